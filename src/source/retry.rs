//! How a source's watches retry: a jittered exponential [`Backoff`] each, reset once a watch has
//! held, and one shared [`Recovery`] that notices when an unreachable API server answers again,
//! so that watches waiting out an outage return within moments of it, spread over
//! [`RECOVERY_SPREAD`] instead of in lockstep (ADR 0013). A server that answers but refuses
//! (403, 404) is asked again by one watch per collection at a time ([`Refusals`]), and one that
//! keeps refusing or failing (5xx) more slowly, as client-go does (to [`REFUSED_BACKOFF_MAX`]).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::sync::lock;
use futures::future::BoxFuture;
use tokio::sync::watch;
use tokio::time::Instant;

/// The first retry waits about this long.
pub const BACKOFF_BASE: Duration = Duration::from_millis(200);

/// No retry waits longer than this: a quiet resource that keeps meeting faults is watched again
/// at most this long after the faults stop.
pub const BACKOFF_MAX: Duration = Duration::from_secs(3);

/// A watch that has held this long was re-established: its next failure starts the backoff
/// over.
pub const HELD: Duration = Duration::from_secs(1);

/// The first retry after a refusal (403, 404) or a server failure (5xx) waits about this long
/// (client-go's reflector: 800 ms, doubling to 30 s, jittered).
pub const REFUSED_BACKOFF_BASE: Duration = Duration::from_millis(800);

/// No retry after refusals waits longer than this.
pub const REFUSED_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// The longest a refused watch waits for another of its collection to get through before it
/// asks again itself (in case what refused the other does not refuse it).
pub const REFUSED_WAIT_MAX: Duration = Duration::from_secs(300);

/// How often an API server that stopped answering is asked whether it is back.
pub const PROBE_EVERY: Duration = Duration::from_millis(500);

/// When it is back, the watches that waited for it return at random moments within this long.
pub const RECOVERY_SPREAD: Duration = Duration::from_secs(1);

/// Refused watches that return when one of their kind gets through come back at about this many
/// a second, over [`RECOVERY_SPREAD`] or longer: 5,000 at once would meet the API server's
/// in-flight limit (429) and come back more slowly than spread.
pub const RETURN_RATE: f64 = 500.0;

/// Exponential backoff with equal jitter: the `n`th wait is between half and all of
/// `BACKOFF_BASE × 2ⁿ`, capped at [`BACKOFF_MAX`].
#[derive(Debug, Default)]
pub struct Backoff {
    attempt: u32,
    /// When the watch last started to work (a LIST answered, a WATCH began streaming).
    held_since: Option<Instant>,
}

impl Backoff {
    /// The watch works again (from now).
    pub fn working(&mut self) {
        self.held_since.get_or_insert_with(Instant::now);
    }

    /// The watch failed: how long to wait before the next try. A watch that held for [`HELD`]
    /// since its last failure starts over from the shortest wait.
    pub fn failed(&mut self) -> Duration {
        if self.held_since.take().is_some_and(|t| t.elapsed() >= HELD) {
            self.attempt = 0;
        }
        self.next(BACKOFF_BASE, BACKOFF_MAX)
    }

    /// The server answered, refusing (403, 404) or failing (5xx): how long to wait, on the
    /// slower backoff to [`REFUSED_BACKOFF_MAX`].
    pub fn refused(&mut self) -> Duration {
        if self.held_since.take().is_some_and(|t| t.elapsed() >= HELD) {
            self.attempt = 0;
        }
        self.next(REFUSED_BACKOFF_BASE, REFUSED_BACKOFF_MAX)
    }

    fn next(&mut self, base: Duration, max: Duration) -> Duration {
        let full = base.saturating_mul(1 << self.attempt.min(16)).min(max);
        self.attempt = self.attempt.saturating_add(1);
        full.mul_f64(0.5 + fastrand::f64() * 0.5)
    }
}

