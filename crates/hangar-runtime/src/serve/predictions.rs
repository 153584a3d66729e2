//! Async predictions in `hangar serve`: the [`Executor`] that runs a
//! prediction through its model's processor and engine — a streamed
//! completion on OpenAI-style engines, cog's protocol ([`hangar_agent::cog`]) on
//! `cog` engines, a training on a replica of the model's trainer (a cog
//! server in train mode, placed as any model's; config/trainers.rs), a
//! request of the OpenAI routes queued in Workers AI's async mode (its
//! stored body sent to its path, the answer read whole) — and the start of
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

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::header;
use futures::StreamExt;
use hangar_core::{AccountId, Adapter, AdapterName, BlockHash, ErrorCode, Millis, Progress, ReplicaId};
use hangar_predictions::llm::LlmInput;
use hangar_predictions::record::{JobKind, Record};
use hangar_predictions::request::{Answer, QueuedRequest};
use hangar_predictions::store::Backend;
use hangar_predictions::{
    AdapterRefused, ExecError, Executor, InputRules, InstanceBounds, Job, Model, PredictionsConfig, Service,
    ServiceError, Sink,
};
use serde::Deserialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::{replica_name, Inner, ModelRuntime, Server};
use crate::events::{
    estimate_answer, estimate_tokens, prediction_event, request_kind, InferenceEvent, Runs, Usage,
};
use crate::processor::{AdmitError, Lease, Patience, Wait};
use hangar_agent::cog::{self, CogError, CogJob, CogMode};

/// Runs predictions on this server's models.
struct ServeExecutor {
    inner: Arc<Inner>,
    /// What each run learns for its prediction's event (only kept when
    /// events are written).
    runs: Arc<Runs>,
}

impl Executor for ServeExecutor {
    fn check_bounds(&self, model: &str, bounds: InstanceBounds) -> Result<(), String> {
        let rt = self.inner.models.get(model).ok_or_else(|| format!("the model `{model}` is not served"))?;
        rt.config.check_bounds(scaler_bounds(bounds)).map_err(|e| e.to_string())
    }

    /// Sends the bounds to the controller (its own from the config for
    /// `None`); a controller given the bounds it has changes nothing.
    fn apply_bounds(&self, model: &str, bounds: Option<InstanceBounds>) -> hangar_predictions::BoundsFuture {
        let inner = self.inner.clone();
        let model = model.to_owned();
        Box::pin(async move {
            let rt = inner.models.get(&model).ok_or_else(|| format!("the model `{model}` is not served"))?;
            let bounds = bounds.map_or(
                hangar_scaler::Bounds { min: rt.config.min_replicas, max: rt.config.max_replicas() },
                scaler_bounds,
            );
            let command = super::ScalingCommand::Bounds(bounds);
            inner.control.scaling(&rt.config.key, command).await.map_err(|e| e.to_string())
        })
    }

    fn check_adapter(
        &self,
        model: &str,
        adapter: &str,
        account: &AccountId,
    ) -> hangar_predictions::AdapterCheck {
        let inner = self.inner.clone();
        let (model, adapter, account) = (model.to_owned(), adapter.to_owned(), account.clone());
        Box::pin(async move { run_adapter(&inner, &model, &adapter, &account).await.map(drop) })
    }

    fn execute(&self, job: Job, sink: Sink, cancel: CancellationToken) -> hangar_predictions::ExecFuture {
        let inner = self.inner.clone();
        let runs = inner.events.enabled().then(|| self.runs.clone());
        Box::pin(async move {
            let run = Run { job: &job, runs: runs.as_deref() };
            // Its steps, one log line each: received (its run here starts
            // from its `created_at`), queued, dispatched, running, and how
            // it ended.
            sink.log(Progress::Received.to_string());
            let result = tokio::select! {
                r = complete(&inner, &run, sink.clone()) => r,
                _ = cancel.cancelled() => Err(ExecError::Canceled),
            };
            // The last step in its logs (a run lost here runs once more,
            // so it has not ended).
            match &result {
                Ok(_) => sink.log(Progress::Completed.to_string()),
                Err(why @ (ExecError::Failed(_) | ExecError::Answered { .. })) => {
                    sink.log(format!("{}: {why}", Progress::Error { code: None }))
                }
                Err(_) => {}
            }
            result
        })
    }

