//! Metrics (prometheus-client, Prometheus naming), logs (plain or JSON) and traces
//! (OpenTelemetry over OTLP, configured only by the standard `OTEL_*` variables, off when unset).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::selector::Selector;

/// Labels naming a kind: `featureflags.core.openfeature.dev`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabels {
    /// `plural.group` of the watched kind.
    pub resource: String,
}

impl ResourceLabels {
    /// The labels for a canonical selector.
    pub fn of(selector: &Selector) -> Self {
        ResourceLabels {
            resource: format!("{}.{}", selector.kind.resource, selector.kind.group),
        }
    }
}

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

/// Labels of the subscriber gauge.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SubscriberLabels {
    /// `plural.group` of the kind.
    pub resource: String,
    /// The API.
    pub protocol: Protocol,
}

/// Why a watch stopped.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum StopReason {
    /// Its last subscriber left and the linger ran out.
    Idle,
    /// The broker shut down.
    Shutdown,
}

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

/// Whether a new subscriber found its watch running.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Watch {
    /// The subscriber started the watch.
    Cold,
    /// The watch was already running (or lingering).
    Warm,
}

/// Label values in Prometheus style: lower snake case.
macro_rules! label_values {
    ($ty:ty { $($variant:ident => $text:literal),* $(,)? }) => {
        impl EncodeLabelValue for $ty {
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

label_values!(Protocol { Native => "native", Flagd => "flagd", FlagdLegacy => "flagd_legacy" });
label_values!(StopReason { Idle => "idle", Shutdown => "shutdown" });
label_values!(Watch { Cold => "cold", Warm => "warm" });

/// A limit a request can hit.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Limit {
    /// `--max-watches`: distinct resources watched at once.
    MaxWatches,
    /// `--max-streams-per-caller`.
    StreamsPerCaller,
    /// `--new-watch-rate`: new watches per second per caller.
    NewWatchRate,
    /// `--max-request-bytes`.
    RequestSize,
}

label_values!(Limit {
    MaxWatches => "max_watches",
    StreamsPerCaller => "streams_per_caller",
    NewWatchRate => "new_watch_rate",
    RequestSize => "request_size",
});

/// Which source identified a caller.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum IdentifiedBy {
    /// `peer-pod`.
    PeerPod,
    /// `token`.
    Token,
    /// `mtls`.
    Mtls,
    /// `mesh`.
    Mesh,
    /// A unix-socket connection: a local caller.
    Unix,
    /// None did.
    Nothing,
}

label_values!(IdentifiedBy {
    PeerPod => "peer_pod",
    Token => "token",
    Mtls => "mtls",
    Mesh => "mesh",
    Unix => "unix",
    Nothing => "none",
});

/// How an identification ended.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum IdentifyResult {
    /// A caller was named.
    Identified,
    /// No source named one (UNAUTHENTICATED).
    Unidentified,
    /// A source could not ask the API server (UNAVAILABLE).
    Failed,
}

label_values!(IdentifyResult {
    Identified => "identified",
    Unidentified => "unidentified",
    Failed => "failed",
});

/// Labels of the identification counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IdentifyLabels {
    /// The source that named the caller (`none` when none did).
    pub source: IdentifiedBy,
    /// How it ended.
    pub result: IdentifyResult,
}

/// Why the policy refused a request.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Denial {
    /// No grant for the namespace.
    Namespace,
    /// A grant for the namespace, not for the kind.
    Kind,
    /// A cluster-scoped object, with no grant reading `*`.
    ClusterScoped,
    /// An open stream the reloaded policy no longer allows.
    Revoked,
}

label_values!(Denial {
    Namespace => "namespace",
    Kind => "kind",
    ClusterScoped => "cluster_scoped",
    Revoked => "revoked",
});

/// Labels of the denial counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DenialLabels {
    /// Why.
    pub reason: Denial,
}

/// How a policy reload went.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum ReloadResult {
    /// The new policy is in force.
    Loaded,
    /// It did not parse; the old one stays.
    Refused,
}

label_values!(ReloadResult { Loaded => "loaded", Refused => "refused" });

/// Labels of the policy-reload counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    /// How it went.
    pub result: ReloadResult,
}

/// Labels of the limit counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabels {
    /// Which limit.
    pub limit: Limit,
}

/// Labels of the first-message histogram.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FirstMessageLabels {
    /// The API.
    pub protocol: Protocol,
    /// Cold or warm.
    pub watch: Watch,
}

