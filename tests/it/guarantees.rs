//! The guarantees of README section "Guarantees", each with a deterministic fault: a row
//! lock held by the test where a race would otherwise decide, an operator's forced delete
//! where a lease would have to run out by luck.

use std::time::{Duration, Instant};

use crate::support::*;

// The guarantees whose bound is the statement timeout run on PostgreSQL directly and through
// PgBouncer in transaction mode, where no server-side timeout is set at connection start and
// the client cancels a statement that outlives its bound (docs/contract.md §8.4).
backend_tests!(
    postgres: Postgres, pgbouncer: Pgbouncer;
    [
        guarantee_3_an_answer_that_cannot_be_recorded_is_503_never_the_2xx,
        guarantee_3_the_client_gets_its_answer_only_once_it_is_committed,
        a_claim_blocked_past_its_statement_timeout_is_503_within_the_bound,
    ]
);

/// Holds a row lock on `(scope, key)` in an open transaction until the returned client's
/// transaction ends (`COMMIT`/`ROLLBACK` on it, or drop).
async fn lock_row(gw: &TestGateway, scope: &str, key: &str) -> tokio_postgres::Client {
    let locker = sql(&gw.db).await;
    locker.batch_execute("BEGIN").await.unwrap();
    let locked = locker
        .query(
            "SELECT 1 FROM idemgate_keys WHERE scope = $1 AND key = $2 FOR UPDATE",
            &[&scope, &key],
        )
        .await
        .unwrap();
    assert_eq!(locked.len(), 1, "the row to lock exists");
    locker
}

async fn guarantee_3_an_answer_that_cannot_be_recorded_is_503_never_the_2xx(b: Backend) {
    let (up, gate) = Upstream::start_gated().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let task = in_flight(&gw.url("/pay"), &up, "a", "k", "x").await;
    // While the upstream holds the request at its gate, the test locks the row; then the
    // upstream answers, and every completion attempt waits for the lock until its statement
    // timeout (1s in the test config).
    let locker = lock_row(&gw, &scoped("a"), "k").await;
    gate.open();
    let r = task.await.unwrap();
    assert_eq!(up.answered(), 1, "the upstream did the work");
    assert_eq!(
        (r.status, r.problem().as_str()),
        (503, "store-unavailable"),
        "never the 2xx that a retry could not get again"
    );
    assert!(
        r.problem_detail().contains("409"),
        "it says what a retry gets"
    );
    drop(locker);
    assert_eq!(row_state(&gw, "a", "k").await.as_deref(), Some("in_flight"));
    let c = client();
    let retry = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(retry.status, 409, "in flight until its lease ends");
}

