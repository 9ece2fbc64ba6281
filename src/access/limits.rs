//! Per-caller limits: streams open at once (`--max-streams-per-caller`), new watches per
//! second (`--new-watch-rate`, a token bucket of `--new-watch-burst`), and watches a caller
//! caused that are still open, lingering ones too (`--max-watches-per-caller`), so that one
//! caller cannot exhaust the broker or the API server, or fill `--max-watches`, for everyone
//! else. Sets have a budget of their own (`--max-sets-per-caller`): a set lists, watches and
//! holds a whole namespace's worth of objects, so it is not charged like one object.
//!
//! New streams of the whole broker are paced too, if asked (`--max-new-streams-per-second`): a
//! replica's loss sends its subscribers to the others all at once, and the survivors then serve
//! their own subscribers first. A stream refused for it is told when to try again, the hints
//! spread over the time the refused ones need; no caller takes more than a quarter of the pace.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::sync::lock;
use crate::telemetry::Limit;

/// The limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Config {
    /// Streams one caller may have open at once.
    pub max_streams_per_caller: usize,
    /// New watches one caller may start per second, on average.
    pub new_watch_rate: f64,
    /// New watches one caller may start at once.
    pub new_watch_burst: f64,
    /// Watches one caller's requests started that are open now (lingering ones too).
    pub max_watches_per_caller: usize,
    /// Sets one caller's requests started that are open now (lingering ones too).
    pub max_sets_per_caller: usize,
    /// New streams the whole broker takes per second, at most one second's worth at once; 0:
    /// no bound.
    pub max_new_streams_per_second: f64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_streams_per_caller: DEFAULT_MAX_STREAMS_PER_CALLER,
            new_watch_rate: DEFAULT_NEW_WATCH_RATE,
            new_watch_burst: DEFAULT_NEW_WATCH_BURST,
            // None of its own: `serve` gives each caller a share of `--max-watches`.
            max_watches_per_caller: usize::MAX,
            max_sets_per_caller: DEFAULT_MAX_SETS_PER_CALLER,
            max_new_streams_per_second: DEFAULT_MAX_NEW_STREAMS_PER_SECOND,
        }
    }
}

/// The default `--max-watches-per-caller` for `max_watches`: a quarter of it, so that no one
/// caller can fill it.
pub fn share_of(max_watches: usize) -> usize {
    (max_watches / 4).max(1)
}

/// The default `--max-streams-per-caller`: a pod with a few sidecars holds a few streams.
pub const DEFAULT_MAX_STREAMS_PER_CALLER: usize = 1000;
/// The default `--new-watch-rate`.
pub const DEFAULT_NEW_WATCH_RATE: f64 = 20.0;
/// The default `--new-watch-burst`: two full Subscribe requests of cold resources.
pub const DEFAULT_NEW_WATCH_BURST: f64 = 200.0;
/// The default `--max-sets-per-caller`: a workload follows a few sets (one per flag source),
/// while each set costs a LIST, a WATCH and its members' bytes.
pub const DEFAULT_MAX_SETS_PER_CALLER: usize = 16;

/// The default `--max-new-streams-per-second`.
pub const DEFAULT_MAX_NEW_STREAMS_PER_SECOND: f64 = 0.0;
/// The longest a refused stream is told to wait.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(30);

/// Above this many callers tracked, idle ones are forgotten.
const TRACKED: usize = 10_000;

/// What is tracked of each key, whose idle entries are forgotten once it holds more than
/// [`TRACKED`], and twice as many as after the last time: each entry is looked at once per
/// doubling, so that more callers than that are not all scanned on every request.
#[derive(Debug)]
struct Tracked<T> {
    entries: HashMap<String, T>,
    after_sweep: usize,
}

impl<T> Default for Tracked<T> {
    fn default() -> Self {
        Tracked {
            entries: HashMap::new(),
            after_sweep: 0,
        }
    }
}

