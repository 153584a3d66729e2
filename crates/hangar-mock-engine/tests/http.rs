//! The mock engine over real HTTP: OpenAI endpoints, streaming, batching,
//! sleep mode and every bad-input path.

use std::time::Duration;

mod common;

use base64::Engine as _;
use common::{post, post_raw, start, start_with, Server};
use serde_json::{json, Value};

/// The `data:` payloads of an SSE response.
async fn sse(s: &Server, path: &str, body: Value) -> Vec<String> {
    let r = reqwest::Client::new().post(format!("{}{path}", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let text = r.text().await.unwrap();
    text.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_owned).collect()
}

fn words(n: usize) -> String {
    (0..n).map(|i| format!("word{}", i % 17)).collect::<Vec<_>>().join(" ")
}

#[tokio::test]
async fn chat_answers_with_exact_usage_and_deterministic_text() {
    let s = start().await;
    let body =
        json!({"model": "mock-llm", "messages": [{"role": "user", "content": words(300)}], "max_tokens": 5});
    let (status, a) = post(&s, "/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["choices"][0]["message"]["role"], "assistant");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(a["usage"]["completion_tokens"], 5);
    let prompt = a["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 300, "{prompt}");
    assert_eq!(a["usage"]["total_tokens"].as_u64().unwrap(), prompt + 5);
    let content = a["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(content.split(' ').count(), 5);
    let (_, b) = post(&s, "/v1/chat/completions", body).await;
    assert_eq!(b["choices"][0]["message"]["content"], content, "same prompt, same text");
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= 256, "the repeated prompt hits the prefix cache: {cached}");
}

#[tokio::test]
async fn chat_streams_one_chunk_per_token_then_usage_and_done() {
    let s = start().await;
    let events = sse(
        &s,
        "/v1/chat/completions",
        json!({"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7,
               "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: Vec<&Value> =
        chunks.iter().filter_map(|c| c["choices"].get(0)).filter_map(|c| c["delta"].get("content")).collect();
    assert_eq!(content.len(), 1 + 7, "the role chunk's empty content, then one per token");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 7);
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn completions_take_text_or_token_ids_and_stream() {
    let s = start().await;
    let (status, r) =
        post(&s, "/v1/completions", json!({"model": "mock-llm", "prompt": [1, 2, 3, 4], "max_tokens": 3}))
            .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "text_completion");
    assert_eq!(r["usage"]["prompt_tokens"], 4);
    assert_eq!(r["usage"]["completion_tokens"], 3);
    let (_, d) =
        post(&s, "/v1/completions", json!({"model": "mock-llm", "prompt": "Once upon a time"})).await;
    assert_eq!(d["usage"]["completion_tokens"], 16, "OpenAI's default max_tokens");
    let events = sse(
        &s,
        "/v1/completions",
        json!({"model": "mock-llm", "prompt": "x", "max_tokens": 4, "stream": true}),
    )
    .await;
    assert_eq!(events.len(), 4 + 1 + 1, "tokens, the finishing chunk, [DONE]");
}

#[tokio::test]
async fn embeddings_in_float_and_base64_agree() {
    let s = start().await;
    let (status, f) =
        post(&s, "/v1/embeddings", json!({"model": "mock-llm", "input": ["a cat", "a dog"]})).await;
    assert_eq!(status, 200, "{f}");
    assert_eq!(f["data"].as_array().unwrap().len(), 2);
    let floats: Vec<f32> =
        f["data"][0]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    assert_eq!(floats.len(), 384);
    let (_, b) = post(
        &s,
        "/v1/embeddings",
        json!({"model": "mock-llm", "input": "a cat", "encoding_format": "base64"}),
    )
    .await;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let decoded: Vec<f32> = bytes.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(decoded, floats);
    assert_eq!(b["usage"]["prompt_tokens"], 2);
}

#[tokio::test]
async fn models_lists_the_served_model() {
    let s = start().await;
    let r: Value = reqwest::get(format!("{}/v1/models", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!(r["data"][0]["id"], "mock-llm");
}

#[tokio::test]
async fn bad_requests_get_openai_errors_naming_the_problem() {
    let s = start_with(|c| c.max_body_bytes = 4096).await;
    let (st, e) = post_raw(&s, "/v1/chat/completions", b"{\"model\": \"mock-llm\", ".to_vec()).await;
    assert_eq!(st, 400);
    assert!(e["error"]["message"].as_str().unwrap().starts_with("the body is not valid JSON"), "{e}");
    let (st, e) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "mock-llm", "messages": [{"role": "user", "content": 3}]}),
    )
    .await;
    assert_eq!((st, e["error"]["param"].as_str()), (400, Some("messages[0].content")));
    let (st, e) =
        post(&s, "/v1/chat/completions", json!({"model": "mock-llm", "messages": [], "max_tokens": 1})).await;
    assert_eq!((st, e["error"]["param"].as_str()), (400, Some("messages")));
    let (st, e) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!((st, e["error"]["code"].as_str()), (404, Some("model_not_found")));
    let (st, _) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "mock-llm", "messages": [{"role": "user", "content": "x"}], "n": 2}),
    )
    .await;
    assert_eq!(st, 400);
    let (st, _) = post(&s, "/v1/completions", json!({"model": "mock-llm", "prompt": ["a", "b"]})).await;
    assert_eq!(st, 400);
    let (st, _) =
        post(&s, "/v1/embeddings", json!({"model": "mock-llm", "input": "x", "encoding_format": "hex"}))
            .await;
    assert_eq!(st, 400);
    let (st, _) = post(&s, "/v1/completions", json!({"model": "mock-llm", "prompt": words(5000)})).await;
    assert_eq!(st, 413, "bodies over the limit are refused");
    let (st, _) = post(&s, "/v2/whatever", json!({})).await;
    assert_eq!(st, 404);
}

#[tokio::test]
async fn concurrent_requests_share_passes() {
    let s = start().await;
    let reqs = (0..8).map(|i| {
        let body = json!({"model": "mock-llm", "messages": [{"role": "user", "content": format!("q{i}")}], "max_tokens": 30});
        let url = format!("{}/v1/chat/completions", s.base);
        async move { reqwest::Client::new().post(url).json(&body).send().await.unwrap().status() }
    });
    for status in futures::future::join_all(reqs).await {
        assert_eq!(status, 200);
    }
    let metrics = reqwest::get(format!("{}/metrics", s.base)).await.unwrap().text().await.unwrap();
    let max_batch: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("hangar_mock_max_batch_size "))
        .expect("max batch metric")
        .parse()
        .unwrap();
    assert!(max_batch >= 2.0, "eight concurrent requests were batched: {metrics}");
    assert!(metrics.contains("hangar_mock_generation_tokens_total 240"), "{metrics}");
}

