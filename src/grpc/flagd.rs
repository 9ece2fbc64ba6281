//! The flagd sync protocol: `flagd.sync.v1.FlagSyncService` (SyncFlags, FetchAllFlags,
//! GetMetadata) and the legacy `sync.v1.FlagSyncService`, over the same registry and watches as
//! the native API — a drop-in for flagd-proxy.
//!
//! What real clients need (see `docs/migrating-from-flagd-proxy.md`): the selector from the
//! `flagd-selector` header first, then the body; the first message at once; `{"flags":{}}` for
//! a FeatureFlag that does not exist (so clients become ready and pick it up when it is
//! created); no repeated identical configurations; no configuration over the clients' 4 MiB
//! limit; streams never ended with OK; GetMetadata answering OK with its Struct present.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::{BoxStream, StreamExt};
use prost::Message;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use super::admit::admit_one;
use super::delivery::{Delivery, counted, deadline_of, drain_of};
use super::flag_sets::{Held, MemberSpec, Merge};
use super::frame::Encoded;
use super::messages::{End, Messages, Next, Owed, View};
use super::status::{shutting_down, source_status};
use crate::access::{Access, Caller};
use crate::pb::{flagd, legacy};
use crate::registry::{Members, Registry, State, Wire};
use crate::selector::{KindRef, Selector, Set, Target};
use crate::source::Source;
use crate::telemetry::SyncStream;

/// A sync stream's messages, encoded.
type Frames = BoxStream<'static, Result<Encoded, Status>>;

/// The largest message the flagd clients accept (their gRPC receive limit).
pub const MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// The gRPC metadata key clients send the selector in.
pub const SELECTOR_HEADER: &str = "flagd-selector";

/// What a missing or deleted FeatureFlag is: no flags. Clients become ready on it.
pub const NO_FLAGS: &str = r#"{"flags":{}}"#;

/// How long FetchAllFlags waits for a resource nobody watched yet.
const FETCH_WAIT: Duration = Duration::from_secs(5);

const PREFIX: &str = "core.openfeature.dev/";

/// The accepted selector forms, for error messages.
const FORMS: &str = "core.openfeature.dev/<namespace>/<name> (a FeatureFlag) or core.openfeature.dev/<namespace>?labelSelector=<URL-encoded selector> (the merged flags of a set; * for every namespace), in the flagd-selector header or the request's selector field";

/// Which of the two flagd protocols a stream speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `flagd.sync.v1`.
    Flagd,
    /// `sync.v1`, whose responses carry `state = SYNC_STATE_ALL`.
    Legacy,
}

impl Protocol {
    fn label(self) -> &'static str {
        match self {
            Protocol::Flagd => "flagd",
            Protocol::Legacy => "flagd_legacy",
        }
    }

    fn metric(self) -> crate::telemetry::Protocol {
        match self {
            Protocol::Flagd => crate::telemetry::Protocol::Flagd,
            Protocol::Legacy => crate::telemetry::Protocol::FlagdLegacy,
        }
    }

    /// The [`crate::registry::Update::wire`] slot for this protocol's encoding.
    fn slot(self) -> usize {
        match self {
            Protocol::Flagd => crate::registry::slot::FLAGD,
            Protocol::Legacy => crate::registry::slot::FLAGD_LEGACY,
        }
    }

    /// A SyncFlagsResponse carrying `config`, and `context` as its `sync_context` where the
    /// protocol has one.
    fn encode(self, config: String, context: &Context) -> Bytes {
        match self {
            Protocol::Flagd => flagd::SyncFlagsResponse {
                flag_configuration: config,
                sync_context: context.as_deref().cloned(),
            }
            .encode_to_vec(),
            Protocol::Legacy => legacy::SyncFlagsResponse {
                flag_configuration: config,
                state: legacy::SyncState::All as i32,
            }
            .encode_to_vec(),
        }
        .into()
    }
}

