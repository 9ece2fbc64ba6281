//! The broker at scale against a real kube-apiserver and etcd (`scripts/control-plane`): a
//! thousand watches over HTTP/2 and HTTP/1.1, a namespace of ten thousand objects listed in
//! pages, and a set of five thousand FeatureFlags by a streaming list and by LIST. A binary of its own, so that its load does not slow the other real-server tests.

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
    let mut values = widget_values(&group, &ns, "30s");
    // LISTs, not a streaming list, for the namespace: this is about pages.
    values["extraEnv"] = json!([{ "name": "CRD_BROKER_API_STREAMING_LISTS", "value": "off" }]);
    let broker = plane.deploy(&ns, values).await;
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

/// The resident memory of process `pid` now, in bytes.
fn rss_of(pid: u32) -> u64 {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

#[tokio::test]
async fn a_set_of_five_thousand_feature_flags_by_a_streaming_list_and_by_list() {
    use futures::StreamExt;
    let plane = control_plane();
    let crd: serde_json::Value = crd_broker::yaml::from_str(support::CRD).unwrap();
    plane.install_crds(&[crd]).await;
    let ns = plane.namespace("streaming").await;
    let resource = kube::core::ApiResource {
        group: "core.openfeature.dev".into(),
        version: "v1beta1".into(),
        api_version: GV.into(),
        kind: "FeatureFlag".into(),
        plural: "featureflags".into(),
    };
    let names: Vec<String> = (0..5000).map(|i| format!("flags-{i}")).collect();
    let created = tokio::time::Instant::now();
    futures::stream::iter(&names)
        .for_each_concurrent(16, |name| {
            let mut object = flag(name, "on");
            object["metadata"]["namespace"] = json!(ns);
            object["metadata"]["labels"] = json!({ "app": "load" });
            create(plane, &resource, &ns, object)
        })
        .await;
    eprintln!("5,000 FeatureFlags created in {:?}", created.elapsed());
    let apiserver: u32 = std::fs::read_to_string(plane.dir.join("kube-apiserver.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let target: crd_broker::selector::Target =
        format!("featureflags.core.openfeature.dev/{ns}?labelSelector=app%3Dload")
            .parse()
            .unwrap();
    let mut table = Vec::new();
    // Each way twice, taking turns, so that neither always follows the other.
    for (round, mode) in ["off", "auto", "off", "auto"].into_iter().enumerate() {
        let values = json!({
            "fullnameOverride": format!("{ns}-{round}"),
            "kinds": [{ "group": "core.openfeature.dev", "plural": "featureflags", "version": "" }],
            "watchNamespaces": [ns],
            "linger": "1s",
            "access": { "identity": "none" },
            "extraEnv": [{ "name": "CRD_BROKER_API_STREAMING_LISTS", "value": mode }],
        });
        let broker = plane.deploy(&ns, values).await;
        let mut client = connect(broker.grpc).await;
        // The API server's memory, every 10 ms, from before the request until the set is in.
        let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let baseline = rss_of(apiserver);
        let sampler = std::thread::spawn({
            let sampling = sampling.clone();
            move || {
                let mut peak = 0;
                while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                    peak = peak.max(rss_of(apiserver));
                    std::thread::sleep(Duration::from_millis(10));
                }
                peak
            }
        });
        let allocated = || async { get(&plane.metrics().await, "go_memstats_alloc_bytes_total") };
        let allocated_before = allocated().await;
        let asked = tokio::time::Instant::now();
        let request = crd_broker::cli::subscribe::request_for(std::slice::from_ref(&target));
        let mut s = client.subscribe(request).await.unwrap().into_inner();
        let mut members = 0;
        loop {
            let m = tokio::time::timeout(Duration::from_secs(60), s.message())
                .await
                .expect("the set arrives")
                .unwrap()
                .unwrap();
            match m.event() {
                crd_broker::pb::subscribe_response::Event::Snapshot => members += 1,
                crd_broker::pb::subscribe_response::Event::Synced => break,
                other => panic!("{other:?} before SYNCED"),
            }
        }
        let took = asked.elapsed();
        sampling.store(false, std::sync::atomic::Ordering::Relaxed);
        let peak = sampler.join().unwrap();
        // What the API server allocated meanwhile (its scrape's own share included, the same
        // each way).
        let spent = (allocated().await - allocated_before) / 1048576.0;
        assert_eq!(members, 5000);
        let ours = metrics(broker.admin).await;
        let lists = total(&ours, "crd_broker_api_requests_total", &[("verb", "list")]);
        match mode {
            // Ten pages of 500.
            "off" => assert!(lists >= 10.0, "{lists} LISTs"),
            // None at all: the members came on the watch.
            _ => assert_eq!(lists, 0.0, "LISTs with streaming lists on"),
        }
        let grew = peak.saturating_sub(baseline) as f64 / 1048576.0;
        eprintln!(
            "--api-streaming-lists {mode}: 5,000 members in {took:?}; the API server's memory \
             {:.0} MiB before, {:.0} MiB at most (+{grew:.1} MiB), {spent:.0} MiB allocated; \
             {lists} LISTs",
            baseline as f64 / 1048576.0,
            peak as f64 / 1048576.0,
        );
        table.push((mode, took, grew, spent));
        drop(s);
        drop(broker);
    }
    eprintln!("{table:?}");
}
