//! Operator tools: garbage collection of expired rows, and `idemgate keys show|delete`.

use std::process::Command;
use std::time::Duration;

use crate::support::*;

/// Inserts `n` rows under `scope`, expired (`past`) or live.
async fn insert_rows(db: &tokio_postgres::Client, scope: &str, n: i32, past: bool) {
    let expiry = if past {
        "now() - interval '1 hour'"
    } else {
        "now() + interval '1 hour'"
    };
    db.execute(
        &format!(
            "INSERT INTO idemgate_keys (scope, key, route, fingerprint, state, status, headers, body, expires_at, gc_after)
             SELECT $1, 'k' || g, 'r', '\\x00', 'completed', 201, '', 'b', {expiry}, {expiry}
               FROM generate_series(1, $2) g"
        ),
        &[&scope, &n],
    )
    .await
    .unwrap();
}

async fn count(db: &tokio_postgres::Client, scope: &str) -> i64 {
    db.query_one(
        "SELECT count(*) FROM idemgate_keys WHERE scope = $1",
        &[&scope],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test]
async fn gc_deletes_expired_rows_in_batches_and_keeps_live_ones() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let db = gw.sql().await;
    insert_rows(&db, "old", 2500, true).await;
    insert_rows(&db, "live", 10, false).await;
    let run = gw.store.gc(1000).await.unwrap();
    assert_eq!(
        run,
        idemgate::store::GcRun {
            deleted: 2500,
            ran: true
        }
    );
    assert_eq!(count(&db, "old").await, 0);
    assert_eq!(count(&db, "live").await, 10);
}

#[tokio::test]
async fn gc_runs_on_one_instance_at_a_time() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let db = gw.sql().await;
    insert_rows(&db, "old", 5, true).await;
    // Another instance is collecting: it holds the collection lock in an open transaction.
    let mut other = sql(&gw.db).await;
    let tx = other.transaction().await.unwrap();
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&0x1de0_6a7e_0002_i64])
        .await
        .unwrap();
    let run = gw.store.gc(1000).await.unwrap();
    assert_eq!(
        run,
        idemgate::store::GcRun {
            deleted: 0,
            ran: false
        }
    );
    assert_eq!(count(&db, "old").await, 5);
    tx.rollback().await.unwrap();
    assert_eq!(gw.store.gc(1000).await.unwrap().deleted, 5);
}

fn write_config(gw: &TestGateway, upstream: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!(
        "idemgate-ops-{}-{}.yaml",
        std::process::id(),
        gw.addr.port()
    ));
    std::fs::write(&path, config_yaml(&gw.db, upstream, "")).unwrap();
    path
}

fn idemgate(args: &[&str], config: &std::path::Path) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemgate"));
    cmd.args(&args[..args.len().min(2)])
        .arg("--config")
        .arg(config);
    cmd.args(&args[args.len().min(2)..]);
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn keys_show_and_delete_from_the_command_line() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let c = client();
    assert_eq!(post(&c, &gw, "acct 1", "k-1", "x").await.status, 201);
    let cfg = write_config(&gw, &up.url());
    let cfg2 = cfg.clone();
    let shown = tokio::task::spawn_blocking(move || {
        idemgate(
            &["keys", "show", "--scope", "acct 1", "--key", "k-1"],
            &cfg2,
        )
    })
    .await
    .unwrap();
    assert_eq!(shown.0, 0, "{shown:?}");
    let v: serde_json::Value = serde_json::from_str(&shown.1).unwrap();
    assert_eq!(v["state"], "completed");
    assert_eq!(v["status"], 201);
    assert_eq!(v["route"], "payments");

    let cfg2 = cfg.clone();
    let deleted = tokio::task::spawn_blocking(move || {
        idemgate(
            &["keys", "delete", "--scope", "acct 1", "--key", "k-1"],
            &cfg2,
        )
    })
    .await
    .unwrap();
    assert_eq!(deleted.0, 0, "{deleted:?}");
    assert_eq!(row_state(&gw, "acct 1", "k-1").await, None);
    // The key is forgotten: the next request is forwarded again (once the delete's
    // announcement has evicted the key from the replay cache, within milliseconds).
    wait_until(
        "the deleted key is forwarded again",
        Duration::from_secs(5),
        || async { !post(&c, &gw, "acct 1", "k-1", "x").await.replayed() },
    )
    .await;
    assert_eq!(up.executions(), 2);

    let cfg2 = cfg.clone();
    let missing = tokio::task::spawn_blocking(move || {
        idemgate(
            &["keys", "show", "--scope", "nobody", "--key", "none"],
            &cfg2,
        )
    })
    .await
    .unwrap();
    assert_eq!(missing.0, 1);
    assert!(
        missing.2.contains("no key 'none' in scope 'nobody'"),
        "{missing:?}"
    );

    let cfg2 = cfg.clone();
    let gc = tokio::task::spawn_blocking(move || idemgate(&["gc"], &cfg2))
        .await
        .unwrap();
    assert_eq!(gc.0, 0, "{gc:?}");
    assert!(gc.1.contains("deleted 0 expired key(s)"), "{gc:?}");
    let _ = std::fs::remove_file(cfg);
}

/// docs/operations.md: the keys table can be hash-partitioned by scope without code changes.
#[tokio::test]
async fn the_gateway_works_unchanged_on_a_keys_table_partitioned_by_scope() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    gw.sql()
        .await
        .batch_execute(
            "BEGIN;
             ALTER TABLE idemgate_keys RENAME TO idemgate_keys_old;
             CREATE TABLE idemgate_keys (LIKE idemgate_keys_old INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
               PARTITION BY HASH (scope);
             ALTER TABLE idemgate_keys ADD PRIMARY KEY (scope, key);
             CREATE INDEX ON idemgate_keys (gc_after);
             CREATE TABLE idemgate_keys_p0 PARTITION OF idemgate_keys FOR VALUES WITH (MODULUS 4, REMAINDER 0) WITH (fillfactor = 90);
             CREATE TABLE idemgate_keys_p1 PARTITION OF idemgate_keys FOR VALUES WITH (MODULUS 4, REMAINDER 1) WITH (fillfactor = 90);
             CREATE TABLE idemgate_keys_p2 PARTITION OF idemgate_keys FOR VALUES WITH (MODULUS 4, REMAINDER 2) WITH (fillfactor = 90);
             CREATE TABLE idemgate_keys_p3 PARTITION OF idemgate_keys FOR VALUES WITH (MODULUS 4, REMAINDER 3) WITH (fillfactor = 90);
             INSERT INTO idemgate_keys SELECT * FROM idemgate_keys_old;
             DROP TABLE idemgate_keys_old;
             COMMIT;",
        )
        .await
        .unwrap();
    let c = client();
    for account in ["a", "b", "c", "d", "e"] {
        let first = post(&c, &gw, account, "k", "x").await;
        assert_eq!(first.status, 201);
        let again = post(&c, &gw, account, "k", "x").await;
        assert!(again.replayed());
        assert_eq!(post(&c, &gw, account, "k", "y").await.status, 422);
    }
    assert_eq!(up.executions(), 5);
    let db = gw.sql().await;
    insert_rows(&db, "old", 50, true).await;
    assert_eq!(gw.store.gc(10).await.unwrap().deleted, 50);
    assert!(gw.store.delete("a", "k").await.unwrap());
}
