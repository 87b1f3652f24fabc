//! Rollout and shutdown (docs/contract.md §8.3), on the real binary: `mode: observe` forwards
//! everything, records first attempts as `enforce` would and counts what enforcing would have
//! done; a switch to `enforce` replays what observe recorded. On SIGTERM or SIGINT,
//! `server.drain_delay` fails `/readyz` at once and keeps serving new connections until the
//! delay ends; a request in flight then still gets `shutdown_grace` and is recorded;
//! `/readyz` stays 200 through a store outage once the store has been ready.

use std::time::{Duration, Instant};

use http::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::process::GatewayProcess;
use crate::support::*;

/// The config with an admin listener on a port the process binds (it prints the address).
fn with_admin(yaml: String) -> String {
    format!("{yaml}admin: {{ listen: \"127.0.0.1:0\" }}\n")
}

/// The admin address the process printed.
fn admin_of(gw: &GatewayProcess) -> String {
    gw.admin
        .expect("the process has an admin listener")
        .to_string()
}

async fn admin_get(admin: &str, path: &str) -> Reply {
    send(
        &client(),
        Method::GET,
        &format!("http://{admin}{path}"),
        &[],
        "",
    )
    .await
}

async fn metrics(admin: &str) -> String {
    String::from_utf8_lossy(&admin_get(admin, "/metrics").await.body).to_string()
}

fn observed(text: &str, outcome: &str) -> f64 {
    metric(
        text,
        &format!("idemgate_observed_total{{route=\"payments\",outcome=\"{outcome}\"}}"),
    )
}

fn requests(text: &str, outcome: &str) -> f64 {
    requests_counted(text, "payments", outcome)
}

/// The one log line that says what enforcing would have done with `key_id`'s request.
fn observed_line(log: &str, would: &str, key_id: &str) -> bool {
    log.lines()
        .any(|l| l.contains("observe:") && l.contains(would) && l.contains(key_id))
}

#[tokio::test]
async fn observe_forwards_every_duplicate_counts_what_enforcing_would_have_done_and_enforce_then_replays()
 {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(1500),
        ..Default::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let yaml = with_admin(config_yaml(&db, &up.url(), "mode: observe"));
    let mut gw = GatewayProcess::start(&yaml).await;
    let admin = admin_of(&gw);
    let c = client();
    let url = gw.url("/pay");

    // Before any traffic the three series exist at 0: a rate reads 0, not "no data".
    let before = metrics(&admin).await;
    for would in ["would_replay", "would_wait", "would_mismatch"] {
        assert_eq!(observed(&before, would), 0.0, "{would}");
    }

    // A duplicate while the first is in flight: forwarded at once, not waited for.
    let first = in_flight(&url, &up, "a", "k1", "order-1").await;
    let during = post_to(&c, &url, "a", "k1", "order-1").await;
    let first = first.await.unwrap();
    assert_eq!((first.status, during.status), (201, 201));
    assert!(!first.replayed() && !during.replayed());
    assert_eq!(
        up.max_concurrency(),
        2,
        "the duplicate ran beside the first"
    );
    assert_eq!(first.json()["execution"], 1);
    assert_eq!(during.json()["execution"], 2);

    // A duplicate after completion: forwarded again, never replayed.
    let again = post_to(&c, &url, "a", "k1", "order-1").await;
    assert_eq!((again.status, again.replayed()), (201, false));
    assert_eq!(again.json()["execution"], 3);
    // The same key with another body: forwarded, never 422.
    let other = post_to(&c, &url, "a", "k1", "order-2").await;
    assert_eq!((other.status, other.replayed()), (201, false));
    assert_eq!(up.executions(), 4, "every request reached the upstream");

    // The first answer was recorded as enforce records it, and nothing overwrote it.
    let row = sql(&db)
        .await
        .query_one(
            "SELECT state, body, attempts FROM idemgate_keys WHERE key = 'k1'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "completed");
    assert_eq!(row.get::<_, Vec<u8>>(1), first.body.to_vec());
    assert_eq!(row.get::<_, i32>(2), 1);

    let text = metrics(&admin).await;
    assert_eq!(observed(&text, "would_wait"), 1.0);
    assert_eq!(observed(&text, "would_replay"), 1.0);
    assert_eq!(observed(&text, "would_mismatch"), 1.0);
    assert_eq!(requests(&text, "forwarded"), 1.0);
    assert_eq!(requests(&text, "observed"), 3.0);

    // Each is logged with the key's id (its hash), never the key itself.
    let id = idemgate::key::KeyId::of(&scoped("a"), "k1").to_string();
    wait_until(
        "the three observations are logged",
        Duration::from_secs(10),
        || async {
            let log = gw.log_text();
            ["would_wait", "would_replay", "would_mismatch"]
                .iter()
                .all(|would| observed_line(&log, would, &id))
        },
    )
    .await;

    // Switch the same file to enforce: what observe recorded is replayed, byte for byte.
    let text = std::fs::read_to_string(&gw.config).unwrap();
    std::fs::write(&gw.config, text.patch("mode: observe", "mode: enforce")).unwrap();
    gw.hangup();
    wait_until("the reload is logged", Duration::from_secs(10), || async {
        gw.log_text().contains("configuration reloaded")
    })
    .await;
    let replay = post_to(&c, &url, "a", "k1", "order-1").await;
    assert_eq!(replay.status, 201);
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body, "the first answer, byte for byte");
    let mismatch = post_to(&c, &url, "a", "k1", "order-2").await;
    assert_eq!(
        (mismatch.status, mismatch.problem().as_str()),
        (422, "fingerprint-mismatch")
    );
    assert_eq!(up.executions(), 4, "enforcing forwards neither");
    gw.kill();
}

