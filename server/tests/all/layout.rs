//! The house holds its floors (`docs/architecture.md`): a file of `src/` names only modules on
//! its own floor or below, and no two files name each other.

use std::collections::BTreeMap;
use std::path::Path;

/// Each module of `src/` and its floor, from the top.
const FLOORS: &[(&str, u8)] = &[
    ("lib", 4),
    ("layer", 4),
    ("reconciler", 4),
    ("service", 3),
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
];

fn floor(module: &str) -> u8 {
    FLOORS
        .iter()
        .find(|(name, _)| *name == module)
        .map(|(_, floor)| *floor)
        .unwrap_or_else(|| panic!("`{module}` has no floor: give it one in tests/all/layout.rs and docs/architecture.md"))
}

/// The module a file of `src/` belongs to (`service/claim.rs` is `service`).
fn module_of(path: &Path, src: &Path) -> String {
    let relative = path.strip_prefix(src).unwrap();
    let first = relative
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_owned()
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
        if name.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
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
}
