//! The OpenFeature Operator's own manager (v0.9.2, built from its sources by `scripts/peers`)
//! deploys the broker in flagd-proxy's place on a real control plane, and its webhook injects
//! the flagd sidecar that reads through it; then the same with stock flagd-proxy, so both routes
//! are shown to work alike.
//!
//! What the Operator is given is what its `config/` holds, as `config/default` makes it (names
//! prefixed `open-feature-operator-`, namespaced objects in `open-feature-operator-system`): its
//! CRDs, its ServiceAccounts, ClusterRoles and bindings. The manager runs as its own
//! ServiceAccount, its mutating webhook served on loopback with a certificate the test makes and
//! registered by URL (`failurePolicy: Fail`, so that a pod the webhook did not see is refused,
//! not silently left alone); the FeatureFlag validating webhook is off
//! (`FLAGS_VALIDATION_ENABLED=false`).
//!
//! There is no kubelet, so the test plays its part and says where: it runs each container the
//! Operator describes as a process with exactly that container's arguments and environment, as
//! the container's ServiceAccount (a token from TokenRequest, in a mount namespace of its own at
//! `/run/secrets/kubernetes.io/serviceaccount`, with `KUBERNETES_SERVICE_HOST` and `_PORT`, as
//! in a pod), and sets the flagd-proxy Deployment's status ready once that process's `/readyz`
//! answers. The sidecar's flagd resolves the Service's cluster name through the tests' loopback
//! DNS server (its `/etc/resolv.conf`, in a mount namespace of its own, names it). Pods share
//! one network here: the FeatureFlagSource moves the sidecar's ports off the server's 8015 and
//! 8016 (`port`, `managementPort`, `ofrepPort`, and `SYNC_PORT` in `envVars`), as a user may.

mod support;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use serde_json::{Value, json};
use support::control_plane::dns::Dns;
use support::flagd::Flagd;
use support::*;

const OPERATOR_NS: &str = "open-feature-operator-system";
const PREFIX: &str = "open-feature-operator-";
const APP_NS: &str = "app";
/// The name the injected sidecar's source gives the server: the Operator's Service in its
/// namespace, in the default cluster domain.
const PROXY_SERVICE: &str = "flagd-proxy-svc.open-feature-operator-system.svc.cluster.local";
/// Where the tests' DNS server answers it: port 53, as a `resolv.conf` names no port.
const DNS_AT: ([u8; 4], u16) = ([127, 0, 0, 153], 53);

/// The documents of `config/PATH` of the Operator's sources (copied beside the manager).
fn config(path: &str) -> Vec<Value> {
    let dir = peer("operator").parent().unwrap().join("config");
    let text = std::fs::read_to_string(dir.join(path)).unwrap();
    crd_broker::yaml::documents_as_json(&text)
        .unwrap()
        .iter()
        .map(|doc| serde_json::from_slice(doc).unwrap())
        .collect()
}

/// `doc` as `config/default`'s kustomization makes it: its name prefixed, in the Operator's
/// namespace if it is namespaced, and the names it refers to (a binding's role and subjects) the
/// same.
fn kustomized(mut doc: Value) -> Value {
    let prefixed = |v: &Value| json!(format!("{PREFIX}{}", v.as_str().unwrap()));
    doc["metadata"]["name"] = prefixed(&doc["metadata"]["name"]);
    let cluster_scoped = doc["kind"].as_str().unwrap().starts_with("Cluster")
        || doc["kind"]
            .as_str()
            .unwrap()
            .ends_with("WebhookConfiguration");
    if cluster_scoped {
        doc["metadata"].as_object_mut().unwrap().remove("namespace");
    } else {
        doc["metadata"]["namespace"] = json!(OPERATOR_NS);
    }
    if doc.get("roleRef").is_some() {
        doc["roleRef"]["name"] = prefixed(&doc["roleRef"]["name"]);
    }
    let subjects = doc.get_mut("subjects").and_then(Value::as_array_mut);
    for subject in subjects.into_iter().flatten() {
        subject["name"] = prefixed(&subject["name"]);
        subject["namespace"] = json!(OPERATOR_NS);
    }
    doc
}

