//! Following one object: a LIST and a WATCH with `fieldSelector=metadata.name=…`, resumed from
//! the last resourceVersion seen, relisted when the API server says that version is gone (410)
//! or ends a watch with any other error in its stream, and retried with the broker's own
//! backoff (ADR 0013) rather than kube's watcher:
//!
//! - the backoff restarts once a watch has held ([`Backoff`]), not only when an event arrives, so
//!   a quiet object that keeps meeting faults is not left unwatched for half a minute;
//! - a watch that cannot reach the API server waits on the shared [`Recovery`], and returns
//!   within moments of the server's return, spread out;
//! - while the server refuses a watch (403, 404), only one watch of its collection asks again and
//!   the others wait for it ([`Refusals`]); once refusals, or failures (5xx), have lasted
//!   [`PERSISTENT`] with no request getting through, that one backs off to 30 s, as client-go
//!   does, but for one watch of the kind, whose success wakes every collection of the kind;
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

use super::convert::{api_error, to_object};
use super::http::Pinged;
use crate::source::retry::{Backoff, Recovery, Refusals, Turn};
use crate::source::{Object, Observed, SourceError};

/// How long the API server keeps one watch open before it ends it and the watch resumes, over
/// pinged connections (kube's watcher asks the same, under the server's 5–10 minute default).
const WATCH_TIMEOUT_SECONDS: u32 = 290;

/// The same over connections nothing pings (HTTP/1.1): short, since on a quiet watch the
/// server's bookmark 2 s before the end, and the end, are what show its connection alive.
const UNPINGED_WATCH_TIMEOUT_SECONDS: u32 = 35;

/// How often the API server sends a quiet watch a bookmark (about once a minute).
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(60);

/// How long past the server's next bookmark, or the watch's end, a silent watch waits before it
/// takes its connection for dead (half-open: nothing arrives, and nothing says so).
const SILENCE_MARGIN: Duration = Duration::from_secs(10);

/// For a watch over pinged connections or not: the timeout it asks of the server, and the
/// silence after which it gives up its connection. Over HTTP/2, pings find a dead connection
/// sooner (within 25 s); the silence bound is for a stream the server forgot.
fn pace(pinged: bool) -> (u32, Duration) {
    let timeout = match pinged {
        true => WATCH_TIMEOUT_SECONDS,
        false => UNPINGED_WATCH_TIMEOUT_SECONDS,
    };
    let quiet = Duration::from_secs(timeout.into()).min(BOOKMARK_INTERVAL);
    (timeout, quiet + SILENCE_MARGIN)
}

/// Objects a LIST page holds (client-go's pager asks for as many): a namespace of any size
/// lists in pages that each come well within the request bound ([`super::throttle`]).
const PAGE: u32 = 500;

/// How long refusals (403, 404) or failures (5xx) must last, no request of the watch getting
/// through, before the watch backs off to 30 s: a fault that comes and goes is retried at the
/// fast pace, one that stays is not asked about every few seconds.
const PERSISTENT: Duration = Duration::from_secs(15);

/// A watch that ends sooner than this without an error counts as a failure for the backoff, so
/// a server that closes every watch at once is not asked again in a tight loop.
const SHORT_WATCH: Duration = Duration::from_secs(1);

/// What every watch of one API server shares: the wait for its return when it cannot be
/// reached, and whether the connections to it are pinged.
#[derive(Clone)]
pub(super) struct Upstream {
    pub recovery: Arc<Recovery>,
    /// The watches refused, by collection.
    pub refusals: Arc<Refusals>,
    pub pinged: Pinged,
    /// Counts the 410s that send a watch back to a LIST.
    pub expired: prometheus_client::metrics::counter::Counter,
    /// Whether collections are listed by streaming.
    pub streaming: Streaming,
}

/// How the broker takes the objects of a namespace or a set, when it starts watching them and
/// when it must start over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum StreamingLists {
    /// A streaming list (a watch with `sendInitialEvents=true`, the objects one event at a time
    /// up to the `k8s.io/initial-events-end` bookmark) while the API server takes it; a LIST
    /// and a WATCH once it refuses, as client-go does.
    #[default]
    Auto,
    /// A LIST in pages, then a WATCH.
    Off,
}

/// Whether the API server is asked for streaming lists: as configured, until it refuses one.
#[derive(Clone, Debug)]
pub(super) struct Streaming(Arc<std::sync::atomic::AtomicBool>);

impl Streaming {
    pub(super) fn new(lists: StreamingLists) -> Streaming {
        let on = lists == StreamingLists::Auto;
        Streaming(Arc::new(std::sync::atomic::AtomicBool::new(on)))
    }

