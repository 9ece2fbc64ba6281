//! The broker as real processes: drain on SIGTERM under load, a second signal, traces to an
//! OTLP collector, and several replicas that clients spread over and fail over between.

mod support;

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crd_broker::pb::subscribe_response::Event;
use support::*;
use tokio::process::{Child, Command};
use tokio::sync::Mutex;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const BIN: &str = env!("CARGO_BIN_EXE_crd-broker");

struct Process {
    child: Child,
    grpc: SocketAddr,
    admin: SocketAddr,
}

impl Process {
    fn pid(&self) -> u32 {
        self.child.id().expect("running")
    }

    fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

/// Starts `crd-broker serve` on loopback ports against the fake, and waits until it is ready.
async fn spawn(kubeconfig: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Process {
    let (grpc, admin) = (free_port(), free_port());
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--grpc-addr",
            &format!("127.0.0.1:{grpc}"),
            "--admin-addr",
            &format!("127.0.0.1:{admin}"),
        ])
        .args(["--readiness-interval", "200ms"])
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .expect("the broker starts");
    let admin: SocketAddr = ([127, 0, 0, 1], admin).into();
    wait_ready(admin, &mut child).await;
    Process {
        child,
        grpc: ([127, 0, 0, 1], grpc).into(),
        admin,
    }
}

/// Waits until the broker answers `/readyz` with 200. A broker that exits first fails the test
/// at once, with its exit status, rather than after the wait.
async fn wait_ready(admin: SocketAddr, child: &mut Child) {
    let ready = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let Ok(Ok((200, _))) =
                tokio::time::timeout(Duration::from_secs(1), try_http_get(admin, "/readyz")).await
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    tokio::select! {
        ready = ready => assert!(ready.is_ok(), "the broker becomes ready"),
        exit = child.wait() => panic!("the broker exited ({exit:?}) before it was ready"),
    }
}

