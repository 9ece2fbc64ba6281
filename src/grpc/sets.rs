//! Sets on the native API: a kind's objects in a namespace that a label selector selects. The
//! registry holds one watch per distinct set (kind, namespace, canonical label selector), shared
//! by its subscribers over every protocol (see [`crate::registry::Watched`]). Each subscriber's stream
//! tells its own view apart from the set's current members: a SNAPSHOT of each member at the
//! start, then SYNCED, then ADDED, UPDATED and DELETED per member. A reader that falls behind
//! skips to the newest state of each member, as single-resource streams do. Each member's
//! frame is encoded once, for every subscriber; a subscriber holds references to what it sent.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt;
use futures::stream::BoxStream;
use tonic::Status;

use super::frame::{self, Frame};
use super::messages::{End, Messages, Next, Owed, View};
use super::status::source_status;
use crate::pb::subscribe_response::Event;
use crate::registry::{Members, PartRef, Subscription, Update, slot};
use crate::selector::Set;

/// One subscriber's stream of `set`, at `index` of its request, ended early by `end`; `resume`
/// is the set version the client holds, if it gives one; the version it was last handed
/// recorded in `part`.
pub(crate) fn stream(
    set: Set,
    members: Subscription<Members>,
    index: u32,
    end: End,
    resume: Option<String>,
    part: PartRef,
) -> BoxStream<'static, Result<Frame, Status>> {
    let view = SetView {
        set,
        index,
        sent: BTreeMap::new(),
        synced: false,
        owed: Owed::new(part),
        resume,
    };
    Messages::new(members, end, tracing::Span::none(), view).boxed()
}

/// What one subscriber of a set was sent, and what it is still owed.
struct SetView {
    set: Set,
    index: u32,
    sent: BTreeMap<String, Arc<Update>>,
    synced: bool,
    owed: Owed<Frame>,
    resume: Option<String>,
}

impl View<Members> for SetView {
    type Message = Frame;
    type Input = std::convert::Infallible;

    fn next(&mut self, members: &Members) -> Next<Frame> {
        // Before anything was sent, a failure that is not an outage ends the stream with its
        // status; an outage is waited out.
        if !self.synced
            && let Some(error) = &members.failure
            && !error.is_outage()
        {
            return Next::Fail(source_status(self.index as usize, error));
        }
        self.catch_up(members);
        if self.synced {
            self.owed.bring_to(members.version(&self.set));
        }
        self.owed.next()
    }

    fn more(&mut self) -> Option<Frame> {
        self.owed.pop()
    }
}

impl SetView {
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
        self.owed.push(frame);
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
                self.owed.push(frame);
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
            self.owed.push(frame);
            self.sent.insert(name.clone(), update.clone());
        }
        if !self.synced {
            let version = self.version(members);
            self.synced(version);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::registry::Registry;
    use crate::source::scripted::Scripted;
    use crate::source::{Object, SetEvent};

    #[tokio::test]
    async fn every_subscriber_of_a_set_sends_the_same_encoded_members() {
        let source = Scripted::default();
        let registry = Registry::new(source.clone(), Duration::ZERO, CancellationToken::new());
        let set = Set {
            kind: "featureflags.v1beta1.core.openfeature.dev".parse().unwrap(),
            namespace: Some("default".into()),
            labels: "app=x".parse().unwrap(),
        };
        // The same three members, listed once.
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
        let streams: Vec<_> = (0..2)
            .map(|_| {
                let never = crate::conn::ConnDrain::new(CancellationToken::new());
                let end = End::new(never, None);
                stream(set.clone(), registry.subscribe(&set), 0, end, None, None)
            })
            .collect();
        while source.live() == 0 {
            tokio::task::yield_now().await;
        }
        source.send_set(&set, SetEvent::Listed(members));
        let mut frames = Vec::new();
        for s in streams {
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
