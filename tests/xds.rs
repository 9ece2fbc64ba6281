//! The broker as its own xDS name resolver (ADR 0023), with real gRPC clients changed only by
//! their documented xDS switch, against replicas run as the chart runs them.
//!
//! The real kube-apiserver refuses loopback addresses in an EndpointSlice (422: "may not be in
//! the loopback range"), and every replica here listens on loopback. So the tests where clients
//! dial the replicas they are told of run the replicas on the fake API server, whose
//! EndpointSlices the test writes as the EndpointSlice controller would (replicas on
//! 127.0.0.2–5); the protocol test runs a broker deployed by the chart on the real control
//! plane, under the RBAC the chart grants, with addresses no one dials.
//!
//! Each client keeps 30 streams open and renews each after a second, as sidecars coming and
//! going do, so where new streams go shows at once; a replica's new streams are counted by its
//! first-message histogram.

mod support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Stdio;
use std::time::{Duration, Instant};

use prost::Message;
use serde_json::{Value, json};
use support::control_plane::endpoints::{endpoint_slice, endpoint_slice_kind};
use support::control_plane::*;
use support::*;

const STREAMS: usize = 30;
const HOLD_MS: u64 = 1000;

fn ip(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
}

const RELEASE: &str = "crd-broker";
const NS: &str = "default";

/// The chart's values for a replica on `ip` (admin on `admin`): xDS on, no connection age
/// (clients learn of replicas from xDS alone), no per-caller rate (a client stands for many).
fn values(ip: IpAddr, port: u16, admin: u16) -> Value {
    json!({
        "fullnameOverride": RELEASE,
        "listenAddress": ip.to_string(),
        "grpc": { "port": port },
        "admin": { "port": admin },
        "maxConnectionAge": "0",
        "shutdownGraceSeconds": 3,
        "xds": { "enabled": true, "drainNoticeSeconds": 2 },
        "access": { "identity": "none", "newWatchRate": 100000, "newWatchBurst": 100000 },
    })
}

/// A replica: the broker binary with the chart's arguments and environment for `ip`, on the
/// API server behind `kubeconfig`.
struct Replica {
    child: tokio::process::Child,
    admin: SocketAddr,
}

impl Replica {
    async fn start(kubeconfig: &std::path::Path, ip: IpAddr, port: u16) -> Replica {
        let admin = free_port();
        let docs = support::chart::render_release(RELEASE, NS, values(ip, port, admin)).unwrap();
        let container = support::chart::container(&docs);
        let args: Vec<&str> = container["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_crd-broker"))
            .args(args)
            .env_clear()
            .env("KUBECONFIG", kubeconfig)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .leashed()
            .spawn()
            .unwrap();
        let admin = SocketAddr::new(ip, admin);
        until("the replica is ready", async || {
            matches!(try_http_get(admin, "/readyz").await, Ok((200, _)))
        })
        .await;
        Replica { child, admin }
    }
}

/// The replicas' EndpointSlice: `ready` and `terminating` replicas on 127.0.0.N.
fn replicas_slice(port: u16, ready: &[u8], terminating: &[u8]) -> Value {
    let ips = |lasts: &[u8]| {
        lasts
            .iter()
            .map(|l| Ipv4Addr::new(127, 0, 0, *l))
            .collect::<Vec<_>>()
    };
    endpoint_slice(
        NS,
        &format!("{RELEASE}-headless"),
        port,
        &ips(ready),
        &ips(terminating),
    )
}

/// New streams a replica has served (each one's first message, cold or warm).
async fn served(admin: SocketAddr) -> f64 {
    let m = metrics(admin).await;
    m.iter()
        .filter(|(k, _)| k.starts_with("crd_broker_first_message_seconds_count{"))
        .map(|(_, v)| v)
        .sum()
}

/// [`served`] of each replica.
async fn counts(admins: &[SocketAddr]) -> Vec<f64> {
    let mut out = Vec::new();
    for admin in admins {
        out.push(served(*admin).await);
    }
    out
}

fn admins(replicas: &[Replica]) -> Vec<SocketAddr> {
    replicas.iter().map(|r| r.admin).collect()
}

