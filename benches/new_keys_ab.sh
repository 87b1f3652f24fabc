#!/usr/bin/env bash
# Two gateway builds side by side on new keys: keys/s, the CPU per key of the gateway and of
# PostgreSQL, and the keys per statement of the group commits (`idemgate_store_batch_keys`),
# to tell whether a change moved the gateway's own cost or the batches PostgreSQL gets
# (BENCHMARKS.md, "futures moved whole, made smaller").
#
#   benches/new_keys_ab.sh BIN_A BIN_B
#
# Starts a throwaway cluster with stock settings (fsync and synchronous_commit on), an nginx
# upstream, and the two gateways, each on a database of its own (`pool_size: 32`, as the
# shared perf harness). Then, ROUNDS times (default 3), A then B: a checkpoint, 2 s of
# warm-up, DUR seconds (default 8) of `wrk -t1 -c32` sending a new key in every request. The
# run after another pays for what the one before left to the database's background work
# (checkpoints, autovacuum): run it twice, the second time with the builds swapped. Needs wrk,
# nginx, curl, python3 and the PostgreSQL server binaries (PGBIN: the newest
# /usr/lib/postgresql/*/bin); run as root (the cluster then runs as the postgres user) or as
# a user who may run initdb.
set -euo pipefail

[[ $# == 2 && -x $1 && -x $2 ]] || { echo "usage: new_keys_ab.sh BIN_A BIN_B" >&2; exit 2; }
ROUNDS=${ROUNDS:-3}
DUR=${DUR:-8}
PGBIN=${PGBIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
for tool in wrk nginx curl python3; do
  command -v "$tool" >/dev/null || { echo "new_keys_ab.sh: $tool is missing" >&2; exit 2; }
done

# WORK, HZ, psql_q, free_port, start_cluster (sets PORT), stop_cluster, ticks and own_ticks:
# benches/cluster.sh. start_upstream, stop_nginx, GATEWAYS and stop_gateways, wait_answering,
# gateway_store_settings, gateway_routes, new_keys_lua and BODY: benches/http.sh.
source "$(dirname "${BASH_SOURCE[0]}")/cluster.sh"
source "$(dirname "${BASH_SOURCE[0]}")/http.sh"
cleanup() {
  stop_gateways
  stop_nginx
  wait 2>/dev/null || true
  stop_cluster
  rm -rf "$WORK"
}
trap cleanup EXIT

start_cluster
UP=$(free_port) STATUS=$(free_port)
start_upstream "$UP" "$STATUS"

declare -A BIN PID LISTEN ADMIN
BIN[A]=$1 BIN[B]=$2
for n in A B; do
  psql_q -c "CREATE DATABASE keys_${n,,}" postgres
  LISTEN[$n]=$(free_port) ADMIN[$n]=$(free_port)
  cat >"$WORK/$n.yaml" <<YAML
listen: 127.0.0.1:${LISTEN[$n]}
admin: { listen: "127.0.0.1:${ADMIN[$n]}" }
store:
  postgres:
    url: postgres://postgres@127.0.0.1:$PORT/keys_${n,,}
$(gateway_store_settings)
$(gateway_routes "$UP")
YAML
  "${BIN[$n]}" migrate --config "$WORK/$n.yaml" >/dev/null
  "${BIN[$n]}" serve --config "$WORK/$n.yaml" >"$WORK/$n.log" 2>&1 &
  PID[$n]=$!
  GATEWAYS+=($!)
  wait_answering "${LISTEN[$n]}" /plain/pay "$WORK/$n.log"
done

new_keys_lua "$WORK/new_keys.lua"

# The sum and the count of `idemgate_store_batch_keys{op=$2}` on admin port $1.
batch() { # admin_port op
  curl -s "http://127.0.0.1:$1/metrics" |
    awk -v op="$2" '$1 ~ "^idemgate_store_batch_keys_(sum|count)\\{op=\"" op "\"" { printf "%s ", $2 }'
}

echo "| build | keys/s | gateway µs/key | PostgreSQL µs/key | keys per claim | keys per completion |"
echo "|---|---:|---:|---:|---:|---:|"
RUN=0
for _ in $(seq "$ROUNDS"); do
  for n in A B; do
    RUN=$((RUN + 1))
    psql_q -c CHECKPOINT "keys_${n,,}"
    wrk -t1 -c32 -d2s -s "$WORK/new_keys.lua" "http://127.0.0.1:${LISTEN[$n]}" -- "w$RUN" "$BODY" >/dev/null
    read -r cs0 cc0 <<<"$(batch "${ADMIN[$n]}" claim_new)"
    read -r fs0 fc0 <<<"$(batch "${ADMIN[$n]}" finish)"
    g0=$(own_ticks "${PID[$n]}") p0=$(ticks)
    out=$(wrk -t1 -c32 -d"${DUR}s" -s "$WORK/new_keys.lua" "http://127.0.0.1:${LISTEN[$n]}" -- "m$RUN" "$BODY")
    g1=$(own_ticks "${PID[$n]}") p1=$(ticks)
    read -r cs1 cc1 <<<"$(batch "${ADMIN[$n]}" claim_new)"
    read -r fs1 fc1 <<<"$(batch "${ADMIN[$n]}" finish)"
    keys=$(sed -n 's/^ *\([0-9]*\) requests in.*/\1/p' <<<"$out")
    python3 - "$n" "$keys" "$DUR" "$HZ" "$((g1 - g0))" "$((p1 - p0))" \
      "$cs0" "$cc0" "$cs1" "$cc1" "$fs0" "$fc0" "$fs1" "$fc1" <<'PY'
import sys
name, keys, secs, hz, g, p = sys.argv[1], *(int(x) for x in sys.argv[2:7])
cs0, cc0, cs1, cc1, fs0, fc0, fs1, fc1 = (float(x) for x in sys.argv[7:15])
us = lambda t: f"{t * 1e6 / hz / keys:.0f}"
per = lambda s, c: f"{s / c:.2f}" if c else "-"
print(f"| {name} | {keys // secs} | {us(g)} | {us(p)} | {per(cs1 - cs0, cc1 - cc0)} | {per(fs1 - fs0, fc1 - fc0)} |")
PY
  done
done
