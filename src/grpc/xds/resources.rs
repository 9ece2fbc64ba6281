//! What the xDS server serves for its one Service, built from that Service's EndpointSlices:
//! the Listener a client's `xds:///` target names (an API listener whose inline route sends
//! every call to one Cluster), the Cluster (its endpoints by EDS over the same stream), and the
//! Cluster's load assignment — ready endpoints HEALTHY, terminating ones DRAINING, the rest
//! UNHEALTHY — in the shape gRPC's xDS clients accept (gRFC A27).

use std::collections::BTreeMap;
use std::net::IpAddr;

use envoy_types::pb::envoy::config::cluster::v3::{Cluster, cluster};
use envoy_types::pb::envoy::config::core::v3::{
    Address, AggregatedConfigSource, ApiVersion, ConfigSource, HealthStatus, Locality,
    SocketAddress, address, config_source, socket_address,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::envoy::config::listener::v3::{ApiListener, Listener};
use envoy_types::pb::envoy::config::route::v3::{
    Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, route, route_action,
    route_match,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, http_connection_manager, http_filter,
};
use envoy_types::pb::google::protobuf::{Any, UInt32Value};
use prost::Message;
use serde::Deserialize;

use super::service::XdsService;
use crate::registry::Members;
use crate::telemetry::XdsType;

/// The Listener type.
pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
/// The RouteConfiguration type (the route is inline in the Listener: nothing is served by it).
pub const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
/// The Cluster type.
pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
/// The ClusterLoadAssignment type.
pub const ENDPOINTS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const HCM: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
const ROUTER: &str = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router";

/// The four types the server answers with resources.
pub const TYPES: [&str; 4] = [LISTENER, ROUTE, CLUSTER, ENDPOINTS];

/// Which of the four types the server answers with resources `type_url` is, if any.
pub fn known(type_url: &str) -> Option<XdsType> {
    match type_url {
        LISTENER => Some(XdsType::Listener),
        ROUTE => Some(XdsType::Route),
        CLUSTER => Some(XdsType::Cluster),
        ENDPOINTS => Some(XdsType::Endpoints),
        _ => None,
    }
}

fn any(type_url: &str, message: &impl Message) -> Any {
    Any {
        type_url: type_url.to_string(),
        value: message.encode_to_vec(),
    }
}

/// The Listener `name`: every call to the one Cluster.
pub fn listener(name: &str, service: &XdsService) -> Any {
    let route = RouteConfiguration {
        name: service.cluster(),
        virtual_hosts: vec![VirtualHost {
            name: service.cluster(),
            domains: vec!["*".into()],
            routes: vec![Route {
                r#match: Some(RouteMatch {
                    path_specifier: Some(route_match::PathSpecifier::Prefix(String::new())),
                    ..Default::default()
                }),
                action: Some(route::Action::Route(RouteAction {
                    cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(
                        service.cluster(),
                    )),
                    ..Default::default()
                })),
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    let manager = HttpConnectionManager {
        route_specifier: Some(http_connection_manager::RouteSpecifier::RouteConfig(route)),
        // gRPC's clients want the router last (and C-core and grpc-go want a filter at all).
        http_filters: vec![HttpFilter {
            name: "router".into(),
            config_type: Some(http_filter::ConfigType::TypedConfig(any(
                ROUTER,
                &Router::default(),
            ))),
            ..Default::default()
        }],
        ..Default::default()
    };
    let listener = Listener {
        name: name.to_string(),
        api_listener: Some(ApiListener {
            api_listener: Some(any(HCM, &manager)),
        }),
        ..Default::default()
    };
    any(LISTENER, &listener)
}

/// The Cluster: round robin over the endpoints EDS gives on the same stream.
pub fn cluster(service: &XdsService) -> Any {
    let cluster = Cluster {
        name: service.cluster(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ConfigSource {
                config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
                    AggregatedConfigSource::default(),
                )),
                resource_api_version: ApiVersion::V3 as i32,
                ..Default::default()
            }),
            service_name: String::new(),
        }),
        lb_policy: cluster::LbPolicy::RoundRobin as i32,
        ..Default::default()
    };
    any(CLUSTER, &cluster)
}

/// One address the Service's EndpointSlices list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replica {
    /// Its IP address.
    pub ip: IpAddr,
    /// The port clients dial there.
    pub port: u16,
    /// Its health as xDS says it.
    pub health: HealthStatus,
}

