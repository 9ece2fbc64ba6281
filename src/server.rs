//! Serving: the gRPC services on TCP (plain or TLS) and a unix socket, with a drain per
//! connection, a maximum connection age, HTTP/2 keepalive, health that follows the source's
//! readiness, reflection, and the admin HTTP server.
//!
//! tonic's own server is not used: with a grace period its max-connection-age sends no GOAWAY,
//! it cannot jitter the age, and it has no certificate reload. Each connection here is a hyper
//! HTTP/2 connection with its own drain token; at its (jittered) age, or at shutdown, it sends
//! GOAWAY, ends its streams with UNAVAILABLE (clients re-resolve and reconnect), and is closed
//! once the grace period ends.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body::{Body, Frame};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::grpc::BrokerService;
use crate::grpc::flagd::{FlagdCore, FlagdService, LegacyService};
use crate::health::Readiness;
use crate::on_wake::OnWake;
use crate::pb::flagd::flag_sync_service_server::FlagSyncServiceServer;
use crate::pb::legacy::flag_sync_service_server::FlagSyncServiceServer as LegacyServer;
use crate::registry::Registry;
use crate::source::Source;
use crate::telemetry::{GrpcCodeLabels, GrpcLabels, Metrics};
use crate::tls::Tls;

/// How the server behaves; the defaults are the command line's.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// How long a watch outlives its last subscriber.
    pub linger: Duration,
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
    /// How often the source's readiness is checked.
    pub readiness_interval: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            linger: crate::config::DEFAULT_LINGER,
            max_connection_age: None,
            max_connection_age_grace: Duration::from_secs(30),
            keepalive_interval: Some(Duration::from_secs(30)),
            keepalive_timeout: Duration::from_secs(20),
            max_concurrent_streams: 2000,
            shutdown_grace: Duration::from_secs(20),
            readiness_interval: Duration::from_secs(10),
        }
    }
}

/// Where to listen.
#[derive(Default)]
pub struct Listeners {
    /// gRPC over TCP.
    pub tcp: Option<TcpListener>,
    /// TLS for the TCP listener.
    pub tls: Option<Arc<Tls>>,
    /// gRPC over a unix domain socket (plain), and its path (removed at exit).
    pub unix: Option<(UnixListener, PathBuf)>,
    /// The admin HTTP server.
    pub admin: Option<TcpListener>,
}

impl Listeners {
    /// gRPC on one TCP listener, nothing else.
    pub fn tcp(listener: TcpListener) -> Self {
        Listeners {
            tcp: Some(listener),
            ..Listeners::default()
        }
    }
}

/// The drain token of the connection a request came on: cancelled when the connection reaches
/// its maximum age or the broker shuts down. Streams end with UNAVAILABLE when it fires.
#[derive(Debug, Clone)]
pub struct ConnDrain(pub CancellationToken);

/// A broker serving on its listeners.
pub struct Running<S> {
    /// The TCP address gRPC listens on (unspecified when there is no TCP listener).
    pub addr: SocketAddr,
    /// The admin server's address, if any.
    pub admin_addr: Option<SocketAddr>,
    /// Its registry, for introspection.
    pub registry: Registry<S>,
    /// Cancel to shut it down (see [`Running::stop`]).
    pub shutdown: CancellationToken,
    /// Readiness, as `/readyz` and gRPC health report it.
    pub readiness: Arc<Readiness>,
    connections: TaskTracker,
    grace: Duration,
    task: tokio::task::JoinHandle<()>,
}

impl<S: Source> Running<S> {
    /// Starts serving `source` on `listener` with default settings and the given linger.
    pub fn start(listener: TcpListener, source: S, linger: Duration) -> anyhow::Result<Self> {
        let config = ServerConfig {
            linger,
            ..ServerConfig::default()
        };
        Self::start_with(Listeners::tcp(listener), source, config)
    }

