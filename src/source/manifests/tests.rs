//! The manifests source, file by file: documents, the catalog and the directory scan.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::MAX_NESTING;
use super::catalog::{Catalog, Key, Stored};
use super::document::version_priority;
use super::document::{read_docs, too_deep};
use super::scan::Loader;

const CRD: &str = include_str!("../../../examples/manifests/featureflag-crd.yaml");

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

fn flag(name: &str, variant: &str) -> String {
    format!(
        "apiVersion: core.openfeature.dev/v1beta1\nkind: FeatureFlag\nmetadata:\n  name: {name}\nspec:\n  flagSpec:\n    flags:\n      f:\n        state: ENABLED\n        variants: {{a: true, b: false}}\n        defaultVariant: {variant}\n"
    )
}

fn served(stored: &Stored) -> Value {
    serde_json::from_slice(&stored.object.json).unwrap()
}

fn loader(dir: &Path) -> Loader {
    Loader::new(dir, Arc::default()).unwrap()
}

/// Two polls: a change is taken once two see it the same.
fn settle(loader: &mut Loader) -> Option<Arc<Catalog>> {
    loader.scan(false).or_else(|| loader.scan(false))
}

fn key(name: &str) -> Key {
    (
        "core.openfeature.dev".into(),
        "featureflags".into(),
        "default".into(),
        name.into(),
    )
}

#[test]
fn loads_crds_and_objects_with_server_metadata() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "crd.yaml", CRD);
    write(dir.path(), "a.yaml", &flag("a", "a"));
    let mut loader = loader(dir.path());
    let catalog = loader.scan(true).expect("a first catalog");
    assert_eq!(catalog.kinds.len(), 1);
    let a = &catalog.objects[&key("a")];
    assert_eq!(served(a)["metadata"]["namespace"], "default");
    assert_eq!(served(a)["metadata"]["generation"], 1);
    assert!(!a.object.uid.is_empty());
    assert!(settle(&mut loader).is_none(), "nothing changed");
}

#[test]
fn edits_move_the_resource_version_and_keep_the_uid() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "crd.yaml", CRD);
    write(dir.path(), "a.yaml", &flag("a", "a"));
    let mut loader = loader(dir.path());
    let first = loader.scan(true).unwrap().objects[&key("a")].object.clone();
    std::thread::sleep(Duration::from_millis(10));
    write(dir.path(), "a.yaml", &flag("a", "b"));
    assert!(
        loader.scan(false).is_none(),
        "a change is taken once it has held"
    );
    let catalog = loader.scan(false).expect("the edit is seen");
    let second = &catalog.objects[&key("a")];
    assert_eq!(second.object.uid, first.uid);
    assert_ne!(second.object.resource_version, first.resource_version);
    assert_eq!(served(second)["metadata"]["generation"], 2);
    std::fs::remove_file(dir.path().join("a.yaml")).unwrap();
    assert!(
        settle(&mut loader)
            .expect("the delete is seen")
            .objects
            .is_empty()
    );
}

#[test]
fn documents_are_kept_as_compact_json_with_aliases_resolved_and_lists_unpacked() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = "---\nkind: List\napiVersion: v1\nitems:\n- {apiVersion: a/v1, kind: K, metadata: {name: x}, spec: &s {n: 1}}\n- {apiVersion: a/v1, kind: K, metadata: {name: y}, spec: *s}\n---\n# empty\n";
    write(dir.path(), "list.yaml", yaml);
    let docs = read_docs(&dir.path().join("list.yaml"), dir.path()).unwrap();
    assert_eq!(docs.len(), 2);
    assert_eq!(
        &docs[1].json[..],
        br#"{"apiVersion":"a/v1","kind":"K","metadata":{"name":"y"},"spec":{"n":1}}"#
    );
    assert_eq!(docs[0].spec, docs[1].spec, "the same spec");
    assert_ne!(docs[0].digest, docs[1].digest, "different objects");
    let json = "{\n  \"apiVersion\": \"a/v1\",\n  \"kind\": \"K\",\n  \"metadata\": {\"name\": \"x\"}\n}\n";
    write(dir.path(), "x.json", json);
    let docs = read_docs(&dir.path().join("x.json"), dir.path()).unwrap();
    assert_eq!(
        &docs[0].json[..],
        br#"{"apiVersion":"a/v1","kind":"K","metadata":{"name":"x"}}"#
    );
    write(dir.path(), "two.json", "{} {}");
    assert!(read_docs(&dir.path().join("two.json"), dir.path()).is_err());
    write(dir.path(), "scalar.yaml", "just text\n");
    assert_eq!(
        read_docs(&dir.path().join("scalar.yaml"), dir.path()).unwrap_err(),
        "a document is not a mapping"
    );
}

