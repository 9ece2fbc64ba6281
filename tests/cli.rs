//! The `crd-broker` binary as users run it: `serve --manifests` and `subscribe`, with flags and
//! environment variables, text and JSON output, and clear errors.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

mod support;
use support::{Leash, free_port};

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
    let mut command = Command::new(BIN);
    command
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
        .env("CRD_BROKER_GRPC_ADDR", format!("127.0.0.1:{port}"));
    listening(command, port).await
}

/// `serve` as `command` says, once it listens on `port`.
async fn listening(mut command: Command, port: u16) -> Child {
    let child = command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .leashed()
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

/// `crd-broker GLOBAL serve --manifests DIR` on 127.0.0.1:`port` with no admin server, for
/// the caller to add to and spawn.
fn serve_on(global: &[&str], dir: &Path, port: u16) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(global)
        .args(["serve", "--manifests"])
        .arg(dir)
        .args(["--grpc-addr", &format!("127.0.0.1:{port}")])
        .args(["--admin-addr", "none"]);
    command
}

fn subscribe(port: u16, args: &[&str]) -> (Child, Lines<BufReader<ChildStdout>>) {
    subscribe_to(&format!("http://127.0.0.1:{port}"), args)
}

/// `crd-broker subscribe --server SERVER ARGS`, and its output's lines.
fn subscribe_to(server: &str, args: &[&str]) -> (Child, Lines<BufReader<ChildStdout>>) {
    let mut child = Command::new(BIN)
        .args(["subscribe", "--server", server])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .leashed()
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

/// A broker that drains every connection after about a second, as a rollout or a replica's loss
/// ends streams: `subscribe` resumes with what it holds, and `--resume=false` exits.
#[tokio::test]
async fn subscribe_resumes_a_drained_stream_with_current_and_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    copy_examples(dir.path());
    let port = free_port();
    let mut serve = serve_on(&[], dir.path(), port);
    serve
        .args(["--manifests-poll", "50ms", "--max-connection-age", "1s"])
        .args(["--max-connection-age-grace", "0s"]);
    let _server = listening(serve, port).await;
    let demo = "featureflags.core.openfeature.dev/default/demo";
    let (mut child, mut lines) = subscribe(port, &["-o", "json", demo]);
    let first: Value = serde_json::from_str(&line(&mut lines).await).unwrap();
    assert_eq!(first["event"], "SNAPSHOT");
    let resumed: Value = serde_json::from_str(&line(&mut lines).await).unwrap();
    assert_eq!(resumed["event"], "CURRENT", "{resumed}");
    assert_eq!(resumed["resourceVersion"], first["resourceVersion"]);
    assert_eq!(resumed["object"], Value::Null, "no object");

    // An edit after a resume arrives as ever.
    let path = dir.path().join("demo.yaml");
    let edited = std::fs::read_to_string(&path).unwrap().replacen(
        "defaultVariant: \"off\"",
        "defaultVariant: \"on\"",
        1,
    );
    std::fs::write(&path, edited).unwrap();
    let updated = loop {
        let r: Value = serde_json::from_str(&line(&mut lines).await).unwrap();
        if r["event"] != "CURRENT" {
            break r;
        }
    };
    assert_eq!(updated["event"], "UPDATED", "{updated}");
    child.kill().await.unwrap();
    let mut stderr = String::new();
    tokio::io::AsyncReadExt::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr)
        .await
        .unwrap();
    assert!(stderr.contains("resuming in"), "{stderr}");

    // Without resuming, the drained stream ends the command with its status.
    let (child, mut lines) = subscribe(port, &["--resume=false", demo]);
    line(&mut lines).await;
    let out = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
        .await
        .expect("it exits after the drain")
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Unavailable"), "{err}");
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
    let port = free_port();
    let mut child = serve_on(&["--log-format", "json"], dir.path(), port)
        .args(["--linger", "0s"])
        .env("RUST_LOG", "info,crd_broker::registry=debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut next_entry = async || -> Value {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .expect("a log line");
        let entry: Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            entry["level"].is_string()
                && entry["timestamp"].is_string()
                && entry["target"].is_string(),
            "{entry}"
        );
        entry
    };
    let mut seen = Vec::new();
    while !seen.iter().any(|m| m == "crd-broker serving") && seen.len() < 5 {
        let entry = next_entry().await;
        // Fields are flat: the message and the event's fields at the top level.
        if entry["message"] == "crd-broker serving" {
            assert_eq!(entry["grpc"], format!("127.0.0.1:{port}"), "{entry}");
        }
        seen.push(entry["message"].as_str().unwrap_or_default().to_string());
    }
    assert!(seen.iter().any(|m| m == "crd-broker serving"), "{seen:?}");
    // An event inside a span carries the span's fields and the trace it belongs to.
    let (subscriber, mut out) =
        subscribe(port, &["featureflags.core.openfeature.dev/default/demo"]);
    line(&mut out).await;
    line(&mut out).await;
    drop((subscriber, out));
    let stopped = loop {
        let entry = next_entry().await;
        if entry["message"] == "watch stopped" {
            break entry;
        }
    };
    assert_eq!(stopped["span"], "watch", "{stopped}");
    assert_eq!(
        stopped["selector"], "featureflags.v1beta1.core.openfeature.dev/default/demo",
        "{stopped}"
    );
    let trace = stopped["trace_id"].as_str().unwrap_or_default();
    assert!(
        trace.len() == 32
            && trace.bytes().all(|b| b.is_ascii_hexdigit())
            && trace != "0".repeat(32),
        "a trace id: {stopped}"
    );
    assert_eq!(
        stopped["span_id"].as_str().map(str::len),
        Some(16),
        "{stopped}"
    );
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
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .leashed();
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
    let many_context_values = (0..65)
        .map(|n| format!("k{n}=v"))
        .collect::<Vec<_>>()
        .join(",");
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
            vec!["--identity", "mesh", "--mesh", "istio", "--policy", bad],
            vec![],
            "line 3",
        ),
        (
            vec!["--identity", "mesh"],
            vec![("CRD_BROKER_POLICY", bad), ("CRD_BROKER_MESH", "linkerd")],
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
        (
            vec!["--identity", "mesh"],
            vec![],
            "--identity mesh needs --mesh istio or --mesh linkerd",
        ),
        (
            vec!["--identity", "mesh", "--mesh", "consul"],
            vec![],
            "invalid value 'consul' for '--mesh <MESH>'",
        ),
        (
            vec!["--api-qps", "-1"],
            vec![],
            "\"-1\" is not a number of requests per second",
        ),
        (
            vec![],
            vec![("CRD_BROKER_API_QPS", "NaN")],
            "\"NaN\" is not a number of requests per second",
        ),
        (
            vec!["--api-burst", "5"],
            vec![],
            "--api-burst 5 needs --api-qps",
        ),
        (
            vec!["--context-value", "=eu"],
            vec![],
            "\"=eu\" is not KEY=VALUE",
        ),
        (
            vec![],
            vec![("CRD_BROKER_CONTEXT_VALUES", many_context_values.as_str())],
            "65 --context-values: at most 64",
        ),
    ];
    for (args, env, want) in cases {
        let err = refused_at_start(&args, &env).await;
        assert!(err.contains(want), "{args:?} {env:?}: {err}");
    }
}

