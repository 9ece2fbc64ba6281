//! Shared by the end-to-end tests: a fake API server serving the FeatureFlag CRD, a broker on
//! 127.0.0.1:0 watching it through kube-rs, and gRPC clients.

#![allow(dead_code, missing_docs)]

use std::time::Duration;

use crd_broker::broker::Running;
use crd_broker::pb;
use crd_broker::pb::broker_client::BrokerClient;
use crd_broker::pb::subscribe_response::Event;
use crd_broker::selector::{KindRef, Selector};
use crd_broker::source::kubernetes::{Kubernetes, READ_TIMEOUT};
use fake_apiserver::{FakeApiServer, Options};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tonic::Streaming;
use tonic::transport::Channel;

pub const CRD: &str = include_str!("../../examples/manifests/featureflag-crd.yaml");
pub const GV: &str = "core.openfeature.dev/v1beta1";
pub const NS_PATH: &str = "/apis/core.openfeature.dev/v1beta1/namespaces/default/featureflags";
pub const WAIT: Duration = Duration::from_secs(10);

pub struct Harness {
    pub fake: FakeApiServer,
    pub broker: Running<Kubernetes>,
}

/// A fake API server with the FeatureFlag CRD and a broker watching it.
pub async fn start(linger: Duration) -> Harness {
    start_allowing(linger, vec![]).await
}

/// As [`start`], with a `--resource` allow-list.
pub async fn start_allowing(linger: Duration, allowed: Vec<KindRef>) -> Harness {
    let options = Options::default()
        .crd_yaml(CRD)
        .expect("the CRD parses")
        .bookmark_every(Duration::from_secs(1));
    let fake = FakeApiServer::start_with(options)
        .await
        .expect("the fake starts");
    let broker = broker_on(&fake, linger, allowed).await;
    Harness { fake, broker }
}

/// A kube client for the fake, configured as the broker's is in production.
pub fn kube_client(fake: &FakeApiServer) -> kube::Client {
    let mut config = kube::Config::new(fake.url().parse().expect("a URL"));
    config.read_timeout = Some(READ_TIMEOUT);
    kube::Client::try_from(config).expect("a kube client")
}

/// A broker on `listener` whose Kubernetes source is the fake.
pub fn broker_at(
    fake: &FakeApiServer,
    listener: TcpListener,
    linger: Duration,
) -> Running<Kubernetes> {
    Running::start(listener, Kubernetes::new(kube_client(fake), vec![]), linger)
        .expect("the broker starts")
}

/// A broker on `listeners` with `config`, its Kubernetes source the fake, serving `allowed`.
pub fn broker_with(
    fake: &FakeApiServer,
    listeners: crd_broker::broker::Listeners,
    config: crd_broker::broker::Config,
    allowed: Vec<KindRef>,
) -> Running<Kubernetes> {
    Running::start_with(
        listeners,
        Kubernetes::new(kube_client(fake), allowed),
        config,
    )
    .expect("the broker starts")
}

/// A fake API server with the FeatureFlag CRD (bookmarks every second).
pub async fn fake() -> FakeApiServer {
    let options = Options::default()
        .crd_yaml(CRD)
        .expect("the CRD parses")
        .bookmark_every(Duration::from_secs(1));
    FakeApiServer::start_with(options)
        .await
        .expect("the fake starts")
}

/// [`fake`], with a kubeconfig for it in a temporary directory (for broker processes).
pub async fn fake_with_kubeconfig() -> (FakeApiServer, tempfile::TempDir, std::path::PathBuf) {
    let fake = fake().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    fake.write_kubeconfig(&kubeconfig).unwrap();
    (fake, dir, kubeconfig)
}

/// A plain HTTP/1.1 GET on loopback: the status code and the body.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// A broker on 127.0.0.1:0 whose Kubernetes source is the fake.
pub async fn broker_on(
    fake: &FakeApiServer,
    linger: Duration,
    allowed: Vec<KindRef>,
) -> Running<Kubernetes> {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
    Running::start(
        listener,
        Kubernetes::new(kube_client(fake), allowed),
        linger,
    )
    .expect("the broker starts")
}

impl Harness {
    pub async fn client(&self) -> BrokerClient<Channel> {
        connect(self.broker.addr).await
    }

    /// Open watches on the fake for the FeatureFlag `name` in `default`.
    pub fn watches_on(&self, name: &str) -> usize {
        self.fake
            .open_watches_on(NS_PATH, Some(&format!("metadata.name={name}")))
    }
}

pub async fn connect(addr: std::net::SocketAddr) -> BrokerClient<Channel> {
    BrokerClient::connect(format!("http://{addr}"))
        .await
        .expect("connects")
}

/// A Broker client over the unix socket at `path`.
pub async fn connect_unix(path: &std::path::Path) -> BrokerClient<Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("unix://{}", path.display()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    BrokerClient::new(channel)
}

pub fn flag(name: &str, variant: &str) -> Value {
    json!({
        "apiVersion": GV,
        "kind": "FeatureFlag",
        "metadata": { "name": name, "namespace": "default" },
        "spec": { "flagSpec": { "flags": { "f": {
            "state": "ENABLED",
            "variants": { "on": true, "off": false, "a": "a", "b": "b" },
            "defaultVariant": variant,
        } } } },
    })
}

