#!/usr/bin/env python3
"""What each process cost per request in each round of the shared perf harness, and where
the machine's CPU went: a sampler to run beside `perf/run.sh`, then a report of its windows
(BENCHMARKS.md, "Why one round is slower than another").

    python3 benches/round_costs.py sample costs.jsonl &  SAMPLER=$!
    ../shared/perf/run.sh --bin target/release/idemgate \
        --scenarios direct,nginx-proxy,gw-passthrough --rounds 5 --out run.md 2> run.log
    kill $SAMPLER
    python3 benches/round_costs.py report costs.jsonl run.log run.md [SCENARIO,...]

`sample` writes a line every half second: the machine's CPU counters (/proc/stat) and, for
every thread of every process named idemgate, nginx or wrk, its user and system ticks, its
voluntary and involuntary context switches and the CPU it last ran on. Reading /proc costs
the sampler about 1% of a core; leave it out of runs of record.

With benches/cache_probe.c running beside any number of harness runs instead:

    cc -O2 -o target/cache_probe benches/cache_probe.c
    target/cache_probe > probe.txt &  PROBE=$!
    ../shared/perf/run.sh --bin target/release/idemgate --rounds 3 --out run1.md 2> run1.log
    ...
    kill $PROBE
    python3 benches/round_costs.py probe probe.txt run1.log run1.md [run2.log run2.md ...]

`probe` prints each row's median chase time (the latency of the shared caches and memory
while the row was measured), then, per scenario over the rows with at most 2% steal, how its
server CPU per request follows the chase time (slope and correlation of their logarithms),
and the gateway's ratios (plain hop, replays, new keys) that those fits give at the same chase time:
the two sides of a ratio compared on a machine in the same state.

`budget` reads only the results of any number of runs and asks, round by round, whether the
replays' ratio to the plain hop is lost to CPU or to idle time:

    python3 benches/round_costs.py budget run1.md [run2.md ...]

For gw-passthrough and gw-replay it prints the machine's CPU per request (the server's CPU
per request plus the load generator's: both share the two cores) and how busy the cores were.
The ratio of those costs is the replay ratio the round would show if both rows kept the
machine equally busy; the difference from the measured ratio is the idle time's share.

`ratios` gives each run's four ratios again from the medians of only the rows with at most
2% steal (a row the hypervisor slowed can move a median either way):

    python3 benches/round_costs.py ratios run1.md [run2.md ...]

`report` takes each measured window from the harness's log (a scenario's start plus its
2 s warm-up, to its end 10 s later; the defaults of run.sh) and its requests per second from
the results' per-round rows, and prints per request: each busy thread's CPU (µs) and
switches (the process id tells the harness's two nginx apart: the upstream is the one in
every scenario), and the machine's time by kind (user, system, softirq, idle, steal; percent
of all CPUs, 200% on two). Softirq is mostly the loopback's receive work, done in the
sender's system call; a kernel that counts CPU by the tick (no IRQ_TIME_ACCOUNTING) charges it
to whichever thread was running as well, so the threads' sum is about user + system + softirq.
"""

import collections
import datetime
import json
import math
import os
import re
import statistics
import sys
import time

KINDS = ["user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"]
NAMES = ("idemgate", "nginx", "wrk")


def comm_and_fields(stat):
    return stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()


def sample(out_path):
    with open(out_path, "w") as out:
        while True:
            rec = {"t": round(time.time(), 2)}
            with open("/proc/stat") as f:
                rec["stat"] = [int(x) for x in f.readline().split()[1:9]]
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        comm, _ = comm_and_fields(f.read())
                    if comm not in NAMES:
                        continue
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        with open(f"/proc/{pid}/task/{tid}/stat") as f:
                            tcomm, fields = comm_and_fields(f.read())
                        vol = invol = 0
                        with open(f"/proc/{pid}/task/{tid}/status") as f:
                            for line in f:
                                if line.startswith("voluntary_ctxt"):
                                    vol = int(line.split()[1])
                                elif line.startswith("nonvoluntary_ctxt"):
                                    invol = int(line.split()[1])
                        rec[f"{comm}:{pid}:{tcomm}:{tid}"] = [
                            int(fields[11]),
                            int(fields[12]),
                            vol,
                            invol,
                            int(fields[36]),
                        ]
                except (OSError, ValueError, IndexError):
                    pass  # a process or thread that ended between listing and reading
            out.write(json.dumps(rec) + "\n")
            out.flush()
            time.sleep(0.5)


