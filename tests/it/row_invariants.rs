//! What the keys table's CHECK constraints used to guard, now guarded by the statements that
//! write (migrations/0005_lean_writes.sql): every row the gateway leaves is one of the four
//! states, an in-flight row has its lease, a completed row has its whole response; a
//! completion that would break that is refused. And the completion, which touches no indexed
//! column, is a HOT update.

use std::time::Duration;

use idemgate::store::postgres::{FINISH_SQL, MIGRATIONS};
use idemgate::store::{Claim, ClaimRequest, LeaseToken, Outcome};
use tokio_postgres::error::SqlState;

use crate::support::*;

/// Rows that break an invariant, by invariant; every count must be 0.
const VIOLATIONS_SQL: &str = "
SELECT count(*) FILTER (WHERE state NOT IN ('in_flight', 'completed', 'not_replayable', 'unknown')),
       count(*) FILTER (WHERE state = 'in_flight'
                          AND (lease_token IS NULL OR lease_expires_at IS NULL)),
       count(*) FILTER (WHERE state = 'completed'
                          AND (status IS NULL OR headers IS NULL OR body IS NULL)),
       count(*) FILTER (WHERE state <> 'in_flight'
                          AND (lease_token IS NOT NULL OR lease_expires_at IS NOT NULL)),
       count(*) FILTER (WHERE gc_after > expires_at),
       count(*)
  FROM idemgate_keys";

/// Asserts every invariant on every row; returns how many rows there are.
async fn assert_invariants(db: &tokio_postgres::Client, when: &str) -> i64 {
    let r = db.query_one(VIOLATIONS_SQL, &[]).await.unwrap();
    let names = [
        "a state outside the four",
        "an in-flight row without its lease",
        "a completed row without status, headers or body",
        "a finished row that still has a lease",
        "gc_after later than expires_at (the collector would find it late)",
    ];
    for (i, name) in names.iter().enumerate() {
        let n: i64 = r.get(i);
        if n > 0 {
            let rows = db
                .query(
                    "SELECT scope || '/' || key || ': ' || state FROM idemgate_keys",
                    &[],
                )
                .await
                .unwrap();
            let rows: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
            panic!("{when}: {n} row(s) with {name}; rows: {rows:?}");
        }
    }
    r.get(5)
}

/// What a completion writes: state, status, headers, body.
type Finish<'a> = (&'a str, Option<i32>, Option<&'a Vec<u8>>, Option<&'a [u8]>);

fn claim_req<'a>(key: &'a str, fp: &'a [u8; 32], lease: Duration) -> ClaimRequest<'a> {
    ClaimRequest {
        scope: "s",
        key,
        route: "payments",
        fingerprint: fp,
        lease,
        ttl: Duration::from_secs(60),
        hold_expired_leases: false,
    }
}

fn stored(body: &str) -> idemgate::replay::StoredResponse {
    idemgate::replay::StoredResponse {
        status: 201,
        headers: vec![(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/plain"),
        )],
        body: bytes::Bytes::from(body.to_string()),
    }
}

async fn acquired(gw: &TestGateway, key: &str, fp: &[u8; 32], lease: Duration) -> LeaseToken {
    match gw.store.claim(claim_req(key, fp, lease)).await.unwrap() {
        Claim::Acquired { token, .. } => token,
        other => panic!("{key}: expected to acquire it, got {other:?}"),
    }
}

