//! Identification: who a request's caller is, by the first `--identity` source that says
//! (`peer-pod`, `token`, `mtls`, `mesh`), kept per connection where the source is.

use std::sync::{Arc, OnceLock};

use http::HeaderMap;
use tonic::Status;

use super::Access;
use super::caller::{Caller, Workload, shared_address};
use super::identity::{self, IdentitySource, Mesh};
use super::peer_pod::Found;
use super::token::{self, Reviewed};
use crate::conn::{Peer, PeerAddr};
use crate::telemetry::{IdentifiedBy, IdentifyLabels, IdentifyResult, Limit};

/// What the access layer knows about one connection: its peer, and the caller a per-connection
/// source (`peer-pod`, `mtls`) found, kept once found.
pub struct ConnIdentity {
    peer: Peer,
    pod: OnceLock<Workload>,
    certificate: OnceLock<Result<Workload, String>>,
}

/// What one source made of a request.
enum Outcome {
    Identified(Caller),
    Unidentified(String),
    Failed(String),
    /// A claim of identity the broker knows to be false: refused, whatever else might identify.
    Forged(String),
    /// Not looked into: the caller's source asked too often (RESOURCE_EXHAUSTED).
    Limited(String),
}

impl Access {
    /// The state of a new connection.
    pub fn connection(&self, peer: &Peer) -> Arc<ConnIdentity> {
        Arc::new(ConnIdentity {
            peer: peer.clone(),
            pod: OnceLock::new(),
            certificate: OnceLock::new(),
        })
    }

    /// Who is calling: the first `--identity` source that says, else a local caller on a unix
    /// socket, else UNAUTHENTICATED naming what was tried (UNAVAILABLE if a source could not
    /// ask the API server, so that clients retry).
    pub async fn identify(
        &self,
        conn: &ConnIdentity,
        headers: &HeaderMap,
    ) -> Result<Caller, Status> {
        if !self.identifies() {
            return Ok(Caller::anonymous(&conn.peer, &self.settings.mesh_proxies));
        }
        let mut tried = Vec::new();
        let mut failed = false;
        for &source in &self.settings.identity.0 {
            let outcome = match source {
                IdentitySource::PeerPod => self.by_peer_pod(conn).await,
                IdentitySource::Token => self.by_token(conn, headers).await,
                IdentitySource::Mtls => self.by_certificate(conn),
                IdentitySource::Mesh => self.by_mesh(conn, headers),
            };
            match outcome {
                Outcome::Identified(caller) => {
                    self.count_identification(
                        IdentifiedBy::from(source),
                        IdentifyResult::Identified,
                    );
                    return Ok(caller);
                }
                Outcome::Unidentified(why) => tried.push(format!("{source}: {why}")),
                Outcome::Failed(why) => {
                    failed = true;
                    tried.push(format!("{source}: {why}"));
                }
                Outcome::Limited(why) => {
                    self.count_identification(IdentifiedBy::from(source), IdentifyResult::Limited);
                    self.count_limit(Limit::TokenReviews);
                    return Err(Status::resource_exhausted(why));
                }
                Outcome::Forged(why) => {
                    self.count_identification(IdentifiedBy::from(source), IdentifyResult::Forged);
                    let from = conn.peer.ip().map(|ip| ip.to_string()).unwrap_or_default();
                    tracing::warn!(%from, reason = %why, "a forged identity refused");
                    return Err(Status::unauthenticated(format!(
                        "the caller at {from} is refused: {why}"
                    )));
                }
            }
        }
        if let PeerAddr::Unix { uid, .. } = conn.peer.addr {
            self.count_identification(IdentifiedBy::Unix, IdentifyResult::Identified);
            return Ok(Caller::Local { uid });
        }
        let from = conn.peer.ip().map(|ip| ip.to_string()).unwrap_or_default();
        if failed {
            self.count_identification(IdentifiedBy::Nothing, IdentifyResult::Failed);
            return Err(Status::unavailable(format!(
                "cannot identify the caller at {from} now: {}; retry",
                tried.join("; ")
            )));
        }
        self.count_identification(IdentifiedBy::Nothing, IdentifyResult::Unidentified);
        Err(Status::unauthenticated(format!(
            "no identity source identifies the caller at {from}: {}",
            tried.join("; ")
        )))
    }

    fn count_identification(&self, source: IdentifiedBy, result: IdentifyResult) {
        self.metrics
            .access
            .identifications
            .get_or_create(&IdentifyLabels { source, result })
            .inc();
    }

