//! A bounded cache whose misses are fetched once, however many ask at the same time (single
//! flight), and whose entries each live as long as their fetch says. Discovery, pod lookups and
//! token reviews go through it, so that a storm of requests for one key costs one API call, and
//! requests for ever new keys cannot grow it without bound.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

use crate::sync::lock;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use tokio::time::Instant;

/// A value and how long it may be served.
#[derive(Debug, Clone)]
struct Fetched<V> {
    value: V,
    until: Instant,
}

/// The cache. `V` is cloned to every asker, so it is usually small or an `Arc`.
pub struct FlightCache<K, V> {
    slots: Mutex<HashMap<K, Shared<BoxFuture<'static, Fetched<V>>>>>,
    capacity: usize,
}

impl<K, V> FlightCache<K, V>
where
    K: Hash + Eq + Clone,
    V: Clone + Send + Sync + 'static,
{
    /// A cache holding at most `capacity` keys.
    pub fn new(capacity: usize) -> Self {
        FlightCache {
            slots: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
        }
    }

    /// The value for `key`: a cached one that has not expired, the one being fetched now, or a
    /// new fetch by `fetch`, which says how long its value may be served (`Duration::ZERO`: not
    /// beyond the askers already waiting for it).
    pub async fn get(
        &self,
        key: &K,
        fetch: impl FnOnce() -> BoxFuture<'static, (V, Duration)>,
    ) -> V {
        let shared = {
            let mut slots = lock(&self.slots);
            let now = Instant::now();
            let live = slots.get(key).filter(|s| match s.peek() {
                Some(done) => done.until > now,
                None => true,
            });
            match live {
                // Answered already: no need to go through the future.
                Some(s) if let Some(done) = s.peek() => return done.value.clone(),
                Some(s) => s.clone(),
                None => {
                    if slots.len() >= self.capacity && !slots.contains_key(key) {
                        evict(&mut slots, now, self.capacity);
                    }
                    let future = fetch();
                    let shared = async move {
                        let (value, ttl) = future.await;
                        Fetched {
                            value,
                            until: Instant::now() + ttl,
                        }
                    }
                    .boxed()
                    .shared();
                    slots.insert(key.clone(), shared.clone());
                    shared
                }
            }
        };
        shared.await.value
    }

    /// Whether `key` has a value that has not expired, or a fetch in flight.
    pub fn holds(&self, key: &K) -> bool {
        let slots = lock(&self.slots);
        let now = Instant::now();
        slots
            .get(key)
            .is_some_and(|s| s.peek().is_none_or(|done| done.until > now))
    }

    /// Keys held now (expired ones included until they are evicted).
    pub fn len(&self) -> usize {
        lock(&self.slots).len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets `key`.
    pub fn remove(&self, key: &K) {
        lock(&self.slots).remove(key);
    }
}

/// Makes room: drops expired entries, then, if the cache is still full, finished entries,
/// then anything (fetches in flight keep running for those already waiting on them).
fn evict<K: Hash + Eq, V: Clone>(
    slots: &mut HashMap<K, Shared<BoxFuture<'static, Fetched<V>>>>,
    now: Instant,
    capacity: usize,
) {
    slots.retain(|_, s| s.peek().is_none_or(|d| d.until > now));
    if slots.len() >= capacity {
        slots.retain(|_, s| s.peek().is_none());
    }
    if slots.len() >= capacity {
        slots.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn counting(
        calls: &Arc<AtomicUsize>,
        value: u32,
        ttl: Duration,
    ) -> impl FnOnce() -> BoxFuture<'static, (u32, Duration)> + use<> {
        let calls = calls.clone();
        move || {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                (value, ttl)
            }
            .boxed()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_misses_fetch_once_and_expired_entries_are_fetched_again() {
        let cache = Arc::new(FlightCache::new(10));
        let calls = Arc::new(AtomicUsize::new(0));
        let askers: Vec<_> = (0..50)
            .map(|_| {
                let cache = cache.clone();
                let fetch = counting(&calls, 7, Duration::from_secs(2));
                tokio::spawn(async move { cache.get(&"k", fetch).await })
            })
            .collect();
        for a in askers {
            assert_eq!(a.await.unwrap(), 7);
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(
            cache.get(&"k", counting(&calls, 8, Duration::ZERO)).await,
            7
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(
            cache.get(&"k", counting(&calls, 8, Duration::ZERO)).await,
            8
        );
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        // A value fetched with no time to live is fetched again by the next asker.
        assert_eq!(
            cache.get(&"k", counting(&calls, 9, Duration::ZERO)).await,
            9
        );
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn new_keys_cannot_grow_it_past_its_capacity() {
        let cache = FlightCache::new(100);
        let calls = Arc::new(AtomicUsize::new(0));
        for i in 0..10_000u32 {
            cache
                .get(&i, counting(&calls, i, Duration::from_secs(60)))
                .await;
            assert!(cache.len() <= 100, "{} keys after {i}", cache.len());
        }
        assert_eq!(calls.load(Ordering::SeqCst), 10_000);
    }
}
