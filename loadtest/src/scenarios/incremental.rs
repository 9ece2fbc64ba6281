//! Scenario `incremental`: what one write to one FeatureFlag of a label-selected set costs its
//! flagd sync streams, sent whole (the merged configuration of every member, as flagd-proxy
//! and flagd's own sync server send it) and as incremental updates (the header
//! `crd-broker-incremental-updates: true`: the written FeatureFlag's flag set alone), for sets
//! of 10, 100 and 1,000 FeatureFlags. Bytes and messages per write per stream, the broker's CPU
//! for the writes, and a check that every incremental stream, read as flagd's store reads it,
//! ends with the same flags as the whole ones.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use crd_broker::pb::flagd::SyncFlagsRequest;
use crd_broker::pb::flagd::flag_sync_service_client::FlagSyncServiceClient;
use prost::Message;
use serde::Serialize;
use serde_json::{Value, json};

use crate::Run;
use crate::fixtures::{GV, wait_until};
use crate::target::Target;

/// Flags in each FeatureFlag of the set.
const FLAGS: usize = 4;

/// One way of sending, for one size of set.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// FeatureFlags in the set.
    pub members: usize,
    /// `whole` or `incremental`.
    pub updates: String,
    /// Streams of the set.
    pub streams: usize,
    /// Writes, each to one FeatureFlag, each waited for on every stream.
    pub writes: usize,
    /// The first message's bytes on one stream.
    pub first_bytes: u64,
    /// Bytes each stream was sent per write (gRPC messages with their 5-byte prefix).
    pub bytes_per_write: f64,
    /// Messages each stream was sent per write.
    pub messages_per_write: f64,
    /// The broker's CPU for the writes, in seconds.
    pub cpu_seconds: f64,
}

/// Every run, with incremental ÷ whole per set size.
#[derive(Debug, Clone, Serialize)]
pub struct Incremental {
    /// By set size, whole then incremental.
    pub rows: Vec<Row>,
    /// Bytes per write, incremental ÷ whole, by set size.
    pub ratios: Vec<(usize, f64)>,
}

/// The FeatureFlag `k` of the set, about `payload` bytes: [`FLAGS`] flags, the first of them
/// marked with write `seq`.
fn member(k: usize, payload: usize, seq: usize) -> Value {
    let padding = "x".repeat(payload.saturating_sub(600) / FLAGS);
    let flags: serde_json::Map<String, Value> = (0..FLAGS)
        .map(|i| {
            let seq = if i == 0 { seq } else { 0 };
            let flag = json!({ "state": "ENABLED", "variants": { "on": true, "off": false },
                "defaultVariant": "on", "metadata": { "seq": seq, "padding": padding } });
            (format!("m{k}-{i}"), flag)
        })
        .collect();
    json!({
        "apiVersion": GV, "kind": "FeatureFlag",
        "metadata": { "name": format!("set-{k}"), "namespace": "default", "labels": { "app": "incremental" } },
        "spec": { "flagSpec": { "flags": flags } },
    })
}

/// What one stream was sent: messages and bytes after the first, the first's bytes, and the
/// flags it holds, read as flagd's store reads them (incremental: only the flag sets a message
/// names are replaced).
#[derive(Default)]
struct Seen {
    messages: AtomicU64,
    bytes: AtomicU64,
    first_bytes: AtomicU64,
    flags: std::sync::Mutex<BTreeMap<String, Value>>,
}

impl Seen {
    fn apply(&self, config: &str, incremental: bool) {
        let config: Value = serde_json::from_str(config).unwrap_or(Value::Null);
        let mut flags = self.flags.lock().unwrap_or_else(|e| e.into_inner());
        let incoming = config["flags"].as_object().cloned().unwrap_or_default();
        if !incremental {
            *flags = incoming.into_iter().collect();
            return;
        }
        let set_of = |flag: &Value| flag["metadata"]["flagSetId"].as_str().map(str::to_string);
        let mut named: Vec<Option<String>> = incoming.values().map(set_of).collect();
        named.push(config["metadata"]["flagSetId"].as_str().map(str::to_string));
        flags.retain(|_, flag| !named.contains(&set_of(flag)));
        flags.extend(incoming);
    }

    /// The flags held, without the flag sets incremental updates name.
    fn flags(&self) -> BTreeMap<String, Value> {
        let mut flags = self.flags.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for flag in flags.values_mut() {
            if let Some(metadata) = flag.get_mut("metadata").and_then(Value::as_object_mut) {
                metadata.remove("flagSetId");
            }
        }
        flags
    }
}

const SET: &str = "core.openfeature.dev/default?labelSelector=app%3Dincremental";

