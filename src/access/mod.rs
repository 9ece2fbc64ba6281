//! Who the caller is and what it may read: identity sources, the policy, and the limits that
//! keep one caller from starving the others.
//!
//! The transport hands every request its connection's [`Peer`]. With identity on, the
//! per-connection [`Authenticate`] layer tries the `--identity` sources in order and puts the
//! [`Caller`] the first one names into the request's extensions, or answers UNAUTHENTICATED
//! (UNAVAILABLE when a source could not ask the API server). The services then ask [`Access`]
//! whether that caller may read what it names ([`Access::precheck`] before anything is resolved,
//! [`Access::authorize`] after) and to admit the stream within the limits
//! ([`Access::admit`]), which gives a [`Ticket`] the stream holds: it counts the stream, and
//! ends it with PERMISSION_DENIED if a reloaded policy no longer lets the caller read it.
//!
//! Identity off (`--identity none`) keeps the broker open, as before this layer: every caller
//! is [`Caller::Anonymous`], the policy does not apply, and the limits count callers by peer IP.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use http::HeaderMap;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::conn::{Peer, PeerAddr};
use crate::selector::Selector;
use crate::sync::lock;
use crate::telemetry::{
    Denial, DenialLabels, IdentifiedBy, IdentifyLabels, IdentifyResult, Limit, LimitLabels,
    Metrics, ReloadLabels, ReloadResult,
};

mod caller;
pub mod identity;
mod layer;
pub mod limits;
pub mod peer_pod;
pub mod policy;
pub mod token;

pub use caller::{Caller, PodRef, Workload};
pub use identity::{IdentityList, IdentitySource, Mesh};
pub use layer::Authenticate;

use caller::shared_address;
use peer_pod::{Found, PeerPods};
use policy::Policy;
use token::{Reviewed, Tokens};

/// The default `--token-audience`.
pub const DEFAULT_TOKEN_AUDIENCE: &str = "crd-broker";

/// The addresses a local proxy may deliver from, without `--mesh`: Istio's inbound passthrough
/// (`127.0.0.6`), and loopback for Linkerd before 2.11. Callers there share an address, so it is
/// not their limit key; nor is the broker's own address, which Linkerd 2.11 and later deliver
/// every caller from ([`crate::conn::Peer::from_own_address`]). With `--mesh`, that mesh's own
/// ([`Mesh::proxy_addresses`]).
pub const DEFAULT_MESH_PROXIES: &[&str] = &["127.0.0.1", "127.0.0.6", "::1"];

/// How the access layer is configured.
#[derive(Clone)]
pub struct Settings {
    /// `--identity`: the sources to try, in order; empty: identity off.
    pub identity: IdentityList,
    /// `--policy`: the policy file; `None`: the default policy (own namespace only).
    pub policy: Option<PathBuf>,
    /// How often the policy file is read for changes.
    pub policy_reload_interval: Duration,
    /// `--token-audience`: the audiences a TokenReview asks for.
    pub token_audiences: Vec<String>,
    /// `--mesh`: the mesh whose proxy's header `mesh` identity believes.
    pub mesh: Option<Mesh>,
    /// `--mesh-proxy-addr`: the addresses whose mesh headers are trusted.
    pub mesh_proxies: Vec<IpAddr>,
    /// `--trust-domain`: the only SPIFFE trust domain accepted, if set.
    pub trust_domain: Option<String>,
    /// Per-caller limits.
    pub limits: limits::Config,
    /// The Kubernetes API, for `peer-pod` and `token` (`None` on the manifests source).
    pub api: Option<kube::Client>,
    /// Whether the TLS listener asks for client certificates (`--tls-client-ca`), which `mtls`
    /// needs.
    pub client_certificates: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            identity: IdentityList::default(),
            policy: None,
            policy_reload_interval: Duration::from_secs(2),
            token_audiences: vec![DEFAULT_TOKEN_AUDIENCE.to_string()],
            mesh: None,
            mesh_proxies: DEFAULT_MESH_PROXIES
                .iter()
                .filter_map(|a| a.parse().ok())
                .collect(),
            trust_domain: None,
            limits: limits::Config::default(),
            api: None,
            client_certificates: false,
        }
    }
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("identity", &self.identity)
            .field("policy", &self.policy)
            .field("token_audiences", &self.token_audiences)
            .field("mesh", &self.mesh)
            .field("mesh_proxies", &self.mesh_proxies)
            .field("trust_domain", &self.trust_domain)
            .field("limits", &self.limits)
            .field("api", &self.api.is_some())
            .finish()
    }
}

