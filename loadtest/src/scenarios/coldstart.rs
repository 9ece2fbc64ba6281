//! Scenario `coldstart`: a cold subscribe's first message against one LIST and the start of one
//! WATCH on the same API server, made by a kube-rs client as the broker's (HTTP/1.1, the same
//! field selector). Both one at a time and 100 at once.

use std::time::{Duration, Instant};

use crd_broker::pb::broker_client::BrokerClient;
use kube::api::{Api, DynamicObject, ListParams, WatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde::Serialize;

use crate::Run;
use crate::fixtures::name;
use crate::stats::{Histogram, Summary};
use crate::target::Target;

/// What it measured.
#[derive(Debug, Clone, Serialize)]
pub struct ColdStart {
    /// One at a time: a cold subscribe's first message.
    pub broker_alone: Summary,
    /// One at a time: LIST, then WATCH response headers.
    pub list_watch_alone: Summary,
    /// At once: each of the cold subscribes' first messages.
    pub broker_at_once: Summary,
    /// At once: each LIST + WATCH.
    pub list_watch_at_once: Summary,
    /// Medians, broker ÷ LIST + WATCH: alone, and at once.
    pub ratio_alone: f64,
    /// See `ratio_alone`.
    pub ratio_at_once: f64,
}

/// CRs in each batch.
const AT_ONCE: usize = 100;
/// One-at-a-time samples.
const ALONE: usize = 50;

fn api(fake: &fake_apiserver::FakeApiServer) -> anyhow::Result<Api<DynamicObject>> {
    let mut config = kube::Config::new(fake.url().parse()?);
    config.read_timeout = Some(crd_broker::source::kubernetes::READ_TIMEOUT);
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("core.openfeature.dev", "v1beta1", "FeatureFlag"),
        "featureflags",
    );
    Ok(Api::namespaced_with(
        kube::Client::try_from(config)?,
        "default",
        &resource,
    ))
}

/// One LIST and the start of one WATCH of `name`, as the broker makes them.
async fn list_watch(api: Api<DynamicObject>, name: String) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let field = format!("metadata.name={name}");
    let list = api.list(&ListParams::default().fields(&field)).await?;
    let rv = list.metadata.resource_version.unwrap_or_default();
    let watch = api
        .watch(&WatchParams::default().fields(&field).timeout(290), &rv)
        .await?;
    let took = started.elapsed();
    drop(watch);
    Ok(took)
}

/// A cold subscribe to `name`: the time to its first message.
async fn subscribe(channel: tonic::transport::Channel, name: String) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut stream = BrokerClient::new(channel)
        .subscribe(crate::clients::subscribe_request(&name))
        .await?
        .into_inner();
    stream.message().await?;
    let took = started.elapsed();
    // Keep the stream a moment, as a subscriber would, then leave.
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop(stream);
    });
    Ok(took)
}

/// Runs the scenario.
pub async fn coldstart(run: &Run) -> anyhow::Result<ColdStart> {
    let total = 2 * (AT_ONCE + ALONE);
    let (fake, dir) = crate::fixtures::fake(total, run.payload_bytes).await?;
    let bin = crate::target::broker_bin(run.broker_bin.clone())?;
    let target = Target::broker(
        &bin,
        &dir.path().join("kubeconfig"),
        Duration::from_secs(30),
        &[],
    )
    .await?;
    let channels = crate::clients::connections(target.grpc, 10, run.sources).await?;
    let api = api(&fake)?;
    // Discovery and the connection pools warm, as on a broker that has served anything.
    subscribe(channels[0].clone(), name(total - 1)).await?;
    list_watch(api.clone(), name(total - 1)).await?;
    let (broker_alone, list_watch_alone) = (Histogram::default(), Histogram::default());
    for i in 0..ALONE {
        broker_alone.record(subscribe(channels[i % 10].clone(), name(i)).await?);
        list_watch_alone.record(list_watch(api.clone(), name(ALONE + i)).await?);
    }
    let at_once = |offset: usize, broker: bool| {
        let (channels, api) = (channels.clone(), api.clone());
        async move {
            let h = Histogram::default();
            let tasks: Vec<_> = (0..AT_ONCE)
                .map(|i| {
                    let n = name(offset + i);
                    let (channel, api) = (channels[i % 10].clone(), api.clone());
                    tokio::spawn(async move {
                        if broker {
                            subscribe(channel, n).await
                        } else {
                            list_watch(api, n).await
                        }
                    })
                })
                .collect();
            for task in tasks {
                h.record(task.await??);
            }
            anyhow::Ok(h)
        }
    };
    let broker_at_once = at_once(2 * ALONE, true).await?;
    let list_watch_at_once = at_once(2 * ALONE + AT_ONCE, false).await?;
    target.stop().await;
    let ratio = |a: &Histogram, b: &Histogram| {
        a.quantile(0.5).as_secs_f64() / b.quantile(0.5).as_secs_f64().max(1e-9)
    };
    Ok(ColdStart {
        ratio_alone: ratio(&broker_alone, &list_watch_alone),
        ratio_at_once: ratio(&broker_at_once, &list_watch_at_once),
        broker_alone: broker_alone.summary(),
        list_watch_alone: list_watch_alone.summary(),
        broker_at_once: broker_at_once.summary(),
        list_watch_at_once: list_watch_at_once.summary(),
    })
}
