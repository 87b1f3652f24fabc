//! One request: route → key/scope → fingerprint → claim → forward or replay
//! (docs/contract.md §2).
//!
//! [`Gateway::handle`] never fails: it calls [`Gateway::route_request`], which returns a
//! `Result`, and turns an error into a problem response, logging it once with its cause.
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
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::body::{RequestBody, read_body};
use crate::cache::ReplayCache;
use crate::config::Idempotency;
use crate::config::{Config, InFlight, Mode, OnStoreError, OnUnknownOutcome, Route};
use crate::fingerprint::{Fingerprint, fingerprint};
use crate::forward::{Body, ClientInfo, UpstreamClient, clean_response_headers, full, stream};
use crate::key::{JsonBody, KeyScope, extract};
use crate::limits::{Admission, ByteBudget, UpstreamLimit};
use crate::metrics::{Metrics, observed, outcome};
use crate::problem::GatewayError;
use crate::record::ForwardJob;
use crate::routing::{LimitRegistry, Routing};
use crate::serialize::Serializer;
use crate::store::{Claim, ClaimRequest, Store};
use crate::wait::{self, key_id};

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

/// What the requests of one client connection share (`server.rs` makes one per
/// connection): the gateway, the client, the connection's slot of `max_connections`, and
/// the routing snapshot its last request used.
///
/// Per request this touches only the connection's own memory, which stays with the task that
/// serves the connection: the runtime's workers do not pass the gateway's reference count,
/// nor the routing lock and count, from core to core at every request. A reload is seen by
/// the next request: the snapshot is taken again when [`Gateway`]'s reload count changed.
pub struct Connection {
    gateway: Arc<Gateway>,
    client: ClientInfo,
    slot: Option<crate::limits::ConnectionSlot>,
    /// The reload count it was taken at, and the snapshot.
    routing: std::sync::Mutex<(u64, Arc<ConnectionRouting>)>,
}

/// A connection's own reference to a routing snapshot: its requests clone this `Arc`, whose
/// count only the connection's task writes, instead of the snapshot's, which every worker
/// shares.
struct ConnectionRouting(Arc<Routing>);

impl Connection {
    pub fn new(
        gateway: Arc<Gateway>,
        client: ClientInfo,
        slot: Option<crate::limits::ConnectionSlot>,
    ) -> Connection {
        let routing = std::sync::Mutex::new(ConnectionRouting::taken(&gateway));
        Connection {
            gateway,
            client,
            slot,
            routing,
        }
    }

    /// The routing snapshot in force now.
    fn routing(&self) -> Arc<ConnectionRouting> {
        let generation = self
            .gateway
            .generation
            .load(std::sync::atomic::Ordering::Acquire);
        let mut cached = self.routing.lock().unwrap_or_else(|e| e.into_inner());
        if cached.0 != generation {
            *cached = ConnectionRouting::taken(&self.gateway);
        }
        Arc::clone(&cached.1)
    }

    /// Serves one request on this connection; never fails.
    pub async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let routing = self.routing();
        self.gateway
            .handle(&routing.0, req, &self.client, self.slot.clone())
            .await
    }
}

impl ConnectionRouting {
    /// `gateway`'s snapshot now, with the reload count read before it: a count seen new is
    /// never paired with an older snapshot.
    fn taken(gateway: &Gateway) -> (u64, Arc<ConnectionRouting>) {
        let generation = gateway
            .generation
            .load(std::sync::atomic::Ordering::Acquire);
        (generation, Arc::new(ConnectionRouting(gateway.routing())))
    }
}

/// What the access log line and the request counter say about one request.
struct RequestLog {
    /// The matched route's metric handles (and name).
    route: Option<Arc<crate::metrics::RouteHandles>>,
    outcome: &'static str,
    key_id: Option<String>,
    upstream: Option<Duration>,
    /// Request body bytes when known (a keyed body read whole).
    bytes_in: Option<u64>,
    /// Counts a streamed request body of unknown length.
    counted_in: Option<Arc<std::sync::atomic::AtomicU64>>,
    /// A passed-on answer's admission, held by the response body until it is done with.
    held: Option<Admission>,
}

