//! The Helm chart, checked by the real helm (built from its module by `scripts/peers`): linted
//! with `helm lint --strict` (warnings and missing values are errors) and rendered with
//! `helm template` under several value sets; every rendered object round-trips through the
//! Kubernetes API types (so no field is unknown or misplaced); every flag the chart passes is
//! one the binary accepts; every value the templates reference exists and every value is
//! documented; the values meet values.schema.json (helm refuses what `jsonschema` refuses); the
//! default and the HA installs validate strictly against the Kubernetes 1.32 schemas
//! (`kubernetes-validate`); the chart README's values table is the one values.yaml generates;
//! the YAML lints clean (yamllint); and the deployment properties an SRE relies on hold. Also
//! the Dockerfile: multi-stage, multi-arch, non-root, labelled, and everything it copies exists.
//! The rendered installs run on the real control plane in `kubernetes.rs`.

mod support;

use std::path::Path;

use clap::Parser;
use serde_json::{Value, json};
use support::chart::*;

/// Drops nulls and empty maps, which typed serialization leaves out or adds.
fn normalize(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), normalize(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(normalize).collect()),
        other => other.clone(),
    }
}

/// The object survives a round trip through its Kubernetes API type unchanged: every field is
/// one the API knows, in the right place, of the right type.
fn round_trips<T: serde::de::DeserializeOwned + serde::Serialize>(doc: &Value) {
    let typed: T = serde_json::from_value(doc.clone()).unwrap_or_else(|e| {
        panic!(
            "{} {} does not match the API: {e}",
            doc["kind"], doc["metadata"]["name"]
        )
    });
    let back = serde_json::to_value(&typed).unwrap();
    assert_eq!(
        normalize(&back),
        normalize(doc),
        "{} has fields the API does not know",
        doc["kind"]
    );
}

fn check_types(docs: &[Value]) {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
    for doc in docs {
        match doc["kind"].as_str().unwrap() {
            "Deployment" => round_trips::<Deployment>(doc),
            "Service" => round_trips::<Service>(doc),
            "ServiceAccount" => round_trips::<ServiceAccount>(doc),
            "ClusterRole" => round_trips::<ClusterRole>(doc),
            "ClusterRoleBinding" => round_trips::<ClusterRoleBinding>(doc),
            "Role" => round_trips::<Role>(doc),
            "RoleBinding" => round_trips::<RoleBinding>(doc),
            "PodDisruptionBudget" => round_trips::<PodDisruptionBudget>(doc),
            "NetworkPolicy" => round_trips::<NetworkPolicy>(doc),
            "ConfigMap" => round_trips::<ConfigMap>(doc),
            "ServiceMonitor" => {
                assert_eq!(doc["apiVersion"], "monitoring.coreos.com/v1");
                assert_eq!(doc["spec"]["endpoints"][0]["port"], "admin");
                assert_eq!(doc["spec"]["endpoints"][0]["path"], "/metrics");
            }
            "PodMonitor" => {
                assert_eq!(doc["apiVersion"], "monitoring.coreos.com/v1");
                assert_eq!(doc["spec"]["podMetricsEndpoints"][0]["path"], "/metrics");
            }
            "PrometheusRule" => {
                assert_eq!(doc["apiVersion"], "monitoring.coreos.com/v1");
                assert!(
                    doc["spec"]["groups"]
                        .as_array()
                        .is_some_and(|g| !g.is_empty())
                );
            }
            other => panic!("unexpected kind {other}"),
        }
    }
}

