//! A throwaway PgBouncer in transaction mode in front of a test cluster.
//!
//! The stock configuration docs/contract.md §8.4 names (`pool_mode = transaction`,
//! `ignore_startup_parameters = extra_float_digits`), listening on 127.0.0.1 on a free port,
//! trust authentication for the cluster's `postgres` user, and one wildcard database entry
//! (`* = host=127.0.0.1 port=<cluster>`), so every test database of the cluster is reachable
//! under its own name. Like the cluster, it runs as the `postgres` user through `runuser` when
//! the tests run as root (PgBouncer refuses to run as root); it is daemonized with a pid file,
//! stopped by that pid when dropped, and by a watchdog shell if the test process dies without
//! dropping it. The binary is `PGBOUNCER`, or `pgbouncer` on the `PATH` or in `/usr/sbin`;
//! without one the test fails loudly with the reason (`.ci/run` installs the Debian package).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::pg::{self, Cluster};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// The pooler settings the tests run with, as README's "Several instances" shows them.
/// `{port}`, `{pg_port}` and `{dir}` are filled in per instance. Beyond the stock settings:
/// `server_idle_timeout` short, so the pools of finished tests' databases let go of their
/// server connections soon (the shared cluster has 300); `server_login_retry` 1 s instead of
/// 15 s, so that after PostgreSQL comes back the pooler reconnects within a second (until it
/// does, keyed requests are answered 503 within their bound: correct, but slow to recover).
pub const INI: &str = "\
[databases]
* = host=127.0.0.1 port={pg_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {dir}/userlist.txt
pool_mode = transaction
ignore_startup_parameters = extra_float_digits
max_client_conn = 2000
default_pool_size = 10
server_idle_timeout = 5
server_login_retry = 1
logfile = {dir}/pgbouncer.log
pidfile = {dir}/pgbouncer.pid
";

fn binary() -> PathBuf {
    if let Ok(bin) = std::env::var("PGBOUNCER") {
        return PathBuf::from(bin);
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([PathBuf::from("/usr/sbin")])
        .map(|d| d.join("pgbouncer"))
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "pgbouncer not found (on the PATH, in /usr/sbin, or PGBOUNCER). Install it \
                 (apt-get install -y pgbouncer; .ci/run does) or set PGBOUNCER."
            )
        })
}

/// A running PgBouncer in transaction mode.
pub struct Bouncer {
    dir: PathBuf,
    pub port: u16,
}

impl Bouncer {
    /// Starts one in front of `cluster` and waits until it accepts connections.
    pub fn start(cluster: &Cluster) -> Bouncer {
        assert!(
            cluster.port != 0,
            "a pooler needs a cluster the tests started (not DATABASE_URL)"
        );
        let bin = binary();
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let dir =
            std::env::temp_dir().join(format!("idemgate-pgbouncer-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the pooler directory");
        let port = pg::free_port();
        let ini = INI
            .replace("{port}", &port.to_string())
            .replace("{pg_port}", &cluster.port.to_string())
            .replace("{dir}", &dir.display().to_string());
        std::fs::write(dir.join("pgbouncer.ini"), ini).expect("writing pgbouncer.ini");
        // trust still wants the user listed.
        std::fs::write(dir.join("userlist.txt"), "\"postgres\" \"\"\n")
            .expect("writing userlist.txt");
        if pg::is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "chown of the pooler directory failed");
        }
        let bouncer = Bouncer { dir, port };
        bouncer.watchdog();
        let mut cmd = as_postgres(&bin);
        cmd.arg("-d").arg(bouncer.dir.join("pgbouncer.ini"));
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("pgbouncer: cannot run {}: {e}", bin.display()));
        if !out.status.success() {
            panic!(
                "pgbouncer failed to start ({}):\n{}\n{}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                bouncer.log()
            );
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                panic!("pgbouncer does not accept connections:\n{}", bouncer.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bouncer
    }

    /// The same database as `direct` (a URL of the cluster behind it), through the pooler.
    pub fn url_for(&self, direct: &str) -> String {
        let name = direct.rsplit('/').next().expect("a database name");
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// The pooler's log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }

    fn pid(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.join("pgbouncer.pid"))
            .ok()
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty())
    }

    /// Stops the pooler (and removes its files) when this process is gone, however it ends.
    fn watchdog(&self) {
        let pidfile = self.dir.join("pgbouncer.pid");
        pg::after_this_process(&format!(
            "[ -s {pidfile} ] && kill $(cat {pidfile}) 2>/dev/null; sleep 1; rm -rf {dir}",
            pidfile = pidfile.display(),
            dir = self.dir.display()
        ));
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill")
                .arg(&pid)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `bin`, run as the cluster's owner when the tests run as root.
fn as_postgres(bin: &Path) -> Command {
    if pg::is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    }
}

/// The pooler in front of the shared cluster, shared by every test of this process.
pub fn shared() -> &'static Bouncer {
    static SHARED: OnceLock<Bouncer> = OnceLock::new();
    SHARED.get_or_init(|| Bouncer::start(pg::shared()))
}

/// A fresh database in the shared cluster: (its direct URL, the same through the pooler).
pub async fn fresh_database() -> (String, String) {
    let direct = pg::fresh_database().await;
    let bouncer = tokio::task::spawn_blocking(shared)
        .await
        .expect("starting the shared pooler");
    let pooled = bouncer.url_for(&direct);
    (direct, pooled)
}
