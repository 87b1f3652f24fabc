//! Configuration: the YAML file of SPEC section 4, in two stages.
//!
//! 1. The text is parsed by serde-saphyr into a generic tree, `${VAR}` references in string
//!    values are replaced from the environment, and the tree is deserialized into the `Raw*`
//!    types below (`deny_unknown_fields`, everything optional that has a default) while the
//!    YAML path of every node is tracked, so an error reads `routes[1].idempotency.ttl: ...`.
//! 2. [`validate`] turns the raw types into [`Config`]: real `Duration`s and byte sizes,
//!    parsed methods and header names, compiled routes, resolved upstreams, and cross-field
//!    checks (a lease must outlive its upstream's timeout).
//!
//! Invariants of a [`Config`]: every route names an existing upstream; every keyed route's
//! `lease` is longer than that upstream's `timeout` and not longer than its `ttl`; route names
//! are unique; TLS files named by the config were readable when it was validated.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use http::{HeaderName, Method};
use serde::Deserialize;
use serde_json::Value;

/// A configuration error: the YAML path it concerns and what is wrong there.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid YAML: {0}")]
    Yaml(String),
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

fn invalid(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}

// ---------------------------------------------------------------------------------------------
// Raw types: exactly what the YAML may say.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    listen: Option<String>,
    admin: Option<RawAdmin>,
    #[serde(default)]
    server: RawServer,
    store: RawStore,
    upstreams: BTreeMap<String, RawUpstream>,
    routes: Vec<RawRoute>,
    replay_cache: Option<RawReplayCache>,
    log: Option<RawLog>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLog {
    format: Option<LogFormat>,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplayCache {
    max_bytes: Option<RawSize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    listen: String,
    token: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    max_connections: Option<usize>,
    max_header_bytes: Option<RawSize>,
    header_read_timeout: Option<String>,
    body_read_timeout: Option<String>,
    shutdown_grace: Option<String>,
    drain_delay: Option<String>,
    max_buffered_bytes: Option<RawSize>,
    worker_threads: Option<usize>,
    tls: Option<RawServerTls>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServerTls {
    cert: String,
    key: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCaOnly {
    ca: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    postgres: Option<RawPostgres>,
    sqlite: Option<RawSqlite>,
    gc: Option<RawGc>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGc {
    interval: Option<String>,
    batch_size: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPostgres {
    url: String,
    listen_url: Option<String>,
    pooler: Option<String>,
    pool_size: Option<usize>,
    acquire_timeout: Option<String>,
    connect_timeout: Option<String>,
    statement_timeout: Option<String>,
    tls: Option<RawPgTls>,
    allow_async_commit: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSqlite {
    path: String,
    busy_timeout: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPgTls {
    mode: String,
    ca: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    url: String,
    connect_timeout: Option<String>,
    timeout: Option<String>,
    max_in_flight: Option<usize>,
    tls: Option<RawCaOnly>,
    http2: Option<bool>,
    preserve_host: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    name: String,
    #[serde(rename = "match")]
    matcher: RawMatch,
    upstream: String,
    idempotency: Option<RawIdempotency>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    path: Option<String>,
    path_prefix: Option<String>,
    methods: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawIdempotency {
    mode: Option<Mode>,
    key: Option<Vec<RawKeySource>>,
    scope: Option<RawScope>,
    required: Option<bool>,
    methods: Option<Vec<String>>,
    fingerprint: Option<RawFingerprint>,
    ttl: Option<String>,
    lease: Option<String>,
    in_flight: Option<InFlight>,
    wait_timeout: Option<String>,
    retry_statuses: Option<Vec<RawStatus>>,
    on_unknown_outcome: Option<OnUnknownOutcome>,
    on_store_error: Option<OnStoreError>,
    max_request_body: Option<RawSize>,
    max_stored_response: Option<RawSize>,
    replay_headers: Option<Vec<String>>,
    forward_key_header: Option<String>,
    serialize: Option<RawSerialize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSerialize {
    max_in_flight: Option<u32>,
    wait_timeout: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
enum RawKeySource {
    Header(String),
    Json(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
enum RawScope {
    Header(String),
    Json(String),
    Authorization(bool),
    Fixed(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFingerprint {
    #[serde(default)]
    headers: Vec<String>,
    #[serde(default)]
    json_canonical: bool,
    #[serde(default)]
    json_ignore: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawStatus {
    Code(u16),
    Range(String),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawSize {
    Bytes(u64),
    Text(String),
}

// ---------------------------------------------------------------------------------------------
// Validated types.
// ---------------------------------------------------------------------------------------------

/// The whole validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub listen: SocketAddr,
    pub admin: Option<AdminConfig>,
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub gc: GcConfig,
    /// Bytes of completed responses kept in memory for hot replays; 0 disables the cache.
    pub replay_cache_bytes: usize,
    pub log_format: LogFormat,
    /// Upstreams by name.
    pub upstreams: BTreeMap<String, UpstreamConfig>,
    /// Routes in file order: the first that matches wins.
    pub routes: Vec<Route>,
}

#[derive(Clone, PartialEq)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// Bearer token for the key API; never printed (see the Debug impl).
    pub token: Option<String>,
}

impl std::fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    /// Connections served at once; further ones wait in the listen backlog.
    pub max_connections: usize,
    /// Largest request head accepted (431 beyond it); at least 8KiB (hyper's minimum).
    pub max_header_bytes: usize,
    /// Time a client has to send a complete request head (slowloris bound).
    pub header_read_timeout: Duration,
    /// Time a client has to send a keyed request's whole body (it is read before the claim).
    pub body_read_timeout: Duration,
    /// Time in-flight requests get to finish after SIGTERM/SIGINT, once the listener has
    /// stopped accepting.
    pub shutdown_grace: Duration,
    /// After SIGTERM/SIGINT, how long `/readyz` answers 503 while the listener still
    /// accepts and serves (SPEC 8.3), so load balancers stop sending before it closes. Zero
    /// (the default) closes the listener at once.
    pub drain_delay: Duration,
    /// Request bodies and captured responses held in memory at once, across all requests
    /// (SPEC 8.2); past it new requests get 503 `overloaded`.
    pub max_buffered_bytes: usize,
    /// Threads of the runtime that serves requests (default: the cores available).
    pub worker_threads: usize,
    /// TLS on the listener (HTTP/1.1 and h2 by ALPN); plain HTTP (and h2c) without.
    pub tls: Option<TlsFiles>,
}

/// A certificate chain and its private key, as PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
}

/// How the store's connections use TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PgTlsMode {
    Disable,
    /// Encrypted; the server's certificate is not checked (libpq's `sslmode=require`).
    Require,
    /// Encrypted; chain and host name checked (libpq's `sslmode=verify-full`).
    VerifyFull,
}

/// What sits between the gateway and PostgreSQL on `url` (`store.postgres.pooler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooler {
    /// A direct session, or a pooler in session mode: named prepared statements, cached per
    /// connection, and the server's `statement_timeout` set as a startup option.
    None,
    /// A pooler in transaction mode (PgBouncer `pool_mode = transaction`): a session is lent
    /// for one transaction only, so nothing may outlive one. Unnamed statements (parse, bind
    /// and execute in one round trip), no startup options, and the statement bound kept by
    /// the client, which cancels a statement that outlives it.
    Transaction,
}

/// Collection of expired rows: one instance at a time, in small batches.
#[derive(Debug, Clone, PartialEq)]
pub struct GcConfig {
    pub interval: Duration,
    pub batch_size: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum StoreConfig {
    Postgres(PostgresConfig),
    Sqlite(SqliteConfig),
}

impl StoreConfig {
    /// The longest one store call may take: a pool acquire plus one statement. A lease must
    /// cover the upstream's timeout plus this, so an answer can be recorded before it ends.
    pub fn record_bound(&self) -> Duration {
        match self {
            StoreConfig::Postgres(pg) => pg.acquire_timeout + pg.statement_timeout,
            StoreConfig::Sqlite(sq) => sq.busy_timeout + Duration::from_millis(500),
        }
    }
}

/// The embedded store: one SQLite file, one gateway instance.
#[derive(Debug, Clone, PartialEq)]
pub struct SqliteConfig {
    pub path: std::path::PathBuf,
    /// How long a statement waits for SQLite's write lock.
    pub busy_timeout: Duration,
}

#[derive(Clone, PartialEq)]
pub struct PostgresConfig {
    pub url: String,
    /// The direct session that LISTENs for wake-ups (SPEC 8.4); `url` when not given.
    pub listen_url: String,
    /// What `url` points at: PostgreSQL itself or a pooler in transaction mode.
    pub pooler: Pooler,
    pub pool_size: usize,
    /// Bound on waiting for a pooled connection (including creating one).
    pub acquire_timeout: Duration,
    /// Bound on opening one new connection.
    pub connect_timeout: Duration,
    /// Server-side `statement_timeout`, also enforced on the client side.
    pub statement_timeout: Duration,
    pub tls: PgTlsMode,
    /// CA file for `verify-full` (the platform's roots without one).
    pub tls_ca: Option<std::path::PathBuf>,
    /// Accept a database whose `synchronous_commit` is `off` (SPEC 8.4). Such a database
    /// can lose a commit that a client was already answered from (guarantee 3), so `serve`
    /// refuses it and `/readyz` fails unless this says the operator chose that.
    pub allow_async_commit: bool,
}

/// The URL may hold a password: it is never printed.
impl std::fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &"<redacted>")
            .field("pool_size", &self.pool_size)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("tls", &self.tls)
            .field("tls_ca", &self.tls_ca)
            .field("allow_async_commit", &self.allow_async_commit)
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamConfig {
    pub name: String,
    /// Base URI: scheme and authority, with an optional path prefix (no trailing slash).
    pub url: http::Uri,
    pub connect_timeout: Duration,
    /// Bound on the whole exchange: sending the request and reading the response head (and,
    /// for keyed requests, the body that is stored).
    pub timeout: Duration,
    /// Requests being forwarded to this upstream at once, detached work included (SPEC 8.2).
    pub max_in_flight: usize,
    /// CA file that verifies an `https` upstream (the platform's roots without one).
    pub tls_ca: Option<std::path::PathBuf>,
    /// Speak HTTP/2 to it: h2c with prior knowledge for `http://`, and `h2` offered before
    /// `http/1.1` by ALPN for `https://` (the upstream picks). Off, only HTTP/1.1 is spoken,
    /// which is what a legacy service is sure to understand.
    pub http2: bool,
    /// Send the client's `Host` (HTTP/1.1 `Host`, h2 `:authority`) instead of the upstream's
    /// authority, for virtual hosts and absolute links. The connection still goes to `url`,
    /// and an `https` upstream is still verified under the name in `url`.
    pub preserve_host: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub name: String,
    pub path: PathMatch,
    /// Methods the route matches; `None` matches every method.
    pub methods: Option<Vec<Method>>,
    pub upstream: String,
    pub idempotency: Option<Idempotency>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    Exact(String),
    Prefix(String),
}

impl PathMatch {
    /// Whether a normalized request path matches (SPEC section 8.1): an exact path with or
    /// without one trailing slash; a prefix on a segment boundary (`/api` matches `/api` and
    /// `/api/x`, never `/apix`). Configured paths are normalized at load, and a prefix is
    /// kept without its trailing slash (`/` stays `/`).
    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathMatch::Exact(p) => {
                let p = p.strip_suffix('/').filter(|s| !s.is_empty()).unwrap_or(p);
                let path = path
                    .strip_suffix('/')
                    .filter(|s| !s.is_empty())
                    .unwrap_or(path);
                path == p
            }
            PathMatch::Prefix(p) if p == "/" => true,
            PathMatch::Prefix(p) => path
                .strip_prefix(p.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/')),
        }
    }

    /// The path a matched request is fingerprinted and forwarded with: an exact route's
    /// configured spelling (so `/a` and `/a/` are one request), a prefix route's request
    /// path as normalized.
    pub fn canonical<'a>(&'a self, path: &'a str) -> &'a str {
        match self {
            PathMatch::Exact(p) => p,
            PathMatch::Prefix(_) => path,
        }
    }
}

impl Route {
    pub fn matches(&self, method: &Method, path: &str) -> bool {
        self.path.matches(path)
            && self
                .methods
                .as_ref()
                .is_none_or(|methods| methods.contains(method))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    Header(HeaderName),
    /// A JSON pointer (RFC 6901) into the request body.
    Json(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScopeSource {
    Header(HeaderName),
    Json(String),
    /// SHA-256 of the `Authorization` header value; the credential is never stored.
    Authorization,
    Fixed(String),
}

/// Whether a keyed route enforces idempotency or only observes what enforcing would do
/// (SPEC 8.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Replay, wait, refuse mismatches and store trouble, as SPEC section 2 says.
    #[default]
    Enforce,
    /// Claim, fingerprint and record as `Enforce` does, but always forward: what enforcing
    /// would have done is counted (`idemgate_observed_total`) and logged, never done.
    Observe,
}

impl Mode {
    /// The name the config uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Observe => "observe",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InFlight {
    Wait,
    Reject,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnUnknownOutcome {
    Reforward,
    Hold,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    Reject,
    PassThrough,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct FingerprintConfig {
    /// Request headers that take part in the fingerprint, in this order.
    pub headers: Vec<HeaderName>,
    /// Hash the body as canonical JSON (sorted keys, no insignificant white space).
    pub json_canonical: bool,
    /// JSON pointers removed before hashing (only with `json_canonical`).
    pub json_ignore: Vec<String>,
}

/// Statuses that release the claim instead of being stored: ranges, inclusive.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusSet(Vec<(u16, u16)>);

impl StatusSet {
    pub fn contains(&self, status: u16) -> bool {
        self.0.iter().any(|&(lo, hi)| lo <= status && status <= hi)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Idempotency {
    /// `enforce` (the default) or `observe` (a shadow rollout).
    pub mode: Mode,
    pub key: Vec<KeySource>,
    pub scope: ScopeSource,
    pub required: bool,
    pub methods: Vec<Method>,
    pub fingerprint: FingerprintConfig,
    pub ttl: Duration,
    pub lease: Duration,
    pub in_flight: InFlight,
    pub wait_timeout: Duration,
    pub retry_statuses: StatusSet,
    pub on_unknown_outcome: OnUnknownOutcome,
    pub on_store_error: OnStoreError,
    pub max_request_body: usize,
    pub max_stored_response: usize,
    pub replay_headers: Vec<HeaderName>,
    pub forward_key_header: HeaderName,
    /// Per-scope limit on concurrent forwards, across all instances.
    pub serialize: Option<SerializeConfig>,
}

/// `serialize`: at most `max_in_flight` keyed requests of one scope are forwarded at once;
/// the rest queue (fairly within an instance) for up to `wait_timeout`, then get 409. The
/// limit is this route's own: routes sharing a scope never add their limits up (see
/// `serialize.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SerializeConfig {
    pub max_in_flight: u32,
    pub wait_timeout: Duration,
}

impl Idempotency {
    /// Whether any part of the key or scope must be read from a JSON body.
    pub fn needs_json(&self) -> bool {
        self.key.iter().any(|k| matches!(k, KeySource::Json(_)))
            || matches!(self.scope, ScopeSource::Json(_))
            || self.fingerprint.json_canonical
    }
}

/// Defaults, in one place (SPEC section 4).
pub mod defaults {
    use std::time::Duration;

    pub const LISTEN: &str = "0.0.0.0:8080";
    pub const MAX_CONNECTIONS: usize = 10_000;
    pub const MAX_HEADER_BYTES: usize = 64 * 1024;
    pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
    pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
    pub const DRAIN_DELAY: Duration = Duration::ZERO;
    pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
    pub const MAX_BUFFERED_BYTES: usize = 256 * 1024 * 1024;
    pub const UPSTREAM_MAX_IN_FLIGHT: usize = 1024;
    pub const POOL_SIZE: usize = 16;
    pub const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(2);
    pub const GC_INTERVAL: Duration = Duration::from_secs(60);
    pub const GC_BATCH_SIZE: usize = 1000;
    pub const REPLAY_CACHE_BYTES: usize = 64 * 1024 * 1024;
    pub const ACQUIRE_TIMEOUT: Duration = Duration::from_millis(500);
    pub const PG_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
    pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(2);
    pub const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
    pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);
    pub const KEY_HEADER: &str = "idempotency-key";
    pub const METHODS: [&str; 2] = ["POST", "PATCH"];
    pub const TTL: Duration = Duration::from_secs(24 * 3600);
    /// Added to the upstream timeout when `lease` is not given.
    pub const LEASE_MARGIN: Duration = Duration::from_secs(15);
    pub const WAIT_TIMEOUT: Duration = Duration::from_secs(10);
    pub const RETRY_STATUSES: [(u16, u16); 4] = [(408, 408), (425, 425), (429, 429), (500, 599)];
    pub const MAX_REQUEST_BODY: usize = 1024 * 1024;
    pub const MAX_STORED_RESPONSE: usize = 1024 * 1024;
    pub const REPLAY_HEADERS: [&str; 10] = [
        "content-type",
        "content-encoding",
        "content-language",
        "location",
        "content-location",
        "etag",
        "last-modified",
        "link",
        "cache-control",
        "retry-after",
    ];
}

// ---------------------------------------------------------------------------------------------
// Loading.
// ---------------------------------------------------------------------------------------------

impl Config {
    /// Settings that are valid but likely wrong, for `check` and `serve` to print at load:
    /// a `shutdown_grace` shorter than a keyed upstream's `timeout` plus the time to record
    /// its answer cuts such forwards at every rolling deploy, and their keys are forwarded
    /// again by the next attempt (or held).
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let record = self.store.record_bound();
        let mut seen = std::collections::BTreeSet::new();
        for route in &self.routes {
            if route.idempotency.is_none() || !seen.insert(route.upstream.as_str()) {
                continue;
            }
            let Some(up) = self.upstreams.get(&route.upstream) else {
                continue;
            };
            let needed = up.timeout + record;
            if self.server.shutdown_grace < needed {
                out.push(format!(
                    "server.shutdown_grace ({}) is shorter than upstreams.{}.timeout plus the \
                     time to record an answer ({}): a shutdown can cut a keyed forward, and its \
                     key is then forwarded again (or held) by the next attempt; raise \
                     shutdown_grace to at least {}",
                    fmt_duration(self.server.shutdown_grace),
                    up.name,
                    fmt_duration(needed),
                    fmt_duration(needed),
                ));
            }
        }
        if let StoreConfig::Postgres(pg) = &self.store
            && pg.pooler == Pooler::Transaction
            && pg.listen_url == pg.url
        {
            out.push(
                "store.postgres.pooler is 'transaction' but store.postgres.listen_url is not \
                 set: the wake-up listener goes through the pooler, which does not deliver \
                 notifications, so waiters will poll; point listen_url at PostgreSQL itself"
                    .into(),
            );
        }
        out
    }

    /// The first route in file order that matches (SPEC section 2, step 1).
    pub fn route_for(&self, method: &Method, path: &str) -> Option<&Route> {
        self.routes.iter().find(|r| r.matches(method, path))
    }

    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Config::from_yaml(&text)
    }

    /// Parses and validates config text, reading `${VAR}` from the process environment.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        Config::from_yaml_with_env(text, &|name| std::env::var(name).ok())
    }

    /// Parses and validates config text with an explicit environment (for tests).
    pub fn from_yaml_with_env(
        text: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let mut tree: Value =
            serde_saphyr::from_str(text).map_err(|e| ConfigError::Yaml(e.to_string()))?;
        if tree.is_null() {
            return Err(invalid("(root)", "the file is empty"));
        }
        interpolate(&mut tree, "", env)?;
        let raw: RawConfig = serde_path_to_error::deserialize(tree).map_err(|e| {
            let path = e.path().to_string();
            let path = if path == "." { "(root)".into() } else { path };
            invalid(path, e.into_inner().to_string())
        })?;
        validate(raw)
    }
}

/// Replaces `${VAR}` in every string of the tree; `$$` stands for a literal `$`.
fn interpolate(
    value: &mut Value,
    path: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    match value {
        Value::String(s) if s.contains('$') => {
            *s = interpolate_str(s, env).map_err(|m| invalid(display_path(path), m))?;
        }
        Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                interpolate(item, &format!("{path}[{i}]"), env)?;
            }
        }
        Value::Object(map) => {
            for (k, item) in map.iter_mut() {
                let sub = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                interpolate(item, &sub, env)?;
            }
        }
        _ => {}
    }
    Ok(())
}

fn display_path(path: &str) -> String {
    if path.is_empty() {
        "(root)".into()
    } else {
        path.into()
    }
}

fn interpolate_str(s: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(tail) = after.strip_prefix('{') {
            let end = tail
                .find('}')
                .ok_or_else(|| "unterminated '${' (write '$$' for a literal '$')".to_string())?;
            let name = &tail[..end];
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(format!("invalid environment variable name '{name}'"));
            }
            let val = env(name).ok_or_else(|| format!("environment variable {name} is not set"))?;
            out.push_str(&val);
            rest = &tail[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// Parses `250ms`, `10s`, `5m`, `24h`, `7d` (one number and one unit).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("'{s}' has no unit: write e.g. 250ms, 10s, 5m, 24h or 7d"))?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration: write e.g. 250ms, 10s, 5m, 24h or 7d"))?;
    let ms = match unit {
        "ms" => Some(n),
        "s" => n.checked_mul(1000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        "d" => n.checked_mul(86_400_000),
        _ => {
            return Err(format!(
                "'{s}' has an unknown unit '{unit}': use ms, s, m, h or d"
            ));
        }
    }
    .ok_or_else(|| format!("'{s}' is too large"))?;
    Ok(Duration::from_millis(ms))
}

/// Parses `512`, `512B`, `64KiB`, `1MiB`, `1GiB` (also `KB`, `MB`, `GB` as powers of 1000).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size: write e.g. 64KiB or 1MiB"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "'{s}' has an unknown unit '{other}': use B, KiB, MiB or GiB"
            ));
        }
    };
    n.checked_mul(mult)
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| format!("'{s}' is too large"))
}

// ---------------------------------------------------------------------------------------------
// Validation.
// ---------------------------------------------------------------------------------------------

fn duration_or(path: &str, v: Option<&String>, default: Duration) -> Result<Duration, ConfigError> {
    match v {
        None => Ok(default),
        Some(s) => {
            let d = parse_duration(s).map_err(|m| invalid(path, m))?;
            if d.is_zero() {
                return Err(invalid(path, "must be greater than zero"));
            }
            Ok(d)
        }
    }
}

/// As [`duration_or`], but zero is allowed (`0s` switches the delay off).
fn duration_or_zero(
    path: &str,
    v: Option<&String>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    match v {
        None => Ok(default),
        Some(s) => parse_duration(s).map_err(|m| invalid(path, m)),
    }
}

fn size_or(path: &str, v: Option<&RawSize>, default: usize) -> Result<usize, ConfigError> {
    match v {
        None => Ok(default),
        Some(RawSize::Bytes(n)) => usize::try_from(*n).map_err(|_| invalid(path, "too large")),
        Some(RawSize::Text(s)) => parse_size(s).map_err(|m| invalid(path, m)),
    }
}

fn socket_addr(path: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse().map_err(|_| {
        invalid(
            path,
            format!("'{s}' is not an address: write IP:PORT, e.g. 0.0.0.0:8080"),
        )
    })
}

fn methods(path: &str, list: &[String]) -> Result<Vec<Method>, ConfigError> {
    if list.is_empty() {
        return Err(invalid(path, "must name at least one method"));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let upper = m.to_ascii_uppercase();
            Method::from_bytes(upper.as_bytes())
                .map_err(|_| invalid(format!("{path}[{i}]"), format!("'{m}' is not a method")))
        })
        .collect()
}

fn header_name(path: &str, s: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(s.as_bytes())
        .map_err(|_| invalid(path, format!("'{s}' is not a valid header name")))
}

fn json_pointer(path: &str, s: &str) -> Result<String, ConfigError> {
    if !s.starts_with('/') {
        return Err(invalid(
            path,
            format!("'{s}' is not a JSON pointer: it must start with '/', e.g. /event_id"),
        ));
    }
    Ok(s.to_string())
}

fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
    let listen = socket_addr("listen", raw.listen.as_deref().unwrap_or(defaults::LISTEN))?;

    let admin = match raw.admin {
        None => None,
        Some(a) => {
            if a.token.as_deref().is_some_and(|t| t.len() < 16) {
                return Err(invalid(
                    "admin.token",
                    "must be at least 16 characters (it guards the key API)",
                ));
            }
            let listen = socket_addr("admin.listen", &a.listen)?;
            if !listen.ip().is_loopback() && a.token.is_none() {
                return Err(invalid(
                    "admin.token",
                    format!(
                        "is required when admin.listen ({listen}) is not a loopback address: \
                         the key API can release and delete keys"
                    ),
                ));
            }
            Some(AdminConfig {
                listen,
                token: a.token,
            })
        }
    };

    let server_tls = match raw.server.tls {
        None => None,
        Some(t) => {
            let files = TlsFiles {
                cert: t.cert.into(),
                key: t.key.into(),
            };
            // Load it now, so `check` and a reload catch a bad file, naming it.
            crate::tls::server_config(&files.cert, &files.key)
                .map_err(|m| invalid("server.tls", m))?;
            Some(files)
        }
    };
    let max_connections = raw
        .server
        .max_connections
        .unwrap_or(defaults::MAX_CONNECTIONS);
    if max_connections == 0 {
        return Err(invalid("server.max_connections", "must be at least 1"));
    }
    let max_header_bytes = size_or(
        "server.max_header_bytes",
        raw.server.max_header_bytes.as_ref(),
        defaults::MAX_HEADER_BYTES,
    )?;
    if max_header_bytes < 8192 {
        return Err(invalid("server.max_header_bytes", "must be at least 8KiB"));
    }
    let server = ServerConfig {
        max_connections,
        max_header_bytes,
        header_read_timeout: duration_or(
            "server.header_read_timeout",
            raw.server.header_read_timeout.as_ref(),
            defaults::HEADER_READ_TIMEOUT,
        )?,
        body_read_timeout: duration_or(
            "server.body_read_timeout",
            raw.server.body_read_timeout.as_ref(),
            defaults::BODY_READ_TIMEOUT,
        )?,
        shutdown_grace: duration_or(
            "server.shutdown_grace",
            raw.server.shutdown_grace.as_ref(),
            defaults::SHUTDOWN_GRACE,
        )?,
        drain_delay: duration_or_zero(
            "server.drain_delay",
            raw.server.drain_delay.as_ref(),
            defaults::DRAIN_DELAY,
        )?,
        max_buffered_bytes: size_or(
            "server.max_buffered_bytes",
            raw.server.max_buffered_bytes.as_ref(),
            defaults::MAX_BUFFERED_BYTES,
        )?,
        worker_threads: match raw.server.worker_threads {
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
            Some(0) => return Err(invalid("server.worker_threads", "must be at least 1")),
            Some(n) => n,
        },
        tls: server_tls,
    };
    if server.max_buffered_bytes == 0 {
        return Err(invalid("server.max_buffered_bytes", "must be at least 1"));
    }

    let store = match (raw.store.postgres, raw.store.sqlite) {
        (None, None) => {
            return Err(invalid(
                "store",
                "give 'postgres: { url: ... }' or 'sqlite: { path: ... }'",
            ));
        }
        (Some(_), Some(_)) => {
            return Err(invalid(
                "store",
                "give either 'postgres' or 'sqlite', not both",
            ));
        }
        (None, Some(sq)) => {
            if cfg!(not(feature = "sqlite")) {
                return Err(invalid(
                    "store.sqlite",
                    "this build has no embedded store (built without the 'sqlite' feature)",
                ));
            }
            if sq.path.is_empty() {
                return Err(invalid("store.sqlite.path", "must not be empty"));
            }
            StoreConfig::Sqlite(SqliteConfig {
                path: sq.path.into(),
                busy_timeout: duration_or(
                    "store.sqlite.busy_timeout",
                    sq.busy_timeout.as_ref(),
                    defaults::SQLITE_BUSY_TIMEOUT,
                )?,
            })
        }
        (Some(pg), None) => {
            let (tls_mode, tls_ca) = match &pg.tls {
                None => (PgTlsMode::Disable, None),
                Some(tls) => {
                    let mode = match tls.mode.as_str() {
                        "disable" => PgTlsMode::Disable,
                        "require" => PgTlsMode::Require,
                        "verify-full" => PgTlsMode::VerifyFull,
                        other => {
                            return Err(invalid(
                                "store.postgres.tls.mode",
                                format!("'{other}' is not one of disable, require, verify-full"),
                            ));
                        }
                    };
                    let ca = tls.ca.as_ref().map(std::path::PathBuf::from);
                    if let Some(ca) = &ca {
                        if mode != PgTlsMode::VerifyFull {
                            return Err(invalid(
                                "store.postgres.tls.ca",
                                "only 'verify-full' checks certificates against a CA",
                            ));
                        }
                        crate::tls::roots(Some(ca))
                            .map_err(|m| invalid("store.postgres.tls.ca", m))?;
                    } else if mode == PgTlsMode::VerifyFull {
                        crate::tls::roots(None).map_err(|m| invalid("store.postgres.tls.ca", m))?;
                    }
                    (mode, ca)
                }
            };
            if pg.url.parse::<tokio_postgres::Config>().is_err() {
                // Never echo the URL: it may hold a password.
                return Err(invalid(
                    "store.postgres.url",
                    "not a valid PostgreSQL connection string (postgres://user:pass@host:port/db)",
                ));
            }
            if let Some(listen) = &pg.listen_url
                && listen.parse::<tokio_postgres::Config>().is_err()
            {
                return Err(invalid(
                    "store.postgres.listen_url",
                    "not a valid PostgreSQL connection string (postgres://user:pass@host:port/db)",
                ));
            }
            let pooler = match pg.pooler.as_deref() {
                None | Some("none") => Pooler::None,
                Some("transaction") => Pooler::Transaction,
                Some(other) => {
                    return Err(invalid(
                        "store.postgres.pooler",
                        format!("'{other}' is not one of none, transaction"),
                    ));
                }
            };
            let pool_size = pg.pool_size.unwrap_or(defaults::POOL_SIZE);
            if pool_size == 0 {
                return Err(invalid("store.postgres.pool_size", "must be at least 1"));
            }
            StoreConfig::Postgres(PostgresConfig {
                listen_url: pg.listen_url.unwrap_or_else(|| pg.url.clone()),
                url: pg.url,
                pooler,
                pool_size,
                acquire_timeout: duration_or(
                    "store.postgres.acquire_timeout",
                    pg.acquire_timeout.as_ref(),
                    defaults::ACQUIRE_TIMEOUT,
                )?,
                connect_timeout: duration_or(
                    "store.postgres.connect_timeout",
                    pg.connect_timeout.as_ref(),
                    defaults::PG_CONNECT_TIMEOUT,
                )?,
                statement_timeout: duration_or(
                    "store.postgres.statement_timeout",
                    pg.statement_timeout.as_ref(),
                    defaults::STATEMENT_TIMEOUT,
                )?,
                tls: tls_mode,
                tls_ca,
                allow_async_commit: pg.allow_async_commit.unwrap_or(false),
            })
        }
    };

    let gc = GcConfig {
        interval: duration_or(
            "store.gc.interval",
            raw.store.gc.as_ref().and_then(|g| g.interval.as_ref()),
            defaults::GC_INTERVAL,
        )?,
        batch_size: match raw.store.gc.as_ref().and_then(|g| g.batch_size) {
            None => defaults::GC_BATCH_SIZE,
            Some(0) => return Err(invalid("store.gc.batch_size", "must be at least 1")),
            Some(n) => n,
        },
    };

    let mut upstreams = BTreeMap::new();
    for (name, up) in raw.upstreams {
        let base = format!("upstreams.{name}");
        let url: http::Uri = up
            .url
            .parse()
            .map_err(|_| invalid(format!("{base}.url"), format!("'{}' is not a URL", up.url)))?;
        let https = match url.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => {
                return Err(invalid(
                    format!("{base}.url"),
                    "must start with http:// or https://, e.g. http://127.0.0.1:9000",
                ));
            }
        };
        let tls_ca = match up.tls.and_then(|t| t.ca) {
            None => None,
            Some(ca) => {
                if !https {
                    return Err(invalid(
                        format!("{base}.tls.ca"),
                        "only an https:// upstream uses a CA",
                    ));
                }
                let ca = std::path::PathBuf::from(ca);
                crate::tls::roots(Some(&ca)).map_err(|m| invalid(format!("{base}.tls.ca"), m))?;
                Some(ca)
            }
        };
        if https && tls_ca.is_none() {
            // Without a CA file the platform's roots verify it: there must be some.
            crate::tls::roots(None).map_err(|m| invalid(format!("{base}.tls.ca"), m))?;
        }
        if url.authority().is_none() {
            return Err(invalid(format!("{base}.url"), "has no host"));
        }
        if url.query().is_some() {
            return Err(invalid(format!("{base}.url"), "must not have a query"));
        }
        let timeout = duration_or(
            &format!("{base}.timeout"),
            up.timeout.as_ref(),
            defaults::UPSTREAM_TIMEOUT,
        )?;
        // Unset, it is the default or half of `timeout`, whichever is shorter.
        let connect_timeout = duration_or(
            &format!("{base}.connect_timeout"),
            up.connect_timeout.as_ref(),
            defaults::UPSTREAM_CONNECT_TIMEOUT.min(timeout / 2),
        )?;
        // A connect that runs into `timeout` would be reported as a timeout (outcome
        // unknown) although nothing was sent; so connecting must give up first.
        if connect_timeout >= timeout {
            return Err(invalid(
                format!("{base}.connect_timeout"),
                format!(
                    "must be shorter than {base}.timeout ({}), so a failed connect is told \
                     apart from a request that may have been processed",
                    fmt_duration(timeout)
                ),
            ));
        }
        let max_in_flight = up.max_in_flight.unwrap_or(defaults::UPSTREAM_MAX_IN_FLIGHT);
        if max_in_flight == 0 {
            return Err(invalid(
                format!("{base}.max_in_flight"),
                "must be at least 1",
            ));
        }
        upstreams.insert(
            name.clone(),
            UpstreamConfig {
                name: name.clone(),
                url,
                connect_timeout,
                timeout,
                max_in_flight,
                tls_ca,
                http2: up.http2.unwrap_or(false),
                preserve_host: up.preserve_host.unwrap_or(false),
            },
        );
    }

    if raw.routes.is_empty() {
        return Err(invalid("routes", "must list at least one route"));
    }
    let mut routes: Vec<Route> = Vec::with_capacity(raw.routes.len());
    for (i, r) in raw.routes.into_iter().enumerate() {
        let base = format!("routes[{i}]");
        if r.name.is_empty() {
            return Err(invalid(format!("{base}.name"), "must not be empty"));
        }
        if routes.iter().any(|other| other.name == r.name) {
            return Err(invalid(
                format!("{base}.name"),
                format!("route name '{}' is used twice", r.name),
            ));
        }
        let upstream = upstreams.get(&r.upstream).ok_or_else(|| {
            let known: Vec<&str> = upstreams.keys().map(String::as_str).collect();
            invalid(
                format!("{base}.upstream"),
                format!(
                    "no upstream named '{}' (known: {})",
                    r.upstream,
                    known.join(", ")
                ),
            )
        })?;
        let path = match (r.matcher.path, r.matcher.path_prefix) {
            (Some(p), None) => PathMatch::Exact(p),
            (None, Some(p)) => PathMatch::Prefix(p),
            _ => {
                return Err(invalid(
                    format!("{base}.match"),
                    "give exactly one of 'path' or 'path_prefix'",
                ));
            }
        };
        let path = {
            let (PathMatch::Exact(p) | PathMatch::Prefix(p)) = &path;
            if !p.starts_with('/') {
                return Err(invalid(
                    format!("{base}.match"),
                    "paths must start with '/'",
                ));
            }
            // Requests are matched in normal form (SPEC 8.1), so the configured path is too.
            let normal = crate::path::normalize(p)
                .map_err(|e| invalid(format!("{base}.match"), e.to_string()))?
                .into_owned();
            match path {
                PathMatch::Exact(_) => PathMatch::Exact(normal),
                PathMatch::Prefix(_) => {
                    let trimmed = normal.strip_suffix('/').filter(|s| !s.is_empty());
                    PathMatch::Prefix(trimmed.map(str::to_string).unwrap_or(normal))
                }
            }
        };
        let route_methods = match &r.matcher.methods {
            None => None,
            Some(list) => Some(methods(&format!("{base}.match.methods"), list)?),
        };
        let idempotency = match r.idempotency {
            None => None,
            Some(idem) => Some(validate_idempotency(
                &format!("{base}.idempotency"),
                idem,
                upstream,
                store.record_bound(),
            )?),
        };
        if let Some(idem) = &idempotency
            && idem.max_request_body > server.max_buffered_bytes
        {
            return Err(invalid(
                format!("{base}.idempotency.max_request_body"),
                format!(
                    "must not be larger than server.max_buffered_bytes ({} bytes): such a \
                     body could never be admitted",
                    server.max_buffered_bytes
                ),
            ));
        }
        routes.push(Route {
            name: r.name,
            path,
            methods: route_methods,
            upstream: r.upstream,
            idempotency,
        });
    }

    Ok(Config {
        listen,
        admin,
        server,
        store,
        gc,
        replay_cache_bytes: size_or(
            "replay_cache.max_bytes",
            raw.replay_cache.as_ref().and_then(|c| c.max_bytes.as_ref()),
            defaults::REPLAY_CACHE_BYTES,
        )?,
        log_format: raw.log.and_then(|l| l.format).unwrap_or_default(),
        upstreams,
        routes,
    })
}

fn validate_idempotency(
    base: &str,
    raw: RawIdempotency,
    upstream: &UpstreamConfig,
    record_bound: Duration,
) -> Result<Idempotency, ConfigError> {
    let serialize = match &raw.serialize {
        None => None,
        Some(ser) => {
            let max_in_flight = ser.max_in_flight.unwrap_or(1);
            if max_in_flight == 0 {
                return Err(invalid(
                    format!("{base}.serialize.max_in_flight"),
                    "must be at least 1",
                ));
            }
            Some(SerializeConfig {
                max_in_flight,
                wait_timeout: duration_or(
                    &format!("{base}.serialize.wait_timeout"),
                    ser.wait_timeout.as_ref(),
                    defaults::WAIT_TIMEOUT,
                )?,
            })
        }
    };
    let key = match raw.key {
        None => vec![KeySource::Header(HeaderName::from_static(
            defaults::KEY_HEADER,
        ))],
        Some(list) if list.is_empty() => {
            return Err(invalid(
                format!("{base}.key"),
                "must list at least one source",
            ));
        }
        Some(list) => list
            .into_iter()
            .enumerate()
            .map(|(i, k)| {
                let p = format!("{base}.key[{i}]");
                Ok(match k {
                    RawKeySource::Header(h) => KeySource::Header(header_name(&p, &h)?),
                    RawKeySource::Json(ptr) => KeySource::Json(json_pointer(&p, &ptr)?),
                })
            })
            .collect::<Result<_, ConfigError>>()?,
    };
    let scope_path = format!("{base}.scope");
    let scope = match raw.scope {
        None => ScopeSource::Fixed("default".into()),
        Some(RawScope::Header(h)) => ScopeSource::Header(header_name(&scope_path, &h)?),
        Some(RawScope::Json(p)) => ScopeSource::Json(json_pointer(&scope_path, &p)?),
        Some(RawScope::Authorization(true)) => ScopeSource::Authorization,
        Some(RawScope::Authorization(false)) => {
            return Err(invalid(
                scope_path,
                "'authorization: false' means nothing: choose header, json, authorization: true or fixed",
            ));
        }
        Some(RawScope::Fixed(name)) => {
            if name.is_empty() || name.len() > 255 {
                return Err(invalid(scope_path, "a fixed scope must be 1-255 bytes"));
            }
            ScopeSource::Fixed(name)
        }
    };
    let idem_methods = match &raw.methods {
        None => defaults::METHODS
            .iter()
            .map(|m| Method::from_bytes(m.as_bytes()).expect("static method"))
            .collect(),
        Some(list) => methods(&format!("{base}.methods"), list)?,
    };
    let fp = raw.fingerprint.unwrap_or_default();
    let fingerprint = FingerprintConfig {
        headers: fp
            .headers
            .iter()
            .enumerate()
            .map(|(i, h)| header_name(&format!("{base}.fingerprint.headers[{i}]"), h))
            .collect::<Result<_, _>>()?,
        json_canonical: fp.json_canonical,
        json_ignore: fp
            .json_ignore
            .iter()
            .enumerate()
            .map(|(i, p)| json_pointer(&format!("{base}.fingerprint.json_ignore[{i}]"), p))
            .collect::<Result<_, _>>()?,
    };
    if !fingerprint.json_ignore.is_empty() && !fingerprint.json_canonical {
        return Err(invalid(
            format!("{base}.fingerprint.json_ignore"),
            "needs 'json_canonical: true' (fields can only be ignored in a parsed body)",
        ));
    }
    let ttl = duration_or(&format!("{base}.ttl"), raw.ttl.as_ref(), defaults::TTL)?;
    let lease = duration_or(
        &format!("{base}.lease"),
        raw.lease.as_ref(),
        upstream.timeout
            + defaults::LEASE_MARGIN
            + serialize.map_or(Duration::ZERO, |s| s.wait_timeout),
    )?;
    if lease <= upstream.timeout {
        return Err(invalid(
            format!("{base}.lease"),
            format!(
                "must be longer than upstream '{}' timeout ({})",
                upstream.name,
                fmt_duration(upstream.timeout)
            ),
        ));
    }
    if lease <= upstream.timeout + record_bound {
        return Err(invalid(
            format!("{base}.lease"),
            format!(
                "must be longer than upstream '{}' timeout ({}) plus the time to record the answer \
                 (the store's acquire_timeout + statement_timeout = {})",
                upstream.name,
                fmt_duration(upstream.timeout),
                fmt_duration(record_bound)
            ),
        ));
    }
    if let Some(ser) = &serialize
        && lease <= upstream.timeout + record_bound + ser.wait_timeout
    {
        return Err(invalid(
            format!("{base}.lease"),
            format!(
                "must be longer than upstream '{}' timeout ({}) plus serialize.wait_timeout ({}) \
                 plus the time to record the answer ({}): the claim is held while a slot is awaited",
                upstream.name,
                fmt_duration(upstream.timeout),
                fmt_duration(ser.wait_timeout),
                fmt_duration(record_bound)
            ),
        ));
    }
    if ttl < lease {
        return Err(invalid(
            format!("{base}.ttl"),
            format!(
                "must not be shorter than the lease ({})",
                fmt_duration(lease)
            ),
        ));
    }
    let retry_statuses = match raw.retry_statuses {
        None => StatusSet(defaults::RETRY_STATUSES.to_vec()),
        Some(list) => StatusSet(
            list.into_iter()
                .enumerate()
                .map(|(i, s)| status_range(&format!("{base}.retry_statuses[{i}]"), s))
                .collect::<Result<_, _>>()?,
        ),
    };
    let replay_headers = match raw.replay_headers {
        None => defaults::REPLAY_HEADERS
            .iter()
            .map(|h| HeaderName::from_static(h))
            .collect(),
        Some(list) => list
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let p = format!("{base}.replay_headers[{i}]");
                let name = header_name(&p, h)?;
                if crate::forward::is_hop_by_hop(&name) {
                    return Err(invalid(
                        p,
                        format!("'{h}' is a hop-by-hop header and is never stored"),
                    ));
                }
                if name == http::header::TRAILER {
                    return Err(invalid(
                        p,
                        format!("'{h}' announces trailers, and trailers are never stored"),
                    ));
                }
                Ok(name)
            })
            .collect::<Result<_, _>>()?,
    };
    let forward_key_header = header_name(
        &format!("{base}.forward_key_header"),
        raw.forward_key_header
            .as_deref()
            .unwrap_or(defaults::KEY_HEADER),
    )?;
    let max_stored_response = size_or(
        &format!("{base}.max_stored_response"),
        raw.max_stored_response.as_ref(),
        defaults::MAX_STORED_RESPONSE,
    )?;
    Ok(Idempotency {
        mode: raw.mode.unwrap_or_default(),
        key,
        scope,
        required: raw.required.unwrap_or(false),
        methods: idem_methods,
        fingerprint,
        ttl,
        lease,
        in_flight: raw.in_flight.unwrap_or(InFlight::Wait),
        wait_timeout: duration_or(
            &format!("{base}.wait_timeout"),
            raw.wait_timeout.as_ref(),
            defaults::WAIT_TIMEOUT,
        )?,
        retry_statuses,
        on_unknown_outcome: raw
            .on_unknown_outcome
            .unwrap_or(OnUnknownOutcome::Reforward),
        on_store_error: raw.on_store_error.unwrap_or(OnStoreError::Reject),
        max_request_body: size_or(
            &format!("{base}.max_request_body"),
            raw.max_request_body.as_ref(),
            defaults::MAX_REQUEST_BODY,
        )?,
        max_stored_response,
        replay_headers,
        forward_key_header,
        serialize,
    })
}