/// The container's arguments parse as the binary's command line.
fn args_parse(docs: &[Value]) -> crd_broker::cli::Serve {
    let args: Vec<String> = container(docs)["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    assert_eq!(args[0], "serve");
    let cli = crd_broker::cli::Cli::try_parse_from(
        std::iter::once("crd-broker".to_string()).chain(args.clone()),
    )
    .unwrap_or_else(|e| panic!("the chart passes flags the binary refuses: {e}\n{args:?}"));
    match cli.command {
        crd_broker::cli::Command::Serve(serve) => *serve,
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_default_chart_renders_a_hardened_highly_available_deployment() {
    let docs = render(json!({})).expect("renders");
    check_types(&docs);
    let serve = args_parse(&docs);
    let deployment = kind(&docs, "Deployment")[0];
    let pod = &deployment["spec"]["template"]["spec"];
    assert!(deployment["spec"]["replicas"].as_u64().unwrap() >= 2);
    assert_eq!(
        pod["topologySpreadConstraints"][0]["topologyKey"],
        "kubernetes.io/hostname"
    );
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace > serve.shutdown_grace.as_secs(),
        "terminationGracePeriodSeconds {grace} above --shutdown-grace {:?}",
        serve.shutdown_grace
    );
    assert_eq!(serve.resources.len(), 1);
    assert_eq!(
        serve.resources[0].to_string(),
        "featureflags.core.openfeature.dev"
    );
    let c = container(&docs);
    let meta = yaml_file(&chart().join("Chart.yaml"));
    assert!(
        c["image"]
            .as_str()
            .unwrap()
            .ends_with(&format!(":{}", meta["appVersion"].as_str().unwrap()))
    );
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/livez");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], "admin");
    let sc = &c["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);

    let services = kind(&docs, "Service");
    let headless = services
        .iter()
        .find(|s| s["spec"]["clusterIP"] == "None")
        .expect("a headless Service");
    assert_eq!(headless["metadata"]["name"], "flags-crd-broker-headless");
    let cluster_ip = services
        .iter()
        .find(|s| s["spec"]["type"] == "ClusterIP")
        .expect("a ClusterIP Service");
    assert_eq!(cluster_ip["metadata"]["name"], "flags-crd-broker");

    assert_eq!(
        serve.identity.to_string(),
        "peer-pod,token",
        "identity on by default"
    );
    let role = kind(&docs, "ClusterRole")[0];
    assert_eq!(
        role["rules"],
        json!([
            { "apiGroups": ["core.openfeature.dev"], "resources": ["featureflags"], "verbs": ["get", "list", "watch"] },
            { "apiGroups": [""], "resources": ["pods"], "verbs": ["list"] },
            { "apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"] },
        ]),
        "least privilege: the kinds served, and what each identity source needs"
    );
    let policy = kind(&docs, "NetworkPolicy")[0];
    let ingress = policy["spec"]["ingress"].as_array().unwrap();
    assert_eq!(ingress.len(), 2);
    assert_eq!(ingress[0]["ports"][0]["port"], "grpc");
    assert_eq!(ingress[0]["from"], json!([{ "namespaceSelector": {} }]));
    assert_eq!(ingress[1]["ports"][0]["port"], "admin");
    assert_eq!(
        ingress[1]["from"],
        json!([{ "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": "monitoring" } } }]),
        "the admin port only from the monitoring namespaces"
    );
    assert!(kind(&docs, "ConfigMap").is_empty(), "no policy by default");
    assert!(serve.policy.is_none());
    let binding = kind(&docs, "ClusterRoleBinding")[0];
    assert_eq!(
        binding["subjects"][0]["name"],
        kind(&docs, "ServiceAccount")[0]["metadata"]["name"]
    );
    assert_eq!(binding["subjects"][0]["namespace"], "openfeature");
    assert_eq!(kind(&docs, "PodDisruptionBudget").len(), 1);
    assert!(kind(&docs, "ServiceMonitor").is_empty(), "off by default");
}

