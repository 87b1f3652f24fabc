//! Cancel requests that a pooler forwards: the statement bound behind PgBouncer in
//! transaction mode (`store.postgres.pooler: transaction`).
//!
//! A cancel request is a connection of its own that sends the session's key and nothing else.
//! PostgreSQL acts on it as soon as it is read; PgBouncer (1.18) first opens a connection to
//! the server to forward it, and drops it if its client hangs up before that. libpq waits for
//! the other side to close the cancel connection; tokio-postgres's own cancel shuts its side
//! down at once, so through PgBouncer it cancels nothing, and when the cancelled client hangs
//! up too while the request is pending, PgBouncer 1.18 dies (seen in this project's tests).
//! Here the cancel connection is kept open after the request is written (its shutdown does
//! nothing) until the other side closes it, or [`LINGER`] passes, in a task of its own; the
//! caller gets a [`Forwarded`] signal for that moment, and keeps the cancelled session open
//! until then.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio_postgres::config::Host;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, NoTls, TlsConnect, TlsStream};
use tokio_postgres::{CancelToken, Config};
use tokio_postgres_rustls::MakeRustlsConnect;

/// How long a cancel connection is kept open, at most, for the other side to act on it.
pub const LINGER: Duration = Duration::from_secs(5);

/// Resolves once the other side closed the cancel connection (it acted on the request), or
/// [`LINGER`] passed.
pub type Forwarded = oneshot::Receiver<()>;

/// Sends a cancel request for the statement running on `token`'s session, to the first host
/// of `config` that accepts a connection, and returns once it is written.
pub async fn cancel(
    token: &CancelToken,
    config: &Config,
    tls: Option<&MakeRustlsConnect>,
    connect_timeout: Duration,
) -> Result<Forwarded, String> {
    let mut last = String::from("no host to send a cancel request to");
    for (i, host) in config.get_hosts().iter().enumerate() {
        let port = config
            .get_ports()
            .get(i)
            .or(config.get_ports().first())
            .copied()
            .unwrap_or(5432);
        let sent = match host {
            Host::Tcp(name) => {
                let connect = TcpStream::connect((name.as_str(), port));
                let socket = match tokio::time::timeout(connect_timeout, connect).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        last = e.to_string();
                        continue;
                    }
                    Err(_) => {
                        last = "timed out connecting".into();
                        continue;
                    }
                };
                let _ = socket.set_nodelay(true);
                send(token, socket, name, tls).await
            }
            #[cfg(unix)]
            Host::Unix(dir) => {
                let path = dir.join(format!(".s.PGSQL.{port}"));
                let socket = match tokio::net::UnixStream::connect(path).await {
                    Ok(s) => s,
                    Err(e) => {
                        last = e.to_string();
                        continue;
                    }
                };
                send(token, socket, "", tls).await
            }
        };
        match sent {
            Ok(forwarded) => return Ok(forwarded),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Writes the request on `socket` (through TLS when configured); the outermost stream
/// lingers and signals.
async fn send<S>(
    token: &CancelToken,
    socket: S,
    host: &str,
    tls: Option<&MakeRustlsConnect>,
) -> Result<Forwarded, String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = oneshot::channel();
    match tls {
        None => {
            token
                .cancel_query_raw(Linger::new(socket, Some(tx)), NoTls)
                .await
        }
        Some(tls) => {
            let Ok(connect) = <MakeRustlsConnect as MakeTlsConnect<Linger<S>>>::make_tls_connect(
                &mut tls.clone(),
                host,
            );
            token
                .cancel_query_raw(Linger::new(socket, None), Lingering(connect, tx))
                .await
        }
    }
    .map_err(|e| e.to_string())?;
    Ok(rx)
}

/// A stream whose shutdown does nothing and which, when dropped, is read until the other
/// side closes it (or [`LINGER`] passes) in a task of its own, which then signals.
struct Linger<S: AsyncRead + Unpin + Send + 'static> {
    inner: Option<S>,
    done: Option<oneshot::Sender<()>>,
}

impl<S: AsyncRead + Unpin + Send + 'static> Linger<S> {
    fn new(inner: S, done: Option<oneshot::Sender<()>>) -> Self {
        Linger {
            inner: Some(inner),
            done,
        }
    }

    fn inner(&mut self) -> &mut S {
        self.inner
            .as_mut()
            .expect("a lingering stream is used only until dropped")
    }
}

impl<S: AsyncRead + Unpin + Send + 'static> Drop for Linger<S> {
    fn drop(&mut self) {
        let (Some(mut inner), Ok(rt)) = (self.inner.take(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let done = self.done.take();
        rt.spawn(async move {
            let mut buf = [0u8; 64];
            let _ = tokio::time::timeout(LINGER, async {
                while matches!(inner.read(&mut buf).await, Ok(n) if n > 0) {}
            })
            .await;
            drop(inner);
            if let Some(done) = done {
                let _ = done.send(());
            }
        });
    }
}

impl<S: AsyncRead + Unpin + Send + 'static> AsyncRead for Linger<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(self.inner()).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> AsyncWrite for Linger<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(self.inner()).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(self.inner()).poll_flush(cx)
    }

    /// Nothing: a pooler takes a half-closed cancel connection for a client that gave up.
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl<S> TlsStream for Linger<S>
where
    S: TlsStream + Unpin + Send + 'static,
{
    fn channel_binding(&self) -> ChannelBinding {
        self.inner
            .as_ref()
            .map_or_else(ChannelBinding::none, TlsStream::channel_binding)
    }
}

/// A TLS connector whose stream lingers like [`Linger`] and signals on `.1`: closing a TLS
/// stream sends `close_notify`, which a pooler takes as the client hanging up, so it must not
/// be sent before the other side acted.
struct Lingering<T>(T, oneshot::Sender<()>);

impl<S, T> TlsConnect<S> for Lingering<T>
where
    T: TlsConnect<S> + Send + 'static,
    T::Future: Send,
    T::Stream: Send + 'static,
    S: Send + 'static,
{
    type Stream = Linger<T::Stream>;
    type Error = T::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Stream, Self::Error>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        let (connect, done) = (self.0.connect(stream), self.1);
        Box::pin(async move { connect.await.map(|s| Linger::new(s, Some(done))) })
    }
}
