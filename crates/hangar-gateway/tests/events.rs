//! Inference events of synchronous requests and predictions, through the
//! router with `oneshot`, in front of a fake engine (an axum server on
//! port 0).

use std::path::Path;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use hangar_core::{ErrorCode, RequestKind};
use hangar_predictions::store::Backend;
use hangar_runtime::events::InferenceEvent;
use hangar_runtime::serve::{ServeConfig, Server};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

/// An engine answering chat: with `usage` unless the prompt says
/// `no-usage`; SSE when `stream` (ending with a usage chunk when the
/// prompt says `with-usage`); 500 when the prompt says `fail`. Completions
/// (what a prediction asks) stream two tokens.
async fn engine() -> String {
    async fn chat(Json(body): Json<Value>) -> axum::response::Response {
        use axum::response::IntoResponse;
        let prompt = body.pointer("/messages/0/content").and_then(Value::as_str).unwrap_or("").to_owned();
        if prompt.contains("fail") {
            return (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response();
        }
        if body.get("stream").and_then(Value::as_bool) == Some(true) {
            let mut sse = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
                           data: {\"choices\":[{\"delta\":{\"content\":\" b\"}}]}\n\n\
                           data: {\"choices\":[{\"delta\":{\"content\":\" c\"}}]}\n\n"
                .to_owned();
            if prompt.contains("with-usage") {
                sse += "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\n";
            }
            sse += "data: [DONE]\n\n";
            return ([(axum::http::header::CONTENT_TYPE, "text/event-stream")], sse).into_response();
        }
        let mut answer = json!({"choices": [{"message": {"role": "assistant", "content": "one two three four five six"}}]});
        if !prompt.contains("no-usage") {
            answer["usage"] = json!({"prompt_tokens": 11, "completion_tokens": 22, "total_tokens": 33});
        }
        Json(answer).into_response()
    }
    async fn complete() -> axum::response::Response {
        use axum::response::IntoResponse;
        let sse = "data: {\"choices\":[{\"text\":\"hello\"}]}\n\n\
                   data: {\"choices\":[{\"text\":\" world\"}]}\n\ndata: [DONE]\n\n";
        ([(axum::http::header::CONTENT_TYPE, "text/event-stream")], sse).into_response()
    }
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(complete));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

async fn start(dir: &Path) -> (Server, Router) {
    let url = engine().await;
    let text = format!(
        r#"
[[nodes]]
id = "n1"
gpus = 1
gpu_memory = "80GB"

[[models]]
key = "t/trusted"
engine = {{ kind = "external", url = "{url}" }}
size = "10GB"
min_replicas = 1
billing = {{ per_second = 0.001, per_input_token = 0.01, per_output_token = 0.02, neurons = {{ cost_per_infer = 1, output_tokens = 0.5 }} }}

[[models]]
key = "t/untrusted"
engine = {{ kind = "external", url = "{url}" }}
size = "10GB"
min_replicas = 1
billing = {{ trust_usage = false }}

[[api_keys]]
key = "k-acme"
account = "acme"
"#
    );
    let mut config = ServeConfig::from_toml(&text, "test").unwrap();
    config.events.path = Some(dir.join("events.jsonl"));
    let server = Server::start(config, Default::default()).await.unwrap();
    let service = server
        .start_predictions(&Backend::Sqlite(dir.to_path_buf()), Default::default(), "http://test")
        .await
        .unwrap();
    let router = hangar_gateway::router(&server, &service, 1 << 20);
    (server, router)
}

async fn chat(router: &Router, id: &str, body: Value) -> (StatusCode, Vec<u8>) {
    let request = Request::post("/v1/chat/completions")
        .header("authorization", "Bearer k-acme")
        .header("content-type", "application/json")
        .header("x-request-id", id)
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    (status, response.into_body().collect().await.unwrap().to_bytes().to_vec())
}

/// The events written so far: all `n` of them, the sink flushed first.
async fn events(server: &Server, path: &Path, n: u64) -> Vec<InferenceEvent> {
    flush(server).await;
    assert_eq!(server.events().stats().written(), n, "events written");
    let text = std::fs::read_to_string(path).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Waits until what was sent so far is written (or dropped).
async fn flush(server: &Server) {
    let sink = server.events().clone();
    let flushed = tokio::task::spawn_blocking(move || sink.flush(Duration::from_secs(30))).await.unwrap();
    assert!(flushed, "the writer flushes");
}

#[tokio::test(flavor = "multi_thread")]
async fn each_request_writes_one_event_with_its_tokens_times_and_cost() {
    let dir = tempfile::tempdir().unwrap();
    let (server, router) = start(dir.path()).await;
    let path = dir.path().join("events.jsonl");
    let message = |text: &str| json!([{"role": "user", "content": text}]);

    let (status, _) =
        chat(&router, "req-1", json!({"model": "t/trusted", "messages": message("hi there")})).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) =
        chat(&router, "req-2", json!({"model": "t/trusted", "messages": message("no-usage please")})).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) =
        chat(&router, "req-3", json!({"model": "t/untrusted", "messages": message("a b c d e f")})).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = chat(
        &router,
        "req-4",
        json!({"model": "t/trusted", "stream": true, "messages": message("no-usage stream")}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(String::from_utf8_lossy(&body).contains("[DONE]"));
    let (status, _) =
        chat(&router, "req-5", json!({"model": "t/trusted", "messages": message("fail")})).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let (status, _) = chat(
        &router,
        "req-6",
        json!({"model": "t/trusted", "stream": true, "messages": message("with-usage stream")}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    // Refused by the gateway itself: no replica, no tokens.
    let (status, _) =
        chat(&router, "req-7", json!({"model": "t/trusted", "max_tokens": -1, "messages": message("x")}))
            .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    // The client leaves before reading its stream.
    let request = Request::post("/v1/chat/completions")
        .header("authorization", "Bearer k-acme")
        .header("x-request-id", "req-8")
        .body(Body::from(json!({"model": "t/trusted", "stream": true, "messages": message("x")}).to_string()))
        .unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    drop(response);
    // A prediction: its event comes from its end, with Replicate's estimates.
    let request = Request::post("/v1/models/t/trusted/predictions")
        .header("authorization", "Bearer k-acme")
        .header("content-type", "application/json")
        .header("prefer", "wait")
        .body(Body::from(json!({"input": {"prompt": "one two three"}}).to_string()))
        .unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    let prediction: Value =
        serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(prediction["status"], "succeeded", "{prediction}");

    let all = events(&server, &path, 9).await;
    let by_id =
        |id: &str| all.iter().find(|e| e.id == id).unwrap_or_else(|| panic!("no event {id}: {all:?}"));

    // The engine's usage, trusted, priced both ways.
    let e = by_id("req-1");
    assert_eq!((e.model.as_str(), e.account.as_str()), ("t/trusted", "acme"));
    assert_eq!((e.kind, e.status, e.code), (RequestKind::Sync, 200, None));
    assert_eq!((e.input_tokens, e.output_tokens, e.tokens_estimated), (11, 22, false));
    assert!(e.replica.as_deref().is_some_and(|r| r.starts_with("t/trusted:")), "{e:?}");
    assert_eq!(e.node.as_deref(), Some("n1"));
    assert!(e.ttft_ms.is_some() && e.total_ms >= e.queue_ms && e.total_ms >= e.inference_ms);
    let usd = 0.001 * e.inference_ms as f64 / 1000.0 + 0.01 * 11.0 + 0.02 * 22.0;
    assert!((e.cost.usd - usd).abs() < 1e-9, "{e:?}");
    assert!((e.cost.neurons - (1.0 + 0.5 * 22.0)).abs() < 1e-9, "{e:?}");
    assert_eq!(e.images, 0);

    // No usage: words × 4/3 of the prompt and of the answer.
    let e = by_id("req-2");
    assert!(e.tokens_estimated);
    assert_eq!((e.input_tokens, e.output_tokens), (3, 8), "{e:?}");

    // Not trusted: estimated even though the engine gave usage.
    let e = by_id("req-3");
    assert!(e.tokens_estimated);
    assert_eq!((e.input_tokens, e.output_tokens), (8, 8), "{e:?}");
    assert_eq!(e.cost.usd, 0.0);

    // A stream without usage: one token per event.
    let e = by_id("req-4");
    assert_eq!((e.output_tokens, e.tokens_estimated), (3, true), "{e:?}");

    // The engine's error, as it answered.
    let e = by_id("req-5");
    assert_eq!((e.status, e.code), (500, Some(ErrorCode::EngineError)));

    // A stream that ends with the engine's usage: taken, not estimated.
    let e = by_id("req-6");
    assert_eq!((e.input_tokens, e.output_tokens, e.tokens_estimated), (7, 3, false), "{e:?}");

    let e = by_id("req-7");
    assert_eq!((e.status, e.code, e.replica.as_deref()), (400, Some(ErrorCode::BadRequest), None));
    assert_eq!((e.input_tokens, e.output_tokens, e.inference_ms, e.ttft_ms), (0, 0, 0, None));

    let e = by_id("req-8");
    assert_eq!((e.status, e.code), (499, Some(ErrorCode::ClientClosed)), "{e:?}");

    let e = by_id(prediction["id"].as_str().unwrap());
    assert_eq!((e.kind, e.status, e.code), (RequestKind::Prediction, 200, None));
    assert_eq!((e.input_tokens, e.output_tokens, e.tokens_estimated), (4, 2, true), "{e:?}");
    assert!(e.replica.as_deref().is_some_and(|r| r.starts_with("t/trusted:")), "{e:?}");
    assert_eq!(e.node.as_deref(), Some("n1"));
    assert!(e.ttft_ms.is_some_and(|t| t <= e.total_ms), "{e:?}");
    let usd = 0.001 * e.inference_ms as f64 / 1000.0 + 0.01 * 4.0 + 0.02 * 2.0;
    assert!((e.cost.usd - usd).abs() < 1e-9, "{e:?}");

    // The figures are in /metrics.
    let metrics =
        router.clone().oneshot(Request::get("/metrics").body(Body::empty()).unwrap()).await.unwrap();
    let text = String::from_utf8(metrics.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    assert!(text.contains("hangar_events_written_total 9"), "{text}");
    assert!(text.contains("hangar_events_sink_failing 0"), "{text}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unwritable_sink_leaves_the_server_serving_and_says_so_in_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("not-a-dir");
    std::fs::write(&blocker, b"").unwrap();
    let url = engine().await;
    let text = format!(
        "[[nodes]]\nid = \"n1\"\ngpus = 1\ngpu_memory = \"80GB\"\n\n[[models]]\nkey = \"t/m\"\n\
         engine = {{ kind = \"external\", url = \"{url}\" }}\nsize = \"10GB\"\nmin_replicas = 1\n"
    );
    let mut config = ServeConfig::from_toml(&text, "test").unwrap();
    config.events.path = Some(blocker.join("events.jsonl"));
    let server = Server::start(config, Default::default()).await.unwrap();
    let service = server
        .start_predictions(&Backend::Sqlite(dir.path().to_path_buf()), Default::default(), "http://test")
        .await
        .unwrap();
    let router = hangar_gateway::router(&server, &service, 1 << 20);
    let request = || {
        Request::post("/v1/chat/completions")
            .header("content-type", "application/json")
            .body(Body::from(
                json!({"model": "t/m", "messages": [{"role": "user", "content": "x"}]}).to_string(),
            ))
            .unwrap()
    };
    for _ in 0..3 {
        let r = router.clone().oneshot(request()).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        r.into_body().collect().await.unwrap();
    }
    flush(&server).await;
    let stats = server.events().stats().clone();
    assert_eq!(stats.dropped_sink_failed() + stats.dropped_full(), 3);
    let text = server.render_metrics();
    assert!(text.contains("hangar_events_sink_failing 1"), "{text}");
    assert!(text.contains("hangar_events_dropped_total{reason=\"sink_failed\"}"), "{text}");
    server.shutdown().await;
}
