//! Sets on the native API: a kind's objects in a namespace that a label selector selects. The
//! stream starts with a SNAPSHOT of each member, then SYNCED, then ADDED, UPDATED and DELETED per
//! member; subscribers of one set share one watch; a malformed selector is INVALID_ARGUMENT.

mod support;

use std::time::Duration;

use crd_broker::cli::subscribe::request_for;
use crd_broker::pb;
use crd_broker::pb::subscribe_response::Event;
use crd_broker::selector::Target;
use serde_json::json;
use support::*;
use tonic::Code;

fn labelled(name: &str, app: &str) -> serde_json::Value {
    let mut flag = flag(name, "on");
    flag["metadata"]["labels"] = json!({ "app": app });
    flag
}

fn set(selector: &str) -> pb::SubscribeRequest {
    let target: Target =
        format!("featureflags.core.openfeature.dev/default?labelSelector={selector}")
            .parse()
            .unwrap();
    request_for(&[target])
}

/// A stream of the set of FeatureFlags in `default` that `selector` (URL-encoded) selects.
async fn open_set(
    client: &mut crd_broker::pb::broker_client::BrokerClient<tonic::transport::Channel>,
    selector: &str,
) -> tonic::Streaming<pb::SubscribeResponse> {
    client.subscribe(set(selector)).await.unwrap().into_inner()
}

/// The next response's event and member name.
async fn seen(s: &mut tonic::Streaming<pb::SubscribeResponse>) -> (Event, String) {
    let r = next(s).await;
    let name = r
        .selector
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_string();
    (r.event(), name)
}

#[tokio::test]
async fn a_set_streams_its_members_then_synced_then_each_change() {
    let h = start(Duration::ZERO).await;
    for (name, app) in [("b", "checkout"), ("a", "checkout"), ("c", "cart")] {
        h.fake.apply(labelled(name, app)).unwrap();
    }
    let mut client = h.client().await;
    let mut s = open_set(&mut client, "app%3Dcheckout").await;
    assert_eq!(seen(&mut s).await, (Event::Snapshot, "a".into()));
    assert_eq!(seen(&mut s).await, (Event::Snapshot, "b".into()));
    let synced = next(&mut s).await;
    assert_eq!(synced.event(), Event::Synced);
    assert_eq!(
        synced.selector,
        "featureflags.v1beta1.core.openfeature.dev/default?labelSelector=app=checkout"
    );
    h.fake.apply(labelled("d", "checkout")).unwrap();
    assert_eq!(seen(&mut s).await, (Event::Added, "d".into()));
    h.fake
        .merge_patch(GV, "featureflags", "default", "a", variant_patch("off"))
        .unwrap();
    let updated = next(&mut s).await;
    assert_eq!(
        (updated.event(), variant(&updated)),
        (Event::Updated, "off".into())
    );
    // An object that stops matching leaves the set; one that starts matching joins it.
    h.fake
        .merge_patch(GV, "featureflags", "default", "b", relabel("cart"))
        .unwrap();
    assert_eq!(seen(&mut s).await, (Event::Deleted, "b".into()));
    h.fake
        .merge_patch(GV, "featureflags", "default", "c", relabel("checkout"))
        .unwrap();
    assert_eq!(seen(&mut s).await, (Event::Added, "c".into()));
    h.fake.delete(GV, "featureflags", "default", "a").unwrap();
    let deleted = next(&mut s).await;
    assert_eq!(deleted.event(), Event::Deleted);
    assert_eq!(variant(&deleted), "off", "the last state it had");
}

#[tokio::test]
async fn subscribers_of_one_set_share_one_watch_with_its_label_selector() {
    let h = start(Duration::ZERO).await;
    h.fake.apply(labelled("a", "checkout")).unwrap();
    let mut client = h.client().await;
    let mut streams = Vec::new();
    // The same set, written two ways.
    for selector in ["app%3Dcheckout", "app+%3D%3D+checkout"] {
        let mut s = open_set(&mut client, selector).await;
        assert_eq!(seen(&mut s).await, (Event::Snapshot, "a".into()));
        assert_eq!(next(&mut s).await.event(), Event::Synced);
        streams.push(s);
    }
    let labelled_watches = || {
        h.fake
            .watches()
            .iter()
            .filter(|w| w.label_selector == "app=checkout")
            .count()
    };
    eventually("one watch for the set", WAIT, async || {
        labelled_watches() == 1
    })
    .await;
    drop(streams);
    eventually("no watch once both left", WAIT, async || {
        h.fake.open_watches() == 0
    })
    .await;
}

