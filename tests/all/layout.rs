//! The rules that hold the source's layout (`docs/architecture.md`), read from the files
//! themselves: the engine names no client library and imports neither the driver nor a door;
//! the driver imports no door; the ground floor imports none of the three; and the tower door
//! holds no rule of its own.

use std::path::{Path, PathBuf};

/// The `.rs` files under `src/<dir>` (or the one file `src/<dir>.rs`), with their code: every
/// line that is not a comment (doc examples name the clients the crate is used with).
fn code_of(dir: &str) -> Vec<(PathBuf, String)> {
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
            let code: Vec<&str> = text
                .lines()
                .filter(|line| !line.trim_start().starts_with("//"))
                .collect();
            files.push((at, code.join("\n")));
        }
    }
    assert!(!files.is_empty(), "no source under src/{dir}");
    files
}

/// Every place in `dir`'s code where one of `names` appears.
fn found(dir: &str, names: &[&str]) -> Vec<String> {
    let mut seen = Vec::new();
    for (path, code) in code_of(dir) {
        for name in names {
            if code.contains(name) {
                seen.push(format!("{} names {name}", path.display()));
            }
        }
    }
    seen
}

#[test]
fn the_engine_names_no_client_library_and_imports_no_floor_above_it() {
    let names = [
        "reqwest::",
        "reqwest_middleware",
        "hyper_util",
        "tower_service",
        "tower_layer",
        "crate::driver",
        "crate::door",
    ];
    let seen = found("engine", &names);
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

#[test]
fn the_tower_door_holds_no_rule() {
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
