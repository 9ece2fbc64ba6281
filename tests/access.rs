//! Who may read what, end to end through real gRPC on loopback against the fake API server:
//! every identity source, every policy rule, IP reuse, policy reloads, and that the broker is no
//! oracle. Clients connect from 127.0.0.x source addresses to be different pods.

mod support;

use std::time::Duration;

use crd_broker::access::{IdentityList, Mesh, Settings};
use crd_broker::pb::subscribe_response::Event;
use fake_apiserver::TokenUser;
use support::*;
use tonic::Code;
use tonic::metadata::MetadataValue;

/// team-a/web-1 at 127.0.0.2, team-b/api-1 at 127.0.0.3, a FeatureFlag `f` in team-a,
/// team-b and shared.
async fn tenants() -> fake_apiserver::FakeApiServer {
    let fake = fake().await;
    run_pod(&fake, "team-a", "web-1", "web", "127.0.0.2");
    run_pod(&fake, "team-b", "api-1", "api", "127.0.0.3");
    for ns in ["team-a", "team-b", "shared"] {
        fake.apply(flag_in(ns, "f", "on")).unwrap();
    }
    fake
}

fn settings(identity: &str) -> Settings {
    Settings {
        identity: identity.parse::<IdentityList>().unwrap(),
        ..Settings::default()
    }
}