/// What every `flagd.sync.v1` response carries as its `sync_context`: static values given at
/// start (`--context-value`), as flagd's own sync server does; none by default.
pub type Context = Option<Arc<prost_types::Struct>>;

/// The most `--context-value`s, and the longest key and value, in bytes: the context is sent
/// with every message.
pub const CONTEXT_VALUES: usize = 64;
const CONTEXT_KEY_BYTES: usize = 256;
const CONTEXT_VALUE_BYTES: usize = 4096;

/// The `sync_context` of `values` (`KEY=VALUE` pairs, each value a string; a key given twice
/// keeps its last value), or an error naming the bound one passes.
pub fn sync_context(values: &[(String, String)]) -> anyhow::Result<Context> {
    if values.is_empty() {
        return Ok(None);
    }
    anyhow::ensure!(
        values.len() <= CONTEXT_VALUES,
        "{} --context-values: at most {CONTEXT_VALUES}",
        values.len()
    );
    let mut fields = std::collections::BTreeMap::new();
    for (key, value) in values {
        anyhow::ensure!(
            !key.is_empty() && key.len() <= CONTEXT_KEY_BYTES,
            "a --context-value key has 1 to {CONTEXT_KEY_BYTES} bytes"
        );
        anyhow::ensure!(
            value.len() <= CONTEXT_VALUE_BYTES,
            "the --context-value of {key} is over {CONTEXT_VALUE_BYTES} bytes"
        );
        let value = prost_types::Value {
            kind: Some(prost_types::value::Kind::StringValue(value.clone())),
        };
        fields.insert(key.clone(), value);
    }
    Ok(Some(Arc::new(prost_types::Struct { fields })))
}

/// The flag configuration of a FeatureFlag: its `spec.flagSpec`, unchanged (`{"flags": …,
/// "metadata"?, "$evaluators"?}`); no flags if it has none.
pub fn flag_configuration(object_json: &[u8]) -> String {
    let object: Value = serde_json::from_slice(object_json).unwrap_or(Value::Null);
    match object["spec"].get("flagSpec") {
        Some(spec) if spec.is_object() => spec.to_string(),
        _ => {
            let name = &object["metadata"]["name"];
            tracing::warn!(%name, "FeatureFlag without spec.flagSpec: serving no flags");
            NO_FLAGS.to_string()
        }
    }
}

/// Which [`Members::wire`] slot holds a set's merged configuration as text; the protocols'
/// encodings of it are in their own slots.
const MERGED: usize = crate::registry::slot::FLAGD_MERGED;

/// The merge of a set's `members` once listed (`None` before, an error if its source refused
/// it), made once per state of the set whatever the number of its subscribers; its conflicts
/// are counted and logged then.
fn merge(
    metrics: &crate::telemetry::Metrics,
    set: &str,
    members: &Members,
) -> Option<Result<Arc<Merge>, Status>> {
    if !members.synced {
        return match &members.failure {
            Some(e) if !e.is_outage() => Some(Err(source_status(0, e))),
            _ => None,
        };
    }
    Some(Ok(members.decoded(|members| {
        let specs = members
            .objects
            .values()
            .map(|u| u.decoded(MemberSpec::of))
            .collect();
        let merge = Merge::of(specs);
        let conflicts = merge.conflicts();
        if !conflicts.is_empty() {
            metrics.subscriptions.flag_conflicts.inc_by(conflicts.len() as u64);
            tracing::warn!(%set, keys = ?conflicts, "flags defined by more than one FeatureFlag of a set; the first in name order of a namespace is kept, and one two namespaces define is served from neither");
        }
        merge
    })))
}

