#!/usr/bin/env bash
# `server.yield_on_wake: true` (the default) against `false` in one build, measured by turns
# with benches/ab.sh (BENCHMARKS.md, "a woken serving thread yields once"; src/wake.rs). Its environment (SCENARIOS,
# ROUNDS, RUN_SECONDS, CONNS, STEAL, HOGS) applies.
#
#   cargo build --release && benches/yield_ab.sh [BIN]     # BIN: target/release/idemgate
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=${1:-$ROOT/target/release/idemgate}
NAME_A=yield NAME_B=no-yield \
  LINE_A='server: { yield_on_wake: true }' LINE_B='server: { yield_on_wake: false }' \
  exec "$ROOT/benches/ab.sh" "$BIN"