async fn health_watch(addr: SocketAddr) -> tonic::Streaming<tonic_health::pb::HealthCheckResponse> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_real_process_under_load() {
    let (fake, _dir, kubeconfig) = fake_with_kubeconfig().await;
    fake.apply(flag("demo", "v0")).unwrap();
    let broker = spawn(
        &kubeconfig,
        &["--shutdown-grace", "4s", "--linger", "0s"],
        &[],
    )
    .await;

    // 50 subscribers over 5 connections, all reading, while the resource changes every 10 ms.
    let endings = Arc::new(Mutex::new(Vec::new()));
    let received = Arc::new(AtomicUsize::new(0));
    let mut readers = Vec::new();
    for _ in 0..5 {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", broker.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap();
        for _ in 0..10 {
            let mut client = crd_broker::pb::broker_client::BrokerClient::new(channel.clone());
            let mut s = subscribe(&mut client, &[&demo("demo")]).await;
            let (endings, received) = (endings.clone(), received.clone());
            readers.push(tokio::spawn(async move {
                loop {
                    match s.message().await {
                        Ok(Some(_)) => {
                            received.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(None) => {
                            endings.lock().await.push(Code::Ok);
                            return;
                        }
                        Err(status) => {
                            endings.lock().await.push(status.code());
                            return;
                        }
                    }
                }
            }));
        }
    }
    let mut health = health_watch(broker.grpc).await;
    assert_eq!(
        health.message().await.unwrap().unwrap().status(),
        ServingStatus::Serving
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let patching = {
        let stop = stop.clone();
        let fake = &fake;
        async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let _ = fake.merge_patch(
                    GV,
                    "featureflags",
                    "default",
                    "demo",
                    variant_patch(&format!("v{i}")),
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    let signalled = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(received.load(Ordering::Relaxed) > 50, "under load");
        let t0 = tokio::time::Instant::now();
        broker.signal("TERM");
        // Health goes down at once, on the watch that is still open.
        let down = tokio::time::timeout(Duration::from_secs(2), health.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(down.status(), ServingStatus::NotServing);
        // Readiness too, while the process drains.
        let (code, body) = http_get(broker.admin, "/readyz").await;
        assert_eq!(code, 503, "{body}");
        assert!(body.contains("shutting down"));
        // No new connections.
        assert!(
            tokio::net::TcpStream::connect(broker.grpc).await.is_err(),
            "the listener is closed"
        );
        stop.store(true, Ordering::Relaxed);
        t0
    };
    let (t0, ()) = tokio::join!(signalled, patching);
    for r in readers {
        tokio::time::timeout(Duration::from_secs(5), r)
            .await
            .expect("every stream ends")
            .unwrap();
    }
    let endings = endings.lock().await.clone();
    assert_eq!(endings.len(), 50);
    assert!(
        endings.iter().all(|c| *c == Code::Unavailable),
        "every stream ends with UNAVAILABLE, never OK: {endings:?}"
    );
    let mut child = broker.child;
    let status = tokio::time::timeout(Duration::from_secs(6), child.wait())
        .await
        .expect("exits within the grace")
        .unwrap();
    assert!(status.success(), "{status:?}");
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "exited {took:?} after SIGTERM (grace 4 s)"
    );
    assert!(
        fake.wait_for(WAIT, |f| f.open_watches() == 0).await,
        "its watch is gone from the API server"
    );
}

#[tokio::test]
async fn a_second_signal_exits_at_once() {
    let (fake, _dir, kubeconfig) = fake_with_kubeconfig().await;
    fake.apply(flag("demo", "on")).unwrap();
    let broker = spawn(&kubeconfig, &["--shutdown-grace", "60s"], &[]).await;
    // A health watch holds its connection open through the drain, which would last the grace.
    let mut health = health_watch(broker.grpc).await;
    health.message().await.unwrap();
    broker.signal("TERM");
    assert_eq!(
        health.message().await.unwrap().unwrap().status(),
        ServingStatus::NotServing
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t0 = tokio::time::Instant::now();
    broker.signal("TERM");
    let mut child = broker.child;
    let status = tokio::time::timeout(Duration::from_secs(3), child.wait())
        .await
        .expect("exits at once")
        .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert_eq!(status.code(), Some(130));
}

mod collector {
    use std::sync::{Arc, Mutex};

    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
        TraceService, TraceServiceServer,
    };
    use opentelemetry_proto::tonic::collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    };
    use opentelemetry_proto::tonic::common::v1::any_value::Value;

    /// A span received.
    #[derive(Debug, Clone)]
    pub struct Span {
        pub name: String,
        /// Attributes as key=value.
        pub attributes: Vec<(String, String)>,
        /// Hex, as in `traceparent`.
        pub trace_id: String,
        pub parent_span_id: String,
    }

    impl Span {
        pub fn has(&self, key: &str, value: &str) -> bool {
            self.attributes.iter().any(|(k, v)| k == key && v == value)
        }
    }

    pub type Spans = Arc<Mutex<Vec<Span>>>;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn record(spans: &Spans, request: ExportTraceServiceRequest) {
        let mut spans = spans.lock().unwrap();
        for rs in request.resource_spans {
            for ss in rs.scope_spans {
                for span in ss.spans {
                    let attributes = span
                        .attributes
                        .iter()
                        .map(|kv| {
                            let v = match kv.value.as_ref().and_then(|v| v.value.clone()) {
                                Some(Value::StringValue(s)) => s,
                                other => format!("{other:?}"),
                            };
                            (kv.key.clone(), v)
                        })
                        .collect();
                    spans.push(Span {
                        name: span.name,
                        attributes,
                        trace_id: hex(&span.trace_id),
                        parent_span_id: hex(&span.parent_span_id),
                    });
                }
            }
        }
    }

    #[derive(Clone, Default)]
    pub struct Collector(pub Spans);

    #[tonic::async_trait]
    impl TraceService for Collector {
        async fn export(
            &self,
            request: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            record(&self.0, request.into_inner());
            Ok(tonic::Response::new(ExportTraceServiceResponse {
                partial_success: None,
            }))
        }
    }

    /// Serves an OTLP/gRPC collector on 127.0.0.1:0; its address and what it received.
    pub async fn start() -> (std::net::SocketAddr, Spans) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let collector = Collector::default();
        let spans = collector.0.clone();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(collector))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        (addr, spans)
    }

    /// Serves an OTLP/HTTP collector (`POST /v1/traces`, protobuf) on 127.0.0.1:0.
    pub async fn start_http() -> (std::net::SocketAddr, Spans) {
        use axum::body::Bytes;
        use axum::http::{HeaderMap, StatusCode};
        use prost::Message;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let spans = Spans::default();
        let received = spans.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |headers: HeaderMap, body: Bytes| {
                let received = received.clone();
                async move {
                    let protobuf = headers
                        .get("content-type")
                        .is_some_and(|v| v == "application/x-protobuf");
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(request) if protobuf => {
                            record(&received, request);
                            StatusCode::OK
                        }
                        _ => StatusCode::BAD_REQUEST,
                    }
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        (addr, spans)
    }
}

#[tokio::test]
async fn spans_for_subscriptions_and_watches_reach_an_otlp_collector_configured_by_otel_env() {
    let (fake, _dir, kubeconfig) = fake_with_kubeconfig().await;
    fake.apply(flag("demo", "on")).unwrap();
    let selector = "featureflags.v1beta1.core.openfeature.dev/default/demo";
    // The caller's trace, which the subscription continues.
    let (trace, parent) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    for protocol in ["grpc", "http/protobuf"] {
        let (collector, spans) = if protocol == "grpc" {
            collector::start().await
        } else {
            collector::start_http().await
        };
        let endpoint = format!("http://{collector}");
        let env = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ("OTEL_SERVICE_NAME", "crd-broker-test"),
        ];
        let broker = spawn(&kubeconfig, &["--linger", "0s"], &env).await;
        let mut client = connect(broker.grpc).await;
        let mut traced = tonic::Request::new(request(&[&demo("demo")]));
        traced.metadata_mut().insert(
            "traceparent",
            format!("00-{trace}-{parent}-01").parse().unwrap(),
        );
        let mut s = client.subscribe(traced).await.unwrap().into_inner();
        next(&mut s).await;
        drop(s);
        assert!(fake.wait_for(WAIT, |f| f.open_watches() == 0).await);
        // Exported as they end (in batches every 100 ms), not only at exit.
        eventually(
            &format!("{protocol}: both spans exported"),
            WAIT,
            async || {
                let spans = spans.lock().unwrap();
                ["subscription", "watch"]
                    .iter()
                    .all(|name| spans.iter().any(|s| s.name == *name))
            },
        )
        .await;
        broker.signal("TERM");
        let mut child = broker.child;
        child.wait().await.unwrap();
        let spans = spans.lock().unwrap().clone();
        let subscription = spans
            .iter()
            .find(|s| s.name == "subscription" && s.has("selector", selector))
            .unwrap_or_else(|| {
                panic!("{protocol}: a span per subscription, with the CR: {spans:?}")
            });
        assert!(
            subscription.has("caller", "anonymous (127.0.0.1)"),
            "the caller in the subscription's span: {subscription:?}"
        );
        assert_eq!(
            (
                subscription.trace_id.as_str(),
                subscription.parent_span_id.as_str()
            ),
            (trace, parent),
            "{protocol}: the subscription continues the caller's traceparent"
        );
        assert!(
            spans
                .iter()
                .any(|s| s.name == "watch" && s.has("selector", selector)),
            "{protocol}: a span per watch, with the CR: {spans:?}"
        );
    }

    // An unsupported protocol is refused with the reason, and the broker runs on untraced.
    let (refused_at, refused) = collector::start().await;
    let endpoint = format!("http://{refused_at}");
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
    ];
    let broker = spawn(&kubeconfig, &["--linger", "0s"], &env).await;
    let mut client = connect(broker.grpc).await;
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    next(&mut s).await;
    broker.signal("TERM");
    broker.child.wait_with_output().await.unwrap();
    assert!(refused.lock().unwrap().is_empty());

    // Without the OTEL_* variables nothing is exported.
    let (quiet_collector, quiet) = collector::start().await;
    let broker = spawn(&kubeconfig, &["--linger", "0s"], &[]).await;
    let mut client = connect(broker.grpc).await;
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    next(&mut s).await;
    drop(s);
    broker.signal("TERM");
    let mut child = broker.child;
    child.wait().await.unwrap();
    assert!(
        quiet.lock().unwrap().is_empty(),
        "nothing reached {quiet_collector}"
    );
}