/// The merged configuration of a set's `members` ([`merge`]), encoded for `protocol`, or as
/// text for none; made and encoded once per state of the set.
fn merged(
    metrics: &crate::telemetry::Metrics,
    set: &str,
    members: &Members,
    protocol: Option<(Protocol, &Context)>,
) -> Option<Result<Wire, Status>> {
    let merge = match merge(metrics, set, members)? {
        Ok(merge) => merge,
        Err(status) => return Some(Err(status)),
    };
    let text = members.wire(MERGED, |_| merge.configuration().into());
    Some(Ok(match protocol {
        None => text,
        Some((protocol, context)) => members.wire(protocol.slot(), |_| {
            protocol.encode(String::from_utf8_lossy(&text.bytes).into_owned(), context)
        }),
    }))
}

/// The gRPC metadata key a client sets to `true` to take a set's configurations as incremental
/// updates ([`flag_sets`](super::flag_sets)): a flagd source with `incrementalUpdates: true`
/// sends it in its `headers`.
pub const INCREMENTAL_HEADER: &str = "crd-broker-incremental-updates";

/// Whether a request asks for incremental updates of `target`: INVALID_ARGUMENT for a header
/// that is neither `true` nor `false`, or that asks them of one FeatureFlag or of the legacy
/// protocol (whose clients have no incremental updates).
fn incremental(
    metadata: &MetadataMap,
    target: &Target,
    protocol: Protocol,
) -> Result<bool, Status> {
    let wanted = match metadata.get(INCREMENTAL_HEADER).map(|v| v.to_str()) {
        None | Some(Ok("false")) => return Ok(false),
        Some(Ok("true")) => true,
        Some(value) => {
            let value = value.unwrap_or("(not text)");
            return Err(Status::invalid_argument(format!(
                "{INCREMENTAL_HEADER} is true or false, not {}",
                crate::selector::quote(value)
            )));
        }
    };
    if protocol == Protocol::Legacy {
        return Err(Status::invalid_argument(format!(
            "{INCREMENTAL_HEADER}: incremental updates are sent on flagd.sync.v1 only"
        )));
    }
    if let Target::One(_) = target {
        return Err(Status::invalid_argument(format!(
            "{INCREMENTAL_HEADER}: incremental updates are for a set of FeatureFlags (core.openfeature.dev/<namespace>?labelSelector=…); one FeatureFlag is sent whole"
        )));
    }
    Ok(wanted)
}

/// FeatureFlags at the version the API server prefers (discovery says which): not pinned, so
/// that a CRD that moves on to another version is followed.
fn featureflags() -> KindRef {
    KindRef {
        resource: "featureflags".into(),
        version: None,
        group: "core.openfeature.dev".into(),
    }
}

/// The selector a flagd request sends: the `flagd-selector` header if set, else the body.
fn selector_text<'a>(metadata: &'a MetadataMap, body: &'a str) -> &'a str {
    metadata
        .get(SELECTOR_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .unwrap_or(body)
        .trim()
}

/// INVALID_ARGUMENT for the selector `text`, saying why and what is accepted.
fn invalid_selector(text: &str, why: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!(
        "selector {} {why}; crd-broker accepts {FORMS}",
        crate::selector::quote(text)
    ))
}

/// What a flagd selector names, the set form too: the `flagd-selector` header if set, else the
/// body.
pub fn target(metadata: &MetadataMap, body: &str) -> Result<Target, Status> {
    let text = selector_text(metadata, body);
    let Some((path, _)) = text.split_once('?') else {
        return one_flag(text).map(Target::One);
    };
    let invalid = |why: String| invalid_selector(text, why);
    let parsed: Target = text
        .strip_prefix(PREFIX)
        .map(|rest| format!("featureflags.{PREFIX}{rest}"))
        .ok_or_else(|| invalid("is not a set of FeatureFlags".into()))?
        .parse()
        .map_err(invalid)?;
    let Target::Set(Set {
        namespace, labels, ..
    }) = parsed
    else {
        return Err(invalid("is not a set".into()));
    };
    if namespace.is_none() || path.matches('/').count() != 1 {
        return Err(invalid(
            "must have exactly a namespace after the group".into(),
        ));
    }
    Ok(Target::Set(Set {
        kind: featureflags(),
        namespace,
        labels,
    }))
}

