//! The raw configuration: exactly what the YAML may say, as serde deserializes it.
//!
//! Every struct denies unknown fields, and everything that has a default is optional here:
//! defaults are applied, and values checked, by `validate.rs` (the defaults themselves are
//! in [`super::defaults`]). Each field's doc says what its YAML spelling means and its
//! default; `docs/configuration.md` and `config/gateway.example.yaml` say the same for
//! operators. Durations are strings such as `250ms`, `10s`, `5m`, `24h`, `7d`; sizes are
//! [`RawSize`]s.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::model::{InFlight, LogFormat, Mode, OnStoreError, OnUnknownOutcome, OtlpProtocol};

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    /// `listen`: the proxy's address, `IP:PORT`. Default `0.0.0.0:8080`.
    pub(super) listen: Option<String>,
    /// `admin`: the admin listener (metrics, health, the key API). Default: none, so no
    /// admin endpoint at all.
    pub(super) admin: Option<RawAdmin>,
    /// `server`: connection limits, timeouts and TLS of the listener. Default: every field
    /// at its own default.
    #[serde(default)]
    pub(super) server: RawServer,
    /// `extra_methods`: methods outside the standard set (GET, HEAD, POST, PUT, DELETE,
    /// OPTIONS, TRACE, PATCH) that routes may name, e.g. `[PURGE, PROPFIND]`. Default none:
    /// any other name in a route is refused as a misspelling.
    pub(super) extra_methods: Option<Vec<String>>,
    /// `store`: where keys live, `postgres` or `sqlite`, and `gc`. Required.
    pub(super) store: RawStore,
    /// `upstreams`: the services requests are forwarded to, by name. Required.
    pub(super) upstreams: BTreeMap<String, RawUpstream>,
    /// `routes`: the routes, the first that matches a request wins. Required, at least one.
    pub(super) routes: Vec<RawRoute>,
    /// `replay_cache`: completed responses kept in memory for hot replays. Default
    /// `{ max_bytes: 64MiB }`.
    pub(super) replay_cache: Option<RawReplayCache>,
    /// `log`: how log lines are written. Default `{ format: text }`.
    pub(super) log: Option<RawLog>,
    /// `telemetry`: traces exported over OTLP. Default: none, so no traces (unless the
    /// standard `OTEL_EXPORTER_OTLP_*` variables name a collector; src/telemetry/).
    pub(super) telemetry: Option<RawTelemetry>,
}

/// `telemetry`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTelemetry {
    /// `telemetry.service_name`: the `service.name` of the spans. Default `idemgate`.
    pub(super) service_name: Option<String>,
    /// `telemetry.sampling_ratio`: the share of new traces recorded, `0.0` to `1.0`; a
    /// client's sampled flag is followed whatever it is. Default `1.0`.
    pub(super) sampling_ratio: Option<f64>,
    /// `telemetry.otlp`: where spans are sent. Default: nowhere.
    pub(super) otlp: Option<RawOtlp>,
}

/// `telemetry.otlp`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOtlp {
    /// `telemetry.otlp.endpoint`: the collector's URL, `http://` or `https://` (`https`
    /// only with `http/protobuf`). Over HTTP a URL without a path gets `/v1/traces`.
    pub(super) endpoint: Option<String>,
    /// `telemetry.otlp.protocol`: `http/protobuf` (default) or `grpc`.
    pub(super) protocol: Option<OtlpProtocol>,
    /// `telemetry.otlp.headers`: headers sent with every export (e.g. an API key).
    pub(super) headers: Option<BTreeMap<String, String>>,
    /// `telemetry.otlp.timeout`: the bound on one export, retries included. Default `10s`.
    pub(super) timeout: Option<String>,
    /// `telemetry.otlp.max_queue_spans`: spans waiting for export; past it new ones are
    /// dropped (and counted). Default `2048`.
    pub(super) max_queue_spans: Option<usize>,
}

/// `log`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLog {
    /// `log.format`: `text` or `json` (one line per request either way). Default `text`.
    pub(super) format: Option<LogFormat>,
}