    /// Starts serving `source` on `listeners`.
    pub fn start_with(
        listeners: Listeners,
        source: S,
        config: ServerConfig,
    ) -> anyhow::Result<Self> {
        let Listeners {
            tcp,
            tls,
            unix,
            admin,
        } = listeners;
        anyhow::ensure!(
            tcp.is_some() || unix.is_some(),
            "nothing to serve gRPC on: give a TCP address, a unix socket, or both"
        );
        let addr = match &tcp {
            Some(l) => l.local_addr()?,
            None => SocketAddr::from(([0, 0, 0, 0], 0)),
        };
        let admin_addr = admin.as_ref().map(TcpListener::local_addr).transpose()?;
        let shutdown = CancellationToken::new();
        let metrics = Arc::new(Metrics::default());
        let registry =
            Registry::with_metrics(source, config.linger, shutdown.clone(), metrics.clone());
        let (reporter, health) = tonic_health::server::health_reporter();
        let readiness = Readiness::new(reporter, shutdown.clone());
        readiness.spawn_checks(registry.clone(), config.readiness_interval);
        if let Some(admin) = admin {
            crate::admin::spawn(admin, readiness.clone(), registry.clone(), metrics.clone());
        }
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::pb::DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()?;
        let reflection_alpha = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::pb::DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1alpha()?;
        let flagd = Arc::new(FlagdCore::new(registry.clone(), shutdown.clone()));
        let routes = tonic::service::Routes::new(health)
            .add_service(reflection)
            .add_service(reflection_alpha)
            .add_service(BrokerService::new(registry.clone(), shutdown.clone()).server())
            .add_service(FlagSyncServiceServer::new(FlagdService(flagd.clone())))
            .add_service(LegacyServer::new(LegacyService(flagd)))
            .prepare();
        let connections = TaskTracker::new();
        let ctx = Arc::new(ConnCtx {
            routes,
            metrics,
            shutdown: shutdown.clone(),
            config: config.clone(),
            connections: connections.clone(),
        });
        let mut accepting = Vec::new();
        if let Some(listener) = tcp {
            accepting.push(tokio::spawn(accept_tcp(listener, tls, ctx.clone())));
        }
        if let Some((listener, path)) = unix {
            accepting.push(tokio::spawn(accept_unix(listener, path, ctx.clone())));
        }
        let stopped = registry.clone();
        let task = tokio::spawn(async move {
            for a in accepting {
                let _ = a.await;
            }
            // Every connection has its own grace; the watch tasks stop with the token.
            let _ = tokio::time::timeout(Duration::from_secs(5), stopped.stopped()).await;
        });
        Ok(Running {
            addr,
            admin_addr,
            registry,
            shutdown,
            readiness,
            connections,
            grace: config.shutdown_grace,
            task,
        })
    }

    /// Drains: readiness and health go down, listeners close, every connection gets GOAWAY and
    /// its streams end with UNAVAILABLE; waits at most the shutdown grace for connections to
    /// finish, then closes the rest.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.finished().await
    }

    /// Waits for the drain that cancelling `shutdown` started.
    pub async fn finished(self) -> anyhow::Result<()> {
        self.shutdown.cancelled().await;
        self.task.await?;
        self.connections.close();
        // Each connection closes itself at the grace; this bounds the wait for stragglers.
        let _ = tokio::time::timeout(self.grace + Duration::from_secs(1), self.connections.wait())
            .await;
        Ok(())
    }
}

