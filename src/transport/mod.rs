//! The HTTP/2 server the gRPC services run on: TCP (plain or TLS) and unix-socket listeners, a
//! drain per connection, a maximum connection age, HTTP/2 keepalive, a request size limit, and
//! the standard gRPC server metrics, and a gauge of open connections.
//!
//! tonic's own server is not used: with a grace period its max-connection-age sends no GOAWAY,
//! it cannot jitter the age, and it has no certificate reload. Each connection here is a hyper
//! HTTP/2 connection with its own drain token; at its (jittered) age, or at shutdown, it sends
//! GOAWAY, ends its streams with UNAVAILABLE (clients re-resolve and reconnect), and is closed
//! once the grace period ends.
//!
//! The transport knows no service and no caller: it is handed a [`MakeService`] that makes the
//! service for each connection from its [`Peer`], and gives every request that peer and the
//! connection's [`ConnDrain`] through the request's extensions.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use futures::future::BoxFuture;
use http_body::{Body, Frame};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::conn::{ConnDrain, Peer, PeerAddr};
use crate::telemetry::{ConnectionLabels, GrpcLabels, LimitLabels, Metrics, Transport};

pub mod tls;

use crate::sync::OnWake;
use tls::Tls;

/// How connections behave; the defaults are the command line's.
#[derive(Debug, Clone)]
pub struct Config {
    /// Connections get GOAWAY after this long (±10 %), so clients re-resolve; `None`: never.
    pub max_connection_age: Option<Duration>,
    /// How long an aged connection may finish before it is closed.
    pub max_connection_age_grace: Duration,
    /// How often the server pings idle connections; `None`: never.
    pub keepalive_interval: Option<Duration>,
    /// How long a ping may go unanswered before the connection is closed.
    pub keepalive_timeout: Duration,
    /// Streams one connection may have open at once.
    pub max_concurrent_streams: u32,
    /// How long a shutdown waits for connections to finish.
    pub shutdown_grace: Duration,
    /// The largest request message taken; a larger one is RESOURCE_EXHAUSTED.
    pub max_request_bytes: usize,
    /// How much a stream may hold queued beyond what its client's flow-control window takes,
    /// before the broker stops handing it messages (see [`DEFAULT_STREAM_SEND_BUFFER`]).
    pub stream_send_buffer: usize,
}

/// The default [`Config::stream_send_buffer`]. The broker hands a stream its next message only
/// when the stream has room, and skips to the newest state, so a client that stops reading
/// holds at most this, the message queued last, and an encode buffer as large as its largest
/// message. Measured (docs/reliability.md): 10.8 KiB per stalled stream under 4 KiB updates,
/// 536 KiB under 256 KiB updates. Hyper's own default, 400 KiB, measured the same (10.5 and
/// 545 KiB): the bound is set here so that it does not depend on it.
pub const DEFAULT_STREAM_SEND_BUFFER: usize = 16 * 1024;

/// The default `--max-request-bytes`: a Subscribe naming 100 resources with every field at its
/// longest is about 65 KiB.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 256 * 1024;

impl Default for Config {
    fn default() -> Self {
        Config {
            max_connection_age: None,
            max_connection_age_grace: Duration::from_secs(30),
            keepalive_interval: Some(Duration::from_secs(30)),
            keepalive_timeout: Duration::from_secs(20),
            max_concurrent_streams: 2000,
            shutdown_grace: Duration::from_secs(20),
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            stream_send_buffer: DEFAULT_STREAM_SEND_BUFFER,
        }
    }
}

/// The service one connection's requests go to.
pub type Service = tower::util::BoxCloneSyncService<
    http::Request<tonic::body::Body>,
    http::Response<tonic::body::Body>,
    Infallible,
>;

/// Makes the service for each new connection, from its peer.
pub type MakeService = Arc<dyn Fn(&Peer) -> Service + Send + Sync>;

