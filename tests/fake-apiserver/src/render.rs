//! How objects leave the server: at the requested version, and in the representation the client
//! asked for in `Accept` — the full object, `PartialObjectMetadata`, or a `meta.k8s.io/v1` Table
//! built from the CRD's printer columns (what `kubectl get` shows).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};

use crate::crd::Kind;
use crate::error::ApiError;

/// The representation a request asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum Format {
    /// The objects themselves.
    Object,
    /// `PartialObjectMetadata(List)`: type and object metadata only.
    Metadata,
    /// A `Table`, with rows carrying the object as `includeObject` says.
    Table(IncludeObject),
}

/// The `includeObject` query parameter of a Table request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum IncludeObject {
    /// No object in the rows.
    None,
    /// `PartialObjectMetadata` in each row (the default).
    Metadata,
    /// The full object in each row.
    Object,
}

impl Format {
    /// Picks the first representation in `Accept` that the server can produce; a 406 if none.
    pub fn negotiate(accept: Option<&str>, include: Option<&str>) -> Result<Format, ApiError> {
        let Some(accept) = accept.filter(|a| !a.trim().is_empty()) else {
            return Ok(Format::Object);
        };
        for alternative in accept.split(',') {
            let mut parts = alternative.split(';').map(str::trim);
            let media = parts.next().unwrap_or("");
            let params: Vec<(&str, &str)> = parts.filter_map(|p| p.split_once('=')).collect();
            let param = |k: &str| params.iter().find(|(pk, _)| *pk == k).map(|(_, v)| *v);
            if !matches!(media, "application/json" | "*/*" | "application/*") {
                continue;
            }
            match (param("as"), param("g"), param("v")) {
                (None, _, _) => return Ok(Format::Object),
                (Some("Table"), Some("meta.k8s.io"), Some("v1" | "v1beta1")) => {
                    let include = match include {
                        Some("None") => IncludeObject::None,
                        Some("Object") => IncludeObject::Object,
                        None | Some("" | "Metadata") => IncludeObject::Metadata,
                        Some(other) => {
                            return Err(ApiError::bad_request(format!(
                                "unrecognized includeObject value: \"{other}\""
                            )));
                        }
                    };
                    return Ok(Format::Table(include));
                }
                (
                    Some("PartialObjectMetadata" | "PartialObjectMetadataList"),
                    Some("meta.k8s.io"),
                    Some("v1" | "v1beta1"),
                ) => return Ok(Format::Metadata),
                _ => continue,
            }
        }
        Err(ApiError::status(
            406,
            "NotAcceptable",
            format!(
                "only the following media types are accepted: application/json, application/json;as=Table;v=v1;g=meta.k8s.io, application/json;as=PartialObjectMetadata;v=v1;g=meta.k8s.io (asked for {accept})"
            ),
        ))
    }
}

/// The object with `apiVersion` and `kind` for the requested version.
pub fn at_version(kind: &Kind, version: &str, obj: &Value) -> Value {
    let mut out = obj.clone();
    out["apiVersion"] = json!(kind.api_version(version));
    out["kind"] = json!(kind.kind);
    out
}

fn partial(obj: &Value) -> Value {
    json!({
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj["metadata"],
    })
}

/// A single object in the requested representation (a GET, or a write's response).
pub fn object(kind: &Kind, version: &str, obj: &Value, format: &Format) -> Value {
    match format {
        Format::Object => at_version(kind, version, obj),
        Format::Metadata => partial(obj),
        Format::Table(include) => table(
            kind,
            version,
            &[obj],
            *include,
            &obj["metadata"]["resourceVersion"],
            true,
        ),
    }
}

/// A watch event's object: like [`object`]; for Table watches a Table holding one row, with the
/// column definitions only in the first event of the watch, as the real server sends them.
pub fn watch_object(
    kind: &Kind,
    version: &str,
    obj: &Value,
    format: &Format,
    first: bool,
) -> Value {
    match format {
        Format::Table(include) => {
            let mut t = table(
                kind,
                version,
                &[obj],
                *include,
                &obj["metadata"]["resourceVersion"],
                first,
            );
            if !first {
                t["columnDefinitions"] = Value::Null;
            }
            t
        }
        other => object(kind, version, obj, other),
    }
}

