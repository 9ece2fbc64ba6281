//! Resuming on the native API: a stream that names the version its client holds of a resource
//! starts with CURRENT (no object) when the broker's state is that version, and a set's stream
//! that names its members' version starts with SYNCED alone; anything else starts as a new
//! stream does. Old clients, which name no version, are served as before.

mod support;

use std::time::Duration;

use crd_broker::cli::subscribe::{Holdings, request_for};
use crd_broker::pb;
use crd_broker::pb::subscribe_response::Event;
use crd_broker::selector::Target;
use serde_json::json;
use support::*;
use tonic::Code;

/// The request for `selectors`, the first resumed at `uid` and `resource_version`.
fn resumed(selectors: &[&str], uid: &str, resource_version: &str) -> pb::SubscribeRequest {
    let mut request = request(selectors);
    request.resources[0].uid = uid.into();
    request.resources[0].resource_version = resource_version.into();
    request
}

async fn first(
    client: &mut pb::broker_client::BrokerClient<tonic::transport::Channel>,
    request: pb::SubscribeRequest,
) -> (
    pb::SubscribeResponse,
    tonic::Streaming<pb::SubscribeResponse>,
) {
    let mut s = client.subscribe(request).await.unwrap().into_inner();
    (next(&mut s).await, s)
}

#[tokio::test]
async fn a_resource_resumed_at_the_version_it_has_starts_with_current_and_then_each_change() {
    let h = start(Duration::ZERO).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut client = h.client().await;
    let demo = demo("demo");
    let (snapshot, _) = first(&mut client, request(&[&demo])).await;
    assert_eq!(snapshot.event(), Event::Snapshot);

    let (current, mut s) = first(
        &mut client,
        resumed(&[&demo], &snapshot.uid, &snapshot.resource_version),
    )
    .await;
    assert_eq!(current.event(), Event::Current);
    assert!(current.object.is_empty(), "no object");
    assert_eq!(
        (&current.uid, &current.resource_version),
        (&snapshot.uid, &snapshot.resource_version)
    );
    assert_eq!(current.selector, snapshot.selector);
    h.fake
        .merge_patch(GV, "featureflags", "default", "demo", variant_patch("off"))
        .unwrap();
    let updated = next(&mut s).await;
    assert_eq!(updated.event(), Event::Updated);

    // A version that is not the broker's, or another object's uid: a SNAPSHOT, as without them.
    for (uid, version) in [
        (snapshot.uid.as_str(), snapshot.resource_version.as_str()),
        ("another-uid", updated.resource_version.as_str()),
    ] {
        let (r, _) = first(&mut client, resumed(&[&demo], uid, version)).await;
        assert_eq!(r.event(), Event::Snapshot, "{uid} {version}");
        assert_eq!(r.resource_version, updated.resource_version);
    }

    // Resumed among others: CURRENT for the one held, ABSENT and SNAPSHOT for the rest as ever.
    h.fake.apply(flag("other", "on")).unwrap();
    let mut request = resumed(
        &[&demo, &support::demo("missing"), &support::demo("other")],
        &updated.uid,
        &updated.resource_version,
    );
    request.resources[2].resource_version = "1".into();
    request.resources[2].uid = "not-its-uid".into();
    let mut s = client.subscribe(request).await.unwrap().into_inner();
    let mut events: Vec<(u32, Event)> = Vec::new();
    for _ in 0..3 {
        let r = next(&mut s).await;
        events.push((r.index, r.event()));
    }
    events.sort();
    assert_eq!(
        events,
        [
            (0, Event::Current),
            (1, Event::Absent),
            (2, Event::Snapshot)
        ]
    );

    // Deleted while the client was away: ABSENT.
    h.fake
        .delete(GV, "featureflags", "default", "demo")
        .unwrap();
    let (r, _) = first(
        &mut client,
        resumed(&[&demo], &updated.uid, &updated.resource_version),
    )
    .await;
    assert_eq!(r.event(), Event::Absent);
}

fn labelled(name: &str, app: &str) -> serde_json::Value {
    let mut flag = flag(name, "on");
    flag["metadata"]["labels"] = json!({ "app": app });
    flag
}

fn set() -> Target {
    "featureflags.core.openfeature.dev/default?labelSelector=app%3Dcheckout"
        .parse()
        .unwrap()
}

