//! The broker as the steady part: through an outage of the API server it stays ready and serves
//! what it knows; it returns within moments of the server's return; a quiet resource that keeps
//! meeting faults is not left unwatched; a stream naming several resources survives one failing.

mod support;

use std::time::{Duration, Instant};

use crd_broker::broker::{Config, Listeners, Running};
use crd_broker::pb::subscribe_response::Event;
use crd_broker::source::kubernetes::throttle::Rate;
use crd_broker::source::kubernetes::{ApiHttp2, Kubernetes, http};
use crd_broker::telemetry::{ApiHeldLabels, ApiRequests};
use fake_apiserver::faults::{Action, Injection};
use fake_apiserver::{FakeApiServer, Matcher};
use support::*;
use tokio::net::TcpListener;
use tonic::Code;

/// A broker on the fake with an admin port, checked every 200 ms, ready through `staleness` of
/// failures, its discovery answers trusted for `discovery_ttl`.
async fn steady_broker(
    fake: &FakeApiServer,
    staleness: Duration,
    discovery_ttl: Duration,
) -> Running<Kubernetes> {
    let listeners = with_admin().await;
    let config = Config {
        linger: Duration::from_secs(30),
        readiness_interval: Duration::from_millis(200),
        max_staleness: staleness,
        ..Config::default()
    };
    let source = Kubernetes::new(kube_client(fake), vec![]).with_discovery_ttl(discovery_ttl);
    Running::start_with(listeners, source, config).expect("the broker starts")
}

async fn wait_for(what: &str, done: impl AsyncFnMut() -> bool) {
    eventually(what, WAIT, done).await;
}

fn patch(fake: &FakeApiServer, name: &str, variant: &str) {
    fake.merge_patch(GV, "featureflags", "default", name, variant_patch(variant))
        .unwrap();
}

#[tokio::test]
async fn through_an_outage_held_resources_are_served_at_once_new_ones_wait_and_all_return() {
    let fake = fake().await;
    fake.apply(flag("demo", "v0")).unwrap();
    fake.apply(flag("other", "o0")).unwrap();
    // Discovery answers expire every 300 ms here: long outages outlive them.
    let broker = steady_broker(&fake, Duration::from_secs(60), Duration::from_millis(300)).await;
    let admin = broker.admin_addr.unwrap();
    wait_for("ready", async || http_get(admin, "/readyz").await.0 == 200).await;
    let mut client = connect(broker.addr).await;
    let mut held = subscribe(&mut client, &[&demo("demo")]).await;
    assert!(is(&next(&mut held).await, Event::Snapshot, "v0"));

    fake.stop_listening();
    wait_for("readyz says the source fails", async || {
        let (code, body) = http_get(admin, "/readyz").await;
        code == 200 && body.contains("serving last-known states")
    })
    .await;
    // Several discovery lifetimes into the outage.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (code, body) = http_get(admin, "/readyz").await;
    assert_eq!(code, 200, "ready within --max-staleness: {body}");
    let m = metrics(admin).await;
    assert!(get(&m, "crd_broker_source_stale_seconds") >= 1.0, "{m:?}");
    let watches: serde_json::Value =
        serde_json::from_str(&http_get(admin, "/debug/watches").await.1).unwrap();
    assert!(
        watches["watches"][0]["staleSeconds"].as_u64().unwrap() >= 1,
        "{watches}"
    );

    // A new subscriber to the held resource, spelled another way (so it is resolved through
    // discovery), gets its state at once.
    let started = Instant::now();
    let mut again = subscribe(
        &mut client,
        &["ff.v1beta1.core.openfeature.dev/default/demo"],
    )
    .await;
    assert!(is(&next(&mut again).await, Event::Snapshot, "v0"));
    let at_once = started.elapsed();
    assert!(at_once < Duration::from_secs(1), "{at_once:?}");
    // One the broker does not hold waits, neither failing nor answered.
    let mut waiting = subscribe(&mut client, &[&demo("other")]).await;
    assert!(
        tokio::time::timeout(Duration::from_secs(1), waiting.message())
            .await
            .is_err(),
        "a resource the broker does not hold waits for the API server"
    );

    // Written while the broker could not see it; the server returns.
    patch(&fake, "demo", "v1");
    let back = Instant::now();
    fake.start_listening().await.unwrap();
    let updated = until(&mut held, |r| variant(r) == "v1").await;
    let converged = back.elapsed();
    assert_eq!(updated.event(), Event::Updated);
    assert!(is(&next(&mut waiting).await, Event::Snapshot, "o0"));
    until(&mut again, |r| variant(r) == "v1").await;
    println!("converged {converged:?} after the API server returned");
    assert!(converged < Duration::from_secs(5), "{converged:?}");
    wait_for("ready and current again", async || {
        let (code, body) = http_get(admin, "/readyz").await;
        code == 200 && body == "ready\n"
    })
    .await;
    assert_eq!(
        get(&metrics(admin).await, "crd_broker_source_stale_seconds"),
        0.0
    );
    assert!(fake.wait_for(WAIT, |f| f.open_watches() == 2).await);
}

