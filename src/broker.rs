//! A broker assembled: the registry over a source, the gRPC services over the registry, the
//! transport they are served on, readiness and gRPC health, and the admin endpoints. The one
//! module besides the command line that knows every layer; tests start brokers through it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;

use crate::access::{self, Access, Authenticate};
use crate::grpc::BrokerService;
use crate::grpc::flagd::{FlagdCore, FlagdService, LegacyService};
use crate::grpc::wire::Streams;
use crate::grpc::xds::{Drain, Xds};
use crate::ops::health::Readiness;
use crate::pb::broker_server::Broker as _;
use crate::pb::flagd::flag_sync_service_server::FlagSyncService as _;
use crate::pb::flagd::flag_sync_service_server::FlagSyncServiceServer;
use crate::pb::legacy::flag_sync_service_server::FlagSyncService as _;
use crate::pb::legacy::flag_sync_service_server::FlagSyncServiceServer as LegacyServer;
use crate::registry::{DEFAULT_LINGER, Registry};
use crate::source::{Source, SourceError};
use crate::telemetry::{GrpcMethod, Known, Metrics};
use crate::transport::{self, Serving};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;

/// How a broker behaves; the defaults are the command line's.
#[derive(Debug, Clone)]
pub struct Config {
    /// How long a watch outlives its last subscriber.
    pub linger: Duration,
    /// How often the source's readiness is checked.
    pub readiness_interval: Duration,
    /// How long the broker stays ready, serving what it knows, while the source fails.
    pub max_staleness: Duration,
    /// Connections: age, keepalive, limits, drain.
    pub transport: transport::Config,
    /// The most resources watched at once (`--max-watches`).
    pub max_watches: usize,
    /// Identity, policy and per-caller limits.
    pub access: access::Settings,
    /// Who may read the admin endpoints that tell what exists.
    pub admin: crate::access::admin::Settings,
    /// The xDS name resolver for the broker's own Service, if on (`--xds-service`).
    pub xds: Option<crate::grpc::xds::Settings>,
    /// What every flagd sync response carries as its `sync_context` (`--context-value`).
    pub flagd_context: Vec<(String, String)>,
}

/// The default `--max-watches`: each watch holds a connection to the API server, and a cluster
/// of 10,000 sidecars rarely needs as many distinct resources.
pub const DEFAULT_MAX_WATCHES: usize = 10_000;

/// Every gRPC method a broker serves: the only methods its metrics name (any other path counts
/// as `other`, so that clients cannot add series to `/metrics`).
pub const METHODS: &[GrpcMethod] = &[
    GrpcMethod::new("/crdbroker.v1.Broker/Subscribe", "server_stream"),
    GrpcMethod::new("/flagd.sync.v1.FlagSyncService/SyncFlags", "server_stream"),
    GrpcMethod::new("/flagd.sync.v1.FlagSyncService/FetchAllFlags", "unary"),
    GrpcMethod::new("/flagd.sync.v1.FlagSyncService/GetMetadata", "unary"),
    GrpcMethod::new("/sync.v1.FlagSyncService/SyncFlags", "server_stream"),
    GrpcMethod::new("/sync.v1.FlagSyncService/FetchAllFlags", "unary"),
    GrpcMethod::new("/grpc.health.v1.Health/Check", "unary"),
    GrpcMethod::new("/grpc.health.v1.Health/Watch", "server_stream"),
    GrpcMethod::new(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "bidi_stream",
    ),
    GrpcMethod::new(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "bidi_stream",
    ),
    GrpcMethod::new(
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources",
        "bidi_stream",
    ),
    GrpcMethod::new(
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources",
        "bidi_stream",
    ),
];

impl Default for Config {
    fn default() -> Self {
        Config {
            linger: DEFAULT_LINGER,
            readiness_interval: Duration::from_secs(10),
            max_staleness: crate::ops::health::DEFAULT_MAX_STALENESS,
            transport: transport::Config::default(),
            max_watches: DEFAULT_MAX_WATCHES,
            access: access::Settings::default(),
            admin: crate::access::admin::Settings::default(),
            xds: None,
            flagd_context: Vec::new(),
        }
    }
}

/// Where to listen.
#[derive(Default)]
pub struct Listeners {
    /// gRPC over TCP.
    pub tcp: Option<TcpListener>,
    /// TLS for the TCP listener.
    pub tls: Option<Arc<transport::tls::Tls>>,
    /// gRPC over a unix domain socket (plain), and its path (removed at exit).
    pub unix: Option<(UnixListener, std::path::PathBuf)>,
    /// The admin HTTP server.
    pub admin: Option<TcpListener>,
}

impl Listeners {
    /// gRPC on one TCP listener, nothing else.
    pub fn tcp(listener: TcpListener) -> Self {
        Listeners {
            tcp: Some(listener),
            ..Listeners::default()
        }
    }
}

/// A broker serving on its listeners.
pub struct Running<S> {
    /// The TCP address gRPC listens on (unspecified when there is no TCP listener).
    pub addr: SocketAddr,
    /// The admin server's address, if any.
    pub admin_addr: Option<SocketAddr>,
    /// Its registry, for introspection.
    pub registry: Registry<S>,
    /// Cancel to shut it down (see [`Running::stop`]).
    pub shutdown: CancellationToken,
    /// Readiness, as `/readyz` and gRPC health report it.
    pub readiness: Arc<Readiness>,
    /// Who may read what.
    pub access: Arc<Access>,
    /// This replica's drain as its xDS server tells clients ([`Running::announce_drain`]).
    pub drain: Drain,
    /// How long the xDS drain notice lasts (zero with xDS off).
    drain_notice: Duration,
    serving: Serving,
}

