//! Adaptive watch granularity (ADR 0015): while more than `--namespace-watch-threshold` names of
//! one kind in one namespace are watched, one watch of the namespace feeds them all instead of a
//! watch each; below half the threshold, each name has its own watch again.
//!
//! Each name's stream follows whichever watch is in use and keeps the one it leaves until the
//! next has caught up: its own watch until the namespace watch has listed, the namespace watch
//! until its own has listed. States are taken only in resourceVersion order (every state comes
//! with the version it holds as of), so no subscriber sees an older state after a newer one,
//! and none is lost: each watch's first state is a quorum LIST. A namespace the API server will
//! not let the broker watch whole (a Role that names objects) stays per object, and so does one
//! where fewer than one object in [`SPARSE`] is watched (the namespace watch would bring the
//! broker every other object's events too).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use futures::StreamExt;
use futures::stream::{self, BoxStream};
use kube::api::{Api, DynamicObject};
use tokio::sync::watch;

use super::follow::{self, Event, Seen, Upstream};
use crate::source::{Object, Observed, SourceError};
use crate::sync::lock;

/// `(group, version, plural, namespace)`.
type Key = (String, String, String, String);

/// The namespace watch's health, which every name it feeds follows.
#[derive(Debug, Clone, Default)]
struct Status {
    /// Whether it has listed (and so knows every object).
    synced: bool,
    /// Failures so far, and the last one while it lasts.
    failures: u64,
    error: Option<SourceError>,
}

/// One name's state as the namespace watch knows it, and the resourceVersion it holds as of.
type Slot = (Observed, String);

/// What the namespace watch knows: every object in the namespace, and a channel for each name
/// followed, so that an event wakes only the stream of the name it is about.
#[derive(Default)]
struct Known {
    rv: String,
    objects: HashMap<String, Object>,
    names: HashMap<String, watch::Sender<Slot>>,
}

impl Known {
    fn slot(&self, name: &str) -> Slot {
        let observed = match self.objects.get(name) {
            Some(object) => Observed::Present(object.clone()),
            None => Observed::Absent,
        };
        (observed, self.rv.clone())
    }

    /// Tells `name`'s stream, if one follows it, what it is now.
    fn tell(&mut self, name: &str) {
        let slot = self.slot(name);
        if let Some(tx) = self.names.get(name) {
            if tx.receiver_count() == 0 {
                self.names.remove(name);
            } else {
                tx.send_replace(slot);
            }
        }
    }
}

struct Shared {
    status: watch::Sender<Status>,
    known: Mutex<Known>,
}

/// A namespace watch, as the names it feeds hold it; it runs while any holds it.
#[derive(Clone)]
struct Feed {
    shared: Arc<Shared>,
    _alive: watch::Receiver<()>,
}

impl Feed {
    /// `name`'s channel, with what is known of it now.
    fn follow(&self, name: &str) -> Followed {
        let mut known = lock(&self.shared.known);
        let slot = known.slot(name);
        let rx = known
            .names
            .entry(name.to_string())
            .or_insert_with(|| watch::channel(slot).0)
            .subscribe();
        Followed {
            rx,
            shared: self.shared.clone(),
            name: name.to_string(),
        }
    }
}

/// One name's channel from the namespace watch. The last one dropped takes the name's entry
/// out of the namespace watch's map, so names nobody follows any more (made-up ones included)
/// do not pile up there while the namespace watch runs on.
struct Followed {
    rx: watch::Receiver<Slot>,
    shared: Arc<Shared>,
    name: String,
}

impl Drop for Followed {
    fn drop(&mut self) {
        let mut known = lock(&self.shared.known);
        // Under the lock every follower subscribes under: its own receiver is the last one.
        if known
            .names
            .get(&self.name)
            .is_some_and(|tx| tx.receiver_count() <= 1)
        {
            known.names.remove(&self.name);
        }
    }
}

