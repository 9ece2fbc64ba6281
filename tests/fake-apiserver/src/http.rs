//! The request path of the fake, in the order the real handler chain runs it: parse the path
//! and derive the verb, log, apply injected faults, authorize, negotiate the representation,
//! then call the store.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::error::{ApiError, Result};
use crate::faults::{Action, Attributes, RequestRecord};
use crate::params::Params;
use crate::render::{self, Format};
use crate::selector::{FieldSelector, LabelSelector};
use crate::store::{
    Deleted, ListOpts, Opened, Patch, Scope, WatchInfo, WatchOpts, WriteOpts, Written,
};
use crate::tls::{self, Tls};
use crate::watch_body::{self, WatchBody};
use crate::{Shared, admin, discovery, reviews};

/// The largest request body the real server takes (3 MiB).
const MAX_BODY: usize = 3 * 1024 * 1024;

/// The router: one fallback handler that parses paths itself.
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new().fallback(handle).with_state(shared)
}

/// Accepts connections until aborted: HTTP/1.1 in the clear, or TLS with ALPN choosing HTTP/2
/// or HTTP/1.1. Aborting drops the listener and, with the join set, every connection.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<Tls>,
    traffic: Arc<Traffic>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                // As Go's net/http (the real API server) does for every TCP connection.
                let _ = stream.set_nodelay(true);
                let stream = Counted { inner: stream, traffic: traffic.clone() };
                let service = TowerToHyperService::new(router.clone());
                let tls = tls.clone();
                let open = Open::new(&traffic);
                connections.spawn(async move {
                    let _open = open;
                    let Some(tls) = tls else {
                        return serve_http1(TokioIo::new(stream), service).await;
                    };
                    let Ok(stream) = tls.acceptor.accept(stream).await else {
                        return;
                    };
                    if stream.get_ref().1.alpn_protocol() == Some(b"h2") {
                        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .timer(TokioTimer::new())
                            .max_concurrent_streams(tls::MAX_STREAMS)
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    } else {
                        serve_http1(TokioIo::new(stream), service).await;
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn serve_http1<I>(io: I, service: TowerToHyperService<Router>)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let _ = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .serve_connection(io, service)
        .await;
}

/// What clients' connections carried: bytes written to them, and how many are open.
#[derive(Debug, Default)]
pub(crate) struct Traffic {
    pub(crate) sent: AtomicU64,
    pub(crate) connections: AtomicUsize,
}

/// One open connection, counted in [`Traffic::connections`] until dropped.
struct Open(Arc<Traffic>);

impl Open {
    fn new(traffic: &Arc<Traffic>) -> Open {
        traffic.connections.fetch_add(1, Ordering::Relaxed);
        Open(traffic.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection that counts the bytes written to it.
struct Counted {
    inner: tokio::net::TcpStream,
    traffic: Arc<Traffic>,
}

impl tokio::io::AsyncRead for Counted {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Counted {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let written = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        if let std::task::Poll::Ready(Ok(n)) = &written {
            self.traffic.sent.fetch_add(*n as u64, Ordering::Relaxed);
        }
        written
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A path under `/apis/{group}/{version}/…` that names a resource.
#[derive(Debug, Clone, PartialEq)]
struct ResourcePath {
    group: String,
    version: String,
    namespace: Option<String>,
    plural: String,
    name: Option<String>,
    sub: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
enum Route {
    Discovery(discovery::Doc),
    Resource(ResourcePath),
    NotFound,
}

impl Route {
    fn parse(path: &str) -> Route {
        let segments: Vec<&str> = path
            .trim_start_matches('/')
            .split('/')
            .filter(|s| !s.is_empty())
            .collect();
        if let Some(doc) = discovery::Doc::parse(&segments) {
            return Route::Discovery(doc);
        }
        let (group, version, rest) = match segments.as_slice() {
            ["apis", g, v, rest @ ..] if !rest.is_empty() => (*g, *v, rest),
            ["api", v, rest @ ..] if !rest.is_empty() => ("", *v, rest),
            _ => return Route::NotFound,
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
            _ => (None, rest),
        };
        let (plural, name, sub) = match rest {
            [p] => (p, None, None),
            [p, n] => (p, Some(n.to_string()), None),
            [p, n, s] => (p, Some(n.to_string()), Some(s.to_string())),
            _ => return Route::NotFound,
        };
        Route::Resource(ResourcePath {
            group: group.to_string(),
            version: version.to_string(),
            namespace,
            plural: plural.to_string(),
            name,
            sub,
        })
    }

    fn verb(&self, method: &Method, params: &Params) -> String {
        let Route::Resource(rp) = self else {
            return "discovery".into();
        };
        let item = rp.name.is_some();
        let verb = match (method.as_str(), item) {
            ("GET" | "HEAD", false) if params.flag("watch") == Some(true) => "watch",
            ("GET" | "HEAD", false) => "list",
            ("GET" | "HEAD", true) => "get",
            ("POST", false) => "create",
            ("PUT", true) => "update",
            ("PATCH", true) => "patch",
            ("DELETE", true) => "delete",
            ("DELETE", false) => "deletecollection",
            (other, _) => return other.to_lowercase(),
        };
        verb.to_string()
    }
}

async fn handle(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let path = parts.uri.path().to_string();
    if path == "/fake" || path.starts_with("/fake/") {
        return admin::handle(&shared, &parts, body).await;
    }
    let query = parts.uri.query().unwrap_or("").to_string();
    let params = Params::parse(&query);
    let route = Route::parse(&path);
    let verb = route.verb(&parts.method, &params);
    let header = |h: header::HeaderName| {
        parts
            .headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    shared.faults().record(RequestRecord {
        method: parts.method.to_string(),
        path: path.clone(),
        query,
        params: params.0.clone(),
        verb: verb.clone(),
        accept: header(header::ACCEPT),
        content_type: header(header::CONTENT_TYPE),
        version: format!("{:?}", parts.version),
    });
    let injected = shared.faults().take(&verb, &path);
    match injected {
        Some(Action::Status { code, retry_after }) => {
            return injected_status(code, retry_after).into_response();
        }
        Some(Action::Hang) => {
            let mut released = shared.hangs_released.subscribe();
            // Until the faults are cleared (or the server stops): then a server-side timeout.
            let _ = released.changed().await;
            return injected_status(504, None).into_response();
        }
        None => {}
    }
    let outcome = match route {
        Route::Discovery(doc) => discovery::answer(&shared, &doc, &parts),
        Route::Resource(rp) => resource(&shared, &parts, body, rp, &verb, &params).await,
        Route::NotFound => Err(ApiError::PathNotFound),
    };
    outcome.unwrap_or_else(IntoResponse::into_response)
}

/// The Status a knob-injected failure answers with, worded as the real server's.
fn injected_status(code: u16, retry_after: Option<u64>) -> ApiError {
    let (reason, message) = match code {
        400 => ("BadRequest", "injected bad request"),
        401 => ("Unauthorized", "Unauthorized"),
        403 => ("Forbidden", "forbidden: injected"),
        404 => (
            "NotFound",
            "the server could not find the requested resource",
        ),
        409 => ("Conflict", "injected conflict"),
        410 => ("Expired", "too old resource version: injected"),
        429 => (
            "TooManyRequests",
            "Too many requests, please try again later.",
        ),
        500 => ("InternalError", "Internal error occurred: injected"),
        503 => (
            "ServiceUnavailable",
            "The server is currently unable to handle the request",
        ),
        504 => ("Timeout", "The server was unable to respond in time"),
        _ => ("", "injected error"),
    };
    match ApiError::status(code, reason, message) {
        ApiError::Status {
            code,
            reason,
            message,
            details,
            ..
        } => ApiError::Status {
            code,
            reason,
            message,
            details,
            retry_after,
        },
        other => other,
    }
}

async fn resource(
    shared: &Arc<Shared>,
    parts: &Parts,
    body: Body,
    rp: ResourcePath,
    verb: &str,
    params: &Params,
) -> Result<Response> {
    let kind = shared
        .state()
        .find_kind(&rp.group, &rp.version, &rp.plural)
        .ok_or(ApiError::PathNotFound)?;
    // A namespaced kind's objects are named within a namespace; a cluster kind has none.
    let path_misfits_scope = matches!(
        (kind.namespaced, &rp.namespace, &rp.name),
        (true, None, Some(_)) | (false, Some(_), _)
    );
    if path_misfits_scope {
        return Err(ApiError::PathNotFound);
    }
    let status_only = match rp.sub.as_deref() {
        None => false,
        Some("status")
            if kind
                .version(&rp.version)
                .is_some_and(|v| v.status_subresource) =>
        {
            true
        }
        Some(_) => return Err(ApiError::PathNotFound),
    };
    let allowed: &[&str] = if status_only {
        &["get", "update", "patch"]
    } else {
        kind.verbs
    };
    if !allowed.contains(&verb) {
        return Err(ApiError::status(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        ));
    }
    let fields = FieldSelector::parse(
        params.get("fieldSelector").unwrap_or(""),
        kind.selectable_fields,
    )?;
    let labels = LabelSelector::parse(params.get("labelSelector").unwrap_or(""))?;
    let user = reviews::user_of(shared, &parts.headers);
    let attrs = Attributes {
        verb: verb.to_string(),
        group: kind.group.clone(),
        resource: match &rp.sub {
            Some(sub) => format!("{}/{sub}", kind.plural),
            None => kind.plural.clone(),
        },
        namespace: rp.namespace.clone(),
        name: rp
            .name
            .clone()
            .or_else(|| fields.exact_name().map(str::to_string)),
        user: user.clone(),
    };
    if shared.faults().denied(&attrs) {
        let target = crate::error::Target {
            group: &kind.group,
            plural: &kind.plural,
        };
        return Err(ApiError::forbidden(
            target,
            &user,
            verb,
            attrs.namespace.as_deref(),
            attrs.name.as_deref(),
        ));
    }
    if !kind.stored {
        let body = read_json(parts, body).await?;
        return reviews::answer(shared, &kind, body, &parts.headers);
    }
    let scope = Scope {
        kind,
        version: rp.version.clone(),
        namespace: rp.namespace.clone(),
    };
    let format = Format::negotiate(
        parts
            .headers
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok()),
        params.get("includeObject"),
    )?;
    let write_opts = WriteOpts {
        dry_run: params.get("dryRun") == Some("All"),
        field_validation: params.get("fieldValidation").map(str::to_string),
        patch: false,
    };
    let name = rp.name.as_deref().unwrap_or("");
    match verb {
        "get" => {
            let obj = shared.state().get(&scope, name)?;
            Ok(json_response(
                StatusCode::OK,
                &render::object(&scope.kind, &scope.version, &obj, &format),
            ))
        }
        "list" => {
            let opts = ListOpts {
                fields,
                labels,
                limit: params.get("limit").and_then(|l| l.parse().ok()),
                continue_token: params
                    .get("continue")
                    .filter(|c| !c.is_empty())
                    .map(str::to_string),
                rv: params.get("resourceVersion").map(str::to_string),
                rv_match: params
                    .get("resourceVersionMatch")
                    .filter(|m| !m.is_empty())
                    .map(str::to_string),
                send_initial_events: params.flag("sendInitialEvents"),
            };
            wait_for_rv(shared, opts.rv.as_deref()).await?;
            let list = shared.state().list(&scope, &opts, &format)?;
            Ok(json_response(StatusCode::OK, &list))
        }
        "watch" => {
            let opts = WatchOpts {
                fields,
                labels,
                rv: params.get("resourceVersion").map(str::to_string),
                rv_match: params
                    .get("resourceVersionMatch")
                    .filter(|m| !m.is_empty())
                    .map(str::to_string),
                bookmarks: params.flag("allowWatchBookmarks") == Some(true),
                send_initial_events: params.flag("sendInitialEvents"),
                timeout: params
                    .get("timeoutSeconds")
                    .and_then(|t| t.parse().ok())
                    .map(Duration::from_secs),
            };
            watch(shared, parts, &scope, &opts, format, params)
        }
        "create" => {
            let obj = read_json(parts, body).await?;
            let written = shared.state().create(&scope, obj, &write_opts)?;
            Ok(written_response(&scope, written, &format))
        }
        "update" => {
            let obj = read_json(parts, body).await?;
            let written = shared
                .state()
                .update(&scope, name, obj, &write_opts, status_only)?;
            Ok(written_response(&scope, written, &format))
        }
        "patch" => {
            let patch = read_patch(parts, body, &scope, params).await?;
            let write_opts = WriteOpts {
                patch: true,
                ..write_opts
            };
            let written = shared
                .state()
                .patch(&scope, name, patch, &write_opts, status_only)?;
            Ok(written_response(&scope, written, &format))
        }
        "delete" => {
            let options = read_optional_json(parts, body).await?;
            let dry_run = write_opts.dry_run
                || options["dryRun"]
                    .as_array()
                    .is_some_and(|d| d.iter().any(|v| v == "All"));
            let deleted =
                shared
                    .state()
                    .delete(&scope, name, &options["preconditions"], dry_run)?;
            let body = match deleted {
                // Custom resources answer an immediate delete with a Status, not the object.
                Deleted::Gone(obj) if !scope.kind.is_builtin() => json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                    "details": { "name": name, "group": scope.kind.group, "kind": scope.kind.plural,
                                 "uid": obj["metadata"]["uid"] },
                }),
                other => render::object(&scope.kind, &scope.version, other.object(), &format),
            };
            Ok(json_response(StatusCode::OK, &body))
        }
        "deletecollection" => {
            let opts = ListOpts {
                fields,
                labels,
                ..ListOpts::default()
            };
            let list = shared.state().delete_collection(&scope, &opts)?;
            Ok(json_response(StatusCode::OK, &list))
        }
        _ => Err(ApiError::status(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )),
    }
}

/// A list or get at a resourceVersion the store has not reached waits for it for up to three
/// seconds, then fails with 504, as the real watch cache does.
async fn wait_for_rv(shared: &Shared, rv: Option<&str>) -> Result<()> {
    let (wanted, mut rx) = {
        let state = shared.state();
        let Some(wanted) = state.too_large(rv) else {
            return Ok(());
        };
        (wanted, state.rv_tx.subscribe())
    };
    let reached =
        tokio::time::timeout(Duration::from_secs(3), rx.wait_for(|rv| *rv >= wanted)).await;
    if matches!(reached, Ok(Ok(_))) {
        return Ok(());
    }
    let current = shared.state().rv;
    Err(ApiError::Status {
        code: 504,
        reason: "Timeout",
        message: format!("Too large resource version: {wanted}, current: {current}"),
        details: Some(
            serde_json::json!({ "causes": [{ "reason": "ResourceVersionTooLarge", "message": "Too large resource version" }] }),
        ),
        retry_after: Some(1),
    })
}

fn watch(
    shared: &Arc<Shared>,
    parts: &Parts,
    scope: &Scope,
    opts: &WatchOpts,
    format: Format,
    params: &Params,
) -> Result<Response> {
    let info = WatchInfo {
        path: parts.uri.path().to_string(),
        field_selector: params.get("fieldSelector").unwrap_or("").to_string(),
        label_selector: params.get("labelSelector").unwrap_or("").to_string(),
        resource_version: params.get("resourceVersion").unwrap_or("").to_string(),
        since: SystemTime::now(),
    };
    let watch_list_enabled = !shared.faults().watch_list_disabled;
    let deadline = tokio::time::Instant::now() + opts.timeout.unwrap_or(Duration::from_secs(1800));
    let control = shared.control.subscribe();
    let stall = shared.stall.subscribe();
    let Opened { initial, live } =
        shared
            .state()
            .watch(scope, opts, format, info, watch_list_enabled)?;
    let (rx, guard) = match live {
        Some((id, rx)) => (rx, Some(watch_body::guard(shared, id))),
        None => (mpsc::channel(1).1, None),
    };
    let body = WatchBody {
        initial,
        rx,
        control,
        stall,
        deadline,
        _guard: guard,
        done: false,
    };
    let mut response = Response::new(Body::from_stream(body.into_stream()));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(response)
}

fn json_response(status: StatusCode, value: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response()
}

fn written_response(scope: &Scope, written: Written, format: &Format) -> Response {
    let status = if written.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let body = render::object(&scope.kind, &scope.version, &written.object, format);
    let mut response = json_response(status, &body);
    for warning in written.warnings {
        let text = format!("299 - \"{}\"", warning.replace('"', "\\\""));
        if let Ok(value) = HeaderValue::from_str(&text) {
            response.headers_mut().append(header::WARNING, value);
        }
    }
    response
}

fn content_type(parts: &Parts) -> String {
    parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_string()
}

async fn read_bytes(body: Body) -> Result<bytes::Bytes> {
    axum::body::to_bytes(body, MAX_BODY).await.map_err(|_| {
        ApiError::status(
            413,
            "RequestEntityTooLarge",
            "Request entity too large: limit is 3145728",
        )
    })
}

fn decode(content_type: &str, bytes: &[u8]) -> Result<Value> {
    let parsed = if content_type.contains("yaml") {
        serde_saphyr::from_slice_with_options::<Value>(bytes, crate::yaml_options())
            .map_err(|e| e.to_string())
    } else {
        serde_json::from_slice::<Value>(bytes).map_err(|e| e.to_string())
    };
    parsed.map_err(|e| {
        ApiError::bad_request(format!(
            "the object provided is unrecognized or could not be decoded: {e}"
        ))
    })
}

async fn read_json(parts: &Parts, body: Body) -> Result<Value> {
    let bytes = read_bytes(body).await?;
    decode(&content_type(parts), &bytes)
}

async fn read_optional_json(parts: &Parts, body: Body) -> Result<Value> {
    let bytes = read_bytes(body).await?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    decode(&content_type(parts), &bytes)
}

async fn read_patch(parts: &Parts, body: Body, scope: &Scope, params: &Params) -> Result<Patch> {
    let content_type = content_type(parts);
    let bytes = read_bytes(body).await?;
    // Built-in kinds take strategic merge patches; custom resources do not.
    let is_builtin = scope.kind.is_crd() || scope.kind.is_namespace();
    match content_type.as_str() {
        "application/merge-patch+json" => Ok(Patch::Merge(decode(&content_type, &bytes)?)),
        "application/json-patch+json" => Ok(Patch::Json(decode(&content_type, &bytes)?)),
        // The lists of the built-in kinds served here have no merge keys, so a merge patch
        // (without the `$` directives) gives the same result as a strategic one.
        "application/strategic-merge-patch+json" if is_builtin => {
            let mut patch = decode(&content_type, &bytes)?;
            strip_directives(&mut patch);
            Ok(Patch::Merge(patch))
        }
        "application/apply-patch+yaml" => {
            if params.get("fieldManager").is_none_or(str::is_empty) {
                return Err(ApiError::invalid(
                    "PatchOptions.meta.k8s.io",
                    "",
                    &[(
                        "fieldManager".into(),
                        "Required value: is required for apply patch".into(),
                    )],
                ));
            }
            Ok(Patch::Apply(decode("yaml", &bytes)?))
        }
        _ => Err(ApiError::unsupported_media_type()),
    }
}

fn strip_directives(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.retain(|k, _| !k.starts_with('$'));
            map.values_mut().for_each(strip_directives);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_directives),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_parse_into_resources() {
        let r = Route::parse("/apis/g.io/v1/namespaces/ns/foos/a/status");
        assert_eq!(
            r,
            Route::Resource(ResourcePath {
                group: "g.io".into(),
                version: "v1".into(),
                namespace: Some("ns".into()),
                plural: "foos".into(),
                name: Some("a".into()),
                sub: Some("status".into()),
            })
        );
        assert!(matches!(
            Route::parse("/apis/g.io/v1/foos"),
            Route::Resource(ResourcePath {
                namespace: None,
                name: None,
                ..
            })
        ));
        assert_eq!(Route::parse("/apis/g.io/v1/a/b/c/d"), Route::NotFound);
        assert_eq!(Route::parse("/healthz/x"), Route::NotFound);
    }

    #[test]
    fn verbs_follow_method_and_watch() {
        let r = Route::parse("/apis/g/v1/foos");
        let watch = Params::parse("&watch=true&timeoutSeconds=290");
        assert_eq!(r.verb(&Method::GET, &watch), "watch");
        assert_eq!(r.verb(&Method::GET, &Params::parse("&watch=1")), "watch");
        assert_eq!(r.verb(&Method::GET, &Params::parse("watch=True")), "watch");
        assert_eq!(r.verb(&Method::GET, &Params::parse("watch=false")), "list");
        assert_eq!(r.verb(&Method::GET, &Params::parse("limit=500")), "list");
        assert_eq!(
            r.verb(&Method::DELETE, &Params::default()),
            "deletecollection"
        );
        assert_eq!(
            Route::parse("/apis/g/v1/foos/a").verb(&Method::PATCH, &Params::default()),
            "patch"
        );
        assert_eq!(
            Route::parse("/version").verb(&Method::GET, &Params::default()),
            "discovery"
        );
    }

    #[test]
    fn query_skips_kube_rs_empty_pairs() {
        let p = Params::parse("&fieldSelector=metadata.name%3Da&limit=500");
        assert_eq!(p.get("fieldSelector"), Some("metadata.name=a"));
        assert_eq!(p.0.len(), 2);
    }
}
