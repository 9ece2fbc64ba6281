//! The flagd sync protocols end to end, with the generated Rust clients: what flagd sidecars and
//! the OpenFeature providers rely on (the Python provider itself runs in `flagd_providers.rs`).

mod support;

use std::time::Duration;

use crd_broker::pb::flagd::flag_sync_service_client::FlagSyncServiceClient;
use crd_broker::pb::legacy::flag_sync_service_client::FlagSyncServiceClient as LegacyClient;
use crd_broker::pb::{flagd, legacy};
use serde_json::{Value, json};
use support::*;
use tonic::Code;
use tonic::transport::Channel;

const SELECTOR: &str = "core.openfeature.dev/default/demo";

async fn flagd_client(h: &Harness) -> FlagSyncServiceClient<Channel> {
    FlagSyncServiceClient::connect(format!("http://{}", h.broker.addr))
        .await
        .unwrap()
}

/// A SyncFlags request with the selector in the header, the body, or both.
fn sync_request(header: Option<&str>, body: &str) -> tonic::Request<flagd::SyncFlagsRequest> {
    let mut r = tonic::Request::new(flagd::SyncFlagsRequest {
        provider_id: "test".into(),
        selector: body.into(),
    });
    if let Some(h) = header {
        r.metadata_mut()
            .insert("flagd-selector", h.parse().unwrap());
    }
    r
}

async fn config(s: &mut tonic::Streaming<flagd::SyncFlagsResponse>) -> Value {
    let r = tokio::time::timeout(WAIT, s.message())
        .await
        .expect("a message in time")
        .expect("no error")
        .expect("open");
    assert!(r.sync_context.is_none());
    serde_json::from_str(&r.flag_configuration).expect("the configuration is JSON")
}

fn flag_spec(h: &Harness, name: &str) -> Value {
    h.fake.get(GV, "featureflags", "default", name).unwrap()["spec"]["flagSpec"].clone()
}

#[tokio::test]
async fn sync_flags_streams_the_flag_spec_and_every_real_change() {
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut client = flagd_client(&h).await;
    let mut s = client
        .sync_flags(sync_request(Some(SELECTOR), SELECTOR))
        .await
        .unwrap()
        .into_inner();
    let first = config(&mut s).await;
    assert_eq!(first, flag_spec(&h, "demo"), "spec.flagSpec, unchanged");
    assert_eq!(first["flags"]["f"]["defaultVariant"], "on");

    // A change outside spec.flagSpec (a label) leaves the configuration as it was: nothing is sent.
    h.fake
        .merge_patch(
            GV,
            "featureflags",
            "default",
            "demo",
            json!({ "metadata": { "labels": { "a": "b" } } }),
        )
        .unwrap();
    h.fake
        .merge_patch(GV, "featureflags", "default", "demo", variant_patch("off"))
        .unwrap();
    assert_eq!(
        config(&mut s).await["flags"]["f"]["defaultVariant"],
        "off",
        "the next message is the real change"
    );

    // Deleted: no flags; re-created: back.
    h.fake
        .delete(GV, "featureflags", "default", "demo")
        .unwrap();
    assert_eq!(config(&mut s).await, json!({ "flags": {} }));
    h.fake.apply(flag("demo", "a")).unwrap();
    assert_eq!(config(&mut s).await["flags"]["f"]["defaultVariant"], "a");
    assert_eq!(
        h.watches_on("demo"),
        1,
        "the same watch as the native API would use"
    );
}