/// A second CRD, `secrets.example.com`, for a kind a broker restricted to FeatureFlags refuses.
pub fn secrets_crd() -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": { "name": "secrets.example.com" },
        "spec": { "group": "example.com", "scope": "Namespaced",
            "names": { "plural": "secrets", "kind": "Secret" },
            "versions": [{ "name": "v1", "served": true, "storage": true,
                "schema": { "openAPIV3Schema": { "type": "object", "x-kubernetes-preserve-unknown-fields": true } } }] }
    })
}

pub fn variant_patch(variant: &str) -> Value {
    json!({ "spec": { "flagSpec": { "flags": { "f": { "defaultVariant": variant } } } } })
}

pub fn request(selectors: &[&str]) -> pb::SubscribeRequest {
    let parsed: Vec<Selector> = selectors
        .iter()
        .map(|s| s.parse().expect("a valid selector"))
        .collect();
    crd_broker::cli::subscribe::request(&parsed)
}

pub fn demo(name: &str) -> String {
    format!("featureflags.core.openfeature.dev/default/{name}")
}

pub async fn subscribe(
    client: &mut BrokerClient<Channel>,
    selectors: &[&str],
) -> Streaming<pb::SubscribeResponse> {
    client
        .subscribe(request(selectors))
        .await
        .expect("the subscription is accepted")
        .into_inner()
}

/// The next response, within [`WAIT`].
pub async fn next(stream: &mut Streaming<pb::SubscribeResponse>) -> pb::SubscribeResponse {
    tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("a response within the wait")
        .expect("no error")
        .expect("the stream goes on")
}

/// Reads responses until one satisfies `done`, returning it.
pub async fn until(
    stream: &mut Streaming<pb::SubscribeResponse>,
    done: impl Fn(&pb::SubscribeResponse) -> bool,
) -> pb::SubscribeResponse {
    loop {
        let r = next(stream).await;
        if done(&r) {
            return r;
        }
    }
}

/// The error a stream ends with, within [`WAIT`].
pub async fn ended<T: std::fmt::Debug>(stream: &mut Streaming<T>) -> tonic::Status {
    tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("the stream ends in time")
        .expect_err("it ends with an error")
}

pub fn object(r: &pb::SubscribeResponse) -> Value {
    serde_json::from_slice(&r.object).expect("the object is JSON")
}

pub fn variant(r: &pb::SubscribeResponse) -> String {
    object(r)["spec"]["flagSpec"]["flags"]["f"]["defaultVariant"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

pub fn is(r: &pb::SubscribeResponse, event: Event, variant_wanted: &str) -> bool {
    r.event() == event && variant(r) == variant_wanted
}

/// A CA with a server certificate (localhost, 127.0.0.1) and a client certificate, as PEM.
pub struct Pki {
    pub ca: String,
    pub server_cert: String,
    pub server_key: String,
    pub client_cert: String,
    pub client_key: String,
}

/// A fresh PKI whose CA is named after `name`.
pub fn pki(name: &str) -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("{name} CA"));
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |sans: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(sans)
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(vec!["localhost".into(), "127.0.0.1".into()]);
    let (client_cert, client_key) = leaf(vec!["client.example".into()]);
    Pki {
        ca: ca.pem(),
        server_cert,
        server_key,
        client_cert,
        client_key,
    }
}

/// A Broker client over TLS trusting `pki`'s CA, with its client certificate if `with_cert`.
pub async fn tls_client(
    addr: std::net::SocketAddr,
    pki: &Pki,
    with_cert: bool,
) -> Result<
    crd_broker::pb::broker_client::BrokerClient<tonic::transport::Channel>,
    tonic::transport::Error,
> {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca))
        .domain_name("localhost");
    if with_cert {
        tls = tls.identity(Identity::from_pem(&pki.client_cert, &pki.client_key));
    }
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(crd_broker::pb::broker_client::BrokerClient::new(channel))
}

/// A Subscribe stream to `default/demo` over TLS as a client of `pki`, with its certificate.
pub async fn tls_demo_stream(
    addr: std::net::SocketAddr,
    pki: &Pki,
) -> Streaming<pb::SubscribeResponse> {
    let mut client = tls_client(addr, pki, true).await.unwrap();
    subscribe(&mut client, &[&demo("demo")]).await
}

/// Whether a TLS client of `pki` (with its client certificate if `with_cert`) is refused, at
/// the handshake or on its first call.
pub async fn refused(addr: std::net::SocketAddr, pki: &Pki, with_cert: bool) -> bool {
    match tls_client(addr, pki, with_cert).await {
        Ok(mut c) => c.subscribe(request(&[&demo("demo")])).await.is_err(),
        Err(_) => true,
    }
}

/// Writes `pki`'s server files into `dir` as `tls.crt`, `tls.key` and `ca.crt` (the client CA),
/// each replaced by a rename, as a certificate manager does.
pub fn write_tls_files(dir: &std::path::Path, pki: &Pki) {
    for (name, text) in [
        ("tls.crt", &pki.server_cert),
        ("tls.key", &pki.server_key),
        ("ca.crt", &pki.ca),
    ] {
        let tmp = dir.join(format!(".{name}"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
}
