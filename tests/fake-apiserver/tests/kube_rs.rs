//! Fidelity against kube-rs 5: discovery, CRUD through `Api`, lists, `watcher` and
//! `watch_object` through every fault the fake can inject. Each test fails if the fake departs
//! from what kube-rs needs of the real server.

mod common;

use std::time::Duration;

use common::*;
use fake_apiserver::{Deny, Matcher, TokenUser};
use futures::StreamExt;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, VersionMatch,
};
use kube::core::GroupVersionKind;
use kube::runtime::watcher::{self, Event, watch_object, watcher};
use serde_json::json;
use tokio::sync::mpsc;

type Events = mpsc::UnboundedReceiver<Result<Event<DynamicObject>, watcher::Error>>;

/// Drives a watcher from a task (it only makes requests while polled) and hands its items over.
fn drive(
    api: Api<DynamicObject>,
    config: watcher::Config,
) -> (Events, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let mut stream = watcher(api, config).boxed();
        while let Some(item) = stream.next().await {
            if tx.send(item).is_err() {
                return;
            }
        }
    });
    (rx, task)
}

/// The next event that is not an error, within five seconds.
async fn next_event(rx: &mut Events) -> Event<DynamicObject> {
    loop {
        let item = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("an event within 5 s")
            .expect("the watcher runs");
        if let Ok(event) = item {
            return event;
        }
    }
}

/// The next item, error or not, within five seconds.
async fn next_item(rx: &mut Events) -> Result<Event<DynamicObject>, watcher::Error> {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("an item within 5 s")
        .expect("the watcher runs")
}

/// Events up to and including `InitDone`, as (type, name) pairs.
async fn until_init_done(rx: &mut Events) -> Vec<(String, String)> {
    let mut seen = Vec::new();
    loop {
        match next_event(rx).await {
            Event::Init => seen.push(("Init".to_string(), String::new())),
            Event::InitApply(o) => {
                seen.push(("InitApply".into(), o.metadata.name.unwrap_or_default()))
            }
            Event::InitDone => {
                seen.push(("InitDone".into(), String::new()));
                return seen;
            }
            other => panic!("unexpected before InitDone: {other:?}"),
        }
    }
}

fn variant(obj: &DynamicObject) -> String {
    obj.data["spec"]["flagSpec"]["flags"]["f"]["defaultVariant"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

#[tokio::test]
async fn discovery_serves_crds_installed_at_start_and_at_run_time() {
    let fake = start().await;
    let client = client(&fake);

    let info = client.apiserver_version().await.expect("/version");
    assert_eq!((info.major.as_str(), info.minor.as_str()), ("1", "32"));

    let gvk = GroupVersionKind::gvk("core.openfeature.dev", "v1beta1", "FeatureFlag");
    let (ar, caps) = kube::discovery::pinned_kind(&client, &gvk)
        .await
        .expect("pinned_kind");
    assert_eq!(ar.plural, "featureflags");
    assert_eq!(caps.scope, kube::discovery::Scope::Namespaced);
    assert!(caps.supports_operation("watch"));
    assert_eq!(caps.subresources.len(), 1, "the status subresource");

    // A CRD created through the API is served at once, in discovery and on its paths.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let widget = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": { "name": "widgets.example.com" },
        "spec": { "group": "example.com", "scope": "Namespaced",
            "names": { "plural": "widgets", "singular": "widget", "kind": "Widget" },
            "versions": [
                { "name": "v1", "served": true, "storage": true,
                  "schema": { "openAPIV3Schema": { "type": "object", "x-kubernetes-preserve-unknown-fields": true } } },
                { "name": "v1beta1", "served": true, "storage": false,
                  "schema": { "openAPIV3Schema": { "type": "object", "x-kubernetes-preserve-unknown-fields": true } } }
            ] }
    }))
    .expect("a CRD");
    let created = crds
        .create(&PostParams::default(), &widget)
        .await
        .expect("create CRD");
    let conditions = created
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default();
    assert!(
        conditions
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True")
    );

    let discovery = kube::Discovery::new(client.clone())
        .run()
        .await
        .expect("discovery runs");
    let (widgets, _) = discovery
        .resolve_gvk(&GroupVersionKind::gvk("example.com", "v1", "Widget"))
        .expect("Widget is discovered");
    assert_eq!(widgets.plural, "widgets");
    let group = discovery.get("example.com").expect("the group");
    assert_eq!(group.preferred_version_or_latest(), "v1");
    assert!(discovery.has_group("core.openfeature.dev"));

    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &widgets);
    let w = dynamic(
        json!({ "apiVersion": "example.com/v1", "kind": "Widget", "metadata": { "name": "w" }, "x": 1 }),
    );
    api.create(&PostParams::default(), &w)
        .await
        .expect("a Widget is servable at once");
    // The same object is served at the other version, with its apiVersion.
    let beta = kube::core::ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("example.com", "v1beta1", "Widget"),
        "widgets",
    );
    let old: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &beta);
    let got = old.get("w").await.expect("served at v1beta1");
    assert_eq!(
        got.types.expect("type meta").api_version,
        "example.com/v1beta1"
    );
}