/// What the access layer knows about one connection: its peer, and the caller a per-connection
/// source (`peer-pod`, `mtls`) found, kept once found.
pub struct ConnIdentity {
    peer: Peer,
    pod: OnceLock<Workload>,
    certificate: OnceLock<Result<Workload, String>>,
}

/// What one source made of a request.
enum Outcome {
    Identified(Caller),
    Unidentified(String),
    Failed(String),
    /// A claim of identity the broker knows to be false: refused, whatever else might identify.
    Forged(String),
    /// Not looked into: the caller's source asked too often (RESOURCE_EXHAUSTED).
    Limited(String),
}

/// Open streams, for revocation when the policy changes.
type Open = Mutex<
    HashMap<
        u64,
        (
            Caller,
            Vec<Selector>,
            CancellationToken,
            Arc<OnceLock<String>>,
        ),
    >,
>;

/// The access layer.
pub struct Access {
    settings: Settings,
    peer_pods: Option<PeerPods>,
    tokens: Option<Tokens>,
    policy: policy::Current,
    limits: limits::Limits,
    open: Arc<Open>,
    next_ticket: AtomicU64,
    metrics: Arc<Metrics>,
}

impl Access {
    /// The access layer `settings` describe; refuses settings that cannot work: a source that
    /// needs the API server without one, `mtls` without client certificates checked, a policy
    /// without identity, a policy file that does not parse.
    pub fn new(settings: Settings, metrics: Arc<Metrics>) -> anyhow::Result<Arc<Access>> {
        let sources = &settings.identity.0;
        if let Some(s) = sources.iter().find(|s| s.needs_api())
            && settings.api.is_none()
        {
            anyhow::bail!(
                "--identity {s} asks the Kubernetes API, which a broker serving --manifests does not have; use mtls or mesh, or leave identity off"
            );
        }
        if sources.is_empty() && settings.policy.is_some() {
            anyhow::bail!(
                "--policy needs --identity: with identity off every caller is anonymous and the policy could not apply"
            );
        }
        if sources.contains(&IdentitySource::Mesh) && settings.mesh.is_none() {
            anyhow::bail!(
                "--identity mesh needs --mesh istio or --mesh linkerd: each mesh's proxy passes the other's header through as the client sent it, so only the named mesh's is believed"
            );
        }
        if sources.contains(&IdentitySource::Mtls) && !settings.client_certificates {
            anyhow::bail!(
                "--identity mtls needs client certificates: give --tls-client-ca (with --tls-cert and --tls-key)"
            );
        }
        // The reloader hears of each reload; once a policy is in force it ends the streams that
        // policy no longer allows. It holds the access layer weakly, and ends with it.
        let this: Arc<OnceLock<Weak<Access>>> = Arc::default();
        let reloads = (metrics.clone(), this.clone());
        let policy = match &settings.policy {
            None => policy::Current::fixed(Policy::default()),
            Some(path) => policy::Current::watch_file(
                path.clone(),
                settings.policy_reload_interval,
                move |loaded| {
                    let (metrics, this) = &reloads;
                    let result = match loaded {
                        Ok(()) => ReloadResult::Loaded,
                        Err(_) => ReloadResult::Refused,
                    };
                    metrics
                        .access
                        .policy_reloads
                        .get_or_create(&ReloadLabels { result })
                        .inc();
                    if loaded.is_ok()
                        && let Some(access) = this.get().and_then(Weak::upgrade)
                    {
                        access.revoke_what_the_policy_forbids();
                    }
                },
            )
            .map_err(anyhow::Error::msg)?,
        };
        let access = Self::assemble(settings, policy, metrics);
        let _ = this.set(Arc::downgrade(&access));
        Ok(access)
    }