/// The FeatureFlag a flagd selector names: the `flagd-selector` header if set, else the body.
pub fn selector(metadata: &MetadataMap, body: &str) -> Result<Selector, Status> {
    one_flag(selector_text(metadata, body))
}

/// The FeatureFlag `core.openfeature.dev/<namespace>/<name>` names.
fn one_flag(text: &str) -> Result<Selector, Status> {
    let invalid = |why: &str| invalid_selector(text, why);
    if text.is_empty() {
        return Err(invalid("is empty"));
    }
    if text.starts_with("file:") {
        return Err(invalid(
            "names a file: crd-broker does not read files from its own filesystem",
        ));
    }
    let rest = text
        .strip_prefix(PREFIX)
        .ok_or_else(|| invalid("is not a FeatureFlag"))?;
    let (namespace, name) = match rest.split('/').collect::<Vec<_>>().as_slice() {
        [ns, name] if !ns.is_empty() && !name.is_empty() => (*ns, *name),
        _ => {
            return Err(invalid(
                "must have exactly a namespace and a name after the group",
            ));
        }
    };
    // The error names the selector already: said once, with what is accepted.
    Selector::new(featureflags(), Some(namespace), name, text)
        .map_err(|e| Status::invalid_argument(format!("{e}; crd-broker accepts {FORMS}")))
}

/// The shared core of both flagd services.
pub struct FlagdCore<S> {
    registry: Registry<S>,
    access: Arc<Access>,
    shutdown: CancellationToken,
    limit: usize,
    /// What every `flagd.sync.v1` response carries as its `sync_context`, if anything.
    context: Context,
}

impl<S: Source> FlagdCore<S> {
    /// A core over `registry` whose callers `access` admits; streams end with UNAVAILABLE when
    /// `shutdown` is cancelled.
    pub fn new(registry: Registry<S>, access: Arc<Access>, shutdown: CancellationToken) -> Self {
        FlagdCore {
            registry,
            access,
            shutdown,
            limit: MAX_MESSAGE,
            context: None,
        }
    }

    /// Every `flagd.sync.v1` response carries `context` as its `sync_context`
    /// ([`sync_context`]).
    pub fn with_context(self, context: Context) -> Self {
        FlagdCore { context, ..self }
    }

    async fn sync_set(
        &self,
        request_drain: crate::conn::ConnDrain,
        caller: Caller,
        set: Set,
        protocol: Protocol,
        incremental: bool,
    ) -> Result<(String, Frames), Status> {
        let (set, members, ticket) = admit_one(&self.registry, &self.access, &caller, &set).await?;
        let end = End::new(request_drain, Some(ticket));
        let name = set.to_string();
        let registered = self.registry.subscribers().register(
            caller.to_string(),
            protocol.label(),
            vec![name.clone()],
        );
        let view = SetView {
            updates: if incremental {
                Updates::Incremental(Held::default())
            } else {
                Updates::Whole(None)
            },
            owed: Owed::new(Some((registered, 0))),
            metrics: self.registry.metrics().clone(),
            name: name.clone(),
            context: self.context.clone(),
            protocol,
            limit: self.limit,
            set,
        };
        let frames = Messages::new(members, end, tracing::Span::none(), view);
        Ok((name, frames.boxed()))
    }

