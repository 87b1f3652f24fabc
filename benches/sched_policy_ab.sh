#!/usr/bin/env bash
# The gateway's threads under SCHED_OTHER (Linux's default) against SCHED_BATCH, measured by
# turns inside one run, so that a noisy machine's slow minutes fall on both sides
# (BENCHMARKS.md, "under SCHED_BATCH").
#
#   cargo build --release && benches/sched_policy_ab.sh [BIN]     # BIN: target/release/idemgate
#
# For each scenario of SCENARIOS ("replay plain"): starts one gateway (the embedded store, an
# nginx upstream on a free port, the benchmark routes) and one `wrk -t1 -c32` of DURATION
# seconds (120) against it: replays (`POST /pay`, one Idempotency-Key) or plain requests
# (`POST /plain/pay`). Meanwhile, window after window, it sets every thread of the gateway to
# one policy and then the other (`chrt`), lets 0.3 s pass, and counts over the next 1.7 s the
# requests the gateway answered (its `idemgate_requests_total`), its CPU time per request, how
# often its threads slept (voluntary context switches), and the machine's busy and steal time
# (/proc/stat). A window and the next one are a pair; a pair where either window had more than
# STEAL (3) percent steal is left out. It prints, per scenario, the median over the pairs of
# SCHED_BATCH's rate and CPU per request divided by SCHED_OTHER's, each policy's sleeps per
# request, and every window.
#
# With HOGS=N (default 0), N busy loops run beside the gateway the whole time, and instead of
# windows each scenario gets ROUNDS (3) pairs of separate `wrk -t1 -c$CONNS` runs (CONNS 4) of
# 6 s, one per policy, and their requests per second and latency percentiles: what a woken
# thread that waits for the tick instead of preempting costs when the cores are contended.
#
# Needs wrk, nginx, curl, chrt and python3.
set -euo pipefail

DURATION=${DURATION:-120}
SCENARIOS=${SCENARIOS:-replay plain}
STEAL=${STEAL:-3}
HOGS=${HOGS:-0}
ROUNDS=${ROUNDS:-3}
CONNS=${CONNS:-4}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=${1:-$ROOT/target/release/idemgate}
for tool in wrk nginx curl chrt python3; do
  command -v "$tool" >/dev/null || { echo "sched_policy_ab.sh: $tool is missing" >&2; exit 2; }
done
[[ -x $BIN ]] || { echo "sched_policy_ab.sh: no $BIN (cargo build --release)" >&2; exit 2; }

# WORK, free_port: benches/work.sh. BODY, request_lua, start_answering_upstream (sets UP),
# GATEWAYS and stop_gateways, wait_answering, cleanup_http, embedded_gateway_config,
# scenario_request: benches/http.sh.
source "$(dirname "${BASH_SOURCE[0]}")/work.sh"
source "$(dirname "${BASH_SOURCE[0]}")/http.sh"
WRK=""
HOG_PIDS=()
cleanup() {
  [[ -z $WRK ]] || kill "$WRK" 2>/dev/null || true
  for p in "${HOG_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  cleanup_http
}
trap cleanup EXIT

start_answering_upstream
request_lua "$WORK/request.lua"
for _ in $(seq "$HOGS"); do
  sh -c 'while :; do :; done' &
  HOG_PIDS+=($!)
done

# Sets every thread of process $1 to the policy of chrt's flag $2 (-o, -b).
set_policy() { # pid flag
  local t
  for t in /proc/"$1"/task/*; do chrt "$2" -p 0 "${t##*/}" >/dev/null; done
}

# With HOGS: ROUNDS pairs of wrk runs on port $1, path $2, key $3, one per policy.
latency_pairs() { # port path key
  local round flag name out
  for round in $(seq "$ROUNDS"); do
    for flag in -o -b; do
      set_policy "${GATEWAYS[0]}" "$flag"
      name=SCHED_OTHER
      [[ $flag == -b ]] && name=SCHED_BATCH
      out=$(wrk -t1 -c"$CONNS" -d6s --latency -s "$WORK/request.lua" "http://127.0.0.1:$1" -- "$2" "$BODY" "$3")
      echo "$name: $(echo "$out" | awk '/Requests\/sec/ {r = $2} / 50%/ {a = $2} / 90%/ {b = $2} / 99%/ {c = $2}
        END {printf "%.0f requests/s, p50 %s, p90 %s, p99 %s", r, a, b, c}')"
    done
  done
}

