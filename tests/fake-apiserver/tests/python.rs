//! Fidelity against the official python `kubernetes` client: `CustomObjectsApi` create, get,
//! merge and JSON patch, replace conflicts, list with a label selector, and a `watch.Watch()`
//! stream including its handling of a 410 ERROR event. The client runs from the virtualenv the
//! README's test command makes (`.venv`, or `$CRD_BROKER_PYTHON`).

mod common;

use std::path::PathBuf;

use common::*;
use control_plane::Leash;
use serde_json::Value;

fn python() -> PathBuf {
    let python = std::env::var_os("CRD_BROKER_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python")
        });
    let ready = std::process::Command::new(&python)
        .args(["-c", "import kubernetes"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ready,
        "{} cannot import the `kubernetes` client: run the README's test command (scripts/test), which makes the virtualenv",
        python.display()
    );
    python
}

#[tokio::test]
async fn python_kubernetes_client_crud_and_watch() {
    crud_and_watch(false).await;
}

/// The python client speaks HTTP/1.1 (urllib3), over TLS verified against the fake's CA.
#[tokio::test]
async fn python_kubernetes_client_crud_and_watch_over_tls() {
    crud_and_watch(true).await;
}

async fn crud_and_watch(tls: bool) {
    let python = python();
    let fake = start_tls(tls).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    fake.write_kubeconfig(&kubeconfig).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/client_check.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .arg(&kubeconfig)
        .kill_on_drop(true)
        .leashed()
        .output()
        .await
        .expect("python runs");
    assert!(
        out.status.success(),
        "the python client check failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: Value = serde_json::from_slice(&out.stdout).expect("a JSON summary");
    assert_eq!(
        summary["watch"],
        serde_json::json!([["MODIFIED", "on"], ["DELETED", "on"]])
    );
    assert!(
        summary["expired"]
            .as_str()
            .is_some_and(|r| r.starts_with("Expired"))
    );

    // What the client sent, read as the real server reads it.
    let requests = fake.requests();
    let watch = requests
        .iter()
        .find(|r| r.verb == "watch" && r.param("fieldSelector") == Some("metadata.name=py"))
        .expect("the python watch, recognised as a watch");
    assert_eq!(watch.param("timeoutSeconds"), Some("10"));
    let patches: Vec<_> = requests.iter().filter(|r| r.method == "PATCH").collect();
    assert_eq!(
        patches[0].content_type.as_deref(),
        Some("application/merge-patch+json")
    );
    assert_eq!(
        patches[1].content_type.as_deref(),
        Some("application/json-patch+json")
    );
    let expired: Vec<_> = requests
        .iter()
        .filter(|r| r.verb == "watch" && r.param("resourceVersion") == Some("1"))
        .collect();
    assert_eq!(
        expired.len(),
        2,
        "the client retries a 410 once, then raises"
    );
    assert_eq!(fake.open_watches(), 0);
}
