//! Server streams whose messages go to HTTP/2 without a copy per subscriber (ADR 0007).
//!
//! tonic's encoder copies each message into a buffer the stream keeps for life, sized to the
//! largest message it has sent: every subscriber copies every update, and an idle sidecar on a
//! 64 KiB FeatureFlag holds 64 KiB it will not use again. Here a message is its gRPC prefix and
//! the subscriber's own fields ([`WriteFrame::write_head`], a few bytes), then the shared part:
//! from `SHARE_FROM` (8 KiB) on, as the same [`Bytes`] every subscriber sends, which h2 writes from
//! where it is; below it, copied once into the message's own buffer.
//!
//! [`Streams`] routes the server-streaming methods here and everything else to tonic. Requests
//! are read as tonic reads them: one message, with the same decoder and size limit.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use http::HeaderMap;
use http_body::Frame as BodyFrame;
use tonic::codec::Streaming;
use tonic::metadata::{GRPC_CONTENT_TYPE, MetadataMap};
use tonic::{Request, Response, Status};
use tonic_prost::ProstDecoder;

use super::frame::{WriteFrame, stream_buffers};

/// A shared part shorter than this is copied after the head, so the message is one DATA frame.
/// A second frame through hyper and h2 costs more than copying a small object: in the hot-CR
/// load scenario (10 updates/s to every subscriber) copying was faster at 1 and 4 KiB, even at
/// 8 KiB, and slower at 16 KiB (docs/performance.md). The copy is the message's own and is
/// freed once written, so a stream still keeps no buffer.
const SHARE_FROM: usize = 8 * 1024;

/// The response body of one stream: each message as one or two chunks, then the status in the
/// trailers.
pub(crate) struct FrameBody<E> {
    messages: BoxStream<'static, Result<E, Status>>,
    /// The shared part of the message whose head was just sent.
    shared: Option<Bytes>,
    done: bool,
}

impl<E> FrameBody<E> {
    pub(crate) fn new(messages: BoxStream<'static, Result<E, Status>>) -> Self {
        FrameBody {
            messages,
            shared: None,
            done: false,
        }
    }
}

/// The trailers that end a stream with `status`.
fn trailers(status: &Status) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(2);
    if let Err(unwritable) = status.add_header(&mut headers) {
        // A message that cannot be a header value: say so rather than lose the code.
        headers.clear();
        let _ = Status::new(status.code(), unwritable.message()).add_header(&mut headers);
    }
    headers
}

/// `item` as it goes out: a first chunk of the gRPC prefix (uncompressed, the message's
/// length), the item's head and, when the shared part is short, the shared part too; then the
/// shared part, unless it was in the first chunk.
pub fn chunks<E: WriteFrame>(item: &E) -> (Bytes, Option<Bytes>) {
    let shared = item.shared();
    let inline = shared.len() < SHARE_FROM;
    let mut buf =
        BytesMut::with_capacity(5 + item.head_len_hint() + if inline { shared.len() } else { 0 });
    buf.put_bytes(0, 5);
    item.write_head(&mut buf);
    let len = buf.len() - 5 + shared.len();
    buf[1..5].copy_from_slice(&(len as u32).to_be_bytes());
    if inline {
        buf.put_slice(shared);
        (buf.freeze(), None)
    } else {
        (buf.freeze(), Some(shared.clone()))
    }
}

impl<E: WriteFrame> http_body::Body for FrameBody<E> {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<BodyFrame<Bytes>, Status>>> {
        if let Some(shared) = self.shared.take() {
            return Poll::Ready(Some(Ok(BodyFrame::data(shared))));
        }
        if self.done {
            return Poll::Ready(None);
        }
        let frame = match std::task::ready!(self.messages.as_mut().poll_next(cx)) {
            Some(Ok(item)) => {
                let (head, shared) = chunks(&item);
                self.shared = shared;
                BodyFrame::data(head)
            }
            Some(Err(status)) => {
                self.done = true;
                BodyFrame::trailers(trailers(&status))
            }
            None => {
                self.done = true;
                BodyFrame::trailers(trailers(&Status::ok("")))
            }
        };
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.shared.is_none()
    }
}

