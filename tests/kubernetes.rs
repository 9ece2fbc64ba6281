//! The broker against a real kube-apiserver and etcd (`scripts/control-plane`, one per test
//! binary, a namespace per test), deployed as the Helm chart deploys it: as a ServiceAccount
//! with the chart's RBAC. What the broker promises the API server is counted from the API
//! server's own metrics, not the broker's.

mod support;

use std::time::Duration;

use crd_broker::pb::subscribe_response::Event;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};
use support::control_plane::*;
use support::*;

#[tokio::test]
async fn one_api_watch_is_shared_by_ten_subscribers_and_ends_after_the_linger() {
    let plane = control_plane();
    let (ns, group, resource) = widget_world(plane, "one-watch").await;
    create(plane, &resource, &ns, widget(&group, &ns, "w1", "red")).await;
    let broker = plane.deploy(&ns, widget_values(&group, &ns, "3s")).await;
    assert_eq!(plane.open_watches(&group, "widgets").await, 0.0);

    let selector = format!("widgets.{group}/{ns}/w1");
    let mut client = connect(broker.grpc).await;
    let mut first = subscribe(&mut client, &[&selector]).await;
    assert_eq!(next(&mut first).await.event(), Event::Snapshot);
    eventually("the API server serves one watch", WAIT, async || {
        plane.open_watches(&group, "widgets").await == 1.0
    })
    .await;
    let mut streams = vec![first];
    for _ in 0..9 {
        let mut s = subscribe(&mut client, &[&selector]).await;
        assert_eq!(next(&mut s).await.event(), Event::Snapshot);
        streams.push(s);
    }
    assert_eq!(
        plane.open_watches(&group, "widgets").await,
        1.0,
        "ten subscribers share one watch"
    );

    // A change reaches all ten.
    let api: Api<DynamicObject> = Api::namespaced_with(plane.admin().await, &ns, &resource);
    api.patch(
        "w1",
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "color": "blue" } })),
    )
    .await
    .unwrap();
    for s in &mut streams {
        let update = next(s).await;
        assert_eq!(update.event(), Event::Updated);
        assert_eq!(object(&update)["spec"]["color"], "blue");
    }

    // The last subscriber leaves: the watch outlives it by the linger, then ends.
    drop(streams);
    let left = tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        plane.open_watches(&group, "widgets").await,
        1.0,
        "the watch lingers"
    );
    eventually("the watch ends after the linger", WAIT, async || {
        plane.open_watches(&group, "widgets").await == 0.0
    })
    .await;
    assert!(
        left.elapsed() >= Duration::from_secs(3),
        "ended {:?} after the last subscriber left, before the 3 s linger",
        left.elapsed()
    );
}

#[tokio::test]
async fn a_resource_created_later_is_served_through_its_life() {
    let plane = control_plane();
    let (ns, group, resource) = widget_world(plane, "created-later").await;
    let broker = plane.deploy(&ns, widget_values(&group, &ns, "30s")).await;
    let mut client = connect(broker.grpc).await;
    let mut s = subscribe(&mut client, &[&format!("widgets.{group}/{ns}/later")]).await;
    assert_eq!(next(&mut s).await.event(), Event::Absent, "not there yet");

    create(plane, &resource, &ns, widget(&group, &ns, "later", "red")).await;
    let created = next(&mut s).await;
    assert_eq!(created.event(), Event::Snapshot);
    assert_eq!(object(&created)["spec"]["color"], "red");

    let api: Api<DynamicObject> = Api::namespaced_with(plane.admin().await, &ns, &resource);
    api.patch(
        "later",
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "color": "green" } })),
    )
    .await
    .unwrap();
    let updated = next(&mut s).await;
    assert_eq!(updated.event(), Event::Updated);
    assert_eq!(object(&updated)["spec"]["color"], "green");

    api.delete("later", &DeleteParams::default()).await.unwrap();
    let deleted = next(&mut s).await;
    assert_eq!(deleted.event(), Event::Deleted);
    assert_eq!(
        object(&deleted)["spec"]["color"],
        "green",
        "with its last state"
    );

    create(plane, &resource, &ns, widget(&group, &ns, "later", "blue")).await;
    let again = next(&mut s).await;
    assert_eq!(again.event(), Event::Snapshot, "re-created");
    assert_eq!(object(&again)["spec"]["color"], "blue");
    assert_ne!(again.uid, created.uid, "a new object");
}