/// A subscriber that spreads over replicas: each (re)subscription goes to the next address.
async fn roaming_subscriber(
    addresses: Arc<Mutex<Vec<SocketAddr>>>,
    start: usize,
    latest: Arc<Mutex<Vec<String>>>,
    slot: usize,
) {
    let mut turn = start;
    loop {
        let addr = {
            let a = addresses.lock().await;
            a[turn % a.len()]
        };
        turn += 1;
        let Ok(channel) = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
        else {
            continue;
        };
        let mut client = crd_broker::pb::broker_client::BrokerClient::new(channel);
        let Ok(response) = client.subscribe(request(&[&demo("demo")])).await else {
            continue;
        };
        let mut s = response.into_inner();
        while let Ok(Some(r)) = s.message().await {
            if r.event() == Event::Snapshot || r.event() == Event::Updated {
                latest.lock().await[slot] = format!("{addr} {}", variant(&r));
            }
        }
    }
}

async fn subscribers_on(admin: SocketAddr) -> u64 {
    let (_, body) = http_get(admin, "/debug/watches").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    v["watches"]
        .as_array()
        .map(|w| w.iter().filter_map(|x| x["subscribers"].as_u64()).sum())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_subscribers_fail_over_and_a_new_one_takes_its_share() {
    let (fake, _dir, kubeconfig) = fake_with_kubeconfig().await;
    fake.apply(flag("demo", "v0")).unwrap();
    let args = [
        "--max-connection-age",
        "2s",
        "--max-connection-age-grace",
        "1s",
        "--linger",
        "0s",
    ];
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(spawn(&kubeconfig, &args, &[]).await);
    }
    let addresses = Arc::new(Mutex::new(
        replicas.iter().map(|r| r.grpc).collect::<Vec<_>>(),
    ));
    const CLIENTS: usize = 30;
    let latest = Arc::new(Mutex::new(vec![String::new(); CLIENTS]));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| tokio::spawn(roaming_subscriber(addresses.clone(), i, latest.clone(), i)))
        .collect();
    let all_on = |want: &'static str| {
        let latest = latest.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(15), async {
                loop {
                    if latest
                        .lock()
                        .await
                        .iter()
                        .all(|l| l.ends_with(&format!(" {want}")))
                    {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await
            .is_ok()
        }
    };
    assert!(all_on("v0").await, "every subscriber has the state");
    assert_eq!(fake.open_watches(), 3, "one watch per replica");

    // Kill one replica: its subscribers reconnect to the others and end on the latest state.
    let killed = replicas.remove(0);
    killed.signal("KILL");
    fake.merge_patch(GV, "featureflags", "default", "demo", variant_patch("v1"))
        .unwrap();
    assert!(
        all_on("v1").await,
        "every subscriber ends on the latest state: {:?}",
        latest.lock().await
    );
    addresses.lock().await.retain(|a| *a != killed.grpc);

    // A fourth replica: with a 2 s maximum connection age it takes subscribers within about one age.
    let fourth = spawn(&kubeconfig, &args, &[]).await;
    addresses.lock().await.push(fourth.grpc);
    let started = tokio::time::Instant::now();
    let took = tokio::time::timeout(Duration::from_secs(10), async {
        while subscribers_on(fourth.admin).await == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        started.elapsed()
    })
    .await
    .expect("the new replica takes subscribers");
    assert!(
        took < Duration::from_secs(4),
        "took {took:?} with a 2 s age"
    );
    fake.merge_patch(GV, "featureflags", "default", "demo", variant_patch("v2"))
        .unwrap();
    assert!(all_on("v2").await);
    for c in clients {
        c.abort();
    }
}

