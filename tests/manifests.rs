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

/// A broker on `dir` polled every `poll`, checking readiness every 50 ms.
async fn polled(dir: &Path, poll: Duration) -> Running<Manifests> {
    let source = Manifests::open(dir, poll, vec![]).expect("the directory opens");
    let listeners =
        crd_broker::broker::Listeners::tcp(TcpListener::bind("127.0.0.1:0").await.unwrap());
    let config = crd_broker::broker::Config {
        readiness_interval: Duration::from_millis(50),
        ..crd_broker::broker::Config::default()
    };
    Running::start_with(listeners, source, config).unwrap()
}

/// Why the file (or link) `name` in the broker's directory is not served; empty if it is.
fn problem(broker: &Running<Manifests>, name: &str) -> String {
    broker
        .registry
        .source()
        .problems()
        .into_iter()
        .find(|(p, _)| p.ends_with(name))
        .map(|(_, why)| why)
        .unwrap_or_default()
}

/// Nothing arrives on `s` for `long`.
async fn quiet(s: &mut tonic::Streaming<crd_broker::pb::SubscribeResponse>, long: Duration) {
    if let Ok(m) = tokio::time::timeout(long, s.message()).await {
        panic!("nothing was to arrive, got {m:?}");
    }
}

#[tokio::test]
async fn an_editor_that_truncates_then_writes_is_one_update_of_the_same_object() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "crd.yaml", CRD);
    write(dir.path(), "demo.yaml", &flag_yaml("demo", "a"));
    let broker = polled(dir.path(), Duration::from_millis(200)).await;
    let mut client = connect(broker.addr).await;
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    let first = next(&mut s).await;
    // In place, as many editors save: truncate, then write.
    let path = dir.path().join("demo.yaml");
    std::fs::write(&path, "").unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    std::fs::write(&path, flag_yaml("demo", "b")).unwrap();
    let updated = next(&mut s).await;
    assert!(is(&updated, Event::Updated, "b"), "{updated:?}");
    assert_eq!(updated.uid, first.uid, "the same object");

    // A half-written file that still parses (its flags null) is never served.
    let text = flag_yaml("demo", "c");
    let half = &text[..text.find("      f:").unwrap()];
    std::fs::write(&path, half).unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    std::fs::write(&path, &text).unwrap();
    let whole = next(&mut s).await;
    assert!(is(&whole, Event::Updated, "c"), "{whole:?}");
    assert!(object(&whole)["spec"]["flagSpec"]["flags"].is_object());
    assert_eq!(whole.uid, first.uid);
}

#[tokio::test]
async fn a_directory_briefly_gone_keeps_its_state_and_is_an_outage_not_a_delete() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("manifests");
    std::fs::create_dir(&dir).unwrap();
    write(&dir, "crd.yaml", CRD);
    write(&dir, "demo.yaml", &flag_yaml("demo", "a"));
    let broker = polled(&dir, Duration::from_millis(50)).await;
    let mut client = connect(broker.addr).await;
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    next(&mut s).await;
    let ready = |b: &Running<Manifests>| b.readiness.current();
    eventually("the source passes its check", WAIT, async || {
        ready(&broker).source == Some(Ok(()))
    })
    .await;

    let away = parent.path().join("away");
    std::fs::rename(&dir, &away).unwrap();
    eventually("an outage of the source", WAIT, async || {
        matches!(&ready(&broker).source, Some(Err(e)) if e.contains("cannot read the manifests directory"))
    })
    .await;
    assert!(ready(&broker).ready(), "ready within --max-staleness");
    quiet(&mut s, Duration::from_millis(400)).await;
    let mut again = subscribe(&mut client, &[&demo("demo")]).await;
    assert!(
        is(&next(&mut again).await, Event::Snapshot, "a"),
        "the last good state is served"
    );

    std::fs::rename(&away, &dir).unwrap();
    eventually("the source passes its check", WAIT, async || {
        ready(&broker).source == Some(Ok(()))
    })
    .await;
    quiet(&mut s, Duration::from_millis(300)).await;
    write(&dir, "demo.yaml", &flag_yaml("demo", "b"));
    assert!(is(&next(&mut s).await, Event::Updated, "b"));
}

#[tokio::test]
async fn links_are_followed_inside_the_directory_once_and_never_out_of_it() {
    let outside = tempfile::tempdir().unwrap();
    write(outside.path(), "secret.yaml", &flag_yaml("secret", "a"));
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "crd.yaml", CRD);
    std::fs::create_dir(dir.path().join("team")).unwrap();
    write(
        &dir.path().join("team"),
        "demo.yaml",
        &flag_yaml("demo", "a"),
    );
    // Loops: each directory is read once.
    std::os::unix::fs::symlink(".", dir.path().join("a")).unwrap();
    std::os::unix::fs::symlink(".", dir.path().join("b")).unwrap();
    std::os::unix::fs::symlink("..", dir.path().join("team/up")).unwrap();
    // A link to a file inside is served once; one out of the directory is not followed.
    std::os::unix::fs::symlink("team/demo.yaml", dir.path().join("again.yaml")).unwrap();
    std::os::unix::fs::symlink(
        outside.path().join("secret.yaml"),
        dir.path().join("secret.yaml"),
    )
    .unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join("out")).unwrap();
    let opened = tokio::time::timeout(WAIT, polled(dir.path(), Duration::from_millis(50)))
        .await
        .expect("the first scan ends");
    let mut client = connect(opened.addr).await;
    let mut s = subscribe(&mut client, &[&demo("demo"), &demo("secret")]).await;
    let mut firsts = [next(&mut s).await, next(&mut s).await];
    firsts.sort_by_key(|r| r.index);
    assert!(is(&firsts[0], Event::Snapshot, "a"));
    assert_eq!(
        firsts[1].event(),
        Event::Absent,
        "nothing from outside the directory"
    );
    for name in ["secret.yaml", "out"] {
        let why = problem(&opened, name);
        assert!(why.contains("outside the directory"), "{name}: {why:?}");
    }
}

