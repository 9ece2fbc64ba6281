//! What the directory serves at one moment: the kinds its CRDs define, and its objects as an
//! API server would serve them (uid, resourceVersion, creation time, generation).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use serde_json::{Value, json};

use super::document::{Digest, Doc, Fields, ManifestKind, with_field};
use crate::selector::{Selector, Set};
use crate::source::{Object, Observed};

/// `(group, plural, namespace, name)`; the namespace is empty for cluster-scoped objects.
pub(super) type Key = (String, String, String, String);

/// One object as served, with what its next version keeps.
#[derive(Debug)]
pub(super) struct Stored {
    /// The digests of the document it was served from.
    pub(super) digest: Digest,
    pub(super) spec: Digest,
    pub(super) api_version: String,
    pub(super) created: String,
    pub(super) generation: i64,
    pub(super) object: Object,
}

/// Everything the directory holds at one moment.
#[derive(Debug, Default)]
pub(super) struct Catalog {
    pub(super) kinds: Vec<ManifestKind>,
    pub(super) objects: Arc<HashMap<Key, Arc<Stored>>>,
}

impl Catalog {
    pub(super) fn kind(&self, group: &str, resource: &str) -> Option<&ManifestKind> {
        self.kinds
            .iter()
            .find(|k| k.names.group == group && k.names.answers_to(resource))
    }

    /// The objects of `set`, by name.
    pub(super) fn members(&self, set: &Set) -> Vec<(String, Object)> {
        let namespace = set.namespace.clone().unwrap_or_default();
        let mut members: Vec<(String, Object)> = self
            .objects
            .iter()
            .filter(|((group, plural, ns, _), _)| {
                *group == set.kind.group
                    && *plural == set.kind.resource
                    && (*ns == namespace || set.all_namespaces())
            })
            .filter_map(|((_, _, ns, name), _)| {
                let key = set.key(ns, name);
                let Observed::Present(object) = self.lookup(&set.member(&key)) else {
                    return None;
                };
                let labels: BTreeMap<String, String> =
                    serde_json::from_slice::<Value>(&object.json)
                        .ok()
                        .and_then(|v| serde_json::from_value(v["metadata"]["labels"].clone()).ok())
                        .unwrap_or_default();
                set.labels.matches(&labels).then_some((key, object))
            })
            .collect();
        members.sort_by(|a, b| a.0.cmp(&b.0));
        members
    }

    pub(super) fn lookup(&self, selector: &Selector) -> Observed {
        let key = (
            selector.kind.group.clone(),
            selector.kind.resource.clone(),
            selector.namespace.clone().unwrap_or_default(),
            selector.name.clone(),
        );
        let Some(stored) = self.objects.get(&key) else {
            return Observed::Absent;
        };
        let version = selector.kind.version.as_deref().unwrap_or_default();
        let api_version = format!("{}/{version}", selector.kind.group);
        if stored.api_version == api_version {
            return Observed::Present(stored.object.clone());
        }
        // Another served version: the same object under that apiVersion (no conversion).
        match with_field(&stored.object.json, "apiVersion", &json!(api_version)) {
            Ok(json) => Observed::Present(Object {
                json: Bytes::from(json),
                ..stored.object.clone()
            }),
            Err(_) => Observed::Present(stored.object.clone()),
        }
    }
}

/// The object as an API server would serve it: the server's metadata added, and the uid,
/// creation time and (unless the spec changed) generation of the `old` one kept.
pub(super) fn serve(key: &Key, doc: &Doc, rv: u64, old: Option<&Stored>) -> Result<Stored, String> {
    let fields: Fields = serde_json::from_slice(&doc.json).map_err(|e| e.to_string())?;
    let mut meta: Value = fields
        .get("metadata")
        .and_then(|raw| serde_json::from_str(raw.get()).ok())
        .unwrap_or_else(|| json!({}));
    let generation = match old {
        Some(o) if o.spec == doc.spec => o.generation,
        Some(o) => o.generation + 1,
        None => 1,
    };
    let uid = old.map_or_else(
        || uuid::Uuid::new_v4().to_string(),
        |o| o.object.uid.clone(),
    );
    let created = old.map_or_else(
        || humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
        |o| o.created.clone(),
    );
    meta["uid"] = json!(uid);
    meta["creationTimestamp"] = json!(created);
    meta["resourceVersion"] = json!(rv.to_string());
    meta["generation"] = json!(generation);
    if !key.2.is_empty() {
        meta["namespace"] = json!(key.2);
    }
    let json = with_field(&doc.json, "metadata", &meta)?;
    Ok(Stored {
        digest: doc.digest,
        spec: doc.spec,
        api_version: doc.api_version.clone().unwrap_or_default(),
        created,
        generation,
        object: Object {
            json: Bytes::from(json),
            uid,
            resource_version: rv.to_string(),
        },
    })
}

/// Where a custom resource document goes, or why it cannot be served.
pub(super) fn key_of(kinds: &[ManifestKind], doc: &Doc) -> Result<Key, String> {
    let api_version = doc.api_version.as_deref().ok_or("no apiVersion")?;
    let kind = doc.kind.as_deref().ok_or("no kind")?;
    let (group, version) = api_version
        .split_once('/')
        .ok_or_else(|| format!("{kind} {api_version} is not a custom resource (no group)"))?;
    let found = kinds
        .iter()
        .find(|k| k.names.group == group && k.names.kind == kind)
        .ok_or_else(|| format!("no CRD in the directory defines {kind} in {group}"))?;
    if !found.versions.iter().any(|v| v == version) {
        return Err(format!("{kind} is not served at {api_version}"));
    }
    let name = doc
        .name
        .as_deref()
        .filter(|n| crate::selector::is_dns_subdomain(n))
        .ok_or_else(|| format!("{kind} has no valid metadata.name"))?;
    let namespace = if found.names.namespaced {
        doc.namespace.as_deref().unwrap_or("default")
    } else {
        ""
    };
    Ok((
        group.to_string(),
        found.names.plural.clone(),
        namespace.to_string(),
        name.to_string(),
    ))
}