/// What a server-streaming handler returns.
pub(crate) type Answer<E> = Result<Response<BoxStream<'static, Result<E, Status>>>, Status>;

/// Reads the one request message of `request`, as tonic's server does.
async fn read_request<M>(request: http::Request<tonic::body::Body>) -> Result<Request<M>, Status>
where
    M: prost::Message + Default + Send + 'static,
{
    if let Some(encoding) = request.headers().get("grpc-encoding")
        && encoding != "identity"
    {
        return Err(Status::unimplemented(format!(
            "Content is compressed with `{}` which isn't supported",
            String::from_utf8_lossy(encoding.as_bytes())
        )));
    }
    let (parts, body) = request.into_parts();
    let mut stream =
        Streaming::new_request(ProstDecoder::<M>::new(stream_buffers()), body, None, None);
    let message = stream
        .message()
        .await?
        .ok_or_else(|| Status::internal("Missing request message."))?;
    let mut headers = parts.headers;
    if let Some(trailers) = stream.trailers().await? {
        headers.extend(trailers.into_headers());
    }
    Ok(Request::from_parts(
        MetadataMap::from_headers(headers),
        parts.extensions,
        message,
    ))
}

/// One server-streaming call: the request read, `handler` called, its messages written.
async fn call<M, E, H, F>(request: http::Request<tonic::body::Body>, handler: H) -> HttpResponse
where
    M: prost::Message + Default + Send + 'static,
    E: WriteFrame,
    H: FnOnce(Request<M>) -> F,
    F: Future<Output = Answer<E>>,
{
    let answer = match read_request(request).await {
        Ok(request) => handler(request).await,
        Err(status) => Err(status),
    };
    match answer {
        Ok(response) => {
            let (metadata, messages, extensions) = response.into_parts();
            let mut response =
                http::Response::new(tonic::body::Body::new(FrameBody::new(messages)));
            *response.headers_mut() = metadata.into_headers();
            response
                .headers_mut()
                .insert(http::header::CONTENT_TYPE, GRPC_CONTENT_TYPE);
            *response.extensions_mut() = extensions;
            response
        }
        Err(status) => status.into_http(),
    }
}

type HttpResponse = http::Response<tonic::body::Body>;

/// A method served here, by path.
type Route =
    Arc<dyn Fn(http::Request<tonic::body::Body>) -> BoxFuture<'static, HttpResponse> + Send + Sync>;

/// The gRPC service: the server-streaming methods routed here by path, every other path to
/// tonic's `inner`.
#[derive(Clone)]
pub struct Streams<S> {
    inner: S,
    routes: Arc<HashMap<&'static str, Route>>,
}

impl<S> Streams<S> {
    /// Every request to `inner`, until methods are routed here.
    pub fn new(inner: S) -> Self {
        Streams {
            inner,
            routes: Arc::default(),
        }
    }

