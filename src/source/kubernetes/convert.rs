//! What the API server's answers become in the source's terms: its errors a [`SourceError`],
//! its objects an [`Object`].

use kube::api::DynamicObject;

use crate::source::{Object, SourceError};

/// An API error about `what`, by what a subscriber should make of it. The API server's own
/// words are logged, not passed on: its 403 names the broker's identity and rights, which are
/// none of a client's business.
pub(super) fn api_error(error: kube::Error, what: &str) -> SourceError {
    match error {
        kube::Error::Api(s) if s.code == 403 => {
            tracing::warn!(%what, message = %s.message, "the API server refuses the broker");
            SourceError::Forbidden(format!(
                "the API server does not let the broker read {what} (forbidden)"
            ))
        }
        kube::Error::Api(s) if s.code == 404 => {
            SourceError::UnknownKind(format!("the API server has no {what} (404)"))
        }
        // Priority and Fairness answers in plain text, which kube cannot read as a Status.
        kube::Error::Api(s) if s.code == 429 => {
            tracing::debug!(%what, "the API server has no room for the broker's request (429)");
            SourceError::Unavailable(format!(
                "the API server has no room for the broker's request on {what} now (429 Too Many \
                 Requests); it asks again when the server says"
            ))
        }
        kube::Error::Api(s) => {
            tracing::warn!(%what, code = s.code, message = %s.message, "the API server failed");
            SourceError::Unavailable(format!(
                "the API server failed on {what} ({} {})",
                s.code, s.reason
            ))
        }
        other => SourceError::Unavailable(format!("the API server cannot be reached ({other})")),
    }
}

/// A Kubernetes object as the sources hand it on.
pub(super) fn to_object(obj: &DynamicObject) -> Object {
    Object {
        json: serde_json::to_vec(obj).unwrap_or_default().into(),
        uid: obj.metadata.uid.clone().unwrap_or_default(),
        resource_version: obj.metadata.resource_version.clone().unwrap_or_default(),
    }
}
