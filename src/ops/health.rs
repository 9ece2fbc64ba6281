//! Readiness, one truth for `/readyz` and `grpc.health.v1`: ready once the source answers and
//! lets the broker read the kinds it serves (and do what its identity sources need) (checked in the background and cached, never per
//! probe), and not while draining. tonic-health starts the overall service "" as SERVING; it is
//! set NOT_SERVING before anything is served and follows readiness from then on.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::access::Access;
use crate::registry::Registry;
use crate::source::Source;

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
    /// Whether the broker is shutting down.
    pub draining: bool,
}

impl ReadyState {
    /// Ready to take subscribers.
    pub fn ready(&self) -> bool {
        !self.draining && matches!(self.source, Some(Ok(())))
    }

    /// Why not, for people.
    pub fn reason(&self) -> String {
        match (&self.source, self.draining) {
            (_, true) => "shutting down".to_string(),
            (None, _) => "the source has not been checked yet".to_string(),
            (Some(Err(e)), _) => e.clone(),
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
    pub fn new(reporter: HealthReporter, shutdown: CancellationToken) -> Arc<Self> {
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
    /// drains.
    pub fn spawn_checks<S: Source>(
        self: &Arc<Self>,
        registry: Registry<S>,
        access: Arc<Access>,
        every: Duration,
    ) {
        let readiness = self.clone();
        tokio::spawn(async move {
            loop {
                if readiness.current().draining {
                    return;
                }
                let result = match registry.source().check().await {
                    Ok(()) => access.check().await,
                    failed => failed,
                };
                if let Err(e) = &result {
                    tracing::warn!(reason = %e, "not ready");
                }
                let pause = if result.is_ok() {
                    every
                } else {
                    every.min(Duration::from_secs(1))
                };
                let changed = readiness.state.send_if_modified(|s| {
                    let was = s.source.clone();
                    s.source = Some(result);
                    s.checked_at = Some(SystemTime::now());
                    was != s.source
                });
                if changed {
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