#[tokio::test]
async fn tls_flags_serve_mtls_and_pick_up_rotated_files_by_themselves() {
    let (fake, _dir, kubeconfig) = fake_with_kubeconfig().await;
    fake.apply(flag("demo", "on")).unwrap();
    let certs = tempfile::tempdir().unwrap();
    let first = pki("first");
    write_tls_files(certs.path(), &first);
    let path = |name: &str| certs.path().join(name).display().to_string();
    let broker = spawn(
        &kubeconfig,
        &[
            "--tls-cert",
            &path("tls.crt"),
            "--tls-key",
            &path("tls.key"),
            "--tls-client-ca",
            &path("ca.crt"),
            "--tls-reload-interval",
            "100ms",
        ],
        &[],
    )
    .await;
    let mut s = tls_demo_stream(broker.grpc, &first).await;
    assert!(is(&next(&mut s).await, Event::Snapshot, "on"));
    assert!(
        refused(broker.grpc, &first, false).await,
        "a client without a certificate is refused"
    );

    // Rotate the files and do nothing else: the broker notices by itself.
    let second = pki("second");
    write_tls_files(certs.path(), &second);
    let rotated = tokio::time::timeout(WAIT, async {
        loop {
            if let Ok(mut c) = tls_client(broker.grpc, &second, true).await
                && let Ok(r) = c.subscribe(request(&[&demo("demo")])).await
            {
                return r.into_inner();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let mut r = rotated.expect("clients of the new CA are served within the wait");
    assert!(is(&next(&mut r).await, Event::Snapshot, "on"));
    // The connection made before the rotation keeps its stream.
    fake.merge_patch(GV, "featureflags", "default", "demo", variant_patch("off"))
        .unwrap();
    assert!(is(&next(&mut s).await, Event::Updated, "off"));
    assert!(is(&next(&mut r).await, Event::Updated, "off"));
}

#[tokio::test]
async fn with_grpc_addr_none_it_serves_on_the_unix_socket_alone() {
    let (fake, _dir, kubeconfig) = fake_with_kubeconfig().await;
    fake.apply(flag("demo", "on")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("broker.sock");
    let admin: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--grpc-addr",
            "none",
            "--readiness-interval",
            "200ms",
        ])
        .arg("--grpc-socket")
        .arg(&socket)
        .args(["--admin-addr", &admin.to_string()])
        .env("KUBECONFIG", &kubeconfig)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .expect("the broker starts");
    wait_ready(admin, &mut child).await;

    let pid = child.id().unwrap();
    assert_eq!(
        listening_tcp_ports(pid),
        vec![admin.port()],
        "the admin port is its only TCP listener"
    );

    let mut client = connect_unix(&socket).await;
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    assert!(is(&next(&mut s).await, Event::Snapshot, "on"));
    fake.merge_patch(GV, "featureflags", "default", "demo", variant_patch("off"))
        .unwrap();
    assert!(is(&next(&mut s).await, Event::Updated, "off"));

    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = tokio::time::timeout(WAIT, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "{exit:?}");
    assert!(!socket.exists(), "the socket file is removed at exit");
}

/// The TCP ports a process listens on, from its socket inodes and /proc/net/tcp{,6}.
fn listening_tcp_ports(pid: u32) -> Vec<u16> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let mut ports = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address is field 1 (addr:PORT in hex), st field 3 (0A = LISTEN), inode 9.
            if f.len() > 9 && f[3] == "0A" && inodes.iter().any(|i| i == f[9]) {
                let port = f[1].rsplit(':').next().unwrap();
                ports.push(u16::from_str_radix(port, 16).unwrap());
            }
        }
    }
    ports.sort();
    ports
}