#[tokio::test]
async fn a_set_of_nothing_yet_is_synced_at_once_and_fills_later() {
    let h = start(Duration::ZERO).await;
    let mut client = h.client().await;
    let mut s = open_set(&mut client, "app%3Dlater").await;
    assert_eq!(next(&mut s).await.event(), Event::Synced);
    h.fake.apply(labelled("x", "later")).unwrap();
    assert_eq!(seen(&mut s).await, (Event::Added, "x".into()));
}

#[tokio::test]
async fn a_set_may_span_every_namespace_with_one_cluster_wide_watch() {
    let h = start(Duration::ZERO).await;
    for (ns, name, app) in [
        ("team-b", "a", "checkout"),
        ("team-a", "a", "checkout"),
        ("team-a", "z", "cart"),
        ("default", "m", "checkout"),
    ] {
        let mut flag = labelled(name, app);
        flag["metadata"]["namespace"] = json!(ns);
        h.fake.apply(flag).unwrap();
    }
    let target: Target = "featureflags.core.openfeature.dev/*?labelSelector=app%3Dcheckout"
        .parse()
        .unwrap();
    let mut client = h.client().await;
    let mut s = client
        .subscribe(request_for(&[target]))
        .await
        .unwrap()
        .into_inner();
    // Members by namespace, then name; the same name in two namespaces is two members.
    for member in ["default/m", "team-a/a", "team-b/a"] {
        let r = next(&mut s).await;
        assert_eq!(
            (r.event(), r.selector),
            (
                Event::Snapshot,
                format!("featureflags.v1beta1.core.openfeature.dev/{member}")
            )
        );
    }
    let synced = next(&mut s).await;
    assert_eq!(
        (synced.event(), synced.selector.as_str()),
        (
            Event::Synced,
            "featureflags.v1beta1.core.openfeature.dev/*?labelSelector=app=checkout"
        )
    );
    h.fake
        .merge_patch(GV, "featureflags", "team-a", "z", relabel("checkout"))
        .unwrap();
    let added = next(&mut s).await;
    assert_eq!(
        (added.event(), added.selector.as_str()),
        (
            Event::Added,
            "featureflags.v1beta1.core.openfeature.dev/team-a/z"
        )
    );
    h.fake.delete(GV, "featureflags", "team-b", "a").unwrap();
    let deleted = next(&mut s).await;
    assert_eq!(
        (deleted.event(), deleted.selector.as_str()),
        (
            Event::Deleted,
            "featureflags.v1beta1.core.openfeature.dev/team-b/a"
        )
    );
    // One watch, of every namespace.
    let watches = h.fake.watches();
    let set_watches: Vec<_> = watches
        .iter()
        .filter(|w| w.label_selector == "app=checkout")
        .collect();
    assert_eq!(set_watches.len(), 1, "{watches:?}");
    assert!(
        !set_watches[0].path.contains("/namespaces/"),
        "{:?}",
        set_watches[0]
    );
}

#[tokio::test]
async fn malformed_sets_are_invalid_arguments_naming_the_fault() {
    let h = start(Duration::ZERO).await;
    let mut client = h.client().await;
    // Written into the request as a client of the API would (`crd-broker subscribe` refuses
    // them itself before it connects).
    for (selector, needle) in [
        ("app in (a", "unclosed '('"),
        ("-app=x", "label key"),
        ("app=-x", "label value"),
    ] {
        let mut malformed = set("app%3Dx");
        malformed.resources[0].label_selector = selector.into();
        let status = client.subscribe(malformed).await.unwrap_err();
        assert_status(&status, Code::InvalidArgument, needle);
        assert_status(&status, Code::InvalidArgument, "label_selector");
    }
    let mut mixed = set("app%3Dx");
    mixed
        .resources
        .push(request(&[&demo("demo")]).resources.remove(0));
    let status = client.subscribe(mixed).await.unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "only resource of its request",
    );
    let mut named = request(&[&demo("demo")]);
    named.resources[0].label_selector = "app=x".into();
    let status = client.subscribe(named).await.unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "a label selector names a set",
    );
    // The broker serves everyone else meanwhile.
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
}

/// A broker on the fake with an admin port, lingering `linger`, at most `max_watches` watches.
async fn broker_for_sets(
    fake: &fake_apiserver::FakeApiServer,
    linger: Duration,
    max_watches: usize,
    limits: crd_broker::access::limits::Config,
) -> crd_broker::broker::Running<crd_broker::source::kubernetes::Kubernetes> {
    let config = crd_broker::broker::Config {
        linger,
        max_watches,
        access: crd_broker::access::Settings {
            limits,
            ..Default::default()
        },
        ..Default::default()
    };
    let listeners = with_admin().await;
    broker_with(fake, listeners, config, vec![])
}

