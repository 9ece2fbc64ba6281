//! Discovery (`/version`, `/api`, `/apis`, `/apis/{g}`, `/apis/{g}/{v}`) and OpenAPI v3
//! (`/openapi/v3`, `/openapi/v3/apis/{g}/{v}`), generated from the kinds being served, so a CRD
//! created at run time shows up at once.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::http::header;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::Shared;
use crate::crd::{Kind, version_priority};
use crate::error::{ApiError, Result};

/// The Kubernetes version the fake reports. The machine's kubectl is a dispatcher that runs the
/// kubectl matching the server's minor version; 1.32 selects kubectl 1.32. (kube-rs 5 does not
/// check the version; everything it uses is in 1.32.)
pub const VERSION: (&str, &str) = ("1", "32");

/// A discovery or OpenAPI document.
#[derive(Debug, Clone, PartialEq)]
pub enum Doc {
    /// `/version`.
    Version,
    /// `/api`.
    Api,
    /// `/api/v1`.
    CoreV1,
    /// `/apis`.
    Apis,
    /// `/apis/{group}`.
    Group(String),
    /// `/apis/{group}/{version}`.
    GroupVersion(String, String),
    /// `/openapi/v3`.
    OpenApiIndex,
    /// `/openapi/v3/apis/{group}/{version}` (or `/openapi/v3/api/v1`).
    OpenApi(String, String),
    /// `/healthz`, `/livez`, `/readyz`.
    Health,
}

impl Doc {
    /// Recognises discovery paths from their segments.
    pub fn parse(segments: &[&str]) -> Option<Doc> {
        Some(match segments {
            ["version"] => Doc::Version,
            ["api"] => Doc::Api,
            ["api", "v1"] => Doc::CoreV1,
            ["apis"] => Doc::Apis,
            ["apis", g] => Doc::Group(g.to_string()),
            ["apis", g, v] => Doc::GroupVersion(g.to_string(), v.to_string()),
            ["openapi", "v3"] => Doc::OpenApiIndex,
            ["openapi", "v3", "apis", g, v] => Doc::OpenApi(g.to_string(), v.to_string()),
            ["openapi", "v3", "api", "v1"] => Doc::OpenApi(String::new(), "v1".into()),
            ["healthz" | "livez" | "readyz"] => Doc::Health,
            _ => return None,
        })
    }
}

/// Answers a discovery request.
pub(crate) fn answer(shared: &Shared, doc: &Doc, parts: &Parts) -> Result<Response> {
    let kinds: Vec<Arc<Kind>> = shared.state().kinds.values().cloned().collect();
    let groups = group_versions(&kinds);
    let body = match doc {
        Doc::Health => return Ok("ok".into_response()),
        Doc::Version => json!({
            "major": VERSION.0,
            "minor": VERSION.1,
            "gitVersion": format!("v{}.{}.0", VERSION.0, VERSION.1),
            "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.24.0",
            "compiler": "gc",
            "platform": "linux/amd64",
        }),
        Doc::Api => {
            let host = parts
                .headers
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .unwrap_or("127.0.0.1");
            json!({
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{ "clientCIDR": "0.0.0.0/0", "serverAddress": host }],
            })
        }
        Doc::CoreV1 => json!({
            "kind": "APIResourceList",
            "groupVersion": "v1",
            "resources": kinds.iter().filter(|k| k.group.is_empty()).flat_map(|k| resources(k, "v1")).collect::<Vec<_>>(),
        }),
        Doc::Apis => json!({
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": groups.iter().filter(|(g, _)| !g.is_empty()).map(|(g, vs)| group_doc(g, vs)).collect::<Vec<_>>(),
        }),
        Doc::Group(g) if g.is_empty() => return Err(ApiError::PathNotFound),
        Doc::Group(g) => {
            let versions = groups.get(g.as_str()).ok_or(ApiError::PathNotFound)?;
            let mut doc = group_doc(g, versions);
            doc["kind"] = json!("APIGroup");
            doc["apiVersion"] = json!("v1");
            doc
        }
        Doc::GroupVersion(g, _) if g.is_empty() => return Err(ApiError::PathNotFound),
        Doc::GroupVersion(g, v) => {
            let served: Vec<&Arc<Kind>> = kinds
                .iter()
                .filter(|k| &k.group == g && k.version(v).is_some())
                .collect();
            if served.is_empty() {
                return Err(ApiError::PathNotFound);
            }
            json!({
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": format!("{g}/{v}"),
                "resources": served.iter().flat_map(|k| resources(k, v)).collect::<Vec<_>>(),
            })
        }
        Doc::OpenApiIndex => crate::openapi::index(&kinds),
        Doc::OpenApi(g, v) => crate::openapi::group_version(&kinds, g, v)?,
    };
    Ok((
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response())
}

/// Each served group with its versions, highest priority first.
fn group_versions(kinds: &[Arc<Kind>]) -> BTreeMap<&str, Vec<&str>> {
    let mut groups: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for k in kinds {
        let versions = groups.entry(k.group.as_str()).or_default();
        for v in &k.versions {
            if !versions.contains(&v.name.as_str()) {
                versions.push(&v.name);
            }
        }
    }
    for versions in groups.values_mut() {
        versions.sort_by(|a, b| version_priority(a, b));
    }
    groups
}

fn group_doc(group: &str, versions: &[&str]) -> Value {
    let gv = |v: &str| json!({ "groupVersion": format!("{group}/{v}"), "version": v });
    json!({
        "name": group,
        "versions": versions.iter().map(|v| gv(v)).collect::<Vec<_>>(),
        "preferredVersion": gv(versions.first().copied().unwrap_or("v1")),
    })
}

fn resources(kind: &Kind, version: &str) -> Vec<Value> {
    let mut main = json!({
        "name": kind.plural,
        "singularName": kind.singular,
        "namespaced": kind.namespaced,
        "kind": kind.kind,
        "verbs": kind.verbs,
    });
    if !kind.short_names.is_empty() {
        main["shortNames"] = json!(kind.short_names);
    }
    if !kind.categories.is_empty() {
        main["categories"] = json!(kind.categories);
    }
    let mut out = vec![main];
    if kind.version(version).is_some_and(|v| v.status_subresource) {
        out.push(json!({
            "name": format!("{}/status", kind.plural),
            "singularName": "",
            "namespaced": kind.namespaced,
            "kind": kind.kind,
            "verbs": ["get", "patch", "update"],
        }));
    }
    out
}
