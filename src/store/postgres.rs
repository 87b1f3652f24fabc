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
//!   the same moment are written together (`batch_keys`, see [`super::pg_batch`]): one
//!   statement and one commit for several keys, each key with its own answer. The batched
//!   claim (`CLAIM_NEW_BATCH_SQL`) is the plain insert for several rows; a key it did not
//!   insert exists and goes to the full claim, alone, as after the plain insert (a second
//!   request for a key already in the batch goes there at once: the unique index orders it
//!   with the insert). The batched completion (`FINISH_BATCH_SQL`) is the fenced completion
//!   for several rows, each fenced by its own lease token, and it names each key it wrote. A
//!   batch of one sends the single-key statement. A key appears once per batch, and a batch
//!   is sorted by key, so concurrent batched inserts take their keys in one order; the rows
//!   of a batched completion are locked in its plan's order, and two completion batches
//!   share a key only when two attempts of one key end at once. A batch chosen as a
//!   deadlock's victim leaves every key to its single statement. The batched completion is
//!   planned at every call (unnamed): it joins the keys table, and a plan cached while the
//!   table was small would scan it whole once it is large.
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

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};

use super::pg_connect::{Connector, PoolerKind};
use tokio_postgres::config::SslMode;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::pg_batch::{Item, Limits, Queue, Waiting, answer_all};
use super::{
    Announce, BoxFuture, Claim, ClaimRequest, Deleted, ExistingRow, FinishRow, GcRun, KeyInfo,
    LeaseToken, Outcome, Slot, Store, StoreError,
};
use crate::config::{PgTlsMode, Pooler, PostgresConfig};
use crate::fingerprint::hex;
use crate::key::KeyId;
use crate::metrics::StoreMetrics;

use super::pg_migrate::BACKFILL_GC_AFTER_SQL;
pub use super::pg_migrate::{MIGRATIONS, OnlineRun};

/// The claim of a new key, the common case: a plain insert, nothing when the key exists
/// (then [`CLAIM_SQL`] decides). `gc_after` is the claim time + ttl: a completion, later,
/// sets `expires_at` to its own time + ttl, so `gc_after <= expires_at` always.
/// `$5` and `$6` are bound from integers, never NULL, so the row always has its lease.
pub const CLAIM_NEW_SQL: &str = "
INSERT INTO idemgate_keys
    (scope, key, route, fingerprint, state, lease_token, lease_expires_at, attempts,
     created_at, expires_at, gc_after)
VALUES ($1, $2, $3, $4, 'in_flight', gen_random_uuid(),
        now() + $5::bigint * interval '1 millisecond', 1,
        now(), now() + $6::bigint * interval '1 millisecond',
        now() + $6::bigint * interval '1 millisecond')
ON CONFLICT (scope, key) DO NOTHING
RETURNING lease_token::text";
pub const CLAIM_NEW_TYPES: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::BYTEA,
    Type::INT8,
    Type::INT8,
];

/// [`CLAIM_NEW_SQL`] as a function call (migrations/0006_pooler_functions.sql), for a pooler
/// in transaction mode: the function's plan is cached per server session, which the pooler
/// keeps, where the statement itself would be parsed and planned on every call.
const CLAIM_NEW_CALL: &str = "SELECT idemgate_claim_new($1, $2, $3, $4, $5, $6)";

/// [`CLAIM_NEW_SQL`] for several keys in one statement and one commit (the rows of the
/// arrays, in order, one key once), sent only for two keys or more. Each key inserted comes
/// back with its lease token; a key that does not come back exists, and the full claim
/// ([`CLAIM_SQL`]) decides it.
const CLAIM_NEW_BATCH_SQL: &str = "
INSERT INTO idemgate_keys
    (scope, key, route, fingerprint, state, lease_token, lease_expires_at, attempts,
     created_at, expires_at, gc_after)
SELECT v.scope, v.key, v.route, v.fingerprint, 'in_flight', gen_random_uuid(),
       now() + v.lease_ms * interval '1 millisecond', 1,
       now(), now() + v.ttl_ms * interval '1 millisecond',
       now() + v.ttl_ms * interval '1 millisecond'
  FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::bigint[], $6::bigint[])
       AS v(scope, key, route, fingerprint, lease_ms, ttl_ms)
ON CONFLICT (scope, key) DO NOTHING
RETURNING scope, key, lease_token::text";
const CLAIM_NEW_BATCH_TYPES: &[Type] = &[
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::BYTEA_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
];

/// A look at a key that exists, written nothing: what [`CLAIM_SQL`] would answer for a row
/// it does not take over (the same columns), and whether it would take it over
/// (`claimable`). A replay, a mismatch, a key in flight or held is answered from this read
/// alone: no row lock, no transaction id, no WAL, no commit to wait for. Only a claimable
/// row goes on to [`CLAIM_SQL`], which locks it.
const LOOK_SQL: &str = "
SELECT k.state, NULL::text AS token, k.attempts, k.fingerprint, k.status, k.headers, k.body,
       k.state = 'in_flight' AND k.lease_expires_at <= now() AS lease_expired,
       greatest(0, ceil(extract(epoch FROM k.lease_expires_at - now()) * 1000))::bigint
           AS lease_remaining_ms,
       false AS stale,
       greatest(0, floor(extract(epoch FROM k.expires_at - now()) * 1000))::bigint
           AS expires_in_ms,
       k.expires_at <= now()
         OR (NOT $4 AND k.state = 'in_flight' AND k.lease_expires_at <= now()
             AND k.fingerprint = $3) AS claimable
  FROM idemgate_keys k
 WHERE k.scope = $1 AND k.key = $2";