fn flagd_set(selector: &str) -> crd_broker::pb::flagd::SyncFlagsRequest {
    crd_broker::pb::flagd::SyncFlagsRequest {
        provider_id: "test".into(),
        selector: format!("core.openfeature.dev/default?labelSelector={selector}"),
    }
}

const SET: &str = "featureflags.v1beta1.core.openfeature.dev/default?labelSelector=app=checkout";
const R: &str = r#"resource="featureflags.core.openfeature.dev""#;

#[tokio::test]
async fn a_set_is_one_watch_of_the_registry_over_both_protocols_listed_counted_and_lingering() {
    use crd_broker::pb::flagd::flag_sync_service_client::FlagSyncServiceClient;
    let fake = fake().await;
    fake.apply(labelled("a", "checkout")).unwrap();
    let linger = Duration::from_secs(2);
    let broker = broker_for_sets(&fake, linger, 100, Default::default()).await;
    let mut native = connect(broker.addr).await;
    let mut s = open_set(&mut native, "app%3Dcheckout").await;
    assert_eq!(seen(&mut s).await, (Event::Snapshot, "a".into()));
    assert_eq!(next(&mut s).await.event(), Event::Synced);
    let mut flagd = FlagSyncServiceClient::connect(format!("http://{}", broker.addr))
        .await
        .unwrap();
    let mut f = flagd
        .sync_flags(flagd_set("app%3Dcheckout"))
        .await
        .unwrap()
        .into_inner();
    let config = f.message().await.unwrap().unwrap().flag_configuration;
    assert!(config.contains(r#""f":"#), "{config}");
    let labelled_watches = || {
        fake.watches()
            .iter()
            .filter(|w| w.label_selector == "app=checkout")
            .count()
    };
    assert_eq!(labelled_watches(), 1, "one API watch for both protocols");
    let admin = broker.admin_addr.unwrap();
    let (_, body) = http_get(admin, "/debug/watches").await;
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
    let watches = listed["watches"].as_array().unwrap();
    assert_eq!(watches.len(), 1, "{body}");
    assert_eq!(watches[0]["selector"], SET, "{body}");
    assert_eq!(watches[0]["subscribers"], 2, "{body}");
    assert_eq!(watches[0]["members"], 1, "{body}");
    let m = metrics(admin).await;
    assert_eq!(get(&m, &format!("crd_broker_watches{{{R}}}")), 1.0);
    assert_eq!(
        get(&m, &format!("crd_broker_watch_starts_total{{{R}}}")),
        1.0
    );
    // A member's change is an update of the watch.
    fake.merge_patch(GV, "featureflags", "default", "a", variant_patch("off"))
        .unwrap();
    assert_eq!(seen(&mut s).await, (Event::Updated, "a".into()));
    f.message().await.unwrap().unwrap();
    let m = metrics(admin).await;
    assert!(get(&m, &format!("crd_broker_updates_total{{{R}}}")) >= 2.0);
    // Both leave: the watch lingers, then stops as a resource's does.
    drop((s, f));
    tokio::time::sleep(linger / 2).await;
    assert_eq!(labelled_watches(), 1, "lingering");
    eventually("the watch stopped after the linger", WAIT, async || {
        labelled_watches() == 0
    })
    .await;
    let m = metrics(admin).await;
    assert_eq!(get(&m, &format!("crd_broker_watches{{{R}}}")), 0.0);
    assert_eq!(
        get(
            &m,
            &format!(r#"crd_broker_watch_stops_total{{{R},reason="idle"}}"#)
        ),
        1.0
    );
}

#[tokio::test]
async fn sets_count_against_max_watches_and_only_a_cold_one_costs_a_new_watch() {
    let fake = fake().await;
    fake.apply(labelled("a", "checkout")).unwrap();
    fake.apply(flag("demo", "on")).unwrap();
    let limits = crd_broker::access::limits::Config {
        new_watch_rate: 0.001,
        new_watch_burst: 2.0,
        ..Default::default()
    };
    let broker = broker_for_sets(&fake, Duration::from_secs(30), 2, limits).await;
    let mut client = connect(broker.addr).await;
    let mut streams = Vec::new();
    // The first set costs one of the caller's two new watches; its second subscriber none.
    for _ in 0..3 {
        let mut s = open_set(&mut client, "app%3Dcheckout").await;
        assert_eq!(seen(&mut s).await, (Event::Snapshot, "a".into()));
        streams.push(s);
    }
    let mut other = open_set(&mut client, "app%3Dcart").await;
    assert_eq!(next(&mut other).await.event(), Event::Synced);
    // Two watches held, both sets: the broker is full for another set and for a resource.
    let status = client.subscribe(set("app%3Dthird")).await.unwrap_err();
    assert_status(&status, Code::ResourceExhausted, "--max-watches");
    let status = client
        .subscribe(request(&[&demo("demo")]))
        .await
        .unwrap_err();
    assert_status(&status, Code::ResourceExhausted, "--max-watches");
    // The sets already watched are still served to anyone.
    let mut warm = connect(broker.addr).await;
    let mut s = open_set(&mut warm, "app%3Dcheckout").await;
    assert_eq!(seen(&mut s).await, (Event::Snapshot, "a".into()));
    assert_eq!(broker.registry.len(), 2);
}

/// A set lists, watches and holds a namespace's worth of objects: one caller's sets have a
/// budget of their own (`--max-sets-per-caller`, 16 by default), lingering ones counted, apart
/// from its share of the watches; another caller has its own.
#[tokio::test]
async fn a_caller_has_a_budget_of_sets_of_its_own() {
    let fake = fake().await;
    fake.apply(flag("demo", "on")).unwrap();
    let limits = crd_broker::access::limits::Config {
        max_watches_per_caller: 1,
        ..Default::default()
    };
    let broker = broker_for_sets(&fake, Duration::from_secs(30), 100, limits).await;
    let mut client = connect(broker.addr).await;
    for i in 0..crd_broker::access::limits::DEFAULT_MAX_SETS_PER_CALLER {
        let mut s = open_set(&mut client, &format!("%21x{i}")).await;
        assert_eq!(next(&mut s).await.event(), Event::Snapshot);
        // Left at once: the set lingers, and is still the caller's.
    }
    let status = client.subscribe(set("%21x-one-more")).await.unwrap_err();
    assert_status(&status, Code::ResourceExhausted, "--max-sets-per-caller");
    // Its sets did not spend its one watch, nor another caller's sets.
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    let mut other = connect_from(broker.addr, "127.0.0.2").await;
    let mut s = open_set(&mut other, "%21x-of-its-own").await;
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    let m = metrics(broker.admin_addr.unwrap()).await;
    assert_eq!(
        get(
            &m,
            r#"crd_broker_limit_hits_total{limit="sets_per_caller"}"#
        ),
        1.0
    );
}

/// The requests the broker made for the FeatureFlags of `default`: (verb, sendInitialEvents).
fn collection_requests(fake: &fake_apiserver::FakeApiServer) -> Vec<(String, bool)> {
    fake.requests()
        .iter()
        .filter(|r| r.path == NS_PATH)
        .map(|r| (r.verb.clone(), r.param("sendInitialEvents") == Some("true")))
        .collect()
}

#[tokio::test]
async fn a_set_starts_with_a_streaming_list_and_falls_back_to_a_list_where_refused() {
    let h = start(Duration::ZERO).await;
    for (name, app) in [("a", "checkout"), ("b", "checkout"), ("c", "cart")] {
        h.fake.apply(labelled(name, app)).unwrap();
    }
    let mut client = h.client().await;
    let mut s = open_set(&mut client, "app%3Dcheckout").await;
    assert_eq!(seen(&mut s).await, (Event::Snapshot, "a".into()));
    assert_eq!(seen(&mut s).await, (Event::Snapshot, "b".into()));
    assert_eq!(next(&mut s).await.event(), Event::Synced);
    // One watch that sent the members first, and no LIST.
    assert_eq!(collection_requests(&h.fake), [("watch".to_string(), true)]);
    // It goes on as a watch.
    h.fake.apply(labelled("d", "checkout")).unwrap();
    assert_eq!(seen(&mut s).await, (Event::Added, "d".into()));
    drop(s);
    eventually("the set's watch ends", WAIT, async || {
        h.fake.open_watches() == 0
    })
    .await;

    // A server without the feature refuses the parameter: the broker lists from then on.
    h.fake.set_watch_list_enabled(false);
    h.fake.clear_requests();
    let mut s = open_set(&mut client, "app%3Dcart").await;
    assert_eq!(seen(&mut s).await, (Event::Snapshot, "c".into()));
    assert_eq!(next(&mut s).await.event(), Event::Synced);
    let asked = collection_requests(&h.fake);
    assert_eq!(
        asked,
        [
            ("watch".to_string(), true),
            ("list".to_string(), false),
            ("watch".to_string(), false)
        ]
    );
    h.fake.set_watch_list_enabled(true);
    h.fake.clear_requests();
    let mut other = open_set(&mut client, "app%3Dcheckout").await;
    assert_eq!(seen(&mut other).await.0, Event::Snapshot);
    let asked = collection_requests(&h.fake);
    assert_eq!(
        asked.first().map(|r| r.0.as_str()),
        Some("list"),
        "{asked:?}"
    );
}
