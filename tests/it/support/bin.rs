//! The release binary that every test about the process runs (signals, drains, logs, probes,
//! the CLI): what a user runs, not the debug build the tests themselves are compiled in.
//!
//! It is built by `cargo build --release --bin idemgate` once per test run (a no-op when it is
//! fresh), under a file lock so that concurrent test processes of one `cargo nextest run`
//! build it once and never run a binary that is being written. A run is nextest's
//! `NEXTEST_RUN_ID`, or this process under `cargo test`. The README's test command builds it
//! first, so the build inside a test is the no-op and never counts against a test's time limit.
//!
//! `IDEMGATE_TEST_BIN=PATH` runs those tests on another build of the same source instead (the
//! profile-guided one, `scripts/build-pgo.sh`), and builds nothing.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Path of the fresh release binary.
pub fn idemgate() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(build)
}

fn build() -> PathBuf {
    if let Some(given) = std::env::var_os("IDEMGATE_TEST_BIN") {
        let given = PathBuf::from(given);
        assert!(
            given.is_file(),
            "IDEMGATE_TEST_BIN names no file: {}",
            given.display()
        );
        return std::path::absolute(&given).expect("an absolute path for IDEMGATE_TEST_BIN");
    }
    // target/debug/idemgate -> target/
    let target = Path::new(env!("CARGO_BIN_EXE_idemgate"))
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lives in a target directory");
    let bin = target.join("release").join("idemgate");
    let lock = File::create(target.join("idemgate-tests-release.lock"))
        .expect("creating the release build's lock file");
    lock.lock().expect("locking the release build");
    let run = std::env::var("NEXTEST_RUN_ID")
        .unwrap_or_else(|_| format!("process-{}", std::process::id()));
    let marker = target.join("idemgate-tests-release.run");
    if bin.exists() && std::fs::read_to_string(&marker).is_ok_and(|m| m == run) {
        return bin;
    }
    let mut cargo = Command::new(env!("CARGO"));
    // What cargo or nextest set for this test (the package's identity, `OUT_DIR`) is not the
    // environment of a build: build scripts that watch such a variable (ring's watches
    // `CARGO_MANIFEST_DIR`) would otherwise rebuild, and the next plain `cargo build
    // --release` would rebuild them back.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let set_for_tests = [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
        ]
        .iter()
        .any(|p| name.starts_with(p))
            || [
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "CARGO_RUSTC_CURRENT_DIR",
                "OUT_DIR",
            ]
            .contains(&name.as_ref());
        if set_for_tests {
            cargo.env_remove(name.as_ref());
        }
    }
    let out = cargo
        .args(["build", "--release", "--bin", "idemgate", "--manifest-path"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .arg("--target-dir")
        .arg(target)
        .output()
        .expect("running cargo build --release");
    assert!(
        out.status.success(),
        "cargo build --release --bin idemgate failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(bin.exists(), "cargo built no {}", bin.display());
    std::fs::write(&marker, &run).expect("writing the release build's marker");
    bin
}
