//! Balancing as real clients do it: replicas on 127.0.0.2–5 behind one DNS name (as a headless
//! Service is), and the real gRPC clients — C-core (grpcio), @grpc/grpc-js and grpc-go (a
//! client of ours on it, built by `scripts/peers`) — with a `dns:` target and `round_robin`. Streams spread over the replicas; after the maximum connection age the client
//! re-resolves and a replica added to DNS takes its share; a replica that dies loses its streams
//! to the others.

mod support;

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crd_broker::broker::{Config, Listeners, Running};
use crd_broker::source::kubernetes::Kubernetes;
use fake_apiserver::FakeApiServer;
use prost::Message;
use support::control_plane::dns::Dns;
use support::*;
use tokio::net::TcpListener;

const NAME: &str = "broker.test";
const STREAMS: usize = 30;

fn python() -> PathBuf {
    python_with("grpc")
}

fn ip(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, last)
}

/// A replica on `ip:port`, its connections aged after `age`.
async fn replica(
    fake: &FakeApiServer,
    ip: Ipv4Addr,
    port: u16,
    age: Duration,
) -> Running<Kubernetes> {
    let listener = TcpListener::bind((ip, port))
        .await
        .expect("the replica's address");
    let mut config = Config {
        linger: Duration::from_secs(30),
        ..Config::default()
    };
    config.transport.max_connection_age = Some(age);
    config.transport.max_connection_age_grace = Duration::from_secs(1);
    config.transport.shutdown_grace = Duration::ZERO;
    Running::start_with(
        Listeners::tcp(listener),
        Kubernetes::new(kube_client(fake), vec![]),
        config,
    )
    .expect("the replica starts")
}

/// Streams a replica serves now.
fn streams(r: &Running<Kubernetes>) -> usize {
    r.registry.watches().iter().map(|w| w.subscribers).sum()
}

async fn settle(what: &str, mut done: impl FnMut() -> bool) -> Duration {
    eventually(what, Duration::from_secs(30), async || done()).await
}

fn node_client() -> tokio::process::Command {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/node");
    assert!(
        dir.join("node_modules/@grpc/grpc-js").exists(),
        "{} has no @grpc/grpc-js: run the README's test command (scripts/test), which installs it",
        dir.display()
    );
    let mut node = tokio::process::Command::new("node");
    node.arg(dir.join("balance.js"))
        .env("GRPC_NODE_USE_ALTERNATIVE_RESOLVER", "true");
    node
}

fn grpcio_client() -> tokio::process::Command {
    let mut python = tokio::process::Command::new(python());
    python
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/python/grpcio_balance.py"
        ))
        .env("GRPC_DNS_RESOLVER", "ares");
    python
}

