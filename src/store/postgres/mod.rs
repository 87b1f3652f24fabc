//! The Postgres store: the claim SQL, fenced by lease token, and the migrations.
//!
//! Invariants:
//! - A new key is claimed by one plain `INSERT ... ON CONFLICT DO NOTHING RETURNING`
//!   (`CLAIM_NEW_SQL`), the common case at the cost of a bare insert. Only when the key exists
//!   does the full claim run: one statement (`INSERT ... ON CONFLICT DO UPDATE ... WHERE
//!   <claimable>` in a CTE, plus a read of the existing row when nothing was claimed) that
//!   decides every other case by itself; nothing is decided by a read followed by a write.
//!   Under READ COMMITTED the read uses the statement's snapshot, while the INSERT waits for
//!   and sees rows committed after it: the read can then find no row, or an older version
//!   that would itself have been claimable (`stale`). Either way the full statement is simply
//!   run again (a new snapshot sees the newer row); an older version that was not claimable
//!   is safe to act on (it says "in flight", and waiting looks again). The plain insert needs
//!   no such care: it either inserts, or waits for a concurrent writer of the key and then
//!   leaves the decision to the full statement, whose snapshot is taken after that wait.
//! - New keys waiting at the same moment are claimed together, and completions waiting at
//!   the same moment are written together (`batch_keys`, see [`super::batch`]): one
//!   statement and one commit for several keys, each key with its own answer. The batched
//!   claim (`CLAIM_NEW_BATCH_CALL`, a function of migration 8 holding
//!   `CLAIM_NEW_BATCH_SQL`) is the plain insert for several rows; a key it did not
//!   insert exists and goes to the full claim, alone, as after the plain insert (a second
//!   request for a key already in the batch goes there at once: the unique index orders it
//!   with the insert). The batched completion (`FINISH_BATCH_CALL`, a function of migration 7)
//!   runs the fenced single-key completion for each row in turn, each fenced by its own lease
//!   token, and names each key it wrote; each row is found by its primary key, so its cached
//!   plan suits a table of any size (an `UPDATE ... FROM unnest(...)` had to be planned at
//!   every call: a plan cached while the table was small scanned it whole once it was
//!   large). A batch of one sends the single-key statement. A key appears once per batch,
//!   and a batch is sorted by key, so concurrent batches take their rows' locks in one
//!   order; two completion batches share a key only when two attempts of one key end at
//!   once. A batch chosen as a deadlock's victim leaves every key to its single statement.
//! - An expired lease is taken over only by the same request (same fingerprint); a
//!   different request under that key is a mismatch, as for a live one.
//! - An in-flight row whose lease expired is taken over, unless the route holds unknown
//!   outcomes: then it stays as it is and is reported as held (its attempt may still finish
//!   and record its answer; an operator may delete it).
//! - Every write after a claim carries `lease_token = $token`, so an attempt whose lease was
//!   taken over can never overwrite its successor.
//! - `now()` (the database clock) sets every lease and expiry.
//! - The table has no CHECK constraints (PostgreSQL re-parses each one at every statement's
//!   start): the statements that write keep what they guarded. Only the claims write
//!   `in_flight`, always with a generated lease token and a lease expiry; the completion can
//!   only write `completed` with status, headers and body, or `not_replayable` or `unknown`,
//!   and fails on anything else (`tests/it/row_invariants.rs`).
//! - The completion changes no indexed column (garbage collection indexes `gc_after`, set only
//!   by a claim), so it can be a HOT update: no index entry, the page of its claim.
//! - Every call is bounded: pool acquire by `acquire_timeout`, statements by
//!   `statement_timeout`. On a direct session (`pooler: none`) the server enforces it (a
//!   startup option) and the client enforces the same bound plus a slack; a connection whose
//!   statement timed out on the client side is detached from the pool, never reused. Behind a
//!   pooler in transaction mode (`pooler: transaction`), which refuses startup options, the
//!   client enforces it: past `statement_timeout` it sends a cancel request (the pooler
//!   forwards it to the server running the statement), waits for the statement to end within
//!   the same slack, and detaches the connection either way. Explicit transactions
//!   (migrations, garbage collection) start with `SET LOCAL statement_timeout` instead.
//! - Each hot statement is written once, with the types of its parameters (`*_TYPES`, what
//!   the server would infer), and sent one of two ways: prepared once per connection
//!   (`prepare_typed_cached`: the server keeps the plan) on a direct session, or unnamed
//!   (parse, bind and execute in one round trip: `query_typed`) behind a pooler in
//!   transaction mode, where a named statement would outlive the transaction that lent the
//!   server session. An unnamed statement costs the server a parse and a plan per call
//!   (docs/scaling.md has the measured price). Rare statements (migrations, readiness,
//!   garbage collection, the listener's probe) are always unnamed. Nothing session-scoped is
//!   used on `url`: no `SET`, no session advisory lock, no `LISTEN` (the wake-up listener has
//!   its own direct session, `listen_url`).
//! - A `serialize` slot is taken by one statement calling `idemgate_take_slot`, which
//!   decides under a per-scope transaction-level advisory lock taken before it reads a row:
//!   takers of one scope are ordered across instances, and each sees every slot committed
//!   before it (see migrations/0004_slot_limits.sql). The lock ends with that statement's
//!   implicit transaction, so it is never held across the upstream call, and a pooler in
//!   transaction mode keeps it on one server connection. Migrations and garbage collection
//!   take transaction-level advisory locks too, inside explicit transactions.

