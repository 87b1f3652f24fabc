//! The Postgres wake-up listener: one dedicated connection per process that `LISTEN`s on
//! [`CHANNEL`](super::postgres::CHANNEL) and wakes local waiters of the announced key.
//!
//! It proves itself before it is trusted: after `LISTEN` it sends a probe notification
//! through the pool (the path every real announcement takes) and marks wake-ups healthy only
//! when the probe comes back; it re-probes every [`REPROBE`]. Its connection is
//! `store.postgres.listen_url`, which must be a direct session: listening through a pooler in
//! transaction mode hears nothing (the probe fails, and waiters keep polling). The probe goes
//! through the pool, whatever `url` points at, so it proves the path real announcements take. When the
//! connection drops, or a probe sent through the pool does not come back on it (a connection
//! frozen without an error: a stalled server process, a half-open TCP connection), wake-ups
//! are marked unhealthy at once (waiters fall back to bounded polling) and the connection is
//! replaced, with backoff while replacements keep failing: a frozen listener is noticed
//! within one probe interval and replaced within two. On recovery every waiter is woken to
//! look again, since announcements may have been missed meanwhile.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::mpsc;
use tokio_postgres::types::Type;
use tokio_postgres::{AsyncMessage, NoTls};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::statements::CHANNEL;
use crate::store::Announce;

/// How often a live listener proves again that notifications arrive. With the probe's own
/// bounds (2 s to send it, 2 s to hear it), it is how long an instance whose listener froze
/// silently may go on trusting its replay cache, which an operator's delete on another
/// instance could not reach meanwhile (`inflight/cache.rs`). One notification per instance
/// per interval, through the pool.
pub const REPROBE: Duration = Duration::from_secs(5);
/// How long a probe may take to come back.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const PROBE_PREFIX: &str = "probe:";
/// How the listener's session shows in `pg_stat_activity`.
pub const APPLICATION_NAME: &str = "idemgate-listener";

static PROBES: AtomicU64 = AtomicU64::new(0);

/// Dispatches a listener connection's notifications until it ends.
fn spawn_driver<S, T>(
    mut conn: tokio_postgres::Connection<S, T>,
    announce: Arc<dyn Announce>,
    probe_tx: mpsc::UnboundedSender<String>,
) -> tokio::task::JoinHandle<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        while let Some(msg) = std::future::poll_fn(|cx| conn.poll_message(cx)).await {
            match msg {
                Ok(AsyncMessage::Notification(n)) => match n.payload().strip_prefix(PROBE_PREFIX) {
                    Some(nonce) => {
                        let _ = probe_tx.send(nonce.to_string());
                    }
                    None => announce.wake(n.payload()),
                },
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "wake-up listener connection failed");
                    break;
                }
            }
        }
    })
}