#[tokio::test]
async fn a_crd_created_while_the_broker_runs_is_served_without_a_restart() {
    let plane = control_plane();
    let ns = plane.namespace("crd-later").await;
    let group = own_group(&ns);
    // Until its kind exists, a broker that serves it is not ready, and says why.
    let mut broker = plane.launch(&ns, widget_values(&group, &ns, "30s")).await;
    let (status, reason) = broker.checked_readiness().await;
    assert_eq!(status, 503, "{reason}");
    assert!(reason.contains(&group), "{reason}");
    let selector = format!("widgets.{group}/{ns}/w1");
    let mut client = connect(broker.grpc).await;
    let unknown = client.subscribe(request(&[&selector])).await;
    let status = match unknown {
        Ok(response) => ended(&mut response.into_inner()).await,
        Err(status) => status,
    };
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");

    plane
        .install_crds(&[crd(&group, "widgets", "Widget")])
        .await;
    create(
        plane,
        &widgets(&group),
        &ns,
        widget(&group, &ns, "w1", "red"),
    )
    .await;
    broker.wait_ready().await;
    eventually("the new kind is served", WAIT, async || {
        let Ok(response) = client.subscribe(request(&[&selector])).await else {
            return false;
        };
        let mut s = response.into_inner();
        matches!(s.message().await, Ok(Some(m)) if m.event() == Event::Snapshot)
    })
    .await;
}

#[tokio::test]
async fn the_control_plane_reports_its_real_version() {
    let plane = control_plane();
    let version: Value = serde_json::from_str(&plane.get("/version").await).unwrap();
    let git = version["gitVersion"].as_str().unwrap();
    assert!(
        git.starts_with("v1.3") && !git.contains("master") && git != "v0.0.0",
        "{version}"
    );
    assert_eq!(version["major"], "1");
}

#[tokio::test]
async fn a_control_plane_on_ipv6_loopback_is_served_over_http2() {
    // A control plane of its own, at [::1]: the broker reaches it over HTTP/2 (`--api-http2`
    // auto, the default), where a URL needs its address in brackets.
    let plane = tokio::task::spawn_blocking(|| support::control_plane::start("::1"))
        .await
        .unwrap();
    assert!(
        plane.server.starts_with("https://[::1]:"),
        "{}",
        plane.server
    );
    let (ns, group, _) = widget_world(&plane, "ipv6").await;
    create(
        &plane,
        &widgets(&group),
        &ns,
        widget(&group, &ns, "w1", "red"),
    )
    .await;
    let broker = plane.deploy(&ns, widget_values(&group, &ns, "30s")).await;
    let mut client = connect(broker.grpc).await;
    let mut s = subscribe(&mut client, &[&format!("widgets.{group}/{ns}/w1")]).await;
    let first = next(&mut s).await;
    assert_eq!(first.event(), Event::Snapshot);
    assert_eq!(object(&first)["spec"]["color"], "red");
    let port: u16 = plane.server.rsplit(':').next().unwrap().parse().unwrap();
    assert!(
        connections_of(broker.child.id().unwrap(), port) >= 1,
        "the broker holds its connection to [::1]:{port}"
    );
}

#[tokio::test]
async fn a_pod_bound_token_for_the_brokers_audience_identifies_its_caller_by_the_real_token_review()
{
    let plane = control_plane();
    let (ns, group, _) = widget_world(plane, "token").await;
    create(
        plane,
        &widgets(&group),
        &ns,
        widget(&group, &ns, "w1", "red"),
    )
    .await;
    // The caller: a pod of the ServiceAccount `app` (there is no kubelet: an API object only).
    plane
        .apply(&[
            json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": { "name": "app", "namespace": ns } }),
            json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "app", "namespace": ns },
                "spec": { "serviceAccountName": "app", "containers": [{ "name": "app", "image": "app" }] } }),
        ])
        .await;
    let mut values = widget_values(&group, &ns, "30s");
    values["access"] = json!({ "identity": "token", "tokenAudience": "crd-broker" });
    let broker = plane.deploy(&ns, values).await;
    let selector = format!("widgets.{group}/{ns}/w1");
    let mut client = connect(broker.grpc).await;
    let with_token = |token: &str| {
        let mut request = tonic::Request::new(request(&[&selector]));
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        request
    };

    let bound = plane.token(&ns, "app", &["crd-broker"], Some("app")).await;
    let mut s = client
        .subscribe(with_token(&bound))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        next(&mut s).await.event(),
        Event::Snapshot,
        "its own namespace"
    );

    // A token for the API server, or for someone else, is not the broker's.
    for audiences in [vec![], vec!["another-service"]] {
        let token = plane.token(&ns, "app", &audiences, Some("app")).await;
        let refused = client.subscribe(with_token(&token)).await.unwrap_err();
        assert_eq!(
            refused.code(),
            tonic::Code::Unauthenticated,
            "{audiences:?}: {refused:?}"
        );
        assert!(
            refused.message().contains("the bearer token was refused"),
            "{audiences:?}: {}",
            refused.message()
        );
    }
}

