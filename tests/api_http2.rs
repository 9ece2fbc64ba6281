//! HTTP/2 to the API server (`--api-http2`): watches share a few TLS connections, up to the
//! server's stream limit each, counted from the kernel's socket table; HTTP/1.1 when the
//! server offers no `h2`; `off` keeps one connection per watch.

mod support;

use std::time::Duration;

use crd_broker::broker::Running;
use crd_broker::source::kubernetes::http::{self, ApiHttp2};
use crd_broker::source::kubernetes::{Kubernetes, READ_TIMEOUT};
use fake_apiserver::{FakeApiServer, Options};
use support::*;
use tokio::net::TcpListener;

/// More CRs than one connection's 100 streams.
const CRS: usize = 180;

async fn tls_fake(http2: bool) -> FakeApiServer {
    let options = Options {
        tls: true,
        http2,
        ..Options::default().crd_yaml(CRD).unwrap()
    };
    let fake = FakeApiServer::start_with(options).await.unwrap();
    for k in 0..CRS {
        fake.apply(flag(&format!("ff-{k}"), "on")).unwrap();
    }
    fake
}

/// A broker on the fake through the kubeconfig it writes, as `serve --api-http2 mode` builds it.
async fn broker(fake: &FakeApiServer, mode: ApiHttp2) -> Running<Kubernetes> {
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&fake.kubeconfig()).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    config.read_timeout = Some(READ_TIMEOUT);
    let (client, pinged) =
        http::client(config, mode, Default::default(), Default::default()).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    Running::start(
        listener,
        // A watch per name, whatever their number.
        Kubernetes::new(client, vec![])
            .with_pinged(pinged)
            .with_namespace_watch_threshold(0),
        Duration::from_secs(30),
    )
    .unwrap()
}

/// Subscribes to every CR (100 per stream) and waits until every stream had its first states.
async fn subscribe_all(
    broker: &Running<Kubernetes>,
) -> Vec<tonic::Streaming<crd_broker::pb::SubscribeResponse>> {
    let names: Vec<String> = (0..CRS).map(|k| demo(&format!("ff-{k}"))).collect();
    let mut client = connect(broker.addr).await;
    let mut streams = Vec::new();
    for chunk in names.chunks(100) {
        let selectors: Vec<&str> = chunk.iter().map(String::as_str).collect();
        let mut stream = subscribe(&mut client, &selectors).await;
        for _ in chunk {
            next(&mut stream).await;
        }
        streams.push(stream);
    }
    streams
}

/// Waits until the fake holds exactly one watch per CR.
async fn all_watched(fake: &FakeApiServer) {
    eventually("one watch per CR", Duration::from_secs(15), async || {
        fake.open_watches() == CRS
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_share_http2_connections_up_to_the_servers_stream_limit() {
    let fake = tls_fake(true).await;
    let broker = broker(&fake, ApiHttp2::Auto).await;
    let mut streams = subscribe_all(&broker).await;
    all_watched(&fake).await;
    let connections = connections_to(fake.addr().port());
    println!("{CRS} watches over {connections} connections");
    // 180 watches at 100 streams per connection need 2; discovery and checks share them.
    assert!(
        (2..=3).contains(&connections),
        "{CRS} watches over {connections} connections"
    );
    let requests = fake.requests();
    assert!(
        requests.iter().all(|r| r.version == "HTTP/2.0"),
        "every request over HTTP/2"
    );

    // The API server goes down and comes back: the watches return over new connections, and a
    // change reaches its subscriber.
    fake.restart(Duration::from_millis(300)).await.unwrap();
    all_watched(&fake).await;
    fake.merge_patch(
        GV,
        "featureflags",
        "default",
        "ff-150",
        variant_patch("off"),
    )
    .unwrap();
    until(&mut streams[1], |r| {
        object(r)["metadata"]["name"] == "ff-150" && variant(r) == "off"
    })
    .await;
    let connections = connections_to(fake.addr().port());
    assert!((2..=3).contains(&connections), "{connections} connections");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_http2_is_spoken_to_over_http1() {
    let fake = tls_fake(false).await;
    let broker = broker(&fake, ApiHttp2::Auto).await;
    let mut streams = subscribe_all(&broker).await;
    all_watched(&fake).await;
    assert!(
        connections_to(fake.addr().port()) >= CRS,
        "a connection per watch"
    );
    assert!(fake.requests().iter().all(|r| r.version == "HTTP/1.1"));
    fake.merge_patch(GV, "featureflags", "default", "ff-3", variant_patch("off"))
        .unwrap();
    until(&mut streams[0], |r| {
        object(r)["metadata"]["name"] == "ff-3" && variant(r) == "off"
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_keeps_kubes_own_stack_one_connection_per_watch() {
    let fake = tls_fake(true).await;
    let broker = broker(&fake, ApiHttp2::Off).await;
    let _streams = subscribe_all(&broker).await;
    all_watched(&fake).await;
    assert!(connections_to(fake.addr().port()) >= CRS);
    assert!(fake.requests().iter().all(|r| r.version == "HTTP/1.1"));
}
