//! [`Authenticate`]: the per-connection layer that identifies the caller of every data-service
//! request before the service sees it.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;

use super::{Access, ConnIdentity};

/// Paths any client may call unidentified: health (kubelet probes come from the node) and
/// reflection (the schema is public).
const OPEN: &[&str] = &["/grpc.health.v1.", "/grpc.reflection."];

/// Identifies the caller of each request on one connection and puts it in the request's
/// extensions, or answers UNAUTHENTICATED (UNAVAILABLE) itself.
#[derive(Clone)]
pub struct Authenticate<S> {
    access: Arc<Access>,
    conn: Arc<ConnIdentity>,
    inner: S,
}

impl<S> Authenticate<S> {
    /// Wraps the service of a connection whose state is `conn`.
    pub fn new(access: Arc<Access>, conn: Arc<ConnIdentity>, inner: S) -> Self {
        Authenticate {
            access,
            conn,
            inner,
        }
    }
}

impl<S, B> tower::Service<http::Request<B>> for Authenticate<S>
where
    S: tower::Service<
            http::Request<B>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        if OPEN.iter().any(|p| request.uri().path().starts_with(p)) {
            return Box::pin(self.inner.call(request));
        }
        // The clone is ready only after poll_ready; swap so the ready one is used.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let access = self.access.clone();
        let conn = self.conn.clone();
        Box::pin(async move {
            match access.identify(&conn, request.headers()).await {
                Ok(caller) => {
                    request.extensions_mut().insert(caller);
                    inner.call(request).await
                }
                Err(status) => Ok(status.into_http()),
            }
        })
    }
}