/// `subscribe ARGS SELECTOR` against `server`; its output once `done` holds of it (or it
/// ended), and its stderr.
async fn subscribe_output(
    server: &str,
    args: &[&str],
    done: impl Fn(&[String]) -> bool,
) -> (Vec<String>, String) {
    let (mut child, mut out) = subscribe_to(server, args);
    let mut got = Vec::new();
    while !done(&got) {
        match tokio::time::timeout(Duration::from_secs(10), out.next_line()).await {
            Ok(Ok(Some(line))) => got.push(line),
            _ => break,
        }
    }
    child.kill().await.ok();
    let mut err = String::new();
    if let Some(mut stderr) = child.stderr.take() {
        use tokio::io::AsyncReadExt;
        stderr.read_to_string(&mut err).await.ok();
    }
    (got, err)
}

#[tokio::test]
async fn subscribe_reaches_a_broker_over_tls_mtls_and_a_unix_socket_and_prints_yaml() {
    let dir = tempfile::tempdir().unwrap();
    copy_examples(dir.path());
    let certs = tempfile::tempdir().unwrap();
    let pki = support::pki("cli");
    support::write_tls_files(certs.path(), &pki);
    for (name, text) in [
        ("client.crt", &pki.client_cert),
        ("client.key", &pki.client_key),
    ] {
        std::fs::write(certs.path().join(name), text).unwrap();
    }
    let file = |name: &str| certs.path().join(name).display().to_string();
    let socket = dir.path().join("broker.sock");
    let port = free_port();
    let _broker = serve_on(&[], dir.path(), port)
        .args([
            "--tls-cert",
            &file("tls.crt"),
            "--tls-key",
            &file("tls.key"),
        ])
        .args(["--tls-client-ca", &file("ca.crt")])
        .arg("--grpc-socket")
        .arg(&socket)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .unwrap();
    support::eventually("the broker listens", Duration::from_secs(20), async || {
        socket.exists()
            && tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
    })
    .await;
    let demo = "featureflags.core.openfeature.dev/default/demo";
    let https = format!("https://localhost:{port}");
    let (ca, cert, key) = (file("ca.crt"), file("client.crt"), file("client.key"));

    // mTLS, and YAML: one document per event.
    let (lines, err) = subscribe_output(
        &https,
        &[
            "--ca", &ca, "--cert", &cert, "--key", &key, "-o", "yaml", demo,
        ],
        // The record's last key.
        |lines| lines.last().is_some_and(|l| l.starts_with("uid:")),
    )
    .await;
    let text = lines.join("\n");
    assert!(text.starts_with("---\n"), "{text}\n{err}");
    let docs = crd_broker::yaml::documents_as_json(&text).unwrap();
    let first: Value = serde_json::from_slice(&docs[0]).unwrap();
    assert_eq!(first["event"], "SNAPSHOT", "{text}");
    assert_eq!(first["object"]["metadata"]["name"], "demo", "{text}");

    // Without a client certificate the broker refuses the handshake; without --ca the broker's
    // certificate is not trusted. Both are reported, not hidden.
    let (lines, err) = subscribe_output(&https, &["--ca", &ca, demo], |l| l.len() >= 2).await;
    assert!(lines.len() <= 1 && !err.is_empty(), "{lines:?}");
    let (lines, err) = subscribe_output(&https, &[demo], |l| l.len() >= 2).await;
    assert!(lines.len() <= 1 && !err.is_empty(), "{lines:?}");

    // The unix socket, plain.
    let unix = format!("unix://{}", socket.display());
    let (lines, err) = subscribe_output(&unix, &["-o", "json", demo], |l| !l.is_empty()).await;
    let first: Value =
        serde_json::from_str(lines.first().unwrap_or_else(|| panic!("{err}"))).unwrap();
    assert_eq!(first["event"], "SNAPSHOT");

    // Mistakes are named.
    for (server, args, want) in [
        (
            unix.as_str(),
            vec!["--ca", ca.as_str(), demo],
            "a unix socket",
        ),
        (
            "http://127.0.0.1:1",
            vec!["--ca", ca.as_str(), demo],
            "need an https://",
        ),
        (https.as_str(), vec!["--cert", cert.as_str(), demo], "--key"),
    ] {
        let (_, err) = subscribe_output(server, &args, |l| !l.is_empty()).await;
        assert!(err.contains(want), "{server} {args:?}: {err}");
    }
}

