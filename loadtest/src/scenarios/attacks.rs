//! The attacks a review found (issue "Close what a review found"), each against a broker with its
//! defaults but for the settings named: what one caller can make the broker and the API server
//! hold. Only settings every build knows are passed as flags, and newer ones as environment
//! variables an older build ignores, so that the same command measures a build before a fix and
//! after it (`--broker-bin`).

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::Context;

use crd_broker::pb;
use crd_broker::pb::broker_client::BrokerClient;
use fake_apiserver::{FakeApiServer, TokenUser};
use futures::StreamExt;
use serde::Serialize;
use serde_json::json;
use tonic::transport::Channel;

use crate::Run;
use crate::clients;
use crate::fixtures::{self, name};
use crate::stats::{Histogram, Summary};
use crate::target::{Log, Target};

/// Every attack's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Attacks {
    /// One caller cycling distinct set selectors under `--max-watches 50`.
    pub set_cycles: Vec<Cycle>,
    /// One caller cycling one name in each of many namespaces, with the default limits.
    pub namespace_cycles: Vec<Cycle>,
    /// Random bearer tokens from one address under `--identity token`.
    pub token_flood: TokenFlood,
    /// Subscribers of a large set that never read.
    pub stalled_set: StalledSet,
    /// Made-up names in one namespace, subscribed and left, round after round.
    pub cycled_names: CycledNames,
    /// Distinct set selectors over one namespace of large objects, each selecting all of them.
    pub overlapping_sets: OverlappingSets,
    /// Many xDS streams on one broker, and one change of its Service's EndpointSlice.
    pub xds_fanout: XdsFanout,
    /// New connections from a mesh proxy's address, each with random bearer tokens, while the
    /// API server answers TokenReviews with 429.
    pub proxy_token_flood: ProxyTokenFlood,
    /// The broker's RBAC taken away, on a real control plane, while it watches FeatureFlags
    /// one per namespace.
    pub rbac_revoked: RbacRevoked,
}

/// A broker watching one FeatureFlag in each of many namespaces on a real kube-apiserver, its
/// ClusterRoleBinding deleted and created again.
#[derive(Debug, Clone, Serialize)]
pub struct RbacRevoked {
    /// Watched FeatureFlags (one per namespace).
    pub crs: usize,
    /// How long the RBAC stayed away.
    pub revoked_seconds: f64,
    /// The broker's requests to the API server a second while it did (its own count).
    pub requests_per_second: f64,
    /// The same over the second half of that time, once refusals have lasted.
    pub later_requests_per_second: f64,
    /// What a new subscriber to a warm FeatureFlag got meanwhile: the cached object
    /// (`snapshot`), or a refusal (its code).
    pub new_subscriber: String,
    /// Seconds from the binding's return until no watch was stale any more.
    pub recovery_seconds: f64,
}

/// xDS streams of the endpoints on one broker (`--xds-service`), and one change of the
/// Service's EndpointSlice.
#[derive(Debug, Clone, Serialize)]
pub struct XdsFanout {
    /// Streams.
    pub streams: usize,
    /// Over this many connections.
    pub connections: usize,
    /// Seconds from the slice's change until every stream had the new endpoints.
    pub change_to_all_seconds: f64,
    /// Per stream: the change's arrival, p50 / p99.
    pub change: Summary,
    /// Streams that did not get the change within 60 s.
    pub missed: usize,
    /// Broker CPU seconds from the change until every stream had it.
    pub cpu_seconds: f64,
    /// Broker memory before the streams.
    pub rss_before_bytes: u64,
    /// With them open.
    pub rss_streams_bytes: u64,
}

/// New connections a second from one proxy address, each sending random bearer tokens.
#[derive(Debug, Clone, Serialize)]
pub struct ProxyTokenFlood {
    /// Connections opened.
    pub connections: usize,
    /// Tokens each sent.
    pub tokens_per_connection: usize,
    /// Seconds it lasted.
    pub seconds: f64,
    /// TokenReviews the API server saw.
    pub token_reviews: usize,
    /// A valid caller's first message during the flood, p50 / p99.
    pub valid: Summary,
    /// Its subscribes that failed.
    pub valid_failures: u64,
    /// A FeatureFlag written every 200 ms during the flood: write to delivery on a warm
    /// watch, p50 / p99.
    pub delivery: Summary,
    /// A resource nobody watched yet, asked for every 200 ms during the flood: its first
    /// message (a new LIST and WATCH), p50 / p99.
    pub cold_first: Summary,
    /// Cold subscribes that failed or took over 10 s.
    pub cold_failures: u64,
}

/// One caller subscribing to distinct selectors that each select a whole namespace of large
/// FeatureFlags (`!x0`, `!x1`, …), each stream read to its first message and left (its set
/// lingers), as fast as the broker admits them.
#[derive(Debug, Clone, Serialize)]
pub struct OverlappingSets {
    /// The namespace's FeatureFlags.
    pub members: usize,
    /// Each one's size.
    pub member_bytes: usize,
    /// Selectors asked for.
    pub attempted: usize,
    /// Selectors admitted (the first message came).
    pub admitted: usize,
    /// Why the attack stopped before it had asked for every selector, if it did.
    pub stopped: Option<String>,
    /// How long it ran.
    pub seconds: f64,
    /// LISTs of the namespace the API server served.
    pub api_lists: usize,
    /// The most WATCHes open on the API server at once, sampled.
    pub api_watches_peak: usize,
    /// Broker memory before.
    pub rss_before_bytes: u64,
    /// The most it held, sampled.
    pub rss_peak_bytes: u64,
    /// Once the attacker's sets lingered out.
    pub rss_after_bytes: u64,
    /// Whether another caller (127.0.0.9) got a FeatureFlag while the attack ran, and its
    /// first-message latency.
    pub other_caller_served: bool,
    /// The other caller's first message, p50 / p99.
    pub other_caller: Summary,
}

