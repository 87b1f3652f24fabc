//! `idemgate demo`: the lab (docs/lab.md) on this machine, in one command, with nothing to set
//! up.
//!
//! It starts two copies of the naive legacy ledger ([`lab`]) on ephemeral ports, a real
//! gateway process (this same binary, `serve`) in front of one of them on the embedded store
//! in a temporary directory (or on `--store postgres://...`), runs the lab's checks straight
//! at one ledger and through idemgate at the other, and prints them side by side. The gateway
//! is a child process so that the crash check is a real SIGKILL. "Store unreachable" is shown
//! by a second gateway whose store does not answer (a Postgres address where nothing
//! listens). The exit status is 0 only if every check passes through the gateway.
//!
//! This module and its two submodules, [`lab`] (the ledger and the lab's checks) and
//! [`process`] (a gateway child process), exist with the cargo feature `demo`, on by
//! default: the `demo` and `lab-ledger` commands use them, and so do the integration tests
//! and the load benchmark. The gateway itself never does. The crate root re-exports them as
//! `idemgate::lab` and `idemgate::process`.

pub mod lab;
pub mod ledger;
pub mod process;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;

use self::lab::{CheckResult, GatewayUnderTest, Ledger, StoreSwitch};
use self::process::{GatewayProcess, free_port};
use crate::store::BoxFuture;

/// What `idemgate demo` was asked.
#[derive(Debug, Clone, Default)]
pub struct DemoOptions {
    /// A Postgres URL; `None` runs on the embedded store in a temporary directory.
    pub store: Option<String>,
    /// Leave the gateway and ledger running and print commands to try by hand.
    pub keep_running: bool,
}

/// The crash window of the demo's gateway: upstream timeout (2s) + serialize wait (3s) +
/// twice the store's record bound (the slot's call and the recording, 1.5s each) < lease.
const LEASE: Duration = Duration::from_secs(9);
const SERIALIZE_WAIT: &str = "3s";

fn store_block(opts: &DemoOptions, dir: &Path) -> String {
    match &opts.store {
        Some(url) => lab::postgres_store(url, None),
        None => format!(
            "  sqlite: {{ path: \"{}\", busy_timeout: 1s }}",
            dir.join("idemgate.db").display()
        ),
    }
}

/// "Store unreachable" in the demo: a second gateway on a Postgres address where nothing
/// listens, while the first keeps its store.
struct CutOff {
    exe: PathBuf,
    dir: PathBuf,
    ledger_url: String,
    gateway: Mutex<Option<GatewayProcess>>,
}

impl StoreSwitch for CutOff {
    fn down(&self) -> BoxFuture<'_, Result<Option<String>, String>> {
        Box::pin(async {
            let port = free_port().map_err(|e| e.to_string())?;
            let store = format!(
                "  postgres: {{ url: \"postgres://idemgate@127.0.0.1:{port}/gone\", acquire_timeout: 500ms, connect_timeout: 500ms, statement_timeout: 1s }}"
            );
            let yaml = lab::gateway_config(
                "127.0.0.1:0",
                &store,
                &self.ledger_url,
                &crate::config::fmt_duration(LEASE),
                SERIALIZE_WAIT,
            );
            // `serve` starts without its store and keeps trying to reach it.
            let p = GatewayProcess::start_logging(&self.exe, &self.dir, &yaml, "info").await?;
            let url = p.url("");
            *self.gateway.lock().await = Some(p);
            Ok(Some(url))
        })
    }
    fn up(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async {
            self.gateway.lock().await.take();
            Ok(())
        })
    }
}

