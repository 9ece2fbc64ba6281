//! End to end through real gRPC on 127.0.0.1:0: the broker watching the fake API server with
//! kube-rs, asserting on what subscribers receive and on the watches the API server carries.

mod support;

use std::time::Duration;

use crd_broker::pb::subscribe_response::Event;
use fake_apiserver::Matcher;
use serde_json::json;
use support::*;
use tonic::Code;

#[tokio::test]
async fn one_watch_serves_every_subscriber_and_each_gets_every_update() {
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut client = h.client().await;

    let mut first = subscribe(&mut client, &[&demo("demo")]).await;
    let r = next(&mut first).await;
    assert_eq!(r.event(), Event::Snapshot);
    assert_eq!(
        r.selector,
        "featureflags.v1beta1.core.openfeature.dev/default/demo"
    );
    assert_eq!(r.index, 0);
    assert_eq!(variant(&r), "on");
    let stored = h.fake.get(GV, "featureflags", "default", "demo").unwrap();
    assert_eq!(
        object(&r),
        stored,
        "the object exactly as the API server serves it"
    );
    assert_eq!(
        r.resource_version,
        stored["metadata"]["resourceVersion"].as_str().unwrap()
    );
    assert_eq!(r.uid, stored["metadata"]["uid"].as_str().unwrap());
    assert_eq!(
        h.watches_on("demo"),
        1,
        "the first subscriber opens exactly one watch"
    );

    let mut streams = vec![first];
    for _ in 0..99 {
        // Over several connections, as sidecars would.
        let mut c = h.client().await;
        let mut s = subscribe(&mut c, &[&demo("demo")]).await;
        assert_eq!(next(&mut s).await.event(), Event::Snapshot);
        streams.push(s);
    }
    assert_eq!(h.fake.open_watches(), 1, "100 subscribers, still one watch");
    assert_eq!(h.fake.request_count("list", NS_PATH), 1);
    assert_eq!(h.broker.registry.watches()[0].subscribers, 100);

    for v in ["off", "a", "b"] {
        h.fake
            .merge_patch(GV, "featureflags", "default", "demo", variant_patch(v))
            .unwrap();
        for s in &mut streams {
            let r = next(s).await;
            assert!(is(&r, Event::Updated, v), "{:?} {}", r.event(), variant(&r));
        }
    }
    assert_eq!(h.fake.open_watches(), 1);
}

async fn last_leaving_closes_the_watch(linger: Duration) {
    let h = start(linger).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut client = h.client().await;
    let mut streams = Vec::new();
    for _ in 0..3 {
        let mut s = subscribe(&mut client, &[&demo("demo")]).await;
        next(&mut s).await;
        streams.push(s);
    }
    assert_eq!(h.watches_on("demo"), 1);
    drop(streams);
    let left = tokio::time::Instant::now();
    if linger >= Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(h.watches_on("demo"), 1, "the watch lingers");
    }
    let closed = h
        .fake
        .wait_for(linger + Duration::from_secs(1), |f| f.open_watches() == 0)
        .await;
    assert!(
        closed,
        "closed on the API server within linger + 1 s (waited {:?})",
        left.elapsed()
    );
    assert!(h.broker.registry.is_empty());
}

#[tokio::test]
async fn the_last_subscriber_leaving_closes_the_watch_at_once_without_linger() {
    last_leaving_closes_the_watch(Duration::ZERO).await;
}

