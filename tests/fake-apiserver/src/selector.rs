//! Field and label selectors, parsed and matched as `k8s.io/apimachinery` does:
//! `metadata.name` / `metadata.namespace` fields (and a kind's own selectable fields, such as a
//! pod's `status.podIP`), and label equality and set requirements.

use serde_json::Value;

use crate::error::ApiError;

/// One field requirement: `metadata.name=x`, `metadata.namespace!=y`.
#[derive(Debug, Clone, PartialEq)]
struct FieldTerm {
    field: FieldPath,
    value: String,
    equal: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum FieldPath {
    Name,
    Namespace,
    /// A kind's own field (dotted path), and its value when an object lacks it.
    Other(&'static str, &'static str),
}

/// A parsed `fieldSelector` (all terms must hold).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FieldSelector {
    terms: Vec<FieldTerm>,
}

impl FieldSelector {
    /// Parses `metadata.name=a,metadata.namespace!=b`, and the fields in `selectable` (path,
    /// value when absent); other fields are a 400, as for CRDs without `selectableFields`.
    pub fn parse(
        text: &str,
        selectable: &[(&'static str, &'static str)],
    ) -> Result<Self, ApiError> {
        let mut terms = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (field, value, equal) = if let Some((f, v)) = part.split_once("!=") {
                (f, v, false)
            } else if let Some((f, v)) = part.split_once("==") {
                (f, v, true)
            } else if let Some((f, v)) = part.split_once('=') {
                (f, v, true)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid selector: '{text}'; can't understand '{part}'"
                )));
            };
            let field = match field.trim() {
                "metadata.name" => FieldPath::Name,
                "metadata.namespace" => FieldPath::Namespace,
                other => match selectable.iter().find(|(path, _)| *path == other) {
                    Some((path, absent)) => FieldPath::Other(path, absent),
                    None => {
                        return Err(ApiError::bad_request(format!(
                            "field label not supported: {other}"
                        )));
                    }
                },
            };
            terms.push(FieldTerm {
                field,
                value: value.trim().to_string(),
                equal,
            });
        }
        Ok(FieldSelector { terms })
    }

    /// Whether the object's metadata satisfies every term.
    pub fn matches(&self, obj: &Value) -> bool {
        self.terms.iter().all(|t| {
            let actual = match t.field {
                FieldPath::Name => obj["metadata"]["name"].as_str().unwrap_or("").to_string(),
                FieldPath::Namespace => obj["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                FieldPath::Other(path, absent) => {
                    match path.split('.').fold(obj, |v, key| &v[key]) {
                        Value::String(s) => s.clone(),
                        Value::Bool(b) => b.to_string(),
                        Value::Number(n) => n.to_string(),
                        _ => absent.to_string(),
                    }
                }
            };
            (actual == t.value) == t.equal
        })
    }

    /// The name an exact `metadata.name=X` term pins, which authorization treats as the
    /// request's object name (so RBAC `resourceNames` applies to per-object list and watch).
    pub fn exact_name(&self) -> Option<&str> {
        self.terms
            .iter()
            .find(|t| t.field == FieldPath::Name && t.equal)
            .map(|t| t.value.as_str())
    }

    /// Whether the selector has no terms.
    pub fn is_empty(&self) -> bool {
        self.terms.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq)]
enum LabelTerm {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed `labelSelector` (all requirements must hold).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LabelSelector {
    terms: Vec<LabelTerm>,
}

impl LabelSelector {
    /// Parses the label selector grammar: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`,
    /// `k notin (a,b)`, comma-separated.
    pub fn parse(text: &str) -> Result<Self, ApiError> {
        let bad = |why: &str| {
            ApiError::bad_request(format!("unable to parse requirement: {why} in \"{text}\""))
        };
        let mut terms = Vec::new();
        let mut rest = text.trim();
        while !rest.is_empty() {
            // A set requirement holds commas inside its parentheses, so find the term's end first.
            let end = term_end(rest);
            let term = rest[..end].trim();
            rest = rest[end..].trim_start_matches(',').trim();
            if term.is_empty() {
                continue;
            }
            let parsed = if let Some(key) = term.strip_prefix('!') {
                LabelTerm::NotExists(valid_key(key.trim()).map_err(|e| bad(&e))?)
            } else if let Some((k, v)) = term.split_once("!=") {
                LabelTerm::NotEquals(
                    valid_key(k.trim()).map_err(|e| bad(&e))?,
                    valid_value(v.trim()).map_err(|e| bad(&e))?,
                )
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                LabelTerm::Equals(
                    valid_key(k.trim()).map_err(|e| bad(&e))?,
                    valid_value(v.trim()).map_err(|e| bad(&e))?,
                )
            } else if let Some((k, set)) = split_set(term, " notin ") {
                LabelTerm::NotIn(
                    valid_key(k).map_err(|e| bad(&e))?,
                    parse_set(set).map_err(|e| bad(&e))?,
                )
            } else if let Some((k, set)) = split_set(term, " in ") {
                LabelTerm::In(
                    valid_key(k).map_err(|e| bad(&e))?,
                    parse_set(set).map_err(|e| bad(&e))?,
                )
            } else {
                LabelTerm::Exists(valid_key(term).map_err(|e| bad(&e))?)
            };
            terms.push(parsed);
        }
        Ok(LabelSelector { terms })
    }

