//! The command line (every flag also an environment variable `CRD_BROKER_*`): `serve` picks the
//! source and the listeners and starts a [`crate::broker`]; `start` is flagd-proxy's command
//! line for the same; `subscribe` is a client.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use tokio::net::{TcpListener, UnixListener};

use crate::access::{self, IdentityList, limits};
use crate::broker::{self, Listeners, Running};
use crate::selector::KindRef;
use crate::source::Source;
use crate::source::kubernetes::{ApiHttp2, Kubernetes, StreamingLists};
use crate::source::manifests::Manifests;
use crate::telemetry::{self, LogFormat};
use crate::transport::{
    self,
    tls::{Tls, TlsFiles},
};
pub use subscribe::SubscribeArgs;

pub mod subscribe;
pub mod top;

/// Shares one Kubernetes watch per custom resource among many gRPC subscribers.
#[derive(Debug, Parser)]
#[command(name = "crd-broker", version)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
    /// Log format (the level comes from RUST_LOG, default info).
    #[arg(long, short = 'z', env = "CRD_BROKER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Plain, global = true)]
    pub log_format: LogFormat,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the broker.
    Serve(Box<Serve>),
    /// Subscribe to resources on a running broker and print every event.
    Subscribe(SubscribeArgs),
    /// A live view of a running broker in the terminal, read from its admin endpoints: each
    /// watch with its subscribers, update rate, last event, errors and staleness; connections
    /// and callers. `q` quits.
    Top(top::TopArgs),
    /// Print a shell completion script: `source <(crd-broker completions bash)`, or write it
    /// where your shell loads completions from.
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: CompletionShell,
    },
    /// Run as a drop-in for flagd-proxy, as the OpenFeature Operator starts it: the broker on
    /// the Kubernetes source serving FeatureFlags, gRPC on --port, admin endpoints on
    /// --management-port (every `serve` setting can still be given through its CRD_BROKER_*
    /// variable; CRD_BROKER_RESOURCE replaces the kinds served).
    Start(Start),
}

/// The shells `completions` writes for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CompletionShell {
    /// bash (with bash-completion).
    Bash,
    /// zsh.
    Zsh,
    /// fish.
    Fish,
}

impl CompletionShell {
    /// The completion script for the whole command line.
    pub fn script(self) -> String {
        use clap::CommandFactory;
        let shell = match self {
            CompletionShell::Bash => clap_complete::Shell::Bash,
            CompletionShell::Zsh => clap_complete::Shell::Zsh,
            CompletionShell::Fish => clap_complete::Shell::Fish,
        };
        let mut out = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "crd-broker", &mut out);
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// `crd-broker start`: flagd-proxy's command line.
#[derive(Debug, Args)]
pub struct Start {
    /// The gRPC port (flagd sync, legacy sync and the native API).
    #[arg(long, short = 'p', env = "PORT", default_value_t = 8015)]
    pub port: u16,
    /// The port of the admin endpoints (health, readiness, metrics).
    #[arg(
        long,
        short = 'm',
        env = "CRD_BROKER_MANAGEMENT_PORT",
        default_value_t = 8016
    )]
    pub management_port: u16,
    /// Debug logging (unless RUST_LOG says otherwise).
    #[arg(long, short = 'x', env = "CRD_BROKER_DEBUG")]
    pub debug: bool,
    /// How callers are identified, as `serve --identity` (default `none`).
    #[arg(long, env = "CRD_BROKER_IDENTITY", value_name = "LIST")]
    pub identity: Option<IdentityList>,
    /// Which callers may read which namespaces, as `serve --policy`.
    #[arg(long, env = "CRD_BROKER_POLICY", value_name = "FILE")]
    pub policy: Option<PathBuf>,
    /// A value for every response's `sync_context`, as `serve --context-value` (and flagd's).
    #[arg(long = "context-value", value_name = "KEY=VALUE", value_delimiter = ',', value_parser = context_value)]
    pub context_values: Vec<(String, String)>,
}

/// A `--context-value`: `KEY=VALUE`, the key not empty (its bounds:
/// [`crate::grpc::flagd::sync_context`]).
fn context_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(format!("{text:?} is not KEY=VALUE")),
    }
}

/// A duration where `0` (or `off`) means "never".
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaybeDuration(pub Option<Duration>);

