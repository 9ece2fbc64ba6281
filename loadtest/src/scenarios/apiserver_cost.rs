//! Scenario `apiserver-cost`: what N sidecars that each need one of M CRs cost a real
//! kube-apiserver, when each watches its CR itself (`direct`, [`crate::direct`]), through one
//! broker (`broker`) and through three replicas (`replicas`, sidecar `i` on replica `i % 3`, as
//! round-robin balancing spreads them). Each row runs on a control plane of its own
//! (`scripts/control-plane`), so that one row's memory does not carry into the next: the CRs
//! are created, the sidecars connect and get their first state, then the API server is watched
//! idle, then under one write per second per CR, by a writer of its own Priority and Fairness
//! flow schema (so that the seats the server estimates for a write are the writer's alone).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use control_plane::ControlPlane;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::Run;
use crate::clients::{self, Recorder, tokio_util_like};
use crate::fixtures::{
    WRITER_FLOW, apiserver, firsts, name, own_plane, real_world, tempfile_like, wait_until,
};
use crate::stats::{self, Summary};
use crate::target::{Log, Target};

/// One mode at one N.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// `direct`, `broker` or `replicas`.
    pub mode: String,
    /// Sidecars.
    pub sidecars: usize,
    /// Distinct CRs they need.
    pub crs: usize,
    /// Seconds from the first connection until every sidecar had its first state.
    pub ready_seconds: f64,
    /// WATCH requests the API server serves on FeatureFlags (`apiserver_longrunning_requests`).
    pub watches: f64,
    /// TCP connections the API server holds (its established sockets on its port).
    pub connections: usize,
    /// The API server's resident memory with the CRs and no client.
    pub rss_base_bytes: u64,
    /// Its resident memory after the idle period.
    pub rss_idle_bytes: u64,
    /// Its largest resident memory while the writes went on.
    pub rss_writes_peak_bytes: u64,
    /// Its CPU while idle, in cores (CPU seconds per second).
    pub cpu_idle_cores: f64,
    /// Its CPU under the writes, in cores.
    pub cpu_writes_cores: f64,
    /// The brokers' resident memory together (0 for `direct`).
    pub brokers_rss_bytes: u64,
    /// The brokers' CPU under the writes, in cores together.
    pub brokers_cpu_writes_cores: f64,
    /// Writes made.
    pub writes: u64,
    /// Per write: from the write until every sidecar of its CR had it.
    pub write_to_all: Summary,
    /// Sidecars not on their CR's last write 30 s after it.
    pub lost: usize,
    /// Sidecar streams that ended with an error.
    pub errors: u64,
    /// Times a direct sidecar started over after an error (a 429 from Priority and Fairness
    /// while the others connect, among others), as client-go's reflector does.
    pub retries: u64,
    /// Seats the server estimated for one write, on average (`apiserver_flowcontrol_work_estimated_seats`).
    pub seats_per_write: f64,
    /// Watchers the server counted for one write, on average (`apiserver_flowcontrol_watch_count_samples`).
    pub watchers_per_write: f64,
}

/// Every row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiserverCost {
    /// Seconds of the idle period.
    pub idle_seconds: f64,
    /// Seconds of writes.
    pub write_seconds: f64,
    /// By N, then mode.
    pub rows: Vec<Row>,
}

const NAMESPACE: &str = "default";

/// Runs every mode at every N.
pub async fn apiserver_cost(run: &Run) -> anyhow::Result<ApiserverCost> {
    let mut rows = Vec::new();
    for &n in &run.cost_sidecars {
        for mode in &run.cost_modes {
            eprintln!(
                "apiserver-cost: {mode}, {n} sidecars on {} CRs",
                run.cost_crs
            );
            rows.push(
                row(run, mode, n)
                    .await
                    .with_context(|| format!("{mode} with {n} sidecars"))?,
            );
        }
    }
    Ok(ApiserverCost {
        idle_seconds: run.cost_idle.as_secs_f64(),
        write_seconds: run.cost_writes.as_secs_f64(),
        rows,
    })
}

