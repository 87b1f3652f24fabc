#!/usr/bin/env bash
# What one PostgreSQL spends per new key, and what a pooler in transaction mode changes.
#
#   benches/pooler_cost.sh
#
# pgbench drives the current revision's claim of a new key (CLAIM_NEW_SQL) and its completion
# (FINISH_SQL), taken from src/store/postgres/statements.rs, on the table its migrations build, two
# autocommit statements per key like the gateway, in six ways:
#
#   prepared           -M prepared, straight to PostgreSQL: the gateway with `pooler: none`
#                      (named statements, parsed and planned once per connection)
#   unnamed            -M extended, straight to PostgreSQL: the same statements unnamed (parse,
#                      bind, execute in one round trip, every time), the other way to run them
#                      behind a transaction pooler, not taken
#   unnamed+bouncer    the same through PgBouncer in transaction mode (its CPU counted apart)
#   set_local          -M extended, each statement inside BEGIN; SET LOCAL statement_timeout;
#                      ...; COMMIT: the other way to bound a statement without startup options,
#                      not taken (pgbench cannot pipeline a script that reads a result, so here
#                      it is four round trips per statement where the gateway would pipeline one;
#                      the extra round trips are in its number)
#   functions          -M extended, the statements called through the PL/pgSQL functions of
#                      migrations/0006 that hold them verbatim (PL/pgSQL caches a plan per
#                      session, which a transaction pooler keeps), straight to PostgreSQL
#   functions+bouncer  the same through PgBouncer: the gateway with `pooler: transaction`
#
# It starts its own throwaway cluster with stock durability (fsync and synchronous_commit on)
# and a PgBouncer (pool_mode = transaction, ignore_startup_parameters = extra_float_digits,
# default_pool_size = CLIENTS) in front of it, runs the six interleaved for ROUNDS rounds and
# prints, per run: keys/s; CPU of the whole cluster per key (postmaster, backends, background
# processes; /proc); PgBouncer's CPU per key; WAL bytes per key (pg_current_wal_lsn, a
# CHECKPOINT before each run, so it includes the full-page images a checkpoint brings); and
# transactions per key (pg_stat_database.xact_commit).
#
# Then the table's size per million keys: KEYS new keys (claimed and completed, prepared) with
# a stored body of each of BODIES bytes, then VACUUM (what autovacuum leaves), and the heap,
# index and TOAST sizes, per key and per million keys.
#
# Environment: ROUNDS (3), DUR seconds per run (10), CLIENTS (16, the default pool_size),
# KEYS (100000), BODIES ("100 1000"), PGBIN (the newest /usr/lib/postgresql/*/bin), PGBOUNCER
# (pgbouncer on the PATH or in /usr/sbin). Needs pgbench, the PostgreSQL server binaries and
# pgbouncer; run as root (the cluster and the pooler then run as the postgres user) or as a
# user who may run initdb. On a shared machine read the ratios within a round.
set -euo pipefail

