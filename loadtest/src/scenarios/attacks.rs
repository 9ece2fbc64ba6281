//! The attacks a review found (issue "Close what a review found"), each against a broker with its
//! defaults but for the settings named: what one caller can make the broker and the API server
//! hold. Only settings every build knows are passed as flags, and newer ones as environment
//! variables an older build ignores, so that the same command measures a build before a fix and
//! after it (`--broker-bin`).

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use crd_broker::pb;
use crd_broker::pb::broker_client::BrokerClient;
use fake_apiserver::{FakeApiServer, TokenUser};
use futures::StreamExt;
use serde::Serialize;
use serde_json::json;
use tonic::transport::Channel;

use crate::Run;
use crate::clients;
use crate::fixtures::{self, name};
use crate::stats::{Histogram, Summary};
use crate::target::{Log, Target};

/// Every attack's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Attacks {
    /// One caller cycling distinct set selectors under `--max-watches 50`.
    pub set_cycles: Vec<Cycle>,
    /// One caller cycling one name in each of many namespaces, with the default limits.
    pub namespace_cycles: Vec<Cycle>,
    /// Random bearer tokens from one address under `--identity token`.
    pub token_flood: TokenFlood,
    /// Subscribers of a large set that never read.
    pub stalled_set: StalledSet,
    /// Made-up names in one namespace, subscribed and left, round after round.
    pub cycled_names: CycledNames,
}

/// One caller opening streams one after another on one connection, each read to its first
/// message and dropped.
#[derive(Debug, Clone, Serialize)]
pub struct Cycle {
    /// The caller's address.
    pub from: String,
    /// Streams it asked for.
    pub attempted: usize,
    /// Streams the broker admitted.
    pub admitted: usize,
    /// API watches open on the API server once it is done (the broker's linger holds them).
    pub api_watches_after: usize,
    /// Watches the broker lists in `/debug/watches` then.
    pub broker_watches_after: usize,
    /// Whether another caller (127.0.0.9) then got a FeatureFlag that exists.
    pub other_caller_served: bool,
}

/// Random bearer tokens from one address.
#[derive(Debug, Clone, Serialize)]
pub struct TokenFlood {
    /// Tokens sent.
    pub tokens: usize,
    /// TokenReviews the API server saw during the flood.
    pub token_reviews: usize,
    /// How long the flood took.
    pub flood_seconds: f64,
    /// Broker memory before and after.
    pub rss_before_bytes: u64,
    /// After.
    pub rss_after_bytes: u64,
    /// A valid caller's first-message latency before the flood.
    pub valid_before: Summary,
    /// The same caller's, during the flood.
    pub valid_during: Summary,
    /// The valid caller's subscribes that failed during the flood.
    pub valid_failures: u64,
    /// TokenReviews the valid caller's next subscribe cost after the flood (0: its token was
    /// still cached).
    pub valid_reviews_after: usize,
}

/// Subscribers of a large set that never read.
#[derive(Debug, Clone, Serialize)]
pub struct StalledSet {
    /// The set's members.
    pub members: usize,
    /// Each member's size.
    pub member_bytes: usize,
    /// Its subscribers.
    pub subscribers: usize,
    /// Broker memory before they came.
    pub rss_before_bytes: u64,
    /// While they stall.
    pub rss_stalled_bytes: u64,
    /// After they left and the set's watch lingered out.
    pub rss_after_bytes: u64,
    /// While as many stall again, and after they leave, round after round: what the first
    /// round left is reused, not added to.
    pub rss_later_rounds_bytes: Vec<(u64, u64)>,
    /// Watches the broker lists once they left (the set's lingered out).
    pub watches_after: usize,
}

