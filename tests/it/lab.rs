//! LAB.md as a test: the naive legacy ledger, straight and behind idemgate (a real gateway
//! process on a real Postgres), through every check the lab lists. Straight, the ledger must
//! fail the checks it failed in the lab (proving the checks can fail); through idemgate,
//! every check passes.

use std::time::Duration;

use idemgate::lab::{self, CheckResult, Harness, Ledger};
use idemgate::store::BoxFuture;
use tokio::sync::Mutex;

use crate::support::pg::Cluster;
use crate::support::process::GatewayProcess;

/// idemgate as a child process on a private cluster (so the store can be stopped).
struct Gateway {
    process: Mutex<GatewayProcess>,
    url: String,
    cluster: std::sync::Arc<Cluster>,
}

impl Harness for Gateway {
    fn base_url(&self) -> String {
        self.url.clone()
    }
    fn is_gateway(&self) -> bool {
        true
    }
    fn kill(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async {
            self.process.lock().await.kill();
            Ok(())
        })
    }
    fn restart(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async {
            self.process.lock().await.restart().await;
            Ok(())
        })
    }
    fn store_down(&self) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async {
            let c = self.cluster.clone();
            tokio::task::spawn_blocking(move || c.pg_stop_immediate())
                .await
                .map_err(|e| e.to_string())?;
            Ok(self.url.clone())
        })
    }
    fn store_up(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async {
            let c = self.cluster.clone();
            tokio::task::spawn_blocking(move || c.pg_start())
                .await
                .map_err(|e| e.to_string())
        })
    }
    fn lease(&self) -> Duration {
        Duration::from_secs(9)
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

    // Through idemgate.
    let ledger = Ledger::new(Duration::from_millis(10));
    let (addr, _task) = ledger.start().await.unwrap();
    let cluster = std::sync::Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap());
    let db = cluster.new_database().await;
    let store = format!(
        "  postgres: {{ url: \"{db}\", acquire_timeout: 500ms, connect_timeout: 1s, statement_timeout: 1s }}"
    );
    let yaml = lab::gateway_config("127.0.0.1:0", &store, &format!("http://{addr}"), "9s", "5s");
    let process = GatewayProcess::start(&yaml).await;
    let url = format!("http://{}", process.addr);
    let gw = Gateway {
        process: Mutex::new(process),
        url,
        cluster,
    };
    let through = lab::run_checks(&gw, &ledger, "g", &progress).await;
    for r in &through {
        eprintln!("gateway {:<28} {:?} {}", r.name, r.passed, r.detail);
    }
    for r in &through {
        assert_eq!(r.passed, Some(true), "{}: {}", r.name, r.detail);
    }
    assert_eq!(through.len(), 8);
}
