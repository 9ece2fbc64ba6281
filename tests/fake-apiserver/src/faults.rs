//! Fault knobs that change how requests are answered (injected statuses, hangs, RBAC denials),
//! the token table behind `TokenReview`, and the request log the introspection reads.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Selects requests: by verb (`get`, `list`, `watch`, `create`, `update`, `patch`, `delete`,
/// `deletecollection`, or `discovery` for anything outside resource paths) and path prefix.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Matcher {
    /// The verb; any verb when `None`.
    #[serde(default)]
    pub verb: Option<String>,
    /// A prefix of the request path; any path when `None`.
    #[serde(default)]
    pub path: Option<String>,
}

impl Matcher {
    /// Requests with this verb, on any path.
    pub fn verb(verb: &str) -> Self {
        Matcher {
            verb: Some(verb.to_string()),
            path: None,
        }
    }

    /// Narrows to paths starting with `prefix`.
    pub fn on(mut self, prefix: &str) -> Self {
        self.path = Some(prefix.to_string());
        self
    }

    /// Whether a request with this verb and path is selected.
    pub fn matches(&self, verb: &str, path: &str) -> bool {
        self.verb.as_deref().is_none_or(|v| v == verb)
            && self.path.as_deref().is_none_or(|p| path.starts_with(p))
    }
}

/// What an injected fault does to a selected request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "camelCase")]
pub enum Action {
    /// Answer with this status code (a `Status` body; `Retry-After` when given).
    #[serde(rename_all = "camelCase")]
    Status {
        /// HTTP status code, e.g. 500, 429, 503.
        code: u16,
        /// Seconds for the `Retry-After` header.
        #[serde(default)]
        retry_after: Option<u64>,
    },
    /// Accept the request and never answer (until the server stops or restarts).
    Hang,
}

/// An injected fault with its remaining count.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Injection {
    /// Which requests.
    #[serde(flatten)]
    pub matcher: Matcher,
    /// How many more requests it applies to.
    pub times: usize,
    /// What happens to them.
    #[serde(flatten)]
    pub action: Action,
}

/// An RBAC denial: requests whose attributes match every field that is set get 403, and
/// `SelfSubjectAccessReview` answers `allowed: false`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Deny {
    /// The verb (`list`, `watch`, `get`, …).
    #[serde(default)]
    pub verb: Option<String>,
    /// The API group.
    #[serde(default)]
    pub group: Option<String>,
    /// The resource plural (`featureflags`, or `featureflags/status`).
    #[serde(default)]
    pub resource: Option<String>,
    /// The namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The object name (for list and watch, the exact `metadata.name` field selector).
    #[serde(default)]
    pub name: Option<String>,
    /// The user (`system:anonymous` for requests without a registered token).
    #[serde(default)]
    pub user: Option<String>,
}

/// An RBAC grant, as a Role or ClusterRole rule bound to a user. Once any grant is set
/// ([`crate::FakeApiServer::grant_only`]), only what some grant allows is allowed (denials still
/// apply), as on a cluster with RBAC; until then everything is.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Grant {
    /// Verbs (`*`: all).
    pub verbs: Vec<String>,
    /// API groups (`*`: all; `""`: the core group).
    pub groups: Vec<String>,
    /// Resources (`*`: all).
    pub resources: Vec<String>,
    /// The namespace, as a RoleBinding grants; `None`: every namespace, as a
    /// ClusterRoleBinding does.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Object names (`resourceNames`); empty: all.
    #[serde(default)]
    pub names: Vec<String>,
    /// The user it is bound to; `None`: everyone.
    #[serde(default)]
    pub user: Option<String>,
}

impl Grant {
    /// `verbs` on `resources` in `group`, in every namespace.
    pub fn cluster(verbs: &[&str], group: &str, resources: &[&str]) -> Self {
        let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        Grant {
            verbs: strings(verbs),
            groups: vec![group.to_string()],
            resources: strings(resources),
            ..Grant::default()
        }
    }

    /// The same, in `namespace` only.
    pub fn in_namespace(mut self, namespace: &str) -> Self {
        self.namespace = Some(namespace.to_string());
        self
    }

    /// The same, for these object names only.
    pub fn names(mut self, names: &[&str]) -> Self {
        self.names = names.iter().map(|s| s.to_string()).collect();
        self
    }