/// A list response of `kind`'s objects at `version`.
pub fn list(
    kind: &Kind,
    version: &str,
    items: &[Arc<Value>],
    metadata: Value,
    format: &Format,
) -> Value {
    match format {
        Format::Object => json!({
            "apiVersion": kind.api_version(version),
            "kind": kind.list_kind,
            "metadata": metadata,
            "items": items.iter().map(|o| at_version(kind, version, o)).collect::<Vec<_>>(),
        }),
        Format::Metadata => json!({
            "apiVersion": "meta.k8s.io/v1",
            "kind": "PartialObjectMetadataList",
            "metadata": metadata,
            "items": items.iter().map(|o| partial(o)).collect::<Vec<_>>(),
        }),
        Format::Table(include) => {
            let objs: Vec<&Value> = items.iter().map(|o| o.as_ref()).collect();
            let mut t = table(
                kind,
                version,
                &objs,
                *include,
                &metadata["resourceVersion"],
                true,
            );
            t["metadata"] = metadata;
            t
        }
    }
}

const NAME_DESCRIPTION: &str = "Name must be unique within a namespace. Is required when creating resources, although some resources may allow a client to request the generation of an appropriate name automatically. Name is primarily intended for creation idempotence and configuration definition. Cannot be updated. More info: https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names";

/// The columns a CRD's objects print with: Name, then the printer columns, or Age by default.
fn columns(kind: &Kind, version: &str) -> Vec<Value> {
    let mut printer: Vec<Value> = kind
        .version(version)
        .map(|v| v.printer_columns.clone())
        .unwrap_or_default();
    if printer.is_empty() {
        printer.push(
            json!({ "name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp" }),
        );
    }
    printer
}

fn table(
    kind: &Kind,
    version: &str,
    objs: &[&Value],
    include: IncludeObject,
    rv: &Value,
    with_columns: bool,
) -> Value {
    let printer = columns(kind, version);
    let mut definitions = vec![json!({
        "name": "Name", "type": "string", "format": "name", "description": NAME_DESCRIPTION, "priority": 0,
    })];
    definitions.extend(printer.iter().map(|c| {
        json!({
            "name": c["name"], "type": c["type"],
            "format": c.get("format").cloned().unwrap_or(json!("")),
            "description": c.get("description").cloned().unwrap_or(json!("")),
            "priority": c.get("priority").cloned().unwrap_or(json!(0)),
        })
    }));
    let rows: Vec<Value> = objs
        .iter()
        .map(|obj| {
            let mut cells = vec![obj["metadata"]["name"].clone()];
            cells.extend(printer.iter().map(|c| cell(c, obj)));
            let mut row = json!({ "cells": cells });
            match include {
                IncludeObject::None => {}
                IncludeObject::Metadata => row["object"] = partial(obj),
                IncludeObject::Object => row["object"] = at_version(kind, version, obj),
            }
            row
        })
        .collect();
    let mut t = json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": { "resourceVersion": rv },
        "rows": rows,
    });
    if with_columns {
        t["columnDefinitions"] = json!(definitions);
    }
    t
}

/// One cell, as the CRD table convertor fills it: strings printed, dates as ages, numbers and
/// booleans as themselves, and null where the path finds nothing.
fn cell(column: &Value, obj: &Value) -> Value {
    let Some(value) = column["jsonPath"].as_str().and_then(|p| json_path(obj, p)) else {
        return Value::Null;
    };
    match column["type"].as_str() {
        Some("date") => match value
            .as_str()
            .and_then(|s| humantime::parse_rfc3339(s).ok())
        {
            Some(t) => json!(human_age(
                SystemTime::now().duration_since(t).unwrap_or_default()
            )),
            None => json!("<invalid>"),
        },
        Some("integer") if value.is_i64() || value.is_u64() => value.clone(),
        Some("number") if value.is_number() => value.clone(),
        Some("boolean") if value.is_boolean() => value.clone(),
        Some("integer" | "number" | "boolean") => Value::Null,
        _ => match value {
            Value::String(s) => json!(s),
            other => json!(other.to_string()),
        },
    }
}

