//! A fake Kubernetes API server for custom resources, faithful enough that kube-rs, kubectl and
//! the python `kubernetes` client cannot tell it from the real one for the verbs they use.
//!
//! # Layout
//!
//! - [`store`] is the etcd and watch cache in one: objects, one global resourceVersion, a bounded
//!   history with a moving floor, and the open watchers, all behind one mutex that is never held
//!   across an `.await`. Every write feeds the watchers under that lock, so a watch opened at a
//!   resourceVersion sees each later event exactly once.
//! - [`http`] turns requests into store calls the way the real handler chain does: path parsing,
//!   verb derivation, fault injection, authorization, content negotiation.
//! - [`discovery`] answers `/version`, `/api`, `/apis…` and `/openapi/…` from the served kinds.
//! - [`faults`] holds the knobs, the token table and the request log; [`admin`] exposes them over
//!   HTTP under `/fake/` for the binary's users.
//! - [`FakeApiServer`] owns the listener (which can go down and come back on the same port), the
//!   bookmark ticker, and the Rust API tests drive.

#![warn(clippy::unwrap_used)]

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub mod admin;
pub mod crd;
pub mod discovery;
pub mod error;
pub mod faults;
pub mod http;
pub mod openapi;
pub mod params;
pub mod render;
pub mod reviews;
pub mod schema;
pub mod selector;
pub mod store;
pub mod tls;
mod watch_body;

pub use error::ApiError;
pub use faults::{Action, Attributes, Deny, Grant, Injection, Matcher, RequestRecord, TokenUser};
pub use store::WatchInfo;

use crd::Kind;
use store::{Scope, State};
use watch_body::Control;

/// How to start the fake.
#[derive(Debug, Clone)]
pub struct Options {
    /// Where to listen; `127.0.0.1:0` picks a free port.
    pub listen: std::net::SocketAddr,
    /// CustomResourceDefinition objects to install before serving.
    pub crds: Vec<Value>,
    /// How often bookmarks go to watchers that allow them (the real server: about a minute).
    pub bookmark_every: Duration,
    /// How many events the history keeps before its floor moves.
    pub history_limit: usize,
    /// Per-watcher buffer, in events; a watcher that falls this far behind is closed, as the
    /// real server closes unresponsive watchers.
    pub watch_buffer: usize,
    /// The first resourceVersion.
    pub first_rv: u64,
    /// Serve TLS (HTTP/2 and HTTP/1.1 by ALPN) with a CA of its own, as the real server does.
    pub tls: bool,
    /// With `tls`: offer `h2` in ALPN (else HTTP/1.1 only, as a proxy in front might).
    pub http2: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            crds: Vec::new(),
            bookmark_every: Duration::from_secs(60),
            history_limit: 10_000,
            watch_buffer: 10_000,
            first_rv: 100,
            tls: false,
            http2: true,
        }
    }
}

/// The YAML parser settings: YAML 1.2 scalars (only `true` and `false` are booleans).
pub fn yaml_options() -> serde_saphyr::Options {
    let mut options = serde_saphyr::Options::default();
    options.strict_booleans = true;
    options.with_snippet = false;
    options
}

/// One YAML document.
fn parse_yaml(text: &str) -> anyhow::Result<Value> {
    Ok(serde_saphyr::from_str_with_options(text, yaml_options())?)
}

impl Options {
    /// Adds a CRD given as YAML (one document).
    pub fn crd_yaml(mut self, yaml: &str) -> anyhow::Result<Self> {
        self.crds.push(parse_yaml(yaml)?);
        Ok(self)
    }

    /// Sets the bookmark interval.
    pub fn bookmark_every(mut self, every: Duration) -> Self {
        self.bookmark_every = every;
        self
    }
}

/// The state every request handler shares.
pub(crate) struct Shared {
    state: Mutex<State>,
    faults: Mutex<faults::Faults>,
    control: watch::Sender<Control>,
    stall: watch::Sender<bool>,
    /// Bumped when faults are cleared: requests hung by an injection then answer 504.
    hangs_released: watch::Sender<u64>,
    listener: Mutex<ListenerState>,
    tls: Option<tls::Tls>,
    /// Bytes written to clients and connections open.
    traffic: Arc<http::Traffic>,
}

