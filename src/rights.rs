//! What the broker's own identity may do in the cluster, for its readiness: one right at a time
//! ([`may`], a SelfSubjectAccessReview), or everything in a namespace ([`rules_in`], a
//! SelfSubjectRulesReview: the rules of every Role and ClusterRole bound to it there, including
//! those that name objects (`resourceNames`), which a SelfSubjectAccessReview without a name
//! would deny). The Kubernetes source asks about the kinds it serves, the access layer about
//! what its identity sources need.

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, ResourceRule, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
    SelfSubjectRulesReview, SelfSubjectRulesReviewSpec,
};
use kube::api::{Api, PostParams};

/// The resource rules that apply to the broker in one namespace.
#[derive(Debug, Default)]
pub struct Rules(Vec<ResourceRule>);

impl Rules {
    /// Whether some rule lets the broker `verb` `resource` in `group` (for some names at least).
    pub fn allow(&self, verb: &str, group: &str, resource: &str) -> bool {
        let has = |list: &[String], v: &str| list.iter().any(|x| x == "*" || x == v);
        self.0.iter().any(|r| {
            has(&r.verbs, verb)
                && has(r.api_groups.as_deref().unwrap_or_default(), group)
                && has(r.resources.as_deref().unwrap_or_default(), resource)
        })
    }
}

/// Whether the broker's own identity may `verb` `resource` in `group`, cluster-wide or in
/// `namespace` (a SelfSubjectAccessReview); `Err` says why not, for readiness.
pub async fn may(
    client: &kube::Client,
    verb: &str,
    group: &str,
    resource: &str,
    namespace: Option<&str>,
) -> Result<(), String> {
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                group: Some(group.to_string()),
                resource: Some(resource.to_string()),
                verb: Some(verb.to_string()),
                namespace: namespace.map(str::to_string),
                ..ResourceAttributes::default()
            }),
            ..SelfSubjectAccessReviewSpec::default()
        },
        ..SelfSubjectAccessReview::default()
    };
    let qualified = match (group, namespace) {
        ("", None) => resource.to_string(),
        ("", Some(ns)) => format!("{resource} in namespace {ns}"),
        (g, None) => format!("{resource}.{g}"),
        (g, Some(ns)) => format!("{resource}.{g} in namespace {ns}"),
    };
    let reviews: Api<SelfSubjectAccessReview> = Api::all(client.clone());
    let answer = reviews
        .create(&kube::api::PostParams::default(), &review)
        .await
        .map_err(|e| format!("asking whether the broker may {verb} {qualified}: {e}"))?;
    match answer.status {
        Some(status) if status.allowed => Ok(()),
        status => Err(format!(
            "the broker may not {verb} {qualified} ({})",
            status
                .and_then(|s| s.reason)
                .unwrap_or_else(|| "no reason given".into())
        )),
    }
}

/// The rules in `namespace`. A review the authorizer could not complete lists what it could;
/// the caller asks a SelfSubjectAccessReview for anything it does not cover.
pub async fn rules_in(client: &kube::Client, namespace: &str) -> Result<Rules, String> {
    let review = SelfSubjectRulesReview {
        spec: SelfSubjectRulesReviewSpec {
            namespace: Some(namespace.to_string()),
        },
        ..SelfSubjectRulesReview::default()
    };
    let reviews: Api<SelfSubjectRulesReview> = Api::all(client.clone());
    let answer = reviews
        .create(&PostParams::default(), &review)
        .await
        .map_err(|e| format!("asking what the broker may do in namespace {namespace}: {e}"))?;
    Ok(Rules(
        answer.status.map(|s| s.resource_rules).unwrap_or_default(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(verbs: &[&str], groups: &[&str], resources: &[&str], names: &[&str]) -> ResourceRule {
        let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        ResourceRule {
            verbs: strings(verbs),
            api_groups: Some(strings(groups)),
            resources: Some(strings(resources)),
            resource_names: (!names.is_empty()).then(|| strings(names)),
        }
    }

    #[test]
    fn rules_cover_verbs_groups_and_resources_with_wildcards_and_names() {
        let g = "core.openfeature.dev";
        let rules = Rules(vec![
            rule(
                &["get", "list", "watch"],
                &[g],
                &["featureflags"],
                &["demo"],
            ),
            rule(&["*"], &["*"], &["widgets"], &[]),
        ]);
        assert!(rules.allow("list", g, "featureflags"));
        assert!(rules.allow("watch", g, "featureflags"));
        assert!(!rules.allow("delete", g, "featureflags"));
        assert!(!rules.allow("list", "", "featureflags"));
        assert!(rules.allow("watch", "example.com", "widgets"));
        assert!(!rules.allow("list", g, "pods"));
        assert!(!Rules::default().allow("list", g, "featureflags"));
    }
}
