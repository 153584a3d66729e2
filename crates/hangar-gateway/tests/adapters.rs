//! LoRA adapters through the gateway, with `oneshot`, in front of the mock
//! engine's runtime LoRA API (in process, port 0), the adapters registered
//! in a weight store in a temporary directory: a request for an adapter
//! loads it on its replica first and runs there under the adapter's name,
//! a full replica unloads its least recently used adapter, and every bad
//! request is refused before it queues with a 4xx naming adapter and
//! model.

mod common;

use std::path::Path;

use axum::http::StatusCode;
use axum::Router;
use hangar_core::AdapterRef;
use hangar_predictions::store::Backend;
use hangar_runtime::serve::{ServeConfig, Server};
use hangar_store::BlobStore;
use serde_json::{json, Value};

/// A mock engine serving `t/m` (its LoRA API on or off), on port 0.
async fn mock(lora_api: bool) -> String {
    common::mock_engine("t/m", |c| {
        c.lora_api = lora_api;
        c.lora_load_ms = 1;
    })
    .await
}

/// Registers a small synthetic adapter `BASE:NAME` in the store at `root`.
fn register(root: &Path, adapter: &str, seed: u64) {
    let store = BlobStore::open(root).unwrap();
    let adapter: AdapterRef = adapter.parse().unwrap();
    hangar_store::synth::register_adapter(&store, &adapter, hangar_store::synth::AdapterShape::TINY, seed)
        .unwrap();
}

/// `t/m` (adapters, two slots, `private/*` for account `beta` only, the
/// rest for everyone) and `t/other` on mocks with the LoRA API, `t/plain`
/// without adapters, `t/nolora` with adapters on a mock without the API.
async fn start(dir: &Path) -> (Server, Router, String) {
    let store = dir.join("store");
    for (i, a) in
        ["t/m:acme/a", "t/m:acme/b", "t/m:acme/c", "t/m:private/x", "t/other:acme/z", "t/nolora:acme/a"]
            .iter()
            .enumerate()
    {
        register(&store, a, i as u64);
    }
    let (with, without) = (mock(true).await, mock(false).await);
    let text = format!(
        r#"
[store]
root = "{store}"

[[nodes]]
id = "n1"
gpus = 4
gpu_memory = "80GB"
virtual_gpus = true

[[models]]
key = "t/m"
engine = {{ kind = "external", url = "{with}" }}
size = "10GB"
min_replicas = 1
router = "adapter"
adapters = {{ slots = 2, memory = "1GB" }}
use_async_queue = true

[[models.adapter_access]]
adapters = "private/*"
accounts = ["beta"]

[[models.adapter_access]]
adapters = "acme/*"

[[models]]
key = "t/other"
engine = {{ kind = "external", url = "{with}" }}
size = "10GB"
min_replicas = 1
adapters = {{}}

[[models]]
key = "t/plain"
engine = {{ kind = "external", url = "{with}" }}
size = "10GB"
min_replicas = 1

[[models]]
key = "t/nolora"
engine = {{ kind = "external", url = "{without}" }}
size = "10GB"
min_replicas = 1
adapters = {{}}

[[api_keys]]
key = "k-acme"
account = "acme"

[[api_keys]]
key = "k-beta"
account = "beta"
"#,
        store = store.display()
    );
    let mut config = ServeConfig::from_toml(&text, "test").unwrap();
    config.events.enabled = false;
    let backend = Backend::Sqlite(dir.to_path_buf());
    let served = common::serve(config, &backend, Default::default()).await;
    (served.server, served.router, with)
}

async fn call(
    router: &Router,
    method: &str,
    path: &str,
    key: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    common::call(router, method, path, Some(key), &[], body.as_ref()).await
}

async fn chat(router: &Router, key: &str, fields: Value) -> (StatusCode, Value) {
    let mut body = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2});
    for (k, v) in fields.as_object().unwrap() {
        body[k] = v.clone();
    }
    call(router, "POST", "/v1/chat/completions", key, Some(body)).await
}

