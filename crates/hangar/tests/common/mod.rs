//! Helpers shared by the integration tests that start `hangar serve`.
//! (Each test binary uses some of them.)
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `hangar serve`. Dropping it stops the server (SIGTERM, so it
/// stops its engines) even when a test fails; engines also die with it if
/// it has to be killed.
pub struct Serve {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Serve {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self._dir.path().join("serve.log")).unwrap_or_default();
            eprintln!("--- hangar serve's log ---\n{log}");
        }
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `hangar serve` with `config` on a free loopback port and waits
/// for its `listening on` line.
pub fn serve(config: &str) -> Serve {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("serve.toml");
    std::fs::write(&path, config).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config", path.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("serve.log")).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    Serve { child, url, _dir: dir }
}

/// A configuration of one node with one virtual 80 GB GPU, then `rest`.
pub fn one_gpu(rest: &str) -> String {
    format!("[[nodes]]\nid = \"local\"\ngpus = 1\ngpu_memory = \"80GB\"\nvirtual_gpus = true\n{rest}")
}

/// A short chat request.
pub fn chat(model: &str, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({
        "model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": max_tokens
    })
}

/// Posts a chat request, with a bearer `key` if given; the status and the
/// JSON answer (null if it is not JSON).
pub fn post(url: &str, key: Option<&str>, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let mut r = reqwest::blocking::Client::new().post(format!("{url}/v1/chat/completions")).json(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(serde_json::Value::Null))
}