#[tokio::test]
async fn crud_through_api_sets_server_fields_and_answers_real_errors() {
    let fake = start().await;
    let client = client(&fake);
    let api = featureflags(&client, "default");
    let pp = PostParams::default();

    let a = api
        .create(&pp, &dynamic(flag("default", "a", "on")))
        .await
        .expect("create");
    let meta = &a.metadata;
    assert!(
        meta.uid.as_deref().is_some_and(|u| u.len() == 36),
        "uid: {:?}",
        meta.uid
    );
    assert!(meta.creation_timestamp.is_some());
    assert_eq!(meta.generation, Some(1));
    let rv1: u64 = meta.resource_version.as_deref().unwrap().parse().unwrap();

    // AlreadyExists.
    let err = api
        .create(&pp, &dynamic(flag("default", "a", "on")))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 409 && s.reason == "AlreadyExists"),
        "{err:?}"
    );

    // Replace bumps generation and resourceVersion; a stale resourceVersion is a Conflict.
    let mut b = a.clone();
    b.data["spec"]["flagSpec"]["flags"]["f"]["defaultVariant"] = json!("off");
    let replaced = api.replace("a", &pp, &b).await.expect("replace");
    assert_eq!(replaced.metadata.generation, Some(2));
    let rv2: u64 = replaced
        .metadata
        .resource_version
        .as_deref()
        .unwrap()
        .parse()
        .unwrap();
    assert!(rv2 > rv1);
    assert_eq!(replaced.metadata.uid, a.metadata.uid);
    assert_eq!(
        replaced.metadata.creation_timestamp,
        a.metadata.creation_timestamp
    );
    let err = api.replace("a", &pp, &b).await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 409 && s.reason == "Conflict"),
        "{err:?}"
    );

    // A label-only merge patch changes the resourceVersion but not the generation.
    let patched = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { "team": "x" } } })),
        )
        .await
        .expect("merge patch");
    assert_eq!(patched.metadata.generation, Some(2));
    assert_eq!(patched.labels().get("team").map(String::as_str), Some("x"));

    // JSON patch.
    let ops: json_patch::Patch = serde_json::from_value(json!([
        { "op": "replace", "path": "/spec/flagSpec/flags/f/defaultVariant", "value": "on" }
    ]))
    .unwrap();
    let patched = api
        .patch("a", &PatchParams::default(), &Patch::Json::<()>(ops))
        .await
        .expect("json patch");
    assert_eq!(variant(&patched), "on");
    assert_eq!(patched.metadata.generation, Some(3));

    // Strict field validation: unknown fields are a 400 on create, a 422 on patch.
    let mut typo = flag("default", "typo", "on");
    typo["spec"]["tyop"] = json!(1);
    let path = format!("{NS_PATH}?fieldValidation=Strict");
    let r = raw(&fake, "POST", &path, Some(("application/json", typo))).await;
    assert_eq!(
        (r.status, r.json()["reason"].as_str()),
        (400, Some("BadRequest"))
    );
    let message = r.json()["message"].as_str().unwrap_or_default().to_string();
    assert!(
        message.ends_with("strict decoding error: unknown field \"spec.tyop\""),
        "{message}"
    );
    let r = raw(
        &fake,
        "PATCH",
        &format!("{NS_PATH}/a?fieldValidation=Strict"),
        Some((
            "application/merge-patch+json",
            json!({ "spec": { "tyop": 1 } }),
        )),
    )
    .await;
    assert_eq!(
        (r.status, r.json()["details"]["causes"][0]["field"].as_str()),
        (422, Some("patch"))
    );
    // Without it, unknown fields are pruned with a warning.
    let r = raw(
        &fake,
        "PATCH",
        &format!("{NS_PATH}/a"),
        Some((
            "application/merge-patch+json",
            json!({ "spec": { "tyop": 1 } }),
        )),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.headers["warning"],
        "299 - \"unknown field \\\"spec.tyop\\\"\""
    );
    assert!(r.json()["spec"].get("tyop").is_none());

    // A no-op patch writes nothing.
    let before = fake.current_rv();
    let same = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { "team": "x" } } })),
        )
        .await
        .expect("no-op patch");
    assert_eq!(fake.current_rv(), before);
    assert_eq!(
        same.metadata.resource_version,
        patched.metadata.resource_version
    );

    // Invalid: a schema violation, and a name that is not a DNS subdomain.
    let mut bad = flag("default", "bad", "on");
    bad["spec"]["flagSpec"]["flags"]["f"]["state"] = json!("MAYBE");
    let err = api.create(&pp, &dynamic(bad)).await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422 && s.reason == "Invalid" && s.message.contains("spec.flagSpec.flags[f].state")),
        "{err:?}"
    );
    let err = api
        .create(&pp, &dynamic(flag("default", "Bad_Name", "on")))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422 && s.message.contains("RFC 1123")),
        "{err:?}"
    );

    // NotFound for a missing object; the plain-text 404 for an unknown resource.
    let err = api.get("missing").await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 404 && s.reason == "NotFound" && s.message == "featureflags.core.openfeature.dev \"missing\" not found"),
        "{err:?}"
    );
    let nowhere = kube::core::ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("nope.example.com", "v1", "Nope"),
        "nopes",
    );
    let err = Api::<DynamicObject>::namespaced_with(client.clone(), "default", &nowhere)
        .get("x")
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 404),
        "{err:?}"
    );
    let raw404 = raw(
        &fake,
        "GET",
        "/apis/nope.example.com/v1/namespaces/default/nopes",
        None,
    )
    .await;
    assert_eq!(
        (raw404.status, raw404.body.as_str()),
        (404, "404 page not found\n")
    );
    assert_eq!(raw404.headers["content-type"], "text/plain; charset=utf-8");

    // Forbidden.
    fake.deny(Deny {
        verb: Some("get".into()),
        resource: Some("featureflags".into()),
        name: Some("a".into()),
        ..Deny::default()
    });
    let err = api.get("a").await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 403 && s.reason == "Forbidden" && s.message.contains("cannot get resource \"featureflags\" in API group \"core.openfeature.dev\" in the namespace \"default\"")),
        "{err:?}"
    );
    fake.clear_faults();

    // Delete returns the object; then it is gone.
    api.delete("a", &DeleteParams::default())
        .await
        .expect("delete");
    assert!(matches!(api.get("a").await, Err(kube::Error::Api(s)) if s.code == 404));
}

