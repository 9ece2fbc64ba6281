//! The services' families: subscriptions open by kind and protocol, the time to a
//! subscription's first message and to the last subscriber's write of a change, flagd's sync
//! streams (open under flagd-proxy's own name, and by selector; how long each lived and why it
//! ended), and flag keys defined twice in a set.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::{Open, latency_histogram, watch::ResourceLabels};
use crate::sync::lock;

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
    /// flagd sync streams by selector, and how they ended.
    pub sync_streams: SyncStreams,
}

impl Default for SubscriptionMetrics {
    fn default() -> Self {
        SubscriptionMetrics {
            open: Family::default(),
            first_message_seconds: Family::new_with_constructor(latency_histogram),
            fanout_seconds: Family::new_with_constructor(latency_histogram),
            flag_conflicts: Counter::default(),
            sync_active_streams: Gauge::default(),
            sync_streams: SyncStreams::default(),
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
        self.sync_streams.register(registry);
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
        for reason in STREAM_ENDS {
            let _ = self
                .sync_streams
                .seconds
                .get_or_create(&StreamEndLabels { reason });
        }
    }
}

/// Why a flagd sync stream ended, in flagd's own words where it has them.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum StreamEnd {
    /// The client closed it or went away.
    ClientDisconnect,
    /// The deadline the client gave (`grpc-timeout`) passed.
    DeadlineExceeded,
    /// The broker drained its connection: shutdown, or `--max-connection-age`.
    Drain,
    /// The broker ended it with an error status: rights revoked, the kind gone, a
    /// configuration too large.
    Error,
}

label_values!(StreamEnd {
    ClientDisconnect => "client_disconnect",
    DeadlineExceeded => "deadline_exceeded",
    Drain => "drain",
    Error => "error",
});

const STREAM_ENDS: [StreamEnd; 4] = [
    StreamEnd::ClientDisconnect,
    StreamEnd::DeadlineExceeded,
    StreamEnd::Drain,
    StreamEnd::Error,
];

/// Labels of the open sync streams by selector.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SelectorLabels {
    /// The selector as the broker reads it, or [`OTHER_SELECTORS`].
    pub selector: String,
}

/// Labels of the sync streams ended.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SelectorEndLabels {
    /// The selector as the broker reads it, or [`OTHER_SELECTORS`].
    pub selector: String,
    /// Why it ended.
    pub reason: StreamEnd,
}

/// Labels of the sync streams' lifetimes.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StreamEndLabels {
    /// Why it ended.
    pub reason: StreamEnd,
}

/// The distinct selectors that become label values; streams of later ones are counted under
/// [`OTHER_SELECTORS`]. Only admitted streams are counted, but a caller admitted to a namespace
/// may still name any number of FeatureFlags that do not exist in it.
pub const SELECTOR_SERIES: usize = 1000;

/// The selector label of the streams beyond [`SELECTOR_SERIES`].
pub const OTHER_SELECTORS: &str = "other";

/// flagd's buckets for a sync stream's life, and three shorter ones for reconnect loops.
const STREAM_SECONDS: [f64; 13] = [
    1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 480.0, 600.0, 1200.0, 1800.0, 3600.0, 10800.0,
];

/// A stream ended this close before its deadline was cut for it, not by its client.
const DEADLINE_SLACK: Duration = Duration::from_millis(500);

/// flagd sync streams: open by selector, ended by selector and reason, and their lifetimes by
/// reason, in flagd's buckets (30 s to 3 h) with three shorter ones for reconnect loops.
pub struct SyncStreams {
    open: Family<SelectorLabels, Gauge>,
    ended: Family<SelectorEndLabels, Counter>,
    seconds: Family<StreamEndLabels, Histogram>,
    named: Mutex<HashSet<String>>,
}

impl Default for SyncStreams {
    fn default() -> Self {
        SyncStreams {
            open: Family::default(),
            ended: Family::default(),
            seconds: Family::new_with_constructor(|| Histogram::new(STREAM_SECONDS)),
            named: Mutex::new(HashSet::new()),
        }
    }
}

impl SyncStreams {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "flagd_sync_streams",
            "flagd sync streams open, by selector",
            super::Declared(self.open.clone()),
        );
        registry.register(
            "flagd_sync_streams_ended",
            "flagd sync streams ended, by selector and reason",
            super::Declared(self.ended.clone()),
        );
        registry.register(
            "flagd_sync_stream_seconds",
            "How long flagd sync streams lived, by the reason they ended",
            self.seconds.clone(),
        );
    }

    /// The label value for `selector`: itself among the first [`SELECTOR_SERIES`], then
    /// [`OTHER_SELECTORS`].
    fn label(&self, selector: &str) -> String {
        let mut named = lock(&self.named);
        if named.contains(selector) || named.len() < SELECTOR_SERIES {
            named.insert(selector.to_string());
            selector.to_string()
        } else {
            OTHER_SELECTORS.to_string()
        }
    }
}

