//! The admin HTTP server: `/livez`, `/readyz`, `/metrics` and `/debug/watches`, and gRPC
//! health (`grpc.health.v1.Health`) over HTTP/2 without TLS, as flagd-proxy serves it on its
//! management port. `/debug/*` and (if asked) `/metrics` are behind the [`Guard`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;
use tokio::net::TcpListener;

use crate::ops::guard::{self, Ends, Guard};
use crate::ops::health::Readiness;
use crate::registry::{Registry, WatchStatus};
use crate::source::Source;
use crate::telemetry::Metrics;

/// How often the liveness heartbeat ticks.
const HEARTBEAT: Duration = Duration::from_secs(1);

/// How stale the runtime heartbeat may be before `/livez` fails.
const STALE: Duration = Duration::from_secs(10);

struct Admin {
    readiness: Arc<Readiness>,
    metrics: Arc<Metrics>,
    watches: Box<dyn Fn() -> Vec<WatchStatus> + Send + Sync>,
    callers: Box<dyn Fn() -> Vec<(String, usize)> + Send + Sync>,
    started: Instant,
    heartbeat: Arc<AtomicU64>,
}

/// Serves the admin endpoints on `listener` until the process ends (so probes see a draining
/// broker as not ready).
pub fn spawn<S: Source>(
    listener: TcpListener,
    readiness: Arc<Readiness>,
    registry: Registry<S>,
    metrics: Arc<Metrics>,
    callers: Box<dyn Fn() -> Vec<(String, usize)> + Send + Sync>,
    grpc: Router,
    guard: Arc<Guard>,
) {
    let started = Instant::now();
    let heartbeat = Arc::new(AtomicU64::new(0));
    let beat = heartbeat.clone();
    // A task that must keep running for the process to count as alive: it proves that timers
    // fire and the runtime is not starved.
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(HEARTBEAT);
        loop {
            tick.tick().await;
            beat.store(started.elapsed().as_millis() as u64, Ordering::Relaxed);
        }
    });
    let admin = Arc::new(Admin {
        readiness,
        metrics,
        watches: Box::new(move || registry.watches()),
        callers,
        started,
        heartbeat,
    });
    let debug = Router::new()
        .route("/debug/watches", get(watches))
        .route("/debug/callers", get(list_callers))
        .route_layer(from_fn_with_state(guard.clone(), guard::debug));
    let metrics = Router::new()
        .route("/metrics", get(metrics_text))
        .route_layer(from_fn_with_state(guard, guard::metrics));
    let app = Router::new()
        .route("/livez", get(live))
        .route("/healthz", get(live))
        .route("/readyz", get(ready))
        .merge(debug)
        .merge(metrics)
        .with_state(admin)
        .merge(grpc);
    let app = app.into_make_service_with_connect_info::<Ends>();
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "the admin server stopped");
        }
    });
}

async fn live(State(admin): State<Arc<Admin>>) -> (StatusCode, String) {
    let beat = Duration::from_millis(admin.heartbeat.load(Ordering::Relaxed));
    let since = admin.started.elapsed().saturating_sub(beat);
    if since > STALE {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the runtime heartbeat is {since:?} old\n"),
        );
    }
    (StatusCode::OK, "ok\n".to_string())
}

async fn ready(State(admin): State<Arc<Admin>>) -> (StatusCode, String) {
    let state = admin.readiness.current();
    let status = if state.ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, format!("{}\n", state.reason()))
}

async fn metrics_text(State(admin): State<Arc<Admin>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        admin.metrics.encode(),
    )
        .into_response()
}

/// The most callers `/debug/callers` lists (those with the most streams).
const MAX_CALLERS_LISTED: usize = 1000;

async fn list_callers(State(admin): State<Arc<Admin>>) -> Response {
    let mut all = (admin.callers)();
    all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let total = all.len();
    all.truncate(MAX_CALLERS_LISTED);
    let list: Vec<_> = all
        .into_iter()
        .map(|(caller, streams)| json!({ "caller": caller, "streams": streams }))
        .collect();
    axum::Json(json!({ "callers": list, "total": total })).into_response()
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

async fn watches(State(admin): State<Arc<Admin>>) -> Response {
    let now = SystemTime::now();
    let list: Vec<_> = (admin.watches)()
        .into_iter()
        .map(|w| {
            json!({
                "selector": w.selector,
                "subscribers": w.subscribers,
                "since": rfc3339(w.since),
                "ageSeconds": now.duration_since(w.since).unwrap_or_default().as_secs(),
                "lastEvent": w.last_event.map(rfc3339),
                "resourceVersion": w.resource_version,
                "members": w.members,
                "errors": w.errors,
                "updates": w.updates,
                "staleSince": w.stale_since.map(rfc3339),
                "staleSeconds": w
                    .stale_since
                    .map(|t| now.duration_since(t).unwrap_or_default().as_secs())
                    .unwrap_or(0),
            })
        })
        .collect();
    axum::Json(json!({ "watches": list })).into_response()
}
