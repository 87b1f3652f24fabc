//! The listener: connection limits, header read timeout, HTTP/1.1 and h2 (h2c in clear, or
//! by ALPN over TLS), the drain that precedes shutdown, graceful shutdown.
//!
//! [`run`] takes the listener and the shutdown future as arguments, so tests bind
//! `127.0.0.1:0` and stop the server at will. Invariants: at most `max_connections`
//! connections are served at once (further ones wait in the kernel's accept backlog); a
//! client that does not finish its request head within `header_read_timeout` is cut off
//! (hyper needs a timer for that, or the timeout is silently off); once the shutdown future
//! resolves no connection is accepted, and open ones get `shutdown_grace` to finish their
//! requests, as do forwards whose client left. What is still in flight when the grace ends is
//! cut: its key keeps its lease and is never marked done.
//!
//! `serve` resolves that future through [`drain_on_signal`]: on SIGTERM/SIGINT `/readyz`
//! fails at once while the listener keeps accepting for `server.drain_delay`
//! (docs/contract.md §8.3).
//!
//! With `server.runtime: thread_per_core` (the default) `App::run` serves the listener on its
//! own runtime and on `worker_threads - 1` [`ServingThread`]s, each a single-threaded runtime
//! accepting from a duplicate of the listening socket: a connection is served start to end by
//! the thread that accepted it. The threads share one count of `max_connections` (the
//! `slots` given to [`run`]), stop accepting together, and each drains its own connections;
//! their runtimes are dropped only once every thread has drained.
//!
//! HTTP/1.1 connections are served with upgrades (`tunnel.rs`). A tunnel keeps its
//! connection's slot of `max_connections` ([`ConnectionSlot`]) for as long as it is open,
//! although hyper hands the connection over when it upgrades. Tunnels are not drained: they
//! run while the process serves and are cut when it exits (a websocket client reconnects).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulConnection;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

use crate::config::ServerConfig;
use crate::forward::ClientInfo;
use crate::gateway::Gateway;
use crate::gateway::connection::Connection;
use crate::limits::{ConnectionSlot, Seat, ThreadLoad};

