//! The access layer's families: identifications by source and result, requests the policy
//! refused and why, requests a limit refused, and policy reloads.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// A limit a request can hit.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Limit {
    /// `--max-watches`: distinct resources watched at once.
    MaxWatches,
    /// `--max-streams-per-caller`.
    StreamsPerCaller,
    /// `--new-watch-rate`: new watches per second per caller.
    NewWatchRate,
    /// `--max-request-bytes`.
    RequestSize,
    /// `--max-watches-per-caller`: watches a caller started, open now.
    WatchesPerCaller,
    /// `--max-sets-per-caller`: sets a caller started, open now.
    SetsPerCaller,
    /// New bearer tokens reviewed per source address.
    TokenReviews,
    /// `--max-new-streams-per-second`: new streams of the whole broker (or of one caller, a
    /// quarter of them).
    NewStreams,
}

label_values!(Limit {
    MaxWatches => "max_watches",
    StreamsPerCaller => "streams_per_caller",
    NewWatchRate => "new_watch_rate",
    RequestSize => "request_size",
    WatchesPerCaller => "watches_per_caller",
    SetsPerCaller => "sets_per_caller",
    TokenReviews => "token_reviews",
    NewStreams => "new_streams",
});

/// Labels of the limit counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabels {
    /// Which limit.
    pub limit: Limit,
}

/// Which source identified a caller.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum IdentifiedBy {
    /// `peer-pod`.
    PeerPod,
    /// `token`.
    Token,
    /// `mtls`.
    Mtls,
    /// `mesh`.
    Mesh,
    /// A unix-socket connection: a local caller.
    Unix,
    /// None did.
    Nothing,
}

label_values!(IdentifiedBy {
    PeerPod => "peer_pod",
    Token => "token",
    Mtls => "mtls",
    Mesh => "mesh",
    Unix => "unix",
    Nothing => "none",
});

/// How an identification ended.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum IdentifyResult {
    /// A caller was named.
    Identified,
    /// No source named one (UNAUTHENTICATED).
    Unidentified,
    /// A source could not ask the API server (UNAVAILABLE).
    Failed,
    /// A claim the broker knows to be false (UNAUTHENTICATED): the other mesh's header.
    Forged,
    /// Not looked into: its source showed too many new tokens lately (RESOURCE_EXHAUSTED).
    Limited,
}

label_values!(IdentifyResult {
    Identified => "identified",
    Unidentified => "unidentified",
    Failed => "failed",
    Forged => "forged",
    Limited => "limited",
});

/// Labels of the identification counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IdentifyLabels {
    /// The source that named the caller (`none` when none did).
    pub source: IdentifiedBy,
    /// How it ended.
    pub result: IdentifyResult,
}

/// Why the policy refused a request.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Denial {
    /// No grant for the namespace.
    Namespace,
    /// A grant for the namespace, not for the kind.
    Kind,
    /// A cluster-scoped object, with no grant reading `*`.
    ClusterScoped,
    /// An open stream the reloaded policy no longer allows.
    Revoked,
}

label_values!(Denial {
    Namespace => "namespace",
    Kind => "kind",
    ClusterScoped => "cluster_scoped",
    Revoked => "revoked",
});

/// Labels of the denial counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DenialLabels {
    /// Why.
    pub reason: Denial,
}

/// How a policy reload went.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum ReloadResult {
    /// The new policy is in force.
    Loaded,
    /// It did not parse; the old one stays.
    Refused,
}

label_values!(ReloadResult { Loaded => "loaded", Refused => "refused" });

/// Labels of the policy-reload counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    /// How it went.
    pub result: ReloadResult,
}

/// The access layer's families.
#[derive(Default)]
pub struct AccessMetrics {
    /// Requests refused by a limit, by limit.
    pub limit_hits: Family<LimitLabels, Counter>,
    /// Identifications, by source and result.
    pub identifications: Family<IdentifyLabels, Counter>,
    /// Requests the policy refused, by reason.
    pub denials: Family<DenialLabels, Counter>,
    /// Policy reloads, by result.
    pub policy_reloads: Family<ReloadLabels, Counter>,
}

impl AccessMetrics {
    /// Registers the families under `crd_broker_`.
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "limit_hits",
            "Requests refused by a limit (RESOURCE_EXHAUSTED), by limit",
            self.limit_hits.clone(),
        );
        registry.register(
            "identifications",
            "Callers identified (or not), by identity source and result",
            self.identifications.clone(),
        );
        registry.register(
            "denials",
            "Requests the policy refused (PERMISSION_DENIED), by reason",
            self.denials.clone(),
        );
        registry.register(
            "policy_reloads",
            "Policy file reloads, by result",
            self.policy_reloads.clone(),
        );
    }

    /// A series for each limit, denial and reload outcome, at zero.
    pub(super) fn initialize(&self) {
        for limit in [
            Limit::MaxWatches,
            Limit::StreamsPerCaller,
            Limit::NewWatchRate,
            Limit::RequestSize,
            Limit::WatchesPerCaller,
            Limit::SetsPerCaller,
            Limit::TokenReviews,
        ] {
            let _ = self.limit_hits.get_or_create(&LimitLabels { limit });
        }
        for reason in [
            Denial::Namespace,
            Denial::Kind,
            Denial::ClusterScoped,
            Denial::Revoked,
        ] {
            let _ = self.denials.get_or_create(&DenialLabels { reason });
        }
        for result in [ReloadResult::Loaded, ReloadResult::Refused] {
            let _ = self.policy_reloads.get_or_create(&ReloadLabels { result });
        }
    }
}
