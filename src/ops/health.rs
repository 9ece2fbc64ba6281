//! Readiness, one truth for `/readyz` and `grpc.health.v1`: ready once the source answers and
//! lets the broker read the kinds it serves (and do what its identity sources need), checked in
//! the background and cached, never per probe; and not while draining. Once the source has
//! answered, a failing check keeps the broker ready for `--max-staleness`: it serves what it
//! knows through an API-server outage instead of every replica leaving its Service at once.
//! tonic-health starts the overall service "" as SERVING; it is set NOT_SERVING before anything
//! is served and follows readiness from then on.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::access::Access;
use crate::registry::Registry;
use crate::source::Source;
use crate::telemetry::Metrics;

/// The default `--max-staleness`.
pub const DEFAULT_MAX_STALENESS: Duration = Duration::from_secs(300);

/// The longest one check may take: a source that hangs fails it.
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// The services whose health is reported, besides the overall "".
pub const SERVICES: &[&str] = &[
    "",
    "crdbroker.v1.Broker",
    "flagd.sync.v1.FlagSyncService",
    "sync.v1.FlagSyncService",
];

/// What readiness rests on.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadyState {
    /// The last check of the source: `Err` says what is wrong; `None` until the first check.
    pub source: Option<Result<(), String>>,
    /// When that check ran.
    pub checked_at: Option<SystemTime>,
    /// When a check last passed; `None` until one has.
    pub passed_at: Option<Instant>,
    /// How long after the last passing check a failing source still counts as ready.
    pub max_staleness: Duration,
    /// Whether the broker is shutting down.
    pub draining: bool,
}

impl ReadyState {
    /// How long the source has been failing its checks, counted from the last that passed;
    /// zero while it passes (or before it ever has).
    pub fn stale(&self) -> Duration {
        match (&self.source, self.passed_at) {
            (Some(Err(_)), Some(passed)) => passed.elapsed(),
            _ => Duration::ZERO,
        }
    }

    /// Ready to take subscribers.
    pub fn ready(&self) -> bool {
        !self.draining
            && match &self.source {
                Some(Ok(())) => true,
                Some(Err(_)) => self.passed_at.is_some() && self.stale() <= self.max_staleness,
                None => false,
            }
    }

    /// Why (or how) it is ready or not, for people.
    pub fn reason(&self) -> String {
        let stale = humantime::format_duration(Duration::from_secs(self.stale().as_secs()));
        let max = humantime::format_duration(self.max_staleness);
        match (&self.source, self.draining) {
            (_, true) => "shutting down".to_string(),
            (None, _) => "the source has not been checked yet".to_string(),
            (Some(Err(e)), _) if self.passed_at.is_none() => e.clone(),
            (Some(Err(e)), _) if self.ready() => format!(
                "ready, serving last-known states: the source has failed for {stale} (--max-staleness {max}): {e}"
            ),
            (Some(Err(e)), _) => {
                format!("the source has failed for {stale}, longer than --max-staleness {max}: {e}")
            }
            (Some(Ok(())), false) => "ready".to_string(),
        }
    }
}

/// The broker's readiness.
pub struct Readiness {
    state: watch::Sender<ReadyState>,
    reporter: HealthReporter,
}

impl Readiness {
    /// Not ready until the first check passes; draining once `shutdown` is cancelled.
    pub fn new(
        reporter: HealthReporter,
        shutdown: CancellationToken,
        max_staleness: Duration,
    ) -> Arc<Self> {
        // The reporter's lock is uncontended here, so this does not wait on the runtime.
        futures::executor::block_on(async {
            for service in SERVICES {
                reporter
                    .set_service_status(*service, ServingStatus::NotServing)
                    .await;
            }
        });
        let (state, _) = watch::channel(ReadyState {
            source: None,
            checked_at: None,
            passed_at: None,
            max_staleness,
            draining: false,
        });
        let readiness = Arc::new(Readiness { state, reporter });
        let on_drain = readiness.clone();
        tokio::spawn(async move {
            shutdown.cancelled().await;
            on_drain.state.send_modify(|s| s.draining = true);
            on_drain.report().await;
        });
        readiness
    }

    /// The current state.
    pub fn current(&self) -> ReadyState {
        self.state.borrow().clone()
    }

    /// Checks the source (and that the broker may do what its identity sources need) now and
    /// then: every `every` while it passes, every second while it does not, until the broker
    /// drains. Records the staleness in `metrics`.
    pub fn spawn_checks<S: Source>(
        self: &Arc<Self>,
        registry: Registry<S>,
        access: Arc<Access>,
        every: Duration,
        metrics: Arc<Metrics>,
    ) {
        let readiness = self.clone();
        tokio::spawn(async move {
            let mut was_ready = false;
            loop {
                if readiness.current().draining {
                    return;
                }
                let check = async {
                    registry.source().check().await?;
                    access.check().await
                };
                let result = tokio::time::timeout(CHECK_TIMEOUT, check)
                    .await
                    .unwrap_or_else(|_| {
                        Err(format!(
                            "the source did not answer its check within {CHECK_TIMEOUT:?}"
                        ))
                    });
                let pause = if result.is_ok() {
                    every
                } else {
                    every.min(Duration::from_secs(1))
                };
                let changed = readiness.state.send_if_modified(|s| {
                    let was = s.source.clone();
                    if result.is_ok() {
                        s.passed_at = Some(Instant::now());
                    }
                    s.source = Some(result);
                    s.checked_at = Some(SystemTime::now());
                    was != s.source
                });
                let state = readiness.current();
                metrics
                    .watch
                    .source_stale_seconds
                    .set(state.stale().as_secs_f64());
                if changed || state.ready() != was_ready {
                    match state.ready() {
                        true if state.source != Some(Ok(())) => {
                            tracing::warn!(reason = %state.reason(), "the source fails; still ready")
                        }
                        true => tracing::info!("ready"),
                        false => tracing::warn!(reason = %state.reason(), "not ready"),
                    }
                    was_ready = state.ready();
                    readiness.report().await;
                }
                tokio::time::sleep(pause).await;
            }
        });
    }

    async fn report(&self) {
        let status = if self.current().ready() {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for service in SERVICES {
            self.reporter.set_service_status(*service, status).await;
        }
    }
}
