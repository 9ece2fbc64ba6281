//! The Kubernetes source: one shared kube-rs `Client`, discovery on first use (so a CRD
//! installed after start works without a restart), and one [`follow`] per resource — a LIST and
//! a WATCH with `fieldSelector=metadata.name=…`, retried with the broker's own backoff.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::stream::BoxStream;
use kube::api::{Api, DynamicObject};

use super::retry::Recovery;
use super::{Observed, SetEvent, Source, SourceError};
use crate::rights::{may, rules_in};
use crate::selector::{KindRef, Selector, Set};
use discovery::Discovery;

mod convert;
mod discovery;
mod follow;
mod granularity;
pub mod http;
mod requests;
pub mod throttle;

pub use discovery::{ABSENT_TTL, DISCOVERY_TTL};
pub use follow::StreamingLists;
pub use http::ApiHttp2;

/// Names of one kind watched in one namespace above which one namespace watch replaces theirs
/// (`--namespace-watch-threshold`; see ADR 0015 for the measurement behind it).
pub const DEFAULT_NAMESPACE_WATCH_THRESHOLD: usize = 100;

/// The read timeout of kube's own stack (used through a `proxy-url`): longer than the ~60 s
/// between the API server's bookmarks on a quiet watch, so idle watches are not cut, but
/// bounded, so a LIST that never answers is retried instead of hanging the watch forever
/// (kube's default is no read timeout). The broker's own stack bounds each request's answer
/// and each watch's silence instead.
pub const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// Custom resources from a Kubernetes API server.
pub struct Kubernetes {
    client: kube::Client,
    allowed: Vec<KindRef>,
    /// The namespaces served (`--namespace`); empty: all.
    namespaces: Vec<String>,
    discovery: Discovery,
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

impl Kubernetes {
    /// A source on `client`, serving the kinds `allowed` names (any kind, if empty).
    pub fn new(client: kube::Client, allowed: Vec<KindRef>) -> Self {
        let probing = client.clone();
        let recovery = Recovery::new(Arc::new(move || {
            let client = probing.clone();
            async move { client.apiserver_version().await.is_ok() }.boxed()
        }));
        Kubernetes {
            discovery: Discovery::new(client.clone(), allowed.clone(), recovery.clone()),
            recovery,
            refusals: Arc::default(),
            pinged: http::Pinged::default(),
            client,
            allowed,
            namespaces: Vec::new(),
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
        self.discovery.ttl = ttl;
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

    fn api(&self, selector: &Selector) -> Api<DynamicObject> {
        let resource = self.discovery.api_resource(&selector.kind);
        match &selector.namespace {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &resource),
            None => Api::all_with(self.client.clone(), &resource),
        }
    }
}

impl Source for Kubernetes {
    fn forget(&self, kind: &KindRef) {
        self.discovery.forget(kind);
    }

    fn kinds(&self) -> Vec<String> {
        self.allowed.iter().map(KindRef::unversioned).collect()
    }

    fn api_requests(&self) -> Option<crate::telemetry::ApiRequests> {
        Some(self.api_requests.clone())
    }

    async fn resolve(&self, selector: &Selector) -> Result<Selector, SourceError> {
        self.namespace_served(selector.namespace.as_deref())?;
        let (names, version) = self.discovery.discover(&selector.kind).await?;
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
                .discovery
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
            let rules = rules_in(&self.client, namespace).await?;
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
