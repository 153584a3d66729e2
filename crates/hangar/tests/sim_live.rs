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
fn a_short_trace_runs_live_and_simulated_with_the_same_replicas() {
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
    // TTFT agreement depends on this machine's load (a benchmark figure,
    // docs/sim.md); the replicas wanted at each sample do not.
    let out = Command::new(hangar)
        .args(["sim", "live", trace.to_str().unwrap(), "--fleet", fleet.to_str().unwrap()])
        .args(["--speedup", "2", "--sample-s", "4", "--ttft-tolerance-pct", "100000"])
        .args(["--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("within the tolerance") && stdout.contains("synth/m0"), "{stdout}");
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let live = &report["live"]["models"]["synth/m0"];
    assert_eq!(live["ttft_ms"].as_array().unwrap().len(), 40, "every request answered live: {live}");
    assert_eq!(report["simulation"]["total"]["completed"], 40);
    let samples = report["live"]["samples"].as_array().unwrap();
    assert!(samples.len() >= 4, "sampled through the run: {samples:?}");
    assert!(report["models"][0]["max_replica_gap"].as_u64().unwrap() <= 1);
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
