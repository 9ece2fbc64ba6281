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

/// The file-level check: inside one top-level module, no file imports one that imports it back
/// (through `super::`, `self::`, `crate::` paths, or a child module's name). A parent's
/// `pub use` of its children is its face, not a use of them, and test code is left out.
mod files {
    use super::*;

    /// A file's module path inside the crate (`grpc/xds/mod.rs` is `["grpc", "xds"]`).
    fn module_files(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
        let mut out = BTreeMap::new();
        for file in rust_files(src) {
            let relative = file.strip_prefix(src).unwrap();
            let mut path: Vec<String> = relative
                .iter()
                .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
                .collect();
            if matches!(
                path.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                path.pop();
            }
            out.insert(path, file);
        }
        out
    }

    /// `text` without comments, test modules and `pub use` re-exports.
    fn code(text: &str) -> String {
        let mut out = Vec::new();
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let line = lines[i];
            if line.trim() == "#[cfg(test)]" && i + 1 < lines.len() {
                let next = lines[i + 1];
                let indent = &next[..next.len() - next.trim_start().len()];
                if next.trim_start().starts_with("mod ") && next.trim_end().ends_with(';') {
                    i += 2;
                    continue;
                }
                if next.trim_start().starts_with("mod ") && next.trim_end().ends_with('{') {
                    let close = format!("{indent}}}");
                    i += 2;
                    while i < lines.len() && lines[i] != close {
                        i += 1;
                    }
                    i += 1;
                    continue;
                }
            }
            let code = line.split("//").next().unwrap_or_default();
            out.push(code);
            i += 1;
        }
        let text = out.join("\n");
        // `pub use …;` and `pub(crate) use …;`, which may span lines.
        let mut kept = String::new();
        let mut rest = text.as_str();
        while let Some(at) = find_pub_use(rest) {
            kept.push_str(&rest[..at]);
            rest = &rest[at..];
            rest = &rest[rest.find(';').map_or(rest.len(), |e| e + 1)..];
        }
        kept.push_str(rest);
        kept
    }

    fn find_pub_use(text: &str) -> Option<usize> {
        let mut from = 0;
        while let Some(at) = text[from..].find("pub") {
            let at = from + at;
            let line_start = text[..at].rfind('\n').map_or(0, |n| n + 1);
            let after = text[at + 3..].trim_start_matches(|c: char| {
                c == '(' || c.is_alphanumeric() || c == ')' || c == '_'
            });
            if text[line_start..at].trim().is_empty() && after.trim_start().starts_with("use ") {
                return Some(at);
            }
            from = at + 3;
        }
        None
    }

    fn is_word(c: char) -> bool {
        c.is_alphanumeric() || c == '_'
    }

    /// The paths written from `at` on: `a::b::C`, or each item of `a::{b, c::D}` (one level).
    fn paths_at(text: &str, at: usize) -> Vec<Vec<String>> {
        let mut segments = Vec::new();
        let mut rest = text[at..].trim_start();
        loop {
            let word: String = rest.chars().take_while(|c| is_word(*c)).collect();
            if word.is_empty() {
                break;
            }
            let after = rest[word.len()..].trim_start();
            segments.push(word.clone());
            match after.strip_prefix("::") {
                Some(more) => rest = more.trim_start(),
                None => return vec![segments],
            }
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut end = group.len();
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = i;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            return group[..end]
                .split(',')
                .map(|item| {
                    let mut path = segments.clone();
                    path.extend(
                        item.split(" as ")
                            .next()
                            .unwrap_or_default()
                            .split("::")
                            .map(|s| s.trim().trim_matches(|c: char| !is_word(c)).to_string())
                            .filter(|s| !s.is_empty()),
                    );
                    path
                })
                .collect();
        }
        vec![segments]
    }

    /// Which files each file of the crate at `src` uses, by module path.
    fn uses(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
        let files = module_files(src);
        let resolve = |path: &[String]| {
            (0..=path.len())
                .rev()
                .map(|n| path[..n].to_vec())
                .find(|p| files.contains_key(p))
        };
        let mut graph = BTreeMap::new();
        for (here, file) in &files {
            let text = code(&std::fs::read_to_string(file).unwrap());
            let mut out = BTreeSet::new();
            for (at, _) in text.match_indices("::") {
                let before = &text[..at];
                let word_start = before
                    .char_indices()
                    .rev()
                    .find(|(_, c)| !is_word(*c))
                    .map_or(0, |(i, c)| i + c.len_utf8());
                let word = &before[word_start..];
                if before[..word_start].ends_with("::") {
                    continue;
                }
                let mut base: Vec<String> = match word {
                    "crate" => Vec::new(),
                    "self" => here.clone(),
                    "super" => here[..here.len().saturating_sub(1)].to_vec(),
                    child if !child.is_empty() => {
                        let declared = text.contains(&format!("mod {child};"));
                        if !declared {
                            continue;
                        }
                        let mut p = here.clone();
                        p.push(child.to_string());
                        p
                    }
                    _ => continue,
                };
                let mut from = at + 2;
                while text[from..].trim_start().starts_with("super::") {
                    base.pop();
                    from = text.len() - text[from..].trim_start().len() + "super::".len();
                }
                for path in paths_at(&text, from) {
                    let mut full = base.clone();
                    full.extend(path);
                    if let Some(target) = resolve(&full)
                        && &target != here
                    {
                        out.insert(target);
                    }
                }
            }
            graph.insert(here.clone(), out);
        }
        graph
    }

    /// Every circle of files inside one top-level module, each written as its files.
    pub(super) fn circles(src: &Path) -> Vec<String> {
        let files = module_files(src);
        let graph: Graph = uses(src)
            .into_iter()
            .map(|(from, to)| {
                let edges = to
                    .into_iter()
                    .filter(|t| !from.is_empty() && t.first() == from.first())
                    .map(|t| (t.join("/"), BTreeSet::new()))
                    .collect();
                (from.join("/"), edges)
            })
            .collect();
        let mut found = Vec::new();
        let mut covered = BTreeSet::new();
        for start in graph.keys() {
            if covered.contains(start) {
                continue;
            }
            if let Some(circle) = circle_through(&graph, start) {
                let shown: Vec<String> = circle
                    .iter()
                    .map(|m| {
                        let key: Vec<String> = m.split('/').map(str::to_string).collect();
                        files[&key].strip_prefix(src).unwrap().display().to_string()
                    })
                    .collect();
                covered.extend(circle);
                found.push(shown.join(" -> "));
            }
        }
        found
    }
}

