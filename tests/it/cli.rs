//! The real binary: `check` exit codes, and `serve` refusing a bad config before binding.

use crate::support::Patch;
use std::process::Command;

fn idemgate() -> Command {
    Command::new(crate::support::bin::idemgate())
}

fn example() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/gateway.example.yaml")
}

/// Every field the config reader knows (`src/config/raw.rs`) appears in the example that
/// says it documents every field, and in the configuration reference: a field added to the
/// code and not to them fails here.
#[test]
fn the_example_and_the_reference_name_every_field() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let raw = std::fs::read_to_string(root.join("src/config/raw.rs")).unwrap();
    let example = std::fs::read_to_string(example()).unwrap();
    let reference = std::fs::read_to_string(root.join("docs/configuration.md")).unwrap();
    // Accepted and no longer read: documented as retired, not shown.
    const RETIRED: [&str; 1] = ["yield_on_wake"];
    let mut fields: Vec<&str> = raw
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub(super) "))
        .filter_map(|l| l.split_once(':').map(|(name, _)| name))
        .filter(|name| {
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c == '_' || c.is_ascii_digit())
        })
        .map(|name| if name == "matcher" { "match" } else { name })
        .filter(|name| !RETIRED.contains(name))
        .collect();
    fields.sort_unstable();
    fields.dedup();
    assert!(fields.len() > 60, "the fields were read: {fields:?}");
    let named = |text: &str, name: &str| {
        text.match_indices(name).any(|(at, _)| {
            let before = text[..at].chars().next_back();
            let after = text[at + name.len()..].chars().next();
            let word = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
            !word(before) && !word(after)
        })
    };
    let missing: Vec<&str> = fields
        .iter()
        .copied()
        .filter(|name| !named(&example, &format!("{name}:")))
        .collect();
    assert!(missing.is_empty(), "not in the example: {missing:?}");
    let missing: Vec<&str> = fields
        .iter()
        .copied()
        .filter(|name| !named(&reference, name))
        .collect();
    assert!(
        missing.is_empty(),
        "not in docs/configuration.md: {missing:?}"
    );
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
        .patch("lease: 50s", "lease: 30s");
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

