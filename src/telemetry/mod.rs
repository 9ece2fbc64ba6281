//! Metrics, logs and traces: a low layer that every other layer records into and that imports
//! none of them.
//!
//! Metrics follow Prometheus naming (prometheus-client); each group of families is defined,
//! labelled and registered in its own file: [`watch`] (the registry's watches), [`subscriptions`]
//! (the services' subscribers), [`grpc`] (the standard gRPC server families and connections),
//! [`access`] (identification, policy, limits), [`api`] (requests to the Kubernetes API
//! server), [`xds`] (the xDS server's streams and responses) and [`process`] (the process and
//! the async runtime). [`Metrics`] holds them all, with a series for every label value [`Known`]
//! at start. [`logs`] writes plain or JSON lines; [`traces`] exports OpenTelemetry spans over
//! OTLP when the standard `OTEL_*` variables say so.
//! [`init`] installs both.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Label values in Prometheus style: lower snake case.
macro_rules! label_values {
    ($ty:ty { $($variant:ident => $text:literal),* $(,)? }) => {
        impl prometheus_client::encoding::EncodeLabelValue for $ty {
            fn encode(
                &self,
                encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>,
            ) -> Result<(), std::fmt::Error> {
                use std::fmt::Write;
                encoder.write_str(match self { $(Self::$variant => $text),* })
            }
        }
    };
}

pub mod access;
pub mod api;
pub mod grpc;
pub mod logs;
pub mod process;
pub mod subscriptions;
pub mod traces;
pub mod watch;
pub mod xds;

pub use access::{
    AccessMetrics, Denial, DenialLabels, IdentifiedBy, IdentifyLabels, IdentifyResult, Limit,
    LimitLabels, ReloadLabels, ReloadResult,
};
pub use api::{
    API_HELD_REASONS, API_VERBS, ApiHeldLabels, ApiRequestLabels, ApiRequests, ApiVerbLabels,
};
pub use grpc::{
    ConnectionLabels, GRPC_CODES, GrpcCodeLabels, GrpcLabels, GrpcMethod, GrpcMetrics, Transport,
};
pub use logs::LogFormat;
pub use process::ProcessMetrics;
pub use subscriptions::{
    FirstMessageLabels, OTHER_SELECTORS, Protocol, SELECTOR_SERIES, StreamEnd, SubscriberLabels,
    SubscriptionMetrics, SyncStream, Watch,
};
pub use traces::{TelemetryGuard, continue_trace, otel_enabled};
pub use watch::{ErrorLabels, ResourceLabels, StopLabels, StopReason, WatchMetrics};
pub use xds::{XdsMetrics, XdsType, XdsTypeLabels};

/// 100 µs to ~100 s: the buckets of the broker's own latency histograms.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.5, 16))
}

/// The label values known at start, each given a series at zero so that dashboards and alerts
/// see data before the first subscriber. The layers that own them hand them in: telemetry
/// imports none of them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Known<'a> {
    /// The kinds served, as `plural.group`.
    pub kinds: &'a [String],
    /// The gRPC methods served: the only methods that become labels.
    pub methods: &'static [GrpcMethod],
    /// The reasons a source reports errors with.
    pub error_reasons: &'a [&'static str],
}

/// Labels of `crd_broker_build_info`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    commit: &'static str,
}

/// Every metric the broker exports.
pub struct Metrics {
    registry: Registry,
    /// The registry's watches.
    pub watch: WatchMetrics,
    /// The services' subscriptions.
    pub subscriptions: SubscriptionMetrics,
    /// The standard gRPC server families, and connections.
    pub grpc: GrpcMetrics,
    /// Identification, policy and limits.
    pub access: AccessMetrics,
    /// Requests to the Kubernetes API server.
    pub api: ApiRequests,
    /// The xDS server's streams and responses.
    pub xds: XdsMetrics,
    /// The process and the async runtime.
    pub process: ProcessMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new(Known::default(), None)
    }
}

impl Metrics {
    /// Every family, registered, with a series (at zero) for each label value `known` at
    /// start, and each limit, denial and reload outcome. `api` counts the source's Kubernetes
    /// requests (none: the source has no API server, and those families stay empty).
    pub fn new(known: Known<'_>, api: Option<ApiRequests>) -> Self {
        let has_api = api.is_some();
        let mut metrics = Metrics {
            registry: Registry::default(),
            watch: WatchMetrics::default(),
            subscriptions: SubscriptionMetrics::default(),
            grpc: GrpcMetrics::new(known.methods),
            access: AccessMetrics::default(),
            api: api.unwrap_or_default(),
            xds: XdsMetrics::default(),
            process: ProcessMetrics::default(),
        };
        let root = &mut metrics.registry;
        metrics.subscriptions.register(root);
        let broker = root.sub_registry_with_prefix("crd_broker");
        metrics.watch.register(broker);
        metrics.access.register(broker);
        metrics.api.register(broker);
        metrics.xds.register(broker);
        let build = Family::<BuildLabels, Gauge>::default();
        build
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
                commit: env!("CRD_BROKER_COMMIT"),
            })
            .set(1);
        broker.register("build_info", "The broker's version and commit", build);
        metrics.grpc.register(root);
        metrics.process.register(root);

        metrics.watch.initialize(known.kinds, known.error_reasons);
        metrics.subscriptions.initialize(known.kinds);
        metrics.grpc.initialize();
        metrics.access.initialize();
        metrics.xds.initialize();
        if has_api {
            metrics.api.initialize();
        }
        metrics
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        self.process.sample();
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "encoding metrics");
        }
        out
    }
}