#[tokio::test]
async fn rights_revoked_while_serving_are_reported_and_recovered_from_when_restored() {
    let plane = control_plane();
    let (ns, group, resource) = widget_world(plane, "revoked").await;
    for name in ["w1", "w2"] {
        create(plane, &resource, &ns, widget(&group, &ns, name, "red")).await;
    }
    let mut values = widget_values(&group, &ns, "30s");
    values["extraEnv"] = json!([
        { "name": "CRD_BROKER_READINESS_INTERVAL", "value": "300ms" },
        { "name": "CRD_BROKER_MAX_STALENESS", "value": "3s" },
    ]);
    let broker = plane.deploy(&ns, values).await;
    let mut client = connect(broker.grpc).await;
    let w1 = format!("widgets.{group}/{ns}/w1");
    let w2 = format!("widgets.{group}/{ns}/w2");
    let mut open = subscribe(&mut client, &[&w1]).await;
    assert_eq!(next(&mut open).await.event(), Event::Snapshot);

    // The chart's RoleBinding removed: the broker may no longer list or watch widgets here.
    let revoked = plane.revoke(&ns, &ns).await;
    // Like an outage of the API server: ready, serving what it knows, for --max-staleness, and
    // saying why; then not ready.
    eventually(
        "the broker says it may not list its kinds",
        WAIT,
        async || {
            matches!(broker.readiness().await,
            Some((200, reason)) if reason.contains(&format!("may not list widgets.{group}")))
        },
    )
    .await;
    eventually("not ready after --max-staleness", WAIT, async || {
        matches!(broker.readiness().await, Some((503, _)))
    })
    .await;
    // A resource it does not watch yet is refused, with the reason.
    let refused = match client.subscribe(request(&[&w2])).await {
        Ok(response) => ended(&mut response.into_inner()).await,
        Err(status) => status,
    };
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    // The watch already open goes on: the API server authorizes a watch when it starts.
    let api: Api<DynamicObject> = Api::namespaced_with(plane.admin().await, &ns, &resource);
    api.patch(
        "w1",
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "color": "blue" } })),
    )
    .await
    .unwrap();
    let update = next(&mut open).await;
    assert_eq!(
        (update.event(), object(&update)["spec"]["color"].clone()),
        (Event::Updated, json!("blue"))
    );

    // Restored: ready again, and the refused resource is served.
    plane.restore(revoked).await;
    eventually("ready again", WAIT, async || {
        matches!(broker.readiness().await, Some((200, _)))
    })
    .await;
    // The refused resource's watch retries with backoff: it is served again at its next try.
    let restored_at = tokio::time::Instant::now();
    eventually("the refused resource is served again", WAIT, async || {
        let Ok(response) = client.subscribe(request(&[&w2])).await else {
            return false;
        };
        let mut s = response.into_inner();
        matches!(s.message().await, Ok(Some(m)) if m.event() == Event::Snapshot)
    })
    .await;
    eprintln!(
        "rights restored: ready and serving again within {:?}",
        restored_at.elapsed()
    );
}

#[tokio::test]
async fn a_half_open_http2_connection_to_the_api_server_is_found_by_its_pings() {
    let found = half_open("half-open-h2", "auto").await;
    eprintln!("--api-http2 auto: a half-open connection found and the change served in {found:?}");
}

#[tokio::test]
async fn a_half_open_http1_connection_to_the_api_server_is_found_by_the_watch_s_silence() {
    let found = half_open("half-open-h1", "off").await;
    eprintln!("--api-http2 off: a half-open connection found and the change served in {found:?}");
}

