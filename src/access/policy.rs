//! `--policy`: which callers may read which namespaces and kinds.
//!
//! ```yaml
//! ownNamespace: true            # default: an identified caller may read its own namespace
//! grants:
//!   - from: team-a              # a namespace, "team-a/<serviceaccount>", "unix:<uid>", "unix:*" or "*"
//!     read: [shared]            # namespaces, or "*" (every namespace and cluster-scoped objects)
//!     kinds: [featureflags.core.openfeature.dev]   # optional; default every kind served
//! ```
//!
//! Everything else is denied. Cluster-scoped objects are readable only through a grant that
//! reads `"*"`. A file that does not parse is refused with its line and reason: at start the
//! broker does not start, at a reload the last good policy stays.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Deserializer};
use tokio::sync::watch;

use super::caller::Caller;
use crate::selector::{KindRef, Selector, is_dns_label, is_dns_subdomain, quote};

/// A policy, parsed and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Whether an identified caller may read its own namespace.
    pub own_namespace: bool,
    /// What else callers may read.
    pub grants: Vec<Grant>,
}

impl Default for Policy {
    /// No file: callers read their own namespace and nothing else.
    fn default() -> Self {
        Policy {
            own_namespace: true,
            grants: Vec::new(),
        }
    }
}

/// One grant.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// Who.
    pub from: From,
    /// Which namespaces.
    pub read: Vec<Namespace>,
    /// Which kinds (`plural.group`); empty: every kind the broker serves.
    #[serde(default)]
    pub kinds: Vec<Kind>,
}

/// Who a grant is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum From {
    /// Every identified caller.
    Anyone,
    /// Every workload in a namespace.
    Namespace(String),
    /// One service account.
    ServiceAccount(String, String),
    /// A local process over the unix socket: one user id, or any.
    Unix(Option<u32>),
}

/// A namespace a grant reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Namespace {
    /// Every namespace, and cluster-scoped objects.
    All,
    /// This one.
    Named(String),
}

/// A kind a grant covers, `plural.group`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kind {
    /// The plural, as discovery names it.
    pub plural: String,
    /// The API group.
    pub group: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct File {
    #[serde(default = "yes")]
    own_namespace: bool,
    #[serde(default)]
    grants: Vec<Grant>,
}

fn yes() -> bool {
    true
}

/// Deserializes through `FromStr`, so a bad value's error carries the YAML line and column.
macro_rules! from_text {
    ($ty:ty) => {
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let text = String::deserialize(d)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

from_text!(From);
from_text!(Namespace);
from_text!(Kind);

impl std::str::FromStr for From {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        if text == "*" {
            return Ok(From::Anyone);
        }
        if let Some(uid) = text.strip_prefix("unix:") {
            return match uid {
                "*" => Ok(From::Unix(None)),
                uid => uid
                    .parse()
                    .map(|u| From::Unix(Some(u)))
                    .map_err(|_| format!("from {}: after unix: comes a user id or *", quote(text))),
            };
        }
        match text.split_once('/') {
            None if is_dns_label(text) => Ok(From::Namespace(text.to_string())),
            Some((ns, sa)) if is_dns_label(ns) && is_dns_subdomain(sa) => {
                Ok(From::ServiceAccount(ns.to_string(), sa.to_string()))
            }
            _ => Err(format!(
                "from {}: expected a namespace, <namespace>/<serviceaccount>, unix:<uid>, unix:* or *",
                quote(text)
            )),
        }
    }
}

impl std::str::FromStr for Namespace {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "*" => Ok(Namespace::All),
            ns if is_dns_label(ns) => Ok(Namespace::Named(ns.to_string())),
            _ => Err(format!("read {}: expected a namespace or *", quote(text))),
        }
    }
}

impl std::str::FromStr for Kind {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "kinds {}: expected <plural>.<group> as discovery names it, e.g. featureflags.core.openfeature.dev",
                quote(text)
            )
        };
        let kind: KindRef = text.parse().map_err(|_| bad())?;
        let lowercase = kind
            .resource
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if kind.version.is_some() || !lowercase {
            return Err(bad());
        }
        Ok(Kind {
            plural: kind.resource,
            group: kind.group,
        })
    }
}

