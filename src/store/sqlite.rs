//! The embedded store: one SQLite file, one gateway instance, zero setup.
//!
//! Same contract as the Postgres store (see `store/mod.rs`), with these mechanics:
//! - One connection, owned by one dedicated thread; every call is a job sent to it, so no
//!   blocking SQLite call ever runs on an async worker. A job carries its deadline: a job
//!   still queued when its caller gave up is skipped, never run late (a late claim would
//!   leave a key in flight with nobody to forward it). A job that panics (a bug) has its
//!   transaction rolled back and answers its caller [`StoreError::Internal`] (500
//!   `internal`, not 503 `store-unavailable`); the thread keeps serving.
//! - SQLite has one writer, and every call runs in one `BEGIN IMMEDIATE` transaction on the
//!   one connection, so the claim (an `INSERT ... ON CONFLICT DO UPDATE ... WHERE
//!   <claimable> RETURNING`, then a read of the row when nothing was claimed) cannot
//!   interleave with any other write: no check-then-write window exists.
//! - Leases and expiries use the database clock (`unixepoch('subsec')`, in milliseconds).
//! - WAL mode, `synchronous=FULL` (an answer is durable before it is sent), and a bounded
//!   `busy_timeout`.
//! - Waiters are woken in process, right after the finishing transaction commits.
//! - One instance per file: an exclusive lock on `<path>.lock`, held for the store's life;
//!   a second instance is refused with a clear message.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use super::{
    Announce, BoxFuture, Claim, ClaimRequest, Deleted, ExistingRow, FinishRow, GcRun, KeyInfo,
    LeaseToken, ListPage, ListQuery, Outcome, Slot, Store, StoreError,
};
use crate::config::SqliteConfig;
use crate::key::KeyId;
use crate::metrics::StoreMetrics;

/// Migrations of the embedded store, applied in order in one transaction.
/// A migration that mirrors a Postgres one carries its number.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "keys_and_slots",
        include_str!("../../migrations/sqlite/0001_keys_and_slots.sql"),
    ),
    (
        2,
        "slot_limits",
        include_str!("../../migrations/sqlite/0002_slot_limits.sql"),
    ),
];

/// The database clock, in milliseconds since the epoch.
const NOW: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

/// How long a call may wait in the queue before its job starts.
const QUEUE_BOUND: Duration = Duration::from_millis(500);

type Job = Box<dyn FnOnce(&mut Connection) + Send>;

pub struct SqliteStore {
    jobs: mpsc::Sender<(Instant, Job)>,
    bound: Duration,
    /// Where finished keys are announced (set by `start_background`; nothing waits before).
    announce: std::sync::OnceLock<Arc<dyn Announce>>,
    path: PathBuf,
    /// Held (locked) for the store's life: one instance per file.
    _lock: File,
    metrics: StoreMetrics,
}

fn sqlite_error(e: rusqlite::Error) -> StoreError {
    use rusqlite::ErrorCode;
    match e.sqlite_error_code() {
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => StoreError::Timeout,
        Some(ErrorCode::CannotOpen) => StoreError::Connect(e.to_string()),
        _ => StoreError::Db(e.to_string()),
    }
}

impl SqliteStore {
    /// Tells the waiters of `id` (if anyone listens yet) that it was finished.
    fn announce(&self, id: KeyId) {
        if let Some(announce) = self.announce.get() {
            announce.wake(id.as_str());
        }
    }

