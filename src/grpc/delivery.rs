//! Delivery: what every service's subscriber streams share — the drain that ends them, each
//! subscriber's metrics and `/debug/subscribers` record, the client's deadline, and the end of a
//! stream at its first error.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{self, BoxStream, Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Status};

use crate::conn::ConnDrain;
use crate::registry::{Delivered, PartRef, Update};
use crate::selector::Selector;
use crate::telemetry::{
    FirstMessageLabels, Metrics, Protocol, ResourceLabels, SubscriberLabels, Watch,
};

/// What ends a request's streams: its connection's drain (max age or shutdown), or the
/// broker's shutdown when served without one.
pub(crate) fn drain_of<T>(request: &Request<T>, shutdown: &CancellationToken) -> ConnDrain {
    request
        .extensions()
        .get::<ConnDrain>()
        .cloned()
        .unwrap_or_else(|| ConnDrain::new(shutdown.clone()))
}

/// One subscriber's view of one resource, for the metrics: counted in the subscriber gauge
/// while it lives; its first message timed from the subscribe; later ones counted towards the
/// update's fan-out time; the version it was last handed recorded for `/debug/subscribers`.
pub(crate) struct Delivery {
    metrics: Arc<Metrics>,
    labels: SubscriberLabels,
    started: Instant,
    cold: bool,
    first: bool,
    part: PartRef,
}

impl Delivery {
    pub(crate) fn new(
        metrics: Arc<Metrics>,
        selector: &Selector,
        protocol: Protocol,
        started: Instant,
        cold: bool,
        part: PartRef,
    ) -> Self {
        let labels = SubscriberLabels {
            resource: selector.kind.unversioned(),
            protocol,
        };
        metrics.subscriptions.open.get_or_create(&labels).inc();
        Delivery {
            metrics,
            labels,
            started,
            cold,
            first: true,
            part,
        }
    }

    /// Records that a message about `update` (none for an absent resource) was handed to the
    /// transport.
    pub(crate) fn sent(&mut self, update: Option<&Arc<Update>>) {
        let what = update.map_or(Delivered::Absent, |u| Delivered::Object(u.clone()));
        crate::registry::subscribers::record(&self.part, what);
        let update = update.map(|u| &**u);
        if std::mem::take(&mut self.first) {
            let labels = FirstMessageLabels {
                protocol: self.labels.protocol,
                watch: if self.cold { Watch::Cold } else { Watch::Warm },
            };
            self.metrics
                .subscriptions
                .first_message_seconds
                .get_or_create(&labels)
                .observe(self.started.elapsed().as_secs_f64());
        } else if let Some(fanout) = update.and_then(Update::delivered) {
            let labels = ResourceLabels {
                resource: self.labels.resource.clone(),
            };
            self.metrics
                .subscriptions
                .fanout_seconds
                .get_or_create(&labels)
                .observe(fanout.as_secs_f64());
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        self.metrics
            .subscriptions
            .open
            .get_or_create(&self.labels)
            .dec();
    }
}

/// The deadline a request's `grpc-timeout` gives, from now: 1 to 8 digits and a unit (`H`,
/// `M`, `S`, `m`, `u`, `n`), as the gRPC protocol spells it; none without the header.
pub(crate) fn deadline_of(
    metadata: &tonic::metadata::MetadataMap,
) -> Result<Option<Instant>, Status> {
    let Some(value) = metadata.get("grpc-timeout") else {
        return Ok(None);
    };
    let text = value.to_str().unwrap_or_default();
    let malformed = || {
        let shown: String = text.chars().take(32).collect();
        Status::invalid_argument(format!(
            "grpc-timeout {shown:?} is not a gRPC timeout: 1 to 8 digits and a unit of H, M, S, m, u or n"
        ))
    };
    let digits = text.get(..text.len().saturating_sub(1)).unwrap_or_default();
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed());
    }
    let amount: u64 = digits.parse().map_err(|_| malformed())?;
    let timeout = match &text[digits.len()..] {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return Err(malformed()),
    };
    Ok(Instant::now().checked_add(timeout))
}

