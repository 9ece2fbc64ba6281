//! A subscriber's response stream: the one shape every protocol's streams have, over a resource
//! or a set alike. It selects on the subscription's watch, on what ends the stream early and,
//! for a protocol whose client speaks during the stream (xDS), on what the client sends — with
//! no task and no channel per subscriber. Each protocol supplies only its [`View`], which turns
//! each state (and each input) into the messages its client is owed. It is written by hand because every
//! subscriber polls it for every update: it is the innermost loop of the fan-out.
//!
//! The first version was combinators — `unfold` for the states, `select` with a `once` for the
//! drain, another `unfold` to stop after an error, and a span entered on every poll. Profiling
//! the fan-out (docs/performance.md) put those layers at about 8 % of the broker's CPU, more
//! than tonic's own encoder. Here a poll is one `watch` receiver check, an atomic swap for the
//! drain ([`OnWake`]), and the caller's `next`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use futures::future::BoxFuture;
use futures::stream::Pending;
use futures::{FutureExt, Stream, StreamExt};
use tokio_util::sync::ReusableBoxFuture;
use tonic::Status;

use super::status::{drained, shutting_down};
use crate::access::Ticket;
use crate::conn::{ConnDrain, DrainReason};
use crate::registry::subscribers::record;
use crate::registry::{Delivered, PartRef, State, Subscription};
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
        End::saying(drain, ticket, drained)
    }

    /// [`End::new`], the drain's status told by `status`.
    pub(crate) fn saying(
        drain: ConnDrain,
        ticket: Option<Arc<Ticket>>,
        status: fn(DrainReason) -> Status,
    ) -> End {
        let revoked = ticket.as_ref().map(|t| t.revoked());
        let token = drain.token().clone();
        let future = async move {
            match revoked {
                Some(revoked) => tokio::select! {
                    _ = token.cancelled_owned() => status(drain.reason()),
                    status = revoked => status,
                },
                None => {
                    token.cancelled_owned().await;
                    status(drain.reason())
                }
            }
        }
        .boxed();
        End { future, ticket }
    }
}

/// A protocol's view of one subscriber: what it is owed for each state its subscription shows.
pub(crate) trait View<S>: Send + Unpin + 'static {
    /// What the stream sends.
    type Message;
    /// What else the stream listens to, beside the subscription: what its client sends
    /// ([`Messages::with_input`]); `Infallible` for the protocols whose client only reads.
    type Input;

    /// What `state` owes the client.
    fn next(&mut self, state: &S) -> Next<Self::Message>;

    /// What `input` owes the client.
    fn input(&mut self, input: Self::Input) -> Next<Self::Message> {
        let _ = input;
        Next::Wait
    }

    /// A further message the last state owes (a change to a set may be several), handed over
    /// before the next state is awaited.
    fn more(&mut self) -> Option<Self::Message> {
        None
    }
}

