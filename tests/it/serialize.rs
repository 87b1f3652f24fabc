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
    .patch("timeout: 5s", "timeout: 1s")
}

/// Adds a keyed route `solo` (`/solo`, limit 1, same scope header) before the others, so
/// that two routes with different limits share each scope.
pub fn with_solo_route(yaml: &str) -> String {
    yaml.replacen(
        "routes:\n",
        "routes:
  - name: solo
    match: { path_prefix: /solo }
    upstream: app
    idempotency:
      scope: { header: X-Account-Id }
      lease: 20s
      serialize: { max_in_flight: 1, wait_timeout: 10s }
",
        1,
    )
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

#[tokio::test]
async fn two_routes_with_different_limits_do_not_add_up_across_instances() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(100),
        ..Default::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let yaml = with_solo_route(&yaml(&db, &up.url(), 3, "10s"));
    let a = TestGateway::start(&yaml, &db).await;
    let b = TestGateway::start(&yaml, &db).await;
    let urls = [
        a.url("/solo"),
        b.url("/pay"),
        a.url("/pay"),
        b.url("/solo"),
        a.url("/pay"),
        b.url("/pay"),
    ];
    let keys = (0..24)
        .map(|i| ("acct".to_string(), format!("k-{i}")))
        .collect();
    let replies = at_once(&urls, keys, "e").await;
    assert!(replies.iter().all(|r| r.status == 201), "{replies:?}");
    assert_eq!(up.executions(), 24);
    assert_eq!(
        up.max_concurrency_beside("/solo"),
        1,
        "a limit-1 request runs alone in its scope, whichever instance forwards the others"
    );
    assert!(
        up.max_concurrency() <= 3,
        "max {} at once",
        up.max_concurrency()
    );
}

/// The race the per-scope lock closes: a holder releases while a limit-1 taker and a limit-3
/// taker ask at once. Without the lock, the limit-3 taker's snapshot can still see the old
/// holder (and pick another slot number) while the limit-1 taker sees none, and both win.
/// Whatever the order, at most one of them may hold a slot afterwards.
#[tokio::test]
async fn a_strict_and_a_loose_taker_racing_a_release_never_both_win() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let gw = TestGateway::start(&yaml(&db, &up.url(), 3, "10s"), &db).await;
    let store = gw.store.clone();
    let lease = Duration::from_secs(60);
    let mut both = 0;
    for round in 0..200 {
        let scope = format!("race-{round}");
        let old = store
            .acquire_slot(&scope, 3, lease)
            .await
            .unwrap()
            .expect("an idle scope");
        let (released, strict, loose) = tokio::join!(
            store.release_slot(&old),
            store.acquire_slot(&scope, 1, lease),
            store.acquire_slot(&scope, 3, lease),
        );
        assert!(released.unwrap());
        if let (Some(_), Some(_)) = (strict.unwrap(), loose.unwrap()) {
            both += 1;
        }
    }
    assert_eq!(both, 0, "rounds in which a limit-1 slot was shared");
}
