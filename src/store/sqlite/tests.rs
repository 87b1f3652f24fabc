use super::*;
use crate::problem::GatewayError;

/// A fresh store file in its own directory, removed at the end.
fn fresh(name: &str) -> (SqliteStore, PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "idemgate-sqlite-unit-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let store = SqliteStore::open(&SqliteConfig {
        path: dir.join("idemgate.db"),
        busy_timeout: Duration::from_secs(1),
    })
    .expect("open");
    (store, dir)
}

#[tokio::test]
async fn a_job_that_panics_is_500_internal_and_the_store_thread_keeps_serving() {
    let (store, dir) = fresh("panic");
    store.migrate().await.expect("migrate");
    let err = store
        .call("test", |tx| -> rusqlite::Result<()> {
            tx.execute_batch("CREATE TABLE half_done (x INTEGER)")?;
            panic!("a bug in a store job");
        })
        .await
        .expect_err("a panic is an error");
    assert!(
        matches!(&err, StoreError::Internal(why) if why.contains("a bug in a store job")),
        "{err:?}"
    );
    assert!(!err.is_unavailable(), "never passed through as an outage");
    let problem = GatewayError::from(err).problem();
    assert_eq!((problem.status.as_u16(), problem.slug), (500, "internal"));
    // The thread serves the next call, its transaction rolled back.
    store.ready().await.expect("the store still answers");
    let tables: i64 = store
        .call("test", |tx| {
            tx.query_row(
                "SELECT count(*) FROM sqlite_master WHERE name = 'half_done'",
                [],
                |r| r.get(0),
            )
        })
        .await
        .expect("the store still answers");
    assert_eq!(tables, 0, "the panicked job's write was rolled back");
    drop(store);
    let _ = std::fs::remove_dir_all(dir);
}
