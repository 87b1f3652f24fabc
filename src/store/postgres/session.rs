//! A statement on a pooled connection: how it is sent (prepared on a direct session, unnamed
//! behind a pooler in transaction mode), bounded (the pool's acquire timeout, the statement
//! timeout, a cancel request and detaching behind a pooler) and classified (`pg_error`).

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::connect::PoolerKind;
use super::statements::*;
use crate::config::Pooler;
use crate::metrics::StoreMetrics;
use crate::store::{ClaimRequest, FinishRow, Outcome, StoreError};

/// The pool and how statements on it are sent and bounded.
pub(super) struct Db {
    pub(super) pool: Pool,
    /// The pool's connection config (`url`), for cancel requests.
    pub(super) pg: tokio_postgres::Config,
    /// What `url` points at (configured or learned by the first connection, see
    /// [`super::connect`]); decides how statements are sent and bounded.
    pub(super) pooler: Arc<PoolerKind>,
    pub(super) acquire_timeout: Duration,
    pub(super) statement_timeout: Duration,
    pub(super) metrics: StoreMetrics,
    /// The TLS connector (`tls.mode` require or verify-full), shared with the listener.
    pub(super) tls: Option<MakeRustlsConnect>,
}

/// Client-side slack on top of the statement timeout: for the server's own timeout to
/// arrive first (direct session), or for a cancelled statement to end (behind a pooler).
pub(super) const CLIENT_SLACK: Duration = Duration::from_millis(200);

/// How a bounded call on a pooled connection ended.
pub(super) enum Ended<T> {
    /// Within the bound: the connection goes back to the pool.
    Done(Result<T, tokio_postgres::Error>),
    /// Past the bound: the connection is detached, never reused; closed at once, or, when a
    /// cancel request was sent for it, once the request was acted on (see `pg_cancel`).
    Detach(
        Result<T, StoreError>,
        Option<tokio::task::JoinHandle<Option<super::cancel::Forwarded>>>,
    ),
}

/// A pooled connection and how statements are sent on it (see the module docs).
pub struct Conn<'a> {
    pub(super) obj: &'a Object,
    pub(super) pooler: Pooler,
}