    /// The configuration of a set once listed: merged, or (`incremental`) every flag set of
    /// it in one configuration, each flag naming its flag set.
    async fn fetch_set(
        &self,
        caller: Caller,
        set: Set,
        incremental: bool,
    ) -> Result<String, Status> {
        let (set, mut members, _ticket) =
            admit_one(&self.registry, &self.access, &caller, &set).await?;
        let name = set.to_string();
        let wait = async {
            loop {
                if let Some(merge) = merge(self.registry.metrics(), &name, &members.current()) {
                    return merge;
                }
                if !members.changed().await {
                    return Err(shutting_down());
                }
            }
        };
        let merge = tokio::time::timeout(FETCH_WAIT, wait).await.map_err(|_| {
            Status::unavailable(format!(
                "no answer from the source for {set} within {FETCH_WAIT:?}"
            ))
        })??;
        let config = if incremental {
            // A first update is one configuration.
            Held::default().next(merge.flag_sets()).concat()
        } else {
            merge.configuration()
        };
        if config.len() > self.limit {
            return Err(too_large(&name, config.len(), self.limit));
        }
        Ok(config)
    }

    /// A `SyncFlags` stream, counted under its selector until it ends
    /// ([`SyncStream`]), and ended with DEADLINE_EXCEEDED at the deadline its client gave.
    async fn sync<T>(
        &self,
        request: &Request<T>,
        body: &str,
        protocol: Protocol,
    ) -> Result<Frames, Status> {
        let deadline = deadline_of(request.metadata())?;
        let drain = drain_of(request, &self.shutdown);
        let (selector, frames) = self.frames(request, body, protocol, drain.clone()).await?;
        let stream = SyncStream::open(self.registry.metrics().clone(), &selector, deadline);
        Ok(counted(frames, stream, drain, deadline).boxed())
    }

    /// The canonical selector and the configurations of one `SyncFlags` stream.
    async fn frames<T>(
        &self,
        request: &Request<T>,
        body: &str,
        protocol: Protocol,
        drain: crate::conn::ConnDrain,
    ) -> Result<(String, Frames), Status> {
        let started = std::time::Instant::now();
        let target = target(request.metadata(), body)?;
        let incremental = incremental(request.metadata(), &target, protocol)?;
        let selector = match target {
            Target::One(selector) => selector,
            Target::Set(set) => {
                let caller = Caller::of(request.extensions())?;
                return self
                    .sync_set(drain, caller, set, protocol, incremental)
                    .await;
            }
        };
        let caller = Caller::of(request.extensions())?;
        let (canonical, subscription, ticket) =
            admit_one(&self.registry, &self.access, &caller, &selector).await?;
        let span = tracing::info_span!(
            "subscription",
            protocol = protocol.label(),
            selector = %canonical,
            caller = %caller
        );
        crate::telemetry::continue_trace(&span, request.metadata());
        let registered = self.registry.subscribers().register(
            caller.to_string(),
            protocol.label(),
            vec![canonical.to_string()],
        );
        let delivery = Delivery::new(
            self.registry.metrics().clone(),
            &canonical,
            protocol.metric(),
            started,
            subscription.cold,
            Some((registered, 0)),
        );
        let name = flag_name(&canonical);
        let context = self.context.clone();
        let next = configurations(protocol, context, name, self.limit, delivery, span.clone());
        let end = End::new(drain, Some(ticket));
        let frames = Messages::new(subscription, end, span, next).boxed();
        Ok((canonical.to_string(), frames))
    }

    async fn fetch<T>(
        &self,
        request: &Request<T>,
        body: &str,
        protocol: Protocol,
    ) -> Result<String, Status> {
        let caller = Caller::of(request.extensions())?;
        let target = target(request.metadata(), body)?;
        let incremental = incremental(request.metadata(), &target, protocol)?;
        let selector = match target {
            Target::One(selector) => selector,
            Target::Set(set) => return self.fetch_set(caller, set, incremental).await,
        };
        let (canonical, mut subscription, _ticket) =
            admit_one(&self.registry, &self.access, &caller, &selector).await?;
        let wait = async {
            loop {
                match subscription.current() {
                    State::Pending => {
                        if !subscription.changed().await {
                            return Err(shutting_down());
                        }
                    }
                    // An outage is waited out, within the client's deadline.
                    State::Failed(e) if e.is_outage() => {
                        if !subscription.changed().await {
                            return Err(shutting_down());
                        }
                    }
                    State::Failed(e) => return Err(source_status(0, &e)),
                    State::Present(u) => return Ok(flag_configuration(&u.object.json)),
                    State::Absent { .. } => return Ok(NO_FLAGS.to_string()),
                }
            }
        };
        let config = tokio::time::timeout(FETCH_WAIT, wait).await.map_err(|_| {
            Status::unavailable(format!(
                "no answer from the source for {canonical} within {FETCH_WAIT:?}"
            ))
        })??;
        if config.len() > self.limit {
            return Err(too_large(&flag_name(&canonical), config.len(), self.limit));
        }
        Ok(config)
    }
}

