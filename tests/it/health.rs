//! `idemgate health`, the image's `HEALTHCHECK` (the image has no curl): the real binary
//! against a real gateway process, a gateway whose store is down, a dead port and a server
//! that never answers. Exit 0 only on a 200 from `/readyz`; 1 with one line of reason
//! otherwise.

use std::process::Output;
use std::time::{Duration, Instant};

use crate::support::process::GatewayProcess;
use crate::support::*;

async fn health(args: &[&str]) -> Output {
    tokio::process::Command::new(crate::support::bin::idemgate())
        .arg("health")
        .args(args)
        .output()
        .await
        .unwrap()
}

/// Exit 1, and the reason on one line of stderr.
fn assert_unhealthy(out: &Output, reason: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(stderr.contains(reason), "{reason:?} in: {stderr}");
}

/// A gateway process whose admin listener is on `admin` (the test config's listeners are
/// otherwise on free ports).
async fn gateway_with_admin(db: &str, upstream: &Upstream, admin: &str) -> GatewayProcess {
    let yaml = format!(
        "{}admin: {{ listen: \"{admin}\", token: a-long-admin-token-1234 }}\n",
        config_yaml(db, &upstream.url(), "")
    );
    let gw = GatewayProcess::start(&yaml).await;
    assert!(gw.admin.is_some(), "the process printed its admin address");
    gw
}

#[tokio::test]
async fn health_exits_0_when_readyz_answers_200_by_config_or_by_url() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    // An unspecified address, as in a container: the probe asks the loopback.
    let gw = gateway_with_admin(&db, &up, "0.0.0.0:0").await;
    let port = gw.admin.unwrap().port();
    let config = gw.config.to_str().unwrap().to_string();

    let out = health(&["--config", &config]).await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("ready: http://127.0.0.1:{port}/readyz answered 200")
    );

    let url = format!("http://127.0.0.1:{port}/readyz");
    let out = health(&["--url", &url, "--timeout", "5s"]).await;
    assert_eq!(out.status.code(), Some(0));

    // /healthz is not /readyz, but a 200 is a 200; a 404 is not.
    let out = health(&["--url", &format!("http://127.0.0.1:{port}/nope")]).await;
    assert_unhealthy(&out, "answered 404 Not Found");
}

#[tokio::test]
async fn health_exits_1_with_the_reason_when_the_store_is_down() {
    let up = Upstream::start().await;
    // Nothing listens there: serve starts anyway, /readyz answers 503.
    let (_refusing, port) = refused_port();
    let db = format!("postgres://idemgate@127.0.0.1:{port}/idemgate");
    let gw = gateway_with_admin(&db, &up, "127.0.0.1:0").await;
    let out = health(&["--config", gw.config.to_str().unwrap()]).await;
    assert_unhealthy(&out, "answered 503 Service Unavailable: ");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("postgres://"),
        "the database URL (a secret) is not printed"
    );
}

#[tokio::test]
async fn health_exits_1_on_a_dead_port_a_silent_server_and_a_config_without_admin() {
    let (_refusing, dead) = refused_port();
    let out = health(&["--url", &format!("http://127.0.0.1:{dead}/readyz")]).await;
    assert_unhealthy(&out, "cannot connect");

    // Accepts, reads, never answers: the timeout bounds the probe, connecting included.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            held.push(conn);
        }
    });
    let started = Instant::now();
    let out = health(&[
        "--url",
        &format!("http://{addr}/readyz"),
        "--timeout",
        "300ms",
    ])
    .await;
    assert_unhealthy(&out, "within 300ms");
    assert!(started.elapsed() < Duration::from_secs(5));
    hold.abort();

    let dir = std::env::temp_dir().join(format!("idemgate-health-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let no_admin = dir.join("no-admin.yaml");
    std::fs::write(
        &no_admin,
        config_yaml("postgres://u@localhost/db", "http://127.0.0.1:1", ""),
    )
    .unwrap();
    let out = health(&["--config", no_admin.to_str().unwrap()]).await;
    assert_unhealthy(&out, "has no admin.listen");
    // A config that does not load is a reason too: exit 1, not 64 (HEALTHCHECK knows 0 and 1).
    let out = health(&["--config", dir.join("missing.yaml").to_str().unwrap()]).await;
    assert_unhealthy(&out, "missing.yaml");
    let out = health(&["--url", "https://127.0.0.1:1/readyz"]).await;
    assert_unhealthy(&out, "only http://");
    let _ = std::fs::remove_dir_all(&dir);
}
