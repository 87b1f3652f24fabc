#!/bin/sh
# The gateway binary started under SCHED_BATCH, for the shared perf harness's --bin (which runs
# `BIN migrate` and `BIN serve`, and passes its environment on): every thread the gateway
# starts inherits the policy (BENCHMARKS.md, "under SCHED_BATCH"; docs/operations.md, "CPU scheduling").
#
#   IDEMGATE_BIN=target/pgo/idemgate ../shared/perf/run.sh --bin benches/sched_batch.sh --rounds 3
#
# IDEMGATE_BIN: the binary (default target/release/idemgate). Needs chrt (util-linux).
exec chrt -b 0 "${IDEMGATE_BIN:-$(dirname "$0")/../target/release/idemgate}" "$@"
