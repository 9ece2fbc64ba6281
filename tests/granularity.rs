//! Adaptive watch granularity (`--namespace-watch-threshold`): past the threshold, one watch of
//! the namespace feeds every name watched there; below half of it, a watch per name again. No
//! subscriber sees an older state after a newer one, or misses the last, across the switches.

mod support;

use std::time::Duration;

use crd_broker::broker::Running;
use crd_broker::pb::subscribe_response::Event;
use crd_broker::source::kubernetes::Kubernetes;
use fake_apiserver::{FakeApiServer, Grant};
use serde_json::json;
use support::*;
use tokio::net::TcpListener;

const THRESHOLD: usize = 4;

async fn broker(fake: &FakeApiServer) -> Running<Kubernetes> {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let source =
        Kubernetes::new(kube_client(fake), vec![]).with_namespace_watch_threshold(THRESHOLD);
    Running::start(listener, source, Duration::ZERO).unwrap()
}

fn name(k: usize) -> String {
    format!("n{k}")
}

/// Watches of the whole namespace, and of single names, open on the fake.
fn watches(fake: &FakeApiServer) -> (usize, usize) {
    let namespace = fake.open_watches_on(NS_PATH, Some(""));
    (namespace, fake.open_watches() - namespace)
}

async fn settle(fake: &FakeApiServer, want: (usize, usize)) {
    let ok = tokio::time::timeout(Duration::from_secs(10), async {
        while watches(fake) != want {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(ok.is_ok(), "watches {:?}, not {want:?}", watches(fake));
}

/// A stream of each of `names` on `client`, each past its first message: the object as it is.
async fn snapshots(
    client: &mut crd_broker::pb::broker_client::BrokerClient<tonic::transport::Channel>,
    names: impl IntoIterator<Item = String>,
) -> Vec<tonic::Streaming<crd_broker::pb::SubscribeResponse>> {
    let mut streams = Vec::new();
    for n in names {
        let mut s = subscribe(client, &[&demo(&n)]).await;
        assert_eq!(next(&mut s).await.event(), Event::Snapshot, "{n}");
        streams.push(s);
    }
    streams
}

fn seq(r: &crd_broker::pb::SubscribeResponse) -> Option<u64> {
    object(r)["spec"]["flagSpec"]["metadata"]["seq"].as_u64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_threshold_one_namespace_watch_feeds_the_names_and_below_half_each_has_its_own() {
    let fake = fake().await;
    for k in 0..=THRESHOLD {
        fake.apply(flag(&name(k), "on")).unwrap();
    }
    let broker = broker(&fake).await;
    let mut client = connect(broker.addr).await;
    let mut streams = snapshots(&mut client, (0..THRESHOLD).map(name)).await;
    settle(&fake, (0, THRESHOLD)).await;
    // One more name: past the threshold.
    let mut s = subscribe(&mut client, &[&demo(&name(THRESHOLD))]).await;
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    streams.push(s);
    settle(&fake, (1, 0)).await;
    // A change reaches its subscriber through the namespace watch, and only that one.
    fake.merge_patch(GV, "featureflags", "default", "n2", variant_patch("off"))
        .unwrap();
    until(&mut streams[2], |r| variant(r) == "off").await;
    // A CR created later in the namespace, and one deleted, are seen too.
    let mut late = subscribe(&mut client, &[&demo("late")]).await;
    assert_eq!(next(&mut late).await.event(), Event::Absent);
    fake.apply(flag("late", "on")).unwrap();
    until(&mut late, |r| r.event() == Event::Snapshot).await;
    fake.delete(GV, "featureflags", "default", "n0").unwrap();
    until(&mut streams[0], |r| r.event() == Event::Deleted).await;
    // Down to half the threshold: still the namespace watch; below it, one watch per name.
    drop(late);
    streams.truncate(2);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(watches(&fake), (1, 0), "no flapping at the threshold");
    streams.truncate(1);
    settle(&fake, (0, 1)).await;
    fake.merge_patch(GV, "featureflags", "default", "n0", variant_patch("back"))
        .unwrap_or_else(|_| fake.apply(flag("n0", "back")).unwrap());
    until(&mut streams[0], |r| variant(r) == "back").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_during_switches_are_seen_in_order_and_the_last_always() {
    let fake = fake().await;
    for k in 0..=THRESHOLD + 1 {
        fake.apply(flag(&name(k), "on")).unwrap();
    }
    let broker = broker(&fake).await;
    let mut client = connect(broker.addr).await;
    let mut watched = subscribe(&mut client, &[&demo("n0")]).await;
    next(&mut watched).await;
    // A writer bumps n0's sequence every 10 ms while other names come and go, crossing the
    // threshold both ways again and again.
    let writer = {
        let fake_patch = |n: u64| json!({ "spec": { "flagSpec": { "metadata": { "seq": n } } } });
        let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
        let fake = std::sync::Arc::new(fake);
        let writing = fake.clone();
        let task = tokio::spawn(async move {
            let mut n = 0;
            loop {
                n += 1;
                writing
                    .merge_patch(GV, "featureflags", "default", "n0", fake_patch(n))
                    .unwrap();
                tokio::select! {
                    _ = &mut rx => return n,
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
            }
        });
        (tx, task, fake)
    };
    let (stop, task, fake) = writer;
    let mut seen = Vec::new();
    for _ in 0..4 {
        let mut others = Vec::new();
        for k in 1..=THRESHOLD + 1 {
            let mut s = subscribe(&mut client, &[&demo(&name(k))]).await;
            next(&mut s).await;
            others.push(s);
        }
        settle(&fake, (1, 0)).await;
        drain(&mut watched, &mut seen).await;
        drop(others);
        settle(&fake, (0, 1)).await;
        drain(&mut watched, &mut seen).await;
    }
    stop.send(()).unwrap();
    let last = task.await.unwrap();
    tokio::time::timeout(WAIT, async {
        while seen.last() != Some(&last) {
            if let Some(n) = seq(&next(&mut watched).await) {
                seen.push(n);
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "the last write ({last}) arrives; saw up to {:?}",
            seen.last()
        )
    });
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "strictly in order, no repeats: {seen:?}"
    );
    println!("{} states seen in order across 8 switches", seen.len());
    assert!(seen.len() > 10, "{} states seen", seen.len());
}

/// Reads what arrives for 100 ms.
async fn drain(
    stream: &mut tonic::Streaming<crd_broker::pb::SubscribeResponse>,
    seen: &mut Vec<u64>,
) {
    let until = tokio::time::Instant::now() + Duration::from_millis(100);
    while let Ok(Ok(Some(r))) = tokio::time::timeout_at(until, stream.message()).await {
        if let Some(n) = seq(&r) {
            seen.push(n);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_names_the_objects_keeps_a_watch_per_name() {
    let fake = fake().await;
    let names: Vec<String> = (0..=THRESHOLD).map(name).collect();
    for n in &names {
        fake.apply(flag(n, "on")).unwrap();
    }
    let named: Vec<&str> = names.iter().map(String::as_str).collect();
    fake.grant_only(vec![
        Grant::cluster(&["*"], "*", &["*"]).in_namespace("kube-system"),
        Grant::cluster(
            &["get", "list", "watch"],
            "core.openfeature.dev",
            &["featureflags"],
        )
        .in_namespace("default")
        .names(&named),
        Grant::cluster(&["*"], "apiextensions.k8s.io", &["*"]),
    ]);
    let broker = broker(&fake).await;
    let mut client = connect(broker.addr).await;
    let mut streams = snapshots(&mut client, names.iter().cloned()).await;
    settle(&fake, (0, THRESHOLD + 1)).await;
    eventually("the namespace watch was tried", WAIT, async || {
        fake.requests()
            .iter()
            .any(|r| r.path == NS_PATH && r.param("fieldSelector").is_none() && lists(r))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        watches(&fake),
        (0, THRESHOLD + 1),
        "and refused: a watch per name"
    );
    fake.merge_patch(GV, "featureflags", "default", "n1", variant_patch("off"))
        .unwrap();
    until(&mut streams[1], |r| variant(r) == "off").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_where_few_objects_are_watched_keeps_a_watch_per_name() {
    let fake = fake().await;
    for k in 0..40 {
        fake.apply(flag(&name(k), "on")).unwrap();
    }
    let broker = broker(&fake).await;
    let mut client = connect(broker.addr).await;
    let mut streams = snapshots(&mut client, (0..=THRESHOLD).map(name)).await;
    // Five names of forty objects: the namespace watch lists (streaming), finds too few
    // watched, and ends.
    eventually("the namespace watch was tried", WAIT, async || {
        fake.requests()
            .iter()
            .any(|r| r.path == NS_PATH && r.param("fieldSelector").is_none() && lists(r))
    })
    .await;
    settle(&fake, (0, THRESHOLD + 1)).await;
    fake.merge_patch(GV, "featureflags", "default", "n3", variant_patch("off"))
        .unwrap();
    until(&mut streams[3], |r| variant(r) == "off").await;
    // Once one object in four is watched, one namespace watch again.
    for k in THRESHOLD + 1..10 {
        let mut s = subscribe(&mut client, &[&demo(&name(k))]).await;
        next(&mut s).await;
        streams.push(s);
    }
    settle(&fake, (0, 10)).await;
    let mut s = subscribe(&mut client, &[&demo(&name(10))]).await;
    next(&mut s).await;
    streams.push(s);
    settle(&fake, (1, 0)).await;
}

/// Whether `r` asked for a collection's objects: a LIST, or a streaming list.
fn lists(r: &fake_apiserver::faults::RequestRecord) -> bool {
    r.verb == "list" || r.param("sendInitialEvents") == Some("true")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_nobody_follows_leave_the_namespace_watch_while_it_runs_on() {
    let fake = fake().await;
    fake.apply(flag(&name(0), "on")).unwrap();
    let broker = broker(&fake).await;
    let mut client = connect(broker.addr).await;
    // Enough names to keep the namespace watch, held throughout.
    let held: Vec<String> = (0..=THRESHOLD)
        .map(|k| demo(&format!("held-{k}")))
        .collect();
    let held: Vec<&str> = held.iter().map(String::as_str).collect();
    let mut holder = subscribe(&mut client, &held).await;
    for _ in 0..held.len() {
        next(&mut holder).await;
    }
    settle(&fake, (1, 0)).await;
    // Rounds of made-up names, each subscribed and left.
    for round in 0..5 {
        let made_up: Vec<String> = (0..20)
            .map(|k| demo(&format!("made-up-{round}-{k}")))
            .collect();
        let made_up: Vec<&str> = made_up.iter().map(String::as_str).collect();
        let mut s = subscribe(&mut client, &made_up).await;
        for _ in 0..made_up.len() {
            assert_eq!(next(&mut s).await.event(), Event::Absent);
        }
        drop(s);
    }
    let source = broker.registry.source();
    eventually("only the held names are followed", WAIT, async || {
        source.namespace_watch_names() == held.len()
    })
    .await;
    settle(&fake, (1, 0)).await;
    // A held name still hears about its object.
    fake.apply(flag("held-0", "on")).unwrap();
    until(&mut holder, |r| r.event() == Event::Snapshot).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_follows_the_newest_namespace_watch_after_a_quick_switch_away_and_back() {
    use fake_apiserver::{Action, Injection, Matcher};
    let fake = fake().await;
    for k in 0..=THRESHOLD {
        fake.apply(flag(&name(k), "on")).unwrap();
    }
    let broker = broker(&fake).await;
    let mut client = connect(broker.addr).await;
    let mut streams = snapshots(&mut client, (0..=THRESHOLD).map(name)).await;
    settle(&fake, (1, 0)).await;
    // Below half the threshold: the one name left goes back to its own watch, whose LIST the
    // server holds, so it keeps following the namespace watch meanwhile.
    fake.clear_requests();
    fake.inject(Injection {
        matcher: Matcher::verb("list").on(NS_PATH),
        times: 1,
        action: Action::Hang,
    });
    let mut kept = streams.remove(0);
    drop(streams);
    eventually("the name's own LIST was sent", WAIT, async || {
        fake.requests().iter().any(|r| r.verb == "list")
    })
    .await;
    // Past the threshold again, before that LIST answers: a new namespace watch.
    let _again = snapshots(&mut client, (1..=THRESHOLD).map(name)).await;
    // The name follows the new one; the old one stops.
    settle(&fake, (1, 0)).await;
    fake.merge_patch(
        GV,
        "featureflags",
        "default",
        &name(0),
        variant_patch("off"),
    )
    .unwrap();
    until(&mut kept, |r| variant(r) == "off").await;
    settle(&fake, (1, 0)).await;
}
