//! Sets on the native API: a kind's objects in a namespace that a label selector selects. One
//! source watch per distinct set (kind, namespace, canonical label selector) is shared by its
//! subscribers, and runs on for the linger after the last one leaves. Each subscriber's stream
//! tells its own view apart from the set's current members: a SNAPSHOT of each member at the
//! start, then SYNCED, then ADDED, UPDATED and DELETED per member. A reader that falls behind
//! skips to the newest state of each member, as single-resource streams do.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::watch;
use tonic::Status;

use super::frame::{self, Frame};
use crate::pb::subscribe_response::Event;
use crate::source::{Object, Set, SetEvent, Source, SourceError, lock};

/// A set's members as its watch knows them.
#[derive(Debug, Clone, Default)]
pub(crate) struct Members {
    /// Whether the watch has listed.
    pub(crate) synced: bool,
    pub(crate) objects: Arc<BTreeMap<String, Object>>,
    /// The failure while it lasts.
    pub(crate) failure: Option<SourceError>,
    /// The merged flag configuration of these members, made once for every flagd subscriber.
    pub(crate) merged: Arc<std::sync::OnceLock<String>>,
}

/// The sets being watched.
#[derive(Default)]
pub(crate) struct Sets {
    watched: Mutex<HashMap<Set, watch::Receiver<Members>>>,
}

impl Sets {
    /// The members of `set`, starting its watch on `source` if nobody watches it yet.
    pub(crate) fn subscribe<S: Source>(
        self: &Arc<Self>,
        source: &S,
        set: &Set,
        linger: Duration,
    ) -> watch::Receiver<Members> {
        let mut watched = lock(&self.watched);
        if let Some(rx) = watched.get(set) {
            return rx.clone();
        }
        let (tx, rx) = watch::channel(Members::default());
        let events = source.watch_set(set);
        tokio::spawn(run(events, tx, self.clone(), set.clone(), linger));
        watched.insert(set.clone(), rx.clone());
        rx
    }
}

/// Follows a set's watch into `tx` until nobody but the registry of sets has held it for the
/// linger.
async fn run(
    mut events: BoxStream<'static, SetEvent>,
    tx: watch::Sender<Members>,
    sets: Arc<Sets>,
    set: Set,
    linger: Duration,
) {
    let mut idle_since: Option<tokio::time::Instant> = None;
    let mut tick = tokio::time::interval(
        Duration::from_millis(250).min(linger.max(Duration::from_millis(10))),
    );
    loop {
        tokio::select! {
            event = events.next() => {
                let Some(event) = event else {
                    // Sources do not end their watches; if one does, the next subscriber starts
                    // it again.
                    lock(&sets.watched).remove(&set);
                    break;
                };
                tx.send_modify(|m| apply(m, event));
            }
            _ = tick.tick() => {
                // The registry of sets holds one receiver; subscribers hold the others.
                if tx.receiver_count() > 1 {
                    idle_since = None;
                    continue;
                }
                let since = *idle_since.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() >= linger {
                    let mut watched = lock(&sets.watched);
                    if tx.receiver_count() <= 1 {
                        watched.remove(&set);
                        break;
                    }
                }
            }
        }
    }
}

fn apply(members: &mut Members, event: SetEvent) {
    members.merged = Arc::default();
    match event {
        SetEvent::Listed(objects) => {
            members.objects = Arc::new(objects.into_iter().collect());
            members.synced = true;
            members.failure = None;
        }
        SetEvent::Applied(name, object) => {
            Arc::make_mut(&mut members.objects).insert(name, object);
        }
        SetEvent::Deleted(name) => {
            Arc::make_mut(&mut members.objects).remove(&name);
        }
        SetEvent::Failed(error) => members.failure = Some(error),
        SetEvent::Recovered => members.failure = None,
    }
}

/// The status a set's stream ends with if its watch ended: clients reconnect on UNAVAILABLE.
pub(crate) fn watch_ended() -> Status {
    Status::unavailable("the set's watch ended; reconnect")
}

/// One subscriber's stream of `set`, at `index` of its request.
pub(crate) fn stream(
    set: Set,
    rx: watch::Receiver<Members>,
    index: u32,
    ends: impl std::future::Future<Output = Status> + Send + 'static,
) -> BoxStream<'static, Result<Frame, Status>> {
    struct View {
        set: Set,
        index: u32,
        sent: BTreeMap<String, Object>,
        synced: bool,
        queue: VecDeque<Frame>,
    }
    impl View {
        fn frame(&self, event: Event, name: &str, object: Option<&Object>) -> Frame {
            let selector = self.set.member(name).to_string();
            let shared = match object {
                Some(object) => frame::encode_object(&selector, object),
                None => frame::encode_absent(&selector),
            };
            Frame {
                index: self.index,
                event,
                shared,
            }
        }

        /// Queues what tells this subscriber's view apart from `members`.
        fn catch_up(&mut self, members: &Members) {
            if !members.synced {
                return;
            }
            let (first, then) = if self.synced {
                (Event::Added, Event::Updated)
            } else {
                (Event::Snapshot, Event::Snapshot)
            };
            let gone: Vec<String> = self
                .sent
                .keys()
                .filter(|name| !members.objects.contains_key(*name))
                .cloned()
                .collect();
            for name in gone {
                if let Some(last) = self.sent.remove(&name) {
                    let frame = self.frame(Event::Deleted, &name, Some(&last));
                    self.queue.push_back(frame);
                }
            }
            for (name, object) in members.objects.iter() {
                let event = match self.sent.get(name) {
                    None => first,
                    Some(old) if old.resource_version == object.resource_version => continue,
                    Some(old) if old.uid != object.uid => first,
                    Some(_) => then,
                };
                let frame = self.frame(event, name, Some(object));
                self.queue.push_back(frame);
                self.sent.insert(name.clone(), object.clone());
            }
            if !self.synced {
                self.synced = true;
                let frame = Frame {
                    index: self.index,
                    event: Event::Synced,
                    shared: frame::encode_absent(&self.set.to_string()),
                };
                self.queue.push_back(frame);
            }
        }
    }
    let view = View {
        set,
        index,
        sent: BTreeMap::new(),
        synced: false,
        queue: VecDeque::new(),
    };
    let ends = Box::pin(ends);
    let frames = futures::stream::unfold(
        (view, ends, true, rx),
        |(mut view, mut ends, mut first, mut rx)| async move {
            loop {
                if let Some(frame) = view.queue.pop_front() {
                    return Some((Ok(frame), (view, ends, first, rx)));
                }
                let members = if std::mem::take(&mut first) {
                    rx.borrow_and_update().clone()
                } else {
                    tokio::select! {
                        status = &mut ends => return Some((Err(status), (view, ends, false, rx))),
                        changed = rx.changed() => {
                            if changed.is_err() {
                                return Some((Err(watch_ended()), (view, ends, false, rx)));
                            }
                            rx.borrow_and_update().clone()
                        }
                    }
                };
                // Before anything was sent, a failure that is not an outage ends the stream
                // with its status; an outage is waited out.
                if !view.synced
                    && let Some(error) = &members.failure
                    && !error.is_outage()
                {
                    let status = super::source_status(view.index as usize, error);
                    return Some((Err(status), (view, ends, false, rx)));
                }
                view.catch_up(&members);
            }
        },
    );
    super::until_error(frames).boxed()
}
