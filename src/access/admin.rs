//! Who may read the admin endpoints that tell what exists: `/debug/*` (every watched name,
//! made-up ones included, and every caller's identity) and, when asked, `/metrics`. Probes
//! (`/livez`, `/readyz`, gRPC health) stay open to all.
//!
//! A caller on the pod's loopback (127.0.0.1 to 127.0.0.1, `::1` to `::1`) is always let in: the
//! pod's own containers, `kubectl port-forward` and `kubectl exec`, which the API server has
//! authorized already. A connection from the pod's IP to itself is not: that is how Linkerd's
//! proxy (since 2.11) delivers every caller, from anywhere. Anyone else needs `--debug-endpoints
//! public`, or with `--admin-auth kubernetes` a bearer token the API server verifies
//! (TokenReview, through the broker's one [`Reviewer`]: one cache and one rate per source
//! with the gRPC port's tokens) for a user it allows to `get` the path as a nonResourceURL
//! (SubjectAccessReview), as controller-runtime's metrics filter does.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::FutureExt;
use k8s_openapi::api::authentication::v1::UserInfo;
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};

use super::token::{Answer, Audience, REVIEW_TIMEOUT, Reviewer, bearer};
use crate::cache::FlightCache;

/// Who may read `/debug/*` without credentials (`--debug-endpoints`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DebugEndpoints {
    /// Callers in the broker's own network namespace only.
    #[default]
    #[value(alias = "loopback")]
    Local,
    /// Anyone who reaches the admin port.
    Public,
}

/// How callers from elsewhere prove they may read a guarded endpoint (`--admin-auth`,
/// `--metrics-auth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum AdminAuth {
    /// No way: `/debug/*` answers by `--debug-endpoints` alone, `/metrics` answers everyone.
    #[default]
    None,
    /// A bearer token for a user the API server allows to `get` the path (a nonResourceURL).
    Kubernetes,
}

/// The admin port's guard settings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settings {
    /// `--debug-endpoints`.
    pub debug_endpoints: DebugEndpoints,
    /// `--admin-auth`: for `/debug/*`.
    pub admin_auth: AdminAuth,
    /// `--metrics-auth`: for `/metrics`.
    pub metrics_auth: AdminAuth,
}

impl Settings {
    /// Whether any endpoint asks the API server.
    pub fn needs_api(&self) -> bool {
        self.admin_auth == AdminAuth::Kubernetes || self.metrics_auth == AdminAuth::Kubernetes
    }
}

/// Both ends of a connection to the admin port.
#[derive(Debug, Clone, Copy)]
pub struct Ends {
    remote: SocketAddr,
    local: Option<SocketAddr>,
}

impl
    axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, tokio::net::TcpListener>>
    for Ends
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, tokio::net::TcpListener>) -> Self {
        Ends {
            remote: *stream.remote_addr(),
            local: stream.io().local_addr().ok(),
        }
    }
}

impl Ends {
    /// Whether the caller is in the broker's own pod: its connection is on the pod's loopback,
    /// from the address it reaches. From the pod's IP to itself is a proxy's delivery (Linkerd
    /// since 2.11), and 127.0.0.6 to the pod's IP Istio's: neither is taken for the pod's own.
    fn own(&self) -> bool {
        let remote = self.remote.ip().to_canonical();
        is_localhost(remote)
            && self
                .local
                .is_some_and(|local| local.ip().to_canonical() == remote)
    }
}

/// `127.0.0.1` or `::1`, the addresses `kubectl port-forward` and the pod's own containers reach
/// the broker on; not the rest of 127.0.0.0/8, which proxies use (Istio's 127.0.0.6).
fn is_localhost(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.octets() == [127, 0, 0, 1],
        IpAddr::V6(v6) => v6.is_loopback(),
    }
}

/// What the API server said of a user and a path.
#[derive(Debug, Clone)]
enum Verdict {
    Allowed,
    /// 403: a user not allowed the path.
    Forbidden(String),
    /// 503: the API server did not answer.
    Failed(String),
}

/// The guard of the admin port.
pub struct Guard {
    settings: Settings,
    client: Option<kube::Client>,
    /// The broker's token reviewer, shared with the gRPC port.
    reviewer: Option<Arc<Reviewer>>,
    /// What the API server said of a user and a path.
    verdicts: FlightCache<(String, String), Verdict>,
}

/// How long a user's right to a path is trusted without asking again, and how long a refusal
/// stands.
const ALLOWED_TTL: Duration = Duration::from_secs(60);
const REFUSED_TTL: Duration = Duration::from_secs(10);

impl Guard {
    /// A guard with `settings`, asking the API server through `client` and `reviewer` (both
    /// needed with `--admin-auth kubernetes` or `--metrics-auth kubernetes`).
    pub fn new(
        settings: Settings,
        client: Option<kube::Client>,
        reviewer: Option<Arc<Reviewer>>,
    ) -> anyhow::Result<Arc<Guard>> {
        anyhow::ensure!(
            (client.is_some() && reviewer.is_some()) || !settings.needs_api(),
            "--admin-auth kubernetes and --metrics-auth kubernetes ask the Kubernetes API server, \
             which the manifests source does not use"
        );
        Ok(Arc::new(Guard {
            settings,
            client,
            reviewer,
            verdicts: FlightCache::new(10_000),
        }))
    }

