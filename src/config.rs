//! The command line (every flag also an environment variable `CRD_BROKER_*`) and the wiring of
//! sources, registry and server: the one module that knows them all.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use tokio::net::TcpListener;

use crate::selector::{KindRef, Selector};
use crate::server::Running;
use crate::source::Source;
use crate::source::kubernetes::Kubernetes;
use crate::source::manifests::Manifests;
use crate::subscribe::{self, Output};

/// How long a watch outlives its last subscriber by default (ADR 0005).
pub const DEFAULT_LINGER: Duration = Duration::from_secs(30);

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

/// Log output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (`console`, as flagd-proxy calls it, is the same).
    #[value(alias = "console")]
    Plain,
    /// One JSON object per line.
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the broker.
    Serve(Serve),
    /// Subscribe to resources on a running broker and print every event.
    Subscribe(SubscribeArgs),
    /// Run as a drop-in for flagd-proxy, as the OpenFeature Operator starts it: the broker on
    /// the Kubernetes source, gRPC on --port, admin endpoints on --management-port.
    Start(Start),
}

/// `crd-broker start`: flagd-proxy's command line.
#[derive(Debug, Args)]
pub struct Start {
    /// The gRPC port (flagd sync, legacy sync and the native API).
    #[arg(long, short = 'p', env = "PORT", default_value_t = 8015)]
    pub port: u16,
    /// The port of the admin endpoints (health, readiness).
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
}

/// `crd-broker serve`.
#[derive(Debug, Args)]
pub struct Serve {
    /// Address for the gRPC server.
    #[arg(long, env = "CRD_BROKER_GRPC_ADDR", default_value = "0.0.0.0:8015")]
    pub grpc_addr: SocketAddr,
    /// Address for the admin HTTP server (liveness, readiness).
    #[arg(long, env = "CRD_BROKER_ADMIN_ADDR", default_value = "0.0.0.0:8016")]
    pub admin_addr: SocketAddr,
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
    /// How long a watch stays open after its last subscriber leaves.
    #[arg(long, env = "CRD_BROKER_LINGER", default_value = "30s", value_parser = humantime::parse_duration)]
    pub linger: Duration,
    /// How often the manifests directory is checked for changes.
    #[arg(long, env = "CRD_BROKER_MANIFESTS_POLL", default_value = "250ms", value_parser = humantime::parse_duration)]
    pub manifests_poll: Duration,
}

/// `crd-broker subscribe`.
#[derive(Debug, Args)]
pub struct SubscribeArgs {
    /// The broker's gRPC address.
    #[arg(
        long,
        env = "CRD_BROKER_SERVER",
        default_value = "http://127.0.0.1:8015"
    )]
    pub server: String,
    /// How to print events.
    #[arg(long, short = 'o', env = "CRD_BROKER_OUTPUT", value_enum, default_value_t = Output::Text)]
    pub output: Output,
    /// Resources, as <resource>[.<version>].<group>/<namespace>/<name>
    /// (e.g. featureflags.core.openfeature.dev/default/demo).
    #[arg(required = true, value_name = "SELECTOR")]
    pub selectors: Vec<Selector>,
}

impl Cli {
    /// Runs the command.
    pub async fn run(self) -> anyhow::Result<()> {
        let debug = matches!(&self.command, Command::Start(s) if s.debug);
        init_logging(self.log_format, if debug { "debug" } else { "info" });
        match self.command {
            Command::Serve(serve) => serve.run().await,
            Command::Subscribe(s) => subscribe::run(s.server, s.output, s.selectors).await,
            Command::Start(start) => start.serve().run().await,
        }
    }
}

impl Start {
    /// The `serve` this stands for: all interfaces, the Kubernetes source, the default linger.
    pub fn serve(&self) -> Serve {
        Serve {
            grpc_addr: SocketAddr::from(([0, 0, 0, 0], self.port)),
            admin_addr: SocketAddr::from(([0, 0, 0, 0], self.management_port)),
            manifests: None,
            resources: Vec::new(),
            linger: DEFAULT_LINGER,
            manifests_poll: Duration::from_millis(250),
        }
    }
}

impl Serve {
    /// Binds, picks the source, serves until SIGINT or SIGTERM.
    pub async fn run(self) -> anyhow::Result<()> {
        let Serve {
            grpc_addr,
            admin_addr,
            manifests,
            resources,
            linger,
            manifests_poll,
        } = self;
        let listener = TcpListener::bind(grpc_addr)
            .await
            .with_context(|| format!("binding the gRPC address {grpc_addr}"))?;
        let admin = TcpListener::bind(admin_addr)
            .await
            .with_context(|| format!("binding the admin address {admin_addr}"))?;
        match manifests {
            Some(dir) => {
                let source =
                    Manifests::open(&dir, manifests_poll, resources).with_context(|| {
                        format!("reading the manifests directory {}", dir.display())
                    })?;
                run_until_signal(listener, admin, source, linger).await
            }
            None => {
                let source = Kubernetes::infer(resources)
                    .await
                    .context("configuring the Kubernetes client (KUBECONFIG, else in-cluster)")?;
                run_until_signal(listener, admin, source, linger).await
            }
        }
    }
}

async fn run_until_signal<S: Source>(
    listener: TcpListener,
    admin: TcpListener,
    source: S,
    linger: Duration,
) -> anyhow::Result<()> {
    let running = Running::start_with_admin(listener, Some(admin), source, linger)?;
    tracing::info!(addr = %running.addr, linger = ?linger, "crd-broker serving");
    crate::shutdown::signal().await;
    tracing::info!("shutting down");
    running.stop().await
}

fn init_logging(format: LogFormat, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Plain => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
