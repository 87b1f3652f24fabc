//! One request: route → key/scope → fingerprint → claim → forward or replay
//! (docs/contract.md §2). One file per stage:
//!
//! - `mod.rs` (here): the [`Gateway`] every connection shares: the routing snapshot and its
//!   reload, admission (`max_in_flight`, `max_buffered_bytes`), readiness, forward jobs.
//! - `connection.rs`: a client connection's requests: the request line checked, the route
//!   found (once, by index), the access line and counters written; never fails.
//! - `plain.rs`: forwards without a key: streamed both ways, tunnels.
//! - `request.rs`: a keyed request from its claim on ([`KeyedRequest`](request::KeyedRequest)):
//!   the one context every later stage reads, its route held by index.
//! - `keyed.rs`: a keyed request up to its claim: the body read, a hot replay; then the
//!   `KeyedRequest` task: claim, wait, replay.
//! - `keying.rs`: a keyed request's key, scope and fingerprint, and the repeated-member
//!   check (on a blocking thread for a large body).
//! - `record.rs`: a claimed request: `serialize` and the upstream slot, the forward, the
//!   fenced write of its outcome.
//!
//! `Connection::handle` never fails: it calls `route_request`, which returns a `Result`,
//! and turns an error into a problem response, logging it once with its cause.
//!
//! Invariants:
//! - Nothing keyed is forwarded without a claim, except with `on_store_error: pass_through`
//!   (answered with `Idempotency-Status: bypassed`).
//! - The forward and the write of its outcome run in a spawned task: a client that hangs up
//!   does not cancel the upstream call, and the outcome is still recorded.
//! - A storable first answer is committed before it is sent (guarantee 3). If it cannot be
//!   committed, the client gets 503 and the key stays in flight until its lease ends.
//! - The path is normalized once (`path.rs`), before routing; the normalized (for an exact
//!   route, the configured) spelling is what is matched, fingerprinted and forwarded.
//! - Every forwarded request is admitted first (`limits.rs`): an upstream slot and its body's
//!   bytes, taken before the body is read and before any claim, held until the forward ends.
//! - A keyed request from its claim on is one spawned task, awaited by its `JoinHandle`: a
//!   client that hangs up does not cancel it, and a task that panics is a 500 `internal`.
//! - Only a plain request can open a tunnel (`tunnel.rs`); a keyed one's `Upgrade` is
//!   stripped like any hop-by-hop header, so no key is claimed for a tunnel.
//! - A `mode: observe` route (contract §8.3) claims, fingerprints and records a first attempt
//!   exactly as `enforce` does, but every request is forwarded: a duplicate, an in-flight
//!   duplicate or a mismatch is forwarded unrecorded (the stored first answer is never
//!   touched) and counted in `idemgate_observed_total`; a request that cannot be keyed, a
//!   body over `max_request_body` and store trouble are forwarded without idempotency. Its
//!   answers never come from the replay cache, `serialize` does not apply, and it never
//!   answers 409, 422 or 503 for the store.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use http::header::HeaderName;
use tokio::sync::Notify;

use crate::config::Config;
use crate::forward::UpstreamClient;
use crate::inflight::Wakeups;
use crate::limits::{Admission, ByteBudget, UpstreamLimit};
use crate::metrics::Metrics;
use crate::problem::GatewayError;
use crate::routing::{LimitRegistry, Routing};
use crate::serialize::Serializer;
use crate::store::Store;

pub mod connection;
mod keyed;
mod keying;
mod plain;
mod record;
mod request;
/// Response header on answers forwarded without idempotency because the store was down.
pub const IDEMPOTENCY_STATUS: HeaderName = HeaderName::from_static("idempotency-status");

/// Everything a request needs, shared by all connections.
pub struct Gateway {
    /// The routes and upstream clients in force; a reload swaps the whole snapshot, and each
    /// request (and its forward job) keeps the one it started with.
    routing: RwLock<Arc<Routing>>,
    /// Counts the reloads: a [`Connection`] takes [`Gateway::routing`] again only when it
    /// changed (a read of a line no request writes, instead of the lock and the count).
    generation: std::sync::atomic::AtomicU64,
    pub(crate) store: Arc<dyn Store>,
    jobs: Arc<Jobs>,
    pub(crate) serializer: Arc<Serializer>,
    /// Who waits for which in-flight key, and the replay cache; the store announces to it.
    pub(crate) inflight: Arc<Wakeups>,
    pub(crate) metrics: Arc<Metrics>,
    /// Admission counters by upstream name, kept across reloads.
    limits: std::sync::Mutex<std::collections::HashMap<String, Arc<UpstreamLimit>>>,
    /// `server.max_buffered_bytes` (a restart applies a change).
    budget: Arc<ByteBudget>,
    /// Draining, and whether the store has been ready once (what `/readyz` reports).
    readiness: Readiness,
    /// The listener's certificate (`server.tls`), loaded by the first serving thread and
    /// shared by all; SIGHUP reads its files again.
    listener_cert: std::sync::Mutex<Option<Arc<crate::tls::ListenerCert>>>,
    /// The tracer when traces are on (`telemetry`); `None`: a request makes no span.
    pub(crate) telemetry: Option<Arc<crate::telemetry::Telemetry>>,
}

