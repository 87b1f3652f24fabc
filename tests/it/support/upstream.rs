//! A fake upstream: a real hyper server on 127.0.0.1:0 that counts executions, records what
//! it received, and can be slowed down or told to answer with a given status, body or
//! extra headers.
//!
//! Default answer: 201 with a JSON body naming the execution number, so two executions can
//! never produce the same bytes, plus a `set-cookie` and an `x-upstream` header (which a
//! replay must not carry) and an `etag` (which it must).
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

/// What the upstream does with the next requests.
#[derive(Clone, Debug)]
pub struct Behavior {
    /// Pause after counting the execution, before answering.
    pub delay: Duration,
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
    let (delay, status, fixed, extra) = {
        let mut b = state.behavior.lock().unwrap();
        let status = if b.script.is_empty() {
            b.status
        } else {
            b.script.remove(0)
        };
        (b.delay, status, b.body.clone(), b.headers.clone())
    };
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
