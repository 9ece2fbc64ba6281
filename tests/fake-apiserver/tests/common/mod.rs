//! Helpers shared by the fidelity tests: a fake serving the FeatureFlag CRD, a kube client for
//! it, FeatureFlag builders, and a raw HTTP client for wire-level assertions.

#![allow(dead_code, missing_docs)]

use std::time::Duration;

use bytes::Bytes;
use fake_apiserver::{FakeApiServer, Options};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use kube::api::{Api, DynamicObject};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

pub const FEATUREFLAG_CRD: &str =
    include_str!("../../../../examples/manifests/featureflag-crd.yaml");
pub const GV: &str = "core.openfeature.dev/v1beta1";
pub const NS_PATH: &str = "/apis/core.openfeature.dev/v1beta1/namespaces/default/featureflags";

/// A fake serving the FeatureFlag CRD, with bookmarks every `bookmarks`.
pub async fn start_with_bookmarks(bookmarks: Duration) -> FakeApiServer {
    let options = Options::default()
        .crd_yaml(FEATUREFLAG_CRD)
        .expect("the CRD parses")
        .bookmark_every(bookmarks);
    FakeApiServer::start_with(options)
        .await
        .expect("the fake starts")
}

/// A fake serving the FeatureFlag CRD.
pub async fn start() -> FakeApiServer {
    start_with_bookmarks(Duration::from_secs(60)).await
}

/// A fake serving the FeatureFlag CRD over TLS (HTTP/2 and HTTP/1.1 by ALPN), or in the clear.
pub async fn start_tls(tls: bool) -> FakeApiServer {
    let options = Options {
        tls,
        ..Options::default()
            .crd_yaml(FEATUREFLAG_CRD)
            .expect("the CRD parses")
    };
    FakeApiServer::start_with(options)
        .await
        .expect("the fake starts")
}

/// A kube client for the fake, with kube's production defaults (retries on).
pub fn client(fake: &FakeApiServer) -> kube::Client {
    let config = kube::Config::new(fake.url().parse().expect("a valid URL"));
    kube::Client::try_from(config).expect("a client")
}

pub fn featureflag_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("core.openfeature.dev", "v1beta1", "FeatureFlag"),
        "featureflags",
    )
}

pub fn featureflags(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &featureflag_resource())
}

/// A FeatureFlag with one boolean flag `f` whose default variant is `variant`.
pub fn flag(ns: &str, name: &str, variant: &str) -> Value {
    json!({
        "apiVersion": GV,
        "kind": "FeatureFlag",
        "metadata": { "name": name, "namespace": ns },
        "spec": { "flagSpec": { "flags": { "f": {
            "state": "ENABLED",
            "variants": { "on": true, "off": false },
            "defaultVariant": variant,
        } } } },
    })
}

pub fn dynamic(value: Value) -> DynamicObject {
    serde_json::from_value(value).expect("a valid object")
}

/// A raw HTTP/1.1 response: status, headers, body.
pub struct Raw {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: String,
}

impl Raw {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

async fn send(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: String,
) -> hyper::Response<Incoming> {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let mut request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string());
    if let Some(ct) = content_type {
        request = request.header("content-type", ct);
    }
    let request = request.body(Full::new(Bytes::from(body))).expect("request");
    sender.send_request(request).await.expect("response")
}

/// Sends one request to the fake and reads the whole response.
pub async fn raw(
    fake: &FakeApiServer,
    method: &str,
    path: &str,
    body: Option<(&str, Value)>,
) -> Raw {
    raw_at(fake.addr(), method, path, body).await
}

/// Sends one request to `addr` and reads the whole response.
pub async fn raw_at(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: Option<(&str, Value)>,
) -> Raw {
    let (ct, text) = match body {
        Some((ct, v)) => (Some(ct), v.to_string()),
        None => (None, String::new()),
    };
    let response = send(addr, method, path, ct, text).await;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("a whole body")
        .to_bytes();
    Raw {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// How a watch body ended.
#[derive(Debug, PartialEq)]
pub enum End {
    /// The terminating chunk arrived.
    Clean,
    /// The connection broke mid-body.
    Aborted,
}

/// Reads a watch response line by line.
pub struct Lines {
    pub status: u16,
    body: Incoming,
    buf: Vec<u8>,
}

impl Lines {
    /// Opens a raw watch request.
    pub async fn open(fake: &FakeApiServer, path: &str) -> Lines {
        Self::open_at(fake.addr(), path).await
    }

    /// Opens a raw watch request to `addr`.
    pub async fn open_at(addr: std::net::SocketAddr, path: &str) -> Lines {
        let response = send(addr, "GET", path, None, String::new()).await;
        Lines {
            status: response.status().as_u16(),
            body: response.into_body(),
            buf: Vec::new(),
        }
    }

    /// The next event line as JSON, or how the body ended.
    pub async fn next(&mut self) -> Result<Value, End> {
        loop {
            if let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return Ok(serde_json::from_slice(&line).expect("each line is one JSON document"));
            }
            match self.body.frame().await {
                None => return Err(End::Clean),
                Some(Err(_)) => return Err(End::Aborted),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }

    /// The next line within `timeout`, or `None` if nothing came.
    pub async fn next_within(&mut self, timeout: Duration) -> Option<Result<Value, End>> {
        tokio::time::timeout(timeout, self.next()).await.ok()
    }
}
