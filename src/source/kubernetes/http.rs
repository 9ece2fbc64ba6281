//! The broker's own HTTP stack to the API server (ADR 0014).
//!
//! kube-client speaks HTTP/1.1 only, so each of its watches holds a TCP (and TLS) connection of
//! its own. This stack keeps kube's TLS configuration, authentication, base-URI and
//! extra-header layers and puts a small pool of connections under them. A connection whose
//! TLS handshake agrees on `h2` (ALPN) carries as many requests at once as its peer's
//! `SETTINGS_MAX_CONCURRENT_STREAMS` allows (100 on the kube-apiserver); a request that finds
//! every connection full opens the next one, since hyper never does that by itself. A server
//! that offers no `h2`, one in the clear, and `--api-http2 off` are spoken to over HTTP/1.1, one
//! connection per request in flight, with a bounded number kept idle for a short while (kube's
//! own client keeps every one it opened). Dead HTTP/2 connections are found by keepalive pings;
//! nothing pings an HTTP/1.1 connection, so [`Pinged`] tells the watches on it to find a dead
//! one themselves. Only a kubeconfig's `proxy-url` goes through kube's own stack.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use kube::client::{Body, ConfigExt};
use rustls_pki_types::ServerName;
use tower::ServiceBuilder;

use super::throttle::{Rate, Throttle};
use crate::sync::lock;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How often an idle HTTP/2 connection to the API server is pinged, and how long an answer may
/// take before the connection (and every watch on it) is given up.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(15);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long an HTTP/2 connection that carries nothing stays open (the first one stays).
const IDLE_CLOSE: Duration = Duration::from_secs(60);

/// HTTP/1.1 connections kept open while they carry nothing, and how long each is kept. A watch
/// holds its connection; an idle one serves the next LIST or watch. Without a bound, hyper keeps
/// every connection a burst of requests opened (a relist after a fault, say) for as long as
/// the server does: each one a task, found left over after fault soaks.
const HTTP1_IDLE_MAX: usize = 16;
const HTTP1_IDLE_CLOSE: Duration = Duration::from_secs(15);

/// How long a TCP connect and TLS handshake may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// TCP keepalive on HTTP/1.1 connections: a peer host that is gone is found within about a
/// minute (a proxy that stops forwarding answers them, so watches bound their silence too).
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);
const TCP_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const TCP_KEEPALIVE_RETRIES: u32 = 3;

/// Whether the broker's connections to the API server are pinged (HTTP/2), so that a dead one is
/// found within [`KEEPALIVE_INTERVAL`] + [`KEEPALIVE_TIMEOUT`]. Over HTTP/1.1 they are not, and
/// a watch must find its dead connection by its silence. It can change once: a server that
/// offers no HTTP/2 turns it off.
#[derive(Clone, Debug, Default)]
pub struct Pinged(Arc<AtomicBool>);