const LOOK_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::BYTEA, Type::BOOL];

/// The claim when the key exists: takes it over when claimable, or reads what is there.
const CLAIM_SQL: &str = "
WITH claimed AS (
    INSERT INTO idemgate_keys AS k
        (scope, key, route, fingerprint, state, lease_token, lease_expires_at, attempts,
         created_at, expires_at, gc_after)
    VALUES ($1, $2, $3, $4, 'in_flight', gen_random_uuid(),
            now() + $5::bigint * interval '1 millisecond', 1,
            now(), now() + $6::bigint * interval '1 millisecond',
            now() + $6::bigint * interval '1 millisecond')
    ON CONFLICT (scope, key) DO UPDATE SET
        route = EXCLUDED.route,
        fingerprint = EXCLUDED.fingerprint,
        state = 'in_flight',
        lease_token = EXCLUDED.lease_token,
        lease_expires_at = EXCLUDED.lease_expires_at,
        attempts = CASE WHEN k.state = 'in_flight' AND k.expires_at > now()
                        THEN k.attempts + 1 ELSE 1 END,
        status = NULL, headers = NULL, body = NULL, waiters = false,
        created_at = EXCLUDED.created_at,
        completed_at = NULL,
        expires_at = EXCLUDED.expires_at,
        gc_after = EXCLUDED.gc_after
    WHERE k.expires_at <= now()
       OR (NOT $7 AND k.state = 'in_flight' AND k.lease_expires_at <= now()
           AND k.fingerprint = EXCLUDED.fingerprint)
    RETURNING k.lease_token, k.attempts
)
SELECT 'claimed' AS state, c.lease_token::text AS token, c.attempts,
       NULL::bytea AS fingerprint, NULL::integer AS status,
       NULL::bytea AS headers, NULL::bytea AS body, false AS lease_expired,
       0::bigint AS lease_remaining_ms, false AS stale, 0::bigint AS expires_in_ms
  FROM claimed c
UNION ALL
SELECT k.state, NULL, k.attempts, k.fingerprint, k.status, k.headers, k.body,
       k.state = 'in_flight' AND k.lease_expires_at <= now(),
       greatest(0, ceil(extract(epoch FROM k.lease_expires_at - now()) * 1000))::bigint,
       -- The version our snapshot sees would have been claimable: a concurrent claim
       -- committed a newer one that the INSERT saw and this SELECT cannot. Look again.
       k.expires_at <= now()
         OR (NOT $7 AND k.state = 'in_flight' AND k.lease_expires_at <= now()
             AND k.fingerprint = $4),
       greatest(0, floor(extract(epoch FROM k.expires_at - now()) * 1000))::bigint
  FROM idemgate_keys k
 WHERE k.scope = $1 AND k.key = $2
   AND NOT EXISTS (SELECT 1 FROM claimed)";
const CLAIM_TYPES: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::BYTEA,
    Type::INT8,
    Type::INT8,
    Type::BOOL,
];

/// The channel on which finished keys are announced; the payload is a [`KeyId`].
pub const CHANNEL: &str = "idemgate_keys";

/// The completion of a claimed attempt, fenced by its lease token.
///
/// Every write that ends an attempt announces it in the same statement (one round trip) when
/// someone waits for the key (`waiters`, set by `WATCH_SQL`); NOTIFY is transactional, so
/// waiters hear of it only once it is committed. A row back means the row was written; none:
/// the lease was lost, nothing written, nothing announced.
///
/// It writes no indexed column (so it can be a HOT update), and it guards the row's
/// invariants itself: `state` becomes `completed` only with status, headers and body, or
/// `not_replayable` or `unknown`; anything else makes it NULL, which the NOT NULL on `state`
/// refuses (the statement fails and writes nothing). The row it leaves has no lease.
pub const FINISH_SQL: &str = "
UPDATE idemgate_keys
   SET state = CASE
           WHEN $4::text = 'completed'
                AND $5::integer IS NOT NULL AND $6::bytea IS NOT NULL AND $7::bytea IS NOT NULL
               THEN 'completed'
           WHEN $4::text IN ('not_replayable', 'unknown') THEN $4::text
       END,
       status = $5, headers = $6, body = $7,
       lease_token = NULL, lease_expires_at = NULL, completed_at = now(),
       expires_at = now() + $8::bigint * interval '1 millisecond'
 WHERE scope = $1 AND key = $2 AND lease_token = $3::text::uuid AND state = 'in_flight'
RETURNING CASE WHEN waiters THEN pg_notify('idemgate_keys', $9) END AS announced";
pub const FINISH_TYPES: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::INT4,
    Type::BYTEA,
    Type::BYTEA,
    Type::INT8,
    Type::TEXT,
];