    /// Counts the prediction in `/metrics` as a request of its kind: its
    /// status (the one a synchronous request ending the same way gets),
    /// its error code, its wait from creation to start and its duration
    /// from creation to end; and hands its inference event to the sink.
    ///
    /// A queued request of the OpenAI API is counted once, here, as a
    /// `prediction` — it waits as one, in the durable queue and patiently
    /// in the line — under the status its client gets (the engine's), with
    /// its tokens read as a synchronous request's are.
    ///
    /// A procedure's run is counted under the procedures runtime's model,
    /// a training under the model's trainer (their replicas ran them); the
    /// event of either names what the client asked for.
    fn ended(&self, record: &Record, code: Option<ErrorCode>) {
        let rt = match record.kind {
            JobKind::Procedure => self
                .inner
                .models
                .values()
                .find(|m| matches!(m.config.engine, hangar_agent::engine::EngineSpec::Procedures { .. })),
            JobKind::Training => self.inner.models.get(&record.model).and_then(|m| self.inner.trainer_of(m)),
            _ => self.inner.models.get(&record.model),
        };
        let Some(rt) = rt else { return };
        let kind = request_kind(record.kind);
        let answer = (record.kind == JobKind::Request).then(|| Answer::kept(record)).flatten();
        let status = answer.as_ref().map_or(code.map_or(200, ErrorCode::http_status), |a| a.status);
        rt.metrics.ended(kind, status, code);
        let ms = |from: Millis, to: Millis| Duration::from_millis(to.saturating_sub(from));
        if let Some(started) = record.started_at {
            rt.metrics.queue_wait(kind, ms(record.created_at, started));
        }
        if let Some(completed) = record.completed_at {
            rt.metrics.finished(kind, ms(record.created_at, completed));
        }
        if self.inner.events.enabled() {
            let facts = self.runs.take(&record.id);
            match prediction_event(rt, record, code, facts) {
                Some(mut event) => {
                    if record.kind == JobKind::Request {
                        event.status = status;
                        request_tokens(rt, record, answer.as_ref(), &mut event);
                    }
                    self.inner.events.prediction(event)
                }
                None => {
                    tracing::warn!(prediction = %record.id, "no inference event: its stored account `{}` is invalid", record.account)
                }
            }
        }
    }
}

/// A deployment's bounds as the scaler holds them.
fn scaler_bounds(b: InstanceBounds) -> hangar_scaler::Bounds {
    hangar_scaler::Bounds { min: b.min_instances, max: b.max_instances }
}

/// The tokens of a queued request's event, as a synchronous request's
/// are counted: the engine's `usage` when the model trusts it, else —
/// once it was sent to an engine — words × 4/3 of the prompt and of the
/// answer's text; then its price.
fn request_tokens(rt: &ModelRuntime, record: &Record, answer: Option<&Answer>, event: &mut InferenceEvent) {
    let billing = &rt.config.billing;
    let body = answer.and_then(|a| a.body.as_ref()).filter(|_| event.code.is_none());
    let usage = body.and_then(|b| b.get("usage")).and_then(|u| Usage::deserialize(u).ok());
    match usage.filter(|_| billing.trust_usage) {
        Some(u) => {
            (event.input_tokens, event.output_tokens, event.tokens_estimated) =
                (u.prompt_tokens, u.completion_tokens, false)
        }
        None if record.started_at.is_none() => (event.input_tokens, event.output_tokens) = (0, 0),
        None => {
            let prompt = QueuedRequest::from_input(&record.input).map(|r| Value::Object(r.body));
            event.input_tokens = prompt.map_or(0, |p| estimate_tokens(&super::prompt_words(&p)));
            event.output_tokens =
                body.map_or(0, |b| estimate_answer(&serde_json::to_vec(b).expect("JSON serializes")));
            event.tokens_estimated = true;
        }
    }
    event.price(billing);
}

/// One run of a job, and where its facts go (none: events are off).
/// Dropped — the run over, or abandoned — it says so to [`Runs`].
struct Run<'a> {
    job: &'a Job,
    runs: Option<&'a Runs>,
}

