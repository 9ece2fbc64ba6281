//! The registry as a state machine, against a scripted source ([`Scripted`]): start, share, linger and
//! teardown (with paused time), conflation for slow readers, races, shutdown and errors.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use super::*;
use crate::source::scripted::Scripted;
use crate::source::{Object, Observed, SourceError};

fn sel(name: &str) -> Selector {
    format!("featureflags.v1beta1.core.openfeature.dev/default/{name}")
        .parse()
        .unwrap()
}

fn present(uid: &str, rv: u64) -> Result<Observed, SourceError> {
    Ok(Observed::Present(Object {
        json: Bytes::from(format!(r#"{{"rv":{rv}}}"#)),
        uid: uid.to_string(),
        resource_version: rv.to_string(),
    }))
}

fn rv_of(state: &State) -> Option<String> {
    match state {
        State::Present(u) => Some(u.object.resource_version.clone()),
        _ => None,
    }
}

fn registry(linger: Duration) -> (Registry<Scripted>, Scripted, CancellationToken) {
    let source = Scripted::default();
    let shutdown = CancellationToken::new();
    (
        Registry::new(source.clone(), linger, shutdown.clone()),
        source,
        shutdown,
    )
}

/// Lets spawned tasks run (under paused time, without moving the clock much).
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(1)).await;
}

#[tokio::test(start_paused = true)]
async fn first_subscriber_starts_one_watch_and_later_ones_share_it() {
    let (registry, source, _shutdown) = registry(Duration::from_secs(30));
    let subs: Vec<_> = (0..3).map(|_| registry.subscribe(&sel("a"))).collect();
    settle().await;
    assert_eq!(source.started(), 1);
    assert_eq!(registry.len(), 1);
    assert_eq!(registry.watches()[0].subscribers, 3);
    let _b = registry.subscribe(&sel("b"));
    settle().await;
    assert_eq!(source.started(), 2);
    drop(subs);
}

