//! What only the embedded store has: one instance per file, WAL mode, and a clear refusal.

use crate::support::*;

#[tokio::test]
async fn a_second_instance_on_the_same_file_is_refused_with_a_clear_message() {
    let file = TempDb::new();
    let cfg = idemgate::config::SqliteConfig {
        path: file.0.clone(),
        busy_timeout: std::time::Duration::from_secs(1),
    };
    let first = idemgate::store::sqlite::SqliteStore::open(&cfg).expect("the first instance opens");
    let err = match idemgate::store::sqlite::SqliteStore::open(&cfg) {
        Ok(_) => panic!("a second instance must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("another idemgate instance is using"), "{err}");
    assert!(err.contains("use the Postgres store for several"), "{err}");
    drop(first);
    // Once the first is gone, the file can be opened again.
    idemgate::store::sqlite::SqliteStore::open(&cfg).expect("reopened after the first closed");
}

#[tokio::test]
async fn the_second_instance_refusal_reaches_the_command_line() {
    let file = TempDb::new();
    let up = Upstream::start().await;
    let yaml = config_yaml_store(&sqlite_store_block(&file.0), &up.url(), "");
    let mut first = crate::support::process::GatewayProcess::start(&yaml).await;
    let config = first.config.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(crate::support::bin::idemgate())
            .args(["gc", "--config"])
            .arg(&config)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("another idemgate instance is using"),
        "{stderr}"
    );
    assert!(
        stderr.contains("admin API") && stderr.contains("/v1/keys"),
        "the refusal names the admin endpoint to use instead: {stderr}"
    );
    // SIGKILL releases the lock with the process: a restart takes the file over.
    first.kill();
    first.restart().await;
}

#[tokio::test]
async fn the_embedded_store_runs_in_wal_mode() {
    let file = TempDb::new();
    let up = Upstream::start().await;
    let yaml = config_yaml_store(&sqlite_store_block(&file.0), &up.url(), "");
    let gw = TestGateway::start(&yaml, &file.0.display().to_string()).await;
    assert_eq!(post(&client(), &gw, "a", "k", "x").await.status, 201);
    let wal = file.0.with_file_name("idemgate.db-wal");
    assert!(wal.exists(), "a WAL file next to the database");
}
