//! The gRPC face of the broker: the native `crdbroker.v1.Broker` service, and the one mapping
//! of errors to `tonic::Status`.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::stream::{self, BoxStream, Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::access::limits::{Charged, New};
use crate::access::{Access, Caller, Ticket};
use crate::conn::{ConnDrain, DrainReason};
use crate::pb;
use crate::pb::broker_server::Broker;
use crate::pb::subscribe_response::Event;
use crate::registry::{
    Delivered, PartRef, Refused, Registry, State, Subscription, Update, Watched,
};
use crate::selector::{KindRef, ParseError, Selector};
use crate::source::{ALL_NAMESPACES, Set, Source, SourceError};
use crate::telemetry::{
    FirstMessageLabels, Limit, Metrics, Protocol, ResourceLabels, SubscriberLabels, Watch,
};

mod flag_sets;
pub mod flagd;
pub mod frame;
mod messages;
mod sets;
pub use crate::registry::set_version;
pub mod wire;

use frame::Frame;
use messages::{End, Messages, Next};

/// The most resources one Subscribe may name.
pub const MAX_RESOURCES: usize = 100;

/// Which [`Update::wire`] slot holds the native protocol's encoding.
const NATIVE_WIRE: usize = crate::registry::slot::NATIVE;

/// The status a source error becomes, for the resource at `index`.
pub fn source_status(index: usize, error: &SourceError) -> Status {
    let message = format!("resources[{index}]: {error}");
    match error {
        SourceError::UnknownKind(_) => Status::not_found(message),
        SourceError::NotAllowed(_) | SourceError::Forbidden(_) => {
            Status::permission_denied(message)
        }
        SourceError::Invalid(_) => Status::invalid_argument(message),
        SourceError::Unavailable(_) => Status::unavailable(message),
    }
}

fn parse_status(index: usize, error: &ParseError) -> Status {
    Status::invalid_argument(format!("resources[{index}]: {error}"))
}

/// `status`, about the resource at `index`.
fn indexed(index: usize, status: Status) -> Status {
    Status::new(
        status.code(),
        format!("resources[{index}]: {}", status.message()),
    )
}

/// What a request may name: a resource, or a set.
pub(crate) trait Wanted: Watched {
    /// What its watch is charged to its caller as.
    const CHARGED: Charged;

    /// The resource the policy and the source's resolution judge it by.
    fn probe(&self) -> Selector;

    /// It, canonical: as `resolved` (its probe, resolved) says.
    fn canonical(&self, resolved: Selector) -> Self;
}

impl Wanted for Selector {
    const CHARGED: Charged = Charged::Watch;

    fn probe(&self) -> Selector {
        self.clone()
    }

    fn canonical(&self, resolved: Selector) -> Self {
        resolved
    }
}

impl Wanted for Set {
    const CHARGED: Charged = Charged::Set;

    fn probe(&self) -> Selector {
        // Policy and resolution look at the kind and namespace only; the name is never read.
        self.member("set")
    }

    fn canonical(&self, resolved: Selector) -> Self {
        Set {
            kind: resolved.kind,
            ..self.clone()
        }
    }
}

/// A request admitted: what it names, canonical, a subscription to each, and the ticket its
/// streams hold.
pub(crate) struct Admitted<W: Watched = Selector> {
    pub(crate) canonical: Vec<W>,
    pub(crate) subscriptions: Vec<Subscription<W::State>>,
    pub(crate) ticket: Arc<Ticket>,
}

