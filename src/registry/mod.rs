//! The heart of the broker: one shared, reference-counted watch per custom resource, and one per
//! set of them.
//!
//! Each resource a client asks for has an entry in a [`DashMap`] keyed by its canonical
//! [`Selector`], each set one in a second map keyed by its [`crate::selector::Set`] (see
//! [`Watched`]); both count against one `--max-watches`. The entry holds the
//! `tokio::sync::watch` sender of the latest [`State`] (for a set, its [`Members`]); each
//! subscriber holds a receiver. The receiver count *is* the reference count:
//! there is no counter to drift.
//!
//! The first subscriber creates the entry and spawns its watch task, which drives the source's
//! stream and publishes each new state with `send_if_modified`. When the last receiver is
//! dropped the task waits `linger` (a returning subscriber keeps the watch warm), then removes
//! the entry with `remove_if` — under the map's shard lock, and only if the receiver count is
//! still zero — and stops the source's watch by dropping its stream. A subscriber takes its
//! receiver under the same lock (`get`, or `entry` for the first), so a subscribe racing a
//! teardown either lands on the live entry (and the teardown backs off) or finds none and starts
//! a new watch: never on one that is going away.
//!
//! A `watch` channel holds one value: a subscriber that reads slowly skips to the newest state
//! and never holds up the task or the other subscribers, and the last state is never lost.
//! Each state's wire forms are computed once, by the first subscriber that needs them, and
//! shared by the rest ([`Update::wire`]).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use dashmap::mapref::entry::Entry as MapEntry;
use futures::StreamExt;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::selector::Selector;
use crate::source::{Object, Source, SourceError};
use crate::sync::lock;
use crate::telemetry::{ErrorLabels, Metrics, ResourceLabels, StopLabels, StopReason};

mod pool;
pub mod subscribers;
#[cfg(test)]
mod tests;
mod watched;

pub use subscribers::{Delivered, PartRef, Subscribers};
pub use watched::{Members, Summary, Tables, Watched, set_version};

/// How long a watch outlives its last subscriber by default (ADR 0005).
pub const DEFAULT_LINGER: Duration = Duration::from_secs(30);

/// The latest state of one resource, as every subscriber sees it.
#[derive(Debug, Clone, Default)]
pub enum State {
    /// The source has not answered yet.
    #[default]
    Pending,
    /// The object exists.
    Present(Arc<Update>),
    /// No object has the name; `last` is the state it had when it was deleted, if the broker saw
    /// it exist.
    Absent {
        /// The object's last state before it was deleted.
        last: Option<Arc<Update>>,
    },
    /// The source failed before it could say whether the object exists.
    Failed(SourceError),
}

/// How many wire forms an update, or a set's members, can carry (one per protocol).
pub const WIRE_SLOTS: usize = 5;

/// The wire slots, each protocol's: in one place, so that two cannot take the same one.
pub mod slot {
    /// The native protocol's encoding of a resource.
    pub const NATIVE: usize = 0;
    /// flagd sync's configuration (of a resource, or merged from a set's members).
    pub const FLAGD: usize = 1;
    /// The legacy `sync.v1` configuration.
    pub const FLAGD_LEGACY: usize = 2;
    /// A set's members merged into one flagd configuration (text).
    pub const FLAGD_MERGED: usize = 3;
    /// The xDS endpoints (a ClusterLoadAssignment) of the EndpointSlices' set.
    pub const XDS_ENDPOINTS: usize = 4;
}

/// FNV-1a, 64 bits: a hash that is the same in every build and on every replica (the standard
/// library's may change between releases), for the versions replicas must agree on, so that a
/// client resuming on another replica is recognised there.
#[derive(Debug, Clone, Copy)]
pub struct StableHash(u64);

impl Default for StableHash {
    fn default() -> Self {
        StableHash(0xcbf2_9ce4_8422_2325)
    }
}

