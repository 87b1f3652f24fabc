//! The conformance suite: one test body, every store. Every test here runs against
//! PostgreSQL (`postgres::*`), the embedded SQLite store (`sqlite::*`), PostgreSQL through
//! PgBouncer in transaction mode with the wake-up listener on a direct session
//! (`pgbouncer::*`, docs/contract.md §8.4), and PostgreSQL with the keys table
//! hash-partitioned by scope (`partitioned::*`, contract §5), so none can drift from
//! contract §2-§3.

use std::time::Duration;

use http::Method;
use idemgate::store::{Claim, ClaimRequest, Deleted, Outcome, Slot};

use crate::support::*;

/// A gateway whose keyed route has `serialize` (upstream timeout 1s, lease 20s).
async fn serialized(
    b: Backend,
    up: &Upstream,
    max: u32,
    wait: &str,
) -> (TestGateway, Option<TempDb>) {
    let idem =
        format!("lease: 20s\n      serialize: {{ max_in_flight: {max}, wait_timeout: {wait} }}");
    TestGateway::on_with(b, up, &idem, |y| y.patch("timeout: 5s", "timeout: 1s")).await
}

backend_tests!(
    postgres: Postgres, sqlite: Sqlite, pgbouncer: Pgbouncer, partitioned: Partitioned;
    [
        a_finish_with_a_lost_lease_writes_nothing,
        expired_rows_are_collected_and_live_ones_kept,
        a_large_response_is_stored_whole,
        a_retry_after_completion_gets_the_stored_answer_byte_for_byte,
        thirty_concurrent_duplicates_get_one_execution_and_thirty_identical_answers,
        the_same_key_with_another_body_is_422_and_not_forwarded,
        a_mismatch_against_an_in_flight_request_is_422_too,
        the_same_key_in_two_scopes_executes_twice_and_never_leaks,
        a_retry_status_releases_the_key_so_a_retry_is_forwarded,
        a_4xx_answer_is_stored_and_replayed_like_any_other,
        a_client_that_hangs_up_mid_flight_still_gets_its_answer_stored,
        an_expired_lease_is_taken_over_and_forwarded_again,
        a_duplicate_in_flight_is_409_with_retry_after_when_rejecting,
        a_wait_that_runs_out_is_409,
        an_upstream_timeout_is_504_and_reforward_releases_the_key,
        a_held_key_whose_outcome_is_unknown_is_502_until_deleted,
        a_response_too_large_to_store_reaches_the_first_client_whole_and_retries_get_502,
        at_most_max_in_flight_forwards_per_scope_run_at_once,
        a_wait_for_a_slot_that_runs_out_is_409_and_releases_the_key,
        two_routes_on_one_scope_each_keep_their_own_limit,
        a_slot_is_refused_past_the_takers_limit_or_any_holders_limit,
        every_row_of_the_decision_table_holds,
    ]
);

