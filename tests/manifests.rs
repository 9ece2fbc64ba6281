//! The manifests source end to end: a directory of YAML files served through real gRPC, where
//! adding, editing and removing files reach subscribers as create, update and delete.

mod support;

use std::path::Path;
use std::time::Duration;

use crd_broker::broker::Running;
use crd_broker::pb::subscribe_response::Event;
use crd_broker::source::manifests::Manifests;
use support::*;
use tokio::net::TcpListener;

fn flag_yaml(name: &str, variant: &str) -> String {
    format!(
        "apiVersion: core.openfeature.dev/v1beta1\nkind: FeatureFlag\nmetadata:\n  name: {name}\nspec:\n  flagSpec:\n    flags:\n      f:\n        state: ENABLED\n        variants: {{a: a, b: b, c: c}}\n        defaultVariant: {variant}\n"
    )
}

/// Writes through a temporary file and a rename, as editors do, so a poll never reads half a file.
fn write(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(tmp, dir.join(name)).unwrap();
}

async fn broker(dir: &Path) -> Running<Manifests> {
    let source =
        Manifests::open(dir, Duration::from_millis(50), vec![]).expect("the directory opens");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    Running::start(listener, source, Duration::ZERO).unwrap()
}

#[tokio::test]
async fn file_changes_reach_subscribers_as_create_update_and_delete() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "crd.yaml", CRD);
    write(dir.path(), "demo.yaml", &flag_yaml("demo", "a"));
    let broker = broker(dir.path()).await;
    let mut client = connect(broker.addr).await;
    let mut s = subscribe(&mut client, &[&demo("demo"), &demo("later")]).await;
    let mut firsts = [next(&mut s).await, next(&mut s).await];
    firsts.sort_by_key(|r| r.index);
    assert!(is(&firsts[0], Event::Snapshot, "a"));
    assert_eq!(firsts[1].event(), Event::Absent);
    let served = object(&firsts[0]);
    assert_eq!(served["metadata"]["namespace"], "default");
    assert_eq!(served["metadata"]["generation"], 1);
    assert!(!firsts[0].uid.is_empty() && !firsts[0].resource_version.is_empty());

    // Edit.
    write(dir.path(), "demo.yaml", &flag_yaml("demo", "b"));
    let updated = next(&mut s).await;
    assert!(is(&updated, Event::Updated, "b"));
    assert_eq!(updated.uid, firsts[0].uid, "the same object");
    assert_eq!(object(&updated)["metadata"]["generation"], 2);

    // A broken edit changes nothing; the fix comes through.
    write(dir.path(), "demo.yaml", "apiVersion: [broken");
    write(dir.path(), "demo.yaml", &flag_yaml("demo", "c"));
    let fixed = until(&mut s, |r| r.index == 0).await;
    assert!(is(&fixed, Event::Updated, "c"));

    // Add: a file for the resource that did not exist.
    write(dir.path(), "later.yaml", &flag_yaml("later", "a"));
    let created = next(&mut s).await;
    assert_eq!(created.index, 1);
    assert!(is(&created, Event::Snapshot, "a"));

    // Remove.
    std::fs::remove_file(dir.path().join("demo.yaml")).unwrap();
    let deleted = next(&mut s).await;
    assert_eq!(deleted.index, 0);
    assert!(is(&deleted, Event::Deleted, "c"));

    // Several objects in one file, across namespaces, and a kind whose CRD arrives later.
    let err = client
        .subscribe(request(&["widgets.example.com/w"]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert!(err.message().contains("no CRD"), "{}", err.message());
    write(
        dir.path(),
        "widgets.yaml",
        "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata: {name: widgets.example.com}\nspec:\n  group: example.com\n  scope: Cluster\n  names: {plural: widgets, singular: widget, kind: Widget}\n  versions: [{name: v1, served: true, storage: true}]\n---\napiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w}\nsize: 3\n",
    );
    let mut w = tokio::time::timeout(WAIT, async {
        loop {
            match client.subscribe(request(&["Widget.example.com/w"])).await {
                Ok(s) => return s.into_inner(),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await
    .expect("the new kind is served without a restart");
    let widget = next(&mut w).await;
    assert_eq!(widget.selector, "widgets.v1.example.com/w");
    assert_eq!(object(&widget)["size"], 3);
    broker.stop().await.unwrap();
}
