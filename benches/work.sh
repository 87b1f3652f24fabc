# Sourced by every benchmark script that starts servers: a work directory (WORK) removed at
# exit, the clock tick for /proc times (HZ), and free_port. A script (or cluster.sh) that
# starts more redefines cleanup, keeping the `rm -rf "$WORK"`.
WORK=$(mktemp -d)
chmod 755 "$WORK"
HZ=$(getconf CLK_TCK)
cleanup() {
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