#[tokio::test]
async fn past_max_staleness_the_broker_is_not_ready_and_says_why() {
    let fake = fake().await;
    let broker = steady_broker(&fake, Duration::from_secs(1), Duration::from_secs(30)).await;
    let admin = broker.admin_addr.unwrap();
    wait_for("ready", async || http_get(admin, "/readyz").await.0 == 200).await;
    fake.stop_listening();
    wait_for("not ready past --max-staleness, naming it", async || {
        let (code, body) = http_get(admin, "/readyz").await;
        code == 503 && body.contains("longer than --max-staleness 1s")
    })
    .await;
    fake.start_listening().await.unwrap();
    wait_for("ready again", async || {
        http_get(admin, "/readyz").await.0 == 200
    })
    .await;
}

#[tokio::test]
async fn a_broker_that_never_reached_the_api_server_is_not_ready() {
    let fake = fake().await;
    fake.stop_listening();
    let broker = steady_broker(&fake, Duration::from_secs(300), Duration::from_secs(30)).await;
    let admin = broker.admin_addr.unwrap();
    wait_for("checked", async || {
        let (code, body) = http_get(admin, "/readyz").await;
        code == 503 && body.contains("does not answer")
    })
    .await;
}

#[tokio::test]
async fn a_quiet_resource_that_keeps_meeting_faults_is_watched_again_soon_after_they_stop() {
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("quiet", "q0")).unwrap();
    let mut client = h.client().await;
    let mut s = subscribe(&mut client, &[&demo("quiet")]).await;
    assert!(is(&next(&mut s).await, Event::Snapshot, "q0"));
    // Eight seconds of faults: every watch ends in an ERROR, and re-watches fail now and then.
    // With kube's default backoff (reset only by events) the waits would climb to 30 s.
    for round in 0..16 {
        h.fake.error_watches(500);
        if round % 2 == 0 {
            h.fake.fail_next(Matcher::verb("watch"), 2, 500, None);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The faults stop (including injections not yet consumed).
    h.fake.clear_faults();
    let last = Instant::now();
    patch(&h.fake, "quiet", "q1");
    until(&mut s, |r| variant(r) == "q1").await;
    let took = last.elapsed();
    println!("the write after the faults arrived after {took:?}");
    assert!(
        took < crd_broker::source::retry::BACKOFF_MAX + Duration::from_secs(2),
        "{took:?}"
    );
}

#[tokio::test]
async fn a_stream_of_several_resources_survives_one_failing_after_the_others_were_served() {
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "on")).unwrap();
    h.fake.deny(fake_apiserver::Deny {
        verb: Some("list".into()),
        name: Some("secret".into()),
        ..Default::default()
    });
    let mut client = h.client().await;
    // Held already: its state is sent before the other's watch has an answer.
    let mut warm = subscribe(&mut client, &[&demo("demo")]).await;
    next(&mut warm).await;
    let mut s = subscribe(&mut client, &[&demo("demo"), &demo("secret")]).await;
    let first = next(&mut s).await;
    assert_eq!((first.index, first.event()), (0, Event::Snapshot));
    let failed = next(&mut s).await;
    assert_eq!(
        (failed.index, failed.event()),
        (1, Event::Failed),
        "{failed:?}"
    );
    assert_eq!(failed.error_code, Code::PermissionDenied as i32);
    assert!(
        failed.error_message.contains("forbidden"),
        "{}",
        failed.error_message
    );
    assert!(failed.object.is_empty());
    // The stream goes on for the other.
    patch(&h.fake, "demo", "off");
    let updated = next(&mut s).await;
    assert_eq!((updated.index, updated.event()), (0, Event::Updated));
    assert_eq!(variant(&updated), "off");
}

