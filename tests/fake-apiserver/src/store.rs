//! The fake's etcd and watch cache in one: objects per kind, one global resourceVersion, a
//! bounded event history with a moving floor, and the open watchers fed under the same lock as
//! every write, so no watcher ever misses or repeats an event.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use serde_json::{Map, Value, json};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::crd::Kind;
use crate::error::{ApiError, Result, Target};
use crate::render::{self, Format};
use crate::schema;
use crate::selector::{FieldSelector, LabelSelector};

/// Identifies a stored resource: `(group, plural)`.
pub type ResKey = (String, String);

/// The namespace (empty for cluster-scoped objects) and name of an object.
type ObjKey = (String, String);

/// What a request addresses: a kind at one of its versions, and a namespace (`None` means every
/// namespace for a list or watch, and is the only choice for a cluster-scoped kind).
#[derive(Debug, Clone)]
pub struct Scope {
    /// The kind.
    pub kind: Arc<Kind>,
    /// The version the request named; objects are rendered at it.
    pub version: String,
    /// The namespace in the path.
    pub namespace: Option<String>,
}

impl Scope {
    fn key(&self) -> ResKey {
        (self.kind.group.clone(), self.kind.plural.clone())
    }

    /// The group and plural, for error messages.
    pub fn target(&self) -> Target<'_> {
        Target {
            group: &self.kind.group,
            plural: &self.kind.plural,
        }
    }

    fn kind_group(&self) -> String {
        if self.kind.group.is_empty() {
            self.kind.kind.clone()
        } else {
            format!("{}.{}", self.kind.kind, self.kind.group)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One change in the history: the object after it (for a delete, the last state with the
/// deletion's resourceVersion) and before it.
#[derive(Debug, Clone)]
struct Event {
    rv: u64,
    res: ResKey,
    ty: EventType,
    obj: Arc<Value>,
    prev: Option<Arc<Value>>,
}

/// An open watch, as the store sees it.
pub(crate) struct Watcher {
    pub(crate) res: ResKey,
    pub(crate) version: String,
    pub(crate) namespace: Option<String>,
    pub(crate) fields: FieldSelector,
    pub(crate) labels: LabelSelector,
    pub(crate) bookmarks: bool,
    pub(crate) format: Format,
    /// Whether a Table event with column definitions went out (only the first carries them).
    pub(crate) columns_sent: bool,
    pub(crate) tx: mpsc::Sender<Bytes>,
    pub(crate) info: WatchInfo,
    pub(crate) deadline: Instant,
    pub(crate) next_bookmark: Instant,
}

/// A description of one open watch connection, for assertions.
#[derive(Debug, Clone, PartialEq)]
pub struct WatchInfo {
    /// The request path, e.g. `/apis/g/v1/namespaces/ns/foos`.
    pub path: String,
    /// The raw `fieldSelector`, empty if none.
    pub field_selector: String,
    /// The raw `labelSelector`, empty if none.
    pub label_selector: String,
    /// The resourceVersion the watch started from, as sent.
    pub resource_version: String,
    /// When it was opened.
    pub since: SystemTime,
}

/// List parameters, already parsed.
#[derive(Debug, Clone, Default)]
pub struct ListOpts {
    /// `fieldSelector`.
    pub fields: FieldSelector,
    /// `labelSelector`.
    pub labels: LabelSelector,
    /// `limit` (0 means none).
    pub limit: Option<usize>,
    /// `continue`.
    pub continue_token: Option<String>,
    /// `resourceVersion`.
    pub rv: Option<String>,
    /// `resourceVersionMatch`.
    pub rv_match: Option<String>,
    /// `sendInitialEvents` (forbidden on a list).
    pub send_initial_events: Option<bool>,
}

/// Watch parameters, already parsed.
#[derive(Debug, Clone, Default)]
pub struct WatchOpts {
    /// `fieldSelector`.
    pub fields: FieldSelector,
    /// `labelSelector`.
    pub labels: LabelSelector,
    /// `resourceVersion`.
    pub rv: Option<String>,
    /// `resourceVersionMatch`.
    pub rv_match: Option<String>,
    /// `allowWatchBookmarks`.
    pub bookmarks: bool,
    /// `sendInitialEvents`.
    pub send_initial_events: Option<bool>,
    /// `timeoutSeconds`.
    pub timeout: Option<Duration>,
}

/// Write parameters shared by create, update and patch.
#[derive(Debug, Clone, Default)]
pub struct WriteOpts {
    /// `dryRun=All`: validate and answer, store nothing.
    pub dry_run: bool,
    /// `fieldValidation`: `Strict` rejects unknown fields, `Warn` (the default) and `Ignore`
    /// prune them.
    pub field_validation: Option<String>,
    /// Whether the write is a PATCH, whose strict-decoding errors the real server reports as a
    /// 422 on the field `patch` rather than a 400.
    pub patch: bool,
}

/// The result of a write: the object and any warnings for the `Warning` header.
#[derive(Debug, Clone)]
pub struct Written {
    /// The object as stored (rendered at the request's version).
    pub object: Value,
    /// Warnings (unknown fields under `fieldValidation=Warn`, or by default).
    pub warnings: Vec<String>,
    /// Whether the write created the object (201 rather than 200).
    pub created: bool,
}

/// The whole stored state.
pub(crate) struct State {
    pub(crate) rv: u64,
    pub(crate) kinds: BTreeMap<ResKey, Arc<Kind>>,
    objects: HashMap<ResKey, BTreeMap<ObjKey, Arc<Value>>>,
    history: VecDeque<Event>,
    pub(crate) floor: u64,
    pub(crate) history_limit: usize,
    pub(crate) watchers: BTreeMap<u64, Watcher>,
    pub(crate) next_watcher: u64,
    pub(crate) rv_tx: watch::Sender<u64>,
    pub(crate) watch_buffer: usize,
    pub(crate) bookmark_every: Duration,
}

/// The verbs' common parts: which stored object a request is about.
struct Addr<'a> {
    scope: &'a Scope,
    name: &'a str,
}

impl State {
    pub(crate) fn new(
        first_rv: u64,
        history_limit: usize,
        watch_buffer: usize,
        bookmark_every: Duration,
    ) -> Self {
        let (rv_tx, _) = watch::channel(first_rv);
        State {
            rv: first_rv,
            kinds: BTreeMap::new(),
            objects: HashMap::new(),
            history: VecDeque::new(),
            floor: first_rv,
            history_limit,
            watchers: BTreeMap::new(),
            next_watcher: 1,
            rv_tx,
            watch_buffer,
            bookmark_every,
        }
    }

    /// Registers a kind (a built-in, or one a CRD defines).
    pub(crate) fn add_kind(&mut self, kind: Kind) {
        let key = (kind.group.clone(), kind.plural.clone());
        self.objects.entry(key.clone()).or_default();
        self.kinds.insert(key, Arc::new(kind));
    }

    /// The kind served at `group/version` under `plural`.
    pub(crate) fn find_kind(&self, group: &str, version: &str, plural: &str) -> Option<Arc<Kind>> {
        self.kinds
            .get(&(group.to_string(), plural.to_string()))
            .filter(|k| k.version(version).is_some())
            .cloned()
    }

    /// The kind whose `kind` field is `kind_name` in `group`, served at `version`.
    pub(crate) fn find_kind_by_name(
        &self,
        group: &str,
        version: &str,
        kind_name: &str,
    ) -> Option<Arc<Kind>> {
        self.kinds
            .values()
            .find(|k| k.group == group && k.kind == kind_name && k.version(version).is_some())
            .cloned()
    }

    fn objects(&self, key: &ResKey) -> impl Iterator<Item = (&ObjKey, &Arc<Value>)> {
        self.objects.get(key).into_iter().flatten()
    }

    fn stored(&self, addr: &Addr<'_>) -> Option<&Arc<Value>> {
        self.objects
            .get(&addr.scope.key())?
            .get(&(ns_of(addr.scope), addr.name.to_string()))
    }

    // === reads ===

    /// GET one object.
    pub(crate) fn get(&self, scope: &Scope, name: &str) -> Result<Value> {
        let addr = Addr { scope, name };
        self.stored(&addr)
            .map(|o| render::at_version(&scope.kind, &scope.version, o))
            .ok_or_else(|| ApiError::not_found(scope.target(), name))
    }

    /// LIST, with the resourceVersion semantics of the API-concepts tables and paging.
    /// The caller has already waited for a resourceVersion ahead of the store (see
    /// [`State::too_large`]).
    pub(crate) fn list(&self, scope: &Scope, opts: &ListOpts, format: &Format) -> Result<Value> {
        validate_list(opts)?;
        let (snapshot_rv, after) = match &opts.continue_token {
            Some(token) => {
                let (rv, after) = decode_continue(token)?;
                if rv < self.floor {
                    return Err(ApiError::expired(
                        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.",
                    ));
                }
                (rv, Some(after))
            }
            None => (self.list_rv(opts)?, None),
        };
        let all = self.state_at(&scope.key(), snapshot_rv);
        let mut matching = all
            .into_iter()
            .filter(|(k, _)| after.as_ref().is_none_or(|a| k > a))
            .filter(|(_, o)| self.in_scope(scope, o, &opts.fields, &opts.labels));
        let limit = opts.limit.filter(|l| *l > 0);
        let mut items: Vec<Arc<Value>> = Vec::new();
        let mut more = false;
        for (_, obj) in matching.by_ref() {
            if limit.is_some_and(|l| items.len() == l) {
                more = true;
                break;
            }
            items.push(obj);
        }
        let mut metadata = json!({ "resourceVersion": snapshot_rv.to_string() });
        if more {
            // The item that did not fit counts too.
            let remaining = 1 + matching.count();
            let last = items.last().map(|o| obj_key(o)).unwrap_or_default();
            metadata["continue"] = json!(encode_continue(snapshot_rv, &last));
            if opts.fields.is_empty() && opts.labels.is_empty() {
                metadata["remainingItemCount"] = json!(remaining);
            }
        }
        Ok(render::list(
            &scope.kind,
            &scope.version,
            &items,
            metadata,
            format,
        ))
    }

    /// The snapshot resourceVersion a list without a continue token reads at.
    fn list_rv(&self, opts: &ListOpts) -> Result<u64> {
        let exact = match (opts.rv.as_deref(), opts.rv_match.as_deref()) {
            (None, _) | (Some("0"), _) => return Ok(self.rv),
            (Some(_), Some("Exact")) => true,
            (Some(_), Some(_)) => false,
            (Some(_), None) => opts.limit.is_some_and(|l| l > 0),
        };
        let n = parse_rv(opts.rv.as_deref().unwrap_or(""))?;
        if !exact {
            return Ok(self.rv.max(n));
        }
        if n < self.floor {
            return Err(ApiError::expired(
                "The resourceVersion for the provided list is too old.",
            ));
        }
        Ok(n)
    }

    /// Whether a list or get at `rv` asks for a resourceVersion the store has not reached: the
    /// real server waits up to three seconds for it, then answers 504.
    pub(crate) fn too_large(&self, rv: Option<&str>) -> Option<u64> {
        let n: u64 = rv?.parse().ok()?;
        (n > self.rv).then_some(n)
    }

    /// The objects of a kind as they were at `rv` (≥ floor), by rolling the history back.
    fn state_at(&self, key: &ResKey, rv: u64) -> BTreeMap<ObjKey, Arc<Value>> {
        let mut state: BTreeMap<ObjKey, Arc<Value>> = self
            .objects(key)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for ev in self.history.iter().rev().take_while(|e| e.rv > rv) {
            if &ev.res != key {
                continue;
            }
            let k = obj_key(&ev.obj);
            match &ev.prev {
                Some(prev) => state.insert(k, prev.clone()),
                None => state.remove(&k),
            };
        }
        state
    }

    fn in_scope(
        &self,
        scope: &Scope,
        obj: &Value,
        fields: &FieldSelector,
        labels: &LabelSelector,
    ) -> bool {
        scope
            .namespace
            .as_deref()
            .is_none_or(|ns| obj["metadata"]["namespace"].as_str() == Some(ns))
            && fields.matches(obj)
            && labels.matches(obj)
    }

    // === writes ===

    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    /// Records a change, trims the history and feeds every watcher it concerns.
    fn commit(&mut self, res: ResKey, ty: EventType, obj: Arc<Value>, prev: Option<Arc<Value>>) {
        let key = obj_key(&obj);
        let objects = self.objects.entry(res.clone()).or_default();
        if ty == EventType::Deleted {
            objects.remove(&key);
        } else {
            objects.insert(key, obj.clone());
        }
        let event = Event {
            rv: self.rv,
            res,
            ty,
            obj,
            prev,
        };
        self.publish(&event);
        self.history.push_back(event);
        while self.history.len() > self.history_limit {
            if let Some(old) = self.history.pop_front() {
                self.floor = self.floor.max(old.rv);
            }
        }
        self.rv_tx.send_replace(self.rv);
    }

    /// Feeds one event to every watcher on its kind, projected through the watcher's filter;
    /// drops watchers that are gone or too slow (the real server closes those, and the client
    /// resumes from the last resourceVersion it saw).
    fn publish(&mut self, ev: &Event) {
        let kinds = &self.kinds;
        self.watchers.retain(|_, w| {
            if w.res != ev.res {
                return true;
            }
            let Some(line) = project(kinds, w, ev) else {
                return true;
            };
            w.tx.try_send(line).is_ok()
        });
    }

    /// Creates an object (POST).
    pub(crate) fn create(
        &mut self,
        scope: &Scope,
        mut body: Value,
        opts: &WriteOpts,
    ) -> Result<Written> {
        check_type_meta(scope, &body)?;
        let meta = body["metadata"].as_object_mut().ok_or_else(|| {
            ApiError::bad_request("Object 'metadata' is missing or not an object")
        })?;
        match (
            &scope.namespace,
            meta.get("namespace").and_then(Value::as_str),
        ) {
            (Some(path_ns), Some(body_ns)) if path_ns != body_ns && !body_ns.is_empty() => {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            (Some(path_ns), _) => {
                meta.insert("namespace".into(), json!(path_ns));
            }
            (None, _) if scope.kind.namespaced => {
                return Err(ApiError::PathNotFound);
            }
            (None, _) => {
                meta.remove("namespace");
            }
        }
        let name = match meta.get("name").and_then(Value::as_str) {
            Some(n) if !n.is_empty() => n.to_string(),
            _ => match meta.get("generateName").and_then(Value::as_str) {
                Some(prefix) if !prefix.is_empty() => format!("{prefix}{}", random_suffix()),
                _ => {
                    return Err(ApiError::invalid(
                        &scope.kind_group(),
                        "",
                        &[(
                            "metadata.name".into(),
                            "Required value: name or generateName is required".into(),
                        )],
                    ));
                }
            },
        };
        meta.insert("name".into(), json!(name));
        let addr = Addr { scope, name: &name };
        validate_name(scope, &name)?;
        if let Some(ns) = scope.namespace.as_deref()
            && !self.namespace_exists(ns)
        {
            let namespaces = Target {
                group: "",
                plural: "namespaces",
            };
            return Err(ApiError::not_found(namespaces, ns));
        }
        if self.stored(&addr).is_some() {
            return Err(ApiError::already_exists(scope.target(), &name));
        }
        let version = scope.kind.version(&scope.version).cloned();
        let status_sub = version.as_ref().is_some_and(|v| v.status_subresource);
        if status_sub && let Some(o) = body.as_object_mut() {
            o.remove("status");
        }
        let warnings = self.shape(scope, &name, &mut body, opts)?;
        let crd_kind = self.crd_precheck(scope, &body, None)?;
        if opts.dry_run {
            return Ok(Written {
                object: body,
                warnings,
                created: true,
            });
        }
        let rv = self.next_rv();
        let meta = body["metadata"]
            .as_object_mut()
            .ok_or_else(|| ApiError::bad_request("metadata"))?;
        meta.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
        meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        meta.insert("generation".into(), json!(1));
        for server_owned in ["deletionTimestamp", "deletionGracePeriodSeconds"] {
            meta.remove(server_owned);
        }
        if let Some(kind) = crd_kind {
            crd_accepted(&mut body, &kind);
            self.add_kind(kind);
        }
        if scope.kind.is_namespace() {
            body["spec"] = json!({ "finalizers": ["kubernetes"] });
            body["status"] = json!({ "phase": "Active" });
        }
        let stored = Arc::new(body);
        self.commit(scope.key(), EventType::Added, stored.clone(), None);
        Ok(Written {
            object: render::at_version(&scope.kind, &scope.version, &stored),
            warnings,
            created: true,
        })
    }

    /// Replaces an object (PUT), or its status when `status_only`.
    pub(crate) fn update(
        &mut self,
        scope: &Scope,
        name: &str,
        mut body: Value,
        opts: &WriteOpts,
        status_only: bool,
    ) -> Result<Written> {
        check_type_meta(scope, &body)?;
        let addr = Addr { scope, name };
        let old = self
            .stored(&addr)
            .cloned()
            .ok_or_else(|| ApiError::not_found(scope.target(), name))?;
        let meta = body["metadata"].as_object_mut().ok_or_else(|| {
            ApiError::bad_request("Object 'metadata' is missing or not an object")
        })?;
        if let Some(body_name) = meta.get("name").and_then(Value::as_str)
            && body_name != name
        {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        if let (Some(path_ns), Some(body_ns)) = (
            &scope.namespace,
            meta.get("namespace").and_then(Value::as_str),
        ) && path_ns != body_ns
        {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        match meta.get("resourceVersion").and_then(Value::as_str) {
            None | Some("") => {
                return Err(ApiError::invalid(
                    &scope.kind_group(),
                    name,
                    &[(
                        "metadata.resourceVersion".into(),
                        "Invalid value: 0x0: must be specified for an update".into(),
                    )],
                ));
            }
            Some(rv) if Some(rv) != old["metadata"]["resourceVersion"].as_str() => {
                return Err(ApiError::conflict(
                    scope.target(),
                    name,
                    "the object has been modified; please apply your changes to the latest version and try again",
                ));
            }
            Some(_) => {}
        }
        if let Some(uid) = meta.get("uid").and_then(Value::as_str)
            && !uid.is_empty()
            && Some(uid) != old["metadata"]["uid"].as_str()
        {
            return Err(ApiError::conflict(
                scope.target(),
                name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    old["metadata"]["uid"].as_str().unwrap_or("")
                ),
            ));
        }
        self.replace(scope, name, &old, body, opts, status_only)
    }

    /// The common tail of update and patch: keep what the server owns, validate, and store the
    /// new state unless nothing changed.
    fn replace(
        &mut self,
        scope: &Scope,
        name: &str,
        old: &Arc<Value>,
        mut body: Value,
        opts: &WriteOpts,
        status_only: bool,
    ) -> Result<Written> {
        let status_sub = scope
            .kind
            .version(&scope.version)
            .is_some_and(|v| v.status_subresource);
        if status_only {
            // Only the status moves; everything else stays as stored.
            let status = body.get("status").cloned();
            body = (**old).clone();
            match status {
                Some(s) => body["status"] = s,
                None => {
                    if let Some(o) = body.as_object_mut() {
                        o.remove("status");
                    }
                }
            }
        } else if status_sub {
            match old.get("status") {
                Some(s) => body["status"] = s.clone(),
                None => {
                    if let Some(o) = body.as_object_mut() {
                        o.remove("status");
                    }
                }
            }
        }
        for owned in [
            "uid",
            "creationTimestamp",
            "generation",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "namespace",
            "name",
        ] {
            match old["metadata"].get(owned) {
                Some(v) => body["metadata"][owned] = v.clone(),
                None => {
                    if let Some(m) = body["metadata"].as_object_mut() {
                        m.remove(owned);
                    }
                }
            }
        }
        body["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
        let warnings = self.shape(scope, name, &mut body, opts)?;
        let crd_kind = self.crd_precheck(scope, &body, Some(old))?;
        if spec_changed(old, &body, status_sub || status_only) {
            let generation = old["metadata"]["generation"].as_i64().unwrap_or(1);
            body["metadata"]["generation"] = json!(generation + 1);
        }
        if render::at_version(&scope.kind, &scope.version, old)
            == render::at_version(&scope.kind, &scope.version, &body)
        {
            // A no-op write: the real server neither bumps the resourceVersion nor sends an event.
            return Ok(Written {
                object: render::at_version(&scope.kind, &scope.version, old),
                warnings,
                created: false,
            });
        }
        if opts.dry_run {
            return Ok(Written {
                object: body,
                warnings,
                created: false,
            });
        }
        let finalized = body["metadata"].get("deletionTimestamp").is_some()
            && body["metadata"]["finalizers"]
                .as_array()
                .is_none_or(Vec::is_empty);
        let rv = self.next_rv();
        body["metadata"]["resourceVersion"] = json!(rv.to_string());
        if let Some(kind) = crd_kind {
            crd_accepted(&mut body, &kind);
            self.add_kind(kind);
        }
        let stored = Arc::new(body);
        if finalized {
            // The last finalizer is gone from an object being deleted: now it goes.
            self.commit(
                scope.key(),
                EventType::Deleted,
                stored.clone(),
                Some(old.clone()),
            );
        } else {
            self.commit(
                scope.key(),
                EventType::Modified,
                stored.clone(),
                Some(old.clone()),
            );
        }
        Ok(Written {
            object: render::at_version(&scope.kind, &scope.version, &stored),
            warnings,
            created: false,
        })
    }

    /// Patches an object (PATCH): JSON merge patch, JSON patch, or a server-side apply (which,
    /// in this fake, is a recursive merge that creates the object when absent).
    pub(crate) fn patch(
        &mut self,
        scope: &Scope,
        name: &str,
        patch: Patch,
        opts: &WriteOpts,
        status_only: bool,
    ) -> Result<Written> {
        let addr = Addr { scope, name };
        let Some(old) = self.stored(&addr).cloned() else {
            if let Patch::Apply(obj) = patch {
                let mut obj = obj;
                obj["metadata"]["name"] = json!(name);
                return self.create(scope, obj, opts);
            }
            return Err(ApiError::not_found(scope.target(), name));
        };
        let mut doc = render::at_version(&scope.kind, &scope.version, &old);
        match patch {
            Patch::Merge(p) => json_patch::merge(&mut doc, &p),
            Patch::Json(ops) => {
                let ops: json_patch::Patch = serde_json::from_value(ops).map_err(|e| {
                    ApiError::bad_request(format!("json: cannot unmarshal the patch: {e}"))
                })?;
                json_patch::patch(&mut doc, &ops).map_err(|e| {
                    ApiError::status(
                        422,
                        "Invalid",
                        format!(
                            "the server rejected our request due to an error in our request: {e}"
                        ),
                    )
                })?;
            }
            Patch::Apply(obj) => apply_merge(&mut doc, &obj),
        }
        check_type_meta(scope, &doc)?;
        let wanted_rv = doc["metadata"]["resourceVersion"]
            .as_str()
            .map(str::to_string);
        if let Some(rv) = wanted_rv
            && Some(rv.as_str()) != old["metadata"]["resourceVersion"].as_str()
        {
            return Err(ApiError::conflict(
                scope.target(),
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            ));
        }
        self.replace(scope, name, &old, doc, opts, status_only)
    }

    /// Deletes an object: at once, or — while finalizers remain — by marking it.
    pub(crate) fn delete(
        &mut self,
        scope: &Scope,
        name: &str,
        preconditions: &Value,
        dry_run: bool,
    ) -> Result<Deleted> {
        let addr = Addr { scope, name };
        let old = self
            .stored(&addr)
            .cloned()
            .ok_or_else(|| ApiError::not_found(scope.target(), name))?;
        for (field, what) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
            if let Some(want) = preconditions[field].as_str()
                && Some(want) != old["metadata"][field].as_str()
            {
                return Err(ApiError::conflict(
                    scope.target(),
                    name,
                    &format!(
                        "Precondition failed: {what} in precondition: {want}, {what} in object meta: {}",
                        old["metadata"][field].as_str().unwrap_or("")
                    ),
                ));
            }
        }
        if dry_run {
            return Ok(Deleted::Gone(render::at_version(
                &scope.kind,
                &scope.version,
                &old,
            )));
        }
        let finalizers = old["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if finalizers {
            if old["metadata"].get("deletionTimestamp").is_some() {
                return Ok(Deleted::Marked(render::at_version(
                    &scope.kind,
                    &scope.version,
                    &old,
                )));
            }
            let mut marked = (*old).clone();
            marked["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
            marked["metadata"]["deletionGracePeriodSeconds"] = json!(0);
            let rv = self.next_rv();
            marked["metadata"]["resourceVersion"] = json!(rv.to_string());
            let marked = Arc::new(marked);
            self.commit(scope.key(), EventType::Modified, marked.clone(), Some(old));
            return Ok(Deleted::Marked(render::at_version(
                &scope.kind,
                &scope.version,
                &marked,
            )));
        }
        if scope.kind.is_crd() {
            self.remove_crd_kind(&old);
        }
        if scope.kind.is_namespace() {
            self.empty_namespace(name);
        }
        let rv = self.next_rv();
        let mut gone = (*old).clone();
        gone["metadata"]["resourceVersion"] = json!(rv.to_string());
        let gone = Arc::new(gone);
        self.commit(scope.key(), EventType::Deleted, gone.clone(), Some(old));
        Ok(Deleted::Gone(render::at_version(
            &scope.kind,
            &scope.version,
            &gone,
        )))
    }

    /// DELETE on a collection: every matching object, one event each.
    pub(crate) fn delete_collection(&mut self, scope: &Scope, opts: &ListOpts) -> Result<Value> {
        let names: Vec<String> = self
            .objects(&scope.key())
            .filter(|(_, o)| self.in_scope(scope, o, &opts.fields, &opts.labels))
            .map(|((_, name), _)| name.clone())
            .collect();
        let mut items = Vec::new();
        for name in names {
            let (Deleted::Gone(obj) | Deleted::Marked(obj)) =
                self.delete(scope, &name, &Value::Null, false)?;
            items.push(Arc::new(obj));
        }
        let metadata = json!({ "resourceVersion": self.rv.to_string() });
        Ok(render::list(
            &scope.kind,
            &scope.version,
            &items,
            metadata,
            &Format::Object,
        ))
    }

    /// Prunes, defaults and validates a body against its version's schema; checks metadata.
    fn shape(
        &self,
        scope: &Scope,
        name: &str,
        body: &mut Value,
        opts: &WriteOpts,
    ) -> Result<Vec<String>> {
        let schema = scope
            .kind
            .version(&scope.version)
            .and_then(|v| v.schema.clone());
        let Some(schema) = schema else {
            return Ok(Vec::new());
        };
        let outcome = schema::apply(&schema, body);
        let mut causes = outcome.causes;
        causes.extend(check_metadata(&body["metadata"]));
        if !causes.is_empty() {
            return Err(ApiError::invalid(&scope.kind_group(), name, &causes));
        }
        let unknown: Vec<String> = outcome
            .unknown
            .iter()
            .map(|f| format!("unknown field \"{}\"", f.trim_start_matches('.')))
            .collect();
        match opts.field_validation.as_deref() {
            Some("Strict") if !unknown.is_empty() && opts.patch => {
                let message = format!(
                    "Invalid value: {:?}: strict decoding error: {}",
                    body.to_string(),
                    unknown.join(", ")
                );
                Err(ApiError::invalid("", "", &[("patch".into(), message)]))
            }
            Some("Strict") if !unknown.is_empty() => Err(ApiError::bad_request(format!(
                "{} in version \"{}\" cannot be handled as a {}: strict decoding error: {}",
                scope.kind.kind,
                scope.version,
                scope.kind.kind,
                unknown.join(", ")
            ))),
            Some("Ignore") => Ok(Vec::new()),
            _ => Ok(unknown),
        }
    }

    // === CRDs ===

    /// For a write to a CRD object: the kind it defines, or a 422 naming what is wrong.
    fn crd_precheck(
        &self,
        scope: &Scope,
        body: &Value,
        old: Option<&Arc<Value>>,
    ) -> Result<Option<Kind>> {
        if !scope.kind.is_crd() {
            return Ok(None);
        }
        let kind = Kind::from_crd(body).map_err(|causes| {
            ApiError::invalid(
                "CustomResourceDefinition.apiextensions.k8s.io",
                body["metadata"]["name"].as_str().unwrap_or(""),
                &causes,
            )
        })?;
        if let Some(old) = old
            && (old["spec"]["group"] != body["spec"]["group"]
                || old["spec"]["names"]["plural"] != body["spec"]["names"]["plural"])
        {
            return Err(ApiError::invalid(
                "CustomResourceDefinition.apiextensions.k8s.io",
                body["metadata"]["name"].as_str().unwrap_or(""),
                &[(
                    "spec.group".into(),
                    "Invalid value: field is immutable".into(),
                )],
            ));
        }
        Ok(Some(kind))
    }

    /// Deleting a CRD deletes its objects (each a DELETED event) and then ends the watches on
    /// them, as the real server does when it tears down the kind's storage.
    fn remove_crd_kind(&mut self, crd: &Value) {
        let (Some(group), Some(plural)) = (
            crd["spec"]["group"].as_str(),
            crd["spec"]["names"]["plural"].as_str(),
        ) else {
            return;
        };
        let key: ResKey = (group.to_string(), plural.to_string());
        self.delete_where(|res, _| *res == key);
        self.watchers.retain(|_, w| w.res != key);
        self.kinds.remove(&key);
        self.objects.remove(&key);
    }

    /// Deleting a namespace deletes everything in it, as the namespace controller does.
    fn empty_namespace(&mut self, ns: &str) {
        self.delete_where(|_, (obj_ns, _)| obj_ns == ns);
    }

    /// Deletes every object whose kind and key match, one DELETED event each.
    fn delete_where(&mut self, doomed: impl Fn(&ResKey, &ObjKey) -> bool) {
        let victims: Vec<(ResKey, Arc<Value>)> = self
            .objects
            .iter()
            .flat_map(|(res, objs)| objs.iter().map(move |(k, o)| (res, k, o)))
            .filter(|(res, k, _)| doomed(res, k))
            .map(|(res, _, o)| (res.clone(), o.clone()))
            .collect();
        for (res, old) in victims {
            self.next_rv();
            let mut gone = (*old).clone();
            gone["metadata"]["resourceVersion"] = json!(self.rv.to_string());
            self.commit(res, EventType::Deleted, Arc::new(gone), Some(old));
        }
    }

    /// Whether a namespace of this name exists.
    pub(crate) fn namespace_exists(&self, ns: &str) -> bool {
        self.objects
            .get(&(String::new(), "namespaces".to_string()))
            .is_some_and(|n| n.contains_key(&(String::new(), ns.to_string())))
    }

    // === watches ===

    /// Opens a watch: returns the initial lines and registers the watcher for live events,
    /// under one lock, so the two neither overlap nor leave a gap.
    pub(crate) fn watch(
        &mut self,
        scope: &Scope,
        opts: &WatchOpts,
        format: Format,
        info: WatchInfo,
        watch_list_enabled: bool,
    ) -> Result<Opened> {
        validate_watch(opts, watch_list_enabled)?;
        let key = scope.key();
        let now = Instant::now();
        let timeout = opts.timeout.unwrap_or(Duration::from_secs(1800));
        let (tx, rx) = mpsc::channel(self.watch_buffer);
        let mut watcher = Watcher {
            res: key.clone(),
            version: scope.version.clone(),
            namespace: scope.namespace.clone(),
            fields: opts.fields.clone(),
            labels: opts.labels.clone(),
            bookmarks: opts.bookmarks,
            format,
            columns_sent: false,
            tx,
            info,
            deadline: now + timeout,
            // The real cacher also sends one two seconds before the deadline.
            next_bookmark: (now + self.bookmark_every).min(
                (now + timeout)
                    .checked_sub(Duration::from_secs(2))
                    .unwrap_or(now),
            ),
        };
        let mut initial = VecDeque::new();
        let send_initial = opts.send_initial_events == Some(true);
        match opts.rv.as_deref() {
            _ if send_initial => {
                for (_, obj) in self.objects(&key) {
                    if self.in_scope(scope, obj, &opts.fields, &opts.labels) {
                        initial.push_back(event_line(&self.kinds, &mut watcher, "ADDED", obj));
                    }
                }
                if opts.bookmarks {
                    initial.push_back(bookmark_line(&scope.kind, &scope.version, self.rv, true));
                }
            }
            None | Some("") | Some("0") => {
                for (_, obj) in self.objects(&key) {
                    if self.in_scope(scope, obj, &opts.fields, &opts.labels) {
                        initial.push_back(event_line(&self.kinds, &mut watcher, "ADDED", obj));
                    }
                }
            }
            Some(text) => {
                let n = parse_rv(text)?;
                if n < self.floor {
                    // The real server starts the response (200) and reports expiry as an event.
                    let status = ApiError::expired(format!(
                        "too old resource version: {n} ({})",
                        self.floor
                    ));
                    initial.push_back(error_line(&status));
                    return Ok(Opened {
                        initial,
                        live: None,
                    });
                }
                for ev in self.history.iter().filter(|e| e.rv > n && e.res == key) {
                    if let Some(line) = project(&self.kinds, &mut watcher, ev) {
                        initial.push_back(line);
                    }
                }
            }
        }
        let id = self.next_watcher;
        self.next_watcher += 1;
        self.watchers.insert(id, watcher);
        Ok(Opened {
            initial,
            live: Some((id, rx)),
        })
    }

    /// Sends a BOOKMARK at the current resourceVersion to watchers that asked for them and are
    /// due (every `bookmark_every`, and once two seconds before their deadline); `force` sends
    /// to all of them now.
    pub(crate) fn send_bookmarks(&mut self, force: bool) {
        let now = Instant::now();
        let rv = self.rv;
        let kinds = &self.kinds;
        let every = self.bookmark_every;
        self.watchers.retain(|_, w| {
            if !w.bookmarks || (!force && now < w.next_bookmark) {
                return true;
            }
            let pre_deadline = w
                .deadline
                .checked_sub(Duration::from_secs(2))
                .unwrap_or(w.deadline);
            w.next_bookmark = if now < pre_deadline {
                (now + every).min(pre_deadline)
            } else {
                w.deadline + every
            };
            let Some(kind) = kinds.get(&w.res) else {
                return true;
            };
            match w.tx.try_send(bookmark_line(kind, &w.version, rv, false)) {
                Ok(()) => true,
                Err(mpsc::error::TrySendError::Full(_)) => false,
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            }
        });
    }

    /// Forgets all history: every resourceVersion before now is too old to resume from.
    pub(crate) fn compact(&mut self) {
        self.history.clear();
        self.floor = self.rv;
    }

    /// Keeps at most `limit` events, moving the floor past the ones dropped.
    pub(crate) fn set_history_limit(&mut self, limit: usize) {
        self.history_limit = limit;
        while self.history.len() > limit {
            if let Some(old) = self.history.pop_front() {
                self.floor = self.floor.max(old.rv);
            }
        }
    }

    /// Describes every open watch.
    pub(crate) fn watch_infos(&self) -> Vec<WatchInfo> {
        self.watchers.values().map(|w| w.info.clone()).collect()
    }
}

/// What a delete did.
#[derive(Debug, Clone, PartialEq)]
pub enum Deleted {
    /// The object is gone; its last state.
    Gone(Value),
    /// Finalizers remain: the object is marked for deletion; its new state.
    Marked(Value),
}

impl Deleted {
    /// The object, in either case.
    pub fn object(&self) -> &Value {
        match self {
            Deleted::Gone(v) | Deleted::Marked(v) => v,
        }
    }
}

/// A newly opened watch: the lines to write first and, unless the watch ends after them, the
/// watcher's id and its live feed.
pub(crate) struct Opened {
    pub(crate) initial: VecDeque<Bytes>,
    pub(crate) live: Option<(u64, mpsc::Receiver<Bytes>)>,
}

/// A patch, by content type.
#[derive(Debug, Clone)]
pub enum Patch {
    /// `application/merge-patch+json` (RFC 7386).
    Merge(Value),
    /// `application/json-patch+json` (RFC 6902).
    Json(Value),
    /// `application/apply-patch+yaml` (server-side apply, simplified to a recursive merge).
    Apply(Value),
}

/// What a watcher sees of one event: the watch cache's projection through its filter.
fn project(kinds: &BTreeMap<ResKey, Arc<Kind>>, w: &mut Watcher, ev: &Event) -> Option<Bytes> {
    let sees = |o: &Value| {
        w.namespace
            .as_deref()
            .is_none_or(|ns| o["metadata"]["namespace"].as_str() == Some(ns))
            && w.fields.matches(o)
            && w.labels.matches(o)
    };
    let now = sees(&ev.obj);
    let before = ev.prev.as_deref().is_some_and(sees);
    let ty = match (ev.ty, before, now) {
        (EventType::Deleted, true, _) => "DELETED",
        (EventType::Deleted, false, _) => return None,
        (_, true, true) => "MODIFIED",
        (_, false, true) => "ADDED",
        (_, true, false) => {
            // Left the selector: the previous state, stamped with this event's resourceVersion.
            let mut prev = ev.prev.as_deref().cloned().unwrap_or(Value::Null);
            prev["metadata"]["resourceVersion"] = json!(ev.rv.to_string());
            return Some(event_line(kinds, w, "DELETED", &prev));
        }
        (_, false, false) => return None,
    };
    Some(event_line(kinds, w, ty, &ev.obj))
}

fn event_line(
    kinds: &BTreeMap<ResKey, Arc<Kind>>,
    w: &mut Watcher,
    ty: &str,
    obj: &Value,
) -> Bytes {
    let object = match kinds.get(&w.res) {
        Some(kind) => render::watch_object(kind, &w.version, obj, &w.format, !w.columns_sent),
        None => obj.clone(),
    };
    w.columns_sent = true;
    line(&json!({ "type": ty, "object": object }))
}

fn bookmark_line(kind: &Kind, version: &str, rv: u64, initial_events_end: bool) -> Bytes {
    let mut metadata = json!({ "resourceVersion": rv.to_string() });
    if initial_events_end {
        metadata["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
    }
    line(&json!({
        "type": "BOOKMARK",
        "object": { "kind": kind.kind, "apiVersion": kind.api_version(version), "metadata": metadata },
    }))
}

/// An `ERROR` event line carrying this error's Status.
pub(crate) fn error_line(error: &ApiError) -> Bytes {
    line(&json!({ "type": "ERROR", "object": error.to_status() }))
}

fn line(value: &Value) -> Bytes {
    let mut out = serde_json::to_vec(value).unwrap_or_default();
    out.push(b'\n');
    Bytes::from(out)
}

fn ns_of(scope: &Scope) -> String {
    if scope.kind.namespaced {
        scope.namespace.clone().unwrap_or_default()
    } else {
        String::new()
    }
}

fn obj_key(obj: &Value) -> ObjKey {
    (
        obj["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string(),
        obj["metadata"]["name"].as_str().unwrap_or("").to_string(),
    )
}

fn parse_rv(text: &str) -> Result<u64> {
    text.parse()
        .map_err(|_| ApiError::bad_request(format!("invalid resource version \"{text}\"")))
}

fn encode_continue(rv: u64, after: &ObjKey) -> String {
    let raw = format!("{rv}\u{0}{}\u{0}{}", after.0, after.1);
    raw.bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode_continue(token: &str) -> Result<(u64, ObjKey)> {
    let bad = || ApiError::bad_request(format!("continue key is not valid: {token}"));
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| {
            token
                .get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        })
        .collect();
    let text = String::from_utf8(bytes.ok_or_else(bad)?).map_err(|_| bad())?;
    let mut parts = text.split('\u{0}');
    let (Some(rv), Some(ns), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad());
    };
    Ok((
        rv.parse().map_err(|_| bad())?,
        (ns.to_string(), name.to_string()),
    ))
}

fn invalid_list_option(field: &str, message: &str) -> ApiError {
    ApiError::invalid(
        "ListOptions.meta.k8s.io",
        "",
        &[(field.to_string(), message.to_string())],
    )
}

fn check_match_value(value: Option<&str>) -> Result<()> {
    match value {
        None | Some("Exact") | Some("NotOlderThan") => Ok(()),
        Some(other) => Err(invalid_list_option(
            "resourceVersionMatch",
            &format!(
                "Unsupported value: \"{other}\": supported values: \"Exact\", \"NotOlderThan\", \"\""
            ),
        )),
    }
}

/// `ValidateListOptions` for a list.
fn validate_list(opts: &ListOpts) -> Result<()> {
    check_match_value(opts.rv_match.as_deref())?;
    if opts.send_initial_events.is_some() {
        return Err(invalid_list_option(
            "sendInitialEvents",
            "Forbidden: sendInitialEvents is forbidden for list",
        ));
    }
    if let Some(m) = &opts.rv_match {
        if opts.rv.is_none() {
            return Err(invalid_list_option(
                "resourceVersionMatch",
                "Forbidden: resourceVersionMatch is forbidden unless resourceVersion is provided",
            ));
        }
        if opts.continue_token.is_some() {
            return Err(invalid_list_option(
                "resourceVersionMatch",
                "Forbidden: resourceVersionMatch is forbidden when continue is provided",
            ));
        }
        if m == "Exact" && opts.rv.as_deref() == Some("0") {
            return Err(invalid_list_option(
                "resourceVersionMatch",
                "Forbidden: resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"",
            ));
        }
    }
    Ok(())
}

/// `validateWatchOptions` for a watch.
fn validate_watch(opts: &WatchOpts, watch_list_enabled: bool) -> Result<()> {
    check_match_value(opts.rv_match.as_deref())?;
    match (opts.send_initial_events, opts.rv_match.as_deref()) {
        (Some(_), _) if !watch_list_enabled => Err(invalid_list_option(
            "sendInitialEvents",
            "Forbidden: sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled",
        )),
        (Some(_), Some("NotOlderThan")) => {
            if opts.send_initial_events == Some(true) && !opts.bookmarks {
                return Err(invalid_list_option(
                    "allowWatchBookmarks",
                    "Forbidden: allowWatchBookmarks must be set to true when sendInitialEvents is true",
                ));
            }
            Ok(())
        }
        (Some(_), _) => Err(invalid_list_option(
            "resourceVersionMatch",
            "Unsupported value: \"\": supported values: \"NotOlderThan\"",
        )),
        (None, Some(_)) => Err(invalid_list_option(
            "resourceVersionMatch",
            "Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
        )),
        (None, None) => Ok(()),
    }
}

fn check_type_meta(scope: &Scope, body: &Value) -> Result<()> {
    let want = scope.kind.api_version(&scope.version);
    match body["apiVersion"].as_str() {
        Some(v) if v == want => {}
        Some("") | None => {
            return Err(ApiError::bad_request(format!(
                "Object 'apiVersion' is missing in '{}'",
                compact(body)
            )));
        }
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({other}) does not match the expected API version ({want})"
            )));
        }
    }
    match body["kind"].as_str() {
        Some(k) if k == scope.kind.kind => Ok(()),
        Some("") | None => Err(ApiError::bad_request(format!(
            "Object 'Kind' is missing in '{}'",
            compact(body)
        ))),
        Some(other) => Err(ApiError::bad_request(format!(
            "the kind in the data ({other}) does not match the expected kind ({})",
            scope.kind.kind
        ))),
    }
}

fn compact(body: &Value) -> String {
    let text = body.to_string();
    if text.len() > 200 {
        format!("{}…", &text[..text.floor_char_boundary(200)])
    } else {
        text
    }
}

const DNS1123: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";

/// Whether `name` is an RFC 1123 subdomain, as custom resource names must be.
pub fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

fn validate_name(scope: &Scope, name: &str) -> Result<()> {
    if is_dns_subdomain(name) {
        return Ok(());
    }
    Err(ApiError::invalid(
        &scope.kind_group(),
        name,
        &[(
            "metadata.name".into(),
            format!("Invalid value: \"{name}\": {DNS1123}"),
        )],
    ))
}

/// Labels and annotations must be string maps.
fn check_metadata(meta: &Value) -> Vec<(String, String)> {
    let mut causes = Vec::new();
    for field in ["labels", "annotations"] {
        if let Some(map) = meta.get(field) {
            let ok = map.is_null()
                || map
                    .as_object()
                    .is_some_and(|m| m.values().all(Value::is_string));
            if !ok {
                causes.push((
                    format!("metadata.{field}"),
                    "Invalid value: must be a map of strings".into(),
                ));
            }
        }
    }
    causes
}

fn spec_changed(old: &Value, new: &Value, status_separate: bool) -> bool {
    let strip = |v: &Value| -> Map<String, Value> {
        let mut m = v.as_object().cloned().unwrap_or_default();
        for k in ["metadata", "apiVersion", "kind"] {
            m.remove(k);
        }
        if status_separate {
            m.remove("status");
        }
        m
    };
    strip(old) != strip(new)
}

/// The recursive merge this fake does for server-side apply: maps merge, everything else
/// (lists included) is replaced.
fn apply_merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                match t.get_mut(k) {
                    Some(existing) if existing.is_object() && v.is_object() => {
                        apply_merge(existing, v)
                    }
                    _ => {
                        t.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// Marks a CRD's names accepted and the kind established, as the real controllers do within
/// moments of the create.
fn crd_accepted(crd: &mut Value, kind: &Kind) {
    let now = now_rfc3339();
    let condition = |ty: &str, reason: &str, message: &str| json!({ "type": ty, "status": "True", "lastTransitionTime": now, "reason": reason, "message": message });
    crd["status"] = json!({
        "conditions": [
            condition("NamesAccepted", "NoConflicts", "no conflicts found"),
            condition("Established", "InitialNamesAccepted", "the initial names have been accepted"),
        ],
        "acceptedNames": {
            "plural": kind.plural, "singular": kind.singular, "kind": kind.kind,
            "listKind": kind.list_kind, "shortNames": kind.short_names, "categories": kind.categories,
        },
        "storedVersions": crd["spec"]["versions"].as_array().into_iter().flatten()
            .filter(|v| v["storage"].as_bool() == Some(true))
            .map(|v| v["name"].clone()).collect::<Vec<_>>(),
    });
}

/// The current time as the API writes timestamps: RFC 3339, whole seconds, UTC.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

/// Five characters from the alphabet the real server uses for `generateName`.
fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    uuid::Uuid::new_v4()
        .as_bytes()
        .iter()
        .take(5)
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continue_tokens_round_trip() {
        let key = ("ns".to_string(), "a.b".to_string());
        let token = encode_continue(105, &key);
        assert_eq!(decode_continue(&token).unwrap(), (105, key));
        assert_eq!(decode_continue("zz").unwrap_err().code(), 400);
    }

    #[test]
    fn names_must_be_dns_subdomains() {
        assert!(is_dns_subdomain("demo"));
        assert!(is_dns_subdomain("a.b-c.d1"));
        assert!(!is_dns_subdomain("Demo"));
        assert!(!is_dns_subdomain("-a"));
        assert!(!is_dns_subdomain("a..b"));
        assert!(!is_dns_subdomain(""));
    }

    #[test]
    fn apply_merges_maps_and_replaces_lists() {
        let mut t = json!({ "a": { "b": 1, "c": [1, 2] }, "d": 1 });
        apply_merge(&mut t, &json!({ "a": { "c": [3] , "e": 2 } }));
        assert_eq!(t, json!({ "a": { "b": 1, "c": [3], "e": 2 }, "d": 1 }));
    }
}
