//! Scenario (c): a reconnect storm at a broker with no watches.

use std::time::{Duration, Instant};

use serde::Serialize;
use std::sync::atomic::Ordering;

use crate::Run;
use crate::clients::{self, Recorder, tokio_util_like};
use crate::fixtures::{
    bar, firsts, least_and_most, name, requests_per_cr, serve, start_subscribers, wait_until,
};
use crate::stats::Summary;
use crate::target::Kind;

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
