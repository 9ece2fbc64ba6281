//! The Kubernetes source: one shared kube-rs `Client`, discovery on first use (so a CRD
//! installed after start works without a restart), and one [`follow`] per resource — a LIST and
//! a WATCH with `fieldSelector=metadata.name=…`, retried with the broker's own backoff.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::stream::BoxStream;
use kube::api::{Api, DynamicObject};
use kube::core::{ApiResource, GroupVersionKind};
use tokio::time::Instant;

use super::retry::Recovery;
use super::{KindNames, Observed, SetEvent, Source, SourceError};
use crate::cache::FlightCache;
use crate::selector::{KindRef, Selector, Set};
use crate::sync::lock;
use convert::api_error;

mod convert;
mod follow;
mod granularity;
pub mod http;
mod requests;
mod rights;
pub mod throttle;

pub use follow::StreamingLists;
pub use http::ApiHttp2;

/// Names of one kind watched in one namespace above which one namespace watch replaces theirs
/// (`--namespace-watch-threshold`; see ADR 0015 for the measurement behind it).
pub const DEFAULT_NAMESPACE_WATCH_THRESHOLD: usize = 100;

/// How long a discovery answer is trusted before it is asked again (the last one that worked is
/// still used while asking fails).
pub const DISCOVERY_TTL: Duration = Duration::from_secs(30);

/// How long an answer that something does not exist is trusted: a CRD installed a moment ago is
/// found this long after, at most, and asking for invented groups or kinds costs at most one
/// request per this long.
pub const ABSENT_TTL: Duration = Duration::from_secs(1);

/// How many API group-versions discovery remembers.
const DISCOVERY_CAPACITY: usize = 1024;

/// The longest a discovery request may take (askers share it, so it must not hang them).
const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(10);

/// The read timeout of kube's own stack (used through a `proxy-url`): longer than the ~60 s
/// between the API server's bookmarks on a quiet watch, so idle watches are not cut, but
/// bounded, so a LIST that never answers is retried instead of hanging the watch forever
/// (kube's default is no read timeout). The broker's own stack bounds each request's answer
/// and each watch's silence instead.
pub const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// The API groups the server serves: each one's versions, the preferred first.
#[derive(Debug)]
struct Groups {
    versions: HashMap<String, Vec<String>>,
    at: Instant,
}

/// The kinds one group-version serves.
#[derive(Debug)]
struct GroupVersion {
    kinds: Vec<KindNames>,
    at: Instant,
}

type Discovered<T> = Result<Arc<T>, SourceError>;

/// Custom resources from a Kubernetes API server.
pub struct Kubernetes {
    client: kube::Client,
    allowed: Vec<KindRef>,
    /// The namespaces served (`--namespace`); empty: all.
    namespaces: Vec<String>,
    groups: FlightCache<(), Discovered<Groups>>,
    group_versions: FlightCache<String, Discovered<GroupVersion>>,
    resources: Mutex<HashMap<(String, String, String), ApiResource>>,
    /// The last discovery answers that worked, for when asking again fails. Only group-versions
    /// the API server served are kept, so invented ones cannot grow it.
    last_groups: Mutex<Option<Arc<Groups>>>,
    last_group_versions: Mutex<HashMap<String, Arc<GroupVersion>>>,
    discovery_ttl: Duration,
    recovery: Arc<Recovery>,
    /// The watches the API server refuses, by collection.
    refusals: Arc<crate::source::retry::Refusals>,
    /// Whether the client's connections are pinged (not known for a client made elsewhere).
    pinged: http::Pinged,
    granularity: Arc<granularity::Granularity>,
    /// What the client counts of its requests (nothing, for a client made elsewhere).
    api_requests: crate::telemetry::ApiRequests,
    /// Whether collections are listed by streaming (while the API server takes it).
    streaming: follow::Streaming,
    /// A client for the access layer's requests (pod lookups, token reviews), paced by a gate of
    /// its own: a flood of them the API server throttles never holds the watches.
    access_client: Option<kube::Client>,
}

