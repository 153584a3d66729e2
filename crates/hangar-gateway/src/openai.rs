//! The OpenAI-compatible gateway in front of the processors, with the
//! server's health, readiness and metrics endpoints.
//!
//! A request gets one deadline at arrival — its model's timeout, within the
//! server's floor and ceiling — covering the wait for a permit, the
//! replica's answer and the streaming of it. A request whose replica fails
//! before answering is sent once more, to another replica if one is free;
//! a streamed answer cut short ends with an error event instead.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use hangar_core::exposition::Format;
use hangar_core::{AccountId, AuthError, BlockHash, ErrorCode, Principal, ReplicaId, RequestKind};
use hangar_predictions::Service;
use hangar_runtime::events::RequestTrace;
use hangar_runtime::processor::{AdmitError, Lease, Wait};
use hangar_runtime::serve::{replica_name, ModelRuntime, SendError, Server, Tally};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::time::Sleep;

use crate::relay::RelayBody;

pub(crate) fn router(server: Server) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(forward))
        .route("/v1/completions", post(forward))
        .route("/v1/embeddings", post(forward))
        // The OpenAI SDK sends `demo/chat-small` as `demo%2Fchat-small`: one
        // segment. (Unencoded, `/v1/models/{owner}/{name}` is Replicate's.)
        .route("/v1/models/{id}", get(model))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/healthz", get(|| async { StatusCode::OK }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            error(StatusCode::NOT_FOUND, "invalid_request_error", "no such endpoint", None)
        })
        .with_state(server)
}

/// An OpenAI-shaped error response.
pub(crate) fn error(status: StatusCode, kind: &str, message: &str, param: Option<&str>) -> Response {
    (status, Json(json!({"error": {"message": message, "type": kind, "param": param, "code": null}})))
        .into_response()
}

/// An error answer in OpenAI's shape, for handlers that use `?`.
pub(crate) struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, message: message.into(), param: None }
    }

    /// 400, naming what is wrong.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
    }

    /// The request field at fault.
    pub fn param(self, param: &'static str) -> Self {
        Self { param: Some(param), ..self }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error(self.status, self.kind, &self.message, self.param)
    }
}

/// Why a caller is not let in: 401 (no or a wrong key) or 403.
pub(crate) fn denied(status: StatusCode, message: &str) -> Response {
    let kind = if status == StatusCode::FORBIDDEN { "permission_error" } else { "authentication_error" };
    error(status, kind, message, None)
}

/// Who a request acts for and whether it may use the admin API, by the
/// server's one set of key rules ([`hangar_core::auth`]); the error is the
/// 401 message.
pub(crate) fn principal(server: &Server, headers: &HeaderMap) -> Result<Principal, AuthError> {
    server.api_keys().authenticate(headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()))
}

/// The account a request acts for.
pub(crate) fn account(server: &Server, headers: &HeaderMap) -> Result<AccountId, AuthError> {
    principal(server, headers).map(|p| p.account)
}

/// An OpenAI model object.
fn model_object(key: &str) -> Value {
    json!({"id": key, "object": "model", "created": 0, "owned_by": "hangar"})
}

/// `GET /v1/models/{id}`: one model the caller may use, as OpenAI's
/// `models.retrieve` expects; 404 alike for an unknown model and one the
/// account may not see.
async fn model(State(server): State<Server>, Path(id): Path<String>, headers: HeaderMap) -> Response {
    let account = match account(&server, &headers) {
        Ok(a) => a,
        Err(e) => return denied(StatusCode::UNAUTHORIZED, &e.to_string()),
    };
    match server.model(&id) {
        Some(rt) if rt.allows(&account) => Json(model_object(&id)).into_response(),
        _ => no_such_model(&id).into_response(),
    }
}

/// The 404 of a model that does not exist — or that the caller's account
/// may not see, which must not be told apart.
pub(crate) fn no_such_model(model: &str) -> ApiError {
    ApiError::not_found(format!("The model `{model}` does not exist.")).param("model")
}

/// Ready when every model that keeps replicas has one serving.
///
/// It needs no key (probes carry none), so it names no model: which ones
/// wait is in `/admin/status`.
async fn readyz(State(server): State<Server>) -> Response {
    let waiting =
        server.models().filter(|rt| rt.config().min_replicas > 0 && rt.ready_replicas() == 0).count();
    match waiting {
        0 => (StatusCode::OK, "ready\n").into_response(),
        n => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("no replica ready yet for {n} model(s); /admin/status names them\n"),
        )
            .into_response(),
    }
}

