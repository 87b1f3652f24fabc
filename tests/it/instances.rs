//! Several gateway instances on one database behave as one gateway: wake-ups cross
//! instances through LISTEN/NOTIFY, local waiters share lookups, and polling takes over when
//! notifications stop. Every test runs twice: on PostgreSQL directly (`postgres::*`), and
//! through PgBouncer in transaction mode with the listener on a direct session
//! (`pgbouncer::*`, docs/contract.md §8.4), where every announcement is sent through the
//! pooler and heard on `listen_url`.
//!
//! The fleet tests run three real gateway processes on one database: a 300-way duplicate
//! storm, the lab's 30 events of one account split across them (`serialize`), and a rolling
//! restart while a sender keeps delivering.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::Method;

use crate::support::process::GatewayProcess;
use crate::support::*;

backend_tests!(
    postgres: Postgres, pgbouncer: Pgbouncer;
    [
        a_completion_on_one_instance_wakes_waiters_on_the_other,
        a_dead_listener_reconnects_by_itself,
        without_wake_ups_waiters_poll_and_still_get_the_one_answer,
        thirty_duplicates_across_two_gateway_processes_execute_once,
        a_key_nobody_waits_for_is_finished_without_an_announcement,
        three_hundred_duplicates_across_three_gateway_processes_execute_once,
        thirty_events_of_one_account_split_across_three_processes_lose_no_update,
        a_rolling_restart_under_load_loses_nothing_and_every_2xx_names_real_work,
    ]
);

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