#[test]
fn every_option_renders_and_stands_in_for_flagd_proxy() {
    let docs = render(json!({
        "replicaCount": 3,
        "kinds": [
            { "group": "core.openfeature.dev", "plural": "featureflags", "version": "v1beta1" },
            { "group": "example.com", "plural": "widgets", "version": "" },
        ],
        "tls": { "enabled": true, "secretName": "broker-tls", "clientAuth": true },
        "service": { "name": "flagd-proxy-svc", "portName": "flagd-proxy", "annotations": { "a": "b" } },
        "serviceMonitor": { "enabled": true, "labels": { "release": "prometheus" } },
        "extraArgs": ["--readiness-interval=5s"],
        "extraEnv": [{ "name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://collector:4317" }],
        "podAnnotations": { "x": "y" },
        "podLabels": { "team": "flags" },
        "nodeSelector": { "kubernetes.io/os": "linux" },
        "tolerations": [{ "key": "k", "operator": "Exists" }],
        "imagePullSecrets": [{ "name": "registry" }],
        "serviceAccount": { "annotations": { "eks.amazonaws.com/role-arn": "arn" } },
        "access": {
            "identity": "mtls,mesh",
            "mesh": "istio",
            "policy": { "ownNamespace": false, "grants": [{ "from": "team-a", "read": ["shared"], "kinds": ["featureflags.core.openfeature.dev"] }] },
            "maxWatches": 500,
            "maxWatchesPerCaller": 50,
        },
        "networkPolicy": { "monitoringNamespaces": ["monitoring", "observability"] },
    }))
    .expect("renders");
    check_types(&docs);
    let serve = args_parse(&docs);
    assert_eq!(serve.identity.to_string(), "mtls,mesh");
    assert_eq!(serve.mesh, Some(crd_broker::access::Mesh::Istio));
    assert_eq!(serve.max_watches, 500);
    assert_eq!(
        serve.broker_config().access.limits.max_watches_per_caller,
        50
    );
    assert_eq!(
        serve.policy.as_deref(),
        Some(Path::new("/etc/crd-broker/policy/policy.yaml"))
    );
    let config_map = kind(&docs, "ConfigMap")[0];
    let text = config_map["data"]["policy.yaml"].as_str().unwrap();
    let parsed = crd_broker::access::policy::Policy::parse(text)
        .expect("the policy the chart writes parses");
    assert!(!parsed.own_namespace);
    assert_eq!(parsed.grants.len(), 1);
    let pod_spec = &kind(&docs, "Deployment")[0]["spec"]["template"]["spec"];
    assert_eq!(
        pod_spec["volumes"][1]["configMap"]["name"],
        config_map["metadata"]["name"]
    );
    // Neither mtls nor mesh asks the API server: no extra rights.
    let rules = kind(&docs, "ClusterRole")[0]["rules"]
        .as_array()
        .unwrap()
        .clone();
    assert!(rules.iter().all(|r| r["resources"] != json!(["pods"]) && r["resources"] != json!(["tokenreviews"])));
    let admin_from = &kind(&docs, "NetworkPolicy")[0]["spec"]["ingress"][1]["from"];
    assert_eq!(admin_from.as_array().unwrap().len(), 2);
    assert_eq!(
        serve.tls_cert.as_deref(),
        Some(Path::new("/etc/crd-broker/tls/tls.crt"))
    );
    assert_eq!(
        serve.tls_client_ca.as_deref(),
        Some(Path::new("/etc/crd-broker/tls/ca.crt"))
    );
    assert_eq!(
        serve
            .resources
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        [
            "featureflags.v1beta1.core.openfeature.dev",
            "widgets.example.com"
        ]
    );
    let services = kind(&docs, "Service");
    let stand_in = services
        .iter()
        .find(|s| s["metadata"]["name"] == "flagd-proxy-svc")
        .expect("named as flagd-proxy's");
    assert_eq!(stand_in["spec"]["ports"][0]["name"], "flagd-proxy");
    assert_eq!(stand_in["spec"]["ports"][0]["port"], 8015);
    let role = kind(&docs, "ClusterRole")[0];
    assert_eq!(role["rules"].as_array().unwrap().len(), 2);
    assert_eq!(
        kind(&docs, "ServiceMonitor")[0]["metadata"]["labels"]["release"],
        "prometheus"
    );
    let pod = &kind(&docs, "Deployment")[0]["spec"]["template"]["spec"];
    assert_eq!(pod["volumes"][0]["secret"]["secretName"], "broker-tls");
}

