//! Readers that never read, while large updates flow.

use std::net::Ipv4Addr;
use std::time::Duration;

use futures::StreamExt;
use serde::Serialize;
use serde_json::{Value, json};

use crate::Run;
use crate::clients;
use crate::fixtures::{GV, name, serve, warm_every_watch};
use crate::target::Kind;

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
