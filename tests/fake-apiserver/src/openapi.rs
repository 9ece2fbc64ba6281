//! OpenAPI v3, as much of it as clients read: the `/openapi/v3` index of group-versions and,
//! per group-version, the paths of each kind with the `x-kubernetes-group-version-kind`
//! extension and the PATCH query parameters. kubectl reads the PATCH operation to learn that the
//! server validates fields itself (`fieldValidation`), and then sends `fieldValidation=Strict`
//! instead of validating on the client; the schemas under `components` are the CRDs' own.

use std::sync::Arc;

use serde_json::{Value, json};

use crate::crd::Kind;
use crate::error::{ApiError, Result};

/// `/openapi/v3`: every served group-version with the URL of its document.
pub fn index(kinds: &[Arc<Kind>]) -> Value {
    let mut paths = serde_json::Map::new();
    for kind in kinds {
        for v in &kind.versions {
            let key = if kind.group.is_empty() {
                format!("api/{}", v.name)
            } else {
                format!("apis/{}/{}", kind.group, v.name)
            };
            let hash = content_hash(kinds, &kind.group, &v.name);
            paths.insert(
                key.clone(),
                json!({ "serverRelativeURL": format!("/openapi/v3/{key}?hash={hash}") }),
            );
        }
    }
    json!({ "paths": paths })
}

/// A hash that changes when the group-version's kinds change, so clients' caches refresh.
fn content_hash(kinds: &[Arc<Kind>], group: &str, version: &str) -> String {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    for k in kinds.iter().filter(|k| k.group == group) {
        if let Some(v) = k.version(version) {
            k.plural.hash(&mut h);
            k.kind.hash(&mut h);
            v.schema.as_ref().map(Value::to_string).hash(&mut h);
        }
    }
    format!("{:016X}", h.finish())
}

/// `/openapi/v3/apis/{group}/{version}`.
pub fn group_version(kinds: &[Arc<Kind>], group: &str, version: &str) -> Result<Value> {
    let served: Vec<&Arc<Kind>> = kinds
        .iter()
        .filter(|k| k.group == group && k.version(version).is_some())
        .collect();
    if served.is_empty() {
        return Err(ApiError::PathNotFound);
    }
    let mut paths = serde_json::Map::new();
    let mut schemas = serde_json::Map::new();
    for kind in served {
        let gvk = json!({ "group": group, "version": version, "kind": kind.kind });
        let schema_name = schema_name(group, version, &kind.kind);
        let base = if group.is_empty() {
            format!("/api/{version}")
        } else {
            format!("/apis/{group}/{version}")
        };
        let (collection, item) = if kind.namespaced {
            (
                format!("{base}/namespaces/{{namespace}}/{}", kind.plural),
                format!("{base}/namespaces/{{namespace}}/{}/{{name}}", kind.plural),
            )
        } else {
            (
                format!("{base}/{}", kind.plural),
                format!("{base}/{}/{{name}}", kind.plural),
            )
        };
        let reference = json!({ "$ref": format!("#/components/schemas/{schema_name}") });
        let op = |action: &str, verb: &str, body: bool| {
            let mut o = json!({
                "operationId": format!("{verb}{}", kind.kind),
                "x-kubernetes-action": action,
                "x-kubernetes-group-version-kind": gvk,
                "responses": { "200": { "description": "OK", "content": { "application/json": { "schema": reference } } } },
            });
            if body {
                o["requestBody"] = json!({ "content": { "*/*": { "schema": reference } } });
            }
            o
        };
        let writes = kind.verbs.contains(&"create");
        if kind.stored {
            paths.insert(
                collection.clone(),
                json!({ "get": op("list", "list", false), "post": op("post", "create", true), "delete": op("deletecollection", "deleteCollection", false) }),
            );
            let mut patch = op("patch", "patch", false);
            patch["parameters"] = json!(["dryRun", "fieldManager", "fieldValidation", "force"]
                .iter()
                .map(|p| json!({ "name": p, "in": "query", "schema": { "type": if *p == "force" { "boolean" } else { "string" } } }))
                .collect::<Vec<_>>());
            patch["requestBody"] = json!({ "content": {
                "application/json-patch+json": { "schema": { "type": "object" } },
                "application/merge-patch+json": { "schema": { "type": "object" } },
                "application/apply-patch+yaml": { "schema": { "type": "object" } },
            }});
            paths.insert(
                item.clone(),
                json!({ "get": op("get", "read", false), "put": op("put", "replace", true), "patch": patch, "delete": op("delete", "delete", false) }),
            );
        } else if writes {
            paths.insert(collection, json!({ "post": op("post", "create", true) }));
        }
        let mut schema = kind
            .version(version)
            .and_then(|v| v.schema.clone())
            .unwrap_or_else(|| json!({ "type": "object" }));
        schema["x-kubernetes-group-version-kind"] = json!([gvk]);
        schemas.insert(schema_name, schema);
    }
    Ok(json!({
        "openapi": "3.0.0",
        "info": { "title": "Kubernetes CRD Swagger", "version": "v0.1.0" },
        "paths": paths,
        "components": { "schemas": schemas },
    }))
}

/// `dev.openfeature.core.v1beta1.FeatureFlag`: the group reversed, as the real server names
/// CRD schemas.
fn schema_name(group: &str, version: &str, kind: &str) -> String {
    let reversed: Vec<&str> = group.split('.').rev().collect();
    format!("{}.{version}.{kind}", reversed.join("."))
}