impl Pinged {
    /// Whether requests made now go over pinged connections.
    pub fn now(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Whether the broker speaks HTTP/2 to the API server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ApiHttp2 {
    /// HTTP/2 when the API server offers it over TLS (ALPN), else HTTP/1.1.
    #[default]
    Auto,
    /// HTTP/1.1: one connection per concurrent request.
    Off,
}

/// A kube client for `config`: over this module's pool for an `https` API server with
/// `Auto`, else over HTTP/1.1 (there is no cleartext HTTP/2 to the API server); through a
/// `proxy-url`, kube's own stack, the one that speaks to proxies.
/// Its requests are paced by `rate` and the API server's `Retry-After`, and bounded
/// ([`super::throttle`]); counted in `requests`; whether its connections are pinged is in the
/// [`Pinged`] returned with it.
pub fn client(
    mut config: kube::Config,
    mode: ApiHttp2,
    rate: Rate,
    requests: crate::telemetry::ApiRequests,
) -> kube::Result<(kube::Client, Pinged)> {
    let throttle = Throttle::new(rate, requests.clone());
    let count = super::requests::Count(requests);
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    // kube's own retries would hide 429s from the throttle, and outlast the request's bound.
    config.default_retry = false;
    if config.proxy_url.is_some() {
        // kube's own stack is the one that speaks to proxies (HTTP CONNECT, SOCKS5).
        tracing::info!(
            "the kubeconfig names a proxy-url: speaking HTTP/1.1 to the API server through it"
        );
        let client = kube::client::ClientBuilder::try_from(config)?
            .with_layer(&count)
            .with_layer(&throttle)
            .build();
        return Ok((client, Pinged::default()));
    }
    let layers = ServiceBuilder::new()
        .layer(throttle.clone())
        .layer(count.clone())
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?);
    if mode == ApiHttp2::Off || config.cluster_url.scheme_str() != Some("https") {
        let service = layers
            .map_err(|e: hyper_util::client::legacy::Error| BoxError::from(e))
            .service(http1(&config)?);
        return Ok((
            kube::Client::new(service, config.default_namespace),
            Pinged::default(),
        ));
    }
    let pool = Pool::new(&config)?;
    let pinged = pool.0.pinged.clone();
    let service = layers.service(pool);
    Ok((kube::Client::new(service, config.default_namespace), pinged))
}

/// An HTTP/1.1 client for `config`'s server (TLS as kube configures it, or none for `http`):
/// one connection per request in flight, at most [`HTTP1_IDLE_MAX`] kept idle, each for at most
/// [`HTTP1_IDLE_CLOSE`].
fn http1(config: &kube::Config) -> kube::Result<Http1> {
    Ok(
        hyper_util::client::legacy::Builder::new(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(HTTP1_IDLE_CLOSE)
            .pool_max_idle_per_host(HTTP1_IDLE_MAX)
            .build(config.rustls_https_connector_with_connector(http1_connector())?),
    )
}

/// Connections to one API server.
#[derive(Clone)]
pub struct Pool(Arc<Shared>);

type Http1 = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Body,
>;

struct Shared {
    host: String,
    port: u16,
    server_name: ServerName<'static>,
    tls: tokio_rustls::TlsConnector,
    lanes: Mutex<Vec<Lane>>,
    /// Held while a connection is being opened, so that a burst of requests opens one.
    opening: tokio::sync::Mutex<()>,
    /// The HTTP/1.1 client, for a server that offers no HTTP/2.
    http1: Http1,
    /// Turned off once a server answered the TLS handshake without `h2`.
    pinged: Pinged,
}

/// One HTTP/2 connection and the requests open on it.
struct Lane {
    sender: http2::SendRequest<Body>,
    open: Arc<Use>,
    /// The peer's `SETTINGS_MAX_CONCURRENT_STREAMS`, as last seen.
    streams: Arc<AtomicUsize>,
    /// Whether the peer's SETTINGS are in (a server sends them before any response), so that
    /// `streams` is its limit. Until then the connection carries its first request alone.
    settled: tokio::sync::watch::Receiver<bool>,
}

impl Lane {
    fn has_room(&self) -> bool {
        let limit = match *self.settled.borrow() {
            true => self.streams.load(Ordering::Relaxed),
            false => INITIAL_STREAMS,
        };
        self.open.requests.load(Ordering::Relaxed) < limit
    }

    /// Whether it has carried nothing for [`IDLE_CLOSE`].
    fn idle(&self) -> bool {
        self.open.requests.load(Ordering::Relaxed) == 0
            && lock(&self.open.last).elapsed() > IDLE_CLOSE
    }
}

/// How a connection is used: requests open on it, and when one last ended.
struct Use {
    requests: AtomicUsize,
    last: Mutex<std::time::Instant>,
}

impl Use {
    fn new() -> Arc<Use> {
        Arc::new(Use {
            requests: AtomicUsize::new(0),
            last: Mutex::new(std::time::Instant::now()),
        })
    }
}

/// Drives an HTTP/2 connection, and publishes its peer's stream limit at every turn. The
/// connection starts with room for one stream ([`INITIAL_STREAMS`]) until the server's SETTINGS
/// raise it; it is settled once they have (or after [`CONNECT_TIMEOUT`], whatever they say).
struct Driven<T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static> {
    connection: http2::Connection<T, Body, TokioExecutor>,
    streams: Arc<AtomicUsize>,
    settle: Arc<tokio::sync::watch::Sender<bool>>,
    /// hyper reads the server's frames in a task of its own, which does not wake this one:
    /// until settled, this one looks again at every tick.
    tick: Pin<Box<tokio::time::Sleep>>,
    settle_by: tokio::time::Instant,
}

/// Streams a new connection may carry before the server's SETTINGS say how many.
const INITIAL_STREAMS: usize = 1;

/// How often an unsettled connection looks for the server's SETTINGS.
const SETTLE_TICK: Duration = Duration::from_millis(5);

impl<T> Future for Driven<T>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    type Output = hyper::Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<hyper::Result<()>> {
        let done = Pin::new(&mut self.connection).poll(cx);
        let streams = self.connection.current_max_send_streams();
        // Stored first: whoever sees it settled sees its limit.
        self.streams.store(streams, Ordering::Relaxed);
        if !*self.settle.borrow() {
            let now = tokio::time::Instant::now();
            if streams > INITIAL_STREAMS || now >= self.settle_by {
                self.settle.send_replace(true);
            } else {
                self.tick.as_mut().reset(now + SETTLE_TICK);
                let _ = self.tick.as_mut().poll(cx);
            }
        }
        done
    }
}

/// The first request of a connection: if it fails (or is given up) before its answer, the
/// requests waiting for the connection to settle are woken, to look elsewhere.
struct FirstRequest {
    settle: Option<Arc<tokio::sync::watch::Sender<bool>>>,
    answered: bool,
}

impl Drop for FirstRequest {
    fn drop(&mut self) {
        if let Some(settle) = &self.settle
            && !self.answered
        {
            settle.send_modify(|_| {});
        }
    }
}

/// A request's place on its connection, given back when its response body is dropped.
struct Slot(Arc<Use>);

impl Drop for Slot {
    fn drop(&mut self) {
        *lock(&self.0.last) = std::time::Instant::now();
        self.0.requests.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that holds its request's [`Slot`] (over HTTP/2) until it is dropped.
pub struct Tracked {
    body: Incoming,
    _slot: Option<Slot>,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, hyper::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

impl Pool {
    fn new(config: &kube::Config) -> kube::Result<Pool> {
        let mut tls = config.rustls_client_config()?;
        tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let url = &config.cluster_url;
        let host = url.host().unwrap_or("localhost").to_string();
        let bare = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let name = config
            .tls_server_name
            .clone()
            .unwrap_or_else(|| bare.clone());
        let server_name = ServerName::try_from(name.clone()).map_err(|e| {
            kube::Error::Service(format!("{name} is not a TLS server name: {e}").into())
        })?;
        Ok(Pool(Arc::new(Shared {
            host: bare,
            port: url.port_u16().unwrap_or(443),
            server_name,
            tls: tokio_rustls::TlsConnector::from(Arc::new(tls)),
            lanes: Mutex::new(Vec::new()),
            opening: tokio::sync::Mutex::new(()),
            http1: http1(config)?,
            pinged: Pinged(Arc::new(AtomicBool::new(true))),
        })))
    }
}

/// TCP for HTTP/1.1 connections: bounded connects, and keepalive probes.
fn http1_connector() -> hyper_util::client::legacy::connect::HttpConnector {
    let mut tcp = hyper_util::client::legacy::connect::HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_nodelay(true);
    tcp.set_connect_timeout(Some(CONNECT_TIMEOUT));
    tcp.set_keepalive(Some(TCP_KEEPALIVE));
    tcp.set_keepalive_interval(Some(TCP_KEEPALIVE_INTERVAL));
    tcp.set_keepalive_retries(Some(TCP_KEEPALIVE_RETRIES));
    tcp
}

/// A request's place on a connection: where to send it, the slot it holds, and, for the
/// connection's first request, the sender through which its failure wakes the requests waiting
/// for the connection to settle.
type Room = (
    http2::SendRequest<Body>,
    Slot,
    Option<Arc<tokio::sync::watch::Sender<bool>>>,
);

/// What a request finds among the connections ([`Shared::find`]).
enum Found {
    Room(Room),
    Settling(tokio::sync::watch::Receiver<bool>),
    Nothing,
}

impl Shared {
    /// A place for one request on a connection with room; else, if a connection has not
    /// settled yet, a receiver to wait on (it may have room once it has), which says which.
    fn take_room(&self) -> Result<Room, Option<tokio::sync::watch::Receiver<bool>>> {
        let mut lanes = lock(&self.lanes);
        lanes.retain(|l| !l.sender.is_closed());
        // Connections idle for long are closed, all but the first.
        let mut first = true;
        lanes.retain(|l| std::mem::take(&mut first) || !l.idle());
        // The first connection with room: requests fill connections in order, so few are open.
        let Some(lane) = lanes.iter().find(|l| l.has_room()) else {
            return Err(lanes
                .iter()
                .find(|l| !*l.settled.borrow())
                .map(|l| l.settled.clone()));
        };
        lane.open.requests.fetch_add(1, Ordering::Relaxed);
        Ok((lane.sender.clone(), Slot(lane.open.clone()), None))
    }

    /// What a request finds among the connections: a place on one with room; else one that has
    /// not settled yet and was not waited on by this request (it may have room once it has);
    /// else nothing, and a connection must be opened.
    fn find(&self, waited: &Option<tokio::sync::watch::Receiver<bool>>) -> Found {
        match self.take_room() {
            Ok(room) => Found::Room(room),
            Err(Some(settling)) if !waited.as_ref().is_some_and(|w| w.same_channel(&settling)) => {
                Found::Settling(settling)
            }
            Err(_) => Found::Nothing,
        }
    }

    /// A place for one request on an HTTP/2 connection, opening one if all are full; `None`
    /// if the server speaks only HTTP/1.1.
    async fn reserve(&self) -> Result<Option<Room>, BoxError> {
        // The connection last waited on, if any.
        let mut waited: Option<tokio::sync::watch::Receiver<bool>> = None;
        loop {
            if !self.pinged.now() {
                return Ok(None);
            }
            match self.find(&waited) {
                Found::Room(room) => return Ok(Some(room)),
                Found::Settling(settling) => {
                    // A new connection learns its stream limit from the server's SETTINGS:
                    // waiting for them keeps a burst of requests from opening one each. Woken
                    // when it settles, or when its first request failed; once per connection.
                    let mut settling = waited.insert(settling).clone();
                    if !*settling.borrow_and_update() {
                        let _ = tokio::time::timeout(CONNECT_TIMEOUT, settling.changed()).await;
                    }
                    continue;
                }
                Found::Nothing => {}
            }
            let opening = self.opening.lock().await;
            // Another request may have opened one meanwhile (wait for it without the lock).
            match self.find(&waited) {
                Found::Room(room) => return Ok(Some(room)),
                Found::Settling(_) => {
                    drop(opening);
                    continue;
                }
                Found::Nothing => {}
            }
            let opened = tokio::time::timeout(CONNECT_TIMEOUT, self.open())
                .await
                .map_err(|_| {
                    format!(
                        "no connection to {}:{} within {CONNECT_TIMEOUT:?}",
                        self.host, self.port
                    )
                })??;
            match opened {
                // The request that opened the connection is its first.
                Some((lane, settle)) => {
                    lane.open.requests.fetch_add(1, Ordering::Relaxed);
                    let room = (lane.sender.clone(), Slot(lane.open.clone()), Some(settle));
                    lock(&self.lanes).push(lane);
                    return Ok(Some(room));
                }
                None => {
                    tracing::info!("the API server offers no HTTP/2; speaking HTTP/1.1 to it");
                    self.pinged.0.store(false, Ordering::Relaxed);
                }
            }
        }
    }

    /// Opens a connection: TCP, then TLS with ALPN, then HTTP/2; `None` if the server did not
    /// agree on `h2`. The connection settles by itself once the server's SETTINGS are in; the
    /// sender returned is for its first request (see [`FirstRequest`]).
    async fn open(
        &self,
    ) -> Result<Option<(Lane, Arc<tokio::sync::watch::Sender<bool>>)>, BoxError> {
        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port)).await?;
        tcp.set_nodelay(true)?;
        let tls = self.tls.connect(self.server_name.clone(), tcp).await?;
        if tls.get_ref().1.alpn_protocol() != Some(b"h2") {
            return Ok(None);
        }
        let (mut sender, connection) = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .initial_max_send_streams(INITIAL_STREAMS)
            .handshake(TokioIo::new(tls))
            .await?;
        let streams = Arc::new(AtomicUsize::new(INITIAL_STREAMS));
        let (settle, settled) = tokio::sync::watch::channel(false);
        let settle = Arc::new(settle);
        let driven = Driven {
            connection,
            streams: streams.clone(),
            settle: settle.clone(),
            tick: Box::pin(tokio::time::sleep(Duration::ZERO)),
            settle_by: tokio::time::Instant::now() + CONNECT_TIMEOUT,
        };
        tokio::spawn(async move {
            if let Err(e) = driven.await {
                tracing::debug!(error = %e, "an HTTP/2 connection to the API server ended");
            }
        });
        // No request of our own to learn the server's SETTINGS: it would carry no credentials
        // (those are added above this pool), and the kube-apiserver closes an HTTP/2
        // connection after an anonymous request. The opener's own request goes first.
        sender.ready().await?;
        tracing::debug!("opened an HTTP/2 connection to the API server");
        Ok(Some((
            Lane {
                sender,
                open: Use::new(),
                streams,
                settled,
            },
            settle,
        )))
    }
}

impl tower::Service<Request<Body>> for Pool {
    type Response = Response<Tracked>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let shared = self.0.clone();
        Box::pin(async move {
            let Some((mut sender, slot, settle)) = shared.reserve().await? else {
                let response = shared.http1.request(request).await?;
                return Ok(response.map(|body| Tracked { body, _slot: None }));
            };
            let mut first = FirstRequest {
                settle,
                answered: false,
            };
            sender.ready().await?;
            let response = sender.send_request(request).await?;
            first.answered = true;
            drop(first);
            Ok(response.map(|body| Tracked {
                body,
                _slot: Some(slot),
            }))
        })
    }
}