impl<T> Tracked<T> {
    /// Forgets the entries `keep` says are idle, if it is time.
    fn sweep(&mut self, mut keep: impl FnMut(&T) -> bool) {
        if self.entries.len() <= TRACKED.max(2 * self.after_sweep) {
            return;
        }
        self.entries.retain(|_, entry| keep(entry));
        self.after_sweep = self.entries.len();
    }
}

#[derive(Debug)]
struct Account {
    streams: usize,
    new_watches: Bucket,
    /// Its share of the broker's pace of new streams.
    new_streams: Bucket,
    /// Watches its requests started, open now.
    watches: usize,
    /// Sets its requests started, open now.
    sets: usize,
}

/// What a request starts that is not watched yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct New {
    /// Resources.
    pub watches: usize,
    /// Sets.
    pub sets: usize,
}

/// What a charge is for: a resource's watch or a set's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Charged {
    /// A resource's watch (`--max-watches-per-caller`).
    Watch,
    /// A set's (`--max-sets-per-caller`).
    Set,
}

/// A token bucket: `burst` tokens at most, refilled at `rate` a second.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(burst: f64, now: Instant) -> Bucket {
        Bucket {
            tokens: burst,
            at: now,
        }
    }

    /// The tokens it holds at `now`.
    fn level(&self, rate: f64, burst: f64, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        (self.tokens + elapsed * rate).min(burst)
    }

    /// Takes `wanted` tokens if it holds them; else the whole tokens it holds.
    fn take(&mut self, wanted: f64, rate: f64, burst: f64, now: Instant) -> Result<(), f64> {
        self.tokens = self.level(rate, burst, now);
        self.at = now;
        if wanted > self.tokens {
            return Err(self.tokens.floor());
        }
        self.tokens -= wanted;
        Ok(())
    }
}

/// How often each key (a source address) may do one costly thing, such as have a bearer token
/// nobody has shown yet reviewed: a token bucket per key. Buckets that have refilled are
/// forgotten above [`TRACKED`] keys, so made-up keys cannot grow it without bound.
#[derive(Debug)]
pub struct Rates {
    rate: f64,
    burst: f64,
    buckets: Mutex<Tracked<Bucket>>,
}

impl Rates {
    /// `rate` a second for each key, `burst` at once.
    pub fn new(rate: f64, burst: f64) -> Self {
        Rates {
            rate,
            burst,
            buckets: Mutex::default(),
        }
    }

    /// Whether `key` may do it once more now (and counts it if so).
    pub fn take(&self, key: &str) -> bool {
        let (rate, burst) = (self.rate, self.burst);
        let now = Instant::now();
        let mut buckets = lock(&self.buckets);
        buckets.sweep(|b| b.level(rate, burst, now) < burst);
        buckets
            .entries
            .entry(key.to_string())
            .or_insert_with(|| Bucket::full(burst, now))
            .take(1.0, rate, burst, now)
            .is_ok()
    }

    /// Keys tracked now.
    pub fn len(&self) -> usize {
        lock(&self.buckets).entries.len()
    }

    /// Whether no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What every caller has used.
#[derive(Debug)]
pub struct Limits {
    config: Config,
    accounts: Arc<Mutex<Tracked<Account>>>,
    /// The broker's pace of new streams (`--max-new-streams-per-second`).
    pace: Mutex<Pace>,
}

/// A request the limits refuse: which limit, why, and when to try again if that helps.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    /// The limit.
    pub limit: Limit,
    /// Why, naming the limit's flag.
    pub why: String,
    /// When the caller may try again (the broker's pace of new streams).
    pub retry_after: Option<Duration>,
}

impl Refusal {
    fn new(limit: Limit, why: String) -> Refusal {
        Refusal {
            limit,
            why,
            retry_after: None,
        }
    }
}

/// The broker's bucket of new streams, and about how many were refused in the last second (a
/// count that decays by e each second), by which a refused stream's hint is spread.
#[derive(Debug)]
struct Pace {
    bucket: Bucket,
    refused: f64,
    refused_at: Instant,
}

