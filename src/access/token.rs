//! Bearer tokens, reviewed by the API server: the one [`Reviewer`] both ports share — the gRPC
//! port's `token` identity source ([`Tokens`], a token made for the broker's audiences, a
//! service account's) and the admin port's guard (a token for the API server itself, any user's,
//! then asked whether that user may read the path).
//!
//! Tokens are remembered by their SHA-256 and the audience asked for, never the token itself. Verified ones are kept apart
//! until the token expires, at most [`MAX_TTL`]: only a review that verified a token adds to
//! them, so a flood of made-up tokens cannot evict them. Refusals are remembered for
//! [`REFUSED_TTL`] (a client repeating a bad token costs one review per that long), in a bounded
//! cache of their own. And a token nobody has shown yet costs a review only within its source's
//! rate ([`REVIEW_RATE`] a second, [`REVIEW_BURST`] at once, per source address: every caller
//! behind one proxy address shares that address's); past it the caller is refused with
//! RESOURCE_EXHAUSTED before the API server is asked. Whatever the sources, at most
//! [`MAX_REVIEWS_IN_FLIGHT`] reviews are asked at once: a flood from many sources waits for
//! room, and past [`ROOM_WAIT`] is refused the same way.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::FutureExt;
use k8s_openapi::api::authentication::v1::{
    TokenReview, TokenReviewSpec, TokenReviewStatus, UserInfo,
};
use kube::api::{Api, PostParams};

use super::caller::{PodRef, Workload};
use crate::cache::FlightCache;
use crate::sync::lock;

/// The longest a verified token is trusted without asking again.
pub const MAX_TTL: Duration = Duration::from_secs(300);

/// How long a refused token stays refused without asking again.
pub const REFUSED_TTL: Duration = Duration::from_secs(10);

/// How many refused tokens are remembered, and how many verified ones.
const CAPACITY: usize = 10_000;

/// New tokens (neither verified nor refused lately) one source address may have reviewed per
/// second, and at once: a pod's sidecars reconnecting together fit the burst many times over.
pub const REVIEW_RATE: f64 = 10.0;
/// See [`REVIEW_RATE`].
pub const REVIEW_BURST: f64 = 100.0;

/// The longest a review may take.
pub(crate) const REVIEW_TIMEOUT: Duration = Duration::from_secs(10);

/// The most TokenReviews asked at once, from every source together.
pub const MAX_REVIEWS_IN_FLIGHT: usize = 32;
/// How long a review waits for room among [`MAX_REVIEWS_IN_FLIGHT`] before its caller is
/// refused.
pub const ROOM_WAIT: Duration = Duration::from_secs(1);

/// The longest token looked at (projected tokens are about 1 KiB).
pub const MAX_TOKEN: usize = 16 * 1024;

/// Whom a token must have been made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Audience {
    /// The broker (`--token-audience`): what sidecars send on the gRPC port.
    Broker,
    /// The API server itself: what users send the admin port, as to the API server.
    ApiServer,
}

/// What the API server said of a token.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// Whose it is.
    User(UserInfo),
    /// It is not one for the audience: why.
    Refused(String),
    /// The review failed: why.
    Failed(String),
    /// Not reviewed: its source has had too many new tokens reviewed lately, or too many are
    /// under review at once.
    Limited(String),
}

/// What a review for the gRPC port said.
#[derive(Debug, Clone, PartialEq)]
pub enum Reviewed {
    /// The token is a service account's (with its pod, for a pod-bound token).
    ServiceAccount(Workload),
    /// It is not: why.
    Refused(String),
    /// The review failed: why.
    Failed(String),
    /// Not reviewed: its source has had too many new tokens reviewed lately.
    Limited(String),
}

/// A token by its digest, and the audience it was reviewed for.
type Key = ([u8; 32], Audience);

/// Verified tokens, until each expires.
#[derive(Default)]
struct Verified(Mutex<HashMap<Key, (UserInfo, tokio::time::Instant)>>);

impl Verified {
    fn get(&self, key: &Key) -> Option<UserInfo> {
        let map = lock(&self.0);
        let (user, until) = map.get(key)?;
        (*until > tokio::time::Instant::now()).then(|| user.clone())
    }

    /// Remembers a verified token; when full, the expired ones go first, then those expiring
    /// soonest (all verified: a real token is never pushed out by a made-up one).
    fn insert(&self, key: Key, user: UserInfo, ttl: Duration) {
        let now = tokio::time::Instant::now();
        let mut map = lock(&self.0);
        if map.len() >= CAPACITY && !map.contains_key(&key) {
            map.retain(|_, (_, until)| *until > now);
            while map.len() >= CAPACITY {
                let soonest = map
                    .iter()
                    .min_by_key(|(_, (_, until))| *until)
                    .map(|(k, _)| *k);
                let Some(soonest) = soonest else { break };
                map.remove(&soonest);
            }
        }
        map.insert(key, (user, now + ttl));
    }
}