impl RequestLog {
    fn new(outcome: &'static str) -> RequestLog {
        RequestLog {
            route: None,
            outcome,
            key_id: None,
            upstream: None,
            bytes_in: None,
            counted_in: None,
            held: None,
        }
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
    pub fn new(config: Arc<Config>, store: Arc<dyn Store>) -> Gateway {
        let cache = Arc::new(ReplayCache::new(config.replay_cache_bytes));
        store.wakeups().attach_cache(Arc::clone(&cache));
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
        metrics.init_observed(&config);
        let routing = Routing::new(
            config,
            &LimitRegistry {
                limits: &limits,
                metrics: &metrics,
            },
        );
        Gateway {
            routing: RwLock::new(Arc::new(routing)),
            generation: std::sync::atomic::AtomicU64::new(0),
            store,
            jobs,
            serializer: Arc::default(),
            metrics,
            limits,
            budget,
            readiness: Readiness::default(),
            listener_cert: std::sync::Mutex::default(),
        }
    }

    /// Draining and store readiness, for `/readyz` and the shutdown path.
    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// Admits a request to `upstream` with `bytes` of body to buffer (`None`: a streamed
    /// forward, which buffers nothing), or refuses it (docs/contract.md §8.2): nothing has
    /// been read, claimed or forwarded yet.
    /// Admits a request: with an upstream slot when it is forwarded as it comes
    /// (`buffered: false`), without one when it is keyed (it takes one once it has claimed
    /// its key, `Gateway::forward_slot`); with a reservation of the byte budget that grows as
    /// its body arrives when it is buffered. Refused while either bound is reached.
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
        self.metrics.init_observed(&config);
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
        let wakeups = self.store.wakeups();
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

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Serves one request of `client`'s connection with the routing snapshot `routing`;
    /// never fails. `connection` is the connection's slot of `max_connections`: only a tunnel
    /// keeps it past the response.
    async fn handle(
        self: &Arc<Self>,
        routing: &Arc<Routing>,
        mut req: Request<Incoming>,
        client: &ClientInfo,
        connection: Option<crate::limits::ConnectionSlot>,
    ) -> Response<Body> {
        let started = Instant::now();
        // The request id travels to the upstream with the request's headers.
        let request_id = crate::access::request_id(req.headers());
        req.headers_mut()
            .insert(crate::access::X_REQUEST_ID, request_id.clone());
        let declared_in = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .or_else(|| hyper::body::Body::is_end_stream(req.body()).then_some(0));
        let (method, uri, version) = (req.method().clone(), req.uri().clone(), req.version());
        let mut log = RequestLog::new(outcome::PROXIED);
        let (mut resp, error) = match self
            .route_request(routing, req, client, connection, &mut log)
            .await
        {
            Ok(resp) => (resp, None),
            Err(err) => {
                log.outcome = err.outcome();
                let close = err.closes_connection();
                let mut resp = err
                    .problem()
                    .with_request_id(request_id.to_str().unwrap_or_default())
                    .into_response();
                if close {
                    resp.headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                (resp, Some(err))
            }
        };
        // While draining, an HTTP/1 client is told to reconnect (through its load balancer,
        // which no longer sends here) instead of reusing this connection. h2 gets GOAWAY when
        // the listener stops accepting.
        if self.readiness.draining() && version < http::Version::HTTP_2 {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        match &log.route {
            Some(handles) => {
                handles.request(log.outcome);
                if let Some(took) = log.upstream {
                    handles.upstream(took);
                }
            }
            // No route matched: counted under `route=""`.
            None => self.metrics.route("").request(log.outcome),
        }
        resp.headers_mut()
            .insert(crate::access::X_REQUEST_ID, request_id.clone());
        let line = crate::access::AccessLine {
            method,
            uri,
            version,
            client_ip: client.addr.ip(),
            request_id,
            started,
            route: log.route,
            outcome: log.outcome,
            status: resp.status().as_u16(),
            key_id: log.key_id,
            upstream: log.upstream,
            bytes_in: log.bytes_in.or(declared_in),
            error: error.map(|e| e.to_string()),
        };
        let (parts, body) = resp.into_parts();
        let body = crate::access::Logged::new(body, line, log.counted_in, log.held);
        Response::from_parts(parts, body.boxed_unsync())
    }

    async fn route_request(
        self: &Arc<Self>,
        routing: &Arc<Routing>,
        mut req: Request<Incoming>,
        client: &ClientInfo,
        connection: Option<crate::limits::ConnectionSlot>,
        log: &mut RequestLog,
    ) -> Result<Response<Body>, GatewayError> {
        check_request_line(&req)?;
        let raw = req.uri().path();
        // `OPTIONS *` is routed as the root and forwarded in asterisk form.
        let asterisk = raw == "*";
        let normal = if asterisk {
            std::borrow::Cow::Borrowed("/")
        } else {
            crate::path::normalize(raw).map_err(|_| GatewayError::PathInvalid)?
        };
        let index = routing.route_index(req.method(), &normal)?;
        let route = &routing.config.routes[index];
        let canonical = route.path.canonical(&normal);
        if canonical != raw && !asterisk {
            let uri = with_path(req.uri(), canonical);
            *req.uri_mut() = uri;
        }
        log.route = Some(Arc::clone(&routing.metrics[index]));
        let upstream = routing
            .upstreams
            .get(&route.upstream)
            .expect("validated config: every route names an upstream");
        match &route.idempotency {
            Some(idem) if idem.methods.contains(req.method()) => {
                // The body is buffered: its bytes are reserved as they arrive.
                let admission = self.admit(upstream, true)?;
                self.keyed(routing, route, idem, upstream, req, client, log, admission)
                    .await
            }
            _ => {
                let admission = self.admit(upstream, false)?;
                let upgrade = crate::tunnel::requested(&req, &upstream.config)
                    .map(|protocols| (protocols, hyper::upgrade::on(&mut req)));
                let (parts, body) = req.into_parts();
                let body = if parts.headers.contains_key(header::CONTENT_LENGTH) {
                    stream(body)
                } else {
                    // Counted for the access line (its length was not declared).
                    let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
                    log.counted_in = Some(Arc::clone(&count));
                    crate::access::Counted { body, count }
                        .map_err(|e| Box::new(e) as crate::forward::BoxError)
                        .boxed_unsync()
                };
                let mut out = upstream.prepare(parts, body, client, None);
                match upgrade {
                    None => proxy(upstream, out, log, admission, Some(&client.timer)).await,
                    Some((protocols, on_client)) => {
                        crate::tunnel::ask(&mut out, protocols);
                        let hold = (admission, connection);
                        Box::pin(tunnel(upstream, out, log, hold, on_client, &route.name)).await
                    }
                }
            }
        }
    }

    /// A keyed request: its body read, its key found, a hot replay answered here, anything
    /// else handed to a [`KeyedWork`] task. The rarer ways out (observe's forwards without a
    /// key, a request that has none) are boxed: this future is part of every request's
    /// future, which hyper moves into place whole.
    #[allow(clippy::too_many_arguments)] // one request's parts, named; a struct would only rename them
    async fn keyed(
        self: &Arc<Self>,
        routing: &Arc<Routing>,
        route: &Route,
        idem: &Idempotency,
        upstream: &UpstreamClient,
        req: Request<Incoming>,
        client: &ClientInfo,
        log: &mut RequestLog,
        mut admission: Admission,
    ) -> Result<Response<Body>, GatewayError> {
        let observe = idem.mode == Mode::Observe;
        let (parts, body) = req.into_parts();
        let limit = routing.config.server.body_read_timeout;
        let body = crate::timer::timeout(
            Some(&client.timer),
            limit,
            read_body(
                &parts.headers,
                body,
                idem.max_request_body,
                &mut admission.bytes,
            ),
        )
        .await
        .map_err(|_| GatewayError::BodyTimeout(limit))?
        .inspect_err(|e| {
            if let GatewayError::Overloaded(bound) = e {
                self.metrics.refused(&upstream.config.name, bound);
            }
        })?;
        let too_large = GatewayError::BodyTooLarge {
            limit: idem.max_request_body,
        };
        let body = match body {
            RequestBody::Whole(body) => body,
            RequestBody::TooLarge(rest) if observe => {
                self.forward_slot(upstream, &mut admission)?;
                return Box::pin(forward_unkeyed(
                    route, upstream, parts, rest, client, log, admission, too_large,
                ))
                .await;
            }
            RequestBody::TooLarge(_) => return Err(too_large),
        };
        admission.bytes.resize(body.len());
        log.bytes_in = Some(body.len() as u64);
        let keyed = key_request(routing, route, idem, &parts, &body).await;
        let (KeyScope { key, scope }, fp, settled) = match keyed {
            Ok(Some(keyed)) => keyed,
            Ok(None) => {
                // No key and none required: a plain forward.
                self.forward_slot(upstream, &mut admission)?;
                let out = upstream.prepare(parts, full(body), client, None);
                let timer = Some(&client.timer);
                return Box::pin(proxy(upstream, out, log, admission, timer)).await;
            }
            Err(e) if observe => {
                self.forward_slot(upstream, &mut admission)?;
                return Box::pin(forward_unkeyed(
                    route,
                    upstream,
                    parts,
                    full(body),
                    client,
                    log,
                    admission,
                    e,
                ))
                .await;
            }
            Err(e) => return Err(e),
        };
        let id = key_id(&scope, &key);
        // Hot replays skip the store (see cache.rs for why a hit is always a committed,
        // unexpired answer to this very request). An observe route never replays.
        let cache = if observe {
            None
        } else {
            self.store.wakeups().trusted_cache()
        };
        if let Some((cache, _)) = cache
            && let Some(hit) = cache.get(&id, &fp)
        {
            log.key_id = Some(id);
            log.outcome = outcome::REPLAYED;
            return self.hold_answer(hit.to_replay(), admission.bytes, true, log);
        }
        if let Err(e) = refuse_ambiguous(&parts, &body, settled) {
            if observe {
                self.forward_slot(upstream, &mut admission)?;
                let body = full(body);
                return Box::pin(forward_unkeyed(
                    route, upstream, parts, body, client, log, admission, e,
                ))
                .await;
            }
            return Err(e);
        }
        log.key_id = Some(id.clone());
        // From the claim on, the work runs in its own task: a client that hangs up while the
        // claim is in the database (or while waiting for a duplicate) cannot leave a claimed
        // key without a forward; the forward still happens and its answer is stored.
        let work = KeyedWork {
            gateway: Arc::clone(self),
            routing: Arc::clone(routing),
            route: route.name.clone(),
            parts,
            body,
            client: client.clone(),
            scope,
            key,
            id,
            fp,
            cache_epoch: cache.map(|(_, epoch)| epoch),
            admission,
        };
        // Awaited by its handle: dropping the handle (the client hung up) does not cancel it.
        // Boxed: `tokio::spawn` moves its future whole several times and writes the task's
        // output over a slot of the future's size, and this one is 5 KB; a box is moved once.
        let ((result, outcome, upstream_took), held) =
            match tokio::spawn(Box::pin(work.run())).await {
                Ok(done) => done,
                Err(e) => (joined(Err(e)), None),
            };
        log.outcome = outcome;
        log.upstream = upstream_took;
        match (result, held) {
            (Ok(resp), Some(bytes)) => {
                let replay = outcome == outcome::REPLAYED || outcome == outcome::COALESCED;
                self.hold_answer(resp, bytes, replay, log)
            }
            (result, _) => result,
        }
    }

    /// Counts an answer held in memory in the byte budget until it is written to the client
    /// (the reservation goes with the response body, `access::Logged`). A replay is refused
    /// past the bound (503 `overloaded`: nothing was executed for it); a first answer was,
    /// so it is always held, overdrawing the budget if it must.
    fn hold_answer(
        &self,
        resp: Response<Body>,
        mut bytes: crate::limits::Reservation,
        replay: bool,
        log: &mut RequestLog,
    ) -> Result<Response<Body>, GatewayError> {
        use hyper::body::Body as _;
        let size = resp.body().size_hint().exact().unwrap_or(0);
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        if replay {
            if !bytes.try_resize(size) {
                return Err(GatewayError::Overloaded("max_buffered_bytes"));
            }
        } else {
            bytes.resize(size);
        }
        log.held = Some(Admission { slot: None, bytes });
        Ok(resp)
    }
}

/// A keyed request from its claim on, owned by its own task (see `Gateway::keyed`).
struct KeyedWork {
    gateway: Arc<Gateway>,
    routing: Arc<Routing>,
    route: String,
    parts: http::request::Parts,
    body: Bytes,
    client: ClientInfo,
    scope: String,
    key: String,
    id: String,
    fp: Fingerprint,
    cache_epoch: Option<u64>,
    /// The buffered bytes (and, once forwarded, the upstream slot), held until this task
    /// ends.
    admission: Admission,
}

/// What a keyed request ended as: the answer, its outcome name, the upstream's time.
type KeyedResult = (
    Result<Response<Body>, GatewayError>,
    &'static str,
    Option<Duration>,
);

impl KeyedWork {
    /// The request's result, and its byte reservation when its answer is held in memory (a
    /// first answer captured for the store, or a replay), for `Gateway::keyed` to hold until
    /// the answer is written.
    async fn run(self) -> (KeyedResult, Option<crate::limits::Reservation>) {
        let mut answer_bytes = None;
        let result = self.work(&mut answer_bytes).await;
        (result, answer_bytes)
    }

    async fn work(self, answer_bytes: &mut Option<crate::limits::Reservation>) -> KeyedResult {
        let KeyedWork {
            gateway,
            routing,
            route: name,
            parts,
            body,
            client,
            scope,
            key,
            id,
            fp,
            cache_epoch,
            mut admission,
        } = self;
        let (route, idem, upstream) = routing
            .route(&name)
            .expect("a keyed request's route exists in its routing");
        let claim = ClaimRequest {
            scope: &scope,
            key: &key,
            route: &route.name,
            fingerprint: &fp,
            lease: idem.lease,
            ttl: idem.ttl,
            hold_expired_leases: idem.on_unknown_outcome == OnUnknownOutcome::Hold,
        };
        let observe = idem.mode == Mode::Observe;
        // What an observe route forwards without claiming: the upstream sees it as enforcing
        // would have forwarded it, key header included; nothing is recorded. It takes an
        // upstream slot first, as every forward does.
        let forward_observed =
            |log_outcome: &'static str, parts, body, mut admission: Admission| {
                let slot = gateway.forward_slot(upstream, &mut admission);
                let request = upstream.prepare(
                    parts,
                    full(body),
                    &client,
                    Some((&idem.forward_key_header, &key)),
                );
                // Boxed, as the other rare ways below: `tokio::spawn` moves this future whole.
                Box::pin(async move {
                    if let Err(e) = slot {
                        return (Err(e), outcome::OVERLOADED, None);
                    }
                    let mut log = RequestLog::new(log_outcome);
                    let result = proxy(upstream, request, &mut log, admission, None).await;
                    (result, log_outcome, log.upstream)
                })
            };
        let mut claimed_at = Instant::now();
        let claimed = { gateway.store.claim(claim).await };
        let first = match claimed {
            Ok(found) => found,
            Err(e) if observe => {
                tracing::warn!(route = %route.name, key = %id, error = %e, "observe: the store cannot claim; forwarded without idempotency");
                return forward_observed(outcome::BYPASSED, parts, body, admission).await;
            }
            Err(e) if idem.on_store_error == OnStoreError::PassThrough && e.is_unavailable() => {
                tracing::warn!(route = %route.name, error = %e, "store unavailable; forwarding without idempotency");
                if let Err(e) = gateway.forward_slot(upstream, &mut admission) {
                    return (Err(e), outcome::OVERLOADED, None);
                }
                let out = upstream.prepare(parts, full(body), &client, None);
                let mut log = RequestLog::new(outcome::BYPASSED);
                let result = Box::pin(proxy(upstream, out, &mut log, admission, None))
                    .await
                    .map(|mut resp| {
                        resp.headers_mut()
                            .insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("bypassed"));
                        resp
                    });
                return (result, outcome::BYPASSED, log.upstream);
            }
            Err(e) => return (Err(e.into()), outcome::STORE_UNAVAILABLE, None),
        };
        if observe {
            let would = match &first {
                Claim::Acquired { .. } => None,
                Claim::Completed(..) | Claim::NotReplayable { .. } | Claim::Held => {
                    Some(observed::WOULD_REPLAY)
                }
                Claim::InFlight { .. } => Some(observed::WOULD_WAIT),
                Claim::Mismatch => Some(observed::WOULD_MISMATCH),
            };
            if let Some(would) = would {
                gateway.metrics.observed(&route.name, would);
                tracing::info!(route = %route.name, key = %id, observed = would, "observe: forwarded a request that enforcing would not have forwarded");
                return forward_observed(outcome::OBSERVED, parts, body, admission).await;
            }
        }
        let mut waited = false;
        let found = match first {
            Claim::InFlight { .. } if idem.in_flight == InFlight::Reject => {
                return (
                    Err(GatewayError::in_flight()),
                    outcome::IN_FLIGHT_REJECTED,
                    None,
                );
            }
            Claim::InFlight { .. } => {
                let deadline = Instant::now() + idem.wait_timeout;
                match Box::pin(wait::wait_in_flight(
                    gateway.store.as_ref(),
                    claim,
                    deadline,
                ))
                .await
                {
                    Ok(Some((found, at))) => {
                        claimed_at = at;
                        waited = true;
                        found
                    }
                    Ok(None) => {
                        return (
                            Err(GatewayError::in_flight()),
                            outcome::IN_FLIGHT_REJECTED,
                            None,
                        );
                    }
                    Err(e) => return (Err(e.into()), outcome::IN_FLIGHT_REJECTED, None),
                }
            }
            other => other,
        };
        match found {
            Claim::Acquired { token, took_over } => {
                if took_over {
                    gateway.metrics.lease(&route.name, "taken_over");
                    tracing::warn!(route = %route.name, key = %id, "took over an expired lease: the earlier attempt's outcome is unknown");
                }
                let job = ForwardJob {
                    store: Arc::clone(&gateway.store),
                    serializer: Arc::clone(&gateway.serializer),
                    metrics: Arc::clone(&gateway.metrics),
                    routing: Arc::clone(&routing),
                    route: route.name.clone(),
                    scope: scope.clone(),
                    key: key.clone(),
                    token,
                    // Our clock started before the statement that set the lease in database
                    // time, so this is never later than the real end of the lease.
                    lease_ends: claimed_at + idem.lease,
                    admission,
                };
                let request = upstream.prepare(
                    parts,
                    full(body),
                    &client,
                    Some((&idem.forward_key_header, &key)),
                );
                // Counted as a running job (shutdown waits for it) until its outcome is written.
                let _guard = gateway.jobs.start();
                let mut took = None;
                let (result, bytes) = job.run(request, &mut took).await;
                *answer_bytes = Some(bytes);
                (result, outcome::FORWARDED, took)
            }
            Claim::Completed(stored, expires_in) => {
                let replay = stored.to_replay();
                // Only a body without a repeated member (or not JSON) enters the cache: a hit
                // skips the repeated-member check (`refuse_ambiguous`).
                if let Some(epoch) = cache_epoch
                    && crate::json::has_duplicate_member(&body) != Some(true)
                {
                    gateway.store.wakeups().cache_fill(
                        epoch,
                        id,
                        fp,
                        stored,
                        claimed_at + expires_in,
                    );
                }
                let name = if waited {
                    outcome::COALESCED
                } else {
                    outcome::REPLAYED
                };
                *answer_bytes = Some(admission.bytes);
                (Ok(replay), name, None)
            }
            Claim::Mismatch => (
                Err(GatewayError::FingerprintMismatch),
                outcome::MISMATCH,
                None,
            ),
            Claim::Held => (
                Err(GatewayError::OutcomeUnknown),
                outcome::OUTCOME_UNKNOWN,
                None,
            ),
            Claim::NotReplayable { .. } => (
                Err(GatewayError::NotReplayable),
                outcome::NOT_REPLAYABLE,
                None,
            ),
            Claim::InFlight { .. } => (
                Err(GatewayError::in_flight()),
                outcome::IN_FLIGHT_REJECTED,
                None,
            ),
        }
    }
}

/// What is refused before a request is routed: a method `routing::check_method` refuses,
/// and an HTTP/1.1 request without `Host` (RFC 9112 section 3.2).
fn check_request_line<B>(req: &Request<B>) -> Result<(), GatewayError> {
    crate::routing::check_method(req.method())?;
    if req.version() == http::Version::HTTP_11 && !req.headers().contains_key(header::HOST) {
        return Err(GatewayError::HostMissing);
    }
    Ok(())
}

/// The key, scope and fingerprint of a keyed request; `None` when it has no key and the
/// route does not require one. Every error is the client's: the request cannot be keyed.
///
/// Reading a body is linear in its size (key.rs), but a large one still takes a while: over
/// `INLINE` bytes it is read on a blocking thread, so that the serving thread goes on with
/// its other connections meanwhile, and the repeated-member check runs there too (`settled`
/// is then true). Running the check before the replay cache is looked up changes no answer:
/// the cache holds no body that fails it (see `refuse_ambiguous`).
async fn key_request(
    routing: &Arc<Routing>,
    route: &Route,
    idem: &Idempotency,
    parts: &http::request::Parts,
    body: &Bytes,
) -> Result<Option<(KeyScope, Fingerprint, bool)>, GatewayError> {
    /// Bodies up to this size are read on the serving thread, where most bodies are: up to
    /// about 0.1 ms for an ordinary one and 0.4 ms for the costliest shape (deep nesting;
    /// `body_1MiB` in benches/micro.rs), against some tens of microseconds for a hand-off.
    const INLINE: usize = 16 * 1024;

    fn key_now(
        route: &Route,
        idem: &Idempotency,
        method: &http::Method,
        uri: &http::Uri,
        headers: &http::HeaderMap,
        body: &Bytes,
        check_now: bool,
    ) -> Result<Option<(KeyScope, Fingerprint, bool)>, GatewayError> {
        let mut json = JsonBody::new(body);
        let Some(keyed) = extract(idem, headers, &mut json)? else {
            return Ok(None);
        };
        // A raw fingerprint pins the body's bytes, so the repeated-member check can wait for
        // a replay cache miss (see `refuse_ambiguous`); a canonical one does not, so it runs
        // here: the parse that the canonical form reads refuses a repeated member.
        let mut settled = json.is_parsed() || idem.fingerprint.json_canonical;
        let json_value = if idem.fingerprint.json_canonical {
            Some(json.get()?)
        } else {
            None
        };
        // The path was normalized before routing (see `route_request`).
        let pq = uri.path_and_query().map(|pq| pq.as_str()).unwrap_or("/");
        let fp = fingerprint(
            &idem.fingerprint,
            method,
            &route.name,
            pq,
            headers,
            body,
            json_value,
        )?;
        if check_now && !settled {
            json.refuse_ambiguous(headers)?;
            settled = true;
        }
        Ok(Some((keyed, fp, settled)))
    }

    // The route and its idempotency are found again in the routing snapshot (by index): a
    // blocking thread needs them owned.
    let index = (body.len() > INLINE)
        .then(|| {
            routing
                .config
                .routes
                .iter()
                .position(|r| std::ptr::eq(r, route))
        })
        .flatten()
        .filter(|_| {
            route
                .idempotency
                .as_ref()
                .is_some_and(|i| std::ptr::eq(i, idem))
        });
    let Some(index) = index else {
        return key_now(
            route,
            idem,
            &parts.method,
            &parts.uri,
            &parts.headers,
            body,
            false,
        );
    };
    let routing = Arc::clone(routing);
    let (method, uri, headers) = (
        parts.method.clone(),
        parts.uri.clone(),
        parts.headers.clone(),
    );
    let body = body.clone();
    let keying = tokio::task::spawn_blocking(move || {
        let route = &routing.config.routes[index];
        let idem = route
            .idempotency
            .as_ref()
            .expect("a keyed route has its idempotency");
        key_now(route, idem, &method, &uri, &headers, &body, true)
    });
    keying.await.unwrap_or_else(|e| {
        tracing::error!(error = %e, "keying a request's body on a blocking thread failed");
        Err(GatewayError::Internal(
            "keying a request's body failed".to_string(),
        ))
    })
}

/// The repeated-member check of a keyed request whose key, scope and fingerprint are known
/// (`settled`: `key_request` checked already, because the body was parsed or the fingerprint
/// is canonical). Run after the replay cache missed: a hit needs no check, because the cache
/// holds only bodies without a repeated member or not JSON at all (`KeyedWork::run`), and a
/// raw fingerprint equal to an entry's means the very same bytes, on which the check cannot
/// fail whatever `Content-Type` says.
fn refuse_ambiguous(
    parts: &http::request::Parts,
    body: &Bytes,
    settled: bool,
) -> Result<(), GatewayError> {
    if settled {
        return Ok(());
    }
    Ok(JsonBody::new(body).refuse_ambiguous(&parts.headers)?)
}

/// On an observe route, a request that enforcing would refuse before any claim (`why`: it
/// cannot be keyed, or its body is over `max_request_body`): forwarded without idempotency
/// and counted under the outcome enforcing would have had (an upstream failure counts as
/// itself).
#[allow(clippy::too_many_arguments)] // one request's parts, named
async fn forward_unkeyed(
    route: &Route,
    upstream: &UpstreamClient,
    parts: http::request::Parts,
    body: Body,
    client: &ClientInfo,
    log: &mut RequestLog,
    admission: Admission,
    why: GatewayError,
) -> Result<Response<Body>, GatewayError> {
    tracing::info!(route = %route.name, would = why.outcome(), reason = %why, "observe: enforcing would refuse this request; forwarded without idempotency");
    let out = upstream.prepare(parts, body, client, None);
    let resp = proxy(upstream, out, log, admission, Some(&client.timer)).await?;
    log.outcome = why.outcome();
    Ok(resp)
}

/// The answer of a keyed request's task; a task that panicked or was cancelled is a bug,
/// never blamed on the store or the upstream.
fn joined(joined: Result<KeyedResult, tokio::task::JoinError>) -> KeyedResult {
    joined.unwrap_or_else(|e| {
        let why = if e.is_panic() {
            "a keyed request's task panicked"
        } else {
            "a keyed request's task was cancelled"
        };
        tracing::error!(error = %e, "{why}");
        (
            Err(GatewayError::Internal(why.to_string())),
            outcome::INTERNAL,
            None,
        )
    })
}

/// `uri` with another path, its query kept.
fn with_path(uri: &http::Uri, path: &str) -> http::Uri {
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = pq.parse().ok().or(parts.path_and_query);
    http::Uri::from_parts(parts).unwrap_or_else(|_| uri.clone())
}

/// A plain forward: the response streams back, bounded by the timeout on its head. The
/// admission is held by the response body until it has been passed on (or dropped).
async fn proxy(
    upstream: &UpstreamClient,
    req: Request<Body>,
    log: &mut RequestLog,
    admission: Admission,
    timer: Option<&crate::timer::Spare>,
) -> Result<Response<Body>, GatewayError> {
    let started = Instant::now();
    let sent = upstream.send_streamed(req, timer).await;
    log.upstream = Some(started.elapsed());
    Ok(passed_on(sent.map_err(GatewayError::from)?, admission, log))
}

/// A plain forward that asked to switch protocols: a 101 from the upstream opens a tunnel
/// that keeps `hold` (the admission and the connection's slot) until it closes; any other
/// answer is passed on as by [`proxy`].
async fn tunnel(
    upstream: &UpstreamClient,
    req: Request<Body>,
    log: &mut RequestLog,
    hold: (Admission, Option<crate::limits::ConnectionSlot>),
    on_client: hyper::upgrade::OnUpgrade,
    route: &str,
) -> Result<Response<Body>, GatewayError> {
    let started = Instant::now();
    let sent = upstream.send(req).await;
    log.upstream = Some(started.elapsed());
    let mut resp = sent.map_err(GatewayError::from)?;
    if resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
        return Ok(passed_on(resp.map(stream), hold.0, log));
    }
    let on_upstream = hyper::upgrade::on(&mut resp);
    let (mut parts, _empty) = resp.into_parts();
    crate::tunnel::switching_headers(&mut parts.headers);
    crate::tunnel::splice(on_client, on_upstream, route.to_string(), hold);
    log.outcome = outcome::TUNNELED;
    Ok(Response::from_parts(parts, full(Bytes::new())))
}

