//! The statuses every service sends alike: a source's error, a malformed resource, and the end
//! of a stream the broker drops.

use tonic::Status;

use crate::conn::DrainReason;
use crate::selector::ParseError;
use crate::source::SourceError;

/// The status a source error becomes, for the resource at `index`.
pub fn source_status(index: usize, error: &SourceError) -> Status {
    let message = format!("resources[{index}]: {error}");
    match error {
        SourceError::UnknownKind(_) => Status::not_found(message),
        SourceError::NotAllowed(_) | SourceError::Forbidden(_) => {
            Status::permission_denied(message)
        }
        SourceError::Invalid(_) => Status::invalid_argument(message),
        SourceError::Unavailable(_) => Status::unavailable(message),
    }
}

pub(crate) fn parse_status(index: usize, error: &ParseError) -> Status {
    Status::invalid_argument(format!("resources[{index}]: {error}"))
}

/// `status`, about the resource at `index`.
pub(crate) fn indexed(index: usize, status: Status) -> Status {
    Status::new(
        status.code(),
        format!("resources[{index}]: {}", status.message()),
    )
}

/// The status a stream ends with when the broker drops it: clients reconnect on UNAVAILABLE.
pub fn shutting_down() -> Status {
    Status::unavailable("the broker is shutting down; reconnect")
}

/// The status a stream ends with when its connection is drained, naming why.
pub fn drained(reason: DrainReason) -> Status {
    match reason {
        DrainReason::MaxAge => Status::unavailable(
            "the connection reached its maximum age (--max-connection-age), so that clients spread over replicas; reconnect",
        ),
        DrainReason::Shutdown => shutting_down(),
    }
}