def report(samples_path, log_path, results_path, wanted):
    with open(samples_path) as f:
        samples = [json.loads(line) for line in f]
    if not samples:
        sys.exit("round_costs.py: no samples")
    hz = os.sysconf("SC_CLK_TCK")
    ncpu = os.cpu_count() or 1
    for scenario, rnd, start, rate, _, _ in rounds_of(log_path, results_path):
        if scenario not in wanted:
            continue
        window = [s for s in samples if start + 2.5 <= s["t"] <= start + 12.0]
        if len(window) < 2:
            continue
        a, b = window[0], window[-1]
        machine = "n/a"
        if "stat" in a and "stat" in b:
            kinds = [y - x for x, y in zip(a["stat"], b["stat"])]
            total = sum(kinds) or 1
            machine = " ".join(
                f"{k} {100 * ncpu * v / total:.0f}%"
                for k, v in zip(KINDS, kinds)
                if k in ("user", "system", "softirq", "idle", "steal")
            )
        print(f"{scenario} round {rnd}: {rate} requests/s; machine: {machine}")
        for key in sorted(k for k in b if k not in ("t", "stat")):
            first = next((s for s in window if key in s), None)
            if first is None or first is b:
                continue
            comm, pid, tcomm, tid = key.split(":")
            ticks, vol, invol = (
                b[key][0] + b[key][1] - first[key][0] - first[key][1],
                b[key][2] - first[key][2],
                b[key][3] - first[key][3],
            )
            requests = rate * (b["t"] - first["t"])
            if ticks < 10 or requests <= 0:
                continue
            print(
                f"  {comm:8} {pid:>7} {tcomm:16} {1e6 * ticks / hz / requests:5.1f} us/request"
                f"  switches: {vol / requests:.3f} voluntary, {invol / requests:.3f} involuntary"
            )


Row = collections.namedtuple("Row", "rate cpu client busy steal")


def per_round(results_path):
    """The results' per-round rows: {(scenario, round): Row}, where cpu is the server CPU per
    request (us), client the load generator's CPU (% of a core), busy the cores' mean busy %."""
    rows = {}
    with open(results_path) as f:
        for line in f:
            cells = [c.strip() for c in line.split("|")]
            if len(cells) > 15 and re.fullmatch(r"\d+", cells[2]) and re.fullmatch(r"\d+", cells[3]):
                try:
                    rows[(cells[1], int(cells[2]))] = Row(
                        int(cells[3]),
                        float(cells[9]),
                        float(cells[10]),
                        (float(cells[11]) + float(cells[12])) / 2,
                        float(cells[14]),
                    )
                except ValueError:
                    pass  # an n/a row
    return rows


def rounds_of(log_path, results_path):
    """(scenario, round, window start, requests/s, server CPU us/request, steal %) per row."""
    with open(log_path) as f:
        log = f.read()
    with open(results_path) as f:
        results = f.read()
    rows = {k: (r.rate, r.cpu, r.steal) for k, r in per_round(results_path).items()}
    when = re.search(r"when: (\d{4}-\d\d-\d\d) ", results)
    day = datetime.date.fromisoformat(when.group(1))
    for m in re.finditer(r"\[perf (\d\d:\d\d:\d\d)\] round (\d+)/\d+: (\S+)", log):
        scenario, rnd = m.group(3), int(m.group(2))
        if (scenario, rnd) in rows:
            start = datetime.datetime.combine(
                day, datetime.time.fromisoformat(m.group(1)), datetime.timezone.utc
            ).timestamp()
            yield (scenario, rnd, start) + rows[(scenario, rnd)]


def fit(points):
    """Least squares of ln y on ln x: (slope, correlation, y at x)."""
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    syy = sum((y - my) ** 2 for y in ys)
    slope = sxy / sxx
    return slope, sxy / math.sqrt(sxx * syy), lambda x: math.exp(my + slope * (math.log(x) - mx))


def probe(probe_path, runs, max_steal=2.0):
    """Each row's median chase time from benches/cache_probe.c, and per scenario how its
    server CPU per request follows it; then the gateway's ratios at matched chase times."""
    with open(probe_path) as f:
        samples = [tuple(map(float, line.split())) for line in f if len(line.split()) == 3]
    points = {}
    for log_path, results_path in runs:
        for scenario, rnd, start, rate, cpu, steal in rounds_of(log_path, results_path):
            window = [s for s in samples if start + 2.5 <= s[0] <= start + 12.0]
            if len(window) < 5:
                continue
            alu = statistics.median(s[1] for s in window) / 1e3
            chase = statistics.median(s[2] for s in window) / 1e3
            print(
                f"{results_path} {scenario:15} round {rnd}: {rate:6d} requests/s,"
                f" {cpu:5.1f} us/request, steal {steal:4.1f}%, chase {chase:5.0f} us"
            )
            if steal <= max_steal:
                points.setdefault(scenario, []).append((chase, rate, cpu, alu))
    print(f"rows with steal <= {max_steal}%: server CPU per request against the chase time (ln-ln)")
    fits = {}
    for scenario, pts in points.items():
        if len(pts) < 4:
            continue
        slope, r, _ = fit([(c, cpu) for c, _, cpu, _ in pts])
        r_alu = fit([(a, cpu) for _, _, cpu, a in pts])[1]
        chases = [c for c, _, _, _ in pts]
        print(
            f"  {scenario:15} {len(pts):3d} rows: slope {slope:.2f}, correlation {r:.2f},"
            f" chase {min(chases):.0f}-{max(chases):.0f} us (correlation with alu {r_alu:.2f})"
        )
        fits[scenario] = (
            fit([(c, rate) for c, rate, _, _ in pts])[2],
            fit([(c, cpu) for c, _, cpu, _ in pts])[2],
        )
    if all(s in fits for s in ("nginx-proxy", "gw-passthrough")):
        every = sorted(p[0] for pts in points.values() for p in pts)
        for q in (0.1, 0.5, 0.9):
            c = every[int(q * (len(every) - 1))]
            rate = fits["gw-passthrough"][0](c) / fits["nginx-proxy"][0](c)
            cpu = fits["gw-passthrough"][1](c) / fits["nginx-proxy"][1](c)
            line = f"  at chase {c:.0f} us: plain rate {rate:.3f}, plain CPU {cpu:.3f}"
            if "gw-replay" in fits:
                line += f", replays {fits['gw-replay'][0](c) / fits['gw-passthrough'][0](c):.3f}"
            if all(s in fits for s in ("gw-new-keys", "db-limit")):
                line += f", new keys {fits['gw-new-keys'][0](c) / fits['db-limit'][0](c):.3f}"
            print(line)