#[tokio::test]
async fn the_last_subscriber_leaving_closes_the_watch_after_the_linger() {
    last_leaving_closes_the_watch(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn a_missing_resource_is_absent_then_follows_create_delete_and_recreate() {
    let h = start(Duration::from_secs(30)).await;
    let mut client = h.client().await;
    let mut s = subscribe(&mut client, &[&demo("later")]).await;
    let r = next(&mut s).await;
    assert_eq!(r.event(), Event::Absent);
    assert!(r.object.is_empty() && r.uid.is_empty());
    assert_eq!(
        r.selector,
        "featureflags.v1beta1.core.openfeature.dev/default/later"
    );

    h.fake.apply(flag("later", "on")).unwrap();
    let created = next(&mut s).await;
    assert!(is(&created, Event::Snapshot, "on"));
    h.fake
        .merge_patch(GV, "featureflags", "default", "later", variant_patch("off"))
        .unwrap();
    assert!(is(&next(&mut s).await, Event::Updated, "off"));
    h.fake
        .delete(GV, "featureflags", "default", "later")
        .unwrap();
    let deleted = next(&mut s).await;
    assert!(
        is(&deleted, Event::Deleted, "off"),
        "DELETED carries the last state"
    );
    h.fake.apply(flag("later", "a")).unwrap();
    let again = next(&mut s).await;
    assert!(
        is(&again, Event::Snapshot, "a"),
        "a re-created object is a new SNAPSHOT"
    );
    assert_ne!(again.uid, created.uid);
    assert_eq!(h.fake.open_watches(), 1);
}

/// Writes a run of changes while `fault` strikes, then checks the subscriber ends on the last.
async fn ends_on_the_final_state(fault: impl AsyncFn(&Harness)) {
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "v0")).unwrap();
    let mut client = h.client().await;
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    assert!(is(&next(&mut s).await, Event::Snapshot, "v0"));
    assert!(h.fake.wait_for(WAIT, |f| f.open_watches() == 1).await);
    for i in 1..=5 {
        h.fake
            .merge_patch(
                GV,
                "featureflags",
                "default",
                "demo",
                variant_patch(&format!("v{i}")),
            )
            .unwrap();
    }
    fault(&h).await;
    for i in 6..=10 {
        h.fake
            .merge_patch(
                GV,
                "featureflags",
                "default",
                "demo",
                variant_patch(&format!("v{i}")),
            )
            .unwrap();
    }
    let last = until(&mut s, |r| variant(r) == "v10").await;
    assert_eq!(last.event(), Event::Updated);
    let stored = h.fake.get(GV, "featureflags", "default", "demo").unwrap();
    assert_eq!(
        last.resource_version,
        stored["metadata"]["resourceVersion"].as_str().unwrap()
    );
    assert!(
        h.fake.wait_for(WAIT, |f| f.open_watches() == 1).await,
        "one watch again, no restart"
    );
}

#[tokio::test]
async fn an_aborted_watch_is_resumed() {
    ends_on_the_final_state(async |h: &Harness| h.fake.abort_watches()).await;
}

/// Compacts the history and sends 410 on the watch, then waits for `lists` LISTs in all.
async fn expire(h: &Harness, lists: u64) {
    h.fake.compact();
    h.fake.error_watches(410);
    let relisted = h
        .fake
        .wait_for(WAIT, |f| f.request_count("list", NS_PATH) >= lists)
        .await;
    assert!(relisted, "{lists} lists");
}

#[tokio::test]
async fn an_expired_watch_is_relisted() {
    ends_on_the_final_state(async |h: &Harness| expire(h, 2).await).await;
}

#[tokio::test]
async fn a_failed_relist_is_retried() {
    ends_on_the_final_state(async |h: &Harness| {
        h.fake.fail_next(Matcher::verb("list"), 1, 500, None);
        // The first list, the failed relist, and one that works.
        expire(h, 3).await;
    })
    .await;
}

#[tokio::test]
async fn watch_errors_and_failed_rewatches_are_retried() {
    ends_on_the_final_state(async |h: &Harness| {
        // An ERROR 500 event, then a 500 at the re-watch: kube backs off and re-watches.
        h.fake.fail_next(Matcher::verb("watch"), 1, 500, None);
        h.fake.error_watches(500);
    })
    .await;
}