    fn assemble(settings: Settings, policy: policy::Current, metrics: Arc<Metrics>) -> Arc<Access> {
        let with = |s: IdentitySource| settings.identity.0.contains(&s);
        let peer_pods = with(IdentitySource::PeerPod)
            .then(|| settings.api.clone().map(PeerPods::new))
            .flatten();
        let tokens = with(IdentitySource::Token)
            .then(|| {
                settings
                    .api
                    .clone()
                    .map(|api| Tokens::new(api, settings.token_audiences.clone()))
            })
            .flatten();
        Arc::new(Access {
            limits: limits::Limits::new(settings.limits),
            settings,
            peer_pods,
            tokens,
            policy,
            open: Arc::default(),
            next_ticket: AtomicU64::new(1),
            metrics,
        })
    }

    /// Whether callers are identified (`--identity` is not `none`).
    pub fn identifies(&self) -> bool {
        !self.settings.identity.0.is_empty()
    }

    /// API requests the identity sources have made: pod lookups and token reviews.
    pub fn api_requests(&self) -> (u64, u64) {
        (
            self.peer_pods.as_ref().map_or(0, PeerPods::lookups),
            self.tokens.as_ref().map_or(0, Tokens::reviews),
        )
    }

    /// Checks that the broker may do what its identity sources need (list pods for
    /// `peer-pod`, create TokenReviews for `token`); `Err` says what is missing. Run with the
    /// source's check for readiness.
    pub async fn check(&self) -> Result<(), String> {
        let Some(api) = &self.settings.api else {
            return Ok(());
        };
        use crate::source::kubernetes::may;
        if self.peer_pods.is_some() {
            may(api, "list", "", "pods", None)
                .await
                .map_err(|e| format!("--identity peer-pod: {e}"))?;
        }
        if self.tokens.is_some() {
            may(api, "create", "authentication.k8s.io", "tokenreviews", None)
                .await
                .map_err(|e| format!("--identity token: {e}"))?;
        }
        Ok(())
    }

    /// The state of a new connection.
    pub fn connection(&self, peer: &Peer) -> Arc<ConnIdentity> {
        Arc::new(ConnIdentity {
            peer: peer.clone(),
            pod: OnceLock::new(),
            certificate: OnceLock::new(),
        })
    }

