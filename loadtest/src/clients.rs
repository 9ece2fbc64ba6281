//! The load: subscribers over shared connections that time every delivery, and light idle
//! "sidecars" (one raw HTTP/2 connection and one stream each) for the memory measurements.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};
use crd_broker::pb;
use crd_broker::pb::broker_client::BrokerClient;
use prost::Message;
use tokio::net::TcpSocket;
use tonic::transport::{Channel, Endpoint};

use crate::stats::Histogram;

/// Nanoseconds since the epoch: the timestamp writers put in the payload.
pub fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64
}

/// The number after `"key":` in a JSON text.
pub fn number_after(text: &[u8], key: &str) -> Option<u64> {
    let needle = format!("\"{key}\":");
    let at = text
        .windows(needle.len())
        .position(|w| w == needle.as_bytes())?;
    let digits: String = text[at + needle.len()..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .map(|b| *b as char)
        .collect();
    digits.parse().ok()
}

/// What the subscribers saw.
pub struct Recorder {
    /// Latency of each live update to each subscriber (write → receipt).
    pub deliveries: Histogram,
    /// Per update (by sequence number): the latency to the last subscriber that got it.
    pub completion: Vec<AtomicU64>,
    /// First message of a subscription that started its resource's watch.
    pub first_cold: Histogram,
    /// First message of a subscription whose resource was already watched.
    pub first_warm: Histogram,
    /// Per subscriber: the sequence number of the last state it received.
    pub last_seq: Vec<AtomicU64>,
    /// Per subscriber: the resourceVersion of the last state it received.
    pub last_rv: Vec<std::sync::Mutex<String>>,
    /// Streams that ended with an error.
    pub errors: AtomicU64,
    /// The first of those errors, for the report of a run that fails on them.
    pub first_error: std::sync::Mutex<Option<String>>,
    /// Times a subscriber started over after an error (the direct sidecars, which retry as
    /// client-go's reflector does).
    pub retries: AtomicU64,
}

impl Recorder {
    /// For `subscribers` subscribers and up to `updates` updates.
    pub fn new(subscribers: usize, updates: usize) -> Arc<Self> {
        Arc::new(Recorder {
            deliveries: Histogram::default(),
            completion: (0..=updates).map(|_| AtomicU64::new(0)).collect(),
            first_cold: Histogram::default(),
            first_warm: Histogram::default(),
            last_seq: (0..subscribers).map(|_| AtomicU64::new(0)).collect(),
            last_rv: (0..subscribers)
                .map(|_| std::sync::Mutex::new(String::new()))
                .collect(),
            errors: AtomicU64::new(0),
            first_error: std::sync::Mutex::new(None),
            retries: AtomicU64::new(0),
        })
    }

    /// A subscriber's first message, `elapsed` after it asked: its resource's watch started
    /// for it (`cold`) or was already there.
    pub fn first(&self, cold: bool, elapsed: Duration) {
        match cold {
            true => self.first_cold.record(elapsed),
            false => self.first_warm.record(elapsed),
        }
    }

    /// A live update received now, `object` the CR's JSON with the writer's `seq` and `sentAt`.
    /// A state no write stamped (`sentAt` 0, the CR as the fixtures made it) is no update: a
    /// server that sends its first configuration twice (flagd-proxy) sends it again.
    pub fn update(&self, object: &[u8]) {
        let received = now_nanos();
        if let (Some(sent @ 1..), Some(seq)) =
            (number_after(object, "sentAt"), number_after(object, "seq"))
        {
            let latency = received.saturating_sub(sent);
            self.deliveries.record(Duration::from_nanos(latency));
            if let Some(c) = self.completion.get(seq as usize) {
                c.fetch_max(latency, Ordering::Relaxed);
            }
        }
    }

    /// Subscriber `slot` now holds `object` at `resource_version`.
    pub fn seen(&self, slot: usize, object: &[u8], resource_version: String) {
        if let Some(seq) = number_after(object, "seq") {
            self.last_seq[slot].store(seq, Ordering::Relaxed);
        }
        if let Ok(mut rv) = self.last_rv[slot].lock() {
            *rv = resource_version;
        }
    }

    /// A stream ended with `status`: counted, and kept if it is the first.
    pub fn failed(&self, status: &tonic::Status) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut first) = self.first_error.lock() {
            first.get_or_insert_with(|| format!("{:?}: {}", status.code(), status.message()));
        }
    }

    /// The first error, as text (empty without one).
    pub fn first_error(&self) -> String {
        self.first_error
            .lock()
            .ok()
            .and_then(|e| e.clone())
            .unwrap_or_default()
    }

    /// Per-update completion times (updates that reached nobody are left out).
    pub fn completions(&self) -> Histogram {
        let h = Histogram::default();
        for c in &self.completion {
            let ns = c.load(Ordering::Relaxed);
            if ns > 0 {
                h.record(Duration::from_nanos(ns));
            }
        }
        h
    }
}

/// `n` connections to `addr`, spread over the loopback addresses 127.0.0.1..=127.0.0.`sources`
/// (each has its own ephemeral ports).
pub async fn connections(addr: SocketAddr, n: usize, sources: u8) -> anyhow::Result<Vec<Channel>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let local = IpAddr::V4(Ipv4Addr::new(
            127,
            0,
            0,
            1 + (i % sources.max(1) as usize) as u8,
        ));
        let channel = Endpoint::from_shared(format!("http://{addr}"))?
            .local_address(Some(local))
            .connect()
            .await?;
        out.push(channel);
    }
    Ok(out)
}

/// One connection to `addr` from `local`.
pub async fn connection_from(addr: SocketAddr, local: Ipv4Addr) -> anyhow::Result<Channel> {
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .local_address(Some(IpAddr::V4(local)))
        .connect()
        .await?)
}

