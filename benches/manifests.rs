//! The manifests source on a directory of 10,000 files: the first scan (reading and parsing
//! every file), a poll that finds nothing changed (what the broker pays every
//! `--manifests-poll`), and an edit of one file (seen, then taken at the next poll).
//!
//! `cargo bench -p crd-broker --bench manifests`

use std::path::Path;
use std::time::Duration;

use crd_broker::source::manifests::DirectoryScan;
use criterion::{Criterion, criterion_group, criterion_main};

const FILES: usize = 10_000;
const CRD: &str = include_str!("../examples/manifests/featureflag-crd.yaml");

fn flag(name: &str, variant: &str) -> String {
    format!(
        "apiVersion: core.openfeature.dev/v1beta1\nkind: FeatureFlag\nmetadata:\n  name: {name}\n  namespace: team-{}\nspec:\n  flagSpec:\n    flags:\n      f:\n        state: ENABLED\n        variants: {{a: true, b: false}}\n        defaultVariant: {variant}\n",
        name.len() % 7
    )
}

fn directory() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("crd.yaml"), CRD).unwrap();
    for i in 0..FILES {
        let sub = dir.path().join(format!("d{}", i % 100));
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::write(sub.join(format!("f{i}.yaml")), flag(&format!("f{i}"), "a")).unwrap();
    }
    dir
}

fn edit(dir: &Path, n: u64) {
    let variant = if n.is_multiple_of(2) { "a" } else { "b" };
    std::fs::write(dir.join("d7/f7.yaml"), flag("f7", variant)).unwrap();
}

fn manifests(c: &mut Criterion) {
    let dir = directory();
    let mut group = c.benchmark_group("manifests_10000_files");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(10));
    group.bench_function("first_scan", |b| {
        b.iter(|| {
            let scan = DirectoryScan::open(dir.path()).unwrap();
            assert_eq!(scan.objects(), FILES);
        })
    });
    let mut scan = DirectoryScan::open(dir.path()).unwrap();
    group.bench_function("idle_poll", |b| b.iter(|| assert!(!scan.poll())));
    let mut n = 0;
    group.bench_function("one_edit", |b| {
        b.iter(|| {
            n += 1;
            edit(dir.path(), n);
            assert!(!scan.poll(), "seen once: not taken yet");
            assert!(scan.poll(), "taken at the next poll");
        })
    });
    group.finish();
}

criterion_group!(benches, manifests);
criterion_main!(benches);
