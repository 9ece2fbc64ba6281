//! The real OpenFeature flagd provider (Python, in-process resolver) against the broker on the
//! fake API server: ready, boolean and targeted string flags, changes within 1 s, delete and
//! re-create, recovery after a broker restart, ten providers sharing one watch, and the broker's
//! `--context-value`s taken as evaluation context. The provider runs from the virtualenv the
//! README's test command makes (`.venv`, or `$CRD_BROKER_PYTHON`).

mod support;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use support::*;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

fn python() -> PathBuf {
    python_with("openfeature.contrib.provider.flagd")
}

#[tokio::test]
async fn the_python_flagd_provider_works_unchanged_against_the_broker() {
    let python = python();
    let Harness { fake, broker } = start(Duration::from_secs(30)).await;
    fake.apply(demo_manifest()).unwrap();
    let addr = broker.addr;
    let mut broker = Some(broker);

    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/flagd_provider_check.py"
    );
    let mut child = tokio::process::Command::new(python)
        .arg(script)
        .arg(fake.url())
        .env("FLAGD_RESOLVER", "in-process")
        .env("FLAGD_HOST", "127.0.0.1")
        .env("FLAGD_SYNC_PORT", addr.port().to_string())
        .env("FLAGD_SOURCE_SELECTOR", "core.openfeature.dev/default/demo")
        // Reconnect within a second instead of five, and go STALE→ERROR quickly: the defaults
        // would only make the restart step slower.
        .env("FLAGD_RETRY_BACKOFF_MAX_MS", "1000")
        .env("FLAGD_RETRY_GRACE_PERIOD", "2")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .expect("python runs");
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut stderr = child.stderr.take().unwrap();

    let summary = loop {
        let line = tokio::time::timeout(Duration::from_secs(120), stdout.next_line())
            .await
            .expect("the check moves on");
        let Some(line) = line.unwrap() else {
            let mut err = String::new();
            stderr.read_to_string(&mut err).await.ok();
            panic!("the provider check failed:\n{err}");
        };
        if let Some(n) = line.strip_prefix("CHECK WATCHES ") {
            let subscribers: usize = n.parse().unwrap();
            let registry = &broker.as_ref().unwrap().registry;
            let settled = tokio::time::timeout(WAIT, async {
                loop {
                    let watches = registry.watches();
                    if watches.len() == 1 && watches[0].subscribers >= subscribers {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
            .await;
            assert!(
                settled.is_ok(),
                "{subscribers} providers on one watch: {:?}",
                registry.watches()
            );
            assert_eq!(
                fake.open_watches_on(NS_PATH, Some("metadata.name=demo")),
                1,
                "one watch on the API server"
            );
            assert_eq!(fake.open_watches(), 1);
            stdin.write_all(b"OK\n").await.unwrap();
        } else if line == "RESTART" {
            broker.take().unwrap().stop().await.unwrap();
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .expect("the same port again");
            let restarted = broker_at(&fake, listener, Duration::from_secs(30));
            broker = Some(restarted);
            stdin.write_all(b"OK\n").await.unwrap();
        } else if line.starts_with('{') {
            break serde_json::from_str::<Value>(&line).unwrap();
        }
    };
    let status = child.wait().await.unwrap();
    assert!(status.success());
    println!("provider check: {summary}");
    assert!(summary["patch_to_evaluation_seconds"].as_f64().unwrap() < 1.0);
}

/// Runs the tenancy check in `mode` with the provider pointed at `port` for `selector`.
async fn tenancy_check(mode: &str, port: u16, selector: &str) -> Value {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/flagd_tenancy_check.py"
    );
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(python())
            .arg(script)
            .arg(mode)
            .env("FLAGD_RESOLVER", "in-process")
            .env("FLAGD_HOST", "127.0.0.1")
            .env("FLAGD_SYNC_PORT", port.to_string())
            .env("FLAGD_SOURCE_SELECTOR", selector)
            .env("FLAGD_RETRY_BACKOFF_MAX_MS", "500")
            .kill_on_drop(true)
            .leashed()
            .output(),
    )
    .await
    .expect("the check ends by itself")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{mode}: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap()
}

#[tokio::test]
async fn the_python_provider_unchanged_reads_its_namespace_and_is_refused_another() {
    let fake = fake().await;
    run_pod(&fake, "team-a", "web-1", "web", "127.0.0.2");
    for ns in ["team-a", "team-b"] {
        let mut demo = demo_manifest();
        demo["metadata"]["namespace"] = ns.into();
        fake.apply(demo).unwrap();
    }
    let broker = broker_with_access(
        &fake,
        crd_broker::access::Settings {
            identity: "peer-pod".parse().unwrap(),
            ..Default::default()
        },
    )
    .await;
    // The provider connects to 127.0.0.1; the forwarder makes it the pod at 127.0.0.2.
    let pod = forwarder("127.0.0.2", broker.addr).await;
    let allowed = tenancy_check("allowed", pod.port(), "core.openfeature.dev/team-a/demo").await;
    println!("allowed: {allowed}");
    let refused = tenancy_check("refused", pod.port(), "core.openfeature.dev/team-b/demo").await;
    println!("refused: {refused}");
    let why = refused["refusal"].as_str().unwrap_or_default();
    assert!(
        why.contains("PERMISSION_DENIED")
            && why.contains("team-a/web (pod web-1) may not read featureflags.core.openfeature.dev in namespace team-b"),
        "the provider was told why: {why}"
    );
    let team_b = "/apis/core.openfeature.dev/v1beta1/namespaces/team-b/featureflags";
    assert_eq!(
        fake.request_count("watch", team_b) + fake.request_count("list", team_b),
        0,
        "refused before any watch of team-b"
    );
    let m = metrics(broker.admin_addr.unwrap()).await;
    assert!(get(&m, r#"crd_broker_denials_total{reason="namespace"}"#) >= 1.0);
}

#[tokio::test]
async fn the_python_provider_takes_the_brokers_context_values_as_evaluation_context() {
    // A flag targeted on `region`, which no evaluation passes: only the broker's
    // `--context-value region=eu-north`, sent as `sync_context`, can make it match.
    let targeted = || {
        let mut f = flag("demo", "off");
        f["spec"]["flagSpec"]["flags"]["f"]["targeting"] = serde_json::json!(
            { "if": [{ "==": [{ "var": "region" }, "eu-north"] }, "on", "off"] });
        f
    };
    let fake = fake().await;
    fake.apply(targeted()).unwrap();
    let config = crd_broker::broker::Config {
        flagd_context: vec![("region".into(), "eu-north".into())],
        ..Default::default()
    };
    let broker = broker_with(&fake, with_admin().await, config, vec![]);
    let selector = "core.openfeature.dev/default/demo";
    let mut provider = support::flagd::Provider::start(broker.addr, selector).await;
    let details = provider.details("f").await;
    assert_eq!(details[0], serde_json::json!(true), "{details}");
    assert_eq!(details[1], "on", "the targeted variant: {details}");
    // Without the value, the same flag evaluates to its default variant.
    let plain = start(Duration::from_secs(30)).await;
    plain.fake.apply(targeted()).unwrap();
    let mut provider = support::flagd::Provider::start(plain.broker.addr, selector).await;
    assert_eq!(provider.details("f").await[1], "off");
}

/// A loopback relay that reads the HTTP/2 frame headers passing through it: PING frames its
/// clients send (not acknowledgements) and GOAWAY frames the server sends.
struct FrameTap {
    address: std::net::SocketAddr,
    connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    pings: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    goaways: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

/// HTTP/2 frame types (RFC 9113, section 6).
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const ACK: u8 = 0x1;

impl FrameTap {
    async fn to(target: std::net::SocketAddr) -> FrameTap {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let pings = Arc::new(AtomicUsize::new(0));
        let goaways = Arc::new(AtomicUsize::new(0));
        let counts = (connections.clone(), pings.clone(), goaways.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                counts.0.fetch_add(1, Ordering::Relaxed);
                let server = tokio::net::TcpStream::connect(target).await.unwrap();
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let pings = counts.1.clone();
                tokio::spawn(tap(client_read, server_write, 24, move |kind, flags| {
                    if kind == PING && flags & ACK == 0 {
                        pings.fetch_add(1, Ordering::Relaxed);
                    }
                }));
                let goaways = counts.2.clone();
                tokio::spawn(tap(server_read, client_write, 0, move |kind, _| {
                    if kind == GOAWAY {
                        goaways.fetch_add(1, Ordering::Relaxed);
                    }
                }));
            }
        });
        FrameTap {
            address,
            connections,
            pings,
            goaways,
            task,
        }
    }

    fn count(n: &std::sync::atomic::AtomicUsize) -> usize {
        n.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for FrameTap {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to`, calling `frame` with each frame's type and flags after the first
/// `preface` bytes (the client's connection preface).
async fn tap(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    preface: usize,
    mut frame: impl FnMut(u8, u8) + Send + 'static,
) {
    let (mut pending, mut skip, mut buf) = (Vec::new(), preface, vec![0u8; 16 * 1024]);
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
        pending.extend_from_slice(&buf[..n]);
        let taken = skip.min(pending.len());
        pending.drain(..taken);
        skip -= taken;
        while pending.len() >= 9 {
            let length = u32::from_be_bytes([0, pending[0], pending[1], pending[2]]) as usize;
            if pending.len() < 9 + length {
                break;
            }
            frame(pending[3], pending[4]);
            pending.drain(..9 + length);
        }
    }
    let _ = to.shutdown().await;
}

/// flagd#1999: grpc-go servers' default keepalive enforcement (a ping at most every 5 minutes)
/// cut the Go provider, which pings every 30 s with `PermitWithoutStream`, every 60–90 s with
/// GOAWAY ENHANCE_YOUR_CALM. grpc-go's own client, configured as that provider is, holds one
/// idle SyncFlags stream for five minutes; the broker's own pings are off here, so that the
/// client's are the only traffic.
#[tokio::test]
async fn grpc_gos_30_s_keepalive_pings_keep_an_idle_sync_stream_for_five_minutes() {
    use prost::Message;
    let fake = fake().await;
    fake.apply(demo_manifest()).unwrap();
    let mut config = crd_broker::broker::Config::default();
    config.transport.keepalive_interval = None;
    let broker = broker_with(&fake, with_admin().await, config, vec![]);
    let tap = FrameTap::to(broker.addr).await;
    let request = crd_broker::pb::flagd::SyncFlagsRequest {
        provider_id: "go".into(),
        selector: "core.openfeature.dev/default/demo".into(),
    };
    let hex: String = request
        .encode_to_vec()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut child = tokio::process::Command::new(peer("grpc-go"))
        .args([&format!("dns:///{}", tap.address), "1", &hex, "0"])
        .env("GRPC_GO_METHOD", "/flagd.sync.v1.FlagSyncService/SyncFlags")
        .env("GRPC_GO_KEEPALIVE_MS", "30000")
        .env("GRPC_GO_SAY_MESSAGES", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // The next line the client prints within `within`, if any.
    let mut next = async |within: Duration| -> Option<Value> {
        let line = tokio::time::timeout(within, lines.next_line()).await.ok()?;
        Some(serde_json::from_str(&line.unwrap().expect("the client runs")).unwrap())
    };
    // "started" and the flags, in either order.
    let mut first = [next(WAIT).await, next(WAIT).await];
    first.sort_by_key(|line| line.as_ref().is_some_and(|l| l.get("message").is_some()));
    assert_eq!(first[0], Some(serde_json::json!({ "started": 1 })));
    assert!(
        first[1].as_ref().unwrap()["message"].as_u64().unwrap() > 0,
        "the flags"
    );

    // Five minutes with nothing to say: the client's pings are the only traffic.
    let quiet = next(Duration::from_secs(300)).await;
    assert_eq!(quiet, None, "nothing in five minutes, no end");
    let pings = FrameTap::count(&tap.pings);
    eprintln!("the client pinged {pings} times in five minutes");
    assert!((9..=11).contains(&pings), "a ping every 30 s: {pings}");
    assert_eq!(FrameTap::count(&tap.goaways), 0, "no GOAWAY");
    assert_eq!(
        FrameTap::count(&tap.connections),
        1,
        "one connection throughout"
    );

    // The stream still carries changes.
    fake.merge_patch(
        GV,
        "featureflags",
        "default",
        "demo",
        serde_json::json!({ "spec": { "flagSpec": { "flags": { "new-checkout": { "defaultVariant": "on" } } } } }),
    )
    .unwrap();
    let edit = next(WAIT).await.expect("the edit in time");
    assert!(edit["message"].as_u64().unwrap() > 0, "the edit: {edit}");
    assert_eq!(FrameTap::count(&tap.connections), 1);
    drop(child.stdin.take());
    let _ = child.kill().await;
}
