//! The manifests source: a directory of YAML (or JSON) manifests — CRDs and custom resources —
//! served as if it were an API server. Adding, editing or removing a file behaves like a create,
//! update or delete. It is the embedded default for running without a cluster.
//!
//! The directory is polled on a thread of its own (see ADR 0006): each poll lists the files and
//! re-reads only those whose stamp (size, times, inode) changed, and takes a change only once two
//! polls in a row see the file the same, so an editor that truncates before it writes, or a
//! half-written file, is never served. A file that fails to parse, or is over the size or
//! nesting limits, keeps its last good contents and is reported once per change. A directory that
//! cannot be read keeps the last good state and counts as an outage of the source. Links are
//! followed only inside the directory, each directory once, [`MAX_DIR_DEPTH`] levels at most.
//! Objects get what an API server would give them: a `uid` that lasts while the object exists
//! (across edits, and moves between files), a `resourceVersion` that moves on every change,
//! `creationTimestamp`, `generation`, and the namespace `default` when none is written.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::{self, BoxStream};
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tokio::sync::watch;

use super::{KindNames, Object, Observed, Set, SetEvent, Source, SourceError, lock};
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

/// A SHA-256 digest.
type Digest = [u8; 32];

/// One document of a file as it is kept: compact JSON, and what the catalog reads out of it.
/// The tree it was parsed into is not kept; that cost about 16 times the file's size.
#[derive(Debug)]
struct Doc {
    json: Bytes,
    /// Of `json`: a rewrite that changes nothing moves no resourceVersion.
    digest: Digest,
    /// Of everything but `metadata` and `status`: what moves `generation`.
    spec: Digest,
    api_version: Option<String>,
    kind: Option<String>,
    name: Option<String>,
    namespace: Option<String>,
    /// For a CRD: the kind it defines, `None` if the CRD is incomplete.
    crd: Option<Option<ManifestKind>>,
}

/// A document's top-level fields, each as its JSON text.
type Fields<'a> = BTreeMap<String, &'a RawValue>;

impl Doc {
    /// Reads a document's fields out of its compact JSON.
    fn new(json: Vec<u8>) -> Result<Doc, String> {
        let fields: Fields =
            serde_json::from_slice(&json).map_err(|_| "a document is not a mapping".to_string())?;
        let text = |field: &str| {
            fields
                .get(field)
                .and_then(|raw| serde_json::from_str::<String>(raw.get()).ok())
        };
        let meta: Value = fields
            .get("metadata")
            .and_then(|raw| serde_json::from_str(raw.get()).ok())
            .unwrap_or_default();
        let meta_text = |field: &str| meta[field].as_str().map(str::to_string);
        let mut spec = ring::digest::Context::new(&ring::digest::SHA256);
        for (field, raw) in fields
            .iter()
            .filter(|(f, _)| *f != "metadata" && *f != "status")
        {
            for part in [field.as_bytes(), b"\0", raw.get().as_bytes(), b"\0"] {
                spec.update(part);
            }
        }
        let api_version = text("apiVersion");
        let kind = text("kind");
        let is_crd = kind.as_deref() == Some("CustomResourceDefinition")
            && api_version
                .as_deref()
                .is_some_and(|v| v.starts_with("apiextensions.k8s.io/"));
        let crd = is_crd.then(|| {
            serde_json::from_slice::<Value>(&json)
                .ok()
                .and_then(|v| crd_kind(&v))
        });
        Ok(Doc {
            digest: sha256(&json),
            spec: digest_of(spec),
            api_version,
            kind,
            name: meta_text("name"),
            namespace: meta_text("namespace"),
            crd,
            json: Bytes::from(json),
        })
    }
}

fn sha256(bytes: &[u8]) -> Digest {
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    context.update(bytes);
    digest_of(context)
}

fn digest_of(context: ring::digest::Context) -> Digest {
    context.finish().as_ref().try_into().unwrap_or([0; 32])
}

/// `json` (an object) with its top-level `field` set to `value`.
fn with_field(json: &[u8], field: &str, value: &Value) -> Result<Vec<u8>, String> {
    let mut fields: Fields = serde_json::from_slice(json).map_err(|e| e.to_string())?;
    let value = serde_json::value::to_raw_value(value).map_err(|e| e.to_string())?;
    fields.insert(field.to_string(), &value);
    serde_json::to_vec(&fields).map_err(|e| e.to_string())
}