/// `streams` streams of the set, each way in turn, through `writes` writes.
async fn measure(
    run: &Run,
    members: usize,
    streams: usize,
    writes: usize,
) -> anyhow::Result<Vec<Row>> {
    let (fake, dir) = crate::fixtures::fake(0, 0).await?;
    for k in 0..members {
        fake.apply(member(k, run.payload_bytes, 0))?;
    }
    let bin = crate::target::broker_bin(run.broker_bin.clone())?;
    let target = Target::broker(
        &bin,
        &dir.path().join("kubeconfig"),
        Duration::from_secs(30),
        &[],
    )
    .await?;
    let channel = crate::clients::connections(target.grpc, 1, 1)
        .await?
        .remove(0);
    let client = FlagSyncServiceClient::new(channel)
        .max_decoding_message_size(crd_broker::grpc::flagd::MAX_MESSAGE);
    let mut rows = Vec::new();
    let mut seq = 0;
    for incremental in [false, true] {
        let mut seen = Vec::new();
        let mut tasks = Vec::new();
        for _ in 0..streams {
            let mut request = tonic::Request::new(SyncFlagsRequest {
                provider_id: String::new(),
                selector: SET.into(),
            });
            if incremental {
                request
                    .metadata_mut()
                    .insert(crd_broker::grpc::flagd::INCREMENTAL_HEADER, "true".parse()?);
            }
            let mut stream = client.clone().sync_flags(request).await?.into_inner();
            let first = stream.message().await?.context("no first message")?;
            let mine = Arc::new(Seen::default());
            mine.first_bytes
                .store(first.encoded_len() as u64 + 5, Ordering::Relaxed);
            mine.apply(&first.flag_configuration, incremental);
            seen.push(mine.clone());
            tasks.push(tokio::spawn(async move {
                while let Ok(Some(message)) = stream.message().await {
                    mine.apply(&message.flag_configuration, incremental);
                    mine.bytes
                        .fetch_add(message.encoded_len() as u64 + 5, Ordering::Relaxed);
                    mine.messages.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        // Each write changes one FeatureFlag and is waited for on every stream, so that
        // whole configurations are not coalesced into fewer than the writes.
        let cpu_before = target.cpu();
        for w in 0..writes {
            seq += 1;
            fake.apply(member(w * 7 % members, run.payload_bytes, seq))?;
            wait_until(
                "every stream took the write",
                Duration::from_secs(30),
                || {
                    seen.iter()
                        .all(|s| s.messages.load(Ordering::Relaxed) > w as u64)
                },
            )
            .await?;
        }
        let cpu_seconds = (target.cpu() - cpu_before).as_secs_f64();
        let fetched = client
            .clone()
            .fetch_all_flags(crd_broker::pb::flagd::FetchAllFlagsRequest {
                provider_id: String::new(),
                selector: SET.into(),
            })
            .await?
            .into_inner()
            .flag_configuration;
        let fetched: Value = serde_json::from_str(&fetched)?;
        let whole: BTreeMap<String, Value> = fetched["flags"]
            .as_object()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .collect();
        for s in &seen {
            anyhow::ensure!(
                s.flags() == whole,
                "a stream ends with other flags than the set's ({})",
                if incremental { "incremental" } else { "whole" }
            );
        }
        for task in tasks {
            task.abort();
        }
        let per_write = |f: fn(&Seen) -> u64| {
            seen.iter().map(|s| f(s)).sum::<u64>() as f64 / (streams * writes) as f64
        };
        rows.push(Row {
            members,
            updates: if incremental { "incremental" } else { "whole" }.into(),
            streams,
            writes,
            first_bytes: seen[0].first_bytes.load(Ordering::Relaxed),
            bytes_per_write: per_write(|s| s.bytes.load(Ordering::Relaxed)),
            messages_per_write: per_write(|s| s.messages.load(Ordering::Relaxed)),
            cpu_seconds,
        });
    }
    target.stop().await;
    Ok(rows)
}

/// Runs the scenario: sets of 10, 100 and 1,000 FeatureFlags, 10 streams each way, 50 writes
/// (the smoke run: 10 FeatureFlags, 2 streams, 5 writes).
pub async fn incremental(run: &Run) -> anyhow::Result<Incremental> {
    let (sizes, streams, writes): (&[usize], usize, usize) = if run.smoke {
        (&[10], 2, 5)
    } else {
        (&[10, 100, 1_000], 10, 50)
    };
    let mut rows = Vec::new();
    let mut ratios = Vec::new();
    for &members in sizes {
        let pair = measure(run, members, streams, writes).await?;
        ratios.push((members, pair[1].bytes_per_write / pair[0].bytes_per_write));
        rows.extend(pair);
    }
    Ok(Incremental { rows, ratios })
}