/// A gRPC method's labels in the standard server families (go-grpc-prometheus's names, which
/// stock dashboards read). Only methods the broker serves are labels; any other path is
/// `other`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcLabels {
    /// The service, e.g. `flagd.sync.v1.FlagSyncService`.
    pub grpc_service: &'static str,
    /// The method, e.g. `SyncFlags`.
    pub grpc_method: &'static str,
    /// `unary`, `server_stream` or `bidi_stream`.
    pub grpc_type: &'static str,
}

/// [`GrpcLabels`] and the status code's name (`OK`, `NotFound`, as grpc-go spells them).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcCodeLabels {
    /// The service.
    pub grpc_service: &'static str,
    /// The method.
    pub grpc_method: &'static str,
    /// The call type.
    pub grpc_type: &'static str,
    /// The status code.
    pub grpc_code: &'static str,
}

/// The status codes by number, named as grpc-go names them.
pub const GRPC_CODES: [&str; 17] = [
    "OK",
    "Canceled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
];

impl GrpcLabels {
    /// These labels with `code` (a status number; an unknown one counts as `Unknown`).
    pub fn with_code(&self, code: i32) -> GrpcCodeLabels {
        let name = usize::try_from(code)
            .ok()
            .and_then(|c| GRPC_CODES.get(c))
            .unwrap_or(&"Unknown");
        GrpcCodeLabels {
            grpc_service: self.grpc_service,
            grpc_method: self.grpc_method,
            grpc_type: self.grpc_type,
            grpc_code: name,
        }
    }
}

/// The standard gRPC server families.
#[derive(Clone)]
pub struct GrpcMetrics {
    /// `grpc_server_started_total`: calls received.
    pub started: Family<GrpcLabels, Counter>,
    /// `grpc_server_handled_total`: calls completed, by status code.
    pub handled: Family<GrpcCodeLabels, Counter>,
    /// `grpc_server_msg_received_total`: request messages.
    pub msg_received: Family<GrpcLabels, Counter>,
    /// `grpc_server_msg_sent_total`: response messages.
    pub msg_sent: Family<GrpcLabels, Counter>,
    /// `grpc_server_handling_seconds`: from the request to the call's end (a stream's life).
    pub handling_seconds: Family<GrpcLabels, Histogram>,
}

/// How a connection reached the broker.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Transport {
    /// Plain TCP (HTTP/2 without TLS).
    Tcp,
    /// TCP with TLS.
    Tls,
    /// A unix domain socket.
    Unix,
}

label_values!(Transport { Tcp => "tcp", Tls => "tls", Unix => "unix" });

/// Labels of the connections gauge.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectionLabels {
    /// How the connections came.
    pub transport: Transport,
}

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

/// The broker's requests to the Kubernetes API server, counted by the client's HTTP stack.
#[derive(Clone)]
pub struct ApiRequests {
    /// Requests by verb and status code.
    pub requests: Family<ApiRequestLabels, Counter>,
    /// Seconds to the response's headers (for a watch: until it is established), by verb.
    pub seconds: Family<ApiVerbLabels, Histogram>,
}

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

impl Default for ApiRequests {
    fn default() -> Self {
        ApiRequests {
            requests: Family::default(),
            seconds: Family::new_with_constructor(latency_histogram),
        }
    }
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
    /// Watches open, by kind.
    pub watches: Family<ResourceLabels, Gauge>,
    /// Subscriptions open, by kind and protocol.
    pub subscribers: Family<SubscriberLabels, Gauge>,
    /// Watches started.
    pub watch_starts: Family<ResourceLabels, Counter>,
    /// Watches stopped, by reason.
    pub watch_stops: Family<StopLabels, Counter>,
    /// Errors the sources reported, by reason.
    pub watch_errors: Family<ErrorLabels, Counter>,
    /// New states published to subscribers.
    pub updates: Family<ResourceLabels, Counter>,
    /// Seconds from a source event to the last subscriber's write of it.
    pub fanout_seconds: Family<ResourceLabels, Histogram>,
    /// Seconds from a subscribe to its first message, per resource.
    pub first_message_seconds: Family<FirstMessageLabels, Histogram>,
    /// The standard gRPC server families.
    pub grpc: GrpcMetrics,
    /// Connections open, by transport.
    pub connections: Family<ConnectionLabels, Gauge>,
    /// States a subscriber never got because a newer one replaced them first (it skipped to
    /// the newest, ADR 0002), by kind: a sign of slow readers.
    pub skipped_states: Family<ResourceLabels, Counter>,
    /// Requests to the Kubernetes API server.
    pub api: ApiRequests,
    /// Requests refused by a limit, by limit.
    pub limit_hits: Family<LimitLabels, Counter>,
    /// Identifications, by source and result.
    pub identifications: Family<IdentifyLabels, Counter>,
    /// Requests the policy refused, by reason.
    pub denials: Family<DenialLabels, Counter>,
    /// Policy reloads, by result.
    pub policy_reloads: Family<ReloadLabels, Counter>,
    /// Seconds since the source last passed its check, while it fails; 0 while it passes.
    pub source_stale_seconds: Gauge<f64, AtomicU64>,
    /// Tasks alive on the async runtime (set at each scrape): a number that grows without
    /// bound is a leak.
    pub runtime_tasks: Gauge,
    /// Flag keys defined by more than one FeatureFlag of a set served to flagd clients (the
    /// first, in name order, is kept).
    pub flag_conflicts: Counter,
    /// flagd sync streams open (`SyncFlags` on both flagd services), under flagd-proxy's name
    /// `sync_active_streams`, for the dashboards and autoscalers that read it.
    pub sync_active_streams: Gauge,
}

