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
