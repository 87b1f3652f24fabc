//! Store trouble: nothing keyed is forwarded (unless `pass_through`), and every request is
//! answered within `acquire_timeout` + `statement_timeout` + a margin (SPEC guarantee 5).
//! The elapsed-time checks below are hang checks against the configured bounds (an unbounded
//! pool waits forever), not speed claims.

use std::time::{Duration, Instant};

use crate::support::*;

/// acquire 500ms + statement 1s (the test config) + a generous margin for a loaded machine.
const BOUND: Duration = Duration::from_millis(500 + 1000 + 2500);

#[tokio::test]
async fn pool_exhaustion_answers_503_within_its_bound() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "").replace("pool_size: 8", "pool_size: 1");
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    assert_eq!(post(&c, &gw, "a", "warm", "x").await.status, 201);
    let held = gw
        .store
        .pool()
        .get()
        .await
        .expect("the only pooled connection");
    let started = Instant::now();
    let r = post(&c, &gw, "a", "k", "x").await;
    let elapsed = started.elapsed();
    assert_eq!((r.status, r.problem().as_str()), (503, "store-unavailable"));
    assert_eq!(r.headers["retry-after"], "1");
    assert!(
        elapsed < BOUND,
        "answered after {elapsed:?}, past the bound"
    );
    assert_eq!(up.executions(), 1, "nothing keyed was forwarded");
    drop(held);
    assert_eq!(post(&c, &gw, "a", "k", "x").await.status, 201);
}

#[tokio::test]
async fn postgres_stopped_answers_503_within_its_bound_and_recovers_by_itself() {
    let cluster = tokio::task::spawn_blocking(pg::Cluster::start)
        .await
        .unwrap();
    let db = cluster.new_database().await;
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config_yaml(&db, &up.url(), ""), &db).await;
    let c = client();
    assert_eq!(post(&c, &gw, "a", "before", "x").await.status, 201);

    let cluster = tokio::task::spawn_blocking(move || {
        cluster.pg_stop_immediate();
        cluster
    })
    .await
    .unwrap();
    for i in 0..3 {
        let started = Instant::now();
        let r = post(&c, &gw, "a", &format!("during-{i}"), "x").await;
        let elapsed = started.elapsed();
        assert_eq!((r.status, r.problem().as_str()), (503, "store-unavailable"));
        assert!(
            elapsed < BOUND,
            "answered after {elapsed:?}, past the bound"
        );
    }
    assert_eq!(
        up.executions(),
        1,
        "nothing keyed was forwarded during the outage"
    );

    let _cluster = tokio::task::spawn_blocking(move || {
        cluster.pg_start();
        cluster
    })
    .await
    .unwrap();
    // No restart of the gateway: dead pooled connections are not handed out forever.
    wait_until(
        "keyed traffic recovers",
        Duration::from_secs(20),
        || async { post(&c, &gw, "a", "after", "x").await.status == 201 },
    )
    .await;
    assert!(
        post(&c, &gw, "a", "before", "x").await.replayed(),
        "stored rows survived"
    );
    assert_eq!(up.executions(), 2);
}

#[tokio::test]
async fn pass_through_forwards_without_idempotency_and_says_so() {
    let cluster = tokio::task::spawn_blocking(pg::Cluster::start)
        .await
        .unwrap();
    let db = cluster.new_database().await;
    let up = Upstream::start().await;
    let yaml = config_yaml(&db, &up.url(), "on_store_error: pass_through");
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    let normal = post(&c, &gw, "a", "k0", "x").await;
    assert!(!normal.headers.contains_key("idempotency-status"));
    let _cluster = tokio::task::spawn_blocking(move || {
        cluster.pg_stop_immediate();
        cluster
    })
    .await
    .unwrap();
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(r.status, 201);
    assert_eq!(r.headers["idempotency-status"], "bypassed");
    assert_eq!(up.executions(), 2);
}
