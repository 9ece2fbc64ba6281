//! Scenario `connections`: TCP connections from the broker to the API server for many distinct
//! CRs, over HTTP/1.1 (`--api-http2 off`) and HTTP/2 (`auto`), against the fake over TLS with
//! the kube-apiserver's 100 streams per connection. Connections are counted from the broker
//! process's own sockets (its file descriptors matched against the kernel's TCP table), not
//! from its bookkeeping.

use std::time::{Duration, Instant};

use crd_broker::pb;
use crd_broker::pb::broker_client::BrokerClient;
use serde::Serialize;

use crate::Run;
use crate::fixtures::{name, wait_until};
use crate::target::Target;

/// One count.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Distinct CRs watched.
    pub crs: usize,
    /// `off` (HTTP/1.1) or `auto` (HTTP/2).
    pub api_http2: String,
    /// The broker's established TCP connections to the API server once every CR was watched.
    pub connections: usize,
    /// Watches open on the API server then.
    pub watches: usize,
    /// Seconds from the first Subscribe until every CR was watched.
    pub seconds: f64,
    /// The broker's resident memory before the subscriptions and once every CR was watched.
    pub rss_before_bytes: u64,
    /// See `rss_before_bytes`.
    pub rss_after_bytes: u64,
}

/// Every count.
#[derive(Debug, Clone, Serialize)]
pub struct Connections {
    /// By CRs, then mode.
    pub rows: Vec<Row>,
}

/// Resources one Subscribe may name.
const PER_STREAM: usize = 100;

/// The broker's established TCP connections to `port`.
fn connections_of(pid: u32, port: u16) -> usize {
    crate::stats::sockets(pid, "01", crate::stats::End::Remote, port)
}

async fn count(run: &Run, crs: usize, mode: &str) -> anyhow::Result<Row> {
    let (fake, dir) = crate::fixtures::fake_with(crs, 256, true).await?;
    let bin = crate::target::broker_bin(run.broker_bin.clone())?;
    let target = Target::broker(
        &bin,
        &dir.path().join("kubeconfig"),
        Duration::from_secs(30),
        &["--api-http2", mode, "--namespace-watch-threshold", "0"],
    )
    .await?;
    let channel = crate::clients::connections(target.grpc, 1, 1)
        .await?
        .remove(0);
    let rss_before_bytes = target.rss();
    let started = Instant::now();
    let mut streams = Vec::new();
    let names: Vec<String> = (0..crs).map(name).collect();
    for chunk in names.chunks(PER_STREAM) {
        let request = pb::SubscribeRequest {
            resources: chunk
                .iter()
                .flat_map(|n| crate::clients::subscribe_request(n).resources)
                .collect(),
        };
        let mut client = BrokerClient::new(channel.clone());
        streams.push(client.subscribe(request).await?.into_inner());
    }
    wait_until("every CR watched", Duration::from_secs(300), || {
        fake.open_watches() >= crs
    })
    .await?;
    let seconds = started.elapsed().as_secs_f64();
    // Let discovery and checks settle, then count.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let row = Row {
        crs,
        api_http2: mode.to_string(),
        connections: connections_of(target.pid(), fake.addr().port()),
        watches: fake.open_watches(),
        seconds,
        rss_before_bytes,
        rss_after_bytes: target.rss(),
    };
    drop(streams);
    target.stop().await;
    Ok(row)
}

/// Runs the scenario: 100, 1,000 and 5,000 CRs (the smoke run: 10 and 150), each both ways.
pub async fn connections(run: &Run) -> anyhow::Result<Connections> {
    let sizes: &[usize] = if run.smoke {
        &[10, 150]
    } else {
        &[100, 1_000, 5_000]
    };
    let mut rows = Vec::new();
    for &crs in sizes {
        for mode in ["off", "auto"] {
            rows.push(count(run, crs, mode).await?);
        }
    }
    Ok(Connections { rows })
}
