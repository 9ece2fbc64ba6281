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
use crate::source::Object;

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
        service: service(),
        metrics: Arc::new(Metrics::default()),
        own: own.map(|ip| ip.parse().unwrap()),
        types: HashMap::new(),
        nonces: 0,
    }
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
    let got: Vec<_> = resources::replicas(&m, 8013, None)
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
    let own = resources::replicas(&m, 8013, Some("10.0.0.2".parse().unwrap()));
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
    let port = |m: &Members| resources::replicas(m, 8013, None).first().map(|r| r.port);
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
    let lds = s
        .request(ask(LISTENER, &["crd-broker.flags:8013"], "", ""), &m, false)
        .unwrap();
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
    assert!(s.request(ack, &m, false).is_none());

    let cds = s
        .request(ask(CLUSTER, &["crd-broker.flags:8013"], "", ""), &m, false)
        .unwrap();
    assert_eq!(cds.resources.len(), 1);
    let eds = s
        .request(
            ask(ENDPOINTS, &["crd-broker.flags:8013"], "", ""),
            &m,
            false,
        )
        .unwrap();
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
    assert!(s.changes(&m, false).is_empty());

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
    let changes = s.changes(&four, false);
    assert_eq!(changes.len(), 1);
    assert_eq!(changes[0].type_url, ENDPOINTS);
    assert_ne!(changes[0].version_info, eds.version_info);
    assert_eq!(assignment(&changes[0]).len(), 4);

    // This replica starts to drain: its own address is DRAINING.
    let mut own = stream(Some("10.0.0.1"));
    own.request(
        ask(ENDPOINTS, &["crd-broker.flags:8013"], "", ""),
        &m,
        false,
    )
    .unwrap();
    let drained = own.changes(&m, true);
    assert_eq!(
        assignment(&drained[0])[0],
        ("10.0.0.1".into(), HealthStatus::Draining)
    );
}

#[test]
fn a_nack_is_not_answered_with_the_same_resources_and_a_stale_nonce_is_ignored() {
    let mut s = stream(None);
    let m = three();
    let first = s
        .request(
            ask(ENDPOINTS, &["crd-broker.flags:8013"], "", ""),
            &m,
            false,
        )
        .unwrap();
    let mut nack = ask(ENDPOINTS, &["crd-broker.flags:8013"], "", &first.nonce);
    nack.error_detail = Some(RpcStatus {
        code: 3,
        message: "x".repeat(100_000),
        details: vec![],
    });
    assert!(s.request(nack, &m, false).is_none());
    // A request answering an older response than the last is stale: no answer, and its
    // names are not taken.
    let stale = ask(ENDPOINTS, &["other"], "", "not-the-last-nonce");
    assert!(s.request(stale, &m, false).is_none());
    assert!(s.changes(&m, false).is_empty());
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
    let lds = s
        .request(ask(LISTENER, &["other.flags:8013"], "", ""), &m, false)
        .unwrap();
    assert!(lds.resources.is_empty());
    let cds = s
        .request(ask(CLUSTER, &["other"], "", ""), &m, false)
        .unwrap();
    assert!(cds.resources.is_empty());
    // The route is inline in the Listener: none is served by name.
    let rds = s.request(ask(ROUTE, &["r"], "", ""), &m, false).unwrap();
    assert!(rds.resources.is_empty());
    // A type it does not know: answered empty too.
    let other = s
        .request(ask("type.googleapis.com/x.Y", &["a"], "", ""), &m, false)
        .unwrap();
    assert!(other.resources.is_empty());
    // Empty names unsubscribe: nothing is sent.
    assert!(
        s.request(ask(LISTENER, &[], "", &lds.nonce), &m, false)
            .is_none()
    );
}

#[test]
fn endpoints_wait_until_the_slices_are_listed() {
    let mut s = stream(None);
    let unlisted = Members::default();
    assert!(
        s.request(
            ask(ENDPOINTS, &["crd-broker.flags:8013"], "", ""),
            &unlisted,
            false
        )
        .is_none()
    );
    let changes = s.changes(&three(), false);
    assert_eq!(assignment(&changes[0]).len(), 3);
    // No replica at all: an assignment without localities.
    let none = s.changes(&members(vec![]), false);
    let cla = ClusterLoadAssignment::decode(none[0].resources[0].value.as_slice()).unwrap();
    assert!(cla.endpoints.is_empty());
}