/// Prometheus `/metrics`, in OpenMetrics for a scraper that asks for it
/// and in the text format 0.0.4 otherwise ([`Format`]). Its labels name
/// every model, private ones included, so with `metrics_key` set it
/// answers only a request bearing that key or an admin API key (401
/// otherwise).
async fn metrics(State(server): State<Server>, headers: HeaderMap) -> Response {
    if let Some(key) = server.metrics_key() {
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let admin = || !server.api_keys().is_open() && principal(&server, &headers).is_ok_and(|p| p.admin);
        if bearer != Some(key) && !admin() {
            let message = "/metrics needs `Authorization: Bearer METRICS_KEY` (or an admin API key)";
            return denied(StatusCode::UNAUTHORIZED, message);
        }
    }
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = Format::negotiate(accept);
    ([(header::CONTENT_TYPE, format.content_type())], format.render(server.render_metrics())).into_response()
}

/// What the gateway reads of a request body; the rest is passed on as is.
#[derive(serde::Deserialize)]
struct Head {
    model: Option<Value>,
    /// Workers AI's name of a LoRA adapter (OpenAI's is `BASE:ADAPTER` in
    /// `model`).
    lora: Option<Value>,
    /// Output tokens asked for (`max_completion_tokens` is the current
    /// name), bounded by [`hangar_core::MAX_OUTPUT_TOKENS`] as a
    /// prediction's are.
    max_tokens: Option<Value>,
    max_completion_tokens: Option<Value>,
    /// Workers AI's async mode ([`crate::queued`]): `options.queueRequest`,
    /// and a follow-up's `inputs.request_id`.
    options: Option<Value>,
    inputs: Option<Value>,
}

impl Head {
    /// The 400 naming the first output-token count out of bounds, if any.
    fn output_tokens_refused(&self) -> Option<Response> {
        let counts =
            [("max_tokens", &self.max_tokens), ("max_completion_tokens", &self.max_completion_tokens)];
        for (field, value) in counts {
            let Some(value) = value.as_ref().filter(|v| !v.is_null()) else { continue };
            if let Err(why) = hangar_core::limits::check_output_tokens(value.as_u64()) {
                let message = format!("`{field}`: {why}");
                return Some(error(StatusCode::BAD_REQUEST, "invalid_request_error", &message, Some(field)));
            }
        }
        None
    }
}

/// Admits the request onto a replica of its model and streams the
/// replica's answer back; the permit is released when the answer ends or
/// the client goes away. Every request for a model the caller may use is
/// counted once, as what happened to it ([`Tally`]).
async fn forward(
    State(server): State<Server>,
    Extension(queue): Extension<Service>,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = Instant::now();
    let account = match account(&server, &headers) {
        Ok(a) => a,
        Err(e) => return denied(StatusCode::UNAUTHORIZED, &e.to_string()),
    };
    let body = match body {
        Ok(b) => b,
        Err(r) => return error(r.status(), "invalid_request_error", &r.body_text(), None),
    };
    let head: Head = match serde_json::from_slice(&body) {
        Ok(h) => h,
        Err(e) => {
            let message = format!("the body is not a valid JSON object: {e}");
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", &message, None);
        }
    };
    let Some(Value::String(model)) = &head.model else {
        let message = "field `model` is missing or not a string";
        return error(StatusCode::BAD_REQUEST, "invalid_request_error", message, Some("model"));
    };
    let (base, adapter) = match model_and_adapter(model, head.lora.as_ref()) {
        Ok(named) => named,
        Err(refused) => return refused,
    };
    let Some(rt) = server.model(base).filter(|rt| rt.allows(&account)).cloned() else {
        return no_such_model(base).into_response();
    };
    // The request's event rides on its tally: ended with it, once.
    let trace =
        crate::guard::with_current_id(|id| RequestTrace::start(&rt, id, account.clone(), arrival, &body));
    let tally = Tally::new(rt.metrics(), RequestKind::Sync).traced(trace);
    if let Some(refused) = head.output_tokens_refused() {
        return counted(tally, ErrorCode::BadRequest, refused);
    }
    if rt.config().engine.is_cog() {
        let message = format!(
            "the model `{model}` runs on a cog engine, which serves predictions, not the OpenAI API: \
             use POST /v1/models/{model}/predictions"
        );
        let refused = error(StatusCode::BAD_REQUEST, "invalid_request_error", &message, Some("model"));
        return counted(tally, ErrorCode::BadRequest, refused);
    }
    let (adapter, body) = match adapter {
        None => (None, body),
        Some(name) => match rt.adapter(server.adapter_catalog(), name, &account).await {
            Ok(adapter) => {
                let body = for_adapter(&body, adapter.0.id.name().as_str());
                (Some((adapter, Arc::<str>::from(model.as_str()))), body)
            }
            Err(refused) => {
                let status = StatusCode::from_u16(refused.status()).unwrap_or(StatusCode::BAD_REQUEST);
                let param = if head.lora.is_some() { "lora" } else { "model" };
                let response = error(status, "invalid_request_error", &refused.to_string(), Some(param));
                return counted(tally, ErrorCode::BadRequest, response);
            }
        },
    };
    // Workers AI's async mode: queued, or a follow-up about one.
    if let Some(asked) =
        crate::queued::Asked::read(rt.config().use_async_queue, head.options.as_ref(), head.inputs.as_ref())
    {
        let to = crate::queued::To { service: &queue, rt: &rt, path: uri.path(), account: &account, model };
        return asked.answer(to, &body, adapter.as_ref(), tally).await;
    }
    // Only the KV router reads the prompt.
    let prompt = rt.prompt_blocks(&body);
    let request = Forward { server: &server, rt: &rt, path: uri.path(), body, arrival, prompt, adapter };
    request.run(account, tally).await
}

