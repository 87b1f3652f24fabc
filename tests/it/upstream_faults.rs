//! A misbehaving upstream, through the fault proxy: each fault ends in the status and key
//! state docs/contract.md §2 names, and a retry after it does the right thing.

use std::time::Duration;

use crate::support::certs::TestPki;
use crate::support::fault_proxy::{Fault, FaultProxy};
use crate::support::*;

/// Upstream behind a fault proxy, gateway in front; upstream timeout 1s, lease 3s.
async fn setup(fault: Fault, idem: &str) -> (Upstream, FaultProxy, TestGateway) {
    let up = Upstream::start().await;
    let proxy = FaultProxy::start(up.addr, fault).await;
    let db = pg::fresh_database().await;
    let idem = format!("lease: 3s\n      {idem}");
    let yaml = config_yaml(&db, &proxy.url(), &idem).patch("timeout: 5s", "timeout: 1s");
    let gw = TestGateway::start(&yaml, &db).await;
    (up, proxy, gw)
}

#[tokio::test]
async fn connection_refused_is_502_and_the_key_is_released() {
    let (up, proxy, gw) = setup(Fault::Refuse, "").await;
    let c = client();
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(
        (r.status, r.problem().as_str()),
        (502, "upstream-unavailable")
    );
    assert_eq!(row_state(&gw, "a", "k").await, None);
    assert_eq!(up.executions(), 0);
    proxy.set(Fault::Pass).await;
    assert_eq!(post(&c, &gw, "a", "k", "x").await.status, 201);
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn a_reset_after_the_request_was_sent_is_an_unknown_outcome() {
    // reforward: released, so a retry forwards.
    let (up, proxy, gw) = setup(Fault::ResetBeforeResponse, "").await;
    let c = client();
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(
        (r.status, r.problem().as_str()),
        (502, "upstream-unavailable")
    );
    assert_eq!(
        row_state(&gw, "a", "k").await,
        None,
        "reforward releases the key"
    );
    proxy.set(Fault::Pass).await;
    assert_eq!(post(&c, &gw, "a", "k", "x").await.status, 201);
    assert_eq!(up.executions(), 1);

    // hold: the key is held, retries get 502 outcome-unknown and nothing is forwarded.
    let (up, _proxy, gw) = setup(Fault::ResetBeforeResponse, "on_unknown_outcome: hold").await;
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(r.status, 502);
    assert_eq!(row_state(&gw, "a", "k").await.as_deref(), Some("unknown"));
    let retry = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(
        (retry.status, retry.problem().as_str()),
        (502, "outcome-unknown")
    );
    assert_eq!(up.executions(), 0);
}

#[tokio::test]
async fn a_connection_cut_mid_body_is_502_and_never_stored_truncated() {
    let (up, proxy, gw) = setup(Fault::CutMidBody { after: 150 }, "").await;
    let c = client();
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(
        (r.status, r.problem().as_str()),
        (502, "upstream-unavailable")
    );
    assert_eq!(up.executions(), 1, "the upstream did the work");
    assert_eq!(
        row_state(&gw, "a", "k").await,
        None,
        "reforward releases the key"
    );
    proxy.set(Fault::Pass).await;
    let retry = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed(), "nothing truncated was stored to replay");
    assert_eq!(
        retry.json()["execution"],
        2,
        "forwarded again: a counted double"
    );
}

