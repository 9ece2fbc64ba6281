//! [`OnWake`]: a future that is only polled after it has woken.
//!
//! A task that waits for a busy future and a rare one together — a connection and its drain, a
//! subscriber's stream and its shutdown — is woken by the busy one all the time, and `select`
//! then polls both. Polling a `CancellationToken`'s future takes two mutexes; doing it on every
//! message of every stream showed in the fan-out profile (docs/performance.md). `OnWake` polls
//! the rare future with a waker of its own that raises a flag and passes the wake on; until
//! that flag is up, polling it is an atomic swap.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures::task::AtomicWaker;

/// A future that polls `F` only when `F` has woken since it was last polled.
pub struct OnWake<F> {
    future: Pin<Box<F>>,
    signal: Arc<Signal>,
    /// The task waker last handed to `signal`.
    registered: Option<Waker>,
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

impl<F: Future> OnWake<F> {
    /// Wraps `future`; it is first polled on the first poll.
    pub fn new(future: F) -> Self {
        let signal = Arc::new(Signal::default());
        signal.woken.store(true, Ordering::Relaxed);
        OnWake {
            future: Box::pin(future),
            signal,
            registered: None,
        }
    }
}

impl<F: Future> Future for OnWake<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        let woken = this.signal.woken.swap(false, Ordering::AcqRel);
        // A wake takes the registered waker out, so register again after one, and whenever the
        // task's waker changes.
        if woken
            || !this
                .registered
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
        {
            this.signal.task.register(cx.waker());
            this.registered = Some(cx.waker().clone());
        }
        if !woken {
            return Poll::Pending;
        }
        let waker = Waker::from(this.signal.clone());
        this.future.as_mut().poll(&mut Context::from_waker(&waker))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;

    use super::*;

    /// A future that counts its polls and is ready once its token is cancelled.
    struct Counted {
        polls: Arc<AtomicUsize>,
        token: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
    }

    impl Future for Counted {
        type Output = ();

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, Ordering::SeqCst);
            self.token.as_mut().poll(cx)
        }
    }

    #[tokio::test]
    async fn polls_its_future_once_until_it_wakes_then_resolves() {
        let token = CancellationToken::new();
        let polls = Arc::new(AtomicUsize::new(0));
        let mut on_wake = OnWake::new(Counted {
            polls: polls.clone(),
            token: Box::pin(token.clone().cancelled_owned()),
        });
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        for _ in 0..100 {
            assert!(Pin::new(&mut on_wake).poll(&mut cx).is_pending());
        }
        assert_eq!(polls.load(Ordering::SeqCst), 1, "polled once, to register");
        token.cancel();
        assert!(Pin::new(&mut on_wake).poll(&mut cx).is_ready());
        assert_eq!(polls.load(Ordering::SeqCst), 2);
    }

    /// A waker that counts its wakes.
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_wake_goes_to_the_waker_of_the_latest_poll() {
        let token = CancellationToken::new();
        let mut on_wake = OnWake::new(token.clone().cancelled_owned());
        let (first, second) = (
            Arc::new(Count(AtomicUsize::new(0))),
            Arc::new(Count(AtomicUsize::new(0))),
        );
        let poll = |on_wake: &mut OnWake<_>, count: &Arc<Count>| {
            let waker = Waker::from(count.clone());
            Pin::new(on_wake).poll(&mut Context::from_waker(&waker))
        };
        assert!(poll(&mut on_wake, &first).is_pending());
        assert!(poll(&mut on_wake, &second).is_pending());
        token.cancel();
        assert_eq!(first.0.load(Ordering::SeqCst), 0);
        assert_eq!(second.0.load(Ordering::SeqCst), 1);
        assert!(poll(&mut on_wake, &second).is_ready());
    }

    #[tokio::test]
    async fn its_wake_reaches_the_task_that_waits_on_it() {
        let token = CancellationToken::new();
        let on_wake = OnWake::new(token.clone().cancelled_owned());
        let waiting = tokio::spawn(on_wake);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        token.cancel();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("woken")
            .unwrap();
    }
}