fn assert_no_file_circles(root: &str) {
    let circles = files::circles(&Path::new(env!("CARGO_MANIFEST_DIR")).join(root));
    assert!(
        circles.is_empty(),
        "files that import each other inside a module of {root}/: {circles:#?}"
    );
}

#[test]
fn no_file_of_a_module_imports_one_that_imports_it_back() {
    for root in [
        "src",
        "loadtest/src",
        "tests/fake-apiserver/src",
        "tests/control-plane/src",
    ] {
        assert_no_file_circles(root);
    }
}

#[test]
fn the_file_check_finds_a_child_importing_its_parent() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("lib.rs", "pub mod a;");
    write(
        "a/mod.rs",
        "mod b;\nmod c;\npub use b::B;\npub struct A;\nfn f() { c::g() }",
    );
    write("a/b.rs", "pub struct B;");
    write("a/c.rs", "use super::A;\npub fn g() {}");
    let found = files::circles(dir.path());
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].contains("a/mod.rs") && found[0].contains("a/c.rs"),
        "{found:?}"
    );
    // A parent's re-export of a child is no use of it, and siblings may import one another.
    write("a/mod.rs", "mod b;\nmod c;\npub use b::B;\npub use c::g;");
    write("a/c.rs", "use super::b::B;\npub fn g() {}");
    assert!(files::circles(dir.path()).is_empty());
}
