//! docs/contract.md §8.4: a database whose `synchronous_commit` is `off` can lose a commit
//! that a client was already answered from (guarantee 3). `serve` refuses it, and `/readyz` fails, unless
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
    yaml.patch(
        "statement_timeout: 1s }",
        "statement_timeout: 1s, allow_async_commit: true }",
    )
}

/// The same config with an admin listener on a port the process binds (it prints it).
fn with_admin(yaml: &str) -> String {
    format!("{yaml}admin: {{ listen: 127.0.0.1:0 }}\n")
}

/// Runs `idemgate serve` on `yaml` until it exits (failing the test after 30 s); returns its
/// exit code and everything it wrote.
async fn serve_until_exit(yaml: &str) -> (Option<i32>, String) {
    let dir = std::env::temp_dir().join(format!(
        "idemgate-async-commit-{}-{}",
        std::process::id(),
        {
            static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        }
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("gateway.yaml");
    std::fs::write(&config, yaml).unwrap();
    let out = dir.join("out.log");
    let mut child = Command::new(crate::support::bin::idemgate())
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
    let yaml = with_admin(&allowing(&config_yaml(&db, &up.url(), "")));
    let gw = GatewayProcess::start(&yaml).await;
    let admin = gw.admin.expect("an admin listener");
    let c = client();
    let headers = [("idempotency-key", "k"), ("x-account-id", "a")];
    let first = send(&c, Method::POST, &gw.url("/pay"), &headers, "x").await;
    assert_eq!(first.status, 201);
    let retry = send(&c, Method::POST, &gw.url("/pay"), &headers, "x").await;
    assert_eq!((retry.status, &retry.body), (201, &first.body));
    assert!(retry.replayed());
    assert_eq!(up.executions(), 1);
    let ready = send(&c, Method::GET, &format!("http://{admin}/readyz"), &[], "").await;
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
async fn the_gateway_refuses_async_commit_naming_the_field_and_readyz_passes_when_allowed() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    async_commit(&db).await;
    // The wiring `serve` uses refuses the database before serving anything.
    let config = idemgate::config::Config::from_yaml(&config_yaml(&db, &up.url(), "")).unwrap();
    match idemgate::app::App::build(config, local_listeners().await).await {
        Err(e) => assert!(
            e.to_string().contains("store.postgres.allow_async_commit"),
            "{e}"
        ),
        Ok(_) => panic!("a database with synchronous_commit off was accepted"),
    }
    let gw = TestGateway::start(&allowing(&config_yaml(&db, &up.url(), "")), &db).await;
    let r = send(
        &client(),
        Method::GET,
        &format!("http://{}/readyz", gw.admin),
        &[],
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    gw.shutdown().await;
}

/// A database switched to `synchronous_commit = off` under a running gateway: once its pooled
/// sessions are new ones, `/readyz` answers 503 naming the field.
#[tokio::test]
async fn readyz_fails_with_the_reason_when_the_database_turns_to_async_commit_under_a_gateway() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let gw = TestGateway::start(&config_yaml(&db, &up.url(), ""), &db).await;
    let c = client();
    let readyz = format!("http://{}/readyz", gw.admin);
    assert_eq!(send(&c, Method::GET, &readyz, &[], "").await.status, 200);
    async_commit(&db).await;
    // The pool's sessions started with the old setting; end them so new ones see the new.
    gw.sql()
        .await
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
              WHERE application_name = 'idemgate' AND datname = current_database()",
            &[],
        )
        .await
        .unwrap();
    wait_until(
        "/readyz fails naming allow_async_commit",
        Duration::from_secs(10),
        || async {
            let r = send(&c, Method::GET, &readyz, &[], "").await;
            r.status == 503
                && r.json()["reason"]
                    .as_str()
                    .is_some_and(|s| s.contains("store.postgres.allow_async_commit"))
        },
    )
    .await;
    gw.shutdown().await;
}
