//! The services' families: subscriptions open by kind and protocol, the time to a
//! subscription's first message and to the last subscriber's write of a change, flagd's open
//! sync streams under flagd-proxy's own name, and flag keys defined twice in a set.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::{latency_histogram, watch::ResourceLabels};

/// Which API a subscriber speaks.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Protocol {
    /// `crdbroker.v1.Broker`.
    Native,
    /// `flagd.sync.v1.FlagSyncService`.
    Flagd,
    /// `sync.v1.FlagSyncService`.
    FlagdLegacy,
}

label_values!(Protocol { Native => "native", Flagd => "flagd", FlagdLegacy => "flagd_legacy" });

const PROTOCOLS: [Protocol; 3] = [Protocol::Native, Protocol::Flagd, Protocol::FlagdLegacy];

/// Labels of the subscriber gauge.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SubscriberLabels {
    /// `plural.group` of the kind.
    pub resource: String,
    /// The API.
    pub protocol: Protocol,
}

/// Whether a new subscriber found its watch running.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Watch {
    /// The subscriber started the watch.
    Cold,
    /// The watch was already running (or lingering).
    Warm,
}

label_values!(Watch { Cold => "cold", Warm => "warm" });

/// Labels of the first-message histogram.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FirstMessageLabels {
    /// The API.
    pub protocol: Protocol,
    /// Cold or warm.
    pub watch: Watch,
}

/// The services' families.
pub struct SubscriptionMetrics {
    /// Subscriptions open, by kind and protocol.
    pub open: Family<SubscriberLabels, Gauge>,
    /// Seconds from a subscribe to its first message, per resource.
    pub first_message_seconds: Family<FirstMessageLabels, Histogram>,
    /// Seconds from a source event to the last subscriber's write of it.
    pub fanout_seconds: Family<ResourceLabels, Histogram>,
    /// Flag keys defined by more than one FeatureFlag of a set served to flagd clients (the
    /// first, in name order, is kept).
    pub flag_conflicts: Counter,
    /// flagd sync streams open (`SyncFlags` on both flagd services), under flagd-proxy's name
    /// `sync_active_streams`, for the dashboards and autoscalers that read it.
    pub sync_active_streams: Gauge,
}

impl Default for SubscriptionMetrics {
    fn default() -> Self {
        SubscriptionMetrics {
            open: Family::default(),
            first_message_seconds: Family::new_with_constructor(latency_histogram),
            fanout_seconds: Family::new_with_constructor(latency_histogram),
            flag_conflicts: Counter::default(),
            sync_active_streams: Gauge::default(),
        }
    }
}

impl SubscriptionMetrics {
    /// Registers `sync_active_streams` at the root, the rest under `crd_broker_`.
    pub(super) fn register(&self, root: &mut Registry) {
        root.register(
            "sync_active_streams",
            "flagd sync streams open (flagd-proxy's name for it)",
            self.sync_active_streams.clone(),
        );
        let registry = root.sub_registry_with_prefix("crd_broker");
        registry.register(
            "subscribers",
            "Subscriptions open, by kind and protocol",
            super::Declared(self.open.clone()),
        );
        registry.register(
            "fanout_seconds",
            "Seconds from a source event to the last subscriber's write of it",
            super::Declared(self.fanout_seconds.clone()),
        );
        registry.register(
            "first_message_seconds",
            "Seconds from a subscribe to its first message, per resource",
            self.first_message_seconds.clone(),
        );
        registry.register(
            "flag_conflicts",
            "Flag keys defined by more than one FeatureFlag of a set served to flagd clients; the first in name order of a namespace is kept, and a key two namespaces define is served from neither",
            self.flag_conflicts.clone(),
        );
    }

    /// The series of each kind served and each protocol, at zero.
    pub(super) fn initialize(&self, kinds: &[String]) {
        for kind in kinds {
            let _ = self.fanout_seconds.get_or_create(&ResourceLabels {
                resource: kind.clone(),
            });
            for protocol in PROTOCOLS {
                let _ = self.open.get_or_create(&SubscriberLabels {
                    resource: kind.clone(),
                    protocol,
                });
            }
        }
        for protocol in PROTOCOLS {
            for watch in [Watch::Cold, Watch::Warm] {
                let _ = self
                    .first_message_seconds
                    .get_or_create(&FirstMessageLabels { protocol, watch });
            }
        }
    }
}