/// The one way into the registry, for every protocol and for resources and sets alike: the
/// policy before anything is resolved (so a namespace the caller may not read costs no API call,
/// and the answer is the same whether or not the resource exists), resolution (`--resource` is
/// checked before any API call), the policy on the resolved kinds, the caller's limits and
/// `--max-watches` (only what is not watched yet counts as new), then a subscription to each.
pub(crate) async fn admit<S: Source, W: Wanted>(
    registry: &Registry<S>,
    access: &Access,
    caller: &Caller,
    wanted: &[W],
) -> Result<Admitted<W>, Status> {
    let probes: Vec<Selector> = wanted.iter().map(Wanted::probe).collect();
    for (i, probe) in probes.iter().enumerate() {
        access.precheck(caller, probe).map_err(|s| indexed(i, s))?;
    }
    let resolved = futures::future::join_all(probes.iter().map(|s| registry.resolve(s))).await;
    let mut judged = Vec::with_capacity(resolved.len());
    let mut canonical = Vec::with_capacity(resolved.len());
    for (i, (r, w)) in resolved.into_iter().zip(wanted).enumerate() {
        let selector = r.map_err(|e| source_status(i, &e))?;
        access
            .authorize(caller, &selector)
            .map_err(|s| indexed(i, s))?;
        canonical.push(w.canonical(selector.clone()));
        judged.push(selector);
    }
    let mut cold: Vec<&W> = canonical
        .iter()
        .filter(|w| !registry.is_watched(*w))
        .collect();
    cold.sort();
    cold.dedup();
    let max = registry.max_watches();
    if !cold.is_empty() && registry.len().saturating_add(cold.len()) > max {
        access.count_limit(Limit::MaxWatches);
        return Err(Status::resource_exhausted(format!(
            "this request starts {} new watches, and the broker watches {} resources and sets of at most {max} (--max-watches)",
            cold.len(),
            registry.len()
        )));
    }
    let new = match W::CHARGED {
        Charged::Watch => New {
            watches: cold.len(),
            sets: 0,
        },
        Charged::Set => New {
            watches: 0,
            sets: cold.len(),
        },
    };
    let ticket = Arc::new(access.admit(caller, &judged, new)?);
    let mut subscriptions = Vec::with_capacity(canonical.len());
    for w in &canonical {
        let charge = || {
            ticket
                .charge(W::CHARGED)
                .map(|c| Box::new(c) as crate::registry::Charge)
        };
        let subscription = registry
            .try_subscribe(w, charge)
            .map_err(|refused| match refused {
                Refused::Full(full) => {
                    access.count_limit(Limit::MaxWatches);
                    Status::resource_exhausted(full.to_string())
                }
                Refused::Forbidden(error) => {
                    Status::permission_denied(format!("the broker may not read it now: {error}"))
                }
            })?;
        subscriptions.push(subscription);
    }
    Ok(Admitted {
        canonical,
        subscriptions,
        ticket,
    })
}

/// [`admit`] for one resource or set: it, canonical, its subscription, and the ticket.
pub(crate) async fn admit_one<S: Source, W: Wanted>(
    registry: &Registry<S>,
    access: &Access,
    caller: &Caller,
    wanted: &W,
) -> Result<(W, Subscription<W::State>, Arc<Ticket>), Status> {
    let Admitted {
        mut canonical,
        mut subscriptions,
        ticket,
    } = admit(registry, access, caller, std::slice::from_ref(wanted)).await?;
    match (canonical.pop(), subscriptions.pop()) {
        (Some(w), Some(s)) => Ok((w, s, ticket)),
        _ => Err(Status::internal("admitted nothing")),
    }
}

/// The status a stream ends with when the broker drops it: clients reconnect on UNAVAILABLE.
pub fn shutting_down() -> Status {
    Status::unavailable("the broker is shutting down; reconnect")
}

/// The status a stream ends with when its connection is drained, naming why.
pub fn drained(reason: DrainReason) -> Status {
    match reason {
        DrainReason::MaxAge => Status::unavailable(
            "the connection reached its maximum age (--max-connection-age), so that clients spread over replicas; reconnect",
        ),
        DrainReason::Shutdown => shutting_down(),
    }
}