    /// Who is calling: the first `--identity` source that says, else a local caller on a unix
    /// socket, else UNAUTHENTICATED naming what was tried (UNAVAILABLE if a source could not
    /// ask the API server, so that clients retry).
    pub async fn identify(
        &self,
        conn: &ConnIdentity,
        headers: &HeaderMap,
    ) -> Result<Caller, Status> {
        if !self.identifies() {
            return Ok(Caller::anonymous(&conn.peer, &self.settings.mesh_proxies));
        }
        let mut tried = Vec::new();
        let mut failed = false;
        for &source in &self.settings.identity.0 {
            let outcome = match source {
                IdentitySource::PeerPod => self.by_peer_pod(conn).await,
                IdentitySource::Token => self.by_token(conn, headers).await,
                IdentitySource::Mtls => self.by_certificate(conn),
                IdentitySource::Mesh => self.by_mesh(conn, headers),
            };
            match outcome {
                Outcome::Identified(caller) => {
                    self.count_identification(
                        IdentifiedBy::from(source),
                        IdentifyResult::Identified,
                    );
                    return Ok(caller);
                }
                Outcome::Unidentified(why) => tried.push(format!("{source}: {why}")),
                Outcome::Failed(why) => {
                    failed = true;
                    tried.push(format!("{source}: {why}"));
                }
                Outcome::Limited(why) => {
                    self.count_identification(IdentifiedBy::from(source), IdentifyResult::Limited);
                    self.count_limit(Limit::TokenReviews);
                    return Err(Status::resource_exhausted(why));
                }
                Outcome::Forged(why) => {
                    self.count_identification(IdentifiedBy::from(source), IdentifyResult::Forged);
                    let from = conn.peer.ip().map(|ip| ip.to_string()).unwrap_or_default();
                    tracing::warn!(%from, reason = %why, "a forged identity refused");
                    return Err(Status::unauthenticated(format!(
                        "the caller at {from} is refused: {why}"
                    )));
                }
            }
        }
        if let PeerAddr::Unix { uid, .. } = conn.peer.addr {
            self.count_identification(IdentifiedBy::Unix, IdentifyResult::Identified);
            return Ok(Caller::Local { uid });
        }
        let from = conn.peer.ip().map(|ip| ip.to_string()).unwrap_or_default();
        if failed {
            self.count_identification(IdentifiedBy::Nothing, IdentifyResult::Failed);
            return Err(Status::unavailable(format!(
                "cannot identify the caller at {from} now: {}; retry",
                tried.join("; ")
            )));
        }
        self.count_identification(IdentifiedBy::Nothing, IdentifyResult::Unidentified);
        Err(Status::unauthenticated(format!(
            "no identity source identifies the caller at {from}: {}",
            tried.join("; ")
        )))
    }

    fn count_identification(&self, source: IdentifiedBy, result: IdentifyResult) {
        self.metrics
            .access
            .identifications
            .get_or_create(&IdentifyLabels { source, result })
            .inc();
    }

    async fn by_peer_pod(&self, conn: &ConnIdentity) -> Outcome {
        if let Some(w) = conn.pod.get() {
            return Outcome::Identified(Caller::Workload(w.clone()));
        }
        let Some(ip) = conn.peer.ip() else {
            return Outcome::Unidentified("not a TCP connection".into());
        };
        if conn.peer.from_own_address() {
            // The broker's own pod has this IP, but such a connection is a proxy in the pod
            // delivering someone else's (Linkerd since 2.11), or a process beside the broker.
            return Outcome::Unidentified(format!(
                "the connection comes from the broker's own address ({ip}): a proxy in its pod \
                 forwarding another pod's caller, or a process beside it, which is no pod's caller"
            ));
        }
        let Some(pods) = &self.peer_pods else {
            return Outcome::Failed("no Kubernetes API".into());
        };
        match pods.find(ip).await {
            Found::Pod(w) => {
                // A racing request on the same connection may have set it: either is the pod.
                let w = conn.pod.get_or_init(|| w).clone();
                Outcome::Identified(Caller::Workload(w))
            }
            Found::Nobody(why) => Outcome::Unidentified(why),
            Found::Failed(why) => Outcome::Failed(why),
        }
    }

    fn shared_address(&self, peer: &Peer) -> bool {
        shared_address(peer, &self.settings.mesh_proxies)
    }

