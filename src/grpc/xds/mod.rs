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
mod service;

pub use service::{XdsService, XdsServiceError};

use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryService;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use super::delivery::drain_of;
use super::messages::{End, Messages, Next, View};
use crate::access::{Access, Caller};
use crate::conn::{Peer, PeerAddr, canonical_ip};
use crate::registry::subscribers::Registered;
use crate::registry::{Delivered, Members, Registry, StableHash, Subscription, Wire, slot};
use crate::source::Source;
use crate::sync::lock;
use crate::telemetry::{Metrics, Open};

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
    shared: Arc<Shared>,
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
            shared: Arc::new(Shared::new(service.clone())),
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
            .map_err(|refused| match refused {
                crate::registry::Refused::Full(full) => {
                    Status::resource_exhausted(full.to_string())
                }
                crate::registry::Refused::Forbidden(error) => Status::unavailable(format!(
                    "the broker may not read its Service's EndpointSlices now: {error}"
                )),
            })
    }
}

/// The most resource names one request may carry for a type, and the longest name: a gRPC
/// client names one Listener and one Cluster; names past these are refused with
/// INVALID_ARGUMENT rather than stored and answered.
pub const MAX_NAMES: usize = 16;
/// See [`MAX_NAMES`].
pub const MAX_NAME_BYTES: usize = 512;
/// The longest `version_info` a client may resume with: the broker's versions are 16 hex
/// digits; a longer one cannot be the broker's, and is answered as if none were given.
const MAX_VERSION_BYTES: usize = 64;

/// What one stream follows of one type: only what the server serves is kept (a client cannot
/// make a stream hold names nobody serves).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Wanted {
    /// Whether it asked for anything (an empty list after names unsubscribes).
    subscribed: bool,
    /// The Listeners it names that name the Service (for the Listener type).
    listeners: BTreeSet<String>,
    /// Whether it names the Cluster (for the Cluster and endpoint types), or every resource of
    /// the type (a wildcard: `*`, or the legacy empty first request of Listeners and Clusters).
    cluster: bool,
}

/// What one stream has asked for and been sent of one type.
#[derive(Default)]
struct Sent {
    wanted: Wanted,
    /// Whether a request of the type came on the stream.
    asked: bool,
    /// Whether its first request named nothing (the legacy wildcard, for Listeners and Clusters).
    legacy_wildcard: bool,
    /// The version the client holds, as far as the stream knows: the last one sent, or the one
    /// it resumed with.
    version: Option<String>,
    /// Whether it resumed with a version not yet compared with the broker's (the endpoints may
    /// not be listed yet).
    resuming: bool,
    nonce: String,
    /// A hash of the last version the client refused, so that a NACK it repeats is logged once.
    refused: Option<u64>,
}

/// What every stream of the server shares: the Cluster, built once, and this replica's
/// endpoints while it drains, built once per state of the slices and address.
struct Shared {
    service: XdsService,
    cluster: Any,
    draining: std::sync::Mutex<Vec<(u64, IpAddr, Wire)>>,
}

impl Shared {
    fn new(service: XdsService) -> Self {
        Shared {
            cluster: resources::cluster(&service),
            service,
            draining: std::sync::Mutex::default(),
        }
    }

    /// The endpoints of `members`, encoded once per state and shared by every stream; while
    /// this replica drains, with `own` (its address as the client reached it) DRAINING, once per
    /// state and address.
    fn endpoints(&self, members: &Members, own: Option<IpAddr>) -> Wire {
        let encode = |own| {
            let replicas = resources::replicas(members, &self.service, own);
            bytes::Bytes::from(resources::endpoints(&self.service, &replicas).value)
        };
        let plain = members.wire(slot::XDS_ENDPOINTS, |_| encode(None));
        let Some(own) = own else {
            return plain;
        };
        let mut draining = lock(&self.draining);
        if let Some((_, _, wire)) = draining
            .iter()
            .find(|(state, ip, _)| *state == plain.digest && *ip == own)
        {
            return wire.clone();
        }
        let wire = Wire::new(encode(Some(own)));
        // A replica drains once; a few addresses and states are all this ever holds.
        if draining.len() >= 8 {
            draining.remove(0);
        }
        draining.push((plain.digest, own, wire.clone()));
        wire
    }
}

