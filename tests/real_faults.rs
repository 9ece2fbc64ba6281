//! The faults real clusters have, on a real kube-apiserver and etcd: each test runs a control
//! plane of its own (the faults are the plane's), with the broker deployed as the Helm chart
//! deploys it, forty subscribers on ten widgets and writes going on. After the fault, a last
//! write to every widget must reach every subscriber (nothing lost), and the API server must
//! count one watch per widget. How long that took is printed (`docs/reliability.md`).
//!
//! At most two planes run at once: each starts an API server, and on two cores a third would
//! make the times measured those of a crowded machine. Most of each test is waiting (a drain,
//! an outage, a rejection window), which two planes share well.

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crd_broker::pb;
use crd_broker::pb::subscribe_response::Event;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};
use support::control_plane::*;
use support::relay::Relay;
use support::*;
use tokio::task::JoinHandle;

/// Control planes at once.
static PLANES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// Widgets, and subscribers per widget.
const WIDGETS: usize = 10;
const PER_WIDGET: usize = 4;

/// What one subscriber holds of its widget.
#[derive(Debug, Clone, Default)]
struct Held {
    present: bool,
    uid: String,
    rv: u64,
    messages: u64,
    /// Streams opened (more than one: the broker ended one, and it was opened again).
    streams: u64,
}

/// The widget as the server last wrote it.
#[derive(Debug, Clone)]
struct Written {
    uid: String,
    rv: u64,
}

impl Written {
    fn of(object: &DynamicObject) -> Written {
        Written {
            uid: object.metadata.uid.clone().unwrap_or_default(),
            rv: object
                .metadata
                .resource_version
                .as_deref()
                .and_then(|rv| rv.parse().ok())
                .unwrap_or(0),
        }
    }

    fn held_by(&self, held: &Held) -> bool {
        held.present && held.uid == self.uid && held.rv >= self.rv
    }
}

/// A plane, the broker on it through a relay, and subscribers on every widget. Dropped in this
/// order: the broker first, so that the plane, stopped next, has no watch to drain.
struct World {
    broker: Deployed,
    relay: Relay,
    ns: String,
    group: String,
    names: Vec<String>,
    held: Arc<Vec<Mutex<Held>>>,
    stop: Arc<AtomicBool>,
    subscribers: Vec<JoinHandle<()>>,
    plane: ControlPlane,
    _turn: tokio::sync::SemaphorePermit<'static>,
}

