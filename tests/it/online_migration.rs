//! Upgrades that run online (src/store/postgres/migrate.rs): a table of a million rows at the
//! schema an earlier release left is upgraded while a client of that release keeps claiming
//! keys, and no claim waits a second; a migration that cannot take its lock says so at error
//! level and the gateway becomes ready once it can.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use idemgate::config::{Config, StoreConfig};
use idemgate::store::postgres::PgStore;

use crate::support::process::GatewayProcess;
use crate::support::*;

fn store_for(db: &str) -> PgStore {
    let config = Config::from_yaml(&config_yaml(db, "http://127.0.0.1:9", "")).expect("config");
    let StoreConfig::Postgres(pg) = &config.store else {
        panic!("a Postgres store")
    };
    PgStore::new(pg).expect("store")
}

/// What an instance of the release before migration 5 does to the table: a new key's claim
/// (an insert, no `gc_after`) and a look at an existing one that writes it (a take-over).
const OLD_CLAIM: &str = "
INSERT INTO idemgate_keys (scope, key, route, fingerprint, state, lease_token,
                           lease_expires_at, expires_at)
VALUES ('client', $1, 'r', '\\x00', 'in_flight', gen_random_uuid(),
        now() + interval '10 seconds', now() + interval '1 hour')
ON CONFLICT (scope, key) DO NOTHING";
const OLD_TOUCH: &str = "
UPDATE idemgate_keys SET attempts = attempts + 1 WHERE scope = 'old' AND key = $1";

const ROWS: i64 = 1_000_000;