/// One flagd sync stream, counted while it lives. [`SyncStream::ending`] says why it ends;
/// dropped without one, it was its client's doing: its deadline's if that had come.
pub struct SyncStream {
    metrics: std::sync::Arc<super::Metrics>,
    selector: String,
    opened: Instant,
    deadline: Option<Instant>,
    ending: Option<StreamEnd>,
    _active: Open,
}

impl SyncStream {
    /// A stream for `selector` opened now, whose client gave it until `deadline`.
    pub fn open(
        metrics: std::sync::Arc<super::Metrics>,
        selector: &str,
        deadline: Option<Instant>,
    ) -> SyncStream {
        let streams = &metrics.subscriptions.sync_streams;
        let selector = streams.label(selector);
        streams
            .open
            .get_or_create(&SelectorLabels {
                selector: selector.clone(),
            })
            .inc();
        let active = Open::new(&metrics.subscriptions.sync_active_streams);
        SyncStream {
            metrics,
            selector,
            opened: Instant::now(),
            deadline,
            ending: None,
            _active: active,
        }
    }

    /// The stream ends, for `reason` (the first reason given stands).
    pub fn ending(&mut self, reason: StreamEnd) {
        self.ending.get_or_insert(reason);
    }
}

impl Drop for SyncStream {
    fn drop(&mut self) {
        let now = Instant::now();
        let reason = self.ending.unwrap_or(match self.deadline {
            Some(deadline) if now + DEADLINE_SLACK >= deadline => StreamEnd::DeadlineExceeded,
            _ => StreamEnd::ClientDisconnect,
        });
        let streams = &self.metrics.subscriptions.sync_streams;
        let selector = std::mem::take(&mut self.selector);
        streams
            .open
            .get_or_create(&SelectorLabels {
                selector: selector.clone(),
            })
            .dec();
        streams
            .ended
            .get_or_create(&SelectorEndLabels { selector, reason })
            .inc();
        streams
            .seconds
            .get_or_create(&StreamEndLabels { reason })
            .observe(now.duration_since(self.opened).as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_beyond_the_series_bound_are_counted_as_other() {
        let metrics = std::sync::Arc::new(super::super::Metrics::default());
        let streams: Vec<SyncStream> = (0..SELECTOR_SERIES + 5)
            .map(|i| SyncStream::open(metrics.clone(), &format!("flags/ns/f{i}"), None))
            .collect();
        let text = metrics.encode();
        let open =
            |selector: &str| format!("crd_broker_flagd_sync_streams{{selector=\"{selector}\"}}");
        assert!(text.contains(&format!("{} 1", open("flags/ns/f0"))));
        assert!(
            text.contains(&format!("{} 5", open(OTHER_SELECTORS))),
            "five beyond the bound"
        );
        assert!(!text.contains(&open(&format!("flags/ns/f{SELECTOR_SERIES}"))));
        // A selector already named keeps its series.
        let again = SyncStream::open(metrics.clone(), "flags/ns/f0", None);
        assert!(
            metrics
                .encode()
                .contains(&format!("{} 2", open("flags/ns/f0")))
        );
        drop((streams, again));
        let text = metrics.encode();
        assert!(text.contains(&format!("{} 0", open(OTHER_SELECTORS))));
        assert!(text.contains(
            "crd_broker_flagd_sync_streams_ended_total{selector=\"other\",reason=\"client_disconnect\"} 5"
        ));
    }

    #[test]
    fn a_stream_dropped_at_its_deadline_ended_by_the_deadline() {
        let metrics = std::sync::Arc::new(super::super::Metrics::default());
        let at = Instant::now() + Duration::from_millis(100);
        drop(SyncStream::open(metrics.clone(), "a", Some(at)));
        drop(SyncStream::open(
            metrics.clone(),
            "b",
            Some(at + Duration::from_secs(60)),
        ));
        let mut ended = SyncStream::open(metrics.clone(), "c", Some(at));
        ended.ending(StreamEnd::Drain);
        ended.ending(StreamEnd::Error);
        drop(ended);
        let text = metrics.encode();
        for line in [
            r#"crd_broker_flagd_sync_streams_ended_total{selector="a",reason="deadline_exceeded"} 1"#,
            r#"crd_broker_flagd_sync_streams_ended_total{selector="b",reason="client_disconnect"} 1"#,
            r#"crd_broker_flagd_sync_streams_ended_total{selector="c",reason="drain"} 1"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line}");
        }
    }
}
