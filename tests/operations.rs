//! Running it for real, in process: health that follows readiness, the admin endpoints, metrics
//! that move, reflection, connection age with GOAWAY on the wire, keepalive, unix sockets, TLS
//! and mTLS with certificate reload.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crd_broker::broker::{Config, Listeners};
use crd_broker::pb::subscribe_response::Event;
use fake_apiserver::{Deny, Matcher};
use serde_json::Value;
use support::*;
use tokio::net::TcpListener;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

async fn channel(addr: std::net::SocketAddr) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn fast() -> Config {
    Config {
        linger: Duration::ZERO,
        readiness_interval: Duration::from_millis(200),
        ..Config::default()
    }
}

async fn health(addr: std::net::SocketAddr, service: &str) -> ServingStatus {
    let mut client = HealthClient::new(channel(addr).await);
    let response = client
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .unwrap();
    response.into_inner().status()
}

#[tokio::test]
async fn readiness_and_health_follow_the_source_and_rbac() {
    let fake = fake().await;
    // The broker may not list FeatureFlags: not ready, and health says so.
    fake.deny(Deny {
        verb: Some("list".into()),
        resource: Some("featureflags".into()),
        ..Deny::default()
    });
    let allowed = vec!["featureflags.core.openfeature.dev".parse().unwrap()];
    let broker = broker_with(&fake, with_admin().await, fast(), allowed);
    let admin = broker.admin_addr.unwrap();
    assert_eq!(
        health(broker.addr, "").await,
        ServingStatus::NotServing,
        "the overall service starts NOT_SERVING"
    );
    let settled = tokio::time::timeout(WAIT, async {
        loop {
            let (code, body) = http_get(admin, "/readyz").await;
            if code == 503 && body.contains("may not list featureflags.core.openfeature.dev") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(settled.is_ok(), "readyz names what is missing");
    assert_eq!(health(broker.addr, "").await, ServingStatus::NotServing);
    assert_eq!(
        health(broker.addr, "flagd.sync.v1.FlagSyncService").await,
        ServingStatus::NotServing
    );

    // Checked in the background and cached: probes cost the API server nothing.
    let reviews = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews";
    let before = fake.request_count("create", reviews);
    for _ in 0..30 {
        http_get(admin, "/readyz").await;
    }
    assert!(
        fake.request_count("create", reviews) < before + 5,
        "30 probes, only the background checks reached the API server"
    );

    // RBAC fixed: ready within a check interval.
    fake.clear_faults();
    assert!(
        tokio::time::timeout(WAIT, async {
            while http_get(admin, "/readyz").await.0 != 200 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .is_ok()
    );
    assert_eq!(health(broker.addr, "").await, ServingStatus::Serving);
    assert_eq!(
        health(broker.addr, "crdbroker.v1.Broker").await,
        ServingStatus::Serving
    );
    assert_eq!(http_get(admin, "/livez").await.0, 200);

    // The API server down: still ready (within --max-staleness), saying so; back: ready.
    fake.stop_listening();
    assert!(
        tokio::time::timeout(WAIT, async {
            loop {
                let (code, body) = http_get(admin, "/readyz").await;
                if code == 200 && body.contains("does not answer") {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .is_ok(),
        "ready, serving what it knows, while the API server is down"
    );
    assert_eq!(health(broker.addr, "").await, ServingStatus::Serving);
    fake.start_listening().await.unwrap();
    assert!(
        tokio::time::timeout(WAIT, async {
            while http_get(admin, "/readyz").await.1 != "ready\n" {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .is_ok()
    );
}

/// Parses the OpenMetrics text into `name{labels}` → value.
#[tokio::test]
async fn metrics_and_debug_watches_move_as_the_broker_works() {
    let fake = fake().await;
    fake.apply(flag("demo", "on")).unwrap();
    let broker = broker_with(&fake, with_admin().await, fast(), vec![]);
    let admin = broker.admin_addr.unwrap();
    const R: &str = r#"resource="featureflags.core.openfeature.dev""#;

    let mut client = connect(broker.addr).await;
    let mut first = subscribe(&mut client, &[&demo("demo")]).await;
    next(&mut first).await;
    let mut second = subscribe(&mut client, &[&demo("demo")]).await;
    next(&mut second).await;
    let m = metrics(admin).await;
    assert_eq!(get(&m, &format!("crd_broker_watches{{{R}}}")), 1.0);
    assert_eq!(
        get(&m, &format!("crd_broker_watch_starts_total{{{R}}}")),
        1.0
    );
    assert_eq!(
        get(
            &m,
            &format!(r#"crd_broker_subscribers{{{R},protocol="native"}}"#)
        ),
        2.0
    );
    assert_eq!(
        get(
            &m,
            r#"crd_broker_first_message_seconds_count{protocol="native",watch="cold"}"#
        ),
        1.0
    );
    assert_eq!(
        get(
            &m,
            r#"crd_broker_first_message_seconds_count{protocol="native",watch="warm"}"#
        ),
        1.0
    );
    assert_eq!(
        get(
            &m,
            r#"grpc_server_started_total{grpc_service="crdbroker.v1.Broker",grpc_method="Subscribe",grpc_type="server_stream"}"#
        ),
        2.0
    );
    assert!(
        get(
            &m,
            r#"grpc_server_msg_sent_total{grpc_service="crdbroker.v1.Broker",grpc_method="Subscribe",grpc_type="server_stream"}"#
        ) >= 2.0,
        "a SNAPSHOT each"
    );
    assert_eq!(
        get(
            &m,
            r#"grpc_server_msg_received_total{grpc_service="crdbroker.v1.Broker",grpc_method="Subscribe",grpc_type="server_stream"}"#
        ),
        2.0,
        "a request each"
    );

    // An update reaching both subscribers: one fan-out sample.
    let updates_before = get(&m, &format!("crd_broker_updates_total{{{R}}}"));
    fake.merge_patch(GV, "featureflags", "default", "demo", variant_patch("off"))
        .unwrap();
    next(&mut first).await;
    next(&mut second).await;
    let m = metrics(admin).await;
    assert_eq!(
        get(&m, &format!("crd_broker_updates_total{{{R}}}")),
        updates_before + 1.0
    );
    assert_eq!(
        get(&m, &format!("crd_broker_fanout_seconds_count{{{R}}}")),
        1.0
    );

    // /debug/watches shows the watch.
    let (_, body) = http_get(admin, "/debug/watches").await;
    let watches: Value = serde_json::from_str(&body).unwrap();
    let w = &watches["watches"][0];
    assert_eq!(
        w["selector"],
        "featureflags.v1beta1.core.openfeature.dev/default/demo"
    );
    assert_eq!(w["subscribers"], 2);
    let stored = fake.get(GV, "featureflags", "default", "demo").unwrap();
    assert_eq!(w["resourceVersion"], stored["metadata"]["resourceVersion"]);
    assert!(
        w["lastEvent"].is_string() && w["ageSeconds"].is_u64() && w["errors"] == 0,
        "{w}"
    );

    // A source error is counted; a bad request is counted by its code.
    fake.fail_next(Matcher::verb("watch"), 1, 500, None);
    fake.error_watches(500);
    let err = client
        .subscribe(request(&["nope.example.com/default/x"]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert!(
        tokio::time::timeout(WAIT, async {
            loop {
                let m = metrics(admin).await;
                if get(
                    &m,
                    &format!(r#"crd_broker_watch_errors_total{{{R},reason="unavailable"}}"#),
                ) >= 1.0
                {
                    return m;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .is_ok()
    );
    let m = metrics(admin).await;
    assert_eq!(
        get(
            &m,
            r#"grpc_server_handled_total{grpc_service="crdbroker.v1.Broker",grpc_method="Subscribe",grpc_type="server_stream",grpc_code="NotFound"}"#
        ),
        1.0
    );

    // Everyone leaves (no linger): the watch stops, counted as idle, and the gauges go to zero.
    drop((first, second));
    assert!(
        tokio::time::timeout(WAIT, async {
            loop {
                let m = metrics(admin).await;
                if get(
                    &m,
                    &format!(r#"crd_broker_watch_stops_total{{{R},reason="idle"}}"#),
                ) == 1.0
                {
                    return m;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .is_ok()
    );
    let m = metrics(admin).await;
    assert_eq!(get(&m, &format!("crd_broker_watches{{{R}}}")), 0.0);
    assert_eq!(
        get(
            &m,
            &format!(r#"crd_broker_subscribers{{{R},protocol="native"}}"#)
        ),
        0.0
    );
    assert_eq!(
        get(
            &m,
            r#"grpc_server_handled_total{grpc_service="crdbroker.v1.Broker",grpc_method="Subscribe",grpc_type="server_stream",grpc_code="Canceled"}"#
        ),
        2.0,
        "streams the clients dropped"
    );

    // flagd streams are counted under their protocol.
    let mut flagd =
        crd_broker::pb::flagd::flag_sync_service_client::FlagSyncServiceClient::connect(format!(
            "http://{}",
            broker.addr
        ))
        .await
        .unwrap();
    let mut s = flagd
        .sync_flags(crd_broker::pb::flagd::SyncFlagsRequest {
            provider_id: String::new(),
            selector: "core.openfeature.dev/default/demo".into(),
        })
        .await
        .unwrap()
        .into_inner();
    s.message().await.unwrap();
    let m = metrics(admin).await;
    assert_eq!(
        get(
            &m,
            &format!(r#"crd_broker_subscribers{{{R},protocol="flagd"}}"#)
        ),
        1.0
    );
}

#[tokio::test]
async fn debug_endpoints_answer_only_the_brokers_own_pod_unless_made_public() {
    use crd_broker::access::admin::{AdminAuth, DebugEndpoints, Settings};
    let fake = fake().await;
    let local = broker_with(&fake, with_admin().await, fast(), vec![]);
    let admin = local.admin_addr.unwrap();
    // From the broker's own address: its pod (a port-forward arrives so too).
    for path in ["/debug/watches", "/debug/callers", "/metrics", "/readyz"] {
        assert_eq!(
            http_get_as(admin, "127.0.0.1", path, None).await.0,
            200,
            "{path}"
        );
    }
    // From elsewhere: the debug endpoints are refused, saying why and what to add.
    for path in ["/debug/watches", "/debug/callers", "/debug/subscribers"] {
        let (status, body) = http_get_as(admin, "127.0.0.2", path, None).await;
        assert_eq!(status, 403, "{path}: {body}");
        assert!(
            body.contains("answers only callers in the broker's own pod"),
            "{body}"
        );
        assert!(body.contains("--admin-auth kubernetes"), "{body}");
    }
    // Probes and metrics stay open.
    for path in ["/livez", "/readyz", "/metrics"] {
        assert_eq!(
            http_get_as(admin, "127.0.0.2", path, None).await.0,
            200,
            "{path}"
        );
    }
    // Made public, they answer anyone; metrics asked to authenticate do not.
    let config = Config {
        admin: Settings {
            debug_endpoints: DebugEndpoints::Public,
            admin_auth: AdminAuth::None,
            metrics_auth: AdminAuth::Kubernetes,
        },
        ..fast()
    };
    let public = broker_with(&fake, with_admin().await, config, vec![]);
    let admin = public.admin_addr.unwrap();
    assert_eq!(
        http_get_as(admin, "127.0.0.2", "/debug/watches", None)
            .await
            .0,
        200
    );
    let (status, body) = http_get_as(admin, "127.0.0.2", "/metrics", None).await;
    assert_eq!(status, 401, "{body}");
    assert!(
        body.contains("needs `authorization: Bearer <token>`"),
        "{body}"
    );
    assert_eq!(
        http_get_as(admin, "127.0.0.1", "/metrics", None).await.0,
        200
    );
}

/// `/debug/subscribers`, read as JSON; the rows whose caller names `ip`.
async fn subscribers_of(admin: std::net::SocketAddr, ip: &str) -> (Value, Vec<Value>) {
    let (status, body) = http_get(admin, "/debug/subscribers").await;
    assert_eq!(status, 200, "{body}");
    let view: Value = serde_json::from_str(&body).unwrap();
    let rows = view["subscribers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["caller"].as_str().unwrap_or_default().contains(ip))
        .cloned()
        .collect();
    (view, rows)
}

/// Waits until the stream of the caller at `ip` is SYNCED in `/debug/subscribers`.
async fn synced_eventually(admin: std::net::SocketAddr, ip: &str) {
    let what = format!("the stream of {ip} is handed the last state");
    eventually(&what, WAIT, async || {
        let (_, rows) = subscribers_of(admin, ip).await;
        rows[0]["status"] == "SYNCED"
    })
    .await;
}

#[tokio::test]
async fn debug_subscribers_says_which_streams_hold_the_current_state_and_which_are_stale() {
    let fake = fake().await;
    // Large states, so that a client that does not read fills its windows at once.
    let mut big = flag("demo", "v0");
    big["spec"]["flagSpec"]["metadata"] = serde_json::json!({ "padding": "x".repeat(64 * 1024) });
    big["metadata"]["labels"] = serde_json::json!({ "app": "ops" });
    fake.apply(big).unwrap();
    let broker = broker_with(&fake, with_admin().await, fast(), vec![]);
    let admin = broker.admin_addr.unwrap();
    let mut reader = connect_from(broker.addr, "127.0.0.2").await;
    let mut reading = subscribe(&mut reader, &[&demo("demo")]).await;
    assert_eq!(next(&mut reading).await.event(), Event::Snapshot);
    let mut staller = connect_from(broker.addr, "127.0.0.3").await;
    let mut stalled = subscribe(&mut staller, &[&demo("demo")]).await;
    let flagd = channel_from(broker.addr, "127.0.0.4").await;
    let mut sync =
        crd_broker::pb::flagd::flag_sync_service_client::FlagSyncServiceClient::new(flagd)
            .sync_flags(crd_broker::pb::flagd::SyncFlagsRequest {
                provider_id: String::new(),
                selector: "core.openfeature.dev/default/demo".into(),
            })
            .await
            .unwrap()
            .into_inner();
    // The flagd client reads as it comes, and so does a native set's.
    let sync = tokio::spawn(async move { while let Ok(Some(_)) = sync.message().await {} });
    let mut sets = connect_from(broker.addr, "127.0.0.5").await;
    let set: crd_broker::selector::Target =
        "featureflags.core.openfeature.dev/default?labelSelector=app%3Dops"
            .parse()
            .unwrap();
    let asked = crd_broker::cli::subscribe::request_for(&[set]);
    let mut set = sets.subscribe(asked).await.unwrap().into_inner();
    let set = tokio::spawn(async move { while let Ok(Some(_)) = set.message().await {} });
    for i in 1..=40 {
        let patch = variant_patch(&format!("v{i}"));
        fake.merge_patch(GV, "featureflags", "default", "demo", patch)
            .unwrap();
    }
    until(&mut reading, |r| variant(r) == "v40").await;
    let stored = fake.get(GV, "featureflags", "default", "demo").unwrap();
    let current = stored["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    synced_eventually(admin, "127.0.0.4").await;

    synced_eventually(admin, "127.0.0.5").await;
    let (view, rows) = subscribers_of(admin, "127.0.0.5").await;
    let part = &rows[0]["resources"][0];
    assert_eq!(part["current"].as_str().map(str::len), Some(16), "{view}");
    assert_eq!(part["delivered"], part["current"]);
    let (view, rows) = subscribers_of(admin, "127.0.0.2").await;
    assert_eq!(view["total"], 4, "{view}");
    let part = &rows[0]["resources"][0];
    assert_eq!(
        (&rows[0]["protocol"], &rows[0]["status"]),
        (&serde_json::json!("native"), &serde_json::json!("SYNCED")),
        "{view}"
    );
    assert_eq!(
        part["selector"],
        "featureflags.v1beta1.core.openfeature.dev/default/demo"
    );
    assert_eq!(
        (part["delivered"].as_str(), part["current"].as_str()),
        (Some(current.as_str()), Some(current.as_str()))
    );
    let (_, rows) = subscribers_of(admin, "127.0.0.3").await;
    assert_eq!(rows[0]["status"], "STALE", "{view}");
    assert_ne!(
        rows[0]["resources"][0]["delivered"].as_str(),
        Some(current.as_str())
    );
    assert_eq!(
        view["subscribers"][0]["status"], "STALE",
        "the stale first: {view}"
    );
    assert_eq!(view["stale"], 1, "{view}");
    let (_, rows) = subscribers_of(admin, "127.0.0.4").await;
    assert_eq!(rows[0]["protocol"], "flagd");

    // Once it reads, the stalled one catches up; a stream that ends leaves the list.
    until(&mut stalled, |r| variant(r) == "v40").await;
    synced_eventually(admin, "127.0.0.3").await;
    sync.abort();
    set.abort();
    drop(reading);
    eventually("ended streams leave the list", WAIT, async || {
        subscribers_of(admin, "").await.0["total"] == 1
    })
    .await;
}

#[tokio::test]
async fn reflection_lists_and_describes_the_services() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let fake = fake().await;
    let broker = broker_with(&fake, with_admin().await, fast(), vec![]);
    let mut client = ServerReflectionClient::new(channel(broker.addr).await);
    let ask = |m: MessageRequest| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(m),
    };
    let requests = futures::stream::iter(vec![
        ask(MessageRequest::ListServices(String::new())),
        ask(MessageRequest::FileContainingSymbol(
            "crdbroker.v1.Broker".into(),
        )),
        ask(MessageRequest::FileContainingSymbol(
            "flagd.sync.v1.FlagSyncService".into(),
        )),
    ]);
    let mut responses = client
        .server_reflection_info(requests)
        .await
        .unwrap()
        .into_inner();
    let services = match responses.message().await.unwrap().unwrap().message_response {
        Some(MessageResponse::ListServicesResponse(l)) => {
            l.service.into_iter().map(|s| s.name).collect::<Vec<_>>()
        }
        other => panic!("{other:?}"),
    };
    for name in [
        "crdbroker.v1.Broker",
        "flagd.sync.v1.FlagSyncService",
        "sync.v1.FlagSyncService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(services.iter().any(|s| s == name), "{name} in {services:?}");
    }
    // What a client such as grpcurl needs to call a method it has never seen: the service, its
    // methods, their message types and that they stream.
    for (service, method, input) in [
        ("Broker", "Subscribe", ".crdbroker.v1.SubscribeRequest"),
        (
            "FlagSyncService",
            "SyncFlags",
            ".flagd.sync.v1.SyncFlagsRequest",
        ),
    ] {
        let files = match responses.message().await.unwrap().unwrap().message_response {
            Some(MessageResponse::FileDescriptorResponse(f)) => f.file_descriptor_proto,
            other => panic!("{other:?}"),
        };
        let files: Vec<prost_types::FileDescriptorProto> = files
            .iter()
            .map(|b| prost::Message::decode(b.as_slice()).unwrap())
            .collect();
        let m = files
            .iter()
            .flat_map(|f| &f.service)
            .filter(|s| s.name() == service)
            .flat_map(|s| &s.method)
            .find(|m| m.name() == method)
            .unwrap_or_else(|| panic!("{service}.{method} in {files:?}"));
        assert_eq!(m.input_type(), input);
        assert!(m.server_streaming() && !m.client_streaming(), "{m:?}");
        let message = input.rsplit('.').next().unwrap();
        assert!(
            files
                .iter()
                .flat_map(|f| &f.message_type)
                .any(|t| t.name() == message),
            "{message} is described too"
        );
    }
}

/// The HTTP/2 frames a server sends, read off the wire: a loopback proxy in front of the
/// server records each frame's type (and a GOAWAY's error code) before passing it on, so a
/// frame is on record before the client can have seen it. (The client library's own debug
/// events are no witness: tracing caches each event's interest process-wide, and a test
/// running beside this one can settle it before this test's subscriber is in place.)
#[derive(Clone, Default)]
struct Wire(Arc<Mutex<Vec<(tokio::time::Instant, u8, u32)>>>);

/// HTTP/2's frame type for GOAWAY.
const GOAWAY: u8 = 0x7;

impl Wire {
    /// A proxy to `server` on a port of its own, for as many connections as come.
    async fn proxy(server: std::net::SocketAddr) -> (std::net::SocketAddr, Wire) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let wire = Wire::default();
        let frames = wire.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = tokio::net::TcpStream::connect(server).await else {
                    continue;
                };
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = upstream.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                    let _ = to_server.shutdown().await;
                });
                let frames = frames.clone();
                tokio::spawn(async move {
                    let (mut pending, mut buf) = (Vec::new(), vec![0; 16 * 1024]);
                    while let Ok(n @ 1..) = from_server.read(&mut buf).await {
                        pending.extend_from_slice(&buf[..n]);
                        frames.take(&mut pending);
                        if to_client.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    let _ = to_client.shutdown().await;
                });
            }
        });
        (addr, wire)
    }

    /// Records the whole frames at the start of `pending` and removes them.
    fn take(&self, pending: &mut Vec<u8>) {
        while pending.len() >= 9 {
            let len = u32::from_be_bytes([0, pending[0], pending[1], pending[2]]) as usize;
            if pending.len() < 9 + len {
                return;
            }
            let kind = pending[3];
            // GOAWAY's payload: the last stream id, then the error code.
            let code = match kind {
                GOAWAY if len >= 8 => u32::from_be_bytes(pending[13..17].try_into().unwrap()),
                _ => 0,
            };
            self.0
                .lock()
                .unwrap()
                .push((tokio::time::Instant::now(), kind, code));
            pending.drain(..9 + len);
        }
    }

    /// The GOAWAY frames: when, and their error codes.
    fn goaways(&self) -> Vec<(tokio::time::Instant, u32)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, kind, _)| *kind == GOAWAY)
            .map(|(at, _, code)| (*at, *code))
            .collect()
    }
}

#[tokio::test]
async fn at_its_age_a_connection_gets_goaway_its_streams_end_unavailable_and_it_closes_after_the_grace()
 {
    let fake = fake().await;
    fake.apply(flag("demo", "on")).unwrap();
    let mut config = fast();
    config.transport.max_connection_age = Some(Duration::from_secs(1));
    config.transport.max_connection_age_grace = Duration::from_secs(2);
    let broker = broker_with(&fake, with_admin().await, config, vec![]);
    let (proxy, wire) = Wire::proxy(broker.addr).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{proxy}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let opened = tokio::time::Instant::now();
    let mut client = crd_broker::pb::broker_client::BrokerClient::new(channel.clone());
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    next(&mut s).await;
    // A stream that knows nothing of the drain: health Watch, on the same connection.
    let mut health = HealthClient::new(channel.clone());
    let mut watch = health
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    watch.message().await.unwrap();

    let ended = ended(&mut s).await;
    let at = opened.elapsed();
    assert_eq!(ended.code(), Code::Unavailable, "{}", ended.message());
    assert!(
        ended.message().contains("maximum age") && !ended.message().contains("shutting down"),
        "the reason is named: {}",
        ended.message()
    );
    assert!(
        at >= Duration::from_millis(850) && at < Duration::from_millis(1800),
        "ended at {at:?}, age 1 s ± 10 %"
    );
    // The server sends GOAWAY before it ends the streams, so it is on the wire before the end.
    let goaways = wire.goaways();
    assert!(!goaways.is_empty(), "a GOAWAY frame arrived");
    assert!(
        goaways[0].0.duration_since(opened) < Duration::from_millis(1800),
        "at the age: {:?}",
        goaways[0].0.duration_since(opened)
    );
    assert_eq!(goaways[0].1, 0, "NO_ERROR");

    // The health watch outlives the age; the connection is closed at age + grace.
    let closed = tokio::time::timeout(WAIT, async {
        loop {
            match watch.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the connection closes");
    assert!(closed.is_err() || closed.as_ref().is_ok_and(Option::is_none));
    let at = opened.elapsed();
    assert!(
        at >= Duration::from_millis(2700),
        "closed at {at:?}, after the grace"
    );

    // The client reconnects by itself: a new subscription works.
    let mut again = subscribe(&mut client, &[&demo("demo")]).await;
    assert_eq!(next(&mut again).await.event(), Event::Snapshot);
}

#[tokio::test]
async fn client_pings_every_100ms_are_permitted() {
    let fake = fake().await;
    fake.apply(flag("demo", "on")).unwrap();
    let broker = broker_with(&fake, with_admin().await, fast(), vec![]);
    // Far more often than the providers' 30 s: the server must not answer with GOAWAY
    // (ENHANCE_YOUR_CALM), as grpc-go's default enforcement would.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", broker.addr))
        .unwrap()
        .http2_keep_alive_interval(Duration::from_millis(100))
        .keep_alive_while_idle(true)
        .keep_alive_timeout(Duration::from_secs(1))
        .connect()
        .await
        .unwrap();
    let mut client = crd_broker::pb::broker_client::BrokerClient::new(channel);
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    next(&mut s).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    fake.merge_patch(GV, "featureflags", "default", "demo", variant_patch("off"))
        .unwrap();
    assert!(
        is(&next(&mut s).await, Event::Updated, "off"),
        "the stream lived through 30 pings"
    );
}

#[tokio::test]
async fn a_unix_socket_serves_alongside_tcp() {
    let fake = fake().await;
    fake.apply(flag("demo", "on")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broker.sock");
    let listeners = Listeners {
        tcp: Some(TcpListener::bind("127.0.0.1:0").await.unwrap()),
        unix: Some((tokio::net::UnixListener::bind(&path).unwrap(), path.clone())),
        ..Listeners::default()
    };
    let broker = broker_with(&fake, listeners, fast(), vec![]);
    let mut client = connect_unix(&path).await;
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    let mut tcp = connect(broker.addr).await;
    let mut t = subscribe(&mut tcp, &[&demo("demo")]).await;
    next(&mut t).await;
    assert_eq!(fake.open_watches(), 1, "one watch for both listeners");
    broker.stop().await.unwrap();
    assert!(!path.exists(), "the socket file is removed at exit");
}

#[tokio::test]
async fn mtls_with_certificates_reloaded_without_dropping_connections() {
    use crd_broker::transport::tls::{Tls, TlsFiles};
    let fake = fake().await;
    fake.apply(flag("demo", "on")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let first = pki("first");
    write_tls_files(dir.path(), &first);
    let files = TlsFiles {
        cert: dir.path().join("tls.crt"),
        key: dir.path().join("tls.key"),
        client_ca: Some(dir.path().join("ca.crt")),
    };
    let tls = Tls::load(files).unwrap();
    let listeners = Listeners {
        tcp: Some(TcpListener::bind("127.0.0.1:0").await.unwrap()),
        tls: Some(tls.clone()),
        ..Listeners::default()
    };
    let broker = broker_with(&fake, listeners, fast(), vec![]);

    let mut s = tls_demo_stream(broker.addr, &first).await;
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    // Without a client certificate: refused.
    assert!(
        refused(broker.addr, &first, false).await,
        "a client without a certificate is refused"
    );
    let plain = connect_plain(broker.addr).await;
    assert!(plain.is_err(), "plaintext is refused on a TLS listener");

    // Rotate to a new CA and certificates.
    let second = pki("second");
    write_tls_files(dir.path(), &second);
    assert!(tls.reload_if_changed(), "the new files are loaded");
    // The open connection is untouched: it keeps receiving.
    fake.merge_patch(GV, "featureflags", "default", "demo", variant_patch("off"))
        .unwrap();
    assert!(is(&next(&mut s).await, Event::Updated, "off"));
    // New connections use the new certificates; the old CA no longer works.
    let mut r = tls_demo_stream(broker.addr, &second).await;
    assert!(is(&next(&mut r).await, Event::Snapshot, "off"));
    assert!(
        refused(broker.addr, &first, true).await,
        "a client trusting only the old CA cannot connect any more"
    );
}

async fn connect_plain(addr: std::net::SocketAddr) -> Result<(), tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut client = crd_broker::pb::broker_client::BrokerClient::new(channel);
    client
        .subscribe(request(&[&demo("demo")]))
        .await
        .map(|_| ())
}