ROUNDS=${ROUNDS:-3}
DUR=${DUR:-10}
CLIENTS=${CLIENTS:-16}
KEYS=${KEYS:-100000}
BODIES=${BODIES:-100 1000}
PGBIN=${PGBIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
PGBOUNCER=${PGBOUNCER:-$(command -v pgbouncer || echo /usr/sbin/pgbouncer)}
ROOT=$(git rev-parse --show-toplevel)

# WORK, HZ, psql_q, start_cluster and start_pgbouncer (stopped at exit), ticks, own_ticks and
# settle: benches/cluster.sh.
source "$(dirname "${BASH_SOURCE[0]}")/cluster.sh"
start_cluster
start_pgbouncer "$CLIENTS"

# The text of `const NAME: &str = "...";` in src/store/postgres/statements.rs.
sql_const() { # name
  awk -v name="$1" '
    !done && index($0, "const " name ": &str = \"") { on = 1; sub(/.*= "/, ""); }
    on { if (sub(/";$/, "")) { on = 0; done = 1 } print }' "$ROOT/src/store/postgres/statements.rs"
}

# The claim ($N -> :cN) and the completion ($N -> :fN), each wrapped in $1 and $2.
script() { # before after
  echo '\set c1 random(0, 99)'
  echo '\set c2 random(1, 9000000000000000000)'
  echo '\set f1 :c1'
  echo '\set f2 :c2'
  printf '%b' "$1"
  sed -E 's/\$([0-9])/:c\1/g' <<<"$(sql_const CLAIM_NEW_SQL)"
  echo '\gset g_'
  printf '%b' "$2"
  printf '%b' "$1"
  sed -E "s/\\\$3/:g_lease_token/g; s/\\\$([0-9])/:f\\1/g" <<<"$(sql_const FINISH_SQL)"
  echo ';'
  printf '%b' "$2"
}
script "" "" >"$WORK/plain.sql"
script 'BEGIN;\nSET LOCAL statement_timeout = 2000;\n' 'COMMIT;\n' >"$WORK/set_local.sql"

# The two statements through the functions of migrations/0006_pooler_functions.sql (which
# hold them verbatim): what the gateway sends with `pooler: transaction`.
cat >"$WORK/plpgsql.sql" <<'SQL'
\set c1 random(0, 99)
\set c2 random(1, 9000000000000000000)
SELECT idemgate_claim_new(:c1, :c2, :c3, :c4, :c5, :c6) AS lease_token \gset g_
SELECT idemgate_finish(:c1, :c2, :g_lease_token, :f4, :f5, :f6, :f7, :f8, :f9);
SQL

schema() { # db
  local f
  for f in $(ls "$ROOT"/migrations/*.sql | sort); do psql_q "$1" <"$f"; done
}

FP='\x'$(printf 'fingerprint' | sha256sum | cut -c1-64)
PGB=("$PGBIN/pgbench" -n -c "$CLIENTS" -j 1
  -D "c3=pay" -D "c4=$FP" -D c5=30000 -D c6=86400000 -D c7=false
  -D f4=completed -D f5=200 -D "f6=content-type: application/json"
  -D f8=86400000 -D f9=0123456789abcdef)

lsn() { psql_q -tA -c "SELECT pg_current_wal_lsn()" postgres; }
commits() { psql_q -tA -c "SELECT xact_commit FROM pg_stat_database WHERE datname = '$1'" postgres; }

# Through the pooler, closes its server connections to $2 (their CPU is then the reaped
# children's), and lets new clients in again.
bouncer_release() { # port db
  [[ $1 == "$BPORT" ]] || return 0
  psql_q -p "$BPORT" -c "KILL $2" pgbouncer >/dev/null
  psql_q -p "$BPORT" -c "RESUME $2" pgbouncer >/dev/null
}

run() { # which round
  local which=$1 round=$2 db=${1//[^a-z]/_}_$2 mode file port a b ba bb w0 w1 x0 x1 n
  case $which in
    prepared) mode=prepared file=plain port=$PORT ;;
    unnamed) mode=extended file=plain port=$PORT ;;
    unnamed+bouncer) mode=extended file=plain port=$BPORT ;;
    set_local) mode=extended file=set_local port=$PORT ;;
    functions) mode=extended file=plpgsql port=$PORT ;;
    functions+bouncer) mode=extended file=plpgsql port=$BPORT ;;
  esac
  psql_q -c "CREATE DATABASE $db" postgres
  schema "$db"
  "${PGB[@]}" -M $mode -p "$port" -D 'f7={"ok":true}' -T 2 -f "$WORK/$file.sql" "$db" \
    >"$WORK/$db.warm.log" 2>&1 || { echo "pgbench failed:"; tail -3 "$WORK/$db.warm.log"; exit 1; }
  bouncer_release "$port" "$db"
  psql_q -c CHECKPOINT "$db"
  settle "$db"
  x0=$(commits "$db")
  w0=$(lsn)
  a=$(ticks)
  ba=$(own_ticks "$BPID")
  "${PGB[@]}" -M $mode -p "$port" -D 'f7={"ok":true}' -T "$DUR" -f "$WORK/$file.sql" "$db" \
    >"$WORK/$db.log" 2>&1 || { echo "pgbench failed:"; tail -3 "$WORK/$db.log"; exit 1; }
  bb=$(own_ticks "$BPID")
  w1=$(lsn)
  bouncer_release "$port" "$db"
  settle "$db"
  b=$(ticks)
  sleep 1 # the backends report their counters within a second or so of going idle
  x1=$(commits "$db")
  n=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$WORK/$db.log")
  wal=$(psql_q -tA -c "SELECT pg_wal_lsn_diff('$w1', '$w0')" postgres)
  awk -v w="$which" -v r="$round" -v n="$n" -v d=$((b - a)) -v bd=$((bb - ba)) -v hz="$HZ" \
    -v dur="$DUR" -v wal="$wal" -v x=$((x1 - x0)) \
    'BEGIN { printf "| %d | %s | %.0f | %.0f | %.0f | %.0f | %.1f |\n", r, w, n / dur,
             d / hz * 1e6 / n, bd / hz * 1e6 / n, wal / n, x / n }'
  psql_q -c "DROP DATABASE $db" postgres
}

size() { # body_bytes
  local bytes=$1 db=size_$1 body per
  body=$(head -c "$bytes" /dev/zero | tr '\0' x)
  psql_q -c "CREATE DATABASE $db" postgres
  schema "$db"
  per=$(((KEYS + CLIENTS - 1) / CLIENTS))
  "${PGB[@]}" -M prepared -D "f7=$body" -t "$per" -f "$WORK/plain.sql" "$db" >"$WORK/$db.log" 2>&1 ||
    { echo "pgbench failed:"; tail -3 "$WORK/$db.log"; exit 1; }
  psql_q -c "VACUUM idemgate_keys" "$db"
  psql_q -tA -F ' ' -c "SELECT count(*), pg_relation_size('idemgate_keys'),
      pg_indexes_size('idemgate_keys'),
      pg_total_relation_size('idemgate_keys') - pg_relation_size('idemgate_keys')
        - pg_indexes_size('idemgate_keys')
    FROM idemgate_keys" "$db" |
    awk -v b="$bytes" '{ n = $1; printf "| %d | %d | %.0f | %.0f | %.0f | %.0f | %.0f |\n", b, n,
      $2 / n, $3 / n, $4 / n, ($2 + $3 + $4) / n, ($2 + $3 + $4) / n * 1e6 / 1048576 }'
  psql_q -c "DROP DATABASE $db" postgres
}

echo "$(git -C "$ROOT" rev-parse --short HEAD); $("$PGBIN/postgres" --version); $("$PGBOUNCER" --version | head -1);" \
  "stock durability; pgbench -c $CLIENTS -j 1, ${DUR}s per run; $(nproc) cores"
echo
echo "| round | statements | keys/s | PostgreSQL CPU µs/key | PgBouncer CPU µs/key | WAL bytes/key | transactions/key |"
echo "|---:|---|---:|---:|---:|---:|---:|"
for round in $(seq "$ROUNDS"); do
  for which in prepared unnamed unnamed+bouncer set_local functions functions+bouncer; do
    run "$which" "$round"
  done
done
echo
echo "| body bytes | keys | heap bytes/key | index bytes/key | TOAST bytes/key | total bytes/key | MiB per million keys |"
echo "|---:|---:|---:|---:|---:|---:|---:|"
for bytes in $BODIES; do
  size "$bytes"
done
