//! Where custom resources come from: the [`Source`] trait the registry watches through, with two
//! implementations — [`kubernetes`] (a cluster, through kube-rs) and [`manifests`] (a directory
//! of YAML files, the embedded default).

use std::future::Future;

use bytes::Bytes;
use futures::stream::BoxStream;
use serde_json::Value;

use crate::selector::{KindRef, Selector, Set};

pub mod kubernetes;
pub mod manifests;
pub mod retry;
pub mod scripted;

/// One object's state, as a source observed it.
#[derive(Debug, Clone, PartialEq)]
pub enum Observed {
    /// The object exists.
    Present(Object),
    /// No object has the name now.
    Absent,
}

/// An object, serialized once, with the metadata subscribers are told about.
#[derive(Debug, Clone, PartialEq)]
pub struct Object {
    /// The whole object as JSON.
    pub json: Bytes,
    /// `metadata.uid`.
    pub uid: String,
    /// `metadata.resourceVersion`.
    pub resource_version: String,
}

impl Object {
    /// Serializes a JSON object and reads its uid and resourceVersion.
    pub fn from_value(value: &Value) -> Object {
        let meta = &value["metadata"];
        let text = |k: &str| meta[k].as_str().unwrap_or_default().to_string();
        Object {
            json: Bytes::from(serde_json::to_vec(value).unwrap_or_default()),
            uid: text("uid"),
            resource_version: text("resourceVersion"),
        }
    }
}

/// Why a source could not resolve or watch a resource.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// The source serves no such kind. Retryable: a CRD may be installed later.
    #[error("{0}")]
    UnknownKind(String),
    /// The kind is not on this broker's `--resource` list. Not retryable.
    #[error("{0}")]
    NotAllowed(String),
    /// The source refuses to let the broker read it (HTTP 403). Retryable once RBAC changes.
    #[error("{0}")]
    Forbidden(String),
    /// The selector does not fit the kind (a namespace on a cluster-scoped kind, or none on a
    /// namespaced one). Not retryable.
    #[error("{0}")]
    Invalid(String),
    /// The source failed or cannot be reached. Retryable.
    #[error("{0}")]
    Unavailable(String),
}

impl SourceError {
    /// Whether this is an outage of the source (it failed or cannot be reached), which a
    /// subscriber waits out, rather than an answer about the resource.
    pub fn is_outage(&self) -> bool {
        matches!(self, SourceError::Unavailable(_))
    }

    /// Whether the source no longer serves the kind at all (at the version watched): a CRD
    /// deleted, or a version it stopped serving. A subscriber is told, even one that has its
    /// state: the state will not change again.
    pub fn is_gone(&self) -> bool {
        matches!(self, SourceError::UnknownKind(_))
    }

    /// Every [`SourceError::reason`].
    pub const REASONS: [&str; 5] = [
        "unknown_kind",
        "not_allowed",
        "forbidden",
        "invalid",
        "unavailable",
    ];

    /// A short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            SourceError::UnknownKind(_) => "unknown_kind",
            SourceError::NotAllowed(_) => "not_allowed",
            SourceError::Forbidden(_) => "forbidden",
            SourceError::Invalid(_) => "invalid",
            SourceError::Unavailable(_) => "unavailable",
        }
    }
}

/// The refusal of a kind (`plural.group`, or as the client spelled it) that `--resource` does
/// not list.
pub fn not_allowed(kind: &str, allowed: &[KindRef]) -> SourceError {
    let list: Vec<String> = allowed.iter().map(ToString::to_string).collect();
    SourceError::NotAllowed(format!(
        "{kind} is not served by this broker (--resource allows: {})",
        list.join(", ")
    ))
}

/// What a source saw of a set, by member name.
#[derive(Debug, Clone)]
pub enum SetEvent {
    /// Every member now.
    Listed(Vec<(String, Object)>),
    /// A member created or changed (or come to match).
    Applied(String, Object),
    /// A member deleted (or no longer matching).
    Deleted(String),
    /// The source failed; it retries by itself.
    Failed(SourceError),
    /// It works again after failures; what was listed still holds.
    Recovered,
}

