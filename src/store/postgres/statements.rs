//! The statements the Postgres store sends, each written once with the types of its
//! parameters (`*_TYPES`, what the server would infer); how they are sent and bounded is
//! `session.rs`. What each one guarantees is in its doc; the table's invariants they keep
//! are in the module docs of `mod.rs`.

use tokio_postgres::types::Type;

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
pub(super) const CLAIM_NEW_CALL: &str = "SELECT idemgate_claim_new($1, $2, $3, $4, $5, $6)";

/// [`CLAIM_NEW_SQL`] for several keys in one statement and one commit (the rows of the
/// arrays, in order, one key once), sent only for two keys or more. Each key inserted comes
/// back with its lease token; a key that does not come back exists, and the full claim
/// ([`CLAIM_SQL`]) decides it. Sent as the body of a function ([`CLAIM_NEW_BATCH_CALL`]),
/// which a unit test checks holds it verbatim.
#[cfg_attr(not(test), allow(dead_code))]
pub(super) const CLAIM_NEW_BATCH_SQL: &str = "
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
/// [`CLAIM_NEW_BATCH_SQL`] as called: a function (migrations/0008) that holds the statement
/// verbatim and waits at most 100 ms for a row lock, after which the batch's keys run alone.
/// Rows: scope, key and lease token of each key inserted.
pub(super) const CLAIM_NEW_BATCH_CALL: &str =
    "SELECT o_scope, o_key, o_token FROM idemgate_claim_new_batch($1, $2, $3, $4, $5, $6)";
pub(super) const CLAIM_NEW_BATCH_TYPES: &[Type] = &[
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
pub(super) const LOOK_SQL: &str = "
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
pub(super) const LOOK_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::BYTEA, Type::BOOL];

/// The claim when the key exists: takes it over when claimable, or reads what is there.
pub(super) const CLAIM_SQL: &str = "
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
pub(super) const CLAIM_TYPES: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::BYTEA,
    Type::INT8,
    Type::INT8,
    Type::BOOL,
];

/// The channel on which finished keys are announced; the payload is a [`KeyId`](crate::key::KeyId).
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
pub(super) const FINISH_CALL: &str = "SELECT idemgate_finish($1, $2, $3, $4, $5, $6, $7, $8, $9)";

/// [`FINISH_SQL`] for several keys in one statement and one commit (one key once), sent only
/// for two keys or more: a function (migrations/0007) that runs the single-key completion for
/// each key in the order given, each fenced by its own lease token and announced when someone
/// waits for it, waiting at most 100 ms for a row lock (migrations/0008). One row back for each
/// key written: its 1-based position.
pub(super) const FINISH_BATCH_CALL: &str =
    "SELECT idemgate_finish_batch($1, $2, $3, $4, $5, $6, $7, $8, $9)";
pub(super) const FINISH_BATCH_TYPES: &[Type] = &[
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
pub(super) const RELEASE_SQL: &str = "
DELETE FROM idemgate_keys
 WHERE scope = $1 AND key = $2 AND lease_token = $3::text::uuid AND state = 'in_flight'
RETURNING CASE WHEN waiters THEN pg_notify('idemgate_keys', $4) END AS announced";
pub(super) const RELEASE_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::TEXT, Type::TEXT];

/// A waiter asks to be told when the key is finished. The first one sets `waiters`: the row
/// lock orders it against the finishing write, so either the finisher sees `waiters` and
/// announces, or this statement sees the row no longer in flight (no row back) and the
/// waiter looks again at once. Once `waiters` is set (committed), later waiters only read
/// it: the finisher will announce, and the row is not written again for each look.
pub(super) const WATCH_SQL: &str = "
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
pub(super) const WATCH_TYPES: &[Type] = &[Type::TEXT, Type::TEXT];

/// Takes a slot of a scope for a route with limit `$2`, in one round trip: the function
/// (migrations/0004_slot_limits.sql) decides under a per-scope transaction lock, so takers on
/// every instance are ordered and none can miss another. No row back: the scope is full for
/// this route (counting itself, more than `$2` live slots, or more than some live holder's
/// limit).
pub(super) const SLOT_ACQUIRE_SQL: &str = "SELECT slot, token FROM idemgate_take_slot($1, $2, $3)";
pub(super) const SLOT_ACQUIRE_TYPES: &[Type] = &[Type::TEXT, Type::INT4, Type::INT8];

/// Frees a slot we hold (fenced by its token) and announces it to the scope's waiters.
pub(super) const SLOT_RELEASE_SQL: &str = "
WITH done AS (
    DELETE FROM idemgate_slots
     WHERE scope = $1 AND slot = $2 AND token = $3::text::uuid
    RETURNING 1
)
SELECT pg_notify('idemgate_keys', $4) FROM done";
pub(super) const SLOT_RELEASE_TYPES: &[Type] = &[Type::TEXT, Type::INT4, Type::TEXT, Type::TEXT];

/// The session's `synchronous_commit`, as `SHOW synchronous_commit` reports it, on a pooled
/// connection: what the gateway's role and database are set to (`ALTER ROLE/DATABASE ...
/// SET`) on top of the server's default.
/// The durability setting and the isolation the session's transactions get by default.
pub(super) const SYNC_COMMIT_SQL: &str = "
SELECT current_setting('synchronous_commit'), current_setting('default_transaction_isolation')";
/// Streaming standbys that are not synchronous: a failover to one of them can lose commits
/// a client was already answered from. A role without `pg_monitor` sees no `sync_state`
/// (NULL), and such a standby counts as asynchronous.
pub(super) const ASYNC_STANDBYS_SQL: &str = "
SELECT count(*) FROM pg_stat_replication
 WHERE sync_state IS DISTINCT FROM 'sync' AND sync_state IS DISTINCT FROM 'quorum'";

