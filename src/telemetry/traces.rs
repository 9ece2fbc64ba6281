//! Traces: OpenTelemetry over OTLP (gRPC or http/protobuf), configured only by the standard
//! `OTEL_*` variables and off when they are unset; and a caller's W3C trace context continued.

use std::sync::Arc;
use std::time::Duration;

/// Keeps the trace exporter alive; flushes it when dropped.
pub struct TelemetryGuard {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Keeps `provider` (if any) until shut down.
    pub(super) fn new(provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>) -> Self {
        TelemetryGuard { provider }
    }

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

/// The layer that gives spans trace ids, exporting them when `provider` exports; with no
/// provider, spans still get ids (for the logs, and to continue a caller's `traceparent`) and
/// are dropped as they end.
pub(super) fn layer<S>(
    provider: Option<&opentelemetry_sdk::trace::SdkTracerProvider>,
) -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use opentelemetry::trace::TracerProvider;
    let provider = provider
        .cloned()
        .unwrap_or_else(|| opentelemetry_sdk::trace::SdkTracerProvider::builder().build());
    tracing_opentelemetry::layer().with_tracer(provider.tracer("crd-broker"))
}

/// The exporting tracer provider, if the environment asks for traces and the exporter can be
/// built (if not, the reason is printed and traces stay off).
pub(super) fn exporting() -> Option<opentelemetry_sdk::trace::SdkTracerProvider> {
    if !otel_enabled(|k| std::env::var(k).ok()) {
        return None;
    }
    tracer_provider()
        .inspect_err(|e| eprintln!("crd-broker: OTLP trace export disabled: {e}"))
        .ok()
}

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
}
