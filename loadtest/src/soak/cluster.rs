//! Where a soak runs: on the project's fake API server, whose faults are injected on demand
//! (a dropped watch, a 500, a stall), or on a real control plane (`--real`), whose faults are
//! the ones real clusters have (kube-apiserver killed or stopped, etcd killed, history
//! compacted, Priority and Fairness rejecting, RBAC revoked, the CRD re-created, and HTTP/2
//! connections cut at random by `--goaway-chance` all along).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use control_plane::{Component, ControlPlane};
use fake_apiserver::{Deny, FakeApiServer, Matcher};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

use super::faults::{FAULTS, Fault, REAL_FAULTS};
use crate::fixtures::{BROKER_BINDING, CRD, GV, flag};

/// Kube-apiserver's flags for a soak: HTTP/2 connections cut at random (one response in 50
/// ends its connection with a GOAWAY), and requests bounded at 20 s, so that a graceful stop
/// drains in 20 s rather than a minute.
pub const REAL_FLAGS: [&str; 2] = ["--goaway-chance=0.02", "--request-timeout=20s"];

/// The Priority and Fairness level that rejects the broker during [`Fault::Rejected`].
const REJECTING: &str = "crd-broker-soak-rejecting";

/// The API server of a soak.
pub enum Cluster {
    /// The fake, in this process.
    Fake(Arc<FakeApiServer>),
    /// A real control plane.
    Real(Box<Real>),
}

/// A real control plane and an admin's view of its FeatureFlags.
pub struct Real {
    /// The plane (stopped when dropped).
    pub plane: ControlPlane,
    flags: Api<DynamicObject>,
    /// Times a component did not start again at the first try (and did at the second).
    pub starts_retried: AtomicU64,
}

/// A CR's state on the server.
#[derive(Debug, Clone, PartialEq)]
pub enum Truth {
    /// There, with its uid and resourceVersion.
    Present { uid: String, rv: u64 },
    /// Not there.
    Absent,
}

/// An object's resourceVersion as a number (0 when it has none).
pub fn rv_of(obj: &Value) -> u64 {
    obj["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn between(rng: &mut fastrand::Rng, low_ms: u64, high_ms: u64) -> Duration {
    Duration::from_millis(rng.u64(low_ms..=high_ms))
}

impl Real {
    /// Starts a control plane with [`REAL_FLAGS`] and the soak's world on it.
    pub async fn start(crs: usize) -> anyhow::Result<Real> {
        let plane =
            tokio::task::spawn_blocking(|| control_plane::start_with("127.0.0.1", &REAL_FLAGS))
                .await
                .map_err(|e| anyhow::anyhow!("scripts/control-plane up failed: {e}"))?;
        crate::fixtures::real_world(&plane, crs, 256).await?;
        let flags = Api::namespaced_with(
            plane.admin().await,
            "default",
            &crate::fixtures::featureflags(),
        );
        Ok(Real {
            plane,
            flags,
            starts_retried: AtomicU64::new(0),
        })
    }

    /// Starts `component` again; one that does not come up (the script says how it ended) is
    /// started once more, and counted: that is the machine's, not the broker's.
    async fn start_again(&self, component: Component) {
        if let Err(e) = self.plane.try_start_again(component).await {
            eprintln!("soak: {component:?} did not start again; once more. {e}");
            self.starts_retried.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_secs(2)).await;
            self.plane.start_again(component).await;
        }
    }

    fn crd(&self) -> anyhow::Result<Value> {
        serde_saphyr::from_str(CRD).context("the FeatureFlag CRD")
    }
}

