//! Out-of-capacity failover: a replica that refuses a request for want of
//! capacity (429) has it sent to another replica before the client sees a
//! refusal, and is then tried last for a cool-down rather than first for
//! every request; with no other replica, the refusal reaches the client as
//! the engine gave it. The engine is `full_engine.py`, whose first instance
//! is always full.

mod common;

use std::time::{Duration, Instant};

use common::{chat, one_gpu, post, serve_in, Serve};
use hangar_router::REFUSAL_COOL_DOWN_MS;
use serde_json::Value;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/full_engine.py");

/// `hangar serve` with `replicas` replicas of `full_engine.py`, the first
/// of which is out of capacity, routed round robin.
fn serve_full(replicas: u32) -> Serve {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("first-is-full");
    let python = common::python();
    let config = one_gpu(&format!(
        r#"
[[models]]
key = "t/full"
engine = {{ kind = "openai", command = "{} {SCRIPT} {{port}} {}", setup_timeout_s = 30 }}
size = "10GB"
min_replicas = {replicas}
max_replicas = {replicas}
router = "round-robin"
"#,
        python.display(),
        marker.display()
    ));
    let s = serve_in(dir, &config);
    common::ready_replicas(&s.url, replicas as usize);
    s
}

fn failovers(url: &str) -> u64 {
    let metrics = reqwest::blocking::get(format!("{url}/metrics")).unwrap().text().unwrap();
    let line = metrics
        .lines()
        .find(|l| l.starts_with("hangar_capacity_failovers_total{model=\"t/full\"}"))
        .unwrap_or_else(|| panic!("no failover counter in\n{metrics}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// The most failovers a full replica can cost in `elapsed`: after each
/// refusal it is chosen last for the cool-down, so it refuses (and a
/// request fails over) at most once per cool-down. Without the cool-down
/// round robin sends it every other request.
fn at_most_once_per_cool_down(elapsed: Duration) -> u64 {
    elapsed.as_millis() as u64 / REFUSAL_COOL_DOWN_MS + 1
}

#[test]
fn a_request_a_full_replica_refuses_is_answered_by_another() {
    let s = serve_full(2);
    let started = Instant::now();
    for i in 0..20 {
        let (status, body) = post(&s.url, None, &chat("t/full", 2));
        assert_eq!(status, 200, "request {i}: {body}");
        assert_eq!(body["choices"][0]["message"]["content"], "hi");
    }
    let bound = at_most_once_per_cool_down(started.elapsed());
    // Round robin reaches the full replica by the second request; it
    // refuses, the request goes on, and the full one is put last.
    let n = failovers(&s.url);
    assert!(n >= 1, "the full replica was never tried");
    assert!(n <= bound, "{n} failovers, more than {bound}: the full replica was tried first again");
}

#[test]
fn with_no_other_replica_the_client_gets_the_engines_refusal() {
    let s = serve_full(1);
    let (status, body) = post(&s.url, None, &chat("t/full", 2));
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["message"], "out of capacity");
    assert_eq!(failovers(&s.url), 0);
}

#[test]
fn an_async_prediction_a_full_replica_refuses_runs_on_another() {
    let s = serve_full(2);
    let client = reqwest::blocking::Client::new();
    let started = Instant::now();
    for i in 0..10 {
        let r = client
            .post(format!("{}/v1/models/t/full/predictions", s.url))
            .header("Prefer", "wait")
            .json(&serde_json::json!({"input": {"prompt": "Hello", "max_tokens": 2}}))
            .send()
            .unwrap();
        let body: Value = r.json().unwrap();
        assert_eq!(body["status"], "succeeded", "prediction {i}: {body}");
    }
    let bound = at_most_once_per_cool_down(started.elapsed());
    let n = failovers(&s.url);
    assert!(n >= 1, "the full replica was never tried");
    assert!(n <= bound, "{n} failovers, more than {bound}: the full replica was tried first again");
}