struct ListenerState {
    addr: std::net::SocketAddr,
    accept: Option<JoinHandle<()>>,
}

impl Shared {
    pub(crate) fn clear_faults(&self) {
        {
            let mut f = self.faults();
            f.injections.clear();
            f.denials.clear();
        }
        self.hangs_released.send_modify(|n| *n += 1);
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn faults(&self) -> MutexGuard<'_, faults::Faults> {
        self.faults.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn listener(&self) -> MutexGuard<'_, ListenerState> {
        self.listener.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts accepting on the recorded address (again).
    async fn listen(self: &Arc<Self>) -> std::io::Result<()> {
        let addr = self.listener().addr;
        let listener = TcpListener::bind(addr).await?;
        let bound = listener.local_addr()?;
        let task = tokio::spawn(http::serve(
            listener,
            http::router(self.clone()),
            self.tls.clone(),
            self.traffic.clone(),
        ));
        let mut l = self.listener();
        l.addr = bound;
        if let Some(old) = l.accept.replace(task) {
            old.abort();
        }
        Ok(())
    }

    /// Closes the listening socket and every open connection.
    fn unlisten(&self) {
        if let Some(task) = self.listener().accept.take() {
            task.abort();
        }
    }

    /// Sends a command to every open watch.
    pub(crate) fn control(&self, command: Control) {
        self.control.send_replace(command);
    }

    /// One `ERROR` event with this code on every watch, then the end of it.
    pub(crate) fn error_watches(&self, code: u16) {
        let floor = self.state().floor;
        let error = match code {
            410 => ApiError::expired(format!("too old resource version: 1 ({floor})")),
            500 => ApiError::status(500, "InternalError", "Internal error occurred: injected"),
            code => ApiError::status(code, "", format!("injected error {code}")),
        };
        self.control(Control::Error(store::error_line(&error)));
    }

    /// Stops listening for `down`, then listens again on the same port.
    pub(crate) async fn restart(self: &Arc<Self>, down: Duration) -> std::io::Result<()> {
        self.unlisten();
        tokio::time::sleep(down).await;
        self.listen().await
    }
}

/// A running fake API server. Dropping it stops it and closes every connection.
pub struct FakeApiServer {
    shared: Arc<Shared>,
    ticker: JoinHandle<()>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.ticker.abort();
        self.shared.unlisten();
    }
}

