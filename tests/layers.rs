//! The layers import one way. For the broker's `src/`, the load harness's `loadtest/src/` and
//! the servers the tests run (`tests/fake-apiserver/src/`, `tests/control-plane/src/`), the
//! graph of `crate::…` references between top-level modules (a file or a folder each) has no
//! circle: when two modules import each other, one of them holds something that belongs to
//! neither (ADR 0018).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module of the crate whose root is `src`: its name and its files.
fn modules(src: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    let mut modules = BTreeMap::new();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            modules.insert(name, rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") && name != "main" && name != "lib" {
            modules.insert(name, vec![path]);
        }
    }
    modules
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// The names `text` reaches through `crate::`: `crate::name` and each first name inside
/// `crate::{…}`.
fn references(text: &str) -> BTreeSet<String> {
    let word = |s: &str| {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect::<String>()
    };
    let mut names = BTreeSet::new();
    for (at, _) in text.match_indices("crate::") {
        let rest = &text[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            names.extend(group.split(',').map(|item| word(item.trim())));
        } else {
            names.insert(word(rest));
        }
    }
    names
}

/// Which module imports which, and through which files.
type Graph = BTreeMap<String, BTreeMap<String, BTreeSet<PathBuf>>>;

fn graph(src: &Path) -> Graph {
    let modules = modules(src);
    let mut graph = Graph::new();
    for (name, files) in &modules {
        let edges = graph.entry(name.clone()).or_default();
        for file in files {
            let text = std::fs::read_to_string(file).unwrap();
            for target in references(&text) {
                if &target != name && modules.contains_key(&target) {
                    edges.entry(target).or_default().insert(file.clone());
                }
            }
        }
    }
    graph
}

/// A circle through `start`, if there is one: the modules in order, `start` first.
fn circle_through(graph: &Graph, start: &str) -> Option<Vec<String>> {
    fn walk(
        graph: &Graph,
        start: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        let here = path.last().unwrap().clone();
        for next in graph[&here].keys() {
            if next == start {
                return true;
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if walk(graph, start, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![start.to_string()];
    walk(graph, start, &mut path, &mut BTreeSet::new()).then_some(path)
}

/// Every circle, one per module it passes through first, written with the files that make
/// each step.
fn circles(src: &Path) -> Vec<String> {
    let graph = graph(src);
    let mut found: Vec<String> = Vec::new();
    let mut covered = BTreeSet::new();
    for start in graph.keys() {
        if covered.contains(start) {
            continue;
        }
        if let Some(circle) = circle_through(&graph, start) {
            let steps: Vec<String> = circle
                .iter()
                .zip(circle.iter().cycle().skip(1))
                .map(|(a, b)| format!("{a} -> {b} ({:?})", graph[a][b]))
                .collect();
            covered.extend(circle);
            found.push(steps.join(", "));
        }
    }
    found
}

/// Fails naming every circle among the top-level modules of the crate whose root is `root`
/// (relative to the workspace).
fn assert_no_circles(root: &str) {
    let circles = circles(&Path::new(env!("CARGO_MANIFEST_DIR")).join(root));
    assert!(
        circles.is_empty(),
        "import circles in {root}/: {circles:#?}"
    );
}

#[test]
fn no_module_of_the_broker_imports_one_that_imports_it_back() {
    assert_no_circles("src");
}

#[test]
fn no_module_of_the_load_harness_imports_one_that_imports_it_back() {
    assert_no_circles("loadtest/src");
}

#[test]
fn no_module_of_the_test_servers_imports_one_that_imports_it_back() {
    assert_no_circles("tests/fake-apiserver/src");
    assert_no_circles("tests/control-plane/src");
}

#[test]
fn the_check_finds_a_circle_and_names_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("lib.rs", "pub mod a; pub mod b; pub mod c;");
    write("a.rs", "use crate::b::Thing;");
    write("b/mod.rs", "mod inner;");
    write("b/inner.rs", "use crate::{c, selector};");
    write("c.rs", "fn f() { crate::a::g() }");
    let found = circles(dir.path());
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("a -> b") && found[0].contains("inner.rs"),
        "{found:?}"
    );
    write("c.rs", "fn f() {}");
    assert!(circles(dir.path()).is_empty());
}
