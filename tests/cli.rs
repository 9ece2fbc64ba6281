//! The `crd-broker` binary as users run it: `serve --manifests` and `subscribe`, with flags and
//! environment variables, text and JSON output, and clear errors.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

mod support;
use support::free_port;

const BIN: &str = env!("CARGO_BIN_EXE_crd-broker");
const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/manifests");

fn copy_examples(to: &Path) {
    for entry in std::fs::read_dir(EXAMPLES).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
    }
}

async fn serve(dir: &Path, port: u16) -> Child {
    // The address through the environment, the rest as flags.
    let child = Command::new(BIN)
        .args(["serve", "--manifests"])
        .arg(dir)
        .args([
            "--linger",
            "0s",
            "--manifests-poll",
            "50ms",
            "--admin-addr",
            "127.0.0.1:0",
        ])
        .env("CRD_BROKER_GRPC_ADDR", format!("127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("serve starts");
    let ready = tokio::time::timeout(Duration::from_secs(20), async {
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(ready.is_ok(), "serve listens on the port");
    child
}

fn subscribe(port: u16, args: &[&str]) -> (Child, Lines<BufReader<ChildStdout>>) {
    let mut child = Command::new(BIN)
        .arg("subscribe")
        .args(["--server", &format!("http://127.0.0.1:{port}")])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("subscribe starts");
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

async fn line(lines: &mut Lines<BufReader<ChildStdout>>) -> String {
    tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .expect("a line within 10 s")
        .unwrap()
        .expect("the subscriber is still running")
}

#[tokio::test]
async fn serve_manifests_and_subscribe_print_every_change() {
    let dir = tempfile::tempdir().unwrap();
    copy_examples(dir.path());
    let port = free_port();
    let _server = serve(dir.path(), port).await;

    let (_json_child, mut json_lines) = subscribe(
        port,
        &[
            "--output",
            "json",
            "featureflags.core.openfeature.dev/default/demo",
        ],
    );
    let first: Value = serde_json::from_str(&line(&mut json_lines).await).unwrap();
    assert_eq!(first["event"], "SNAPSHOT");
    assert_eq!(
        first["selector"],
        "featureflags.v1beta1.core.openfeature.dev/default/demo"
    );
    assert_eq!(
        first["object"]["spec"]["flagSpec"]["flags"]["new-checkout"]["defaultVariant"],
        "off"
    );
    assert!(!first["resourceVersion"].as_str().unwrap().is_empty());

    let (_text_child, mut text_lines) = subscribe(port, &["ff.core.openfeature.dev/default/demo"]);
    let header = line(&mut text_lines).await;
    assert!(
        header.starts_with("EVENT") && header.contains("SELECTOR"),
        "{header}"
    );
    let row = line(&mut text_lines).await;
    assert!(
        row.starts_with("SNAPSHOT ")
            && row.contains("featureflags.v1beta1.core.openfeature.dev/default/demo"),
        "{row}"
    );

    // Edit the manifest as the README's quickstart does.
    let path = dir.path().join("demo.yaml");
    let edited = std::fs::read_to_string(&path).unwrap().replacen(
        "defaultVariant: \"off\"",
        "defaultVariant: \"on\"",
        1,
    );
    std::fs::write(&path, edited).unwrap();
    let update: Value = serde_json::from_str(&line(&mut json_lines).await).unwrap();
    assert_eq!(update["event"], "UPDATED");
    assert_eq!(
        update["object"]["spec"]["flagSpec"]["flags"]["new-checkout"]["defaultVariant"],
        "on"
    );
    assert!(line(&mut text_lines).await.starts_with("UPDATED "));
}

#[tokio::test]
async fn subscribe_reports_bad_selectors_and_refusals_clearly() {
    let out = Command::new(BIN)
        .args(["subscribe", "featureflags/default/demo"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("group \"\" is missing"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    copy_examples(dir.path());
    let port = free_port();
    let _server = serve(dir.path(), port).await;
    let (child, _) = subscribe(port, &["nothings.example.com/default/x"]);
    let out = child.wait_with_output().await.unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("NotFound") || err.contains("not found") || err.contains("no CRD"),
        "{err}"
    );
}

#[tokio::test]
async fn serve_fails_clearly_on_a_missing_directory() {
    let out = Command::new(BIN)
        .args([
            "serve",
            "--manifests",
            "/nonexistent/manifests",
            "--grpc-addr",
            "127.0.0.1:0",
            "--admin-addr",
            "127.0.0.1:0",
        ])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("reading the manifests directory /nonexistent/manifests"),
        "{err}"
    );
}

#[tokio::test]
async fn json_logs_are_one_object_per_line() {
    let dir = tempfile::tempdir().unwrap();
    copy_examples(dir.path());
    let mut child = Command::new(BIN)
        .args(["--log-format", "json", "serve", "--manifests"])
        .arg(dir.path())
        .args(["--grpc-addr", "127.0.0.1:0", "--admin-addr", "none"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    while !seen.iter().any(|m| m == "crd-broker serving") && seen.len() < 5 {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .expect("a log line");
        let entry: Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            entry["level"].is_string() && entry["timestamp"].is_string(),
            "{entry}"
        );
        seen.push(
            entry["fields"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
    }
    assert!(seen.iter().any(|m| m == "crd-broker serving"), "{seen:?}");
    child.kill().await.unwrap();
}

/// Runs `crd-broker serve` with `args` on the example manifests (and `env`), expecting it to
/// refuse to start: its stderr.
async fn refused_at_start(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut command = Command::new(BIN);
    command
        .args(["serve", "--manifests", EXAMPLES])
        .args(["--grpc-addr", "127.0.0.1:0", "--admin-addr", "none"])
        .args(args)
        .stdin(Stdio::null());
    for (k, v) in env {
        command.env(k, v);
    }
    let out = tokio::time::timeout(Duration::from_secs(20), command.output())
        .await
        .expect("it exits by itself")
        .unwrap();
    assert!(!out.status.success(), "{args:?} started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test]
async fn access_settings_that_cannot_work_are_refused_at_start_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("policy.yaml");
    std::fs::write(
        &bad,
        "grants:\n  - from: team-a\n    read: [Not_A_Namespace]\n",
    )
    .unwrap();
    let bad = bad.to_str().unwrap();
    let good = dir.path().join("good.yaml");
    std::fs::write(&good, "grants: []\n").unwrap();
    let good = good.to_str().unwrap();
    type Env<'a> = Vec<(&'a str, &'a str)>;
    let cases: Vec<(Vec<&str>, Env, &str)> = vec![
        (
            vec!["--identity", "peer-pod"],
            vec![],
            "--identity peer-pod asks the Kubernetes API",
        ),
        (
            vec![],
            vec![("CRD_BROKER_IDENTITY", "mesh,token")],
            "--identity token asks the Kubernetes API",
        ),
        (
            vec!["--identity", "mtls"],
            vec![],
            "--identity mtls needs client certificates",
        ),
        (
            vec!["--identity", "mesh", "--policy", bad],
            vec![],
            "line 3",
        ),
        (
            vec!["--identity", "mesh"],
            vec![("CRD_BROKER_POLICY", bad)],
            "read \"Not_A_Namespace\"",
        ),
        (vec!["--policy", good], vec![], "--policy needs --identity"),
        (
            vec!["--identity", "pod-ip"],
            vec![],
            "unknown identity source \"pod-ip\"",
        ),
        (
            vec!["--identity", "none,mesh"],
            vec![],
            "`none` cannot be combined",
        ),
        (
            vec!["--namespace", "team-a"],
            vec![],
            "--namespace confines the Kubernetes source",
        ),
        (
            vec![],
            vec![("CRD_BROKER_NAMESPACE", "team-a,Team_B")],
            "\"Team_B\" is not a namespace name",
        ),
    ];
    for (args, env, want) in cases {
        let err = refused_at_start(&args, &env).await;
        assert!(err.contains(want), "{args:?} {env:?}: {err}");
    }
}
