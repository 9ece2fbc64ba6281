//! The pace of the broker's requests to the API server, and a bound on each one's answer: a
//! tower layer under every kube client the broker builds.
//!
//! - A client-side rate limit, as client-go's QPS and burst (`serve --api-qps`, `--api-burst`);
//!   off unless set, as SIG API Machinery advises where the server has API Priority and
//!   Fairness (controller-runtime turned it off by default for that reason).
//! - The API server's own word: after a 429 (API Priority and Fairness rejecting the broker) or
//!   a 503 with `Retry-After`, no request goes before that many seconds have passed.
//! - Fewer requests at once after a 429: Priority and Fairness rejects what does not fit in the
//!   broker's seats, so requests waiting for an answer are limited to half as many as when it
//!   rejected, and one more for each answer that comes (back to no limit past
//!   [`OPEN_WINDOW`]). Without it every hold would end in a burst that the server rejects
//!   again, each time asking for a longer wait.
//! - Once a request goes, its answer must come within [`REQUEST_TIMEOUT`]: the headers, and
//!   for anything but a watch the whole body. Time spent held back does not count.
//!
//! Requests are held in `poll_ready`, under kube's buffer: they go in the order they were
//! made, and one given up while held costs nothing.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;
use tokio::time::{Instant, Sleep};

use crate::sync::lock;
use crate::telemetry::{ApiHeldLabels, ApiRequests};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The longest a request may wait for its answer once it has gone: a request the API server
/// accepted and never answers is abandoned and retried. A LIST of many pages takes as long as
/// its pages need.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest `Retry-After` honoured (API Priority and Fairness asks for 1 s, growing while it
/// keeps rejecting, up to a minute).
const LONGEST_RETRY_AFTER: Duration = Duration::from_secs(60);

/// Requests waiting for an answer, past which the window after a 429 is lifted.
const OPEN_WINDOW: usize = 64;

/// The broker's own limit on its requests to the API server: `qps` a second on average, up to
/// `burst` at once; `qps` 0 is no limit.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Rate {
    /// Requests a second, on average.
    pub qps: f64,
    /// Requests that may go at once.
    pub burst: u32,
}

/// Why requests are held back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    /// The broker's own rate limit.
    Rate,
    /// The API server's `Retry-After`.
    RetryAfter,
    /// The window of requests at once, after a 429.
    Concurrency,
}

impl Why {
    fn label(self) -> &'static str {
        match self {
            Why::Rate => "rate",
            Why::RetryAfter => "retry_after",
            Why::Concurrency => "concurrency",
        }
    }
}

/// Until when a request must wait: a moment, or an answer to come.
#[derive(Debug, PartialEq)]
enum Wait {
    Until(Instant, Why),
    Answer,
}

/// The layer.
#[derive(Clone)]
pub struct Throttle(Arc<Gate>);

/// What every request to one API server shares.
struct Gate {
    rate: Rate,
    state: Mutex<GateState>,
    /// Woken when an answer comes (a request waiting for the window may go).
    answered: Arc<Notify>,
    requests: ApiRequests,
}

#[derive(Debug)]
struct GateState {
    /// Tokens in the bucket (up to `burst`), as of `at`.
    tokens: f64,
    at: Instant,
    /// No request goes before this (the API server's `Retry-After`).
    held_until: Option<Instant>,
    /// Requests gone and not answered yet.
    waiting: usize,
    /// How many may be, after a 429; `None`: any number.
    window: Option<usize>,
}

impl GateState {
    fn new(rate: Rate) -> GateState {
        GateState {
            tokens: f64::from(rate.burst.max(1)),
            at: Instant::now(),
            held_until: None,
            waiting: 0,
            window: None,
        }
    }
}

impl Throttle {
    /// Requests paced by `rate`, and their waits counted in `requests`.
    pub fn new(rate: Rate, requests: ApiRequests) -> Throttle {
        Throttle(Arc::new(Gate::new(rate, requests)))
    }
}

