//! Workers AI's async mode on the OpenAI routes (`options.queueRequest`,
//! followed up with `inputs.request_id`), through the router with
//! `oneshot`, in front of a fake engine on port 0 that holds the requests
//! it is told to until the test lets them go.

mod common;

use common::Served;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use hangar_predictions::store::Backend;
use hangar_predictions::PredictionsConfig;
use hangar_runtime::events::InferenceEvent;
use hangar_runtime::serve::{ServeConfig, Server};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Mutex, Semaphore};
use tower::ServiceExt;

/// A fake engine. Its chat answer says what it was sent (`seen`: whether
/// the body had `stream` and `options`), names its model as an engine
/// started on a path would, and carries a `usage`. A prompt holding
/// `hold` waits for a permit of `gate` first (and says it arrived on
/// `arrived`); one holding `fail` is refused with 400 and an OpenAI error.
#[derive(Clone)]
struct Engine {
    url: String,
    gate: Arc<Semaphore>,
    arrived: Arc<Mutex<mpsc::UnboundedReceiver<String>>>,
    /// Chat requests answered or refused.
    answered: Arc<AtomicUsize>,
}

impl Engine {
    /// Lets `n` held requests go.
    fn release(&self, n: usize) {
        self.gate.add_permits(n);
    }

    /// Waits until a held request with this prompt has arrived.
    async fn arrival(&self) -> String {
        self.arrived.lock().await.recv().await.expect("the engine runs")
    }
}

#[derive(Clone)]
struct EngineState {
    gate: Arc<Semaphore>,
    arrived: mpsc::UnboundedSender<String>,
    answered: Arc<AtomicUsize>,
}

async fn engine() -> Engine {
    async fn chat(State(s): State<EngineState>, Json(body): Json<Value>) -> axum::response::Response {
        use axum::response::IntoResponse;
        let prompt = body.pointer("/messages/0/content").and_then(Value::as_str).unwrap_or("").to_owned();
        if prompt.contains("hold") {
            let _ = s.arrived.send(prompt.clone());
            s.gate.acquire().await.expect("never closed").forget();
        }
        s.answered.fetch_add(1, Ordering::SeqCst);
        if prompt.contains("fail") {
            let refusal =
                json!({"error": {"message": "the prompt is refused", "type": "invalid_request_error"}});
            return (StatusCode::BAD_REQUEST, Json(refusal)).into_response();
        }
        Json(json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "/weights/engine-name",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("echo {prompt}")}}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 22, "total_tokens": 33},
            "seen": {"stream": body.get("stream").is_some(), "options": body.get("options").is_some()},
        }))
        .into_response()
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let state = EngineState { gate: Arc::new(Semaphore::new(0)), arrived: tx, answered: Arc::default() };
    let engine = Engine {
        url: String::new(),
        gate: state.gate.clone(),
        arrived: Arc::new(Mutex::new(rx)),
        answered: state.answered.clone(),
    };
    async fn embed(Json(body): Json<Value>) -> Json<Value> {
        Json(json!({
            "object": "list",
            "model": "/weights/engine-name",
            "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
            "usage": {"prompt_tokens": 2, "total_tokens": 2},
            "seen": {"stream": body.get("stream").is_some(), "options": body.get("options").is_some()},
        }))
    }
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/embeddings", post(embed))
        .route("/v1/chat/completions", post(chat))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Engine { url: format!("http://{addr}"), ..engine }
}

/// A server in front of `engine` with its events in `dir`: `t/async`
/// (`use_async_queue`), `t/again` (the same, its predictions idempotent)
/// and `t/sync` (without); keys `k-acme` (account `acme`) and `k-beta`
/// (`beta`). A queued request is waited for `wait_ms` before 202.
async fn serve(dir: &Path, backend: Backend, engine: &Engine, wait_ms: u64) -> Served {
    let url = &engine.url;
    let text = format!(
        r#"
[[nodes]]
id = "n1"
gpus = 3
gpu_memory = "80GB"

[[models]]
key = "t/async"
engine = {{ kind = "external", url = "{url}" }}
size = "10GB"
min_replicas = 1
use_async_queue = true

[[models]]
key = "t/again"
engine = {{ kind = "external", url = "{url}" }}
size = "10GB"
min_replicas = 1
use_async_queue = true
predictions = {{ idempotent = true }}

[[models]]
key = "t/sync"
engine = {{ kind = "external", url = "{url}" }}
size = "10GB"
min_replicas = 1

[[api_keys]]
key = "k-acme"
account = "acme"

[[api_keys]]
key = "k-beta"
account = "beta"
"#
    );
    let mut config = ServeConfig::from_toml(&text, "test").unwrap();
    config.events.path = Some(dir.join("events.jsonl"));
    let predictions = PredictionsConfig { queue_request_wait_ms: wait_ms, ..Default::default() };
    common::serve(config, &backend, predictions).await
}

