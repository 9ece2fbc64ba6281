//! Scenario `peers`: crd-broker beside the real peers a user could run in its place, on one
//! real control plane each, with the same CRs and the same flagd sync subscribers, one server
//! after the other in one run.
//!
//! The peers: stock flagd-proxy (built from its sources by `scripts/peers`, ADR 0022), which
//! starts a namespace-wide informer at a selector's first subscriber, as the broker starts a
//! watch at a CR's first; and the flagd daemon as a relay, `flagd start` with a Kubernetes
//! source per CR (flagd's core Kubernetes sync, the code flagd-proxy runs for each selector)
//! and its own sync server taking the sidecars' `SyncFlags` streams, which watches every CR
//! from its start.
//!
//! Per row: the CRs; the server; the first subscriber of every CR (cold, one CR after the other:
//! stock flagd-proxy crashes when they come at once, `--peers-cold-together`), then the rest
//! (warm), each on a connection of its own as pods have; an idle period (memory per idle stream); one
//! write per second per CR (write → every subscriber, the API server's CPU); churn (subscribers
//! opening and dropping while the writes go on); then one CR deleted and created again.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use control_plane::ControlPlane;
use crd_broker::pb::flagd::SyncFlagsRequest;
use crd_broker::pb::flagd::flag_sync_service_client::FlagSyncServiceClient;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tonic::transport::Channel;

use crate::Run;
use crate::clients::{self, Recorder, number_after, tokio_util_like};
use crate::fixtures::{name, real_world, tempfile_like, wait_until};
use crate::stats::{self, Histogram, Summary};
use crate::target::{Log, Target};

const NAMESPACE: &str = "default";

/// One server at one number of streams.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// `flagd-proxy`, `flagd` or `crd-broker`.
    pub server: String,
    /// flagd sync streams.
    pub streams: usize,
    /// CRs they follow.
    pub crs: usize,
    /// Seconds from the first stream until every stream had its first configuration.
    pub ready_seconds: f64,
    /// First message of the first stream of each CR.
    pub first_cold: Summary,
    /// First message of the other streams.
    pub first_warm: Summary,
    /// The server's resident memory once started, before any stream.
    pub rss_base_bytes: u64,
    /// Its resident memory after the idle period.
    pub rss_idle_bytes: u64,
    /// WATCH requests the API server serves on FeatureFlags, idle.
    pub api_watches: f64,
    /// Requests on FeatureFlags the API server counted from the server's start to the end of
    /// the writes (`apiserver_request_total`), the writer's PATCHes left out.
    pub api_requests: f64,
    /// The API server's CPU under the writes, in cores.
    pub api_cpu_writes_cores: f64,
    /// The server's CPU under the writes, in cores.
    pub server_cpu_writes_cores: f64,
    /// Writes made.
    pub writes: u64,
    /// Per write: from the write until every stream of its CR had it.
    pub write_to_all: Summary,
    /// Streams not on their CR's last write 30 s after it.
    pub lost: usize,
    /// Streams that ended with an error.
    pub errors: u64,
    /// Streams opened and dropped during the churn.
    pub churn_streams: u64,
    /// Their first messages.
    pub churn_first: Summary,
    /// Churn streams that failed (an error, or no first message in 10 s).
    pub churn_errors: u64,
    /// Streams of the long-lived ones not on their CR's last write after the churn.
    pub churn_lost: usize,
    /// Seconds from deleting a CR until every stream of it had a configuration without its
    /// flags (`None`: not every one did within 30 s).
    pub deleted_seconds: Option<f64>,
    /// Seconds from creating it again until every stream of it had it.
    pub recreated_seconds: Option<f64>,
    /// How the server ended, if it ended before the row did, and its log there.
    #[serde(default)]
    pub exited: Option<String>,
}

/// Every row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Peers {
    /// Seconds of idle, writes and churn.
    pub idle_seconds: f64,
    pub write_seconds: f64,
    pub churn_seconds: f64,
    /// By streams, then server.
    pub rows: Vec<Row>,
}

