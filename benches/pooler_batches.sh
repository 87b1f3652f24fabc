#!/usr/bin/env bash
# New keys through PgBouncer with and without group commit (`store.postgres.batch_keys`),
# next to the direct pool: the gateway itself, not its statements alone (docs/scaling.md,
# "Batches through PgBouncer, measured").
#
#   cargo build --release && benches/pooler_batches.sh
#
# Starts a throwaway cluster with stock settings (fsync and synchronous_commit on), a
# PgBouncer in transaction mode (`default_pool_size` POOL, 10 by default, as README's "Several
# instances" shows it), an nginx upstream, and three gateways (target/release/idemgate) on one
# fresh database: `direct` (the pool to PostgreSQL, batch_keys 32), `pooler` (`pooler:
# transaction` through PgBouncer, batch_keys 32) and `pooler-alone` (the same with batch_keys 1:
# every key alone). Then, ROUNDS times, the three alternated, each: a checkpoint, 2 s of
# warm-up, DUR seconds (default 8) of `wrk -t1 -c32` sending a new key in every request.
# Prints per run keys/s and the CPU per key of the gateway, of PostgreSQL (the postmaster and
# every backend and background process) and of PgBouncer, from /proc. Needs wrk, nginx,
# pgbouncer, python3 and the PostgreSQL server binaries (PGBIN: the newest
# /usr/lib/postgresql/*/bin); run as root (the cluster and the pooler then run as the
# postgres user) or as a user who may run initdb.
set -euo pipefail

ROUNDS=${ROUNDS:-3}
DUR=${DUR:-8}
POOL=${POOL:-10}
PGBIN=${PGBIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
PGBOUNCER=${PGBOUNCER:-$(command -v pgbouncer || echo /usr/sbin/pgbouncer)}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=${BIN:-$ROOT/target/release/idemgate}
for tool in wrk nginx python3 "$PGBOUNCER"; do
  command -v "$tool" >/dev/null || { echo "pooler_batches.sh: $tool is missing" >&2; exit 2; }
done
[[ -x $BIN ]] || { echo "pooler_batches.sh: no $BIN (cargo build --release)" >&2; exit 2; }

# WORK, HZ, psql_q, free_port, start_cluster (sets PORT, PM), start_pgbouncer (sets BPORT,
# BPID), their stops, ticks and own_ticks: benches/cluster.sh. start_upstream, stop_nginx,
# GATEWAYS and stop_gateways, wait_answering, gateway_store_settings, gateway_routes,
# new_keys_lua and BODY: benches/http.sh.
source "$(dirname "${BASH_SOURCE[0]}")/cluster.sh"
source "$(dirname "${BASH_SOURCE[0]}")/http.sh"
cleanup() {
  stop_gateways
  stop_nginx
  stop_pgbouncer
  wait 2>/dev/null || true
  stop_cluster
  rm -rf "$WORK"
}
trap cleanup EXIT

start_cluster
psql_q -c "CREATE DATABASE keys" postgres

start_pgbouncer "$POOL"

UP=$(free_port) STATUS=$(free_port)
start_upstream "$UP" "$STATUS"

DIRECT=postgres://postgres@127.0.0.1:$PORT/keys
POOLED=postgres://postgres@127.0.0.1:$BPORT/keys
# A gateway config: $1 name, $2 the store's url and what goes with it, $3 batch_keys.
gateway_config() { # name store batch_keys
  cat >"$WORK/$1.yaml" <<YAML
listen: 127.0.0.1:$(free_port)
admin: { listen: "127.0.0.1:$(free_port)" }
store:
  postgres:
$2
    batch_keys: $3
$(gateway_store_settings)
$(gateway_routes "$UP")
YAML
}
gateway_config direct "    url: $DIRECT" 32
gateway_config pooler "    url: $POOLED
    pooler: transaction
    listen_url: $DIRECT" 32
gateway_config pooler-alone "    url: $POOLED
    pooler: transaction
    listen_url: $DIRECT" 1
"$BIN" migrate --config "$WORK/direct.yaml" >/dev/null

NAMES=(direct pooler pooler-alone)
declare -A GW_PID GW_PORT
for name in "${NAMES[@]}"; do
  "$BIN" serve --config "$WORK/$name.yaml" >"$WORK/$name.log" 2>&1 &
  GW_PID[$name]=$!
  GATEWAYS+=($!)
  GW_PORT[$name]=$(sed -n 's/^listen: 127.0.0.1:\([0-9]*\)$/\1/p' "$WORK/$name.yaml")
  wait_answering "${GW_PORT[$name]}" /plain/pay "$WORK/$name.log"
done

new_keys_lua "$WORK/new_keys.lua"

RUN=0
measure() { # name
  local port=${GW_PORT[$1]} pid=${GW_PID[$1]} g0 p0 b0 g1 p1 b1 out n bad
  RUN=$((RUN + 1))
  psql_q -c CHECKPOINT keys
  wrk -t1 -c32 -d2s -s "$WORK/new_keys.lua" "http://127.0.0.1:$port" -- "w$RUN" "$BODY" >/dev/null
  g0=$(own_ticks "$pid") p0=$(ticks) b0=$(own_ticks "$BPID")
  out=$(wrk -t1 -c32 -d"${DUR}s" -s "$WORK/new_keys.lua" "http://127.0.0.1:$port" -- "m$RUN" "$BODY")
  g1=$(own_ticks "$pid") p1=$(ticks) b1=$(own_ticks "$BPID")
  n=$(sed -n 's/^ *\([0-9]*\) requests in.*/\1/p' <<<"$out")
  bad=$(sed -n 's/^ *Non-2xx or 3xx responses: *\([0-9]*\).*/\1/p' <<<"$out")
  python3 - "$1" "$n" "$DUR" "$HZ" "$((g1 - g0))" "$((p1 - p0))" "$((b1 - b0))" "${bad:-0}" <<'PY'
import sys
name, n, secs, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
g, p, b, bad = (int(x) for x in sys.argv[5:9])
us = lambda t: f"{t * 1e6 / hz / n:.0f}"
print(f"| {name} | {n // secs} | {us(g)} | {us(p)} | {us(b) if name.startswith('pooler') else '-'} | {bad} |")
PY
}

echo "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'); $("$PGBIN/postgres" --version); $("$PGBOUNCER" --version | head -1); wrk -t1 -c32, ${DUR}s per run; CPU per key"
echo
echo "| gateway | keys/s | gateway µs/key | PostgreSQL µs/key | PgBouncer µs/key | non-2xx |"
echo "|---|---:|---:|---:|---:|---:|"
for _ in $(seq "$ROUNDS"); do
  for name in "${NAMES[@]}"; do measure "$name"; done
done
