//! `hangar sim live`: a short trace through the fleet simulation and
//! through a live `hangar serve` with mock engines, compared.
//!
//! The server is a child of the command, killed with it (and with the
//! command's temporary directory) whatever happens.

use std::process::Command;

const FLEET: &str = r#"
seed = 1

[cold_start]
disk_gbps = 2.0
wake_gbps = 25.0
boot_ms = 200

[[nodes]]
id = "gpu"
gpus = 2
gpu_memory = "80GB"
cpu_cache = "64GB"

[[models]]
key = "synth/m0"
size = "1GB"
max_replicas = 2
concurrency = 4
"#;

#[test]
fn a_short_trace_runs_live_and_simulated_with_the_same_ttft_counts_and_replicas() {
    let dir = tempfile::tempdir().unwrap();
    let (fleet, trace, json) =
        (dir.path().join("fleet.toml"), dir.path().join("t.jsonl"), dir.path().join("r.json"));
    std::fs::write(&fleet, FLEET).unwrap();
    let hangar = env!("CARGO_BIN_EXE_hangar");
    let synth = Command::new(hangar)
        .args(["trace", "synth", "--requests", "40", "--rate", "2", "--models", "1", "--max-turns", "1"])
        .args(["--seed", "3", "-o", trace.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(synth.status.success(), "{}", String::from_utf8_lossy(&synth.stderr));
    // Tolerances measured on this 2-core machine with the test's debug
    // build, 14 runs, some while other builds and tests ran (the
    // simulation's TTFT p50 is 77.7 ms, its p99 853 ms): the live p99 was
    // 0.8–13 % away, but the live p50 1.5–108 % (1–84 ms) above the
    // simulation's — the debug gateway and mock engine add a few to tens
    // of ms to each request, more on a loaded machine, a large share of a
    // 78 ms TTFT and a small one of the p99. Hence the command's one
    // tolerance for both percentiles at 150 %, and below the checks that
    // hold each to what was measured: p99 within 25 %, p50 no more than
    // 10 % below the simulation's (the live server cannot beat the
    // modelled time) nor more than 120 ms above it.
    let out = Command::new(hangar)
        .args(["sim", "live", trace.to_str().unwrap(), "--fleet", fleet.to_str().unwrap()])
        .args([
            "--speedup",
            "2",
            "--sample-s",
            "4",
            "--ttft-tolerance-pct",
            "150",
            "--replica-tolerance",
            "1",
        ])
        .args(["--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("within the tolerance") && stdout.contains("synth/m0"), "{stdout}");
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let row = &report["models"][0];
    let [sim50, live50, sim99, live99] =
        ["sim_ttft_p50_ms", "live_ttft_p50_ms", "sim_ttft_p99_ms", "live_ttft_p99_ms"]
            .map(|k| row[k].as_f64().unwrap());
    assert!((live99 - sim99).abs() <= 0.25 * sim99, "TTFT p99: sim {sim99} ms, live {live99} ms");
    assert!(live50 >= 0.9 * sim50 && live50 <= sim50 + 120.0, "TTFT p50: sim {sim50} ms, live {live50} ms");
    // Counts: every request answered on both sides, none failed.
    let live = &report["live"]["models"]["synth/m0"];
    assert_eq!(live["ttft_ms"].as_array().unwrap().len(), 40, "every request answered live: {live}");
    assert_eq!(live["failed"], 0);
    let sim = &report["simulation"]["total"];
    assert_eq!(
        (sim["completed"].as_u64(), sim["timed_out"].as_u64(), sim["rejected"].as_u64()),
        (Some(40), Some(0), Some(0))
    );
    // Replicas wanted: the same at every sample but the first, which the
    // live side may take after the first request has asked for one.
    let wanted = |samples: &serde_json::Value, f: &dyn Fn(&serde_json::Value) -> u64| -> Vec<u64> {
        samples.as_array().unwrap().iter().map(f).collect()
    };
    let live = wanted(&report["live"]["samples"], &|s| s["desired"]["synth/m0"].as_u64().unwrap());
    let sim = wanted(&report["simulation"]["timeline"], &|s| s["desired"][0].as_u64().unwrap());
    assert!(sim.len() >= 4, "sampled through the run: {sim:?}");
    assert!(live[0].abs_diff(sim[0]) <= 1, "live {live:?}, sim {sim:?}");
    assert_eq!(live[1..sim.len()], sim[1..], "live {live:?}, sim {sim:?}");
}

#[test]
fn a_model_missing_from_the_fleet_is_named_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let (fleet, trace) = (dir.path().join("fleet.toml"), dir.path().join("t.jsonl"));
    std::fs::write(&fleet, FLEET).unwrap();
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1], \"model\": \"other\"}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["sim", "live", trace.to_str().unwrap(), "--fleet", fleet.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("t.jsonl:1") && stderr.contains("other"), "{stderr}");
}