mod batch;
mod batched;
pub mod cancel;
mod claim;
mod connect;
mod list;
pub mod listener;
mod migrate;
mod session;
mod statements;

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use tokio_postgres::config::SslMode;
use tokio_postgres::types::Type;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::{
    Announce, BoxFuture, Claim, ClaimRequest, Deleted, GcRun, KeyInfo, LeaseToken, ListPage,
    ListQuery, OnlineRun, Outcome, Slot, Store, StoreError,
};
use crate::config::{PgTlsMode, PostgresConfig};
use crate::key::KeyId;
use crate::metrics::StoreMetrics;

use batch::Limits;
use batched::Batches;
use connect::{Connector, PoolerKind};
use migrate::BACKFILL_GC_AFTER_SQL;
pub use migrate::MIGRATIONS;
use session::*;
use statements::*;
pub use statements::{
    CHANNEL, CLAIM_NEW_SQL, CLAIM_NEW_TYPES, FINISH_SQL, FINISH_TYPES, LIST_TYPES, list_sql,
};

pub struct PgStore {
    /// What a statement on a pooled connection needs; shared with the batch dispatchers.
    db: Arc<Db>,
    /// The wake-up listener's own connection (`listen_url`, a direct session).
    listen: tokio_postgres::Config,
    listener: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// `store.postgres.allow_async_commit`.
    allow_async_commit: bool,
    /// The queues of new-key claims and completions (see [`super::batch`]); `None` with
    /// `batch_keys: 1`, where every key runs its own statements on its own connection.
    batches: Option<Batches>,
}

impl Drop for PgStore {
    fn drop(&mut self) {
        if let Ok(mut l) = self.listener.lock()
            && let Some(task) = l.take()
        {
            task.abort();
        }
    }
}

