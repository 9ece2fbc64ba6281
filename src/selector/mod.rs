//! The one place selectors are parsed, displayed and validated.
//!
//! A selector names one custom resource the way kubectl names resources:
//! `<resource>[.<version>].<group>/<namespace>/<name>`, for example
//! `featureflags.core.openfeature.dev/default/demo` or, with the version as kubectl writes it,
//! `featureflags.v1beta1.core.openfeature.dev/default/demo`. For cluster-scoped kinds the
//! namespace is left out: `<resource>.<group>/<name>`. The resource may be the plural, the
//! singular, a short name or the kind; resolution against the source (discovery) turns it into
//! the canonical form, with the plural and the version filled in.
//!
//! A [`Target`] is what a client writes to follow something: a selector, or a set — a kind's
//! objects in a namespace that a label selector selects,
//! `<resource>[.<version>].<group>/<namespace>?labelSelector=<URL-encoded selector>`, read into a
//! [`Set`] (the label selector parsed by the `labels` module).

use std::fmt;
use std::str::FromStr;

pub mod labels;
mod names;

pub use labels::LabelSelector;
use names::is_resource_word;
pub use names::{QUOTE_LIMIT, is_dns_label, is_dns_subdomain, is_version, quote};

/// A kind, as kubectl writes one: `<resource>[.<version>].<group>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KindRef {
    /// Plural, singular, short name or kind, e.g. `featureflags` or `FeatureFlag`.
    pub resource: String,
    /// The API version, if given.
    pub version: Option<String>,
    /// The API group, e.g. `core.openfeature.dev`.
    pub group: String,
}

/// One custom resource: a kind, an optional namespace and a name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Selector {
    /// The kind.
    pub kind: KindRef,
    /// The namespace; `None` for cluster-scoped kinds.
    pub namespace: Option<String>,
    /// The object name.
    pub name: String,
}

/// Why a selector is not valid. Not retryable: the input must change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Nothing was given.
    #[error("empty selector: expected {FORMS}")]
    Empty,
    /// The text has the wrong number of `/`-separated parts.
    #[error("selector {0} has {1} '/'-separated part(s): expected {FORMS}")]
    Parts(String, usize),
    /// A part is empty or malformed.
    #[error("selector {selector}: {part} {value} {why}")]
    Part {
        /// The whole input, quoted (see [`quote`]).
        selector: String,
        /// Which part: `resource`, `version`, `group`, `namespace` or `name`.
        part: &'static str,
        /// The offending value, quoted.
        value: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

/// The accepted forms, for error messages.
pub const FORMS: &str = "<resource>[.<version>].<group>/<namespace>/<name> (e.g. featureflags.core.openfeature.dev/default/demo), or <resource>[.<version>].<group>/<name> for cluster-scoped kinds";

/// A [`ParseError::Part`] about `input`.
fn bad_part(input: &str, part: &'static str, value: &str, why: &'static str) -> ParseError {
    ParseError::Part {
        selector: quote(input),
        part,
        value: quote(value),
        why,
    }
}

impl KindRef {
    /// Validates the parts of a kind; `input` is quoted in errors.
    pub fn new(
        resource: &str,
        version: Option<&str>,
        group: &str,
        input: &str,
    ) -> Result<KindRef, ParseError> {
        let bad = |part, value: &str, why| bad_part(input, part, value, why);
        if !is_resource_word(resource) {
            return Err(bad(
                "resource",
                resource,
                "must be a plural, singular, short name or kind (letters, digits and '-')",
            ));
        }
        if let Some(v) = version
            && !is_version(v)
        {
            return Err(bad("version", v, "must look like v1, v1beta1 or v2alpha1"));
        }
        if !is_dns_subdomain(group) {
            return Err(bad(
                "group",
                group,
                "must be a lowercase DNS subdomain such as core.openfeature.dev",
            ));
        }
        Ok(KindRef {
            resource: resource.to_string(),
            version: version.map(str::to_string),
            group: group.to_string(),
        })
    }

    /// `<resource>.<group>`, without the version: how metrics and messages name a kind.
    pub fn unversioned(&self) -> String {
        format!("{}.{}", self.resource, self.group)
    }

    /// Parses `<resource>[.<version>].<group>`; `input` is quoted in errors.
    pub(crate) fn parse_in(text: &str, input: &str) -> Result<KindRef, ParseError> {
        let missing_group = || {
            bad_part(
                input,
                "group",
                "",
                "is missing: write <resource>.<group>, e.g. featureflags.core.openfeature.dev",
            )
        };
        let (resource, rest) = text.split_once('.').ok_or_else(missing_group)?;
        let (version, group) = match rest.split_once('.') {
            Some((first, group)) if is_version(first) => (Some(first), group),
            _ => (None, rest),
        };
        KindRef::new(resource, version, group, input)
    }
}

impl FromStr for KindRef {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.is_empty() {
            return Err(ParseError::Empty);
        }
        KindRef::parse_in(s, s)
    }
}

