//! The rooms of `architecture.md`, enforced: each file's `crate::…` paths
//! (outside its test module) name only the rooms its row allows.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// (room, rooms it may import), as the table in `architecture.md`.
const ALLOWED: &[(&str, &[&str])] = &[
    ("main", &["*"]),
    ("app", &["*"]),
    (
        "config",
        &[
            "collections",
            "proto",
            "transport",
            "source",
            "downstream",
            "tools",
            "skew",
        ],
    ),
    ("collections", &[]),
    ("proto", &[]),
    ("metrics", &[]),
    ("memory", &[]),
    ("runtime", &[]),
    ("transport", &["metrics"]),
    ("cache", &[]),
    ("source", &["cache", "proto", "transport", "metrics", "collections"]),
    ("skew", &["cache", "source", "metrics"]),
    (
        "downstream",
        &["cache", "proto", "transport", "metrics", "collections", "skew"],
    ),
    (
        "admin",
        &[
            "cache",
            "downstream",
            "source",
            "metrics",
            "collections",
            "transport",
            "proto",
            "skew",
            "runtime",
        ],
    ),
    (
        "tools",
        &[
            "proto",
            "transport",
            "source",
            "collections",
            "downstream",
            "metrics",
            "skew",
        ],
    ),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The rooms a file's code (before its test module) names as `crate::room`.
fn imported_rooms(text: &str) -> BTreeSet<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or_default();
    let mut rooms = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let room: String = code[at + "crate::".len()..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // A type of the crate root (`crate::SharedStr`) is the crate's
        // shared vocabulary, not a room: rooms are modules, lower case.
        if room.starts_with(|c: char| c.is_ascii_lowercase()) {
            rooms.insert(room);
        }
    }
    rooms
}

#[test]
fn rooms_import_only_what_architecture_md_allows() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut violations = Vec::new();
    for file in files {
        let relative = file.strip_prefix(&src).unwrap();
        let first = relative.components().next().unwrap().as_os_str().to_string_lossy();
        if first == "bin" || first == "lib.rs" {
            continue; // other crates of the package, and the module list
        }
        let room = first.trim_end_matches(".rs").to_owned();
        let allowed = ALLOWED
            .iter()
            .find(|(name, _)| *name == room)
            .unwrap_or_else(|| panic!("{room} (src/{}) is not a room of architecture.md", relative.display()))
            .1;
        if allowed.contains(&"*") {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        for imported in imported_rooms(&text) {
            if imported != room && !allowed.contains(&imported.as_str()) {
                violations.push(format!("src/{} ({room}) imports crate::{imported}", relative.display()));
            }
        }
    }
    assert!(
        violations.is_empty(),
        "imports architecture.md does not allow:\n{}",
        violations.join("\n")
    );
}

#[test]
fn the_table_here_is_the_table_in_architecture_md() {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("architecture.md")).unwrap();
    for (room, _) in ALLOWED {
        let named = doc.contains(&format!("`{room}.rs`")) || doc.contains(&format!("`{room}/`"));
        assert!(named, "architecture.md has no row for {room}");
    }
}

/// Every task of the gateway is spawned on the app's `TaskTracker`, so that
/// shutdown stops and waits for it: no bare `tokio::spawn` or thread outside
/// test modules, the tools (not part of a running gateway) and the metrics
/// upkeep thread (process-wide, holds nothing).
#[test]
fn every_task_is_spawned_on_the_tracker() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut bare = Vec::new();
    for file in files {
        let relative = file.strip_prefix(&src).unwrap().display().to_string();
        if relative.starts_with("bin/") || relative.starts_with("tools/") || relative == "metrics.rs" {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        for pattern in ["tokio::spawn(", "task::spawn(", "thread::spawn(", "thread::Builder"] {
            if code.contains(pattern) {
                bare.push(format!("src/{relative}: {pattern}"));
            }
        }
    }
    assert!(bare.is_empty(), "tasks not on the tracker:\n{}", bare.join("\n"));
}
