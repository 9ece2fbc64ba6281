//! The tests' side of the real control plane (the `control-plane` crate): one plane per test
//! binary, shared by its tests, each test in a namespace of its own; the broker deployed on it
//! as its users run it, as a ServiceAccount with exactly the RBAC the Helm chart renders,
//! through a kubeconfig holding that account's token; and widgets, a kind of each test's own.

pub use control_plane::*;
use crd_broker::pb::subscribe_response::Event;
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::ApiResource;
use serde_json::{Value, json};

/// The control plane of this test binary, started at the first call (`scripts/control-plane
/// up`; the binaries are built once per version and cached). It stops when the test binary
/// exits, however it exits.
pub fn control_plane() -> &'static ControlPlane {
    shared()
}

/// The OpenFeature Operator's FeatureFlags (`core.openfeature.dev/v1beta1`).
pub fn feature_flags() -> ApiResource {
    ApiResource {
        group: "core.openfeature.dev".into(),
        version: "v1beta1".into(),
        api_version: "core.openfeature.dev/v1beta1".into(),
        kind: "FeatureFlag".into(),
        plural: "featureflags".into(),
    }
}

/// The broker as the Helm chart deploys it, running against a control plane: the chart rendered
/// by helm as the release `namespace` in `namespace`, every object applied, and the
/// container's args and env run with a kubeconfig holding its ServiceAccount's token.
pub struct Deployed {
    /// The broker process (killed when dropped).
    pub child: tokio::process::Child,
    /// Its gRPC address.
    pub grpc: std::net::SocketAddr,
    /// Its admin address.
    pub admin: std::net::SocketAddr,
    /// The namespace it is deployed in, and its ServiceAccount's name.
    pub namespace: String,
    /// Where its kubeconfig is.
    pub dir: tempfile::TempDir,
}

/// The chart's rendered objects as `helm install` would send them to the API server of a
/// release in `namespace`: namespaced ones placed in it. Those of the Prometheus Operator's
/// kinds are left out (no control plane here has its CRDs).
pub fn placed(docs: &[Value], namespace: &str) -> Vec<Value> {
    docs.iter()
        .filter(|d| {
            !d["apiVersion"]
                .as_str()
                .unwrap_or_default()
                .starts_with("monitoring.coreos.com/")
        })
        .map(|d| {
            let mut d = d.clone();
            let cluster_wide = d["kind"]
                .as_str()
                .unwrap_or_default()
                .starts_with("Cluster");
            if !cluster_wide && d["metadata"]["namespace"].is_null() {
                d["metadata"]["namespace"] = json!(namespace);
            }
            d
        })
        .collect()
}

/// The broker deployed on a control plane as the chart deploys it.
pub trait Deploy {
    /// Deploys the broker into `namespace` with the chart's values overlaid by `values` (its
    /// admin port is a free loopback port, and so is its gRPC port unless `values` names one),
    /// and waits until it is ready.
    async fn deploy(&self, namespace: &str, values: Value) -> Deployed;
    /// [`Deploy::deploy`], the broker reaching the API server at `server` (a relay to it).
    async fn deploy_through(&self, namespace: &str, values: Value, server: &str) -> Deployed;
    /// [`Deploy::deploy`], waiting only until the broker takes connections, ready or not.
    async fn launch(&self, namespace: &str, values: Value) -> Deployed;
}

impl Deploy for ControlPlane {
    async fn deploy(&self, namespace: &str, values: Value) -> Deployed {
        let mut deployed = self.launch(namespace, values).await;
        deployed.wait_ready().await;
        deployed
    }

    async fn deploy_through(&self, namespace: &str, values: Value, server: &str) -> Deployed {
        let mut deployed = launch_through(self, namespace, values, server).await;
        deployed.wait_ready().await;
        deployed
    }

    async fn launch(&self, namespace: &str, values: Value) -> Deployed {
        launch_through(self, namespace, values, &self.server).await
    }
}