/// Watches the API server refuses (403, 404) or keeps failing (5xx), by collection (a kind in a
/// namespace) and by kind. One watch of each collection, its probe, asks again on its own
/// backoff (the slow one once refusals last); the collection's other watches wait until it gets
/// through, then return spread over [`RECOVERY_SPREAD`], or until [`REFUSED_WAIT_MAX`] has
/// passed. One watch of each kind asks again at the fast pace whatever: when it gets through
/// (rights given back cluster-wide, a CRD created again), every collection of the kind asks
/// again at once, spread. RBAC taken away for 5,000 watched names costs the API server one
/// request per collection per backoff, not one per name, and its return is noticed within
/// seconds.
#[derive(Default)]
pub struct Refusals {
    gates: Mutex<HashMap<String, Weak<Gate>>>,
}

struct Gate {
    /// Bumped each time a watch of the gate gets through.
    through: watch::Sender<u64>,
    /// Whether a watch is the gate's probe now.
    probing: AtomicBool,
    /// Told when the probe goes without getting through (its watch dropped): one waiter asks
    /// again, and takes over.
    probe_left: tokio::sync::Notify,
}

/// A refused watch's place at one gate: its probe, or not.
struct Place {
    gate: Arc<Gate>,
    probe: bool,
    /// What the watch has seen of the gate's successes since it joined: one after that wakes
    /// it, even if it comes before the watch starts to wait.
    seen: watch::Receiver<u64>,
}

impl Place {
    fn join(gates: &mut HashMap<String, Weak<Gate>>, key: &str) -> Place {
        let gate = match gates.get(key).and_then(Weak::upgrade) {
            Some(gate) => gate,
            None => {
                gates.retain(|_, gate| gate.strong_count() > 0);
                let gate = Arc::new(Gate {
                    through: watch::channel(0).0,
                    probing: AtomicBool::new(false),
                    probe_left: tokio::sync::Notify::new(),
                });
                gates.insert(key.to_string(), Arc::downgrade(&gate));
                gate
            }
        };
        let probe = !gate.probing.swap(true, Ordering::AcqRel);
        let mut seen = gate.through.subscribe();
        seen.mark_unchanged();
        Place { gate, probe, seen }
    }

    /// Takes the probe's part if nobody has it.
    fn claim(&mut self) {
        if !self.probe {
            self.probe = !self.gate.probing.swap(true, Ordering::AcqRel);
        }
    }

    /// Gives up the probe's part; if not `through`, a waiter is told to take over.
    fn leave(&mut self, through: bool) {
        if std::mem::take(&mut self.probe) {
            self.gate.probing.store(false, Ordering::Release);
            if !through {
                self.gate.probe_left.notify_one();
            }
        }
    }
}

/// A refused watch's places: at its collection's gate and at its kind's.
pub struct Turn {
    collection: Place,
    kind: Place,
}

impl Refusals {
    /// A watch of the collection `collection`, of the kind `kind`, was refused: its turn.
    pub fn refused(&self, kind: &str, collection: &str) -> Turn {
        let mut gates = lock(&self.gates);
        Turn {
            kind: Place::join(&mut gates, &format!("kind:{kind}")),
            collection: Place::join(&mut gates, collection),
        }
    }

    /// Gates with a refused watch now (collections and kinds).
    pub fn len(&self) -> usize {
        let gates = lock(&self.gates);
        gates
            .values()
            .filter(|gate| gate.strong_count() > 0)
            .count()
    }

