//! The admin HTTP server: `/livez`, `/readyz`, `/metrics`, `/debug/watches`, `/debug/callers`
//! and `/debug/subscribers`, and gRPC
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

use crate::access::admin::{self as guard, Ends, Guard};
use crate::ops::health::Readiness;
use crate::registry::subscribers::Subscriber;
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
    subscribers: Box<dyn Fn() -> Vec<Arc<Subscriber>> + Send + Sync>,
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
    let listed = registry.clone();
    let admin = Arc::new(Admin {
        readiness,
        metrics,
        watches: Box::new(move || registry.watches()),
        subscribers: Box::new(move || listed.subscribers().list()),
        callers,
        started,
        heartbeat,
    });
    let debug = Router::new()
        .route("/debug/watches", get(watches))
        .route("/debug/callers", get(list_callers))
        .route("/debug/subscribers", get(list_subscribers))
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
                "version": w.version,
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

/// The most subscribers `/debug/subscribers` lists: the STALE first, then those not sent
/// anything yet, then the SYNCED, each oldest first.
const MAX_SUBSCRIBERS_LISTED: usize = 1000;

/// Whether a subscriber holds what it should, as `istioctl proxy-status` says it of a proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Holding {
    /// Handed a version that is not the current one (or, on xDS, not yet ACKed).
    Stale,
    /// Handed nothing yet (the resource is not answered yet).
    NotSent,
    /// Handed the current version.
    Synced,
}

impl Holding {
    fn label(self) -> &'static str {
        match self {
            Holding::Stale => "STALE",
            Holding::NotSent => "NOT SENT",
            Holding::Synced => "SYNCED",
        }
    }

    /// A part's: what it was handed against what it should hold (none: not known yet).
    fn of(delivered: Option<&str>, current: Option<&str>) -> Holding {
        match (delivered, current) {
            (None, _) => Holding::NotSent,
            (Some(d), Some(c)) if d == c => Holding::Synced,
            (Some(_), Some(_)) => Holding::Stale,
            // The watch knows nothing now (it failed, or ended): what was sent stands.
            (Some(_), None) => Holding::Synced,
        }
    }
}

/// `/debug/subscribers`: each open stream, its caller and protocol, and for each resource or set
/// it follows (each xDS type) the version last handed to it against the current one.
fn subscribers_view(
    subscribers: Vec<Arc<Subscriber>>,
    watches: &[WatchStatus],
) -> serde_json::Value {
    let current: std::collections::HashMap<&str, Option<&str>> = watches
        .iter()
        .map(|w| (w.selector.as_str(), w.version.as_deref()))
        .collect();
    let mut rows: Vec<(Holding, u64, serde_json::Value)> = subscribers
        .iter()
        .map(|s| {
            let xds = s.protocol == "xds";
            let mut worst = Holding::Synced;
            let parts: Vec<serde_json::Value> = s
                .parts
                .iter()
                .filter_map(|p| {
                    let delivered = p.delivered();
                    let kept = p.current();
                    let now = match xds {
                        true => kept.as_deref().map(str::to_string),
                        false => current
                            .get(p.selector.as_str())
                            .copied()
                            .flatten()
                            .map(str::to_string),
                    };
                    // An xDS type the client never asked for is not shown.
                    if xds && delivered.is_none() && now.is_none() {
                        return None;
                    }
                    let handed = delivered.as_ref().map(|(d, _)| d.version());
                    let sync = Holding::of(handed, now.as_deref());
                    worst = worst.min(sync);
                    Some(json!({
                        "selector": p.selector,
                        "delivered": handed,
                        "deliveredAt": delivered.as_ref().map(|(_, at)| rfc3339(*at)),
                        "current": now,
                        "status": sync.label(),
                    }))
                })
                .collect();
            let mut row = json!({
                "id": s.id,
                "caller": s.caller,
                "protocol": s.protocol,
                "opened": rfc3339(s.opened),
                "status": worst.label(),
                "resources": parts,
            });
            if xds {
                row["acks"] = json!(s.acks.load(Ordering::Relaxed));
                row["nacks"] = json!(s.nacks.load(Ordering::Relaxed));
            }
            (worst, s.id, row)
        })
        .collect();
    let count = |wanted: Holding| rows.iter().filter(|(s, _, _)| *s == wanted).count();
    let (stale, not_sent, synced) = (
        count(Holding::Stale),
        count(Holding::NotSent),
        count(Holding::Synced),
    );
    let total = rows.len();
    rows.sort_by_key(|(sync, id, _)| (*sync, *id));
    rows.truncate(MAX_SUBSCRIBERS_LISTED);
    let list: Vec<serde_json::Value> = rows.into_iter().map(|(_, _, row)| row).collect();
    json!({
        "subscribers": list,
        "total": total,
        "synced": synced,
        "stale": stale,
        "notSent": not_sent,
    })
}

