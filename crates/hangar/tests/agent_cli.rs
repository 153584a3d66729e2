//! `hangar agent --engine-host`: the address a node's engines bind to and
//! are reported at, which the fleet's gateways send requests to.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::fleet::{status, wait_ready};
use hangar_redis::LocalRedis;
use serde_json::Value;

/// Stops the agent (SIGTERM, as Kubernetes does) even when a test fails.
struct Guard(std::process::Child);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.0.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn an_engine_host_that_names_no_machine_is_refused() {
    for host in ["0.0.0.0", "::", "[::]", ""] {
        let o = Command::new(env!("CARGO_BIN_EXE_hangar"))
            .args(["agent", "--config", "/nonexistent/fleet.toml", "--redis", "redis://127.0.0.1:1/0"])
            .args(["--gpus", "1", "--gpu-memory", "80GB", "--engine-host", host])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "--engine-host {host:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("--engine-host"), "{err}");
    }
}

/// An agent listening on every interface with the engine host 127.0.0.2
/// (standing in for a pod's IP; Linux routes all of 127/8 to loopback):
/// its engines are reported at that host, the gateway reaches them there,
/// and the registry names the agent at that host too.
#[test]
fn an_agents_engines_are_reported_and_reached_at_its_engine_host() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let config = format!(
        "redis = \"{}\"\n\n[[models]]\nkey = \"t/a\"\nengine = {{ kind = \"mock\", preset = \"fast\" }}\n\
         size = \"10GB\"\nmin_replicas = 1\n",
        redis.url()
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.toml");
    std::fs::write(&path, &config).unwrap();
    let gateway = common::serve_in(tempfile::tempdir().unwrap(), &config);
    let mut child = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["agent", "--config", path.to_str().unwrap(), "--redis", &redis.url(), "--name", "n0"])
        .args(["--gpus", "1", "--gpu-memory", "80GB", "--virtual-gpus", "--drain-s", "0"])
        .args(["--listen", "0.0.0.0:0", "--engine-host", "127.0.0.2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let _agent = Guard(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let port = line.trim().rsplit(':').next().unwrap().to_owned();
    assert!(line.starts_with("agent n0 listening on http://0.0.0.0:"), "{line:?}");

    wait_ready(&gateway.url, &[("t/a", 1)], None);
    let agent: Value =
        reqwest::blocking::get(format!("http://127.0.0.2:{port}/status")).unwrap().json().unwrap();
    assert_eq!(agent["node"]["url"], format!("http://127.0.0.2:{port}"), "{agent}");
    let url = agent["report"]["replicas"][0]["url"].as_str().unwrap_or_else(|| panic!("{agent}"));
    assert!(url.starts_with("http://127.0.0.2:"), "the engine is reported at the engine host: {url}");
    let (code, answer) = common::post(&gateway.url, None, &common::chat("t/a", 3));
    assert_eq!(code, 200, "{answer} {}", status(&gateway.url));
    assert_eq!(answer["usage"]["completion_tokens"], 3);
}

/// Without `--gpus` the agent counts the NVIDIA GPUs it can open; on a
/// machine with none it stops at once saying what to give instead. (A
/// machine with GPUs skips this test: there the count is the answer.)
#[test]
fn without_gpus_the_agent_counts_the_machines_and_names_the_flag_when_there_are_none() {
    if hangar_agent::devices::nvidia_gpus(std::path::Path::new("/dev")).unwrap_or(0) > 0 {
        eprintln!("skipped: this machine has NVIDIA GPUs");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.toml");
    let config = "[[models]]\nkey = \"t/a\"\nengine = { kind = \"mock\" }\nsize = \"10GB\"\n";
    std::fs::write(&path, config).unwrap();
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_hangar"))
            .args(["agent", "--config", path.to_str().unwrap(), "--redis", "redis://:pw@127.0.0.1:1/0"])
            .args(["--gpu-memory", "80GB"])
            .args(extra)
            .env_remove("HANGAR_GPUS")
            .output()
            .unwrap()
    };
    let o = run(&[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("no NVIDIA GPU in /dev") && err.contains("--gpus N"), "{err}");
    let o = run(&["--virtual-gpus"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--virtual-gpus needs --gpus"), "{err}");
    // Given, the count is taken as is and the agent goes on to Redis,
    // which is not there: named without its password.
    let o = run(&["--gpus", "2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("redis://:***@127.0.0.1:1/0") && !err.contains(":pw@"), "{err}");
}

/// A fleet node's agent hands its engine a model directory from the
/// store as `hangar serve` does (the same `hangar-agent` weights code):
/// the directory written under the node's store root, every file read by
/// the engine as it was imported, and the request answered through the
/// gateway.
#[test]
fn a_fleet_agent_hands_its_engine_a_model_directory_from_the_store() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (src, store) = (dir.path().join("tiny-llama"), dir.path().join("store"));
    let hangar = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_hangar")).args(args).output().unwrap();
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    };
    hangar(&["store", "synth-model-dir", src.to_str().unwrap(), "--hidden", "64", "--layers", "2"]);
    hangar(&[
        "store",
        "--root",
        store.to_str().unwrap(),
        "import",
        src.to_str().unwrap(),
        "--key",
        "tiny/llama:v1",
    ]);
    let config = format!(
        "redis = \"{}\"\n[store]\nroot = \"{}\"\n\n[[models]]\nkey = \"t/d\"\n\
         engine = {{ kind = \"mock\", preset = \"fast\" }}\nsize = \"10GB\"\nmin_replicas = 1\n\
         weights = \"store:tiny/llama:v1\"\n",
        redis.url(),
        store.display()
    );
    let path = dir.path().join("fleet.toml");
    std::fs::write(&path, &config).unwrap();
    let gateway = common::serve_in(tempfile::tempdir().unwrap(), &config);
    let mut child = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["agent", "--config", path.to_str().unwrap(), "--redis", &redis.url(), "--name", "n0"])
        .args(["--gpus", "1", "--gpu-memory", "80GB", "--virtual-gpus", "--drain-s", "0"])
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let _agent = Guard(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let port = line.trim().rsplit(':').next().unwrap().to_owned();

    wait_ready(&gateway.url, &[("t/d", 1)], None);
    let agent: Value =
        reqwest::blocking::get(format!("http://127.0.0.1:{port}/status")).unwrap().json().unwrap();
    let url = agent["report"]["replicas"][0]["url"].as_str().unwrap_or_else(|| panic!("{agent}"));
    let models: Value = reqwest::blocking::get(format!("{url}/v1/models")).unwrap().json().unwrap();
    let read = &models["data"][0]["weights"];
    assert!(read["path"].as_str().unwrap().starts_with(store.join("model-dirs").to_str().unwrap()), "{read}");
    for f in read["files"].as_array().unwrap() {
        let name = f["name"].as_str().unwrap();
        let want = blake3::hash(&std::fs::read(src.join(name)).unwrap()).to_hex().to_string();
        assert_eq!(f["blake3"], want.as_str(), "{name} read as imported");
    }
    assert_eq!(read["files"].as_array().unwrap().len(), 7, "{read}");
    let (code, answer) = common::post(&gateway.url, None, &common::chat("t/d", 3));
    assert_eq!(code, 200, "{answer} {}", status(&gateway.url));
}