/// One object as served, with what its next version keeps.
#[derive(Debug)]
struct Stored {
    /// The digests of the document it was served from.
    digest: Digest,
    spec: Digest,
    api_version: String,
    created: String,
    generation: i64,
    object: Object,
}

/// Everything the directory holds at one moment.
#[derive(Debug, Default)]
struct Catalog {
    kinds: Vec<ManifestKind>,
    objects: Arc<HashMap<Key, Arc<Stored>>>,
}

impl Catalog {
    fn kind(&self, group: &str, resource: &str) -> Option<&ManifestKind> {
        self.kinds
            .iter()
            .find(|k| k.names.group == group && k.names.answers_to(resource))
    }

    /// The objects of `set`, by name.
    fn members(&self, set: &Set) -> Vec<(String, Object)> {
        let namespace = set.namespace.clone().unwrap_or_default();
        let mut members: Vec<(String, Object)> = self
            .objects
            .iter()
            .filter(|((group, plural, ns, _), _)| {
                *group == set.kind.group
                    && *plural == set.kind.resource
                    && (*ns == namespace || set.all_namespaces())
            })
            .filter_map(|((_, _, ns, name), _)| {
                let key = set.key(ns, name);
                let Observed::Present(object) = self.lookup(&set.member(&key)) else {
                    return None;
                };
                let labels: BTreeMap<String, String> =
                    serde_json::from_slice::<Value>(&object.json)
                        .ok()
                        .and_then(|v| serde_json::from_value(v["metadata"]["labels"].clone()).ok())
                        .unwrap_or_default();
                set.labels.matches(&labels).then_some((key, object))
            })
            .collect();
        members.sort_by(|a, b| a.0.cmp(&b.0));
        members
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
        if stored.api_version == api_version {
            return Observed::Present(stored.object.clone());
        }
        // Another served version: the same object under that apiVersion (no conversion).
        match with_field(&stored.object.json, "apiVersion", &json!(api_version)) {
            Ok(json) => Observed::Present(Object {
                json: Bytes::from(json),
                ..stored.object.clone()
            }),
            Err(_) => Observed::Present(stored.object.clone()),
        }
    }
}

/// The largest manifest file read: as large as the largest message flagd clients take (no
/// Kubernetes object is over 1.5 MiB). Parsing YAML costs up to about a hundred times a
/// document's size in memory while it runs; JSON, a few times.
pub const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;

/// The deepest nesting (mappings, sequences and flow collections) read in a manifest.
pub const MAX_NESTING: usize = 64;

/// The deepest directory level below the root that is read.
pub const MAX_DIR_DEPTH: usize = 16;

/// Custom resources from a directory of manifests.
pub struct Manifests {
    dir: PathBuf,
    catalog: watch::Receiver<Arc<Catalog>>,
    allowed: Vec<KindRef>,
    shared: Arc<LoaderShared>,
}

/// What the polling thread tells the source.
#[derive(Default)]
struct LoaderShared {
    /// Why the directory cannot be read now, if it cannot.
    outage: Mutex<Option<String>>,
    /// Files that are not served, and why.
    problems: Mutex<BTreeMap<PathBuf, String>>,
    stop: AtomicBool,
}

impl Drop for Manifests {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
    }
}

impl Manifests {
    /// Loads `dir` and keeps polling it every `poll`, on a thread of its own (reading and
    /// parsing files blocks). Fails if the directory cannot be read.
    pub fn open(dir: &Path, poll: Duration, allowed: Vec<KindRef>) -> std::io::Result<Self> {
        let shared = Arc::new(LoaderShared::default());
        let mut loader = Loader::new(dir, shared.clone())?;
        let first = loader.scan(true).unwrap_or_default();
        tracing::info!(
            dir = %dir.display(),
            kinds = first.kinds.len(),
            objects = first.objects.len(),
            "manifests loaded"
        );
        let (tx, catalog) = watch::channel(first);
        let polling = shared.clone();
        std::thread::Builder::new()
            .name("manifests".into())
            .spawn(move || {
                while !polling.stop.load(Ordering::Relaxed) && !tx.is_closed() {
                    std::thread::sleep(poll);
                    if let Some(next) = loader.scan(false) {
                        tx.send_replace(next);
                    }
                }
            })?;
        Ok(Manifests {
            dir: dir.to_path_buf(),
            catalog,
            allowed,
            shared,
        })
    }