impl<S: Source> Running<S> {
    /// Starts serving `source` on `listener` with default settings and the given linger.
    pub fn start(listener: TcpListener, source: S, linger: Duration) -> anyhow::Result<Self> {
        let config = Config {
            linger,
            ..Config::default()
        };
        Self::start_with(Listeners::tcp(listener), source, config)
    }

    /// Starts serving `source` on `listeners`.
    pub fn start_with(listeners: Listeners, source: S, config: Config) -> anyhow::Result<Self> {
        let Listeners {
            tcp,
            tls,
            unix,
            admin,
        } = listeners;
        let admin_addr = admin.as_ref().map(TcpListener::local_addr).transpose()?;
        let shutdown = CancellationToken::new();
        let kinds = source.kinds();
        let known = Known {
            kinds: &kinds,
            methods: METHODS,
            error_reasons: &SourceError::REASONS,
        };
        let metrics = Arc::new(Metrics::new(known, source.api_requests()));
        let api = config.access.api.clone();
        let access = Access::new(config.access, metrics.clone())?;
        let guard = crate::access::admin::Guard::new(config.admin, api, access.token_reviewer())?;
        let registry = Registry::with_metrics(
            source,
            config.linger,
            shutdown.clone(),
            metrics.clone(),
            config.max_watches,
        );
        let (reporter, health) = tonic_health::server::health_reporter();
        let readiness = Readiness::new(reporter, shutdown.clone(), config.max_staleness);
        readiness.spawn_checks(
            registry.clone(),
            access.clone(),
            config.readiness_interval,
            metrics.clone(),
        );
        if let Some(admin) = admin {
            // gRPC health on the admin port too, where the OpenFeature Operator's flagd-proxy
            // probes look for it.
            let grpc = axum::Router::new()
                .route_service("/grpc.health.v1.Health/Check", health.clone())
                .route_service("/grpc.health.v1.Health/Watch", health.clone());
            let open = access.clone();
            crate::ops::admin::spawn(
                admin,
                readiness.clone(),
                registry.clone(),
                metrics.clone(),
                Box::new(move || open.callers()),
                grpc,
                guard,
            );
        }
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::pb::DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()?;
        let reflection_alpha = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::pb::DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1alpha()?;
        let flagd = Arc::new(
            FlagdCore::new(registry.clone(), access.clone(), shutdown.clone())
                .with_context(crate::grpc::flagd::sync_context(&config.flagd_context)?),
        );
        let native = Arc::new(BrokerService::new(
            registry.clone(),
            access.clone(),
            shutdown.clone(),
        ));
        let drain = Drain::default();
        let mut tonic_routes = tonic::service::Routes::new(health)
            .add_service(reflection)
            .add_service(reflection_alpha)
            .add_service(FlagSyncServiceServer::new(FlagdService(flagd.clone())))
            .add_service(LegacyServer::new(LegacyService(flagd.clone())));
        let drain_notice = match config.xds {
            Some(xds) => {
                tonic_routes =
                    tonic_routes.add_service(AggregatedDiscoveryServiceServer::new(Xds::new(
                        xds.service,
                        registry.clone(),
                        access.clone(),
                        drain.clone(),
                        shutdown.clone(),
                    )));
                xds.drain_notice
            }
            None => Duration::ZERO,
        };
        let tonic_routes = tonic_routes.prepare();
        // The streams go out through `wire`: no buffer per stream, and an update of 8 KiB or
        // more sent as the same bytes to every subscriber. tonic serves the rest.
        let (flagd, legacy) = (
            Arc::new(FlagdService(flagd.clone())),
            Arc::new(LegacyService(flagd)),
        );
        let routes = Streams::new(tonic_routes)
            .route("/crdbroker.v1.Broker/Subscribe", move |request| {
                let native = native.clone();
                async move { native.subscribe(request).await }
            })
            .route("/flagd.sync.v1.FlagSyncService/SyncFlags", move |request| {
                let flagd = flagd.clone();
                async move { flagd.sync_flags(request).await }
            })
            .route("/sync.v1.FlagSyncService/SyncFlags", move |request| {
                let legacy = legacy.clone();
                async move { legacy.sync_flags(request).await }
            });
        // Every request's caller is named before the services see it (anonymous with identity
        // off): a service refuses a request without one.
        let make: transport::MakeService = {
            let access = access.clone();
            Arc::new(move |peer| {
                let conn = access.connection(peer);
                transport::Service::new(Authenticate::new(access.clone(), conn, routes.clone()))
            })
        };
        let serving = transport::serve(
            transport::Listeners { tcp, tls, unix },
            make,
            config.transport,
            shutdown.clone(),
            metrics,
        )?;
        Ok(Running {
            addr: serving.addr,
            admin_addr,
            registry,
            shutdown,
            readiness,
            access,
            drain,
            drain_notice,
            serving,
        })
    }

    /// Starts the xDS drain notice: from now on this replica's xDS server serves its own
    /// address as DRAINING, so clients open no new streams here. Returns how long to keep
    /// serving before [`Running::stop`] (zero with xDS off).
    pub fn announce_drain(&self) -> Duration {
        self.drain.start();
        self.drain_notice
    }

    /// Drains: readiness and health go down, listeners close, every connection gets GOAWAY and
    /// its streams end with UNAVAILABLE; waits at most the shutdown grace for connections to
    /// finish, then closes the rest.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.finished().await
    }

    /// Waits for the drain that cancelling `shutdown` started.
    pub async fn finished(self) -> anyhow::Result<()> {
        self.shutdown.cancelled().await;
        let Running {
            registry, serving, ..
        } = self;
        let stopped = async {
            // The watch tasks stop with the token.
            let _ = tokio::time::timeout(Duration::from_secs(5), registry.stopped()).await;
        };
        tokio::join!(serving.finished(), stopped);
        Ok(())
    }
}
