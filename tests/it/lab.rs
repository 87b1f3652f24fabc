//! The lab (docs/lab.md) as a test: the naive legacy ledger, straight and behind idemgate (a
//! real gateway process on a real Postgres), through every check the lab lists. Straight, the
//! ledger must fail the checks it failed in the lab (proving the checks can fail); through
//! idemgate, every check passes.

use std::sync::Arc;
use std::time::Duration;

use idemgate::lab::{self, CheckResult, GatewayUnderTest, Ledger, StoreSwitch};
use idemgate::store::BoxFuture;

use crate::support::pg::Cluster;
use crate::support::pgbouncer::Bouncer;

/// The store of the gateway under test: its private cluster, stopped and started under it,
/// behind PgBouncer if any (the pooler stays up while the cluster is stopped), with the
/// test database through it.
struct OwnCluster {
    cluster: Arc<Cluster>,
    bouncer: Option<(Bouncer, String)>,
}

impl StoreSwitch for OwnCluster {
    fn down(&self) -> BoxFuture<'_, Result<Option<String>, String>> {
        Box::pin(async {
            let c = self.cluster.clone();
            tokio::task::spawn_blocking(move || c.pg_stop_immediate())
                .await
                .map_err(|e| e.to_string())?;
            Ok(None)
        })
    }
    fn up(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async {
            let c = self.cluster.clone();
            tokio::task::spawn_blocking(move || c.pg_start())
                .await
                .map_err(|e| e.to_string())?;
            // Behind a pooler the store is back once the pooler serves again: it retries its
            // server logins only every `server_login_retry`, and fails clients until then.
            if let Some((_, url)) = &self.bouncer {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
                loop {
                    let ok = match tokio_postgres::connect(url, tokio_postgres::NoTls).await {
                        Ok((client, conn)) => {
                            tokio::spawn(conn);
                            client.simple_query("SELECT 1").await.is_ok()
                        }
                        Err(_) => false,
                    };
                    if ok {
                        break;
                    }
                    if tokio::time::Instant::now() >= deadline {
                        return Err("the pooler does not serve again".into());
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            Ok(())
        })
    }
}

fn get<'a>(results: &'a [CheckResult], name: &str) -> &'a CheckResult {
    results.iter().find(|r| r.name == name).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_labs_checks_fail_straight_and_pass_through_idemgate() {
    let progress = |_: &str| {};

    // Straight at the naive ledger.
    let ledger = Ledger::new(Duration::from_millis(10));
    let (addr, _task) = ledger.start().await.unwrap();
    let direct = lab::run_checks(
        &lab::Direct(format!("http://{addr}")),
        &ledger,
        "d",
        &progress,
    )
    .await;
    for r in &direct {
        eprintln!("direct  {:<28} {:?} {}", r.name, r.passed, r.detail);
    }
    assert_eq!(get(&direct, "one delivery").passed, Some(true));
    assert_eq!(
        get(&direct, "a redelivery").passed,
        Some(false),
        "doubles a row"
    );
    assert_eq!(get(&direct, "30 concurrent deliveries").passed, Some(false));
    assert_eq!(
        get(&direct, "30 events, one account").passed,
        Some(false),
        "the read-then-write ledger loses updates: the check can fail"
    );
    assert_eq!(get(&direct, "same key, different body").passed, Some(false));
    assert_eq!(get(&direct, "webhook + reconciliation").passed, Some(false));

    for r in through_idemgate(false).await {
        assert_eq!(r.passed, Some(true), "{}: {}", r.name, r.detail);
    }
}

/// The same checks with PgBouncer in transaction mode between the gateway and PostgreSQL
/// (docs/contract.md §8.4), the wake-up listener on a direct session; "store down" stops
/// PostgreSQL behind the pooler, which keeps accepting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_labs_checks_pass_through_idemgate_behind_pgbouncer() {
    for r in through_idemgate(true).await {
        assert_eq!(r.passed, Some(true), "{}: {}", r.name, r.detail);
    }
}

/// Every check of docs/lab.md through a real gateway process on a private cluster (directly, or
/// behind a private PgBouncer).
async fn through_idemgate(pooled: bool) -> Vec<CheckResult> {
    let progress = |_: &str| {};
    let ledger = Ledger::new(Duration::from_millis(10));
    let (addr, _task) = ledger.start().await.unwrap();
    let cluster = Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap());
    let db = cluster.new_database().await;
    let bouncer = if pooled {
        let c = cluster.clone();
        Some(
            tokio::task::spawn_blocking(move || Bouncer::start(&c))
                .await
                .unwrap(),
        )
    } else {
        None
    };
    let store = match &bouncer {
        None => lab::postgres_store(&db, None),
        Some(b) => lab::postgres_store(&b.url_for(&db), Some(&db)),
    };
    let yaml = lab::gateway_config(
        "127.0.0.1:0",
        &store,
        &format!("http://{addr}"),
        "11s",
        "5s",
    );
    let dir = std::env::temp_dir().join(format!("idemgate-lab-{}-{pooled}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let process =
        idemgate::process::GatewayProcess::start(crate::support::bin::idemgate(), &dir, &yaml)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    let store = OwnCluster {
        cluster,
        bouncer: bouncer.map(|b| {
            let url = b.url_for(&db);
            (b, url)
        }),
    };
    let gw = GatewayUnderTest::new(process, Duration::from_secs(9), store);
    let through = lab::run_checks(&gw, &ledger, "g", &progress).await;
    for r in &through {
        eprintln!("gateway {:<28} {:?} {}", r.name, r.passed, r.detail);
    }
    assert_eq!(through.len(), 8);
    if through.iter().any(|r| r.passed != Some(true)) {
        if let Some((b, _)) = &gw.store().bouncer {
            eprintln!("pgbouncer log:\n{}", b.log());
        }
        eprintln!("gateway log:\n{}", gw.log_text().await);
    }
    let _ = std::fs::remove_dir_all(&dir);
    through
}
