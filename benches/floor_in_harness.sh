#!/usr/bin/env bash
# Puts the floor under any hyper-based proxy (examples/hyper_floor.rs) in the gateway's place
# in the shared perf harness, so that its plain-hop rows are measured by the benchmark of
# record itself (BENCHMARKS.md, "hyper alone in the harness of record"):
#
#   cargo build --release --example hyper_floor
#   ../shared/perf/run.sh --bin benches/floor_in_harness.sh \
#     --scenarios direct,nginx-proxy,gw-passthrough --rounds 3
#
# The harness calls its binary as `BIN migrate --config FILE` and `BIN serve --config FILE`.
# `migrate` has nothing to do here; `serve` reads the top-level `listen:` and the first
# `http://` upstream `url:` of the rendered template and becomes hyper_floor on them (exec:
# the harness counts the CPU of the process it started). Only the plain hop means anything:
# the floor has no routes, so gw-new-keys and gw-replay would be plain hops too.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FLOOR_BIN=$ROOT/target/release/examples/hyper_floor
usage="usage: floor_in_harness.sh migrate|serve --config FILE"
(($# == 3)) && [[ $2 == --config ]] || { echo "$usage" >&2; exit 2; }
[[ -x $FLOOR_BIN ]] || { echo "floor_in_harness.sh: no $FLOOR_BIN (cargo build --release --example hyper_floor)" >&2; exit 2; }
case $1 in
  migrate) exit 0 ;;
  serve)
    listen=$(sed -n 's/^listen: *//p' "$3")
    upstream=$(sed -n 's|^ *url: *http://\([^/ ]*\).*|\1|p' "$3" | head -1)
    [[ -n $listen && -n $upstream ]] || { echo "floor_in_harness.sh: no listen or upstream url in $3" >&2; exit 2; }
    exec "$FLOOR_BIN" "$listen" "$upstream"
    ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