/// [`FINISH_SQL`] as a function call (migrations/0006), for a pooler in transaction mode;
/// one row back, `true` when the row was written.
const FINISH_CALL: &str = "SELECT idemgate_finish($1, $2, $3, $4, $5, $6, $7, $8, $9)";

/// [`FINISH_SQL`] for several keys in one statement and one commit (one key once), sent only
/// for two keys or more: each key is fenced by its own lease token and guarded the same way,
/// and each key written comes back (announced when someone waits for it).
const FINISH_BATCH_SQL: &str = "
UPDATE idemgate_keys k
   SET state = CASE
           WHEN v.state = 'completed'
                AND v.status IS NOT NULL AND v.headers IS NOT NULL AND v.body IS NOT NULL
               THEN 'completed'
           WHEN v.state IN ('not_replayable', 'unknown') THEN v.state
       END,
       status = v.status, headers = v.headers, body = v.body,
       lease_token = NULL, lease_expires_at = NULL, completed_at = now(),
       expires_at = now() + v.ttl_ms * interval '1 millisecond'
  FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::integer[], $6::bytea[],
              $7::bytea[], $8::bigint[], $9::text[])
       AS v(scope, key, token, state, status, headers, body, ttl_ms, id)
 WHERE k.scope = v.scope AND k.key = v.key AND k.lease_token = v.token::uuid
   AND k.state = 'in_flight'
RETURNING k.scope, k.key, CASE WHEN k.waiters THEN pg_notify('idemgate_keys', v.id) END";
const FINISH_BATCH_TYPES: &[Type] = &[
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::INT4_ARRAY,
    Type::BYTEA_ARRAY,
    Type::BYTEA_ARRAY,
    Type::INT8_ARRAY,
    Type::TEXT_ARRAY,
];

/// The release of a claimed attempt (a retry forwards again), announced like a completion.
const RELEASE_SQL: &str = "
DELETE FROM idemgate_keys
 WHERE scope = $1 AND key = $2 AND lease_token = $3::text::uuid AND state = 'in_flight'
RETURNING CASE WHEN waiters THEN pg_notify('idemgate_keys', $4) END AS announced";
const RELEASE_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::TEXT, Type::TEXT];

/// A waiter asks to be told when the key is finished. The first one sets `waiters`: the row
/// lock orders it against the finishing write, so either the finisher sees `waiters` and
/// announces, or this statement sees the row no longer in flight (no row back) and the
/// waiter looks again at once. Once `waiters` is set (committed), later waiters only read
/// it: the finisher will announce, and the row is not written again for each look.
const WATCH_SQL: &str = "
WITH asked AS (
    UPDATE idemgate_keys SET waiters = true
     WHERE scope = $1 AND key = $2 AND state = 'in_flight' AND NOT waiters
    RETURNING 1
)
SELECT 1 FROM asked
UNION ALL
SELECT 1 FROM idemgate_keys
 WHERE scope = $1 AND key = $2 AND state = 'in_flight' AND waiters
   AND NOT EXISTS (SELECT 1 FROM asked)";
const WATCH_TYPES: &[Type] = &[Type::TEXT, Type::TEXT];

/// Takes a slot of a scope for a route with limit `$2`, in one round trip: the function
/// (migrations/0004_slot_limits.sql) decides under a per-scope transaction lock, so takers on
/// every instance are ordered and none can miss another. No row back: the scope is full for
/// this route (counting itself, more than `$2` live slots, or more than some live holder's
/// limit).
const SLOT_ACQUIRE_SQL: &str = "SELECT slot, token FROM idemgate_take_slot($1, $2, $3)";
const SLOT_ACQUIRE_TYPES: &[Type] = &[Type::TEXT, Type::INT4, Type::INT8];

/// Frees a slot we hold (fenced by its token) and announces it to the scope's waiters.
const SLOT_RELEASE_SQL: &str = "
WITH done AS (
    DELETE FROM idemgate_slots
     WHERE scope = $1 AND slot = $2 AND token = $3::text::uuid
    RETURNING 1
)
SELECT pg_notify('idemgate_keys', $4) FROM done";
const SLOT_RELEASE_TYPES: &[Type] = &[Type::TEXT, Type::INT4, Type::TEXT, Type::TEXT];

/// The session's `synchronous_commit`, as `SHOW synchronous_commit` reports it, on a pooled
/// connection: what the gateway's role and database are set to (`ALTER ROLE/DATABASE ...
/// SET`) on top of the server's default.
/// The durability setting and the isolation the session's transactions get by default.
const SYNC_COMMIT_SQL: &str = "
SELECT current_setting('synchronous_commit'), current_setting('default_transaction_isolation')";
/// Streaming standbys that are not synchronous: a failover to one of them can lose commits
/// a client was already answered from. A role without `pg_monitor` sees no `sync_state`
/// (NULL), and such a standby counts as asynchronous.
const ASYNC_STANDBYS_SQL: &str = "
SELECT count(*) FROM pg_stat_replication
 WHERE sync_state IS DISTINCT FROM 'sync' AND sync_state IS DISTINCT FROM 'quorum'";

/// Readiness in one round trip: the schema version, the durability setting, the isolation.
const READY_SQL: &str = "
SELECT (SELECT max(version) FROM idemgate_migrations), current_setting('synchronous_commit'),
       current_setting('default_transaction_isolation')";