impl Pace {
    /// Whether a new stream may start now at `rate` a second; if not, when to try again: a
    /// random moment before the bucket has a token for each stream refused lately, so that
    /// the refused do not all come back at once.
    fn check(&mut self, rate: f64, now: Instant) -> Result<(), Duration> {
        let level = self.bucket.level(rate, rate.max(1.0), now);
        if level >= 1.0 {
            return Ok(());
        }
        let since = now.saturating_duration_since(self.refused_at).as_secs_f64();
        self.refused = self.refused * (-since).exp() + 1.0;
        self.refused_at = now;
        let next = (1.0 - level) / rate;
        let wait = next + fastrand::f64() * self.refused / rate;
        Err(Duration::from_secs_f64(wait).min(MAX_RETRY_AFTER))
    }
}

/// One open stream of a caller's, counted until dropped.
#[derive(Debug)]
pub struct Slot {
    key: Option<String>,
    accounts: Arc<Mutex<Tracked<Account>>>,
}

impl Limits {
    /// Limits as configured.
    pub fn new(config: Config) -> Self {
        let now = Instant::now();
        let rate = config.max_new_streams_per_second;
        Limits {
            config,
            accounts: Arc::default(),
            pace: Mutex::new(Pace {
                bucket: Bucket::full(rate.max(1.0), now),
                refused: 0.0,
                refused_at: now,
            }),
        }
    }

    /// The broker's pace of new streams, if it has one: `Ok` takes a token, unless `check`
    /// refuses first (the caller's own limits, checked under the same lock).
    fn paced<T>(
        &self,
        now: Instant,
        check: impl FnOnce() -> Result<T, Refusal>,
    ) -> Result<T, Refusal> {
        let rate = self.config.max_new_streams_per_second;
        if rate <= 0.0 {
            return check();
        }
        let mut pace = lock(&self.pace);
        if let Err(wait) = pace.check(rate, now) {
            return Err(Refusal {
                limit: Limit::NewStreams,
                why: format!(
                    "the broker takes {rate} new streams a second (--max-new-streams-per-second), and has taken them for now: try again in {} ms",
                    wait.as_millis().max(1)
                ),
                retry_after: Some(wait),
            });
        }
        let admitted = check()?;
        let burst = rate.max(1.0);
        let _ = pace.bucket.take(1.0, rate, burst, now);
        Ok(admitted)
    }

    /// The callers with streams open, by their limit key (`ip:…`, `pod:…`, `sa:…`, `unix:…`),
    /// and how many each has.
    pub fn callers(&self) -> Vec<(String, usize)> {
        lock(&self.accounts)
            .entries
            .iter()
            .filter(|(_, a)| a.streams > 0)
            .map(|(key, a)| (key.clone(), a.streams))
            .collect()
    }