/// The xDS bootstrap ConfigMap the chart renders, and its `bootstrap.json`.
fn xds_bootstrap(docs: &[Value]) -> (Value, Value) {
    let map = kind(docs, "ConfigMap")
        .into_iter()
        .find(|m| {
            m["metadata"]["name"]
                .as_str()
                .unwrap()
                .ends_with("-xds-bootstrap")
        })
        .expect("the bootstrap");
    let text = map["data"]["bootstrap.json"].as_str().unwrap();
    let bootstrap = serde_json::from_str(text).expect("the bootstrap is JSON");
    (map.clone(), bootstrap)
}

/// `xds.enabled`: the flag for the headless Service, the right to watch its EndpointSlices (in
/// its namespace only), and the clients' bootstrap, plain or over TLS.
#[test]
fn xds_serves_the_headless_service_and_renders_the_clients_bootstrap() {
    let docs =
        render(json!({ "xds": { "enabled": true, "drainNoticeSeconds": 3 } })).expect("renders");
    check_types(&docs);
    let serve = args_parse(&docs);
    let service = serve.xds_service.expect("--xds-service");
    let headless = kind(&docs, "Service")
        .into_iter()
        .find(|s| s["spec"]["clusterIP"] == "None")
        .expect("the headless Service");
    assert_eq!(service.name, headless["metadata"]["name"].as_str().unwrap());
    assert_eq!(service.port, 8015);
    assert_eq!(serve.xds_drain_notice, std::time::Duration::from_secs(3));
    let role = kind(&docs, "Role")
        .into_iter()
        .find(|r| r["metadata"]["name"].as_str().unwrap().ends_with("-xds"))
        .expect("a Role for the EndpointSlices");
    assert!(
        role["metadata"]["namespace"].is_null(),
        "the release's namespace"
    );
    assert_eq!(
        role["rules"],
        json!([{ "apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"] }])
    );
    let binding = kind(&docs, "RoleBinding")
        .into_iter()
        .find(|r| r["roleRef"]["name"] == role["metadata"]["name"])
        .expect("bound");
    assert_eq!(binding["subjects"][0]["kind"], "ServiceAccount");
    let (map, bootstrap) = xds_bootstrap(&docs);
    assert_eq!(
        bootstrap["xds_servers"][0]["channel_creds"],
        json!([{ "type": "insecure" }])
    );
    assert_eq!(
        bootstrap["node"]["locality"],
        json!({}),
        "grpc-js-xds needs one"
    );
    assert_eq!(
        map["data"]["target"],
        format!("xds:///{}.{}:8015", service.name, service.namespace)
    );
    // Over TLS the clients verify the broker with the CA they are given.
    let docs = render(json!({
        "xds": { "enabled": true, "bootstrap": { "caCertificateFile": "/etc/ca/ca.crt" } },
        "tls": { "enabled": true, "secretName": "broker-tls" },
    }))
    .expect("renders");
    let (_, bootstrap) = xds_bootstrap(&docs);
    assert_eq!(
        bootstrap["xds_servers"][0]["channel_creds"],
        json!([{ "type": "tls", "config": { "ca_certificate_file": "/etc/ca/ca.crt" } }])
    );
    // Off by default: no flag, no rights, no bootstrap.
    let docs = render(json!({})).unwrap();
    assert!(args_parse(&docs).xds_service.is_none());
    assert!(kind(&docs, "ConfigMap").is_empty());
}

