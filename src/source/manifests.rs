//! The manifests source: a directory of YAML (or JSON) manifests — CRDs and custom resources —
//! served as if it were an API server. Adding, editing or removing a file behaves like a create,
//! update or delete. It is the embedded default for running without a cluster.
//!
//! The directory is polled (see ADR 0006): each poll re-reads only files whose size or mtime
//! changed. A file that fails to parse keeps its last good contents and is reported once per
//! change, so a half-saved edit loses nothing. Objects get what an API server would give them:
//! a `uid` that lasts while the object exists, a `resourceVersion` that moves on every change,
//! `creationTimestamp`, `generation`, and the namespace `default` when none is written.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use futures::stream::{self, BoxStream};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::{KindNames, Object, Observed, Source, SourceError};
use crate::selector::{KindRef, Selector};

/// One kind a CRD in the directory defines.
#[derive(Debug, Clone, PartialEq)]
struct ManifestKind {
    names: KindNames,
    /// Served versions, highest priority first.
    versions: Vec<String>,
}

/// `(group, plural, namespace, name)`; the namespace is empty for cluster-scoped objects.
type Key = (String, String, String, String);

/// One object as loaded: what the file says, and the object as served.
#[derive(Debug, Clone)]
struct Stored {
    written: Value,
    served: Value,
    object: Object,
}

/// Everything the directory holds at one moment.
#[derive(Debug, Default)]
struct Catalog {
    kinds: Vec<ManifestKind>,
    objects: HashMap<Key, Stored>,
}

impl Catalog {
    fn kind(&self, group: &str, resource: &str) -> Option<&ManifestKind> {
        self.kinds
            .iter()
            .find(|k| k.names.group == group && k.names.answers_to(resource))
    }

    fn lookup(&self, selector: &Selector) -> Observed {
        let key = (
            selector.kind.group.clone(),
            selector.kind.resource.clone(),
            selector.namespace.clone().unwrap_or_default(),
            selector.name.clone(),
        );
        let Some(stored) = self.objects.get(&key) else {
            return Observed::Absent;
        };
        let version = selector.kind.version.as_deref().unwrap_or_default();
        let api_version = format!("{}/{version}", selector.kind.group);
        if stored.served["apiVersion"].as_str() == Some(api_version.as_str()) {
            return Observed::Present(stored.object.clone());
        }
        // Another served version: the same object under that apiVersion (no conversion).
        let mut at_version = stored.served.clone();
        at_version["apiVersion"] = json!(api_version);
        Observed::Present(Object::from_value(&at_version))
    }
}

/// Custom resources from a directory of manifests.
pub struct Manifests {
    dir: PathBuf,
    catalog: watch::Receiver<Arc<Catalog>>,
    allowed: Vec<KindRef>,
    poller: tokio::task::JoinHandle<()>,
}

impl Drop for Manifests {
    fn drop(&mut self) {
        self.poller.abort();
    }
}

impl Manifests {
    /// Loads `dir` and keeps polling it every `poll`. Fails if the directory cannot be read.
    pub fn open(dir: &Path, poll: Duration, allowed: Vec<KindRef>) -> std::io::Result<Self> {
        std::fs::read_dir(dir)?;
        let mut loader = Loader::new(dir.to_path_buf());
        let first = loader.scan().unwrap_or_default();
        tracing::info!(
            dir = %dir.display(),
            kinds = first.kinds.len(),
            objects = first.objects.len(),
            "manifests loaded"
        );
        let (tx, catalog) = watch::channel(first);
        let poller = tokio::spawn(async move {
            let mut tick = tokio::time::interval(poll);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Some(next) = loader.scan() {
                    tx.send_replace(next);
                }
            }
        });
        Ok(Manifests {
            dir: dir.to_path_buf(),
            catalog,
            allowed,
            poller,
        })
    }
}

impl Source for Manifests {
    async fn resolve(&self, selector: &Selector) -> Result<Selector, SourceError> {
        let catalog = self.catalog.borrow().clone();
        let kind = catalog
            .kind(&selector.kind.group, &selector.kind.resource)
            .ok_or_else(|| {
                SourceError::UnknownKind(format!(
                    "no CRD in {} defines {}.{}",
                    self.dir.display(),
                    selector.kind.resource,
                    selector.kind.group
                ))
            })?;
        let version = match &selector.kind.version {
            Some(v) if kind.versions.contains(v) => v.clone(),
            Some(v) => {
                return Err(SourceError::UnknownKind(format!(
                    "{}.{} is not served at version {v} (served: {})",
                    kind.names.plural,
                    kind.names.group,
                    kind.versions.join(", ")
                )));
            }
            None => kind.versions.first().cloned().unwrap_or_default(),
        };
        kind.names.canonical(selector, &version, &self.allowed)
    }