#[tokio::test(start_paused = true)]
async fn a_new_subscriber_gets_the_current_state_at_once() {
    let (registry, source, _shutdown) = registry(Duration::from_secs(30));
    let mut first = registry.subscribe(&sel("a"));
    assert!(matches!(first.current(), State::Pending));
    settle().await;
    source.send(&sel("a"), present("u", 5));
    assert!(first.changed().await);
    assert_eq!(rv_of(&first.current()).as_deref(), Some("5"));
    let mut second = registry.subscribe(&sel("a"));
    assert_eq!(
        rv_of(&second.current()).as_deref(),
        Some("5"),
        "no wait for the source"
    );
    assert_eq!(source.started(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_last_subscriber_leaving_stops_the_watch_after_the_linger() {
    let (registry, source, _shutdown) = registry(Duration::from_secs(10));
    let sub = registry.subscribe(&sel("a"));
    settle().await;
    drop(sub);
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert_eq!((source.live(), registry.len()), (1, 1), "still lingering");
    tokio::time::sleep(Duration::from_secs(2)).await;
    settle().await;
    assert_eq!(
        (source.live(), registry.len(), registry.tasks()),
        (0, 0, 0),
        "stopped at the source"
    );
}

#[tokio::test(start_paused = true)]
async fn with_no_linger_the_watch_stops_at_once() {
    let (registry, source, _shutdown) = registry(Duration::ZERO);
    let sub = registry.subscribe(&sel("a"));
    settle().await;
    drop(sub);
    settle().await;
    assert_eq!((source.live(), registry.len()), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_subscriber_returning_within_the_linger_keeps_the_warm_watch() {
    let (registry, source, _shutdown) = registry(Duration::from_secs(10));
    drop(registry.subscribe(&sel("a")));
    settle().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let back = registry.subscribe(&sel("a"));
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!((source.started(), source.live()), (1, 1));
    drop(back);
}

#[tokio::test(start_paused = true)]
async fn the_linger_runs_from_the_last_departure() {
    let (registry, source, _shutdown) = registry(Duration::from_secs(10));
    drop(registry.subscribe(&sel("a")));
    settle().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    drop(registry.subscribe(&sel("a")));
    tokio::time::sleep(Duration::from_secs(6)).await;
    settle().await;
    assert_eq!(
        source.live(),
        1,
        "11 s after the first departure, 6 s after the last"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    settle().await;
    assert_eq!(source.live(), 0);
    assert_eq!(source.started(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_slow_subscriber_skips_to_the_latest_state_and_delays_nobody() {
    let (registry, source, _shutdown) = registry(Duration::from_secs(30));
    let mut slow = registry.subscribe(&sel("a"));
    let mut fast = registry.subscribe(&sel("a"));
    settle().await;
    for rv in 1..=100 {
        source.send(&sel("a"), present("u", rv));
        settle().await;
        assert!(fast.changed().await);
        assert_eq!(
            rv_of(&fast.current()),
            Some(rv.to_string()),
            "the fast reader sees each one"
        );
    }
    assert!(slow.changed().await);
    assert_eq!(
        rv_of(&slow.current()).as_deref(),
        Some("100"),
        "the slow reader gets the newest"
    );
}

#[tokio::test(start_paused = true)]
async fn repeated_states_are_not_republished() {
    let (registry, source, _shutdown) = registry(Duration::from_secs(30));
    let mut sub = registry.subscribe(&sel("a"));
    settle().await;
    source.send(&sel("a"), present("u", 1));
    assert!(sub.changed().await);
    sub.current();
    source.send(&sel("a"), present("u", 1));
    source.send(&sel("a"), Ok(Observed::Absent));
    source.send(&sel("a"), Ok(Observed::Absent));
    settle().await;
    assert!(sub.changed().await);
    match sub.current() {
        State::Absent { last: Some(u) } => assert_eq!(u.object.resource_version, "1"),
        other => panic!("expected Absent with the last state, got {other:?}"),
    }
    settle().await;
    assert!(
        !sub.rx.has_changed().unwrap(),
        "the second Absent changed nothing"
    );
}

#[tokio::test(start_paused = true)]
async fn errors_fail_a_resource_nobody_has_seen_and_keep_a_known_state() {
    let (registry, source, _shutdown) = registry(Duration::from_secs(30));
    let mut a = registry.subscribe(&sel("a"));
    settle().await;
    source.send(&sel("a"), Err(SourceError::Forbidden("no".into())));
    assert!(a.changed().await);
    assert!(matches!(
        a.current(),
        State::Failed(SourceError::Forbidden(_))
    ));
    source.send(&sel("a"), present("u", 3));
    assert!(a.changed().await);
    assert_eq!(rv_of(&a.current()).as_deref(), Some("3"), "recovered");
    source.send(&sel("a"), Err(SourceError::Unavailable("blip".into())));
    settle().await;
    assert_eq!(
        rv_of(&a.current()).as_deref(),
        Some("3"),
        "the known state stays"
    );
    assert_eq!(registry.watches()[0].errors, 2);
}

#[tokio::test(start_paused = true)]
async fn a_kind_no_longer_served_fails_its_known_state_and_is_forgotten_by_the_source() {
    let (registry, source, _shutdown) = registry(Duration::from_secs(30));
    let mut a = registry.subscribe(&sel("a"));
    settle().await;
    source.send(&sel("a"), present("u", 3));
    assert!(a.changed().await);
    source.send(&sel("a"), Err(SourceError::Forbidden("no".into())));
    settle().await;
    assert_eq!(rv_of(&a.current()).as_deref(), Some("3"), "forbidden: kept");
    // The version watched stopped being served: the last state will not change again.
    source.send(&sel("a"), Err(SourceError::UnknownKind("gone".into())));
    assert!(a.changed().await);
    assert!(matches!(
        a.current(),
        State::Failed(SourceError::UnknownKind(_))
    ));
    assert_eq!(source.forgotten(), 1, "the source asks discovery again");
}

#[tokio::test(start_paused = true)]
async fn shutdown_ends_every_subscription_and_stops_every_watch() {
    let (registry, source, shutdown) = registry(Duration::from_secs(30));
    let mut subs: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|n| registry.subscribe(&sel(n)))
        .collect();
    settle().await;
    shutdown.cancel();
    for sub in &mut subs {
        assert!(!sub.changed().await, "the subscription ends");
    }
    registry.stopped().await;
    assert_eq!((source.live(), registry.len()), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribes_racing_teardowns_always_land_on_a_live_watch() {
    let (registry, source, _shutdown) = registry(Duration::ZERO);
    let names = ["a", "b", "c"];
    let mut workers = Vec::new();
    for w in 0..8 {
        let registry = registry.clone();
        workers.push(tokio::spawn(async move {
            let mut kept = Vec::new();
            for i in 0..500 {
                let s = registry.subscribe(&sel(names[(w + i) % names.len()]));
                if i % 97 == 0 {
                    kept.push(s);
                } else if i % 3 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            kept
        }));
    }
    let mut kept = Vec::new();
    for w in workers {
        kept.extend(w.await.unwrap());
    }
    // Let teardowns of abandoned watches finish, then publish: every kept subscription must see it.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for n in names {
        source.send(&sel(n), present(n, 42));
    }
    for sub in &mut kept {
        tokio::time::timeout(Duration::from_secs(5), async {
            while rv_of(&sub.current()).as_deref() != Some("42") {
                assert!(sub.changed().await);
            }
        })
        .await
        .expect("every kept subscription is on a live watch");
    }
    assert_eq!(registry.len(), names.len());
    assert_eq!(source.live(), names.len(), "exactly one watch per resource");
    drop(kept);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!((registry.len(), source.live(), registry.tasks()), (0, 0, 0));
}

fn member(uid: &str, rv: u64) -> Object {
    Object {
        json: Bytes::from(format!(r#"{{"rv":{rv}}}"#)),
        uid: uid.to_string(),
        resource_version: rv.to_string(),
    }
}

/// Two sets that select the same object at the same resourceVersion (`!x1` and `!x2` over one
/// namespace) hold one state of it, not a copy each; a newer version in one is its own.
#[test]
fn sets_holding_one_object_at_one_version_share_its_state() {
    use crate::selector::Set;
    use crate::source::SetEvent;
    let pool = pool::Pool::<Update>::default();
    let (a, _a) = watch::channel(Members::default());
    let (b, _b) = watch::channel(Members::default());
    let listed = || {
        SetEvent::Listed(vec![
            ("f".to_string(), member("u1", 3)),
            ("g".to_string(), member("u2", 4)),
        ])
    };
    assert!(Set::apply(&a, listed(), &|_| {}, &pool));
    assert!(Set::apply(&b, listed(), &|_| {}, &pool));
    let shared = |key: &str| Arc::ptr_eq(&a.borrow().objects[key], &b.borrow().objects[key]);
    assert!(shared("f") && shared("g"));
    assert!(Set::apply(
        &a,
        SetEvent::Applied("f".into(), member("u1", 5)),
        &|_| {},
        &pool
    ));
    assert!(!shared("f"), "b still holds version 3");
    assert!(Set::apply(
        &b,
        SetEvent::Applied("f".into(), member("u1", 5)),
        &|_| {},
        &pool
    ));
    assert!(shared("f"), "both at version 5 share it again");
}

#[test]
fn the_stable_hash_is_fnv_1a_64() {
    let hex = |parts: &[&[u8]]| {
        let mut hash = super::StableHash::default();
        for part in parts {
            hash.write(part);
        }
        hash.hex()
    };
    // The published FNV-1a 64 test vectors: the same in every build, on every replica.
    assert_eq!(hex(&[]), "cbf29ce484222325");
    assert_eq!(hex(&[b"a"]), "af63dc4c8601ec8c");
    assert_eq!(hex(&[b"foo", b"bar"]), "85944171f73967e8");
}