#[tokio::test]
async fn a_blackholed_upstream_is_504_after_its_timeout() {
    let (up, proxy, gw) = setup(Fault::Blackhole, "").await;
    let c = client();
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!((r.status, r.problem().as_str()), (504, "upstream-timeout"));
    assert_eq!(row_state(&gw, "a", "k").await, None);
    proxy.set(Fault::Pass).await;
    assert_eq!(post(&c, &gw, "a", "k", "x").await.status, 201);
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn a_body_slower_than_the_timeout_is_504() {
    let (up, proxy, gw) = setup(
        Fault::SlowBody {
            chunk: 10,
            pause: Duration::from_millis(100),
        },
        "",
    )
    .await;
    let c = client();
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!((r.status, r.problem().as_str()), (504, "upstream-timeout"));
    assert_eq!(up.executions(), 1);
    assert_eq!(row_state(&gw, "a", "k").await, None);
    proxy.set(Fault::Pass).await;
    let retry = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(retry.status, 201);
    assert!(post(&c, &gw, "a", "k", "x").await.replayed());
    assert_eq!(up.executions(), 2);
}

/// Nothing was sent when the upstream's name does not resolve or its port refuses: the
/// key is released even on a route that holds unknown outcomes, and a retry is forwarded.
#[tokio::test]
async fn dns_and_connect_failures_release_the_key_even_under_hold() {
    for unreachable in ["http://no-such-host.invalid:9000", "http://127.0.0.1:1"] {
        let up = Upstream::start().await;
        let db = pg::fresh_database().await;
        let yaml = config_yaml(&db, unreachable, "on_unknown_outcome: hold");
        let gw = TestGateway::start(&yaml, &db).await;
        let c = client();
        for attempt in 0..2 {
            let r = post(&c, &gw, "a", "k", "x").await;
            assert_eq!(
                (r.status, r.problem().as_str()),
                (502, "upstream-unavailable"),
                "{unreachable}, attempt {attempt}: not outcome-unknown"
            );
            assert_eq!(row_state(&gw, "a", "k").await, None, "released");
        }
        drop(up);
    }
}

/// Two attempts of one key on a `hold` route whose upstream never comes up: each a 502 connect
/// failure before the exchange's `timeout` (5s) could fire, never a timeout or a held
/// outcome, and the key released after each.
async fn connect_failures_release_the_key(gw: &TestGateway, c: &TestClient) {
    for attempt in 0..2 {
        let started = std::time::Instant::now();
        let r = post(c, gw, "a", "k", "x").await;
        let elapsed = started.elapsed();
        assert_eq!(
            (r.status, r.problem().as_str()),
            (502, "upstream-unavailable"),
            "attempt {attempt}: a connect failure, not a timeout or a held outcome"
        );
        // A hang check, not a speed claim: the exchange's own timeout (5s) never fired.
        assert!(
            elapsed < Duration::from_secs(5),
            "answered after {elapsed:?}"
        );
        assert_eq!(row_state(gw, "a", "k").await, None, "released");
    }
}

/// An upstream whose TCP connect hangs: a listener with backlog 0 whose accept queue is
/// already full, so the kernel drops every further SYN. The forward gives up after the
/// upstream's `connect_timeout` (200ms), well before its `timeout` (5s, which would be 504):
/// 502, and the key is released even on a `hold` route, since nothing was sent. Once the
/// upstream accepts again, a retry is forwarded.
#[tokio::test]
async fn a_connect_that_hangs_is_502_after_connect_timeout_and_the_key_is_released() {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    // Fill the accept queue: connect until a connect does not complete. That one shows the
    // trick works on this kernel (SYNs to a full queue are dropped, not refused); it is
    // dropped, and the ones that completed are held open, keeping the queue full.
    let mut fillers = Vec::new();
    loop {
        let connect = tokio::net::TcpStream::connect(addr);
        match tokio::time::timeout(Duration::from_millis(500), connect).await {
            Ok(Ok(stream)) => fillers.push(stream),
            Ok(Err(e)) => panic!("a connect to a full accept queue failed instead of hanging: {e}"),
            Err(_) => break,
        }
        assert!(
            fillers.len() < 8,
            "connects to a listener with backlog 0 never hang on this kernel"
        );
    }
    assert!(!fillers.is_empty(), "the queue took a connection first");

    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &format!("http://{addr}"), "on_unknown_outcome: hold");
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    connect_failures_release_the_key(&gw, &c).await;

    // The upstream accepts again: take the fillers off the queue, then serve on it.
    for _ in 0..fillers.len() {
        tokio::time::timeout(Duration::from_secs(5), listener.accept())
            .await
            .expect("the queued fillers are accepted at once")
            .unwrap();
    }
    let up = Upstream::serve(listener, Behavior::default());
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(r.status, 201);
    assert!(!r.replayed());
    assert!(post(&c, &gw, "a", "k", "x").await.replayed());
    assert_eq!(
        up.executions(),
        1,
        "forwarded once, after the upstream came back"
    );
    drop(fillers);
}

/// An https upstream that accepts the connection and never answers the TLS handshake: the
/// request was never sent, so the forward gives up at `connect_timeout` (200ms), not at the
/// exchange's `timeout` (5s, 504 and an unknown outcome): 502, and the key is released even
/// on a `hold` route. The connections were accepted, so it was the handshake that hung.
#[tokio::test]
async fn a_tls_handshake_that_hangs_is_502_after_connect_timeout_and_the_key_is_released() {
    let pki = TestPki::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = std::sync::Arc::clone(&accepted);
    // Accepts, reads nothing, writes nothing; keeps every socket open.
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(socket);
        }
    });
    let db = pg::fresh_database().await;
    let yaml = config_yaml(
        &db,
        &format!("https://localhost:{port}"),
        "on_unknown_outcome: hold",
    )
    .patch(
        "timeout: 5s }",
        &format!("timeout: 5s, tls: {{ ca: \"{}\" }} }}", pki.ca.display()),
    );
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    connect_failures_release_the_key(&gw, &c).await;
    assert!(
        accepted.load(std::sync::atomic::Ordering::SeqCst) >= 2,
        "each attempt's TCP connection was accepted: the handshake is what hung"
    );
    holder.abort();
}

#[test]
fn a_connect_timeout_not_shorter_than_the_timeout_is_a_config_error() {
    let yaml = config_yaml("postgres://u@localhost/db", "http://127.0.0.1:9", "").patch(
        "connect_timeout: 200ms, timeout: 5s",
        "connect_timeout: 5s, timeout: 5s",
    );
    let err = idemgate::config::Config::from_yaml(&yaml)
        .unwrap_err()
        .to_string();
    assert!(err.contains("upstreams.app.connect_timeout"), "{err}");
}

#[test]
fn a_shutdown_grace_shorter_than_a_keyed_forward_is_warned_about_at_load() {
    let dir = std::env::temp_dir().join(format!("idemgate-grace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("short-grace.yaml");
    let yaml = config_yaml("postgres://u@localhost/db", "http://127.0.0.1:9", "")
        .patch("shutdown_grace: 5s", "shutdown_grace: 2s");
    std::fs::write(&file, yaml).unwrap();
    let out = std::process::Command::new(crate::support::bin::idemgate())
        .args(["check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "valid, but...");
    assert!(
        stderr
            .contains("warning: server.shutdown_grace (2s) is shorter than upstreams.app.timeout"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