/// The API server's FeatureFlag watches now.
async fn watches(plane: &ControlPlane) -> f64 {
    plane
        .open_watches("core.openfeature.dev", "featureflags")
        .await
}

/// The writer's seats and watch-count samples so far: (seats sum, seats count, watchers sum,
/// watchers count).
async fn apf(plane: &ControlPlane) -> [f64; 4] {
    let m = plane.metrics().await;
    let flow = [("flow_schema", WRITER_FLOW)];
    [
        "apiserver_flowcontrol_work_estimated_seats_sum",
        "apiserver_flowcontrol_work_estimated_seats_count",
        "apiserver_flowcontrol_watch_count_samples_sum",
        "apiserver_flowcontrol_watch_count_samples_count",
    ]
    .map(|name| control_plane::total(&m, name, &flow))
}

async fn row(run: &Run, mode: &str, n: usize) -> anyhow::Result<Row> {
    let crs = run.cost_crs;
    let plane = own_plane().await?;
    real_world(&plane, crs, run.payload_bytes).await?;
    let (pid, port) = apiserver(&plane)?;
    let dir = tempfile_like::Dir::new()?;
    let ca = plane.dir.join("pki/ca.crt");
    let rss_base_bytes = stats::rss(pid);

    let writes_planned = crs * (run.cost_writes.as_secs() as usize + 1);
    let recorder = Recorder::new(n, writes_planned + 1);
    let (trigger, stop) = tokio_util_like::signal();
    let started = Instant::now();
    let mut brokers = Vec::new();
    match mode {
        "direct" => {
            let token = plane.token(NAMESPACE, "sidecar", &[], None).await;
            let collection =
                format!("/apis/core.openfeature.dev/v1beta1/namespaces/{NAMESPACE}/featureflags");
            let api = Arc::new(crate::direct::Api::new(
                &plane.server,
                &ca,
                token,
                &collection,
            )?);
            let by_name = |i: usize| crate::direct::by_name(&name(i % crs));
            crate::direct::start(api, n, by_name, &recorder, &stop).await;
        }
        "broker" | "replicas" => {
            let replicas = if mode == "broker" { 1 } else { 3 };
            let kubeconfig = plane
                .kubeconfig_for(NAMESPACE, "broker", dir.path(), &plane.server)
                .await;
            let bin = crate::target::broker_bin(run.broker_bin.clone())?;
            for _ in 0..replicas {
                brokers.push(
                    Target::broker_logging(
                        &bin,
                        &kubeconfig,
                        Duration::from_secs(30),
                        &[],
                        Log::Inherit,
                    )
                    .await?,
                );
            }
            for (r, broker) in brokers.iter().enumerate() {
                let mine: Vec<usize> = (0..n).filter(|i| i % replicas == r).collect();
                // One connection per sidecar, as each pod has its own.
                let channels = clients::connections(broker.grpc, mine.len(), run.sources).await?;
                for (channel, i) in channels.into_iter().zip(mine) {
                    tokio::spawn(clients::subscribe(
                        channel,
                        name(i % crs),
                        i,
                        true,
                        recorder.clone(),
                        stop.clone(),
                    ));
                }
            }
        }
        other => anyhow::bail!("no mode {other} (direct, broker, replicas)"),
    }
    let recorder_ = recorder.clone();
    wait_until(
        "every sidecar's first state",
        Duration::from_secs(600),
        || firsts(&recorder_) >= n as u64 || recorder_.errors.load(Ordering::Relaxed) > 0,
    )
    .await?;
    anyhow::ensure!(
        recorder.errors.load(Ordering::Relaxed) == 0,
        "{} sidecars failed before their first state",
        recorder.errors.load(Ordering::Relaxed)
    );
    let ready_seconds = started.elapsed().as_secs_f64();
    // Let the connection bursts and their goroutines settle before the idle period.
    tokio::time::sleep(Duration::from_secs(5)).await;

    let cpu = || stats::cpu(pid).as_secs_f64();
    let brokers_cpu =
        |brokers: &[Target]| -> f64 { brokers.iter().map(|b| b.cpu().as_secs_f64()).sum() };
    let before = cpu();
    tokio::time::sleep(run.cost_idle).await;
    let cpu_idle_cores = (cpu() - before) / run.cost_idle.as_secs_f64();
    let rss_idle_bytes = stats::rss(pid);
    let open_watches = watches(&plane).await;
    let connections = stats::sockets(pid, "01", stats::End::Local, port);
    let brokers_rss_bytes = brokers.iter().map(Target::rss).sum();

    // One write per second per CR, each stamping its seq and the time it was sent.
    let writer = control_plane::client_from(
        &plane
            .kubeconfig_for(NAMESPACE, "writer", dir.path(), &plane.server)
            .await,
    )
    .await;
    let api: Api<DynamicObject> =
        Api::namespaced_with(writer, NAMESPACE, &crate::fixtures::featureflags());
    let apf_before = apf(&plane).await;
    let (cpu_before, brokers_before) = (cpu(), brokers_cpu(&brokers));
    let mut last = vec![0u64; crs];
    let mut seq = 0u64;
    let mut rss_writes_peak_bytes = 0;
    let writes_started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while writes_started.elapsed() < run.cost_writes {
        tick.tick().await;
        let mut batch = Vec::with_capacity(crs);
        for (k, last) in last.iter_mut().enumerate() {
            seq += 1;
            *last = seq;
            let patch = json!({ "spec": { "flagSpec": { "metadata": {
                "seq": seq, "sentAt": clients::now_nanos() } } } });
            let api = api.clone();
            batch.push(tokio::spawn(async move {
                api.patch(&name(k), &PatchParams::default(), &Patch::Merge(patch))
                    .await
            }));
        }
        for write in batch {
            write.await??;
        }
        rss_writes_peak_bytes = rss_writes_peak_bytes.max(stats::rss(pid));
    }
    let write_seconds = writes_started.elapsed().as_secs_f64();
    let cpu_writes_cores = (cpu() - cpu_before) / write_seconds;
    let brokers_cpu_writes_cores = (brokers_cpu(&brokers) - brokers_before) / write_seconds;
    let on_last = |r: &Recorder| {
        (0..n)
            .filter(|&i| r.last_seq[i].load(Ordering::Relaxed) == last[i % crs])
            .count()
    };
    let _ = wait_until(
        "every sidecar on its CR's last write",
        Duration::from_secs(30),
        || on_last(&recorder) == n,
    )
    .await;
    let apf_after = apf(&plane).await;
    let delta = |i: usize| apf_after[i] - apf_before[i];
    let mean = |sum: f64, count: f64| if count > 0.0 { sum / count } else { 0.0 };

    // Errors while measuring: read before the teardown, where a stream that sees its broker
    // go before its task sees the stop would count one.
    let errors = recorder.errors.load(Ordering::Relaxed);
    trigger.stop();
    for broker in brokers {
        broker.stop().await;
    }
    tokio::task::spawn_blocking(move || drop(plane)).await?;
    Ok(Row {
        mode: mode.to_string(),
        sidecars: n,
        crs,
        ready_seconds,
        watches: open_watches,
        connections,
        rss_base_bytes,
        rss_idle_bytes,
        rss_writes_peak_bytes,
        cpu_idle_cores,
        cpu_writes_cores,
        brokers_rss_bytes,
        brokers_cpu_writes_cores,
        writes: seq,
        write_to_all: recorder.completions().summary(),
        lost: n - on_last(&recorder),
        errors,
        retries: recorder.retries.load(Ordering::Relaxed),
        seats_per_write: mean(delta(0), delta(1)),
        watchers_per_write: mean(delta(2), delta(3)),
    })
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The markdown section: every row, then direct ÷ broker and direct ÷ replicas at each N.
pub fn markdown(c: &ApiserverCost) -> String {
    let mut s = format!(
        "### What the broker saves the API server (a real kube-apiserver)\n\nEach row on a control plane of its own; idle {:.0} s, then one write per second per CR for {:.0} s. `direct`: each sidecar lists and watches its CR itself (own TLS connection, HTTP/2, a token of its own).\n\n| mode | sidecars | CRs | watches | connections | API server memory (base → idle → peak under writes) | API server CPU idle / writes (cores) | write → every sidecar p50 / p99 | seats / watchers per write | brokers' memory | lost | sidecar retries |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        c.idle_seconds, c.write_seconds
    );
    for r in &c.rows {
        s += &format!(
            "| {} | {} | {} | {:.0} | {} | {:.0} → {:.0} → {:.0} MiB | {:.3} / {:.3} | {:.1} / {:.1} ms | {:.1} / {:.1} | {:.0} MiB | {} | {} |\n",
            r.mode,
            r.sidecars,
            r.crs,
            r.watches,
            r.connections,
            mib(r.rss_base_bytes),
            mib(r.rss_idle_bytes),
            mib(r.rss_writes_peak_bytes),
            r.cpu_idle_cores,
            r.cpu_writes_cores,
            r.write_to_all.p50_ms,
            r.write_to_all.p99_ms,
            r.seats_per_write,
            r.watchers_per_write,
            mib(r.brokers_rss_bytes),
            r.lost,
            r.retries
        );
    }
    let ratios = ratios(c);
    if !ratios.is_empty() {
        s += "\n| ratio (same run) | sidecars | watches | connections | memory idle | memory the clients added | peak memory under writes | CPU idle | CPU under writes | write → every sidecar p99 |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
        for r in ratios {
            s += &format!(
                "| direct ÷ {} | {} | {:.0}× | {:.0}× | {:.2}× | {:.0} vs {:.0} MiB | {:.2}× | {:.2}× | {:.2}× | {:.2}× |\n",
                r.versus,
                r.sidecars,
                r.watches,
                r.connections,
                r.memory_idle,
                mib(r.memory_added.0),
                mib(r.memory_added.1),
                r.peak_memory,
                r.cpu_idle,
                r.cpu_writes,
                r.latency_p99
            );
        }
    }
    s + "\n"
}

/// Direct ÷ a broker mode at one N.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    /// `broker` or `replicas`.
    pub versus: String,
    /// N.
    pub sidecars: usize,
    /// API watches.
    pub watches: f64,
    /// API server connections.
    pub connections: f64,
    /// The API server's memory after the idle period.
    pub memory_idle: f64,
    /// Memory the clients added to the API server (idle − base), direct and through brokers,
    /// in bytes: the broker's is near zero, so a ratio would say little.
    pub memory_added: (u64, u64),
    /// Peak memory under writes.
    pub peak_memory: f64,
    /// CPU while idle.
    pub cpu_idle: f64,
    /// CPU under writes.
    pub cpu_writes: f64,
    /// Write → every sidecar, p99 (direct ÷ broker: below 1, direct is faster).
    pub latency_p99: f64,
}