impl StableHash {
    /// Takes in `bytes`.
    pub fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 ^= u64::from(*byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// The hash, as 16 lowercase hex digits.
    pub fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// An encoded form of an update, with a digest of its bytes for cheap comparisons.
#[derive(Debug, Clone, PartialEq)]
pub struct Wire {
    /// The encoded bytes.
    pub bytes: Bytes,
    /// A hash of `bytes`.
    pub digest: u64,
}

impl Wire {
    /// Wraps encoded bytes, hashing them once.
    pub fn new(bytes: Bytes) -> Wire {
        use std::hash::{DefaultHasher, Hasher};
        let mut h = DefaultHasher::new();
        h.write(&bytes);
        Wire {
            digest: h.finish(),
            bytes,
        }
    }
}

/// One state of an object, with its wire forms computed at most once each.
#[derive(Debug)]
pub struct Update {
    /// The object.
    pub object: Object,
    wire: [OnceLock<Wire>; WIRE_SLOTS],
    /// A protocol's decoded form of the object (see [`Update::decoded`]).
    decoded: OnceLock<Arc<dyn std::any::Any + Send + Sync>>,
    /// When the source reported it.
    pub published: Instant,
    /// Subscribers at publication that have not written it yet.
    pending: AtomicUsize,
}

/// A set member's state, made once per uid and resourceVersion ([`pool`]).
impl From<Object> for Update {
    fn from(object: Object) -> Update {
        Update::new(object)
    }
}

impl Update {
    /// Wraps an object.
    pub fn new(object: Object) -> Update {
        Update {
            object,
            wire: Default::default(),
            decoded: OnceLock::new(),
            published: Instant::now(),
            pending: AtomicUsize::new(0),
        }
    }

    /// Records that one of the subscribers present at publication has written this update;
    /// the time since publication when it was the last of them (the fan-out time).
    pub fn delivered(&self) -> Option<Duration> {
        let before = self
            .pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .ok()?;
        (before == 1).then(|| self.published.elapsed())
    }

    /// The wire form in `slot`, encoding it with `encode` the first time it is asked for; every
    /// later subscriber gets the same bytes.
    pub fn wire(&self, slot: usize, encode: impl FnOnce(&Object) -> Bytes) -> Wire {
        self.wire[slot % WIRE_SLOTS]
            .get_or_init(|| Wire::new(encode(&self.object)))
            .clone()
    }

    /// The object decoded by `decode` the first time it is asked for, and shared after: what a
    /// protocol reads of each member of a set it merges, decoded once per state of the member
    /// rather than once per merge. One decoded form is kept; another type is decoded anew.
    pub fn decoded<T: Send + Sync + 'static>(&self, decode: impl FnOnce(&Object) -> T) -> Arc<T> {
        decoded_in(&self.decoded, || decode(&self.object))
    }

    fn same_version(&self, other: &Object) -> bool {
        self.object.uid == other.uid && self.object.resource_version == other.resource_version
    }
}

/// A decoded form held in `cell`, made by `decode` the first time it is asked for; a type other
/// than the one held is decoded anew and not kept.
fn decoded_in<T: Send + Sync + 'static>(
    cell: &OnceLock<Arc<dyn std::any::Any + Send + Sync>>,
    decode: impl FnOnce() -> T,
) -> Arc<T> {
    if let Some(held) = cell.get() {
        return match held.clone().downcast::<T>() {
            Ok(value) => value,
            Err(_) => Arc::new(decode()),
        };
    }
    let value = Arc::new(decode());
    // Two first askers at once each decode; one's is kept.
    let _ = cell.set(value.clone());
    value
}

/// A subscriber's handle on one watch: a resource's [`State`], or a set's [`Members`]. Dropping
/// it is unsubscribing.
#[derive(Debug)]
pub struct Subscription<T = State> {
    rx: watch::Receiver<T>,
    stats: Arc<Stats>,
    /// Whether this subscription started the watch.
    pub cold: bool,
}

impl<T: Clone> Subscription<T> {
    /// The current state, marking it seen.
    pub fn current(&mut self) -> T {
        self.rx.borrow_and_update().clone()
    }

    /// Waits for a state newer than the last one seen; `false` when the watch has ended (the
    /// broker is shutting down).
    pub async fn changed(&mut self) -> bool {
        self.rx.changed().await.is_ok()
    }
}

impl<T> Drop for Subscription<T> {
    fn drop(&mut self) {
        // The linger clock runs from the last departure, not the first.
        *lock(&self.stats.left) = Instant::now();
    }
}

/// A new watch was refused: the registry holds the most it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the broker watches {max} resources and sets, the most it watches at once (--max-watches)")]
pub struct Full {
    /// The limit.
    pub max: usize,
}

/// Why a subscription was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// A new watch, with the registry full.
    #[error(transparent)]
    Full(#[from] Full),
    /// The API server's last answer to the watch was Forbidden: the broker may no longer read
    /// what it holds, so nobody new is given it (those already subscribed keep their streams).
    #[error("{0}")]
    Forbidden(SourceError),
}