/// Reads a request's resource reference into a selector, validating every field.
fn to_selector(index: usize, r: &pb::ResourceRef) -> Result<Selector, Status> {
    // As the selector would be written, so errors read like the CLI's.
    let version = if r.version.is_empty() {
        String::new()
    } else {
        format!(".{}", r.version)
    };
    let input = match r.namespace.as_str() {
        "" => format!("{}{version}.{}/{}", r.resource, r.group, r.name),
        ns => format!("{}{version}.{}/{ns}/{}", r.resource, r.group, r.name),
    };
    let version = Some(r.version.as_str()).filter(|v| !v.is_empty());
    let kind = KindRef::new(&r.resource, version, &r.group, &input)
        .map_err(|e| parse_status(index, &e))?;
    let namespace = Some(r.namespace.as_str()).filter(|n| !n.is_empty());
    Selector::new(kind, namespace, &r.name, &input).map_err(|e| parse_status(index, &e))
}

/// The native Broker service over a registry.
pub struct BrokerService<S> {
    registry: Registry<S>,
    access: Arc<Access>,
    shutdown: CancellationToken,
}

impl<S: Source> BrokerService<S> {
    /// A service whose callers `access` admits, whose streams end with UNAVAILABLE when
    /// `shutdown` is cancelled.
    pub fn new(registry: Registry<S>, access: Arc<Access>, shutdown: CancellationToken) -> Self {
        BrokerService {
            registry,
            access,
            shutdown,
        }
    }

    /// Serves a request naming a set (`resources[0]` with no name).
    async fn subscribe_set(
        &self,
        caller: &Caller,
        drain: ConnDrain,
        r: &pb::ResourceRef,
    ) -> Result<Response<BoxStream<'static, Result<Frame, Status>>>, Status> {
        let labels: crate::labels::LabelSelector =
            r.label_selector.parse().map_err(|e: String| {
                Status::invalid_argument(format!("resources[0].label_selector: {e}"))
            })?;
        resume_bounds(0, r)?;
        if !r.uid.is_empty() {
            return Err(Status::invalid_argument(
                "resources[0].uid is given for a set: a set resumes by the set_version of its last SYNCED, in resource_version",
            ));
        }
        let resume = Some(r.resource_version.clone()).filter(|v| !v.is_empty());
        // A set's kind and namespace are checked as a selector's would be; `*` (every
        // namespace) is no namespace name, so it is put back after the check.
        let all = r.namespace == ALL_NAMESPACES;
        let mut probe = to_selector(
            0,
            &pb::ResourceRef {
                name: "set".into(),
                namespace: if all {
                    "all".into()
                } else {
                    r.namespace.clone()
                },
                ..r.clone()
            },
        )?;
        if all {
            probe.namespace = Some(ALL_NAMESPACES.into());
        }
        let set = Set {
            kind: probe.kind,
            namespace: probe.namespace,
            labels,
        };
        let (set, members, ticket) = admit_one(&self.registry, &self.access, caller, &set).await?;
        let revoked = ticket.revoked();
        let ends = async move {
            let _ticket = ticket;
            tokio::select! {
                _ = drain.token().cancelled() => drained(drain.reason()),
                status = revoked => status,
            }
        };
        tracing::debug!(%set, %caller, "set subscribed");
        let registered = self.registry.subscribers().register(
            caller.to_string(),
            "native",
            vec![set.to_string()],
        );
        let part = Some((registered, 0));
        Ok(Response::new(sets::stream(
            set, members, 0, ends, resume, part,
        )))
    }
}

#[tonic::async_trait]
impl<S: Source> Broker for BrokerService<S> {
    type SubscribeStream = BoxStream<'static, Result<Frame, Status>>;

