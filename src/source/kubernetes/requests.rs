//! Counts the broker's requests to the API server by verb and status code, and times them to
//! their response headers: a tower layer under every kube client the broker builds.

use std::task::{Context, Poll};
use std::time::Instant;

use futures::future::BoxFuture;
use http::{Method, Request, Response};

use crate::telemetry::{ApiRequestLabels, ApiRequests, ApiVerbLabels};

/// The layer.
#[derive(Clone)]
pub struct Count(pub ApiRequests);

impl<S> tower::Layer<S> for Count {
    type Service = Counted<S>;

    fn layer(&self, inner: S) -> Counted<S> {
        Counted {
            inner,
            requests: self.0.clone(),
        }
    }
}

/// A service whose requests are counted.
#[derive(Clone)]
pub struct Counted<S> {
    inner: S,
    requests: ApiRequests,
}

impl<S, B, R> tower::Service<Request<B>> for Counted<S>
where
    S: tower::Service<Request<B>, Response = Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let verb = verb(
            request.method(),
            request.uri().path(),
            request.uri().query().unwrap_or_default(),
        );
        let requests = self.requests.clone();
        let started = Instant::now();
        let answer = self.inner.call(request);
        Box::pin(async move {
            let answer = answer.await;
            let code = match &answer {
                Ok(response) => response.status().as_u16().to_string(),
                Err(_) => "error".to_string(),
            };
            requests
                .seconds
                .get_or_create(&ApiVerbLabels { verb })
                .observe(started.elapsed().as_secs_f64());
            requests
                .requests
                .get_or_create(&ApiRequestLabels { verb, code })
                .inc();
            answer
        })
    }
}

/// What a request to the API server does, as Kubernetes names its verbs: `get` (one object),
/// `list` and `watch` (a collection), `create`, `discovery` (`/api`, `/apis` and group
/// versions), `version`, or `other`.
pub(super) fn verb(method: &Method, path: &str, query: &str) -> &'static str {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let rest = match segments.as_slice() {
        ["version"] => return "version",
        ["api"] | ["apis"] | ["api", _] | ["apis", _] | ["apis", _, _] => return "discovery",
        ["api", _, rest @ ..] => rest,
        ["apis", _, _, rest @ ..] => rest,
        _ => return "other",
    };
    let rest = match rest {
        ["namespaces", _, tail @ ..] if !tail.is_empty() => tail,
        other => other,
    };
    let watching = query
        .split('&')
        .any(|p| p == "watch=true" || p == "watch=1");
    match (method, rest.len()) {
        (&Method::GET, 1) if watching => "watch",
        (&Method::GET, 1) => "list",
        (&Method::GET, n) if n >= 2 => "get",
        (&Method::POST, 1) => "create",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_named_by_their_kubernetes_verb() {
        let get = Method::GET;
        for (method, path, query, want) in [
            (&get, "/version", "", "version"),
            (&get, "/apis", "", "discovery"),
            (&get, "/api/v1", "", "discovery"),
            (&get, "/apis/core.openfeature.dev/v1beta1", "", "discovery"),
            (
                &get,
                "/apis/core.openfeature.dev/v1beta1/namespaces/default/featureflags",
                "fieldSelector=metadata.name%3Ddemo",
                "list",
            ),
            (
                &get,
                "/apis/core.openfeature.dev/v1beta1/namespaces/default/featureflags",
                "watch=true&resourceVersion=5",
                "watch",
            ),
            (
                &get,
                "/apis/core.openfeature.dev/v1beta1/namespaces/default/featureflags/demo",
                "",
                "get",
            ),
            (
                &get,
                "/api/v1/pods",
                "fieldSelector=status.podIP%3D10.0.0.1",
                "list",
            ),
            (&get, "/api/v1/namespaces", "", "list"),
            (&get, "/api/v1/namespaces/default", "", "get"),
            (
                &Method::POST,
                "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                "",
                "create",
            ),
            (
                &Method::DELETE,
                "/api/v1/namespaces/default/pods/p",
                "",
                "other",
            ),
            (&get, "/healthz", "", "other"),
        ] {
            assert_eq!(verb(method, path, query), want, "{method} {path}?{query}");
        }
    }
}