/// Counts one open flagd sync stream in [`Metrics::sync_active_streams`] while it lives.
pub struct ActiveSync(Gauge);

impl ActiveSync {
    /// Counts a stream that opened now.
    pub fn new(metrics: &Metrics) -> ActiveSync {
        metrics.sync_active_streams.inc();
        ActiveSync(metrics.sync_active_streams.clone())
    }
}

impl Drop for ActiveSync {
    fn drop(&mut self) {
        self.0.dec();
    }
}

fn latency_histogram() -> Histogram {
    // 100 µs to ~100 s.
    Histogram::new(exponential_buckets(0.0001, 2.5, 16))
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new(&[], None)
    }
}

/// The `grpc_server_handling_seconds` buckets of go-grpc-prometheus.
fn grpc_histogram() -> Histogram {
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

impl Metrics {
    /// Every family, registered, with a series (at zero) for each label value known at start:
    /// every method the broker serves and every status code, each of the `kinds` served
    /// (`plural.group`), each limit, denial and reload outcome, so dashboards and alerts see
    /// data before the first subscriber. `api` counts the source's Kubernetes requests (none:
    /// the source has no API server, and those families stay empty).
    pub fn new(kinds: &[String], api: Option<ApiRequests>) -> Self {
        let has_api = api.is_some();
        let api = api.unwrap_or_default();
        let mut root = Registry::default();
        let m = Metrics {
            watches: Family::default(),
            subscribers: Family::default(),
            watch_starts: Family::default(),
            watch_stops: Family::default(),
            watch_errors: Family::default(),
            updates: Family::default(),
            fanout_seconds: Family::new_with_constructor(latency_histogram),
            first_message_seconds: Family::new_with_constructor(latency_histogram),
            grpc: GrpcMetrics {
                started: Family::default(),
                handled: Family::default(),
                msg_received: Family::default(),
                msg_sent: Family::default(),
                handling_seconds: Family::new_with_constructor(grpc_histogram),
            },
            connections: Family::default(),
            skipped_states: Family::default(),
            api,
            limit_hits: Family::default(),
            identifications: Family::default(),
            denials: Family::default(),
            policy_reloads: Family::default(),
            source_stale_seconds: Gauge::default(),
            runtime_tasks: Gauge::default(),
            flag_conflicts: Counter::default(),
            sync_active_streams: Gauge::default(),
            registry: Registry::default(),
        };
        root.register(
            "sync_active_streams",
            "flagd sync streams open (flagd-proxy's name for it)",
            m.sync_active_streams.clone(),
        );
        let registry = root.sub_registry_with_prefix("crd_broker");
        registry.register(
            "watches",
            "Kubernetes watches open, by kind",
            m.watches.clone(),
        );
        registry.register(
            "subscribers",
            "Subscriptions open, by kind and protocol",
            m.subscribers.clone(),
        );
        registry.register("watch_starts", "Watches started", m.watch_starts.clone());
        registry.register(
            "watch_stops",
            "Watches stopped, by reason",
            m.watch_stops.clone(),
        );
        registry.register(
            "watch_errors",
            "Errors the source reported, by reason",
            m.watch_errors.clone(),
        );
        registry.register(
            "updates",
            "New states published to subscribers",
            m.updates.clone(),
        );
        registry.register(
            "fanout_seconds",
            "Seconds from a source event to the last subscriber's write of it",
            m.fanout_seconds.clone(),
        );
        registry.register(
            "first_message_seconds",
            "Seconds from a subscribe to its first message, per resource",
            m.first_message_seconds.clone(),
        );
        registry.register(
            "flag_conflicts",
            "Flag keys defined by more than one FeatureFlag of a set served to flagd clients; the first in name order is kept",
            m.flag_conflicts.clone(),
        );
        registry.register(
            "limit_hits",
            "Requests refused by a limit (RESOURCE_EXHAUSTED), by limit",
            m.limit_hits.clone(),
        );
        registry.register(
            "identifications",
            "Callers identified (or not), by identity source and result",
            m.identifications.clone(),
        );
        registry.register(
            "denials",
            "Requests the policy refused (PERMISSION_DENIED), by reason",
            m.denials.clone(),
        );
        registry.register(
            "policy_reloads",
            "Policy file reloads, by result",
            m.policy_reloads.clone(),
        );
        registry.register(
            "source_stale_seconds",
            "Seconds since the source (the API server) last answered its check, while it fails; 0 while it answers",
            m.source_stale_seconds.clone(),
        );
        registry.register(
            "runtime_tasks",
            "Tasks alive on the async runtime",
            m.runtime_tasks.clone(),
        );
        registry.register(
            "connections",
            "Client connections open, by transport",
            m.connections.clone(),
        );
        registry.register(
            "skipped_states",
            "States a subscriber never got because a newer one replaced them first, by kind",
            m.skipped_states.clone(),
        );
        registry.register(
            "api_requests",
            "Requests to the Kubernetes API server, by verb and HTTP status",
            m.api.requests.clone(),
        );
        registry.register(
            "api_request_seconds",
            "Seconds to the Kubernetes API server's response headers, by verb",
            m.api.seconds.clone(),
        );
        let build = Family::<BuildLabels, Gauge>::default();
        build
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
                commit: env!("CRD_BROKER_COMMIT"),
            })
            .set(1);
        registry.register("build_info", "The broker's version and commit", build);
        let grpc = root.sub_registry_with_prefix("grpc_server");
        grpc.register(
            "started",
            "gRPC calls started on the server",
            m.grpc.started.clone(),
        );
        grpc.register(
            "handled",
            "gRPC calls completed on the server, by status code",
            m.grpc.handled.clone(),
        );
        grpc.register(
            "msg_received",
            "gRPC request messages received",
            m.grpc.msg_received.clone(),
        );
        grpc.register(
            "msg_sent",
            "gRPC response messages sent",
            m.grpc.msg_sent.clone(),
        );
        grpc.register(
            "handling_seconds",
            "Seconds from a gRPC call's start to its end (a stream's life)",
            m.grpc.handling_seconds.clone(),
        );
        root.register_collector(Box::new(crate::ops::process::Process));
        let m = Metrics {
            registry: root,
            ..m
        };
        m.initialize(kinds, has_api);
        m
    }

    /// The series known at start, at zero.
    fn initialize(&self, kinds: &[String], has_api: bool) {
        for method in crate::transport::METHODS {
            let labels = method.labels();
            let _ = self.grpc.started.get_or_create(&labels);
            let _ = self.grpc.msg_received.get_or_create(&labels);
            let _ = self.grpc.msg_sent.get_or_create(&labels);
            let _ = self.grpc.handling_seconds.get_or_create(&labels);
            for code in 0..GRPC_CODES.len() as i32 {
                let _ = self.grpc.handled.get_or_create(&labels.with_code(code));
            }
        }
        for kind in kinds {
            let resource = ResourceLabels {
                resource: kind.clone(),
            };
            let _ = self.watches.get_or_create(&resource);
            let _ = self.watch_starts.get_or_create(&resource);
            let _ = self.updates.get_or_create(&resource);
            let _ = self.skipped_states.get_or_create(&resource);
            let _ = self.fanout_seconds.get_or_create(&resource);
            for protocol in [Protocol::Native, Protocol::Flagd, Protocol::FlagdLegacy] {
                let _ = self.subscribers.get_or_create(&SubscriberLabels {
                    resource: kind.clone(),
                    protocol,
                });
            }
            for reason in [StopReason::Idle, StopReason::Shutdown] {
                let _ = self.watch_stops.get_or_create(&StopLabels {
                    resource: kind.clone(),
                    reason,
                });
            }
            for reason in crate::source::SourceError::REASONS {
                let _ = self.watch_errors.get_or_create(&ErrorLabels {
                    resource: kind.clone(),
                    reason: reason.to_string(),
                });
            }
        }
        for protocol in [Protocol::Native, Protocol::Flagd, Protocol::FlagdLegacy] {
            for watch in [Watch::Cold, Watch::Warm] {
                let _ = self
                    .first_message_seconds
                    .get_or_create(&FirstMessageLabels { protocol, watch });
            }
        }
        for transport in [Transport::Tcp, Transport::Tls, Transport::Unix] {
            let _ = self
                .connections
                .get_or_create(&ConnectionLabels { transport });
        }
        for limit in [
            Limit::MaxWatches,
            Limit::StreamsPerCaller,
            Limit::NewWatchRate,
            Limit::RequestSize,
        ] {
            let _ = self.limit_hits.get_or_create(&LimitLabels { limit });
        }
        for reason in [
            Denial::Namespace,
            Denial::Kind,
            Denial::ClusterScoped,
            Denial::Revoked,
        ] {
            let _ = self.denials.get_or_create(&DenialLabels { reason });
        }
        for result in [ReloadResult::Loaded, ReloadResult::Refused] {
            let _ = self.policy_reloads.get_or_create(&ReloadLabels { result });
        }
        if !has_api {
            return;
        }
        for verb in ["get", "list", "watch"] {
            let _ = self.api.requests.get_or_create(&ApiRequestLabels {
                verb,
                code: "200".into(),
            });
        }
        for verb in API_VERBS {
            let _ = self.api.seconds.get_or_create(&ApiVerbLabels { verb });
        }
    }
}