impl std::str::FromStr for MaybeDuration {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim() {
            "0" | "off" | "none" => Ok(MaybeDuration(None)),
            t => humantime::parse_duration(t)
                .map(|d| MaybeDuration((!d.is_zero()).then_some(d)))
                .map_err(|e| e.to_string()),
        }
    }
}

/// An address where `none` (or `off`) means "do not listen".
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaybeAddr(pub Option<SocketAddr>);

impl std::str::FromStr for MaybeAddr {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim() {
            "" | "none" | "off" => Ok(MaybeAddr(None)),
            t => t
                .parse()
                .map(|a| MaybeAddr(Some(a)))
                .map_err(|e| format!("{e}: {t:?}")),
        }
    }
}

/// `crd-broker serve`.
#[derive(Debug, Parser)]
#[command(name = "serve")]
pub struct Serve {
    /// gRPC over TCP (`none`: no TCP listener). `[::]` listens on IPv6 and IPv4 both (IPv4
    /// alone where the host has no IPv6).
    #[arg(long, env = "CRD_BROKER_GRPC_ADDR", default_value = "[::]:8015")]
    pub grpc_addr: MaybeAddr,
    /// gRPC over a unix domain socket at this path as well (or instead, with --grpc-addr none).
    #[arg(long, env = "CRD_BROKER_GRPC_SOCKET", value_name = "PATH")]
    pub grpc_socket: Option<PathBuf>,
    /// The admin HTTP server: /livez, /readyz, /metrics, /debug/watches and gRPC health
    /// (`none`: off).
    #[arg(long, env = "CRD_BROKER_ADMIN_ADDR", default_value = "[::]:8016")]
    pub admin_addr: MaybeAddr,
    /// Who may read `/debug/*` (which names every watched resource and every caller) without
    /// credentials: `local`, callers in the broker's own pod (its containers, `kubectl
    /// port-forward`), or `public`, anyone who reaches the admin port.
    #[arg(
        long,
        env = "CRD_BROKER_DEBUG_ENDPOINTS",
        value_enum,
        default_value = "local"
    )]
    pub debug_endpoints: crate::access::admin::DebugEndpoints,
    /// How other callers may read `/debug/*`: `kubernetes`, a bearer token of a user the API
    /// server allows to `get` the path as a nonResourceURL (TokenReview, then
    /// SubjectAccessReview; the broker needs `create` on both), or `none`.
    #[arg(
        long,
        env = "CRD_BROKER_ADMIN_AUTH",
        value_enum,
        default_value = "none"
    )]
    pub admin_auth: crate::access::admin::AdminAuth,
    /// The same for `/metrics` from outside the broker's pod: `none` (open to all, the default),
    /// or `kubernetes`.
    #[arg(
        long,
        env = "CRD_BROKER_METRICS_AUTH",
        value_enum,
        default_value = "none"
    )]
    pub metrics_auth: crate::access::admin::AdminAuth,
    /// Serve the CRDs and custom resources in this directory of manifests instead of a
    /// cluster; edits to its files are seen as changes.
    #[arg(long, env = "CRD_BROKER_MANIFESTS", value_name = "DIR")]
    pub manifests: Option<PathBuf>,
    /// A kind the broker may serve, as <resource>[.<version>].<group> (repeatable, or
    /// comma-separated in the environment). None: any kind the source serves.
    #[arg(
        long = "resource",
        env = "CRD_BROKER_RESOURCE",
        value_name = "RESOURCE.GROUP",
        value_delimiter = ','
    )]
    pub resources: Vec<KindRef>,
    /// Serve only objects in this namespace (repeatable), so a Role in each grants the broker
    /// all it needs; cluster-scoped kinds are not served then. Default: every namespace.
    #[arg(
        long = "namespace",
        env = "CRD_BROKER_NAMESPACE",
        value_name = "NAMESPACE",
        value_delimiter = ',',
        value_parser = parse_namespace
    )]
    pub namespaces: Vec<String>,
    /// How long a watch stays open after its last subscriber leaves.
    #[arg(long, env = "CRD_BROKER_LINGER", default_value = "30s", value_parser = humantime::parse_duration)]
    pub linger: Duration,
    /// How often the manifests directory is checked for changes.
    #[arg(long, env = "CRD_BROKER_MANIFESTS_POLL", default_value = "250ms", value_parser = humantime::parse_duration)]
    pub manifests_poll: Duration,
    /// TLS: the server certificate chain (PEM). With --tls-key.
    #[arg(
        long,
        env = "CRD_BROKER_TLS_CERT",
        value_name = "FILE",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// TLS: the server's private key (PEM).
    #[arg(
        long,
        env = "CRD_BROKER_TLS_KEY",
        value_name = "FILE",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// mTLS: CA certificates (PEM) client certificates must chain to.
    #[arg(
        long,
        env = "CRD_BROKER_TLS_CLIENT_CA",
        value_name = "FILE",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,
    /// How often the TLS files are checked for changes (they are reloaded without a restart).
    #[arg(long, env = "CRD_BROKER_TLS_RELOAD_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub tls_reload_interval: Duration,
    /// After this long (±10 %) a connection gets GOAWAY and its streams end with UNAVAILABLE,
    /// so clients re-resolve and spread over replicas (`0`: never).
    #[arg(long, env = "CRD_BROKER_MAX_CONNECTION_AGE", default_value = "30m")]
    pub max_connection_age: MaybeDuration,
    /// How long an aged connection may finish before it is closed.
    #[arg(long, env = "CRD_BROKER_MAX_CONNECTION_AGE_GRACE", default_value = "30s", value_parser = humantime::parse_duration)]
    pub max_connection_age_grace: Duration,
    /// How often idle connections are pinged (`0`: never). Clients may ping as often as they like.
    #[arg(
        long,
        env = "CRD_BROKER_HTTP2_KEEPALIVE_INTERVAL",
        default_value = "30s"
    )]
    pub http2_keepalive_interval: MaybeDuration,
    /// How long a ping may go unanswered before the connection is closed.
    #[arg(long, env = "CRD_BROKER_HTTP2_KEEPALIVE_TIMEOUT", default_value = "20s", value_parser = humantime::parse_duration)]
    pub http2_keepalive_timeout: Duration,
    /// Streams one connection may have open at once.
    #[arg(
        long,
        env = "CRD_BROKER_MAX_CONCURRENT_STREAMS",
        default_value_t = 2000
    )]
    pub max_concurrent_streams: u32,
    /// On SIGTERM, how long to wait for connections to finish before exiting (a second signal
    /// exits at once).
    #[arg(long, env = "CRD_BROKER_SHUTDOWN_GRACE", default_value = "20s", value_parser = humantime::parse_duration)]
    pub shutdown_grace: Duration,
    /// How often readiness (the source answers, and may be read) is checked.
    #[arg(long, env = "CRD_BROKER_READINESS_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub readiness_interval: Duration,
    /// Once the source has answered, how long the broker stays ready and serves last-known
    /// states while the API server is unreachable or failing (`0`: not at all).
    #[arg(long, env = "CRD_BROKER_MAX_STALENESS", default_value = "5m", value_parser = humantime::parse_duration)]
    pub max_staleness: Duration,
    /// Serve xDS (ADS) for this Service, `NAME.NAMESPACE:PORT`: clients with an
    /// `xds:///NAME.NAMESPACE:PORT` target learn its ready replicas from its EndpointSlices as
    /// they change (ADR 0023). Off when unset.
    #[arg(long, env = "CRD_BROKER_XDS_SERVICE")]
    pub xds_service: Option<crate::grpc::xds::XdsService>,
    /// A value every flagd sync response carries in its `sync_context`, as flagd's own
    /// `--context-value`: `KEY=VALUE`, repeated or comma-separated (at most 64, keys of at most
    /// 256 bytes, values of at most 4,096 bytes). The in-process flagd providers take it as
    /// evaluation context for every evaluation; `GetMetadata` answers it too.
    #[arg(long = "context-value", value_name = "KEY=VALUE", env = "CRD_BROKER_CONTEXT_VALUES", value_delimiter = ',', value_parser = context_value)]
    pub context_values: Vec<(String, String)>,
    /// With `--xds-service`: on SIGTERM, how long this replica serves its own address as
    /// DRAINING to xDS clients before it ends its streams.
    #[arg(long, env = "CRD_BROKER_XDS_DRAIN_NOTICE", default_value = "2s", value_parser = humantime::parse_duration)]
    pub xds_drain_notice: Duration,
    /// Whether the broker speaks HTTP/2 to the API server: `auto` does when the API server
    /// offers it over TLS, sharing each connection among up to its stream limit (100) of
    /// watches; `off` speaks HTTP/1.1, one connection per watch.
    #[arg(long, env = "CRD_BROKER_API_HTTP2", value_enum, default_value_t = ApiHttp2::Auto)]
    pub api_http2: ApiHttp2,
    /// How a namespace watch or a set takes its objects: `auto` by a streaming list (a watch
    /// that first sends every object, KEP-3157) while the API server takes them, else by LIST
    /// as `off` always does.
    #[arg(long, env = "CRD_BROKER_API_STREAMING_LISTS", value_enum, default_value_t = StreamingLists::Auto)]
    pub api_streaming_lists: StreamingLists,
    /// The broker's own limit on its requests to the API server, per second on average (as
    /// client-go's QPS); `0`: none of its own, the API server's Priority and Fairness paces it.
    /// The API server's `Retry-After` (with a 429 or 503) holds every request either way.
    #[arg(long, env = "CRD_BROKER_API_QPS", default_value_t = 0.0, value_parser = requests_per_second, allow_negative_numbers = true)]
    pub api_qps: f64,
    /// Requests that may go at once, above `--api-qps` (as client-go's burst); `0`: twice
    /// `--api-qps`.
    #[arg(long, env = "CRD_BROKER_API_BURST", default_value_t = 0)]
    pub api_burst: u32,
    /// Names of one kind watched in one namespace above which one watch of the namespace
    /// replaces theirs (and below half of which each name has its own watch again); `0`: a
    /// watch per name always.
    #[arg(long, env = "CRD_BROKER_NAMESPACE_WATCH_THRESHOLD", default_value_t = crate::source::kubernetes::DEFAULT_NAMESPACE_WATCH_THRESHOLD)]
    pub namespace_watch_threshold: usize,
    /// The largest request message taken, in bytes (a larger one is RESOURCE_EXHAUSTED).
    #[arg(long, env = "CRD_BROKER_MAX_REQUEST_BYTES", default_value_t = transport::DEFAULT_MAX_REQUEST_BYTES)]
    pub max_request_bytes: usize,
    /// How callers are identified: identity sources tried in order, the first that identifies
    /// the caller wins (peer-pod, token, mtls, mesh), or `none` (everyone may read everything
    /// the broker serves).
    #[arg(
        long,
        env = "CRD_BROKER_IDENTITY",
        default_value = "none",
        value_name = "LIST"
    )]
    pub identity: IdentityList,
    /// Which callers may read which namespaces and kinds (YAML; reloaded when it changes).
    /// Without it an identified caller may read its own namespace only.
    #[arg(long, env = "CRD_BROKER_POLICY", value_name = "FILE")]
    pub policy: Option<PathBuf>,
    /// How often the policy file is read for changes.
    #[arg(long, env = "CRD_BROKER_POLICY_RELOAD_INTERVAL", default_value = "2s", value_parser = humantime::parse_duration)]
    pub policy_reload_interval: Duration,
    /// The audience a caller's token must be for (`token` identity; repeatable).
    #[arg(
        long = "token-audience",
        env = "CRD_BROKER_TOKEN_AUDIENCE",
        default_value = access::DEFAULT_TOKEN_AUDIENCE,
        value_delimiter = ','
    )]
    pub token_audiences: Vec<String>,
    /// The service mesh whose proxy's header `mesh` identity believes: `istio`
    /// (`x-forwarded-client-cert`) or `linkerd` (`l5d-client-id`); the other's header is a
    /// forgery. Needed by `--identity mesh`.
    #[arg(long, env = "CRD_BROKER_MESH", value_enum)]
    pub mesh: Option<access::Mesh>,
    /// The addresses a local mesh proxy delivers from: only their mesh header is believed
    /// (`mesh` identity; repeatable). Default: `--mesh`'s proxy (istio: 127.0.0.6 and ::6;
    /// linkerd: 127.0.0.1 and ::1, and the broker's own address, which Linkerd 2.11 and later
    /// deliver from); without `--mesh`, 127.0.0.1, 127.0.0.6 and ::1.
    #[arg(
        long = "mesh-proxy-addr",
        env = "CRD_BROKER_MESH_PROXY_ADDR",
        value_delimiter = ','
    )]
    pub mesh_proxies: Vec<IpAddr>,
    /// The only SPIFFE trust domain accepted from client certificates and mesh headers.
    #[arg(long, env = "CRD_BROKER_TRUST_DOMAIN")]
    pub trust_domain: Option<String>,
    /// The most distinct resources watched at once.
    #[arg(long, env = "CRD_BROKER_MAX_WATCHES", default_value_t = broker::DEFAULT_MAX_WATCHES)]
    pub max_watches: usize,
    /// The most watches one caller's requests may keep open, lingering ones too (a caller the
    /// broker cannot tell apart is one connection); `0`: a quarter of `--max-watches`.
    #[arg(long, env = "CRD_BROKER_MAX_WATCHES_PER_CALLER", default_value_t = 0)]
    pub max_watches_per_caller: usize,
    /// The most sets one caller's requests may keep open, lingering ones too: each set lists,
    /// watches and holds its members (a caller the broker cannot tell apart is one connection).
    #[arg(long, env = "CRD_BROKER_MAX_SETS_PER_CALLER", default_value_t = limits::DEFAULT_MAX_SETS_PER_CALLER)]
    pub max_sets_per_caller: usize,
    /// The most streams one caller may have open at once.
    #[arg(long, env = "CRD_BROKER_MAX_STREAMS_PER_CALLER", default_value_t = limits::DEFAULT_MAX_STREAMS_PER_CALLER)]
    pub max_streams_per_caller: usize,
    /// New watches one caller may start per second, on average.
    #[arg(long, env = "CRD_BROKER_NEW_WATCH_RATE", default_value_t = limits::DEFAULT_NEW_WATCH_RATE)]
    pub new_watch_rate: f64,
    /// New watches one caller may start at once.
    #[arg(long, env = "CRD_BROKER_NEW_WATCH_BURST", default_value_t = limits::DEFAULT_NEW_WATCH_BURST)]
    pub new_watch_burst: f64,
    /// New streams the whole broker takes per second (every protocol), one second's worth at
    /// once, and a quarter of that per caller; more are refused with RESOURCE_EXHAUSTED and a
    /// time to try again (`grpc-retry-pushback-ms`). Paces the herd after a replica's loss; 0:
    /// no bound.
    #[arg(long, env = "CRD_BROKER_MAX_NEW_STREAMS_PER_SECOND", default_value_t = limits::DEFAULT_MAX_NEW_STREAMS_PER_SECOND, value_parser = requests_per_second)]
    pub max_new_streams_per_second: f64,
}

