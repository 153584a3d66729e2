//! `hangar engine mock` as a supervisor runs it: a child process on a free
//! port, read back from its first line, killed at the end.

mod common;

use std::process::{Command, Stdio};

use common::{first_line, Killed};

fn spawn(args: &[&str]) -> (Killed, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_hangar"));
    command.args(["engine", "mock", "--port", "0"]).args(args).stderr(Stdio::null());
    let (child, line) = first_line(&mut command);
    let url = line.strip_prefix("listening on ").expect("the first line names the address").to_owned();
    (child, url)
}

#[test]
fn the_mock_engine_process_serves_on_the_port_it_prints() {
    let (_guard, url) = spawn(&["--preset", "fast", "--model", "demo"]);
    let models: serde_json::Value =
        reqwest::blocking::get(format!("{url}/v1/models")).unwrap().json().unwrap();
    assert_eq!(models["data"][0]["id"], "demo");
    let r: serde_json::Value = reqwest::blocking::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&serde_json::json!({"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(r["usage"]["completion_tokens"], 3);
}

#[test]
fn an_unknown_preset_is_a_clear_error() {
    let o = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["engine", "mock", "--preset", "gpt"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("unknown preset `gpt`; choose one of default, fast, instant, sglang"), "{err}");
}

/// `--host` is how an agent puts a mock engine on its engine host: the
/// printed URL names that address, and it answers there.
#[test]
fn the_mock_engine_listens_on_the_host_it_is_given() {
    let (_guard, url) = spawn(&["--preset", "fast", "--model", "demo", "--host", "127.0.0.2"]);
    assert!(url.starts_with("http://127.0.0.2:"), "{url}");
    let health = reqwest::blocking::get(format!("{url}/health")).unwrap();
    assert_eq!(health.status(), 200);
}
