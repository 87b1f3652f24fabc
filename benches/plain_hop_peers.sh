#!/usr/bin/env bash
# What one plain request costs every process on its path, the gateway's hop against nginx's:
# why a gateway that spends 1.3-1.4 times nginx's CPU per plain request runs at 0.7-0.8 of its
# rate (BENCHMARKS.md, "Why 1.34 times the CPU is 0.78 of the rate").
#
#   cargo build --release && benches/plain_hop_peers.sh
#
# Starts, on free ports under a temporary directory: an nginx upstream (one worker, `POST
# /plain/pay` answers 200 `{"ok":true}`, a stub_status listener to count what reached it), an
# nginx proxy in front of it (one worker, keep-alive pool, the X-Forwarded-* headers, as the
# shared perf harness's nginx-proxy), and the gateway (target/release/idemgate, route `plain`,
# the embedded store, which a plain request never touches; WORKERS sets server.worker_threads,
# default the cores available). Then, ROUNDS times, the gateway and the nginx proxy
# alternated, each with one `wrk -t1 -c32` run of DUR seconds (default 10) of which the middle
# DUR-2 are measured: per request, user and system CPU (µs) and context switches of the proxy
# (all its threads), the upstream worker and wrk, from /proc; requests counted by the
# upstream. With FLOOR=1 a third proxy joins the rotation: examples/hyper_floor.rs (nothing but
# hyper on both sides, one upstream connection per client connection; build it first with
# `cargo build --release --example hyper_floor`), the floor under any hyper-based proxy
# (BENCHMARKS.md, "What hyper alone costs"). Needs wrk, nginx and python3 (for free ports);
# run as root or as a user nginx accepts (it drops to www-data only as root).
set -euo pipefail

ROUNDS=${ROUNDS:-3}
DUR=${DUR:-10}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=${BIN:-$ROOT/target/release/idemgate}
for tool in wrk nginx python3; do
  command -v "$tool" >/dev/null || { echo "plain_hop_peers.sh: $tool is missing" >&2; exit 2; }
done
[[ -x $BIN ]] || { echo "plain_hop_peers.sh: no $BIN (cargo build --release)" >&2; exit 2; }
FLOOR_BIN=$ROOT/target/release/examples/hyper_floor
if [[ ${FLOOR:-0} == 1 && ! -x $FLOOR_BIN ]]; then
  echo "plain_hop_peers.sh: no $FLOOR_BIN (cargo build --release --example hyper_floor)" >&2
  exit 2
fi
((DUR >= 4)) || { echo "plain_hop_peers.sh: DUR must be at least 4" >&2; exit 2; }

# WORK, HZ, free_port: benches/work.sh. BODY, request_lua, start_upstream, start_proxy,
# stop_nginx, served, worker_of, wait_answering, embedded_gateway_config: benches/http.sh.
source "$(dirname "${BASH_SOURCE[0]}")/work.sh"
source "$(dirname "${BASH_SOURCE[0]}")/http.sh"
GW_PID="" FLOOR_PID=""
cleanup() {
  [[ -n $GW_PID ]] && kill "$GW_PID" 2>/dev/null
  if [[ -n $FLOOR_PID ]]; then kill "$FLOOR_PID" 2>/dev/null; fi
  stop_nginx
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

UP=$(free_port) STATUS=$(free_port) PROXY=$(free_port) GW=$(free_port) ADMIN=$(free_port)
start_upstream "$UP" "$STATUS"
start_proxy "$PROXY" "$UP"

WORKERS_LINE=""
[[ -n ${WORKERS:-} ]] && WORKERS_LINE="server: { worker_threads: $WORKERS }"
embedded_gateway_config "$WORK/gateway.yaml" "$GW" "$ADMIN" "$WORK/store" "$WORKERS_LINE"
"$BIN" serve --config "$WORK/gateway.yaml" >"$WORK/gateway.log" 2>&1 &
GW_PID=$!
if [[ ${FLOOR:-0} == 1 ]]; then
  FLOOR_PORT=$(free_port)
  "$FLOOR_BIN" "127.0.0.1:$FLOOR_PORT" "127.0.0.1:$UP" >"$WORK/floor.log" 2>&1 &
  FLOOR_PID=$!
fi

request_lua "$WORK/request.lua"

wait_answering "$PROXY" /plain/pay "$WORK"/*/error.log
wait_answering "$GW" /plain/pay "$WORK/gateway.log"
if [[ -n $FLOOR_PID ]]; then wait_answering "$FLOOR_PORT" /plain/pay "$WORK/floor.log"; fi
UPW=$(worker_of "${NGINX_MASTERS[0]}")
PXW=$(worker_of "${NGINX_MASTERS[1]}")

# "user system switches" of a process, all threads: ticks and context switches.
sample() {
  local pid=$1 line sw
  read -r line <"/proc/$pid/stat"
  line=${line##*) }
  sw=$(cat /proc/"$pid"/task/*/status | awk '/^(non)?voluntary_ctxt_switches/ { s += $2 } END { print s }')
  set -- $line
  echo "${12} ${13} $sw"
}

# One measured run: $1 label, $2 port, $3 proxy pid.
run() {
  local wrk_pid a u w b u2 w2 n0 n1 n
  wrk -t1 -c32 -d"${DUR}s" -s "$WORK/request.lua" "http://127.0.0.1:$2" -- /plain/pay "$BODY" - >"$WORK/wrk.out" &
  wrk_pid=$!
  sleep 1
  a=$(sample "$3") u=$(sample "$UPW") w=$(sample "$wrk_pid") n0=$(served "$STATUS")
  sleep $((DUR - 2))
  b=$(sample "$3") u2=$(sample "$UPW") w2=$(sample "$wrk_pid") n1=$(served "$STATUS")
  wait "$wrk_pid"
  n=$((n1 - n0 - 1)) # the status request itself is counted
  python3 - "$1" "$n" "$((DUR - 2))" "$HZ" "$a" "$b" "$u" "$u2" "$w" "$w2" <<'PY'
import sys
label, n, secs, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cells, total = [], 0.0
for before, after in zip(sys.argv[5::2], sys.argv[6::2]):
    b, a = [int(x) for x in before.split()], [int(x) for x in after.split()]
    usr, sys_ = ((a[i] - b[i]) * 1e6 / hz / n for i in (0, 1))
    total += usr + sys_
    cells.append(f"{usr:.1f} / {sys_:.1f} | {(a[2] - b[2]) / n:.2f}")
print(f"| {label} | {n // secs:,} | " + " | ".join(cells) + f" | {total:.1f} |")
PY
}

echo "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'); $(nginx -v 2>&1); wrk -t1 -c32, ${DUR}s runs, the middle $((DUR - 2))s measured; per request"
echo
echo "| run | requests/s | proxy user / sys, µs | proxy switches | upstream user / sys, µs | upstream switches | wrk user / sys, µs | wrk switches | all three, µs |"
echo "|---|---:|---|---:|---|---:|---|---:|---:|"
for _ in $(seq "$ROUNDS"); do
  run "gateway${WORKERS:+, $WORKERS worker(s)}" "$GW" "$GW_PID"
  run "nginx proxy" "$PROXY" "$PXW"
  if [[ -n $FLOOR_PID ]]; then run "hyper floor" "$FLOOR_PORT" "$FLOOR_PID"; fi
done
