//! LoRA adapters on a fleet: a Redis, a store registry, two nodes each
//! with its own weight store (a `hangar store serve` daemon known to the
//! registry) and agent, and two gateways. An adapter registered on one
//! node is served by the replicas of both, through either gateway: that
//! node makes its directory ahead of need, the other node's agent fetches
//! it from its peer when a request needs it, and each engine loads it
//! once for both gateways.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::fleet::{agent, status, wait_ready, Agent};
use common::predictions::client;
use common::{register_adapter, serve_in, start_store, Killed};
use hangar_redis::LocalRedis;
use hangar_store::{adapters, ArtifactId, BlobStore};
use serde_json::{json, Value};

/// A chat for `model` through `gateway`: its status and body.
fn chat(gateway: &str, model: &str) -> (u16, Value) {
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    let answer = client().post(format!("{gateway}/v1/chat/completions")).json(&body).send().unwrap();
    (answer.status().as_u16(), answer.json().unwrap_or(Value::Null))
}

/// Chats for `model` until the answer's status is `want` (10 s at most,
/// failing with `what`).
fn until_status(gateway: &str, model: &str, want: u16, what: &str) {
    let t = Instant::now();
    loop {
        let (status, body) = chat(gateway, model);
        if status == want {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{what}: still {status} {body}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `POST /v1/replicas/{replica}/adapters/hold` to the agent at `url`:
/// status and body.
fn hold(url: &str, replica: &str, body: &str) -> (u16, Value) {
    let answer = client()
        .post(format!("{url}/v1/replicas/{replica}/adapters/hold"))
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .unwrap();
    (answer.status().as_u16(), answer.json().unwrap_or(Value::Null))
}

/// The gateways holding `adapter` on the node's one replica, by its
/// agent's `/status`, sorted.
fn holders(agent: &Agent, adapter: &str) -> Vec<String> {
    let status = agent.status();
    let engines = status["adapters"].as_object().cloned().unwrap_or_default();
    let mut held: Vec<String> = engines
        .values()
        .flat_map(|e| e.as_array().cloned().unwrap_or_default())
        .filter(|a| a["adapter"] == adapter && a["loaded"] == true)
        .flat_map(|a| a["holders"].as_array().cloned().unwrap_or_default())
        .map(|h| h.as_str().unwrap().to_owned())
        .collect();
    held.sort();
    held
}

/// The node's adapter directory of `id`, if written.
fn exported(root: &Path, id: &ArtifactId) -> Option<PathBuf> {
    let dir = root.join(adapters::EXPORT_DIRS).join(id.file_name());
    dir.join(adapters::CONFIG_FILE).is_file().then_some(dir)
}

/// The adapter registered on node n0 only is served through both
/// gateways on both nodes' replicas (round robin sends requests to each):
/// n1's agent fetches the artifact from n0's daemon through the registry
/// and writes the directory its engine loads, the same files as n0's, and
/// each engine loads it once though both gateways' slots load it (a second
/// load of a name is refused by vLLM and the mock alike, so a gateway
/// posting its own would fail). An adapter registered on n1 while the
/// fleet runs is served within seconds, one removed from n0 stops being
/// served, and an unknown one is a 404. The agent refuses what it is asked
/// wrongly, naming what: a body that is not a hold (400), a replica it does
/// not run (404), an artifact that is another adapter or that no source
/// holds (502).
#[test]
fn an_adapter_registered_on_one_node_is_served_on_every_node() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (_registry, line) =
        start_store(&dir.path().join("registry"), &["registry", "--listen", "127.0.0.1:0"]);
    let registry = line.strip_prefix("registry at ").unwrap().to_owned();
    let roots: Vec<PathBuf> = ["n0", "n1"].iter().map(|n| dir.path().join(n).join("store")).collect();
    let a1 = register_adapter(&roots[0], "t/base:acme/a1", 1);
    let _daemons: Vec<Killed> = ["n0", "n1"]
        .iter()
        .zip(&roots)
        .map(|(node, root)| {
            std::fs::create_dir_all(root).unwrap();
            let socket = root.join("store.sock").display().to_string();
            let args = ["serve", "--socket", &socket, "--listen", "127.0.0.1:0", "--registry", &registry];
            let (daemon, line) = start_store(root, &[&args[..], &["--node", node]].concat());
            assert!(line.starts_with("serving"), "{line}");
            daemon
        })
        .collect();

    // `t/nolora`'s engine has no runtime LoRA API (llama.cpp's server, vLLM
    // without VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    let hangar = env!("CARGO_BIN_EXE_hangar");
    let models = format!(
        r#"
[[models]]
key = "t/base"
engine = {{ kind = "mock", preset = "instant" }}
size = "50GB"
min_replicas = 2
max_replicas = 2
router = "round-robin"
adapters = {{ slots = 2 }}

[[models]]
key = "t/nolora"
engine = {{ kind = "openai", command = "{hangar} engine mock --port {{port}} --host {{host}} --preset instant --model t/nolora --no-lora-api", readiness_path = "/health" }}
size = "10GB"
min_replicas = 1
max_replicas = 1
adapters = {{}}
"#
    );
    let fleet = format!("redis = \"{}\"\n{models}", redis.url());
    let gateways: Vec<_> = (0..2).map(|_| serve_in(tempfile::tempdir().unwrap(), &fleet)).collect();
    // Each agent's file names its own store root; n2, which joins once
    // `t/base` runs on n0 and n1 (one GPU each), takes `t/nolora`.
    let start = |name: &str| {
        let own = dir.path().join(name);
        std::fs::create_dir_all(&own).unwrap();
        let config = own.join("fleet.toml");
        let root = own.join("store");
        std::fs::write(&config, format!("{fleet}\n[store]\nroot = \"{}\"\n", root.display())).unwrap();
        agent(&own, &config, &redis.url(), name, 1)
    };
    let mut agents: Vec<Agent> = ["n0", "n1"].iter().map(|name| start(name)).collect();
    let urls: Vec<String> = gateways.iter().map(|g| g.url.clone()).collect();
    let placed = wait_ready(&urls[0], &[("t/base", 2)], None);
    let base_on_n0 = placed.iter().filter(|(m, n)| m == "t/base" && n == "n0").count();
    assert_eq!(base_on_n0, 1, "{placed:?}");
    agents.push(start("n2"));
    for g in &urls {
        wait_ready(g, &[("t/base", 2), ("t/nolora", 1)], None);
    }
    // Its agent's probe found no LoRA API and said so: shown, and refused
    // before it queues, on a gateway that runs none of the engines.
    for g in &urls {
        for m in status(g)["models"].as_array().unwrap() {
            let lora = m["model"] == "t/base";
            for r in m["replicas"].as_array().unwrap() {
                assert_eq!(r["capabilities"]["lora"], lora, "{}: {r}", m["model"]);
            }
        }
        let (status, body) = chat(g, "t/nolora:acme/a1");
        assert_eq!(status, 400, "{body}");
        assert!(body["error"]["message"].as_str().unwrap().contains("cannot load LoRA adapters"), "{body}");
    }

    // n0 makes the directory of its own store's adapter ahead of need; n1
    // fetches it from its peer only once a request needs it.
    let t = Instant::now();
    while exported(&roots[0], &a1).is_none() {
        assert!(t.elapsed() < Duration::from_secs(10), "n0 made no directory of acme/a1 ahead of need");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(exported(&roots[1], &a1).is_none(), "n1 fetched acme/a1 before any request");
    for g in &urls {
        until_status(g, "t/base:acme/a1", 200, "the adapter n0 registers is served");
    }
    for i in 0..12 {
        let (status, body) = chat(&urls[i % 2], "t/base:acme/a1");
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["model"], "t/base:acme/a1", "{body}");
    }
    let ids: Vec<String> =
        urls.iter().map(|g| status(g)["fleet"]["gateway"].as_str().unwrap().to_owned()).collect();
    for a in &agents[..2] {
        let loaded = a.log().matches("LoRA adapter loaded name=\"acme/a1\"").count();
        assert_eq!(loaded, 1, "node {}'s engine loads acme/a1 once for both gateways", a.name);
        let mut both = ids.clone();
        both.sort();
        assert_eq!(holders(a, "t/base:acme/a1"), both, "node {}", a.name);
    }
    // A gateway killed outright never releases: its holds go once it has
    // been gone from Redis's index of gateways past the agent's grace.
    let mut gateways = gateways;
    gateways.pop().unwrap().kill9();
    let t = Instant::now();
    for a in &agents[..2] {
        while holders(a, "t/base:acme/a1") != ids[..1] {
            assert!(t.elapsed() < Duration::from_secs(30), "node {}: {:?}", a.name, a.status()["adapters"]);
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let g = urls[0].as_str();
    let (here, fetched) = (exported(&roots[0], &a1), exported(&roots[1], &a1));
    let (here, fetched) =
        (here.expect("n0 loaded it"), fetched.expect("n1 fetched it from n0 and loaded it"));
    for file in [adapters::CONFIG_FILE, "adapter_model.safetensors"] {
        assert_eq!(
            std::fs::read(here.join(file)).unwrap(),
            std::fs::read(fetched.join(file)).unwrap(),
            "{file}"
        );
    }

    let (status, body) = chat(g, "t/base:acme/nope");
    assert_eq!(status, 404, "{body}");
    let a2 = register_adapter(&roots[1], "t/base:acme/a2", 2);
    until_status(g, "t/base:acme/a2", 200, "an adapter registered on n1 meanwhile is served");
    adapters::remove(&BlobStore::open(&roots[0]).unwrap(), &"t/base:acme/a1".parse().unwrap()).unwrap();
    until_status(g, "t/base:acme/a1", 404, "an adapter no node registers any more is not served");

    let n0 = &agents[0].url;
    let replica = agents[0].status()["report"]["replicas"][0]["replica"].as_str().unwrap().to_owned();
    let (status, body) = hold(n0, &replica, "{\"adapter\": 3}");
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("adapter"), "{body}");
    let asked = |adapter: &str, id: &ArtifactId| {
        format!(r#"{{"adapter": "{adapter}", "artifact": "{id}", "gateway": "gw-test", "slots": 1}}"#)
    };
    let (status, body) = hold(n0, &"0".repeat(32), &asked("t/base:acme/a2", &a2));
    assert_eq!(status, 404, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("does not serve on node n0"), "{body}");
    let (status, body) = hold(n0, &replica, &asked("t/base:acme/other", &a2));
    assert_eq!(status, 502, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&a2.to_string()) && message.contains("bound to adapter t/base:acme/a2"),
        "{body}"
    );
    let unknown: ArtifactId = format!("hg1:{}:{}", "07".repeat(32), "09".repeat(32)).parse().unwrap();
    let (status, body) = hold(n0, &replica, &asked("t/base:acme/nope", &unknown));
    assert_eq!(status, 502, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains(&unknown.to_string()), "{body}");
    let (status, body) = hold(n0, &replica, &asked("t/base:acme/a2", &a2));
    assert_eq!(status, 200, "{body}");
    assert!(exported(&roots[0], &a2).is_some(), "n0 fetched a2 from n1 for its engine");
}