/// The Operator's CRDs and RBAC, its namespace, and the Deployment its own objects are owned
/// by (the manager looks it up by name to set their owner; it runs no pod here).
async fn install(plane: &control_plane::ControlPlane) {
    let crds: Vec<Value> = [
        "featureflags",
        "featureflagsources",
        "flagds",
        "inprocessconfigurations",
    ]
    .iter()
    .flat_map(|plural| config(&format!("crd/bases/core.openfeature.dev_{plural}.yaml")))
    .collect();
    plane.install_crds(&crds).await;
    plane
        .apply(&[
            json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": OPERATOR_NS } }),
            json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": APP_NS } }),
        ])
        .await;
    let rbac: Vec<Value> = [
        "service_account_manager.yaml",
        "service_account_flagd_proxy.yaml",
        "role.yaml",
        "role_binding.yaml",
        "flagd_kubernetes_sync_clusterrole.yaml",
        "flagd_kubernetes_sync_clusterrolebinding.yaml",
    ]
    .iter()
    .flat_map(|file| config(&format!("rbac/{file}")))
    .map(kustomized)
    .collect();
    plane.apply(&rbac).await;
    plane
        .apply(&[
            json!({
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": { "name": "open-feature-operator-controller-manager", "namespace": OPERATOR_NS },
                "spec": {
                    "replicas": 0,
                    "selector": { "matchLabels": { "control-plane": "controller-manager" } },
                    "template": {
                        "metadata": { "labels": { "control-plane": "controller-manager" } },
                        "spec": { "containers": [{ "name": "manager", "image": "open-feature-operator:v0.9.2" }] },
                    },
                },
            }),
            // No controller manager makes a namespace's default ServiceAccount here; pods need it.
            json!({ "apiVersion": "v1", "kind": "ServiceAccount",
                    "metadata": { "name": "default", "namespace": APP_NS } }),
        ])
        .await;
}