    async fn by_peer_pod(&self, conn: &ConnIdentity) -> Outcome {
        if let Some(w) = conn.pod.get() {
            return Outcome::Identified(Caller::Workload(w.clone()));
        }
        let Some(ip) = conn.peer.ip() else {
            return Outcome::Unidentified("not a TCP connection".into());
        };
        if conn.peer.from_own_address() {
            // The broker's own pod has this IP, but such a connection is a proxy in the pod
            // delivering someone else's (Linkerd since 2.11), or a process beside the broker.
            return Outcome::Unidentified(format!(
                "the connection comes from the broker's own address ({ip}): a proxy in its pod \
                 forwarding another pod's caller, or a process beside it, which is no pod's caller"
            ));
        }
        let Some(pods) = &self.peer_pods else {
            return Outcome::Failed("no Kubernetes API".into());
        };
        match pods.find(ip).await {
            Found::Pod(w) => {
                // A racing request on the same connection may have set it: either is the pod.
                let w = conn.pod.get_or_init(|| w).clone();
                Outcome::Identified(Caller::Workload(w))
            }
            Found::Nobody(why) => Outcome::Unidentified(why),
            Found::Failed(why) => Outcome::Failed(why),
        }
    }

    fn shared_address(&self, peer: &Peer) -> bool {
        shared_address(peer, &self.settings.mesh_proxies)
    }

    async fn by_token(&self, conn: &ConnIdentity, headers: &HeaderMap) -> Outcome {
        let Some(value) = headers.get(http::header::AUTHORIZATION) else {
            return Outcome::Unidentified("no authorization header".into());
        };
        let token = value.to_str().ok().and_then(token::bearer);
        let Some(token) = token else {
            return Outcome::Unidentified(
                "the authorization header is not `Bearer <token>`".into(),
            );
        };
        let Some(tokens) = &self.tokens else {
            return Outcome::Failed("no Kubernetes API".into());
        };
        // Where the token comes from: the caller's address, one for every caller at a proxy's
        // (a new connection there is no new source), the connection on a unix socket.
        let source = match conn.peer.ip() {
            Some(ip) if self.shared_address(&conn.peer) => format!("proxy:{ip}"),
            Some(ip) => format!("ip:{ip}"),
            None => format!("connection:{}", conn.peer.id),
        };
        match tokens.review(token, &source).await {
            Reviewed::ServiceAccount(w) => Outcome::Identified(Caller::Workload(w)),
            Reviewed::Refused(why) => Outcome::Unidentified(why),
            Reviewed::Failed(why) => Outcome::Failed(why),
            Reviewed::Limited(why) => Outcome::Limited(why),
        }
    }

    fn by_certificate(&self, conn: &ConnIdentity) -> Outcome {
        let found = conn.certificate.get_or_init(|| {
            let Some(chain) = &conn.peer.client_certs else {
                return Err("no client certificate".into());
            };
            let leaf = chain.first().ok_or("no client certificate")?;
            let sa = identity::certificate_spiffe_id(leaf, self.settings.trust_domain.as_deref())?;
            Ok(Workload {
                namespace: sa.namespace,
                service_account: sa.name,
                pod: None,
                instance: Some(fingerprint(leaf)),
            })
        });
        match found {
            Ok(w) => Outcome::Identified(Caller::Workload(w.clone())),
            Err(why) => Outcome::Unidentified(why.clone()),
        }
    }

    fn by_mesh(&self, conn: &ConnIdentity, headers: &HeaderMap) -> Outcome {
        let Some(mesh) = self.settings.mesh else {
            return Outcome::Unidentified("no --mesh named".into());
        };
        // The other mesh's header: no proxy of this mesh sets it, so the client did.
        let other = mesh.other();
        if headers.contains_key(other.header()) {
            return Outcome::Forged(format!(
                "it sent {}, which only {other}'s proxy sets, and this broker is in {mesh} (--mesh {mesh})",
                other.header()
            ));
        }
        // Linkerd's proxy delivers from the pod's own IP since 2.11 (from 127.0.0.1 before).
        let from_proxy = conn
            .peer
            .ip()
            .is_some_and(|ip| self.settings.mesh_proxies.contains(&ip))
            || (mesh == Mesh::Linkerd && conn.peer.from_own_address());
        if !from_proxy {
            // Anyone can send the header; only the local proxy's is believed.
            return Outcome::Unidentified(
                "not from a local mesh proxy address (--mesh-proxy-addr); its mesh headers are ignored"
                    .into(),
            );
        }
        let values: Vec<&str> = headers
            .get_all(mesh.header())
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        if values.is_empty() {
            return Outcome::Unidentified(format!("no {} header", mesh.header()));
        }
        let value = values.join(",");
        let trust_domain = self.settings.trust_domain.as_deref();
        let found = match mesh {
            Mesh::Istio => identity::xfcc(&value, trust_domain).map(|(sa, hash)| {
                let instance = hash.unwrap_or_else(|| fingerprint(value.as_bytes()));
                (sa, Some(instance))
            }),
            Mesh::Linkerd => identity::l5d_client_id(&value, trust_domain).map(|sa| (sa, None)),
        };
        match found {
            Ok((sa, instance)) => Outcome::Identified(Caller::Workload(Workload {
                namespace: sa.namespace,
                service_account: sa.name,
                pod: None,
                instance,
            })),
            Err(why) => Outcome::Unidentified(why),
        }
    }
}

/// A short hash of a certificate, to tell instances of one service account apart in the limits.
fn fingerprint(der: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