#[tokio::test]
async fn a_million_rows_are_upgraded_while_claims_go_on_none_waiting_a_second() {
    let db = pg::fresh_database().await;
    let store = store_for(&db);
    assert_eq!(store.migrate_through(4).await.expect("migrations 1-4"), 4);
    let admin = sql(&db).await;
    let started = std::time::Instant::now();
    admin
        .batch_execute(&format!(
            "INSERT INTO idemgate_keys (scope, key, route, fingerprint, state, status, headers,
                                        body, expires_at)
             SELECT 'old', 'k' || g, 'r', '\\x00', 'completed', 201, '', 'b',
                    now() + CASE WHEN g % 10 = 0 THEN interval '-1 hour'
                                 ELSE interval '1 hour' END
               FROM generate_series(1, {ROWS}) g;
             ANALYZE idemgate_keys;"
        ))
        .await
        .unwrap();
    eprintln!("{ROWS} rows in {:?}", started.elapsed());

    // The client: claims and take-overs as fast as it can, each allowed one second.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let client = {
        let (stop, done) = (Arc::clone(&stop), Arc::clone(&done));
        let c = sql(&db).await;
        tokio::spawn(async move {
            c.batch_execute("SET statement_timeout = '1s'")
                .await
                .unwrap();
            let mut failed = Vec::new();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let new = format!("n{i}");
                let old = format!("k{}", (i * 7919) % ROWS as u64 + 1);
                for (sql, key) in [(OLD_CLAIM, &new), (OLD_TOUCH, &old)] {
                    match c.execute(sql, &[key]).await {
                        Ok(_) => {
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => failed.push(
                            e.as_db_error()
                                .map_or_else(|| e.to_string(), |d| d.message().to_string()),
                        ),
                    }
                }
            }
            failed
        })
    };
    wait_until("the client claims", Duration::from_secs(10), || async {
        done.load(Ordering::Relaxed) > 10
    })
    .await;

    let before = done.load(Ordering::Relaxed);
    let started = std::time::Instant::now();
    // Migration 5 and every one after it.
    let pending = idemgate::store::postgres::MIGRATIONS.len() - 4;
    assert_eq!(store.migrate().await.expect("the migrations"), pending);
    let applied = started.elapsed();
    let online = store.migrate_online().await.expect("the online part");
    eprintln!(
        "migrations applied in {applied:?}, online part done at {:?}",
        started.elapsed()
    );
    let during = done.load(Ordering::Relaxed) - before;
    stop.store(true, Ordering::Relaxed);
    let failed = client.await.unwrap();
    assert!(
        failed.is_empty(),
        "{} of the client's statements waited past a second or failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(
        during > 10,
        "the client went on during the upgrade ({during})"
    );
    assert_eq!(online.indexes_built, 1, "{online:?}");
    assert!(
        online.rows_filled >= ROWS as u64,
        "every old row (and the client's) backfilled: {online:?}"
    );

    let at_default = async || -> i64 {
        admin
            .query_one(
                "SELECT count(*) FROM idemgate_keys
                  WHERE gc_after = '-infinity' AND scope = 'old'",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    };
    assert_eq!(
        at_default().await,
        0,
        "no row from before is left at the default"
    );
    let valid: bool = admin
        .query_one(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = 'idemgate_keys_gc_after'::regclass",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(valid, "the gc_after index is valid");
    // Run again, it builds nothing (and fills only the claims the client made after it).
    let again = store.migrate_online().await.expect("the online part again");
    assert_eq!(again.indexes_built, 0);
    // The collector finds the expired tenth by gc_after.
    let deleted = store_gc_all(&store).await;
    assert_eq!(deleted, (ROWS / 10) as u64);
}

async fn store_gc_all(store: &PgStore) -> u64 {
    use idemgate::store::Store;
    store.gc(5_000).await.expect("gc").deleted
}

/// A row written at the default by an instance of an earlier release after the upgrade is
/// backfilled by the collector, and collected once it expires.
#[tokio::test]
async fn the_collector_fills_rows_an_earlier_release_writes_during_a_rolling_upgrade() {
    use idemgate::store::Store;
    let db = pg::fresh_database().await;
    let store = store_for(&db);
    store.migrate().await.expect("migrations");
    store.migrate_online().await.expect("online");
    let admin = sql(&db).await;
    admin
        .batch_execute(
            "INSERT INTO idemgate_keys (scope, key, route, fingerprint, state, status, headers,
                                        body, expires_at)
             VALUES ('old', 'live', 'r', '\\x00', 'completed', 201, '', 'b', now() + interval '1 hour'),
                    ('old', 'gone', 'r', '\\x00', 'completed', 201, '', 'b', now() - interval '1 hour')",
        )
        .await
        .unwrap();
    assert_eq!(store.gc(100).await.expect("gc").deleted, 1);
    let rows: Vec<(String, bool)> = admin
        .query(
            "SELECT key, gc_after = expires_at FROM idemgate_keys ORDER BY key",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows, [("live".to_string(), true)]);
}

/// A migration that cannot take its lock (a long transaction holds the table) gives up
/// within its lock timeout each time, says why at error level at every retry, and the
/// gateway becomes ready once the transaction ends; claims on the table meanwhile are not
/// held behind it.
#[tokio::test]
async fn a_migration_blocked_by_a_long_transaction_says_why_and_holds_no_claim() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let store = store_for(&db);
    store.migrate_through(4).await.expect("migrations 1-4");
    let holder = sql(&db).await;
    holder
        .batch_execute("BEGIN; LOCK TABLE idemgate_keys IN ACCESS SHARE MODE")
        .await
        .unwrap();
    let yaml = format!(
        "{}admin: {{ listen: 127.0.0.1:0 }}\n",
        config_yaml(&db, &up.url(), "")
    );
    let gw = GatewayProcess::start(&yaml).await;
    let c = client();
    let readyz = format!("http://{}/readyz", gw.admin.expect("an admin listener"));
    wait_until("the failure is logged", Duration::from_secs(30), || async {
        gw.log_text().contains("the migrations failed")
    })
    .await;
    let log = gw.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("the migrations failed"))
        .expect("the line");
    assert!(line.contains("ERROR"), "logged at error level: {line}");
    assert!(line.contains("long transaction"), "names the cause: {line}");
    assert_eq!(
        send(&c, http::Method::GET, &readyz, &[], "").await.status,
        503
    );
    // Meanwhile a client of the earlier release claims without waiting on the migration.
    let claimer = sql(&db).await;
    claimer
        .batch_execute("SET statement_timeout = '1s'")
        .await
        .unwrap();
    for i in 0..20 {
        claimer
            .execute(OLD_CLAIM, &[&format!("c{i}")])
            .await
            .expect("a claim is not held behind the migration");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every retry says it again at error level (not once per reason, as for a role that
    // may not migrate: this one the operator may not have seen the first time).
    wait_until(
        "the failure is said again at the next retry",
        Duration::from_secs(30),
        || async {
            gw.log_text()
                .lines()
                .filter(|l| l.contains("the migrations failed") && l.contains(" ERROR idemgate"))
                .count()
                >= 2
        },
    )
    .await;
    holder.batch_execute("COMMIT").await.unwrap();
    wait_until("ready", Duration::from_secs(30), || async {
        send(&c, http::Method::GET, &readyz, &[], "").await.status == 200
    })
    .await;
    assert_eq!(
        post_to(&c, &gw.url("/pay"), "a", "k", "{}").await.status,
        201
    );
}

/// A runtime role without CREATE (PostgreSQL 15's default on `public`): on a schema an
/// owner migrated it serves; with migrations pending it says once, at error level, which
/// role cannot apply them and that `idemgate migrate` must run with an owner role, and the
/// gateway becomes ready once that is done.
#[tokio::test]
async fn a_runtime_role_without_create_serves_a_migrated_schema_and_says_once_what_is_missing() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let admin = sql(&db).await;
    let name = db.rsplit('/').next().expect("a database name").to_string();
    let role = format!("rt_{name}");
    admin
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; REVOKE CREATE ON SCHEMA public FROM PUBLIC;"
        ))
        .await
        .unwrap();
    let runtime = db.replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
    assert_ne!(runtime, db, "the runtime role's URL");
    let yaml = format!(
        "{}admin: {{ listen: 127.0.0.1:0 }}\n",
        config_yaml(&runtime, &up.url(), "")
    );
    let gw = GatewayProcess::start(&yaml).await;
    let readyz = format!("http://{}/readyz", gw.admin.expect("an admin listener"));
    let c = client();
    wait_until(
        "the missing privilege is named",
        Duration::from_secs(30),
        || async { gw.log_text().contains("idemgate migrate") },
    )
    .await;
    // Several retries later (100 ms doubling), still said once.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let log = gw.log_text();
    let tries = log
        .lines()
        .filter(|l| l.contains("the migrations failed"))
        .count();
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("the migrations failed") && l.contains(" ERROR idemgate"))
        .collect();
    assert_eq!(said.len(), 1, "said at error level once: {log}");
    assert!(tries > 1, "and tried again meanwhile: {log}");
    assert!(said[0].contains(&role), "{}", said[0]);
    assert_eq!(
        send(&c, http::Method::GET, &readyz, &[], "").await.status,
        503
    );

    // The owner migrates and grants the runtime role its rows.
    let owner = store_for(&db);
    owner.migrate().await.expect("the owner migrates");
    owner
        .migrate_online()
        .await
        .expect("the owner's online part");
    admin
        .batch_execute(&format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}"
        ))
        .await
        .unwrap();
    wait_until("ready", Duration::from_secs(30), || async {
        send(&c, http::Method::GET, &readyz, &[], "").await.status == 200
    })
    .await;
    assert_eq!(
        post_to(&c, &gw.url("/pay"), "a", "k", "{}").await.status,
        201
    );
    assert!(
        post_to(&c, &gw.url("/pay"), "a", "k", "{}")
            .await
            .replayed()
    );
}
