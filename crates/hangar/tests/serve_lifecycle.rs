//! `hangar serve`'s replica life cycle end to end, with real engine
//! processes: warm reuse, eviction to the warm cache and back, a crashed
//! engine, demand scaling, the admin API, queue switching and fairness.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{chat, one_gpu, post, serve, Serve};
use reqwest::blocking::Client;
use serde_json::{json, Value};

fn admin(url: &str, key: Option<&str>, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let client = Client::new();
    let mut r = match method {
        "GET" => client.get(format!("{url}{path}")),
        "PUT" => client.put(format!("{url}{path}")),
        "PATCH" => client.patch(format!("{url}{path}")),
        "DELETE" => client.delete(format!("{url}{path}")),
        _ => client.post(format!("{url}{path}")),
    };
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

/// The model's entry in `GET /admin/status`.
fn model_status(url: &str, key: Option<&str>, model: &str) -> Value {
    let (status, s) = admin(url, key, "GET", "/admin/status", None);
    assert_eq!(status, 200, "{s}");
    s["models"].as_array().unwrap().iter().find(|m| m["model"] == model).cloned().unwrap()
}

fn replicas(url: &str, key: Option<&str>, model: &str) -> Vec<Value> {
    model_status(url, key, model)["replicas"].as_array().unwrap().clone()
}

/// Sends two requests at once (as `key`) to `model`, whose replicas have
/// one permit each, and checks (as `admin_key`) the demand started a
/// second replica.
fn two_at_once_start_a_second_replica(
    url: &str,
    key: Option<&'static str>,
    admin_key: Option<&str>,
    model: &str,
) {
    let runs: Vec<_> = (0..2)
        .map(|_| {
            let (url, body) = (url.to_owned(), chat(model, 150));
            std::thread::spawn(move || post(&url, key, &body).0)
        })
        .collect();
    for r in runs {
        assert_eq!(r.join().unwrap(), 200);
    }
    eventually("demand started a second replica", || replicas(url, admin_key, model).len() == 2);
    // The server frees a permit when it has sent the last byte, which can
    // be a moment after the client read it: wait, so what follows sees an
    // idle model.
    eventually("the requests gave back their permits", || {
        model_status(url, admin_key, model)["permits"]["used"] == 0
    });
}

/// Waits until `/metrics` holds every one of `lines` (ten seconds at most).
fn assert_metrics(url: &str, lines: &[&str]) {
    // A request is counted when its answer's body ends, which may be a
    // moment after its client has read the last byte.
    let start = Instant::now();
    loop {
        let metrics = Client::new().get(format!("{url}/metrics")).send().unwrap().text().unwrap();
        let missing: Vec<&&str> = lines.iter().filter(|line| !metrics.contains(**line)).collect();
        if missing.is_empty() {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "missing {missing:?} in\n{metrics}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Polls `check` until it holds, failing after ten seconds.
fn eventually(what: &str, check: impl FnMut() -> bool) {
    eventually_within(what, Duration::from_secs(10), check)
}

/// Waits until `check` holds, failing after `limit` (a hang, not a speed
/// check).
fn eventually_within(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < limit, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One 80 GB GPU that two 60 GB models take turns on, with a warm cache
/// and no minimum age, so a model's start evicts the other at once.
const ONE_GPU_AND_WARM_CACHE: &str = r#"
[placement]
min_deployment_age_ms = 0

[[nodes]]
id = "local"
gpus = 1
gpu_memory = "80GB"
virtual_gpus = true
cpu_cache = "200GB"
"#;

/// A server where `t/a` and `t/b` (fast mock engines that sleep, 60 GB
/// each) take turns on [`ONE_GPU_AND_WARM_CACHE`]'s GPU.
fn two_models_taking_turns() -> Serve {
    serve(&format!(
        r#"{ONE_GPU_AND_WARM_CACHE}
[[models]]
key = "t/a"
engine = {{ kind = "mock", preset = "fast" }}
size = "60GB"

[[models]]
key = "t/b"
engine = {{ kind = "mock", preset = "fast" }}
size = "60GB"
"#
    ))
}

/// [`ONE_GPU_AND_WARM_CACHE`] with a weight store (in the temporary
/// directory returned, removed when dropped) in which each of `adapters`
/// (`BASE:NAME`) is registered.
fn with_adapters(adapters: &[&str]) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    for (seed, adapter) in adapters.iter().enumerate() {
        common::register_adapter(&store, adapter, seed as u64 + 1);
    }
    let head = format!("{ONE_GPU_AND_WARM_CACHE}\n[store]\nroot = \"{}\"\n", store.display());
    (dir, head)
}

#[test]
fn a_replica_is_reused_evicted_to_the_warm_cache_and_woken_again() {
    let s = two_models_taking_turns();
    assert_eq!(post(&s.url, None, &chat("t/a", 2)).0, 200, "cold start");
    let first = replicas(&s.url, None, "t/a");
    assert_eq!(first.len(), 1);
    assert_eq!((first[0]["level"].as_str(), first[0]["state"].as_str()), (Some("HOT"), Some("ready")));
    assert!(first[0]["name"].as_str().unwrap().starts_with("t/a:"), "{first:?}");

    assert_eq!(post(&s.url, None, &chat("t/a", 2)).0, 200);
    let again = replicas(&s.url, None, "t/a");
    assert_eq!((again.len(), &again[0]["pid"]), (1, &first[0]["pid"]), "the warm replica served again");

    // Both do not fit on the GPU: t/b's start evicts t/a to the warm cache.
    assert_eq!(post(&s.url, None, &chat("t/b", 2)).0, 200);
    let a = replicas(&s.url, None, "t/a");
    assert_eq!((a[0]["level"].as_str(), a[0]["state"].as_str()), (Some("WARM"), Some("sleeping")), "{a:?}");
    assert_eq!(replicas(&s.url, None, "t/b")[0]["level"], "HOT");

    // And back: t/a wakes in the same process, t/b goes to sleep.
    assert_eq!(post(&s.url, None, &chat("t/a", 2)).0, 200);
    let a = replicas(&s.url, None, "t/a");
    assert_eq!((a.len(), a[0]["level"].as_str(), a[0]["state"].as_str()), (1, Some("HOT"), Some("ready")));
    assert_eq!((&a[0]["id"], &a[0]["pid"]), (&first[0]["id"], &first[0]["pid"]), "woken, not restarted");
    assert_eq!(replicas(&s.url, None, "t/b")[0]["state"], "sleeping");
}

/// An engine that sleeps keeps the LoRA adapters it loaded (vLLM and the
/// mock engine alike), while the adapter slots of a replica that slept
/// start empty when it wakes: the slots' load after the wake must not be
/// posted to an engine that has the adapter (it refuses "already loaded"),
/// and is not — the engine's adapters are held per engine. So a request
/// for the adapter after a sleep and a wake is answered, and the engine
/// loaded the adapter once.
#[test]
fn an_adapter_loaded_before_its_engine_slept_serves_after_it_wakes() {
    let (_store, head) = with_adapters(&["t/a:acme/x"]);
    let s = serve(&format!(
        r#"{head}
[[models]]
key = "t/a"
engine = {{ kind = "mock", preset = "fast" }}
size = "60GB"
router = "adapter"
adapters = {{ slots = 2 }}

[[models]]
key = "t/b"
engine = {{ kind = "mock", preset = "fast" }}
size = "60GB"
"#
    ));
    let (status, body) = post(&s.url, None, &chat("t/a:acme/x", 2));
    assert_eq!(status, 200, "{body}");
    let first = replicas(&s.url, None, "t/a");
    assert_eq!(post(&s.url, None, &chat("t/b", 2)).0, 200);
    assert_eq!(replicas(&s.url, None, "t/a")[0]["state"], "sleeping");
    let (status, body) = post(&s.url, None, &chat("t/a:acme/x", 2));
    assert_eq!(status, 200, "after the wake: {body}");
    assert_eq!(body["model"], "t/a:acme/x", "{body}");
    let a = replicas(&s.url, None, "t/a");
    assert_eq!((&a[0]["id"], &a[0]["pid"]), (&first[0]["id"], &first[0]["pid"]), "woken, not restarted");
    let loads = s.log().matches("LoRA adapter loaded name=\"acme/x\"").count();
    assert_eq!(loads, 1, "the engine kept the adapter through its sleep");
}

/// An engine without a sleep API (as llama.cpp's server) is stopped when
/// placement sends its replica to the warm cache — never a WARM replica
/// whose process keeps its memory — and starts afresh (COLD) when wanted
/// again; one with vLLM's sleeps and wakes as before. `/admin/status`
/// shows what each engine can do.
#[test]
fn an_engine_that_cannot_sleep_is_stopped_rather_than_kept_warm() {
    let hangar = env!("CARGO_BIN_EXE_hangar");
    let s = serve(&format!(
        r#"{ONE_GPU_AND_WARM_CACHE}
[[models]]
key = "t/nosleep"
engine = {{ kind = "openai", command = "{hangar} engine mock --port {{port}} --preset fast --model t/nosleep --no-sleep --no-lora-api", readiness_path = "/health" }}
size = "60GB"

[[models]]
key = "t/b"
engine = {{ kind = "mock", preset = "fast" }}
size = "60GB"
"#
    ));
    assert_eq!(post(&s.url, None, &chat("t/nosleep", 2)).0, 200, "cold start");
    let first = replicas(&s.url, None, "t/nosleep");
    assert_eq!(
        first[0]["capabilities"],
        json!({"sleep": null, "metrics": true, "slots": false, "lora": false}),
        "{first:?}"
    );

    // t/b's start sends t/nosleep to the warm cache: it is stopped instead.
    assert_eq!(post(&s.url, None, &chat("t/b", 2)).0, 200);
    let b = replicas(&s.url, None, "t/b");
    assert_eq!(
        (&b[0]["capabilities"]["sleep"], &b[0]["capabilities"]["lora"]),
        (&json!("vllm"), &json!(true))
    );
    eventually("the engine that cannot sleep was stopped", || replicas(&s.url, None, "t/nosleep").is_empty());

    // Wanted again: a fresh engine (COLD), and t/b goes to sleep.
    assert_eq!(post(&s.url, None, &chat("t/nosleep", 2)).0, 200);
    let again = replicas(&s.url, None, "t/nosleep");
    assert_eq!((again.len(), again[0]["state"].as_str()), (1, Some("ready")));
    assert_ne!(again[0]["pid"], first[0]["pid"], "started afresh");
    assert_eq!(replicas(&s.url, None, "t/b")[0]["state"], "sleeping");
    // Placement learned from the first start that t/nosleep's engine cannot
    // sleep, so it sent it straight out (COLD) rather than to the warm cache.
    let status = model_status(&s.url, None, "t/nosleep");
    assert_eq!(status["replicas"].as_array().unwrap().len(), 1, "{status}");
}

/// A server on one GPU with one replica of `model` (a mock engine), that
/// replica as listed, and its engine's process.
fn one_replica(model: &str) -> (Serve, Value, rustix::process::Pid) {
    let s = serve(&one_gpu(&format!(
        r#"
[[models]]
key = "{model}"
engine = {{ kind = "mock", preset = "default" }}
size = "10GB"
min_replicas = 1
"#
    )));
    let replica = replicas(&s.url, None, model).remove(0);
    let pid = rustix::process::Pid::from_raw(replica["pid"].as_u64().unwrap() as i32).unwrap();
    (s, replica, pid)
}

#[test]
fn a_crashed_engine_is_replaced_and_its_requests_retried_or_ended() {
    let (s, before, pid) = one_replica("t/crash");
    let url = s.url.clone();
    let plain = std::thread::spawn(move || post(&url, None, &chat("t/crash", 300)));
    let url = s.url.clone();
    let streamed = std::thread::spawn(move || {
        let mut body = chat("t/crash", 300);
        body["stream"] = json!(true);
        let r = Client::new().post(format!("{url}/v1/chat/completions")).json(&body).send().unwrap();
        (r.status().as_u16(), r.text().unwrap_or_default())
    });
    eventually("both requests run", || model_status(&s.url, None, "t/crash")["permits"]["used"] == 2);
    std::thread::sleep(Duration::from_millis(200));
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();

    let (status, r) = plain.join().unwrap();
    assert_eq!(status, 200, "the non-streaming request was retried on the new replica: {r}");
    assert_eq!(r["usage"]["completion_tokens"], 300);
    let (status, text) = streamed.join().unwrap();
    assert_eq!(status, 200);
    assert!(text.contains("\"error\"") && text.contains("failed while answering"), "{text}");
    assert!(!text.contains("[DONE]"), "a cut-off stream does not claim to be complete");

    let after = replicas(&s.url, None, "t/crash");
    assert_eq!(after.len(), 1, "{after:?}");
    assert_ne!(after[0]["pid"], before["pid"]);
    assert_ne!(after[0]["id"], before["id"]);
    assert_metrics(&s.url, &["hangar_replica_failures_total{model=\"t/crash\"} 1"]);
}

/// An engine that hangs (SIGSTOP: alive, answering nothing, as one wedged
/// on its GPU) is found by its health checks, killed and replaced; a
/// request that had received nothing from it is retried on the new
/// replica (within 10 s here: three failed checks and the restart), not
/// left to wait out its timeout (504).
#[test]
fn a_hung_engine_is_replaced_and_its_waiting_request_retried() {
    let (s, before, pid) = one_replica("t/hang");
    let url = s.url.clone();
    let plain = std::thread::spawn(move || post(&url, None, &chat("t/hang", 50)));
    eventually("the request runs", || model_status(&s.url, None, "t/hang")["permits"]["used"] == 1);
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();

    let (status, r) = plain.join().unwrap();
    // Let the stopped process go whatever happened, so no test leaves it.
    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    assert_eq!(status, 200, "the request was retried on the new replica: {r}");
    assert_eq!(r["usage"]["completion_tokens"], 50);
    let after = replicas(&s.url, None, "t/hang");
    assert_eq!(after.len(), 1, "{after:?}");
    assert_ne!(after[0]["id"], before["id"]);
    assert_metrics(&s.url, &["hangar_replica_failures_total{model=\"t/hang\"} 1"]);
}

/// An engine that hangs asleep in the warm cache is found by its health
/// checks (its sleep API's state route) and killed: the replica is cold,
/// counted as a failure, and a request for its model starts a fresh one
/// rather than waiting on a wake that would never answer.
#[test]
fn a_hung_sleeping_engine_is_killed_and_its_model_started_afresh() {
    let s = two_models_taking_turns();
    assert_eq!(post(&s.url, None, &chat("t/a", 2)).0, 200);
    // t/b's start evicts t/a to the warm cache, where its engine hangs.
    assert_eq!(post(&s.url, None, &chat("t/b", 2)).0, 200);
    let a = replicas(&s.url, None, "t/a").remove(0);
    assert_eq!(a["state"], "sleeping", "{a:?}");
    let pid = a["pid"].as_u64().unwrap();
    // A sleeping engine that answers passes its checks: still asleep after
    // more of them than make a failure.
    std::thread::sleep(Duration::from_secs(5));
    let still = replicas(&s.url, None, "t/a");
    assert_eq!(
        (still[0]["state"].as_str(), still[0]["pid"].as_u64()),
        (Some("sleeping"), Some(pid)),
        "{still:?}"
    );
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::STOP,
    )
    .unwrap();
    let proc = std::path::PathBuf::from(format!("/proc/{pid}"));
    // Three failed checks, each given 2 s, a second apart.
    eventually_within("the hung sleeping engine is killed", Duration::from_secs(30), || !proc.exists());

    let (status, r) = post(&s.url, None, &chat("t/a", 2));
    assert_eq!(status, 200, "{r}");
    let a = replicas(&s.url, None, "t/a");
    assert_eq!((a.len(), a[0]["state"].as_str()), (1, Some("ready")), "{a:?}");
    assert_ne!(a[0]["pid"].as_u64(), Some(pid), "a fresh engine, not the hung one");
    assert_metrics(&s.url, &["hangar_replica_failures_total{model=\"t/a\"} 1"]);
}

/// A replica whose engine fails every request while its health checks
/// pass (a black hole: it answers 500 at once, so least-outstanding would
/// send it most requests) is chosen last after a streak of server errors:
/// the requests after go to the replica that serves.
#[test]
fn a_replica_that_fails_every_request_is_chosen_last() {
    let hangar = env!("CARGO_BIN_EXE_hangar");
    let dir = tempfile::tempdir().unwrap();
    let fail = dir.path().display();
    let s = serve(&one_gpu(&format!(
        r#"
[[models]]
key = "t/bh"
engine = {{ kind = "openai", command = "{hangar} engine mock --port {{port}} --preset fast --model t/bh --fail-while {fail}/fail-{{port}}", readiness_path = "/health" }}
size = "10GB"
min_replicas = 2
"#
    )));
    let ready = common::ready_replicas(&s.url, 2);
    let url = ready[0]["url"].as_str().unwrap_or_else(|| panic!("{ready:?}"));
    let port = url.rsplit(':').next().unwrap().trim_end_matches('/');
    std::fs::write(dir.path().join(format!("fail-{port}")), b"").unwrap();

    let (clients, each) = (4, 15);
    let statuses: Vec<u16> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..clients)
            .map(|_| {
                scope.spawn(|| (0..each).map(|_| post(&s.url, None, &chat("t/bh", 2)).0).collect::<Vec<_>>())
            })
            .collect();
        threads.into_iter().flat_map(|t| t.join().unwrap()).collect()
    });
    let failed = statuses.iter().filter(|s| **s == 500).count();
    assert_eq!(failed + statuses.iter().filter(|s| **s == 200).count(), clients * each, "{statuses:?}");
    // The streak, and at most one more from each other client whose request
    // was already on its way there when the streak ended.
    let most = hangar_router::FAILING_STREAK as usize + clients - 1;
    assert!(failed <= most, "{failed} of {} requests failed (at most {most}): {statuses:?}", statuses.len());
    assert!(failed >= 1, "the failing replica was never tried: {statuses:?}");
    // The streak is counted for the operator: once (at most 8 failures
    // make no second one).
    assert_metrics(&s.url, &["hangar_failing_streaks_total{model=\"t/bh\"} 1\n"]);
}

