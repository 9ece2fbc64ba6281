//! One subscriber's response stream over one resource, written by hand because every subscriber
//! polls it for every update: it is the innermost loop of the fan-out.
//!
//! The first version was combinators — `unfold` for the states, `select` with a `once` for the
//! drain, another `unfold` to stop after an error, and a span entered on every poll. Profiling
//! the fan-out (docs/performance.md) put those layers at about 8 % of the broker's CPU, more
//! than tonic's own encoder. Here a poll is one `watch` receiver check, an atomic swap for the
//! drain ([`OnWake`]), and the caller's `next`.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use futures::future::BoxFuture;
use futures::{FutureExt, Stream};
use tokio_util::sync::ReusableBoxFuture;
use tonic::Status;

use super::status::{drained, shutting_down};
use crate::access::Ticket;
use crate::conn::ConnDrain;
use crate::registry::{State, Subscription};
use crate::sync::OnWake;

/// What ends a stream before its client does: its connection's drain (UNAVAILABLE: the client
/// reconnects) or the revocation of its ticket (PERMISSION_DENIED). It holds the ticket, so the
/// stream counts against its caller's limits while it lives.
pub(crate) struct End {
    future: BoxFuture<'static, Status>,
    ticket: Option<Arc<Ticket>>,
}

impl End {
    /// Ended by `drain`, or by `ticket`'s revocation.
    pub(crate) fn new(drain: ConnDrain, ticket: Option<Arc<Ticket>>) -> End {
        let revoked = ticket.as_ref().map(|t| t.revoked());
        let token = drain.token().clone();
        let future = async move {
            match revoked {
                Some(revoked) => tokio::select! {
                    _ = token.cancelled_owned() => drained(drain.reason()),
                    status = revoked => status,
                },
                None => {
                    token.cancelled_owned().await;
                    drained(drain.reason())
                }
            }
        }
        .boxed();
        End { future, ticket }
    }
}

/// What a subscriber's stream does with a state its subscription sees.
pub(crate) enum Next<T> {
    /// Nothing to send (not answered yet, or already sent); wait for the next state.
    Wait,
    /// Send this message.
    Send(T),
    /// End the stream with this error.
    Fail(Status),
}

/// The messages `next` makes of each state one subscription sees: the current state at once,
/// then each change (a slow reader skips to the newest). Ends after its first error; with
/// UNAVAILABLE — never OK, which some clients never notice — when its connection drains (its max
/// age, or the broker's shutdown) or the registry stops; with PERMISSION_DENIED when its access
/// is revoked.
pub(crate) struct Messages<F> {
    /// Resolves with the subscription once it has a state not yet seen; `false` when the
    /// registry has stopped.
    state: ReusableBoxFuture<'static, (bool, Subscription)>,
    end: OnWake<BoxFuture<'static, Status>>,
    _ticket: Option<Arc<Ticket>>,
    next: F,
    done: bool,
    /// The subscription's span: it lives as long as the stream. Not entered on every poll (that
    /// cost a measurable share of the fan-out); `next` enters it where it logs.
    _span: tracing::Span,
}

async fn newer(mut subscription: Subscription, wait: bool) -> (bool, Subscription) {
    let alive = !wait || subscription.changed().await;
    (alive, subscription)
}

impl<T, F> Messages<F>
where
    F: FnMut(&State) -> Next<T> + Send + Unpin + 'static,
{
    /// The stream of `subscription`, ended early by `end`, in `span`.
    pub(crate) fn new(subscription: Subscription, end: End, span: tracing::Span, next: F) -> Self {
        Messages {
            state: ReusableBoxFuture::new(newer(subscription, false)),
            end: OnWake::new(end.future),
            _ticket: end.ticket,
            next,
            done: false,
            _span: span,
        }
    }
}

