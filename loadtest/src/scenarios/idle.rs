//! The memory of idle one-stream sidecars, on the broker and on the bare server.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;

use crate::Run;
use crate::clients;
use crate::fixtures::{bar, name, serve, warm_every_watch};
use crate::target::Kind;

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

/// The idle-memory scenario.
pub async fn idle(run: &Run) -> anyhow::Result<Idle> {
    Ok(Idle {
        broker: idle_on(run, Kind::Broker).await?,
        bare: idle_on(run, Kind::Bare).await?,
    })
}
