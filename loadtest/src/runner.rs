//! Runs every scenario asked for, then writes the reports.

use anyhow::Context;

use crate::scenarios::{
    apiserver_cost, attacks, churn, coldstart, connections, failover, fanout, granularity,
    identity, idle, incremental, peers, resolvers, stalled, storm,
};
use crate::{Run, report, stats};

/// Every scenario asked for, then the reports.
pub async fn run_all(run: Run) -> anyhow::Result<()> {
    let fds = stats::raise_fd_limit();
    crate::target::broker_bin(run.broker_bin.clone())?;
    let mut sockets = match run.wants("idle") || run.wants("identity") {
        true => run.sidecars.max(run.connections),
        false => run.connections,
    } as u64;
    if run.wants("apiserver-cost") {
        let most = run.cost_sidecars.iter().copied().max().unwrap_or(0) as u64;
        sockets = sockets.max(most);
    }
    if run.wants("resolvers") {
        // Every client on a connection of its own.
        let most = run.resolvers_clients.iter().copied().max().unwrap_or(0) as u64;
        sockets = sockets.max(most);
    }
    if run.wants("peers") {
        // Every stream on a connection of its own, and the churn's on top.
        let most = run.peers_streams.iter().copied().max().unwrap_or(0) as u64;
        sockets = sockets.max(most + most / 10);
    }
    // Every connection is an open file here and in the server; the broker's watches (one per
    // CR) and the rest need some more.
    let needed = sockets + run.crs as u64 + 100;
    anyhow::ensure!(
        needed <= fds,
        "{sockets} connections need about {} open files in this process and in the server, but \
         the open-file limit is {fds} and cannot be raised further (it is the hard limit: raise \
         it as root with CAP_SYS_RESOURCE, e.g. `ulimit -Hn 1048576`)",
        needed
    );
    let mut results = report::Results::new(&run, fds);
    if run.wants("fanout") {
        results.fanout = Some(
            fanout::fanout(&run, run.crs, true)
                .await
                .context("the fan-out scenario")?,
        );
    }
    if run.wants("hot") {
        results.hot = Some(
            fanout::fanout(&run, 1, false)
                .await
                .context("the hot-CR scenario")?,
        );
    }
    if run.wants("storm") {
        results.storm = Some(storm::storm(&run).await.context("the storm scenario")?);
    }
    if run.wants("churn") {
        results.churn = Some(churn::churn(&run).await.context("the churn scenario")?);
    }
    if run.wants("idle") {
        results.idle = Some(idle::idle(&run).await.context("the idle scenario")?);
    }
    if run.wants("identity") {
        results.identity = Some(
            identity::identity(&run)
                .await
                .context("the identity scenario")?,
        );
    }
    if run.wants("failover") {
        // Native subscribers afresh and resuming while the CRs are written, and resuming while
        // nothing changes; flagd subscribers (which cannot resume), with the replicas pacing
        // new streams and without.
        let way = |resume, quiet, flagd, pace| failover::Way {
            resume,
            quiet,
            flagd,
            pace,
        };
        let pace = run.failover_pace;
        let ways = [
            (way(false, false, false, 0.0), &mut results.failover),
            (way(true, false, false, 0.0), &mut results.failover_resume),
            (
                way(true, true, false, 0.0),
                &mut results.failover_resume_quiet,
            ),
            (way(false, false, true, 0.0), &mut results.failover_flagd),
            (
                way(false, false, true, pace),
                &mut results.failover_flagd_paced,
            ),
        ];
        for (way, row) in ways {
            let measured = failover::failover(&run, way)
                .await
                .with_context(|| format!("the failover scenario ({way:?})"))?;
            *row = Some(measured);
        }
    }
    if run.wants("coldstart") {
        results.coldstart = Some(
            coldstart::coldstart(&run)
                .await
                .context("the cold-start scenario")?,
        );
    }
    if run.wants("granularity") {
        results.granularity = Some(
            granularity::granularity(&run)
                .await
                .context("the granularity scenario")?,
        );
    }
    if run.wants("incremental") {
        results.incremental = Some(
            incremental::incremental(&run)
                .await
                .context("the incremental-updates scenario")?,
        );
    }
    if run.wants("connections") {
        results.connections = Some(
            connections::connections(&run)
                .await
                .context("the API-connections scenario")?,
        );
    }
    if run.wants("stalled") {
        results.stalled = Some(
            stalled::stalled(&run)
                .await
                .context("the stalled-readers scenario")?,
        );
    }
    if run.wants("attacks") {
        results.attacks = Some(
            attacks::attacks(&run)
                .await
                .context("the attacks scenario")?,
        );
    }
    if run.wants("apiserver-cost") {
        results.apiserver_cost = Some(
            apiserver_cost::apiserver_cost(&run)
                .await
                .context("the apiserver-cost scenario")?,
        );
    }
    if run.wants("peers") {
        results.peers = Some(peers::peers(&run).await.context("the peers scenario")?);
    }
    if run.wants("resolvers") {
        results.resolvers = Some(
            resolvers::resolvers(&run)
                .await
                .context("the resolvers scenario")?,
        );
    }
    results.compute_ratios();
    let summary = report::write(&run.out, &results)?;
    println!("{summary}");
    Ok(())
}
