//! Following one object: a LIST and a WATCH with `fieldSelector=metadata.name=…`, resumed from
//! the last resourceVersion seen, relisted only when the API server says that version is gone
//! (410), and retried with the broker's own backoff (ADR 0013) rather than kube's watcher:
//!
//! - the backoff restarts once a watch has held ([`Backoff`]), not only when an event arrives, so
//!   a quiet object that keeps meeting faults is not left unwatched for half a minute;
//! - a watch that cannot reach the API server waits on the shared [`Recovery`], and returns
//!   within moments of the server's return, spread out;
//! - relists are quorum reads (no `resourceVersion=0`), so they never answer with an older object
//!   than one already reported, and an object older than the last one reported for the same uid is
//!   dropped all the same;
//! - after errors, the state is reported again once the watch works, so the registry knows the
//!   resource is current again.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::{self, BoxStream};
use kube::api::{Api, DynamicObject, ListParams, WatchEvent, WatchParams};
use tokio::time::Instant;

use super::{api_error, to_object};
use crate::source::retry::{Backoff, Recovery};
use crate::source::{Observed, SourceError};

/// How long the API server keeps one watch open before it ends it and the watch resumes (kube's
/// watcher asks the same, under the server's 5–10 minute default).
const WATCH_TIMEOUT_SECONDS: u32 = 290;

/// The longest a LIST, or a WATCH's response headers, may take: a request the API server
/// accepted and never answers is abandoned and retried (kube's read timeout, meant for quiet
/// watch bodies, is minutes).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A watch that ends sooner than this without an error counts as a failure for the backoff, so
/// a server that closes every watch at once is not asked again in a tight loop.
const SHORT_WATCH: Duration = Duration::from_secs(1);

/// Follows the object `name` through `api`; `what` names it in errors.
pub fn follow(
    api: Api<DynamicObject>,
    name: &str,
    what: String,
    recovery: Arc<Recovery>,
) -> BoxStream<'static, Result<Observed, SourceError>> {
    let field = format!("metadata.name={name}");
    let state = Follow {
        list: ListParams::default().fields(&field),
        watch: WatchParams::default()
            .fields(&field)
            .timeout(WATCH_TIMEOUT_SECONDS),
        api,
        what,
        recovery,
        phase: Phase::List,
        backoff: Backoff::default(),
        wait: None,
        last: None,
        failing: false,
    };
    stream::unfold(state, Follow::next).boxed()
}

enum Phase {
    /// LIST next.
    List,
    /// Start a WATCH from this resourceVersion next.
    Watch(String),
    /// A WATCH is streaming.
    Streaming {
        rv: String,
        events: BoxStream<'static, kube::Result<WatchEvent<DynamicObject>>>,
        started: Instant,
    },
}

struct Follow {
    api: Api<DynamicObject>,
    list: ListParams,
    watch: WatchParams,
    what: String,
    recovery: Arc<Recovery>,
    phase: Phase,
    backoff: Backoff,
    /// Wait this long before the next request; `true` if the API server could not be reached.
    wait: Option<(Duration, bool)>,
    /// The state last reported.
    last: Option<Observed>,
    /// Whether an error was reported since the state last was.
    failing: bool,
}

type Item = Result<Observed, SourceError>;