#[tokio::test]
async fn lists_page_and_honour_resource_version_semantics_and_selectors() {
    let fake = start().await;
    let client = client(&fake);
    let api = featureflags(&client, "default");
    let pp = PostParams::default();
    for i in 0..5 {
        let mut f = flag("default", &format!("f{i}"), "on");
        f["metadata"]["labels"] = json!({ "tier": if i % 2 == 0 { "even" } else { "odd" } });
        api.create(&pp, &dynamic(f)).await.unwrap();
    }
    let rv_after_five = fake.current_rv();
    let err = api
        .create(&pp, &dynamic(flag("other", "elsewhere", "on")))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 400),
        "{err:?}"
    );
    let other = featureflags(&client, "other");
    let err = other
        .create(&pp, &dynamic(flag("other", "elsewhere", "on")))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 404 && s.message == "namespaces \"other\" not found"),
        "{err:?}"
    );
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let ns = serde_json::from_value(
        json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": "other" } }),
    )
    .unwrap();
    let ns = namespaces
        .create(&pp, &ns)
        .await
        .expect("create a namespace");
    assert_eq!(ns.status.and_then(|s| s.phase).as_deref(), Some("Active"));
    other
        .create(&pp, &dynamic(flag("other", "elsewhere", "on")))
        .await
        .unwrap();

    // Paging: 2 + 2 + 1, one snapshot resourceVersion, continue tokens, remaining counts.
    let page1 = api.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(page1.items.len(), 2);
    assert_eq!(page1.metadata.remaining_item_count, Some(3));
    let token = page1.metadata.continue_.clone().expect("a continue token");
    api.delete("f4", &DeleteParams::default()).await.unwrap();
    let page2 = api
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap();
    let page3 = api
        .list(
            &ListParams::default()
                .limit(2)
                .continue_token(page2.metadata.continue_.as_deref().unwrap()),
        )
        .await
        .unwrap();
    let names: Vec<String> = [&page1, &page2, &page3]
        .iter()
        .flat_map(|p| p.items.iter().map(|o| o.metadata.name.clone().unwrap()))
        .collect();
    assert_eq!(
        names,
        ["f0", "f1", "f2", "f3", "f4"],
        "the continued list reads the first page's snapshot"
    );
    assert!(
        page3
            .metadata
            .continue_
            .as_deref()
            .is_none_or(str::is_empty)
    );
    assert_eq!(
        page2.metadata.resource_version,
        page1.metadata.resource_version
    );

    // Exact at an older resourceVersion sees f4 again; NotOlderThan sees now.
    let exact = api
        .list(
            &ListParams::default()
                .at(&rv_after_five.to_string())
                .matching(VersionMatch::Exact),
        )
        .await
        .unwrap();
    assert_eq!(exact.items.len(), 5);
    let recent = api
        .list(
            &ListParams::default()
                .at(&rv_after_five.to_string())
                .matching(VersionMatch::NotOlderThan),
        )
        .await
        .unwrap();
    assert_eq!(recent.items.len(), 4);

    // Below the history floor: 410 Expired; a continue token from before compaction too.
    fake.compact();
    let err = api
        .list(
            &ListParams::default()
                .at(&rv_after_five.to_string())
                .matching(VersionMatch::Exact),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 410 && s.reason == "Expired"),
        "{err:?}"
    );
    let err = api
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 410),
        "{err:?}"
    );

    // Invalid list options.
    let bad = raw(
        &fake,
        "GET",
        &format!("{NS_PATH}?resourceVersionMatch=Exact"),
        None,
    )
    .await;
    assert_eq!(bad.status, 422);
    assert!(
        bad.json()["message"]
            .as_str()
            .unwrap()
            .contains("resourceVersionMatch is forbidden unless resourceVersion is provided")
    );

    // Selectors: fields, label equality and sets, across namespaces.
    let by_name = api
        .list(&ListParams::default().fields("metadata.name=f1"))
        .await
        .unwrap();
    assert_eq!(by_name.items.len(), 1);
    let odd = api
        .list(&ListParams::default().labels("tier=odd"))
        .await
        .unwrap();
    assert_eq!(odd.items.len(), 2);
    let set = api
        .list(&ListParams::default().labels("tier in (even),tier notin (odd)"))
        .await
        .unwrap();
    assert_eq!(set.items.len(), 2);
    let all: Api<DynamicObject> = Api::all_with(client.clone(), &featureflag_resource());
    let everywhere = all
        .list(&ListParams::default().fields("metadata.namespace!=default"))
        .await
        .unwrap();
    assert_eq!(everywhere.items.len(), 1);
    let err = api
        .list(&ListParams::default().fields("spec.x=1"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 400 && s.message.contains("field label not supported")),
        "{err:?}"
    );
}

#[tokio::test]
async fn watch_object_reports_absent_then_present_then_deleted() {
    let fake = start().await;
    let client = client(&fake);
    watch_object_sees_a_life(&fake, &client).await;
}

/// kube-rs's own stack (HTTP/1.1) over TLS, trusting the CA and sending the token of the
/// kubeconfig the fake writes.
#[tokio::test]
async fn watch_object_over_tls_with_the_kubeconfig_the_fake_writes() {
    let fake = start_tls(true).await;
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&fake.kubeconfig()).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    watch_object_sees_a_life(&fake, &client).await;
    let requests = fake.requests();
    assert!(requests.iter().all(|r| r.version == "HTTP/1.1"));
}

