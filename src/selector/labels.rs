//! Kubernetes label selectors, as `kubectl -l` and the API server's `labelSelector` take them:
//! `key=value`, `key==value`, `key!=value`, `key in (a,b)`, `key notin (a,b)`, `key` and `!key`,
//! joined by commas. Parsed to refuse a malformed one with the fault named, matched against an
//! object's labels, and written back in one canonical form (which keys shared watches).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// The longest selector taken.
pub const MAX_SELECTOR_BYTES: usize = 4096;

/// A parsed label selector; the empty one selects everything.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct LabelSelector {
    requirements: Vec<Requirement>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Requirement {
    key: String,
    op: Op,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Op {
    Exists,
    NotExists,
    In(BTreeSet<String>),
    NotIn(BTreeSet<String>),
}

impl LabelSelector {
    /// Whether `labels` satisfy every requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| {
            let value = labels.get(&r.key);
            match &r.op {
                Op::Exists => value.is_some(),
                Op::NotExists => value.is_none(),
                Op::In(values) => value.is_some_and(|v| values.contains(v)),
                Op::NotIn(values) => value.is_none_or(|v| !values.contains(v)),
            }
        })
    }

    /// Whether it selects everything.
    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }
}

impl std::str::FromStr for LabelSelector {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        if text.len() > MAX_SELECTOR_BYTES {
            return Err(format!(
                "the label selector has {} bytes; at most {MAX_SELECTOR_BYTES}",
                text.len()
            ));
        }
        let mut requirements = Vec::new();
        for part in split_top_level(text)? {
            let part = part.trim();
            if part.is_empty() {
                if text.trim().is_empty() {
                    break;
                }
                return Err(format!("an empty requirement in label selector {text:?}"));
            }
            requirements.push(requirement(part)?);
        }
        requirements.sort();
        requirements.dedup();
        Ok(LabelSelector { requirements })
    }
}

/// Splits at commas outside parentheses.
fn split_top_level(text: &str) -> Result<Vec<&str>, String> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' if depth == 0 => depth = 1,
            '(' => return Err(format!("nested parentheses in label selector {text:?}")),
            ')' if depth == 1 => depth = 0,
            ')' => return Err(format!("an unmatched ')' in label selector {text:?}")),
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("an unclosed '(' in label selector {text:?}"));
    }
    parts.push(&text[start..]);
    Ok(parts)
}

fn requirement(part: &str) -> Result<Requirement, String> {
    if let Some(key) = part.strip_prefix('!') {
        return Ok(Requirement {
            key: label_key(key.trim())?,
            op: Op::NotExists,
        });
    }
    for (token, negated) in [(" notin ", true), (" in ", false)] {
        if let Some(at) = part.find(token) {
            let key = label_key(part[..at].trim())?;
            let list = part[at + token.len()..].trim();
            let inner = list
                .strip_prefix('(')
                .and_then(|l| l.strip_suffix(')'))
                .ok_or_else(|| format!("{part:?}: the values of in/notin go in parentheses"))?;
            let values = inner
                .split(',')
                .map(|v| label_value(v.trim()))
                .collect::<Result<BTreeSet<_>, _>>()?;
            let op = if negated {
                Op::NotIn(values)
            } else {
                Op::In(values)
            };
            return Ok(Requirement { key, op });
        }
    }
    for (token, negated) in [("!=", true), ("==", false), ("=", false)] {
        if let Some((key, value)) = part.split_once(token) {
            let values = BTreeSet::from([label_value(value.trim())?]);
            let op = if negated {
                Op::NotIn(values)
            } else {
                Op::In(values)
            };
            return Ok(Requirement {
                key: label_key(key.trim())?,
                op,
            });
        }
    }
    Ok(Requirement {
        key: label_key(part)?,
        op: Op::Exists,
    })
}

/// A label key: an optional DNS-subdomain prefix and `/`, then a name of at most 63 characters.
fn label_key(key: &str) -> Result<String, String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix
        && !super::names::is_dns_subdomain(prefix)
    {
        return Err(format!(
            "label key {key:?}: its prefix is not a DNS subdomain"
        ));
    }
    if name.is_empty() || !is_label_text(name) {
        return Err(format!(
            "label key {key:?} is not valid: at most 63 characters, alphanumeric, '-', '_' or '.', beginning and ending with an alphanumeric"
        ));
    }
    Ok(key.to_string())
}

fn label_value(value: &str) -> Result<String, String> {
    if !value.is_empty() && !is_label_text(value) {
        return Err(format!(
            "label value {value:?} is not valid: at most 63 characters, alphanumeric, '-', '_' or '.', beginning and ending with an alphanumeric"
        ));
    }
    Ok(value.to_string())
}

fn is_label_text(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() <= 63
        && b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

impl fmt::Display for LabelSelector {
    /// The canonical form: requirements sorted, `=` and `!=` for single values.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .requirements
            .iter()
            .map(|r| {
                let list = |v: &BTreeSet<String>| v.iter().cloned().collect::<Vec<_>>().join(",");
                match &r.op {
                    Op::Exists => r.key.clone(),
                    Op::NotExists => format!("!{}", r.key),
                    Op::In(v) if v.len() == 1 => format!("{}={}", r.key, list(v)),
                    Op::NotIn(v) if v.len() == 1 => format!("{}!={}", r.key, list(v)),
                    Op::In(v) => format!("{} in ({})", r.key, list(v)),
                    Op::NotIn(v) => format!("{} notin ({})", r.key, list(v)),
                }
            })
            .collect();
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parses_every_form_matches_and_prints_canonically() {
        let s: LabelSelector =
            "tier notin (cache), app==checkout,env in (prod, staging),!legacy,team"
                .parse()
                .unwrap();
        assert_eq!(
            s.to_string(),
            "app=checkout,env in (prod,staging),!legacy,team,tier!=cache"
        );
        assert_eq!(s.to_string().parse::<LabelSelector>().unwrap(), s);
        let ok = labels(&[("app", "checkout"), ("env", "prod"), ("team", "a")]);
        assert!(s.matches(&ok));
        let mut cached = ok.clone();
        cached.insert("tier".into(), "cache".into());
        assert!(!s.matches(&cached));
        let mut legacy = ok.clone();
        legacy.insert("legacy".into(), "".into());
        assert!(!s.matches(&legacy));
        assert!(!s.matches(&labels(&[
            ("app", "checkout"),
            ("env", "dev"),
            ("team", "a")
        ])));
        assert!("".parse::<LabelSelector>().unwrap().matches(&labels(&[])));
        assert!(
            "example.com/app=x"
                .parse::<LabelSelector>()
                .unwrap()
                .matches(&labels(&[("example.com/app", "x")]))
        );
    }

    #[test]
    fn malformed_selectors_name_the_fault() {
        assert_eq!(
            "app=".parse::<LabelSelector>().unwrap().to_string(),
            "app=",
            "an empty value is a value"
        );
        for (bad, needle) in [
            ("app in (a", "unclosed"),
            ("app in a,b", "parentheses"),
            ("-app=x", "label key"),
            ("app=-x", "label value"),
            ("a,,b", "empty requirement"),
            ("Exa_mple.com/app=x", "prefix"),
            ("app in ((a))", "nested"),
        ] {
            let e = bad.parse::<LabelSelector>().unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
        assert!("a=b,".repeat(2000).parse::<LabelSelector>().is_err());
    }
}
