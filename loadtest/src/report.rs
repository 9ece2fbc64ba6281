//! The results: a JSON file, a markdown summary and a PNG of the delivery-latency distributions.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use serde::Serialize;

use crate::Run;
use crate::scenarios::apiserver_cost::{self, ApiserverCost};
use crate::scenarios::attacks::Attacks;
use crate::scenarios::churn::Churn;
use crate::scenarios::coldstart::ColdStart;
use crate::scenarios::connections::Connections;
use crate::scenarios::failover::Failover;
use crate::scenarios::fanout::{Fanout, FanoutRun};
use crate::scenarios::granularity::Granularity;
use crate::scenarios::identity::Identity;
use crate::scenarios::idle::Idle;
use crate::scenarios::incremental::Incremental;
use crate::scenarios::peers::{self, Peers};
use crate::scenarios::resolvers::{self, Resolvers};
use crate::scenarios::stalled::Stalled;
use crate::scenarios::storm::Storm;

/// The machine the run was on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// CPU model.
    pub cpu: String,
    /// Cores available.
    pub cores: usize,
    /// Total memory in bytes.
    pub memory_bytes: u64,
    /// Kernel release.
    pub kernel: String,
    /// The open-file limit the run had.
    pub fd_limit: u64,
}

impl Machine {
    fn read(fd_limit: u64) -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        Machine {
            cpu: cpuinfo
                .lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
                .unwrap_or_default(),
            cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            memory_bytes: meminfo
                .lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .unwrap_or(0)
                * 1024,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_string(),
            fd_limit,
        }
    }
}

/// Broker ÷ bare, side by side in the same run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Ratios {
    /// Median fan-out time, many CRs (a).
    pub fanout_p50: Option<f64>,
    /// 99th-percentile fan-out time, many CRs (a).
    pub fanout_p99: Option<f64>,
    /// Median fan-out time, one hot CR (b).
    pub hot_fanout_p50: Option<f64>,
    /// Warm first message (broker) ÷ a unary round trip (bare), medians.
    pub warm_first_message_vs_unary: Option<f64>,
    /// Memory per idle one-stream sidecar.
    pub idle_memory: Option<f64>,
    /// `--identity peer-pod` ÷ `none`: median fan-out time.
    pub identity_fanout_p50: Option<f64>,
    /// `--identity peer-pod` ÷ `none`: median warm first message on a connection in use.
    pub identity_warm_first_message: Option<f64>,
    /// `--identity peer-pod` ÷ `none`: median first message on a new connection.
    pub identity_new_connection_first_message: Option<f64>,
}

/// Everything a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Results {
    /// The machine.
    pub machine: Machine,
    /// The command line's settings.
    pub settings: BTreeMap<String, String>,
    /// (a) many subscribers on many CRs.
    pub fanout: Option<Fanout>,
    /// (b) one hot CR.
    pub hot: Option<Fanout>,
    /// (c) reconnect storm.
    pub storm: Option<Storm>,
    /// (d) churn.
    pub churn: Option<Churn>,
    /// Idle sidecars' memory.
    pub idle: Option<Idle>,
    /// The cost of caller identity.
    pub identity: Option<Identity>,
    /// Readers that never read.
    pub stalled: Option<Stalled>,
    /// Replicas SIGKILLed under load, and a restart storm.
    pub failover: Option<Failover>,
    /// The same, the subscribers resuming with the version they hold.
    pub failover_resume: Option<Failover>,
    /// The same, resuming, with nothing written while they move.
    pub failover_resume_quiet: Option<Failover>,
    /// The same with flagd sync subscribers, which cannot resume.
    pub failover_flagd: Option<Failover>,
    /// The same, the replicas pacing new streams (`--failover-pace`).
    pub failover_flagd_paced: Option<Failover>,
    /// TCP connections to the API server, HTTP/1.1 and HTTP/2.
    pub connections: Option<Connections>,
    /// Per-object watches against one namespace watch.
    pub granularity: Option<Granularity>,
    /// A set's flagd streams sent whole and as incremental updates.
    pub incremental: Option<Incremental>,
    /// A cold subscribe against one LIST + WATCH.
    pub coldstart: Option<ColdStart>,
    /// The attacks a review found.
    pub attacks: Option<Attacks>,
    /// What sidecars cost a real API server, directly and through brokers.
    pub apiserver_cost: Option<ApiserverCost>,
    /// crd-broker beside the flagd daemon as a relay, on a real API server.
    pub peers: Option<Peers>,
    /// Resolving the replicas: kuberesolver-style clients against xDS through the broker.
    pub resolvers: Option<Resolvers>,
    /// Broker ÷ bare.
    pub ratios: Ratios,
}

