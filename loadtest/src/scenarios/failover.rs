//! Scenario `failover`: replicas SIGKILLed under load. Three broker processes on one fake API
//! server share the subscribers, which roam as clients behind a headless Service do: a stream
//! that ends or a connection that fails moves to the next replica in the address list. One
//! replica is killed while every CR is written: its subscribers move to the other two, which
//! already watch every CR. Then every replica is killed and one fresh replica takes all the
//! subscribers at once, a restart storm. At the end every subscriber must hold its CR's final
//! resourceVersion. It runs several ways ([`Way`]): native subscribers that subscribe afresh,
//! that resume with the uid and resourceVersion they hold (ADR 0026), flagd sync subscribers
//! (whose protocol cannot resume), and with the replicas pacing new streams
//! (`--max-new-streams-per-second`, the clients waiting as each refusal says): for the bytes the
//! move costs, how soon the moved are served again, and what the survivors' own subscribers
//! and the survivors' CPU and memory went through meanwhile.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use crd_broker::pb;
use crd_broker::pb::broker_client::BrokerClient;
use crd_broker::pb::flagd::SyncFlagsRequest;
use crd_broker::pb::flagd::flag_sync_service_client::FlagSyncServiceClient;
use crd_broker::pb::subscribe_response::Event;
use fake_apiserver::FakeApiServer;
use prost::Message;
use serde::Serialize;
use serde_json::json;
use tokio::sync::RwLock;
use tonic::transport::Channel;

use crate::Run;
use crate::clients::{self, now_nanos, number_after, tokio_util_like};
use crate::fixtures::{GV, least_and_most, name, requests_per_cr, wait_until};
use crate::target::Target;

/// How a run of the scenario goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Way {
    /// Native subscribers resume with the version they hold.
    pub resume: bool,
    /// The writes pause while the killed replica's subscribers move.
    pub quiet: bool,
    /// flagd sync subscribers (`SyncFlags` on each CR) instead of native ones.
    pub flagd: bool,
    /// Each replica's `--max-new-streams-per-second` (0: none).
    pub pace: f64,
}

/// What the scenario measured.
#[derive(Debug, Clone, Serialize)]
pub struct Failover {
    /// Subscribers, spread over the replicas.
    pub subscribers: usize,
    /// Custom resources they ask for.
    pub crs: usize,
    /// Replicas at the start.
    pub replicas: usize,
    /// Subscribers on the replica that was killed.
    pub moved: usize,
    /// Seconds from the kill until the last of them held a state from another replica.
    pub moved_seconds: f64,
    /// Seconds from the kill until half of them, and 99 %, did.
    pub moved_p50_seconds: f64,
    /// See `moved_p50_seconds`.
    pub moved_p99_seconds: f64,
    /// LISTs and WATCHes the API server saw while they moved (the survivors already watched
    /// every CR: goal 0 and 0).
    pub moved_lists: usize,
    /// See `moved_lists`.
    pub moved_watches: usize,
    /// Seconds from the fresh replica listening until every subscriber held a state from it.
    pub storm_seconds: f64,
    /// LISTs per CR in the restart storm: the least and the most (goal 1 and 1).
    pub storm_lists_per_cr: (usize, usize),
    /// WATCHes per CR in the restart storm: the least and the most (goal 1 and 1).
    pub storm_watches_per_cr: (usize, usize),
    /// Writes to the CRs during the run.
    pub writes: u64,
    /// Subscribers not on their CR's final resourceVersion at the end (goal 0).
    pub lost: usize,
    /// Whether the subscribers resume with the version they hold.
    pub resume: bool,
    /// Whether the writes paused while the killed replica's subscribers moved.
    pub quiet_move: bool,
    /// Bytes the moved subscribers were sent from the kill until the last of them was served
    /// again (gRPC messages with their 5-byte prefixes).
    pub moved_bytes: u64,
    /// What their states cost sent whole: each moved subscriber's last state's message.
    pub moved_full_bytes: u64,
    /// Moved subscribers whose first message on another replica was CURRENT.
    pub moved_current: usize,
    /// Moved subscribers whose CR did not change while they moved (their first message on
    /// another replica was of the state they held).
    pub moved_unchanged: usize,
    /// The bytes of those subscribers' first messages on another replica.
    pub unchanged_bytes: u64,
    /// What those first messages cost as whole states.
    pub unchanged_full_bytes: u64,
    /// Whether the subscribers were flagd sync streams.
    pub flagd: bool,
    /// Each replica's `--max-new-streams-per-second` (0: none).
    pub pace: f64,
    /// New streams the survivors refused for their pace while the subscribers moved.
    pub refused: u64,
    /// The survivors' own subscribers (not moved): write → receipt p99 over the second before
    /// the kill, and during the move (from the kill until the last moved subscriber was served
    /// again, a second at least); the most any waited then; how many deliveries each window had.
    pub survivors_usual_p99_seconds: f64,
    /// See `survivors_usual_p99_seconds`.
    pub survivors_move_p99_seconds: f64,
    /// See `survivors_usual_p99_seconds`.
    pub survivors_move_max_seconds: f64,
    /// See `survivors_usual_p99_seconds`.
    pub survivors_usual_deliveries: usize,
    /// See `survivors_usual_p99_seconds`.
    pub survivors_move_deliveries: usize,
    /// The survivors' CPU during the move: the busiest 100 ms of either, in cores, and the CPU
    /// seconds both used.
    pub survivors_cpu_peak_cores: f64,
    /// See `survivors_cpu_peak_cores`.
    pub survivors_cpu_seconds: f64,
    /// The survivors' resident memory, the larger of the two: at the kill, and at its peak
    /// during the move.
    pub survivors_rss_before_bytes: u64,
    /// See `survivors_rss_before_bytes`.
    pub survivors_rss_peak_bytes: u64,
}

