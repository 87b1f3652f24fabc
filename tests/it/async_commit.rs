//! SPEC 8.4: a database whose `synchronous_commit` is `off` can lose a commit that a client
//! was already answered from (guarantee 3). `serve` refuses it, and `/readyz` fails, unless
//! `store.postgres.allow_async_commit: true`.

use std::process::{Command, Stdio};
use std::time::Duration;

use http::Method;

use crate::support::process::GatewayProcess;
use crate::support::*;

/// Sets `synchronous_commit = off` for new sessions of the test's own database.
async fn async_commit(db: &str) {
    sql(db)
        .await
        .batch_execute(
            "DO $$ BEGIN
               EXECUTE format('ALTER DATABASE %I SET synchronous_commit = off', current_database());
             END $$",
        )
        .await
        .expect("ALTER DATABASE");
    let seen: String = sql(db)
        .await
        .query_one("SHOW synchronous_commit", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        seen, "off",
        "a new session of the database sees the setting"
    );
}

/// The default test config with `allow_async_commit: true` in its Postgres block.
fn allowing(yaml: &str) -> String {
    yaml.replace(
        "statement_timeout: 1s }",
        "statement_timeout: 1s, allow_async_commit: true }",
    )
}

/// The same config with an admin listener on a free port; returns it and that port.
fn with_admin(yaml: &str) -> (String, u16) {
    let port = pg::free_port();
    (
        format!("{yaml}admin: {{ listen: 127.0.0.1:{port} }}\n"),
        port,
    )
}

/// Runs `idemgate serve` on `yaml` until it exits (failing the test after 30 s); returns its
/// exit code and everything it wrote.
async fn serve_until_exit(yaml: &str) -> (Option<i32>, String) {
    let dir = std::env::temp_dir().join(format!(
        "idemgate-async-commit-{}-{}",
        std::process::id(),
        pg::free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("gateway.yaml");
    std::fs::write(&config, yaml).unwrap();
    let out = dir.join("out.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["serve", "--config"])
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(dir.join("err.log")).unwrap())
        .spawn()
        .expect("starting idemgate");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if tokio::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("idemgate serve is still running after 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let text = std::fs::read_to_string(&out).unwrap_or_default()
        + &std::fs::read_to_string(dir.join("err.log")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    (status.code(), text)
}

#[tokio::test]
async fn serve_refuses_a_database_with_async_commit_and_names_the_setting() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    async_commit(&db).await;
    let (code, output) = serve_until_exit(&config_yaml(&db, &up.url(), "")).await;
    assert_eq!(code, Some(1), "{output}");
    assert!(
        output.contains("synchronous_commit = off")
            && output.contains("store.postgres.allow_async_commit: true"),
        "the refusal names the setting and the field: {output}"
    );
    let migrated: bool = sql(&db)
        .await
        .query_one("SELECT to_regclass('idemgate_keys') IS NOT NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!migrated, "a refused database is left untouched");
    assert_eq!(up.executions(), 0);
}

#[tokio::test]
async fn serve_accepts_a_database_with_async_commit_when_the_config_allows_it() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    async_commit(&db).await;
    let (yaml, admin) = with_admin(&allowing(&config_yaml(&db, &up.url(), "")));
    let gw = GatewayProcess::start(&yaml).await;
    let c = client();
    let headers = [("idempotency-key", "k"), ("x-account-id", "a")];
    let first = send(&c, Method::POST, &gw.url("/pay"), &headers, "x").await;
    assert_eq!(first.status, 201);
    let retry = send(&c, Method::POST, &gw.url("/pay"), &headers, "x").await;
    assert_eq!((retry.status, &retry.body), (201, &first.body));
    assert!(retry.replayed());
    assert_eq!(up.executions(), 1);
    let ready = send(
        &c,
        Method::GET,
        &format!("http://127.0.0.1:{admin}/readyz"),
        &[],
        "",
    )
    .await;
    assert_eq!(ready.status, 200, "{:?}", ready.body);
}

#[tokio::test]
async fn a_database_found_with_async_commit_after_an_outage_stops_serve() {
    let cluster = pg::Cluster::start_async().await;
    let db = cluster.new_database().await;
    async_commit(&db).await;
    let cluster = cluster.crashed().await;
    let up = Upstream::start().await;
    // The store is down at start: serve serves (503s) and keeps trying in the background.
    let mut gw = GatewayProcess::start(&config_yaml(&db, &up.url(), "")).await;
    let _cluster = cluster.restarted().await;
    // Once the database answers, the check finds async commit: serve stops, not cleanly.
    assert!(!gw.wait_exit(Duration::from_secs(30)).await);
    let log = gw.log_text();
    assert!(
        log.contains("store.postgres.allow_async_commit: true"),
        "the reason is logged: {log}"
    );
    assert_eq!(up.executions(), 0);
}

#[tokio::test]
async fn readyz_fails_on_async_commit_with_the_reason_unless_allowed() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    async_commit(&db).await;
    let c = client();
    for (yaml, status) in [
        (config_yaml(&db, &up.url(), ""), 503),
        (allowing(&config_yaml(&db, &up.url(), "")), 200),
    ] {
        let gw = TestGateway::start(&yaml, &db).await;
        let r = send(
            &c,
            Method::GET,
            &format!("http://{}/readyz", gw.admin),
            &[],
            "",
        )
        .await;
        assert_eq!(r.status, status, "{:?}", r.body);
        if status == 503 {
            let reason = r.json()["reason"].as_str().unwrap().to_string();
            assert!(
                reason.contains("store.postgres.allow_async_commit"),
                "{reason}"
            );
        }
        gw.shutdown().await;
    }
}