impl Metrics {
    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            self.runtime_tasks
                .set(runtime.metrics().num_alive_tasks() as i64);
        }
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "encoding metrics");
        }
        out
    }
}

/// Shared metrics handle.
pub type SharedMetrics = Arc<Metrics>;

/// Log output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (`console`, as flagd-proxy calls it, is the same).
    #[value(alias = "console")]
    Plain,
    /// One JSON object per line.
    Json,
}

/// Keeps the trace exporter alive; flushes it when dropped.
pub struct TelemetryGuard {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Flushes and stops the trace exporter (off the async runtime: the SDK blocks).
    pub async fn shutdown(mut self) {
        if let Some(provider) = self.provider.take() {
            let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        }
    }
}

/// Whether the `OTEL_*` environment asks for traces: an OTLP endpoint is set, the SDK is not
/// disabled and the traces exporter is not `none`.
pub fn otel_enabled(env: impl Fn(&str) -> Option<String>) -> bool {
    let set = |k: &str| env(k).is_some_and(|v| !v.trim().is_empty());
    (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        && env("OTEL_SDK_DISABLED").is_none_or(|v| !v.eq_ignore_ascii_case("true"))
        && env("OTEL_TRACES_EXPORTER").is_none_or(|v| !v.eq_ignore_ascii_case("none"))
}

/// Installs the log subscriber and, if the environment asks for it, the OTLP trace exporter.
pub fn init(format: LogFormat, default_level: &str) -> TelemetryGuard {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;

    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = match format {
        LogFormat::Plain => tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .event_format(crate::logs::FlatJson)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let exporting = if otel_enabled(|k| std::env::var(k).ok()) {
        match tracer_provider() {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("crd-broker: OTLP trace export disabled: {e}");
                None
            }
        }
    } else {
        None
    };
    // Spans get trace ids (for the logs, and to continue a caller's `traceparent`) even when
    // nothing is exported: a provider with no exporter then drops them as they end.
    let tracing_provider = exporting
        .clone()
        .unwrap_or_else(|| opentelemetry_sdk::trace::SdkTracerProvider::builder().build());
    let otel = {
        use opentelemetry::trace::TracerProvider;
        tracing_opentelemetry::layer().with_tracer(tracing_provider.tracer("crd-broker"))
    };
    let provider = exporting;
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init();
    TelemetryGuard { provider }
}

/// The OTLP protocol the standard variables ask for: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`,
/// else `OTEL_EXPORTER_OTLP_PROTOCOL`, else `grpc`.
fn otlp_protocol(var: impl Fn(&str) -> Option<String>) -> anyhow::Result<Otlp> {
    let protocol = var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|| "grpc".into());
    match protocol.trim() {
        "grpc" => Ok(Otlp::Grpc),
        "http/protobuf" => Ok(Otlp::HttpProtobuf),
        other => anyhow::bail!(
            "OTEL_EXPORTER_OTLP_PROTOCOL {other:?} is not supported: use grpc or http/protobuf"
        ),
    }
}