/// Every direct ÷ broker-mode ratio the rows allow.
pub fn ratios(c: &ApiserverCost) -> Vec<Ratio> {
    let q = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let added = |r: &Row| r.rss_idle_bytes.saturating_sub(r.rss_base_bytes);
    let mut out = Vec::new();
    for d in c.rows.iter().filter(|r| r.mode == "direct") {
        for b in c
            .rows
            .iter()
            .filter(|r| r.mode != "direct" && r.sidecars == d.sidecars)
        {
            out.push(Ratio {
                versus: b.mode.clone(),
                sidecars: d.sidecars,
                watches: q(d.watches, b.watches),
                connections: q(d.connections as f64, b.connections as f64),
                memory_idle: q(d.rss_idle_bytes as f64, b.rss_idle_bytes as f64),
                memory_added: (added(d), added(b)),
                peak_memory: q(
                    d.rss_writes_peak_bytes as f64,
                    b.rss_writes_peak_bytes as f64,
                ),
                cpu_idle: q(d.cpu_idle_cores, b.cpu_idle_cores),
                cpu_writes: q(d.cpu_writes_cores, b.cpu_writes_cores),
                latency_p99: q(d.write_to_all.p99_ms, b.write_to_all.p99_ms),
            });
        }
    }
    out
}

