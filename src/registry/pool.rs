//! Set members' states, held once across sets. Two sets that select the same object (`!x1` and
//! `!x2` both select everything in a namespace) list and watch it each, but a member at a
//! resourceVersion another set already holds gets that set's state (an `Update`: its bytes and
//! its wire forms), not a copy. The pool holds its states weakly: a state no set holds any more is gone.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;

use crate::source::Object;

/// The members' states, by uid and resourceVersion: each a `T` made from its object.
pub struct Pool<T> {
    states: DashMap<(String, String), Weak<T>>,
    /// How many states the pool held after its last sweep of the gone ones.
    swept: AtomicUsize,
}

impl<T> Default for Pool<T> {
    fn default() -> Self {
        Pool {
            states: DashMap::default(),
            swept: AtomicUsize::default(),
        }
    }
}

/// Below this many, gone states are not swept.
const SWEEP_FROM: usize = 1024;

impl<T: From<Object>> Pool<T> {
    /// The state of `object`: one a set holds already at its uid and resourceVersion, or a new
    /// one. An object without either (no API server made it) is never shared.
    pub fn update(&self, object: Object) -> Arc<T> {
        if object.uid.is_empty() || object.resource_version.is_empty() {
            return Arc::new(T::from(object));
        }
        let key = (object.uid.clone(), object.resource_version.clone());
        let update = match self.states.entry(key) {
            Entry::Occupied(mut held) => match held.get().upgrade() {
                Some(update) => return update,
                None => {
                    let update = Arc::new(T::from(object));
                    held.insert(Arc::downgrade(&update));
                    update
                }
            },
            Entry::Vacant(vacant) => {
                let update = Arc::new(T::from(object));
                vacant.insert(Arc::downgrade(&update));
                update
            }
        };
        self.sweep();
        update
    }

    /// States held now, gone ones not yet swept included.
    pub fn len(&self) -> usize {
        self.states.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// Forgets the gone states once the pool has doubled since the last sweep: amortized, each
    /// state costs one look.
    fn sweep(&self) {
        let held = self.states.len();
        if held < SWEEP_FROM.max(2 * self.swept.load(Ordering::Relaxed)) {
            return;
        }
        self.states.retain(|_, state| state.strong_count() > 0);
        self.swept.store(self.states.len(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(uid: &str, rv: &str, json: &str) -> Object {
        Object {
            json: bytes::Bytes::from(json.to_string()),
            uid: uid.into(),
            resource_version: rv.into(),
        }
    }

    #[test]
    fn one_object_at_one_version_is_held_once() {
        let pool = Pool::<Object>::default();
        let a = pool.update(object("u1", "5", "{\"a\":1}"));
        let b = pool.update(object("u1", "5", "{\"a\":1}"));
        assert!(Arc::ptr_eq(&a, &b));
        let newer = pool.update(object("u1", "6", "{\"a\":2}"));
        assert!(!Arc::ptr_eq(&a, &newer));
        let unnamed = pool.update(object("", "", "{}"));
        assert!(!Arc::ptr_eq(&unnamed, &pool.update(object("", "", "{}"))));
    }

    #[test]
    fn a_state_no_set_holds_is_gone_and_swept() {
        let pool = Pool::<Object>::default();
        let first = pool.update(object("u1", "1", "{}"));
        let weak = Arc::downgrade(&first);
        drop(first);
        assert!(weak.upgrade().is_none(), "the pool holds no state itself");
        let again = pool.update(object("u1", "1", "{}"));
        assert_eq!(Arc::strong_count(&again), 1);
        drop(again);
        for i in 0..SWEEP_FROM * 3 {
            drop(pool.update(object(&format!("u{i}"), "1", "{}")));
        }
        assert!(pool.len() < SWEEP_FROM * 2, "{} held", pool.len());
    }
}