/// One caller opening streams one after another on one connection, each read to its first
/// message and dropped.
#[derive(Debug, Clone, Serialize)]
pub struct Cycle {
    /// The caller's address.
    pub from: String,
    /// Streams it asked for.
    pub attempted: usize,
    /// Streams the broker admitted.
    pub admitted: usize,
    /// API watches open on the API server once it is done (the broker's linger holds them).
    pub api_watches_after: usize,
    /// Watches the broker lists in `/debug/watches` then.
    pub broker_watches_after: usize,
    /// Whether another caller (127.0.0.9) then got a FeatureFlag that exists.
    pub other_caller_served: bool,
}

/// Random bearer tokens from one address.
#[derive(Debug, Clone, Serialize)]
pub struct TokenFlood {
    /// Tokens sent.
    pub tokens: usize,
    /// TokenReviews the API server saw during the flood.
    pub token_reviews: usize,
    /// How long the flood took.
    pub flood_seconds: f64,
    /// Broker memory before and after.
    pub rss_before_bytes: u64,
    /// After.
    pub rss_after_bytes: u64,
    /// A valid caller's first-message latency before the flood.
    pub valid_before: Summary,
    /// The same caller's, during the flood.
    pub valid_during: Summary,
    /// The valid caller's subscribes that failed during the flood.
    pub valid_failures: u64,
    /// TokenReviews the valid caller's next subscribe cost after the flood (0: its token was
    /// still cached).
    pub valid_reviews_after: usize,
}

/// Subscribers of a large set that never read.
#[derive(Debug, Clone, Serialize)]
pub struct StalledSet {
    /// The set's members.
    pub members: usize,
    /// Each member's size.
    pub member_bytes: usize,
    /// Its subscribers.
    pub subscribers: usize,
    /// Broker memory before they came.
    pub rss_before_bytes: u64,
    /// While they stall.
    pub rss_stalled_bytes: u64,
    /// After they left and the set's watch lingered out.
    pub rss_after_bytes: u64,
    /// While as many stall again, and after they leave, round after round: what the first
    /// round left is reused, not added to.
    pub rss_later_rounds_bytes: Vec<(u64, u64)>,
    /// Watches the broker lists once they left (the set's lingered out).
    pub watches_after: usize,
}

/// Made-up names cycled.
#[derive(Debug, Clone, Serialize)]
pub struct CycledNames {
    /// Names per round (new ones each round).
    pub names: usize,
    /// Broker memory after the first rounds, which are not counted: the allocator's arenas
    /// grow to their working size over them (24 rounds measured here stayed flat after three).
    pub rss_after_warmup_bytes: u64,
    /// Broker memory after each round, once its watches lingered out.
    pub rss_after_round_bytes: Vec<u64>,
    /// (last − first) ÷ first, in percent.
    pub growth_percent: f64,
    /// (highest − lowest) ÷ lowest, in percent.
    pub spread_percent: f64,
    /// The least-squares trend over the rounds (slope × (rounds − 1)) ÷ the mean, in percent:
    /// growth, with the allocator's round-to-round noise averaged out.
    pub trend_percent: f64,
}

/// How big each attack is.
struct Sizes {
    rbac_crs: usize,
    rbac_for: Duration,
    xds_streams: usize,
    flood_connections: usize,
    overlapping: usize,
    overlap_members: usize,
    sets: usize,
    namespaces: usize,
    tokens: usize,
    set_members: usize,
    member_bytes: usize,
    stalled: usize,
    names: usize,
    rounds: usize,
}

impl Sizes {
    fn of(run: &Run) -> Sizes {
        if run.smoke {
            Sizes {
                rbac_crs: 20,
                rbac_for: Duration::from_secs(10),
                xds_streams: 50,
                flood_connections: 20,
                overlapping: 40,
                overlap_members: 10,
                sets: 20,
                namespaces: 40,
                tokens: 200,
                set_members: 10,
                member_bytes: 10_000,
                stalled: 5,
                names: 200,
                rounds: 2,
            }
        } else {
            Sizes {
                rbac_crs: 5_000,
                rbac_for: Duration::from_secs(60),
                xds_streams: 10_000,
                flood_connections: 1_000,
                overlapping: 2_500,
                overlap_members: 200,
                sets: 500,
                namespaces: 2_000,
                tokens: 5_000,
                set_members: 200,
                member_bytes: 50_000,
                stalled: 200,
                names: 5_000,
                rounds: 8,
            }
        }
    }
}

const ATTACKER_ADDRESSES: [Ipv4Addr; 2] =
    [Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::new(127, 0, 0, 2)];
const OTHER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 9);
const AUDIENCE: &str = "crd-broker";

/// Every attack, one after another, each on a fresh fake API server and broker.
pub async fn attacks(run: &Run) -> anyhow::Result<Attacks> {
    let sizes = Sizes::of(run);
    let mut set_cycles = Vec::new();
    let mut namespace_cycles = Vec::new();
    for from in ATTACKER_ADDRESSES {
        set_cycles.push(set_cycle(run, from, sizes.sets).await?);
        namespace_cycles.push(namespace_cycle(run, from, sizes.namespaces).await?);
    }
    Ok(Attacks {
        set_cycles,
        namespace_cycles,
        token_flood: token_flood(run, sizes.tokens).await?,
        stalled_set: stalled_set(run, &sizes).await?,
        cycled_names: cycled_names(run, sizes.names, sizes.rounds).await?,
        overlapping_sets: overlapping_sets(run, &sizes).await?,
        xds_fanout: xds_fanout(run, sizes.xds_streams).await?,
        proxy_token_flood: proxy_token_flood(run, sizes.flood_connections).await?,
        rbac_revoked: rbac_revoked(run, &sizes).await?,
    })
}