#[test]
fn wrong_values_are_refused_with_a_reason() {
    let err = render(json!({ "terminationGracePeriodSeconds": 10 })).unwrap_err();
    assert!(
        err.contains(
            "terminationGracePeriodSeconds must be above preStopSleepSeconds + shutdownGraceSeconds"
        ),
        "{err}"
    );
    let err = render(json!({ "tls": { "enabled": true } })).unwrap_err();
    assert!(err.contains("tls.secretName is required"), "{err}");
    // The xDS drain notice is part of the drain Kubernetes must wait for.
    let err = render(json!({
        "terminationGracePeriodSeconds": 26,
        "xds": { "enabled": true, "drainNoticeSeconds": 5 },
    }))
    .unwrap_err();
    assert!(err.contains("xds.drainNoticeSeconds"), "{err}");
    let err = render(json!({
        "xds": { "enabled": true },
        "headlessService": { "enabled": false },
    }))
    .unwrap_err();
    assert!(err.contains("set headlessService.enabled"), "{err}");
    let err = render(json!({ "access": { "identity": "mtls" } })).unwrap_err();
    assert!(err.contains("needs client certificates"), "{err}");
    let err = render(json!({ "access": { "identity": "peer-pod,mesh" } })).unwrap_err();
    assert!(
        err.contains("access.identity mesh needs access.mesh"),
        "{err}"
    );
    // With no monitoring namespaces nobody reaches the admin port (an empty `from` would let
    // everyone in).
    let docs = render(json!({ "networkPolicy": { "monitoringNamespaces": [] } })).unwrap();
    let ingress = kind(&docs, "NetworkPolicy")[0]["spec"]["ingress"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(ingress.len(), 1);
    assert_eq!(ingress[0]["ports"][0]["port"], "grpc");
}

/// Every `.Values.x.y` in the templates exists in values.yaml.
#[test]
fn every_referenced_value_exists_and_every_value_is_documented() {
    let values = yaml_file(&chart().join("values.yaml"));
    for entry in std::fs::read_dir(chart().join("templates")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, _) in text.match_indices(".Values.") {
            let rest = &text[i + ".Values.".len()..];
            let reference: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '.' || *c == '_')
                .collect();
            let mut node = &values;
            for part in reference.trim_end_matches('.').split('.') {
                node = node.get(part).unwrap_or_else(|| {
                    panic!(
                        "{} references .Values.{reference}, which values.yaml does not have",
                        path.display()
                    )
                });
            }
        }
    }
    // A key is documented by a comment block starting `# --` right above it, or by its parent's.
    let text = std::fs::read_to_string(chart().join("values.yaml")).unwrap();
    let mut documented_indents: Vec<usize> = Vec::new();
    let mut comment = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.starts_with("# --") {
            comment = true;
            continue;
        }
        if trimmed.starts_with('#') || trimmed.is_empty() {
            continue;
        }
        documented_indents.retain(|d| *d < indent);
        let is_key = !trimmed.starts_with('-') && trimmed.contains(':');
        if is_key && documented_indents.is_empty() {
            let has_children = trimmed.ends_with(':');
            assert!(
                comment || has_children,
                "values.yaml: {trimmed:?} has no `# --` description"
            );
        }
        if is_key && comment {
            documented_indents.push(indent);
        }
        comment = false;
    }
    lint(&[&chart().join("values.yaml"), &chart().join("Chart.yaml")]);
}