/// Counters named as each format names them, under that format's own
/// `Content-Type`: a scraper reading OpenMetrics as the text format would
/// take every counter for an untyped series.
#[tokio::test]
async fn metrics_come_in_the_format_the_scraper_asks_for() {
    let s = start().await;
    let (status, _) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
    let client = reqwest::Client::new();
    let text = client.get(format!("{}/metrics", s.base)).send().await.unwrap();
    assert_eq!(text.headers()["content-type"], "text/plain; version=0.0.4; charset=utf-8");
    let text = text.text().await.unwrap();
    assert!(
        text.contains("# TYPE hangar_mock_requests_total counter\nhangar_mock_requests_total 1\n"),
        "{text}"
    );
    assert!(!text.contains("# EOF"), "{text}");
    let open = client
        .get(format!("{}/metrics", s.base))
        .header("accept", "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5")
        .send()
        .await
        .unwrap();
    assert_eq!(open.headers()["content-type"], "application/openmetrics-text; version=1.0.0; charset=utf-8");
    let open = open.text().await.unwrap();
    assert!(open.contains("# TYPE hangar_mock_requests counter\nhangar_mock_requests_total 1\n"), "{open}");
    assert!(open.ends_with("# EOF\n"), "{open}");
}

#[tokio::test]
async fn sleep_refuses_requests_until_wake_up() {
    let s = start().await;
    let client = reqwest::Client::new();
    let chat = json!({"model": "mock-llm", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2});
    assert_eq!(client.post(format!("{}/sleep", s.base)).send().await.unwrap().status(), 200);
    let r: Value = client.get(format!("{}/is_sleeping", s.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(r["is_sleeping"], true);
    let (st, e) = post(&s, "/v1/chat/completions", chat.clone()).await;
    assert_eq!(st, 503, "{e}");
    assert_eq!(client.post(format!("{}/wake_up", s.base)).send().await.unwrap().status(), 200);
    assert_eq!(post(&s, "/v1/chat/completions", chat).await.0, 200);
}

#[tokio::test]
async fn sleep_is_refused_while_requests_run_and_disconnects_abort() {
    let s = start().await;
    let client = reqwest::Client::new();
    let mut stream = client
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&json!({"model": "mock-llm", "messages": [{"role": "user", "content": "long"}], "max_tokens": 100000, "stream": true}))
        .send()
        .await
        .unwrap();
    stream.chunk().await.unwrap().expect("first chunk");
    let r = client.post(format!("{}/sleep", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 409);
    drop(stream);
    // The engine notices the dropped client at its next token.
    let mut aborted = false;
    for _ in 0..200 {
        let m = reqwest::get(format!("{}/metrics", s.base)).await.unwrap().text().await.unwrap();
        if m.contains("hangar_mock_requests_aborted_total 1") {
            aborted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(aborted, "the abandoned request was aborted");
    assert_eq!(client.post(format!("{}/sleep", s.base)).send().await.unwrap().status(), 200);
}

#[tokio::test]
async fn a_loading_engine_answers_503() {
    let s = start_with(|c| c.startup_delay = Duration::from_secs(3600)).await;
    assert_eq!(reqwest::get(format!("{}/health", s.base)).await.unwrap().status(), 503);
    let (st, e) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "mock-llm", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(st, 503);
    assert!(e["error"]["message"].as_str().unwrap().contains("loading"));
}

/// `--fail-while FILE`: every inference request is answered 500 while the
/// file exists — `/health` still 200 — and served again once it is gone.
#[tokio::test]
async fn while_its_fail_file_exists_every_request_fails_and_health_still_answers() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("fail");
    let s = start_with(|c| c.fail_while = Some(file.clone())).await;
    let body = json!({"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    assert_eq!(post(&s, "/v1/chat/completions", body.clone()).await.0, 200);
    std::fs::write(&file, b"").unwrap();
    let (status, a) = post(&s, "/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 500, "{a}");
    assert!(a["error"]["message"].as_str().unwrap().contains("told to fail"), "{a}");
    let completion = json!({"model": "mock-llm", "prompt": "hi", "max_tokens": 2});
    assert_eq!(post(&s, "/v1/completions", completion).await.0, 500);
    let health = reqwest::get(format!("{}/health", s.base)).await.unwrap().status();
    assert_eq!(health, 200);
    std::fs::remove_file(&file).unwrap();
    assert_eq!(post(&s, "/v1/chat/completions", body).await.0, 200);
}