/// The broker's requests to the API server so far, by its own count.
async fn api_requests(target: &Target) -> f64 {
    let admin = target.admin.expect("an admin port");
    let Ok((_, body)) = fixtures::get(admin, "/metrics").await else {
        return 0.0;
    };
    body.lines()
        .filter(|l| l.starts_with("crd_broker_api_requests_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Watches the broker lists as stale (their source's last report an error).
async fn stale_watches(target: &Target) -> usize {
    let admin = target.admin.expect("an admin port");
    let Ok((_, body)) = fixtures::get(admin, "/debug/watches").await else {
        return usize::MAX;
    };
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    listed["watches"].as_array().map_or(usize::MAX, |w| {
        w.iter().filter(|w| !w["staleSince"].is_null()).count()
    })
}

/// On a real control plane: `sizes.rbac_crs` namespaces with a FeatureFlag each, a broker
/// reading them through a ClusterRoleBinding, and a subscriber of every one; the binding is
/// deleted, kube-apiserver restarted (so that every watch asks again), and the broker's requests
/// counted for `sizes.rbac_for`; then the binding is created again.
async fn rbac_revoked(run: &Run, sizes: &Sizes) -> anyhow::Result<RbacRevoked> {
    use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
    use kube::core::{ApiResource, GroupVersionKind};
    let crs = sizes.rbac_crs;
    let plane = fixtures::own_plane().await?;
    let crd: serde_json::Value =
        serde_saphyr::from_str(fixtures::CRD).context("the FeatureFlag CRD")?;
    plane.install_crds(&[crd]).await;
    let binding = json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": { "name": "broker-reads-all" },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "featureflag-reader" },
        "subjects": [{ "kind": "ServiceAccount", "name": "broker", "namespace": "default" }] });
    plane
        .apply(&[
            json!({ "apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": { "name": "broker", "namespace": "default" } }),
            json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": { "name": "featureflag-reader" },
                "rules": [{ "apiGroups": ["core.openfeature.dev"], "resources": ["featureflags"],
                    "verbs": ["get", "list", "watch"] }] }),
            binding.clone(),
        ])
        .await;
    let namespace = |k: usize| format!("app-{k}");
    let admin = plane.admin().await;
    let kind =
        |group: &str, kind: &str| ApiResource::from_gvk(&GroupVersionKind::gvk(group, "v1", kind));
    let namespaces: Api<DynamicObject> = Api::all_with(admin.clone(), &kind("", "Namespace"));
    futures::stream::iter(0..crs)
        .for_each_concurrent(16, |k| {
            let (plane, namespaces) = (&plane, namespaces.clone());
            async move {
                let ns = serde_json::from_value(json!({ "apiVersion": "v1", "kind": "Namespace",
                    "metadata": { "name": namespace(k) } }))
                .expect("a namespace");
                let _ = namespaces.create(&PostParams::default(), &ns).await;
                let mut flag = fixtures::flag("f", 256);
                flag["metadata"]["namespace"] = json!(namespace(k));
                plane.apply(&[flag]).await;
            }
        })
        .await;
    let dir = fixtures::tempfile_like::Dir::new()?;
    let kubeconfig = plane
        .kubeconfig_for("default", "broker", dir.path(), &plane.server)
        .await;
    let bin = crate::target::broker_bin(run.broker_bin.clone())?;
    // One subscriber stands for a pod of each namespace: no per-caller limit is meant to bind.
    let unlimited = crate::target::UNLIMITED;
    let target = Target::launch(&bin, &kubeconfig, &unlimited, &[], Log::Null).await?;
    wait_ready(&target).await?;
    // Every FeatureFlag subscribed, 100 to a stream, each stream held.
    let channel = clients::connection_from(target.grpc, Ipv4Addr::new(127, 0, 0, 2)).await?;
    let mut streams = Vec::new();
    for batch in (0..crs).collect::<Vec<_>>().chunks(100) {
        let request = pb::SubscribeRequest {
            resources: batch
                .iter()
                .map(|&k| resource(&namespace(k), "f"))
                .collect(),
        };
        let mut stream = BrokerClient::new(channel.clone())
            .subscribe(request)
            .await?
            .into_inner();
        for _ in batch {
            tokio::time::timeout(Duration::from_secs(60), stream.message())
                .await
                .context("a first message")??;
        }
        streams.push(stream);
    }
    let bindings: Api<DynamicObject> = Api::all_with(
        admin.clone(),
        &kind("rbac.authorization.k8s.io", "ClusterRoleBinding"),
    );
    bindings
        .delete("broker-reads-all", &DeleteParams::default())
        .await?;
    // The API server does not end the watches it serves when rights go: a restart (as a
    // rollout of the API server would) makes every watch ask again, and be refused.
    tokio::time::sleep(Duration::from_secs(2)).await;
    plane
        .stop(control_plane::Component::ApiServer, "KILL")
        .await;
    plane.start_again(control_plane::Component::ApiServer).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (before, started) = (api_requests(&target).await, Instant::now());
    tokio::time::sleep(sizes.rbac_for / 2).await;
    let (half, halfway) = (api_requests(&target).await, Instant::now());
    tokio::time::sleep(sizes.rbac_for / 2).await;
    let now = api_requests(&target).await;
    let (requests, later) = (now - before, now - half);
    let later_requests_per_second = later / halfway.elapsed().as_secs_f64();
    let revoked_seconds = started.elapsed().as_secs_f64();
    let mut newcomer = BrokerClient::new(
        clients::connection_from(target.grpc, Ipv4Addr::new(127, 0, 0, 3)).await?,
    );
    let new_subscriber = match newcomer.subscribe(one(&namespace(0), "f")).await {
        Ok(response) => match response.into_inner().message().await {
            Ok(Some(m)) if m.event() == pb::subscribe_response::Event::Snapshot => {
                "snapshot".into()
            }
            Ok(Some(m)) => format!("{:?}", m.event()),
            Ok(None) => "nothing".into(),
            Err(status) => format!("{:?}", status.code()),
        },
        Err(status) => format!("{:?}", status.code()),
    };
    bindings
        .create(&PostParams::default(), &serde_json::from_value(binding)?)
        .await?;
    let restored = Instant::now();
    while stale_watches(&target).await > 0 && restored.elapsed() < Duration::from_secs(300) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let recovery_seconds = restored.elapsed().as_secs_f64();
    drop(streams);
    target.stop().await;
    drop(plane);
    Ok(RbacRevoked {
        crs,
        revoked_seconds,
        requests_per_second: requests / revoked_seconds,
        later_requests_per_second,
        new_subscriber,
        recovery_seconds,
    })
}

