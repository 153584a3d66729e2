//! Inference events of synchronous requests and predictions, through the
//! router with `oneshot`, in front of a fake engine (an axum server on
//! port 0).

use std::path::Path;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use hangar_core::{ErrorCode, Progress, RequestKind};
use hangar_predictions::store::Backend;
use hangar_runtime::events::InferenceEvent;
use hangar_runtime::serve::{ServeConfig, Server};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

/// An engine answering chat: with `usage` unless the prompt says
/// `no-usage`; SSE when `stream` (ending with a usage chunk when the
/// prompt says `with-usage`); 500 when the prompt says `fail`; after
/// 300 ms when it says `slow`. Completions
/// (what a prediction asks) stream two tokens.
async fn engine() -> String {
    async fn chat(Json(body): Json<Value>) -> axum::response::Response {
        use axum::response::IntoResponse;
        let prompt = body.pointer("/messages/0/content").and_then(Value::as_str).unwrap_or("").to_owned();
        if prompt.contains("fail") {
            return (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response();
        }
        if prompt.contains("slow") {
            tokio::time::sleep(Duration::from_millis(300)).await;
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
    start_with(dir, |_| {}).await
}

/// The test server with its events in `dir`, its configuration changed by
/// `edit` first: two public models (`t/trusted` priced, `t/untrusted`) and
/// `t/private` for account `beta` only; keys `k-acme` (account `acme`),
/// `k-beta` (`beta`) and `k-ops` (admin).
async fn start_with(dir: &Path, edit: impl FnOnce(&mut ServeConfig)) -> (Server, Router) {
    let url = engine().await;
    let text = format!(
        r#"
[[nodes]]
id = "n1"
gpus = 3
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

[[models]]
key = "t/private"
engine = {{ kind = "external", url = "{url}" }}
size = "10GB"
min_replicas = 1
access = ["beta"]

[[api_keys]]
key = "k-acme"
account = "acme"

[[api_keys]]
key = "k-beta"
account = "beta"

[[api_keys]]
key = "k-ops"
account = "ops"
admin = true
"#
    );
    let mut config = ServeConfig::from_toml(&text, "test").unwrap();
    config.events.path = Some(dir.join("events.jsonl"));
    edit(&mut config);
    let server = Server::start(config, Default::default()).await.unwrap();
    let service = server
        .start_predictions(&Backend::Sqlite(dir.to_path_buf()), Default::default(), "http://test")
        .await
        .unwrap();
    let router = hangar_gateway::router(&server, &service, 1 << 20);
    (server, router)
}

async fn chat(router: &Router, id: &str, body: Value) -> (StatusCode, Vec<u8>) {
    chat_as(router, "k-acme", id, body).await
}

async fn chat_as(router: &Router, key: &str, id: &str, body: Value) -> (StatusCode, Vec<u8>) {
    let request = Request::post("/v1/chat/completions")
        .header("authorization", format!("Bearer {key}"))
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
    // Its steps, in order and in time, a permit free on arrival.
    assert_eq!(step_names(e), ["received", "dispatched", "running", "completed"], "{e:?}");
    assert_eq!(e.steps[1].step, Progress::Dispatched { replica: e.replica.clone().unwrap() });
    assert!(e.steps.windows(2).all(|w| w[0].at_ms <= w[1].at_ms) && e.steps[3].at_ms == e.ts_ms, "{e:?}");
    assert_eq!(e.queue_position, None);

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
    assert_eq!(e.steps.last().unwrap().step, Progress::Error { code: Some(ErrorCode::EngineError) });

    // A stream that ends with the engine's usage: taken, not estimated.
    let e = by_id("req-6");
    assert_eq!((e.input_tokens, e.output_tokens, e.tokens_estimated), (7, 3, false), "{e:?}");

    let e = by_id("req-7");
    assert_eq!((e.status, e.code, e.replica.as_deref()), (400, Some(ErrorCode::BadRequest), None));
    assert_eq!((e.input_tokens, e.output_tokens, e.inference_ms, e.ttft_ms), (0, 0, 0, None));
    assert_eq!(step_names(e), ["received", "error"], "never dispatched: {e:?}");

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
    // A prediction's steps are lines of its logs.
    let replica = e.replica.as_deref().unwrap();
    let logs = format!("received\ndispatched to replica {replica}\nrunning\ncompleted\n");
    assert_eq!(prediction["logs"], logs.as_str(), "{prediction}");

    // The figures are in /metrics.
    let metrics =
        router.clone().oneshot(Request::get("/metrics").body(Body::empty()).unwrap()).await.unwrap();
    let text = String::from_utf8(metrics.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    assert!(text.contains("hangar_events_written_total 9"), "{text}");
    assert!(text.contains("hangar_events_sink_failing 0"), "{text}");
    server.shutdown().await;
}

fn step_names(e: &InferenceEvent) -> Vec<String> {
    e.steps
        .iter()
        .map(|s| serde_json::to_value(&s.step).unwrap()["step"].as_str().unwrap().to_owned())
        .collect()
}

/// A request that found every permit taken says where it queued and
/// when it left the line; so does a prediction, in its logs.
#[tokio::test(flavor = "multi_thread")]
async fn a_queued_request_reports_its_position_and_steps() {
    let dir = tempfile::tempdir().unwrap();
    let (server, router) = start_with(dir.path(), |c| {
        let model = c.models.iter_mut().find(|m| m.key.as_str() == "t/trusted").unwrap();
        model.concurrency = 1;
    })
    .await;
    let path = dir.path().join("events.jsonl");
    let slow = json!({"model": "t/trusted", "messages": [{"role": "user", "content": "slow"}]});
    let holder = tokio::spawn({
        let (router, slow) = (router.clone(), slow.clone());
        async move { chat(&router, "holder", slow).await }
    });
    while server.model("t/trusted").unwrap().processor().load().in_use == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (status, _) = chat(&router, "queued", slow).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(holder.await.unwrap().0, StatusCode::OK);

    let all = events(&server, &path, 2).await;
    let e = all.iter().find(|e| e.id == "queued").unwrap();
    assert_eq!(e.queue_position, Some(1), "{e:?}");
    assert_eq!(step_names(e), ["received", "queued", "dispatched", "running", "completed"], "{e:?}");
    assert_eq!(e.steps[1].step, Progress::Queued { position: 1 });
    assert!(e.steps.windows(2).all(|w| w[0].at_ms <= w[1].at_ms), "{e:?}");
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

/// `GET /v1/usage?{query}` with `key` (none: no key): the status and the
/// JSON answer.
async fn usage(router: &Router, key: Option<&str>, query: &str) -> (StatusCode, Value) {
    let mut request = Request::get(format!("/v1/usage?{query}"));
    if let Some(key) = key {
        request = request.header("authorization", format!("Bearer {key}"));
    }
    let response = router.clone().oneshot(request.body(Body::empty()).unwrap()).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// The groups of a usage answer as (group, requests).
fn groups(answer: &Value) -> Vec<(String, u64)> {
    answer["data"]
        .as_array()
        .unwrap_or_else(|| panic!("no data: {answer}"))
        .iter()
        .map(|g| (g["group"].as_str().unwrap().to_owned(), g["requests"].as_u64().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_account_sees_its_own_usage_and_an_admin_everyones() {
    let dir = tempfile::tempdir().unwrap();
    let (server, router) = start(dir.path()).await;
    let message = json!([{"role": "user", "content": "hello there"}]);
    for i in 0..3 {
        let body = json!({"model": "t/trusted", "messages": message});
        assert_eq!(chat_as(&router, "k-acme", &format!("a{i}"), body).await.0, StatusCode::OK);
    }
    for (i, model) in ["t/trusted", "t/private"].into_iter().enumerate() {
        let body = json!({"model": model, "messages": message});
        assert_eq!(chat_as(&router, "k-beta", &format!("b{i}"), body).await.0, StatusCode::OK);
    }

    // An account: its own, whatever it asks for.
    let (status, mine) = usage(&router, Some("k-acme"), "").await;
    assert_eq!(status, StatusCode::OK, "{mine}");
    assert_eq!(groups(&mine), [("t/trusted".to_owned(), 3)]);
    assert_eq!((mine["account"].as_str(), mine["group_by"].as_str()), (Some("acme"), Some("model")));
    assert_eq!(mine["total"]["input_tokens"], 33, "the engine's usage: {mine}");
    let usd = mine["total"]["usd"].as_f64().unwrap();
    assert!(usd >= 3.0 * (0.01 * 11.0 + 0.02 * 22.0) - 1e-9, "{mine}");
    let (status, refused) = usage(&router, Some("k-acme"), "account=beta").await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{refused}");
    assert_eq!(refused["error"]["param"], "account");
    assert_eq!(usage(&router, Some("k-acme"), "account=acme").await.0, StatusCode::OK);
    // A model it may not use does not exist for it; nothing of beta's shows.
    let (status, refused) = usage(&router, Some("k-acme"), "model=t/private").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{refused}");
    assert!(!refused.to_string().contains("beta"), "{refused}");
    let (_, theirs) = usage(&router, Some("k-beta"), "group_by=account").await;
    assert_eq!(groups(&theirs), [("beta".to_owned(), 2)]);

    // An admin: everyone's, or one account's, or one model's.
    let (_, all) = usage(&router, Some("k-ops"), "group_by=account").await;
    assert_eq!(groups(&all), [("acme".to_owned(), 3), ("beta".to_owned(), 2)]);
    assert_eq!(all["account"], Value::Null);
    let (_, one) = usage(&router, Some("k-ops"), "account=beta&model=t/private").await;
    assert_eq!(groups(&one), [("t/private".to_owned(), 1)]);
    // A model no longer served is still a valid question for an admin.
    let (status, gone) = usage(&router, Some("k-ops"), "model=t/retired").await;
    assert_eq!((status, gone["total"]["requests"].as_u64()), (StatusCode::OK, Some(0)));
    // Grouped by hour or day: all five in one group (unless the hour
    // turned between the requests and the question).
    let (_, hours) = usage(&router, Some("k-ops"), "group_by=hour").await;
    assert_eq!(hours["total"]["requests"], 5);
    assert!(groups(&hours).iter().all(|(g, _)| g.len() == 17 && g.ends_with(":00Z")), "{hours}");
    // A range: RFC 3339 or Unix seconds; one in the future has none.
    let now = hangar_runtime::serve::wall_ms() / 1000;
    let (_, later) = usage(&router, Some("k-ops"), &format!("from={}&to={}", now + 3600, now + 7200)).await;
    assert_eq!(later["total"]["requests"], 0);
    let (_, today) = usage(&router, Some("k-ops"), "from=2020-01-01T00:00:00Z").await;
    assert_eq!(today["total"]["requests"], 5);
    assert_eq!(today["from"], "2020-01-01T00:00:00Z");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_usage_questions_are_refused_naming_the_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let (server, router) = start(dir.path()).await;
    assert_eq!(usage(&router, None, "").await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(usage(&router, Some("k-wrong"), "").await.0, StatusCode::UNAUTHORIZED);
    for (query, param) in [
        ("from=yesterday", Some("from")),
        ("to=2026-13-40T00:00:00Z", Some("to")),
        ("from=2000&to=1000", Some("from")),
        ("group_by=week", Some("group_by")),
        ("model=../etc", Some("model")),
        ("account=a%20b", Some("account")),
        ("from=1&from=2", Some("from")),
        ("grup_by=model", None),
    ] {
        let (status, answer) = usage(&router, Some("k-ops"), query).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        match param {
            Some(param) => {
                assert_eq!(answer["error"]["param"], param, "{query}: {answer}");
                assert!(message.contains(&format!("`{param}`")), "{query}: {message}");
            }
            None => assert!(message.contains("`grup_by`"), "{message}"),
        }
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn usage_reads_the_rotated_files_too() {
    let dir = tempfile::tempdir().unwrap();
    let (server, router) = start_with(dir.path(), |c| {
        // A couple of events a file.
        c.events.max_file_bytes = hangar_core::ByteSize::new(1024);
        c.events.keep_files = 30;
    })
    .await;
    let message = json!([{"role": "user", "content": "hello there"}]);
    for i in 0..12 {
        let body = json!({"model": "t/trusted", "messages": message});
        assert_eq!(chat(&router, &format!("r{i}"), body).await.0, StatusCode::OK);
    }
    let (status, answer) = usage(&router, Some("k-acme"), "").await;
    assert_eq!((status, groups(&answer)), (StatusCode::OK, vec![("t/trusted".to_owned(), 12)]), "{answer}");
    let files = std::fs::read_dir(dir.path()).unwrap().flatten();
    let events = files.filter(|f| f.file_name().to_string_lossy().starts_with("events.jsonl")).count();
    assert!(events >= 4, "rotated: {events} files");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_server_without_events_says_it_has_no_usage() {
    let dir = tempfile::tempdir().unwrap();
    let (server, router) = start_with(dir.path(), |c| c.events.enabled = false).await;
    let (status, answer) = usage(&router, Some("k-ops"), "").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{answer}");
    assert!(answer["error"]["message"].as_str().unwrap().contains("enabled = false"), "{answer}");
    server.shutdown().await;
}