    /// Serves the server-streaming method at `path` by `handler`.
    pub fn route<M, E, H, F>(mut self, path: &'static str, handler: H) -> Self
    where
        M: prost::Message + Default + Send + 'static,
        E: WriteFrame,
        H: Fn(Request<M>) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = Answer<E>> + Send + 'static,
    {
        let route: Route = Arc::new(move |request| Box::pin(call(request, handler.clone())));
        Arc::make_mut(&mut self.routes).insert(path, route);
        self
    }
}

impl<S> tower::Service<http::Request<tonic::body::Body>> for Streams<S>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = HttpResponse,
            Error = Infallible,
        >,
    S::Future: Send + 'static,
{
    type Response = HttpResponse;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<HttpResponse, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        match self.routes.get(request.uri().path()) {
            Some(route) => {
                let answer = route(request);
                Box::pin(async move { Ok(answer.await) })
            }
            None => Box::pin(self.inner.call(request)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::frame::{Encoded, Frame};
    use crate::pb;
    use futures::StreamExt;
    use pb::subscribe_response::Event;
    use prost::Message;

    async fn next(
        body: &mut (impl http_body::Body<Data = Bytes, Error = Status> + Unpin),
    ) -> Option<BodyFrame<Bytes>> {
        std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx))
            .await
            .map(|frame| frame.expect("a frame"))
    }

    /// Every frame of `body`: the data chunks, then the trailers.
    async fn frames(
        mut body: impl http_body::Body<Data = Bytes, Error = Status> + Unpin,
    ) -> (Vec<Bytes>, Option<HeaderMap>) {
        let (mut chunks, mut trailers) = (Vec::new(), None);
        while let Some(frame) = next(&mut body).await {
            assert!(trailers.is_none(), "a frame after the trailers");
            match frame.into_data() {
                Ok(data) => chunks.push(data),
                Err(frame) => trailers = Some(frame.into_trailers().expect("trailers")),
            }
        }
        (chunks, trailers)
    }

    fn frame(index: u32, event: Event, shared_len: usize) -> Frame {
        let object = crate::source::Object {
            json: Bytes::from(format!(r#"{{"pad":"{}"}}"#, "x".repeat(shared_len))),
            uid: "u-1".into(),
            resource_version: "7".into(),
        };
        Frame {
            index,
            event,
            shared: crate::grpc::frame::encode_object("featureflags/default/demo", &object),
        }
    }

    /// The messages in `chunks`, each checked against its gRPC prefix.
    fn messages(chunks: &[Bytes]) -> Vec<Vec<u8>> {
        let all: Vec<u8> = chunks.iter().flat_map(|c| c.to_vec()).collect();
        let (mut rest, mut out) = (&all[..], Vec::new());
        while !rest.is_empty() {
            assert_eq!(rest[0], 0, "uncompressed");
            let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
            out.push(rest[5..5 + len].to_vec());
            rest = &rest[5 + len..];
        }
        out
    }

    #[tokio::test]
    async fn a_large_shared_part_goes_out_as_the_same_bytes_and_a_small_one_in_one_chunk() {
        let large = frame(3, Event::Updated, SHARE_FROM);
        let small = frame(0, Event::Snapshot, 1024);
        let stream = futures::stream::iter([Ok(large.clone()), Ok(small.clone())]).boxed();
        let (chunks, trailers) = frames(FrameBody::new(stream)).await;
        assert_eq!(chunks.len(), 3, "head and shared part, then one chunk");
        assert_eq!(chunks[1].as_ptr(), large.shared.as_ptr(), "not copied");
        assert_eq!(chunks[1].len(), large.shared.len());
        let sent = messages(&chunks);
        for (message, frame) in sent.iter().zip([&large, &small]) {
            let mut whole = Vec::new();
            frame.write(&mut whole);
            assert_eq!(message, &whole, "what the codec writes");
            let decoded = pb::SubscribeResponse::decode(&message[..]).unwrap();
            assert_eq!((decoded.index, decoded.event()), (frame.index, frame.event));
            assert_eq!(decoded.resource_version, "7");
        }
        let trailers = trailers.expect("trailers");
        assert_eq!(trailers["grpc-status"], "0");
        assert!(trailers.get("grpc-message").is_none());
    }

    #[tokio::test]
    async fn an_error_ends_the_stream_with_its_status_in_the_trailers() {
        let stream = futures::stream::iter([
            Ok(Encoded(Bytes::from_static(b"\x0a\x01a"))),
            Err(Status::unavailable("the broker is draining; reconnect")),
            Ok(Encoded(Bytes::from_static(b"never"))),
        ])
        .boxed();
        let (chunks, trailers) = frames(FrameBody::new(stream)).await;
        assert_eq!(messages(&chunks), vec![b"\x0a\x01a".to_vec()]);
        let trailers = trailers.expect("trailers");
        assert_eq!(trailers["grpc-status"], "14");
        assert_eq!(
            trailers["grpc-message"],
            "the%20broker%20is%20draining;%20reconnect"
        );
    }

    /// A request body of `bytes`, then its end.
    struct Once(Option<Bytes>);

    impl http_body::Body for Once {
        type Data = Bytes;
        type Error = Status;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<BodyFrame<Bytes>, Status>>> {
            Poll::Ready(self.0.take().map(|b| Ok(BodyFrame::data(b))))
        }
    }

    fn request(path: &str, message: Option<&[u8]>) -> http::Request<tonic::body::Body> {
        let body = message.map(|m| {
            let mut framed = vec![0];
            framed.extend((m.len() as u32).to_be_bytes());
            framed.extend(m);
            Bytes::from(framed)
        });
        http::Request::builder()
            .uri(format!("http://broker{path}"))
            .header("content-type", "application/grpc")
            .header("x-caller", "test")
            .body(tonic::body::Body::new(Once(body)))
            .unwrap()
    }

    /// Answers every path with UNIMPLEMENTED, as tonic does for one it does not serve.
    #[derive(Clone)]
    struct Tonic;

    impl tower::Service<http::Request<tonic::body::Body>> for Tonic {
        type Response = HttpResponse;
        type Error = Infallible;
        type Future = std::future::Ready<Result<HttpResponse, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<tonic::body::Body>) -> Self::Future {
            std::future::ready(Ok(Status::unimplemented("tonic").into_http()))
        }
    }

    fn streams() -> Streams<Tonic> {
        Streams::new(Tonic).route(
            "/test/Stream",
            |request: Request<pb::SubscribeRequest>| async move {
                let caller = request.metadata().get("x-caller").cloned();
                let names: Vec<_> = request
                    .into_inner()
                    .resources
                    .into_iter()
                    .map(|r| r.name)
                    .collect();
                if names.is_empty() {
                    return Err(Status::invalid_argument("name a resource"));
                }
                assert_eq!(caller.unwrap(), "test", "the request's metadata");
                let frames = names.into_iter().map(|name| Ok(Encoded(Bytes::from(name))));
                Ok(Response::new(futures::stream::iter(frames).boxed()))
            },
        )
    }

    async fn call(path: &str, message: Option<&[u8]>) -> HttpResponse {
        let mut streams = streams();
        tower::Service::call(&mut streams, request(path, message))
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_routed_method_streams_and_every_other_path_goes_to_tonic() {
        let asked = pb::SubscribeRequest {
            resources: vec![
                pb::ResourceRef {
                    name: "a".into(),
                    ..Default::default()
                },
                pb::ResourceRef {
                    name: "b".into(),
                    ..Default::default()
                },
            ],
        }
        .encode_to_vec();
        let response = call("/test/Stream", Some(&asked)).await;
        assert_eq!(response.headers()["content-type"], "application/grpc");
        assert!(
            response.headers().get("grpc-status").is_none(),
            "not trailers-only"
        );
        let (chunks, trailers) = frames(response.into_body()).await;
        assert_eq!(messages(&chunks), vec![b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(trailers.unwrap()["grpc-status"], "0");

        let other = call("/test/Other", Some(&asked)).await;
        assert_eq!(other.headers()["grpc-status"], "12");
    }

    #[tokio::test]
    async fn bad_requests_get_a_trailers_only_status() {
        let status = |r: &HttpResponse| Status::from_header_map(r.headers()).expect("a status");
        let refused = call(
            "/test/Stream",
            Some(&pb::SubscribeRequest::default().encode_to_vec()),
        )
        .await;
        assert_eq!(status(&refused).code(), tonic::Code::InvalidArgument);
        assert_eq!(status(&refused).message(), "name a resource");

        let missing = call("/test/Stream", None).await;
        assert_eq!(status(&missing).code(), tonic::Code::Internal);
        assert_eq!(status(&missing).message(), "Missing request message.");

        let garbage = call("/test/Stream", Some(b"\xff\xff\xff")).await;
        assert_eq!(status(&garbage).code(), tonic::Code::Internal);

        let mut compressed = request("/test/Stream", Some(b""));
        compressed
            .headers_mut()
            .insert("grpc-encoding", "gzip".parse().unwrap());
        let compressed = tower::Service::call(&mut streams(), compressed)
            .await
            .unwrap();
        assert_eq!(status(&compressed).code(), tonic::Code::Unimplemented);
        assert!(status(&compressed).message().contains("gzip"));
    }
}