/// [`Deploy::launch`], the broker reaching the API server at `server`.
async fn launch_through(
    plane: &ControlPlane,
    namespace: &str,
    values: Value,
    server: &str,
) -> Deployed {
    // The gRPC port the test names (a broker started again where it was), else a free one.
    let grpc = values["grpc"]["port"]
        .as_u64()
        .map_or_else(super::free_port, |p| p as u16);
    let admin = super::free_port();
    // A loopback address of the test's choosing, else 127.0.0.1.
    let host = values["listenAddress"].as_str().unwrap_or("127.0.0.1");
    let ip: std::net::IpAddr = host.parse().expect("listenAddress is a loopback IP");
    let mut overrides = json!({ "fullnameOverride": namespace });
    super::chart::merge(&mut overrides, &values);
    super::chart::merge(
        &mut overrides,
        &json!({ "listenAddress": host, "grpc": { "port": grpc }, "admin": { "port": admin } }),
    );
    let docs = super::chart::render_release(namespace, namespace, overrides).unwrap();
    // Every object, as helm would install it: the Deployment, Services and policies stay
    // objects (no controller or kubelet runs here); the broker runs as the ServiceAccount
    // under the RBAC they grant.
    let objects = placed(&docs, namespace);
    plane.apply(&objects).await;
    let account = objects
        .iter()
        .find(|d| d["kind"] == "ServiceAccount")
        .map(|d| d["metadata"]["name"].as_str().unwrap().to_string())
        .expect("the chart renders a ServiceAccount");
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = plane
        .kubeconfig_for(namespace, &account, dir.path(), server)
        .await;
    let container = super::chart::container(&docs);
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .map(|a| a.as_str().unwrap().to_string())
            .collect()
    };
    let env: Vec<(String, String)> = container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            let value = e["value"].as_str().expect("plain env values");
            (e["name"].as_str().unwrap().to_string(), value.to_string())
        })
        .collect();
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_crd-broker"))
        .args(strings(&container["args"]))
        .env_clear()
        .env("KUBECONFIG", &kubeconfig)
        .envs(env)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .expect("the broker starts");
    let mut deployed = Deployed {
        child,
        grpc: (ip, grpc).into(),
        admin: (ip, admin).into(),
        namespace: namespace.to_string(),
        dir,
    };
    deployed
        .wait_for("takes connections", |status| status.is_some())
        .await;
    deployed
}

impl Deployed {
    /// Waits until `/readyz` answers 200; a broker that exits first fails at once.
    pub async fn wait_ready(&mut self) {
        self.wait_for("becomes ready", |status| status == Some(200))
            .await;
    }