async fn a_completion_on_one_instance_wakes_waiters_on_the_other(b: Backend) {
    let (up, gate) = Upstream::start_gated().await;
    let (yaml, db) = fresh_config(b, &up.url(), "").await;
    let a = TestGateway::start(&yaml, &db).await;
    let b = TestGateway::start(&yaml, &db).await;
    wakeups_flow(&a).await;
    wakeups_flow(&b).await;
    // Held at the upstream's gate: in flight on A until the test lets it through.
    let first = in_flight(&a.url("/pay"), &up, "a", "k", "evt").await;
    // 29 duplicates wait on instance B: all of them in B, and B waiting for the key.
    let urls = [b.url("/pay")];
    let dups = tokio::spawn(async move { storm(&urls, 29, "k").await });
    wait_bodies_held(&b, 29 * "evt".len()).await;
    let sql = b.sql().await;
    wait_until(
        "B's requests wait for the key, and its row asks for an announcement",
        Duration::from_secs(10),
        || async {
            b.gateway.inflight().waited_keys() == 1
                && sql
                    .query_one("SELECT waiters FROM idemgate_keys WHERE key = 'k'", &[])
                    .await
                    .unwrap()
                    .get::<_, bool>(0)
        },
    )
    .await;
    gate.open();
    let replies = dups.await.unwrap();
    let mut all = vec![first.await.unwrap()];
    all.extend(replies);
    assert_one_answer(&all);
    assert_eq!(up.executions(), 1);
    let stats = &b.gateway.inflight().stats;
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

async fn a_dead_listener_reconnects_by_itself(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    wakeups_flow(&gw).await;
    let stats = &gw.gateway.inflight().stats;
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

/// A listener connection frozen without an error (its server process stopped: no reset, no
/// close) hears no announcement. The next probe, sent through the pool, is not heard: the
/// instance drops its replay cache (an operator's delete elsewhere could not reach it) within
/// the 9 s the docs give (the 5 s probe interval, 2 s to send the probe, 2 s to hear it), and
/// the connection is replaced and wake-ups flow again, within two probe intervals.
#[tokio::test]
async fn a_frozen_listener_is_replaced_when_its_probe_is_not_heard() {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(Backend::Postgres, &up, "").await;
    wakeups_flow(&gw).await;
    let c = client();
    assert_eq!(post(&c, &gw, "a", "k", "x").await.status, 201);
    assert!(post(&c, &gw, "a", "k", "x").await.replayed());
    assert!(
        gw.gateway.inflight().cache_bytes() > 0,
        "a replayed key is cached"
    );
    let stats = &gw.gateway.inflight().stats;
    let db = gw.sql().await;
    let pids = pg::session_pids(&db, "idemgate-listener").await;
    assert_eq!(pids.len(), 1, "one listener connection");
    let _frozen = pg::Stopped::stop(&pids);
    // A bound, not a speed claim: 9 s promised, 3 s of slack for a busy machine.
    // Unhealthy drops the cache; replaced, it was unhealthy first (and nothing was replayed
    // since to fill it again).
    wait_until("the probe is missed", Duration::from_secs(12), || async {
        !gw.gateway.inflight().healthy() || stats.listener_replaced.load(Ordering::Relaxed) >= 1
    })
    .await;
    assert_eq!(
        gw.gateway.inflight().cache_bytes(),
        0,
        "the cache is dropped"
    );
    let interval = idemgate::store::postgres::listener::REPROBE;
    wait_until(
        "the frozen listener is replaced",
        2 * interval + Duration::from_secs(10),
        || async { stats.listener_replaced.load(Ordering::Relaxed) >= 1 },
    )
    .await;
    wait_until(
        "a new listener session is up",
        Duration::from_secs(10),
        || async { stats.listener_sessions.load(Ordering::Relaxed) == 2 },
    )
    .await;
    wakeups_flow(&gw).await;
}

/// A listener whose server accepts its connection and never answers the session's start-up
/// (frozen before the session began) is given up on within its bound and tried again: once
/// the server answers, wake-ups flow.
#[tokio::test]
async fn a_listener_that_never_gets_a_session_tries_again() {
    use crate::support::fault_proxy::{Fault, FaultProxy};
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let (proxy, frozen) = FaultProxy::in_front_of_database(&db, Fault::Blackhole).await;
    let yaml = config_yaml(&db, &up.url(), "").patch(
        "pool_size: 8",
        &format!("pool_size: 8, listen_url: \"{frozen}\""),
    );
    let gw = TestGateway::start(&yaml, &db).await;
    wait_until(
        "the listener's first connection is held by the frozen server",
        Duration::from_secs(10),
        || async { proxy.accepted() >= 1 },
    )
    .await;
    assert!(!gw.gateway.inflight().healthy());
    // The server answers new connections from now on; the held one stays frozen.
    proxy.set(Fault::Pass).await;
    wait_until(
        "a new listener session is up",
        Duration::from_secs(20),
        || async { gw.gateway.inflight().healthy() },
    )
    .await;
    assert!(proxy.accepted() >= 2, "the listener connected again");
}

async fn without_wake_ups_waiters_poll_and_still_get_the_one_answer(b: Backend) {
    let (up, gate) = Upstream::start_gated().await;
    let (yaml, db) = fresh_config(b, &up.url(), "").await;
    let gw = TestGateway::start_config(without_wakeups(&yaml), &db).await;
    assert!(!gw.gateway.inflight().healthy());
    let urls = [gw.url("/pay")];
    let dups = tokio::spawn(async move { storm(&urls, 20, "polled").await });
    // The first is held at the upstream's gate until all twenty are in the gateway and the
    // others wait for the key.
    gate.wait_arrived(1).await;
    wait_bodies_held(&gw, 20 * "evt".len()).await;
    wait_until(
        "the duplicates wait for the key",
        Duration::from_secs(10),
        || async { gw.gateway.inflight().waited_keys() == 1 },
    )
    .await;
    gate.open();
    assert_one_answer(&dups.await.unwrap());
    assert_eq!(up.executions(), 1);
    assert_eq!(gw.gateway.inflight().stats.woken.load(Ordering::Relaxed), 0);
}

async fn thirty_duplicates_across_two_gateway_processes_execute_once(b: Backend) {
    // A slow upstream so that the storm's duplicates meet one in flight; the assertions hold
    // however long it is. The second part holds its request at a gate instead.
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(500),
        ..Default::default()
    })
    .await;
    let (yaml, _db) = fresh_config(b, &up.url(), "").await;
    let a = GatewayProcess::start(&yaml).await;
    let b2 = GatewayProcess::start(&yaml).await;
    let urls = [a.url("/pay"), b2.url("/pay")];
    assert_one_answer(&storm(&urls, 30, "webhook-1").await);
    assert_eq!(up.executions(), 1, "one execution across both instances");
    // A lease taken on one instance is respected by the other, with `reject` too.
    let (yaml, _db2) = fresh_config(b, &up.url(), "in_flight: reject").await;
    let a = GatewayProcess::start(&yaml).await;
    let b2 = GatewayProcess::start(&yaml).await;
    let c = client();
    let gate = Gate::new();
    up.set(Behavior {
        gate: Some(gate.clone()),
        ..Default::default()
    });
    // Held at the upstream's gate: in flight on A until the test lets it through.
    let first = in_flight(&a.url("/pay"), &up, "a", "k2", "evt").await;
    let dup = post_to(&c, &b2.url("/pay"), "a", "k2", "evt").await;
    assert_eq!((dup.status, dup.problem().as_str()), (409, "in-flight"));
    gate.open();
    assert_eq!(first.await.unwrap().status, 201);
    assert!(
        post_to(&c, &b2.url("/pay"), "a", "k2", "evt")
            .await
            .replayed()
    );
    assert_eq!(up.executions(), 2);
}