/// Serves until `shutdown` resolves, then drains for at most `shutdown_grace`. Fails only
/// if the listener's TLS files cannot be loaded. `slots` bounds the connections served at
/// once (`max_connections`); the serving threads of one gateway share it.
pub async fn run(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    cfg: ServerConfig,
    slots: Arc<Semaphore>,
    balanced: Option<Balanced>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), String> {
    let tls = match &cfg.tls {
        None => None,
        Some(files) => Some(tokio_rustls::TlsAcceptor::from(
            gateway.listener_tls(files)?,
        )),
    };
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // hyper's timer for the header read timeout is set per connection, below.
    builder
        .http1()
        .header_read_timeout(cfg.header_read_timeout)
        .max_buf_size(cfg.max_header_bytes);
    // h2 has no header read timeout: idle connections are found by pings instead, and the
    // streams per connection are bounded so one connection cannot hold unbounded requests.
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(cfg.max_header_bytes).unwrap_or(u32::MAX))
        .max_concurrent_streams(cfg.h2_max_concurrent_streams)
        .keep_alive_interval(Some(cfg.header_read_timeout))
        .keep_alive_timeout(cfg.header_read_timeout);
    let graceful = Connections::new();
    tokio::pin!(shutdown);
    let (balance, mut inbox) = match balanced {
        Some(Balanced {
            balance,
            index,
            inbox,
        }) => (Some((balance, index)), Some(inbox)),
        None => (None, None),
    };

    loop {
        let accept = async {
            let permit = Arc::clone(&slots)
                .acquire_owned()
                .await
                .expect("the semaphore is never closed");
            (permit, listener.accept().await)
        };
        let (permit, stream, addr, seat) = tokio::select! {
            Some((permit, stream, addr, seat)) = handed_to(&mut inbox) => {
                (permit, stream, addr, Some(seat))
            }
            (permit, accepted) = accept => match accepted {
                Ok((stream, addr)) => match &balance {
                    None => (permit, stream, addr, None),
                    Some((balance, index)) => match balance.place(*index, permit, stream, addr) {
                        Placed::Here(permit, stream, seat) => (permit, stream, addr, Some(seat)),
                        Placed::Handed => continue,
                    },
                },
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning, and say so once a
                    // second at most (a full descriptor table fails every accept).
                    static SAID: std::sync::Mutex<Option<std::time::Instant>> =
                        std::sync::Mutex::new(None);
                    {
                        let mut said = SAID.lock().expect("accept warning");
                        if said.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
                            tracing::warn!(error = %e, "accept failed; backing off (see the open-file limit)");
                            *said = Some(std::time::Instant::now());
                        }
                    }
                    drop(permit);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let info = ClientInfo::new(addr, tls.is_some());
        let permit = ConnectionSlot::new(permit, seat);
        let connection = Arc::new(Connection::new(
            Arc::clone(&gateway),
            info,
            Some(permit.clone()),
        ));
        let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let connection = Arc::clone(&connection);
            async move { Ok::<_, Infallible>(connection.handle(req).await) }
        });
        // The connection's own timer for its request heads, which reuses one sleep from one
        // head to the next (`timer.rs`).
        let mut builder = builder.clone();
        builder.http1().timer(crate::timer::Spare::default());
        if let Some(acceptor) = &tls {
            // The handshake runs in the connection's task, bounded like a request head.
            let (acceptor, watcher) = (acceptor.clone(), graceful.watcher());
            let limit = cfg.header_read_timeout;
            tokio::spawn(async move {
                match tokio::time::timeout(limit, acceptor.accept(stream)).await {
                    Ok(Ok(tls_stream)) => {
                        let conn =
                            builder.serve_connection_with_upgrades(TokioIo::new(tls_stream), svc);
                        if let Err(e) = watcher.watch(conn.into_owned()).await {
                            tracing::debug!(error = %e, "connection ended with an error");
                        }
                    }
                    Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!("TLS handshake timed out"),
                }
                drop(permit);
            });
            continue;
        }
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
        let conn = graceful.watcher().watch(conn.into_owned());
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }

    drop(listener);
    tracing::info!(grace = ?cfg.shutdown_grace, "stopped accepting; finishing the requests in flight");
    let drain = async {
        graceful.shutdown().await;
        // Jobs whose client left are not tied to a connection: let them record too.
        gateway.jobs().wait_idle().await;
    };
    tokio::select! {
        () = drain => tracing::info!("all connections closed and every forward recorded"),
        () = tokio::time::sleep(cfg.shutdown_grace) => {
            tracing::warn!("shutdown grace ended with requests still in flight; their keys are left to their leases");
        }
    }
    Ok(())
}

/// The open connections, for the graceful shutdown: hyper-util's `GracefulShutdown`, cheaper
/// per request. Its wrapper polls the shutdown signal (a watch channel's `changed`, which
/// takes a lock to store the waker again) every time a connection's task runs. Here the
/// signal is polled when a connection is first polled, to leave its task's waker with it,
/// and then only when a flag says the shutdown has begun or the task's waker changed.
///
/// Invariant: every connection watched gets `graceful_shutdown` once [`Connections::shutdown`]
/// is called, and `shutdown` resolves when every watched connection has ended (each holds a
/// receiver of the channel until it is dropped).
struct Connections {
    tx: watch::Sender<()>,
    begun: Arc<std::sync::atomic::AtomicBool>,
}

/// One connection's share of [`Connections`], taken before its task starts.
struct Watcher {
    rx: watch::Receiver<()>,
    begun: Arc<std::sync::atomic::AtomicBool>,
}

