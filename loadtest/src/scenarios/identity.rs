//! The cost of caller identity: the fan-out on two brokers at once, with `--identity none` and
//! `--identity peer-pod`, and the API requests identity makes for many sidecars on many pods.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;

use super::fanout::{FanoutRun, PROBES, drive, load};
use crate::Run;
use crate::clients;
use crate::fixtures::{bar, name, run_pod, serve, warm_every_watch};
use crate::target::Kind;

/// The cost of caller identity: the fan-out scenario on two brokers loaded at once, one with
/// `--identity none` and one with `--identity peer-pod` (every source address a pod), and the
/// API requests identity makes for many sidecars on many pod IPs.
#[derive(Debug, Clone, Serialize)]
pub struct Identity {
    /// Subscribers on each broker.
    pub subscribers: usize,
    /// Connections they share.
    pub connections: usize,
    /// Custom resources.
    pub crs: usize,
    /// Updates per second.
    pub rate: f64,
    /// Seconds of updates.
    pub seconds: f64,
    /// The broker with identity off.
    pub none: FanoutRun,
    /// The broker with `--identity peer-pod`.
    pub peer_pod: FanoutRun,
    /// Pod lookups the peer-pod broker made for all its connections and probes.
    pub pod_lookups: usize,
    /// Many sidecars on many pod IPs.
    pub cost: IdentityCost,
}

/// API requests for `sidecars` one-stream sidecars on `pod_ips` pods, with `--identity peer-pod`.
#[derive(Debug, Clone, Serialize)]
pub struct IdentityCost {
    /// Sidecars (one connection and one stream each).
    pub sidecars: usize,
    /// Pods (distinct source addresses) they run in.
    pub pod_ips: usize,
    /// Every sidecar connecting, a pod's sidecars together (as when pods start).
    pub by_pod: ConnectPhase,
    /// Every sidecar reconnecting once the lookup cache has expired, the pods' sidecars
    /// interleaved (as after a broker restart, each client on its own backoff): the worst case.
    pub interleaved: ConnectPhase,
    /// Sidecars refused.
    pub errors: usize,
}

/// One round of sidecars connecting, 256 at a time.
#[derive(Debug, Clone, Serialize)]
pub struct ConnectPhase {
    /// Seconds until all were served.
    pub seconds: f64,
    /// Pod lookups (LISTs of pods by IP) they caused.
    pub pod_lookups: usize,
    /// Every request the API server received meanwhile.
    pub api_requests: usize,
}

/// The identity scenario.
pub async fn identity(run: &Run) -> anyhow::Result<Identity> {
    let (subscribers, connections, crs) = (run.subscribers, run.connections, run.crs);
    let updates = (run.rate * run.duration.as_secs_f64()).round() as usize;
    let mut both = [
        load(
            run,
            Kind::Broker,
            &["--identity", "none"],
            subscribers,
            connections,
            crs,
            updates,
        )
        .await?,
        load(
            run,
            Kind::Broker,
            &["--identity", "peer-pod"],
            subscribers,
            connections,
            crs,
            updates,
        )
        .await?,
    ];
    drive(&mut both, updates, run.rate).await?;
    let [mut none, mut pod] = both;
    none.settle().await;
    pod.settle().await;
    for _ in 0..PROBES / 10 {
        none.probe(10).await;
        pod.probe(10).await;
        none.probe_new_connections(10, run.sources).await?;
        pod.probe_new_connections(10, run.sources).await?;
    }
    let pod_lookups = pod.fake.request_count("list", "/api/v1/pods") as usize;
    let (none, peer_pod) = (none.finish().await?, pod.finish().await?);
    Ok(Identity {
        subscribers,
        connections,
        crs,
        rate: run.rate,
        seconds: run.duration.as_secs_f64(),
        none,
        peer_pod,
        pod_lookups,
        cost: identity_cost(run).await?,
    })
}

/// The source address of pod `i`: 127.1.0.1, 127.1.0.2, … (250 to a /24).
fn pod_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 1, (i / 250) as u8, (i % 250 + 1) as u8)
}

async fn identity_cost(run: &Run) -> anyhow::Result<IdentityCost> {
    let (sidecars, pods, crs) = (run.sidecars, run.pod_ips.max(1), run.crs);
    let (fake, _dir, target) = serve(
        run,
        Kind::Broker,
        crs,
        Duration::from_secs(30),
        &["--identity", "peer-pod"],
    )
    .await?;
    let progress = bar(pods as u64, "identity: pods");
    for i in 0..pods {
        run_pod(&fake, &format!("pod-{i}"), &pod_ip(i).to_string())?;
        progress.inc(1);
    }
    progress.finish_and_clear();
    // Every watch warm, so the sidecars pay only for identity.
    let trigger = warm_every_watch(&target, crs).await?;
    let addr = target.grpc;
    let per_pod = sidecars.div_ceil(pods);
    // Sidecar i runs in pod `pod_of(i)`.
    let round = |pod_of: fn(usize, usize, usize) -> usize, what: &'static str| {
        let fake = &fake;
        async move {
            fake.clear_requests();
            let progress = bar(sidecars as u64, what);
            let started = Instant::now();
            let connected: Vec<_> = futures::stream::iter(0..sidecars)
                .map(|i| {
                    let progress = progress.clone();
                    let pod = pod_of(i, per_pod, pods);
                    async move {
                        let s = clients::sidecar(addr, pod_ip(pod), &name(i % crs)).await;
                        progress.inc(1);
                        s
                    }
                })
                .buffer_unordered(256)
                .collect()
                .await;
            progress.finish_and_clear();
            let phase = ConnectPhase {
                seconds: started.elapsed().as_secs_f64(),
                pod_lookups: fake.request_count("list", "/api/v1/pods") as usize,
                api_requests: fake.requests().len(),
            };
            (phase, connected)
        }
    };
    let (by_pod, first) = round(|i, per_pod, _| i / per_pod, "identity: sidecars by pod").await;
    let mut errors = first.iter().filter(|s| s.is_err()).count();
    drop(first);
    tokio::time::sleep(crd_broker::access::peer_pod::FOUND_TTL + Duration::from_millis(500)).await;
    let (interleaved, second) =
        round(|i, _, pods| i % pods, "identity: sidecars interleaved").await;
    errors += second.iter().filter(|s| s.is_err()).count();
    drop(second);
    trigger.stop();
    target.stop().await;
    Ok(IdentityCost {
        sidecars,
        pod_ips: pods,
        by_pod,
        interleaved,
        errors,
    })
}