    async fn subscribe(
        &self,
        request: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let started = Instant::now();
        let drain = drain_of(&request, &self.shutdown);
        let caller = Caller::of(request.extensions())?;
        let (metadata, _, message) = request.into_parts();
        let resources = message.resources;
        if resources.len() > 1
            && let Some(i) = resources.iter().position(|r| r.name.is_empty())
        {
            return Err(Status::invalid_argument(format!(
                "resources[{i}] names a set (no name): a set must be the only resource of its request"
            )));
        }
        if let Some(i) = resources
            .iter()
            .position(|r| !r.name.is_empty() && !r.label_selector.is_empty())
        {
            return Err(Status::invalid_argument(format!(
                "resources[{i}] has a name and a label_selector: a label selector names a set, with the name left empty"
            )));
        }
        if resources.len() == 1 && resources[0].name.is_empty() {
            return self.subscribe_set(&caller, drain, &resources[0]).await;
        }
        if resources.is_empty() {
            return Err(Status::invalid_argument(
                "SubscribeRequest.resources is empty: name at least one resource (group, resource, namespace, name)",
            ));
        }
        if resources.len() > MAX_RESOURCES {
            return Err(Status::invalid_argument(format!(
                "SubscribeRequest names {} resources; at most {MAX_RESOURCES} per stream",
                resources.len()
            )));
        }
        let selectors = resources
            .iter()
            .enumerate()
            .map(|(i, r)| to_selector(i, r))
            .collect::<Result<Vec<_>, _>>()?;
        let mut held = resources
            .iter()
            .enumerate()
            .map(|(i, r)| held(i, r))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter();
        let Admitted {
            canonical,
            subscriptions,
            ticket,
        } = admit(&self.registry, &self.access, &caller, &selectors).await?;
        let names: Vec<String> = canonical.iter().map(ToString::to_string).collect();
        let span = tracing::info_span!(
            "subscription",
            protocol = "native",
            selector = %names.join(" "),
            caller = %caller
        );
        crate::telemetry::continue_trace(&span, &metadata);
        let registered =
            self.registry
                .subscribers()
                .register(caller.to_string(), "native", names.clone());
        // Whether any part has sent: a part that fails after that sends FAILED and goes on.
        let served = Arc::new(AtomicBool::new(false));
        let mut streams: Vec<_> = canonical
            .iter()
            .zip(subscriptions)
            .enumerate()
            .map(|(i, (selector, subscription))| {
                let delivery = Delivery::new(
                    self.registry.metrics().clone(),
                    selector,
                    Protocol::Native,
                    started,
                    subscription.cold,
                    Some((registered.clone(), i)),
                );
                let next = native_messages(
                    i as u32,
                    Arc::from(selector.to_string()),
                    delivery,
                    served.clone(),
                    held.next().unwrap_or_default(),
                );
                let end = End::new(drain.clone(), Some(ticket.clone()));
                Messages::new(subscription, end, span.clone(), next).boxed()
            })
            .collect();
        // Most subscribers name one resource: skip the merge and its extra wake-up per message.
        let merged = match streams.len() {
            1 => streams.swap_remove(0),
            // Each part ends itself at the drain; the whole ends at the first error of any.
            _ => until_error(stream::select_all(streams)).boxed(),
        };
        Ok(Response::new(merged))
    }
}

/// What ends a request's streams: its connection's drain (max age or shutdown), or the
/// broker's shutdown when served without one.
pub(crate) fn drain_of<T>(request: &Request<T>, shutdown: &CancellationToken) -> ConnDrain {
    request
        .extensions()
        .get::<ConnDrain>()
        .cloned()
        .unwrap_or_else(|| ConnDrain::new(shutdown.clone()))
}

/// One subscriber's view of one resource, for the metrics: counted in the subscriber gauge
/// while it lives; its first message timed from the subscribe; later ones counted towards the
/// update's fan-out time; the version it was last handed recorded for `/debug/subscribers`.
pub(crate) struct Delivery {
    metrics: Arc<Metrics>,
    labels: SubscriberLabels,
    started: Instant,
    cold: bool,
    first: bool,
    part: PartRef,
}

impl Delivery {
    pub(crate) fn new(
        metrics: Arc<Metrics>,
        selector: &Selector,
        protocol: Protocol,
        started: Instant,
        cold: bool,
        part: PartRef,
    ) -> Self {
        let labels = SubscriberLabels {
            resource: ResourceLabels::of(&selector.kind).resource,
            protocol,
        };
        metrics.subscriptions.open.get_or_create(&labels).inc();
        Delivery {
            metrics,
            labels,
            started,
            cold,
            first: true,
            part,
        }
    }

