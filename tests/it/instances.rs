//! Several gateway instances on one database behave as one gateway: wake-ups cross
//! instances through LISTEN/NOTIFY, local waiters share lookups, and polling takes over when
//! notifications stop.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::process::GatewayProcess;
use crate::support::*;

/// Fires `n` identical keyed requests at once, round-robin over `urls`.
async fn storm(urls: &[String], n: usize, key: &str) -> Vec<Reply> {
    at_once(urls, vec![("a".to_string(), key.to_string()); n], "evt").await
}

fn assert_one_answer(replies: &[Reply]) {
    for r in replies {
        assert_eq!(r.status, 201, "{r:?}");
        assert_eq!(
            r.body, replies[0].body,
            "every duplicate gets the same body"
        );
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
}

#[tokio::test]
async fn a_completion_on_one_instance_wakes_waiters_on_the_other() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(600),
        ..Default::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "");
    let a = TestGateway::start(&yaml, &db).await;
    let b = TestGateway::start(&yaml, &db).await;
    wakeups_flow(&a).await;
    wakeups_flow(&b).await;
    let first = in_flight(&a.url("/pay"), &up, "a", "k", "evt").await;
    // 29 duplicates wait on instance B.
    let replies = storm(&[b.url("/pay")], 29, "k").await;
    let mut all = vec![first.await.unwrap()];
    all.extend(replies);
    assert_one_answer(&all);
    assert_eq!(up.executions(), 1);
    let stats = &b.store.wakeups().stats;
    assert!(
        stats.woken.load(Ordering::Relaxed) >= 1,
        "B was woken by A's NOTIFY"
    );
    let lookups = stats.lookups.load(Ordering::Relaxed);
    assert!(
        lookups < 29,
        "29 local waiters shared their lookups ({lookups} statements, {} shared)",
        stats.shared.load(Ordering::Relaxed)
    );
}

#[tokio::test]
async fn a_dead_listener_reconnects_by_itself() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    wakeups_flow(&gw).await;
    let stats = &gw.store.wakeups().stats;
    assert_eq!(stats.listener_sessions.load(Ordering::Relaxed), 1);
    let killed = gw
        .sql()
        .await
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
              WHERE application_name = 'idemgate-listener' AND datname = current_database()",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        killed.len(),
        1,
        "exactly one listener connection per instance"
    );
    wait_until(
        "the listener reconnects",
        Duration::from_secs(10),
        || async { stats.listener_sessions.load(Ordering::Relaxed) == 2 },
    )
    .await;
    wakeups_flow(&gw).await;
}

#[tokio::test]
async fn without_wake_ups_waiters_poll_and_still_get_the_one_answer() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(400),
        ..Default::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let gw = TestGateway::start_with(&config_yaml(&db, &up.url(), ""), &db, false).await;
    assert!(!gw.store.wakeups().healthy());
    assert_one_answer(&storm(&[gw.url("/pay")], 20, "polled").await);
    assert_eq!(up.executions(), 1);
    assert_eq!(gw.store.wakeups().stats.woken.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn thirty_duplicates_across_two_gateway_processes_execute_once() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(500),
        ..Default::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "");
    let a = GatewayProcess::start(&yaml).await;
    let b = GatewayProcess::start(&yaml).await;
    let urls = [a.url("/pay"), b.url("/pay")];
    assert_one_answer(&storm(&urls, 30, "webhook-1").await);
    assert_eq!(up.executions(), 1, "one execution across both instances");
    // A lease taken on one instance is respected by the other, with `reject` too.
    let db2 = pg::fresh_database().await;
    let yaml = config_yaml(&db2, &up.url(), "in_flight: reject");
    let a = GatewayProcess::start(&yaml).await;
    let b = GatewayProcess::start(&yaml).await;
    let c = client();
    let first = in_flight(&a.url("/pay"), &up, "a", "k2", "evt").await;
    let dup = post_to(&c, &b.url("/pay"), "a", "k2", "evt").await;
    assert_eq!((dup.status, dup.problem().as_str()), (409, "in-flight"));
    assert_eq!(first.await.unwrap().status, 201);
    assert!(
        post_to(&c, &b.url("/pay"), "a", "k2", "evt")
            .await
            .replayed()
    );
    assert_eq!(up.executions(), 2);
}

/// A NOTIFY serializes commits cluster-wide; a key nobody waits for is finished without one.
/// (Notifications arrive in commit order, so a sentinel sent afterwards, arriving first,
/// proves no announcement came before it.)
#[tokio::test]
async fn a_key_nobody_waits_for_is_finished_without_an_announcement() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let (client_pg, mut conn) = tokio_postgres::connect(&gw.db, tokio_postgres::NoTls)
        .await
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(Ok(msg)) = std::future::poll_fn(|cx| conn.poll_message(cx)).await {
            if let tokio_postgres::AsyncMessage::Notification(n) = msg {
                let _ = tx.send(n.payload().to_string());
            }
        }
    });
    client_pg
        .batch_execute("LISTEN idemgate_keys")
        .await
        .unwrap();
    assert_eq!(post(&client(), &gw, "a", "lonely", "x").await.status, 201);
    client_pg
        .batch_execute("SELECT pg_notify('idemgate_keys', 'sentinel')")
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let got = rx.recv().await.unwrap();
            if !got.starts_with("probe:") {
                return got;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(first, "sentinel", "the completion was not announced");
}