impl Connections {
    fn new() -> Connections {
        Connections {
            tx: watch::channel(()).0,
            begun: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }

    fn watcher(&self) -> Watcher {
        Watcher {
            rx: self.tx.subscribe(),
            begun: Arc::clone(&self.begun),
        }
    }

    /// Asks every connection to finish what it is serving and close, and waits until they
    /// all have.
    async fn shutdown(self) {
        self.begun.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = self.tx.send(());
        self.tx.closed().await;
    }
}

impl Watcher {
    fn watch<C: GracefulConnection>(self, conn: C) -> Watched<C> {
        let Watcher { mut rx, begun } = self;
        Watched {
            conn: Box::pin(conn),
            signal: Some(Box::pin(async move {
                let _ = rx.changed().await;
                rx
            })),
            begun,
            waker: None,
            _shutting_down: None,
        }
    }
}

type Signal = std::pin::Pin<Box<dyn Future<Output = watch::Receiver<()>> + Send>>;

/// A connection that is asked to shut down gracefully when [`Connections::shutdown`] begins.
struct Watched<C> {
    conn: std::pin::Pin<Box<C>>,
    /// Resolves when the shutdown begins; `None` once it has.
    signal: Option<Signal>,
    begun: Arc<std::sync::atomic::AtomicBool>,
    /// The waker the signal holds.
    waker: Option<std::task::Waker>,
    /// The receiver, kept until the connection ends (`Connections::shutdown` waits for it).
    _shutting_down: Option<watch::Receiver<()>>,
}

impl<C: GracefulConnection> Future for Watched<C> {
    type Output = C::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<C::Output> {
        let this = &mut *self;
        if let Some(signal) = this.signal.as_mut() {
            let registered = this.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker()));
            if !registered || this.begun.load(std::sync::atomic::Ordering::SeqCst) {
                this.waker = Some(cx.waker().clone());
                if let std::task::Poll::Ready(rx) = signal.as_mut().poll(cx) {
                    this.signal = None;
                    this._shutting_down = Some(rx);
                    this.conn.as_mut().graceful_shutdown();
                }
            }
        }
        this.conn.as_mut().poll(cx)
    }
}

/// The drain of contract §8.3: resolves when the listener must stop accepting. On SIGTERM or
/// SIGINT the gateway is marked draining at once (`/readyz` answers 503, HTTP/1 answers
/// carry `Connection: close`), and the listener keeps accepting and serving for
/// `drain_delay`, so load balancers stop sending before it closes; a second signal ends the
/// delay early. Then [`run`] stops accepting and drains within `shutdown_grace`.
pub async fn drain_on_signal(mut signals: Signals, gateway: &Gateway, drain_delay: Duration) {
    signals.recv().await;
    gateway.readiness().start_draining();
    if drain_delay.is_zero() {
        return;
    }
    tracing::info!(drain_delay = ?drain_delay, "draining: /readyz answers 503; still accepting and serving until the delay ends");
    tokio::select! {
        () = tokio::time::sleep(drain_delay) => {}
        () = signals.recv() => tracing::info!("second signal: ending the drain delay now"),
    }
}

/// SIGTERM and SIGINT, received from the moment they are installed: `serve` installs them
/// just before it binds, so a signal that comes once the ports accept drains instead of
/// killing the process, and one stream per signal serves both the first and a second signal.
pub struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers; must be called inside a Tokio runtime.
    pub fn install() -> Signals {
        use tokio::signal::unix::{SignalKind, signal};
        Signals {
            term: signal(SignalKind::terminate()).expect("installing a SIGTERM handler"),
            int: signal(SignalKind::interrupt()).expect("installing a SIGINT handler"),
        }
    }

    /// Resolves on the next SIGTERM or SIGINT.
    async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => tracing::info!("SIGTERM received"),
            _ = self.int.recv() => tracing::info!("SIGINT received"),
        }
    }
}

/// The serving threads' count of the connections each serves, and a way to hand one a
/// connection: as envoy's exact connection balance, a thread that accepts a connection while
/// another serves fewer hands it to the one serving the fewest. Whichever thread the
/// kernel wakes for a burst of connections accepts them all, so without this one thread can
/// end up serving every kept-alive connection of a client's pool while the others idle.
pub struct Balance {
    load: Arc<ThreadLoad>,
    inboxes: Box<[tokio::sync::mpsc::UnboundedSender<Handed>]>,
}

