//! Who has what (issue 37, point 6): each open stream's caller, protocol and, for each resource
//! or set it follows, the version it was last handed, so that `/debug/subscribers` and `top`
//! can say, as `istioctl proxy-status` does per proxy, which subscribers hold the current state
//! (SYNCED) and which do not yet (STALE). xDS streams count the ACKs and NACKs of their clients.
//!
//! A stream records what it hands to the transport, not what the client has read: a message
//! handed over sits in the connection's buffers until the client takes it. A stream polls its
//! watch only when the transport wants another message, so a client that does not read stays
//! on the version it was last handed, and shows STALE.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::SystemTime;

use super::Update;
use crate::sync::lock;

/// The open streams of a broker.
#[derive(Default)]
pub struct Subscribers {
    next: AtomicU64,
    open: Arc<Mutex<HashMap<u64, Arc<Subscriber>>>>,
}

/// One open stream.
#[derive(Debug)]
pub struct Subscriber {
    /// The stream's id, in the order streams opened.
    pub id: u64,
    /// The caller, as the access layer names it.
    pub caller: String,
    /// The protocol: `native`, `flagd`, `sync.v1`, `xds`.
    pub protocol: &'static str,
    /// When it opened.
    pub opened: SystemTime,
    /// What it follows, in its request's order.
    pub parts: Vec<Part>,
    /// ACKs and NACKs its client sent (xDS).
    pub acks: AtomicU64,
    /// See `acks`.
    pub nacks: AtomicU64,
}

/// One resource or set a stream follows (or, for xDS, one resource type).
#[derive(Debug)]
pub struct Part {
    /// Its selector (an xDS type's name).
    pub selector: String,
    delivered: Mutex<Option<(Delivered, SystemTime)>>,
    /// The version the stream would have its client hold, where the stream knows it rather
    /// than the registry (the last an xDS stream sent).
    current: Mutex<Option<Arc<str>>>,
}

/// The version of what a stream was last handed of one resource or set.
#[derive(Debug, Clone)]
pub enum Delivered {
    /// A state of the resource.
    Object(Arc<Update>),
    /// That the resource does not exist.
    Absent,
    /// A set's members, by their version (`SYNCED.set_version`).
    Set(Arc<str>),
    /// An xDS type's resources, by the version sent.
    Xds(Arc<str>),
}

impl Delivered {
    /// The version: a resourceVersion, a set's version, an xDS version; empty for absence.
    pub fn version(&self) -> &str {
        match self {
            Delivered::Object(u) => &u.object.resource_version,
            Delivered::Absent => "",
            Delivered::Set(v) | Delivered::Xds(v) => v,
        }
    }
}

impl Part {
    /// What was last handed over, and when.
    pub fn delivered(&self) -> Option<(Delivered, SystemTime)> {
        lock(&self.delivered).clone()
    }

    /// The version the stream would have its client hold, if the stream keeps it.
    pub fn current(&self) -> Option<Arc<str>> {
        lock(&self.current).clone()
    }
}

/// A stream's entry, removed when the last holder drops it.
#[derive(Debug)]
pub struct Registered {
    subscriber: Arc<Subscriber>,
    open: Weak<Mutex<HashMap<u64, Arc<Subscriber>>>>,
}

impl std::ops::Deref for Registered {
    type Target = Subscriber;

    fn deref(&self) -> &Subscriber {
        &self.subscriber
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Some(open) = self.open.upgrade() {
            lock(&open).remove(&self.subscriber.id);
        }
    }
}

impl Registered {
    /// Records that part `index` was handed `what` now.
    pub fn delivered(&self, index: usize, what: Delivered) {
        if let Some(part) = self.subscriber.parts.get(index) {
            *lock(&part.delivered) = Some((what, SystemTime::now()));
        }
    }

    /// Records that part `index` should hold `version` (what an xDS stream sent; its ACK is
    /// the delivery).
    pub fn current(&self, index: usize, version: Arc<str>) {
        if let Some(part) = self.subscriber.parts.get(index) {
            *lock(&part.current) = Some(version);
        }
    }
}

impl Subscribers {
    /// Registers a stream of `caller` over `protocol`, following `selectors`.
    pub fn register(
        &self,
        caller: String,
        protocol: &'static str,
        selectors: Vec<String>,
    ) -> Arc<Registered> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let subscriber = Arc::new(Subscriber {
            id,
            caller,
            protocol,
            opened: SystemTime::now(),
            parts: selectors
                .into_iter()
                .map(|selector| Part {
                    selector,
                    delivered: Mutex::new(None),
                    current: Mutex::new(None),
                })
                .collect(),
            acks: AtomicU64::new(0),
            nacks: AtomicU64::new(0),
        });
        lock(&self.open).insert(id, subscriber.clone());
        Arc::new(Registered {
            subscriber,
            open: Arc::downgrade(&self.open),
        })
    }

    /// The open streams, in the order they opened.
    pub fn list(&self) -> Vec<Arc<Subscriber>> {
        let mut all: Vec<Arc<Subscriber>> = lock(&self.open).values().cloned().collect();
        all.sort_by_key(|s| s.id);
        all
    }

    /// How many streams are open.
    pub fn len(&self) -> usize {
        lock(&self.open).len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One part of a stream, for the recording of what it is handed (`None`: not recorded).
pub type PartRef = Option<(Arc<Registered>, usize)>;

/// Records `what` for `part`, if it is recorded.
pub fn record(part: &PartRef, what: Delivered) {
    if let Some((registered, index)) = part {
        registered.delivered(*index, what);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_is_listed_while_a_holder_lives_with_what_each_part_was_handed() {
        let subscribers = Subscribers::default();
        let a = subscribers.register("ip:10.0.0.1".into(), "native", vec!["x".into(), "y".into()]);
        let b = subscribers.register("ip:10.0.0.2".into(), "xds", vec![]);
        assert_eq!(subscribers.len(), 2);
        record(&Some((a.clone(), 1)), Delivered::Set("0123".into()));
        record(&Some((a.clone(), 7)), Delivered::Absent);
        let listed = subscribers.list();
        assert_eq!(listed[0].caller, "ip:10.0.0.1");
        assert!(listed[0].parts[0].delivered().is_none());
        let (what, _) = listed[0].parts[1].delivered().unwrap();
        assert_eq!(what.version(), "0123");
        let held = (a.clone(), 0);
        drop(a);
        assert_eq!(subscribers.len(), 2, "a part still holds it");
        drop(held);
        drop(b);
        assert!(subscribers.is_empty());
    }
}
