//! How a source's watches retry: a jittered exponential [`Backoff`] each, reset once a watch has
//! held, and one shared [`Recovery`] that notices when an unreachable API server answers again,
//! so that watches waiting out an outage return within moments of it, spread over
//! [`RECOVERY_SPREAD`] instead of in lockstep (ADR 0013).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

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

/// How often an API server that stopped answering is asked whether it is back.
pub const PROBE_EVERY: Duration = Duration::from_millis(500);

/// When it is back, the watches that waited for it return at random moments within this long.
pub const RECOVERY_SPREAD: Duration = Duration::from_secs(1);

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
        let full = BACKOFF_BASE
            .saturating_mul(1 << self.attempt.min(16))
            .min(BACKOFF_MAX);
        self.attempt = self.attempt.saturating_add(1);
        full.mul_f64(0.5 + fastrand::f64() * 0.5)
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
            let mut probing = self.probing.lock().unwrap_or_else(PoisonError::into_inner);
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
            *recovery
                .probing
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Probing {
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

    #[tokio::test(start_paused = true)]
    async fn a_server_that_never_left_wakes_nobody() {
        let recovery = Recovery::new(Arc::new(|| Box::pin(async { true })));
        let start = Instant::now();
        recovery.wait(Duration::from_secs(2)).await;
        assert!(start.elapsed() >= Duration::from_secs(2));
    }
}