async fn watch_object_sees_a_life(fake: &fake_apiserver::FakeApiServer, client: &kube::Client) {
    let api = featureflags(client, "default");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let watched = api.clone();
    let task = tokio::spawn(async move {
        let mut s = watch_object(watched, "late").boxed();
        while let Some(item) = s.next().await {
            if tx.send(item).is_err() {
                return;
            }
        }
    });
    let mut next = async || {
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
    };
    assert!(next().await.is_none(), "absent at first");
    api.create(
        &PostParams::default(),
        &dynamic(flag("default", "late", "on")),
    )
    .await
    .unwrap();
    assert_eq!(next().await.map(|o| variant(&o)), Some("on".to_string()));
    api.patch(
        "late",
        &PatchParams::default(),
        &Patch::Merge(
            json!({ "spec": { "flagSpec": { "flags": { "f": { "defaultVariant": "off" } } } } }),
        ),
    )
    .await
    .unwrap();
    assert_eq!(next().await.map(|o| variant(&o)), Some("off".to_string()));
    api.delete("late", &DeleteParams::default()).await.unwrap();
    assert!(next().await.is_none(), "deleted");
    // One list and one watch, with the field selector on the name, as the notes describe.
    let list = fake
        .requests()
        .into_iter()
        .find(|r| r.verb == "list")
        .unwrap();
    assert_eq!(list.query, "&fieldSelector=metadata.name%3Dlate&limit=500");
    assert_eq!(fake.open_watches_on(NS_PATH, Some("metadata.name=late")), 1);
    task.abort();
    assert!(
        fake.wait_for(Duration::from_secs(2), |f| f.open_watches() == 0)
            .await,
        "teardown is visible server-side"
    );
}

#[tokio::test]
async fn label_selector_transitions_give_added_and_deleted() {
    let fake = start().await;
    let client = client(&fake);
    let api = featureflags(&client, "default");
    let (mut rx, _task) = drive(api.clone(), watcher::Config::default().labels("stage=live"));
    assert_eq!(
        until_init_done(&mut rx).await,
        [
            ("Init".into(), String::new()),
            ("InitDone".into(), String::new())
        ]
    );
    api.create(&PostParams::default(), &dynamic(flag("default", "t", "on")))
        .await
        .unwrap();
    let label = |v: &str| Patch::Merge(json!({ "metadata": { "labels": { "stage": v } } }));
    api.patch("t", &PatchParams::default(), &label("live"))
        .await
        .unwrap();
    assert!(
        matches!(next_event(&mut rx).await, Event::Apply(o) if o.metadata.name.as_deref() == Some("t")),
        "entering: ADDED"
    );
    api.patch("t", &PatchParams::default(), &label("draft"))
        .await
        .unwrap();
    match next_event(&mut rx).await {
        Event::Delete(o) => {
            assert_eq!(
                o.labels().get("stage").map(String::as_str),
                Some("live"),
                "DELETED carries the previous state"
            );
            assert_eq!(
                o.metadata.resource_version.as_deref(),
                Some(fake.current_rv().to_string().as_str())
            );
        }
        other => panic!("leaving: expected Delete, got {other:?}"),
    }
}

#[tokio::test]
async fn aborted_watch_resumes_from_last_resource_version_without_gaps() {
    let fake = start().await;
    let client = client(&fake);
    let api = featureflags(&client, "default");
    api.create(&PostParams::default(), &dynamic(flag("default", "n", "v0")))
        .await
        .unwrap();
    let (mut rx, _task) = drive(
        api.clone(),
        watcher::Config::default().fields("metadata.name=n"),
    );
    until_init_done(&mut rx).await;
    let mut seen = Vec::new();
    for i in 1..=30 {
        let p = Patch::Merge(
            json!({ "spec": { "flagSpec": { "flags": { "f": { "defaultVariant": format!("v{i}") } } } } }),
        );
        api.patch("n", &PatchParams::default(), &p).await.unwrap();
        if i % 10 == 0 {
            fake.abort_watches();
        }
    }
    while seen.last().map(String::as_str) != Some("v30") {
        match next_event(&mut rx).await {
            Event::Apply(o) => seen.push(variant(&o)),
            other => panic!("expected Apply, got {other:?}"),
        }
    }
    let want: Vec<String> = (1..=30).map(|i| format!("v{i}")).collect();
    assert_eq!(seen, want, "every change once, in order");
    let lists = fake.requests().iter().filter(|r| r.verb == "list").count();
    assert_eq!(lists, 1, "an abort resumes the watch, it does not relist");
    let resumed: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| r.verb == "watch")
        .collect();
    assert!(resumed.len() >= 2, "the watch was reopened after the abort");
    assert!(resumed.iter().all(|r| r.param("resourceVersion").is_some()));
}

