//! The container image's build stage, replayed without a Docker engine.
//!
//! `docker build` runs the build stage's lines in order inside `WORKDIR`: each `COPY` puts
//! files of the build context (less `.dockerignore`) there, each `RUN` runs a command there.
//! This test does the same on this machine. It parses the `Dockerfile`, finds the stage the
//! final image copies its binary from, and replays that stage line by line into a scratch
//! directory standing for its `WORKDIR`: a `COPY` copies exactly the context files the line
//! names (keeping their modification times, as Docker does, so a stage that forgets to make
//! cargo rebuild its stand-in sources ships the stand-in, and this test sees it); a `RUN`
//! runs verbatim under `sh -c`. Then every file another stage copies out of it must exist,
//! and the binary must be the real one (`--version`), and the `HEALTHCHECK` command must be
//! one the binary accepts.
//!
//! What differs from `docker build`, and why it does not hide what this test is for (a
//! stage that lacks a file it needs, like a manifest whose targets are missing):
//!
//! - The base image is not pulled: the stage runs on this machine's toolchain and shell.
//! - Cargo runs offline (`CARGO_NET_OFFLINE`), from the local registry cache: CI runs
//!   `cargo fetch --locked` once before the tests, and so must a developer on a fresh
//!   machine. Offline or not, cargo reads the same manifest and lock file.
//! - The release profile is compiled at opt-level 0 (`CARGO_PROFILE_RELEASE_OPT_LEVEL`),
//!   without link-time optimization and with cargo's default codegen units, so
//!   the replay costs about what a debug build does (a minute and a half from scratch on two
//!   cores, half a minute once the dependencies are built) instead of several minutes for
//!   an optimized one; which files a stage needs does not depend on optimization.
//! - The stage's `target/` persists between runs (as a cache mount would), under this
//!   build's own target directory, so a second run only rebuilds the crate. The commands run
//!   at the lowest CPU priority, so the other tests keep their timing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One instruction of a Dockerfile, with the line it starts on.
#[derive(Debug, Clone)]
struct Instruction {
    line: usize,
    keyword: String,
    args: String,
}

/// The instructions of one stage, `FROM` excluded.
#[derive(Debug)]
struct Stage {
    name: Option<String>,
    instructions: Vec<Instruction>,
}

/// Splits a Dockerfile into stages: joins `\` continuations, drops comments and blank lines.
fn parse(text: &str) -> Vec<Stage> {
    let mut instructions = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_none()) {
            continue;
        }
        let (start, mut joined) = current.take().unwrap_or((i + 1, String::new()));
        let (body, continues) = match trimmed.strip_suffix('\\') {
            Some(body) => (body, true),
            None => (trimmed, false),
        };
        if !joined.is_empty() {
            joined.push(' ');
        }
        joined.push_str(body.trim());
        if continues {
            current = Some((start, joined));
        } else {
            let (keyword, args) = joined
                .split_once(char::is_whitespace)
                .unwrap_or((&joined, ""));
            instructions.push(Instruction {
                line: start,
                keyword: keyword.to_ascii_uppercase(),
                args: args.trim().to_string(),
            });
        }
    }
    assert!(
        current.is_none(),
        "the Dockerfile ends inside a continued line"
    );
    let mut stages: Vec<Stage> = Vec::new();
    for ins in instructions {
        if ins.keyword == "FROM" {
            let words: Vec<&str> = ins.args.split_whitespace().collect();
            let name = match words.as_slice() {
                [.., as_kw, name] if as_kw.eq_ignore_ascii_case("as") => Some(name.to_string()),
                _ => None,
            };
            stages.push(Stage {
                name,
                instructions: Vec::new(),
            });
        } else {
            stages
                .last_mut()
                .unwrap_or_else(|| panic!("line {}: {} before any FROM", ins.line, ins.keyword))
                .instructions
                .push(ins);
        }
    }
    stages
}

/// The leading `--flag=value` options of a line, and the rest.
fn split_flags(args: &str) -> (HashMap<String, String>, &str) {
    let mut flags = HashMap::new();
    let mut rest = args.trim();
    while let Some(flag) = rest.strip_prefix("--") {
        let (word, tail) = flag.split_once(char::is_whitespace).unwrap_or((flag, ""));
        let (k, v) = word.split_once('=').unwrap_or((word, ""));
        flags.insert(k.to_string(), v.to_string());
        rest = tail.trim_start();
    }
    (flags, rest)
}

