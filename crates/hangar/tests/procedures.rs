//! Procedures end to end: `hangar serve` with the procedures runtime (the
//! embedded Python server, run with `python3`) as a model, a source
//! archive served by a tiny HTTP server of the test on loopback (which the
//! configuration lets the webhook destination guard reach), and a
//! procedure that calls a mock model of the same server through both the
//! OpenAI and the Replicate API as its caller.
//!
//! The fleet's case: two gateways on one Redis and an agent running the
//! runtime; a procedure created through one gateway runs through the
//! other, the runtime downloading its source from the gateway that runs it.
//!
//! Needs `python3` on PATH: without it the test fails, naming it.

mod common;

use std::io::{BufReader, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::predictions::{client, get_as};
use serde_json::{json, Value};

/// The procedure: asks `t/llm` through the OpenAI API and through the
/// Replicate API (waiting for the prediction), with the caller's key.
const PIPE: &str = r#"
import json, os, urllib.request

def call(path, body, headers):
    req = urllib.request.Request(path, data=json.dumps(body).encode(), headers={
        "Authorization": "Bearer " + os.environ["REPLICATE_API_TOKEN"],
        "Content-Type": "application/json", **headers})
    return json.load(urllib.request.urlopen(req))

def predict(prompt, tokens=3):
    print(f"pipeline for {prompt!r}")
    chat = call(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                {"model": "t/llm", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens}, {})
    print("chat answered")
    p = call(os.environ["REPLICATE_BASE_URL"] + "/v1/models/t/llm/predictions",
             {"input": {"prompt": prompt, "max_tokens": tokens}}, {"Prefer": "wait=30"})
    return {"chat_tokens": chat["usage"]["completion_tokens"], "prediction": p["status"],
            "prediction_tokens": len(p["output"]), "cwd": os.path.basename(os.getcwd())}
"#;

/// A procedure that fails.
const FAILS: &str = "def predict():\n    print('about to fail')\n    raise ValueError('no way')\n";

/// A procedure that runs until canceled, yielding as it goes.
const SLOW: &str =
    "import time\n\ndef predict():\n    for i in range(600):\n        yield i\n        time.sleep(0.1)\n";

/// A procedure written with the official clients (`replicate`, `openai`),
/// which read `REPLICATE_*` and `OPENAI_*` from the environment the
/// runtime sets.
const SHOUT: &str = r#"
import openai, replicate

def predict(prompt: str):
    print("asking t/llm")
    words = list(replicate.run("t/llm", input={"prompt": prompt, "max_tokens": 4}))
    chat = openai.OpenAI().chat.completions.create(
        model="t/llm", messages=[{"role": "user", "content": prompt}], max_tokens=2)
    return {"words": len(words), "chat_tokens": chat.usage.completion_tokens, "shout": prompt.upper()}
"#;

/// What the official `replicate` client does with a procedure, as a user
/// would: `replicate.run` and `predictions.create` + `wait` with a webhook.
const CLIENT: &str = r#"
import os, sys, replicate
out = replicate.run("alice/shout", input={"prompt": "hi there"})
if out != {"words": 4, "chat_tokens": 2, "shout": "HI THERE"}:
    sys.exit(f"replicate.run: {out}")
p = replicate.predictions.create(model="alice/shout", input={"prompt": "again"},
                                 webhook=os.environ["HOOK"], webhook_events_filter=["completed"])
p.wait()
if p.status != "succeeded" or p.output["shout"] != "AGAIN" or "asking t/llm" not in p.logs:
    sys.exit(f"predictions.create: {p.status} {p.output} {p.logs!r}")
print(p.id)
"#;

fn tar_gz(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        let name = &mut h.as_old_mut().name;
        name[..path.len()].copy_from_slice(path.as_bytes());
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap().finish().unwrap()
}

/// A loopback HTTP server of archives by path; counts the GETs of each.
struct Origin {
    url: String,
    hits: Arc<Vec<(String, AtomicUsize)>>,
}

impl Origin {
    fn start(files: Vec<(&str, Vec<u8>)>) -> Origin {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let hits: Arc<Vec<(String, AtomicUsize)>> =
            Arc::new(files.iter().map(|(p, _)| (p.to_string(), AtomicUsize::new(0))).collect());
        let counted = hits.clone();
        let files: Vec<(String, Vec<u8>)> = files.into_iter().map(|(p, b)| (p.to_owned(), b)).collect();
        // Ends with the test process.
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let Some((head, _)) = common::read_request(&mut BufReader::new(stream.try_clone().unwrap()))
                else {
                    continue;
                };
                let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
                match files.iter().position(|(p, _)| *p == path) {
                    Some(i) => {
                        counted[i].1.fetch_add(1, Ordering::SeqCst);
                        let body = &files[i].1;
                        let _ = write!(
                            stream,
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                            body.len()
                        );
                        let _ = stream.write_all(body);
                    }
                    None => {
                        let _ = stream.write_all(
                            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                        );
                    }
                }
            }
        });
        Origin { url, hits }
    }

    fn hits(&self, path: &str) -> usize {
        self.hits.iter().find(|(p, _)| p == path).map_or(0, |(_, n)| n.load(Ordering::SeqCst))
    }
}