/// Within a minute, however the broker speaks (`--api-http2 mode`), a connection to the API
/// server that silently stops carrying is given up, and a change made meanwhile reaches the
/// subscriber: how long that took.
async fn half_open(test: &str, mode: &str) -> Duration {
    let plane = control_plane();
    let (ns, group, resource) = widget_world(plane, test).await;
    create(plane, &resource, &ns, widget(&group, &ns, "w1", "red")).await;
    let server: std::net::SocketAddr = plane.server.trim_start_matches("https://").parse().unwrap();
    let relay = support::relay::Relay::to(server).await;
    let mut values = widget_values(&group, &ns, "30s");
    values["extraArgs"] = json!(["--api-http2", mode]);
    let broker = plane
        .deploy_through(&ns, values, &format!("https://{}", relay.address))
        .await;
    let mut client = connect(broker.grpc).await;
    let mut s = subscribe(&mut client, &[&format!("widgets.{group}/{ns}/w1")]).await;
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    let api: Api<DynamicObject> = Api::namespaced_with(plane.admin().await, &ns, &resource);
    let paint = async |color: &str| {
        api.patch(
            "w1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "color": color } })),
        )
        .await
        .unwrap();
    };
    if mode == "off" {
        // Over HTTP/1.1 nothing pings: the watch asks the server to end it within 35 s, and the
        // server does, so a quiet watch is never taken for a dead one.
        eventually(
            "the API server ends the watch",
            Duration::from_secs(60),
            async || plane.requests(&group, "WATCH").await >= 1.0,
        )
        .await;
        let errors = total(
            &metrics(broker.admin).await,
            "crd_broker_watch_errors_total",
            &[],
        );
        assert_eq!(
            errors, 0.0,
            "no watch error when the server ends a quiet watch"
        );
    }
    // A change comes through: the watch is streaming.
    paint("green").await;
    assert_eq!(next(&mut s).await.event(), Event::Updated);

    // Every connection the broker has goes half-open, and the widget changes meanwhile.
    let before = relay.accepted();
    relay.freeze();
    let frozen = tokio::time::Instant::now();
    paint("blue").await;
    let update = tokio::time::timeout(Duration::from_secs(90), s.message())
        .await
        .expect("the change arrives at last")
        .unwrap()
        .expect("the stream goes on");
    let found = frozen.elapsed();
    assert_eq!(
        (update.event(), object(&update)["spec"]["color"].clone()),
        (Event::Updated, json!("blue"))
    );
    assert!(
        relay.accepted() > before,
        "the broker reached the API server on a new connection"
    );
    assert!(
        found < Duration::from_secs(60),
        "the half-open connection was left after {found:?}"
    );
    assert!(matches!(broker.readiness().await, Some((200, _))));
    found
}

#[tokio::test]
async fn priority_and_fairness_rejecting_the_broker_is_waited_out_as_the_server_asks() {
    let plane = control_plane();
    let (ns, group, resource) = widget_world(plane, "starved").await;
    let names = many_widgets(plane, &group, &ns, 40).await;
    let mut values = widget_values(&group, &ns, "30s");
    // A watch per name, so that a subscription to forty asks forty LISTs at once.
    values["extraArgs"] = json!(["--namespace-watch-threshold", "0"]);
    let broker = plane.deploy(&ns, values).await;

    // The broker's ServiceAccount gets a priority level of its own with the fewest seats there
    // are (one share of the server's concurrency), which rejects what does not fit.
    let starved = format!("{ns}-starved");
    plane.prioritize(&starved, &ns, &broker.namespace, 1).await;

    // Forty new resources at once: the server rejects most of the broker's requests, saying
    // when to come back; the broker holds every request that long, and serves all forty.
    let mut client = connect(broker.grpc).await;
    let selectors: Vec<String> = names
        .iter()
        .map(|n| format!("widgets.{group}/{ns}/{n}"))
        .collect();
    let selectors: Vec<&str> = selectors.iter().map(String::as_str).collect();
    let asked = tokio::time::Instant::now();
    let mut s = subscribe(&mut client, &selectors).await;
    for _ in &names {
        let first = tokio::time::timeout(Duration::from_secs(120), s.message())
            .await
            .expect("every resource is served at last")
            .unwrap()
            .expect("the stream goes on");
        assert_eq!(first.event(), Event::Snapshot);
    }
    let served = asked.elapsed();
    let refused = plane.rejected(&starved).await;
    let ours = metrics(broker.admin).await;
    let held = get(
        &ours,
        "crd_broker_api_held_seconds_total{reason=\"retry_after\"}",
    );
    let too_many = total(&ours, "crd_broker_api_requests_total", &[("code", "429")]);
    eprintln!(
        "starved: forty served in {served:?}; the server rejected {refused} requests, the broker \
         saw {too_many} 429s and held its requests {held:.1} s as asked"
    );
    assert!(
        refused > 0.0,
        "the priority level rejected some of the broker's requests"
    );
    assert!(too_many > 0.0 && held > 0.0);

    // The schema removed: a change reaches the subscriber at once.
    plane.unprioritize(&starved).await;
    let api: Api<DynamicObject> = Api::namespaced_with(plane.admin().await, &ns, &resource);
    api.patch(
        &names[0],
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "color": "blue" } })),
    )
    .await
    .unwrap();
    let update = next(&mut s).await;
    assert_eq!(update.event(), Event::Updated);
}