#[tokio::test]
async fn environment_variables_configure_serve_without_flags() {
    use tokio::io::AsyncBufReadExt;
    let (fake, _dir, kubeconfig) = fake_with_kubeconfig().await;
    fake.apply(flag("demo", "on")).unwrap();
    fake.install_crd(secrets_crd()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("broker.sock");
    let admin: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut child = Command::new(BIN)
        .arg("serve")
        .env("KUBECONFIG", &kubeconfig)
        .env("CRD_BROKER_GRPC_ADDR", "none")
        .env("CRD_BROKER_GRPC_SOCKET", &socket)
        .env("CRD_BROKER_ADMIN_ADDR", admin.to_string())
        .env("CRD_BROKER_RESOURCE", "featureflags.core.openfeature.dev")
        .env("CRD_BROKER_LINGER", "200ms")
        .env("CRD_BROKER_MAX_CONCURRENT_STREAMS", "1")
        .env("CRD_BROKER_READINESS_INTERVAL", "200ms")
        .env("CRD_BROKER_LOG_FORMAT", "json")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .expect("the broker starts");
    let mut log = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    wait_ready(admin, &mut child).await;

    // CRD_BROKER_LOG_FORMAT: the start-up line is JSON.
    let line = tokio::time::timeout(WAIT, log.next_line())
        .await
        .unwrap()
        .unwrap()
        .expect("a log line");
    let record: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert!(record.get("level").is_some(), "{record}");

    // CRD_BROKER_GRPC_ADDR, _GRPC_SOCKET, _ADMIN_ADDR.
    let pid = child.id().unwrap();
    assert_eq!(listening_tcp_ports(pid), vec![admin.port()]);
    let mut client = connect_unix(&socket).await;
    let mut first = subscribe(&mut client, &[&demo("demo")]).await;
    assert!(is(&next(&mut first).await, Event::Snapshot, "on"));

    // CRD_BROKER_MAX_CONCURRENT_STREAMS: a second stream on the connection waits for the first.
    let mut again = client.clone();
    let second = tokio::time::timeout(Duration::from_millis(500), async {
        again.subscribe(request(&[&demo("demo")])).await
    })
    .await;
    assert!(second.is_err(), "one stream at a time on a connection");

    // CRD_BROKER_RESOURCE: another kind is not served.
    drop(first);
    let other = client
        .subscribe(request(&["secrets.example.com/default/x"]))
        .await
        .map(|_| ())
        .expect_err("a kind outside CRD_BROKER_RESOURCE");
    assert_eq!(other.code(), Code::PermissionDenied, "{other:?}");

    // CRD_BROKER_LINGER: the watch stops soon after its last subscriber left (default: 30 s).
    let stopped = tokio::time::timeout(WAIT, async {
        while fake.open_watches() > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(stopped.is_ok(), "the watch stops within the linger");
}

#[tokio::test]
async fn serve_speaks_http2_to_a_tls_api_server_unless_api_http2_is_off() {
    let options = fake_apiserver::Options {
        tls: true,
        ..fake_apiserver::Options::default().crd_yaml(CRD).unwrap()
    };
    let fake = fake_apiserver::FakeApiServer::start_with(options)
        .await
        .unwrap();
    fake.apply(flag("demo", "on")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    fake.write_kubeconfig(&kubeconfig).unwrap();
    for (env, version) in [
        (None, "HTTP/2.0"),
        (Some("off"), "HTTP/1.1"),
        (Some("auto"), "HTTP/2.0"),
    ] {
        fake.clear_requests();
        let env: Vec<(&str, &str)> = env
            .map(|v| ("CRD_BROKER_API_HTTP2", v))
            .into_iter()
            .collect();
        let mut broker = spawn(&kubeconfig, &[], &env).await;
        let mut client = connect(broker.grpc).await;
        let mut stream = subscribe(&mut client, &[&demo("demo")]).await;
        assert_eq!(variant(&next(&mut stream).await), "on");
        assert!(
            fake.wait_for(Duration::from_secs(10), |f| f.open_watches() == 1)
                .await
        );
        let requests = fake.requests();
        assert!(
            requests.iter().any(|r| r.verb == "list")
                && requests.iter().all(|r| r.version == version),
            "{env:?}: {:?}",
            requests
                .iter()
                .map(|r| (&r.verb, &r.version))
                .collect::<Vec<_>>()
        );
        // The broker counts its own requests as the API server saw them, over either stack.
        // It counts a request when the response headers reach it; the fake logs a watch when
        // it opens it, before its headers are on the wire. So the watch the fake saw may not
        // be counted yet: wait for the count to reach what the fake saw, then check that it
        // is exactly that.
        let key =
            |verb: &str| format!(r#"crd_broker_api_requests_total{{verb="{verb}",code="200"}}"#);
        let seen = |verb: &str| requests.iter().filter(|r| r.verb == verb).count() as f64;
        eventually(
            "the broker counts the watch the API server opened",
            WAIT,
            async || get(&metrics(broker.admin).await, &key("watch")) >= seen("watch"),
        )
        .await;
        let counted = metrics(broker.admin).await;
        for verb in ["list", "watch"] {
            assert_eq!(get(&counted, &key(verb)), seen(verb), "{env:?}: {verb}");
        }
        // Gone before the next one starts, so that none of its requests is counted there.
        broker.child.kill().await.unwrap();
        assert!(
            fake.wait_for(Duration::from_secs(10), |f| f.open_watches() == 0)
                .await
        );
    }
}