/// Reads a set's stream through its SYNCED into `holdings`; the SYNCED.
async fn through_synced(
    s: &mut tonic::Streaming<pb::SubscribeResponse>,
    holdings: &mut Holdings,
) -> pb::SubscribeResponse {
    holdings.start();
    loop {
        let r = next(s).await;
        holdings.take(&r);
        if r.event() == Event::Synced {
            return r;
        }
    }
}

#[tokio::test]
async fn a_set_resumed_at_its_members_version_starts_with_synced_alone() {
    let h = start(Duration::ZERO).await;
    for name in ["a", "b"] {
        h.fake.apply(labelled(name, "checkout")).unwrap();
    }
    let mut client = h.client().await;
    let mut holdings = Holdings::default();
    let mut s = client
        .subscribe(request_for(&[set()]))
        .await
        .unwrap()
        .into_inner();
    let synced = through_synced(&mut s, &mut holdings).await;
    assert_eq!(synced.set_version.len(), 16, "{synced:?}");
    // The client computes the same version from the members it holds.
    let asked = holdings.request(&[set()]);
    assert_eq!(asked.resources[0].resource_version, synced.set_version);

    // Resumed at that version: SYNCED alone, then changes as ever.
    let mut resumed = client.subscribe(asked).await.unwrap().into_inner();
    let again = next(&mut resumed).await;
    assert_eq!(again.event(), Event::Synced);
    assert_eq!(again.set_version, synced.set_version);
    h.fake
        .merge_patch(GV, "featureflags", "default", "b", variant_patch("off"))
        .unwrap();
    for stream in [&mut s, &mut resumed] {
        let r = next(stream).await;
        assert_eq!(r.event(), Event::Updated);
        assert!(r.selector.ends_with("/b"), "{}", r.selector);
        holdings.take(&r);
    }

    // The client that saw the change resumes with SYNCED alone; one at the old version gets the
    // members again, and a new version.
    let (r, _) = first(&mut client, holdings.request(&[set()])).await;
    assert_eq!(r.event(), Event::Synced);
    let mut old = request_for(&[set()]);
    old.resources[0].resource_version = synced.set_version.clone();
    let mut s = client.subscribe(old).await.unwrap().into_inner();
    let mut stale = Holdings::default();
    let newer = through_synced(&mut s, &mut stale).await;
    assert_ne!(newer.set_version, synced.set_version);
    assert_eq!(
        stale.request(&[set()]).resources[0].resource_version,
        newer.set_version
    );

    // A member that left while the client was away: the members again, without it.
    h.fake
        .merge_patch(GV, "featureflags", "default", "a", relabel("cart"))
        .unwrap();
    let mut s = client
        .subscribe(holdings.request(&[set()]))
        .await
        .unwrap()
        .into_inner();
    let snapshot = next(&mut s).await;
    assert_eq!(snapshot.event(), Event::Snapshot);
    holdings.start();
    holdings.take(&snapshot);
    let synced = through_synced(&mut s, &mut holdings).await;
    assert_eq!(
        holdings.request(&[set()]).resources[0].resource_version,
        synced.set_version,
        "the member that left is forgotten"
    );
}

#[tokio::test]
async fn resume_fields_out_of_bounds_or_misplaced_are_invalid_argument() {
    let h = start(Duration::ZERO).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut client = h.client().await;
    let demo = demo("demo");
    let long = "9".repeat(100_000);
    let mut on_set = request_for(&[set()]);
    on_set.resources[0].uid = "u".into();
    for (request, says) in [
        (
            resumed(&[&demo], "u", &long),
            "resource_version has 100000 bytes; at most 256",
        ),
        (
            resumed(&[&demo], &long, "1"),
            "uid has 100000 bytes; at most 128",
        ),
        (
            resumed(&[&demo], "u", ""),
            "uid is given without resource_version",
        ),
        (on_set, "uid is given for a set"),
    ] {
        let status = client.subscribe(request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(says), "{status:?}");
        assert!(status.message().len() < 300, "bounded");
    }
    // The broker serves on.
    let (r, _) = first(&mut client, request(&[&demo])).await;
    assert_eq!(r.event(), Event::Snapshot);
}