impl Gate {
    fn new(rate: Rate, requests: ApiRequests) -> Gate {
        Gate {
            rate,
            state: Mutex::new(GateState::new(rate)),
            answered: Arc::new(Notify::new()),
            requests,
        }
    }

    /// Lets one request go now (it then waits for its answer until [`Gate::done`]), or says
    /// until when, and why, it must wait.
    fn take(&self, now: Instant) -> Result<(), Wait> {
        let mut state = lock(&self.state);
        if let Some(until) = state.held_until {
            if now < until {
                return Err(Wait::Until(until, Why::RetryAfter));
            }
            state.held_until = None;
        }
        if state.window.is_some_and(|window| state.waiting >= window) {
            return Err(Wait::Answer);
        }
        if self.rate.qps > 0.0 {
            let burst = f64::from(self.rate.burst.max(1));
            let refilled = now.saturating_duration_since(state.at).as_secs_f64() * self.rate.qps;
            state.tokens = (state.tokens + refilled).min(burst);
            state.at = now;
            if state.tokens < 1.0 {
                let missing = (1.0 - state.tokens) / self.rate.qps;
                return Err(Wait::Until(
                    now + Duration::from_secs_f64(missing),
                    Why::Rate,
                ));
            }
            state.tokens -= 1.0;
        }
        state.waiting += 1;
        Ok(())
    }

    /// A request that went has its answer (`None`: it failed, or was given up).
    fn done(&self, status: Option<StatusCode>) {
        let mut state = lock(&self.state);
        state.waiting = state.waiting.saturating_sub(1);
        match (status, state.window) {
            // Priority and Fairness had no seat for it: half as many at once.
            (Some(StatusCode::TOO_MANY_REQUESTS), window) => {
                let window = window.unwrap_or(state.waiting + 1).min(state.waiting + 1);
                state.window = Some((window / 2).max(1));
            }
            (Some(_), Some(window)) if window + 1 >= OPEN_WINDOW => state.window = None,
            (Some(_), Some(window)) => state.window = Some(window + 1),
            _ => {}
        }
        drop(state);
        self.answered.notify_waiters();
    }

    /// The API server answered `status` with `retry_after`: hold every request until then (a
    /// number of seconds, as the API server sends, or an HTTP date, as proxies and load
    /// balancers in front of it may).
    fn hold(&self, status: StatusCode, retry_after: Option<&http::HeaderValue>) {
        if status != StatusCode::TOO_MANY_REQUESTS && status != StatusCode::SERVICE_UNAVAILABLE {
            return;
        }
        let Some(wait) = retry_after
            .and_then(|v| v.to_str().ok())
            .and_then(retry_delay)
        else {
            return;
        };
        let wait = wait.min(LONGEST_RETRY_AFTER);
        let until = Instant::now() + wait;
        let mut state = lock(&self.state);
        if state.held_until.is_none_or(|held| held < until) {
            if state.held_until.is_none() {
                tracing::warn!(
                    status = status.as_u16(),
                    ?wait,
                    "the API server asks the broker to wait (Retry-After): holding its requests"
                );
            }
            state.held_until = Some(until);
        }
    }

    fn count_held(&self, why: Why, seconds: Duration) {
        self.requests
            .held
            .get_or_create(&ApiHeldLabels {
                reason: why.label(),
            })
            .inc_by(seconds.as_secs_f64());
    }
}

impl<S> tower::Layer<S> for Throttle {
    type Service = Throttled<S>;

    fn layer(&self, inner: S) -> Throttled<S> {
        Throttled {
            inner,
            gate: self.0.clone(),
            held: None,
            admitted: false,
        }
    }
}

/// A service whose requests are paced and bounded.
pub struct Throttled<S> {
    inner: S,
    gate: Arc<Gate>,
    /// While held: what for, why, and since when it is counted.
    held: Option<(Held, Why, Instant)>,
    /// Whether the next call may go.
    admitted: bool,
}

/// What a held request waits for.
enum Held {
    Moment(Pin<Box<Sleep>>),
    Answer(Pin<Box<OwnedNotified>>),
}

