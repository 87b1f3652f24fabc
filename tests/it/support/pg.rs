//! A throwaway PostgreSQL cluster for tests.
//!
//! `initdb` + `pg_ctl` from the installed PostgreSQL (found under `/usr/lib/postgresql/*/bin`,
//! or `PG_BIN`), run as the `postgres` user through `runuser` when the tests run as root
//! (`initdb` once per machine: each cluster starts from a copy of its directory). A
//! cluster listens on 127.0.0.1 on a free port, with trust auth and `fsync=off` (safe here:
//! tests crash the server, never the machine, and commits stay synchronous, so a crashed
//! server loses nothing committed). It is stopped and removed when dropped; a watchdog shell stops it too if the test process dies without dropping it
//! (statics are never dropped). If `DATABASE_URL` is set, the shared cluster is that server.
//! If a cluster cannot be started, the test fails loudly with the reason: nothing is skipped.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("PG_BIN") {
        return PathBuf::from(dir);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .filter(|p| p.join("initdb").exists())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found.pop().unwrap_or_else(|| {
        panic!(
            "PostgreSQL server binaries not found: no /usr/lib/postgresql/*/bin/initdb. \
             Install them (apt-get install -y postgresql) or set PG_BIN or DATABASE_URL."
        )
    })
}

pub fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    // `/proc/self` belongs to the process's effective user: no `id -u` to spawn.
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Runs the shell command `cleanup` once this test process is gone, however it ends (statics
/// are never dropped, and a killed process drops nothing): a watcher that outlives us.
#[allow(clippy::zombie_processes)] // it must outlive us: nobody waits for it, by design
pub fn after_this_process(cleanup: &str) {
    let script = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 1; done; {cleanup}",
        pid = std::process::id()
    );
    Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawning a watchdog");
}

/// A command run as the cluster's owner.
fn pg_command(bin: &Path, tool: &str) -> Command {
    let exe = bin.join(tool);
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(exe);
        c
    } else {
        Command::new(exe)
    }
}

