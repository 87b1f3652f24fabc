//! Test helpers: a gateway on 127.0.0.1:0 against a fresh database and a fake upstream, an
//! HTTP client, and waiting on a condition with a deadline (never sleeping "to settle").

pub mod bin;
pub mod certs;
pub mod fault_proxy;
pub mod history;
pub mod pg;
pub mod pgbouncer;
pub mod process;
pub mod upstream;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idemgate::app::{App, Listeners};
use idemgate::config::{Config, StoreConfig};
use idemgate::gateway::Gateway;
use idemgate::store::Store;
use idemgate::store::postgres::PgStore;
use tokio::net::TcpListener;

pub use upstream::{Behavior, Gate, Upstream};

/// The default keyed route used by most tests, on Postgres; `{idem}` adds idempotency fields.
pub fn config_yaml(db: &str, upstream: &str, idem: &str) -> String {
    config_yaml_store(&pg_store_block(db), upstream, idem)
}

/// The Postgres store block of the test configs.
pub fn pg_store_block(db: &str) -> String {
    format!(
        "  postgres: {{ url: \"{db}\", pool_size: 8, acquire_timeout: 500ms, connect_timeout: 1s, statement_timeout: 1s }}"
    )
}

/// The Postgres store block for a pooler in transaction mode at `pooled`, the wake-up
/// listener on the direct session `direct` (docs/contract.md §8.4).
pub fn pgbouncer_store_block(pooled: &str, direct: &str) -> String {
    format!(
        "  postgres: {{ url: \"{pooled}\", pooler: transaction, listen_url: \"{direct}\", pool_size: 8, acquire_timeout: 500ms, connect_timeout: 1s, statement_timeout: 1s }}"
    )
}

/// The default keyed route on Postgres through the shared PgBouncer in transaction mode.
pub fn config_yaml_pgbouncer(pooled: &str, direct: &str, upstream: &str, idem: &str) -> String {
    config_yaml_store(&pgbouncer_store_block(pooled, direct), upstream, idem)
}

/// The embedded store block of the test configs (its record bound is also 1.5s).
pub fn sqlite_store_block(path: &std::path::Path) -> String {
    format!(
        "  sqlite: {{ path: \"{}\", busy_timeout: 1s }}",
        path.display()
    )
}

/// Which store a conformance test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
    /// PostgreSQL through PgBouncer in transaction mode (`pooler: transaction`), the wake-up
    /// listener on a direct session (`listen_url`).
    Pgbouncer,
    /// PostgreSQL with the keys table hash-partitioned by scope (docs/operations.md).
    Partitioned,
}

/// Test functions `fn name(Backend)` run once per backend, each backend in a module of its
/// own: `backend_tests!(postgres: Postgres, pgbouncer: Pgbouncer; [a, b])` makes
/// `postgres::a`, `postgres::b`, `pgbouncer::a` and `pgbouncer::b`.
macro_rules! backend_tests {
    ($($module:ident: $backend:ident),+ ; $names:tt) => {
        $( crate::support::backend_module!($module, $backend, $names); )+
    };
}
pub(crate) use backend_tests;

macro_rules! backend_module {
    ($module:ident, $backend:ident, [$($name:ident),* $(,)?]) => {
        mod $module {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(crate::support::Backend::$backend).await
                }
            )*
        }
    };
}
pub(crate) use backend_module;

/// A fresh PostgreSQL database reached as `backend` says, and the default config for it:
/// (the YAML, the database's direct URL for the test's own SQL).
pub async fn fresh_config(backend: Backend, upstream: &str, idem: &str) -> (String, String) {
    match backend {
        Backend::Postgres => {
            let db = pg::fresh_database().await;
            (config_yaml(&db, upstream, idem), db)
        }
        Backend::Pgbouncer => {
            let (db, pooled) = pgbouncer::fresh_database().await;
            (config_yaml_pgbouncer(&pooled, &db, upstream, idem), db)
        }
        Backend::Partitioned => {
            let db = pg::fresh_database().await;
            partition_keys_by_scope(&db).await;
            (config_yaml(&db, upstream, idem), db)
        }
        Backend::Sqlite => panic!("a PostgreSQL backend"),
    }
}

/// The head every test config shares (listener, server bounds, the store block), above its
/// own `upstreams:` and `routes:`.
pub fn config_head(store: &str) -> String {
    format!(
        "\nlisten: 127.0.0.1:0\nserver: {{ shutdown_grace: 5s, header_read_timeout: 2s }}\nstore:\n{store}\n"
    )
}