impl Held {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match self {
            Held::Moment(sleep) => sleep.as_mut().poll(cx),
            Held::Answer(answered) => answered.as_mut().poll(cx),
        }
    }
}

impl<S> Drop for Throttled<S> {
    fn drop(&mut self) {
        // Let through and never called: its place among the requests waiting is given back.
        if self.admitted {
            self.gate.done(None);
        }
    }
}

impl<S: Clone> Clone for Throttled<S> {
    fn clone(&self) -> Self {
        Throttled {
            inner: self.inner.clone(),
            gate: self.gate.clone(),
            held: None,
            admitted: false,
        }
    }
}

/// A request gone and not answered yet; given back to the gate when dropped.
struct Going {
    gate: Arc<Gate>,
    status: Option<StatusCode>,
}

impl Drop for Going {
    fn drop(&mut self) {
        self.gate.done(self.status);
    }
}

impl<S, B, R> tower::Service<Request<B>> for Throttled<S>
where
    S: tower::Service<Request<B>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    R: http_body::Body<Data = Bytes>,
{
    type Response = Response<Bounded<R>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        while !self.admitted {
            if let Some((held, _, _)) = &mut self.held {
                ready!(held.poll(cx));
            }
            let now = Instant::now();
            if let Some((_, why, since)) = self.held.take() {
                self.gate.count_held(why, now - since);
            }
            // Listening before looking, so that an answer in between is not missed.
            let mut answered = Box::pin(self.gate.answered.clone().notified_owned());
            answered.as_mut().enable();
            match self.gate.take(now) {
                Ok(()) => self.admitted = true,
                Err(Wait::Until(until, why)) => {
                    let sleep = Box::pin(tokio::time::sleep_until(until));
                    self.held = Some((Held::Moment(sleep), why, now));
                }
                Err(Wait::Answer) => {
                    self.held = Some((Held::Answer(answered), Why::Concurrency, now));
                }
            }
        }
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        self.admitted = false;
        let mut going = Going {
            gate: self.gate.clone(),
            status: None,
        };
        let watch = super::requests::verb(
            request.method(),
            request.uri().path(),
            request.uri().query().unwrap_or_default(),
        ) == "watch";
        let deadline = Instant::now() + REQUEST_TIMEOUT;
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = match tokio::time::timeout_at(deadline, answer).await {
                Ok(response) => response.map_err(Into::into)?,
                Err(_) => return Err(format!("no answer within {REQUEST_TIMEOUT:?}").into()),
            };
            going.status = Some(response.status());
            going.gate.hold(
                response.status(),
                response.headers().get(http::header::RETRY_AFTER),
            );
            drop(going);
            Ok(response.map(|body| Bounded {
                body,
                deadline: (!watch).then(|| Box::pin(tokio::time::sleep_until(deadline))),
            }))
        })
    }
}

/// A response body that must end by a deadline (none for a watch's).
pub struct Bounded<B> {
    body: B,
    deadline: Option<Pin<Box<Sleep>>>,
}