/// The names watched in one namespace, and the namespace watch while it is in use.
struct Group {
    names: usize,
    /// `Some` while the namespace watch feeds the names.
    mode: watch::Sender<Option<Feed>>,
    /// The API server refused the namespace watch: per object only, from now on.
    refused: bool,
    /// Names needed for a namespace watch besides the threshold: set when the namespace holds
    /// many more objects than are watched, whose events the broker would receive for nothing.
    at_least: usize,
}

/// A namespace watch is kept only while at least one object in this many is watched: the broker
/// receives every object's events, and per-object watches only those watched.
pub(super) const SPARSE: usize = 4;

/// The groups of one source.
pub(super) struct Granularity {
    /// Names above which one namespace watch replaces theirs; 0: never.
    threshold: usize,
    groups: Mutex<HashMap<Key, Group>>,
}

/// How a name's stream makes the watches it may follow.
pub(super) struct Watches {
    /// This kind in this namespace (for the namespace watch).
    pub namespace: Api<DynamicObject>,
    pub name: String,
    pub what: String,
    pub upstream: Upstream,
    pub key: Key,
}

impl Granularity {
    pub(super) fn new(threshold: usize) -> Arc<Granularity> {
        Arc::new(Granularity {
            threshold,
            groups: Mutex::new(HashMap::new()),
        })
    }

    /// One name's stream; with a threshold of 0, just its own watch.
    pub(super) fn watch(
        self: &Arc<Self>,
        w: Watches,
    ) -> BoxStream<'static, Result<Observed, SourceError>> {
        if self.threshold == 0 {
            return follow::follow(w.namespace, &w.name, w.what, w.upstream);
        }
        let mode = self.join(&w);
        let state = Name {
            own: None,
            own_listed: false,
            feed: None,
            mode,
            last: None,
            rv: String::new(),
            failures: 0,
            failing: false,
            _member: Member {
                granularity: Arc::downgrade(self),
                key: w.key.clone(),
            },
            w,
        };
        stream::unfold(state, Name::next).boxed()
    }

    /// Names the namespace watches running now keep a channel for.
    pub(super) fn followed(&self) -> usize {
        lock(&self.groups)
            .values()
            .filter_map(|g| {
                g.mode
                    .borrow()
                    .as_ref()
                    .map(|f| lock(&f.shared.known).names.len())
            })
            .sum()
    }

    /// Counts a name in; past the threshold, starts the namespace watch.
    fn join(self: &Arc<Self>, w: &Watches) -> watch::Receiver<Option<Feed>> {
        let mut groups = lock(&self.groups);
        let group = groups.entry(w.key.clone()).or_insert_with(|| Group {
            names: 0,
            mode: watch::channel(None).0,
            refused: false,
            at_least: 0,
        });
        group.names += 1;
        if group.names > self.threshold.max(group.at_least)
            && !group.refused
            && group.mode.borrow().is_none()
        {
            tracing::info!(
                namespace = %w.key.3,
                resource = %w.key.2,
                names = group.names,
                "one namespace watch for the names watched here"
            );
            let shared = Arc::new(Shared {
                status: watch::channel(Status::default()).0,
                known: Mutex::default(),
            });
            let (alive, _alive) = watch::channel(());
            let events = follow::events(
                w.namespace.clone(),
                None,
                None,
                format!("{} in namespace {}", w.key.2, w.key.3),
                w.upstream.clone(),
            );
            tokio::spawn(feed(
                events,
                shared.clone(),
                alive,
                Arc::downgrade(self),
                w.key.clone(),
            ));
            group.mode.send_replace(Some(Feed { shared, _alive }));
        }
        group.mode.subscribe()
    }

    /// Counts a name out; below half the threshold, back to a watch per name.
    fn leave(&self, key: &Key) {
        let mut groups = lock(&self.groups);
        let Some(group) = groups.get_mut(key) else {
            return;
        };
        group.names -= 1;
        if group.names == 0 {
            groups.remove(key);
            return;
        }
        if group.names < self.threshold.div_ceil(2) && group.mode.borrow().is_some() {
            tracing::info!(namespace = %key.3, resource = %key.2, names = group.names, "a watch per name again");
            group.mode.send_replace(None);
        }
    }

    /// The namespace watch listed `objects`: with far more objects than names watched, every
    /// name back to its own, until there are names for one object in [`SPARSE`].
    fn listed(&self, key: &Key, objects: usize) {
        if let Some(group) = lock(&self.groups).get_mut(key)
            && objects > group.names * SPARSE
        {
            tracing::info!(namespace = %key.3, resource = %key.2, names = group.names, objects, "too few of the namespace's objects are watched for a namespace watch; a watch per name");
            group.at_least = objects / SPARSE;
            group.mode.send_replace(None);
        }
    }

    /// The API server refused the namespace watch: every name back to its own, for good.
    fn refused(&self, key: &Key) {
        if let Some(group) = lock(&self.groups).get_mut(key) {
            tracing::warn!(namespace = %key.3, resource = %key.2, "the API server refuses a namespace watch; a watch per name");
            group.refused = true;
            group.mode.send_replace(None);
        }
    }
}

