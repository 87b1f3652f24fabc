//! An `idemgate serve` child process: started from a config, killed with SIGKILL, signalled
//! with SIGTERM, restarted. The demo uses it to crash a real gateway mid-request; the
//! integration tests use it the same way.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A port that was free a moment ago (bind 127.0.0.1:0, read it, release it). Only for an
/// address that must have nothing listening (a refused connection); never to listen on.
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

pub struct GatewayProcess {
    exe: PathBuf,
    /// The child's `RUST_LOG`.
    log_filter: String,
    /// More environment variables for the child (e.g. `SSL_CERT_FILE`).
    env: Vec<(String, String)>,
    pub addr: SocketAddr,
    /// The admin listener's address, when the config has one.
    pub admin: Option<SocketAddr>,
    /// The config file it runs with.
    pub config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl GatewayProcess {
    /// Writes `yaml` into `dir` and starts `exe serve` on it, waiting (up to 30 s) until it
    /// accepts connections. Listeners on port 0 are bound by the process itself, which prints
    /// the addresses; the config is then rewritten with them, so a restart comes back on the
    /// same ports (no port is picked, released and hoped for).
    pub async fn start(exe: &Path, dir: &Path, yaml: &str) -> Result<GatewayProcess, String> {
        GatewayProcess::start_with_env(exe, dir, yaml, &[]).await
    }

    /// As [`start`](Self::start), with more environment variables for the child: the only
    /// way a test sets one, since setting it in a threaded test process is unsound.
    pub async fn start_with_env(
        exe: &Path,
        dir: &Path,
        yaml: &str,
        env: &[(&str, &str)],
    ) -> Result<GatewayProcess, String> {
        let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "idemgate=debug".into());
        GatewayProcess::launch(exe, dir, yaml, &filter, env).await
    }

    /// As [`start`](Self::start), with the child's log filter (`RUST_LOG`) given: a load
    /// test must not pay for a debug line per request.
    pub async fn start_logging(
        exe: &Path,
        dir: &Path,
        yaml: &str,
        log_filter: &str,
    ) -> Result<GatewayProcess, String> {
        GatewayProcess::launch(exe, dir, yaml, log_filter, &[]).await
    }

    async fn launch(
        exe: &Path,
        dir: &Path,
        yaml: &str,
        log_filter: &str,
        env: &[(&str, &str)],
    ) -> Result<GatewayProcess, String> {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = format!(
            "{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        );
        let config = dir.join(format!("gateway-{n}.yaml"));
        std::fs::write(&config, yaml).map_err(|e| format!("writing {}: {e}", config.display()))?;
        let mut p = GatewayProcess {
            exe: exe.to_path_buf(),
            log_filter: log_filter.to_string(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin: None,
            log: dir.join(format!("gateway-{n}.log")),
            config,
            child: None,
        };
        p.spawn().await?;
        // Pin the bound ports for restarts (and for tools that read the config).
        let mut pinned = String::with_capacity(yaml.len());
        for line in yaml.lines() {
            let port = if line.starts_with("listen:") {
                Some(p.addr.port())
            } else if line.starts_with("admin:") {
                p.admin.map(|a| a.port())
            } else {
                None
            };
            pinned.push_str(&port.map_or_else(|| line.to_string(), |port| pin_port(line, port)));
            pinned.push('\n');
        }
        std::fs::write(&p.config, pinned)
            .map_err(|e| format!("writing {}: {e}", p.config.display()))?;
        Ok(p)
    }

    async fn spawn(&mut self) -> Result<(), String> {
        let open_log = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log)
                .map_err(|e| format!("opening {}: {e}", self.log.display()))
        };
        // The log is appended to across restarts: only this start's lines count.
        let skip = std::fs::metadata(&self.log).map_or(0, |m| m.len() as usize);
        let child = Command::new(&self.exe)
            .args(["serve", "--config"])
            .arg(&self.config)
            .env("RUST_LOG", &self.log_filter)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(open_log()?)
            .stderr(open_log()?)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", self.exe.display()))?;
        self.child = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let wants_admin = std::fs::read_to_string(&self.config)
            .is_ok_and(|c| c.lines().any(|l| l.starts_with("admin:")));
        loop {
            let text = self.log_text();
            let fresh = text.get(skip..).unwrap_or("");
            if let Some(at) = fresh.find("idemgate: listening on ") {
                let rest = &fresh[at + "idemgate: listening on ".len()..];
                if let Some(addr) = rest.lines().next().and_then(|l| l.trim().parse().ok()) {
                    self.addr = addr;
                    if let Some(at) = fresh.find("idemgate: admin on ") {
                        self.admin = fresh[at + "idemgate: admin on ".len()..]
                            .lines()
                            .next()
                            .and_then(|l| l.trim().parse().ok());
                    }
                    if (self.admin.is_some() || !wants_admin)
                        && tokio::net::TcpStream::connect(self.addr).await.is_ok()
                    {
                        break;
                    }
                }
            }
            let child = self.child.as_mut().expect("just started");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(format!(
                    "idemgate exited with {status} at start:\n{}",
                    self.log_text()
                ));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!("idemgate did not start:\n{}", self.log_text()));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// SIGKILL: no cleanup, no shutdown grace.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the same config again after a kill.
    pub async fn restart(&mut self) -> Result<(), String> {
        self.kill();
        self.spawn().await
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) -> Result<(), String> {
        let pid = self.child.as_ref().ok_or("not running")?.id();
        let ok = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .map_err(|e| e.to_string())?
            .success();
        if ok {
            Ok(())
        } else {
            Err("kill -TERM failed".into())
        }
    }

    /// Waits up to `limit` for the process to exit; `Some(clean exit)`, or `None` if it is
    /// still running.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<bool> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let child = self.child.as_mut()?;
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Some(status.success());
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }
}

/// `line` with the port 0 of its `listen:` value replaced by `port` (the host kept).
fn pin_port(line: &str, port: u16) -> String {
    let Some(at) = line.find("listen:") else {
        return line.to_string();
    };
    let value_start = at + "listen:".len();
    let rest = &line[value_start..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    let value = rest[..end].trim();
    let unquoted = value.trim_matches('"');
    match unquoted.strip_suffix(":0") {
        Some(host) => format!("{} {host}:{port}{}", &line[..value_start], &rest[end..]),
        None => line.to_string(),
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
