//! The floor under any hyper-based HTTP/1.1 proxy: what a plain hop costs with nothing but
//! hyper on both sides (BENCHMARKS.md, decisions).
//!
//!     cargo build --release --example hyper_floor
//!     target/release/examples/hyper_floor LISTEN UPSTREAM [one-task|two-tasks]
//!
//! Each client connection gets one upstream connection of its own, opened when the client
//! connects and never shared, so there is no pool and no lookup. A request is sent on with
//! the three `X-Forwarded-*` headers the shared perf harness's nginx proxy sets, in
//! origin-form, its `Host` kept; the answer comes back as it is. No routing, no admission,
//! no access line, no metrics, no timeouts, no hop-by-hop stripping: it is a measuring
//! stick, not a proxy to put anywhere.
//!
//! - `one-task` (default): the client connection and its upstream connection are polled by
//!   one task, as an nginx worker drives both sides (and as `forward/h1.rs` does).
//! - `two-tasks`: the upstream connection runs in a task of its own, as hyper's client
//!   examples do; requests and answers cross between the tasks through hyper's channels.
//!
//! The runtime is tokio's multi-threaded one with a worker per core, as `idemgate serve`'s
//! default.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use http::header::{HOST, HeaderName, HeaderValue};
use hyper::body::Incoming;
use hyper::client::conn::http1 as client;
use hyper::server::conn::http1 as server;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let usage = "usage: hyper_floor LISTEN UPSTREAM [one-task|two-tasks]";
    let mut args = std::env::args().skip(1);
    let listen: SocketAddr = args.next().ok_or(usage)?.parse()?;
    let upstream: SocketAddr = args.next().ok_or(usage)?.parse()?;
    let one_task = match args.next().as_deref() {
        None | Some("one-task") => true,
        Some("two-tasks") => false,
        Some(_) => return Err(usage.into()),
    };
    let listener = TcpListener::bind(listen).await?;
    loop {
        let (stream, peer) = listener.accept().await?;
        tokio::spawn(async move {
            if let Err(e) = connection(stream, peer, upstream, one_task).await {
                eprintln!("hyper_floor: {peer}: {e}");
            }
        });
    }
}

/// Serves one client connection over one upstream connection of its own.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    upstream: SocketAddr,
    one_task: bool,
) -> Result<(), Error> {
    stream.set_nodelay(true)?;
    let up = TcpStream::connect(upstream).await?;
    up.set_nodelay(true)?;
    let (sender, conn) = client::handshake::<_, Incoming>(TokioIo::new(up)).await?;
    // hyper serves one request of a connection at a time: the lock is never contended.
    let sender = Arc::new(Mutex::new(sender));
    let forwarded_for = HeaderValue::from_str(&peer.ip().to_string())?;
    let service = service_fn(move |req: Request<Incoming>| {
        let (mut parts, body) = req.into_parts();
        if let Some(path) = parts.uri.path_and_query() {
            parts.uri = path.as_str().parse().expect("a path and query is a URI");
        }
        let host = parts.headers.get(HOST).cloned();
        parts.headers.insert(X_FORWARDED_FOR, forwarded_for.clone());
        parts
            .headers
            .insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
        if let Some(host) = host {
            parts.headers.insert(X_FORWARDED_HOST, host);
        }
        let sent = sender
            .lock()
            .expect("never poisoned: nothing panics under it")
            .send_request(Request::from_parts(parts, body));
        async move { sent.await.map(|resp: Response<Incoming>| resp) }
    });
    let served = server::Builder::new().serve_connection(TokioIo::new(stream), service);
    if one_task {
        // Both connections polled by this task; the client's end ends the upstream's.
        tokio::select! {
            r = served => r?,
            r = conn => r?,
        }
    } else {
        tokio::spawn(conn);
        served.await?;
    }
    Ok(())
}
