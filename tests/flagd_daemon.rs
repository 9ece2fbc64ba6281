//! The real flagd daemon (built from its module by `scripts/peers`) as the OpenFeature Operator
//! runs it in flagd-proxy mode — `flagd start --sources '[{"uri":…,"provider":"grpc",
//! "selector":"core.openfeature.dev/NS/NAME"}]'` — syncing from the broker on the real control
//! plane, its flags evaluated through flagd's own OFREP API: the CR's values, an edit within
//! 2 s, TLS, the set selector, a broker restart, a replica lost, a deleted CR; and the selector
//! forms of newer releases asked of flagd's own sync server and of the broker side by side.

mod support;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use crd_broker::pb::flagd::flag_sync_service_client::FlagSyncServiceClient;
use crd_broker::pb::flagd::{FetchAllFlagsRequest, SyncFlagsRequest};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};
use support::control_plane::*;
use support::flagd::Flagd;
use support::*;
use tokio::time::Instant;

/// How long flagd may take to evaluate an edit of the CR.
const EDIT: Duration = Duration::from_secs(2);

/// A namespace with the FeatureFlag CRD installed and the FeatureFlag `demo` whose flag `f`
/// is `variant`.
async fn flag_world(plane: &ControlPlane, test: &str, variant: &str) -> String {
    let ns = plane.namespace(test).await;
    plane
        .install_crds(&[crd_broker::yaml::from_str(support::CRD).unwrap()])
        .await;
    plane.apply(&[flag_in(&ns, "demo", variant)]).await;
    ns
}

/// The chart's values for a broker serving FeatureFlags of `namespace`, on `port` if given.
fn values(namespace: &str, extra: Value) -> Value {
    let mut values = json!({
        "watchNamespaces": [namespace],
        "linger": "30s",
        "access": { "identity": "none" },
    });
    support::chart::merge(&mut values, &extra);
    values
}

async fn set_variant(plane: &ControlPlane, ns: &str, name: &str, variant: &str) {
    let api: Api<DynamicObject> = Api::namespaced_with(plane.admin().await, ns, &feature_flags());
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(variant_patch(variant)),
    )
    .await
    .unwrap();
}

/// The flagd source the Operator writes for a FeatureFlagSource with `provider: flagd-proxy`.
fn source(uri: &str, ns: &str, name: &str) -> Value {
    json!({
        "uri": uri,
        "provider": "grpc",
        "selector": format!("core.openfeature.dev/{ns}/{name}"),
    })
}

#[tokio::test]
async fn flagd_evaluates_the_crs_flags_and_an_edit_within_two_seconds_then_after_a_broker_restart()
{
    let plane = control_plane();
    let ns = flag_world(plane, "flagd-daemon", "on").await;
    let mut broker = plane.deploy(&ns, values(&ns, json!({}))).await;
    let mut flagd = Flagd::start(json!([source(&broker.grpc.to_string(), &ns, "demo")])).await;

    let first = flagd.until("f", json!(true), Duration::from_secs(30)).await;
    println!("flagd evaluated the CR's flag {first:?} after it started");
    let (_, body) = flagd.evaluate("f").await.unwrap();
    assert_eq!(body["variant"], "on", "{body}");
    assert_eq!(flagd.evaluate("nope").await.unwrap().0, 404);

    for (variant, value) in [("off", false), ("on", true), ("off", false)] {
        set_variant(plane, &ns, "demo", variant).await;
        let took = flagd.until("f", json!(value), EDIT).await;
        println!("an edit to {variant} evaluated by flagd after {took:?}");
    }

    // The broker restarts on the same port (an edit lands while it is down): flagd's gRPC
    // source reconnects with its back-off and evaluates the CR's state again.
    let port = broker.grpc.port();
    broker.child.kill().await.unwrap();
    set_variant(plane, &ns, "demo", "on").await;
    let restarted = Instant::now();
    let _broker = plane
        .deploy(&ns, values(&ns, json!({ "grpc": { "port": port } })))
        .await;
    let took = flagd.until("f", json!(true), Duration::from_secs(30)).await;
    println!(
        "after a broker restart, flagd evaluated the edit made while it was down {:?} after it \
         was back",
        restarted.elapsed().max(took)
    );
    set_variant(plane, &ns, "demo", "off").await;
    flagd.until("f", json!(false), EDIT).await;
}