/// A discovery answer with how long it may be served: `worked` when it worked, briefly when it
/// says the thing does not exist, not at all (beyond the requests already waiting) when the API
/// server failed.
fn ttl<T>(answer: &Discovered<T>, worked: Duration) -> Duration {
    match answer {
        Ok(_) => worked,
        Err(SourceError::UnknownKind(_)) => ABSENT_TTL,
        Err(_) => Duration::ZERO,
    }
}

impl Kubernetes {
    /// A source on `client`, serving the kinds `allowed` names (any kind, if empty).
    pub fn new(client: kube::Client, allowed: Vec<KindRef>) -> Self {
        let probing = client.clone();
        let recovery = Recovery::new(Arc::new(move || {
            let client = probing.clone();
            async move { client.apiserver_version().await.is_ok() }.boxed()
        }));
        Kubernetes {
            recovery,
            refusals: Arc::default(),
            pinged: http::Pinged::default(),
            client,
            allowed,
            namespaces: Vec::new(),
            groups: FlightCache::new(1),
            group_versions: FlightCache::new(DISCOVERY_CAPACITY),
            resources: Mutex::new(HashMap::new()),
            last_groups: Mutex::new(None),
            last_group_versions: Mutex::new(HashMap::new()),
            discovery_ttl: DISCOVERY_TTL,
            granularity: granularity::Granularity::new(DEFAULT_NAMESPACE_WATCH_THRESHOLD),
            api_requests: crate::telemetry::ApiRequests::default(),
            streaming: follow::Streaming::new(StreamingLists::Auto),
            access_client: None,
        }
    }

    /// As it is, listing namespaces and sets as `lists` says.
    pub fn with_streaming_lists(mut self, lists: StreamingLists) -> Self {
        self.streaming = follow::Streaming::new(lists);
        self
    }

    /// As it is, replacing the watches of more than `threshold` names of one kind in one
    /// namespace by one watch of the namespace (0: never), and going back below half of it.
    pub fn with_namespace_watch_threshold(mut self, threshold: usize) -> Self {
        self.granularity = granularity::Granularity::new(threshold);
        self
    }

    /// Names the namespace watches running now keep a channel for (ADR 0015): each one a name
    /// some subscription follows. For tests that look for growth.
    pub fn namespace_watch_names(&self) -> usize {
        self.granularity.followed()
    }

    /// As it is, serving only objects in `namespaces` (all, if empty), so that a Role in each
    /// grants the broker all it needs; cluster-scoped kinds are not served then.
    pub fn confined_to(mut self, namespaces: Vec<String>) -> Self {
        self.namespaces = namespaces;
        self
    }

    /// Refuses, without asking the API server, a namespace `--namespace` does not name.
    fn namespace_served(&self, namespace: Option<&str>) -> Result<(), SourceError> {
        match namespace {
            Some(crate::selector::ALL_NAMESPACES) if !self.namespaces.is_empty() => {
                Err(SourceError::NotAllowed(format!(
                    "this broker serves only some namespaces (--namespace {}), not every one",
                    self.namespaces.join(", ")
                )))
            }
            Some(ns) if !self.namespaces.is_empty() && !self.namespaces.iter().any(|n| n == ns) => {
                Err(SourceError::NotAllowed(format!(
                    "namespace {} is not served by this broker (--namespace serves: {})",
                    crate::selector::quote(ns),
                    self.namespaces.join(", ")
                )))
            }
            _ => Ok(()),
        }
    }

    /// As it is, with discovery answers trusted for `ttl` instead of [`DISCOVERY_TTL`].
    pub fn with_discovery_ttl(mut self, ttl: Duration) -> Self {
        self.discovery_ttl = ttl;
        self
    }

