//! Who is calling: a workload an identity source named, a local process, or (identity off) an
//! address.

use std::fmt;
use std::net::IpAddr;

use tonic::Status;

use crate::conn::Peer;

/// A pod, as `peer-pod` and pod-bound tokens name it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PodRef {
    /// Its name.
    pub name: String,
    /// Its UID: a new pod on a reused IP has another.
    pub uid: String,
}

/// A workload: a service account in a namespace, and the pod when the source knows it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Workload {
    /// The namespace.
    pub namespace: String,
    /// The service account.
    pub service_account: String,
    /// The pod, when the source names it (`peer-pod`, pod-bound tokens).
    pub pod: Option<PodRef>,
    /// Otherwise something unique to one instance (a certificate's hash), for the limits.
    pub instance: Option<String>,
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Caller {
    /// Identity is off; the peer's IP (none on a unix socket) and its connection, for the
    /// limits.
    Anonymous {
        /// The peer's IP.
        ip: Option<IpAddr>,
        /// The connection's number ([`Peer::id`]).
        connection: Option<u64>,
        /// Whether the IP stands for many callers: a local proxy's address, or the broker's own
        /// (a proxy in its pod that forwards to the pod's IP).
        shared: bool,
    },
    /// A workload, and the source that identified it.
    Workload(Workload),
    /// A local process over the unix socket, with its user id if the kernel said.
    Local {
        /// `SO_PEERCRED`'s uid.
        uid: Option<u32>,
    },
}

impl Caller {
    /// The caller a request is: the one [`Authenticate`] put in its extensions (an anonymous
    /// one when identity is off). A request it did not see has none, and is refused rather than
    /// taken for an anonymous caller, whom no policy limits.
    pub fn of(extensions: &http::Extensions) -> Result<Caller, Status> {
        extensions.get::<Caller>().cloned().ok_or_else(|| {
            Status::unauthenticated(
                "the request reached the service without its caller being identified",
            )
        })
    }

    /// The anonymous caller at `peer` (identity off), its address shared by many callers if it
    /// is one of `proxies` or the broker's own.
    pub(super) fn anonymous(peer: &Peer, proxies: &[IpAddr]) -> Caller {
        Caller::Anonymous {
            ip: peer.ip(),
            connection: Some(peer.id),
            shared: shared_address(peer, proxies),
        }
    }

    /// The key the limits count this caller under: the most specific thing known about it.
    /// Where an address stands for many callers at once (with identity off, a local proxy's or
    /// the broker's own, or a unix socket), each connection is a caller of its own.
    pub(super) fn limit_key(&self) -> Option<String> {
        match self {
            Caller::Anonymous {
                ip: Some(ip),
                shared: false,
                ..
            } => Some(format!("ip:{ip}")),
            Caller::Anonymous {
                connection: Some(id),
                ..
            } => Some(format!("connection:{id}")),
            Caller::Anonymous { .. } => None,
            Caller::Workload(w) => Some(match (&w.pod, &w.instance) {
                (Some(pod), _) => format!("pod:{}/{}/{}", w.namespace, pod.name, pod.uid),
                (None, Some(instance)) => {
                    format!("sa:{}/{}#{instance}", w.namespace, w.service_account)
                }
                (None, None) => format!("sa:{}/{}", w.namespace, w.service_account),
            }),
            Caller::Local { uid } => Some(format!("unix:{}", uid.map_or(-1, i64::from))),
        }
    }
}

/// Whether `peer`'s address stands for many callers: a local proxy's (one of `proxies`), or the
/// broker's own (a proxy in its pod that forwards to the pod's IP).
pub(super) fn shared_address(peer: &Peer, proxies: &[IpAddr]) -> bool {
    peer.from_own_address() || peer.ip().is_some_and(|ip| proxies.contains(&ip))
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Caller::Anonymous { ip: Some(ip), .. } => write!(f, "anonymous ({ip})"),
            Caller::Anonymous { ip: None, .. } => f.write_str("anonymous (unix socket)"),
            Caller::Workload(w) => {
                write!(f, "{}/{}", w.namespace, w.service_account)?;
                if let Some(pod) = &w.pod {
                    write!(f, " (pod {})", pod.name)?;
                }
                Ok(())
            }
            Caller::Local { uid: Some(uid) } => write!(f, "unix:{uid}"),
            Caller::Local { uid: None } => f.write_str("unix:?"),
        }
    }
}