impl fmt::Display for KindRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.version {
            Some(v) => write!(f, "{}.{v}.{}", self.resource, self.group),
            None => write!(f, "{}.{}", self.resource, self.group),
        }
    }
}

impl Selector {
    /// Validates the parts of a selector; `input` is quoted in errors.
    pub fn new(
        kind: KindRef,
        namespace: Option<&str>,
        name: &str,
        input: &str,
    ) -> Result<Selector, ParseError> {
        let bad = |part, value: &str, why| bad_part(input, part, value, why);
        if let Some(ns) = namespace
            && !is_dns_label(ns)
        {
            return Err(bad(
                "namespace",
                ns,
                "must be a lowercase RFC 1123 label (letters, digits, '-', at most 63)",
            ));
        }
        if !is_dns_subdomain(name) {
            return Err(bad(
                "name",
                name,
                "must be a lowercase RFC 1123 subdomain (letters, digits, '-', '.', at most 253)",
            ));
        }
        Ok(Selector {
            kind,
            namespace: namespace.map(str::to_string),
            name: name.to_string(),
        })
    }
}

impl FromStr for Selector {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let input = s.trim();
        if input.is_empty() {
            return Err(ParseError::Empty);
        }
        let parts: Vec<&str> = input.split('/').collect();
        let (kind, namespace, name) = match parts.as_slice() {
            [kind, ns, name] => (*kind, Some(*ns), *name),
            [kind, name] => (*kind, None, *name),
            _ => return Err(ParseError::Parts(quote(input), parts.len())),
        };
        let kind = KindRef::parse_in(kind, input)?;
        Selector::new(kind, namespace, name, input)
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{}/{ns}/{}", self.kind, self.name),
            None => write!(f, "{}/{}", self.kind, self.name),
        }
    }
}

/// The namespace of a set that spans every namespace, as requests and selectors write it.
pub const ALL_NAMESPACES: &str = "*";

/// A set of objects: those of a kind in a namespace (or in every namespace, or, for a
/// cluster-scoped kind, all of them) that a label selector selects.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Set {
    /// The kind, resolved (plural and version filled in).
    pub kind: KindRef,
    /// The namespace: [`ALL_NAMESPACES`] for every one, `None` for a cluster-scoped kind.
    pub namespace: Option<String>,
    /// Which of its objects.
    pub labels: LabelSelector,
}

impl Set {
    /// Whether the set spans every namespace. Its members are then keyed `namespace/name`.
    pub fn all_namespaces(&self) -> bool {
        self.namespace.as_deref() == Some(ALL_NAMESPACES)
    }

    /// The namespace to list and watch in: `None` for every namespace (or a cluster-scoped
    /// kind).
    pub fn scope(&self) -> Option<&str> {
        self.namespace.as_deref().filter(|ns| *ns != ALL_NAMESPACES)
    }

    /// The key of the member `name` in `namespace`: its name, or `namespace/name` in a set
    /// that spans every namespace.
    pub fn key(&self, namespace: &str, name: &str) -> String {
        if self.all_namespaces() {
            format!("{namespace}/{name}")
        } else {
            name.to_string()
        }
    }

    /// The canonical selector of the member with `key` (see [`Set::key`]).
    pub fn member(&self, key: &str) -> Selector {
        let (namespace, name) = match key.split_once('/') {
            Some((ns, name)) if self.all_namespaces() => (Some(ns.to_string()), name),
            _ => (self.namespace.clone(), key),
        };
        Selector {
            kind: self.kind.clone(),
            namespace,
            name: name.to_string(),
        }
    }
}

impl std::fmt::Display for Set {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.kind)?;
        if let Some(ns) = &self.namespace {
            write!(f, "/{ns}")?;
        }
        if !self.labels.is_empty() {
            write!(f, "?labelSelector={}", self.labels)?;
        }
        Ok(())
    }
}