    /// Whether the object's `metadata.labels` satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = &obj["metadata"]["labels"];
        let get = |k: &str| labels.get(k).and_then(Value::as_str);
        self.terms.iter().all(|t| match t {
            LabelTerm::Equals(k, v) => get(k) == Some(v.as_str()),
            LabelTerm::NotEquals(k, v) => get(k) != Some(v.as_str()),
            LabelTerm::In(k, set) => get(k).is_some_and(|v| set.iter().any(|s| s == v)),
            LabelTerm::NotIn(k, set) => get(k).is_none_or(|v| set.iter().all(|s| s != v)),
            LabelTerm::Exists(k) => get(k).is_some(),
            LabelTerm::NotExists(k) => get(k).is_none(),
        })
    }

    /// Whether the selector has no requirements.
    pub fn is_empty(&self) -> bool {
        self.terms.is_empty()
    }
}

/// The byte offset where the first term of `text` ends: the first comma outside parentheses.
fn term_end(text: &str) -> usize {
    let mut depth = 0usize;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => return i,
            _ => {}
        }
    }
    text.len()
}

fn split_set<'a>(term: &'a str, op: &str) -> Option<(&'a str, &'a str)> {
    let (k, set) = term.split_once(op)?;
    Some((k.trim(), set.trim()))
}

fn parse_set(set: &str) -> Result<Vec<String>, String> {
    let inner = set
        .strip_prefix('(')
        .and_then(|s| s.strip_suffix(')'))
        .ok_or_else(|| format!("found '{set}', expected: '('"))?;
    inner
        .split(',')
        .map(|v| valid_value(v.trim()))
        .collect::<Result<Vec<_>, _>>()
}

fn valid_key(key: &str) -> Result<String, String> {
    let name = key.rsplit('/').next().unwrap_or(key);
    if name.is_empty()
        || name.len() > 63
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        || !name.starts_with(|c: char| c.is_ascii_alphanumeric())
        || !name.ends_with(|c: char| c.is_ascii_alphanumeric())
    {
        return Err(format!(
            "invalid label key \"{key}\": name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
        ));
    }
    Ok(key.to_string())
}

fn valid_value(value: &str) -> Result<String, String> {
    let ok = value.is_empty()
        || (value.len() <= 63
            && value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            && value.starts_with(|c: char| c.is_ascii_alphanumeric())
            && value.ends_with(|c: char| c.is_ascii_alphanumeric()));
    if ok {
        Ok(value.to_string())
    } else {
        Err(format!("invalid label value: \"{value}\""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(name: &str, ns: &str, labels: Value) -> Value {
        json!({ "metadata": { "name": name, "namespace": ns, "labels": labels } })
    }

    #[test]
    fn field_selector_matches_name_and_namespace() {
        let s =
            FieldSelector::parse("metadata.name=a,metadata.namespace!=kube-system", &[]).unwrap();
        assert!(s.matches(&obj("a", "default", json!({}))));
        assert!(!s.matches(&obj("a", "kube-system", json!({}))));
        assert!(!s.matches(&obj("b", "default", json!({}))));
        assert_eq!(s.exact_name(), Some("a"));
        assert_eq!(
            FieldSelector::parse("metadata.name==a", &[])
                .unwrap()
                .exact_name(),
            Some("a")
        );
    }

    #[test]
    fn pod_fields_are_selectable_with_their_absent_values() {
        let fields = crate::crd::POD_FIELDS;
        let pod = json!({ "metadata": { "name": "p" }, "spec": {}, "status": { "podIP": "10.0.0.5", "phase": "Running" } });
        let sel = |s: &str| FieldSelector::parse(s, fields).unwrap().matches(&pod);
        assert!(sel("status.podIP=10.0.0.5"));
        assert!(!sel("status.podIP=10.0.0.6"));
        assert!(sel("status.podIP=10.0.0.5,status.phase=Running"));
        assert!(sel("spec.hostNetwork=false"));
        assert!(!sel("spec.hostNetwork=true"));
        assert!(FieldSelector::parse("status.podIP=1", &[]).is_err());
    }

    #[test]
    fn field_selector_rejects_unsupported_fields() {
        let err = FieldSelector::parse("spec.x=1", &[]).unwrap_err();
        assert_eq!(err.code(), 400);
        assert!(format!("{err:?}").contains("field label not supported: spec.x"));
    }

    #[test]
    fn label_selector_equality_and_sets() {
        let o = obj("a", "d", json!({ "app": "web", "tier": "front" }));
        let case = |s: &str| LabelSelector::parse(s).unwrap().matches(&o);
        assert!(case("app=web"));
        assert!(case("app==web,tier"));
        assert!(!case("app!=web"));
        assert!(case("app in (web, api),!missing"));
        assert!(!case("app notin (web)"));
        assert!(case("missing notin (x)"));
        assert!(!case("tier in (back)"));
        assert!(case("example.com/missing notin (a,b),tier in (front)"));
        assert!(case(""));
    }

    #[test]
    fn label_selector_rejects_garbage() {
        assert_eq!(LabelSelector::parse("a in b").unwrap_err().code(), 400);
        assert_eq!(LabelSelector::parse("-bad=x").unwrap_err().code(), 400);
        assert_eq!(LabelSelector::parse("a=b c").unwrap_err().code(), 400);
    }
}