/// A chunked keyed POST over raw TCP (no `Content-Length`): `chunks` chunks of 1000 bytes.
async fn chunked_post(gw: &GatewayProcess, key: &str, chunks: usize) -> String {
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let head = format!(
        "POST /pay HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: {key}\r\nX-Account-Id: a\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    for _ in 0..chunks {
        s.write_all(format!("3e8\r\n{}\r\n", "x".repeat(1000)).as_bytes())
            .await
            .unwrap();
    }
    s.write_all(b"0\r\n\r\n").await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out))
        .await
        .expect("an answer within 30 s")
        .unwrap();
    String::from_utf8_lossy(&out).to_string()
}

/// A store that hangs (every PostgreSQL process stopped: connections open, nothing answers)
/// rather than refusing: an observed route still forwards every keyed request once the
/// store's bound passes, and claims again once the store answers.
#[tokio::test]
async fn observe_forwards_when_the_store_hangs_instead_of_refusing() {
    let cluster = pg::Cluster::start_async().await;
    let db = cluster.new_database().await;
    let up = Upstream::start().await;
    let yaml = with_admin(config_yaml(&db, &up.url(), "mode: observe"));
    let gw = GatewayProcess::start(&yaml).await;
    let admin = admin_of(&gw);
    let c = client();
    let url = gw.url("/pay");
    assert_eq!(post_to(&c, &url, "a", "before", "x").await.status, 201);
    assert_eq!(key_state(&db, "before").await, "completed");

    let frozen = cluster.frozen();
    for i in 0..3 {
        let r = post_to(&c, &url, "a", &format!("hung-{i}"), "x").await;
        assert_eq!(r.status, 201, "{r:?}");
    }
    assert_eq!(up.executions(), 4, "each forwarded once");
    assert_eq!(requests(&metrics(&admin).await, "bypassed"), 3.0);
    drop(frozen);

    // The store answers again: keys are claimed and recorded again.
    wait_until(
        "a new key is recorded again",
        Duration::from_secs(20),
        || async {
            let key = format!("after-{}", up.executions());
            post_to(&c, &url, "a", &key, "x").await.status == 201
                && sql(&db)
                    .await
                    .query_opt(
                        "SELECT 1 FROM idemgate_keys WHERE key = $1 AND state = 'completed'",
                        &[&key],
                    )
                    .await
                    .is_ok_and(|row| row.is_some())
        },
    )
    .await;
    let log = gw.log_text();
    assert!(
        log.contains("observe: the store cannot claim; forwarded without idempotency"),
        "{log}"
    );
}