/// `replay_cache`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawReplayCache {
    /// `replay_cache.max_bytes`: memory for completed responses of keys replayed at least
    /// once; `0` disables the cache. Default `64MiB`.
    pub(super) max_bytes: Option<RawSize>,
}

/// `admin`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    /// `admin.listen`: the admin listener's address, e.g. `127.0.0.1:9090`. Required.
    pub(super) listen: String,
    /// `admin.token`: the bearer token (16 or more characters) the key API requires.
    /// Default: none, allowed only when `listen` is a loopback address.
    pub(super) token: Option<String>,
}

/// `server`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    /// `server.max_connections`: connections served at once; more wait in the kernel's
    /// backlog. Default `10000`, at least 1.
    pub(super) max_connections: Option<usize>,
    /// `server.max_header_bytes`: the largest request head (431 beyond it). Default
    /// `64KiB`, at least `8KiB`.
    pub(super) max_header_bytes: Option<RawSize>,
    /// `server.header_read_timeout`: time a client has to send a complete request head (and
    /// finish a TLS handshake); h2 connections are pinged at this interval. Default `10s`.
    pub(super) header_read_timeout: Option<String>,
    /// `server.body_read_timeout`: time a client has to send a keyed request's whole body
    /// (408 `body-timeout` after it). Default `30s`.
    pub(super) body_read_timeout: Option<String>,
    /// `server.shutdown_grace`: after SIGTERM/SIGINT (and `drain_delay`), how long requests
    /// in flight get to finish once the listener stops accepting. Default `30s`.
    pub(super) shutdown_grace: Option<String>,
    /// `server.drain_delay`: after SIGTERM/SIGINT, how long `/readyz` answers 503 while the
    /// listener still serves. Default `0s` (stop accepting at once); zero is allowed.
    pub(super) drain_delay: Option<String>,
    /// `server.max_buffered_bytes`: request bodies and captured responses held in memory at
    /// once, across all requests (503 `overloaded` past it). Default `256MiB`, at least 1.
    pub(super) max_buffered_bytes: Option<RawSize>,
    /// `server.h2_max_concurrent_streams`: requests one HTTP/2 connection may have open at
    /// once. Default `100`, at least 1.
    pub(super) h2_max_concurrent_streams: Option<u32>,
    /// `server.worker_threads`: threads of the runtime that serves requests. Default: the
    /// cores available; at least 1.
    pub(super) worker_threads: Option<usize>,
    /// `server.runtime`: how those threads share the work: `thread_per_core` (the default:
    /// each thread runs its own event loop and accepts its own connections) or
    /// `work_stealing` (one tokio runtime whose threads take tasks from each other).
    pub(super) runtime: Option<crate::config::RuntimeLayout>,
    /// `server.yield_on_wake`: no longer read (a woken serving thread used to yield its core
    /// once; it paid only when the load generator shared the gateway's cores). Accepted, with
    /// a warning, so that a config that sets it still loads.
    pub(super) yield_on_wake: Option<bool>,
    /// `server.tls`: HTTPS on the listener (HTTP/1.1 and h2 by ALPN). Default: none, plain
    /// HTTP (and h2c).
    pub(super) tls: Option<RawServerTls>,
}

/// `server.tls`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServerTls {
    /// `server.tls.cert`: the certificate chain, a PEM file. Required.
    pub(super) cert: String,
    /// `server.tls.key`: the chain's private key, a PEM file. Required.
    pub(super) key: String,
}

/// `upstreams.<name>.tls`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCaOnly {
    /// `tls.ca`: a PEM file of the CA that verifies an `https` upstream. Default: the
    /// platform's trusted roots (`SSL_CERT_FILE` / `SSL_CERT_DIR` when set).
    pub(super) ca: Option<String>,
}

/// `store`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    /// `store.postgres`: keys in PostgreSQL, shared by every instance. Exactly one of
    /// `postgres` and `sqlite` is required.
    pub(super) postgres: Option<RawPostgres>,
    /// `store.sqlite`: keys in an embedded SQLite file, for one instance. Exactly one of
    /// `postgres` and `sqlite` is required.
    pub(super) sqlite: Option<RawSqlite>,
    /// `store.gc`: collection of expired keys. Default: every field at its own default.
    pub(super) gc: Option<RawGc>,
}