impl Results {
    /// An empty result set for this run.
    pub fn new(run: &Run, fd_limit: u64) -> Self {
        let settings = [
            ("subscribers", run.subscribers.to_string()),
            ("connections", run.connections.to_string()),
            ("crs", run.crs.to_string()),
            ("rate", run.rate.to_string()),
            (
                "duration",
                humantime::format_duration(run.duration).to_string(),
            ),
            (
                "churn_duration",
                humantime::format_duration(run.churn_duration).to_string(),
            ),
            ("churn_subscribers", run.churn_subscribers.to_string()),
            ("sidecars", run.sidecars.to_string()),
            (
                "idle_hold",
                humantime::format_duration(run.idle_hold).to_string(),
            ),
            ("pod_ips", run.pod_ips.to_string()),
            ("payload_bytes", run.payload_bytes.to_string()),
            ("smoke", run.smoke.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        Results {
            machine: Machine::read(fd_limit),
            settings,
            fanout: None,
            hot: None,
            storm: None,
            churn: None,
            idle: None,
            identity: None,
            stalled: None,
            failover: None,
            failover_resume: None,
            failover_resume_quiet: None,
            failover_flagd: None,
            failover_flagd_paced: None,
            connections: None,
            granularity: None,
            incremental: None,
            coldstart: None,
            attacks: None,
            apiserver_cost: None,
            peers: None,
            resolvers: None,
            ratios: Ratios::default(),
        }
    }

    /// Fills in the ratios from what ran.
    pub fn compute_ratios(&mut self) {
        let ratio = |a: f64, b: f64| (b > 0.0).then(|| (a / b * 1000.0).round() / 1000.0);
        if let Some(f) = &self.fanout {
            self.ratios.fanout_p50 = ratio(f.broker.fanout.p50_ms, f.bare.fanout.p50_ms);
            self.ratios.fanout_p99 = ratio(f.broker.fanout.p99_ms, f.bare.fanout.p99_ms);
            if let Some(unary) = &f.bare.unary {
                self.ratios.warm_first_message_vs_unary =
                    ratio(f.broker.first_warm_alone.p50_ms, unary.p50_ms);
            }
        }
        if let Some(h) = &self.hot {
            self.ratios.hot_fanout_p50 = ratio(h.broker.fanout.p50_ms, h.bare.fanout.p50_ms);
        }
        if let Some(i) = &self.idle {
            self.ratios.idle_memory = ratio(i.broker.bytes_per_sidecar, i.bare.bytes_per_sidecar);
        }
        if let Some(i) = &self.identity {
            self.ratios.identity_fanout_p50 = ratio(i.peer_pod.fanout.p50_ms, i.none.fanout.p50_ms);
            self.ratios.identity_warm_first_message = ratio(
                i.peer_pod.first_warm_alone.p50_ms,
                i.none.first_warm_alone.p50_ms,
            );
            if let (Some(p), Some(n)) = (
                &i.peer_pod.first_new_connection,
                &i.none.first_new_connection,
            ) {
                self.ratios.identity_new_connection_first_message = ratio(p.p50_ms, n.p50_ms);
            }
        }
    }
}

fn kib(bytes: f64) -> String {
    format!("{:.1} KiB", bytes / 1024.0)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1048576.0)
}

fn fanout_table(title: &str, f: &Fanout) -> String {
    let mut s = format!(
        "### {title}\n\n{} subscribers over {} connections on {} CR(s), {} updates/s for {} s.\n\n| | broker | bare tonic |\n|---|---|---|\n",
        f.subscribers, f.connections, f.crs, f.rate, f.seconds
    );
    let row = |name: &str, b: String, t: String| format!("| {name} | {b} | {t} |\n");
    let lat = |x: &crate::stats::Summary| format!("{} / {} / {} ms", x.p50_ms, x.p99_ms, x.max_ms);
    s += &row(
        "fan-out time (write → last subscriber) p50 / p99 / max",
        lat(&f.broker.fanout),
        lat(&f.bare.fanout),
    );
    s += &row(
        "of which inside the broker (source event → last write), mean",
        f.broker
            .internal_fanout_mean_ms
            .map(|ms| format!("{ms:.3} ms"))
            .unwrap_or_else(|| "—".into()),
        "—".into(),
    );
    s += &row(
        "delivery latency (write → each subscriber) p50 / p99 / max",
        lat(&f.broker.deliveries),
        lat(&f.bare.deliveries),
    );
    s += &row(
        "first message, cold, all at once p50 / p99 / max",
        lat(&f.broker.first_cold),
        lat(&f.bare.first_cold),
    );
    s += &row(
        "first message, warm, all at once p50 / p99 / max",
        lat(&f.broker.first_warm),
        lat(&f.bare.first_warm),
    );
    s += &row(
        "first message, warm, one at a time p50 / p99 / max",
        lat(&f.broker.first_warm_alone),
        lat(&f.bare.first_warm_alone),
    );
    s += &row(
        "unary round trip p50",
        "—".into(),
        f.bare
            .unary
            .map(|u| format!("{} ms", u.p50_ms))
            .unwrap_or_default(),
    );
    s += &row(
        "memory before → loaded",
        format!(
            "{} → {}",
            mib(f.broker.rss_before_bytes),
            mib(f.broker.rss_loaded_bytes)
        ),
        format!(
            "{} → {}",
            mib(f.bare.rss_before_bytes),
            mib(f.bare.rss_loaded_bytes)
        ),
    );
    s += &row(
        "memory per subscriber stream",
        kib(f.broker.bytes_per_stream),
        kib(f.bare.bytes_per_stream),
    );
    s += &row(
        "CPU during updates",
        format!("{:.2} s", f.broker.cpu_seconds),
        format!("{:.2} s", f.bare.cpu_seconds),
    );
    s += &row(
        "updates / lost / stream errors",
        format!(
            "{} / {} / {}",
            f.broker.updates, f.broker.lost, f.broker.errors
        ),
        format!("{} / {} / {}", f.bare.updates, f.bare.lost, f.bare.errors),
    );
    s += &row(
        "API server: open watches / LISTs / WATCHes",
        format!(
            "{} / {} / {}",
            f.broker.open_watches.unwrap_or(0),
            f.broker.lists.unwrap_or(0),
            f.broker.watches.unwrap_or(0)
        ),
        "—".into(),
    );
    s + "\n"
}

/// The markdown summary.
pub fn markdown(r: &Results) -> String {
    let m = &r.machine;
    let mut s = format!(
        "## crd-broker load test\n\nMachine: {} ({} cores), {} memory, Linux {}, open-file limit {}.\n\n",
        m.cpu,
        m.cores,
        mib(m.memory_bytes),
        m.kernel,
        m.fd_limit
    );
    let x = |v: Option<f64>| v.map(|v| format!("{v:.2}×")).unwrap_or_else(|| "—".into());
    s += &format!(
        "| ratio (broker ÷ bare, same run) | value |\n|---|---|\n| fan-out time p50 (a) | {} |\n| fan-out time p99 (a) | {} |\n| fan-out time p50, hot CR (b) | {} |\n| warm first message ÷ unary round trip | {} |\n| memory per idle one-stream sidecar | {} |\n\n",
        x(r.ratios.fanout_p50),
        x(r.ratios.fanout_p99),
        x(r.ratios.hot_fanout_p50),
        x(r.ratios.warm_first_message_vs_unary),
        x(r.ratios.idle_memory)
    );
    if let Some(f) = &r.fanout {
        s += &fanout_table("(a) many subscribers, many CRs", f);
    }
    if let Some(f) = &r.hot {
        s += &fanout_table("(b) one hot CR", f);
    }
    if let Some(st) = &r.storm {
        s += &format!(
            "### (c) reconnect storm\n\n{} subscribers on {} CRs at once, on a broker with no watches: all served in {:.2} s; first message p50 / p99 / max {} / {} / {} ms; LISTs per CR {}–{}, WATCHes per CR {}–{} (goal 1 and 1); {} open watches; {} stream errors.\n\n",
            st.subscribers,
            st.crs,
            st.all_served_seconds,
            st.first_message.p50_ms,
            st.first_message.p99_ms,
            st.first_message.max_ms,
            st.lists_per_cr.0,
            st.lists_per_cr.1,
            st.watches_per_cr.0,
            st.watches_per_cr.1,
            st.open_watches,
            st.errors
        );
    }
    if let Some(c) = &r.coldstart {
        s += &format!(
            "### Cold start\n\nA cold subscribe's first message against one LIST and the start of one WATCH by a kube-rs client on the same API server (p50 / p99 ms).\n\n| | cold subscribe | LIST + WATCH | ratio of medians |\n|---|---:|---:|---:|\n| one at a time | {} / {} | {} / {} | {:.2} |\n| 100 at once | {} / {} | {} / {} | {:.2} |\n\n",
            c.broker_alone.p50_ms,
            c.broker_alone.p99_ms,
            c.list_watch_alone.p50_ms,
            c.list_watch_alone.p99_ms,
            c.ratio_alone,
            c.broker_at_once.p50_ms,
            c.broker_at_once.p99_ms,
            c.list_watch_at_once.p50_ms,
            c.list_watch_at_once.p99_ms,
            c.ratio_at_once
        );
    }
    if let Some(g) = &r.granularity {
        s += "### Watch granularity\n\nN names watched in a namespace of FeatureFlags, while every FeatureFlag there is written twice.\n\n| names | objects | granularity | API watches | bytes from the API server | broker CPU | all subscribed after |\n|---:|---:|---|---:|---:|---:|---:|\n";
        for row in &g.rows {
            s += &format!(
                "| {} | {} | {} | {} | {:.1} KiB | {:.2} s | {:.2} s |\n",
                row.names,
                row.objects,
                row.granularity,
                row.watches,
                row.bytes as f64 / 1024.0,
                row.cpu_seconds,
                row.subscribe_seconds
            );
        }
        s += "\n";
    }
    if let Some(i) = &r.incremental {
        s += "### Incremental updates of a set\n\nOne write to one FeatureFlag of a label-selected set, as the set's flagd sync streams are sent it: whole (the merged configuration) or as incremental updates (that FeatureFlag's flag set alone).\n\n| FeatureFlags | updates | streams | writes | first message | bytes per write per stream | messages per write | broker CPU for the writes |\n|---:|---|---:|---:|---:|---:|---:|---:|\n";
        for row in &i.rows {
            s += &format!(
                "| {} | {} | {} | {} | {:.1} KiB | {:.0} | {:.2} | {:.2} s |\n",
                row.members,
                row.updates,
                row.streams,
                row.writes,
                row.first_bytes as f64 / 1024.0,
                row.bytes_per_write,
                row.messages_per_write,
                row.cpu_seconds
            );
        }
        s += "\n| FeatureFlags | bytes per write, incremental ÷ whole |\n|---:|---:|\n";
        for (members, ratio) in &i.ratios {
            s += &format!("| {members} | {ratio:.4} |\n");
        }
        s += "\n";
    }
    if let Some(c) = &r.connections {
        s += "### TCP connections to the API server\n\nThe fake over TLS with 100 streams per HTTP/2 connection; counted from the broker's sockets once every CR was watched.\n\n| CRs | `--api-http2` | connections | watches | all watched after | broker memory before → after |\n|---:|---|---:|---:|---:|---:|\n";
        for row in &c.rows {
            s += &format!(
                "| {} | {} | {} | {} | {:.2} s | {:.1} → {:.1} MiB |\n",
                row.crs,
                row.api_http2,
                row.connections,
                row.watches,
                row.seconds,
                row.rss_before_bytes as f64 / 1048576.0,
                row.rss_after_bytes as f64 / 1048576.0
            );
        }
        s += "\n";
    }
    let failovers = [
        &r.failover,
        &r.failover_resume,
        &r.failover_resume_quiet,
        &r.failover_flagd,
        &r.failover_flagd_paced,
    ];
    for f in failovers.into_iter().flatten() {
        let how = match (f.flagd, f.pace > 0.0, f.resume, f.quiet_move) {
            (true, false, ..) => "flagd sync subscribers".to_string(),
            (true, true, ..) => format!(
                "flagd sync subscribers, each replica taking {} new streams a second",
                f.pace
            ),
            (false, _, false, _) => "subscribers subscribing afresh".to_string(),
            (false, _, true, false) => {
                "subscribers resuming with the version they hold".to_string()
            }
            (false, _, true, true) => {
                "subscribers resuming, nothing written while they move".to_string()
            }
        };
        s += &format!(
            "### Replicas SIGKILLed under load, {how}

{} subscribers on {} CRs over {} replicas, every CR written in turn ({} writes in all). One replica SIGKILLed: its {} subscribers held a state from another replica {:.2} s later at p50, {:.2} s at p99 and {:.2} s for the last, costing the API server {} LISTs and {} WATCHes (the others already watched every CR). They were sent {:.1} KiB meanwhile, {:.4} × their states sent whole ({:.1} KiB); {} began again with CURRENT. The {} whose CR did not change while they moved were sent {:.4} × their states whole. Then every replica killed and a fresh one started: every subscriber held a state from it {:.2} s after it listened, with {}–{} LISTs and {}–{} WATCHes per CR (goal 1 and 1). Subscribers not on their CR's final resourceVersion at the end: {} (goal 0).\n\n",
            f.subscribers,
            f.crs,
            f.replicas,
            f.writes,
            f.moved,
            f.moved_p50_seconds,
            f.moved_p99_seconds,
            f.moved_seconds,
            f.moved_lists,
            f.moved_watches,
            f.moved_bytes as f64 / 1024.0,
            f.moved_bytes as f64 / f.moved_full_bytes.max(1) as f64,
            f.moved_full_bytes as f64 / 1024.0,
            f.moved_current,
            f.moved_unchanged,
            f.unchanged_bytes as f64 / f.unchanged_full_bytes.max(1) as f64,
            f.storm_seconds,
            f.storm_lists_per_cr.0,
            f.storm_lists_per_cr.1,
            f.storm_watches_per_cr.0,
            f.storm_watches_per_cr.1,
            f.lost
        );
        s += &format!(
            "While they moved: the survivors refused {} new streams for their pace; their own subscribers were sent writes at p99 {:.3} s (the second before the kill: {:.3} s; the longest wait {:.3} s; {} and {} deliveries); the survivors' busiest 100 ms took {:.2} cores, {:.2} CPU seconds in all, and the larger one's memory went from {:.1} to {:.1} MiB.\n\n",
            f.refused,
            f.survivors_move_p99_seconds,
            f.survivors_usual_p99_seconds,
            f.survivors_move_max_seconds,
            f.survivors_move_deliveries,
            f.survivors_usual_deliveries,
            f.survivors_cpu_peak_cores,
            f.survivors_cpu_seconds,
            f.survivors_rss_before_bytes as f64 / 1048576.0,
            f.survivors_rss_peak_bytes as f64 / 1048576.0,
        );
    }
    if let Some(c) = &r.churn {
        s += &format!(
            "### (d) churn\n\n{} subscribers alive at once, each for 0.2–3 s, for {} s: {} subscriptions, first message p50 / p99 {} / {} ms, {} watches started, {} lost at the end, {} watches open after everyone left (linger 1 s), {:.2} s broker CPU.\n\n",
            c.active,
            c.seconds,
            c.subscriptions,
            c.first_message.p50_ms,
            c.first_message.p99_ms,
            c.watch_starts,
            c.lost,
            c.open_watches_after,
            c.cpu_seconds
        );
    }
    if let Some(i) = &r.idle {
        s += &format!(
            "### Idle sidecars (one connection, one stream each)\n\n| | broker | bare tonic |\n|---|---|---|\n| sidecars | {} | {} |\n| memory before → after {:.1} s connected | {} → {} | {} → {} |\n| per sidecar | {} | {} |\n| connect time | {:.1} s | {:.1} s |\n\n",
            i.broker.sidecars,
            i.bare.sidecars,
            i.broker.hold_seconds,
            mib(i.broker.rss_before_bytes),
            mib(i.broker.rss_after_bytes),
            mib(i.bare.rss_before_bytes),
            mib(i.bare.rss_after_bytes),
            kib(i.broker.bytes_per_sidecar),
            kib(i.bare.bytes_per_sidecar),
            i.broker.connect_seconds,
            i.bare.connect_seconds
        );
    }
    if let Some(i) = &r.identity {
        s += &identity_section(i, &r.ratios);
    }
    if let Some(t) = &r.stalled {
        s += &format!(
            "### Readers that never read

{} streams took their first message and never read again; {} updates of {} were written.

| | |
|---|---|
| memory before → after | {} → {} |
| per stalled stream | {} |
| a reader on the same CR got the last update | {} |

",
            t.readers,
            t.updates,
            kib(t.update_bytes as f64),
            mib(t.rss_before_bytes),
            mib(t.rss_after_bytes),
            kib(t.bytes_per_stalled_stream),
            t.reader_got_the_last
        );
    }
    if let Some(a) = &r.attacks {
        s += &attacks_section(a);
    }
    if let Some(c) = &r.apiserver_cost {
        s += &apiserver_cost::markdown(c);
    }
    if let Some(p) = &r.peers {
        s += &peers::markdown(p);
    }
    if let Some(x) = &r.resolvers {
        s += &resolvers::markdown(x);
    }
    s
}

fn attacks_section(a: &Attacks) -> String {
    let mut s = String::from(
        "### Attacks (docs/security.md)

| attack | from | admitted | API watches after | broker watches after | another caller served |
|---|---|---|---|---|---|
",
    );
    for (what, cycles) in [
        ("set selectors, `--max-watches 50`", &a.set_cycles),
        ("one name per namespace", &a.namespace_cycles),
    ] {
        for c in cycles {
            s += &format!(
                "| {} × {what} | {} | {} | {} | {} | {} |\n",
                c.attempted,
                c.from,
                c.admitted,
                c.api_watches_after,
                c.broker_watches_after,
                c.other_caller_served
            );
        }
    }
    let t = &a.token_flood;
    let lat = |x: &crate::stats::Summary| format!("{} / {} ms", x.p50_ms, x.p99_ms);
    s += &format!(
        "
{} random bearer tokens from one address: {} TokenReviews; memory {} → {}; a valid caller's \
first message (p50 / p99) {} before, {} during, {} failed; its next subscribe after cost {} \
TokenReviews.

",
        t.tokens,
        t.token_reviews,
        mib(t.rss_before_bytes),
        mib(t.rss_after_bytes),
        lat(&t.valid_before),
        lat(&t.valid_during),
        t.valid_failures,
        t.valid_reviews_after
    );
    let st = &a.stalled_set;
    let later: Vec<String> = st
        .rss_later_rounds_bytes
        .iter()
        .map(|(stalled, after)| format!("{} / {}", mib(*stalled), mib(*after)))
        .collect();
    s += &format!(
        "{} stalled subscribers of a set of {} × {}: memory {} before, {} while they stall, {} after \
they left ({} watches listed then); in later rounds, while / after: {}.

",
        st.subscribers,
        st.members,
        kib(st.member_bytes as f64),
        mib(st.rss_before_bytes),
        mib(st.rss_stalled_bytes),
        mib(st.rss_after_bytes),
        st.watches_after,
        later.join(", ")
    );
    let o = &a.overlapping_sets;
    s += &format!(
        "{} × distinct selectors over {} FeatureFlags of {} (each selects all of them), from one \
caller: {} admitted of {} asked in {:.0} s{}; the API server served {} LISTs and held up to {} \
WATCHes; memory {} before, {} at most, {} once they lingered out; another caller {} (first \
message p50 / p99 {} / {} ms).

",
        o.attempted,
        o.members,
        kib(o.member_bytes as f64),
        o.admitted,
        o.attempted,
        o.seconds,
        o.stopped
            .as_ref()
            .map(|why| format!(", stopped: {why}"))
            .unwrap_or_default(),
        o.api_lists,
        o.api_watches_peak,
        mib(o.rss_before_bytes),
        mib(o.rss_peak_bytes),
        mib(o.rss_after_bytes),
        if o.other_caller_served {
            "was served throughout"
        } else {
            "was refused or timed out at times"
        },
        o.other_caller.p50_ms,
        o.other_caller.p99_ms,
    );
    let x = &a.xds_fanout;
    s += &format!(
        "{} xDS streams of the endpoints over {} connections, one EndpointSlice change: every \
stream had it {:.2} s after the write (p50 / p99 {} / {} ms, {} missed), {:.2} s of broker CPU; \
memory {} before the streams, {} with them ({} a stream).

",
        x.streams,
        x.connections,
        x.change_to_all_seconds,
        x.change.p50_ms,
        x.change.p99_ms,
        x.missed,
        x.cpu_seconds,
        mib(x.rss_before_bytes),
        mib(x.rss_streams_bytes),
        kib(
            x.rss_streams_bytes.saturating_sub(x.rss_before_bytes) as f64 / x.streams.max(1) as f64
        ),
    );
    let f = &a.proxy_token_flood;
    s += &format!(
        "{} new connections from a proxy's address, 100 a second, {} random tokens each, the API \
server answering TokenReviews 429 (Retry-After 2 s): {} TokenReviews in {:.0} s; a valid \
caller's first message p50 / p99 {} / {} ms ({} failed); a warm watch's delivery {} / {} ms; a \
cold resource's first message {} / {} ms ({} failed or over 10 s).

",
        f.connections,
        f.tokens_per_connection,
        f.token_reviews,
        f.seconds,
        f.valid.p50_ms,
        f.valid.p99_ms,
        f.valid_failures,
        f.delivery.p50_ms,
        f.delivery.p99_ms,
        f.cold_first.p50_ms,
        f.cold_first.p99_ms,
        f.cold_failures,
    );
    let r = &a.rbac_revoked;
    s += &format!(
        "The broker's ClusterRoleBinding deleted on a real kube-apiserver, restarted so that every \
watch asks again, while the broker watched {} FeatureFlags one per namespace: over {:.0} s, {:.1} \
requests a second ({:.1} in the second half); a new subscriber to a warm one got {}; every watch \
current again {:.1} s after the binding came back.

",
        r.crs,
        r.revoked_seconds,
        r.requests_per_second,
        r.later_requests_per_second,
        r.new_subscriber,
        r.recovery_seconds,
    );
    let n = &a.cycled_names;
    let rounds: Vec<String> = n.rss_after_round_bytes.iter().map(|b| mib(*b)).collect();
    s += &format!(
        "{} made-up names, new each round: memory {} after three rounds, then after each round {} \
({:+}% first to last, {}% between the lowest and the highest, a fitted trend of {:+}%).

",
        n.names,
        mib(n.rss_after_warmup_bytes),
        rounds.join(", "),
        n.growth_percent,
        n.spread_percent,
        n.trend_percent
    );
    s
}

fn identity_section(i: &Identity, ratios: &Ratios) -> String {
    let lat = |x: &crate::stats::Summary| format!("{} / {} / {} ms", x.p50_ms, x.p99_ms, x.max_ms);
    let x = |v: Option<f64>| v.map(|v| format!("{v:.2}×")).unwrap_or_else(|| "—".into());
    let new_conn = |f: &FanoutRun| {
        f.first_new_connection
            .as_ref()
            .map(lat)
            .unwrap_or_else(|| "—".into())
    };
    let mut s = format!(
        "### The cost of identity

{} subscribers over {} connections on {} CRs, {} updates/s for {} s, on two brokers at once: `--identity none` and `--identity peer-pod` (every source address a pod).

| | identity none | identity peer-pod | ratio |
|---|---|---|---|
",
        i.subscribers, i.connections, i.crs, i.rate, i.seconds
    );
    s += &format!(
        "| fan-out time p50 / p99 / max | {} | {} | {} |
",
        lat(&i.none.fanout),
        lat(&i.peer_pod.fanout),
        x(ratios.identity_fanout_p50)
    );
    s += &format!(
        "| first message, warm, on a connection in use p50 / p99 / max | {} | {} | {} |
",
        lat(&i.none.first_warm_alone),
        lat(&i.peer_pod.first_warm_alone),
        x(ratios.identity_warm_first_message)
    );
    s += &format!(
        "| first message, warm, on a new connection p50 / p99 / max | {} | {} | {} |
",
        new_conn(&i.none),
        new_conn(&i.peer_pod),
        x(ratios.identity_new_connection_first_message)
    );
    s += &format!(
        "| updates / lost / stream errors | {} / {} / {} | {} / {} / {} | |
",
        i.none.updates,
        i.none.lost,
        i.none.errors,
        i.peer_pod.updates,
        i.peer_pod.lost,
        i.peer_pod.errors
    );
    s += &format!(
        "| pod lookups (API requests) for it all | 0 | {} | |

",
        i.pod_lookups
    );
    let c = &i.cost;
    s += &format!(
        "{} one-stream sidecars in {} pods, connecting 256 at a time; {} refused.\n\n| | served in | pod lookups | API requests in all |\n|---|---|---|---|\n| a pod's sidecars together (pods starting) | {:.1} s | {} | {} |\n| every pod's interleaved, once the cache expired (a broker restart) | {:.1} s | {} | {} |\n\n",
        c.sidecars,
        c.pod_ips,
        c.errors,
        c.by_pod.seconds,
        c.by_pod.pod_lookups,
        c.by_pod.api_requests,
        c.interleaved.seconds,
        c.interleaved.pod_lookups,
        c.interleaved.api_requests
    );
    s
}

/// Writes `results.json`, `summary.md`, `latency.png` (and `apiserver-cost.png`) into `dir`;
/// returns the summary.
pub fn write(dir: &Path, r: &Results) -> anyhow::Result<String> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("results.json"), serde_json::to_string_pretty(r)?)?;
    let summary = markdown(r);
    std::fs::write(dir.join("summary.md"), &summary)?;
    plot(&dir.join("latency.png"), r)?;
    if let Some(c) = &r.apiserver_cost {
        apiserver_cost::plot(&dir.join("apiserver-cost.png"), c)?;
    }
    Ok(summary)
}