    /// `/readyz`'s status and reason once the broker has checked its source (30 s at most).
    /// A broker that answers may not have run its first check yet, and until then says only
    /// that.
    pub async fn checked_readiness(&self) -> (u16, String) {
        let checked = tokio::time::timeout(std::time::Duration::from_secs(30), async {
            loop {
                if let Some((status, reason)) = self.readiness().await
                    && !reason.contains("has not been checked yet")
                {
                    return (status, reason);
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        })
        .await;
        checked.expect("the broker checks its source within 30 s")
    }

    /// `/readyz`'s status and reason now (`None` if the admin port does not answer).
    pub async fn readiness(&self) -> Option<(u16, String)> {
        super::try_http_get(self.admin, "/readyz").await.ok()
    }

    /// Waits (30 s at most) until `/readyz`'s status (`None`: no answer) is `wanted`; a broker
    /// that exits first fails at once.
    async fn wait_for(&mut self, what: &str, wanted: impl Fn(Option<u16>) -> bool) {
        let admin = self.admin;
        let reached = tokio::time::timeout(std::time::Duration::from_secs(30), async {
            loop {
                let status = tokio::time::timeout(
                    std::time::Duration::from_secs(2),
                    super::try_http_get(admin, "/readyz"),
                )
                .await;
                if wanted(status.ok().and_then(Result::ok).map(|(code, _)| code)) {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        });
        tokio::select! {
            reached = reached => assert!(reached.is_ok(), "the broker {what}"),
            exit = self.child.wait() => panic!("the broker exited ({exit:?}) before it {what}"),
        }
    }
}

// === widgets: a kind of each test's own ===

/// A kind of this test's own, so that the API server's watch counts (by group and resource)
/// are this test's alone.
pub fn own_group(namespace: &str) -> String {
    format!("{namespace}.crd-broker.test")
}

/// Widgets of `group`: a namespaced kind served at v1 with any fields ([`crd`]).
pub fn widgets(group: &str) -> ApiResource {
    ApiResource {
        group: group.to_string(),
        version: "v1".into(),
        api_version: format!("{group}/v1"),
        kind: "Widget".into(),
        plural: "widgets".into(),
    }
}

/// The widget `namespace/name` of `group`, with `spec.color`.
pub fn widget(group: &str, namespace: &str, name: &str, color: &str) -> Value {
    json!({
        "apiVersion": format!("{group}/v1"),
        "kind": "Widget",
        "metadata": { "name": name, "namespace": namespace },
        "spec": { "color": color },
    })
}

/// Creates `object`, of `resource`, in `namespace` (as the admin).
pub async fn create(plane: &ControlPlane, resource: &ApiResource, namespace: &str, object: Value) {
    let api: Api<DynamicObject> = Api::namespaced_with(plane.admin().await, namespace, resource);
    api.create(
        &PostParams::default(),
        &serde_json::from_value(object).unwrap(),
    )
    .await
    .unwrap();
}

/// The broker's values for serving widgets of `group` in `namespace` alone, with `linger`.
/// The test's one connection stands for many sidecars: no per-caller limit on new watches is
/// meant to bind.
pub fn widget_values(group: &str, namespace: &str, linger: &str) -> Value {
    json!({
        "kinds": [{ "group": group, "plural": "widgets", "version": "" }],
        "watchNamespaces": [namespace],
        "linger": linger,
        "access": { "identity": "none", "newWatchRate": 100000, "newWatchBurst": 100000 },
    })
}

/// Subscribes to every name of `names` (100 to a stream, as a request takes at most 100) and
/// waits for each one's SNAPSHOT; the streams, to keep the watches open.
pub async fn subscribe_all(
    broker: &Deployed,
    group: &str,
    ns: &str,
    names: &[String],
) -> Vec<tonic::Streaming<crd_broker::pb::SubscribeResponse>> {
    let mut client = super::connect(broker.grpc).await;
    let mut streams = Vec::new();
    for chunk in names.chunks(100) {
        let selectors: Vec<String> = chunk
            .iter()
            .map(|n| format!("widgets.{group}/{ns}/{n}"))
            .collect();
        let selectors: Vec<&str> = selectors.iter().map(String::as_str).collect();
        let mut s = super::subscribe(&mut client, &selectors).await;
        for _ in chunk {
            assert_eq!(super::next(&mut s).await.event(), Event::Snapshot);
        }
        streams.push(s);
    }
    streams
}

/// `count` widgets `w0`… in `ns`.
pub async fn many_widgets(
    plane: &ControlPlane,
    group: &str,
    ns: &str,
    count: usize,
) -> Vec<String> {
    use futures::StreamExt;
    let resource = widgets(group);
    let names: Vec<String> = (0..count).map(|i| format!("w{i}")).collect();
    futures::stream::iter(&names)
        .for_each_concurrent(16, |name| {
            create(plane, &resource, ns, widget(group, ns, name, "red"))
        })
        .await;
    names
}

/// A namespace named after `test` and a widget kind of its own, installed: the namespace, the
/// kind's group, and the kind.
pub async fn widget_world(plane: &ControlPlane, test: &str) -> (String, String, ApiResource) {
    let ns = plane.namespace(test).await;
    let group = own_group(&ns);
    plane
        .install_crds(&[crd(&group, "widgets", "Widget")])
        .await;
    let resource = widgets(&group);
    (ns, group, resource)
}