/// A confined broker on the fake, serving FeatureFlags, checked every 200 ms.
async fn confined_broker(fake: &FakeApiServer, namespaces: &[&str]) -> Running<Kubernetes> {
    let listeners = with_admin().await;
    let config = Config {
        readiness_interval: Duration::from_millis(200),
        ..Config::default()
    };
    let source = Kubernetes::new(
        kube_client(fake),
        vec!["featureflags.core.openfeature.dev".parse().unwrap()],
    )
    .confined_to(namespaces.iter().map(|n| n.to_string()).collect());
    Running::start_with(listeners, source, config).expect("the broker starts")
}

async fn readyz_settles(admin: std::net::SocketAddr, code: u16, needle: &str) {
    wait_for(&format!("readyz {code} {needle:?}"), async || {
        let (c, body) = http_get(admin, "/readyz").await;
        c == code && body.contains(needle)
    })
    .await;
}

#[tokio::test]
async fn confined_to_namespaces_a_role_there_suffices_even_one_naming_objects() {
    use fake_apiserver::Grant;
    let fake = fake().await;
    for ns in ["team-a", "team-b"] {
        fake.create_namespace(ns).unwrap();
        fake.apply(flag_in(ns, "x", "on")).unwrap();
        fake.apply(flag_in(ns, "y", "on")).unwrap();
    }
    let role = Grant::cluster(
        &["get", "list", "watch"],
        "core.openfeature.dev",
        &["featureflags"],
    )
    .in_namespace("team-a");
    fake.grant_only(vec![role.clone()]);

    // Unconfined, the broker needs cluster-wide rights, and says it lacks them.
    let everywhere = confined_broker(&fake, &[]).await;
    readyz_settles(
        everywhere.admin_addr.unwrap(),
        503,
        "may not list featureflags.core.openfeature.dev",
    )
    .await;

    // Confined to team-a, the Role there is all it needs.
    let broker = confined_broker(&fake, &["team-a"]).await;
    let admin = broker.admin_addr.unwrap();
    readyz_settles(admin, 200, "ready").await;
    let mut client = connect(broker.addr).await;
    let mut s = subscribe(&mut client, &[&ff("team-a", "x")]).await;
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    // Another namespace is refused before any API call.
    let path = "/apis/core.openfeature.dev/v1beta1/namespaces/team-b/featureflags";
    let status = client
        .subscribe(request(&[&ff("team-b", "x")]))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_status(
        &status,
        Code::PermissionDenied,
        "--namespace serves: team-a",
    );
    assert_eq!(fake.request_count("list", path), 0);

    // A Role that names the objects (resourceNames) is enough for readiness, and for them.
    fake.grant_only(vec![role.names(&["x"])]);
    let named = confined_broker(&fake, &["team-a"]).await;
    readyz_settles(named.admin_addr.unwrap(), 200, "ready").await;
    let mut client = connect(named.addr).await;
    let mut x = subscribe(&mut client, &[&ff("team-a", "x")]).await;
    assert_eq!(next(&mut x).await.event(), Event::Snapshot);
    let mut y = subscribe(&mut client, &[&ff("team-a", "y")]).await;
    assert_eq!(ended(&mut y).await.code(), Code::PermissionDenied);

    // No rights in a namespace it serves: not ready, naming the namespace.
    let two = confined_broker(&fake, &["team-a", "team-b"]).await;
    readyz_settles(
        two.admin_addr.unwrap(),
        503,
        "may not list featureflags.core.openfeature.dev in namespace team-b",
    )
    .await;
}

