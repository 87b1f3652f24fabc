//! The replay cache: hot replays skip the store, and nothing it serves is stale.

use std::sync::atomic::Ordering;
use std::time::Duration;

use idemgate::store::Deleted;

use crate::support::*;

fn hits(gw: &TestGateway) -> u64 {
    gw.gateway
        .inflight()
        .trusted_cache()
        .map(|(c, _)| c.hits.load(Ordering::Relaxed))
        .unwrap_or(0)
}

#[tokio::test]
async fn a_hot_replay_is_served_from_memory_byte_for_byte() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    wakeups_flow(&gw).await;
    let c = client();
    let first = post(&c, &gw, "a", "k", "x").await;
    let from_store = post(&c, &gw, "a", "k", "x").await;
    assert!(from_store.replayed());
    assert_eq!(
        hits(&gw),
        0,
        "the first replay is read from the store, and fills the cache"
    );
    let from_memory = post(&c, &gw, "a", "k", "x").await;
    assert!(from_memory.replayed());
    assert_eq!(from_memory.body, first.body);
    assert_eq!(from_memory.headers["etag"], first.headers["etag"]);
    assert_eq!(hits(&gw), 1, "the second replay came from memory");
    // A different request under the key still goes to the store, which says 422.
    assert_eq!(post(&c, &gw, "a", "k", "y").await.status, 422);
    assert_eq!(up.executions(), 1);
}

/// A hit skips the repeated-member check, so a body that repeats a member name never enters
/// the cache: a JSON retry of one first sent as another type is still refused, after any
/// number of replays.
#[tokio::test]
async fn a_body_that_repeats_a_member_is_never_served_from_memory() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    wakeups_flow(&gw).await;
    let c = client();
    let url = gw.url("/pay");
    let ambiguous = r#"{"amount":1,"amount":1000}"#;
    let send_as = |content_type: &'static str| {
        let (c, url) = (&c, &url);
        async move {
            let h = [
                ("idempotency-key", "k"),
                ("x-account-id", "a"),
                ("content-type", content_type),
            ];
            send(c, http::Method::POST, url, &h, ambiguous.to_string()).await
        }
    };
    // Not said to be JSON: not checked, forwarded once, then replayed from the store.
    assert_eq!(send_as("text/plain").await.status, 201);
    for _ in 0..3 {
        assert!(send_as("text/plain").await.replayed());
    }
    assert_eq!(hits(&gw), 0, "it was never served from memory");
    let json = send_as("application/json").await;
    assert_eq!(
        (json.status, json.problem().as_str()),
        (400, "body-not-json")
    );
    // The same request without the repeat is served from memory from its second replay on.
    let h = [
        ("idempotency-key", "k2"),
        ("x-account-id", "a"),
        ("content-type", "application/json"),
    ];
    for _ in 0..3 {
        send(
            &c,
            http::Method::POST,
            &url,
            &h,
            r#"{"amount":1}"#.to_string(),
        )
        .await;
    }
    assert_eq!(hits(&gw), 1);
    let json = send_as("application/json").await;
    assert_eq!(json.status, 400, "a hit on another key changes nothing");
    assert_eq!(up.executions(), 2);
}

#[tokio::test]
async fn a_delete_on_one_instance_evicts_the_key_from_every_instances_cache() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "");
    let a = TestGateway::start(&yaml, &db).await;
    let b = TestGateway::start(&yaml, &db).await;
    wakeups_flow(&a).await;
    wakeups_flow(&b).await;
    let c = client();
    post(&c, &a, "a", "k", "x").await;
    assert!(
        post(&c, &b, "a", "k", "x").await.replayed(),
        "B read it from the store"
    );
    assert!(post(&c, &b, "a", "k", "x").await.replayed());
    assert_eq!(hits(&b), 1, "and then served it from memory");
    assert!(matches!(
        a.store.delete(&scoped("a"), "k", false).await.unwrap(),
        Deleted::Yes { .. }
    ));
    wait_until(
        "B forwards the deleted key again",
        Duration::from_secs(5),
        || async { !post(&c, &b, "a", "k", "x").await.replayed() },
    )
    .await;
    assert_eq!(up.executions(), 2);
}

#[tokio::test]
async fn without_wake_ups_the_cache_is_not_used() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let gw =
        TestGateway::start_config(without_wakeups(&config_yaml(&db, &up.url(), "")), &db).await;
    let c = client();
    post(&c, &gw, "a", "k", "x").await;
    assert!(post(&c, &gw, "a", "k", "x").await.replayed());
    assert_eq!(hits(&gw), 0);
    assert!(gw.gateway.inflight().trusted_cache().is_none());
}
