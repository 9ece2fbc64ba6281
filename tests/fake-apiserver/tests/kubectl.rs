//! Fidelity against the real kubectl (the machine's v1.32, or `$KUBECTL`): discovery, OpenAPI
//! and server-side field validation on `create -f`, `apply`, `patch` of every type, `delete`
//! with its wait, and `get -w`. Needs kubectl on PATH; the README's test command installs it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;
use control_plane::Leash;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

struct Kubectl {
    bin: String,
    kubeconfig: PathBuf,
    cache: PathBuf,
    home: PathBuf,
    _dir: tempfile::TempDir,
}

impl Kubectl {
    fn new(fake: &fake_apiserver::FakeApiServer) -> Kubectl {
        let dir = tempfile::tempdir().expect("a temp dir");
        let kubeconfig = dir.path().join("kubeconfig");
        fake.write_kubeconfig(&kubeconfig).expect("kubeconfig");
        let bin = std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".into());
        let found = Command::new(&bin).args(["version", "--client"]).output();
        assert!(
            found.as_ref().is_ok_and(|o| o.status.success()),
            "kubectl is needed for this test: run the README's test command (scripts/test), which installs it, or set KUBECTL"
        );
        Kubectl {
            bin,
            kubeconfig,
            cache: dir.path().join("cache"),
            home: dir.path().to_path_buf(),
            _dir: dir,
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.bin);
        // A fresh HOME: the machine's kubectl dispatcher caches the server version under ~/.kube.
        c.env("HOME", &self.home)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(&self.cache)
            .args(args)
            .leashed();
        c
    }

    /// Starts a long-running kubectl (`get -w`) whose output is read line by line.
    fn watch(&self, args: &[&str]) -> Watching {
        let mut child = tokio::process::Command::from(self.command(args))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("kubectl get -w runs");
        let lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        Watching { child, lines }
    }

    async fn run(&self, args: &[&str]) -> Output {
        let mut command = tokio::process::Command::from(self.command(args));
        command.output().await.expect("kubectl runs")
    }

    async fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args).await;
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    async fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args).await;
        assert!(!out.status.success(), "kubectl {args:?} should fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }
}

/// A running `kubectl get -w`.
struct Watching {
    child: tokio::process::Child,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Watching {
    async fn line(&mut self) -> String {
        tokio::time::timeout(Duration::from_secs(10), self.lines.next_line())
            .await
            .expect("kubectl prints within 10 s")
            .expect("stdout readable")
            .expect("kubectl is still watching")
    }

    /// kubectl prints one pretty JSON object per event: read up to its closing brace.
    async fn object(&mut self) -> Value {
        let mut text = String::new();
        loop {
            let line = self.line().await;
            text.push_str(&line);
            text.push('\n');
            if line == "}" {
                return serde_json::from_str(&text).expect("an object");
            }
        }
    }
}

fn manifest(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/manifests")
        .join(name)
        .display()
        .to_string()
}

/// Writes a manifest as JSON (kubectl reads YAML 1.1, where a bare `on` is a boolean).
fn write(dir: &Path, name: &str, value: &Value) -> String {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(value).expect("json")).expect("write");
    path.display().to_string()
}

#[tokio::test]
async fn create_get_apply_patch_delete_with_kubectl() {
    create_get_apply_patch_delete(false).await;
}

#[tokio::test]
async fn create_get_apply_patch_delete_with_kubectl_over_tls_and_http2() {
    let fake = create_get_apply_patch_delete(true).await;
    let requests = fake.requests();
    assert!(!requests.is_empty());
    assert!(
        requests.iter().all(|r| r.version == "HTTP/2.0"),
        "kubectl negotiates HTTP/2: {:?}",
        requests.iter().map(|r| &r.version).collect::<Vec<_>>()
    );
}