#[tokio::test]
async fn the_brokers_own_rate_limit_from_its_environment_paces_what_the_server_sees() {
    let plane = control_plane();
    let (ns, group, _) = widget_world(plane, "paced").await;
    let names = many_widgets(plane, &group, &ns, 10).await;
    let mut values = widget_values(&group, &ns, "30s");
    values["extraArgs"] = json!(["--namespace-watch-threshold", "0"]);
    values["extraEnv"] = json!([
        { "name": "CRD_BROKER_API_QPS", "value": "4" },
        { "name": "CRD_BROKER_API_BURST", "value": "1" },
    ]);
    let broker = plane.deploy(&ns, values).await;
    let before = plane.requests(&group, "LIST").await + plane.requests(&group, "GET").await;
    let asked = tokio::time::Instant::now();
    subscribe_all(&broker, &group, &ns, &names).await;
    let took = asked.elapsed();
    // Ten LISTs (the API server counts one with a name's fieldSelector as a GET) at four a
    // second, one at once: nine of them waited a quarter of a second each at least.
    let lists = plane.requests(&group, "LIST").await + plane.requests(&group, "GET").await - before;
    assert_eq!(lists, 10.0);
    assert!(took >= Duration::from_millis(2250), "ten LISTs in {took:?}");
    let held = get(
        &metrics(broker.admin).await,
        "crd_broker_api_held_seconds_total{reason=\"rate\"}",
    );
    assert!(held >= 2.0, "held {held} s");
}

/// The FeatureFlag CRD as the OpenFeature Operator installs it.
fn feature_flag_crd() -> Value {
    crd_broker::yaml::from_str(support::CRD).unwrap()
}

/// The broker's values for serving FeatureFlags in `namespace` alone.
fn flag_values(namespace: &str) -> Value {
    json!({
        "watchNamespaces": [namespace],
        "linger": "30s",
        "access": { "identity": "none" },
    })
}

#[tokio::test]
async fn the_python_flagd_provider_evaluates_flags_from_the_real_server_and_their_changes() {
    let plane = control_plane();
    let ns = plane.namespace("flagd-provider").await;
    plane.install_crds(&[feature_flag_crd()]).await;
    plane.apply(&[flag_in(&ns, "demo", "on")]).await;
    let broker = plane.deploy(&ns, flag_values(&ns)).await;

    let selector = format!("core.openfeature.dev/{ns}/demo");
    let mut provider = support::flagd::Provider::start(broker.grpc, &selector).await;
    let seen = provider.expect("f", json!(true)).await;
    assert!(
        seen.starts_with("seen "),
        "f is on, as the FeatureFlag says"
    );

    // Turned off on the API server: the provider evaluates the change within 2 s.
    let api: Api<DynamicObject> = Api::namespaced_with(plane.admin().await, &ns, &feature_flags());
    let edited = tokio::time::Instant::now();
    api.patch(
        "demo",
        &PatchParams::default(),
        &Patch::Merge(variant_patch("off")),
    )
    .await
    .unwrap();
    let seen = provider.expect("f", json!(false)).await;
    assert!(seen.starts_with("seen "), "the change is evaluated: {seen}");
    let took = edited.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "the change took {took:?} to evaluate"
    );
    eprintln!("an edit on the API server evaluated by the provider after {took:?}");
}