/// A request whose adapter is loading on a replica whose engine dies
/// meanwhile is not answered 502: nothing was sent to the engine, so it
/// asks again and is served by the replica started in the dead one's place
/// (`hangar bench chaos` found adapter requests failed so on a fleet). So
/// is a queued request (Workers AI's `queueRequest`), which runs through
/// the predictions' executor.
#[test]
fn a_request_whose_adapters_engine_dies_mid_load_is_served_by_the_next_replica() {
    let (_store, head) = with_adapters(&["t/a:acme/x", "t/a:acme/y"]);
    let hangar = env!("CARGO_BIN_EXE_hangar");
    let s = serve(&format!(
        r#"{head}
[[models]]
key = "t/a"
engine = {{ kind = "openai", command = "{hangar} engine mock --port {{port}} --preset fast --model t/a --lora-load-ms 1500", readiness_path = "/health" }}
size = "60GB"
min_replicas = 1
adapters = {{ slots = 2 }}
use_async_queue = true
"#
    ));
    // Kills the replica's engine once a request's permit is held while its
    // adapter loads (1.5 s); the engine's pid.
    let kill_mid_load = |s: &common::Serve| {
        eventually("a request waits for its adapter", || {
            model_status(&s.url, None, "t/a")["permits"]["used"] == 1
        });
        std::thread::sleep(Duration::from_millis(300));
        let pid = replicas(&s.url, None, "t/a")[0]["pid"].as_u64().unwrap();
        let target = rustix::process::Pid::from_raw(pid as i32).unwrap();
        rustix::process::kill_process(target, rustix::process::Signal::KILL).unwrap();
        pid
    };
    let url = s.url.clone();
    let asked = std::thread::spawn(move || post(&url, None, &chat("t/a:acme/x", 2)));
    let killed = kill_mid_load(&s);
    let (status, body) = asked.join().unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "t/a:acme/x", "{body}");
    let after = replicas(&s.url, None, "t/a");
    assert_ne!(after[0]["pid"], json!(killed), "served by the replica started in the dead one's place");

    let mut queued = chat("t/a:acme/y", 2);
    queued["options"] = json!({"queueRequest": true});
    let url = s.url.clone();
    let asked = std::thread::spawn(move || post(&url, None, &queued));
    kill_mid_load(&s);
    let (mut status, mut body) = asked.join().unwrap();
    let started = std::time::Instant::now();
    while status == 202 && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
        let id = body["request_id"].as_str().unwrap().to_owned();
        (status, body) = post(&s.url, None, &json!({"model": "t/a:acme/y", "inputs": {"request_id": id}}));
    }
    assert_eq!(status, 200, "the queued request ran on the next replica: {body}");
    assert_eq!(body["model"], "t/a:acme/y", "{body}");
}

