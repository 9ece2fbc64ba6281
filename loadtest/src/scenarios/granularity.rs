//! Scenario `granularity`: the API server's cost of per-object watches against adaptive ones
//! (`--namespace-watch-threshold 1`: one namespace watch wherever at least one object in four is
//! watched), for 10, 100 and 1,000 names watched in a namespace of 1,000 FeatureFlags while
//! writes go to all of them: watches open, bytes the API server sent the broker, and the
//! broker's CPU.

use std::time::{Duration, Instant};

use crd_broker::pb;
use crd_broker::pb::broker_client::BrokerClient;
use serde::Serialize;
use serde_json::json;

use crate::Run;
use crate::fixtures::{GV, name, wait_until};
use crate::target::Target;

/// One run.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Names watched.
    pub names: usize,
    /// FeatureFlags in the namespace.
    pub objects: usize,
    /// `per-object` (threshold 0) or `adaptive` (threshold 1: a namespace watch wherever enough
    /// of the namespace is watched).
    pub granularity: String,
    /// Watches open on the API server while the writes went on.
    pub watches: usize,
    /// Bytes the API server sent the broker during the writes.
    pub bytes: u64,
    /// Writes (spread over every object in the namespace).
    pub writes: usize,
    /// The broker's CPU during the writes, in seconds.
    pub cpu_seconds: f64,
    /// Seconds from the first Subscribe until every name had its state.
    pub subscribe_seconds: f64,
}

/// Every run.
#[derive(Debug, Clone, Serialize)]
pub struct Granularity {
    /// By names watched, then granularity.
    pub rows: Vec<Row>,
}

async fn measure(run: &Run, names: usize, objects: usize, threshold: &str) -> anyhow::Result<Row> {
    let (fake, dir) = crate::fixtures::fake(objects, 256).await?;
    let bin = crate::target::broker_bin(run.broker_bin.clone())?;
    let target = Target::broker(
        &bin,
        &dir.path().join("kubeconfig"),
        Duration::from_secs(30),
        &["--namespace-watch-threshold", threshold],
    )
    .await?;
    let channel = crate::clients::connections(target.grpc, 1, 1)
        .await?
        .remove(0);
    let started = Instant::now();
    let mut streams = Vec::new();
    let watched: Vec<String> = (0..names).map(name).collect();
    for chunk in watched.chunks(100) {
        let request = pb::SubscribeRequest {
            resources: chunk
                .iter()
                .flat_map(|n| crate::clients::subscribe_request(n).resources)
                .collect(),
        };
        let mut stream = BrokerClient::new(channel.clone())
            .subscribe(request)
            .await?
            .into_inner();
        for _ in chunk {
            stream.message().await?;
        }
        streams.push(stream);
    }
    let subscribe_seconds = started.elapsed().as_secs_f64();
    // A watch per name, or (adaptive, once its namespace watch has listed) one for all if
    // enough of the namespace is watched, else a watch per name again.
    let settled = |n: usize| n == names || (threshold != "0" && n == 1);
    wait_until("the watches settled", Duration::from_secs(60), || {
        settled(fake.open_watches())
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    wait_until("the watches settled", Duration::from_secs(60), || {
        settled(fake.open_watches())
    })
    .await?;
    let (bytes_before, cpu_before) = (fake.bytes_sent(), target.cpu());
    let writes = objects * 2;
    for w in 0..writes {
        let patch = json!({ "spec": { "flagSpec": { "metadata": { "write": w } } } });
        fake.merge_patch(GV, "featureflags", "default", &name(w % objects), patch)?;
        if w % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // Let the last events reach the broker.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let row = Row {
        names,
        objects,
        granularity: if threshold == "0" {
            "per-object"
        } else {
            "adaptive"
        }
        .to_string(),
        watches: fake.open_watches(),
        bytes: fake.bytes_sent() - bytes_before,
        writes,
        cpu_seconds: (target.cpu() - cpu_before).as_secs_f64(),
        subscribe_seconds,
    };
    drop(streams);
    target.stop().await;
    Ok(row)
}

/// Runs the scenario: 10, 100 and 1,000 names in a namespace of 1,000, and 10 of 10 and 100 of
/// 100 (the smoke run: 4 and 20 of 20), each way.
pub async fn granularity(run: &Run) -> anyhow::Result<Granularity> {
    let sizes: &[(usize, usize)] = if run.smoke {
        &[(4, 20), (20, 20)]
    } else {
        &[
            (10, 1_000),
            (100, 1_000),
            (1_000, 1_000),
            (10, 10),
            (100, 100),
        ]
    };
    let mut rows = Vec::new();
    for &(names, objects) in sizes {
        // Threshold 0: a watch per name; 1: one namespace watch for any two names or more.
        for threshold in ["0", "1"] {
            rows.push(measure(run, names, objects, threshold).await?);
        }
    }
    Ok(Granularity { rows })
}
