//! Configuration: the YAML file of docs/contract.md §4, in two stages.
//!
//! 1. The text is parsed by serde-saphyr into a generic tree, `${VAR}` references in string
//!    values are replaced from the environment, and the tree is deserialized into the `Raw*`
//!    types (`deny_unknown_fields`, everything optional that has a default) while the YAML
//!    path of every node is tracked, so an error reads `routes[1].idempotency.ttl: ...`.
//! 2. Validation turns the raw types into [`Config`]: real `Duration`s and byte sizes,
//!    parsed methods and header names, compiled routes, resolved upstreams, and cross-field
//!    checks (a lease must outlive its upstream's timeout).
//!
//! Which file owns what:
//!
//! - `mod.rs` (this file): the typed, validated configuration ([`Config`] and the types it
//!   is made of), the [`defaults`], [`ConfigError`], loading ([`Config::load`],
//!   [`Config::from_yaml`], `${VAR}` interpolation), [`Config::warnings`] and
//!   [`Config::route_for`].
//! - `raw.rs`: the `Raw*` types, the shapes serde deserializes the YAML into; every field is
//!   documented there with its YAML spelling and default.
//! - `validate.rs`: raw to typed, with the defaults applied and every error naming its YAML
//!   path.
//! - `units.rs`: durations and sizes, parsed ([`parse_duration`], [`parse_size`]) and
//!   formatted back the way the config writes them ([`fmt_duration`], [`fmt_size`]).
//!
//! Invariants of a [`Config`]: every route names an existing upstream; every keyed route's
//! `lease` is longer than that upstream's `timeout` and not longer than its `ttl`; route names
//! are unique; TLS files named by the config were readable when it was validated.
//!
//! Invariants of the code: every error names the YAML path of the value it concerns
//! (`store.postgres.pool_size`, `routes[0].idempotency.lease`), and the tests assert the
//! exact messages; the database URLs are never printed, neither in an error nor by `Debug`
//! (see [`PostgresConfig`]); a value is printed as the config spells it (the enums'
//! `as_str`, [`fmt_duration`], [`fmt_size`]), and every such spelling is one the config
//! accepts.

mod pg_url;
mod raw;
mod shadow;
mod units;
mod validate;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use http::{HeaderName, Method};
use serde::Deserialize;
use serde_json::Value;

pub use units::{fmt_duration, fmt_size, parse_duration, parse_size};

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