#[test]
fn a_client_that_leaves_mid_answer_cancels_the_engine_request_and_frees_its_permit() {
    let s = serve(&one_gpu(
        r#"
[[models]]
key = "t/leave"
engine = { kind = "mock", preset = "default" }
size = "10GB"
min_replicas = 1
"#,
    ));
    let mut body = chat("t/leave", 2000);
    body["stream"] = json!(true);
    let mut r = Client::new().post(format!("{}/v1/chat/completions", s.url)).json(&body).send().unwrap();
    let mut first = [0u8; 64];
    std::io::Read::read(&mut r, &mut first).unwrap();
    assert_eq!(model_status(&s.url, None, "t/leave")["permits"]["used"], 1);
    drop(r);
    eventually("the permit is back", || model_status(&s.url, None, "t/leave")["permits"]["used"] == 0);
    let engine = replicas(&s.url, None, "t/leave")[0]["url"].as_str().unwrap().to_owned();
    eventually("the engine aborted the request", || {
        let metrics = Client::new().get(format!("{engine}/metrics")).send().unwrap().text().unwrap();
        metrics.lines().any(|l| l == "hangar_mock_requests_aborted_total 1")
    });
}

const KEYS: &str = r#"
[[nodes]]
id = "local"
gpus = 2
gpu_memory = "80GB"
virtual_gpus = true
cpu_cache = "64GB"

