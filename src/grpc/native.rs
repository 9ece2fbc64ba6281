//! The native `crdbroker.v1.Broker` service: each named resource's state at once (CURRENT
//! when the client resumes at it), then every change; a set's members as SYNCED ([`super::sets`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use futures::stream::{self, BoxStream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::admit::{Admitted, admit, admit_one};
use super::delivery::{Delivery, drain_of, until_error};
use super::frame::{self, Frame};
use super::messages::{End, Messages, Next};
use super::sets;
use super::status::{parse_status, source_status};
use crate::access::{Access, Caller};
use crate::conn::ConnDrain;
use crate::pb;
use crate::pb::broker_server::Broker;
use crate::pb::subscribe_response::Event;
use crate::registry::{Registry, State, Update, slot};
use crate::selector::{ALL_NAMESPACES, KindRef, Selector, Set};
use crate::source::{Source, SourceError};
use crate::telemetry::Protocol;

/// The most resources one Subscribe may name.
pub const MAX_RESOURCES: usize = 100;

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
        let labels: crate::selector::LabelSelector =
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
        tracing::debug!(%set, %caller, "set subscribed");
        let registered = self.registry.subscribers().register(
            caller.to_string(),
            "native",
            vec![set.to_string()],
        );
        let part = Some((registered, 0));
        let end = End::new(drain, Some(ticket));
        Ok(Response::new(sets::stream(
            set, members, 0, end, resume, part,
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
                    u.wire(slot::NATIVE, |o| frame::encode_object(&selector, o))
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
