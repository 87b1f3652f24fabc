//! The typed, validated configuration: [`Config`] and the types it is made of, the
//! [`defaults`], and [`ConfigError`]. What the YAML spells (`raw.rs`) becomes these in
//! `validate.rs`; loading is `mod.rs`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use http::{HeaderName, Method};
use serde::Deserialize;

pub use super::telemetry::{ExportHeaders, OtlpProtocol, TelemetryConfig};

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

pub(super) fn invalid(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl LogFormat {
    /// The name the config uses.
    pub fn as_str(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
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
    /// `telemetry`: traces (off without an endpoint; the environment may add one, see
    /// `telemetry::Settings::resolve`).
    pub telemetry: TelemetryConfig,
    /// Upstreams by name.
    pub upstreams: BTreeMap<String, UpstreamConfig>,
    /// Routes in file order: the first that matches wins.
    pub routes: Vec<Route>,
}

impl Default for TelemetryConfig {
    fn default() -> TelemetryConfig {
        TelemetryConfig {
            endpoint: None,
            protocol: OtlpProtocol::default(),
            headers: ExportHeaders::default(),
            service_name: defaults::SERVICE_NAME.to_string(),
            sampling_ratio: 1.0,
            timeout: defaults::OTLP_TIMEOUT,
            max_queue_spans: defaults::MAX_QUEUE_SPANS,
        }
    }
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
    /// accepts and serves (docs/contract.md §8.3), so load balancers stop sending before it
    /// closes. Zero (the default) closes the listener at once.
    pub drain_delay: Duration,
    /// Request bodies and captured responses held in memory at once, across all requests
    /// (docs/contract.md §8.2); past it new requests get 503 `overloaded`.
    pub max_buffered_bytes: usize,
    /// Requests one HTTP/2 connection may have open at once.
    pub h2_max_concurrent_streams: u32,
    /// Threads that serve requests (default: the cores available).
    pub worker_threads: usize,
    /// How those threads share the work (default: a thread per core).
    pub runtime: RuntimeLayout,
    /// Fields set in the file that are no longer read (each gets a warning).
    pub retired: Vec<&'static str>,
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

impl PgTlsMode {
    /// Every mode, in the order the config's error message lists them.
    pub const ALL: [PgTlsMode; 3] = [
        PgTlsMode::Disable,
        PgTlsMode::Require,
        PgTlsMode::VerifyFull,
    ];

    /// The name the config uses (`store.postgres.tls.mode`).
    pub fn as_str(self) -> &'static str {
        match self {
            PgTlsMode::Disable => "disable",
            PgTlsMode::Require => "require",
            PgTlsMode::VerifyFull => "verify-full",
        }
    }
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

impl Pooler {
    /// Every value, in the order the config's error message lists them.
    pub const ALL: [Pooler; 2] = [Pooler::None, Pooler::Transaction];

    /// The name the config uses (`store.postgres.pooler`).
    pub fn as_str(self) -> &'static str {
        match self {
            Pooler::None => "none",
            Pooler::Transaction => "transaction",
        }
    }
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
    /// The direct session that LISTENs for wake-ups (docs/contract.md §8.4); `url` when not
    /// given.
    pub listen_url: String,
    /// What `url` points at: PostgreSQL itself or a pooler in transaction mode; `None`
    /// (not configured): learned from the first connection (src/store/pg_connect.rs).
    pub pooler: Option<Pooler>,
    pub pool_size: usize,
    /// The most keys one batched claim or completion carries (1: no batches).
    pub batch_keys: usize,
    /// The most stored answers, in bytes, one batched completion carries.
    pub batch_bytes: usize,
    /// Bound on waiting for a pooled connection (including creating one).
    pub acquire_timeout: Duration,
    /// Bound on opening one new connection.
    pub connect_timeout: Duration,
    /// Server-side `statement_timeout`, also enforced on the client side.
    pub statement_timeout: Duration,
    pub tls: PgTlsMode,
    /// CA file for `verify-full` (the platform's roots without one).
    pub tls_ca: Option<std::path::PathBuf>,
    /// Accept a database whose `synchronous_commit` is `off` (docs/contract.md §8.4). Such a
    /// database can lose a commit that a client was already answered from (guarantee 3), so
    /// `serve` refuses it and `/readyz` fails unless this says the operator chose that.
    pub allow_async_commit: bool,
}

/// The URL may hold a password: it is never printed.
impl std::fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &"<redacted>")
            .field("pool_size", &self.pool_size)
            .field("batch_keys", &self.batch_keys)
            .field("batch_bytes", &self.batch_bytes)
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
    /// Requests being forwarded to this upstream at once, detached work included.
    pub max_in_flight: usize,
    /// How long a connection to it stays idle for reuse: shorter than the upstream's own
    /// keep-alive timeout, so a request is never written on a connection it is closing.
    pub idle_timeout: Duration,
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
    /// Whether a normalized request path matches (docs/contract.md §8.1): an exact path with
    /// or without one trailing slash; a prefix on a segment boundary (`/api` matches `/api` and
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

    /// The same match with its path's ASCII letters lower-cased.
    pub fn folded(&self) -> PathMatch {
        match self {
            PathMatch::Exact(p) => PathMatch::Exact(p.to_ascii_lowercase()),
            PathMatch::Prefix(p) => PathMatch::Prefix(p.to_ascii_lowercase()),
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

/// How the threads that serve requests share the work (`server.runtime`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RuntimeLayout {
    /// Each of the `worker_threads` runs a single-threaded runtime of its own that accepts
    /// from the shared listening socket and serves its connections start to end, as nginx's
    /// workers do: no task moves between threads, and no thread wakes another for a request.
    #[default]
    ThreadPerCore,
    /// One multi-threaded tokio runtime: its `worker_threads` steal tasks from each other.
    WorkStealing,
}

/// Whether a keyed route enforces idempotency or only observes what enforcing would do
/// (docs/contract.md §8.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Replay, wait, refuse mismatches and store trouble, as docs/contract.md §2 says.
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

impl InFlight {
    /// The name the config uses (`in_flight`).
    pub fn as_str(self) -> &'static str {
        match self {
            InFlight::Wait => "wait",
            InFlight::Reject => "reject",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnUnknownOutcome {
    Reforward,
    Hold,
}

impl OnUnknownOutcome {
    /// The name the config uses (`on_unknown_outcome`).
    pub fn as_str(self) -> &'static str {
        match self {
            OnUnknownOutcome::Reforward => "reforward",
            OnUnknownOutcome::Hold => "hold",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    Reject,
    PassThrough,
}

impl OnStoreError {
    /// The name the config uses (`on_store_error`).
    pub fn as_str(self) -> &'static str {
        match self {
            OnStoreError::Reject => "reject",
            OnStoreError::PassThrough => "pass_through",
        }
    }
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
pub struct StatusSet(pub(super) Vec<(u16, u16)>);

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

/// Defaults, in one place (docs/contract.md §4).
pub mod defaults {
    use std::time::Duration;

    pub const LISTEN: &str = "0.0.0.0:8080";
    pub const SERVICE_NAME: &str = "idemgate";
    pub const OTLP_TIMEOUT: Duration = Duration::from_secs(10);
    pub const MAX_QUEUE_SPANS: usize = 2048;
    pub const MAX_CONNECTIONS: usize = 10_000;
    pub const MAX_HEADER_BYTES: usize = 64 * 1024;
    pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
    pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
    pub const DRAIN_DELAY: Duration = Duration::ZERO;
    pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
    pub const MAX_BUFFERED_BYTES: usize = 256 * 1024 * 1024;
    pub const UPSTREAM_MAX_IN_FLIGHT: usize = 1024;
    /// Below the keep-alive timeouts of the servers legacy services run on (gunicorn 2 s,
    /// Node.js, uvicorn and Apache 5 s, nginx 75 s), with room for one that closes after 1 s.
    pub const UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_millis(800);
    pub const POOL_SIZE: usize = 16;
    pub const BATCH_KEYS: usize = 32;
    pub const BATCH_BYTES: usize = 1024 * 1024;
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
    /// Added to the upstream timeout when `lease` is not given, or the store calls the lease
    /// must leave room for (one, two with `serialize`) plus [`LEASE_SLACK`] where that is more.
    pub const LEASE_MARGIN: Duration = Duration::from_secs(15);
    pub const LEASE_SLACK: Duration = Duration::from_secs(5);
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
