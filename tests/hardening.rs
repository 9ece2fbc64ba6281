//! The broker tried as an attacker and a careless user would: every RPC × malformed, oversized,
//! unauthenticated, forbidden and over-limit input, each with its specific status while the
//! broker keeps serving everyone else; floods of watches, discovery and metric series from one
//! client; huge names; and what the API server's refusals reveal.

mod support;

use std::time::Duration;

use crd_broker::access::{IdentityList, Settings, limits};
use crd_broker::pb::subscribe_response::Event;
use prost::Message;
use support::*;
use tonic::Code;

const SUBSCRIBE: &str = "/crdbroker.v1.Broker/Subscribe";
const SYNC: &str = "/flagd.sync.v1.FlagSyncService/SyncFlags";
const FETCH: &str = "/flagd.sync.v1.FlagSyncService/FetchAllFlags";
const METADATA: &str = "/flagd.sync.v1.FlagSyncService/GetMetadata";
const LEGACY_SYNC: &str = "/sync.v1.FlagSyncService/SyncFlags";
const LEGACY_FETCH: &str = "/sync.v1.FlagSyncService/FetchAllFlags";

/// The request message of `method` naming `namespace/name`.
fn body(method: &str, namespace: &str, name: &str) -> Vec<u8> {
    let flagd = format!("core.openfeature.dev/{namespace}/{name}");
    match method {
        SUBSCRIBE => {
            let mut r = request(&[&ff(namespace, "x")]);
            r.resources[0].name = name.to_string();
            r.encode_to_vec()
        }
        SYNC => crd_broker::pb::flagd::SyncFlagsRequest {
            selector: flagd,
            ..Default::default()
        }
        .encode_to_vec(),
        FETCH => crd_broker::pb::flagd::FetchAllFlagsRequest {
            selector: flagd,
            ..Default::default()
        }
        .encode_to_vec(),
        LEGACY_SYNC => crd_broker::pb::legacy::SyncFlagsRequest {
            selector: flagd,
            ..Default::default()
        }
        .encode_to_vec(),
        LEGACY_FETCH => crd_broker::pb::legacy::FetchAllFlagsRequest {
            selector: flagd,
            ..Default::default()
        }
        .encode_to_vec(),
        _ => Vec::new(),
    }
}

/// The status of a call (OK when it answered a message).
async fn status_of(
    channel: &tonic::transport::Channel,
    method: &str,
    body: Vec<u8>,
) -> tonic::Status {
    match raw_call(channel.clone(), method, body, &[]).await {
        Ok(_) => tonic::Status::ok(""),
        Err(status) => status,
    }
}