#[tokio::test]
async fn flagd_sync_fetch_and_the_merged_set_selector_on_the_real_server() {
    use crd_broker::pb::flagd;
    use crd_broker::pb::flagd::flag_sync_service_client::FlagSyncServiceClient;
    let plane = control_plane();
    let ns = plane.namespace("flagd-sets").await;
    plane.install_crds(&[feature_flag_crd()]).await;
    let labelled = |name: &str, key: &str| {
        let mut f = flag_in(&ns, name, "on");
        f["metadata"]["labels"] = json!({ "app": "checkout" });
        let flags = f["spec"]["flagSpec"]["flags"]["f"].clone();
        f["spec"]["flagSpec"]["flags"] = json!({ key: flags });
        f
    };
    plane
        .apply(&[
            flag_in(&ns, "demo", "on"),
            labelled("a", "from-a"),
            labelled("b", "from-b"),
        ])
        .await;
    let broker = plane.deploy(&ns, flag_values(&ns)).await;
    let mut client = FlagSyncServiceClient::connect(format!("http://{}", broker.grpc))
        .await
        .unwrap();

    let one = format!("core.openfeature.dev/{ns}/demo");
    let mut sync = client
        .sync_flags(flagd::SyncFlagsRequest {
            provider_id: String::new(),
            selector: one.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = sync.message().await.unwrap().unwrap();
    let config: Value = serde_json::from_str(&first.flag_configuration).unwrap();
    assert_eq!(config["flags"]["f"]["defaultVariant"], "on");
    let fetched = client
        .fetch_all_flags(flagd::FetchAllFlagsRequest {
            provider_id: String::new(),
            selector: one,
        })
        .await
        .unwrap()
        .into_inner();
    let fetched: Value = serde_json::from_str(&fetched.flag_configuration).unwrap();
    assert_eq!(
        fetched["flags"], config["flags"],
        "FetchAllFlags serves what SyncFlags does"
    );

    let set = format!("core.openfeature.dev/{ns}?labelSelector=app%3Dcheckout");
    let mut merged = client
        .sync_flags(flagd::SyncFlagsRequest {
            provider_id: String::new(),
            selector: set,
        })
        .await
        .unwrap()
        .into_inner();
    let config: Value =
        serde_json::from_str(&merged.message().await.unwrap().unwrap().flag_configuration).unwrap();
    let keys: Vec<&String> = config["flags"].as_object().unwrap().keys().collect();
    assert_eq!(
        keys,
        ["from-a", "from-b"],
        "the labelled FeatureFlags, merged: {config}"
    );
}

#[tokio::test]
async fn past_the_threshold_one_namespace_watch_feeds_every_name_and_below_half_a_watch_each_again()
{
    let plane = control_plane();
    let (ns, group, _) = widget_world(plane, "granularity").await;
    let names = many_widgets(plane, &group, &ns, 200).await;
    let broker = plane.deploy(&ns, widget_values(&group, &ns, "1s")).await;
    // 150 of 200 names: past --namespace-watch-threshold (100), and far more than a quarter.
    let a = subscribe_all(&broker, &group, &ns, &names[..100]).await;
    let b = subscribe_all(&broker, &group, &ns, &names[100..140]).await;
    let c = subscribe_all(&broker, &group, &ns, &names[140..150]).await;
    eventually("one namespace watch on the API server", WAIT, async || {
        plane.open_watches(&group, "widgets").await == 1.0
    })
    .await;
    // 50 left: not below half the threshold, so the namespace watch stays.
    drop(a);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(plane.open_watches(&group, "widgets").await, 1.0);
    // 10 left: a watch per name again.
    drop(b);
    eventually("a watch per name on the API server", WAIT, async || {
        plane.open_watches(&group, "widgets").await == 10.0
    })
    .await;
    drop(c);
}

#[tokio::test]
async fn a_role_that_names_objects_lets_the_broker_serve_those_and_only_those() {
    let plane = control_plane();
    let (ns, group, _) = widget_world(plane, "resource-names").await;
    many_widgets(plane, &group, &ns, 3).await;
    // The chart's Role, narrowed to two names.
    let mut broker = plane.launch(&ns, widget_values(&group, &ns, "30s")).await;
    plane
        .apply(&[json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": { "name": ns, "namespace": ns },
            "rules": [{
                "apiGroups": [group], "resources": ["widgets"],
                "resourceNames": ["w0", "w1"], "verbs": ["get", "list", "watch"],
            }],
        })])
        .await;
    broker.wait_ready().await;
    let mut client = connect(broker.grpc).await;
    for name in ["w0", "w1"] {
        let mut s = subscribe(&mut client, &[&format!("widgets.{group}/{ns}/{name}")]).await;
        assert_eq!(next(&mut s).await.event(), Event::Snapshot, "{name}");
    }
    let other = match client
        .subscribe(request(&[&format!("widgets.{group}/{ns}/w2")]))
        .await
    {
        Ok(response) => ended(&mut response.into_inner()).await,
        Err(status) => status,
    };
    assert_eq!(other.code(), tonic::Code::PermissionDenied, "{other:?}");
}

