//! `serialize`: at most `max_in_flight` keyed forwards per scope at once, across instances.

use std::time::Duration;

use crate::support::*;

/// Upstream timeout 1s, a lease that covers timeout + wait + record.
fn yaml(db: &str, upstream: &str, max: u32, wait: &str) -> String {
    config_yaml(
        db,
        upstream,
        &format!("lease: 20s\n      serialize: {{ max_in_flight: {max}, wait_timeout: {wait} }}"),
    )
    .replace("timeout: 5s", "timeout: 1s")
}

pub async fn burst(urls: &[String], account: &str, n: usize) -> Vec<Reply> {
    let keys = (0..n)
        .map(|i| (account.to_string(), format!("{account}-evt-{i}")))
        .collect();
    at_once(urls, keys, "e").await
}

#[tokio::test]
async fn the_limit_holds_across_instances_and_scopes_do_not_block_each_other() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(150),
        ..Default::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let yaml = yaml(&db, &up.url(), 1, "10s");
    let a = TestGateway::start(&yaml, &db).await;
    let b = TestGateway::start(&yaml, &db).await;
    let urls = [a.url("/pay"), b.url("/pay")];
    let replies = burst(&urls, "one", 8).await;
    assert!(replies.iter().all(|r| r.status == 201), "{replies:?}");
    assert_eq!(
        up.max_concurrency(),
        1,
        "one scope, one forward at a time, two instances"
    );

    // Two scopes proceed side by side.
    let (r1, r2) = tokio::join!(burst(&urls, "left", 4), burst(&urls, "right", 4));
    assert!(r1.iter().chain(&r2).all(|r| r.status == 201));
    assert_eq!(
        up.max_concurrency(),
        2,
        "different scopes are not serialized together"
    );
}

#[tokio::test]
async fn a_crashed_holders_slot_frees_itself_when_its_lease_ends() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let gw = TestGateway::start(&yaml(&db, &up.url(), 1, "10s"), &db).await;
    // A crashed instance holds the only slot of scope "a" for one more second.
    gw.sql()
        .await
        .execute(
            "INSERT INTO idemgate_slots (scope, slot, token, lease_expires_at)
             VALUES ('header:a', 0, gen_random_uuid(), now() + interval '1 second')",
            &[],
        )
        .await
        .unwrap();
    let c = client();
    let r = post(&c, &gw, "a", "k", "e").await;
    assert_eq!(
        r.status, 201,
        "served once the crashed holder's lease ended"
    );
    assert_eq!(up.executions(), 1);
    let slots: i64 = gw
        .sql()
        .await
        .query_one("SELECT count(*) FROM idemgate_slots", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 0, "our slot was released after the forward");
}