/// What `/readyz` needs to know besides the store's own answer (see `admin.rs`).
#[derive(Debug, Default)]
pub struct Readiness {
    /// Set once on SIGTERM/SIGINT: `/readyz` answers 503 from then on (docs/contract.md §8.3).
    draining: AtomicBool,
    /// Set the first time the store answered, migrated and durable: from then on a store
    /// outage is reported by `/readyz` without failing it.
    store_was_ready: AtomicBool,
}

impl Readiness {
    /// Marks the process as draining; it never becomes ready again.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Records that the store was found ready (migrated, durable) by this process.
    pub fn store_ready(&self) {
        self.store_was_ready.store(true, Ordering::SeqCst);
    }

    pub fn store_was_ready(&self) -> bool {
        self.store_was_ready.load(Ordering::SeqCst)
    }
}

/// Counts forward jobs still running (including those whose client left), so that shutdown
/// can let them record their outcome.
#[derive(Default)]
pub struct Jobs {
    running: AtomicUsize,
    idle: Notify,
    gauge: prometheus_client::metrics::gauge::Gauge,
}

/// Held by a running job; the last one out wakes whoever waits for idleness.
struct JobGuard(Arc<Jobs>);

impl Jobs {
    fn start(self: &Arc<Self>) -> JobGuard {
        self.running.fetch_add(1, Ordering::SeqCst);
        self.gauge.inc();
        JobGuard(Arc::clone(self))
    }