#[tokio::test]
async fn every_row_keeps_its_invariants_through_the_gateways_flows() {
    let up = Upstream::start().await;
    let (gw, _) = TestGateway::on_with(
        Backend::Postgres,
        &up,
        "lease: 5s\n      on_unknown_outcome: hold\n      max_stored_response: 1KiB",
        |y| y.patch("timeout: 5s", "timeout: 500ms"),
    )
    .await;
    let db = gw.sql().await;
    let checks: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_constraint
              WHERE conrelid = 'idemgate_keys'::regclass AND contype = 'c'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(checks, 0, "no CHECK: each costs a parse at every statement");
    let c = client();

    // Completed (2xx and 4xx), replayed, and refused on another body.
    assert_eq!(post(&c, &gw, "a", "k-201", "x").await.status, 201);
    assert!(post(&c, &gw, "a", "k-201", "x").await.replayed());
    assert_eq!(post(&c, &gw, "a", "k-201", "y").await.status, 422);
    up.set(Behavior {
        status: 400,
        ..Default::default()
    });
    assert_eq!(post(&c, &gw, "a", "k-400", "x").await.status, 400);
    // Released (a retry status), then forwarded again and completed.
    up.set(Behavior {
        script: vec![503],
        ..Default::default()
    });
    assert_eq!(post(&c, &gw, "a", "k-503", "x").await.status, 503);
    assert_eq!(post(&c, &gw, "a", "k-503", "x").await.status, 201);
    // Too large to store.
    up.set(Behavior {
        body: Some(bytes::Bytes::from(vec![b'z'; 5000])),
        ..Default::default()
    });
    assert_eq!(post(&c, &gw, "a", "k-big", "x").await.status, 201);
    assert_eq!(
        row_state(&gw, "a", "k-big").await.as_deref(),
        Some("not_replayable")
    );
    // Outcome unknown, held.
    up.set(Behavior {
        delay: Duration::from_millis(3000),
        ..Default::default()
    });
    assert_eq!(post(&c, &gw, "a", "k-unknown", "x").await.status, 504);
    assert_eq!(
        row_state(&gw, "a", "k-unknown").await.as_deref(),
        Some("unknown")
    );
    // In flight, with a duplicate waiting for it (the completion announces).
    up.set(Behavior {
        delay: Duration::from_millis(300),
        ..Default::default()
    });
    let first = in_flight(&gw.url("/pay"), &up, "a", "k-wait", "x").await;
    assert_eq!(
        row_state(&gw, "a", "k-wait").await.as_deref(),
        Some("in_flight")
    );
    assert_invariants(&db, "with a request in flight").await;
    let dup = post(&c, &gw, "a", "k-wait", "x").await;
    assert_eq!(first.await.unwrap().status, 201);
    assert!(dup.replayed());

    // Through the store: a live lease left in flight, a takeover, a finish with a lost lease,
    // and an outcome recorded as unknown.
    let fp = [9u8; 32];
    acquired(&gw, "live", &fp, Duration::from_secs(60)).await;
    let old = acquired(&gw, "taken", &fp, Duration::from_millis(50)).await;
    let new = loop {
        match gw
            .store
            .claim(claim_req("taken", &fp, Duration::from_secs(60)))
            .await
            .unwrap()
        {
            Claim::Acquired { token, took_over } => {
                assert!(took_over);
                break token;
            }
            Claim::InFlight { .. } => tokio::time::sleep(Duration::from_millis(20)).await,
            other => panic!("unexpected {other:?}"),
        }
    };
    let ttl = Duration::from_secs(60);
    let finish = |token: LeaseToken, outcome: Outcome| {
        let store = gw.store.clone();
        async move { store.finish("s", "taken", &token, outcome, ttl).await }
    };
    assert!(
        !finish(old, Outcome::Completed(stored("old")))
            .await
            .unwrap()
    );
    assert!(
        finish(new, Outcome::Completed(stored("new")))
            .await
            .unwrap()
    );
    let token = acquired(&gw, "unknown", &fp, ttl).await;
    assert!(
        gw.store
            .finish("s", "unknown", &token, Outcome::Unknown, ttl)
            .await
            .unwrap()
    );

    let rows = assert_invariants(&db, "after every flow").await;
    assert_eq!(
        rows, 9,
        "every flow left its row (the released one completed later)"
    );
}

/// The statement that completes a row refuses a state without what it needs: a `completed`
/// row without its response, an `in_flight` row without a lease, a state outside the four.
/// Nothing is written; the attempt's row stays in flight under its lease.
#[tokio::test]
async fn a_completion_that_would_break_a_row_is_refused_and_writes_nothing() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let fp = [4u8; 32];
    let token = acquired(&gw, "k", &fp, Duration::from_secs(60)).await;
    let db = gw.sql().await;
    let token = token.0.as_str();
    let body: &[u8] = b"b";
    let headers: Vec<u8> = Vec::new();
    let ttl_ms = 60_000i64;
    let id = "k-id";
    let cases: [Finish; 5] = [
        ("completed", Some(201), Some(&headers), None),
        ("completed", Some(201), None, Some(body)),
        ("completed", None, Some(&headers), Some(body)),
        ("in_flight", None, None, None),
        ("done", Some(201), Some(&headers), Some(body)),
    ];
    for (state, status, headers, body) in cases {
        let err = db
            .query_opt(
                FINISH_SQL,
                &[
                    &"s", &"k", &token, &state, &status, &headers, &body, &ttl_ms, &id,
                ],
            )
            .await
            .expect_err(state);
        assert_eq!(
            err.code(),
            Some(&SqlState::NOT_NULL_VIOLATION),
            "{state}: {err}"
        );
    }
    assert_eq!(
        gw.store
            .inspect("s", "k")
            .await
            .unwrap()
            .map(|i| i.state)
            .as_deref(),
        Some("in_flight")
    );
    assert_invariants(&db, "after the refused completions").await;
    // The right completion still goes through, once.
    let ok = db
        .query_opt(
            FINISH_SQL,
            &[
                &"s",
                &"k",
                &token,
                &"completed",
                &Some(201i32),
                &Some(&headers),
                &Some(body),
                &ttl_ms,
                &id,
            ],
        )
        .await
        .unwrap();
    assert!(ok.is_some());
    assert_eq!(
        gw.store
            .inspect("s", "k")
            .await
            .unwrap()
            .map(|i| i.state)
            .as_deref(),
        Some("completed")
    );
}