    /// Whether no watch is refused.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Turn {
    /// Waits before the watch asks again. A probe waits `delay` (its own backoff), or less if
    /// another watch of its kind gets through. A waiter waits until its collection's probe or a
    /// watch of its kind gets through (then a random moment within [`RECOVERY_SPREAD`], or
    /// longer for more than [`RETURN_RATE`] refused watches of the kind), until its collection's
    /// probe goes without getting through, or until a random moment between half and all of
    /// [`REFUSED_WAIT_MAX`].
    pub fn wait(&self, delay: Duration) -> impl Future<Output = ()> + Send + 'static {
        let probe = self.is_probe();
        let (mut collection, mut kind) = (self.collection.seen.clone(), self.kind.seen.clone());
        let gate = self.collection.gate.clone();
        // Every refused watch of the kind holds its gate: they all return when it gets through.
        let herd = Arc::strong_count(&self.kind.gate) as f64;
        let over = RECOVERY_SPREAD.mul_f64((herd / RETURN_RATE).max(1.0));
        async move {
            let spread = || tokio::time::sleep(over.mul_f64(fastrand::f64()));
            if probe {
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    Ok(()) = kind.changed() => spread().await,
                }
                return;
            }
            let most = REFUSED_WAIT_MAX.mul_f64(0.5 + fastrand::f64() * 0.5);
            tokio::select! {
                _ = tokio::time::sleep(most) => {}
                _ = gate.probe_left.notified() => {}
                Ok(()) = collection.changed() => spread().await,
                Ok(()) = kind.changed() => spread().await,
            }
        }
    }

    /// The watch got through: every watch of its collection asks again, and every probe of its
    /// kind.
    pub fn through(mut self) {
        self.collection.gate.through.send_modify(|n| *n += 1);
        self.kind.gate.through.send_modify(|n| *n += 1);
        self.collection.leave(true);
        self.kind.leave(true);
    }

    /// Refused again: it takes the part of its kind's probe if nobody has it.
    pub fn again(&mut self) {
        self.kind.claim();
    }

    /// Whether this watch is a probe: of its collection, or of its kind.
    pub fn is_probe(&self) -> bool {
        self.collection.probe || self.kind.probe
    }

    /// Whether this watch is its kind's probe, which asks again at the fast pace however long
    /// refusals last.
    pub fn is_kind_probe(&self) -> bool {
        self.kind.probe
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        // A probe gone without getting through (its watch dropped): a waiter takes over.
        self.collection.leave(false);
        self.kind.leave(false);
    }
}

/// A probe of the API server: `true` when it answered.
pub type Probe = Arc<dyn Fn() -> BoxFuture<'static, bool> + Send + Sync>;

/// Notices when an API server that stopped answering answers again. Watches that fail because
/// it cannot be reached [`Recovery::wait`]: they wake at the end of their own backoff, or soon
/// after a probe finds the server back, whichever comes first. One probe runs at a time, however
/// many watches wait, so an outage costs the API server a request per [`PROBE_EVERY`] instead
/// of one per watch per backoff.
pub struct Recovery {
    probe: Probe,
    /// Bumped each time the server is found back after a probe found it gone.
    back: watch::Sender<u64>,
    probing: Mutex<Probing>,
    /// Whether the last probe failed.
    down: AtomicBool,
}

#[derive(Default)]
struct Probing {
    running: bool,
    /// When a probe last found the server answering: within [`PROBE_EVERY`] of that, failures
    /// are the watches' own and start no probe.
    up_at: Option<Instant>,
}

impl Recovery {
    /// Recovery detection by `probe`.
    pub fn new(probe: Probe) -> Arc<Self> {
        Arc::new(Recovery {
            probe,
            back: watch::channel(0).0,
            probing: Mutex::new(Probing::default()),
            down: AtomicBool::new(false),
        })
    }

    /// Whether the API server is known not to answer now (a probe failed, none has answered
    /// since).
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    /// Something failed to reach the API server: probe it, unless a probe runs already.
    pub fn suspect(self: &Arc<Self>) {
        self.start_probing();
    }

