use std::collections::BTreeMap;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::HealthStatus;
use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, lb_endpoint};
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use prost::Message;
use serde_json::json;

use super::resources::{CLUSTER, ENDPOINTS, LISTENER, ROUTE};
use super::*;
use crate::registry::Update;
use crate::source::{Object, SetEvent};

fn service() -> XdsService {
    "crd-broker.flags:8013".parse().unwrap()
}

fn slice(name: &str, endpoints: serde_json::Value) -> (String, Arc<Update>) {
    let object = json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "flags", "uid": name, "resourceVersion": "1"},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "grpc", "port": 8013, "protocol": "TCP"}],
    });
    (
        name.to_string(),
        Arc::new(Update::new(Object::from_value(&object))),
    )
}

fn members(slices: Vec<(String, Arc<Update>)>) -> Members {
    Members::listed(slices.into_iter().collect::<BTreeMap<_, _>>())
}

fn three() -> Members {
    members(vec![slice(
        "crd-broker-abc",
        json!([
            {"addresses": ["10.0.0.1"], "conditions": {"ready": true}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": true}},
            {"addresses": ["10.0.0.3"], "conditions": {"ready": false, "terminating": true}},
        ]),
    )])
}

fn stream(own: Option<&str>) -> Stream {
    Stream {
        shared: Arc::new(Shared::new(service())),
        metrics: Arc::new(Metrics::default()),
        own: own.map(|ip| ip.parse().unwrap()),
        types: HashMap::new(),
        nonces: 0,
        registered: None,
    }
}

/// The stream's answer to `request`, which it does not refuse.
fn answer(
    s: &mut Stream,
    request: DiscoveryRequest,
    members: &Members,
    draining: bool,
) -> Option<DiscoveryResponse> {
    s.request(request, members, draining)
        .expect("a request the stream takes")
}

/// The first answer of `s` for `type_url`, asked for the Service's cluster (or listener) name.
fn opened(s: &mut Stream, type_url: &str, members: &Members) -> DiscoveryResponse {
    answer(
        s,
        ask(type_url, &["crd-broker.flags:8013"], "", ""),
        members,
        false,
    )
    .expect("an answer")
}

fn ask(type_url: &str, names: &[&str], version: &str, nonce: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        type_url: type_url.into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        version_info: version.into(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

fn assignment(response: &DiscoveryResponse) -> Vec<(String, HealthStatus)> {
    assert_eq!(response.resources.len(), 1);
    let cla = ClusterLoadAssignment::decode(response.resources[0].value.as_slice()).unwrap();
    assert_eq!(cla.cluster_name, "crd-broker.flags:8013");
    cla.endpoints
        .iter()
        .flat_map(|l| {
            assert_eq!(l.load_balancing_weight.as_ref().map(|w| w.value), Some(1));
            l.lb_endpoints.iter()
        })
        .map(|e| {
            let Some(lb_endpoint::HostIdentifier::Endpoint(endpoint)) = &e.host_identifier else {
                panic!("an endpoint without an address");
            };
            let address = format!("{:?}", endpoint.address);
            let ip = address
                .split("address: \"")
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .unwrap()
                .to_string();
            (ip, HealthStatus::try_from(e.health_status).unwrap())
        })
        .collect()
}

#[test]
fn the_service_is_name_namespace_and_port_and_bad_ones_say_why() {
    let s = service();
    assert_eq!(
        (s.name.as_str(), s.namespace.as_str(), s.port),
        ("crd-broker", "flags", 8013)
    );
    assert_eq!(s.to_string(), "crd-broker.flags:8013");
    for (text, why) in [
        ("crd-broker.flags", "no port"),
        ("crd-broker:8013", "no namespace"),
        ("crd-broker.flags:0", "the port"),
        ("crd-broker.flags:99999", "the port"),
        ("Crd.flags:8013", "the name is not a DNS label"),
        ("crd.fl/ags:8013", "the namespace is not a DNS label"),
        ("crd.a.b:8013", "the namespace is not a DNS label"),
    ] {
        let error = text.parse::<XdsService>().unwrap_err().to_string();
        assert!(error.contains(why), "{text}: {error}");
        assert!(error.contains("NAME.NAMESPACE:PORT"), "{error}");
    }
    let long = format!("{}.flags:8013", "a".repeat(100_000));
    assert!(long.parse::<XdsService>().unwrap_err().to_string().len() < 300);
}

#[test]
fn a_target_names_the_service_in_any_of_its_dns_forms_with_its_port() {
    let s = service();
    for name in [
        "crd-broker:8013",
        "crd-broker.flags:8013",
        "crd-broker.flags.svc:8013",
        "crd-broker.flags.svc.cluster.local:8013",
    ] {
        assert!(s.named_by(name), "{name}");
    }
    for name in [
        "crd-broker",
        "crd-broker:8014",
        "crd-broker.other:8013",
        "crd-broker.flags.svc.:8013",
        "other.flags:8013",
        "",
    ] {
        assert!(!s.named_by(name), "{name}");
    }
}

#[test]
fn ready_endpoints_are_healthy_terminating_draining_and_an_address_counts_once() {
    let m = members(vec![
        slice(
            "a",
            json!([
                {"addresses": ["10.0.0.1"], "conditions": {"ready": true}},
                {"addresses": ["10.0.0.2"], "conditions": {}},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": false, "serving": true, "terminating": true}},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": false}},
                {"addresses": ["not-an-ip"], "conditions": {"ready": true}},
            ]),
        ),
        // The same address in a second slice, not ready there: the healthier state wins.
        slice(
            "b",
            json!([{"addresses": ["10.0.0.1"], "conditions": {"ready": false}}]),
        ),
    ]);
    let got: Vec<_> = resources::replicas(&m, &service(), None)
        .into_iter()
        .map(|r| (r.ip.to_string(), r.port, r.health))
        .collect();
    assert_eq!(
        got,
        [
            ("10.0.0.1".into(), 8013, HealthStatus::Healthy),
            ("10.0.0.2".into(), 8013, HealthStatus::Healthy),
            ("10.0.0.3".into(), 8013, HealthStatus::Draining),
            ("10.0.0.4".into(), 8013, HealthStatus::Unhealthy),
        ]
    );
    // This replica, draining, says so whatever the slice says.
    let own = resources::replicas(&m, &service(), Some("10.0.0.2".parse().unwrap()));
    assert_eq!(own[1].health, HealthStatus::Draining);
}

#[test]
fn the_port_is_the_services_or_the_slices_only_one() {
    let object = |ports: serde_json::Value| {
        let o = json!({
            "metadata": {"name": "s", "uid": "s", "resourceVersion": "1"},
            "endpoints": [{"addresses": ["10.0.0.1"]}],
            "ports": ports,
        });
        members(vec![(
            "s".into(),
            Arc::new(Update::new(Object::from_value(&o))),
        )])
    };
    let port = |m: &Members| {
        resources::replicas(m, &service(), None)
            .first()
            .map(|r| r.port)
    };
    assert_eq!(port(&object(json!([{"port": 9000}]))), Some(9000));
    assert_eq!(
        port(&object(json!([{"port": 9000}, {"port": 8013}]))),
        Some(8013)
    );
    assert_eq!(port(&object(json!([{"port": 9000}, {"port": 9001}]))), None);
    assert_eq!(port(&object(json!(null))), None);
}

#[test]
fn a_client_gets_its_listener_cluster_and_endpoints_each_once_until_something_changes() {
    let mut s = stream(None);
    let m = three();
    let lds = opened(&mut s, LISTENER, &m);
    assert_eq!(lds.type_url, LISTENER);
    let listener = Listener::decode(lds.resources[0].value.as_slice()).unwrap();
    assert_eq!(listener.name, "crd-broker.flags:8013");
    assert!(listener.api_listener.is_some());
    // The ACK is not answered.
    let ack = ask(
        LISTENER,
        &["crd-broker.flags:8013"],
        &lds.version_info,
        &lds.nonce,
    );
    assert!(answer(&mut s, ack, &m, false).is_none());

    let cds = opened(&mut s, CLUSTER, &m);
    assert_eq!(cds.resources.len(), 1);
    let eds = opened(&mut s, ENDPOINTS, &m);
    assert_eq!(
        assignment(&eds),
        [
            ("10.0.0.1".into(), HealthStatus::Healthy),
            ("10.0.0.2".into(), HealthStatus::Healthy),
            ("10.0.0.3".into(), HealthStatus::Draining),
        ]
    );
    let nonces = [&lds.nonce, &cds.nonce, &eds.nonce];
    assert_eq!(
        nonces.iter().collect::<BTreeSet<_>>().len(),
        3,
        "a nonce per response"
    );
    // Nothing changed: nothing to send.
    assert!(s.changes(&m, false).is_none());

    // A fourth replica: only the endpoints are sent again, at a new version.
    let four = members(vec![slice(
        "crd-broker-abc",
        json!([
            {"addresses": ["10.0.0.1"], "conditions": {"ready": true}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": true}},
            {"addresses": ["10.0.0.3"], "conditions": {"ready": false, "terminating": true}},
            {"addresses": ["10.0.0.4"], "conditions": {"ready": true}},
        ]),
    )]);
    let change = s.changes(&four, false).unwrap();
    assert_eq!(change.type_url, ENDPOINTS);
    assert_ne!(change.version_info, eds.version_info);
    assert_eq!(assignment(&change).len(), 4);

    // This replica starts to drain: its own address is DRAINING.
    let mut own = stream(Some("10.0.0.1"));
    opened(&mut own, ENDPOINTS, &m);
    let drained = own.changes(&m, true).unwrap();
    assert_eq!(
        assignment(&drained)[0],
        ("10.0.0.1".into(), HealthStatus::Draining)
    );
}

/// A new stream, its first request of each type carrying the version a client holds.
fn resume(s: &mut Stream, held: &[&DiscoveryResponse], m: &Members) -> Vec<DiscoveryResponse> {
    held.iter()
        .filter_map(|r| {
            let names = ["crd-broker.flags:8013"];
            answer(s, ask(&r.type_url, &names, &r.version_info, ""), m, false)
        })
        .collect()
}

#[test]
fn a_new_stream_resuming_at_the_version_the_broker_would_send_is_not_sent_it_again() {
    let m = three();
    let mut first = stream(None);
    let held = [
        opened(&mut first, LISTENER, &m),
        opened(&mut first, CLUSTER, &m),
        opened(&mut first, ENDPOINTS, &m),
    ];
    // Another replica's stream (its own shared state): the same versions, nothing sent.
    let mut again = stream(None);
    assert!(resume(&mut again, &held.each_ref(), &m).is_empty());
    let text = again.metrics.encode();
    for r#type in ["listener", "cluster", "endpoints"] {
        for series in [
            format!(r#"crd_broker_xds_resumed_total{{type="{type}"}} 1"#),
            format!(r#"crd_broker_xds_responses_total{{type="{type}"}} 0"#),
            format!(r#"crd_broker_xds_response_bytes_total{{type="{type}"}} 0"#),
        ] {
            assert!(text.contains(&series), "{series} in:\n{text}");
        }
    }
    // A change is sent, with a nonce the client's ACK then names.
    let four = members(vec![slice(
        "crd-broker-abc",
        json!([{"addresses": ["10.0.0.4"], "conditions": {"ready": true}}]),
    )]);
    let change = again.changes(&four, false).unwrap();
    assert_eq!(
        assignment(&change),
        [("10.0.0.4".into(), HealthStatus::Healthy)]
    );
    let ack = ask(
        ENDPOINTS,
        &["crd-broker.flags:8013"],
        &change.version_info,
        &change.nonce,
    );
    assert!(answer(&mut again, ack, &four, false).is_none());
    assert!(again.changes(&four, false).is_none());
    let bytes = prost::Message::encoded_len(&change);
    assert!(
        again.metrics.encode().contains(&format!(
            r#"crd_broker_xds_response_bytes_total{{type="endpoints"}} {bytes}"#
        )),
        "the bytes of the one response sent are counted"
    );
}

#[test]
fn a_resume_at_another_version_is_answered_and_only_a_streams_first_request_resumes() {
    let m = three();
    let mut first = stream(None);
    let eds = opened(&mut first, ENDPOINTS, &m);
    // The client holds what a draining replica served: the endpoints are sent again.
    let mut own = stream(Some("10.0.0.1"));
    opened(&mut own, ENDPOINTS, &m);
    let draining = own.changes(&m, true).unwrap();
    let sent = resume(&mut stream(None), &[&draining], &m);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].version_info, eds.version_info);
    // A version no replica sends (too long to be one, or not one): answered.
    for version in ["x".repeat(65), "0123456789abcdef".into()] {
        let mut other = eds.clone();
        other.version_info = version;
        assert_eq!(resume(&mut stream(None), &[&other], &m).len(), 1);
    }
    // On a stream that has asked before, a request without a nonce is answered, whatever
    // version it names.
    let mut s = stream(None);
    assert!(resume(&mut s, &[&eds], &m).is_empty());
    assert_eq!(resume(&mut s, &[&eds], &m).len(), 1);
}

#[test]
fn a_resume_before_the_slices_are_listed_waits_and_sends_only_what_differs() {
    let m = three();
    let eds = opened(&mut stream(None), ENDPOINTS, &m);
    let unlisted = Members::default();
    let mut same = stream(None);
    assert!(resume(&mut same, &[&eds], &unlisted).is_empty());
    assert!(same.changes(&m, false).is_none(), "the client holds these");
    assert!(
        same.metrics
            .encode()
            .contains(r#"crd_broker_xds_resumed_total{type="endpoints"} 1"#)
    );
    let mut other = stream(None);
    assert!(resume(&mut other, &[&eds], &unlisted).is_empty());
    let four = members(vec![slice(
        "crd-broker-abc",
        json!([{"addresses": ["10.0.0.4"], "conditions": {"ready": true}}]),
    )]);
    let change = other.changes(&four, false).unwrap();
    assert_eq!(assignment(&change).len(), 1);
    assert!(
        other
            .metrics
            .encode()
            .contains(r#"crd_broker_xds_resumed_total{type="endpoints"} 0"#)
    );
}

#[test]
fn a_nack_is_not_answered_with_the_same_resources_and_a_stale_nonce_is_ignored() {
    let mut s = stream(None);
    let m = three();
    let first = opened(&mut s, ENDPOINTS, &m);
    let mut nack = ask(ENDPOINTS, &["crd-broker.flags:8013"], "", &first.nonce);
    nack.error_detail = Some(RpcStatus {
        code: 3,
        message: "x".repeat(100_000),
        details: vec![],
    });
    assert!(answer(&mut s, nack, &m, false).is_none());
    // A request answering an older response than the last is stale: no answer, and its
    // names are not taken.
    let stale = ask(ENDPOINTS, &["other"], "", "not-the-last-nonce");
    assert!(answer(&mut s, stale, &m, false).is_none());
    assert!(s.changes(&m, false).is_none());
    // One response sent and one refused, of the endpoints alone.
    let text = s.metrics.encode();
    for series in [
        r#"crd_broker_xds_responses_total{type="endpoints"} 1"#,
        r#"crd_broker_xds_nacks_total{type="endpoints"} 1"#,
        r#"crd_broker_xds_responses_total{type="listener"} 0"#,
        r#"crd_broker_xds_nacks_total{type="cluster"} 0"#,
    ] {
        assert!(text.contains(series), "{series} in:\n{text}");
    }
}

#[test]
fn names_it_does_not_serve_get_an_answer_without_them() {
    let mut s = stream(None);
    let m = three();
    // A Listener of another service: an empty answer at once, so the client's resolution
    // fails now (the resource does not exist) rather than after its 15 s timer.
    let lds = answer(
        &mut s,
        ask(LISTENER, &["other.flags:8013"], "", ""),
        &m,
        false,
    )
    .unwrap();
    assert!(lds.resources.is_empty());
    let cds = answer(&mut s, ask(CLUSTER, &["other"], "", ""), &m, false).unwrap();
    assert!(cds.resources.is_empty());
    // The route is inline in the Listener: none is served by name.
    let rds = answer(&mut s, ask(ROUTE, &["r"], "", ""), &m, false).unwrap();
    assert!(rds.resources.is_empty());
    // A type it does not know: answered empty too.
    let other = answer(
        &mut s,
        ask("type.googleapis.com/x.Y", &["a"], "", ""),
        &m,
        false,
    )
    .unwrap();
    assert!(other.resources.is_empty());
    // Empty names unsubscribe: nothing is sent.
    assert!(answer(&mut s, ask(LISTENER, &[], "", &lds.nonce), &m, false).is_none());
}

#[test]
fn endpoints_wait_until_the_slices_are_listed() {
    let mut s = stream(None);
    let unlisted = Members::default();
    assert!(
        answer(
            &mut s,
            ask(ENDPOINTS, &["crd-broker.flags:8013"], "", ""),
            &unlisted,
            false
        )
        .is_none()
    );
    let change = s.changes(&three(), false).unwrap();
    assert_eq!(assignment(&change).len(), 3);
    // No replica at all: an assignment without localities.
    let none = s.changes(&members(vec![]), false).unwrap();
    let cla = ClusterLoadAssignment::decode(none.resources[0].value.as_slice()).unwrap();
    assert!(cla.endpoints.is_empty());
}

#[test]
fn a_request_naming_too_many_or_too_long_names_is_refused_naming_the_limit() {
    let mut s = stream(None);
    let m = three();
    let many: Vec<String> = (0..MAX_NAMES + 1).map(|i| format!("n{i}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let refused = s.request(ask(ROUTE, &many, "", ""), &m, false).unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused
            .message()
            .contains("17 resource names, more than the 16"),
        "{}",
        refused.message()
    );
    let long = "a".repeat(MAX_NAME_BYTES + 1);
    let refused = s
        .request(ask(LISTENER, &[&long], "", ""), &m, false)
        .unwrap_err();
    assert!(
        refused.message().contains("513 bytes, longer than the 512"),
        "{}",
        refused.message()
    );
    assert!(refused.message().len() < 300);
}

#[test]
fn only_names_the_server_serves_are_kept() {
    let mut s = stream(None);
    let m = three();
    let names = [
        "crd-broker.flags:8013",
        "x.y.svc.a1:8013",
        "other:1",
        "crd-broker:8013",
    ];
    let lds = answer(&mut s, ask(LISTENER, &names, "", ""), &m, false).unwrap();
    assert_eq!(lds.resources.len(), 2);
    assert_eq!(
        s.types[LISTENER].wanted.listeners,
        BTreeSet::from([
            "crd-broker.flags:8013".to_string(),
            "crd-broker:8013".to_string()
        ])
    );
    answer(&mut s, ask(ROUTE, &["r1", "r2"], "", ""), &m, false).unwrap();
    let route = &s.types[ROUTE].wanted;
    assert!(route.listeners.is_empty() && !route.cluster && route.subscribed);
}

#[test]
fn the_endpoints_are_built_once_per_state_and_shared_by_every_stream() {
    let shared = Arc::new(Shared::new(service()));
    let mut streams: Vec<Stream> = (0..3)
        .map(|_| Stream {
            shared: shared.clone(),
            ..stream(None)
        })
        .collect();
    let m = three();
    let answers: Vec<DiscoveryResponse> = streams
        .iter_mut()
        .map(|s| opened(s, ENDPOINTS, &m))
        .collect();
    assert!(
        answers
            .windows(2)
            .all(|w| w[0].version_info == w[1].version_info)
    );
    let built = shared.endpoints(&m, None);
    assert!(
        std::ptr::eq(
            built.bytes.as_ptr(),
            shared.endpoints(&m, None).bytes.as_ptr()
        ),
        "one encoding for the state"
    );
    // Draining, once per address.
    let own: IpAddr = "10.0.0.1".parse().unwrap();
    let a = shared.endpoints(&m, Some(own));
    let b = shared.endpoints(&m, Some(own));
    assert!(std::ptr::eq(a.bytes.as_ptr(), b.bytes.as_ptr()));
    assert_ne!(a.digest, built.digest);
}

#[test]
fn a_repeated_nack_is_counted_each_time() {
    let mut s = stream(None);
    let m = three();
    let first = opened(&mut s, ENDPOINTS, &m);
    for _ in 0..3 {
        let mut nack = ask(
            ENDPOINTS,
            &["crd-broker.flags:8013"],
            &"v".repeat(200_000),
            &first.nonce,
        );
        nack.error_detail = Some(RpcStatus {
            code: 3,
            message: "no".into(),
            details: vec![],
        });
        assert!(answer(&mut s, nack, &m, false).is_none());
    }
    assert!(
        s.metrics
            .encode()
            .contains(r#"crd_broker_xds_nacks_total{type="endpoints"} 3"#)
    );
    assert!(
        s.types[ENDPOINTS].refused.is_some(),
        "the version refused is remembered"
    );
}

#[test]
fn the_legacy_wildcard_and_star_get_every_listener_and_cluster() {
    let m = three();
    for names in [&[][..], &["*"][..]] {
        let mut s = stream(None);
        let lds = answer(&mut s, ask(LISTENER, names, "", ""), &m, false).unwrap();
        let listener = Listener::decode(lds.resources[0].value.as_slice()).unwrap();
        assert_eq!(listener.name, "crd-broker.flags:8013", "{names:?}");
        let cds = answer(&mut s, ask(CLUSTER, names, "", ""), &m, false).unwrap();
        assert_eq!(cds.resources.len(), 1, "{names:?}");
        // The wildcard holds on the acknowledgements.
        let ack = ask(CLUSTER, names, &cds.version_info, &cds.nonce);
        assert!(answer(&mut s, ack, &m, false).is_none());
        assert!(s.types[CLUSTER].wanted.cluster);
    }
    // Endpoints have no legacy wildcard: an empty first request asks for nothing.
    let mut s = stream(None);
    assert!(answer(&mut s, ask(ENDPOINTS, &[], "", ""), &m, false).is_none());
}

#[test]
fn a_port_is_found_by_the_service_ports_name_and_replicas_by_address_and_port() {
    let named: XdsService = "crd-broker.flags:8013/grpc".parse().unwrap();
    assert_eq!(named.port_name.as_deref(), Some("grpc"));
    assert_eq!(named.cluster(), "crd-broker.flags:8013");
    assert!(
        "crd-broker.flags:8013/Bad_Name"
            .parse::<XdsService>()
            .unwrap_err()
            .to_string()
            .contains("the port's name")
    );
    let o = json!({
        "metadata": {"name": "s", "uid": "s", "resourceVersion": "1"},
        "endpoints": [
            {"addresses": ["10.0.0.1"]},
        ],
        "ports": [{"name": "admin", "port": 9001}, {"name": "grpc", "port": 9000}],
    });
    let m = members(vec![(
        "s".into(),
        Arc::new(Update::new(Object::from_value(&o))),
    )]);
    // The Service's port (8013) differs from its targetPort (9000): found by name only.
    assert!(resources::replicas(&m, &service(), None).is_empty());
    let found = resources::replicas(&m, &named, None);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].port, 9000);
    // Two replicas at one address (host-network pods on one node): two endpoints.
    let two = json!({
        "metadata": {"name": "t", "uid": "t", "resourceVersion": "1"},
        "endpoints": [{"addresses": ["10.0.0.1"]}],
        "ports": [{"name": "grpc", "port": 9002}],
    });
    let m = members(vec![
        ("s".into(), Arc::new(Update::new(Object::from_value(&o)))),
        ("t".into(), Arc::new(Update::new(Object::from_value(&two)))),
    ]);
    let ports: Vec<u16> = resources::replicas(&m, &named, None)
        .iter()
        .map(|r| r.port)
        .collect();
    assert_eq!(ports, [9000, 9002]);
}

/// The Service's slice at resourceVersion `rv`, with one ready endpoint at `10.0.0.<rv>`.
fn one_at(rv: u8) -> (String, Object) {
    let (name, update) = slice(
        "crd-broker-abc",
        json!([{"addresses": [format!("10.0.0.{rv}")], "conditions": {"ready": true}}]),
    );
    let mut object = update.object.clone();
    object.resource_version = rv.to_string();
    (name, object)
}

#[tokio::test]
async fn a_client_that_does_not_read_is_sent_the_latest_endpoints_when_it_reads() {
    use futures::StreamExt;
    use tokio_util::sync::CancellationToken;

    let source = crate::source::scripted::Scripted::default();
    let registry = Registry::new(source.clone(), Duration::ZERO, CancellationToken::new());
    let set = service().endpoint_slices();
    let metrics = Metrics::default();
    let view = XdsView {
        stream: stream(None),
        members: Members::default(),
        draining: false,
        _open: Open::new(&metrics.xds.streams),
    };
    let (requests, input) = futures::channel::mpsc::unbounded();
    let never = crate::conn::ConnDrain::new(CancellationToken::new());
    let mut responses = Messages::with_input(
        registry.subscribe(&set),
        End::new(never, None),
        tracing::Span::none(),
        view,
        input,
    );
    while source.live() == 0 {
        tokio::task::yield_now().await;
    }
    source.send_set(&set, SetEvent::Listed(vec![one_at(1)]));
    let ask_endpoints = ask(ENDPOINTS, &["crd-broker.flags:8013"], "", "");
    requests
        .unbounded_send(Input::Request(Box::new(Ok(ask_endpoints))))
        .unwrap();
    let first = responses.next().await.unwrap().unwrap();
    assert_eq!(assignment(&first)[0].0, "10.0.0.1");
    // 99 changes while the client reads nothing: it is owed only the newest.
    for i in 2..=100 {
        let (name, object) = one_at(i);
        source.send_set(&set, SetEvent::Applied(name, object));
    }
    while registry.watches()[0].updates < 100 {
        tokio::task::yield_now().await;
    }
    let latest = responses.next().await.unwrap().unwrap();
    assert_eq!(assignment(&latest)[0].0, "10.0.0.100");
    // Nothing else is owed; the client's end of the stream ends it.
    drop(requests);
    assert!(responses.next().await.is_none());
}
