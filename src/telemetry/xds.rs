//! The xDS server's families: its streams open, the responses it sent (and their bytes), the
//! ones its clients refused (NACKs) and the requests it resumed, by resource type. A NACK means a
//! client would not take what the broker served it, and keeps using what it had before; a
//! resumed request came on a new stream with the version the broker would send, and was not
//! answered with the same resources again.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The resource types the xDS server serves.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum XdsType {
    /// `envoy.config.listener.v3.Listener`.
    Listener,
    /// `envoy.config.route.v3.RouteConfiguration`.
    Route,
    /// `envoy.config.cluster.v3.Cluster`.
    Cluster,
    /// `envoy.config.endpoint.v3.ClusterLoadAssignment`.
    Endpoints,
}

label_values!(XdsType {
    Listener => "listener",
    Route => "route",
    Cluster => "cluster",
    Endpoints => "endpoints",
});

const XDS_TYPES: [XdsType; 4] = [
    XdsType::Listener,
    XdsType::Route,
    XdsType::Cluster,
    XdsType::Endpoints,
];

/// Labels of the xDS response and NACK counters.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct XdsTypeLabels {
    /// The resource type.
    pub r#type: XdsType,
}

/// The xDS server's families.
#[derive(Default)]
pub struct XdsMetrics {
    /// ADS streams open.
    pub streams: Gauge,
    /// Responses sent, by type.
    pub responses: Family<XdsTypeLabels, Counter>,
    /// Bytes of the responses sent (their resources, encoded), by type.
    pub response_bytes: Family<XdsTypeLabels, Counter>,
    /// Responses a client refused (a request with `error_detail`), by type.
    pub nacks: Family<XdsTypeLabels, Counter>,
    /// Requests opening a type on a new stream with the version the client already holds,
    /// answered by nothing, by type.
    pub resumed: Family<XdsTypeLabels, Counter>,
}

impl XdsMetrics {
    /// Registers the families under `crd_broker_`.
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "xds_streams",
            "xDS (ADS) streams open",
            self.streams.clone(),
        );
        registry.register(
            "xds_responses",
            "xDS responses sent, by resource type",
            self.responses.clone(),
        );
        registry.register(
            "xds_response_bytes",
            "Bytes of the xDS responses sent (their encoded size), by resource type",
            self.response_bytes.clone(),
        );
        registry.register(
            "xds_nacks",
            "xDS responses a client refused (NACK), by resource type: the client keeps what it \
             had before",
            self.nacks.clone(),
        );
        registry.register(
            "xds_resumed",
            "xDS requests that opened a type on a new stream with the version the client holds, \
             answered without sending it again, by resource type",
            self.resumed.clone(),
        );
    }

    /// A series at zero for every type.
    pub(super) fn initialize(&self) {
        for r#type in XDS_TYPES {
            let labels = XdsTypeLabels { r#type };
            let _ = self.responses.get_or_create(&labels);
            let _ = self.response_bytes.get_or_create(&labels);
            let _ = self.nacks.get_or_create(&labels);
            let _ = self.resumed.get_or_create(&labels);
        }
    }

    /// Counts a response sent of `type`, of `bytes` encoded.
    pub fn responded(&self, r#type: XdsType, bytes: usize) {
        let labels = XdsTypeLabels { r#type };
        self.responses.get_or_create(&labels).inc();
        self.response_bytes
            .get_or_create(&labels)
            .inc_by(bytes as u64);
    }

    /// Counts a request of `type` resumed at the version its client holds.
    pub fn resumed(&self, r#type: XdsType) {
        self.resumed.get_or_create(&XdsTypeLabels { r#type }).inc();
    }

    /// Counts a response of `type` a client refused.
    pub fn refused(&self, r#type: XdsType) {
        self.nacks.get_or_create(&XdsTypeLabels { r#type }).inc();
    }
}