    async fn check(&self) -> Result<(), String> {
        std::fs::read_dir(&self.dir)
            .map(|_| ())
            .map_err(|e| format!("cannot read {}: {e}", self.dir.display()))
    }

    fn watch(&self, selector: &Selector) -> BoxStream<'static, Result<Observed, SourceError>> {
        let selector = selector.clone();
        let rx = self.catalog.clone();
        stream::unfold((rx, true), move |(mut rx, first)| {
            let selector = selector.clone();
            async move {
                if !first && rx.changed().await.is_err() {
                    return None;
                }
                let observed = rx.borrow_and_update().lookup(&selector);
                Some((Ok(observed), (rx, false)))
            }
        })
        .boxed()
    }
}

/// A file's parsed documents and what they were read from.
struct FileState {
    stamp: (SystemTime, u64),
    docs: Vec<Value>,
}

/// Reads the directory into catalogs.
struct Loader {
    dir: PathBuf,
    files: BTreeMap<PathBuf, FileState>,
    /// The stamp of each file's last failed read, so a broken file is reported once.
    failed: HashMap<PathBuf, (SystemTime, u64)>,
    objects: HashMap<Key, Stored>,
    next_rv: u64,
    kinds: Vec<ManifestKind>,
}

impl Loader {
    fn new(dir: PathBuf) -> Self {
        Loader {
            dir,
            files: BTreeMap::new(),
            failed: HashMap::new(),
            objects: HashMap::new(),
            next_rv: 1,
            kinds: Vec::new(),
        }
    }

    /// Re-reads changed files; a new catalog if anything that is served changed.
    fn scan(&mut self) -> Option<Arc<Catalog>> {
        let mut seen = Vec::new();
        let mut changed = false;
        for path in manifest_files(&self.dir) {
            let Ok(meta) = std::fs::metadata(&path) else {
                continue;
            };
            let stamp = (
                meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                meta.len(),
            );
            seen.push(path.clone());
            if self.files.get(&path).is_some_and(|f| f.stamp == stamp)
                || self.failed.get(&path) == Some(&stamp)
            {
                continue;
            }
            match read_docs(&path) {
                Ok(docs) => {
                    self.failed.remove(&path);
                    self.files.insert(path, FileState { stamp, docs });
                    changed = true;
                }
                Err(error) => {
                    tracing::warn!(file = %path.display(), %error, "cannot parse manifest; keeping its last good contents");
                    self.failed.insert(path, stamp);
                }
            }
        }
        let before = self.files.len();
        self.files.retain(|path, _| seen.contains(path));
        changed |= self.files.len() != before;
        if !changed {
            return None;
        }
        self.rebuild()
    }

    /// Builds the catalog from every file's documents; `None` if it serves the same as before.
    fn rebuild(&mut self) -> Option<Arc<Catalog>> {
        let docs: Vec<(&Path, &Value)> = self
            .files
            .iter()
            .flat_map(|(path, f)| f.docs.iter().map(move |d| (path.as_path(), d)))
            .collect();
        let kinds: Vec<ManifestKind> = docs
            .iter()
            .filter(|(_, d)| is_crd(d))
            .filter_map(|(path, d)| {
                let kind = crd_kind(d);
                if kind.is_none() {
                    tracing::warn!(file = %path.display(), "skipping a CRD without group, names, scope or served versions");
                }
                kind
            })
            .collect();
        // Sorted, so resourceVersions are handed out in a stable order.
        let mut written: BTreeMap<Key, Value> = BTreeMap::new();
        for (path, doc) in docs.iter().filter(|(_, d)| !is_crd(d)) {
            match key_of(&kinds, doc) {
                Ok(key) => {
                    if written.insert(key.clone(), (*doc).clone()).is_some() {
                        tracing::warn!(file = %path.display(), object = ?key, "object defined twice; the later file wins");
                    }
                }
                Err(why) => tracing::warn!(file = %path.display(), "skipping a document: {why}"),
            }
        }
        let mut objects = HashMap::new();
        let mut moved = kinds != self.kinds || written.len() != self.objects.len();
        for (key, doc) in written {
            let stored = match self.objects.remove(&key) {
                Some(old) if old.written == doc => old,
                old => {
                    moved = true;
                    let rv = self.next_rv;
                    self.next_rv += 1;
                    serve(&key, doc, rv, old.as_ref())
                }
            };
            objects.insert(key, stored);
        }
        moved |= !self.objects.is_empty();
        self.objects = objects.clone();
        self.kinds = kinds.clone();
        moved.then(|| Arc::new(Catalog { kinds, objects }))
    }
}

