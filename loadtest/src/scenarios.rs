//! The scenarios: each sets up a fake API server and a server under test, applies load on
//! loopback for a bounded time, and measures.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use fake_apiserver::{FakeApiServer, Options};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::{Value, json};
use tonic::transport::Channel;

use crate::Run;
use crate::clients::{self, Recorder, now_nanos, tokio_util_like};
use crate::report;
use crate::stats::{self, Histogram, Summary};
use crate::target::{Kind, Target};

pub(crate) const CRD: &str = include_str!("../../examples/manifests/featureflag-crd.yaml");
pub(crate) const GV: &str = "core.openfeature.dev/v1beta1";

pub(crate) fn name(k: usize) -> String {
    format!("ff-{k}")
}

fn bar(len: u64, message: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg:40} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

/// A fake API server holding `crs` FeatureFlags of about `payload` bytes, and a kubeconfig.
pub(crate) async fn fake(
    crs: usize,
    payload: usize,
) -> anyhow::Result<(FakeApiServer, tempfile_like::Dir)> {
    fake_with(crs, payload, false).await
}

/// As [`fake`], over TLS (HTTP/2 and HTTP/1.1 by ALPN, 100 streams per connection) if `tls`.
pub(crate) async fn fake_with(
    crs: usize,
    payload: usize,
    tls: bool,
) -> anyhow::Result<(FakeApiServer, tempfile_like::Dir)> {
    let options = Options {
        history_limit: 100_000,
        tls,
        ..Options::default()
    }
    .crd_yaml(CRD)?;
    let fake = FakeApiServer::start_with(options).await?;
    for k in 0..crs {
        fake.apply(flag(&name(k), payload))?;
    }
    let dir = tempfile_like::Dir::new()?;
    fake.write_kubeconfig(&dir.path().join("kubeconfig"))?;
    Ok((fake, dir))
}

/// The fake API server with `crs` FeatureFlags and the server under test: the broker watching
/// it (through a kubeconfig in the returned directory, with `linger`), or the bare server fed
/// every FeatureFlag.
async fn serve(
    run: &Run,
    kind: Kind,
    crs: usize,
    linger: Duration,
    args: &[&str],
) -> anyhow::Result<(FakeApiServer, tempfile_like::Dir, Target)> {
    let (fake, dir) = fake(crs, run.payload_bytes).await?;
    // The loopback addresses connections come from are pods, for `--identity peer-pod`.
    for i in 1..=run.sources.max(1) {
        run_pod(&fake, &format!("sidecar-{i}"), &format!("127.0.0.{i}"))?;
    }
    let target = match kind {
        Kind::Broker => {
            let bin = crate::target::broker_bin(run.broker_bin.clone())?;
            Target::broker(&bin, &dir.path().join("kubeconfig"), linger, args).await?
        }
        Kind::Bare => {
            let mut t = Target::bare().await?;
            for k in 0..crs {
                let obj = fake.get(GV, "featureflags", "default", &name(k))?;
                t.feed(&name(k), &obj.to_string()).await?;
            }
            t
        }
    };
    Ok((fake, dir, target))
}

/// A Running pod `name` in `default` with `ip`, as a kubelet reports it.
fn run_pod(fake: &FakeApiServer, name: &str, ip: &str) -> anyhow::Result<()> {
    fake.apply(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": "default" },
        "spec": { "serviceAccountName": "sidecar", "containers": [{ "name": "app", "image": "app" }] },
    }))?;
    fake.merge_patch_status(
        "v1",
        "pods",
        "default",
        name,
        json!({ "status": { "phase": "Running", "podIP": ip } }),
    )?;
    Ok(())
}

pub(crate) fn flag(name: &str, payload: usize) -> Value {
    let mut f = json!({
        "apiVersion": GV,
        "kind": "FeatureFlag",
        "metadata": { "name": name, "namespace": "default" },
        "spec": { "flagSpec": {
            "metadata": { "seq": 0, "sentAt": 0, "padding": "" },
            "flags": { "f": { "state": "ENABLED", "variants": { "on": true, "off": false }, "defaultVariant": "on" } },
        } },
    });
    let size = f.to_string().len() + 200; // the server adds its metadata
    f["spec"]["flagSpec"]["metadata"]["padding"] = json!("x".repeat(payload.saturating_sub(size)));
    f
}