impl Follow {
    async fn next(mut self) -> Option<(Item, Follow)> {
        loop {
            if let Some((delay, unreachable)) = self.wait.take() {
                if unreachable {
                    self.recovery.wait(delay).await;
                } else {
                    tokio::time::sleep(delay).await;
                }
            }
            match std::mem::replace(&mut self.phase, Phase::List) {
                Phase::List => match bounded(self.api.list(&self.list)).await {
                    Ok(list) => {
                        self.backoff.working();
                        let rv = list.metadata.resource_version.unwrap_or_default();
                        self.phase = Phase::Watch(rv);
                        let observed = match list.items.first() {
                            Some(obj) => Observed::Present(to_object(obj)),
                            None => Observed::Absent,
                        };
                        if let Some(item) = self.report(observed) {
                            return Some((item, self));
                        }
                    }
                    Err(e) => return Some((self.fail(e, Phase::List), self)),
                },
                Phase::Watch(rv) => match bounded(self.api.watch(&self.watch, &rv)).await {
                    Ok(events) => {
                        self.backoff.working();
                        self.phase = Phase::Streaming {
                            rv,
                            events: events.boxed(),
                            started: Instant::now(),
                        };
                        // It works again: say so with the state it had, which still holds.
                        if self.failing
                            && let Some(last) = self.last.clone()
                        {
                            self.failing = false;
                            return Some((Ok(last), self));
                        }
                    }
                    Err(kube::Error::Api(s)) if s.code == 410 => self.phase = Phase::List,
                    Err(e) => return Some((self.fail(e, Phase::Watch(rv)), self)),
                },
                Phase::Streaming {
                    mut rv,
                    mut events,
                    started,
                } => match events.next().await {
                    Some(Ok(event)) => {
                        let observed = match event {
                            WatchEvent::Added(obj) | WatchEvent::Modified(obj) => {
                                rv = obj.metadata.resource_version.clone().unwrap_or(rv);
                                Some(Observed::Present(to_object(&obj)))
                            }
                            WatchEvent::Deleted(obj) => {
                                rv = obj.metadata.resource_version.clone().unwrap_or(rv);
                                Some(Observed::Absent)
                            }
                            WatchEvent::Bookmark(b) => {
                                rv = b.metadata.resource_version;
                                None
                            }
                            WatchEvent::Error(s) if s.code == 410 => {
                                // Compacted past our version: start over from a fresh list.
                                continue;
                            }
                            WatchEvent::Error(s) => {
                                return Some((
                                    self.fail(kube::Error::Api(s), Phase::Watch(rv)),
                                    self,
                                ));
                            }
                        };
                        self.phase = Phase::Streaming {
                            rv,
                            events,
                            started,
                        };
                        if let Some(item) = observed.and_then(|o| self.report(o)) {
                            return Some((item, self));
                        }
                    }
                    Some(Err(e)) => return Some((self.fail(e, Phase::Watch(rv)), self)),
                    None => {
                        // The server ended the watch (its timeout): resume where it ended.
                        if started.elapsed() < SHORT_WATCH {
                            self.wait = Some((self.backoff.failed(), false));
                        }
                        self.phase = Phase::Watch(rv);
                    }
                },
            }
        }
    }

    /// The item reporting `observed`, unless it is older than what was reported (the same
    /// object at a lower resourceVersion).
    fn report(&mut self, observed: Observed) -> Option<Item> {
        if let (Some(Observed::Present(last)), Observed::Present(now)) = (&self.last, &observed)
            && last.uid == now.uid
            && older(&now.resource_version, &last.resource_version)
        {
            tracing::debug!(
                was = %last.resource_version,
                now = %now.resource_version,
                "an older state than the one reported; dropped"
            );
            return None;
        }
        self.failing = false;
        self.last = Some(observed.clone());
        Some(Ok(observed))
    }

    /// Records a failure of the request in `retry`, to be retried after the backoff.
    fn fail(&mut self, error: kube::Error, retry: Phase) -> Item {
        let error = api_error(error, &self.what);
        let unreachable = matches!(error, SourceError::Unavailable(_));
        self.wait = Some((self.backoff.failed(), unreachable));
        self.phase = retry;
        self.failing = true;
        Err(error)
    }
}

/// `request`, failing with a timeout after [`REQUEST_TIMEOUT`].
async fn bounded<T>(request: impl Future<Output = kube::Result<T>>) -> kube::Result<T> {
    match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
        Ok(answer) => answer,
        Err(_) => Err(kube::Error::Service(
            format!("no answer within {REQUEST_TIMEOUT:?}").into(),
        )),
    }
}

/// Whether resourceVersion `a` is older than `b`. They are opaque strings by contract, but
/// integers (etcd revisions) on every API server; strings that are not are never called older.
fn older(a: &str, b: &str) -> bool {
    match (a.parse::<u64>(), b.parse::<u64>()) {
        (Ok(a), Ok(b)) => a < b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn resource_versions_compare_as_integers_or_not_at_all() {
        assert!(super::older("9", "10"));
        assert!(!super::older("10", "9"));
        assert!(!super::older("10", "10"));
        assert!(!super::older("a", "10"));
    }
}