const ENDPOINTS_TYPE: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// `streams` xDS streams of the endpoints of `crd-broker.default`, 100 to a connection, each
/// answered and ACKed; then a fourth address joins the Service's EndpointSlice, and each
/// stream's next response is timed from the write.
async fn xds_fanout(run: &Run, streams: usize) -> anyhow::Result<XdsFanout> {
    use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    const PORT: u16 = 8013;
    let service = format!("crd-broker.default:{PORT}");
    let address = |last: u8| Ipv4Addr::new(10, 0, 0, last);
    let (fake, _dir, target) = broker(run, 1, &["--xds-service", &service], &[]).await?;
    fake.apply(control_plane::endpoints::endpoint_slice_kind())?;
    let slice = |n: u8| {
        let ips: Vec<Ipv4Addr> = (1..=n).map(address).collect();
        control_plane::endpoints::endpoint_slice("default", "crd-broker", PORT, &ips, &[])
    };
    fake.apply(slice(3))?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_before = target.rss();
    let connections = streams.div_ceil(100);
    let mut channels = Vec::with_capacity(connections);
    for i in 0..connections {
        let from = Ipv4Addr::new(127, 0, 3, 1 + (i % 250) as u8);
        channels.push(clients::connection_from(target.grpc, from).await?);
    }
    // When the change was written (ns since `epoch`), and when each stream had it.
    let epoch = Instant::now();
    let written = Arc::new(AtomicU64::new(u64::MAX));
    let arrivals = Arc::new(Histogram::default());
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel::<()>(streams.max(1));
    let (got_tx, mut got_rx) = tokio::sync::mpsc::channel::<Duration>(streams.max(1));
    let (trigger, stop) = clients::tokio_util_like::signal();
    let stop = std::sync::Arc::new(stop);
    for i in 0..streams {
        let channel = channels[i % connections].clone();
        let (cluster, ready_tx, got_tx) = (service.clone(), ready_tx.clone(), got_tx.clone());
        let (written, stop) = (written.clone(), stop.clone());
        tokio::spawn(async move {
            let (tx, requests) = tokio::sync::mpsc::channel::<DiscoveryRequest>(4);
            let ask = |version: String, nonce: String| DiscoveryRequest {
                type_url: ENDPOINTS_TYPE.into(),
                resource_names: vec![cluster.clone()],
                version_info: version,
                response_nonce: nonce,
                ..Default::default()
            };
            let follow = async {
                tx.send(ask(String::new(), String::new())).await.ok()?;
                let mut responses = AggregatedDiscoveryServiceClient::new(channel)
                    .stream_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(
                        requests,
                    ))
                    .await
                    .ok()?
                    .into_inner();
                let first = responses.message().await.ok()??;
                tx.send(ask(first.version_info, first.nonce)).await.ok()?;
                ready_tx.send(()).await.ok()?;
                let next = responses.message().await.ok()??;
                let at = epoch.elapsed();
                let since =
                    at.saturating_sub(Duration::from_nanos(written.load(Ordering::Acquire)));
                got_tx.send(since).await.ok()?;
                tx.send(ask(next.version_info, next.nonce)).await.ok()?;
                // Held open until the attack is done.
                stop.wait().await;
                Some(())
            };
            follow.await;
        });
    }
    drop((ready_tx, got_tx));
    let mut ready = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    while ready < streams && Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(5), ready_rx.recv()).await {
            Ok(Some(())) => ready += 1,
            Ok(None) => break,
            Err(_) => {}
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_streams = target.rss();
    let cpu_before = target.cpu();
    written.store(epoch.elapsed().as_nanos() as u64, Ordering::Release);
    fake.apply(slice(4))?;
    let changed_at = Instant::now();
    let mut got = 0;
    while got < ready {
        match tokio::time::timeout(Duration::from_secs(60), got_rx.recv()).await {
            Ok(Some(since)) => {
                arrivals.record(since);
                got += 1;
            }
            _ => break,
        }
    }
    let change_to_all = changed_at.elapsed().as_secs_f64();
    let cpu = target.cpu().saturating_sub(cpu_before).as_secs_f64();
    trigger.stop();
    target.stop().await;
    Ok(XdsFanout {
        streams,
        connections,
        change_to_all_seconds: change_to_all,
        change: arrivals.summary(),
        missed: streams - got,
        cpu_seconds: cpu,
        rss_before_bytes: rss_before,
        rss_streams_bytes: rss_streams,
    })
}

/// Istio's inbound passthrough address, where unmeshed callers of a meshed broker come from.
const PROXY: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 6);

