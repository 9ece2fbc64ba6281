//! Logs on stderr: human-readable lines, or JSON with flat fields — one object per line holding
//! the time, level, target and message, every field of the event and of the spans it happened
//! in (the innermost wins), and the OpenTelemetry trace and span ids, so a log line and its
//! trace find each other.

use std::fmt;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// Log output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (`console`, as flagd-proxy calls it, is the same).
    #[value(alias = "console")]
    Plain,
    /// One JSON object per line.
    Json,
}

/// The layer that writes log lines in `format` to stderr (with colours on a terminal).
pub(super) fn layer<S>(format: LogFormat) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    use tracing_subscriber::Layer;
    match format {
        LogFormat::Plain => tracing_subscriber::fmt::layer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .fmt_fields(JsonFields::new())
            .event_format(FlatJson)
            .with_writer(std::io::stderr)
            .boxed(),
    }
}

/// The JSON event format.
pub struct FlatJson;

/// Fields into a JSON object; `message` is the event's message.
struct Fields<'a>(&'a mut Map<String, Value>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0.insert(field.name().into(), value.to_string().into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().into(), format!("{value:?}").into());
    }
}

impl<S> FormatEvent<S, JsonFields> for FlatJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, JsonFields>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut line = Map::new();
        line.insert(
            "timestamp".into(),
            humantime::format_rfc3339_micros(std::time::SystemTime::now())
                .to_string()
                .into(),
        );
        line.insert("level".into(), meta.level().as_str().into());
        line.insert("target".into(), meta.target().into());
        // The trace first: looking it up may build the span's OpenTelemetry data, which must
        // not happen while its extensions are borrowed below.
        if let Some(current) = ctx.lookup_current() {
            use opentelemetry::trace::TraceContextExt;
            let context = tracing::dispatcher::get_default(|dispatch| {
                tracing_opentelemetry::get_otel_context(&current.id(), dispatch)
            });
            if let Some(context) = context {
                let span = context.span();
                let ids = span.span_context();
                if ids.is_valid() {
                    line.insert("trace_id".into(), ids.trace_id().to_string().into());
                    line.insert("span_id".into(), ids.span_id().to_string().into());
                }
            }
        }
        if let Some(scope) = ctx.event_scope() {
            let mut innermost = None;
            for span in scope.from_root() {
                innermost = Some(span.name());
                let extensions = span.extensions();
                let Some(fields) = extensions.get::<FormattedFields<JsonFields>>() else {
                    continue;
                };
                if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(fields) {
                    line.extend(fields);
                }
            }
            if let Some(name) = innermost {
                line.insert("span".into(), name.into());
            }
        }
        event.record(&mut Fields(&mut line));
        writeln!(writer, "{}", Value::Object(line))
    }
}
