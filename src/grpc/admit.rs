//! Admission: the one way a request of any protocol gets its subscriptions, past the caller's
//! policy and limits and the broker's `--max-watches`.

use std::sync::Arc;

use tonic::Status;

use super::status::{indexed, source_status};
use crate::access::limits::{Charged, New};
use crate::access::{Access, Caller, Ticket};
use crate::registry::{Refused, Registry, Subscription, Watched};
use crate::selector::{Selector, Set};
use crate::source::Source;
use crate::telemetry::Limit;

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
