//! A fake upstream: a real hyper server on 127.0.0.1:0 that counts executions, records what
//! it received, and can be slowed down or told to answer with a given status, body or
//! extra headers.
//!
//! Default answer: 201 with a JSON body naming the execution number, so two executions can
//! never produce the same bytes, plus a `set-cookie` and an `x-upstream` header (which a
//! replay must not carry) and an `etag` (which it must).
//!
//! A [`Gate`] holds executions where the test wants them: each one is counted (and seen) at
//! once, then waits at the gate until the test lets it through, so "the request is now in
//! flight" is a fact the test waits for, never a delay it hopes is long enough.
//!
//! It also counts concurrency: the most executions in progress at once, overall and while
//! an execution of a given path was among them ([`Upstream::max_concurrency_beside`]).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

/// Holds executions until the test lets them through. Closed when made: every execution that
/// reaches it (counted, its request seen) waits there until [`release`](Gate::release) lets
/// some through or [`open`](Gate::open) lets every one through, now and from then on. Clones
/// share one gate.
#[derive(Clone)]
pub struct Gate(Arc<GateState>);

struct GateState {
    /// One permit per execution let through; closed once the gate is open for good.
    permits: Semaphore,
    /// How many executions reached the gate (including those already let through).
    arrived: watch::Sender<usize>,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("arrived", &self.arrived())
            .field("open", &self.0.permits.is_closed())
            .finish()
    }
}

impl Default for Gate {
    fn default() -> Self {
        Gate::new()
    }
}

impl Gate {
    /// A closed gate.
    pub fn new() -> Gate {
        Gate(Arc::new(GateState {
            permits: Semaphore::new(0),
            arrived: watch::Sender::new(0),
        }))
    }

    /// Lets `n` more executions through (those waiting first, in arrival order).
    pub fn release(&self, n: usize) {
        self.0.permits.add_permits(n);
    }

    /// Lets every execution through, the waiting ones and all that come later.
    pub fn open(&self) {
        self.0.permits.close();
    }

    /// How many executions reached the gate so far.
    pub fn arrived(&self) -> usize {
        *self.0.arrived.borrow()
    }

    /// Waits until `n` executions reached the gate (10 s at most, then the test fails).
    pub async fn wait_arrived(&self, n: usize) {
        self.wait_arrived_within(n, Duration::from_secs(10)).await;
    }

    /// As [`wait_arrived`](Self::wait_arrived), with a deadline of `limit`.
    pub async fn wait_arrived_within(&self, n: usize, limit: Duration) {
        let mut arrived = self.0.arrived.subscribe();
        let reached = tokio::time::timeout(limit, arrived.wait_for(|a| *a >= n)).await;
        if reached.is_err() {
            panic!(
                "timed out after {limit:?} waiting until {n} executions reached the upstream's \
                 gate ({} did)",
                self.arrived()
            );
        }
    }

    /// Counts an execution's arrival, then waits until it is let through.
    async fn pass(&self) {
        self.0.arrived.send_modify(|a| *a += 1);
        // An error: the gate is open for good.
        if let Ok(permit) = self.0.permits.acquire().await {
            permit.forget();
        }
    }
}

/// What the upstream does with the next requests.
#[derive(Clone, Debug)]
pub struct Behavior {
    /// Pause after counting the execution (and after the gate, if any), before answering.
    /// For an upstream that is slow on purpose; to hold a request in flight, use `gate`.
    pub delay: Duration,
    /// Holds each execution, once counted, until the test lets it through.
    pub gate: Option<Gate>,
    pub status: u16,
    /// A fixed body; `None` for the default JSON naming the execution.
    pub body: Option<Bytes>,
    /// Statuses for the next executions, consumed one by one before `status` applies.
    pub script: Vec<u16>,
    /// More headers on every answer, after the default ones (a name may repeat).
    pub headers: HeaderMap,
}

impl Default for Behavior {
    fn default() -> Self {
        Behavior {
            delay: Duration::ZERO,
            gate: None,
            status: 201,
            body: None,
            script: Vec::new(),
            headers: HeaderMap::new(),
        }
    }
}

/// One request as the upstream saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    /// The execution number its answer names.
    pub execution: usize,
    pub method: String,
    pub uri: String,
    /// The HTTP version the request arrived in.
    pub version: http::Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

#[derive(Default)]
struct State {
    executions: AtomicUsize,
    /// Executions that finished sending their answer.
    answered: AtomicUsize,
    /// Executions in progress now, and the most there ever were at once.
    in_progress: AtomicUsize,
    max_in_progress: AtomicUsize,
    by_path: Mutex<ByPath>,
    behavior: Mutex<Behavior>,
    seen: Mutex<Vec<Seen>>,
}

/// Executions in progress per path, and per path the most executions (of any path) that
/// were in progress at once while one of that path was.
#[derive(Default)]
struct ByPath {
    in_progress: HashMap<String, usize>,
    max_beside: HashMap<String, usize>,
}

