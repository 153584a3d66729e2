//! `hangar usage` against a running `hangar serve`: an account's table of
//! its own usage, an admin's of everyone's, the JSON, and a refusal
//! (docs/observability.md, "Usage and billing").

mod common;

use std::process::{Command, Output};

use common::{chat, one_gpu, post, serve};
use serde_json::Value;

const CONFIG: &str = r#"
[[models]]
key = "t/fast"
engine = { kind = "mock", preset = "fast" }
size = "10GB"
min_replicas = 1
billing = { per_input_token = 0.001, per_output_token = 0.002, neurons = { cost_per_infer = 1 } }

[[api_keys]]
key = "k-acme"
account = "acme"

[[api_keys]]
key = "k-beta"
account = "beta"

[[api_keys]]
key = "k-ops"
account = "ops"
admin = true
"#;

fn usage(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hangar")).args(["usage", "--url", url]).args(args).output().unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(out.status.success(), "hangar usage failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn an_account_prints_its_usage_and_an_admin_everyones() {
    let server = serve(&one_gpu(CONFIG));
    for (key, n) in [("k-acme", 3), ("k-beta", 2)] {
        for _ in 0..n {
            let (status, answer) = post(&server.url, Some(key), &chat("t/fast", 4));
            assert_eq!(status, 200, "{answer}");
        }
    }

    // An account's table: its one model, then the total.
    let text = stdout(&usage(&server.url, &["--key", "k-acme"]));
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("usage from ") && lines[0].ends_with(", account acme"), "{text}");
    let cells = |line: &str| line.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    assert_eq!(cells(lines[1])[..3], ["model", "requests", "errors"], "{text}");
    assert_eq!(cells(lines[2])[..3], ["t/fast", "3", "0"], "{text}");
    assert_eq!(cells(lines[3])[..3], ["total", "3", "0"], "{text}");
    assert_eq!(lines.len(), 4, "{text}");

    // An admin's, by account, as JSON: both accounts, priced.
    let json: Value = serde_json::from_str(&stdout(&usage(
        &server.url,
        &["--key", "k-ops", "--group-by", "account", "--from", "2020-01-01T00:00:00Z", "--json"],
    )))
    .unwrap();
    let groups: Vec<(&str, u64)> = json["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| (g["group"].as_str().unwrap(), g["requests"].as_u64().unwrap()))
        .collect();
    assert_eq!(groups, [("acme", 3), ("beta", 2)], "{json}");
    assert_eq!(json["total"]["neurons"], 5.0, "one neuron a request: {json}");
    assert!(json["total"]["usd"].as_f64().unwrap() > 0.0, "{json}");
    assert!(json["total"]["output_tokens"].as_u64().unwrap() > 0, "{json}");

    // Another account's usage, with an account's key: refused, said why.
    let refused = usage(&server.url, &["--key", "k-acme", "--account", "beta"]);
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("403") && err.contains("its own usage"), "{err}");
    // A bad time, refused by the server naming it.
    let refused = usage(&server.url, &["--key", "k-acme", "--from", "last week"]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("400") && err.contains("`from`"), "{err}");
}