/// Token reviews, remembered and rate-limited: one for the whole broker.
pub struct Reviewer {
    client: kube::Client,
    /// The broker's audiences (`--token-audience`).
    audiences: Vec<String>,
    verified: Arc<Verified>,
    /// Refusals, and the reviews in flight.
    others: FlightCache<Key, Answer>,
    rates: crate::access::limits::Rates,
    in_flight: Arc<tokio::sync::Semaphore>,
    reviews: Arc<AtomicU64>,
}

impl Reviewer {
    /// Reviews through `client`; a token for the broker must be for one of `audiences`.
    pub fn new(client: kube::Client, audiences: Vec<String>) -> Self {
        Reviewer {
            client,
            audiences,
            verified: Arc::default(),
            others: FlightCache::new(CAPACITY),
            rates: crate::access::limits::Rates::new(REVIEW_RATE, REVIEW_BURST),
            in_flight: Arc::new(tokio::sync::Semaphore::new(MAX_REVIEWS_IN_FLIGHT)),
            reviews: Arc::default(),
        }
    }

    /// Reviews made so far (API requests).
    pub fn reviews(&self) -> u64 {
        self.reviews.load(Ordering::Relaxed)
    }

    /// Whose `token` is, as one made for `audience`, `source` (the caller's address, or its
    /// connection where the address stands for many) sending it.
    pub async fn review(&self, token: &str, source: &str, audience: Audience) -> Answer {
        if token.len() > MAX_TOKEN {
            return Answer::Refused(format!(
                "the bearer token is {} bytes, longer than any Kubernetes token",
                token.len()
            ));
        }
        let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
        let mut key = ([0u8; 32], audience);
        key.0.copy_from_slice(digest.as_ref());
        if let Some(user) = self.verified.get(&key) {
            return Answer::User(user);
        }
        // A refusal remembered, or a review in flight, costs no new review.
        if !self.others.holds(&key) && !self.rates.take(source) {
            return Answer::Limited(format!(
                "{source} has shown more new bearer tokens than the broker reviews for one \
                 source ({REVIEW_RATE} a second, {REVIEW_BURST} at once); retry later"
            ));
        }
        let client = self.client.clone();
        let audiences = match audience {
            Audience::Broker => Some(self.audiences.clone()),
            Audience::ApiServer => None,
        };
        let reviews = self.reviews.clone();
        let verified = self.verified.clone();
        let in_flight = self.in_flight.clone();
        let token = token.to_string();
        self.others
            .get(&key, move || {
                async move {
                    let room = tokio::time::timeout(ROOM_WAIT, in_flight.acquire_owned()).await;
                    let Ok(Ok(_room)) = room else {
                        let why = format!(
                            "the broker is reviewing {MAX_REVIEWS_IN_FLIGHT} bearer tokens at once, \
                             the most it asks the API server; retry later"
                        );
                        return (Answer::Limited(why), Duration::ZERO);
                    };
                    reviews.fetch_add(1, Ordering::Relaxed);
                    let answer = review(client, &token, audiences).await;
                    let ttl = match &answer {
                        Answer::User(user) => {
                            let ttl = expiry(&token)
                                .and_then(|exp| exp.duration_since(SystemTime::now()).ok())
                                .unwrap_or(MAX_TTL)
                                .min(MAX_TTL);
                            // Kept apart from refusals, before the askers have the answer.
                            verified.insert(key, user.clone(), ttl);
                            Duration::ZERO
                        }
                        Answer::Refused(_) => REFUSED_TTL,
                        Answer::Failed(_) | Answer::Limited(_) => Duration::ZERO,
                    };
                    (answer, ttl)
                }
                .boxed()
            })
            .await
    }
}