/// Made-up names cycled.
#[derive(Debug, Clone, Serialize)]
pub struct CycledNames {
    /// Names per round (new ones each round).
    pub names: usize,
    /// Broker memory after the first rounds, which are not counted: the allocator's arenas
    /// grow to their working size over them (24 rounds measured here stayed flat after three).
    pub rss_after_warmup_bytes: u64,
    /// Broker memory after each round, once its watches lingered out.
    pub rss_after_round_bytes: Vec<u64>,
    /// (last − first) ÷ first, in percent.
    pub growth_percent: f64,
    /// (highest − lowest) ÷ lowest, in percent.
    pub spread_percent: f64,
    /// The least-squares trend over the rounds (slope × (rounds − 1)) ÷ the mean, in percent:
    /// growth, with the allocator's round-to-round noise averaged out.
    pub trend_percent: f64,
}

/// How big each attack is.
struct Sizes {
    sets: usize,
    namespaces: usize,
    tokens: usize,
    set_members: usize,
    member_bytes: usize,
    stalled: usize,
    names: usize,
    rounds: usize,
}

impl Sizes {
    fn of(run: &Run) -> Sizes {
        if run.smoke {
            Sizes {
                sets: 20,
                namespaces: 40,
                tokens: 200,
                set_members: 10,
                member_bytes: 10_000,
                stalled: 5,
                names: 200,
                rounds: 2,
            }
        } else {
            Sizes {
                sets: 500,
                namespaces: 2_000,
                tokens: 5_000,
                set_members: 200,
                member_bytes: 50_000,
                stalled: 200,
                names: 5_000,
                rounds: 8,
            }
        }
    }
}

const ATTACKER_ADDRESSES: [Ipv4Addr; 2] =
    [Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::new(127, 0, 0, 2)];
const OTHER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 9);
const AUDIENCE: &str = "crd-broker";

/// Every attack, one after another, each on a fresh fake API server and broker.
pub async fn attacks(run: &Run) -> anyhow::Result<Attacks> {
    let sizes = Sizes::of(run);
    let mut set_cycles = Vec::new();
    let mut namespace_cycles = Vec::new();
    for from in ATTACKER_ADDRESSES {
        set_cycles.push(set_cycle(run, from, sizes.sets).await?);
        namespace_cycles.push(namespace_cycle(run, from, sizes.namespaces).await?);
    }
    Ok(Attacks {
        set_cycles,
        namespace_cycles,
        token_flood: token_flood(run, sizes.tokens).await?,
        stalled_set: stalled_set(run, &sizes).await?,
        cycled_names: cycled_names(run, sizes.names, sizes.rounds).await?,
    })
}

