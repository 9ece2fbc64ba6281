//! The Kubernetes source: one shared kube-rs `Client`, discovery on first use (so a CRD
//! installed after start works without a restart), and one `watch_object` per resource — a LIST
//! and a WATCH with `fieldSelector=metadata.name=…`, with kube's default backoff.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use kube::api::{Api, DynamicObject};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, watch_object};
use tokio::time::Instant;

use super::{KindNames, Object, Observed, Source, SourceError};
use crate::selector::{KindRef, Selector};

/// How long a discovery answer is trusted before it is asked again.
const DISCOVERY_TTL: Duration = Duration::from_secs(30);

/// Longer than the ~60 s between the API server's bookmarks on a quiet watch, so idle watches
/// are not cut, but bounded, so a LIST that never answers is retried instead of hanging the
/// watch forever (kube's default is no read timeout).
pub const READ_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Debug, Clone)]
struct Discovered {
    names: KindNames,
    version: String,
    at: Instant,
}

/// Custom resources from a Kubernetes API server.
pub struct Kubernetes {
    client: kube::Client,
    allowed: Vec<KindRef>,
    discovered: Mutex<HashMap<KindRef, Discovered>>,
    resources: Mutex<HashMap<(String, String, String), ApiResource>>,
}

impl Kubernetes {
    /// A source on `client`, serving the kinds `allowed` names (any kind, if empty).
    pub fn new(client: kube::Client, allowed: Vec<KindRef>) -> Self {
        Kubernetes {
            client,
            allowed,
            discovered: Mutex::new(HashMap::new()),
            resources: Mutex::new(HashMap::new()),
        }
    }

    /// A source on the client kube infers from the environment: `KUBECONFIG` (or
    /// `~/.kube/config`), else the in-cluster service account.
    pub async fn infer(allowed: Vec<KindRef>) -> anyhow::Result<Self> {
        let mut config = kube::Config::infer().await?;
        config.read_timeout = Some(READ_TIMEOUT);
        Ok(Self::new(kube::Client::try_from(config)?, allowed))
    }

    /// The client.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    async fn discover(&self, kind: &KindRef) -> Result<Discovered, SourceError> {
        let cached = self
            .discovered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(kind)
            .filter(|d| d.at.elapsed() < DISCOVERY_TTL)
            .cloned();
        if let Some(d) = cached {
            return Ok(d);
        }
        let version = match &kind.version {
            Some(v) => v.clone(),
            None => self.preferred_version(&kind.group).await?,
        };
        let group_version = format!("{}/{version}", kind.group);
        let list = self
            .client
            .list_api_group_resources(&group_version)
            .await
            .map_err(|e| match e {
                kube::Error::Api(s) if s.code == 404 => {
                    SourceError::UnknownKind(format!("the API server serves no {group_version}"))
                }
                other => api_error(other),
            })?;
        let candidates: Vec<KindNames> = list
            .resources
            .iter()
            .filter(|r| !r.name.contains('/'))
            .map(|r| KindNames {
                group: kind.group.clone(),
                plural: r.name.clone(),
                singular: r.singular_name.clone(),
                kind: r.kind.clone(),
                short_names: r.short_names.clone().unwrap_or_default(),
                namespaced: r.namespaced,
            })
            .collect();
        let names = candidates
            .iter()
            .find(|n| n.answers_to(&kind.resource))
            .cloned()
            .ok_or_else(|| {
                let served: Vec<&str> = candidates.iter().map(|n| n.plural.as_str()).collect();
                SourceError::UnknownKind(format!(
                    "the API server serves no resource {:?} in {group_version} (it serves: {})",
                    kind.resource,
                    served.join(", ")
                ))
            })?;
        let found = Discovered {
            names,
            version,
            at: Instant::now(),
        };
        self.discovered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(kind.clone(), found.clone());
        let resource = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(&kind.group, &found.version, &found.names.kind),
            &found.names.plural,
        );
        self.resources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                (
                    kind.group.clone(),
                    found.version.clone(),
                    found.names.plural.clone(),
                ),
                resource,
            );
        Ok(found)
    }

    async fn preferred_version(&self, group: &str) -> Result<String, SourceError> {
        let groups = self.client.list_api_groups().await.map_err(api_error)?;
        let g = groups
            .groups
            .iter()
            .find(|g| g.name == group)
            .ok_or_else(|| {
                SourceError::UnknownKind(format!("the API server serves no API group {group}"))
            })?;
        g.preferred_version
            .as_ref()
            .map(|p| p.version.clone())
            .or_else(|| g.versions.first().map(|v| v.version.clone()))
            .ok_or_else(|| {
                SourceError::UnknownKind(format!("API group {group} has no served version"))
            })
    }

    fn api(&self, selector: &Selector) -> Api<DynamicObject> {
        let kind = &selector.kind;
        let version = kind.version.clone().unwrap_or_default();
        let resource = self
            .resources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(kind.group.clone(), version.clone(), kind.resource.clone()))
            .cloned()
            .unwrap_or_else(|| {
                ApiResource::from_gvk_with_plural(
                    &GroupVersionKind::gvk(&kind.group, &version, ""),
                    &kind.resource,
                )
            });
        match &selector.namespace {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &resource),
            None => Api::all_with(self.client.clone(), &resource),
        }
    }
}