/// `namespace/name`, for messages.
fn flag_name(selector: &Selector) -> String {
    format!(
        "{}/{}",
        selector.namespace.as_deref().unwrap_or_default(),
        selector.name
    )
}

fn too_large(name: &str, size: usize, limit: usize) -> Status {
    tracing::error!(
        featureflag = name,
        size,
        limit,
        "flag configuration over the clients' message limit; not sent"
    );
    Status::resource_exhausted(format!(
        "FeatureFlag {name} makes a flag configuration of {size} bytes; flagd clients accept at most {limit} bytes"
    ))
}

/// How a set's configurations reach one client.
enum Updates {
    /// The whole merged configuration whenever it changes; the digest of the last sent.
    Whole(Option<u64>),
    /// Only the flag sets that changed ([`Held`]).
    Incremental(Held),
}

/// One client's view of a set's configurations: the first at once, then each change.
struct SetView {
    updates: Updates,
    /// Configurations made and not yet sent (an incremental update may be several).
    owed: Owed<Bytes>,
    metrics: Arc<crate::telemetry::Metrics>,
    name: String,
    context: Context,
    protocol: Protocol,
    limit: usize,
    set: Set,
}

impl View<Members> for SetView {
    type Message = Encoded;
    type Input = std::convert::Infallible;

    fn next(&mut self, current: &Members) -> Next<Encoded> {
        if let Err(status) = self.queue_for(current) {
            return Next::Fail(status);
        }
        self.owed.bring_to(current.version(&self.set));
        match self.owed.pop() {
            Some(config) => Next::Send(Encoded(config)),
            None => Next::Wait,
        }
    }

    fn more(&mut self) -> Option<Encoded> {
        self.owed.pop().map(Encoded)
    }
}

impl SetView {
    /// Queues the configurations `current` owes the client.
    fn queue_for(&mut self, current: &Members) -> Result<(), Status> {
        let (metrics, name, limit) = (&self.metrics, &self.name, self.limit);
        match &mut self.updates {
            Updates::Whole(last) => {
                let Some(wire) =
                    merged(metrics, name, current, Some((self.protocol, &self.context)))
                else {
                    return Ok(());
                };
                let wire = wire?;
                if *last != Some(wire.digest) {
                    if wire.bytes.len() > limit {
                        return Err(too_large(name, wire.bytes.len(), limit));
                    }
                    *last = Some(wire.digest);
                    self.owed.push(wire.bytes);
                }
            }
            Updates::Incremental(held) => {
                let Some(merge) = merge(metrics, name, current) else {
                    return Ok(());
                };
                for config in held.next(merge?.flag_sets()) {
                    if config.len() > limit {
                        return Err(too_large(name, config.len(), limit));
                    }
                    self.owed.push(self.protocol.encode(config, &self.context));
                }
            }
        }
        Ok(())
    }
}