    /// A source on the client kube infers from the environment: `KUBECONFIG` (or
    /// `~/.kube/config`), else the in-cluster service account.
    /// `http2` says whether it may speak HTTP/2 to the API server; `rate` limits its requests.
    pub async fn infer(
        allowed: Vec<KindRef>,
        http2: ApiHttp2,
        rate: throttle::Rate,
    ) -> anyhow::Result<Self> {
        let mut config = kube::Config::infer().await?;
        config.read_timeout = Some(READ_TIMEOUT);
        let requests = crate::telemetry::ApiRequests::default();
        let (access, _) = http::client(config.clone(), http2, rate, requests.clone())?;
        let (client, pinged) = http::client(config, http2, rate, requests.clone())?;
        Ok(Kubernetes {
            api_requests: requests,
            pinged,
            access_client: Some(access),
            ..Self::new(client, allowed)
        })
    }

    /// The client.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// The client for the access layer's requests: one with a gate of its own where the source
    /// made its own clients ([`Kubernetes::infer`]), else the source's.
    pub fn access_client(&self) -> kube::Client {
        self.access_client
            .clone()
            .unwrap_or_else(|| self.client.clone())
    }

    /// As it is, knowing whether `client`'s connections are pinged, as [`http::client`] says.
    pub fn with_pinged(mut self, pinged: http::Pinged) -> Self {
        self.pinged = pinged;
        self
    }

    fn upstream(&self) -> follow::Upstream {
        follow::Upstream {
            recovery: self.recovery.clone(),
            refusals: self.refusals.clone(),
            pinged: self.pinged.clone(),
            expired: self.api_requests.expired.clone(),
            streaming: self.streaming.clone(),
        }
    }

    /// Refuses, without asking the API server, a kind whose group no `--resource` names.
    fn precheck(&self, kind: &KindRef) -> Result<(), SourceError> {
        if self.allowed.is_empty() || self.allowed.iter().any(|a| a.group == kind.group) {
            return Ok(());
        }
        Err(super::not_allowed(&kind.unversioned(), &self.allowed))
    }

