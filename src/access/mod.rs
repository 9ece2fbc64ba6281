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
//!
//! Every "who may" of the broker is decided here: who a caller is (`identify.rs`, from the
//! sources in `peer_pod.rs`, `token.rs` and `identity.rs`), what it may read and within which
//! limits (`admission.rs`, `policy.rs`, `limits.rs`), and who may read the admin port's guarded
//! endpoints ([`admin`]); the gRPC port's tokens and the admin port's share one token
//! [`token::Reviewer`].

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::selector::Selector;
use crate::telemetry::{Metrics, ReloadLabels, ReloadResult};

pub mod admin;
mod admission;
mod caller;
mod identify;
pub mod identity;
mod layer;
pub mod limits;
pub mod peer_pod;
pub mod policy;
pub mod token;

pub use admission::{RETRY_PUSHBACK, Ticket};
pub use caller::{Caller, PodRef, Workload};
pub use identify::ConnIdentity;
pub use identity::{IdentityList, IdentitySource, Mesh};
pub use layer::Authenticate;

use peer_pod::PeerPods;
use policy::Policy;
use token::{Reviewer, Tokens};

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
    reviewer: Option<Arc<Reviewer>>,
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
        let reviewer = settings
            .api
            .clone()
            .map(|api| Arc::new(Reviewer::new(api, settings.token_audiences.clone())));
        let tokens = with(IdentitySource::Token)
            .then(|| reviewer.clone().map(Tokens::new))
            .flatten();
        Arc::new(Access {
            limits: limits::Limits::new(settings.limits),
            settings,
            peer_pods,
            tokens,
            reviewer,
            policy,
            open: Arc::default(),
            next_ticket: AtomicU64::new(1),
            metrics,
        })
    }

    /// The broker's one token reviewer (none without a Kubernetes API), which the admin port's
    /// guard shares.
    pub fn token_reviewer(&self) -> Option<Arc<Reviewer>> {
        self.reviewer.clone()
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
        use crate::rights::may;
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