/// grpc-go's `grpc.NewClient("dns://…")`, with `round_robin` in its default service config.
fn grpc_go_client() -> tokio::process::Command {
    tokio::process::Command::new(peer("grpc-go"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_go_round_robin_over_dns_spreads_rebalances_and_fails_over() {
    balances(grpc_go_client()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_round_robin_over_dns_spreads_rebalances_and_fails_over() {
    balances(grpcio_client()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_js_round_robin_over_dns_spreads_rebalances_and_fails_over() {
    balances(node_client()).await;
}

/// `client` (a script taking TARGET STREAMS REQUEST_HEX MIN_RESOLUTION_MS) balancing its
/// streams over the replicas.
async fn balances(mut client: tokio::process::Command) {
    let fake = fake().await;
    fake.apply(flag("demo", "on")).unwrap();
    let port = free_port();
    let age = Duration::from_secs(3);
    let mut replicas = Vec::new();
    for last in [2, 3, 4] {
        replicas.push(replica(&fake, ip(last), port, age).await);
    }
    let dns = Dns::start(NAME, &[ip(2), ip(3), ip(4)]).await;
    let target = format!("dns://{}/{NAME}:{port}", dns.addr);
    let request = hex(&request(&[&demo("demo")]).encode_to_vec());
    let mut client = client
        .args([&target, &STREAMS.to_string(), &request, "1000"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .unwrap();

    // Spread over the three.
    settle("every stream is served", || {
        replicas.iter().map(streams).sum::<usize>() == STREAMS
    })
    .await;
    let spread: Vec<usize> = replicas.iter().map(streams).collect();
    println!("streams per replica: {spread:?}");
    assert!(spread.iter().all(|&n| n >= STREAMS / 6), "{spread:?}");

    // A fourth replica in DNS takes its share once connections age and the client re-resolves.
    replicas.push(replica(&fake, ip(5), port, age).await);
    dns.set(&[ip(2), ip(3), ip(4), ip(5)]);
    let took = settle("the new replica takes its share", || {
        streams(&replicas[3]) >= STREAMS / 8
    })
    .await;
    println!("the fourth replica served streams {took:?} after it joined");
    // One more age: every connection has been re-made with four addresses to pick from.
    tokio::time::sleep(age + Duration::from_secs(2)).await;
    settle("every stream is served again", || {
        replicas.iter().map(streams).sum::<usize>() == STREAMS
    })
    .await;
    let spread: Vec<usize> = replicas.iter().map(streams).collect();
    let mean = STREAMS as f64 / 4.0;
    let max = *spread.iter().max().unwrap() as f64;
    println!(
        "after one more age, per replica {spread:?}, max/mean {:.2}",
        max / mean
    );
    assert!(spread.iter().all(|&n| n > 0), "{spread:?}");

    // A replica dies (and leaves DNS): its streams move to the others.
    let dead = replicas.remove(0);
    dns.set(&[ip(3), ip(4), ip(5)]);
    let died = Instant::now();
    dead.shutdown.cancel();
    settle("the dead replica's streams moved", || {
        replicas.iter().map(streams).sum::<usize>() == STREAMS
    })
    .await;
    println!(
        "streams moved {:?} after a replica died: {:?}",
        died.elapsed(),
        replicas.iter().map(streams).collect::<Vec<_>>()
    );
    drop(client.stdin.take());
    let _ = client.kill().await;
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_flagd_provider_on_a_dns_host_keeps_evaluating_through_ages_and_a_lost_replica()
{
    use tokio::io::{AsyncBufReadExt, BufReader};
    let fake = fake().await;
    fake.apply(demo_manifest()).unwrap();
    let port = free_port();
    let age = Duration::from_secs(2);
    let mut replicas = Vec::new();
    for last in [2, 3] {
        replicas.push(replica(&fake, ip(last), port, age).await);
    }
    let dns = Dns::start(NAME, &[ip(2), ip(3)]).await;
    let mut child = tokio::process::Command::new(python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/python/flagd_dns_check.py"
        ))
        .arg("20")
        .env("FLAGD_RESOLVER", "in-process")
        .env("FLAGD_HOST", format!("dns://{}/{NAME}", dns.addr))
        .env("FLAGD_SYNC_PORT", port.to_string())
        .env("FLAGD_SOURCE_SELECTOR", "core.openfeature.dev/default/demo")
        .env("GRPC_DNS_RESOLVER", "ares")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(Duration::from_secs(40), lines.next_line())
        .await
        .expect("the provider becomes ready")
        .unwrap();
    assert_eq!(ready.as_deref(), Some("READY"));
    let ready = Instant::now();
    // Two ages pass; then the replica it is on dies (and leaves DNS); then the flag changes.
    tokio::time::sleep(age * 2).await;
    settle("the provider's stream is on a replica", || {
        replicas.iter().map(streams).sum::<usize>() == 1
    })
    .await;
    let serving: Vec<usize> = replicas.iter().map(streams).collect();
    let on = serving.iter().position(|&n| n > 0).unwrap();
    let survivor = ip(if on == 0 { 3 } else { 2 });
    dns.set(&[survivor]);
    replicas.remove(on).shutdown.cancel();
    tokio::time::sleep(Duration::from_secs(1)).await;
    fake.merge_patch(
        GV,
        "featureflags",
        "default",
        "demo",
        serde_json::json!({ "spec": { "flagSpec": { "flags": { "new-checkout": { "defaultVariant": "on" } } } } }),
    )
    .unwrap();
    let changed_at = ready.elapsed().as_secs_f64();
    let summary = tokio::time::timeout(Duration::from_secs(40), async {
        let mut last = None;
        while let Ok(Some(line)) = lines.next_line().await {
            last = Some(line);
        }
        last
    })
    .await
    .expect("the check ends")
    .expect("a summary");
    let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
    println!(
        "the provider on a dns host: {summary}; the change was made {changed_at:.2} s after READY (streams per replica before the loss: {serving:?})"
    );
    assert_eq!(summary["errors"], 0, "{summary}");
    assert_eq!(summary["saw_the_change"], true, "{summary}");
    assert!(summary["evaluations"].as_u64().unwrap() > 100, "{summary}");
}
