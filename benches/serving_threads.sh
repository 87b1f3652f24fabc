#!/usr/bin/env bash
# What a replay and a plain request cost one gateway by its number of serving threads: CPU and
# context switches per request, summed over the gateway's threads (BENCHMARKS.md, "Before that:
# the profile-guided build on a thread per core, and one serving thread or two").
#
#   cargo build --release && benches/serving_threads.sh [BIN]     # BIN: target/release/idemgate
#
# For THREADS (default "2 1") in turn, starts the gateway with `server.worker_threads` set to
# it (the embedded store, an nginx upstream on a free port, the benchmark routes), then ROUNDS
# (3) times: replays (`POST /pay`, one Idempotency-Key per round) and plain requests (`POST
# /plain/pay`), each `wrk -t1 -c32` for DUR seconds (8) after 2 s of warm-up, and prints per
# request the gateway's user and system CPU (µs, from /proc) and its voluntary and involuntary
# context switches. A voluntary switch is a thread that ran out of work and slept. Needs wrk,
# nginx, curl and python3.
set -euo pipefail

ROUNDS=${ROUNDS:-3}
DUR=${DUR:-8}
THREADS=${THREADS:-2 1}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=${1:-$ROOT/target/release/idemgate}
for tool in wrk nginx curl python3; do
  command -v "$tool" >/dev/null || { echo "serving_threads.sh: $tool is missing" >&2; exit 2; }
done
[[ -x $BIN ]] || { echo "serving_threads.sh: no $BIN (cargo build --release)" >&2; exit 2; }

# WORK, HZ, free_port: benches/work.sh. BODY, request_lua, start_answering_upstream (sets
# UP), GATEWAYS, wait_answering, cleanup_http, embedded_gateway_config: benches/http.sh.
source "$(dirname "${BASH_SOURCE[0]}")/work.sh"
source "$(dirname "${BASH_SOURCE[0]}")/http.sh"
trap cleanup_http EXIT

start_answering_upstream
request_lua "$WORK/request.lua"

# The gateway's user and system ticks (its stat counts all its threads) and its threads'
# voluntary and involuntary context switches.
snapshot() {
  local ticks
  ticks=$(awk '{ print $14, $15 }' /proc/"$GW_PID"/stat)
  echo "$ticks $(cat /proc/"$GW_PID"/task/*/status |
    awk '/^voluntary_ctxt_switches/ { v += $2 } /^nonvoluntary_ctxt_switches/ { n += $2 } END { print v, n }')"
}

echo "wrk -t1 -c32, ${DUR}s after 2s of warm-up; per request, the gateway's threads summed"
echo
echo "| serving threads | round | request | requests/s | user µs | system µs | voluntary switches | involuntary switches |"
echo "|---:|---:|---|---:|---:|---:|---:|---:|"
for threads in $THREADS; do
  port=$(free_port) admin=$(free_port)
  embedded_gateway_config "$WORK/gateway-$threads.yaml" "$port" "$admin" "$WORK/store-$threads" \
    "server: { worker_threads: $threads }"
  "$BIN" serve --config "$WORK/gateway-$threads.yaml" >"$WORK/gateway-$threads.log" 2>&1 &
  GW_PID=$!
  GATEWAYS=("$GW_PID")
  wait_answering "$port" /plain/pay "$WORK/gateway-$threads.log"
  for round in $(seq "$ROUNDS"); do
    for kind in replay plain; do
      case $kind in
        replay) path=/pay key=replayed-$threads-$round ;;
        plain) path=/plain/pay key=- ;;
      esac
      wrk -t1 -c32 -d2s -s "$WORK/request.lua" "http://127.0.0.1:$port" -- "$path" "$BODY" "$key" >/dev/null
      read -r u0 s0 v0 n0 < <(snapshot)
      n=$(wrk -t1 -c32 -d"${DUR}s" -s "$WORK/request.lua" "http://127.0.0.1:$port" -- "$path" "$BODY" "$key" |
        sed -n 's/^ *\([0-9]*\) requests in.*/\1/p')
      read -r u1 s1 v1 n1 < <(snapshot)
      [[ -n $n && $n -gt 0 ]] || { echo "serving_threads.sh: wrk completed nothing; the gateway's log:" >&2; tail -20 "$WORK/gateway-$threads.log" >&2; exit 1; }
      python3 -c "
n, hz = $n, $HZ
print(f'| $threads | $round | $kind | {n / $DUR:.0f} | {($u1 - $u0) / hz * 1e6 / n:.2f} | {($s1 - $s0) / hz * 1e6 / n:.2f} | {($v1 - $v0) / n:.3f} | {($n1 - $n0) / n:.3f} |')"
    done
  done
  stop_gateways
done