/// `connections` new connections from the proxy's address, 100 a second, each sending 100
/// random bearer tokens (10 at a time), under `--identity mesh,token --mesh istio`, while the
/// API server answers TokenReviews with 429 (Retry-After 2 s), as Priority and Fairness does
/// under such a flood. Meanwhile a valid caller subscribes every 100 ms, a FeatureFlag is
/// written every 200 ms to a warm watch, and a resource nobody watched is asked for every
/// 200 ms.
async fn proxy_token_flood(run: &Run, connections: usize) -> anyhow::Result<ProxyTokenFlood> {
    const TOKENS: usize = 100;
    let args = [
        "--identity",
        "mesh,token",
        "--mesh",
        "istio",
        "--token-audience",
        AUDIENCE,
    ];
    let (fake, _dir, target) = broker(run, 1, &args, &[]).await?;
    let valid = "valid-token-of-the-sidecar".to_string();
    fake.register_token(TokenUser {
        token: valid.clone(),
        username: "system:serviceaccount:default:sidecar".into(),
        uid: "uid-sidecar".into(),
        groups: vec!["system:serviceaccounts".into()],
        audiences: vec![AUDIENCE.into()],
        ..Default::default()
    });
    let with_token = |request: pb::SubscribeRequest| {
        let mut request = tonic::Request::new(request);
        let bearer = format!("Bearer {valid}").parse().expect("ASCII");
        request.metadata_mut().insert("authorization", bearer);
        request
    };
    // A warm watch: written every 200 ms, delivery timed.
    let sidecar = clients::connection_from(target.grpc, Ipv4Addr::new(127, 0, 0, 3)).await?;
    let mut warm = BrokerClient::new(sidecar.clone())
        .subscribe(with_token(one("default", &name(0))))
        .await?
        .into_inner();
    warm.message().await?;
    let (valid_h, delivery_h, cold_h) = (
        std::sync::Arc::new(Histogram::default()),
        std::sync::Arc::new(Histogram::default()),
        std::sync::Arc::new(Histogram::default()),
    );
    let (valid_failures, cold_failures) = (
        std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0)),
        std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0)),
    );
    fake.clear_requests();
    fake.inject(fake_apiserver::Injection {
        matcher: fake_apiserver::Matcher::verb("create").on("/apis/authentication.k8s.io"),
        times: usize::MAX,
        action: fake_apiserver::Action::Status {
            code: 429,
            retry_after: Some(2),
        },
    });
    let started = Instant::now();
    let flooding = async {
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        let mut floods = Vec::with_capacity(connections);
        for _ in 0..connections {
            tick.tick().await;
            let channel = clients::connection_from(target.grpc, PROXY).await?;
            floods.push(tokio::spawn(random_tokens(channel, TOKENS, 10)));
        }
        for flood in floods {
            let _ = flood.await;
        }
        anyhow::Ok(())
    };
    let watching = async {
        let mut round = 0u64;
        loop {
            round += 1;
            // The valid caller.
            let asked = Instant::now();
            let mut client = BrokerClient::new(sidecar.clone());
            let answered = tokio::time::timeout(Duration::from_secs(5), async {
                let response = client
                    .subscribe(with_token(one("default", &name(0))))
                    .await
                    .ok()?;
                response.into_inner().message().await.ok().flatten()
            })
            .await;
            match answered {
                Ok(Some(_)) => valid_h.record(asked.elapsed()),
                _ => {
                    valid_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            // A write to the warm watch.
            let written = Instant::now();
            let mut flag = fixtures::flag(&name(0), 0);
            flag["spec"]["flagSpec"]["flags"]["round"] = json!({ "state": "ENABLED",
                "variants": { "on": round }, "defaultVariant": "on" });
            let _ = fake.apply(flag);
            if tokio::time::timeout(Duration::from_secs(10), warm.message())
                .await
                .is_ok_and(|m| matches!(m, Ok(Some(_))))
            {
                delivery_h.record(written.elapsed());
            }
            // A resource nobody watched yet.
            let asked = Instant::now();
            let mut client = BrokerClient::new(sidecar.clone());
            let cold = format!("cold-{round}");
            let answered = tokio::time::timeout(Duration::from_secs(10), async {
                let response = client
                    .subscribe(with_token(one("default", &cold)))
                    .await
                    .ok()?;
                response.into_inner().message().await.ok().flatten()
            })
            .await;
            match answered {
                Ok(Some(_)) => cold_h.record(asked.elapsed()),
                _ => {
                    cold_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::select! {
        flooded = flooding => flooded?,
        _ = watching => unreachable!("the watcher's loop never ends"),
    }
    let seconds = started.elapsed().as_secs_f64();
    let reviews = token_reviews(&fake);
    target.stop().await;
    Ok(ProxyTokenFlood {
        connections,
        tokens_per_connection: TOKENS,
        seconds,
        token_reviews: reviews,
        valid: valid_h.summary(),
        valid_failures: valid_failures.load(std::sync::atomic::Ordering::Relaxed),
        delivery: delivery_h.summary(),
        cold_first: cold_h.summary(),
        cold_failures: cold_failures.load(std::sync::atomic::Ordering::Relaxed),
    })
}

/// The most the overlapping-sets attack lets a broker hold before it stops: past it a broker
/// without a bound on sets would take the machine.
const RSS_CEILING: u64 = 6 << 30;
/// The longest the overlapping-sets attack runs.
const OVERLAP_FOR: Duration = Duration::from_secs(90);

/// `sizes.overlapping` distinct selectors from 127.0.0.2, each of which selects all of
/// `sizes.overlap_members` FeatureFlags of `sizes.member_bytes` in `default`, 8 at a time, each
/// read to its first message and left; a refused one is not retried. Meanwhile another caller
/// asks for one FeatureFlag every 200 ms, and the broker's memory and the API server's open
/// watches are sampled every 100 ms.
async fn overlapping_sets(run: &Run, sizes: &Sizes) -> anyhow::Result<OverlappingSets> {
    let linger = Duration::from_secs(5);
    let (fake, _dir, target) = broker(run, 1, &["--linger", "5s"], &[]).await?;
    for k in 0..sizes.overlap_members {
        fake.apply(fixtures::flag(&format!("big-{k}"), sizes.member_bytes))?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_before = target.rss();
    fake.clear_requests();
    let started = Instant::now();
    let attacker = clients::connection_from(target.grpc, Ipv4Addr::new(127, 0, 0, 2)).await?;
    let other = clients::connection_from(target.grpc, OTHER).await?;
    let (mut attempted, mut admitted) = (0, 0);
    let mut stopped = None;
    let (mut rss_peak, mut watches_peak) = (rss_before, 0);
    // The other caller asks on a task of its own, so that a slow answer holds up neither side.
    let latencies = std::sync::Arc::new(Histogram::default());
    let other_failures = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let asking_other = tokio::spawn({
        let (latencies, failures) = (latencies.clone(), other_failures.clone());
        async move {
            loop {
                let asked = Instant::now();
                let mut client = BrokerClient::new(other.clone());
                if first_message(&mut client, one("default", &name(0))).await {
                    latencies.record(asked.elapsed());
                } else {
                    failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    });
    let mut selectors = (0..sizes.overlapping).map(|i| set_request(&format!("!x{i}")));
    let mut asking = futures::stream::FuturesUnordered::new();
    let mut sample = tokio::time::interval(Duration::from_millis(100));
    loop {
        while asking.len() < 8 {
            let Some(request) = selectors.next() else {
                break;
            };
            attempted += 1;
            let mut client = BrokerClient::new(attacker.clone());
            asking.push(async move { first_message(&mut client, request).await });
        }
        if asking.is_empty() {
            break;
        }
        tokio::select! {
            Some(came) = asking.next() => admitted += usize::from(came),
            _ = sample.tick() => {
                rss_peak = rss_peak.max(target.rss());
                watches_peak = watches_peak.max(fake.open_watches());
                if rss_peak > RSS_CEILING {
                    stopped = Some(format!("the broker held {} MiB", rss_peak >> 20));
                } else if started.elapsed() > OVERLAP_FOR {
                    stopped = Some(format!("{} s passed", OVERLAP_FOR.as_secs()));
                }
                if stopped.is_some() {
                    break;
                }
            }
        }
    }
    asking_other.abort();
    drop(asking);
    let seconds = started.elapsed().as_secs_f64();
    let api_lists = fake
        .requests()
        .iter()
        .filter(|r| r.verb == "list" && r.path.ends_with("/featureflags"))
        .count();
    tokio::time::sleep(linger + Duration::from_secs(5)).await;
    let rss_after = target.rss();
    target.stop().await;
    let other_caller = latencies.summary();
    Ok(OverlappingSets {
        members: sizes.overlap_members,
        member_bytes: sizes.member_bytes,
        attempted,
        admitted,
        stopped,
        seconds,
        api_lists,
        api_watches_peak: watches_peak,
        rss_before_bytes: rss_before,
        rss_peak_bytes: rss_peak,
        rss_after_bytes: rss_after,
        other_caller_served: other_failures.load(std::sync::atomic::Ordering::Relaxed) == 0
            && other_caller.count > 0,
        other_caller,
    })
}

/// The broker `run` names on a fake holding FeatureFlags `name(0)` .. `name(crs - 1)`.
async fn broker(
    run: &Run,
    crs: usize,
    args: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<(FakeApiServer, fixtures::tempfile_like::Dir, Target)> {
    let (fake, dir) = fixtures::fake(crs, run.payload_bytes).await?;
    let bin = crate::target::broker_bin(run.broker_bin.clone())?;
    let kubeconfig = dir.path().join("kubeconfig");
    let target = Target::launch(&bin, &kubeconfig, args, env, Log::Null).await?;
    wait_ready(&target).await?;
    Ok((fake, dir, target))
}

async fn wait_ready(target: &Target) -> anyhow::Result<()> {
    let admin = target.admin.expect("a broker has an admin port");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok((200, _)) = fixtures::get(admin, "/readyz").await {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the broker did not become ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn resource(namespace: &str, name: &str) -> pb::ResourceRef {
    pb::ResourceRef {
        group: "core.openfeature.dev".into(),
        version: "v1beta1".into(),
        resource: "featureflags".into(),
        namespace: namespace.into(),
        name: name.into(),
        ..Default::default()
    }
}

fn set_request(labels: &str) -> pb::SubscribeRequest {
    pb::SubscribeRequest {
        resources: vec![pb::ResourceRef {
            label_selector: labels.into(),
            ..resource("default", "")
        }],
    }
}

fn one(namespace: &str, name: &str) -> pb::SubscribeRequest {
    pb::SubscribeRequest {
        resources: vec![resource(namespace, name)],
    }
}

/// Subscribes with `request` and waits for the first message: whether both came.
async fn first_message(client: &mut BrokerClient<Channel>, request: pb::SubscribeRequest) -> bool {
    let subscribe = async {
        match client.subscribe(request).await {
            Ok(response) => matches!(response.into_inner().message().await, Ok(Some(_))),
            Err(_) => false,
        }
    };
    tokio::time::timeout(Duration::from_secs(5), subscribe)
        .await
        .unwrap_or(false)
}

/// One caller at `from` sends `requests` one after another on one connection; then another
/// caller asks for a FeatureFlag that exists.
async fn cycle(
    target: &Target,
    fake: &FakeApiServer,
    from: Ipv4Addr,
    requests: impl Iterator<Item = pb::SubscribeRequest>,
) -> anyhow::Result<Cycle> {
    let mut client = BrokerClient::new(clients::connection_from(target.grpc, from).await?);
    let (mut attempted, mut admitted) = (0, 0);
    for request in requests {
        attempted += 1;
        if first_message(&mut client, request).await {
            admitted += 1;
        }
    }
    let mut other = BrokerClient::new(clients::connection_from(target.grpc, OTHER).await?);
    let other_caller_served = first_message(&mut other, one("default", &name(0))).await;
    let admin = target.admin.expect("an admin port");
    let (_, body) = fixtures::get(admin, "/debug/watches").await?;
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    Ok(Cycle {
        from: from.to_string(),
        attempted,
        admitted,
        // The other caller's watch is not the attacker's.
        api_watches_after: fake
            .open_watches()
            .saturating_sub(usize::from(other_caller_served)),
        broker_watches_after: listed["watches"].as_array().map_or(0, |w| {
            w.len().saturating_sub(usize::from(other_caller_served))
        }),
        other_caller_served,
    })
}

/// Distinct set selectors, each subscribed and left, under `--max-watches 50`.
async fn set_cycle(run: &Run, from: Ipv4Addr, sets: usize) -> anyhow::Result<Cycle> {
    let (fake, _dir, target) = broker(run, 1, &["--max-watches", "50"], &[]).await?;
    let requests = (0..sets).map(|i| set_request(&format!("app=attack-{i}")));
    let result = cycle(&target, &fake, from, requests).await;
    target.stop().await;
    result
}

/// One made-up name in each of `namespaces` namespaces, each subscribed and left.
async fn namespace_cycle(run: &Run, from: Ipv4Addr, namespaces: usize) -> anyhow::Result<Cycle> {
    let (fake, _dir, target) = broker(run, 1, &[], &[]).await?;
    let requests = (0..namespaces).map(|i| one(&format!("attack-{i}"), "x"));
    let result = cycle(&target, &fake, from, requests).await;
    target.stop().await;
    result
}

fn token_reviews(fake: &FakeApiServer) -> usize {
    fake.requests()
        .iter()
        .filter(|r| r.path.ends_with("/tokenreviews"))
        .count()
}

/// `tokens` random bearer tokens from 127.0.0.2, 64 at a time, while a caller with a valid
/// token at 127.0.0.3 subscribes every 100 ms.
async fn token_flood(run: &Run, tokens: usize) -> anyhow::Result<TokenFlood> {
    let (fake, _dir, target) = broker(
        run,
        1,
        &["--identity", "token", "--token-audience", AUDIENCE],
        &[],
    )
    .await?;
    let valid = "valid-token-of-the-sidecar".to_string();
    fake.register_token(TokenUser {
        token: valid.clone(),
        username: "system:serviceaccount:default:sidecar".into(),
        uid: "uid-sidecar".into(),
        groups: vec!["system:serviceaccounts".into()],
        audiences: vec![AUDIENCE.into()],
        ..Default::default()
    });
    let channel = clients::connection_from(target.grpc, Ipv4Addr::new(127, 0, 0, 3)).await?;
    let subscribe_valid = |channel: Channel| {
        let valid = valid.clone();
        async move {
            let mut request = tonic::Request::new(one("default", &name(0)));
            let bearer = format!("Bearer {valid}").parse().expect("ASCII");
            request.metadata_mut().insert("authorization", bearer);
            let started = Instant::now();
            let mut client = BrokerClient::new(channel);
            let answer = tokio::time::timeout(Duration::from_secs(5), async {
                let response = client.subscribe(request).await.ok()?;
                response.into_inner().message().await.ok().flatten()
            });
            answer.await.ok().flatten().map(|_| started.elapsed())
        }
    };
    let before = Histogram::default();
    for _ in 0..10 {
        if let Some(t) = subscribe_valid(channel.clone()).await {
            before.record(t);
        }
    }
    let rss_before = target.rss();
    fake.clear_requests();
    let flooding = async {
        let channel = clients::connection_from(target.grpc, Ipv4Addr::new(127, 0, 0, 2)).await?;
        random_tokens(channel, tokens, 64).await;
        anyhow::Ok(())
    };
    let during = Histogram::default();
    let mut failures = 0;
    let watching = async {
        loop {
            match subscribe_valid(channel.clone()).await {
                Some(t) => during.record(t),
                None => failures += 1,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let started = Instant::now();
    tokio::select! {
        flooded = flooding => flooded?,
        _ = watching => unreachable!("the valid caller's loop never ends"),
    }
    let flood_seconds = started.elapsed().as_secs_f64();
    let reviews = token_reviews(&fake);
    let rss_after = target.rss();
    fake.clear_requests();
    subscribe_valid(channel.clone()).await;
    let valid_reviews_after = token_reviews(&fake);
    target.stop().await;
    Ok(TokenFlood {
        tokens,
        token_reviews: reviews,
        flood_seconds,
        rss_before_bytes: rss_before,
        rss_after_bytes: rss_after,
        valid_before: before.summary(),
        valid_during: during.summary(),
        valid_failures: failures,
        valid_reviews_after,
    })
}

/// `count` Subscribes on `channel`, `at_once` at a time, each with a random bearer token, each
/// given 5 s.
async fn random_tokens(channel: Channel, count: usize, at_once: usize) {
    futures::stream::iter(0..count)
        .for_each_concurrent(at_once, |i| {
            let mut client = BrokerClient::new(channel.clone());
            async move {
                let mut request = tonic::Request::new(one("default", &name(0)));
                let token = format!("Bearer random-{i}-{}", fastrand::u64(..));
                request
                    .metadata_mut()
                    .insert("authorization", token.parse().expect("ASCII"));
                let _ =
                    tokio::time::timeout(Duration::from_secs(5), client.subscribe(request)).await;
            }
        })
        .await;
}

/// A set of large members, and subscribers of it that never read.
async fn stalled_set(run: &Run, sizes: &Sizes) -> anyhow::Result<StalledSet> {
    let linger = Duration::from_secs(2);
    let (fake, _dir, target) = broker(run, 0, &["--linger", "2s"], &[]).await?;
    for k in 0..sizes.set_members {
        let mut flag = fixtures::flag(&format!("big-{k}"), sizes.member_bytes);
        flag["metadata"]["labels"] = json!({ "app": "big" });
        fake.apply(flag)?;
    }
    let rss_before = target.rss();
    let request = set_request("app=big");
    let addr = target.grpc;
    let mut rss = Vec::new();
    for _ in 0..STALLED_ROUNDS {
        let subscribers: Vec<clients::Sidecar> = futures::stream::iter(0..sizes.stalled)
            .map(|i| {
                let local = Ipv4Addr::new(127, 0, 1, 1 + (i % 200) as u8);
                let request = request.clone();
                async move { clients::open(addr, local, &request, false).await }
            })
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        // The broker sends what each stream's window takes, then holds the rest.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let stalled = target.rss();
        drop(subscribers);
        tokio::time::sleep(linger + Duration::from_secs(3)).await;
        rss.push((stalled, target.rss()));
    }
    let admin = target.admin.expect("an admin port");
    let (_, body) = fixtures::get(admin, "/debug/watches").await?;
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    target.stop().await;
    Ok(StalledSet {
        members: sizes.set_members,
        member_bytes: sizes.member_bytes,
        subscribers: sizes.stalled,
        rss_before_bytes: rss_before,
        rss_stalled_bytes: rss[0].0,
        rss_after_bytes: rss[0].1,
        rss_later_rounds_bytes: rss[1..].to_vec(),
        watches_after: listed["watches"].as_array().map_or(0, Vec::len),
    })
}

/// `names` made-up names in `default`, new ones each round, subscribed 100 to a stream over 50
/// streams at once and left, while 100 other names stay subscribed (so the namespace watch the
/// names share runs on); memory read once their watches lingered out, after [`WARMUP`] rounds
/// that are not counted and then after each of `rounds`.
async fn cycled_names(run: &Run, names: usize, rounds: usize) -> anyhow::Result<CycledNames> {
    let args: Vec<&str> = ["--linger", "1s"]
        .into_iter()
        .chain(crate::target::UNLIMITED)
        .collect();
    let (_fake, _dir, target) = broker(run, 1, &args, &[]).await?;
    let channel = clients::connection_from(target.grpc, Ipv4Addr::new(127, 0, 0, 2)).await?;
    let held = pb::SubscribeRequest {
        resources: (0..100)
            .map(|i| resource("default", &format!("held-{i}")))
            .collect(),
    };
    let mut holder = BrokerClient::new(channel.clone())
        .subscribe(held)
        .await?
        .into_inner();
    for _ in 0..100 {
        holder.message().await?;
    }
    let mut rss = Vec::new();
    for round in 0..WARMUP + rounds {
        let batches: Vec<Vec<String>> = (0..names)
            .map(|i| format!("made-up-{round}-{i}"))
            .collect::<Vec<_>>()
            .chunks(100)
            .map(<[String]>::to_vec)
            .collect();
        futures::stream::iter(batches)
            .for_each_concurrent(50, |batch| {
                let mut client = BrokerClient::new(channel.clone());
                async move {
                    let request = pb::SubscribeRequest {
                        resources: batch.iter().map(|n| resource("default", n)).collect(),
                    };
                    let Ok(response) = client.subscribe(request).await else {
                        return;
                    };
                    let mut stream = response.into_inner();
                    for _ in 0..batch.len() {
                        let next = tokio::time::timeout(Duration::from_secs(10), stream.message());
                        if !matches!(next.await, Ok(Ok(Some(_)))) {
                            return;
                        }
                    }
                }
            })
            .await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        rss.push(target.rss());
    }
    drop(holder);
    target.stop().await;
    let warmup = rss.drain(..WARMUP).next_back().unwrap_or(0);
    let percent = |from: u64, to: u64| {
        ((to as f64 - from as f64) / (from as f64).max(1.0) * 1000.0).round() / 10.0
    };
    let (first, last) = (rss[0], *rss.last().unwrap_or(&0));
    let (low, high) = (
        rss.iter().copied().min().unwrap_or(0),
        rss.iter().copied().max().unwrap_or(0),
    );
    Ok(CycledNames {
        names,
        trend_percent: trend(&rss),
        rss_after_warmup_bytes: warmup,
        growth_percent: percent(first, last),
        spread_percent: percent(low, high),
        rss_after_round_bytes: rss,
    })
}

/// Rounds of stalled set subscribers.
const STALLED_ROUNDS: usize = 4;

/// Rounds of made-up names before memory is measured.
const WARMUP: usize = 3;

/// The least-squares slope of `ys` over their index, times (n − 1), ÷ their mean, in percent.
fn trend(ys: &[u64]) -> f64 {
    let n = ys.len() as f64;
    if ys.len() < 2 {
        return 0.0;
    }
    let mean_x = (n - 1.0) / 2.0;
    let mean_y = ys.iter().map(|&y| y as f64).sum::<f64>() / n;
    let (mut num, mut den) = (0.0, 0.0);
    for (x, &y) in ys.iter().enumerate() {
        num += (x as f64 - mean_x) * (y as f64 - mean_y);
        den += (x as f64 - mean_x).powi(2);
    }
    (num / den * (n - 1.0) / mean_y.max(1.0) * 1000.0).round() / 10.0
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_trend_is_the_fitted_growth_over_the_rounds() {
        assert_eq!(super::trend(&[100, 100, 100]), 0.0);
        assert_eq!(super::trend(&[100, 110, 120]), 18.2);
        assert_eq!(super::trend(&[100, 120, 100, 120]), 10.9);
    }
}