/// The OTLP transports the broker exports over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Otlp {
    Grpc,
    HttpProtobuf,
}

fn tracer_provider() -> anyhow::Result<opentelemetry_sdk::trace::SdkTracerProvider> {
    use opentelemetry_otlp::WithExportConfig;
    let builder = opentelemetry_otlp::SpanExporter::builder();
    let exporter = match otlp_protocol(|k| std::env::var(k).ok())? {
        Otlp::Grpc => builder.with_tonic().build()?,
        Otlp::HttpProtobuf => {
            let exporter = builder
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .build()?;
            return Ok(provider(OnRuntime {
                inner: Arc::new(exporter),
                runtime: tokio::runtime::Handle::try_current()
                    .map_err(|_| anyhow::anyhow!("OTLP over HTTP needs the async runtime"))?,
            }));
        }
    };
    Ok(provider(exporter))
}

/// An exporter whose requests run on the broker's runtime: the HTTP client needs its reactor,
/// and the batch processor calls exporters from a thread of its own.
#[derive(Debug)]
struct OnRuntime<E> {
    inner: Arc<E>,
    runtime: tokio::runtime::Handle,
}

impl<E: opentelemetry_sdk::trace::SpanExporter + 'static> opentelemetry_sdk::trace::SpanExporter
    for OnRuntime<E>
{
    async fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        let inner = self.inner.clone();
        self.runtime
            .spawn(async move { inner.export(batch).await })
            .await
            .unwrap_or_else(|e| {
                Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(
                    e.to_string(),
                ))
            })
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.force_flush()
    }
}