/// The strings of an exec-form (JSON array) line, or the words of a shell-form one.
fn words(rest: &str) -> Vec<String> {
    if rest.starts_with('[') {
        serde_json::from_str(rest).unwrap_or_else(|e| panic!("exec form {rest}: {e}"))
    } else {
        rest.split_whitespace().map(str::to_string).collect()
    }
}

/// `.dockerignore` as Docker reads it, for the patterns this repository uses: one path per
/// line, relative to the context, `*` and `?` within a segment; a pattern excludes the path
/// it names and everything under it. Anything else is refused rather than guessed.
struct Ignore(Vec<Vec<String>>);

impl Ignore {
    fn load(context: &Path) -> Ignore {
        let text = std::fs::read_to_string(context.join(".dockerignore")).unwrap_or_default();
        let patterns = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| {
                assert!(
                    !l.starts_with('!') && !l.contains("**") && !l.contains('['),
                    ".dockerignore pattern {l:?}: this replay does not know that syntax"
                );
                l.trim_start_matches('/')
                    .trim_end_matches('/')
                    .split('/')
                    .map(str::to_string)
                    .collect()
            })
            .collect();
        Ignore(patterns)
    }

    /// `rel` is relative to the context, `/`-separated.
    fn excludes(&self, rel: &str) -> bool {
        let segments: Vec<&str> = rel.split('/').collect();
        self.0
            .iter()
            .any(|p| p.len() <= segments.len() && p.iter().zip(&segments).all(|(p, s)| glob(p, s)))
    }
}

/// `*` (any run of characters) and `?` (one character) within one path segment.
fn glob(pattern: &str, s: &str) -> bool {
    fn go(p: &[char], s: &[char]) -> bool {
        match p.split_first() {
            None => s.is_empty(),
            Some(('*', rest)) => (0..=s.len()).any(|i| go(rest, &s[i..])),
            Some(('?', rest)) => !s.is_empty() && go(rest, &s[1..]),
            Some((c, rest)) => s.first() == Some(c) && go(rest, &s[1..]),
        }
    }
    let p: Vec<char> = pattern.chars().collect();
    let s: Vec<char> = s.chars().collect();
    go(&p, &s)
}

/// Copies one file, keeping its modification time (Docker's `COPY` does).
fn copy_file(from: &Path, to: &Path) {
    if let Some(parent) = to.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("{} -> {}: {e}", from.display(), to.display()));
    let modified = std::fs::metadata(from).unwrap().modified().unwrap();
    std::fs::File::options()
        .write(true)
        .open(to)
        .unwrap()
        .set_modified(modified)
        .unwrap();
}

/// Copies the context path `rel` (a file, or a directory's contents) to `to`, skipping what
/// `.dockerignore` excludes. Returns the number of files copied.
fn copy_tree(context: &Path, rel: &str, to: &Path, ignore: &Ignore) -> usize {
    if ignore.excludes(rel) {
        return 0;
    }
    let from = context.join(rel);
    let meta = std::fs::metadata(&from)
        .unwrap_or_else(|e| panic!("COPY {rel}: not in the build context ({e})"));
    if meta.is_file() {
        copy_file(&from, to);
        return 1;
    }
    std::fs::create_dir_all(to).unwrap();
    let mut n = 0;
    for entry in std::fs::read_dir(&from).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        n += copy_tree(context, &format!("{rel}/{name}"), &to.join(&name), ignore);
    }
    n
}

/// A context path as Docker cleans it: relative, `/`-separated, no `.` segments.
fn clean(rel: &str) -> String {
    let parts: Vec<&str> = rel
        .split('/')
        .filter(|s| !s.is_empty() && *s != ".")
        .collect();
    assert!(
        !parts.contains(&".."),
        "COPY {rel}: outside the build context"
    );
    parts.join("/")
}

/// Where an image path of the stage lands in the replay: `WORKDIR` maps to `workdir`.
fn in_replay(image_path: &str, image_workdir: &str, workdir: &Path) -> PathBuf {
    let rel = match image_path.strip_prefix('/') {
        Some(_) => image_path
            .strip_prefix(image_workdir)
            .and_then(|r| r.strip_prefix('/').or((r.is_empty()).then_some("")))
            .unwrap_or_else(|| panic!("{image_path} is outside WORKDIR {image_workdir}")),
        None => image_path,
    };
    workdir.join(clean(rel))
}