/// Readiness in one round trip: the schema version, the durability setting, the isolation.
pub(super) const READY_SQL: &str = "
SELECT (SELECT max(version) FROM idemgate_migrations), current_setting('synchronous_commit'),
       current_setting('default_transaction_isolation')";

pub(super) const INSPECT_SQL: &str = "
SELECT scope, key, route, state, status, attempts, length(body) AS body_bytes,
       created_at::text, completed_at::text, lease_expires_at::text, expires_at::text,
       fingerprint,
       (extract(epoch FROM now() - created_at) * 1000)::bigint AS age_ms,
       (extract(epoch FROM lease_expires_at - now()) * 1000)::bigint AS lease_left_ms
  FROM idemgate_keys WHERE scope = $1 AND key = $2";
pub(super) const INSPECT_TYPES: &[Type] = &[Type::TEXT, Type::TEXT];

/// One page of an operator's listing (`Store::list`): a walk of the primary key in order
/// (`(scope, key) > ($1, $2)`, within one scope when `$3` is given), at most `$8` rows read
/// (`LIMIT`, so the walk stops there whatever the filters match); the filters on state
/// (`$4`), route (`$5`) and age (`$6` ms) are checked on the rows read, and the matches are
/// returned up to `$7` of them, with the last row read (`last`) for the page's cursor.
/// `after` and `scope` choose which of the walk's conditions are written, so that the first
/// page and an unscoped walk carry no condition that would keep the planner from the
/// primary key's order; the statement is sent unnamed (planned for its values).
pub fn list_sql(after: bool, scope: bool) -> String {
    let mut conditions: Vec<&str> = Vec::new();
    if after {
        conditions.push("(scope, key) > ($1, $2)");
    }
    if scope {
        conditions.push("scope = $3");
    }
    let walk = if conditions.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", conditions.join(" AND "))
    };
    format!(
        "
WITH walked AS (
    SELECT scope, key, route, state, status, attempts, length(body) AS body_bytes,
           created_at, completed_at, lease_expires_at, expires_at, fingerprint,
           ($4::text IS NULL OR state = $4)
           AND ($5::text IS NULL OR route = $5)
           AND ($6::bigint IS NULL OR created_at <= now() - $6::bigint * interval '1 millisecond')
               AS hit
      FROM idemgate_keys
     {walk}
     ORDER BY scope, key
     LIMIT $8
),
ranked AS (
    SELECT w.*,
           count(*) FILTER (WHERE hit) OVER (ORDER BY scope, key ROWS UNBOUNDED PRECEDING) AS nth,
           row_number() OVER (ORDER BY scope, key) AS n,
           count(*) OVER () AS total
      FROM walked w
)
SELECT scope, key, route, state, status, attempts, body_bytes,
       created_at::text, completed_at::text, lease_expires_at::text, expires_at::text,
       fingerprint,
       (extract(epoch FROM now() - created_at) * 1000)::bigint AS age_ms,
       (extract(epoch FROM lease_expires_at - now()) * 1000)::bigint AS lease_left_ms,
       hit AND nth <= $7 AS returned, n = total AS last, total
  FROM ranked
 WHERE (hit AND nth <= $7) OR n = total
 ORDER BY scope, key"
    )
}
pub const LIST_TYPES: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
    Type::INT8,
    Type::INT8,
];

/// The advisory lock that lets one instance at a time collect expired rows.
pub(super) const GC_LOCK: i64 = 0x1de0_6a7e_0002;

/// One batch of expired rows, by full key (so it works on a table partitioned by scope);
/// rows locked by a concurrent claim are skipped, not waited for. Found by the index on
/// `gc_after` (never later than `expires_at`); only rows whose `expires_at` passed go.
pub(super) const GC_SQL: &str = "
DELETE FROM idemgate_keys
 WHERE (scope, key) IN (SELECT scope, key FROM idemgate_keys
                         WHERE gc_after <= now() AND expires_at <= now()
                         ORDER BY gc_after
                         LIMIT $1
                           FOR UPDATE SKIP LOCKED)";

/// The slot rows of `serialize` holders that crashed (a released slot is deleted by its
/// holder): a minute past its lease, such a row is only ever taken over in its scope again,
/// and a scope that never comes back would keep it forever. Deleting one changes no live count.
pub(super) const GC_SLOTS_SQL: &str = "
DELETE FROM idemgate_slots
 WHERE (scope, slot) IN (SELECT scope, slot FROM idemgate_slots
                          WHERE lease_expires_at <= now() - interval '1 minute'
                          LIMIT $1
                            FOR UPDATE SKIP LOCKED)";

/// An operator's delete: the row is locked and read, then deleted unless it is in flight
/// under a live lease and `$3` (force) is false; the deletion is announced. One row back
/// when the key exists: its route, whether its lease was live, whether it was deleted.
pub(super) const DELETE_SQL: &str = "
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
pub(super) const DELETE_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::BOOL, Type::TEXT];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::postgres::MIGRATIONS;

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
            function_holds(sql, name, function, statement);
        }
        let (_, name, sql) = MIGRATIONS
            .iter()
            .find(|m| m.1 == "batch_lock_timeout")
            .expect("the migration exists");
        function_holds(sql, name, "idemgate_claim_new_batch", CLAIM_NEW_BATCH_SQL);
    }

    /// Whether migration `name` (`sql`) defines `function` with `statement` in its body.
    fn function_holds(sql: &str, name: &str, function: &str, statement: &str) {
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