/// A NOTIFY serializes commits cluster-wide; a key nobody waits for is finished without one.
/// (Notifications arrive in commit order, so a sentinel sent afterwards, arriving first,
/// proves no announcement came before it.)
async fn a_key_nobody_waits_for_is_finished_without_an_announcement(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
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
            let got = rx.recv().await.expect("the notification stream ended");
            if !got.starts_with("probe:") {
                return got;
            }
        }
    })
    .await
    .expect("timed out after 10s waiting for a notification other than a probe");
    assert_eq!(first, "sentinel", "the completion was not announced");
}

/// Three gateway processes with `yaml`, started together.
async fn three_processes(yaml: &str) -> Vec<GatewayProcess> {
    let (a, b, c) = tokio::join!(
        GatewayProcess::start(yaml),
        GatewayProcess::start(yaml),
        GatewayProcess::start(yaml)
    );
    vec![a, b, c]
}

/// Each process takes 100 of the storm's requests at once on a pool of 8: their claims and
/// lookups queue for a connection (through PgBouncer, for its server connections too). The
/// default test bounds (500ms to acquire, 1s per statement) are tight enough that a machine
/// busy with the other tests can answer one of them 503, as it should; this test is about one
/// execution and one answer, so it gives the queue room.
async fn three_hundred_duplicates_across_three_gateway_processes_execute_once(b: Backend) {
    // A slow upstream so that duplicates meet one in flight; the assertions hold however long
    // it is.
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(500),
        ..Default::default()
    })
    .await;
    let (yaml, _db) = fresh_config(b, &up.url(), "wait_timeout: 20s").await;
    let yaml = yaml
        .patch("acquire_timeout: 500ms", "acquire_timeout: 5s")
        .patch("statement_timeout: 1s", "statement_timeout: 5s");
    let fleet = three_processes(&yaml).await;
    let urls: Vec<String> = fleet.iter().map(|g| g.url("/pay")).collect();
    let replies = storm(&urls, 300, "storm-300").await;
    assert_eq!(replies.len(), 300);
    assert_one_answer(&replies);
    assert_eq!(up.executions(), 1, "one execution across three processes");
}

