//! Micro-benchmarks of the hot paths: subscribing to and leaving a warm watch, publishing an
//! update to many subscribers, and encoding an update for each protocol (done once per update)
//! and framing it (done once per subscriber).
//!
//! `cargo bench -p crd-broker`

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use crd_broker::grpc::flagd::flag_configuration;
use crd_broker::grpc::frame::{Encoded, Frame, WriteFrame, encode_object};
use crd_broker::grpc::wire;
use crd_broker::pb::subscribe_response::Event;
use crd_broker::registry::{Registry, State};
use crd_broker::selector::Selector;
use crd_broker::source::scripted::Scripted;
use crd_broker::source::{Object, Observed};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use prost::Message;
use tokio_util::sync::CancellationToken;

fn object(size: usize, rv: u64) -> Object {
    let json = format!(
        r#"{{"apiVersion":"core.openfeature.dev/v1beta1","kind":"FeatureFlag","metadata":{{"name":"demo","namespace":"default","resourceVersion":"{rv}","uid":"u"}},"spec":{{"flagSpec":{{"flags":{{"f":{{"state":"ENABLED","variants":{{"on":true,"off":false}},"defaultVariant":"on"}}}},"metadata":{{"padding":"{}"}}}}}}}}"#,
        "x".repeat(size)
    );
    Object {
        json: Bytes::from(json),
        uid: "u".into(),
        resource_version: rv.to_string(),
    }
}

fn selector() -> Selector {
    "featureflags.v1beta1.core.openfeature.dev/default/demo"
        .parse()
        .unwrap()
}

/// A registry on a [`Scripted`] source, fed by the benchmark; subscribe inside a runtime (the
/// first subscribe spawns the watch task).
fn registry() -> (Registry<Scripted>, Scripted) {
    let source = Scripted::default();
    let registry = Registry::new(
        source.clone(),
        Duration::from_secs(3600),
        CancellationToken::new(),
    );
    (registry, source)
}

/// One worker thread for the watch task; the benchmark thread is the subscriber.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

fn subscribe_and_leave(c: &mut Criterion) {
    let rt = runtime();
    let _in_runtime = rt.enter();
    let (registry, _tx) = registry();
    let sel = selector();
    let _keep = registry.subscribe(&sel);
    c.bench_function("registry/subscribe+leave a warm watch", |b| {
        b.iter(|| drop(registry.subscribe(&sel)));
    });
}

fn publish(c: &mut Criterion) {
    let mut group = c.benchmark_group("registry/publish to N subscribers, all observe");
    for n in [1usize, 100, 10_000] {
        let rt = runtime();
        let _in_runtime = rt.enter();
        let (registry, source) = registry();
        let sel = selector();
        let mut subs: Vec<_> = (0..n).map(|_| registry.subscribe(&sel)).collect();
        // What is sent before the watch task has started its watch would be lost.
        while source.live() == 0 {
            std::thread::yield_now();
        }
        let rv = AtomicU64::new(1);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let next = rv.fetch_add(1, Ordering::Relaxed);
                        source.send(&sel, Ok(Observed::Present(object(64, next))));
                        // Every subscriber sees the new state (the watch task published it once).
                        let last = subs.last_mut().unwrap();
                        while !matches!(last.current(), State::Present(ref u) if u.object.resource_version == next.to_string()) {
                            last.changed().await;
                        }
                        for s in subs.iter_mut() {
                            std::hint::black_box(s.current());
                        }
                    }
                    start.elapsed()
                })
            });
        });
    }
    group.finish();
}

fn encode(c: &mut Criterion) {
    let mut group = c.benchmark_group("encode one update");
    for size in [1024usize, 64 * 1024] {
        let obj = object(size, 7);
        group.throughput(Throughput::Bytes(obj.json.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("native shared part", size),
            &obj,
            |b, obj| {
                b.iter(|| {
                    encode_object(
                        "featureflags.v1beta1.core.openfeature.dev/default/demo",
                        obj,
                    )
                });
            },
        );
        group.bench_with_input(
            BenchmarkId::new("flagd configuration", size),
            &obj,
            |b, obj| {
                b.iter(|| {
                    crd_broker::pb::flagd::SyncFlagsResponse {
                        flag_configuration: flag_configuration(&obj.json),
                        sync_context: None,
                    }
                    .encode_to_vec()
                });
            },
        );
    }
    group.finish();
}

fn frame(c: &mut Criterion) {
    let mut group = c.benchmark_group("frame one update for one subscriber");
    for size in [1024usize, 64 * 1024] {
        let shared = encode_object(
            "featureflags.v1beta1.core.openfeature.dev/default/demo",
            &object(size, 7),
        );
        let mut buf = Vec::with_capacity(shared.len() + 16);
        group.throughput(Throughput::Bytes(shared.len() as u64));
        group.bench_with_input(BenchmarkId::new("native", size), &shared, |b, shared| {
            b.iter(|| {
                buf.clear();
                Frame {
                    index: 3,
                    event: Event::Updated,
                    shared: shared.clone(),
                }
                .write(&mut buf);
            });
        });
        group.bench_with_input(BenchmarkId::new("flagd", size), &shared, |b, shared| {
            b.iter(|| {
                buf.clear();
                Encoded(shared.clone()).write(&mut buf);
            });
        });
        // What the broker sends: the head in a chunk of its own, the shared bytes as they are.
        group.bench_with_input(
            BenchmarkId::new("native, wire", size),
            &shared,
            |b, shared| {
                b.iter(|| {
                    wire::chunks(&Frame {
                        index: 3,
                        event: Event::Updated,
                        shared: shared.clone(),
                    })
                });
            },
        );
        group.bench_with_input(
            BenchmarkId::new("flagd, wire", size),
            &shared,
            |b, shared| {
                b.iter(|| wire::chunks(&Encoded(shared.clone())));
            },
        );
    }
    group.finish();
}

criterion_group!(benches, subscribe_and_leave, publish, encode, frame);
criterion_main!(benches);