/// Runs forever (until aborted): listen, probe, dispatch, reconnect. `tls` is the store's
/// own TLS connector (the listener's connection is protected like the pool's).
pub async fn run(
    mut pg: tokio_postgres::Config,
    pool: Pool,
    announce: Arc<dyn Announce>,
    tls: Option<MakeRustlsConnect>,
) {
    pg.application_name(APPLICATION_NAME);
    // `connect_timeout` bounds the socket's connection only: the session's start-up and the
    // LISTEN have a bound of their own, so a server that accepts and never answers (frozen)
    // is given up on and tried again, as a frozen session is replaced.
    let setup_bound = pg.get_connect_timeout().copied().unwrap_or(PROBE_TIMEOUT) + PROBE_TIMEOUT;
    let mut backoff = BACKOFF_MIN;
    loop {
        let (probe_tx, mut probe_rx) = mpsc::unbounded_channel::<String>();
        let wk = Arc::clone(&announce);
        let setup = async {
            let (client, driver) = match &tls {
                None => pg
                    .connect(NoTls)
                    .await
                    .map(|(client, conn)| (client, spawn_driver(conn, wk, probe_tx))),
                Some(tls) => pg
                    .connect(tls.clone())
                    .await
                    .map(|(client, conn)| (client, spawn_driver(conn, wk, probe_tx))),
            }
            // Refused while the database is down: retried quietly.
            .map_err(|e| (false, format!("cannot connect: {e}")))?;
            // Aborted if LISTEN fails or runs out of time (a dropped handle would not).
            let driver = AbortOnDrop(Some(driver));
            client
                .batch_execute(&format!("LISTEN {CHANNEL}"))
                .await
                .map_err(|e| (true, format!("LISTEN failed: {e}")))?;
            Ok::<_, (bool, String)>((client, driver))
        };
        let set_up = tokio::time::timeout(setup_bound, setup)
            .await
            .unwrap_or_else(|_| Err((true, format!("no session within {setup_bound:?}"))));
        let (client, mut driver) = match set_up {
            Ok((client, mut driver)) => (client, driver.take()),
            Err((warn, why)) => {
                announce.set_healthy(false);
                if warn {
                    tracing::warn!(%why, "wake-up listener not set up; retrying");
                } else {
                    tracing::debug!(%why, "wake-up listener not set up; retrying");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        announce.listener_session();
        let mut replace = false;
        loop {
            let found = probe(&pool, &mut probe_rx).await;
            let ok = found == Probe::Heard;
            if !ok && announce.healthy() {
                tracing::warn!("a probe notification did not come back; waiters poll");
            }
            announce.set_healthy(ok);
            if found == Probe::Unheard {
                // Sent and not heard: this connection hears nothing. Replace it.
                tracing::warn!(
                    "replacing the wake-up listener's connection: a probe sent through the pool did not come back on it"
                );
                replace = true;
                break;
            }
            if ok {
                backoff = BACKOFF_MIN;
            }
            tokio::select! {
                () = tokio::time::sleep(REPROBE) => {}
                _ = &mut driver => break,
            }
        }
        announce.set_healthy(false);
        driver.abort();
        drop(client);
        if replace {
            announce.listener_replaced();
        }
        // A listener that keeps not hearing (`listen_url` through a pooler in transaction
        // mode, say), or whose sessions keep ending before a probe is heard, is replaced at a
        // growing interval, not in a loop; one that was heard starts again from the least.
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// A task aborted when its handle is dropped, unless taken out first.
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl AbortOnDrop {
    fn take(&mut self) -> tokio::task::JoinHandle<()> {
        self.0.take().expect("taken once")
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// What one probe found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    /// It came back on the listener.
    Heard,
    /// It could not be sent (the pool or the database is down): the listener is not to blame.
    Unsent,
    /// It was sent and did not come back in time: the listener's connection is not working.
    Unheard,
}

/// Sends a probe through the pool and waits for it on the listener.
async fn probe(pool: &Pool, rx: &mut mpsc::UnboundedReceiver<String>) -> Probe {
    let nonce = format!(
        "{}-{}",
        std::process::id(),
        PROBES.fetch_add(1, Ordering::Relaxed)
    );
    let send = async {
        let conn = pool.get().await.ok()?;
        // Unnamed: the pool may sit behind a pooler in transaction mode.
        conn.execute_typed(
            "SELECT pg_notify($1, $2)",
            &[
                (&CHANNEL, Type::TEXT),
                (&format!("{PROBE_PREFIX}{nonce}"), Type::TEXT),
            ],
        )
        .await
        .ok()
    };
    if tokio::time::timeout(PROBE_TIMEOUT, send)
        .await
        .ok()
        .flatten()
        .is_none()
    {
        return Probe::Unsent;
    }
    let wait = async {
        while let Some(got) = rx.recv().await {
            if got == nonce {
                return true;
            }
        }
        false
    };
    if tokio::time::timeout(PROBE_TIMEOUT, wait)
        .await
        .unwrap_or(false)
    {
        Probe::Heard
    } else {
        Probe::Unheard
    }
}