/// The token of an `authorization` header's value, `Bearer <token>`.
pub fn bearer(value: &str) -> Option<&str> {
    value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// The `token` identity source: a service account's token, made for the broker.
pub struct Tokens(Arc<Reviewer>);

impl Tokens {
    /// Tokens reviewed by `reviewer`.
    pub fn new(reviewer: Arc<Reviewer>) -> Self {
        Tokens(reviewer)
    }

    /// Reviews made so far (API requests), for either port.
    pub fn reviews(&self) -> u64 {
        self.0.reviews()
    }

    /// Whose service account `token` is, `source` sending it (see [`Reviewer::review`]).
    pub async fn review(&self, token: &str, source: &str) -> Reviewed {
        match self.0.review(token, source, Audience::Broker).await {
            Answer::User(user) => service_account(user),
            Answer::Refused(why) => Reviewed::Refused(why),
            Answer::Failed(why) => Reviewed::Failed(why),
            Answer::Limited(why) => Reviewed::Limited(why),
        }
    }
}

/// The workload a user is, if it is a service account's (with its pod, for a pod-bound token).
fn service_account(user: UserInfo) -> Reviewed {
    let username = user.username.unwrap_or_default();
    let Some((namespace, service_account)) = username
        .strip_prefix("system:serviceaccount:")
        .and_then(|rest| rest.split_once(':'))
    else {
        return Reviewed::Refused(format!(
            "the bearer token is user {}'s, not a service account's",
            crate::selector::quote(&username)
        ));
    };
    let extra = user.extra.unwrap_or_default();
    let first = |key: &str| extra.get(key).and_then(|v| v.first()).cloned();
    let pod = match (
        first("authentication.kubernetes.io/pod-name"),
        first("authentication.kubernetes.io/pod-uid"),
    ) {
        (Some(name), Some(uid)) => Some(PodRef { name, uid }),
        _ => None,
    };
    Reviewed::ServiceAccount(Workload {
        namespace: namespace.to_string(),
        service_account: service_account.to_string(),
        pod,
        instance: None,
    })
}

/// A TokenReview of `token` for `audiences` (`None`: the API server's own), bounded in time:
/// what it says, or why it could not be asked.
pub(crate) async fn token_review(
    client: kube::Client,
    token: &str,
    audiences: Option<Vec<String>>,
) -> Result<TokenReviewStatus, String> {
    let reviews: Api<TokenReview> = Api::all(client);
    let request = TokenReview {
        spec: TokenReviewSpec {
            token: token.to_string(),
            audiences,
        },
        ..TokenReview::default()
    };
    let params = PostParams::default();
    let answer = tokio::time::timeout(REVIEW_TIMEOUT, reviews.create(&params, &request));
    match answer.await {
        Ok(Ok(review)) => Ok(review.status.unwrap_or_default()),
        Ok(Err(kube::Error::Api(s))) => {
            tracing::warn!(code = s.code, message = %s.message, "a TokenReview failed");
            Err(format!("the TokenReview failed ({} {})", s.code, s.reason))
        }
        Ok(Err(e)) => Err(format!("the TokenReview failed ({e})")),
        Err(_) => Err(format!(
            "the TokenReview did not answer within {REVIEW_TIMEOUT:?}"
        )),
    }
}

/// The review of `token` for `audiences` (`None`: the API server's own).
async fn review(client: kube::Client, token: &str, audiences: Option<Vec<String>>) -> Answer {
    let status = match token_review(client, token, audiences.clone()).await {
        Ok(status) => status,
        Err(why) => return Answer::Failed(why),
    };
    if status.authenticated != Some(true) {
        // The API server's error says why (expired, wrong audience); it is about the caller's
        // own token, so it may be passed on, bounded.
        let why = status.error.unwrap_or_else(|| "not authenticated".into());
        return Answer::Refused(format!(
            "the bearer token was refused: {}",
            crate::selector::quote(&why)
        ));
    }
    // An authenticator that does not check audiences answers without them, and the token may
    // then be one for the API server itself (which any pod's default token is): only a review
    // that names one of the broker's audiences says the token was made for the broker.
    if let Some(audiences) = audiences {
        let confirmed = status.audiences.unwrap_or_default();
        if !confirmed.iter().any(|a| audiences.contains(a)) {
            return Answer::Refused(format!(
                "the TokenReview did not confirm the bearer token is for {} (it named {}): the \
                 API server's authenticator may not check audiences",
                audiences.join(", "),
                crate::selector::quote(&confirmed.join(", "))
            ));
        }
    }
    Answer::User(status.user.unwrap_or_default())
}

/// A JWT's `exp` claim, read without verifying (the API server has just verified the token).
pub fn expiry(token: &str) -> Option<SystemTime> {
    use base64::Engine;
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let exp = claims["exp"].as_u64()?;
    Some(UNIX_EPOCH + Duration::from_secs(exp))
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    fn jwt(claims: serde_json::Value) -> String {
        let b64 = |v: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
        format!(
            "{}.{}.{}",
            b64(br#"{"alg":"RS256"}"#),
            b64(claims.to_string().as_bytes()),
            b64(b"signature")
        )
    }

    #[test]
    fn a_jwt_says_when_it_expires() {
        let token = jwt(serde_json::json!({ "exp": 2_000_000_000u64, "sub": "x" }));
        assert_eq!(
            expiry(&token),
            Some(UNIX_EPOCH + Duration::from_secs(2_000_000_000))
        );
        assert_eq!(expiry("opaque-token"), None);
        assert_eq!(expiry(&jwt(serde_json::json!({ "sub": "x" }))), None);
        assert_eq!(expiry("a.!!!.c"), None);
    }
}