/// Where gRPC is served.
#[derive(Default)]
pub struct Listeners {
    /// TCP.
    pub tcp: Option<TcpListener>,
    /// TLS for the TCP listener.
    pub tls: Option<Arc<Tls>>,
    /// A unix domain socket (plain), and its path (removed at exit).
    pub unix: Option<(UnixListener, PathBuf)>,
}

/// The transport, serving until `shutdown` is cancelled.
pub struct Serving {
    /// The TCP address (unspecified when there is no TCP listener).
    pub addr: SocketAddr,
    connections: TaskTracker,
    accepting: Vec<tokio::task::JoinHandle<()>>,
    grace: Duration,
}

/// Starts accepting on `listeners`; each connection's requests go to the service `make` makes
/// for it.
pub fn serve(
    listeners: Listeners,
    make: MakeService,
    config: Config,
    shutdown: CancellationToken,
    metrics: Arc<Metrics>,
) -> anyhow::Result<Serving> {
    let Listeners { tcp, tls, unix } = listeners;
    anyhow::ensure!(
        tcp.is_some() || unix.is_some(),
        "nothing to serve gRPC on: give a TCP address, a unix socket, or both"
    );
    let addr = match &tcp {
        Some(l) => l.local_addr()?,
        None => SocketAddr::from(([0, 0, 0, 0], 0)),
    };
    let connections = TaskTracker::new();
    let grace = config.shutdown_grace;
    let ctx = Arc::new(ConnCtx {
        make,
        metrics,
        shutdown,
        config,
        connections: connections.clone(),
        next_id: AtomicU64::new(1),
    });
    let mut accepting = Vec::new();
    if let Some(listener) = tcp {
        accepting.push(tokio::spawn(accept_tcp(listener, tls, ctx.clone())));
    }
    if let Some((listener, path)) = unix {
        accepting.push(tokio::spawn(accept_unix(listener, path, ctx)));
    }
    Ok(Serving {
        addr,
        connections,
        accepting,
        grace,
    })
}

impl Serving {
    /// Waits for the listeners to close (after shutdown), then at most the shutdown grace for
    /// connections to finish (each closes itself at its grace; this bounds the wait).
    pub async fn finished(self) {
        for a in self.accepting {
            let _ = a.await;
        }
        self.connections.close();
        let _ = tokio::time::timeout(self.grace + Duration::from_secs(1), self.connections.wait())
            .await;
    }
}

/// What every connection needs.
struct ConnCtx {
    make: MakeService,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    config: Config,
    connections: TaskTracker,
    next_id: AtomicU64,
}

