//! Async predictions in `hangar serve`: the [`Executor`] that runs a
//! prediction through its model's processor and engine, and the start of
//! the predictions service beside the gateway.
//!
//! # Sync and async classes
//! A prediction enters the same per-model admission as a synchronous
//! request ([`Processor::admit`](crate::processor::Processor::admit)):
//! one line, one set of permits, with the line's own order (FIFO, or fair
//! over accounts) between the two classes. Two rules keep either class
//! from starving the other:
//! - at most `predictions.async_slots` predictions of a model are in its
//!   line or running at once (the rest wait in the durable queue), so a
//!   synchronous request never finds more than that many predictions ahead
//!   of it, and a backlog of predictions cannot fill the line (429s);
//! - a prediction never gets 429 or 504: when the line is full it backs off
//!   and asks again, and it waits without an admission timeout (its own
//!   deadlines bound it), so it is served in its turn however busy the
//!   synchronous path is.

use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use futures::StreamExt;
use hangar_predictions::llm::LlmInput;
use hangar_predictions::record::JobKind;
use hangar_predictions::{ExecError, Executor, Job, Model, PredictionsConfig, Service, ServiceError, Sink};
use hangar_router::text_blocks;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::prompt::prompt_text;
use super::{Inner, ReplicaRouting, Server};
use crate::processor::AdmitError;

/// Runs predictions on this server's models.
struct ServeExecutor {
    inner: Arc<Inner>,
}

impl Executor for ServeExecutor {
    fn execute(&self, job: Job, sink: Sink, cancel: CancellationToken) -> hangar_predictions::ExecFuture {
        let inner = self.inner.clone();
        Box::pin(async move {
            tokio::select! {
                r = complete(inner, job, sink) => r,
                _ = cancel.cancelled() => Err(ExecError::Canceled),
            }
        })
    }
}

/// Admits `job` and streams its completion from the engine into `sink`.
///
/// # Cancel safety
/// Dropping the future leaves the line or gives the permit back, and
/// drops the engine connection (the engine stops generating).
async fn complete(inner: Arc<Inner>, job: Job, sink: Sink) -> Result<Value, ExecError> {
    if job.kind == JobKind::Training {
        return Err(ExecError::Failed(format!(
            "the model `{}` runs on an engine that serves completions and cannot train; trainings need an \
             engine that runs a trainer (the `cog` engine kind, not available yet)",
            job.model
        )));
    }
    let rt = inner
        .models
        .get(&job.model)
        .cloned()
        .ok_or_else(|| ExecError::Failed(format!("the model `{}` is not served", job.model)))?;
    let input = LlmInput::parse(&job.input).map_err(|e| ExecError::Failed(e.to_string()))?;
    let body = input.completion_body(rt.config.key.as_str());
    let prompt = match rt.config.router {
        ReplicaRouting::Kv => Some(text_blocks(&prompt_text(&body), rt.config.kv.block_chars)),
        _ => None,
    };
    inner.scale_for_demand(&rt, 1);
    let lease = loop {
        let prompt = prompt.as_ref().map(|(blocks, tokens)| (&blocks[..], *tokens));
        match rt.processor.admit_with(job.account.clone(), None, prompt).await {
            Ok(lease) => break lease,
            // The line is full of synchronous requests: yield to them.
            Err(AdmitError::QueueFull { .. }) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => return Err(ExecError::Failed(format!("no replica could serve it: {e}"))),
        }
    };
    sink.started();
    let base =
        rt.replica_url(lease.replica).ok_or_else(|| ExecError::Failed("the replica went away".into()))?;
    let body = serde_json::to_vec(&body).expect("JSON serializes");
    let response = inner
        .client
        .post(format!("{base}/v1/completions"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| ExecError::Failed(format!("the replica did not answer: {e}")))?;
    if !response.status().is_success() {
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        return Err(ExecError::Failed(format!("the engine answered {status}: {text}")));
    }
    let mut tokens = Vec::new();
    let mut buffer = String::new();
    let mut chunks = response.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| ExecError::Failed(format!("the engine stream broke: {e}")))?;
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            for data in event.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim) {
                if data == "[DONE]" {
                    return Ok(Value::Array(tokens));
                }
                let v: Value = serde_json::from_str(data)
                    .map_err(|e| ExecError::Failed(format!("the engine sent a malformed event: {e}")))?;
                if let Some(err) = v.get("error") {
                    return Err(ExecError::Failed(format!("the engine failed: {err}")));
                }
                if let Some(text) = v.pointer("/choices/0/text").and_then(Value::as_str) {
                    if !text.is_empty() {
                        let token = Value::String(text.to_owned());
                        sink.output(token.clone());
                        tokens.push(token);
                    }
                }
            }
        }
    }
    Ok(Value::Array(tokens))
}

impl Server {
    /// Starts the predictions service on this server's models, storing in
    /// `data_dir`; `base_url` is where clients reach the server. Merge
    /// [`Service::router`] into the gateway's router.
    pub fn start_predictions(
        &self,
        data_dir: &std::path::Path,
        config: PredictionsConfig,
        base_url: &str,
    ) -> Result<Service, ServiceError> {
        let models = self
            .inner
            .models
            .values()
            .map(|rt| Model {
                key: rt.config.key.to_string(),
                version: hangar_predictions::version_id(
                    &serde_json::to_string(&rt.config).unwrap_or_default(),
                ),
                settings: rt.config.predictions,
                access: rt.config.access.clone(),
            })
            .collect();
        let executor = Arc::new(ServeExecutor { inner: self.inner.clone() });
        let api_keys =
            self.inner.api_keys.iter().map(|(key, (account, _))| (key.clone(), account.clone())).collect();
        Service::start(data_dir, config, models, api_keys, executor, base_url)
    }
}
