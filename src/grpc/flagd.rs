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

use super::frame::Encoded;
use super::messages::{End, Messages, Next};
use super::{Delivery, admit_one, drain_of, shutting_down, source_status};
use crate::access::{Access, Caller};
use crate::pb::{flagd, legacy};
use crate::registry::{Members, Registry, State, Wire};
use crate::selector::{KindRef, Selector};
use crate::source::{Set, Source};
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

/// What a merge reads of one FeatureFlag: its namespace, and each of its flags and
/// `$evaluators` as written (JSON kept as text, not rebuilt). Decoded once per state of the
/// FeatureFlag ([`crate::registry::Update::decoded`]), so a change to one member of a large set
/// costs its own decoding, not every member's.
#[derive(Debug, Default)]
pub struct MemberSpec {
    namespace: String,
    flags: Vec<(String, Box<serde_json::value::RawValue>)>,
    evaluators: Vec<(String, Box<serde_json::value::RawValue>)>,
}

impl MemberSpec {
    /// The spec of the FeatureFlag `object`; none of its flags if they do not parse.
    pub fn of(object: &crate::source::Object) -> MemberSpec {
        #[derive(serde::Deserialize, Default)]
        struct Document {
            #[serde(default)]
            metadata: Metadata,
            #[serde(default)]
            spec: Option<FeatureFlagSpec>,
        }
        #[derive(serde::Deserialize, Default)]
        struct Metadata {
            #[serde(default)]
            namespace: String,
        }
        #[derive(serde::Deserialize)]
        struct FeatureFlagSpec {
            #[serde(rename = "flagSpec", default)]
            flag_spec: Option<FlagSpec>,
        }
        #[derive(serde::Deserialize)]
        struct FlagSpec {
            #[serde(default)]
            flags: Option<std::collections::BTreeMap<String, Box<serde_json::value::RawValue>>>,
            #[serde(rename = "$evaluators", default)]
            evaluators:
                Option<std::collections::BTreeMap<String, Box<serde_json::value::RawValue>>>,
        }
        let document: Document = serde_json::from_slice(&object.json).unwrap_or_default();
        let spec = document.spec.and_then(|s| s.flag_spec);
        let (flags, evaluators) = spec.map_or((None, None), |s| (s.flags, s.evaluators));
        MemberSpec {
            namespace: document.metadata.namespace,
            flags: flags.into_iter().flatten().collect(),
            evaluators: evaluators.into_iter().flatten().collect(),
        }
    }
}

/// The merged flag configuration of a set's FeatureFlags, given in name order (namespace, then
/// name, for a set of every namespace): each flag key (and `$evaluators` key) from the first
/// FeatureFlag of its namespace that defines it; the keys defined again. A key that FeatureFlags
/// of two namespaces define is served from neither: no namespace may shadow another's flag by
/// sorting first.
pub fn merged_configuration<'a>(
    specs: impl IntoIterator<Item = &'a MemberSpec>,
) -> (String, Vec<String>) {
    use serde_json::value::RawValue;
    use std::collections::BTreeMap;
    // Each key: the namespace that defined it first, its JSON, and whether another namespace
    // defines it too.
    type Merged<'s> = BTreeMap<&'s str, (&'s str, &'s RawValue, bool)>;
    let mut flags: Merged = BTreeMap::new();
    let mut evaluators: Merged = BTreeMap::new();
    let mut conflicts = Vec::new();
    for spec in specs {
        for (field, from, into) in [
            ("flags", &spec.flags, &mut flags),
            ("$evaluators", &spec.evaluators, &mut evaluators),
        ] {
            for (key, value) in from {
                match into.get_mut(key.as_str()) {
                    None => {
                        into.insert(key, (&spec.namespace, value, false));
                    }
                    Some((namespace, _, _)) if *namespace == spec.namespace => {
                        conflicts.push(format!("{field}.{key}"));
                    }
                    Some((namespace, _, across)) => {
                        conflicts.push(format!(
                            "{field}.{key} (in {namespace} and {}: served from neither)",
                            spec.namespace
                        ));
                        *across = true;
                    }
                }
            }
        }
    }
    let write = |text: &mut String, merged: &Merged| {
        text.push('{');
        let mut first = true;
        for (key, (_, value, across)) in merged {
            if *across {
                continue;
            }
            if !std::mem::take(&mut first) {
                text.push(',');
            }
            text.push_str(&Value::from(*key).to_string());
            text.push(':');
            text.push_str(value.get());
        }
        text.push('}');
    };
    let mut config = String::from("{\"flags\":");
    write(&mut config, &flags);
    if evaluators.values().any(|(_, _, across)| !across) {
        config.push_str(",\"$evaluators\":");
        write(&mut config, &evaluators);
    }
    config.push('}');
    (config, conflicts)
}

