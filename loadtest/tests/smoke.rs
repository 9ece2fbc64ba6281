//! A tiny configuration of every scenario (a few seconds), so the harness cannot rot: it runs,
//! measures both servers, loses nothing, and writes its three reports.

use std::path::PathBuf;
use std::process::Command;

use control_plane::Leash;
use serde_json::Value;

/// The broker binary cargo built for this workspace (next to this test's directory).
fn broker_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>");
    let bin = dir.join("crd-broker");
    assert!(
        bin.exists(),
        "{} is missing: build the workspace (scripts/test does, or `cargo build -p crd-broker`)",
        bin.display()
    );
    bin
}

/// Runs the harness with `args`, the release broker and `--out out`.
fn harness(args: &[&str], out: &std::path::Path) -> std::process::ExitStatus {
    Command::new(env!("CARGO_BIN_EXE_crd-broker-loadtest"))
        .args(args)
        .arg("--broker-bin")
        .arg(broker_bin())
        .arg("--out")
        .arg(out)
        .env("RUST_BACKTRACE", "0")
        .leashed()
        .status()
        .expect("the harness runs")
}

#[test]
fn the_smoke_configuration_runs_every_scenario_and_loses_nothing() {
    let out =
        std::env::temp_dir().join(format!("crd-broker-loadtest-smoke-{}", std::process::id()));
    let status = harness(&["--smoke"], &out);
    assert!(status.success());
    let results: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    for scenario in ["fanout", "hot"] {
        for target in ["broker", "bare"] {
            let run = &results[scenario][target];
            assert_eq!(run["lost"], 0, "{scenario} {target}: {run}");
            assert_eq!(run["errors"], 0, "{scenario} {target}: {run}");
            assert!(
                run["deliveries"]["count"].as_u64().unwrap() > 0,
                "{scenario} {target}: {run}"
            );
            assert!(run["rss_loaded_bytes"].as_u64().unwrap() > 0);
            assert_eq!(
                run["first_warm_alone"]["count"], 200,
                "{scenario} {target}: every lone subscription got its first message"
            );
        }
        let internal = results[scenario]["broker"]["internal_fanout_mean_ms"]
            .as_f64()
            .unwrap();
        assert!(
            internal > 0.0,
            "{scenario}: the broker's own fan-out time, from its metrics"
        );
        let crs = results[scenario]["crs"].as_u64().unwrap();
        assert_eq!(
            results[scenario]["broker"]["open_watches"], crs,
            "one watch per CR"
        );
    }
    let storm = &results["storm"];
    assert_eq!(storm["lists_per_cr"], serde_json::json!([1, 1]), "{storm}");
    assert_eq!(
        storm["watches_per_cr"],
        serde_json::json!([1, 1]),
        "{storm}"
    );
    assert_eq!(results["churn"]["lost"], 0);
    assert_eq!(results["churn"]["open_watches_after"], 0);
    assert!(
        results["idle"]["broker"]["bytes_per_sidecar"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert_eq!(results["idle"]["broker"]["hold_seconds"], 1.0);
    assert_eq!(results["settings"]["idle_hold"], "1s");
    let identity = &results["identity"];
    for broker in ["none", "peer_pod"] {
        assert_eq!(identity[broker]["lost"], 0, "identity {broker}: {identity}");
        assert_eq!(
            identity[broker]["errors"], 0,
            "identity {broker}: {identity}"
        );
        assert_eq!(identity[broker]["first_new_connection"]["count"], 200);
    }
    assert!(identity["pod_lookups"].as_u64().unwrap() >= 1, "{identity}");
    let stalled = &results["stalled"];
    assert_eq!(stalled["readers"], 10, "{stalled}");
    assert_eq!(
        stalled["reader_got_the_last"], true,
        "readers that never read delay nobody: {stalled}"
    );
    let failover = &results["failover"];
    assert_eq!(failover["lost"], 0, "{failover}");
    assert!(failover["moved"].as_u64().unwrap() > 0, "{failover}");
    assert_eq!(
        (&failover["moved_lists"], &failover["moved_watches"]),
        (&serde_json::json!(0), &serde_json::json!(0)),
        "the survivors already watched every CR: {failover}"
    );
    for verb in ["storm_lists_per_cr", "storm_watches_per_cr"] {
        assert_eq!(failover[verb], serde_json::json!([1, 1]), "{failover}");
    }
    assert_eq!(failover["moved_current"], 0, "{failover}");
    // Resuming, each moved subscriber whose CR did not change is told so (all of them when
    // nothing is written meanwhile), for a fraction of the bytes; afresh, each is sent its state
    // whole.
    for key in ["failover_resume", "failover_resume_quiet"] {
        let resumed = &results[key];
        assert_eq!(resumed["lost"], 0, "{resumed}");
        assert_eq!(
            resumed["moved_current"], resumed["moved_unchanged"],
            "{resumed}"
        );
    }
    let quiet = &results["failover_resume_quiet"];
    assert_eq!(quiet["moved_unchanged"], quiet["moved"], "{quiet}");
    let share = |f: &serde_json::Value| {
        f["unchanged_bytes"].as_f64().unwrap() / f["unchanged_full_bytes"].as_f64().unwrap()
    };
    assert!(share(quiet) < 0.2, "{quiet}");
    if failover["moved_unchanged"].as_u64().unwrap() > 0 {
        assert_eq!(share(failover), 1.0, "{failover}");
    }
    // flagd sync streams cannot resume: each moved subscriber is sent its configuration whole.
    // Paced, the survivors refuse some of them, each told when to come back, and lose none.
    for key in ["failover_flagd", "failover_flagd_paced"] {
        let flagd = &results[key];
        assert_eq!(flagd["lost"], 0, "{flagd}");
        assert!(flagd["moved"].as_u64().unwrap() > 0, "{flagd}");
        assert!(
            flagd["survivors_usual_deliveries"].as_u64().unwrap() > 0,
            "{flagd}"
        );
        if flagd["moved_unchanged"].as_u64().unwrap() > 0 {
            assert_eq!(share(flagd), 1.0, "{flagd}");
        }
    }
    assert_eq!(results["failover_flagd"]["refused"], 0);
    let paced = &results["failover_flagd_paced"];
    assert!(paced["refused"].as_u64().unwrap() > 0, "{paced}");
    let rows = results["connections"]["rows"].as_array().unwrap();
    let of = |crs: u64, mode: &str| {
        rows.iter()
            .find(|r| r["crs"] == crs && r["api_http2"] == mode)
            .unwrap_or_else(|| panic!("a row for {crs} {mode}: {rows:?}"))
    };
    for row in rows {
        assert_eq!(row["watches"], row["crs"], "{row}");
    }
    let (h1, h2) = (
        &of(150, "off")["connections"],
        &of(150, "auto")["connections"],
    );
    assert!(
        h1.as_u64().unwrap() >= 150,
        "HTTP/1.1: a connection per watch: {h1}"
    );
    assert!(
        (2..=3).contains(&h2.as_u64().unwrap()),
        "HTTP/2: 150 watches on two connections of 100 streams: {h2}"
    );
    let granularity = results["granularity"]["rows"].as_array().unwrap();
    let watches = |names: u64, how: &str| {
        granularity
            .iter()
            .find(|r| r["names"] == names && r["granularity"] == how)
            .map(|r| r["watches"].as_u64().unwrap())
    };
    assert_eq!(watches(20, "per-object"), Some(20), "{granularity:?}");
    assert_eq!(
        watches(20, "adaptive"),
        Some(1),
        "a whole namespace watched: one watch"
    );
    assert_eq!(
        watches(4, "adaptive"),
        Some(4),
        "4 of 20 watched: a watch per name, not every object's events"
    );
    let cold = &results["coldstart"];
    for ratio in ["ratio_alone", "ratio_at_once"] {
        assert!(cold[ratio].as_f64().is_some_and(|r| r > 0.0), "{cold}");
    }
    assert_eq!(cold["broker_at_once"]["count"], 100, "{cold}");
    let cost = &identity["cost"];
    assert_eq!(cost["errors"], 0, "{cost}");
    for phase in ["by_pod", "interleaved"] {
        assert_eq!(
            cost[phase]["pod_lookups"], cost["pod_ips"],
            "one lookup per pod: {cost}"
        );
    }
    for ratio in [
        "fanout_p50",
        "hot_fanout_p50",
        "warm_first_message_vs_unary",
        "idle_memory",
        "identity_fanout_p50",
        "identity_new_connection_first_message",
    ] {
        assert!(
            results["ratios"][ratio].as_f64().is_some_and(|r| r > 0.0),
            "{ratio}: {}",
            results["ratios"]
        );
    }
    let attacks = &results["attacks"];
    for cycle in attacks["set_cycles"].as_array().unwrap() {
        assert_eq!(
            cycle["admitted"], 16,
            "a caller's budget of sets (--max-sets-per-caller 16): {cycle}"
        );
        assert_eq!(cycle["api_watches_after"], 16, "{cycle}");
        assert_eq!(cycle["other_caller_served"], true, "{cycle}");
    }
    let overlapping = &attacks["overlapping_sets"];
    assert_eq!(overlapping["admitted"], 16, "{overlapping}");
    assert_eq!(overlapping["other_caller_served"], true, "{overlapping}");
    let xds = &attacks["xds_fanout"];
    assert_eq!(xds["missed"], 0, "every stream had the change: {xds}");
    let proxied = &attacks["proxy_token_flood"];
    let allowed = 100.0 + 10.0 * proxied["seconds"].as_f64().unwrap() + 1.0;
    assert!(
        proxied["token_reviews"].as_f64().unwrap() <= allowed,
        "one bucket for every connection at the proxy's address: {proxied}"
    );
    assert_eq!(proxied["cold_failures"], 0, "{proxied}");
    let rbac = &attacks["rbac_revoked"];
    assert_eq!(rbac["new_subscriber"], "PermissionDenied", "{rbac}");
    assert!(rbac["recovery_seconds"].as_f64().unwrap() < 60.0, "{rbac}");
    let flood = &attacks["token_flood"];
    let allowed = 100.0 + 10.0 * flood["flood_seconds"].as_f64().unwrap() + 1.0;
    assert!(
        (flood["token_reviews"].as_f64().unwrap()) <= allowed,
        "new tokens reviewed within the source's rate: {flood}"
    );
    assert_eq!(flood["valid_reviews_after"], 0, "{flood}");
    assert_eq!(
        attacks["stalled_set"]["watches_after"], 0,
        "the set's watch lingered out: {attacks}"
    );
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(summary.contains("(c) reconnect storm"));
    assert!(summary.contains("### Attacks"));
    assert!(summary.contains("The cost of identity"));
    let png = std::fs::read(out.join("latency.png")).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "a real plot"
    );
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn a_short_seeded_soak_meets_every_kind_of_fault_and_loses_nothing() {
    let out = std::env::temp_dir().join(format!("crd-broker-soak-smoke-{}", std::process::id()));
    let status = harness(&["soak", "--smoke", "--seed", "11"], &out);
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("soak.json")).unwrap()).unwrap();
    assert!(status.success(), "{report:#}");
    assert_eq!(report["seed"], 11);
    assert_eq!(report["lost"], 0, "{report:#}");
    assert_eq!(report["watches_not_one"], 0, "{report:#}");
    assert_eq!(report["watches_after_leaving"], 0, "{report:#}");
    assert!(report["final_converge_ms"].as_f64().unwrap() < 5_000.0);
    let kinds = report["by_fault"].as_object().unwrap();
    assert_eq!(kinds.len(), 13, "every kind of fault: {kinds:?}");
    for (kind, r) in kinds {
        assert_eq!(r["count"], 2, "{kind}: {r}");
        assert_eq!(r["slow"], 0, "{kind}: {r}");
    }
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn the_apiserver_cost_smoke_measures_every_mode_on_a_real_api_server() {
    let out = std::env::temp_dir().join(format!("crd-broker-cost-smoke-{}", std::process::id()));
    let status = harness(&["--scenario", "apiserver-cost", "--smoke"], &out);
    assert!(status.success());
    let results: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let rows = results["apiserver_cost"]["rows"].as_array().unwrap();
    let row = |mode: &str| {
        rows.iter()
            .find(|r| r["mode"] == mode)
            .unwrap_or_else(|| panic!("a {mode} row: {rows:?}"))
    };
    for r in rows {
        assert_eq!(r["lost"], 0, "{r}");
        assert_eq!(r["errors"], 0, "{r}");
        assert!(r["writes"].as_u64().unwrap() >= 10, "{r}");
        assert!(r["write_to_all"]["count"].as_u64().unwrap() > 0, "{r}");
        assert!(r["rss_idle_bytes"].as_u64().unwrap() > 0, "{r}");
        assert!(r["cpu_writes_cores"].as_f64().unwrap() > 0.0, "{r}");
        assert!(
            r["seats_per_write"].as_f64().unwrap() >= 1.0,
            "the server's own seat estimate for the writer's flow schema: {r}"
        );
    }
    // The smoke run: 30 sidecars on 5 CRs. The API server counts one watch per sidecar when
    // each watches its own CR, one per CR and replica through brokers.
    let (direct, broker, replicas) = (row("direct"), row("broker"), row("replicas"));
    assert_eq!(direct["watches"], 30.0, "{direct}");
    assert_eq!(broker["watches"], 5.0, "{broker}");
    assert_eq!(replicas["watches"], 15.0, "{replicas}");
    assert!(direct["connections"].as_u64().unwrap() >= 30, "{direct}");
    assert!(broker["connections"].as_u64().unwrap() < 30, "{broker}");
    // A write to one CR reaches its 6 direct watchers, its one broker watch.
    assert_eq!(direct["watchers_per_write"], 6.0, "{direct}");
    assert_eq!(broker["watchers_per_write"], 1.0, "{broker}");
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(summary.contains("What the broker saves the API server"));
    assert!(
        summary.contains("| direct ÷ broker | 30 | 6× |"),
        "{summary}"
    );
    let png = std::fs::read(out.join("apiserver-cost.png")).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "a real plot"
    );
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn the_peers_smoke_runs_flagd_proxy_flagd_and_the_broker_side_by_side_on_a_real_api_server() {
    let out = std::env::temp_dir().join(format!("crd-broker-peers-smoke-{}", std::process::id()));
    let status = harness(&["--scenario", "peers", "--smoke"], &out);
    assert!(status.success());
    let results: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let rows = results["peers"]["rows"].as_array().unwrap();
    let row = |server: &str| {
        rows.iter()
            .find(|r| r["server"] == server)
            .unwrap_or_else(|| panic!("a {server} row: {rows:?}"))
    };
    // The smoke run: 200 streams on 10 CRs, through each server in turn.
    let servers: Vec<&str> = rows.iter().map(|r| r["server"].as_str().unwrap()).collect();
    assert_eq!(servers, ["flagd-proxy", "flagd", "crd-broker"]);
    for r in rows {
        assert_eq!(r["streams"], 200, "{r}");
        assert_eq!(r["lost"], 0, "{r}");
        assert_eq!(r["errors"], 0, "{r}");
        assert_eq!(r["churn_errors"], 0, "{r}");
        assert_eq!(r["churn_lost"], 0, "{r}");
        assert!(r["churn_streams"].as_u64().unwrap() >= 20, "{r}");
        assert!(r["write_to_all"]["count"].as_u64().unwrap() >= 30, "{r}");
        assert_eq!(r["api_watches"], 10.0, "one watch per CR: {r}");
        assert!(r["rss_idle_bytes"].as_u64().unwrap() > 0, "{r}");
        assert!(r["recreated_seconds"].as_f64().is_some(), "{r}");
    }
    // The broker sends a deleted CR's streams a configuration without its flags; flagd-proxy
    // and flagd keep serving the flags they had.
    assert!(row("crd-broker")["deleted_seconds"].as_f64().is_some());
    assert!(row("flagd-proxy")["deleted_seconds"].is_null());
    assert!(row("flagd")["deleted_seconds"].is_null());
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(
        summary.contains("| crd-broker ÷ flagd-proxy (same run"),
        "{summary}"
    );
    assert!(
        summary.contains("| crd-broker ÷ flagd (same run"),
        "{summary}"
    );
    assert_eq!(summary.matches("| 200 streams |").count(), 2, "{summary}");
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn the_resolvers_smoke_counts_a_watch_per_kuberesolver_client_and_one_through_xds() {
    let out =
        std::env::temp_dir().join(format!("crd-broker-resolvers-smoke-{}", std::process::id()));
    let status = harness(&["--scenario", "resolvers", "--smoke"], &out);
    assert!(status.success());
    let results: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let rows = results["resolvers"]["rows"].as_array().unwrap();
    let row = |mode: &str| {
        rows.iter()
            .find(|r| r["mode"] == mode)
            .unwrap_or_else(|| panic!("a {mode} row: {rows:?}"))
    };
    // The smoke run: 50 clients each way; every one learns the fourth replica.
    for r in rows {
        assert_eq!(r["clients"], 50, "{r}");
        assert_eq!(r["lost"], 0, "{r}");
        assert!(r["change_seconds"].as_f64().is_some(), "{r}");
    }
    assert_eq!(row("kuberesolver")["watches"], 50.0, "a watch per client");
    assert_eq!(row("xds")["watches"], 1.0, "one watch for them all");
    // Then the real grpc-go client over dns:/// and xds:///: through xDS a fourth replica takes
    // new streams within the window.
    let follow = results["resolvers"]["follow"].as_array().unwrap();
    assert_eq!(follow.len(), 2, "{follow:?}");
    let xds = follow.iter().find(|f| f["resolver"] == "xds").unwrap();
    assert!(xds["joined_seconds"].as_f64().is_some(), "{xds}");
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(summary.contains("| 50 clients | 50× |"), "{summary}");
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn a_short_seeded_soak_on_a_real_control_plane_meets_every_real_fault_and_loses_nothing() {
    let out = std::env::temp_dir().join(format!("crd-broker-soak-real-{}", std::process::id()));
    let status = harness(&["soak", "--real", "--smoke", "--seed", "23"], &out);
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("soak.json")).unwrap()).unwrap();
    assert!(status.success(), "{report:#}");
    assert_eq!(report["api_server"], "real");
    assert_eq!(report["lost"], 0, "{report:#}");
    assert_eq!(report["watches_not_one"], 0, "{report:#}");
    assert_eq!(report["watches_after_leaving"], 0, "{report:#}");
    let kinds = report["by_fault"].as_object().unwrap();
    let expected = [
        "api_server_killed",
        "api_server_stopped",
        "etcd_killed",
        "compaction",
        "rejected",
        "rbac_revoked",
        "crd_recreated",
    ];
    assert_eq!(kinds.len(), expected.len(), "every real fault: {kinds:?}");
    for kind in expected {
        let r = &kinds[kind];
        assert_eq!(r["count"], 1, "{kind}: {r}");
        assert_eq!(r["slow"], 0, "{kind}: {r}");
    }
    let summary = std::fs::read_to_string(out.join("soak.md")).unwrap();
    assert!(summary.contains("Fault soak on a real kube-apiserver and etcd (seed 23)"));
    std::fs::remove_dir_all(&out).ok();
}