    async fn discover(&self, kind: &KindRef) -> Result<(KindNames, String), SourceError> {
        self.precheck(kind)?;
        // The group list answers for groups and versions that do not exist, so invented ones
        // cost no request of their own.
        let versions = self.versions(&kind.group, kind.version.as_deref()).await?;
        let version = match &kind.version {
            Some(v) if versions.contains(v) => v.clone(),
            Some(v) => {
                return Err(SourceError::UnknownKind(format!(
                    "the API server serves no {}/{v} (it serves {}: {})",
                    kind.group,
                    kind.group,
                    versions.join(", ")
                )));
            }
            None => versions.first().cloned().ok_or_else(|| {
                SourceError::UnknownKind(format!("API group {} has no served version", kind.group))
            })?,
        };
        let group_version = format!("{}/{version}", kind.group);
        let mut listed = self.group_version(&group_version).await?;
        if !listed.kinds.iter().any(|n| n.answers_to(&kind.resource))
            && listed.at.elapsed() >= ABSENT_TTL
        {
            // Perhaps a CRD added a kind to this group-version since: ask again.
            self.group_versions.remove(&group_version);
            listed = self.group_version(&group_version).await?;
        }
        let names = listed
            .kinds
            .iter()
            .find(|n| n.answers_to(&kind.resource))
            .cloned()
            .ok_or_else(|| {
                let served: Vec<&str> = listed.kinds.iter().map(|n| n.plural.as_str()).collect();
                self.unknown(format!(
                    "the API server serves no resource {:?} in {group_version} (it serves: {})",
                    kind.resource,
                    served.join(", ")
                ))
            })?;
        let key = (kind.group.clone(), version.clone(), names.plural.clone());
        let mut resources = lock(&self.resources);
        // Built once per kind (a re-created CRD may have renamed its kind).
        if resources.get(&key).is_none_or(|r| r.kind != names.kind) {
            let resource = ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk(&kind.group, &version, &names.kind),
                &names.plural,
            );
            resources.insert(key, resource);
        }
        drop(resources);
        Ok((names, version))
    }

    /// That something is not served — unless the API server is down, and the answer that says
    /// so is only the last one it gave.
    fn unknown(&self, message: String) -> SourceError {
        if self.recovery.is_down() {
            SourceError::Unavailable(format!(
                "the API server cannot be reached, and the last discovery did not find it: {message}"
            ))
        } else {
            SourceError::UnknownKind(message)
        }
    }

    async fn group_version(&self, group_version: &str) -> Discovered<GroupVersion> {
        let last = lock(&self.last_group_versions).get(group_version).cloned();
        self.or_last(last, self.fetch_group_version(group_version), |last| {
            let mut lasts = lock(&self.last_group_versions);
            match last {
                Some(last) => lasts.insert(group_version.to_string(), last),
                None => lasts.remove(group_version),
            };
        })
        .await
    }

    async fn fetch_group_version(&self, group_version: &str) -> Discovered<GroupVersion> {
        let worked = self.discovery_ttl;
        let client = self.client.clone();
        let gv = group_version.to_string();
        self.group_versions
            .get(&gv.clone(), move || {
                async move {
                    let answer = bounded(client.list_api_group_resources(&gv)).await;
                    let answer = answer
                        .map_err(|e| match e {
                            DiscoveryError::Api(kube::Error::Api(s)) if s.code == 404 => {
                                SourceError::UnknownKind(format!("the API server serves no {gv}"))
                            }
                            e => e.into(),
                        })
                        .map(|list| {
                            let group = gv.split_once('/').map(|(g, _)| g).unwrap_or_default();
                            Arc::new(GroupVersion {
                                kinds: kind_names(group, &list),
                                at: Instant::now(),
                            })
                        });
                    let ttl = ttl(&answer, worked);
                    (answer, ttl)
                }
                .boxed()
            })
            .await
    }

    /// The versions `group` serves, the preferred first; the list is asked for again (at most
    /// once an [`ABSENT_TTL`]) when it lacks the group or the `wanted` version.
    async fn versions(
        &self,
        group: &str,
        wanted: Option<&str>,
    ) -> Result<Vec<String>, SourceError> {
        let mut groups = self.groups().await?;
        let lacks = |g: &Groups| {
            g.versions
                .get(group)
                .is_none_or(|v| wanted.is_some_and(|w| !v.iter().any(|x| x == w)))
        };
        if lacks(&groups) && groups.at.elapsed() >= ABSENT_TTL {
            // Perhaps a CRD made this group since: ask again.
            self.groups.remove(&());
            groups = self.groups().await?;
        }
        groups
            .versions
            .get(group)
            .cloned()
            .ok_or_else(|| self.unknown(format!("the API server serves no API group {group}")))
    }

    async fn groups(&self) -> Discovered<Groups> {
        let last = lock(&self.last_groups).clone();
        self.or_last(last, self.fetch_groups(), |last| {
            *lock(&self.last_groups) = last
        })
        .await
    }

    /// The answer `fetch` gives, or the `last` one that worked if the API server is down or
    /// fails to answer; `remember` keeps what is the last answer from now on. While the server
    /// is known to be down, the last answer serves at once, without asking. An outage does not
    /// make the kinds the server served unknown: the broker keeps resolving them, and serving
    /// the watches it holds.
    async fn or_last<T>(
        &self,
        last: Option<Arc<T>>,
        fetch: impl Future<Output = Discovered<T>>,
        remember: impl FnOnce(Option<Arc<T>>),
    ) -> Discovered<T> {
        if let Some(last) = &last
            && self.recovery.is_down()
        {
            return Ok(last.clone());
        }
        match fetch.await {
            Ok(worked) => {
                remember(Some(worked.clone()));
                Ok(worked)
            }
            Err(e) if e.is_outage() => {
                self.recovery.suspect();
                last.ok_or(e)
            }
            Err(e) => {
                remember(None);
                Err(e)
            }
        }
    }

    async fn fetch_groups(&self) -> Discovered<Groups> {
        let worked = self.discovery_ttl;
        let client = self.client.clone();
        self.groups
            .get(&(), move || {
                async move {
                    let answer = bounded(client.list_api_groups()).await.map_err(Into::into);
                    let answer = answer.map(|list| {
                        let versions = list
                            .groups
                            .iter()
                            .map(|g| {
                                let preferred = g.preferred_version.as_ref().map(|p| &p.version);
                                let mut versions: Vec<String> =
                                    preferred.into_iter().cloned().collect();
                                versions.extend(
                                    g.versions
                                        .iter()
                                        .map(|v| v.version.clone())
                                        .filter(|v| Some(v) != preferred),
                                );
                                (g.name.clone(), versions)
                            })
                            .collect();
                        Arc::new(Groups {
                            versions,
                            at: Instant::now(),
                        })
                    });
                    let ttl = ttl(&answer, worked);
                    (answer, ttl)
                }
                .boxed()
            })
            .await
    }

    fn api(&self, selector: &Selector) -> Api<DynamicObject> {
        let kind = &selector.kind;
        let version = kind.version.clone().unwrap_or_default();
        let resource = lock(&self.resources)
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

/// Whether the broker's own identity may `verb` `resource` in `group`, cluster-wide or in
/// `namespace` (a SelfSubjectAccessReview); `Err` says why not, for readiness.
pub async fn may(
    client: &kube::Client,
    verb: &str,
    group: &str,
    resource: &str,
    namespace: Option<&str>,
) -> Result<(), String> {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
    };
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                group: Some(group.to_string()),
                resource: Some(resource.to_string()),
                verb: Some(verb.to_string()),
                namespace: namespace.map(str::to_string),
                ..ResourceAttributes::default()
            }),
            ..SelfSubjectAccessReviewSpec::default()
        },
        ..SelfSubjectAccessReview::default()
    };
    let qualified = match (group, namespace) {
        ("", None) => resource.to_string(),
        ("", Some(ns)) => format!("{resource} in namespace {ns}"),
        (g, None) => format!("{resource}.{g}"),
        (g, Some(ns)) => format!("{resource}.{g} in namespace {ns}"),
    };
    let reviews: Api<SelfSubjectAccessReview> = Api::all(client.clone());
    let answer = reviews
        .create(&kube::api::PostParams::default(), &review)
        .await
        .map_err(|e| format!("asking whether the broker may {verb} {qualified}: {e}"))?;
    match answer.status {
        Some(status) if status.allowed => Ok(()),
        status => Err(format!(
            "the broker may not {verb} {qualified} ({})",
            status
                .and_then(|s| s.reason)
                .unwrap_or_else(|| "no reason given".into())
        )),
    }
}