    fn on(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The API server does not stream lists: LISTs from now on.
    fn refused(&self, why: &str) {
        if self.0.swap(false, std::sync::atomic::Ordering::Relaxed) {
            tracing::info!(why, "the API server does not stream lists: listing instead");
        }
    }
}

/// The annotation of the bookmark that ends a streaming list's objects.
const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";

/// What a LIST+WATCH of a collection (one name, or a namespace) saw.
#[derive(Debug, Clone)]
pub(super) enum Event {
    /// A LIST: every object, by name, as of `rv`.
    Listed {
        rv: String,
        objects: Vec<(String, Object)>,
    },
    /// An object created or changed, at `rv`.
    Applied {
        rv: String,
        name: String,
        object: Object,
    },
    /// An object deleted, at `rv`.
    Deleted { rv: String, name: String },
    /// A request failed; it is retried after the backoff.
    Failed(SourceError),
    /// The watch works again after failures: what was last seen still holds, as of `rv`.
    Recovered { rv: String },
}

/// Follows a collection through `api`: the objects `field` and `labels` select (all, if
/// `None`); `what` names it in errors.
pub(super) fn events(
    api: Api<DynamicObject>,
    field: Option<String>,
    labels: Option<String>,
    what: String,
    upstream: Upstream,
) -> BoxStream<'static, Event> {
    let mut list = ListParams::default();
    let mut watch = WatchParams::default();
    if let Some(field) = &field {
        list = list.fields(field);
        watch = watch.fields(field);
    }
    if let Some(labels) = &labels {
        list = list.labels(labels);
        watch = watch.labels(labels);
    }
    let state = Follow {
        // One object is listed (from the watch cache, cheaply); collections are streamed.
        streamable: field.is_none(),
        list,
        watch,
        api,
        what,
        upstream,
        phase: Phase::List,
        backoff: Backoff::default(),
        wait: None,
        refused: None,
        failing_since: None,
        failing: false,
    };
    stream::unfold(state, Follow::next).boxed()
}

/// One state of one object, and the resourceVersion it is known to hold as of.
pub(super) type Seen = Result<(Observed, String), SourceError>;

/// Follows the object `name` through `api`; `what` names it in errors. Each state comes with
/// the resourceVersion it holds as of; one older than the last reported for the same object
/// is dropped.
pub(super) fn follow_seen(
    api: Api<DynamicObject>,
    name: &str,
    what: String,
    upstream: Upstream,
) -> BoxStream<'static, Seen> {
    let field = format!("metadata.name={name}");
    let mut last: Option<Observed> = None;
    events(api, Some(field), None, what, upstream)
        .filter_map(move |event| {
            let seen = match event {
                Event::Listed { rv, objects } => {
                    let observed = match objects.into_iter().next() {
                        Some((_, object)) => Observed::Present(object),
                        None => Observed::Absent,
                    };
                    Some((observed, rv))
                }
                Event::Applied { rv, object, .. } => Some((Observed::Present(object), rv)),
                Event::Deleted { rv, .. } => Some((Observed::Absent, rv)),
                Event::Recovered { rv } => last.clone().map(|l| (l, rv)),
                Event::Failed(error) => return std::future::ready(Some(Err(error))),
            };
            let seen = seen.filter(|(observed, _)| !goes_back(last.as_ref(), observed));
            if let Some((observed, _)) = &seen {
                last = Some(observed.clone());
            }
            std::future::ready(seen.map(Ok))
        })
        .boxed()
}

/// Follows the object `name` through `api`; `what` names it in errors.
pub fn follow(
    api: Api<DynamicObject>,
    name: &str,
    what: String,
    upstream: Upstream,
) -> BoxStream<'static, Result<Observed, SourceError>> {
    follow_seen(api, name, what, upstream)
        .map(|seen| seen.map(|(observed, _)| observed))
        .boxed()
}

/// Whether `now` is an older state than `last`: the same object at a lower resourceVersion.
pub(super) fn goes_back(last: Option<&Observed>, now: &Observed) -> bool {
    if let (Some(Observed::Present(last)), Observed::Present(now)) = (last, now)
        && last.uid == now.uid
        && older(&now.resource_version, &last.resource_version)
    {
        tracing::debug!(
            was = %last.resource_version,
            now = %now.resource_version,
            "an older state than the one reported; dropped"
        );
        return true;
    }
    false
}

