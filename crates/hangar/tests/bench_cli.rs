//! `hangar bench` end to end: the gateway and predictions benchmarks start
//! their own mock engine and gateway and every request is served; the store
//! benchmark builds its own model and daemons; the queue benchmark its own
//! stores. Timings are not asserted
//! (they belong to the benchmark, not to a test).

use std::process::Command;

use serde_json::Value;

fn run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_hangar")).args(args).output().unwrap()
}

/// `hangar bench --help` names what each bench measures — one it lists
/// missing from the summary fails here — and no longer claims they are
/// all about the gateway's overhead.
#[test]
fn bench_help_names_every_bench_it_lists() {
    let o = run(&["bench", "--help"]);
    assert!(o.status.success());
    let help = String::from_utf8(o.stdout).unwrap();
    let summary = help.lines().next().unwrap();
    let topics = [
        ("gateway", "the gateway"),
        ("predictions", "durable predictions"),
        ("queue", "the predictions queue"),
        ("cluster", "a fleet's control plane"),
        ("chaos", "a fleet under faults"),
        ("store", "the weight store"),
        ("coldstart", "cold starts"),
        ("adapters", "LoRA adapters"),
    ];
    let listed: Vec<&str> = help
        .split("Commands:")
        .nth(1)
        .unwrap()
        .lines()
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .collect();
    assert_eq!(listed, topics.map(|(name, _)| name), "{help}");
    for (name, topic) in topics {
        assert!(summary.contains(topic), "`{name}` ({topic}) is not in the summary: {summary}");
    }
    assert!(!help.contains("overhead)"), "{help}");
}

/// With `--compare-events` a second gateway, without events, takes turns
/// with the first, and with `--baseline` a third (here of the same
/// binary): all serve everything, and only those with events have an
/// events writer to spend CPU.
#[test]
fn bench_gateway_serves_every_request_on_every_path() {
    let exe = env!("CARGO_BIN_EXE_hangar");
    let args = ["--requests", "200", "--concurrency", "4", "--compare-events", "--baseline", exe, "--json"];
    let o = run(&[&["bench", "gateway"][..], &args].concat());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["requests"], 200);
    assert_eq!(report["body"], "chat");
    for phase in ["closed_loop", "open_loop"] {
        for path in ["direct", "gateway"] {
            let s = &report[phase][path];
            assert_eq!(
                (s["requests"].as_u64(), s["ok"].as_u64()),
                (Some(200), Some(200)),
                "{phase} {path}: {s}"
            );
            assert_eq!(s["errors"], 0, "{phase} {path}: {s}");
            for field in ["req_per_s", "p50_ms", "p90_ms", "p99_ms", "max_ms"] {
                assert!(s[field].as_f64().is_some_and(|x| x > 0.0), "{phase} {path} {field}: {s}");
            }
            assert!(s["p50_ms"].as_f64() <= s["p99_ms"].as_f64(), "{s}");
        }
        for field in ["p50_ms", "p90_ms", "p99_ms"] {
            assert!(report[phase]["added"][field].is_f64(), "{phase}: {}", report[phase]);
        }
        assert!(report[phase]["throughput_share"].as_f64().is_some_and(|x| x > 0.0));
        for other in ["without_events", "baseline"] {
            let other = &report[other][phase];
            assert_eq!(other["gateway"]["ok"], 200, "{other}");
            assert_eq!(other["direct"], report[phase]["direct"], "one direct path for every gateway");
        }
    }
    for cpu in [&report["cpu"], &report["without_events"]["cpu"], &report["baseline"]["cpu"]] {
        assert!(cpu["us_per_request"].as_f64().is_some_and(|us| us > 0.0), "{cpu}");
    }
    assert_eq!(report["without_events"]["cpu"]["events_writer_us_per_request"], 0.0, "{report}");
}

