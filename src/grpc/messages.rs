//! One subscriber's response stream over one resource, written by hand because every subscriber
//! polls it for every update: it is the innermost loop of the fan-out.
//!
//! The first version was combinators — `unfold` for the states, `select` with a `once` for the
//! drain, another `unfold` to stop after an error, and a span entered on every poll. Profiling
//! the fan-out (docs/performance.md) put those layers at about 8 % of the broker's CPU, more
//! than tonic's own encoder. Here a poll is one `watch` receiver check, two atomic loads for
//! the drain, and the caller's `next`.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker, ready};

use futures::Stream;
use futures::task::AtomicWaker;
use tokio_util::sync::{CancellationToken, ReusableBoxFuture, WaitForCancellationFutureOwned};
use tonic::Status;

use super::shutting_down;
use crate::registry::{State, Subscription};

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
/// then each change (a slow reader skips to the newest). Ends after its first error, and with
/// UNAVAILABLE — never OK, which some clients never notice — when `drain` is cancelled (its
/// connection's max age, or the broker's shutdown) or the registry stops.
pub(crate) struct Messages<F> {
    /// Resolves with the subscription once it has a state not yet seen; `false` when the
    /// registry has stopped.
    state: ReusableBoxFuture<'static, (bool, Subscription)>,
    drain: Drain,
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
    /// The stream of `subscription`, ended by `drain`, in `span`.
    pub(crate) fn new(
        subscription: Subscription,
        drain: CancellationToken,
        span: tracing::Span,
        next: F,
    ) -> Self {
        Messages {
            state: ReusableBoxFuture::new(newer(subscription, false)),
            drain: Drain::new(drain),
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
        if this.drain.fired(cx.waker()) {
            this.done = true;
            return Poll::Ready(Some(Err(shutting_down())));
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

/// Whether a cancellation token has fired, checked with atomics.
///
/// `CancellationToken::is_cancelled` takes a mutex, and polling its future takes another; done
/// on every poll of every stream, they showed in the profile. Instead the token's future is
/// polled with a waker of our own, which raises a flag and wakes the stream's task: the token
/// is only looked at again after that wake.
struct Drain {
    cancelled: Pin<Box<WaitForCancellationFutureOwned>>,
    signal: Arc<Signal>,
    fired: bool,
}

#[derive(Default)]
struct Signal {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl Drain {
    fn new(token: CancellationToken) -> Self {
        let signal = Arc::new(Signal::default());
        // Polled first on the first `fired` call, which registers our waker with the token.
        signal.woken.store(true, Ordering::Relaxed);
        Drain {
            cancelled: Box::pin(token.cancelled_owned()),
            signal,
            fired: false,
        }
    }

    /// Whether the token has fired; if not, `task` is woken when it does.
    fn fired(&mut self, task: &Waker) -> bool {
        if self.fired {
            return true;
        }
        self.signal.task.register(task);
        if self.signal.woken.swap(false, Ordering::AcqRel) {
            let waker = Waker::from(self.signal.clone());
            let mut cx = Context::from_waker(&waker);
            self.fired = self.cancelled.as_mut().poll(&mut cx).is_ready();
        }
        self.fired
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt;
    use futures::stream::BoxStream;

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

    #[tokio::test]
    async fn a_cancelled_drain_ends_a_waiting_stream_with_unavailable() {
        let registry = registry();
        let selector = "widgets.example.com/default/a".parse().unwrap();
        let drain = CancellationToken::new();
        let mut stream = Messages::new(
            registry.subscribe(&selector),
            drain.clone(),
            tracing::Span::none(),
            |_: &State| Next::<()>::Wait,
        );
        let waiting = tokio::time::timeout(Duration::from_millis(50), stream.next()).await;
        assert!(waiting.is_err(), "nothing to send yet");
        drain.cancel();
        let ended = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .expect("the drain wakes the stream");
        let status = ended.expect("an item").expect_err("an error");
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(stream.next().await.is_none(), "nothing after the error");
    }

    #[tokio::test]
    async fn a_drain_cancelled_before_the_first_poll_ends_the_stream_at_once() {
        let registry = registry();
        let selector = "widgets.example.com/default/a".parse().unwrap();
        let drain = CancellationToken::new();
        drain.cancel();
        let mut stream = Messages::new(
            registry.subscribe(&selector),
            drain,
            tracing::Span::none(),
            |_: &State| Next::Send(()),
        );
        let status = stream.next().await.unwrap().expect_err("an error");
        assert_eq!(status.code(), tonic::Code::Unavailable);
    }

    #[tokio::test]
    async fn a_failure_ends_the_stream_after_it() {
        let registry = registry();
        let selector = "widgets.example.com/default/a".parse().unwrap();
        let mut stream = Messages::new(
            registry.subscribe(&selector),
            CancellationToken::new(),
            tracing::Span::none(),
            |_: &State| Next::<()>::Fail(Status::resource_exhausted("too big")),
        );
        let status = stream.next().await.unwrap().expect_err("an error");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(stream.next().await.is_none());
    }
}
