//! The registry's families: watches open, started and stopped, the errors their sources report,
//! the states they publish (and those a slow subscriber skipped), and how stale the source is.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Labels naming a kind: `featureflags.core.openfeature.dev`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabels {
    /// `plural.group` of the watched kind.
    pub resource: String,
}

impl ResourceLabels {
    /// The labels for a kind named `<plural>.<group>` (`KindRef::unversioned`).
    pub fn of(resource: String) -> Self {
        ResourceLabels { resource }
    }
}

/// Why a watch stopped.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum StopReason {
    /// Its last subscriber left and the linger ran out.
    Idle,
    /// The broker shut down.
    Shutdown,
}

label_values!(StopReason { Idle => "idle", Shutdown => "shutdown" });

/// Labels of the watch-stop counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StopLabels {
    /// `plural.group` of the kind.
    pub resource: String,
    /// Why.
    pub reason: StopReason,
}

/// Labels of the watch-error counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// `plural.group` of the kind.
    pub resource: String,
    /// `unknown_kind`, `forbidden`, `unavailable`, …
    pub reason: String,
}

/// The registry's families.
#[derive(Default)]
pub struct WatchMetrics {
    /// Watches open, by kind.
    pub open: Family<ResourceLabels, Gauge>,
    /// Watches started.
    pub starts: Family<ResourceLabels, Counter>,
    /// Watches stopped, by reason.
    pub stops: Family<StopLabels, Counter>,
    /// Errors the sources reported, by reason.
    pub errors: Family<ErrorLabels, Counter>,
    /// New states published to subscribers.
    pub updates: Family<ResourceLabels, Counter>,
    /// States a subscriber never got because a newer one replaced them first (it skipped to
    /// the newest, ADR 0002), by kind: a sign of slow readers.
    pub skipped_states: Family<ResourceLabels, Counter>,
    /// Seconds since the source last passed its check, while it fails; 0 while it passes.
    pub source_stale_seconds: Gauge<f64, AtomicU64>,
}

impl WatchMetrics {
    /// Registers the families under `crd_broker_`.
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "watches",
            "Kubernetes watches open, by kind",
            super::Declared(self.open.clone()),
        );
        registry.register(
            "watch_starts",
            "Watches started",
            super::Declared(self.starts.clone()),
        );
        registry.register(
            "watch_stops",
            "Watches stopped, by reason",
            super::Declared(self.stops.clone()),
        );
        registry.register(
            "watch_errors",
            "Errors the source reported, by reason",
            super::Declared(self.errors.clone()),
        );
        registry.register(
            "updates",
            "New states published to subscribers",
            super::Declared(self.updates.clone()),
        );
        registry.register(
            "skipped_states",
            "States a subscriber never got because a newer one replaced them first, by kind",
            super::Declared(self.skipped_states.clone()),
        );
        registry.register(
            "source_stale_seconds",
            "Seconds since the source (the API server) last answered its check, while it fails; 0 while it answers",
            self.source_stale_seconds.clone(),
        );
    }

    /// The series of each kind served (`plural.group`) and each error reason, at zero.
    pub(super) fn initialize(&self, kinds: &[String], error_reasons: &[&str]) {
        for kind in kinds {
            let resource = ResourceLabels {
                resource: kind.clone(),
            };
            let _ = self.open.get_or_create(&resource);
            let _ = self.starts.get_or_create(&resource);
            let _ = self.updates.get_or_create(&resource);
            let _ = self.skipped_states.get_or_create(&resource);
            for reason in [StopReason::Idle, StopReason::Shutdown] {
                let _ = self.stops.get_or_create(&StopLabels {
                    resource: kind.clone(),
                    reason,
                });
            }
            for reason in error_reasons {
                let _ = self.errors.get_or_create(&ErrorLabels {
                    resource: kind.clone(),
                    reason: reason.to_string(),
                });
            }
        }
    }
}
