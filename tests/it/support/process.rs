//! The real `idemgate` binary as a child process, for tests that kill it or signal it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::pg::free_port;

pub struct GatewayProcess {
    pub addr: SocketAddr,
    pub config: PathBuf,
    child: Option<Child>,
    log: PathBuf,
}

impl GatewayProcess {
    /// Writes `yaml` (its `listen` replaced by a free port) and starts `idemgate serve`,
    /// waiting until it accepts connections.
    pub async fn start(yaml: &str) -> GatewayProcess {
        let port = free_port();
        let yaml = yaml.replace("listen: 127.0.0.1:0", &format!("listen: 127.0.0.1:{port}"));
        let dir = std::env::temp_dir();
        let config = dir.join(format!("idemgate-proc-{}-{port}.yaml", std::process::id()));
        std::fs::write(&config, yaml).unwrap();
        let mut p = GatewayProcess {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            log: dir.join(format!("idemgate-proc-{}-{port}.log", std::process::id())),
            config,
            child: None,
        };
        p.spawn().await;
        p
    }

    async fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(["serve", "--config"])
            .arg(&self.config)
            .env("RUST_LOG", "idemgate=debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawning idemgate");
        self.child = Some(child);
        let addr = self.addr;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "idemgate exited with {status} at start:\n{}",
                    self.log_text()
                );
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "idemgate did not start:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL: no cleanup, no shutdown grace.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL");
            child.wait().expect("reaping the killed gateway");
        }
    }

    /// Starts the same config again after a kill.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "kill it first");
        self.spawn().await;
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let pid = self.child.as_ref().expect("running").id();
        let ok = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("kill -TERM")
            .success();
        assert!(ok, "kill -TERM failed");
    }

    /// Waits for the process to exit (up to `limit`), returning whether it exited cleanly.
    pub async fn wait_exit(&mut self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let child = self.child.as_mut().expect("running");
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                return status.success();
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "idemgate did not exit within {limit:?}:\n{}",
                    self.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
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
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(&self.config);
        let _ = std::fs::remove_file(&self.log);
    }
}