/// The lab's "30 events, one account" (docs/lab.md) against the read-then-write ledger, the
/// 30 deliveries split across three processes: `serialize` (one forward per account at a
/// time, across instances) leaves 30 rows and no lost update.
async fn thirty_events_of_one_account_split_across_three_processes_lose_no_update(b: Backend) {
    use idemgate::lab::{self, AMOUNT, LabClient, Ledger};
    let ledger = Ledger::new(Duration::from_millis(10));
    let (addr, _task) = ledger.start().await.unwrap();
    let (direct_yaml, _db) = fresh_config(b, "http://unused", "").await;
    let store = store_block_of(&direct_yaml);
    let yaml = lab::gateway_config(
        "127.0.0.1:0",
        &store,
        &format!("http://{addr}"),
        "21s",
        "15s",
    );
    let fleet = three_processes(&yaml).await;
    let c = LabClient::default();
    let tasks: Vec<_> = (0..30)
        .map(|i| {
            let c = c.clone();
            let base = fleet[i % 3].url("");
            let body = lab::event(&format!("evt-{i}"), &format!("pay-{i}"), "acct-1", AMOUNT);
            tokio::spawn(async move { c.deliver(&base, &body).await })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        let a = t.await.unwrap().unwrap_or_else(|e| panic!("{e}"));
        assert!(a.is_2xx(), "{} {:?}", a.status, a.body);
        ok += 1;
    }
    assert_eq!(ok, 30);
    assert_eq!(
        ledger.account("acct-1"),
        (30, 30 * AMOUNT),
        "30 rows and every update kept"
    );
    assert_eq!(ledger.received(), 30, "each event executed once");
}

/// The `store:` block of a test config (its lines up to `upstreams:`).
fn store_block_of(yaml: &str) -> String {
    let start = yaml.find("store:\n").expect("a store block") + "store:\n".len();
    let end = yaml.find("upstreams:").expect("upstreams after the store");
    yaml[start..end].trim_end().to_string()
}

/// A webhook sender keeps delivering new events (each retried until it gets a 2xx, spread
/// over the fleet) while each of three processes in turn is stopped with SIGTERM and started
/// again. Nothing is lost (every event gets its 2xx), nothing runs twice (SIGTERM drains), and
/// every 2xx is the answer of the one execution of its own key.
async fn a_rolling_restart_under_load_loses_nothing_and_every_2xx_names_real_work(b: Backend) {
    // A slow upstream so that restarts meet requests in flight; the assertions hold however
    // long it is.
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(50),
        ..Default::default()
    })
    .await;
    let (yaml, _db) = fresh_config(b, &up.url(), "").await;
    let mut fleet = three_processes(&yaml).await;
    let urls: Vec<String> = fleet.iter().map(|g| g.url("/pay")).collect();

    let stop = Arc::new(AtomicBool::new(false));
    let senders: Vec<_> = (0..8)
        .map(|s| {
            let (urls, stop, c) = (urls.clone(), Arc::clone(&stop), client());
            tokio::spawn(async move {
                let (mut answered, mut retried) = (Vec::new(), 0usize);
                let mut next = s;
                // Bounded: stops when told, or after 2,000 events.
                for i in 0..2000 {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let key = format!("s{s}-evt-{i}");
                    // Retried like a webhook sender: on no answer or any non-2xx, again at
                    // the next instance, until a 2xx (at most 200 tries, 25 ms apart).
                    let mut got = None;
                    for _ in 0..200 {
                        next += 1;
                        let r = try_send(
                            &c,
                            Method::POST,
                            &urls[next % urls.len()],
                            &[("idempotency-key", &key), ("x-account-id", "fleet")],
                            "evt",
                        )
                        .await;
                        match r {
                            Ok(r) if (200..300).contains(&r.status) => {
                                got = Some(r);
                                break;
                            }
                            Ok(r) => assert!(
                                r.status == 503 || r.status == 409,
                                "only 'not now' answers while instances restart: {r:?}"
                            ),
                            Err(_) => {} // that instance is down: try the next one
                        }
                        retried += 1;
                        tokio::time::sleep(Duration::from_millis(25)).await;
                    }
                    answered.push((key.clone(), got.unwrap_or_else(|| panic!("{key} lost"))));
                }
                (answered, retried)
            })
        })
        .collect();

    let mut answered_before = up.executions();
    for gw in fleet.iter_mut() {
        // Some traffic reaches the fleet before each restart.
        wait_until("events are delivered", Duration::from_secs(20), || async {
            up.executions() >= answered_before + 40
        })
        .await;
        gw.terminate();
        assert!(
            gw.wait_exit(Duration::from_secs(15)).await,
            "clean exit:\n{}",
            gw.log_text()
        );
        gw.restart().await;
        answered_before = up.executions();
    }
    wait_until(
        "events are delivered after the last restart",
        Duration::from_secs(20),
        || async { up.executions() >= answered_before + 40 },
    )
    .await;
    stop.store(true, Ordering::SeqCst);

    let (mut answers, mut retried) = (Vec::new(), 0);
    for s in senders {
        let (a, r) = s.await.expect("sender");
        answers.extend(a);
        retried += r;
    }
    eprintln!(
        "rolling restart: {} events delivered, {retried} attempts refused or unanswered",
        answers.len()
    );
    // Executions per key, and the execution each one's answer names.
    let mut executed: HashMap<String, Vec<usize>> = HashMap::new();
    for seen in up.seen() {
        let key = seen.headers["idempotency-key"]
            .to_str()
            .unwrap()
            .to_string();
        executed.entry(key).or_default().push(seen.execution);
    }
    assert!(answers.len() >= 160, "only {} events", answers.len());
    for (key, reply) in &answers {
        let runs = executed
            .get(key)
            .unwrap_or_else(|| panic!("{key} got a 2xx but was never executed: {reply:?}"));
        assert_eq!(runs.len(), 1, "{key} executed {} times", runs.len());
        let named = reply.json()["execution"].as_u64().unwrap() as usize;
        assert_eq!(named, runs[0], "{key}'s 2xx is its own execution's answer");
    }
    assert_eq!(
        executed.len(),
        answers.len(),
        "every execution was an event that got its 2xx"
    );
}