    /// Files in the directory that are not served, and why (too large, too deep, unparsable,
    /// a link out of the directory, …).
    pub fn problems(&self) -> BTreeMap<PathBuf, String> {
        lock(&self.shared.problems).clone()
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

    /// Fails while the directory cannot be read: the last good state is served meanwhile, and
    /// readiness treats it as an outage of the source (`--max-staleness`).
    async fn check(&self) -> Result<(), String> {
        match lock(&self.shared.outage).clone() {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }

    /// The set's members after every change to the directory (the stream's reader tells the
    /// changes apart).
    fn kinds(&self) -> Vec<String> {
        self.allowed
            .iter()
            .map(|k| format!("{}.{}", k.resource, k.group))
            .collect()
    }

    fn watch_set(&self, set: &Set) -> BoxStream<'static, SetEvent> {
        let set = set.clone();
        let rx = self.catalog.clone();
        stream::unfold((rx, true), move |(mut rx, first)| {
            let set = set.clone();
            async move {
                if !first && rx.changed().await.is_err() {
                    return None;
                }
                let members = rx.borrow_and_update().members(&set);
                Some((SetEvent::Listed(members), (rx, false)))
            }
        })
        .boxed()
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

/// What tells a file's contents apart between polls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    modified: SystemTime,
    changed: (i64, i64),
    len: u64,
    inode: u64,
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            changed: (meta.ctime(), meta.ctime_nsec()),
            len: meta.len(),
            inode: meta.ino(),
        }
    }
}

/// A file's documents as last taken.
struct Taken {
    stamp: Stamp,
    docs: Vec<Arc<Doc>>,
}

/// The manifest files one poll found.
#[derive(Default)]
struct Listing {
    files: HashMap<PathBuf, Stamp>,
    /// Directories below the root that could not be read: their files are not taken as gone.
    unreadable: Vec<PathBuf>,
    /// Entries left out, and why.
    skipped: BTreeMap<PathBuf, String>,
}

/// Lists the manifest files under `root` (canonical): hidden entries left out; links followed
/// only to places inside `root`, each directory once; at most [`MAX_DIR_DEPTH`] levels.
fn list(root: &Path) -> std::io::Result<Listing> {
    let mut listing = Listing::default();
    let mut visited: HashSet<PathBuf> = HashSet::from([root.to_path_buf()]);
    let mut targets: HashSet<PathBuf> = HashSet::new();
    let mut pending = vec![(root.to_path_buf(), 0usize)];
    while let Some((dir, depth)) = pending.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if depth == 0 => return Err(e),
            Err(_) => {
                listing.unreadable.push(dir);
                continue;
            }
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if entry
                .file_name()
                .to_str()
                .is_none_or(|n| n.starts_with('.'))
            {
                continue;
            }
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            let (real, meta) = if kind.is_symlink() {
                let Ok(target) = std::fs::canonicalize(&path) else {
                    continue; // dangling
                };
                if !target.starts_with(root) {
                    listing.skipped.insert(
                        path,
                        "a link to outside the directory: not followed".to_string(),
                    );
                    continue;
                }
                let Ok(meta) = std::fs::metadata(&target) else {
                    continue;
                };
                (target, meta)
            } else {
                let Ok(meta) = entry.metadata() else { continue };
                (path.clone(), meta)
            };
            if meta.is_dir() {
                let real = if kind.is_symlink() {
                    real
                } else {
                    std::fs::canonicalize(&path).unwrap_or(real)
                };
                if depth + 1 > MAX_DIR_DEPTH {
                    listing.skipped.insert(
                        path,
                        format!("more than {MAX_DIR_DEPTH} directory levels deep: not read"),
                    );
                } else if visited.insert(real) {
                    pending.push((path, depth + 1));
                }
            } else if meta.is_file()
                && matches!(
                    path.extension().and_then(|e| e.to_str()),
                    Some("yaml" | "yml" | "json")
                )
                && (!kind.is_symlink() || targets.insert(real))
            {
                listing.files.insert(path, Stamp::of(&meta));
            }
        }
    }
    Ok(listing)
}

/// The directory reader the source polls with, for benchmarks and tools: [`DirectoryScan::open`]
/// reads a directory as the source's first scan does, [`DirectoryScan::poll`] is one poll.
pub struct DirectoryScan(Loader);

impl DirectoryScan {
    /// Reads `dir`.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        let mut loader = Loader::new(dir, Arc::default())?;
        loader.scan(true);
        Ok(DirectoryScan(loader))
    }

    /// Polls once: whether what is served changed.
    pub fn poll(&mut self) -> bool {
        self.0.scan(false).is_some()
    }

    /// Objects served.
    pub fn objects(&self) -> usize {
        self.0.objects.len()
    }
}

