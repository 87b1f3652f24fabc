//! Group commit on the PostgreSQL store (`store.postgres.batch_keys`, src/store/postgres/batch.rs):
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
    ]
);

// With a pool of two connections (the pooler keeps its own pool, so these run on the direct
// stores): what gathers, and what one key's lock does to the others of its batch.
backend_tests!(
    direct: Postgres, direct_partitioned: Partitioned;
    [
        a_batch_gathers_only_while_every_connection_is_busy,
        a_locked_row_fails_no_other_claim_of_its_batch,
        a_locked_row_fails_no_other_completion_of_its_batch,
        a_statement_error_on_one_key_fails_no_other_claim_of_its_batch,
        a_statement_timeout_on_one_key_fails_no_other_claim_of_its_batch,
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

/// Waits until a statement of the gateway waits for the lock and every request the test
/// sent is in the gateway (it holds `bodies` bytes of request bodies: none can be answered
/// while the lock is held), then releases the lock.
async fn release_once_queued(gw: &TestGateway, lock: tokio_postgres::Client, bodies: usize) {
    wait_for_the_lock(gw).await;
    wait_bodies_held(gw, bodies).await;
    lock.batch_execute("COMMIT")
        .await
        .expect("releasing the lock");
}

/// Waits until a statement of the gateway waits for the lock.
async fn wait_for_the_lock(gw: &TestGateway) {
    let db = gw.sql().await;
    wait_until(
        "a statement waits for the lock",
        Duration::from_secs(10),
        || async { lock_waiters(&db).await > 0 },
    )
    .await;
}

/// A store call, not yet polled.
type StoreCall<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// Polls each store call once, then runs them on as tasks. A batched store call queues its
/// ask before its first wait (`batch::Queue::ask`), so when this returns every one of them
/// is queued, whatever the scheduler does next.
async fn queued<T: Send + 'static>(
    mut calls: Vec<StoreCall<T>>,
) -> Vec<tokio::task::JoinHandle<T>> {
    std::future::poll_fn(|cx| {
        for call in &mut calls {
            assert!(
                call.as_mut().poll(cx).is_pending(),
                "a store call was answered before its batch could run"
            );
        }
        std::task::Poll::Ready(())
    })
    .await;
    calls.into_iter().map(tokio::spawn).collect()
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
    release_once_queued(&gw, lock, N * "{\"amount\":1}".len()).await;
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

/// A gateway with two pooled connections, 3s to get one and 1s per statement.
async fn two_connections(b: Backend, up: &Upstream) -> (TestGateway, Option<TempDb>) {
    TestGateway::on_with(b, up, "", |y| {
        y.patch("pool_size: 8", "pool_size: 2")
            .patch("acquire_timeout: 500ms", "acquire_timeout: 3s")
    })
    .await
}

/// As [`two_connections`], with statements that may take 10 s: a statement waiting on a held
/// row outlasts the checks made while it waits.
async fn two_patient_connections(b: Backend, up: &Upstream) -> (TestGateway, Option<TempDb>) {
    TestGateway::on_with(b, up, "", |y| {
        y.patch("pool_size: 8", "pool_size: 2")
            .patch("acquire_timeout: 500ms", "acquire_timeout: 3s")
            .patch("statement_timeout: 1s", "statement_timeout: 10s")
    })
    .await
}

/// Keyed POSTs sent at once, in a task.
fn send_keys(gw: &TestGateway, keys: &[&str]) -> tokio::task::JoinHandle<Vec<Reply>> {
    let urls = vec![gw.url("/pay")];
    let keys: Vec<(String, String)> = keys
        .iter()
        .map(|k| ("acct".to_string(), k.to_string()))
        .collect();
    tokio::spawn(async move { at_once(&urls, keys, "{\"amount\":1}").await })
}

/// While a pooled connection is idle, a request goes at once, alone: a batch gathers only
/// once every connection is busy, and then carries everyone who came meanwhile.
async fn a_batch_gathers_only_while_every_connection_is_busy(b: Backend) {
    const N: usize = 12;
    let up = Upstream::start().await;
    let (gw, _file) = two_connections(b, &up).await;
    let db = gw.sql().await;
    let lock = lock_writes(&gw).await;
    // The first claim takes a connection and waits for the lock; the second, sent after it,
    // does not wait for the first to gather company: it takes the idle connection.
    let first = send_keys(&gw, &["first"]);
    wait_until(
        "the first claim waits for the lock",
        Duration::from_secs(10),
        || async { lock_waiters(&db).await == 1 },
    )
    .await;
    let second = send_keys(&gw, &["second"]);
    wait_until(
        "the second claim waits beside it",
        Duration::from_secs(10),
        || async { lock_waiters(&db).await == 2 },
    )
    .await;
    // Both connections are busy now: the next ones gather, every body read and held.
    let keys: Vec<String> = (0..N).map(|i| format!("k{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let rest = send_keys(&gw, &refs);
    let held = ((N + 2) * "{\"amount\":1}".len()) as f64;
    wait_until(
        "every request holds its body",
        Duration::from_secs(10),
        || async {
            let text = admin_request(&gw, Method::GET, "/metrics", None).await.body;
            metric(&String::from_utf8_lossy(&text), "idemgate_buffered_bytes ") == held
        },
    )
    .await;
    assert_eq!(
        lock_waiters(&db).await,
        2,
        "only the two connections' statements wait"
    );
    lock.batch_execute("COMMIT")
        .await
        .expect("releasing the lock");
    let mut replies: Vec<Reply> = Vec::new();
    for t in [first, second, rest] {
        replies.extend(t.await.unwrap());
    }
    assert!(replies.iter().all(|r| r.status == 201), "{replies:?}");
    assert_eq!(up.executions(), N + 2);
    // Each of the first two alone; the N that came while both were busy in fewer statements.
    let (statements, claimed) = batches(&gw, "claim_new").await;
    assert_eq!(claimed, (N + 2) as f64);
    assert!(
        (3.0..(N + 2) as f64).contains(&statements),
        "{statements} statements for {} keys",
        N + 2
    );
}

/// An operator's transaction holds a row of the keys table (updated, not committed) and,
/// until [`ROLLBACK TO SAVEPOINT`](release_table), the whole table against writes.
async fn hold_row_and_table(gw: &TestGateway, key: &str) -> tokio_postgres::Client {
    let c = sql(&gw.db).await;
    c.batch_execute("BEGIN").await.unwrap();
    let n = c
        .execute(
            "UPDATE idemgate_keys SET expires_at = expires_at WHERE key = $1",
            &[&key],
        )
        .await
        .unwrap();
    assert_eq!(n, 1, "the row to hold exists");
    c.batch_execute("SAVEPOINT table_lock; LOCK TABLE idemgate_keys IN EXCLUSIVE MODE")
        .await
        .unwrap();
    c
}

/// Lets the table go, keeping the row.
async fn release_table(c: &tokio_postgres::Client) {
    c.batch_execute("ROLLBACK TO SAVEPOINT table_lock")
        .await
        .unwrap();
}

/// A claim of a key whose row an operator holds shares its batch with new keys: they are
/// claimed and forwarded, each once, while the row is still held, and the held key's retry
/// is replayed from its row.
async fn a_locked_row_fails_no_other_claim_of_its_batch(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _file) = two_patient_connections(b, &up).await;
    let c = client();
    assert_eq!(
        post(&c, &gw, "acct", "held", "{\"amount\":1}").await.status,
        201
    );
    let db = gw.sql().await;
    let operator = hold_row_and_table(&gw, "held").await;
    // Two claims take the two connections and wait for the table...
    let first = send_keys(&gw, &["a1", "a2"]);
    wait_until(
        "two claims wait for the table",
        Duration::from_secs(10),
        || async { lock_waiters(&db).await == 2 },
    )
    .await;
    // ...and the held key's retry gathers with six new keys behind them.
    let held_retry = send_keys(&gw, &["held"]);
    let news = send_keys(&gw, &["b0", "b1", "b2", "b3", "b4", "b5"]);
    let held = (9 * "{\"amount\":1}".len()) as f64;
    wait_until(
        "every request holds its body",
        Duration::from_secs(10),
        || async {
            let text = admin_request(&gw, Method::GET, "/metrics", None).await.body;
            metric(&String::from_utf8_lossy(&text), "idemgate_buffered_bytes ") >= held
        },
    )
    .await;
    release_table(&operator).await;
    let first = first.await.unwrap();
    assert!(first.iter().all(|r| r.status == 201), "{first:?}");
    // The new keys are answered while the row is still held: their batch gave up on the
    // held row (100 ms), and each ran alone (it waited for it up to the statement timeout,
    // here 10 s, before).
    let news = tokio::time::timeout(Duration::from_secs(5), news)
        .await
        .expect("the new keys are answered while the row is held, not after it")
        .unwrap();
    for r in &news {
        assert_eq!(
            r.status, 201,
            "an unrelated key failed with the held one: {r:?}"
        );
    }
    // The held key's retry, alone, reads its completed row (a read waits for no lock): a
    // replay.
    let held_retry = tokio::time::timeout(Duration::from_secs(5), held_retry)
        .await
        .expect("the held key's retry is answered")
        .unwrap();
    assert!(held_retry[0].replayed(), "{held_retry:?}");
    // One execution for the held key (before the hold), one for each new key.
    assert_eq!(up.executions(), 1 + 2 + 6);
    operator.batch_execute("ROLLBACK").await.unwrap();
    let again = post(&c, &gw, "acct", "held", "{\"amount\":1}").await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(up.executions(), 9);
}

/// Completions of several keys in one batch, one of whose rows an operator holds: every
/// other key's answer is written while the row is held; the held key's completion alone
/// waits for it, and is written once the operator lets go.
async fn a_locked_row_fails_no_other_completion_of_its_batch(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _file) = two_patient_connections(b, &up).await;
    let fp = [7u8; 32];
    let claim = |key: String| {
        let store = gw.store.clone();
        async move {
            let claim = store
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
                panic!("{key} was not claimed: {claim:?}")
            };
            (key, token)
        }
    };
    let mut tokens = Vec::new();
    for i in 0..9 {
        tokens.push(claim(format!("c{i}")).await);
    }
    let finish = |(key, token): (String, idemgate::store::LeaseToken)| {
        let store = gw.store.clone();
        Box::pin(async move {
            let answer = idemgate::replay::StoredResponse {
                status: 201,
                headers: vec![],
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
        }) as StoreCall<Result<bool, idemgate::store::StoreError>>
    };
    let db = gw.sql().await;
    let operator = hold_row_and_table(&gw, "c0").await;
    let mut tokens = tokens.into_iter();
    // Two completions take the two connections and wait for the table...
    let first: Vec<_> = tokens
        .by_ref()
        .skip(1)
        .take(2)
        .map(finish)
        .map(tokio::spawn)
        .collect();
    wait_until(
        "two completions wait for the table",
        Duration::from_secs(10),
        || async { lock_waiters(&db).await == 2 },
    )
    .await;
    // ...and the held key's gathers with six others behind them: all seven are queued
    // while no connection is free, so one batch takes them.
    let held = tokens_of(&gw, "c0").await;
    let mut rest: Vec<_> = tokens.map(finish).collect();
    rest.push(finish(held));
    let mut rest = queued(rest).await;
    release_table(&operator).await;
    for f in first {
        assert!(f.await.unwrap().unwrap());
    }
    let held = rest.pop().unwrap();
    // Written while the row is still held: the batch gave up on it (100 ms) and each
    // completion ran alone; only the held key's waits for its row (here up to 10 s).
    for f in rest {
        let written = tokio::time::timeout(Duration::from_secs(5), f)
            .await
            .expect("written while the row is held, not after it");
        assert!(written.unwrap().unwrap(), "an unrelated completion failed");
    }
    assert!(
        !held.is_finished(),
        "the held key's completion waits for its row"
    );
    operator.batch_execute("ROLLBACK").await.unwrap();
    assert!(
        held.await.unwrap().unwrap(),
        "written once the operator lets the row go"
    );
    for i in 0..9 {
        let row = db
            .query_one(
                "SELECT state FROM idemgate_keys WHERE key = $1",
                &[&format!("c{i}")],
            )
            .await
            .unwrap();
        assert_eq!(row.get::<_, String>(0), "completed", "c{i}");
    }
}

/// The lease token of a claimed key, read back from its row.
async fn tokens_of(gw: &TestGateway, key: &str) -> (String, idemgate::store::LeaseToken) {
    let row = gw
        .sql()
        .await
        .query_one(
            "SELECT lease_token::text FROM idemgate_keys WHERE key = $1",
            &[&key],
        )
        .await
        .unwrap();
    (key.to_string(), idemgate::store::LeaseToken(row.get(0)))
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
    let n = keys.len();
    let sent = tokio::spawn(async move { at_once(&urls, keys, "{}").await });
    release_once_queued(&gw, lock, n * "{}".len()).await;
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
    let finishing = queued(
        tokens
            .into_iter()
            .map(|(key, token)| {
                let store = gw.store.clone();
                Box::pin(async move {
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
                }) as StoreCall<bool>
            })
            .collect(),
    )
    .await;
    // Every completion is queued: the first batch takes them all, and waits for the lock.
    wait_for_the_lock(&gw).await;
    lock.batch_execute("COMMIT")
        .await
        .expect("releasing the lock");
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

/// A trigger that makes the insert of one key fail (`error`: an exception) or run past the
/// statement timeout (`slow`: a sleep), whatever statement carries it: a fault in one key of
/// a batch.
async fn poison(gw: &TestGateway, key: &str, how: &str) {
    let fault = match how {
        "error" => "RAISE EXCEPTION 'a fault injected into key %', NEW.key;",
        _ => "PERFORM pg_sleep(30);",
    };
    gw.sql()
        .await
        .batch_execute(&format!(
            "CREATE FUNCTION idemgate_test_poison() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN IF NEW.key = '{key}' THEN {fault} END IF; RETURN NEW; END $$;
             CREATE TRIGGER idemgate_test_poison BEFORE INSERT ON idemgate_keys
             FOR EACH ROW EXECUTE FUNCTION idemgate_test_poison();"
        ))
        .await
        .expect("installing the fault");
}

/// New keys gathered in one batch with a key whose insert fails (`how`): the batch's
/// statement fails, every key runs its own statement, and only the faulty key fails
/// (503, nothing forwarded); every other key is claimed and forwarded once.
async fn one_faulty_key_fails_alone(b: Backend, how: &str) {
    let up = Upstream::start().await;
    let (gw, _file) = two_connections(b, &up).await;
    poison(&gw, "bad", how).await;
    let db = gw.sql().await;
    let lock = lock_writes(&gw).await;
    // Two claims take the two connections and wait for the table...
    let first = send_keys(&gw, &["a1", "a2"]);
    wait_until(
        "two claims wait for the table",
        Duration::from_secs(10),
        || async { lock_waiters(&db).await == 2 },
    )
    .await;
    // ...and the faulty key gathers with six new keys behind them.
    let gathered = send_keys(&gw, &["b0", "b1", "b2", "bad", "b3", "b4", "b5"]);
    wait_bodies_held(&gw, 9 * "{\"amount\":1}".len()).await;
    let (statements, _) = batches(&gw, "claim_new").await;
    lock.batch_execute("COMMIT").await.unwrap();
    let first = first.await.unwrap();
    let gathered = gathered.await.unwrap();
    assert!(first.iter().all(|r| r.status == 201), "{first:?}");
    for (i, r) in gathered.iter().enumerate() {
        if i == 3 {
            assert_eq!(
                (r.status, r.problem().as_str()),
                (503, "store-unavailable"),
                "the faulty key fails for its own reason: {r:?}"
            );
        } else {
            assert_eq!(
                r.status, 201,
                "an unrelated key failed with the faulty one: {r:?}"
            );
        }
    }
    assert_eq!(up.executions(), 2 + 6, "the faulty key was never forwarded");
    // The seven were carried by one statement first (then each alone).
    let (after, keys) = batches(&gw, "claim_new").await;
    assert!(after > statements, "a batch statement ran");
    assert!(
        keys >= 7.0,
        "the seven gathered keys went into a batch: {keys}"
    );
    assert_eq!(rows_in(&gw, "completed").await, 8);
}

async fn a_statement_error_on_one_key_fails_no_other_claim_of_its_batch(b: Backend) {
    one_faulty_key_fails_alone(b, "error").await;
}

async fn a_statement_timeout_on_one_key_fails_no_other_claim_of_its_batch(b: Backend) {
    one_faulty_key_fails_alone(b, "slow").await;
}
