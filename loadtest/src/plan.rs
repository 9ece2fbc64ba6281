//! `crd-broker-loadtest plan`: what a fleet costs the brokers and the API server, from the
//! per-unit costs measured on this project's machine (`docs/capacity.md`), and which limit a
//! replica meets first.

use std::fmt::Write;

/// The per-unit costs, measured with the release build on the 2-core VM (`docs/performance.md`).
mod measured {
    /// Resident memory of one idle sidecar with its own connection and one stream.
    pub const SIDECAR_BYTES: f64 = 24.1 * 1024.0;
    /// Resident memory per watched CR over HTTP/2 (5,000 CRs: 15.1 → 106.6 MiB).
    pub const WATCH_BYTES_HTTP2: f64 = 18.7 * 1024.0;
    /// The same over HTTP/1.1 (5,000 CRs: 15.0 → 207.8 MiB).
    pub const WATCH_BYTES_HTTP1: f64 = 39.4 * 1024.0;
    /// A broker with nothing to do.
    pub const BASE_BYTES: f64 = 15.0 * 1024.0 * 1024.0;
    /// CPU per update delivered to one subscriber (fan-out (a): 0.46 s for 20,000 deliveries).
    pub const DELIVERY_SECONDS: f64 = 23e-6;
    /// Watches per HTTP/2 connection to the API server (its stream limit).
    pub const STREAMS_PER_CONNECTION: f64 = 100.0;
    /// HTTP/1.1 connections per watch (1,000 CRs: 1,090–1,216 connections).
    pub const HTTP1_CONNECTIONS_PER_WATCH: f64 = 1.2;
    /// The kube-apiserver's memory per client that watches its CR over a connection of its own
    /// (`--scenario apiserver-cost`: 5,000 such sidecars, 582 MiB; 1,000, 76 MiB).
    pub const APISERVER_DIRECT_WATCH_BYTES: f64 = 120.0 * 1024.0;
    /// The kube-apiserver's memory per watch of a broker's, 100 to a connection (the same
    /// scenario: 300 watches on 7 connections added 3–4 MiB to a 270 MiB process; an upper
    /// bound).
    pub const APISERVER_BROKER_WATCH_BYTES: f64 = 20.0 * 1024.0;
    /// Priority and Fairness: a write's seats are one per this many watchers of its object
    /// (`k8s.io/apiserver` `mutating_work_estimator.go`; measured: 50 watchers, 5 seats)…
    pub const APF_WATCHERS_PER_SEAT: f64 = 10.0;
    /// …and at most this many.
    pub const APF_MAX_SEATS: f64 = 10.0;
}

/// What to plan for.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// Sidecars (one connection and one stream each).
    #[arg(long, default_value_t = 100_000)]
    pub sidecars: u64,
    /// Distinct CRs they ask for.
    #[arg(long, default_value_t = 5_000)]
    pub crs: u64,
    /// CRs each sidecar follows.
    #[arg(long, default_value_t = 1)]
    pub crs_per_sidecar: u64,
    /// Broker replicas (clients spread over them at random, as DNS balancing does).
    #[arg(long, default_value_t = 10)]
    pub replicas: u64,
    /// Updates per second, over all CRs.
    #[arg(long, default_value_t = 10.0)]
    pub update_rate: f64,
    /// Size of a CR's JSON, in bytes.
    #[arg(long, default_value_t = 1024)]
    pub object_bytes: u64,
    /// HTTP/2 to the API server (`--api-http2 auto` against a TLS API server), else HTTP/1.1.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub http2: bool,
    /// Memory limit of one replica, in MiB.
    #[arg(long, default_value_t = 2048)]
    pub memory_mib: u64,
    /// CPU of one replica, in cores.
    #[arg(long, default_value_t = 2.0)]
    pub cpus: f64,
    /// Open-file limit of one replica.
    #[arg(long, default_value_t = 1_048_576)]
    pub open_files: u64,
}

/// The plan's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Sidecars per replica.
    pub sidecars_per_replica: f64,
    /// Subscribers of one CR, over every replica.
    pub subscribers_per_cr: f64,
    /// Watches one replica holds (a CR is watched on every replica one of its subscribers is on).
    pub watches_per_replica: f64,
    /// Watches on the API server, over every replica.
    pub api_watches: f64,
    /// Connections from one replica to the API server.
    pub api_connections_per_replica: f64,
    /// Resident memory of one replica, in bytes.
    pub memory_bytes: f64,
    /// Cores one replica spends delivering updates.
    pub cores: f64,
    /// Open files of one replica.
    pub files: f64,
    /// Bytes per second the API server sends the brokers, and the brokers the sidecars.
    pub api_bytes_per_second: f64,
    /// See `api_bytes_per_second`.
    pub sidecar_bytes_per_second: f64,
    /// The API server's memory for the brokers' watches, and for one watch per sidecar, each
    /// on its own connection, without the broker.
    pub apiserver_watch_bytes: f64,
    /// See `apiserver_watch_bytes`.
    pub apiserver_direct_bytes: f64,
    /// Priority and Fairness seats of one write to a CR, through the brokers and without them.
    pub seats_per_write: f64,
    /// See `seats_per_write`.
    pub seats_per_write_direct: f64,
    /// Each limit's use (0–1 and beyond), highest first.
    pub limits: Vec<(&'static str, f64)>,
}