async fn guarantee_3_the_client_gets_its_answer_only_once_it_is_committed(b: Backend) {
    let (up, gate) = Upstream::start_gated().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let task = in_flight(&gw.url("/pay"), &up, "a", "k", "x").await;
    // The row is locked while the upstream holds the request at its gate, then it answers.
    let locker = lock_row(&gw, &scoped("a"), "k").await;
    gate.open();
    // The completion now waits behind our lock (its statement timeout is 1s).
    let watcher = gw.sql().await;
    wait_for_a_lock_waiter(&watcher).await;
    assert!(!task.is_finished(), "no answer while the completion waits");
    locker.batch_execute("COMMIT").await.unwrap();
    let r = task.await.unwrap();
    assert_eq!(r.status, 201);
    assert_eq!(row_state(&gw, "a", "k").await.as_deref(), Some("completed"));
    let c = client();
    assert!(post(&c, &gw, "a", "k", "x").await.replayed());
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn a_lease_lost_at_the_gateway_still_answers_its_client_and_is_counted() {
    let (up, gate) = Upstream::start_gated().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let task = in_flight(&gw.url("/pay"), &up, "a", "k", "x").await;
    // An operator forces the key away mid-flight (the upstream holds the request at its
    // gate): the holder's lease is gone.
    let forced = admin_request(
        &gw,
        http::Method::DELETE,
        "/v1/keys?scope=a&key=k&force=true",
        None,
    )
    .await;
    assert_eq!(forced.status, 204);
    assert_eq!(
        up.answered(),
        0,
        "forced away while the upstream still works"
    );
    gate.open();
    let r = task.await.unwrap();
    assert_eq!(
        r.status, 201,
        "the stale holder's client still gets the answer"
    );
    assert_eq!(
        row_state(&gw, "a", "k").await,
        None,
        "and nothing was written"
    );
    let metrics = admin_request(&gw, http::Method::GET, "/metrics", None).await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("idemgate_leases_total{route=\"payments\",event=\"lost\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn a_waiter_forwards_itself_once_the_first_attempt_released_its_key() {
    let gate = Gate::new();
    let up = Upstream::start_with(Behavior {
        gate: Some(gate.clone()),
        script: vec![503],
        ..Default::default()
    })
    .await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let first = in_flight(&gw.url("/pay"), &up, "a", "k", "x").await;
    // A duplicate arrives while the first is held at the upstream's gate: it waits
    // (in_flight: wait). Only then does the upstream answer the first.
    let url = gw.url("/pay");
    let waiter = tokio::spawn(async move { post_to(&client(), &url, "a", "k", "x").await });
    wait_until(
        "the duplicate waits for the key",
        Duration::from_secs(10),
        || async { gw.gateway.inflight().waited_keys() == 1 },
    )
    .await;
    gate.open();
    let first = first.await.unwrap();
    assert_eq!(
        first.status, 503,
        "a retryable status: passed on, key released"
    );
    let second = waiter.await.unwrap();
    assert_eq!(
        second.status, 201,
        "the waiter claimed the released key and forwarded"
    );
    assert!(!second.replayed());
    assert_eq!(up.executions(), 2);
    assert_eq!(row_state(&gw, "a", "k").await.as_deref(), Some("completed"));
}

#[tokio::test]
async fn a_key_whose_ttl_ran_out_is_forwarded_again() {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on_with(Backend::Postgres, &up, "ttl: 4s\n      lease: 3s", |y| {
        y.patch(
            "connect_timeout: 200ms, timeout: 5s",
            "connect_timeout: 200ms, timeout: 1s",
        )
    })
    .await;
    let c = client();
    let first = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(first.status, 201);
    assert!(post(&c, &gw, "a", "k", "x").await.replayed());
    wait_until("the ttl runs out", Duration::from_secs(10), || async {
        !post(&c, &gw, "a", "k", "x").await.replayed()
    })
    .await;
    assert_eq!(up.executions(), 2, "forgotten after ttl: a new request");
}

/// The held case of `ttl` (docs/contract.md §2.6): under `on_unknown_outcome: hold`, an
/// upstream that outlives its timeout leaves the key `unknown`; every retry gets 502
/// `outcome-unknown` and nothing is forwarded until `ttl` passes; then a retry is forwarded.
#[tokio::test]
async fn a_held_key_is_forwarded_again_once_its_ttl_ran_out() {
    // The first execution is held at the upstream's gate for good: it outlives its timeout.
    let (up, _gate) = Upstream::start_gated().await;
    let idem = "ttl: 4s\n      lease: 3s\n      on_unknown_outcome: hold";
    let (gw, _db) = TestGateway::on_with(Backend::Postgres, &up, idem, |y| {
        y.patch(
            "connect_timeout: 200ms, timeout: 5s",
            "connect_timeout: 200ms, timeout: 500ms",
        )
    })
    .await;
    let c = client();
    let first = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(
        (first.status, first.problem().as_str()),
        (504, "upstream-timeout")
    );
    assert_eq!(row_state(&gw, "a", "k").await.as_deref(), Some("unknown"));
    let retry = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(
        (retry.status, retry.problem().as_str()),
        (502, "outcome-unknown"),
        "held"
    );
    // The upstream answers at once from now on: only the ttl keeps a retry from it.
    up.set(Behavior::default());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut held = 1;
    let after = loop {
        let r = post(&c, &gw, "a", "k", "x").await;
        if r.status != 502 {
            break r;
        }
        assert_eq!(r.problem(), "outcome-unknown");
        assert_eq!(
            up.executions(),
            1,
            "nothing forwarded while the key is held"
        );
        held += 1;
        assert!(
            tokio::time::Instant::now() < deadline,
            "still held after 15 s ({held} retries) with ttl 3s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        after.status, 201,
        "forwarded once the ttl ran out: {after:?}"
    );
    assert!(!after.replayed());
    assert_eq!(up.executions(), 2);
    assert_eq!(row_state(&gw, "a", "k").await.as_deref(), Some("completed"));
    assert!(post(&c, &gw, "a", "k", "x").await.replayed());
    assert_eq!(up.executions(), 2);
}

async fn a_claim_blocked_past_its_statement_timeout_is_503_within_the_bound(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let c = client();
    assert_eq!(post(&c, &gw, "a", "k", "x").await.status, 201);
    // Expired, the row is claimable: a claim must take it over, under its lock. (A row a
    // claim only reads, a replay or a mismatch, is answered from a read that waits for no
    // lock.)
    gw.sql()
        .await
        .execute(
            "UPDATE idemgate_keys SET expires_at = now() - interval '1 second'",
            &[],
        )
        .await
        .unwrap();
    let _locker = lock_row(&gw, &scoped("a"), "k").await;
    let started = Instant::now();
    // A retry under the locked key: its claim waits for the lock until the statement
    // timeout (1s), then the client is told the store is unavailable.
    let r = post(&c, &gw, "a", "k", "x").await;
    let elapsed = started.elapsed();
    assert_eq!((r.status, r.problem().as_str()), (503, "store-unavailable"));
    // A hang check against the configured bound (acquire 500ms + statement 1s), with a
    // generous margin for a loaded machine: not a speed claim.
    assert!(
        elapsed < Duration::from_secs(6),
        "answered after {elapsed:?}"
    );
    assert_eq!(up.executions(), 1, "nothing was forwarded");
    // And the server stopped the statement (its own timeout, or the client's cancel request
    // through the pooler): nothing waits for the lock any more while it is still held.
    let watcher = gw.sql().await;
    wait_until(
        "the blocked claim is stopped on the server",
        Duration::from_secs(3),
        || async { lock_waiters(&watcher).await == 0 },
    )
    .await;
}

/// `idemgate_leases_total{event="lost"}` of the `payments` route in a `/metrics` text.
fn leases_lost(text: &str) -> f64 {
    metric(
        text,
        "idemgate_leases_total{route=\"payments\",event=\"lost\"} ",
    )
}

/// An upstream answering `lost-reply-answer` (each execution held at `gate`, if given), and
/// the config of a gateway with `pool` connections whose store statements pass a proxy that
/// loses every reply after the first statement carrying that answer (its wake-up listener
/// connects directly); the proxy is kept for the test's length.
async fn lost_reply_setup(
    gate: Option<Gate>,
    pool: usize,
) -> (
    Upstream,
    crate::support::fault_proxy::FaultProxy,
    String,
    String,
) {
    use crate::support::fault_proxy::{Fault, FaultProxy};
    let up = Upstream::start_with(Behavior {
        body: Some(bytes::Bytes::from_static(b"lost-reply-answer")),
        gate,
        ..Behavior::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let (proxy, through_proxy) = FaultProxy::in_front_of_database(
        &db,
        Fault::LoseRepliesAfter {
            marker: b"lost-reply-answer",
        },
    )
    .await;
    let yaml = config_yaml(&through_proxy, &up.url(), "").patch(
        "pool_size: 8",
        &format!("pool_size: {pool}, listen_url: \"{db}\""),
    );
    (up, proxy, db, yaml)
}

/// A completion whose commit landed but whose reply was lost (the connection to PostgreSQL
/// cut just after it) is tried again; the retry writes nothing, and the row holding the
/// answer is recognized as this attempt's own: the client gets the answer, the retry a
/// replay, and no lease is counted lost.
#[tokio::test]
async fn a_completion_whose_commit_reply_was_lost_is_not_counted_as_a_lost_lease() {
    let (up, _proxy, db, yaml) = lost_reply_setup(None, 8).await;
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    let first = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(
        (first.status, &first.body[..]),
        (201, &b"lost-reply-answer"[..]),
        "{first:?}"
    );
    let retry = post(&c, &gw, "a", "k", "x").await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(up.executions(), 1);
    let metrics = admin_request(&gw, http::Method::GET, "/metrics", None).await;
    let text = String::from_utf8_lossy(&metrics.body);
    // The series exists from the start (at 0, with the route) and stays there.
    assert_eq!(leases_lost(&text), 0.0, "no lease counted lost:\n{text}");
}

/// The same lost reply on a batched completion: two answers written in one statement whose
/// reply never comes back. The batch then hands each key back to be written alone, which
/// finds the row already finished (by the batch, within this attempt's lease): each is
/// recognized as its own, and no lease is counted lost.
#[tokio::test]
async fn a_batched_completion_whose_commit_reply_was_lost_is_not_counted_as_a_lost_lease() {
    let gate = Gate::new();
    // Two connections, and statements that may wait 3s for one (and for a lock).
    let (up, _proxy, db, yaml) = lost_reply_setup(Some(gate.clone()), 2).await;
    let yaml = yaml
        .patch("acquire_timeout: 500ms", "acquire_timeout: 3s")
        .patch("statement_timeout: 1s", "statement_timeout: 3s");
    let gw = TestGateway::start(&yaml, &db).await;
    let url = gw.url("/pay");
    let send_key = |key: &'static str| {
        let url = url.clone();
        tokio::spawn(async move { post_to(&client(), &url, "a", key, "x").await })
    };
    // Two requests claimed, held at the upstream.
    let batched = [send_key("k1"), send_key("k2")];
    gate.wait_arrived(2).await;
    // Writes wait; two more claims take both connections and wait for the lock.
    let lock = sql(&db).await;
    lock.batch_execute("BEGIN; LOCK TABLE idemgate_keys IN EXCLUSIVE MODE")
        .await
        .expect("locking the keys table");
    let behind = [send_key("k3"), send_key("k4")];
    let watcher = sql(&db).await;
    wait_until(
        "both connections' claims wait for the lock",
        Duration::from_secs(10),
        || async { lock_waiters(&watcher).await == 2 },
    )
    .await;
    // The first two answers come back; their completions queue for a connection, together.
    gate.release(2);
    let held = 4.0 + 2.0 * "lost-reply-answer".len() as f64;
    wait_until(
        "both answers are captured (and their completions queued)",
        Duration::from_secs(10),
        || async {
            let text = admin_request(&gw, http::Method::GET, "/metrics", None)
                .await
                .body;
            metric(&String::from_utf8_lossy(&text), "idemgate_buffered_bytes ") >= held
        },
    )
    .await;
    gate.open();
    lock.batch_execute("COMMIT")
        .await
        .expect("releasing the lock");
    for reply in batched.into_iter().chain(behind) {
        let reply = reply.await.expect("a reply");
        assert_eq!(
            (reply.status, &reply.body[..]),
            (201, &b"lost-reply-answer"[..]),
            "{reply:?}"
        );
    }
    let c = client();
    for key in ["k1", "k2", "k3", "k4"] {
        let retry = post_to(&c, &url, "a", key, "x").await;
        assert!(retry.replayed(), "{key}: {retry:?}");
    }
    assert_eq!(up.executions(), 4);
    let metrics = admin_request(&gw, http::Method::GET, "/metrics", None).await;
    let text = String::from_utf8_lossy(&metrics.body);
    // The first two completions went in one statement, queued together before any other
    // (the reply lost was a batch's); the last two may have gathered as well, and the first
    // two are tried again, each in a statement of its own.
    let statements = metric(&text, "idemgate_store_batch_keys_count{op=\"finish\"}");
    let keys = metric(&text, "idemgate_store_batch_keys_sum{op=\"finish\"}");
    assert!(keys > statements, "a statement carried two keys:\n{text}");
    assert_eq!(leases_lost(&text), 0.0, "no lease counted lost:\n{text}");
}