#[tokio::test]
async fn expired_history_gives_error_event_and_kube_relists() {
    let fake = start().await;
    let client = client(&fake);
    let api = featureflags(&client, "default");
    api.create(&PostParams::default(), &dynamic(flag("default", "x", "on")))
        .await
        .unwrap();
    let (mut rx, _task) = drive(
        api.clone(),
        watcher::Config::default()
            .fields("metadata.name=x")
            .disable_bookmarks(),
    );
    until_init_done(&mut rx).await;
    // Other objects move the history on; the quiet watch's resourceVersion falls below the floor.
    api.create(&PostParams::default(), &dynamic(flag("default", "y", "on")))
        .await
        .unwrap();
    fake.compact();
    fake.close_watches();
    match next_item(&mut rx).await {
        Err(watcher::Error::WatchError(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
            assert!(
                status.message.starts_with("too old resource version"),
                "{}",
                status.message
            );
        }
        other => panic!("expected the 410 ERROR event, got {other:?}"),
    }
    let relisted = until_init_done(&mut rx).await;
    assert_eq!(relisted[1], ("InitApply".to_string(), "x".to_string()));
    assert_eq!(
        fake.request_count("list", NS_PATH),
        2,
        "one list, one relist"
    );

    // Wire shape: HTTP 200, then one ERROR line carrying the Status, then the end.
    let stale = format!("{NS_PATH}?watch=true&resourceVersion=101");
    let mut lines = Lines::open(&fake, &stale).await;
    assert_eq!(lines.status, 200);
    let line = lines.next().await.expect("one line");
    assert_eq!(line["type"], "ERROR");
    assert_eq!(line["object"]["kind"], "Status");
    assert_eq!(line["object"]["code"], 410);
    assert_eq!(lines.next().await.unwrap_err(), End::Clean);
}

#[tokio::test]
async fn bookmarks_keep_a_quiet_watch_fresh_through_compaction() {
    let fake = start_with_bookmarks(Duration::from_millis(100)).await;
    let client = client(&fake);
    let api = featureflags(&client, "default");
    api.create(
        &PostParams::default(),
        &dynamic(flag("default", "quiet", "on")),
    )
    .await
    .unwrap();
    let (mut rx, _task) = drive(
        api.clone(),
        watcher::Config::default().fields("metadata.name=quiet"),
    );
    until_init_done(&mut rx).await;
    api.create(
        &PostParams::default(),
        &dynamic(flag("default", "busy", "on")),
    )
    .await
    .unwrap();
    // Wait for a bookmark carrying the newest resourceVersion, then compact and reconnect.
    tokio::time::sleep(Duration::from_millis(400)).await;
    fake.compact();
    fake.close_watches();
    assert!(
        fake.wait_for(Duration::from_secs(3), |f| f
            .request_count("watch", NS_PATH)
            >= 2)
            .await
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        rx.try_recv().is_err(),
        "no error and no relist: the bookmark kept the watch fresh"
    );
    assert_eq!(fake.request_count("list", NS_PATH), 1);

    // Bookmark wire shape: apiVersion and kind present, the current resourceVersion.
    let mut lines = Lines::open(
        &fake,
        &format!(
            "{NS_PATH}?watch=true&allowWatchBookmarks=true&resourceVersion={}",
            fake.current_rv()
        ),
    )
    .await;
    let bookmark = lines
        .next_within(Duration::from_secs(2))
        .await
        .expect("a bookmark")
        .unwrap();
    assert_eq!(bookmark["type"], "BOOKMARK");
    assert_eq!(bookmark["object"]["apiVersion"], GV);
    assert_eq!(bookmark["object"]["kind"], "FeatureFlag");
    assert_eq!(
        bookmark["object"]["metadata"]["resourceVersion"],
        fake.current_rv().to_string()
    );
}

#[tokio::test]
async fn streaming_list_ends_initial_events_with_the_annotated_bookmark() {
    let fake = start().await;
    let client = client(&fake);
    let api = featureflags(&client, "default");
    api.create(
        &PostParams::default(),
        &dynamic(flag("default", "s1", "on")),
    )
    .await
    .unwrap();
    api.create(
        &PostParams::default(),
        &dynamic(flag("default", "s2", "on")),
    )
    .await
    .unwrap();
    let (mut rx, task) = drive(api.clone(), watcher::Config::default().streaming_lists());
    let init = until_init_done(&mut rx).await;
    assert_eq!(init.iter().filter(|(t, _)| t == "InitApply").count(), 2);
    let first = fake
        .requests()
        .into_iter()
        .find(|r| r.verb == "watch")
        .unwrap();
    assert_eq!(first.param("sendInitialEvents"), Some("true"));
    assert_eq!(first.param("resourceVersionMatch"), Some("NotOlderThan"));
    assert_eq!(
        fake.request_count("list", NS_PATH),
        0,
        "no list in streaming mode"
    );
    api.create(
        &PostParams::default(),
        &dynamic(flag("default", "s3", "on")),
    )
    .await
    .unwrap();
    assert!(
        matches!(next_event(&mut rx).await, Event::Apply(o) if o.metadata.name.as_deref() == Some("s3"))
    );
    task.abort();

    // Without the WatchList feature the server answers 422, and kube (which has no fallback)
    // reports a start failure.
    fake.set_watch_list_enabled(false);
    let (mut rx, _task) = drive(api.clone(), watcher::Config::default().streaming_lists());
    loop {
        match next_item(&mut rx).await {
            Err(watcher::Error::WatchStartFailed(kube::Error::Api(s))) => {
                assert_eq!(s.code, 422);
                break;
            }
            Ok(Event::Init) => continue,
            other => panic!("expected a 422 start failure, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn timeout_seconds_ends_the_watch_cleanly_and_kube_rewatches() {
    let fake = start().await;
    let client = client(&fake);
    let api = featureflags(&client, "default");
    let mut lines = Lines::open(&fake, &format!("{NS_PATH}?watch=true&timeoutSeconds=1")).await;
    let started = tokio::time::Instant::now();
    assert_eq!(lines.next().await.unwrap_err(), End::Clean);
    assert!(started.elapsed() >= Duration::from_millis(900));

    // With bookmarks allowed, one comes two seconds before the deadline, then the end.
    let mut lines = Lines::open(
        &fake,
        &format!("{NS_PATH}?watch=true&timeoutSeconds=3&allowWatchBookmarks=true"),
    )
    .await;
    let started = tokio::time::Instant::now();
    assert_eq!(lines.next().await.expect("a bookmark")["type"], "BOOKMARK");
    // The periodic interval is a minute, so this one is the pre-deadline bookmark.
    assert!(started.elapsed() >= Duration::from_millis(800));
    assert_eq!(lines.next().await.unwrap_err(), End::Clean);
    assert!(started.elapsed() >= Duration::from_millis(2900));

    let (mut rx, _task) = drive(api.clone(), watcher::Config::default().timeout(1));
    until_init_done(&mut rx).await;
    assert!(
        fake.wait_for(Duration::from_secs(4), |f| f
            .request_count("watch", NS_PATH)
            >= 3)
            .await
    );
    assert_eq!(fake.request_count("list", NS_PATH), 1);
    let w = fake
        .requests()
        .into_iter()
        .find(|r| r.verb == "watch" && r.param("timeoutSeconds") == Some("1"));
    assert!(w.is_some());
}

#[tokio::test]
async fn stalled_stream_trips_the_client_idle_timeout() {
    let fake = start().await;
    let client = client(&fake);
    let api = featureflags(&client, "default");
    let (mut rx, _task) = drive(
        api.clone(),
        watcher::Config::default().timeout(1).disable_bookmarks(),
    );
    until_init_done(&mut rx).await;
    assert!(
        fake.wait_for(Duration::from_secs(2), |f| f.open_watches() == 1)
            .await
    );
    // Without bookmarks a quiet watch gets no bytes; stalled, the server does not even end it at
    // its timeoutSeconds. The client gives up after timeout + 5 s of silence and re-watches.
    fake.stall_watches(true);
    let watches_before = fake.request_count("watch", NS_PATH);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        fake.request_count("watch", NS_PATH),
        watches_before,
        "silent while stalled"
    );
    assert!(
        fake.wait_for(Duration::from_secs(6), |f| f
            .request_count("watch", NS_PATH)
            > watches_before)
            .await,
        "the client's idle timeout made it re-watch"
    );
    fake.stall_watches(false);
    api.create(
        &PostParams::default(),
        &dynamic(flag("default", "after", "on")),
    )
    .await
    .unwrap();
    assert!(
        matches!(next_event(&mut rx).await, Event::Apply(o) if o.metadata.name.as_deref() == Some("after"))
    );
}

#[tokio::test]
async fn injected_statuses_hangs_and_retry_after_reach_kube_as_the_real_ones_do() {
    let fake = start().await;
    let client = client(&fake);
    let api = featureflags(&client, "default");

    // 429 with Retry-After: 0 is absorbed by kube's retry layer; 500 surfaces.
    fake.fail_next(Matcher::verb("list"), 2, 429, Some(0));
    api.list(&ListParams::default())
        .await
        .expect("retries absorb 429");
    assert_eq!(fake.request_count("list", NS_PATH), 3);
    fake.fail_next(Matcher::verb("list").on(NS_PATH), 1, 500, None);
    let err = api.list(&ListParams::default()).await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 500 && s.reason == "InternalError"),
        "{err:?}"
    );

    // 503 carries Retry-After on the wire.
    fake.fail_next(Matcher::verb("get"), 1, 503, Some(7));
    let r = raw(&fake, "GET", &format!("{NS_PATH}/x"), None).await;
    assert_eq!(
        (r.status, r.headers["retry-after"].to_str().unwrap()),
        (503, "7")
    );
    assert_eq!(r.json()["details"]["retryAfterSeconds"], 7);

    // A hung request never answers; the next one does.
    fake.hang_next(Matcher::verb("get"), 1);
    assert!(
        tokio::time::timeout(Duration::from_millis(500), api.get_opt("x"))
            .await
            .is_err(),
        "hangs"
    );
    assert!(api.get_opt("x").await.expect("answers").is_none());

    // A watcher keeps going through list failures.
    fake.fail_next(Matcher::verb("list"), 1, 500, None);
    let (mut rx, _task) = drive(api.clone(), watcher::Config::default());
    loop {
        match next_item(&mut rx).await {
            Err(watcher::Error::InitialListFailed(kube::Error::Api(s))) => {
                assert_eq!(s.code, 500);
                break;
            }
            Ok(Event::Init) => continue,
            other => panic!("expected InitialListFailed, got {other:?}"),
        }
    }
    assert!(
        until_init_done(&mut rx).await.len() >= 2,
        "relisted after the failure"
    );
}

#[tokio::test]
async fn forbidden_list_and_watch_follow_rbac_resource_names() {
    let fake = start().await;
    let client = client(&fake);
    let api = featureflags(&client, "default");
    // Deny watching the object "secret": per-object list and watch carry its name.
    fake.deny(Deny {
        verb: Some("list".into()),
        name: Some("secret".into()),
        ..Deny::default()
    });
    let err = api
        .list(&ListParams::default().fields("metadata.name=secret"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 403 && s.message.starts_with("featureflags.core.openfeature.dev \"secret\" is forbidden")),
        "{err:?}"
    );
    api.list(&ListParams::default().fields("metadata.name=open"))
        .await
        .expect("others are allowed");
    api.list(&ListParams::default())
        .await
        .expect("a namespace-wide list names no object");
}

#[tokio::test]
async fn restart_on_the_same_port_keeps_data_and_watchers_recover() {
    let fake = start().await;
    let client = client(&fake);
    let api = featureflags(&client, "default");
    api.create(
        &PostParams::default(),
        &dynamic(flag("default", "r", "before")),
    )
    .await
    .unwrap();
    let (mut rx, _task) = drive(
        api.clone(),
        watcher::Config::default().fields("metadata.name=r"),
    );
    until_init_done(&mut rx).await;
    let port = fake.addr().port();
    fake.stop_listening();
    assert!(
        fake.wait_for(Duration::from_secs(2), |f| f.open_watches() == 0)
            .await
    );
    assert!(
        tokio::net::TcpStream::connect(fake.addr()).await.is_err(),
        "down means refused"
    );
    fake.merge_patch(
        GV,
        "featureflags",
        "default",
        "r",
        json!({ "spec": { "flagSpec": { "flags": { "f": { "defaultVariant": "during" } } } } }),
    )
    .unwrap();
    fake.start_listening().await.unwrap();
    assert_eq!(fake.addr().port(), port);
    // The watcher reconnects (after its backoff, if it saw errors) and gets what changed.
    loop {
        match tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap()
            .unwrap()
        {
            Ok(Event::Apply(o)) | Ok(Event::InitApply(o)) if variant(&o) == "during" => break,
            _ => continue,
        }
    }
}

#[tokio::test]
async fn deleting_a_crd_deletes_its_objects_and_ends_their_watches() {
    let fake = start().await;
    let client = client(&fake);
    let api = featureflags(&client, "default");
    api.create(&PostParams::default(), &dynamic(flag("default", "d", "on")))
        .await
        .unwrap();
    let mut lines = Lines::open(
        &fake,
        &format!("{NS_PATH}?watch=true&resourceVersion={}", fake.current_rv()),
    )
    .await;
    assert!(
        fake.wait_for(Duration::from_secs(2), |f| f.open_watches() == 1)
            .await
    );
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.delete(
        "featureflags.core.openfeature.dev",
        &DeleteParams::default(),
    )
    .await
    .expect("delete the CRD");
    let deleted = lines.next().await.expect("a DELETED event first");
    assert_eq!(
        (
            deleted["type"].as_str(),
            deleted["object"]["metadata"]["name"].as_str()
        ),
        (Some("DELETED"), Some("d"))
    );
    assert_eq!(
        lines.next().await.unwrap_err(),
        End::Clean,
        "then the watch ends"
    );
    assert_eq!(fake.open_watches(), 0);
    let gone = raw(&fake, "GET", NS_PATH, None).await;
    assert_eq!(
        (gone.status, gone.body.as_str()),
        (404, "404 page not found\n")
    );
    let discovery = kube::Discovery::new(client.clone()).run().await.unwrap();
    assert!(!discovery.has_group("core.openfeature.dev"));
}

#[tokio::test]
async fn access_and_token_reviews_have_the_real_shapes() {
    let fake = start().await;
    let client = client(&fake);
    let reviews: Api<SelfSubjectAccessReview> = Api::all(client.clone());
    let ask = |verb: &str| SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                group: Some("core.openfeature.dev".into()),
                resource: Some("featureflags".into()),
                verb: Some(verb.into()),
                namespace: Some("default".into()),
                ..ResourceAttributes::default()
            }),
            ..SelfSubjectAccessReviewSpec::default()
        },
        ..SelfSubjectAccessReview::default()
    };
    let allowed = reviews
        .create(&PostParams::default(), &ask("watch"))
        .await
        .unwrap();
    assert!(allowed.status.expect("status").allowed);
    fake.deny(Deny {
        verb: Some("watch".into()),
        resource: Some("featureflags".into()),
        ..Deny::default()
    });
    let denied = reviews
        .create(&PostParams::default(), &ask("watch"))
        .await
        .unwrap();
    assert!(!denied.status.expect("status").allowed);
    assert!(
        reviews
            .create(&PostParams::default(), &ask("list"))
            .await
            .unwrap()
            .status
            .unwrap()
            .allowed
    );

    fake.register_token(
        TokenUser::service_account("good-token", "apps", "flagd").with_audiences(&["crd-broker"]),
    );
    let tokens: Api<TokenReview> = Api::all(client.clone());
    let review = |token: &str, audiences: &[&str]| TokenReview {
        spec: TokenReviewSpec {
            token: token.into(),
            audiences: Some(audiences.iter().map(|a| a.to_string()).collect()),
        },
        ..TokenReview::default()
    };
    let good = tokens
        .create(
            &PostParams::default(),
            &review("good-token", &["crd-broker"]),
        )
        .await
        .unwrap()
        .status
        .unwrap();
    assert_eq!(good.authenticated, Some(true));
    let user = good.user.unwrap();
    assert_eq!(
        user.username.as_deref(),
        Some("system:serviceaccount:apps:flagd")
    );
    assert!(
        user.groups
            .unwrap()
            .contains(&"system:serviceaccounts:apps".to_string())
    );
    assert_eq!(good.audiences, Some(vec!["crd-broker".to_string()]));
    let wrong_audience = tokens
        .create(&PostParams::default(), &review("good-token", &["other"]))
        .await
        .unwrap()
        .status
        .unwrap();
    assert_ne!(wrong_audience.authenticated, Some(true));
    let unknown = tokens
        .create(&PostParams::default(), &review("nope", &[]))
        .await
        .unwrap()
        .status
        .unwrap();
    assert_ne!(unknown.authenticated, Some(true));
    assert!(unknown.error.is_some());
}