    /// Waits `delay`, or less if the API server comes back sooner: then a random moment within
    /// [`RECOVERY_SPREAD`], so that the watches waiting for it do not all return at once.
    pub fn wait(self: &Arc<Self>, delay: Duration) -> impl Future<Output = ()> + Send + 'static {
        let mut back = self.back.subscribe();
        back.mark_unchanged();
        self.suspect();
        async move {
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                Ok(()) = back.changed() => {
                    let spread = RECOVERY_SPREAD.mul_f64(fastrand::f64());
                    tokio::time::sleep(spread.min(delay)).await;
                }
            }
        }
    }

    fn start_probing(self: &Arc<Self>) {
        {
            let mut probing = lock(&self.probing);
            if probing.running || probing.up_at.is_some_and(|t| t.elapsed() < PROBE_EVERY) {
                return;
            }
            probing.running = true;
        }
        let recovery = self.clone();
        tokio::spawn(async move {
            let mut was_down = false;
            loop {
                let up = tokio::time::timeout(PROBE_EVERY * 4, (recovery.probe)())
                    .await
                    .unwrap_or(false);
                if up {
                    break;
                }
                was_down = true;
                recovery.down.store(true, Ordering::Release);
                tokio::time::sleep(PROBE_EVERY).await;
            }
            recovery.down.store(false, Ordering::Release);
            *lock(&recovery.probing) = Probing {
                running: false,
                up_at: Some(Instant::now()),
            };
            // A server that answered the first probe was never gone: the watch's failure was its
            // own, and waits out its own backoff.
            if was_down {
                tracing::info!("the API server answers again");
                recovery.back.send_modify(|n| *n += 1);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_with_jitter_to_its_cap_and_restarts_after_a_watch_held() {
        let mut b = Backoff::default();
        let waits: Vec<Duration> = (0..8).map(|_| b.failed()).collect();
        assert!(waits[0] >= BACKOFF_BASE / 2 && waits[0] <= BACKOFF_BASE);
        assert!(waits[3] >= BACKOFF_BASE * 4 && waits[3] <= BACKOFF_BASE * 8);
        assert!(waits.iter().all(|w| *w <= BACKOFF_MAX));
        assert!(waits[7] >= BACKOFF_MAX / 2);
        // Working briefly does not restart it; holding does.
        b.working();
        assert!(b.failed() >= BACKOFF_MAX / 2);
        b.held_since = Some(Instant::now() - HELD);
        assert!(b.failed() <= BACKOFF_BASE);
    }

    #[test]
    fn jitter_spreads_the_waits() {
        let waits: std::collections::BTreeSet<u128> = (0..50)
            .map(|_| Backoff::default().failed().as_micros())
            .collect();
        assert!(waits.len() > 40, "{waits:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_return_soon_after_the_server_is_back_and_one_probe_runs() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let up = Arc::new(AtomicBool::new(false));
        let probes = Arc::new(AtomicUsize::new(0));
        let (u, p) = (up.clone(), probes.clone());
        let recovery = Recovery::new(Arc::new(move || {
            p.fetch_add(1, Ordering::Relaxed);
            let up = u.load(Ordering::Relaxed);
            Box::pin(async move { up })
        }));
        let start = Instant::now();
        let waiters: Vec<_> = (0..100)
            .map(|_| tokio::spawn(recovery.wait(Duration::from_secs(30))))
            .collect();
        tokio::time::sleep(Duration::from_secs(5)).await;
        // One probe per PROBE_EVERY while the server is gone, not one per waiter.
        let during = probes.load(Ordering::Relaxed);
        assert!((9..=12).contains(&during), "{during} probes in 5 s");
        up.store(true, Ordering::Relaxed);
        for w in waiters {
            w.await.unwrap();
        }
        let took = start.elapsed();
        assert!(
            took <= Duration::from_secs(5) + PROBE_EVERY + RECOVERY_SPREAD,
            "{took:?}"
        );
    }

    #[test]
    fn refusals_back_off_slower_to_thirty_seconds() {
        let mut b = Backoff::default();
        let first = b.refused();
        assert!(first >= REFUSED_BACKOFF_BASE / 2 && first <= REFUSED_BACKOFF_BASE);
        let waits: Vec<Duration> = (0..10).map(|_| b.refused()).collect();
        assert!(waits.iter().all(|w| *w <= REFUSED_BACKOFF_MAX));
        assert!(waits[9] >= REFUSED_BACKOFF_MAX / 2, "{waits:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn one_refused_watch_per_collection_asks_and_the_rest_wait_for_it() {
        let refusals = Refusals::default();
        let probe = refusals.refused("widgets", "ns-a/widgets");
        assert!(probe.is_probe() && probe.is_kind_probe());
        let waiters: Vec<Turn> = (0..100)
            .map(|_| refusals.refused("widgets", "ns-a/widgets"))
            .collect();
        assert!(waiters.iter().all(|t| !t.is_probe()));
        let other = refusals.refused("widgets", "ns-b/widgets");
        assert!(
            other.is_probe() && !other.is_kind_probe(),
            "another collection has a probe of its own; the kind has one"
        );
        let start = Instant::now();
        let woken: Vec<_> = waiters
            .iter()
            .map(|t| tokio::spawn(t.wait(Duration::from_secs(1))))
            .collect();
        let slow = tokio::spawn(other.wait(REFUSED_BACKOFF_MAX));
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert!(
            woken.iter().all(|w| !w.is_finished()),
            "waiting for the probe"
        );
        probe.through();
        for w in woken {
            w.await.unwrap();
        }
        slow.await.unwrap();
        assert!(
            start.elapsed() <= Duration::from_secs(20) + RECOVERY_SPREAD,
            "the other collection's probe, on the slow backoff, asked again with the kind"
        );
        drop(waiters);
        assert!(refusals.refused("widgets", "ns-a/widgets").is_probe());
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_goes_hands_over_and_a_success_before_the_wait_still_wakes() {
        let refusals = Refusals::default();
        let probe = refusals.refused("k", "c");
        let waiter = refusals.refused("k", "c");
        let start = Instant::now();
        drop(probe);
        waiter.wait(Duration::from_secs(1)).await;
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "woken to take over"
        );
        let mut waiter = waiter;
        waiter.again();
        assert!(waiter.is_kind_probe(), "the kind's probe taken over");
        drop(waiter);
        assert!(refusals.refused("k", "c").is_probe());
        // A success between a waiter's refusal and its wait is not missed.
        let refusals = Refusals::default();
        let probe = refusals.refused("k", "c");
        let waiter = refusals.refused("k", "c");
        probe.through();
        let start = Instant::now();
        waiter.wait(Duration::from_secs(1)).await;
        assert!(start.elapsed() <= RECOVERY_SPREAD);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_whose_probe_never_gets_through_asks_again_itself() {
        let refusals = Refusals::default();
        let _probe = refusals.refused("k", "c");
        let waiter = refusals.refused("k", "c");
        let start = Instant::now();
        waiter.wait(Duration::from_secs(1)).await;
        let waited = start.elapsed();
        assert!(
            waited >= REFUSED_WAIT_MAX / 2 && waited <= REFUSED_WAIT_MAX,
            "{waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_large_herd_returns_at_the_return_rate() {
        const HERD: usize = 3_000;
        let refusals = Refusals::default();
        let probe = refusals.refused("widgets", "ns-0/widgets");
        let herd: Vec<Turn> = (1..HERD)
            .map(|n| refusals.refused("widgets", &format!("ns-{n}/widgets")))
            .collect();
        let start = Instant::now();
        let returned: Vec<_> = herd
            .iter()
            .map(|t| {
                let wait = t.wait(REFUSED_BACKOFF_MAX);
                tokio::spawn(async move {
                    wait.await;
                    Instant::now() - start
                })
            })
            .collect();
        probe.through();
        let mut at = Vec::new();
        for r in returned {
            at.push(r.await.unwrap());
        }
        let over = RECOVERY_SPREAD.mul_f64(HERD as f64 / RETURN_RATE);
        let last = at.iter().max().unwrap();
        assert!(
            *last <= over,
            "all back within {over:?}, woken by the kind: {last:?}"
        );
        let in_the_first_second = at.iter().filter(|t| **t <= RECOVERY_SPREAD).count() as f64;
        assert!(
            (in_the_first_second - RETURN_RATE).abs() < RETURN_RATE * 0.2,
            "about {RETURN_RATE} a second: {in_the_first_second}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_that_never_left_wakes_nobody() {
        let recovery = Recovery::new(Arc::new(|| Box::pin(async { true })));
        let start = Instant::now();
        recovery.wait(Duration::from_secs(2)).await;
        assert!(start.elapsed() >= Duration::from_secs(2));
    }
}
