# Sourced by the benchmark scripts: CPU accounting of one PostgreSQL cluster from /proc, and
# waiting for a database's backends to be gone. Needs PM, the postmaster's pid.

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