impl fmt::Display for From {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            From::Anyone => f.write_str("*"),
            From::Namespace(ns) => f.write_str(ns),
            From::ServiceAccount(ns, sa) => write!(f, "{ns}/{sa}"),
            From::Unix(None) => f.write_str("unix:*"),
            From::Unix(Some(uid)) => write!(f, "unix:{uid}"),
        }
    }
}

impl Policy {
    /// Parses a policy file's text; an empty file is the default policy.
    pub fn parse(text: &str) -> Result<Policy, String> {
        if text.trim().is_empty() {
            return Ok(Policy::default());
        }
        let file: File = crate::yaml::from_str(text).map_err(|e| with_line(text, &e))?;
        Ok(Policy {
            own_namespace: file.own_namespace,
            grants: file.grants,
        })
    }

    /// Reads and parses a policy file.
    pub fn load(path: &Path) -> Result<Policy, String> {
        let text = std::fs::read(path)
            .map_err(|e| format!("reading the policy {}: {e}", path.display()))?;
        parse_file(path, &text)
    }

    /// Whether `caller` may read some kind in `namespace` (`None`: cluster-scoped objects) —
    /// the check made before the kind is resolved, so that a request for a namespace the caller
    /// may not read costs no API call.
    pub fn may_read_in(&self, caller: &Caller, namespace: Option<&str>) -> bool {
        self.allows(caller, namespace, |_| true)
    }

    /// Whether `caller` may read the resolved `selector`.
    pub fn may_read(&self, caller: &Caller, selector: &Selector) -> bool {
        let (plural, group) = (&selector.kind.resource, &selector.kind.group);
        self.allows(caller, selector.namespace.as_deref(), |grant| {
            grant.kinds.is_empty()
                || grant
                    .kinds
                    .iter()
                    .any(|k| &k.plural == plural && &k.group == group)
        })
    }

    fn allows(
        &self,
        caller: &Caller,
        namespace: Option<&str>,
        kind: impl Fn(&Grant) -> bool,
    ) -> bool {
        let workload = match caller {
            // Identity is off: the policy does not apply.
            Caller::Anonymous { .. } => return true,
            Caller::Workload(w) => Some(w),
            Caller::Local { .. } => None,
        };
        if self.own_namespace
            && let (Some(w), Some(ns)) = (workload, namespace)
            && w.namespace == ns
        {
            return true;
        }
        self.grants.iter().any(|g| {
            g.applies_to(caller)
                && g.read.iter().any(|r| match (r, namespace) {
                    (Namespace::All, _) => true,
                    (Namespace::Named(n), Some(ns)) => n == ns,
                    (Namespace::Named(_), None) => false,
                })
                && kind(g)
        })
    }
}

/// The parser's error, with the line it is about: when the parser gives none (an unknown field
/// of the top-level mapping), it is found by its key.
fn with_line(text: &str, message: &str) -> String {
    let message = message.to_string();
    if let Some(at) = message.split(" at line ").nth(1) {
        // Named by the key on that line, when the parser's reason does not name it.
        let key = at
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|n| n.parse::<usize>().ok())
            .and_then(|n| text.lines().nth(n.checked_sub(1)?))
            .and_then(|l| l.trim_start().trim_start_matches("- ").split_once(':'))
            .map(|(key, _)| key.trim())
            .filter(|key| !key.is_empty() && !message.contains(key));
        return match key {
            Some(key) => format!("{key}: {message}"),
            None => message,
        };
    }
    let key = message
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split_once('`'))
        .map(|(key, _)| key);
    let line = key.and_then(|key| {
        text.lines().position(|l| {
            l.trim_start()
                .trim_start_matches("- ")
                .starts_with(&format!("{key}:"))
        })
    });
    match line {
        Some(n) => format!("{message} at line {}", n + 1),
        None => message,
    }
}

/// A policy file's contents, parsed; errors name the file.
fn parse_file(path: &Path, text: &[u8]) -> Result<Policy, String> {
    let text = std::str::from_utf8(text)
        .map_err(|e| format!("the policy {} is not UTF-8: {e}", path.display()))?;
    Policy::parse(text).map_err(|e| format!("the policy {}: {e}", path.display()))
}

