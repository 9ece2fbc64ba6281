//! What an entry of the registry watches: one resource ([`Selector`]) or a set of them ([`Set`]).
//! Both share the registry's admission, limit, linger and teardown; they differ in what their
//! subscribers see ([`Watched::State`]) and in how a source's report changes it.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use dashmap::DashMap;
use futures::stream::BoxStream;
use tokio::sync::watch;

use super::pool;
use super::{Entry, State, Update, WIRE_SLOTS, Wire};
use crate::selector::{KindRef, Selector, Set};
use crate::source::{Observed, SetEvent, Source, SourceError};

/// What one entry of the registry watches.
pub trait Watched:
    Clone + Eq + std::hash::Hash + Ord + std::fmt::Display + Send + Sync + 'static
{
    /// What its subscribers see: the latest of it.
    type State: Clone + Default + Send + Sync + 'static;
    /// What its source reports.
    type Report: Send + 'static;

    /// Its kind.
    fn kind(&self) -> &KindRef;

    /// Starts its watch at `source`; dropping the stream stops it.
    fn open<S: Source>(&self, source: &S) -> BoxStream<'static, Self::Report>;

    /// The source's error, if `report` is one.
    fn error(report: &Self::Report) -> Option<&SourceError>;

    /// Applies `report` to the state in `tx`; whether subscribers see a new state. `skipped`
    /// is told how many subscribers never wrote a state it replaced; a set's members come from
    /// `pool`, shared with every other set that holds them.
    fn apply(
        tx: &watch::Sender<Self::State>,
        report: Self::Report,
        skipped: &dyn Fn(u64),
        pool: &pool::Pool<Update>,
    ) -> bool;

    /// What `/debug/watches` says of `state`: a resource's resourceVersion, a set's member count.
    fn summary(&self, state: &Self::State) -> Summary;

    /// The registry's table of entries of this type.
    fn table(tables: &Tables) -> &DashMap<Self, Entry<Self::State>>;
}

/// The registry's tables: one per type of [`Watched`], counted together against `--max-watches`;
/// and the sets' members, held once across them.
#[derive(Default)]
pub struct Tables {
    pub(super) ones: DashMap<Selector, Entry<State>>,
    pub(super) sets: DashMap<Set, Entry<Members>>,
    pub(super) members: pool::Pool<Update>,
}

/// What `/debug/watches` says of a watch's state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    /// A resource's resourceVersion, if it exists.
    pub resource_version: Option<String>,
    /// A set's members, once listed.
    pub members: Option<usize>,
    /// The version a subscriber holding this state was handed: the resourceVersion, or the
    /// set's version (`SYNCED.set_version`) once listed; empty for a resource that does not
    /// exist; none while nothing is known.
    pub version: Option<String>,
}

impl Watched for Selector {
    type State = State;
    type Report = Result<Observed, SourceError>;

    fn kind(&self) -> &KindRef {
        &self.kind
    }

    fn open<S: Source>(&self, source: &S) -> BoxStream<'static, Self::Report> {
        source.watch(self)
    }

    fn error(report: &Self::Report) -> Option<&SourceError> {
        report.as_ref().err()
    }

    fn apply(
        tx: &watch::Sender<State>,
        report: Self::Report,
        skipped: &dyn Fn(u64),
        _: &pool::Pool<Update>,
    ) -> bool {
        let subscribers = tx.receiver_count();
        // Subscribers present when `old` was published that have not written it now skip it.
        let skip = |old: &Update| {
            let missed = old.pending.load(Ordering::Acquire) as u64;
            if missed > 0 {
                skipped(missed);
            }
        };
        match report {
            Ok(Observed::Present(object)) => tx.send_if_modified(|state| match state {
                State::Present(u) if u.same_version(&object) => false,
                _ => {
                    if let State::Present(old) = state {
                        skip(old);
                    }
                    let update = Update::new(object);
                    update.pending.store(subscribers, Ordering::Release);
                    *state = State::Present(Arc::new(update));
                    true
                }
            }),
            Ok(Observed::Absent) => tx.send_if_modified(|state| match state {
                State::Absent { .. } => false,
                State::Present(u) => {
                    skip(u);
                    *state = State::Absent {
                        last: Some(u.clone()),
                    };
                    true
                }
                State::Pending | State::Failed(_) => {
                    *state = State::Absent { last: None };
                    true
                }
            }),
            // Only a resource nobody has seen yet is reported as failed, or one whose kind is no
            // longer served (its state will not change again); otherwise subscribers keep the
            // last known state while the source recovers.
            Err(error) => tx.send_if_modified(|state| match state {
                State::Pending => {
                    *state = State::Failed(error);
                    true
                }
                State::Failed(old) if *old != error => {
                    *state = State::Failed(error);
                    true
                }
                State::Failed(_) => false,
                State::Present(_) | State::Absent { .. } if error.is_gone() => {
                    *state = State::Failed(error);
                    true
                }
                State::Present(_) | State::Absent { .. } => false,
            }),
        }
    }

    fn summary(&self, state: &State) -> Summary {
        let resource_version = match state {
            State::Present(u) => Some(u.object.resource_version.clone()),
            _ => None,
        };
        Summary {
            version: match state {
                State::Absent { .. } => Some(String::new()),
                _ => resource_version.clone(),
            },
            resource_version,
            members: None,
        }
    }

    fn table(tables: &Tables) -> &DashMap<Self, Entry<State>> {
        &tables.ones
    }
}