/// The base model a request's `model` names and its adapter, if it names
/// one (`BASE:ADAPTER`, or Workers AI's `lora`); a 400 naming the field if
/// either is malformed. A plain model key is taken as it is, unparsed: an
/// unknown one is a 404 as before.
#[allow(clippy::result_large_err)]
fn model_and_adapter<'a>(
    model: &'a str,
    lora: Option<&Value>,
) -> Result<(&'a str, Option<hangar_core::AdapterName>), Response> {
    let lora = match lora {
        None | Some(Value::Null) if !model.contains(':') => return Ok((model, None)),
        None | Some(Value::Null) => None,
        Some(Value::String(lora)) => Some(lora.as_str()),
        Some(_) => {
            let message = "field `lora` must be a string: the name of one of the model's LoRA adapters";
            return Err(error(StatusCode::BAD_REQUEST, "invalid_request_error", message, Some("lora")));
        }
    };
    match hangar_core::parse_model_field(model, lora) {
        Ok((_, adapter)) => Ok((model.split_once(':').map_or(model, |(base, _)| base), adapter)),
        Err(e) => Err(error(StatusCode::BAD_REQUEST, "invalid_request_error", &e.to_string(), Some("model"))),
    }
}

/// The request `body` for an engine that serves adapter `name` under that
/// name (vLLM names a LoRA loaded at run time by its `lora_name`): its
/// `model` is the adapter's name and `lora` is gone. Only the top level is
/// parsed: every other field's value is copied as the raw text it was, so
/// a long prompt costs a copy, not a parse into values and back.
fn for_adapter(body: &Bytes, name: &str) -> Bytes {
    use serde_json::value::RawValue;
    let Ok(mut fields) = serde_json::from_slice::<std::collections::BTreeMap<String, &RawValue>>(body) else {
        return body.clone();
    };
    let model = serde_json::value::to_raw_value(name).expect("a string serializes");
    fields.remove("lora");
    fields.insert("model".to_owned(), &model);
    Bytes::from(serde_json::to_vec(&fields).expect("a JSON object serializes"))
}

/// `response`, an answer the gateway gives itself, counted with `code`.
fn counted(tally: Tally, code: ErrorCode, response: Response) -> Response {
    tally.ended(response.status().as_u16(), Some(code));
    response
}

/// One request on its way to a replica.
struct Forward<'a> {
    server: &'a Server,
    rt: &'a Arc<ModelRuntime>,
    path: &'a str,
    body: Bytes,
    arrival: Instant,
    /// Block hashes and estimated tokens of the prompt, for the KV router.
    prompt: Option<(Vec<BlockHash>, u32)>,
    /// The request's LoRA adapter and the estimate of loading it (ms), and
    /// the model's name as the client wrote it, which answers carry.
    adapter: Option<((hangar_core::Adapter, f64), Arc<str>)>,
}