    /// Records that a message about `update` (none for an absent resource) was handed to the
    /// transport.
    pub(crate) fn sent(&mut self, update: Option<&Arc<Update>>) {
        let what = update.map_or(Delivered::Absent, |u| Delivered::Object(u.clone()));
        crate::registry::subscribers::record(&self.part, what);
        let update = update.map(|u| &**u);
        if std::mem::take(&mut self.first) {
            let labels = FirstMessageLabels {
                protocol: self.labels.protocol,
                watch: if self.cold { Watch::Cold } else { Watch::Warm },
            };
            self.metrics
                .subscriptions
                .first_message_seconds
                .get_or_create(&labels)
                .observe(self.started.elapsed().as_secs_f64());
        } else if let Some(fanout) = update.and_then(Update::delivered) {
            let labels = ResourceLabels {
                resource: self.labels.resource.clone(),
            };
            self.metrics
                .subscriptions
                .fanout_seconds
                .get_or_create(&labels)
                .observe(fanout.as_secs_f64());
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        self.metrics
            .subscriptions
            .open
            .get_or_create(&self.labels)
            .dec();
    }
}

/// The deadline a request's `grpc-timeout` gives, from now: 1 to 8 digits and a unit (`H`,
/// `M`, `S`, `m`, `u`, `n`), as the gRPC protocol spells it; none without the header.
pub(crate) fn deadline_of(
    metadata: &tonic::metadata::MetadataMap,
) -> Result<Option<Instant>, Status> {
    let Some(value) = metadata.get("grpc-timeout") else {
        return Ok(None);
    };
    let text = value.to_str().unwrap_or_default();
    let malformed = || {
        let shown: String = text.chars().take(32).collect();
        Status::invalid_argument(format!(
            "grpc-timeout {shown:?} is not a gRPC timeout: 1 to 8 digits and a unit of H, M, S, m, u or n"
        ))
    };
    let digits = text.get(..text.len().saturating_sub(1)).unwrap_or_default();
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed());
    }
    let amount: u64 = digits.parse().map_err(|_| malformed())?;
    let timeout = match &text[digits.len()..] {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return Err(malformed()),
    };
    Ok(Instant::now().checked_add(timeout))
}

/// `frames`, counted as `stream` until it ends, and ended with DEADLINE_EXCEEDED at `deadline`.
/// An error ends it for the drain's reason when its connection is draining, as an error
/// otherwise; a stream its client dropped is the client's doing ([`SyncStream`]).
pub(crate) fn counted<T: Send + 'static>(
    frames: BoxStream<'static, Result<T, Status>>,
    stream: crate::telemetry::SyncStream,
    drain: ConnDrain,
    deadline: Option<Instant>,
) -> impl Stream<Item = Result<T, Status>> + Send + 'static {
    use crate::telemetry::StreamEnd;
    let expiry = Box::pin(async move {
        match deadline {
            Some(at) => tokio::time::sleep_until(at.into()).await,
            None => std::future::pending().await,
        }
    });
    stream::unfold(
        (frames, stream, expiry, false),
        move |(mut frames, mut stream, mut expiry, ended)| {
            let drain = drain.clone();
            async move {
                if ended {
                    return None;
                }
                let item = tokio::select! {
                    item = frames.next() => item?,
                    () = &mut expiry => {
                        stream.ending(StreamEnd::DeadlineExceeded);
                        Err(Status::deadline_exceeded(
                            "the stream reached the deadline its client gave (grpc-timeout)",
                        ))
                    }
                };
                if item.is_err() {
                    stream.ending(if drain.token().is_cancelled() {
                        StreamEnd::Drain
                    } else {
                        StreamEnd::Error
                    });
                }
                let ended = item.is_err();
                Some((item, (frames, stream, expiry, ended)))
            }
        },
    )
}