/// The object as an API server would serve it: the server's metadata added.
fn serve(key: &Key, doc: Value, rv: u64, old: Option<&Stored>) -> Stored {
    let mut served = doc.clone();
    let old_meta = old.map(|o| &o.served["metadata"]);
    let keep = |field: &str, fresh: Value| {
        old_meta
            .and_then(|m| m.get(field).cloned())
            .unwrap_or(fresh)
    };
    let generation = match old {
        Some(o) if spec_of(&o.written) == spec_of(&doc) => keep("generation", json!(1)),
        Some(o) => json!(o.served["metadata"]["generation"].as_i64().unwrap_or(0) + 1),
        None => json!(1),
    };
    let meta = &mut served["metadata"];
    meta["uid"] = keep("uid", json!(uuid::Uuid::new_v4().to_string()));
    meta["creationTimestamp"] = keep(
        "creationTimestamp",
        json!(humantime::format_rfc3339_seconds(SystemTime::now()).to_string()),
    );
    meta["resourceVersion"] = json!(rv.to_string());
    meta["generation"] = generation;
    if !key.2.is_empty() {
        meta["namespace"] = json!(key.2);
    }
    Stored {
        object: Object::from_value(&served),
        written: doc,
        served,
    }
}

fn spec_of(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("metadata");
        o.remove("status");
    }
    v
}

fn manifest_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let hidden = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with('.'));
            if hidden {
                continue;
            }
            if path.is_dir() {
                pending.push(path);
            } else if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml" | "json")
            ) {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

fn read_docs(path: &Path) -> Result<Vec<Value>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let mut docs = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let value: Value = serde::Deserialize::deserialize(doc).map_err(|e| e.to_string())?;
        match value {
            Value::Null => {}
            Value::Object(ref o) if o.get("kind").and_then(Value::as_str) == Some("List") => {
                docs.extend(
                    o.get("items")
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default(),
                );
            }
            Value::Object(_) => docs.push(value),
            _ => return Err("a document is not a mapping".to_string()),
        }
    }
    Ok(docs)
}

fn is_crd(doc: &Value) -> bool {
    doc["kind"] == "CustomResourceDefinition"
        && doc["apiVersion"]
            .as_str()
            .is_some_and(|v| v.starts_with("apiextensions.k8s.io/"))
}

fn crd_kind(crd: &Value) -> Option<ManifestKind> {
    let spec = &crd["spec"];
    let names = &spec["names"];
    let text = |v: &Value| v.as_str().map(str::to_string);
    let kind = text(&names["kind"])?;
    let namespaced = match spec["scope"].as_str()? {
        "Namespaced" => true,
        "Cluster" => false,
        _ => return None,
    };
    let mut versions: Vec<String> = spec["versions"]
        .as_array()?
        .iter()
        .filter(|v| v["served"].as_bool() == Some(true))
        .filter_map(|v| text(&v["name"]))
        .collect();
    if versions.is_empty() {
        return None;
    }
    versions.sort_by_key(|v| version_priority(v));
    Some(ManifestKind {
        names: KindNames {
            group: text(&spec["group"])?,
            plural: text(&names["plural"])?,
            singular: text(&names["singular"]).unwrap_or_else(|| kind.to_lowercase()),
            short_names: names["shortNames"]
                .as_array()
                .map(|a| a.iter().filter_map(text).collect())
                .unwrap_or_default(),
            kind,
            namespaced,
        },
        versions,
    })
}

