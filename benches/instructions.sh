#!/usr/bin/env bash
# Instructions per request, counted by valgrind's callgrind: a measure of the gateway's own
# user-space work that the noise of a shared machine does not move, for comparing builds
# (BENCHMARKS.md, "Instructions per request").
#
#   cargo build --release && benches/instructions.sh [BIN ...]
#
# For each binary (default target/release/idemgate) and each scenario: starts the gateway
# under callgrind (embedded store, an nginx upstream on a free port), warms it up with WARMUP
# seconds (5) of `wrk -t1 -c8`, zeroes the counters, runs DUR seconds (10), dumps, and
# prints the instructions executed in the gateway's process divided by the requests wrk
# completed. Scenarios: `plain` (`POST /plain/pay` on a route without idempotency: the plain
# hop) and `replay` (`POST /pay` with one Idempotency-Key for the whole run: the first request
# executes, every other one is replayed from memory). The request is the shared perf
# harness's (~200-byte JSON body, Content-Type, X-Account-Id).
#
# Under valgrind SHA-256 runs in its portable code (valgrind does not emulate the CPU's SHA
# instructions), so a replay's three hashes count several times what they cost natively: compare
# replays between builds, not against the plain hop. Needs valgrind, wrk, nginx, python3.
#
# A binary named `hyper_floor` (`cargo build --release --example hyper_floor`) is counted as
# the floor under any hyper-based proxy, in the plain scenario only (it has no keyed route):
#
#   benches/instructions.sh target/release/idemgate target/release/examples/hyper_floor
#
# SCENARIOS (default "plain replay") picks the scenarios; KEEP=DIR keeps each count's callgrind
# output as DIR/<binary's directory>-<binary>-<scenario>.out, for `callgrind_annotate` or for
# comparing two builds function by function.
set -euo pipefail

DUR=${DUR:-10}
WARMUP=${WARMUP:-5}
SCENARIOS=${SCENARIOS:-plain replay}
KEEP=${KEEP:-}
[[ -z $KEEP ]] || mkdir -p "$KEEP"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BINS=("$@")
((${#BINS[@]})) || BINS=("$ROOT/target/release/idemgate")
for tool in valgrind callgrind_control callgrind_annotate wrk nginx python3; do
  command -v "$tool" >/dev/null || { echo "instructions.sh: $tool is missing" >&2; exit 2; }
done
for bin in "${BINS[@]}"; do
  [[ -x $bin ]] || { echo "instructions.sh: no $bin (cargo build --release)" >&2; exit 2; }
done

# WORK, free_port: benches/work.sh. BODY, request_lua, start_answering_upstream (sets UP),
# stop_nginx, GATEWAYS and stop_gateways, cleanup_http, embedded_gateway_config: benches/http.sh.
source "$(dirname "${BASH_SOURCE[0]}")/work.sh"
source "$(dirname "${BASH_SOURCE[0]}")/http.sh"
trap cleanup_http EXIT

start_answering_upstream
request_lua "$WORK/request.lua"

RUN=0
# Counts one binary ($1) in one scenario ($2): sets TOTAL (instructions) and N (requests).
count() { # bin scenario
  local port admin path key out n total
  RUN=$((RUN + 1))
  port=$(free_port) admin=$(free_port)
  case $2 in
    plain) path=/plain/pay key=- ;;
    replay) path=/pay key=replayed-$RUN ;;
  esac
  embedded_gateway_config "$WORK/gateway-$RUN.yaml" "$port" "$admin" "$WORK/store-$RUN"
  out=$WORK/callgrind-$RUN
  local -a cmd=("$1" serve --config "$WORK/gateway-$RUN.yaml")
  [[ $(basename "$1") != hyper_floor ]] || cmd=("$1" "127.0.0.1:$port" "127.0.0.1:$UP")
  valgrind --tool=callgrind --callgrind-out-file="$out.%p" "${cmd[@]}" >"$WORK/gateway-$RUN.log" 2>&1 &
  GW_PID=$!
  GATEWAYS=("$GW_PID")
  for _ in $(seq 600); do
    curl -sf -o /dev/null -X POST "http://127.0.0.1:$port/plain/pay" && break
    sleep 0.1
  done
  wrk -t1 -c8 -d"${WARMUP}s" -s "$WORK/request.lua" "http://127.0.0.1:$port" -- "$path" "$BODY" "$key" >/dev/null
  callgrind_control -z "$GW_PID" >/dev/null 2>&1
  n=$(wrk -t1 -c8 -d"${DUR}s" -s "$WORK/request.lua" "http://127.0.0.1:$port" -- "$path" "$BODY" "$key" |
    sed -n 's/^ *\([0-9]*\) requests in.*/\1/p')
  callgrind_control -d "$GW_PID" >/dev/null 2>&1
  stop_gateways
  total=$(callgrind_annotate "$out".*.1 2>/dev/null | sed -n 's/^ *\([0-9,]*\) .*PROGRAM TOTALS.*/\1/p' | tr -d ,)
  [[ -n $n && -n $total ]] || { echo "instructions.sh: no count for $1 $2; its log:" >&2; tail -20 "$WORK/gateway-$RUN.log" >&2; exit 1; }
  [[ -z $KEEP ]] || cp "$out".*.1 "$KEEP/$(basename "$(dirname "$1")")-$(basename "$1")-$2.out"
  TOTAL=$total N=$n
}

echo "$(valgrind --version); wrk -t1 -c8, ${DUR}s counted after ${WARMUP}s of warm-up"
echo
echo "| binary | scenario | requests | instructions per request |"
echo "|---|---|---:|---:|"
for bin in "${BINS[@]}"; do
  for scenario in $SCENARIOS; do
    [[ $scenario == plain || $(basename "$bin") != hyper_floor ]] || continue
    count "$bin" "$scenario"
    echo "| $bin | $scenario | $N | $((TOTAL / N)) |"
  done
done