fn run_in_stage(workdir: &Path, ins: &Instruction, env: &[(String, String)]) {
    let (flags, rest) = split_flags(&ins.args);
    assert!(
        flags.is_empty(),
        "line {}: RUN options ({:?}) are not replayed",
        ins.line,
        flags.keys()
    );
    assert!(
        !rest.starts_with("<<"),
        "line {}: heredocs are not replayed",
        ins.line
    );
    let mut cmd = Command::new("nice");
    cmd.args(["-n", "19"]);
    if rest.starts_with('[') {
        cmd.args(words(rest));
    } else {
        cmd.args(["sh", "-c", rest]);
    }
    // The stage sees only its own environment: none of cargo's variables for this test
    // (its target directory above all), plus the stage's ENV lines.
    for (k, _) in std::env::vars() {
        if k.starts_with("CARGO_") && k != "CARGO_HOME" {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().map(|(k, v)| (k, v)))
        .env("CARGO_NET_OFFLINE", "true")
        .env("CARGO_PROFILE_RELEASE_OPT_LEVEL", "0")
        .env("CARGO_PROFILE_RELEASE_LTO", "off")
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "16")
        .env("CARGO_TERM_COLOR", "never")
        .current_dir(workdir);
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("line {}: cannot run: {e}", ins.line));
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(40).collect();
        let hint = if stderr.contains("--offline") {
            "\n(a crate is missing from the local registry cache: run `cargo fetch --locked` once)"
        } else {
            ""
        };
        panic!(
            "Dockerfile line {}: RUN {} failed ({}):\n{}\n{}{hint}",
            ins.line,
            ins.args,
            out.status,
            String::from_utf8_lossy(&out.stdout),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
        );
    }
}

/// The build directory of this test binary (`target/`), where the replay keeps its own.
fn target_dir() -> PathBuf {
    let exe = crate::support::bin::idemgate();
    exe.parent()
        .and_then(Path::parent)
        .expect("the binary lives in target/<profile>/")
        .to_path_buf()
}

