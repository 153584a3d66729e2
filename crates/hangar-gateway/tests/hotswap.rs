//! The hotswap tier through the gateway, with `oneshot`, in front of mock
//! engines (in process, port 0): a model that holds its own replicas takes
//! a hotswap model's GPU at once on a full node, however young that
//! replica, where it would otherwise wait out the hour
//! `min_deployment_age_ms` protects a replica for; and the operator's gate
//! closes a hotswap model to swapping in and opens it again.

mod common;

use std::path::Path;
use std::time::Duration;

use axum::http::StatusCode;
use axum::Router;
use hangar_predictions::store::Backend;
use hangar_runtime::serve::{ServeConfig, Server};
use serde_json::{json, Value};

/// A mock engine serving `model`, on port 0.
async fn mock(model: &str) -> String {
    common::mock_engine(model, |_| {}).await
}

/// One node with one 80 GB GPU, so two 60 GB models cannot both run:
/// `t/swap` (hotswap unless `hotswap` is false) and `t/own`, both at zero.
async fn start(dir: &Path, hotswap: bool) -> (Server, Router) {
    let (swap, own) = (mock("t/swap").await, mock("t/own").await);
    let text = format!(
        r#"
[[nodes]]
id = "n1"
gpus = 1
gpu_memory = "80GB"
virtual_gpus = true

[[models]]
key = "t/swap"
engine = {{ kind = "external", url = "{swap}" }}
size = "60GB"
hotswap = {hotswap}
timeout_s = 5

[[models]]
key = "t/own"
engine = {{ kind = "external", url = "{own}" }}
size = "60GB"
timeout_s = 5

[[api_keys]]
key = "k-ops"
account = "ops"
admin = true
"#
    );
    let mut config = ServeConfig::from_toml(&text, "test").unwrap();
    config.events.enabled = false;
    config.timeout_floor_s = 5;
    let served = common::serve(config, &Backend::Sqlite(dir.to_path_buf()), Default::default()).await;
    (served.server, served.router)
}

async fn call(router: &Router, method: &str, path: &str, body: Value) -> (StatusCode, Value) {
    common::call(router, method, path, Some("k-ops"), &[], Some(&body)).await
}

async fn chat(router: &Router, model: &str) -> (StatusCode, Value) {
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    call(router, "POST", "/v1/chat/completions", body).await
}

#[tokio::test]
async fn a_model_with_its_own_replicas_takes_a_young_hotswap_replicas_gpu_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (server, router) = start(dir.path(), true).await;
    assert_eq!(chat(&router, "t/swap").await.0, StatusCode::OK, "swapped in on demand");
    let (status, answer) = chat(&router, "t/own").await;
    assert_eq!(status, StatusCode::OK, "the hotswap replica, seconds old, yielded its GPU: {answer}");
    assert_eq!(server.model("t/swap").unwrap().ready_replicas(), 0);
    server.shutdown().await;

    // Without the tier, the young replica is protected: the second model
    // cannot run now.
    let dir = tempfile::tempdir().unwrap();
    let (server, router) = start(dir.path(), false).await;
    assert_eq!(chat(&router, "t/swap").await.0, StatusCode::OK);
    let (status, answer) = chat(&router, "t/own").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{answer}");
    server.shutdown().await;
}

#[tokio::test]
async fn an_operator_closes_a_hotswap_model_to_swapping_in_and_opens_it_again() {
    let dir = tempfile::tempdir().unwrap();
    let (server, router) = start(dir.path(), true).await;
    assert_eq!(chat(&router, "t/swap").await.0, StatusCode::OK);

    let (status, answer) =
        call(&router, "PUT", "/admin/models/t/swap/hotswap", json!({"swappable": false})).await;
    assert_eq!((status, &answer["swappable"]), (StatusCode::OK, &json!(false)), "{answer}");
    let (status, answer) = chat(&router, "t/swap").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{answer}");
    let message = answer.pointer("/error/message").and_then(Value::as_str).unwrap_or("");
    assert!(message.contains("closed to swapping in"), "{answer}");
    let rt = server.model("t/swap").unwrap();
    for _ in 0..200 {
        if rt.ready_replicas() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!((rt.desired_replicas(), rt.ready_replicas()), (0, 0), "held at zero");
    let (_, status_page) = call(&router, "GET", "/admin/status", Value::Null).await;
    let swap = status_page["models"].as_array().unwrap().iter().find(|m| m["model"] == "t/swap").unwrap();
    assert_eq!(swap["hotswap"], json!({"swappable": false}));

    let (status, _) = call(&router, "PUT", "/admin/models/t/swap/hotswap", json!({"swappable": true})).await;
    assert_eq!(status, StatusCode::OK);
    let (status, answer) = chat(&router, "t/swap").await;
    assert_eq!(status, StatusCode::OK, "swapped in again: {answer}");

    // A model outside the tier has no gate; a malformed body names why.
    let (status, answer) =
        call(&router, "PUT", "/admin/models/t/own/hotswap", json!({"swappable": false})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    let (status, _) = call(&router, "PUT", "/admin/models/t/swap/hotswap", json!({"open": true})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    server.shutdown().await;
}