impl<B> http_body::Body for Bounded<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if let Some(deadline) = &mut self.deadline
            && deadline.as_mut().poll(cx).is_ready()
        {
            let late = format!("the answer did not end within {REQUEST_TIMEOUT:?}");
            return Poll::Ready(Some(Err(late.into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// How long a `Retry-After` value asks to wait: seconds, or until an HTTP date (RFC 9110); a
/// date already past asks for none.
fn retry_delay(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let until = httpdate::parse_http_date(value).ok()?;
    Some(
        until
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_seconds_or_an_http_date() {
        assert_eq!(retry_delay(" 5 "), Some(Duration::from_secs(5)));
        let later = std::time::SystemTime::now() + Duration::from_secs(20);
        let waited = retry_delay(&httpdate::fmt_http_date(later)).unwrap();
        assert!(
            waited > Duration::from_secs(18) && waited <= Duration::from_secs(20),
            "{waited:?}"
        );
        assert_eq!(
            retry_delay("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO),
            "a date past asks for no wait"
        );
        assert_eq!(retry_delay("soon"), None);
    }

    fn gate(qps: f64, burst: u32) -> Gate {
        Gate::new(Rate { qps, burst }, ApiRequests::default())
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_goes_at_once_and_the_rest_at_the_rate() {
        let gate = gate(10.0, 3);
        let now = Instant::now();
        for _ in 0..3 {
            assert_eq!(gate.take(now), Ok(()));
        }
        let wait = gate.take(now).unwrap_err();
        let until = now + Duration::from_millis(100);
        assert_eq!(wait, Wait::Until(until, Why::Rate));
        assert_eq!(gate.take(until), Ok(()));
        assert!(gate.take(until).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn no_rate_is_no_limit() {
        let gate = gate(0.0, 0);
        let now = Instant::now();
        for _ in 0..10_000 {
            assert_eq!(gate.take(now), Ok(()));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_holds_every_request_and_is_bounded() {
        let gate = gate(0.0, 0);
        let header = http::HeaderValue::from_static("3");
        gate.hold(StatusCode::TOO_MANY_REQUESTS, Some(&header));
        let now = Instant::now();
        let until = now + Duration::from_secs(3);
        assert_eq!(gate.take(now), Err(Wait::Until(until, Why::RetryAfter)));
        assert_eq!(gate.take(until), Ok(()));
        // A shorter one does not shorten a hold; one longer than a minute holds a minute.
        let huge = http::HeaderValue::from_static("86400");
        gate.hold(StatusCode::SERVICE_UNAVAILABLE, Some(&huge));
        gate.hold(StatusCode::TOO_MANY_REQUESTS, Some(&header));
        let now = Instant::now();
        let until = now + LONGEST_RETRY_AFTER;
        assert_eq!(gate.take(now), Err(Wait::Until(until, Why::RetryAfter)));
        // Other answers, and a Retry-After that is not seconds, hold nothing.
        let gate = super::tests::gate(0.0, 0);
        gate.hold(StatusCode::OK, Some(&header));
        let date = http::HeaderValue::from_static("Wed, 21 Oct 2026 07:28:00 GMT");
        gate.hold(StatusCode::TOO_MANY_REQUESTS, Some(&date));
        gate.hold(StatusCode::TOO_MANY_REQUESTS, None);
        assert_eq!(gate.take(Instant::now()), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_let_through_and_never_sent_gives_its_place_back() {
        use tower::{Layer, ServiceExt};
        let throttle = Throttle::new(Rate::default(), ApiRequests::default());
        // One at a time, as after a 429 with one request waiting.
        lock(&throttle.0.state).window = Some(1);
        let service = tower::service_fn(|_: Request<String>| async {
            Ok::<_, BoxError>(Response::new(String::new()))
        });
        let mut first = throttle.layer(service);
        first.ready().await.unwrap();
        drop(first);
        let mut second = throttle.layer(service);
        let ready = tokio::time::timeout(Duration::from_secs(1), second.ready()).await;
        assert!(ready.is_ok(), "the place of the one dropped is free");
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_429_half_as_many_go_at_once_and_one_more_for_each_answer() {
        let gate = gate(0.0, 0);
        let now = Instant::now();
        for _ in 0..10 {
            gate.take(now).unwrap();
        }
        // Ten waiting; one is rejected: five may wait at once, and nine still do.
        gate.done(Some(StatusCode::TOO_MANY_REQUESTS));
        assert_eq!(gate.take(now), Err(Wait::Answer));
        for _ in 0..4 {
            gate.done(Some(StatusCode::OK));
        }
        // Five wait, in a window that grew to nine: four more may go.
        for _ in 0..4 {
            gate.take(now).unwrap();
        }
        assert_eq!(gate.take(now), Err(Wait::Answer));
        // A failure without an answer frees its place and says nothing of the server.
        gate.done(None);
        gate.take(now).unwrap();
        assert_eq!(lock(&gate.state).window, Some(9));
        // Answers bring the window back to no limit.
        for _ in 0..OPEN_WINDOW {
            gate.done(Some(StatusCode::OK));
            gate.take(now).unwrap();
        }
        assert_eq!(lock(&gate.state).window, None);
    }
}