#[tokio::test]
async fn flagd_syncs_over_tls_with_its_cert_path() {
    let plane = control_plane();
    let ns = flag_world(plane, "flagd-tls", "on").await;
    let pki = pki("localhost");
    let dir = tempfile::tempdir().unwrap();
    write_tls_files(dir.path(), &pki);
    let path = |f: &str| dir.path().join(f).to_string_lossy().into_owned();
    let tls = json!({ "extraArgs": ["--tls-cert", path("tls.crt"), "--tls-key", path("tls.key")] });
    let broker = plane.deploy(&ns, values(&ns, tls)).await;
    let mut source = source(&broker.grpc.to_string(), &ns, "demo");
    source["tls"] = json!(true);
    source["certPath"] = json!(path("ca.crt"));
    let mut flagd = Flagd::start(json!([source])).await;
    flagd.until("f", json!(true), Duration::from_secs(30)).await;
    set_variant(plane, &ns, "demo", "off").await;
    let took = flagd.until("f", json!(false), EDIT).await;
    println!("over TLS, an edit evaluated by flagd after {took:?}");

    // Without the CA flagd does not trust the broker: its first sync fails on the certificate,
    // and flagd exits (as it does whenever its first sync fails; in a pod it is restarted).
    let mut untrusted = source.clone();
    untrusted.as_object_mut().unwrap().remove("certPath");
    let mut stranger = Flagd::start(json!([untrusted])).await;
    let exit = tokio::time::timeout(Duration::from_secs(30), stranger.child.wait())
        .await
        .expect("flagd gives up")
        .unwrap();
    assert!(!exit.success(), "{exit}");
    assert!(
        stranger.log_text().contains("certificate"),
        "{}",
        stranger.log_text()
    );
}

/// The FeatureFlag `name` of `ns`, labelled `app=checkout`, whose one flag is `key`.
fn labelled(ns: &str, name: &str, key: &str, variant: &str) -> Value {
    let mut f = flag_in(ns, name, variant);
    f["metadata"]["labels"] = json!({ "app": "checkout" });
    let flags = f["spec"]["flagSpec"]["flags"]["f"].take();
    f["spec"]["flagSpec"]["flags"] = json!({ key: flags });
    f
}

#[tokio::test]
async fn flagd_takes_the_merged_flags_of_a_set_selector() {
    let plane = control_plane();
    let ns = flag_world(plane, "flagd-set", "on").await;
    let labelled = |name: &str, key: &str, variant: &str| labelled(&ns, name, key, variant);
    plane
        .apply(&[labelled("a", "x", "on"), labelled("b", "y", "off")])
        .await;
    let broker = plane.deploy(&ns, values(&ns, json!({}))).await;
    let mut set = source(&broker.grpc.to_string(), &ns, "demo");
    set["selector"] = json!(format!(
        "core.openfeature.dev/{ns}?labelSelector=app%3Dcheckout"
    ));
    let mut flagd = Flagd::start(json!([set])).await;
    flagd.until("x", json!(true), Duration::from_secs(30)).await;
    flagd.until("y", json!(false), EDIT).await;
    assert_eq!(
        flagd.evaluate("f").await.unwrap().0,
        404,
        "demo is not in the set"
    );
    // A FeatureFlag joins the set: its flags are evaluated.
    plane.apply(&[labelled("c", "z", "on")]).await;
    let took = flagd.until("z", json!(true), EDIT).await;
    println!("a FeatureFlag joining the set evaluated by flagd after {took:?}");
}