[[api_keys]]
key = "sk-root"
account = "ops"
admin = true

[[api_keys]]
key = "sk-a"
account = "a"

[[api_keys]]
key = "sk-b"
account = "b"
"#;

#[test]
fn switching_to_a_fair_queue_keeps_every_waiter_and_interleaves_accounts() {
    let s = serve(&format!(
        r#"{KEYS}
[[models]]
key = "t/one"
engine = {{ kind = "mock", preset = "default" }}
size = "10GB"
min_replicas = 1
concurrency = 1
queue = {{ algorithm = "fifo", capacity = 10 }}
"#
    ));
    let root = Some("sk-root");
    let waiting = |url: &str| model_status(url, root, "t/one")["queue"]["waiting"].as_u64().unwrap();
    let url = s.url.clone();
    let holder = std::thread::spawn(move || post(&url, Some("sk-a"), &chat("t/one", 150)).0);
    eventually("the holder runs", || model_status(&s.url, root, "t/one")["permits"]["used"] == 1);

    // A client that gives up leaves the line at once.
    let gone = Client::builder().timeout(Duration::from_millis(200)).build().unwrap();
    let r = gone.post(format!("{}/v1/chat/completions", s.url)).bearer_auth("sk-b").json(&chat("t/one", 1));
    assert!(r.send().is_err());
    eventually("the disconnected request leaves the line", || waiting(&s.url) == 0);

    let order = Arc::new(Mutex::new(Vec::new()));
    let mut threads = Vec::new();
    for (i, (name, key)) in
        [("a1", "sk-a"), ("a2", "sk-a"), ("a3", "sk-a"), ("b1", "sk-b")].into_iter().enumerate()
    {
        let (url, order) = (s.url.clone(), order.clone());
        threads.push(std::thread::spawn(move || {
            let (status, r) = post(&url, Some(key), &chat("t/one", 10));
            assert_eq!(status, 200, "{r}");
            order.lock().unwrap().push(name);
        }));
        eventually("the request queues", || waiting(&s.url) == i as u64 + 1);
    }
    let (status, r) =
        admin(&s.url, root, "PUT", "/admin/models/t/one/queue", Some(json!({"algorithm": "fair"})));
    assert_eq!(status, 200, "{r}");
    assert_eq!(model_status(&s.url, root, "t/one")["queue"]["algorithm"], "fair");
    assert_eq!(waiting(&s.url), 4, "nobody was lost by the switch");
    // A line that holds nobody, or more than seed 001's 1,000, is refused.
    for capacity in [0, 1001] {
        let body = Some(json!({"capacity": capacity}));
        let (status, r) = admin(&s.url, root, "PUT", "/admin/models/t/one/queue", body);
        assert_eq!(status, 400, "{r}");
        assert_eq!(r["error"]["param"], "capacity", "{r}");
    }
    assert_eq!(waiting(&s.url), 4, "a refused switch changes nothing");
    assert_eq!(holder.join().unwrap(), 200);
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(*order.lock().unwrap(), ["a1", "b1", "a2", "a3"], "accounts take turns");
}

