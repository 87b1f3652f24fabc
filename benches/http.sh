# Sourced by the benchmark scripts that drive HTTP: an nginx upstream that answers every
# benchmark route 200 `{"ok":true}` with a stub_status listener (which counts what reached it),
# nginx's own proxy hop in front of it, and the gateway's routes to that upstream. Each nginx
# runs one worker in the foreground as a child of the script; stop_nginx (call it from the
# script's cleanup) stops them. Needs WORK (benches/work.sh).

# The request body of every benchmark request: the shared perf harness's, about 200 bytes.
BODY='{"amount":100,"currency":"EUR","note":"perf body padding padding padding padding padding padding padding padding padding padding padding padding padding padding padding pad"}'

# Writes to $1 a wrk script sending one fixed request: `POST` to the path given as wrk's first
# script argument, the body as its second, JSON, `X-Account-Id: acct-1`, and as its third an
# Idempotency-Key (`-` for none).
request_lua() { # file
  cat >"$1" <<'LUA'
function init(args)
  wrk.method = "POST"
  wrk.path = args[1]
  wrk.body = args[2]
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["X-Account-Id"] = "acct-1"
  if args[3] ~= "-" then wrk.headers["Idempotency-Key"] = args[3] end
end
LUA
}

# Writes to $1 a wrk script sending `POST /pay` with a new Idempotency-Key in every request
# (wrk's first script argument as a prefix, then a counter), one of 100 accounts, and wrk's
# second script argument as the JSON body.
new_keys_lua() { # file
  cat >"$1" <<'LUA'
local body, prefix, counter = nil, nil, 0
local headers = { ["Content-Type"] = "application/json" }
function init(args) prefix, body = args[1], args[2] end
function request()
  counter = counter + 1
  headers["Idempotency-Key"] = prefix .. "-" .. counter
  headers["X-Account-Id"] = "acct-" .. (counter % 100)
  return wrk.format("POST", "/pay", headers, body)
end
LUA
}

NGINX_MASTERS=()

# The gateways a script started (their pids), for stop_gateways.
GATEWAYS=()

# Stops the gateways in GATEWAYS and waits for those this shell started (call it from the
# script's cleanup, or to stop one before starting the next); empties GATEWAYS.
stop_gateways() {
  local p
  for p in "${GATEWAYS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${GATEWAYS[@]}"; do wait "$p" 2>/dev/null || true; done
  GATEWAYS=()
}

# Starts an nginx named $1 (its files under $WORK/$1) serving the server blocks $2.
start_nginx() { # name servers
  local user_line=""
  [[ $(id -u) == 0 ]] && user_line="user www-data;"
  mkdir -p "$WORK/$1"
  cat >"$WORK/$1/nginx.conf" <<CONF
worker_processes 1;
daemon off;
$user_line
pid $WORK/$1/nginx.pid;
error_log $WORK/$1/error.log warn;
events { worker_connections 8192; }
http {
    access_log off;
    server_tokens off;
    client_body_temp_path $WORK/$1/body;
    proxy_temp_path $WORK/$1/proxy;
    fastcgi_temp_path $WORK/$1/fastcgi;
    uwsgi_temp_path $WORK/$1/uwsgi;
    scgi_temp_path $WORK/$1/scgi;
    keepalive_requests 100000000;
    keepalive_timeout 120s;
$2
}
CONF
  nginx -c "$WORK/$1/nginx.conf" -e "$WORK/$1/error.log" &
  NGINX_MASTERS+=($!)
}

stop_nginx() {
  local p
  for p in "${NGINX_MASTERS[@]}"; do kill "$p" 2>/dev/null || true; done
}

# The cleanup of a script that starts only gateways and nginx: stops them, waits for them, and
# removes WORK (`trap cleanup_http EXIT`, or call it last from a cleanup of the script's own).
cleanup_http() {
  stop_gateways
  stop_nginx
  wait 2>/dev/null || true
  rm -rf "$WORK"
}

# The upstream: `POST /pay` and `POST /plain/pay` answer 200 on port $1, stub_status on $2.
start_upstream() { # port status_port
  start_nginx upstream "
    server {
        listen 127.0.0.1:$1 backlog=4096;
        default_type application/json;
        location = /pay       { return 200 '{\"ok\":true}'; }
        location = /plain/pay { return 200 '{\"ok\":true}'; }
        location /            { return 404 '{\"ok\":false}'; }
    }
    server {
        listen 127.0.0.1:$2;
        location = /status { stub_status; }
    }"
}