#[test]
fn the_dockerfile_build_stage_builds_the_real_binary_from_what_it_copies() {
    let context = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(context.join("Dockerfile")).expect("a Dockerfile");
    let stages = parse(&text);
    let last = stages.last().expect("at least one stage");

    // The stage the image copies its files from, and what it copies.
    let mut outputs = Vec::new();
    for ins in last.instructions.iter().filter(|i| i.keyword == "COPY") {
        let (flags, rest) = split_flags(&ins.args);
        if let Some(from) = flags.get("from") {
            let [src, dest]: [String; 2] = words(rest).try_into().unwrap_or_else(|w| {
                panic!(
                    "line {}: COPY --from with one source expected: {w:?}",
                    ins.line
                )
            });
            outputs.push((from.clone(), src, dest));
        }
    }
    let builder_name = outputs
        .first()
        .map(|o| o.0.clone())
        .expect("the final stage copies its binary from a build stage (COPY --from=...)");
    let builder = stages
        .iter()
        .find(|s| s.name.as_deref() == Some(builder_name.as_str()))
        .unwrap_or_else(|| panic!("no stage named {builder_name}"));

    // A scratch directory per checkout (cargo's locks keep two runs from mixing builds; this
    // lock keeps them from mixing sources), emptied but for the stage's `target/`.
    let root = target_dir().join("dockerfile-replay");
    std::fs::create_dir_all(&root).unwrap();
    let lock = std::fs::File::create(root.join("lock")).unwrap();
    lock.lock().unwrap();
    let workdir = root.join("src");
    std::fs::create_dir_all(&workdir).unwrap();
    for entry in std::fs::read_dir(&workdir).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() == "target" {
            continue;
        }
        let path = entry.path();
        if entry.file_type().unwrap().is_dir() {
            std::fs::remove_dir_all(&path).unwrap();
        } else {
            std::fs::remove_file(&path).unwrap();
        }
    }

    let ignore = Ignore::load(context);
    let mut image_workdir: Option<String> = None;
    let mut env: Vec<(String, String)> = Vec::new();
    for ins in &builder.instructions {
        match ins.keyword.as_str() {
            "WORKDIR" => {
                assert!(
                    image_workdir.is_none() && ins.args.starts_with('/'),
                    "line {}: one absolute WORKDIR per build stage is replayed",
                    ins.line
                );
                image_workdir = Some(ins.args.trim_end_matches('/').to_string());
            }
            "ENV" => {
                for pair in ins.args.split_whitespace() {
                    let (k, v) = pair
                        .split_once('=')
                        .unwrap_or_else(|| panic!("line {}: ENV KEY=VALUE expected", ins.line));
                    env.push((k.to_string(), v.trim_matches('"').to_string()));
                }
            }
            "COPY" => {
                let image_workdir = image_workdir
                    .as_deref()
                    .unwrap_or_else(|| panic!("line {}: COPY before WORKDIR", ins.line));
                let (flags, rest) = split_flags(&ins.args);
                assert!(
                    !flags.contains_key("from"),
                    "line {}: the build stage copies from the context only",
                    ins.line
                );
                let words = words(rest);
                let (dest, sources) = words.split_last().expect("COPY SRC... DEST");
                assert!(
                    !sources.is_empty(),
                    "line {}: COPY without a source",
                    ins.line
                );
                assert!(
                    sources.len() == 1 || dest.ends_with('/'),
                    "line {}: several sources need a destination directory ending in /",
                    ins.line
                );
                let dest_dir = in_replay(dest, image_workdir, &workdir);
                let mut copied = 0;
                for src in sources {
                    assert!(
                        !src.contains(['*', '?', '[']),
                        "line {}: wildcards are not replayed",
                        ins.line
                    );
                    let rel = clean(src);
                    let is_file = context.join(&rel).is_file();
                    let to = if rel.is_empty() || !is_file || !dest.ends_with('/') {
                        dest_dir.clone()
                    } else {
                        dest_dir.join(rel.rsplit('/').next().unwrap())
                    };
                    copied += if rel.is_empty() {
                        std::fs::read_dir(context)
                            .unwrap()
                            .map(|e| e.unwrap().file_name().into_string().unwrap())
                            .map(|name| copy_tree(context, &name, &to.join(&name), &ignore))
                            .sum()
                    } else {
                        copy_tree(context, &rel, &to, &ignore)
                    };
                }
                assert!(copied > 0, "line {}: COPY copied nothing", ins.line);
            }
            "RUN" => run_in_stage(&workdir, ins, &env),
            "ARG" | "LABEL" => {}
            other => panic!(
                "line {}: {other} in the build stage: this replay does not know it",
                ins.line
            ),
        }
    }

    let image_workdir = image_workdir.expect("the build stage sets WORKDIR");

    // What the image takes from the stage exists, and the binary is the real one: a
    // stand-in left by the dependency layer prints no version.
    let mut binary = None;
    for (_, src, dest) in &outputs {
        let path = in_replay(src, &image_workdir, &workdir);
        assert!(
            path.is_file(),
            "the image copies {src} from the build stage, which does not make it"
        );
        if dest.ends_with("/idemgate") {
            binary = Some((path, dest.clone()));
        }
    }
    let (binary, image_binary) = binary.expect("the image copies the idemgate binary");
    let version = Command::new(&binary).arg("--version").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        format!("idemgate {}", env!("CARGO_PKG_VERSION")),
        "the built binary is the real idemgate, not the dependency layer's stand-in"
    );

    // The HEALTHCHECK runs that binary with arguments it accepts. There is no config at the
    // image's path here, so it answers 1 (unhealthy) with a reason; 2 would be a usage error.
    let health = last
        .instructions
        .iter()
        .find(|i| i.keyword == "HEALTHCHECK")
        .expect("the image has a HEALTHCHECK");
    let (_, rest) = split_flags(&health.args);
    let exec = words(
        rest.strip_prefix("CMD")
            .expect("HEALTHCHECK [OPTIONS] CMD ...")
            .trim_start(),
    );
    assert_eq!(
        exec[0], image_binary,
        "the HEALTHCHECK runs the image's own binary (the image has no curl)"
    );
    let out = Command::new(&binary).args(&exec[1..]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr.trim().lines().count(),
        1,
        "one line of reason: {stderr}"
    );
}