impl ConnCtx {
    fn peer(
        &self,
        addr: PeerAddr,
        client_certs: Option<Arc<[rustls_pki_types::CertificateDer<'static>]>>,
    ) -> Peer {
        Peer {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            addr,
            client_certs,
        }
    }
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Io for T {}

async fn accept_tcp(listener: TcpListener, tls: Option<Arc<Tls>>, ctx: Arc<ConnCtx>) {
    loop {
        let accepted = tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, remote) = match accepted {
            Ok(a) => a,
            Err(error) => {
                tracing::warn!(%error, "accepting a connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        let addr = PeerAddr::Tcp { remote, local };
        let tls = tls.clone();
        let task_ctx = ctx.clone();
        ctx.connections.spawn(async move {
            let transport = if tls.is_some() {
                Transport::Tls
            } else {
                Transport::Tcp
            };
            let (io, certs): (Box<dyn Io>, _) = match tls {
                None => (Box::new(stream), None),
                Some(tls) => {
                    let handshake = tokio::time::timeout(
                        Duration::from_secs(10),
                        tls.acceptor().accept(stream),
                    );
                    match handshake.await {
                        Ok(Ok(stream)) => {
                            let certs = stream
                                .get_ref()
                                .1
                                .peer_certificates()
                                .map(|c| c.iter().map(|c| c.clone().into_owned()).collect());
                            (Box::new(stream), certs)
                        }
                        Ok(Err(error)) => {
                            tracing::debug!(%remote, %error, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%remote, "TLS handshake timed out");
                            return;
                        }
                    }
                }
            };
            let peer = task_ctx.peer(addr, certs);
            serve_connection(io, peer, task_ctx, transport).await;
        });
    }
}

async fn accept_unix(listener: UnixListener, path: PathBuf, ctx: Arc<ConnCtx>) {
    loop {
        let accepted = tokio::select! {
            _ = ctx.shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                let cred = stream.peer_cred().ok();
                let addr = PeerAddr::Unix {
                    uid: cred.map(|c| c.uid()),
                    pid: cred.and_then(|c| c.pid()),
                };
                let peer = ctx.peer(addr, None);
                let task_ctx = ctx.clone();
                ctx.connections.spawn(serve_connection(
                    Box::new(stream),
                    peer,
                    task_ctx,
                    Transport::Unix,
                ));
            }
            Err(error) => {
                tracing::warn!(%error, "accepting a unix connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let _ = std::fs::remove_file(&path);
}

/// `age` ±10 %.
fn jittered(age: Duration) -> Duration {
    use std::hash::{BuildHasher, RandomState};
    let r = RandomState::new().hash_one(std::time::SystemTime::now()) % 2001;
    let factor = 0.9 + (r as f64) / 10_000.0;
    age.mul_f64(factor)
}

/// Counts one open connection in the connections gauge while it lives.
struct Open(prometheus_client::metrics::gauge::Gauge);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

async fn serve_connection(io: Box<dyn Io>, peer: Peer, ctx: Arc<ConnCtx>, transport: Transport) {
    let gauge = ctx
        .metrics
        .grpc
        .connections
        .get_or_create(&ConnectionLabels { transport })
        .clone();
    gauge.inc();
    let _open = Open(gauge);
    let drain = ConnDrain::new(ctx.shutdown.child_token());
    let connect_info = match peer.addr {
        PeerAddr::Tcp { remote, local } => Some(tonic::transport::server::TcpConnectInfo {
            local_addr: Some(local),
            remote_addr: Some(remote),
        }),
        PeerAddr::Unix { .. } => None,
    };
    let service = ConnService {
        inner: (ctx.make)(&peer),
        peer,
        connect_info,
        drain: drain.clone(),
        metrics: ctx.metrics.clone(),
        max_request_bytes: ctx.config.max_request_bytes,
    };
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(ctx.config.keepalive_interval)
        .keep_alive_timeout(ctx.config.keepalive_timeout)
        .max_concurrent_streams(ctx.config.max_concurrent_streams)
        .max_send_buf_size(ctx.config.stream_send_buffer);
    let conn = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(service));
    tokio::pin!(conn);
    let age = ctx.config.max_connection_age.map(jittered);
    let (age_grace, shutdown_grace) = (
        ctx.config.max_connection_age_grace,
        ctx.config.shutdown_grace,
    );
    let draining = drain.token().clone();
    // The connection's task wakes for every frame it writes; the end is only looked at when it
    // has woken (OnWake), not on each of those.
    let mut ending = OnWake::new(async move {
        let aged = async {
            match age {
                Some(age) => tokio::time::sleep(age).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = aged => {
                tracing::debug!(?age, "connection reached its maximum age: GOAWAY");
                (age_grace, true)
            }
            _ = draining.cancelled() => (shutdown_grace, false),
        }
    });
    let (grace, aged) = tokio::select! {
        _ = conn.as_mut() => return,
        ending = &mut ending => ending,
    };
    // GOAWAY, then end this connection's streams so clients move on; close it at the grace.
    conn.as_mut().graceful_shutdown();
    if aged {
        drain.age();
    } else {
        drain.token().cancel();
    }
    if tokio::time::timeout(grace, conn.as_mut()).await.is_err() {
        tracing::debug!("connection still open at the end of its grace: closing it");
    }
}

/// Per connection: gives requests the connection's peer and drain, holds them to the request
/// size limit, and counts gRPC calls by method and code.
#[derive(Clone)]
struct ConnService {
    inner: Service,
    peer: Peer,
    connect_info: Option<tonic::transport::server::TcpConnectInfo>,
    drain: ConnDrain,
    metrics: Arc<Metrics>,
    max_request_bytes: usize,
}

impl tower::Service<http::Request<Incoming>> for ConnService {
    type Response = http::Response<CountedBody>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Incoming>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        parts.extensions.insert(self.drain.clone());
        parts.extensions.insert(self.peer.clone());
        if let Some(info) = &self.connect_info {
            parts.extensions.insert(info.clone());
        }
        let labels = self.metrics.grpc.labels(parts.uri.path());
        self.metrics.grpc.started.get_or_create(&labels).inc();
        let limited = LimitedBody {
            inner: body,
            limit: self.max_request_bytes,
            state: Prefix::default(),
            metrics: self.metrics.clone(),
            received: self
                .metrics
                .grpc
                .msg_received
                .get_or_create(&labels)
                .clone(),
        };
        let request = http::Request::from_parts(parts, tonic::body::Body::new(limited));
        let metrics = self.metrics.clone();
        let started = std::time::Instant::now();
        let future = tower::Service::call(&mut self.inner, request);
        Box::pin(async move {
            let response = future.await?;
            let (parts, body) = response.into_parts();
            let sent_messages = metrics.grpc.msg_sent.get_or_create(&labels).clone();
            let mut counted = CountedBody {
                inner: body,
                sent_messages,
                labels,
                metrics,
                started,
                sent: Prefix::default(),
                done: false,
            };
            // A trailers-only response (an error before any message) has its status in the headers.
            if let Some(code) = parts.headers.get("grpc-status") {
                counted.record(code.as_bytes());
            }
            Ok(http::Response::from_parts(parts, counted))
        })
    }
}

/// Where a request body is in its gRPC framing: each message is a 5-byte prefix (a compression
/// flag and a big-endian length) and then that many bytes.
#[derive(Debug, Clone, Copy)]
enum Prefix {
    /// Reading a prefix; holds the bytes read so far.
    Reading { got: [u8; 5], len: usize },
    /// Skipping a message's body; this many bytes remain.
    Skipping(usize),
    /// Over the limit: the error has been reported.
    Refused,
}

impl Default for Prefix {
    fn default() -> Self {
        Prefix::Reading {
            got: [0; 5],
            len: 0,
        }
    }
}

impl Prefix {
    /// Advances over `data`: how many messages began in it, or the length of the first message
    /// over `limit`.
    fn advance(&mut self, mut data: &[u8], limit: usize) -> Result<u64, usize> {
        let mut began = 0;
        while !data.is_empty() {
            match self {
                Prefix::Reading { got, len } => {
                    let take = (5 - *len).min(data.len());
                    got[*len..*len + take].copy_from_slice(&data[..take]);
                    *len += take;
                    data = &data[take..];
                    if *len == 5 {
                        let size = u32::from_be_bytes([got[1], got[2], got[3], got[4]]) as usize;
                        if size > limit {
                            *self = Prefix::Refused;
                            return Err(size);
                        }
                        began += 1;
                        *self = if size == 0 {
                            Prefix::default()
                        } else {
                            Prefix::Skipping(size)
                        };
                    }
                }
                Prefix::Skipping(left) => {
                    let take = (*left).min(data.len());
                    *left -= take;
                    data = &data[take..];
                    if *left == 0 {
                        *self = Prefix::default();
                    }
                }
                Prefix::Refused => return Ok(began),
            }
        }
        Ok(began)
    }
}

/// A request body held to the request size limit: a message whose prefix announces more than
/// the limit ends the body with RESOURCE_EXHAUSTED (as gRPC servers answer an oversized
/// message) before any of it is buffered.
struct LimitedBody {
    inner: Incoming,
    limit: usize,
    state: Prefix,
    metrics: Arc<Metrics>,
    /// The call's `grpc_server_msg_received_total`, looked up once per call.
    received: prometheus_client::metrics::counter::Counter,
}

impl Body for LimitedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if matches!(self.state, Prefix::Refused) {
            return Poll::Ready(None);
        }
        let polled = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        Poll::Ready(match polled {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    let limit = self.limit;
                    let advanced = self.state.advance(data.chunk(), limit);
                    if let Ok(began) = advanced
                        && began > 0
                    {
                        self.received.inc_by(began);
                    }
                    if let Err(size) = advanced {
                        self.metrics
                            .access
                            .limit_hits
                            .get_or_create(&LimitLabels {
                                limit: crate::telemetry::Limit::RequestSize,
                            })
                            .inc();
                        return Poll::Ready(Some(Err(tonic::Status::resource_exhausted(format!(
                            "the request message is {size} bytes; this broker takes at most {limit} (--max-request-bytes)"
                        )))));
                    }
                }
                Some(Ok(frame))
            }
            Some(Err(error)) => Some(Err(tonic::Status::from_error(Box::new(error)))),
            None => None,
        })
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.state, Prefix::Refused) || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that counts the call's messages as they go and its status code and
/// duration when it ends (a client that goes away first counts as `Canceled`).
pub struct CountedBody {
    inner: tonic::body::Body,
    labels: GrpcLabels,
    metrics: Arc<Metrics>,
    started: std::time::Instant,
    /// Where the response is in its gRPC framing, to count messages.
    sent: Prefix,
    /// The call's `grpc_server_msg_sent_total`, looked up once per call rather than per
    /// message.
    sent_messages: prometheus_client::metrics::counter::Counter,
    done: bool,
}

impl CountedBody {
    fn record(&mut self, code: &[u8]) {
        if self.done {
            return;
        }
        self.done = true;
        let code = std::str::from_utf8(code)
            .ok()
            .and_then(|c| c.parse::<i32>().ok())
            .unwrap_or(2);
        let grpc = &self.metrics.grpc;
        grpc.handled
            .get_or_create(&self.labels.with_code(code))
            .inc();
        grpc.handling_seconds
            .get_or_create(&self.labels)
            .observe(self.started.elapsed().as_secs_f64());
    }
}

impl Drop for CountedBody {
    fn drop(&mut self) {
        self.record(b"1");
    }
}

impl Body for CountedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                let began = self.sent.advance(data.chunk(), usize::MAX).unwrap_or(0);
                if began > 0 {
                    self.sent_messages.inc_by(began);
                }
            } else if let Some(code) = frame.trailers_ref().and_then(|t| t.get("grpc-status")) {
                let code = code.as_bytes().to_vec();
                self.record(&code);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_are_jittered_within_ten_percent() {
        let age = Duration::from_secs(100);
        let samples: Vec<Duration> = (0..200).map(|_| jittered(age)).collect();
        assert!(
            samples
                .iter()
                .all(|d| *d >= Duration::from_secs(90) && *d <= Duration::from_secs(110))
        );
        assert!(samples.iter().any(|d| *d != samples[0]), "not all the same");
    }

    fn message(len: usize) -> Vec<u8> {
        let mut m = vec![0];
        m.extend_from_slice(&(len as u32).to_be_bytes());
        m.extend(std::iter::repeat_n(7u8, len));
        m
    }

    #[test]
    fn the_size_limit_reads_prefixes_split_across_frames() {
        let mut data = message(10);
        data.extend(message(0));
        data.extend(message(3));
        data.extend(message(11));
        // Every way of cutting the body into two frames finds the one message over 10, after
        // counting the three before it.
        for cut in 0..data.len() {
            let mut state = Prefix::default();
            let first = state.advance(&data[..cut], 10);
            let second = state.advance(&data[cut..], 10);
            let (began, over) = match (first, second) {
                (Ok(a), Err(size)) => (a, size),
                (Err(size), _) => (0, size),
                other => panic!("cut at {cut}: {other:?}"),
            };
            assert_eq!(over, 11, "cut at {cut}");
            assert!(began <= 3, "cut at {cut}");
        }
        let mut state = Prefix::default();
        assert_eq!(state.advance(&message(10), 10), Ok(1));
        let mut two = message(10);
        two.extend(message(2));
        assert_eq!(state.advance(&two, 10), Ok(2));
        assert_eq!(state.advance(&[0, 0], 10), Ok(0), "half a prefix");
    }
}
