//! `peer-pod`: a connection's peer IP → the Running pod whose `status.podIP` it is, by a list
//! of pods with that field selector (ADR 0011 says why a lookup and not a pods watch).
//!
//! A lookup's answer is cached per IP for a short while ([`FOUND_TTL`]), so that a storm of
//! connections from one pod costs one lookup, and it names the pod's UID, so that a reused IP is
//! recognised as a new pod once the entry has expired. A connection keeps the pod it was matched
//! to for its lifetime: a pod's connections end with its network namespace, so an open
//! connection cannot change hands.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::FutureExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};

use super::caller::{PodRef, Workload};
use crate::cache::FlightCache;

/// How long a found pod is trusted for new connections from its IP. A new pod on a reused IP
/// is recognised at most this long (plus a lookup) after the last lookup.
pub const FOUND_TTL: Duration = Duration::from_secs(3);

/// How long "no pod has this IP" is trusted: the kubelet reports a new pod's IP a moment after
/// its containers start, and a client that connects before then retries.
pub const NOBODY_TTL: Duration = Duration::from_secs(1);

/// How many IPs the cache holds.
const CAPACITY: usize = 100_000;

/// The longest a lookup may take.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);

/// What a lookup found.
#[derive(Debug, Clone, PartialEq)]
pub enum Found {
    /// Exactly one Running pod, not terminating, not on the host network, has the IP.
    Pod(Workload),
    /// Nobody: why.
    Nobody(String),
    /// The lookup failed: why.
    Failed(String),
}

/// Pod lookups by IP, cached.
pub struct PeerPods {
    client: kube::Client,
    cache: FlightCache<IpAddr, Found>,
    lookups: Arc<AtomicU64>,
}

impl PeerPods {
    /// Lookups through `client`.
    pub fn new(client: kube::Client) -> Self {
        PeerPods {
            client,
            cache: FlightCache::new(CAPACITY),
            lookups: Arc::default(),
        }
    }

    /// Lookups made so far (API requests).
    pub fn lookups(&self) -> u64 {
        self.lookups.load(Ordering::Relaxed)
    }

    /// The pod behind `ip`.
    pub async fn find(&self, ip: IpAddr) -> Found {
        let client = self.client.clone();
        let lookups = self.lookups.clone();
        self.cache
            .get(&ip, move || {
                async move {
                    lookups.fetch_add(1, Ordering::Relaxed);
                    let found = lookup(client, ip).await;
                    let ttl = match &found {
                        Found::Pod(_) => FOUND_TTL,
                        Found::Nobody(_) => NOBODY_TTL,
                        Found::Failed(_) => Duration::ZERO,
                    };
                    (found, ttl)
                }
                .boxed()
            })
            .await
    }
}

async fn lookup(client: kube::Client, ip: IpAddr) -> Found {
    let pods: Api<Pod> = Api::all(client);
    let params = ListParams::default().fields(&format!("status.podIP={ip}"));
    let listed = match tokio::time::timeout(LOOKUP_TIMEOUT, pods.list(&params)).await {
        Ok(Ok(list)) => list.items,
        Ok(Err(kube::Error::Api(s))) => {
            tracing::warn!(%ip, code = s.code, message = %s.message, "looking up the pod of a peer");
            return Found::Failed(format!("the pod lookup failed ({} {})", s.code, s.reason));
        }
        Ok(Err(e)) => return Found::Failed(format!("the pod lookup failed ({e})")),
        Err(_) => {
            return Found::Failed(format!(
                "the pod lookup did not answer within {LOOKUP_TIMEOUT:?}"
            ));
        }
    };
    identify(ip, &listed)
}

/// The pod `pods` (those whose `status.podIP` is `ip`) make the caller, by the rules: Running,
/// not being deleted, not on the host network (whose IP is the node's, shared by many pods),
/// and exactly one.
pub fn identify(ip: IpAddr, pods: &[Pod]) -> Found {
    let running: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    if running
        .iter()
        .any(|p| p.spec.as_ref().and_then(|s| s.host_network) == Some(true))
    {
        return Found::Nobody(format!(
            "{ip} is a node's IP (host-network pods have it), which identifies nobody"
        ));
    }
    match running.as_slice() {
        [] => Found::Nobody(format!("no running pod has IP {ip}")),
        [pod] => {
            let meta = &pod.metadata;
            let service_account = pod
                .spec
                .as_ref()
                .and_then(|s| s.service_account_name.clone())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "default".to_string());
            match (&meta.namespace, &meta.name, &meta.uid) {
                (Some(namespace), Some(name), Some(uid)) => Found::Pod(Workload {
                    namespace: namespace.clone(),
                    service_account,
                    pod: Some(PodRef {
                        name: name.clone(),
                        uid: uid.clone(),
                    }),
                    instance: None,
                }),
                _ => Found::Nobody(format!(
                    "the pod with IP {ip} has no namespace, name or uid"
                )),
            }
        }
        several => {
            let names: Vec<String> = several
                .iter()
                .take(3)
                .map(|p| {
                    format!(
                        "{}/{}",
                        p.metadata.namespace.as_deref().unwrap_or_default(),
                        p.metadata.name.as_deref().unwrap_or_default()
                    )
                })
                .collect();
            Found::Nobody(format!(
                "{} running pods have IP {ip} ({}…), which identifies none of them",
                several.len(),
                names.join(", ")
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": { "name": name, "namespace": "team-a", "uid": format!("uid-{name}") },
            "spec": { "serviceAccountName": "web", "containers": [] },
            "status": { "phase": phase, "podIP": "10.0.0.5" },
        }))
        .unwrap()
    }

    fn on_host(mut p: Pod) -> Pod {
        p.spec.as_mut().unwrap().host_network = Some(true);
        p
    }

    fn ip() -> IpAddr {
        "10.0.0.5".parse().unwrap()
    }

    #[test]
    fn one_running_pod_is_the_caller() {
        let found = identify(ip(), &[pod("old", "Succeeded"), pod("web-1", "Running")]);
        let Found::Pod(w) = found else {
            panic!("{found:?}")
        };
        assert_eq!(
            (w.namespace.as_str(), w.service_account.as_str()),
            ("team-a", "web")
        );
        assert_eq!(w.pod.unwrap().uid, "uid-web-1");
    }

    #[test]
    fn host_network_terminating_ambiguous_and_pending_pods_identify_nobody() {
        let mut terminating = pod("t", "Running");
        terminating.metadata.deletion_timestamp =
            Some(serde_json::from_value(json!("2026-01-01T00:00:00Z")).unwrap());
        let cases = [
            vec![on_host(pod("h", "Running"))],
            vec![on_host(pod("h", "Running")), pod("p", "Running")],
            vec![terminating],
            vec![pod("a", "Running"), pod("b", "Running")],
            vec![pod("p", "Pending")],
            vec![],
        ];
        for pods in cases {
            assert!(
                matches!(identify(ip(), &pods), Found::Nobody(_)),
                "{:?}",
                pods.iter()
                    .map(|p| p.metadata.name.clone())
                    .collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn a_pod_without_a_service_account_name_runs_as_default() {
        let mut p = pod("web-1", "Running");
        p.spec.as_mut().unwrap().service_account_name = None;
        let Found::Pod(w) = identify(ip(), &[p]) else {
            panic!()
        };
        assert_eq!(w.service_account, "default");
    }
}