/// A policy file in a temporary directory.
fn policy_file(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

/// Settings for `identity` with a policy file holding `text` (kept while the directory lives).
fn with_policy(identity: &str, text: &str) -> (tempfile::TempDir, Settings) {
    let (dir, policy) = policy_file(text);
    let settings = Settings {
        policy: Some(policy),
        ..settings(identity)
    };
    (dir, settings)
}

/// Replaces the file by a rename, as a ConfigMap volume update does.
fn rewrite(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The status a Subscribe of `selector` is refused with.
async fn refusal(
    client: &mut crd_broker::pb::broker_client::BrokerClient<tonic::transport::Channel>,
    selector: &str,
) -> tonic::Status {
    client.subscribe(request(&[selector])).await.unwrap_err()
}

/// A Subscribe request for `selector` carrying the header `name: value`.
fn with(
    name: &'static str,
    value: &str,
    selector: &str,
) -> tonic::Request<crd_broker::pb::SubscribeRequest> {
    let mut r = tonic::Request::new(request(&[selector]));
    r.metadata_mut()
        .insert(name, MetadataValue::try_from(value).unwrap());
    r
}

const SHARED_FOR_TEAM_B: &str = "grants:\n  - from: team-b\n    read: [shared]\n";

#[tokio::test]
async fn peer_pod_identifies_callers_by_ip_and_each_reads_what_the_policy_grants() {
    let fake = tenants().await;
    let (_dir, access) = with_policy("peer-pod", SHARED_FOR_TEAM_B);
    let broker = broker_with_access(&fake, access).await;

    let mut a = connect_from(broker.addr, "127.0.0.2").await;
    let mut own = subscribe(&mut a, &[&ff("team-a", "f")]).await;
    assert!(is(&next(&mut own).await, Event::Snapshot, "on"));
    let denied = refusal(&mut a, &ff("team-b", "f")).await;
    assert_eq!(
        denied.code(),
        Code::PermissionDenied,
        "{}",
        denied.message()
    );
    assert!(
        denied.message().contains("team-a/web (pod web-1)")
            && denied.message().contains("namespace team-b"),
        "names the caller and the namespace: {}",
        denied.message()
    );
    // The same answer whether or not the resource exists: the broker is no oracle.
    let missing = refusal(&mut a, &ff("team-b", "no-such-flag")).await;
    assert_eq!(
        (missing.code(), missing.message()),
        (denied.code(), denied.message())
    );
    assert_eq!(
        refusal(&mut a, &ff("shared", "f")).await.code(),
        Code::PermissionDenied,
        "shared is granted to team-b only"
    );
    // Refused before anything is resolved: a namespace the caller may not read costs no API call.
    fake.clear_requests();
    let invented = refusal(&mut a, "things.nowhere.example/team-b/x").await;
    assert_eq!(invented.code(), Code::PermissionDenied);
    let discovery: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| r.path.starts_with("/apis"))
        .collect();
    assert!(discovery.is_empty(), "{discovery:?}");

    let mut b = connect_from(broker.addr, "127.0.0.3").await;
    let mut shared = subscribe(&mut b, &[&ff("shared", "f")]).await;
    assert!(is(&next(&mut shared).await, Event::Snapshot, "on"));
    assert_eq!(
        refusal(&mut b, &ff("team-a", "f")).await.code(),
        Code::PermissionDenied
    );

    // A peer no pod has: unauthenticated, naming what was tried; health still answers it.
    let mut stranger = connect_from(broker.addr, "127.0.0.9").await;
    let unknown = refusal(&mut stranger, &ff("team-a", "f")).await;
    assert_status(
        &unknown,
        Code::Unauthenticated,
        "peer-pod: no running pod has IP 127.0.0.9",
    );
    let mut health = tonic_health::pb::health_client::HealthClient::new(
        channel_from(broker.addr, "127.0.0.9").await,
    );
    health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("health is open to everyone");

    // The subscriptions that were allowed go on.
    fake.merge_patch(GV, "featureflags", "team-a", "f", variant_patch("off"))
        .unwrap();
    assert!(is(&next(&mut own).await, Event::Updated, "off"));
    let m = metrics(broker.admin_addr.unwrap()).await;
    assert!(
        get(
            &m,
            r#"crd_broker_identifications_total{source="peer_pod",result="identified"}"#
        ) >= 2.0
    );
    assert!(get(&m, r#"crd_broker_denials_total{reason="namespace"}"#) >= 4.0);
    assert_eq!(
        get(
            &m,
            r#"crd_broker_identifications_total{source="none",result="unidentified"}"#
        ),
        1.0
    );
}

#[tokio::test]
async fn a_storm_of_connections_from_one_pod_costs_one_lookup_and_a_connection_resolves_once() {
    let fake = tenants().await;
    let broker = broker_with_access(&fake, settings("peer-pod")).await;
    fake.clear_requests();
    let storms: Vec<_> = (0..50)
        .map(|_| {
            let addr = broker.addr;
            tokio::spawn(async move {
                let mut c = connect_from(addr, "127.0.0.2").await;
                let mut s = subscribe(&mut c, &[&ff("team-a", "f")]).await;
                next(&mut s).await;
                // More requests on the same connection ask nobody.
                for _ in 0..5 {
                    let mut again = subscribe(&mut c, &[&ff("team-a", "f")]).await;
                    next(&mut again).await;
                }
            })
        })
        .collect();
    for s in storms {
        s.await.unwrap();
    }
    let lookups = fake.request_count("list", "/api/v1/pods");
    assert_eq!(
        lookups, 1,
        "300 subscriptions on 50 connections from one pod"
    );
    assert_eq!(broker.access.api_requests().0, 1);
}

#[tokio::test]
async fn a_new_pod_on_a_reused_ip_is_recognised_within_five_seconds() {
    let fake = tenants().await;
    run_pod(&fake, "team-a", "old", "web", "127.0.0.4");
    let broker = broker_with_access(&fake, settings("peer-pod")).await;
    let mut old = connect_from(broker.addr, "127.0.0.4").await;
    let mut s = subscribe(&mut old, &[&ff("team-a", "f")]).await;
    next(&mut s).await;

    fake.delete("v1", "pods", "team-a", "old").unwrap();
    let new_uid = run_pod(&fake, "team-b", "new", "api", "127.0.0.4");
    assert!(!new_uid.is_empty());
    let reused = std::time::Instant::now();
    let recognised = loop {
        let mut c = connect_from(broker.addr, "127.0.0.4").await;
        if let Ok(r) = c.subscribe(request(&[&ff("team-b", "f")])).await {
            let mut r = r.into_inner();
            assert_eq!(next(&mut r).await.event(), Event::Snapshot);
            break reused.elapsed();
        }
        assert!(
            reused.elapsed() < Duration::from_secs(5),
            "not recognised in 5 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("a new pod on a reused IP was recognised after {recognised:?}");
    // From then on a new connection from that IP is never the old pod.
    let mut c = connect_from(broker.addr, "127.0.0.4").await;
    assert_eq!(
        refusal(&mut c, &ff("team-a", "f")).await.code(),
        Code::PermissionDenied
    );
    // The old connection keeps the pod it was matched to (a pod's connections die with it).
    let mut again = subscribe(&mut old, &[&ff("team-a", "f")]).await;
    next(&mut again).await;
}

#[tokio::test]
async fn host_network_ambiguous_and_terminating_pods_identify_nobody() {
    let fake = tenants().await;
    fake.apply(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": "node-agent", "namespace": "kube-system" },
        "spec": { "hostNetwork": true, "containers": [{ "name": "a", "image": "a" }] },
    }))
    .unwrap();
    fake.merge_patch_status(
        "v1",
        "pods",
        "kube-system",
        "node-agent",
        serde_json::json!({ "status": { "phase": "Running", "podIP": "127.0.0.5" } }),
    )
    .unwrap();
    run_pod(&fake, "team-a", "twin-1", "web", "127.0.0.6");
    run_pod(&fake, "team-b", "twin-2", "api", "127.0.0.6");
    let broker = broker_with_access(&fake, settings("peer-pod")).await;
    for (ip, why) in [
        ("127.0.0.5", "a node's IP"),
        ("127.0.0.6", "2 running pods have IP 127.0.0.6"),
    ] {
        let mut c = connect_from(broker.addr, ip).await;
        let status = refusal(&mut c, &ff("team-a", "f")).await;
        assert_eq!(status.code(), Code::Unauthenticated, "{ip}");
        assert!(status.message().contains(why), "{}", status.message());
    }
}

#[tokio::test]
async fn tokens_identify_service_accounts_once_per_token() {
    let fake = tenants().await;
    fake.register_token(
        TokenUser::service_account("good", "team-a", "web").with_audiences(&["crd-broker"]),
    );
    fake.register_token(
        TokenUser::service_account("elsewhere", "team-a", "web").with_audiences(&["other"]),
    );
    fake.register_token(TokenUser {
        token: "person".into(),
        username: "alice".into(),
        audiences: vec!["crd-broker".into()],
        ..TokenUser::default()
    });
    // Authenticated by an authenticator that ignores audiences: any token of the API server's.
    fake.register_token(TokenUser {
        audience_unaware: true,
        ..TokenUser::service_account("unaware", "team-a", "web")
    });
    let broker = broker_with_access(&fake, settings("token")).await;
    let mut c = connect_from(broker.addr, "127.0.0.9").await;
    let with_token =
        |token: &str, selector: &str| with("authorization", &format!("Bearer {token}"), selector);
    fake.clear_requests();
    for _ in 0..20 {
        let mut s = c
            .subscribe(with_token("good", &ff("team-a", "f")))
            .await
            .unwrap()
            .into_inner();
        next(&mut s).await;
    }
    assert_eq!(
        fake.request_count("create", "/apis/authentication.k8s.io/v1/tokenreviews"),
        1,
        "one review for twenty requests with one token"
    );
    let other_ns = c
        .subscribe(with_token("good", &ff("team-b", "f")))
        .await
        .unwrap_err();
    assert_eq!(other_ns.code(), Code::PermissionDenied);
    for (token, why) in [
        ("elsewhere", "token: the bearer token was refused"),
        ("person", "user \"alice\"'s, not a service account's"),
        ("forged", "token: the bearer token was refused"),
        (
            "unaware",
            "the TokenReview did not confirm the bearer token is for crd-broker",
        ),
    ] {
        let status = c
            .subscribe(with_token(token, &ff("team-a", "f")))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{token}");
        assert!(status.message().contains(why), "{}", status.message());
    }
    let none = refusal(&mut c, &ff("team-a", "f")).await;
    assert!(
        none.message().contains("token: no authorization header"),
        "{}",
        none.message()
    );
}

#[tokio::test]
async fn a_flood_of_made_up_tokens_is_bounded_per_source_and_never_costs_a_verified_caller() {
    use crd_broker::access::token::{REVIEW_BURST, REVIEW_RATE};
    let fake = tenants().await;
    fake.register_token(
        TokenUser::service_account("good", "team-a", "web").with_audiences(&["crd-broker"]),
    );
    let broker = broker_with_access(&fake, settings("token")).await;
    let reviews = || fake.request_count("create", "/apis/authentication.k8s.io/v1/tokenreviews");
    let with_token =
        |token: &str, selector: &str| with("authorization", &format!("Bearer {token}"), selector);
    let mut good = connect_from(broker.addr, "127.0.0.9").await;
    let mut s = good
        .subscribe(with_token("good", &ff("team-a", "f")))
        .await
        .unwrap()
        .into_inner();
    next(&mut s).await;
    fake.clear_requests();
    // One source: its new tokens are reviewed at its rate, the rest refused before any review.
    let started = std::time::Instant::now();
    let mut flood = connect_from(broker.addr, "127.0.0.2").await;
    let mut limited = None;
    for i in 0..400 {
        let status = flood
            .subscribe(with_token(&format!("made-up-{i}"), &ff("team-a", "f")))
            .await
            .unwrap_err();
        if status.code() == Code::ResourceExhausted {
            limited.get_or_insert(status);
        }
    }
    let allowed = REVIEW_BURST + REVIEW_RATE * started.elapsed().as_secs_f64();
    assert!(
        (reviews() as f64) <= allowed + 1.0,
        "{} reviews for 400 made-up tokens from one source, at most {allowed} allowed",
        reviews()
    );
    assert!(reviews() >= REVIEW_BURST as u64, "{}", reviews());
    assert_status(
        &limited.expect("some were limited"),
        Code::ResourceExhausted,
        "ip:127.0.0.2 has shown more new bearer tokens than the broker reviews",
    );
    // A refused token shown again is remembered: no second review.
    let before = reviews();
    let status = flood
        .subscribe(with_token("made-up-0", &ff("team-a", "f")))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    assert_eq!(reviews(), before, "a refusal is remembered");
    // Many sources, more made-up tokens than the broker remembers: the verified token stays
    // verified, and its caller is served without a review.
    let sources = 120;
    let mut tasks = Vec::new();
    for a in 0..sources {
        let addr = broker.addr;
        tasks.push(tokio::spawn(async move {
            let mut c = connect_from(addr, &format!("127.0.1.{}", a + 1)).await;
            for i in 0..REVIEW_BURST as usize {
                let token = format!("flood-{a}-{i}");
                let _ = c
                    .subscribe(with(
                        "authorization",
                        &format!("Bearer {token}"),
                        &ff("team-a", "f"),
                    ))
                    .await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(
        reviews() > 10_000,
        "the refusals overflowed what is remembered: {}",
        reviews()
    );
    let before = reviews();
    let mut s = good
        .subscribe(with_token("good", &ff("team-a", "f")))
        .await
        .unwrap()
        .into_inner();
    next(&mut s).await;
    assert_eq!(reviews(), before, "the verified token was not pushed out");
    let m = metrics(broker.admin_addr.unwrap()).await;
    assert!(get(&m, r#"crd_broker_limit_hits_total{limit="token_reviews"}"#) >= 1.0);
}

#[tokio::test]
async fn sources_are_tried_in_order_and_the_first_that_identifies_wins() {
    let fake = tenants().await;
    fake.register_token(
        TokenUser::service_account("b-token", "team-b", "api").with_audiences(&["crd-broker"]),
    );
    let broker = broker_with_access(&fake, settings("peer-pod,token")).await;
    let with_token = |selector: &str| with("authorization", "Bearer b-token", selector);
    // From team-a's pod: peer-pod answers first, the token is not looked at.
    let mut pod = connect_from(broker.addr, "127.0.0.2").await;
    assert!(pod.subscribe(with_token(&ff("team-a", "f"))).await.is_ok());
    assert_eq!(
        pod.subscribe(with_token(&ff("team-b", "f")))
            .await
            .unwrap_err()
            .code(),
        Code::PermissionDenied
    );
    // From an address no pod has: the token identifies team-b.
    let mut other = connect_from(broker.addr, "127.0.0.9").await;
    assert!(
        other
            .subscribe(with_token(&ff("team-b", "f")))
            .await
            .is_ok()
    );
}

async fn mtls_broker(
    fake: &fake_apiserver::FakeApiServer,
    pki: &Pki,
    dir: &std::path::Path,
) -> crd_broker::broker::Running<crd_broker::source::kubernetes::Kubernetes> {
    write_tls_files(dir, pki);
    let tls = crd_broker::transport::tls::Tls::load(crd_broker::transport::tls::TlsFiles {
        cert: dir.join("tls.crt"),
        key: dir.join("tls.key"),
        client_ca: Some(dir.join("ca.crt")),
    })
    .unwrap();
    let listeners = crd_broker::broker::Listeners {
        tcp: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()),
        tls: Some(tls),
        ..Default::default()
    };
    let config = crd_broker::broker::Config {
        access: Settings {
            client_certificates: true,
            ..settings("mtls")
        },
        ..Default::default()
    };
    broker_with(fake, listeners, config, vec![])
}

#[tokio::test]
async fn mtls_reads_the_spiffe_id_in_the_client_certificate() {
    let fake = tenants().await;
    let dir = tempfile::tempdir().unwrap();
    let pki = pki_with_client_uri("spiffe", Some("spiffe://cluster.local/ns/team-a/sa/web"));
    let broker = mtls_broker(&fake, &pki, dir.path()).await;
    let mut c = tls_client(broker.addr, &pki, true).await.unwrap();
    let mut s = subscribe(&mut c, &[&ff("team-a", "f")]).await;
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    let denied = refusal(&mut c, &ff("team-b", "f")).await;
    assert_status(&denied, Code::PermissionDenied, "team-a/web");

    // A certificate of the same CA without a SPIFFE ID identifies nobody.
    let dir = tempfile::tempdir().unwrap();
    let plain = support::pki("plain");
    let broker = mtls_broker(&fake, &plain, dir.path()).await;
    let mut c = tls_client(broker.addr, &plain, true).await.unwrap();
    let status = refusal(&mut c, &ff("team-a", "f")).await;
    assert_status(&status, Code::Unauthenticated, "no spiffe:// URI SAN");
}

/// `mesh` identity in `mesh`, its proxy at that mesh's addresses (as `serve --mesh` sets them).
fn in_mesh(mesh: Mesh, trust_domain: Option<&str>) -> Settings {
    Settings {
        mesh: Some(mesh),
        mesh_proxies: mesh
            .proxy_addresses()
            .iter()
            .map(|a| a.parse().unwrap())
            .collect(),
        trust_domain: trust_domain.map(str::to_string),
        ..settings("mesh")
    }
}

const XFCC: &str = "By=spiffe://cluster.local/ns/broker/sa/crd-broker;Hash=0af1;URI=spiffe://cluster.local/ns/team-a/sa/web";
const L5D_TEAM_A: &str = "web.team-a.serviceaccount.identity.linkerd.cluster.local";
const L5D_TEAM_B: &str = "api.team-b.serviceaccount.identity.linkerd.cluster.local";

#[tokio::test]
async fn in_istio_xfcc_from_its_sidecar_is_believed_and_a_linkerd_header_is_a_forgery() {
    let fake = tenants().await;
    let broker = broker_with_access(&fake, in_mesh(Mesh::Istio, None)).await;
    // From the sidecar's address, 127.0.0.6: believed.
    let mut sidecar = connect_from(broker.addr, "127.0.0.6").await;
    let mut s = sidecar
        .subscribe(with("x-forwarded-client-cert", XFCC, &ff("team-a", "f")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    // A client's own element before the proxy's does not count.
    let forged = format!("URI=spiffe://cluster.local/ns/team-b/sa/api,{XFCC}");
    let status = sidecar
        .subscribe(with("x-forwarded-client-cert", &forged, &ff("team-b", "f")))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    // A pod without a sidecar, through Istio's PERMISSIVE port: Envoy drops its XFCC and
    // passes the rest, so an l5d-client-id is the client's own. Refused, even with XFCC.
    let status = sidecar
        .subscribe(with("l5d-client-id", L5D_TEAM_B, &ff("team-b", "f")))
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::Unauthenticated,
        "it sent l5d-client-id, which only linkerd's proxy sets, and this broker is in istio",
    );
    let mut both = with("x-forwarded-client-cert", XFCC, &ff("team-a", "f"));
    both.metadata_mut()
        .insert("l5d-client-id", L5D_TEAM_A.parse().unwrap());
    assert_eq!(
        sidecar.subscribe(both).await.unwrap_err().code(),
        Code::Unauthenticated
    );
    // Loopback is not Istio's sidecar: a port-forward or another container is not believed.
    let mut local = connect(broker.addr).await;
    let status = local
        .subscribe(with("x-forwarded-client-cert", XFCC, &ff("team-a", "f")))
        .await
        .unwrap_err();
    assert_status(&status, Code::Unauthenticated, "mesh headers are ignored");
    let m = metrics(broker.admin_addr.unwrap()).await;
    assert_eq!(
        get(
            &m,
            r#"crd_broker_identifications_total{source="mesh",result="forged"}"#
        ),
        2.0
    );
}

#[tokio::test]
async fn in_linkerd_its_proxys_client_id_is_believed_in_its_trust_domain_and_xfcc_is_a_forgery() {
    let fake = tenants().await;
    let broker = broker_with_access(&fake, in_mesh(Mesh::Linkerd, Some("cluster.local"))).await;
    // From Linkerd's proxy, on loopback: believed.
    let mut proxy = connect(broker.addr).await;
    let mut s = proxy
        .subscribe(with("l5d-client-id", L5D_TEAM_A, &ff("team-a", "f")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    assert_eq!(
        proxy
            .subscribe(with("l5d-client-id", L5D_TEAM_A, &ff("team-b", "f")))
            .await
            .unwrap_err()
            .code(),
        Code::PermissionDenied
    );
    // Another trust domain: not believed.
    let elsewhere = "web.team-a.serviceaccount.identity.linkerd.other.example";
    let status = proxy
        .subscribe(with("l5d-client-id", elsewhere, &ff("team-a", "f")))
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::Unauthenticated,
        "not \"cluster.local\" (--trust-domain)",
    );
    // Linkerd passes a client's own XFCC through: a forgery.
    let status = proxy
        .subscribe(with("x-forwarded-client-cert", XFCC, &ff("team-a", "f")))
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::Unauthenticated,
        "it sent x-forwarded-client-cert, which only istio's proxy sets",
    );
    // From anywhere else: ignored.
    let mut pod = connect_from(broker.addr, "127.0.0.2").await;
    let status = pod
        .subscribe(with("l5d-client-id", L5D_TEAM_A, &ff("team-a", "f")))
        .await
        .unwrap_err();
    assert_status(&status, Code::Unauthenticated, "mesh headers are ignored");
}

#[tokio::test]
async fn a_unix_socket_caller_is_local_and_reads_only_what_a_unix_grant_gives() {
    let fake = tenants().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broker.sock");
    let (_p, policy) = policy_file("grants:\n  - from: \"unix:*\"\n    read: [shared]\n");
    let listeners = crd_broker::broker::Listeners {
        tcp: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()),
        unix: Some((tokio::net::UnixListener::bind(&path).unwrap(), path.clone())),
        ..Default::default()
    };
    let config = crd_broker::broker::Config {
        access: Settings {
            policy: Some(policy),
            ..settings("peer-pod")
        },
        ..Default::default()
    };
    let _broker = broker_with(&fake, listeners, config, vec![]);
    let mut local = connect_unix(&path).await;
    let mut s = subscribe(&mut local, &[&ff("shared", "f")]).await;
    assert_eq!(next(&mut s).await.event(), Event::Snapshot);
    let denied = refusal(&mut local, &ff("team-a", "f")).await;
    assert_eq!(denied.code(), Code::PermissionDenied);
    assert!(denied.message().contains("unix:"), "{}", denied.message());
}

#[tokio::test]
async fn a_reloaded_policy_ends_streams_it_no_longer_allows_and_a_broken_one_changes_nothing() {
    let fake = tenants().await;
    let (_dir, policy) = policy_file(SHARED_FOR_TEAM_B);
    let broker = broker_with_access(
        &fake,
        Settings {
            policy: Some(policy.clone()),
            policy_reload_interval: Duration::from_millis(100),
            ..settings("peer-pod")
        },
    )
    .await;
    let mut b = connect_from(broker.addr, "127.0.0.3").await;
    let mut shared = subscribe(&mut b, &[&ff("shared", "f")]).await;
    next(&mut shared).await;
    let mut own = subscribe(&mut b, &[&ff("team-b", "f")]).await;
    next(&mut own).await;

    rewrite(&policy, "grants: []\n");
    let revoked = ended(&mut shared).await;
    assert_status(&revoked, Code::PermissionDenied, "the policy changed");
    assert_eq!(
        refusal(&mut b, &ff("shared", "f")).await.code(),
        Code::PermissionDenied
    );

    // A policy that does not parse is refused and the one in force stays.
    rewrite(
        &policy,
        "grants:\n  - from: Not_A_Namespace\n    read: [shared]\n",
    );
    let admin = broker.admin_addr.unwrap();
    let refused = r#"crd_broker_policy_reloads_total{result="refused"}"#;
    let waited = tokio::time::timeout(WAIT, async {
        while get(&metrics(admin).await, refused) < 1.0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "the broken policy is seen and refused");
    assert_eq!(
        refusal(&mut b, &ff("shared", "f")).await.code(),
        Code::PermissionDenied
    );

    // Granted again: readable again, and the stream that was never revoked went on throughout.
    rewrite(&policy, SHARED_FOR_TEAM_B);
    let granted = tokio::time::timeout(WAIT, async {
        loop {
            if b.subscribe(request(&[&ff("shared", "f")])).await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(granted.is_ok());
    fake.merge_patch(GV, "featureflags", "team-b", "f", variant_patch("off"))
        .unwrap();
    assert!(is(&next(&mut own).await, Event::Updated, "off"));
}

#[tokio::test]
async fn cluster_scoped_kinds_are_readable_only_through_a_grant_of_every_namespace() {
    let fake = tenants().await;
    fake.install_crd(serde_json::json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": { "name": "widgets.example.com" },
        "spec": { "group": "example.com", "scope": "Cluster",
            "names": { "plural": "widgets", "kind": "Widget" },
            "versions": [{ "name": "v1", "served": true, "storage": true,
                "schema": { "openAPIV3Schema": { "type": "object", "x-kubernetes-preserve-unknown-fields": true } } }] }
    }))
    .unwrap();
    fake.apply(serde_json::json!({ "apiVersion": "example.com/v1", "kind": "Widget", "metadata": { "name": "w" } }))
        .unwrap();
    let (_dir, access) = with_policy(
        "peer-pod",
        "grants:\n  - from: team-b/api\n    read: [\"*\"]\n    kinds: [widgets.example.com]\n",
    );
    let broker = broker_with_access(&fake, access).await;
    let mut a = connect_from(broker.addr, "127.0.0.2").await;
    let denied = refusal(&mut a, "widgets.example.com/w").await;
    assert_status(&denied, Code::PermissionDenied, "cluster-scoped");
    let mut b = connect_from(broker.addr, "127.0.0.3").await;
    let mut w = subscribe(&mut b, &["widgets.example.com/w"]).await;
    assert_eq!(next(&mut w).await.event(), Event::Snapshot);
    // The grant covers widgets only: team-b's api may not read FeatureFlags in team-a.
    assert_eq!(
        refusal(&mut b, &ff("team-a", "f")).await.code(),
        Code::PermissionDenied
    );
}

#[tokio::test]
async fn readiness_needs_the_rights_the_identity_sources_use() {
    let fake = tenants().await;
    fake.deny(fake_apiserver::Deny {
        verb: Some("create".into()),
        resource: Some("tokenreviews".into()),
        ..Default::default()
    });
    let mut config = crd_broker::broker::Config {
        access: settings("peer-pod,token"),
        readiness_interval: Duration::from_millis(100),
        ..Default::default()
    };
    config.linger = Duration::ZERO;
    let listeners = with_admin().await;
    let broker = broker_with(&fake, listeners, config, vec![]);
    let admin = broker.admin_addr.unwrap();
    let readyz = || http_get(admin, "/readyz");
    let not_ready = tokio::time::timeout(WAIT, async {
        loop {
            let (code, body) = readyz().await;
            if code == 503 && body.contains("--identity token") {
                return body;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("not ready while the broker may not review tokens");
    assert!(
        not_ready.contains("may not create tokenreviews.authentication.k8s.io"),
        "{not_ready}"
    );
    // The other source's right, alone.
    fake.clear_faults();
    fake.deny(fake_apiserver::Deny {
        verb: Some("list".into()),
        resource: Some("pods".into()),
        ..Default::default()
    });
    let not_ready = tokio::time::timeout(WAIT, async {
        loop {
            let (code, body) = readyz().await;
            if code == 503 && body.contains("--identity peer-pod") {
                return body;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("not ready while the broker may not list pods");
    assert!(not_ready.contains("may not list pods"), "{not_ready}");
    fake.clear_faults();
    let ready = tokio::time::timeout(WAIT, async {
        while readyz().await.0 != 200 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(ready.is_ok(), "ready once the right is granted");
}

#[tokio::test]
async fn a_set_across_every_namespace_needs_a_grant_that_reads_every_namespace() {
    let fake = tenants().await;
    let policy =
        "grants:\n  - from: team-b\n    read: [\"*\"]\n  - from: team-a\n    read: [shared]\n";
    let (_dir, access) = with_policy("peer-pod", policy);
    let broker = broker_with_access(&fake, access).await;
    let every = || {
        let target: crd_broker::selector::Target =
            "featureflags.core.openfeature.dev/*?labelSelector="
                .parse()
                .unwrap();
        crd_broker::cli::subscribe::request_for(&[target])
    };
    // Its own namespace and a granted one are not every namespace.
    let mut a = connect_from(broker.addr, "127.0.0.2").await;
    let denied = a.subscribe(every()).await.unwrap_err();
    assert_status(&denied, Code::PermissionDenied, "in every namespace");
    assert!(
        denied.message().contains("team-a/web"),
        "{}",
        denied.message()
    );

    let mut b = connect_from(broker.addr, "127.0.0.3").await;
    let mut s = b.subscribe(every()).await.unwrap().into_inner();
    let mut members = Vec::new();
    loop {
        let r = next(&mut s).await;
        if r.event() == Event::Synced {
            break;
        }
        assert_eq!(r.event(), Event::Snapshot);
        members.push(r.selector);
    }
    assert_eq!(
        members,
        ["shared", "team-a", "team-b"]
            .map(|ns| format!("featureflags.v1beta1.core.openfeature.dev/{ns}/f"))
    );
}

/// The broker's pod at 127.0.0.5, standing for its pod IP, with a FeatureFlag of its own
/// namespace (`flags/broker-secret`); the tenants besides. The broker listens on that address,
/// as in a pod; `settings` for its access layer, `admin` for its admin port.
async fn broker_in_its_pod(
    settings: Settings,
    admin: crd_broker::access::admin::Settings,
) -> (
    fake_apiserver::FakeApiServer,
    crd_broker::broker::Running<crd_broker::source::kubernetes::Kubernetes>,
) {
    let fake = tenants().await;
    run_pod(&fake, "flags", "broker", "crd-broker", "127.0.0.5");
    fake.apply(flag_in("flags", "broker-secret", "on")).unwrap();
    let listeners = crd_broker::broker::Listeners {
        tcp: Some(tokio::net::TcpListener::bind("127.0.0.5:0").await.unwrap()),
        admin: Some(tokio::net::TcpListener::bind("127.0.0.5:0").await.unwrap()),
        ..Default::default()
    };
    let config = crd_broker::broker::Config {
        linger: Duration::ZERO,
        access: settings,
        admin,
        ..Default::default()
    };
    let broker = broker_with(&fake, listeners, config, vec![]);
    (fake, broker)
}

/// Linkerd's proxy (since 2.11) connects to the pod's own IP without binding a source address,
/// so the kernel gives the connection the pod's IP at both ends. A forwarder whose outgoing
/// socket is bound to the broker's address stands for it: through it, a caller from anywhere is
/// not the broker's own pod, and reads nothing of the broker's namespace.
#[tokio::test]
async fn a_caller_delivered_from_the_brokers_own_address_is_not_the_brokers_pod() {
    for identity in ["peer-pod", "peer-pod,token"] {
        let (fake, broker) = broker_in_its_pod(settings(identity), Default::default()).await;
        fake.register_token(
            TokenUser::service_account("evil", "evil", "app").with_audiences(&["crd-broker"]),
        );
        let proxy = forwarder("127.0.0.5", broker.addr).await;
        let mut c = connect(proxy).await;
        let status = refusal(&mut c, &ff("flags", "broker-secret")).await;
        assert_status(
            &status,
            Code::Unauthenticated,
            "the connection comes from the broker's own address (127.0.0.5)",
        );
        if identity.contains("token") {
            // With a token, the caller is who the token says, and reads its own namespace only.
            let status = c
                .subscribe(with(
                    "authorization",
                    "Bearer evil",
                    &ff("flags", "broker-secret"),
                ))
                .await
                .unwrap_err();
            assert_status(&status, Code::PermissionDenied, "evil/app may not read");
        }
        // The pod that really is at an address of its own is still itself.
        let mut a = connect_from(broker.addr, "127.0.0.2").await;
        let mut own = subscribe(&mut a, &[&ff("team-a", "f")]).await;
        assert!(
            is(&next(&mut own).await, Event::Snapshot, "on"),
            "{identity}"
        );
    }
}

/// With `--mesh linkerd`, a connection from the broker's own address is Linkerd's proxy, whose
/// `l5d-client-id` is believed; Istio's sidecar never delivers so, and is not taken for one.
#[tokio::test]
async fn in_linkerd_the_proxy_delivering_from_the_pods_own_ip_is_believed() {
    let (_fake, broker) = broker_in_its_pod(
        in_mesh(Mesh::Linkerd, Some("cluster.local")),
        Default::default(),
    )
    .await;
    let proxy = forwarder("127.0.0.5", broker.addr).await;
    let mut c = connect(proxy).await;
    let mut s = c
        .subscribe(with("l5d-client-id", L5D_TEAM_A, &ff("team-a", "f")))
        .await
        .unwrap()
        .into_inner();
    assert!(is(&next(&mut s).await, Event::Snapshot, "on"));
    let status = c
        .subscribe(with(
            "l5d-client-id",
            L5D_TEAM_A,
            &ff("flags", "broker-secret"),
        ))
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        Code::PermissionDenied,
        "{}",
        status.message()
    );

    let (_fake, broker) = broker_in_its_pod(in_mesh(Mesh::Istio, None), Default::default()).await;
    let proxy = forwarder("127.0.0.5", broker.addr).await;
    let mut c = connect(proxy).await;
    let status = c
        .subscribe(with("x-forwarded-client-cert", XFCC, &ff("team-a", "f")))
        .await
        .unwrap_err();
    assert_status(&status, Code::Unauthenticated, "mesh headers are ignored");
}

/// The admin port's debug endpoints: a caller delivered from the pod's own IP to itself is not
/// the pod's own, so with `--admin-auth kubernetes` it needs a token.
#[tokio::test]
async fn the_admin_guard_does_not_take_a_caller_from_the_pods_own_ip_for_the_pod() {
    use crd_broker::access::admin::{AdminAuth, Settings as Guard};
    let guard = Guard {
        admin_auth: AdminAuth::Kubernetes,
        ..Guard::default()
    };
    let (_fake, broker) = broker_in_its_pod(settings("peer-pod"), guard).await;
    let admin = broker.admin_addr.unwrap();
    let proxy = forwarder("127.0.0.5", admin).await;
    let (status, body) = http_get(proxy, "/debug/callers").await;
    assert_eq!(status, 401, "{body}");
    assert!(
        body.contains("needs `authorization: Bearer <token>`"),
        "{body}"
    );
    // Probes stay open.
    assert_eq!(http_get(proxy, "/livez").await.0, 200);
}
