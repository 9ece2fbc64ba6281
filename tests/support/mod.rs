//! Shared by the end-to-end tests: a fake API server serving the FeatureFlag CRD, a broker on
//! 127.0.0.1:0 watching it through kube-rs, and gRPC clients.

#![allow(dead_code, missing_docs)]

use std::time::Duration;

pub mod chart;
pub mod control_plane;
pub mod flagd;
pub mod relay;

pub use control_plane::{Leash, free_port, peer, scrape};

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

/// A broker on `listeners` with `config`, its Kubernetes source the fake, serving `allowed`;
/// its identity sources ask the fake too.
pub fn broker_with(
    fake: &FakeApiServer,
    listeners: crd_broker::broker::Listeners,
    mut config: crd_broker::broker::Config,
    allowed: Vec<KindRef>,
) -> Running<Kubernetes> {
    config.access.api.get_or_insert_with(|| kube_client(fake));
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
    try_http_get(addr, path).await.expect("GET")
}

/// [`http_get`], failing when the server does not take the connection or answer (a server that
/// is starting, say).
pub async fn try_http_get(
    addr: std::net::SocketAddr,
    path: &str,
) -> std::io::Result<(u16, String)> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    exchange(stream, addr, &format!("GET {path}"), None, None).await
}

/// A plain HTTP/1.1 POST of the JSON `body` on loopback: the status code and the body, or why
/// there is none.
pub async fn http_post(
    addr: std::net::SocketAddr,
    path: &str,
    body: &Value,
) -> std::io::Result<(u16, String)> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let body = body.to_string();
    exchange(stream, addr, &format!("POST {path}"), None, Some(&body)).await
}

/// A plain HTTP/1.1 GET from the loopback address `from`, with `token` as a bearer token if
/// given: the status code and the body.
pub async fn http_get_as(
    addr: std::net::SocketAddr,
    from: &str,
    path: &str,
    token: Option<&str>,
) -> (u16, String) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(std::net::SocketAddr::new(from.parse().unwrap(), 0))
        .unwrap();
    let stream = socket.connect(addr).await.expect("connect");
    exchange(stream, addr, &format!("GET {path}"), token, None)
        .await
        .expect("GET")
}

/// One request (`line`: the method and the path) on `stream`, which the server closes after
/// answering: the status and the body.
async fn exchange(
    mut stream: tokio::net::TcpStream,
    addr: std::net::SocketAddr,
    line: &str,
    token: Option<&str>,
    json: Option<&str>,
) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let body = json
        .map(|b| {
            format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            )
        })
        .unwrap_or_default();
    let request = format!(
        "{line} HTTP/1.1\r\nHost: {addr}\r\n{authorization}{body}Connection: close\r\n\r\n{}",
        json.unwrap_or_default()
    );
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
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

/// A merge patch that labels an object `app=<app>`.
pub fn relabel(app: &str) -> Value {
    json!({ "metadata": { "labels": { "app": app } } })
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

/// The rows of the kernel's TCP socket tables (`/proc/net/tcp` and `tcp6`), split into fields:
/// local address, remote address, state, …, inode (field 9).
fn tcp_sockets() -> Vec<Vec<String>> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|text| {
            text.lines()
                .skip(1)
                .map(|line| line.split_whitespace().map(str::to_string).collect())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The port of a `/proc/net/tcp` address (`0100007F:1F90`), as the table writes it (hex).
fn port_of(address: &str) -> &str {
    address.rsplit(':').next().unwrap_or_default()
}

/// Established TCP connections from this process to `port` on loopback (IPv4 and IPv6),
/// counted from the kernel's socket table: the client side only.
pub fn connections_to(port: u16) -> usize {
    let port = format!("{port:04X}");
    tcp_sockets()
        .iter()
        .filter(|f| f.len() > 3 && f[3] == "01" && port_of(&f[2]) == port && port_of(&f[1]) != port)
        .count()
}

/// Established TCP connections of the process `pid` to `port` (any address): its socket inodes
/// matched against the kernel's socket tables.
pub fn connections_of(pid: u32, port: u16) -> usize {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(
                target
                    .strip_prefix("socket:[")?
                    .trim_end_matches(']')
                    .to_string(),
            )
        })
        .collect();
    let port = format!("{port:04X}");
    tcp_sockets()
        .iter()
        .filter(|f| f.len() > 9 && f[3] == "01" && port_of(&f[2]) == port && inodes.contains(&f[9]))
        .count()
}