/// The same on the real control plane: three replicas deployed as the chart deploys them, one
/// SIGKILLed. Its subscribers resume on the others with the uids and resourceVersions the real
/// API server gave; the replicas the resumes land on had never watched the widgets (their first
/// state is their own LIST), and a widget written while its subscriber was away is sent anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_real_control_plane_a_killed_replicas_subscribers_resume_on_the_others() {
    use kube::api::{Api, DynamicObject, Patch, PatchParams};
    use support::control_plane::*;
    let plane = control_plane();
    let (ns, group, resource) = widget_world(plane, "resume-replicas").await;
    let names = many_widgets(plane, &group, &ns, 3).await;
    let api: Api<DynamicObject> = Api::namespaced_with(plane.admin().await, &ns, &resource);
    let patch = |body: serde_json::Value| Patch::Merge(body);
    for name in &names {
        let label = json!({ "metadata": { "labels": { "app": "resume" } } });
        api.patch(name, &PatchParams::default(), &patch(label))
            .await
            .unwrap();
    }
    let values = widget_values(&group, &ns, "30s");
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(plane.deploy(&ns, values.clone()).await);
    }
    let mut targets: Vec<Target> = names
        .iter()
        .map(|n| format!("widgets.{group}/{ns}/{n}").parse().unwrap())
        .collect();
    targets.push(
        format!("widgets.{group}/{ns}?labelSelector=app%3Dresume")
            .parse()
            .unwrap(),
    );
    let set = targets.len() - 1;

    // Every widget and the set on the first replica.
    let mut first_replica = connect(replicas[0].grpc).await;
    let mut held: Vec<Holdings> = targets.iter().map(|_| Holdings::default()).collect();
    let mut streams = Vec::new();
    for (i, target) in targets.iter().enumerate() {
        let asked = request_for(std::slice::from_ref(target));
        let mut s = first_replica.subscribe(asked).await.unwrap().into_inner();
        if i == set {
            through_synced(&mut s, &mut held[i]).await;
        } else {
            held[i].start();
            let snapshot = next(&mut s).await;
            assert_eq!(snapshot.event(), Event::Snapshot);
            held[i].take(&snapshot);
        }
        streams.push(s);
    }

    // The replica dies; its streams break.
    replicas[0].child.start_kill().unwrap();
    replicas[0].child.wait().await.unwrap();
    for s in &mut streams {
        let ended = tokio::time::timeout(WAIT, s.message()).await.unwrap();
        assert!(!matches!(ended, Ok(Some(_))), "{ended:?}");
    }

    // Resumed on the others, never watched there before: CURRENT for each widget, at the
    // resourceVersion the API server gave; SYNCED alone for the set.
    let mut others = [
        connect(replicas[1].grpc).await,
        connect(replicas[2].grpc).await,
    ];
    for (i, target) in targets.iter().enumerate() {
        let client = &mut others[i % 2];
        let asked = held[i].request(std::slice::from_ref(target));
        let (r, _) = first(client, asked.clone()).await;
        if i == set {
            assert_eq!(r.event(), Event::Synced, "{r:?}");
            assert_eq!(r.set_version, asked.resources[0].resource_version);
        } else {
            assert_eq!(r.event(), Event::Current, "{r:?}");
            assert_eq!(r.resource_version, asked.resources[0].resource_version);
            assert!(r.object.is_empty());
        }
    }

    // A widget written while its subscriber was away: its state anew, at the new version.
    let written = api
        .patch(
            &names[0],
            &PatchParams::default(),
            &patch(json!({ "spec": { "color": "blue" } })),
        )
        .await
        .unwrap();
    let written_rv = written.metadata.resource_version.unwrap();
    let asked = held[0].request(&targets[..1]);
    let resumed = tokio::time::timeout(WAIT, async {
        loop {
            let (r, _) = first(&mut others[1], asked.clone()).await;
            if r.resource_version == written_rv {
                return r;
            }
            // The replica's watch has not seen the write yet: CURRENT at the old version.
            assert_eq!(r.event(), Event::Current, "{r:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the write reaches the replica");
    assert_eq!(resumed.event(), Event::Snapshot);
    assert!(String::from_utf8_lossy(&resumed.object).contains("blue"));
    // The set at its old version: its members again, and a new set version.
    let mut s = others[0]
        .subscribe(held[set].request(&targets[set..]))
        .await
        .unwrap()
        .into_inner();
    let mut again = Holdings::default();
    let synced = through_synced(&mut s, &mut again).await;
    assert_ne!(
        synced.set_version,
        held[set].request(&targets[set..]).resources[0].resource_version
    );
}