impl ByPath {
    fn enter(&mut self, path: &str) {
        *self.in_progress.entry(path.to_string()).or_default() += 1;
        let total: usize = self.in_progress.values().sum();
        for (p, n) in &self.in_progress {
            if *n > 0 {
                let m = self.max_beside.entry(p.clone()).or_default();
                *m = (*m).max(total);
            }
        }
    }

    fn leave(&mut self, path: &str) {
        if let Some(n) = self.in_progress.get_mut(path) {
            *n -= 1;
        }
    }
}

pub struct Upstream {
    pub addr: SocketAddr,
    state: Arc<State>,
    _task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    pub async fn start() -> Upstream {
        Upstream::start_with(Behavior::default()).await
    }

    /// An upstream whose executions wait at a closed gate (see [`Gate`]), and the gate.
    pub async fn start_gated() -> (Upstream, Gate) {
        let gate = Gate::new();
        let up = Upstream::start_with(Behavior {
            gate: Some(gate.clone()),
            ..Default::default()
        })
        .await;
        (up, gate)
    }

    pub async fn start_with(behavior: Behavior) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        Upstream::serve(listener, behavior)
    }

    /// Serves on a given listener (to restart an upstream on the same port).
    pub fn serve(listener: TcpListener, behavior: Behavior) -> Upstream {
        Upstream::serve_with(listener, behavior, None)
    }

    /// An upstream that speaks HTTPS with this certificate.
    pub async fn start_tls(tls: std::sync::Arc<rustls::ServerConfig>) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        Upstream::serve_with(
            listener,
            Behavior::default(),
            Some(tokio_rustls::TlsAcceptor::from(tls)),
        )
    }

    fn serve_with(
        listener: TcpListener,
        behavior: Behavior,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> Upstream {
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(State {
            behavior: Mutex::new(behavior),
            ..Default::default()
        });
        let st = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let st = Arc::clone(&st);
                let tls = tls.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let st = Arc::clone(&st);
                        async move { Ok::<_, Infallible>(answer(&st, req).await) }
                    });
                    let builder =
                        hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    match tls {
                        None => {
                            let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                        }
                        Some(tls) => {
                            if let Ok(stream) = tls.accept(stream).await {
                                let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                            }
                        }
                    }
                });
            }
        });
        Upstream {
            addr,
            state,
            _task: task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many requests reached the upstream.
    pub fn executions(&self) -> usize {
        self.state.executions.load(Ordering::SeqCst)
    }

    /// How many executions finished their answer.
    pub fn answered(&self) -> usize {
        self.state.answered.load(Ordering::SeqCst)
    }

    /// The most executions that were ever in progress at once.
    pub fn max_concurrency(&self) -> usize {
        self.state.max_in_progress.load(Ordering::SeqCst)
    }

    /// The most executions (of any path) that were in progress at once while an execution
    /// of `path` was one of them (0: `path` was never executed).
    pub fn max_concurrency_beside(&self, path: &str) -> usize {
        let by_path = self.state.by_path.lock().unwrap();
        by_path.max_beside.get(path).copied().unwrap_or(0)
    }

    pub fn set(&self, behavior: Behavior) {
        *self.state.behavior.lock().unwrap() = behavior;
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }
}

async fn answer(state: &State, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let n = state.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let now = state.in_progress.fetch_add(1, Ordering::SeqCst) + 1;
    state.max_in_progress.fetch_max(now, Ordering::SeqCst);
    state.by_path.lock().unwrap().enter(parts.uri.path());
    state.seen.lock().unwrap().push(Seen {
        execution: n,
        method: parts.method.to_string(),
        uri: parts.uri.to_string(),
        version: parts.version,
        headers: parts.headers.clone(),
        body: body.clone(),
    });
    let (delay, gate, status, fixed, extra) = {
        let mut b = state.behavior.lock().unwrap();
        let status = if b.script.is_empty() {
            b.status
        } else {
            b.script.remove(0)
        };
        (
            b.delay,
            b.gate.clone(),
            status,
            b.body.clone(),
            b.headers.clone(),
        )
    };
    if let Some(gate) = gate {
        gate.pass().await;
    }
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let body = fixed.unwrap_or_else(|| {
        Bytes::from(format!(
            "{{\"execution\":{n},\"method\":\"{}\",\"path\":\"{}\",\"received_bytes\":{}}}",
            parts.method,
            parts.uri.path(),
            body.len()
        ))
    });
    state.by_path.lock().unwrap().leave(parts.uri.path());
    state.in_progress.fetch_sub(1, Ordering::SeqCst);
    state.answered.fetch_add(1, Ordering::SeqCst);
    let mut response = Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("etag", format!("\"e{n}\""))
        .header("set-cookie", "session=secret")
        .header("x-upstream", "1")
        // Headers only the gateway may say (docs/contract.md §8.1): a first answer that
        // still carries them would look like a replay to the client; every test sees them
        // stripped.
        .header("idempotent-replayed", "true")
        .header("idempotency-status", "from-the-upstream")
        .body(Full::new(body))
        .expect("valid response");
    for (name, value) in &extra {
        response.headers_mut().append(name, value.clone());
    }
    response
}
