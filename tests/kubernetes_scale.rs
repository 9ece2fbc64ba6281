//! The broker at scale against a real kube-apiserver and etcd (`scripts/control-plane`): a
//! thousand watches over HTTP/2 and HTTP/1.1, and a namespace of ten thousand objects listed in
//! pages. A binary of its own, so that its load does not slow the other real-server tests.

mod support;

use std::time::Duration;

use serde_json::json;
use support::control_plane::*;
use support::*;

#[tokio::test]
async fn a_thousand_watched_resources_share_a_dozen_http2_connections_and_hold_one_each_without() {
    use futures::StreamExt;
    let plane = control_plane();
    let (ns, group, resource) = widget_world(plane, "http2").await;
    let names: Vec<String> = (0..1000).map(|i| format!("w{i}")).collect();
    futures::stream::iter(&names)
        .for_each_concurrent(16, |name| {
            create(plane, &resource, &ns, widget(&group, &ns, name, "red"))
        })
        .await;
    let port: u16 = plane.server.rsplit(':').next().unwrap().parse().unwrap();
    for (mode, most, least) in [("auto", 12, 1), ("off", usize::MAX, 1000)] {
        let mut values = widget_values(&group, &ns, "1s");
        // A watch per name (no switch to one namespace watch), over HTTP/2 or not.
        values["extraEnv"] = json!([
            { "name": "CRD_BROKER_NAMESPACE_WATCH_THRESHOLD", "value": "0" },
            { "name": "CRD_BROKER_API_HTTP2", "value": mode },
        ]);
        values["fullnameOverride"] = json!(format!("{ns}-{mode}"));
        let broker = plane.deploy(&ns, values).await;
        let streams = subscribe_all(&broker, &group, &ns, &names).await;
        eventually("the API server serves a watch per name", WAIT, async || {
            plane.open_watches(&group, "widgets").await == 1000.0
        })
        .await;
        let held = connections_of(broker.child.id().unwrap(), port);
        assert!(
            (least..=most).contains(&held),
            "--api-http2 {mode}: {held} connections for 1,000 watches"
        );
        eprintln!("--api-http2 {mode}: 1,000 watches over {held} connections");
        drop(streams);
        drop(broker);
        eventually("the watches end", WAIT, async || {
            plane.open_watches(&group, "widgets").await == 0.0
        })
        .await;
    }
}

#[tokio::test]
async fn a_namespace_of_ten_thousand_lists_in_pages_and_then_the_sparse_rule_applies() {
    let plane = control_plane();
    let (ns, group, _) = widget_world(plane, "ten-thousand").await;
    let created = tokio::time::Instant::now();
    let names = many_widgets(plane, &group, &ns, 10_000).await;
    eprintln!("10,000 objects created in {:?}", created.elapsed());
    let broker = plane.deploy(&ns, widget_values(&group, &ns, "30s")).await;
    // 101 names: past --namespace-watch-threshold (100), so the broker lists the namespace to
    // see whether one watch could feed them; 101 of 10,000 is far below a quarter, so each
    // name keeps a watch of its own.
    let _streams = subscribe_all(&broker, &group, &ns, &names[..101]).await;
    eventually(
        "a watch per name on the API server",
        Duration::from_secs(30),
        async || plane.open_watches(&group, "widgets").await == 101.0,
    )
    .await;
    let lists = get(
        &metrics(broker.admin).await,
        r#"crd_broker_api_requests_total{verb="list",code="200"}"#,
    );
    // A LIST for each name, and the namespace's in pages of 500.
    assert!(lists >= 101.0 + 20.0, "{lists} LIST requests");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        plane.open_watches(&group, "widgets").await,
        101.0,
        "and it stays so"
    );
}

#[tokio::test]
async fn what_the_api_server_sees_for_one_a_hundred_and_a_thousand_resources() {
    let plane = control_plane();
    let port: u16 = plane.server.rsplit(':').next().unwrap().parse().unwrap();
    let mut table = Vec::new();
    for crs in [1usize, 100, 1000] {
        let ns = plane.namespace(&format!("claims-{crs}")).await;
        let group = own_group(&ns);
        plane
            .install_crds(&[crd(&group, "widgets", "Widget")])
            .await;
        let names = many_widgets(plane, &group, &ns, crs).await;
        let mut values = widget_values(&group, &ns, "30s");
        // A watch per name, whatever their number: the claim is one LIST and one WATCH each.
        values["extraEnv"] =
            json!([{ "name": "CRD_BROKER_NAMESPACE_WATCH_THRESHOLD", "value": "0" }]);
        let broker = plane.deploy(&ns, values).await;
        // Ten subscribers for each resource.
        let mut streams = Vec::new();
        for _ in 0..10 {
            streams.extend(subscribe_all(&broker, &group, &ns, &names).await);
        }
        eventually(
            "a watch per resource",
            Duration::from_secs(30),
            async || plane.open_watches(&group, "widgets").await == crs as f64,
        )
        .await;
        // The API server counts a LIST of one name (`fieldSelector=metadata.name=…`) as a GET
        // of it, and a WATCH when it ends: the watches are those it serves now and those ended.
        let open = plane.open_watches(&group, "widgets").await;
        let (lists, watches) = (
            plane.requests(&group, "LIST").await + plane.requests(&group, "GET").await,
            plane.requests(&group, "WATCH").await + open,
        );
        let connections = connections_of(broker.child.id().unwrap(), port);
        table.push(format!(
            "| {crs} | {} | {lists} | {watches} | {open} | {connections} |",
            crs * 10
        ));
        assert_eq!(lists, crs as f64, "one LIST per resource");
        assert_eq!(watches, crs as f64, "one WATCH per resource");
        assert!(
            connections <= crs.div_ceil(100) + 1,
            "{connections} connections"
        );
    }
    eprintln!(
        "| CRs | subscribers | LISTs | WATCHes | watches open | connections |\n|---|---|---|---|---|---|\n{}",
        table.join("\n")
    );
}
