//! The standard gRPC server families (go-grpc-prometheus's names, which stock dashboards read)
//! and the connections the server holds. Only the methods the broker serves — a table it is
//! given at start — become labels; any other path counts as `other`, so that clients cannot add
//! series to `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// A gRPC method's labels in the standard server families.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcLabels {
    /// The service, e.g. `flagd.sync.v1.FlagSyncService`.
    pub grpc_service: &'static str,
    /// The method, e.g. `SyncFlags`.
    pub grpc_method: &'static str,
    /// `unary`, `server_stream` or `bidi_stream`.
    pub grpc_type: &'static str,
}

/// [`GrpcLabels`] and the status code's name (`OK`, `NotFound`, as grpc-go spells them).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcCodeLabels {
    /// The service.
    pub grpc_service: &'static str,
    /// The method.
    pub grpc_method: &'static str,
    /// The call type.
    pub grpc_type: &'static str,
    /// The status code.
    pub grpc_code: &'static str,
}

/// The status codes by number, named as grpc-go names them.
pub const GRPC_CODES: [&str; 17] = [
    "OK",
    "Canceled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
];

impl GrpcLabels {
    /// The labels of a path the broker does not serve.
    const OTHER: GrpcLabels = GrpcLabels {
        grpc_service: "other",
        grpc_method: "other",
        grpc_type: "unknown",
    };

    /// These labels with `code` (a status number; an unknown one counts as `Unknown`).
    pub fn with_code(&self, code: i32) -> GrpcCodeLabels {
        let name = usize::try_from(code)
            .ok()
            .and_then(|c| GRPC_CODES.get(c))
            .unwrap_or(&"Unknown");
        GrpcCodeLabels {
            grpc_service: self.grpc_service,
            grpc_method: self.grpc_method,
            grpc_type: self.grpc_type,
            grpc_code: name,
        }
    }
}

/// A gRPC method a server serves.
#[derive(Debug, Clone, Copy)]
pub struct GrpcMethod {
    /// `/package.Service/Method`.
    pub path: &'static str,
    /// `unary`, `server_stream` or `bidi_stream`.
    pub kind: &'static str,
}

impl GrpcMethod {
    /// The method at `path`, of the call type `kind`.
    pub const fn new(path: &'static str, kind: &'static str) -> GrpcMethod {
        GrpcMethod { path, kind }
    }

    /// Its labels in the gRPC server families.
    pub fn labels(&self) -> GrpcLabels {
        let (service, method) = self
            .path
            .trim_start_matches('/')
            .split_once('/')
            .unwrap_or(("other", "other"));
        GrpcLabels {
            grpc_service: service,
            grpc_method: method,
            grpc_type: self.kind,
        }
    }
}

/// How a connection reached the broker.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Transport {
    /// Plain TCP (HTTP/2 without TLS).
    Tcp,
    /// TCP with TLS.
    Tls,
    /// A unix domain socket.
    Unix,
}

label_values!(Transport { Tcp => "tcp", Tls => "tls", Unix => "unix" });

/// Labels of the connections gauge.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectionLabels {
    /// How the connections came.
    pub transport: Transport,
}

/// The standard gRPC server families, and the connections gauge.
pub struct GrpcMetrics {
    /// `grpc_server_started_total`: calls received.
    pub started: Family<GrpcLabels, Counter>,
    /// `grpc_server_handled_total`: calls completed, by status code.
    pub handled: Family<GrpcCodeLabels, Counter>,
    /// `grpc_server_msg_received_total`: request messages.
    pub msg_received: Family<GrpcLabels, Counter>,
    /// `grpc_server_msg_sent_total`: response messages.
    pub msg_sent: Family<GrpcLabels, Counter>,
    /// `grpc_server_handling_seconds`: from the request to the call's end (a stream's life).
    pub handling_seconds: Family<GrpcLabels, Histogram>,
    /// `crd_broker_connections`: client connections open, by transport.
    pub connections: Family<ConnectionLabels, Gauge>,
    /// The methods served: the only ones that are labels.
    methods: &'static [GrpcMethod],
}

/// The `grpc_server_handling_seconds` buckets of go-grpc-prometheus.
fn grpc_histogram() -> Histogram {
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

impl GrpcMetrics {
    /// The families for a server serving `methods`.
    pub fn new(methods: &'static [GrpcMethod]) -> GrpcMetrics {
        GrpcMetrics {
            started: Family::default(),
            handled: Family::default(),
            msg_received: Family::default(),
            msg_sent: Family::default(),
            handling_seconds: Family::new_with_constructor(grpc_histogram),
            connections: Family::default(),
            methods,
        }
    }

    /// The labels of the method at `path`: one the broker serves, or `other`.
    pub fn labels(&self, path: &str) -> GrpcLabels {
        match self.methods.iter().find(|m| m.path == path) {
            Some(m) => m.labels(),
            None => GrpcLabels::OTHER,
        }
    }

    /// Registers the `grpc_server_` families, and `crd_broker_connections`.
    pub(super) fn register(&self, root: &mut Registry) {
        root.sub_registry_with_prefix("crd_broker").register(
            "connections",
            "Client connections open, by transport",
            self.connections.clone(),
        );
        let grpc = root.sub_registry_with_prefix("grpc_server");
        grpc.register(
            "started",
            "gRPC calls started on the server",
            self.started.clone(),
        );
        grpc.register(
            "handled",
            "gRPC calls completed on the server, by status code",
            self.handled.clone(),
        );
        grpc.register(
            "msg_received",
            "gRPC request messages received",
            self.msg_received.clone(),
        );
        grpc.register(
            "msg_sent",
            "gRPC response messages sent",
            self.msg_sent.clone(),
        );
        grpc.register(
            "handling_seconds",
            "Seconds from a gRPC call's start to its end (a stream's life)",
            self.handling_seconds.clone(),
        );
    }

    /// A series for every method served and every status code, and each transport, at zero.
    pub(super) fn initialize(&self) {
        for method in self.methods {
            let labels = method.labels();
            let _ = self.started.get_or_create(&labels);
            let _ = self.msg_received.get_or_create(&labels);
            let _ = self.msg_sent.get_or_create(&labels);
            let _ = self.handling_seconds.get_or_create(&labels);
            for code in 0..GRPC_CODES.len() as i32 {
                let _ = self.handled.get_or_create(&labels.with_code(code));
            }
        }
        for transport in [Transport::Tcp, Transport::Tls, Transport::Unix] {
            let _ = self
                .connections
                .get_or_create(&ConnectionLabels { transport });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_labels_are_a_closed_set() {
        const SERVED: &[GrpcMethod] = &[GrpcMethod::new(
            "/crdbroker.v1.Broker/Subscribe",
            "server_stream",
        )];
        let metrics = GrpcMetrics::new(SERVED);
        let subscribe = metrics.labels("/crdbroker.v1.Broker/Subscribe");
        assert_eq!(
            (
                subscribe.grpc_service,
                subscribe.grpc_method,
                subscribe.grpc_type
            ),
            ("crdbroker.v1.Broker", "Subscribe", "server_stream")
        );
        for path in [
            "/evil/random-path-123",
            "/crdbroker.v1.Broker/Invented",
            "/crdbroker.v1.Broker/Subscribe2",
        ] {
            assert_eq!(metrics.labels(path).grpc_method, "other", "{path}");
        }
        assert_eq!(subscribe.with_code(0).grpc_code, "OK");
        assert_eq!(subscribe.with_code(1).grpc_code, "Canceled");
        assert_eq!(subscribe.with_code(99).grpc_code, "Unknown");
    }
}