/// The Operator's manager, killed when dropped.
struct Manager {
    _child: tokio::process::Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Manager {
    /// Started as its ServiceAccount with `FLAGD_PROXY_IMAGE`/`TAG` set to `image`, its
    /// webhook registered, and ready.
    async fn start(plane: &control_plane::ControlPlane, image: (&str, &str)) -> Manager {
        let dir = tempfile::tempdir().unwrap();
        let pki = pki("open-feature-operator webhook");
        let certs = dir.path().join("certs");
        std::fs::create_dir(&certs).unwrap();
        std::fs::write(certs.join("tls.crt"), &pki.server_cert).unwrap();
        std::fs::write(certs.join("tls.key"), &pki.server_key).unwrap();
        let kubeconfig = plane
            .kubeconfig_for(
                OPERATOR_NS,
                "open-feature-operator-controller-manager",
                dir.path(),
                &plane.server,
            )
            .await;
        let health: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let log = dir.path().join("manager.log");
        let child = tokio::process::Command::new(peer("operator"))
            .args(["--metrics-bind-address", "0"])
            .args(["--health-probe-bind-address", &health.to_string()])
            .arg("--webhook-cert-path")
            .arg(&certs)
            .env_clear()
            .env("HOME", dir.path())
            .env("KUBECONFIG", &kubeconfig)
            .env("POD_NAMESPACE", OPERATOR_NS)
            .env("FLAGD_PROXY_IMAGE", image.0)
            .env("FLAGD_PROXY_TAG", image.1)
            .env("FLAGS_VALIDATION_ENABLED", "false")
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::options().append(true).open(&log).unwrap())
            .kill_on_drop(true)
            .leashed()
            .spawn()
            .expect("the manager starts");
        let manager = Manager {
            _child: child,
            log,
            _dir: dir,
        };
        // Its pod webhook, by URL, trusting the test's CA; refusing what it cannot reach.
        let mut webhook = kustomized(config("webhook/manifests.yaml").remove(0));
        let hook = &mut webhook["webhooks"][0];
        hook["clientConfig"] = json!({
            "url": "https://127.0.0.1:9443/mutate-v1-pod",
            "caBundle": base64(pki.ca.as_bytes()),
        });
        hook["failurePolicy"] = json!("Fail");
        plane.apply(&[webhook]).await;
        let ready = tokio::time::timeout(Duration::from_secs(60), async {
            while !matches!(try_http_get(health, "/readyz").await, Ok((200, _))) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        assert!(
            ready.is_ok(),
            "the manager is not ready:\n{}",
            manager.log_tail()
        );
        manager
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

fn base64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The first `unshare` on this machine's usual paths.
fn unshare() -> &'static str {
    ["/usr/bin/unshare", "/bin/unshare"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("unshare (util-linux)")
}

/// `program args` as in a pod of the ServiceAccount whose token, CA and namespace are the
/// files in `secrets`: mounted at `/run/secrets/kubernetes.io/serviceaccount` (a tmpfs over
/// `/run`, in a mount namespace of its own), with the API server's address in
/// `KUBERNETES_SERVICE_HOST` and `_PORT`, a `HOME`, and the container's `env`, nothing else.
fn in_pod(
    program: &Path,
    args: &[String],
    env: &[(String, String)],
    secrets: &Path,
    api: SocketAddr,
) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(unshare());
    command
        .args(["--mount", "--propagation", "private", "/bin/sh", "-c"])
        .arg(concat!(
            "s=$1; shift; /bin/mount -t tmpfs tmpfs /run",
            " && /bin/mkdir -p /run/secrets/kubernetes.io/serviceaccount",
            " && /bin/cp \"$s\"/* /run/secrets/kubernetes.io/serviceaccount/",
            " && exec \"$@\""
        ))
        .arg("sh")
        .arg(secrets)
        .arg(program)
        .args(args)
        .env_clear()
        .env("HOME", secrets.parent().unwrap())
        .env("KUBERNETES_SERVICE_HOST", api.ip().to_string())
        .env("KUBERNETES_SERVICE_PORT", api.port().to_string())
        .envs(env.iter().map(|(k, v)| (k, v)));
    command
}

/// `program args` with `env` and a `HOME` (`dir`; the container runtime sets one) only, its
/// `/etc/resolv.conf` naming the tests' DNS server (a bind mount, in a mount namespace of its
/// own).
fn with_dns(
    program: &Path,
    args: &[String],
    env: &[(String, String)],
    dir: &Path,
) -> tokio::process::Command {
    let resolv = dir.join("resolv.conf");
    let server = Ipv4Addr::from(DNS_AT.0);
    std::fs::write(
        &resolv,
        format!("nameserver {server}\noptions timeout:1 attempts:3\n"),
    )
    .unwrap();
    let mut command = tokio::process::Command::new(unshare());
    command
        .args(["--mount", "--propagation", "private", "/bin/sh", "-c"])
        .arg("r=$1; shift; /bin/mount --bind \"$r\" /etc/resolv.conf && exec \"$@\"")
        .arg("sh")
        .arg(&resolv)
        .arg(program)
        .args(args)
        .env_clear()
        .env("HOME", dir)
        .envs(env.iter().map(|(k, v)| (k, v)));
    command
}

/// A container's args and its environment (plain values), as the API server stores them.
fn args_and_env(container: &Value) -> (Vec<String>, Vec<(String, String)>) {
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    };
    let env = container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            let value = e["value"].as_str().expect("a plain value (no valueFrom)");
            (e["name"].as_str().unwrap().to_string(), value.to_string())
        })
        .collect();
    (strings(&container["args"]), env)
}