#[tokio::test]
async fn every_rpc_answers_bad_input_with_its_own_status_and_the_broker_serves_on() {
    let fake = fake().await;
    run_pod(&fake, "team-a", "web-1", "web", "127.0.0.2");
    run_pod(&fake, "team-a", "web-2", "web", "127.0.0.4");
    run_pod(&fake, "team-b", "api-1", "api", "127.0.0.3");
    for ns in ["team-a", "team-b"] {
        fake.apply(flag_in(ns, "f", "on")).unwrap();
    }
    let broker = broker_with_access(
        &fake,
        Settings {
            identity: "peer-pod".parse::<IdentityList>().unwrap(),
            limits: limits::Config {
                max_streams_per_caller: 1,
                ..limits::Config::default()
            },
            ..Settings::default()
        },
    )
    .await;
    let mut healthy_client = connect_from(broker.addr, "127.0.0.3").await;
    let mut healthy = subscribe(&mut healthy_client, &[&ff("team-b", "f")]).await;
    next(&mut healthy).await;

    let pod = channel_from(broker.addr, "127.0.0.2").await;
    let stranger = channel_from(broker.addr, "127.0.0.9").await;
    let busy = channel_from(broker.addr, "127.0.0.4").await;
    // web-2 holds its one stream.
    let mut held = crd_broker::pb::broker_client::BrokerClient::new(busy.clone());
    let mut held = subscribe(&mut held, &[&ff("team-a", "f")]).await;
    next(&mut held).await;

    let garbage = vec![0xff; 64];
    let oversized = vec![b'x'; 300 * 1024];
    let methods = [SUBSCRIBE, SYNC, FETCH, METADATA, LEGACY_SYNC, LEGACY_FETCH];
    let mut rows = Vec::new();
    for method in methods {
        let resource_rpc = method != METADATA;
        let mut cases: Vec<(&str, &tonic::transport::Channel, Vec<u8>, Code)> = vec![
            ("garbage", &pod, garbage.clone(), Code::Internal),
            (
                "oversized",
                &pod,
                oversized.clone(),
                Code::ResourceExhausted,
            ),
            (
                "unauthenticated",
                &stranger,
                body(method, "team-a", "f"),
                Code::Unauthenticated,
            ),
        ];
        if resource_rpc {
            cases.push((
                "malformed",
                &pod,
                body(method, "team-a", "Not_A_Name"),
                Code::InvalidArgument,
            ));
            cases.push((
                "forbidden",
                &pod,
                body(method, "team-b", "f"),
                Code::PermissionDenied,
            ));
            cases.push((
                "forbidden, absent",
                &pod,
                body(method, "team-b", "nope"),
                Code::PermissionDenied,
            ));
            cases.push((
                "over the limit",
                &busy,
                body(method, "team-a", "f"),
                Code::ResourceExhausted,
            ));
        }
        for (case, channel, request, want) in cases {
            let status = status_of(channel, method, request).await;
            assert_eq!(
                status.code(),
                want,
                "{method} {case}: {:?} {}",
                status.code(),
                status.message()
            );
            assert!(
                status.message().len() < 1024,
                "{method} {case}: a {}-byte message",
                status.message().len()
            );
            rows.push(format!("{method:<45} {case:<18} {:?}", status.code()));
        }
    }
    println!("{}", rows.join("\n"));
    // Everyone else was served throughout.
    fake.merge_patch(GV, "featureflags", "team-b", "f", variant_patch("off"))
        .unwrap();
    assert!(is(&next(&mut healthy).await, Event::Updated, "off"));
    let mut fresh = connect_from(broker.addr, "127.0.0.2").await;
    let mut s = subscribe(&mut fresh, &[&ff("team-a", "f")]).await;
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    let m = metrics(broker.admin_addr.unwrap()).await;
    assert!(get(&m, r#"crd_broker_limit_hits_total{limit="request_size"}"#) >= 6.0);
    assert!(
        get(
            &m,
            r#"crd_broker_limit_hits_total{limit="streams_per_caller"}"#
        ) >= 5.0
    );
}

#[tokio::test]
async fn one_connection_cannot_open_thousands_of_watches() {
    let h = start(Duration::ZERO).await;
    // 20 streams × 100 names that do not exist, as the attack that once opened 2,000 watches.
    let mut attacker = connect_from(h.broker.addr, "127.0.0.7").await;
    let mut admitted = Vec::new();
    let mut refused = Vec::new();
    for stream in 0..20 {
        let names: Vec<String> = (0..100)
            .map(|i| demo(&format!("ghost-{stream}-{i}")))
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        match attacker.subscribe(request(&names)).await {
            Ok(s) => admitted.push(s.into_inner()),
            Err(status) => refused.push(status),
        }
    }
    assert_eq!(
        admitted.len(),
        2,
        "the burst of {} new watches",
        limits::DEFAULT_NEW_WATCH_BURST
    );
    assert_eq!(refused.len(), 18);
    assert!(
        refused.iter().all(
            |s| s.code() == Code::ResourceExhausted && s.message().contains("--new-watch-rate")
        )
    );
    let opened = h.broker.registry.len();
    assert_eq!(opened, 200);
    // Another caller is not held back by the first one's bucket.
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut other = connect_from(h.broker.addr, "127.0.0.8").await;
    let mut s = subscribe(&mut other, &[&demo("demo")]).await;
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    drop(admitted);
    drop(attacker);
    let registry = h.broker.registry.clone();
    let closed = tokio::time::timeout(WAIT, async {
        while registry.len() > 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(closed.is_ok(), "{} watches left", registry.len());
}

#[tokio::test]
async fn max_watches_refuses_new_watches_and_serves_the_watched() {
    let fake = fake().await;
    for name in ["a", "b", "c", "d"] {
        fake.apply(flag(name, "on")).unwrap();
    }
    let config = crd_broker::broker::Config {
        max_watches: 3,
        ..Default::default()
    };
    let listeners = crd_broker::broker::Listeners::tcp(
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    );
    let broker = broker_with(&fake, listeners, config, vec![]);
    let mut c = connect(broker.addr).await;
    let mut held = Vec::new();
    for name in ["a", "b", "c"] {
        let mut s = subscribe(&mut c, &[&demo(name)]).await;
        next(&mut s).await;
        held.push(s);
    }
    let full = c.subscribe(request(&[&demo("d")])).await.unwrap_err();
    assert_status(&full, Code::ResourceExhausted, "--max-watches");
    let mut warm = subscribe(&mut c, &[&demo("a")]).await;
    assert_eq!(
        next(&mut warm).await.event(),
        Event::Snapshot,
        "a watched resource is served"
    );
    assert_eq!(fake.open_watches(), 3);
}

/// A broker on `fake` with `limits`, on a port of its own.
async fn limited(
    fake: &fake_apiserver::FakeApiServer,
    limits: limits::Config,
) -> crd_broker::broker::Running<crd_broker::source::kubernetes::Kubernetes> {
    let config = crd_broker::broker::Config {
        access: Settings {
            limits,
            ..Settings::default()
        },
        ..Default::default()
    };
    let listeners = crd_broker::broker::Listeners::tcp(
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    );
    broker_with(fake, listeners, config, vec![])
}

#[tokio::test]
async fn streams_per_caller_are_limited_per_caller() {
    let fake = fake().await;
    fake.apply(flag("demo", "on")).unwrap();
    let broker = limited(
        &fake,
        limits::Config {
            max_streams_per_caller: 2,
            ..limits::Config::default()
        },
    )
    .await;
    let mut a = connect_from(broker.addr, "127.0.0.2").await;
    let mut first = subscribe(&mut a, &[&demo("demo")]).await;
    next(&mut first).await;
    let mut second = subscribe(&mut a, &[&demo("demo")]).await;
    next(&mut second).await;
    let third = a.subscribe(request(&[&demo("demo")])).await.unwrap_err();
    assert_status(&third, Code::ResourceExhausted, "--max-streams-per-caller");
    // Another address is another caller.
    let mut b = connect_from(broker.addr, "127.0.0.3").await;
    assert!(b.subscribe(request(&[&demo("demo")])).await.is_ok());
    // The local proxy's address (127.0.0.1) stands for many callers: each connection from it is
    // one, under the limit like any other.
    let mut proxy = connect(broker.addr).await;
    let mut streams = Vec::new();
    for _ in 0..2 {
        streams.push(proxy.subscribe(request(&[&demo("demo")])).await.unwrap());
    }
    let over = proxy
        .subscribe(request(&[&demo("demo")]))
        .await
        .unwrap_err();
    assert_status(&over, Code::ResourceExhausted, "--max-streams-per-caller");
    let mut another = connect(broker.addr).await;
    let s = another.subscribe(request(&[&demo("demo")])).await;
    streams.push(s.expect("another connection from the proxy is another caller"));
    drop(first);
    let again = tokio::time::timeout(WAIT, async {
        loop {
            if a.subscribe(request(&[&demo("demo")])).await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(again.is_ok(), "a slot comes free when a stream ends");
}

#[tokio::test]
async fn new_streams_over_the_brokers_pace_are_refused_with_a_time_to_try_again() {
    let fake = fake().await;
    fake.apply(flag("demo", "on")).unwrap();
    // One new stream every two seconds for the whole broker.
    let broker = limited(
        &fake,
        limits::Config {
            max_new_streams_per_second: 0.5,
            ..limits::Config::default()
        },
    )
    .await;
    let mut a = connect_from(broker.addr, "127.0.0.2").await;
    let mut held = subscribe(&mut a, &[&demo("demo")]).await;
    assert_eq!(next(&mut held).await.event(), Event::Snapshot);
    let channel = channel_from(broker.addr, "127.0.0.3").await;
    let mut b = crd_broker::pb::broker_client::BrokerClient::new(channel.clone());
    let refused = b.subscribe(request(&[&demo("demo")])).await.unwrap_err();
    assert_status(
        &refused,
        Code::ResourceExhausted,
        "--max-new-streams-per-second",
    );
    let hint = |status: &tonic::Status| -> Duration {
        let millis = status
            .metadata()
            .get(crd_broker::access::RETRY_PUSHBACK)
            .expect("a time to try again")
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        Duration::from_millis(millis)
    };
    let wait = hint(&refused);
    assert!(wait <= Duration::from_secs(30), "{wait:?}");
    // Every protocol's new stream counts: flagd's too.
    let flagd = raw_call(
        channel,
        "/flagd.sync.v1.FlagSyncService/SyncFlags",
        Vec::new(),
        &[("flagd-selector", "core.openfeature.dev/default/demo")],
    )
    .await
    .unwrap_err();
    assert_status(
        &flagd,
        Code::ResourceExhausted,
        "--max-new-streams-per-second",
    );
    // The stream already open is served meanwhile.
    fake.merge_patch(GV, "featureflags", "default", "demo", variant_patch("off"))
        .unwrap();
    assert!(is(&next(&mut held).await, Event::Updated, "off"));
    // Told when, it gets in then (or is told again, later).
    let admitted = tokio::time::timeout(Duration::from_secs(10), async {
        let mut wait = wait;
        loop {
            tokio::time::sleep(wait).await;
            match b.subscribe(request(&[&demo("demo")])).await {
                Ok(stream) => return stream.into_inner(),
                Err(again) => wait = hint(&again),
            }
        }
    })
    .await;
    let mut admitted = admitted.expect("admitted within 10 s, following the hints");
    assert_eq!(next(&mut admitted).await.event(), Event::Snapshot);
    let m = broker.registry.metrics().encode();
    let hits = m
        .lines()
        .find_map(|l| l.strip_prefix(r#"crd_broker_limit_hits_total{limit="new_streams"} "#))
        .and_then(|v| v.parse::<f64>().ok());
    assert!(hits >= Some(2.0), "{hits:?}");
}

#[tokio::test]
async fn one_caller_keeps_at_most_its_share_of_watches_lingering_ones_too() {
    let fake = fake().await;
    for name in ["a", "b", "c"] {
        fake.apply(flag(name, "on")).unwrap();
    }
    let config = crd_broker::broker::Config {
        linger: Duration::from_secs(30),
        access: Settings {
            limits: limits::Config {
                max_watches_per_caller: 2,
                ..limits::Config::default()
            },
            ..Settings::default()
        },
        ..Default::default()
    };
    let listeners = with_admin().await;
    let broker = broker_with(&fake, listeners, config, vec![]);
    let mut greedy = connect_from(broker.addr, "127.0.0.2").await;
    let mut s = subscribe(&mut greedy, &[&demo("a"), &demo("b")]).await;
    next(&mut s).await;
    next(&mut s).await;
    drop(s);
    // Its streams gone, the watches it started linger: they still count as its own.
    let over = greedy.subscribe(request(&[&demo("c")])).await.unwrap_err();
    assert_status(
        &over,
        Code::ResourceExhausted,
        "this caller's requests keep 2 open (lingering ones too) of at most 2 (--max-watches-per-caller)",
    );
    // What is watched costs no share; another caller has its own.
    let mut warm = subscribe(&mut greedy, &[&demo("a")]).await;
    assert_eq!(next(&mut warm).await.event(), Event::Snapshot);
    let mut other = connect_from(broker.addr, "127.0.0.3").await;
    let mut s = subscribe(&mut other, &[&demo("c")]).await;
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    let m = metrics(broker.admin_addr.unwrap()).await;
    assert_eq!(
        get(
            &m,
            r#"crd_broker_limit_hits_total{limit="watches_per_caller"}"#
        ),
        1.0
    );
}

/// Discovery requests the fake saw.
fn discovery_requests(fake: &fake_apiserver::FakeApiServer) -> Vec<String> {
    fake.requests()
        .into_iter()
        .filter(|r| r.verb == "discovery" && r.path.starts_with("/apis"))
        .map(|r| r.path)
        .collect()
}

#[tokio::test]
async fn concurrent_cold_subscribes_share_one_discovery() {
    let h = start(Duration::ZERO).await;
    h.fake.clear_requests();
    let addr = h.broker.addr;
    let subscribes: Vec<_> = (0..200)
        .map(|i| {
            tokio::spawn(async move {
                let mut c = connect_from(addr, &format!("127.0.1.{}", i % 250 + 1)).await;
                let mut s = subscribe(&mut c, &[&demo(&format!("n{i}"))]).await;
                assert_eq!(next(&mut s).await.event(), Event::Absent);
            })
        })
        .collect();
    for s in subscribes {
        s.await.unwrap();
    }
    let asked = discovery_requests(&h.fake);
    assert!(
        asked.len() <= 2,
        "200 cold subscribes made {} discovery requests: {asked:?}",
        asked.len()
    );
}

#[tokio::test]
async fn invented_groups_and_spellings_cost_bounded_discovery() {
    let h = start(Duration::ZERO).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    let mut c = connect(h.broker.addr).await;
    h.fake.clear_requests();
    for round in 0..10 {
        let names: Vec<String> = (0..100)
            .map(|g| format!("things.g{round}-{g}.example/default/x"))
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let status = c.subscribe(request(&names)).await.unwrap_err();
        assert_eq!(status.code(), Code::NotFound);
    }
    // With a version as well: the group list answers for them too.
    for round in 0..10 {
        let names: Vec<String> = (0..100)
            .map(|g| format!("things.v1.g{round}-{g}.example/default/x"))
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let status = c.subscribe(request(&names)).await.unwrap_err();
        assert_eq!(status.code(), Code::NotFound);
    }
    let status = c
        .subscribe(request(&[
            "featureflags.v7.core.openfeature.dev/default/demo",
        ]))
        .await
        .unwrap_err();
    assert_status(&status, Code::NotFound, "serves no core.openfeature.dev/v7");
    let asked = discovery_requests(&h.fake);
    assert!(
        asked.len() <= 2,
        "2,000 invented groups and a version made {} discovery requests: {asked:?}",
        asked.len()
    );
    // Every spelling of one kind is one discovery entry, not one each.
    h.fake.clear_requests();
    let spellings = [
        "FeatureFlag",
        "featureFlag",
        "FEATUREFLAG",
        "fEaTuReFlAg",
        "featureflag",
        "ff",
        "featureflags",
    ];
    for (i, kind) in spellings.iter().cycle().take(100).enumerate() {
        let selector = format!("{kind}.core.openfeature.dev/default/demo");
        let mut s = subscribe(&mut c, &[&selector]).await;
        assert_eq!(next(&mut s).await.event(), Event::Snapshot, "{i}");
    }
    let asked = discovery_requests(&h.fake);
    assert!(asked.len() <= 2, "{asked:?}");
}

#[tokio::test]
async fn invented_methods_add_no_metric_series() {
    let fake = fake().await;
    let listeners = with_admin().await;
    let broker = broker_with(&fake, listeners, Default::default(), vec![]);
    let channel = support::channel_from(broker.addr, "127.0.0.1").await;
    let before = metrics(broker.admin_addr.unwrap()).await;
    for i in 0..300 {
        let path = format!("/crdbroker.v1.Broker/Invented{i}");
        let status = raw_call(channel.clone(), &path, Vec::new(), &[])
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unimplemented);
    }
    let m = metrics(broker.admin_addr.unwrap()).await;
    // The only new series are those of `other`: one per family (and histogram bucket).
    let new: Vec<&String> = m.keys().filter(|k| !before.contains_key(*k)).collect();
    assert!(
        new.iter().all(|k| k.contains(r#"grpc_method="other""#)),
        "{new:?}"
    );
    assert!(new.len() <= 20, "{} new series: {new:?}", new.len());
    assert_eq!(
        get(
            &m,
            r#"grpc_server_started_total{grpc_service="other",grpc_method="other",grpc_type="unknown"}"#
        ),
        300.0
    );
}

#[tokio::test]
async fn huge_names_get_bounded_errors_and_the_largest_a_size_error() {
    let h = start(Duration::ZERO).await;
    let mut c = connect(h.broker.addr).await;
    let big = "a".repeat(200 * 1024);
    let status = c.subscribe(request(&[&demo("demo")])).await.map(|_| ());
    assert!(status.is_ok());
    let mut r = request(&[&demo("demo")]);
    r.resources[0].name = big.clone();
    let status = c.subscribe(r).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().len() < 1024,
        "{} bytes",
        status.message().len()
    );
    assert!(
        status.message().contains("(204800 bytes)"),
        "{}",
        status.message()
    );
    let mut r = request(&[&demo("demo")]);
    r.resources[0].name = "a".repeat(1024 * 1024);
    let status = c.subscribe(r).await.unwrap_err();
    assert_status(&status, Code::ResourceExhausted, "--max-request-bytes");
    // The flagd selector too.
    let channel = support::channel_from(h.broker.addr, "127.0.0.1").await;
    let request = crd_broker::pb::flagd::SyncFlagsRequest {
        selector: format!("core.openfeature.dev/default/{big}"),
        ..Default::default()
    };
    let status = raw_call(channel, SYNC, request.encode_to_vec(), &[])
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().len() < 1024,
        "{} bytes",
        status.message().len()
    );
}

#[tokio::test]
async fn the_api_servers_refusal_text_is_not_passed_on() {
    let h = start(Duration::ZERO).await;
    h.fake.deny(fake_apiserver::Deny {
        verb: Some("list".into()),
        name: Some("secret".into()),
        ..Default::default()
    });
    let mut c = connect(h.broker.addr).await;
    let mut s = subscribe(&mut c, &[&demo("secret")]).await;
    let status = ended(&mut s).await;
    assert_eq!(status.code(), Code::PermissionDenied);
    for leak in ["system:", "User", "cannot list"] {
        assert!(!status.message().contains(leak), "{}", status.message());
    }
    assert!(
        status.message().contains("forbidden"),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn a_kind_the_allow_list_refuses_costs_no_api_call() {
    let h = start_allowing(
        Duration::ZERO,
        vec!["featureflags.core.openfeature.dev".parse().unwrap()],
    )
    .await;
    let mut c = connect(h.broker.addr).await;
    h.fake.clear_requests();
    for i in 0..50 {
        let status = c
            .subscribe(request(&[&format!("secrets.g{i}.example/default/x")]))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied);
        assert!(
            status.message().contains("--resource allows"),
            "{}",
            status.message()
        );
    }
    let asked: Vec<String> = discovery_requests(&h.fake)
        .into_iter()
        .filter(|p| p.contains(".example"))
        .collect();
    assert!(asked.is_empty(), "{asked:?}");
}
