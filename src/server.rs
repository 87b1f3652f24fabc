//! The listener: connection limits, header read timeout, HTTP/1.1 and h2 (h2c in clear, or
//! by ALPN over TLS), graceful shutdown.
//!
//! [`run`] takes the listener and the shutdown future as arguments, so tests bind
//! `127.0.0.1:0` and stop the server at will. Invariants: at most `max_connections`
//! connections are served at once (further ones wait in the kernel's accept backlog); a
//! client that does not finish its request head within `header_read_timeout` is cut off
//! (hyper needs a timer for that, or the timeout is silently off); after shutdown starts no
//! connection is accepted, and open ones get `shutdown_grace` to finish their requests, as do
//! forwards whose client left. What is still in flight when the grace ends is cut: its key
//! keeps its lease and is never marked done.
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
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::ServerConfig;
use crate::forward::ClientInfo;
use crate::gateway::Gateway;

/// Concurrent requests on one h2 connection.
const H2_MAX_STREAMS: u32 = 100;

/// A connection's slot of `max_connections`, shared by the connection and its requests (in
/// their extensions): freed when the last holder is gone. Only a tunnel keeps its request's
/// copy past the response (`Gateway::route_request` drops it for everything else).
#[derive(Clone)]
pub struct ConnectionSlot {
    _permit: Arc<OwnedSemaphorePermit>,
}

/// Serves until `shutdown` resolves, then drains for at most `shutdown_grace`. Fails only
/// if the listener's TLS files cannot be loaded.
pub async fn run(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    cfg: ServerConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), String> {
    let tls = match &cfg.tls {
        None => None,
        Some(files) => Some(tokio_rustls::TlsAcceptor::from(crate::tls::server_config(
            &files.cert,
            &files.key,
        )?)),
    };
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_read_timeout)
        .max_buf_size(cfg.max_header_bytes);
    // h2 has no header read timeout: idle connections are found by pings instead, and the
    // streams per connection are bounded so one connection cannot hold unbounded requests.
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(cfg.max_header_bytes).unwrap_or(u32::MAX))
        .max_concurrent_streams(H2_MAX_STREAMS)
        .keep_alive_interval(Some(cfg.header_read_timeout))
        .keep_alive_timeout(cfg.header_read_timeout);
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(cfg.max_connections));
    tokio::pin!(shutdown);

    loop {
        let permit = tokio::select! {
            p = Arc::clone(&slots).acquire_owned() => p.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (stream, addr) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let info = ClientInfo::new(addr, tls.is_some());
        let gw = Arc::clone(&gateway);
        let permit = ConnectionSlot {
            _permit: Arc::new(permit),
        };
        let slot = permit.clone();
        let svc = service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            let (gw, info) = (Arc::clone(&gw), info.clone());
            req.extensions_mut().insert(slot.clone());
            async move { Ok::<_, Infallible>(gw.handle(req, info).await) }
        });
        if let Some(acceptor) = &tls {
            // The handshake runs in the connection's task, bounded like a request head.
            let (acceptor, builder, watcher) =
                (acceptor.clone(), builder.clone(), graceful.watcher());
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
        let conn = graceful.watch(conn.into_owned());
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }

    drop(listener);
    tracing::info!(grace = ?cfg.shutdown_grace, "shutting down: draining connections");
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

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing a SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}