#[tokio::test]
async fn observe_never_blocks_a_request_it_cannot_key_an_oversized_body_or_store_trouble() {
    let cluster = pg::Cluster::start_async().await;
    let db = cluster.new_database().await;
    let up = Upstream::start().await;
    let yaml = with_admin(config_yaml(
        &db,
        &up.url(),
        "mode: observe\n      required: true\n      max_request_body: 1KiB",
    ));
    let mut gw = GatewayProcess::start(&yaml).await;
    let admin = admin_of(&gw);
    let c = client();
    let url = gw.url("/pay");

    // Requests enforcing would refuse before any claim are forwarded without idempotency.
    let no_key = send(&c, Method::POST, &url, &[("x-account-id", "a")], "x").await;
    assert_eq!(no_key.status, 201);
    let bad_key = post_to(&c, &url, "a", "has space", "x").await;
    assert_eq!(bad_key.status, 201);
    let big = post_to(&c, &url, "a", "big-1", &"x".repeat(4096)).await;
    assert_eq!(big.status, 201);
    assert_eq!(big.json()["received_bytes"], 4096, "forwarded whole");
    // Chunked, found over the limit while reading: what was read and the rest, in order.
    let chunked = chunked_post(&gw, "big-2", 3).await;
    assert!(chunked.starts_with("HTTP/1.1 201"), "{chunked}");
    assert!(chunked.contains("\"received_bytes\":3000"), "{chunked}");
    assert_eq!(up.executions(), 4);
    assert_eq!(
        up.seen()[3].body,
        "x".repeat(3000).as_bytes(),
        "the upstream got the body as sent"
    );
    let text = metrics(&admin).await;
    assert_eq!(requests(&text, "key_missing"), 1.0);
    assert_eq!(requests(&text, "key_invalid"), 1.0);
    assert_eq!(requests(&text, "body_too_large"), 2.0);
    let keys: i64 = sql(&db)
        .await
        .query_one("SELECT count(*) FROM idemgate_keys", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(keys, 0, "none of them was claimed");

    // The store dies while a first attempt is at the upstream: its answer cannot be
    // recorded, and the client gets it anyway (enforcing would answer 503).
    up.set(Behavior {
        delay: Duration::from_millis(1500),
        ..Default::default()
    });
    let first = in_flight(&url, &up, "a", "k-outage", "x").await;
    let cluster = cluster.crashed().await;
    let first = first.await.unwrap();
    assert_eq!((first.status, first.replayed()), (201, false));

    // With the store down, keyed requests are forwarded without a claim: never a 503.
    up.set(Behavior::default());
    let before = up.executions();
    for i in 0..3 {
        let r = post_to(&c, &url, "a", &format!("down-{i}"), "x").await;
        assert_eq!(r.status, 201, "{r:?}");
        assert!(
            !r.headers.contains_key("idempotency-status"),
            "observe answers carry no gateway header"
        );
    }
    assert_eq!(up.executions(), before + 3);
    let text = metrics(&admin).await;
    assert_eq!(requests(&text, "bypassed"), 3.0);
    // The log is written by a thread of its own: its lines may reach the file a moment after
    // the answers.
    for line in [
        "observe: the answer could not be recorded; passed on anyway",
        "observe: the store cannot claim; forwarded without idempotency",
    ] {
        wait_until(line, Duration::from_secs(10), || async {
            gw.log_text().contains(line)
        })
        .await;
    }
    drop(cluster);
    gw.kill();
}

#[tokio::test]
async fn sigterm_with_a_drain_delay_fails_readyz_at_once_and_serves_new_connections_until_the_delay_ends()
 {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let delay = Duration::from_secs(2);
    let yaml = with_admin(
        config_yaml(&db, &up.url(), "")
            .patch("shutdown_grace: 5s", "shutdown_grace: 5s, drain_delay: 2s"),
    );
    let mut gw = GatewayProcess::start(&yaml).await;
    let admin = admin_of(&gw);
    let ready = admin_get(&admin, "/readyz").await;
    assert_eq!(
        (ready.status, &ready.json()["status"]),
        (200, &"ready".into())
    );

    // Taken before the signal is sent: every time measured from it is an upper bound.
    let signalled = Instant::now();
    gw.terminate();
    // Not ready at once: well within the delay.
    let admin_url = admin.clone();
    wait_until("/readyz answers 503", delay / 2, || async {
        admin_get(&admin_url, "/readyz").await.status == 503
    })
    .await;
    let draining = admin_get(&admin, "/readyz").await;
    assert_eq!(draining.json()["status"], "draining");

    // A new connection (a fresh client) is still accepted and served, keyed or not, and
    // told not to keep the connection.
    let keyed = post_to(&client(), &gw.url("/pay"), "a", "during-drain", "x").await;
    let plain = send(&client(), Method::GET, &gw.url("/plain"), &[], "").await;
    assert!(
        signalled.elapsed() < delay,
        "served within the delay ({:?})",
        signalled.elapsed()
    );
    for r in [&keyed, &plain] {
        assert_eq!(r.status, 201, "{r:?}");
        assert_eq!(r.headers["connection"], "close");
    }
    assert_eq!(up.executions(), 2);

    // After the delay, new connections are refused; the process exits 0.
    let addr = gw.addr;
    wait_until(
        "new connections are refused",
        Duration::from_secs(10),
        || async { tokio::net::TcpStream::connect(addr).await.is_err() },
    )
    .await;
    assert!(
        signalled.elapsed() >= delay,
        "the listener stayed open for the whole delay ({:?})",
        signalled.elapsed()
    );
    assert!(
        gw.wait_exit(Duration::from_secs(10)).await,
        "exit 0:\n{}",
        gw.log_text()
    );
    let state = key_state(&db, "during-drain").await;
    assert_eq!(
        state, "completed",
        "served during the drain, stored as usual"
    );
}

#[tokio::test]
async fn sigint_drains_as_sigterm_does_readyz_fails_at_once_the_delay_serves_and_it_exits_0() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let delay = Duration::from_secs(2);
    let yaml = with_admin(
        config_yaml(&db, &up.url(), "")
            .patch("shutdown_grace: 5s", "shutdown_grace: 5s, drain_delay: 2s"),
    );
    let mut gw = GatewayProcess::start(&yaml).await;
    let admin = admin_of(&gw);
    assert_eq!(admin_get(&admin, "/readyz").await.status, 200);

    gw.interrupt();
    let admin_url = admin.clone();
    wait_until("/readyz answers 503", delay / 2, || async {
        admin_get(&admin_url, "/readyz").await.status == 503
    })
    .await;
    assert_eq!(
        admin_get(&admin, "/readyz").await.json()["status"],
        "draining"
    );
    // Still in the delay: a new connection is served and told not to keep the connection.
    let plain = send(&client(), Method::GET, &gw.url("/plain"), &[], "").await;
    assert_eq!(plain.status, 201, "{plain:?}");
    assert_eq!(plain.headers["connection"], "close");
    assert!(
        gw.wait_exit(Duration::from_secs(10)).await,
        "exit 0:\n{}",
        gw.log_text()
    );
    assert!(gw.log_text().contains("SIGINT received"));
}