async fn create_get_apply_patch_delete(tls: bool) -> fake_apiserver::FakeApiServer {
    let fake = start_tls(tls).await;
    let k = Kubectl::new(&fake);
    let dir = tempfile::tempdir().unwrap();

    // The machine's kubectl dispatcher picks the kubectl for the server's version: 1.32.
    let version: Value = serde_json::from_str(&k.ok(&["version", "-o", "json"]).await).unwrap();
    let client = version["clientVersion"]["gitVersion"]
        .as_str()
        .unwrap_or_default();
    assert!(client.starts_with("v1.32."), "{version}");
    assert_eq!(version["serverVersion"]["minor"], "32");

    // create -f: kubectl reads OpenAPI v3, sees the server validates fields, and asks it to.
    let out = k.ok(&["create", "-f", &manifest("demo.yaml")]).await;
    assert_eq!(out.trim(), "featureflag.core.openfeature.dev/demo created");
    let requests = fake.requests();
    assert!(requests.iter().any(|r| r.path == "/openapi/v3"));
    assert!(
        requests
            .iter()
            .any(|r| r.path == "/openapi/v3/apis/core.openfeature.dev/v1beta1")
    );
    let post = requests
        .iter()
        .find(|r| r.method == "POST")
        .expect("a POST");
    assert_eq!(post.param("fieldValidation"), Some("Strict"));

    // An unknown field is a strict decoding error from the server; a schema violation is Invalid.
    let mut typo = flag("default", "typo", "on");
    typo["spec"]["flagSpec"]["tyop"] = json!(1);
    let err = k
        .fails(&["create", "-f", &write(dir.path(), "typo.json", &typo)])
        .await;
    assert!(
        err.contains("strict decoding error: unknown field \"spec.flagSpec.tyop\""),
        "{err}"
    );
    let mut invalid = flag("default", "invalid", "on");
    invalid["spec"]["flagSpec"]["flags"]["f"]["state"] = json!("SOMETIMES");
    let err = k
        .fails(&["create", "-f", &write(dir.path(), "invalid.json", &invalid)])
        .await;
    assert!(
        err.contains("is invalid") && err.contains("Unsupported value: \"SOMETIMES\""),
        "{err}"
    );
    let err = k.fails(&["create", "-f", &manifest("demo.yaml")]).await;
    assert!(
        err.contains("AlreadyExists") && err.contains("already exists"),
        "{err}"
    );

    // get: table output from the server, JSON output with the server's fields.
    let table = k.ok(&["get", "featureflags"]).await;
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("NAME") && lines[0].contains("AGE"),
        "{table}"
    );
    assert!(lines[1].starts_with("demo "), "{table}");
    let by_short_name = k.ok(&["get", "ff", "demo", "-o", "json"]).await;
    let obj: Value = serde_json::from_str(&by_short_name).unwrap();
    assert_eq!(obj["metadata"]["generation"], 1);
    assert!(
        obj["metadata"]["uid"]
            .as_str()
            .is_some_and(|u| !u.is_empty())
    );

    // apply: a three-way merge patch, the last-applied annotation kept.
    let mut applied = flag("default", "applied", "on");
    k.ok(&["apply", "-f", &write(dir.path(), "a.json", &applied)])
        .await;
    applied["spec"]["flagSpec"]["flags"]["f"]["defaultVariant"] = json!("off");
    let out = k
        .ok(&["apply", "-f", &write(dir.path(), "a.json", &applied)])
        .await;
    assert!(out.contains("configured"), "{out}");
    let now = fake.get(GV, "featureflags", "default", "applied").unwrap();
    assert_eq!(
        now["spec"]["flagSpec"]["flags"]["f"]["defaultVariant"],
        "off"
    );
    assert!(
        now["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"]
            .is_string()
    );
    assert_eq!(now["metadata"]["generation"], 2);
    let patch = fake
        .requests()
        .into_iter()
        .rev()
        .find(|r| r.method == "PATCH")
        .unwrap();
    assert_eq!(
        patch.content_type.as_deref(),
        Some("application/merge-patch+json")
    );
    let out = k
        .ok(&["apply", "-f", &write(dir.path(), "a.json", &applied)])
        .await;
    assert!(out.contains("unchanged"), "{out}");

    // patch: merge and json work; kubectl's default strategic patch is refused as for any CR.
    k.ok(&[
        "patch",
        "ff",
        "demo",
        "--type",
        "merge",
        "-p",
        r#"{"metadata":{"labels":{"team":"web"}}}"#,
    ])
    .await;
    k.ok(&[
        "patch",
        "ff",
        "demo",
        "--type",
        "json",
        "-p",
        r#"[{"op":"replace","path":"/metadata/labels/team","value":"api"}]"#,
    ])
    .await;
    assert_eq!(
        k.ok(&["get", "ff", "-l", "team=api", "-o", "name"])
            .await
            .trim(),
        "featureflag.core.openfeature.dev/demo"
    );
    // kubectl patch sends no fieldValidation: the server's default (Warn) prunes and warns.
    let out = k
        .run(&[
            "patch",
            "ff",
            "demo",
            "--type",
            "merge",
            "-p",
            r#"{"spec":{"flagSpec":{"tyop":1}}}"#,
        ])
        .await;
    assert!(out.status.success());
    let warning = String::from_utf8_lossy(&out.stderr);
    assert!(
        warning.contains("Warning: unknown field \"spec.flagSpec.tyop\""),
        "{warning}"
    );
    let err = k
        .fails(&[
            "patch",
            "ff",
            "demo",
            "-p",
            r#"{"metadata":{"labels":{"team":"x"}}}"#,
        ])
        .await;
    assert!(
        err.contains("application/strategic-merge-patch+json is not supported"),
        "{err}"
    );

    // delete: kubectl waits for the object to go, and it is gone.
    let out = k.ok(&["delete", "ff", "demo"]).await;
    assert_eq!(
        out.trim(),
        "featureflag.core.openfeature.dev \"demo\" deleted"
    );
    let err = k.fails(&["get", "ff", "demo"]).await;
    assert!(
        err.contains("NotFound") && err.contains("\"demo\" not found"),
        "{err}"
    );

    // CRDs through kubectl: created at run time, then usable by name.
    let widgets = json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": { "name": "widgets.example.com" },
        "spec": { "group": "example.com", "scope": "Namespaced",
            "names": { "plural": "widgets", "singular": "widget", "kind": "Widget" },
            "versions": [{ "name": "v1", "served": true, "storage": true,
                "schema": { "openAPIV3Schema": { "type": "object", "x-kubernetes-preserve-unknown-fields": true } } }] }
    });
    k.ok(&["apply", "-f", &write(dir.path(), "crd.json", &widgets)])
        .await;
    let widget = json!({ "apiVersion": "example.com/v1", "kind": "Widget", "metadata": { "name": "w" }, "size": 3 });
    k.ok(&["create", "-f", &write(dir.path(), "w.json", &widget)])
        .await;
    assert_eq!(
        k.ok(&["get", "widgets", "w", "-o", "jsonpath={.size}"])
            .await,
        "3"
    );
    assert!(k.ok(&["get", "crd"]).await.contains("widgets.example.com"));
    fake
}

