//! What the transport tells the layers above about the connection a request came on, through
//! the request's extensions: who is at the other end ([`Peer`]) and whether the connection is
//! being drained ([`ConnDrain`]). A leaf module: the transport fills these in, the access layer
//! and the services read them, and none of them imports another for it.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rustls_pki_types::CertificateDer;
use tokio_util::sync::CancellationToken;

/// The drain of the connection a request came on: its token is cancelled when the connection
/// reaches its maximum age or the broker shuts down, and streams end with UNAVAILABLE saying
/// which.
#[derive(Debug, Clone)]
pub struct ConnDrain {
    token: CancellationToken,
    aged: Arc<AtomicBool>,
}

/// Why a connection is drained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainReason {
    /// It reached `--max-connection-age`: the client reconnects, perhaps to another replica.
    MaxAge,
    /// The broker is shutting down.
    Shutdown,
}

impl ConnDrain {
    /// A drain by `token`.
    pub fn new(token: CancellationToken) -> Self {
        ConnDrain {
            token,
            aged: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The token.
    pub fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// Drains the connection because it reached its maximum age.
    pub fn age(&self) {
        self.aged.store(true, Ordering::Release);
        self.token.cancel();
    }

    /// Why it is drained (once it is).
    pub fn reason(&self) -> DrainReason {
        if self.aged.load(Ordering::Acquire) {
            DrainReason::MaxAge
        } else {
            DrainReason::Shutdown
        }
    }
}

/// The other end of a connection, as the transport saw it when it accepted it.
#[derive(Debug, Clone)]
pub struct Peer {
    /// A number unique to the connection within this process.
    pub id: u64,
    /// Where it comes from.
    pub addr: PeerAddr,
    /// On a TLS connection where the client presented a certificate (which then chains to
    /// `--tls-client-ca`): its chain, leaf first.
    pub client_certs: Option<Arc<[CertificateDer<'static>]>>,
}

/// Where a connection comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerAddr {
    /// TCP, plain or TLS.
    Tcp {
        /// The client's address.
        remote: SocketAddr,
        /// The broker's address it connected to.
        local: SocketAddr,
    },
    /// A unix domain socket, with the connecting process's credentials when the kernel gives
    /// them (`SO_PEERCRED`).
    Unix {
        /// The process's user id.
        uid: Option<u32>,
        /// The process id.
        pid: Option<i32>,
    },
}

impl Peer {
    /// The client's IP address, on TCP.
    pub fn ip(&self) -> Option<IpAddr> {
        match self.addr {
            PeerAddr::Tcp { remote, .. } => Some(canonical_ip(remote.ip())),
            PeerAddr::Unix { .. } => None,
        }
    }

    /// Whether the connection comes from the address it reached: a process in the broker's own
    /// network namespace. That is a proxy in its pod that forwards to the pod's IP without
    /// binding a source address (Linkerd since 2.11, whose proxy delivers every caller so: the
    /// kernel takes a local destination's own address as the source), or a container beside it.
    pub fn from_own_address(&self) -> bool {
        match self.addr {
            PeerAddr::Tcp { remote, local } => {
                canonical_ip(remote.ip()) == canonical_ip(local.ip())
            }
            PeerAddr::Unix { .. } => false,
        }
    }
}

/// An IPv4 address that arrived as IPv4-mapped IPv6 (`::ffff:10.0.0.1`, as on a dual-stack
/// listener) as plain IPv4, so that it compares equal to a pod's `status.podIP`.
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_ipv4_compares_as_ipv4() {
        let mapped: IpAddr = "::ffff:10.1.2.3".parse().unwrap();
        assert_eq!(canonical_ip(mapped), "10.1.2.3".parse::<IpAddr>().unwrap());
        let v6: IpAddr = "fd00::1".parse().unwrap();
        assert_eq!(canonical_ip(v6), v6);
    }
}