#[tokio::test]
async fn a_keyed_request_in_flight_when_the_drain_delay_ends_completes_is_recorded_and_it_exits_0()
{
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_secs(4),
        ..Default::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "")
        .patch("shutdown_grace: 5s", "shutdown_grace: 10s, drain_delay: 1s");
    let mut gw = GatewayProcess::start(&yaml).await;
    let slow = in_flight(&gw.url("/pay"), &up, "a", "slow-drain", "x").await;
    gw.terminate();

    // The delay ends (the listener closes) while the upstream still works on it.
    let addr = gw.addr;
    wait_until(
        "new connections are refused",
        Duration::from_secs(10),
        || async { tokio::net::TcpStream::connect(addr).await.is_err() },
    )
    .await;
    assert_eq!(
        up.answered(),
        0,
        "the request was still at the upstream when the delay ended"
    );

    // It completes within shutdown_grace, is recorded, and the process exits 0.
    let first = slow.await.unwrap();
    assert_eq!((first.status, first.replayed()), (201, false), "{first:?}");
    assert!(
        gw.wait_exit(Duration::from_secs(20)).await,
        "exit 0:\n{}",
        gw.log_text()
    );
    let state = key_state(&db, "slow-drain").await;
    assert_eq!(state, "completed");

    // A retry on the next process replays it: the upstream never runs it twice.
    up.set(Behavior::default());
    gw.restart().await;
    let retry = send(
        &client(),
        Method::POST,
        &gw.url("/pay"),
        &[("idempotency-key", "slow-drain"), ("x-account-id", "a")],
        "x",
    )
    .await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(up.executions(), 1);
    gw.kill();
}

/// Observe mode on a key whose first attempt left no answer to replay: held (outcome
/// unknown under `on_unknown_outcome: hold`) or not replayable (too large to store).
/// Enforcing would answer 502 without forwarding; observe forwards and counts both as
/// `would_replay` (src/gateway/keyed.rs: enforcing would not have forwarded them).
#[tokio::test]
async fn observe_forwards_held_and_not_replayable_keys_and_counts_them_as_would_replay() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_secs(3),
        ..Default::default()
    })
    .await;
    let idem = "mode: observe\n      lease: 5s\n      on_unknown_outcome: hold\n      max_stored_response: 1KiB";
    let (gw, _db) = TestGateway::on_with(Backend::Postgres, &up, idem, |y| {
        y.patch("timeout: 5s", "timeout: 500ms")
    })
    .await;
    let c = client();
    let timed_out = post(&c, &gw, "a", "held", "x").await;
    assert_eq!(timed_out.status, 504, "{timed_out:?}");
    assert_eq!(
        row_state(&gw, "a", "held").await.as_deref(),
        Some("unknown")
    );
    up.set(Behavior {
        body: Some(bytes::Bytes::from(vec![b'z'; 5000])),
        ..Default::default()
    });
    assert_eq!(post(&c, &gw, "a", "big", "x").await.status, 201);
    assert_eq!(
        row_state(&gw, "a", "big").await.as_deref(),
        Some("not_replayable")
    );

    for key in ["held", "big"] {
        let again = post(&c, &gw, "a", key, "x").await;
        assert_eq!((again.status, again.replayed()), (201, false), "{key}");
    }
    assert_eq!(up.executions(), 4, "both duplicates were forwarded");
    let m = admin_request(&gw, Method::GET, "/metrics", None).await;
    let text = String::from_utf8_lossy(&m.body);
    assert_eq!(observed(&text, "would_replay"), 2.0);
    assert_eq!(observed(&text, "would_wait"), 0.0);
    assert_eq!(observed(&text, "would_mismatch"), 0.0);
}