/// Reads the directory into catalogs.
struct Loader {
    root: PathBuf,
    shared: Arc<LoaderShared>,
    taken: HashMap<PathBuf, Taken>,
    /// Files seen changed (or, `None`, missing) once: taken at the next poll that sees them so
    /// again, so a half-written or briefly truncated file is never served.
    pending: HashMap<PathBuf, Option<Stamp>>,
    /// The stamp of each file's last failed read, so a broken file is reported once.
    failed: HashMap<PathBuf, Stamp>,
    /// What the last catalog serves (shared with it).
    objects: Arc<HashMap<Key, Arc<Stored>>>,
    next_rv: u64,
    kinds: Vec<ManifestKind>,
}

impl Loader {
    fn new(dir: &Path, shared: Arc<LoaderShared>) -> std::io::Result<Self> {
        let root = std::fs::canonicalize(dir)?;
        std::fs::read_dir(&root)?;
        Ok(Loader {
            root,
            shared,
            taken: HashMap::new(),
            pending: HashMap::new(),
            failed: HashMap::new(),
            objects: Arc::default(),
            next_rv: 1,
            kinds: Vec::new(),
        })
    }

    /// Polls the directory; a new catalog if anything that is served changed. A change to a
    /// file is taken once two polls in a row see it the same (at once on the `first` scan). A
    /// directory that cannot be read changes nothing, and is reported as an outage.
    fn scan(&mut self, first: bool) -> Option<Arc<Catalog>> {
        let listing = match list(&self.root) {
            Ok(listing) => {
                if lock(&self.shared.outage).take().is_some() {
                    tracing::info!(dir = %self.root.display(), "the manifests directory can be read again");
                }
                listing
            }
            Err(e) => {
                let why = format!(
                    "cannot read the manifests directory {}: {e}; serving its last good state",
                    self.root.display()
                );
                let mut outage = lock(&self.shared.outage);
                if outage.is_none() {
                    tracing::warn!("{why}");
                }
                *outage = Some(why);
                return None;
            }
        };
        let mut problems = listing.skipped.clone();
        let mut changed = false;
        for (path, stamp) in &listing.files {
            if self.taken.get(path).is_some_and(|t| t.stamp == *stamp) {
                self.pending.remove(path);
                continue;
            }
            if self.failed.get(path) == Some(stamp) {
                if let Some(why) = lock(&self.shared.problems).get(path) {
                    problems.insert(path.clone(), why.clone());
                }
                continue;
            }
            if !first && self.pending.get(path) != Some(&Some(*stamp)) {
                self.pending.insert(path.clone(), Some(*stamp));
                continue;
            }
            self.pending.remove(path);
            match read_docs(path, stamp.len) {
                Ok(docs) => {
                    self.failed.remove(path);
                    self.taken.insert(
                        path.clone(),
                        Taken {
                            stamp: *stamp,
                            docs,
                        },
                    );
                    changed = true;
                }
                Err(error) => {
                    tracing::warn!(file = %path.display(), %error, "cannot read manifest; keeping its last good contents");
                    self.failed.insert(path.clone(), *stamp);
                    problems.insert(path.clone(), error);
                }
            }
        }
        let gone: Vec<PathBuf> = self
            .taken
            .keys()
            .filter(|p| {
                !listing.files.contains_key(*p)
                    && !listing.unreadable.iter().any(|d| p.starts_with(d))
            })
            .cloned()
            .collect();
        for path in gone {
            if first || self.pending.get(&path) == Some(&None) {
                self.taken.remove(&path);
                self.pending.remove(&path);
                changed = true;
            } else {
                self.pending.insert(path, None);
            }
        }
        let taken = &self.taken;
        self.pending
            .retain(|p, s| listing.files.contains_key(p) || (s.is_none() && taken.contains_key(p)));
        self.failed.retain(|p, _| listing.files.contains_key(p));
        *lock(&self.shared.problems) = problems;
        if !changed {
            return None;
        }
        self.rebuild()
    }