/// The default routes with any store block.
pub fn config_yaml_store(store: &str, upstream: &str, idem: &str) -> String {
    let head = config_head(store);
    format!(
        r#"{head}upstreams:
  app: {{ url: "{upstream}", connect_timeout: 200ms, timeout: 5s }}
routes:
  - name: payments
    match: {{ path_prefix: /pay }}
    upstream: app
    idempotency:
      scope: {{ header: X-Account-Id }}
      {idem}
  - name: rest
    match: {{ path_prefix: / }}
    upstream: app
"#
    )
}

/// A gateway served in this process.
pub struct TestGateway {
    pub addr: SocketAddr,
    /// The store, whichever it is.
    pub store: Arc<dyn Store>,
    /// The same store when it is Postgres (for its pool).
    pg: Option<Arc<PgStore>>,
    /// The database URL (Postgres) or file (embedded store).
    pub db: String,
    /// The admin API (metrics, health, keys), on its own ephemeral port.
    pub admin: SocketAddr,
    /// The gateway itself (its bounds' counters).
    pub gateway: Arc<Gateway>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// A fresh embedded-store file, removed (with its WAL and lock files) when dropped.
pub struct TempDb(pub std::path::PathBuf);

impl TempDb {
    pub fn new() -> TempDb {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idemgate-sqlite-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDb(dir.join("idemgate.db"))
    }
}

impl Drop for TempDb {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// `yaml` with its Postgres wake-up listener pointed at a socket that does not exist: the
/// listener never connects, as when a network or a pooler keeps notifications away, and
/// waiters poll.
pub fn without_wakeups(yaml: &str) -> Config {
    let mut config = Config::from_yaml(yaml).unwrap_or_else(|e| panic!("config: {e}"));
    let StoreConfig::Postgres(pg) = &mut config.store else {
        panic!("wake-ups are a Postgres store's")
    };
    pg.listen_url = "host=/nonexistent-idemgate-listener user=postgres dbname=none".into();
    config
}

/// Edits of a test's config text that fail the test unless the text to edit occurs exactly
/// once: a `str::replace` that matches nothing silently tests the unedited config, and
/// `"timeout: 5s"` also matches `wait_timeout: 5s`.
pub trait Patch {
    fn patch(&self, from: &str, to: &str) -> String;
}

impl<T: AsRef<str> + ?Sized> Patch for T {
    fn patch(&self, from: &str, to: &str) -> String {
        let text = self.as_ref();
        let n = text.matches(from).count();
        assert_eq!(n, 1, "expected {from:?} exactly once in:\n{text}");
        text.replacen(from, to, 1)
    }
}

/// A port on 127.0.0.1 that refuses connections for as long as the returned socket lives:
/// bound, so nobody else gets it, and never listening.
pub fn refused_port() -> (tokio::net::TcpSocket, u16) {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket
        .bind("127.0.0.1:0".parse().unwrap())
        .expect("binding a port to refuse on");
    let port = socket.local_addr().expect("a bound address").port();
    (socket, port)
}

/// A listener and an admin listener on `127.0.0.1:0`: the kernel picks the ports, bound
/// before anyone learns them.
pub async fn local_listeners() -> Listeners {
    Listeners {
        main: TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind gateway"),
        admin: Some(TcpListener::bind("127.0.0.1:0").await.expect("bind admin")),
    }
}

impl TestGateway {
    /// Starts a gateway from YAML through the wiring `serve` uses ([`App::build`] and
    /// [`App::run`]) on listeners bound to `127.0.0.1:0`, the admin plane on one of its own.
    /// The store must answer: the test fails if it could not be prepared (migrated).
    pub async fn start(yaml: &str, db: &str) -> TestGateway {
        let config = Config::from_yaml(yaml).unwrap_or_else(|e| panic!("config: {e}"));
        TestGateway::start_config(config, db).await
    }

    /// As [`start`](Self::start), from a typed configuration (for edits a test makes to it).
    pub async fn start_config(config: Config, db: &str) -> TestGateway {
        init_logs();
        let app = App::build(config, local_listeners().await)
            .await
            .unwrap_or_else(|e| panic!("building the gateway: {e}"));
        assert!(
            app.is_prepared(),
            "the store did not answer or could not be migrated at start"
        );
        TestGateway::run(app, db)
    }

