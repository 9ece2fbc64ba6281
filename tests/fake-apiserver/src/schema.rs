//! Structural-schema handling on writes, as the real server does for custom resources, in one
//! walk: apply `default`s, prune fields the schema does not declare, and validate types, `enum`,
//! `required` and the numeric, length and size bounds.
//!
//! Not covered: `pattern`, `format`, CEL rules (`x-kubernetes-validations`), list-type and
//! map-type uniqueness, and `x-kubernetes-embedded-resource`.

use serde_json::{Map, Value};

/// What one walk found.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Fields dropped because the schema does not declare them (`.spec.typo`).
    pub unknown: Vec<String>,
    /// Validation failures as `(field, message)`; any makes the write a 422.
    pub causes: Vec<(String, String)>,
}

/// Defaults, prunes and validates `obj` against its version's `openAPIV3Schema`. The top-level
/// `apiVersion`, `kind` and `metadata` are the server's business and left alone.
pub fn apply(schema: &Value, obj: &mut Value) -> Outcome {
    let mut out = Outcome::default();
    let Some(fields) = obj.as_object_mut() else {
        out.causes
            .push(("<root>".into(), "Invalid value: must be an object".into()));
        return out;
    };
    let props = schema.get("properties").and_then(Value::as_object);
    let keep_unknown = preserves_unknown(schema);
    apply_defaults(schema, fields);
    let keys: Vec<String> = fields.keys().cloned().collect();
    for key in keys {
        if matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
            continue;
        }
        match props.and_then(|p| p.get(&key)) {
            Some(sub) => {
                if let Some(value) = fields.get_mut(&key) {
                    walk(sub, value, &key, &mut out);
                }
            }
            None if keep_unknown => {}
            None => {
                fields.remove(&key);
                out.unknown.push(format!(".{key}"));
            }
        }
    }
    check_required(schema, fields, "", &mut out);
    out
}

fn preserves_unknown(schema: &Value) -> bool {
    schema["x-kubernetes-preserve-unknown-fields"].as_bool() == Some(true)
}

fn apply_defaults(schema: &Value, fields: &mut Map<String, Value>) {
    if let Some(props) = schema.get("properties").and_then(Value::as_object) {
        for (key, sub) in props {
            if let Some(default) = sub.get("default")
                && !fields.contains_key(key)
            {
                fields.insert(key.clone(), default.clone());
            }
        }
    }
}