/// Runs the namespace watch into `shared` until nothing holds it.
async fn feed(
    mut events: BoxStream<'static, Event>,
    shared: Arc<Shared>,
    alive: watch::Sender<()>,
    granularity: Weak<Granularity>,
    key: Key,
) {
    loop {
        let event = tokio::select! {
            _ = alive.closed() => return,
            event = events.next() => event,
        };
        let Some(event) = event else { return };
        match event {
            Event::Listed { rv, objects } => {
                if let Some(g) = granularity.upgrade() {
                    g.listed(&key, objects.len());
                }
                let mut known = lock(&shared.known);
                known.objects = objects.into_iter().collect();
                known.rv = rv;
                let names: Vec<String> = known.names.keys().cloned().collect();
                for name in names {
                    known.tell(&name);
                }
                drop(known);
                shared.status.send_modify(|s| {
                    s.synced = true;
                    s.error = None;
                });
            }
            Event::Applied { rv, name, object } => {
                let mut known = lock(&shared.known);
                known.objects.insert(name.clone(), object);
                known.rv = rv;
                known.tell(&name);
            }
            Event::Deleted { rv, name } => {
                let mut known = lock(&shared.known);
                known.objects.remove(&name);
                known.rv = rv;
                known.tell(&name);
            }
            Event::Failed(error) => {
                if let SourceError::Forbidden(_) = &error
                    && let Some(g) = granularity.upgrade()
                {
                    g.refused(&key);
                }
                shared.status.send_modify(|s| {
                    s.failures += 1;
                    s.error = Some(error);
                });
            }
            Event::Recovered { .. } => shared.status.send_modify(|s| s.error = None),
        }
    }
}

/// Counts its name out when its stream is dropped.
struct Member {
    granularity: Weak<Granularity>,
    key: Key,
}

impl Drop for Member {
    fn drop(&mut self) {
        if let Some(g) = self.granularity.upgrade() {
            g.leave(&self.key);
        }
    }
}

/// One name's stream.
struct Name {
    w: Watches,
    /// Its own watch, while it is followed or being caught up with, and whether it has caught up
    /// (listed).
    own: Option<BoxStream<'static, Seen>>,
    own_listed: bool,
    /// The namespace watch, while it is followed or being caught up with: its health, and
    /// this name's channel.
    feed: Option<(Feed, watch::Receiver<Status>, Followed)>,
    mode: watch::Receiver<Option<Feed>>,
    /// The state last reported, and the resourceVersion it held as of.
    last: Option<Observed>,
    rv: String,
    /// The namespace watch's failures seen, and whether a failure was reported since the last
    /// state.
    failures: u64,
    failing: bool,
    _member: Member,
}

type Item = Result<Observed, SourceError>;

