//! API discovery: which kinds the API server serves, under which names and versions, asked
//! once per [`DISCOVERY_TTL`] for every resolution and kept for when asking fails.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use kube::core::{ApiResource, GroupVersionKind};
use tokio::time::Instant;

use super::convert::api_error;
use crate::cache::FlightCache;
use crate::selector::KindRef;
use crate::source::retry::Recovery;
use crate::source::{KindNames, SourceError};
use crate::sync::lock;

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

/// Discovery's answers, remembered.
pub(super) struct Discovery {
    client: kube::Client,
    /// The kinds `--resource` serves (any kind, if empty).
    allowed: Vec<KindRef>,
    recovery: Arc<Recovery>,
    groups: FlightCache<(), Discovered<Groups>>,
    group_versions: FlightCache<String, Discovered<GroupVersion>>,
    resources: Mutex<HashMap<(String, String, String), ApiResource>>,
    /// The last discovery answers that worked, for when asking again fails. Only group-versions
    /// the API server served are kept, so invented ones cannot grow it.
    last_groups: Mutex<Option<Arc<Groups>>>,
    last_group_versions: Mutex<HashMap<String, Arc<GroupVersion>>>,
    /// How long an answer that worked is trusted.
    pub(super) ttl: Duration,
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

impl Discovery {
    /// Discovery through `client` for the kinds `allowed` names; `recovery` says whether the
    /// API server is down.
    pub(super) fn new(
        client: kube::Client,
        allowed: Vec<KindRef>,
        recovery: Arc<Recovery>,
    ) -> Self {
        Discovery {
            client,
            allowed,
            recovery,
            groups: FlightCache::new(1),
            group_versions: FlightCache::new(DISCOVERY_CAPACITY),
            resources: Mutex::new(HashMap::new()),
            last_groups: Mutex::new(None),
            last_group_versions: Mutex::new(HashMap::new()),
            ttl: DISCOVERY_TTL,
        }
    }

    /// Forgets what was discovered about `kind`'s group (its CRD changed).
    pub(super) fn forget(&self, kind: &KindRef) {
        self.groups.remove(&());
        if let Some(version) = &kind.version {
            self.group_versions
                .remove(&format!("{}/{version}", kind.group));
        }
    }

    /// The API resource of a resolved `kind`, as discovery built it (named by its plural where
    /// discovery has not seen it).
    pub(super) fn api_resource(&self, kind: &KindRef) -> ApiResource {
        let version = kind.version.clone().unwrap_or_default();
        lock(&self.resources)
            .get(&(kind.group.clone(), version.clone(), kind.resource.clone()))
            .cloned()
            .unwrap_or_else(|| {
                ApiResource::from_gvk_with_plural(
                    &GroupVersionKind::gvk(&kind.group, &version, ""),
                    &kind.resource,
                )
            })
    }

    /// Refuses, without asking the API server, a kind whose group no `--resource` names.
    fn precheck(&self, kind: &KindRef) -> Result<(), SourceError> {
        if self.allowed.is_empty() || self.allowed.iter().any(|a| a.group == kind.group) {
            return Ok(());
        }
        Err(crate::source::not_allowed(
            &kind.unversioned(),
            &self.allowed,
        ))
    }

    pub(super) async fn discover(
        &self,
        kind: &KindRef,
    ) -> Result<(KindNames, String), SourceError> {
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
        let worked = self.ttl;
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
        let worked = self.ttl;
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
