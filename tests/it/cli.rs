//! The real binary: `check` exit codes, and `serve` refusing a bad config before binding.

use crate::support::Patch;
use std::process::Command;

fn idemgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_idemgate"))
}

fn example() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/gateway.example.yaml")
}

#[test]
fn check_accepts_the_example_and_prints_its_routes() {
    let out = idemgate()
        .args(["check", "--config"])
        .arg(example())
        .env("DATABASE_URL", "postgres://u@localhost/db")
        .env("IDEMGATE_ADMIN_TOKEN", "an-example-token-for-tests")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout} {stderr}");
    assert!(
        !stderr.contains("warning"),
        "the example draws no warning: {stderr}"
    );
    assert!(
        stdout
            .contains("route[0] payment-webhooks: path /webhooks/payments methods POST -> ledger"),
        "{stdout}"
    );
    assert!(
        stdout.contains("  idempotency: mode enforce methods POST,PATCH"),
        "{stdout}"
    );
    assert!(
        stdout.contains("server shutdown: drain_delay 0s then shutdown_grace 35s"),
        "{stdout}"
    );
    // Values as the YAML spells them, never as Rust's Debug prints them (`Wait`, `Some(..)`).
    for spelled in [
        "store  postgres (pool 16, acquire 500ms, statement 2s, tls disable)",
        "max_header_bytes 64KiB max_buffered_bytes 256MiB",
        "replay_cache max_bytes 64MiB",
        "  ttl 24h lease 45s in_flight wait wait_timeout 10s on_unknown_outcome reforward \
         on_store_error reject",
        "  max_request_body 1MiB max_stored_response 1MiB",
    ] {
        assert!(stdout.contains(spelled), "'{spelled}' in:\n{stdout}");
    }
    for debug in ["Disable", "Wait", "Reforward", "Reject", "Some("] {
        assert!(!stdout.contains(debug), "'{debug}' in:\n{stdout}");
    }
    assert!(
        !stdout.contains("postgres://"),
        "the database URL (a secret) is not printed"
    );
}

#[test]
fn a_bad_config_exits_64_naming_the_yaml_path() {
    let dir = std::env::temp_dir().join(format!("idemgate-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    let text = std::fs::read_to_string(example())
        .unwrap()
        .patch("lease: 45s", "lease: 30s");
    std::fs::write(&bad, text).unwrap();
    for verb in ["check", "serve"] {
        let out = idemgate()
            .args([verb, "--config"])
            .arg(&bad)
            .env("DATABASE_URL", "postgres://u@localhost/db")
            .env("IDEMGATE_ADMIN_TOKEN", "an-example-token-for-tests")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{verb}: {stderr}");
        assert!(
            stderr.contains(
                "routes[0].idempotency.lease: must be longer than upstream 'ledger' timeout (30s)"
            ),
            "{verb}: {stderr}"
        );
    }
    let out = idemgate()
        .args(["check", "--config"])
        .arg(example())
        .env_remove("DATABASE_URL")
        .env("IDEMGATE_ADMIN_TOKEN", "an-example-token-for-tests")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("environment variable DATABASE_URL is not set")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_demo_passes_every_check_on_postgres_too() {
    let db = crate::support::pg::fresh_database().await;
    let out = tokio::task::spawn_blocking(move || {
        idemgate().args(["demo", "--store", &db]).output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("every check passes through idemgate"),
        "{stdout}"
    );
    assert_eq!(
        stdout.matches("  pass  ").count(),
        8 + 1,
        "8 through idemgate, 1 straight:\n{stdout}"
    );
}