#[tokio::test]
async fn confined_to_namespaces_cluster_scoped_kinds_are_not_served() {
    let fake = fake().await;
    let mut crd = secrets_crd();
    crd["spec"]["scope"] = "Cluster".into();
    fake.install_crd(crd).unwrap();
    let listeners = Listeners::tcp(TcpListener::bind("127.0.0.1:0").await.unwrap());
    let source = Kubernetes::new(kube_client(&fake), vec![]).confined_to(vec!["team-a".into()]);
    let broker = Running::start_with(listeners, source, Config::default()).unwrap();
    let mut client = connect(broker.addr).await;
    let status = client
        .subscribe(request(&["secrets.example.com/s"]))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_status(&status, Code::PermissionDenied, "is cluster-scoped");
}

#[tokio::test]
async fn relists_are_quorum_reads_and_watches_resume_from_the_last_version() {
    // A relist with resourceVersion=0 may be answered from a lagging cache with an older object;
    // without one it is read from etcd and never goes back.
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "v0")).unwrap();
    let mut client = h.client().await;
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    next(&mut s).await;
    patch(&h.fake, "demo", "v1");
    until(&mut s, |r| variant(r) == "v1").await;
    // Expired history: the resume gets 410, and the broker relists.
    h.fake.compact();
    h.fake.error_watches(410);
    patch(&h.fake, "demo", "v2");
    until(&mut s, |r| variant(r) == "v2").await;
    let requests = h.fake.requests();
    let lists: Vec<_> = requests
        .iter()
        .filter(|r| r.verb == "list" && r.path == NS_PATH)
        .collect();
    assert!(lists.len() >= 2, "a list and a relist: {lists:?}");
    for list in &lists {
        assert!(
            list.param("resourceVersion").is_none_or(str::is_empty),
            "a quorum read: {list:?}"
        );
        assert_eq!(list.param("fieldSelector"), Some("metadata.name=demo"));
    }
    let watches: Vec<_> = requests
        .iter()
        .filter(|r| r.verb == "watch" && r.path == NS_PATH)
        .collect();
    assert!(
        watches.iter().all(|w| w
            .param("resourceVersion")
            .is_some_and(|v| v != "0" && !v.is_empty())),
        "watches resume from a version seen: {watches:?}"
    );
}

#[tokio::test]
async fn an_error_in_a_watchs_stream_starts_over_from_a_list() {
    // A real kube-apiserver without its watch cache answers a watch resumed at the revision
    // etcd was compacted to with 500 "etcd event received with PrevKv=nil" in the stream, on
    // every try from that version (tests/real_faults.rs): resuming from it again would never end.
    let h = start(Duration::from_secs(30)).await;
    h.fake.apply(flag("demo", "v0")).unwrap();
    let mut client = h.client().await;
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    next(&mut s).await;
    let lists = |h: &Harness| {
        h.fake
            .requests()
            .iter()
            .filter(|r| r.verb == "list" && r.path == NS_PATH)
            .count()
    };
    let before = lists(&h);
    h.fake.error_watches(500);
    patch(&h.fake, "demo", "v1");
    until(&mut s, |r| variant(r) == "v1").await;
    assert_eq!(lists(&h), before + 1, "one relist after the error");
}

/// A TCP proxy on 127.0.0.2 to `to` whose connections can be blackholed: both directions stop,
/// no FIN or RST is sent, the sockets stay open — as when the peer's node vanishes.
async fn blackholing_proxy(
    to: std::net::SocketAddr,
) -> (std::net::SocketAddr, tokio::sync::watch::Sender<bool>) {
    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
    type Half = (
        Box<dyn AsyncRead + Unpin + Send>,
        Box<dyn AsyncWrite + Unpin + Send>,
    );
    let listener = TcpListener::bind("127.0.0.2:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (hole, _) = tokio::sync::watch::channel(false);
    let holes = hole.clone();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let Ok(outbound) = tokio::net::TcpStream::connect(to).await else {
                return;
            };
            let (ir, iw) = inbound.into_split();
            let (or, ow) = outbound.into_split();
            let halves: [Half; 2] = [(Box::new(ir), Box::new(ow)), (Box::new(or), Box::new(iw))];
            for (mut from, mut into) in halves {
                let mut holed = holes.subscribe();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        tokio::select! {
                            _ = async { drop(holed.wait_for(|h| *h).await) } => {
                                // Both sockets stay open and silent until the test ends.
                                std::future::pending::<()>().await;
                            }
                            n = from.read(&mut buf) => match n {
                                Ok(0) | Err(_) => return,
                                Ok(n) => if into.write_all(&buf[..n]).await.is_err() { return },
                            },
                        }
                    }
                });
            }
        }
    });
    (addr, hole)
}

