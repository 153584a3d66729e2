//! vLLM's runtime LoRA API on the mock engine, over real HTTP: loads that
//! read the adapter's bytes and take a time that grows with them, one at a
//! time; requests on loaded adapters; unloads; every refusal with vLLM's
//! status; and Hangar's capability probe seeing the API or not.

mod common;

use std::num::NonZeroU64;
use std::path::Path;
use std::time::Duration;

use common::{get_json, get_text, post, post_text, start, start_with, Server};
use hangar_agent::capabilities;
use hangar_agent::engine::EngineSpec;
use serde_json::{json, Value};

const LOAD: &str = "/v1/load_lora_adapter";
const UNLOAD: &str = "/v1/unload_lora_adapter";

/// A PEFT adapter directory: `adapter_config.json` and
/// `adapter_model.safetensors` of `size` bytes. Returns the bytes the
/// engine must read, in name order.
fn peft_adapter(dir: &Path, size: usize) -> Vec<u8> {
    std::fs::create_dir_all(dir).unwrap();
    let config =
        br#"{"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}"#;
    let weights: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(dir.join("adapter_config.json"), config).unwrap();
    std::fs::write(dir.join("adapter_model.safetensors"), &weights).unwrap();
    [config.as_slice(), &weights].concat()
}

fn load_body(name: &str, path: &Path) -> Value {
    json!({"lora_name": name, "lora_path": path.to_str().unwrap()})
}

fn chat(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "Which airport is LLW?"}], "max_tokens": 6})
}

/// The value of an unlabelled sample in the text format.
fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in {metrics}"))
        .parse()
        .unwrap()
}

