//! Scenario (d): subscribers come and go while updates flow.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use serde_json::json;

use crate::Run;
use crate::clients::{self, Recorder, now_nanos, tokio_util_like};
use crate::fixtures::{GV, bar, name, scrape, serve, wait_until};
use crate::stats::Summary;
use crate::target::Kind;

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
        Some(admin) => scrape(admin).await,
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