#[tokio::test]
async fn peer_pod_identifies_a_caller_by_a_real_pod_s_ip() {
    let plane = control_plane();
    let (ns, group, _) = widget_world(plane, "peer-pod").await;
    many_widgets(plane, &group, &ns, 1).await;
    // A pod at 127.0.0.17: no kubelet here, so its IP is written through pods/status, as a
    // kubelet reports it.
    let ip = "127.0.0.17";
    plane
        .apply(&[
            json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": { "name": "app", "namespace": ns } }),
            json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "app", "namespace": ns },
                "spec": { "serviceAccountName": "app", "containers": [{ "name": "app", "image": "app" }] } }),
        ])
        .await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(plane.admin().await, &ns);
    pods.patch_status(
        "app",
        &PatchParams::default(),
        &Patch::Merge(
            json!({ "status": { "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }] } }),
        ),
    )
    .await
    .unwrap();
    let mut values = widget_values(&group, &ns, "30s");
    values["access"] = json!({ "identity": "peer-pod" });
    let broker = plane.deploy(&ns, values).await;
    let selector = format!("widgets.{group}/{ns}/w0");

    let mut pod = connect_from(broker.grpc, ip).await;
    let mut s = subscribe(&mut pod, &[&selector]).await;
    assert_eq!(
        next(&mut s).await.event(),
        Event::Snapshot,
        "the pod reads its namespace"
    );

    let mut stranger = connect_from(broker.grpc, "127.0.0.18").await;
    let refused = stranger.subscribe(request(&[&selector])).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
}

#[tokio::test]
async fn a_version_no_longer_served_fails_its_subscribers_and_flagd_follows_the_new_one() {
    use crd_broker::pb::flagd;
    use crd_broker::pb::flagd::flag_sync_service_client::FlagSyncServiceClient;
    // A control plane of its own: this test changes the FeatureFlag CRD others use.
    let plane = tokio::task::spawn_blocking(|| support::control_plane::start("127.0.0.1"))
        .await
        .unwrap();
    let ns = plane.namespace("version-moved").await;
    let mut crd = feature_flag_crd();
    plane.install_crds(std::slice::from_ref(&crd)).await;
    plane.apply(&[flag_in(&ns, "demo", "on")]).await;
    let broker = plane.deploy(&ns, flag_values(&ns)).await;
    let mut client = connect(broker.grpc).await;
    let mut native = subscribe(
        &mut client,
        &[&format!("featureflags.core.openfeature.dev/{ns}/demo")],
    )
    .await;
    let first = next(&mut native).await;
    assert_eq!(object(&first)["apiVersion"], "core.openfeature.dev/v1beta1");
    let selector = format!("core.openfeature.dev/{ns}/demo");
    let sync = |selector: String| async move {
        let mut flagd = FlagSyncServiceClient::connect(format!("http://{}", broker.grpc))
            .await
            .unwrap();
        flagd
            .sync_flags(flagd::SyncFlagsRequest {
                provider_id: String::new(),
                selector,
            })
            .await
            .map(tonic::Response::into_inner)
    };
    let mut sidecar = sync(selector.clone()).await.unwrap();
    sidecar.message().await.unwrap().unwrap();

    // The CRD moves on: v1 served (and stored), v1beta1 no longer served.
    let mut v1 = crd["spec"]["versions"][0].clone();
    v1["name"] = json!("v1");
    crd["spec"]["versions"][0]["served"] = json!(false);
    crd["spec"]["versions"][0]["storage"] = json!(false);
    crd["spec"]["versions"].as_array_mut().unwrap().push(v1);
    plane.install_crds(&[crd]).await;

    // The native subscriber is told, with the reason; the flagd stream ends, so that the
    // sidecar reconnects.
    let failed = next(&mut native).await;
    assert_eq!(failed.event(), Event::Failed);
    assert_eq!(
        tonic::Code::from_i32(failed.error_code),
        tonic::Code::NotFound,
        "{failed:?}"
    );
    let ended = tokio::time::timeout(WAIT, async {
        loop {
            match sidecar.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return None,
                Err(status) => return Some(status),
            }
        }
    })
    .await
    .expect("the flagd stream ends");
    assert_eq!(ended.map(|s| s.code()), Some(tonic::Code::NotFound));

    // Reconnecting, flagd's selector (which names no version) resolves to the new one.
    eventually("flagd is served again, at v1", WAIT, async || {
        let Ok(mut again) = sync(selector.clone()).await else {
            return false;
        };
        matches!(again.message().await, Ok(Some(m))
            if serde_json::from_str::<Value>(&m.flag_configuration).unwrap()["flags"]["f"]["defaultVariant"] == "on")
    })
    .await;
    let mut fresh = subscribe(
        &mut client,
        &[&format!("featureflags.core.openfeature.dev/{ns}/demo")],
    )
    .await;
    assert_eq!(
        object(&next(&mut fresh).await)["apiVersion"],
        "core.openfeature.dev/v1"
    );
}

#[tokio::test]
async fn the_debug_endpoints_let_in_a_token_whose_user_real_rbac_allows_the_path() {
    let plane = control_plane();
    let (ns, group, _) = widget_world(plane, "admin-auth").await;
    let mut values = widget_values(&group, &ns, "30s");
    // On 127.0.0.3: a caller connecting from 127.0.0.1 or .2 is not in the broker's own pod.
    values["listenAddress"] = json!("127.0.0.3");
    values["admin"] = json!({ "auth": "kubernetes", "metricsAuth": "kubernetes" });
    let broker = plane.deploy(&ns, values).await;
    let reader_role = format!("{ns}-debug-reader");
    plane
        .apply(&[
            json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": { "name": "reader", "namespace": ns } }),
            json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": { "name": "nobody", "namespace": ns } }),
            json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": { "name": format!("{ns}-reader") },
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": reader_role },
                "subjects": [{ "kind": "ServiceAccount", "name": "reader", "namespace": ns }] }),
        ])
        .await;
    let reader = plane.token(&ns, "reader", &[], None).await;
    let nobody = plane.token(&ns, "nobody", &[], None).await;
    let admin = broker.admin;
    for path in ["/debug/watches", "/debug/callers", "/metrics"] {
        let (status, body) = http_get_as(admin, "127.0.0.2", path, None).await;
        assert_eq!(status, 401, "{path} without a token: {body}");
        let (status, body) = http_get_as(admin, "127.0.0.2", path, Some("made-up")).await;
        assert_eq!(status, 401, "{path} with a made-up token: {body}");
        assert!(body.contains("the bearer token was refused"), "{body}");
        let (status, body) = http_get_as(admin, "127.0.0.2", path, Some(&nobody)).await;
        assert_eq!(status, 403, "{path} for a user without the grant: {body}");
        assert!(
            body.contains(&format!("system:serviceaccount:{ns}:nobody")) && body.contains(path),
            "{body}"
        );
        let (status, body) = http_get_as(admin, "127.0.0.2", path, Some(&reader)).await;
        assert_eq!(status, 200, "{path} for the reader: {body}");
    }
    // Probes stay open.
    assert_eq!(
        http_get_as(admin, "127.0.0.2", "/readyz", None).await.0,
        200
    );
    // `crd-broker top --token-file` sends the token (it connects from 127.0.0.1).
    let refused = crd_broker::cli::top::fetch(&admin.to_string(), None)
        .await
        .unwrap_err();
    assert!(
        format!("{refused:#}").contains("answered 401")
            && format!("{refused:#}").contains("--token-file"),
        "{refused:#}"
    );
    crd_broker::cli::top::fetch(&admin.to_string(), Some(&reader))
        .await
        .expect("top reads the broker with the reader's token");
}

