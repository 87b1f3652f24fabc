//! PostgreSQL migrations, run online: while other instances keep claiming keys.
//!
//! Two parts, both without the request `statement_timeout`:
//!
//! 1. [`apply`]: the pending files of [`MIGRATIONS`], on a pooled connection (its settings
//!    `SET LOCAL`, so they end with it even behind a pooler in transaction mode), in one
//!    transaction under an advisory
//!    transaction lock, so many instances may start at once. Every statement in them takes
//!    its lock briefly: no table rewrite, no scan, no backfill (a column is added with a
//!    constant default, which PostgreSQL keeps in the catalog). Each lock is waited for at
//!    most [`LOCK_TIMEOUT`]: a DDL statement waiting for its lock queues every claim behind
//!    it, so a long transaction on the table must make the migration give up and try again
//!    ([`LOCK_TRIES`] times, then an error naming the cause), never hold the claims.
//! 2. [`online`]: what a migration leaves for after its transaction, run outside any
//!    transaction, on a direct session of its own (`listen_url`: session settings and a
//!    session advisory lock), each step idempotent (so an interrupted run is finished by the
//!    next one):
//!    indexes built with `CREATE INDEX CONCURRENTLY` (an invalid one left by an interrupted
//!    build is dropped and built again), and backfills in small batches of their own
//!    transactions, skipping rows a claim holds. One instance at a time runs it (a session
//!    advisory lock, tried, not waited for); the gateway serves while it runs.
//!
//! Migration 5 is the one with online work: `gc_after` is added with the default
//! `-infinity` (rows from before it, and rows written by an instance of an earlier release
//! during a rolling upgrade, read as "collect-eligible now", which is never later than their
//! `expires_at`: the collector still deletes only rows whose `expires_at` passed); its index
//! is built concurrently, and the backfill sets `gc_after = expires_at` on those rows. The
//! collector runs the same backfill statement for rows that arrive later.

use std::time::Duration;

use tokio_postgres::{Client, NoTls, error::SqlState, types::Type};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::store::{OnlineRun, StoreError};

/// The migrations, in order: (version, name, SQL). The SQL runs in the transaction of
/// [`apply`]; the work each leaves for later is in [`online`].
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "keys", include_str!("../../../migrations/0001_keys.sql")),
    (
        2,
        "slots",
        include_str!("../../../migrations/0002_slots.sql"),
    ),
    (
        3,
        "waiters",
        include_str!("../../../migrations/0003_waiters.sql"),
    ),
    (
        4,
        "slot_limits",
        include_str!("../../../migrations/0004_slot_limits.sql"),
    ),
    (
        5,
        "lean_writes",
        include_str!("../../../migrations/0005_lean_writes.sql"),
    ),
    (
        6,
        "pooler_functions",
        include_str!("../../../migrations/0006_pooler_functions.sql"),
    ),
    (
        7,
        "finish_batch",
        include_str!("../../../migrations/0007_finish_batch.sql"),
    ),
    (
        8,
        "batch_lock_timeout",
        include_str!("../../../migrations/0008_batch_lock_timeout.sql"),
    ),
];

/// The advisory lock key that serializes the migrations' transactions (and nothing else).
const MIGRATION_LOCK: i64 = 0x1de0_6a7e_0001;

/// The session advisory lock of the online part: one instance at a time builds and fills.
const ONLINE_LOCK: i64 = 0x1de0_6a7e_0003;

/// How long one statement of a migration waits for a lock before the transaction gives up
/// (and is tried again): a claim queued behind it waits no longer than this plus the
/// statement itself.
pub const LOCK_TIMEOUT: Duration = Duration::from_millis(500);

/// How many times [`apply`] tries before it reports the lock it could not take.
const LOCK_TRIES: u32 = 3;

/// Rows per backfill batch (one transaction): each holds its rows' locks for milliseconds.
pub const BACKFILL_BATCH: i64 = 5000;

/// Sets `gc_after` on up to `$1` rows still at the default migration 5 gave them (found by
/// the `gc_after` index; rows a claim holds are skipped and done by a later batch): the
/// collector's, for rows an instance of an earlier release inserts during an upgrade (the
/// migration's own backfill walks the table instead, see [`backfill_gc_after`]).
pub const BACKFILL_GC_AFTER_SQL: &str = "
UPDATE idemgate_keys SET gc_after = expires_at
 WHERE (scope, key) IN (SELECT scope, key FROM idemgate_keys
                         WHERE gc_after = '-infinity'
                         LIMIT $1
                           FOR UPDATE SKIP LOCKED)";

