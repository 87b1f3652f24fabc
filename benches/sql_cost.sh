#!/usr/bin/env bash
# PostgreSQL CPU per new key of the store's own SQL, at two revisions, next to a bare pair.
#
#   benches/sql_cost.sh BEFORE_REV AFTER_REV
#
# For each revision: the keys table from that revision's migrations, and pgbench driving that
# revision's claim of a new key (CLAIM_NEW_SQL if it has one, else CLAIM_SQL) and its
# completion (FINISH_SQL), taken from src/store/postgres.rs, as prepared statements, two
# autocommits per key, like the gateway. The bare pair is the least any claim + completion
# can cost: a plain INSERT ... ON CONFLICT DO NOTHING RETURNING and a fenced UPDATE on a
# table with only its primary key (the db-limit anchor of the shared perf harness).
#
# It starts its own throwaway cluster with stock settings (fsync and synchronous_commit on),
# runs the three interleaved for ROUNDS rounds, and prints, per run, keys/s and the CPU time
# of the whole cluster (postmaster, backends, background processes; /proc) per key, and how
# many completions were HOT updates. On a shared machine read the ratios within a round.
#
# Environment: ROUNDS (3), DUR seconds per run (10), CLIENTS (32), RATE (keys/s for every
# run, pgbench -R, so that the three are compared at matched rates: CPU per key moves with
# load on a small machine; default: as fast as each goes), PGBIN (the newest
# /usr/lib/postgresql/*/bin). Needs git, pgbench and the PostgreSQL server binaries; run as
# root (the cluster then runs as the postgres user) or as a user who may run initdb.
set -euo pipefail

BEFORE=${1:?usage: benches/sql_cost.sh BEFORE_REV AFTER_REV}
AFTER=${2:?usage: benches/sql_cost.sh BEFORE_REV AFTER_REV}
ROUNDS=${ROUNDS:-3}
DUR=${DUR:-10}
CLIENTS=${CLIENTS:-32}
PGBIN=${PGBIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
ROOT=$(git rev-parse --show-toplevel)

# WORK, HZ, psql_q, start_cluster (stopped at exit), bare_schema and measure_pgbench:
# benches/cluster.sh.
source "$(dirname "${BASH_SOURCE[0]}")/cluster.sh"
start_cluster

# The text of `const NAME: &str = "...";` in a revision's src/store/postgres.rs.
sql_const() { # rev name
  git -C "$ROOT" show "$1:src/store/postgres.rs" |
    awk -v name="$2" '
      !done && index($0, "const " name ": &str = \"") { on = 1; sub(/.*= "/, ""); }
      on { if (sub(/";$/, "")) { on = 0; done = 1 } print }'
}

# A pgbench script for one revision: claim ($N -> :cN), then completion ($N -> :fN).
script_for() { # rev file
  local rev=$1 out=$2 claim token
  if [[ -n $(sql_const "$rev" CLAIM_NEW_SQL) ]]; then
    claim=$(sql_const "$rev" CLAIM_NEW_SQL)
    token=g_lease_token
  else
    claim=$(sql_const "$rev" CLAIM_SQL)
    token=g_token
  fi
  {
    echo '\set c1 random(0, 99)'
    echo '\set c2 random(1, 9000000000000000000)'
    echo '\set f1 :c1'
    echo '\set f2 :c2'
    sed -E 's/\$([0-9])/:c\1/g' <<<"$claim"
    echo '\gset g_'
    sql_const "$rev" FINISH_SQL | sed -E "s/\\\$3/:$token/g; s/\\\$([0-9])/:f\\1/g"
    echo ';'
  } >"$out"
}

schema_for() { # rev db
  local f
  for f in $(git -C "$ROOT" ls-tree --name-only "$1" migrations/ | grep '\.sql$' | sort); do
    git -C "$ROOT" show "$1:$f" | psql_q "$2"
  done
}

cat >"$WORK/bare.sql" <<'SQL'
\set c1 random(0, 99)
\set c2 random(1, 9000000000000000000)
INSERT INTO idemgate_keys (scope, key, fingerprint, state, lease_token, lease_expires_at, expires_at)
VALUES (:c1, :c2, :c4, 0, gen_random_uuid(), now() + interval '30 seconds', now() + interval '24 hours')
ON CONFLICT (scope, key) DO NOTHING
RETURNING scope AS s, key AS k, lease_token AS tok \gset
UPDATE idemgate_keys
   SET state = 1, status = 200, headers = :f6, body = :f7,
       lease_expires_at = NULL, expires_at = now() + interval '24 hours'
 WHERE scope = :s AND key = :k AND lease_token = :tok::uuid;
SQL
script_for "$BEFORE" "$WORK/before.sql"
script_for "$AFTER" "$WORK/after.sql"

FP='\x'$(printf 'fingerprint' | sha256sum | cut -c1-64)
PGB=("$PGBIN/pgbench" -n -M prepared -c "$CLIENTS" -j 1 ${RATE:+-R "$RATE"}
  -D "c3=pay" -D "c4=$FP" -D c5=30000 -D c6=86400000 -D c7=false
  -D f4=completed -D f5=200 -D "f6=content-type: application/json" -D 'f7={"ok":true}'
  -D f8=86400000 -D f9=0123456789abcdef)

run() { # which round
  local which=$1 round=$2 db=${1}_$2 hot
  psql_q -c "CREATE DATABASE $db" postgres
  case $which in
    before) schema_for "$BEFORE" "$db" ;;
    after) schema_for "$AFTER" "$db" ;;
    bare) bare_schema "$db" ;;
  esac
  measure_pgbench "$WORK/$which.sql" "$db"
  sleep 2 # the backends report their table counters within a second or so of going idle
  hot=$(psql_q -tA -c "SELECT n_tup_hot_upd || ' of ' || n_tup_upd FROM pg_stat_user_tables
                        WHERE relname = 'idemgate_keys'" "$db")
  awk -v w="$which" -v r="$round" -v n="$TXNS" -v d="$TICKS" -v hz="$HZ" -v dur="$DUR" -v hot="$hot" \
    'BEGIN { printf "| %d | %s | %.0f | %.0f | %s |\n", r, w, n / dur, d / hz * 1e6 / n, hot }'
  psql_q -c "DROP DATABASE $db" postgres
}

echo "before: $(git -C "$ROOT" rev-parse --short "$BEFORE"), after: $(git -C "$ROOT" rev-parse --short "$AFTER");" \
  "$("$PGBIN/postgres" --version), stock settings; pgbench -M prepared -c $CLIENTS -j 1${RATE:+ -R $RATE}, ${DUR}s per run"
echo
echo "| round | SQL | keys/s | PostgreSQL CPU µs/key | HOT completions |"
echo "|---:|---|---:|---:|---|"
for round in $(seq "$ROUNDS"); do
  for which in before after bare; do
    run "$which" "$round"
  done
done
