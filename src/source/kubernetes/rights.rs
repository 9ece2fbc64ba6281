//! What the broker may do in a namespace, from one SelfSubjectRulesReview: the rules of every
//! Role and ClusterRole bound to it there, including those that name objects (`resourceNames`),
//! which a SelfSubjectAccessReview without a name would deny.

use k8s_openapi::api::authorization::v1::{
    ResourceRule, SelfSubjectRulesReview, SelfSubjectRulesReviewSpec,
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