/// POSTs `body` to `path` as `key`: the status and the JSON answer.
async fn post_as(router: &Router, key: &str, path: &str, body: Value) -> (StatusCode, Value) {
    let (status, answer) = common::call(router, "POST", path, Some(key), &[], Some(&body)).await;
    assert!(!answer.is_null(), "{path} answered {status} without JSON");
    (status, answer)
}

/// A chat request for `model` saying `prompt`, queued.
fn queued(model: &str, prompt: &str) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": true,
        "options": {"queueRequest": true},
    })
}

/// The follow-up about request `id` of `model`.
fn follow_up(model: &str, id: &str) -> Value {
    json!({"model": model, "inputs": {"request_id": id}})
}

/// Asks about request `id` until it is no longer waiting or running (a
/// bounded poll, 10 s at most): the answer then.
async fn until_ended(router: &Router, model: &str, id: &str) -> (StatusCode, Value) {
    for _ in 0..500 {
        let (status, answer) = post_as(router, "k-acme", "/v1/chat/completions", follow_up(model, id)).await;
        if status != StatusCode::ACCEPTED {
            return (status, answer);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("request {id} did not end");
}

/// Asks about request `id` until it says `running` (a bounded poll): its
/// engine holds it, and its start may take a moment to be stored.
async fn until_running(router: &Router, model: &str, id: &str) -> Value {
    for _ in 0..500 {
        let (status, answer) = post_as(router, "k-acme", "/v1/chat/completions", follow_up(model, id)).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
        if answer["status"] == "running" {
            return answer;
        }
        assert_eq!(answer["status"], "queued", "{answer}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("request {id} never ran");
}

/// The value of the server's metric `series` (0 if it has none).
fn metric(server: &Server, series: &str) -> u64 {
    let text = server.render_metrics();
    let value = text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' '));
    value.map_or(0, |v| v.parse().unwrap_or_else(|_| panic!("{series} {v}")))
}

/// Waits (a bounded poll) until `series` reads `n`: a prediction's end is
/// stored, and so answered to a follow-up, a moment before it is counted.
async fn until_counted(server: &Server, series: &str, n: u64) {
    for _ in 0..500 {
        if metric(server, series) == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(metric(server, series), n, "{series}");
}

/// Every event written so far, the sink flushed first.
async fn events(server: &Server, dir: &Path) -> Vec<InferenceEvent> {
    let sink = server.events().clone();
    let flushed = tokio::task::spawn_blocking(move || sink.flush(Duration::from_secs(30))).await.unwrap();
    assert!(flushed, "the writer flushes");
    let text = std::fs::read_to_string(dir.join("events.jsonl")).unwrap_or_default();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// A queued request whose engine answers within the wait is answered at
/// once, 200 with the engine's answer named for the model; the engine was
/// sent neither `stream` nor `options`; it is counted once, as a
/// prediction, with its event's tokens from the engine's usage. A model
/// without `use_async_queue` serves the same body synchronously, passing
/// `options` on.
#[tokio::test(flavor = "multi_thread")]
async fn a_quick_answer_comes_at_once_and_a_model_without_the_queue_serves_synchronously() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine().await;
    let s = serve(dir.path(), Backend::Sqlite(dir.path().into()), &engine, 30_000).await;

    let (status, answer) =
        post_as(&s.router, "k-acme", "/v1/chat/completions", queued("t/async", "hi")).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["choices"][0]["message"]["content"], "echo hi", "{answer}");
    assert_eq!(answer["model"], "t/async", "renamed for the client: {answer}");
    assert_eq!(answer["seen"], json!({"stream": false, "options": false}), "stream and options dropped");
    let requests = |kind: &str, status: u16| {
        metric(
            &s.server,
            &format!("hangar_requests_total{{model=\"t/async\",kind=\"{kind}\",status=\"{status}\"}}"),
        )
    };
    // Counted as its job ends, which its answer may overtake.
    for _ in 0..500 {
        if requests("prediction", 200) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!((requests("prediction", 200), requests("sync", 200)), (1, 0), "counted once, as a prediction");

    // Sent on the path it came in on.
    let body = json!({"model": "t/async", "input": "two words", "options": {"queueRequest": true}});
    let (status, answer) = post_as(&s.router, "k-acme", "/v1/embeddings", body).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!((answer["object"].as_str(), answer["model"].as_str()), (Some("list"), Some("t/async")));
    assert_eq!(answer["seen"], json!({"stream": false, "options": false}));

    let body = json!({"model": "t/sync", "messages": [{"role": "user", "content": "hi"}], "options": {"queueRequest": true}});
    let (status, answer) = post_as(&s.router, "k-acme", "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["seen"], json!({"stream": false, "options": true}), "passed on untouched: {answer}");
    assert_eq!(metric(&s.server, "hangar_requests_total{model=\"t/sync\",kind=\"sync\",status=\"200\"}"), 1);
    assert_eq!(engine.answered.load(Ordering::SeqCst), 2, "each ran once");

    // Each is sent as its job ends, which its answer may overtake.
    let mut all = events(&s.server, dir.path()).await;
    for _ in 0..500 {
        if all.iter().filter(|e| e.model == "t/async").count() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        all = events(&s.server, dir.path()).await;
    }
    let mut queued: Vec<_> = all.iter().filter(|e| e.model == "t/async").collect();
    queued.sort_by_key(|e| e.input_tokens);
    let tokens: Vec<_> =
        queued.iter().map(|e| (e.input_tokens, e.output_tokens, e.tokens_estimated)).collect();
    assert_eq!(tokens, [(2, 0, false), (11, 22, false)], "one event each, the engine's usage: {all:?}");
    for e in queued {
        assert_eq!((e.kind, e.status, e.code), (hangar_core::RequestKind::Prediction, 200, None), "{e:?}");
    }
    s.stop().await;
}

/// A slow answer: 202 with the request's id, `running` to a follow-up
/// while its engine works, then the answer — and the engine's refusal,
/// its status and body, for one that fails. Ids of another account, of
/// nobody and of another route are 404 naming the id; a malformed field is
/// a 400 naming it.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_answer_is_a_202_then_the_follow_up_answers_it_and_only_to_its_account() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine().await;
    let s = serve(dir.path(), Backend::Sqlite(dir.path().into()), &engine, 50).await;
    let chat = "/v1/chat/completions";

    let (status, accepted) = post_as(&s.router, "k-acme", chat, queued("t/async", "hold on")).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{accepted}");
    assert_eq!(accepted["model"], "t/async");
    assert!(["queued", "running"].contains(&accepted["status"].as_str().unwrap()), "{accepted}");
    let id = accepted["request_id"].as_str().unwrap().to_owned();
    assert_eq!(engine.arrival().await, "hold on");
    let running = until_running(&s.router, "t/async", &id).await;
    assert_eq!(running, json!({"request_id": id, "status": "running", "model": "t/async"}));

    // Nobody else learns of it.
    for (key, path, body) in [
        ("k-beta", chat, follow_up("t/async", &id)),
        ("k-acme", chat, follow_up("t/async", "no-such-request")),
        ("k-acme", "/v1/completions", follow_up("t/async", &id)),
    ] {
        let (status, answer) = post_as(&s.router, key, path, body.clone()).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{key} {path} {body}: {answer}");
        let named = body["inputs"]["request_id"].as_str().unwrap();
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(&format!("`{named}`")), "{message}");
        assert_eq!(answer["error"]["param"], "inputs.request_id");
    }
    // Nor is it a prediction to the predictions API.
    let get = Request::get(format!("/v1/predictions/{id}")).header("authorization", "Bearer k-acme");
    let response = s.router.clone().oneshot(get.body(Body::empty()).unwrap()).await.unwrap();
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    let (status, answer) =
        post_as(&s.router, "k-acme", chat, json!({"model": "t/async", "inputs": {"request_id": 7}})).await;
    assert_eq!((status, &answer["error"]["param"]), (StatusCode::BAD_REQUEST, &json!("inputs.request_id")));
    let mut bad = queued("t/async", "x");
    bad["options"]["queueRequest"] = json!("yes");
    let (status, answer) = post_as(&s.router, "k-acme", chat, bad).await;
    assert_eq!(
        (status, &answer["error"]["param"]),
        (StatusCode::BAD_REQUEST, &json!("options.queueRequest"))
    );

    engine.release(1);
    let (status, answer) = until_ended(&s.router, "t/async", &id).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["choices"][0]["message"]["content"], "echo hold on");
    assert_eq!(answer["model"], "t/async");
    // Asked again, the same answer.
    let (again, _) = post_as(&s.router, "k-acme", chat, follow_up("t/async", &id)).await;
    assert_eq!(again, StatusCode::OK);

    let (status, accepted) = post_as(&s.router, "k-acme", chat, queued("t/async", "hold and fail")).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{accepted}");
    let failing = accepted["request_id"].as_str().unwrap().to_owned();
    assert_eq!(engine.arrival().await, "hold and fail");
    engine.release(1);
    let (status, answer) = until_ended(&s.router, "t/async", &failing).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "the engine's status: {answer}");
    assert_eq!(answer["error"]["message"], "the prompt is refused", "the engine's body: {answer}");
    let name = |name: &str, labels: &str| format!("{name}{{model=\"t/async\",{labels}}}");
    let series = |n: &str, labels: &str| metric(&s.server, &name(n, labels));
    until_counted(&s.server, &name("hangar_requests_total", "kind=\"prediction\",status=\"400\""), 1).await;
    until_counted(&s.server, &name("hangar_errors_total", "kind=\"prediction\",code=\"engine_error\""), 1)
        .await;
    assert_eq!(series("hangar_requests_total", "kind=\"prediction\",status=\"200\""), 1);
    // The two refusals of the mode's fields are counted as synchronous
    // requests refused; the polls not at all.
    assert_eq!(series("hangar_requests_total", "kind=\"sync\",status=\"400\""), 2);
    assert_eq!(series("hangar_requests_total", "kind=\"sync\",status=\"200\""), 0);
    assert_eq!(engine.answered.load(Ordering::SeqCst), 2, "each ran once");
    s.stop().await;
}

