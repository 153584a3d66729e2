//! Live trace replay, the live half of `hangar sim live`: a `hangar serve`
//! child process on a given configuration, every request sent at its time
//! (an open loop: a late answer never delays the next request) as a
//! streaming completion whose prompt is token ids, its time to the first
//! streamed token recorded, and every model's replicas wanted read from
//! `/admin/status` on a fixed period.
//!
//! TTFT is measured from when the request was due, not from when it was
//! sent, so a client that falls behind shows as latency rather than
//! hiding it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Value};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::processes::start_serve_config;
use crate::BenchError;

/// One request of the replay.
#[derive(Debug, Clone)]
pub struct ReplayRequest {
    /// When it is sent, ms after the replay starts.
    pub at_ms: f64,
    /// The model.
    pub model: String,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: u32,
}

/// What one model's requests got.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ModelOutcome {
    /// TTFT of each answered request, ms, in completion order.
    pub ttft_ms: Vec<f64>,
    /// Requests that got no streamed token (an error status or a broken
    /// stream).
    pub failed: u64,
}

/// The replicas each model wanted at one moment.
#[derive(Debug, Clone, Serialize)]
pub struct LiveSample {
    /// Seconds after the replay started.
    pub t_s: f64,
    /// Replicas wanted, per model.
    pub desired: BTreeMap<String, u32>,
}

/// A whole live replay.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LiveRun {
    /// Per model.
    pub models: BTreeMap<String, ModelOutcome>,
    /// Every `sample_ms`, from the start until the last answer.
    pub samples: Vec<LiveSample>,
    /// The first few failures, for the report.
    pub errors: Vec<String>,
}

/// Failures kept word for word in [`LiveRun::errors`].
const ERRORS_KEPT: usize = 5;

/// Starts `hangar serve` on `config` (which must listen on port 0), replays
/// `requests` and samples the replicas wanted every `sample_ms`.
pub async fn replay(
    hangar_exe: &Path,
    config: &str,
    requests: Vec<ReplayRequest>,
    sample_ms: u64,
) -> Result<LiveRun, BenchError> {
    if sample_ms == 0 {
        return Err(BenchError::Options("the sample period must be above 0 ms".into()));
    }
    let server = start_serve_config(hangar_exe, config, "server").await?;
    let base = server.process.base_url.clone();
    let client = hangar_agent::direct_http()
        .pool_idle_timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| BenchError::Options(format!("cannot build an HTTP client: {e}")))?;
    let start = Instant::now();
    let samples = Arc::new(Mutex::new(Vec::new()));
    let status_url = format!("{base}/admin/status");
    let sampler = tokio::spawn(sample(client.clone(), status_url, start, sample_ms, samples.clone()));
    let url: Arc<str> = format!("{base}/v1/completions").into();
    let mut sent = JoinSet::new();
    for r in requests {
        let due = start + Duration::from_secs_f64(r.at_ms.max(0.0) / 1000.0);
        tokio::time::sleep_until(due).await;
        sent.spawn(one(client.clone(), url.clone(), r, due));
    }
    let mut run = LiveRun::default();
    while let Some(done) = sent.join_next().await {
        let (model, got) = done.expect("a request task does not panic");
        let outcome = run.models.entry(model.clone()).or_default();
        match got {
            Ok(ttft_ms) => outcome.ttft_ms.push(ttft_ms),
            Err(e) => {
                outcome.failed += 1;
                if run.errors.len() < ERRORS_KEPT {
                    run.errors.push(format!("{model}: {e}"));
                }
            }
        }
    }
    sampler.abort();
    let _ = sampler.await;
    run.samples = std::mem::take(&mut *samples.lock().expect("never poisoned: no panics while held"));
    drop(server);
    Ok(run)
}

/// Sends one request when it is due; its model and its TTFT in ms from
/// `due`, or why it got no token.
async fn one(
    client: reqwest::Client,
    url: Arc<str>,
    r: ReplayRequest,
    due: Instant,
) -> (String, Result<f64, String>) {
    let body = json!({
        "model": r.model, "prompt": r.prompt, "max_tokens": r.max_tokens, "stream": true,
    });
    let got = async {
        let mut response = client
            .post(&*url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        if !status.is_success() {
            let text = response.text().await.unwrap_or_default();
            return Err(format!("{status}: {}", text.chars().take(200).collect::<String>()));
        }
        let mut ttft = None;
        while let Some(chunk) = response.chunk().await.map_err(|e| e.to_string())? {
            if ttft.is_none() && chunk.windows(5).any(|w| w == b"data:") {
                ttft = Some(due.elapsed().as_secs_f64() * 1000.0);
            }
        }
        ttft.ok_or_else(|| "the stream ended without a token".to_owned())
    };
    (r.model, got.await)
}

/// Reads every model's replicas wanted every `period_ms` into `samples`
/// until the task is aborted.
///
/// Cancel safety: each sample is pushed whole, so an abort between two
/// reads loses nothing already read.
async fn sample(
    client: reqwest::Client,
    url: String,
    start: Instant,
    period_ms: u64,
    samples: Arc<Mutex<Vec<LiveSample>>>,
) {
    for k in 0u64.. {
        tokio::time::sleep_until(start + Duration::from_millis(k * period_ms)).await;
        let t_s = (k * period_ms) as f64 / 1000.0;
        let status: Option<Value> = async {
            let body = client.get(&url).send().await.ok()?.bytes().await.ok()?;
            serde_json::from_slice(&body).ok()
        }
        .await;
        let desired = status.as_ref().map(desired_by_model).unwrap_or_default();
        samples.lock().expect("never poisoned: no panics while held").push(LiveSample { t_s, desired });
    }
}

/// `models[].scaling.desired` of an `/admin/status` answer, by model.
fn desired_by_model(status: &Value) -> BTreeMap<String, u32> {
    status["models"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            let model = m["model"].as_str()?.to_owned();
            let desired = u32::try_from(m["scaling"]["desired"].as_u64()?).ok()?;
            Some((model, desired))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wanted_replicas_are_read_from_the_status() {
        let status = json!({"models": [
            {"model": "a", "scaling": {"desired": 2}},
            {"model": "b", "scaling": {"desired": 0}},
            {"model": "c", "scaling": null},
        ]});
        let got = desired_by_model(&status);
        assert_eq!(got, BTreeMap::from([("a".to_owned(), 2), ("b".to_owned(), 0)]));
    }
}