    /// Counts a new stream of the caller `key` (`None`: a caller the limits do not apply to)
    /// that starts `new` watches and sets, or says which limit it would break. Each new watch
    /// and each new set takes a token of the new-watch rate.
    pub fn admit(&self, key: Option<String>, new: New) -> Result<Slot, Refusal> {
        let now = Instant::now();
        let Some(key) = key else {
            return self.paced(now, || {
                Ok(Slot {
                    key: None,
                    accounts: self.accounts.clone(),
                })
            });
        };
        let c = self.config;
        let mut accounts = lock(&self.accounts);
        accounts.sweep(|a| {
            a.streams > 0
                || a.watches > 0
                || a.sets > 0
                || a.new_watches
                    .level(c.new_watch_rate, c.new_watch_burst, now)
                    < c.new_watch_burst
        });
        let share = (c.max_new_streams_per_second / 4.0).max(1.0);
        let account = accounts.entries.entry(key.clone()).or_insert(Account {
            streams: 0,
            new_watches: Bucket::full(c.new_watch_burst, now),
            new_streams: Bucket::full(share, now),
            watches: 0,
            sets: 0,
        });
        if account.streams >= c.max_streams_per_caller {
            return Err(Refusal::new(
                Limit::StreamsPerCaller,
                format!(
                    "this caller has {} streams open, the most one caller may (--max-streams-per-caller)",
                    account.streams
                ),
            ));
        }
        let new_watches = new.watches;
        if new_watches > 0 && account.watches.saturating_add(new_watches) > c.max_watches_per_caller
        {
            return Err(Refusal::new(
                Limit::WatchesPerCaller,
                format!(
                    "this request starts {new_watches} new watches, and this caller's requests keep {} open (lingering ones too) of at most {} (--max-watches-per-caller)",
                    account.watches, c.max_watches_per_caller
                ),
            ));
        }
        if new.sets > 0 && account.sets.saturating_add(new.sets) > c.max_sets_per_caller {
            return Err(Refusal::new(
                Limit::SetsPerCaller,
                format!(
                    "this request starts {} new sets, and this caller's requests keep {} open (lingering ones too) of at most {} (--max-sets-per-caller)",
                    new.sets, account.sets, c.max_sets_per_caller
                ),
            ));
        }
        self.paced(now, || {
            let paced = c.max_new_streams_per_second > 0.0;
            if paced && account.new_streams.level(share, share, now) < 1.0 {
                return Err(Refusal {
                    limit: Limit::NewStreams,
                    why: format!(
                        "this caller has opened {share} new streams in the last second, a quarter of what the broker takes (--max-new-streams-per-second)"
                    ),
                    retry_after: Some(Duration::from_secs_f64(1.0 / share)),
                });
            }
            let (rate, burst) = (c.new_watch_rate, c.new_watch_burst);
            let starts = new_watches + new.sets;
            if let Err(available) = account.new_watches.take(starts as f64, rate, burst, now) {
                return Err(Refusal::new(
                    Limit::NewWatchRate,
                    format!(
                        "this request starts {starts} new watches; this caller may start {available} now and {rate} per second (--new-watch-rate, --new-watch-burst)"
                    ),
                ));
            }
            if paced {
                let _ = account.new_streams.take(1.0, share, share, now);
            }
            account.streams += 1;
            Ok(Slot {
                key: Some(key),
                accounts: self.accounts.clone(),
            })
        })
    }
}

impl Slot {
    /// A watch or a set this stream's request started, charged to its caller until it ends
    /// (`None` for a caller the limits do not apply to).
    pub fn charge(&self, what: Charged) -> Option<Charge> {
        let key = self.key.clone()?;
        let mut accounts = lock(&self.accounts);
        *accounts.entries.get_mut(&key)?.count(what) += 1;
        Some(Charge {
            key,
            what,
            accounts: self.accounts.clone(),
        })
    }
}

impl Account {
    fn count(&mut self, what: Charged) -> &mut usize {
        match what {
            Charged::Watch => &mut self.watches,
            Charged::Set => &mut self.sets,
        }
    }
}

/// One open watch or set charged to a caller, until dropped.
#[derive(Debug)]
pub struct Charge {
    key: String,
    what: Charged,
    accounts: Arc<Mutex<Tracked<Account>>>,
}