fn status_range(path: &str, s: RawStatus) -> Result<(u16, u16), ConfigError> {
    let check = |n: u16| {
        if (100..=599).contains(&n) {
            Ok(n)
        } else {
            Err(invalid(
                path,
                format!("{n} is not an HTTP status (100-599)"),
            ))
        }
    };
    match s {
        RawStatus::Code(n) => Ok((check(n)?, n)),
        RawStatus::Range(text) => {
            let bad = || {
                invalid(
                    path,
                    format!("'{text}' is not a status or a range like 500-599"),
                )
            };
            let (lo, hi) = match text.split_once('-') {
                Some((a, b)) => (a.trim(), b.trim()),
                None => (text.trim(), text.trim()),
            };
            let lo = check(lo.parse().map_err(|_| bad())?)?;
            let hi = check(hi.parse().map_err(|_| bad())?)?;
            if lo > hi {
                return Err(bad());
            }
            Ok((lo, hi))
        }
    }
}

/// Formats a duration the way the config writes it.
pub fn fmt_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms.is_multiple_of(3_600_000) && ms > 0 {
        format!("{}h", ms / 3_600_000)
    } else if ms.is_multiple_of(60_000) && ms > 0 {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
store: { postgres: { url: "postgres://u@localhost/db" } }
upstreams: { app: { url: "http://127.0.0.1:9000", timeout: 30s } }
routes:
  - name: r
    match: { path_prefix: / }
    upstream: app
    idempotency: {}
"#;

    fn err(yaml: &str) -> String {
        Config::from_yaml_with_env(yaml, &|_| None)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::from_yaml(MINIMAL).unwrap();
        let idem = c.routes[0].idempotency.as_ref().unwrap();
        assert_eq!(idem.lease, Duration::from_secs(45));
        assert_eq!(idem.ttl, Duration::from_secs(86400));
        assert_eq!(idem.methods, vec![Method::POST, Method::PATCH]);
        assert!(idem.retry_statuses.contains(503));
        assert!(idem.retry_statuses.contains(429));
        assert!(!idem.retry_statuses.contains(404));
        assert_eq!(c.listen.to_string(), "0.0.0.0:8080");
    }

    #[test]
    fn lease_not_longer_than_timeout_names_the_path() {
        let yaml = MINIMAL.replace("idempotency: {}", "idempotency: { lease: 30s }");
        assert_eq!(
            err(&yaml),
            "routes[0].idempotency.lease: must be longer than upstream 'app' timeout (30s)"
        );
    }

    #[test]
    fn the_database_url_never_reaches_debug_output() {
        let c = Config::from_yaml(&MINIMAL.replace(
            "postgres://u@localhost/db",
            "postgres://u:hunter2@localhost/db",
        ))
        .unwrap();
        let text = format!("{c:?}");
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("<redacted>"));
    }

    #[test]
    fn reload_decisions_compare_values() {
        let a = Config::from_yaml(MINIMAL).unwrap();
        let b = Config::from_yaml(MINIMAL).unwrap();
        assert_eq!(a, b);
        let c = Config::from_yaml(&MINIMAL.replace("timeout: 30s", "timeout: 29s")).unwrap();
        assert_ne!(a.upstreams, c.upstreams);
    }

    #[test]
    fn unknown_fields_name_their_path() {
        let yaml = MINIMAL.replace("idempotency: {}", "idempotency: { leese: 30s }");
        let e = err(&yaml);
        assert!(
            e.starts_with("routes[0].idempotency.leese: unknown field `leese`, expected one of"),
            "{e}"
        );
    }

    #[test]
    fn tls_files_that_do_not_exist_are_named() {
        let yaml = format!(
            "{MINIMAL}server: {{ tls: {{ cert: /nonexistent/gw.pem, key: /nonexistent/gw.key }} }}\n"
        );
        let e = err(&yaml);
        assert!(
            e.starts_with("server.tls: cannot read certificates from /nonexistent/gw.pem"),
            "{e}"
        );
        let yaml = MINIMAL.replace(
            "url: \"http://127.0.0.1:9000\", timeout: 30s",
            "url: \"http://127.0.0.1:9000\", timeout: 30s, tls: { ca: /x.pem }",
        );
        assert_eq!(
            err(&yaml),
            "upstreams.app.tls.ca: only an https:// upstream uses a CA"
        );
    }

    #[test]
    fn env_vars_are_interpolated_and_unset_ones_are_named() {
        let yaml = MINIMAL.replace("postgres://u@localhost/db", "${DB_URL}");
        let c = Config::from_yaml_with_env(&yaml, &|n| {
            (n == "DB_URL").then(|| "postgres://x@h/d".to_string())
        })
        .unwrap();
        let StoreConfig::Postgres(pg) = &c.store else {
            panic!("a postgres store")
        };
        assert_eq!(pg.url, "postgres://x@h/d");
        assert_eq!(
            err(&yaml),
            "store.postgres.url: environment variable DB_URL is not set"
        );
    }

    #[test]
    fn async_commit_is_refused_unless_the_config_allows_it() {
        let allowed = |yaml: &str| match Config::from_yaml(yaml).unwrap().store {
            StoreConfig::Postgres(pg) => pg.allow_async_commit,
            StoreConfig::Sqlite(_) => panic!("a postgres store"),
        };
        assert!(!allowed(MINIMAL), "off by default");
        let yaml = MINIMAL.replace(
            "url: \"postgres://u@localhost/db\"",
            "url: \"postgres://u@localhost/db\", allow_async_commit: true",
        );
        assert!(allowed(&yaml));
    }

    #[test]
    fn a_pooler_in_transaction_mode_and_a_listen_url_are_read_and_checked() {
        let pg = |yaml: &str| match Config::from_yaml(yaml).unwrap().store {
            StoreConfig::Postgres(pg) => pg,
            StoreConfig::Sqlite(_) => panic!("a postgres store"),
        };
        let plain = pg(MINIMAL);
        assert_eq!(plain.pooler, Pooler::None, "a direct session by default");
        assert_eq!(plain.listen_url, plain.url, "listen_url defaults to url");
        let pooled = pg(&MINIMAL.replace(
            "url: \"postgres://u@localhost/db\"",
            "url: \"postgres://u@bouncer:6432/db\", pooler: transaction, \
             listen_url: \"postgres://u@db:5432/db\"",
        ));
        assert_eq!(pooled.pooler, Pooler::Transaction);
        assert_eq!(pooled.url, "postgres://u@bouncer:6432/db");
        assert_eq!(pooled.listen_url, "postgres://u@db:5432/db");
        assert_eq!(
            err(&MINIMAL.replace(
                "url: \"postgres://u@localhost/db\"",
                "url: \"postgres://u@localhost/db\", pooler: session"
            )),
            "store.postgres.pooler: 'session' is not one of none, transaction"
        );
        assert!(
            err(&MINIMAL.replace(
                "url: \"postgres://u@localhost/db\"",
                "url: \"postgres://u@localhost/db\", listen_url: \"postgres://u@h:x/db\""
            ))
            .starts_with("store.postgres.listen_url: not a valid PostgreSQL connection string"),
            "the listen URL is checked like the URL, and never echoed"
        );
        let warned = |yaml: &str| {
            Config::from_yaml(yaml)
                .unwrap()
                .warnings()
                .iter()
                .any(|w| w.contains("listen_url is not set"))
        };
        let without_listen = MINIMAL.replace(
            "url: \"postgres://u@localhost/db\"",
            "url: \"postgres://u@bouncer:6432/db\", pooler: transaction",
        );
        assert_ne!(without_listen, MINIMAL);
        assert!(warned(&without_listen), "a pooled listener is warned about");
        assert!(!warned(MINIMAL), "a direct session is not");
    }

    #[test]
    fn durations_and_sizes_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("24h").unwrap(), Duration::from_secs(86400));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("10x").is_err());
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("1ZiB").is_err());
    }

    #[test]
    fn status_ranges_parse() {
        let yaml = MINIMAL.replace(
            "idempotency: {}",
            "idempotency: { retry_statuses: [409, 500-502] }",
        );
        let c = Config::from_yaml(&yaml).unwrap();
        let s = &c.routes[0].idempotency.as_ref().unwrap().retry_statuses;
        assert!(s.contains(409) && s.contains(501) && !s.contains(503) && !s.contains(500 - 1));
        let yaml = MINIMAL.replace("idempotency: {}", "idempotency: { retry_statuses: [600] }");
        assert!(err(&yaml).contains("routes[0].idempotency.retry_statuses[0]: 600"));
    }

    #[test]
    fn mode_is_enforce_unless_the_route_says_observe() {
        let mode = |yaml: &str| {
            Config::from_yaml(yaml).unwrap().routes[0]
                .idempotency
                .as_ref()
                .unwrap()
                .mode
        };
        assert_eq!(mode(MINIMAL), Mode::Enforce);
        let observe = MINIMAL.replace("idempotency: {}", "idempotency: { mode: observe }");
        assert_eq!(mode(&observe), Mode::Observe);
        let bad = MINIMAL.replace("idempotency: {}", "idempotency: { mode: shadow }");
        let e = err(&bad);
        assert!(
            e.starts_with("routes[0].idempotency.mode: unknown variant `shadow`, expected `enforce` or `observe`"),
            "{e}"
        );
    }

    #[test]
    fn drain_delay_defaults_to_zero_and_may_be_zero() {
        let delay = |yaml: &str| Config::from_yaml(yaml).unwrap().server.drain_delay;
        assert_eq!(delay(MINIMAL), Duration::ZERO);
        let yaml = format!("{MINIMAL}server: {{ drain_delay: 10s }}\n");
        assert_eq!(delay(&yaml), Duration::from_secs(10));
        let yaml = format!("{MINIMAL}server: {{ drain_delay: 0s }}\n");
        assert_eq!(delay(&yaml), Duration::ZERO);
        let yaml = format!("{MINIMAL}server: {{ drain_delay: soon }}\n");
        assert!(err(&yaml).starts_with("server.drain_delay: "));
    }

    #[test]
    fn unknown_upstream_is_named() {
        let yaml = MINIMAL.replace("upstream: app", "upstream: nope");
        assert_eq!(
            err(&yaml),
            "routes[0].upstream: no upstream named 'nope' (known: app)"
        );
    }
}
