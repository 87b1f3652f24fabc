//! Group commit on the PostgreSQL store (`store.postgres.batch_keys`, src/store/pg_batch.rs):
//! requests waiting at the same moment share one claim statement and one completion
//! statement, and every key keeps its own answer. To make batches form whatever the
//! machine's speed, each test holds the keys table locked against writes while its requests
//! queue behind the statements the lock blocks, then lets them all go.

use std::time::Duration;

use http::Method;
use idemgate::store::{ClaimRequest, Outcome};

use crate::support::*;

backend_tests!(
    postgres: Postgres, pgbouncer: Pgbouncer, partitioned: Partitioned;
    [
        new_keys_waiting_together_share_statements_and_keep_their_own_answers,
        keys_that_exist_in_a_batch_are_left_to_the_full_claim,
        a_batched_completion_is_fenced_by_each_keys_own_lease,
        while_a_statement_runs_the_next_batch_gathers_until_it_ends,
    ]
);

/// A session holding the keys table locked against writes (claims and completions wait;
/// reads do not), until [`release`].
async fn lock_writes(gw: &TestGateway) -> tokio_postgres::Client {
    let c = sql(&gw.db).await;
    c.batch_execute("BEGIN; LOCK TABLE idemgate_keys IN EXCLUSIVE MODE")
        .await
        .expect("locking the keys table");
    c
}