impl Kubernetes {
    /// Whether the broker's own identity may `verb` the kind, cluster-wide
    /// (a SelfSubjectAccessReview).
    async fn may(&self, verb: &str, names: &KindNames) -> Result<(), String> {
        use k8s_openapi::api::authorization::v1::{
            ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
        };
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(ResourceAttributes {
                    group: Some(names.group.clone()),
                    resource: Some(names.plural.clone()),
                    verb: Some(verb.to_string()),
                    ..ResourceAttributes::default()
                }),
                ..SelfSubjectAccessReviewSpec::default()
            },
            ..SelfSubjectAccessReview::default()
        };
        let reviews: Api<SelfSubjectAccessReview> = Api::all(self.client.clone());
        let answer = reviews
            .create(&kube::api::PostParams::default(), &review)
            .await
            .map_err(|e| {
                format!(
                    "asking whether the broker may {verb} {}.{}: {e}",
                    names.plural, names.group
                )
            })?;
        match answer.status {
            Some(status) if status.allowed => Ok(()),
            status => Err(format!(
                "the broker may not {verb} {}.{} ({})",
                names.plural,
                names.group,
                status
                    .and_then(|s| s.reason)
                    .unwrap_or_else(|| "no reason given".into())
            )),
        }
    }
}

/// An API error, by what a subscriber should make of it.
fn api_error(error: kube::Error) -> SourceError {
    match error {
        kube::Error::Api(s) if s.code == 403 => SourceError::Forbidden(s.message),
        kube::Error::Api(s) if s.code == 404 => SourceError::UnknownKind(s.message),
        other => SourceError::Unavailable(other.to_string()),
    }
}

fn watch_error(error: watcher::Error) -> SourceError {
    match error {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => api_error(e),
        watcher::Error::WatchError(s) if s.code == 403 => SourceError::Forbidden(s.message),
        other => SourceError::Unavailable(other.to_string()),
    }
}

fn to_object(obj: &DynamicObject) -> Object {
    Object {
        json: serde_json::to_vec(obj).unwrap_or_default().into(),
        uid: obj.metadata.uid.clone().unwrap_or_default(),
        resource_version: obj.metadata.resource_version.clone().unwrap_or_default(),
    }
}

impl Source for Kubernetes {
    async fn resolve(&self, selector: &Selector) -> Result<Selector, SourceError> {
        let found = self.discover(&selector.kind).await?;
        found
            .names
            .canonical(selector, &found.version, &self.allowed)
    }

    async fn check(&self) -> Result<(), String> {
        self.client
            .apiserver_version()
            .await
            .map_err(|e| format!("the API server does not answer: {e}"))?;
        for kind in &self.allowed {
            let found = self
                .discover(kind)
                .await
                .map_err(|e| format!("--resource {kind}: {e}"))?;
            for verb in ["list", "watch"] {
                self.may(verb, &found.names).await?;
            }
        }
        Ok(())
    }

    fn watch(&self, selector: &Selector) -> BoxStream<'static, Result<Observed, SourceError>> {
        watch_object(self.api(selector), &selector.name)
            .default_backoff()
            .map(|item| match item {
                Ok(Some(obj)) => Ok(Observed::Present(to_object(&obj))),
                Ok(None) => Ok(Observed::Absent),
                Err(e) => Err(watch_error(e)),
            })
            .boxed()
    }
}
