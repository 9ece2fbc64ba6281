//! The broker as its own xDS name resolver (ADR 0023): gRPC clients with an `xds:///` target
//! learn the ready replicas of the broker's own Service from the broker, and learn of each
//! change at once, where `dns:///` re-resolves only when a connection breaks.
//!
//! It serves state-of-the-world ADS (`envoy.service.discovery.v3.AggregatedDiscoveryService`)
//! for one Service (`--xds-service NAME.NAMESPACE:PORT`): the Listener each client's target
//! names, the Cluster, and its endpoints from the Service's EndpointSlices
//! ([`resources`]). The EndpointSlices are a set in the broker's own registry, so a replica holds
//! one API watch for them however many clients resolve through it. A replica that shuts down
//! first serves its own address as DRAINING ([`Drain`]), so clients stop opening streams there
//! before its streams end.

pub mod resources;

use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryService;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::access::{Access, Caller};
use crate::conn::{Peer, PeerAddr, canonical_ip};
use crate::registry::{Members, Registry, Subscription};
use crate::selector::{KindRef, is_dns_label};
use crate::source::{Set, Source};
use crate::telemetry::{Metrics, Open};

/// The Service whose replicas the xDS server serves: `NAME.NAMESPACE:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsService {
    /// The Service's name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
    /// The port clients dial.
    pub port: u16,
}

impl XdsService {
    /// The Cluster's name, and its load assignment's: `NAME.NAMESPACE:PORT`.
    pub fn cluster(&self) -> String {
        self.to_string()
    }

    /// Whether a client's `xds:///` target (the Listener it asks for) names this Service: its
    /// name, `NAME.NAMESPACE`, `NAME.NAMESPACE.svc` or `NAME.NAMESPACE.svc.DOMAIN`, with its
    /// port.
    pub fn named_by(&self, listener: &str) -> bool {
        let Some((host, port)) = listener.rsplit_once(':') else {
            return false;
        };
        if port.parse::<u16>().ok() != Some(self.port) {
            return false;
        }
        let qualified = format!("{}.{}", self.name, self.namespace);
        host == self.name
            || host == qualified
            || host == format!("{qualified}.svc")
            || host
                .strip_prefix(&format!("{qualified}.svc."))
                .is_some_and(|domain| !domain.is_empty())
    }

    /// The set of the Service's EndpointSlices.
    fn endpoint_slices(&self) -> Set {
        Set {
            kind: KindRef {
                resource: "endpointslices".into(),
                version: Some("v1".into()),
                group: "discovery.k8s.io".into(),
            },
            namespace: Some(self.namespace.clone()),
            labels: format!("kubernetes.io/service-name={}", self.name)
                .parse()
                .unwrap_or_default(),
        }
    }
}

impl std::fmt::Display for XdsService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}:{}", self.name, self.namespace, self.port)
    }
}

/// Why `--xds-service` is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--xds-service {0:?}: {1} (expected NAME.NAMESPACE:PORT, e.g. crd-broker.flags:8013)")]
pub struct XdsServiceError(String, &'static str);

impl FromStr for XdsService {
    type Err = XdsServiceError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let shown: String = text.chars().take(100).collect();
        let err = |why| XdsServiceError(shown.clone(), why);
        let (host, port) = text.rsplit_once(':').ok_or_else(|| err("no port"))?;
        let port = port
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| err("the port is not a number from 1 to 65535"))?;
        let (name, namespace) = host.split_once('.').ok_or_else(|| err("no namespace"))?;
        if !is_dns_label(name) {
            return Err(err("the name is not a DNS label"));
        }
        if !is_dns_label(namespace) {
            return Err(err("the namespace is not a DNS label"));
        }
        Ok(XdsService {
            name: name.into(),
            namespace: namespace.into(),
            port,
        })
    }
}

/// How the xDS server runs.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The Service it serves.
    pub service: XdsService,
    /// On SIGTERM, how long the replica serves its own address as DRAINING before it ends its
    /// streams.
    pub drain_notice: Duration,
}

/// A replica's own drain, as its xDS server tells its clients.
#[derive(Debug, Clone)]
pub struct Drain(Arc<watch::Sender<bool>>);

impl Default for Drain {
    fn default() -> Self {
        Drain(Arc::new(watch::channel(false).0))
    }
}

impl Drain {
    /// From now on the replica serves its own address as DRAINING.
    pub fn start(&self) {
        self.0.send_replace(true);
    }

