# Sourced by the benchmark scripts: a work directory, a throwaway PostgreSQL cluster
# (start_cluster), CPU accounting of it from /proc (ticks), waiting for a database's
# backends to be gone (settle), and one measured pgbench run (measure_pgbench).

# What every script gets: WORK, HZ and free_port (benches/work.sh), the cluster (and a pooler)
# stopped at exit with the work directory removed (a script that starts more redefines
# cleanup), and psql. Needs PGBIN.
source "$(dirname "${BASH_SOURCE[0]}")/work.sh"
psql_q() { "$PGBIN/psql" -X -q -v ON_ERROR_STOP=1 "$@"; }
cleanup() {
  stop_pgbouncer
  stop_cluster
  rm -rf "$WORK"
}
trap cleanup EXIT

# Runs a command as the postgres user when running as root (initdb refuses root).
as_pg() { if [[ $(id -u) == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi; }

# Starts a cluster with stock settings (fsync and synchronous_commit on) under $WORK/pg, from
# $PGBIN, on a free port; sets PORT and PM (the postmaster's pid) and points libpq's
# environment at it. cleanup stops it at exit.
start_cluster() {
  PORT=$(free_port)
  mkdir -p "$WORK/pg"
  [[ $(id -u) == 0 ]] && chown postgres "$WORK/pg"
  as_pg "$PGBIN/initdb" -D "$WORK/pg/data" -U postgres --auth=trust --no-sync >/dev/null
  as_pg "$PGBIN/pg_ctl" -D "$WORK/pg/data" -l "$WORK/pg/log" -w \
    -o "-p $PORT -k $WORK/pg -c listen_addresses=127.0.0.1 -c max_connections=100" start >/dev/null
  export PGHOST=127.0.0.1 PGPORT=$PORT PGUSER=postgres
  PM=$(head -1 "$WORK/pg/data/postmaster.pid")
}

stop_cluster() {
  as_pg "$PGBIN/pg_ctl" -D "$WORK/pg/data" -m fast -w stop >/dev/null 2>&1 || true
}

# Starts a PgBouncer (PGBOUNCER, as the postgres user when root) in transaction mode in front
# of the cluster, with `default_pool_size` $1, on a free port; sets BPORT and BPID. cleanup
# stops it at exit.
start_pgbouncer() { # default_pool_size
  BPORT=$(free_port)
  mkdir -p "$WORK/bouncer"
  cat >"$WORK/bouncer/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port=$PORT

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $BPORT
unix_socket_dir =
auth_type = trust
auth_file = $WORK/bouncer/userlist.txt
pool_mode = transaction
ignore_startup_parameters = extra_float_digits
max_client_conn = 1000
default_pool_size = $1
logfile = $WORK/bouncer/pgbouncer.log
pidfile = $WORK/bouncer/pgbouncer.pid
admin_users = postgres
INI
  echo '"postgres" ""' >"$WORK/bouncer/userlist.txt"
  [[ $(id -u) == 0 ]] && chown -R postgres "$WORK/bouncer"
  as_pg "$PGBOUNCER" -d "$WORK/bouncer/pgbouncer.ini"
  for _ in $(seq 100); do [[ -s $WORK/bouncer/pgbouncer.pid ]] && break; sleep 0.1; done
  BPID=$(cat "$WORK/bouncer/pgbouncer.pid")
}

stop_pgbouncer() {
  [[ -s $WORK/bouncer/pgbouncer.pid ]] && kill "$(cat "$WORK/bouncer/pgbouncer.pid")" 2>/dev/null || true
}

# CPU ticks of one process (utime + stime).
own_ticks() { # pid
  local line
  read -r line <"/proc/$1/stat"
  line=${line##*) }
  set -- $line
  echo $((${12} + ${13}))
}

# CPU ticks of the cluster: the postmaster with its reaped children, and its live children.
# A backend that exited but is not reaped yet is in neither, so callers wait for pgbench's
# backends to be reaped first; and if the postmaster reaps one while we read, read again.
ticks() {
  local line own cut cut2 kids c try
  for try in $(seq 20); do
    read -r line <"/proc/$PM/stat"
    line=${line##*) }
    set -- $line
    own=$((${12} + ${13}))
    cut=$((${14} + ${15}))
    kids=0
    for c in $(ps -o pid= --ppid "$PM"); do
      read -r line 2>/dev/null <"/proc/$c/stat" || continue
      line=${line##*) }
      set -- $line
      kids=$((kids + ${12} + ${13}))
    done
    read -r line <"/proc/$PM/stat"
    line=${line##*) }
    set -- $line
    cut2=$((${14} + ${15}))
    [[ $cut == "$cut2" ]] && break
    sleep 0.05
  done
  echo $((own + cut + kids))
}

# Waits until no client backend of database $1 is left (pgbench's have exited and been reaped;
# behind a pooler, its server connections are closed first). Needs psql_q.
settle() {
  local i
  for i in $(seq 100); do
    [[ $(psql_q -tA -c "SELECT count(*) FROM pg_stat_activity WHERE datname = '$1'" postgres) == 0 ]] &&
      [[ -z $(ps -o stat= --ppid "$PM" | grep Z) ]] && return
    sleep 0.1
  done
}

# Runs pgbench (the array PGB) with a script against a database: 2 s of warm-up, a
# checkpoint, then DUR seconds measured. Sets TXNS (transactions pgbench completed in the
# measured run) and TICKS (the cluster's CPU ticks over it). Exits on a pgbench failure.
measure_pgbench() { # script db
  local log=$WORK/$2.log a b
  "${PGB[@]}" -T 2 -f "$1" "$2" >"$log.warm" 2>&1 ||
    { echo "pgbench failed:"; tail -3 "$log.warm"; exit 1; }
  psql_q -c CHECKPOINT "$2"
  settle "$2"
  a=$(ticks)
  "${PGB[@]}" -T "$DUR" -f "$1" "$2" >"$log" 2>&1 ||
    { echo "pgbench failed:"; tail -3 "$log"; exit 1; }
  settle "$2"
  b=$(ticks)
  TXNS=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$log")
  TICKS=$((b - a))
}

# Creates the bare pair's table in a database: the db-limit anchor of the shared perf
# harness (primary key only, nothing else indexed, no constraints beyond NOT NULL).
bare_schema() { # db
  psql_q "$1" <<'SQL'
CREATE TABLE idemgate_keys (
    scope text NOT NULL, key text NOT NULL, fingerprint bytea NOT NULL, state smallint NOT NULL,
    lease_token uuid, lease_expires_at timestamptz, status smallint, headers bytea, body bytea,
    expires_at timestamptz NOT NULL, PRIMARY KEY (scope, key));
SQL
}
