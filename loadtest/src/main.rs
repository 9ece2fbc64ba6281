//! `crd-broker-loadtest`: drives a release-built crd-broker on the fake API server with many
//! subscribers, side by side with a bare tonic server broadcasting the same payloads, and reports
//! fan-out latency, first-message latency, memory, CPU, API-server load and lost updates; on a
//! real kube-apiserver and etcd (`scripts/control-plane`), what sidecars cost it with and without
//! the broker (`--scenario apiserver-cost`) and the fault soak (`soak --real`). Everything runs on
//! loopback and every scenario is bounded in time.

mod bare;
mod clients;
mod direct;
mod fixtures;
mod plan;
mod plot;
mod report;
mod runner;
mod scenarios;
mod soak;
mod stats;
mod target;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

/// Load harness for crd-broker.
#[derive(Debug, Parser)]
#[command(name = "crd-broker-loadtest", version)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: Run,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The bare tonic server (started by the harness itself).
    Bare {
        /// Where to listen.
        #[arg(long)]
        addr: SocketAddr,
    },
    /// A long random mix of API-server faults under many subscribers, then the promises
    /// checked: every subscriber on its CR's final state within 5 s of the last write, one
    /// watch per CR, none left, no leaked tasks, bounded memory, no readiness flaps.
    Soak(soak::SoakArgs),
    /// What a fleet costs the brokers and the API server, from the per-unit costs measured
    /// here, and which limit a replica meets first (docs/capacity.md).
    Plan(plan::PlanArgs),
}

/// What to run.
#[derive(Debug, Clone, clap::Args)]
pub struct Run {
    /// Scenarios: `fanout` (a: many subscribers on many CRs), `hot` (b: one hot CR), `storm`
    /// (c: a reconnect storm on a cold broker), `churn` (d: subscribers come and go), `idle`
    /// (memory of idle one-stream sidecars), `identity` (the cost of `--identity peer-pod`),
    /// `stalled` (readers that never read, under large updates), `failover` (replicas SIGKILLed
    /// under load, then a restart storm on a fresh replica), `connections` (TCP connections to
    /// the API server for 100, 1,000 and 5,000 CRs, HTTP/1.1 and HTTP/2), `granularity`
    /// (per-object watches against one namespace watch), `incremental` (one write to a
    /// FeatureFlag of a set, as its flagd streams are sent it whole and as incremental updates), `coldstart` (a cold subscribe's first
    /// message against one LIST + WATCH on the same API server), `attacks` (what one caller can
    /// make the broker and the API server hold: cycled sets, namespaces and names, a token
    /// flood, stalled set subscribers; docs/security.md), `apiserver-cost` (what sidecars
    /// watching their CRs themselves cost a real kube-apiserver, against one broker and three
    /// replicas; needs Go or a cached control plane, so `all` leaves it out), `peers` (crd-broker
    /// beside stock flagd-proxy and the flagd daemon as a relay, on real control planes with the
    /// same CRs and flagd sync subscribers; also left out of `all`),
    /// `resolvers` (clients watching the headless Service's EndpointSlices themselves, as
    /// kuberesolver does, against clients asking the broker over xDS; a real control plane,
    /// left out of `all`), or `all`.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    pub scenario: Vec<String>,
    /// A tiny configuration of every scenario (a few seconds), for CI.
    #[arg(long)]
    pub smoke: bool,
    /// Subscribers in the fan-out, hot and storm scenarios.
    #[arg(long, default_value_t = 10_000)]
    pub subscribers: usize,
    /// Connections they share.
    #[arg(long, default_value_t = 1_000)]
    pub connections: usize,
    /// Custom resources (FeatureFlags) in the fan-out and storm scenarios.
    #[arg(long, default_value_t = 100)]
    pub crs: usize,
    /// Updates per second, over all CRs.
    #[arg(long, default_value_t = 10.0)]
    pub rate: f64,
    /// How long updates are written in the fan-out and hot scenarios.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// How long the churn scenario runs.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub churn_duration: Duration,
    /// Subscribers alive at once in the churn scenario.
    #[arg(long, default_value_t = 1_000)]
    pub churn_subscribers: usize,
    /// Idle sidecars (one connection, one stream each) in the memory scenario.
    #[arg(long, default_value_t = 10_000)]
    pub sidecars: usize,
    /// How long the idle sidecars stay connected before the broker's memory is read. Every frame
    /// a sidecar sends (a PING answer, a WINDOW_UPDATE) moves h2's read position further into its
    /// 8 KiB read buffer, so a longer hold with frequent pings shows the steady state.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub idle_hold: Duration,
    /// Pods (distinct source addresses, 127.1.0.1 …) the identity scenario's sidecars run in.
    #[arg(long, default_value_t = 1_000)]
    pub pod_ips: usize,
    /// Streams that never read in the stalled-readers scenario.
    #[arg(long, default_value_t = 200)]
    pub stalled_readers: usize,
    /// Updates written in the stalled-readers scenario (50 ms apart).
    #[arg(long, default_value_t = 20)]
    pub stalled_updates: u64,
    /// Size of each update in the stalled-readers scenario, in bytes.
    #[arg(long, default_value_t = 256 * 1024)]
    pub stalled_update_bytes: usize,
    /// Loopback source addresses to spread connections over (127.0.0.1 ..= 127.0.0.N).
    #[arg(long, default_value_t = 8)]
    pub sources: u8,
    /// Size of each FeatureFlag's JSON, in bytes (padded).
    #[arg(long, default_value_t = 1024)]
    pub payload_bytes: usize,
    /// Each replica's `--max-new-streams-per-second` in the failover scenario's paced runs.
    #[arg(long, default_value_t = 1000.0)]
    pub failover_pace: f64,
    /// Sidecars in the apiserver-cost scenario, one row each.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,5000")]
    pub cost_sidecars: Vec<usize>,
    /// CRs they need in the apiserver-cost scenario (sidecar `i` needs CR `i % M`).
    #[arg(long, default_value_t = 100)]
    pub cost_crs: usize,
    /// Modes of the apiserver-cost scenario: `direct`, `broker`, `replicas`.
    #[arg(long, value_delimiter = ',', default_value = "direct,broker,replicas")]
    pub cost_modes: Vec<String>,
    /// How long the API server is watched idle in the apiserver-cost scenario.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub cost_idle: Duration,
    /// How long one write per second per CR goes on in the apiserver-cost scenario.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub cost_writes: Duration,
    /// flagd sync streams in the peers scenario, one row per server at each.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    pub peers_streams: Vec<usize>,
    /// CRs they follow in the peers scenario (stream `i` follows CR `i % M`).
    #[arg(long, default_value_t = 100)]
    pub peers_crs: usize,
    /// Servers of the peers scenario: `flagd-proxy` (stock, built from its sources by
    /// `scripts/peers`), `flagd` (the flagd daemon relaying a Kubernetes source per CR through
    /// its sync server) and `crd-broker`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "flagd-proxy,flagd,crd-broker"
    )]
    pub peers_servers: Vec<String>,
    /// Opens the first stream of every CR at once in the peers scenario, instead of one CR
    /// after the other (each once the one before has its first configuration). Stock
    /// flagd-proxy v0.9.7 crashes on it (`fatal error: concurrent map read and map write`: its
    /// informers register their types in one scheme at once).
    #[arg(long)]
    pub peers_cold_together: bool,
    /// How long the streams sit idle in the peers scenario before memory is read.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub peers_idle: Duration,
    /// How long one write per second per CR goes on in the peers scenario.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub peers_writes: Duration,
    /// How long subscribers come and go (with the writes going on) in the peers scenario.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub peers_churn: Duration,
    /// Clients resolving the replicas in the resolvers scenario, one row per mode at each.
    #[arg(long, value_delimiter = ',', default_value = "1000")]
    pub resolvers_clients: Vec<usize>,
    /// How long the resolvers scenario's clients sit idle before the API server is measured.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub resolvers_idle: Duration,
    /// The replicas' `--max-connection-age` while the resolvers scenario times how soon a
    /// client's new streams follow them (`dns:///` re-resolves only when a connection ends).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub resolvers_age: Duration,
    /// How long the resolvers scenario waits for new streams to follow a change of replicas.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub resolvers_window: Duration,
    /// The broker binary (default: `crd-broker` next to this binary).
    #[arg(long)]
    pub broker_bin: Option<PathBuf>,
    /// Where to write `results.json`, `summary.md` and `latency.png`.
    #[arg(long, default_value = "target/loadtest")]
    pub out: PathBuf,
}