enum Phase {
    /// LIST next.
    List,
    /// Start a WATCH from this resourceVersion next.
    Watch(String),
    /// A WATCH is streaming; its connection is taken for dead after `silence` without a word.
    Streaming {
        rv: String,
        events: BoxStream<'static, kube::Result<WatchEvent<DynamicObject>>>,
        started: Instant,
        silence: Duration,
    },
}

struct Follow {
    /// Whether it starts with a streaming list when the server takes them.
    streamable: bool,
    api: Api<DynamicObject>,
    list: ListParams,
    watch: WatchParams,
    what: String,
    upstream: Upstream,
    phase: Phase,
    backoff: Backoff,
    /// Wait this long before the next request, as the last failure says.
    wait: Option<(Duration, Wait)>,
    /// The watch's turn at its collection's gate while the API server refuses it.
    refused: Option<Turn>,
    /// Since when no request of the watch got through.
    failing_since: Option<Instant>,
    /// Whether a failure was reported since the last state was.
    failing: bool,
}

impl Follow {
    /// The key of `obj` in its collection: its name, or `namespace/name` when the collection
    /// spans namespaces (a namespaced kind listed in all of them).
    fn key_of(&self, obj: &DynamicObject) -> String {
        let name = obj.metadata.name.clone().unwrap_or_default();
        match (&self.api.namespace(), &obj.metadata.namespace) {
            (None, Some(ns)) => format!("{ns}/{name}"),
            _ => name,
        }
    }
}

/// How a failed watch waits before it asks again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Its backoff.
    Backoff,
    /// Its backoff, or less if the API server, which could not be reached, answers again.
    Recovery,
    /// Its turn at its collection's gate: the server answered, refusing or failing.
    Refused,
}

impl Follow {
    /// The request got through: a refused watch's collection asks again.
    fn through(&mut self) {
        self.backoff.working();
        self.failing_since = None;
        if let Some(turn) = self.refused.take() {
            turn.through();
        }
    }

    async fn next(mut self) -> Option<(Event, Follow)> {
        loop {
            if let Some((delay, wait)) = self.wait.take() {
                match (wait, &self.refused) {
                    (Wait::Recovery, _) => self.upstream.recovery.wait(delay).await,
                    (Wait::Refused, Some(turn)) => turn.wait(delay).await,
                    _ => tokio::time::sleep(delay).await,
                }
            }
            match std::mem::replace(&mut self.phase, Phase::List) {
                Phase::List if self.streamable && self.upstream.streaming.on() => {
                    if let Some(event) = self.stream_list().await {
                        return Some((event, self));
                    }
                }
                Phase::List => match list_all(&self.api, &self.list).await {
                    Ok((rv, items)) => {
                        self.through();
                        self.failing = false;
                        self.phase = Phase::Watch(rv.clone());
                        let objects = items
                            .iter()
                            .map(|obj| (self.key_of(obj), to_object(obj)))
                            .collect();
                        return Some((Event::Listed { rv, objects }, self));
                    }
                    Err(e) => {
                        if matches!(&e, kube::Error::Api(s) if s.code == 410) {
                            self.upstream.expired.inc();
                        }
                        return Some((self.fail(e, Phase::List), self));
                    }
                },
                Phase::Watch(rv) => {
                    let (timeout, silence) = pace(self.upstream.pinged.now());
                    let params = self.watch.clone().timeout(timeout);
                    match self.api.watch(&params, &rv).await {
                        Ok(events) => {
                            self.through();
                            self.phase = Phase::Streaming {
                                rv: rv.clone(),
                                events: events.boxed(),
                                started: Instant::now(),
                                silence,
                            };
                            // It works again: say so, as of the version it resumed from.
                            if std::mem::take(&mut self.failing) {
                                return Some((Event::Recovered { rv }, self));
                            }
                        }
                        Err(kube::Error::Api(s)) if s.code == 410 => self.relist(),
                        Err(e) => return Some((self.fail(e, Phase::Watch(rv)), self)),
                    }
                }
                Phase::Streaming {
                    mut rv,
                    mut events,
                    started,
                    silence,
                } => match tokio::time::timeout(silence, events.next()).await {
                    Err(_) => {
                        tracing::warn!(
                            what = %self.what,
                            ?silence,
                            "nothing from the API server on a watch: its connection is taken for dead"
                        );
                        let silent = format!("nothing on the watch for {silence:?}");
                        return Some((
                            self.fail(kube::Error::Service(silent.into()), Phase::Watch(rv)),
                            self,
                        ));
                    }
                    Ok(Some(Ok(event))) => {
                        let event = match event {
                            WatchEvent::Added(obj) | WatchEvent::Modified(obj) => {
                                rv = obj.metadata.resource_version.clone().unwrap_or(rv);
                                Some(Event::Applied {
                                    rv: rv.clone(),
                                    name: self.key_of(&obj),
                                    object: to_object(&obj),
                                })
                            }
                            WatchEvent::Deleted(obj) => {
                                rv = obj.metadata.resource_version.clone().unwrap_or(rv);
                                Some(Event::Deleted {
                                    rv: rv.clone(),
                                    name: self.key_of(&obj),
                                })
                            }
                            WatchEvent::Bookmark(b) => {
                                rv = b.metadata.resource_version;
                                None
                            }
                            WatchEvent::Error(s) if s.code == 410 => {
                                self.relist();
                                continue;
                            }
                            // Any other error the server ends a watch with in its stream
                            // starts over from a LIST, as client-go's reflector does: resumed
                            // from the same version, the watch may meet it again and again.
                            // Without the watch cache, a watch resumed at the revision etcd
                            // was compacted to is answered 500 "etcd event received with
                            // PrevKv=nil" for the next write, on every try.
                            WatchEvent::Error(s) => {
                                return Some((self.fail(kube::Error::Api(s), Phase::List), self));
                            }
                        };
                        self.phase = Phase::Streaming {
                            rv,
                            events,
                            started,
                            silence,
                        };
                        if let Some(event) = event {
                            return Some((event, self));
                        }
                    }
                    Ok(Some(Err(e))) => return Some((self.fail(e, Phase::Watch(rv)), self)),
                    Ok(None) => {
                        // The server ended the watch (its timeout): resume where it ended.
                        if started.elapsed() < SHORT_WATCH {
                            self.wait = Some((self.backoff.failed(), Wait::Backoff));
                        }
                        self.phase = Phase::Watch(rv);
                    }
                },
            }
        }
    }