/// No replica: a subscriber between streams.
const NONE: usize = usize::MAX;

/// The address list the subscribers resolve, as DNS for a headless Service would give it:
/// each live replica's id and connections.
type Pool = RwLock<Vec<(usize, Vec<Channel>)>>;

/// What each subscriber holds: the replica its stream is on, when that stream's first message
/// came, the resourceVersion of the last state, its uid, and its message's size; and what the
/// moved subscribers were sent while they moved.
struct Seen {
    replica: Vec<AtomicUsize>,
    served_at: Vec<AtomicU64>,
    rv: Vec<AtomicU64>,
    uid: Vec<std::sync::Mutex<String>>,
    state_bytes: Vec<AtomicU64>,
    /// Whether the subscriber was on the replica killed.
    moving: Vec<std::sync::atomic::AtomicBool>,
    /// Bytes sent to the moving subscribers, and how many began again with CURRENT.
    moved_bytes: AtomicU64,
    moved_current: AtomicUsize,
    /// The resourceVersion each held when its replica was killed.
    rv_at_kill: Vec<AtomicU64>,
    /// Moving subscribers whose first message was of the state they held, that message's bytes,
    /// and what it would have cost whole.
    unchanged: AtomicUsize,
    unchanged_bytes: AtomicU64,
    unchanged_full_bytes: AtomicU64,
    /// Deliveries of a write to a subscriber not moving: when (epoch nanoseconds) and how long
    /// after the write.
    deliveries: std::sync::Mutex<Vec<(u64, u64)>>,
    /// Streams refused for a replica's pace.
    refused: AtomicU64,
}

impl Seen {
    fn new(n: usize) -> Self {
        Seen {
            replica: (0..n).map(|_| AtomicUsize::new(NONE)).collect(),
            served_at: (0..n).map(|_| AtomicU64::new(0)).collect(),
            rv: (0..n).map(|_| AtomicU64::new(0)).collect(),
            uid: (0..n).map(|_| std::sync::Mutex::default()).collect(),
            state_bytes: (0..n).map(|_| AtomicU64::new(0)).collect(),
            moving: (0..n).map(|_| Default::default()).collect(),
            moved_bytes: AtomicU64::new(0),
            moved_current: AtomicUsize::new(0),
            rv_at_kill: (0..n).map(|_| AtomicU64::new(0)).collect(),
            unchanged: AtomicUsize::new(0),
            unchanged_bytes: AtomicU64::new(0),
            unchanged_full_bytes: AtomicU64::new(0),
            deliveries: std::sync::Mutex::default(),
            refused: AtomicU64::new(0),
        }
    }