/// Polls `read` every 100 ms until it gives something, for `within` at most.
async fn until<T>(what: &str, within: Duration, mut read: impl AsyncFnMut() -> Option<T>) -> T {
    let started = Instant::now();
    loop {
        if let Some(found) = read().await {
            return found;
        }
        assert!(started.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A kind of the Operator's API group.
fn openfeature(kind: &str) -> ApiResource {
    ApiResource {
        group: "core.openfeature.dev".into(),
        version: "v1beta1".into(),
        api_version: "core.openfeature.dev/v1beta1".into(),
        kind: kind.into(),
        plural: format!("{}s", kind.to_lowercase()),
    }
}

/// Which server runs in the Deployment the Operator makes.
#[derive(Clone, Copy, Debug)]
enum Server {
    Broker,
    FlagdProxy,
}

impl Server {
    /// `FLAGD_PROXY_IMAGE` and `FLAGD_PROXY_TAG` as a user sets them for it.
    fn image(self) -> (&'static str, &'static str) {
        match self {
            Server::Broker => ("ghcr.io/crd-broker/crd-broker", env!("CARGO_PKG_VERSION")),
            Server::FlagdProxy => ("ghcr.io/open-feature/flagd-proxy", "v0.9.7"),
        }
    }

    /// The binary that image holds.
    fn binary(self) -> PathBuf {
        match self {
            Server::Broker => PathBuf::from(env!("CARGO_BIN_EXE_crd-broker")),
            Server::FlagdProxy => peer("flagd-proxy"),
        }
    }
}

/// The sidecar's own ports, moved off the server's by the FeatureFlagSource.
struct SidecarPorts {
    port: u16,
    management: u16,
    ofrep: u16,
    sync: u16,
}

/// The FeatureFlag `app/demo`, and the FeatureFlagSource `app/flag-source` naming it with
/// `provider: flagd-proxy`.
async fn flag_and_source(plane: &control_plane::ControlPlane, ports: &SidecarPorts) {
    plane
        .apply(&[
            json!({
                "apiVersion": "core.openfeature.dev/v1beta1", "kind": "FeatureFlag",
                "metadata": { "name": "demo", "namespace": APP_NS },
                "spec": { "flagSpec": { "flags": { "f": {
                    "state": "ENABLED", "variants": { "on": true, "off": false }, "defaultVariant": "on",
                } } } },
            }),
            json!({
                "apiVersion": "core.openfeature.dev/v1beta1", "kind": "FeatureFlagSource",
                "metadata": { "name": "flag-source", "namespace": APP_NS },
                "spec": {
                    "sources": [{ "source": format!("{APP_NS}/demo"), "provider": "flagd-proxy" }],
                    "port": ports.port, "managementPort": ports.management, "ofrepPort": ports.ofrep,
                    "envVars": [{ "name": "SYNC_PORT", "value": ports.sync.to_string() }],
                },
            }),
        ])
        .await;
}

/// The flagd-proxy Deployment the manager made, read back with its Service and the binding
/// that gives its ServiceAccount its rights: the Deployment, and its container's args and env.
async fn deployed(
    plane: &control_plane::ControlPlane,
    server: Server,
) -> (Value, Vec<String>, Vec<(String, String)>) {
    let admin = plane.admin().await;
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), OPERATOR_NS);
    let deployment = until("the flagd-proxy Deployment", WAIT * 3, async || {
        deployments.get_opt("flagd-proxy").await.unwrap()
    })
    .await;
    let deployment = serde_json::to_value(&deployment).unwrap();
    let pod_spec = &deployment["spec"]["template"]["spec"];
    assert_eq!(
        pod_spec["serviceAccountName"],
        "open-feature-operator-flagd-proxy"
    );
    let container = &pod_spec["containers"][0];
    let (image, tag) = server.image();
    assert_eq!(container["name"], "flagd-proxy");
    assert_eq!(container["image"], format!("{image}:{tag}"));
    let ports: Vec<(String, i64)> = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_string(),
                p["containerPort"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        ports,
        [("port".into(), 8015), ("management-port".into(), 8016)]
    );
    let (args, env) = args_and_env(container);
    eprintln!("{server:?}: the container: args {args:?}, env {env:?}, ports {ports:?}");
    let services: Api<Service> = Api::namespaced(admin, OPERATOR_NS);
    let service = until("the flagd-proxy-svc Service", WAIT, async || {
        services.get_opt("flagd-proxy-svc").await.unwrap()
    })
    .await;
    let service = serde_json::to_value(&service).unwrap();
    assert_eq!(service["spec"]["ports"][0]["port"], 8015);
    // The ServiceAccount and its rights come from the Operator's manifests, not the manager.
    let binding = plane
        .read(
            &json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                        "metadata": { "name": "open-feature-operator-flagd-kubernetes-sync" } }),
        )
        .await;
    assert!(
        binding["subjects"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["name"] == "open-feature-operator-flagd-proxy"
                && s["namespace"] == OPERATOR_NS),
        "{binding}"
    );
    (deployment, args, env)
}