    /// Opens (creating if needed) the file, takes the instance lock, sets WAL mode and
    /// starts the store thread.
    pub fn open(cfg: &SqliteConfig) -> Result<SqliteStore, StoreError> {
        if let Some(dir) = cfg.path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir).map_err(|e| {
                StoreError::Connect(format!("cannot create {}: {e}", dir.display()))
            })?;
        }
        let lock_path = lock_path(&cfg.path);
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| {
                StoreError::Connect(format!("cannot open {}: {e}", lock_path.display()))
            })?;
        if lock.try_lock().is_err() {
            return Err(StoreError::Connect(format!(
                "another idemgate instance is using {} (it holds {}); the embedded store serves \
                 one instance: stop the other one, or use the Postgres store for several. While \
                 `serve` runs, list, show or delete keys through its admin API (`GET /v1/keys`, \
                 `GET` or `DELETE /v1/keys?scope=...&key=...` on `admin.listen`); it collects expired keys \
                 itself every `store.gc.interval`",
                cfg.path.display(),
                lock_path.display()
            )));
        }
        let mut conn = Connection::open(&cfg.path).map_err(sqlite_error)?;
        conn.busy_timeout(cfg.busy_timeout).map_err(sqlite_error)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(sqlite_error)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(sqlite_error)?;
        conn.set_prepared_statement_cache_capacity(32);
        let (tx, rx) = mpsc::channel::<(Instant, Job)>();
        std::thread::Builder::new()
            .name("idemgate-sqlite".into())
            .spawn(move || {
                while let Ok((deadline, job)) = rx.recv() {
                    if Instant::now() <= deadline {
                        // Jobs catch their own panics (`call_inner`); this keeps the thread
                        // serving even if one did not.
                        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            job(&mut conn)
                        }));
                        if ran.is_err() {
                            tracing::error!("a job on the embedded store's thread panicked");
                        }
                    }
                    // A job past its deadline is dropped unrun; its caller already answered.
                }
            })
            .map_err(|e| StoreError::Connect(format!("cannot start the store thread: {e}")))?;
        Ok(SqliteStore {
            jobs: tx,
            bound: cfg.busy_timeout + QUEUE_BOUND,
            announce: std::sync::OnceLock::new(),
            path: cfg.path.clone(),
            _lock: lock,
            metrics: StoreMetrics::default(),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the store thread in one IMMEDIATE transaction, bounded in time.
    async fn call<T, F>(&self, op: &'static str, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Transaction<'_>) -> rusqlite::Result<T> + Send + 'static,
    {
        self.metrics.timed(op, self.call_inner(f)).await
    }

    async fn call_inner<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Transaction<'_>) -> rusqlite::Result<T> + Send + 'static,
    {
        let (otx, orx) = tokio::sync::oneshot::channel();
        let deadline = Instant::now() + QUEUE_BOUND;
        let job: Job = Box::new(move |conn| {
            if otx.is_closed() {
                return; // the caller is gone: do not claim (or write) on its behalf
            }
            // A panic inside the call rolls its transaction back (the transaction is dropped
            // while unwinding) and answers the caller with an internal error; the thread and
            // its connection keep serving.
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let v = f(&tx)?;
                tx.commit()?;
                Ok(v)
            }))
            .unwrap_or_else(|panic| Err(Panicked(panic_text(panic.as_ref()))));
            let _ = otx.send(result);
        });
        self.jobs
            .send((deadline, job))
            .map_err(|_| StoreError::Connect("the store thread has stopped".into()))?;
        match tokio::time::timeout(self.bound, orx).await {
            Err(_) => Err(StoreError::Timeout),
            // Dropped unrun: it waited in the queue past its deadline.
            Ok(Err(_)) => Err(StoreError::AcquireTimeout),
            Ok(Ok(r)) => r.map_err(|e| match e {
                Panicked(why) => StoreError::Internal(why),
                CallError::Sqlite(e) => sqlite_error(e),
            }),
        }
    }
}

/// How a job on the store thread failed: SQLite said no, or the job panicked.
enum CallError {
    Sqlite(rusqlite::Error),
    Panicked(String),
}
use CallError::Panicked;

impl From<rusqlite::Error> for CallError {
    fn from(e: rusqlite::Error) -> CallError {
        CallError::Sqlite(e)
    }
}

/// The message of a panic, when it has one.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

fn lock_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".lock");
    PathBuf::from(p)
}