impl Cli {
    /// Runs the command.
    pub async fn run(self) -> anyhow::Result<()> {
        let debug = matches!(&self.command, Command::Start(s) if s.debug);
        let telemetry = telemetry::init(self.log_format, if debug { "debug" } else { "info" });
        let result = match self.command {
            Command::Serve(serve) => serve.run().await,
            Command::Subscribe(s) => subscribe::run(s).await,
            Command::Top(args) => top::run(args).await,
            Command::Completions { shell } => {
                print!("{}", shell.script());
                Ok(())
            }
            Command::Start(start) => start.serve()?.run().await,
        };
        telemetry.shutdown().await;
        result
    }
}

fn parse_namespace(s: &str) -> Result<String, String> {
    if crate::selector::is_dns_label(s) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "{} is not a namespace name (lowercase letters, digits and '-', at most 63)",
            crate::selector::quote(s)
        ))
    }
}

/// A listener on `addr`. The unspecified IPv6 address `[::]` takes IPv4 connections too
/// (`IPV6_V6ONLY` off, whatever the host's default), and falls back to `0.0.0.0` on a host
/// without IPv6.
pub fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let dual = addr.ip() == std::net::IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED);
    let open = |addr: SocketAddr| -> std::io::Result<TcpListener> {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        if addr.is_ipv6() {
            socket.set_only_v6(!dual)?;
        }
        socket.set_reuse_address(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        TcpListener::from_std(socket.into())
    };
    match open(addr) {
        // EAFNOSUPPORT: no IPv6 in the kernel; EADDRNOTAVAIL: IPv6 disabled.
        Err(e) if dual && matches!(e.raw_os_error(), Some(97 | 99)) => {
            tracing::info!(%addr, "no IPv6 on this host: listening on IPv4 only");
            open(SocketAddr::from(([0, 0, 0, 0], addr.port())))
        }
        other => other,
    }
}