    async fn by_token(&self, conn: &ConnIdentity, headers: &HeaderMap) -> Outcome {
        let Some(value) = headers.get(http::header::AUTHORIZATION) else {
            return Outcome::Unidentified("no authorization header".into());
        };
        let token = value
            .to_str()
            .ok()
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim)
            .filter(|t| !t.is_empty());
        let Some(token) = token else {
            return Outcome::Unidentified(
                "the authorization header is not `Bearer <token>`".into(),
            );
        };
        let Some(tokens) = &self.tokens else {
            return Outcome::Failed("no Kubernetes API".into());
        };
        // Where the token comes from: the caller's address, one for every caller at a proxy's
        // (a new connection there is no new source), the connection on a unix socket.
        let source = match conn.peer.ip() {
            Some(ip) if self.shared_address(&conn.peer) => format!("proxy:{ip}"),
            Some(ip) => format!("ip:{ip}"),
            None => format!("connection:{}", conn.peer.id),
        };
        match tokens.review(token, &source).await {
            Reviewed::ServiceAccount(w) => Outcome::Identified(Caller::Workload(w)),
            Reviewed::Refused(why) => Outcome::Unidentified(why),
            Reviewed::Failed(why) => Outcome::Failed(why),
            Reviewed::Limited(why) => Outcome::Limited(why),
        }
    }

    fn by_certificate(&self, conn: &ConnIdentity) -> Outcome {
        let found = conn.certificate.get_or_init(|| {
            let Some(chain) = &conn.peer.client_certs else {
                return Err("no client certificate".into());
            };
            let leaf = chain.first().ok_or("no client certificate")?;
            let sa = identity::certificate_spiffe_id(leaf, self.settings.trust_domain.as_deref())?;
            Ok(Workload {
                namespace: sa.namespace,
                service_account: sa.name,
                pod: None,
                instance: Some(fingerprint(leaf)),
            })
        });
        match found {
            Ok(w) => Outcome::Identified(Caller::Workload(w.clone())),
            Err(why) => Outcome::Unidentified(why.clone()),
        }
    }

    fn by_mesh(&self, conn: &ConnIdentity, headers: &HeaderMap) -> Outcome {
        let Some(mesh) = self.settings.mesh else {
            return Outcome::Unidentified("no --mesh named".into());
        };
        // The other mesh's header: no proxy of this mesh sets it, so the client did.
        let other = mesh.other();
        if headers.contains_key(other.header()) {
            return Outcome::Forged(format!(
                "it sent {}, which only {other}'s proxy sets, and this broker is in {mesh} (--mesh {mesh})",
                other.header()
            ));
        }
        // Linkerd's proxy delivers from the pod's own IP since 2.11 (from 127.0.0.1 before).
        let from_proxy = conn
            .peer
            .ip()
            .is_some_and(|ip| self.settings.mesh_proxies.contains(&ip))
            || (mesh == Mesh::Linkerd && conn.peer.from_own_address());
        if !from_proxy {
            // Anyone can send the header; only the local proxy's is believed.
            return Outcome::Unidentified(
                "not from a local mesh proxy address (--mesh-proxy-addr); its mesh headers are ignored"
                    .into(),
            );
        }
        let values: Vec<&str> = headers
            .get_all(mesh.header())
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        if values.is_empty() {
            return Outcome::Unidentified(format!("no {} header", mesh.header()));
        }
        let value = values.join(",");
        let trust_domain = self.settings.trust_domain.as_deref();
        let found = match mesh {
            Mesh::Istio => identity::xfcc(&value, trust_domain).map(|(sa, hash)| {
                let instance = hash.unwrap_or_else(|| fingerprint(value.as_bytes()));
                (sa, Some(instance))
            }),
            Mesh::Linkerd => identity::l5d_client_id(&value, trust_domain).map(|sa| (sa, None)),
        };
        match found {
            Ok((sa, instance)) => Outcome::Identified(Caller::Workload(Workload {
                namespace: sa.namespace,
                service_account: sa.name,
                pod: None,
                instance,
            })),
            Err(why) => Outcome::Unidentified(why),
        }
    }

    /// Refuses, before anything is resolved, a caller who may read nothing in the selector's
    /// namespace: PERMISSION_DENIED naming the caller and the namespace, the same whether or
    /// not the resource exists.
    pub fn precheck(&self, caller: &Caller, selector: &Selector) -> Result<(), Status> {
        if self
            .policy
            .get()
            .may_read_in(caller, selector.namespace.as_deref())
        {
            return Ok(());
        }
        Err(self.denied(caller, selector, Denial::Namespace))
    }

    /// Refuses a caller who may not read the resolved `selector`'s kind there.
    pub fn authorize(&self, caller: &Caller, selector: &Selector) -> Result<(), Status> {
        if self.policy.get().may_read(caller, selector) {
            return Ok(());
        }
        Err(self.denied(caller, selector, Denial::Kind))
    }

    fn denied(&self, caller: &Caller, selector: &Selector, reason: Denial) -> Status {
        let reason = match (reason, &selector.namespace) {
            (_, None) => Denial::ClusterScoped,
            (r, Some(_)) => r,
        };
        self.count_denial(reason);
        Status::permission_denied(denial_message(caller, selector))
    }

    /// The callers with streams open and how many each has (callers the limits do not apply
    /// to, such as a local mesh proxy, are not listed).
    pub fn callers(&self) -> Vec<(String, usize)> {
        self.limits.callers()
    }

    /// Admits a stream of `caller`'s over the resolved `selectors`, of which `new` are not
    /// watched yet, within the per-caller limits (RESOURCE_EXHAUSTED naming the limit).
    pub fn admit(
        &self,
        caller: &Caller,
        selectors: &[Selector],
        new: limits::New,
    ) -> Result<Ticket, Status> {
        let slot = self
            .limits
            .admit(caller.limit_key(), new)
            .map_err(|refused| {
                self.count_limit(refused.limit);
                refusal_status(caller, refused)
            })?;
        let revoked = CancellationToken::new();
        let reason = Arc::new(OnceLock::new());
        let id = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        // Streams of anonymous callers are never revoked: no policy applies to them.
        let registered = self.identifies();
        if registered {
            lock(&self.open).insert(
                id,
                (
                    caller.clone(),
                    selectors.to_vec(),
                    revoked.clone(),
                    reason.clone(),
                ),
            );
        }
        let ticket = Ticket {
            slot,
            id,
            open: registered.then(|| self.open.clone()),
            revoked,
            reason,
        };
        // A reload between the caller's authorization and the registration above would have
        // found nothing to revoke: the policy in force is asked again now that a reload will
        // find this stream (dropping the ticket unregisters it).
        if registered {
            let policy = self.policy.get();
            if let Some(s) = selectors.iter().find(|s| !policy.may_read(caller, s)) {
                self.count_denial(Denial::Revoked);
                let why = format!("{}; the policy changed", denial_message(caller, s));
                return Err(Status::permission_denied(why));
            }
        }
        Ok(ticket)
    }

    fn count_denial(&self, reason: Denial) {
        self.metrics
            .access
            .denials
            .get_or_create(&DenialLabels { reason })
            .inc();
    }

    /// Counts a request refused by `limit`.
    pub fn count_limit(&self, limit: crate::telemetry::Limit) {
        self.metrics
            .access
            .limit_hits
            .get_or_create(&LimitLabels { limit })
            .inc();
    }

    /// Ends every open stream the policy now in force no longer allows.
    fn revoke_what_the_policy_forbids(&self) {
        let policy = self.policy.get();
        let open = lock(&self.open);
        for (caller, selectors, revoked, reason) in open.values() {
            if let Some(s) = selectors.iter().find(|s| !policy.may_read(caller, s)) {
                let _ = reason.set(format!("{}; the policy changed", denial_message(caller, s)));
                self.count_denial(Denial::Revoked);
                revoked.cancel();
            }
        }
    }
}