impl Run {
    /// The tiny configuration CI runs.
    fn smoke(mut self) -> Self {
        self.subscribers = 60;
        self.connections = 6;
        self.crs = 3;
        self.rate = 20.0;
        self.failover_pace = 8.0;
        self.duration = Duration::from_secs(2);
        self.churn_duration = Duration::from_secs(2);
        self.churn_subscribers = 30;
        self.sidecars = 50;
        self.pod_ips = 5;
        self.stalled_readers = 10;
        self.stalled_update_bytes = 64 * 1024;
        self.sources = 2;
        self.cost_sidecars = vec![30];
        self.cost_crs = 5;
        self.cost_idle = Duration::from_secs(2);
        self.cost_writes = Duration::from_secs(3);
        self.peers_streams = vec![200];
        self.peers_crs = 10;
        self.peers_idle = Duration::from_secs(2);
        self.peers_writes = Duration::from_secs(3);
        self.peers_churn = Duration::from_secs(3);
        self.resolvers_clients = vec![50];
        self.resolvers_idle = Duration::from_secs(1);
        self.resolvers_age = Duration::from_secs(3);
        self.resolvers_window = Duration::from_secs(8);
        self
    }

    fn wants(&self, scenario: &str) -> bool {
        // `all` means the scenarios on the fake; the real control plane's are asked for by name.
        let all = !matches!(scenario, "apiserver-cost" | "peers" | "resolvers");
        self.scenario
            .iter()
            .any(|s| s == scenario || (all && s == "all"))
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Some(Command::Bare { addr }) => runtime.block_on(bare::run(addr)),
        Some(Command::Soak(args)) => runtime.block_on(soak::soak(args)),
        Some(Command::Plan(args)) => {
            print!("{}", plan::render(&args, &plan::plan(&args)));
            Ok(())
        }
        None => {
            let run = if cli.run.smoke {
                cli.run.smoke()
            } else {
                cli.run
            };
            runtime.block_on(runner::run_all(run))
        }
    }
}