#[tokio::test]
async fn the_api_server_going_down_and_coming_back_is_survived() {
    ends_on_the_final_state(async |h: &Harness| {
        h.fake.stop_listening();
        tokio::time::sleep(Duration::from_secs(1)).await;
        h.fake.start_listening().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_subscribes_and_unsubscribes_leaves_exactly_the_watches_in_use() {
    let h = start(Duration::ZERO).await;
    let names = ["s0", "s1", "s2", "s3"];
    for n in names {
        h.fake.apply(flag(n, "on")).unwrap();
    }
    let addr = h.broker.addr;
    let mut workers = Vec::new();
    for w in 0..20usize {
        workers.push(tokio::spawn(async move {
            let mut client = connect(addr).await;
            let mut kept = None;
            for i in 0..100usize {
                let name = names[(w * 7 + i * 13) % names.len()];
                let mut s = subscribe(&mut client, &[&demo(name)]).await;
                if (w + i) % 3 != 0 {
                    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
                }
                if i == 99 && w % 5 == 0 {
                    kept = Some((name, s));
                }
            }
            kept
        }));
    }
    let mut kept = Vec::new();
    for w in workers {
        kept.extend(w.await.unwrap());
    }
    let in_use: std::collections::BTreeSet<&str> = kept.iter().map(|(n, _)| *n).collect();
    assert!(!in_use.is_empty());
    let settled = h
        .fake
        .wait_for(WAIT, |f| f.open_watches() == in_use.len())
        .await;
    assert!(
        settled,
        "open watches {} == resources still subscribed {}",
        h.fake.open_watches(),
        in_use.len()
    );
    for n in &in_use {
        assert_eq!(h.watches_on(n), 1);
    }
    // The kept subscriptions are live: they see a change.
    for n in &in_use {
        h.fake
            .merge_patch(GV, "featureflags", "default", n, variant_patch("off"))
            .unwrap();
    }
    for (_, s) in &mut kept {
        until(s, |r| variant(r) == "off").await;
    }
    drop(kept);
    assert!(
        h.fake.wait_for(WAIT, |f| f.open_watches() == 0).await,
        "0 once all leave"
    );
    let registry = &h.broker.registry;
    let drained = tokio::time::timeout(WAIT, async {
        while !registry.is_empty() || registry.tasks() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        drained.is_ok(),
        "no leaked tasks: {} entries, {} tasks",
        registry.len(),
        registry.tasks()
    );
}

#[tokio::test]
async fn a_subscriber_that_stops_reading_delays_nobody_and_later_gets_the_latest() {
    let h = start(Duration::from_secs(30)).await;
    // Large objects, so the stalled client's HTTP/2 windows fill up quickly.
    let mut big = flag("demo", "v0");
    big["spec"]["flagSpec"]["metadata"] = json!({ "padding": "x".repeat(64 * 1024) });
    h.fake.apply(big).unwrap();
    let mut slow_client = h.client().await;
    let mut slow = subscribe(&mut slow_client, &[&demo("demo")]).await;
    let mut fast_client = h.client().await;
    let mut fast = subscribe(&mut fast_client, &[&demo("demo")]).await;
    assert_eq!(next(&mut fast).await.event(), Event::Snapshot);
    for i in 1..=200 {
        h.fake
            .merge_patch(
                GV,
                "featureflags",
                "default",
                "demo",
                variant_patch(&format!("v{i}")),
            )
            .unwrap();
        if i % 20 == 0 {
            // The reading subscriber keeps up while the other reads nothing.
            until(&mut fast, |r| variant(r) == format!("v{i}")).await;
        }
    }
    // Now the slow one reads: it drains what was in flight and ends on the newest state.
    let last = until(&mut slow, |r| variant(r) == "v200").await;
    assert_eq!(last.event(), Event::Updated);
}

#[tokio::test]
async fn one_stream_carries_two_kinds_and_a_crd_created_after_start() {
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut client = h.client().await;
    let err = client
        .subscribe(request(&["widgets.example.com/default/w"]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{}", err.message());

    h.fake
        .install_crd(json!({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": { "name": "widgets.example.com" },
            "spec": { "group": "example.com", "scope": "Namespaced",
                "names": { "plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"] },
                "versions": [{ "name": "v1", "served": true, "storage": true,
                    "schema": { "openAPIV3Schema": { "type": "object", "x-kubernetes-preserve-unknown-fields": true } } }] }
        }))
        .unwrap();
    h.fake.apply(json!({ "apiVersion": "example.com/v1", "kind": "Widget", "metadata": { "name": "w" }, "size": 1 })).unwrap();
    // Discovery remembers "no such group" for ABSENT_TTL: the new kind is found after it.
    let both = request(&[&demo("demo"), "Widget.example.com/default/w"]);
    let asked = std::time::Instant::now();
    let mut s = loop {
        match client.subscribe(both.clone()).await {
            Ok(s) => break s.into_inner(),
            Err(e) if e.code() == Code::NotFound && asked.elapsed() < WAIT => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert!(
        asked.elapsed() <= crd_broker::source::kubernetes::ABSENT_TTL + Duration::from_millis(500)
    );
    let mut firsts = [next(&mut s).await, next(&mut s).await];
    firsts.sort_by_key(|r| r.index);
    assert_eq!((firsts[0].index, firsts[0].event()), (0, Event::Snapshot));
    assert_eq!((firsts[1].index, firsts[1].event()), (1, Event::Snapshot));
    assert_eq!(firsts[1].selector, "widgets.v1.example.com/default/w");
    assert_eq!(object(&firsts[1])["size"], 1);
    h.fake.apply(json!({ "apiVersion": "example.com/v1", "kind": "Widget", "metadata": { "name": "w" }, "size": 2 })).unwrap();
    let r = next(&mut s).await;
    assert_eq!(
        (r.index, r.event(), object(&r)["size"].as_i64()),
        (1, Event::Updated, Some(2))
    );
    assert_eq!(h.fake.open_watches(), 2);
}

#[tokio::test]
async fn bad_requests_get_specific_statuses_and_others_are_still_served() {
    let allowed = vec!["featureflags.core.openfeature.dev".parse().unwrap()];
    let h = start_allowing(Duration::from_secs(30), allowed).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    h.fake.install_crd(secrets_crd()).unwrap();
    let mut client = h.client().await;
    let mut healthy = subscribe(&mut client, &[&demo("demo")]).await;
    next(&mut healthy).await;

    let cases: Vec<(crd_broker::pb::SubscribeRequest, Code, &str)> = vec![
        (
            Default::default(),
            Code::InvalidArgument,
            "resources is empty",
        ),
        (
            with(&demo("demo"), |r| r.name = "Not_A_Name".into()),
            Code::InvalidArgument,
            "name \"Not_A_Name\"",
        ),
        (
            with(&demo("demo"), |r| r.group.clear()),
            Code::InvalidArgument,
            "group \"\"",
        ),
        (
            request(&["featureflagz.core.openfeature.dev/default/demo"]),
            Code::NotFound,
            "featureflagz",
        ),
        (
            // Refused by the allow-list before any API call.
            request(&["things.nowhere.example/default/x"]),
            Code::PermissionDenied,
            "--resource allows: featureflags.core.openfeature.dev",
        ),
        (
            request(&["secrets.example.com/default/x"]),
            Code::PermissionDenied,
            "--resource allows: featureflags.core.openfeature.dev",
        ),
        (
            request(&["featureflags.core.openfeature.dev/demo"]),
            Code::InvalidArgument,
            "namespaced",
        ),
        (
            request(&vec![demo("demo").as_str(); 101]),
            Code::InvalidArgument,
            "at most 100",
        ),
    ];
    for (req, code, needle) in cases {
        let status = client.subscribe(req).await.unwrap_err();
        assert_eq!(status.code(), code, "{}", status.message());
        assert!(
            status.message().contains(needle),
            "{:?} lacks {needle:?}",
            status.message()
        );
    }

    // The broker keeps serving the stream that was already open, and new ones.
    h.fake
        .merge_patch(GV, "featureflags", "default", "demo", variant_patch("off"))
        .unwrap();
    assert!(is(&next(&mut healthy).await, Event::Updated, "off"));
    let mut again = subscribe(&mut client, &[&demo("demo")]).await;
    assert!(is(&next(&mut again).await, Event::Snapshot, "off"));
}

/// A request for one selector, with one field changed.
fn with(
    selector: &str,
    change: impl FnOnce(&mut crd_broker::pb::ResourceRef),
) -> crd_broker::pb::SubscribeRequest {
    let mut r = request(&[selector]);
    change(&mut r.resources[0]);
    r
}

#[tokio::test]
async fn a_forbidden_resource_ends_the_stream_with_permission_denied() {
    let h = start(Duration::ZERO).await;
    h.fake.deny(fake_apiserver::Deny {
        verb: Some("list".into()),
        name: Some("secret".into()),
        ..Default::default()
    });
    let mut client = h.client().await;
    let mut s = subscribe(&mut client, &[&demo("secret")]).await;
    let err = ended(&mut s).await;
    assert_eq!(err.code(), Code::PermissionDenied, "{}", err.message());
    assert!(err.message().contains("forbidden"), "{}", err.message());
    // Others are unaffected.
    h.fake.apply(flag("open", "on")).unwrap();
    let mut ok = subscribe(&mut client, &[&demo("open")]).await;
    assert_eq!(next(&mut ok).await.event(), Event::Snapshot);
}

#[tokio::test]
async fn shutdown_ends_streams_with_unavailable() {
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut client = h.client().await;
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    next(&mut s).await;
    let registry = h.broker.registry.clone();
    let stopping = tokio::spawn(h.broker.stop());
    let err = ended(&mut s).await;
    assert_eq!(err.code(), Code::Unavailable);
    stopping.await.unwrap().unwrap();
    assert_eq!(registry.tasks(), 0);
    assert!(h.fake.wait_for(WAIT, |f| f.open_watches() == 0).await);
}