impl PgStore {
    /// Builds the pool. Connections are opened lazily, so this succeeds with Postgres down.
    pub fn new(cfg: &PostgresConfig) -> Result<PgStore, StoreError> {
        let mut pg: tokio_postgres::Config = cfg
            .url
            .parse()
            .map_err(|_| StoreError::Connect("invalid connection string".into()))?;
        pg.connect_timeout(cfg.connect_timeout);
        pg.application_name("idemgate");
        keepalive(&mut pg);
        // A direct session keeps the statement bound and the isolation its statements are
        // written for (read committed: a claim reads the newest committed row, and takes it
        // over under its lock; `serializable` or `repeatable read` would fail them with 40001)
        // as startup options; a pooler in transaction mode takes none (super::connect).
        let pooled = pg.clone();
        pg.options(connect::direct_options(cfg.statement_timeout.as_millis()));
        let mut listen: tokio_postgres::Config = cfg
            .listen_url
            .parse()
            .map_err(|_| StoreError::Connect("invalid listen connection string".into()))?;
        listen.connect_timeout(cfg.connect_timeout);
        keepalive(&mut listen);
        let tls = match cfg.tls {
            PgTlsMode::Disable => {
                pg.ssl_mode(SslMode::Disable);
                listen.ssl_mode(SslMode::Disable);
                None
            }
            PgTlsMode::Require => {
                pg.ssl_mode(SslMode::Require);
                listen.ssl_mode(SslMode::Require);
                Some(MakeRustlsConnect::new(
                    crate::tls::unverified_client_config().map_err(StoreError::Connect)?,
                ))
            }
            PgTlsMode::VerifyFull => {
                pg.ssl_mode(SslMode::Require);
                listen.ssl_mode(SslMode::Require);
                Some(MakeRustlsConnect::new(
                    crate::tls::client_config(cfg.tls_ca.as_deref())
                        .map_err(StoreError::Connect)?,
                ))
            }
        };
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let kind = Arc::new(PoolerKind::new(cfg.pooler));
        let pooled = {
            let mut pooled = pooled;
            match cfg.tls {
                PgTlsMode::Disable => pooled.ssl_mode(SslMode::Disable),
                PgTlsMode::Require | PgTlsMode::VerifyFull => pooled.ssl_mode(SslMode::Require),
            };
            pooled
        };
        let connector = Connector {
            direct: pg.clone(),
            pooled,
            tls: tls.clone(),
            kind: Arc::clone(&kind),
        };
        let mgr = Manager::from_connect(pg.clone(), connector, manager_config);
        let pool = Pool::builder(mgr)
            .max_size(cfg.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(cfg.acquire_timeout))
            .create_timeout(Some(cfg.connect_timeout.min(cfg.acquire_timeout)))
            .recycle_timeout(Some(cfg.acquire_timeout))
            .build()
            .map_err(|e| StoreError::Db(e.to_string()))?;
        let db = Arc::new(Db {
            pool,
            pg,
            pooler: kind,
            acquire_timeout: cfg.acquire_timeout,
            statement_timeout: cfg.statement_timeout,
            metrics: StoreMetrics::default(),
            tls,
        });
        Ok(PgStore {
            batches: (cfg.batch_keys > 1).then(|| {
                let limits = Limits {
                    keys: cfg.batch_keys,
                    bytes: cfg.batch_bytes,
                };
                Batches::new(Arc::clone(&db), limits)
            }),
            db,
            listen,
            listener: std::sync::Mutex::new(None),
            allow_async_commit: cfg.allow_async_commit,
        })
    }

    /// Refuses a `synchronous_commit` of `off` unless the configuration accepts it: with it,
    /// the server acknowledges a commit before it is on disk, so a database crash can lose
    /// an answer a client already holds (guarantee 3). Every other value (`on`, `local`,
    /// `remote_write`, `remote_apply`) flushes the commit locally before acknowledging it.
    fn check_commit_setting(&self, setting: &str) -> Result<(), StoreError> {
        if setting != "off" || self.allow_async_commit {
            return Ok(());
        }
        Err(StoreError::NotDurable(
            "the database runs with synchronous_commit = off for this gateway: a crash of \
             the database can lose stored answers that clients already got (guarantee 3). \
             Turn it on for the gateway's role or database (ALTER ROLE ... SET \
             synchronous_commit = on), or accept the risk with \
             store.postgres.allow_async_commit: true"
                .into(),
        ))
    }

    /// Starts the wake-up listener (one extra connection, outside the pool), which announces
    /// what it hears to `announce`. Without it, waiters for in-flight keys poll. Idempotent;
    /// must run inside a Tokio runtime.
    pub fn start_listener(&self, announce: Arc<dyn Announce>) {
        let mut slot = self.listener.lock().expect("listener lock");
        if slot.is_none() {
            *slot = Some(tokio::spawn(listener::run(
                self.listen.clone(),
                self.db.pool.clone(),
                announce,
                self.db.tls.clone(),
            )));
        }
    }

    /// The pool, for the gc, metrics and tests.
    pub fn pool(&self) -> &Pool {
        &self.db.pool
    }

    /// Applies pending migrations (`migrate.rs`): their transaction, on a pooled
    /// connection (with settings of its own, `SET LOCAL`). Returns how many were applied; the
    /// work they leave for later is [`PgStore::migrate_online`]'s.
    pub async fn migrate(&self) -> Result<usize, StoreError> {
        self.migrate_through(i32::MAX).await
    }