#[tokio::test]
async fn a_second_signal_ends_the_drain_delay_early() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = with_admin(
        config_yaml(&db, &up.url(), "")
            .patch("shutdown_grace: 5s", "shutdown_grace: 5s, drain_delay: 60s"),
    );
    let mut gw = GatewayProcess::start(&yaml).await;
    let admin = admin_of(&gw);
    gw.terminate();
    wait_until("/readyz answers 503", Duration::from_secs(10), || async {
        admin_get(&admin, "/readyz").await.status == 503
    })
    .await;
    // The image's HEALTHCHECK says why.
    let health = idemgate_health(&admin).await;
    assert_eq!(health.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&health.stderr)
            .contains("answered 503 Service Unavailable: draining"),
        "{health:?}"
    );
    let second = Instant::now();
    gw.terminate();
    assert!(
        gw.wait_exit(Duration::from_secs(10)).await,
        "exit 0:\n{}",
        gw.log_text()
    );
    assert!(second.elapsed() < Duration::from_secs(10));
    assert!(
        gw.log_text()
            .contains("second signal: ending the drain delay now")
    );
}

#[tokio::test]
async fn readyz_fails_until_the_store_is_first_ready_then_stays_200_through_an_outage_and_says_so()
{
    let cluster = pg::Cluster::start_async().await;
    let db = cluster.new_database().await;
    let cluster = cluster.crashed().await;
    let up = Upstream::start().await;
    let yaml = with_admin(config_yaml(&db, &up.url(), ""));
    // Started with its store down: not ready, so a rollout would not replace working
    // instances with it.
    let gw = GatewayProcess::start(&yaml).await;
    let admin = admin_of(&gw);
    let starting = admin_get(&admin, "/readyz").await;
    assert_eq!(starting.status, 503);
    assert_eq!(starting.json()["status"], "not ready");

    let cluster = cluster.restarted().await;
    let admin_url = admin.clone();
    wait_until(
        "ready once the store answers and is migrated",
        Duration::from_secs(30),
        || async { admin_get(&admin_url, "/readyz").await.status == 200 },
    )
    .await;

    // The store goes down again: every instance shares the outage, so /readyz stays 200 and
    // says so, while plain routes serve and keyed ones answer 503 store-unavailable.
    let _cluster = cluster.crashed().await;
    let c = client();
    let plain = send(&c, Method::GET, &gw.url("/plain"), &[], "").await;
    assert_eq!(plain.status, 201);
    let keyed = post_to(&c, &gw.url("/pay"), "a", "k", "x").await;
    assert_eq!(
        (keyed.status, keyed.problem().as_str()),
        (503, "store-unavailable")
    );
    let started = Instant::now();
    let degraded = admin_get(&admin, "/readyz").await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "answered within a probe's timeout ({:?})",
        started.elapsed()
    );
    assert_eq!(degraded.status, 200, "{degraded:?}");
    let body = degraded.json();
    assert_eq!(body["status"], "degraded");
    assert_eq!(body["store"], "unavailable");
    assert!(body["reason"].as_str().is_some_and(|r| !r.is_empty()));
    assert!(
        !String::from_utf8_lossy(&degraded.body).contains("postgres://"),
        "the database URL (a secret) is not printed"
    );
    // The image's HEALTHCHECK stays healthy, and says the store is down.
    let health = idemgate_health(&admin).await;
    assert_eq!(health.status.code(), Some(0), "{health:?}");
    assert!(
        String::from_utf8_lossy(&health.stdout).starts_with("ready (degraded: "),
        "{health:?}"
    );
}

/// `idemgate health --url` on an admin listener's `/readyz`.
async fn idemgate_health(admin: &str) -> std::process::Output {
    tokio::process::Command::new(crate::support::bin::idemgate())
        .args(["health", "--url", &format!("http://{admin}/readyz")])
        .output()
        .await
        .unwrap()
}