/// One resource's view, written as a function of its state.
impl<T, F> View<State> for F
where
    F: FnMut(&State) -> Next<T> + Send + Unpin + 'static,
{
    type Message = T;
    type Input = Infallible;

    fn next(&mut self, state: &State) -> Next<T> {
        self(state)
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
    /// End the stream: its client is done.
    End,
}

/// What changes of a set owe one client: their messages in order, and the set's version they
/// bring it to, recorded for `/debug/subscribers` once the last of them is handed over.
pub(crate) struct Owed<T> {
    queue: VecDeque<T>,
    version: Option<Arc<str>>,
    part: PartRef,
}

impl<T> Owed<T> {
    /// Nothing owed yet; what is handed over is recorded in `part`.
    pub(crate) fn new(part: PartRef) -> Self {
        Owed {
            queue: VecDeque::new(),
            version: None,
            part,
        }
    }

    /// Owes `message`, after those owed already.
    pub(crate) fn push(&mut self, message: T) {
        self.queue.push_back(message);
    }

    /// Once what is owed is handed over (at once, if nothing is), the client holds `version`.
    pub(crate) fn bring_to(&mut self, version: Arc<str>) {
        self.version = Some(version);
    }

    /// The next message owed, recording the version once the last is taken.
    pub(crate) fn pop(&mut self) -> Option<T> {
        let message = self.queue.pop_front();
        if self.queue.is_empty()
            && let Some(version) = self.version.take()
        {
            record(&self.part, Delivered::Set(version));
        }
        message
    }

    /// [`Owed::pop`], as what a view says of a state.
    pub(crate) fn next(&mut self) -> Next<T> {
        self.pop().map_or(Next::Wait, Next::Send)
    }
}

/// The messages a [`View`] makes of each state one subscription sees: the current state at
/// once, then each change (a slow reader skips to the newest). Ends after its first error; with
/// UNAVAILABLE — never OK, which some clients never notice — when its connection drains (its max
/// age, or the broker's shutdown) or the registry stops; with PERMISSION_DENIED when its access
/// is revoked.
pub(crate) struct Messages<S, V, I = Pending<Infallible>> {
    /// Resolves with the subscription once it has a state not yet seen; `false` when the
    /// registry has stopped.
    state: ReusableBoxFuture<'static, (bool, Subscription<S>)>,
    end: OnWake<BoxFuture<'static, Status>>,
    _ticket: Option<Arc<Ticket>>,
    view: V,
    input: I,
    done: bool,
    /// The subscription's span: it lives as long as the stream. Not entered on every poll (that
    /// cost a measurable share of the fan-out); `next` enters it where it logs.
    _span: tracing::Span,
}

async fn newer<S: Clone>(mut subscription: Subscription<S>, wait: bool) -> (bool, Subscription<S>) {
    let alive = !wait || subscription.changed().await;
    (alive, subscription)
}

impl<S, V> Messages<S, V>
where
    S: Clone + Send + Sync + 'static,
    V: View<S, Input = Infallible>,
{
    /// The stream of `subscription` as `view` sees it, ended early by `end`, in `span`.
    pub(crate) fn new(
        subscription: Subscription<S>,
        end: End,
        span: tracing::Span,
        view: V,
    ) -> Self {
        Messages::with_input(subscription, end, span, view, futures::stream::pending())
    }
}

impl<S, V, I> Messages<S, V, I>
where
    S: Clone + Send + Sync + 'static,
    V: View<S>,
    I: Stream<Item = V::Input> + Send + Unpin + 'static,
{
    /// [`Messages::new`], listening to `input` too: the stream ends when `input` does.
    pub(crate) fn with_input(
        subscription: Subscription<S>,
        end: End,
        span: tracing::Span,
        view: V,
        input: I,
    ) -> Self {
        Messages {
            state: ReusableBoxFuture::new(newer(subscription, false)),
            end: OnWake::new(end.future),
            _ticket: end.ticket,
            view,
            input,
            done: false,
            _span: span,
        }
    }

    /// The stream's item for what the view said; `None` to wait on.
    fn item(&mut self, next: Next<V::Message>) -> Option<Option<Result<V::Message, Status>>> {
        match next {
            Next::Wait => None,
            Next::Send(message) => Some(Some(Ok(message))),
            Next::Fail(status) => {
                self.done = true;
                Some(Some(Err(status)))
            }
            Next::End => {
                self.done = true;
                Some(None)
            }
        }
    }
}

impl<S, V, I> Stream for Messages<S, V, I>
where
    S: Clone + Send + Sync + 'static,
    V: View<S>,
    I: Stream<Item = V::Input> + Send + Unpin + 'static,
{
    type Item = Result<V::Message, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        // What the last state still owes goes first: its messages are one change.
        if let Some(message) = this.view.more() {
            return Poll::Ready(Some(Ok(message)));
        }
        if let Poll::Ready(status) = this.end.poll_unpin(cx) {
            this.done = true;
            return Poll::Ready(Some(Err(status)));
        }
        loop {
            if let Poll::Ready((alive, mut subscription)) = this.state.poll(cx) {
                if !alive {
                    this.done = true;
                    this.state.set(newer(subscription, true));
                    return Poll::Ready(Some(Err(shutting_down())));
                }
                let next = this.view.next(&subscription.current());
                this.state.set(newer(subscription, true));
                match this.item(next) {
                    Some(item) => return Poll::Ready(item),
                    None => continue,
                }
            }
            let next = match ready!(this.input.poll_next_unpin(cx)) {
                Some(input) => this.view.input(input),
                None => Next::End,
            };
            if let Some(item) = this.item(next) {
                return Poll::Ready(item);
            }
            // What the last state still owes, if the input added to it.
            if let Some(message) = this.view.more() {
                return Poll::Ready(Some(Ok(message)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt;

    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::registry::Registry;
    use crate::selector::Selector;
    use crate::source::scripted::Scripted;

    /// A registry whose source never answers (nothing is sent into it): every state stays
    /// pending.
    fn registry() -> Registry<Scripted> {
        Registry::new(
            Scripted::default(),
            Duration::from_secs(1),
            CancellationToken::new(),
        )
    }

    /// A stream with nothing to send, ended by `drain`.
    fn waiting(
        registry: &Registry<Scripted>,
        drain: &ConnDrain,
    ) -> Messages<State, impl FnMut(&State) -> Next<()> + Send + Unpin + 'static> {
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
