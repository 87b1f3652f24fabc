//! How the pool opens its connections, and what `store.postgres.url` points at.
//!
//! A direct session gets the gateway's settings as startup options (the server then keeps
//! `statement_timeout` and read committed isolation itself). A pooler in transaction mode
//! cannot take them: PgBouncer refuses the `options` startup parameter ("unsupported
//! startup parameter"), or drops it when told to ignore it. Unless `store.postgres.pooler`
//! says which it is, the first connection finds out: a refusal, or options that did not
//! reach the server (a marker setting among them reads back empty), mean a pooler in
//! transaction mode, and every later connection and statement is made for it. Nothing is
//! sent on a pooled connection before the answer is known (a statement needs a connection,
//! and the first one decides), so no statement is ever made for the wrong kind.
//!
//! Invariant: once learned, the kind never changes for the life of the process.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use deadpool_postgres::Connect;
use tokio_postgres::{Client, NoTls};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::config::Pooler;

/// The startup option whose value on the server shows that the options arrived.
const MARKER: &str = "idemgate.direct";

/// What `url` points at: configured, or learned from the first connection.
#[derive(Debug)]
pub(super) struct PoolerKind {
    configured: Option<Pooler>,
    /// 0 unknown, 1 a direct session, 2 a pooler in transaction mode.
    learned: AtomicU8,
}

impl PoolerKind {
    pub(super) fn new(configured: Option<Pooler>) -> PoolerKind {
        PoolerKind {
            configured,
            learned: AtomicU8::new(0),
        }
    }

    /// The kind, once known (always, when configured).
    pub(super) fn known(&self) -> Option<Pooler> {
        self.configured
            .or(match self.learned.load(Ordering::Acquire) {
                1 => Some(Pooler::None),
                2 => Some(Pooler::Transaction),
                _ => None,
            })
    }

    /// The kind for a statement on a connection already open (then it is known; a direct
    /// session before).
    pub(super) fn get(&self) -> Pooler {
        self.known().unwrap_or(Pooler::None)
    }

    fn learn(&self, kind: Pooler) {
        let code = match kind {
            Pooler::None => 1,
            Pooler::Transaction => 2,
        };
        if self.learned.swap(code, Ordering::AcqRel) != code && kind == Pooler::Transaction {
            tracing::info!(
                "store.postgres.url does not take session startup options: a pooler in \
                 transaction mode; statements are sent as with store.postgres.pooler: \
                 transaction (set store.postgres.pooler to skip this detection)"
            );
        }
    }
}

/// The pool's connector: `direct` carries the startup options, `pooled` none.
pub(super) struct Connector {
    pub(super) direct: tokio_postgres::Config,
    pub(super) pooled: tokio_postgres::Config,
    pub(super) tls: Option<MakeRustlsConnect>,
    pub(super) kind: Arc<PoolerKind>,
}

/// The options of a direct session: the statement bound and the isolation its statements
/// are written for, and the marker.
pub(super) fn direct_options(statement_timeout_ms: u128) -> String {
    format!(
        "-c statement_timeout={statement_timeout_ms} \
         -c default_transaction_isolation=read\\ committed -c {MARKER}=on"
    )
}

/// Whether a failed connection is a pooler refusing the startup options.
pub(super) fn refused_options(e: &tokio_postgres::Error) -> bool {
    e.as_db_error()
        .is_some_and(|d| d.message().starts_with("unsupported startup parameter"))
}

type Opened = (Client, tokio::task::JoinHandle<()>);

async fn open(
    cfg: &tokio_postgres::Config,
    tls: &Option<MakeRustlsConnect>,
) -> Result<Opened, tokio_postgres::Error> {
    let (client, driver) = match tls {
        None => {
            let (client, conn) = cfg.connect(NoTls).await?;
            (
                client,
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "store connection ended");
                    }
                }),
            )
        }
        Some(tls) => {
            let (client, conn) = cfg.connect(tls.clone()).await?;
            (
                client,
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "store connection ended");
                    }
                }),
            )
        }
    };
    Ok((client, driver))
}

impl Connect for Connector {
    fn connect(
        &self,
        _: &tokio_postgres::Config,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Opened, tokio_postgres::Error>> + Send + '_>,
    > {
        Box::pin(async move {
            match self.kind.known() {
                Some(Pooler::None) => open(&self.direct, &self.tls).await,
                Some(Pooler::Transaction) => open(&self.pooled, &self.tls).await,
                None => match open(&self.direct, &self.tls).await {
                    Ok((client, driver)) => {
                        // The simple protocol: no named statement, which a pooler in
                        // transaction mode could not keep.
                        let arrived = client
                            .simple_query(&format!("SELECT current_setting('{MARKER}', true)"))
                            .await?
                            .iter()
                            .any(|m| match m {
                                tokio_postgres::SimpleQueryMessage::Row(r) => {
                                    r.get(0) == Some("on")
                                }
                                _ => false,
                            });
                        self.kind.learn(if arrived {
                            Pooler::None
                        } else {
                            Pooler::Transaction
                        });
                        Ok((client, driver))
                    }
                    Err(e) if refused_options(&e) => {
                        self.kind.learn(Pooler::Transaction);
                        open(&self.pooled, &self.tls).await
                    }
                    Err(e) => Err(e),
                },
            }
        })
    }
}