# nginx as a plain proxy hop on port $1 to the upstream on $2: a keep-alive pool and the
# X-Forwarded-* headers the gateway sets, as the shared perf harness's nginx-proxy.
start_proxy() { # port upstream_port
  start_nginx proxy "
    upstream origin {
        server 127.0.0.1:$2;
        keepalive 64;
        keepalive_requests 100000000;
        keepalive_timeout 120s;
    }
    server {
        listen 127.0.0.1:$1 backlog=4096;
        location / {
            proxy_pass http://origin;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_set_header Host \$host;
            proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto \$scheme;
            proxy_set_header X-Forwarded-Host \$host;
        }
    }"
}

# Requests the upstream whose stub_status listens on $1 has served.
served() { curl -s "http://127.0.0.1:$1/status" | awk 'NR == 3 { print $3 }'; }

# The worker of the nginx whose master is $1.
worker_of() { # master_pid
  local w
  for _ in $(seq 50); do
    w=$(ps -o pid= --ppid "$1" | head -1 | tr -d ' ')
    [[ -n $w ]] && { echo "$w"; return; }
    sleep 0.1
  done
  echo "nginx $1 has no worker" >&2
  return 1
}

# Starts the upstream on free ports (sets UP and STATUS) and waits until it answers.
start_answering_upstream() {
  UP=$(free_port) STATUS=$(free_port)
  start_upstream "$UP" "$STATUS"
  wait_answering "$UP" /plain/pay "$WORK"/upstream/error.log
}

# Waits up to 10 s for `POST $2` on port $1 to answer 2xx; on failure prints the logs $3...
wait_answering() { # port path log...
  local port=$1 path=$2
  shift 2
  for _ in $(seq 100); do
    curl -sf -o /dev/null -X POST "http://127.0.0.1:$port$path" && return
    sleep 0.1
  done
  echo "nothing answers POST $path on port $port; the logs:" >&2
  cat "$@" >&2
  return 1
}

# The settings of a benchmark gateway's PostgreSQL store after its `url` (indented under
# `store: postgres:`): the shared perf harness's pool of 32, bounded waits, no TLS.
gateway_store_settings() {
  cat <<'YAML'
    pool_size: 32
    acquire_timeout: 500ms
    connect_timeout: 2s
    statement_timeout: 2s
    tls: { mode: disable }
YAML
}

# Writes to $1 a benchmark gateway's config: listening on port $2, admin on port $3, the
# embedded store under directory $4, the routes of gateway_routes to the upstream UP, and the
# line $5 (say a `server:` block) if given.
embedded_gateway_config() { # file port admin_port store_dir [line]
  cat >"$1" <<YAML
listen: 127.0.0.1:$2
admin: { listen: "127.0.0.1:$3" }
${5:-}
store:
  sqlite: { path: $4/keys.db }
$(gateway_routes "$UP")
YAML
}

# Sets PATH_ and KEY for scenario $1 of the by-turns scripts: replays (`POST /pay`, one new
# Idempotency-Key for the run) or plain requests (`POST /plain/pay`, no key); $2 names the
# caller in the error for another scenario.
scenario_request() { # scenario caller
  case $1 in
    plain) PATH_=/plain/pay KEY=- ;;
    replay) PATH_=/pay KEY=replayed-$RANDOM ;;
    *) echo "$2: unknown scenario $1 (replay, plain)" >&2; exit 2 ;;
  esac
}

# The gateway configuration's `upstreams` and `routes` for an upstream on port $1: the shared
# perf harness's two routes, `pay` (`POST /pay`, key from Idempotency-Key, scope from
# X-Account-Id) and `plain` (`/plain/`, no idempotency).
gateway_routes() { # upstream_port
  cat <<YAML
upstreams:
  origin: { url: "http://127.0.0.1:$1", connect_timeout: 1s, timeout: 10s }
routes:
  - name: pay
    match: { path: /pay, methods: [POST] }
    upstream: origin
    idempotency:
      key: [ { header: Idempotency-Key } ]
      scope: { header: X-Account-Id }
      required: true
      methods: [POST]
      ttl: 24h
      lease: 30s
  - name: plain
    match: { path_prefix: /plain/ }
    upstream: origin
YAML
}