/// The broker `run` names on a fake holding FeatureFlags `name(0)` .. `name(crs - 1)`.
async fn broker(
    run: &Run,
    crs: usize,
    args: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<(FakeApiServer, fixtures::tempfile_like::Dir, Target)> {
    let (fake, dir) = fixtures::fake(crs, run.payload_bytes).await?;
    let bin = crate::target::broker_bin(run.broker_bin.clone())?;
    let kubeconfig = dir.path().join("kubeconfig");
    let target = Target::launch(&bin, &kubeconfig, args, env, Log::Null).await?;
    wait_ready(&target).await?;
    Ok((fake, dir, target))
}

async fn wait_ready(target: &Target) -> anyhow::Result<()> {
    let admin = target.admin.expect("a broker has an admin port");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok((200, _)) = fixtures::get(admin, "/readyz").await {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the broker did not become ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn resource(namespace: &str, name: &str) -> pb::ResourceRef {
    pb::ResourceRef {
        group: "core.openfeature.dev".into(),
        version: "v1beta1".into(),
        resource: "featureflags".into(),
        namespace: namespace.into(),
        name: name.into(),
        ..Default::default()
    }
}

fn set_request(labels: &str) -> pb::SubscribeRequest {
    pb::SubscribeRequest {
        resources: vec![pb::ResourceRef {
            label_selector: labels.into(),
            ..resource("default", "")
        }],
    }
}

fn one(namespace: &str, name: &str) -> pb::SubscribeRequest {
    pb::SubscribeRequest {
        resources: vec![resource(namespace, name)],
    }
}

/// Subscribes with `request` and waits for the first message: whether both came.
async fn first_message(client: &mut BrokerClient<Channel>, request: pb::SubscribeRequest) -> bool {
    let subscribe = async {
        match client.subscribe(request).await {
            Ok(response) => matches!(response.into_inner().message().await, Ok(Some(_))),
            Err(_) => false,
        }
    };
    tokio::time::timeout(Duration::from_secs(5), subscribe)
        .await
        .unwrap_or(false)
}

/// One caller at `from` sends `requests` one after another on one connection; then another
/// caller asks for a FeatureFlag that exists.
async fn cycle(
    target: &Target,
    fake: &FakeApiServer,
    from: Ipv4Addr,
    requests: impl Iterator<Item = pb::SubscribeRequest>,
) -> anyhow::Result<Cycle> {
    let mut client = BrokerClient::new(clients::connection_from(target.grpc, from).await?);
    let (mut attempted, mut admitted) = (0, 0);
    for request in requests {
        attempted += 1;
        if first_message(&mut client, request).await {
            admitted += 1;
        }
    }
    let mut other = BrokerClient::new(clients::connection_from(target.grpc, OTHER).await?);
    let other_caller_served = first_message(&mut other, one("default", &name(0))).await;
    let admin = target.admin.expect("an admin port");
    let (_, body) = fixtures::get(admin, "/debug/watches").await?;
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    Ok(Cycle {
        from: from.to_string(),
        attempted,
        admitted,
        // The other caller's watch is not the attacker's.
        api_watches_after: fake
            .open_watches()
            .saturating_sub(usize::from(other_caller_served)),
        broker_watches_after: listed["watches"].as_array().map_or(0, |w| {
            w.len().saturating_sub(usize::from(other_caller_served))
        }),
        other_caller_served,
    })
}

/// Distinct set selectors, each subscribed and left, under `--max-watches 50`.
async fn set_cycle(run: &Run, from: Ipv4Addr, sets: usize) -> anyhow::Result<Cycle> {
    let (fake, _dir, target) = broker(run, 1, &["--max-watches", "50"], &[]).await?;
    let requests = (0..sets).map(|i| set_request(&format!("app=attack-{i}")));
    let result = cycle(&target, &fake, from, requests).await;
    target.stop().await;
    result
}

/// One made-up name in each of `namespaces` namespaces, each subscribed and left.
async fn namespace_cycle(run: &Run, from: Ipv4Addr, namespaces: usize) -> anyhow::Result<Cycle> {
    let (fake, _dir, target) = broker(run, 1, &[], &[]).await?;
    let requests = (0..namespaces).map(|i| one(&format!("attack-{i}"), "x"));
    let result = cycle(&target, &fake, from, requests).await;
    target.stop().await;
    result
}

fn token_reviews(fake: &FakeApiServer) -> usize {
    fake.requests()
        .iter()
        .filter(|r| r.path.ends_with("/tokenreviews"))
        .count()
}

/// `tokens` random bearer tokens from 127.0.0.2, 64 at a time, while a caller with a valid
/// token at 127.0.0.3 subscribes every 100 ms.
async fn token_flood(run: &Run, tokens: usize) -> anyhow::Result<TokenFlood> {
    let (fake, _dir, target) = broker(
        run,
        1,
        &["--identity", "token", "--token-audience", AUDIENCE],
        &[],
    )
    .await?;
    let valid = "valid-token-of-the-sidecar".to_string();
    fake.register_token(TokenUser {
        token: valid.clone(),
        username: "system:serviceaccount:default:sidecar".into(),
        uid: "uid-sidecar".into(),
        groups: vec!["system:serviceaccounts".into()],
        audiences: vec![AUDIENCE.into()],
        ..Default::default()
    });
    let channel = clients::connection_from(target.grpc, Ipv4Addr::new(127, 0, 0, 3)).await?;
    let subscribe_valid = |channel: Channel| {
        let valid = valid.clone();
        async move {
            let mut request = tonic::Request::new(one("default", &name(0)));
            let bearer = format!("Bearer {valid}").parse().expect("ASCII");
            request.metadata_mut().insert("authorization", bearer);
            let started = Instant::now();
            let mut client = BrokerClient::new(channel);
            let answer = tokio::time::timeout(Duration::from_secs(5), async {
                let response = client.subscribe(request).await.ok()?;
                response.into_inner().message().await.ok().flatten()
            });
            answer.await.ok().flatten().map(|_| started.elapsed())
        }
    };
    let before = Histogram::default();
    for _ in 0..10 {
        if let Some(t) = subscribe_valid(channel.clone()).await {
            before.record(t);
        }
    }
    let rss_before = target.rss();
    fake.clear_requests();
    let flooding = async {
        let channel = clients::connection_from(target.grpc, Ipv4Addr::new(127, 0, 0, 2)).await?;
        futures::stream::iter(0..tokens)
            .for_each_concurrent(64, |i| {
                let mut client = BrokerClient::new(channel.clone());
                async move {
                    let mut request = tonic::Request::new(one("default", &name(0)));
                    let token = format!("Bearer random-{i}-{}", fastrand::u64(..));
                    request
                        .metadata_mut()
                        .insert("authorization", token.parse().expect("ASCII"));
                    let _ = client.subscribe(request).await;
                }
            })
            .await;
        anyhow::Ok(())
    };
    let during = Histogram::default();
    let mut failures = 0;
    let watching = async {
        loop {
            match subscribe_valid(channel.clone()).await {
                Some(t) => during.record(t),
                None => failures += 1,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let started = Instant::now();
    tokio::select! {
        flooded = flooding => flooded?,
        _ = watching => unreachable!("the valid caller's loop never ends"),
    }
    let flood_seconds = started.elapsed().as_secs_f64();
    let reviews = token_reviews(&fake);
    let rss_after = target.rss();
    fake.clear_requests();
    subscribe_valid(channel.clone()).await;
    let valid_reviews_after = token_reviews(&fake);
    target.stop().await;
    Ok(TokenFlood {
        tokens,
        token_reviews: reviews,
        flood_seconds,
        rss_before_bytes: rss_before,
        rss_after_bytes: rss_after,
        valid_before: before.summary(),
        valid_during: during.summary(),
        valid_failures: failures,
        valid_reviews_after,
    })
}

/// A set of large members, and subscribers of it that never read.
async fn stalled_set(run: &Run, sizes: &Sizes) -> anyhow::Result<StalledSet> {
    let linger = Duration::from_secs(2);
    let (fake, _dir, target) = broker(run, 0, &["--linger", "2s"], &[]).await?;
    for k in 0..sizes.set_members {
        let mut flag = fixtures::flag(&format!("big-{k}"), sizes.member_bytes);
        flag["metadata"]["labels"] = json!({ "app": "big" });
        fake.apply(flag)?;
    }
    let rss_before = target.rss();
    let request = set_request("app=big");
    let addr = target.grpc;
    let mut rss = Vec::new();
    for _ in 0..STALLED_ROUNDS {
        let subscribers: Vec<clients::Sidecar> = futures::stream::iter(0..sizes.stalled)
            .map(|i| {
                let local = Ipv4Addr::new(127, 0, 1, 1 + (i % 200) as u8);
                let request = request.clone();
                async move { clients::open(addr, local, &request, false).await }
            })
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        // The broker sends what each stream's window takes, then holds the rest.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let stalled = target.rss();
        drop(subscribers);
        tokio::time::sleep(linger + Duration::from_secs(3)).await;
        rss.push((stalled, target.rss()));
    }
    let admin = target.admin.expect("an admin port");
    let (_, body) = fixtures::get(admin, "/debug/watches").await?;
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    target.stop().await;
    Ok(StalledSet {
        members: sizes.set_members,
        member_bytes: sizes.member_bytes,
        subscribers: sizes.stalled,
        rss_before_bytes: rss_before,
        rss_stalled_bytes: rss[0].0,
        rss_after_bytes: rss[0].1,
        rss_later_rounds_bytes: rss[1..].to_vec(),
        watches_after: listed["watches"].as_array().map_or(0, Vec::len),
    })
}

/// `names` made-up names in `default`, new ones each round, subscribed 100 to a stream over 50
/// streams at once and left, while 100 other names stay subscribed (so the namespace watch the
/// names share runs on); memory read once their watches lingered out, after [`WARMUP`] rounds
/// that are not counted and then after each of `rounds`.
async fn cycled_names(run: &Run, names: usize, rounds: usize) -> anyhow::Result<CycledNames> {
    let unlimited = [
        "--linger",
        "1s",
        "--max-streams-per-caller",
        "1000000",
        "--new-watch-rate",
        "100000",
        "--new-watch-burst",
        "100000",
    ];
    let env = [("CRD_BROKER_MAX_WATCHES_PER_CALLER", "1000000")];
    let (_fake, _dir, target) = broker(run, 1, &unlimited, &env).await?;
    let channel = clients::connection_from(target.grpc, Ipv4Addr::new(127, 0, 0, 2)).await?;
    let held = pb::SubscribeRequest {
        resources: (0..100)
            .map(|i| resource("default", &format!("held-{i}")))
            .collect(),
    };
    let mut holder = BrokerClient::new(channel.clone())
        .subscribe(held)
        .await?
        .into_inner();
    for _ in 0..100 {
        holder.message().await?;
    }
    let mut rss = Vec::new();
    for round in 0..WARMUP + rounds {
        let batches: Vec<Vec<String>> = (0..names)
            .map(|i| format!("made-up-{round}-{i}"))
            .collect::<Vec<_>>()
            .chunks(100)
            .map(<[String]>::to_vec)
            .collect();
        futures::stream::iter(batches)
            .for_each_concurrent(50, |batch| {
                let mut client = BrokerClient::new(channel.clone());
                async move {
                    let request = pb::SubscribeRequest {
                        resources: batch.iter().map(|n| resource("default", n)).collect(),
                    };
                    let Ok(response) = client.subscribe(request).await else {
                        return;
                    };
                    let mut stream = response.into_inner();
                    for _ in 0..batch.len() {
                        let next = tokio::time::timeout(Duration::from_secs(10), stream.message());
                        if !matches!(next.await, Ok(Ok(Some(_)))) {
                            return;
                        }
                    }
                }
            })
            .await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        rss.push(target.rss());
    }
    drop(holder);
    target.stop().await;
    let warmup = rss.drain(..WARMUP).next_back().unwrap_or(0);
    let percent = |from: u64, to: u64| {
        ((to as f64 - from as f64) / (from as f64).max(1.0) * 1000.0).round() / 10.0
    };
    let (first, last) = (rss[0], *rss.last().unwrap_or(&0));
    let (low, high) = (
        rss.iter().copied().min().unwrap_or(0),
        rss.iter().copied().max().unwrap_or(0),
    );
    Ok(CycledNames {
        names,
        trend_percent: trend(&rss),
        rss_after_warmup_bytes: warmup,
        growth_percent: percent(first, last),
        spread_percent: percent(low, high),
        rss_after_round_bytes: rss,
    })
}

/// Rounds of stalled set subscribers.
const STALLED_ROUNDS: usize = 4;

/// Rounds of made-up names before memory is measured.
const WARMUP: usize = 3;

/// The least-squares slope of `ys` over their index, times (n − 1), ÷ their mean, in percent.
fn trend(ys: &[u64]) -> f64 {
    let n = ys.len() as f64;
    if ys.len() < 2 {
        return 0.0;
    }
    let mean_x = (n - 1.0) / 2.0;
    let mean_y = ys.iter().map(|&y| y as f64).sum::<f64>() / n;
    let (mut num, mut den) = (0.0, 0.0);
    for (x, &y) in ys.iter().enumerate() {
        num += (x as f64 - mean_x) * (y as f64 - mean_y);
        den += (x as f64 - mean_x).powi(2);
    }
    (num / den * (n - 1.0) / mean_y.max(1.0) * 1000.0).round() / 10.0
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_trend_is_the_fitted_growth_over_the_rounds() {
        assert_eq!(super::trend(&[100, 100, 100]), 0.0);
        assert_eq!(super::trend(&[100, 110, 120]), 18.2);
        assert_eq!(super::trend(&[100, 120, 100, 120]), 10.9);
    }
}
