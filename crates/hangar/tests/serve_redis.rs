//! Gateways sharing one Redis: `hangar serve --redis` processes over a
//! private `redis-server`, real engines and a real webhook receiver; a
//! gateway killed with SIGKILL, Redis restarted, paused and stopped
//! mid-run.

mod common;

use std::time::{Duration, Instant};

use common::predictions::{
    client, create_with_webhook, get, post, receiver, tls_receiver, wait_terminal, Receiver,
};
use common::{serve, Serve};
use hangar_redis::tls::TestCa;
use hangar_redis::LocalRedis;
use serde_json::{json, Value};

/// A gateway with its own node (two virtual 80 GB GPUs) and the
/// predictions on the Redis at `url`: `models` (`[[models]]` entries),
/// `async_slots` per model, a 2 s lease so a dead gateway's claims are
/// swept quickly, webhooks to loopback.
fn gateway_config(url: &str, models: &str, async_slots: u32) -> String {
    format!(
        r#"
redis = "{url}"

[[nodes]]
id = "local"
gpus = 2
gpu_memory = "80GB"
virtual_gpus = true
{models}
[predictions]
async_slots = {async_slots}
lease_s = 2
webhook_allow = ["127.0.0.1/32"]
"#
    )
}

/// Two mock models; `t/fast` is idempotent (a prediction whose gateway
/// died runs again).
fn config(redis: &LocalRedis) -> String {
    config_at(&redis.url())
}

/// [`config`] with the Redis at `url`.
fn config_at(url: &str) -> String {
    let models = r#"
[[models]]
key = "t/fast"
engine = { kind = "mock", preset = "fast" }
size = "10GB"
min_replicas = 1
predictions = { idempotent = true }

[[models]]
key = "t/slow"
engine = { kind = "mock", preset = "default" }
size = "10GB"
min_replicas = 1
concurrency = 1
"#;
    gateway_config(url, models, 2)
}

fn create(gateway: &Serve, model: &str, tokens: u32, hooks: &Receiver) -> (u16, Value) {
    create_with_webhook(&gateway.url, model, tokens, hooks)
}

/// TLS both ways, as a user sets it up: the gateway reaches Redis by
/// `rediss://` with the server's CA in `?ca_file=`, and a prediction's
/// `https` webhook reaches a receiver whose certificate a private CA
/// issued, trusted through `webhook_ca_file`, signed as ever.
#[test]
fn a_gateway_on_rediss_delivers_a_signed_https_webhook() {
    let Some(redis) = LocalRedis::for_test_tls() else { return };
    let url = format!("{}/0?ca_file={}", redis.tls_url().unwrap(), redis.ca_file().unwrap().display());
    let hooks_ca = TestCa::new("hooks CA");
    let hooks_ca_file = redis.dir().join("hooks-ca.pem");
    hooks_ca.write(&hooks_ca_file).unwrap();
    let hooks = tls_receiver(0, &hooks_ca);
    assert!(hooks.url.starts_with("https://"), "{}", hooks.url);
    let config = format!("{}webhook_ca_file = \"{}\"\n", config_at(&url), hooks_ca_file.display());
    let gateway = serve(&config);
    let (status, p) = create(&gateway, "t/fast", 4, &hooks);
    assert_eq!(status, 201, "{p}");
    let id = p["id"].as_str().unwrap().to_owned();
    assert_eq!(hooks.one_terminal_each(std::slice::from_ref(&id))[&id], "succeeded");
    let secret =
        get(&format!("{}/v1/webhooks/default/secret", gateway.url))["key"].as_str().unwrap().to_owned();
    let hook = &hooks.completed()[&id][0];
    assert!(
        hangar_predictions::signing::verify(&secret, &hook.id, hook.timestamp, &hook.body, &hook.signature),
        "{hook:?}"
    );
    // The prediction is in the Redis reached over TLS.
    let plain = hangar_redis::Redis::connect(&redis.url()).unwrap();
    let stored: bool =
        plain.run(|c| hangar_redis::redis::cmd("EXISTS").arg(format!("hangar:p:{id}")).query(c)).unwrap();
    assert!(stored, "hangar:p:{id} in Redis");
}

