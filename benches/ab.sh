#!/usr/bin/env bash
# Two gateways measured by turns: A and B side by side, and short wrk runs that alternate
# between them, so that a noisy machine's slow minutes fall on both sides. A and B may be two
# builds, two settings, or both (BENCHMARKS.md, "Method"; benches/README.md).
#
#   benches/ab.sh BIN_A [BIN_B]      # BIN_B: BIN_A
#
# LINE_A and LINE_B (default none) are a YAML line each added to that gateway's config, as in
# LINE_A='server: { worker_threads: 1 }'; NAME_A and NAME_B (default A and B) label them.
# Both gateways use the embedded store, one nginx upstream on a free port and the benchmark
# routes. For each scenario of SCENARIOS ("replay plain"): ROUNDS (10) pairs of
# `wrk -t1 -c$CONNS` runs (CONNS 32) of RUN_SECONDS (5) each, one against each gateway, the
# order swapped every pair: replays (`POST /pay`, one Idempotency-Key) or plain requests
# (`POST /plain/pay`). Per run it counts the requests the gateway answered (its
# `idemgate_requests_total`), its CPU time per request, how often its threads slept
# (voluntary context switches) and the machine's steal time (/proc/stat). It prints every
# run, and the median over the pairs with at most STEAL (3) percent steal in both runs of
# A's rate and CPU per request divided by B's; at the end, for builds that count them, how
# often each gateway's yields paused (`idemgate_yield_pauses_total`).
#
# With HOGS=N (default 0), N busy loops run beside the gateways the whole time; use it with
# CONNS=4 to see what a change costs when a neighbour takes whole slices (the runs also
# print wrk's latency percentiles).
#
# Needs wrk, nginx, curl and python3.
set -euo pipefail

SCENARIOS=${SCENARIOS:-replay plain}
ROUNDS=${ROUNDS:-10}
SECONDS_PER_RUN=${RUN_SECONDS:-5}
CONNS=${CONNS:-32}
STEAL=${STEAL:-3}
HOGS=${HOGS:-0}
(($# >= 1 && $# <= 2)) || { echo "usage: benches/ab.sh BIN_A [BIN_B]" >&2; exit 2; }
BINS=("$1" "${2:-$1}") LINES=("${LINE_A:-}" "${LINE_B:-}") NAMES="${NAME_A:-A} ${NAME_B:-B}"
NAMES_ARR=("${NAME_A:-A}" "${NAME_B:-B}")
for tool in wrk nginx curl python3; do
  command -v "$tool" >/dev/null || { echo "ab.sh: $tool is missing" >&2; exit 2; }
done
for bin in "${BINS[@]}"; do
  [[ -x $bin ]] || { echo "ab.sh: no $bin (cargo build --release)" >&2; exit 2; }
done

# WORK, free_port: benches/work.sh. BODY, request_lua, start_answering_upstream (sets UP),
# GATEWAYS and stop_gateways, wait_answering, cleanup_http, embedded_gateway_config,
# scenario_request: benches/http.sh.
source "$(dirname "${BASH_SOURCE[0]}")/work.sh"
source "$(dirname "${BASH_SOURCE[0]}")/http.sh"
HOG_PIDS=()
cleanup() {
  for p in "${HOG_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  cleanup_http
}
trap cleanup EXIT

start_answering_upstream
request_lua "$WORK/request.lua"
PORTS=() ADMINS=()
for side in 0 1; do
  port=$(free_port) admin=$(free_port)
  embedded_gateway_config "$WORK/gateway-$side.yaml" "$port" "$admin" "$WORK/store-$side" \
    "${LINES[$side]}"
  "${BINS[$side]}" serve --config "$WORK/gateway-$side.yaml" >"$WORK/gateway-$side.log" 2>&1 &
  GATEWAYS+=($!)
  wait_answering "$port" /plain/pay "$WORK/gateway-$side.log"
  PORTS+=("$port") ADMINS+=("$admin")
done
for _ in $(seq "$HOGS"); do
  sh -c 'while :; do :; done' &
  HOG_PIDS+=($!)
done

for scenario in $SCENARIOS; do
  scenario_request "$scenario" ab.sh
  path=$PATH_ key=$KEY
  echo "## $scenario (wrk -t1 -c$CONNS, ${SECONDS_PER_RUN}s runs, $HOGS busy loops beside)"
  python3 - "$scenario" "$path" "$key" "$BODY" "$WORK/request.lua" "$ROUNDS" "$SECONDS_PER_RUN" \
    "$CONNS" "$STEAL" "${GATEWAYS[*]}" "${PORTS[*]}" "${ADMINS[*]}" "$NAMES" <<'PY'
import os, re, statistics, subprocess, sys, urllib.request

(scenario, path, key, body, lua, rounds, seconds, conns, max_steal,
 pids, ports, admins, names) = sys.argv[1:]
rounds, seconds, max_steal = int(rounds), int(seconds), float(max_steal)
pids, ports, admins = pids.split(), ports.split(), admins.split()
NAMES = tuple(names.split())
hz = os.sysconf("SC_CLK_TCK")

def steal_ticks():  # busy+idle, steal ticks of all cpus
    f = list(map(int, open("/proc/stat").readline().split()[1:]))
    return sum(f[:8]), f[7]

def gateway(pid):  # cpu ticks, voluntary context switches
    ticks = slept = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        ticks += int(stat[11]) + int(stat[12])
        for line in open(f"/proc/{pid}/task/{tid}/status"):
            if line.startswith("voluntary_ctxt_switches"):
                slept += int(line.split()[1])
    return ticks, slept

def answered(admin):
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics").read().decode()
    return sum(float(l.split()[-1]) for l in text.splitlines()
               if l.startswith("idemgate_requests_total{"))

def run(which):
    n0, (t0, s0), (c0, v0) = answered(admins[which]), steal_ticks(), gateway(pids[which])
    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", lua,
                          f"http://127.0.0.1:{ports[which]}", "--", path, body, key],
                         check=True, capture_output=True, text=True).stdout
    n1, (t1, s1), (c1, v1) = answered(admins[which]), steal_ticks(), gateway(pids[which])
    for line in out.splitlines():  # the rate counts every answer: say when some were errors
        if "Non-2xx" in line or "Socket errors" in line:
            print(f"{NAMES[which]:>8}: wrk: {line.strip()}", flush=True)
    requests = max(n1 - n0, 1)
    pct = dict(re.findall(r"^\s+(50|90|99)%\s+(\S+)", out, re.M))
    return {"rate": requests / seconds, "cpu": (c1 - c0) / hz * 1e6 / requests,
            "sleeps": (v1 - v0) / requests, "steal": 100 * (s1 - s0) / max(t1 - t0, 1),
            "p50": pct.get("50", "?"), "p90": pct.get("90", "?"), "p99": pct.get("99", "?")}