/// Defaults, in one place (docs/contract.md §4).
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
        let mut out: Vec<String> = self
            .server
            .retired
            .iter()
            .map(|field| format!("{field} is no longer read; remove it"))
            .collect();
        out.extend(shadow::partial_warnings(&self.routes));
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
            && pg.pooler == Some(Pooler::Transaction)
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

    /// The first route in file order that matches (docs/contract.md §2.1).
    pub fn route_for(&self, method: &Method, path: &str) -> Option<&Route> {
        self.route_index_for(method, path).map(|i| &self.routes[i])
    }

    /// The index in `routes` of the route [`route_for`](Self::route_for) finds.
    pub fn route_index_for(&self, method: &Method, path: &str) -> Option<usize> {
        self.routes.iter().position(|r| r.matches(method, path))
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
        let raw: raw::RawConfig = serde_path_to_error::deserialize(tree).map_err(|e| {
            let path = e.path().to_string();
            let path = if path == "." { "(root)".into() } else { path };
            invalid(path, e.into_inner().to_string())
        })?;
        validate::validate(raw)
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
    fn batch_keys_defaults_to_32_and_is_bounded() {
        let c = Config::from_yaml(MINIMAL).unwrap();
        let StoreConfig::Postgres(pg) = &c.store else {
            panic!("a postgres store: {:?}", c.store)
        };
        assert_eq!(pg.batch_keys, 32);
        for (value, ok) in [("0", false), ("1", true), ("1000", true), ("1001", false)] {
            let yaml = MINIMAL.replace(
                r#"url: "postgres://u@localhost/db" }"#,
                &format!(r#"url: "postgres://u@localhost/db", batch_keys: {value} }}"#),
            );
            match Config::from_yaml(&yaml) {
                Ok(c) => {
                    assert!(ok, "batch_keys {value} was accepted");
                    let StoreConfig::Postgres(pg) = &c.store else {
                        panic!("a postgres store")
                    };
                    assert_eq!(pg.batch_keys.to_string(), value);
                }
                Err(e) => {
                    assert!(!ok, "batch_keys {value} was refused: {e}");
                    assert_eq!(
                        e.to_string(),
                        "store.postgres.batch_keys: must be from 1 to 1000"
                    );
                }
            }
        }
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
    fn yield_on_wake_is_accepted_and_no_longer_read() {
        let retired = "server.yield_on_wake is no longer read; remove it";
        let plain = Config::from_yaml(MINIMAL).unwrap().warnings();
        assert!(!plain.iter().any(|w| w == retired), "{plain:?}");
        let yaml = format!("server: {{ yield_on_wake: false }}\n{MINIMAL}");
        let warned = Config::from_yaml(&yaml).unwrap().warnings();
        assert!(warned.iter().any(|w| w == retired), "{warned:?}");
    }

    #[test]
    fn the_runtime_is_a_thread_per_core_unless_asked_otherwise() {
        let c = Config::from_yaml(MINIMAL).unwrap();
        assert_eq!(c.server.runtime, RuntimeLayout::ThreadPerCore);
        let yaml = format!("server: {{ runtime: work_stealing }}\n{MINIMAL}");
        let c = Config::from_yaml(&yaml).unwrap();
        assert_eq!(c.server.runtime, RuntimeLayout::WorkStealing);
        let e = err(&format!("server: {{ runtime: per_core }}\n{MINIMAL}"));
        assert!(
            e.starts_with("server.runtime: unknown variant `per_core`, expected `thread_per_core` or `work_stealing`"),
            "{e}"
        );
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
        assert_eq!(
            plain.pooler, None,
            "learned from the first connection by default"
        );
        assert_eq!(plain.listen_url, plain.url, "listen_url defaults to url");
        let pooled = pg(&MINIMAL.replace(
            "url: \"postgres://u@localhost/db\"",
            "url: \"postgres://u@bouncer:6432/db\", pooler: transaction, \
             listen_url: \"postgres://u@db:5432/db\"",
        ));
        assert_eq!(pooled.pooler, Some(Pooler::Transaction));
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
    fn the_names_printed_for_values_are_the_ones_the_config_accepts() {
        let idem = |field: String| {
            let yaml = MINIMAL.replace("idempotency: {}", &format!("idempotency: {{ {field} }}"));
            Config::from_yaml(&yaml).unwrap().routes[0]
                .idempotency
                .clone()
                .unwrap()
        };
        for v in [Mode::Enforce, Mode::Observe] {
            assert_eq!(idem(format!("mode: {}", v.as_str())).mode, v);
        }
        for v in [InFlight::Wait, InFlight::Reject] {
            assert_eq!(idem(format!("in_flight: {}", v.as_str())).in_flight, v);
        }
        for v in [OnUnknownOutcome::Reforward, OnUnknownOutcome::Hold] {
            let field = format!("on_unknown_outcome: {}", v.as_str());
            assert_eq!(idem(field).on_unknown_outcome, v);
        }
        for v in [OnStoreError::Reject, OnStoreError::PassThrough] {
            assert_eq!(
                idem(format!("on_store_error: {}", v.as_str())).on_store_error,
                v
            );
        }
        let pg = |field: String| {
            let yaml = MINIMAL.replace(
                "url: \"postgres://u@localhost/db\"",
                &format!("url: \"postgres://u@localhost/db\", {field}"),
            );
            match Config::from_yaml(&yaml).unwrap().store {
                StoreConfig::Postgres(pg) => pg,
                StoreConfig::Sqlite(_) => panic!("a postgres store"),
            }
        };
        for v in Pooler::ALL {
            assert_eq!(pg(format!("pooler: {}", v.as_str())).pooler, Some(v));
        }
        // verify-full needs trusted roots on this machine: its spelling is checked by name.
        for v in PgTlsMode::ALL {
            if v == PgTlsMode::VerifyFull {
                assert_eq!(v.as_str(), "verify-full");
                continue;
            }
            assert_eq!(pg(format!("tls: {{ mode: {} }}", v.as_str())).tls, v);
        }
        for v in [LogFormat::Text, LogFormat::Json] {
            let yaml = format!("{MINIMAL}log: {{ format: {} }}\n", v.as_str());
            assert_eq!(Config::from_yaml(&yaml).unwrap().log_format, v);
        }
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