/// Two panels: the API server's peak memory and its CPU under writes, against N, a line per
/// mode.
pub fn plot(path: &std::path::Path, c: &ApiserverCost) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let with_text = crate::plot::text();
    let root = BitMapBackend::new(path, (1100, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    let colors = [
        ("direct", RGBColor(200, 40, 40)),
        ("broker", RGBColor(40, 40, 200)),
        ("replicas", RGBColor(0, 150, 150)),
    ];
    let max_n = c.rows.iter().map(|r| r.sidecars).max().unwrap_or(1) as f64;
    let min_n = c.rows.iter().map(|r| r.sidecars).min().unwrap_or(1) as f64;
    type Measure = fn(&Row) -> f64;
    let measures: [(&str, &str, Measure); 2] = [
        ("API server peak memory under writes", "MiB", |r| {
            mib(r.rss_writes_peak_bytes)
        }),
        ("API server CPU under writes", "cores", |r| {
            r.cpu_writes_cores
        }),
    ];
    for (panel, (title, unit, measure)) in panels.iter().zip(measures) {
        let top = c.rows.iter().map(measure).fold(0.0f64, f64::max) * 1.15;
        let mut builder = ChartBuilder::on(panel);
        builder
            .margin(20)
            .x_label_area_size(45)
            .y_label_area_size(60);
        if with_text {
            builder.caption(title, ("sans-serif", 20));
        }
        let ns: Vec<f64> = c.rows.iter().map(|r| r.sidecars as f64).collect();
        let across = (min_n * 0.8..max_n * 1.25).log_scale().with_key_points(ns);
        let mut chart = builder.build_cartesian_2d(across, 0f64..top.max(0.01))?;
        let mut mesh = chart.configure_mesh();
        mesh.light_line_style(WHITE)
            .x_label_formatter(&|n| format!("{n:.0}"))
            .y_label_formatter(&|v| format!("{v:.1}"));
        if with_text {
            mesh.x_desc("sidecars (log)").y_desc(unit);
        } else {
            mesh.disable_x_mesh().disable_y_mesh();
        }
        mesh.draw()?;
        for (mode, color) in colors {
            let points: Vec<(f64, f64)> = c
                .rows
                .iter()
                .filter(|r| r.mode == mode)
                .map(|r| (r.sidecars as f64, measure(r)))
                .collect();
            if points.is_empty() {
                continue;
            }
            let style = ShapeStyle::from(color).stroke_width(2);
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, style.filled())))?;
            let drawn = chart.draw_series(LineSeries::new(points, style))?;
            if with_text {
                drawn.label(mode).legend(crate::plot::mark(color));
            }
        }
        if with_text {
            crate::plot::legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
        }
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The run in docs/performance.md, as the harness wrote it.
    fn documented() -> ApiserverCost {
        let text = include_str!("../../../docs/performance/apiserver-cost.json");
        let run: serde_json::Value = serde_json::from_str(text).unwrap();
        serde_json::from_value(run["apiserver_cost"].clone()).unwrap()
    }

    #[test]
    fn the_documented_run_gives_direct_over_broker_at_each_n() {
        let c = documented();
        let ratios = ratios(&c);
        let at = |versus: &str, n: usize| {
            ratios
                .iter()
                .find(|r| r.versus == versus && r.sidecars == n)
                .unwrap()
                .clone()
        };
        assert_eq!(ratios.len(), 6);
        // One watch per sidecar against one per CR (and replica).
        assert_eq!(at("broker", 5_000).watches, 50.0);
        assert!((at("replicas", 5_000).watches - 16.67).abs() < 0.01);
        let table = markdown(&c);
        assert!(
            table.contains("| direct ÷ broker | 5000 | 50× | 1667× |"),
            "{table}"
        );
    }

    #[test]
    fn the_plot_is_drawn_for_the_documented_run() {
        let path = std::env::temp_dir().join(format!("apiserver-cost-{}.png", std::process::id()));
        plot(&path, &documented()).unwrap();
        let png = std::fs::read(&path).unwrap();
        assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000);
        std::fs::remove_file(&path).unwrap();
    }
}