/// Computes the plan.
pub fn plan(a: &PlanArgs) -> Plan {
    let replicas = a.replicas.max(1) as f64;
    let crs = a.crs.max(1) as f64;
    let sidecars_per_replica = a.sidecars as f64 / replicas;
    let subscribers_per_cr = (a.sidecars * a.crs_per_sidecar) as f64 / crs;
    // The chance that at least one of a CR's subscribers is on a given replica.
    let on_replica = 1.0 - (1.0 - 1.0 / replicas).powf(subscribers_per_cr);
    let watches_per_replica = crs * on_replica;
    let api_connections_per_replica = if a.http2 {
        (watches_per_replica / measured::STREAMS_PER_CONNECTION).ceil() + 1.0
    } else {
        watches_per_replica * measured::HTTP1_CONNECTIONS_PER_WATCH
    };
    let watch_bytes = if a.http2 {
        measured::WATCH_BYTES_HTTP2
    } else {
        measured::WATCH_BYTES_HTTP1
    };
    let memory_bytes = measured::BASE_BYTES
        + sidecars_per_replica * measured::SIDECAR_BYTES
        + watches_per_replica * watch_bytes;
    let deliveries = a.update_rate * subscribers_per_cr / replicas;
    let cores = deliveries * measured::DELIVERY_SECONDS;
    let files = sidecars_per_replica + api_connections_per_replica + 100.0;
    let mut limits = vec![
        (
            "memory",
            memory_bytes / (a.memory_mib as f64 * 1024.0 * 1024.0),
        ),
        ("cpu", cores / a.cpus.max(0.001)),
        ("open files", files / a.open_files.max(1) as f64),
    ];
    limits.sort_by(|x, y| y.1.total_cmp(&x.1));
    let seats = |watchers: f64| {
        (watchers / measured::APF_WATCHERS_PER_SEAT)
            .ceil()
            .clamp(1.0, measured::APF_MAX_SEATS)
    };
    Plan {
        sidecars_per_replica,
        subscribers_per_cr,
        watches_per_replica,
        api_watches: watches_per_replica * replicas,
        api_connections_per_replica,
        memory_bytes,
        cores,
        files,
        api_bytes_per_second: a.update_rate * on_replica * replicas * a.object_bytes as f64,
        sidecar_bytes_per_second: a.update_rate * subscribers_per_cr * a.object_bytes as f64,
        apiserver_watch_bytes: watches_per_replica
            * replicas
            * measured::APISERVER_BROKER_WATCH_BYTES,
        apiserver_direct_bytes: (a.sidecars * a.crs_per_sidecar) as f64
            * measured::APISERVER_DIRECT_WATCH_BYTES,
        // The replicas that watch a CR, against each of its subscribers.
        seats_per_write: seats(on_replica * replicas),
        seats_per_write_direct: seats(subscribers_per_cr),
        limits,
    }
}

