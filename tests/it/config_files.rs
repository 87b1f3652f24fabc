//! Every file under `config/` loads, so the examples cannot drift from the code.

#[test]
fn every_example_config_loads() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut loaded = 0;
    for entry in std::fs::read_dir(&dir).expect("config/ exists") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            let text = std::fs::read_to_string(&path).unwrap();
            let env = |name: &str| match name {
                "DATABASE_URL" => Some("postgres://idemgate@localhost/idemgate".to_string()),
                "IDEMGATE_ADMIN_TOKEN" => Some("an-example-token-for-tests".to_string()),
                _ => None,
            };
            idemgate::config::Config::from_yaml_with_env(&text, &env)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            loaded += 1;
        }
    }
    assert!(loaded >= 1, "no example configs found in {}", dir.display());
}

/// `idemgate check` (the release binary) on every file under `config/` exits 0 and warns
/// about nothing: a first deployment copied from them starts clean.
#[test]
fn check_passes_every_example_config_without_a_warning() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("config/ exists") {
        let path = entry.unwrap().path();
        if !path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            continue;
        }
        let out = std::process::Command::new(crate::support::bin::idemgate())
            .args(["check", "--config"])
            .arg(&path)
            .env("DATABASE_URL", "postgres://idemgate@localhost/idemgate")
            .env("IDEMGATE_ADMIN_TOKEN", "an-example-token-for-tests")
            .output()
            .expect("running idemgate check");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{}: {text}", path.display());
        assert!(
            !text.to_lowercase().contains("warning"),
            "{}: {text}",
            path.display()
        );
        checked += 1;
    }
    assert!(checked >= 3, "the example configs were checked ({checked})");
}