    /// A streaming list: a watch from now that first sends every object, then a bookmark
    /// marking the end of them, and goes on as a watch. The objects, as a LIST's, and the watch
    /// streaming on; `None` to go on from the phase it set (a LIST, when the server refused).
    async fn stream_list(&mut self) -> Option<Event> {
        let (timeout, silence) = pace(self.upstream.pinged.now());
        let params = self.watch.clone().initial_events().timeout(timeout);
        let mut events = match self.api.watch(&params, "").await {
            Ok(events) => events.boxed(),
            // A server without the WatchList feature says the parameter is invalid.
            Err(kube::Error::Api(s)) if s.code == 400 || s.code == 422 => {
                self.upstream.streaming.refused(&s.message);
                return None;
            }
            Err(e) => return Some(self.fail(e, Phase::List)),
        };
        let mut objects = std::collections::BTreeMap::new();
        loop {
            let event = match tokio::time::timeout(silence, events.next()).await {
                Err(_) => {
                    let silent = format!("nothing on the streaming list for {silence:?}");
                    return Some(self.fail(kube::Error::Service(silent.into()), Phase::List));
                }
                Ok(None) => {
                    let ended = "the API server ended the streaming list before its last object";
                    return Some(self.fail(kube::Error::Service(ended.into()), Phase::List));
                }
                Ok(Some(Err(e))) => return Some(self.fail(e, Phase::List)),
                Ok(Some(Ok(event))) => event,
            };
            match event {
                WatchEvent::Added(obj) | WatchEvent::Modified(obj) => {
                    objects.insert(self.key_of(&obj), to_object(&obj));
                }
                WatchEvent::Deleted(obj) => {
                    objects.remove(&self.key_of(&obj));
                }
                WatchEvent::Bookmark(b) => {
                    if b.metadata
                        .annotations
                        .get(INITIAL_EVENTS_END)
                        .map(String::as_str)
                        != Some("true")
                    {
                        // A server that knows no streaming lists sends its objects as a legacy
                        // watch does, and bookmarks that end nothing.
                        self.upstream
                            .streaming
                            .refused("a bookmark without the initial-events-end annotation");
                        return None;
                    }
                    let rv = b.metadata.resource_version;
                    self.through();
                    self.failing = false;
                    self.phase = Phase::Streaming {
                        rv: rv.clone(),
                        events,
                        started: Instant::now(),
                        silence,
                    };
                    let objects = objects.into_iter().collect();
                    return Some(Event::Listed { rv, objects });
                }
                WatchEvent::Error(s) if s.code == 410 => {
                    self.relist();
                    return None;
                }
                WatchEvent::Error(s) => return Some(self.fail(kube::Error::Api(s), Phase::List)),
            }
        }
    }