    /// Builds the catalog from every file's documents; `None` if it serves the same as before.
    /// Files not re-read keep their parsed documents, and objects whose document did not change
    /// keep their served form: a change costs the pointers of the rest, not their parsing.
    fn rebuild(&mut self) -> Option<Arc<Catalog>> {
        let mut paths: Vec<&PathBuf> = self.taken.keys().collect();
        paths.sort();
        let docs: Vec<(&Path, &Arc<Doc>)> = paths
            .iter()
            .flat_map(|p| self.taken[*p].docs.iter().map(move |d| (p.as_path(), d)))
            .collect();
        let kinds: Vec<ManifestKind> = docs
            .iter()
            .filter_map(|(path, d)| {
                let kind = d.crd.clone()?;
                if kind.is_none() {
                    tracing::warn!(file = %path.display(), "skipping a CRD without group, names, scope or served versions");
                }
                kind
            })
            .collect();
        let mut written: BTreeMap<Key, &Arc<Doc>> = BTreeMap::new();
        for (path, doc) in docs.iter().filter(|(_, d)| d.crd.is_none()) {
            match key_of(&kinds, doc) {
                Ok(key) => {
                    if written.insert(key.clone(), *doc).is_some() {
                        tracing::warn!(file = %path.display(), object = ?key, "object defined twice; the later file wins");
                    }
                }
                Err(why) => tracing::warn!(file = %path.display(), "skipping a document: {why}"),
            }
        }
        let mut moved = kinds != self.kinds || written.len() != self.objects.len();
        let mut objects = HashMap::with_capacity(written.len());
        // Sorted, so resourceVersions are handed out in a stable order.
        for (key, doc) in written {
            let stored = match self.objects.get(&key) {
                Some(old) if old.digest == doc.digest => old.clone(),
                old => {
                    let rv = self.next_rv;
                    match serve(&key, doc, rv, old.map(|o| &**o)) {
                        Ok(stored) => {
                            moved = true;
                            self.next_rv += 1;
                            Arc::new(stored)
                        }
                        Err(why) => {
                            tracing::warn!(object = ?key, "cannot serve: {why}");
                            continue;
                        }
                    }
                }
            };
            objects.insert(key, stored);
        }
        moved |= self.objects.keys().any(|k| !objects.contains_key(k));
        let objects = Arc::new(objects);
        self.kinds = kinds.clone();
        self.objects = objects.clone();
        moved.then(|| Arc::new(Catalog { kinds, objects }))
    }
}

/// The object as an API server would serve it: the server's metadata added, and the uid,
/// creation time and (unless the spec changed) generation of the `old` one kept.
fn serve(key: &Key, doc: &Doc, rv: u64, old: Option<&Stored>) -> Result<Stored, String> {
    let fields: Fields = serde_json::from_slice(&doc.json).map_err(|e| e.to_string())?;
    let mut meta: Value = fields
        .get("metadata")
        .and_then(|raw| serde_json::from_str(raw.get()).ok())
        .unwrap_or_else(|| json!({}));
    let generation = match old {
        Some(o) if o.spec == doc.spec => o.generation,
        Some(o) => o.generation + 1,
        None => 1,
    };
    let uid = old.map_or_else(
        || uuid::Uuid::new_v4().to_string(),
        |o| o.object.uid.clone(),
    );
    let created = old.map_or_else(
        || humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
        |o| o.created.clone(),
    );
    meta["uid"] = json!(uid);
    meta["creationTimestamp"] = json!(created);
    meta["resourceVersion"] = json!(rv.to_string());
    meta["generation"] = json!(generation);
    if !key.2.is_empty() {
        meta["namespace"] = json!(key.2);
    }
    let json = with_field(&doc.json, "metadata", &meta)?;
    Ok(Stored {
        digest: doc.digest,
        spec: doc.spec,
        api_version: doc.api_version.clone().unwrap_or_default(),
        created,
        generation,
        object: Object {
            json: Bytes::from(json),
            uid,
            resource_version: rv.to_string(),
        },
    })
}

/// A file's documents, within the size and nesting limits. Each document is carried straight
/// from the parser into compact JSON, with no tree in between.
fn read_docs(path: &Path, len: u64) -> Result<Vec<Arc<Doc>>, String> {
    let too_large =
        |len: u64| format!("{len} bytes: a manifest file may have at most {MAX_FILE_BYTES} bytes");
    if len > MAX_FILE_BYTES {
        return Err(too_large(len));
    }
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large(text.len() as u64));
    }
    let json = path.extension().is_some_and(|e| e == "json");
    if let Some(line) = too_deep(&text, MAX_NESTING, json) {
        return Err(format!(
            "nested more than {MAX_NESTING} levels deep (line {line})"
        ));
    }
    if json {
        let mut parser = serde_json::Deserializer::from_str(&text);
        let doc = crate::yaml::compact(&mut parser).map_err(|e| e.to_string())?;
        parser.end().map_err(|e| e.to_string())?;
        return documents([doc]);
    }
    documents(crate::yaml::documents_as_json(&text)?)
}

