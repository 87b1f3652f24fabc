#!/usr/bin/env bash
# PostgreSQL CPU per new key when several keys share one statement and one commit: what an
# application-level group commit of claims and completions would save, measured before
# building one.
#
#   benches/batch_cost.sh
#
# Four pgbench scripts on the bare pair's table (the db-limit anchor of the shared perf
# harness: primary key only), each handling BATCH new keys per pgbench transaction:
#   single        each key claimed and completed by statements of its own, one commit
#                 each: the BATCH claims, then the BATCH completions (the bare pair's
#                 statements, what the gateway does today)
#   claims        the BATCH claims in one multi-row INSERT ... ON CONFLICT DO NOTHING
#                 RETURNING, the completions one by one
#   completions   the claims one by one, the BATCH completions in one UPDATE ... FROM
#                 (VALUES ...) fenced by each key's lease token
#   both          one statement for the claims, one for the completions
# Every statement is an autocommit, so a batch is one commit. All four run at the same rate
# of keys (RATE keys/s: pgbench -R RATE/BATCH), because CPU per key moves with load. The lease
# token is derived from the key (md5) so that the batched completion can name it without a
# round trip per key; the cost of the statements does not depend on how it is made.
#
# It starts its own throwaway cluster with stock settings (fsync and synchronous_commit on),
# runs the four interleaved for ROUNDS rounds, and prints, per run, keys/s, the CPU time of the
# whole cluster per key (postmaster, backends, background processes; /proc), and how many
# keys ended completed. Environment: ROUNDS (2), DUR seconds per run (10), CLIENTS (32),
# BATCH (8; at most 51: pgbench passes at most 255 parameters to a statement, and a claim
# row takes 5), RATE (3000; a multiple of BATCH), PGBIN (the newest
# /usr/lib/postgresql/*/bin). Run as root (the cluster then runs as the postgres user) or
# as a user who may run initdb.
set -euo pipefail

ROUNDS=${ROUNDS:-2}
DUR=${DUR:-10}
CLIENTS=${CLIENTS:-32}
BATCH=${BATCH:-8}
RATE=${RATE:-3000}
if ((BATCH < 1 || BATCH > 51 || RATE < BATCH || RATE % BATCH != 0)); then
  echo "batch_cost.sh: BATCH must be 1 to 51 and RATE a multiple of it (BATCH=$BATCH RATE=$RATE)" >&2
  exit 2
fi
PGBIN=${PGBIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}

# WORK, HZ, psql_q, start_cluster (stopped at exit), bare_schema and measure_pgbench:
# benches/cluster.sh.
source "$(dirname "${BASH_SOURCE[0]}")/cluster.sh"
start_cluster

# The transaction's scope, key i of it, and key i's lease token.
SCOPE="('acct-' || :a)"
key() { echo "'k-' || :client_id || '-' || :n$1"; }
token() { echo "md5(:n$1::text)::uuid"; }
SET="state = 1, status = 200, headers = :headers, body = :body, lease_expires_at = NULL,
       expires_at = now() + interval '24 hours'"
claim_row() { echo "($SCOPE, $(key "$1"), :fp, 0, $(token "$1"), now() + interval '30 seconds', now() + interval '24 hours')"; }
claim_head="INSERT INTO idemgate_keys (scope, key, fingerprint, state, lease_token, lease_expires_at, expires_at) VALUES"

claims_one_by_one() {
  local i
  for i in $(seq "$BATCH"); do
    echo "$claim_head $(claim_row "$i") ON CONFLICT (scope, key) DO NOTHING RETURNING lease_token;"
  done
}
claims_batched() {
  local i rows=()
  for i in $(seq "$BATCH"); do rows+=("$(claim_row "$i")"); done
  local IFS=,
  echo "$claim_head ${rows[*]} ON CONFLICT (scope, key) DO NOTHING RETURNING key, lease_token;"
}
completions_one_by_one() {
  local i
  for i in $(seq "$BATCH"); do
    echo "UPDATE idemgate_keys SET $SET WHERE scope = $SCOPE AND key = $(key "$i") AND lease_token = $(token "$i");" |
      tr '\n' ' '
    echo
  done
}
completions_batched() {
  local i rows=()
  for i in $(seq "$BATCH"); do rows+=("($SCOPE, $(key "$i"), $(token "$i"))"); done
  local IFS=,
  echo "UPDATE idemgate_keys t SET $SET FROM (VALUES ${rows[*]}) v(s, k, tok)
        WHERE t.scope = v.s AND t.key = v.k AND t.lease_token = v.tok RETURNING t.key;" | tr '\n' ' '
  echo
}
script() { # claims completions
  echo '\set a random(0, 99)'
  local i
  for i in $(seq "$BATCH"); do echo "\\set n$i random(1, 9000000000000000000)"; done
  "$1"
  "$2"
}
script claims_one_by_one completions_one_by_one >"$WORK/single.sql"
script claims_batched completions_one_by_one >"$WORK/claims.sql"
script claims_one_by_one completions_batched >"$WORK/completions.sql"
script claims_batched completions_batched >"$WORK/both.sql"

FP='\x'$(printf 'fingerprint' | sha256sum | cut -c1-64)
TXN_RATE=$((RATE / BATCH))
PGB=("$PGBIN/pgbench" -n -M prepared -c "$CLIENTS" -j 1 -R "$TXN_RATE"
  -D "fp=$FP" -D "headers=content-type: application/json" -D 'body={"ok":true}')

run() { # which round
  local which=$1 round=$2 db=${1}_$2 n done_keys
  psql_q -c "CREATE DATABASE $db" postgres
  bare_schema "$db"
  measure_pgbench "$WORK/$which.sql" "$db"
  n=$((TXNS * BATCH))
  done_keys=$(psql_q -tA -c "SELECT count(*) FILTER (WHERE state = 1) || ' of ' || count(*) FROM idemgate_keys" "$db")
  awk -v w="$which" -v r="$round" -v n="$n" -v d="$TICKS" -v hz="$HZ" -v dur="$DUR" -v k="$done_keys" \
    'BEGIN { printf "| %d | %s | %.0f | %.0f | %s |\n", r, w, n / dur, d / hz * 1e6 / n, k }'
  psql_q -c "DROP DATABASE $db" postgres
}

echo "$("$PGBIN/postgres" --version), stock settings; pgbench -M prepared -c $CLIENTS -j 1 -R $TXN_RATE" \
  "($RATE keys/s, $BATCH keys per pgbench transaction), ${DUR}s per run"
echo
echo "| round | statements | keys/s | PostgreSQL CPU µs/key | keys completed (warm-up included) |"
echo "|---:|---|---:|---:|---|"
for round in $(seq "$ROUNDS"); do
  for which in single claims completions both; do
    run "$which" "$round"
  done
done
