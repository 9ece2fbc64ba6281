//! The yardstick: a bare tonic server — stock `tonic::transport::Server` with its defaults but
//! for the broker's HTTP/2 keepalive (so both transports do the same work), the same
//! `crdbroker.v1.Broker/Subscribe` service and wire format, and none of the broker's logic.
//! It broadcasts pre-encoded messages to the streams of each resource; the harness feeds them on
//! stdin, one `name<TAB>json` line per message.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use crd_broker::grpc::frame::{Frame, encode_object};
use crd_broker::pb;
use crd_broker::pb::broker_server::{Broker, BrokerServer};
use crd_broker::pb::subscribe_response::Event;
use crd_broker::source::Object;
use futures::stream::{BoxStream, StreamExt};
use tokio::io::AsyncBufReadExt;
use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tonic::{Request, Response, Status};

type Channels = Arc<Mutex<HashMap<String, watch::Sender<Option<Bytes>>>>>;

struct Bare {
    channels: Channels,
}

fn channel(channels: &Channels, name: &str) -> watch::Sender<Option<Bytes>> {
    channels
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(name.to_string())
        .or_insert_with(|| watch::channel(None).0)
        .clone()
}

#[tonic::async_trait]
impl Broker for Bare {
    type SubscribeStream = BoxStream<'static, Result<Frame, Status>>;

    async fn subscribe(
        &self,
        request: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let name = request
            .into_inner()
            .resources
            .first()
            .map(|r| r.name.clone())
            .ok_or_else(|| Status::invalid_argument("no resource"))?;
        let rx = channel(&self.channels, &name).subscribe();
        let mut first = true;
        let frames = WatchStream::new(rx).filter_map(move |shared| {
            let event = if std::mem::take(&mut first) {
                Event::Snapshot
            } else {
                Event::Updated
            };
            futures::future::ready(shared.map(|shared| {
                Ok(Frame {
                    index: 0,
                    event,
                    shared,
                })
            }))
        });
        Ok(Response::new(frames.boxed()))
    }
}

/// Serves on `addr` until killed.
pub async fn run(addr: SocketAddr) -> anyhow::Result<()> {
    let channels: Channels = Arc::default();
    let feed = channels.clone();
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
        let mut seq = 0u64;
        while let Ok(Some(line)) = lines.next_line().await {
            let Some((name, json)) = line.split_once('\t') else {
                continue;
            };
            seq += 1;
            let object = Object {
                json: Bytes::from(json.to_string()),
                uid: "bare".into(),
                resource_version: seq.to_string(),
            };
            let selector = format!("featureflags.v1beta1.core.openfeature.dev/default/{name}");
            // Encoded once; every stream writes the same bytes.
            channel(&feed, name).send_replace(Some(encode_object(&selector, &object)));
        }
    });
    let (_, health) = tonic_health::server::health_reporter();
    let broker = crd_broker::transport::Config::default();
    tonic::transport::Server::builder()
        .http2_keepalive_interval(broker.keepalive_interval)
        .http2_keepalive_timeout(Some(broker.keepalive_timeout))
        .add_service(health)
        .add_service(BrokerServer::new(Bare { channels }))
        .serve(addr)
        .await?;
    Ok(())
}