    /// The request of subscriber `slot` for `name`: with the version it holds, if it resumes.
    fn request(&self, slot: usize, name: &str, resume: bool) -> pb::SubscribeRequest {
        let mut request = clients::subscribe_request(name);
        let uid = self.uid[slot]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        if resume && !uid.is_empty() {
            request.resources[0].uid = uid;
            request.resources[0].resource_version =
                self.rv[slot].load(Ordering::Relaxed).to_string();
        }
        request
    }

    fn on(&self, replica: usize) -> usize {
        self.replica
            .iter()
            .filter(|r| r.load(Ordering::Relaxed) == replica)
            .count()
    }
}

/// One subscriber: subscribes on the next replica of the pool, follows the stream, and moves on
/// when it ends.
async fn roam(
    pool: Arc<Pool>,
    name: String,
    slot: usize,
    mut turn: usize,
    seen: Arc<Seen>,
    way: Way,
    stop: tokio_util_like::Stop,
) {
    loop {
        let picked = {
            let pool = pool.read().await;
            (!pool.is_empty()).then(|| {
                let (id, channels) = &pool[turn % pool.len()];
                (*id, channels[slot % channels.len()].clone())
            })
        };
        turn += 1;
        let mut told = None;
        if let Some((id, channel)) = picked {
            let ended = match way.flagd {
                true => follow_flagd(id, channel, &name, slot, &seen, &stop).await,
                false => follow(id, channel, &name, slot, &seen, way.resume, &stop).await,
            };
            told = ended.and_then(|status| retry_after(&status));
        }
        seen.replica[slot].store(NONE, Ordering::Relaxed);
        if told.is_some() {
            seen.refused.fetch_add(1, Ordering::Relaxed);
        }
        // A short, spread pause before the next try, as a client's backoff would have; or as
        // long as a refusal said.
        let pause = told.unwrap_or_else(|| Duration::from_millis(20 + fastrand::u64(0..80)));
        tokio::select! {
            _ = stop.wait() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

async fn follow(
    id: usize,
    channel: Channel,
    name: &str,
    slot: usize,
    seen: &Seen,
    resume: bool,
    stop: &tokio_util_like::Stop,
) -> Option<tonic::Status> {
    let mut client = BrokerClient::new(channel);
    let request = seen.request(slot, name, resume);
    let response = match client.subscribe(request).await {
        Ok(response) => response,
        Err(status) => return Some(status),
    };
    let mut stream = response.into_inner();
    let mut first = true;
    loop {
        let message = tokio::select! {
            _ = stop.wait() => return None,
            m = stream.message() => m,
        };
        let m = match message {
            Ok(Some(m)) => m,
            Ok(None) => return None,
            Err(status) => return Some(status),
        };
        let bytes = m.encoded_len() as u64 + 5;
        if !m.object.is_empty() {
            seen.delivered(slot, &m.object);
        }
        let moving = seen.moving[slot].load(Ordering::Relaxed);
        if moving {
            seen.moved_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        let rv: u64 = m.resource_version.parse().unwrap_or(0);
        if moving && first && rv == seen.rv_at_kill[slot].load(Ordering::Relaxed) {
            seen.unchanged.fetch_add(1, Ordering::Relaxed);
            seen.unchanged_bytes.fetch_add(bytes, Ordering::Relaxed);
            let whole = seen.state_bytes[slot].load(Ordering::Relaxed);
            seen.unchanged_full_bytes
                .fetch_add(whole, Ordering::Relaxed);
        }
        if m.event() == Event::Current {
            if moving && first {
                seen.moved_current.fetch_add(1, Ordering::Relaxed);
            }
        } else if !m.object.is_empty() {
            seen.state_bytes[slot].store(bytes, Ordering::Relaxed);
            *seen.uid[slot]
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = m.uid.clone();
        }
        if rv != 0 {
            seen.rv[slot].store(rv, Ordering::Relaxed);
        }
        if std::mem::take(&mut first) {
            seen.served_at[slot].store(now_nanos(), Ordering::Relaxed);
            seen.replica[slot].store(id, Ordering::Relaxed);
        }
    }
}

/// How long a refusal for a replica's pace says to wait (`grpc-retry-pushback-ms`).
fn retry_after(status: &tonic::Status) -> Option<Duration> {
    if status.code() != tonic::Code::ResourceExhausted {
        return None;
    }
    let millis = status
        .metadata()
        .get(crd_broker::access::RETRY_PUSHBACK)?
        .to_str()
        .ok()?
        .parse()
        .ok()?;
    Some(Duration::from_millis(millis))
}

/// A flagd sync subscriber on replica `id`: `SyncFlags` for its CR. Its configuration carries
/// no resourceVersion: the CR's write number (plus one) stands for it, and a moved subscriber's
/// CR is unchanged when its first configuration has the write it held.
async fn follow_flagd(
    id: usize,
    channel: Channel,
    name: &str,
    slot: usize,
    seen: &Seen,
    stop: &tokio_util_like::Stop,
) -> Option<tonic::Status> {
    let mut client = FlagSyncServiceClient::new(channel)
        .max_decoding_message_size(crd_broker::grpc::flagd::MAX_MESSAGE);
    let request = SyncFlagsRequest {
        provider_id: String::new(),
        selector: format!("core.openfeature.dev/default/{name}"),
    };
    let mut stream = match client.sync_flags(request).await {
        Ok(response) => response.into_inner(),
        Err(status) => return Some(status),
    };
    let mut first = true;
    loop {
        let message = tokio::select! {
            _ = stop.wait() => return None,
            m = stream.message() => m,
        };
        let m = match message {
            Ok(Some(m)) => m,
            Ok(None) => return None,
            Err(status) => return Some(status),
        };
        let bytes = m.encoded_len() as u64 + 5;
        let config = m.flag_configuration.as_bytes();
        seen.delivered(slot, config);
        let version = number_after(config, "write").map_or(0, |w| w + 1);
        let moving = seen.moving[slot].load(Ordering::Relaxed);
        if moving {
            seen.moved_bytes.fetch_add(bytes, Ordering::Relaxed);
            if first && version == seen.rv_at_kill[slot].load(Ordering::Relaxed) {
                seen.unchanged.fetch_add(1, Ordering::Relaxed);
                seen.unchanged_bytes.fetch_add(bytes, Ordering::Relaxed);
                let whole = seen.state_bytes[slot].load(Ordering::Relaxed);
                seen.unchanged_full_bytes
                    .fetch_add(whole, Ordering::Relaxed);
            }
        }
        seen.state_bytes[slot].store(bytes, Ordering::Relaxed);
        seen.rv[slot].store(version, Ordering::Relaxed);
        if std::mem::take(&mut first) {
            seen.served_at[slot].store(now_nanos(), Ordering::Relaxed);
            seen.replica[slot].store(id, Ordering::Relaxed);
        }
    }
}

impl Seen {
    /// Subscriber `slot` received a state (`object`, stamped `sentAt` by its write): kept if
    /// the subscriber is not moving, for the survivors' own latency.
    fn delivered(&self, slot: usize, object: &[u8]) {
        if self.moving[slot].load(Ordering::Relaxed) {
            return;
        }
        let Some(sent @ 1..) = number_after(object, "sentAt") else {
            return;
        };
        let now = now_nanos();
        self.deliveries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((now, now.saturating_sub(sent)));
    }

    /// The survivors' deliveries received within `[from, to)`: their p99 and most, in seconds,
    /// and how many.
    fn latency(&self, from: u64, to: u64) -> (f64, f64, usize) {
        let deliveries = self
            .deliveries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut within: Vec<u64> = deliveries
            .iter()
            .filter(|(at, _)| (from..to).contains(at))
            .map(|(_, latency)| *latency)
            .collect();
        within.sort_unstable();
        let p99 = within
            .get(((within.len() as f64 * 0.99).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0);
        let max = within.last().copied().unwrap_or(0);
        (p99 as f64 / 1e9, max as f64 / 1e9, within.len())
    }
}

/// Writes every CR in turn until stopped; the count of writes.
async fn write(
    fake: Arc<FakeApiServer>,
    crs: usize,
    rate: f64,
    stop: tokio_util_like::Stop,
) -> u64 {
    let period = Duration::from_secs_f64(1.0 / rate.max(1.0));
    let mut writes = 0u64;
    loop {
        let k = writes as usize % crs;
        let stamp = json!({ "write": writes, "sentAt": now_nanos() });
        let patch = json!({ "spec": { "flagSpec": { "metadata": stamp } } });
        if fake
            .merge_patch(GV, "featureflags", "default", &name(k), patch)
            .is_ok()
        {
            writes += 1;
        }
        tokio::select! {
            _ = stop.wait() => return writes,
            _ = tokio::time::sleep(period) => {}
        }
    }
}

/// Runs the scenario the [`Way`] says.
pub async fn failover(run: &Run, way: Way) -> anyhow::Result<Failover> {
    let Way {
        resume,
        quiet,
        flagd,
        pace,
    } = way;
    let pace_arg = pace.to_string();
    let args: Vec<&str> = match pace > 0.0 {
        true => vec!["--max-new-streams-per-second", &pace_arg],
        false => Vec::new(),
    };
    const REPLICAS: usize = 3;
    let (fake, dir) = crate::fixtures::fake(run.crs, run.payload_bytes).await?;
    let fake = Arc::new(fake);
    let bin = crate::target::broker_bin(run.broker_bin.clone())?;
    let kubeconfig = dir.path().join("kubeconfig");
    let linger = Duration::from_secs(30);
    let per_replica = (run.connections / REPLICAS).max(1);
    let mut replicas = Vec::new();
    let mut entries = Vec::new();
    for id in 0..REPLICAS {
        let target = Target::broker(&bin, &kubeconfig, linger, &args).await?;
        entries.push((
            id,
            clients::connections(target.grpc, per_replica, run.sources).await?,
        ));
        replicas.push(target);
    }
    let pool = Arc::new(RwLock::new(entries));
    let n = run.subscribers;
    let seen = Arc::new(Seen::new(n));
    let (trigger, stop) = tokio_util_like::signal();
    for slot in 0..n {
        // CR `slot % crs`, first on replica `slot / crs` (mod 3): each replica serves some
        // subscribers of every CR.
        let (cr, turn) = (slot % run.crs, slot / run.crs);
        tokio::spawn(roam(
            pool.clone(),
            name(cr),
            slot,
            turn,
            seen.clone(),
            way,
            stop.clone(),
        ));
    }
    let all_served = |on: &[usize]| {
        let seen = seen.clone();
        let on = on.to_vec();
        move || {
            seen.replica
                .iter()
                .all(|r| on.contains(&r.load(Ordering::Relaxed)))
        }
    };
    wait_until(
        "every subscriber served",
        Duration::from_secs(120),
        all_served(&[0, 1, 2]),
    )
    .await?;
    let writing = || {
        let (stop_writes, writes_stop) = tokio_util_like::signal();
        let writer = tokio::spawn(write(fake.clone(), run.crs, run.rate, writes_stop));
        (stop_writes, writer)
    };
    let (mut stop_writes, mut writer) = writing();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut writes = 0;
    if quiet {
        // Nothing changes while they move: every subscriber on its CR's last state first.
        stop_writes.stop();
        writes += (&mut writer).await.unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // One replica is SIGKILLed and leaves the address list, as its endpoint would.
    fake.clear_requests();
    let moved = seen.on(0);
    let mut moved_full_bytes = 0;
    for slot in 0..n {
        if seen.replica[slot].load(Ordering::Relaxed) == 0 {
            let held = seen.rv[slot].load(Ordering::Relaxed);
            seen.rv_at_kill[slot].store(held, Ordering::Relaxed);
            seen.moving[slot].store(true, Ordering::Relaxed);
            moved_full_bytes += seen.state_bytes[slot].load(Ordering::Relaxed);
        }
    }
    pool.write().await.retain(|(id, _)| *id != 0);
    let killed_at = now_nanos();
    let survivors: Vec<u32> = replicas[1..].iter().map(Target::pid).collect();
    let refused_before = seen.refused.load(Ordering::Relaxed);
    let (stop_sampling, sampling_stop) = tokio_util_like::signal();
    let sampler = tokio::spawn(sample(survivors.clone(), sampling_stop));
    replicas.remove(0).stop().await;
    wait_until(
        "the killed replica's subscribers on the others",
        Duration::from_secs(120),
        all_served(&[1, 2]),
    )
    .await?;
    let moved_seconds = last_served_after(&seen, killed_at);
    let moved_bytes = seen.moved_bytes.load(Ordering::Relaxed);
    let moved_current = seen.moved_current.load(Ordering::Relaxed);
    let moved_unchanged = seen.unchanged.load(Ordering::Relaxed);
    let unchanged_bytes = seen.unchanged_bytes.load(Ordering::Relaxed);
    let unchanged_full_bytes = seen.unchanged_full_bytes.load(Ordering::Relaxed);
    let mut served: Vec<f64> = (0..n)
        .filter(|&slot| seen.moving[slot].load(Ordering::Relaxed))
        .map(|slot| {
            let at = seen.served_at[slot].load(Ordering::Relaxed);
            at.saturating_sub(killed_at) as f64 / 1e9
        })
        .collect();
    served.sort_by(f64::total_cmp);
    let quantile = |q: f64| {
        let i = ((served.len() as f64 * q).ceil() as usize).saturating_sub(1);
        served.get(i).copied().unwrap_or(0.0)
    };
    let (moved_p50_seconds, moved_p99_seconds) = (quantile(0.5), quantile(0.99));
    // The survivors' own subscribers, over the move (a second at least), against the second
    // before the kill; the moved ones are told apart until then.
    let window_end = killed_at + (moved_seconds.max(1.0) * 1e9) as u64;
    let until = Duration::from_nanos(window_end.saturating_sub(now_nanos()));
    tokio::time::sleep(until).await;
    stop_sampling.stop();
    let peaks = sampler.await.unwrap_or_default();
    let refused = seen.refused.load(Ordering::Relaxed) - refused_before;
    let (survivors_usual_p99_seconds, _, survivors_usual_deliveries) =
        seen.latency(killed_at.saturating_sub(1_000_000_000), killed_at);
    let (survivors_move_p99_seconds, survivors_move_max_seconds, survivors_move_deliveries) =
        seen.latency(killed_at, window_end);
    for moving in &seen.moving {
        moving.store(false, Ordering::Relaxed);
    }
    if quiet {
        (stop_writes, writer) = writing();
    }
    let moved_lists = requests_per_cr(&fake, run.crs, "list").iter().sum();
    let moved_watches = requests_per_cr(&fake, run.crs, "watch").iter().sum();

    // Every replica is killed; one fresh replica takes everyone at once.
    pool.write().await.clear();
    for target in replicas.drain(..) {
        target.stop().await;
    }
    wait_until(
        "every stream ended",
        Duration::from_secs(60),
        all_served(&[NONE]),
    )
    .await?;
    fake.clear_requests();
    let fresh = Target::broker(&bin, &kubeconfig, linger, &args).await?;
    let started = now_nanos();
    let channels = clients::connections(fresh.grpc, run.connections, run.sources).await?;
    pool.write().await.push((REPLICAS, channels));
    wait_until(
        "every subscriber on the fresh replica",
        Duration::from_secs(120),
        all_served(&[REPLICAS]),
    )
    .await?;
    let storm_seconds = last_served_after(&seen, started);
    stop_writes.stop();
    writes += writer.await.unwrap_or(0);
    let storm_lists_per_cr = least_and_most(&requests_per_cr(&fake, run.crs, "list"));
    let storm_watches_per_cr = least_and_most(&requests_per_cr(&fake, run.crs, "watch"));

    // Every subscriber ends on its CR's final state (for flagd, its last write).
    let finals: Vec<u64> = (0..run.crs)
        .map(|k| {
            let o = fake.get(GV, "featureflags", "default", &name(k)).ok();
            match flagd {
                true => o
                    .and_then(|o| o["spec"]["flagSpec"]["metadata"]["write"].as_u64())
                    .map_or(0, |w| w + 1),
                false => o
                    .and_then(|o| o["metadata"]["resourceVersion"].as_str()?.parse().ok())
                    .unwrap_or(0),
            }
        })
        .collect();
    let settled = |seen: &Seen| {
        (0..n)
            .filter(|&slot| seen.rv[slot].load(Ordering::Relaxed) != finals[slot % run.crs])
            .count()
    };
    let _ = wait_until(
        "every subscriber on the final state",
        Duration::from_secs(5),
        || settled(&seen) == 0,
    )
    .await;
    let lost = settled(&seen);
    trigger.stop();
    fresh.stop().await;
    Ok(Failover {
        subscribers: n,
        crs: run.crs,
        replicas: REPLICAS,
        moved,
        moved_seconds,
        moved_p50_seconds,
        moved_p99_seconds,
        moved_lists,
        moved_watches,
        storm_seconds,
        storm_lists_per_cr,
        storm_watches_per_cr,
        writes,
        lost,
        resume,
        quiet_move: quiet,
        moved_bytes,
        moved_full_bytes,
        moved_current,
        moved_unchanged,
        unchanged_bytes,
        unchanged_full_bytes,
        flagd,
        pace,
        refused,
        survivors_usual_p99_seconds,
        survivors_move_p99_seconds,
        survivors_move_max_seconds,
        survivors_usual_deliveries,
        survivors_move_deliveries,
        survivors_cpu_peak_cores: peaks.cpu_peak_cores,
        survivors_cpu_seconds: peaks.cpu_seconds,
        survivors_rss_before_bytes: peaks.rss_before,
        survivors_rss_peak_bytes: peaks.rss_peak,
    })
}

/// The survivors' CPU and memory over the move.
#[derive(Debug, Default)]
struct Peaks {
    cpu_peak_cores: f64,
    cpu_seconds: f64,
    rss_before: u64,
    rss_peak: u64,
}

/// Samples `pids` every 100 ms until stopped.
async fn sample(pids: Vec<u32>, stop: tokio_util_like::Stop) -> Peaks {
    let cpu = |pid| crate::stats::cpu(pid).as_secs_f64();
    let rss = |pids: &[u32]| {
        pids.iter()
            .map(|&p| crate::stats::rss(p))
            .max()
            .unwrap_or(0)
    };
    let start: Vec<f64> = pids.iter().map(|&p| cpu(p)).collect();
    let mut last = start.clone();
    let mut at = std::time::Instant::now();
    let mut peaks = Peaks {
        rss_before: rss(&pids),
        ..Peaks::default()
    };
    peaks.rss_peak = peaks.rss_before;
    loop {
        tokio::select! {
            _ = stop.wait() => break,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        let elapsed = at.elapsed().as_secs_f64();
        at = std::time::Instant::now();
        for (i, &pid) in pids.iter().enumerate() {
            let now = cpu(pid);
            peaks.cpu_peak_cores = peaks.cpu_peak_cores.max((now - last[i]) / elapsed);
            last[i] = now;
        }
        peaks.rss_peak = peaks.rss_peak.max(rss(&pids));
    }
    peaks.cpu_seconds = pids
        .iter()
        .enumerate()
        .map(|(i, &p)| cpu(p) - start[i])
        .sum();
    peaks
}

/// Seconds from `since` (epoch nanoseconds) to the latest first message of a stream after it.
fn last_served_after(seen: &Seen, since: u64) -> f64 {
    let last = seen
        .served_at
        .iter()
        .map(|t| t.load(Ordering::Relaxed))
        .filter(|&t| t >= since)
        .max()
        .unwrap_or(since);
    (last - since) as f64 / 1e9
}