impl Run<'_> {
    /// The run holds `lease`, on a replica of `rt` run by `node`, now: its
    /// logs say where it was dispatched.
    fn admitted(&self, rt: &ModelRuntime, lease: &Lease, node: Option<String>, sink: &Sink) {
        let replica = replica_name(&rt.config.key, lease.replica);
        sink.log(Progress::Dispatched { replica }.to_string());
        if let Some(runs) = self.runs {
            runs.admitted(&self.job.id, lease.replica, node, lease.queued_at);
        }
    }
}

impl Drop for Run<'_> {
    fn drop(&mut self) {
        if let Some(runs) = self.runs {
            runs.run_over(&self.job.id, Instant::now());
        }
    }
}

/// Tells `sink` of an output item, and `/metrics` (and the run's facts)
/// of the job's first one (its time to first token, from its creation).
struct Outputs<'a> {
    sink: &'a Sink,
    rt: &'a ModelRuntime,
    run: &'a Run<'a>,
    first: bool,
}

impl<'a> Outputs<'a> {
    fn new(sink: &'a Sink, rt: &'a ModelRuntime, run: &'a Run<'a>) -> Self {
        Outputs { sink, rt, run, first: true }
    }

    fn output(&mut self, item: Value) {
        self.first();
        self.sink.output(item);
    }

    /// The job's first output came now (later calls do nothing): its logs
    /// say it runs, and its time to first token is taken.
    fn first(&mut self) {
        if std::mem::take(&mut self.first) {
            self.sink.log(Progress::Running.to_string());
            let (job, now) = (self.run.job, super::wall_ms());
            let since = now.saturating_sub(job.created_at);
            self.rt.metrics.first_byte(request_kind(job.kind), Duration::from_millis(since));
            if let Some(runs) = self.run.runs {
                runs.first_output(&job.id, now);
            }
        }
    }
}

/// Runs `job` on its model: a completion for OpenAI-style engines, a
/// prediction or training on a cog server for `cog` engines.
///
/// # Cancel safety
/// Dropping the future leaves the line or gives the permit back, and
/// drops the engine connection (the engine stops generating) or cancels
/// the prediction on its cog server.
async fn complete(inner: &Arc<Inner>, run: &Run<'_>, sink: Sink) -> Result<Value, ExecError> {
    let job = run.job;
    // A procedure runs on the procedures runtime's replicas.
    let key = job.procedure.as_ref().map_or(&job.model, |p| &p.runtime);
    let rt = inner
        .models
        .get(key)
        .cloned()
        .ok_or_else(|| ExecError::Failed(format!("the model `{key}` is not served")))?;
    match (rt.config.engine.is_cog(), job.kind) {
        (true, JobKind::Prediction) => on_cog_replica(inner, &rt, run, &sink, CogMode::Predict).await,
        (true, JobKind::Procedure) => on_cog_replica(inner, &rt, run, &sink, CogMode::Procedure).await,
        (false, JobKind::Procedure) => Err(ExecError::Failed(format!(
            "the procedures runtime `{key}` must be a model whose engine is of kind `procedures`"
        ))),
        (_, JobKind::Training) => {
            let trainer = inner.trainer_of(&rt).ok_or_else(|| {
                ExecError::Failed(format!(
                    "the model `{}` runs on an engine that cannot train; trainings need a `cog` engine whose \
                     cog.yaml names a `train` function",
                    job.model
                ))
            })?;
            on_cog_replica(inner, trainer, run, &sink, CogMode::Train).await
        }
        (false, JobKind::Prediction) => complete_on_llm(inner, &rt, run, &sink).await,
        (false, JobKind::Request) => answer_request(inner, &rt, run, &sink).await,
        // Refused at load (`use_async_queue` on a cog engine).
        (true, JobKind::Request) => Err(ExecError::Failed(format!(
            "the model `{}` runs on a cog engine, which serves predictions, not the OpenAI API",
            job.model
        ))),
    }
}