/// Runs every server at every number of streams.
pub async fn peers(run: &Run) -> anyhow::Result<Peers> {
    let mut rows = Vec::new();
    for &n in &run.peers_streams {
        for server in &run.peers_servers {
            eprintln!("peers: {server}, {n} streams on {} CRs", run.peers_crs);
            rows.push(
                row(run, server, n)
                    .await
                    .with_context(|| format!("{server} with {n} streams"))?,
            );
        }
    }
    Ok(Peers {
        idle_seconds: run.peers_idle.as_secs_f64(),
        write_seconds: run.peers_writes.as_secs_f64(),
        churn_seconds: run.peers_churn.as_secs_f64(),
        rows,
    })
}

/// The selector of CR `k` on `server`: flagd's sync server knows its sources by their URI.
fn selector(server: &str, k: usize) -> String {
    match server {
        "flagd" => format!("{NAMESPACE}/{}", name(k)),
        _ => format!("core.openfeature.dev/{NAMESPACE}/{}", name(k)),
    }
}

/// The API server's requests on FeatureFlags other than the writer's PATCHes.
async fn api_requests(plane: &ControlPlane) -> f64 {
    let m = plane.metrics().await;
    let all = control_plane::total(
        &m,
        "apiserver_request_total",
        &[("resource", "featureflags")],
    );
    let patches = control_plane::total(
        &m,
        "apiserver_request_total",
        &[("resource", "featureflags"), ("verb", "PATCH")],
    );
    all - patches
}

/// One flagd sync stream: the first configuration timed into `first`, then every one recorded
/// (a configuration without the writer's stamp — a deleted CR's — leaves the slot at 0).
async fn follow(
    channel: Channel,
    selector: String,
    slot: usize,
    first: Arc<Histogram>,
    recorder: Arc<Recorder>,
    stop: tokio_util_like::Stop,
) {
    let mut client = FlagSyncServiceClient::new(channel);
    let request = SyncFlagsRequest {
        provider_id: String::new(),
        selector,
    };
    let opened = client.sync_flags(request);
    clients::follow(opened, &recorder, stop, |elapsed, r| {
        let config = r.flag_configuration.as_bytes();
        match elapsed {
            Some(elapsed) => first.record(elapsed),
            None => recorder.update(config),
        }
        let seq = number_after(config, "seq").unwrap_or(0);
        recorder.last_seq[slot].store(seq, Ordering::Relaxed);
    })
    .await
}