/// Opens the online part's connection on `cfg` (`listen_url`'s). It must be a direct
/// session: its settings (no statement timeout, [`LOCK_TIMEOUT`]) and its advisory lock are
/// the session's, which a pooler in transaction mode would lend to others; such a pooler
/// refuses the startup option that sets them, and the error says so.
pub(super) async fn connect(
    mut cfg: tokio_postgres::Config,
    tls: Option<MakeRustlsConnect>,
) -> Result<Client, StoreError> {
    cfg.application_name("idemgate migrate");
    cfg.options(format!(
        "-c statement_timeout=0 -c lock_timeout={} -c default_transaction_isolation=read\\ committed",
        LOCK_TIMEOUT.as_millis()
    ));
    let connected = match tls {
        None => cfg.connect(NoTls).await.map(|(client, conn)| {
            tokio::spawn(conn);
            client
        }),
        Some(tls) => cfg.connect(tls).await.map(|(client, conn)| {
            tokio::spawn(conn);
            client
        }),
    };
    connected.map_err(|e| {
        let mut why = crate::payload::error_chain(&e);
        if why.contains("unsupported startup parameter") {
            why.push_str(
                " (the online part of the migrations, an index built concurrently, needs a \
                 session of its own: point store.postgres.listen_url at PostgreSQL itself)",
            );
        }
        StoreError::Connect(why)
    })
}

fn db_error(e: tokio_postgres::Error) -> StoreError {
    StoreError::Db(crate::payload::error_chain(&e))
}

/// Applies the pending migrations up to version `last`, in one transaction; a lock not
/// taken within [`LOCK_TIMEOUT`] rolls it back and it is tried again after a pause.
/// Returns how many were applied.
pub(super) async fn apply(client: &mut Client, last: i32) -> Result<usize, StoreError> {
    // Nothing pending: no DDL at all, so a runtime role without CREATE serves a schema that
    // an owner migrated (`CREATE TABLE IF NOT EXISTS` needs the privilege even when the
    // table exists).
    let wanted = MIGRATIONS
        .iter()
        .map(|m| m.0)
        .filter(|v| *v <= last)
        .max()
        .unwrap_or(0);
    if applied_version(client).await.map_err(db_error)? >= wanted {
        return Ok(0);
    }
    let mut pause = Duration::from_millis(200);
    for attempt in 1..=LOCK_TRIES {
        match apply_once(client, last).await {
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                tracing::warn!(
                    attempt,
                    "a migration waited {} ms for a lock that a long transaction holds; trying again",
                    LOCK_TIMEOUT.as_millis()
                );
                if attempt == LOCK_TRIES {
                    return Err(StoreError::Db(format!(
                        "the migrations could not take their locks ({} ms each, {LOCK_TRIES} \
                         tries): a long transaction holds a lock on idemgate_keys or \
                         idemgate_slots (see pg_locks and pg_stat_activity)",
                        LOCK_TIMEOUT.as_millis()
                    )));
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
                let role: String = client
                    .query_one("SELECT current_user::text", &[])
                    .await
                    .map(|r| r.get(0))
                    .unwrap_or_else(|_| "this role".into());
                return Err(StoreError::Privilege(format!(
                    "migrations are pending and the role {role} may not apply them ({}): run \
                     `idemgate migrate` once with a role that owns the schema (CREATE on it, \
                     and owner of the idemgate tables), then serve with this one",
                    crate::payload::error_chain(&e)
                )));
            }
            Err(e) => return Err(db_error(e)),
            Ok(n) => return Ok(n),
        }
    }
    unreachable!("the last try returns")
}

/// The highest migration applied (0 before the first).
async fn applied_version(client: &Client) -> Result<i32, tokio_postgres::Error> {
    let exists: bool = client
        .query_typed("SELECT to_regclass('idemgate_migrations') IS NOT NULL", &[])
        .await?[0]
        .get(0);
    if !exists {
        return Ok(0);
    }
    let v: Option<i32> = client
        .query_typed("SELECT max(version) FROM idemgate_migrations", &[])
        .await?[0]
        .get(0);
    Ok(v.unwrap_or(0))
}

