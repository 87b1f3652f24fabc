//! HTTP/1.1 to a plain `http://` upstream, each connection driven by the task that uses it.
//!
//! hyper-util's pooled client runs every upstream connection in a task of its own: a request
//! is handed to that task through a channel, and the response head and each body chunk come
//! back through more channels, so one plain forward costs several task wake-ups on top of the
//! I/O. Here the request's own task polls the connection while it waits for the response head,
//! and the response body polls it while the client reads the body, as an nginx worker drives
//! its upstream connection: no hand-off. Measured on the plain hop (BENCHMARKS.md): 5% to
//! 20% less gateway CPU per request, in A/B runs of the gateway alone.
//!
//! Used by plain and keyed forwards (`gateway/plain.rs`, `gateway/record.rs`) to `http://`
//! upstreams without `http2`; upgrades, h2 and TLS upstreams keep the pooled client (`mod.rs`).
//!
//! Invariants:
//! - A connection is idle (in the pool) only between exchanges: after its response body was
//!   read to its end, its request was written to its end, and the connection stayed open. A
//!   body dropped before its end (a client that hung up) drops its connection, and so does an
//!   answer that came before the whole request body was sent (the rest would wait in a
//!   connection nobody polls, and the client's upload with it): it is never reused
//!   mid-message.
//! - An idle connection is polled once when taken: one the upstream closed (or sent anything
//!   unasked on) is dropped, never used.
//! - A request that could not be written on a taken connection (it closed in between) is sent
//!   once on a new connection; a request of which anything was written is never sent again.
//! - The connect is bounded by `connect_timeout`, and the whole exchange up to the response
//!   head, connect included, by the upstream's `timeout`.
//! - At most [`MAX_IDLE`] connections wait in a pool; one idle for the upstream's
//!   `idle_timeout` (default 800 ms, below the keep-alive of common servers) is closed
//!   when found, and a reaper closes them when nobody comes (so sockets the upstream closed
//!   do not linger).
//!
//! The idle connections are kept in `shard::SHARDS` lists (each keeping at most `MAX_IDLE /
//! SHARDS`), each thread giving back to and taking from its own first: a connection mostly stays
//! with the runtime worker that used it last, with its buffers and state in that core's cache, as
//! an nginx worker keeps its own keep-alive pool. On the multi-threaded runtime a thread whose
//! list is empty takes from the others before it connects, so sharding opens no more
//! connections than one list would; a thread with a runtime of its own (thread per core) only
//! takes from its own list, as a socket stays registered with the runtime that opened it.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, Uri, uri};
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{Connection, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::error::UpstreamError;
use crate::config::UpstreamConfig;
use crate::payload::{Body, BoxError, error_chain};
use crate::shard::{Padded, SHARDS};

/// Idle connections kept per upstream.
pub const MAX_IDLE: usize = 512;

/// Boxed: an idle connection moves from the pool to the request's future, its response body
/// and back, and hyper's connection state is large.
type Conn = Box<Connection<TokioIo<TcpStream>, Body>>;

struct Idle {
    tx: SendRequest<Body>,
    conn: Conn,
    since: Instant,
    /// The thread whose runtime the connection's socket belongs to, when that runtime is
    /// the thread's own (`server.runtime: thread_per_core`): only that thread takes it.
    owner: Option<std::thread::ThreadId>,
}

/// The thread a connection given back or taken now belongs to: the current one when it runs
/// a runtime of its own, none on a multi-threaded runtime (whose workers share a reactor).
fn owner() -> Option<std::thread::ThreadId> {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => None,
        _ => Some(std::thread::current().id()),
    }
}

/// One list of idle connections.
type Shard = Padded<Mutex<Vec<Idle>>>;

/// The idle connections to one upstream.
pub struct Pool {
    /// `host:port` to connect to (the upstream's URL, port 80 by default).
    addr: String,
    /// The configured authority and its `Host` value.
    host: Option<(uri::Authority, HeaderValue)>,
    connect_timeout: Duration,
    timeout: Duration,
    /// `upstreams.<name>.idle_timeout`: an idle connection older than this is closed instead
    /// of used, before the upstream's own keep-alive timeout closes it under a request.
    idle_timeout: Duration,
    /// Oldest first in each; taken from the end.
    idle: [Shard; SHARDS],
    /// Whether the reaper task was started (once, by the first connection given back).
    reaper: std::sync::atomic::AtomicBool,
}