/// Evaluates the simple JSONPaths printer columns use: `.a.b`, `.a[0].b`, `.a['x.y']`.
fn json_path<'a>(obj: &'a Value, path: &str) -> Option<&'a Value> {
    let path = path.trim().trim_start_matches('{').trim_end_matches('}');
    let mut current = obj;
    let mut rest = path.trim_start_matches('$');
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('.') {
            let end = r.find(['.', '[']).unwrap_or(r.len());
            current = current.get(&r[..end])?;
            rest = &r[end..];
        } else if let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']')?;
            let index = r[..end].trim_matches(|c| c == '\'' || c == '"');
            current = match index.parse::<usize>() {
                Ok(i) => current.get(i)?,
                Err(_) => current.get(index)?,
            };
            rest = &r[end + 1..];
        } else {
            return None;
        }
    }
    Some(current)
}

/// `k8s.io/apimachinery/pkg/util/duration.HumanDuration`: the ages `kubectl get` prints.
pub fn human_age(d: Duration) -> String {
    let s = d.as_secs();
    let (m, h, days) = (s / 60, s / 3600, s / 86400);
    let years = days / 365;
    match s {
        _ if s < 120 => format!("{s}s"),
        _ if m < 10 => match s % 60 {
            0 => format!("{m}m"),
            sec => format!("{m}m{sec}s"),
        },
        _ if h < 3 => format!("{m}m"),
        _ if h < 8 => match m % 60 {
            0 => format!("{h}h"),
            min => format!("{h}h{min}m"),
        },
        _ if h < 48 => format!("{h}h"),
        _ if h < 192 => match h % 24 {
            0 => format!("{days}d"),
            hr => format!("{days}d{hr}h"),
        },
        _ if years < 2 => format!("{days}d"),
        _ if years < 8 => match days % 365 {
            0 => format!("{years}y"),
            d => format!("{years}y{d}d"),
        },
        _ => format!("{years}y"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_like_kubectl() {
        let cases = [
            (5, "5s"),
            (119, "119s"),
            (125, "2m5s"),
            (600, "10m"),
            (3 * 3600 + 60, "3h1m"),
            (10 * 3600, "10h"),
            (3 * 86400 + 3600, "3d1h"),
            (30 * 86400, "30d"),
        ];
        for (secs, want) in cases {
            assert_eq!(human_age(Duration::from_secs(secs)), want, "{secs}s");
        }
    }

    #[test]
    fn json_paths_reach_nested_fields() {
        let obj = json!({ "spec": { "a": [ { "b": 7 } ], "c.d": "x" } });
        assert_eq!(json_path(&obj, ".spec.a[0].b"), Some(&json!(7)));
        assert_eq!(json_path(&obj, ".spec['c.d']"), Some(&json!("x")));
        assert_eq!(json_path(&obj, ".spec.missing"), None);
    }

    #[test]
    fn accept_picks_the_first_supported_representation() {
        let table = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json";
        assert_eq!(
            Format::negotiate(Some(table), None).unwrap(),
            Format::Table(IncludeObject::Metadata)
        );
        assert_eq!(
            Format::negotiate(
                Some("application/vnd.kubernetes.protobuf, application/json"),
                None
            )
            .unwrap(),
            Format::Object
        );
        assert_eq!(Format::negotiate(None, None).unwrap(), Format::Object);
        assert_eq!(
            Format::negotiate(
                Some("application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"),
                None
            )
            .unwrap(),
            Format::Metadata
        );
        assert_eq!(
            Format::negotiate(Some("application/vnd.kubernetes.protobuf"), None)
                .unwrap_err()
                .code(),
            406
        );
    }
}
