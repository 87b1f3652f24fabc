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
        // `forward::h1::tests::x` in src/forward/h1.rs, `store::sqlite::tests::x` in
        // src/store/sqlite.rs or src/store/sqlite/tests.rs.
        let modules: Vec<&str> = parts[..parts.len() - 1]
            .iter()
            .copied()
            .filter(|p| *p != "tests")
            .collect();
        let dir = modules
            .iter()
            .fold(root.join("src"), |path, part| path.join(part));
        files.push(dir.with_extension("rs"));
        files.push(dir.join("mod.rs"));
        files.push(dir.join("tests.rs"));
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
fn module_imports(root: &Path) -> Graph {
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
    let mut graph = Graph::new();
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

/// An import graph: each module (or file) and the ones it imports.
type Graph = std::collections::BTreeMap<String, std::collections::BTreeSet<String>>;

/// The cycles of `graph`, each as `a -> b -> a`: a depth-first search from every node, where
/// a node met again on the current path closes a cycle.
fn cycles(graph: &Graph) -> Vec<String> {
    fn visit<'a>(
        graph: &'a Graph,
        node: &'a str,
        path: &mut Vec<&'a str>,
        done: &mut std::collections::BTreeSet<&'a str>,
        found: &mut Vec<String>,
    ) {
        if let Some(at) = path.iter().position(|m| *m == node) {
            found.push(format!("{} -> {node}", path[at..].join(" -> ")));
            return;
        }
        if !done.insert(node) {
            return;
        }
        path.push(node);
        for dep in graph.get(node).into_iter().flatten() {
            if graph.contains_key(dep.as_str()) {
                visit(graph, dep, path, done, found);
            }
        }
        path.pop();
    }
    let mut found = Vec::new();
    let mut done = std::collections::BTreeSet::new();
    for node in graph.keys() {
        visit(graph, node, &mut Vec::new(), &mut done, &mut found);
    }
    found
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
    let cycles = cycles(&graph);
    assert!(cycles.is_empty(), "import cycles: {cycles:#?}");
}

/// The code of a source file without its comments and its unit tests.
fn code_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let code = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap()
        .split("#[cfg(test)]\npub(crate) mod tests")
        .next()
        .unwrap();
    code.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Inside every folder of `src/`, the files (and the folder's root, `mod.rs` or
/// `<folder>.rs`, as `mod`) and which of them each one imports: a child naming
/// `super::<sibling>` imports that sibling, any other `super::` item is the root's; the root
/// naming `<child>::` imports that child.
fn folder_imports(root: &Path) -> Vec<(String, Graph)> {
    fn folders(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            if entry.path().is_dir() {
                out.push(entry.path());
                folders(&entry.path(), out);
            }
        }
    }
    let src = root.join("src");
    let mut dirs = Vec::new();
    folders(&src, &mut dirs);
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut all = Vec::new();
    for dir in dirs {
        let mut kids = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if path.is_dir() {
                kids.push((name, path.join("mod.rs")));
            } else if let Some(stem) = name.strip_suffix(".rs")
                && stem != "mod"
                && stem != "tests"
            {
                kids.push((stem.to_string(), path));
            }
        }
        let root_file = if dir.join("mod.rs").exists() {
            dir.join("mod.rs")
        } else {
            dir.with_extension("rs")
        };
        let names: std::collections::BTreeSet<String> =
            kids.iter().map(|(k, _)| k.clone()).collect();
        let mut graph =
            std::collections::BTreeMap::<String, std::collections::BTreeSet<String>>::new();
        graph.entry("mod".into()).or_default();
        for (kid, file) in &kids {
            let deps = graph.entry(kid.clone()).or_default();
            if !file.exists() {
                continue;
            }
            let code = code_of(file);
            for (i, _) in code.match_indices("super::") {
                let rest = &code[i + "super::".len()..];
                let items: Vec<String> = match rest.strip_prefix('{') {
                    Some(list) => list
                        .split('}')
                        .next()
                        .unwrap()
                        .split(',')
                        .map(|s| ident(s.trim()))
                        .collect(),
                    None => vec![ident(rest)],
                };
                for item in items.into_iter().filter(|s| !s.is_empty() && s != "super") {
                    if names.contains(&item) {
                        if &item != kid {
                            deps.insert(item);
                        }
                    } else {
                        deps.insert("mod".into());
                    }
                }
            }
        }
        let code = code_of(&root_file);
        for kid in &names {
            let pattern = format!("{kid}::");
            let used = code.match_indices(&pattern).any(|(i, _)| {
                i == 0 || {
                    let before = code.as_bytes()[i - 1];
                    !(before.is_ascii_alphanumeric() || before == b'_' || before == b':')
                }
            });
            if used {
                graph.get_mut("mod").unwrap().insert(kid.clone());
            }
        }
        let rel = dir
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .to_string();
        all.push((rel, graph));
    }
    all
}

/// Inside a folder too, files can be read bottom-up: no file imports, directly or through
/// its siblings, a file that imports it (the folder's root counts as one of them).
#[test]
fn no_import_cycle_inside_a_folder_of_src() {
    let folders = folder_imports(Path::new(env!("CARGO_MANIFEST_DIR")));
    assert!(folders.len() >= 5, "the folders were found: {folders:?}");
    let store = folders
        .iter()
        .find(|(f, _)| f == "store/postgres")
        .expect("store/postgres is a folder");
    assert!(
        store.1["mod"].contains("session"),
        "imports are read: {:?}",
        store.1
    );
    let mut found = Vec::new();
    for (folder, graph) in &folders {
        found.extend(
            cycles(graph)
                .into_iter()
                .map(|c| format!("src/{folder}: {c}")),
        );
    }
    assert!(found.is_empty(), "import cycles inside folders: {found:#?}");
}