#[tokio::test]
async fn introspection_counts_watches_per_path_and_selector() {
    let fake = start().await;
    let client = client(&fake);
    let api = featureflags(&client, "default");
    let mut tasks = Vec::new();
    for name in ["a", "a", "b"] {
        let (mut rx, task) = drive(
            api.clone(),
            watcher::Config::default().fields(&format!("metadata.name={name}")),
        );
        until_init_done(&mut rx).await;
        tasks.push((rx, task));
    }
    assert!(
        fake.wait_for(Duration::from_secs(2), |f| f.open_watches() == 3)
            .await
    );
    assert_eq!(fake.open_watches_on(NS_PATH, Some("metadata.name=a")), 2);
    assert_eq!(fake.open_watches_on(NS_PATH, Some("metadata.name=b")), 1);
    assert_eq!(fake.open_watches_on(NS_PATH, None), 3);
    assert_eq!(fake.request_count("list", NS_PATH), 3);
    assert_eq!(fake.request_count("watch", NS_PATH), 3);
    let (_, task) = tasks.remove(0);
    task.abort();
    assert!(
        fake.wait_for(Duration::from_secs(2), |f| f
            .open_watches_on(NS_PATH, Some("metadata.name=a"))
            == 1)
            .await
    );
    fake.clear_requests();
    assert_eq!(fake.request_count("list", NS_PATH), 0);
}

