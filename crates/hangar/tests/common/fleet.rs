//! Fleets for the tests: node agents as real processes, and what the
//! gateways' admin API says of them.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A running `hangar agent`. Dropping it stops it (SIGTERM, then SIGKILL)
/// even when a test fails; its engines die with it.
pub struct Agent {
    child: Child,
    /// Its node's name.
    pub name: String,
    /// Its own HTTP (`/health`, `/status`): `http://ADDR`.
    pub url: String,
    log: std::path::PathBuf,
}

impl Agent {
    /// Kills it outright (SIGKILL), as a machine that vanishes.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops it (SIGSTOP) or lets it go on (SIGCONT), as a machine that
    /// hangs for a while.
    pub fn signal(&self, signal: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).unwrap();
        rustix::process::kill_process(pid, signal).unwrap();
    }

    /// Whether it has exited, and how.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().unwrap()
    }

    /// `GET /status`: its record, report and every replica as its
    /// lifecycle driver holds it.
    pub fn status(&self) -> Value {
        reqwest::blocking::get(format!("{}/status", self.url)).unwrap().json().unwrap()
    }

    /// What it has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- agent {}'s log ---\n{}", self.name, self.log());
        }
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        for _ in 0..200 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `hangar agent` for node `name` (`gpus` virtual 80 GB GPUs) of
/// the fleet `config` on `redis`, its log in `dir`, and waits for its
/// first line.
pub fn agent(dir: &Path, config: &Path, redis: &str, name: &str, gpus: u32) -> Agent {
    agent_with(dir, config, redis, name, gpus, "80GB", &[])
}

/// [`agent`] with GPUs of `gpu_memory` each and `more` flags (`--move-s
/// 30`).
pub fn agent_with(
    dir: &Path,
    config: &Path,
    redis: &str,
    name: &str,
    gpus: u32,
    gpu_memory: &str,
    more: &[&str],
) -> Agent {
    let log = dir.join(format!("agent-{name}.log"));
    let child = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["agent", "--config", config.to_str().unwrap(), "--redis", redis, "--name", name])
        .args(["--gpus", &gpus.to_string(), "--gpu-memory", gpu_memory, "--virtual-gpus", "--drain-s", "1"])
        .args(more)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut agent = Agent { child, name: name.to_owned(), url: String::new(), log };
    let mut line = String::new();
    BufReader::new(agent.child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let prefix = format!("agent {name} listening on ");
    agent.url = line
        .trim()
        .strip_prefix(&prefix)
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    agent
}

/// A fleet's file of `models` (`[[models]]` entries) on `redis`, written
/// to `dir`, and a gateway serving it: the file's path (for agents) and
/// the gateway.
pub fn gateway(dir: &Path, redis: &str, models: &str) -> (std::path::PathBuf, super::Serve) {
    let config = format!("redis = \"{redis}\"\n{models}");
    let path = dir.join("fleet.toml");
    std::fs::write(&path, &config).unwrap();
    (path, super::serve_in(tempfile::tempdir().unwrap(), &config))
}

/// `GET /admin/status` of a gateway.
pub fn status(gateway: &str) -> Value {
    status_as(gateway, None)
}

/// [`status`] asked with `key` (an admin's, on a server with keys).
pub fn status_as(gateway: &str, key: Option<&str>) -> Value {
    let mut ask = reqwest::blocking::Client::new().get(format!("{gateway}/admin/status"));
    if let Some(key) = key {
        ask = ask.bearer_auth(key);
    }
    ask.send().unwrap().json().unwrap()
}

/// Each model's replicas that `gateway` routes to (ready), with their node
/// as the leader placed them (`null` on a gateway that does not lead).
pub fn ready(gateway: &str) -> Vec<(String, String)> {
    let s = status(gateway);
    let mut out = Vec::new();
    for m in s["models"].as_array().unwrap() {
        for r in m["replicas"].as_array().unwrap().iter().filter(|r| r["state"] == "ready") {
            out.push((m["model"].as_str().unwrap().to_owned(), r["node"].as_str().unwrap_or("").to_owned()));
        }
    }
    out
}

/// Waits until `gateway` routes to `want` ready replicas of each model
/// (and, if given, none on the node `not_on`, per the leader's status);
/// two minutes at most.
pub fn wait_ready(gateway: &str, want: &[(&str, usize)], not_on: Option<&str>) -> Vec<(String, String)> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let r = ready(gateway);
        let counts_ok = want.iter().all(|(m, n)| r.iter().filter(|(model, _)| model == m).count() == *n);
        let placed_ok = not_on.is_none_or(|bad| r.iter().all(|(_, node)| node != bad));
        if counts_ok && placed_ok {
            return r;
        }
        assert!(Instant::now() < deadline, "not {want:?} ready in time: {}", status(gateway));
        std::thread::sleep(Duration::from_millis(100));
    }
}
