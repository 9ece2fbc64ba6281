//! The OpenFeature Operator's two routes to crd-broker (docs/deploy.md), each with the broker run
//! exactly as the manifest starts it and the clients configured as the operator configures them:
//!
//! (a) the operator's own `flagd-proxy` Deployment running the crd-broker image: `start
//!     --management-port 8016` and nothing else, so gRPC on 8015 on every address, IPv6 and
//!     IPv4, and gRPC health on the management port;
//! (b) FeatureFlagSources with `provider: grpc` (and InProcessConfigurations) pointing at the
//!     Service of the broker the Helm chart deploys: the container's args and env as the chart
//!     renders them.
//!
//! The operator's flagd sidecar is the real flagd daemon (`scripts/peers`), started with the
//! arguments the operator's webhook gives it (v0.9.2, `internal/common/flagdinjector`); a client
//! of ours that sends what its `grpc` sync sends checks both address families. The in-process
//! provider is the real Python one. The operator's manager itself, deploying the broker and
//! injecting the sidecar, runs in `operator_manager.rs`.

mod support;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use crd_broker::pb::flagd;
use crd_broker::pb::flagd::flag_sync_service_client::FlagSyncServiceClient;
use serde_json::{Value, json};
use support::chart::{container, render};
use support::control_plane::dns;
use support::flagd::Flagd;
use support::*;
use tokio::process::{Child, Command};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const BIN: &str = env!("CARGO_BIN_EXE_crd-broker");
const SELECTOR: &str = "core.openfeature.dev/default/demo";

/// The broker binary with `args` (and `env`) against the fake behind `kubeconfig`, which stands
/// for the in-cluster service account.
fn broker(kubeconfig: &std::path::Path, args: &[String], env: &[(String, String)]) -> Child {
    Command::new(BIN)
        .args(args)
        .env_clear()
        .env("KUBECONFIG", kubeconfig)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .expect("the broker starts")
}

/// `grpc.health.v1.Health/Check` of the overall service at `addr`, once it answers SERVING.
async fn serving(addr: SocketAddr) {
    eventually(
        &format!("gRPC health SERVING at {addr}"),
        Duration::from_secs(20),
        async || {
            let Ok(channel) = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect()
                .await
            else {
                return false;
            };
            let answer = HealthClient::new(channel)
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await;
            answer.is_ok_and(|r| r.into_inner().status() == ServingStatus::Serving)
        },
    )
    .await;
}

/// The next configuration on `stream`.
async fn next_config(stream: &mut tonic::Streaming<flagd::SyncFlagsResponse>) -> Value {
    let next = tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("a configuration in time")
        .unwrap()
        .unwrap();
    serde_json::from_str(&next.flag_configuration).unwrap()
}

/// What the operator's flagd sidecar does for a `grpc` source: SyncFlags with the selector in
/// the body (no `flagd-selector` header) and the source's providerID (empty by default); the
/// first configuration.
async fn sidecar_sync(addr: SocketAddr) -> (tonic::Streaming<flagd::SyncFlagsResponse>, Value) {
    let mut client = FlagSyncServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("the sidecar connects");
    let mut stream = client
        .sync_flags(flagd::SyncFlagsRequest {
            provider_id: String::new(),
            selector: SELECTOR.into(),
        })
        .await
        .expect("SyncFlags is served")
        .into_inner();
    let first = next_config(&mut stream).await;
    (stream, first)
}

/// The flagd Service's name in the operator's sidecar sources (`flagd-proxy-svc` in the
/// operator's namespace, the default cluster domain).
const PROXY_SERVICE: &str = "flagd-proxy-svc.open-feature-operator-system.svc.cluster.local";

/// The flagd sidecar the operator's webhook injects into a pod whose FeatureFlagSource has
/// `provider: flagd-proxy` for `default/demo`: `start --management-port 8014 --port 8013
/// --sources [{"uri":"flagd-proxy-svc.<ns>.svc.cluster.local:8015","provider":"grpc",
/// "selector":"core.openfeature.dev/default/demo"}]`. The Service's name is resolved by `dns`
/// (the target names it, as cluster DNS would answer it); the OFREP and sync ports, which the
/// webhook leaves at flagd's defaults (8016 and 8015, the broker's here), are free ones.
async fn operator_sidecar(dns: &dns::Dns) -> Flagd {
    let sources = json!([{
        "uri": format!("dns://{}/{PROXY_SERVICE}:8015", dns.addr),
        "provider": "grpc",
        "selector": SELECTOR,
    }])
    .to_string();
    let args = [
        "start",
        "--management-port",
        "8014",
        "--port",
        "8013",
        "--sources",
        &sources,
    ];
    Flagd::start_with(&args).await
}