    fn watch(&self) -> watch::Receiver<bool> {
        self.0.subscribe()
    }
}

/// The xDS server.
pub struct Xds<S> {
    service: XdsService,
    registry: Registry<S>,
    access: Arc<Access>,
    drain: Drain,
    shutdown: CancellationToken,
}

impl<S: Source> Xds<S> {
    /// An xDS server for `service`, its EndpointSlices watched through `registry`; each stream
    /// counts against its caller's `--max-streams-per-caller` in `access`.
    pub fn new(
        service: XdsService,
        registry: Registry<S>,
        access: Arc<Access>,
        drain: Drain,
        shutdown: CancellationToken,
    ) -> Self {
        Xds {
            service,
            registry,
            access,
            drain,
            shutdown,
        }
    }

    /// The Service's EndpointSlices, shared by every stream. Not resolved as a caller's
    /// request is: the kind is named in full (no discovery), and neither `--resource` nor
    /// `--namespace` applies, since no caller reads the slices through it (ADR 0023).
    fn subscribe(&self) -> Result<Subscription<Members>, Status> {
        self.registry
            .try_subscribe(&self.service.endpoint_slices(), || None)
            .map_err(|full| Status::resource_exhausted(full.to_string()))
    }
}

/// What one stream has asked for and been sent of one type.
#[derive(Default)]
struct Sent {
    names: BTreeSet<String>,
    version: Option<String>,
    nonce: String,
}

/// One ADS stream.
struct Stream {
    service: XdsService,
    /// Where its responses and NACKs are counted.
    metrics: Arc<Metrics>,
    /// This replica's address as the client reached it.
    own: Option<IpAddr>,
    types: HashMap<String, Sent>,
    nonces: u64,
}

impl Stream {
    /// The resources of `type_url` among `names`, and their version (a digest of them).
    fn resources(
        &self,
        type_url: &str,
        names: &BTreeSet<String>,
        members: &Members,
        draining: bool,
    ) -> Option<(String, Vec<Any>)> {
        let cluster = self.service.cluster();
        let resources: Vec<Any> = match type_url {
            resources::LISTENER => names
                .iter()
                .filter(|name| self.service.named_by(name))
                .map(|name| resources::listener(name, &self.service))
                .collect(),
            resources::CLUSTER if names.contains(&cluster) => {
                vec![resources::cluster(&self.service)]
            }
            resources::ENDPOINTS if names.contains(&cluster) => {
                // Not before the slices are listed: an empty list would say there is no replica.
                if !members.synced {
                    return None;
                }
                let own = self.own.filter(|_| draining);
                let replicas = resources::replicas(members, self.service.port, own);
                vec![resources::endpoints(&self.service, &replicas)]
            }
            _ => Vec::new(),
        };
        let mut digest = std::collections::hash_map::DefaultHasher::new();
        for r in &resources {
            r.value.hash(&mut digest);
        }
        Some((format!("{:016x}", digest.finish()), resources))
    }