#[tokio::test]
async fn status_subresource_and_finalizers_behave_as_on_a_real_server() {
    let fake = start().await;
    fake.install_crd(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": { "name": "gadgets.example.com" },
        "spec": { "group": "example.com", "scope": "Namespaced",
            "names": { "plural": "gadgets", "kind": "Gadget" },
            "versions": [{ "name": "v1", "served": true, "storage": true, "subresources": { "status": {} },
                "schema": { "openAPIV3Schema": { "type": "object", "properties": {
                    "spec": { "type": "object", "x-kubernetes-preserve-unknown-fields": true },
                    "status": { "type": "object", "properties": { "phase": { "type": "string" } } } } } } }] }
    }))
    .expect("install");
    let client = client(&fake);
    let gadgets = kube::core::ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("example.com", "v1", "Gadget"),
        "gadgets",
    );
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &gadgets);
    let g = json!({
        "apiVersion": "example.com/v1", "kind": "Gadget",
        "metadata": { "name": "s", "finalizers": ["example.com/hold"] },
        "spec": { "size": 1 }, "status": { "phase": "ignored" },
    });
    let created = api
        .create(&PostParams::default(), &dynamic(g))
        .await
        .unwrap();
    assert!(
        created.data.get("status").is_none(),
        "status is dropped on create"
    );
    let with_status = api
        .patch_status(
            "s",
            &PatchParams::default(),
            &Patch::Merge(
                json!({ "status": { "phase": "ok", "undeclared": 1 }, "spec": { "size": 9 } }),
            ),
        )
        .await
        .unwrap();
    assert_eq!(
        with_status.data["status"],
        json!({ "phase": "ok" }),
        "status written, undeclared fields pruned"
    );
    assert_eq!(
        with_status.data["spec"]["size"], 1,
        "a status write leaves the spec"
    );
    assert_eq!(
        with_status.metadata.generation,
        Some(1),
        "and the generation"
    );
    let spec_write = api
        .patch(
            "s",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "size": 2 }, "status": { "phase": "lost" } })),
        )
        .await
        .unwrap();
    assert_eq!(
        spec_write.data["status"]["phase"], "ok",
        "a main-resource write leaves the status"
    );
    assert_eq!(spec_write.metadata.generation, Some(2));

    // Delete with a finalizer marks; removing the finalizer completes it.
    let marked = api
        .delete("s", &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .expect("the object");
    assert!(marked.metadata.deletion_timestamp.is_some());
    assert!(api.get("s").await.is_ok());
    api.patch(
        "s",
        &PatchParams::default(),
        &Patch::Merge(json!({ "metadata": { "finalizers": null } })),
    )
    .await
    .unwrap();
    assert!(matches!(api.get("s").await, Err(kube::Error::Api(s)) if s.code == 404));
}