/// `store.gc`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGc {
    /// `store.gc.interval`: how often `serve` deletes expired keys (one instance at a
    /// time). Default `60s`.
    pub(super) interval: Option<String>,
    /// `store.gc.batch_size`: rows deleted per short transaction. Default `1000`, at least 1.
    pub(super) batch_size: Option<usize>,
}

/// `store.postgres`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPostgres {
    /// `store.postgres.url`: `postgres://user:pass@host:port/db`, usually
    /// `${DATABASE_URL}`. Required; never printed.
    pub(super) url: String,
    /// `store.postgres.listen_url`: a direct session for the connection that `LISTEN`s for
    /// wake-ups. Default: `url`.
    pub(super) listen_url: Option<String>,
    /// `store.postgres.pooler`: what `url` points at, `none` (PostgreSQL itself or a pooler
    /// in session mode) or `transaction` (a pooler in transaction mode). Default: learned
    /// from the first connection.
    pub(super) pooler: Option<String>,
    /// `store.postgres.pool_size`: pooled connections. Default `16`, at least 1.
    pub(super) pool_size: Option<usize>,
    /// `store.postgres.batch_keys`: the most keys one statement claims or completes for
    /// requests waiting together. Default `32`, 1 to 1000; `1` sends every key alone.
    pub(super) batch_keys: Option<usize>,
    /// `store.postgres.batch_bytes`: the most stored answers (bytes) one batched completion
    /// carries. Default `1MiB`, at least 1.
    pub(super) batch_bytes: Option<RawSize>,
    /// `store.postgres.acquire_timeout`: longest wait for a pooled connection, creating one
    /// included. Default `500ms`.
    pub(super) acquire_timeout: Option<String>,
    /// `store.postgres.connect_timeout`: longest wait to open one connection. Default `2s`.
    pub(super) connect_timeout: Option<String>,
    /// `store.postgres.statement_timeout`: the server-side `statement_timeout`, also
    /// enforced on the client side. Default `2s`.
    pub(super) statement_timeout: Option<String>,
    /// `store.postgres.tls`: TLS to the database. Default `{ mode: disable }`.
    pub(super) tls: Option<RawPgTls>,
    /// `store.postgres.allow_async_commit`: `true` accepts a database whose
    /// `synchronous_commit` is `off`, which can lose answers clients already got. Default
    /// `false`: `serve` refuses such a database.
    pub(super) allow_async_commit: Option<bool>,
}

/// `store.sqlite`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSqlite {
    /// `store.sqlite.path`: the database file, created with its directory; one instance per
    /// file. Required, not empty.
    pub(super) path: String,
    /// `store.sqlite.busy_timeout`: how long a statement waits for SQLite's write lock.
    /// Default `2s`.
    pub(super) busy_timeout: Option<String>,
}

/// `store.postgres.tls`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPgTls {
    /// `store.postgres.tls.mode`: `disable`, `require` (encrypted, certificate not checked)
    /// or `verify-full` (chain and host name checked). Required when `tls` is given.
    pub(super) mode: String,
    /// `store.postgres.tls.ca`: a PEM file of the CA for `verify-full` (only with it).
    /// Default: the platform's trusted roots.
    pub(super) ca: Option<String>,
}