/// Waits for a permit on one of the model's replicas, however long (a
/// prediction's own deadlines bound it). While it waits it is in the
/// model's line, which the controller hears of at once and observes every
/// second: replicas follow, and a failed start is retried on the
/// controller's back-off. It waits as a patient request: a model that
/// cannot be placed for now (no room, no nodes) keeps it waiting, not
/// failed; only a model whose engine does not start fails it. Its logs
/// (`sink`) show its position in the line while it waits.
async fn admit(
    inner: &Arc<Inner>,
    rt: &Arc<ModelRuntime>,
    account: &AccountId,
    asked: Asked<'_>,
    sink: &Sink,
) -> Result<Lease, ExecError> {
    let tell = |position: NonZeroU32| sink.log(Progress::Queued { position: position.get() }.to_string());
    let Asked { prompt, avoid, adapter } = asked;
    let mut wait = Wait {
        patience: Patience::Patient,
        prompt,
        avoid,
        on_position: Some(&tell),
        adapter,
        ..Wait::default()
    };
    // A failed adapter load is tried once more, its replica probed first
    // (out of routing if dead) and avoided: nothing was sent.
    let mut load_tries = 2;
    loop {
        match rt.processor.admit_with(account.clone(), wait).await {
            Ok(lease) => return Ok(lease),
            // The line is full of synchronous requests: yield to them.
            // (`Unavailable` is only for fail-fast requests; should it
            // come, wait the same way.)
            Err(AdmitError::QueueFull { .. } | AdmitError::Unavailable { .. }) => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            // Its replica left while its adapter loaded there; nothing was
            // sent: it asks again.
            Err(AdmitError::AdapterReplicaLeft(why)) => tracing::info!("{why}: asking for another replica"),
            Err(AdmitError::AdapterFailed { replica: Some(replica), why }) if load_tries > 1 => {
                tracing::warn!("{why}: asking for another replica");
                load_tries -= 1;
                inner.probe(rt, replica).await;
                wait.avoid = Some(replica);
            }
            Err(e) => return Err(ExecError::Failed(format!("no replica could serve it: {e}"))),
        }
    }
}