/// The kind flagd-proxy serves, and `start` by default.
const FEATURE_FLAGS: &str = "featureflags.core.openfeature.dev";

impl Start {
    /// The `serve` this stands for: all interfaces (IPv6 and IPv4) on the given ports, the
    /// Kubernetes source,
    /// FeatureFlags as the kind it serves (so readiness checks the rights to list and watch
    /// them) unless `CRD_BROKER_RESOURCE` names kinds, every other setting from its
    /// CRD_BROKER_* variable or its default.
    pub fn serve(&self) -> anyhow::Result<Serve> {
        let mut serve = Serve::try_parse_from(["serve"])?;
        let any = std::net::Ipv6Addr::UNSPECIFIED;
        serve.grpc_addr = MaybeAddr(Some(SocketAddr::from((any, self.port))));
        serve.admin_addr = MaybeAddr(Some(SocketAddr::from((any, self.management_port))));
        serve.manifests = None;
        if let Some(identity) = &self.identity {
            serve.identity = identity.clone();
        }
        if let Some(policy) = &self.policy {
            serve.policy = Some(policy.clone());
        }
        if !self.context_values.is_empty() {
            serve.context_values = self.context_values.clone();
        }
        if serve.resources.is_empty() {
            serve.resources = vec![FEATURE_FLAGS.parse()?];
        }
        Ok(serve)
    }
}