fn migrate(tx: &rusqlite::Transaction<'_>) -> rusqlite::Result<usize> {
    tx.execute_batch(
        "CREATE TABLE IF NOT EXISTS idemgate_migrations (
            version INTEGER PRIMARY KEY, name TEXT NOT NULL,
            applied_at INTEGER NOT NULL DEFAULT (unixepoch()))",
    )?;
    let mut applied = 0;
    for (version, name, sql) in MIGRATIONS {
        let done: bool = tx.query_row(
            "SELECT EXISTS (SELECT 1 FROM idemgate_migrations WHERE version = ?1)",
            [version],
            |r| r.get(0),
        )?;
        if !done {
            tx.execute_batch(sql)?;
            tx.execute(
                "INSERT INTO idemgate_migrations (version, name) VALUES (?1, ?2)",
                params![version, name],
            )?;
            applied += 1;
        }
    }
    Ok(applied)
}

/// The claim of `store/postgres/`, in SQLite's dialect; see the module docs for why two
/// statements in one IMMEDIATE transaction are as atomic as one.
/// `?8` is the clock, read once for the whole claim, so the insert and the read that may
/// follow it agree on what has expired.
const CLAIM_SQL: &str = "INSERT INTO idemgate_keys AS k
            (scope, key, route, fingerprint, state, lease_token, lease_expires_at, attempts,
             created_at, expires_at)
         VALUES (?1, ?2, ?3, ?4, 'in_flight', lower(hex(randomblob(16))), ?8 + ?5, 1,
                 ?8, ?8 + ?6)
         ON CONFLICT (scope, key) DO UPDATE SET
            route = excluded.route,
            fingerprint = excluded.fingerprint,
            state = 'in_flight',
            lease_token = excluded.lease_token,
            lease_expires_at = excluded.lease_expires_at,
            attempts = CASE WHEN k.state = 'in_flight' AND k.expires_at > ?8
                            THEN k.attempts + 1 ELSE 1 END,
            status = NULL, headers = NULL, body = NULL,
            created_at = excluded.created_at,
            completed_at = NULL,
            expires_at = excluded.expires_at
         WHERE k.expires_at <= ?8
            OR (NOT ?7 AND k.state = 'in_flight' AND k.lease_expires_at <= ?8
                AND k.fingerprint = excluded.fingerprint)
         RETURNING lease_token, attempts";

const EXISTING_SQL: &str = "SELECT state, fingerprint, status, headers, body,
                state = 'in_flight' AND lease_expires_at <= ?3,
                max(0, coalesce(lease_expires_at, 0) - ?3),
                max(0, expires_at - ?3)
           FROM idemgate_keys WHERE scope = ?1 AND key = ?2";

fn decode_existing(
    fp: &[u8; 32],
    row: &rusqlite::Row<'_>,
) -> rusqlite::Result<Result<Claim, StoreError>> {
    let state: String = row.get(0)?;
    let fingerprint: Vec<u8> = row.get(1)?;
    Ok(ExistingRow {
        state: &state,
        fingerprint: &fingerprint,
        status: row.get(2)?,
        headers: row.get(3)?,
        body: row.get(4)?,
        lease_expired: row.get(5)?,
        lease_remaining_ms: row.get(6)?,
        expires_in_ms: row.get(7)?,
    }
    .decide(fp))
}