    /// How many jobs are running now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// Resolves once no job is running.
    pub async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.running() == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        self.0.gauge.dec();
        if self.0.running.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Gateway {
    /// A gateway without traces.
    pub fn new(config: Arc<Config>, store: Arc<dyn Store>) -> Gateway {
        Gateway::with_traces(config, store, None).expect("nothing to start without traces")
    }

    /// A gateway whose requests are traced as `traces` says (`None`: not traced); fails
    /// only when the exporter cannot start.
    pub fn with_traces(
        config: Arc<Config>,
        store: Arc<dyn Store>,
        traces: Option<&crate::telemetry::Settings>,
    ) -> Result<Gateway, String> {
        let inflight = Arc::new(Wakeups::new(config.replay_cache_bytes));
        store.start_background(Arc::clone(&inflight) as Arc<dyn crate::store::Announce>);
        let metrics = Arc::new(Metrics::new(store.metrics()));
        let jobs = Arc::new(Jobs {
            gauge: metrics.forwards_in_flight.clone(),
            ..Default::default()
        });
        let budget = Arc::new(ByteBudget::new(
            config.server.max_buffered_bytes,
            metrics.buffered_bytes.clone(),
        ));
        let limits = std::sync::Mutex::default();
        metrics.configure(&config);
        let telemetry = traces
            .map(|t| crate::telemetry::Telemetry::start(t, metrics.trace_spans.clone()))
            .transpose()?;
        let routing = Routing::new(
            config,
            &LimitRegistry {
                limits: &limits,
                metrics: &metrics,
            },
        );
        Ok(Gateway {
            routing: RwLock::new(Arc::new(routing)),
            generation: std::sync::atomic::AtomicU64::new(0),
            store,
            jobs,
            serializer: Arc::default(),
            inflight,
            metrics,
            limits,
            budget,
            readiness: Readiness::default(),
            listener_cert: std::sync::Mutex::default(),
            telemetry,
        })
    }

    /// The tracer, when traces are on.
    pub fn telemetry(&self) -> Option<&Arc<crate::telemetry::Telemetry>> {
        self.telemetry.as_ref()
    }

    /// Draining and store readiness, for `/readyz` and the shutdown path.
    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// Admits a request to `upstream`, or refuses it while either bound is reached
    /// (docs/contract.md §8.2: nothing has been read, claimed or forwarded yet). A request
    /// forwarded as it comes (`buffered: false`) takes its upstream slot now; a keyed one
    /// takes it once it has claimed its key ([`Gateway::forward_slot`]: a duplicate or a
    /// replay takes none) and reserves the byte budget as its body arrives.
    fn admit(&self, upstream: &UpstreamClient, buffered: bool) -> Result<Admission, GatewayError> {
        let name = &upstream.config.name;
        let slot = if buffered {
            None
        } else {
            let slot = upstream.limit.try_acquire();
            if slot.is_none() {
                self.metrics.refused(name, "max_in_flight");
                return Err(GatewayError::Overloaded("max_in_flight"));
            }
            slot
        };
        let bytes = if buffered {
            self.budget.try_reserve(0)
        } else {
            self.budget.admit_unbuffered()
        };
        let Some(bytes) = bytes else {
            self.metrics.refused(name, "max_buffered_bytes");
            return Err(GatewayError::Overloaded("max_buffered_bytes"));
        };
        Ok(Admission { slot, bytes })
    }

    /// The upstream slot of a buffered request about to be forwarded (see [`Gateway::admit`]).
    fn forward_slot(
        &self,
        upstream: &UpstreamClient,
        admission: &mut Admission,
    ) -> Result<(), GatewayError> {
        admission
            .take_slot(&upstream.limit, &upstream.config.name, &self.metrics)
            .map_err(GatewayError::Overloaded)
    }

    /// The bytes held by request bodies and captured responses now.
    pub fn buffered_bytes(&self) -> usize {
        self.budget.used()
    }

    /// The routing snapshot in force now.
    pub fn routing(&self) -> Arc<Routing> {
        Arc::clone(&self.routing.read().expect("routing lock"))
    }

    /// The configuration in force now.
    pub fn config(&self) -> Arc<Config> {
        Arc::clone(&self.routing().config)
    }

    /// Swaps in a new, already validated configuration for new requests; requests in flight
    /// finish with the one they started with. Returns the changed settings that only a
    /// restart applies (listeners, server limits, the replay cache size, logging): those keep
    /// their old values. A changed `store` section refuses the whole reload: leases were
    /// validated against its timeouts, which would not be the ones in force.
    pub fn reload(&self, config: Config) -> Result<Vec<&'static str>, String> {
        let old = self.config();
        if old.store != config.store {
            return Err(
                "the store section changed; restart to apply it (nothing was reloaded)".into(),
            );
        }
        // Sections only a restart applies are compared with what runs, and what runs is kept
        // in the new snapshot (so a request never sees a value the log says is pending, and
        // a second SIGHUP still reports a pending change).
        let mut config = config;
        let mut restart_needed = Vec::new();
        if old.listen != config.listen {
            restart_needed.push("listen");
            config.listen = old.listen;
        }
        if old.admin.as_ref().map(|a| a.listen) != config.admin.as_ref().map(|a| a.listen) {
            restart_needed.push("admin.listen");
        }
        if let (Some(running), Some(new)) = (&old.admin, &mut config.admin) {
            new.listen = running.listen;
        }
        if old.server != config.server {
            restart_needed.push("server");
            config.server = old.server.clone();
        }
        if old.gc != config.gc {
            restart_needed.push("store.gc");
            config.gc = old.gc.clone();
        }
        if old.replay_cache_bytes != config.replay_cache_bytes {
            restart_needed.push("replay_cache");
            config.replay_cache_bytes = old.replay_cache_bytes;
        }
        if old.log_format != config.log_format {
            restart_needed.push("log");
            config.log_format = old.log_format;
        }
        if old.telemetry != config.telemetry {
            restart_needed.push("telemetry");
            config.telemetry = old.telemetry.clone();
        }
        self.metrics.configure(&config);
        let routing = Routing::new(
            Arc::new(config),
            &LimitRegistry {
                limits: &self.limits,
                metrics: &self.metrics,
            },
        );
        *self.routing.write().expect("routing lock") = Arc::new(routing);
        // After the swap: a connection that sees the new count takes the new snapshot.
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        Ok(restart_needed)
    }

    /// The listener's TLS (`server.tls`), its certificate loaded once and shared by every
    /// serving thread.
    pub fn listener_tls(
        &self,
        files: &crate::config::TlsFiles,
    ) -> Result<Arc<rustls::ServerConfig>, String> {
        let mut cert = self.listener_cert.lock().expect("certificate lock");
        let cert = match &*cert {
            Some(c) => Arc::clone(c),
            None => {
                Arc::clone(cert.insert(crate::tls::ListenerCert::load(&files.cert, &files.key)?))
            }
        };
        cert.server_config()
    }

    /// Reads the listener's certificate files again (SIGHUP): `None` without TLS; on an
    /// error the certificate in place stays.
    pub fn reload_certificate(&self) -> Option<Result<(), String>> {
        let cert = self
            .listener_cert
            .lock()
            .expect("certificate lock")
            .clone()?;
        Some(cert.reload())
    }

    /// The process's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Refreshes the gauges read at scrape time and renders every metric.
    pub fn render_metrics(&self, format: crate::metrics::Format) -> String {
        self.store.observe_pool();
        let wakeups = &self.inflight;
        self.metrics
            .wakeups_healthy
            .set(i64::from(wakeups.healthy()));
        self.metrics
            .replay_cache_bytes
            .set(wakeups.cache_bytes() as i64);
        self.metrics.encode(format)
    }

    /// The forward jobs in flight.
    pub fn jobs(&self) -> &Jobs {
        &self.jobs
    }

    /// Who waits for which in-flight key, and the replay cache.
    pub fn inflight(&self) -> &Wakeups {
        &self.inflight
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }
}