impl Serve {
    /// `--mesh-proxy-addr`, else the named mesh's proxy addresses, else those of both.
    fn mesh_proxy_addresses(&self) -> Vec<IpAddr> {
        if !self.mesh_proxies.is_empty() {
            return self.mesh_proxies.clone();
        }
        let defaults = match self.mesh {
            Some(mesh) => mesh.proxy_addresses(),
            None => access::DEFAULT_MESH_PROXIES,
        };
        defaults.iter().filter_map(|a| a.parse().ok()).collect()
    }

    /// The limit on the broker's requests to the API server (`--api-qps`, `--api-burst`).
    pub fn api_rate(&self) -> anyhow::Result<crate::source::kubernetes::throttle::Rate> {
        if self.api_qps == 0.0 && self.api_burst > 0 {
            anyhow::bail!(
                "--api-burst {} needs --api-qps: without it the broker sets no rate of its own",
                self.api_burst
            );
        }
        let burst = match self.api_burst {
            // At least one, and never more than the largest count the bucket can hold.
            0 => (self.api_qps * 2.0).ceil().clamp(1.0, f64::from(u32::MAX)) as u32,
            burst => burst,
        };
        Ok(crate::source::kubernetes::throttle::Rate {
            qps: self.api_qps,
            burst,
        })
    }