/// What the registry knows about one watch, for the admin endpoint and tests.
#[derive(Debug, Clone, PartialEq)]
pub struct WatchStatus {
    /// The resource or set, as a selector names it.
    pub selector: String,
    /// Subscribers now.
    pub subscribers: usize,
    /// When the watch started.
    pub since: SystemTime,
    /// When the source last reported anything.
    pub last_event: Option<SystemTime>,
    /// The object's resourceVersion, if it exists.
    pub resource_version: Option<String>,
    /// A set's members, once listed.
    pub members: Option<usize>,
    /// The version a subscriber holding the current state was handed ([`Summary::version`]).
    pub version: Option<String>,
    /// Errors the source reported since the watch started.
    pub errors: u64,
    /// New states published since the watch started.
    pub updates: u64,
    /// Since when the source has reported only errors, if its last report was one: the state
    /// subscribers hold may be stale since then.
    pub stale_since: Option<SystemTime>,
}

#[derive(Debug)]
struct Stats {
    id: u64,
    since: SystemTime,
    left: Mutex<Instant>,
    last_event: Mutex<Option<SystemTime>>,
    errors: AtomicU64,
    updates: AtomicU64,
    stale_since: Mutex<Option<SystemTime>>,
    /// The Forbidden error the source last reported, until it reports anything else.
    forbidden: Mutex<Option<SourceError>>,
}

impl Stats {
    fn status<W: Watched>(&self, watched: &W, tx: &watch::Sender<W::State>) -> WatchStatus {
        let summary = watched.summary(&tx.borrow());
        WatchStatus {
            selector: watched.to_string(),
            subscribers: tx.receiver_count(),
            since: self.since,
            last_event: *lock(&self.last_event),
            resource_version: summary.resource_version,
            members: summary.members,
            version: summary.version,
            errors: self.errors.load(Ordering::Relaxed),
            updates: self.updates.load(Ordering::Relaxed),
            stale_since: *lock(&self.stale_since),
        }
    }
}

/// One watch in the registry.
pub struct Entry<T> {
    tx: watch::Sender<T>,
    stats: Arc<Stats>,
    /// What the watch is charged to, held until it ends.
    _charge: Option<Charge>,
}

impl<T> Entry<T> {
    fn subscription(&self, cold: bool) -> Subscription<T> {
        Subscription {
            rx: self.tx.subscribe(),
            stats: self.stats.clone(),
            cold,
        }
    }
}

/// Whatever a watch is charged to (a caller's share of the watches), held while it is open and
/// dropped when it ends.
pub type Charge = Box<dyn std::any::Any + Send + Sync>;

struct Inner<S> {
    tables: Tables,
    source: S,
    linger: Duration,
    max_watches: usize,
    tasks: TaskTracker,
    shutdown: CancellationToken,
    next_id: AtomicU64,
    metrics: Arc<Metrics>,
    subscribers: Subscribers,
}

impl<S> Inner<S> {
    fn len(&self) -> usize {
        self.tables.ones.len() + self.tables.sets.len()
    }
}

/// Shares one watch per resource, and one per set, among their subscribers. Cheap to clone.
pub struct Registry<S> {
    inner: Arc<Inner<S>>,
}

impl<S> Clone for Registry<S> {
    fn clone(&self) -> Self {
        Registry {
            inner: self.inner.clone(),
        }
    }
}

impl<S: Source> Registry<S> {
    /// A registry over `source`. Watches linger `linger` after their last subscriber leaves and
    /// all stop when `shutdown` is cancelled.
    pub fn new(source: S, linger: Duration, shutdown: CancellationToken) -> Self {
        Self::with_metrics(source, linger, shutdown, Arc::default(), usize::MAX)
    }

    /// As [`Registry::new`], recording into `metrics`, with at most `max_watches` resources and
    /// sets watched at once (see [`Registry::try_subscribe`]).
    pub fn with_metrics(
        source: S,
        linger: Duration,
        shutdown: CancellationToken,
        metrics: Arc<Metrics>,
        max_watches: usize,
    ) -> Self {
        Registry {
            inner: Arc::new(Inner {
                tables: Tables::default(),
                source,
                linger,
                max_watches,
                tasks: TaskTracker::new(),
                shutdown,
                next_id: AtomicU64::new(1),
                metrics,
                subscribers: Subscribers::default(),
            }),
        }
    }