/// A set's members as its watch knows them. Each member's state is held once, with its wire
/// forms (see [`Update::wire`]): every subscriber of the set shares them, so a subscriber costs
/// references to the members, never copies.
#[derive(Debug, Clone, Default)]
pub struct Members {
    /// Whether the watch has listed.
    pub synced: bool,
    /// The members by key ([`Set::key`]).
    pub objects: Arc<BTreeMap<String, Arc<Update>>>,
    /// The failure while it lasts.
    pub failure: Option<SourceError>,
    /// Forms made from all the members (a flagd configuration merged from them), at most once
    /// per state of the set.
    forms: Arc<SetForms>,
}

/// What is made from all the members of one state of a set: wire forms, and one decoded form.
#[derive(Debug, Default)]
struct SetForms {
    wire: [OnceLock<Wire>; WIRE_SLOTS],
    decoded: OnceLock<Arc<dyn std::any::Any + Send + Sync>>,
    version: OnceLock<Arc<str>>,
}

/// The version of a set's members, as SYNCED carries it (`SubscribeResponse.set_version`): the
/// FNV-1a 64-bit hash, as 16 lowercase hex digits, of each member's
/// `<selector>\n<uid>\n<resource_version>\n` in byte order of the selectors. The same on every
/// replica for the same members, and computable by a client from the members it holds.
pub fn set_version<'a>(members: impl IntoIterator<Item = (&'a str, &'a str, &'a str)>) -> String {
    let mut members: Vec<(&str, &str, &str)> = members.into_iter().collect();
    members.sort_unstable();
    let mut hash = super::StableHash::default();
    for (selector, uid, resource_version) in members {
        for part in [selector, uid, resource_version] {
            hash.write(part.as_bytes());
            hash.write(b"\n");
        }
    }
    hash.hex()
}

impl Members {
    /// A set listed with `objects` (keyed as [`Set::key`] keys them).
    pub fn listed(objects: BTreeMap<String, Arc<Update>>) -> Members {
        Members {
            synced: true,
            objects: Arc::new(objects),
            ..Members::default()
        }
    }

    /// The form in `slot` made from every member, made with `make` the first time it is asked
    /// for in this state of the set.
    pub fn wire(&self, slot: usize, make: impl FnOnce(&Members) -> Bytes) -> Wire {
        self.forms.wire[slot % WIRE_SLOTS]
            .get_or_init(|| Wire::new(make(self)))
            .clone()
    }

    /// What `decode` makes of every member, made the first time it is asked for in this state
    /// of the set and shared after (a protocol's reading of the set that its encodings start
    /// from). One decoded form is kept; another type is decoded anew.
    pub fn decoded<T: Send + Sync + 'static>(&self, decode: impl FnOnce(&Members) -> T) -> Arc<T> {
        super::decoded_in(&self.forms.decoded, || decode(self))
    }

    /// The members' version ([`set_version`]) as members of `set`, computed once per state.
    pub fn version(&self, set: &Set) -> Arc<str> {
        self.forms
            .version
            .get_or_init(|| {
                let selectors: Vec<(String, &Update)> = self
                    .objects
                    .iter()
                    .map(|(name, u)| (set.member(name).to_string(), &**u))
                    .collect();
                set_version(selectors.iter().map(|(selector, u)| {
                    (
                        selector.as_str(),
                        u.object.uid.as_str(),
                        u.object.resource_version.as_str(),
                    )
                }))
                .into()
            })
            .clone()
    }
}

impl Watched for Set {
    type State = Members;
    type Report = SetEvent;

    fn kind(&self) -> &KindRef {
        &self.kind
    }

    fn open<S: Source>(&self, source: &S) -> BoxStream<'static, SetEvent> {
        source.watch_set(self)
    }

    fn error(report: &SetEvent) -> Option<&SourceError> {
        match report {
            SetEvent::Failed(error) => Some(error),
            _ => None,
        }
    }

    fn apply(
        tx: &watch::Sender<Members>,
        report: SetEvent,
        _: &dyn Fn(u64),
        pool: &pool::Pool<Update>,
    ) -> bool {
        tx.send_if_modified(|members| {
            let changed = match report {
                SetEvent::Listed(objects) => {
                    // A member listed again at the version it had keeps its state and what was
                    // encoded of it.
                    let old = std::mem::take(&mut members.objects);
                    members.objects = Arc::new(
                        objects
                            .into_iter()
                            .map(|(key, object)| {
                                let update = match old.get(&key) {
                                    Some(u) if u.same_version(&object) => u.clone(),
                                    _ => pool.update(object),
                                };
                                (key, update)
                            })
                            .collect(),
                    );
                    members.synced = true;
                    members.failure = None;
                    true
                }
                SetEvent::Applied(key, object) => {
                    if members
                        .objects
                        .get(&key)
                        .is_some_and(|u| u.same_version(&object))
                    {
                        false
                    } else {
                        Arc::make_mut(&mut members.objects).insert(key, pool.update(object));
                        true
                    }
                }
                SetEvent::Deleted(key) => {
                    Arc::make_mut(&mut members.objects).remove(&key).is_some()
                }
                SetEvent::Failed(error) => {
                    let changed = members.failure.as_ref() != Some(&error);
                    members.failure = Some(error);
                    changed
                }
                SetEvent::Recovered => members.failure.take().is_some(),
            };
            if changed {
                members.forms = Arc::default();
            }
            changed
        })
    }

    fn summary(&self, members: &Members) -> Summary {
        Summary {
            resource_version: None,
            members: members.synced.then(|| members.objects.len()),
            version: members.synced.then(|| members.version(self).to_string()),
        }
    }

    fn table(tables: &Tables) -> &DashMap<Self, Entry<Members>> {
        &tables.sets
    }
}
