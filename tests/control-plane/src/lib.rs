//! A real kube-apiserver and etcd on loopback (`scripts/control-plane`), and the faults a real
//! cluster has, on demand: a component killed or ended and started again, etcd compacted, a
//! Priority and Fairness level that rejects, RBAC taken away and given back. Shared by the tests
//! and the load harness, with what else both need (free loopback ports, a DNS server on
//! loopback, EndpointSlices, the real peers' binaries, leashes that end what they start however
//! they end); a harness's helpers, they panic with the cause when the plane does not do what
//! they ask.

pub mod dns;
pub mod endpoints;
pub mod leash;
mod ports;

pub use leash::Leash;
pub use ports::free_port;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

/// The repository's root (this crate lives in `tests/control-plane`).
pub fn root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.canonicalize().unwrap_or(root)
}

fn script() -> PathBuf {
    root().join("scripts/control-plane")
}

/// The binary of the real peer `name` (`helm`, `flagd`, `grpc-go`): `scripts/peers path`,
/// which builds it from its module once per version and caches it.
pub fn peer(name: &str) -> PathBuf {
    let out = Command::new(root().join("scripts/peers"))
        .args(["path", name])
        .output()
        .expect("scripts/peers runs");
    assert!(
        out.status.success(),
        "scripts/peers path {name} (run the README's test command, scripts/test, which builds it): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// The API of `object`'s kind (discovered), in its namespace if it is namespaced; its kind and
/// name.
async fn api_for<'a>(
    client: &kube::Client,
    object: &'a Value,
) -> (Api<DynamicObject>, &'a str, &'a str) {
    let api_version = object["apiVersion"].as_str().unwrap();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let kind = object["kind"].as_str().unwrap();
    let (resource, capabilities): (ApiResource, _) =
        kube::discovery::pinned_kind(client, &GroupVersionKind::gvk(group, version, kind))
            .await
            .unwrap_or_else(|e| panic!("{kind} in {api_version}: {e}"));
    let api = match object["metadata"]["namespace"].as_str() {
        Some(ns) if capabilities.scope == kube::discovery::Scope::Namespaced => {
            Api::namespaced_with(client.clone(), ns, &resource)
        }
        _ => Api::all_with(client.clone(), &resource),
    };
    (api, kind, object["metadata"]["name"].as_str().unwrap())
}

/// A running control plane.
pub struct ControlPlane {
    /// Where its certificates, logs and kubeconfig are.
    pub dir: PathBuf,
    /// The admin's kubeconfig (a client certificate in `system:masters`).
    pub admin_kubeconfig: PathBuf,
    /// `https://host:port`.
    pub server: String,
}

/// The control plane of this process, on 127.0.0.1, started at the first call and shared by
/// every later one (a test binary's tests, each in a namespace of its own). A static is never
/// dropped: it is stopped as the process exits (`atexit`), and should the process be killed,
/// its keepers stop it a second later.
pub fn shared() -> &'static ControlPlane {
    static PLANE: OnceLock<ControlPlane> = OnceLock::new();
    PLANE.get_or_init(|| {
        extern "C" fn stop() {
            if let Some(plane) = PLANE.get() {
                plane.down();
            }
        }
        leash::at_exit(stop);
        start("127.0.0.1")
    })
}

/// Starts a control plane on `address` (`127.0.0.1`, `::1`) in a directory of its own under
/// `target/control-plane/`, owned by this process: it stops when this process ends, however it
/// ends (`scripts/control-plane up --watch-pid`). The planes of earlier processes that are gone
/// are stopped, if anything of them is left, and their directories removed.
pub fn start(address: &str) -> ControlPlane {
    start_with(address, &[])
}