    /// The metrics it records into.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// The open streams, and what each was last handed ([`subscribers`]).
    pub fn subscribers(&self) -> &Subscribers {
        &self.inner.subscribers
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.inner.source
    }

    /// How long a watch lingers after its last subscriber leaves.
    pub fn linger(&self) -> Duration {
        self.inner.linger
    }

    /// Resolves a selector to its canonical form through the source.
    pub async fn resolve(&self, selector: &Selector) -> Result<Selector, SourceError> {
        self.inner.source.resolve(selector).await
    }

    /// Subscribes to a resolved resource or set, starting its watch if nobody watches it yet.
    pub fn subscribe<W: Watched>(&self, watched: &W) -> Subscription<W::State> {
        self.warm(watched)
            .unwrap_or_else(|| self.start(watched, || None))
    }

    /// As [`Registry::subscribe`], unless that would start a watch while the registry already
    /// holds its `max_watches`, or the watch's last answer was Forbidden; a watch it starts is
    /// charged to `charge()` until it ends.
    pub fn try_subscribe<W: Watched>(
        &self,
        watched: &W,
        charge: impl FnOnce() -> Option<Charge>,
    ) -> Result<Subscription<W::State>, Refused> {
        if let Some(subscription) = self.warm(watched) {
            let forbidden = lock(&subscription.stats.forbidden).clone();
            return match forbidden {
                Some(error) => Err(Refused::Forbidden(error)),
                None => Ok(subscription),
            };
        }
        // Counted before the entry's shard is locked (`len` locks every shard in turn), so a
        // burst of cold subscribes may pass the bound by a few.
        let max = self.inner.max_watches;
        if self.inner.len() >= max {
            return Err(Full { max }.into());
        }
        Ok(self.start(watched, charge))
    }

    /// Whether `watched` is watched now (a subscribe would find its watch warm).
    pub fn is_watched<W: Watched>(&self, watched: &W) -> bool {
        W::table(&self.inner.tables).contains_key(watched)
    }

    /// The most resources and sets watched at once.
    pub fn max_watches(&self) -> usize {
        self.inner.max_watches
    }

    /// A subscription to the watch of `watched`, if it is open.
    fn warm<W: Watched>(&self, watched: &W) -> Option<Subscription<W::State>> {
        W::table(&self.inner.tables)
            .get(watched)
            .map(|entry| entry.subscription(false))
    }

    /// A subscription to the watch of `watched`, starting it (charged to `charge()`) unless a
    /// racing subscribe just did.
    fn start<W: Watched>(
        &self,
        watched: &W,
        charge: impl FnOnce() -> Option<Charge>,
    ) -> Subscription<W::State> {
        let (tx, stats) = match W::table(&self.inner.tables).entry(watched.clone()) {
            MapEntry::Occupied(e) => return e.get().subscription(false),
            MapEntry::Vacant(v) => {
                let stats = Arc::new(Stats {
                    id: self.inner.next_id.fetch_add(1, Ordering::Relaxed),
                    since: SystemTime::now(),
                    left: Mutex::new(Instant::now()),
                    last_event: Mutex::new(None),
                    errors: AtomicU64::new(0),
                    updates: AtomicU64::new(0),
                    stale_since: Mutex::new(None),
                    forbidden: Mutex::new(None),
                });
                let (tx, _) = watch::channel(W::State::default());
                v.insert(Entry {
                    tx: tx.clone(),
                    stats: stats.clone(),
                    _charge: charge(),
                });
                (tx, stats)
            }
        };
        // Subscribed before the task starts, so it never finds the watch unwanted.
        let subscription = Subscription {
            rx: tx.subscribe(),
            stats: stats.clone(),
            cold: true,
        };
        let span = tracing::info_span!("watch", selector = %watched);
        let task = run_watch(self.inner.clone(), watched.clone(), tx, stats);
        self.inner.tasks.spawn(task.instrument(span));
        subscription
    }

    /// Watches now open, of resources and sets.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Whether no watch is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Watch tasks still running (a task may outlive its entry by a moment while it stops).
    pub fn tasks(&self) -> usize {
        self.inner.tasks.len()
    }

    /// Waits until every watch task has stopped (after shutdown).
    pub async fn stopped(&self) {
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
    }

