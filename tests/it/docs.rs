//! The docs name real tests: every `module::test_name` in docs/guarantees.md is a test
//! function in that module's file (`tests/it/<module>.rs`, or `src/<module>.rs` for unit
//! tests), so a renamed or moved test cannot leave a guarantee pointing at nothing.

use std::path::Path;

/// The files a test path may live in: `holes::x` in tests/it/holes.rs, `path::tests::x` in
/// src/path.rs, `config::tests::x` in src/config/mod.rs, `conformance::postgres::x` in
/// tests/it/conformance.rs.
fn candidates(root: &Path, module: &str) -> Vec<std::path::PathBuf> {
    vec![
        root.join("tests/it").join(format!("{module}.rs")),
        root.join("src").join(format!("{module}.rs")),
        root.join("src").join(module).join("mod.rs"),
        root.join("src/store").join(format!("{module}.rs")),
    ]
}

#[test]
fn every_test_named_in_the_guarantees_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("docs/guarantees.md")).unwrap();
    let mut checked = 0;
    let mut missing = Vec::new();
    for quoted in text.split('`').skip(1).step_by(2) {
        let parts: Vec<&str> = quoted.split("::").collect();
        let is_path = parts.len() >= 2
            && parts.iter().all(|p| {
                !p.is_empty()
                    && p.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            });
        if !is_path {
            continue;
        }
        let (module, name) = (parts[0], parts[parts.len() - 1]);
        let found = candidates(root, module).iter().any(|file| {
            std::fs::read_to_string(file).is_ok_and(|src| src.contains(&format!("fn {name}(")))
        });
        if !found {
            missing.push(quoted.to_string());
        }
        checked += 1;
    }
    assert!(
        checked >= 40,
        "only {checked} test names found: is the format still `module::name`?"
    );
    assert!(
        missing.is_empty(),
        "docs/guarantees.md names tests that do not exist: {missing:?}"
    );
}