/// Ends a stream after its first error (tonic stops there too; this makes it explicit).
fn until_error<T>(
    s: impl Stream<Item = Result<T, Status>> + Send + 'static,
) -> impl Stream<Item = Result<T, Status>> + Send + 'static {
    stream::unfold(
        (Box::pin(s), false),
        |(mut s, failed): (Pin<Box<_>>, bool)| async move {
            if failed {
                return None;
            }
            let item = s.next().await?;
            let failed = item.is_err();
            Some((item, (s, failed)))
        },
    )
}

/// What one subscriber last told its client about one resource.
#[derive(Debug, Clone, Default)]
pub(crate) enum Sent {
    /// Nothing yet.
    #[default]
    Nothing,
    /// Nothing yet on this stream; the client says it holds this version (it resumes).
    Held {
        /// The uid it holds.
        uid: String,
        /// The resourceVersion it holds.
        resource_version: String,
    },
    /// That the object exists, in this state.
    Present(Arc<Update>),
    /// That it does not.
    Absent,
}

/// The longest `resource_version` and `uid` a request may give to resume.
const MAX_RESUME_VERSION: usize = 256;
const MAX_RESUME_UID: usize = 128;

/// What the client of `resources[index]` says it holds: [`Sent::Held`] when it gives a version
/// to resume from, else [`Sent::Nothing`]; INVALID_ARGUMENT for one over the bounds or a uid
/// without a resource_version.
fn held(index: usize, r: &pb::ResourceRef) -> Result<Sent, Status> {
    resume_bounds(index, r)?;
    if r.resource_version.is_empty() {
        if !r.uid.is_empty() {
            return Err(Status::invalid_argument(format!(
                "resources[{index}].uid is given without resource_version: a resumed resource names both"
            )));
        }
        return Ok(Sent::Nothing);
    }
    Ok(Sent::Held {
        uid: r.uid.clone(),
        resource_version: r.resource_version.clone(),
    })
}

fn resume_bounds(index: usize, r: &pb::ResourceRef) -> Result<(), Status> {
    for (field, value, max) in [
        ("resource_version", &r.resource_version, MAX_RESUME_VERSION),
        ("uid", &r.uid, MAX_RESUME_UID),
    ] {
        if value.len() > max {
            return Err(Status::invalid_argument(format!(
                "resources[{index}].{field} has {} bytes; at most {max}",
                value.len()
            )));
        }
    }
    Ok(())
}

/// The next event to send, given what was sent and the latest state.
pub(crate) enum Step {
    /// Nothing new for this client.
    Skip,
    /// Send this event about this object (`None`: ABSENT, no object).
    Send(Event, Option<Arc<Update>>),
    /// Send CURRENT: the object is as the client holds it.
    Current(Arc<Update>),
    /// End the stream with this error.
    Fail(SourceError),
}

/// Decides the event for a client that was last told `sent` and now sees `state`; a client that
/// fell behind skips straight to the newest state.
pub(crate) fn step(sent: &Sent, state: &State) -> Step {
    match (state, sent) {
        (State::Pending, _) => Step::Skip,
        // The source retries: the subscriber waits for its answer.
        (State::Failed(e), Sent::Nothing | Sent::Held { .. }) if e.is_outage() => Step::Skip,
        (State::Failed(e), Sent::Nothing | Sent::Held { .. }) => Step::Fail(e.clone()),
        // The kind is no longer served: the last state sent will not change again.
        (State::Failed(e), _) if e.is_gone() => Step::Fail(e.clone()),
        (State::Failed(_), _) => Step::Skip,
        (State::Present(now), Sent::Present(was)) if Arc::ptr_eq(now, was) => Step::Skip,
        (State::Present(now), Sent::Present(was)) if now.object.uid == was.object.uid => {
            if now.object.resource_version == was.object.resource_version {
                Step::Skip
            } else {
                Step::Send(Event::Updated, Some(now.clone()))
            }
        }
        (
            State::Present(now),
            Sent::Held {
                uid,
                resource_version,
            },
        ) if now.object.uid == *uid && now.object.resource_version == *resource_version => {
            Step::Current(now.clone())
        }
        (State::Present(now), _) => Step::Send(Event::Snapshot, Some(now.clone())),
        (State::Absent { .. }, Sent::Absent) => Step::Skip,
        (State::Absent { .. }, Sent::Nothing | Sent::Held { .. }) => {
            Step::Send(Event::Absent, None)
        }
        (State::Absent { last }, Sent::Present(was)) => Step::Send(
            Event::Deleted,
            Some(last.clone().unwrap_or_else(|| was.clone())),
        ),
    }
}