/// A deployment made through Replicate's API (`POST /v1/deployments`)
/// runs its model between its bounds: a minimum of 2 starts two replicas
/// of an idle model, an update lowers them, and a delete gives the model
/// its own bounds (0 to 2) back, which the controller shows.
#[test]
fn a_deployment_made_through_the_api_runs_its_model_between_its_bounds() {
    let s = serve(&format!(
        r#"{KEYS}
[[models]]
key = "t/dep"
engine = {{ kind = "mock", preset = "fast" }}
size = "10GB"
max_replicas = 2

[predictions]
"#
    ));
    let root = Some("sk-root");
    let hot = |url: &str| {
        replicas(url, root, "t/dep").iter().filter(|r| r["level"] == "HOT" && r["state"] == "ready").count()
    };
    let bounds = |url: &str| model_status(url, root, "t/dep")["scaling"]["bounds"].clone();
    assert_eq!(bounds(&s.url), json!({"min": 0, "max": 2}));
    let (_, model) = admin(&s.url, Some("sk-a"), "GET", "/v1/models/t/dep", None);
    let version = model["latest_version"]["id"].as_str().unwrap().to_owned();
    let body = json!({"name": "live", "model": "t/dep", "version": version, "hardware": "gpu",
                      "min_instances": 2, "max_instances": 2});
    let (status, made) = admin(&s.url, Some("sk-a"), "POST", "/v1/deployments", Some(body));
    assert_eq!(status, 201, "{made}");
    assert_eq!(bounds(&s.url), json!({"min": 2, "max": 2}), "applied before the answer");
    eventually("two replicas are up for the deployment's minimum", || hot(&s.url) == 2);

    let path = "/v1/deployments/a/live";
    let (status, updated) = admin(&s.url, Some("sk-a"), "PATCH", path, Some(json!({"min_instances": 1})));
    assert_eq!(status, 200, "{updated}");
    assert_eq!(bounds(&s.url), json!({"min": 1, "max": 2}));
    assert_eq!(admin(&s.url, Some("sk-a"), "DELETE", path, None).0, 204);
    assert_eq!(bounds(&s.url), json!({"min": 0, "max": 2}), "the model's own bounds again");
}