#[tokio::test]
async fn kubectl_get_watch_streams_changes() {
    get_watch_streams_changes(false).await;
}

#[tokio::test]
async fn kubectl_get_watch_streams_changes_over_tls_and_http2() {
    get_watch_streams_changes(true).await;
}

async fn get_watch_streams_changes(tls: bool) {
    let fake = start_tls(tls).await;
    fake.apply(flag("default", "w", "on")).unwrap();
    let k = Kubectl::new(&fake);
    let mut kubectl = k.watch(&["get", "ff", "w", "-w", "-o", "json"]);
    let first = kubectl.object().await;
    assert_eq!(
        first["spec"]["flagSpec"]["flags"]["f"]["defaultVariant"],
        "on"
    );
    assert!(
        fake.wait_for(Duration::from_secs(5), |f| f.open_watches() == 1)
            .await
    );
    let watch = fake
        .requests()
        .into_iter()
        .find(|r| r.verb == "watch")
        .expect("a watch request");
    assert_eq!(watch.param("fieldSelector"), Some("metadata.name=w"));
    fake.merge_patch(
        GV,
        "featureflags",
        "default",
        "w",
        json!({ "spec": { "flagSpec": { "flags": { "f": { "defaultVariant": "off" } } } } }),
    )
    .unwrap();
    let changed = kubectl.object().await;
    assert_eq!(
        changed["spec"]["flagSpec"]["flags"]["f"]["defaultVariant"],
        "off"
    );
    kubectl.child.kill().await.ok();
    assert!(
        fake.wait_for(Duration::from_secs(5), |f| f.open_watches() == 0)
            .await,
        "kubectl's watch closed"
    );
}

#[tokio::test]
async fn kubectl_get_watch_prints_server_side_table_rows() {
    let fake = start().await;
    fake.apply(flag("default", "t", "on")).unwrap();
    let k = Kubectl::new(&fake);
    let mut kubectl = k.watch(&["get", "ff", "-w"]);
    let header = kubectl.line().await;
    assert!(
        header.starts_with("NAME") && header.contains("AGE"),
        "{header}"
    );
    assert!(kubectl.line().await.starts_with("t "), "the listed row");
    assert!(
        fake.wait_for(Duration::from_secs(5), |f| f.open_watches() == 1)
            .await
    );
    let watch = fake
        .requests()
        .into_iter()
        .find(|r| r.verb == "watch")
        .unwrap();
    assert!(
        watch
            .accept
            .as_deref()
            .is_some_and(|a| a.contains("as=Table")),
        "{watch:?}"
    );
    fake.merge_patch(
        GV,
        "featureflags",
        "default",
        "t",
        json!({ "metadata": { "labels": { "x": "y" } } }),
    )
    .unwrap();
    assert!(
        kubectl.line().await.starts_with("t "),
        "a row per change, columns from the first event"
    );
    fake.merge_patch(
        GV,
        "featureflags",
        "default",
        "t",
        json!({ "metadata": { "labels": { "x": "z" } } }),
    )
    .unwrap();
    assert!(kubectl.line().await.starts_with("t "));
    kubectl.child.kill().await.ok();
}