fn run(mut cmd: Command, what: &str) {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    if !out.status.success() {
        panic!(
            "{what} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding an ephemeral port")
}

/// A data directory fresh from `initdb`, made once per machine, user and server binaries and
/// copied for every new cluster: `initdb` costs about a second of CPU, the copy a tenth of
/// that, and every test process starts at least one cluster. It is made under a file lock
/// (tests run in processes of their own, in parallel) and renamed into place whole, so a
/// reader never sees half of one; it is never changed afterwards. It stays in the temporary
/// directory (about 40 MB) for the next run.
fn initialized(bin: &Path) -> PathBuf {
    static DONE: OnceLock<PathBuf> = OnceLock::new();
    DONE.get_or_init(|| {
        // The options below, the binaries' directory and the user name the template.
        use std::hash::{Hash, Hasher};
        let args = ["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"];
        let mut hasher = std::hash::DefaultHasher::new();
        (bin, args, is_root()).hash(&mut hasher);
        let hash = hasher.finish();
        let base = std::env::temp_dir().join(format!("idemgate-pg-template-{hash:016x}"));
        let template = base.join("data");
        let lock = std::fs::File::create(base.with_extension("lock"))
            .expect("creating the template's lock file");
        lock.lock().expect("locking the template");
        if template.join("PG_VERSION").is_file() {
            return template;
        }
        let partial = base.with_extension(format!("partial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&partial);
        std::fs::create_dir_all(&partial).expect("creating the template's directory");
        if is_root() {
            let mut c = Command::new("chown");
            c.args(["postgres:postgres"]).arg(&partial);
            run(c, "chown of the template's directory");
        }
        let mut init = pg_command(bin, "initdb");
        init.arg("-D").arg(partial.join("data")).args(args);
        run(init, "initdb");
        let _ = std::fs::remove_dir_all(&base);
        std::fs::rename(&partial, &base).expect("moving the template into place");
        template
    })
    .clone()
}

/// A running cluster, or an external server from `DATABASE_URL`.
pub struct Cluster {
    bin: PathBuf,
    dir: Option<PathBuf>,
    pub port: u16,
    /// Connection string of the maintenance database (`postgres`).
    admin_url: String,
    /// fsync on, as in production (benchmarks); tests run with fsync off.
    durable: bool,
}

impl Cluster {
    /// Starts a new private cluster (for tests that stop or crash Postgres).
    pub fn start() -> Cluster {
        Cluster::start_with_tls(None)
    }

    /// A private cluster with stock durability (fsync and synchronous_commit on), for
    /// benchmarks: numbers from a database that does not flush would flatter the database.
    #[allow(dead_code)] // used by the load harness (benches/load.rs), which includes this file
    pub fn start_durable() -> Cluster {
        Cluster::start_inner(None, true)
    }

    /// A private cluster that also accepts TLS with this certificate and key (PEM).
    pub fn start_with_tls(tls: Option<(&str, &str)>) -> Cluster {
        Cluster::start_inner(tls, false)
    }

    fn start_inner(tls: Option<(&str, &str)>, durable: bool) -> Cluster {
        let bin = bin_dir();
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("idemgate-pg-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the cluster directory");
        if is_root() {
            run(
                {
                    let mut c = Command::new("chown");
                    c.args(["-R", "postgres:postgres"]).arg(&dir);
                    c
                },
                "chown of the cluster directory",
            );
        }
        let data = dir.join("data");
        let mut copy = Command::new("cp");
        copy.arg("-a").arg(initialized(&bin)).arg(&data);
        run(copy, "copying the initialized data directory");
        if let Some((cert, key)) = tls {
            // The server wants its key readable by its owner only.
            std::fs::write(data.join("server.crt"), cert).expect("writing the server certificate");
            std::fs::write(data.join("server.key"), key).expect("writing the server key");
            let conf = data.join("postgresql.conf");
            let mut text = std::fs::read_to_string(&conf).expect("postgresql.conf");
            text.push_str(
                "\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n",
            );
            std::fs::write(&conf, text).expect("postgresql.conf");
            let mut chmod = Command::new("chmod");
            chmod.arg("600").arg(data.join("server.key"));
            run(chmod, "chmod of the server key");
            if is_root() {
                let mut c = Command::new("chown");
                c.args(["postgres:postgres"])
                    .arg(data.join("server.crt"))
                    .arg(data.join("server.key"));
                run(c, "chown of the server certificate");
            }
        }
        let port = free_port();
        let cluster = Cluster {
            bin,
            dir: Some(dir.clone()),
            port,
            admin_url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            durable,
        };
        cluster.watchdog();
        cluster.pg_start();
        cluster
    }

    /// Stops the cluster (and removes its files) when this process is gone, however it ends.
    fn watchdog(&self) {
        let dir = self.dir.as_ref().expect("own cluster");
        let ctl = self.bin.join("pg_ctl");
        let stop = if is_root() {
            format!(
                "runuser -u postgres -- {} -D {} stop -m immediate",
                ctl.display(),
                dir.join("data").display()
            )
        } else {
            format!(
                "{} -D {} stop -m immediate",
                ctl.display(),
                dir.join("data").display()
            )
        };
        after_this_process(&format!("{stop} >/dev/null 2>&1; rm -rf {}", dir.display()));
    }

    /// Starts (or restarts) the server and waits until it accepts connections.
    pub fn pg_start(&self) {
        let dir = self.dir.as_ref().expect("own cluster");
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync={} \
             -c max_connections=300 -c shared_buffers=64MB",
            self.port,
            dir.display(),
            if self.durable { "on" } else { "off" }
        );
        let mut c = pg_command(&self.bin, "pg_ctl");
        c.arg("-D")
            .arg(dir.join("data"))
            .args(["-o", &opts, "-l"])
            .arg(dir.join("log"))
            .args(["-w", "-t", "60", "start"]);
        run(c, "pg_ctl start");
    }

    /// The postmaster's process id while the server runs (benchmarks count its CPU).
    #[allow(dead_code)] // used by the load harness (benches/load.rs), which includes this file
    pub fn postmaster_pid(&self) -> Option<u32> {
        let dir = self.dir.as_ref()?;
        std::fs::read_to_string(dir.join("data").join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    /// Freezes the server, like a host that stops answering without closing anything: the
    /// postmaster and every process it started get SIGSTOP (connections stay open, statements
    /// and connects hang) until the returned guard is dropped.
    #[allow(dead_code)] // used by the tests, not by the load harness that includes this file
    pub fn frozen(&self) -> Stopped {
        let postmaster = self.postmaster_pid().expect("own cluster, running") as i32;
        let children = Command::new("pgrep")
            .args(["-P", &postmaster.to_string()])
            .output()
            .expect("pgrep");
        let mut pids = vec![postmaster];
        pids.extend(
            String::from_utf8_lossy(&children.stdout)
                .lines()
                .filter_map(|l| l.trim().parse::<i32>().ok()),
        );
        assert!(pids.len() > 1, "the postmaster has no children to freeze");
        Stopped::stop_present(&pids)
    }

    /// Stops the server at once, like a crash (`pg_ctl -m immediate stop`).
    pub fn pg_stop_immediate(&self) {
        let dir = self.dir.as_ref().expect("own cluster");
        let mut c = pg_command(&self.bin, "pg_ctl");
        c.arg("-D")
            .arg(dir.join("data"))
            .args(["-m", "immediate", "-w", "stop"]);
        run(c, "pg_ctl stop");
    }

    /// Crashes the server (`pg_ctl -m immediate stop`) off the async workers.
    pub async fn crashed(self) -> Cluster {
        tokio::task::spawn_blocking(move || {
            self.pg_stop_immediate();
            self
        })
        .await
        .expect("stopping the cluster")
    }

    /// Starts the server again, off the async workers.
    pub async fn restarted(self) -> Cluster {
        tokio::task::spawn_blocking(move || {
            self.pg_start();
            self
        })
        .await
        .expect("starting the cluster")
    }

    /// A new private cluster, started off the async workers.
    pub async fn start_async() -> Cluster {
        tokio::task::spawn_blocking(Cluster::start)
            .await
            .expect("starting a private cluster")
    }

    /// A fresh, empty database; returns its connection string.
    pub async fn new_database(&self) -> String {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let name = format!("t{}_{n}", std::process::id());
        let (client, conn) = tokio_postgres::connect(&self.admin_url, tokio_postgres::NoTls)
            .await
            .unwrap_or_else(|e| panic!("connecting to the test cluster: {e}"));
        let task = tokio::spawn(conn);
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap_or_else(|e| panic!("creating database {name}: {e}"));
        drop(client);
        let _ = task.await;
        let base = self
            .admin_url
            .rsplit_once('/')
            .map(|(b, _)| b)
            .expect("URL has a database part");
        format!("{base}/{name}")
    }
}

/// A WAL receiver streaming from a cluster (`pg_receivewal`: to the primary, an asynchronous
/// standby), stopped and its directory removed when dropped.
#[allow(dead_code)] // used by the tests, not by the load harness that includes this file
pub struct WalReceiver {
    child: std::process::Child,
    dir: PathBuf,
}

impl Drop for WalReceiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Cluster {
    /// Starts `pg_receivewal` against this cluster: it shows in `pg_stat_replication` as a
    /// streaming standby that is not synchronous.
    #[allow(dead_code)] // used by the tests, not by the load harness that includes this file
    pub fn stream_wal(&self) -> WalReceiver {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("idemgate-wal-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("creating the WAL directory");
        let child = Command::new(self.bin.join("pg_receivewal"))
            .arg("-D")
            .arg(&dir)
            .args(["--no-sync", "-d"])
            .arg(format!("host=127.0.0.1 port={} user=postgres", self.port))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting pg_receivewal");
        WalReceiver { child, dir }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let mut c = pg_command(&self.bin, "pg_ctl");
            c.arg("-D")
                .arg(dir.join("data"))
                .args(["-m", "immediate", "stop"])
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let _ = c.status();
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The cluster shared by every test of this process (each test gets its own database).
pub fn shared() -> &'static Cluster {
    static SHARED: OnceLock<Cluster> = OnceLock::new();
    SHARED.get_or_init(|| match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => Cluster {
            bin: PathBuf::new(),
            dir: None,
            port: 0,
            admin_url: url,
            durable: true,
        },
        _ => Cluster::start(),
    })
}

/// A fresh database in the shared cluster.
pub async fn fresh_database() -> String {
    let cluster = tokio::task::spawn_blocking(shared)
        .await
        .expect("starting the shared cluster");
    cluster.new_database().await
}

/// The server processes of this database's sessions that `application_name` names
/// (`idemgate` for the pool, `idemgate-listener` for the wake-up listener).
#[allow(dead_code)] // used by the tests, not by the load harness that includes this file
pub async fn session_pids(db: &tokio_postgres::Client, application_name: &str) -> Vec<i32> {
    db.query(
        "SELECT pid FROM pg_stat_activity
          WHERE application_name = $1 AND datname = current_database()",
        &[&application_name],
    )
    .await
    .expect("listing the sessions")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// Processes stopped with SIGSTOP, continued (SIGCONT) when dropped, however the test ends.
#[allow(dead_code)] // used by the tests, not by the load harness that includes this file
pub struct Stopped(Vec<i32>);

impl Stopped {
    #[allow(dead_code)] // used by the tests, not by the load harness that includes this file
    pub fn stop(pids: &[i32]) -> Stopped {
        Stopped::stopping(pids, false)
    }

    /// Like [`Stopped::stop`], for a list read a moment ago (a server's children): a process
    /// that has exited since (a backend whose client just left) is passed over; one that is
    /// still there and cannot be stopped still fails the test.
    #[allow(dead_code)] // used by the tests, not by the load harness that includes this file
    pub fn stop_present(pids: &[i32]) -> Stopped {
        Stopped::stopping(pids, true)
    }

    fn stopping(pids: &[i32], pass_exited: bool) -> Stopped {
        // Built first, so that whatever was stopped is continued even if a later kill fails.
        let stopped = Stopped(pids.to_vec());
        for pid in pids {
            let sent = Command::new("kill")
                .args(["-STOP", &pid.to_string()])
                .stderr(std::process::Stdio::null())
                .status()
                .expect("kill")
                .success();
            let exited = !std::path::Path::new(&format!("/proc/{pid}")).exists();
            assert!(sent || (pass_exited && exited), "kill -STOP {pid} failed");
        }
        stopped
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        for pid in &self.0 {
            let _ = Command::new("kill")
                .args(["-CONT", &pid.to_string()])
                .status();
        }
    }
}
