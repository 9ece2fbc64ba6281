//! The `fake-apiserver` binary: flags, the printed URL, the kubeconfig it writes, and every
//! knob and introspection endpoint under `/fake/`.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use control_plane::Leash;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

struct Process {
    child: tokio::process::Child,
    url: String,
    addr: SocketAddr,
    kubeconfig: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

async fn spawn() -> Process {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    let crd = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/manifests/featureflag-crd.yaml");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_fake-apiserver"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--bookmark-interval",
            "200ms",
            "--crd",
        ])
        .arg(crd)
        .arg("--kubeconfig-out")
        .arg(&kubeconfig)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .expect("the binary starts");
    let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    let url = tokio::time::timeout(Duration::from_secs(10), stdout.next_line())
        .await
        .expect("prints its URL within 10 s")
        .unwrap()
        .expect("a first line");
    let addr = url
        .trim_start_matches("http://")
        .parse()
        .expect("http://127.0.0.1:PORT");
    Process {
        child,
        url,
        addr,
        kubeconfig,
        _dir: dir,
    }
}

async fn knob(addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> Value {
    let r = raw_at(addr, method, path, body.map(|b| ("application/json", b))).await;
    assert_eq!(r.status, 200, "{method} {path}: {}", r.body);
    r.json()
}

#[tokio::test]
async fn binary_prints_url_writes_kubeconfig_and_serves_knobs() {
    let mut p = spawn().await;
    assert!(p.url.starts_with("http://127.0.0.1:"));
    let text = std::fs::read_to_string(&p.kubeconfig).unwrap();
    assert!(text.contains(&format!("server: {}", p.url)), "{text}");

    // The kubeconfig works for kube-rs, and the CRD from --crd is served.
    let kubeconfig = kube::config::Kubeconfig::read_from(&p.kubeconfig).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let api: Api<DynamicObject> = featureflags(&client, "default");
    api.create(&PostParams::default(), &dynamic(flag("default", "b", "on")))
        .await
        .unwrap();

    // Introspection.
    let path = format!(
        "{NS_PATH}?watch=true&allowWatchBookmarks=true&fieldSelector=metadata.name%3Db&resourceVersion=0"
    );
    let mut lines = Lines::open_at(p.addr, &path).await;
    assert_eq!(lines.next().await.unwrap()["type"], "ADDED");
    let watches = knob(p.addr, "GET", "/fake/watches", None).await;
    assert_eq!(watches["open"], 1);
    assert_eq!(watches["watches"][0]["fieldSelector"], "metadata.name=b");
    let bookmark = lines
        .next_within(Duration::from_secs(2))
        .await
        .expect("periodic bookmark")
        .unwrap();
    assert_eq!(
        bookmark["type"], "BOOKMARK",
        "--bookmark-interval is honoured"
    );
    let counts = knob(p.addr, "GET", "/fake/counts", None).await;
    assert!(
        counts
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["verb"] == "watch" && c["count"] == 1),
        "{counts}"
    );
    let requests = knob(p.addr, "GET", "/fake/requests", None).await;
    assert!(
        requests
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["method"] == "POST")
    );
    let state = knob(p.addr, "GET", "/fake/state", None).await;
    assert!(state["resourceVersion"].as_u64().unwrap() > 100);

    // Watch knobs: error, close, abort.
    knob(p.addr, "POST", "/fake/watches/error?code=410", None).await;
    let error = lines.next().await.unwrap();
    assert_eq!(
        (error["type"].as_str(), error["object"]["code"].as_u64()),
        (Some("ERROR"), Some(410))
    );
    assert_eq!(lines.next().await.unwrap_err(), End::Clean);
    let mut lines = Lines::open_at(p.addr, &format!("{NS_PATH}?watch=true")).await;
    lines.next().await.unwrap();
    knob(p.addr, "POST", "/fake/watches/abort", None).await;
    assert_eq!(lines.next().await.unwrap_err(), End::Aborted);
    let mut lines = Lines::open_at(p.addr, &format!("{NS_PATH}?watch=true")).await;
    lines.next().await.unwrap();
    knob(p.addr, "POST", "/fake/watches/close", None).await;
    assert_eq!(lines.next().await.unwrap_err(), End::Clean);

    // Stall holds output; release lets it through.
    let mut lines = Lines::open_at(
        p.addr,
        &format!(
            "{NS_PATH}?watch=true&resourceVersion={}",
            state["resourceVersion"]
        ),
    )
    .await;
    knob(p.addr, "POST", "/fake/watches/stall?on=true", None).await;
    api.create(&PostParams::default(), &dynamic(flag("default", "c", "on")))
        .await
        .unwrap();
    assert!(
        lines
            .next_within(Duration::from_millis(500))
            .await
            .is_none(),
        "stalled"
    );
    knob(p.addr, "POST", "/fake/watches/stall?on=false", None).await;
    assert_eq!(
        lines
            .next_within(Duration::from_secs(2))
            .await
            .unwrap()
            .unwrap()["type"],
        "ADDED"
    );

    // Compaction and history limit.
    knob(p.addr, "POST", "/fake/compact", None).await;
    let mut old =
        Lines::open_at(p.addr, &format!("{NS_PATH}?watch=true&resourceVersion=101")).await;
    assert_eq!(old.next().await.unwrap()["object"]["reason"], "Expired");
    knob(p.addr, "POST", "/fake/history?limit=5", None).await;

    // Injected statuses, hangs, denials; then cleared.
    knob(
        p.addr,
        "POST",
        "/fake/inject",
        Some(
            json!({ "verb": "list", "times": 1, "action": "status", "code": 503, "retryAfter": 2 }),
        ),
    )
    .await;
    let r = raw_at(p.addr, "GET", NS_PATH, None).await;
    assert_eq!(
        (r.status, r.headers["retry-after"].to_str().unwrap()),
        (503, "2")
    );
    assert_eq!(
        raw_at(p.addr, "GET", NS_PATH, None).await.status,
        200,
        "only the next one"
    );
    knob(
        p.addr,
        "POST",
        "/fake/inject",
        Some(json!({ "verb": "get", "times": 1, "action": "hang" })),
    )
    .await;
    let hung = tokio::time::timeout(
        Duration::from_millis(300),
        raw_at(p.addr, "GET", &format!("{NS_PATH}/b"), None),
    )
    .await;
    assert!(hung.is_err(), "the request hangs");
    knob(
        p.addr,
        "POST",
        "/fake/deny",
        Some(json!({ "verb": "list", "resource": "featureflags" })),
    )
    .await;
    let err = api.list(&ListParams::default()).await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 403),
        "{err:?}"
    );
    knob(p.addr, "DELETE", "/fake/faults", None).await;
    api.list(&ListParams::default())
        .await
        .expect("allowed again");

    // Tokens for TokenReview.
    knob(p.addr, "POST", "/fake/tokens", Some(json!({ "token": "t1", "username": "system:serviceaccount:a:b", "groups": ["system:serviceaccounts"] }))).await;
    let review = raw_at(p.addr, "POST", "/apis/authentication.k8s.io/v1/tokenreviews", Some(("application/json", json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": { "token": "t1" }
    })))).await;
    assert_eq!(review.status, 201);
    assert_eq!(
        review.json()["status"]["user"]["username"],
        "system:serviceaccount:a:b"
    );

    // Restart: down (refused), then back on the same port with the data.
    knob(p.addr, "POST", "/fake/restart?downMs=400", None).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(
        tokio::net::TcpStream::connect(p.addr).await.is_err(),
        "down"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        api.get("b").await.unwrap().metadata.name.as_deref(),
        Some("b")
    );

    // Bad knob requests are plain errors.
    assert_eq!(raw_at(p.addr, "POST", "/fake/nope", None).await.status, 404);
    assert_eq!(
        raw_at(
            p.addr,
            "POST",
            "/fake/inject",
            Some(("application/json", json!({ "times": "x" })))
        )
        .await
        .status,
        400
    );

    p.child.kill().await.unwrap();
}