    /// Whether the caller at `ends` may read `path`: `Err` with the status and why if not.
    async fn check(
        &self,
        ends: &Ends,
        path: &str,
        headers: &HeaderMap,
        auth: AdminAuth,
        open: bool,
    ) -> Result<(), (StatusCode, String)> {
        if open || ends.own() {
            return Ok(());
        }
        let from = ends.remote.ip().to_canonical();
        let (Some(client), Some(reviewer)) = (
            self.client
                .as_ref()
                .filter(|_| auth == AdminAuth::Kubernetes),
            self.reviewer.as_ref(),
        ) else {
            return Err((
                StatusCode::FORBIDDEN,
                format!(
                    "{path} answers only callers in the broker's own pod (this one is at {from}); \
                     start the broker with --admin-auth kubernetes to let in users the API server \
                     allows, or --debug-endpoints public"
                ),
            ));
        };
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer);
        let Some(token) = token else {
            return Err((
                StatusCode::UNAUTHORIZED,
                format!("{path} needs `authorization: Bearer <token>` from a caller at {from}"),
            ));
        };
        let user = match reviewer
            .review(token, &format!("ip:{from}"), Audience::ApiServer)
            .await
        {
            Answer::User(user) => user,
            Answer::Refused(why) => return Err((StatusCode::UNAUTHORIZED, why)),
            Answer::Failed(why) => return Err((StatusCode::SERVICE_UNAVAILABLE, why)),
            Answer::Limited(why) => return Err((StatusCode::TOO_MANY_REQUESTS, why)),
        };
        let key = (who(&user), path.to_string());
        let (client, path_owned) = (client.clone(), path.to_string());
        let verdict = self
            .verdicts
            .get(&key, move || {
                async move {
                    let verdict = may_get(client, user, &path_owned).await;
                    let ttl = match verdict {
                        Verdict::Allowed => ALLOWED_TTL,
                        Verdict::Forbidden(_) => REFUSED_TTL,
                        Verdict::Failed(_) => Duration::ZERO,
                    };
                    (verdict, ttl)
                }
                .boxed()
            })
            .await;
        match verdict {
            Verdict::Allowed => Ok(()),
            Verdict::Forbidden(why) => Err((StatusCode::FORBIDDEN, why)),
            Verdict::Failed(why) => Err((StatusCode::SERVICE_UNAVAILABLE, why)),
        }
    }
}

/// A user as the verdicts are kept: everything the SubjectAccessReview is sent of it (name,
/// uid, groups and extra, which an authorizer may weigh), written out unambiguously.
fn who(user: &UserInfo) -> String {
    format!("{user:?}")
}

/// The SubjectAccessReview of `get` on `path` for `user`.
async fn may_get(client: kube::Client, user: UserInfo, path: &str) -> Verdict {
    let name = user.username.clone().unwrap_or_default();
    let reviews: Api<SubjectAccessReview> = Api::all(client);
    let request = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: user.username,
            groups: user.groups,
            uid: user.uid,
            extra: user.extra,
            non_resource_attributes: Some(NonResourceAttributes {
                path: Some(path.to_string()),
                verb: Some("get".into()),
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    };
    let params = PostParams::default();
    let answer = tokio::time::timeout(REVIEW_TIMEOUT, reviews.create(&params, &request));
    let status = match answer.await {
        Ok(Ok(review)) => review.status.unwrap_or_default(),
        Ok(Err(e)) => return Verdict::Failed(format!("the SubjectAccessReview failed ({e})")),
        Err(_) => {
            return Verdict::Failed(format!(
                "the SubjectAccessReview did not answer within {REVIEW_TIMEOUT:?}"
            ));
        }
    };
    if status.allowed {
        Verdict::Allowed
    } else {
        Verdict::Forbidden(format!(
            "user {} may not get {path} (a nonResourceURL: grant it in a ClusterRole)",
            crate::selector::quote(&name)
        ))
    }
}

/// The middleware in front of `/debug/*`.
pub async fn debug(
    State(guard): State<Arc<Guard>>,
    ConnectInfo(ends): ConnectInfo<Ends>,
    request: Request,
    next: Next,
) -> Response {
    let open = guard.settings.debug_endpoints == DebugEndpoints::Public;
    let auth = guard.settings.admin_auth;
    guarded(&guard, ends, request, next, auth, open).await
}

/// The middleware in front of `/metrics`.
pub async fn metrics(
    State(guard): State<Arc<Guard>>,
    ConnectInfo(ends): ConnectInfo<Ends>,
    request: Request,
    next: Next,
) -> Response {
    let auth = guard.settings.metrics_auth;
    guarded(&guard, ends, request, next, auth, auth == AdminAuth::None).await
}

async fn guarded(
    guard: &Guard,
    ends: Ends,
    request: Request,
    next: Next,
    auth: AdminAuth,
    open: bool,
) -> Response {
    let path = request.uri().path().to_string();
    match guard
        .check(&ends, &path, request.headers(), auth, open)
        .await
    {
        Ok(()) => next.run(request).await,
        Err((status, why)) => {
            tracing::debug!(%path, from = %ends.remote, %status, reason = %why, "an admin request refused");
            (status, format!("{why}\n")).into_response()
        }
    }
}
