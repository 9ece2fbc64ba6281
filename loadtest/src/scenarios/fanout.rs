//! Scenarios (a) and (b): many subscribers on many CRs, and on one hot CR, on the broker and
//! on the bare server under the same load; and the loaded server the identity scenario reuses.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fake_apiserver::FakeApiServer;
use serde::Serialize;
use serde_json::json;
use tonic::transport::Channel;

use crate::Run;
use crate::clients::{self, Recorder, now_nanos, tokio_util_like};
use crate::fixtures::{GV, bar, firsts, name, serve, start_subscribers, tempfile_like, wait_until};
use crate::stats::{Histogram, Summary};
use crate::target::{Kind, Target};

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

/// One server with the fan-out's subscribers connected, taking updates.
pub(super) struct Loaded {
    kind: Kind,
    pub(super) fake: FakeApiServer,
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
pub(super) async fn load(
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
    pub(super) async fn probe(&self, n: usize) {
        let channel = self.channels[0].clone();
        clients::first_messages(channel.clone(), &name(0), n, &self.first_warm_alone).await;
        if self.kind == Kind::Bare {
            unary_round_trips(channel, n, &self.unary).await;
        }
    }

    /// Times `n` lone first messages on a watched resource, each on a new connection from one
    /// of the source addresses in turn.
    pub(super) async fn probe_new_connections(&self, n: usize, sources: u8) -> anyhow::Result<()> {
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
    pub(super) async fn settle(&mut self) {
        let _ = wait_until(
            "every subscriber on the last state",
            Duration::from_secs(30),
            || self.lost() == 0,
        )
        .await;
        self.cpu = self.target.cpu().saturating_sub(self.cpu_before);
    }

    /// Measures what is left to measure, and stops the server.
    pub(super) async fn finish(self) -> anyhow::Result<FanoutRun> {
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
pub(super) const PROBES: usize = 200;

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
pub(super) async fn drive(servers: &mut [Loaded], updates: usize, rate: f64) -> anyhow::Result<()> {
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