pairs = []
for r in range(rounds):
    order = (0, 1) if r % 2 == 0 else (1, 0)
    got = {}
    for which in order:
        got[which] = run(which)
        g = got[which]
        print(f"{NAMES[which]:>8}: {g['rate']:7.0f}/s {g['cpu']:5.1f} us/req "
              f"{g['sleeps']:.3f} sleeps/req {g['steal']:4.1f}% steal "
              f"p50 {g['p50']} p90 {g['p90']} p99 {g['p99']}", flush=True)
    pairs.append((got[0], got[1]))

clean = [(a, b) for a, b in pairs if a["steal"] <= max_steal and b["steal"] <= max_steal]
print(f"{len(clean)} of {len(pairs)} pairs with at most {max_steal:g}% steal in both runs")
if clean:
    rate = statistics.median(a["rate"] / b["rate"] for a, b in clean)
    cpu = statistics.median(a["cpu"] / b["cpu"] for a, b in clean)
    won = sum(a["rate"] > b["rate"] for a, b in clean)
    print(f"{NAMES[0]} / {NAMES[1]}, median over those pairs: rate {rate:.3f} (higher in {won} of "
          f"{len(clean)}), gateway CPU per request {cpu:.3f}")
    for which, name in enumerate(NAMES):
        sleeps = statistics.median(p[which]["sleeps"] for p in clean)
        print(f"{name}: the gateway's threads slept {sleeps:.3f} times per request (median)")
PY
done
# How often each gateway's yields paused (a build without the counter prints nothing).
for side in 0 1; do
  pauses=$(curl -s "http://127.0.0.1:${ADMINS[$side]}/metrics" | awk '$1 == "idemgate_yield_pauses_total" { print $2 }')
  [[ -z $pauses ]] || echo "${NAMES_ARR[$side]}: yielding paused $pauses times over the whole run"
done
