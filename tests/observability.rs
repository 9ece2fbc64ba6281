//! The observability assets with the real Prometheus (Debian's `prometheus` package, which the
//! README's test command installs): promtool checks the alert rules and runs their unit tests,
//! and a Prometheus scraping a broker under load (with a denial and failing API requests)
//! evaluates every dashboard expression and every alert's query, each of which must return data.

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crd_broker::pb::flagd;
use crd_broker::pb::flagd::flag_sync_service_client::FlagSyncServiceClient;
use serde_json::Value;
use support::*;
use tokio::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn alerts() -> PathBuf {
    Path::new(ROOT).join("helm/crd-broker/files/alerts.yaml")
}

fn dashboard() -> Value {
    let path = Path::new(ROOT).join("helm/crd-broker/files/dashboard.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A Debian Prometheus binary, or a failure saying how to get it.
fn binary(name: &str) -> String {
    let found = std::process::Command::new(name)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "{name} is needed: run the README's test command (scripts/test), which installs Debian's prometheus package"
    );
    name.to_string()
}

#[test]
fn promtool_checks_the_alert_rules_and_their_unit_tests_pass() {
    for args in [
        vec![
            "check".to_string(),
            "rules".into(),
            alerts().display().to_string(),
        ],
        vec![
            "test".to_string(),
            "rules".into(),
            Path::new(ROOT)
                .join("tests/prometheus/alerts_test.yaml")
                .display()
                .to_string(),
        ],
    ] {
        let out = std::process::Command::new(binary("promtool"))
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Every expression the dashboard's panels query.
fn dashboard_queries(dashboard: &Value) -> Vec<String> {
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(target["expr"].as_str().unwrap().to_string());
        }
    }
    queries
}

/// The query of each alert: its expression without the comparison with a threshold (which
/// holds only while it fires), and the whole expression.
fn alert_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(alerts()).unwrap();
    let rules: Value = crd_broker::yaml::from_str(&text).unwrap();
    rules["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter())
        .map(|rule| {
            let expr = rule["expr"].as_str().unwrap().trim().to_string();
            let query = without_threshold(&expr).unwrap_or_else(|| {
                panic!(
                    "{}: write the expression as <query> <comparison> <threshold>: {expr}",
                    rule["alert"]
                )
            });
            (query, expr)
        })
        .collect()
}

/// `query` of `query <comparison> <number>`.
fn without_threshold(expr: &str) -> Option<String> {
    let (head, threshold) = expr.rsplit_once(' ')?;
    threshold.parse::<f64>().ok()?;
    let (query, op) = head.trim_end().rsplit_once(' ')?;
    ["<", ">", "<=", ">=", "==", "!="]
        .contains(&op)
        .then(|| query.trim_end().to_string())
}

/// Grafana's variables as a dashboard user would have them: every pod, a one-minute rate.
fn substituted(query: &str) -> String {
    let q = query
        .replace("$__rate_interval", "1m")
        .replace("$pod", ".*");
    assert!(
        !q.contains('$'),
        "a variable the test does not know: {query}"
    );
    q
}

fn percent_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A GET to Prometheus's HTTP API over HTTP/1.0 (so the answer is not chunked); its JSON.
async fn api(addr: SocketAddr, path: &str) -> Value {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {response}"))
}

async fn query(addr: SocketAddr, promql: &str) -> Value {
    api(
        addr,
        &format!("/api/v1/query?query={}", percent_encoded(promql)),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_and_alert_query_returns_data_from_a_broker_under_load() {
    let prometheus = binary("prometheus");
    let (fake, dir, kubeconfig) = fake_with_kubeconfig().await;
    for k in 0..20 {
        fake.apply(flag(&format!("ff-{k}"), "on")).unwrap();
    }
    // The subscribers' pod, for --identity peer-pod.
    run_pod(&fake, "default", "app", "app", "127.0.0.2");
    let (grpc, admin, web) = (free_port(), free_port(), free_port());
    let _broker = Command::new(env!("CARGO_BIN_EXE_crd-broker"))
        .args(["serve", "--grpc-addr", &format!("127.0.0.1:{grpc}")])
        .args(["--admin-addr", &format!("127.0.0.1:{admin}")])
        .args(["--resource", "featureflags.core.openfeature.dev"])
        .args(["--identity", "peer-pod", "--readiness-interval", "200ms"])
        .env("KUBECONFIG", &kubeconfig)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global: {{ scrape_interval: 1s, evaluation_interval: 1s }}\n\
             rule_files: [{:?}]\n\
             scrape_configs:\n  - job_name: crd-broker\n    static_configs: [{{ targets: ['127.0.0.1:{admin}'] }}]\n",
            alerts().display().to_string()
        ),
    )
    .unwrap();
    let _prometheus = Command::new(prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{web}"))
        .arg("--log.level=warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .unwrap();
    let grpc: SocketAddr = ([127, 0, 0, 1], grpc).into();
    let web: SocketAddr = ([127, 0, 0, 1], web).into();
    eventually("the broker serves", Duration::from_secs(20), async || {
        tokio::net::TcpStream::connect(grpc).await.is_ok()
    })
    .await;

    // Load: native streams on every CR and flagd streams, from the pod.
    let mut native = connect_from(grpc, "127.0.0.2").await;
    let names: Vec<String> = (0..20).map(|k| demo(&format!("ff-{k}"))).collect();
    let selectors: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut streams = Vec::new();
    for _ in 0..5 {
        let mut s = subscribe(&mut native, &selectors).await;
        for _ in 0..20 {
            next(&mut s).await;
        }
        streams.push(s);
    }
    let mut flagd = FlagSyncServiceClient::new(support::channel_from(grpc, "127.0.0.2").await);
    let mut syncs = Vec::new();
    for k in 0..5 {
        let mut s = flagd
            .sync_flags(flagd::SyncFlagsRequest {
                provider_id: String::new(),
                selector: format!("core.openfeature.dev/default/ff-{k}"),
            })
            .await
            .unwrap()
            .into_inner();
        s.message().await.unwrap();
        syncs.push(s);
    }
    // A denial, and API requests that fail.
    let denied = native
        .subscribe(request(&[&ff("elsewhere", "x")]))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied);
    fake.fail_next(fake_apiserver::Matcher::verb("list"), 1, 500, None);
    fake.apply(flag("late", "on")).unwrap();
    let _late = subscribe(&mut native, &[&demo("late")]).await;
    // Changes, for ten seconds of scrapes.
    for round in 0..50 {
        let variant = if (round / 20) % 2 == 0 { "off" } else { "on" };
        let name = format!("ff-{}", round % 20);
        fake.merge_patch(GV, "featureflags", "default", &name, variant_patch(variant))
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eventually(
        "ten scrapes of the broker",
        Duration::from_secs(30),
        async || {
            let r = query(web, "count_over_time(up{job=\"crd-broker\"}[1m])").await;
            r["data"]["result"][0]["value"][1]
                .as_str()
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(|n| n >= 10.0)
        },
    )
    .await;

    let mut empty = Vec::new();
    let dashboard = dashboard();
    let queries = dashboard_queries(&dashboard);
    assert!(queries.len() >= 20, "{} dashboard queries", queries.len());
    let alerts = alert_queries();
    assert!(alerts.len() >= 4, "{} alerts", alerts.len());
    for promql in queries
        .iter()
        .map(|q| substituted(q))
        .chain(alerts.iter().map(|(q, _)| q.clone()))
    {
        let answer = query(web, &promql).await;
        assert_eq!(answer["status"], "success", "{promql}: {answer}");
        let result = answer["data"]["result"].as_array().unwrap();
        if result.is_empty() {
            empty.push(promql);
        }
    }
    assert!(empty.is_empty(), "queries with no data: {empty:#?}");
    // The whole alert expressions are valid too, and Prometheus evaluates every rule cleanly.
    for (_, expr) in &alerts {
        assert_eq!(query(web, expr).await["status"], "success", "{expr}");
    }
    let rules = api(web, "/api/v1/rules").await;
    let loaded: Vec<&Value> = rules["data"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter())
        .collect();
    assert_eq!(loaded.len(), alerts.len());
    assert!(loaded.iter().all(|r| r["health"] == "ok"), "{loaded:#?}");
    // The load the queries saw: updates delivered, the denial, the failed LIST.
    let m = metrics(([127, 0, 0, 1], admin).into()).await;
    assert!(
        get(
            &m,
            r#"crd_broker_updates_total{resource="featureflags.core.openfeature.dev"}"#
        ) >= 50.0
    );
    assert_eq!(
        get(&m, r#"crd_broker_denials_total{reason="namespace"}"#),
        1.0
    );
    assert!(
        get(
            &m,
            r#"crd_broker_api_requests_total{verb="list",code="500"}"#
        ) >= 1.0
    );
    assert_eq!(get(&m, "sync_active_streams"), 5.0);
    drop((streams, syncs));
}

#[tokio::test]
async fn every_family_is_on_metrics_from_the_start_even_without_resource() {
    let fake = fake().await;
    let listeners = with_admin().await;
    // No `--resource`: no kind is known until someone subscribes.
    let broker = broker_with(&fake, listeners, Default::default(), vec![]);
    let (_, text) = http_get(broker.admin_addr.unwrap(), "/metrics").await;
    for family in [
        "# TYPE crd_broker_watches gauge",
        "# TYPE crd_broker_watch_starts counter",
        "# TYPE crd_broker_watch_stops counter",
        "# TYPE crd_broker_watch_errors counter",
        "# TYPE crd_broker_updates counter",
        "# TYPE crd_broker_skipped_states counter",
        "# TYPE crd_broker_subscribers gauge",
        "# TYPE crd_broker_fanout_seconds histogram",
    ] {
        assert!(text.contains(family), "{family} in:\n{text}");
    }
}