impl Drop for Charge {
    fn drop(&mut self) {
        let mut accounts = lock(&self.accounts);
        if let Some(a) = accounts.entries.get_mut(&self.key) {
            let count = a.count(self.what);
            *count = count.saturating_sub(1);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Some(key) = &self.key else { return };
        let mut accounts = lock(&self.accounts);
        if let Some(a) = accounts.entries.get_mut(key) {
            a.streams = a.streams.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn limits(streams: usize, rate: f64, burst: f64) -> Limits {
        Limits::new(Config {
            max_streams_per_caller: streams,
            new_watch_rate: rate,
            new_watch_burst: burst,
            max_watches_per_caller: 1000,
            max_sets_per_caller: 1000,
            max_new_streams_per_second: 0.0,
        })
    }

    fn watches(n: usize) -> New {
        New {
            watches: n,
            sets: 0,
        }
    }

    fn sets(n: usize) -> New {
        New {
            watches: 0,
            sets: n,
        }
    }

    fn paced(rate: f64, streams: usize) -> Limits {
        Limits::new(Config {
            max_streams_per_caller: streams,
            max_new_streams_per_second: rate,
            ..Config::default()
        })
    }

    #[tokio::test(start_paused = true)]
    async fn new_streams_are_paced_for_the_broker_a_quarter_per_caller_with_a_time_to_retry() {
        let l = paced(8.0, 100);
        let mut held = Vec::new();
        for caller in ["a", "b", "c", "d"] {
            for _ in 0..2 {
                held.push(l.admit(Some(caller.into()), watches(0)).unwrap());
            }
            // Its quarter taken, a caller waits for its own share to refill; the others not.
            if caller == "a" {
                let own = l.admit(Some("a".into()), watches(0)).unwrap_err();
                assert_eq!(own.limit, Limit::NewStreams);
                assert!(own.why.contains("a quarter"), "{}", own.why);
                assert_eq!(own.retry_after, Some(Duration::from_millis(500)));
            }
        }
        // The broker's second's worth taken, everyone waits, told until when.
        for caller in [Some("e".to_string()), None] {
            let all = l.admit(caller, watches(0)).unwrap_err();
            assert_eq!(all.limit, Limit::NewStreams);
            assert!(
                all.why.contains("--max-new-streams-per-second"),
                "{}",
                all.why
            );
            let wait = all.retry_after.unwrap();
            assert!(
                wait > Duration::ZERO && wait <= Duration::from_secs(1),
                "{wait:?}"
            );
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(l.admit(Some("e".into()), watches(0)).is_ok());
        // Unbounded when 0, as by default.
        let free = paced(0.0, 10_000);
        for _ in 0..1000 {
            held.push(free.admit(None, watches(0)).unwrap());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_refused_by_its_callers_own_limits_takes_nothing_of_the_pace() {
        let l = paced(1.0, 1);
        let _a = l.admit(Some("a".into()), watches(0)).unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        for _ in 0..5 {
            let over = l.admit(Some("a".into()), watches(0)).unwrap_err();
            assert_eq!(over.limit, Limit::StreamsPerCaller);
            let costly = l.admit(Some("b".into()), watches(500)).unwrap_err();
            assert_eq!(costly.limit, Limit::NewWatchRate);
        }
        assert!(l.admit(Some("b".into()), watches(0)).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn the_refused_herd_is_told_to_come_back_spread_over_the_time_it_needs() {
        let l = paced(10.0, 100);
        let callers: Vec<String> = (0..110).map(|i| format!("c{i}")).collect();
        let mut held = Vec::new();
        let mut waits = Vec::new();
        for caller in &callers {
            match l.admit(Some(caller.clone()), watches(0)) {
                Ok(slot) => held.push(slot),
                Err(refused) => waits.push(refused.retry_after.unwrap()),
            }
        }
        assert_eq!((held.len(), waits.len()), (10, 100));
        // 100 refused at 10 a second: told to come back over about ten seconds, not at once.
        let longest = waits.iter().max().unwrap();
        assert!(*longest >= Duration::from_secs(5), "{waits:?}");
        assert!(*longest <= Duration::from_secs(11), "{waits:?}");
        let early = waits
            .iter()
            .filter(|w| **w < Duration::from_secs(1))
            .count();
        assert!(
            early < 50,
            "{early} of 100 told to come back within a second"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn sets_have_a_budget_of_their_own_kept_until_they_end() {
        let l = Limits::new(Config {
            max_sets_per_caller: 2,
            max_watches_per_caller: 1,
            ..Config::default()
        });
        let a = l.admit(Some("a".into()), sets(2)).unwrap();
        let held = [
            a.charge(Charged::Set).unwrap(),
            a.charge(Charged::Set).unwrap(),
        ];
        drop(a);
        let Refusal { limit, why, .. } = l.admit(Some("a".into()), sets(1)).unwrap_err();
        assert_eq!(limit, Limit::SetsPerCaller);
        assert!(
            why.contains("keep 2 open") && why.contains("--max-sets-per-caller"),
            "{why}"
        );
        // Its watches are counted apart: a resource is still within its share.
        let a = l.admit(Some("a".into()), watches(1)).unwrap();
        let _watch = a.charge(Charged::Watch).unwrap();
        let _b = l
            .admit(Some("b".into()), sets(2))
            .expect("another caller has its own budget");
        drop(held);
        l.admit(Some("a".into()), sets(2))
            .expect("ended sets are given back");
    }

    #[tokio::test(start_paused = true)]
    async fn watches_a_caller_started_count_until_they_end_even_after_its_streams() {
        let l = Limits::new(Config {
            max_watches_per_caller: 3,
            ..Config::default()
        });
        let a = l.admit(Some("a".into()), watches(2)).unwrap();
        let held = [
            a.charge(Charged::Watch).unwrap(),
            a.charge(Charged::Watch).unwrap(),
        ];
        drop(a);
        // Its stream gone, its watches linger: they still count.
        let Refusal { limit, why, .. } = l.admit(Some("a".into()), watches(2)).unwrap_err();
        assert_eq!(limit, Limit::WatchesPerCaller);
        assert!(why.contains("keep 2 open"), "{why}");
        let a = l.admit(Some("a".into()), watches(1)).unwrap();
        let _third = a.charge(Charged::Watch).unwrap();
        let _warm = l
            .admit(Some("a".into()), watches(0))
            .expect("warm ones cost nothing");
        let _b = l
            .admit(Some("b".into()), watches(3))
            .expect("another caller has its own share");
        drop(held);
        l.admit(Some("a".into()), watches(2))
            .expect("ended watches are given back");
        assert!(
            l.admit(None, watches(0))
                .unwrap()
                .charge(Charged::Watch)
                .is_none()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn streams_are_counted_per_caller_until_dropped() {
        let l = limits(2, 100.0, 100.0);
        let a1 = l.admit(Some("a".into()), watches(0)).unwrap();
        let _a2 = l.admit(Some("a".into()), watches(0)).unwrap();
        let Refusal { limit, why, .. } = l.admit(Some("a".into()), watches(0)).unwrap_err();
        assert_eq!(limit, Limit::StreamsPerCaller);
        assert!(why.contains("2 streams"), "{why}");
        let _b = l
            .admit(Some("b".into()), watches(0))
            .expect("another caller is not held back");
        drop(a1);
        l.admit(Some("a".into()), watches(0))
            .expect("a slot came free");
        for _ in 0..10 {
            std::mem::forget(
                l.admit(None, watches(0))
                    .expect("exempt callers are not counted"),
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn new_watches_drain_a_bucket_that_refills_at_the_rate() {
        let l = limits(1000, 10.0, 20.0);
        let key = || Some("a".to_string());
        let _s = l.admit(key(), watches(15)).unwrap();
        let limit = l.admit(key(), watches(6)).unwrap_err().limit;
        assert_eq!(limit, Limit::NewWatchRate);
        let _s = l.admit(key(), watches(5)).unwrap();
        assert!(l.admit(key(), watches(1)).is_err());
        tokio::time::advance(Duration::from_millis(500)).await;
        let _s = l.admit(key(), watches(5)).unwrap();
        assert!(l.admit(key(), watches(1)).is_err());
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(
            l.admit(key(), watches(21)).is_err(),
            "never more than the burst"
        );
        let _s = l.admit(key(), watches(20)).unwrap();
        let _w = l
            .admit(key(), watches(0))
            .expect("warm subscriptions cost nothing");
    }

    #[tokio::test(start_paused = true)]
    async fn rates_are_kept_per_key_and_made_up_keys_are_forgotten_once_refilled() {
        let rates = Rates::new(2.0, 3.0);
        assert_eq!((0..5).filter(|_| rates.take("a")).count(), 3);
        assert!(rates.take("b"), "another key has its own bucket");
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(rates.take("a"));
        assert!(!rates.take("a"));
        for i in 0..3 * TRACKED {
            rates.take(&format!("made-up-{i}"));
            if i % TRACKED == 0 {
                tokio::time::advance(Duration::from_secs(2)).await;
            }
        }
        assert!(rates.len() <= 2 * TRACKED + 2, "{} keys", rates.len());
    }
}