/// A fresh PKI whose CA is named after `name`.
pub fn pki(name: &str) -> Pki {
    pki_with_client_uri(name, None)
}

/// As [`pki`], the client certificate also carrying the URI SAN `uri` (a SPIFFE ID, say).
pub fn pki_with_client_uri(name: &str, uri: Option<&str>) -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("{name} CA"));
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |sans: Vec<String>, uri: Option<&str>| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(sans).unwrap();
        if let Some(uri) = uri {
            params
                .subject_alt_names
                .push(SanType::URI(uri.try_into().unwrap()));
        }
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(vec!["localhost".into(), "127.0.0.1".into()], None);
    let (client_cert, client_key) = leaf(vec!["client.example".into()], uri);
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

/// A FeatureFlag `name` in namespace `ns` whose flag `f` defaults to `variant`.
pub fn flag_in(ns: &str, name: &str, variant: &str) -> Value {
    let mut f = flag(name, variant);
    f["metadata"]["namespace"] = json!(ns);
    f
}

/// `featureflags.core.openfeature.dev/<ns>/<name>`.
pub fn ff(ns: &str, name: &str) -> String {
    format!("featureflags.core.openfeature.dev/{ns}/{name}")
}

/// Runs a pod in the fake, as a kubelet would report it: Running, with `ip` (use 127.0.0.x to
/// stand for pods on loopback), under the service account `sa`. Returns its UID.
pub fn run_pod(fake: &FakeApiServer, ns: &str, name: &str, sa: &str, ip: &str) -> String {
    fake.apply(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": ns },
        "spec": { "serviceAccountName": sa, "containers": [{ "name": "app", "image": "app" }] },
    }))
    .expect("the pod is created");
    let pod = fake
        .merge_patch_status(
            "v1",
            "pods",
            ns,
            name,
            json!({ "status": { "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }] } }),
        )
        .expect("its status is set");
    pod["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// A Broker client whose connection comes from `ip` (127.0.0.x: a different pod).
pub async fn connect_from(addr: std::net::SocketAddr, ip: &str) -> BrokerClient<Channel> {
    BrokerClient::new(channel_from(addr, ip).await)
}

/// A channel to `addr` from the source address `ip`.
pub async fn channel_from(addr: std::net::SocketAddr, ip: &str) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .local_address(Some(ip.parse().unwrap()))
        .connect()
        .await
        .expect("connects")
}

/// A TCP forwarder on 127.0.0.1 whose connections reach `to` from the source address `from`:
/// an unmodified client pointed at it is, to the broker, the pod at `from`. It runs until the
/// test ends.
pub async fn forwarder(from: &str, to: std::net::SocketAddr) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let from: std::net::IpAddr = from.parse().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let socket = tokio::net::TcpSocket::new_v4().unwrap();
                socket.bind(std::net::SocketAddr::new(from, 0)).unwrap();
                let Ok(mut outbound) = socket.connect(to).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    });
    addr
}

/// gRPC and admin listeners on 127.0.0.1, each on a free port.
pub async fn with_admin() -> crd_broker::broker::Listeners {
    crd_broker::broker::Listeners {
        tcp: Some(TcpListener::bind("127.0.0.1:0").await.unwrap()),
        admin: Some(TcpListener::bind("127.0.0.1:0").await.unwrap()),
        ..Default::default()
    }
}

/// A broker on 127.0.0.1:0 (with an admin port) on the fake, with these access settings and
/// a linger of zero.
pub async fn broker_with_access(
    fake: &FakeApiServer,
    access: crd_broker::access::Settings,
) -> Running<Kubernetes> {
    let config = crd_broker::broker::Config {
        linger: Duration::ZERO,
        access,
        ..Default::default()
    };
    broker_with(fake, with_admin().await, config, vec![])
}

