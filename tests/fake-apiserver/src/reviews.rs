//! Access and token reviews: `SelfSubjectAccessReview` and `SubjectAccessReview` answered from
//! the grants and the deny knob, `SelfSubjectRulesReview` listing the grants that apply in a
//! namespace, and `TokenReview` answered from the tokens registered through the token knob (any
//! other token is unauthenticated).

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::Shared;
use crate::crd::Kind;
use crate::error::{ApiError, Result};
use crate::faults::Attributes;

/// The review kinds: `(group, plural, kind, namespaced)`.
pub const KINDS: &[(&str, &str, &str, bool)] = &[
    (
        "authorization.k8s.io",
        "selfsubjectaccessreviews",
        "SelfSubjectAccessReview",
        false,
    ),
    (
        "authorization.k8s.io",
        "selfsubjectrulesreviews",
        "SelfSubjectRulesReview",
        false,
    ),
    (
        "authorization.k8s.io",
        "subjectaccessreviews",
        "SubjectAccessReview",
        false,
    ),
    (
        "authentication.k8s.io",
        "tokenreviews",
        "TokenReview",
        false,
    ),
];

/// The audience of tokens registered without one: the API server's own.
pub const API_SERVER_AUDIENCE: &str = "https://kubernetes.default.svc.cluster.local";

/// Answers a POST of a review kind: the request echoed back with its `status` filled in.
pub(crate) fn answer(
    shared: &Shared,
    kind: &Kind,
    mut review: Value,
    headers: &HeaderMap,
) -> Result<Response> {
    let want = kind.api_version("v1");
    if review["apiVersion"].as_str() != Some(want.as_str())
        || review["kind"].as_str() != Some(kind.kind.as_str())
    {
        return Err(ApiError::bad_request(format!(
            "the object provided is unrecognized: expected {want} {}",
            kind.kind
        )));
    }
    let status = match kind.kind.as_str() {
        "SelfSubjectAccessReview" => {
            let user = user_of(shared, headers);
            access(shared, &review["spec"], user)?
        }
        "SelfSubjectRulesReview" => {
            let user = user_of(shared, headers);
            rules(shared, &review["spec"], &user)?
        }
        "SubjectAccessReview" => {
            let user = review["spec"]["user"].as_str().unwrap_or("").to_string();
            access(shared, &review["spec"], user)?
        }
        _ => token(shared, &review["spec"])?,
    };
    review["status"] = status;
    if review["metadata"].is_null() {
        review["metadata"] = json!({ "creationTimestamp": null });
    }
    Ok((
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        review.to_string(),
    )
        .into_response())
}

/// The rules that apply to `user` in `spec.namespace`: every grant bound there or cluster-wide
/// (everything, when RBAC is off). Denials cannot be written as rules: while any is set, the
/// answer lists nothing and says it is incomplete, as an authorizer that cannot enumerate does.
fn rules(shared: &Shared, spec: &Value, user: &str) -> Result<Value> {
    let Some(namespace) = spec["namespace"].as_str().filter(|n| !n.is_empty()) else {
        return Err(ApiError::invalid(
            "SelfSubjectRulesReview.authorization.k8s.io",
            "",
            &[(
                "spec.namespace".into(),
                "Required value: the namespace to review rules in".into(),
            )],
        ));
    };
    let faults = shared.faults();
    if !faults.denials.is_empty() {
        return Ok(json!({
            "resourceRules": [],
            "nonResourceRules": [],
            "incomplete": true,
            "evaluationError": "the fake-apiserver deny knob cannot be listed as rules",
        }));
    }
    let rules: Vec<Value> = match &faults.grants {
        None => vec![json!({ "verbs": ["*"], "apiGroups": ["*"], "resources": ["*"] })],
        Some(grants) => grants
            .iter()
            .filter(|g| g.applies(namespace, user))
            .map(|g| {
                let mut rule = json!({
                    "verbs": g.verbs,
                    "apiGroups": g.groups,
                    "resources": g.resources,
                });
                if !g.names.is_empty() {
                    rule["resourceNames"] = json!(g.names);
                }
                rule
            })
            .collect(),
    };
    Ok(json!({
        "resourceRules": rules,
        "nonResourceRules": [{ "verbs": ["get"], "nonResourceURLs": ["*"] }],
        "incomplete": false,
    }))
}