#[tokio::test]
async fn keepalive_reaps_a_half_open_connection_within_interval_and_timeout() {
    let fake = fake().await;
    fake.apply(flag("demo", "on")).unwrap();
    let (interval, timeout) = (Duration::from_millis(300), Duration::from_millis(300));
    let mut config = Config {
        linger: Duration::ZERO,
        ..Config::default()
    };
    config.transport.keepalive_interval = Some(interval);
    config.transport.keepalive_timeout = timeout;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let broker = Running::start_with(
        Listeners::tcp(listener),
        Kubernetes::new(kube_client(&fake), vec![]),
        config,
    )
    .unwrap();
    let (proxy, hole) = blackholing_proxy(broker.addr).await;
    let mut vanishing = connect(proxy).await;
    let mut s = subscribe(&mut vanishing, &[&demo("demo")]).await;
    next(&mut s).await;
    let mut direct = connect(broker.addr).await;
    let mut other = subscribe(&mut direct, &[&demo("other")]).await;
    next(&mut other).await;
    assert_eq!(broker.registry.len(), 2);

    hole.send_replace(true);
    let vanished = Instant::now();
    wait_for(
        "the half-open connection is closed and its watch with it",
        async || broker.registry.len() == 1,
    )
    .await;
    let reaped = vanished.elapsed();
    println!(
        "reaped {reaped:?} after the peer vanished (interval {interval:?} + timeout {timeout:?})"
    );
    assert!(
        reaped <= interval * 2 + timeout + Duration::from_secs(1),
        "{reaped:?}"
    );
    // Nobody else noticed.
    fake.apply(flag("other", "off")).unwrap();
    assert!(is(&next(&mut other).await, Event::Snapshot, "off"));
}

/// A broker on the fake whose client is built as `serve` builds it, its requests limited by
/// `rate`; with what its client counts.
async fn paced_broker(fake: &FakeApiServer, rate: Rate) -> (Running<Kubernetes>, ApiRequests) {
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&fake.kubeconfig()).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let requests = ApiRequests::default();
    let (client, pinged) = http::client(config, ApiHttp2::Auto, rate, requests.clone()).unwrap();
    let source = Kubernetes::new(client, vec![]).with_pinged(pinged);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let broker = Running::start(listener, source, Duration::from_secs(30)).unwrap();
    (broker, requests)
}

fn held(requests: &ApiRequests, reason: &'static str) -> f64 {
    requests.held.get_or_create(&ApiHeldLabels { reason }).get()
}

#[tokio::test]
async fn a_429_s_retry_after_holds_the_brokers_requests_that_long() {
    let fake = fake().await;
    fake.apply(flag("demo", "v0")).unwrap();
    let (broker, requests) = paced_broker(&fake, Rate::default()).await;
    // API Priority and Fairness refuses the first LIST, and asks for 2 s.
    fake.inject(Injection {
        matcher: Matcher::verb("list").on(NS_PATH),
        times: 1,
        action: Action::Status {
            code: 429,
            retry_after: Some(2),
        },
    });
    let asked = Instant::now();
    let mut client = connect(broker.addr).await;
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    assert!(is(&next(&mut s).await, Event::Snapshot, "v0"));
    assert!(
        asked.elapsed() >= Duration::from_secs(2),
        "served {:?} after the 429: its Retry-After was not honoured",
        asked.elapsed()
    );
    let lists = fake.requests().iter().filter(|r| r.verb == "list").count();
    assert_eq!(lists, 2, "the refused LIST, and one more after the wait");
    assert!(held(&requests, "retry_after") >= 1.9);
    assert_eq!(
        held(&requests, "rate"),
        0.0,
        "no rate of its own by default"
    );
}

