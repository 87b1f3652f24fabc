#!/usr/bin/env bash
# The release binary built with profile-guided optimization: compiled once with
# instrumentation, trained on the three request kinds of the shared perf harness, compiled
# again with the profile (BENCHMARKS.md, decisions).
#
#   rustup component add llvm-tools     # once: llvm-profdata of rustc's own LLVM
#   scripts/build-pgo.sh                # -> target/pgo/idemgate
#   IDEMGATE_TEST_BIN=target/pgo/idemgate cargo nextest run   # the process tests on it
#
# Training: a throwaway PostgreSQL cluster with stock settings (fsync on), an nginx upstream,
# the instrumented gateway on a database of its own (`pool_size: 32`), then TRAIN seconds
# (default 8) each of `wrk -t1 -c32` sending plain requests (`POST /plain/pay`), one key's
# replays (`POST /pay`, one Idempotency-Key) and new keys (a new key in every request); the
# gateway is stopped with SIGTERM, which writes the profile. The binary made with it must pass
# the demo's checks (`idemgate demo`, the lab's checks through it). What the workload never runs
# (TLS, HTTP/2, upgrades, observe mode, error paths) is compiled as cold code: train on a
# workload of your own if that is your traffic. The same source and the same toolchain give
# the same code paths; retrain after changing either (a profile from other code is only
# partly used; one from another LLVM is refused).
#
# Both builds keep their own target directories under target/pgo: a second run rebuilds only
# the crate for training, then every crate with the new profile (about 14 minutes on two cores
# the first time, 10 after a change). Needs wrk, nginx, curl, python3 and the PostgreSQL server
# binaries (PGBIN: the newest /usr/lib/postgresql/*/bin); run as root (the cluster then runs
# as the postgres user) or as a user who may run initdb.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TRAIN=${TRAIN:-8}
PGBIN=${PGBIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
HOST=$(rustc -vV | sed -n 's/^host: //p')
PROFDATA=$(rustc --print sysroot)/lib/rustlib/$HOST/bin/llvm-profdata
[[ -x $PROFDATA ]] || {
  echo "build-pgo.sh: no llvm-profdata for rustc's LLVM; install it: rustup component add llvm-tools" >&2
  exit 2
}
for tool in wrk nginx curl python3; do
  command -v "$tool" >/dev/null || { echo "build-pgo.sh: $tool is missing" >&2; exit 2; }
done
OUT=$ROOT/target/pgo
PROFILES=$OUT/profiles

# --target: RUSTFLAGS then reach only what runs in the binary, not build scripts or macros.
# The profile decides what to inline here, as measured in BENCHMARKS.md.
build() { # target_dir rustflags
  (cd "$ROOT" && RUSTFLAGS=$2 cargo build --release --locked --target "$HOST" \
    --target-dir "$1" --bin idemgate)
}

echo "build-pgo.sh: 1/4 the instrumented build" >&2
rm -rf "$PROFILES"
mkdir -p "$PROFILES"
build "$OUT/generate" "-Cprofile-generate=$PROFILES"
INSTRUMENTED=$OUT/generate/$HOST/release/idemgate

# WORK, psql_q, free_port, start_cluster (sets PORT), stop_cluster: benches/cluster.sh.
# start_upstream, stop_nginx, wait_answering, gateway_store_settings, gateway_routes,
# request_lua, new_keys_lua and BODY: benches/http.sh.
source "$ROOT/benches/cluster.sh"
source "$ROOT/benches/http.sh"
GW=""
cleanup() {
  [[ -z $GW ]] || kill "$GW" 2>/dev/null || true
  stop_nginx
  wait 2>/dev/null || true
  stop_cluster
  rm -rf "$WORK"
}
trap cleanup EXIT

echo "build-pgo.sh: 2/4 training, ${TRAIN}s of each request kind" >&2
start_cluster
UP=$(free_port) STATUS=$(free_port)
start_upstream "$UP" "$STATUS"
wait_answering "$UP" /plain/pay "$WORK"/upstream/error.log
psql_q -c "CREATE DATABASE keys" postgres
LISTEN=$(free_port) ADMIN=$(free_port)
cat >"$WORK/gateway.yaml" <<YAML
listen: 127.0.0.1:$LISTEN
admin: { listen: "127.0.0.1:$ADMIN" }
store:
  postgres:
    url: postgres://postgres@127.0.0.1:$PORT/keys
$(gateway_store_settings)
$(gateway_routes "$UP")
YAML
"$INSTRUMENTED" migrate --config "$WORK/gateway.yaml" >/dev/null
"$INSTRUMENTED" serve --config "$WORK/gateway.yaml" >"$WORK/gateway.log" 2>&1 &
GW=$!
wait_answering "$LISTEN" /plain/pay "$WORK/gateway.log"
request_lua "$WORK/request.lua"
new_keys_lua "$WORK/new_keys.lua"
train() { # what script args...
  local what=$1
  shift
  printf '  %-15s' "$what" >&2
  wrk -t1 -c32 -d"${TRAIN}s" "$@" | sed -n 's/^Requests\/sec: *//p' | sed 's/$/ requests\/s (instrumented)/' >&2
}
train "plain requests" -s "$WORK/request.lua" "http://127.0.0.1:$LISTEN" -- /plain/pay "$BODY" -
train "replays" -s "$WORK/request.lua" "http://127.0.0.1:$LISTEN" -- /pay "$BODY" trained-replay
train "new keys" -s "$WORK/new_keys.lua" "http://127.0.0.1:$LISTEN" -- trained "$BODY"
kill -TERM "$GW"
wait "$GW" || { echo "build-pgo.sh: the instrumented gateway did not stop cleanly; its log:" >&2; tail -20 "$WORK/gateway.log" >&2; exit 1; }
GW=""
# Not needed past the training: stopped now rather than left idle through the optimized build.
stop_nginx
stop_cluster

echo "build-pgo.sh: 3/4 merging the profile" >&2
compgen -G "$PROFILES/*.profraw" >/dev/null || { echo "build-pgo.sh: the gateway wrote no profile" >&2; exit 1; }
"$PROFDATA" merge -o "$WORK/merged.profdata" "$PROFILES"
# Named by its content: cargo does not look into the file a flag names, so a new profile under
# the old name would leave every crate compiled with the old one.
rm -f "$OUT"/idemgate-*.profdata
PROFILE=$OUT/idemgate-$(sha256sum "$WORK/merged.profdata" | cut -c1-16).profdata
mv "$WORK/merged.profdata" "$PROFILE"

echo "build-pgo.sh: 4/4 the optimized build" >&2
build "$OUT/use" "-Cprofile-use=$PROFILE"
# Copied, then renamed into place: a gateway still running the last one keeps its file.
cp "$OUT/use/$HOST/release/idemgate" "$OUT/idemgate.new"
mv -f "$OUT/idemgate.new" "$OUT/idemgate"
# What the profiled binary must still do: the lab's checks through it, as `demo` runs them.
"$OUT/idemgate" demo >"$WORK/demo.log" 2>&1 || {
  echo "build-pgo.sh: the profiled binary failed the demo's checks:" >&2
  cat "$WORK/demo.log" >&2
  exit 1
}
echo "$OUT/idemgate"