#[tokio::test]
async fn pods_are_found_by_ip_listed_across_namespaces_and_watched() {
    use k8s_openapi::api::core::v1::Pod;
    let fake = start().await;
    let client = client(&fake);
    for (ns, name, ip, phase) in [
        ("team-a", "web-1", "10.0.0.5", "Running"),
        ("team-b", "job-1", "10.0.0.5", "Succeeded"),
        ("team-b", "api-1", "10.0.0.6", "Running"),
    ] {
        fake.apply(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": name, "namespace": ns },
            "spec": { "serviceAccountName": "web", "containers": [{ "name": "c", "image": "x" }] },
            "status": { "phase": "Pending" },
        }))
        .unwrap();
        let pod = fake.get("v1", "pods", ns, name).unwrap();
        assert!(
            pod["status"].is_null(),
            "create drops the status, as for pods"
        );
        fake.merge_patch_status(
            "v1",
            "pods",
            ns,
            name,
            json!({ "status": { "phase": phase, "podIP": ip } }),
        )
        .unwrap();
    }
    let pods: Api<Pod> = Api::all(client.clone());
    let by_ip = |ip: &str| ListParams::default().fields(&format!("status.podIP={ip}"));
    let found = pods.list(&by_ip("10.0.0.5")).await.unwrap();
    let mut names: Vec<String> = found.items.iter().map(|p| p.name_any()).collect();
    names.sort();
    assert_eq!(names, ["job-1", "web-1"]);
    let running = pods
        .list(&ListParams::default().fields("status.podIP=10.0.0.5,status.phase=Running"))
        .await
        .unwrap();
    assert_eq!(running.items.len(), 1);
    assert_eq!(
        running.items[0]
            .spec
            .as_ref()
            .unwrap()
            .service_account_name
            .as_deref(),
        Some("web")
    );
    assert_eq!(
        pods.list(&ListParams::default().fields("spec.hostNetwork=false"))
            .await
            .unwrap()
            .items
            .len(),
        3,
        "an unset hostNetwork selects as false"
    );
    let bad = pods
        .list(&ListParams::default().fields("status.hostIP=1"))
        .await
        .unwrap_err();
    assert!(matches!(bad, kube::Error::Api(s) if s.code == 400));
    let in_ns: Api<Pod> = Api::namespaced(client.clone(), "team-b");
    assert_eq!(
        in_ns
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        2
    );

    // A watch by IP sees a pod take the IP and another give it up.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let stream = watcher(
        pods.clone(),
        watcher::Config::default().fields("status.podIP=10.0.0.7"),
    );
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(e) = stream.next().await {
            if tx.send(e).is_err() {
                return;
            }
        }
    });
    loop {
        if let Ok(Event::InitDone) = rx.recv().await.unwrap() {
            break;
        }
    }
    fake.merge_patch_status(
        "v1",
        "pods",
        "team-b",
        "api-1",
        json!({ "status": { "podIP": "10.0.0.7" } }),
    )
    .unwrap();
    let added = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(matches!(added, Event::Apply(p) if p.name_any() == "api-1"));
    fake.delete("v1", "pods", "team-b", "api-1").unwrap();
    let deleted = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(matches!(deleted, Event::Delete(p) if p.name_any() == "api-1"));
}

#[tokio::test]
async fn pod_bound_tokens_carry_the_pod_in_the_review() {
    let fake = start().await;
    fake.register_token(
        TokenUser::service_account("bound", "team-a", "web")
            .with_audiences(&["crd-broker"])
            .bound_to_pod("web-1", "uid-1"),
    );
    let tokens: Api<TokenReview> = Api::all(client(&fake));
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: "bound".into(),
            audiences: Some(vec!["crd-broker".into()]),
        },
        ..TokenReview::default()
    };
    let status = tokens
        .create(&PostParams::default(), &review)
        .await
        .unwrap()
        .status
        .unwrap();
    let extra = status.user.unwrap().extra.unwrap();
    assert_eq!(extra["authentication.kubernetes.io/pod-name"], ["web-1"]);
    assert_eq!(extra["authentication.kubernetes.io/pod-uid"], ["uid-1"]);
}