/// What a prediction asks of its model's processor besides a permit.
#[derive(Default, Clone, Copy)]
struct Asked<'a> {
    /// Its prompt's blocks and tokens, for the `kv` router.
    prompt: Option<(&'a [BlockHash], u32)>,
    /// A replica that just refused it for want of capacity.
    avoid: Option<ReplicaId>,
    /// Its LoRA adapter and the estimate of loading it, ms.
    adapter: Option<(&'a Adapter, f64)>,
}

/// Runs a prediction on one of the model's cog servers — or, by `mode`, a
/// procedure on the procedures runtime's, or a training on the trainer's
/// (`rt` is then the trainer, config/trainers.rs).
async fn on_cog_replica(
    inner: &Arc<Inner>,
    rt: &Arc<ModelRuntime>,
    run: &Run<'_>,
    sink: &Sink,
    mode: CogMode,
) -> Result<Value, ExecError> {
    let lease = admit(inner, rt, &run.job.account, Asked::default(), sink).await?;
    sink.started();
    let (base, node) =
        rt.replica_route(lease.replica).ok_or_else(|| ExecError::Lost("the replica went away".into()))?;
    run.admitted(rt, &lease, node, sink);
    let result = run_on_cog(&inner.client, &base, mode, rt, run, sink).await;
    drop(lease);
    result
}

/// Runs `job` on the cog server at `base`, passing its output items and
/// log lines on to `sink`.
async fn run_on_cog(
    client: &reqwest::Client,
    base: &str,
    mode: CogMode,
    rt: &ModelRuntime,
    run: &Run<'_>,
    sink: &Sink,
) -> Result<Value, ExecError> {
    let job = run.job;
    let context = job.procedure.as_ref().map(|p| &p.context);
    let source = job.procedure.as_ref().map(|p| p.source.as_path());
    let cog_job = CogJob { base_url: base, mode, id: &job.id, input: &job.input, context, source };
    let mut outputs = Outputs::new(sink, rt, run);
    let progress = |items: Vec<Value>, lines: Vec<String>| {
        items.into_iter().for_each(|i| outputs.output(i));
        lines.into_iter().for_each(|l| sink.log(l));
    };
    cog::run(client, cog_job, progress).await.map_err(|e| match e {
        CogError::Canceled => ExecError::Canceled,
        e => ExecError::Failed(e.to_string()),
    })
}

/// The adapter `adapter` of `model` for `account`, with its load estimate,
/// or why a prediction may not run with it (the gateway's own refusals).
async fn run_adapter(
    inner: &Inner,
    model: &str,
    adapter: &str,
    account: &AccountId,
) -> Result<(Adapter, f64), AdapterRefused> {
    let refused = |status: u16, message: String| AdapterRefused { status, message };
    let rt =
        inner.models.get(model).ok_or_else(|| refused(404, format!("the model `{model}` does not exist")))?;
    let name = adapter.parse::<AdapterName>().map_err(|e| refused(400, format!("input.lora: {e}")))?;
    rt.adapter(inner.adapters.as_ref(), name, account).await.map_err(|e| refused(e.status(), e.to_string()))
}

/// Sends `body` to `path` on one of the model's replicas, admitted as a
/// patient request ([`admit`]; the job starts with its first permit): the
/// answer's head, and the lease, held until the caller has read the
/// answer. A replica out of capacity (429, 503) hands the job to another,
/// once, as a synchronous request's would be; one that does not answer is
/// probed (out of routing at once if it is dead) and the run is lost.
///
/// # Cancel safety
/// Dropping the future leaves the line or gives the permit back, and
/// drops the engine connection.
async fn send(
    inner: &Arc<Inner>,
    rt: &Arc<ModelRuntime>,
    run: &Run<'_>,
    sink: &Sink,
    path: &str,
    body: Vec<u8>,
    adapter: Option<(&Adapter, f64)>,
) -> Result<(reqwest::Response, Lease), ExecError> {
    let prompt = rt.prompt_blocks(&body);
    let prompt = prompt.as_ref().map(|(blocks, tokens)| (&blocks[..], *tokens));
    let mut avoid = None;
    loop {
        let lease = admit(inner, rt, &run.job.account, Asked { prompt, avoid, adapter }, sink).await?;
        if avoid.is_none() {
            sink.started();
        }
        // Gone between the permit and now (failed, or its node left):
        // ask for another.
        let Some((base, node)) = rt.replica_route(lease.replica) else { continue };
        run.admitted(rt, &lease, node, sink);
        let sent = inner
            .client
            .post(format!("{base}{path}"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.clone())
            .send()
            .await;
        let response = match sent {
            Ok(r) => r,
            Err(e) => {
                // Out of routing at once if it is dead, so the run once
                // more goes elsewhere.
                inner.probe(rt, lease.replica).await;
                return Err(ExecError::Lost(format!("the replica running it did not answer: {e}")));
            }
        };
        rt.answered(lease.replica, response.status());
        if avoid.is_none() && rt.fails_over(response.status()) {
            rt.metrics.capacity_failover();
            avoid = Some(lease.replica);
            continue;
        }
        return Ok((response, lease));
    }
}

/// Runs a request of the OpenAI API queued in Workers AI's async mode
/// ([`hangar_predictions::request`]): its stored body to its path on one of
/// the model's replicas, the answer read whole — the job's output, or
/// [`ExecError::Answered`] with the engine's error status and answer.
///
/// # Cancel safety
/// As [`send`]'s: the permit and the engine connection are given back.
async fn answer_request(
    inner: &Arc<Inner>,
    rt: &Arc<ModelRuntime>,
    run: &Run<'_>,
    sink: &Sink,
) -> Result<Value, ExecError> {
    let job = run.job;
    let request = QueuedRequest::from_input(&job.input).map_err(ExecError::Failed)?;
    let adapter = job_adapter(inner, job, request.adapter.as_deref()).await?;
    let body = serde_json::to_vec(&request.body).expect("JSON serializes");
    let adapter = adapter.as_ref().map(|(a, load_ms)| (a, *load_ms));
    let (response, lease) = send(inner, rt, run, sink, &request.path, body, adapter).await?;
    let status = response.status();
    let whole = match response.bytes().await {
        Ok(whole) => whole,
        Err(e) => {
            inner.probe(rt, lease.replica).await;
            return Err(ExecError::Lost(format!("the replica running it went away mid-answer: {e}")));
        }
    };
    drop(lease);
    // Its one output, the whole answer, has come.
    Outputs::new(sink, rt, run).first();
    let body = serde_json::from_slice(&whole)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&whole).into_owned()));
    match status.is_success() {
        true => Ok(Answer { status: status.as_u16(), body: Some(body) }.to_value()),
        false => Err(ExecError::Answered { status: status.as_u16(), body }),
    }
}