/// The objects of a file's documents: `List`s unpacked, empty documents skipped.
fn documents(values: impl IntoIterator<Item = Vec<u8>>) -> Result<Vec<Arc<Doc>>, String> {
    let mut docs = Vec::new();
    for json in values {
        if json == b"null" {
            continue;
        }
        let doc = Doc::new(json)?;
        if doc.kind.as_deref() != Some("List") {
            docs.push(Arc::new(doc));
            continue;
        }
        let fields: Fields = serde_json::from_slice(&doc.json).map_err(|e| e.to_string())?;
        let items: Vec<&RawValue> = match fields.get("items") {
            Some(raw) => serde_json::from_str(raw.get())
                .map_err(|_| "a List's items are not a sequence".to_string())?,
            None => Vec::new(),
        };
        for item in items {
            docs.push(Arc::new(Doc::new(item.get().as_bytes().to_vec())?));
        }
    }
    Ok(docs)
}

/// The first line where `text` nests deeper than `max` — block indentation and `- ` items (for
/// YAML) plus flow brackets — found in one pass before the parser, whose cost grows with the
/// depth, ever sees it.
fn too_deep(text: &str, max: usize, json: bool) -> Option<usize> {
    let mut indents: Vec<usize> = Vec::new();
    let mut flow = 0usize;
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let mut depth = 0;
        if !json && flow == 0 && !trimmed.is_empty() && !trimmed.starts_with('#') {
            let indent = line.len() - trimmed.len();
            while indents.last().is_some_and(|&i| i >= indent) {
                indents.pop();
            }
            indents.push(indent);
            let dashes = trimmed
                .split_inclusive(' ')
                .take_while(|w| *w == "- ")
                .count();
            depth = indents.len() + dashes;
        }
        let (mut single, mut double, mut escaped) = (false, false, false);
        let mut previous = ' ';
        for c in trimmed.chars() {
            match c {
                _ if escaped => escaped = false,
                '\\' if double => escaped = true,
                '"' if !single => double = !double,
                '\'' if !double => single = !single,
                '#' if !json && !single && !double && previous == ' ' => break,
                '[' | '{' if !single && !double => flow += 1,
                ']' | '}' if !single && !double => flow = flow.saturating_sub(1),
                _ => {}
            }
            previous = c;
            if depth.max(indents.len()) + flow > max {
                return Some(n + 1);
            }
        }
        if depth > max {
            return Some(n + 1);
        }
    }
    None
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
fn key_of(kinds: &[ManifestKind], doc: &Doc) -> Result<Key, String> {
    let api_version = doc.api_version.as_deref().ok_or("no apiVersion")?;
    let kind = doc.kind.as_deref().ok_or("no kind")?;
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
    let name = doc
        .name
        .as_deref()
        .filter(|n| crate::selector::is_dns_subdomain(n))
        .ok_or_else(|| format!("{kind} has no valid metadata.name"))?;
    let namespace = if found.names.namespaced {
        doc.namespace.as_deref().unwrap_or("default")
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
        let docs = read_docs(&dir.path().join("list.yaml"), yaml.len() as u64).unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!(
            &docs[1].json[..],
            br#"{"apiVersion":"a/v1","kind":"K","metadata":{"name":"y"},"spec":{"n":1}}"#
        );
        assert_eq!(docs[0].spec, docs[1].spec, "the same spec");
        assert_ne!(docs[0].digest, docs[1].digest, "different objects");
        let json = "{\n  \"apiVersion\": \"a/v1\",\n  \"kind\": \"K\",\n  \"metadata\": {\"name\": \"x\"}\n}\n";
        write(dir.path(), "x.json", json);
        let docs = read_docs(&dir.path().join("x.json"), json.len() as u64).unwrap();
        assert_eq!(
            &docs[0].json[..],
            br#"{"apiVersion":"a/v1","kind":"K","metadata":{"name":"x"}}"#
        );
        write(dir.path(), "two.json", "{} {}");
        assert!(read_docs(&dir.path().join("two.json"), 5).is_err());
        write(dir.path(), "scalar.yaml", "just text\n");
        assert_eq!(
            read_docs(&dir.path().join("scalar.yaml"), 10).unwrap_err(),
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
}