/// The plan as Markdown.
pub fn render(a: &PlanArgs, p: &Plan) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} sidecars on {} CRs ({} each), {} replicas, {} updates/s, {} B objects, HTTP/{} to the API server\n",
        a.sidecars,
        a.crs,
        a.crs_per_sidecar,
        a.replicas,
        a.update_rate,
        a.object_bytes,
        if a.http2 { "2" } else { "1.1" }
    );
    let _ = writeln!(s, "| | per replica | in all |\n|---|---:|---:|");
    let row = |s: &mut String, what: &str, one: String, all: String| {
        let _ = writeln!(s, "| {what} | {one} | {all} |");
    };
    let r = a.replicas.max(1) as f64;
    row(
        &mut s,
        "sidecars",
        format!("{:.0}", p.sidecars_per_replica),
        a.sidecars.to_string(),
    );
    row(
        &mut s,
        "API watches",
        format!("{:.0}", p.watches_per_replica),
        format!(
            "{:.0} (without the broker: {})",
            p.api_watches,
            a.sidecars * a.crs_per_sidecar
        ),
    );
    row(
        &mut s,
        "API connections",
        format!("{:.0}", p.api_connections_per_replica),
        format!("{:.0}", p.api_connections_per_replica * r),
    );
    row(
        &mut s,
        "memory",
        format!("{:.0} MiB", p.memory_bytes / 1048576.0),
        format!("{:.1} GiB", p.memory_bytes * r / 1073741824.0),
    );
    row(
        &mut s,
        "CPU delivering updates",
        format!("{:.3} cores", p.cores),
        format!("{:.2} cores", p.cores * r),
    );
    row(
        &mut s,
        "open files",
        format!("{:.0}", p.files),
        String::new(),
    );
    row(
        &mut s,
        "bytes/s from the API server",
        format!("{:.0}", p.api_bytes_per_second / r),
        format!("{:.0}", p.api_bytes_per_second),
    );
    row(
        &mut s,
        "bytes/s to sidecars",
        format!("{:.0}", p.sidecar_bytes_per_second / r),
        format!("{:.0}", p.sidecar_bytes_per_second),
    );
    row(
        &mut s,
        "API server memory for the watches",
        String::new(),
        format!(
            "{:.2} GiB (without the broker: {:.2} GiB)",
            p.apiserver_watch_bytes / 1073741824.0,
            p.apiserver_direct_bytes / 1073741824.0
        ),
    );
    row(
        &mut s,
        "Priority and Fairness seats per write",
        String::new(),
        format!(
            "{:.0} (without the broker: {:.0})",
            p.seats_per_write, p.seats_per_write_direct
        ),
    );
    let _ = writeln!(s, "\nUse of one replica's limits, highest first:\n");
    for (limit, used) in &p.limits {
        let _ = writeln!(s, "- {limit}: {:.1} %", used * 100.0);
    }
    let watch_bytes = if a.http2 {
        measured::WATCH_BYTES_HTTP2
    } else {
        measured::WATCH_BYTES_HTTP1
    };
    let room = a.memory_mib as f64 * 1048576.0
        - measured::BASE_BYTES
        - p.watches_per_replica * watch_bytes;
    let _ = writeln!(
        s,
        "\nWith these watches, one replica's memory holds {:.0} sidecars.",
        (room / measured::SIDECAR_BYTES).max(0.0)
    );
    if let Some((limit, used)) = p.limits.first() {
        let verdict = if *used > 1.0 {
            "exceeds it"
        } else {
            "is the first one met"
        };
        let _ = writeln!(s, "\n{limit} {verdict} ({:.0} %).", used * 100.0);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        plan: PlanArgs,
    }

    fn args(line: &[&str]) -> PlanArgs {
        Cli::parse_from(std::iter::once("plan").chain(line.iter().copied())).plan
    }

    #[test]
    fn the_issue_fleet_is_memory_bound_and_watches_most_crs_on_every_replica() {
        let p = plan(&args(&[]));
        assert_eq!(p.sidecars_per_replica, 10_000.0);
        assert_eq!(p.subscribers_per_cr, 20.0);
        // 1 - 0.9^20 of 5,000 CRs have a subscriber on a given replica.
        assert!((p.watches_per_replica - 4_392.0).abs() < 1.0, "{p:?}");
        assert_eq!(p.api_connections_per_replica, 45.0);
        assert_eq!(p.limits[0].0, "memory");
        let mib = p.memory_bytes / 1048576.0;
        assert!((330.0..340.0).contains(&mib), "{mib}");
        // 20 subscribers a CR: 2 seats a write without the broker; the 10 replicas that watch
        // most CRs cost 1.
        assert_eq!((p.seats_per_write, p.seats_per_write_direct), (1.0, 2.0));
        let gib = |b: f64| b / 1073741824.0;
        assert!(
            (gib(p.apiserver_direct_bytes) - 11.44).abs() < 0.01,
            "{p:?}"
        );
        assert!((gib(p.apiserver_watch_bytes) - 0.84).abs() < 0.01, "{p:?}");
    }

    #[test]
    fn a_write_to_a_cr_with_many_watchers_costs_at_most_ten_seats() {
        let p = plan(&args(&[
            "--sidecars",
            "5000",
            "--crs",
            "100",
            "--replicas",
            "1",
        ]));
        assert_eq!(p.seats_per_write_direct, 5.0);
        assert_eq!(p.seats_per_write, 1.0);
        let crowded = plan(&args(&["--sidecars", "100000", "--crs", "10"]));
        assert_eq!(crowded.seats_per_write_direct, 10.0);
    }

    #[test]
    fn one_replica_watches_each_cr_once_and_more_replicas_watch_more() {
        let one = plan(&args(&["--replicas", "1"]));
        assert_eq!(one.api_watches, 5_000.0);
        let twenty = plan(&args(&["--replicas", "20"]));
        assert!(twenty.api_watches > plan(&args(&[])).api_watches);
        let http1 = plan(&args(&["--http2", "false"]));
        assert!(http1.api_connections_per_replica > 5_000.0);
    }
}