/// Waits until a statement of the gateway waits for the lock, lets the other requests
/// queue behind it for a while (well within the 3s `acquire_timeout` and
/// `statement_timeout` of [`gateway`]), and releases the lock.
async fn release_after_queueing(gw: &TestGateway, lock: tokio_postgres::Client) {
    let db = gw.sql().await;
    wait_until(
        "a statement waits for the lock",
        Duration::from_secs(10),
        || async { lock_waiters(&db).await > 0 },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    lock.batch_execute("COMMIT")
        .await
        .expect("releasing the lock");
}

/// `idemgate_store_batch_keys` for `op`: (statements, keys).
async fn batches(gw: &TestGateway, op: &str) -> (f64, f64) {
    let text =
        String::from_utf8_lossy(&admin_request(gw, Method::GET, "/metrics", None).await.body)
            .to_string();
    (
        metric(
            &text,
            &format!("idemgate_store_batch_keys_count{{op=\"{op}\"}}"),
        ),
        metric(
            &text,
            &format!("idemgate_store_batch_keys_sum{{op=\"{op}\"}}"),
        ),
    )
}

/// A gateway on a fresh store of kind `b` whose requests may wait 3s for a connection (the
/// queue behind a held lock counts) and 3s for a statement.
async fn gateway(b: Backend, up: &Upstream) -> (TestGateway, Option<TempDb>) {
    TestGateway::on_with(b, up, "", |y| {
        y.patch("acquire_timeout: 500ms", "acquire_timeout: 3s")
            .patch("statement_timeout: 1s", "statement_timeout: 3s")
    })
    .await
}

async fn rows_in(gw: &TestGateway, state: &str) -> i64 {
    gw.sql()
        .await
        .query_one(
            "SELECT count(*) FROM idemgate_keys WHERE state = $1",
            &[&state],
        )
        .await
        .unwrap()
        .get(0)
}

async fn new_keys_waiting_together_share_statements_and_keep_their_own_answers(b: Backend) {
    const N: usize = 40;
    let up = Upstream::start().await;
    let (gw, _file) = gateway(b, &up).await;
    let keys: Vec<(String, String)> = (0..N)
        .map(|i| (format!("acct-{}", i % 3), format!("k{i}")))
        .collect();

    let lock = lock_writes(&gw).await;
    let urls = vec![gw.url("/pay")];
    let sent = {
        let (urls, keys) = (urls.clone(), keys.clone());
        tokio::spawn(async move { at_once(&urls, keys, "{\"amount\":1}").await })
    };
    release_after_queueing(&gw, lock).await;
    let first = sent.await.unwrap();

    // Every key was executed once and got an answer of its own.
    assert!(first.iter().all(|r| r.status == 201), "{first:?}");
    assert_eq!(up.executions(), N);
    let mut bodies: Vec<&[u8]> = first.iter().map(|r| &r.body[..]).collect();
    bodies.sort();
    bodies.dedup();
    assert_eq!(bodies.len(), N, "two keys got the same answer");
    assert_eq!(rows_in(&gw, "completed").await, N as i64);

    // Fewer claim statements than keys: the claims queued behind the lock shared them.
    let (statements, claimed) = batches(&gw, "claim_new").await;
    assert_eq!(claimed, N as f64);
    assert!(
        statements < N as f64,
        "{statements} statements for {N} keys"
    );
    let (_, finished) = batches(&gw, "finish").await;
    assert_eq!(finished, N as f64);

    // Each retry gets its own key's stored answer.
    let again = at_once(&urls, keys, "{\"amount\":1}").await;
    for (a, b) in first.iter().zip(&again) {
        assert_eq!(b.status, 201);
        assert!(b.replayed(), "{b:?}");
        assert_eq!(a.body, b.body);
    }
    assert_eq!(up.executions(), N);
}

/// Under load the free statement slot does not go to whichever request came first, alone:
/// while another claim statement is in the database, the next batch keeps gathering until
/// that statement ends, and then carries everyone who came meanwhile.
async fn while_a_statement_runs_the_next_batch_gathers_until_it_ends(b: Backend) {
    const N: usize = 20;
    const BODY: &str = "{\"amount\":1}";
    let up = Upstream::start().await;
    let (gw, _file) = gateway(b, &up).await;
    let db = gw.sql().await;
    let urls = vec![gw.url("/pay")];

    // The first claim goes alone (nothing else runs) and waits for the lock.
    let lock = lock_writes(&gw).await;
    let first = {
        let urls = urls.clone();
        let key = vec![("acct-1".to_string(), "first".to_string())];
        tokio::spawn(async move { at_once(&urls, key, BODY).await })
    };
    wait_until(
        "the first claim waits for the lock",
        Duration::from_secs(10),
        || async { lock_waiters(&db).await == 1 },
    )
    .await;

    // N more come while it waits: all of them read and holding their bodies...
    let rest = {
        let urls = urls.clone();
        let keys: Vec<(String, String)> = (0..N)
            .map(|i| (format!("acct-{}", i % 3), format!("k{i}")))
            .collect();
        tokio::spawn(async move { at_once(&urls, keys, BODY).await })
    };
    let held = ((N + 1) * BODY.len()) as f64;
    wait_until(
        "every request holds its body",
        Duration::from_secs(10),
        || async {
            let text = admin_request(&gw, Method::GET, "/metrics", None).await.body;
            metric(&String::from_utf8_lossy(&text), "idemgate_buffered_bytes ") == held
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // ...and none of them took the free slot alone: still one statement in the database.
    assert_eq!(lock_waiters(&db).await, 1, "a second statement was sent");
    lock.batch_execute("COMMIT")
        .await
        .expect("releasing the lock");

    let first = first.await.unwrap();
    let rest = rest.await.unwrap();
    assert!(
        first.iter().chain(&rest).all(|r| r.status == 201),
        "{first:?} {rest:?}"
    );
    assert_eq!(up.executions(), N + 1);
    // Two claim statements: the first key alone, then the N that gathered behind it.
    assert_eq!(batches(&gw, "claim_new").await, (2.0, (N + 1) as f64));
}

async fn keys_that_exist_in_a_batch_are_left_to_the_full_claim(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _file) = gateway(b, &up).await;
    let c = client();
    let mut old = Vec::new();
    for i in 0..10 {
        let r = post(&c, &gw, "a", &format!("old{i}"), "{}").await;
        assert_eq!(r.status, 201);
        old.push(r);
    }

    // Completed keys, new keys, and every new key twice: all in the same queue.
    let mut keys: Vec<(String, String)> =
        (0..10).map(|i| ("a".into(), format!("old{i}"))).collect();
    for i in 0..10 {
        keys.push(("a".into(), format!("new{i}")));
        keys.push(("a".into(), format!("new{i}")));
    }
    let lock = lock_writes(&gw).await;
    let urls = vec![gw.url("/pay")];
    let sent = tokio::spawn(async move { at_once(&urls, keys, "{}").await });
    release_after_queueing(&gw, lock).await;
    let replies = sent.await.unwrap();

    assert!(replies.iter().all(|r| r.status == 201), "{replies:?}");
    for (before, now) in old.iter().zip(&replies[..10]) {
        assert!(now.replayed(), "{now:?}");
        assert_eq!(before.body, now.body);
    }
    for pair in replies[10..].chunks(2) {
        assert_eq!(pair[0].body, pair[1].body, "one key, two answers");
        assert!(pair[0].replayed() != pair[1].replayed(), "{pair:?}");
    }
    // Ten old executions and one per new key, however the batches fell.
    assert_eq!(up.executions(), 20);
    assert_eq!(rows_in(&gw, "completed").await, 20);
    // And they did fall in batches: fewer claim statements than the keys they carried.
    let (statements, claimed) = batches(&gw, "claim_new").await;
    assert!(
        statements < claimed,
        "{statements} statements for {claimed} keys"
    );
}

async fn a_batched_completion_is_fenced_by_each_keys_own_lease(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _file) = gateway(b, &up).await;
    let fp = [9u8; 32];
    let mut tokens = Vec::new();
    for i in 0..6 {
        let key = format!("f{i}");
        let claim = gw
            .store
            .claim(ClaimRequest {
                scope: "s",
                key: &key,
                route: "r",
                fingerprint: &fp,
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(60),
                hold_expired_leases: false,
            })
            .await
            .unwrap();
        let idemgate::store::Claim::Acquired { token, .. } = claim else {
            panic!("f{i} was not claimed: {claim:?}")
        };
        tokens.push((key, token));
    }
    // Another attempt took f3 over: its first attempt's completion must write nothing.
    let db = gw.sql().await;
    db.execute(
        "UPDATE idemgate_keys SET lease_token = gen_random_uuid() WHERE key = 'f3'",
        &[],
    )
    .await
    .unwrap();

    let lock = lock_writes(&gw).await;
    let finishing: Vec<_> = tokens
        .into_iter()
        .map(|(key, token)| {
            let store = gw.store.clone();
            tokio::spawn(async move {
                let answer = idemgate::replay::StoredResponse {
                    status: 201,
                    headers: vec![(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("text/plain"),
                    )],
                    body: bytes::Bytes::from(format!("answer of {key}")),
                };
                store
                    .finish(
                        "s",
                        &key,
                        &token,
                        Outcome::Completed(answer),
                        Duration::from_secs(60),
                    )
                    .await
                    .unwrap()
            })
        })
        .collect();
    release_after_queueing(&gw, lock).await;
    let mut written = Vec::new();
    for f in finishing {
        written.push(f.await.unwrap());
    }

    assert_eq!(written, [true, true, true, false, true, true]);
    let (statements, finished) = batches(&gw, "finish").await;
    assert_eq!(finished, 6.0);
    assert!(
        statements < 6.0,
        "{statements} statements for 6 completions"
    );
    for i in 0..6 {
        let row = db
            .query_one(
                "SELECT state, convert_from(body, 'UTF8') FROM idemgate_keys WHERE key = $1",
                &[&format!("f{i}")],
            )
            .await
            .unwrap();
        let (state, body): (String, Option<String>) = (row.get(0), row.get(1));
        if i == 3 {
            assert_eq!((state.as_str(), body), ("in_flight", None));
        } else {
            assert_eq!(state, "completed");
            assert_eq!(body.as_deref(), Some(format!("answer of f{i}").as_str()));
        }
    }
}
