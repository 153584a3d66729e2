//! The HTTP surface: OpenAI-compatible endpoints plus vLLM's health, sleep,
//! metrics and runtime LoRA endpoints.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use hangar_core::exposition::Format;
use hangar_core::{mix64, RequestId};
use hangar_engine::Prompt;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};

use crate::driver::{Command, Progress};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::openai::{self, ChatRequest, CompletionRequest, EmbeddingRequest, Input};
use crate::text;

/// What every handler shares.
pub(crate) struct AppState {
    pub model: String,
    pub block_size: u32,
    pub embedding_dims: usize,
    pub default_max_tokens: u32,
    pub commands: mpsc::UnboundedSender<Command>,
    pub asleep: watch::Receiver<bool>,
    pub ready_at: Instant,
    pub next_id: AtomicU64,
    pub metrics: Metrics,
    pub weights: Option<crate::WeightsRead>,
    pub lora: crate::lora::Lora,
    /// [`crate::MockConfig::fail_while`].
    pub fail_while: Option<std::path::PathBuf>,
}

pub(crate) type Shared = Arc<AppState>;

pub(crate) fn router(state: Shared, max_body_bytes: usize, sleep_api: bool, lora_api: bool) -> Router {
    let routes = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/ws", get(crate::ws::stream))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics));
    let routes = if sleep_api {
        routes
            .route("/sleep", post(sleep))
            .route("/wake_up", post(wake_up))
            .route("/is_sleeping", get(is_sleeping))
    } else {
        routes
    };
    let routes = if lora_api {
        routes
            .route("/v1/load_lora_adapter", post(crate::lora::load))
            .route("/v1/unload_lora_adapter", post(crate::lora::unload))
    } else {
        routes
    };
    routes
        .fallback(|| async {
            ApiError { status: StatusCode::NOT_FOUND, ..ApiError::bad_request("no such endpoint", None) }
        })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

/// What a request's `"model"` names: the base model or a loaded LoRA
/// adapter.
pub(crate) struct Served {
    /// The name, which the answer's `model` repeats (vLLM's).
    pub name: String,
    /// A loaded adapter's salt, mixed into the prompt's token ids.
    pub adapter: Option<u64>,
}

/// A request in the engine: its id, prompt size and output identity, and
/// the channel its progress arrives on.
pub(crate) struct Run {
    pub id: RequestId,
    pub prompt_tokens: u32,
    pub fingerprint: u64,
    pub progress: mpsc::UnboundedReceiver<Progress>,
}

impl AppState {
    pub(crate) fn check_ready(&self) -> Result<(), ApiError> {
        if Instant::now() < self.ready_at {
            return Err(ApiError::unavailable("the model is still loading; retry when /health answers 200"));
        }
        if *self.asleep.borrow() {
            return Err(ApiError::unavailable("the engine is asleep; POST /wake_up first"));
        }
        Ok(())
    }

    /// The base model or the loaded adapter `model` names; 404 for
    /// anything else, an adapter still loading or unloaded included (vLLM
    /// serves an adapter only once loaded).
    fn resolve(&self, model: &str) -> Result<Served, ApiError> {
        if model == self.model {
            return Ok(Served { name: model.into(), adapter: None });
        }
        match self.lora.resolve(model) {
            Some(salt) => Ok(Served { name: model.into(), adapter: Some(salt) }),
            None => Err(ApiError::unknown_model(model)),
        }
    }

    /// Submits a prompt to the engine; on an adapter (`adapter` its salt)
    /// the token ids are the adapter's own, so its output text and its
    /// prefix cache blocks differ from the base model's, as a fine-tune's
    /// do, while the prompt's length and the timing stay the same.
    pub(crate) fn submit(
        &self,
        mut tokens: Vec<u32>,
        max_tokens: u32,
        adapter: Option<u64>,
    ) -> Result<Run, ApiError> {
        if tokens.is_empty() {
            return Err(ApiError::bad_request("the prompt is empty", Some("prompt".into())));
        }
        if let Some(salt) = adapter {
            for t in &mut tokens {
                *t = mix64(u64::from(*t), salt) as u32;
            }
        }
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = mpsc::unbounded_channel();
        let fingerprint = text::fingerprint(&tokens);
        let prompt_tokens = tokens.len() as u32;
        let prompt = Prompt::from_tokens(&tokens, self.block_size);
        self.commands
            .send(Command::Submit { id, prompt, max_tokens, progress: tx })
            .map_err(|_| ApiError::unavailable("the engine has stopped"))?;
        Ok(Run { id, prompt_tokens, fingerprint, progress: rx })
    }
}

fn body(b: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    b.map_err(|r| ApiError { status: r.status(), ..ApiError::bad_request(r.body_text(), None) })
}

/// A request's body parsed as `T`, once the engine can take requests: an
/// oversized body first (413), then a loading or sleeping engine (503),
/// then a malformed body (400).
pub(crate) fn parse_ready<T: DeserializeOwned>(
    s: &AppState,
    b: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let b = body(b)?;
    s.check_ready()?;
    if let Some(path) = s.fail_while.as_ref().filter(|p| p.exists()) {
        return Err(ApiError::internal(format!(
            "the engine was told to fail while {} exists",
            path.display()
        )));
    }
    openai::parse(&b)
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn one_choice(n: Option<u32>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::bad_request(
            format!("n = {n} is not supported; ask for 1 choice"),
            Some("n".into()),
        )),
    }
}

