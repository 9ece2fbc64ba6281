//! The admin HTTP server: liveness and readiness for probes.

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[derive(Clone)]
struct Admin {
    shutdown: CancellationToken,
}

/// Serves the admin endpoints on `listener` until `shutdown` is cancelled.
pub async fn serve(listener: TcpListener, shutdown: CancellationToken) -> std::io::Result<()> {
    let app = Router::new()
        .route("/livez", get(live))
        .route("/healthz", get(live))
        .route("/readyz", get(ready))
        .with_state(Admin {
            shutdown: shutdown.clone(),
        });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

async fn live() -> &'static str {
    "ok\n"
}

async fn ready(State(admin): State<Admin>) -> (StatusCode, &'static str) {
    if admin.shutdown.is_cancelled() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n")
    } else {
        (StatusCode::OK, "ok\n")
    }
}
