//! The real binary killed with SIGKILL mid-request, and stopped with SIGTERM: no retry ever
//! gets a 2xx for work that was not stored, nothing is lost, and shutdown drains within its
//! grace.

use std::time::Duration;

use http::Method;

use crate::support::process::GatewayProcess;
use crate::support::*;

/// Upstream timeout 1500ms, lease 3500ms (> timeout + the store's 1.5s record bound), waits
/// of 500ms: crash windows stay short.
fn yaml(db: &str, upstream: &str, idem: &str, grace: &str) -> String {
    config_yaml(
        db,
        upstream,
        &format!("lease: 3500ms\n      wait_timeout: 500ms\n      {idem}"),
    )
    .patch("timeout: 5s", "timeout: 1500ms")
    .patch("shutdown_grace: 5s", &format!("shutdown_grace: {grace}"))
}

#[tokio::test]
async fn a_gateway_killed_mid_request_forwards_again_after_the_lease_with_reforward() {
    let (up, gate) = Upstream::start_gated().await;
    let db = pg::fresh_database().await;
    let mut gw = GatewayProcess::start(&yaml(&db, &up.url(), "", "5s")).await;
    let c = client();
    // Killed while the upstream holds the request at its gate.
    let first = in_flight_try(&gw.url("/pay"), &up, "a", "evt-1", "evt").await;
    gw.kill();
    assert!(
        first.await.unwrap().is_err(),
        "the killed gateway's client got no answer"
    );
    gate.open();
    gw.restart().await;

    // Before the lease ends: in flight, never a 2xx for work that was not stored.
    let early = post_to(&c, &gw.url("/pay"), "a", "evt-1", "evt").await;
    assert_eq!((early.status, early.problem().as_str()), (409, "in-flight"));

    // After it: forwarded again, with the same key header, and completed. (Retried until
    // then, with a deadline: no assertion depends on how long the lease takes to end.)
    let url = gw.url("/pay");
    wait_until(
        "the retry is forwarded and answered",
        Duration::from_secs(15),
        || async {
            let r = post_to(&c, &url, "a", "evt-1", "evt").await;
            assert!(r.status == 201 || r.status == 409, "unexpected {r:?}");
            r.status == 201
        },
    )
    .await;
    assert_eq!(
        up.executions(),
        2,
        "executed at least once: here twice, the counted double"
    );
    let seen = up.seen();
    assert_eq!(
        seen[0].headers["idempotency-key"],
        seen[1].headers["idempotency-key"]
    );
    let replay = post_to(&c, &gw.url("/pay"), "a", "evt-1", "evt").await;
    assert!(replay.replayed());
    let rows = sql(&db)
        .await
        .query_one(
            "SELECT state, attempts FROM idemgate_keys WHERE key = 'evt-1'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.get::<_, String>(0), "completed");
    assert_eq!(rows.get::<_, i32>(1), 2, "the takeover is counted");
}

#[tokio::test]
async fn a_gateway_killed_mid_request_holds_the_key_until_an_operator_deletes_it() {
    let (up, gate) = Upstream::start_gated().await;
    let db = pg::fresh_database().await;
    let mut gw =
        GatewayProcess::start(&yaml(&db, &up.url(), "on_unknown_outcome: hold", "5s")).await;
    let c = client();
    // Killed while the upstream holds the request at its gate.
    let first = in_flight_try(&gw.url("/pay"), &up, "a", "evt-2", "evt").await;
    gw.kill();
    assert!(first.await.unwrap().is_err());
    gate.open();
    gw.restart().await;

    let url = gw.url("/pay");
    wait_until(
        "the lease ends and the key is held",
        Duration::from_secs(15),
        || async {
            let r = post_to(&c, &url, "a", "evt-2", "evt").await;
            assert!(r.status == 409 || r.status == 502, "unexpected {r:?}");
            r.status == 502 && r.problem() == "outcome-unknown"
        },
    )
    .await;
    assert_eq!(
        up.executions(),
        1,
        "a held key is never forwarded again by itself"
    );

    let config = gw.config.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(crate::support::bin::idemgate())
            .args(["keys", "delete", "--config"])
            .arg(&config)
            .args(["--scope", "a", "--key", "evt-2"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = post_to(&c, &gw.url("/pay"), "a", "evt-2", "evt").await;
    assert_eq!(r.status, 201);
    assert_eq!(up.executions(), 2);
}

#[tokio::test]
async fn sigterm_drains_in_flight_requests_stores_them_and_exits() {
    let (up, gate) = Upstream::start_gated().await;
    let db = pg::fresh_database().await;
    let gw = GatewayProcess::start(&yaml(&db, &up.url(), "", "10s")).await;
    let c = client();
    let keys = ["t1", "t2", "t3", "t4", "t5"];
    let mut tasks = Vec::new();
    for key in keys {
        let (c, url) = (c.clone(), gw.url("/pay"));
        tasks.push(tokio::spawn(async move {
            try_send(
                &c,
                Method::POST,
                &url,
                &[("idempotency-key", key), ("x-account-id", "a")],
                "e",
            )
            .await
        }));
    }
    gate.wait_arrived(5).await;
    terminate_and_drain(gw, &db, &up, &gate, tasks).await;
}

/// Sends SIGTERM while `tasks` are held at the upstream's `gate`: the listener stops
/// accepting while they are still in flight; then the upstream answers them, every one is
/// answered 201 and stored, and the process exits cleanly.
async fn terminate_and_drain(
    mut gw: GatewayProcess,
    db: &str,
    up: &Upstream,
    gate: &Gate,
    tasks: Vec<tokio::task::JoinHandle<Result<Reply, String>>>,
) {
    gw.terminate();
    let addr = gw.addr;
    wait_until(
        "new connections are refused",
        Duration::from_secs(5),
        || async { tokio::net::TcpStream::connect(addr).await.is_err() },
    )
    .await;
    assert_eq!(up.answered(), 0, "refused while every request is in flight");
    gate.open();
    let n = tasks.len();
    for t in tasks {
        let r = t.await.unwrap().expect("in-flight requests are answered");
        assert_eq!(r.status, 201);
    }
    assert!(
        gw.wait_exit(Duration::from_secs(10)).await,
        "clean exit:\n{}",
        gw.log_text()
    );
    let completed: i64 = sql(db)
        .await
        .query_one(
            "SELECT count(*) FROM idemgate_keys WHERE state = 'completed'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(completed, n as i64, "every drained request was stored");
}

#[tokio::test]
async fn a_request_still_in_flight_when_the_grace_ends_is_left_to_its_lease() {
    // The upstream holds the request at its gate until the process has exited.
    let (up, gate) = Upstream::start_gated().await;
    let db = pg::fresh_database().await;
    let mut gw = GatewayProcess::start(&yaml(&db, &up.url(), "", "300ms")).await;
    let first = in_flight_try(&gw.url("/pay"), &up, "a", "late", "evt").await;
    gw.terminate();
    assert!(gw.wait_exit(Duration::from_secs(10)).await);
    assert_eq!(
        up.answered(),
        0,
        "the process exited before the upstream answered"
    );
    gate.open();
    let r = first.await.unwrap();
    assert!(r.is_err(), "no answer, certainly no 2xx: {r:?}");
    let state = key_state(&db, "late").await;
    assert_eq!(state, "in_flight", "never marked done");
}

/// The names of the process's threads (`/proc/<pid>/task/*/comm`).
fn thread_names(gw: &GatewayProcess) -> Vec<String> {
    let pid = gw.pid().expect("running");
    let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn sigterm_drains_the_requests_of_every_serving_thread() {
    // `server.runtime: thread_per_core` (the default) with four threads: three of them
    // started beside the main one, each accepting from the same socket. Twelve requests on
    // twelve connections are spread over them by the kernel; a drain must wait for all.
    let (up, gate) = Upstream::start_gated().await;
    let db = pg::fresh_database().await;
    let config = yaml(&db, &up.url(), "", "10s").patch("server: {", "server: { worker_threads: 4,");
    let gw = GatewayProcess::start(&config).await;
    let serving = || {
        thread_names(&gw)
            .into_iter()
            .filter(|n| n.starts_with("idemgate-srv-"))
            .collect::<Vec<_>>()
    };
    // A thread names itself once it runs: the gateway can answer on one thread a moment
    // before another has.
    wait_until(
        "three serving threads beside the main one",
        Duration::from_secs(10),
        || async { serving().len() == 3 },
    )
    .await;
    assert_eq!(
        serving(),
        ["idemgate-srv-1", "idemgate-srv-2", "idemgate-srv-3"],
        "three serving threads beside the main one"
    );
    // A client of its own each (`in_flight_try`): twelve connections, not one pooled one.
    let mut tasks = Vec::new();
    for i in 0..12 {
        tasks.push(in_flight_try(&gw.url("/pay"), &up, "a", &format!("d{i}"), "e").await);
    }
    gate.wait_arrived(12).await;
    terminate_and_drain(gw, &db, &up, &gate, tasks).await;
    assert_eq!(up.executions(), 12);
}

#[tokio::test]
async fn the_work_stealing_runtime_serves_and_drains_too() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let config = yaml(&db, &up.url(), "", "10s").patch(
        "server: {",
        "server: { runtime: work_stealing, worker_threads: 3,",
    );
    let mut gw = GatewayProcess::start(&config).await;
    let names = thread_names(&gw);
    assert!(
        !names.iter().any(|n| n.starts_with("idemgate-srv-")),
        "no serving threads of their own: {names:?}"
    );
    assert!(
        names
            .iter()
            .filter(|n| n.starts_with("tokio-rt-worker"))
            .count()
            >= 3,
        "the runtime's workers: {names:?}"
    );
    let c = client();
    let first = try_send(
        &c,
        Method::POST,
        &gw.url("/pay"),
        &[("idempotency-key", "w1"), ("x-account-id", "a")],
        "e",
    )
    .await
    .unwrap();
    assert_eq!(first.status, 201);
    let retry = try_send(
        &c,
        Method::POST,
        &gw.url("/pay"),
        &[("idempotency-key", "w1"), ("x-account-id", "a")],
        "e",
    )
    .await
    .unwrap();
    assert_eq!(retry.status, 201);
    assert_eq!(up.executions(), 1, "the retry was replayed");
    // Held at the upstream's gate until the drain has begun (new connections refused).
    let gate = Gate::new();
    up.set(Behavior {
        gate: Some(gate.clone()),
        ..Default::default()
    });
    let late = in_flight_try(&gw.url("/pay"), &up, "a", "w2", "e").await;
    gw.terminate();
    let addr = gw.addr;
    wait_until(
        "new connections are refused",
        Duration::from_secs(5),
        || async { tokio::net::TcpStream::connect(addr).await.is_err() },
    )
    .await;
    gate.open();
    let r = late.await.unwrap().expect("answered during the drain");
    assert_eq!(r.status, 201);
    assert!(
        gw.wait_exit(Duration::from_secs(10)).await,
        "clean exit:\n{}",
        gw.log_text()
    );
}

/// Bytes waiting in the receive queues of `pid`'s TCP sockets (`/proc/net/tcp`): a stopped
/// process's unread input.
fn unread_tcp_bytes(pid: i32) -> u64 {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
                .filter_map(|target| {
                    let t = target.to_string_lossy().into_owned();
                    Some(t.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
                })
                .collect()
        })
        .unwrap_or_default();
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|text| text.lines().skip(1).map(str::to_string).collect::<Vec<_>>())
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let inode = cols.get(9)?;
            let rx = cols.get(4)?.split(':').nth(1)?;
            inodes
                .iter()
                .any(|i| i == inode)
                .then(|| u64::from_str_radix(rx, 16).ok())?
        })
        .sum()
}