/// What a client asks to follow: one resource (a [`Selector`]), or a set (written
/// `featureflags.core.openfeature.dev/<ns>?labelSelector=app%3Dcheckout`, [`ALL_NAMESPACES`]
/// for every namespace). `crd-broker subscribe`, `crd-broker top` and the flagd set selector
/// all read it.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// One resource.
    One(Selector),
    /// A kind's objects in a namespace (none for a cluster-scoped kind) that a label selector
    /// selects; its kind as written, not yet resolved.
    Set(Set),
}

impl FromStr for Target {
    type Err = String;

    fn from_str(input: &str) -> Result<Self, String> {
        let Some((path, query)) = input.split_once('?') else {
            return input.parse().map(Target::One).map_err(|e| e.to_string());
        };
        let labels = match query.split_once('=') {
            Some(("labelSelector", value)) => percent_decoded(value)?,
            _ => {
                return Err(format!(
                    "{}: a set is written KIND/NAMESPACE?labelSelector=SELECTOR (URL-encoded)",
                    quote(input)
                ));
            }
        };
        let (kind, namespace) = match path.split_once('/') {
            Some((kind, ns)) => (kind, Some(ns)),
            None => (path, None),
        };
        let kind = KindRef::parse_in(kind, input).map_err(|e| e.to_string())?;
        // The namespace is checked as a selector's would be; `*` is every namespace.
        let checked = namespace.filter(|ns| *ns != ALL_NAMESPACES);
        Selector::new(kind.clone(), checked, "set", input).map_err(|e| e.to_string())?;
        let labels = labels
            .parse()
            .map_err(|e: String| format!("{}: has a bad label selector: {e}", quote(input)))?;
        Ok(Target::Set(Set {
            kind,
            namespace: namespace.map(str::to_string),
            labels,
        }))
    }
}

