//! `crd-broker-loadtest soak`: a long random mix of API-server faults under many subscribers,
//! with concurrent writes and deletes, then the checks the broker promises. Every subscriber ends
//! on its CR's final state, soon after the last write. There is one watch per CR, and none once
//! everyone has left. Tasks do not leak, memory does not grow, and readiness does not flap.
//!
//! The faults are sequential episodes. After each one ends, a probe write to a CR that is never
//! deleted is timed until every subscriber of that CR holds it: that is the fault's convergence
//! time. The fault schedule, the writer's choices and the final states all come from `--seed`.
//!
//! With `--real` the API server is a real control plane (`scripts/control-plane`) and the faults
//! are the ones real clusters have ([`cluster`]).

mod cluster;
mod faults;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use crd_broker::pb;
use crd_broker::pb::subscribe_response::Event;
use serde::Serialize;
use tonic::transport::Channel;

use self::cluster::{Cluster, Real, Truth};
use self::faults::{FAULTS, Fault, REAL_FAULTS};
use crate::clients;
use crate::fixtures::{fake, name, scrape};
use crate::stats::{self, Histogram, Summary};
use crate::target::{self, Target};

const PATH: &str = "/apis/core.openfeature.dev/v1beta1/namespaces/default/featureflags";

/// What to run.
#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    /// Faults to inject, one after another.
    #[arg(long, default_value_t = 1_000)]
    pub faults: usize,
    /// Subscribers, spread evenly over the CRs.
    #[arg(long, default_value_t = 1_000)]
    pub subscribers: usize,
    /// FeatureFlags. A tenth of them are deleted and re-created now and then.
    #[arg(long, default_value_t = 50)]
    pub crs: usize,
    /// Connections the subscribers share.
    #[arg(long, default_value_t = 100)]
    pub connections: usize,
    /// Background writes per second, over all CRs.
    #[arg(long, default_value_t = 20.0)]
    pub write_rate: f64,
    /// The seed of the fault schedule, the writes and the final states (default: random, and
    /// printed so the run can be repeated).
    #[arg(long)]
    pub seed: Option<u64>,
    /// A short run for CI: 100 subscribers on 10 CRs, each kind of fault twice on the fake
    /// (26), once on a real control plane (7).
    #[arg(long)]
    pub smoke: bool,
    /// On a real kube-apiserver and etcd, started here (`scripts/control-plane`), with the
    /// faults a real cluster has: kube-apiserver killed (SIGKILL) or stopped (SIGTERM) and
    /// started again, etcd killed for 10–30 s, history compacted under the watches, Priority and
    /// Fairness rejecting the broker for 5–30 s, its RBAC revoked, the CRD deleted and
    /// re-created; and all along, HTTP/2 connections cut at random (`--goaway-chance`).
    #[arg(long)]
    pub real: bool,
    /// The broker binary (default: `crd-broker` next to this binary).
    #[arg(long)]
    pub broker_bin: Option<std::path::PathBuf>,
    /// Where to write `soak.json` and `soak.md`.
    #[arg(long, default_value = "target/loadtest")]
    pub out: std::path::PathBuf,
}

impl SoakArgs {
    fn sized(mut self) -> Self {
        if self.smoke {
            self.faults = match self.real {
                true => REAL_FAULTS.len(),
                false => 2 * FAULTS.len(),
            };
            self.subscribers = 100;
            self.crs = 10;
            self.connections = 10;
        }
        self.crs = self.crs.max(2);
        self
    }

    /// CRs `0..churn` are deleted and re-created by the writer; the rest only change.
    fn churn(&self) -> usize {
        (self.crs / 10).max(1)
    }
}

/// What one subscriber holds.
#[derive(Debug, Clone, Default, PartialEq)]
struct Held {
    present: bool,
    uid: String,
    rv: u64,
    messages: u64,
}

impl Truth {
    fn held_by(&self, held: &Held) -> bool {
        match self {
            Truth::Present { uid, rv } => held.present && held.uid == *uid && held.rv >= *rv,
            Truth::Absent => !held.present && held.messages > 0,
        }
    }
}