/// One line of the plot: its label, its (ms, fraction) points and its colour.
type Series<'a> = (String, &'a Vec<(f64, f64)>, plotters::style::RGBColor);

fn plot(path: &Path, r: &Results) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let series: Vec<Series<'_>> = [
        r.fanout.as_ref().map(|f| {
            (
                "(a) broker".to_string(),
                &f.broker.cdf,
                RGBColor(200, 40, 40),
            )
        }),
        r.fanout.as_ref().map(|f| {
            (
                "(a) bare tonic".to_string(),
                &f.bare.cdf,
                RGBColor(40, 40, 200),
            )
        }),
        r.hot.as_ref().map(|f| {
            (
                "(b) broker".to_string(),
                &f.broker.cdf,
                RGBColor(230, 140, 0),
            )
        }),
        r.hot.as_ref().map(|f| {
            (
                "(b) bare tonic".to_string(),
                &f.bare.cdf,
                RGBColor(0, 150, 150),
            )
        }),
    ]
    .into_iter()
    .flatten()
    .filter(|(_, points, _)| !points.is_empty())
    .collect();
    let with_text = crate::plot::text();
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let all_ms = || {
        series
            .iter()
            .flat_map(|(_, p, _)| p.iter().map(|(ms, _)| *ms))
    };
    let max_ms = all_ms().fold(1.0f64, f64::max);
    let min_ms = all_ms().filter(|ms| *ms > 0.0).fold(max_ms, f64::min);
    let mut builder = ChartBuilder::on(&root);
    builder
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(55);
    if with_text {
        builder.caption(
            "Delivery latency: write → subscriber (CDF)",
            ("sans-serif", 22),
        );
    }
    let mut chart =
        builder.build_cartesian_2d((min_ms * 0.8..max_ms * 1.2).log_scale(), 0f64..1.0)?;
    let mut mesh = chart.configure_mesh();
    if with_text {
        mesh.x_desc("milliseconds (log)")
            .y_desc("fraction of deliveries");
    } else {
        mesh.disable_x_mesh().disable_y_mesh();
    }
    mesh.draw()?;
    for (label, points, color) in &series {
        let drawn = chart.draw_series(LineSeries::new(
            points.iter().map(|(ms, f)| (ms.max(min_ms * 0.8), *f)),
            ShapeStyle::from(*color).stroke_width(2),
        ))?;
        if with_text {
            drawn.label(label.clone()).legend(crate::plot::mark(*color));
        }
    }
    if with_text {
        crate::plot::legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    }
    root.present()?;
    Ok(())
}