/// A completion changes no indexed column, so PostgreSQL updates the row in place on its
/// page (HOT): no new index entries. Counted by `pg_stat_user_tables`, which a backend
/// reports within a second or so of going idle.
#[tokio::test]
async fn completions_are_hot_updates() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let fp = [5u8; 32];
    let ttl = Duration::from_secs(60);
    let n = 50i64;
    for i in 0..n {
        let key = format!("k{i}");
        let token = acquired(&gw, &key, &fp, ttl).await;
        assert!(
            gw.store
                .finish("s", &key, &token, Outcome::Completed(stored(&key)), ttl)
                .await
                .unwrap()
        );
    }
    let db = gw.sql().await;
    let counts = async || -> (i64, i64) {
        let r = db
            .query_one(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
                  WHERE relname = 'idemgate_keys'",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    wait_until(
        "the completions are counted",
        Duration::from_secs(20),
        || async { counts().await.0 >= n },
    )
    .await;
    assert_eq!(counts().await, (n, n), "(updates, of which HOT)");
}

/// A keys table partitioned by scope as docs/operations.md showed before this migration
/// (CHECKs copied, an index on expires_at named by PostgreSQL) is migrated too.
#[tokio::test]
async fn a_keys_table_partitioned_before_the_upgrade_is_migrated() {
    let db_url = pg::fresh_database().await;
    let db = sql(&db_url).await;
    db.batch_execute(
        "CREATE TABLE idemgate_migrations (
            version integer PRIMARY KEY,
            name text NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .await
    .unwrap();
    for (version, name, text) in MIGRATIONS.iter().filter(|m| m.0 <= 3) {
        db.batch_execute(text).await.unwrap();
        db.execute(
            "INSERT INTO idemgate_migrations (version, name) VALUES ($1, $2)",
            &[version, name],
        )
        .await
        .unwrap();
    }
    db.batch_execute(
        "BEGIN;
         INSERT INTO idemgate_keys (scope, key, route, fingerprint, state, status, headers, body, expires_at)
         VALUES ('old', 'gone', 'r', '\\x00', 'completed', 201, '', 'b', now() - interval '1 hour'),
                ('old', 'kept', 'r', '\\x00', 'completed', 201, '', 'b', now() + interval '1 hour');
         ALTER TABLE idemgate_keys RENAME TO idemgate_keys_old;
         CREATE TABLE idemgate_keys (LIKE idemgate_keys_old INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
           PARTITION BY HASH (scope);
         ALTER TABLE idemgate_keys ADD PRIMARY KEY (scope, key);
         CREATE INDEX ON idemgate_keys (expires_at);
         CREATE TABLE idemgate_keys_p0 PARTITION OF idemgate_keys FOR VALUES WITH (MODULUS 2, REMAINDER 0);
         CREATE TABLE idemgate_keys_p1 PARTITION OF idemgate_keys FOR VALUES WITH (MODULUS 2, REMAINDER 1);
         INSERT INTO idemgate_keys SELECT * FROM idemgate_keys_old;
         DROP TABLE idemgate_keys_old;
         COMMIT;",
    )
    .await
    .unwrap();

    let up = Upstream::start().await;
    let gw = TestGateway::start(&config_yaml(&db_url, &up.url(), ""), &db_url).await;
    let expires_indexes: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_indexes
              WHERE tablename LIKE 'idemgate_keys%' AND indexdef LIKE '%(expires_at)'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(expires_indexes, 0, "no index on expires_at is left");
    // The gc_after index, built concurrently partition by partition after the migrations'
    // transaction, while the gateway serves: valid on the parent once every one is attached.
    wait_until(
        "the gc_after index is built on every partition",
        Duration::from_secs(30),
        || async {
            db.query_one(
                "SELECT count(*) FILTER (WHERE i.indisvalid) = 3 AND count(*) = 3
                   FROM pg_index i
                   JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                  WHERE i.indrelid::regclass::text LIKE 'idemgate_keys%'
                    AND i.indnatts = 1 AND a.attname = 'gc_after'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
        },
    )
    .await;
    let fillfactors: Vec<String> = db
        .query(
            "SELECT relname || ' ' || coalesce(array_to_string(reloptions, ','), '')
               FROM pg_class WHERE relname IN ('idemgate_keys_p0', 'idemgate_keys_p1')
              ORDER BY relname",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        fillfactors,
        [
            "idemgate_keys_p0 fillfactor=90",
            "idemgate_keys_p1 fillfactor=90"
        ]
    );
    assert_invariants(&db, "after the migration").await;
    let c = client();
    assert_eq!(post(&c, &gw, "a", "k", "x").await.status, 201);
    assert!(post(&c, &gw, "a", "k", "x").await.replayed());
    assert_eq!(gw.store.gc(10).await.unwrap().deleted, 1);
    assert!(gw.store.inspect("old", "kept").await.unwrap().is_some());
    assert_invariants(&db, "after the gateway ran on it").await;
}
