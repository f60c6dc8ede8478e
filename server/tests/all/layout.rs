//! The house holds its floors (`docs/architecture.md`): a file of `src/` names only modules on
//! its own floor or below, no two files name each other, no front names another, and the
//! engine names no transport's crate.

use std::collections::BTreeMap;
use std::path::Path;

/// Each module of `src/` and its floor, from the top.
const FLOORS: &[(&str, u8)] = &[
    ("lib", 5),
    ("layer", 5),
    ("reconciler", 5),
    ("operator", 5),
    ("front", 4),
    ("front::http", 4),
    ("front::grpc", 4),
    ("front::consumer", 4),
    ("engine", 3),
    ("execution", 2),
    ("step", 2),
    ("relay", 2),
    ("sweeper", 2),
    ("worker", 2),
    ("testing", 2),
    ("store", 1),
    ("config", 1),
    ("events", 1),
    ("markers", 1),
    ("outgoing", 1),
    ("key", 1),
    ("fingerprint", 1),
    ("headers", 1),
    ("problem", 1),
    ("body", 1),
    ("transport", 1),
];

/// The crates of transports (and of the frameworks over them): the engine names none.
const TRANSPORT_CRATES: &[&str] = &[
    "tonic",
    "axum",
    "axum_core",
    "hyper",
    "reqwest",
    "lapin",
    "async_nats",
];

fn floor(module: &str) -> u8 {
    FLOORS
        .iter()
        .find(|(name, _)| *name == module)
        .map(|(_, floor)| *floor)
        .unwrap_or_else(|| panic!("`{module}` has no floor: give it one in tests/all/layout.rs and docs/architecture.md"))
}

/// The module a file of `src/` belongs to (`engine/claim.rs` is `engine`); each front is a
/// module of its own (`front/grpc.rs` is `front::grpc`).
fn module_of(path: &Path, src: &Path) -> String {
    let relative = path.strip_prefix(src).unwrap();
    let parts: Vec<String> = relative
        .components()
        .map(|c| {
            c.as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_owned()
        })
        .collect();
    match parts.as_slice() {
        [front, name, ..] if front == "front" && name != "mod" => format!("front::{name}"),
        [first, ..] => first.clone(),
        [] => unreachable!(),
    }
}

/// The modules of this crate a file's code names (`crate::x`), its tests and its comments
/// (doc links among them) left out.
fn named(code: &str) -> Vec<String> {
    let code = code.split("#[cfg(test)]").next().unwrap_or_default();
    let code: String = code
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // `crate::Name` is a re-export of lib.rs, named in docs; a module is lower case.
        if !name.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
            continue;
        }
        let after = &rest[name.len()..];
        let sub: String = after
            .strip_prefix("::")
            .unwrap_or_default()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name == "front" && sub.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
            found.push(format!("front::{sub}"));
        } else {
            found.push(name);
        }
    }
    found
}

fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_file_names_only_its_floor_or_below_and_no_two_name_each_other() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let mut edges: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for path in &all {
        let module = module_of(path, &src);
        let code = std::fs::read_to_string(path).unwrap();
        for name in named(&code) {
            if name == module {
                continue;
            }
            assert!(
                floor(&name) <= floor(&module),
                "{} (floor {}) names `{name}` (floor {}), a floor above it",
                path.display(),
                floor(&module),
                floor(&name)
            );
            edges.entry(module.clone()).or_default().push(name);
        }
    }
    for (from, tos) in &edges {
        for to in tos {
            let back = edges.get(to).is_some_and(|names| names.contains(from));
            assert!(
                !back,
                "`{from}` and `{to}` name each other: an import circle"
            );
        }
    }
    assert!(edges.len() >= 8, "the files were read: {edges:?}");
    for (from, tos) in &edges {
        if from.starts_with("front::") {
            let other = tos
                .iter()
                .find(|to| to.starts_with("front::") && *to != from);
            assert!(
                other.is_none(),
                "the front `{from}` names another front, `{other:?}`"
            );
        }
    }
    assert!(
        edges
            .get("front::http")
            .is_some_and(|tos| tos.iter().any(|to| to == "engine")),
        "the HTTP front was read: {edges:?}"
    );
}

/// The crates a file's code names in its paths (`tonic::Status`, `use axum_core::...`), its tests
/// and comments left out.
fn crates_named(code: &str) -> Vec<&'static str> {
    let code = code.split("#[cfg(test)]").next().unwrap_or_default();
    let code: String = code
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    TRANSPORT_CRATES
        .iter()
        .copied()
        .filter(|name| {
            code.match_indices(&format!("{name}::")).any(|(i, _)| {
                // A whole name: `tonic::`, not `my_tonic::`.
                !code[..i]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
            })
        })
        .collect()
}

#[test]
fn the_engine_names_no_transport_s_crate() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src.join("engine"), &mut all);
    assert!(all.len() >= 4, "the engine's files were read: {all:?}");
    for path in [src.join("transport.rs")].iter().chain(&all) {
        let code = std::fs::read_to_string(path).unwrap();
        let named = crates_named(&code);
        assert!(named.is_empty(), "{} names {named:?}", path.display());
    }
    assert_eq!(crates_named("let s = tonic::Status::ok(\"\");"), ["tonic"]);
    assert!(crates_named("my_tonic::x\n  // tonic::y").is_empty());
}

/// The consumer front is broker-neutral: its core names no broker's crate; lapin and
/// async-nats are named only by their adapters and the relay's publishers, one file each.
#[test]
fn only_a_broker_s_own_adapter_and_publisher_name_its_crate() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let allowed: &[(&str, &[&str])] = &[
        (
            "lapin",
            &[
                "front/consumer/rabbitmq.rs",
                "relay/rabbitmq.rs",
                "relay/mod.rs",
            ],
        ),
        (
            "async_nats",
            &["front/consumer/nats.rs", "relay/nats.rs", "relay/mod.rs"],
        ),
    ];
    let mut seen = 0;
    for path in &all {
        let relative = path
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let code = std::fs::read_to_string(path).unwrap();
        for name in crates_named(&code) {
            if let Some((_, files)) = allowed.iter().find(|(c, _)| *c == name) {
                assert!(
                    files.contains(&relative.as_str()),
                    "{relative} names `{name}`: only its adapter and its publisher may"
                );
                seen += 1;
            }
        }
    }
    assert!(seen >= 4, "the brokers' files were read");
    let core = std::fs::read_to_string(src.join("front/consumer/mod.rs")).unwrap();
    assert!(
        crates_named(&core).is_empty(),
        "the consumer front's core names a crate"
    );
}