/// Polls `done` every 50 ms for at most 30 s; how long it took.
async fn until(what: &str, mut done: impl AsyncFnMut() -> bool) -> Duration {
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(30) {
        if done().await {
            return began.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not within 30 s");
}

/// The chart's bootstrap for clients, pointed at `server` (in a cluster it names the headless
/// Service; here the first replica), and the target it names.
fn bootstrap(port: u16, server: SocketAddr) -> (String, String) {
    let docs = support::chart::render_release(RELEASE, NS, values(ip(2), port, 8016)).unwrap();
    let map = docs
        .iter()
        .find(|d| {
            d["kind"] == "ConfigMap" && d["metadata"]["name"] == format!("{RELEASE}-xds-bootstrap")
        })
        .expect("the chart renders the xDS bootstrap");
    let mut bootstrap: Value =
        serde_json::from_str(map["data"]["bootstrap.json"].as_str().unwrap()).unwrap();
    assert_eq!(
        bootstrap["xds_servers"][0]["server_uri"],
        format!("dns:///{RELEASE}-headless.{NS}.svc.cluster.local:{port}")
    );
    bootstrap["xds_servers"][0]["server_uri"] = json!(server.to_string());
    let target = map["data"]["target"].as_str().unwrap().to_string();
    assert_eq!(target, format!("xds:///{RELEASE}-headless.{NS}:{port}"));
    (bootstrap.to_string(), target)
}

/// One test at a time: each measures how soon its client follows a change, which four other
/// replicas and clients starting beside it on 2 cores would blur.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_over_xds_follows_replicas_as_the_endpoint_slice_changes_and_outlives_its_server() {
    let mut python = tokio::process::Command::new(python_with("grpc"));
    python.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/grpcio_balance.py"
    ));
    follows("xds-grpcio", python).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_go_over_xds_follows_replicas_as_the_endpoint_slice_changes_and_outlives_its_server() {
    follows("xds-grpc-go", tokio::process::Command::new(peer("grpc-go"))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_js_over_xds_follows_replicas_as_the_endpoint_slice_changes_and_outlives_its_server() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/node");
    assert!(
        dir.join("node_modules/@grpc/grpc-js-xds").exists(),
        "{} has no @grpc/grpc-js-xds: run the README's test command (scripts/test), which installs it",
        dir.display()
    );
    let mut node = tokio::process::Command::new("node");
    node.arg(dir.join("balance.js"));
    follows("xds-grpc-js", node).await;
}

/// `client` (taking TARGET STREAMS REQUEST_HEX MIN_RESOLUTION_MS HOLD_MS, the bootstrap in
/// `GRPC_XDS_BOOTSTRAP_CONFIG`) over three replicas, then a fourth, one removed, one
/// terminating, and the one it resolves through drained; then that one restarted, twice, the
/// client's ADS stream resuming on it (ADR 0026).
async fn follows(test: &str, mut client: tokio::process::Command) {
    let _turn = ONE_AT_A_TIME.lock().await;
    let (fake, _dir, kubeconfig) = fake_with_kubeconfig().await;
    fake.apply(endpoint_slice_kind()).unwrap();
    fake.apply(flag("demo", "on")).unwrap();
    let port = free_port();
    fake.apply(replicas_slice(port, &[2, 3, 4], &[])).unwrap();
    let mut replicas = Vec::new();
    for last in [2, 3, 4] {
        replicas.push(Replica::start(&kubeconfig, ip(last), port).await);
    }
    let (bootstrap, target) = bootstrap(port, SocketAddr::new(ip(2), port));
    let hex: String = request(&[&demo("demo")])
        .encode_to_vec()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut client = client
        .args([
            &target,
            &STREAMS.to_string(),
            &hex,
            "0",
            &HOLD_MS.to_string(),
        ])
        .env("GRPC_XDS_BOOTSTRAP_CONFIG", &bootstrap)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .unwrap();

    // Spread: over a few seconds, each of the three takes a share of the new streams.
    until("streams on every replica", async || {
        counts(&admins(&replicas)).await.iter().all(|&n| n > 0.0)
    })
    .await;
    let before = counts(&admins(&replicas)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = counts(&admins(&replicas)).await;
    let share: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let total: f64 = share.iter().sum();
    println!("{test}: new streams per replica over 3 s: {share:?}");
    assert!(total >= STREAMS as f64, "{share:?}");
    assert!(share.iter().all(|&n| n >= total / 6.0), "{share:?}");

    // A fourth replica in the slice takes new streams within 2 s.
    replicas.push(Replica::start(&kubeconfig, ip(5), port).await);
    fake.apply(replicas_slice(port, &[2, 3, 4, 5], &[]))
        .unwrap();
    let fourth = replicas[3].admin;
    let took = until("the fourth replica takes streams", async || {
        served(fourth).await > 0.0
    })
    .await;
    println!("{test}: a fourth replica took new streams {took:?} after the slice listed it");
    assert!(took < Duration::from_secs(2), "{took:?}");

    // A replica removed from the slice, and one terminating in it: no new streams after 2 s.
    fake.apply(replicas_slice(port, &[2, 5], &[3])).unwrap();
    let changed = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let gone = counts(&admins(&replicas[1..3])).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        counts(&admins(&replicas[1..3])).await,
        gone,
        "a terminating and a removed replica took new streams {:?} after the change",
        changed.elapsed()
    );
    let others = counts(&[replicas[0].admin, replicas[3].admin]).await;
    println!("{test}: terminating and removed: {gone:?}; the others {others:?}");

    // The xDS server's own replica drains: for its notice it says so itself, and the client
    // opens no new stream there; then its streams and the client's xDS stream end, and the
    // client goes on with the endpoints it had.
    let server = replicas.remove(0);
    let first = Xds::of(server.admin).await;
    let pid = server.child.id().unwrap();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    tokio::time::sleep(Duration::from_millis(700)).await;
    let early = served(server.admin).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        served(server.admin).await,
        early,
        "the draining replica took new streams during its notice"
    );
    let mut server = server;
    let exited = tokio::time::timeout(Duration::from_secs(15), server.child.wait()).await;
    assert!(exited.is_ok(), "the drained replica exits");
    let last = served(replicas[2].admin).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = served(replicas[2].admin).await;
    println!(
        "{test}: without its xDS server, the client opened {} streams in 3 s",
        later - last
    );
    assert!(later - last >= STREAMS as f64, "{last} → {later}");

    // The xDS server comes back at its address, a replica restarted. The client's new ADS
    // stream names the versions it holds and is sent only what differs: not the Listener nor
    // the Cluster; the endpoints, since it holds its old server's address DRAINING.
    let back = Replica::start(&kubeconfig, ip(2), port).await;
    until(
        "the client's ADS stream on the restarted replica",
        async || {
            let x = Xds::of(back.admin).await;
            x.resumed[..2] == [1.0, 1.0] && x.responses[2] == 1.0
        },
    )
    .await;
    let x = Xds::of(back.admin).await;
    assert_eq!(x.responses, [0.0, 0.0, 1.0], "{x:?}");
    println!(
        "{test}: restarted after a drain, the xDS server sent {} bytes where the first sent {} ({x:?})",
        x.bytes, first.bytes
    );

    // Killed and restarted: now the client holds what the broker would send, and is sent
    // nothing. Past gRPC's 15 s does-not-exist timer it still has its Listener, Cluster and
    // endpoints (its new streams land on the replicas it knows), and then takes a change.
    let mut back = back;
    back.child.start_kill().unwrap();
    back.child.wait().await.unwrap();
    let again = Replica::start(&kubeconfig, ip(2), port).await;
    until(
        "the client's ADS stream resumed on the replica restarted again",
        async || Xds::of(again.admin).await.resumed == [1.0, 1.0, 1.0],
    )
    .await;
    replicas.push(again);
    tokio::time::sleep(Duration::from_secs(16)).await;
    let before = counts(&admins(&replicas)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = counts(&admins(&replicas)).await;
    let x = Xds::of(replicas[3].admin).await;
    let opened: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    println!(
        "{test}: resumed after a kill, the xDS server sent {} bytes ({x:?}); 16 s on, new streams in 3 s: {opened:?}",
        x.bytes
    );
    assert_eq!((x.responses, x.bytes), ([0.0; 3], 0.0), "{x:?}");
    // The replicas it knows: the fourth started and the one restarted.
    assert!(opened[2] + opened[3] >= STREAMS as f64, "{opened:?}");
    // Back in the slice, the replica removed before takes new streams.
    fake.apply(replicas_slice(port, &[2, 4, 5], &[])).unwrap();
    let removed = replicas[1].admin;
    let frozen = served(removed).await;
    let took = until("the replica back in the slice takes streams", async || {
        served(removed).await > frozen
    })
    .await;
    println!("{test}: after the resume, a change took {took:?} to reach the client");
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert_eq!(Xds::of(replicas[3].admin).await.responses, [0.0, 0.0, 1.0]);
    drop(client.stdin.take());
    let _ = client.kill().await;
}

/// A replica's xDS figures, of the Listener, Cluster and endpoints types.
#[derive(Debug)]
struct Xds {
    responses: [f64; 3],
    resumed: [f64; 3],
    bytes: f64,
}

impl Xds {
    async fn of(admin: SocketAddr) -> Xds {
        let m = metrics(admin).await;
        let by_type = |family: &str| {
            ["listener", "cluster", "endpoints"].map(|t| {
                m.get(&format!("crd_broker_xds_{family}_total{{type=\"{t}\"}}"))
                    .copied()
                    .unwrap_or(0.0)
            })
        };
        Xds {
            responses: by_type("responses"),
            resumed: by_type("resumed"),
            bytes: by_type("response_bytes").iter().sum(),
        }
    }
}

/// The protocol as a raw ADS client sees it, against a broker on the real control plane.
mod protocol {
    use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
    use envoy_types::pb::envoy::config::listener::v3::Listener;
    use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
    use envoy_types::pb::envoy::service::discovery::v3::{
        DeltaDiscoveryRequest, DiscoveryRequest, DiscoveryResponse,
    };
    use envoy_types::pb::google::rpc::Status as RpcStatus;
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::ReceiverStream;
    use tonic::transport::Channel;

    use super::*;

    const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
    const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    const ENDPOINTS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

    struct Ads {
        tx: mpsc::Sender<DiscoveryRequest>,
        rx: tonic::Streaming<DiscoveryResponse>,
    }

    impl Ads {
        async fn open(channel: Channel) -> Result<Ads, tonic::Status> {
            let (tx, requests) = mpsc::channel(8);
            let rx = AggregatedDiscoveryServiceClient::new(channel)
                .stream_aggregated_resources(ReceiverStream::new(requests))
                .await?
                .into_inner();
            Ok(Ads { tx, rx })
        }

        async fn ask(&self, type_url: &str, names: &[&str], last: Option<&DiscoveryResponse>) {
            let request = DiscoveryRequest {
                type_url: type_url.into(),
                resource_names: names.iter().map(|n| n.to_string()).collect(),
                version_info: last.map(|r| r.version_info.clone()).unwrap_or_default(),
                response_nonce: last.map(|r| r.nonce.clone()).unwrap_or_default(),
                ..Default::default()
            };
            self.tx.send(request).await.unwrap();
        }

        async fn next(&mut self) -> DiscoveryResponse {
            tokio::time::timeout(Duration::from_secs(5), self.rx.message())
                .await
                .expect("an answer within 5 s")
                .expect("the stream goes on")
                .expect("a message")
        }

        /// Whether anything arrives within `wait`.
        async fn quiet(&mut self, wait: Duration) -> bool {
            tokio::time::timeout(wait, self.rx.message()).await.is_err()
        }
    }

    fn endpoints(response: &DiscoveryResponse) -> usize {
        let cla = ClusterLoadAssignment::decode(response.resources[0].value.as_slice()).unwrap();
        cla.endpoints.iter().map(|l| l.lb_endpoints.len()).sum()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_raw_ads_client_is_answered_by_the_protocol_and_cannot_flood_or_break_the_server() {
        let plane = control_plane();
        let (ns, group, _) = widget_world(plane, "xds-protocol").await;
        let headless = format!("{ns}-headless");
        let port = free_port();
        let ips = |lasts: &[u8]| {
            lasts
                .iter()
                .map(|l| Ipv4Addr::new(10, 0, 0, *l))
                .collect::<Vec<_>>()
        };
        let at = |ready: &[u8], terminating: &[u8]| {
            endpoint_slice(&ns, &headless, port, &ips(ready), &ips(terminating))
        };
        plane.apply(&[at(&[2, 3], &[])]).await;
        // The chart's install, under its RBAC: the EndpointSlices are the broker's to watch.
        let mut values = widget_values(&group, &ns, "30s");
        support::chart::merge(
            &mut values,
            &json!({
                "grpc": { "port": port },
                "xds": { "enabled": true, "drainNoticeSeconds": 0 },
                "access": { "maxStreamsPerCaller": 3 },
            }),
        );
        let broker = plane.deploy(&ns, values).await;
        let service = format!("{headless}.{ns}:{port}");
        let channel = Channel::from_shared(format!("http://{}", broker.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap();

        // Listener, Cluster, endpoints, each answered once; the ACKs are not answered.
        let mut ads = Ads::open(channel.clone()).await.unwrap();
        let target = format!("{headless}.{ns}.svc.cluster.local:{port}");
        ads.ask(LISTENER, &[&target], None).await;
        let lds = ads.next().await;
        assert_eq!(lds.type_url, LISTENER);
        let listener = Listener::decode(lds.resources[0].value.as_slice()).unwrap();
        assert_eq!(listener.name, target);
        ads.ask(LISTENER, &[&target], Some(&lds)).await;
        ads.ask(CLUSTER, &[&service], None).await;
        let cds = ads.next().await;
        assert_eq!((cds.type_url.as_str(), cds.resources.len()), (CLUSTER, 1));
        ads.ask(CLUSTER, &[&service], Some(&cds)).await;
        ads.ask(ENDPOINTS, &[&service], None).await;
        let eds = ads.next().await;
        assert_eq!(endpoints(&eds), 2);
        ads.ask(ENDPOINTS, &[&service], Some(&eds)).await;
        assert!(
            ads.quiet(Duration::from_millis(500)).await,
            "an ACK was answered"
        );
        // The stream in /debug/subscribers: every type ACKed at the version sent.
        let xds_row = async || {
            let (_, body) = http_get(broker.admin, "/debug/subscribers").await;
            let view: Value = serde_json::from_str(&body).unwrap();
            view["subscribers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["protocol"] == "xds")
                .cloned()
                .expect("the ADS stream is listed")
        };
        let row = xds_row().await;
        assert_eq!(
            (&row["status"], &row["acks"]),
            (&json!("SYNCED"), &json!(3)),
            "{row}"
        );
        assert_eq!(row["resources"].as_array().map(Vec::len), Some(3), "{row}");

        // A change of the slice is pushed; only the endpoints.
        plane.apply(&[at(&[2, 3, 4], &[])]).await;
        let pushed = ads.next().await;
        assert_eq!(
            (pushed.type_url.as_str(), endpoints(&pushed)),
            (ENDPOINTS, 3)
        );
        assert_ne!(pushed.version_info, eds.version_info);
        ads.ask(ENDPOINTS, &[&service], Some(&pushed)).await;

        // A NACK of the endpoints: not answered with the same resources, and counted.
        let nack = DiscoveryRequest {
            type_url: ENDPOINTS.into(),
            resource_names: vec![service.clone()],
            version_info: eds.version_info.clone(),
            response_nonce: pushed.nonce.clone(),
            error_detail: Some(RpcStatus {
                code: tonic::Code::InvalidArgument as i32,
                message: "no endpoints this client can use".into(),
                details: vec![],
            }),
            ..Default::default()
        };
        ads.tx.send(nack).await.unwrap();

        // Another service's Listener: answered at once, without it (and after the NACK, which
        // the stream took in order).
        ads.ask(LISTENER, &["other.flags:8015"], Some(&lds)).await;
        let none = ads.next().await;
        assert_eq!(none.type_url, LISTENER, "the NACK was answered");
        assert!(none.resources.is_empty());
        // The NACK counted; the Listener answered since is not ACKed yet: STALE.
        let row = xds_row().await;
        assert_eq!(
            (&row["status"], &row["nacks"]),
            (&json!("STALE"), &json!(1)),
            "{row}"
        );
        let m = metrics(broker.admin).await;
        for (series, sent) in [
            (r#"crd_broker_xds_streams"#, 1.0),
            (r#"crd_broker_xds_responses_total{type="listener"}"#, 2.0),
            (r#"crd_broker_xds_responses_total{type="cluster"}"#, 1.0),
            (r#"crd_broker_xds_responses_total{type="endpoints"}"#, 2.0),
            (r#"crd_broker_xds_nacks_total{type="endpoints"}"#, 1.0),
            (r#"crd_broker_xds_nacks_total{type="listener"}"#, 0.0),
        ] {
            assert_eq!(m.get(series), Some(&sent), "{series}");
        }

        // One caller's flood: its streams stop at its limit (3), RESOURCE_EXHAUSTED naming it.
        let mut held = Vec::new();
        let refused = loop {
            match Ads::open(channel.clone()).await {
                Ok(a) => {
                    a.ask(LISTENER, &[&target], None).await;
                    held.push(a)
                }
                Err(status) => break status,
            }
            assert!(held.len() < 10, "no limit on one caller's xDS streams");
        };
        assert_status(&refused, tonic::Code::ResourceExhausted, "streams");
        assert_eq!(held.len(), 2, "the first stream and two more");

        // Bytes that are no DiscoveryRequest: INVALID_ARGUMENT naming it.
        let other = Channel::from_shared(format!("http://{}", broker.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let garbage = raw_call(
            other.clone(),
            "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources",
            vec![0xff_u8; 64],
            &[],
        )
        .await
        .unwrap_err();
        assert_status(
            &garbage,
            tonic::Code::InvalidArgument,
            "not a DiscoveryRequest",
        );
        // Delta xDS is not served, and says so.
        let (_tx, requests) = mpsc::channel::<DeltaDiscoveryRequest>(1);
        let delta = AggregatedDiscoveryServiceClient::new(other)
            .delta_aggregated_resources(ReceiverStream::new(requests))
            .await
            .unwrap_err();
        assert_status(&delta, tonic::Code::Unimplemented, "state-of-the-world");

        // The first client is still served.
        plane.apply(&[at(&[2], &[3])]).await;
        let pushed = ads.next().await;
        assert_eq!(endpoints(&pushed), 2);

        // A new stream naming the versions it holds (a client back from a broken stream) is
        // sent nothing; then the next change. A fresh stream's first answers are the bytes a
        // resume saves.
        drop(held);
        let again = loop {
            // The dropped streams leave the caller's count as the server sees them end.
            match Ads::open(channel.clone()).await {
                Ok(again) => break again,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        let mut again = again;
        for (held, names) in [(&lds, &target), (&cds, &service), (&pushed, &service)] {
            let resume = DiscoveryRequest {
                type_url: held.type_url.clone(),
                resource_names: vec![names.clone()],
                version_info: held.version_info.clone(),
                ..Default::default()
            };
            again.tx.send(resume).await.unwrap();
        }
        assert!(
            again.quiet(Duration::from_millis(500)).await,
            "a resumed stream was sent what it holds"
        );
        let fresh: usize = [&lds, &cds, &pushed]
            .iter()
            .map(|r| prost::Message::encoded_len(*r))
            .sum();
        println!("xDS reconnect: {fresh} bytes on a fresh stream, 0 resumed");
        let m = metrics(broker.admin).await;
        for r#type in ["listener", "cluster", "endpoints"] {
            let series = format!(r#"crd_broker_xds_resumed_total{{type="{type}"}}"#);
            assert_eq!(m.get(&series), Some(&1.0), "{series}");
        }
        plane.apply(&[at(&[2, 3], &[])]).await;
        let change = again.next().await;
        assert_eq!(
            (change.type_url.as_str(), endpoints(&change)),
            (ENDPOINTS, 2)
        );
    }
}