/// The LoRA adapter `name` of `job`, if it names one, with its load
/// estimate: checked when the job was created, and looked up again when it
/// runs, since it may have been removed from the store while the job
/// waited.
async fn job_adapter(
    inner: &Inner,
    job: &Job,
    name: Option<&str>,
) -> Result<Option<(Adapter, f64)>, ExecError> {
    let Some(name) = name else { return Ok(None) };
    let found = run_adapter(inner, &job.model, name, &job.account).await;
    found.map(Some).map_err(|e| ExecError::Failed(e.message))
}

/// Streams a completion from one of the model's OpenAI-style engines.
async fn complete_on_llm(
    inner: &Arc<Inner>,
    rt: &Arc<ModelRuntime>,
    run: &Run<'_>,
    sink: &Sink,
) -> Result<Value, ExecError> {
    let job = run.job;
    let input = LlmInput::parse(&job.input).map_err(|e| ExecError::Failed(e.to_string()))?;
    let adapter = job_adapter(inner, job, input.lora.as_deref()).await?;
    // An engine serves an adapter loaded at run time under its name.
    let served = adapter.as_ref().map_or(rt.config.key.as_str(), |(a, _)| a.id.name().as_str());
    let body = serde_json::to_vec(&input.completion_body(served)).expect("JSON serializes");
    let adapter = adapter.as_ref().map(|(a, load_ms)| (a, *load_ms));
    let (response, lease) = send(inner, rt, run, sink, "/v1/completions", body, adapter).await?;
    if !response.status().is_success() {
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        return Err(ExecError::Failed(format!("the engine answered {status}: {text}")));
    }
    let mut tokens = Vec::new();
    let mut outputs = Outputs::new(sink, rt, run);
    let mut buffer = String::new();
    let mut chunks = response.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                inner.probe(rt, lease.replica).await;
                return Err(ExecError::Lost(format!("the replica running it went away mid-run: {e}")));
            }
        };
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
                        outputs.output(token.clone());
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
    /// `backend`; `base_url` is where clients reach the server. Merge
    /// [`Service::router`] into the gateway's router (`hangar-gateway`'s
    /// `router` does). A cog model's
    /// version shows the OpenAPI schema its server publishes, when one of
    /// its replicas is up by now.
    pub async fn start_predictions(
        &self,
        backend: &Backend,
        config: PredictionsConfig,
        base_url: &str,
    ) -> Result<Service, ServiceError> {
        let mut models = Vec::new();
        for rt in self.inner.models.values().filter(|rt| rt.config.trains.is_none()) {
            let input = match rt.config.engine.is_cog() {
                true => InputRules::Own(self.cog_schema(rt).await),
                false => InputRules::Llm,
            };
            models.push(Model {
                key: rt.config.key.to_string(),
                version: hangar_predictions::version_id(
                    &serde_json::to_string(&rt.config).unwrap_or_default(),
                ),
                settings: rt.config.predictions,
                access: rt.config.access.clone(),
                input,
                capacity: hangar_predictions::Capacity::new(
                    rt.config.gpu_kind.as_deref(),
                    rt.config.min_replicas,
                    rt.config.max_replicas(),
                ),
            });
        }
        let executor = Arc::new(ServeExecutor { inner: self.inner.clone(), runs: Arc::default() });
        let api_keys = self.inner.api_keys.clone();
        Service::start(backend, config, models, api_keys, executor, base_url)
    }

    /// `GET /openapi.json` from a running replica of the cog model `rt`.
    async fn cog_schema(&self, rt: &ModelRuntime) -> Option<Value> {
        let url =
            rt.replicas.lock().expect("replica table lock").values().find_map(|r| r.base_url.clone())?;
        let answer =
            self.inner.client.get(format!("{url}/openapi.json")).timeout(Duration::from_secs(5)).send();
        let body = answer.await.ok()?.bytes().await.ok()?;
        serde_json::from_slice(&body).ok()
    }
}