for scenario in $SCENARIOS; do
  scenario_request "$scenario" sched_policy_ab.sh
  path=$PATH_ key=$KEY
  port=$(free_port) admin=$(free_port)
  embedded_gateway_config "$WORK/gateway-$scenario.yaml" "$port" "$admin" "$WORK/store-$scenario"
  "$BIN" serve --config "$WORK/gateway-$scenario.yaml" >"$WORK/gateway-$scenario.log" 2>&1 &
  GATEWAYS=($!)
  wait_answering "$port" /plain/pay "$WORK/gateway-$scenario.log"
  echo "## $scenario"
  if ((HOGS > 0)); then
    echo "$HOGS busy loops beside, wrk -t1 -c$CONNS"
    latency_pairs "$port" "$path" "$key"
    stop_gateways
    continue
  fi
  wrk -t1 -c32 -d"$((DURATION + 4))s" -s "$WORK/request.lua" \
    "http://127.0.0.1:$port" -- "$path" "$BODY" "$key" >/dev/null &
  WRK=$!
  sleep 2
  python3 - "${GATEWAYS[0]}" "$admin" "$DURATION" "$STEAL" <<'PY'
import os, statistics, subprocess, sys, time, urllib.request

pid, admin, seconds, max_steal = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
hz = os.sysconf("SC_CLK_TCK")
POLICIES = (("SCHED_OTHER", "-o"), ("SCHED_BATCH", "-b"))

def threads():
    return os.listdir(f"/proc/{pid}/task")

def set_policy(flag):
    for tid in threads():
        subprocess.run(["chrt", flag, "-p", "0", tid], check=True, stdout=subprocess.DEVNULL)

def machine():  # busy, idle, steal ticks of all cpus
    f = list(map(int, open("/proc/stat").readline().split()[1:]))
    return f[0] + f[1] + f[2] + f[5] + f[6], f[3] + f[4], f[7]

def gateway_ticks():
    total = 0
    for tid in threads():
        stat = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        total += int(stat[11]) + int(stat[12])
    return total

def slept():  # voluntary context switches: a thread that ran out of work and slept
    total = 0
    for tid in threads():
        for line in open(f"/proc/{pid}/task/{tid}/status"):
            if line.startswith("voluntary_ctxt_switches"):
                total += int(line.split()[1])
    return total

def answered():
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics").read().decode()
    return sum(float(l.split()[-1]) for l in text.splitlines()
               if l.startswith("idemgate_requests_total{"))

windows = []  # (policy index, rate, cpu µs per request, busy %, steal %, sleeps per request)
end = time.time() + seconds
while time.time() < end:
    which = len(windows) % 2
    set_policy(POLICIES[which][1])
    time.sleep(0.3)
    n0, m0, c0, v0, t0 = answered(), machine(), gateway_ticks(), slept(), time.time()
    time.sleep(1.7)
    n1, m1, c1, v1, t1 = answered(), machine(), gateway_ticks(), slept(), time.time()
    d = [b - a for a, b in zip(m0, m1)]
    requests = max(n1 - n0, 1)
    windows.append((which, requests / (t1 - t0), (c1 - c0) / hz * 1e6 / requests,
                    100 * d[0] / sum(d), 100 * d[2] / sum(d), (v1 - v0) / requests))

pairs = [(a, b) for a, b in zip(windows[::2], windows[1::2])
         if a[4] <= max_steal and b[4] <= max_steal]
print(f"{len(windows) // 2} pairs of 2 s windows, {len(pairs)} with at most {max_steal:g}% steal in both")
if pairs:
    rate = statistics.median(b[1] / a[1] for a, b in pairs)
    cpu = statistics.median(b[2] / a[2] for a, b in pairs)
    won = sum(b[1] > a[1] for a, b in pairs)
    print(f"SCHED_BATCH / SCHED_OTHER, median over those pairs: rate {rate:.3f} "
          f"(higher in {won} of {len(pairs)}), gateway CPU per request {cpu:.3f}")
    for which, name in enumerate(p[0] for p in POLICIES):
        sleeps = statistics.median((a, b)[which][5] for a, b in pairs)
        print(f"{name}: the gateway's threads slept {sleeps:.3f} times per request (median)")
for which, name in enumerate(p[0] for p in POLICIES):
    mine = [w for w in windows if w[0] == which]
    print(f"{name}: " + " ".join(f"{w[1] / 1000:.0f}k/{w[2]:.1f}us/{w[3]:.0f}%busy/{w[4]:.0f}%steal"
                                 for w in mine))
PY
  kill "$WRK" 2>/dev/null || true
  wait "$WRK" 2>/dev/null || true
  WRK=""
  stop_gateways
done