#[test]
fn a_broken_file_keeps_its_last_good_contents() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "crd.yaml", CRD);
    write(dir.path(), "a.yaml", &flag("a", "a"));
    let mut loader = loader(dir.path());
    loader.scan(true).unwrap();
    write(dir.path(), "a.yaml", "apiVersion: [unclosed");
    assert!(settle(&mut loader).is_none(), "nothing served changes");
    assert!(loader.objects.contains_key(&key("a")));
    assert!(
        loader
            .shared
            .problems
            .lock()
            .unwrap()
            .contains_key(&dir.path().canonicalize().unwrap().join("a.yaml"))
    );
}

#[test]
fn nesting_is_measured_in_block_flow_and_json_forms() {
    let deep_flow = format!("a: {}{}\n", "[".repeat(70), "]".repeat(70));
    assert_eq!(too_deep(&deep_flow, MAX_NESTING, false), Some(1));
    let deep_json = format!(
        "{}{}",
        "{\"a\":".repeat(70),
        "1".to_string() + &"}".repeat(70)
    );
    assert_eq!(too_deep(&deep_json, MAX_NESTING, true), Some(1));
    let mut block = String::new();
    for i in 0..70 {
        block.push_str(&format!("{}k{i}:\n", " ".repeat(i * 2)));
    }
    assert_eq!(too_deep(&block, MAX_NESTING, false), Some(MAX_NESTING + 1));
    // Real manifests, brackets in strings and comments, and pretty JSON pass.
    assert_eq!(too_deep(CRD, MAX_NESTING, false), None);
    assert_eq!(too_deep(&flag("a", "a"), MAX_NESTING, false), None);
    assert_eq!(too_deep("a: \"[[[[[[\" # {{{{{{\n", 3, false), None);
    let pretty =
        serde_json::to_string_pretty(&serde_json::json!({"a": {"b": {"c": [1, 2]}}})).unwrap();
    assert_eq!(too_deep(&pretty, 4, true), None);
    assert_eq!(too_deep(&pretty, 3, true), Some(4));
}

#[test]
fn versions_sort_by_kubernetes_priority() {
    let mut v = vec![
        "v1alpha1", "v1beta1", "v2", "v1", "x1", "v2beta2", "v2beta1",
    ];
    v.sort_by_key(|a| version_priority(a));
    assert_eq!(
        v,
        [
            "v2", "v1", "v2beta2", "v2beta1", "v1beta1", "v1alpha1", "x1"
        ]
    );
}

#[test]
fn a_file_still_open_for_writing_is_not_taken_however_long_its_writer_pauses() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "crd.yaml", CRD);
    let mut loader = loader(dir.path());
    loader.scan(true).unwrap();
    // Another process writes two FeatureFlags into one file, and pauses after the first.
    let path = dir.path().join("b.yaml");
    let mut writer = std::process::Command::new("sh")
        .args(["-c", "cat >> \"$1\"", "sh"])
        .arg(&path)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = writer.stdin.take().unwrap();
    stdin
        .write_all(format!("{}---\n", flag("b", "a")).as_bytes())
        .unwrap();
    stdin.flush().unwrap();
    let written = std::time::Instant::now();
    while std::fs::metadata(&path).map_or(0, |m| m.len()) == 0 {
        assert!(
            written.elapsed() < Duration::from_secs(5),
            "the writer wrote"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    for _ in 0..5 {
        assert!(
            loader.scan(false).is_none(),
            "a file being written is not taken"
        );
    }
    assert!(!loader.objects.contains_key(&key("b")));
    stdin.write_all(flag("c", "b").as_bytes()).unwrap();
    drop(stdin);
    writer.wait().unwrap();
    let catalog = settle(&mut loader).expect("taken once its writer closed it");
    assert!(catalog.objects.contains_key(&key("b")) && catalog.objects.contains_key(&key("c")));
}

#[test]
fn a_file_is_read_through_one_handle_within_the_limit_and_where_it_really_is() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    // Grown past the limit since it was listed: read no further than the limit.
    let big = std::fs::File::create(root.join("big.yaml")).unwrap();
    big.set_len(1 << 30).unwrap();
    let error = read_docs(&root.join("big.yaml"), &root).unwrap_err();
    assert!(error.contains("1073741824 bytes"), "{error}");
    // A link swapped to point outside the directory since it was listed.
    let outside = tempfile::tempdir().unwrap();
    write(outside.path(), "secret.yaml", &flag("secret", "a"));
    write(&root, "inside.yaml", &flag("a", "a"));
    std::os::unix::fs::symlink(root.join("inside.yaml"), root.join("link.yaml")).unwrap();
    assert!(read_docs(&root.join("link.yaml"), &root).is_ok());
    std::fs::remove_file(root.join("link.yaml")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret.yaml"), root.join("link.yaml")).unwrap();
    let error = read_docs(&root.join("link.yaml"), &root).unwrap_err();
    assert!(error.contains("outside the directory"), "{error}");
}