/// The header in which a stream refused for the broker's pace is told when to try again, in
/// milliseconds: gRPC's server pushback (gRFC A6), which a client's retry policy follows.
pub const RETRY_PUSHBACK: &str = "grpc-retry-pushback-ms";

/// RESOURCE_EXHAUSTED for a request the limits refuse, naming the caller and the limit, with
/// the wait in [`RETRY_PUSHBACK`] where one is known.
fn refusal_status(caller: &Caller, refused: limits::Refusal) -> Status {
    let mut status = Status::resource_exhausted(format!("{caller}: {}", refused.why));
    if let Some(wait) = refused.retry_after {
        let millis = wait.as_millis().max(1).to_string();
        if let Ok(value) = millis.parse() {
            status.metadata_mut().insert(RETRY_PUSHBACK, value);
        }
    }
    status
}

fn denial_message(caller: &Caller, selector: &Selector) -> String {
    match &selector.namespace {
        Some(ns) if ns == crate::selector::ALL_NAMESPACES => format!(
            "{caller} may not read {}.{} in every namespace: no policy grant reads \"*\"",
            selector.kind.resource, selector.kind.group
        ),
        Some(ns) => format!(
            "{caller} may not read {}.{} in namespace {ns}: no policy grant covers it",
            selector.kind.resource, selector.kind.group
        ),
        None => format!(
            "{caller} may not read cluster-scoped {}.{}: no policy grant covers it",
            selector.kind.resource, selector.kind.group
        ),
    }
}

