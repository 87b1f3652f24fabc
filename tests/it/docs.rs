//! The docs name real tests: every `module::test_name` in docs/guarantees.md is a test
//! function in that module's file (`tests/it/<module>.rs`, or `src/<module>.rs` for unit
//! tests), so a renamed or moved test cannot leave a guarantee pointing at nothing. And
//! the modules of `src/` import each other without cycles.

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
        root.join("src").join(module).join("tests.rs"),
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
        let mut files = candidates(root, module);
        // `forward::h1::tests::x` in src/forward/h1.rs.
        if parts.len() >= 3 && parts[1] != "tests" {
            files.push(
                root.join("src")
                    .join(module)
                    .join(format!("{}.rs", parts[1])),
            );
        }
        let found = files.iter().any(|file| {
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

/// The top-level modules of `src/` each file belongs to, and the top-level modules it names
/// as `crate::<module>` outside comments and its unit tests (a `mod tests` at the end of a
/// file, or a file of its own named `tests.rs`).
fn module_imports(
    root: &Path,
) -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs")
                && path.file_name().is_some_and(|n| n != "tests.rs")
            {
                out.push(path);
            }
        }
    }
    let src = root.join("src");
    let mut files = Vec::new();
    walk(&src, &mut files);
    let mut graph = std::collections::BTreeMap::<String, std::collections::BTreeSet<String>>::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        let code = text
            .split("#[cfg(test)]\nmod tests")
            .next()
            .unwrap()
            .split("#[cfg(test)]\npub(crate) mod tests")
            .next()
            .unwrap();
        let deps = graph.entry(top.clone()).or_default();
        for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for (i, _) in line.match_indices("crate::") {
                let name: String = line[i + "crate::".len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != top {
                    deps.insert(name);
                }
            }
        }
    }
    graph
}

/// A newcomer can read the modules bottom-up: no module of `src/` imports, directly or
/// through others, a module that imports it.
#[test]
fn no_import_cycle_among_the_modules_of_src() {
    let graph = module_imports(Path::new(env!("CARGO_MANIFEST_DIR")));
    assert!(graph.len() > 20, "the modules were found: {graph:?}");
    assert!(
        graph["gateway"].contains("store"),
        "imports are read: {:?}",
        graph["gateway"]
    );
    // Depth-first search from every module; a module met again on the current path closes
    // a cycle.
    fn visit<'a>(
        graph: &'a std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
        module: &'a str,
        path: &mut Vec<&'a str>,
        done: &mut std::collections::BTreeSet<&'a str>,
        cycles: &mut Vec<String>,
    ) {
        if let Some(at) = path.iter().position(|m| *m == module) {
            cycles.push(format!("{} -> {module}", path[at..].join(" -> ")));
            return;
        }
        if !done.insert(module) {
            return;
        }
        path.push(module);
        for dep in graph.get(module).into_iter().flatten() {
            if graph.contains_key(dep.as_str()) {
                visit(graph, dep, path, done, cycles);
            }
        }
        path.pop();
    }
    let mut cycles = Vec::new();
    let mut done = std::collections::BTreeSet::new();
    for module in graph.keys() {
        visit(&graph, module, &mut Vec::new(), &mut done, &mut cycles);
    }
    assert!(cycles.is_empty(), "import cycles: {cycles:#?}");
}