/// The configurations for one subscriber: at once, then each one that differs from the last sent.
fn configurations(
    protocol: Protocol,
    context: Context,
    name: String,
    limit: usize,
    mut delivery: Delivery,
    span: tracing::Span,
) -> impl FnMut(&State) -> Next<Encoded> + Send + Unpin + 'static {
    let mut last = None::<u64>;
    move |state| {
        let wire = match state {
            State::Pending => return Next::Wait,
            // Failed before anything was sent, or the kind is no longer served: the stream
            // ends, and a flagd client reconnects and resolves its selector again.
            State::Failed(e) if (last.is_none() && !e.is_outage()) || e.is_gone() => {
                return Next::Fail(source_status(0, e));
            }
            State::Failed(_) => return Next::Wait,
            State::Present(u) => u.wire(protocol.slot(), |o| {
                protocol.encode(flag_configuration(&o.json), &context)
            }),
            State::Absent { .. } => Wire::new(protocol.encode(NO_FLAGS.to_string(), &context)),
        };
        if last == Some(wire.digest) {
            return Next::Wait;
        }
        if wire.bytes.len() > limit {
            return Next::Fail(span.in_scope(|| too_large(&name, wire.bytes.len(), limit)));
        }
        last = Some(wire.digest);
        delivery.sent(match state {
            State::Present(u) => Some(u),
            _ => None,
        });
        Next::Send(Encoded(wire.bytes))
    }
}

/// `flagd.sync.v1.FlagSyncService`.
pub struct FlagdService<S>(pub std::sync::Arc<FlagdCore<S>>);

/// `sync.v1.FlagSyncService`.
pub struct LegacyService<S>(pub std::sync::Arc<FlagdCore<S>>);

#[tonic::async_trait]
impl<S: Source> flagd::flag_sync_service_server::FlagSyncService for FlagdService<S> {
    type SyncFlagsStream = Frames;

    async fn sync_flags(
        &self,
        request: Request<flagd::SyncFlagsRequest>,
    ) -> Result<Response<Self::SyncFlagsStream>, Status> {
        let body = request.get_ref().selector.clone();
        let stream = self.0.sync(&request, &body, Protocol::Flagd).await?;
        Ok(Response::new(stream))
    }

    async fn fetch_all_flags(
        &self,
        request: Request<flagd::FetchAllFlagsRequest>,
    ) -> Result<Response<flagd::FetchAllFlagsResponse>, Status> {
        let config = (self.0)
            .fetch(&request, &request.get_ref().selector, Protocol::Flagd)
            .await?;
        Ok(Response::new(flagd::FetchAllFlagsResponse {
            flag_configuration: config,
        }))
    }

    async fn get_metadata(
        &self,
        _request: Request<flagd::GetMetadataRequest>,
    ) -> Result<Response<flagd::GetMetadataResponse>, Status> {
        // Present, empty but for `--context-value`: the Python provider needs the field, and
        // whatever it holds becomes evaluation context for every evaluation.
        let context = self.0.context.as_deref().cloned().unwrap_or_default();
        Ok(Response::new(flagd::GetMetadataResponse {
            metadata: Some(context),
        }))
    }
}

#[tonic::async_trait]
impl<S: Source> legacy::flag_sync_service_server::FlagSyncService for LegacyService<S> {
    type SyncFlagsStream = Frames;

    async fn sync_flags(
        &self,
        request: Request<legacy::SyncFlagsRequest>,
    ) -> Result<Response<Self::SyncFlagsStream>, Status> {
        let body = request.get_ref().selector.clone();
        let stream = self.0.sync(&request, &body, Protocol::Legacy).await?;
        Ok(Response::new(stream))
    }