async fn list_subscribers(State(admin): State<Arc<Admin>>) -> Response {
    let view = subscribers_view((admin.subscribers)(), &(admin.watches)());
    axum::Json(view).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{Delivered, Subscribers};

    fn watch(selector: &str, version: Option<&str>) -> WatchStatus {
        WatchStatus {
            selector: selector.into(),
            subscribers: 1,
            since: SystemTime::UNIX_EPOCH,
            last_event: None,
            resource_version: version.map(str::to_string),
            members: None,
            version: version.map(str::to_string),
            errors: 0,
            updates: 0,
            stale_since: None,
        }
    }

    #[test]
    fn each_subscriber_is_synced_stale_or_not_sent_the_stale_first_and_xds_by_its_acks() {
        let subscribers = Subscribers::default();
        let synced = subscribers.register("ip:10.0.0.1".into(), "native", vec!["a".into()]);
        synced.delivered(0, Delivered::Set("7".into()));
        let stale =
            subscribers.register("ip:10.0.0.2".into(), "flagd", vec!["a".into(), "b".into()]);
        stale.delivered(0, Delivered::Set("6".into()));
        stale.delivered(1, Delivered::Absent);
        let waiting = subscribers.register("ip:10.0.0.3".into(), "native", vec!["c".into()]);
        let xds = subscribers.register(
            "ip:10.0.0.4".into(),
            "xds",
            vec!["listener".into(), "cluster".into(), "endpoints".into()],
        );
        xds.current(0, "l1".into());
        xds.delivered(0, Delivered::Xds("l1".into()));
        xds.current(2, "e2".into());
        xds.delivered(2, Delivered::Xds("e1".into()));
        xds.nacks.fetch_add(1, Ordering::Relaxed);
        let watches = [
            watch("a", Some("7")),
            watch("b", Some("")),
            watch("c", None),
        ];
        let view = subscribers_view(subscribers.list(), &watches);
        assert_eq!(
            (view["total"].as_u64(), view["stale"].as_u64()),
            (Some(4), Some(2))
        );
        let rows = view["subscribers"].as_array().unwrap();
        let order: Vec<(&str, &str)> = rows
            .iter()
            .map(|r| (r["caller"].as_str().unwrap(), r["status"].as_str().unwrap()))
            .collect();
        assert_eq!(
            order,
            [
                ("ip:10.0.0.2", "STALE"),
                ("ip:10.0.0.4", "STALE"),
                ("ip:10.0.0.3", "NOT SENT"),
                ("ip:10.0.0.1", "SYNCED"),
            ]
        );
        // The stale flagd stream: its first part behind, its second (absent) current.
        let parts = rows[0]["resources"].as_array().unwrap();
        assert_eq!(parts[0]["status"], "STALE");
        assert_eq!(
            (&parts[0]["delivered"], &parts[0]["current"]),
            (&json!("6"), &json!("7"))
        );
        assert_eq!(parts[1]["status"], "SYNCED");
        // xDS: the endpoints sent and not ACKed; the cluster never asked for is not shown.
        let xds_parts = rows[1]["resources"].as_array().unwrap();
        assert_eq!(xds_parts.len(), 2);
        assert_eq!(xds_parts[1]["selector"], "endpoints");
        assert_eq!(xds_parts[1]["status"], "STALE");
        assert_eq!(
            (rows[1]["acks"].as_u64(), rows[1]["nacks"].as_u64()),
            (Some(0), Some(1))
        );
        drop((synced, stale, waiting, xds));
        assert_eq!(subscribers_view(subscribers.list(), &watches)["total"], 0);
    }
}
