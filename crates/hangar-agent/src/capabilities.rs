//! What an engine can do beyond serving requests, found out when it
//! starts: whether it can sleep (give back its GPU memory and keep its
//! weights in CPU memory, the WARM tier) and through which API, whether it
//! loads LoRA adapters at run time, whether it serves Prometheus metrics
//! and llama.cpp's slot view.
//!
//! Engines differ: vLLM sleeps through `/sleep` and `/wake_up` (and says
//! so at `/is_sleeping`), SGLang through `/release_memory_occupation` and
//! `/resume_memory_occupation` (it describes itself at
//! `/get_server_info`), llama.cpp's server has no sleep at all. An engine
//! that cannot sleep is stopped when its replica leaves the GPU, so no
//! replica is ever counted WARM while its process holds the memory.

use std::time::Duration;

use serde::Serialize;

use crate::engine::EngineSpec;

/// What one running engine can do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    /// How it sleeps, if it can.
    pub sleep: Option<SleepApi>,
    /// It serves `/metrics`.
    pub metrics: bool,
    /// It serves llama.cpp's `/slots`.
    pub slots: bool,
    /// It loads LoRA adapters at run time (vLLM's `/v1/load_lora_adapter`,
    /// served with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`).
    pub lora: bool,
}

/// An engine's way of sleeping and waking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SleepApi {
    /// vLLM's sleep mode (and Hangar's mock engine).
    Vllm,
    /// SGLang's memory release.
    Sglang,
}

impl SleepApi {
    /// The call that puts it to sleep.
    pub fn sleep_path(self) -> &'static str {
        match self {
            SleepApi::Vllm => "/sleep",
            SleepApi::Sglang => "/release_memory_occupation",
        }
    }

    /// The call that wakes it.
    pub fn wake_path(self) -> &'static str {
        match self {
            SleepApi::Vllm => "/wake_up",
            SleepApi::Sglang => "/resume_memory_occupation",
        }
    }

    /// The read-only call that says its state, which it answers asleep
    /// too (vLLM's asks the engine core): the health check of an engine
    /// that sleeps, so one that hung asleep is found before a wake needs
    /// it.
    pub fn state_path(self) -> &'static str {
        match self {
            SleepApi::Vllm => "/is_sleeping",
            SleepApi::Sglang => "/get_server_info",
        }
    }
}

/// How long one probe may take: an engine that has just answered its
/// readiness check answers these at once, or not at all.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Finds out what the engine of `spec` at `base` can do. A cog server
/// has none of these; any other engine is asked.
pub async fn probe(client: &reqwest::Client, base: &str, spec: &EngineSpec) -> Capabilities {
    if spec.is_cog() {
        return Capabilities::default();
    }
    let answers = |path: &'static str| async move {
        let r = client.get(format!("{base}{path}")).timeout(PROBE_TIMEOUT).send().await.ok()?;
        r.status().is_success().then_some(r)
    };
    let vllm = match answers("/is_sleeping").await {
        Some(r) => r.json::<serde_json::Value>().await.is_ok_and(|v| v.get("is_sleeping").is_some()),
        None => false,
    };
    let sleep = if vllm {
        Some(SleepApi::Vllm)
    } else if answers("/get_server_info").await.is_some() {
        Some(SleepApi::Sglang)
    } else {
        None
    };
    // An empty body loads nothing: an engine with the route refuses it
    // (400 or 422), one without answers 404.
    let lora = client
        .post(format!("{base}/v1/load_lora_adapter"))
        .json(&serde_json::json!({}))
        .timeout(PROBE_TIMEOUT)
        .send()
        .await
        .is_ok_and(|r| {
            ![reqwest::StatusCode::NOT_FOUND, reqwest::StatusCode::METHOD_NOT_ALLOWED].contains(&r.status())
        });
    Capabilities {
        sleep,
        metrics: answers("/metrics").await.is_some(),
        slots: answers("/slots").await.is_some(),
        lora,
    }
}

/// An engine's answer that was not a success, as one line for the log:
/// the status and the start of the body.
pub async fn describe(answer: Result<reqwest::Response, reqwest::Error>) -> String {
    match answer {
        Ok(r) => {
            let status = r.status();
            let body = r.text().await.unwrap_or_default();
            let body: String = body.split_whitespace().collect::<Vec<_>>().join(" ");
            let body: String = body.chars().take(200).collect();
            if body.is_empty() {
                format!("it answered {status}")
            } else {
                format!("it answered {status}: {body}")
            }
        }
        Err(e) if e.is_timeout() => "it did not answer in time".into(),
        Err(e) => format!("it could not be reached: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;
    use axum::routing::{get, post};

    use super::*;

    /// Serves `app` on a free loopback port until the test ends.
    async fn serve(app: axum::Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    fn openai() -> EngineSpec {
        EngineSpec::Openai { command: "x".into(), readiness_path: "/health".into(), setup_timeout_s: 1 }
    }

    #[tokio::test]
    async fn each_engine_is_asked_what_it_can_do() {
        let client = reqwest::Client::new();
        // SGLang-like: server info, LoRA route that refuses an empty body.
        let sglang = axum::Router::new()
            .route("/get_server_info", get(|| async { "{}" }))
            .route("/v1/load_lora_adapter", post(|| async { StatusCode::BAD_REQUEST }))
            .route("/metrics", get(|| async { "" }));
        let caps = probe(&client, &serve(sglang).await, &openai()).await;
        assert_eq!(
            caps,
            Capabilities { sleep: Some(SleepApi::Sglang), metrics: true, slots: false, lora: true }
        );
        // vLLM-like: /is_sleeping answers with the field.
        let vllm = axum::Router::new().route("/is_sleeping", get(|| async { r#"{"is_sleeping": false}"# }));
        assert_eq!(probe(&client, &serve(vllm).await, &openai()).await.sleep, Some(SleepApi::Vllm));
        // llama.cpp-like: slots, no sleep, no LoRA route.
        let llama = axum::Router::new().route("/slots", get(|| async { "[]" }));
        let caps = probe(&client, &serve(llama).await, &openai()).await;
        assert_eq!(caps, Capabilities { sleep: None, metrics: false, slots: true, lora: false });
        // Nothing answers: nothing claimed.
        assert_eq!(probe(&client, "http://127.0.0.1:9", &openai()).await, Capabilities::default());
    }
}