    /// Whether it allows the request.
    pub fn allows(&self, a: &Attributes) -> bool {
        let has = |list: &[String], v: &str| list.iter().any(|x| x == "*" || x == v);
        has(&self.verbs, &a.verb)
            && has(&self.groups, &a.group)
            && has(&self.resources, &a.resource)
            && self.user.as_deref().is_none_or(|u| u == a.user)
            && self
                .namespace
                .as_deref()
                .is_none_or(|ns| a.namespace.as_deref() == Some(ns))
            && (self.names.is_empty()
                || a.name
                    .as_deref()
                    .is_some_and(|n| self.names.iter().any(|x| x == n)))
    }

    /// Whether it applies in `namespace` for `user` (what a SelfSubjectRulesReview lists).
    pub fn applies(&self, namespace: &str, user: &str) -> bool {
        self.namespace.as_deref().is_none_or(|ns| ns == namespace)
            && self.user.as_deref().is_none_or(|u| u == user)
    }
}

/// The attributes an authorizer sees for one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Attributes {
    /// The verb.
    pub verb: String,
    /// The API group.
    pub group: String,
    /// The resource, with `/subresource` appended when there is one.
    pub resource: String,
    /// The namespace, if any.
    pub namespace: Option<String>,
    /// The object name, if any.
    pub name: Option<String>,
    /// Who asks.
    pub user: String,
}

impl Deny {
    /// Whether this denial covers the request.
    pub fn covers(&self, a: &Attributes) -> bool {
        let eq = |want: &Option<String>, have: &str| want.as_deref().is_none_or(|w| w == have);
        eq(&self.verb, &a.verb)
            && eq(&self.user, &a.user)
            && eq(&self.group, &a.group)
            && eq(&self.resource, &a.resource)
            && self
                .namespace
                .as_deref()
                .is_none_or(|w| a.namespace.as_deref() == Some(w))
            && self
                .name
                .as_deref()
                .is_none_or(|w| a.name.as_deref() == Some(w))
    }
}

/// The user a bearer token stands for, as `TokenReview` reports it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenUser {
    /// The bearer token.
    pub token: String,
    /// e.g. `system:serviceaccount:default:flagd`.
    pub username: String,
    /// The user's uid.
    #[serde(default)]
    pub uid: String,
    /// Groups, e.g. `system:serviceaccounts`.
    #[serde(default)]
    pub groups: Vec<String>,
    /// Audiences the token is valid for; empty means the API server's own.
    #[serde(default)]
    pub audiences: Vec<String>,
    /// Extra attributes, e.g. `authentication.kubernetes.io/pod-name` for a pod-bound token.
    #[serde(default)]
    pub extra: std::collections::BTreeMap<String, Vec<String>>,
    /// Reviewed by an authenticator that does not check audiences (a webhook that predates
    /// them, say): authenticated whatever the review asks, with no audiences in the answer.
    #[serde(default)]
    pub audience_unaware: bool,
}

impl TokenUser {
    /// A service-account user with the groups the real token authenticator gives it.
    pub fn service_account(token: &str, namespace: &str, name: &str) -> Self {
        TokenUser {
            token: token.to_string(),
            username: format!("system:serviceaccount:{namespace}:{name}"),
            uid: uuid::Uuid::new_v4().to_string(),
            groups: vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{namespace}"),
                "system:authenticated".into(),
            ],
            audiences: Vec::new(),
            extra: Default::default(),
            audience_unaware: false,
        }
    }

    /// The same user, bound to a pod (as a projected service-account token is): the pod's name
    /// and UID in `extra`, as the real TokenReview reports them.
    pub fn bound_to_pod(mut self, name: &str, uid: &str) -> Self {
        self.extra.insert(
            "authentication.kubernetes.io/pod-name".into(),
            vec![name.to_string()],
        );
        self.extra.insert(
            "authentication.kubernetes.io/pod-uid".into(),
            vec![uid.to_string()],
        );
        self
    }

    /// Restricts the token to these audiences.
    pub fn with_audiences(mut self, audiences: &[&str]) -> Self {
        self.audiences = audiences.iter().map(|a| a.to_string()).collect();
        self
    }
}