/// `upstreams.<name>`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    /// `upstreams.<name>.url`: `http://` or `https://`, host and port, optionally a path
    /// prefix (no query). Required.
    pub(super) url: String,
    /// `upstreams.<name>.connect_timeout`: a connection not up by then is a 502 (nothing
    /// was sent). Default `1s`, or half of `timeout` if that is shorter; must be shorter
    /// than `timeout`.
    pub(super) connect_timeout: Option<String>,
    /// `upstreams.<name>.timeout`: the whole exchange, request, response head and, for
    /// keyed requests, the stored body (504 after it). Default `30s`.
    pub(super) timeout: Option<String>,
    /// `upstreams.<name>.max_in_flight`: requests forwarded to it at once, detached ones
    /// included (503 `overloaded` past it). Default `1024`, at least 1.
    pub(super) max_in_flight: Option<usize>,
    /// `upstreams.<name>.idle_timeout`: how long an idle connection to it is kept for reuse.
    /// Default `800ms`; set it below the upstream's own keep-alive timeout.
    pub(super) idle_timeout: Option<String>,
    /// `upstreams.<name>.tls`: the CA that verifies an `https` upstream. Default: the
    /// platform's trusted roots.
    pub(super) tls: Option<RawCaOnly>,
    /// `upstreams.<name>.http2`: `true` speaks HTTP/2 (h2c for `http://`, ALPN `h2` then
    /// `http/1.1` for `https://`). Default `false`: HTTP/1.1 only.
    pub(super) http2: Option<bool>,
    /// `upstreams.<name>.preserve_host`: `true` sends the client's `Host` instead of the
    /// upstream's authority. Default `false`.
    pub(super) preserve_host: Option<bool>,
}

/// `routes[i]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    /// `routes[i].name`: unique, not empty; named in metrics, logs and fingerprints.
    /// Required.
    pub(super) name: String,
    /// `routes[i].match`: which requests the route takes. Required.
    #[serde(rename = "match")]
    pub(super) matcher: RawMatch,
    /// `routes[i].upstream`: the name of an upstream in `upstreams`. Required.
    pub(super) upstream: String,
    /// `routes[i].idempotency`: makes the route's keyed requests idempotent. Default: none,
    /// a plain reverse proxy.
    pub(super) idempotency: Option<RawIdempotency>,
}

/// `routes[i].match`: exactly one of `path` and `path_prefix`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMatch {
    /// `match.path`: an exact path, with or without one trailing slash; starts with `/`.
    pub(super) path: Option<String>,
    /// `match.path_prefix`: a prefix on a segment boundary (`/api` matches `/api` and
    /// `/api/x`, never `/apix`); starts with `/`.
    pub(super) path_prefix: Option<String>,
    /// `match.methods`: the methods the route matches, e.g. `[POST]`. Default: any method.
    pub(super) methods: Option<Vec<String>>,
}

/// `routes[i].idempotency`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawIdempotency {
    /// `mode`: `enforce` (replay, wait, refuse) or `observe` (claim and record, but always
    /// forward, counting what enforcing would have done). Default `enforce`.
    pub(super) mode: Option<Mode>,
    /// `key`: where the key is read, the first source present wins. Default
    /// `[ { header: Idempotency-Key } ]`; not empty.
    pub(super) key: Option<Vec<RawKeySource>>,
    /// `scope`: whose key it is. Default `{ fixed: default }`.
    pub(super) scope: Option<RawScope>,
    /// `required`: `true` answers a request without a key 400 `key-missing`; `false`
    /// forwards it without idempotency. Default `false`.
    pub(super) required: Option<bool>,
    /// `methods`: the methods made idempotent; others on the route are plain proxied.
    /// Default `[POST, PATCH]`.
    pub(super) methods: Option<Vec<String>>,
    /// `fingerprint`: what besides the method, path and body makes two requests differ.
    /// Default: the raw body bytes, no headers.
    pub(super) fingerprint: Option<RawFingerprint>,
    /// `ttl`: how long a stored answer is replayed, counted from completion. Default `24h`;
    /// longer than `lease`.
    pub(super) ttl: Option<String>,
    /// `lease`: how long an attempt owns its key. Default: the upstream's `timeout` + `15s`
    /// (+ `serialize.wait_timeout`), more where the store's timeouts need it; must exceed the
    /// upstream's `timeout` plus the store's record bound (with `serialize`: plus
    /// `serialize.wait_timeout` and a second record bound, the slot's call).
    pub(super) lease: Option<String>,
    /// `in_flight`: `wait` for the first attempt's answer, or `reject` with 409 at once.
    /// Default `wait`.
    pub(super) in_flight: Option<InFlight>,
    /// `wait_timeout`: how long a duplicate waits, then 409 `in-flight`. Default `10s`.
    pub(super) wait_timeout: Option<String>,
    /// `retry_statuses`: statuses (`503`) and ranges (`500-599`) that release the key
    /// instead of being stored. Default `[408, 425, 429, 500-599]`.
    pub(super) retry_statuses: Option<Vec<RawStatus>>,
    /// `on_unknown_outcome`: after a timeout, a cut connection or a crash, `reforward`
    /// (release the key) or `hold` (502 `outcome-unknown` until deleted or `ttl`). Default
    /// `reforward`.
    pub(super) on_unknown_outcome: Option<OnUnknownOutcome>,
    /// `on_store_error`: with the store unreachable, `reject` (503) or `pass_through`
    /// (forward without idempotency). Default `reject`.
    pub(super) on_store_error: Option<OnStoreError>,
    /// `max_request_body`: larger keyed bodies get 413. Default `1MiB`; not larger than
    /// `server.max_buffered_bytes`.
    pub(super) max_request_body: Option<RawSize>,
    /// `max_stored_response`: larger answers reach the first client but are not stored
    /// (retries get 502 `response-not-replayable`). Default `1MiB`.
    pub(super) max_stored_response: Option<RawSize>,
    /// `replay_headers`: response headers stored and replayed (never hop-by-hop ones or
    /// `Trailer`). Default: `content-type`, `content-encoding`, `content-language`,
    /// `location`, `content-location`, `etag`, `last-modified`, `link`, `cache-control`,
    /// `retry-after`.
    pub(super) replay_headers: Option<Vec<String>>,
    /// `forward_key_header`: the header the key is sent on to the upstream in. Default
    /// `Idempotency-Key`.
    pub(super) forward_key_header: Option<String>,
    /// `serialize`: a per-scope limit on keyed forwards, across instances. Default: none.
    pub(super) serialize: Option<RawSerialize>,
}