    /// [`PgStore::migrate`] up to version `last` only (to build a database as an earlier
    /// release left it).
    pub async fn migrate_through(&self, last: i32) -> Result<usize, StoreError> {
        let mut obj = self.db.conn().await?;
        migrate::apply(&mut obj, last).await
    }

    /// [`Store::gc`]: batches of expired keys deleted, one short transaction each under the
    /// collection lock, until a batch comes back short or another instance holds the lock.
    async fn gc_batches(&self, batch: usize) -> Result<GcRun, StoreError> {
        let batch = i64::try_from(batch.max(1)).unwrap_or(i64::MAX);
        let mut deleted = 0u64;
        loop {
            // One short transaction per batch, each under the collection lock.
            let mut obj = self.db.conn().await?;
            let bound = self.db.statement_timeout * 2 + CLIENT_SLACK;
            let step = async {
                let tx = self.db.begin(&mut obj).await?;
                let locked: bool = tx
                    .query_typed_one(
                        "SELECT pg_try_advisory_xact_lock($1)",
                        &[(&GC_LOCK, Type::INT8)],
                    )
                    .await?
                    .get(0);
                if !locked {
                    return Ok(None);
                }
                // Rows still at migration 5's default first (an earlier release's
                // instance inserted them), so the delete below does not pass over them.
                tx.execute_typed(BACKFILL_GC_AFTER_SQL, &[(&batch, Type::INT8)])
                    .await?;
                let n = tx.execute_typed(GC_SQL, &[(&batch, Type::INT8)]).await?;
                tx.execute_typed(GC_SLOTS_SQL, &[(&batch, Type::INT8)])
                    .await?;
                tx.commit().await?;
                Ok::<_, tokio_postgres::Error>(Some(n))
            };
            match tokio::time::timeout(bound, step).await {
                Err(_) => {
                    drop(Object::take(obj));
                    return Err(StoreError::Timeout);
                }
                Ok(Err(e)) => return Err(pg_error(e)),
                Ok(Ok(None)) => {
                    return Ok(GcRun {
                        deleted,
                        ran: deleted > 0,
                    });
                }
                Ok(Ok(Some(n))) => {
                    deleted += n;
                    if n < batch as u64 {
                        return Ok(GcRun { deleted, ran: true });
                    }
                }
            }
        }
    }

    /// The migrations' online work: indexes built concurrently and backfills in batches,
    /// while the gateway serves, on a direct session of its own (`listen_url`). Idempotent;
    /// one instance at a time does it.
    pub async fn migrate_online(&self) -> Result<OnlineRun, StoreError> {
        let client = migrate::connect(self.listen.clone(), self.db.tls.clone()).await?;
        migrate::online(&client).await
    }
}