    /// Serves a built app until [`shutdown`](Self::shutdown) (or drop).
    pub fn run(app: App, db: &str) -> TestGateway {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let addr = app.local_addr();
        let admin = app
            .admin_addr()
            .expect("the test gateway has an admin listener");
        let (store, pg, gateway) = (
            Arc::clone(app.store()),
            app.postgres().cloned(),
            Arc::clone(app.gateway()),
        );
        let task = tokio::spawn(async move {
            app.run(async move {
                let _ = rx.await;
            })
            .await
            .unwrap_or_else(|e| panic!("the gateway stopped with an error: {e}"));
        });
        TestGateway {
            addr,
            store,
            pg,
            db: db.to_string(),
            admin,
            gateway,
            stop: Some(tx),
            task: Some(task),
        }
    }

    /// A fresh database, a gateway with the default routes and `idem` fields.
    pub async fn with_upstream(upstream: &Upstream, idem: &str) -> TestGateway {
        let db = pg::fresh_database().await;
        TestGateway::start(&config_yaml(&db, &upstream.url(), idem), &db).await
    }

    /// A fresh store of the given kind, a gateway with the default routes and `idem` fields.
    /// The embedded store's file lives as long as the returned `TempDb`.
    pub async fn on(
        backend: Backend,
        upstream: &Upstream,
        idem: &str,
    ) -> (TestGateway, Option<TempDb>) {
        TestGateway::on_with(backend, upstream, idem, |y| y).await
    }

    /// As [`on`](Self::on), with a last edit of the YAML (e.g. a shorter upstream timeout).
    pub async fn on_with(
        backend: Backend,
        upstream: &Upstream,
        idem: &str,
        edit: impl Fn(String) -> String,
    ) -> (TestGateway, Option<TempDb>) {
        match backend {
            Backend::Postgres | Backend::Pgbouncer | Backend::Partitioned => {
                let (yaml, db) = fresh_config(backend, &upstream.url(), idem).await;
                (TestGateway::start(&edit(yaml), &db).await, None)
            }
            Backend::Sqlite => {
                let file = TempDb::new();
                let yaml = edit(config_yaml_store(
                    &sqlite_store_block(&file.0),
                    &upstream.url(),
                    idem,
                ));
                let gw = TestGateway::start(&yaml, &file.0.display().to_string()).await;
                (gw, Some(file))
            }
        }
    }

    /// The Postgres store (panics on the embedded one).
    pub fn pg(&self) -> &Arc<PgStore> {
        self.pg.as_ref().expect("a Postgres-backed gateway")
    }