/// An upstream's answer streamed back to the client, its headers cleaned; the admission is
/// held by the response body (`access::Logged`, through `log`) until it has been passed on (or
/// dropped). Trailers pass too.
fn passed_on(resp: Response<Body>, admission: Admission, log: &mut RequestLog) -> Response<Body> {
    let (mut parts, body) = resp.into_parts();
    clean_response_headers(&mut parts.headers);
    log.held = Some(admission);
    Response::from_parts(parts, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicked_task_is_a_500_internal_never_blamed_on_the_store() {
        let handle = tokio::spawn(async {
            if true {
                panic!("a bug");
            }
            (
                Ok(Response::new(full(Bytes::new()))),
                outcome::FORWARDED,
                None,
            )
        });
        let (result, name, _) = joined(handle.await);
        let err = result.expect_err("a panic is an error");
        assert_eq!(name, outcome::INTERNAL);
        let problem = err.problem();
        assert_eq!((problem.status.as_u16(), problem.slug), (500, "internal"));
    }

    #[tokio::test]
    async fn a_cancelled_task_is_a_500_internal_never_blamed_on_the_store() {
        let (_hold, wait) = tokio::sync::oneshot::channel::<()>();
        let handle = tokio::spawn(async move {
            let _ = wait.await;
            (
                Ok(Response::new(full(Bytes::new()))),
                outcome::FORWARDED,
                None,
            )
        });
        handle.abort();
        let joined_result = handle.await;
        assert!(joined_result.as_ref().is_err_and(|e| e.is_cancelled()));
        let (result, name, took) = joined(joined_result);
        let err = result.expect_err("a cancelled task is an error");
        assert_eq!(name, outcome::INTERNAL);
        assert!(took.is_none());
        assert!(err.to_string().contains("cancelled"), "{err}");
        let problem = err.problem();
        assert_eq!((problem.status.as_u16(), problem.slug), (500, "internal"));
    }

    #[test]
    fn another_spelling_of_the_path_keeps_the_query() {
        let uri: http::Uri = "/a//b?x=1&y=%2F".parse().unwrap();
        assert_eq!(with_path(&uri, "/a/b").to_string(), "/a/b?x=1&y=%2F");
        let bare: http::Uri = "/a/./b".parse().unwrap();
        assert_eq!(with_path(&bare, "/a/b").to_string(), "/a/b");
    }
}