/// Queued requests outlive their server: restarted on the same SQLite
/// store, the one whose model is idempotent runs again and is answered;
/// the other, interrupted while it ran, says the server stopped.
#[tokio::test(flavor = "multi_thread")]
async fn a_restart_on_the_same_store_keeps_a_queued_request_answerable() {
    let dir = tempfile::tempdir().unwrap();
    let backend = Backend::Sqlite(dir.path().into());
    let stuck = engine().await;
    for events in ["a", "b"] {
        std::fs::create_dir_all(dir.path().join(events)).unwrap();
    }
    let first = serve(&dir.path().join("a"), backend.clone(), &stuck, 50).await;
    let chat = "/v1/chat/completions";
    let mut ids = Vec::new();
    for model in ["t/again", "t/async"] {
        let (status, accepted) = post_as(&first.router, "k-acme", chat, queued(model, "hold forever")).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{accepted}");
        ids.push(accepted["request_id"].as_str().unwrap().to_owned());
        stuck.arrival().await;
    }
    // Both run, held by an engine that never answers, when the server
    // stops.
    first.stop().await;

    let engine = engine().await;
    engine.release(16);
    let second = serve(&dir.path().join("b"), backend, &engine, 50).await;
    let (status, answer) = until_ended(&second.router, "t/again", &ids[0]).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["choices"][0]["message"]["content"], "echo hold forever");
    let (status, answer) = until_ended(&second.router, "t/async", &ids[1]).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains("server stopped"), "{message}");
    assert_eq!(stuck.answered.load(Ordering::SeqCst), 0);
    second.stop().await;
}

/// The same on Redis Streams, the fleet's store: a quick answer at once,
/// a slow one through its follow-up.
#[tokio::test(flavor = "multi_thread")]
async fn queued_requests_run_on_redis_streams_too() {
    let Some(redis) = hangar_redis::LocalRedis::for_test() else { return };
    let dir = tempfile::tempdir().unwrap();
    let backend = Backend::Redis(hangar_redis::Redis::connect(&redis.url()).unwrap());
    let engine = engine().await;
    let s = serve(dir.path(), backend, &engine, 50).await;
    let chat = "/v1/chat/completions";
    let (status, accepted) = post_as(&s.router, "k-acme", chat, queued("t/async", "hold it")).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{accepted}");
    let id = accepted["request_id"].as_str().unwrap().to_owned();
    engine.arrival().await;
    until_running(&s.router, "t/async", &id).await;
    engine.release(1);
    let (status, answer) = until_ended(&s.router, "t/async", &id).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["choices"][0]["message"]["content"], "echo hold it");
    let (status, _) = post_as(&s.router, "k-beta", chat, follow_up("t/async", &id)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    s.stop().await;
}
