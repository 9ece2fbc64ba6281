//! The soak's faults: what each episode does, and which ones each kind of cluster can make.

use serde::Serialize;

/// The faults, each an episode that ends by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Fault {
    /// Every watch connection dropped mid-body.
    Drop,
    /// Every watch ended cleanly.
    Close,
    /// An ERROR 410 on every watch: relist.
    Error410,
    /// History compacted while writes go on, then watches dropped: resumes hit 410.
    Compaction,
    /// LISTs fail with 500 (relists forced).
    List500,
    /// WATCH starts fail with 500 (watches ended).
    Watch500,
    /// LISTs get 429 with Retry-After.
    List429,
    /// WATCH starts get 429 with Retry-After.
    Watch429,
    /// Watch output held, connections open and silent.
    Stall,
    /// WATCH requests accepted and never answered, until the fault ends.
    Hang,
    /// The API server down, and back on the same port with its data.
    Down,
    /// The CRD deleted (its objects with it) and re-created.
    CrdRecreated,
    /// The broker's right to list and watch FeatureFlags revoked, and restored.
    RbacRevoked,
    /// A real kube-apiserver killed (SIGKILL) and started again on the same etcd.
    ApiServerKilled,
    /// A real kube-apiserver stopped (SIGTERM: it drains) and started again.
    ApiServerStopped,
    /// A real etcd killed for 10–30 s, the API server up without its storage.
    EtcdKilled,
    /// Priority and Fairness rejecting every request of the broker (429 with Retry-After).
    Rejected,
}

pub(super) const FAULTS: [Fault; 13] = [
    Fault::Drop,
    Fault::Close,
    Fault::Error410,
    Fault::Compaction,
    Fault::List500,
    Fault::Watch500,
    Fault::List429,
    Fault::Watch429,
    Fault::Stall,
    Fault::Hang,
    Fault::Down,
    Fault::CrdRecreated,
    Fault::RbacRevoked,
];

/// The faults of a real control plane ([`super::cluster::Real`]).
pub(super) const REAL_FAULTS: [Fault; 7] = [
    Fault::ApiServerKilled,
    Fault::ApiServerStopped,
    Fault::EtcdKilled,
    Fault::Compaction,
    Fault::Rejected,
    Fault::RbacRevoked,
    Fault::CrdRecreated,
];