/// One thing open (a stream), counted in a gauge until it is dropped.
pub struct Open(Gauge);

impl Open {
    /// Counts one that opened now in `gauge`.
    pub fn new(gauge: &Gauge) -> Open {
        gauge.inc();
        Open(gauge.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Shared metrics handle.
pub type SharedMetrics = Arc<Metrics>;

/// Installs the log subscriber and, if the environment asks for it, the OTLP trace exporter.
pub fn init(format: LogFormat, default_level: &str) -> TelemetryGuard {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;

    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let exporting = traces::exporting();
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(logs::layer(format))
        .with(traces::layer(exporting.as_ref()))
        .try_init();
    TelemetryGuard::new(exporting)
}

/// A family whose HELP and TYPE are written even before it has a series. The families labelled
/// by kind have none until a kind is known: with `--resource` at start, without it at the first
/// subscription. Declared, they are on `/metrics` from the start, so that scrapers and
/// `promtool` see every family the broker has.
#[derive(Debug)]
pub(crate) struct Declared<M>(pub M);

impl<M: prometheus_client::encoding::EncodeMetric> prometheus_client::encoding::EncodeMetric
    for Declared<M>
{
    fn encode(
        &self,
        encoder: prometheus_client::encoding::MetricEncoder,
    ) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> prometheus_client::metrics::MetricType {
        self.0.metric_type()
    }

    fn is_empty(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_encode_with_prometheus_names_and_every_family_has_series_from_the_start() {
        let kind = "featureflags.core.openfeature.dev".to_string();
        const METHODS: &[GrpcMethod] = &[
            GrpcMethod::new("/crdbroker.v1.Broker/Subscribe", "server_stream"),
            GrpcMethod::new("/flagd.sync.v1.FlagSyncService/SyncFlags", "server_stream"),
            GrpcMethod::new("/sync.v1.FlagSyncService/FetchAllFlags", "unary"),
        ];
        let known = Known {
            kinds: std::slice::from_ref(&kind),
            methods: METHODS,
            error_reasons: &["unknown_kind", "unavailable"],
        };
        let m = Metrics::new(known, Some(ApiRequests::default()));
        let text = m.encode();
        for series in [
            r#"crd_broker_watches{resource="featureflags.core.openfeature.dev"} 0"#,
            r#"crd_broker_subscribers{resource="featureflags.core.openfeature.dev",protocol="flagd"} 0"#,
            r#"crd_broker_updates_total{resource="featureflags.core.openfeature.dev"} 0"#,
            r#"crd_broker_skipped_states_total{resource="featureflags.core.openfeature.dev"} 0"#,
            r#"crd_broker_fanout_seconds_count{resource="featureflags.core.openfeature.dev"} 0"#,
            r#"crd_broker_watch_errors_total{resource="featureflags.core.openfeature.dev",reason="unavailable"} 0"#,
            r#"crd_broker_denials_total{reason="namespace"} 0"#,
            r#"crd_broker_connections{transport="tcp"} 0"#,
            r#"crd_broker_api_requests_total{verb="watch",code="200"} 0"#,
            r#"crd_broker_source_stale_seconds 0"#,
            r#"sync_active_streams 0"#,
            r#"crd_broker_xds_streams 0"#,
            r#"crd_broker_xds_responses_total{type="endpoints"} 0"#,
            r#"crd_broker_xds_nacks_total{type="listener"} 0"#,
            r#"crd_broker_xds_resumed_total{type="cluster"} 0"#,
            r#"crd_broker_xds_response_bytes_total{type="route"} 0"#,
            r#"grpc_server_started_total{grpc_service="flagd.sync.v1.FlagSyncService",grpc_method="SyncFlags",grpc_type="server_stream"} 0"#,
            r#"grpc_server_handled_total{grpc_service="crdbroker.v1.Broker",grpc_method="Subscribe",grpc_type="server_stream",grpc_code="Unavailable"} 0"#,
            r#"grpc_server_msg_sent_total{grpc_service="crdbroker.v1.Broker",grpc_method="Subscribe",grpc_type="server_stream"} 0"#,
            r#"grpc_server_handling_seconds_bucket{le="0.005",grpc_service="sync.v1.FlagSyncService",grpc_method="FetchAllFlags",grpc_type="unary"} 0"#,
        ] {
            assert!(text.contains(series), "{series} in:\n{text}");
        }
        let build = format!(
            r#"crd_broker_build_info{{version="{}",commit="{}"}} 1"#,
            env!("CARGO_PKG_VERSION"),
            env!("CRD_BROKER_COMMIT")
        );
        assert!(text.contains(&build), "{text}");
        for family in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_max_fds",
            "process_start_time_seconds",
            "process_threads",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(&format!("{family} "))),
                "{family} in:\n{text}"
            );
        }
        assert!(text.ends_with("# EOF\n") && text.matches("# EOF").count() == 1);
    }
}
