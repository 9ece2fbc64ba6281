//! A sidecar that watches its CR on the API server itself, as an informer in each pod does
//! (flagd's own Kubernetes sync, a client-go informer): its own TLS connection speaking HTTP/2
//! (client-go's default), its own bearer token, and the reflector's two requests — a LIST of
//! the one object (`fieldSelector=metadata.name=NAME`) or of the objects a label selector
//! picks (a resolver's EndpointSlices), then a WATCH from the list's resourceVersion with
//! bookmarks and client-go's timeout (5 to 10 minutes), watched again from the last
//! resourceVersion when the server ends it, listed again on 410 Gone.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::{Buf, Bytes, BytesMut};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::clients::Recorder;
use crate::clients::tokio_util_like::Stop;

/// Where the API server is and how a sidecar proves who it is.
pub struct Api {
    addr: SocketAddr,
    authority: String,
    tls: TlsConnector,
    token: String,
    /// The collection's path, e.g. `/apis/core.openfeature.dev/v1beta1/namespaces/default/featureflags`.
    collection: String,
}

impl Api {
    /// The API server at `server` (`https://host:port`), trusted through the CA at `ca`,
    /// with `token`, serving the objects of `collection`.
    pub fn new(server: &str, ca: &Path, token: String, collection: &str) -> anyhow::Result<Api> {
        let authority = server
            .strip_prefix("https://")
            .context("the API server's URL is https://")?
            .trim_end_matches('/')
            .to_string();
        let addr: SocketAddr = authority
            .parse()
            .with_context(|| format!("{authority} is an IP address and a port"))?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(ca)? {
            roots.add(cert?)?;
        }
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Api {
            addr,
            authority,
            tls: TlsConnector::from(Arc::new(config)),
            token,
            collection: collection.to_string(),
        })
    }

    /// A new connection of its own, HTTP/2 over TLS.
    async fn connect(&self) -> anyhow::Result<h2::client::SendRequest<Bytes>> {
        let tcp = TcpStream::connect(self.addr).await?;
        tcp.set_nodelay(true)?;
        let name = ServerName::IpAddress(self.addr.ip().into());
        let tls = self.tls.connect(name, tcp).await?;
        let (send, connection) = h2::client::handshake(tls).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(send.ready().await?)
    }

    /// GET `query` on the collection: the response's status and body.
    async fn get(
        &self,
        send: &mut h2::client::SendRequest<Bytes>,
        query: &str,
    ) -> anyhow::Result<(http::StatusCode, h2::RecvStream)> {
        let request = http::Request::get(format!(
            "https://{}{}?{query}",
            self.authority, self.collection
        ))
        .header("authorization", format!("Bearer {}", self.token))
        .header("accept", "application/json")
        .header("user-agent", "crd-broker-loadtest/direct-sidecar")
        .body(())?;
        *send = send.clone().ready().await?;
        let (response, _) = send.send_request(request, true)?;
        let response = response.await?;
        Ok((response.status(), response.into_body()))
    }
}

/// The next chunk of `body`, its flow-control window given back.
async fn chunk(body: &mut h2::RecvStream) -> Option<anyhow::Result<Bytes>> {
    let data = body.data().await?;
    Some(
        data.inspect(|bytes| {
            let _ = body.flow_control().release_capacity(bytes.len());
        })
        .map_err(Into::into),
    )
}

/// Reads `body` to its end.
async fn read_all(body: &mut h2::RecvStream) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    while let Some(bytes) = chunk(body).await {
        out.extend_from_slice(&bytes?);
    }
    Ok(out)
}

/// What a sidecar follows: the object `name`, or the objects the label selector picks.
pub fn by_name(name: &str) -> String {
    format!("fieldSelector=metadata.name%3D{name}")
}

/// [`by_name`] for the objects with the label `key=value`.
pub fn by_label(key: &str, value: &str) -> String {
    format!("labelSelector={}%3D{value}", key.replace('/', "%2F"))
}