/// A connection on its way to the thread that will serve it, with its slot and its seat
/// there.
struct Handed {
    permit: tokio::sync::OwnedSemaphorePermit,
    seat: Seat,
    stream: std::net::TcpStream,
    addr: std::net::SocketAddr,
}

/// One serving thread's place in a [`Balance`].
pub struct Balanced {
    balance: Arc<Balance>,
    index: usize,
    inbox: tokio::sync::mpsc::UnboundedReceiver<Handed>,
}

enum Placed {
    Here(
        tokio::sync::OwnedSemaphorePermit,
        tokio::net::TcpStream,
        Seat,
    ),
    Handed,
}

impl Balance {
    /// A balance of `threads` threads: each one's place in it.
    pub fn places(threads: usize) -> Vec<Balanced> {
        let (inboxes, receivers): (Vec<_>, Vec<_>) = (0..threads)
            .map(|_| tokio::sync::mpsc::unbounded_channel())
            .unzip();
        let balance = Arc::new(Balance {
            load: Arc::new(ThreadLoad::new(threads)),
            inboxes: inboxes.into_boxed_slice(),
        });
        receivers
            .into_iter()
            .enumerate()
            .map(|(index, inbox)| Balanced {
                balance: Arc::clone(&balance),
                index,
                inbox,
            })
            .collect()
    }

    /// Serves a connection thread `index` accepted there, or hands it to the thread serving
    /// the fewest when that is fewer than `index`.
    fn place(
        &self,
        index: usize,
        permit: tokio::sync::OwnedSemaphorePermit,
        stream: tokio::net::TcpStream,
        addr: std::net::SocketAddr,
    ) -> Placed {
        let (fewest, least) = self.load.fewest();
        if least >= self.load.of(index) {
            return Placed::Here(permit, stream, self.load.seat(index));
        }
        match stream.into_std() {
            Ok(stream) => {
                let handed = Handed {
                    permit,
                    seat: self.load.seat(fewest),
                    stream,
                    addr,
                };
                // A thread that has stopped serving has dropped its inbox: the connection
                // closes, as one still in the backlog would at shutdown.
                let _ = self.inboxes[fewest].send(handed);
            }
            Err(e) => {
                tracing::debug!(error = %e, "a connection to hand over could not be detached")
            }
        }
        Placed::Handed
    }
}

/// The next connection another thread handed to this one; pending without a balance.
async fn handed_to(
    inbox: &mut Option<tokio::sync::mpsc::UnboundedReceiver<Handed>>,
) -> Option<(
    tokio::sync::OwnedSemaphorePermit,
    tokio::net::TcpStream,
    std::net::SocketAddr,
    Seat,
)> {
    let Some(inbox) = inbox.as_mut() else {
        return std::future::pending().await;
    };
    let handed = inbox.recv().await?;
    match tokio::net::TcpStream::from_std(handed.stream) {
        Ok(stream) => Some((handed.permit, stream, handed.addr, handed.seat)),
        Err(e) => {
            tracing::debug!(error = %e, "a handed connection could not be registered");
            None
        }
    }
}

/// One more thread serving the listener, on a single-threaded runtime of its own
/// (`server.runtime: thread_per_core`). It accepts from a duplicate of the listening socket:
/// the kernel hands each new connection to one of the threads waiting on it, and the thread
/// that accepts a connection serves it to the end.
///
/// Invariant: its runtime lives until [`ServingThread::finish`], after every thread has
/// drained, so the forwards it started and the store connections it opened outlast the
/// drain of the threads that may still use them.
pub struct ServingThread {
    served: tokio::sync::oneshot::Receiver<Result<(), String>>,
    release: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl ServingThread {
    /// Starts serving `listener` (a duplicate of the main one) until `stop` turns true,
    /// with the same connection slots as the other threads and its `place` in their balance.
    pub fn start(
        index: usize,
        listener: std::net::TcpListener,
        gateway: Arc<Gateway>,
        cfg: ServerConfig,
        slots: Arc<Semaphore>,
        place: Balanced,
        mut stop: watch::Receiver<bool>,
    ) -> std::io::Result<ServingThread> {
        let runtime = runtime(Some(&cfg))?;
        let (served_tx, served) = tokio::sync::oneshot::channel();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("idemgate-srv-{index}"))
            .spawn(move || {
                runtime.block_on(async move {
                    let result = match TcpListener::from_std(listener) {
                        Ok(listener) => {
                            let stopped = async move {
                                let _ = stop.wait_for(|s| *s).await;
                            };
                            run(listener, gateway, cfg, slots, Some(place), stopped).await
                        }
                        Err(e) => Err(format!("serving thread {index}: {e}")),
                    };
                    let _ = served_tx.send(result);
                    let _ = released.await;
                });
                // Nothing of it is in use any more; a DNS lookup still running must not
                // hold the process.
                runtime.shutdown_timeout(Duration::from_secs(1));
            })?;
        Ok(ServingThread {
            served,
            release,
            thread,
        })
    }