impl Cluster {
    /// The faults this cluster can have.
    pub fn faults(&self) -> &'static [Fault] {
        match self {
            Cluster::Fake(_) => &FAULTS,
            Cluster::Real(_) => &REAL_FAULTS,
        }
    }

    /// How long every subscriber may take to hold a probe written after a fault: a real API
    /// server restarted comes back with an empty watch cache, which answers 429 until it is
    /// filled from etcd.
    pub fn probe_bound(&self) -> Duration {
        match self {
            Cluster::Fake(_) => Duration::from_secs(15),
            Cluster::Real(_) => Duration::from_secs(30),
        }
    }

    /// The CR `cr` now.
    pub async fn truth(&self, cr: &str) -> Truth {
        let object = match self {
            Cluster::Fake(fake) => fake.get(GV, "featureflags", "default", cr).ok(),
            Cluster::Real(real) => match real.flags.get_opt(cr).await {
                Ok(found) => found.and_then(|o| serde_json::to_value(o).ok()),
                // Unknown (the server is down): not a state to compare with.
                Err(_) => return Truth::Absent,
            },
        };
        match object {
            Some(obj) => Truth::Present {
                uid: obj["metadata"]["uid"].as_str().unwrap_or_default().into(),
                rv: rv_of(&obj),
            },
            None => Truth::Absent,
        }
    }

    /// Writes `seq` into `cr`: its new resourceVersion.
    pub async fn patch(&self, cr: &str, seq: u64) -> anyhow::Result<u64> {
        let patch = json!({ "spec": { "flagSpec": { "metadata": { "seq": seq } } } });
        match self {
            Cluster::Fake(fake) => Ok(rv_of(&fake.merge_patch(
                GV,
                "featureflags",
                "default",
                cr,
                patch,
            )?)),
            Cluster::Real(real) => {
                let obj = real
                    .flags
                    .patch(cr, &PatchParams::default(), &Patch::Merge(patch))
                    .await?;
                Ok(rv_of(&serde_json::to_value(obj)?))
            }
        }
    }

    /// Deletes `cr`; whether it was deleted.
    pub async fn delete(&self, cr: &str) -> bool {
        match self {
            Cluster::Fake(fake) => fake.delete(GV, "featureflags", "default", cr).is_ok(),
            Cluster::Real(real) => real
                .flags
                .delete(cr, &DeleteParams::default())
                .await
                .is_ok(),
        }
    }

    /// Creates `cr` anew; whether it was created.
    pub async fn create(&self, cr: &str) -> bool {
        match self {
            Cluster::Fake(fake) => fake.apply(flag(cr, 256)).is_ok(),
            Cluster::Real(real) => match serde_json::from_value(flag(cr, 256)) {
                Ok(obj) => real
                    .flags
                    .create(&PostParams::default(), &obj)
                    .await
                    .is_ok(),
                Err(_) => false,
            },
        }
    }

    /// Ends every fault still on (the fake's; a real fault ends within [`Cluster::inject`]).
    pub fn clear(&self) {
        if let Cluster::Fake(fake) = self {
            fake.clear_faults();
            fake.stall_watches(false);
        }
    }

    /// FeatureFlag watches the API server serves now.
    pub async fn open_watches(&self) -> usize {
        match self {
            Cluster::Fake(fake) => fake.open_watches(),
            Cluster::Real(real) => real
                .plane
                .open_watches("core.openfeature.dev", "featureflags")
                .await
                .round() as usize,
        }
    }

    /// CRs `0..crs` not watched by exactly one watch. The fake counts each CR's watches by its
    /// field selector; a real server counts watches by resource only, so there it is how far
    /// the total is from one per CR.
    pub async fn watches_not_one(&self, crs: usize, path: &str) -> usize {
        match self {
            Cluster::Fake(fake) => (0..crs)
                .filter(|&k| {
                    let selector = format!("metadata.name={}", crate::fixtures::name(k));
                    fake.open_watches_on(path, Some(&selector)) != 1
                })
                .count(),
            Cluster::Real(_) => self.open_watches().await.abs_diff(crs),
        }
    }

    /// The broker's TCP connections to the API server (`pid`: the broker's).
    pub fn api_connections(&self, pid: u32) -> usize {
        match self {
            Cluster::Fake(fake) => fake.open_connections(),
            Cluster::Real(real) => {
                let port = real
                    .plane
                    .server
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.parse().ok())
                    .unwrap_or(0);
                crate::stats::sockets(pid, "01", crate::stats::End::Remote, port)
            }
        }
    }

    /// Injects `fault`, lets it last, and ends it.
    pub async fn inject(&self, fault: Fault, rng: &mut fastrand::Rng, stable: &[String]) {
        match self {
            Cluster::Fake(fake) => inject_fake(fake, fault, rng, stable).await,
            Cluster::Real(real) => real.inject(self, fault, rng, stable).await,
        }
    }
}