/// Which [`Members::wire`] slot holds a set's merged configuration as text; the protocols'
/// encodings of it are in their own slots.
const MERGED: usize = crate::registry::slot::FLAGD_MERGED;

/// The merged configuration of a set's `members` once listed (`None` before), encoded for
/// `protocol`, or as text for none. It is made and encoded once per state of the set, whatever
/// the number of its subscribers, and its conflicts are counted and logged then.
fn merged(
    metrics: &crate::telemetry::Metrics,
    set: &str,
    members: &Members,
    protocol: Option<(Protocol, &Context)>,
) -> Option<Result<Wire, Status>> {
    if !members.synced {
        return match &members.failure {
            Some(e) if !e.is_outage() => Some(Err(source_status(0, e))),
            _ => None,
        };
    }
    let text = members.wire(MERGED, |members| {
        let specs: Vec<Arc<MemberSpec>> = members
            .objects
            .values()
            .map(|u| u.decoded(MemberSpec::of))
            .collect();
        let (config, conflicts) = merged_configuration(specs.iter().map(|s| &**s));
        if !conflicts.is_empty() {
            metrics.subscriptions.flag_conflicts.inc_by(conflicts.len() as u64);
            tracing::warn!(%set, keys = ?conflicts, "flags defined by more than one FeatureFlag of a set; the first in name order of a namespace is kept, and one two namespaces define is served from neither");
        }
        config.into()
    });
    Some(Ok(match protocol {
        None => text,
        Some((protocol, context)) => members.wire(protocol.slot(), |_| {
            protocol.encode(String::from_utf8_lossy(&text.bytes).into_owned(), context)
        }),
    }))
}