async fn a_retry_after_completion_gets_the_stored_answer_byte_for_byte(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let c = client();

    let first = post(&c, &gw, "acct-1", "k1", r#"{"amount":10}"#).await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed(), "a first answer is not marked replayed");
    assert_eq!(first.json()["execution"], 1);
    assert!(
        first.headers.contains_key("set-cookie"),
        "the first client gets every header"
    );

    let retry = post(&c, &gw, "acct-1", "k1", r#"{"amount":10}"#).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body, "byte-identical body");
    assert_eq!(retry.headers["content-type"], first.headers["content-type"]);
    assert_eq!(retry.headers["etag"], first.headers["etag"]);
    assert!(
        !retry.headers.contains_key("set-cookie"),
        "set-cookie is never stored"
    );
    assert!(
        !retry.headers.contains_key("x-upstream"),
        "only allow-listed headers are stored"
    );
    assert_eq!(up.executions(), 1);
}

async fn thirty_concurrent_duplicates_get_one_execution_and_thirty_identical_answers(b: Backend) {
    const BODY: &str = r#"{"event_id":"storm","amount":5}"#;
    let (up, gate) = Upstream::start_gated().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let urls = [gw.url("/pay")];
    let storm = tokio::spawn(async move {
        at_once(
            &urls,
            vec![("acct-1".to_string(), "storm".to_string()); 30],
            BODY,
        )
        .await
    });
    // The first execution is held at the upstream's gate until all thirty requests are in
    // the gateway together.
    gate.wait_arrived(1).await;
    wait_bodies_held(&gw, 30 * BODY.len()).await;
    assert_eq!(up.executions(), 1, "one forward while all 30 are in flight");
    gate.open();
    let replies = storm.await.unwrap();
    assert_eq!(up.executions(), 1, "one execution for 30 duplicates");
    for r in &replies {
        assert_eq!(r.status, 201, "every duplicate gets the 2xx: {r:?}");
        assert_eq!(
            r.body, replies[0].body,
            "every duplicate gets the same body"
        );
    }
    assert_eq!(
        replies.iter().filter(|r| !r.replayed()).count(),
        1,
        "exactly one first answer, the rest replays"
    );
}

async fn the_same_key_with_another_body_is_422_and_not_forwarded(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let c = client();
    assert_eq!(
        post(&c, &gw, "a", "k", r#"{"amount":10}"#).await.status,
        201
    );
    let other = post(&c, &gw, "a", "k", r#"{"amount":99}"#).await;
    assert_eq!(other.status, 422);
    assert_eq!(other.problem(), "fingerprint-mismatch");
    assert_eq!(up.executions(), 1);
}

async fn a_mismatch_against_an_in_flight_request_is_422_too(b: Backend) {
    let (up, gate) = Upstream::start_gated().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let c = client();
    let first = in_flight(&gw.url("/pay"), &up, "a", "k", "one").await;
    // The first is held at the upstream's gate: the key is in flight.
    let other = post(&c, &gw, "a", "k", "two").await;
    assert_eq!(other.problem(), "fingerprint-mismatch");
    assert_eq!(up.answered(), 0, "answered while the first was in flight");
    gate.open();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(up.executions(), 1);
}

async fn the_same_key_in_two_scopes_executes_twice_and_never_leaks(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let c = client();
    let a = post(&c, &gw, "acct-A", "shared-key", r#"{"amount":1}"#).await;
    let b = post(&c, &gw, "acct-B", "shared-key", r#"{"amount":1}"#).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(!b.replayed(), "B's first request is not a replay of A's");
    assert_ne!(a.body, b.body, "B never sees A's stored body");
    assert_eq!(up.executions(), 2);
    // And each scope replays its own answer.
    assert_eq!(
        post(&c, &gw, "acct-A", "shared-key", r#"{"amount":1}"#)
            .await
            .body,
        a.body
    );
    assert_eq!(
        post(&c, &gw, "acct-B", "shared-key", r#"{"amount":1}"#)
            .await
            .body,
        b.body
    );
}

async fn a_retry_status_releases_the_key_so_a_retry_is_forwarded(b: Backend) {
    let up = Upstream::start_with(Behavior {
        script: vec![503, 429],
        ..Default::default()
    })
    .await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let c = client();
    let r1 = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(r1.status, 503, "the upstream's 503 is passed through");
    assert_eq!(row_state(&gw, "a", "k").await, None, "released");
    let r2 = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(r2.status, 429);
    let r3 = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(r3.status, 201);
    assert!(!r3.replayed());
    let r4 = post(&c, &gw, "a", "k", "x").await;
    assert!(r4.replayed());
    assert_eq!(r4.body, r3.body);
    assert_eq!(up.executions(), 3);
}

async fn a_4xx_answer_is_stored_and_replayed_like_any_other(b: Backend) {
    let up = Upstream::start_with(Behavior {
        status: 400,
        ..Default::default()
    })
    .await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let c = client();
    let r1 = post(&c, &gw, "a", "k", "x").await;
    let r2 = post(&c, &gw, "a", "k", "x").await;
    assert_eq!((r1.status, r2.status), (400, 400));
    assert!(r2.replayed());
    assert_eq!(r1.body, r2.body);
    assert_eq!(up.executions(), 1);
}

async fn a_client_that_hangs_up_mid_flight_still_gets_its_answer_stored(b: Backend) {
    use tokio::io::AsyncWriteExt;
    let (up, gate) = Upstream::start_gated().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let body = r#"{"amount":7}"#;
    s.write_all(
        format!(
            "POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: gone\r\nx-account-id: a\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    gate.wait_arrived(1).await;
    drop(s); // the client hangs up while the upstream holds its request at the gate
    gate.open();
    wait_until("the answer is stored", Duration::from_secs(10), || async {
        row_state(&gw, "a", "gone").await.as_deref() == Some("completed")
    })
    .await;
    assert_eq!(up.answered(), 1, "the upstream call was not cancelled");
    let c = client();
    let retry = post(&c, &gw, "a", "gone", body).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.json()["execution"], 1);
    assert_eq!(up.executions(), 1);
}

async fn an_expired_lease_is_taken_over_and_forwarded_again(b: Backend) {
    let up = Upstream::start().await;
    // A short lease; the upstream timeout must stay below it.
    // (The lease is waited out below by retrying until one is forwarded, with a deadline: no
    // assertion depends on how long that takes.)
    let (gw, _db) = TestGateway::on_with(b, &up, "lease: 3s\n      in_flight: reject", |y| {
        y.patch("timeout: 5s", "timeout: 1s")
    })
    .await;
    // A crashed gateway: it claimed the key (with the fingerprint the gateway computes for
    // this request) and never finished.
    let body = "x";
    let c = client();
    let fp = {
        let cfg = Default::default();
        idemgate::fingerprint::fingerprint(
            &cfg,
            &Method::POST,
            "payments",
            "/pay",
            &http::HeaderMap::new(),
            body.as_bytes(),
            None,
        )
        .unwrap()
    };
    let claimed = gw
        .store
        .claim(ClaimRequest {
            scope: &scoped("a"),
            key: "crashed",
            route: "payments",
            fingerprint: &fp,
            lease: Duration::from_secs(3),
            ttl: Duration::from_secs(60),
            hold_expired_leases: false,
        })
        .await
        .unwrap();
    assert!(matches!(claimed, idemgate::store::Claim::Acquired { .. }));

    assert_eq!(
        lease_events(&gw, "payments", "taken_over").await,
        0.0,
        "no takeover yet"
    );
    let early = post(&c, &gw, "a", "crashed", body).await;
    assert_eq!(early.status, 409, "a live lease is respected");
    assert_eq!(early.problem(), "in-flight");
    assert!(early.headers.contains_key("retry-after"));
    assert_eq!(up.executions(), 0);

    let c2 = c.clone();
    let gw_url = gw.url("/pay");
    wait_until("the lease is taken over", Duration::from_secs(10), || {
        let c2 = c2.clone();
        let gw_url = gw_url.clone();
        async move {
            let r = send(
                &c2,
                Method::POST,
                &gw_url,
                &[("idempotency-key", "crashed"), ("x-account-id", "a")],
                body,
            )
            .await;
            r.status == 201
        }
    })
    .await;
    assert_eq!(up.executions(), 1);
    let info = gw
        .store
        .inspect(&scoped("a"), "crashed")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(info.state, "completed");
    assert_eq!(info.attempts, 2, "the takeover is counted on the row");
    assert_eq!(
        lease_events(&gw, "payments", "taken_over").await,
        1.0,
        "and in idemgate_leases_total, once, for the route"
    );
}

async fn a_duplicate_in_flight_is_409_with_retry_after_when_rejecting(b: Backend) {
    let (up, gate) = Upstream::start_gated().await;
    let (gw, _db) = TestGateway::on(b, &up, "in_flight: reject").await;
    let c = client();
    // Held at the upstream's gate: in flight until the test lets it through.
    let first = in_flight(&gw.url("/pay"), &up, "a", "k", "x").await;
    let dup = post(&c, &gw, "a", "k", "x").await;
    assert_eq!((dup.status, dup.problem().as_str()), (409, "in-flight"));
    assert_eq!(dup.headers["retry-after"], "1");
    gate.open();
    assert_eq!(first.await.unwrap().status, 201);
    assert!(post(&c, &gw, "a", "k", "x").await.replayed());
    assert_eq!(up.executions(), 1);
}

async fn a_wait_that_runs_out_is_409(b: Backend) {
    let (up, gate) = Upstream::start_gated().await;
    let (gw, _db) = TestGateway::on(b, &up, "wait_timeout: 300ms").await;
    let c = client();
    // Held at the upstream's gate until the duplicate's wait has run out.
    let first = in_flight(&gw.url("/pay"), &up, "a", "k", "x").await;
    let dup = post(&c, &gw, "a", "k", "x").await;
    assert_eq!((dup.status, dup.problem().as_str()), (409, "in-flight"));
    assert!(dup.headers.contains_key("retry-after"));
    assert_eq!(up.answered(), 0, "the first was still in flight");
    gate.open();
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(up.executions(), 1);
}

async fn an_upstream_timeout_is_504_and_reforward_releases_the_key(b: Backend) {
    // The first execution is held at the upstream's gate for good: it outlives its timeout.
    let (up, _gate) = Upstream::start_gated().await;
    let (gw, _db) = TestGateway::on_with(b, &up, "lease: 5s", |y| {
        y.patch("timeout: 5s", "timeout: 500ms")
    })
    .await;
    let c = client();
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!((r.status, r.problem().as_str()), (504, "upstream-timeout"));
    assert_eq!(
        row_state(&gw, "a", "k").await,
        None,
        "reforward releases the key"
    );
    up.set(Behavior::default());
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(r.status, 201);
    assert_eq!(
        up.executions(),
        2,
        "forwarded again: the first outcome was unknown"
    );
}

async fn a_held_key_whose_outcome_is_unknown_is_502_until_deleted(b: Backend) {
    // The first execution is held at the upstream's gate for good: it outlives its timeout.
    let (up, _gate) = Upstream::start_gated().await;
    let (gw, _db) =
        TestGateway::on_with(b, &up, "lease: 5s\n      on_unknown_outcome: hold", |y| {
            y.patch("timeout: 5s", "timeout: 500ms")
        })
        .await;
    let c = client();
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!((r.status, r.problem().as_str()), (504, "upstream-timeout"));
    assert_eq!(row_state(&gw, "a", "k").await.as_deref(), Some("unknown"));
    let retry = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(
        (retry.status, retry.problem().as_str()),
        (502, "outcome-unknown")
    );
    assert_eq!(up.executions(), 1);
    // An operator releases the key; the next retry is forwarded.
    assert!(matches!(
        gw.store.delete(&scoped("a"), "k", false).await.unwrap(),
        Deleted::Yes { .. }
    ));
    up.set(Behavior::default());
    assert_eq!(post(&c, &gw, "a", "k", "x").await.status, 201);
    assert_eq!(up.executions(), 2);
}

async fn a_response_too_large_to_store_reaches_the_first_client_whole_and_retries_get_502(
    b: Backend,
) {
    let big = bytes::Bytes::from(vec![b'z'; 5000]);
    let up = Upstream::start_with(Behavior {
        body: Some(big.clone()),
        ..Default::default()
    })
    .await;
    let (gw, _db) = TestGateway::on(b, &up, "max_stored_response: 1KiB").await;
    let c = client();
    let first = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body, big, "the first client gets the whole body");
    assert_eq!(
        row_state(&gw, "a", "k").await.as_deref(),
        Some("not_replayable")
    );
    let retry = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(
        (retry.status, retry.problem().as_str()),
        (502, "response-not-replayable")
    );
    assert_eq!(up.executions(), 1, "never a second forward");
}

async fn at_most_max_in_flight_forwards_per_scope_run_at_once(b: Backend) {
    let (up, gate) = Upstream::start_gated().await;
    let (gw, _db) = serialized(b, &up, 2, "10s").await;
    let urls = [gw.url("/pay")];
    let sent = tokio::spawn(async move { crate::serialize::burst(&urls, "acct", 10).await });
    // Two forwards held at the upstream's gate while all ten requests are in the gateway:
    // the other eight wait for a slot. Then the gate lets one through at a time, and each
    // time one more is forwarded (a third beside two held ones would wait at the gate too,
    // and be counted).
    wait_bodies_held(&gw, 10 * "e".len()).await;
    gate.wait_arrived(2).await;
    for n in 3..=10 {
        gate.release(1);
        gate.wait_arrived(n).await;
    }
    gate.open();
    let replies = sent.await.unwrap();
    assert!(replies.iter().all(|r| r.status == 201), "{replies:?}");
    assert_eq!(up.executions(), 10);
    assert!(
        up.max_concurrency() <= 2,
        "max {} at once",
        up.max_concurrency()
    );
    assert_eq!(up.max_concurrency(), 2, "the limit was reached");
}

async fn a_wait_for_a_slot_that_runs_out_is_409_and_releases_the_key(b: Backend) {
    let (up, gate) = Upstream::start_gated().await;
    let (gw, _db) = serialized(b, &up, 1, "200ms").await;
    let c = client();
    // The first holds the scope's only slot while the upstream holds it at the gate.
    let first = in_flight(&gw.url("/pay"), &up, "a", "first", "e").await;
    let second = post(&c, &gw, "a", "second", "e").await;
    assert_eq!(
        (second.status, second.problem().as_str()),
        (409, "in-flight")
    );
    assert!(second.headers.contains_key("retry-after"));
    assert_eq!(
        row_state(&gw, "a", "second").await,
        None,
        "released: nothing was forwarded"
    );
    gate.open();
    assert_eq!(first.await.unwrap().status, 201);
    // Now the slot is free: the retry goes through.
    assert_eq!(post(&c, &gw, "a", "second", "e").await.status, 201);
    assert_eq!(up.executions(), 2);
}

/// Two keyed routes on one scope: while a request of the limit-1 route is forwarded, no
/// other request of the scope is, and never more than 3 (the other route's limit) at all.
async fn two_routes_on_one_scope_each_keep_their_own_limit(b: Backend) {
    // A slow upstream so that forwards overlap; the assertions hold however long it is.
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(100),
        ..Default::default()
    })
    .await;
    let idem = "lease: 20s\n      serialize: { max_in_flight: 3, wait_timeout: 10s }";
    let (gw, _db) = TestGateway::on_with(b, &up, idem, |y| {
        crate::serialize::with_solo_route(&y.patch("timeout: 5s", "timeout: 1s"))
    })
    .await;
    let urls = [gw.url("/solo"), gw.url("/pay"), gw.url("/pay")];
    let keys = (0..18)
        .map(|i| ("acct".to_string(), format!("k-{i}")))
        .collect();
    let replies = at_once(&urls, keys, "e").await;
    assert!(replies.iter().all(|r| r.status == 201), "{replies:?}");
    assert_eq!(up.executions(), 18);
    assert_eq!(
        up.max_concurrency_beside("/solo"),
        1,
        "a limit-1 request of the scope runs alone"
    );
    assert!(
        up.max_concurrency() <= 3,
        "max {} at once",
        up.max_concurrency()
    );
}

/// The slot rule at the store: a taker with limit L gets a slot only if, counting itself,
/// the scope's live slots number at most L and at most every live holder's limit.
async fn a_slot_is_refused_past_the_takers_limit_or_any_holders_limit(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let store = gw.store.clone();
    let lease = Duration::from_secs(60);
    let take = |limit: u32| {
        let store = store.clone();
        async move { store.acquire_slot("s", limit, lease).await.unwrap() }
    };

    let b1 = take(3).await.expect("1 of 3");
    let b2 = take(3).await.expect("2 of 3");
    assert_eq!(take(1).await, None, "limit 1: two others run");
    assert_eq!(take(2).await, None, "limit 2: it would make three");
    let b3 = take(3).await.expect("3 of 3");
    assert_eq!(take(3).await, None, "a fourth under limit 3");
    let other = store
        .acquire_slot("t", 1, lease)
        .await
        .unwrap()
        .expect("another scope is not affected");
    for s in [&b1, &b2, &b3, &other] {
        assert!(store.release_slot(s).await.unwrap(), "released");
    }

    let solo = take(1).await.expect("limit 1 on an idle scope");
    assert_eq!(
        take(3).await,
        None,
        "a limit-1 holder keeps every route out of its scope"
    );
    let forged = Slot {
        token: "00000000-0000-0000-0000-000000000000".into(),
        ..solo.clone()
    };
    assert!(
        !store.release_slot(&forged).await.unwrap(),
        "a release is fenced by its token"
    );
    assert_eq!(take(3).await, None, "the forged release freed nothing");
    assert!(store.release_slot(&solo).await.unwrap());
    let again = take(3).await.expect("free again once the holder released");
    assert!(store.release_slot(&again).await.unwrap());

    // A crashed limit-1 holder: its limit ends with its lease.
    store
        .acquire_slot("s", 1, Duration::from_millis(1))
        .await
        .unwrap()
        .expect("limit 1 on an idle scope");
    wait_until(
        "the crashed holder's lease ended",
        Duration::from_secs(10),
        || {
            let store = store.clone();
            async move { store.acquire_slot("s", 3, lease).await.unwrap().is_some() }
        },
    )
    .await;
}

fn claim_req<'a>(
    key: &'a str,
    fp: &'a [u8; 32],
    lease: Duration,
    ttl: Duration,
) -> ClaimRequest<'a> {
    ClaimRequest {
        scope: "s",
        key,
        route: "payments",
        fingerprint: fp,
        lease,
        ttl,
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

/// Fencing: after a takeover, the first attempt's write matches no row and changes nothing.
async fn a_finish_with_a_lost_lease_writes_nothing(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let fp = [1u8; 32];
    let Claim::Acquired { token: old, .. } = gw
        .store
        .claim(claim_req(
            "k",
            &fp,
            Duration::from_millis(50),
            Duration::from_secs(60),
        ))
        .await
        .unwrap()
    else {
        panic!("a new key is acquired")
    };
    // Retried until the 50ms lease has ended (with a deadline): no assertion depends on how
    // long that takes.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let new = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after 10s waiting until the 50ms lease of k can be taken over"
        );
        match gw
            .store
            .claim(claim_req(
                "k",
                &fp,
                Duration::from_secs(60),
                Duration::from_secs(60),
            ))
            .await
            .unwrap()
        {
            Claim::Acquired { token, took_over } => {
                assert!(took_over, "the second claim took an expired lease over");
                break token;
            }
            Claim::InFlight { .. } => tokio::time::sleep(Duration::from_millis(20)).await,
            other => panic!("unexpected {other:?}"),
        }
    };
    let ttl = Duration::from_secs(60);
    assert!(
        !gw.store
            .finish("s", "k", &old, Outcome::Completed(stored("old")), ttl)
            .await
            .unwrap()
    );
    assert!(
        !gw.store
            .finish("s", "k", &old, Outcome::Release, ttl)
            .await
            .unwrap()
    );
    assert!(
        gw.store
            .finish("s", "k", &new, Outcome::Completed(stored("new")), ttl)
            .await
            .unwrap()
    );
    match gw
        .store
        .claim(claim_req("k", &fp, Duration::from_secs(60), ttl))
        .await
        .unwrap()
    {
        Claim::Completed(r, _) => assert_eq!(r, stored("new")),
        other => panic!("unexpected {other:?}"),
    }
    let info = gw.store.inspect("s", "k").await.unwrap().unwrap();
    assert_eq!((info.state.as_str(), info.attempts), ("completed", 2));
}

async fn expired_rows_are_collected_and_live_ones_kept(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let fp = [2u8; 32];
    for (key, ttl) in [("old-1", 1), ("old-2", 1), ("live", 60_000)] {
        let ttl = Duration::from_millis(ttl);
        let Claim::Acquired { token, .. } =
            gw.store.claim(claim_req(key, &fp, ttl, ttl)).await.unwrap()
        else {
            panic!("acquired")
        };
        assert!(
            gw.store
                .finish("s", key, &token, Outcome::Completed(stored(key)), ttl)
                .await
                .unwrap()
        );
    }
    let store = gw.store.clone();
    wait_until(
        "both short rows are expired and collected",
        Duration::from_secs(10),
        || {
            let store = store.clone();
            async move {
                store.gc(1).await.unwrap();
                store.inspect("s", "old-1").await.unwrap().is_none()
                    && store.inspect("s", "old-2").await.unwrap().is_none()
            }
        },
    )
    .await;
    assert!(gw.store.inspect("s", "live").await.unwrap().is_some());
}

/// A completion writes status, headers and the whole body in one write
/// (docs/contract.md §2.7).
async fn a_large_response_is_stored_whole(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let fp = [3u8; 32];
    let ttl = Duration::from_secs(60);
    let Claim::Acquired { token, .. } =
        gw.store.claim(claim_req("k", &fp, ttl, ttl)).await.unwrap()
    else {
        panic!("acquired")
    };
    let big = "b".repeat(100_000);
    assert!(
        gw.store
            .finish("s", "k", &token, Outcome::Completed(stored(&big)), ttl)
            .await
            .unwrap()
    );
    let info = gw.store.inspect("s", "k").await.unwrap().unwrap();
    assert_eq!(
        (info.state.as_str(), info.status, info.body_bytes),
        ("completed", Some(201), Some(100_000))
    );
}

/// The decision table (`decisions.rs`, which the protocol model also takes its decisions
/// from), row by row on this store: each [`Before`] state made through the store's own API,
/// each [`Op`] sent, the answer and the row left compared with the table.
async fn every_row_of_the_decision_table_holds(b: Backend) {
    use crate::decisions::{After, Before, Decision, Op, Token, cases, decide};
    use idemgate::store::{LeaseToken, Store};

    const LIVE: Duration = Duration::from_secs(60);
    const NEVER_ISSUED: &str = "00000000-0000-4000-8000-000000000000";
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let store = gw.store.as_ref();
    let req =
        |key: &'static str, fp: &'static [u8; 32], lease: Duration, ttl: Duration, holds: bool| {
            ClaimRequest {
                scope: "table",
                key,
                route: "payments",
                fingerprint: fp,
                lease,
                ttl,
                hold_expired_leases: holds,
            }
        };
    // A claim that only looks: with `hold`, an expired lease is reported, never taken.
    async fn wait_lease_ended(store: &dyn Store, key: &'static str, fp: &'static [u8; 32]) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let look = ClaimRequest {
                scope: "table",
                key,
                route: "payments",
                fingerprint: fp,
                lease: Duration::from_secs(60),
                ttl: Duration::from_secs(60),
                hold_expired_leases: true,
            };
            match store.claim(look).await.unwrap() {
                Claim::Held => return,
                Claim::InFlight { .. } => {}
                other => panic!("{key}: a look at an in-flight key found {other:?}"),
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{key}: the 1 ms lease had not ended after 10 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    static FP: [u8; 32] = [7u8; 32];
    static OTHER: [u8; 32] = [8u8; 32];
    let mut checked = 0;
    for (n, (before, op)) in cases().enumerate() {
        let key: &'static str = Box::leak(format!("k{n}").into_boxed_str());
        let acquire = |claim: Claim| match claim {
            Claim::Acquired { token, .. } => token,
            other => panic!("{key}: setting up {before:?}, a claim found {other:?}"),
        };
        // The row in its `before` state, the token of its latest claim and of the one
        // before (taken over).
        let (current, stale) = match before {
            Before::Absent => (None, None),
            Before::InFlight => (
                Some(acquire(
                    store.claim(req(key, &FP, LIVE, LIVE, false)).await.unwrap(),
                )),
                None,
            ),
            Before::InFlightTtlPassed => {
                let ms = Duration::from_millis(1);
                let token = acquire(store.claim(req(key, &FP, ms, ms, false)).await.unwrap());
                // Its lease and ttl were 1 ms of the database's clock, which is this host's.
                tokio::time::sleep(Duration::from_millis(50)).await;
                (Some(token), None)
            }
            Before::InFlightExpired | Before::TakenOver => {
                let first = acquire(
                    store
                        .claim(req(key, &FP, Duration::from_millis(1), LIVE, false))
                        .await
                        .unwrap(),
                );
                wait_lease_ended(store, key, &FP).await;
                if before == Before::TakenOver {
                    let second = store.claim(req(key, &FP, LIVE, LIVE, false)).await.unwrap();
                    assert!(
                        matches!(
                            second,
                            Claim::Acquired {
                                took_over: true,
                                ..
                            }
                        ),
                        "{key}: taking over found {second:?}"
                    );
                    (Some(acquire(second)), Some(first))
                } else {
                    (Some(first), None)
                }
            }
            Before::Completed | Before::Expired | Before::Unknown | Before::NotReplayable => {
                let token = acquire(store.claim(req(key, &FP, LIVE, LIVE, false)).await.unwrap());
                let (outcome, ttl) = match before {
                    Before::Completed => (Outcome::Completed(stored("table")), LIVE),
                    Before::Expired => (
                        Outcome::Completed(stored("table")),
                        Duration::from_millis(1),
                    ),
                    Before::Unknown => (Outcome::Unknown, LIVE),
                    _ => (Outcome::NotReplayable { status: 200 }, LIVE),
                };
                assert!(
                    store
                        .finish("table", key, &token, outcome, ttl)
                        .await
                        .unwrap()
                );
                if before == Before::Expired {
                    // The row's ttl was 1 ms of the database's clock, which is this host's.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                (Some(token), None)
            }
        };
        // The row as stored, without what is relative to the moment it is read.
        let stored_row = |info: Option<idemgate::store::KeyInfo>| {
            info.map(|mut row| {
                row.age_ms = 0;
                row.lease_left_ms = None;
                row
            })
        };
        let seen_before = stored_row(store.inspect("table", key).await.unwrap());
        let token = |t: Token| match t {
            Token::Current => current.clone().unwrap_or(LeaseToken(NEVER_ISSUED.into())),
            Token::Stale => stale.clone().unwrap_or(LeaseToken(NEVER_ISSUED.into())),
        };
        let decision = match op {
            Op::Claim {
                same_request,
                holds,
            } => {
                let fp = if same_request { &FP } else { &OTHER };
                match store.claim(req(key, fp, LIVE, LIVE, holds)).await.unwrap() {
                    Claim::Acquired { took_over, .. } => Decision::Acquired { took_over },
                    Claim::InFlight { .. } => Decision::InFlight,
                    Claim::Completed(..) => Decision::Replay,
                    Claim::Mismatch => Decision::Mismatch,
                    Claim::Held => Decision::Held,
                    Claim::NotReplayable { .. } => Decision::NotReplayable,
                }
            }
            Op::Complete(t) | Op::Hold(t) | Op::Release(t) => {
                let outcome = match op {
                    Op::Complete(_) => Outcome::Completed(stored("end")),
                    Op::Hold(_) => Outcome::Unknown,
                    _ => Outcome::Release,
                };
                match store
                    .finish("table", key, &token(t), outcome, LIVE)
                    .await
                    .unwrap()
                {
                    true => Decision::Wrote,
                    false => Decision::Fenced,
                }
            }
            Op::Delete { force } => match store.delete("table", key, force).await.unwrap() {
                Deleted::Yes { live_lease, .. } => Decision::Deleted { live_lease },
                Deleted::NotFound => Decision::NotFound,
                Deleted::InFlight => Decision::Refused,
            },
        };
        let (want, after) = decide(before, op);
        assert_eq!(decision, want, "{key}: {op:?} on a row {before:?}");
        let seen_after = stored_row(store.inspect("table", key).await.unwrap());
        let state = seen_after.as_ref().map(|r| r.state.as_str());
        match after {
            After::Same => assert_eq!(
                seen_after, seen_before,
                "{key}: {op:?} on {before:?} changed the row"
            ),
            After::Absent => assert_eq!(seen_after, None, "{key}: {op:?} on {before:?}"),
            After::Claimed => {
                assert_eq!(state, Some("in_flight"), "{key}: {op:?} on {before:?}");
                assert_ne!(
                    seen_after, seen_before,
                    "{key}: a new claim, a new row version"
                );
            }
            After::Completed => assert_eq!(state, Some("completed"), "{key}: {op:?} on {before:?}"),
            After::Unknown => assert_eq!(state, Some("unknown"), "{key}: {op:?} on {before:?}"),
        }
        checked += 1;
    }
    assert_eq!(checked, 108, "every row of the table was driven");
}
