//! What an engine can do beyond serving requests, found out when it
//! starts: whether it can sleep (give back its GPU memory and keep its
//! weights in CPU memory, the WARM tier) and through which API, whether it
//! serves Prometheus metrics and llama.cpp's slot view.
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
    Capabilities {
        sleep,
        metrics: answers("/metrics").await.is_some(),
        slots: answers("/slots").await.is_some(),
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
        Err(e) => format!("it could not be reached: {e}"),
    }
}