#[tokio::test]
async fn subscribe_sends_the_token_of_token_file_as_a_bearer_token() {
    let fake = support::fake().await;
    fake.apply(support::flag("demo", "on")).unwrap();
    fake.register_token(
        fake_apiserver::TokenUser::service_account("s3cret", "default", "app")
            .with_audiences(&["crd-broker"]),
    );
    let access = crd_broker::access::Settings {
        identity: "token".parse().unwrap(),
        ..Default::default()
    };
    let broker = support::broker_with_access(&fake, access).await;
    let server = format!("http://{}", broker.addr);
    let demo = "featureflags.core.openfeature.dev/default/demo";
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let token = token.display().to_string();
    let (lines, err) = subscribe_output(
        &server,
        &["--token-file", &token, "-o", "json", demo],
        |l| !l.is_empty(),
    )
    .await;
    let first: Value =
        serde_json::from_str(lines.first().unwrap_or_else(|| panic!("{err}"))).unwrap();
    assert_eq!(first["event"], "SNAPSHOT");
    // Without it, the caller is not identified.
    let (lines, err) = subscribe_output(&server, &[demo], |l| l.len() >= 2).await;
    assert!(
        lines.len() <= 1
            && err.contains("Unauthenticated: ")
            && err.contains("no authorization header"),
        "{lines:?} {err}"
    );
    std::fs::write(dir.path().join("empty"), "").unwrap();
    let empty = dir.path().join("empty").display().to_string();
    let (_, err) =
        subscribe_output(&server, &["--token-file", &empty, demo], |l| !l.is_empty()).await;
    assert!(err.contains("is empty"), "{err}");
}

#[test]
fn completions_are_scripts_each_shell_accepts() {
    for (shell, check) in [("bash", "bash"), ("zsh", "zsh"), ("fish", "fish")] {
        let out = std::process::Command::new(BIN)
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(out.status.success(), "{shell}");
        let script = String::from_utf8(out.stdout).unwrap();
        for word in ["serve", "subscribe", "start", "manifests", "token-file"] {
            assert!(script.contains(word), "{shell}: {word}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("completion");
        std::fs::write(&path, &script).unwrap();
        let available = std::process::Command::new(check)
            .args(["-c", "true"])
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(
            available,
            "{check} is needed to check its completions: run the README's test command (scripts/test), which installs it"
        );
        let parsed = std::process::Command::new(check)
            .arg("-n")
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            parsed.status.success(),
            "{shell} refuses the script: {}",
            String::from_utf8_lossy(&parsed.stderr)
        );
    }
    // bash, for real: sourcing it registers the completion, which completes subcommands.
    let script = String::from_utf8(
        std::process::Command::new(BIN)
            .args(["completions", "bash"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let probe = format!(
        "{script}\nf=$(complete -p crd-broker | sed -E 's/.*-F ([^ ]+).*/\\1/')\nCOMP_WORDS=(crd-broker sub); COMP_CWORD=1; COMP_LINE='crd-broker sub'; COMP_POINT=14\n\"$f\" crd-broker sub crd-broker\necho \"${{COMPREPLY[@]}}\"\n"
    );
    let out = std::process::Command::new("bash")
        .args(["-c", &probe])
        .output()
        .unwrap();
    let reply = String::from_utf8_lossy(&out.stdout);
    assert!(
        reply.contains("subscribe"),
        "{reply} {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