    /// The broker settings these flags give.
    pub fn broker_config(&self) -> broker::Config {
        broker::Config {
            linger: self.linger,
            readiness_interval: self.readiness_interval,
            max_staleness: self.max_staleness,
            transport: transport::Config {
                max_connection_age: self.max_connection_age.0,
                max_connection_age_grace: self.max_connection_age_grace,
                keepalive_interval: self.http2_keepalive_interval.0,
                keepalive_timeout: self.http2_keepalive_timeout,
                max_concurrent_streams: self.max_concurrent_streams,
                shutdown_grace: self.shutdown_grace,
                max_request_bytes: self.max_request_bytes,
                stream_send_buffer: transport::DEFAULT_STREAM_SEND_BUFFER,
            },
            max_watches: self.max_watches,
            flagd_context: self.context_values.clone(),
            admin: crate::access::admin::Settings {
                debug_endpoints: self.debug_endpoints,
                admin_auth: self.admin_auth,
                metrics_auth: self.metrics_auth,
            },
            access: access::Settings {
                identity: self.identity.clone(),
                policy: self.policy.clone(),
                policy_reload_interval: self.policy_reload_interval,
                token_audiences: self.token_audiences.clone(),
                mesh: self.mesh,
                mesh_proxies: self.mesh_proxy_addresses(),
                trust_domain: self.trust_domain.clone(),
                limits: limits::Config {
                    max_streams_per_caller: self.max_streams_per_caller,
                    new_watch_rate: self.new_watch_rate,
                    new_watch_burst: self.new_watch_burst,
                    max_watches_per_caller: match self.max_watches_per_caller {
                        0 => limits::share_of(self.max_watches),
                        n => n,
                    },
                    max_sets_per_caller: self.max_sets_per_caller,
                    max_new_streams_per_second: self.max_new_streams_per_second,
                },
                api: None,
                client_certificates: self.tls_client_ca.is_some(),
            },
            xds: self
                .xds_service
                .clone()
                .map(|service| crate::grpc::xds::Settings {
                    service,
                    drain_notice: self.xds_drain_notice,
                }),
        }
    }