#[test]
fn the_dockerfile_is_multi_stage_multi_arch_non_root_labelled_and_copies_what_exists() {
    let text = std::fs::read_to_string(Path::new(ROOT).join("Dockerfile")).unwrap();
    let froms: Vec<&str> = text.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert!(froms.len() >= 2, "multi-stage: {froms:?}");
    assert!(
        froms.last().unwrap().contains("distroless") && froms.last().unwrap().contains("nonroot"),
        "a small non-root runtime image"
    );
    let user = text
        .lines()
        .rfind(|l| l.starts_with("USER "))
        .expect("a USER");
    assert!(!user.contains("root") || user.contains("nonroot"));
    assert!(user.contains("65532"), "{user}");
    let mut copied = Vec::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from="))
    {
        let parts: Vec<&str> = line.split_whitespace().skip(1).collect();
        for source in &parts[..parts.len() - 1] {
            copied.push(source.to_string());
            assert!(
                Path::new(ROOT).join(source).exists(),
                "the Dockerfile copies {source}, which does not exist"
            );
        }
    }
    // The members of the workspace must all be in the build context.
    let manifest: toml_value::Manifest = toml_value::read(&Path::new(ROOT).join("Cargo.toml"));
    for member in manifest.members.iter().filter(|m| *m != ".") {
        assert!(
            text.contains(&format!("COPY {member} {member}")),
            "the Dockerfile does not copy the workspace member {member}"
        );
    }
    // Cargo reads every target the manifest declares, so their files must be there too.
    for bench in &manifest.benches {
        let file = format!("benches/{bench}.rs");
        assert!(
            copied.iter().any(|c| Path::new(&file).starts_with(c)),
            "the Dockerfile does not copy {file}, which Cargo.toml declares"
        );
    }
    assert!(text.contains("ENTRYPOINT [\"/usr/local/bin/crd-broker\"]"));
    // Built for --platform linux/amd64 and linux/arm64 by cross-compiling on the builder's own
    // platform, each architecture to its triple.
    assert!(
        text.starts_with("# syntax=docker/dockerfile:1"),
        "BuildKit syntax"
    );
    assert!(froms[0].contains("--platform=$BUILDPLATFORM"), "{froms:?}");
    for arch in [
        "amd64) triple=x86_64-unknown-linux-gnu",
        "arm64) triple=aarch64-unknown-linux-gnu",
    ] {
        assert!(text.contains(arch), "no {arch}");
    }
    // Dependencies stay compiled between builds: the target directory is a cache mount of the
    // step that builds (per architecture).
    let build = text
        .split("RUN ")
        .find(|step| step.contains("cargo build"))
        .expect("a cargo build step");
    assert!(
        build.contains("--mount=type=cache,target=/src/target")
            && build.contains("--mount=type=cache,target=/usr/local/cargo/registry")
            && build.contains("$TARGETARCH"),
        "{build}"
    );
    for label in [
        "org.opencontainers.image.title",
        "org.opencontainers.image.version",
        "org.opencontainers.image.revision",
        "org.opencontainers.image.licenses=\"Apache-2.0\"",
    ] {
        assert!(text.contains(label), "OCI label {label}");
    }
    let license = std::fs::read_to_string(Path::new(ROOT).join("LICENSE")).unwrap();
    assert!(license.contains("Apache License") && license.contains("Version 2.0"));
}

/// Just enough TOML reading for the workspace's member list and the declared benchmarks.
mod toml_value {
    pub struct Manifest {
        pub members: Vec<String>,
        pub benches: Vec<String>,
    }

    pub fn read(path: &std::path::Path) -> Manifest {
        let text = std::fs::read_to_string(path).unwrap();
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with("members"))
            .expect("a members line");
        let list = line.split_once('[').unwrap().1.split_once(']').unwrap().0;
        // The `name` following each `[[bench]]` header.
        let benches = text
            .split("[[bench]]")
            .skip(1)
            .filter_map(|section| {
                let line = section
                    .lines()
                    .find(|l| l.trim_start().starts_with("name"))?;
                Some(line.split_once('=')?.1.trim().trim_matches('"').to_string())
            })
            .collect();
        Manifest {
            benches,
            members: list
                .split(',')
                .map(|m| m.trim().trim_matches('"').to_string())
                .filter(|m| !m.is_empty())
                .collect(),
        }
    }
}

#[test]
fn watch_namespaces_confine_the_broker_and_grant_by_a_role_in_each() {
    let docs = render(json!({
        "watchNamespaces": ["team-a", "team-b"],
        "access": { "identity": "mesh", "mesh": "linkerd" },
    }))
    .expect("renders");
    check_types(&docs);
    let serve = args_parse(&docs);
    assert_eq!(serve.namespaces, ["team-a", "team-b"]);
    // Nothing cluster-wide is needed: mesh identity asks the API server nothing.
    assert!(kind(&docs, "ClusterRole").is_empty());
    assert!(kind(&docs, "ClusterRoleBinding").is_empty());
    let roles = kind(&docs, "Role");
    let bindings = kind(&docs, "RoleBinding");
    assert_eq!(roles.len(), 2);
    assert_eq!(bindings.len(), 2);
    for (role, ns) in roles.iter().zip(["team-a", "team-b"]) {
        assert_eq!(role["metadata"]["namespace"], ns);
        assert_eq!(
            role["rules"][0],
            json!({ "apiGroups": ["core.openfeature.dev"], "resources": ["featureflags"], "verbs": ["get", "list", "watch"] })
        );
    }
    for binding in bindings {
        assert_eq!(binding["subjects"][0]["namespace"], "openfeature");
        assert_eq!(binding["roleRef"]["kind"], "Role");
    }
    // With peer-pod identity the pods right stays cluster-wide, and only it.
    let docs = render(json!({ "watchNamespaces": ["team-a"] })).expect("renders");
    let rules = &kind(&docs, "ClusterRole")[0]["rules"];
    assert!(
        rules
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["resources"] != json!(["featureflags"])),
        "{rules}"
    );
}