/// One request, as the fake received it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestRecord {
    /// HTTP method.
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// The raw query string (kube-rs sends it starting with `&`).
    pub query: String,
    /// The decoded query parameters, empty pairs skipped.
    pub params: Vec<(String, String)>,
    /// The derived verb (`list`, `watch`, …, or `discovery`).
    pub verb: String,
    /// The `Accept` header.
    pub accept: Option<String>,
    /// The `Content-Type` header.
    pub content_type: Option<String>,
    /// The HTTP version: `HTTP/1.1` or `HTTP/2.0`.
    #[serde(default)]
    pub version: String,
}

impl RequestRecord {
    /// The value of a query parameter.
    pub fn param(&self, key: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The knob settings and the log.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    pub(crate) injections: Vec<Injection>,
    pub(crate) denials: Vec<Deny>,
    /// `None`: everything is allowed that no denial covers.
    pub(crate) grants: Option<Vec<Grant>>,
    pub(crate) tokens: HashMap<String, TokenUser>,
    pub(crate) watch_list_disabled: bool,
    pub(crate) log: Vec<RequestRecord>,
    pub(crate) log_limit: usize,
    pub(crate) counts: HashMap<(String, String), u64>,
}

impl Faults {
    /// Takes one use of the first injection that selects this request.
    pub(crate) fn take(&mut self, verb: &str, path: &str) -> Option<Action> {
        let i = self
            .injections
            .iter()
            .position(|inj| inj.times > 0 && inj.matcher.matches(verb, path))?;
        let injection = &mut self.injections[i];
        injection.times -= 1;
        let action = injection.action.clone();
        if injection.times == 0 {
            self.injections.remove(i);
        }
        Some(action)
    }

    /// Whether a denial covers these attributes.
    pub(crate) fn denied(&self, attrs: &Attributes) -> bool {
        // Everyone may ask what they may do, as `system:basic-user` lets them.
        let self_review = attrs.verb == "create"
            && attrs.group == "authorization.k8s.io"
            && attrs.resource.starts_with("selfsubject");
        self.denials.iter().any(|d| d.covers(attrs))
            || (!self_review
                && self
                    .grants
                    .as_ref()
                    .is_some_and(|g| !g.iter().any(|g| g.allows(attrs))))
    }

    pub(crate) fn record(&mut self, record: RequestRecord) {
        *self
            .counts
            .entry((record.verb.clone(), record.path.clone()))
            .or_default() += 1;
        if self.log.len() >= self.log_limit {
            // Keep the newest half; counts stay exact regardless.
            let half = self.log.len() / 2;
            self.log.drain(..half);
        }
        self.log.push(record);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn injections_run_out() {
        let mut f = Faults::default();
        f.injections.push(Injection {
            matcher: Matcher::verb("list").on("/apis/x"),
            times: 2,
            action: Action::Status {
                code: 500,
                retry_after: None,
            },
        });
        assert!(f.take("watch", "/apis/x/v1/foos").is_none());
        assert!(f.take("list", "/apis/y/v1/foos").is_none());
        assert!(f.take("list", "/apis/x/v1/foos").is_some());
        assert!(f.take("list", "/apis/x/v1/foos").is_some());
        assert!(f.take("list", "/apis/x/v1/foos").is_none());
        assert!(f.injections.is_empty());
    }

    #[test]
    fn injections_read_from_admin_json() {
        let inj: Injection = serde_json::from_str(
            r#"{"verb":"list","path":"/apis","times":3,"action":"status","code":503,"retryAfter":1}"#,
        )
        .unwrap();
        assert_eq!(inj.times, 3);
        assert_eq!(
            inj.action,
            Action::Status {
                code: 503,
                retry_after: Some(1)
            }
        );
        let hang: Injection = serde_json::from_str(r#"{"times":1,"action":"hang"}"#).unwrap();
        assert_eq!(hang.action, Action::Hang);
        assert_eq!(hang.matcher, Matcher::default());
    }

    #[test]
    fn denial_matches_only_set_fields() {
        let d = Deny {
            verb: Some("watch".into()),
            resource: Some("foos".into()),
            name: Some("a".into()),
            ..Deny::default()
        };
        let mut a = Attributes {
            verb: "watch".into(),
            group: "g".into(),
            resource: "foos".into(),
            namespace: Some("ns".into()),
            name: Some("a".into()),
            user: "system:anonymous".into(),
        };
        assert!(d.covers(&a));
        a.name = None;
        assert!(!d.covers(&a));
    }
}