async fn apply_once(client: &mut Client, last: i32) -> Result<usize, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    tx.batch_execute(&format!(
        "SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = {}",
        LOCK_TIMEOUT.as_millis()
    ))
    .await?;
    tx.execute_typed(
        "SELECT pg_advisory_xact_lock($1)",
        &[(&MIGRATION_LOCK, Type::INT8)],
    )
    .await?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS idemgate_migrations (
            version integer PRIMARY KEY,
            name text NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .await?;
    let done: Vec<i32> = tx
        .query_typed("SELECT version FROM idemgate_migrations", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut applied = 0;
    for (version, name, sql) in MIGRATIONS.iter().filter(|m| m.0 <= last) {
        if done.contains(version) {
            continue;
        }
        tx.batch_execute(sql).await?;
        tx.execute_typed(
            "INSERT INTO idemgate_migrations (version, name) VALUES ($1, $2)",
            &[(version, Type::INT4), (name, Type::TEXT)],
        )
        .await?;
        applied += 1;
    }
    tx.commit().await?;
    Ok(applied)
}

/// The online part: the `gc_after` index, built concurrently, then the backfill. Does
/// nothing (cheaply) when both are done, or before migration 5.
pub(super) async fn online(client: &Client) -> Result<OnlineRun, StoreError> {
    let locked: bool = client
        .query_one("SELECT pg_try_advisory_lock($1)", &[&ONLINE_LOCK])
        .await
        .map_err(db_error)?
        .get(0);
    if !locked {
        return Ok(OnlineRun {
            skipped: true,
            ..OnlineRun::default()
        });
    }
    let run = online_locked(client).await;
    // Dropping the connection would release it too; a reused one must not keep it.
    let _ = client
        .execute("SELECT pg_advisory_unlock($1)", &[&ONLINE_LOCK])
        .await;
    run.map_err(db_error)
}

async fn online_locked(client: &Client) -> Result<OnlineRun, tokio_postgres::Error> {
    let mut run = OnlineRun::default();
    let has_column: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_attribute
                             WHERE attrelid = to_regclass('idemgate_keys')
                               AND attname = 'gc_after' AND NOT attisdropped)",
            &[],
        )
        .await?
        .get(0);
    if !has_column {
        return Ok(run);
    }
    run.indexes_built = index_gc_after(client).await?;
    let pending: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM idemgate_keys WHERE gc_after = '-infinity')",
            &[],
        )
        .await?
        .get(0);
    if pending {
        run.rows_filled = backfill_gc_after(client).await?;
    }
    Ok(run)
}

/// One backfill batch: the next [`BACKFILL_BATCH`] rows in primary key order after
/// `($1, $2)`, those at the default set; returns how many were set and the batch's last key
/// (none when the table is done). A walk by key visits each row once: selecting by the
/// default instead would pass, batch after batch, over the index entries of the rows
/// already filled (dead until vacuumed), quadratic in the table.
const BACKFILL_WALK_SQL: &str = "
WITH batch AS (SELECT scope, key FROM idemgate_keys
                WHERE (scope, key) > ($1, $2)
                ORDER BY scope, key LIMIT $3),
     filled AS (UPDATE idemgate_keys k SET gc_after = k.expires_at
                  FROM batch b
                 WHERE k.scope = b.scope AND k.key = b.key AND k.gc_after = '-infinity'
                RETURNING 1)
SELECT (SELECT count(*) FROM filled),
       (SELECT scope FROM batch ORDER BY scope DESC, key DESC LIMIT 1),
       (SELECT key FROM batch ORDER BY scope DESC, key DESC LIMIT 1)";

/// Fills `gc_after` on every row at migration 5's default, walking the table by primary key
/// in batches of their own transactions (a row a claim holds is waited for, at most
/// [`LOCK_TIMEOUT`], then the batch is tried again). Returns the rows filled.
async fn backfill_gc_after(client: &Client) -> Result<u64, tokio_postgres::Error> {
    let statement = client
        .prepare_typed(BACKFILL_WALK_SQL, &[Type::TEXT, Type::TEXT, Type::INT8])
        .await?;
    // Every (scope, key) is above ("", "") but the empty pair itself (never a key: keys and
    // scopes are never empty).
    let (mut scope, mut key) = (String::new(), String::new());
    let mut filled = 0u64;
    let mut busy = 0;
    loop {
        let row = match client
            .query_one(&statement, &[&scope, &key, &BACKFILL_BATCH])
            .await
        {
            Ok(row) => row,
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) && busy < LOCK_TRIES => {
                busy += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        busy = 0;
        filled += row.get::<_, i64>(0) as u64;
        match (
            row.get::<_, Option<String>>(1),
            row.get::<_, Option<String>>(2),
        ) {
            (Some(s), Some(k)) => (scope, key) = (s, k),
            _ => return Ok(filled),
        }
    }
}

/// The one-column index on `gc_after` of `table` that is valid, if any; and whether an
/// invalid one is left (an interrupted concurrent build: its name).
async fn gc_after_index(
    client: &Client,
    table: &str,
) -> Result<(bool, Option<String>), tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT i.indisvalid, i.indexrelid::regclass::text
               FROM pg_index i
               JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
              WHERE i.indrelid = $1::text::regclass AND i.indnatts = 1
                AND a.attname = 'gc_after'",
            &[&table],
        )
        .await?;
    let valid = rows.iter().any(|r| r.get::<_, bool>(0));
    let invalid = rows
        .iter()
        .find(|r| !r.get::<_, bool>(0))
        .map(|r| r.get::<_, String>(1));
    Ok((valid, invalid))
}

