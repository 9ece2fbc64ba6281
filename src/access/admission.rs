//! Admission: what a caller may read (the policy, before anything is resolved and on the
//! resolved kind), its streams within its limits, and the tickets that end them when a reloaded
//! policy no longer allows them.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::caller::Caller;
use super::{Access, Open, limits};
use crate::selector::Selector;
use crate::sync::lock;
use crate::telemetry::{Denial, DenialLabels, LimitLabels};

impl Access {
    /// Refuses, before anything is resolved, a caller who may read nothing in the selector's
    /// namespace: PERMISSION_DENIED naming the caller and the namespace, the same whether or
    /// not the resource exists.
    pub fn precheck(&self, caller: &Caller, selector: &Selector) -> Result<(), Status> {
        if self
            .policy
            .get()
            .may_read_in(caller, selector.namespace.as_deref())
        {
            return Ok(());
        }
        Err(self.denied(caller, selector, Denial::Namespace))
    }

    /// Refuses a caller who may not read the resolved `selector`'s kind there.
    pub fn authorize(&self, caller: &Caller, selector: &Selector) -> Result<(), Status> {
        if self.policy.get().may_read(caller, selector) {
            return Ok(());
        }
        Err(self.denied(caller, selector, Denial::Kind))
    }

    fn denied(&self, caller: &Caller, selector: &Selector, reason: Denial) -> Status {
        let reason = match (reason, &selector.namespace) {
            (_, None) => Denial::ClusterScoped,
            (r, Some(_)) => r,
        };
        self.count_denial(reason);
        Status::permission_denied(denial_message(caller, selector))
    }

    /// The callers with streams open and how many each has (callers the limits do not apply
    /// to, such as a local mesh proxy, are not listed).
    pub fn callers(&self) -> Vec<(String, usize)> {
        self.limits.callers()
    }

    /// Admits a stream of `caller`'s over the resolved `selectors`, of which `new` are not
    /// watched yet, within the per-caller limits (RESOURCE_EXHAUSTED naming the limit).
    pub fn admit(
        &self,
        caller: &Caller,
        selectors: &[Selector],
        new: limits::New,
    ) -> Result<Ticket, Status> {
        let slot = self
            .limits
            .admit(caller.limit_key(), new)
            .map_err(|refused| {
                self.count_limit(refused.limit);
                refusal_status(caller, refused)
            })?;
        let revoked = CancellationToken::new();
        let reason = Arc::new(OnceLock::new());
        let id = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        // Streams of anonymous callers are never revoked: no policy applies to them.
        let registered = self.identifies();
        if registered {
            lock(&self.open).insert(
                id,
                (
                    caller.clone(),
                    selectors.to_vec(),
                    revoked.clone(),
                    reason.clone(),
                ),
            );
        }
        let ticket = Ticket {
            slot,
            id,
            open: registered.then(|| self.open.clone()),
            revoked,
            reason,
        };
        // A reload between the caller's authorization and the registration above would have
        // found nothing to revoke: the policy in force is asked again now that a reload will
        // find this stream (dropping the ticket unregisters it).
        if registered {
            let policy = self.policy.get();
            if let Some(s) = selectors.iter().find(|s| !policy.may_read(caller, s)) {
                self.count_denial(Denial::Revoked);
                let why = format!("{}; the policy changed", denial_message(caller, s));
                return Err(Status::permission_denied(why));
            }
        }
        Ok(ticket)
    }

    fn count_denial(&self, reason: Denial) {
        self.metrics
            .access
            .denials
            .get_or_create(&DenialLabels { reason })
            .inc();
    }

    /// Counts a request refused by `limit`.
    pub fn count_limit(&self, limit: crate::telemetry::Limit) {
        self.metrics
            .access
            .limit_hits
            .get_or_create(&LimitLabels { limit })
            .inc();
    }

    /// Ends every open stream the policy now in force no longer allows.
    pub(super) fn revoke_what_the_policy_forbids(&self) {
        let policy = self.policy.get();
        let open = lock(&self.open);
        for (caller, selectors, revoked, reason) in open.values() {
            if let Some(s) = selectors.iter().find(|s| !policy.may_read(caller, s)) {
                let _ = reason.set(format!("{}; the policy changed", denial_message(caller, s)));
                self.count_denial(Denial::Revoked);
                revoked.cancel();
            }
        }
    }
}

/// The header in which a stream refused for the broker's pace is told when to try again, in
/// milliseconds: gRPC's server pushback (gRFC A6), which a client's retry policy follows.
pub const RETRY_PUSHBACK: &str = "grpc-retry-pushback-ms";

/// RESOURCE_EXHAUSTED for a request the limits refuse, naming the caller and the limit, with
/// the wait in [`RETRY_PUSHBACK`] where one is known.
fn refusal_status(caller: &Caller, refused: limits::Refusal) -> Status {
    let mut status = Status::resource_exhausted(format!("{caller}: {}", refused.why));
    if let Some(wait) = refused.retry_after {
        let millis = wait.as_millis().max(1).to_string();
        if let Ok(value) = millis.parse() {
            status.metadata_mut().insert(RETRY_PUSHBACK, value);
        }
    }
    status
}

fn denial_message(caller: &Caller, selector: &Selector) -> String {
    match &selector.namespace {
        Some(ns) if ns == crate::selector::ALL_NAMESPACES => format!(
            "{caller} may not read {}.{} in every namespace: no policy grant reads \"*\"",
            selector.kind.resource, selector.kind.group
        ),
        Some(ns) => format!(
            "{caller} may not read {}.{} in namespace {ns}: no policy grant covers it",
            selector.kind.resource, selector.kind.group
        ),
        None => format!(
            "{caller} may not read cluster-scoped {}.{}: no policy grant covers it",
            selector.kind.resource, selector.kind.group
        ),
    }
}

/// A stream's admission: it counts the stream against its caller's limit while it lives, and
/// [`Ticket::revoked`] resolves when a reloaded policy no longer lets the caller read it.
pub struct Ticket {
    slot: limits::Slot,
    id: u64,
    open: Option<Arc<Open>>,
    revoked: CancellationToken,
    reason: Arc<OnceLock<String>>,
}

impl Ticket {
    /// A watch (`--max-watches-per-caller`) or a set (`--max-sets-per-caller`) this stream's
    /// request started, charged to its caller until it ends.
    pub fn charge(&self, what: limits::Charged) -> Option<limits::Charge> {
        self.slot.charge(what)
    }

    /// Resolves with PERMISSION_DENIED if the stream is revoked; never otherwise.
    pub fn revoked(&self) -> impl Future<Output = Status> + Send + 'static {
        let revoked = self.revoked.clone();
        let reason = self.reason.clone();
        async move {
            revoked.cancelled().await;
            Status::permission_denied(
                reason
                    .get()
                    .cloned()
                    .unwrap_or_else(|| "access revoked".into()),
            )
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(open) = &self.open {
            lock(open).remove(&self.id);
        }
    }
}