/// Where `held` (an object as the API server holds it) departs from `wanted` (as rendered):
/// every field of `wanted` is in `held` with the same value; the server may add defaults.
fn departures(held: &Value, wanted: &Value, at: &str) -> Vec<String> {
    match (held, wanted) {
        (Value::Object(h), Value::Object(w)) => w
            .iter()
            .flat_map(|(k, v)| {
                departures(h.get(k).unwrap_or(&Value::Null), v, &format!("{at}.{k}"))
            })
            .collect(),
        (Value::Array(h), Value::Array(w)) if h.len() == w.len() => h
            .iter()
            .zip(w)
            .enumerate()
            .flat_map(|(i, (h, w))| departures(h, w, &format!("{at}[{i}]")))
            .collect(),
        (h, w) if h == w => vec![],
        (h, w) => vec![format!("{at}: held {h}, rendered {w}")],
    }
}

/// The chart's default and HA installs as the real helm lints (`--strict`) and renders them,
/// applied to the real API server (every object, not a dry run) and read back as rendered; then
/// the broker runs as the ServiceAccount the default install creates and serves a FeatureFlag
/// under the RBAC it grants.
#[tokio::test]
async fn helms_default_and_ha_installs_apply_to_the_real_server_and_the_broker_runs_under_them() {
    let plane = control_plane();
    plane.install_crds(&[feature_flag_crd()]).await;
    let ha = support::chart::yaml_file(&support::chart::chart().join("ci/ha-values.yaml"));
    for (test, values) in [("helm-default", json!({})), ("helm-ha", ha)] {
        let ns = plane.namespace(test).await;
        let docs = support::chart::render_release(&ns, &ns, values).expect("helm renders");
        let objects = placed(&docs, &ns);
        let kinds: std::collections::BTreeSet<&str> = objects
            .iter()
            .map(|o| o["kind"].as_str().unwrap())
            .collect();
        for kind in [
            "Deployment",
            "Service",
            "ServiceAccount",
            "ClusterRole",
            "PodDisruptionBudget",
        ] {
            assert!(kinds.contains(kind), "{test}: {kind} in {kinds:?}");
        }
        plane.apply(&objects).await;
        for object in &objects {
            let held = plane.read(object).await;
            let off = departures(&held, object, object["kind"].as_str().unwrap());
            assert!(off.is_empty(), "{test}: {off:#?}");
        }
        println!(
            "{test}: {} objects applied and read back: {kinds:?}",
            objects.len()
        );
    }

    let ns = plane.namespace("helm-runs").await;
    plane.apply(&[flag_in(&ns, "demo", "on")]).await;
    let broker = plane.deploy(&ns, flag_values(&ns)).await;
    let account = plane
        .read(&json!({ "apiVersion": "apps/v1", "kind": "Deployment",
                       "metadata": { "namespace": ns, "name": ns } }))
        .await["spec"]["template"]["spec"]["serviceAccountName"]
        .clone();
    assert_eq!(
        account,
        json!(ns),
        "the Deployment runs as the chart's account"
    );
    let mut client = connect(broker.grpc).await;
    let selector = format!("featureflags.core.openfeature.dev/{ns}/demo");
    let mut stream = subscribe(&mut client, &[&selector]).await;
    assert_eq!(next(&mut stream).await.event(), Event::Snapshot);
}