    async fn fetch_all_flags(
        &self,
        request: Request<legacy::FetchAllFlagsRequest>,
    ) -> Result<Response<legacy::FetchAllFlagsResponse>, Status> {
        let config = (self.0)
            .fetch(&request, &request.get_ref().selector, Protocol::Legacy)
            .await?;
        Ok(Response::new(legacy::FetchAllFlagsResponse {
            flag_configuration: config,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::metadata::MetadataValue;

    fn meta(header: Option<&str>) -> MetadataMap {
        let mut m = MetadataMap::new();
        if let Some(h) = header {
            m.insert(SELECTOR_HEADER, MetadataValue::try_from(h).unwrap());
        }
        m
    }

    #[test]
    fn the_header_wins_over_the_body() {
        let s = selector(
            &meta(Some("core.openfeature.dev/a/one")),
            "core.openfeature.dev/b/two",
        )
        .unwrap();
        // No version: the API server's preferred one is resolved later.
        assert_eq!(s.to_string(), "featureflags.core.openfeature.dev/a/one");
        let s = selector(&meta(None), "core.openfeature.dev/b/two").unwrap();
        assert_eq!(s.to_string(), "featureflags.core.openfeature.dev/b/two");
    }

    #[test]
    fn other_selectors_are_invalid_and_name_the_accepted_form() {
        for bad in [
            "",
            "file:/etc/flagd/config.json",
            "coreXopenfeature.dev/a/b",
            "core.openfeature.dev/a",
            "core.openfeature.dev/a/b/c",
            "core.openfeature.dev/A/b",
            "flagSetId=x",
        ] {
            let status = selector(&meta(None), bad).unwrap_err();
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{bad}");
            assert!(
                status
                    .message()
                    .contains("core.openfeature.dev/<namespace>/<name>"),
                "{bad}: {}",
                status.message()
            );
        }
    }

    #[test]
    fn a_bad_part_names_the_selector_once() {
        let status = selector(&meta(None), "core.openfeature.dev/DEFAULT/demo").unwrap_err();
        let message = status.message();
        assert_eq!(
            message.matches("core.openfeature.dev/DEFAULT/demo").count(),
            1,
            "{message}"
        );
        assert!(message.contains("namespace \"DEFAULT\""), "{message}");
    }

    #[test]
    fn the_configuration_is_the_flag_spec_unchanged() {
        let ff = br#"{"metadata":{"name":"x"},"spec":{"flagSpec":{"flags":{"f":{"state":"ENABLED","variants":{"on":true},"defaultVariant":"on","targeting":{}}},"$evaluators":{"e":{"in":[1,[1]]}},"metadata":{"flagSetId":"s"}}}}"#;
        let config: Value = serde_json::from_str(&flag_configuration(ff)).unwrap();
        let expected: Value =
            serde_json::from_slice::<Value>(ff).unwrap()["spec"]["flagSpec"].clone();
        assert_eq!(config, expected);
        assert_eq!(flag_configuration(br#"{"spec":{}}"#), NO_FLAGS);
    }

    fn json() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "\\PC{0,12}".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 40, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
                prop::collection::btree_map("[a-z$]{0,6}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        #[test]
        fn the_configuration_is_the_flag_spec_whatever_it_holds(spec in json(), rest in json()) {
            let object = serde_json::json!({ "metadata": { "name": "x" }, "spec": { "flagSpec": spec, "other": rest } });
            let config: Value = serde_json::from_str(&flag_configuration(object.to_string().as_bytes())).unwrap();
            if spec.is_object() {
                proptest::prop_assert_eq!(config, spec);
            } else {
                proptest::prop_assert_eq!(config, serde_json::json!({ "flags": {} }));
            }
        }

        #[test]
        fn any_bytes_make_a_configuration_without_panicking(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            let config: Value = serde_json::from_str(&flag_configuration(&bytes)).unwrap();
            proptest::prop_assert!(config.is_object());
        }
    }

    #[test]
    fn legacy_responses_say_all() {
        let bytes = Protocol::Legacy.encode(NO_FLAGS.into(), &None);
        let r = legacy::SyncFlagsResponse::decode(bytes).unwrap();
        assert_eq!(r.state(), legacy::SyncState::All);
        assert_eq!(r.flag_configuration, NO_FLAGS);
        let r = flagd::SyncFlagsResponse::decode(Protocol::Flagd.encode(NO_FLAGS.into(), &None))
            .unwrap();
        assert!(r.sync_context.is_none());
    }
}