/// Waits (2 s at most) until flagd answers 404 for `key`; how long it took.
async fn gone(flagd: &Flagd, key: &str) -> Duration {
    let at = Instant::now();
    loop {
        let (status, body) = flagd.evaluate(key).await.unwrap();
        if status == 404 {
            return at.elapsed();
        }
        assert!(at.elapsed() < EDIT, "{key} still evaluates: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// flagd with `incrementalUpdates` (flagd#1922) and the broker's header takes a set one
/// FeatureFlag at a time: an edit, a FeatureFlag leaving the set, one joining, one deleted.
#[tokio::test]
async fn flagd_with_incremental_updates_keeps_each_feature_flag_of_a_set_as_its_own_flag_set() {
    let plane = control_plane();
    let ns = flag_world(plane, "flagd-incremental", "on").await;
    let mut b = labelled(&ns, "b", "y", "off");
    b["spec"]["flagSpec"]["metadata"] = json!({ "flagSetId": "team-b" });
    plane
        .apply(&[labelled(&ns, "a", "x", "on"), b.clone()])
        .await;
    let broker = plane.deploy(&ns, values(&ns, json!({}))).await;
    let mut set = source(&broker.grpc.to_string(), &ns, "demo");
    set["selector"] = json!(format!(
        "core.openfeature.dev/{ns}?labelSelector=app%3Dcheckout"
    ));
    set["incrementalUpdates"] = json!(true);
    set["headers"] = json!({ crd_broker::grpc::flagd::INCREMENTAL_HEADER: "true" });
    let mut flagd = Flagd::start(json!([set])).await;
    flagd.until("x", json!(true), Duration::from_secs(30)).await;
    flagd.until("y", json!(false), EDIT).await;
    let flag_set = |body: Value| body["metadata"]["flagSetId"].clone();
    assert_eq!(
        flag_set(flagd.evaluate("x").await.unwrap().1),
        json!(format!("{ns}/a"))
    );
    assert_eq!(
        flag_set(flagd.evaluate("y").await.unwrap().1),
        json!("team-b")
    );

    // a's edit, sent alone, leaves b's flag as it was.
    plane.apply(&[labelled(&ns, "a", "x", "off")]).await;
    flagd.until("x", json!(false), EDIT).await;
    assert_eq!(flagd.evaluate("y").await.unwrap().1["value"], false);

    // b leaves the set: its flag set is emptied, a's stays.
    b["metadata"]["labels"] = json!({ "app": "cart" });
    plane.apply(&[b]).await;
    gone(&flagd, "y").await;
    assert_eq!(flagd.evaluate("x").await.unwrap().1["value"], false);

    // c joins; a is deleted: c's flag evaluates, a's is gone.
    plane.apply(&[labelled(&ns, "c", "z", "on")]).await;
    flagd.until("z", json!(true), EDIT).await;
    let api: Api<DynamicObject> = Api::namespaced_with(plane.admin().await, &ns, &feature_flags());
    api.delete("a", &DeleteParams::default()).await.unwrap();
    let took = gone(&flagd, "x").await;
    assert_eq!(flagd.evaluate("z").await.unwrap().1["value"], true);
    println!("incremental: a deleted FeatureFlag's flag gone from flagd after {took:?}");
}

#[tokio::test]
async fn flagd_follows_the_other_replica_when_the_one_it_uses_is_lost() {
    let plane = control_plane();
    let ns = flag_world(plane, "flagd-replicas", "on").await;
    let port = free_port();
    let mut replicas = Vec::new();
    for last in [2, 3] {
        let at = json!({ "listenAddress": format!("127.0.0.{last}"), "grpc": { "port": port } });
        replicas.push(Some(plane.deploy(&ns, values(&ns, at)).await));
    }
    let ips = [Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3)];
    let dns = dns::Dns::start("broker.test", &ips).await;
    let uri = format!("dns://{}/broker.test:{port}", dns.addr);
    let mut flagd = Flagd::start(json!([source(&uri, &ns, "demo")])).await;
    flagd.until("f", json!(true), Duration::from_secs(30)).await;

    // The replica flagd streams from is lost (and leaves DNS, as a pod leaves its Service).
    let pid = flagd.child.id().unwrap();
    let used = replicas
        .iter()
        .position(|r| {
            let r = r.as_ref().unwrap();
            connections_between(pid, r.grpc) > 0
        })
        .expect("flagd is connected to one replica");
    let mut lost = replicas[used].take().unwrap();
    lost.child.kill().await.unwrap();
    dns.set(&[ips[1 - used]]);
    let at = Instant::now();
    set_variant(plane, &ns, "demo", "off").await;
    let took = flagd
        .until("f", json!(false), Duration::from_secs(30))
        .await;
    println!(
        "replica {} lost: flagd evaluated an edit through the other {took:?} later",
        ips[used]
    );
    assert!(at.elapsed() >= took);
    let other = replicas[1 - used].as_ref().unwrap();
    assert!(
        connections_between(pid, other.grpc) > 0,
        "flagd now uses the other replica"
    );
}

/// Established TCP connections from process `pid` to `to`.
fn connections_between(pid: u32, to: SocketAddr) -> usize {
    let out = std::process::Command::new("ss")
        .args(["-Htnp", "state", "established", "dst", &to.to_string()])
        .output()
        .expect("ss runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&format!("pid={pid},")))
        .count()
}

/// What flagd does when its FeatureFlag is deleted (and created again), as documented in
/// `docs/migrating-from-flagd-proxy.md`.
#[tokio::test]
async fn a_deleted_feature_flag_leaves_flagd_with_no_flags_until_it_is_created_again() {
    let plane = control_plane();
    let ns = flag_world(plane, "flagd-deleted", "on").await;
    let broker = plane.deploy(&ns, values(&ns, json!({}))).await;
    let mut flagd = Flagd::start(json!([source(&broker.grpc.to_string(), &ns, "demo")])).await;
    flagd.until("f", json!(true), Duration::from_secs(30)).await;

    let api: Api<DynamicObject> = Api::namespaced_with(plane.admin().await, &ns, &feature_flags());
    api.delete("demo", &DeleteParams::default()).await.unwrap();
    let deleted = Instant::now();
    let (status, body) = loop {
        let (status, body) = flagd.evaluate("f").await.unwrap();
        if status != 200 || deleted.elapsed() > EDIT {
            break (status, body);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status, 404, "the flag is gone with its CR: {body}");
    assert_eq!(body["errorCode"], "FLAG_NOT_FOUND", "{body}");
    println!(
        "deleted: flagd answers {status} {} after {:?}",
        body["errorCode"],
        deleted.elapsed()
    );

    plane.apply(&[flag_in(&ns, "demo", "off")]).await;
    let took = flagd.until("f", json!(false), EDIT).await;
    println!("created again: evaluated after {took:?}");
}

/// What a provider may ask: the selector in the `Flagd-Selector` header or in the body, a
/// `flagSetId=` selector. flagd's own sync server (serving a file of flags) and the broker are
/// asked the same; where the broker differs it refuses with INVALID_ARGUMENT and a message
/// naming the form it takes.
#[tokio::test]
async fn selector_forms_of_newer_providers_asked_of_flagd_and_of_the_broker() {
    let plane = control_plane();
    let ns = flag_world(plane, "flagd-selectors", "on").await;
    plane.apply(&[flag_in(&ns, "other", "off")]).await;
    let broker = plane.deploy(&ns, values(&ns, json!({}))).await;

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("flags.json");
    let flags = json!({
        "metadata": { "flagSetId": "web" },
        "flags": { "f": { "state": "ENABLED", "variants": { "on": true, "off": false },
                          "defaultVariant": "on" } },
    });
    std::fs::write(&file, flags.to_string()).unwrap();
    let file_uri = file.to_string_lossy().into_owned();
    let mut flagd = Flagd::start(json!([{ "uri": file_uri, "provider": "file" }])).await;
    flagd.until("f", json!(true), Duration::from_secs(30)).await;

    let demo = format!("core.openfeature.dev/{ns}/demo");
    let other = format!("core.openfeature.dev/{ns}/other");
    // Each server is asked with the header alone, the body alone, and both (the header
    // naming what has other flags, or none): both take the header first, as flagd#1814 says.
    let ask = |at, header: Option<&str>, body: &str| {
        let (header, body) = (header.map(str::to_string), body.to_string());
        async move { fetch(at, header.as_deref(), &body).await }
    };
    for (server, at, here, elsewhere) in [
        ("flagd", flagd.sync, file_uri.as_str(), "nowhere"),
        ("the broker", broker.grpc, demo.as_str(), other.as_str()),
    ] {
        let header = ask(at, Some(here), "").await.expect("the header alone");
        let body = ask(at, None, here).await.expect("the body alone");
        let both = ask(at, Some(elsewhere), here).await.expect("both");
        println!("{server}: header {header}\n  body {body}\n  both {both}");
        assert_eq!(
            header["flags"]["f"]["defaultVariant"], "on",
            "{server}: {header}"
        );
        assert_eq!(
            body["flags"]["f"]["defaultVariant"], "on",
            "{server}: {body}"
        );
        assert_ne!(
            both["flags"]["f"]["defaultVariant"], "on",
            "{server}: the header wins: {both}"
        );
    }

    // flagSetId=: flagd filters its flags by set; the broker has no flag sets across CRs and
    // says which selectors it takes.
    let theirs = fetch(flagd.sync, None, "flagSetId=web")
        .await
        .expect("flagd answers");
    assert!(
        theirs["flags"]["f"].is_object(),
        "flagd serves its set web: {theirs}"
    );
    for (header, body) in [(None, "flagSetId=web"), (Some("flagSetId=web"), "")] {
        let ours = fetch(broker.grpc, header, body).await.unwrap_err();
        assert_eq!(ours.code(), tonic::Code::InvalidArgument, "{ours:?}");
        assert!(
            ours.message()
                .contains("core.openfeature.dev/<namespace>/<name>"),
            "{}",
            ours.message()
        );
        // The stream form answers the same.
        let mut client = FlagSyncServiceClient::connect(format!("http://{}", broker.grpc))
            .await
            .unwrap();
        let mut request = tonic::Request::new(SyncFlagsRequest {
            provider_id: String::new(),
            selector: body.into(),
        });
        if let Some(h) = header {
            request
                .metadata_mut()
                .insert("flagd-selector", h.parse().unwrap());
        }
        let status = client.sync_flags(request).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
    }
}

/// FetchAllFlags with the selector in the `Flagd-Selector` header and/or the body: the
/// configuration, or the status.
async fn fetch(at: SocketAddr, header: Option<&str>, body: &str) -> Result<Value, tonic::Status> {
    let mut client = FlagSyncServiceClient::connect(format!("http://{at}"))
        .await
        .unwrap();
    let mut request = tonic::Request::new(FetchAllFlagsRequest {
        provider_id: String::new(),
        selector: body.into(),
    });
    if let Some(h) = header {
        request
            .metadata_mut()
            .insert("flagd-selector", h.parse().unwrap());
    }
    let config = client.fetch_all_flags(request).await?.into_inner();
    Ok(serde_json::from_str(&config.flag_configuration).unwrap())
}