impl Store for SqliteStore {
    fn claim<'a>(&'a self, req: ClaimRequest<'a>) -> BoxFuture<'a, Result<Claim, StoreError>> {
        let (scope, key, route) = (
            req.scope.to_string(),
            req.key.to_string(),
            req.route.to_string(),
        );
        let fp = *req.fingerprint;
        let (lease, ttl) = (req.lease.as_millis() as i64, req.ttl.as_millis() as i64);
        let hold = req.hold_expired_leases;
        Box::pin(async move {
            self.call("claim", move |tx| {
                let now: i64 = tx.query_row(&format!("SELECT {NOW}"), [], |r| r.get(0))?;
                let claimed = tx
                    .prepare_cached(CLAIM_SQL)?
                    .query_row(
                        params![scope, key, route, &fp[..], lease, ttl, hold, now],
                        |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)),
                    )
                    .optional()?;
                if let Some((token, attempts)) = claimed {
                    return Ok(Ok(Claim::Acquired {
                        token: LeaseToken(token),
                        took_over: attempts > 1,
                    }));
                }
                tx.prepare_cached(EXISTING_SQL)?
                    .query_row(params![scope, key, now], |r| decode_existing(&fp, r))
            })
            .await?
        })
    }

    fn finish<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        token: &'a LeaseToken,
        outcome: Outcome,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let (s, k, t) = (scope.to_string(), key.to_string(), token.0.clone());
        let ttl = ttl.as_millis() as i64;
        Box::pin(async move {
            let n = self
                .call("finish", move |tx| {
                    let fence =
                        "scope = ?1 AND key = ?2 AND lease_token = ?3 AND state = 'in_flight'";
                    if let Outcome::Release = &outcome {
                        return tx.execute(
                            &format!("DELETE FROM idemgate_keys WHERE {fence}"),
                            params![s, k, t],
                        );
                    }
                    let FinishRow {
                        state,
                        status,
                        headers,
                        body,
                    } = FinishRow::of(&outcome);
                    tx.prepare_cached(&format!(
                        "UPDATE idemgate_keys
                            SET state = ?4, status = ?5, headers = ?6, body = ?7,
                                lease_token = NULL, lease_expires_at = NULL,
                                completed_at = {NOW}, expires_at = {NOW} + ?8
                          WHERE {fence}"
                    ))?
                    .execute(params![s, k, t, state, status, headers, body, ttl])
                })
                .await?;
            if n == 1 {
                self.announce(KeyId::of(scope, key));
            }
            Ok(n == 1)
        })
    }

    fn inspect<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyInfo>, StoreError>> {
        let (s, k) = (scope.to_string(), key.to_string());
        Box::pin(async move {
            self.call("inspect", move |tx| {
                tx.query_row(
                    &format!(
                        "SELECT {} FROM idemgate_keys WHERE scope = ?1 AND key = ?2",
                        list::key_info_columns("length(body)", NOW)
                    ),
                    params![s, k],
                    list::key_info,
                )
                .optional()
            })
            .await
        })
    }

    fn list<'a>(&'a self, q: &'a ListQuery) -> BoxFuture<'a, Result<ListPage, StoreError>> {
        let q = q.clone();
        Box::pin(async move { self.call("list", move |tx| list::page(tx, &q, NOW)).await })
    }

    fn delete<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        force: bool,
    ) -> BoxFuture<'a, Result<Deleted, StoreError>> {
        let (s, k) = (scope.to_string(), key.to_string());
        Box::pin(async move {
            // One write transaction: the read and the delete see the same row.
            let done = self
                .call("delete", move |tx| {
                    let found: Option<(String, bool)> = tx
                        .query_row(
                            &format!(
                                "SELECT route, state = 'in_flight' AND coalesce(lease_expires_at > {NOW}, 0)
                                   FROM idemgate_keys WHERE scope = ?1 AND key = ?2"
                            ),
                            params![s, k],
                            |r| Ok((r.get(0)?, r.get(1)?)),
                        )
                        .optional()?;
                    let Some((route, live)) = found else {
                        return Ok(Deleted::NotFound);
                    };
                    if live && !force {
                        return Ok(Deleted::InFlight);
                    }
                    tx.execute(
                        "DELETE FROM idemgate_keys WHERE scope = ?1 AND key = ?2",
                        params![s, k],
                    )?;
                    Ok(Deleted::Yes {
                        route,
                        live_lease: live,
                    })
                })
                .await?;
            if matches!(done, Deleted::Yes { .. }) {
                self.announce(KeyId::of(scope, key));
            }
            Ok(done)
        })
    }

    fn gc(&self, batch: usize) -> BoxFuture<'_, Result<GcRun, StoreError>> {
        let batch = i64::try_from(batch.max(1)).unwrap_or(i64::MAX);
        Box::pin(async move {
            let mut deleted = 0u64;
            loop {
                // One short transaction per batch, so claims are not held up for long.
                let n = self
                    .call("gc", move |tx| {
                        tx.execute(
                            &format!(
                                "DELETE FROM idemgate_keys WHERE (scope, key) IN
                                   (SELECT scope, key FROM idemgate_keys
                                     WHERE expires_at <= {NOW} ORDER BY expires_at LIMIT ?1)"
                            ),
                            [batch],
                        )
                    })
                    .await?;
                deleted += n as u64;
                if (n as i64) < batch {
                    return Ok(GcRun { deleted, ran: true });
                }
            }
        })
    }

    fn acquire_slot<'a>(
        &'a self,
        scope: &'a str,
        max_in_flight: u32,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<Slot>, StoreError>> {
        let s = scope.to_string();
        let lease = lease.as_millis() as i64;
        Box::pin(async move {
            // The rule of `store/postgres/` (`idemgate_take_slot`): the count and the
            // insert run in one IMMEDIATE transaction, and SQLite has one writer, so no other
            // taker can come between them.
            self.call("acquire_slot", move |tx| {
                let now: i64 = tx.query_row(&format!("SELECT {NOW}"), [], |r| r.get(0))?;
                let (live, least): (i64, Option<i64>) = tx
                    .prepare_cached(
                        "SELECT count(*), min(max_in_flight) FROM idemgate_slots
                          WHERE scope = ?1 AND lease_expires_at > ?2",
                    )?
                    .query_row(params![s, now], |r| Ok((r.get(0)?, r.get(1)?)))?;
                let limit = i64::from(max_in_flight);
                if live + 1 > limit || live + 1 > least.unwrap_or(limit) {
                    return Ok(None);
                }
                // The lowest number no live slot holds (one of 0..=live is free).
                let slot: i64 = tx
                    .prepare_cached(
                        "WITH RECURSIVE g(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM g WHERE n < ?3)
                         SELECT n FROM g
                          WHERE NOT EXISTS (SELECT 1 FROM idemgate_slots s
                                             WHERE s.scope = ?1 AND s.slot = g.n
                                               AND s.lease_expires_at > ?2)
                          ORDER BY n LIMIT 1",
                    )?
                    .query_row(params![s, now, live], |r| r.get(0))?;
                let token: String = tx
                    .prepare_cached(
                        "INSERT INTO idemgate_slots (scope, slot, token, lease_expires_at, max_in_flight)
                         VALUES (?1, ?2, lower(hex(randomblob(16))), ?3 + ?4, ?5)
                         ON CONFLICT (scope, slot) DO UPDATE
                            SET token = excluded.token,
                                lease_expires_at = excluded.lease_expires_at,
                                max_in_flight = excluded.max_in_flight
                         RETURNING token",
                    )?
                    .query_row(params![s, slot, now, lease, limit], |r| r.get(0))?;
                Ok(Some(Slot {
                    scope: s,
                    slot: slot as i32,
                    token,
                }))
            })
            .await
        })
    }

    fn release_slot<'a>(&'a self, slot: &'a Slot) -> BoxFuture<'a, Result<bool, StoreError>> {
        let (s, n, t) = (slot.scope.clone(), slot.slot, slot.token.clone());
        Box::pin(async move {
            let done = self
                .call("release_slot", move |tx| {
                    tx.execute(
                        "DELETE FROM idemgate_slots WHERE scope = ?1 AND slot = ?2 AND token = ?3",
                        params![s, n, t],
                    )
                })
                .await?;
            self.announce(KeyId::slots(&slot.scope));
            Ok(done == 1)
        })
    }

    fn migrate(&self) -> BoxFuture<'_, Result<usize, StoreError>> {
        Box::pin(self.call("migrate", migrate))
    }

    fn metrics(&self) -> &StoreMetrics {
        &self.metrics
    }

    fn start_background(&self, announce: Arc<dyn Announce>) {
        // In-process announcements always flow.
        announce.set_healthy(true);
        let _ = self.announce.set(announce);
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let latest = MIGRATIONS.iter().map(|m| m.0).max().unwrap_or(0);
            let v: i64 = self
                .call("ready", |tx| {
                    tx.query_row(
                        "SELECT coalesce(max(version), 0) FROM idemgate_migrations",
                        [],
                        |r| r.get(0),
                    )
                })
                .await?;
            if v < i64::from(latest) {
                return Err(StoreError::Db("migrations not applied".into()));
            }
            Ok(())
        })
    }
}

mod list;
#[cfg(test)]
mod tests;
