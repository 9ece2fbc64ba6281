//! Kinds the fake serves: each custom resource definition becomes a [`Kind`], and a few built-in
//! kinds (CRDs themselves, access and token reviews) are described the same way.

use std::cmp::Ordering;

use serde_json::{Value, json};

/// A served resource: one CRD, or one built-in kind.
#[derive(Debug, Clone, PartialEq)]
pub struct Kind {
    /// API group, e.g. `core.openfeature.dev`.
    pub group: String,
    /// Plural resource name, the path segment: `featureflags`.
    pub plural: String,
    /// Singular name: `featureflag`.
    pub singular: String,
    /// The kind: `FeatureFlag`.
    pub kind: String,
    /// The list kind: `FeatureFlagList`.
    pub list_kind: String,
    /// `kubectl` short names.
    pub short_names: Vec<String>,
    /// Categories (`all`, …).
    pub categories: Vec<String>,
    /// Whether objects live in namespaces.
    pub namespaced: bool,
    /// Served versions, highest priority first (the Kubernetes version ordering).
    pub versions: Vec<Version>,
    /// What clients may do with it.
    pub verbs: &'static [&'static str],
    /// Whether objects are stored (false for review kinds, which only answer a create).
    pub stored: bool,
    /// Fields a `fieldSelector` may name besides `metadata.name` and `metadata.namespace`, each
    /// with the value an object that lacks it has (as the real server converts them).
    pub selectable_fields: &'static [(&'static str, &'static str)],
}

/// The fields pods can be selected by (the API's pod field label conversion).
pub const POD_FIELDS: &[(&str, &str)] = &[
    ("spec.nodeName", ""),
    ("spec.restartPolicy", ""),
    ("spec.schedulerName", ""),
    ("spec.serviceAccountName", ""),
    ("spec.hostNetwork", "false"),
    ("status.phase", ""),
    ("status.podIP", ""),
    ("status.nominatedNodeName", ""),
];

/// One served version of a kind.
#[derive(Debug, Clone, PartialEq)]
pub struct Version {
    /// `v1beta1`.
    pub name: String,
    /// The structural schema (`openAPIV3Schema`) of objects at this version.
    pub schema: Option<Value>,
    /// Whether `/status` is a subresource (then main-resource writes keep the old status).
    pub status_subresource: bool,
    /// `additionalPrinterColumns`, used when a client asks for a Table.
    pub printer_columns: Vec<Value>,
}

/// Verbs of a stored resource, in the order the real discovery lists them.
pub const STORED_VERBS: &[&str] = &[
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "create",
    "update",
    "watch",
];