/// Directories that clean up after themselves (no extra dependency).
pub(crate) mod tempfile_like {
    use std::path::{Path, PathBuf};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new() -> std::io::Result<Dir> {
            let path = std::env::temp_dir().join(format!(
                "crd-broker-loadtest-{}-{}",
                std::process::id(),
                crate::clients::now_nanos()
            ));
            std::fs::create_dir_all(&path)?;
            Ok(Dir(path))
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// What one server did in a fan-out run.
#[derive(Debug, Clone, Serialize)]
pub struct FanoutRun {
    /// Which server.
    pub target: Kind,
    /// Write → receipt, for every live update and subscriber.
    pub deliveries: Summary,
    /// Write → receipt by the last subscriber, per update: the fan-out time.
    pub fanout: Summary,
    /// First message of subscriptions that started a watch.
    pub first_cold: Summary,
    /// First message of subscriptions to an already-watched resource, all opened at once.
    pub first_warm: Summary,
    /// First message of a lone subscription to an already-watched resource on an idle server.
    pub first_warm_alone: Summary,
    /// First message of a lone subscription to a watched resource on a new connection
    /// (measured in the identity scenario).
    pub first_new_connection: Option<Summary>,
    /// A unary round trip on a warm connection (the bare server's health Check).
    pub unary: Option<Summary>,
    /// The broker's own mean fan-out time, from its metrics: source event → last subscriber's
    /// write. The rest of the fan-out time is the API server's watch and the client side.
    pub internal_fanout_mean_ms: Option<f64>,
    /// Server memory before the subscribers came.
    pub rss_before_bytes: u64,
    /// Server memory with every subscriber connected and served.
    pub rss_loaded_bytes: u64,
    /// (loaded - before) / subscribers.
    pub bytes_per_stream: f64,
    /// Server CPU time while updates were written.
    pub cpu_seconds: f64,
    /// Updates written.
    pub updates: u64,
    /// Subscribers that did not end on their resource's last state.
    pub lost: u64,
    /// Streams that ended with an error.
    pub errors: u64,
    /// Watches open on the API server during the run (broker only).
    pub open_watches: Option<usize>,
    /// LIST requests the API server received (broker only).
    pub lists: Option<usize>,
    /// WATCH requests the API server received (broker only).
    pub watches: Option<usize>,
    /// The delivery-latency distribution, for the plot.
    #[serde(skip)]
    pub cdf: Vec<(f64, f64)>,
}

/// A fan-out scenario, on both servers.
#[derive(Debug, Clone, Serialize)]
pub struct Fanout {
    /// Subscribers.
    pub subscribers: usize,
    /// Connections.
    pub connections: usize,
    /// Custom resources.
    pub crs: usize,
    /// Updates per second.
    pub rate: f64,
    /// Seconds of updates.
    pub seconds: f64,
    /// The broker.
    pub broker: FanoutRun,
    /// The bare tonic server.
    pub bare: FanoutRun,
}

async fn start_subscribers(
    channels: &[Channel],
    names: &[String],
    range: std::ops::Range<usize>,
    cold: bool,
    recorder: &Arc<Recorder>,
    stop: &tokio_util_like::Stop,
) {
    for i in range {
        let channel = channels[i % channels.len()].clone();
        tokio::spawn(clients::subscribe(
            channel,
            names[i].clone(),
            i,
            cold,
            recorder.clone(),
            stop.clone(),
        ));
    }
}

pub(crate) async fn wait_until(
    what: &str,
    timeout: Duration,
    mut done: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !done() {
        anyhow::ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

fn firsts(r: &Recorder) -> u64 {
    r.first_cold.count() + r.first_warm.count()
}

/// One server with the fan-out's subscribers connected, taking updates.
struct Loaded {
    kind: Kind,
    fake: FakeApiServer,
    _dir: tempfile_like::Dir,
    target: Target,
    channels: Vec<Channel>,
    recorder: Arc<Recorder>,
    trigger: tokio_util_like::Trigger,
    subscribers: usize,
    crs: usize,
    updates: usize,
    rss_before: u64,
    rss_loaded: u64,
    /// CPU time when the updates began, then the time they took (once settled).
    cpu_before: Duration,
    cpu: Duration,
    /// Lone subscriptions to a watched resource, after the updates.
    first_warm_alone: Histogram,
    /// Unary round trips (the bare server's health Check), after the updates.
    unary: Histogram,
    /// Lone subscriptions to a watched resource, each on a new connection.
    first_new_connection: Histogram,
    /// Per resource: the last update written, and the resourceVersion it got.
    last_seq: Vec<u64>,
    last_rv: Vec<String>,
}

/// Starts one server and connects the fan-out's subscribers to it.
async fn load(
    run: &Run,
    kind: Kind,
    args: &[&str],
    subscribers: usize,
    connections: usize,
    crs: usize,
    updates: usize,
) -> anyhow::Result<Loaded> {
    let (fake, dir, target) = serve(run, kind, crs, Duration::from_secs(30), args).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss_before = target.rss();
    let channels = clients::connections(target.grpc, connections, run.sources).await?;
    let names: Vec<String> = (0..subscribers).map(|i| name(i % crs)).collect();
    let recorder = Recorder::new(subscribers, updates);
    let (trigger, stop) = tokio_util_like::signal();

    // One subscriber per resource first (cold: it starts the watch), then the rest (warm).
    let progress = bar(subscribers as u64, &format!("{kind:?}: subscribing"));
    let cold = subscribers.min(crs);
    start_subscribers(&channels, &names, 0..cold, true, &recorder, &stop).await;
    wait_until("the cold subscribers", Duration::from_secs(60), || {
        firsts(&recorder) as usize >= cold
    })
    .await?;
    start_subscribers(
        &channels,
        &names,
        cold..subscribers,
        false,
        &recorder,
        &stop,
    )
    .await;
    wait_until(
        "every subscriber's first message",
        Duration::from_secs(120),
        || {
            progress.set_position(firsts(&recorder));
            firsts(&recorder) as usize >= subscribers
        },
    )
    .await?;
    progress.finish_and_clear();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_loaded = target.rss();
    Ok(Loaded {
        kind,
        fake,
        _dir: dir,
        target,
        channels,
        recorder,
        trigger,
        subscribers,
        crs,
        updates,
        rss_before,
        rss_loaded,
        cpu_before: Duration::ZERO,
        cpu: Duration::ZERO,
        first_warm_alone: Histogram::default(),
        unary: Histogram::default(),
        first_new_connection: Histogram::default(),
        last_seq: vec![0; crs],
        last_rv: vec![String::new(); crs],
    })
}

impl Loaded {
    /// Writes update `seq` to its resource (round robin). The clock starts at the API write for
    /// both servers: the broker learns of it from its watch, the bare server from the harness
    /// once the write has returned.
    async fn update(&mut self, seq: usize) -> anyhow::Result<()> {
        let k = seq % self.crs;
        let patch = json!({ "spec": { "flagSpec": { "metadata": { "seq": seq, "sentAt": now_nanos() } } } });
        let obj = self
            .fake
            .merge_patch(GV, "featureflags", "default", &name(k), patch)?;
        if self.kind == Kind::Bare {
            self.target.feed(&name(k), &obj.to_string()).await?;
        }
        self.last_seq[k] = seq as u64;
        self.last_rv[k] = obj["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        Ok(())
    }

    /// Times `n` lone first messages on a watched resource and, on the bare server, `n` unary
    /// round trips.
    async fn probe(&self, n: usize) {
        let channel = self.channels[0].clone();
        clients::first_messages(channel.clone(), &name(0), n, &self.first_warm_alone).await;
        if self.kind == Kind::Bare {
            unary_round_trips(channel, n, &self.unary).await;
        }
    }

    /// Times `n` lone first messages on a watched resource, each on a new connection from one
    /// of the source addresses in turn.
    async fn probe_new_connections(&self, n: usize, sources: u8) -> anyhow::Result<()> {
        for i in 0..n {
            let started = Instant::now();
            let channel = clients::connection_from(
                self.target.grpc,
                Ipv4Addr::new(127, 0, 0, 1 + (i % sources.max(1) as usize) as u8),
            )
            .await?;
            let h = Histogram::default();
            clients::first_messages(channel, &name(0), 1, &h).await;
            if h.count() == 1 {
                self.first_new_connection.record(started.elapsed());
            }
        }
        Ok(())
    }

    /// Subscribers not on their resource's last state.
    fn lost(&self) -> u64 {
        let r = &self.recorder;
        (0..self.subscribers)
            .filter(|i| {
                let k = i % self.crs;
                let seq_ok = r.last_seq[*i].load(Ordering::Relaxed) == self.last_seq[k];
                let rv_ok = self.kind == Kind::Bare
                    || r.last_rv[*i]
                        .lock()
                        .map(|v| *v == self.last_rv[k])
                        .unwrap_or(false);
                !(seq_ok && rv_ok)
            })
            .count() as u64
    }

    /// Waits for the last states to arrive (or a timeout: `lost` says how many did not), then
    /// reads the CPU time the updates took.
    async fn settle(&mut self) {
        let _ = wait_until(
            "every subscriber on the last state",
            Duration::from_secs(30),
            || self.lost() == 0,
        )
        .await;
        self.cpu = self.target.cpu().saturating_sub(self.cpu_before);
    }

    /// Measures what is left to measure, and stops the server.
    async fn finish(self) -> anyhow::Result<FanoutRun> {
        let kind = self.kind;
        let first_warm_alone = self.first_warm_alone.summary();
        let unary = (kind == Kind::Bare).then(|| self.unary.summary());
        let first_new_connection =
            (self.first_new_connection.count() > 0).then(|| self.first_new_connection.summary());
        let internal_fanout_mean_ms = match (
            self.target
                .metric_sum("crd_broker_fanout_seconds_sum")
                .await,
            self.target
                .metric_sum("crd_broker_fanout_seconds_count")
                .await,
        ) {
            (Some(sum), Some(count)) if count > 0.0 => Some(sum / count * 1000.0),
            _ => None,
        };
        let recorder = &self.recorder;
        let fake = &self.fake;
        let result = FanoutRun {
            target: kind,
            deliveries: recorder.deliveries.summary(),
            fanout: recorder.completions().summary(),
            first_cold: recorder.first_cold.summary(),
            first_warm: recorder.first_warm.summary(),
            first_warm_alone,
            first_new_connection,
            unary,
            internal_fanout_mean_ms,
            rss_before_bytes: self.rss_before,
            rss_loaded_bytes: self.rss_loaded,
            bytes_per_stream: self.rss_loaded.saturating_sub(self.rss_before) as f64
                / self.subscribers as f64,
            cpu_seconds: self.cpu.as_secs_f64(),
            updates: self.updates as u64,
            lost: self.lost(),
            errors: recorder.errors.load(Ordering::Relaxed),
            open_watches: (kind == Kind::Broker).then(|| fake.open_watches()),
            lists: (kind == Kind::Broker)
                .then(|| fake.requests().iter().filter(|r| r.verb == "list").count()),
            watches: (kind == Kind::Broker)
                .then(|| fake.requests().iter().filter(|r| r.verb == "watch").count()),
            cdf: recorder.deliveries.cdf(),
        };
        self.trigger.stop();
        drop(self.channels);
        self.target.stop().await;
        Ok(result)
    }
}

async fn unary_round_trips(channel: Channel, n: usize, h: &Histogram) {
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    for _ in 0..n {
        let t = Instant::now();
        let _ = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await;
        h.record(t.elapsed());
    }
}

/// Lone first messages (and unary round trips) timed on each server after its updates.
const PROBES: usize = 200;

/// Scenarios (a) and (b): the broker and the bare server under the same load.
///
/// With `together`, both are loaded first and their updates interleave, the bare server's half
/// a period after the broker's, so whatever else the machine is doing falls on both alike; that
/// suits (a), whose fan-outs end in milliseconds, long before the other server's next update.
/// The probes after the updates take turns too, ten at a time.
/// Otherwise each server runs alone in turn: (b) keeps both cores busy for its whole run.
pub async fn fanout(run: &Run, crs: usize, together: bool) -> anyhow::Result<Fanout> {
    let (subscribers, connections) = (run.subscribers, run.connections);
    let updates = (run.rate * run.duration.as_secs_f64()).round() as usize;
    let load = |kind| load(run, kind, &[], subscribers, connections, crs, updates);
    let (broker, bare) = if together {
        let mut both = [load(Kind::Broker).await?, load(Kind::Bare).await?];
        drive(&mut both, updates, run.rate).await?;
        let [mut broker, mut bare] = both;
        broker.settle().await;
        bare.settle().await;
        for _ in 0..PROBES / 10 {
            broker.probe(10).await;
            bare.probe(10).await;
        }
        (broker.finish().await?, bare.finish().await?)
    } else {
        let mut broker = [load(Kind::Broker).await?];
        drive(&mut broker, updates, run.rate).await?;
        let [mut broker] = broker;
        broker.settle().await;
        broker.probe(PROBES).await;
        let broker = broker.finish().await?;
        let mut bare = [load(Kind::Bare).await?];
        drive(&mut bare, updates, run.rate).await?;
        let [mut bare] = bare;
        bare.settle().await;
        bare.probe(PROBES).await;
        (broker, bare.finish().await?)
    };
    Ok(Fanout {
        subscribers,
        connections,
        crs,
        rate: run.rate,
        seconds: run.duration.as_secs_f64(),
        broker,
        bare,
    })
}

/// Writes `updates` updates at `rate` to each server, the servers' turns spread evenly over
/// each period.
async fn drive(servers: &mut [Loaded], updates: usize, rate: f64) -> anyhow::Result<()> {
    let progress = bar(updates as u64, "updating");
    let period = Duration::from_secs_f64(1.0 / rate);
    let turn = period / servers.len() as u32;
    for server in servers.iter_mut() {
        server.cpu_before = server.target.cpu();
    }
    let started = Instant::now();
    for seq in 1..=updates {
        for (i, server) in servers.iter_mut().enumerate() {
            let due = started + period * seq as u32 + turn * i as u32;
            tokio::time::sleep_until(due.into()).await;
            server.update(seq).await?;
        }
        progress.inc(1);
    }
    progress.finish_and_clear();
    Ok(())
}

/// The cost of caller identity: the fan-out scenario on two brokers loaded at once, one with
/// `--identity none` and one with `--identity peer-pod` (every source address a pod), and the
/// API requests identity makes for many sidecars on many pod IPs.
#[derive(Debug, Clone, Serialize)]
pub struct Identity {
    /// Subscribers on each broker.
    pub subscribers: usize,
    /// Connections they share.
    pub connections: usize,
    /// Custom resources.
    pub crs: usize,
    /// Updates per second.
    pub rate: f64,
    /// Seconds of updates.
    pub seconds: f64,
    /// The broker with identity off.
    pub none: FanoutRun,
    /// The broker with `--identity peer-pod`.
    pub peer_pod: FanoutRun,
    /// Pod lookups the peer-pod broker made for all its connections and probes.
    pub pod_lookups: usize,
    /// Many sidecars on many pod IPs.
    pub cost: IdentityCost,
}

/// API requests for `sidecars` one-stream sidecars on `pod_ips` pods, with `--identity peer-pod`.
#[derive(Debug, Clone, Serialize)]
pub struct IdentityCost {
    /// Sidecars (one connection and one stream each).
    pub sidecars: usize,
    /// Pods (distinct source addresses) they run in.
    pub pod_ips: usize,
    /// Every sidecar connecting, a pod's sidecars together (as when pods start).
    pub by_pod: ConnectPhase,
    /// Every sidecar reconnecting once the lookup cache has expired, the pods' sidecars
    /// interleaved (as after a broker restart, each client on its own backoff): the worst case.
    pub interleaved: ConnectPhase,
    /// Sidecars refused.
    pub errors: usize,
}

/// One round of sidecars connecting, 256 at a time.
#[derive(Debug, Clone, Serialize)]
pub struct ConnectPhase {
    /// Seconds until all were served.
    pub seconds: f64,
    /// Pod lookups (LISTs of pods by IP) they caused.
    pub pod_lookups: usize,
    /// Every request the API server received meanwhile.
    pub api_requests: usize,
}

/// The identity scenario.
pub async fn identity(run: &Run) -> anyhow::Result<Identity> {
    let (subscribers, connections, crs) = (run.subscribers, run.connections, run.crs);
    let updates = (run.rate * run.duration.as_secs_f64()).round() as usize;
    let mut both = [
        load(
            run,
            Kind::Broker,
            &["--identity", "none"],
            subscribers,
            connections,
            crs,
            updates,
        )
        .await?,
        load(
            run,
            Kind::Broker,
            &["--identity", "peer-pod"],
            subscribers,
            connections,
            crs,
            updates,
        )
        .await?,
    ];
    drive(&mut both, updates, run.rate).await?;
    let [mut none, mut pod] = both;
    none.settle().await;
    pod.settle().await;
    for _ in 0..PROBES / 10 {
        none.probe(10).await;
        pod.probe(10).await;
        none.probe_new_connections(10, run.sources).await?;
        pod.probe_new_connections(10, run.sources).await?;
    }
    let pod_lookups = pod.fake.request_count("list", "/api/v1/pods") as usize;
    let (none, peer_pod) = (none.finish().await?, pod.finish().await?);
    Ok(Identity {
        subscribers,
        connections,
        crs,
        rate: run.rate,
        seconds: run.duration.as_secs_f64(),
        none,
        peer_pod,
        pod_lookups,
        cost: identity_cost(run).await?,
    })
}

/// The source address of pod `i`: 127.1.0.1, 127.1.0.2, … (250 to a /24).
fn pod_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 1, (i / 250) as u8, (i % 250 + 1) as u8)
}

async fn identity_cost(run: &Run) -> anyhow::Result<IdentityCost> {
    let (sidecars, pods, crs) = (run.sidecars, run.pod_ips.max(1), run.crs);
    let (fake, _dir, target) = serve(
        run,
        Kind::Broker,
        crs,
        Duration::from_secs(30),
        &["--identity", "peer-pod"],
    )
    .await?;
    let progress = bar(pods as u64, "identity: pods");
    for i in 0..pods {
        run_pod(&fake, &format!("pod-{i}"), &pod_ip(i).to_string())?;
        progress.inc(1);
    }
    progress.finish_and_clear();
    // Every watch warm, so the sidecars pay only for identity.
    let trigger = warm_every_watch(&target, crs).await?;
    let addr = target.grpc;
    let per_pod = sidecars.div_ceil(pods);
    // Sidecar i runs in pod `pod_of(i)`.
    let round = |pod_of: fn(usize, usize, usize) -> usize, what: &'static str| {
        let fake = &fake;
        async move {
            fake.clear_requests();
            let progress = bar(sidecars as u64, what);
            let started = Instant::now();
            let connected: Vec<_> = futures::stream::iter(0..sidecars)
                .map(|i| {
                    let progress = progress.clone();
                    let pod = pod_of(i, per_pod, pods);
                    async move {
                        let s = clients::sidecar(addr, pod_ip(pod), &name(i % crs)).await;
                        progress.inc(1);
                        s
                    }
                })
                .buffer_unordered(256)
                .collect()
                .await;
            progress.finish_and_clear();
            let phase = ConnectPhase {
                seconds: started.elapsed().as_secs_f64(),
                pod_lookups: fake.request_count("list", "/api/v1/pods") as usize,
                api_requests: fake.requests().len(),
            };
            (phase, connected)
        }
    };
    let (by_pod, first) = round(|i, per_pod, _| i / per_pod, "identity: sidecars by pod").await;
    let mut errors = first.iter().filter(|s| s.is_err()).count();
    drop(first);
    tokio::time::sleep(crd_broker::access::peer_pod::FOUND_TTL + Duration::from_millis(500)).await;
    let (interleaved, second) =
        round(|i, _, pods| i % pods, "identity: sidecars interleaved").await;
    errors += second.iter().filter(|s| s.is_err()).count();
    drop(second);
    trigger.stop();
    target.stop().await;
    Ok(IdentityCost {
        sidecars,
        pod_ips: pods,
        by_pod,
        interleaved,
        errors,
    })
}

/// Scenario (c): a reconnect storm at a broker with no watches.
#[derive(Debug, Clone, Serialize)]
pub struct Storm {
    /// Subscribers.
    pub subscribers: usize,
    /// Custom resources they ask for.
    pub crs: usize,
    /// Seconds until the last subscriber had its first message.
    pub all_served_seconds: f64,
    /// First messages.
    pub first_message: Summary,
    /// LISTs per resource: the least and the most.
    pub lists_per_cr: (usize, usize),
    /// WATCHes per resource: the least and the most.
    pub watches_per_cr: (usize, usize),
    /// Watches open on the API server afterwards.
    pub open_watches: usize,
    /// Streams that failed.
    pub errors: u64,
}

/// Runs the storm.
pub async fn storm(run: &Run) -> anyhow::Result<Storm> {
    let (fake, _dir, target) =
        serve(run, Kind::Broker, run.crs, Duration::from_secs(30), &[]).await?;
    let channels = clients::connections(target.grpc, run.connections, run.sources).await?;
    fake.clear_requests();
    let n = run.subscribers;
    let names: Vec<String> = (0..n).map(|i| name(i % run.crs)).collect();
    let recorder = Recorder::new(n, 0);
    let (trigger, stop) = tokio_util_like::signal();
    let started = Instant::now();
    // All at once: every subscriber races for its resource's first watch.
    start_subscribers(&channels, &names, 0..n, true, &recorder, &stop).await;
    let progress = bar(n as u64, "storm: subscribing");
    wait_until(
        "the storm's first messages",
        Duration::from_secs(120),
        || {
            progress.set_position(firsts(&recorder));
            firsts(&recorder) as usize >= n
        },
    )
    .await?;
    progress.finish_and_clear();
    let all_served = started.elapsed();
    let per_cr = |verb: &str| least_and_most(&requests_per_cr(&fake, run.crs, verb));
    let result = Storm {
        subscribers: n,
        crs: run.crs,
        all_served_seconds: all_served.as_secs_f64(),
        first_message: recorder.first_cold.summary(),
        lists_per_cr: per_cr("list"),
        watches_per_cr: per_cr("watch"),
        open_watches: fake.open_watches(),
        errors: recorder.errors.load(Ordering::Relaxed),
    };
    trigger.stop();
    target.stop().await;
    Ok(result)
}

/// The requests of `verb` the API server saw for each of the first `crs` CRs, by the field
/// selector that names it.
pub(crate) fn requests_per_cr(fake: &FakeApiServer, crs: usize, verb: &str) -> Vec<usize> {
    let requests = fake.requests();
    (0..crs)
        .map(|k| {
            let selector = format!("metadata.name={}", name(k));
            requests
                .iter()
                .filter(|r| r.verb == verb && r.param("fieldSelector") == Some(selector.as_str()))
                .count()
        })
        .collect()
}

/// The least and the most of `counts`.
pub(crate) fn least_and_most(counts: &[usize]) -> (usize, usize) {
    (
        counts.iter().copied().min().unwrap_or(0),
        counts.iter().copied().max().unwrap_or(0),
    )
}

/// Scenario (d): subscribers come and go while updates flow.
#[derive(Debug, Clone, Serialize)]
pub struct Churn {
    /// Subscribers alive at once.
    pub active: usize,
    /// Seconds it ran.
    pub seconds: f64,
    /// Subscriptions opened.
    pub subscriptions: u64,
    /// First messages.
    pub first_message: Summary,
    /// Watches the broker started (its metrics).
    pub watch_starts: f64,
    /// Subscribers alive at the end that were not on their resource's last state.
    pub lost: u64,
    /// Watches open on the API server once everyone left and the linger passed.
    pub open_watches_after: usize,
    /// Broker CPU time over the run.
    pub cpu_seconds: f64,
}

/// Runs the churn.
pub async fn churn(run: &Run) -> anyhow::Result<Churn> {
    let crs = run.crs;
    let linger = Duration::from_secs(1);
    let (fake, _dir, target) = serve(run, Kind::Broker, crs, linger, &[]).await?;
    let channels =
        clients::connections(target.grpc, (run.connections / 10).max(1), run.sources).await?;
    let active = run.churn_subscribers;
    let recorder = Recorder::new(active, 0);
    let cpu_before = target.cpu();
    let started = Instant::now();
    let opened = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (end_trigger, end) = tokio_util_like::signal();
    // Each slot runs subscriber after subscriber, each living 0.2–3 s on a pseudo-random resource.
    let mut slots = Vec::new();
    for slot in 0..active {
        let (channels, recorder, opened, end) = (
            channels.clone(),
            recorder.clone(),
            opened.clone(),
            end.clone(),
        );
        slots.push(tokio::spawn(async move {
            let mut x = (slot as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut step = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            loop {
                let k = (step() % crs as u64) as usize;
                let life = Duration::from_millis(200 + step() % 2800);
                let (trigger, stop) = tokio_util_like::signal();
                opened.fetch_add(1, Ordering::Relaxed);
                let task = tokio::spawn(clients::subscribe(
                    channels[slot % channels.len()].clone(),
                    name(k),
                    slot,
                    false,
                    recorder.clone(),
                    stop,
                ));
                tokio::select! {
                    _ = tokio::time::sleep(life) => { trigger.stop(); let _ = task.await; }
                    _ = end.wait() => {
                        // The last subscriber of the slot stays for the final-state check.
                        return (k, trigger, task);
                    }
                }
            }
        }));
    }
    // Updates while they churn.
    let total = (run.rate * run.churn_duration.as_secs_f64()).round() as usize;
    let mut last_seq = vec![0u64; crs];
    let progress = bar(total as u64, "churn: updating");
    for seq in 1..=total {
        tokio::time::sleep_until((started + Duration::from_secs_f64(seq as f64 / run.rate)).into())
            .await;
        let k = seq % crs;
        let patch = json!({ "spec": { "flagSpec": { "metadata": { "seq": seq, "sentAt": now_nanos() } } } });
        fake.merge_patch(GV, "featureflags", "default", &name(k), patch)?;
        last_seq[k] = seq as u64;
        progress.inc(1);
    }
    progress.finish_and_clear();
    end_trigger.stop();
    let mut last = Vec::new();
    for s in slots {
        last.push(s.await.context("a churn slot")?);
    }
    let lost = |r: &Recorder| {
        last.iter()
            .enumerate()
            .filter(|(slot, (k, _, _))| r.last_seq[*slot].load(Ordering::Relaxed) != last_seq[*k])
            .count() as u64
    };
    let _ = wait_until("the churn's final states", Duration::from_secs(30), || {
        lost(&recorder) == 0
    })
    .await;
    let lost_count = lost(&recorder);
    let cpu = target.cpu().saturating_sub(cpu_before);
    for (_, trigger, task) in last {
        trigger.stop();
        let _ = task.await;
    }
    drop(channels);
    // Everyone left: after the linger no watch may remain.
    let _ = wait_until(
        "the watches to close",
        linger + Duration::from_secs(5),
        || fake.open_watches() == 0,
    )
    .await;
    let metrics = match target.admin {
        Some(admin) => report::scrape(admin).await,
        None => Default::default(),
    };
    let result = Churn {
        active,
        seconds: run.churn_duration.as_secs_f64(),
        subscriptions: opened.load(Ordering::Relaxed),
        first_message: recorder.first_warm.summary(),
        watch_starts: metrics
            .iter()
            .filter(|(k, _)| k.starts_with("crd_broker_watch_starts_total"))
            .map(|(_, v)| v)
            .sum(),
        lost: lost_count,
        open_watches_after: fake.open_watches(),
        cpu_seconds: cpu.as_secs_f64(),
    };
    target.stop().await;
    Ok(result)
}

/// Memory of idle one-stream sidecars on one server.
#[derive(Debug, Clone, Serialize)]
pub struct IdleRun {
    /// Which server.
    pub target: Kind,
    /// Sidecars connected and served.
    pub sidecars: usize,
    /// Server memory before.
    pub rss_before_bytes: u64,
    /// Server memory with every sidecar connected, `hold_seconds` after the last connected.
    pub rss_after_bytes: u64,
    /// How long the sidecars were held connected before `rss_after_bytes` was read.
    pub hold_seconds: f64,
    /// (after - before) / sidecars.
    pub bytes_per_sidecar: f64,
    /// Seconds to connect them all.
    pub connect_seconds: f64,
}

/// Idle memory on both servers.
#[derive(Debug, Clone, Serialize)]
pub struct Idle {
    /// The broker.
    pub broker: IdleRun,
    /// The bare tonic server.
    pub bare: IdleRun,
}

/// One subscriber on each of the `crs` resources, on one connection from 127.0.0.1, until the
/// returned trigger is stopped: every watch open.
async fn warm_every_watch(target: &Target, crs: usize) -> anyhow::Result<tokio_util_like::Trigger> {
    let warm = clients::connections(target.grpc, 1, 1).await?;
    let recorder = Recorder::new(crs, 0);
    let (trigger, stop) = tokio_util_like::signal();
    let names: Vec<String> = (0..crs).map(name).collect();
    start_subscribers(&warm, &names, 0..crs, true, &recorder, &stop).await;
    wait_until("the warm-up", Duration::from_secs(60), || {
        firsts(&recorder) as usize >= crs
    })
    .await?;
    Ok(trigger)
}

async fn idle_on(run: &Run, kind: Kind) -> anyhow::Result<IdleRun> {
    let crs = run.crs;
    let (fake, _dir, target) = serve(run, kind, crs, Duration::from_secs(30), &[]).await?;
    // Every watch warm first, so the measurement is the sidecars' own cost.
    let trigger = warm_every_watch(&target, crs).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = target.rss();
    let n = run.sidecars;
    let progress = bar(n as u64, &format!("{kind:?}: idle sidecars"));
    let started = Instant::now();
    let addr = target.grpc;
    let sources = run.sources.max(1);
    let sidecars: Vec<clients::Sidecar> = futures::stream::iter(0..n)
        .map(|i| {
            let local = Ipv4Addr::new(127, 0, 0, 1 + (i % sources as usize) as u8);
            let name = name(i % crs);
            let progress = progress.clone();
            async move {
                let s = clients::sidecar(addr, local, &name).await;
                progress.inc(1);
                s
            }
        })
        .buffer_unordered(256)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    progress.finish_and_clear();
    let connect = started.elapsed();
    tokio::time::sleep(run.idle_hold).await;
    let after = target.rss();
    let result = IdleRun {
        target: kind,
        sidecars: sidecars.len(),
        rss_before_bytes: before,
        rss_after_bytes: after,
        hold_seconds: run.idle_hold.as_secs_f64(),
        bytes_per_sidecar: after.saturating_sub(before) as f64 / n.max(1) as f64,
        connect_seconds: connect.as_secs_f64(),
    };
    drop(sidecars);
    trigger.stop();
    target.stop().await;
    let _ = fake;
    Ok(result)
}

/// Readers that never read, while large updates flow: what each costs the broker, and whether a
/// reader that does read still gets the newest state.
#[derive(Debug, Clone, Serialize)]
pub struct Stalled {
    /// Streams that took their first message and then never read again.
    pub readers: usize,
    /// The size of each update.
    pub update_bytes: usize,
    /// Updates written.
    pub updates: u64,
    /// Broker memory with the stalled readers connected, before the updates.
    pub rss_before_bytes: u64,
    /// Broker memory after the updates.
    pub rss_after_bytes: u64,
    /// (after - before) / readers.
    pub bytes_per_stalled_stream: f64,
    /// Whether a reader on the same CR that does read got the last update.
    pub reader_got_the_last: bool,
}

/// The stalled-readers scenario.
pub async fn stalled(run: &Run) -> anyhow::Result<Stalled> {
    let (fake, _dir, target) = serve(run, Kind::Broker, 1, Duration::from_secs(30), &[]).await?;
    let trigger = warm_every_watch(&target, 1).await?;
    let n = run.stalled_readers;
    let addr = target.grpc;
    let sources = run.sources.max(1);
    let readers: Vec<clients::Sidecar> = futures::stream::iter(0..n)
        .map(|i| {
            let local = Ipv4Addr::new(127, 0, 0, 1 + (i % sources as usize) as u8);
            async move { clients::sidecar(addr, local, &name(0)).await }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    // One that reads, on its own connection.
    let channel = clients::connection_from(addr, Ipv4Addr::new(127, 0, 0, 1)).await?;
    let mut reader = crd_broker::pb::broker_client::BrokerClient::new(channel)
        .subscribe(clients::subscribe_request(&name(0)))
        .await?
        .into_inner();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = target.rss();
    let updates = run.stalled_updates;
    let padding = "x".repeat(run.stalled_update_bytes);
    for seq in 1..=updates {
        fake.merge_patch(
            GV,
            "featureflags",
            "default",
            &name(0),
            json!({ "spec": { "flagSpec": { "metadata": { "seq": seq, "padding": padding } } } }),
        )?;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last = tokio::time::timeout(Duration::from_secs(20), async {
        while let Ok(Some(m)) = reader.message().await {
            let object: Value = serde_json::from_slice(&m.object).unwrap_or_default();
            if object["spec"]["flagSpec"]["metadata"]["seq"] == updates {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = target.rss();
    let result = Stalled {
        readers: readers.len(),
        update_bytes: run.stalled_update_bytes,
        updates,
        rss_before_bytes: before,
        rss_after_bytes: after,
        bytes_per_stalled_stream: after.saturating_sub(before) as f64 / n.max(1) as f64,
        reader_got_the_last: last,
    };
    drop(readers);
    trigger.stop();
    target.stop().await;
    Ok(result)
}

/// The idle-memory scenario.
pub async fn idle(run: &Run) -> anyhow::Result<Idle> {
    Ok(Idle {
        broker: idle_on(run, Kind::Broker).await?,
        bare: idle_on(run, Kind::Bare).await?,
    })
}

/// Every scenario asked for, then the reports.
pub async fn run_all(run: Run) -> anyhow::Result<()> {
    let fds = stats::raise_fd_limit();
    crate::target::broker_bin(run.broker_bin.clone())?;
    let sockets = match run.wants("idle") || run.wants("identity") {
        true => run.sidecars.max(run.connections),
        false => run.connections,
    } as u64;
    // Every connection is an open file here and in the server; the broker's watches (one per
    // CR) and the rest need some more.
    let needed = sockets + run.crs as u64 + 100;
    anyhow::ensure!(
        needed <= fds,
        "{sockets} connections need about {} open files in this process and in the server, but \
         the open-file limit is {fds} and cannot be raised further (it is the hard limit: raise \
         it as root with CAP_SYS_RESOURCE, e.g. `ulimit -Hn 1048576`)",
        needed
    );
    let mut results = report::Results::new(&run, fds);
    if run.wants("fanout") {
        results.fanout = Some(
            fanout(&run, run.crs, true)
                .await
                .context("the fan-out scenario")?,
        );
    }
    if run.wants("hot") {
        results.hot = Some(
            fanout(&run, 1, false)
                .await
                .context("the hot-CR scenario")?,
        );
    }
    if run.wants("storm") {
        results.storm = Some(storm(&run).await.context("the storm scenario")?);
    }
    if run.wants("churn") {
        results.churn = Some(churn(&run).await.context("the churn scenario")?);
    }
    if run.wants("idle") {
        results.idle = Some(idle(&run).await.context("the idle scenario")?);
    }
    if run.wants("identity") {
        results.identity = Some(identity(&run).await.context("the identity scenario")?);
    }
    if run.wants("failover") {
        results.failover = Some(
            crate::failover::failover(&run)
                .await
                .context("the failover scenario")?,
        );
    }
    if run.wants("coldstart") {
        results.coldstart = Some(
            crate::coldstart::coldstart(&run)
                .await
                .context("the cold-start scenario")?,
        );
    }
    if run.wants("granularity") {
        results.granularity = Some(
            crate::granularity::granularity(&run)
                .await
                .context("the granularity scenario")?,
        );
    }
    if run.wants("connections") {
        results.connections = Some(
            crate::connections::connections(&run)
                .await
                .context("the API-connections scenario")?,
        );
    }
    if run.wants("stalled") {
        results.stalled = Some(
            stalled(&run)
                .await
                .context("the stalled-readers scenario")?,
        );
    }
    results.compute_ratios();
    let summary = report::write(&run.out, &results)?;
    println!("{summary}");
    Ok(())
}