impl Grant {
    fn applies_to(&self, caller: &Caller) -> bool {
        match (&self.from, caller) {
            (From::Anyone, _) => true,
            (From::Namespace(ns), Caller::Workload(w)) => &w.namespace == ns,
            (From::ServiceAccount(ns, sa), Caller::Workload(w)) => {
                &w.namespace == ns && &w.service_account == sa
            }
            (From::Unix(None), Caller::Local { .. }) => true,
            (From::Unix(Some(uid)), Caller::Local { uid: Some(u) }) => uid == u,
            _ => false,
        }
    }
}

/// The policy in force, reloaded from its file when the file changes.
#[derive(Clone)]
pub struct Current {
    rx: watch::Receiver<Arc<Policy>>,
}

impl Current {
    /// A fixed policy.
    pub fn fixed(policy: Policy) -> Self {
        let (_tx, rx) = watch::channel(Arc::new(policy));
        Current { rx }
    }

    /// The policy in `path`, which must parse now, and is then read every `every`: a change
    /// that parses replaces it, one that does not is logged and the policy in force stays;
    /// `on_reload` hears of each, after the new policy is in force. It stops when the policy's
    /// last reader is gone.
    pub fn watch_file(
        path: PathBuf,
        every: Duration,
        on_reload: impl Fn(Result<(), &str>) + Send + 'static,
    ) -> Result<Self, String> {
        let text = std::fs::read(&path)
            .map_err(|e| format!("reading the policy {}: {e}", path.display()))?;
        let first = parse_file(&path, &text)?;
        let (tx, rx) = watch::channel(Arc::new(first));
        tokio::spawn(async move {
            let mut seen = text;
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                if tx.is_closed() {
                    return;
                }
                // Compared by content: a ConfigMap volume swaps a symlink, and mtimes lie.
                let Ok(text) = std::fs::read(&path) else {
                    continue;
                };
                if text == seen {
                    continue;
                }
                let parsed = parse_file(&path, &text);
                seen = text;
                match parsed {
                    Ok(policy) => {
                        tracing::info!(policy = %path.display(), grants = policy.grants.len(), "policy reloaded");
                        tx.send_replace(Arc::new(policy));
                        on_reload(Ok(()));
                    }
                    Err(error) => {
                        tracing::error!(%error, "the changed policy does not parse; keeping the one in force");
                        on_reload(Err(&error));
                    }
                }
            }
        });
        Ok(Current { rx })
    }

    /// The policy in force.
    pub fn get(&self) -> Arc<Policy> {
        self.rx.borrow().clone()
    }

    /// A policy the caller replaces through the sender, with no reloader: for tests.
    #[cfg(test)]
    pub(crate) fn swappable(policy: Policy) -> (Current, watch::Sender<Arc<Policy>>) {
        let (tx, rx) = watch::channel(Arc::new(policy));
        (Current { rx }, tx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::{PodRef, Workload};
    use proptest::prelude::*;

    fn workload(ns: &str, sa: &str) -> Caller {
        Caller::Workload(Workload {
            namespace: ns.into(),
            service_account: sa.into(),
            pod: Some(PodRef {
                name: "p".into(),
                uid: "u".into(),
            }),
            instance: None,
        })
    }

    fn sel(text: &str) -> Selector {
        text.parse().unwrap()
    }

    const POLICY: &str = r#"
grants:
  - from: team-a
    read: [shared]
    kinds: [featureflags.core.openfeature.dev]
  - from: team-b/reader
    read: ["*"]
  - from: "unix:1000"
    read: [ops]
  - from: "*"
    read: [public]
"#;

    #[test]
    fn own_namespace_and_grants_are_what_may_be_read() {
        let p = Policy::parse(POLICY).unwrap();
        let a = workload("team-a", "web");
        let ff = |ns: &str| sel(&format!("featureflags.core.openfeature.dev/{ns}/x"));
        let widget = |ns: &str| sel(&format!("widgets.example.com/{ns}/x"));
        assert!(p.may_read(&a, &ff("team-a")), "own namespace");
        assert!(p.may_read(&a, &widget("team-a")), "own namespace, any kind");
        assert!(p.may_read(&a, &ff("shared")), "granted kind");
        assert!(!p.may_read(&a, &widget("shared")), "kind not granted");
        assert!(p.may_read_in(&a, Some("shared")));
        assert!(!p.may_read(&a, &ff("team-c")));
        assert!(!p.may_read_in(&a, Some("team-c")));
        assert!(p.may_read(&a, &ff("public")), "granted to everyone");
        assert!(
            !p.may_read(&a, &sel("clusterthings.example.com/x")),
            "cluster-scoped"
        );

        let reader = workload("team-b", "reader");
        assert!(p.may_read(&reader, &ff("team-z")));
        assert!(p.may_read(&reader, &sel("clusterthings.example.com/x")));
        assert!(!p.may_read(&workload("team-b", "writer"), &ff("team-z")));

        let local = Caller::Local { uid: Some(1000) };
        assert!(p.may_read(&local, &ff("ops")));
        assert!(!p.may_read(&Caller::Local { uid: Some(0) }, &ff("ops")));
        assert!(
            !p.may_read(&local, &ff("team-a")),
            "no namespace of its own"
        );

        let closed = Policy::parse("ownNamespace: false").unwrap();
        assert!(!closed.may_read(&a, &ff("team-a")));
        assert_eq!(Policy::parse("").unwrap(), Policy::default());
        assert!(Policy::default().may_read(&a, &ff("team-a")));
        assert!(!Policy::default().may_read(&a, &ff("shared")));
    }

    #[test]
    fn bad_policies_are_refused_with_the_line_and_the_reason() {
        let cases = [
            (
                "grants:\n  - from: Team-A\n    read: [x]\n",
                "line 2",
                "from \"Team-A\"",
            ),
            (
                "grants:\n  - from: a\n    read: [x]\n    kinds: [FeatureFlag.core.openfeature.dev]\n",
                "line 4",
                "kinds",
            ),
            (
                "grants:\n  - from: a\n    read: [Not_A_Namespace]\n",
                "line 3",
                "read",
            ),
            (
                "grants:\n  - from: a\n    reads: [x]\n",
                "line 3",
                "unknown field `reads`",
            ),
            ("grants:\n  - from: a\n", "line 2", "missing field `read`"),
            ("ownNamespace: maybe\n", "line 1", "ownNamespace"),
            ("grants: [\n", "line", ""),
            ("grant:\n  - from: a\n", "line 1", "unknown field `grant`"),
        ];
        for (text, line, why) in cases {
            let error = Policy::parse(text).unwrap_err();
            assert!(
                error.contains(line) && error.contains(why),
                "{text:?}: {error}"
            );
        }
    }

    fn from_text() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("*".to_string()),
            "[a-z][a-z0-9-]{0,8}",
            "[a-z][a-z0-9-]{0,8}/[a-z][a-z0-9.-]{0,8}",
            "unix:[0-9]{1,5}",
            "\\PC{0,12}",
        ]
    }

    proptest! {
        #[test]
        fn any_text_parses_or_is_refused_without_panicking(text in "\\PC{0,300}") {
            let _ = Policy::parse(&text);
        }

        #[test]
        fn generated_policies_parse_and_decide_consistently(
            froms in prop::collection::vec(from_text(), 0..5),
            ns in "[a-z]([a-z0-9-]{0,8}[a-z0-9])?",
        ) {
            let grants: Vec<String> = froms
                .iter()
                .map(|f| format!("  - from: {}\n    read: [{ns}]\n", serde_json::to_string(f).unwrap()))
                .collect();
            let text = format!("ownNamespace: false\ngrants:\n{}", grants.concat());
            if let Ok(policy) = Policy::parse(&text) {
                let caller = workload("caller-ns", "sa");
                let target = sel(&format!("featureflags.core.openfeature.dev/{ns}/x"));
                // The kind-blind check never refuses what the full check allows.
                prop_assert!(!policy.may_read(&caller, &target) || policy.may_read_in(&caller, Some(&ns)));
                // Without a grant for everyone or for the caller's namespace, nothing is readable.
                let relevant = policy.grants.iter().any(|g| g.applies_to(&caller));
                prop_assert_eq!(policy.may_read(&caller, &target), relevant);
            }
        }
    }
}