impl FakeApiServer {
    /// Starts a fake with no kinds on `127.0.0.1:0`.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(Options::default()).await
    }

    /// Starts a fake as `options` say.
    pub async fn start_with(options: Options) -> anyhow::Result<Self> {
        let mut state = State::new(
            options.first_rv,
            options.history_limit,
            options.watch_buffer,
            options.bookmark_every,
        );
        state.add_kind(Kind::crd_kind());
        state.add_kind(Kind::namespace_kind());
        state.add_kind(Kind::pod_kind());
        for (group, plural, kind, namespaced) in reviews::KINDS {
            state.add_kind(Kind::review_kind(group, plural, kind, *namespaced));
        }
        let (control, _) = watch::channel(Control::Run);
        let (stall, _) = watch::channel(false);
        let tls = options
            .tls
            .then(|| tls::Tls::generate(options.http2))
            .transpose()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            faults: Mutex::new(faults::Faults {
                log_limit: 100_000,
                ..faults::Faults::default()
            }),
            control,
            stall,
            hangs_released: watch::channel(0).0,
            listener: Mutex::new(ListenerState {
                addr: options.listen,
                accept: None,
            }),
            tls,
            traffic: Arc::default(),
        });
        let server = FakeApiServer {
            ticker: tokio::spawn(bookmark_ticker(
                Arc::downgrade(&shared),
                options.bookmark_every,
            )),
            shared,
        };
        for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
            server.create_namespace(ns)?;
        }
        if server.shared.tls.is_some() {
            server.register_token(TokenUser {
                token: tls::ADMIN_TOKEN.to_string(),
                username: "kubernetes-admin".to_string(),
                groups: vec![
                    "system:masters".to_string(),
                    "system:authenticated".to_string(),
                ],
                ..TokenUser::default()
            });
        }
        for crd in options.crds {
            server.install_crd(crd)?;
        }
        server.shared.listen().await?;
        Ok(server)
    }

    /// The address it listens on.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.shared.listener().addr
    }

    /// `http://127.0.0.1:PORT`, or `https://` with TLS.
    pub fn url(&self) -> String {
        let scheme = if self.shared.tls.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.addr())
    }

    /// Bytes written to clients so far, over every connection (TLS and HTTP/2 framing included).
    pub fn bytes_sent(&self) -> u64 {
        self.shared
            .traffic
            .sent
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// TCP connections clients hold open to it now (idle ones in a client's pool included).
    pub fn open_connections(&self) -> usize {
        self.shared
            .traffic
            .connections
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The CA that signed the server's certificate (PEM), with TLS.
    pub fn ca_pem(&self) -> Option<&str> {
        self.shared.tls.as_ref().map(|t| t.ca_pem.as_str())
    }

    /// A kubeconfig (YAML) whose current context points at this server: without auth in the
    /// clear; with TLS, trusting its CA and with a token user (no prompt, no skipped checks).
    pub fn kubeconfig(&self) -> String {
        match self.ca_pem() {
            None => kubeconfig_for(&self.url()),
            Some(ca) => {
                use base64::Engine;
                let ca = base64::engine::general_purpose::STANDARD.encode(ca);
                format!(
                    "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n    certificate-authority-data: {ca}\nusers:\n- name: fake\n  user:\n    token: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\ncurrent-context: fake\npreferences: {{}}\n",
                    self.url(),
                    tls::ADMIN_TOKEN
                )
            }
        }
    }

    /// Writes [`FakeApiServer::kubeconfig`] to `path`.
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.kubeconfig())
    }

    // === data ===

    /// Installs a CRD, as a POST to `customresourcedefinitions` would; the kind is served at once.
    pub fn install_crd(&self, crd: Value) -> Result<Value, ApiError> {
        let scope = self.scope(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            None,
        )?;
        let mut state = self.shared.state();
        Ok(state
            .create(&scope, crd, &store::WriteOpts::default())?
            .object)
    }

    /// Installs a CRD given as YAML.
    pub fn install_crd_yaml(&self, yaml: &str) -> anyhow::Result<Value> {
        let crd: Value = parse_yaml(yaml)?;
        Ok(self.install_crd(crd)?)
    }

    /// Deletes a CRD by name (`plural.group`): its objects go (DELETED events), then its
    /// watches end and its paths answer 404.
    pub fn delete_crd(&self, name: &str) -> Result<Value, ApiError> {
        let scope = self.scope(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            None,
        )?;
        let deleted = self
            .shared
            .state()
            .delete(&scope, name, &Value::Null, false)?;
        Ok(deleted.object().clone())
    }

    fn scope(
        &self,
        group: &str,
        version: &str,
        plural: &str,
        namespace: Option<&str>,
    ) -> Result<Scope, ApiError> {
        let kind = self
            .shared
            .state()
            .find_kind(group, version, plural)
            .ok_or(ApiError::PathNotFound)?;
        Ok(Scope {
            namespace: namespace.filter(|_| kind.namespaced).map(str::to_string),
            kind,
            version: version.to_string(),
        })
    }

    fn scope_of(&self, obj: &Value) -> Result<(Scope, String), ApiError> {
        let api_version = obj["apiVersion"].as_str().unwrap_or("");
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let kind_name = obj["kind"].as_str().unwrap_or("");
        let kind = self
            .shared
            .state()
            .find_kind_by_name(group, version, kind_name)
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "no kind \"{kind_name}\" is served in \"{api_version}\""
                ))
            })?;
        let namespace = kind.namespaced.then(|| {
            obj["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_string()
        });
        let name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
        Ok((
            Scope {
                kind,
                version: version.to_string(),
                namespace,
            },
            name,
        ))
    }

    /// Creates a namespace (doing nothing if it exists).
    pub fn create_namespace(&self, name: &str) -> Result<(), ApiError> {
        let scope = self.scope("", "v1", "namespaces", None)?;
        let mut state = self.shared.state();
        if state.namespace_exists(name) {
            return Ok(());
        }
        let ns = serde_json::json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": name } });
        state.create(&scope, ns, &store::WriteOpts::default())?;
        Ok(())
    }

    /// Creates the object, or replaces it if it exists (the resourceVersion is taken care of):
    /// the test-side equivalent of `kubectl apply`. Its `apiVersion`, `kind` and
    /// `metadata.namespace` (default `default`) say where it goes; a missing namespace is
    /// created first.
    pub fn apply(&self, obj: Value) -> Result<Value, ApiError> {
        let (scope, name) = self.scope_of(&obj)?;
        if let Some(ns) = &scope.namespace {
            self.create_namespace(ns)?;
        }
        let mut state = self.shared.state();
        let opts = store::WriteOpts::default();
        match state.get(&scope, &name) {
            Ok(current) => {
                let mut obj = obj;
                obj["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
                Ok(state.update(&scope, &name, obj, &opts, false)?.object)
            }
            Err(_) => Ok(state.create(&scope, obj, &opts)?.object),
        }
    }

    /// Applies a JSON merge patch to an object.
    pub fn merge_patch(
        &self,
        group_version: &str,
        plural: &str,
        namespace: &str,
        name: &str,
        patch: Value,
    ) -> Result<Value, ApiError> {
        self.merge_patch_to(group_version, plural, namespace, name, patch, false)
    }

    /// Applies a JSON merge patch to an object's `status` subresource, as a controller or the
    /// kubelet would (main-resource writes keep the old status of kinds that have one).
    pub fn merge_patch_status(
        &self,
        group_version: &str,
        plural: &str,
        namespace: &str,
        name: &str,
        patch: Value,
    ) -> Result<Value, ApiError> {
        self.merge_patch_to(group_version, plural, namespace, name, patch, true)
    }

    fn merge_patch_to(
        &self,
        group_version: &str,
        plural: &str,
        namespace: &str,
        name: &str,
        patch: Value,
        status_only: bool,
    ) -> Result<Value, ApiError> {
        let (group, version) = group_version.split_once('/').unwrap_or(("", group_version));
        let scope = self.scope(group, version, plural, Some(namespace))?;
        let opts = store::WriteOpts::default();
        Ok(self
            .shared
            .state()
            .patch(&scope, name, store::Patch::Merge(patch), &opts, status_only)?
            .object)
    }

    /// Deletes an object; returns its last state (or, while finalizers remain, its marked state).
    pub fn delete(
        &self,
        group_version: &str,
        plural: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Value, ApiError> {
        let (group, version) = group_version.split_once('/').unwrap_or(("", group_version));
        let scope = self.scope(group, version, plural, Some(namespace))?;
        let deleted = self
            .shared
            .state()
            .delete(&scope, name, &Value::Null, false)?;
        Ok(deleted.object().clone())
    }

    /// Reads an object.
    pub fn get(
        &self,
        group_version: &str,
        plural: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Value, ApiError> {
        let (group, version) = group_version.split_once('/').unwrap_or(("", group_version));
        let scope = self.scope(group, version, plural, Some(namespace))?;
        self.shared.state().get(&scope, name)
    }

    /// The newest resourceVersion.
    pub fn current_rv(&self) -> u64 {
        self.shared.state().rv
    }

    // === fault knobs ===

    /// Drops every watch connection mid-body, without the terminating chunk.
    pub fn abort_watches(&self) {
        self.shared.control(Control::Abort);
    }

    /// Ends every watch cleanly, as `timeoutSeconds` does.
    pub fn close_watches(&self) {
        self.shared.control(Control::Close);
    }

    /// Sends one `ERROR` event with this code on every watch, then ends it. 410 is the
    /// `Expired` a compacted history produces; kube-rs relists on it.
    pub fn error_watches(&self, code: u16) {
        self.shared.error_watches(code);
    }

    /// Drops all history: resuming from any earlier resourceVersion gets 410.
    pub fn compact(&self) {
        self.shared.state().compact();
    }

    /// Keeps at most `limit` events of history.
    pub fn set_history_limit(&self, limit: usize) {
        self.shared.state().set_history_limit(limit);
    }

    /// Sends a BOOKMARK now to every watch that allows them.
    pub fn send_bookmarks(&self) {
        self.shared.state().send_bookmarks(true);
    }

    /// Holds (`true`) or releases all watch output; connections stay open and silent.
    pub fn stall_watches(&self, stalled: bool) {
        self.shared.stall.send_replace(stalled);
    }

    /// Answers the next `times` requests selected by `matcher` with `code` (and `Retry-After`).
    pub fn fail_next(&self, matcher: Matcher, times: usize, code: u16, retry_after: Option<u64>) {
        self.inject(Injection {
            matcher,
            times,
            action: Action::Status { code, retry_after },
        });
    }

    /// Accepts the next `times` requests selected by `matcher` and never answers them.
    pub fn hang_next(&self, matcher: Matcher, times: usize) {
        self.inject(Injection {
            matcher,
            times,
            action: Action::Hang,
        });
    }

    /// Adds an injected fault.
    pub fn inject(&self, injection: Injection) {
        self.shared.faults().injections.push(injection);
    }

    /// Removes every injected fault and denial (grants stay); requests hung by an injection
    /// are answered 504, as a server's own timeout would.
    pub fn clear_faults(&self) {
        self.shared.clear_faults();
    }

    /// Removes one denial added by [`FakeApiServer::deny`].
    pub fn remove_deny(&self, deny: &Deny) {
        self.shared.faults().denials.retain(|d| d != deny);
    }

    /// Turns RBAC on: from now on only what `grants` allow is allowed (and denials still deny).
    pub fn grant_only(&self, grants: Vec<Grant>) {
        self.shared.faults().grants = Some(grants);
    }

    /// Turns RBAC off again: everything no denial covers is allowed.
    pub fn allow_all(&self) {
        self.shared.faults().grants = None;
    }

    /// Denies matching requests with 403 (and access reviews with `allowed: false`).
    pub fn deny(&self, deny: Deny) {
        self.shared.faults().denials.push(deny);
    }

    /// Registers a bearer token for `TokenReview` (and as the user of requests that carry it).
    pub fn register_token(&self, user: TokenUser) {
        self.shared.faults().tokens.insert(user.token.clone(), user);
    }

    /// Turns the WatchList feature (`sendInitialEvents`) off or on.
    pub fn set_watch_list_enabled(&self, enabled: bool) {
        self.shared.faults().watch_list_disabled = !enabled;
    }

    /// Closes the port and every connection, as a server going down does.
    pub fn stop_listening(&self) {
        self.shared.unlisten();
    }

    /// Listens again on the same port.
    pub async fn start_listening(&self) -> std::io::Result<()> {
        self.shared.listen().await
    }

    /// Goes down for `down`, then comes back on the same port; the data survives.
    pub async fn restart(&self, down: Duration) -> std::io::Result<()> {
        self.shared.restart(down).await
    }

    // === introspection ===

    /// Open watch connections.
    pub fn open_watches(&self) -> usize {
        self.shared.state().watchers.len()
    }

    /// Open watch connections on `path` whose field selector is `field_selector` (`None`: any).
    pub fn open_watches_on(&self, path: &str, field_selector: Option<&str>) -> usize {
        self.watches()
            .iter()
            .filter(|w| w.path == path && field_selector.is_none_or(|f| w.field_selector == f))
            .count()
    }

    /// Every open watch.
    pub fn watches(&self) -> Vec<WatchInfo> {
        self.shared.state().watch_infos()
    }

    /// The request log, oldest first (bounded; the newest 100,000 at least are kept).
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.shared.faults().log.clone()
    }

    /// Empties the request log and the counters.
    pub fn clear_requests(&self) {
        let mut f = self.shared.faults();
        f.log.clear();
        f.counts.clear();
    }

    /// How many requests with this verb (`list`, `watch`, …) reached `path`.
    pub fn request_count(&self, verb: &str, path: &str) -> u64 {
        self.shared
            .faults()
            .counts
            .get(&(verb.to_string(), path.to_string()))
            .copied()
            .unwrap_or(0)
    }

    /// Waits until `condition` holds, checking every 10 ms, for at most `timeout`; returns
    /// whether it held. For assertions on eventually-consistent counts.
    pub async fn wait_for(&self, timeout: Duration, condition: impl Fn(&Self) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if condition(self) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A kubeconfig pointing at `url` with no credentials and namespace `default`.
pub fn kubeconfig_for(url: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {url}\nusers:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\ncurrent-context: fake\npreferences: {{}}\n"
    )
}

/// Sends due bookmarks until the server is gone.
async fn bookmark_ticker(shared: std::sync::Weak<Shared>, every: Duration) {
    let tick = (every / 4).clamp(Duration::from_millis(10), Duration::from_millis(500));
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        shared.state().send_bookmarks(false);
    }
}