/// A temporary directory, removed on drop unless kept.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> std::io::Result<TempDir> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir =
            std::env::temp_dir().join(format!("idemgate-demo-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(TempDir(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One line of progress on stderr: overwritten in place on a terminal, one line each
/// otherwise (logs, CI).
fn progress(line: &str) {
    use std::io::IsTerminal;
    let mut err = std::io::stderr();
    if err.is_terminal() {
        let _ = write!(err, "\r\x1b[2K{line}");
        let _ = err.flush();
    } else if !line.is_empty() {
        let _ = writeln!(err, "{line}");
    }
}

fn cell(r: &CheckResult) -> String {
    let mark = match r.passed {
        Some(true) => "pass",
        Some(false) => "FAIL",
        None => "n/a ",
    };
    format!("{mark}  {}", r.detail)
}

/// Renders the side-by-side table.
pub fn table(direct: &[CheckResult], through: &[CheckResult]) -> String {
    let name_w = through
        .iter()
        .map(|r| r.name.len())
        .max()
        .unwrap_or(10)
        .max(5);
    let left: Vec<String> = direct.iter().map(cell).collect();
    let left_w = left
        .iter()
        .map(|s| s.chars().count())
        .max()
        .unwrap_or(10)
        .max(24);
    let mut out = String::new();
    out.push_str(&format!(
        "{:<name_w$}  {:<left_w$}  {}\n",
        "check", "straight to the legacy ledger", "through idemgate"
    ));
    out.push_str(&format!(
        "{}  {}  {}\n",
        "-".repeat(name_w),
        "-".repeat(left_w),
        "-".repeat(40)
    ));
    for (i, r) in through.iter().enumerate() {
        let l = left.get(i).map(String::as_str).unwrap_or("");
        out.push_str(&format!(
            "{:<name_w$}  {:<left_w$}  {}\n",
            r.name,
            l,
            cell(r)
        ));
    }
    out
}

/// Runs the demo; `Ok(true)` when every check passed through the gateway.
pub async fn run(opts: DemoOptions) -> Result<bool, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let dir = TempDir::new().map_err(|e| format!("cannot create a temporary directory: {e}"))?;
    let work = Duration::from_millis(10);
    let straight = Ledger::new(work);
    let (straight_addr, _t1) = straight.start().await.map_err(|e| e.to_string())?;
    let behind = Ledger::new(work);
    let (behind_addr, _t2) = behind.start().await.map_err(|e| e.to_string())?;
    let ledger_url = format!("http://{behind_addr}");

    progress("starting idemgate in front of the legacy ledger...");
    let yaml = lab::gateway_config(
        "127.0.0.1:0",
        &store_block(&opts, &dir.0),
        &ledger_url,
        &crate::config::fmt_duration(LEASE),
        SERIALIZE_WAIT,
    );
    let gateway = GatewayProcess::start_logging(&exe, &dir.0, &yaml, "info").await?;
    let url = gateway.url("");
    let cut_off = CutOff {
        exe: exe.clone(),
        dir: dir.0.clone(),
        ledger_url,
        gateway: Mutex::new(None),
    };
    let harness = GatewayUnderTest::new(gateway, LEASE, cut_off);
    let run_id = format!("{}", std::process::id());
    let total = 8;
    let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let step = |label: &'static str| {
        let count = Arc::clone(&count);
        move |name: &str| {
            let n = count.fetch_add(1, std::sync::atomic::Ordering::SeqCst) % total + 1;
            progress(&format!("[{n}/{total}] {label}: {name}..."));
        }
    };
    let direct = lab::run_checks(
        &lab::Direct(format!("http://{straight_addr}")),
        &straight,
        &format!("{run_id}-direct"),
        &step("straight to the ledger"),
    )
    .await;
    let through = lab::run_checks(
        &harness,
        &behind,
        &format!("{run_id}-gw"),
        &step("through idemgate"),
    )
    .await;
    progress("");
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!();
    }

    let store_name = match &opts.store {
        Some(_) => "PostgreSQL".to_string(),
        None => "a temporary embedded store".to_string(),
    };
    println!(
        "idemgate demo: the lab, a naive legacy ledger straight and behind idemgate on {store_name}\n"
    );
    print!("{}", table(&direct, &through));
    let passed = through.iter().all(|r| r.passed == Some(true));
    println!(
        "\n{}",
        if passed {
            "every check passes through idemgate; the ledger's code did not change."
        } else {
            "SOME CHECKS FAILED THROUGH IDEMGATE: see the table above."
        }
    );

    if opts.keep_running {
        println!(
            "\nidemgate is running at {url} in front of the legacy ledger at http://{behind_addr}.\n\
             Try it (Ctrl-C to stop):\n\n  \
             curl -si {url}/webhooks/payments -H 'content-type: application/json' \\\n    \
             -d '{{\"event_id\":\"evt_1\",\"payment_id\":\"pay_1\",\"account_id\":\"acct_1\",\"amount\":100}}'\n  \
             # run it again: same answer, with Idempotent-Replayed: true, and no second ledger row\n  \
             curl -si {url}/webhooks/payments -H 'content-type: application/json' \\\n    \
             -d '{{\"event_id\":\"evt_1\",\"payment_id\":\"pay_1\",\"account_id\":\"acct_1\",\"amount\":999}}'\n  \
             # same payment, another amount: 422 fingerprint-mismatch\n"
        );
        let _ = tokio::signal::ctrl_c().await;
    }
    Ok(passed)
}