/// What a native subscriber is sent about one resource: its state at once (CURRENT if it is
/// the version `held`), then each change. `served` is shared by the parts of one stream: once
/// one has sent, a part that fails says so in a FAILED event instead of ending the others'
/// stream.
fn native_messages(
    index: u32,
    selector: Arc<str>,
    mut delivery: Delivery,
    served: Arc<AtomicBool>,
    held: Sent,
) -> impl FnMut(&State) -> Next<Frame> + Send + Unpin + 'static {
    let mut sent = held;
    let mut failed: Option<SourceError> = None;
    move |state| match step(&sent, state) {
        Step::Skip => Next::Wait,
        Step::Current(update) => {
            served.store(true, Ordering::Release);
            failed = None;
            delivery.sent(Some(&update));
            let shared = frame::encode_current(&selector, &update.object);
            sent = Sent::Present(update);
            Next::Send(Frame {
                index,
                event: Event::Current,
                shared,
            })
        }
        Step::Fail(error) if served.load(Ordering::Acquire) => {
            if failed.as_ref() == Some(&error) {
                return Next::Wait;
            }
            let status = source_status(index as usize, &error);
            failed = Some(error);
            // Should the kind be served again, the resource is sent afresh.
            sent = Sent::Nothing;
            Next::Send(Frame {
                index,
                event: Event::Failed,
                shared: frame::encode_failed(&selector, &status),
            })
        }
        Step::Fail(error) => Next::Fail(source_status(index as usize, &error)),
        Step::Send(event, update) => {
            served.store(true, Ordering::Release);
            failed = None;
            delivery.sent(update.as_ref());
            let shared = match &update {
                Some(u) => {
                    u.wire(NATIVE_WIRE, |o| frame::encode_object(&selector, o))
                        .bytes
                }
                None => frame::encode_absent(&selector),
            };
            sent = match (event, update) {
                (Event::Deleted | Event::Absent, _) => Sent::Absent,
                (_, Some(u)) => Sent::Present(u),
                (_, None) => Sent::Absent,
            };
            Next::Send(Frame {
                index,
                event,
                shared,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deadline(value: &str) -> Result<Option<Duration>, Status> {
        let mut metadata = tonic::metadata::MetadataMap::new();
        metadata.insert("grpc-timeout", value.parse().unwrap());
        let before = Instant::now();
        deadline_of(&metadata).map(|at| at.map(|at| at - before))
    }

    #[test]
    fn grpc_timeouts_are_read_in_each_unit_and_refused_when_malformed() {
        let near = |value, want: Duration| {
            let got = deadline(value).unwrap().unwrap();
            assert!(
                got >= want && got - want < Duration::from_millis(100),
                "{value}: {got:?}"
            );
        };
        near("1H", Duration::from_secs(3600));
        near("2M", Duration::from_secs(120));
        near("600S", Duration::from_secs(600));
        near("99999999m", Duration::from_millis(99_999_999));
        near("500u", Duration::from_micros(500));
        near("7n", Duration::from_nanos(7));
        assert_eq!(
            deadline_of(&tonic::metadata::MetadataMap::new()).unwrap(),
            None
        );
        for bad in [
            "",
            "S",
            "10",
            "123456789S",
            "10s",
            "-1S",
            "1.5S",
            "10 S",
            "ten",
        ] {
            let status = deadline(bad).unwrap_err();
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{bad:?}");
            assert!(status.message().starts_with("grpc-timeout"), "{status:?}");
        }
        let long = deadline(&"9".repeat(4000)).unwrap_err();
        assert!(
            long.message().len() < 200,
            "bounded: {}",
            long.message().len()
        );
    }
}
