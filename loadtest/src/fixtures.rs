//! What the scenarios share: the fake API server with its FeatureFlags (or a real control
//! plane's world), a server under test started on it, subscribers started and waited for, and
//! the broker's metrics scraped.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use fake_apiserver::{FakeApiServer, Options};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};
use tonic::transport::Channel;

use crate::Run;
use crate::clients::{self, Recorder, tokio_util_like};
use crate::target::{Kind, Target};

pub(crate) const CRD: &str = include_str!("../../examples/manifests/featureflag-crd.yaml");

pub(crate) const GV: &str = "core.openfeature.dev/v1beta1";

pub(crate) fn name(k: usize) -> String {
    format!("ff-{k}")
}

pub(crate) fn bar(len: u64, message: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg:40} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

/// A fake API server holding `crs` FeatureFlags of about `payload` bytes, and a kubeconfig.
pub(crate) async fn fake(
    crs: usize,
    payload: usize,
) -> anyhow::Result<(FakeApiServer, tempfile_like::Dir)> {
    fake_with(crs, payload, false).await
}

/// As [`fake`], over TLS (HTTP/2 and HTTP/1.1 by ALPN, 100 streams per connection) if `tls`.
pub(crate) async fn fake_with(
    crs: usize,
    payload: usize,
    tls: bool,
) -> anyhow::Result<(FakeApiServer, tempfile_like::Dir)> {
    let options = Options {
        history_limit: 100_000,
        tls,
        ..Options::default()
    }
    .crd_yaml(CRD)?;
    let fake = FakeApiServer::start_with(options).await?;
    for k in 0..crs {
        fake.apply(flag(&name(k), payload))?;
    }
    let dir = tempfile_like::Dir::new()?;
    fake.write_kubeconfig(&dir.path().join("kubeconfig"))?;
    Ok((fake, dir))
}

/// The fake API server with `crs` FeatureFlags and the server under test: the broker watching
/// it (through a kubeconfig in the returned directory, with `linger`), or the bare server fed
/// every FeatureFlag.
pub(crate) async fn serve(
    run: &Run,
    kind: Kind,
    crs: usize,
    linger: Duration,
    args: &[&str],
) -> anyhow::Result<(FakeApiServer, tempfile_like::Dir, Target)> {
    let (fake, dir) = fake(crs, run.payload_bytes).await?;
    // The loopback addresses connections come from are pods, for `--identity peer-pod`.
    for i in 1..=run.sources.max(1) {
        run_pod(&fake, &format!("sidecar-{i}"), &format!("127.0.0.{i}"))?;
    }
    let target = match kind {
        Kind::Broker => {
            let bin = crate::target::broker_bin(run.broker_bin.clone())?;
            Target::broker(&bin, &dir.path().join("kubeconfig"), linger, args).await?
        }
        Kind::Bare => {
            let mut t = Target::bare().await?;
            for k in 0..crs {
                let obj = fake.get(GV, "featureflags", "default", &name(k))?;
                t.feed(&name(k), &obj.to_string()).await?;
            }
            t
        }
        Kind::Flagd | Kind::FlagdProxy => {
            anyhow::bail!("flagd and flagd-proxy run on a real control plane (scenario peers)")
        }
    };
    Ok((fake, dir, target))
}

/// A Running pod `name` in `default` with `ip`, as a kubelet reports it.
pub(crate) fn run_pod(fake: &FakeApiServer, name: &str, ip: &str) -> anyhow::Result<()> {
    fake.apply(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": "default" },
        "spec": { "serviceAccountName": "sidecar", "containers": [{ "name": "app", "image": "app" }] },
    }))?;
    fake.merge_patch_status(
        "v1",
        "pods",
        "default",
        name,
        json!({ "status": { "phase": "Running", "podIP": ip } }),
    )?;
    Ok(())
}

pub(crate) fn flag(name: &str, payload: usize) -> Value {
    let mut f = json!({
        "apiVersion": GV,
        "kind": "FeatureFlag",
        "metadata": { "name": name, "namespace": "default" },
        "spec": { "flagSpec": {
            "metadata": { "seq": 0, "sentAt": 0, "padding": "" },
            "flags": { "f": { "state": "ENABLED", "variants": { "on": true, "off": false }, "defaultVariant": "on" } },
        } },
    });
    let size = f.to_string().len() + 200; // the server adds its metadata
    f["spec"]["flagSpec"]["metadata"]["padding"] = json!("x".repeat(payload.saturating_sub(size)));
    f
}

