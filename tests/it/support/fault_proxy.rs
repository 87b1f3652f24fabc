//! A fault-injecting TCP proxy between the gateway and an upstream (netem is not available
//! here). Each accepted connection gets the fault set at accept time:
//!
//! - [`Fault::Pass`]: relay both ways.
//! - [`Fault::Refuse`]: nothing listens on the port (connection refused), see [`FaultProxy::set`].
//! - [`Fault::ResetBeforeResponse`]: read the request, then reset the connection (RST).
//!   The upstream never sees it, but the gateway has sent it: outcome unknown.
//! - [`Fault::CutMidBody`]: relay the request; relay only the first `after` bytes of the
//!   response, then close.
//! - [`Fault::Blackhole`]: read the request and never answer.
//! - [`Fault::SlowBody`]: relay the response `chunk` bytes at a time with `pause` between.
//! - [`Fault::LoseRepliesAfter`]: relay both ways until a client first sends `marker` (once
//!   per proxy, on whichever connection); from then on nothing more reaches that client, and
//!   both sides are closed a moment later (a reply lost after the server acted: a database's
//!   commit that the client never hears of).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Pass,
    Refuse,
    ResetBeforeResponse,
    CutMidBody { after: usize },
    Blackhole,
    SlowBody { chunk: usize, pause: Duration },
    LoseRepliesAfter { marker: &'static [u8] },
}

pub struct FaultProxy {
    pub addr: SocketAddr,
    target: SocketAddr,
    fault: Arc<Mutex<Fault>>,
    accept: Mutex<Option<JoinHandle<()>>>,
    /// Whether a `LoseRepliesAfter` fault has fired (it fires once).
    fired: Arc<std::sync::atomic::AtomicBool>,
    /// Connections accepted so far.
    accepted: Arc<std::sync::atomic::AtomicUsize>,
}

impl FaultProxy {
    pub async fn start(target: SocketAddr, fault: Fault) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let proxy = FaultProxy {
            addr: listener.local_addr().unwrap(),
            target,
            fault: Arc::new(Mutex::new(Fault::Pass)),
            accept: Mutex::new(None),
            fired: Arc::default(),
            accepted: Arc::default(),
        };
        proxy.listen(listener);
        proxy.set(fault).await;
        proxy
    }

    /// A proxy in front of the PostgreSQL server of the database URL `db`, and the URL of
    /// the same database through the proxy.
    pub async fn in_front_of_database(db: &str, fault: Fault) -> (FaultProxy, String) {
        let server: SocketAddr = db
            .split_once('@')
            .and_then(|(_, rest)| rest.split_once('/'))
            .map(|(addr, _)| addr.parse().expect("host:port"))
            .expect("a postgres URL with an address");
        let proxy = FaultProxy::start(server, fault).await;
        let through = db.replace(&server.to_string(), &proxy.addr.to_string());
        (proxy, through)
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Changes the fault for new connections; `Refuse` closes the port, anything else
    /// reopens it.
    pub async fn set(&self, fault: Fault) {
        *self.fault.lock().unwrap() = fault;
        let running = self.accept.lock().unwrap().is_some();
        if fault == Fault::Refuse && running {
            let task = self.accept.lock().unwrap().take();
            if let Some(task) = task {
                task.abort();
                let _ = task.await;
            }
        } else if fault != Fault::Refuse && !running {
            let listener = TcpListener::bind(self.addr)
                .await
                .expect("rebind proxy port");
            self.listen(listener);
        }
    }

    /// How many connections the proxy accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn listen(&self, listener: TcpListener) {
        let (fault, target) = (Arc::clone(&self.fault), self.target);
        let fired = Arc::clone(&self.fired);
        let accepted = Arc::clone(&self.accepted);
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let fault = *fault.lock().unwrap();
                tokio::spawn(handle(client, target, fault, Arc::clone(&fired)));
            }
        });
        *self.accept.lock().unwrap() = Some(task);
    }
}

/// Reads until the end of a request head (and whatever body came with it).
async fn read_request(client: &mut TcpStream) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        match client.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    buf
}

async fn handle(
    mut client: TcpStream,
    target: SocketAddr,
    fault: Fault,
    fired: Arc<std::sync::atomic::AtomicBool>,
) {
    match fault {
        Fault::Refuse => {}
        Fault::ResetBeforeResponse => {
            let _ = read_request(&mut client).await;
            let _ = client.set_zero_linger();
            drop(client); // RST
        }
        Fault::Blackhole => {
            let mut sink = [0u8; 8192];
            while let Ok(n) = client.read(&mut sink).await {
                if n == 0 {
                    break;
                }
            }
        }
        Fault::LoseRepliesAfter { marker } => {
            lose_replies_after(client, target, marker, fired).await
        }
        Fault::Pass | Fault::CutMidBody { .. } | Fault::SlowBody { .. } => {
            let Ok(upstream) = TcpStream::connect(target).await else {
                return;
            };
            let (mut cr, mut cw) = client.into_split();
            let (mut ur, mut uw) = upstream.into_split();
            let up = tokio::spawn(async move {
                let _ = tokio::io::copy(&mut cr, &mut uw).await;
            });
            let mut sent = 0usize;
            let mut buf = [0u8; 8192];
            loop {
                let n = match ur.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                match fault {
                    Fault::CutMidBody { after } => {
                        let take = n.min(after.saturating_sub(sent));
                        if cw.write_all(&buf[..take]).await.is_err() {
                            break;
                        }
                        sent += take;
                        if sent >= after {
                            break;
                        }
                    }
                    Fault::SlowBody { chunk, pause } => {
                        for piece in buf[..n].chunks(chunk.max(1)) {
                            if cw.write_all(piece).await.is_err() {
                                return;
                            }
                            tokio::time::sleep(pause).await;
                        }
                    }
                    _ => {
                        if cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                }
            }
            up.abort();
        }
    }
}

async fn lose_replies_after(
    client: TcpStream,
    target: SocketAddr,
    marker: &'static [u8],
    fired: Arc<std::sync::atomic::AtomicBool>,
) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let Ok(upstream) = TcpStream::connect(target).await else {
        return;
    };
    let (mut cr, mut cw) = client.into_split();
    let (mut ur, mut uw) = upstream.into_split();
    let lost = Arc::new(AtomicBool::new(false));
    let down = {
        let lost = Arc::clone(&lost);
        tokio::spawn(async move {
            let mut buf = [0u8; 8192];
            while let Ok(n) = ur.read(&mut buf).await {
                if n == 0 || lost.load(Ordering::SeqCst) {
                    break;
                }
                if cw.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            // Nothing more for the client; keep the socket open a moment (the server acts
            // meanwhile), then close it.
            tokio::time::sleep(Duration::from_millis(300)).await;
            drop(cw);
        })
    };
    let mut buf = [0u8; 8192];
    while let Ok(n) = cr.read(&mut buf).await {
        if n == 0 {
            break;
        }
        if buf[..n].windows(marker.len()).any(|w| w == marker)
            && !fired.swap(true, Ordering::SeqCst)
        {
            // Set before the bytes reach the server, so its reply is never relayed.
            lost.store(true, Ordering::SeqCst);
        }
        if uw.write_all(&buf[..n]).await.is_err() {
            break;
        }
        if lost.load(Ordering::SeqCst) {
            break;
        }
    }
    let _ = down.await;
}
