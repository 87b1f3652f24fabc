//! Operator tools: garbage collection of expired rows, and `idemgate keys show|delete`.

use std::process::Command;
use std::time::Duration;

use idemgate::store::Deleted;

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
    // One collection (of three batches) is one `gc` operation in the store's metrics.
    let m = admin_request(&gw, http::Method::GET, "/metrics", None).await;
    let text = String::from_utf8_lossy(&m.body);
    assert_eq!(
        metric(&text, "idemgate_store_latency_seconds_count{op=\"gc\"}"),
        1.0
    );
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
    let mut cmd = Command::new(crate::support::bin::idemgate());
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

/// docs/operations.md: the keys table can be hash-partitioned by scope without code changes
/// (the whole conformance suite runs on it too: `conformance::partitioned::*`); collection
/// and operator deletes work across partitions.
#[tokio::test]
async fn the_gateway_works_unchanged_on_a_keys_table_partitioned_by_scope() {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(Backend::Partitioned, &up, "").await;
    let partitions: i64 = gw
        .sql()
        .await
        .query_one(
            "SELECT count(*) FROM pg_partition_tree('idemgate_keys') WHERE isleaf",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(partitions, 8);
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
    assert!(matches!(
        gw.store.delete(&scoped("a"), "k", false).await.unwrap(),
        Deleted::Yes { .. }
    ));
}

use crate::support::admin_request as admin;

#[tokio::test]
async fn a_key_in_flight_under_a_live_lease_is_deleted_only_when_forced() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(1500),
        ..Default::default()
    })
    .await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let busy = in_flight(&gw.url("/pay"), &up, "acct", "busy", "x").await;
    let q = "/v1/keys?scope=acct&key=busy";
    let refused = admin(&gw, http::Method::DELETE, q, None).await;
    assert_eq!(
        (refused.status, refused.problem().as_str()),
        (409, "key-in-flight")
    );
    // The detail says it once: what deleting would risk, and how to force it.
    let detail = refused.problem_detail();
    assert_eq!(detail.matches("force").count(), 1, "{detail}");
    assert!(detail.contains("force=true"), "{detail}");
    assert_eq!(
        row_state(&gw, "acct", "busy").await.as_deref(),
        Some("in_flight")
    );
    // The command line refuses too (exit 1), and says how to force it.
    let cfg = write_config(&gw, &up.url());
    let cfg2 = cfg.clone();
    let cli = tokio::task::spawn_blocking(move || {
        idemgate(
            &["keys", "delete", "--scope", "acct", "--key", "busy"],
            &cfg2,
        )
    })
    .await
    .unwrap();
    assert_eq!(cli.0, 1, "{cli:?}");
    assert!(cli.2.contains("in flight"), "{cli:?}");
    assert_eq!(
        row_state(&gw, "acct", "busy").await.as_deref(),
        Some("in_flight")
    );
    // Forced: deleted, logged and counted as a possible double.
    let forced = admin(&gw, http::Method::DELETE, &format!("{q}&force=true"), None).await;
    assert_eq!(forced.status, 204);
    assert_eq!(row_state(&gw, "acct", "busy").await, None);
    let metrics = admin(&gw, http::Method::GET, "/metrics", None).await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("idemgate_leases_total{route=\"payments\",event=\"force_deleted\"} 1"),
        "{text}"
    );
    // The first attempt still answers its client; its write is fenced out (lease lost).
    assert_eq!(busy.await.unwrap().status, 201);
    let _ = std::fs::remove_file(cfg);
}

/// `--force` on the command line deletes a key in flight under a live lease (exit 0), and
/// a forced delete, from the command line or the admin API, is a warning in the log of the
/// process that made it.
#[tokio::test]
async fn a_forced_delete_exits_0_and_is_logged_as_a_warning() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(1500),
        ..Default::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let yaml = format!(
        "{}admin: {{ listen: 127.0.0.1:0 }}\n",
        config_yaml(&db, &up.url(), "")
    );
    let gw = crate::support::process::GatewayProcess::start(&yaml).await;
    let cli_busy = in_flight(&gw.url("/pay"), &up, "acct", "cli", "x").await;
    let api_busy = in_flight(&gw.url("/pay"), &up, "acct", "api", "x").await;
    let sql = sql(&db).await;
    let row = |key: &'static str| {
        let sql = &sql;
        async move {
            sql.query_opt(
                "SELECT state FROM idemgate_keys WHERE scope = $1 AND key = $2",
                &[&scoped("acct"), &key],
            )
            .await
            .unwrap()
            .map(|r| r.get::<_, String>(0))
        }
    };
    assert_eq!(row("cli").await.as_deref(), Some("in_flight"));
    let config = gw.config.clone();
    let forced = tokio::task::spawn_blocking(move || {
        idemgate(
            &[
                "keys", "delete", "--scope", "acct", "--key", "cli", "--force",
            ],
            &config,
        )
    })
    .await
    .unwrap();
    assert_eq!(forced.0, 0, "{forced:?}");
    assert_eq!(row("cli").await, None, "the key is gone");
    let warned = |log: &str| {
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("forced delete of a key in flight"))
    };
    assert!(warned(&forced.2), "the command's log: {forced:?}");
    // Through the admin API the warning is in the gateway's log.
    let admin_url = format!(
        "http://{}/v1/keys?scope=acct&key=api&force=true",
        gw.admin.expect("an admin listener")
    );
    let deleted = send(&client(), http::Method::DELETE, &admin_url, &[], "").await;
    assert_eq!(deleted.status, 204);
    assert_eq!(row("api").await, None);
    wait_until(
        "the gateway logs the forced delete",
        Duration::from_secs(5),
        || async { warned(&gw.log_text()) },
    )
    .await;
    for busy in [cli_busy, api_busy] {
        assert_eq!(
            busy.await.unwrap().status,
            201,
            "the first attempts still answer"
        );
    }
}