/// `frames`, counted as `stream` until it ends, and ended with DEADLINE_EXCEEDED at `deadline`.
/// An error ends it for the drain's reason when its connection is draining, as an error
/// otherwise; a stream its client dropped is the client's doing ([`SyncStream`]).
pub(crate) fn counted<T: Send + 'static>(
    frames: BoxStream<'static, Result<T, Status>>,
    stream: crate::telemetry::SyncStream,
    drain: ConnDrain,
    deadline: Option<Instant>,
) -> impl Stream<Item = Result<T, Status>> + Send + 'static {
    use crate::telemetry::StreamEnd;
    let expiry = Box::pin(async move {
        match deadline {
            Some(at) => tokio::time::sleep_until(at.into()).await,
            None => std::future::pending().await,
        }
    });
    stream::unfold(
        (frames, stream, expiry, false),
        move |(mut frames, mut stream, mut expiry, ended)| {
            let drain = drain.clone();
            async move {
                if ended {
                    return None;
                }
                let item = tokio::select! {
                    item = frames.next() => item?,
                    () = &mut expiry => {
                        stream.ending(StreamEnd::DeadlineExceeded);
                        Err(Status::deadline_exceeded(
                            "the stream reached the deadline its client gave (grpc-timeout)",
                        ))
                    }
                };
                if item.is_err() {
                    stream.ending(if drain.token().is_cancelled() {
                        StreamEnd::Drain
                    } else {
                        StreamEnd::Error
                    });
                }
                let ended = item.is_err();
                Some((item, (frames, stream, expiry, ended)))
            }
        },
    )
}

/// Ends a stream after its first error (tonic stops there too; this makes it explicit).
pub(crate) fn until_error<T>(
    s: impl Stream<Item = Result<T, Status>> + Send + 'static,
) -> impl Stream<Item = Result<T, Status>> + Send + 'static {
    stream::unfold(
        (Box::pin(s), false),
        |(mut s, failed): (Pin<Box<_>>, bool)| async move {
            if failed {
                return None;
            }
            let item = s.next().await?;
            let failed = item.is_err();
            Some((item, (s, failed)))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deadline(value: &str) -> Result<Option<Duration>, Status> {
        let mut metadata = tonic::metadata::MetadataMap::new();
        metadata.insert("grpc-timeout", value.parse().unwrap());
        let before = Instant::now();
        deadline_of(&metadata).map(|at| at.map(|at| at - before))
    }

    #[test]
    fn grpc_timeouts_are_read_in_each_unit_and_refused_when_malformed() {
        let near = |value, want: Duration| {
            let got = deadline(value).unwrap().unwrap();
            assert!(
                got >= want && got - want < Duration::from_millis(100),
                "{value}: {got:?}"
            );
        };
        near("1H", Duration::from_secs(3600));
        near("2M", Duration::from_secs(120));
        near("600S", Duration::from_secs(600));
        near("99999999m", Duration::from_millis(99_999_999));
        near("500u", Duration::from_micros(500));
        near("7n", Duration::from_nanos(7));
        assert_eq!(
            deadline_of(&tonic::metadata::MetadataMap::new()).unwrap(),
            None
        );
        for bad in [
            "",
            "S",
            "10",
            "123456789S",
            "10s",
            "-1S",
            "1.5S",
            "10 S",
            "ten",
        ] {
            let status = deadline(bad).unwrap_err();
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{bad:?}");
            assert!(status.message().starts_with("grpc-timeout"), "{status:?}");
        }
        let long = deadline(&"9".repeat(4000)).unwrap_err();
        assert!(
            long.message().len() < 200,
            "bounded: {}",
            long.message().len()
        );
    }
}