/// Why a request is refused: INVALID_ARGUMENT, and the stream ends.
fn refuse(type_url: &str, why: String) -> Status {
    let shown: String = type_url.chars().take(100).collect();
    Status::invalid_argument(format!("an xDS request for {shown}: {why}"))
}

/// One ADS stream.
struct Stream {
    shared: Arc<Shared>,
    /// Where its responses and NACKs are counted.
    metrics: Arc<Metrics>,
    /// This replica's address as the client reached it.
    own: Option<IpAddr>,
    types: HashMap<&'static str, Sent>,
    nonces: u64,
    /// Where what it sent and what its client ACKed are kept, per type ([`PARTS`]), for
    /// `/debug/subscribers`.
    registered: Option<Arc<Registered>>,
}

/// The types a stream's entry in `/debug/subscribers` shows, in order.
const PARTS: [&str; 3] = [
    resources::LISTENER,
    resources::CLUSTER,
    resources::ENDPOINTS,
];

/// The names of [`PARTS`], as `/debug/subscribers` shows them.
const PART_NAMES: [&str; 3] = ["listener", "cluster", "endpoints"];

impl Stream {
    /// Records, for `type_url`, what the client holds now (`delivered`) or should hold.
    fn record(&self, type_url: &str, version: &str, delivered: bool) {
        let (Some(registered), Some(index)) =
            (&self.registered, PARTS.iter().position(|t| *t == type_url))
        else {
            return;
        };
        let version: Arc<str> = version.into();
        if delivered {
            registered.delivered(index, Delivered::Xds(version));
        } else {
            registered.current(index, version);
        }
    }
}

impl Stream {
    /// The resources of `type_url` the stream wants, and their version (a digest of them);
    /// `None` while the endpoints are not listed yet.
    fn resources(
        &self,
        type_url: &str,
        wanted: &Wanted,
        members: &Members,
        draining: bool,
    ) -> Option<(String, Vec<Any>)> {
        let service = &self.shared.service;
        let resources: Vec<Any> = match type_url {
            resources::LISTENER => wanted
                .listeners
                .iter()
                .map(|name| resources::listener(name, service))
                .collect(),
            resources::CLUSTER if wanted.cluster => vec![self.shared.cluster.clone()],
            resources::ENDPOINTS if wanted.cluster => {
                // Not before the slices are listed: an empty list would say there is no replica.
                if !members.synced {
                    return None;
                }
                let wire = self
                    .shared
                    .endpoints(members, self.own.filter(|_| draining));
                let mut version = StableHash::default();
                version.write(&wire.bytes);
                return Some((
                    version.hex(),
                    vec![Any {
                        type_url: resources::ENDPOINTS.to_string(),
                        value: wire.bytes.to_vec(),
                    }],
                ));
            }
            _ => Vec::new(),
        };
        let mut version = StableHash::default();
        for r in &resources {
            version.write(&(r.value.len() as u64).to_le_bytes());
            version.write(&r.value);
        }
        Some((version.hex(), resources))
    }