impl Name {
    async fn next(mut self) -> Option<(Item, Name)> {
        loop {
            let wanted = self.mode.borrow_and_update().clone();
            // A namespace watch other than the one followed (the mode went to another and
            // back before this name's own watch listed) is left for the one wanted.
            let following = |feed: &Feed| {
                self.feed
                    .as_ref()
                    .is_some_and(|(f, _, _)| Arc::ptr_eq(&f.shared, &feed.shared))
            };
            match &wanted {
                Some(feed) if !following(feed) => {
                    let status = feed.shared.status.subscribe();
                    let slot = feed.follow(&self.w.name);
                    self.feed = Some((feed.clone(), status, slot));
                }
                None if self.own.is_none() => {
                    self.own_listed = false;
                    self.own = Some(follow::follow_seen(
                        self.w.namespace.clone(),
                        &self.w.name,
                        self.w.what.clone(),
                        self.w.upstream.clone(),
                    ));
                }
                _ => {}
            }
            if wanted.is_none() && self.own_listed {
                // Its own watch has caught up: the namespace watch is not needed any more.
                self.feed = None;
            }
            let feed_synced = self
                .feed
                .as_ref()
                .is_some_and(|(_, s, _)| s.borrow().synced);
            let on_feed = wanted.is_some() && feed_synced;
            if on_feed {
                // Caught up (or already on it): the namespace view is what is followed now.
                self.own = None;
                if let Some(item) = self.read_feed() {
                    return Some((item, self));
                }
            }
            tokio::select! {
                changed = self.mode.changed() => {
                    if changed.is_err() {
                        return None;
                    }
                }
                seen = next_own(&mut self.own) => {
                    let Some(seen) = seen else {
                        self.own = None;
                        continue;
                    };
                    match seen {
                        Ok((observed, rv)) => {
                            self.own_listed = true;
                            if wanted.is_none() {
                                self.feed = None;
                            }
                            if let Some(item) = self.take(observed, rv) {
                                return Some((item, self));
                            }
                        }
                        Err(error) => {
                            self.failing = true;
                            return Some((Err(error), self));
                        }
                    }
                }
                changed = next_feed(&mut self.feed) => {
                    if changed.is_err() {
                        self.feed = None;
                    }
                }
            }
        }
    }

    /// The item the namespace watch has for this name, if it is news: a failure not yet
    /// reported, or a newer state (or the same one again once failures end).
    fn read_feed(&mut self) -> Option<Item> {
        let (_, status, slot) = self.feed.as_mut()?;
        let status = status.borrow_and_update().clone();
        let (observed, rv) = slot.rx.borrow_and_update().clone();
        if status.failures > self.failures {
            self.failures = status.failures;
            if let Some(error) = status.error {
                self.failing = true;
                return Some(Err(error));
            }
        }
        if status.error.is_some() {
            return None;
        }
        self.take(observed, rv)
    }

    /// `observed` as of `rv`, unless it is older than what was reported, or the same (the same
    /// is reported again after a failure, so the registry knows it is current again).
    fn take(&mut self, observed: Observed, rv: String) -> Option<Item> {
        if follow::older(&rv, &self.rv) || follow::goes_back(self.last.as_ref(), &observed) {
            return None;
        }
        self.rv = rv;
        if self.last.as_ref() == Some(&observed) && !self.failing {
            return None;
        }
        self.failing = false;
        self.last = Some(observed.clone());
        Some(Ok(observed))
    }
}

async fn next_own(own: &mut Option<BoxStream<'static, Seen>>) -> Option<Seen> {
    match own {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

/// The next change to the namespace watch's health or to this name's state.
async fn next_feed(
    feed: &mut Option<(Feed, watch::Receiver<Status>, Followed)>,
) -> Result<(), watch::error::RecvError> {
    match feed {
        Some((_, status, slot)) => tokio::select! {
            changed = status.changed() => changed,
            changed = slot.rx.changed() => changed,
        },
        None => std::future::pending().await,
    }
}