#[tokio::test]
async fn a_missing_feature_flag_is_no_flags_at_once_then_its_flags() {
    let h = start(Duration::from_secs(30)).await;
    let mut client = flagd_client(&h).await;
    let mut s = client
        .sync_flags(sync_request(None, "core.openfeature.dev/default/later"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        config(&mut s).await,
        json!({ "flags": {} }),
        "body-only selector, missing CR"
    );
    h.fake.apply(flag("later", "on")).unwrap();
    assert_eq!(config(&mut s).await["flags"]["f"]["defaultVariant"], "on");
}

#[tokio::test]
async fn the_header_selector_wins_and_bad_selectors_are_invalid_argument() {
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    h.fake.apply(flag("other", "off")).unwrap();
    let mut client = flagd_client(&h).await;
    let mut s = client
        .sync_flags(sync_request(
            Some(SELECTOR),
            "core.openfeature.dev/default/other",
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(config(&mut s).await["flags"]["f"]["defaultVariant"], "on");

    for bad in [
        "file:/etc/flagd/config.json",
        "",
        "flagSetId=web",
        "core.openfeature.dev/default",
        "featureflags.core.openfeature.dev/default/demo",
    ] {
        let status = client
            .sync_flags(sync_request(None, bad))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{bad:?}");
        assert!(
            status
                .message()
                .contains("core.openfeature.dev/<namespace>/<name>"),
            "{}",
            status.message()
        );
    }
    let status = client
        .fetch_all_flags(flagd::FetchAllFlagsRequest {
            provider_id: String::new(),
            selector: "file:/etc/passwd".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    // The stream that was open is unaffected.
    h.fake
        .merge_patch(GV, "featureflags", "default", "demo", variant_patch("off"))
        .unwrap();
    assert_eq!(config(&mut s).await["flags"]["f"]["defaultVariant"], "off");
}

#[tokio::test]
async fn context_values_are_every_responses_sync_context_and_the_metadata() {
    let fake = fake().await;
    fake.apply(flag("demo", "on")).unwrap();
    let values = [
        ("region", "eu-west"),
        ("tier", "gold"),
        ("region", "eu-north"),
    ];
    let config = crd_broker::broker::Config {
        flagd_context: values.map(|(k, v)| (k.into(), v.into())).to_vec(),
        ..Default::default()
    };
    let broker = broker_with(&fake, with_admin().await, config, vec![]);
    let mut client = FlagSyncServiceClient::connect(format!("http://{}", broker.addr))
        .await
        .unwrap();
    let wanted = prost_types::Struct {
        fields: [("region", "eu-north"), ("tier", "gold")]
            .map(|(k, v)| {
                let v = prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(v.into())),
                };
                (k.to_string(), v)
            })
            .into(),
    };
    let mut stream = client
        .sync_flags(sync_request(None, SELECTOR))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(
        first.sync_context.as_ref(),
        Some(&wanted),
        "the last value of a key wins"
    );
    fake.merge_patch(GV, "featureflags", "default", "demo", variant_patch("off"))
        .unwrap();
    let next = stream.message().await.unwrap().unwrap();
    assert!(next.flag_configuration.contains("off"));
    assert_eq!(
        next.sync_context.as_ref(),
        Some(&wanted),
        "on every response"
    );
    let metadata = client
        .get_metadata(flagd::GetMetadataRequest {})
        .await
        .unwrap();
    assert_eq!(metadata.into_inner().metadata, Some(wanted));

    // The legacy protocol has no such field; a broker without values sends none.
    let default = start(Duration::from_secs(30)).await;
    default.fake.apply(flag("demo", "on")).unwrap();
    let mut plain = flagd_client(&default).await;
    let mut stream = plain
        .sync_flags(sync_request(None, SELECTOR))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stream.message().await.unwrap().unwrap().sync_context, None);
}

#[test]
fn context_values_are_bounded_with_a_clear_error() {
    let many: Vec<(String, String)> = (0..65).map(|n| (format!("k{n}"), "v".into())).collect();
    let e = crd_broker::grpc::flagd::sync_context(&many).unwrap_err();
    assert_eq!(e.to_string(), "65 --context-values: at most 64");
    let long = [("k".to_string(), "v".repeat(4097))];
    let e = crd_broker::grpc::flagd::sync_context(&long).unwrap_err();
    assert_eq!(e.to_string(), "the --context-value of k is over 4096 bytes");
    assert!(
        crd_broker::grpc::flagd::sync_context(&[])
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn get_metadata_answers_ok_with_its_struct_and_fetch_all_flags_answers_once() {
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut client = flagd_client(&h).await;
    let metadata = client
        .get_metadata(flagd::GetMetadataRequest {})
        .await
        .expect("OK")
        .into_inner();
    assert!(metadata.metadata.is_some(), "the metadata field is present");

    let fetched = client
        .fetch_all_flags(flagd::FetchAllFlagsRequest {
            provider_id: String::new(),
            selector: SELECTOR.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let parsed: Value = serde_json::from_str(&fetched.flag_configuration).unwrap();
    assert_eq!(parsed, flag_spec(&h, "demo"));
    let missing = client
        .fetch_all_flags(flagd::FetchAllFlagsRequest {
            provider_id: String::new(),
            selector: "core.openfeature.dev/default/none".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(missing.flag_configuration, r#"{"flags":{}}"#);
}

#[tokio::test]
async fn the_legacy_protocol_says_all_on_every_message() {
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut client = LegacyClient::connect(format!("http://{}", h.broker.addr))
        .await
        .unwrap();
    let mut s = client
        .sync_flags(legacy::SyncFlagsRequest {
            provider_id: String::new(),
            selector: SELECTOR.into(),
        })
        .await
        .unwrap()
        .into_inner();
    for variant in ["on", "off", "a"] {
        if variant != "on" {
            h.fake
                .merge_patch(
                    GV,
                    "featureflags",
                    "default",
                    "demo",
                    variant_patch(variant),
                )
                .unwrap();
        }
        let r = tokio::time::timeout(WAIT, s.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(r.state(), legacy::SyncState::All);
        let parsed: Value = serde_json::from_str(&r.flag_configuration).unwrap();
        assert_eq!(parsed["flags"]["f"]["defaultVariant"], variant);
    }
    let fetched = client
        .fetch_all_flags(legacy::FetchAllFlagsRequest {
            provider_id: String::new(),
            selector: SELECTOR.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        fetched
            .flag_configuration
            .contains(r#""defaultVariant":"a""#)
    );
    assert_eq!(h.watches_on("demo"), 1);
}

#[tokio::test]
async fn sync_streams_end_with_unavailable_never_ok() {
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut client = flagd_client(&h).await;
    let mut s = client
        .sync_flags(sync_request(Some(SELECTOR), ""))
        .await
        .unwrap()
        .into_inner();
    config(&mut s).await;
    let stopping = tokio::spawn(h.broker.stop());
    let status = ended(&mut s).await;
    assert_eq!(status.code(), Code::Unavailable);
    stopping.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_configuration_over_four_mebibytes_is_resource_exhausted_and_never_sent() {
    // A real API server takes no object that large (its request limit is 3 MiB), and the
    // manifests source reads no file over 4 MiB; the fake's own store does take it.
    let h = start(Duration::ZERO).await;
    let mut big = flag("big", "on");
    big["spec"]["flagSpec"]["metadata"] = json!({ "padding": "x".repeat(4_300_000) });
    h.fake.apply(big).unwrap();
    h.fake.apply(flag("small", "on")).unwrap();
    let mut client = flagd_client(&h).await;
    let mut s = client
        .sync_flags(sync_request(Some("core.openfeature.dev/default/big"), ""))
        .await
        .unwrap()
        .into_inner();
    let status = ended(&mut s).await;
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().contains("FeatureFlag default/big") && status.message().contains("4300"),
        "{}",
        status.message()
    );
    // The broker keeps serving others.
    let mut ok = client
        .sync_flags(sync_request(Some("core.openfeature.dev/default/small"), ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(config(&mut ok).await["flags"]["f"]["defaultVariant"], "on");
}

/// A plain HTTP/1.1 GET on loopback; the whole response as text.
async fn http_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
}

/// `crd-broker start ARGS` on the API server behind `kubeconfig`.
fn start_command(
    kubeconfig: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_crd-broker"))
        .arg("start")
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .unwrap()
}

#[tokio::test]
async fn start_runs_the_broker_as_the_operator_starts_flagd_proxy() {
    let (fake, _dir, kubeconfig) = fake_with_kubeconfig().await;
    fake.apply(flag("demo", "on")).unwrap();
    let (port, management) = (free_port(), free_port());
    // flagd-proxy's own spelling: `start --port N --management-port M --debug --log-format console`,
    // with the port from the PORT environment variable here.
    let mut child = start_command(
        &kubeconfig,
        &[
            "--management-port",
            &management.to_string(),
            "--debug",
            "--log-format",
            "console",
        ],
        &[("PORT", &port.to_string())],
    );
    let client = tokio::time::timeout(WAIT, async {
        loop {
            if let Ok(c) = FlagSyncServiceClient::connect(format!("http://127.0.0.1:{port}")).await
            {
                return c;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("start listens on PORT");
    let mut client = client;
    let mut s = client
        .sync_flags(sync_request(Some(SELECTOR), SELECTOR))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(config(&mut s).await["flags"]["f"]["defaultVariant"], "on");
    // Readiness answers 503 until the broker's first check of its source, which runs in the
    // background: wait for that verdict, then it must be ready.
    let deadline = tokio::time::Instant::now() + WAIT;
    let ready = loop {
        let ready = http_get(management, "/readyz").await;
        if !ready.contains("not been checked yet") || tokio::time::Instant::now() > deadline {
            break ready;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        ready.starts_with("HTTP/1.1 200"),
        "the admin endpoints answer on --management-port: {ready}"
    );
    child.kill().await.unwrap();
}

#[tokio::test]
async fn start_is_not_ready_without_the_rights_to_watch_featureflags() {
    let (fake, _dir, kubeconfig) = fake_with_kubeconfig().await;
    fake.deny(fake_apiserver::Deny {
        verb: Some("watch".into()),
        resource: Some("featureflags".into()),
        ..fake_apiserver::Deny::default()
    });
    let (port, management) = (free_port(), free_port());
    let mut child = start_command(
        &kubeconfig,
        &[
            "--port",
            &port.to_string(),
            "--management-port",
            &management.to_string(),
        ],
        &[("CRD_BROKER_READINESS_INTERVAL", "200ms")],
    );
    let named = tokio::time::timeout(WAIT, async {
        loop {
            if let Ok(true) = tokio::time::timeout(Duration::from_secs(1), async {
                tokio::net::TcpStream::connect(("127.0.0.1", management))
                    .await
                    .is_ok()
                    && http_get(management, "/readyz")
                        .await
                        .contains("may not watch featureflags")
            })
            .await
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(named.is_ok(), "readyz names the missing right");
    let ready = http_get(management, "/readyz").await;
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
    // --port is the gRPC port.
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    );
    child.kill().await.unwrap();
}

#[tokio::test]
async fn the_clients_stream_deadline_churn_reuses_the_warm_watch() {
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut client = flagd_client(&h).await;
    for _ in 0..5 {
        // A provider's stream deadline: it cancels the stream and opens a new one.
        let mut s = client
            .sync_flags(sync_request(Some(SELECTOR), SELECTOR))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(config(&mut s).await["flags"]["f"]["defaultVariant"], "on");
        drop(s);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        h.fake.request_count("list", NS_PATH),
        1,
        "one LIST for five streams"
    );
    assert_eq!(
        h.fake.request_count("watch", NS_PATH),
        1,
        "one WATCH for five streams"
    );
    assert_eq!(h.watches_on("demo"), 1);
}

#[tokio::test]
async fn start_takes_identity_and_policy_as_flags_or_variables() {
    let (fake, dir, kubeconfig) = fake_with_kubeconfig().await;
    run_pod(&fake, "team-a", "web-1", "web", "127.0.0.2");
    for ns in ["team-a", "team-b"] {
        fake.apply(flag_in(ns, "f", "on")).unwrap();
    }
    let policy = dir.path().join("policy.yaml");
    std::fs::write(&policy, "grants:\n  - from: team-a\n    read: [team-b]\n").unwrap();
    let (port, management) = (free_port(), free_port());
    let _child = start_command(
        &kubeconfig,
        &[
            "--port",
            &port.to_string(),
            "--management-port",
            &management.to_string(),
            "--identity",
            "peer-pod",
        ],
        // The policy through the environment; the identity flag wins over the variable.
        &[
            ("CRD_BROKER_IDENTITY", "none"),
            ("CRD_BROKER_POLICY", policy.to_str().unwrap()),
        ],
    );
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let channel = tokio::time::timeout(WAIT, async {
        loop {
            let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .unwrap()
                .local_address(Some("127.0.0.2".parse().unwrap()));
            if let Ok(c) = endpoint.connect().await {
                return c;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("start listens");
    let mut pod = FlagSyncServiceClient::new(channel);
    for ns in ["team-a", "team-b"] {
        let selector = format!("core.openfeature.dev/{ns}/f");
        let mut s = pod
            .sync_flags(sync_request(Some(&selector), ""))
            .await
            .unwrap_or_else(|e| panic!("{ns}: {e}"))
            .into_inner();
        assert_eq!(config(&mut s).await["flags"]["f"]["defaultVariant"], "on");
    }
    let mut stranger = FlagSyncServiceClient::new(channel_from(addr, "127.0.0.9").await);
    let status = stranger
        .sync_flags(sync_request(Some("core.openfeature.dev/team-a/f"), ""))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{}", status.message());
}

/// A FeatureFlag labelled `app` whose flags are `keys`, each with `variant` as default.
fn labelled_flags(name: &str, app: &str, keys: &[&str], variant: &str) -> Value {
    let flags: serde_json::Map<String, Value> = keys
        .iter()
        .map(|k| {
            (
                k.to_string(),
                serde_json::json!({ "state": "ENABLED", "variants": { "on": true, "off": false }, "defaultVariant": variant }),
            )
        })
        .collect();
    serde_json::json!({
        "apiVersion": GV, "kind": "FeatureFlag",
        "metadata": { "name": name, "namespace": "default", "labels": { "app": app } },
        "spec": { "flagSpec": { "flags": flags } },
    })
}

#[tokio::test]
async fn a_set_selector_serves_the_merged_flags_of_its_feature_flags_in_name_order() {
    let h = start(Duration::ZERO).await;
    h.fake
        .apply(labelled_flags("b", "checkout", &["y", "z"], "off"))
        .unwrap();
    h.fake
        .apply(labelled_flags("a", "checkout", &["x", "y"], "on"))
        .unwrap();
    h.fake
        .apply(labelled_flags("c", "cart", &["w"], "on"))
        .unwrap();
    let set = "core.openfeature.dev/default?labelSelector=app%3Dcheckout";
    let mut client = flagd_client(&h).await;
    let mut s = client
        .sync_flags(sync_request(Some(set), ""))
        .await
        .unwrap()
        .into_inner();
    let merged = config(&mut s).await;
    let keys: Vec<&String> = merged["flags"].as_object().unwrap().keys().collect();
    assert_eq!(keys, ["x", "y", "z"], "{merged}");
    assert_eq!(
        merged["flags"]["y"]["defaultVariant"], "on",
        "a's y: the first in name order"
    );
    assert_eq!(
        h.broker
            .registry
            .metrics()
            .subscriptions
            .flag_conflicts
            .get(),
        1,
        "one conflict counted"
    );
    // A change to a member, and a FeatureFlag joining the set, give new merged configurations.
    h.fake
        .merge_patch(GV, "featureflags", "default", "b", serde_json::json!({ "spec": { "flagSpec": { "flags": { "z": { "defaultVariant": "on" } } } } }))
        .unwrap();
    assert_eq!(config(&mut s).await["flags"]["z"]["defaultVariant"], "on");
    h.fake
        .merge_patch(GV, "featureflags", "default", "c", relabel("checkout"))
        .unwrap();
    assert!(config(&mut s).await["flags"]["w"].is_object());
    let fetched: Value = serde_json::from_str(
        &client
            .fetch_all_flags(flagd::FetchAllFlagsRequest {
                provider_id: String::new(),
                selector: set.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .flag_configuration,
    )
    .unwrap();
    assert_eq!(
        fetched["flags"].as_object().unwrap().len(),
        4,
        "w, x, y, z: {fetched}"
    );
    for bad in [
        "core.openfeature.dev/default?labelSelector=app%20in%20(x",
        "core.openfeature.dev?labelSelector=app%3Dx",
        "core.openfeature.dev/default/extra?labelSelector=app%3Dx",
    ] {
        let status = client
            .sync_flags(sync_request(Some(bad), ""))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{bad}: {status:?}");
    }
    // `*`: the FeatureFlags of every namespace, by namespace and name; a key two namespaces
    // define (`x`, in `default` and `other`) is served from neither: no namespace can shadow
    // another's flag by sorting first.
    let mut elsewhere = labelled_flags("a", "checkout", &["v", "x"], "on");
    elsewhere["metadata"]["namespace"] = serde_json::json!("other");
    h.fake.apply(elsewhere).unwrap();
    let every = client
        .fetch_all_flags(flagd::FetchAllFlagsRequest {
            provider_id: String::new(),
            selector: "core.openfeature.dev/*?labelSelector=app%3Dcheckout".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .flag_configuration;
    let every: Value = serde_json::from_str(&every).unwrap();
    let keys: Vec<&String> = every["flags"].as_object().unwrap().keys().collect();
    assert_eq!(keys, ["v", "w", "y", "z"], "{every}");
}

/// `request` with the incremental-updates header set to `value`.
fn incremental<T>(mut request: tonic::Request<T>, value: &str) -> tonic::Request<T> {
    request.metadata_mut().insert(
        crd_broker::grpc::flagd::INCREMENTAL_HEADER,
        value.parse().unwrap(),
    );
    request
}

/// A set's SyncFlags request asking for incremental updates (`value` of the header).
fn incremental_request(set: &str, value: &str) -> tonic::Request<flagd::SyncFlagsRequest> {
    incremental(sync_request(Some(set), ""), value)
}

#[tokio::test]
async fn incremental_updates_send_only_the_feature_flag_that_changed_and_name_one_that_left() {
    let h = start(Duration::ZERO).await;
    h.fake
        .apply(labelled_flags("a", "checkout", &["x"], "on"))
        .unwrap();
    let mut b = labelled_flags("b", "checkout", &["y", "z"], "off");
    b["spec"]["flagSpec"]["metadata"] = json!({ "flagSetId": "team-b" });
    h.fake.apply(b).unwrap();
    let set = "core.openfeature.dev/default?labelSelector=app%3Dcheckout";
    let mut client = flagd_client(&h).await;
    let mut s = client
        .sync_flags(incremental_request(set, "true"))
        .await
        .unwrap()
        .into_inner();
    // At once: every flag, each naming its flag set.
    let first = config(&mut s).await;
    let sets: Vec<&Value> = ["x", "y", "z"]
        .iter()
        .map(|k| &first["flags"][*k]["metadata"]["flagSetId"])
        .collect();
    assert_eq!(
        sets,
        [&json!("default/a"), &json!("team-b"), &json!("team-b")],
        "{first}"
    );

    // An edit of b: b's flags alone.
    h.fake
        .merge_patch(
            GV,
            "featureflags",
            "default",
            "b",
            json!({ "spec": { "flagSpec": { "flags": { "z": { "defaultVariant": "on" } } } } }),
        )
        .unwrap();
    let edit = config(&mut s).await;
    let keys: Vec<&String> = edit["flags"].as_object().unwrap().keys().collect();
    assert_eq!(keys, ["y", "z"], "{edit}");
    assert!(edit.get("metadata").is_none(), "{edit}");

    // a leaves the set: no flags, naming its flag set.
    h.fake
        .merge_patch(GV, "featureflags", "default", "a", relabel("cart"))
        .unwrap();
    assert_eq!(
        config(&mut s).await,
        json!({ "flags": {}, "metadata": { "flagSetId": "default/a" } })
    );

    // FetchAllFlags with the header: every flag set in one configuration, as a first message.
    let fetch = flagd::FetchAllFlagsRequest {
        provider_id: String::new(),
        selector: set.into(),
    };
    let fetch = incremental(tonic::Request::new(fetch), "true");
    let fetched: Value = serde_json::from_str(
        &client
            .fetch_all_flags(fetch)
            .await
            .unwrap()
            .into_inner()
            .flag_configuration,
    )
    .unwrap();
    assert_eq!(
        fetched["flags"]["y"]["metadata"]["flagSetId"], "team-b",
        "{fetched}"
    );

    // A header that is not true or false, or asks it of one FeatureFlag or of sync.v1: refused,
    // naming the header; the stream already open goes on.
    for (selector, value) in [
        (set, "yes"),
        (set, &*"t".repeat(10_000)),
        ("core.openfeature.dev/default/a", "true"),
    ] {
        let status = client
            .sync_flags(incremental_request(selector, value))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains("crd-broker-incremental-updates"),
            "{status:?}"
        );
        assert!(
            status.message().len() < 400,
            "bounded: {}",
            status.message().len()
        );
    }
    let mut legacy = LegacyClient::connect(format!("http://{}", h.broker.addr))
        .await
        .unwrap();
    let request = legacy::SyncFlagsRequest {
        provider_id: String::new(),
        selector: set.into(),
    };
    let request = incremental(tonic::Request::new(request), "true");
    let status = legacy.sync_flags(request).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    h.fake
        .merge_patch(
            GV,
            "featureflags",
            "default",
            "b",
            json!({ "spec": { "flagSpec": { "flags": { "y": { "defaultVariant": "on" } } } } }),
        )
        .unwrap();
    assert_eq!(config(&mut s).await["flags"]["y"]["defaultVariant"], "on");
}

/// The line of `family{labels}` in the broker's metrics, as text; none if it has no series.
fn series(h: &Harness, family_and_labels: &str) -> Option<String> {
    h.broker
        .registry
        .metrics()
        .encode()
        .lines()
        .find(|l| l.starts_with(family_and_labels))
        .map(str::to_string)
}

#[tokio::test]
async fn sync_streams_are_counted_by_selector_and_each_end_by_its_reason() {
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut big = flag("big", "on");
    big["spec"]["flagSpec"]["metadata"] = json!({ "padding": "x".repeat(4_300_000) });
    h.fake.apply(big).unwrap();
    let mut client = flagd_client(&h).await;
    let demo = r#"{selector="featureflags.v1beta1.core.openfeature.dev/default/demo""#;
    let open = format!("crd_broker_flagd_sync_streams{demo}}}");
    let ended = |reason: &str| {
        format!("crd_broker_flagd_sync_streams_ended_total{demo},reason=\"{reason}\"}}")
    };

    // Open, then its client goes.
    let mut s = client
        .sync_flags(sync_request(Some(SELECTOR), ""))
        .await
        .unwrap()
        .into_inner();
    config(&mut s).await;
    assert_eq!(series(&h, &open).unwrap(), format!("{open} 1"));
    drop(s);
    eventually("the client's end counted", WAIT, async || {
        series(&h, &ended("client_disconnect")).is_some()
    })
    .await;
    assert_eq!(series(&h, &open).unwrap(), format!("{open} 0"));

    // The deadline the client gave is kept by the broker too: DEADLINE_EXCEEDED, counted so.
    let mut request = sync_request(Some(SELECTOR), "");
    request.set_timeout(Duration::from_millis(700));
    let mut s = client.sync_flags(request).await.unwrap().into_inner();
    config(&mut s).await;
    let status = support::ended(&mut s).await;
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    eventually("the deadline's end counted", WAIT, async || {
        series(&h, &ended("deadline_exceeded")).is_some()
    })
    .await;

    // A malformed deadline is refused by name.
    let mut request = sync_request(Some(SELECTOR), "");
    request
        .metadata_mut()
        .insert("grpc-timeout", "soon".parse().unwrap());
    let status = client.sync_flags(request).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("grpc-timeout \"soon\""),
        "{status:?}"
    );

    // The broker ends it with an error: a configuration too large.
    let mut s = client
        .sync_flags(sync_request(Some("core.openfeature.dev/default/big"), ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(support::ended(&mut s).await.code(), Code::ResourceExhausted);
    let big = r#"crd_broker_flagd_sync_streams_ended_total{selector="featureflags.v1beta1.core.openfeature.dev/default/big",reason="error"}"#;
    eventually("the error's end counted", WAIT, async || {
        series(&h, big).is_some_and(|l| l.ends_with(" 1"))
    })
    .await;

    // The broker drains: shutdown.
    let mut s = client
        .sync_flags(sync_request(Some(SELECTOR), ""))
        .await
        .unwrap()
        .into_inner();
    config(&mut s).await;
    let metrics = h.broker.registry.metrics().clone();
    let stopping = tokio::spawn(h.broker.stop());
    assert_eq!(support::ended(&mut s).await.code(), Code::Unavailable);
    stopping.await.unwrap().unwrap();
    let text = metrics.encode();
    for (reason, count) in [
        ("client_disconnect", 1),
        ("deadline_exceeded", 1),
        ("drain", 1),
    ] {
        let line = format!("{} {count}", ended(reason));
        assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
    }
    assert!(text.lines().any(|l| l == format!("{open} 0")), "{text}");
    assert!(
        text.lines()
            .any(|l| l == r#"crd_broker_flagd_sync_stream_seconds_count{reason="drain"} 1"#),
        "{text}"
    );
}
