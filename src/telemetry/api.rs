//! The broker's requests to the Kubernetes API server, by verb and status code, the time to
//! their response headers, and the time they were held back: counted by the client's HTTP
//! stack, which the source builds around these families.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use super::latency_histogram;

/// Labels of the Kubernetes API request counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiRequestLabels {
    /// `get`, `list`, `watch`, `create`, `discovery`, `version` or `other`.
    pub verb: &'static str,
    /// The HTTP status (`200`, `403`, …), or `error` when no answer came.
    pub code: String,
}

/// Labels of the Kubernetes API latency histogram.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiVerbLabels {
    /// As [`ApiRequestLabels::verb`].
    pub verb: &'static str,
}

/// Labels of the time requests were held back.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiHeldLabels {
    /// `rate` (the broker's own `--api-qps`/`--api-burst`), `retry_after` (the API server's
    /// `Retry-After`, with a 429 or 503) or `concurrency` (fewer requests at once after a 429).
    pub reason: &'static str,
}

/// The reasons [`ApiHeldLabels`] takes.
pub const API_HELD_REASONS: [&str; 3] = ["rate", "retry_after", "concurrency"];

/// The verbs [`ApiRequestLabels`] takes.
pub const API_VERBS: [&str; 7] = [
    "get",
    "list",
    "watch",
    "create",
    "discovery",
    "version",
    "other",
];

/// The broker's requests to the Kubernetes API server, counted by the client's HTTP stack.
#[derive(Clone)]
pub struct ApiRequests {
    /// Requests by verb and status code.
    pub requests: Family<ApiRequestLabels, Counter>,
    /// Seconds to the response's headers (for a watch: until it is established), by verb.
    pub seconds: Family<ApiVerbLabels, Histogram>,
    /// Seconds requests were held back before they went, by reason.
    pub held: Family<ApiHeldLabels, Counter<f64, AtomicU64>>,
    /// Watches and LIST pages the API server answered 410 Gone (their resourceVersion or
    /// continue token compacted away), as a response or as an ERROR event in the stream; each
    /// one is followed by a fresh LIST.
    pub expired: Counter,
}

impl Default for ApiRequests {
    fn default() -> Self {
        ApiRequests {
            requests: Family::default(),
            seconds: Family::new_with_constructor(latency_histogram),
            held: Family::default(),
            expired: Counter::default(),
        }
    }
}

impl ApiRequests {
    /// Registers the families under `crd_broker_`.
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "api_requests",
            "Requests to the Kubernetes API server, by verb and HTTP status",
            self.requests.clone(),
        );
        registry.register(
            "api_request_seconds",
            "Seconds to the Kubernetes API server's response headers, by verb",
            self.seconds.clone(),
        );
        registry.register(
            "api_held_seconds",
            "Seconds the broker's requests to the Kubernetes API server were held back before \
             they went, by reason: rate (--api-qps), retry_after (the API server's Retry-After) or \
             concurrency (fewer at once after a 429)",
            self.held.clone(),
        );
        registry.register(
            "api_expired",
            "Watches and LIST pages the Kubernetes API server answered 410 Gone (compacted \
             away), as a response or in the watch stream; each is followed by a fresh LIST",
            self.expired.clone(),
        );
    }

    /// The series a working source has from its first minutes, at zero: answered gets, lists
    /// and watches, and every verb's latency.
    pub(super) fn initialize(&self) {
        for verb in ["get", "list", "watch"] {
            let _ = self.requests.get_or_create(&ApiRequestLabels {
                verb,
                code: "200".into(),
            });
        }
        for verb in API_VERBS {
            let _ = self.seconds.get_or_create(&ApiVerbLabels { verb });
        }
        for reason in API_HELD_REASONS {
            let _ = self.held.get_or_create(&ApiHeldLabels { reason });
        }
    }
}
