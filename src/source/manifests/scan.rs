//! Polling the directory: which files to read (hidden entries left out, links followed only
//! inside the directory, each directory once, [`MAX_DIR_DEPTH`] levels at most), which changes
//! to take (once two polls in a row see a file the same), and the catalog rebuilt from them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use super::catalog::{Catalog, Key, Stored, key_of, serve};
use super::document::ManifestKind;
use super::document::{Doc, open_for_writing, read_docs};
use crate::sync::lock;

/// The deepest directory level below the root that is read.
pub const MAX_DIR_DEPTH: usize = 16;

/// What the polling thread tells the source.
#[derive(Default)]
pub(super) struct LoaderShared {
    /// Why the directory cannot be read now, if it cannot.
    pub(super) outage: Mutex<Option<String>>,
    /// Files that are not served, and why.
    pub(super) problems: Mutex<BTreeMap<PathBuf, String>>,
    pub(super) stop: AtomicBool,
}

/// What tells a file's contents apart between polls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stamp {
    pub(super) modified: SystemTime,
    pub(super) changed: (i64, i64),
    pub(super) len: u64,
    pub(super) inode: u64,
}

impl Stamp {
    pub(super) fn of(meta: &std::fs::Metadata) -> Stamp {
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
pub(super) struct Taken {
    pub(super) stamp: Stamp,
    pub(super) docs: Vec<Arc<Doc>>,
}

/// The manifest files one poll found.
#[derive(Default)]
pub(super) struct Listing {
    pub(super) files: HashMap<PathBuf, Stamp>,
    /// Directories below the root that could not be read: their files are not taken as gone.
    pub(super) unreadable: Vec<PathBuf>,
    /// Entries left out, and why.
    pub(super) skipped: BTreeMap<PathBuf, String>,
}

/// Lists the manifest files under `root` (canonical): hidden entries left out; links followed
/// only to places inside `root`, each directory once; at most [`MAX_DIR_DEPTH`] levels.
pub(super) fn list(root: &Path) -> std::io::Result<Listing> {
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
pub(super) struct Loader {
    pub(super) root: PathBuf,
    pub(super) shared: Arc<LoaderShared>,
    pub(super) taken: HashMap<PathBuf, Taken>,
    /// Files seen changed (or, `None`, missing) once: taken at the next poll that sees them so
    /// again, so a half-written or briefly truncated file is never served.
    pub(super) pending: HashMap<PathBuf, Option<Stamp>>,
    /// The stamp of each file's last failed read, so a broken file is reported once.
    pub(super) failed: HashMap<PathBuf, Stamp>,
    /// What the last catalog serves (shared with it).
    pub(super) objects: Arc<HashMap<Key, Arc<Stored>>>,
    pub(super) next_rv: u64,
    pub(super) kinds: Vec<ManifestKind>,
}

impl Loader {
    pub(super) fn new(dir: &Path, shared: Arc<LoaderShared>) -> std::io::Result<Self> {
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
    pub(super) fn scan(&mut self, first: bool) -> Option<Arc<Catalog>> {
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
            // Unchanged over two polls, but still open for writing: a writer that paused
            // mid-file. Taken once it is closed.
            if !first && let Some(pid) = open_for_writing(path) {
                tracing::debug!(file = %path.display(), pid, "still open for writing; not taken yet");
                continue;
            }
            self.pending.remove(path);
            match read_docs(path, &self.root) {
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
    pub(super) fn rebuild(&mut self) -> Option<Arc<Catalog>> {
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