/// One sidecar following `selector` ([`by_name`], [`by_label`]): lists it, times that first
/// state, then watches it and
/// records every update into `recorder` as subscriber `slot`, until `stop`. On an error (a
/// refused connection, a 429 from Priority and Fairness, a 5xx) it waits and starts over on a
/// new connection, as the reflector does: 800 ms doubling to 30 s, with jitter.
pub async fn follow(
    api: Arc<Api>,
    selector: String,
    slot: usize,
    recorder: Arc<Recorder>,
    stop: Stop,
) {
    let started = Instant::now();
    let mut backoff = Duration::from_millis(800);
    loop {
        tokio::select! {
            _ = stop.wait() => return,
            result = run(&api, &selector, slot, &recorder, started) => {
                if let Err(e) = result
                    && recorder.retries.fetch_add(1, Ordering::Relaxed) == 0
                {
                    eprintln!("a direct sidecar starts over after: {e:#}");
                }
            }
        }
        let jitter = backoff.mul_f64(fastrand::f64());
        tokio::select! {
            _ = stop.wait() => return,
            _ = tokio::time::sleep(backoff + jitter) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// `n` sidecars, sidecar `i` following `selector(i)` as subscriber `i`, started as pods start:
/// over time, 50 every 100 ms.
pub async fn start(
    api: Arc<Api>,
    n: usize,
    selector: impl Fn(usize) -> String,
    recorder: &Arc<Recorder>,
    stop: &Stop,
) {
    for i in 0..n {
        tokio::spawn(follow(
            api.clone(),
            selector(i),
            i,
            recorder.clone(),
            stop.clone(),
        ));
        if i % 50 == 49 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

async fn run(
    api: &Api,
    selector: &str,
    slot: usize,
    recorder: &Recorder,
    started: Instant,
) -> anyhow::Result<()> {
    let mut send = api.connect().await?;
    let mut first = recorder.last_rv[slot]
        .lock()
        .map(|rv| rv.is_empty())
        .unwrap_or(true);
    loop {
        let (status, mut body) = api.get(&mut send, &format!("{selector}&limit=500")).await?;
        let list: serde_json::Value = serde_json::from_slice(&read_all(&mut body).await?)?;
        anyhow::ensure!(status.is_success(), "LIST {selector}: {status}");
        let mut rv = list["metadata"]["resourceVersion"]
            .as_str()
            .context("a list has a resourceVersion")?
            .to_string();
        if let Some(item) = list["items"].get(0) {
            let object = serde_json::to_vec(item)?;
            if std::mem::take(&mut first) {
                recorder.first(true, started.elapsed());
            }
            recorder.seen(slot, &object, rv.clone());
        }
        // client-go's reflector: a timeout between its minimum (5 minutes) and twice that.
        let timeout = 300 + fastrand::u64(0..300);
        loop {
            let query = format!(
                "{selector}&watch=true&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds={timeout}"
            );
            let (status, mut body) = api.get(&mut send, &query).await?;
            if status == http::StatusCode::GONE {
                break;
            }
            anyhow::ensure!(status.is_success(), "WATCH {selector}: {status}");
            match watch(&mut body, slot, recorder, &mut rv).await? {
                Ended::Closed => continue,
                Ended::Gone => break,
            }
        }
    }
}

enum Ended {
    /// The server ended the watch (its timeout): watch again from the last resourceVersion.
    Closed,
    /// An ERROR event (410 Gone): list again.
    Gone,
}

/// Reads watch events (one JSON object a line) from `body` until it ends.
async fn watch(
    body: &mut h2::RecvStream,
    slot: usize,
    recorder: &Recorder,
    rv: &mut String,
) -> anyhow::Result<Ended> {
    let mut buffer = BytesMut::new();
    while let Some(bytes) = chunk(body).await {
        buffer.extend_from_slice(&bytes?);
        while let Some(end) = buffer.iter().position(|&b| b == b'\n') {
            let line = buffer.split_to(end + 1);
            let event: serde_json::Value = serde_json::from_slice(line.chunk())?;
            let object = &event["object"];
            if let Some(version) = object["metadata"]["resourceVersion"].as_str() {
                *rv = version.to_string();
            }
            match event["type"].as_str() {
                Some("ADDED" | "MODIFIED") => {
                    // The line holds the object, with the writer's seq and sentAt.
                    recorder.update(&line);
                    recorder.seen(slot, &line, rv.clone());
                }
                Some("ERROR") => return Ok(Ended::Gone),
                _ => {}
            }
        }
    }
    Ok(Ended::Closed)
}