/// [`start`], kube-apiserver run with `flags` besides the script's own.
pub fn start_with(address: &str, flags: &[&str]) -> ControlPlane {
    leash::follow_cargo();
    let base = root().join("target/control-plane");
    std::fs::create_dir_all(&base).unwrap();
    for entry in std::fs::read_dir(&base).unwrap().flatten() {
        if !owner_alive(&entry.path()) {
            // Stopped first: a directory removed under a running plane left its
            // kube-apiserver running for good (issue 40).
            let _ = down_dir(&entry.path());
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    static STARTED: AtomicU32 = AtomicU32::new(0);
    let dir = base.join(format!(
        "{}-{}",
        std::process::id(),
        STARTED.fetch_add(1, Ordering::Relaxed)
    ));
    let out = Command::new(script())
        .args(["up", "--dir"])
        .arg(&dir)
        .args(["--address", address])
        .args(["--watch-pid", &std::process::id().to_string()])
        .env("CONTROL_PLANE_APISERVER_FLAGS", flags.join(" "))
        .output()
        .expect("scripts/control-plane runs");
    assert!(
        out.status.success(),
        "scripts/control-plane up (run the README's test command, scripts/test, which builds it): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let server = std::fs::read_to_string(dir.join("server"))
        .unwrap()
        .trim()
        .to_string();
    ControlPlane {
        admin_kubeconfig: dir.join("admin.kubeconfig"),
        dir,
        server,
    }
}

/// Whether the process that owns the plane in `dir` (its `owner` file: pid and start time, as
/// `up` wrote it) still runs. A directory without one is taken as owned by the pid its name
/// starts with.
fn owner_alive(dir: &Path) -> bool {
    let owner = std::fs::read_to_string(dir.join("owner")).unwrap_or_default();
    let mut owner = owner.split_whitespace();
    let (pid, since) = match (owner.next(), owner.next()) {
        (Some(pid), since) => (pid.to_string(), since.map(str::to_string)),
        _ => {
            let name = dir.file_name().unwrap_or_default().to_string_lossy();
            (name.split('-').next().unwrap_or_default().to_string(), None)
        }
    };
    match (started(&pid), since) {
        (Some(now), Some(since)) => now == since,
        (now, None) => now.is_some(),
        (None, _) => false,
    }
}

/// The start time of process `pid` (field 22 of `/proc/PID/stat`), unless it is gone or a
/// zombie.
fn started(pid: &str) -> Option<String> {
    let stat = std::fs::read_to_string(Path::new("/proc").join(pid).join("stat")).ok()?;
    // The fields after the command name (which may hold spaces), from the state on.
    let fields: Vec<&str> = stat.rsplit_once(") ")?.1.split_whitespace().collect();
    if fields.first() == Some(&"Z") {
        return None;
    }
    fields.get(19).map(|since| since.to_string())
}

/// `scripts/control-plane down --dir dir`: what it said it stopped.
fn down_dir(dir: &Path) -> std::io::Result<String> {
    let out = Command::new(script())
        .args(["down", "--dir"])
        .arg(dir)
        .output()?;
    Ok(String::from_utf8_lossy(&out.stderr).into_owned())
}

impl ControlPlane {
    /// Stops the plane now (`scripts/control-plane down`); dropping it does the same.
    pub fn down(&self) {
        let _ = down_dir(&self.dir);
    }
}

impl Drop for ControlPlane {
    /// Stops the plane (a test's own; the binary's shared one is stopped as the binary exits).
    fn drop(&mut self) {
        self.down();
    }
}

/// A process of the control plane.
#[derive(Debug, Clone, Copy)]
pub enum Component {
    /// etcd.
    Etcd,
    /// kube-apiserver.
    ApiServer,
}

impl Component {
    fn name(self) -> &'static str {
        match self {
            Component::Etcd => "etcd",
            Component::ApiServer => "kube-apiserver",
        }
    }
}

impl ControlPlane {
    /// Ends `component` with `signal` (`KILL`, `TERM`) and waits until it has exited
    /// (`scripts/control-plane stop`).
    pub async fn stop(&self, component: Component, signal: &str) {
        self.script(&["stop", component.name(), "--signal", signal])
            .await;
    }

    /// Starts `component` again as it first ran, on its ports and data, and waits until it
    /// answers: etcd its health, kube-apiserver its `/readyz` (`scripts/control-plane start`).
    pub async fn start_again(&self, component: Component) {
        self.script(&["start", component.name()]).await;
    }

    /// [`ControlPlane::start_again`], a failure to start returned (the script's words) rather
    /// than panicked with.
    pub async fn try_start_again(&self, component: Component) -> Result<(), String> {
        self.try_script(&["start", component.name()]).await
    }

    async fn script(&self, args: &[&str]) {
        if let Err(e) = self.try_script(args).await {
            panic!("{e}");
        }
    }

    async fn try_script(&self, args: &[&str]) -> Result<(), String> {
        let mut command = tokio::process::Command::new(script());
        command.args(args).arg("--dir").arg(&self.dir);
        let out = command.output().await.expect("scripts/control-plane runs");
        match out.status.success() {
            true => Ok(()),
            false => Err(format!(
                "scripts/control-plane {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            )),
        }
    }

    /// Compacts etcd's history up to its current revision, through its own API: every older
    /// revision is gone, and a watch resumed from one is told so (410 Gone).
    pub async fn compact_etcd(&self) -> u64 {
        let url = std::fs::read_to_string(self.dir.join("etcd-url")).unwrap();
        let url = url.trim();
        let etcd = |path: &str, body: Value| {
            let out = Command::new("curl")
                .args(["-fsS", "-X", "POST", "-d", &body.to_string()])
                .arg(format!("{url}{path}"))
                .output()
                .expect("curl runs");
            assert!(out.status.success(), "etcd {path}: {out:?}");
            serde_json::from_slice::<Value>(&out.stdout).unwrap()
        };
        // Any read answers with the store's revision in its header.
        let head = etcd("/v3/kv/range", json!({ "key": base64(b"/") }));
        let revision: u64 = head["header"]["revision"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        etcd(
            "/v3/kv/compaction",
            json!({ "revision": revision.to_string(), "physical": true }),
        );
        revision
    }

    /// A client with the admin's rights. A new one each time: a kube client's buffer runs as a
    /// task of the runtime that made it, and each test has a runtime of its own, while the
    /// control plane is shared by every test of the binary.
    pub async fn admin(&self) -> kube::Client {
        client_from(&self.admin_kubeconfig).await
    }

    /// GET `path` as the admin: the body (for `/metrics`, `/version`, …).
    pub async fn get(&self, path: &str) -> String {
        let request = http::Request::get(path).body(Vec::new()).unwrap();
        self.admin().await.request_text(request).await.unwrap()
    }

    /// The API server's own metrics, as `name{labels}` → value.
    pub async fn metrics(&self) -> BTreeMap<String, f64> {
        scrape(&self.get("/metrics").await)
    }

    /// A new namespace named after `test` (with a number, so that a test may run twice).
    pub async fn namespace(&self, test: &str) -> String {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "{}-{}-{}",
            test.replace('_', "-")
                .chars()
                .take(40)
                .collect::<String>()
                .trim_end_matches('-'),
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let namespaces: Api<Namespace> = Api::all(self.admin().await);
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({ "metadata": { "name": name } })).unwrap(),
            )
            .await
            .unwrap();
        name
    }

    /// Applies `objects` (server-side apply, as the admin), each in its own namespace or the
    /// cluster.
    pub async fn apply(&self, objects: &[Value]) {
        let client = self.admin().await;
        for object in objects {
            let (api, kind, name) = api_for(&client, object).await;
            api.patch(
                name,
                &PatchParams::apply("crd-broker-tests").force(),
                &Patch::Apply(object),
            )
            .await
            .unwrap_or_else(|e| panic!("applying {kind} {name}: {e}"));
        }
    }

    /// `object` as the API server holds it now (found by its kind, namespace and name).
    pub async fn read(&self, object: &Value) -> Value {
        let client = self.admin().await;
        let (api, kind, name) = api_for(&client, object).await;
        let found = api
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("reading {kind} {name}: {e}"));
        serde_json::to_value(found).unwrap()
    }

    /// A token of the ServiceAccount `account` of `namespace` from TokenRequest, for a day (a
    /// long soak outlives an hour): for `audiences` (none: the API server's own), bound to the
    /// pod `pod` (its name) if given.
    pub async fn token(
        &self,
        namespace: &str,
        account: &str,
        audiences: &[&str],
        pod: Option<&str>,
    ) -> String {
        let client = self.admin().await;
        let mut spec = json!({ "audiences": audiences, "expirationSeconds": 86_400 });
        if let Some(pod) = pod {
            let pods: Api<k8s_openapi::api::core::v1::Pod> =
                Api::namespaced(client.clone(), namespace);
            let uid = pods.get(pod).await.unwrap().metadata.uid.unwrap();
            spec["boundObjectRef"] =
                json!({ "kind": "Pod", "apiVersion": "v1", "name": pod, "uid": uid });
        }
        let request: TokenRequest = serde_json::from_value(json!({ "spec": spec })).unwrap();
        let accounts: Api<ServiceAccount> = Api::namespaced(client, namespace);
        accounts
            .create_token_request(account, &PostParams::default(), &request)
            .await
            .unwrap()
            .status
            .and_then(|status| status.token)
            .expect("TokenRequest gives a token")
    }

    /// A kubeconfig in `dir` for the ServiceAccount `account` of `namespace`, with a token from
    /// TokenRequest (a day, for the API server's audience), to reach the API server at `server`
    /// (its own URL, or a relay's to it).
    pub async fn kubeconfig_for(
        &self,
        namespace: &str,
        account: &str,
        dir: &Path,
        server: &str,
    ) -> PathBuf {
        let token = self.token(namespace, account, &[], None).await;
        let ca = std::fs::read(self.dir.join("pki/ca.crt")).unwrap();
        let path = dir.join(format!("{account}.kubeconfig"));
        let kubeconfig = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{ "name": "control-plane", "cluster": {
                "server": server,
                "certificate-authority-data": base64(&ca),
            } }],
            "users": [{ "name": account, "user": { "token": token } }],
            "contexts": [{ "name": account, "context": {
                "cluster": "control-plane", "user": account, "namespace": namespace,
            } }],
            "current-context": account,
        });
        std::fs::write(&path, kubeconfig.to_string()).unwrap();
        path
    }
}