    async fn listeners(&self) -> anyhow::Result<Listeners> {
        let tcp = match self.grpc_addr.0 {
            Some(addr) => {
                Some(bind(addr).with_context(|| format!("binding the gRPC address {addr}"))?)
            }
            None => None,
        };
        let unix = match &self.grpc_socket {
            Some(path) => {
                // A socket left by an earlier run would make bind fail.
                if std::fs::symlink_metadata(path)
                    .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                {
                    std::fs::remove_file(path).ok();
                }
                let listener = UnixListener::bind(path)
                    .with_context(|| format!("binding the unix socket {}", path.display()))?;
                Some((listener, path.clone()))
            }
            None => None,
        };
        let admin = match self.admin_addr.0 {
            Some(addr) => {
                Some(bind(addr).with_context(|| format!("binding the admin address {addr}"))?)
            }
            None => None,
        };
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                let tls = Tls::load(TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: self.tls_client_ca.clone(),
                })
                .context("loading the TLS certificates")?;
                tls.spawn_reloader(self.tls_reload_interval);
                Some(tls)
            }
            _ => None,
        };
        Ok(Listeners {
            tcp,
            tls,
            unix,
            admin,
        })
    }

    /// Binds, picks the source, serves until SIGINT or SIGTERM, then drains.
    pub async fn run(self) -> anyhow::Result<()> {
        let rate = self.api_rate()?;
        let listeners = self.listeners().await?;
        let mut config = self.broker_config();
        match &self.manifests {
            Some(_) if !self.namespaces.is_empty() => anyhow::bail!(
                "--namespace confines the Kubernetes source; --manifests serves its whole directory"
            ),
            Some(dir) => {
                let source = Manifests::open(dir, self.manifests_poll, self.resources.clone())
                    .with_context(|| {
                        format!("reading the manifests directory {}", dir.display())
                    })?;
                run_until_signal(listeners, source, config).await
            }
            None => {
                let source = Kubernetes::infer(self.resources.clone(), self.api_http2, rate)
                    .await
                    .context("configuring the Kubernetes client (KUBECONFIG, else in-cluster)")?
                    .confined_to(self.namespaces.clone())
                    .with_namespace_watch_threshold(self.namespace_watch_threshold)
                    .with_streaming_lists(self.api_streaming_lists);
                config.access.api = Some(source.access_client());
                run_until_signal(listeners, source, config).await
            }
        }
    }
}

/// A rate of requests: a finite number, 0 or more.
fn requests_per_second(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(qps) if qps.is_finite() && qps >= 0.0 => Ok(qps),
        _ => Err(format!(
            "{text:?} is not a number of requests per second (0 or more; 0: no limit)"
        )),
    }
}

async fn run_until_signal<S: Source>(
    listeners: Listeners,
    source: S,
    config: broker::Config,
) -> anyhow::Result<()> {
    let grace = config.transport.shutdown_grace;
    let running = Running::start_with(listeners, source, config)?;
    tracing::info!(
        grpc = %running.addr,
        admin = ?running.admin_addr,
        "crd-broker serving"
    );
    let signals = Arc::new(crate::ops::shutdown::Signals::new()?);
    signals.next().await;
    let notice = running.announce_drain();
    if !notice.is_zero() {
        tracing::info!(
            ?notice,
            "draining: xDS clients are told this replica is DRAINING"
        );
        tokio::select! {
            _ = tokio::time::sleep(notice) => {}
            _ = signals.next() => {
                tracing::warn!("second signal: exiting now");
                std::process::exit(130);
            }
        }
    }
    tracing::info!(
        ?grace,
        "draining: not ready, GOAWAY to every connection, streams end with UNAVAILABLE"
    );
    running.shutdown.cancel();
    tokio::select! {
        result = running.finished() => result,
        _ = signals.next() => {
            tracing::warn!("second signal: exiting now");
            std::process::exit(130);
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::Serve;

    #[test]
    fn each_caller_may_keep_a_quarter_of_the_watches_unless_told() {
        let limits = |args: &[&str]| {
            let serve = Serve::try_parse_from([&["serve"], args].concat()).unwrap();
            serve.broker_config().access.limits.max_watches_per_caller
        };
        assert_eq!(limits(&[]), 2_500);
        assert_eq!(limits(&["--max-watches", "400"]), 100);
        assert_eq!(limits(&["--max-watches", "2"]), 1);
        assert_eq!(limits(&["--max-watches-per-caller", "7"]), 7);
    }
}