#[test]
fn the_admin_api_scales_and_evicts_and_metrics_and_probes_report() {
    let s = serve(&format!(
        r#"{KEYS}
[[models]]
key = "t/scale"
engine = {{ kind = "mock", preset = "default" }}
size = "10GB"
concurrency = 1
max_replicas = 2
"#
    ));
    let root = Some("sk-root");
    assert_eq!(admin(&s.url, None, "GET", "/admin/status", None).0, 401);
    let (status, r) = admin(&s.url, Some("sk-a"), "GET", "/admin/status", None);
    assert_eq!(status, 403, "{r}");
    assert_eq!(Client::new().get(format!("{}/healthz", s.url)).send().unwrap().status(), 200);
    assert_eq!(Client::new().get(format!("{}/readyz", s.url)).send().unwrap().status(), 200);

    // Demand: two requests at once on one-permit replicas start a second.
    two_at_once_start_a_second_replica(&s.url, Some("sk-a"), root, "t/scale");

    let path = "/admin/models/t/scale/scaling";
    let (status, r) = admin(&s.url, root, "POST", path, Some(json!({"action": "pin", "replicas": 3})));
    assert_eq!(status, 400, "{r}");
    assert!(r["error"]["message"].as_str().unwrap().contains("outside the model's bounds (0 to 2)"), "{r}");
    let (status, r) = admin(&s.url, root, "POST", path, Some(json!({"action": "pin", "replicas": "two"})));
    assert_eq!(status, 400);
    assert!(r["error"]["message"].as_str().unwrap().contains("replicas"), "{r}");
    let (status, r) = admin(&s.url, root, "POST", path, Some(json!({"action": "grow"})));
    assert_eq!(status, 400, "{r}");
    let (status, r) = admin(&s.url, root, "POST", path, Some(json!({"action": "pin", "replicas": 1})));
    assert_eq!((status, &r["desired_replicas"]), (200, &json!(1)), "{r}");
    let now = replicas(&s.url, root, "t/scale");
    let hot: Vec<&Value> = now.iter().filter(|r| r["level"] == "HOT").collect();
    assert_eq!(hot.len(), 1, "pinned to one hot replica: {now:?}");
    let scaling = &model_status(&s.url, root, "t/scale")["scaling"];
    assert_eq!(scaling["override"], json!({"mode": "pinned", "replicas": 1}), "{scaling}");
    let last = scaling["decisions"].as_array().unwrap().last().unwrap().clone();
    assert_eq!((&last["desired"], &last["reason"]), (&json!(1), &json!("pinned by an operator")), "{last}");
    let (status, _) = admin(&s.url, root, "POST", path, Some(json!({"action": "unfreeze"})));
    assert_eq!(status, 200);
    assert_eq!(model_status(&s.url, root, "t/scale")["scaling"]["override"], Value::Null);

    let name = hot[0]["name"].as_str().unwrap().to_owned();
    let (status, r) = admin(&s.url, root, "POST", "/admin/evict", Some(json!({"replica": name})));
    assert_eq!((status, &r["evicted"]), (200, &json!(1)), "{r}");
    // Placement answers at once; the engine goes to sleep in the background.
    eventually("both replicas are asleep in the warm cache", || {
        let warm = replicas(&s.url, root, "t/scale");
        warm.len() == 2 && warm.iter().all(|r| r["level"] == "WARM" && r["state"] == "sleeping")
    });
    let (status, _) = admin(&s.url, root, "POST", "/admin/evict", Some(json!({"model": "t/none"})));
    assert_eq!(status, 404);
    let (status, _) = admin(&s.url, root, "POST", "/admin/evict", Some(json!({"replica": "t/scale:zz"})));
    assert_eq!(status, 400);
    assert_eq!(post(&s.url, Some("sk-b"), &chat("t/scale", 2)).0, 200, "an evicted model comes back");

    assert_metrics(
        &s.url,
        &[
            "hangar_requests_total{model=\"t/scale\",kind=\"sync\",status=\"200\"} 3",
            "hangar_replicas{model=\"t/scale\",state=\"ready\"} 1",
            "hangar_permits{model=\"t/scale\"} 1",
            "hangar_queue_depth{model=\"t/scale\"} 0",
            "hangar_replica_in_flight{model=\"t/scale\",replica=\"t/scale:",
            "hangar_request_duration_seconds_count{model=\"t/scale\",kind=\"sync\"} 3",
            "hangar_time_to_first_token_seconds_count{model=\"t/scale\",kind=\"sync\"} 3",
        ],
    );
}