impl Kind {
    /// Reads a `apiextensions.k8s.io/v1` CustomResourceDefinition; the error lists the
    /// `(field, message)` causes of a 422.
    pub fn from_crd(crd: &Value) -> Result<Kind, Vec<(String, String)>> {
        let spec = &crd["spec"];
        let mut causes = Vec::new();
        let mut text = |path: &str, v: &Value| -> String {
            match v.as_str() {
                Some(s) if !s.is_empty() => s.to_string(),
                _ => {
                    causes.push((path.to_string(), "Required value".to_string()));
                    String::new()
                }
            }
        };
        let group = text("spec.group", &spec["group"]);
        let names = &spec["names"];
        let plural = text("spec.names.plural", &names["plural"]);
        let kind = text("spec.names.kind", &names["kind"]);
        let list_kind = names["listKind"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("{kind}List"));
        let singular = names["singular"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| kind.to_lowercase());
        let namespaced = match spec["scope"].as_str() {
            Some("Namespaced") => true,
            Some("Cluster") => false,
            _ => {
                causes.push((
                    "spec.scope".to_string(),
                    "Unsupported value: supported values: \"Cluster\", \"Namespaced\"".to_string(),
                ));
                true
            }
        };
        let expected = format!("{plural}.{group}");
        if crd["metadata"]["name"].as_str() != Some(expected.as_str()) {
            causes.push((
                "metadata.name".to_string(),
                format!(
                    "Invalid value: \"{}\": must be spec.names.plural+\".\"+spec.group",
                    crd["metadata"]["name"].as_str().unwrap_or("")
                ),
            ));
        }
        let mut versions = Vec::new();
        let mut storage = 0;
        for (i, v) in spec["versions"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            let Some(name) = v["name"].as_str() else {
                causes.push((format!("spec.versions[{i}].name"), "Required value".into()));
                continue;
            };
            if v["storage"].as_bool() == Some(true) {
                storage += 1;
            }
            if v["served"].as_bool() != Some(true) {
                continue;
            }
            versions.push(Version {
                name: name.to_string(),
                schema: v["schema"].get("openAPIV3Schema").cloned(),
                status_subresource: v["subresources"].get("status").is_some(),
                printer_columns: v["additionalPrinterColumns"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default(),
            });
        }
        if storage != 1 {
            causes.push((
                "spec.versions".to_string(),
                "Invalid value: must have exactly one version marked as storage version"
                    .to_string(),
            ));
        }
        if !causes.is_empty() {
            return Err(causes);
        }
        versions.sort_by(|a, b| version_priority(&a.name, &b.name));
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        Ok(Kind {
            group,
            plural,
            singular,
            kind,
            list_kind,
            short_names: strings(&names["shortNames"]),
            categories: strings(&names["categories"]),
            namespaced,
            versions,
            verbs: STORED_VERBS,
            stored: true,
            selectable_fields: &[],
        })
    }

    /// The served version called `name`.
    pub fn version(&self, name: &str) -> Option<&Version> {
        self.versions.iter().find(|v| v.name == name)
    }

    /// `group/version` for `apiVersion` fields.
    pub fn api_version(&self, version: &str) -> String {
        if self.group.is_empty() {
            version.to_string()
        } else {
            format!("{}/{version}", self.group)
        }
    }

    /// The CRD kind itself: `apiextensions.k8s.io/v1` `customresourcedefinitions`.
    pub fn crd_kind() -> Kind {
        Kind {
            group: "apiextensions.k8s.io".into(),
            plural: "customresourcedefinitions".into(),
            singular: "customresourcedefinition".into(),
            kind: "CustomResourceDefinition".into(),
            list_kind: "CustomResourceDefinitionList".into(),
            short_names: vec!["crd".into(), "crds".into()],
            categories: vec!["api-extensions".into()],
            namespaced: false,
            versions: vec![Version {
                name: "v1".into(),
                schema: Some(
                    json!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true }),
                ),
                status_subresource: true,
                printer_columns: vec![json!({
                    "name": "Created At", "type": "date", "jsonPath": ".metadata.creationTimestamp"
                })],
            }],
            verbs: STORED_VERBS,
            stored: true,
            selectable_fields: &[],
        }
    }

    /// The core `v1` `Namespace` kind: namespaced objects can only be created in one that exists.
    pub fn namespace_kind() -> Kind {
        Kind {
            group: String::new(),
            plural: "namespaces".into(),
            singular: "namespace".into(),
            kind: "Namespace".into(),
            list_kind: "NamespaceList".into(),
            short_names: vec!["ns".into()],
            categories: vec![],
            namespaced: false,
            versions: vec![Version {
                name: "v1".into(),
                schema: None,
                status_subresource: true,
                printer_columns: vec![
                    json!({ "name": "Status", "type": "string", "jsonPath": ".status.phase" }),
                    json!({ "name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp" }),
                ],
            }],
            verbs: &[
                "create", "delete", "get", "list", "patch", "update", "watch",
            ],
            stored: true,
            selectable_fields: &[],
        }
    }

    /// The core `v1` `Pod` kind, with the pod field selectors (`status.podIP`, …) and a status
    /// subresource, as a kubelet writes it. Nothing runs the pods: tests set their status.
    pub fn pod_kind() -> Kind {
        Kind {
            group: String::new(),
            plural: "pods".into(),
            singular: "pod".into(),
            kind: "Pod".into(),
            list_kind: "PodList".into(),
            short_names: vec!["po".into()],
            categories: vec!["all".into()],
            namespaced: true,
            versions: vec![Version {
                name: "v1".into(),
                schema: None,
                status_subresource: true,
                printer_columns: vec![
                    json!({ "name": "Status", "type": "string", "jsonPath": ".status.phase" }),
                    json!({ "name": "IP", "type": "string", "jsonPath": ".status.podIP" }),
                    json!({ "name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp" }),
                ],
            }],
            verbs: STORED_VERBS,
            stored: true,
            selectable_fields: POD_FIELDS,
        }
    }

    /// Whether this is a built-in kind (served by the API server itself, not by a CRD).
    pub fn is_builtin(&self) -> bool {
        self.is_crd() || self.is_namespace() || self.is_pod() || !self.stored
    }

    /// Whether this is the core `Pod` kind.
    pub fn is_pod(&self) -> bool {
        self.group.is_empty() && self.plural == "pods"
    }

    /// Whether this is the core `Namespace` kind.
    pub fn is_namespace(&self) -> bool {
        self.group.is_empty() && self.plural == "namespaces"
    }

    /// Whether this is the `CustomResourceDefinition` kind.
    pub fn is_crd(&self) -> bool {
        self.group == "apiextensions.k8s.io" && self.plural == "customresourcedefinitions"
    }

    /// A create-only review kind (`SelfSubjectAccessReview`, `TokenReview`).
    pub fn review_kind(group: &str, plural: &str, kind: &str, namespaced: bool) -> Kind {
        Kind {
            group: group.into(),
            plural: plural.into(),
            singular: plural.trim_end_matches('s').into(),
            kind: kind.into(),
            list_kind: format!("{kind}List"),
            short_names: vec![],
            categories: vec![],
            namespaced,
            versions: vec![Version {
                name: "v1".into(),
                schema: None,
                status_subresource: false,
                printer_columns: vec![],
            }],
            verbs: &["create"],
            stored: false,
            selectable_fields: &[],
        }
    }
}