/// A Subscribe request for the FeatureFlag `default/{name}`.
pub fn subscribe_request(name: &str) -> pb::SubscribeRequest {
    pb::SubscribeRequest {
        resources: vec![pb::ResourceRef {
            group: "core.openfeature.dev".into(),
            version: "v1beta1".into(),
            resource: "featureflags".into(),
            namespace: "default".into(),
            name: name.to_string(),
            ..Default::default()
        }],
    }
}

/// `n` subscriptions to `name`, one after another on `channel`, each timed from the call to its
/// first message and then dropped: the first-message time of a lone subscriber.
pub async fn first_messages(channel: Channel, name: &str, n: usize, h: &Histogram) {
    let mut client = BrokerClient::new(channel);
    for _ in 0..n {
        let started = Instant::now();
        if let Ok(response) = client.subscribe(subscribe_request(name)).await
            && let Ok(Some(_)) = response.into_inner().message().await
        {
            h.record(started.elapsed());
        }
    }
}

/// One subscriber: subscribes to `name`, times its first message, then every live update.
pub async fn subscribe(
    channel: Channel,
    name: String,
    slot: usize,
    cold: bool,
    recorder: Arc<Recorder>,
    stop: tokio_util_like::Stop,
) {
    let mut client = BrokerClient::new(channel);
    let opened = client.subscribe(subscribe_request(&name));
    follow(opened, &recorder, stop, |first, r| {
        match first {
            Some(elapsed) => recorder.first(cold, elapsed),
            None => recorder.update(&r.object),
        }
        recorder.seen(slot, &r.object, r.resource_version);
    })
    .await
}

/// Follows the stream `opened` opens until `stop`: `each` gets every message, with the time
/// from the call to the first one. A stream that fails to open, fails or ends counts as an
/// error in `recorder`.
pub async fn follow<M>(
    opened: impl Future<Output = Result<tonic::Response<tonic::Streaming<M>>, tonic::Status>>,
    recorder: &Recorder,
    stop: tokio_util_like::Stop,
    mut each: impl FnMut(Option<Duration>, M),
) {
    let started = Instant::now();
    let response = match opened.await {
        Ok(response) => response,
        Err(status) => return recorder.failed(&status),
    };
    let mut stream = response.into_inner();
    let mut first = true;
    loop {
        let message = tokio::select! {
            _ = stop.wait() => return,
            m = stream.message() => m,
        };
        match message {
            Ok(Some(m)) => {
                let elapsed = std::mem::take(&mut first).then(|| started.elapsed());
                each(elapsed, m);
            }
            Ok(None) => return recorder.failed(&tonic::Status::unknown("the stream ended")),
            Err(status) => return recorder.failed(&status),
        }
    }
}

/// A small stop signal, so the harness needs no extra dependency for it.
pub mod tokio_util_like {
    use tokio::sync::watch;

    /// Resolves `wait` once `stop` is called on any clone of its sender.
    #[derive(Clone)]
    pub struct Stop(watch::Receiver<bool>);

    /// Triggers a [`Stop`].
    pub struct Trigger(watch::Sender<bool>);

    /// A new signal.
    pub fn signal() -> (Trigger, Stop) {
        let (tx, rx) = watch::channel(false);
        (Trigger(tx), Stop(rx))
    }

    impl Trigger {
        /// Stops every waiter.
        pub fn stop(&self) {
            self.0.send_replace(true);
        }
    }

    impl Stop {
        /// Waits for the signal.
        pub async fn wait(&self) {
            let mut rx = self.0.clone();
            let _ = rx.wait_for(|stopped| *stopped).await;
        }
    }
}

/// An idle sidecar: one HTTP/2 connection and one Subscribe stream that has had its first
/// message. Dropping it closes both.
pub struct Sidecar {
    _send: h2::client::SendRequest<Bytes>,
    _body: h2::RecvStream,
    _conn: tokio::task::JoinHandle<()>,
}

fn grpc_frame(message: &impl Message) -> Bytes {
    let body = message.encode_to_vec();
    let mut out = BytesMut::with_capacity(body.len() + 5);
    out.put_u8(0);
    out.put_u32(body.len() as u32);
    out.put_slice(&body);
    out.freeze()
}

/// Opens a sidecar from `local` to `addr` subscribing to `name`; waits for its first message.
pub async fn sidecar(addr: SocketAddr, local: Ipv4Addr, name: &str) -> anyhow::Result<Sidecar> {
    open(addr, local, &subscribe_request(name), true).await
}

/// Opens a raw stream from `local` to `addr` with `request`, taking its first message if
/// `read_first`; after that it reads nothing (it stalls once the server fills its window).
pub async fn open(
    addr: SocketAddr,
    local: Ipv4Addr,
    request: &pb::SubscribeRequest,
    read_first: bool,
) -> anyhow::Result<Sidecar> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(IpAddr::V4(local), 0))?;
    let tcp = socket.connect(addr).await?;
    tcp.set_nodelay(true)?;
    let (send, conn) = h2::client::handshake(tcp).await?;
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut send = send.ready().await?;
    let post = http::Request::post(format!("http://{addr}/crdbroker.v1.Broker/Subscribe"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())?;
    let (response, mut stream) = send.send_request(post, false)?;
    stream.send_data(grpc_frame(request), true)?;
    let mut body = response.await?.into_body();
    if read_first {
        let first = body
            .data()
            .await
            .ok_or_else(|| anyhow::anyhow!("the stream ended before its first message"))??;
        let _ = body.flow_control().release_capacity(first.len());
    }
    Ok(Sidecar {
        _send: send,
        _body: body,
        _conn: conn,
    })
}