    /// Starts graceful shutdown and waits for the server to return.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// A direct connection to this test's database.
    pub async fn sql(&self) -> tokio_postgres::Client {
        sql(&self.db).await
    }
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// Migrates the database `db` and hash-partitions its keys table by scope into eight
/// partitions, as docs/operations.md ("When the keys table grows") shows, before any gateway
/// serves on it.
pub async fn partition_keys_by_scope(db: &str) {
    let yaml = config_yaml(db, "http://127.0.0.1:9", "");
    let config = Config::from_yaml(&yaml).unwrap_or_else(|e| panic!("config: {e}"));
    let StoreConfig::Postgres(pg) = &config.store else {
        panic!("a Postgres store")
    };
    PgStore::new(pg)
        .expect("store")
        .migrate()
        .await
        .expect("migrations");
    let partitions: String = (0..8)
        .map(|r| {
            format!(
                "CREATE TABLE idemgate_keys_p{r} PARTITION OF idemgate_keys \
                 FOR VALUES WITH (MODULUS 8, REMAINDER {r}) WITH (fillfactor = 90);\n"
            )
        })
        .collect();
    sql(db)
        .await
        .batch_execute(&format!(
            "BEGIN;
             ALTER TABLE idemgate_keys RENAME TO idemgate_keys_old;
             CREATE TABLE idemgate_keys (LIKE idemgate_keys_old INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
               PARTITION BY HASH (scope);
             ALTER TABLE idemgate_keys ADD PRIMARY KEY (scope, key);
             CREATE INDEX ON idemgate_keys (gc_after);
             {partitions}
             INSERT INTO idemgate_keys SELECT * FROM idemgate_keys_old;
             DROP TABLE idemgate_keys_old;
             COMMIT;"
        ))
        .await
        .expect("partitioning the keys table");
}

pub async fn sql(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("test SQL connection");
    tokio::spawn(conn);
    client
}

/// The stored state of the key named `key` (any scope); panics when there is no such row.
pub async fn key_state(db: &str, key: &str) -> String {
    sql(db)
        .await
        .query_one("SELECT state FROM idemgate_keys WHERE key = $1", &[&key])
        .await
        .unwrap_or_else(|e| panic!("the row of key {key}: {e}"))
        .get(0)
}

/// What a client received.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }

    /// The problem `type` slug of a problem+json body.
    /// A problem response's `detail`.
    pub fn problem_detail(&self) -> String {
        self.problem();
        self.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    pub fn problem(&self) -> String {
        assert_eq!(
            self.headers["content-type"], "application/problem+json",
            "not a problem response: {self:?}"
        );
        let t = self.json()["type"].as_str().unwrap().to_string();
        t.strip_prefix("urn:idemgate:problem:")
            .unwrap_or_else(|| panic!("bad problem type {t}"))
            .to_string()
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(64)
        .build(HttpConnector::new())
}

/// Sends one request; panics if the connection itself fails (or 30 s pass).
pub async fn send(
    client: &TestClient,
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Reply {
    try_send(client, method, url, headers, body)
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"))
}

/// Sends one request; a failed connection (a killed gateway) is an `Err`.
pub async fn try_send(
    client: &TestClient,
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Result<Reply, String> {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(body.into())).expect("request");
    let resp = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .map_err(|_| "no answer within 30 s".to_string())?
        .map_err(|e| format!("request failed: {e}"))?;
    let (parts, body) = resp.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| format!("body failed: {e}"))?
        .to_bytes();
    Ok(Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    })
}

/// A request to the gateway's admin API, with an `Authorization` header when given.
pub async fn admin_request(
    gw: &TestGateway,
    method: Method,
    path: &str,
    authorization: Option<&str>,
) -> Reply {
    let headers: Vec<(&str, &str)> = authorization
        .iter()
        .map(|a| ("authorization", *a))
        .collect();
    send(
        &client(),
        method,
        &format!("http://{}{path}", gw.admin),
        &headers,
        "",
    )
    .await
}

/// A keyed POST to `url`.
pub async fn post_to(
    client: &TestClient,
    url: &str,
    account: &str,
    key: &str,
    body: &str,
) -> Reply {
    send(
        client,
        Method::POST,
        url,
        &[
            ("idempotency-key", key),
            ("x-account-id", account),
            ("content-type", "application/json"),
        ],
        body.to_string(),
    )
    .await
}

/// A keyed POST to the default route.
pub async fn post(
    client: &TestClient,
    gw: &TestGateway,
    account: &str,
    key: &str,
    body: &str,
) -> Reply {
    post_to(client, &gw.url("/pay"), account, key, body).await
}

/// Sends a keyed POST (`account`, `key`, `body`) to `url` in the background and waits until
/// the upstream is working on it; the handle yields what the client got, or why it got
/// nothing (a killed gateway).
pub async fn in_flight_try(
    url: &str,
    up: &Upstream,
    account: &str,
    key: &str,
    body: &str,
) -> tokio::task::JoinHandle<Result<Reply, String>> {
    let before = up.executions();
    let (c, url) = (client(), url.to_string());
    let (account, key, body) = (account.to_string(), key.to_string(), body.to_string());
    let task = tokio::spawn(async move {
        try_send(
            &c,
            Method::POST,
            &url,
            &[("idempotency-key", &key), ("x-account-id", &account)],
            body,
        )
        .await
    });
    wait_until(
        "the upstream is working on it",
        Duration::from_secs(10),
        || async { up.executions() > before },
    )
    .await;
    task
}

/// As [`in_flight_try`], for a client that must get an answer.
pub async fn in_flight(
    url: &str,
    up: &Upstream,
    account: &str,
    key: &str,
    body: &str,
) -> tokio::task::JoinHandle<Reply> {
    let task = in_flight_try(url, up, account, key, body).await;
    tokio::spawn(async move {
        task.await
            .expect("the request task")
            .unwrap_or_else(|e| panic!("{e}"))
    })
}

/// Sends a keyed POST (`account`, `key`, `body`) to `url` in the background, not waited for.
pub fn spawn_post(
    client: &TestClient,
    url: &str,
    account: &str,
    key: &str,
    body: &str,
) -> tokio::task::JoinHandle<Reply> {
    let c = client.clone();
    let (url, account, key, body) = (
        url.to_string(),
        account.to_string(),
        key.to_string(),
        body.to_string(),
    );
    tokio::spawn(async move {
        send(
            &c,
            Method::POST,
            &url,
            &[("idempotency-key", &key), ("x-account-id", &account)],
            body,
        )
        .await
    })
}

/// Sends keyed POSTs (`account`, `key`) all at once, round-robin over `urls`.
pub async fn at_once(
    urls: &[String],
    keys: Vec<(String, String)>,
    body: &'static str,
) -> Vec<Reply> {
    let c = client();
    let tasks: Vec<_> = keys
        .into_iter()
        .enumerate()
        .map(|(i, (account, key))| spawn_post(&c, &urls[i % urls.len()], &account, &key, body))
        .collect();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.expect("request task"));
    }
    out
}

/// Waits until the store's wake-ups flow (the listener is up and its probe came back).
pub async fn wakeups_flow(gw: &TestGateway) {
    wait_until("wake-ups flow", Duration::from_secs(10), || async {
        gw.gateway.inflight().healthy()
    })
    .await;
}

/// How many sessions of the current database wait for a lock now.
pub async fn lock_waiters(db: &tokio_postgres::Client) -> i64 {
    db.query_one(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = current_database() AND wait_event_type = 'Lock'",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// Waits until `gw` holds exactly `bytes` of request bodies. A keyed request holds its body
/// from its arrival until it is answered, so while the test keeps every answer back (a
/// closed [`Gate`], a held lock), this is "every request the test sent is in the gateway".
pub async fn wait_bodies_held(gw: &TestGateway, bytes: usize) {
    let limit = Duration::from_secs(10);
    let deadline = tokio::time::Instant::now() + limit;
    while gw.gateway.buffered_bytes() != bytes {
        if tokio::time::Instant::now() >= deadline {
            panic!(
                "timed out after {limit:?} waiting until the gateway holds {bytes} bytes of \
                 request bodies (it holds {})",
                gw.gateway.buffered_bytes()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until one session of the current database waits for a lock (a claim blocked
/// behind an uncommitted transaction).
pub async fn wait_for_a_lock_waiter(db: &tokio_postgres::Client) {
    wait_until(
        "a statement waits for a row lock",
        Duration::from_secs(10),
        || async { lock_waiters(db).await == 1 },
    )
    .await;
}

/// The value of the first sample in a `/metrics` text whose line starts with `line_start`.
pub fn metric(text: &str, line_start: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no metric line starting with {line_start} in:\n{text}"))
}

/// `idemgate_requests_total{route, outcome}` summed over its status classes (0 while no
/// series exists).
pub fn requests_counted(text: &str, route: &str, outcome: &str) -> f64 {
    let series = format!("idemgate_requests_total{{route=\"{route}\",outcome=\"{outcome}\",");
    text.lines()
        .filter(|l| l.starts_with(&series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `idemgate_leases_total{route, event}` as `gw` reports it now (a keyed route's series exist
/// at 0 from the start; 0 for a series that does not exist).
pub async fn lease_events(gw: &TestGateway, route: &str, event: &str) -> f64 {
    let scraped = admin_request(gw, Method::GET, "/metrics", None).await;
    let text = String::from_utf8_lossy(&scraped.body);
    let series = format!("idemgate_leases_total{{route=\"{route}\",event=\"{event}\"}} ");
    if text.lines().any(|l| l.starts_with(&series)) {
        metric(&text, &series)
    } else {
        0.0
    }
}

/// Waits until `cond` holds, checking every 20 ms, failing the test after `limit`.
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if cond().await {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {limit:?} waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The scope under which a header scope (`X-Account-Id: account`) is stored.
pub fn scoped(account: &str) -> String {
    format!("header:{account}")
}

/// The state of the row of `account`'s key (a header scope), if any.
pub async fn row_state(gw: &TestGateway, account: &str, key: &str) -> Option<String> {
    gw.store
        .inspect(&scoped(account), key)
        .await
        .expect("inspect")
        .map(|i| i.state)
}

/// Gateway logs in test output, filtered by `RUST_LOG` (off unless set).
pub fn init_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok(filter) = std::env::var("RUST_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_test_writer()
                .try_init();
        }
    });
}