/// The part of an EndpointSlice the server reads.
#[derive(Deserialize)]
struct Slice {
    #[serde(default)]
    endpoints: Vec<SliceEndpoint>,
    #[serde(default)]
    ports: Option<Vec<SlicePort>>,
}

#[derive(Deserialize)]
struct SliceEndpoint {
    #[serde(default)]
    addresses: Vec<String>,
    #[serde(default)]
    conditions: Conditions,
}

#[derive(Deserialize, Default)]
struct Conditions {
    ready: Option<bool>,
    terminating: Option<bool>,
}

#[derive(Deserialize)]
struct SlicePort {
    name: Option<String>,
    port: Option<u16>,
}

/// The port a slice lists for `service`: the one named as the Service's port (a slice lists the
/// `targetPort`, which may differ from the port clients dial, under the Service port's name),
/// else the one numbered as the Service's, else the slice's only port.
fn port_of(ports: &[SlicePort], service: &XdsService) -> Option<u16> {
    let named = |p: &&SlicePort| service.port_name.is_some() && p.name == service.port_name;
    ports
        .iter()
        .find(named)
        .or_else(|| ports.iter().find(|p| p.port == Some(service.port)))
        .and_then(|p| p.port)
        .or(match ports {
            [only] => only.port,
            _ => None,
        })
}

/// The replicas `members` (the Service's EndpointSlices) list, each address and port once, in
/// that order: two replicas at one address (host-network pods on one node) are two. A slice
/// without a port for `service` ([`port_of`]) is skipped, and said so. An address listed
/// twice keeps its healthiest state. `draining` (this replica's own address, while it shuts
/// down) is DRAINING whatever the slices say.
pub fn replicas(members: &Members, service: &XdsService, draining: Option<IpAddr>) -> Vec<Replica> {
    let mut by_address: BTreeMap<(IpAddr, u16), Replica> = BTreeMap::new();
    for (name, update) in members.objects.iter() {
        let Ok(slice) = serde_json::from_slice::<Slice>(&update.object.json) else {
            continue;
        };
        let ports = slice.ports.unwrap_or_default();
        let Some(port) = port_of(&ports, service) else {
            tracing::warn!(
                slice = %name,
                service = %service,
                "an EndpointSlice without the Service's port (by name or number, or an only one) is skipped; name the port: --xds-service NAME.NAMESPACE:PORT/PORT-NAME"
            );
            continue;
        };
        for endpoint in slice.endpoints {
            // Kubernetes: a missing `ready` means ready, a missing `terminating` means not.
            let health = if endpoint.conditions.terminating == Some(true) {
                HealthStatus::Draining
            } else if endpoint.conditions.ready.unwrap_or(true) {
                HealthStatus::Healthy
            } else {
                HealthStatus::Unhealthy
            };
            for address in endpoint.addresses {
                let Ok(ip) = address.parse::<IpAddr>() else {
                    continue;
                };
                let health = if Some(ip) == draining {
                    HealthStatus::Draining
                } else {
                    health
                };
                let replica = Replica { ip, port, health };
                by_address
                    .entry((ip, port))
                    .and_modify(|old| {
                        if rank(health) < rank(old.health) {
                            *old = replica;
                        }
                    })
                    .or_insert(replica);
            }
        }
    }
    by_address.into_values().collect()
}

/// Healthier first.
fn rank(health: HealthStatus) -> u8 {
    match health {
        HealthStatus::Healthy => 0,
        HealthStatus::Draining => 1,
        _ => 2,
    }
}

/// The Cluster's load assignment: one locality (gRPC skips a locality without a weight), every
/// replica in it.
pub fn endpoints(service: &XdsService, replicas: &[Replica]) -> Any {
    let lb_endpoints = replicas
        .iter()
        .map(|r| LbEndpoint {
            host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                address: Some(Address {
                    address: Some(address::Address::SocketAddress(SocketAddress {
                        address: r.ip.to_string(),
                        port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(
                            r.port,
                        ))),
                        ..Default::default()
                    })),
                }),
                ..Default::default()
            })),
            health_status: r.health as i32,
            ..Default::default()
        })
        .collect::<Vec<_>>();
    let assignment = ClusterLoadAssignment {
        cluster_name: service.cluster(),
        endpoints: if lb_endpoints.is_empty() {
            Vec::new()
        } else {
            vec![LocalityLbEndpoints {
                locality: Some(Locality::default()),
                lb_endpoints,
                load_balancing_weight: Some(UInt32Value { value: 1 }),
                ..Default::default()
            }]
        },
        ..Default::default()
    };
    any(ENDPOINTS, &assignment)
}