impl Conn<'_> {
    /// A hot statement: prepared once per connection on a direct session, unnamed (one round
    /// trip, parsed and planned each time) behind a pooler in transaction mode.
    pub(super) async fn query(
        &self,
        sql: &str,
        types: &[Type],
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        match self.pooler {
            Pooler::None => {
                let stmt = self.obj.prepare_typed_cached(sql, types).await?;
                self.obj.query(&stmt, params).await
            }
            Pooler::Transaction => self.unnamed(sql, types, params).await,
        }
    }

    /// [`query`](Self::query) for at most one row.
    pub(super) async fn query_opt(
        &self,
        sql: &str,
        types: &[Type],
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<tokio_postgres::Row>, tokio_postgres::Error> {
        match self.pooler {
            Pooler::None => {
                let stmt = self.obj.prepare_typed_cached(sql, types).await?;
                self.obj.query_opt(&stmt, params).await
            }
            Pooler::Transaction => self.obj.query_typed_opt(sql, &typed(params, types)).await,
        }
    }

    /// The claim of one new key ([`CLAIM_NEW_SQL`], or its function behind a pooler): its
    /// lease token, or `None` when the key exists.
    pub(super) async fn claim_new(
        &self,
        k: NewKeyParams<'_>,
    ) -> Result<Option<String>, tokio_postgres::Error> {
        let params: &[&(dyn ToSql + Sync)] = &[
            &k.scope,
            &k.key,
            &k.route,
            &k.fingerprint,
            &k.lease_ms,
            &k.ttl_ms,
        ];
        Ok(match self.pooler {
            Pooler::None => self
                .query_opt(CLAIM_NEW_SQL, CLAIM_NEW_TYPES, params)
                .await?
                .map(|row| row.get(0)),
            // The same statement in a function whose plan the server session keeps
            // (migrations/0006): NULL when the key exists.
            Pooler::Transaction => self
                .query_opt(CLAIM_NEW_CALL, CLAIM_NEW_TYPES, params)
                .await?
                .and_then(|row| row.get(0)),
        })
    }

    /// The end of one attempt, fenced by its lease token: the completion ([`FINISH_SQL`], or
    /// its function behind a pooler), or the release ([`RELEASE_SQL`]). Whether it wrote.
    pub(super) async fn finish_one(
        &self,
        f: FinishParams<'_>,
        outcome: &Outcome,
    ) -> Result<bool, tokio_postgres::Error> {
        let FinishParams {
            scope,
            key,
            token,
            ttl_ms,
            id,
        } = f;
        if let Outcome::Release = outcome {
            return Ok(self
                .query_opt(RELEASE_SQL, RELEASE_TYPES, &[&scope, &key, &token, &id])
                .await?
                .is_some());
        }
        let FinishRow {
            state,
            status,
            headers,
            body,
        } = FinishRow::of(outcome);
        let params: &[&(dyn ToSql + Sync)] = &[
            &scope, &key, &token, &state, &status, &headers, &body, &ttl_ms, &id,
        ];
        Ok(match self.pooler {
            Pooler::None => self
                .query_opt(FINISH_SQL, FINISH_TYPES, params)
                .await?
                .is_some(),
            // The same statement in a function (migrations/0006): whether it wrote the row.
            Pooler::Transaction => self
                .query_opt(FINISH_CALL, FINISH_TYPES, params)
                .await?
                .is_some_and(|row| row.get::<_, bool>(0)),
        })
    }

    /// A statement planned at every call for the values it is given (unnamed, one round
    /// trip), whatever the pooler: for a statement whose best plan depends on them.
    pub(super) async fn unnamed(
        &self,
        sql: &str,
        types: &[Type],
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        self.obj.query_typed(sql, &typed(params, types)).await
    }

    /// A rare statement without parameters, unnamed whatever the pooler.
    pub(super) async fn unnamed_one(
        &self,
        sql: &str,
    ) -> Result<tokio_postgres::Row, tokio_postgres::Error> {
        self.obj.query_typed_one(sql, &[]).await
    }
}

/// Parameters paired with their types, as `query_typed` takes them.
pub(super) fn typed<'a>(
    params: &[&'a (dyn ToSql + Sync)],
    types: &[Type],
) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
    debug_assert_eq!(params.len(), types.len(), "one type per parameter");
    params.iter().copied().zip(types.iter().cloned()).collect()
}

/// Classifies by `SqlState`, severity and error source, never by message text.
pub(super) fn pg_error(e: tokio_postgres::Error) -> StoreError {
    use std::error::Error as _;
    if e.code() == Some(&SqlState::QUERY_CANCELED) {
        return StoreError::Timeout;
    }
    let io = e
        .source()
        .is_some_and(|s| s.downcast_ref::<std::io::Error>().is_some());
    // A FATAL error ends the session: the server shutting down or refusing connections, or
    // a pooler that cannot reach it (PgBouncer: "server login has been failing"). Like a
    // connection exception (class 08), it means the store is unreachable, not a bad row.
    let session_ended = e.as_db_error().is_some_and(|d| {
        use tokio_postgres::error::Severity;
        // The nonlocalized severity when the server sends one (PgBouncer sends only the
        // other, which it never localizes).
        let fatal = match d.parsed_severity() {
            Some(s) => matches!(s, Severity::Fatal | Severity::Panic),
            None => matches!(d.severity(), "FATAL" | "PANIC"),
        };
        fatal || d.code().code().starts_with("08")
    });
    if e.is_closed() || io || session_ended {
        let mut why = crate::payload::error_chain(&e);
        // PgBouncer refuses the `options` startup parameter that a direct session sends:
        // say which field fixes it (the classification above never reads the message).
        if super::connect::refused_options(&e) {
            why.push_str(
                " (is store.postgres.url a pooler in transaction mode? set \
                 store.postgres.pooler: transaction)",
            );
        }
        return StoreError::Connect(why);
    }
    StoreError::Db(crate::payload::error_chain(&e))
}

impl Db {
    pub(super) async fn conn(&self) -> Result<Object, StoreError> {
        self.conn_by(tokio::time::Instant::now() + self.acquire_timeout)
            .await
    }

