//! `hangar plan` from the outside: the example, JSON output, and malformed
//! or missing files.

use std::path::PathBuf;
use std::process::{Command, Output};

fn hangar(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("hangar runs")
}

fn example() -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/plan.toml");
    root.to_str().unwrap().to_owned()
}

#[test]
fn plan_prints_decisions_evictions_and_the_delta() {
    let out = hangar(&["plan", &example()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    for needle in
        ["decisions:", "CACHED_AND_FREE", "FULL", "evictions:", "to_cache", "create", "nodes after:"]
    {
        assert!(text.contains(needle), "{needle} missing:\n{text}");
    }
}

#[test]
fn plan_json_is_machine_readable() {
    let out = hangar(&["plan", "--json", &example()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["seed"], 7);
    assert!(v["delta"]["create"].as_array().is_some_and(|a| !a.is_empty()));
    assert!(v["deploy"]["models"].as_array().is_some_and(|a| !a.is_empty()));
    // The evicted replica's own key, and the cause's keys apart.
    let eviction = &v["deploy"]["evictions"][0];
    assert_eq!(eviction["model_key"], "mistral/mixtral-8x22b");
    assert_eq!(eviction["cause"]["kind"], "pressure");
    assert_eq!(eviction["cause"]["model_key"], "meta/llama-3-70b");
}

#[test]
fn a_malformed_scenario_fails_naming_file_field_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.toml");
    std::fs::write(&path, "[[nodes]]\nid = \"a\"\ngpus = \"eight\"\n").unwrap();
    let out = hangar(&["plan", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("invalid scenario") && err.contains("broken.toml"), "{err}");
    assert!(err.contains("line 3") && err.contains("nodes[0].gpus"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn a_missing_scenario_fails_clearly() {
    let out = hangar(&["plan", "/nonexistent/scenario.toml"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("cannot read /nonexistent/scenario.toml"), "{err}");
}