#[test]
fn the_alerts_and_the_dashboard_ship_in_the_chart_as_their_files_hold_them() {
    let defaults = render(json!({})).expect("renders");
    assert!(
        kind(&defaults, "PrometheusRule").is_empty(),
        "off by default"
    );
    let docs = render(json!({
        "prometheusRule": { "enabled": true, "labels": { "release": "prometheus" } },
        "grafanaDashboard": { "enabled": true },
    }))
    .expect("renders");
    check_types(&docs);
    let rule = kind(&docs, "PrometheusRule")[0];
    assert_eq!(rule["metadata"]["labels"]["release"], "prometheus");
    let file: Value = crd_broker::yaml::from_str(
        &std::fs::read_to_string(chart().join("files/alerts.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(rule["spec"]["groups"], file["groups"]);
    let dashboard = kind(&docs, "ConfigMap")
        .into_iter()
        .find(|c| c["metadata"]["name"] == "flags-crd-broker-dashboard")
        .expect("the dashboard's ConfigMap");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value =
        serde_json::from_str(dashboard["data"]["crd-broker.json"].as_str().unwrap()).unwrap();
    let file: Value = serde_json::from_str(
        &std::fs::read_to_string(chart().join("files/dashboard.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(json, file);
}

#[test]
fn a_pdb_only_with_more_than_one_replica_and_monitoring_without_the_headless_service() {
    let one = render(json!({ "replicaCount": 1 })).expect("renders");
    assert!(
        kind(&one, "PodDisruptionBudget").is_empty(),
        "one replica: a PDB would block every node drain"
    );
    let two = render(json!({})).expect("renders");
    let pdb = kind(&two, "PodDisruptionBudget")[0];
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    assert!(pdb["spec"].get("minAvailable").is_none());
    let half =
        render(json!({ "replicaCount": 4, "podDisruptionBudget": { "minAvailable": "50%" } }))
            .expect("renders");
    assert_eq!(
        kind(&half, "PodDisruptionBudget")[0]["spec"]["minAvailable"],
        "50%"
    );

    // A ServiceMonitor selects its own metrics Service, which exists without the headless one.
    let docs = render(json!({
        "headlessService": { "enabled": false },
        "serviceMonitor": { "enabled": true },
        "podMonitor": { "enabled": true },
    }))
    .expect("renders");
    check_types(&docs);
    let monitor = kind(&docs, "ServiceMonitor")[0];
    let wanted = monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap();
    let selected: Vec<&Value> = kind(&docs, "Service")
        .into_iter()
        .filter(|s| {
            wanted
                .iter()
                .all(|(k, v)| &s["metadata"]["labels"][k.as_str()] == v)
        })
        .collect();
    assert_eq!(
        selected.len(),
        1,
        "exactly the metrics Service: {selected:?}"
    );
    let port = monitor["spec"]["endpoints"][0]["port"].as_str().unwrap();
    assert!(
        selected[0]["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == port),
        "the metrics Service has the port scraped"
    );
    let pods = kind(&docs, "PodMonitor")[0];
    assert_eq!(pods["spec"]["podMetricsEndpoints"][0]["port"], "admin");
    assert_eq!(
        pods["spec"]["selector"]["matchLabels"],
        kind(&docs, "Deployment")[0]["spec"]["selector"]["matchLabels"]
    );
}

#[test]
fn probes_addresses_zone_spread_and_the_pre_stop_sleep_are_set_by_values() {
    let docs = render(json!({
        "listenAddress": "0.0.0.0",
        "probes": { "readiness": { "periodSeconds": 3, "timeoutSeconds": 1, "failureThreshold": 4 } },
        "preStopSleepSeconds": 8,
        "terminationGracePeriodSeconds": 40,
    }))
    .expect("renders");
    let serve = args_parse(&docs);
    assert_eq!(serve.grpc_addr.0.unwrap().to_string(), "0.0.0.0:8015");
    let c = container(&docs);
    assert_eq!(c["readinessProbe"]["periodSeconds"], 3);
    assert_eq!(c["readinessProbe"]["failureThreshold"], 4);
    assert_eq!(
        c["livenessProbe"]["periodSeconds"], 10,
        "the others keep their defaults"
    );
    assert_eq!(c["lifecycle"]["preStop"]["sleep"]["seconds"], 8);
    let defaults = render(json!({})).expect("renders");
    assert_eq!(
        args_parse(&defaults).grpc_addr.0.unwrap().to_string(),
        "[::]:8015"
    );
    let spread =
        &kind(&defaults, "Deployment")[0]["spec"]["template"]["spec"]["topologySpreadConstraints"];
    let keys: Vec<&str> = spread
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["topologyKey"].as_str().unwrap())
        .collect();
    assert_eq!(
        keys,
        ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
    );
    let err = render(json!({ "preStopSleepSeconds": 15 })).unwrap_err();
    assert!(
        err.contains("preStopSleepSeconds + shutdownGraceSeconds"),
        "{err}"
    );
}

#[test]
fn values_are_checked_against_values_schema_json() {
    for (values, want) in [
        (
            json!({ "replicaCount": "two" }),
            "replicaCount: 'two' is not of type 'integer'",
        ),
        (
            json!({ "logFormat": "xml" }),
            "logFormat: 'xml' is not one of",
        ),
        (
            json!({ "grpc": { "port": 70000 } }),
            "grpc/port: 70000 is greater than the maximum",
        ),
        (
            json!({ "replicas": 3 }),
            "Additional properties are not allowed ('replicas'",
        ),
        (
            json!({ "access": { "identity": "pod-ip" } }),
            "access/identity: 'pod-ip' does not match",
        ),
        (json!({ "linger": "soon" }), "linger: 'soon' does not match"),
        (
            json!({ "kinds": [{ "plural": "featureflags" }] }),
            "kinds/0: 'group' is a required property",
        ),
        (
            json!({ "watchNamespaces": ["Team_A"] }),
            "watchNamespaces/0: 'Team_A' does not match",
        ),
    ] {
        let err = render(values.clone()).unwrap_err();
        assert!(err.contains(want), "{values}: {err}");
    }
    let ha = yaml_file(&chart().join("ci/ha-values.yaml"));
    render(ha).expect("the HA example meets the schema");
}

#[test]
fn the_default_and_ha_installs_validate_against_the_kubernetes_schemas() {
    for values in [json!({}), yaml_file(&chart().join("ci/ha-values.yaml"))] {
        let docs = render(values).expect("renders");
        check_types(&docs);
        kubernetes_validate(&docs);
    }
}

#[test]
fn the_chart_readme_lists_every_documented_value() {
    let path = chart().join("README.md");
    let readme = std::fs::read_to_string(&path).unwrap();
    let (head, rest) = readme.split_once("<!-- values:begin -->\n").unwrap();
    let (_, tail) = rest.split_once("<!-- values:end -->").unwrap();
    let want = format!(
        "{head}<!-- values:begin -->\n{}<!-- values:end -->{tail}",
        values_table()
    );
    if std::env::var_os("UPDATE_CHART_README").is_some() && readme != want {
        std::fs::write(&path, &want).unwrap();
        return;
    }
    assert!(
        readme == want,
        "helm/crd-broker/README.md is out of date: run UPDATE_CHART_README=1 cargo test --test helm chart_readme"
    );
    for key in [
        "replicaCount",
        "podDisruptionBudget.maxUnavailable",
        "probes.readiness",
        "preStopSleepSeconds",
    ] {
        assert!(want.contains(&format!("| `{key}` |")), "{key}");
    }
}