#[tokio::test]
async fn files_over_the_size_or_nesting_limits_are_refused_with_the_reason() {
    use crd_broker::source::manifests::{MAX_FILE_BYTES, MAX_NESTING};
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "crd.yaml", CRD);
    write(dir.path(), "demo.yaml", &flag_yaml("demo", "a"));
    let padding = "x".repeat(MAX_FILE_BYTES as usize);
    write(
        dir.path(),
        "huge.yaml",
        &format!("{}  padding: {padding}\n", flag_yaml("huge", "a")),
    );
    // 200 KB of nesting: refused before the parser sees it.
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    write(dir.path(), "deep.yaml", &format!("a: {deep}\n"));
    let started = std::time::Instant::now();
    let broker = polled(dir.path(), Duration::from_millis(50)).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let mut client = connect(broker.addr).await;
    let mut s = subscribe(&mut client, &[&demo("demo"), &demo("huge")]).await;
    let mut firsts = [next(&mut s).await, next(&mut s).await];
    firsts.sort_by_key(|r| r.index);
    assert_eq!(firsts[0].event(), Event::Snapshot);
    assert_eq!(firsts[1].event(), Event::Absent);
    let why = problem(&broker, "huge.yaml");
    assert!(
        why.contains(&format!("at most {MAX_FILE_BYTES} bytes")),
        "{why:?}"
    );
    assert!(
        problem(&broker, "deep.yaml").contains(&format!("nested more than {MAX_NESTING} levels")),
        "{:?}",
        broker.registry.source().problems()
    );
}

#[tokio::test]
async fn a_set_of_manifests_follows_the_files_by_their_labels() {
    let labelled = |name: &str, app: &str, variant: &str| {
        flag_yaml(name, variant).replace(
            &format!("  name: {name}\n"),
            &format!("  name: {name}\n  labels:\n    app: {app}\n"),
        )
    };
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "crd.yaml", CRD);
    write(dir.path(), "a.yaml", &labelled("a", "checkout", "a"));
    write(dir.path(), "b.yaml", &labelled("b", "cart", "a"));
    let broker = broker(dir.path()).await;
    let mut client = connect(broker.addr).await;
    let target: crd_broker::selector::Target =
        "featureflags.core.openfeature.dev/default?labelSelector=app%3Dcheckout"
            .parse()
            .unwrap();
    let mut s = client
        .subscribe(crd_broker::cli::subscribe::request_for(&[target]))
        .await
        .unwrap()
        .into_inner();
    assert!(is(&next(&mut s).await, Event::Snapshot, "a"));
    assert_eq!(next(&mut s).await.event(), Event::Synced);
    write(dir.path(), "a.yaml", &labelled("a", "checkout", "b"));
    assert!(is(&next(&mut s).await, Event::Updated, "b"));
    write(dir.path(), "b.yaml", &labelled("b", "checkout", "c"));
    assert!(is(&next(&mut s).await, Event::Added, "c"));
    write(dir.path(), "a.yaml", &labelled("a", "cart", "b"));
    let left = next(&mut s).await;
    assert_eq!(left.event(), Event::Deleted);
    assert!(left.selector.ends_with("/default/a"), "{}", left.selector);

    // `*`: every namespace, members by namespace and name.
    let other =
        labelled("b", "checkout", "d").replace("  name: b\n", "  name: b\n  namespace: other\n");
    write(dir.path(), "other.yaml", &other);
    let every: crd_broker::selector::Target =
        "featureflags.core.openfeature.dev/*?labelSelector=app%3Dcheckout"
            .parse()
            .unwrap();
    let mut all = eventually_subscribed(&mut client, every, 2).await;
    let members: Vec<String> = all.drain(..2).map(|r| r.selector).collect();
    assert_eq!(
        members,
        ["default/b", "other/b"].map(|m| format!("featureflags.v1beta1.core.openfeature.dev/{m}"))
    );
}

/// The SNAPSHOTs of `target` once it has `members` of them.
async fn eventually_subscribed(
    client: &mut crd_broker::pb::broker_client::BrokerClient<tonic::transport::Channel>,
    target: crd_broker::selector::Target,
    members: usize,
) -> Vec<crd_broker::pb::SubscribeResponse> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let mut s = client
            .subscribe(crd_broker::cli::subscribe::request_for(
                std::slice::from_ref(&target),
            ))
            .await
            .unwrap()
            .into_inner();
        let mut snapshots = Vec::new();
        loop {
            let r = next(&mut s).await;
            if r.event() == Event::Synced {
                break;
            }
            snapshots.push(r);
        }
        if snapshots.len() == members || tokio::time::Instant::now() > deadline {
            return snapshots;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