#[test]
fn the_kv_router_sends_a_prompt_back_to_the_replica_that_has_its_prefix() {
    let s = serve(&one_gpu(
        r#"
[[models]]
key = "t/kv"
engine = { kind = "mock", preset = "fast" }
size = "10GB"
min_replicas = 2
router = "kv"
kv = { block_chars = 16 }
"#,
    ));
    let prompt = |topic: &str, max_tokens: u32| {
        let system = format!("You are an assistant who only ever talks about {topic}, at length. ");
        json!({"model": "t/kv", "max_tokens": max_tokens,
               "messages": [{"role": "system", "content": system.repeat(8)}, {"role": "user", "content": "Go on."}]})
    };
    // Two conversations start at once, so they land on different replicas.
    let url = s.url.clone();
    let first = std::thread::spawn(move || post(&url, None, &prompt("boats", 300)).0);
    eventually("the first runs", || model_status(&s.url, None, "t/kv")["permits"]["used"] == 1);
    assert_eq!(post(&s.url, None, &prompt("trains", 5)).0, 200);
    assert_eq!(first.join().unwrap(), 200);
    // Their next turns follow their cached prefixes, not the lowest id.
    for _ in 0..3 {
        assert_eq!(post(&s.url, None, &prompt("boats", 5)).0, 200);
        assert_eq!(post(&s.url, None, &prompt("trains", 5)).0, 200);
    }
    let served: Vec<u64> = replicas(&s.url, None, "t/kv")
        .iter()
        .map(|r| {
            let metrics = Client::new()
                .get(format!("{}/metrics", r["url"].as_str().unwrap()))
                .send()
                .unwrap()
                .text()
                .unwrap();
            let line = metrics.lines().find(|l| l.starts_with("hangar_mock_requests_total")).unwrap();
            line.rsplit(' ').next().unwrap().parse().unwrap()
        })
        .collect();
    assert_eq!(served, [4, 4], "each conversation stayed on its replica");
}

