//! The rules that hold the source's layout (`docs/architecture.md`), read from the files
//! themselves: the engine names no client library and imports neither the driver nor a door;
//! the driver imports no door; no door imports another; the ground floor imports none of the
//! three; and no door holds a rule of its own.

use std::path::{Path, PathBuf};

/// The `.rs` files under `src/<dir>` (or the one file `src/<dir>.rs`), with their text: every
/// line, or (`code`) every line that is not a comment.
fn text_of(dir: &str, code: bool) -> Vec<(PathBuf, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    let mut stack = vec![root.join(dir)];
    let single = root.join(format!("{dir}.rs"));
    if single.is_file() {
        stack = vec![single];
    }
    // Bounded: the source tree is a few levels deep.
    for _ in 0..1_000 {
        let Some(at) = stack.pop() else { break };
        if at.is_dir() {
            for entry in std::fs::read_dir(&at).unwrap() {
                stack.push(entry.unwrap().path());
            }
        } else if at.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&at).unwrap();
            let kept: Vec<&str> = text
                .lines()
                .filter(|line| !code || !line.trim_start().starts_with("//"))
                .collect();
            files.push((at, kept.join("\n")));
        }
    }
    assert!(!files.is_empty(), "no source under src/{dir}");
    files
}

/// Every file of `dir` whose code (or, `docs_too`, whose text) names one of `names`.
fn found_in(dir: &str, names: &[&str], docs_too: bool) -> Vec<String> {
    let mut seen = Vec::new();
    for (path, code) in text_of(dir, !docs_too) {
        for name in names {
            if code.contains(name) {
                seen.push(format!("{} names {name}", path.display()));
            }
        }
    }
    seen
}

/// Every file of `dir` whose code names one of `names`.
fn found(dir: &str, names: &[&str]) -> Vec<String> {
    found_in(dir, names, false)
}

#[test]
fn the_engine_names_no_client_library_and_imports_no_floor_above_it() {
    // Not in its docs either: an example that needs a client lives on the face or a door.
    let libraries = [
        "reqwest::",
        "reqwest_middleware::",
        "hyper_util::",
        "tower::",
        "tower_service::",
        "tower_layer::",
        "tonic::",
    ];
    let seen = found_in("engine", &libraries, true);
    assert!(seen.is_empty(), "{seen:#?}");
    let seen = found("engine", &["crate::driver", "crate::door"]);
    assert!(seen.is_empty(), "{seen:#?}");
}

/// Each door is native on its own types: none imports another (the tower door once read its
/// layer's own errors through the reqwest door's reader).
#[test]
fn no_door_imports_another() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/door");
    let mut doors: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.file_stem().is_some_and(|stem| stem != "mod"))
        .map(|path| path.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    doors.sort();
    doors.dedup();
    assert!(doors.len() >= 2, "{doors:?}");
    let mut seen = Vec::new();
    for door in &doors {
        let others: Vec<String> = (doors.iter().filter(|other| *other != door))
            .map(|other| format!("door::{other}"))
            .collect();
        let others: Vec<&str> = others.iter().map(String::as_str).collect();
        seen.extend(found(&format!("door/{door}"), &others));
    }
    assert!(seen.is_empty(), "{seen:#?}");
}

#[test]
fn the_driver_imports_no_door_and_the_ground_no_floor_above_it() {
    let seen = found("driver", &["crate::door"]);
    assert!(seen.is_empty(), "{seen:#?}");
    for ground in [
        "clock", "error", "fault", "observe", "record", "rng", "shared", "stop",
    ] {
        let seen = found(ground, &["crate::engine", "crate::driver", "crate::door"]);
        assert!(seen.is_empty(), "{seen:#?}");
    }
}

/// The tower door's errors are the inner service's, boxed, and the layer's own: its code,
/// tests aside, names no error, request, response or URL of reqwest's, and nothing of
/// reqwest-middleware's (it knows reqwest's body only to take its bytes without a copy).
#[test]
fn the_tower_door_names_neither_reqwest_nor_reqwest_middleware_on_its_error_path() {
    let names = [
        "reqwest_middleware",
        "reqwest::Error",
        "reqwest::Url",
        "reqwest::Request",
        "reqwest::Response",
    ];
    let mut seen = Vec::new();
    for (path, code) in text_of("door/tower", true) {
        if path.file_name().is_some_and(|name| name == "tests.rs") {
            continue;
        }
        let code = code.split("#[cfg(test)]").next().unwrap_or_default();
        seen.extend(
            names
                .iter()
                .filter(|name| code.contains(*name))
                .map(|name| format!("{} names {name}", path.display())),
        );
    }
    assert!(seen.is_empty(), "{seen:#?}");
}

#[test]
fn no_door_holds_a_rule() {
    let rules = [
        "StatusCode::",
        "Method::",
        "is_idempotent",
        "budget",
        "quota",
        "idempotency",
        "Idempotency-Key",
        "429",
        "503",
    ];
    let seen = found("door", &rules);
    assert!(seen.is_empty(), "{seen:#?}");
}

/// Issue 64, defect 13: the crate root holds at most 40 public items with every feature: each
/// door's own items under its module (`grpc`, as tower-http groups each middleware), the
/// classifier's under `classify`, the error's parts under `error`, the bodies under `body`.
#[test]
fn the_crate_root_holds_at_most_forty_items() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs");
    let code = std::fs::read_to_string(root).unwrap();
    let mut items = Vec::new();
    let mut lines = code.lines().peekable();
    while let Some(line) = lines.next() {
        if let Some(rest) = line.strip_prefix("pub use ") {
            let mut statement = rest.to_owned();
            while !statement.contains(';') {
                statement.push_str(lines.next().expect("a `pub use` ends"));
            }
            let names = match statement.split_once('{') {
                Some((_, inner)) => inner.trim_end_matches([';', '}']).to_owned(),
                None => statement
                    .rsplit("::")
                    .next()
                    .unwrap()
                    .trim_end_matches(';')
                    .to_owned(),
            };
            items.extend(
                names
                    .split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(String::from),
            );
        } else if let Some(rest) = line.strip_prefix("pub mod ") {
            items.push(rest.trim_end_matches([';', ' ', '{']).to_owned());
        } else if line.starts_with("pub struct") || line.starts_with("pub enum") {
            items.push(line.to_owned());
        }
    }
    // The README's doctests hold, compiled only for `cargo test --doc`.
    items.retain(|item| !item.contains("ReadmeDoctests"));
    assert!(
        items.len() <= 40,
        "{} items at the root: {items:?}",
        items.len()
    );
}
