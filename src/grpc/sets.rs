//! Sets on the native API: a kind's objects in a namespace that a label selector selects. The
//! registry holds one watch per distinct set (kind, namespace, canonical label selector), shared
//! by its subscribers over every protocol (see [`crate::registry::Watched`]). Each subscriber's stream
//! tells its own view apart from the set's current members: a SNAPSHOT of each member at the
//! start, then SYNCED, then ADDED, UPDATED and DELETED per member. A reader that falls behind
//! skips to the newest state of each member, as single-resource streams do. Each member's
//! frame is encoded once, for every subscriber; a subscriber holds references to what it sent.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use futures::StreamExt;
use futures::stream::BoxStream;
use tonic::Status;

use super::delivery::until_error;
use super::frame::{self, Frame};
use super::status::{shutting_down, source_status};
use crate::pb::subscribe_response::Event;
use crate::registry::subscribers::record;
use crate::registry::{Delivered, Members, PartRef, Subscription, Update, slot};
use crate::selector::Set;

/// One subscriber's stream of `set`, at `index` of its request; `resume` is the set version the
/// client holds, if it gives one; the version it was last handed recorded in `part`.
pub(crate) fn stream(
    set: Set,
    members: Subscription<Members>,
    index: u32,
    ends: impl std::future::Future<Output = Status> + Send + 'static,
    resume: Option<String>,
    part: PartRef,
) -> BoxStream<'static, Result<Frame, Status>> {
    struct View {
        set: Set,
        index: u32,
        sent: BTreeMap<String, Arc<Update>>,
        synced: bool,
        queue: VecDeque<Frame>,
        resume: Option<String>,
        /// The version of the members the queued frames bring the client to, recorded once
        /// the last of them is handed over.
        pending: Option<Arc<str>>,
        part: PartRef,
    }
    impl View {
        fn frame(&self, event: Event, name: &str, update: &Update) -> Frame {
            let shared = update.wire(slot::NATIVE, |object| {
                frame::encode_object(&self.set.member(name).to_string(), object)
            });
            Frame {
                index: self.index,
                event,
                shared: shared.bytes,
            }
        }

        /// The version of `members`, as their selectors name them.
        fn version(&self, members: &Members) -> String {
            members.version(&self.set).to_string()
        }

        fn synced(&mut self, version: String) {
            self.synced = true;
            let frame = Frame {
                index: self.index,
                event: Event::Synced,
                shared: frame::encode_synced(&self.set.to_string(), version),
            };
            self.queue.push_back(frame);
        }

        /// Queues what tells this subscriber's view apart from `members`.
        fn catch_up(&mut self, members: &Members) {
            if !members.synced {
                return;
            }
            if let Some(resume) = self.resume.take() {
                let version = self.version(members);
                if version == resume {
                    // The client holds these members: it is told so, and changes follow.
                    self.sent = (*members.objects).clone();
                    self.synced(version);
                    return;
                }
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
                    let frame = self.frame(Event::Deleted, &name, &last);
                    self.queue.push_back(frame);
                }
            }
            for (name, update) in members.objects.iter() {
                let event = match self.sent.get(name) {
                    None => first,
                    Some(old) if Arc::ptr_eq(old, update) => continue,
                    Some(old) if old.object.resource_version == update.object.resource_version => {
                        continue;
                    }
                    Some(old) if old.object.uid != update.object.uid => first,
                    Some(_) => then,
                };
                let frame = self.frame(event, name, update);
                self.queue.push_back(frame);
                self.sent.insert(name.clone(), update.clone());
            }
            if !self.synced {
                let version = self.version(members);
                self.synced(version);
            }
        }
    }
    let view = View {
        set,
        index,
        sent: BTreeMap::new(),
        synced: false,
        queue: VecDeque::new(),
        resume,
        pending: None,
        part,
    };
    let ends = Box::pin(ends);
    let frames = futures::stream::unfold(
        (view, ends, true, members),
        |(mut view, mut ends, mut first, mut rx)| async move {
            loop {
                if let Some(frame) = view.queue.pop_front() {
                    if view.queue.is_empty()
                        && let Some(version) = view.pending.take()
                    {
                        record(&view.part, Delivered::Set(version));
                    }
                    return Some((Ok(frame), (view, ends, first, rx)));
                }
                if !std::mem::take(&mut first) {
                    tokio::select! {
                        status = &mut ends => return Some((Err(status), (view, ends, false, rx))),
                        changed = rx.changed() => if !changed {
                            return Some((Err(shutting_down()), (view, ends, false, rx)));
                        }
                    }
                }
                let members = rx.current();
                // Before anything was sent, a failure that is not an outage ends the stream
                // with its status; an outage is waited out.
                if !view.synced
                    && let Some(error) = &members.failure
                    && !error.is_outage()
                {
                    let status = source_status(view.index as usize, error);
                    return Some((Err(status), (view, ends, false, rx)));
                }
                view.catch_up(&members);
                if view.synced {
                    view.pending = Some(members.version(&view.set));
                    if view.queue.is_empty()
                        && let Some(version) = view.pending.take()
                    {
                        record(&view.part, Delivered::Set(version));
                    }
                }
            }
        },
    );
    until_error(frames).boxed()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::stream;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::registry::Registry;
    use crate::selector::Selector;
    use crate::source::{Object, Observed, SetEvent, Source, SourceError};

    /// A source whose sets hold the same three members, listed once.
    struct Three;

    impl Source for Three {
        async fn resolve(&self, selector: &Selector) -> Result<Selector, SourceError> {
            Ok(selector.clone())
        }

        async fn check(&self) -> Result<(), String> {
            Ok(())
        }

        fn forget(&self, _: &crate::selector::KindRef) {}

        fn watch(&self, _: &Selector) -> BoxStream<'static, Result<Observed, SourceError>> {
            stream::pending().boxed()
        }

        fn watch_set(&self, _: &Set) -> BoxStream<'static, SetEvent> {
            let members = ["a", "b", "c"]
                .map(|name| {
                    let object = Object {
                        json: vec![b'x'; 50_000].into(),
                        uid: name.into(),
                        resource_version: "1".into(),
                    };
                    (name.to_string(), object)
                })
                .to_vec();
            stream::once(async { SetEvent::Listed(members) })
                .chain(stream::pending())
                .boxed()
        }
    }

    #[tokio::test]
    async fn every_subscriber_of_a_set_sends_the_same_encoded_members() {
        let registry = Registry::new(Three, Duration::ZERO, CancellationToken::new());
        let set = Set {
            kind: "featureflags.v1beta1.core.openfeature.dev".parse().unwrap(),
            namespace: Some("default".into()),
            labels: "app=x".parse().unwrap(),
        };
        let mut frames = Vec::new();
        for _ in 0..2 {
            let s = stream(
                set.clone(),
                registry.subscribe(&set),
                0,
                std::future::pending(),
                None,
                None,
            );
            let sent: Vec<Frame> = s.take(4).map(Result::unwrap).collect().await;
            frames.push(sent);
        }
        let events: Vec<Event> = frames[0].iter().map(|f| f.event).collect();
        assert_eq!(
            events,
            [
                Event::Snapshot,
                Event::Snapshot,
                Event::Snapshot,
                Event::Synced
            ]
        );
        for (first, second) in frames[0].iter().zip(&frames[1]).take(3) {
            assert!(first.shared.len() > 50_000);
            // One encoding, referenced by both: not two equal copies.
            assert_eq!(first.shared.as_ptr(), second.shared.as_ptr());
        }
    }
}