impl Forward<'_> {
    /// The answer: the replica's, relayed (counted by its body when it
    /// ends), or the gateway's own refusal (counted here).
    async fn run(self, account: AccountId, mut tally: Tally) -> Response {
        let deadline = self.arrival + self.rt.timeout();
        let timeout_s = self.rt.timeout().as_secs();
        // One timer for the whole request: the send, then the answer.
        let mut timer = Box::pin(tokio::time::sleep_until(deadline.into()));
        // A replica that refused the request for want of capacity.
        let mut avoid = None;
        let mut tries = Tries::default();
        for attempt in 0.. {
            if !tries.take() {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let prompt = self.prompt.as_ref().map(|(blocks, tokens)| (&blocks[..], *tokens));
            let adapter = self.adapter.as_ref().map(|((adapter, load_ms), _)| (adapter, *load_ms));
            let wait = Wait { timeout: Some(left), prompt, avoid, adapter, ..Wait::default() };
            let admitted = self.rt.processor().admit_with(account.clone(), wait);
            let lease = match admitted.await {
                Ok(lease) => lease,
                // Nothing was sent: asked again, the try given back as
                // for a replica found gone before the send.
                Err(AdmitError::AdapterReplicaLeft(why)) => {
                    tracing::info!("{why}: asking for another replica");
                    tries.replica_dead();
                    continue;
                }
                // Nothing was sent either: another replica is tried while a
                // try is left (one found dead gives it back, as for a failed
                // send); the last failure is the answer.
                Err(AdmitError::AdapterFailed { replica: Some(replica), why }) if tries.any_left() => {
                    tracing::warn!("{why}: asking for another replica");
                    self.lost(replica, &mut tries).await;
                    avoid = Some(replica);
                    continue;
                }
                Err(e) => {
                    let (code, response) = admit_error(&e, timeout_s);
                    return counted(tally, code, response);
                }
            };
            let now = Instant::now();
            if attempt == 0 {
                self.rt.metrics().queue_wait(RequestKind::Sync, now - self.arrival);
            }
            let Some(base) = self.rt.replica_url(lease.replica) else {
                // Granted on a replica that left the table meanwhile (failed
                // by another request's probe): nothing was sent.
                tries.replica_dead();
                continue;
            };
            if let Some(trace) = tally.trace() {
                trace.admitted(now, lease.replica, lease.queued_at);
            }
            let url = format!("{base}{}", self.path);
            let answer = tokio::select! {
                answer = self.rt.send(&url, self.body.clone()) => answer,
                () = timer.as_mut() => return counted(tally, ErrorCode::Timeout, timed_out(timeout_s)),
            };
            let replica = lease.replica;
            let name = || replica_name(&self.rt.config().key, replica);
            if let Ok(upstream) = &answer {
                self.rt.answered(replica, upstream.status());
            }
            match answer {
                Ok(upstream) if attempt == 0 && self.rt.fails_over(upstream.status()) => {
                    tracing::info!(replica = %name(), status = %upstream.status(), "out of capacity: sending the request to another replica");
                    self.rt.metrics().capacity_failover();
                    avoid = Some(replica);
                }
                Ok(upstream) => {
                    let answer = match Answer::read(upstream, &mut timer).await {
                        Some(Ok(answer)) => answer,
                        None => return counted(tally, ErrorCode::Timeout, timed_out(timeout_s)),
                        // A JSON answer cut before its end: the client has
                        // had nothing yet, so it is retried as a failed send.
                        Some(Err(e)) => {
                            tracing::warn!(replica = %name(), "a replica's answer broke off: {e}");
                            drop(lease);
                            self.lost(replica, &mut tries).await;
                            continue;
                        }
                    };
                    return self.relay(answer, lease, timer, tally);
                }
                Err(SendError::Address(e)) => {
                    // Engine URLs are checked at load; should one still not
                    // make a request, this replica cannot serve.
                    tracing::error!(replica = %name(), "cannot address the replica at `{base}`: {e}");
                    let message = "the replica cannot be reached";
                    let response = error(StatusCode::BAD_GATEWAY, "service_unavailable", message, None);
                    return counted(tally, ErrorCode::ReplicaFailed, response);
                }
                Err(e) => {
                    tracing::warn!(replica = %name(), "forwarding failed: {e}");
                    drop(lease);
                    self.lost(replica, &mut tries).await;
                }
            }
        }
        let message = "the replica failed before answering, and so did the retry";
        let response = error(StatusCode::BAD_GATEWAY, "service_unavailable", message, None);
        counted(tally, ErrorCode::ReplicaFailed, response)
    }

    /// The model's name in answers when it is not its key: `BASE:ADAPTER`.
    fn name(&self) -> Option<&str> {
        self.adapter.as_ref().map(|(_, name)| &name[..])
    }

    /// `replica` gave no whole answer (its permit already given back): it
    /// is checked, and if found dead its try is given back.
    async fn lost(&self, replica: ReplicaId, tries: &mut Tries) {
        if !self.server.probe(self.rt, replica).await {
            tries.replica_dead();
        }
    }

    /// The replica's answer for the client, holding the permit until it
    /// ends: a JSON answer (read whole, within the request's deadline,
    /// before this) renamed, anything else streamed within `deadline`.
    fn relay(&self, answer: Answer, lease: Lease, deadline: Pin<Box<Sleep>>, mut tally: Tally) -> Response {
        let rt = self.rt.clone();
        let (parts, body) = match answer {
            Answer::Whole(parts, whole) => {
                let now = Instant::now();
                rt.metrics().first_byte(RequestKind::Sync, now - self.arrival);
                if let Some(trace) = tally.trace() {
                    trace.first_byte(now);
                    trace.whole(&whole);
                }
                let whole =
                    match crate::rename::whole(&whole, self.name().unwrap_or(rt.config().key.as_str())) {
                        Some(renamed) => Bytes::from(renamed),
                        None => whole,
                    };
                let status = parts.status.as_u16();
                (parts, RelayBody::whole(whole, lease, rt, tally, status, self.arrival))
            }
            Answer::Stream(parts, body) => {
                let sse = is(&parts, b"text/event-stream");
                if let Some(trace) = tally.trace() {
                    trace.streaming(sse);
                }
                let status = parts.status.as_u16();
                let body = RelayBody::stream(body, deadline, sse, lease, rt, tally, status, self.arrival);
                (parts, body.named(self.adapter.as_ref().map(|(_, name)| name.clone())))
            }
        };
        let mut response = Response::new(Body::new(body));
        *response.status_mut() = parts.status;
        if let Some(ct) = parts.headers.get(header::CONTENT_TYPE).cloned() {
            response.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        response
    }
}

/// A replica's answer as the gateway relays it.
enum Answer {
    /// A JSON answer, read whole.
    Whole(axum::http::response::Parts, Bytes),
    /// Anything else, streamed as it comes.
    Stream(axum::http::response::Parts, Incoming),
}

impl Answer {
    /// Reads a JSON answer whole (`Some(Err)` if it broke off, `None` if
    /// `deadline` passed first); anything else is left to stream.
    ///
    /// # Cancel safety
    /// Dropping the future drops the answer (and the replica's connection).
    async fn read(
        upstream: hyper::Response<Incoming>,
        deadline: &mut Pin<Box<Sleep>>,
    ) -> Option<Result<Answer, hyper::Error>> {
        let (parts, body) = upstream.into_parts();
        if !is(&parts, b"application/json") {
            return Some(Ok(Answer::Stream(parts, body)));
        }
        tokio::select! {
            read = read_whole(body) => Some(read.map(|whole| Answer::Whole(parts, whole))),
            () = deadline.as_mut() => None,
        }
    }
}

/// Whether the answer's content type is `kind`.
fn is(parts: &axum::http::response::Parts, kind: &[u8]) -> bool {
    parts.headers.get(header::CONTENT_TYPE).is_some_and(|c| c.as_bytes().starts_with(kind))
}

/// All of `body`. Most answers come in one frame, which is returned as
/// it is: no copy, no allocation; several are joined.
///
/// # Cancel safety
/// Dropping the future drops the body (and the replica's connection).
async fn read_whole(mut body: Incoming) -> Result<Bytes, hyper::Error> {
    let mut first: Option<Bytes> = None;
    let mut joined: Option<Vec<u8>> = None;
    while let Some(frame) = body.frame().await {
        // Trailers have no place in a JSON answer.
        let Ok(data) = frame?.into_data() else { continue };
        if let Some(joined) = &mut joined {
            joined.extend_from_slice(&data);
        } else if let Some(head) = first.take() {
            joined = Some([&head[..], &data[..]].concat());
        } else {
            first = Some(data);
        }
    }
    Ok(joined.map(Bytes::from).or(first).unwrap_or_default())
}

fn timed_out(timeout_s: u64) -> Response {
    let message = format!("the request did not finish within its timeout ({timeout_s} s)");
    error(StatusCode::GATEWAY_TIMEOUT, "timeout", &message, None)
}

/// How many replicas found dead one request may pass over (each gives
/// its try back): more than a node holds of one model in practice, and
/// few enough that a request cannot keep a gateway busy for long.
const DEAD_REPLICAS_SKIPPED: u32 = 4;

/// A sync request's sends: a first and one retry. A send whose replica is
/// then found dead gives its try back — that replica is out of the table,
/// so the next goes elsewhere — up to [`DEAD_REPLICAS_SKIPPED`] times: a
/// node that dies takes all its replicas, and its siblings' health checks
/// may still be in flight when the retry is admitted.
struct Tries {
    left: u32,
    dead_skipped: u32,
}

impl Default for Tries {
    fn default() -> Self {
        Tries { left: 2, dead_skipped: 0 }
    }
}

impl Tries {
    /// Whether a try is left to take.
    fn any_left(&self) -> bool {
        self.left > 0
    }

    /// Takes a try; `false` when none is left.
    fn take(&mut self) -> bool {
        let Some(left) = self.left.checked_sub(1) else { return false };
        self.left = left;
        true
    }

    /// The last try's replica was found dead, or gone: the try is given
    /// back, within the bound.
    fn replica_dead(&mut self) {
        if self.dead_skipped < DEAD_REPLICAS_SKIPPED {
            self.dead_skipped += 1;
            self.left += 1;
        }
    }
}

/// Seconds a client is told to wait (`Retry-After`) before asking again
/// for a model that cannot run now: about the controller's first retry
/// of a model it could not place.
const UNAVAILABLE_RETRY_AFTER_S: u32 = 5;

/// The answer to a request admission refused, and its code.
pub(crate) fn admit_error(e: &AdmitError, timeout_s: u64) -> (ErrorCode, Response) {
    match e {
        AdmitError::Unavailable { reason } => {
            let message = format!("{reason}; retry");
            let mut r = error(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", &message, None);
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(UNAVAILABLE_RETRY_AFTER_S));
            (ErrorCode::Unavailable, r)
        }
        AdmitError::QueueFull { .. } => {
            let mut r = error(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", &e.to_string(), None);
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            (ErrorCode::QueueFull, r)
        }
        AdmitError::Timeout => {
            let message = format!("no replica became free within the request's timeout ({timeout_s} s)");
            (ErrorCode::Timeout, error(StatusCode::GATEWAY_TIMEOUT, "timeout", &message, None))
        }
        AdmitError::AdapterFailed { why, .. } | AdmitError::AdapterReplicaLeft(why) => {
            (ErrorCode::ReplicaFailed, error(StatusCode::BAD_GATEWAY, "service_unavailable", why, None))
        }
        AdmitError::AdapterRefused(why) => (
            ErrorCode::BadRequest,
            error(StatusCode::BAD_REQUEST, "invalid_request_error", why, Some("model")),
        ),
        _ => (
            ErrorCode::Unavailable,
            error(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", &e.to_string(), None),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_adapters_body_names_it_as_its_model_and_keeps_every_other_field_as_it_was() {
        let body = Bytes::from_static(
            br#"{"model":"t/m:acme/a","lora":"acme/a","messages":[{"role":"user","content":"h\u00e9 \"x\""}],"max_tokens":2}"#,
        );
        let out: Value = serde_json::from_slice(&for_adapter(&body, "acme/a")).unwrap();
        let mut want: Value = serde_json::from_slice(&body).unwrap();
        want["model"] = json!("acme/a");
        want.as_object_mut().unwrap().remove("lora");
        assert_eq!(out, want);
        // Not an object: passed on as it is (the engine answers it).
        assert_eq!(for_adapter(&Bytes::from_static(b"[1]"), "a"), Bytes::from_static(b"[1]"));
    }

    #[test]
    fn a_request_tries_twice_and_once_more_per_replica_found_dead_within_the_bound() {
        let mut t = Tries::default();
        assert!(t.take() && t.take());
        assert!(!t.take(), "a first and one retry");
        let mut t = Tries::default();
        let mut sends = 0;
        while t.take() {
            sends += 1;
            t.replica_dead();
        }
        assert_eq!(sends, 2 + DEAD_REPLICAS_SKIPPED, "every send found its replica dead");
    }
}