    /// The response for `type_url` if it is due: `force` for a request that must be answered,
    /// else only when what the client holds differs (as far as the stream knows: what it sent,
    /// or the version the client resumed with).
    fn respond(
        &mut self,
        type_url: &'static str,
        members: &Members,
        draining: bool,
        force: bool,
    ) -> Option<DiscoveryResponse> {
        let wanted = &self.types.get(type_url)?.wanted;
        if !wanted.subscribed {
            return None;
        }
        let (version, resources) = self.resources(type_url, wanted, members, draining)?;
        let sent = self.types.get_mut(type_url)?;
        let resumed = std::mem::take(&mut sent.resuming);
        if !force && sent.version.as_deref() == Some(version.as_str()) {
            if let Some(r#type) = resources::known(type_url).filter(|_| resumed) {
                self.metrics.xds.resumed(r#type);
                self.record(type_url, &version, false);
                self.record(type_url, &version, true);
            }
            return None;
        }
        self.nonces += 1;
        sent.version = Some(version.clone());
        sent.nonce = self.nonces.to_string();
        let response = DiscoveryResponse {
            version_info: version,
            resources,
            type_url: type_url.to_string(),
            nonce: sent.nonce.clone(),
            ..Default::default()
        };
        self.record(type_url, &response.version_info, false);
        if let Some(r#type) = resources::known(type_url) {
            self.metrics
                .xds
                .responded(r#type, prost::Message::encoded_len(&response));
        }
        Some(response)
    }

    /// A client's request: what to answer, if anything; an error ends the stream.
    fn request(
        &mut self,
        request: DiscoveryRequest,
        members: &Members,
        draining: bool,
    ) -> Result<Option<DiscoveryResponse>, Status> {
        let Some(type_url) = resources::TYPES
            .iter()
            .copied()
            .find(|t| *t == request.type_url)
        else {
            return Ok(self.unknown(request));
        };
        let r#type = resources::known(type_url);
        if request.resource_names.len() > MAX_NAMES {
            return Err(refuse(
                type_url,
                format!(
                    "{} resource names, more than the {MAX_NAMES} a request may carry",
                    request.resource_names.len()
                ),
            ));
        }
        if let Some(long) = request
            .resource_names
            .iter()
            .find(|n| n.len() > MAX_NAME_BYTES)
        {
            return Err(refuse(
                type_url,
                format!(
                    "a resource name of {} bytes, longer than the {MAX_NAME_BYTES} a name may be",
                    long.len()
                ),
            ));
        }
        let sent = self.types.entry(type_url).or_default();
        // A request that answers an older response than the last one sent is stale: the
        // client will answer the newer one too.
        if !request.response_nonce.is_empty() && request.response_nonce != sent.nonce {
            return Ok(None);
        }
        let answers = !request.response_nonce.is_empty();
        if let (Some(registered), true) = (&self.registered, answers) {
            let counter = match request.error_detail {
                Some(_) => &registered.nacks,
                None => &registered.acks,
            };
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if answers
            && request.error_detail.is_none()
            && let Some(version) = sent.version.clone()
        {
            // An ACK: the client holds what was sent with that nonce.
            self.record(type_url, &version, true);
        }
        let sent = self.types.entry(type_url).or_default();
        if let Some(error) = &request.error_detail {
            if let Some(r#type) = r#type {
                self.metrics.xds.refused(r#type);
            }
            // Counted every time; logged once per version refused, however often repeated.
            let mut hash = std::collections::hash_map::DefaultHasher::new();
            request.version_info.hash(&mut hash);
            let refused = hash.finish();
            if sent.refused != Some(refused) {
                sent.refused = Some(refused);
                let message: String = error.message.chars().take(500).collect();
                let version: String = request.version_info.chars().take(100).collect();
                tracing::warn!(
                    type_url,
                    version,
                    %message,
                    "an xDS client refused a response (NACK)"
                );
            }
        }
        // The first request of a type on a stream, with no nonce, may name the version the
        // client holds from an earlier stream (of this replica or another): it resumes there,
        // and is answered only if what the broker would send differs (ADR 0026).
        let resumes = !sent.asked
            && request.response_nonce.is_empty()
            && !request.version_info.is_empty()
            && request.version_info.len() <= MAX_VERSION_BYTES;
        if !sent.asked {
            sent.asked = true;
            sent.legacy_wildcard = request.resource_names.is_empty();
        }
        let listeners_or_clusters = matches!(type_url, resources::LISTENER | resources::CLUSTER);
        let wildcard = request.resource_names.iter().any(|n| n == "*")
            || (listeners_or_clusters && sent.legacy_wildcard && request.resource_names.is_empty());
        let service = &self.shared.service;
        let cluster = service.cluster();
        let wanted = Wanted {
            subscribed: wildcard || !request.resource_names.is_empty(),
            listeners: match type_url {
                resources::LISTENER if wildcard => BTreeSet::from([cluster.clone()]),
                resources::LISTENER => request
                    .resource_names
                    .iter()
                    .filter(|n| service.named_by(n))
                    .cloned()
                    .collect(),
                _ => BTreeSet::new(),
            },
            cluster: matches!(type_url, resources::CLUSTER | resources::ENDPOINTS)
                && (wildcard || request.resource_names.contains(&cluster)),
        };
        let changed = wanted != sent.wanted;
        sent.wanted = wanted;
        if resumes {
            sent.version = Some(request.version_info);
            sent.resuming = true;
            return Ok(self.respond(type_url, members, draining, false));
        }
        // A request without a nonce opens the type on this stream: it is always answered. An
        // ACK or NACK is answered only if the subscription or the resources changed.
        let force = request.response_nonce.is_empty() || changed;
        Ok(self.respond(type_url, members, draining, force))
    }

    /// A type the server does not serve: answered empty when asked without a nonce, and not
    /// kept.
    fn unknown(&mut self, request: DiscoveryRequest) -> Option<DiscoveryResponse> {
        let shown: String = request.type_url.chars().take(100).collect();
        tracing::debug!(type_url = shown, "an xDS type this server does not serve");
        if !request.response_nonce.is_empty() {
            return None;
        }
        self.nonces += 1;
        Some(DiscoveryResponse {
            type_url: request.type_url,
            nonce: self.nonces.to_string(),
            ..Default::default()
        })
    }

    /// What a change of the slices or of the drain owes the client: only the endpoints depend
    /// on either.
    fn changes(&mut self, members: &Members, draining: bool) -> Option<DiscoveryResponse> {
        self.respond(resources::ENDPOINTS, members, draining, false)
    }
}

/// What an xDS stream listens to beside the EndpointSlices.
enum Input {
    /// A request from the client (or the error its bytes made).
    Request(Box<Result<DiscoveryRequest, Status>>),
    /// The client is done sending: the stream ends.
    Closed,
    /// This replica's drain notice, now.
    Draining(bool),
}

/// One client's view: its [`Stream`], with the slices and the drain notice it last saw. What a
/// client that reads slowly is owed is made when it reads, from the newest slices: it skips
/// intermediate versions and holds nothing more.
struct XdsView {
    stream: Stream,
    members: Members,
    draining: bool,
    /// Counts the stream in `crd_broker_xds_streams` while it lives.
    _open: Open,
}

impl View<Members> for XdsView {
    type Message = DiscoveryResponse;
    type Input = Input;

    fn next(&mut self, members: &Members) -> Next<DiscoveryResponse> {
        self.members = members.clone();
        self.stream
            .changes(&self.members, self.draining)
            .map_or(Next::Wait, Next::Send)
    }

    fn input(&mut self, input: Input) -> Next<DiscoveryResponse> {
        match input {
            Input::Request(request) => match *request {
                Ok(request) => match self.stream.request(request, &self.members, self.draining) {
                    Ok(response) => response.map_or(Next::Wait, Next::Send),
                    Err(refusal) => Next::Fail(refusal),
                },
                Err(status) => {
                    // Undecodable bytes, or the client gone (then nobody reads this).
                    let why: String = status.message().chars().take(200).collect();
                    Next::Fail(Status::invalid_argument(format!(
                        "an xDS request that is not a DiscoveryRequest: {why}"
                    )))
                }
            },
            Input::Closed => Next::End,
            Input::Draining(draining) => {
                self.draining = draining;
                self.stream
                    .changes(&self.members, draining)
                    .map_or(Next::Wait, Next::Send)
            }
        }
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
        let drain = drain_of(&request, &self.shutdown);
        // A stream of the caller's like any other: one caller cannot hold more than its share.
        let caller = Caller::of(request.extensions())?;
        let ticket = self.access.admit(&caller, &[], Default::default())?;
        let requests = request.into_inner();
        let members = self.subscribe()?;
        let parts = PART_NAMES.iter().map(|t| t.to_string()).collect();
        let registered = self
            .registry
            .subscribers()
            .register(caller.to_string(), "xds", parts);
        let metrics = self.registry.metrics().clone();
        let mut notice = self.drain.watch();
        let view = XdsView {
            _open: Open::new(&metrics.xds.streams),
            stream: Stream {
                shared: self.shared.clone(),
                metrics,
                own,
                types: HashMap::new(),
                nonces: 0,
                registered: Some(registered),
            },
            members: Members::default(),
            draining: *notice.borrow_and_update(),
        };
        // What the client sends, and this replica's own drain notice; the client's end of the
        // stream ends it.
        let draining = futures::stream::unfold(notice, |mut rx| async move {
            rx.changed().await.ok()?;
            let draining = *rx.borrow_and_update();
            Some((Input::Draining(draining), rx))
        });
        let input = futures::stream::select(
            requests
                .map(|request| Input::Request(Box::new(request)))
                .chain(futures::stream::once(async { Input::Closed })),
            draining,
        )
        .boxed();
        let end = End::saying(drain, Some(Arc::new(ticket)), |_| {
            Status::unavailable("the broker is draining this connection: resolve again")
        });
        let responses = Messages::with_input(members, end, tracing::Span::none(), view, input);
        Ok(Response::new(responses.boxed()))
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