fn message(answer: &Value) -> &str {
    answer.pointer("/error/message").and_then(Value::as_str).unwrap_or("")
}

/// The adapters the mock at `url` has loaded, by `GET /v1/models`.
async fn loaded(url: &str) -> Vec<String> {
    let models: Value = reqwest::get(format!("{url}/v1/models")).await.unwrap().json().await.unwrap();
    let mut names: Vec<String> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m.get("parent").is_some_and(|p| !p.is_null()))
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn an_adapter_is_loaded_on_its_replica_and_runs_there_under_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let (server, router, mock) = start(dir.path()).await;
    let (status, answer) = chat(&router, "k-acme", json!({"model": "t/m:acme/a"})).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["model"], "t/m:acme/a", "the answer names the model as the client wrote it");
    assert_eq!(loaded(&mock).await, ["acme/a"]);

    // Workers AI's spelling names the same adapter: no second load.
    let (status, answer) = chat(&router, "k-acme", json!({"model": "t/m", "lora": "acme/a"})).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["model"], "t/m");
    // And a request without an adapter runs on the base model.
    let (status, answer) = chat(&router, "k-acme", json!({"model": "t/m"})).await;
    assert_eq!((status, answer["model"].as_str()), (StatusCode::OK, Some("t/m")));

    // Two slots: a third adapter unloads the least recently used one.
    chat(&router, "k-acme", json!({"model": "t/m:acme/b"})).await;
    chat(&router, "k-acme", json!({"model": "t/m:acme/a"})).await;
    let (status, _) = chat(&router, "k-acme", json!({"model": "t/m:acme/c"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(loaded(&mock).await, ["acme/a", "acme/c"], "b, the least recently used, went");

    let (status, metrics) = {
        let request = axum::http::Request::get("/metrics").body(axum::body::Body::empty()).unwrap();
        let response = tower::ServiceExt::oneshot(router.clone(), request).await.unwrap();
        let bytes = http_body_util::BodyExt::collect(response.into_body()).await.unwrap().to_bytes();
        (StatusCode::OK, String::from_utf8(bytes.to_vec()).unwrap())
    };
    assert_eq!(status, StatusCode::OK);
    let count = |step: &str| {
        let line = format!("hangar_adapter_steps_total{{model=\"t/m\",step=\"{step}\",outcome=\"ok\"}} ");
        metrics.lines().find_map(|l| l.strip_prefix(&line)).map(|v| v.trim().to_owned())
    };
    assert_eq!((count("load").as_deref(), count("unload").as_deref()), (Some("3"), Some("1")), "{metrics}");
    server.shutdown().await;
}

#[tokio::test]
async fn bad_adapters_are_refused_before_they_queue_naming_adapter_and_model() {
    let dir = tempfile::tempdir().unwrap();
    let (server, router, mock) = start(dir.path()).await;
    let refused = |body: Value, key: &'static str| {
        let router = router.clone();
        async move { chat(&router, key, body).await }
    };
    let cases = [
        (json!({"model": "t/m:"}), StatusCode::BAD_REQUEST, "no adapter name"),
        (json!({"model": "t/m:a:b"}), StatusCode::BAD_REQUEST, "second `:`"),
        (json!({"model": "t/m:../x"}), StatusCode::BAD_REQUEST, "`..`"),
        (json!({"model": "t/m", "lora": 7}), StatusCode::BAD_REQUEST, "`lora` must be a string"),
        (json!({"model": "t/m:acme/a", "lora": "acme/b"}), StatusCode::BAD_REQUEST, "name it once"),
        (json!({"model": "t/m:acme/nope"}), StatusCode::NOT_FOUND, "`t/m` has no adapter `acme/nope`"),
        (json!({"model": "t/m:acme/z"}), StatusCode::BAD_REQUEST, "adapter of `t/other`, not of `t/m`"),
        (json!({"model": "t/plain:acme/a"}), StatusCode::BAD_REQUEST, "`t/plain` serves no LoRA adapters"),
        (
            json!({"model": "t/nolora:acme/a"}),
            StatusCode::BAD_REQUEST,
            "engine of model `t/nolora` cannot load",
        ),
        (json!({"model": "t/m:private/x"}), StatusCode::NOT_FOUND, "`t/m` has no adapter `private/x`"),
        (json!({"model": "t/m:other/q"}), StatusCode::NOT_FOUND, "`t/m` has no adapter `other/q`"),
        (json!({"model": "t/unknown:acme/a"}), StatusCode::NOT_FOUND, "`t/unknown` does not exist"),
    ];
    for (body, status, says) in cases {
        let (got, answer) = refused(body.clone(), "k-acme").await;
        assert_eq!(got, status, "{body}: {answer}");
        assert!(message(&answer).contains(says), "{body}: {answer}");
    }
    // The account the rule names may use it.
    let (status, answer) = chat(&router, "k-beta", json!({"model": "t/m:private/x"})).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(loaded(&mock).await, ["private/x"], "nothing refused was loaded");
    let queued = server.model("t/m").unwrap().processor().load().counters.arrivals;
    assert_eq!(queued, 1, "only the request that ran reached the line");
    server.shutdown().await;
}

#[tokio::test]
async fn an_adapter_registered_while_serving_is_found_within_a_second() {
    let dir = tempfile::tempdir().unwrap();
    let (server, router, _) = start(dir.path()).await;
    let (status, _) = chat(&router, "k-acme", json!({"model": "t/m:acme/late"})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    register(&dir.path().join("store"), "t/m:acme/late", 99);
    tokio::time::sleep(hangar_runtime::serve::adapters::REFRESH_EVERY).await;
    let (status, answer) = chat(&router, "k-acme", json!({"model": "t/m:acme/late"})).await;
    assert_eq!(status, StatusCode::OK, "{answer}");

    // One removed from the store: the next read refuses it and removes
    // its exported copy.
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let gone: AdapterRef = "t/m:acme/c".parse().unwrap();
    let id = hangar_store::adapters::find(&store, &gone).unwrap().unwrap().id;
    let copy = dir.path().join("store").join("adapter-dirs").join(id.file_name());
    for _ in 0..500 {
        if copy.exists() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(copy.exists(), "exported ahead of need");
    hangar_store::adapters::remove(&store, &gone).unwrap();
    // A request for an unknown adapter has the store read.
    tokio::time::sleep(hangar_runtime::serve::adapters::REFRESH_EVERY).await;
    chat(&router, "k-acme", json!({"model": "t/m:acme/unknown"})).await;
    let (status, _) = chat(&router, "k-acme", json!({"model": "t/m:acme/c"})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(!copy.exists(), "its copy went with it");
    server.shutdown().await;
}

/// `POST path` with `Prefer: wait` as account `acme`.
async fn predict(router: &Router, path: &str, body: Value) -> (StatusCode, Value) {
    common::call(router, "POST", path, Some("k-acme"), &[("prefer", "wait")], Some(&body)).await
}

#[tokio::test]
async fn predictions_name_an_adapter_as_a_version_or_in_their_input_and_are_refused_before_they_queue() {
    let dir = tempfile::tempdir().unwrap();
    let (server, router, mock) = start(dir.path()).await;
    // Replicate's spelling: the adapter as a version of its base.
    let (status, p) =
        predict(&router, "/v1/predictions", json!({"version": "t/m:acme/a", "input": {"prompt": "hi"}}))
            .await;
    assert_eq!((status, p["status"].as_str()), (StatusCode::CREATED, Some("succeeded")), "{p}");
    assert_eq!(loaded(&mock).await, ["acme/a"], "it ran on the adapter, loaded for it");
    // Workers AI's: `lora` in the input.
    let body = json!({"input": {"prompt": "hi", "lora": "acme/b"}});
    let (status, p) = predict(&router, "/v1/models/t/m/predictions", body).await;
    assert_eq!((status, p["status"].as_str()), (StatusCode::CREATED, Some("succeeded")), "{p}");
    assert_eq!(loaded(&mock).await, ["acme/a", "acme/b"]);

    // Refused when created, naming adapter and model; nothing queued.
    let before = server.model("t/m").unwrap().processor().load().counters.arrivals;
    let detail = |p: &Value| p["detail"].as_str().unwrap_or("").to_owned();
    let (status, p) =
        predict(&router, "/v1/predictions", json!({"version": "t/m:acme/nope", "input": {"prompt": "hi"}}))
            .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{p}");
    assert!(detail(&p).contains("`t/m` has no adapter `acme/nope`"), "{p}");
    let body = json!({"input": {"prompt": "hi", "lora": "acme/z"}});
    let (status, p) = predict(&router, "/v1/models/t/m/predictions", body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{p}");
    assert!(detail(&p).contains("adapter of `t/other`"), "{p}");
    let body = json!({"input": {"prompt": "hi", "lora": "acme/a"}});
    let (status, p) = predict(&router, "/v1/models/t/plain/predictions", body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{p}");
    let body = json!({"version": "t/m:acme/a", "input": {"prompt": "hi", "lora": "acme/b"}});
    let (status, p) = predict(&router, "/v1/predictions", body).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{p}");
    assert!(detail(&p).contains("name it once"), "{p}");
    assert_eq!(server.model("t/m").unwrap().processor().load().counters.arrivals, before);
    server.shutdown().await;
}

#[tokio::test]
async fn the_adapters_a_model_serves_are_exported_ahead_of_need_and_no_others() {
    let dir = tempfile::tempdir().unwrap();
    let (server, _router, _) = start(dir.path()).await;
    let exports = dir.path().join("store").join("adapter-dirs");
    let exported = || {
        std::fs::read_dir(&exports)
            .map(|d| {
                d.filter_map(Result::ok).filter(|e| e.path().join("adapter_config.json").exists()).count()
            })
            .unwrap_or(0)
    };
    for _ in 0..500 {
        if exported() >= 6 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // Six served (t/m's `acme/*` and `private/*`, t/other's and t/nolora's
    // every adapter); t/m's `other/q` matches none of its rules.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert_eq!(exported(), 6);
    server.shutdown().await;
}

/// A request queued in Workers AI's async mode with an adapter runs with
/// it, loaded on its replica, and its answer names the model as the
/// client wrote it; an adapter the account may not use is refused before
/// anything is queued.
#[tokio::test]
async fn a_queued_request_runs_with_its_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let (server, router, mock) = start(dir.path()).await;
    let queued = json!({"model": "t/m:acme/b", "options": {"queueRequest": true}});
    let (mut status, mut answer) = chat(&router, "k-acme", queued).await;
    for _ in 0..500 {
        if status != StatusCode::ACCEPTED {
            break;
        }
        // Not ended within the wait: asked after until it has.
        let id = answer["request_id"].as_str().unwrap().to_owned();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let follow_up = json!({"model": "t/m:acme/b", "inputs": {"request_id": id}});
        (status, answer) = call(&router, "POST", "/v1/chat/completions", "k-acme", Some(follow_up)).await;
    }
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["model"], "t/m:acme/b", "{answer}");
    assert_eq!(loaded(&mock).await, ["acme/b"], "it ran on the adapter, loaded for it");

    let before = server.model("t/m").unwrap().processor().load().counters.arrivals;
    let refused = json!({"model": "t/m:private/x", "options": {"queueRequest": true}});
    let (status, answer) = chat(&router, "k-acme", refused).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{answer}");
    assert_eq!(server.model("t/m").unwrap().processor().load().counters.arrivals, before, "nothing queued");
    server.shutdown().await;
}