const INSPECT_SQL: &str = "
SELECT scope, key, route, state, status, attempts, length(body) AS body_bytes,
       created_at::text, completed_at::text, lease_expires_at::text, expires_at::text,
       fingerprint
  FROM idemgate_keys WHERE scope = $1 AND key = $2";
const INSPECT_TYPES: &[Type] = &[Type::TEXT, Type::TEXT];

/// The advisory lock that lets one instance at a time collect expired rows.
const GC_LOCK: i64 = 0x1de0_6a7e_0002;

/// One batch of expired rows, by full key (so it works on a table partitioned by scope);
/// rows locked by a concurrent claim are skipped, not waited for. Found by the index on
/// `gc_after` (never later than `expires_at`); only rows whose `expires_at` passed go.
const GC_SQL: &str = "
DELETE FROM idemgate_keys
 WHERE (scope, key) IN (SELECT scope, key FROM idemgate_keys
                         WHERE gc_after <= now() AND expires_at <= now()
                         ORDER BY gc_after
                         LIMIT $1
                           FOR UPDATE SKIP LOCKED)";

/// The slot rows of `serialize` holders that crashed (a released slot is deleted by its
/// holder): a minute past its lease, such a row is only ever taken over in its scope again,
/// and a scope that never comes back would keep it forever. Deleting one changes no live count.
const GC_SLOTS_SQL: &str = "
DELETE FROM idemgate_slots
 WHERE (scope, slot) IN (SELECT scope, slot FROM idemgate_slots
                          WHERE lease_expires_at <= now() - interval '1 minute'
                          LIMIT $1
                            FOR UPDATE SKIP LOCKED)";

/// An operator's delete: the row is locked and read, then deleted unless it is in flight
/// under a live lease and `$3` (force) is false; the deletion is announced. One row back
/// when the key exists: its route, whether its lease was live, whether it was deleted.
const DELETE_SQL: &str = "
WITH target AS (
    SELECT route, coalesce(state = 'in_flight' AND lease_expires_at > now(), false) AS live
      FROM idemgate_keys WHERE scope = $1 AND key = $2
       FOR UPDATE
),
done AS (
    DELETE FROM idemgate_keys k USING target t
     WHERE k.scope = $1 AND k.key = $2 AND ($3 OR NOT t.live)
    RETURNING 1
),
announced AS (SELECT pg_notify('idemgate_keys', $4) FROM done)
SELECT t.route, t.live, (SELECT count(*) FROM done) > 0, (SELECT count(*) FROM announced)
  FROM target t";
const DELETE_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::BOOL, Type::TEXT];

/// What one claim's statements found: a new key claimed by the plain insert, or the full
/// statement's row (none: look again, see the module docs).
enum Found {
    New(LeaseToken),
    Existing(Option<tokio_postgres::Row>),
}

pub struct PgStore {
    /// What a statement on a pooled connection needs; shared with the batch dispatchers.
    db: Arc<Db>,
    /// The wake-up listener's own connection (`listen_url`, a direct session).
    listen: tokio_postgres::Config,
    listener: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// `store.postgres.allow_async_commit`.
    allow_async_commit: bool,
    /// The queues of new-key claims and completions (see [`super::pg_batch`]); `None` with
    /// `batch_keys: 1`, where every key runs its own statements on its own connection.
    batches: Option<Batches>,
}

/// The pool and how statements on it are sent and bounded.
pub(super) struct Db {
    pool: Pool,
    /// The pool's connection config (`url`), for cancel requests.
    pg: tokio_postgres::Config,
    /// What `url` points at (configured or learned by the first connection, see
    /// [`super::pg_connect`]); decides how statements are sent and bounded.
    pub(super) pooler: Arc<PoolerKind>,
    pub(super) acquire_timeout: Duration,
    statement_timeout: Duration,
    pub(super) metrics: StoreMetrics,
    /// The TLS connector (`tls.mode` require or verify-full), shared with the listener.
    tls: Option<MakeRustlsConnect>,
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

/// Client-side slack on top of the statement timeout: for the server's own timeout to
/// arrive first (direct session), or for a cancelled statement to end (behind a pooler).
const CLIENT_SLACK: Duration = Duration::from_millis(200);

/// How a bounded call on a pooled connection ended.
enum Ended<T> {
    /// Within the bound: the connection goes back to the pool.
    Done(Result<T, tokio_postgres::Error>),
    /// Past the bound: the connection is detached, never reused; closed at once, or, when a
    /// cancel request was sent for it, once the request was acted on (see `pg_cancel`).
    Detach(
        Result<T, StoreError>,
        Option<tokio::task::JoinHandle<Option<super::pg_cancel::Forwarded>>>,
    ),
}

/// A pooled connection and how statements are sent on it (see the module docs).
pub struct Conn<'a> {
    obj: &'a Object,
    pooler: Pooler,
}