fn access(shared: &Shared, spec: &Value, user: String) -> Result<Value> {
    let attrs = &spec["resourceAttributes"];
    if attrs.is_null() {
        if spec["nonResourceAttributes"].is_null() {
            return Err(ApiError::invalid(
                "SelfSubjectAccessReview.authorization.k8s.io",
                "",
                &[(
                    "spec.resourceAttributes".into(),
                    "Invalid value: null: exactly one of nonResourceAttributes or resourceAttributes must be specified".into(),
                )],
            ));
        }
        // Non-resource URLs (discovery, /healthz) are open to everyone here.
        return Ok(
            json!({ "allowed": true, "reason": "non-resource URLs are allowed by the fake" }),
        );
    }
    let text = |k: &str| {
        attrs[k]
            .as_str()
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    };
    let resource = match (text("resource"), text("subresource")) {
        (Some(r), Some(sub)) => format!("{r}/{sub}"),
        (r, _) => r.unwrap_or_default(),
    };
    let request = Attributes {
        verb: text("verb").unwrap_or_default(),
        group: text("group").unwrap_or_default(),
        resource,
        namespace: text("namespace"),
        name: text("name"),
        user,
    };
    Ok(if shared.faults().denied(&request) {
        json!({ "allowed": false, "reason": "denied by the fake-apiserver deny knob" })
    } else {
        json!({ "allowed": true, "reason": "allowed by the fake-apiserver (no deny rule matches)" })
    })
}

fn token(shared: &Shared, spec: &Value) -> Result<Value> {
    let Some(token) = spec["token"].as_str().filter(|t| !t.is_empty()) else {
        return Err(ApiError::invalid(
            "TokenReview.authentication.k8s.io",
            "",
            &[("spec.token".into(), "Required value".into())],
        ));
    };
    let wanted: Vec<String> = spec["audiences"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str().map(str::to_string))
        .collect();
    let Some(user) = shared.faults().tokens.get(token).cloned() else {
        return Ok(json!({
            "user": {},
            "error": "[invalid bearer token, token lookup failed]",
        }));
    };
    if user.audience_unaware {
        return Ok(json!({ "authenticated": true, "user": user_info(&user) }));
    }
    let has: Vec<String> = if user.audiences.is_empty() {
        vec![API_SERVER_AUDIENCE.to_string()]
    } else {
        user.audiences.clone()
    };
    let target = if wanted.is_empty() {
        vec![API_SERVER_AUDIENCE.to_string()]
    } else {
        wanted
    };
    let granted: Vec<&String> = target.iter().filter(|a| has.contains(a)).collect();
    if granted.is_empty() {
        return Ok(json!({
            "user": {},
            "error": format!("[invalid bearer token, token audiences {has:?} is invalid for the target audiences {target:?}]"),
        }));
    }
    Ok(json!({ "authenticated": true, "user": user_info(&user), "audiences": granted }))
}

/// A TokenReview's `status.user` for `user`.
fn user_info(user: &crate::TokenUser) -> Value {
    let mut info = json!({ "username": user.username, "groups": user.groups });
    if !user.uid.is_empty() {
        info["uid"] = json!(user.uid);
    }
    if !user.extra.is_empty() {
        info["extra"] = json!(user.extra);
    }
    info
}

/// Who a request is from: the user a registered bearer token stands for, else anonymous.
pub(crate) fn user_of(shared: &Shared, headers: &HeaderMap) -> String {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|token| {
            shared
                .faults()
                .tokens
                .get(token.trim())
                .map(|u| u.username.clone())
        })
        .unwrap_or_else(|| "system:anonymous".to_string())
}
