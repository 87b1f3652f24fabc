//! The claim statement itself, under the READ COMMITTED races it must survive.

use std::time::Duration;

use idemgate::store::{Claim, ClaimRequest};

use crate::support::*;

fn req<'a>(key: &'a str, fp: &'a [u8; 32], lease: Duration) -> ClaimRequest<'a> {
    ClaimRequest {
        scope: "s",
        key,
        route: "r",
        fingerprint: fp,
        lease,
        ttl: Duration::from_secs(60),
        hold_expired_leases: false,
    }
}

/// A claim whose snapshot predates a concurrent takeover must not act on the old version
/// of the row (here: an expired lease, which would read as "held" or be taken over twice).
#[tokio::test]
async fn a_claim_blocked_behind_a_takeover_sees_the_new_row_not_its_snapshot() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let fp = [7u8; 32];
    let first = gw
        .store
        .claim(req("k", &fp, Duration::from_millis(100)))
        .await
        .unwrap();
    assert!(matches!(first, Claim::Acquired { .. }));
    let db = gw.sql().await;
    wait_until("the lease expires", Duration::from_secs(10), || async {
        db.query_one("SELECT lease_expires_at <= now() FROM idemgate_keys", &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
    })
    .await;

    // Another instance takes the row over, and has not committed yet.
    let mut other = sql(&gw.db).await;
    let tx = other.transaction().await.unwrap();
    tx.execute(
        "UPDATE idemgate_keys SET lease_token = gen_random_uuid(),
                lease_expires_at = now() + interval '1 hour', attempts = attempts + 1",
        &[],
    )
    .await
    .unwrap();

    // Our claim starts now (its snapshot sees the expired lease) and blocks on the row lock.
    let store = gw.store.clone();
    let ours = tokio::spawn(async move {
        let fp = [7u8; 32];
        store.claim(req("k", &fp, Duration::from_secs(5))).await
    });
    wait_for_a_lock_waiter(&db).await;
    tx.commit().await.unwrap();

    match ours.await.unwrap().unwrap() {
        Claim::InFlight { lease_remaining } => {
            assert!(
                lease_remaining > Duration::from_secs(60),
                "the new lease: {lease_remaining:?}"
            )
        }
        other => panic!("acted on a stale snapshot: {other:?}"),
    }
}

/// The transaction id that last wrote or locked the key's row (`xmax`, 0 when none did since
/// its version was written) and the version itself (`ctid`).
async fn row_version(db: &tokio_postgres::Client, key: &str) -> (String, String) {
    let row = db
        .query_one(
            "SELECT xmax::text, ctid::text FROM idemgate_keys WHERE key = $1",
            &[&key],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// A replay served from the store is a read: twenty claims of a completed key lock nothing
/// and write nothing (the row keeps its version and its `xmax`), and a waiter's second look
/// at a key in flight does not rewrite the row either.
#[tokio::test]
async fn a_replay_and_a_waiters_look_write_nothing() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let db = gw.sql().await;
    let fp = [3u8; 32];
    let Claim::Acquired { token, .. } = gw
        .store
        .claim(req("done", &fp, Duration::from_secs(30)))
        .await
        .unwrap()
    else {
        panic!("a new key is claimed")
    };
    let answer = idemgate::replay::StoredResponse {
        status: 201,
        headers: vec![],
        body: bytes::Bytes::from_static(b"the answer"),
    };
    let written = gw
        .store
        .finish(
            "s",
            "done",
            &token,
            idemgate::store::Outcome::Completed(answer),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert!(written);
    let before = row_version(&db, "done").await;
    for _ in 0..20 {
        let replay = gw
            .store
            .claim(req("done", &fp, Duration::from_secs(30)))
            .await
            .unwrap();
        assert!(matches!(replay, Claim::Completed(..)), "{replay:?}");
    }
    assert_eq!(
        row_version(&db, "done").await,
        before,
        "a replay wrote the row"
    );

    // In flight: the first waiter marks the row once; later looks only read it.
    let Claim::Acquired { .. } = gw
        .store
        .claim(req("busy", &fp, Duration::from_secs(30)))
        .await
        .unwrap()
    else {
        panic!("a new key is claimed")
    };
    assert!(gw.store.watch("s", "busy").await.unwrap());
    let marked = row_version(&db, "busy").await;
    for _ in 0..5 {
        assert!(
            gw.store.watch("s", "busy").await.unwrap(),
            "still in flight"
        );
        let look = gw
            .store
            .claim(req("busy", &fp, Duration::from_secs(30)))
            .await
            .unwrap();
        assert!(matches!(look, Claim::InFlight { .. }), "{look:?}");
    }
    assert_eq!(
        row_version(&db, "busy").await,
        marked,
        "a look rewrote the row"
    );
}

/// A database whose default isolation is serializable still answers duplicates (the
/// gateway's sessions run at read committed), never 503 for a serialization failure.
#[tokio::test]
async fn a_serializable_database_answers_duplicates_without_503() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(300),
        ..Behavior::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let admin = sql(&db).await;
    admin
        .batch_execute(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET default_transaction_isolation \
             = ''serializable''', current_database()); END $$",
        )
        .await
        .unwrap();
    let gw = TestGateway::start(&config_yaml(&db, &up.url(), ""), &db).await;
    let replies = at_once(
        &[gw.url("/pay")],
        (0..16)
            .map(|i| (format!("a{}", i % 2), "same".to_string()))
            .collect(),
        "{}",
    )
    .await;
    for r in &replies {
        assert_eq!(r.status, 201, "{r:?}");
    }
    assert_eq!(up.executions(), 2, "one per account");
}

/// Behind a pooler in transaction mode the gateway cannot set its sessions' isolation: a
/// database whose default is serializable is refused before serving, naming the fix, and
/// never reported ready.
#[tokio::test]
async fn a_serializable_database_behind_a_pooler_is_refused_naming_the_fix() {
    use idemgate::store::{Store, StoreError};
    let (direct, pooled) = crate::support::pgbouncer::fresh_database().await;
    let pg_of = |yaml: &str| {
        let config = idemgate::config::Config::from_yaml(yaml).expect("config");
        let idemgate::config::StoreConfig::Postgres(pg) = config.store else {
            panic!("a postgres store");
        };
        idemgate::store::postgres::PgStore::new(&pg).expect("store")
    };
    // Migrated directly, before the pooler opens a session to the database.
    pg_of(&config_yaml(&direct, "http://127.0.0.1:9", ""))
        .migrate()
        .await
        .expect("migrations");
    sql(&direct)
        .await
        .batch_execute(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET default_transaction_isolation \
             = ''serializable''', current_database()); END $$",
        )
        .await
        .unwrap();
    let store = pg_of(&config_yaml_pgbouncer(
        &pooled,
        &direct,
        "http://127.0.0.1:9",
        "",
    ));
    for (what, result) in [
        ("durability", store.durability().await),
        ("ready", store.ready().await),
    ] {
        match result {
            Err(StoreError::NotDurable(why)) => {
                assert!(why.contains("serializable"), "{what}: {why}");
                assert!(why.contains("ALTER ROLE"), "{what}: {why}");
            }
            other => panic!("{what}: expected a refusal, got {other:?}"),
        }
    }
}