/// Kubernetes version priority: GA before beta before alpha, higher numbers first, and
/// versions that do not look like `vN[alpha|betaM]` last, alphabetically.
pub fn version_priority(a: &str, b: &str) -> Ordering {
    fn parse(v: &str) -> Option<(u64, u8, u64)> {
        let rest = v.strip_prefix('v')?;
        let digits = rest.chars().take_while(char::is_ascii_digit).count();
        let major: u64 = rest[..digits].parse().ok()?;
        let tail = &rest[digits..];
        let (rank, minor) = if tail.is_empty() {
            (2, 0)
        } else if let Some(n) = tail.strip_prefix("beta") {
            (1, n.parse().ok()?)
        } else if let Some(n) = tail.strip_prefix("alpha") {
            (0, n.parse().ok()?)
        } else {
            return None;
        };
        Some((major, rank, minor))
    }
    match (parse(a), parse(b)) {
        (Some((ma, ra, na)), Some((mb, rb, nb))) => rb.cmp(&ra).then(mb.cmp(&ma)).then(nb.cmp(&na)),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => a.cmp(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_sort_as_kubernetes_does() {
        let mut v = vec![
            "v1alpha1",
            "v2beta1",
            "foo1",
            "v1",
            "v11beta2",
            "v10beta3",
            "v2",
            "v12alpha1",
            "foo10",
            "v1beta2",
        ];
        v.sort_by(|a, b| version_priority(a, b));
        assert_eq!(
            v,
            [
                "v2",
                "v1",
                "v11beta2",
                "v10beta3",
                "v2beta1",
                "v1beta2",
                "v12alpha1",
                "v1alpha1",
                "foo1",
                "foo10"
            ]
        );
    }

    #[test]
    fn crd_needs_names_scope_and_one_storage_version() {
        let causes = Kind::from_crd(&json!({"metadata": {"name": "x"}, "spec": {}})).unwrap_err();
        let fields: Vec<&str> = causes.iter().map(|(f, _)| f.as_str()).collect();
        assert!(fields.contains(&"spec.group"));
        assert!(fields.contains(&"spec.scope"));
        assert!(fields.contains(&"spec.versions"));
    }
}