fn input_tokens(input: Input) -> Vec<u32> {
    match input {
        Input::Text(t) => text::tokenize(&t),
        Input::Tokens(t) => t,
    }
}

pub(crate) fn usage(prompt: u32, completion: u32, cached: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Waits for a run to finish; returns its text, token count and cached
/// prompt tokens.
async fn collect(mut run: Run) -> Result<(String, u32, u32), ApiError> {
    let mut out = String::new();
    let mut n = 0;
    while let Some(p) = run.progress.recv().await {
        match p {
            Progress::Token(i) => {
                out.push_str(&text::output_piece(run.fingerprint, i));
                n += 1;
            }
            Progress::Done { cached_tokens } => return Ok((out, n, cached_tokens)),
            Progress::Refused(why) => return Err(refused(why)),
        }
    }
    Err(ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        ..ApiError::bad_request("the engine stopped", None)
    })
}

fn refused(why: String) -> ApiError {
    ApiError { code: Some("context_length_exceeded"), ..ApiError::bad_request(why, Some("messages".into())) }
}

/// Streams a run as server-sent events; `chunk(text, finish)` renders one
/// chunk, the usage chunk and `[DONE]` follow the last.
fn stream(
    mut run: Run,
    include_usage: bool,
    first: Option<Value>,
    chunk: impl Fn(&str, Option<&str>) -> Value + Send + 'static,
    usage_chunk: impl Fn(Value) -> Value + Send + 'static,
) -> Response {
    let (tx, rx) = mpsc::channel::<Event>(64);
    tokio::spawn(async move {
        let send = |v: Value| tx.send(Event::default().data(v.to_string()));
        if let Some(first) = first {
            if send(first).await.is_err() {
                return;
            }
        }
        let mut n = 0;
        while let Some(p) = run.progress.recv().await {
            match p {
                Progress::Token(i) => {
                    n += 1;
                    if send(chunk(&text::output_piece(run.fingerprint, i), None)).await.is_err() {
                        return; // Client gone: dropping `run` aborts the request.
                    }
                }
                Progress::Done { cached_tokens } => {
                    let _ = send(chunk("", Some("length"))).await;
                    if include_usage {
                        let _ = send(usage_chunk(usage(run.prompt_tokens, n, cached_tokens))).await;
                    }
                    let _ = tx.send(Event::default().data("[DONE]")).await;
                    return;
                }
                Progress::Refused(why) => {
                    let _ = send(json!({"error": {"message": why, "type": "invalid_request_error"}})).await;
                    return;
                }
            }
        }
    });
    let events =
        futures::stream::unfold(
            rx,
            |mut rx| async move { rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx)) },
        );
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

async fn chat(State(s): State<Shared>, b: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_ready(&s, b)?;
    let served = s.resolve(&req.model)?;
    one_choice(req.n)?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_request(
            "`messages` must hold at least one message",
            Some("messages".into()),
        ));
    }
    let max_tokens = req.max_completion_tokens.or(req.max_tokens).unwrap_or(s.default_max_tokens);
    if max_tokens == 0 {
        return Err(ApiError::bad_request("`max_tokens` must be at least 1", Some("max_tokens".into())));
    }
    let run = s.submit(text::tokenize(&req.render()), max_tokens, served.adapter)?;
    let id = format!("chatcmpl-{}", run.id.0);
    let (model, created) = (served.name, unix_now());
    if req.stream {
        let include_usage = req.stream_options.unwrap_or_default().include_usage;
        let base = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model});
        let (b1, b2, b3) = (base.clone(), base.clone(), base);
        let first = with(
            &b1,
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]}),
        );
        return Ok(stream(
            run,
            include_usage,
            Some(first),
            move |t, fin| {
                let delta = if fin.is_some() { json!({}) } else { json!({"content": t}) };
                with(
                    &b2,
                    json!({"choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": fin}]}),
                )
            },
            move |u| with(&b3, json!({"choices": [], "usage": u})),
        ));
    }
    let prompt_tokens = run.prompt_tokens;
    let (content, n, cached) = collect(run).await?;
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": null, "finish_reason": "length"}],
        "usage": usage(prompt_tokens, n, cached),
    }))
    .into_response())
}

/// `base` with the fields of `extra` added.
fn with(base: &Value, extra: Value) -> Value {
    let mut v = base.clone();
    if let (Value::Object(m), Value::Object(e)) = (&mut v, extra) {
        m.extend(e);
    }
    v
}

