//! Scenario `resolvers`: what N clients that resolve the broker's replicas cost a real
//! kube-apiserver. `kuberesolver`: each client watches the headless Service's EndpointSlices
//! itself, as kuberesolver does for each channel (a LIST and a WATCH of its own, over a TLS
//! connection of its own, [`crate::direct`]); `xds`: each asks one broker over xDS (ADS on a
//! connection of its own: the Listener, the Cluster, the endpoints, each ACKed), and the broker
//! watches the EndpointSlices once (ADR 0023). Each row on a control plane of its own: the
//! clients connect and get the replicas, sit idle, then a fourth replica joins the slice and
//! every client must learn it.
//!
//! Then how soon a client's new streams follow the replicas, `dns` (a DNS server on loopback
//! answering the Service's name, as cluster DNS answers a headless Service) beside `xds`: the
//! real grpc-go client (`scripts/peers`, `round_robin`, its resolvers' defaults) keeps 30
//! streams, each renewed every second, over three replicas (the broker binary on 127.0.0.2–4,
//! each connection aged after `--resolvers-age`); a fourth joins, then one leaves. The replicas
//! run on the fake API server, since the real one refuses loopback addresses in an
//! EndpointSlice.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use control_plane::endpoints::{endpoint_slice, endpoint_slice_kind};
use control_plane::{ControlPlane, Leash};
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use prost::Message;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::Run;
use crate::clients::{Recorder, tokio_util_like};
use crate::fixtures::{firsts, tempfile_like, wait_until};
use crate::stats;
use crate::target::{Log, Target};

/// One mode at one N.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// `kuberesolver` or `xds`.
    pub mode: String,
    /// Clients.
    pub clients: usize,
    /// Seconds from the first client until every one knew the replicas.
    pub ready_seconds: f64,
    /// WATCH requests the API server serves on EndpointSlices for the clients (its own, open
    /// before any client, left out).
    pub watches: f64,
    /// TCP connections the API server holds for the clients (those open before any client
    /// left out).
    pub connections: usize,
    /// The API server's resident memory before any client, and after the idle period.
    pub rss_base_bytes: u64,
    /// See `rss_base_bytes`.
    pub rss_idle_bytes: u64,
    /// The broker's resident memory (0 for `kuberesolver`).
    pub broker_rss_bytes: u64,
    /// Seconds from the write of the EndpointSlice with a fourth replica until every client
    /// knew it; `None` if some did not within 30 s.
    pub change_seconds: Option<f64>,
    /// Clients that did not know the fourth replica 30 s after the write.
    pub lost: usize,
    /// Times a client started over after an error.
    pub retries: u64,
}

/// How soon one resolver's new streams follow the replicas.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Follow {
    /// `dns` or `xds`.
    pub resolver: String,
    /// Seconds from the change (the DNS answer, the EndpointSlice) until a fourth replica had
    /// served a new stream; `None` if not within the window.
    pub joined_seconds: Option<f64>,
    /// Seconds from the change until a replica that left served its last new stream.
    pub left_seconds: Option<f64>,
    /// The window each is watched for.
    pub window_seconds: f64,
    /// The replicas' maximum connection age.
    pub age_seconds: f64,
}

/// Every row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Resolvers {
    /// Seconds of the idle period.
    pub idle_seconds: f64,
    /// By N, then mode.
    pub rows: Vec<Row>,
    /// `dns`, then `xds`.
    pub follow: Vec<Follow>,
}

const NAMESPACE: &str = "default";
const SERVICE: &str = "crd-broker-headless";
const PORT: u16 = 8015;

/// Runs every mode at every N.
pub async fn resolvers(run: &Run) -> anyhow::Result<Resolvers> {
    let mut rows = Vec::new();
    for &n in &run.resolvers_clients {
        for mode in ["kuberesolver", "xds"] {
            eprintln!("resolvers: {mode}, {n} clients");
            rows.push(
                row(run, mode, n)
                    .await
                    .with_context(|| format!("{mode} with {n} clients"))?,
            );
        }
    }
    let mut follow = Vec::new();
    for resolver in ["dns", "xds"] {
        eprintln!("resolvers: how soon {resolver} follows the replicas");
        follow.push(
            follows(run, resolver)
                .await
                .with_context(|| format!("how soon {resolver} follows"))?,
        );
    }
    Ok(Resolvers {
        idle_seconds: run.resolvers_idle.as_secs_f64(),
        rows,
        follow,
    })
}