impl Conn<'_> {
    /// A hot statement: prepared once per connection on a direct session, unnamed (one round
    /// trip, parsed and planned each time) behind a pooler in transaction mode.
    async fn query(
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
    async fn query_opt(
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
    async fn claim_new(
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
    async fn finish_one(
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
    async fn unnamed(
        &self,
        sql: &str,
        types: &[Type],
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        self.obj.query_typed(sql, &typed(params, types)).await
    }

    /// A rare statement without parameters, unnamed whatever the pooler.
    async fn unnamed_one(&self, sql: &str) -> Result<tokio_postgres::Row, tokio_postgres::Error> {
        self.obj.query_typed_one(sql, &[]).await
    }
}

/// Parameters paired with their types, as `query_typed` takes them.
fn typed<'a>(
    params: &[&'a (dyn ToSql + Sync)],
    types: &[Type],
) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
    debug_assert_eq!(params.len(), types.len(), "one type per parameter");
    params.iter().copied().zip(types.iter().cloned()).collect()
}

/// Classifies by `SqlState`, severity and error source, never by message text.
fn pg_error(e: tokio_postgres::Error) -> StoreError {
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
        let mut why = crate::forward::error_chain(&e);
        // PgBouncer refuses the `options` startup parameter that a direct session sends:
        // say which field fixes it (the classification above never reads the message).
        if super::pg_connect::refused_options(&e) {
            why.push_str(
                " (is store.postgres.url a pooler in transaction mode? set \
                 store.postgres.pooler: transaction)",
            );
        }
        return StoreError::Connect(why);
    }
    StoreError::Db(crate::forward::error_chain(&e))
}

impl Db {
    async fn conn(&self) -> Result<Object, StoreError> {
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
        let started = std::time::Instant::now();
        let result = self.unobserved(f).await;
        self.metrics.observe(op, started.elapsed());
        result
    }

    /// [`with_conn`](Self::with_conn) without recording its latency: for a call whose caller
    /// records the whole operation once (a claim's statements, a completion after its batch).
    async fn unobserved<T>(
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
    /// which forwards it to the server session that runs it; see [`super::pg_cancel`]). Yields
    /// the signal that it was acted on, or nothing if it could not be sent.
    fn cancel(
        &self,
        obj: &Object,
    ) -> impl std::future::Future<Output = Option<super::pg_cancel::Forwarded>> + use<> {
        let token = obj.cancel_token();
        let (pg, tls) = (self.pg.clone(), self.tls.clone());
        async move {
            let timeout = pg.get_connect_timeout().copied().unwrap_or(CLIENT_SLACK);
            match super::pg_cancel::cancel(&token, &pg, tls.as_ref(), timeout).await {
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
    async fn begin<'c>(
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
fn keepalive(cfg: &mut tokio_postgres::Config) {
    cfg.keepalives(true);
    cfg.keepalives_idle(Duration::from_secs(30));
    cfg.keepalives_interval(Duration::from_secs(10));
    cfg.keepalives_retries(3);
}

/// Refuses a default isolation other than read committed. A direct session sets its own (a
/// startup option), so this only fails behind a pooler in transaction mode, where the
/// database's or role's default applies: the statements are written for read committed, and
/// under `repeatable read` or `serializable` concurrent claims of one key fail with 40001.
fn check_isolation(isolation: &str) -> Result<(), StoreError> {
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
        // as startup options; a pooler in transaction mode takes none (super::pg_connect).
        let pooled = pg.clone();
        pg.options(super::pg_connect::direct_options(
            cfg.statement_timeout.as_millis(),
        ));
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
            *slot = Some(tokio::spawn(super::pg_listener::run(
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

    /// Applies pending migrations (src/store/pg_migrate.rs): their transaction, on a pooled
    /// connection (with settings of its own, `SET LOCAL`). Returns how many were applied; the
    /// work they leave for later is [`PgStore::migrate_online`]'s.
    pub async fn migrate(&self) -> Result<usize, StoreError> {
        self.migrate_through(i32::MAX).await
    }

    /// [`PgStore::migrate`] up to version `last` only (to build a database as an earlier
    /// release left it).
    pub async fn migrate_through(&self, last: i32) -> Result<usize, StoreError> {
        let mut obj = self.db.conn().await?;
        super::pg_migrate::apply(&mut obj, last).await
    }

    /// The migrations' online work: indexes built concurrently and backfills in batches,
    /// while the gateway serves, on a direct session of its own (`listen_url`). Idempotent;
    /// one instance at a time does it.
    pub async fn migrate_online(&self) -> Result<OnlineRun, StoreError> {
        let client = super::pg_migrate::connect(self.listen.clone(), self.db.tls.clone()).await?;
        super::pg_migrate::online(&client).await
    }

    /// A claim, from the batched insert of a new key (with batches) to the full statement.
    async fn claim_all(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        // With batches, a new key is claimed with the others waiting (one insert for all);
        // a key that exists is left to the full statement, run alone.
        let mut try_new = true;
        if let Some(batches) = &self.batches {
            if let Some(token) = batches.claim_new(req).await? {
                return Ok(Claim::Acquired {
                    token,
                    took_over: false,
                });
            }
            try_new = false;
        }
        // A row committed after our snapshot but before our insert's conflict check makes
        // the statement return nothing (or a stale version): run it again. Five such answers
        // in a row would need five such races; treat that as the store misbehaving. Only the
        // first try can find the key new: a retry follows a row seen.
        for attempt in 0..5 {
            if let Some(claim) = self.claim_once(req, try_new && attempt == 0).await? {
                return Ok(claim);
            }
        }
        Err(StoreError::Db("claim saw no current row five times".into()))
    }

    /// The end of an attempt: a completion goes with the others waiting (with batches); a
    /// release (rare), or a completion handed back by its batch, runs alone.
    async fn finish_all(&self, f: FinishParams<'_>, outcome: Outcome) -> Result<bool, StoreError> {
        let outcome = match (&self.batches, outcome) {
            (_, Outcome::Release) => Outcome::Release,
            (None, outcome) => outcome,
            (Some(batches), outcome) => match batches.finish(f, outcome).await? {
                Finished::Written(written) => return Ok(written),
                Finished::Alone(outcome) => outcome,
            },
        };
        self.db
            .unobserved(async |c| c.finish_one(f, &outcome).await)
            .await
    }

    /// One claim: with `try_new`, first the plain insert of a new key ([`CLAIM_NEW_SQL`]);
    /// when the key exists (or without `try_new`), the full statement ([`CLAIM_SQL`]). Both
    /// run on one connection within one statement bound.
    async fn claim_once(
        &self,
        req: &ClaimRequest<'_>,
        try_new: bool,
    ) -> Result<Option<Claim>, StoreError> {
        let p = NewKeyParams::of(req);
        let found = self
            .db
            .unobserved(async |c| {
                if try_new {
                    let token = c.claim_new(p).await?;
                    if let Some(token) = token {
                        return Ok(Found::New(LeaseToken(token)));
                    }
                }
                // A row that will not be taken over is answered from a read (LOOK_SQL).
                let look = c
                    .query_opt(
                        LOOK_SQL,
                        LOOK_TYPES,
                        &[&p.scope, &p.key, &p.fingerprint, &req.hold_expired_leases],
                    )
                    .await?;
                if let Some(row) = look
                    && !row.get::<_, bool>("claimable")
                {
                    return Ok(Found::Existing(Some(row)));
                }
                c.query_opt(
                    CLAIM_SQL,
                    CLAIM_TYPES,
                    &[
                        &p.scope,
                        &p.key,
                        &p.route,
                        &p.fingerprint,
                        &p.lease_ms,
                        &p.ttl_ms,
                        &req.hold_expired_leases,
                    ],
                )
                .await
                .map(Found::Existing)
            })
            .await?;
        let row = match found {
            Found::New(token) => {
                return Ok(Some(Claim::Acquired {
                    token,
                    took_over: false,
                }));
            }
            Found::Existing(None) => return Ok(None),
            Found::Existing(Some(row)) => row,
        };
        if row.get::<_, bool>("stale") {
            return Ok(None);
        }
        let state: &str = row.get("state");
        if state == "claimed" {
            let attempts: i32 = row.get("attempts");
            return Ok(Some(Claim::Acquired {
                token: LeaseToken(row.get("token")),
                took_over: attempts > 1,
            }));
        }
        ExistingRow {
            state,
            fingerprint: row.get("fingerprint"),
            status: row.get::<_, Option<i32>>("status").map(i64::from),
            headers: row.get("headers"),
            body: row.get("body"),
            lease_expired: row.get("lease_expired"),
            lease_remaining_ms: row.get("lease_remaining_ms"),
            expires_in_ms: row.get("expires_in_ms"),
        }
        .decide(p.fingerprint)
        .map(Some)
    }
}

/// One new key's claim parameters, as [`CLAIM_NEW_SQL`] binds them.
#[derive(Clone, Copy)]
struct NewKeyParams<'a> {
    scope: &'a str,
    key: &'a str,
    route: &'a str,
    fingerprint: &'a [u8],
    lease_ms: i64,
    ttl_ms: i64,
}

impl<'a> NewKeyParams<'a> {
    fn of(req: &ClaimRequest<'a>) -> NewKeyParams<'a> {
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
struct FinishParams<'a> {
    scope: &'a str,
    key: &'a str,
    token: &'a str,
    ttl_ms: i64,
    /// The key's wake-up id ([`KeyId`]), the payload of its announcement.
    id: &'a str,
}

/// The batch queues of a store with `batch_keys` above 1 (see [`super::pg_batch`]).
struct Batches {
    claims: Queue<NewKey>,
    finishes: Queue<Completion>,
}

impl Batches {
    fn new(db: Arc<Db>, limits: Limits) -> Batches {
        Batches {
            claims: Queue::new(Arc::clone(&db), limits),
            finishes: Queue::new(db, limits),
        }
    }

    /// Claims a new key in a batch: its lease token, or `None` when the full claim must
    /// decide (the key exists, or the batch could not tell).
    async fn claim_new(&self, req: &ClaimRequest<'_>) -> Result<Option<LeaseToken>, StoreError> {
        let p = NewKeyParams::of(req);
        self.claims
            .ask(NewKey {
                scope: p.scope.to_owned(),
                key: p.key.to_owned(),
                route: p.route.to_owned(),
                fingerprint: *req.fingerprint,
                lease_ms: p.lease_ms,
                ttl_ms: p.ttl_ms,
            })
            .await
    }

    /// Completes an attempt in a batch: whether it wrote, or the outcome back when it must
    /// run alone.
    async fn finish(&self, f: FinishParams<'_>, outcome: Outcome) -> Result<Finished, StoreError> {
        self.finishes
            .ask(Completion {
                scope: f.scope.to_owned(),
                key: f.key.to_owned(),
                token: f.token.to_owned(),
                ttl_ms: f.ttl_ms,
                id: f.id.to_owned(),
                outcome,
            })
            .await
    }
}

/// A batch statement's rows, or `None` when it was chosen as a deadlock's victim (then every
/// key runs alone; batched inserts take their keys in one order, so it should be rare).
fn unless_deadlocked(
    found: Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>,
) -> Result<Option<Vec<tokio_postgres::Row>>, tokio_postgres::Error> {
    match found {
        Err(e) if e.code() == Some(&SqlState::T_R_DEADLOCK_DETECTED) => Ok(None),
        found => found.map(Some),
    }
}

/// An ask about one key, known by its scope and key.
trait Keyed: Item {
    fn id(&self) -> (&str, &str);
}

/// Sorts a batch by key and keeps one request per key: a later one for a key already in the
/// batch is handed to `alone` (it runs its own statement after this one).
fn one_per_key<T: Keyed>(
    mut batch: Vec<Waiting<T>>,
    alone: impl Fn(Waiting<T>),
) -> Vec<Waiting<T>> {
    batch.sort_unstable_by(|a, b| a.ask.id().cmp(&b.ask.id()));
    let mut kept: Vec<Waiting<T>> = Vec::with_capacity(batch.len());
    for waiting in batch {
        if kept
            .last()
            .is_some_and(|last| last.ask.id() == waiting.ask.id())
        {
            alone(waiting);
        } else {
            kept.push(waiting);
        }
    }
    kept
}

/// Which requests of a sorted, one-per-key batch the rows name (by scope and key).
fn named<T: Keyed>(batch: &[Waiting<T>], rows: &[tokio_postgres::Row]) -> Vec<Option<usize>> {
    rows.iter()
        .map(|row| {
            let wanted: (&str, &str) = (row.get(0), row.get(1));
            batch.binary_search_by(|w| w.ask.id().cmp(&wanted)).ok()
        })
        .collect()
}

/// One column of a batch's parameter arrays.
fn column<'a, T: Item, V>(batch: &'a [Waiting<T>], f: impl Fn(&'a T) -> V) -> Vec<V> {
    batch.iter().map(|w| f(&w.ask)).collect()
}

/// A new key's claim.
struct NewKey {
    scope: String,
    key: String,
    route: String,
    fingerprint: crate::fingerprint::Fingerprint,
    lease_ms: i64,
    ttl_ms: i64,
}

impl NewKey {
    fn params(&self) -> NewKeyParams<'_> {
        NewKeyParams {
            scope: &self.scope,
            key: &self.key,
            route: &self.route,
            fingerprint: &self.fingerprint,
            lease_ms: self.lease_ms,
            ttl_ms: self.ttl_ms,
        }
    }
}

impl Keyed for NewKey {
    fn id(&self) -> (&str, &str) {
        (&self.scope, &self.key)
    }
}

impl Item for NewKey {
    const OP: &'static str = "claim_new";
    /// The lease token, or `None`: the full claim decides.
    type Answer = Option<LeaseToken>;

    async fn run(db: Arc<Db>, obj: Object, batch: Vec<Waiting<NewKey>>) {
        // A second claim of a key in this batch goes to the full statement at once; the
        // unique index orders it with this insert, and it decides on the row it finds.
        let batch = one_per_key(batch, |w| w.answer(Ok(None)));
        db.metrics.batch(NewKey::OP, batch.len());
        let tokens = db
            .bounded(obj, async |c| {
                if let [one] = &batch[..] {
                    let token = c.claim_new(one.ask.params()).await?;
                    return Ok(Some(vec![token.map(LeaseToken)]));
                }
                let found = c
                    .query(
                        CLAIM_NEW_BATCH_SQL,
                        CLAIM_NEW_BATCH_TYPES,
                        &[
                            &column(&batch, |k| k.scope.as_str()),
                            &column(&batch, |k| k.key.as_str()),
                            &column(&batch, |k| k.route.as_str()),
                            &column(&batch, |k| &k.fingerprint[..]),
                            &column(&batch, |k| k.lease_ms),
                            &column(&batch, |k| k.ttl_ms),
                        ],
                    )
                    .await;
                let Some(rows) = unless_deadlocked(found)? else {
                    return Ok(None);
                };
                let mut tokens = vec![None; batch.len()];
                for (row, at) in rows.iter().zip(named(&batch, &rows)) {
                    if let Some(at) = at {
                        tokens[at] = Some(LeaseToken(row.get(2)));
                    }
                }
                Ok(Some(tokens))
            })
            .await;
        // Without an answer, the full statement decides each key, one at a time.
        answer_all(batch, tokens, |w| w.answer(Ok(None)));
    }
}

/// What a batched completion tells its caller.
enum Finished {
    /// The statement ran: whether it wrote the row (false: the lease was lost).
    Written(bool),
    /// Nothing was written: run the completion alone (a second one for the key in the batch,
    /// or the batch was a deadlock's victim).
    Alone(Outcome),
}

/// The completion of one attempt.
struct Completion {
    scope: String,
    key: String,
    token: String,
    ttl_ms: i64,
    id: String,
    outcome: Outcome,
}

impl Completion {
    fn params(&self) -> FinishParams<'_> {
        FinishParams {
            scope: &self.scope,
            key: &self.key,
            token: &self.token,
            ttl_ms: self.ttl_ms,
            id: &self.id,
        }
    }

    /// Hands the outcome back, to be written alone.
    fn alone(waiting: Waiting<Completion>) {
        waiting.answer_with(|c| Ok(Finished::Alone(c.outcome)));
    }
}

impl Keyed for Completion {
    fn id(&self) -> (&str, &str) {
        (&self.scope, &self.key)
    }
}

impl Item for Completion {
    const OP: &'static str = "finish";
    type Answer = Finished;

    fn bytes(&self) -> usize {
        match &self.outcome {
            Outcome::Completed(stored) => stored.body.len(),
            _ => 0,
        }
    }

    async fn run(db: Arc<Db>, obj: Object, batch: Vec<Waiting<Completion>>) {
        let batch = one_per_key(batch, Completion::alone);
        db.metrics.batch(Completion::OP, batch.len());
        let written = db
            .bounded(obj, async |c| {
                if let [one] = &batch[..] {
                    let f = &one.ask;
                    let written = c.finish_one(f.params(), &f.outcome).await?;
                    return Ok(Some(vec![Finished::Written(written)]));
                }
                let rows: Vec<FinishRow<'_>> = column(&batch, |f| FinishRow::of(&f.outcome));
                let found = c
                    .unnamed(
                        FINISH_BATCH_SQL,
                        FINISH_BATCH_TYPES,
                        &[
                            &column(&batch, |f| f.scope.as_str()),
                            &column(&batch, |f| f.key.as_str()),
                            &column(&batch, |f| f.token.as_str()),
                            &rows.iter().map(|r| r.state).collect::<Vec<_>>(),
                            &rows.iter().map(|r| r.status).collect::<Vec<_>>(),
                            &rows
                                .iter()
                                .map(|r| r.headers.as_deref())
                                .collect::<Vec<_>>(),
                            &rows.iter().map(|r| r.body).collect::<Vec<_>>(),
                            &column(&batch, |f| f.ttl_ms),
                            &column(&batch, |f| f.id.as_str()),
                        ],
                    )
                    .await;
                let Some(done) = unless_deadlocked(found)? else {
                    return Ok(None);
                };
                let mut written: Vec<Finished> =
                    batch.iter().map(|_| Finished::Written(false)).collect();
                for at in named(&batch, &done).into_iter().flatten() {
                    written[at] = Finished::Written(true);
                }
                Ok(Some(written))
            })
            .await;
        answer_all(batch, written, Completion::alone);
    }
}

impl Store for PgStore {
    fn claim<'a>(&'a self, req: ClaimRequest<'a>) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            let started = std::time::Instant::now();
            let claim = self.claim_all(&req).await;
            self.db.metrics.observe("claim", started.elapsed());
            claim
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
        Box::pin(async move {
            let started = std::time::Instant::now();
            let id = String::from(KeyId::of(scope, key));
            let f = FinishParams {
                scope,
                key,
                token: token.0.as_str(),
                ttl_ms: ttl.as_millis() as i64,
                id: &id,
            };
            let written = self.finish_all(f, outcome).await;
            self.db.metrics.observe("finish", started.elapsed());
            written
        })
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
            Ok(row.map(|r| KeyInfo {
                scope: r.get(0),
                key: r.get(1),
                route: r.get(2),
                state: r.get(3),
                status: r
                    .get::<_, Option<i32>>(4)
                    .and_then(|s| u16::try_from(s).ok()),
                attempts: r.get(5),
                body_bytes: r.get::<_, Option<i32>>(6).map(|n| n as usize),
                created_at: r.get(7),
                completed_at: r.get(8),
                lease_expires_at: r.get(9),
                expires_at: r.get(10),
                fingerprint_hex: hex(r.get::<_, &[u8]>(11)),
            }))
        })
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
        Box::pin(async move {
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
        })
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
        Box::pin(PgStore::migrate(self))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The functions a pooled gateway calls hold the statements a direct one prepares,
    /// verbatim: both write the same rows.
    #[test]
    fn the_pooler_functions_hold_the_statements_verbatim() {
        let (_, name, sql) = MIGRATIONS
            .iter()
            .find(|m| m.1 == "pooler_functions")
            .expect("the migration exists");
        for (statement, function) in [
            (CLAIM_NEW_SQL, "idemgate_claim_new"),
            (FINISH_SQL, "idemgate_finish"),
        ] {
            let start = sql
                .find(&format!("FUNCTION {function}("))
                .unwrap_or_else(|| panic!("{name} defines {function}"));
            let body = &sql[start..];
            let body = &body[..body.find("END\n$fn$").expect("the function ends")];
            assert!(
                body.contains(statement.trim()),
                "{function} in migration {name} is not {statement}"
            );
        }
    }
}