fn check_required(schema: &Value, fields: &Map<String, Value>, path: &str, out: &mut Outcome) {
    for key in schema["required"].as_array().into_iter().flatten() {
        if let Some(key) = key.as_str()
            && !fields.contains_key(key)
        {
            out.causes
                .push((join(path, key), "Required value".to_string()));
        }
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn type_ok(schema: &Value, value: &Value) -> bool {
    if schema["x-kubernetes-int-or-string"].as_bool() == Some(true) {
        return value.is_string() || value.is_i64() || value.is_u64();
    }
    match schema["type"].as_str() {
        None => true,
        Some("object") => value.is_object(),
        Some("array") => value.is_array(),
        Some("string") => value.is_string(),
        Some("boolean") => value.is_boolean(),
        Some("integer") => value.is_i64() || value.is_u64(),
        Some("number") => value.is_number(),
        Some(_) => true,
    }
}

fn walk(schema: &Value, value: &mut Value, path: &str, out: &mut Outcome) {
    if value.is_null() {
        if schema["nullable"].as_bool() != Some(true) && schema.get("type").is_some() {
            let ty = schema["type"].as_str().unwrap_or("");
            out.causes.push((
                path.to_string(),
                format!("Invalid value: \"null\": {path} in body must be of type {ty}: \"null\""),
            ));
        }
        return;
    }
    if !type_ok(schema, value) {
        let ty = schema["type"].as_str().unwrap_or("integer or string");
        let actual = json_type(value);
        out.causes.push((
            path.to_string(),
            format!(
                "Invalid value: \"{actual}\": {path} in body must be of type {ty}: \"{actual}\""
            ),
        ));
        return;
    }
    if let Some(allowed) = schema["enum"].as_array()
        && !allowed.contains(value)
    {
        let list: Vec<String> = allowed.iter().map(Value::to_string).collect();
        out.causes.push((
            path.to_string(),
            format!(
                "Unsupported value: {value}: supported values: {}",
                list.join(", ")
            ),
        ));
    }
    check_bounds(schema, value, path, out);
    match value {
        Value::Object(fields) => walk_object(schema, fields, path, out),
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter_mut().enumerate() {
                    walk(item_schema, item, &format!("{path}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

fn walk_object(schema: &Value, fields: &mut Map<String, Value>, path: &str, out: &mut Outcome) {
    apply_defaults(schema, fields);
    let props = schema.get("properties").and_then(Value::as_object);
    let additional = schema.get("additionalProperties");
    let keep_unknown = preserves_unknown(schema)
        || additional.and_then(Value::as_bool) == Some(true)
        || (props.is_none() && additional.is_none() && schema.get("type").is_none());
    let keys: Vec<String> = fields.keys().cloned().collect();
    for key in keys {
        let declared = props.and_then(|p| p.get(&key));
        let Some(value) = fields.get_mut(&key) else {
            continue;
        };
        match (declared, additional) {
            (Some(sub), _) => walk(sub, value, &join(path, &key), out),
            (None, Some(sub)) if sub.is_object() => {
                walk(sub, value, &format!("{path}[{key}]"), out);
            }
            _ if keep_unknown => {}
            _ => {
                fields.remove(&key);
                out.unknown.push(format!(".{}", join(path, &key)));
            }
        }
    }
    check_required(schema, fields, path, out);
}

fn check_bounds(schema: &Value, value: &Value, path: &str, out: &mut Outcome) {
    let mut fail = |message: String| out.causes.push((path.to_string(), message));
    let bound = |key: &str| schema.get(key).and_then(Value::as_f64);
    if let Some(n) = value.as_f64() {
        if let Some(min) = bound("minimum")
            && n < min
        {
            fail(format!(
                "Invalid value: {value}: {path} in body should be greater than or equal to {min}"
            ));
        }
        if let Some(max) = bound("maximum")
            && n > max
        {
            fail(format!(
                "Invalid value: {value}: {path} in body should be less than or equal to {max}"
            ));
        }
    }
    let len = match value {
        Value::String(s) => Some((s.chars().count() as f64, "minLength", "maxLength", "chars")),
        Value::Array(a) => Some((a.len() as f64, "minItems", "maxItems", "items")),
        Value::Object(o) => Some((
            o.len() as f64,
            "minProperties",
            "maxProperties",
            "properties",
        )),
        _ => None,
    };
    if let Some((n, min_key, max_key, unit)) = len {
        if let Some(min) = bound(min_key)
            && n < min
        {
            fail(format!(
                "Invalid value: {n}: {path} in body should have at least {min} {unit}"
            ));
        }
        if let Some(max) = bound(max_key)
            && n > max
        {
            fail(format!("Too long: may not be more than {max} {unit}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Value {
        json!({
            "type": "object",
            "properties": {
                "spec": {
                    "type": "object",
                    "required": ["size"],
                    "properties": {
                        "size": { "type": "integer", "minimum": 1 },
                        "mode": { "type": "string", "enum": ["a", "b"], "default": "a" },
                        "flags": {
                            "type": "object",
                            "additionalProperties": {
                                "type": "object",
                                "properties": { "state": { "type": "string" } }
                            }
                        },
                        "free": { "type": "object", "x-kubernetes-preserve-unknown-fields": true },
                        "port": { "x-kubernetes-int-or-string": true }
                    }
                }
            }
        })
    }

    #[test]
    fn defaults_prunes_and_keeps_preserved_fields() {
        let mut obj = json!({
            "apiVersion": "x/v1", "kind": "X", "metadata": { "name": "a" },
            "spec": {
                "size": 2, "typo": 1, "port": "http",
                "flags": { "f": { "state": "ON", "extra": true } },
                "free": { "anything": { "goes": 1 } }
            },
            "top": 1
        });
        let out = apply(&schema(), &mut obj);
        assert!(out.causes.is_empty(), "{:?}", out.causes);
        assert_eq!(out.unknown, [".spec.flags[f].extra", ".spec.typo", ".top"]);
        assert_eq!(obj["spec"]["mode"], "a");
        assert!(obj["spec"].get("typo").is_none());
        assert!(obj.get("top").is_none());
        assert!(obj["spec"]["flags"]["f"].get("extra").is_none());
        assert_eq!(obj["spec"]["free"]["anything"]["goes"], 1);
        assert_eq!(obj["metadata"]["name"], "a");
    }

    #[test]
    fn reports_type_enum_required_and_bounds() {
        let mut obj = json!({ "spec": { "mode": "c", "port": 1.5 } });
        let out = apply(&schema(), &mut obj);
        let text: Vec<String> = out
            .causes
            .iter()
            .map(|(f, m)| format!("{f}: {m}"))
            .collect();
        assert!(
            text.iter()
                .any(|t| t.starts_with("spec.mode: Unsupported value: \"c\"")),
            "{text:?}"
        );
        assert!(
            text.iter().any(|t| t == "spec.size: Required value"),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|t| t.starts_with("spec.port: Invalid value: \"number\"")),
            "{text:?}"
        );
        let mut small = json!({ "spec": { "size": 0 } });
        let out = apply(&schema(), &mut small);
        assert_eq!(out.causes.len(), 1, "{:?}", out.causes);
        assert!(out.causes[0].1.contains("greater than or equal to 1"));
    }
}