/// A gateway stopped (SIGSTOP) while its claim waits in the database, and continued after its
/// lease has passed, does not forward: by its own clock, the lease could end before the
/// upstream answered, and another attempt may own the key by then. It releases the key and
/// answers 409; the retry forwards, once.
#[tokio::test]
async fn a_gateway_paused_past_its_lease_while_claiming_does_not_forward_when_it_resumes() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    // One pooled session (to stop it), behind `pooler: transaction` (on the server itself):
    // a statement answered just after its client-side bound is still read, so the resumed
    // gateway reads its claim rather than a timeout.
    let store = format!(
        "  postgres: {{ url: \"{db}\", pooler: transaction, pool_size: 1, acquire_timeout: 500ms, connect_timeout: 1s, statement_timeout: 1s }}"
    );
    let yaml =
        config_yaml_store(&store, &up.url(), "lease: 3s").patch("timeout: 5s", "timeout: 1s");
    let gw = GatewayProcess::start(&yaml).await;
    let c = client();
    let url = gw.url("/pay");
    let post = |key: &'static str| {
        let (c, url) = (c.clone(), url.clone());
        async move {
            send(
                &c,
                Method::POST,
                &url,
                &[
                    ("idempotency-key", key),
                    ("x-account-id", "acct"),
                    ("content-type", "application/json"),
                ],
                "{}",
            )
            .await
        }
    };
    assert_eq!(post("warm").await.status, 201, "the pool's session is open");

    let side = sql(&db).await;
    let pids = pg::session_pids(&side, "idemgate").await;
    assert_eq!(pids.len(), 1, "one pooled session");
    let session = pg::Stopped::stop(&pids);
    let first = tokio::spawn(post("paused"));
    wait_until(
        "the claim's statement waits in the stopped session",
        Duration::from_secs(10),
        || async { unread_tcp_bytes(pids[0]) > 0 },
    )
    .await;
    let gateway = pg::Stopped::stop(&[gw.pid().expect("running") as i32]);
    drop(session);
    // Past the lease by any clock: it began before the claim was sent.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    drop(gateway);

    let first = first.await.unwrap();
    assert_eq!(
        first.status,
        409,
        "not forwarded: {}",
        String::from_utf8_lossy(&first.body)
    );
    assert_eq!(up.executions(), 1, "only the warm-up was forwarded");
    // The log is written off the serving threads: the line may follow the answer.
    wait_until(
        "the gateway logs why it did not forward",
        Duration::from_secs(10),
        || async {
            gw.log_text()
                .contains("not forwarded: too little of the lease was left")
        },
    )
    .await;
    // The key was released: the retry forwards, once.
    assert_eq!(post("paused").await.status, 201);
    assert_eq!(post("paused").await.status, 201);
    assert_eq!(up.executions(), 2);
}