#[tokio::test]
async fn a_loaded_adapter_serves_requests_until_unloaded() {
    let s = start().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sql-lora");
    let bytes = peft_adapter(&dir, 10_000);

    let (st, text) = post_text(&s, LOAD, load_body("sql", &dir)).await;
    assert_eq!((st, text.as_str()), (200, "Success: LoRA adapter 'sql' added successfully."));

    let models = get_json(&s, "/v1/models").await;
    let data = models["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "{models}");
    let card = &data[1];
    assert_eq!(card["id"], "sql");
    assert_eq!(card["parent"], "mock-llm");
    assert_eq!(card["root"], dir.to_str().unwrap());
    assert_eq!(card["weights"]["bytes"], bytes.len() as u64);
    assert_eq!(
        card["weights"]["blake3"],
        blake3::hash(&bytes).to_hex().as_str(),
        "the engine read other bytes"
    );

    let (st, on_adapter) = post(&s, "/v1/chat/completions", chat("sql")).await;
    assert_eq!(st, 200, "{on_adapter}");
    assert_eq!(on_adapter["model"], "sql");
    assert_eq!(on_adapter["usage"]["completion_tokens"], 6);
    let (_, on_base) = post(&s, "/v1/chat/completions", chat("mock-llm")).await;
    assert_eq!(on_base["model"], "mock-llm");
    assert_eq!(on_adapter["usage"]["prompt_tokens"], on_base["usage"]["prompt_tokens"]);
    assert_ne!(
        on_adapter["choices"][0]["message"]["content"], on_base["choices"][0]["message"]["content"],
        "a fine-tune answers the same prompt its own way"
    );
    let (st, completion) =
        post(&s, "/v1/completions", json!({"model": "sql", "prompt": "SELECT", "max_tokens": 2})).await;
    assert_eq!((st, completion["model"].as_str()), (200, Some("sql")));

    let metrics = get_text(&s, "/metrics").await;
    assert_eq!(sample(&metrics, "hangar_mock_adapter_loads_total"), 1.0);
    assert_eq!(sample(&metrics, "hangar_mock_loaded_adapters"), 1.0);

    let (st, text) = post_text(&s, UNLOAD, json!({"lora_name": "sql", "lora_int_id": 1})).await;
    assert_eq!((st, text.as_str()), (200, "Success: LoRA adapter 'sql' removed successfully."));
    let (st, e) = post(&s, "/v1/chat/completions", chat("sql")).await;
    assert_eq!(st, 404);
    assert_eq!(e["error"]["message"], "The model `sql` does not exist.");
    assert_eq!(e["error"]["code"], "model_not_found");
    assert_eq!(get_json(&s, "/v1/models").await["data"].as_array().unwrap().len(), 1);
    let metrics = get_text(&s, "/metrics").await;
    assert_eq!(sample(&metrics, "hangar_mock_loaded_adapters"), 0.0);
    assert_eq!(sample(&metrics, "hangar_mock_adapter_loads_total"), 1.0);

    // Loaded again, it serves again; a single file is an adapter too.
    assert_eq!(post_text(&s, LOAD, load_body("sql", &dir)).await.0, 200);
    let file = dir.join("adapter_model.safetensors");
    assert_eq!(post_text(&s, LOAD, load_body("single", &file)).await.0, 200);
    let models = get_json(&s, "/v1/models").await;
    assert_eq!(models["data"][2]["weights"]["bytes"], 10_000, "{models}");
    assert_eq!(post(&s, "/v1/chat/completions", chat("single")).await.0, 200);
}

/// On tokio's paused clock: the load time is the modelled one, so it grows
/// with the adapter's size, and two loads asked for at once take the sum
/// of their times, not the longer one — the engine loads one at a time.
#[tokio::test(start_paused = true)]
async fn loads_take_their_size_over_the_bandwidth_one_at_a_time() {
    let s = start_with(|c| {
        c.lora_load_bytes_per_s = NonZeroU64::new(1_000_000).unwrap(); // 1 MB/s
        c.lora_load_ms = 50;
    })
    .await;
    let tmp = tempfile::tempdir().unwrap();
    let (small, big) = (tmp.path().join("small"), tmp.path().join("big"));
    let small_bytes = peft_adapter(&small, 1_000).len() as f64;
    let big_bytes = peft_adapter(&big, 2_000_000).len() as f64;
    let expected = |bytes: f64| bytes / 1_000_000.0 * 1000.0 + 50.0;

    let t0 = tokio::time::Instant::now();
    assert_eq!(post_text(&s, LOAD, load_body("small", &small)).await.0, 200);
    let small_took = t0.elapsed();
    let t1 = tokio::time::Instant::now();
    assert_eq!(post_text(&s, LOAD, load_body("big", &big)).await.0, 200);
    let big_took = t1.elapsed();
    assert!(small_took >= Duration::from_secs_f64(expected(small_bytes) / 1000.0), "{small_took:?}");
    assert!(big_took >= Duration::from_secs_f64(expected(big_bytes) / 1000.0), "{big_took:?}");
    assert!(big_took > small_took * 10, "{big_took:?} against {small_took:?}");
    let models = get_json(&s, "/v1/models").await;
    let load_ms = |i: usize| models["data"][i]["load_ms"].as_f64().unwrap();
    assert!((load_ms(1) - expected(small_bytes)).abs() < 1e-6, "{models}");
    assert!((load_ms(2) - expected(big_bytes)).abs() < 1e-6, "{models}");

    for name in ["small", "big"] {
        assert_eq!(post_text(&s, UNLOAD, json!({"lora_name": name})).await.0, 200);
    }
    let t2 = tokio::time::Instant::now();
    let (a, b) = tokio::join!(
        post_text(&s, LOAD, load_body("big", &big)),
        post_text(&s, LOAD, load_body("small", &small))
    );
    assert_eq!((a.0, b.0), (200, 200));
    let both = t2.elapsed();
    let sum = Duration::from_secs_f64((expected(big_bytes) + expected(small_bytes)) / 1000.0);
    assert!(both >= sum, "loads ran side by side: {both:?} < {sum:?}");
}

/// A request naming an adapter that is still loading is refused as an
/// unknown model (vLLM serves it only once loaded), and the load holds its
/// name and its slot meanwhile.
#[tokio::test]
async fn an_adapter_is_not_served_while_it_loads() {
    let s = start_with(|c| {
        c.lora_load_ms = 3_600_000; // Never done within the test.
        c.max_loras = 1;
    })
    .await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("slow");
    peft_adapter(&dir, 100);
    let (base, body) = (s.base.clone(), load_body("slow", &dir));
    let loading = tokio::spawn(async move {
        // Sent again if a probe below held the name at that moment.
        loop {
            let r = reqwest::Client::new().post(format!("{base}{LOAD}")).json(&body).send().await.unwrap();
            if r.status() != 400 {
                return r.status();
            }
        }
    });
    // Its name is taken from the moment the load is accepted. The probe
    // names a path with nothing at it, so if it comes first it fails at
    // once (404) and gives the name back.
    let probe = load_body("slow", &tmp.path().join("nothing"));
    let mut refused = None;
    for _ in 0..500 {
        let (st, e) = post(&s, LOAD, probe.clone()).await;
        if st == 400 {
            refused = Some(e);
            break;
        }
        assert_eq!(st, 404, "{e}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let e = refused.expect("the load in progress holds its name");
    assert_eq!(e["error"]["message"], "The lora adapter 'slow' is already being loaded.");
    let (st, e) = post(&s, "/v1/chat/completions", chat("slow")).await;
    assert_eq!((st, e["error"]["message"].as_str()), (404, Some("The model `slow` does not exist.")));
    let (st, e) = post(&s, LOAD, load_body("other", &dir)).await;
    assert_eq!(st, 400, "the loading adapter holds the only slot: {e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("max_loras = 1"), "{e}");
    let (st, e) = post(&s, UNLOAD, json!({"lora_name": "slow"})).await;
    assert_eq!((st, e["error"]["message"].as_str()), (404, Some("The lora adapter 'slow' cannot be found.")));
    assert_eq!(get_json(&s, "/v1/models").await["data"].as_array().unwrap().len(), 1);
    assert!(!loading.is_finished());
    loading.abort();
}

#[tokio::test]
async fn bad_loads_and_unloads_get_vllms_answers() {
    let s = start_with(|c| c.max_loras = 2).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("a");
    peft_adapter(&dir, 64);

    let missing = "Both 'lora_name' and 'lora_path' must be provided.";
    let (st, e) = post(&s, LOAD, json!({})).await;
    assert_eq!(
        (st, e["error"]["message"].as_str(), e["error"]["param"].as_str()),
        (400, Some(missing), Some("lora_name"))
    );
    let (st, e) = post(&s, LOAD, json!({"lora_name": "a", "lora_path": ""})).await;
    assert_eq!((st, e["error"]["param"].as_str()), (400, Some("lora_path")));
    let (st, e) = post(&s, LOAD, json!({"lora_name": 5, "lora_path": "/x"})).await;
    assert_eq!((st, e["error"]["param"].as_str()), (400, Some("lora_name")), "{e}");
    let (st, e) = post(&s, LOAD, load_body("mock-llm", &dir)).await;
    assert_eq!(st, 400, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("base model"), "{e}");

    let nowhere = tmp.path().join("nowhere");
    let (st, e) = post(&s, LOAD, load_body("b", &nowhere)).await;
    assert_eq!(st, 404, "vLLM answers 404 when no adapter is at the path: {e}");
    assert_eq!(
        e["error"]["message"].as_str().unwrap(),
        format!("Loading lora b failed: No adapter found for {}", nowhere.display())
    );
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert_eq!(post(&s, LOAD, load_body("b", &empty)).await.0, 404);
    // A file that cannot be read: a link to nothing in the adapter.
    let broken = tmp.path().join("broken");
    peft_adapter(&broken, 8);
    std::os::unix::fs::symlink(tmp.path().join("gone"), broken.join("extra.safetensors")).unwrap();
    let (st, e) = post(&s, LOAD, load_body("b", &broken)).await;
    assert_eq!(st, 400, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("extra.safetensors"), "names the file: {e}");

    assert_eq!(post_text(&s, LOAD, load_body("a", &dir)).await.0, 200);
    let (st, e) = post(&s, LOAD, load_body("a", &dir)).await;
    assert_eq!(
        (st, e["error"]["message"].as_str()),
        (400, Some("The lora adapter 'a' has already been loaded."))
    );
    assert_eq!(post_text(&s, LOAD, load_body("b", &dir)).await.0, 200, "the refused loads took no slot");
    let (st, e) = post(&s, LOAD, load_body("c", &dir)).await;
    assert_eq!(st, 400);
    assert!(e["error"]["message"].as_str().unwrap().contains("max_loras = 2"), "names the limit: {e}");

    let (st, e) = post(&s, UNLOAD, json!({})).await;
    assert_eq!((st, e["error"]["param"].as_str()), (400, Some("lora_name")), "{e}");
    let (st, e) = post(&s, UNLOAD, json!({"lora_name": "zzz"})).await;
    assert_eq!((st, e["error"]["message"].as_str()), (404, Some("The lora adapter 'zzz' cannot be found.")));
    assert_eq!(post_text(&s, UNLOAD, json!({"lora_name": "a"})).await.0, 200);
    assert_eq!(post_text(&s, LOAD, load_body("c", &dir)).await.0, 200, "an unload frees a slot");
}

/// Hangar's node asks a started engine whether it loads adapters by
/// posting an empty load: the mock refuses it (400) with the API on and
/// has no such route (404) with it off.
#[tokio::test]
async fn the_capability_probe_sees_the_lora_api_or_not() {
    let client = reqwest::Client::new();
    let spec = EngineSpec::mock("fast", 0);
    let on: Server = start().await;
    assert!(capabilities::probe(&client, &on.base, &spec).await.lora);
    let off = start_with(|c| c.lora_api = false).await;
    assert!(!capabilities::probe(&client, &off.base, &spec).await.lora);
    for path in [LOAD, UNLOAD] {
        assert_eq!(post(&off, path, json!({"lora_name": "a", "lora_path": "/a"})).await.0, 404);
    }
}
