//! The real `idemgate` binary as a child process (the library's `process::GatewayProcess`),
//! with test-friendly failures: every error panics with the gateway's log.

use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::time::Duration;

pub struct GatewayProcess {
    inner: idemgate::process::GatewayProcess,
    dir: PathBuf,
}

impl GatewayProcess {
    /// Writes `yaml` and starts `idemgate serve`; listeners on port 0 are bound by the process.
    pub async fn start(yaml: &str) -> GatewayProcess {
        GatewayProcess::start_with_env(yaml, &[]).await
    }

    /// As [`start`](Self::start), with more environment variables for the child.
    pub async fn start_with_env(yaml: &str, env: &[(&str, &str)]) -> GatewayProcess {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idemgate-proc-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let exe = crate::support::bin::idemgate();
        let inner = idemgate::process::GatewayProcess::start_with_env(exe, &dir, yaml, env)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        GatewayProcess { inner, dir }
    }

    /// Starts the same config again after a kill.
    pub async fn restart(&mut self) {
        self.inner.restart().await.unwrap_or_else(|e| panic!("{e}"));
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        self.inner.terminate().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Sends SIGHUP: reload the config file.
    pub fn hangup(&self) {
        self.signal("-HUP");
    }

    /// Sends SIGINT (what Ctrl-C in a terminal sends).
    pub fn interrupt(&self) {
        self.signal("-INT");
    }

    fn signal(&self, which: &str) {
        let pid = self.pid().expect("running");
        let sent = std::process::Command::new("kill")
            .args([which, &pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(sent, "kill {which} failed");
    }

    /// Waits for the process to exit, returning whether it exited cleanly.
    pub async fn wait_exit(&mut self, limit: Duration) -> bool {
        match self.inner.wait_exit(limit).await {
            Some(clean) => clean,
            None => panic!(
                "idemgate did not exit within {limit:?}:\n{}",
                self.inner.log_text()
            ),
        }
    }
}

impl Deref for GatewayProcess {
    type Target = idemgate::process::GatewayProcess;
    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

impl DerefMut for GatewayProcess {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.inner
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        self.inner.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
