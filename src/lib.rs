//! idemgate: an idempotency gateway in front of any HTTP upstream.
//!
//! The modules, in the order a request meets them:
//!
//! - [`config`]: YAML → validated [`config::Config`] (durations, sizes, routes, env vars):
//!   `config/mod.rs` the typed config and loading, `raw.rs` the YAML shapes, `validate.rs`
//!   one check per section, `units.rs` durations and sizes.
//! - [`server`]: listener, connection limit, header read timeout, drain and graceful shutdown.
//! - [`wake`]: what a serving thread does when it wakes (one yield while nothing is in
//!   flight), and the count of what is in flight.
//! - [`path`]: path normalization before routing (one request, one spelling).
//! - [`limits`]: admission bounds: connection slots, upstream slots and buffered bytes.
//! - [`routing`]: the configuration snapshot in force and its upstream clients.
//! - [`access`]: request ids and the access log line of each request.
//! - [`body`]: request bodies read within their limit, responses captured for the store.
//! - [`record`]: a claimed request's forward and its fenced, retried recording.
//! - [`gateway`]: one request: route → key/scope → fingerprint → claim → forward or replay
//!   (or, on an observe route, forward and count what enforcing would have done).
//! - [`json`]: the JSON of keyed bodies, read in one linear pass, nesting bounded.
//! - [`key`]: key and scope extraction and validation.
//! - [`fingerprint`]: SHA-256 over the parts that make two requests the same.
//! - [`serialize`]: per-scope forwarding slots across instances (`serialize`).
//! - [`inflight`]: who waits for which in-flight key (subscriptions, shared lookups, the
//!   waiting loop and its backoff), and the replay cache: completed responses kept in memory
//!   so hot replays skip the store. The stores only announce to it ([`store::Announce`]).
//! - [`store`]: the [`store::Store`] trait (claim / finish / inspect / delete), the
//!   Postgres and embedded implementations with their SQL and migrations.
//! - [`tls`]: rustls (ring) configurations for the listener, upstreams and PostgreSQL.
//! - [`forward`]: upstream clients (HTTP/1.1 or h2), header hygiene, timeouts.
//! - [`headers`]: the hop-by-hop header names (never forwarded, stored or replayed).
//! - [`tunnel`]: upgrades (WebSocket) on plain routes, spliced until either side closes.
//! - [`replay`]: stored response ⇄ HTTP response, header allow-list.
//! - [`problem`]: every client-visible error and the one status table.
//! - [`metrics`]: the Prometheus metrics and the outcome names they count.
//! - [`telemetry`]: traces over OTLP (off unless configured): spans per request, exported
//!   off the request path through a bounded queue.
//! - [`admin`]: health, readiness (draining, store trouble) and the key API on `admin.listen`.
//! - [`keys`]: operator lookups and deletes of stored keys (key API and `idemgate keys`).
//! - [`app`]: the one wiring path (`App::build`, `App::run`) that `serve` and the tests use.
//! - [`commands`]: what each CLI verb does (`main.rs` only parses arguments).
//!
//! Beside the gateway, with the cargo feature `demo` (on by default), `src/demo/`:
//!
//! - `demo`: `idemgate demo`: the lab, straight and through idemgate, side by side.
//! - `demo::lab` (also `idemgate::lab`): the lab of docs/lab.md as code: the naive legacy
//!   ledger upstream and the lab's checks.
//! - `demo::process` (also `idemgate::process`): an `idemgate serve` child process to crash
//!   and restart (demo, tests, benchmarks).

#![forbid(unsafe_code)]

pub mod access;
pub(crate) mod admin;
pub mod app;
pub(crate) mod body;
pub mod commands;
pub mod config;
#[cfg(feature = "demo")]
pub mod demo;
pub mod fingerprint;
pub mod forward;
pub mod gateway;
pub(crate) mod headers;
pub(crate) mod inflight;
pub mod json;
pub mod key;
pub(crate) mod keys;
pub(crate) mod limits;
pub mod logging;
pub mod metrics;
pub(crate) mod path;
pub(crate) mod payload;
pub mod problem;
pub mod replay;
pub(crate) mod routing;
pub(crate) mod serialize;
pub mod server;
pub(crate) mod shard;
pub mod store;
pub mod telemetry;
pub(crate) mod timer;
pub mod tls;
pub(crate) mod tunnel;

#[cfg(feature = "demo")]
pub use demo::{lab, process};