    /// The response for `type_url` if it is due: `force` for a request that must be answered,
    /// else only when what the client holds differs.
    fn respond(
        &mut self,
        type_url: &str,
        members: &Members,
        draining: bool,
        force: bool,
    ) -> Option<DiscoveryResponse> {
        let names = self.types.get(type_url)?.names.clone();
        if names.is_empty() {
            return None;
        }
        let (version, resources) = self.resources(type_url, &names, members, draining)?;
        let sent = self.types.get_mut(type_url)?;
        if !force && sent.version.as_deref() == Some(version.as_str()) {
            return None;
        }
        self.nonces += 1;
        sent.version = Some(version.clone());
        sent.nonce = self.nonces.to_string();
        if let Some(r#type) = resources::known(type_url) {
            self.metrics.xds.responded(r#type);
        }
        Some(DiscoveryResponse {
            version_info: version,
            resources,
            type_url: type_url.to_string(),
            nonce: sent.nonce.clone(),
            ..Default::default()
        })
    }

    /// A client's request: what to answer, if anything.
    fn request(
        &mut self,
        request: DiscoveryRequest,
        members: &Members,
        draining: bool,
    ) -> Option<DiscoveryResponse> {
        let type_url = request.type_url;
        let Some(r#type) = resources::known(&type_url) else {
            // Answered empty, the first time it is asked on the stream, and not kept: what a
            // stream holds is bounded by the four types served.
            tracing::debug!(type_url, "an xDS type this server does not serve");
            if !request.response_nonce.is_empty() {
                return None;
            }
            self.nonces += 1;
            return Some(DiscoveryResponse {
                type_url,
                nonce: self.nonces.to_string(),
                ..Default::default()
            });
        };
        let sent = self.types.entry(type_url.clone()).or_default();
        // A request that answers an older response than the last one sent is stale: the
        // client will answer the newer one too.
        if !request.response_nonce.is_empty() && request.response_nonce != sent.nonce {
            return None;
        }
        if let Some(error) = &request.error_detail {
            self.metrics.xds.refused(r#type);
            let message: String = error.message.chars().take(500).collect();
            tracing::warn!(
                type_url,
                version = request.version_info,
                %message,
                "an xDS client refused a response (NACK)"
            );
        }
        let names: BTreeSet<String> = request.resource_names.into_iter().collect();
        let changed = names != sent.names;
        sent.names = names;
        // A request without a nonce opens the type on this stream (or resumes it on a new
        // one): it is always answered. An ACK or NACK is answered only if the subscription or
        // the resources changed.
        let force = request.response_nonce.is_empty() || changed;
        self.respond(&type_url, members, draining, force)
    }

    /// What changed resources owe each type the client follows.
    fn changes(&mut self, members: &Members, draining: bool) -> Vec<DiscoveryResponse> {
        let types: Vec<String> = self.types.keys().cloned().collect();
        types
            .iter()
            .filter_map(|t| self.respond(t, members, draining, false))
            .collect()
    }
}

#[tonic::async_trait]
impl<S: Source> AggregatedDiscoveryService for Xds<S> {
    type StreamAggregatedResourcesStream = BoxStream<'static, Result<DiscoveryResponse, Status>>;
    type DeltaAggregatedResourcesStream =
        BoxStream<'static, Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let own = request
            .extensions()
            .get::<Peer>()
            .and_then(|p| match p.addr {
                PeerAddr::Tcp { local, .. } => Some(canonical_ip(local.ip())),
                PeerAddr::Unix { .. } => None,
            });
        let drain = request
            .extensions()
            .get::<crate::conn::ConnDrain>()
            .map(|d| d.token().clone())
            .unwrap_or_else(|| self.shutdown.clone());
        // A stream of the caller's like any other: one caller cannot hold more than its share.
        let caller = Caller::of(request.extensions())?;
        let ticket = self.access.admit(&caller, &[], 0)?;
        let mut requests = request.into_inner();
        let mut members = self.subscribe()?;
        let mut draining = self.drain.watch();
        let mut stream = Stream {
            service: self.service.clone(),
            metrics: self.registry.metrics().clone(),
            own,
            types: HashMap::new(),
            nonces: 0,
        };
        let (tx, rx) = mpsc::channel::<Result<DiscoveryResponse, Status>>(8);
        let open = Open::new(&stream.metrics.xds.streams);
        tokio::spawn(async move {
            let (_ticket, _open) = (ticket, open);
            loop {
                let out: Vec<DiscoveryResponse> = tokio::select! {
                    next = requests.next() => match next {
                        Some(Ok(request)) => {
                            let state = members.current();
                            let drains = *draining.borrow();
                            stream.request(request, &state, drains).into_iter().collect()
                        }
                        Some(Err(status)) => {
                            // Undecodable bytes, or the client gone (then nobody reads this).
                            let why: String = status.message().chars().take(200).collect();
                            let refusal = Status::invalid_argument(format!(
                                "an xDS request that is not a DiscoveryRequest: {why}"
                            ));
                            let _ = tx.send(Err(refusal)).await;
                            break;
                        }
                        None => break,
                    },
                    alive = members.changed() => {
                        if !alive {
                            break;
                        }
                        let state = members.current();
                        stream.changes(&state, *draining.borrow())
                    }
                    Ok(()) = draining.changed() => {
                        let state = members.current();
                        stream.changes(&state, *draining.borrow_and_update())
                    }
                    _ = drain.cancelled() => {
                        let _ = tx.send(Err(Status::unavailable("the broker is draining this connection: resolve again"))).await;
                        break;
                    }
                };
                for response in out {
                    if tx.send(Ok(response)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(
            tokio_stream::wrappers::ReceiverStream::new(rx).boxed(),
        ))
    }

    async fn delta_aggregated_resources(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented(
            "crd-broker serves state-of-the-world ADS (StreamAggregatedResources), not delta xDS",
        ))
    }
}

#[cfg(test)]
mod tests;