impl Real {
    async fn inject(
        &self,
        cluster: &Cluster,
        fault: Fault,
        rng: &mut fastrand::Rng,
        stable: &[String],
    ) {
        let plane = &self.plane;
        match fault {
            Fault::ApiServerKilled => {
                plane.stop(Component::ApiServer, "KILL").await;
                tokio::time::sleep(between(rng, 500, 5_000)).await;
                self.start_again(Component::ApiServer).await;
            }
            Fault::ApiServerStopped => {
                plane.stop(Component::ApiServer, "TERM").await;
                self.start_again(Component::ApiServer).await;
            }
            Fault::EtcdKilled => {
                plane.stop(Component::Etcd, "KILL").await;
                tokio::time::sleep(between(rng, 10_000, 30_000)).await;
                self.start_again(Component::Etcd).await;
            }
            Fault::Compaction => {
                // Writes, then every older version compacted away, then the API server's
                // restart ends every watch: each resumes from a version etcd no longer has.
                for cr in stable.iter().take(3) {
                    let _ = cluster.patch(cr, 0).await;
                }
                plane.compact_etcd().await;
                plane.stop(Component::ApiServer, "KILL").await;
                self.start_again(Component::ApiServer).await;
            }
            Fault::Rejected => {
                plane.prioritize(REJECTING, "default", "broker", 0).await;
                tokio::time::sleep(between(rng, 5_000, 30_000)).await;
                plane.unprioritize(REJECTING).await;
            }
            Fault::RbacRevoked => {
                let revoked = plane.revoke("default", BROKER_BINDING).await;
                tokio::time::sleep(between(rng, 1_000, 10_000)).await;
                plane.restore(revoked).await;
            }
            Fault::CrdRecreated => {
                let Ok(crd) = self.crd() else { return };
                let crds: Api<DynamicObject> = Api::all_with(
                    plane.admin().await,
                    &ApiResource::from_gvk_with_plural(
                        &GroupVersionKind::gvk(
                            "apiextensions.k8s.io",
                            "v1",
                            "CustomResourceDefinition",
                        ),
                        "customresourcedefinitions",
                    ),
                );
                let name = "featureflags.core.openfeature.dev";
                let _ = crds.delete(name, &DeleteParams::default()).await;
                // Its objects go first (the CRD's finalizer), then the CRD itself.
                for _ in 0..600 {
                    if matches!(crds.get_opt(name).await, Ok(None)) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                tokio::time::sleep(between(rng, 100, 1_000)).await;
                plane.install_crds(&[crd]).await;
                for cr in stable {
                    cluster.create(cr).await;
                }
            }
            _ => {}
        }
    }
}

/// Injects `fault` into the fake, lets it last, and ends it.
async fn inject_fake(
    fake: &FakeApiServer,
    fault: Fault,
    rng: &mut fastrand::Rng,
    stable: &[String],
) {
    let times = rng.usize(1..=5);
    let patch = |cr: &str| {
        fake.merge_patch(
            GV,
            "featureflags",
            "default",
            cr,
            json!({ "spec": { "flagSpec": { "metadata": { "seq": 0 } } } }),
        )
    };
    match fault {
        Fault::Drop => fake.abort_watches(),
        Fault::Close => fake.close_watches(),
        Fault::Error410 => fake.error_watches(410),
        Fault::Compaction => {
            fake.compact();
            for cr in stable.iter().take(3) {
                let _ = patch(cr);
            }
            fake.abort_watches();
        }
        Fault::List500 | Fault::List429 => {
            let (code, retry) = if fault == Fault::List500 {
                (500, None)
            } else {
                (429, Some(1))
            };
            fake.fail_next(Matcher::verb("list"), times, code, retry);
            fake.error_watches(410);
        }
        Fault::Watch500 | Fault::Watch429 => {
            let (code, retry) = if fault == Fault::Watch500 {
                (500, None)
            } else {
                (429, Some(1))
            };
            fake.fail_next(Matcher::verb("watch"), times, code, retry);
            fake.close_watches();
        }
        Fault::Stall => {
            fake.stall_watches(true);
            tokio::time::sleep(between(rng, 200, 1_500)).await;
            fake.stall_watches(false);
        }
        Fault::Hang => {
            fake.hang_next(Matcher::verb("watch"), times);
            fake.close_watches();
        }
        Fault::Down => {
            let _ = fake.restart(between(rng, 200, 1_500)).await;
        }
        Fault::CrdRecreated => {
            let _ = fake.delete_crd("featureflags.core.openfeature.dev");
            tokio::time::sleep(between(rng, 100, 1_000)).await;
            let _ = fake.install_crd_yaml(CRD);
            for cr in stable {
                let _ = fake.apply(flag(cr, 256));
            }
        }
        Fault::RbacRevoked => {
            let deny = Deny {
                group: Some("core.openfeature.dev".into()),
                resource: Some("featureflags".into()),
                ..Deny::default()
            };
            fake.deny(deny.clone());
            fake.close_watches();
            tokio::time::sleep(between(rng, 200, 1_500)).await;
            fake.remove_deny(&deny);
        }
        _ => {}
    }
    // Injections last a moment, then the fault is over (hung requests are answered).
    tokio::time::sleep(between(rng, 50, 400)).await;
    fake.clear_faults();
}