async fn row(run: &Run, server: &str, n: usize) -> anyhow::Result<Row> {
    let crs = run.peers_crs;
    let plane = crate::fixtures::own_plane().await?;
    real_world(&plane, crs, run.payload_bytes).await?;
    // Each CR a flag set of its own: flagd's store keys a flag by its set and its key, so CRs
    // with the same flag keys and no set would overwrite each other there.
    let admin: Api<DynamicObject> = Api::namespaced_with(
        plane.admin().await,
        NAMESPACE,
        &crate::fixtures::featureflags(),
    );
    for k in 0..crs {
        let set = json!({ "spec": { "flagSpec": { "metadata": { "flagSetId": name(k) } } } });
        admin
            .patch(&name(k), &PatchParams::default(), &Patch::Merge(set))
            .await?;
    }
    let (api_pid, _) = crate::fixtures::apiserver(&plane)?;
    let dir = tempfile_like::Dir::new()?;
    let kubeconfig = plane
        .kubeconfig_for(NAMESPACE, "broker", dir.path(), &plane.server)
        .await;
    let requests_before = api_requests(&plane).await;
    let mut target = match server {
        "flagd" => {
            let sources: Vec<_> = (0..crs)
                .map(|k| json!({ "uri": format!("{NAMESPACE}/{}", name(k)), "provider": "kubernetes" }))
                .collect();
            let log = Log::File(std::fs::File::create(dir.path().join("flagd.log"))?);
            Target::flagd(&kubeconfig, &json!(sources), log)
                .await
                .with_context(|| format!("flagd's log: {}", log_tail(&dir, server)))?
        }
        "flagd-proxy" => {
            let log = Log::File(std::fs::File::create(dir.path().join("flagd-proxy.log"))?);
            Target::flagd_proxy(&kubeconfig, log)
                .await
                .with_context(|| format!("flagd-proxy's log: {}", log_tail(&dir, server)))?
        }
        "crd-broker" => {
            let bin = crate::target::broker_bin(run.broker_bin.clone())?;
            Target::broker_logging(
                &bin,
                &kubeconfig,
                Duration::from_secs(30),
                &[],
                Log::Inherit,
            )
            .await?
        }
        other => anyhow::bail!("no server {other} (flagd-proxy, flagd, crd-broker)"),
    };
    // flagd lists and watches every source as it starts; give it the moment it takes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_base_bytes = target.rss();

    let writes_planned =
        crs * (run.peers_writes.as_secs() as usize + run.peers_churn.as_secs() as usize + 2);
    let recorder = Recorder::new(n, writes_planned + 1);
    let (cold, warm) = (
        Arc::new(Histogram::default()),
        Arc::new(Histogram::default()),
    );
    let (trigger, stop) = tokio_util_like::signal();
    let started = Instant::now();
    // One connection per stream, as each pod has its own: the first of every CR, one CR after
    // the other (or all at once), then the rest.
    let channels = clients::connections(target.grpc, n, run.sources).await?;
    let mut channels = channels.into_iter().enumerate();
    for (i, channel) in channels.by_ref().take(crs.min(n)) {
        tokio::spawn(follow(
            channel,
            selector(server, i % crs),
            i,
            cold.clone(),
            recorder.clone(),
            stop.clone(),
        ));
        if !run.peers_cold_together {
            wait_until("the CR's first stream", Duration::from_secs(30), || {
                cold.count() > i as u64 || recorder.errors.load(Ordering::Relaxed) > 0
            })
            .await?;
        }
    }
    wait_until("every CR's first stream", Duration::from_secs(120), || {
        cold.summary().count >= crs.min(n) as u64 || recorder.errors.load(Ordering::Relaxed) > 0
    })
    .await?;
    for (i, channel) in channels {
        tokio::spawn(follow(
            channel,
            selector(server, i % crs),
            i,
            warm.clone(),
            recorder.clone(),
            stop.clone(),
        ));
    }
    wait_until(
        "every stream's first configuration",
        Duration::from_secs(600),
        || {
            cold.summary().count + warm.summary().count >= n as u64
                || recorder.errors.load(Ordering::Relaxed) > 0
        },
    )
    .await?;
    anyhow::ensure!(
        recorder.errors.load(Ordering::Relaxed) == 0,
        "{} streams failed before their first configuration, the first with {}; the server's log ends: {}",
        recorder.errors.load(Ordering::Relaxed),
        recorder.first_error(),
        log_tail(&dir, server)
    );
    let ready_seconds = started.elapsed().as_secs_f64();
    tokio::time::sleep(run.peers_idle).await;
    let rss_idle_bytes = target.rss();
    let api_watches = plane
        .open_watches("core.openfeature.dev", "featureflags")
        .await;

    // One write per second per CR, by the writer, each stamping its seq and the time it was sent.
    let writer = control_plane::client_from(
        &plane
            .kubeconfig_for(NAMESPACE, "writer", dir.path(), &plane.server)
            .await,
    )
    .await;
    let api: Api<DynamicObject> =
        Api::namespaced_with(writer, NAMESPACE, &crate::fixtures::featureflags());
    let seq = Arc::new(AtomicU64::new(0));
    let last: Arc<Vec<AtomicU64>> = Arc::new((0..crs).map(|_| AtomicU64::new(0)).collect());
    let on_last = |r: &Recorder| {
        (0..n)
            .filter(|&i| {
                r.last_seq[i].load(Ordering::Relaxed) == last[i % crs].load(Ordering::Relaxed)
            })
            .count()
    };
    let cpu = |pid: u32| stats::cpu(pid).as_secs_f64();
    let (api_before, server_before) = (cpu(api_pid), cpu(target.pid()));
    let writes_started = Instant::now();
    write_for(&api, crs, run.peers_writes, &seq, &last).await?;
    let write_seconds = writes_started.elapsed().as_secs_f64();
    let api_cpu_writes_cores = (cpu(api_pid) - api_before) / write_seconds;
    let server_cpu_writes_cores = (cpu(target.pid()) - server_before) / write_seconds;
    let _ = wait_until(
        "every stream on its CR's last write",
        Duration::from_secs(30),
        || on_last(&recorder) == n,
    )
    .await;
    let lost = n - on_last(&recorder);
    let write_to_all = recorder.completions().summary();
    let api_requests = api_requests(&plane).await - requests_before;

    // Churn: a tenth of the streams again (500 at most), each opening, holding 0.5–2 s and
    // dropping, over and over, while the writes go on.
    let churners = (n / 10).clamp(1, 500);
    let churn_first = Arc::new(Histogram::default());
    let churn_errors = Arc::new(AtomicU64::new(0));
    let churn_until = Instant::now() + run.peers_churn;
    let mut tasks = Vec::new();
    for c in 0..churners {
        let (addr, selector) = (target.grpc, selector(server, c % crs));
        let (first, errors) = (churn_first.clone(), churn_errors.clone());
        let local = std::net::Ipv4Addr::new(127, 0, 0, 1 + (c % run.sources.max(1) as usize) as u8);
        tasks.push(tokio::spawn(async move {
            let mut k = c as u64;
            while Instant::now() < churn_until {
                let opened = Instant::now();
                let got = async {
                    let channel = clients::connection_from(addr, local).await.ok()?;
                    let request = SyncFlagsRequest {
                        provider_id: String::new(),
                        selector: selector.clone(),
                    };
                    let mut stream = FlagSyncServiceClient::new(channel)
                        .sync_flags(request)
                        .await
                        .ok()?
                        .into_inner();
                    stream.message().await.ok()??;
                    Some(stream)
                };
                match tokio::time::timeout(Duration::from_secs(10), got).await {
                    Ok(Some(stream)) => {
                        first.record(opened.elapsed());
                        k = k
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        tokio::time::sleep(Duration::from_millis(500 + (k >> 33) % 1500)).await;
                        drop(stream);
                    }
                    _ => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        }));
    }
    write_for(&api, crs, run.peers_churn, &seq, &last).await?;
    for task in tasks {
        task.await?;
    }
    let _ = wait_until(
        "every stream on its CR's last write after the churn",
        Duration::from_secs(30),
        || on_last(&recorder) == n,
    )
    .await;
    let churn_lost = n - on_last(&recorder);

    // A CR deleted, then created again with a stamp of its own (by the admin: the writer
    // may only patch).
    let api = admin;
    let mine: Vec<usize> = (0..n).filter(|i| i % crs == 0).collect();
    let held = |r: &Recorder, want: u64| {
        mine.iter()
            .all(|&i| r.last_seq[i].load(Ordering::Relaxed) == want)
    };
    api.delete(&name(0), &DeleteParams::default()).await?;
    let deleted = Instant::now();
    let deleted_seconds = wait_until(
        "the deleted CR's streams without its flags",
        Duration::from_secs(30),
        || held(&recorder, 0),
    )
    .await
    .ok()
    .map(|_| deleted.elapsed().as_secs_f64());
    let again = seq.fetch_add(1, Ordering::Relaxed) + 1;
    let mut flag = crate::fixtures::flag(&name(0), run.payload_bytes);
    flag["spec"]["flagSpec"]["metadata"]["seq"] = json!(again);
    flag["spec"]["flagSpec"]["metadata"]["sentAt"] = json!(clients::now_nanos());
    flag["spec"]["flagSpec"]["metadata"]["flagSetId"] = json!(name(0));
    let created = Instant::now();
    api.create(&PostParams::default(), &serde_json::from_value(flag)?)
        .await?;
    let recreated_seconds = wait_until(
        "the re-created CR at its streams",
        Duration::from_secs(30),
        || held(&recorder, again),
    )
    .await
    .ok()
    .map(|_| created.elapsed().as_secs_f64());

    trigger.stop();
    let errors = recorder.errors.load(Ordering::Relaxed);
    let exited = target
        .exited()
        .map(|status| format!("{status}; its log: {}", log_tail(&dir, server)));
    target.stop().await;
    tokio::task::spawn_blocking(move || drop(plane)).await?;
    Ok(Row {
        server: server.to_string(),
        streams: n,
        crs,
        ready_seconds,
        first_cold: cold.summary(),
        first_warm: warm.summary(),
        rss_base_bytes,
        rss_idle_bytes,
        api_watches,
        api_requests,
        api_cpu_writes_cores,
        server_cpu_writes_cores,
        writes: seq.load(Ordering::Relaxed),
        write_to_all,
        lost,
        errors,
        churn_streams: churn_first.summary().count + churn_errors.load(Ordering::Relaxed),
        churn_first: churn_first.summary(),
        churn_errors: churn_errors.load(Ordering::Relaxed),
        churn_lost,
        deleted_seconds,
        recreated_seconds,
        exited,
    })
}

/// One write per second per CR for `how_long`, each stamping the next seq and the time it was
/// sent into the CR's flag-set metadata; `last` holds each CR's last seq.
async fn write_for(
    api: &Api<DynamicObject>,
    crs: usize,
    how_long: Duration,
    seq: &AtomicU64,
    last: &[AtomicU64],
) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while started.elapsed() < how_long {
        tick.tick().await;
        let mut batch = Vec::with_capacity(crs);
        for (k, last) in last.iter().enumerate().take(crs) {
            let s = seq.fetch_add(1, Ordering::Relaxed) + 1;
            last.store(s, Ordering::Relaxed);
            let patch = json!({ "spec": { "flagSpec": { "metadata": {
                "seq": s, "sentAt": clients::now_nanos() } } } });
            let api = api.clone();
            batch.push(tokio::spawn(async move {
                api.patch(&name(k), &PatchParams::default(), &Patch::Merge(patch))
                    .await
            }));
        }
        for write in batch {
            write.await??;
        }
    }
    Ok(())
}

/// A peer's log in `dir`, shortened: from its first `fatal error` or `panic` line (a Go crash)
/// the next 12 lines, else its last 8 (the broker logs to the harness's own stderr).
fn log_tail(dir: &tempfile_like::Dir, server: &str) -> String {
    let text =
        std::fs::read_to_string(dir.path().join(format!("{server}.log"))).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let from = lines
        .iter()
        .position(|l| l.starts_with("fatal error") || l.starts_with("panic"))
        .unwrap_or(lines.len().saturating_sub(8));
    lines[from..(from + 12).min(lines.len())].join(" | ")
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Memory the streams added to the server, per stream, in KiB.
fn per_stream_kib(r: &Row) -> f64 {
    r.rss_idle_bytes.saturating_sub(r.rss_base_bytes) as f64 / 1024.0 / r.streams.max(1) as f64
}

fn seconds(s: Option<f64>) -> String {
    s.map_or_else(
        || "never (30 s)".into(),
        |s| format!("{:.0} ms", s * 1000.0),
    )
}

/// The peers the broker is compared with, in the order their ratios are shown.
pub const PEERS: [&str; 2] = ["flagd-proxy", "flagd"];

/// crd-broker ÷ a peer at one number of streams: below 1, the broker is ahead.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    /// The peer: `flagd-proxy` or `flagd`.
    pub peer: String,
    /// Streams.
    pub streams: usize,
    /// Write → every stream, p50 and p99.
    pub write_p50: f64,
    pub write_p99: f64,
    /// First message, cold and warm, p50.
    pub first_cold_p50: f64,
    pub first_warm_p50: f64,
    /// Memory per idle stream.
    pub memory_per_stream: f64,
    /// The API server's FeatureFlag watches, and its requests.
    pub api_watches: f64,
    pub api_requests: f64,
    /// The API server's CPU under the writes.
    pub api_cpu: f64,
    /// The server's own CPU under the writes.
    pub server_cpu: f64,
    /// First message of a churning stream, p99.
    pub churn_first_p99: f64,
}

/// crd-broker ÷ `peer` at every number of streams the rows have both for.
pub fn ratios(p: &Peers, peer: &str) -> Vec<Ratio> {
    let q = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let mut out = Vec::new();
    for f in p.rows.iter().filter(|r| r.server == peer) {
        for b in p
            .rows
            .iter()
            .filter(|r| r.server == "crd-broker" && r.streams == f.streams)
        {
            out.push(Ratio {
                peer: peer.to_string(),
                streams: f.streams,
                write_p50: q(b.write_to_all.p50_ms, f.write_to_all.p50_ms),
                write_p99: q(b.write_to_all.p99_ms, f.write_to_all.p99_ms),
                first_cold_p50: q(b.first_cold.p50_ms, f.first_cold.p50_ms),
                first_warm_p50: q(b.first_warm.p50_ms, f.first_warm.p50_ms),
                memory_per_stream: q(per_stream_kib(b), per_stream_kib(f)),
                api_watches: q(b.api_watches, f.api_watches),
                api_requests: q(b.api_requests, f.api_requests),
                api_cpu: q(b.api_cpu_writes_cores, f.api_cpu_writes_cores),
                server_cpu: q(b.server_cpu_writes_cores, f.server_cpu_writes_cores),
                churn_first_p99: q(b.churn_first.p99_ms, f.churn_first.p99_ms),
            });
        }
    }
    out
}

/// The ratio table against `peer`, header first; empty without rows for both.
pub fn ratio_table(p: &Peers, peer: &str) -> String {
    let ratios = ratios(p, peer);
    if ratios.is_empty() {
        return String::new();
    }
    let mut s = format!(
        "| crd-broker ÷ {peer} (same run; below 1: the broker is ahead) | write → every stream p50 | p99 | first message cold p50 | warm p50 | memory per idle stream | API watches | API requests | API CPU under writes | server CPU under writes | churn first message p99 |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    for r in ratios {
        s += &format!(
            "| {} streams | {:.2}× | {:.2}× | {:.2}× | {:.2}× | {:.2}× | {:.2}× | {:.2}× | {:.2}× | {:.2}× | {:.2}× |\n",
            r.streams,
            r.write_p50,
            r.write_p99,
            r.first_cold_p50,
            r.first_warm_p50,
            r.memory_per_stream,
            r.api_watches,
            r.api_requests,
            r.api_cpu,
            r.server_cpu,
            r.churn_first_p99
        );
    }
    s
}

/// The markdown section: every row, then crd-broker ÷ each peer at each number of streams.
pub fn markdown(p: &Peers) -> String {
    let mut s = format!(
        "### Beside the real peers: stock flagd-proxy, and the flagd daemon as a relay (a real kube-apiserver)\n\nEach row on a control plane of its own, one connection per stream; idle {:.0} s, one write per second per CR for {:.0} s, then {:.0} s of churn with the writes going on, then a CR deleted and created again. `flagd-proxy`: stock flagd-proxy v0.9.7, built from its sources. `flagd`: flagd v0.16.0 with a Kubernetes source per CR, its sync server taking the streams.\n\n| server | streams | CRs | first message cold / warm p50 | memory per idle stream | API watches | API requests | API CPU under writes | server CPU under writes | write → every stream p50 / p99 | lost | churn: streams, first p99, failed, lost | deleted CR seen / re-created seen |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        p.idle_seconds, p.write_seconds, p.churn_seconds
    );
    for r in &p.rows {
        s += &format!(
            "| {} | {} | {} | {:.1} / {:.1} ms | {:.1} KiB ({:.0} → {:.0} MiB) | {:.0} | {:.0} | {:.3} cores | {:.3} cores | {:.1} / {:.1} ms | {} | {}, {:.1} ms, {}, {} | {} / {} |\n",
            r.server,
            r.streams,
            r.crs,
            r.first_cold.p50_ms,
            r.first_warm.p50_ms,
            per_stream_kib(r),
            mib(r.rss_base_bytes),
            mib(r.rss_idle_bytes),
            r.api_watches,
            r.api_requests,
            r.api_cpu_writes_cores,
            r.server_cpu_writes_cores,
            r.write_to_all.p50_ms,
            r.write_to_all.p99_ms,
            r.lost,
            r.churn_streams,
            r.churn_first.p99_ms,
            r.churn_errors,
            r.churn_lost,
            seconds(r.deleted_seconds),
            seconds(r.recreated_seconds),
        );
    }
    for r in p.rows.iter().filter(|r| r.exited.is_some()) {
        s += &format!(
            "\n{} at {} streams ended before its row did: {}\n",
            r.server,
            r.streams,
            r.exited.as_deref().unwrap_or_default().replace('|', "/")
        );
    }
    for peer in PEERS {
        let table = ratio_table(p, peer);
        if !table.is_empty() {
            s += "\n";
            s += &table;
        }
    }
    s + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two runs in docs/performance.md, as the harness wrote them.
    fn documented() -> [Peers; 2] {
        let runs = [
            include_str!("../../../docs/performance/peers-1.json"),
            include_str!("../../../docs/performance/peers-2.json"),
        ];
        runs.map(|text| {
            let run: serde_json::Value = serde_json::from_str(text).unwrap();
            serde_json::from_value(run["peers"].clone()).unwrap()
        })
    }

    #[test]
    fn the_documented_runs_are_the_tables_in_performance_md() {
        let doc = include_str!("../../../docs/performance.md");
        for run in documented() {
            let servers: Vec<&str> = run.rows.iter().map(|r| r.server.as_str()).collect();
            assert_eq!(
                servers,
                [
                    "flagd-proxy",
                    "flagd",
                    "crd-broker",
                    "flagd-proxy",
                    "flagd",
                    "crd-broker"
                ]
            );
            for peer in PEERS {
                let ratios = ratios(&run, peer);
                assert_eq!(
                    ratios.iter().map(|r| r.streams).collect::<Vec<_>>(),
                    [1_000, 10_000]
                );
                for r in &ratios {
                    // One watch per CR through each.
                    assert_eq!(r.api_watches, 1.0, "{peer}");
                }
            }
            for line in markdown(&run).lines().filter(|l| l.starts_with("| ")) {
                assert!(
                    doc.contains(line),
                    "docs/performance.md lacks the line the run renders:\n{line}"
                );
            }
        }
    }

    #[test]
    fn the_readme_and_the_migration_guide_show_the_second_runs_ratios_to_flagd_proxy() {
        let [_, second] = documented();
        let table = ratio_table(&second, "flagd-proxy");
        let lines: Vec<&str> = table.lines().filter(|l| !l.starts_with("|---")).collect();
        assert_eq!(
            lines.len(),
            3,
            "the header and a line per number of streams"
        );
        for (name, doc) in [
            ("README.md", include_str!("../../../README.md")),
            (
                "docs/migrating-from-flagd-proxy.md",
                include_str!("../../../docs/migrating-from-flagd-proxy.md"),
            ),
        ] {
            for line in &lines {
                assert!(
                    doc.contains(line),
                    "{name} lacks the line run 2 renders:\n{line}"
                );
            }
        }
    }
}