impl World {
    /// A plane of its own (kube-apiserver with `flags`), the broker deployed with `values`
    /// overlaid, and every subscriber holding its widget.
    async fn new(test: &str, flags: &[&str], values: Value) -> World {
        show_panics_in_place();
        let turn = PLANES.acquire().await.unwrap();
        let flags: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
        let plane = tokio::task::spawn_blocking(move || {
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            start_with("127.0.0.1", &flags)
        })
        .await
        .unwrap();
        let (ns, group, _) = widget_world(&plane, test).await;
        let names = many_widgets(&plane, &group, &ns, WIDGETS).await;
        let mut merged = widget_values(&group, &ns, "1s");
        chart::merge(
            &mut merged,
            &json!({ "extraArgs": ["--namespace-watch-threshold", "0"] }),
        );
        chart::merge(&mut merged, &values);
        let relay = Relay::to(plane.server.trim_start_matches("https://").parse().unwrap()).await;
        let through = format!("https://{}", relay.address);
        let broker = plane.deploy_through(&ns, merged, &through).await;
        let held: Arc<Vec<Mutex<Held>>> = Arc::new(
            (0..WIDGETS * PER_WIDGET)
                .map(|_| Mutex::default())
                .collect(),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let mut subscribers = Vec::new();
        for connection in 0..PER_WIDGET {
            let client = connect(broker.grpc).await;
            for (k, name) in names.iter().enumerate() {
                let i = connection * WIDGETS + k;
                let selector = format!("widgets.{group}/{ns}/{name}");
                subscribers.push(tokio::spawn(subscriber(
                    client.clone(),
                    selector,
                    held.clone(),
                    i,
                    stop.clone(),
                )));
            }
        }
        let world = World {
            plane,
            relay,
            ns,
            group,
            names,
            broker,
            held,
            stop,
            subscribers,
            _turn: turn,
        };
        eventually("every subscriber holds its widget", WAIT, async || {
            (0..world.held.len()).all(|i| world.held(i).present)
        })
        .await;
        world
    }

    fn held(&self, i: usize) -> Held {
        self.held[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    async fn api(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.plane.admin().await, &self.ns, &widgets(&self.group))
    }

    /// Patches a random widget every 100 ms until stopped, whatever the server answers.
    async fn writing(&self) -> Writer {
        let api = self.api().await;
        let names = self.names.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn({
            let (stop, done) = (stop.clone(), done.clone());
            async move {
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    seq += 1;
                    let name = &names[fastrand::usize(..names.len())];
                    let patch = Patch::Merge(json!({ "spec": { "seq": seq } }));
                    let params = PatchParams::default();
                    let write = api.patch(name, &params, &patch);
                    if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(2), write).await {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        });
        Writer { stop, done, task }
    }

    /// A new subscription to a widget the broker holds is answered at once (during an outage,
    /// from what the broker knows).
    async fn serves_what_it_holds(&self) {
        let mut client = connect(self.broker.grpc).await;
        let selector = format!("widgets.{}/{}/{}", self.group, self.ns, self.names[0]);
        let mut s = subscribe(&mut client, &[&selector]).await;
        let first = tokio::time::timeout(Duration::from_secs(2), s.message())
            .await
            .expect("a held widget is served at once")
            .unwrap()
            .unwrap();
        assert_eq!(first.event(), Event::Snapshot);
    }

    /// A new subscriber to a held widget, while the API server refuses the broker: refused
    /// (PERMISSION_DENIED, the broker may not read it now), once the widget's watch has been.
    async fn refuses_what_it_may_not_read(&self) {
        let mut client = connect(self.broker.grpc).await;
        let selector = format!("widgets.{}/{}/{}", self.group, self.ns, self.names[0]);
        let mut last = None;
        eventually("a new subscriber is refused", WAIT * 3, async || {
            let refused = client.subscribe(request(&[&selector])).await.err();
            let denied = refused
                .as_ref()
                .is_some_and(|s| s.code() == tonic::Code::PermissionDenied);
            last = refused;
            denied
        })
        .await;
        let status = last.expect("refused");
        assert!(
            status.message().contains("the broker may not read it now"),
            "{status:?}"
        );
    }

    /// After the fault: a last write to every widget (retried until the server takes it), then
    /// every subscriber must hold it, and the API server must count one watch per widget.
    async fn settle(&self, fault: &str) -> Duration {
        let api = self.api().await;
        let mut last = Vec::new();
        for name in &self.names {
            let patch = Patch::Merge(json!({ "spec": { "last": true, "seq": 0 } }));
            let written = tokio::time::timeout(Duration::from_secs(90), async {
                loop {
                    match api.patch(name, &PatchParams::default(), &patch).await {
                        Ok(object) => return Written::of(&object),
                        Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
            })
            .await
            .expect("the server takes writes again");
            last.push(written);
        }
        let written = Instant::now();
        let all_hold = || (0..self.held.len()).all(|i| last[i % WIDGETS].held_by(&self.held(i)));
        while !all_hold() && written.elapsed() < Duration::from_secs(60) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let converged = written.elapsed();
        let lost: Vec<String> = (0..self.held.len())
            .filter(|&i| !last[i % WIDGETS].held_by(&self.held(i)))
            .map(|i| format!("{} holds {:?}", self.names[i % WIDGETS], self.held(i)))
            .collect();
        assert!(lost.is_empty(), "{fault}: lost the last write: {lost:?}");
        eventually(
            "the API server counts one watch per widget",
            WAIT * 3,
            async || self.plane.open_watches(&self.group, "widgets").await == WIDGETS as f64,
        )
        .await;
        let ours = metrics(self.broker.admin).await;
        eprintln!(
            "REAL FAULT | {fault} | converged {:.0} ms after the last write | lost 0 | API \
             watches {WIDGETS} for {WIDGETS} widgets | 410s {} | 429s {} (held {:.1} s) | \
             subscriber streams ended {}",
            converged.as_secs_f64() * 1000.0,
            get(&ours, "crd_broker_api_expired_total"),
            total(&ours, "crd_broker_api_requests_total", &[("code", "429")]),
            get(
                &ours,
                "crd_broker_api_held_seconds_total{reason=\"retry_after\"}"
            ),
            self.stream_ends(),
        );
        converged
    }

    /// Subscriber streams the broker ended (each opened again).
    fn stream_ends(&self) -> u64 {
        (0..self.held.len())
            .map(|i| self.held(i).streams.saturating_sub(1))
            .sum()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for s in &self.subscribers {
            s.abort();
        }
    }
}

/// The background writer of [`World::writing`].
struct Writer {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Writer {
    /// Stops it; the writes the server took.
    async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.task.await;
        self.done.load(Ordering::Relaxed)
    }
}

/// One subscriber: records every message, and subscribes again when its stream ends, as the
/// flagd providers do.
async fn subscriber(
    mut client: pb::broker_client::BrokerClient<tonic::transport::Channel>,
    selector: String,
    held: Arc<Vec<Mutex<Held>>>,
    i: usize,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Relaxed) {
        if let Ok(response) = client.subscribe(request(&[&selector])).await {
            held[i]
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .streams += 1;
            let mut stream = response.into_inner();
            while let Ok(Some(m)) = stream.message().await {
                let mut held = held[i].lock().unwrap_or_else(PoisonError::into_inner);
                held.messages += 1;
                match m.event() {
                    Event::Snapshot | Event::Updated => {
                        held.present = true;
                        held.uid = m.uid;
                        held.rv = m.resource_version.parse().unwrap_or(0);
                    }
                    Event::Deleted | Event::Absent => held.present = false,
                    _ => {}
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_api_server_killed_and_restarted_on_the_same_etcd() {
    let world = World::new("apiserver-killed", &[], json!({})).await;
    let writer = world.writing().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    world.plane.stop(Component::ApiServer, "KILL").await;
    world.serves_what_it_holds().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    world.plane.start_again(Component::ApiServer).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(writer.stop().await > 0);
    world.settle("kube-apiserver SIGKILL, restarted").await;
}

#[tokio::test]
async fn the_api_server_stopped_gracefully_and_restarted() {
    let world = World::new("apiserver-stopped", &[], json!({})).await;
    let writer = world.writing().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let asked = Instant::now();
    world.plane.stop(Component::ApiServer, "TERM").await;
    // It drains: it waits for its open requests, the broker's watches among them, up to its
    // --request-timeout (60 s).
    let drained = asked.elapsed();
    world.serves_what_it_holds().await;
    world.plane.start_again(Component::ApiServer).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(writer.stop().await > 0);
    world
        .settle(&format!(
            "kube-apiserver SIGTERM ({:.0} s to exit), restarted",
            drained.as_secs_f64()
        ))
        .await;
}

#[tokio::test]
async fn etcd_killed_while_the_api_server_stays_up() {
    let world = World::new("etcd-killed", &[], json!({})).await;
    let writer = world.writing().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    world.plane.stop(Component::Etcd, "KILL").await;
    // The API server is up without its storage for twelve seconds; the broker serves what it
    // knows, and is ready (the outage is shorter than --max-staleness).
    tokio::time::sleep(Duration::from_secs(6)).await;
    world.serves_what_it_holds().await;
    assert!(matches!(world.broker.readiness().await, Some((200, _))));
    tokio::time::sleep(Duration::from_secs(6)).await;
    world.plane.start_again(Component::Etcd).await;
    assert!(writer.stop().await > 0);
    world.settle("etcd SIGKILL, down 12 s").await;
}

#[tokio::test]
async fn a_watch_resumed_from_a_compacted_version_is_told_410_in_its_stream_and_relists() {
    // Without the watch cache every watch is etcd's own, and etcd's compaction is what decides
    // whether a version can still be resumed from.
    let world = World::new("compacted", &["--watch-cache=false"], json!({})).await;
    let writer = world.writing().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(writer.stop().await > 0);
    // One widget written last: every other watch's version is now older than the store's.
    let api = world.api().await;
    api.patch(
        &world.names[0],
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "seq": -1 } })),
    )
    .await
    .unwrap();
    let revision = world.plane.compact_etcd().await;
    // The connections cut: each watch resumes from its last version, compacted away.
    world.relay.cut();
    let admin = world.broker.admin;
    eventually("the broker is told of the compaction", WAIT, async || {
        get(&metrics(admin).await, "crd_broker_api_expired_total") >= 1.0
    })
    .await;
    let ours = metrics(admin).await;
    eprintln!(
        "compacted at revision {revision}: {} 410s, {} of them as a response",
        get(&ours, "crd_broker_api_expired_total"),
        get(
            &ours,
            "crd_broker_api_requests_total{code=\"410\",verb=\"watch\"}"
        ),
    );
    world.settle("etcd compacted, watches resumed (410)").await;
}

#[tokio::test]
async fn watches_the_api_server_ends_again_and_again() {
    // Over HTTP/1.1 the broker asks for 35 s watches (over HTTP/2, 290 s; a timeout the client
    // asks for is what the server keeps, whatever its --min-request-timeout).
    let world = World::new(
        "timeouts",
        &["--min-request-timeout=20"],
        json!({ "extraArgs": ["--namespace-watch-threshold", "0", "--api-http2", "off"] }),
    )
    .await;
    let ended = || async {
        let labels = [("verb", "WATCH"), ("group", world.group.as_str())];
        total(
            &world.plane.metrics().await,
            "apiserver_request_total",
            &labels,
        )
    };
    let before = ended().await;
    let writer = world.writing().await;
    tokio::time::sleep(Duration::from_secs(75)).await;
    assert!(writer.stop().await > 0);
    let by_server = ended().await - before;
    assert!(
        by_server >= 2.0 * WIDGETS as f64,
        "the server ended {by_server} watches in 75 s"
    );
    world
        .settle(&format!(
            "watch timeouts: {by_server} watches ended by the server in 75 s"
        ))
        .await;
}

#[tokio::test]
async fn priority_and_fairness_rejecting_every_request_of_the_broker_for_thirty_seconds() {
    let world = World::new("rejected", &[], json!({})).await;
    // A priority level with no seats at all, which rejects what it cannot seat: every request
    // of the broker's ServiceAccount.
    let name = format!("{}-rejected", world.ns);
    let account = &world.broker.namespace;
    world.plane.prioritize(&name, &world.ns, account, 0).await;
    // A level without seats still runs one request when it runs none (so that nothing starves):
    // eight clients as the broker's ServiceAccount keep that one seat busy with LISTs.
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = world
        .plane
        .kubeconfig_for(&world.ns, account, dir.path(), &world.plane.server)
        .await;
    let hog: Api<DynamicObject> = Api::namespaced_with(
        client_from(&kubeconfig).await,
        &world.ns,
        &widgets(&world.group),
    );
    let hogging = Arc::new(AtomicBool::new(true));
    let hogs: Vec<JoinHandle<()>> = (0..8)
        .map(|_| {
            let (hog, hogging) = (hog.clone(), hogging.clone());
            tokio::spawn(async move {
                while hogging.load(Ordering::Relaxed) {
                    let _ = hog.list(&Default::default()).await;
                }
            })
        })
        .collect();
    let writer = world.writing().await;
    // Every watch must be asked for again, and is rejected, again and again, for 30 s.
    tokio::time::sleep(Duration::from_secs(1)).await;
    world.relay.cut();
    let started = Instant::now();
    let admin = world.broker.admin;
    let too_many = || async {
        total(
            &metrics(admin).await,
            "crd_broker_api_requests_total",
            &[("code", "429")],
        )
    };
    eventually("the server rejects the broker", WAIT, async || {
        too_many().await > 0.0
    })
    .await;
    world.serves_what_it_holds().await;
    tokio::time::sleep(Duration::from_secs(30).saturating_sub(started.elapsed())).await;
    hogging.store(false, Ordering::Relaxed);
    for hog in hogs {
        let _ = hog.await;
    }
    let broker_rejected = too_many().await;
    world.plane.unprioritize(&name).await;
    assert!(writer.stop().await > 0);
    let refused = world.plane.rejected(&name).await;
    let ours = metrics(world.broker.admin).await;
    let held = get(
        &ours,
        "crd_broker_api_held_seconds_total{reason=\"retry_after\"}",
    );
    eprintln!(
        "Priority and Fairness: {refused} requests rejected, {broker_rejected} of the broker's; \
         it held its requests {held:.1} s as the server asked"
    );
    assert!(held > 0.0, "the broker waited as the server asked");
    world
        .settle(&format!(
            "Priority and Fairness rejecting for 30 s ({broker_rejected} of the broker's requests)"
        ))
        .await;
}

#[tokio::test]
async fn the_brokers_rights_revoked_and_restored() {
    let world = World::new("rbac", &[], json!({})).await;
    let writer = world.writing().await;
    let revoked = world.plane.revoke(&world.ns, &world.ns).await;
    // Every watch asked for again, without the right to.
    world.relay.cut();
    let admin = world.broker.admin;
    eventually("the server refuses the broker", WAIT, async || {
        total(
            &metrics(admin).await,
            "crd_broker_api_requests_total",
            &[("code", "403")],
        ) > 0.0
    })
    .await;
    // Its subscribers keep what they hold; a new one is refused what the broker may no longer
    // read, once the server has refused its watch.
    world.refuses_what_it_may_not_read().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    world.plane.restore(revoked).await;
    assert!(writer.stop().await > 0);
    world.settle("RBAC revoked for 3 s, restored").await;
}

#[tokio::test]
async fn the_crd_deleted_and_created_again() {
    let world = World::new("crd-again", &[], json!({})).await;
    let writer = world.writing().await;
    let crd = crd(&world.group, "widgets", "Widget");
    let crds: Api<DynamicObject> = Api::all_with(
        world.plane.admin().await,
        &kube::core::ApiResource::from_gvk(&kube::core::GroupVersionKind::gvk(
            "apiextensions.k8s.io",
            "v1",
            "CustomResourceDefinition",
        )),
    );
    let crd_name = format!("widgets.{}", world.group);
    crds.delete(&crd_name, &DeleteParams::default())
        .await
        .unwrap();
    eventually("the CRD and its widgets are gone", WAIT * 3, async || {
        crds.get_opt(&crd_name).await.unwrap().is_none()
    })
    .await;
    // Every subscriber is told its widget is gone.
    eventually("every subscriber holds nothing", WAIT, async || {
        (0..world.held.len()).all(|i| !world.held(i).present)
    })
    .await;
    world.plane.install_crds(&[crd]).await;
    many_widgets(&world.plane, &world.group, &world.ns, WIDGETS).await;
    writer.stop().await;
    world
        .settle("CRD deleted and created again, with new widgets")
        .await;
}

#[tokio::test]
async fn http2_connections_cut_at_random_by_the_servers_goaways() {
    // The server answers one request in fifty with a GOAWAY (the most it allows): the
    // connection takes no new streams and closes once its streams are done.
    let world = World::new("goaway", &["--goaway-chance=0.02"], json!({})).await;
    let writer = world.writing().await;
    // New watches, again and again: fifty more widgets subscribed at once and left, ten times.
    let resource = widgets(&world.group);
    let extra: Vec<String> = (0..50).map(|i| format!("x{i}")).collect();
    for name in &extra {
        let object = widget(&world.group, &world.ns, name, "red");
        create(&world.plane, &resource, &world.ns, object).await;
    }
    let connections_before = world.relay.accepted();
    let mut client = connect(world.broker.grpc).await;
    let selectors: Vec<String> = extra
        .iter()
        .map(|n| format!("widgets.{}/{}/{n}", world.group, world.ns))
        .collect();
    let selectors: Vec<&str> = selectors.iter().map(String::as_str).collect();
    for _ in 0..10 {
        let mut s = subscribe(&mut client, &selectors).await;
        for _ in &extra {
            assert_eq!(next(&mut s).await.event(), Event::Snapshot);
        }
        drop(s);
        // The linger (1 s) ends their watches.
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    assert!(writer.stop().await > 0);
    let opened = world.relay.accepted() - connections_before;
    eprintln!("GOAWAYs: the broker opened {opened} new connections to the API server");
    assert!(opened > 0, "no GOAWAY in a thousand requests");
    world
        .settle(&format!(
            "GOAWAY on 2% of requests ({opened} new connections)"
        ))
        .await;
}