/// Sorts versions as Kubernetes prefers them: GA, then beta, then alpha, newest first; other
/// names last, alphabetically.
fn version_priority(v: &str) -> (u8, std::cmp::Reverse<u64>, std::cmp::Reverse<u64>, String) {
    let parsed = v.strip_prefix('v').and_then(|rest| {
        let digits = rest.chars().take_while(char::is_ascii_digit).count();
        let major: u64 = rest[..digits].parse().ok()?;
        let tail = &rest[digits..];
        let (rank, minor) = if tail.is_empty() {
            (0, 0)
        } else if let Some(n) = tail.strip_prefix("beta") {
            (1, n.parse().ok()?)
        } else {
            (2, tail.strip_prefix("alpha")?.parse().ok()?)
        };
        Some((rank, major, minor))
    });
    match parsed {
        Some((rank, major, minor)) => (
            rank,
            std::cmp::Reverse(major),
            std::cmp::Reverse(minor),
            String::new(),
        ),
        None => (3, std::cmp::Reverse(0), std::cmp::Reverse(0), v.to_string()),
    }
}

/// Where a custom resource document goes, or why it cannot be served.
fn key_of(kinds: &[ManifestKind], doc: &Value) -> Result<Key, String> {
    let api_version = doc["apiVersion"].as_str().ok_or("no apiVersion")?;
    let kind = doc["kind"].as_str().ok_or("no kind")?;
    let (group, version) = api_version
        .split_once('/')
        .ok_or_else(|| format!("{kind} {api_version} is not a custom resource (no group)"))?;
    let found = kinds
        .iter()
        .find(|k| k.names.group == group && k.names.kind == kind)
        .ok_or_else(|| format!("no CRD in the directory defines {kind} in {group}"))?;
    if !found.versions.iter().any(|v| v == version) {
        return Err(format!("{kind} is not served at {api_version}"));
    }
    let name = doc["metadata"]["name"]
        .as_str()
        .filter(|n| crate::selector::is_dns_subdomain(n))
        .ok_or_else(|| format!("{kind} has no valid metadata.name"))?;
    let namespace = if found.names.namespaced {
        doc["metadata"]["namespace"].as_str().unwrap_or("default")
    } else {
        ""
    };
    Ok((
        group.to_string(),
        found.names.plural.clone(),
        namespace.to_string(),
        name.to_string(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CRD: &str = include_str!("../../examples/manifests/featureflag-crd.yaml");

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
    }

    fn flag(name: &str, variant: &str) -> String {
        format!(
            "apiVersion: core.openfeature.dev/v1beta1\nkind: FeatureFlag\nmetadata:\n  name: {name}\nspec:\n  flagSpec:\n    flags:\n      f:\n        state: ENABLED\n        variants: {{a: true, b: false}}\n        defaultVariant: {variant}\n"
        )
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
        let mut loader = Loader::new(dir.path().to_path_buf());
        let catalog = loader.scan().expect("a first catalog");
        assert_eq!(catalog.kinds.len(), 1);
        let a = &catalog.objects[&key("a")];
        assert_eq!(a.served["metadata"]["namespace"], "default");
        assert_eq!(a.served["metadata"]["generation"], 1);
        assert!(!a.object.uid.is_empty());
        assert!(loader.scan().is_none(), "nothing changed");
    }

    #[test]
    fn edits_move_the_resource_version_and_keep_the_uid() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "crd.yaml", CRD);
        write(dir.path(), "a.yaml", &flag("a", "a"));
        let mut loader = Loader::new(dir.path().to_path_buf());
        let first = loader.scan().unwrap().objects[&key("a")].object.clone();
        std::thread::sleep(Duration::from_millis(10));
        write(dir.path(), "a.yaml", &flag("a", "b"));
        let catalog = loader.scan().expect("the edit is seen");
        let second = &catalog.objects[&key("a")];
        assert_eq!(second.object.uid, first.uid);
        assert_ne!(second.object.resource_version, first.resource_version);
        assert_eq!(second.served["metadata"]["generation"], 2);
        std::fs::remove_file(dir.path().join("a.yaml")).unwrap();
        assert!(
            loader
                .scan()
                .expect("the delete is seen")
                .objects
                .is_empty()
        );
    }

    #[test]
    fn a_broken_file_keeps_its_last_good_contents() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "crd.yaml", CRD);
        write(dir.path(), "a.yaml", &flag("a", "a"));
        let mut loader = Loader::new(dir.path().to_path_buf());
        loader.scan().unwrap();
        write(dir.path(), "a.yaml", "apiVersion: [unclosed");
        assert!(loader.scan().is_none(), "nothing served changes");
        assert!(loader.objects.contains_key(&key("a")));
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
}