def budget(results_paths, max_steal=2.0):
    """Per round, the CPU per request of the whole machine and its busy cores for the plain
    hop and the replays; their ratios measured and at equal busy time."""
    kept = []
    for path in results_paths:
        rows = {
            k: (r.rate, r.cpu + r.client * 1e4 / r.rate, r.busy, r.steal)
            for k, r in per_round(path).items()
            if k[0] in ("gw-passthrough", "gw-replay")
        }
        print(path)
        for rnd in sorted({r for _, r in rows}):
            plain, replay = rows.get(("gw-passthrough", rnd)), rows.get(("gw-replay", rnd))
            if plain is None or replay is None:
                continue
            measured, at_equal_busy = replay[0] / plain[0], plain[1] / replay[1]
            steal = max(plain[3], replay[3])
            print(
                f"  round {rnd}: plain {plain[1]:5.1f} us/request, cores {plain[2]:3.0f}% busy;"
                f" replays {replay[1]:5.1f} us/request, {replay[2]:3.0f}% busy;"
                f" replays/plain {measured:.2f} measured, {at_equal_busy:.2f} at equal busy;"
                f" steal {steal:.1f}%"
            )
            if steal <= max_steal:
                kept.append((measured, at_equal_busy, plain[2] - replay[2]))
    if kept:
        print(
            f"{len(kept)} rounds with steal <= {max_steal}%, medians: replays/plain"
            f" {statistics.median(k[0] for k in kept):.2f} measured,"
            f" {statistics.median(k[1] for k in kept):.2f} at equal busy;"
            f" replays' cores {statistics.median(k[2] for k in kept):.0f} points less busy"
        )


def ratios(results_paths, max_steal=2.0):
    """Each run's plain rate, plain CPU, new keys and replays ratios from the medians of its
    rows with at most `max_steal`% steal, and how many rows each scenario kept."""
    asks = (("plain rate", 0.9, 1), ("plain CPU", 1.5, -1), ("new keys", 0.8, 1), ("replays", 2.0, 1))
    for path in results_paths:
        rows = {}
        for (scenario, _), r in per_round(path).items():
            if r.steal <= max_steal:
                rows.setdefault(scenario, []).append((r.rate, r.cpu))
        med = {
            s: (statistics.median(r for r, _ in v), statistics.median(c for _, c in v), len(v))
            for s, v in rows.items()
        }
        need = ("nginx-proxy", "gw-passthrough", "gw-new-keys", "db-limit", "gw-replay")
        if not all(s in med for s in need):
            print(f"{path}: a scenario has no row with steal <= {max_steal}%")
            continue
        values = (
            med["gw-passthrough"][0] / med["nginx-proxy"][0],
            med["gw-passthrough"][1] / med["nginx-proxy"][1],
            med["gw-new-keys"][0] / med["db-limit"][0],
            med["gw-replay"][0] / med["gw-passthrough"][0],
        )
        met = sum((v - line) * sign >= 0 for v, (_, line, sign) in zip(values, asks))
        kept = "/".join(str(med[s][2]) for s in need)
        print(
            f"{path}: "
            + ", ".join(f"{name} {v:.3f}" for v, (name, _, _) in zip(values, asks))
            + f"; {met} of 4 met; rows kept {kept} ({', '.join(need)})"
        )


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "sample":
        sample(sys.argv[2])
    elif len(sys.argv) in (5, 6) and sys.argv[1] == "report":
        wanted = (sys.argv[5] if len(sys.argv) == 6 else "nginx-proxy,gw-passthrough").split(",")
        report(sys.argv[2], sys.argv[3], sys.argv[4], wanted)
    elif len(sys.argv) >= 5 and sys.argv[1] == "probe" and len(sys.argv) % 2 == 1:
        probe(sys.argv[2], list(zip(sys.argv[3::2], sys.argv[4::2])))
    elif len(sys.argv) >= 3 and sys.argv[1] == "budget":
        budget(sys.argv[2:])
    elif len(sys.argv) >= 3 and sys.argv[1] == "ratios":
        ratios(sys.argv[2:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