/// The broker's metrics, scraped from its admin port.
pub async fn metrics(admin: std::net::SocketAddr) -> std::collections::BTreeMap<String, f64> {
    let (code, body) = http_get(admin, "/metrics").await;
    assert_eq!(code, 200);
    scrape(&body)
}

/// One sample's value (0 when absent).
pub fn get(m: &std::collections::BTreeMap<String, f64>, key: &str) -> f64 {
    m.get(key).copied().unwrap_or(0.0)
}

/// A codec that sends and receives message bytes as they are: for calling any method with any
/// bytes (garbage, oversized, invented paths).
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = bytes::Bytes;
    type Decode = bytes::Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = bytes::Bytes;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: bytes::Bytes,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put(dst, item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = bytes::Bytes;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<bytes::Bytes>, tonic::Status> {
        let n = bytes::Buf::remaining(src);
        Ok(Some(bytes::Buf::copy_to_bytes(src, n)))
    }
}

/// Calls `path` on `channel` with `body` as the request message and `metadata`: the first
/// response message, or the status the call ends with.
pub async fn raw_call(
    channel: Channel,
    path: &str,
    body: impl Into<bytes::Bytes>,
    metadata: &[(&'static str, &str)],
) -> Result<bytes::Bytes, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut request = tonic::Request::new(body.into());
    for (k, v) in metadata {
        request
            .metadata_mut()
            .insert(*k, tonic::metadata::MetadataValue::try_from(*v).unwrap());
    }
    let path = http::uri::PathAndQuery::try_from(path).unwrap();
    let mut stream = grpc
        .server_streaming(request, path, RawCodec)
        .await?
        .into_inner();
    match tokio::time::timeout(WAIT, stream.message()).await {
        Ok(Ok(Some(message))) => Ok(message),
        Ok(Ok(None)) => Err(tonic::Status::ok("ended without a message")),
        Ok(Err(status)) => Err(status),
        Err(_) => Err(tonic::Status::deadline_exceeded(
            "no message within the wait",
        )),
    }
}

/// Asserts that `status` has `code` and a message containing `needle`.
#[track_caller]
pub fn assert_status(status: &tonic::Status, code: tonic::Code, needle: &str) {
    assert_eq!(status.code(), code, "{}", status.message());
    assert!(
        status.message().contains(needle),
        "{:?} lacks {needle:?}",
        status.message()
    );
}

/// The virtualenv's Python (`$CRD_BROKER_PYTHON`, else `.venv`), once it can import `module`.
pub fn python_with(module: &str) -> std::path::PathBuf {
    let python = std::env::var_os("CRD_BROKER_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python")
        });
    let ready = std::process::Command::new(&python)
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ready,
        "{} cannot import {module}: run the README's test command (scripts/test), which makes the virtualenv",
        python.display()
    );
    python
}

/// examples/manifests/demo.yaml: the FeatureFlag `default/demo` with two flags.
pub fn demo_manifest() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/manifests/demo.yaml"
    ))
    .unwrap();
    crd_broker::yaml::from_str(&text).unwrap()
}

/// Makes a panic show at once on the process's standard error, besides the test's captured
/// output: a failure among child processes' logs then reads in place, also where only a part
/// of a long output is kept (a CI excerpt). Installed once per process.
pub fn show_panics_in_place() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            use std::io::Write;
            let thread = std::thread::current();
            let name = thread.name().unwrap_or("a test");
            // Not captured by the test harness: straight to the file descriptor.
            let _ = writeln!(std::io::stderr(), "PANIC in {name}: {info}");
            previous(info);
        }));
    });
}

/// Polls `done` every 50 ms until it holds, failing with `what` after `within`: how long it took.
pub async fn eventually(
    what: &str,
    within: Duration,
    mut done: impl AsyncFnMut() -> bool,
) -> Duration {
    let start = std::time::Instant::now();
    let ok = tokio::time::timeout(within, async {
        while !done().await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(ok.is_ok(), "{what}");
    start.elapsed()
}