fn config() -> String {
    config_with("python3")
}

/// The configuration, the runtime run by `python`.
fn config_with(python: &str) -> String {
    common::one_gpu(&models_with(python))
}

/// The models, keys and predictions settings, the runtime run by `python`.
fn models_with(python: &str) -> String {
    format!(
        r#"
[[models]]
key = "t/llm"
engine = {{ kind = "mock", preset = "fast" }}
size = "10GB"
min_replicas = 1
access = ["alice"]

[[models]]
key = "hangar/procedures"
engine = {{ kind = "procedures", python = "{python}" }}
size = "1GB"

[[api_keys]]
key = "sk-alice"
account = "alice"

[[api_keys]]
key = "sk-bob"
account = "bob"

[[api_keys]]
key = "sk-ops"
account = "ops"
admin = true

[predictions]
webhook_allow = ["127.0.0.1/32"]

[predictions.procedures]
runtime = "hangar/procedures"
"#
    )
}

/// Posts JSON as `key`: the status and the JSON answer.
fn post_as(url: &str, key: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
    let mut r = client().post(url).bearer_auth(key).json(body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().unwrap();
    (r.status().as_u16(), r.json().unwrap_or(Value::Null))
}

fn poll_as(url: &str, key: &str) -> Value {
    let t = Instant::now();
    loop {
        let (_, p) = get_as(url, Some(key));
        if !matches!(p["status"].as_str(), Some("starting" | "processing")) {
            return p;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "never ended: {p}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Fails, naming it, without `python3` on PATH.
fn needs_python3() {
    let python = std::process::Command::new("python3").arg("--version").output();
    assert!(
        python.is_ok_and(|o| o.status.success()),
        "python3 is needed on PATH to run the procedures runtime (the test does not skip without it)"
    );
}

#[test]
fn procedures_run_on_the_shared_runtime_and_call_the_servers_models_as_their_caller() {
    needs_python3();
    let origin = Origin::start(vec![
        ("/pipe.tar.gz", tar_gz(&[("predict.py", PIPE.as_bytes())])),
        ("/fails.tar.gz", tar_gz(&[("./predict.py", FAILS.as_bytes())])),
        (
            "/slow.tar.gz",
            tar_gz(&[("cog.yaml", b"predict: \"slow.py:predict\"\n"), ("slow.py", SLOW.as_bytes())]),
        ),
        ("/escape.tar.gz", tar_gz(&[("../evil.py", b"x")])),
        ("/zip.tar.gz", b"PK\x03\x04 not a tar.gz".to_vec()),
    ]);
    // Behind a proxy that answers nothing: the server, the runtime and the
    // procedure's own clients reach each other directly all the same.
    let s = common::serve_in_env(tempfile::tempdir().unwrap(), &config(), &[], &common::DEAD_PROXY);
    let procedures = format!("{}/v1/procedures", s.url);
    let create = |name: &str, path: &str| {
        post_as(
            &procedures,
            "sk-alice",
            &json!({"name": name, "source_url": format!("{}{path}", origin.url)}),
            &[],
        )
    };

    // Created: its source fetched and checked before the answer.
    let (status, p) = create("pipe", "/pipe.tar.gz");
    assert_eq!(status, 201, "{p}");
    assert_eq!((p["owner"].as_str(), p["ephemeral"].as_bool()), (Some("alice"), Some(false)), "{p}");
    assert_eq!(origin.hits("/pipe.tar.gz"), 1);

    // Another account's procedure does not exist for it.
    let (status, _) = get_as(&format!("{procedures}/alice/pipe"), Some("sk-bob"));
    assert_eq!(status, 404);
    let by_model = format!("{}/v1/models/alice/pipe/predictions", s.url);
    let (status, e) = post_as(&by_model, "sk-bob", &json!({"input": {}}), &[]);
    assert_eq!(status, 404, "{e}");

    // Run as `replicate.run("alice/pipe")` does: the model's predictions
    // route. The procedure calls `t/llm`, which only alice may use.
    let (status, run) = post_as(&by_model, "sk-alice", &json!({"input": {"prompt": "hello there"}}), &[]);
    assert_eq!(status, 201, "{run}");
    assert_eq!(run["model"], "alice/pipe", "{run}");
    let done = poll_as(run["urls"]["get"].as_str().unwrap(), "sk-alice");
    assert_eq!(done["status"], "succeeded", "{done}");
    // The runtime downloaded the archive from the gateway and ran it from
    // its own cache, under the archive's hash (the procedure's version).
    assert_eq!(done["output"]["cwd"], p["version"], "{done} {p}");
    let fetched =
        format!("fetched {} bytes from the gateway", tar_gz(&[("predict.py", PIPE.as_bytes())]).len());
    assert!(done["logs"].as_str().unwrap().contains(&fetched), "{done}");
    assert_eq!(done["output"]["chat_tokens"], 3, "{done}");
    assert_eq!(done["output"]["prediction"], "succeeded", "{done}");
    assert_eq!(done["output"]["prediction_tokens"], 3, "{done}");
    let logs = done["logs"].as_str().unwrap();
    assert!(logs.contains("pipeline for 'hello there'") && logs.contains("chat answered"), "{logs}");
    // Listed with alice's predictions.
    let (_, listed) = get_as(&format!("{}/v1/predictions", s.url), Some("sk-alice"));
    assert!(listed["results"].as_array().unwrap().iter().any(|p| p["id"] == run["id"]), "{listed}");
    // Bob cannot read alice's run.
    let (status, _) = get_as(run["urls"]["get"].as_str().unwrap(), Some("sk-bob"));
    assert_eq!(status, 404);

    // The second run, through the procedure's own route, uses the cache.
    let (status, again) = post_as(
        &format!("{procedures}/alice/pipe/predictions"),
        "sk-alice",
        &json!({"input": {"prompt": "again", "tokens": 2}}),
        &[("Prefer", "wait=60")],
    );
    assert_eq!(status, 201, "{again}");
    assert_eq!(again["status"], "succeeded", "{again}");
    assert_eq!(again["output"]["chat_tokens"], 2, "{again}");
    assert_eq!(origin.hits("/pipe.tar.gz"), 1, "the source was fetched once");
    assert!(again["logs"].as_str().unwrap().contains("from this runtime's cache"), "{again}");

    // A procedure that raises: the run fails with its error and logs.
    assert_eq!(create("fails", "/fails.tar.gz").0, 201);
    let (_, f) =
        post_as(&format!("{procedures}/alice/fails/predictions"), "sk-alice", &json!({"input": {}}), &[]);
    let f = poll_as(f["urls"]["get"].as_str().unwrap(), "sk-alice");
    assert_eq!(f["status"], "failed", "{f}");
    assert!(f["error"].as_str().unwrap().contains("ValueError: no way"), "{f}");
    assert!(f["logs"].as_str().unwrap().contains("about to fail"), "{f}");

    // Cancel while it runs (its entry point named by cog.yaml).
    assert_eq!(create("slow", "/slow.tar.gz").0, 201);
    let (_, r) =
        post_as(&format!("{procedures}/alice/slow/predictions"), "sk-alice", &json!({"input": {}}), &[]);
    let url = r["urls"]["get"].as_str().unwrap().to_owned();
    let t = Instant::now();
    while get_as(&url, Some("sk-alice")).1["output"].as_array().is_none_or(Vec::is_empty) {
        assert!(t.elapsed() < Duration::from_secs(60), "no output: {}", get_as(&url, Some("sk-alice")).1);
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, _) = post_as(r["urls"]["cancel"].as_str().unwrap(), "sk-alice", &json!({}), &[]);
    assert_eq!(status, 200);
    assert_eq!(poll_as(&url, "sk-alice")["status"], "canceled");

    // Bad sources are refused when created, naming what and where.
    let (status, e) = create("escape", "/escape.tar.gz");
    assert_eq!(status, 422, "{e}");
    let detail = e["detail"].as_str().unwrap();
    assert!(detail.contains("/escape.tar.gz") && detail.contains("`../evil.py` escapes"), "{e}");
    let (status, e) = create("zip", "/zip.tar.gz");
    assert_eq!(status, 422, "{e}");
    assert!(e["detail"].as_str().unwrap().contains("not a tar.gz"), "{e}");
    let (status, e) = post_as(
        &procedures,
        "sk-alice",
        &json!({"name": "meta", "source_url": "http://169.254.169.254/latest/p.tar.gz"}),
        &[],
    );
    assert_eq!(status, 400, "{e}");
    assert!(e["detail"].as_str().unwrap().starts_with("source_url:"), "{e}");

    // Counted in `/metrics` under the runtime, whose replicas ran them:
    // two succeeded, one failed, one canceled.
    let metrics = client().get(format!("{}/metrics", s.url)).send().unwrap().text().unwrap();
    let line = "hangar_requests_total{model=\"hangar/procedures\",kind=\"prediction\",status=\"200\"} 2";
    assert!(metrics.contains(line), "{metrics}");

    // Listed for its owner only; deleted, it no longer runs.
    let (_, mine) = get_as(&procedures, Some("sk-alice"));
    let names: Vec<&str> =
        mine["results"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["fails", "pipe", "slow"], "{mine}");
    assert_eq!(get_as(&procedures, Some("sk-bob")).1["results"], json!([]));
    let r = client().delete(format!("{procedures}/alice/pipe")).bearer_auth("sk-alice").send().unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let (status, _) = post_as(&by_model, "sk-alice", &json!({"input": {"prompt": "x"}}), &[]);
    assert_eq!(status, 404);
}

#[test]
fn the_official_replicate_client_runs_a_procedure_written_with_the_official_clients() {
    // The venv with the pinned `replicate` and `openai` (it fails, naming
    // what is missing, without python3).
    let python = common::python();
    let origin = Origin::start(vec![("/shout.tar.gz", tar_gz(&[("predict.py", SHOUT.as_bytes())]))]);
    let s = common::serve(&config_with(python.to_str().unwrap()));
    let (status, p) = post_as(
        &format!("{}/v1/procedures", s.url),
        "sk-alice",
        &json!({"name": "shout", "source_url": format!("{}/shout.tar.gz", origin.url), "ephemeral": true}),
        &[],
    );
    assert_eq!(status, 201, "{p}");
    assert!(p["expires_at"].is_string() && p["expired"] == false, "{p}");
    let hooks = common::predictions::receiver(0);
    let o = std::process::Command::new(&python)
        .args(["-c", CLIENT])
        .env("REPLICATE_BASE_URL", &s.url)
        .env("REPLICATE_API_TOKEN", "sk-alice")
        .env("HOOK", &hooks.url)
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "the client failed:\n{stdout}\n{stderr}\nserver log:\n{}", s.log());
    // The run's signed `completed` webhook, as a prediction's.
    let id = stdout.trim().to_owned();
    let ended = hooks.one_terminal_each(std::slice::from_ref(&id));
    assert_eq!(ended[&id], "succeeded");
    assert_eq!(origin.hits("/shout.tar.gz"), 1, "fetched once for the creation and both runs");
}

#[test]
fn a_fleets_gateways_share_procedures_and_an_agents_runtime_fetches_the_source_from_the_one_running_it() {
    let Some(redis) = hangar_redis::LocalRedis::for_test() else { return };
    needs_python3();
    let pipe = tar_gz(&[("predict.py", PIPE.as_bytes())]);
    let origin = Origin::start(vec![("/pipe.tar.gz", pipe.clone())]);
    let dir = tempfile::tempdir().unwrap();
    let (fleet, a) = common::fleet::gateway(dir.path(), &redis.url(), &models_with("python3"));
    let b = common::serve_in(tempfile::tempdir().unwrap(), &std::fs::read_to_string(&fleet).unwrap());
    let _agent = common::fleet::agent(dir.path(), &fleet, &redis.url(), "n0", 1);

    // Created through one gateway, the other knows it at once.
    let create_on = |gateway: &str| {
        let body = json!({"name": "pipe", "source_url": format!("{}/pipe.tar.gz", origin.url)});
        post_as(&format!("{gateway}/v1/procedures"), "sk-alice", &body, &[])
    };
    let (status, p) = create_on(&a.url);
    assert_eq!(status, 201, "{p}");
    let (status, seen) = get_as(&format!("{}/v1/procedures/alice/pipe", b.url), Some("sk-alice"));
    assert_eq!((status, &seen["version"]), (200, &p["version"]), "{seen}");
    let (status, _) = create_on(&b.url);
    assert_eq!(status, 409, "one registry: the name is taken on every gateway");

    // Run through the other gateway: the runtime, a replica on the agent's
    // node, downloads the archive from whichever gateway runs it.
    let by_model = format!("{}/v1/models/alice/pipe/predictions", b.url);
    for round in 0..2 {
        let (status, run) =
            post_as(&by_model, "sk-alice", &json!({"input": {"prompt": "fleet"}}), &[("Prefer", "wait=60")]);
        assert_eq!(status, 201, "{run}");
        let done = poll_as(run["urls"]["get"].as_str().unwrap(), "sk-alice");
        assert_eq!(done["status"], "succeeded", "round {round}: {done}\n{}", b.log());
        assert_eq!(
            (done["output"]["cwd"].as_str(), done["output"]["prediction"].as_str()),
            (p["version"].as_str(), Some("succeeded")),
            "{done}"
        );
        let logs = done["logs"].as_str().unwrap();
        let want = if round == 0 {
            format!("fetched {} bytes from the gateway", pipe.len())
        } else {
            "from this runtime's cache".to_owned()
        };
        assert!(logs.contains(&want), "round {round}: {logs}");
    }
    // The leader's status names each replica's node (the other's, null).
    let mut nodes = Vec::new();
    for g in [&a, &b] {
        let status = common::fleet::status_as(&g.url, Some("sk-ops"));
        let models = status["models"].as_array().unwrap().clone();
        let runtime = models.into_iter().find(|m| m["model"] == "hangar/procedures").unwrap();
        nodes.extend(
            runtime["replicas"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|r| r["node"].as_str().map(str::to_owned)),
        );
    }
    assert!(!nodes.is_empty() && nodes.iter().all(|n| n == "n0"), "the runtime runs on the agent: {nodes:?}");
    // Each gateway fetches from the origin at most once, and checks what it got
    // against the hash recorded at creation.
    assert!((1..=2).contains(&origin.hits("/pipe.tar.gz")), "{}", origin.hits("/pipe.tar.gz"));

    // Deleted through one gateway, it is gone on the other at once.
    let r = client()
        .delete(format!("{}/v1/procedures/alice/pipe", b.url))
        .bearer_auth("sk-alice")
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let (status, e) = post_as(
        &format!("{}/v1/models/alice/pipe/predictions", a.url),
        "sk-alice",
        &json!({"input": {}}),
        &[],
    );
    assert_eq!(status, 404, "{e}");
}