/// A discovery request that failed or took too long.
#[derive(Debug)]
enum DiscoveryError {
    Api(kube::Error),
    Timeout,
}

impl From<DiscoveryError> for SourceError {
    fn from(error: DiscoveryError) -> Self {
        match error {
            DiscoveryError::Api(e) => api_error(e, "API discovery"),
            DiscoveryError::Timeout => SourceError::Unavailable(format!(
                "API discovery did not answer within {DISCOVERY_TIMEOUT:?}"
            )),
        }
    }
}

/// A discovery request, bounded by [`DISCOVERY_TIMEOUT`].
async fn bounded<T>(
    request: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, DiscoveryError> {
    match tokio::time::timeout(DISCOVERY_TIMEOUT, request).await {
        Ok(answer) => answer.map_err(DiscoveryError::Api),
        Err(_) => Err(DiscoveryError::Timeout),
    }
}

/// The kinds an `APIResourceList` describes (subresources left out).
fn kind_names(
    group: &str,
    list: &k8s_openapi::apimachinery::pkg::apis::meta::v1::APIResourceList,
) -> Vec<KindNames> {
    list.resources
        .iter()
        .filter(|r| !r.name.contains('/'))
        .map(|r| KindNames {
            group: group.to_string(),
            plural: r.name.clone(),
            singular: r.singular_name.clone(),
            kind: r.kind.clone(),
            short_names: r.short_names.clone().unwrap_or_default(),
            namespaced: r.namespaced,
        })
        .collect()
}

impl Source for Kubernetes {
    fn forget(&self, kind: &KindRef) {
        self.groups.remove(&());
        if let Some(version) = &kind.version {
            self.group_versions
                .remove(&format!("{}/{version}", kind.group));
        }
    }

    fn kinds(&self) -> Vec<String> {
        self.allowed.iter().map(KindRef::unversioned).collect()
    }

    fn api_requests(&self) -> Option<crate::telemetry::ApiRequests> {
        Some(self.api_requests.clone())
    }

    async fn resolve(&self, selector: &Selector) -> Result<Selector, SourceError> {
        self.namespace_served(selector.namespace.as_deref())?;
        let (names, version) = self.discover(&selector.kind).await?;
        if !names.namespaced && !self.namespaces.is_empty() {
            return Err(SourceError::NotAllowed(format!(
                "{}.{} is cluster-scoped, and this broker serves only namespaces (--namespace {})",
                names.plural,
                names.group,
                self.namespaces.join(", ")
            )));
        }
        names.canonical(selector, &version, &self.allowed)
    }

    /// The broker's rights, asked as it uses them: to list and watch each `--resource` kind
    /// cluster-wide, or, with `--namespace`, in each namespace — where a grant of some names
    /// only (a Role with `resourceNames`) counts, as per-object watches need no more.
    async fn check(&self) -> Result<(), String> {
        self.client.apiserver_version().await.map_err(|e| match e {
            kube::Error::Api(s) if s.code == 429 => {
                "the API server has no room for the broker's requests now (429 Too Many \
                     Requests)"
                    .to_string()
            }
            e => format!("the API server does not answer: {e}"),
        })?;
        let mut kinds = Vec::with_capacity(self.allowed.len());
        for kind in &self.allowed {
            let (names, _) = self
                .discover(kind)
                .await
                .map_err(|e| format!("--resource {kind}: {e}"))?;
            kinds.push(names);
        }
        if kinds.is_empty() {
            return Ok(());
        }
        if self.namespaces.is_empty() {
            for names in &kinds {
                for verb in ["list", "watch"] {
                    may(&self.client, verb, &names.group, &names.plural, None).await?;
                }
            }
            return Ok(());
        }
        for namespace in &self.namespaces {
            let rules = rights::rules_in(&self.client, namespace).await?;
            for names in &kinds {
                for verb in ["list", "watch"] {
                    if !rules.allow(verb, &names.group, &names.plural) {
                        may(
                            &self.client,
                            verb,
                            &names.group,
                            &names.plural,
                            Some(namespace),
                        )
                        .await?;
                    }
                }
            }
        }
        Ok(())
    }

    fn watch_set(&self, set: &Set) -> BoxStream<'static, SetEvent> {
        use futures::StreamExt;
        let labels = Some(set.labels.to_string()).filter(|l| !l.is_empty());
        let scope = Selector {
            namespace: set.scope().map(str::to_string),
            ..set.member("")
        };
        let events = follow::events(
            self.api(&scope),
            None,
            labels,
            set.to_string(),
            self.upstream(),
        );
        events
            .map(|event| match event {
                follow::Event::Listed { objects, .. } => SetEvent::Listed(objects),
                follow::Event::Applied { name, object, .. } => SetEvent::Applied(name, object),
                follow::Event::Deleted { name, .. } => SetEvent::Deleted(name),
                follow::Event::Failed(error) => SetEvent::Failed(error),
                follow::Event::Recovered { .. } => SetEvent::Recovered,
            })
            .boxed()
    }

    fn watch(&self, selector: &Selector) -> BoxStream<'static, Result<Observed, SourceError>> {
        let Some(namespace) = &selector.namespace else {
            return follow::follow(
                self.api(selector),
                &selector.name,
                selector.to_string(),
                self.upstream(),
            );
        };
        let kind = &selector.kind;
        self.granularity.watch(granularity::Watches {
            namespace: self.api(selector),
            name: selector.name.clone(),
            what: selector.to_string(),
            upstream: self.upstream(),
            key: (
                kind.group.clone(),
                kind.version.clone().unwrap_or_default(),
                kind.resource.clone(),
                namespace.clone(),
            ),
        })
    }
}
