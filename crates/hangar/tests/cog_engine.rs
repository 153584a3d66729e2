//! The `cog` engine end to end: `hangar serve` launches cog's own model
//! server (`python -m cog.server.http`, the pinned `cog` package) in
//! `examples/cog-echo` and runs predictions and trainings on it over cog's
//! HTTP protocol — streamed output, logs, cancel, input the model
//! rejects, a setup that fails, and the OpenAI routes refusing the model —
//! and stopping those servers quietly.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::predictions::{client, get, post, sse_events, wait_terminal};
use serde_json::{json, Value};

/// A predictor whose `setup()` prints, then fails.
const BROKEN: &str = r#"
from cog import BasePredictor

class Predictor(BasePredictor):
    def setup(self) -> None:
        print("setup: looking for weights.bin")
        raise FileNotFoundError("weights.bin is missing")

    def predict(self, prompt: str) -> str:
        return prompt
"#;

fn config(python: &Path, broken_dir: &str) -> String {
    common::one_gpu(&format!(
        r#"{}
[[models]]
key = "examples/broken"
engine = {{ kind = "cog", dir = "{broken_dir}", python = "{}", setup_timeout_s = 120 }}
size = "1GB"
"#,
        common::cog_echo_model(python),
        python.display()
    ))
}

/// Polls until the prediction is `processing`.
fn wait_processing(url: &str) {
    let t = Instant::now();
    while get(url)["status"] != "processing" {
        assert!(t.elapsed() < Duration::from_secs(60), "never started: {}", get(url));
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn cog_models_serve_predictions_and_trainings() {
    let python = common::python();
    let broken = tempfile::tempdir().unwrap();
    std::fs::write(broken.path().join("cog.yaml"), "predict: \"predict.py:Predictor\"\n").unwrap();
    std::fs::write(broken.path().join("predict.py"), BROKEN).unwrap();
    let s = common::serve(&config(&python, broken.path().to_str().unwrap()));
    let create = format!("{}/v1/models/examples/cog-echo/predictions", s.url);

    // Waiting: the whole streamed output, and the model's logs.
    let input = json!({"input": {"prompt": "hello cog world", "repeat": 2}});
    let (status, p) = post(&create, &input, &[("Prefer", "wait=60")]);
    assert_eq!(status, 201, "{p}");
    assert_eq!(p["status"], "succeeded", "{p}");
    let words = ["echo:", "hello", "cog", "world", "hello", "cog", "world"];
    let expected: Vec<Value> = words.iter().map(|w| json!(format!("{w} "))).collect();
    assert_eq!(p["output"], json!(expected), "{p}");
    assert!(p["logs"].as_str().unwrap().contains("predicting 15 characters, 2 time(s)"), "{p}");

    // Streaming: each word is an SSE `output` event as the model yields it.
    let (_, p) = post(&create, &json!({"input": {"prompt": "a b c", "delay": 0.1}, "stream": true}), &[]);
    let events = sse_events(p["urls"]["stream"].as_str().unwrap());
    let outputs: Vec<&str> = events.iter().filter(|(e, _)| e == "output").map(|(_, d)| d.as_str()).collect();
    assert_eq!(outputs, ["echo: ", "a ", "b ", "c "], "{events:?}");
    assert_eq!(events.last().unwrap().0, "done", "{events:?}");

    // Cancel while running: cog stops the predictor; the next prediction
    // runs once the server is free again.
    let (_, p) = post(&create, &json!({"input": {"prompt": "x ".repeat(50), "delay": 0.5}}), &[]);
    let url = p["urls"]["get"].as_str().unwrap().to_owned();
    wait_processing(&url);
    let (status, _) = post(p["urls"]["cancel"].as_str().unwrap(), &json!({}), &[]);
    assert_eq!(status, 200);
    let done = wait_terminal(&url);
    assert_eq!(done["status"], "canceled", "{done}");
    let (_, p) = post(&create, &json!({"input": {"prompt": "after"}}), &[("Prefer", "wait")]);
    assert_eq!(p["output"], json!(["echo: ", "after "]), "{p}");

    // Input the model's signature rejects: failed, naming the field.
    let (_, p) = post(&create, &json!({"input": {"prompt": "x", "repeat": "many"}}), &[("Prefer", "wait")]);
    assert_eq!(p["status"], "failed", "{p}");
    assert!(p["error"].as_str().unwrap().contains("input.repeat"), "{p}");

    // The version shows the schema the cog server publishes.
    let model = get(&format!("{}/v1/models/examples/cog-echo", s.url));
    let schema = &model["latest_version"]["openapi_schema"]["components"]["schemas"];
    assert_eq!(schema["Input"]["properties"]["repeat"]["maximum"].as_f64(), Some(10.0), "{model}");

    // A training runs the model's `train` on a replica of its trainer,
    // placed on the node's GPU beside the model's replica.
    let version = model["latest_version"]["id"].as_str().unwrap().to_owned();
    let (status, t) = post(
        &format!("{}/v1/models/examples/cog-echo/versions/{version}/trainings", s.url),
        &json!({"destination": "acme/echo-tuned", "input": {"text": "a b a c", "epochs": 2}}),
        &[],
    );
    assert_eq!(status, 201, "{t}");
    let t = wait_terminal(t["urls"]["get"].as_str().unwrap());
    assert_eq!(t["status"], "succeeded", "{t}");
    assert_eq!(t["output"], json!({"words": 8, "vocabulary": 3}), "{t}");
    assert!(t["logs"].as_str().unwrap().contains("epoch 2/2: 4 words"), "{t}");
    let trainer = trainer_status(&s.url, "examples/cog-echo");
    assert_eq!(trainer["replicas"][0]["node"], "local", "{trainer}");
    // Counted under the trainer, whose replica ran it.
    let metrics = client().get(format!("{}/metrics", s.url)).send().unwrap().text().unwrap();
    let counted = metrics.lines().any(|l| {
        l.starts_with("hangar_requests_total")
            && l.contains(r#"model="examples/cog-echo/trainer""#)
            && l.contains(r#"kind="training""#)
            && l.ends_with(" 1")
    });
    assert!(counted, "{metrics}");
    // No client names the trainer.
    let (status, e) = post(
        &format!("{}/v1/models/examples/cog-echo/trainer/predictions", s.url),
        &json!({"input": {"text": "a"}}),
        &[],
    );
    assert_eq!(status, 404, "{e}");
    let r = client()
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&common::chat("examples/cog-echo/trainer", 4))
        .send()
        .unwrap();
    assert_eq!(r.status(), 404, "the OpenAI routes do not know it either");

    // A model whose setup fails: its predictions fail with the setup logs.
    let (_, p) = post(
        &format!("{}/v1/models/examples/broken/predictions", s.url),
        &json!({"input": {"prompt": "x"}}),
        &[],
    );
    let p = wait_terminal(p["urls"]["get"].as_str().unwrap());
    assert_eq!(p["status"], "failed", "{p}");
    let error = p["error"].as_str().unwrap();
    assert!(error.contains("SETUP_FAILED") && error.contains("setup: looking for weights.bin"), "{p}");
    assert!(error.contains("weights.bin is missing"), "{p}");

    // The OpenAI routes do not serve cog models.
    let r = client()
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&common::chat("examples/cog-echo", 4))
        .send()
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("predictions"), "{body}");
}

/// The entry of `model`'s trainer in `/admin/status`.
fn trainer_status(url: &str, model: &str) -> Value {
    let status = get(&format!("{url}/admin/status"));
    let trainer = status["models"].as_array().unwrap().iter().find(|m| m["trains"] == model).cloned();
    trainer.unwrap_or_else(|| panic!("no trainer of {model} in {status}"))
}

#[test]
fn a_fleets_trainings_run_on_a_trainer_the_leader_places_on_an_agent_and_stops_when_idle() {
    let Some(redis) = hangar_redis::LocalRedis::for_test() else { return };
    let python = common::python();
    let dir = tempfile::tempdir().unwrap();
    // The gateway has no GPU and the model no replica: only placement can
    // start the trainer, on the agent's node.
    let models = common::cog_echo_model(&python).replace("min_replicas = 1", "min_replicas = 0");
    let (fleet, gateway) = common::fleet::gateway(dir.path(), &redis.url(), &models);
    let _agent = common::fleet::agent(dir.path(), &fleet, &redis.url(), "n0", 1);

    let model = get(&format!("{}/v1/models/examples/cog-echo", gateway.url));
    let version = model["latest_version"]["id"].as_str().unwrap().to_owned();
    let create = format!("{}/v1/models/examples/cog-echo/versions/{version}/trainings", gateway.url);

    // A training canceled while it runs stops on the trainer, which stays
    // up for the next.
    let slow = json!({"destination": "acme/echo-tuned", "input": {"text": "x", "epochs": 100, "delay": 0.2}});
    let (_, t) = post(&create, &slow, &[]);
    let url = t["urls"]["get"].as_str().unwrap().to_owned();
    wait_processing(&url);
    let (status, _) = post(t["urls"]["cancel"].as_str().unwrap(), &json!({}), &[]);
    assert_eq!(status, 200);
    assert_eq!(wait_terminal(&url)["status"], "canceled");

    let (status, t) = post(
        &create,
        &json!({"destination": "acme/echo-tuned", "input": {"text": "x y x", "epochs": 1}}),
        &[],
    );
    assert_eq!(status, 201, "{t}");
    let t = wait_terminal(t["urls"]["get"].as_str().unwrap());
    assert_eq!(t["status"], "succeeded", "{t}\n{}", gateway.log());
    assert_eq!(t["output"], json!({"words": 3, "vocabulary": 2}), "{t}");
    let trainer = trainer_status(&gateway.url, "examples/cog-echo");
    assert_eq!(trainer["model"], "examples/cog-echo/trainer", "{trainer}");
    let nodes: Vec<&Value> = trainer["replicas"].as_array().unwrap().iter().map(|r| &r["node"]).collect();
    assert_eq!(nodes, [&json!("n0")], "{trainer}");
    assert!(
        common::fleet::ready(&gateway.url).iter().all(|(m, _)| m != "examples/cog-echo"),
        "a training starts no replica of the model itself"
    );

    // Idle, it gives the GPU back (a quiet period of twice its measured
    // start, at least 5 s).
    let t0 = Instant::now();
    while !trainer_status(&gateway.url, "examples/cog-echo")["replicas"].as_array().unwrap().is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "{}",
            trainer_status(&gateway.url, "examples/cog-echo")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `hangar serve` whose log the test reads once it has stopped.
struct LoggedServe {
    child: Child,
    url: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl LoggedServe {
    fn start(config: &str) -> LoggedServe {
        let dir = tempfile::tempdir().unwrap();
        let (path, log) = (dir.path().join("serve.toml"), dir.path().join("serve.log"));
        std::fs::write(&path, config).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_hangar"))
            .args(["serve", "--listen", "127.0.0.1:0", "--config", path.to_str().unwrap()])
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut s = LoggedServe { child, url: String::new(), log, _dir: dir };
        let mut line = String::new();
        BufReader::new(s.child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        s.url = line.trim().strip_prefix("listening on ").expect("listening on URL").to_owned();
        s
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops the server as an operator does (SIGTERM: it stops its
    /// engines, then exits) and returns what it logged from then on.
    fn stop(&mut self) -> String {
        let before = self.log().len();
        let pid = rustix::process::Pid::from_child(&self.child);
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
        // A bound for liveness only: stopping takes about a second.
        let t = Instant::now();
        while self.child.try_wait().unwrap().is_none() {
            assert!(t.elapsed() < Duration::from_secs(120), "hangar serve did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
        self.log()[before..].to_owned()
    }
}

impl Drop for LoggedServe {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- hangar serve's log ---\n{}", self.log());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a Python process prints when the cog server it worked for went
/// away without shutting it down: its worker's `EOFError` on the closed
/// pipe, and the resource tracker's warning about what was left behind.
const UNCLEAN_STOP: [&str; 3] = ["EOFError", "Process _ChildWorker", "leaked semaphore"];

/// A `python` that runs `python` with SIGINT ignored, as every process
/// started in the background by a non-interactive shell inherits it.
fn python_ignoring_sigint(python: &Path, dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    // Resolved here: the engine puts the wrapper's directory first on PATH.
    let real = if python.components().count() > 1 {
        python.to_owned()
    } else {
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path).map(|d| d.join(python)).find(|p| p.is_file()).expect("python on PATH")
    };
    let wrapper = dir.join("python");
    std::fs::write(&wrapper, format!("#!/bin/sh\ntrap '' INT\nexec '{}' \"$@\"\n", real.display())).unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    wrapper
}

#[test]
fn regression_stopping_cog_servers_leaves_no_traceback_in_the_log() {
    let bin = tempfile::tempdir().unwrap();
    let python = python_ignoring_sigint(&common::python(), bin.path());
    let broken = tempfile::tempdir().unwrap();
    std::fs::write(broken.path().join("cog.yaml"), "predict: \"predict.py:Predictor\"\n").unwrap();
    std::fs::write(broken.path().join("predict.py"), BROKEN).unwrap();
    let mut s = LoggedServe::start(&config(&python, broken.path().to_str().unwrap()));

    // A replica that serves, a trainer that ran one training, and a
    // server stopped because its setup failed.
    let create = format!("{}/v1/models/examples/cog-echo/predictions", s.url);
    let (_, p) = post(&create, &json!({"input": {"prompt": "hi"}}), &[("Prefer", "wait=60")]);
    assert_eq!(p["status"], "succeeded", "{p}");
    let model = get(&format!("{}/v1/models/examples/cog-echo", s.url));
    let version = model["latest_version"]["id"].as_str().unwrap().to_owned();
    let (_, t) = post(
        &format!("{}/v1/models/examples/cog-echo/versions/{version}/trainings", s.url),
        &json!({"destination": "acme/echo-tuned", "input": {"text": "a b"}}),
        &[],
    );
    let t = wait_terminal(t["urls"]["get"].as_str().unwrap());
    assert_eq!(t["status"], "succeeded", "{t}");
    let (_, p) = post(
        &format!("{}/v1/models/examples/broken/predictions", s.url),
        &json!({"input": {"prompt": "x"}}),
        &[],
    );
    let p = wait_terminal(p["urls"]["get"].as_str().unwrap());
    assert!(p["error"].as_str().unwrap().contains("SETUP_FAILED"), "{p}");

    // Stopping the server stops the serving replica: not a line of
    // Python traceback (the broken model's own setup traceback, logged
    // while it failed, came before).
    let after_stop = s.stop();
    assert!(!after_stop.contains("Traceback"), "a traceback while stopping:\n{after_stop}");
    let log = s.log();
    for unclean in UNCLEAN_STOP {
        assert!(!log.contains(unclean), "a cog server was not shut down cleanly ({unclean}):\n{log}");
    }
}