/// The kubelet's part for the Deployment: its container's process, as its ServiceAccount,
/// running until dropped; the Deployment's status set ready once `/readyz` answers.
async fn run_deployment(
    plane: &control_plane::ControlPlane,
    server: Server,
    (deployment, args, env): (Value, Vec<String>, Vec<(String, String)>),
) -> (tokio::process::Child, tempfile::TempDir) {
    let pod_dir = tempfile::tempdir().unwrap();
    let secrets = pod_dir.path().join("serviceaccount");
    std::fs::create_dir(&secrets).unwrap();
    let token = plane
        .token(OPERATOR_NS, "open-feature-operator-flagd-proxy", &[], None)
        .await;
    std::fs::write(secrets.join("token"), token).unwrap();
    std::fs::copy(plane.dir.join("pki/ca.crt"), secrets.join("ca.crt")).unwrap();
    std::fs::write(secrets.join("namespace"), OPERATOR_NS).unwrap();
    let api: SocketAddr = plane.server.trim_start_matches("https://").parse().unwrap();
    let log = pod_dir.path().join("server.log");
    let child = in_pod(&server.binary(), &args, &env, &secrets, api)
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::options().append(true).open(&log).unwrap())
        .kill_on_drop(true)
        .leashed()
        .spawn()
        .expect("the server starts");
    let readyz: SocketAddr = ([127, 0, 0, 1], 8016).into();
    until(
        "the server's /readyz",
        Duration::from_secs(30),
        async || matches!(try_http_get(readyz, "/readyz").await, Ok((200, _))).then_some(()),
    )
    .await;
    let deployments: Api<Deployment> = Api::namespaced(plane.admin().await, OPERATOR_NS);
    let generation = deployment["metadata"]["generation"].as_i64().unwrap();
    deployments
        .patch_status(
            "flagd-proxy",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": {
                "observedGeneration": generation, "replicas": 1, "updatedReplicas": 1,
                "readyReplicas": 1, "availableReplicas": 1,
            } })),
        )
        .await
        .unwrap();
    (child, pod_dir)
}

/// A pod of the application with the Operator's annotations, created once the webhook admits
/// it (it defers the pod until the Deployment is ready in its cache): the flagd container it
/// injected, as stored.
async fn admitted_pod(plane: &control_plane::ControlPlane, manager: &Manager) -> Value {
    let admin = plane.admin().await;
    let sources: Api<DynamicObject> =
        Api::namespaced_with(admin.clone(), APP_NS, &openfeature("FeatureFlagSource"));
    let source_uid = sources.get("flag-source").await.unwrap().metadata.uid;
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "app", "namespace": APP_NS,
            "annotations": {
                "openfeature.dev/enabled": "true",
                "openfeature.dev/featureflagsource": "flag-source",
            },
            // The webhook mutates only pods with an owner, as a Deployment's are.
            "ownerReferences": [{ "apiVersion": "core.openfeature.dev/v1beta1",
                "kind": "FeatureFlagSource", "name": "flag-source", "uid": source_uid }],
        },
        "spec": { "containers": [{ "name": "app", "image": "app:1" }] },
    }))
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(admin, APP_NS);
    let mut refusals = Vec::new();
    let stored = until("the pod admitted", WAIT * 3, async || {
        match pods.create(&PostParams::default(), &pod).await {
            Ok(stored) => Some(stored),
            Err(e) => {
                refusals.push(e.to_string());
                None
            }
        }
    })
    .await;
    if let Some(first) = refusals.first() {
        eprintln!("refused {} times first: {first}", refusals.len());
    }
    let stored = serde_json::to_value(&stored).unwrap();
    stored["spec"]["initContainers"]
        .as_array()
        .into_iter()
        .chain(stored["spec"]["containers"].as_array())
        .flatten()
        .find(|c| c["name"] == "flagd")
        .unwrap_or_else(|| {
            panic!(
                "an injected flagd container:\n{stored:#}\n{}",
                manager.log_tail()
            )
        })
        .clone()
}