    /// Resolves when this thread has stopped accepting and drained (as [`run`] does).
    pub async fn served(&mut self) -> Result<(), String> {
        (&mut self.served)
            .await
            .unwrap_or_else(|_| Err("a serving thread ended without a result".into()))
    }

    /// Lets the thread end and drop its runtime, and waits until it has.
    pub async fn finish(self) {
        let ServingThread {
            release, thread, ..
        } = self;
        drop(release);
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    }
}

/// The runtime `serve` runs on, built in one place: with `runtime: thread_per_core` (the
/// default), a current-thread runtime per serving thread (this one is the first serving
/// thread's); with `multi_thread`, one runtime of `worker_threads` workers. Without a
/// configuration (the other commands), a multi-thread runtime.
pub fn runtime(server: Option<&ServerConfig>) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = match server {
        Some(s) if s.runtime == crate::config::RuntimeLayout::ThreadPerCore => {
            tokio::runtime::Builder::new_current_thread()
        }
        Some(s) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(s.worker_threads);
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    builder.enable_all().build()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected socket on the loopback, as the listener would accept it.
    async fn accepted(listener: &TcpListener) -> (tokio::net::TcpStream, std::net::SocketAddr) {
        let addr = listener.local_addr().unwrap();
        let (_client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        accepted.unwrap()
    }

    #[tokio::test]
    async fn a_burst_accepted_by_one_thread_is_spread_evenly() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let slots = Arc::new(Semaphore::new(100));
        let mut places = Balance::places(3).into_iter();
        let first = places.next().unwrap();
        let mut inboxes: Vec<_> = places.map(|p| Some(p.inbox)).collect();
        let mut here = Vec::new();
        for _ in 0..9 {
            let permit = Arc::clone(&slots).acquire_owned().await.unwrap();
            let (stream, addr) = accepted(&listener).await;
            match first.balance.place(0, permit, stream, addr) {
                Placed::Here(_, _, seat) => here.push(seat),
                Placed::Handed => {}
            }
        }
        // Nine connections accepted by thread 0: three each, six of them handed over.
        assert_eq!(here.len(), 3);
        let mut handed = Vec::new();
        for inbox in &mut inboxes {
            for _ in 0..3 {
                let got = tokio::time::timeout(Duration::from_secs(5), handed_to(inbox)).await;
                handed.push(got.expect("a handed connection").expect("registered"));
            }
        }
        let load = &first.balance.load;
        let counts = || (0..3).map(|i| load.of(i)).collect::<Vec<_>>();
        assert_eq!(counts(), [3, 3, 3]);
        // Connections that end give their seats back: thread 0 now serves the fewest, and
        // keeps the next one it accepts.
        here.clear();
        assert_eq!(counts(), [0, 3, 3]);
        let permit = Arc::clone(&slots).acquire_owned().await.unwrap();
        let (stream, addr) = accepted(&listener).await;
        assert!(matches!(
            first.balance.place(0, permit, stream, addr),
            Placed::Here(..)
        ));
        drop(handed);
        assert_eq!(counts(), [0, 0, 0]);
        assert_eq!(slots.available_permits(), 100, "every slot given back");
    }
}
