//! The knobs and introspection over HTTP, under `/fake/`, for users of the binary (the load
//! harness, people with curl). Requests here are neither logged nor subject to faults.
//!
//! | method and path | effect |
//! |---|---|
//! | `GET /fake/watches` | `{"open": N, "watches": [{path, fieldSelector, labelSelector, resourceVersion, since}]}` |
//! | `GET /fake/requests` | the request log; `DELETE` empties it and the counters |
//! | `GET /fake/counts` | `[{verb, path, count}]`, requests per verb and path |
//! | `GET /fake/state` | `{"resourceVersion": N, "floor": N}` |
//! | `POST /fake/watches/abort` | drop every watch connection mid-body |
//! | `POST /fake/watches/close` | end every watch cleanly |
//! | `POST /fake/watches/error?code=410` | one ERROR event (410 Expired by default) on each watch, then end |
//! | `POST /fake/watches/stall?on=true` | hold (`on=false`: release) all watch output |
//! | `POST /fake/watches/bookmarks` | send a BOOKMARK now |
//! | `POST /fake/compact` | drop all history (resuming earlier gets 410) |
//! | `POST /fake/history?limit=N` | keep at most N events |
//! | `POST /fake/inject` | body `{"verb"?, "path"?, "times", "action": "status", "code", "retryAfter"?}` or `"action": "hang"` |
//! | `POST /fake/deny` | body `{"verb"?, "group"?, "resource"?, "namespace"?, "name"?, "user"?}`: 403 for matches |
//! | `DELETE /fake/faults` | remove every injection and denial |
//! | `POST /fake/tokens` | body `{"token", "username", "uid"?, "groups"?, "audiences"?}` for TokenReview |
//! | `POST /fake/restart?downMs=N` | stop listening (every connection closes) and come back on the same port after N ms |
//! | `POST /fake/watchlist?enabled=false` | turn `sendInitialEvents` support off (or on) |

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::request::Parts;
use axum::http::{Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::Shared;
use crate::faults::{Deny, Injection, TokenUser};
use crate::params::Params;

/// Answers a `/fake/…` request.
pub(crate) async fn handle(shared: &Arc<Shared>, parts: &Parts, body: Body) -> Response {
    let params = Params::parse(parts.uri.query().unwrap_or(""));
    let path = parts
        .uri
        .path()
        .trim_start_matches("/fake")
        .trim_matches('/');
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let result = match (&parts.method, path) {
        (&Method::GET, "watches") => {
            let watches: Vec<Value> = shared
                .state()
                .watch_infos()
                .iter()
                .map(|w| {
                    json!({
                        "path": w.path,
                        "fieldSelector": w.field_selector,
                        "labelSelector": w.label_selector,
                        "resourceVersion": w.resource_version,
                        "since": humantime::format_rfc3339_seconds(w.since).to_string(),
                    })
                })
                .collect();
            Ok(json!({ "open": watches.len(), "watches": watches }))
        }
        (&Method::GET, "requests") => Ok(json!(shared.faults().log)),
        (&Method::DELETE, "requests") => {
            let mut f = shared.faults();
            f.log.clear();
            f.counts.clear();
            Ok(json!({}))
        }
        (&Method::GET, "counts") => {
            let f = shared.faults();
            let mut counts: Vec<Value> = f
                .counts
                .iter()
                .map(|((verb, path), n)| json!({ "verb": verb, "path": path, "count": n }))
                .collect();
            counts.sort_by_key(|c| c.to_string());
            Ok(json!(counts))
        }
        (&Method::GET, "state") => {
            let s = shared.state();
            Ok(json!({ "resourceVersion": s.rv, "floor": s.floor }))
        }
        (&Method::POST, "watches/abort") => {
            shared.control(crate::watch_body::Control::Abort);
            Ok(json!({}))
        }
        (&Method::POST, "watches/close") => {
            shared.control(crate::watch_body::Control::Close);
            Ok(json!({}))
        }
        (&Method::POST, "watches/error") => {
            let code = params
                .get("code")
                .and_then(|c| c.parse().ok())
                .unwrap_or(410);
            shared.error_watches(code);
            Ok(json!({}))
        }
        (&Method::POST, "watches/stall") => {
            shared.stall.send_replace(params.get("on") != Some("false"));
            Ok(json!({}))
        }
        (&Method::POST, "watches/bookmarks") => {
            shared.state().send_bookmarks(true);
            Ok(json!({}))
        }
        (&Method::POST, "compact") => {
            shared.state().compact();
            Ok(json!({}))
        }
        (&Method::POST, "history") => match params.get("limit").and_then(|l| l.parse().ok()) {
            Some(limit) => {
                shared.state().set_history_limit(limit);
                Ok(json!({}))
            }
            None => Err("history needs ?limit=N".to_string()),
        },
        (&Method::POST, "inject") => parse::<Injection>(&bytes).map(|inj| {
            shared.faults().injections.push(inj);
            json!({})
        }),
        (&Method::POST, "deny") => parse::<Deny>(&bytes).map(|deny| {
            shared.faults().denials.push(deny);
            json!({})
        }),
        (&Method::DELETE, "faults") => {
            shared.clear_faults();
            Ok(json!({}))
        }
        (&Method::POST, "tokens") => parse::<TokenUser>(&bytes).map(|user| {
            shared.faults().tokens.insert(user.token.clone(), user);
            json!({})
        }),
        (&Method::POST, "restart") => {
            let down = Duration::from_millis(
                params
                    .get("downMs")
                    .and_then(|d| d.parse().ok())
                    .unwrap_or(500),
            );
            let shared = shared.clone();
            // Answer first: this very connection closes when the listener goes down.
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                if let Err(e) = shared.restart(down).await {
                    tracing::error!(error = %e, "fake-apiserver could not listen again");
                }
            });
            Ok(json!({ "downMs": down.as_millis() as u64 }))
        }
        (&Method::POST, "watchlist") => {
            shared.faults().watch_list_disabled = params.get("enabled") == Some("false");
            Ok(json!({}))
        }
        _ => {
            return (
                StatusCode::NOT_FOUND,
                format!("no fake-apiserver knob at {} /fake/{path}\n", parts.method),
            )
                .into_response();
        }
    };
    match result {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response(),
        Err(message) => (StatusCode::BAD_REQUEST, message + "\n").into_response(),
    }
}

fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    serde_json::from_slice(bytes).map_err(|e| format!("bad knob body: {e}"))
}