async fn completions(
    State(s): State<Shared>,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_ready(&s, b)?;
    let served = s.resolve(&req.model)?;
    one_choice(req.n)?;
    let mut inputs = req.prompt.into_inputs();
    if inputs.len() != 1 {
        return Err(ApiError::bad_request(
            format!("{} prompts in one request are not supported; send one", inputs.len()),
            Some("prompt".into()),
        ));
    }
    let run = s.submit(input_tokens(inputs.remove(0)), req.max_tokens.unwrap_or(16), served.adapter)?;
    let id = format!("cmpl-{}", run.id.0);
    let (model, created) = (served.name, unix_now());
    let base = json!({"id": id, "object": "text_completion", "created": created, "model": model});
    if req.stream {
        let include_usage = req.stream_options.unwrap_or_default().include_usage;
        let (b1, b2) = (base.clone(), base);
        return Ok(stream(
            run,
            include_usage,
            None,
            move |t, fin| {
                with(
                    &b1,
                    json!({"choices": [{"index": 0, "text": t, "logprobs": null, "finish_reason": fin}]}),
                )
            },
            move |u| with(&b2, json!({"choices": [], "usage": u})),
        ));
    }
    let prompt_tokens = run.prompt_tokens;
    let (text, n, cached) = collect(run).await?;
    Ok(Json(with(
        &base,
        json!({
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}],
            "usage": usage(prompt_tokens, n, cached),
        }),
    ))
    .into_response())
}

async fn embeddings(State(s): State<Shared>, b: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: EmbeddingRequest = parse_ready(&s, b)?;
    let served = s.resolve(&req.model)?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad_request(
                format!("encoding_format `{other}` is neither `float` nor `base64`"),
                Some("encoding_format".into()),
            ))
        }
    };
    let dims = req.dimensions.unwrap_or(s.embedding_dims);
    if dims == 0 || dims > s.embedding_dims {
        return Err(ApiError::bad_request(
            format!("dimensions must be between 1 and {}", s.embedding_dims),
            Some("dimensions".into()),
        ));
    }
    let inputs = req.input.into_inputs();
    if inputs.is_empty() {
        return Err(ApiError::bad_request("`input` is empty", Some("input".into())));
    }
    // Every input is a prefill-only request, so embeddings take the time
    // and batch slots they would on the engine.
    let mut runs = Vec::with_capacity(inputs.len());
    for input in inputs {
        let tokens = input_tokens(input);
        let vector = text::embedding(&tokens, dims);
        runs.push((s.submit(tokens, 0, served.adapter)?, vector));
    }
    let mut data = Vec::with_capacity(runs.len());
    let mut prompt_tokens = 0;
    for (i, (run, vector)) in runs.into_iter().enumerate() {
        prompt_tokens += run.prompt_tokens;
        collect(run).await?;
        let embedding = if base64 {
            let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
            Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            json!(vector)
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
    }
    Ok(Json(json!({
        "object": "list", "data": data, "model": served.name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }))
    .into_response())
}

/// `GET /v1/models`: the base model, then every loaded adapter with its
/// `parent` (the base) and `root` (the path it was loaded from), as vLLM
/// lists them.
async fn models(State(s): State<Shared>) -> Json<Value> {
    let root = s.weights.as_ref().map_or(s.model.as_str(), |w| w.path.as_str());
    let mut model = json!({"id": s.model, "object": "model", "created": 0, "owned_by": "hangar",
                           "root": root, "parent": null});
    if let Some(w) = &s.weights {
        model["weights"] = json!(w);
    }
    let mut data = vec![model];
    data.extend(s.lora.cards(&s.model));
    Json(json!({"object": "list", "data": data}))
}

async fn health(State(s): State<Shared>) -> Response {
    if Instant::now() < s.ready_at {
        return ApiError::unavailable("the model is still loading").into_response();
    }
    StatusCode::OK.into_response()
}

/// `GET /metrics`: OpenMetrics for a scraper that asks for it (Prometheus
/// does), the text format 0.0.4 otherwise, each under its own name.
async fn metrics(State(s): State<Shared>, headers: HeaderMap) -> Response {
    let format = Format::negotiate(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()));
    ([(header::CONTENT_TYPE, format.content_type())], format.render(s.metrics.render())).into_response()
}

async fn sleep(State(s): State<Shared>) -> Result<Response, ApiError> {
    let (reply, rx) = oneshot::channel();
    s.commands.send(Command::Sleep { reply }).map_err(|_| ApiError::unavailable("the engine has stopped"))?;
    match rx.await {
        Ok(Ok(())) => Ok(StatusCode::OK.into_response()),
        Ok(Err(n)) => Err(ApiError {
            status: StatusCode::CONFLICT,
            ..ApiError::bad_request(format!("{n} requests are in flight; sleep when idle"), None)
        }),
        Err(_) => Err(ApiError::unavailable("the engine has stopped")),
    }
}

async fn wake_up(State(s): State<Shared>) -> Result<Response, ApiError> {
    let (reply, rx) = oneshot::channel();
    s.commands.send(Command::Wake { reply }).map_err(|_| ApiError::unavailable("the engine has stopped"))?;
    rx.await.map_err(|_| ApiError::unavailable("the engine has stopped"))?;
    Ok(StatusCode::OK.into_response())
}

async fn is_sleeping(State(s): State<Shared>) -> Json<Value> {
    Json(json!({"is_sleeping": *s.asleep.borrow()}))
}
