//! API errors, rendered the way kube-apiserver renders them: a `meta/v1` `Status` object with
//! the HTTP code, or — for paths no API group serves — the plain-text `404 page not found`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// What a failed request answers with.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// A `Status` object with this code, reason and message.
    Status {
        /// The HTTP status code, also written into the body's `code`.
        code: u16,
        /// The machine-readable reason (`NotFound`, `Conflict`, `Expired`, …).
        reason: &'static str,
        /// The human-readable message.
        message: String,
        /// The `details` object, if any.
        details: Option<Value>,
        /// A `Retry-After` header (seconds), as the real server sends with 429 and 503.
        retry_after: Option<u64>,
    },
    /// The plain-text 404 the real server's mux answers for a path no group serves.
    PathNotFound,
}

/// Shorthand for results whose error is an [`ApiError`].
pub type Result<T, E = ApiError> = std::result::Result<T, E>;

/// Names a resource the way Status messages and details do: `plural.group` and the plural alone.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// The API group (empty for the core group).
    pub group: &'a str,
    /// The resource plural.
    pub plural: &'a str,
}

impl Target<'_> {
    /// `featureflags.core.openfeature.dev`, or just the plural for the core group.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    fn details(&self, name: Option<&str>) -> Value {
        let mut d = json!({ "group": self.group, "kind": self.plural });
        if let Some(name) = name {
            d["name"] = json!(name);
        }
        d
    }
}

impl ApiError {
    /// A Status error with no details.
    pub fn status(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError::Status {
            code,
            reason,
            message: message.into(),
            details: None,
            retry_after: None,
        }
    }

    fn with_details(mut self, value: Value) -> Self {
        if let ApiError::Status { details, .. } = &mut self {
            *details = Some(value);
        }
        self
    }

    /// 400 BadRequest.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::status(400, "BadRequest", message)
    }

    /// 404 NotFound for a named object.
    pub fn not_found(target: Target<'_>, name: &str) -> Self {
        Self::status(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", target.qualified()),
        )
        .with_details(target.details(Some(name)))
    }

    /// 409 AlreadyExists for a create of a name that is taken.
    pub fn already_exists(target: Target<'_>, name: &str) -> Self {
        Self::status(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", target.qualified()),
        )
        .with_details(target.details(Some(name)))
    }

    /// 409 Conflict for a write whose precondition (resourceVersion or uid) no longer holds.
    pub fn conflict(target: Target<'_>, name: &str, why: &str) -> Self {
        Self::status(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                target.qualified()
            ),
        )
        .with_details(target.details(Some(name)))
    }

    /// 422 Invalid for an object that fails validation; `causes` are `(field, message)` pairs.
    pub fn invalid(kind_group: &str, name: &str, causes: &[(String, String)]) -> Self {
        let text: Vec<String> = causes.iter().map(|(f, m)| format!("{f}: {m}")).collect();
        let message = match text.len() {
            1 => format!("{kind_group} \"{name}\" is invalid: {}", text[0]),
            _ => format!("{kind_group} \"{name}\" is invalid: [{}]", text.join(", ")),
        };
        let (kind, group) = kind_group.split_once('.').unwrap_or((kind_group, ""));
        let causes: Vec<Value> = causes
            .iter()
            .map(|(field, message)| {
                json!({ "reason": cause_reason(message), "message": message, "field": field })
            })
            .collect();
        Self::status(422, "Invalid", message)
            .with_details(json!({ "name": name, "group": group, "kind": kind, "causes": causes }))
    }

    /// 403 Forbidden, worded as the RBAC authorizer words it.
    pub fn forbidden(
        target: Target<'_>,
        user: &str,
        verb: &str,
        namespace: Option<&str>,
        name: Option<&str>,
    ) -> Self {
        let subject = match name {
            Some(name) => format!("{} \"{name}\"", target.qualified()),
            None => target.qualified(),
        };
        let scope = match namespace {
            Some(ns) => format!(" in the namespace \"{ns}\""),
            None => " at the cluster scope".to_string(),
        };
        Self::status(
            403,
            "Forbidden",
            format!(
                "{subject} is forbidden: User \"{user}\" cannot {verb} resource \"{}\" in API group \"{}\"{scope}",
                target.plural, target.group
            ),
        )
        .with_details(target.details(name))
    }

    /// 410 Expired, as sent for a list or continue token below the history floor.
    pub fn expired(message: impl Into<String>) -> Self {
        Self::status(410, "Expired", message)
    }

    /// 415 UnsupportedMediaType for a patch type the resource does not take.
    pub fn unsupported_media_type() -> Self {
        Self::status(
            415,
            "UnsupportedMediaType",
            "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
        )
    }

    /// The HTTP status code this error answers with.
    pub fn code(&self) -> u16 {
        match self {
            ApiError::Status { code, .. } => *code,
            ApiError::PathNotFound => 404,
        }
    }

    /// The `Status` object, as JSON.
    pub fn to_status(&self) -> Value {
        match self {
            ApiError::Status {
                code,
                reason,
                message,
                details,
                retry_after,
            } => {
                let mut status = json!({
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "message": message,
                    "reason": reason,
                    "code": code,
                });
                let mut details = details.clone();
                if let Some(secs) = retry_after {
                    details.get_or_insert_with(|| json!({}))["retryAfterSeconds"] = json!(secs);
                }
                if let Some(details) = details {
                    status["details"] = details;
                }
                status
            }
            ApiError::PathNotFound => json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "the server could not find the requested resource",
                "reason": "NotFound", "code": 404,
            }),
        }
    }
}

/// The `causes[].reason` the real validators attach, read off the message's opening words.
fn cause_reason(message: &str) -> &'static str {
    if message.starts_with("Required value") {
        "FieldValueRequired"
    } else if message.starts_with("Unsupported value") {
        "FieldValueNotSupported"
    } else if message.starts_with("Forbidden") {
        "FieldValueForbidden"
    } else {
        "FieldValueInvalid"
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiError::Status { code, message, .. } => write!(f, "{code}: {message}"),
            ApiError::PathNotFound => f.write_str("404 page not found"),
        }
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self == ApiError::PathNotFound {
            return (
                StatusCode::NOT_FOUND,
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                "404 page not found\n",
            )
                .into_response();
        }
        let code = StatusCode::from_u16(self.code()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (
            code,
            [(header::CONTENT_TYPE, "application/json")],
            self.to_status().to_string(),
        )
            .into_response();
        if let ApiError::Status {
            retry_after: Some(secs),
            ..
        } = self
        {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