/// A source of custom resources.
pub trait Source: Send + Sync + 'static {
    /// Resolves a selector to its canonical form — the plural and the version filled in —
    /// checking that the kind exists, is allowed, and fits the namespace given.
    fn resolve(
        &self,
        selector: &Selector,
    ) -> impl Future<Output = Result<Selector, SourceError>> + Send;

    /// Watches one resolved selector. The stream reports the object's state when it starts and
    /// whenever it may have changed (repeats are allowed), and errors as they happen; it retries
    /// by itself and ends only when dropped. Dropping it stops the watch at the source.
    fn watch(&self, selector: &Selector) -> BoxStream<'static, Result<Observed, SourceError>>;

    /// Checks that the source answers and lets the broker read the kinds it serves; `Err` says
    /// what is wrong. Run in the background for readiness, never per probe.
    fn check(&self) -> impl Future<Output = Result<(), String>> + Send;

    /// The kinds it is configured to serve, as `plural.group` (empty: any kind), for metrics
    /// to have their series from the start.
    fn kinds(&self) -> Vec<String> {
        Vec::new()
    }

    /// What its client counts of its requests to an API server, if it has one.
    fn api_requests(&self) -> Option<crate::telemetry::ApiRequests> {
        None
    }

    /// Forgets what it learned of `kind`'s group (its versions, its kinds), after a watch found
    /// the kind no longer served: the next resolution asks the source again, and finds the
    /// version it prefers now.
    fn forget(&self, kind: &KindRef) {
        let _ = kind;
    }

    /// Watches a set: its members when it starts, then each change, retrying by itself until
    /// dropped. Sources that serve no sets say so once.
    fn watch_set(&self, set: &Set) -> BoxStream<'static, SetEvent> {
        let why = format!("this source serves single resources only, not sets such as {set}");
        futures::StreamExt::boxed(futures::StreamExt::chain(
            futures::stream::once(async move { SetEvent::Failed(SourceError::NotAllowed(why)) }),
            futures::stream::pending(),
        ))
    }
}

/// Names a kind has: what a selector's resource part may be.
#[derive(Debug, Clone, PartialEq)]
pub struct KindNames {
    /// API group.
    pub group: String,
    /// Plural (the canonical resource name).
    pub plural: String,
    /// Singular.
    pub singular: String,
    /// The kind.
    pub kind: String,
    /// Short names.
    pub short_names: Vec<String>,
    /// Whether objects live in namespaces.
    pub namespaced: bool,
}

impl KindNames {
    /// Whether `resource` names this kind, as kubectl matches: the plural, singular or a short
    /// name exactly, or the kind case-insensitively.
    pub fn answers_to(&self, resource: &str) -> bool {
        resource == self.plural
            || resource == self.singular
            || self.short_names.iter().any(|s| s == resource)
            || resource.eq_ignore_ascii_case(&self.kind)
    }

    /// The canonical selector for `selector` at `version`, after checking the allow-list and
    /// that the namespace fits the kind's scope.
    pub fn canonical(
        &self,
        selector: &Selector,
        version: &str,
        allowed: &[KindRef],
    ) -> Result<Selector, SourceError> {
        let qualified = format!("{}.{}", self.plural, self.group);
        if !allowed.is_empty()
            && !allowed.iter().any(|a| {
                a.group == self.group
                    && self.answers_to(&a.resource)
                    && a.version.as_deref().is_none_or(|v| v == version)
            })
        {
            return Err(not_allowed(&qualified, allowed));
        }
        match (self.namespaced, &selector.namespace) {
            (true, None) => Err(SourceError::Invalid(format!(
                "{qualified} is namespaced: the selector needs a namespace, as in {}/<namespace>/{}",
                selector.kind, selector.name
            ))),
            (false, Some(_)) => Err(SourceError::Invalid(format!(
                "{qualified} is cluster-scoped: the selector must not have a namespace, as in {}/{}",
                selector.kind, selector.name
            ))),
            _ => Ok(Selector {
                kind: KindRef {
                    resource: self.plural.clone(),
                    version: Some(version.to_string()),
                    group: self.group.clone(),
                },
                namespace: selector.namespace.clone(),
                name: selector.name.clone(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> KindNames {
        KindNames {
            group: "core.openfeature.dev".into(),
            plural: "featureflags".into(),
            singular: "featureflag".into(),
            kind: "FeatureFlag".into(),
            short_names: vec!["ff".into()],
            namespaced: true,
        }
    }

    #[test]
    fn kinds_answer_to_their_names() {
        let n = names();
        for r in [
            "featureflags",
            "featureflag",
            "ff",
            "FeatureFlag",
            "featureFlag",
        ] {
            assert!(n.answers_to(r), "{r}");
        }
        assert!(!n.answers_to("flags"));
    }

    #[test]
    fn canonical_checks_allow_list_and_scope() {
        let n = names();
        let sel: Selector = "ff.core.openfeature.dev/default/demo".parse().unwrap();
        let c = n.canonical(&sel, "v1beta1", &[]).unwrap();
        assert_eq!(
            c.to_string(),
            "featureflags.v1beta1.core.openfeature.dev/default/demo"
        );
        let allowed = ["featureflags.core.openfeature.dev".parse().unwrap()];
        assert!(n.canonical(&sel, "v1beta1", &allowed).is_ok());
        let other = ["widgets.example.com".parse().unwrap()];
        assert!(
            matches!(n.canonical(&sel, "v1beta1", &other), Err(SourceError::NotAllowed(m)) if m.contains("widgets.example.com"))
        );
        let pinned = ["featureflags.v1.core.openfeature.dev".parse().unwrap()];
        assert!(matches!(
            n.canonical(&sel, "v1beta1", &pinned),
            Err(SourceError::NotAllowed(_))
        ));
        let no_ns: Selector = "ff.core.openfeature.dev/demo".parse().unwrap();
        assert!(
            matches!(n.canonical(&no_ns, "v1beta1", &[]), Err(SourceError::Invalid(m)) if m.contains("namespaced"))
        );
    }
}