#[test]
fn a_prediction_is_created_run_read_and_cancelled_through_any_gateway() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let config = config(&redis);
    let (a, b) = (serve(&config), serve(&config));
    let hooks = receiver(0);
    let mut ids = Vec::new();
    for i in 0..100 {
        let (status, p) = create(if i % 2 == 0 { &a } else { &b }, "t/fast", 8, &hooks);
        assert_eq!(status, 201, "{p}");
        ids.push(p["id"].as_str().unwrap().to_owned());
    }
    // Each is read through the gateway it was not created through.
    for (i, id) in ids.iter().enumerate() {
        let other = if i % 2 == 0 { &b } else { &a };
        let done = wait_terminal(&format!("{}/v1/predictions/{id}", other.url));
        assert_eq!(done["status"], "succeeded", "{done}");
        assert_eq!(done["output"].as_array().unwrap().len(), 8, "{done}");
    }
    assert!(hooks.one_terminal_each(&ids).values().all(|s| s == "succeeded"));
    // Listing through either gateway shows all of them.
    let listed = get(&format!("{}/v1/predictions", a.url));
    assert_eq!(listed["results"].as_array().unwrap().len(), 100);

    // `Prefer: wait` on one gateway sees the end, wherever it ran.
    let (status, waited) = post(
        &format!("{}/v1/models/t/fast/predictions", b.url),
        &json!({"input": {"prompt": "x", "max_tokens": 4}}),
        &[("Prefer", "wait=30")],
    );
    assert_eq!((status, waited["status"].as_str()), (201, Some("succeeded")), "{waited}");

    // A long prediction created through A and cancelled through B ends
    // `canceled` for both, and whichever gateway ran it stops: the slow
    // model's single permit is free again on both.
    let (_, long) = create(&a, "t/slow", 20_000, &hooks);
    let id = long["id"].as_str().unwrap();
    let t = Instant::now();
    while get(&format!("{}/v1/predictions/{id}", b.url))["status"] != "processing" {
        assert!(t.elapsed() < Duration::from_secs(30), "never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let canceled = client()
        .post(format!("{}/v1/predictions/{id}/cancel", b.url))
        .send()
        .unwrap()
        .json::<Value>()
        .unwrap();
    assert_eq!(canceled["status"], "canceled", "{canceled}");
    assert_eq!(get(&format!("{}/v1/predictions/{id}", a.url))["status"], "canceled");
    for gateway in [&a, &b] {
        let t = Instant::now();
        let chat = client()
            .post(format!("{}/v1/chat/completions", gateway.url))
            .json(
                &json!({"model": "t/slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
            )
            .send()
            .unwrap();
        assert_eq!(chat.status(), 200);
        assert!(t.elapsed() < Duration::from_secs(10), "the cancelled run still held the permit");
    }
}

#[test]
fn a_gateway_killed_mid_run_loses_no_prediction() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let config = config(&redis);
    let (a, b) = (serve(&config), serve(&config));
    let hooks = receiver(0);
    let mut ids = Vec::new();
    // 200 tokens each: running them must not outpace creating them (with
    // 40, a slow moment in CI saw all 300 end before the kill).
    for i in 0..300 {
        let (status, p) = create(if i % 2 == 0 { &a } else { &b }, "t/fast", 200, &hooks);
        assert_eq!(status, 201, "{p}");
        ids.push(p["id"].as_str().unwrap().to_owned());
    }
    let t = Instant::now();
    while hooks.completed().len() < 50 {
        assert!(t.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(a.kill9());
    let before = hooks.completed().len();
    assert!(before < 300, "the kill came too late to test anything");
    // The survivor sweeps the dead gateway's claims after the lease and
    // runs them again (the model is idempotent): every one succeeds, with
    // one terminal webhook each.
    let statuses = hooks.one_terminal_each(&ids);
    for id in &ids {
        assert_eq!(statuses[id], "succeeded", "{id}");
        assert_eq!(get(&format!("{}/v1/predictions/{id}", b.url))["status"], "succeeded");
    }
    eprintln!("gateway kill: 300 created, {before} completed before the SIGKILL, all 300 succeeded");
}

#[test]
fn accepted_predictions_survive_a_redis_restart() {
    let Some(mut redis) = LocalRedis::for_test() else { return };
    let gateway = serve(&config(&redis));
    let hooks = receiver(0);
    let mut ids = Vec::new();
    let mut refused = 0;
    // Redis restarts (and then crashes, SIGKILL, and restarts) while
    // predictions are created and run.
    let restarts = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        redis.restart().unwrap();
        std::thread::sleep(Duration::from_millis(1_500));
        redis.crash_and_restart().unwrap();
        redis
    });
    for _ in 0..300 {
        std::thread::sleep(Duration::from_millis(10));
        // While Redis is down a create is refused (503: retry, nothing
        // stored, naming the store); the client tries again.
        loop {
            let (status, p) = create(&gateway, "t/fast", 20, &hooks);
            if status == 201 {
                ids.push(p["id"].as_str().unwrap().to_owned());
                break;
            }
            assert_eq!(status, 503, "{p}");
            assert!(p["detail"].as_str().unwrap().ends_with("is unreachable; retry"), "{p}");
            refused += 1;
            assert!(refused < 100, "Redis never came back: {p}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let _redis = restarts.join().unwrap();
    let statuses = hooks.one_terminal_each(&ids);
    assert!(statuses.values().all(|s| s == "succeeded"), "{statuses:?}");
    eprintln!(
        "redis restart: 300 accepted ({refused} creates refused while it was down), all succeeded once"
    );
}

/// The engine requests each of a gateway's replicas took
/// (`hangar_mock_requests_total` of each mock engine), summed.
fn engine_runs(gateway: &Serve) -> u64 {
    let status = get(&format!("{}/admin/status", gateway.url));
    let mut runs = 0;
    for m in status["models"].as_array().unwrap() {
        for r in m["replicas"].as_array().unwrap() {
            let Some(url) = r["url"].as_str() else { continue };
            let metrics = client().get(format!("{url}/metrics")).send().unwrap().text().unwrap();
            runs += metrics
                .lines()
                .find_map(|l| l.strip_prefix("hangar_mock_requests_total "))
                .map_or(0, |v| v.trim().parse::<u64>().unwrap());
        }
    }
    runs
}

/// Predictions running on two gateways while Redis is paused (`CLIENT
/// PAUSE … ALL`) for twice the lease — under the 5 s command timeout, so
/// every call just waits — and then stopped for twice the lease and
/// started again, each run long enough to last through both: every
/// claim's idle time passes the lease on Redis's clock, yet no sweep
/// takes a live gateway's claim. Every prediction succeeds once — one
/// engine run each, one terminal webhook each — and none fails for a
/// lapsed lease (the model is not idempotent: a running prediction swept
/// would fail).
#[test]
fn no_prediction_runs_twice_when_redis_pauses_or_restarts() {
    let Some(mut redis) = LocalRedis::for_test() else { return };
    let model = r#"
[[models]]
key = "t/steady"
engine = { kind = "mock", preset = "default" }
size = "10GB"
min_replicas = 1
concurrency = 4
"#;
    let config = gateway_config(&redis.url(), model, 4);
    let gateways = [serve(&config), serve(&config)];
    let hooks = receiver(0);
    // 2,000 tokens of the default mock engine: over 10 s a run. Four run
    // on each gateway at once, the others wait in the queue.
    let ids: Vec<String> = (0..12)
        .map(|i| {
            let (status, p) = create(&gateways[i % 2], "t/steady", 2_000, &hooks);
            assert_eq!(status, 201, "{p}");
            p["id"].as_str().unwrap().to_owned()
        })
        .collect();
    let processing = || {
        ids.iter()
            .filter(|id| get(&format!("{}/v1/predictions/{id}", gateways[0].url))["status"] == "processing")
            .count()
    };
    let t = Instant::now();
    while processing() < 8 {
        assert!(t.elapsed() < Duration::from_secs(60), "never 8 running at once");
        std::thread::sleep(Duration::from_millis(50));
    }
    redis.pause(Duration::from_millis(4_000)).unwrap();
    std::thread::sleep(Duration::from_millis(5_000));
    redis.stop();
    std::thread::sleep(Duration::from_millis(4_000));
    redis.start_again().unwrap();
    let ended_before = hooks.completed().len();
    assert!(ended_before < 8, "{ended_before} ended: the runs were over before the faults");
    let statuses = hooks.one_terminal_each(&ids);
    for id in &ids {
        assert_eq!(
            statuses[id],
            "succeeded",
            "{id}: {}",
            get(&format!("{}/v1/predictions/{id}", gateways[0].url))
        );
    }
    let runs: u64 = gateways.iter().map(engine_runs).sum();
    assert_eq!(runs, ids.len() as u64, "engine runs for {} predictions", ids.len());
    eprintln!(
        "redis blips: 12 predictions on 2 gateways, 8 running through a 4 s pause and a 4 s stop of Redis \
         (lease 2 s); all succeeded with one engine run each"
    );
}