impl Pool {
    /// A pool for `cfg`, or `None` when its connections are not plain HTTP/1.1.
    pub fn for_upstream(cfg: &UpstreamConfig) -> Option<Arc<Pool>> {
        if cfg.url.scheme() != Some(&http::uri::Scheme::HTTP) || cfg.http2 {
            return None;
        }
        let host = cfg.url.host()?;
        let port = cfg.url.port_u16().unwrap_or(80);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let addr = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let made = cfg.url.authority().cloned().and_then(|a| {
            let value = host_value(a.host(), a.port_u16())?;
            Some((a, value))
        });
        Some(Arc::new(Pool {
            addr,
            host: made,
            connect_timeout: cfg.connect_timeout,
            timeout: cfg.timeout,
            idle_timeout: cfg.idle_timeout,
            idle: Default::default(),
            reaper: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// The `Host` of a request to this upstream (its URL's authority, without port 80).
    pub fn host_value(&self) -> Option<&HeaderValue> {
        self.host.as_ref().map(|(_, value)| value)
    }

    /// Sends `req` and returns the response; its body drives the connection and gives it back
    /// at its end. An absolute-form request (the client's `Host` kept, `preserve_host`) is put
    /// in origin-form first; one `UpstreamClient::prepare` made for this pool already is.
    /// The exchange is timed by `timer` when given (the client connection's, `timer.rs`).
    pub async fn send(
        self: &Arc<Pool>,
        req: Request<Body>,
        timer: Option<&crate::timer::Spare>,
    ) -> Result<Response<Body>, UpstreamError> {
        let req = if req.uri().scheme().is_some() {
            origin_form(req, self.host.as_ref())
        } else {
            req
        };
        match crate::timer::timeout(timer, self.timeout, self.exchange(req)).await {
            Err(_) => Err(UpstreamError::Timeout),
            Ok(r) => r,
        }
    }

    async fn exchange(
        self: &Arc<Pool>,
        req: Request<Body>,
    ) -> Result<Response<Body>, UpstreamError> {
        let (req, reused) = match self.take_idle().await {
            Some(idle) => match drive(idle.tx, idle.conn, req).await {
                Ok(driven) => return Ok(self.respond(driven)),
                // Not written: the connection closed before it; once more on a new one.
                Err(Unsent(req)) => (*req, true),
                Err(Failed(e)) => return Err(e),
            },
            None => (req, false),
        };
        let (tx, conn) = self.connect().await?;
        match drive(tx, conn, req).await {
            Ok(driven) => Ok(self.respond(driven)),
            Err(Unsent(_)) => Err(UpstreamError::Failed(format!(
                "the upstream closed a new connection before the request was written{}",
                if reused {
                    " (and a reused one before it)"
                } else {
                    ""
                }
            ))),
            Err(Failed(e)) => Err(e),
        }
    }

    async fn connect(&self) -> Result<(SendRequest<Body>, Conn), UpstreamError> {
        let stream = match tokio::time::timeout(
            self.connect_timeout,
            TcpStream::connect(&self.addr),
        )
        .await
        {
            Err(_) => {
                return Err(UpstreamError::Connect(format!(
                    "connect to {} timed out after {:?}",
                    self.addr, self.connect_timeout
                )));
            }
            Ok(Err(e)) => {
                return Err(UpstreamError::Connect(format!(
                    "connect to {}: {e}",
                    self.addr
                )));
            }
            Ok(Ok(s)) => s,
        };
        let _ = stream.set_nodelay(true);
        hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map(|(tx, conn)| (tx, Box::new(conn)))
            .map_err(|e| UpstreamError::Connect(error_chain(&e)))
    }

    /// The most recently used idle connection that is still open and ready: from the
    /// thread's own list, else (on a multi-threaded runtime) from the others in turn.
    async fn take_idle(&self) -> Option<Idle> {
        let own = crate::shard::own();
        // A thread with a runtime of its own (`server.runtime: thread_per_core`) keeps to its
        // own connections: another's socket waits for readiness on another thread's runtime.
        // Its list may hold other threads' too (past `SHARDS` threads lists are shared), so it
        // takes only those it owns, however many threads there are.
        let me = owner();
        let lists = if me.is_some() { 1 } else { SHARDS };
        for i in 0..lists {
            let shard = &self.idle[(own + i) % SHARDS];
            loop {
                let mut idle = {
                    let mut list = shard.0.lock().expect("pool lock");
                    let Some(at) = list.iter().rposition(|idle| idle.owner == me) else {
                        break;
                    };
                    let idle = list.remove(at);
                    if idle.since.elapsed() >= self.idle_timeout {
                        // Those of this owner before it in the list are older still.
                        list.retain(|idle| idle.owner != me);
                        break;
                    }
                    idle
                };
                if std::future::poll_fn(|cx| Poll::Ready(ready(&mut idle, cx))).await {
                    return Some(idle);
                }
            }
        }
        None
    }

    fn respond(self: &Arc<Pool>, driven: Exchange) -> Response<Body> {
        let (parts, body) = driven.resp.into_parts();
        let body = Driven {
            // An empty body (204, 304, HEAD) may never be polled: it has ended already.
            ended: hyper::body::Body::is_end_stream(&body),
            body,
            conn: driven.conn,
            pool: Arc::downgrade(self),
        };
        Response::from_parts(parts, body.boxed_unsync())
    }

    /// Keeps a connection whose exchange is over for the next request. One that is not ready
    /// for it is dropped: hyper asks for the next request (`is_ready`) only once the request
    /// before it was written to its end too, which an upstream that answered early may not
    /// have let it do.
    fn give_back(self: &Arc<Pool>, tx: SendRequest<Body>, conn: Conn) {
        if !tx.is_ready() {
            return;
        }
        {
            let mut list = self.idle[crate::shard::own()].0.lock().expect("pool lock");
            if list.len() >= MAX_IDLE / SHARDS {
                list.remove(0);
            }
            list.push(Idle {
                tx,
                conn,
                since: Instant::now(),
                owner: owner(),
            });
        }
        if !self.reaper.swap(true, std::sync::atomic::Ordering::Relaxed)
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(reap(Arc::downgrade(self)));
        }
    }
}

/// Whether an idle connection can take a request now: polling it lets it notice a close (or
/// bytes nobody asked for, which close it too).
fn ready(idle: &mut Idle, cx: &mut Context<'_>) -> bool {
    if Pin::new(&mut idle.conn).poll(cx).is_ready() {
        return false;
    }
    matches!(idle.tx.poll_ready(cx), Poll::Ready(Ok(())))
}

/// Every half of the idle timeout, closes the idle connections that are too old or that the
/// upstream closed; ends with its pool.
async fn reap(pool: Weak<Pool>) {
    let waker = std::task::Waker::noop();
    loop {
        let Some(every) = pool.upgrade().map(|p| p.idle_timeout / 2) else {
            return;
        };
        tokio::time::sleep(every).await;
        let Some(pool) = pool.upgrade() else {
            return;
        };
        let mut cx = Context::from_waker(waker);
        for shard in &pool.idle {
            shard.0.lock().expect("pool lock").retain_mut(|idle| {
                idle.since.elapsed() < pool.idle_timeout && ready(idle, &mut cx)
            });
        }
    }
}

/// What the legacy client did to an absolute-form request before writing it on HTTP/1.1:
/// origin-form URI, and `Host` from the authority (without the scheme's default port) unless
/// one is set.
/// `upstream` is the configured authority and its `Host`, made once.
fn origin_form(
    mut req: Request<Body>,
    upstream: Option<&(uri::Authority, HeaderValue)>,
) -> Request<Body> {
    let uri = req.uri().clone();
    if let Some(host) = uri.host()
        && !req.headers().contains_key(header::HOST)
    {
        let value = match upstream {
            Some((authority, value)) if uri.authority() == Some(authority) => Some(value.clone()),
            _ => host_value(host, uri.port_u16()),
        };
        if let Some(v) = value {
            req.headers_mut().insert(header::HOST, v);
        }
    }
    let path = match uri.path_and_query() {
        Some(pq) if !pq.as_str().is_empty() => pq.clone(),
        _ => http::uri::PathAndQuery::from_static("/"),
    };
    *req.uri_mut() = Uri::from(path);
    req
}

/// `Host` for an authority: without the scheme's default port.
fn host_value(host: &str, port: Option<u16>) -> Option<HeaderValue> {
    match port {
        Some(port) if port != 80 => HeaderValue::from_str(&format!("{host}:{port}")),
        _ => HeaderValue::from_str(host),
    }
    .ok()
}

struct Exchange {
    resp: Response<Incoming>,
    /// `None` when the connection ended with the response head.
    conn: Option<(SendRequest<Body>, Conn)>,
}

enum DriveError {
    /// Nothing of the request was written; here it is back.
    Unsent(Box<Request<Body>>),
    Failed(UpstreamError),
}
use DriveError::{Failed, Unsent};

/// Writes `req` on the connection and polls it here until the response head arrives.
async fn drive(
    mut tx: SendRequest<Body>,
    conn: Conn,
    req: Request<Body>,
) -> Result<Exchange, DriveError> {
    let mut sent = std::pin::pin!(tx.try_send_request(req));
    let mut conn = Some(conn);
    let result = std::future::poll_fn(|cx| {
        if let Some(c) = conn.as_mut()
            && Pin::new(c).poll(cx).is_ready()
        {
            // Ended: dropping it answers a request it did not finish (with the request
            // itself when none of it was written), instead of leaving it waiting.
            conn = None;
        }
        sent.as_mut().poll(cx)
    })
    .await;
    match result {
        Ok(resp) => Ok(Exchange {
            resp,
            conn: conn.map(|c| (tx, c)),
        }),
        Err(mut e) => match e.take_message() {
            Some(req) => Err(Unsent(Box::new(req))),
            None => Err(Failed(UpstreamError::Failed(error_chain(&e.into_error())))),
        },
    }
}

/// A response body that polls its connection as it is read, and gives the connection back
/// to its pool once read to its end.
struct Driven {
    body: Incoming,
    conn: Option<(SendRequest<Body>, Conn)>,
    ended: bool,
    pool: Weak<Pool>,
}

impl hyper::body::Body for Driven {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some((_, conn)) = this.conn.as_mut()
            && Pin::new(conn).poll(cx).is_ready()
        {
            // Closed (after a close-delimited body, or on an error the body reports).
            this.conn = None;
        }
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.ended = true,
            Poll::Ready(Some(Ok(_))) if this.body.is_end_stream() => this.ended = true,
            Poll::Ready(Some(Err(_))) => this.conn = None,
            _ => {}
        }
        polled.map(|frame| frame.map(|r| r.map_err(|e| Box::new(e) as BoxError)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Driven {
    fn drop(&mut self) {
        if self.ended
            && let Some((tx, conn)) = self.conn.take()
            && let Some(pool) = self.pool.upgrade()
        {
            pool.give_back(tx, conn);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An HTTP/1.1 upstream that answers every request on a connection, keep-alive, with the
    /// client port of that connection.
    fn upstream() -> std::net::SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                loop {
                    let (mut s, peer) = listener.accept().await.unwrap();
                    tokio::spawn(async move {
                        let mut buf = Vec::new();
                        let mut chunk = [0u8; 1024];
                        loop {
                            while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                                match s.read(&mut chunk).await {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                                }
                            }
                            buf.clear();
                            let body = peer.port().to_string();
                            let head = format!(
                                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                                body.len()
                            );
                            if s.write_all(head.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            });
        });
        addr
    }

    async fn port_of_connection(pool: &Arc<Pool>) -> u16 {
        let req = Request::builder()
            .uri("/")
            .header(http::header::HOST, "app")
            .body(crate::forward::full(""))
            .unwrap();
        let resp = pool.send(req, None).await.unwrap();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        std::str::from_utf8(&body).unwrap().parse().unwrap()
    }

    /// Connections are kept per runtime however many threads run one: past `SHARDS`
    /// threads, lists are shared, and a thread must still take only its own connections.
    #[test]
    fn a_thread_with_a_runtime_of_its_own_never_takes_another_threads_connection() {
        let addr = upstream();
        let cfg: UpstreamConfig = crate::config::Config::from_yaml_with_env(
            &format!(
                "store: {{ postgres: {{ url: \"postgres://u@localhost/db\" }} }}\n\
                 upstreams: {{ app: {{ url: \"http://{addr}\", timeout: 5s, idle_timeout: 60s }} }}\n\
                 routes: [ {{ name: r, match: {{ path_prefix: / }}, upstream: app }} ]\n"
            ),
            &|_| None,
        )
        .unwrap()
        .upstreams["app"]
            .clone();
        let pool = Pool::for_upstream(&cfg).unwrap();
        let threads = 3 * SHARDS / 2;
        let given_back = Arc::new(std::sync::Barrier::new(threads));
        let done = Arc::new(std::sync::Barrier::new(threads));
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (pool, given_back, done) = (
                    Arc::clone(&pool),
                    Arc::clone(&given_back),
                    Arc::clone(&done),
                );
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    let first = rt.block_on(port_of_connection(&pool));
                    given_back.wait();
                    // Another runtime's connection may never be driven: bounded.
                    let second = rt.block_on(async {
                        tokio::time::timeout(Duration::from_secs(5), port_of_connection(&pool))
                            .await
                            .ok()
                    });
                    // The runtime (and its connections) lives until every thread is done.
                    done.wait();
                    (first, second)
                })
            })
            .collect();
        let ports: Vec<(u16, Option<u16>)> =
            handles.into_iter().map(|h| h.join().unwrap()).collect();
        for (i, (first, second)) in ports.iter().enumerate() {
            assert_eq!(
                Some(*first),
                *second,
                "thread {i} reused its own connection"
            );
        }
    }
}