/// The real Python provider, configured only by the environment an InProcessConfiguration
/// injects (spec.host, spec.port, the defaults of the rest): ready, evaluates `f`, and sees it
/// change. Its summary.
async fn in_process_provider(fake: &str, host: &str, port: u16) -> Value {
    let python = python_with("openfeature.contrib.provider.flagd");
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/flagd_operator_check.py"
    );
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        Command::new(python)
            .args([script, fake, "default", "demo"])
            .env_clear()
            .env("FLAGD_HOST", host)
            .env("FLAGD_PORT", port.to_string())
            .env("FLAGD_TLS", "false")
            .env("FLAGD_CACHE", "lru")
            .env("FLAGD_MAX_CACHE_SIZE", "1000")
            .env("FLAGD_RESOLVER", "in-process")
            .env("FLAGD_SOURCE_SELECTOR", SELECTOR)
            .kill_on_drop(true)
            .leashed()
            .output(),
    )
    .await
    .expect("the provider check ends by itself")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the provider check failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap()
}

#[tokio::test]
async fn the_operators_flagd_proxy_deployment_runs_the_broker_image_unchanged() {
    let (fake, _dir, kubeconfig) = fake_with_kubeconfig().await;
    fake.apply(flag("demo", "on")).unwrap();
    // The container OFO's FlagdProxyHandler creates: `Args: start --management-port
    // <FLAGD_PROXY_MANAGEMENT_PORT>` (8016 by default), no --port, no env, no probes.
    let args = ["start", "--management-port", "8016"].map(String::from);
    let _broker = broker(&kubeconfig, &args, &[]);
    // gRPC health on the management port, and both address families.
    for host in ["127.0.0.1", "[::1]"] {
        serving(format!("{host}:8016").parse().unwrap()).await;
    }
    // The sidecars OFO injects for `provider: flagd-proxy` reach flagd-proxy-svc:8015.
    let mut streams = Vec::new();
    for host in ["127.0.0.1", "[::1]"] {
        let (stream, config) = sidecar_sync(format!("{host}:8015").parse().unwrap()).await;
        assert_eq!(config["flags"]["f"]["defaultVariant"], "on", "{host}");
        streams.push(stream);
    }
    let admin: SocketAddr = "127.0.0.1:8016".parse().unwrap();
    assert_eq!(
        get(&metrics(admin).await, "sync_active_streams"),
        2.0,
        "flagd-proxy's gauge, under its name"
    );
    // The real flagd sidecar, as the webhook configures it, evaluates the FeatureFlag.
    let dns = dns::Dns::start(PROXY_SERVICE, &[std::net::Ipv4Addr::LOCALHOST]).await;
    let mut sidecar = operator_sidecar(&dns).await;
    sidecar
        .until("f", json!(true), Duration::from_secs(30))
        .await;
    let summary = in_process_provider(&fake.url(), "[::1]", 8015).await;
    println!("in-process provider through the flagd-proxy Deployment: {summary}");
    // Both sidecar streams saw the provider's change, and so does the flagd sidecar.
    for stream in &mut streams {
        assert_eq!(
            next_config(stream).await["flags"]["f"]["defaultVariant"],
            "off"
        );
    }
    let took = sidecar
        .until("f", json!(false), Duration::from_secs(2))
        .await;
    println!("the flagd sidecar evaluated the provider's change {took:?} after the streams");
    drop((streams, sidecar));
    eventually("the gauge falls back", WAIT, async || {
        get(&metrics(admin).await, "sync_active_streams") == 0.0
    })
    .await;
}

#[tokio::test]
async fn feature_flag_sources_with_provider_grpc_reach_the_chart_s_broker() {
    let (fake, _dir, kubeconfig) = fake_with_kubeconfig().await;
    fake.apply(flag("demo", "on")).unwrap();
    // The chart's defaults, with ports of this test's own (8015 and 8016 are the other test's).
    let (grpc, admin) = (free_port(), free_port());
    let docs = render(json!({ "grpc": { "port": grpc }, "admin": { "port": admin } })).unwrap();
    let container = container(&docs);
    let args: Vec<String> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    let env: Vec<(String, String)> = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let value = e["value"]
                .as_str()
                .expect("plain env values in the default chart");
            (e["name"].as_str().unwrap().to_string(), value.to_string())
        })
        .collect();
    // The chart identifies callers by their pod (peer-pod,token): the workload here is the pod
    // default/app at 127.0.0.2, which this test's clients connect from through a forwarder (a
    // connection from the broker's own address is no pod's).
    run_pod(&fake, "default", "app", "app", "127.0.0.2");
    let _broker = broker(&kubeconfig, &args, &env);
    serving(SocketAddr::from(([127, 0, 0, 1], grpc))).await;
    let from_app = forwarder("127.0.0.2", SocketAddr::from(([127, 0, 0, 1], grpc))).await;

    // A FeatureFlagSource `provider: grpc, source: flags-crd-broker.openfeature.svc:<port>,
    // selector: core.openfeature.dev/default/demo`: the sidecar's sync.
    let (mut stream, config) = sidecar_sync(from_app).await;
    assert_eq!(config["flags"]["f"]["defaultVariant"], "on");
    // An InProcessConfiguration `host: flags-crd-broker.openfeature.svc, port: <port>`.
    let summary = in_process_provider(&fake.url(), "127.0.0.1", from_app.port()).await;
    println!("in-process provider through the chart's Service: {summary}");
    assert_eq!(
        next_config(&mut stream).await["flags"]["f"]["defaultVariant"],
        "off"
    );
    // The same health on the admin port, where the chart's probes and the operator look.
    serving(SocketAddr::from(([127, 0, 0, 1], admin))).await;
}