#[test]
fn a_quiet_model_gives_back_its_replicas_and_wakes_on_the_next_request() {
    let s = serve(&one_gpu(
        r#"cpu_cache = "64GB"

[[models]]
key = "t/quiet"
engine = { kind = "mock", preset = "fast" }
size = "10GB"
concurrency = 1
max_replicas = 2
scaling = { policy = "hangar", scale_down_after_s = 1 }
"#,
    ));
    two_at_once_start_a_second_replica(&s.url, None, None, "t/quiet");
    let busy = replicas(&s.url, None, "t/quiet");
    let scaling = &model_status(&s.url, None, "t/quiet")["scaling"];
    assert_eq!(scaling["policy"], "hangar", "{scaling}");

    // No request for the quiet period: both go to the warm cache (min_replicas = 0).
    eventually("the quiet model scaled to zero", || {
        let now = replicas(&s.url, None, "t/quiet");
        now.len() == 2 && now.iter().all(|r| r["level"] == "WARM" && r["state"] == "sleeping")
    });
    let decisions = model_status(&s.url, None, "t/quiet")["scaling"]["decisions"].clone();
    let last = decisions.as_array().unwrap().last().unwrap();
    assert_eq!(last["desired"], 0, "{decisions}");
    assert!(last["reason"].as_str().unwrap().contains("quiet period over"), "{decisions}");
    assert_metrics(&s.url, &["hangar_scale_decisions_total{model=\"t/quiet\",direction=\"down\"}"]);

    assert_eq!(post(&s.url, None, &chat("t/quiet", 2)).0, 200, "the next request wakes one");
    let after = replicas(&s.url, None, "t/quiet");
    let hot: Vec<&Value> = after.iter().filter(|r| r["state"] == "ready").collect();
    assert_eq!(hot.len(), 1, "{after:?}");
    assert!(busy.iter().any(|r| r["pid"] == hot[0]["pid"]), "woken, not restarted: {busy:?} {after:?}");
}

#[test]
fn a_dedicated_window_starts_and_ends_on_time() {
    let at = |from_now: Duration| humantime::format_rfc3339_millis(std::time::SystemTime::now() + from_now);
    let (start_in, end_in) = (Duration::from_secs(3), Duration::from_secs(6));
    let s = serve(&format!(
        r#"
[[nodes]]
id = "local"
gpus = 2
gpu_memory = "80GB"
virtual_gpus = true
cpu_cache = "64GB"

[[models]]
key = "t/dedicated"
engine = {{ kind = "mock", preset = "fast" }}
size = "10GB"
max_replicas = 2
scaling = {{ policy = "hangar", scale_down_after_s = 1 }}

[[schedule]]
model = "t/dedicated"
replicas = 2
start = "{}"
end = "{}"
"#,
        at(start_in),
        at(end_in)
    ));
    let started = Instant::now();
    let dedicated =
        |s: &str| replicas(s, None, "t/dedicated").iter().filter(|r| r["dedicated"] == true).count();
    assert_eq!(replicas(&s.url, None, "t/dedicated").len(), 0, "nothing before the window");
    eventually("the window's two replicas are up", || {
        let up = replicas(&s.url, None, "t/dedicated");
        up.iter().filter(|r| r["state"] == "ready" && r["dedicated"] == true).count() == 2
    });
    assert!(started.elapsed() >= start_in - Duration::from_millis(500), "not before the window opens");
    let decisions = model_status(&s.url, None, "t/dedicated")["scaling"]["decisions"].clone();
    assert!(decisions.to_string().contains("a dedicated window keeps 2"), "{decisions}");
    // Idle, they stay while the window lasts; after it, the quiet model
    // gives them back.
    while started.elapsed() + Duration::from_millis(500) < end_in {
        assert_eq!(dedicated(&s.url), 2, "kept while the window lasts");
        std::thread::sleep(Duration::from_millis(200));
    }
    eventually("the replicas went back after the window", || {
        replicas(&s.url, None, "t/dedicated").iter().all(|r| r["state"] != "ready" && r["dedicated"] == false)
    });
}

#[test]
fn a_model_that_requires_hardware_runs_only_on_the_nodes_that_have_it() {
    // Two nodes, two kinds: `big` needs the 80 GB `h100` node, `small`
    // the `l4` one; `any` goes wherever there is room.
    let s = serve(
        r#"
[[nodes]]
id = "l4-node"
gpus = 2
gpu_memory = "24GB"
gpu_kind = "l4"
virtual_gpus = true

[[nodes]]
id = "h100-node"
gpus = 2
gpu_memory = "80GB"
gpu_kind = "h100"
virtual_gpus = true

[[models]]
key = "t/big"
engine = { kind = "mock", preset = "instant" }
size = "10GB"
min_replicas = 2
max_replicas = 2
min_gpu_memory = "80GB"

[[models]]
key = "t/small"
engine = { kind = "mock", preset = "instant" }
size = "5GB"
min_replicas = 2
max_replicas = 2
gpu_kind = "l4"
"#,
    );
    for (model, node) in [("t/big", "h100-node"), ("t/small", "l4-node")] {
        eventually(&format!("two {model} replicas"), || replicas(&s.url, None, model).len() == 2);
        for r in replicas(&s.url, None, model) {
            assert_eq!(r["node"], node, "{model}: {r}");
        }
        assert_eq!(post(&s.url, None, &chat(model, 2)).0, 200);
    }
}