impl Store for PgStore {
    fn claim<'a>(&'a self, req: ClaimRequest<'a>) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(
            self.db
                .metrics
                .timed("claim", async move { self.claim_all(&req).await }),
        )
    }

    fn finish<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        token: &'a LeaseToken,
        outcome: Outcome,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.db.metrics.timed("finish", async move {
            let id = String::from(KeyId::of(scope, key));
            let f = FinishParams {
                scope,
                key,
                token: token.0.as_str(),
                ttl_ms: ttl.as_millis() as i64,
                id: &id,
            };
            self.finish_all(f, outcome).await
        }))
    }

    fn watch<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let row = self
                .db
                .with_conn("watch", async |c| {
                    c.query_opt(WATCH_SQL, WATCH_TYPES, &[&scope, &key]).await
                })
                .await?;
            Ok(row.is_some())
        })
    }

    fn inspect<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyInfo>, StoreError>> {
        Box::pin(async move {
            let row = self
                .db
                .with_conn("inspect", async |c| {
                    c.query_opt(INSPECT_SQL, INSPECT_TYPES, &[&scope, &key])
                        .await
                })
                .await?;
            Ok(row.as_ref().map(list::key_info))
        })
    }

    fn list<'a>(&'a self, q: &'a ListQuery) -> BoxFuture<'a, Result<ListPage, StoreError>> {
        Box::pin(list::page(&self.db, q))
    }

    fn delete<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        force: bool,
    ) -> BoxFuture<'a, Result<Deleted, StoreError>> {
        Box::pin(async move {
            let rows = self
                .db
                .with_conn("delete", async |c| {
                    c.query(
                        DELETE_SQL,
                        DELETE_TYPES,
                        &[&scope, &key, &force, &KeyId::of(scope, key).as_str()],
                    )
                    .await
                })
                .await?;
            Ok(match rows.first() {
                None => Deleted::NotFound,
                Some(r) if r.get::<_, bool>(2) => Deleted::Yes {
                    route: r.get(0),
                    live_lease: r.get(1),
                },
                Some(_) => Deleted::InFlight,
            })
        })
    }

    fn gc(&self, batch: usize) -> BoxFuture<'_, Result<GcRun, StoreError>> {
        Box::pin(self.db.metrics.timed("gc", self.gc_batches(batch)))
    }

    fn acquire_slot<'a>(
        &'a self,
        scope: &'a str,
        max_in_flight: u32,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<Slot>, StoreError>> {
        Box::pin(async move {
            let max = i32::try_from(max_in_flight).unwrap_or(i32::MAX);
            let lease_ms = lease.as_millis() as i64;
            let row = self
                .db
                .with_conn("acquire_slot", async |c| {
                    c.query_opt(
                        SLOT_ACQUIRE_SQL,
                        SLOT_ACQUIRE_TYPES,
                        &[&scope, &max, &lease_ms],
                    )
                    .await
                })
                .await?;
            Ok(row.map(|r| Slot {
                scope: scope.to_string(),
                slot: r.get(0),
                token: r.get(1),
            }))
        })
    }

    fn release_slot<'a>(&'a self, slot: &'a Slot) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let id = String::from(KeyId::slots(&slot.scope));
            let rows = self
                .db
                .with_conn("release_slot", async |c| {
                    c.query(
                        SLOT_RELEASE_SQL,
                        SLOT_RELEASE_TYPES,
                        &[&slot.scope, &slot.slot, &slot.token, &id],
                    )
                    .await
                })
                .await?;
            Ok(rows.len() == 1)
        })
    }

    fn migrate(&self) -> BoxFuture<'_, Result<usize, StoreError>> {
        Box::pin(self.db.metrics.timed("migrate", PgStore::migrate(self)))
    }

    fn migrate_online(&self) -> BoxFuture<'_, Result<OnlineRun, StoreError>> {
        Box::pin(PgStore::migrate_online(self))
    }

    fn metrics(&self) -> &StoreMetrics {
        &self.db.metrics
    }

    fn observe_pool(&self) {
        let status = self.db.pool.status();
        let gauge = |state: &'static str, v: usize| {
            self.db
                .metrics
                .pool
                .get_or_create(&crate::metrics::StateLabel { state })
                .set(v as i64);
        };
        gauge("max", status.max_size);
        gauge("open", status.size);
        gauge("idle", status.available);
        gauge("waiting", status.waiting);
    }

    fn start_background(&self, announce: Arc<dyn Announce>) {
        self.start_listener(announce);
    }

    fn durability(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let (setting, isolation, standbys): (String, String, i64) = self
                .db
                .with_conn("durability", async |c| {
                    let row = c.unnamed_one(SYNC_COMMIT_SQL).await?;
                    let standbys = c.unnamed_one(ASYNC_STANDBYS_SQL).await?.get(0);
                    Ok((row.get(0), row.get(1), standbys))
                })
                .await?;
            check_isolation(&isolation)?;
            self.db.metrics.async_standbys.set(standbys);
            if standbys > 0 {
                tracing::warn!(
                    standbys,
                    "the database streams to standbys that are not synchronous: a failover to one can lose answers already given, and their keys are then forwarded again (docs/operations.md, failover)"
                );
            }
            self.check_commit_setting(&setting)
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let latest = MIGRATIONS.iter().map(|m| m.0).max().unwrap_or(0);
            let (v, setting, isolation): (Option<i32>, String, String) = self
                .db
                .with_conn("ready", async |c| {
                    let row = c.unnamed_one(READY_SQL).await?;
                    Ok((row.get(0), row.get(1), row.get(2)))
                })
                .await?;
            self.check_commit_setting(&setting)?;
            check_isolation(&isolation)?;
            if v.unwrap_or(0) < latest {
                return Err(StoreError::Db("migrations not applied".into()));
            }
            Ok(())
        })
    }
}