/// A short hash of a certificate, to tell instances of one service account apart in the limits.
fn fingerprint(der: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A stream's admission: it counts the stream against its caller's limit while it lives, and
/// [`Ticket::revoked`] resolves when a reloaded policy no longer lets the caller read it.
pub struct Ticket {
    slot: limits::Slot,
    id: u64,
    open: Option<Arc<Open>>,
    revoked: CancellationToken,
    reason: Arc<OnceLock<String>>,
}

impl Ticket {
    /// A watch (`--max-watches-per-caller`) or a set (`--max-sets-per-caller`) this stream's
    /// request started, charged to its caller until it ends.
    pub fn charge(&self, what: limits::Charged) -> Option<limits::Charge> {
        self.slot.charge(what)
    }

    /// Resolves with PERMISSION_DENIED if the stream is revoked; never otherwise.
    pub fn revoked(&self) -> impl Future<Output = Status> + Send + 'static {
        let revoked = self.revoked.clone();
        let reason = self.reason.clone();
        async move {
            revoked.cancelled().await;
            Status::permission_denied(
                reason
                    .get()
                    .cloned()
                    .unwrap_or_else(|| "access revoked".into()),
            )
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(open) = &self.open {
            lock(open).remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(namespace: &str) -> Caller {
        Caller::Workload(Workload {
            namespace: namespace.into(),
            service_account: "app".into(),
            pod: None,
            instance: Some("1".into()),
        })
    }

    #[test]
    fn a_request_the_access_layer_did_not_see_has_no_caller() {
        let status = Caller::of(&http::Extensions::new()).unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
    }

    #[tokio::test]
    async fn a_policy_changed_between_authorization_and_admission_refuses_the_stream() {
        let grant = Policy::parse("grants:\n  - from: team-a\n    read: [team-b]\n").unwrap();
        let (policy, swap) = policy::Current::swappable(grant);
        let settings = Settings {
            identity: "mtls".parse().unwrap(),
            ..Settings::default()
        };
        let access = Access::assemble(settings, policy, Arc::default());
        let caller = workload("team-a");
        let selector: Selector = "featureflags.v1beta1.core.openfeature.dev/team-b/f"
            .parse()
            .unwrap();
        access.authorize(&caller, &selector).expect("granted");
        // The reload lands here, and finds no stream of this caller's to revoke.
        swap.send_replace(Arc::new(Policy::default()));
        access.revoke_what_the_policy_forbids();
        let one = limits::New {
            watches: 1,
            sets: 0,
        };
        let Err(refused) = access.admit(&caller, std::slice::from_ref(&selector), one) else {
            panic!("the policy in force no longer allows it");
        };
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(
            refused.message().contains("the policy changed"),
            "{}",
            refused.message()
        );
        assert!(
            access.open.lock().unwrap().is_empty(),
            "not left registered"
        );
        // The caller's own namespace is still theirs.
        let own: Selector = "featureflags.v1beta1.core.openfeature.dev/team-a/f"
            .parse()
            .unwrap();
        access
            .admit(&caller, &[own], one)
            .expect("its own namespace");
    }
}
