//! The directory served as a [`Source`]: the polling thread publishes each new catalog, and
//! every watch reads its resource (or set) out of the newest.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::{self, BoxStream};
use tokio::sync::watch;

use super::catalog::Catalog;
use super::scan::{Loader, LoaderShared};
use crate::selector::{KindRef, Selector, Set};
use crate::source::{Observed, SetEvent, Source, SourceError};
use crate::sync::lock;

/// Custom resources from a directory of manifests.
pub struct Manifests {
    pub(super) dir: PathBuf,
    pub(super) catalog: watch::Receiver<Arc<Catalog>>,
    pub(super) allowed: Vec<KindRef>,
    pub(super) shared: Arc<LoaderShared>,
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

    fn kinds(&self) -> Vec<String> {
        self.allowed.iter().map(KindRef::unversioned).collect()
    }

    /// The set's members after every change to the directory (the stream's reader tells the
    /// changes apart).
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