impl<T, F> Stream for Messages<F>
where
    F: FnMut(&State) -> Next<T> + Send + Unpin + 'static,
{
    type Item = Result<T, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if let Poll::Ready(status) = this.end.poll_unpin(cx) {
            this.done = true;
            return Poll::Ready(Some(Err(status)));
        }
        loop {
            let (alive, mut subscription) = ready!(this.state.poll(cx));
            if !alive {
                this.done = true;
                this.state.set(newer(subscription, true));
                return Poll::Ready(Some(Err(shutting_down())));
            }
            let next = (this.next)(&subscription.current());
            this.state.set(newer(subscription, true));
            match next {
                Next::Wait => continue,
                Next::Send(message) => return Poll::Ready(Some(Ok(message))),
                Next::Fail(status) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(status)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt;
    use futures::stream::BoxStream;

    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::registry::Registry;
    use crate::selector::Selector;
    use crate::source::{Observed, Source, SourceError};

    /// A source that never answers: every state stays pending.
    struct Silent;

    impl Source for Silent {
        async fn resolve(&self, selector: &Selector) -> Result<Selector, SourceError> {
            Ok(selector.clone())
        }

        async fn check(&self) -> Result<(), String> {
            Ok(())
        }

        fn watch(&self, _: &Selector) -> BoxStream<'static, Result<Observed, SourceError>> {
            futures::stream::pending().boxed()
        }
    }

    fn registry() -> Registry<Silent> {
        Registry::new(Silent, Duration::from_secs(1), CancellationToken::new())
    }

    /// A stream with nothing to send, ended by `drain`.
    fn waiting(
        registry: &Registry<Silent>,
        drain: &ConnDrain,
    ) -> Messages<impl FnMut(&State) -> Next<()> + Send + Unpin + 'static> {
        let selector: Selector = "widgets.example.com/default/a".parse().unwrap();
        Messages::new(
            registry.subscribe(&selector),
            End::new(drain.clone(), None),
            tracing::Span::none(),
            |_: &State| Next::<()>::Wait,
        )
    }

    #[tokio::test]
    async fn a_cancelled_drain_ends_a_waiting_stream_with_unavailable() {
        let registry = registry();
        let drain = ConnDrain::new(CancellationToken::new());
        let mut stream = waiting(&registry, &drain);
        let waiting = tokio::time::timeout(Duration::from_millis(50), stream.next()).await;
        assert!(waiting.is_err(), "nothing to send yet");
        drain.token().cancel();
        let ended = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .expect("the drain wakes the stream");
        let status = ended.expect("an item").expect_err("an error");
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains("shutting down"), "{status:?}");
        assert!(stream.next().await.is_none(), "nothing after the error");
    }

    #[tokio::test]
    async fn a_stream_drained_at_the_maximum_age_says_so() {
        let registry = registry();
        let drain = ConnDrain::new(CancellationToken::new());
        let mut stream = waiting(&registry, &drain);
        drain.age();
        let status = stream.next().await.unwrap().expect_err("an error");
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains("maximum age"), "{status:?}");
        assert!(!status.message().contains("shutting down"), "{status:?}");
    }

    #[tokio::test]
    async fn a_drain_cancelled_before_the_first_poll_ends_the_stream_at_once() {
        let registry = registry();
        let selector: Selector = "widgets.example.com/default/a".parse().unwrap();
        let drain = ConnDrain::new(CancellationToken::new());
        drain.token().cancel();
        let mut stream = Messages::new(
            registry.subscribe(&selector),
            End::new(drain, None),
            tracing::Span::none(),
            |_: &State| Next::Send(()),
        );
        let status = stream.next().await.unwrap().expect_err("an error");
        assert_eq!(status.code(), tonic::Code::Unavailable);
    }

    #[tokio::test]
    async fn a_failure_ends_the_stream_after_it() {
        let registry = registry();
        let selector: Selector = "widgets.example.com/default/a".parse().unwrap();
        let mut stream = Messages::new(
            registry.subscribe(&selector),
            End::new(ConnDrain::new(CancellationToken::new()), None),
            tracing::Span::none(),
            |_: &State| Next::<()>::Fail(Status::resource_exhausted("too big")),
        );
        let status = stream.next().await.unwrap().expect_err("an error");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(stream.next().await.is_none());
    }
}