/// A `ttl` equal to the lease would let a crashed attempt's row expire with its lease, and
/// the retry after it run uncounted: refused, on the release binary.
#[test]
fn a_ttl_not_longer_than_the_lease_exits_64() {
    let dir = std::env::temp_dir().join(format!("idemgate-cli-ttl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    let text = std::fs::read_to_string(example()).unwrap();
    let text = text.patch("ttl: 24h", "ttl: 50s");
    std::fs::write(&bad, text).unwrap();
    let out = idemgate()
        .args(["check", "--config"])
        .arg(&bad)
        .env("DATABASE_URL", "postgres://u@localhost/db")
        .env("IDEMGATE_ADMIN_TOKEN", "an-example-token-for-tests")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("routes[0].idempotency.ttl: must be longer than the lease (50s)"),
        "{stderr}"
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

/// Runs `idemgate <args>` with `--config` set to `yaml` written to a file, until it exits
/// (failing the test after `limit`): its exit code, stdout and stderr.
async fn run_with_config(
    args: &[&str],
    yaml: &str,
    limit: std::time::Duration,
) -> (Option<i32>, String, String) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "idemgate-cli-run-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("gateway.yaml");
    std::fs::write(&config, yaml).unwrap();
    let (out, err) = (dir.join("out.log"), dir.join("err.log"));
    let mut child = idemgate()
        .args(args)
        .arg("--config")
        .arg(&config)
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("starting idemgate");
    let deadline = tokio::time::Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if tokio::time::Instant::now() >= deadline {
            child.kill().ok();
            child.wait().ok();
            panic!("idemgate {args:?} still running after {limit:?}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let (stdout, stderr) = (
        std::fs::read_to_string(&out).unwrap(),
        std::fs::read_to_string(&err).unwrap(),
    );
    std::fs::remove_dir_all(&dir).ok();
    (status.code(), stdout, stderr)
}

/// `idemgate migrate` on a fresh database applies every migration and exits 0; run again,
/// it applies none and still exits 0; with the database unreachable it exits 1 saying so,
/// within its connect bound.
#[tokio::test]
async fn migrate_applies_the_migrations_once_and_fails_cleanly_without_a_database() {
    use idemgate::store::postgres::MIGRATIONS;
    use std::time::Duration;

    let db = crate::support::pg::fresh_database().await;
    let yaml = crate::support::config_yaml(&db, "http://127.0.0.1:9", "");
    let conn = crate::support::sql(&db).await;
    let keys_table = async || -> bool {
        conn.query_one("SELECT to_regclass('idemgate_keys') IS NOT NULL", &[])
            .await
            .unwrap()
            .get(0)
    };
    assert!(!keys_table().await, "the database starts empty");

    let (code, stdout, stderr) =
        run_with_config(&["migrate"], &yaml, Duration::from_secs(30)).await;
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("applied {} migration(s)", MIGRATIONS.len())),
        "{stdout}"
    );
    let versions = async || -> Vec<i32> {
        conn.query(
            "SELECT version FROM idemgate_migrations ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
    };
    let expected: Vec<i32> = MIGRATIONS.iter().map(|m| m.0).collect();
    assert_eq!(versions().await, expected);
    assert!(keys_table().await, "idemgate_keys exists");

    let (code, stdout, stderr) =
        run_with_config(&["migrate"], &yaml, Duration::from_secs(30)).await;
    assert_eq!(code, Some(0), "a second run succeeds: {stdout}\n{stderr}");
    assert!(stdout.contains("applied 0 migration(s)"), "{stdout}");
    assert_eq!(versions().await, expected, "and changes nothing");

    // The store refuses connections: an error naming the failure, exit 1, no hang (the
    // store's connect_timeout is 1s, acquire_timeout 500ms; 20 s is a hang check).
    let (_refusing, port) = crate::support::refused_port();
    let down = crate::support::config_yaml(
        &format!("postgres://postgres@127.0.0.1:{port}/none"),
        "http://127.0.0.1:9",
        "",
    );
    let (code, stdout, stderr) =
        run_with_config(&["migrate"], &down, Duration::from_secs(20)).await;
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.starts_with("idemgate: ") && stderr.contains("cannot connect to the database"),
        "a message: {stderr}"
    );
    assert!(!stdout.contains("applied"), "{stdout}");
}

/// Runs `idemgate check` on `yaml`; its exit code and everything it wrote.
fn check_text(name: &str, yaml: &str) -> (Option<i32>, String) {
    let dir = std::env::temp_dir().join(format!("idemgate-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("config.yaml");
    std::fs::write(&file, yaml).unwrap();
    let out = idemgate()
        .args(["check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// A config with `routes` (YAML) on the embedded store and one upstream.
fn with_routes(routes: &str) -> String {
    format!(
        "store: {{ sqlite: {{ path: /tmp/idemgate-unused.db }} }}\n\
         upstreams: {{ app: {{ url: \"http://127.0.0.1:9\", timeout: 20s }} }}\n\
         routes:\n{routes}"
    )
}

const KEYED: &str = "  - name: payments\n    match: { path_prefix: /payments, methods: [POST] }\n    upstream: app\n    idempotency: { key: [ { header: Idempotency-Key } ] }\n";

/// Configs that leave a keyed route unable to key anything exit 64 naming the routes or the
/// field: a catch-all above it, methods that never meet, a misspelled method. A route that
/// takes only part of a keyed route's paths is a warning naming the path.
#[test]
fn a_keyed_route_that_can_never_key_a_request_is_refused() {
    let catch_all = "  - name: everything\n    match: { path_prefix: / }\n    upstream: app\n";
    let (code, text) = check_text("shadowed", &with_routes(&format!("{catch_all}{KEYED}")));
    assert_eq!(code, Some(64), "{text}");
    assert!(
        text.contains("routes[1].match")
            && text.contains("'payments'")
            && text.contains("'everything'"),
        "{text}"
    );
    // Two earlier routes that together take every method of it.
    let split = "  - name: posts\n    match: { path_prefix: /, methods: [POST] }\n    upstream: app\n  - name: patches\n    match: { path_prefix: /payments, methods: [PATCH] }\n    upstream: app\n";
    let both = KEYED.replace("methods: [POST]", "methods: [POST, PATCH]");
    let (code, text) = check_text("split", &with_routes(&format!("{split}{both}")));
    assert_eq!(code, Some(64), "{text}");
    assert!(
        text.contains("'posts'") && text.contains("'patches'"),
        "{text}"
    );

    let never = KEYED.replace("idempotency: {", "idempotency: { methods: [PUT],");
    let (code, text) = check_text("methods", &with_routes(&never));
    assert_eq!(code, Some(64), "{text}");
    assert!(
        text.contains("routes[0].idempotency.methods") && text.contains("shares no method"),
        "{text}"
    );

    let typo = KEYED.replace("methods: [POST]", "methods: [PSOT]");
    let (code, text) = check_text("typo", &with_routes(&typo));
    assert_eq!(code, Some(64), "{text}");
    assert!(
        text.contains("routes[0].match.methods[0]")
            && text.contains("'PSOT' is not a standard method"),
        "{text}"
    );
    let listed = format!(
        "extra_methods: [PSOT]\n{}",
        with_routes(&KEYED.replace("methods: [POST]", "methods: [PSOT, POST]"))
    );
    let (code, text) = check_text("listed", &listed);
    assert_eq!(code, Some(0), "{text}");

    let part =
        "  - name: refunds\n    match: { path_prefix: /payments/refunds }\n    upstream: app\n";
    let (code, text) = check_text("partial", &with_routes(&format!("{part}{KEYED}")));
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("warning")
            && text.contains("/payments/refunds")
            && text.contains("'payments'"),
        "{text}"
    );
    // The same routes in the right order: clean.
    let (code, text) = check_text("ordered", &with_routes(&format!("{KEYED}{catch_all}")));
    assert_eq!(code, Some(0), "{text}");
    assert!(!text.contains("warning"), "{text}");
}

/// A connection string's `sslmode` means what it says: `require` against a server without
/// TLS fails (it never falls back to plaintext), and a `tls` block that contradicts it is
/// refused naming both.
#[tokio::test]
async fn a_urls_sslmode_is_honoured_and_a_contradicting_tls_block_refused() {
    use std::time::Duration;
    let db = crate::support::pg::fresh_database().await;
    let yaml =
        crate::support::config_yaml(&format!("{db}?sslmode=require"), "http://127.0.0.1:9", "");
    let (code, stdout, stderr) =
        run_with_config(&["migrate"], &yaml, Duration::from_secs(30)).await;
    assert_ne!(code, Some(0), "migrated in plaintext: {stdout}\n{stderr}");
    assert!(
        stderr.to_lowercase().contains("tls") || stderr.contains("ssl"),
        "{stderr}"
    );
    let conn = crate::support::sql(&db).await;
    let migrated: bool = conn
        .query_one("SELECT to_regclass('idemgate_keys') IS NOT NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!migrated, "nothing was written over plaintext");

    let contradicting = yaml.replace(
        "statement_timeout: 1s }",
        "statement_timeout: 1s, tls: { mode: disable } }",
    );
    assert_ne!(contradicting, yaml, "the tls block was added");
    let (code, text) = check_text("sslmode", &contradicting);
    assert_eq!(code, Some(64), "{text}");
    // The path once, then what is wrong.
    assert!(
        text.contains(
            "store.postgres.url: sslmode=require contradicts store.postgres.tls.mode: disable;"
        ),
        "{text}"
    );
}