/// One route, on a control plane of its own: the manager deploys `server`, the test runs it as
/// its container, the webhook injects the sidecar into a pod, and the sidecar's flagd
/// evaluates the FeatureFlag through it and sees an edit. Each step's time, printed.
async fn route(server: Server) {
    let plane = control_plane::start("127.0.0.1");
    let started = Instant::now();
    let step = |what: &str| {
        eprintln!(
            "{server:?}: {what} at {:.2} s",
            started.elapsed().as_secs_f64()
        )
    };
    install(&plane).await;
    let manager = Manager::start(&plane, server.image()).await;
    step("the manager is ready");
    let ports = SidecarPorts {
        port: free_port(),
        management: free_port(),
        ofrep: free_port(),
        sync: free_port(),
    };
    flag_and_source(&plane, &ports).await;
    let deployment = deployed(&plane, server).await;
    step("the Operator created the flagd-proxy Deployment");
    let _server = run_deployment(&plane, server, deployment).await;
    step("the server answers /readyz as its ServiceAccount");
    let sidecar = admitted_pod(&plane, &manager).await;
    step("the webhook admitted the pod");
    let (args, env) = args_and_env(&sidecar);
    eprintln!("{server:?}: the sidecar: args {args:?}, env {env:?}");
    let source = format!("{PROXY_SERVICE}:8015");
    assert!(args.iter().any(|a| a.contains(&source)), "{args:?}");

    // The kubelet's part again: the sidecar's flagd, exactly as injected.
    let sidecar_dir = tempfile::tempdir().unwrap();
    let command = with_dns(&peer("flagd"), &args, &env, sidecar_dir.path());
    let mut flagd = Flagd::spawn(
        command,
        ([127, 0, 0, 1], ports.ofrep).into(),
        ([127, 0, 0, 1], ports.sync).into(),
        sidecar_dir,
    );
    flagd.until("f", json!(true), Duration::from_secs(30)).await;
    step("the sidecar's flagd evaluates the FeatureFlag through the server");
    let flags: Api<DynamicObject> =
        Api::namespaced_with(plane.admin().await, APP_NS, &openfeature("FeatureFlag"));
    flags
        .patch(
            "demo",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "flagSpec": { "flags": { "f": { "defaultVariant": "off" } } } } })),
        )
        .await
        .unwrap();
    let took = flagd.until("f", json!(false), Duration::from_secs(2)).await;
    eprintln!(
        "{server:?}: an edit evaluated {:.0} ms after it was written",
        took.as_secs_f64() * 1000.0
    );
    drop((flagd, manager));
    plane.down();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_manager_deploys_the_broker_and_its_sidecars_read_through_it_as_through_flagd_proxy()
 {
    // Both serve on 8015 and 8016 as the Operator starts them, and the manager's webhook on
    // 9443: one route after the other.
    let _dns = Dns::start_on(DNS_AT.into(), PROXY_SERVICE, &[Ipv4Addr::LOCALHOST]).await;
    route(Server::Broker).await;
    route(Server::FlagdProxy).await;
}