    /// Every open watch, of resources and sets, sorted by selector.
    pub fn watches(&self) -> Vec<WatchStatus> {
        let tables = &self.inner.tables;
        let ones = tables.ones.iter().map(|e| e.stats.status(e.key(), &e.tx));
        let sets = tables.sets.iter().map(|e| e.stats.status(e.key(), &e.tx));
        let mut out: Vec<WatchStatus> = ones.chain(sets).collect();
        out.sort_by(|a, b| a.selector.cmp(&b.selector));
        out
    }
}

/// Drives one watch until it is no longer wanted or the broker shuts down.
async fn run_watch<S: Source, W: Watched>(
    inner: Arc<Inner<S>>,
    watched: W,
    tx: watch::Sender<W::State>,
    stats: Arc<Stats>,
) {
    tracing::debug!("watch started");
    let table = W::table(&inner.tables);
    let labels = ResourceLabels::of(watched.kind().unversioned());
    inner.metrics.watch.starts.get_or_create(&labels).inc();
    inner.metrics.watch.open.get_or_create(&labels).inc();
    let mut reports = watched.open(&inner.source);
    let mut reason = StopReason::Shutdown;
    // Set while nobody is subscribed: when the linger ends.
    let mut idle_until: Option<Instant> = None;
    loop {
        let linger_ends = async {
            match idle_until {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            _ = inner.shutdown.cancelled() => {
                // Dropping the entry's sender too ends every subscription.
                table.remove_if(&watched, |_, e| e.stats.id == stats.id);
                break;
            }
            _ = tx.closed(), if idle_until.is_none() => {
                idle_until = Some(Instant::now() + inner.linger);
            }
            _ = linger_ends => {
                let left = *lock(&stats.left);
                if Instant::now() < left + inner.linger {
                    // Someone came and went during the linger: it runs from their departure.
                    idle_until = Some(left + inner.linger);
                    continue;
                }
                let removed = table.remove_if(&watched, |_, e| {
                    e.stats.id == stats.id && e.tx.receiver_count() == 0
                });
                if removed.is_some() {
                    reason = StopReason::Idle;
                    break;
                }
                idle_until = None;
            }
            report = reports.next() => match report {
                Some(report) => {
                    if W::error(&report).is_some_and(SourceError::is_gone) {
                        inner.source.forget(watched.kind());
                    }
                    publish::<W>(&tx, &stats, &inner.metrics, &labels, report, &inner.tables.members);
                }
                None => {
                    // Sources retry by themselves and do not end; if one does, start it again.
                    tracing::warn!("the source's watch ended; restarting it");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    reports = watched.open(&inner.source);
                }
            },
        }
    }
    // Dropping the stream stops the watch at the source (for Kubernetes, closes the request).
    drop(reports);
    inner.metrics.watch.open.get_or_create(&labels).dec();
    let stop = StopLabels {
        resource: labels.resource.clone(),
        reason,
    };
    inner.metrics.watch.stops.get_or_create(&stop).inc();
    tracing::debug!(?reason, "watch stopped");
}

/// Records a source's report in the watch's stats and metrics, and publishes what it changes.
fn publish<W: Watched>(
    tx: &watch::Sender<W::State>,
    stats: &Stats,
    metrics: &Metrics,
    labels: &ResourceLabels,
    report: W::Report,
    members: &pool::Pool<Update>,
) {
    let now = SystemTime::now();
    *lock(&stats.last_event) = Some(now);
    *lock(&stats.forbidden) = W::error(&report)
        .filter(|e| matches!(e, SourceError::Forbidden(_)))
        .cloned();
    let failed = match W::error(&report) {
        Some(error) => {
            stats.errors.fetch_add(1, Ordering::Relaxed);
            let error_labels = ErrorLabels {
                resource: labels.resource.clone(),
                reason: error.reason().to_string(),
            };
            metrics.watch.errors.get_or_create(&error_labels).inc();
            tracing::warn!(%error, "source error; the source retries");
            true
        }
        None => false,
    };
    {
        let mut stale = lock(&stats.stale_since);
        if failed {
            stale.get_or_insert(now);
        } else {
            *stale = None;
        }
    }
    let skipped = |missed| {
        metrics
            .watch
            .skipped_states
            .get_or_create(labels)
            .inc_by(missed);
    };
    if W::apply(tx, report, &skipped, members) && !failed {
        stats.updates.fetch_add(1, Ordering::Relaxed);
        metrics.watch.updates.get_or_create(labels).inc();
    }
}