#[tokio::test]
async fn the_brokers_own_rate_limit_paces_its_requests_to_the_api_server() {
    let fake = fake().await;
    let names: Vec<String> = (0..10).map(|i| format!("f{i}")).collect();
    for name in &names {
        fake.apply(flag(name, "v0")).unwrap();
    }
    let rate = Rate { qps: 5.0, burst: 2 };
    let started = Instant::now();
    let (broker, requests) = paced_broker(&fake, rate).await;
    let selectors: Vec<String> = names.iter().map(|n| demo(n)).collect();
    let selectors: Vec<&str> = selectors.iter().map(String::as_str).collect();
    let mut client = connect(broker.addr).await;
    let mut s = subscribe(&mut client, &selectors).await;
    for _ in &names {
        assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    }
    let took = started.elapsed();
    let sent = fake.requests().len();
    assert!(sent >= 10, "a LIST for each of the ten at least: {sent}");
    // At most `burst` at once, then `qps` a second: `sent` requests need this long at least.
    let least = Duration::from_secs_f64((sent - 2) as f64 / 5.0);
    assert!(
        took >= least,
        "{sent} requests in {took:?}, under {least:?}"
    );
    assert!(held(&requests, "rate") > 0.0);
}

#[tokio::test]
async fn a_server_answering_410_again_and_again_is_not_listed_in_a_tight_loop() {
    let fake = fake().await;
    fake.apply(flag("demo", "v0")).unwrap();
    let broker = steady_broker(&fake, Duration::from_secs(60), Duration::from_secs(30)).await;
    let mut client = connect(broker.addr).await;
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    assert!(is(&next(&mut s).await, Event::Snapshot, "v0"));
    // Every WATCH from now on is told its version is gone, twenty times.
    fake.clear_requests();
    fake.inject(Injection {
        matcher: Matcher::verb("watch").on(NS_PATH),
        times: 20,
        action: Action::Status {
            code: 410,
            retry_after: None,
        },
    });
    fake.abort_watches();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let lists = fake.requests().iter().filter(|r| r.verb == "list").count();
    // The backoff (100 ms, then doubling, each between half and all) allows five in a second;
    // without it, the twenty would all be spent at once.
    assert!(lists <= 5, "{lists} LISTs in a second");
    // And the resource is followed again once the server stops.
    fake.clear_faults();
    patch(&fake, "demo", "v1");
    let update = tokio::time::timeout(
        Duration::from_secs(20),
        until(&mut s, |m| is(m, Event::Updated, "v1")),
    )
    .await
    .expect("the change arrives once the 410s stop");
    assert!(is(&update, Event::Updated, "v1"));
}

#[tokio::test]
async fn a_burst_of_requests_leaves_a_few_idle_connections_and_those_not_for_long() {
    let fake = fake().await;
    // The client as serve builds it, for a server without TLS: HTTP/1.1, a connection for
    // each request in flight.
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&fake.kubeconfig()).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let (client, _) = http::client(
        config,
        ApiHttp2::Auto,
        Rate::default(),
        ApiRequests::default(),
    )
    .unwrap();
    let burst = (0..40).map(|_| {
        let client = client.clone();
        async move {
            let request = ::http::Request::get("/version").body(Vec::new()).unwrap();
            client.request_text(request).await.unwrap()
        }
    });
    futures::future::join_all(burst).await;
    // Before, hyper kept all forty open for as long as the server did, each a task of the
    // broker's: after a fault soak, 14 tasks where there had been 8.
    eventually("at most 16 idle connections kept", WAIT, async || {
        fake.open_connections() <= 16
    })
    .await;
    eventually(
        "the idle connections are closed",
        Duration::from_secs(35),
        async || fake.open_connections() == 0,
    )
    .await;
}