struct Subscribers {
    held: Vec<Mutex<Held>>,
    /// Subscriber `i` follows CR `i % crs`.
    crs: usize,
    stream_ends: AtomicU64,
    stop: AtomicBool,
}

impl Subscribers {
    fn held(&self, i: usize) -> Held {
        self.held[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn of_cr(&self, k: usize) -> impl Iterator<Item = usize> + '_ {
        (k..self.held.len()).step_by(self.crs)
    }

    fn all_hold(&self, k: usize, truth: &Truth) -> bool {
        self.of_cr(k).all(|i| truth.held_by(&self.held(i)))
    }
}

/// One subscriber: subscribes, records every message, and subscribes again if the stream ends.
async fn subscriber(subs: Arc<Subscribers>, i: usize, channel: Channel) {
    let cr = name(i % subs.crs);
    let mut client = pb::broker_client::BrokerClient::new(channel);
    while !subs.stop.load(Ordering::Relaxed) {
        let request = pb::SubscribeRequest {
            resources: vec![pb::ResourceRef {
                group: "core.openfeature.dev".into(),
                version: "v1beta1".into(),
                resource: "featureflags".into(),
                namespace: "default".into(),
                name: cr.clone(),
                ..Default::default()
            }],
        };
        if let Ok(response) = client.subscribe(request).await {
            let mut stream = response.into_inner();
            while let Ok(Some(m)) = stream.message().await {
                let mut held = subs.held[i].lock().unwrap_or_else(PoisonError::into_inner);
                held.messages += 1;
                match m.event() {
                    Event::Snapshot | Event::Updated => {
                        held.present = true;
                        held.uid = m.uid;
                        held.rv = m.resource_version.parse().unwrap_or(0);
                    }
                    Event::Deleted | Event::Absent => held.present = false,
                    Event::Failed
                    | Event::Unspecified
                    | Event::Added
                    | Event::Synced
                    | Event::Current => {}
                }
            }
        }
        if subs.stop.load(Ordering::Relaxed) {
            return;
        }
        subs.stream_ends.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Counts readiness flaps: `/readyz` answers that are not 200 after one that was.
async fn watch_readiness(admin: SocketAddr, stop: Arc<AtomicBool>) -> u64 {
    let mut flaps = 0;
    let mut was_ready = true;
    while !stop.load(Ordering::Relaxed) {
        let ready = readyz(admin).await;
        if was_ready && !ready {
            flaps += 1;
        }
        was_ready = ready;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    flaps
}

async fn readyz(admin: SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut tcp) = tokio::net::TcpStream::connect(admin).await else {
        return false;
    };
    let _ = tcp
        .write_all(b"GET /readyz HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
        .await;
    let mut text = String::new();
    let _ = tcp.read_to_string(&mut text).await;
    text.starts_with("HTTP/1.1 200")
}

/// The background writer: patches random CRs, and deletes and re-creates the churn CRs.
async fn writer(cluster: Arc<Cluster>, args: SoakArgs, seed: u64, stop: Arc<AtomicBool>) -> u64 {
    let mut rng = fastrand::Rng::with_seed(seed);
    let churn = args.churn();
    let mut writes = 0;
    let gap = Duration::from_secs_f64(1.0 / args.write_rate.max(0.1));
    while !stop.load(Ordering::Relaxed) {
        let k = rng.usize(..args.crs);
        let cr = name(k);
        let done = if k < churn && rng.u8(..4) == 0 {
            match cluster.truth(&cr).await {
                Truth::Present { .. } => cluster.delete(&cr).await,
                Truth::Absent => cluster.create(&cr).await,
            }
        } else {
            cluster.patch(&cr, writes).await.is_ok()
        };
        writes += u64::from(done);
        tokio::time::sleep(gap).await;
    }
    writes
}

/// Faults of one kind and how long the broker took to be current after each.
#[derive(Debug, Default, Serialize)]
pub struct KindReport {
    count: u64,
    converge: Summary,
    /// Probes not held by every subscriber within the bound.
    slow: u64,
}

/// What a soak measured.
#[derive(Debug, Serialize)]
pub struct SoakReport {
    /// `fake` or `real`.
    api_server: &'static str,
    seed: u64,
    faults: usize,
    subscribers: usize,
    crs: usize,
    writes: u64,
    duration_seconds: f64,
    by_fault: BTreeMap<Fault, KindReport>,
    /// From the last write after the faults stopped until every subscriber held its CR's final
    /// state.
    final_converge_ms: f64,
    /// Subscribers not on their CR's final state 30 s after the last write.
    lost: usize,
    /// CRs not watched by exactly one watch at the end (with their subscribers on); on a real
    /// API server, which counts watches by resource, how far the total is from one per CR.
    watches_not_one: usize,
    /// Watches open at the API server once everyone had left and the linger passed.
    watches_after_leaving: usize,
    /// Streams that ended and were opened again.
    stream_ends: u64,
    readiness_flaps: u64,
    rss_warm_bytes: u64,
    rss_after_bytes: u64,
    rss_growth: f64,
    tasks_before: f64,
    tasks_after: f64,
    /// TCP connections the broker held to the API server once everyone had left (its
    /// readiness check keeps one in use).
    api_connections_after: usize,
    /// On a real control plane: times kube-apiserver or etcd did not start again at the first
    /// try after a fault (the machine's, not the broker's; each did at the second).
    plane_starts_retried: u64,
}

impl SoakReport {
    fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.lost > 0 {
            out.push(format!("{} subscribers lost their final state", self.lost));
        }
        if self.final_converge_ms > 5_000.0 {
            out.push(format!(
                "converged {:.0} ms after the last write (goal 5 s)",
                self.final_converge_ms
            ));
        }
        if self.watches_not_one > 0 {
            out.push(format!(
                "{} CRs without exactly one watch",
                self.watches_not_one
            ));
        }
        if self.watches_after_leaving > 0 {
            out.push(format!(
                "{} watches left after everyone left",
                self.watches_after_leaving
            ));
        }
        if self.rss_growth > 1.2 {
            out.push(format!("RSS grew {:.2}× (goal ≤ 1.2×)", self.rss_growth));
        }
        if self.tasks_after > self.tasks_before + 5.0 {
            out.push(format!(
                "{} runtime tasks after, {} before",
                self.tasks_after, self.tasks_before
            ));
        }
        out
    }

    fn markdown(&self) -> String {
        let mut md = format!(
            "## Fault soak on {} (seed {})\n\n{} faults, {} subscribers on {} CRs, {} background writes, {:.0} s.\n\n\
             | fault | count | converge p50 | p99 | max | slow |\n|---|---:|---:|---:|---:|---:|\n",
            match self.api_server {
                "real" => "a real kube-apiserver and etcd",
                _ => "the fake API server",
            },
            self.seed,
            self.faults,
            self.subscribers,
            self.crs,
            self.writes,
            self.duration_seconds
        );
        for (fault, r) in &self.by_fault {
            md.push_str(&format!(
                "| {} | {} | {:.0} ms | {:.0} ms | {:.0} ms | {} |\n",
                serde_json::to_value(fault)
                    .unwrap_or_default()
                    .as_str()
                    .unwrap_or("?"),
                r.count,
                r.converge.p50_ms,
                r.converge.p99_ms,
                r.converge.max_ms,
                r.slow
            ));
        }
        md.push_str(&format!(
            "\n- final states held {:.0} ms after the last write; lost {}\n\
             - CRs without exactly one watch: {}; watches after everyone left: {}\n\
             - streams ended and reopened: {}; readiness flaps: {}\n\
             - RSS {:.1} MiB after warm-up, {:.1} MiB after the faults ({:.2}×)\n\
             - runtime tasks {} before the subscribers, {} after they left; \
             connections to the API server after they left: {}\n\
             - control-plane components started a second time after a fault: {}\n",
            self.final_converge_ms,
            self.lost,
            self.watches_not_one,
            self.watches_after_leaving,
            self.stream_ends,
            self.readiness_flaps,
            self.rss_warm_bytes as f64 / 1048576.0,
            self.rss_after_bytes as f64 / 1048576.0,
            self.rss_growth,
            self.tasks_before,
            self.tasks_after,
            self.api_connections_after,
            self.plane_starts_retried,
        ));
        md
    }
}

async fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done() {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    done().then(|| start.elapsed())
}

/// Waits until `done` (asked every 100 ms) or `limit` has passed: whether it was.
async fn eventually(limit: Duration, mut done: impl AsyncFnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if done().await {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs the soak and writes its report; fails if a promise was broken.
pub async fn soak(args: SoakArgs) -> anyhow::Result<()> {
    let args = args.sized();
    stats::raise_fd_limit();
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
    println!("soak: seed {seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let bin = target::broker_bin(args.broker_bin.clone())?;
    let dir = crate::fixtures::tempfile_like::Dir::new()?;
    let (cluster, kubeconfig, _fake_dir) = match args.real {
        false => {
            let (fake, fake_dir) = fake(args.crs, 256).await?;
            let kubeconfig = fake_dir.path().join("kubeconfig");
            (Cluster::Fake(Arc::new(fake)), kubeconfig, Some(fake_dir))
        }
        true => {
            let real = Real::start(args.crs).await?;
            let kubeconfig = real
                .plane
                .kubeconfig_for("default", "broker", dir.path(), &real.plane.server)
                .await;
            (Cluster::Real(Box::new(real)), kubeconfig, None)
        }
    };
    let cluster = Arc::new(cluster);
    let linger = Duration::from_secs(1);
    std::fs::create_dir_all(&args.out)?;
    let log = std::fs::File::create(args.out.join("soak-broker.log"))?;
    let broker = Target::broker_logging(
        &bin,
        &kubeconfig,
        linger,
        &["--max-staleness", "5m"],
        target::Log::File(log),
    )
    .await?;
    let admin = broker.admin.context("the broker's admin port")?;
    let ready = async {
        while !readyz(admin).await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), ready)
        .await
        .context("the broker did not become ready")?;
    let tasks_before = scrape(admin)
        .await
        .get("crd_broker_runtime_tasks")
        .copied()
        .unwrap_or(0.0);

    let subs = Arc::new(Subscribers {
        held: (0..args.subscribers).map(|_| Mutex::default()).collect(),
        crs: args.crs,
        stream_ends: AtomicU64::new(0),
        stop: AtomicBool::new(false),
    });
    let channels = clients::connections(broker.grpc, args.connections.max(1), 8).await?;
    let mut tasks = Vec::with_capacity(args.subscribers);
    for i in 0..args.subscribers {
        let channel = channels[i % channels.len()].clone();
        tasks.push(tokio::spawn(subscriber(subs.clone(), i, channel)));
    }
    let warm = wait_until(Duration::from_secs(60), || {
        (0..args.subscribers).all(|i| subs.held(i).messages > 0)
    })
    .await;
    anyhow::ensure!(warm.is_some(), "not every subscriber got its first message");
    let rss_warm = broker.rss();

    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let watching = Arc::new(AtomicBool::new(false));
    let flaps = tokio::spawn(watch_readiness(admin, watching.clone()));
    let writes = tokio::spawn(writer(
        cluster.clone(),
        args.clone(),
        seed ^ 1,
        stop.clone(),
    ));
    let churn = args.churn();
    let stable: Vec<String> = (churn..args.crs).map(name).collect();
    let mut by_fault: BTreeMap<Fault, (KindReport, Histogram)> = BTreeMap::new();
    // Every kind in turn, each round in a random order.
    let mut round = Vec::new();
    for n in 0..args.faults {
        if round.is_empty() {
            round = cluster.faults().to_vec();
            rng.shuffle(&mut round);
        }
        let fault = round.pop().unwrap_or(Fault::Drop);
        cluster.inject(fault, &mut rng, &stable).await;
        let k = rng.usize(churn..args.crs);
        let entry = by_fault.entry(fault).or_default();
        entry.0.count += 1;
        let probe = match cluster.patch(&name(k), n as u64).await {
            Ok(rv) => rv,
            Err(_) => continue,
        };
        let truth = match cluster.truth(&name(k)).await {
            Truth::Present { uid, .. } => Truth::Present { uid, rv: probe },
            Truth::Absent => continue,
        };
        match wait_until(cluster.probe_bound(), || subs.all_hold(k, &truth)).await {
            Some(took) => entry.1.record(took),
            None => entry.0.slow += 1,
        }
        if (n + 1) % 100 == 0 {
            println!(
                "soak: {} faults, {:.0} s",
                n + 1,
                started.elapsed().as_secs_f64()
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    let writes = writes.await.unwrap_or(0);

    // The faults have stopped: the final writes, then every subscriber must hold them.
    cluster.clear();
    for k in 0..args.crs {
        let cr = name(k);
        if k < churn && rng.bool() {
            cluster.delete(&cr).await;
        } else if cluster.truth(&cr).await == Truth::Absent {
            anyhow::ensure!(cluster.create(&cr).await, "creating {cr}");
        } else {
            cluster.patch(&cr, u64::MAX / 2).await?;
        }
    }
    let last_write = Instant::now();
    let mut truths = Vec::with_capacity(args.crs);
    for k in 0..args.crs {
        truths.push(cluster.truth(&name(k)).await);
    }
    let all_final = || (0..args.crs).all(|k| subs.all_hold(k, &truths[k]));
    let converged = wait_until(Duration::from_secs(30), all_final).await;
    let final_converge_ms = converged
        .map(|_| last_write.elapsed().as_secs_f64() * 1000.0)
        .unwrap_or(f64::INFINITY);
    let lost = (0..args.subscribers)
        .filter(|&i| !truths[i % args.crs].held_by(&subs.held(i)))
        .count();
    let one_each = async || cluster.watches_not_one(args.crs, PATH).await == 0;
    eventually(Duration::from_secs(10), one_each).await;
    let watches_not_one = cluster.watches_not_one(args.crs, PATH).await;
    let rss_after = broker.rss();
    watching.store(true, Ordering::Relaxed);
    let readiness_flaps = flaps.await.unwrap_or(0);

    // Everyone leaves: after the linger, no watch is left, and no task.
    subs.stop.store(true, Ordering::Relaxed);
    for t in &tasks {
        t.abort();
    }
    drop(channels);
    let none_left = async || cluster.open_watches().await == 0;
    eventually(linger + Duration::from_secs(10), none_left).await;
    let watches_after_leaving = cluster.open_watches().await;
    // What is left must go: the connections the last relists opened close once idle (15 s,
    // looked at as often), and so do their tasks.
    let tasks = async || {
        scrape(admin)
            .await
            .get("crd_broker_runtime_tasks")
            .copied()
            .unwrap_or(f64::NAN)
    };
    let settle = Instant::now();
    let back = |now: f64| now <= tasks_before;
    let mut tasks_after = tasks().await;
    while !back(tasks_after) && settle.elapsed() < Duration::from_secs(35) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        tasks_after = tasks().await;
    }
    let api_connections_after = cluster.api_connections(broker.pid());
    broker.stop().await;

    let report = SoakReport {
        api_server: if args.real { "real" } else { "fake" },
        seed,
        faults: args.faults,
        subscribers: args.subscribers,
        crs: args.crs,
        writes,
        duration_seconds: started.elapsed().as_secs_f64(),
        by_fault: by_fault
            .into_iter()
            .map(|(f, (mut r, h))| {
                r.converge = h.summary();
                (f, r)
            })
            .collect(),
        final_converge_ms,
        lost,
        watches_not_one,
        watches_after_leaving,
        stream_ends: subs.stream_ends.load(Ordering::Relaxed),
        readiness_flaps,
        rss_warm_bytes: rss_warm,
        rss_after_bytes: rss_after,
        rss_growth: rss_after as f64 / rss_warm.max(1) as f64,
        tasks_before,
        tasks_after,
        api_connections_after,
        plane_starts_retried: match &*cluster {
            Cluster::Real(real) => real.starts_retried.load(Ordering::Relaxed),
            Cluster::Fake(_) => 0,
        },
    };
    std::fs::write(
        args.out.join("soak.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    let md = report.markdown();
    std::fs::write(args.out.join("soak.md"), &md)?;
    println!("{md}");
    let problems = report.problems();
    anyhow::ensure!(
        problems.is_empty(),
        "the soak failed: {}",
        problems.join("; ")
    );
    Ok(())
}