/// What a flagd selector names: one FeatureFlag, or a set of them.
pub enum Target {
    /// `core.openfeature.dev/<namespace>/<name>`.
    One(Selector),
    /// `core.openfeature.dev/<namespace>?labelSelector=<URL-encoded selector>`.
    Set(Set),
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
    let parsed: crate::selector::Target = text
        .strip_prefix(PREFIX)
        .map(|rest| format!("featureflags.{PREFIX}{rest}"))
        .ok_or_else(|| invalid("is not a set of FeatureFlags".into()))?
        .parse()
        .map_err(invalid)?;
    let crate::selector::Target::Set {
        namespace, labels, ..
    } = parsed
    else {
        return Err(invalid("is not a set".into()));
    };
    if namespace.is_none() || path.matches('/').count() != 1 {
        return Err(invalid(
            "must have exactly a namespace after the group".into(),
        ));
    }
    let labels = labels
        .parse()
        .map_err(|e: String| invalid(format!("has a bad label selector: {e}")))?;
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
    ) -> Result<(String, Frames), Status> {
        let (set, members, ticket) = admit_one(&self.registry, &self.access, &caller, &set).await?;
        let (metrics, limit) = (self.registry.metrics().clone(), self.limit);
        let revoked = ticket.revoked();
        let ends = Box::pin(async move {
            let _ticket = ticket;
            tokio::select! {
                _ = request_drain.token().cancelled() => super::drained(request_drain.reason()),
                status = revoked => status,
            }
        });
        let name = set.to_string();
        let selector = name.clone();
        let context = self.context.clone();
        let frames = futures::stream::unfold(
            (members, ends, None::<u64>, true),
            move |(mut members, mut ends, last, first)| {
                let metrics = metrics.clone();
                let name = name.clone();
                let context = context.clone();
                async move {
                    let mut first = first;
                    loop {
                        if !std::mem::take(&mut first) {
                            tokio::select! {
                                status = &mut ends => return Some((Err(status), (members, ends, last, false))),
                                changed = members.changed() => if !changed {
                                    return Some((Err(shutting_down()), (members, ends, last, false)));
                                },
                            }
                        }
                        let current = members.current();
                        match merged(&metrics, &name, &current, Some((protocol, &context))) {
                            None => continue,
                            Some(Err(status)) => {
                                return Some((Err(status), (members, ends, last, false)));
                            }
                            Some(Ok(wire)) if last == Some(wire.digest) => continue,
                            Some(Ok(wire)) if wire.bytes.len() > limit => {
                                let status = too_large(&name, wire.bytes.len(), limit);
                                return Some((Err(status), (members, ends, last, false)));
                            }
                            Some(Ok(wire)) => {
                                let digest = Some(wire.digest);
                                return Some((
                                    Ok(Encoded(wire.bytes)),
                                    (members, ends, digest, false),
                                ));
                            }
                        }
                    }
                }
            },
        );
        Ok((selector, super::until_error(frames).boxed()))
    }

    async fn fetch_set(&self, caller: Caller, set: Set) -> Result<String, Status> {
        let (set, mut members, _ticket) =
            admit_one(&self.registry, &self.access, &caller, &set).await?;
        let name = set.to_string();
        let wait = async {
            loop {
                let current = members.current();
                if let Some(config) = merged(self.registry.metrics(), &name, &current, None) {
                    return config;
                }
                if !members.changed().await {
                    return Err(shutting_down());
                }
            }
        };
        let config = tokio::time::timeout(FETCH_WAIT, wait).await.map_err(|_| {
            Status::unavailable(format!(
                "no answer from the source for {set} within {FETCH_WAIT:?}"
            ))
        })??;
        if config.bytes.len() > self.limit {
            return Err(too_large(&name, config.bytes.len(), self.limit));
        }
        Ok(String::from_utf8_lossy(&config.bytes).into_owned())
    }

    /// A `SyncFlags` stream, counted under its selector until it ends
    /// ([`SyncStream`]), and ended with DEADLINE_EXCEEDED at the deadline its client gave.
    async fn sync<T>(
        &self,
        request: &Request<T>,
        body: &str,
        protocol: Protocol,
    ) -> Result<Frames, Status> {
        let deadline = super::deadline_of(request.metadata())?;
        let drain = drain_of(request, &self.shutdown);
        let (selector, frames) = self.frames(request, body, protocol, drain.clone()).await?;
        let stream = SyncStream::open(self.registry.metrics().clone(), &selector, deadline);
        Ok(super::counted(frames, stream, drain, deadline).boxed())
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
        let selector = match target(request.metadata(), body)? {
            Target::One(selector) => selector,
            Target::Set(set) => {
                let caller = Caller::of(request.extensions())?;
                return self.sync_set(drain, caller, set, protocol).await;
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
        let delivery = Delivery::new(
            self.registry.metrics().clone(),
            &canonical,
            protocol.metric(),
            started,
            subscription.cold,
        );
        let name = flag_name(&canonical);
        let context = self.context.clone();
        let next = configurations(protocol, context, name, self.limit, delivery, span.clone());
        let end = End::new(drain, Some(ticket));
        let frames = Messages::new(subscription, end, span, next).boxed();
        Ok((canonical.to_string(), frames))
    }

    async fn fetch<T>(&self, request: &Request<T>, body: &str) -> Result<String, Status> {
        let caller = Caller::of(request.extensions())?;
        let selector = match target(request.metadata(), body)? {
            Target::One(selector) => selector,
            Target::Set(set) => return self.fetch_set(caller, set).await,
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
            State::Present(u) => Some(u.as_ref()),
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
        let config = self.0.fetch(&request, &request.get_ref().selector).await?;
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
        let config = self.0.fetch(&request, &request.get_ref().selector).await?;
        Ok(Response::new(legacy::FetchAllFlagsResponse {
            flag_configuration: config,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::metadata::MetadataValue;

    fn member(namespace: &str, flags: serde_json::Value) -> MemberSpec {
        let object = serde_json::json!({
            "metadata": { "name": "f", "namespace": namespace },
            "spec": { "flagSpec": { "flags": flags, "$evaluators": { "e": { "in": [1] } } } },
        });
        MemberSpec::of(&crate::source::Object::from_value(&object))
    }

    #[test]
    fn a_merge_keeps_a_namespaces_first_definition_and_serves_no_key_two_namespaces_define() {
        let specs = [
            member(
                "team-a",
                serde_json::json!({ "x": { "v": 1 }, "y": { "v": 1 } }),
            ),
            member(
                "team-a",
                serde_json::json!({ "y": { "v": 2 }, "z": { "v": 2 } }),
            ),
            member(
                "team-b",
                serde_json::json!({ "z": { "v": 3 }, "w": { "v": 3 } }),
            ),
        ];
        let (config, conflicts) = merged_configuration(&specs);
        let config: Value = serde_json::from_str(&config).unwrap();
        assert_eq!(
            config["flags"],
            serde_json::json!({ "w": { "v": 3 }, "x": { "v": 1 }, "y": { "v": 1 } }),
            "y from team-a's first; z, in both namespaces, from neither"
        );
        assert_eq!(
            conflicts,
            [
                "flags.y",
                "$evaluators.e",
                "flags.z (in team-a and team-b: served from neither)",
                "$evaluators.e (in team-a and team-b: served from neither)",
            ]
        );
        assert!(config.get("$evaluators").is_none(), "{config}");
        // One namespace: as before, the first in name order.
        let (config, _) = merged_configuration(&specs[..2]);
        let config: Value = serde_json::from_str(&config).unwrap();
        assert_eq!(config["flags"]["y"]["v"], 1);
        assert_eq!(config["$evaluators"]["e"]["in"][0], 1);
    }

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