/// A client for the kubeconfig at `path`.
pub async fn client_from(path: &Path) -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::read_from(path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    kube::Client::try_from(config).unwrap()
}

fn base64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The CustomResourceDefinition of a namespaced kind `plural` in `group`, served at v1, with
/// any fields.
pub fn crd(group: &str, plural: &str, kind: &str) -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": format!("{plural}.{group}") },
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": { "plural": plural, "singular": kind.to_lowercase(), "kind": kind },
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": { "openAPIV3Schema": {
                    "type": "object", "x-kubernetes-preserve-unknown-fields": true,
                } },
            }],
        },
    })
}

impl ControlPlane {
    /// Applies the CRDs and waits until the API server serves each (the kind at its first
    /// served version in discovery).
    pub async fn install_crds(&self, crds: &[Value]) {
        self.apply(crds).await;
        let client = self.admin().await;
        for crd in crds {
            let group = crd["spec"]["group"].as_str().unwrap();
            let kind = crd["spec"]["names"]["kind"].as_str().unwrap();
            let versions = crd["spec"]["versions"].as_array().unwrap();
            let version = versions
                .iter()
                .find(|v| v["served"] == true)
                .and_then(|v| v["name"].as_str())
                .expect("a served version");
            let gvk = GroupVersionKind::gvk(group, version, kind);
            let found = tokio::time::timeout(std::time::Duration::from_secs(30), async {
                loop {
                    if kube::discovery::pinned_kind(&client, &gvk).await.is_ok() {
                        return;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            })
            .await;
            assert!(found.is_ok(), "{kind}.{group} served after 30 s");
        }
    }

    /// The WATCH requests the API server is serving now on `resource` of `group`, from its
    /// own metrics (`apiserver_longrunning_requests`).
    pub async fn open_watches(&self, group: &str, resource: &str) -> f64 {
        let labels = [("verb", "WATCH"), ("group", group), ("resource", resource)];
        total(
            &self.metrics().await,
            "apiserver_longrunning_requests",
            &labels,
        )
    }

    /// What the API server counted for `group`'s widgets: `apiserver_request_total` by verb,
    /// summed over codes and scopes. A WATCH counts once it has ended.
    pub async fn requests(&self, group: &str, verb: &str) -> f64 {
        let labels = [("verb", verb), ("group", group), ("resource", "widgets")];
        total(&self.metrics().await, "apiserver_request_total", &labels)
    }
}

impl ControlPlane {
    /// Gives every request of the ServiceAccount `account` of `namespace` a Priority and
    /// Fairness level of its own, `name`, with `shares` of the server's concurrency (0: no seat
    /// of its own; the level still runs one request when it runs none), which rejects what it
    /// cannot seat (429 with Retry-After). [`ControlPlane::unprioritize`] ends it.
    pub async fn prioritize(&self, name: &str, namespace: &str, account: &str, shares: u32) {
        self.apply(&[
            json!({
                "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
                "kind": "PriorityLevelConfiguration",
                "metadata": { "name": name },
                "spec": { "type": "Limited", "limited": {
                    "nominalConcurrencyShares": shares,
                    "lendablePercent": 0,
                    "borrowingLimitPercent": 0,
                    "limitResponse": { "type": "Reject" },
                } },
            }),
            json!({
                "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
                "kind": "FlowSchema",
                "metadata": { "name": name },
                "spec": {
                    "priorityLevelConfiguration": { "name": name },
                    "matchingPrecedence": 500,
                    "distinguisherMethod": { "type": "ByUser" },
                    "rules": [{
                        "subjects": [{ "kind": "ServiceAccount",
                            "serviceAccount": { "name": account, "namespace": namespace } }],
                        "resourceRules": [{ "verbs": ["*"], "apiGroups": ["*"],
                            "resources": ["*"], "clusterScope": true, "namespaces": ["*"] }],
                        "nonResourceRules": [{ "verbs": ["*"], "nonResourceURLs": ["*"] }],
                    }],
                },
            }),
        ])
        .await;
    }

    /// Removes the FlowSchema `name` of [`ControlPlane::prioritize`]: the account's requests go
    /// back to the levels they had.
    pub async fn unprioritize(&self, name: &str) {
        let schemas: Api<DynamicObject> = Api::all_with(
            self.admin().await,
            &ApiResource::from_gvk(&GroupVersionKind::gvk(
                "flowcontrol.apiserver.k8s.io",
                "v1",
                "FlowSchema",
            )),
        );
        schemas
            .delete(name, &kube::api::DeleteParams::default())
            .await
            .unwrap();
    }

    /// Requests of the FlowSchema `name` the server rejected so far.
    pub async fn rejected(&self, name: &str) -> f64 {
        total(
            &self.metrics().await,
            "apiserver_flowcontrol_rejected_requests_total",
            &[("flow_schema", name)],
        )
    }
}

/// A RoleBinding taken away by [`ControlPlane::revoke`], to give back.
pub struct Revoked(k8s_openapi::api::rbac::v1::RoleBinding);

impl ControlPlane {
    /// Deletes the RoleBinding `name` of `namespace` (the chart's, named after the release,
    /// grants the broker its kinds there).
    pub async fn revoke(&self, namespace: &str, name: &str) -> Revoked {
        let bindings: Api<k8s_openapi::api::rbac::v1::RoleBinding> =
            Api::namespaced(self.admin().await, namespace);
        let binding = bindings.get(name).await.unwrap();
        bindings
            .delete(name, &kube::api::DeleteParams::default())
            .await
            .unwrap();
        Revoked(binding)
    }

    /// Creates the revoked RoleBinding again.
    pub async fn restore(&self, revoked: Revoked) {
        let mut binding = revoked.0;
        let namespace = binding.metadata.namespace.clone().unwrap();
        binding.metadata.resource_version = None;
        binding.metadata.uid = None;
        let bindings: Api<k8s_openapi::api::rbac::v1::RoleBinding> =
            Api::namespaced(self.admin().await, &namespace);
        bindings
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
    }
}

impl ControlPlane {
    /// The pid of `component` now (`None` while it is stopped).
    pub fn pid(&self, component: Component) -> Option<u32> {
        let pid = std::fs::read_to_string(self.dir.join(format!("{}.pid", component.name())));
        pid.ok()?.trim().parse().ok()
    }
}

/// Prometheus text as `name{labels}` → value.
pub fn scrape(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// The sum of `name`'s series that carry every label of `labels` (folded from 0: a float sum
/// starts at -0).
pub fn total(m: &BTreeMap<String, f64>, name: &str, labels: &[(&str, &str)]) -> f64 {
    let prefix = format!("{name}{{");
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    m.iter()
        .filter(|(series, _)| {
            series.starts_with(&prefix) && labels.iter().all(|l| series.contains(l.as_str()))
        })
        .fold(0.0, |sum, (_, v)| sum + v)
}