/// Directories that clean up after themselves (no extra dependency).
pub(crate) mod tempfile_like {
    use std::path::{Path, PathBuf};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new() -> std::io::Result<Dir> {
            let path = std::env::temp_dir().join(format!(
                "crd-broker-loadtest-{}-{}",
                std::process::id(),
                crate::clients::now_nanos()
            ));
            std::fs::create_dir_all(&path)?;
            Ok(Dir(path))
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

pub(crate) async fn start_subscribers(
    channels: &[Channel],
    names: &[String],
    range: std::ops::Range<usize>,
    cold: bool,
    recorder: &Arc<Recorder>,
    stop: &tokio_util_like::Stop,
) {
    for i in range {
        let channel = channels[i % channels.len()].clone();
        tokio::spawn(clients::subscribe(
            channel,
            names[i].clone(),
            i,
            cold,
            recorder.clone(),
            stop.clone(),
        ));
    }
}

pub(crate) async fn wait_until(
    what: &str,
    timeout: Duration,
    mut done: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !done() {
        anyhow::ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

pub(crate) fn firsts(r: &Recorder) -> u64 {
    r.first_cold.count() + r.first_warm.count()
}

/// The requests of `verb` the API server saw for each of the first `crs` CRs, by the field
/// selector that names it.
pub(crate) fn requests_per_cr(fake: &FakeApiServer, crs: usize, verb: &str) -> Vec<usize> {
    let requests = fake.requests();
    (0..crs)
        .map(|k| {
            let selector = format!("metadata.name={}", name(k));
            requests
                .iter()
                .filter(|r| r.verb == verb && r.param("fieldSelector") == Some(selector.as_str()))
                .count()
        })
        .collect()
}

/// The least and the most of `counts`.
pub(crate) fn least_and_most(counts: &[usize]) -> (usize, usize) {
    (
        counts.iter().copied().min().unwrap_or(0),
        counts.iter().copied().max().unwrap_or(0),
    )
}

/// One subscriber on each of the `crs` resources, on one connection from 127.0.0.1, until the
/// returned trigger is stopped: every watch open.
pub(crate) async fn warm_every_watch(
    target: &Target,
    crs: usize,
) -> anyhow::Result<tokio_util_like::Trigger> {
    let warm = clients::connections(target.grpc, 1, 1).await?;
    let recorder = Recorder::new(crs, 0);
    let (trigger, stop) = tokio_util_like::signal();
    let names: Vec<String> = (0..crs).map(name).collect();
    start_subscribers(&warm, &names, 0..crs, true, &recorder, &stop).await;
    wait_until("the warm-up", Duration::from_secs(60), || {
        firsts(&recorder) as usize >= crs
    })
    .await?;
    Ok(trigger)
}

/// A plain HTTP/1.1 GET of `path` on the admin port: the status and the body.
pub(crate) async fn get(admin: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(admin).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// The broker's metrics, as `name{labels}` → value.
pub(crate) async fn scrape(admin: SocketAddr) -> BTreeMap<String, f64> {
    let Ok((_, text)) = get(admin, "/metrics").await else {
        return BTreeMap::new();
    };
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// The writer's FlowSchema on a real control plane: its requests are the only ones under this
/// name.
pub(crate) const WRITER_FLOW: &str = "crd-broker-writer";

/// The RoleBinding that lets the broker read FeatureFlags on a real control plane.
pub(crate) const BROKER_BINDING: &str = "broker-reads";

/// A real control plane of the caller's own (`scripts/control-plane up`), started off the
/// runtime (the script blocks); it stops when dropped.
pub(crate) async fn own_plane() -> anyhow::Result<control_plane::ControlPlane> {
    tokio::task::spawn_blocking(|| control_plane::start("127.0.0.1"))
        .await
        .map_err(|e| anyhow::anyhow!("scripts/control-plane up failed: {e}"))
}

/// The kube-apiserver of `plane`: its process id and its port.
pub(crate) fn apiserver(plane: &control_plane::ControlPlane) -> anyhow::Result<(u32, u16)> {
    let pid = plane
        .pid(control_plane::Component::ApiServer)
        .context("kube-apiserver runs")?;
    let port = plane
        .server
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .context("the API server's port")?;
    Ok((pid, port))
}

/// A real control plane's world: the FeatureFlag CRD, `crs` flags in `default`, and three
/// ServiceAccounts there — `sidecar` and `broker` may read FeatureFlags (a Role and a
/// RoleBinding each), `writer` may patch them and has a FlowSchema of its own at the
/// `workload-low` level, where service accounts' requests go by default.
pub(crate) async fn real_world(
    plane: &control_plane::ControlPlane,
    crs: usize,
    payload: usize,
) -> anyhow::Result<()> {
    let crd: Value = serde_saphyr::from_str(CRD).context("the FeatureFlag CRD")?;
    plane.install_crds(&[crd]).await;
    let account = |name: &str| {
        json!({ "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": { "name": name, "namespace": "default" } })
    };
    let role = |name: &str, verbs: &[&str]| {
        json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": { "name": name, "namespace": "default" },
            "rules": [{ "apiGroups": ["core.openfeature.dev"], "resources": ["featureflags"],
                "verbs": verbs }] })
    };
    let binding = |name: &str, role: &str, account: &str| {
        json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": { "name": name, "namespace": "default" },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role },
            "subjects": [{ "kind": "ServiceAccount", "name": account, "namespace": "default" }] })
    };
    plane
        .apply(&[
            account("sidecar"),
            account("broker"),
            account("writer"),
            role("featureflag-reader", &["get", "list", "watch"]),
            role("featureflag-writer", &["get", "patch"]),
            binding("sidecar-reads", "featureflag-reader", "sidecar"),
            binding(BROKER_BINDING, "featureflag-reader", "broker"),
            binding("writer-writes", "featureflag-writer", "writer"),
            json!({ "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
                "metadata": { "name": WRITER_FLOW },
                "spec": {
                    "priorityLevelConfiguration": { "name": "workload-low" },
                    "matchingPrecedence": 500,
                    "distinguisherMethod": { "type": "ByUser" },
                    "rules": [{
                        "subjects": [{ "kind": "ServiceAccount",
                            "serviceAccount": { "name": "writer", "namespace": "default" } }],
                        "resourceRules": [{ "verbs": ["*"], "apiGroups": ["*"],
                            "resources": ["*"], "namespaces": ["*"] }],
                    }],
                } }),
        ])
        .await;
    let flags: Vec<Value> = (0..crs).map(|k| flag(&name(k), payload)).collect();
    plane.apply(&flags).await;
    Ok(())
}

/// FeatureFlags, for a kube client's `Api`.
pub(crate) fn featureflags() -> kube::core::ApiResource {
    kube::core::ApiResource {
        group: "core.openfeature.dev".into(),
        version: "v1beta1".into(),
        api_version: GV.into(),
        kind: "FeatureFlag".into(),
        plural: "featureflags".into(),
    }
}