/// The delete's announcement cannot reach this instance (its listener's backend is
/// stopped), so only the instance's own eviction keeps the deleted key out of its replay
/// cache.
#[tokio::test]
async fn an_instances_own_delete_evicts_its_replay_cache_at_once() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    wakeups_flow(&gw).await;
    let c = client();
    assert_eq!(post(&c, &gw, "a", "k", "x").await.status, 201);
    assert!(post(&c, &gw, "a", "k", "x").await.replayed());
    assert!(post(&c, &gw, "a", "k", "x").await.replayed());
    let hits = gw
        .gateway
        .inflight()
        .trusted_cache()
        .map(|(c, _)| c.hits.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(hits, Some(1), "the second replay came from memory");
    let listeners = pg::session_pids(
        &gw.sql().await,
        idemgate::store::postgres::listener::APPLICATION_NAME,
    )
    .await;
    assert_eq!(listeners.len(), 1, "one listener session");
    let stopped = pg::Stopped::stop(&listeners);
    let deleted = admin(&gw, http::Method::DELETE, "/v1/keys?scope=a&key=k", None).await;
    assert_eq!(deleted.status, 204);
    assert!(
        gw.gateway.inflight().trusted_cache().is_some(),
        "the cache is still trusted: nothing but the delete itself evicts the key"
    );
    let after = post(&c, &gw, "a", "k", "x").await;
    drop(stopped);
    assert!(!after.replayed(), "forwarded again right after the delete");
    assert_eq!(up.executions(), 2);
}

#[tokio::test]
async fn the_key_api_accepts_the_bearer_scheme_in_any_case() {
    let up = Upstream::start().await;
    let token = "a-long-admin-token-1234";
    let (gw, _db) = TestGateway::on_with(Backend::Postgres, &up, "", |y| {
        format!("{y}admin: {{ listen: 127.0.0.1:0, token: {token} }}\n")
    })
    .await;
    let q = "/v1/keys?scope=a&key=none";
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let auth = format!("{scheme} {token}");
        let r = admin(&gw, http::Method::GET, q, Some(&auth)).await;
        assert_eq!(r.status, 404, "{scheme}: authorized, and no such key");
    }
    let wrong = admin(
        &gw,
        http::Method::GET,
        q,
        Some("Bearer a-long-admin-token-1235"),
    )
    .await;
    assert_eq!(wrong.status, 401);
    let basic = admin(&gw, http::Method::GET, q, Some(&format!("Basic {token}"))).await;
    assert_eq!(basic.status, 401);
}

#[test]
fn an_admin_listener_off_loopback_without_a_token_is_a_config_error() {
    let dir = std::env::temp_dir().join(format!("idemgate-adm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("open-admin.yaml");
    let base = config_yaml("postgres://u@localhost/db", "http://127.0.0.1:9", "");
    std::fs::write(&file, format!("{base}admin: {{ listen: 0.0.0.0:9090 }}\n")).unwrap();
    let out = Command::new(crate::support::bin::idemgate())
        .args(["check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("admin.token"), "{stderr}");
    // On loopback, no token is needed.
    std::fs::write(
        &file,
        format!("{base}admin: {{ listen: 127.0.0.1:9090 }}\n"),
    )
    .unwrap();
    let out = Command::new(crate::support::bin::idemgate())
        .args(["check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let _ = std::fs::remove_dir_all(dir);
}

/// A `serialize` holder that crashed leaves its slot row behind (a released slot is deleted
/// by its holder); the collection deletes such rows a minute past their lease, and keeps
/// live ones.
#[tokio::test]
async fn gc_deletes_the_slot_rows_of_crashed_holders() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let db = gw.sql().await;
    for i in 0..20 {
        let slot = gw
            .store
            .acquire_slot(&format!("scope-{i}"), 1, Duration::from_secs(30))
            .await
            .unwrap();
        assert!(slot.is_some(), "scope-{i} has a free slot");
        // Never released: its holder crashed.
    }
    db.execute(
        "UPDATE idemgate_slots SET lease_expires_at = now() - interval '2 minutes'
          WHERE scope <> 'scope-0'",
        &[],
    )
    .await
    .unwrap();
    gw.store.gc(1000).await.unwrap();
    let left: Vec<String> = db
        .query("SELECT scope FROM idemgate_slots", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, ["scope-0"], "only the live slot is kept");
}