/// Builds the `gc_after` index concurrently: on the table, or on each partition of a table
/// partitioned as in docs/operations.md (a partitioned table's index cannot be built
/// concurrently: it is created on the parent alone, then each partition's is built and
/// attached). Returns how many indexes were built.
async fn index_gc_after(client: &Client) -> Result<usize, tokio_postgres::Error> {
    let partitioned: bool = client
        .query_one(
            "SELECT relkind = 'p' FROM pg_class WHERE oid = 'idemgate_keys'::regclass",
            &[],
        )
        .await?
        .get(0);
    if !partitioned {
        return Ok(usize::from(
            build_concurrently(client, "idemgate_keys", "idemgate_keys_gc_after").await?,
        ));
    }
    let (parent_valid, _) = gc_after_index(client, "idemgate_keys").await?;
    if parent_valid {
        return Ok(0);
    }
    // A partitioned table's index on the parent alone is invalid until every partition's is
    // attached; an invalid one found here is that (it has no build of its own to redo).
    let parent_index: String = match client
        .query_opt(
            "SELECT i.indexrelid::regclass::text
               FROM pg_index i
               JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
              WHERE i.indrelid = 'idemgate_keys'::regclass AND i.indnatts = 1
                AND a.attname = 'gc_after'",
            &[],
        )
        .await?
    {
        Some(r) => r.get(0),
        None => {
            // Takes a SHARE lock on the parent for a moment (no partition is scanned), so it
            // waits for its lock at most LOCK_TIMEOUT, like a migration.
            client
                .batch_execute(
                    "CREATE INDEX idemgate_keys_gc_after ON ONLY idemgate_keys (gc_after)",
                )
                .await?;
            "idemgate_keys_gc_after".to_string()
        }
    };
    let partitions: Vec<(String, String)> = client
        .query(
            "SELECT t.relid::regclass::text, quote_ident(c.relname || '_gc_after')
               FROM pg_partition_tree('idemgate_keys') t
               JOIN pg_class c ON c.oid = t.relid
              WHERE t.isleaf AND t.parentrelid = 'idemgate_keys'::regclass",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let mut built = 0;
    for (partition, index) in &partitions {
        built += usize::from(build_concurrently(client, partition, index).await?);
        let attached: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_inherits h
                                  JOIN pg_index i ON i.indexrelid = h.inhrelid
                                  JOIN pg_attribute a ON a.attrelid = i.indrelid
                                                     AND a.attnum = i.indkey[0]
                                 WHERE h.inhparent = $1::text::regclass
                                   AND i.indrelid = $2::text::regclass
                                   AND i.indnatts = 1 AND a.attname = 'gc_after')",
                &[&parent_index, partition],
            )
            .await?
            .get(0);
        if !attached {
            let name = valid_index_name(client, partition).await?;
            client
                .batch_execute(&format!(
                    "ALTER INDEX {parent_index} ATTACH PARTITION {name}"
                ))
                .await?;
        }
    }
    Ok(built)
}

/// The name of `table`'s valid `gc_after` index (built just before).
async fn valid_index_name(client: &Client, table: &str) -> Result<String, tokio_postgres::Error> {
    let r = client
        .query_one(
            "SELECT i.indexrelid::regclass::text
               FROM pg_index i
               JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
              WHERE i.indrelid = $1::text::regclass AND i.indnatts = 1
                AND a.attname = 'gc_after' AND i.indisvalid
              LIMIT 1",
            &[&table],
        )
        .await?;
    Ok(r.get(0))
}

/// Builds `index` on `table (gc_after)` with `CREATE INDEX CONCURRENTLY` unless a valid one
/// exists; an invalid one (an interrupted build) is dropped concurrently first. Neither
/// takes a lock that conflicts with writes; both wait for the transactions open on the table
/// to end, so they run without the lock timeout. Returns whether it built one.
async fn build_concurrently(
    client: &Client,
    table: &str,
    index: &str,
) -> Result<bool, tokio_postgres::Error> {
    let (valid, invalid) = gc_after_index(client, table).await?;
    if valid {
        return Ok(false);
    }
    client.batch_execute("SET lock_timeout = 0").await?;
    let built = async {
        if let Some(invalid) = invalid {
            tracing::info!(index = %invalid, "dropping an index left invalid by an interrupted build");
            client
                .batch_execute(&format!("DROP INDEX CONCURRENTLY IF EXISTS {invalid}"))
                .await?;
        }
        tracing::info!(%table, "building the gc_after index concurrently");
        client
            .batch_execute(&format!(
                "CREATE INDEX CONCURRENTLY {index} ON {table} (gc_after)"
            ))
            .await
    }
    .await;
    client
        .batch_execute(&format!("SET lock_timeout = {}", LOCK_TIMEOUT.as_millis()))
        .await?;
    built.map(|()| true)
}