#[test]
fn bench_gateway_completion_bodies_and_the_table() {
    let o = run(&["bench", "gateway", "--requests", "50", "--concurrency", "2", "--body", "completion"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let table = String::from_utf8_lossy(&o.stdout);
    for needle in [
        "50 completion requests",
        "closed loop, 2 keep-alive clients",
        "gateway CPU = ",
        "open loop, 1000 req/s",
        "added",
    ] {
        assert!(table.contains(needle), "{needle:?} missing from\n{table}");
    }
}

#[test]
fn bench_gateway_rejects_bad_options_by_name() {
    let o = run(&["bench", "gateway", "--concurrency", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--concurrency"));
    let o = run(&["bench", "gateway", "--rate", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--rate"));
    let o = run(&["bench", "gateway", "--baseline", "/nonexistent/hangar"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--baseline /nonexistent/hangar: no such file"));
    let o = run(&["bench", "gateway", "--body", "image"]);
    assert_eq!(o.status.code(), Some(2), "clap names the allowed values");
}

#[test]
fn bench_predictions_runs_every_phase_and_prints_the_targets() {
    let o =
        run(&["bench", "predictions", "--requests", "200", "--concurrency", "4", "--rate", "400", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    for phase in ["creates", "wait", "open_loop"] {
        let s = &report[phase];
        assert_eq!((s["ok"].as_u64(), s["errors"].as_u64()), (Some(200), Some(0)), "{phase}: {s}");
        assert!(s["p99_ms"].as_f64().is_some_and(|x| x > 0.0), "{phase}: {s}");
    }
    assert!(report["drain_completions_per_s"].as_f64().is_some_and(|x| x > 0.0), "{report}");
    let o = run(&["bench", "predictions", "--requests", "50", "--concurrency", "2", "--rate", "200"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let table = String::from_utf8_lossy(&o.stdout);
    for needle in
        ["durable creates", "completions (queue drain)", "Prefer: wait", "creates at 200/s", "targets:"]
    {
        assert!(table.contains(needle), "{needle:?} missing from\n{table}");
    }
    let o = run(&["bench", "predictions", "--concurrency", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--concurrency"));
}

#[test]
fn bench_store_prints_every_ratio_next_to_its_reference() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let o = run(&["bench", "store", "--size", "24MiB", "--lip-calls", "50", "--warm-only", "--dir", d]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    for row in [
        "import, warm cache",
        "BLAKE3 only (import ceiling)",
        "Materialize, blob cached",
        "P2P Materialize (loopback)",
        "lease-in-place Materialize",
        "host steal meanwhile",
        "import, cold cache: skipped (--warm-only)",
    ] {
        assert!(out.contains(row), "no `{row}` in:\n{out}");
    }
    assert!(out.contains("%"), "{out}");

    let o = run(&["bench", "store", "--lip-calls", "0", "--dir", d]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--lip-calls must be at least 1"));
}

/// The queue benchmark claims every prediction it creates, on SQLite and
/// on Redis Streams, and other accounts' predictions wait one claim
/// behind a backlog on SQLite (accounts take turns), at most two on
/// Redis (the backlog's two shards take turns with theirs), not the
/// backlog.
#[test]
fn bench_queue_claims_everything_and_an_account_waits_one_claim() {
    let args = ["bench", "queue", "--requests", "300", "--backlog", "200", "--probes", "5", "--slots", "2"];
    let o = run(&[&args[..], &["--json"]].concat());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let all: Value = serde_json::from_slice(&o.stdout).unwrap();
    let report = &all["reports"][0];
    assert_eq!((report["backend"].as_str(), report["requests"].as_u64()), (Some("sqlite"), Some(300)));
    assert!(report["create_claim_per_s"].as_f64().is_some_and(|x| x > 0.0), "{report}");
    assert_eq!(report["claims_before"], serde_json::json!([1, 1, 1]), "{report}");
    assert_eq!(report["slot_waits"], serde_json::json!([1, 1, 1]), "{report}");
    match all["reports"].get(1) {
        Some(redis) => {
            assert!(redis["backend"].as_str().unwrap().starts_with("redis streams"), "{redis}");
            assert!(redis["create_claim_per_s"].as_f64().is_some_and(|x| x > 0.0), "{redis}");
            assert!(redis["claims_before"][2].as_u64().unwrap() <= 2, "{redis}");
        }
        None => assert!(std::env::var_os("CI").is_none(), "no redis figures in CI: {all}"),
    }
    let o = run(&["bench", "queue", "--slots", "0"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--slots"));
}

/// The adapters benchmark measures both figures on one machine and, with
/// `--fleet`, through a fleet's gateway, where its fresh adapters are
/// registered in turn on the replica's own node and only on its peer:
/// each request succeeded (the bench fails on any error), and the report
/// says which source each fresh adapter had.
#[test]
fn bench_adapters_measures_a_machine_and_a_fleet() {
    let args = ["bench", "adapters", "--requests", "10", "--fresh", "2", "--rank", "1", "--json"];
    let o = run(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let machine: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(machine["fleet"], false, "{machine}");
    assert_eq!((machine["base"]["ok"].as_u64(), machine["loaded"]["ok"].as_u64()), (Some(10), Some(10)));
    assert_eq!(machine["fresh"].as_array().unwrap().len(), 2, "{machine}");
    assert!(machine["exported_ahead_s"].is_number(), "{machine}");
    if hangar_redis::LocalRedis::binary().is_none() && std::env::var_os("CI").is_none() {
        return eprintln!("skipped the fleet: no redis-server");
    }
    let o = run(&[&args[..], &["--fleet"]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let fleet: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (fleet["fleet"].as_bool(), fleet["exported_ahead_s"].is_number()),
        (Some(true), true),
        "{fleet}"
    );
    // Registered on n0, then n1: which is "this node" is placement's pick.
    let mut sources: Vec<&str> =
        fleet["fresh"].as_array().unwrap().iter().map(|f| f["source"].as_str().unwrap()).collect();
    sources.sort_unstable();
    assert_eq!(sources, ["peer", "this-node"], "{fleet}");
    let by_source: Vec<&str> = fleet["overhead_p50_by_source_ms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_str().unwrap())
        .collect();
    assert_eq!(by_source, ["this-node", "peer"], "{fleet}");
}

/// The queue benchmark with `--durable` adds a Redis Cluster with a
/// replica per primary, measured without and with `durable_replicas = 1`;
/// every backend reports the latency of creates sent one at a time.
#[test]
fn bench_queue_durable_measures_a_cluster_without_and_with_replicas_acknowledging() {
    if hangar_redis::LocalRedis::binary().is_none() && std::env::var_os("CI").is_none() {
        return eprintln!("skipped: no redis-server");
    }
    let args =
        ["bench", "queue", "--requests", "200", "--backlog", "100", "--probes", "3", "--durable", "--json"];
    let o = run(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let all: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(all["durable_skipped"].is_null(), "{all}");
    let backends: Vec<&str> =
        all["durable"].as_array().unwrap().iter().map(|r| r["backend"].as_str().unwrap()).collect();
    assert_eq!(backends.len(), 2, "{all}");
    assert!(
        backends[0].ends_with("durable_replicas = 0") && backends[1].ends_with("durable_replicas = 1"),
        "{all}"
    );
    for r in all["reports"].as_array().unwrap().iter().chain(all["durable"].as_array().unwrap()) {
        let [p50, p99] = [0, 1].map(|i| r["create_ms"][i].as_f64().unwrap());
        assert!(0.0 < p50 && p50 <= p99, "{r}");
    }
}

/// The cluster benchmark measures simulated agents' heartbeats against a
/// private Redis, and a real fleet draining a node and losing one: every
/// figure is there
/// (their targets are in the printed report, not asserted here).
#[test]
fn bench_cluster_reports_heartbeat_load_and_a_node_loss() {
    if hangar_redis::LocalRedis::binary().is_none() && std::env::var_os("CI").is_none() {
        return eprintln!("skipped: no redis-server");
    }
    let o = run(&["bench", "cluster", "--agents", "50", "--seconds", "2", "--json"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    let h = &report["heartbeats"];
    assert_eq!(h["agents"], 50, "{report}");
    assert!(h["reports_per_s"].as_f64().unwrap() > 0.0 && h["leader_cpu_pct"].as_f64().is_some(), "{report}");
    let n = &report["node_loss"];
    // The registration lapses no earlier than its TTL after the last
    // heartbeat: the dead node was really waited for.
    assert!(n["detected_ms"].as_u64().unwrap() >= 7_000, "{report}");
    assert!(n["replaced_ms"].as_u64().is_some() && n["engine_ms"].as_u64().is_some(), "{report}");
    // The drain before it moved the replica make-before-break.
    assert_eq!(n["drain"]["fewest_ready"], 2, "{report}");
    assert!(n["drain"]["moved_ms"].as_u64().is_some_and(|ms| ms > 0), "{report}");
}

/// `hangar bench chaos --schedule FILE` reads faults written out — here an
/// engine hung and a node drained, which no seed draws — and `--dry-run`
/// prints them; a bad file is refused naming the file, the step and what
/// is wrong, before anything runs.
#[test]
fn bench_chaos_runs_a_schedule_written_out() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("faults.toml");
    std::fs::write(
        &path,
        "[[step]]\ngap_ms = 3000\nfault = { kind = \"engine-hang\", agent = 1, pick = 0 }\n\n\
         [[step]]\ngap_ms = 2000\nfault = { kind = \"node-drain\", agent = 0, ms = 12000 }\n",
    )
    .unwrap();
    let file = path.to_str().unwrap();
    let o = run(&["bench", "chaos", "--schedule", file, "--dry-run"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(out.starts_with("fixed schedule (2 faults):"), "{out}");
    assert!(out.contains("SIGSTOP engine #0 (mod count) of agent node-2"), "{out}");
    assert!(out.contains("drain node node-1 for 12.0 s"), "{out}");

    std::fs::write(
        &path,
        "[[step]]\ngap_ms = 3000\nfault = { kind = \"agent-stop\", agent = 5, ms = 1000 }\n",
    )
    .unwrap();
    let o = run(&["bench", "chaos", "--schedule", file, "--dry-run"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&format!("schedule {file}: step 1")) && err.contains("agents are 0 to 2"), "{err}");
    let o = run(&["bench", "chaos", "--schedule", file, "--minutes", "1"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("cannot be used with"));
}