/// New streams the replica with admin port `admin` has served (each one's first message).
async fn served(admin: std::net::SocketAddr) -> f64 {
    let Ok((200, body)) = crate::fixtures::get(admin, "/metrics").await else {
        return 0.0;
    };
    control_plane::scrape(&body)
        .iter()
        .filter(|(k, _)| k.starts_with("crd_broker_first_message_seconds_count{"))
        .map(|(_, v)| v)
        .sum()
}

/// The replicas here: 127.0.0.`last`.
fn ip(last: u8) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(127, 0, 0, last)
}

/// The headless Service's EndpointSlice on the fake: `ready` replicas on loopback.
fn loopback_slice(port: u16, ready: &[u8]) -> Value {
    let ips: Vec<_> = ready.iter().map(|l| ip(*l)).collect();
    endpoint_slice(NAMESPACE, SERVICE, port, &ips, &[])
}

/// Polls `done` every 50 ms for at most `window`: when it held, from `since`.
async fn within(
    window: Duration,
    since: Instant,
    mut done: impl AsyncFnMut() -> bool,
) -> Option<f64> {
    while since.elapsed() < window {
        if done().await {
            return Some(since.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// One resolver: three replicas, a fourth joining, then one leaving.
async fn follows(run: &Run, resolver: &str) -> anyhow::Result<Follow> {
    let window = run.resolvers_window;
    let (fake, dir) = crate::fixtures::fake(1, run.payload_bytes).await?;
    fake.apply(endpoint_slice_kind())?;
    let port = control_plane::free_port();
    fake.apply(loopback_slice(port, &[2, 3, 4]))?;
    let bin = crate::target::broker_bin(run.broker_bin.clone())?;
    let kubeconfig = dir.path().join("kubeconfig");
    let age = humantime::format_duration(run.resolvers_age).to_string();
    let service = format!("{SERVICE}.{NAMESPACE}:{port}");
    let args = [
        "--max-connection-age",
        &age,
        "--max-connection-age-grace",
        "1s",
        "--xds-service",
        &service,
    ];
    let mut replicas = Vec::new();
    for last in [2, 3, 4] {
        let at = std::net::SocketAddr::from((ip(last), port));
        replicas.push(Target::replica(&bin, &kubeconfig, at, &args).await?);
    }
    let admin = |t: &Target| t.admin.expect("a broker has an admin port");
    let dns = control_plane::dns::Dns::start("broker.test", &[ip(2), ip(3), ip(4)]).await;
    let (target, bootstrap) = match resolver {
        "dns" => (format!("dns://{}/broker.test:{port}", dns.addr), None),
        _ => (
            format!("xds:///{service}"),
            Some(json!({
                "xds_servers": [{ "server_uri": format!("{}:{port}", ip(2)),
                    "channel_creds": [{ "type": "insecure" }], "server_features": ["xds_v3"] }],
                "node": { "id": "crd-broker-loadtest", "locality": {} },
            })),
        ),
    };
    let hex: String = crate::clients::subscribe_request(&crate::fixtures::name(0))
        .encode_to_vec()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let go = tokio::task::spawn_blocking(|| control_plane::peer("grpc-go")).await?;
    let mut client = tokio::process::Command::new(go);
    client
        .args([&target, "30", &hex, "0", "1000"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .leashed();
    if let Some(b) = &bootstrap {
        client.env("GRPC_XDS_BOOTSTRAP_CONFIG", b.to_string());
    }
    let mut client = client.spawn().context("the grpc-go client")?;
    let first = admin(&replicas[0]);
    let ready = within(Duration::from_secs(30), Instant::now(), async || {
        served(first).await > 0.0
    })
    .await;
    anyhow::ensure!(ready.is_some(), "the client opened no stream within 30 s");

    // A fourth replica joins: in DNS, in the EndpointSlice.
    let at = std::net::SocketAddr::from((ip(5), port));
    replicas.push(Target::replica(&bin, &kubeconfig, at, &args).await?);
    dns.set(&[ip(2), ip(3), ip(4), ip(5)]);
    fake.apply(loopback_slice(port, &[2, 3, 4, 5]))?;
    let changed = Instant::now();
    let fourth = admin(&replicas[3]);
    let joined_seconds = within(window, changed, async || served(fourth).await > 0.0).await;

    // One leaves (it keeps running, as a pod that is terminating does for a while): the time
    // of its last new stream.
    dns.set(&[ip(2), ip(3), ip(5)]);
    fake.apply(loopback_slice(port, &[2, 3, 5]))?;
    let changed = Instant::now();
    let gone = admin(&replicas[2]);
    let (mut count, mut last) = (served(gone).await, None);
    while changed.elapsed() < window {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = served(gone).await;
        if now > count {
            (count, last) = (now, Some(changed.elapsed().as_secs_f64()));
        }
    }
    let left_seconds = Some(last.unwrap_or(0.0));
    drop(client.stdin.take());
    let _ = client.kill().await;
    for r in replicas {
        r.stop().await;
    }
    Ok(Follow {
        resolver: resolver.to_string(),
        joined_seconds,
        left_seconds,
        window_seconds: window.as_secs_f64(),
        age_seconds: run.resolvers_age.as_secs_f64(),
    })
}

/// The headless Service's EndpointSlice with `replicas` replicas `10.0.0.2`… (addresses no one
/// dials: the API server refuses loopback ones).
fn slice(replicas: u8) -> Value {
    let ips: Vec<_> = (0..replicas)
        .map(|r| std::net::Ipv4Addr::new(10, 0, 0, r + 2))
        .collect();
    endpoint_slice(NAMESPACE, SERVICE, PORT, &ips, &[])
}

/// The accounts: `resolver` (each kuberesolver-style client) and `broker` may read
/// EndpointSlices.
async fn world(plane: &ControlPlane) {
    let mut objects = Vec::new();
    for account in ["resolver", "broker"] {
        objects.push(json!({ "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": { "name": account, "namespace": NAMESPACE } }));
        objects.push(json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": { "name": format!("{account}-reads-endpointslices"), "namespace": NAMESPACE },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "endpointslice-reader" },
            "subjects": [{ "kind": "ServiceAccount", "name": account, "namespace": NAMESPACE }] }));
    }
    objects.push(
        json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": { "name": "endpointslice-reader", "namespace": NAMESPACE },
        "rules": [{ "apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"] }] }),
    );
    objects.push(slice(3));
    plane.apply(&objects).await;
}

/// One xDS client: its own connection, the Listener, the Cluster and the endpoints asked for
/// and each answer ACKed, as gRPC's xDS client does; `known[slot]` is the replicas it knows.
async fn xds_client(
    broker: std::net::SocketAddr,
    slot: usize,
    known: Arc<Vec<AtomicUsize>>,
    recorder: Arc<Recorder>,
    stop: tokio_util_like::Stop,
) {
    let started = Instant::now();
    let listener = format!("{SERVICE}.{NAMESPACE}:{PORT}");
    let cluster = listener.clone();
    let run = async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{broker}"))?
            .connect()
            .await?;
        let (tx, requests) = tokio::sync::mpsc::channel::<DiscoveryRequest>(4);
        let ask = |type_url: &str, name: &str, last: Option<&DiscoveryResponse>| DiscoveryRequest {
            type_url: type_url.into(),
            resource_names: vec![name.to_string()],
            version_info: last.map(|r| r.version_info.clone()).unwrap_or_default(),
            response_nonce: last.map(|r| r.nonce.clone()).unwrap_or_default(),
            ..Default::default()
        };
        tx.send(ask(LISTENER, &listener, None)).await?;
        let mut responses = AggregatedDiscoveryServiceClient::new(channel)
            .stream_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(requests))
            .await?
            .into_inner();
        let mut first = true;
        while let Some(response) = responses.message().await? {
            let name = match response.type_url.as_str() {
                LISTENER => &listener,
                _ => &cluster,
            };
            tx.send(ask(&response.type_url, name, Some(&response)))
                .await?;
            match response.type_url.as_str() {
                LISTENER if first => tx.send(ask(CLUSTER, &cluster, None)).await?,
                CLUSTER if first => tx.send(ask(ENDPOINTS, &cluster, None)).await?,
                ENDPOINTS => {
                    let cla = ClusterLoadAssignment::decode(
                        response
                            .resources
                            .first()
                            .context("an assignment")?
                            .value
                            .as_slice(),
                    )?;
                    let replicas = cla.endpoints.iter().map(|l| l.lb_endpoints.len()).sum();
                    known[slot].store(replicas, Ordering::Relaxed);
                    if std::mem::take(&mut first) {
                        recorder.first(true, started.elapsed());
                    }
                }
                _ => {}
            }
        }
        anyhow::Ok(())
    };
    tokio::select! {
        _ = stop.wait() => {}
        result = run => {
            if result.is_err() {
                recorder.retries.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const ENDPOINTS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

async fn row(run: &Run, mode: &str, n: usize) -> anyhow::Result<Row> {
    let plane = crate::fixtures::own_plane().await?;
    world(&plane).await;
    let (pid, port) = crate::fixtures::apiserver(&plane)?;
    let dir = tempfile_like::Dir::new()?;
    let rss_base_bytes = stats::rss(pid);
    // What the API server watches and holds before any client (its own EndpointSlice watch).
    let watches_base = plane
        .open_watches("discovery.k8s.io", "endpointslices")
        .await;
    let connections_base = stats::sockets(pid, "01", stats::End::Local, port);
    let recorder = Recorder::new(n, 2);
    let known: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
    let (trigger, stop) = tokio_util_like::signal();
    let started = Instant::now();
    let mut broker = None;
    match mode {
        "kuberesolver" => {
            let token = plane.token(NAMESPACE, "resolver", &[], None).await;
            let collection =
                format!("/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices");
            let api = Arc::new(crate::direct::Api::new(
                &plane.server,
                &plane.dir.join("pki/ca.crt"),
                token,
                &collection,
            )?);
            let by_label = |_| crate::direct::by_label("kubernetes.io/service-name", SERVICE);
            crate::direct::start(api, n, by_label, &recorder, &stop).await;
        }
        "xds" => {
            let kubeconfig = plane
                .kubeconfig_for(NAMESPACE, "broker", dir.path(), &plane.server)
                .await;
            let bin = crate::target::broker_bin(run.broker_bin.clone())?;
            let service = format!("{SERVICE}.{NAMESPACE}:{PORT}");
            let b = Target::broker_logging(
                &bin,
                &kubeconfig,
                Duration::from_secs(30),
                &["--xds-service", &service],
                Log::Inherit,
            )
            .await?;
            for i in 0..n {
                tokio::spawn(xds_client(
                    b.grpc,
                    i,
                    known.clone(),
                    recorder.clone(),
                    stop.clone(),
                ));
                if i % 50 == 49 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            broker = Some(b);
        }
        other => anyhow::bail!("no mode {other} (kuberesolver, xds)"),
    }
    let recorder_ = recorder.clone();
    wait_until(
        "every client knows the replicas",
        Duration::from_secs(600),
        || firsts(&recorder_) >= n as u64,
    )
    .await?;
    let ready_seconds = started.elapsed().as_secs_f64();
    tokio::time::sleep(run.resolvers_idle).await;
    let rss_idle_bytes = stats::rss(pid);
    let watches = plane
        .open_watches("discovery.k8s.io", "endpointslices")
        .await
        - watches_base;
    let connections =
        stats::sockets(pid, "01", stats::End::Local, port).saturating_sub(connections_base);
    let broker_rss_bytes = broker.as_ref().map_or(0, Target::rss);

    // A fourth replica joins: every client must learn it.
    plane.apply(&[slice(4)]).await;
    let written = Instant::now();
    let version = plane.read(&slice(4)).await["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let knows = |i: usize| match mode {
        "xds" => known[i].load(Ordering::Relaxed) == 4,
        _ => recorder.last_rv[i]
            .lock()
            .map(|rv| *rv == version)
            .unwrap_or(false),
    };
    let change_seconds = wait_until(
        "every client knows the fourth replica",
        Duration::from_secs(30),
        || (0..n).all(knows),
    )
    .await
    .ok()
    .map(|_| written.elapsed().as_secs_f64());
    let lost = (0..n).filter(|&i| !knows(i)).count();
    let retries = recorder.retries.load(Ordering::Relaxed);
    trigger.stop();
    if let Some(b) = broker {
        b.stop().await;
    }
    tokio::task::spawn_blocking(move || drop(plane)).await?;
    Ok(Row {
        mode: mode.to_string(),
        clients: n,
        ready_seconds,
        watches,
        connections,
        rss_base_bytes,
        rss_idle_bytes,
        broker_rss_bytes,
        change_seconds,
        lost,
        retries,
    })
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The markdown section: every row, then kuberesolver ÷ xds at each N.
pub fn markdown(r: &Resolvers) -> String {
    let mut s = String::from(
        "### Resolving the replicas: kuberesolver-style clients against xDS through the broker (a real kube-apiserver)\n\n| mode | clients | ready | API watches | API connections | API server memory (before → idle) | broker memory | 4th replica known by all | lost | retries |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for row in &r.rows {
        s += &format!(
            "| {} | {} | {:.2} s | {:.0} | {} | {:.0} → {:.0} MiB | {:.0} MiB | {} | {} | {} |\n",
            row.mode,
            row.clients,
            row.ready_seconds,
            row.watches,
            row.connections,
            mib(row.rss_base_bytes),
            mib(row.rss_idle_bytes),
            mib(row.broker_rss_bytes),
            row.change_seconds
                .map_or("not within 30 s".to_string(), |s| format!(
                    "{:.0} ms",
                    s * 1000.0
                )),
            row.lost,
            row.retries,
        );
    }
    let pairs: Vec<(&Row, &Row)> = r
        .rows
        .iter()
        .filter(|k| k.mode == "kuberesolver")
        .filter_map(|k| {
            r.rows
                .iter()
                .find(|x| x.mode == "xds" && x.clients == k.clients)
                .map(|x| (k, x))
        })
        .collect();
    if !r.follow.is_empty() {
        s += &format!(
            "\n| resolver (grpc-go, its defaults; connections aged after {:.0} s) | a fourth replica's first new stream | the last new stream of one that left |\n|---|---:|---:|\n",
            r.follow[0].age_seconds
        );
        let shown = |t: Option<f64>, window: f64| {
            t.map_or(format!("not within {window:.0} s"), |t| format!("{t:.2} s"))
        };
        for f in &r.follow {
            s += &format!(
                "| {} | {} | {} |\n",
                f.resolver,
                shown(f.joined_seconds, f.window_seconds),
                shown(f.left_seconds, f.window_seconds)
            );
        }
    }
    if !pairs.is_empty() {
        s += "\n| kuberesolver ÷ xds (same run) | API watches | API connections | API server memory added |\n|---|---:|---:|---:|\n";
        for (k, x) in pairs {
            let added = |row: &Row| row.rss_idle_bytes.saturating_sub(row.rss_base_bytes) as f64;
            let q = |a: f64, b: f64| {
                if b > 0.0 {
                    format!("{:.0}×", a / b)
                } else {
                    "—".into()
                }
            };
            s += &format!(
                "| {} clients | {} | {} | {} |\n",
                k.clients,
                q(k.watches, x.watches),
                q(k.connections as f64, x.connections as f64),
                q(added(k), added(x)),
            );
        }
    }
    s + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_run_is_the_table_in_performance_md() {
        let text = include_str!("../../../docs/performance/resolvers.json");
        let run: serde_json::Value = serde_json::from_str(text).unwrap();
        let run: Resolvers = serde_json::from_value(run["resolvers"].clone()).unwrap();
        let at = |mode: &str| run.rows.iter().find(|r| r.mode == mode).unwrap();
        assert_eq!(at("kuberesolver").clients, 1_000);
        // A watch per client, against one for them all.
        assert_eq!(at("xds").watches, 1.0);
        assert_eq!(at("kuberesolver").watches, 1_000.0);
        let doc = include_str!("../../../docs/performance.md");
        for line in markdown(&run).lines().filter(|l| l.starts_with("| ")) {
            assert!(
                doc.contains(line),
                "docs/performance.md lacks the line the run renders:\n{line}"
            );
        }
    }
}
