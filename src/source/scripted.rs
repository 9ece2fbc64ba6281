//! A source fed by its caller: the unit tests' and the benchmarks' stand-in for a cluster. Each
//! watch of a resource or a set is a channel the caller sends into ([`Scripted::send`],
//! [`Scripted::send_set`]); a watch nobody sends into waits forever, as one the source never
//! answers. It counts the watches it started, those still live, and the kinds it forgot.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::mpsc;

use super::{Observed, SetEvent, Source, SourceError};
use crate::selector::{KindRef, Selector, Set};
use crate::sync::lock;

/// See the [module](self). Clones share their watches.
#[derive(Clone, Default)]
pub struct Scripted(Arc<Script>);

/// The live watches of each key, as the channels that feed them.
type Feeds<K, T> = Mutex<HashMap<K, Vec<mpsc::UnboundedSender<T>>>>;

#[derive(Default)]
struct Script {
    feeds: Feeds<Selector, Result<Observed, SourceError>>,
    set_feeds: Feeds<Set, SetEvent>,
    started: AtomicUsize,
    live: Arc<AtomicUsize>,
    forgotten: AtomicUsize,
}

/// Counts a watch as live until its stream is dropped.
struct Live(Arc<AtomicUsize>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Scripted {
    /// Sends `item` to every live watch of `selector` (none: it is lost, as a change nobody
    /// watched).
    pub fn send(&self, selector: &Selector, item: Result<Observed, SourceError>) {
        let mut feeds = lock(&self.0.feeds);
        let list = feeds.entry(selector.clone()).or_default();
        list.retain(|tx| tx.send(item.clone()).is_ok());
    }

    /// Sends `event` to every live watch of `set`.
    pub fn send_set(&self, set: &Set, event: SetEvent) {
        let mut feeds = lock(&self.0.set_feeds);
        let list = feeds.entry(set.clone()).or_default();
        list.retain(|tx| tx.send(event.clone()).is_ok());
    }

    /// Watches started, of resources and sets.
    pub fn started(&self) -> usize {
        self.0.started.load(Ordering::SeqCst)
    }

    /// Watches whose streams are not dropped yet.
    pub fn live(&self) -> usize {
        self.0.live.load(Ordering::SeqCst)
    }

    /// Calls of [`Source::forget`].
    pub fn forgotten(&self) -> usize {
        self.0.forgotten.load(Ordering::SeqCst)
    }

    /// A stream of what is sent into a new feed, live until dropped.
    fn feed<K, T>(&self, feeds: &Feeds<K, T>, key: &K) -> BoxStream<'static, T>
    where
        K: Clone + Eq + std::hash::Hash,
        T: Send + 'static,
    {
        self.0.started.fetch_add(1, Ordering::SeqCst);
        self.0.live.fetch_add(1, Ordering::SeqCst);
        let live = Live(self.0.live.clone());
        let (tx, rx) = mpsc::unbounded_channel();
        lock(feeds).entry(key.clone()).or_default().push(tx);
        futures::stream::unfold((rx, live), |(mut rx, live)| async move {
            let item = rx.recv().await?;
            Some((item, (rx, live)))
        })
        .boxed()
    }
}

impl Source for Scripted {
    async fn resolve(&self, selector: &Selector) -> Result<Selector, SourceError> {
        Ok(selector.clone())
    }

    async fn check(&self) -> Result<(), String> {
        Ok(())
    }

    fn forget(&self, _: &KindRef) {
        self.0.forgotten.fetch_add(1, Ordering::SeqCst);
    }

    fn watch(&self, selector: &Selector) -> BoxStream<'static, Result<Observed, SourceError>> {
        self.feed(&self.0.feeds, selector)
    }

    fn watch_set(&self, set: &Set) -> BoxStream<'static, SetEvent> {
        self.feed(&self.0.set_feeds, set)
    }
}