/// The tracer provider over `exporter`, batching, with the service name of
/// `OTEL_SERVICE_NAME` (default `crd-broker`).
fn provider(
    exporter: impl opentelemetry_sdk::trace::SpanExporter + 'static,
) -> opentelemetry_sdk::trace::SdkTracerProvider {
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(
            std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "crd-broker".to_string()),
        )
        .build();
    opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build()
}

/// Makes `span` continue the trace a caller sent as W3C Trace Context (`traceparent`, and
/// `tracestate`), so that a subscription is a child of the caller's span.
pub fn continue_trace(span: &tracing::Span, metadata: &tonic::metadata::MetadataMap) {
    use opentelemetry::propagation::{Extractor, TextMapPropagator};
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    struct Headers<'a>(&'a tonic::metadata::MetadataMap);
    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            ["traceparent", "tracestate"]
                .into_iter()
                .filter(|k| self.0.contains_key(*k))
                .collect()
        }
    }
    if !metadata.contains_key("traceparent") {
        return;
    }
    let context =
        opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&Headers(metadata));
    // A malformed traceparent gives an empty context: the span starts its own trace.
    let _ = span.set_parent(context);
}

/// How often the liveness heartbeat ticks.
pub const HEARTBEAT: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    /// An environment holding `pairs`.
    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn the_otlp_protocol_comes_from_the_standard_variables() {
        assert_eq!(otlp_protocol(env(&[])).unwrap(), Otlp::Grpc);
        let http = env(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")]);
        assert_eq!(otlp_protocol(http).unwrap(), Otlp::HttpProtobuf);
        let traces_win = env(&[
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
        ]);
        assert_eq!(otlp_protocol(traces_win).unwrap(), Otlp::Grpc);
        let json = env(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")]);
        let error = otlp_protocol(json).unwrap_err().to_string();
        assert!(error.contains("\"http/json\" is not supported"), "{error}");
    }

    #[test]
    fn traces_are_on_only_when_the_environment_asks() {
        assert!(!otel_enabled(env(&[])));
        assert!(otel_enabled(env(&[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://c:4317"
        )])));
        assert!(otel_enabled(env(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://c:4317"
        )])));
        assert!(!otel_enabled(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_SDK_DISABLED", "true")
        ])));
        assert!(!otel_enabled(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_TRACES_EXPORTER", "none")
        ])));
    }

    #[test]
    fn metrics_encode_with_prometheus_names_and_every_family_has_series_from_the_start() {
        let kind = "featureflags.core.openfeature.dev".to_string();
        let m = Metrics::new(std::slice::from_ref(&kind), Some(ApiRequests::default()));
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