/// `%XX` escapes (and `+` for a space) decoded.
fn percent_decoded(text: &str) -> Result<String, String> {
    let mut out = Vec::with_capacity(text.len());
    let mut bytes = text.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let hex: Vec<u8> = bytes.by_ref().take(2).collect();
                let value = std::str::from_utf8(&hex)
                    .ok()
                    .filter(|h| h.len() == 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| {
                        format!("{}: a '%' must be followed by two hex digits", quote(text))
                    })?;
                out.push(value);
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
    }
    String::from_utf8(out).map_err(|_| format!("{} does not decode to UTF-8", quote(text)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_the_kubectl_forms() {
        let s: Selector = "featureflags.core.openfeature.dev/default/demo"
            .parse()
            .unwrap();
        assert_eq!(s.kind.resource, "featureflags");
        assert_eq!(s.kind.version, None);
        assert_eq!(s.kind.group, "core.openfeature.dev");
        assert_eq!(s.namespace.as_deref(), Some("default"));
        assert_eq!(s.name, "demo");

        let v: Selector = "FeatureFlag.v1beta1.core.openfeature.dev/default/demo"
            .parse()
            .unwrap();
        assert_eq!(v.kind.resource, "FeatureFlag");
        assert_eq!(v.kind.version.as_deref(), Some("v1beta1"));
        assert_eq!(v.kind.group, "core.openfeature.dev");

        let cluster: Selector = "widgets.example.com/w1".parse().unwrap();
        assert_eq!(cluster.namespace, None);
        assert_eq!(cluster.to_string(), "widgets.example.com/w1");
    }

    #[test]
    fn errors_name_the_problem() {
        let err = |s: &str| s.parse::<Selector>().unwrap_err().to_string();
        assert!(err("").contains("empty selector"));
        assert!(err("featureflags/default/demo").contains("group \"\" is missing"));
        assert!(err("a.b.c/d/e/f").contains("4 '/'-separated part(s)"));
        assert!(
            err("featureflags.core.openfeature.dev/Default/demo").contains("namespace \"Default\"")
        );
        assert!(err("featureflags.core.openfeature.dev/default/de_mo").contains("name \"de_mo\""));
        assert!(
            err("feature_flags.core.openfeature.dev/default/demo")
                .contains("resource \"feature_flags\"")
        );
        assert!(err("featureflags.Core.dev/default/demo").contains("group \"Core.dev\""));
        assert!(err("featureflags.core.openfeature.dev//demo").contains("namespace \"\""));
    }

    #[test]
    fn errors_quote_at_most_a_bounded_prefix() {
        let huge = format!(
            "featureflags.core.openfeature.dev/default/{}",
            "é".repeat(500_000)
        );
        let message = huge.parse::<Selector>().unwrap_err().to_string();
        assert!(message.len() < 600, "{} bytes", message.len());
        assert!(message.contains("(1000042 bytes)"), "{message}");
        let parts = "a/"
            .repeat(100_000)
            .parse::<Selector>()
            .unwrap_err()
            .to_string();
        assert!(parts.len() < 400, "{} bytes", parts.len());
    }

    #[test]
    fn versions_are_recognised_like_kubectl() {
        for v in ["v1", "v1beta1", "v2alpha3", "v10"] {
            assert!(is_version(v), "{v}");
        }
        for v in ["v", "v0", "v1beta", "v1gamma1", "version1", "1", "v01"] {
            assert!(!is_version(v), "{v}");
        }
    }

    fn label() -> impl Strategy<Value = String> {
        "[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?"
    }

    fn subdomain() -> impl Strategy<Value = String> {
        prop::collection::vec(label(), 1..4).prop_map(|l| l.join("."))
    }

    fn group() -> impl Strategy<Value = String> {
        // A group whose first label looks like a version would read as one, as in kubectl.
        (label(), subdomain())
            .prop_filter("first label is not a version", |(l, _)| !is_version(l))
            .prop_map(|(l, rest)| format!("{l}.{rest}"))
    }

    fn selector() -> impl Strategy<Value = Selector> {
        (
            "[A-Za-z][A-Za-z0-9]{0,12}",
            prop::option::of("v[1-9][0-9]?((alpha|beta)[1-9])?"),
            group(),
            prop::option::of(label()),
            subdomain(),
        )
            .prop_map(|(resource, version, group, namespace, name)| Selector {
                kind: KindRef {
                    resource,
                    version,
                    group,
                },
                namespace,
                name,
            })
    }

    proptest! {
        #[test]
        fn display_and_parse_round_trip(s in selector()) {
            let text = s.to_string();
            let back: Selector = text.parse().unwrap();
            prop_assert_eq!(&back, &s);
            prop_assert_eq!(back.to_string(), text);
        }

        #[test]
        fn parsing_arbitrary_text_never_panics(text in "\\PC{0,80}") {
            let _ = text.parse::<Selector>();
        }

        #[test]
        fn whatever_parses_displays_back_to_an_equal_selector(text in "[a-zA-Z0-9./_-]{0,60}") {
            if let Ok(s) = text.parse::<Selector>() {
                prop_assert_eq!(s.to_string().parse::<Selector>().unwrap(), s);
            }
        }
    }

    #[test]
    fn targets_are_resources_or_sets_with_an_encoded_label_selector() {
        let one: Target = "featureflags.core.openfeature.dev/default/demo"
            .parse()
            .unwrap();
        assert!(matches!(one, Target::One(_)));
        let set: Target =
            "ff.v1beta1.core.openfeature.dev/default?labelSelector=app%3Dcheckout%2Ctier+in+(web)"
                .parse()
                .unwrap();
        let Target::Set(set) = set else {
            panic!("a set: {set:?}");
        };
        assert_eq!(set.kind.to_string(), "ff.v1beta1.core.openfeature.dev");
        assert_eq!(set.namespace.as_deref(), Some("default"));
        // Decoded and parsed; written back as the broker writes it (a one-value `in` is `=`).
        assert_eq!(set.labels.to_string(), "app=checkout,tier=web");
        let all: Target = "ff.core.openfeature.dev/*?labelSelector=a".parse().unwrap();
        assert!(
            matches!(all, Target::Set(Set { namespace: Some(ns), .. }) if ns == ALL_NAMESPACES)
        );
        for (bad, needle) in [
            ("ff.core.openfeature.dev/default?app=x", "labelSelector="),
            (
                "ff.core.openfeature.dev/default?labelSelector=a%3",
                "two hex digits",
            ),
            (
                "ff.core.openfeature.dev/Bad_NS?labelSelector=a",
                "namespace",
            ),
            (
                "ff.core.openfeature.dev/default?labelSelector=a%3D%3D%3Db",
                "bad label selector",
            ),
        ] {
            let e = bad.parse::<Target>().unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }
}
