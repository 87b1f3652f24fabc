//! An `idemgate serve` child process: started from a config, killed with SIGKILL, signalled
//! with SIGTERM, restarted. The demo uses it to crash a real gateway mid-request; the
//! integration tests use it the same way.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A port that was free a moment ago (bind 127.0.0.1:0, read it, release it).
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
    /// The config file it runs with.
    pub config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl GatewayProcess {
    /// Writes `yaml` into `dir` (its `listen: 127.0.0.1:0` replaced by a free port) and
    /// starts `exe serve` on it, waiting (up to 30 s) until it accepts connections.
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
        let port = free_port().map_err(|e| format!("no free port: {e}"))?;
        let yaml = yaml.replace("listen: 127.0.0.1:0", &format!("listen: 127.0.0.1:{port}"));
        let config = dir.join(format!("gateway-{port}.yaml"));
        std::fs::write(&config, yaml).map_err(|e| format!("writing {}: {e}", config.display()))?;
        let mut p = GatewayProcess {
            exe: exe.to_path_buf(),
            log_filter: log_filter.to_string(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            log: dir.join(format!("gateway-{port}.log")),
            config,
            child: None,
        };
        p.spawn().await?;
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
        while tokio::net::TcpStream::connect(self.addr).await.is_err() {
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

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