    /// A pooled connection, waited for until `deadline` at the latest.
    pub(super) async fn conn_by(
        &self,
        deadline: tokio::time::Instant,
    ) -> Result<Object, StoreError> {
        use deadpool_postgres::PoolError;
        let started = std::time::Instant::now();
        let got = tokio::time::timeout_at(deadline, self.pool.get()).await;
        self.metrics
            .pool_wait
            .observe(started.elapsed().as_secs_f64());
        match got {
            Err(_) => Err(StoreError::AcquireTimeout),
            Ok(Ok(obj)) => Ok(obj),
            Ok(Err(PoolError::Timeout(_))) => Err(StoreError::AcquireTimeout),
            Ok(Err(PoolError::Backend(e))) => Err(pg_error(e)),
            Ok(Err(e)) => Err(StoreError::Connect(e.to_string())),
        }
    }

    /// Runs `f` on a pooled connection within the statement bound. On a client-side timeout
    /// the connection is detached (its statement may still be running), never reused.
    pub(super) async fn with_conn<T>(
        &self,
        op: &'static str,
        f: impl AsyncFnOnce(&Conn<'_>) -> Result<T, tokio_postgres::Error>,
    ) -> Result<T, StoreError> {
        self.metrics.timed(op, self.unobserved(f)).await
    }

    /// [`with_conn`](Self::with_conn) without recording its latency: for a call whose caller
    /// records the whole operation once (a claim's statements, a completion after its batch).
    pub(super) async fn unobserved<T>(
        &self,
        f: impl AsyncFnOnce(&Conn<'_>) -> Result<T, tokio_postgres::Error>,
    ) -> Result<T, StoreError> {
        let obj = self.conn().await?;
        self.bounded(obj, f).await
    }

    /// Runs `f` on `obj` within the statement bound; the connection goes back to the pool
    /// when it ended in time, and is detached (never reused) when it did not.
    pub(super) async fn bounded<T>(
        &self,
        obj: Object,
        f: impl AsyncFnOnce(&Conn<'_>) -> Result<T, tokio_postgres::Error>,
    ) -> Result<T, StoreError> {
        let ended = {
            let pooler = self.pooler.get();
            let conn = Conn { obj: &obj, pooler };
            let run = f(&conn);
            tokio::pin!(run);
            match pooler {
                Pooler::None => {
                    match tokio::time::timeout(self.statement_timeout + CLIENT_SLACK, &mut run)
                        .await
                    {
                        Ok(done) => Ended::Done(done),
                        // Its statement may still be running: never lend this connection again.
                        Err(_) => Ended::Detach(Err(StoreError::Timeout), None),
                    }
                }
                Pooler::Transaction => {
                    match tokio::time::timeout(self.statement_timeout, &mut run).await {
                        Ok(done) => Ended::Done(done),
                        Err(_) => {
                            // Nobody else bounds it: ask the server (through the pooler) to
                            // stop the statement, and give it the slack to end. Whatever
                            // comes back, the cancel request may still be on its way: never
                            // lend this connection again.
                            let cancel = tokio::spawn(self.cancel(&obj));
                            let after = tokio::time::timeout(CLIENT_SLACK, &mut run).await;
                            Ended::Detach(
                                match after {
                                    Ok(done) => done.map_err(pg_error),
                                    Err(_) => Err(StoreError::Timeout),
                                },
                                Some(cancel),
                            )
                        }
                    }
                }
            }
        };
        match ended {
            Ended::Done(done) => done.map_err(pg_error),
            Ended::Detach(result, None) => {
                drop(Object::take(obj));
                result
            }
            Ended::Detach(result, Some(cancel)) => {
                // Hanging up while the pooler still forwards the cancel request would drop
                // it (and PgBouncer 1.18 does not survive that): close the session once the
                // request was acted on. Bounded by the connect timeout and `pg_cancel::LINGER`.
                let client = Object::take(obj);
                tokio::spawn(async move {
                    if let Ok(Some(forwarded)) = cancel.await {
                        let _ = forwarded.await;
                    }
                    drop(client);
                });
                result
            }
        }
    }

    /// Sends a cancel request for whatever statement `obj` is running (through the pooler,
    /// which forwards it to the server session that runs it; see [`super::cancel`]). Yields
    /// the signal that it was acted on, or nothing if it could not be sent.
    pub(super) fn cancel(
        &self,
        obj: &Object,
    ) -> impl std::future::Future<Output = Option<super::cancel::Forwarded>> + use<> {
        let token = obj.cancel_token();
        let (pg, tls) = (self.pg.clone(), self.tls.clone());
        async move {
            let timeout = pg.get_connect_timeout().copied().unwrap_or(CLIENT_SLACK);
            match super::cancel::cancel(&token, &pg, tls.as_ref(), timeout).await {
                Ok(forwarded) => Some(forwarded),
                Err(e) => {
                    tracing::debug!(error = %e, "cancel request failed");
                    None
                }
            }
        }
    }

    /// Starts an explicit transaction with the statement bound set for it alone (`SET LOCAL`
    /// lasts until its commit, so it is safe behind a pooler in transaction mode too).
    pub(super) async fn begin<'c>(
        &self,
        obj: &'c mut Object,
    ) -> Result<deadpool_postgres::Transaction<'c>, tokio_postgres::Error> {
        let tx = obj.transaction().await?;
        tx.batch_execute(&format!(
            "SET LOCAL statement_timeout = {}",
            self.statement_timeout.as_millis()
        ))
        .await?;
        Ok(tx)
    }
}

/// TCP keepalive on a store connection, well below the kernel's two-hour default: a
/// connection whose peer vanished (a failover, a dropped NAT entry) is noticed in about a
/// minute instead of hanging a statement or the wake-up listener until then.
pub(super) fn keepalive(cfg: &mut tokio_postgres::Config) {
    cfg.keepalives(true);
    cfg.keepalives_idle(Duration::from_secs(30));
    cfg.keepalives_interval(Duration::from_secs(10));
    cfg.keepalives_retries(3);
}

/// Refuses a default isolation other than read committed. A direct session sets its own (a
/// startup option), so this only fails behind a pooler in transaction mode, where the
/// database's or role's default applies: the statements are written for read committed, and
/// under `repeatable read` or `serializable` concurrent claims of one key fail with 40001.
pub(super) fn check_isolation(isolation: &str) -> Result<(), StoreError> {
    if isolation == "read committed" {
        return Ok(());
    }
    Err(StoreError::NotDurable(format!(
        "the gateway's transactions default to {isolation} isolation, and through a pooler in \
         transaction mode it cannot choose its own: concurrent requests for one key would fail \
         with serialization errors (40001). Give its role read committed (ALTER ROLE ... SET \
         default_transaction_isolation = 'read committed') or point store.postgres.url at \
         PostgreSQL itself"
    )))
}

/// One new key's claim parameters, as [`CLAIM_NEW_SQL`] binds them.
#[derive(Clone, Copy)]
pub(super) struct NewKeyParams<'a> {
    pub(super) scope: &'a str,
    pub(super) key: &'a str,
    pub(super) route: &'a str,
    pub(super) fingerprint: &'a [u8],
    pub(super) lease_ms: i64,
    pub(super) ttl_ms: i64,
}

impl<'a> NewKeyParams<'a> {
    pub(super) fn of(req: &ClaimRequest<'a>) -> NewKeyParams<'a> {
        NewKeyParams {
            scope: req.scope,
            key: req.key,
            route: req.route,
            fingerprint: req.fingerprint,
            lease_ms: req.lease.as_millis() as i64,
            ttl_ms: req.ttl.as_millis() as i64,
        }
    }
}

/// What fences and announces the end of one attempt; the outcome is passed beside it.
#[derive(Clone, Copy)]
pub(super) struct FinishParams<'a> {
    pub(super) scope: &'a str,
    pub(super) key: &'a str,
    pub(super) token: &'a str,
    pub(super) ttl_ms: i64,
    /// The key's wake-up id ([`KeyId`](crate::key::KeyId)), the payload of its announcement.
    pub(super) id: &'a str,
}
