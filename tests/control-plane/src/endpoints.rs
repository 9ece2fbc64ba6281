//! A headless Service's EndpointSlice as the EndpointSlice controller writes it (no controller
//! runs beside the control plane here, so tests and the harness write it themselves), and the
//! EndpointSlice kind for the fake API server, which serves only the kinds it is given.

use std::net::Ipv4Addr;

use serde_json::{Value, json};

/// The EndpointSlice of the headless Service `service` in `namespace`: `ready` addresses, then
/// `terminating` ones, on `port`.
pub fn endpoint_slice(
    namespace: &str,
    service: &str,
    port: u16,
    ready: &[Ipv4Addr],
    terminating: &[Ipv4Addr],
) -> Value {
    let endpoint = |ip: &Ipv4Addr, ready: bool| {
        json!({
            "addresses": [ip.to_string()],
            "conditions": { "ready": ready, "serving": ready, "terminating": !ready },
        })
    };
    let endpoints: Vec<Value> = ready
        .iter()
        .map(|ip| endpoint(ip, true))
        .chain(terminating.iter().map(|ip| endpoint(ip, false)))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{service}-abcde"),
            "namespace": namespace,
            "labels": { "kubernetes.io/service-name": service },
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{ "name": "grpc", "port": port, "protocol": "TCP" }],
    })
}

/// The EndpointSlice kind as a CustomResourceDefinition, for the fake API server (a real one
/// serves it already).
pub fn endpoint_slice_kind() -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": "endpointslices.discovery.k8s.io" },
        "spec": {
            "group": "discovery.k8s.io",
            "scope": "Namespaced",
            "names": { "plural": "endpointslices", "singular": "endpointslice", "kind": "EndpointSlice" },
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": { "openAPIV3Schema": { "type": "object", "x-kubernetes-preserve-unknown-fields": true } },
            }],
        },
    })
}