/// `routes[i].idempotency.serialize`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSerialize {
    /// `serialize.max_in_flight`: keyed requests of one scope forwarded at once. Default
    /// `1`, at least 1.
    pub(super) max_in_flight: Option<u32>,
    /// `serialize.wait_timeout`: how long a request queues for a slot, then 409
    /// `in-flight`. Default `10s`.
    pub(super) wait_timeout: Option<String>,
}

/// One of `routes[i].idempotency.key`: a map with exactly one of these.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
pub(super) enum RawKeySource {
    /// `{ header: Name }`: a request header, bare or RFC 8941 `"quoted"`.
    Header(String),
    /// `{ json: /pointer }`: a JSON pointer (RFC 6901) into the request body.
    Json(String),
}

/// `routes[i].idempotency.scope`: a map with exactly one of these.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
pub(super) enum RawScope {
    /// `{ header: X-Account-Id }`: a request header.
    Header(String),
    /// `{ json: /account_id }`: a JSON pointer into the request body.
    Json(String),
    /// `{ authorization: true }`: SHA-256 of the `Authorization` header (`false` is an
    /// error).
    Authorization(bool),
    /// `{ fixed: name }`: one scope for every request of the route (1-255 bytes).
    Fixed(String),
}

/// `routes[i].idempotency.fingerprint`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFingerprint {
    /// `fingerprint.headers`: request headers that make two requests differ. Default `[]`.
    #[serde(default)]
    pub(super) headers: Vec<String>,
    /// `fingerprint.json_canonical`: `true` hashes the body as canonical JSON (sorted keys,
    /// compact). Default `false`: the raw body bytes.
    #[serde(default)]
    pub(super) json_canonical: bool,
    /// `fingerprint.json_ignore`: JSON pointers left out of the fingerprint (needs
    /// `json_canonical: true`). Default `[]`.
    #[serde(default)]
    pub(super) json_ignore: Vec<String>,
}

/// One of `retry_statuses`: a number or a string.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum RawStatus {
    /// `503`: one status, 100-599.
    Code(u16),
    /// `"500-599"` (or `"503"`): an inclusive range of statuses.
    Range(String),
}

/// A size: a number or a string.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum RawSize {
    /// `512`: bytes.
    Bytes(u64),
    /// `64KiB`, `1MiB`, `1GiB`, `512B` (`KB`, `MB`, `GB` are powers of 1000).
    Text(String),
}