    /// The API server compacted past the version the watch would resume from (410): start over
    /// from a fresh LIST, after the backoff, so that a server answering 410 again and again is
    /// not listed in a tight loop (the backoff restarts once a watch holds).
    fn relist(&mut self) {
        self.upstream.expired.inc();
        self.phase = Phase::List;
        self.wait = Some((self.backoff.failed(), Wait::Backoff));
    }

    /// Records a failure of the request in `retry`, to be retried after the backoff, at its
    /// collection's gate if the server answered refusing (403, 404) or has failed (5xx) for
    /// [`PERSISTENT`]; the slow backoff once that long has passed.
    fn fail(&mut self, error: kube::Error, retry: Phase) -> Event {
        let since = *self.failing_since.get_or_insert_with(Instant::now);
        let persistent = since.elapsed() >= PERSISTENT;
        let refused = match &error {
            kube::Error::Api(s) => s.code == 403 || s.code == 404 || (s.code >= 500 && persistent),
            _ => false,
        };
        let error = api_error(error, &self.what);
        self.wait = Some(if refused {
            match &mut self.refused {
                Some(turn) if turn.is_probe() => turn.again(),
                // A waiter that asked again itself may find the probe gone, and take over.
                _ => {
                    let collection = self.api.resource_url();
                    let kind = kind_of(collection);
                    self.refused = Some(self.upstream.refusals.refused(&kind, collection));
                }
            }
            // The kind's probe asks at the fast pace however long refusals last.
            let slow = persistent && !self.refused.as_ref().is_some_and(Turn::is_kind_probe);
            let delay = match slow {
                true => self.backoff.refused(),
                false => self.backoff.failed(),
            };
            (delay, Wait::Refused)
        } else if matches!(error, SourceError::Unavailable(_)) {
            (self.backoff.failed(), Wait::Recovery)
        } else {
            (self.backoff.failed(), Wait::Backoff)
        });
        self.phase = retry;
        self.failing = true;
        Event::Failed(error)
    }
}

/// The kind of a collection's URL: without its namespace (`/apis/g/v/namespaces/ns/plural` is
/// of `/apis/g/v/plural`).
fn kind_of(collection: &str) -> String {
    match collection.split_once("/namespaces/") {
        Some((group, rest)) => {
            let plural = rest.split_once('/').map_or("", |(_, plural)| plural);
            format!("{group}/{plural}")
        }
        None => collection.to_string(),
    }
}

/// Every object `params` select, [`PAGE`] at a time (`limit` and `continue`), each page within
/// the request bound; with the resourceVersion of the list, which every page holds as of. A
/// continue token the API server has compacted away (410) fails the LIST, which starts over.
async fn list_all(
    api: &Api<DynamicObject>,
    params: &ListParams,
) -> kube::Result<(String, Vec<DynamicObject>)> {
    let mut page = params.clone().limit(PAGE);
    let mut items = Vec::new();
    loop {
        let list = api.list(&page).await?;
        items.extend(list.items);
        match list.metadata.continue_.filter(|token| !token.is_empty()) {
            Some(token) => page = page.continue_token(&token),
            None => return Ok((list.metadata.resource_version.unwrap_or_default(), items)),
        }
    }
}

/// Whether resourceVersion `a` is older than `b`. They are opaque strings by contract, but
/// integers (etcd revisions) on every API server; strings that are not are never called older.
pub(super) fn older(a: &str, b: &str) -> bool {
    match (a.parse::<u64>(), b.parse::<u64>()) {
        (Ok(a), Ok(b)) => a < b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn an_unpinged_watch_ends_and_is_given_up_on_within_a_minute() {
        // Over HTTP/2 the watch is long, and its silence bound lies past the server's bookmark.
        assert_eq!(super::pace(true), (290, Duration::from_secs(70)));
        // Over HTTP/1.1 the server's own end of the watch shows the connection alive.
        assert_eq!(super::pace(false), (35, Duration::from_secs(45)));
    }

    #[test]
    fn a_collection_is_of_its_kind_whatever_its_namespace() {
        assert_eq!(
            super::kind_of("/apis/g.example/v1/namespaces/team-a/widgets"),
            "/apis/g.example/v1/widgets"
        );
        assert_eq!(
            super::kind_of("/apis/g.example/v1/widgets"),
            "/apis/g.example/v1/widgets"
        );
    }

    #[test]
    fn resource_versions_compare_as_integers_or_not_at_all() {
        assert!(super::older("9", "10"));
        assert!(!super::older("10", "9"));
        assert!(!super::older("10", "10"));
        assert!(!super::older("a", "10"));
    }
}