/// What every connection needs.
struct ConnCtx {
    routes: tonic::service::Routes,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    config: ServerConfig,
    connections: TaskTracker,
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Io for T {}

async fn accept_tcp(listener: TcpListener, tls: Option<Arc<Tls>>, ctx: Arc<ConnCtx>) {
    loop {
        let accepted = tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(error) => {
                tracing::warn!(%error, "accepting a connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let local = stream.local_addr().ok();
        let info = local.map(|local| tonic::transport::server::TcpConnectInfo {
            local_addr: Some(local),
            remote_addr: Some(peer),
        });
        let tls = tls.clone();
        let task_ctx = ctx.clone();
        ctx.connections.spawn(async move {
            let io: Box<dyn Io> = match tls {
                None => Box::new(stream),
                Some(tls) => {
                    let handshake = tokio::time::timeout(
                        Duration::from_secs(10),
                        tls.acceptor().accept(stream),
                    );
                    match handshake.await {
                        Ok(Ok(stream)) => Box::new(stream),
                        Ok(Err(error)) => {
                            tracing::debug!(%peer, %error, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    }
                }
            };
            serve_connection(io, info, task_ctx).await;
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
                let task_ctx = ctx.clone();
                ctx.connections
                    .spawn(serve_connection(Box::new(stream), None, task_ctx));
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

async fn serve_connection(
    io: Box<dyn Io>,
    info: Option<tonic::transport::server::TcpConnectInfo>,
    ctx: Arc<ConnCtx>,
) {
    let drain = ctx.shutdown.child_token();
    let service = ConnService {
        routes: ctx.routes.clone(),
        drain: drain.clone(),
        metrics: ctx.metrics.clone(),
        info,
    };
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(ctx.config.keepalive_interval)
        .keep_alive_timeout(ctx.config.keepalive_timeout)
        .max_concurrent_streams(ctx.config.max_concurrent_streams);
    let conn = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(service));
    tokio::pin!(conn);
    let age = ctx.config.max_connection_age.map(jittered);
    let (age_grace, shutdown_grace) = (
        ctx.config.max_connection_age_grace,
        ctx.config.shutdown_grace,
    );
    let draining = drain.clone();
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
                age_grace
            }
            _ = draining.cancelled() => shutdown_grace,
        }
    });
    let grace = tokio::select! {
        _ = conn.as_mut() => return,
        grace = &mut ending => grace,
    };
    // GOAWAY, then end this connection's streams so clients move on; close it at the grace.
    conn.as_mut().graceful_shutdown();
    drain.cancel();
    if tokio::time::timeout(grace, conn.as_mut()).await.is_err() {
        tracing::debug!("connection still open at the end of its grace: closing it");
    }
}

/// Per connection: gives requests the connection's drain and counts gRPC calls by code.
#[derive(Clone)]
struct ConnService {
    routes: tonic::service::Routes,
    drain: CancellationToken,
    metrics: Arc<Metrics>,
    info: Option<tonic::transport::server::TcpConnectInfo>,
}

/// The method label: known services by name, anything else as `other` (bounded cardinality).
fn method_label(path: &str) -> String {
    const KNOWN: &[&str] = &[
        "/crdbroker.v1.",
        "/flagd.sync.v1.",
        "/sync.v1.",
        "/grpc.health.v1.",
        "/grpc.reflection.",
    ];
    if KNOWN.iter().any(|k| path.starts_with(k)) && path.len() < 128 {
        path.to_string()
    } else {
        "other".to_string()
    }
}

impl tower::Service<http::Request<Incoming>> for ConnService {
    type Response = http::Response<CountedBody>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: http::Request<Incoming>) -> Self::Future {
        request
            .extensions_mut()
            .insert(ConnDrain(self.drain.clone()));
        if let Some(info) = &self.info {
            request.extensions_mut().insert(info.clone());
        }
        let method = method_label(request.uri().path());
        self.metrics
            .grpc_started
            .get_or_create(&GrpcLabels {
                method: method.clone(),
            })
            .inc();
        let metrics = self.metrics.clone();
        let future = tower::Service::call(&mut self.routes, request);
        Box::pin(async move {
            let response = future.await?;
            let (parts, body) = response.into_parts();
            let mut counted = CountedBody {
                inner: body,
                method,
                metrics,
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

/// A response body that counts the call's status code when it ends (a client that goes away
/// first counts as `Cancelled`).
pub struct CountedBody {
    inner: tonic::body::Body,
    method: String,
    metrics: Arc<Metrics>,
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
            .map(|c| format!("{:?}", tonic::Code::from_i32(c)))
            .unwrap_or_else(|| "Unknown".to_string());
        self.metrics
            .grpc_handled
            .get_or_create(&GrpcCodeLabels {
                method: self.method.clone(),
                code,
            })
            .inc();
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
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(trailers) = frame.trailers_ref()
            && let Some(code) = trailers.get("grpc-status")
        {
            let code = code.as_bytes().to_vec();
            self.record(&code);
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

    #[test]
    fn method_labels_are_bounded() {
        assert_eq!(
            method_label("/crdbroker.v1.Broker/Subscribe"),
            "/crdbroker.v1.Broker/Subscribe"
        );
        assert_eq!(method_label("/evil/random-path-123"), "other");
    }
}
