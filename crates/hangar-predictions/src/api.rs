//! The Replicate-compatible HTTP API under `/v1`.
//!
//! Errors are RFC 7807 problem documents (`application/problem+json`)
//! with `title`, `detail` and `status`; input validation errors (422) add
//! `invalid_fields` naming each bad field.
//!
//! Every route authenticates first (401 before anything is looked up), and
//! a model an account may not use — and its versions and deployments — is
//! answered exactly as one that does not exist: the same 404, the same
//! body, so its existence does not leak.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hangar_core::{AccountId, ErrorCode};
use rand::Rng;
use serde_json::{json, Map, Value};

use crate::idempotency;
use crate::lifecycle::{parse_cancel_after, Deadlines, Status};
use crate::llm::{openapi_schema, LlmInput};
use crate::procedures::routes as procedures;
use crate::record::{rfc3339, JobKind, Record, StatusView};
use crate::service::{now, Inner, InputRules, Service};
use crate::store::{Cursor, StoreError};
use crate::webhook_policy::{Event, Filter};
use crate::webhook_target;

mod deployments;

/// Predictions per page of `GET /v1/predictions`.
pub const PAGE_SIZE: usize = 100;

/// A new random id: 26 characters of `[a-z0-9]`, as Replicate's look.
pub(crate) fn new_id() -> String {
    let mut rng = rand::rng();
    (0..ID_LEN).map(|_| ID_ALPHABET[rng.random_range(0..ID_ALPHABET.len())] as char).collect()
}

/// The letters of a prediction's id.
pub(crate) const ID_ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
/// The length of a prediction's id.
pub(crate) const ID_LEN: usize = 26;

/// Seconds a client is told to wait (`Retry-After`) before repeating a
/// call the store could not serve: about what a Redis restart takes.
const STORE_RETRY_AFTER_S: u32 = 2;

/// An RFC 7807 problem.
#[derive(Debug)]
pub(crate) struct Problem {
    status: StatusCode,
    title: &'static str,
    detail: String,
    invalid: Option<(String, String)>,
    /// Seconds for a `Retry-After` header.
    retry_after: Option<u32>,
}

impl Problem {
    pub(crate) fn new(status: StatusCode, title: &'static str, detail: impl Into<String>) -> Self {
        Problem { status, title, detail: detail.into(), invalid: None, retry_after: None }
    }

    /// A 422 naming `field`.
    pub(crate) fn invalid(field: &str, message: &str) -> Self {
        Problem {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            title: "Input validation failed",
            detail: format!("{field}: {message}"),
            invalid: Some((field.to_owned(), message.to_owned())),
            retry_after: None,
        }
    }

    pub(crate) fn bad_request(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::BAD_REQUEST, "Bad request", detail)
    }

    /// Its HTTP status.
    #[cfg(test)]
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    /// A 400 naming `field` (a value refused outright, not input to fix).
    pub(crate) fn bad_field(field: &str, message: &str) -> Self {
        Problem {
            status: StatusCode::BAD_REQUEST,
            title: "Bad request",
            detail: format!("{field}: {message}"),
            invalid: Some((field.to_owned(), message.to_owned())),
            retry_after: None,
        }
    }

    /// The problem of a body that could not be read: its status (413 when
    /// over the length limit, 400 otherwise), a title to match.
    fn body_rejected(r: BytesRejection) -> Self {
        let status = r.status();
        let title = match status {
            StatusCode::PAYLOAD_TOO_LARGE => "Payload too large",
            StatusCode::UNSUPPORTED_MEDIA_TYPE => "Unsupported media type",
            s if s.is_server_error() => "Internal error",
            _ => "Bad request",
        };
        Problem::new(status, title, r.body_text())
    }

    pub(crate) fn not_found(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::NOT_FOUND, "Not found", detail)
    }

    /// The answer to a store failure. An unreachable store (Redis down,
    /// paused or timing out; SQLite locked past its busy timeout) is 503
    /// with `Retry-After`, naming the store and nothing more: the call
    /// may be repeated, and a create that failed so stored nothing. Any
    /// other failure is 500. The cause goes to the log, never the body.
    pub(crate) fn store(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable { store, cause } => {
                // Not a fault of the server's: the outage itself is
                // logged once, by the watched store, not per request.
                tracing::debug!("predictions API: the prediction store ({store}) is unreachable: {cause}");
                Problem {
                    retry_after: Some(STORE_RETRY_AFTER_S),
                    ..Problem::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "Service unavailable",
                        format!("the prediction store ({store}) is unreachable; retry"),
                    )
                }
            }
            e => {
                tracing::error!("predictions API: {e}");
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Internal error",
                    "the prediction store failed; see the server log",
                )
            }
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        // OpenAI's `error` object beside the problem's fields: routes both
        // clients call (`GET /v1/models`, `/v1/models/{owner}/{name}`) fail
        // readably for either, and the rest cost nothing by it.
        let kind = match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        };
        let mut body = json!({
            "type": "about:blank", "title": self.title, "status": self.status.as_u16(), "detail": self.detail,
            "error": {"message": self.detail, "type": kind, "param": null, "code": null},
        });
        if let Some((field, message)) = self.invalid {
            body["invalid_fields"] = json!([{"type": "invalid", "field": field, "description": message}]);
        }
        let mut r = (self.status, body.to_string()).into_response();
        r.headers_mut()
            .insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/problem+json"));
        if let Some(secs) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from(secs));
        }
        r
    }
}

pub(crate) type ApiResult = Result<Response, Problem>;

impl Service {
    /// The API's routes (to merge into the server's router).
    pub fn router(&self) -> Router {
        Router::new()
            .route(
                "/v1/predictions",
                post(create_by_version).get(|s, h, q| list(s, h, q, JobKind::Prediction)),
            )
            .route("/v1/trainings", get(|s, h, q| list(s, h, q, JobKind::Training)))
            .route("/v1/trainings/{id}", get(|s, p, h| get_job(s, p, h, JobKind::Training)))
            .route("/v1/trainings/{id}/cancel", post(|s, p, h| cancel(s, p, h, JobKind::Training)))
            .route("/v1/models/{owner}/{name}/versions/{id}/trainings", post(create_training))
            .route("/v1/predictions/{id}", get(|s, p, h| get_job(s, p, h, JobKind::Prediction)))
            .route("/v1/predictions/{id}/cancel", post(|s, p, h| cancel(s, p, h, JobKind::Prediction)))
            .route("/v1/predictions/{id}/stream", get(stream))
            // `urls.web`: no page for a prediction exists yet, so this is
            // `urls.get` at another address — JSON, with the same key rules
            // (docs/predictions.md); a status page is to take it over.
            .route("/p/{id}", get(|s, p, h| get_job(s, p, h, JobKind::Prediction)))
            .route("/v1/models", get(models))
            .route("/v1/models/{owner}/{name}", get(model))
            .route("/v1/models/{owner}/{name}/predictions", post(create_by_model))
            .route("/v1/models/{owner}/{name}/versions", get(versions))
            .route("/v1/models/{owner}/{name}/versions/{id}", get(version))
            .merge(deployments::routes())
            .route("/v1/hardware", get(hardware))
            .route("/v1/deployments/{owner}/{name}/predictions", post(create_by_deployment))
            .route("/v1/webhooks/default/secret", get(secret))
            .route("/v1/webhooks/default/secret/rotate", post(rotate_secret))
            .route("/v1/procedures", get(procedures::list).post(procedures::create))
            .route("/v1/procedures/{owner}/{name}", get(procedures::get).delete(procedures::delete))
            .route("/v1/procedures/{owner}/{name}/predictions", post(procedures::run))
            .with_state(self.inner.clone())
    }
}

/// The account of a request, by the server's one set of key rules
/// ([`hangar_core::auth`]).
pub(crate) fn account(inner: &Inner, headers: &HeaderMap) -> Result<AccountId, Problem> {
    let authorization = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    match inner.api_keys.authenticate(authorization) {
        Ok(principal) => Ok(principal.account),
        Err(e) => Err(Problem::new(StatusCode::UNAUTHORIZED, "Unauthenticated", e.to_string())),
    }
}

fn view(headers: &HeaderMap) -> StatusView {
    StatusView::for_user_agent(headers.get(header::USER_AGENT).and_then(|v| v.to_str().ok()))
}

/// Where a create request goes: a model (through a deployment or not), or
/// a procedure (`kind` [`JobKind::Procedure`], `model` its `owner/name`).
pub(crate) struct Target {
    pub(crate) model: String,
    pub(crate) deployment: Option<String>,
    pub(crate) kind: JobKind,
}

impl Target {
    fn model(model: String) -> Self {
        Target { model, deployment: None, kind: JobKind::Prediction }
    }
}

pub(crate) fn parse_body(body: Result<Bytes, BytesRejection>) -> Result<Map<String, Value>, Problem> {
    let body = body.map_err(Problem::body_rejected)?;
    match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(Problem::bad_request("the body must be a JSON object")),
        Err(e) => Err(Problem::bad_request(format!("the body is not valid JSON: {e}"))),
    }
}

async fn create_by_version(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let body = parse_body(body)?;
    let version = match body.get("version") {
        Some(Value::String(v)) => v.clone(),
        None => return Err(Problem::invalid("version", "is required")),
        Some(_) => return Err(Problem::invalid("version", "must be a string")),
    };
    let (model, adapter) = resolve_version(&inner, &account, &version)?;
    let mut body = body;
    if let Some(adapter) = adapter {
        name_adapter(&mut body, adapter)?;
    }
    create(&inner, &headers, &account, Target::model(model), body).await
}

/// Puts the adapter a `BASE:ADAPTER` version names into the input's `lora`
/// (where a language model's input names it); a `lora` naming another
/// adapter is a 422.
fn name_adapter(body: &mut Map<String, Value>, adapter: String) -> Result<(), Problem> {
    let Some(Value::Object(input)) = body.get_mut("input") else { return Ok(()) };
    match input.get("lora") {
        Some(Value::String(named)) if *named != adapter => Err(Problem::invalid(
            "input.lora",
            &format!("names `{named}` and the version names adapter `{adapter}`; name it once"),
        )),
        _ => {
            input.insert("lora".to_owned(), Value::String(adapter));
            Ok(())
        }
    }
}

/// The model of `owner/name`, `owner/name:<id>` or `<id>`, among those
/// `account` may use (the others are not found, as unknown ones); and the
/// LoRA adapter of `owner/name:ADAPTER` (`BASE:ADAPTER`, an adapter named as
/// a version of its base, as Replicate's hotswap versions are), whose
/// existence the executor checks when the prediction is created.
fn resolve_version(
    inner: &Inner,
    account: &AccountId,
    version: &str,
) -> Result<(String, Option<String>), Problem> {
    let unknown = || Problem::not_found(format!("version `{version}` does not exist"));
    let visible = |key: &str| inner.models.get(key).filter(|m| m.allows(account));
    match version.split_once(':') {
        Some((model, id)) => {
            let m = visible(model).ok_or_else(unknown)?;
            match m.version == id {
                true => Ok((m.key.clone(), None)),
                false if id.parse::<hangar_core::AdapterName>().is_ok() => {
                    Ok((m.key.clone(), Some(id.to_owned())))
                }
                false => Err(unknown()),
            }
        }
        None if version.contains('/') => visible(version).map(|m| (m.key.clone(), None)).ok_or_else(unknown),
        None => inner
            .models
            .values()
            .find(|m| m.version == version && m.allows(account))
            .map(|m| (m.key.clone(), None))
            .ok_or_else(unknown),
    }
}

/// The model `owner/name` if `account` may use it; otherwise the 404 of a
/// model that does not exist.
fn visible_model<'a>(
    inner: &'a Inner,
    account: &AccountId,
    owner: &str,
    name: &str,
) -> Result<&'a crate::Model, Problem> {
    let key = format!("{owner}/{name}");
    match inner.models.get(&key) {
        Some(m) if m.allows(account) => Ok(m),
        _ => Err(Problem::not_found(format!("model `{key}` does not exist"))),
    }
}

async fn create_by_model(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let target = match visible_model(&inner, &account, &owner, &name) {
        Ok(m) => Target::model(m.key.clone()),
        // `replicate.run("owner/name")` of a procedure comes here.
        Err(problem) => crate::procedures::routes::target(&inner, &account, &owner, &name)?.ok_or(problem)?,
    };
    let body = parse_body(body)?;
    create(&inner, &headers, &account, target, body).await
}

async fn create_by_deployment(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let found = deployments::visible(&inner, &account, &owner, &name)?;
    let body = parse_body(body)?;
    let (model, deployment) = (found.model().to_owned(), Some(found.name().to_owned()));
    let target = Target { model, deployment, kind: JobKind::Prediction };
    create(&inner, &headers, &account, target, body).await
}

/// A training of a model version: its own queue, one at a time per
/// model, the model's `train_timeout_s`, a `destination`.
async fn create_training(
    State(inner): State<Arc<Inner>>,
    Path((owner, name, version)): Path<(String, String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let key = format!("{owner}/{name}");
    if inner.models.get(&key).is_none_or(|m| m.version != version || !m.allows(&account)) {
        return Err(Problem::not_found(format!("version `{version}` of `{key}` does not exist")));
    }
    let body = parse_body(body)?;
    create(&inner, &headers, &account, Target { model: key, deployment: None, kind: JobKind::Training }, body)
        .await
}

/// `Prefer: wait` / `wait=n` (1–60 s, default 60).
fn prefer_wait(headers: &HeaderMap) -> Result<Option<u64>, Problem> {
    let Some(v) = headers.get("prefer") else { return Ok(None) };
    let v = v.to_str().map_err(|_| Problem::bad_request("the Prefer header is not text"))?;
    for pref in v.split(',').map(str::trim) {
        if pref == "wait" {
            return Ok(Some(60));
        }
        if let Some(n) = pref.strip_prefix("wait=") {
            return match n.trim().parse::<u64>() {
                Ok(n) if (1..=60).contains(&n) => Ok(Some(n)),
                _ => Err(Problem::bad_request(format!(
                    "Prefer: `{pref}` is invalid: the wait must be 1 to 60 seconds"
                ))),
            };
        }
    }
    Ok(None)
}

/// Creates a prediction of `target`, which the callers resolved among
/// the models (or procedures) `account` may use.
pub(crate) async fn create(
    inner: &Arc<Inner>,
    headers: &HeaderMap,
    account: &AccountId,
    target: Target,
    body: Map<String, Value>,
) -> ApiResult {
    let (key, version, model_settings, llm) = match target.kind {
        JobKind::Procedure => crate::procedures::routes::to_run(inner, account, &target.model)?,
        _ => {
            let model = &inner.models[&target.model];
            debug_assert!(model.allows(account), "callers resolve only visible models");
            (model.key.clone(), model.version.clone(), model.settings, model.input == InputRules::Llm)
        }
    };
    let input = match body.get("input") {
        Some(v @ Value::Object(_)) => v.clone(),
        None => return Err(Problem::invalid("input", "is required")),
        Some(_) => return Err(Problem::invalid("input", "must be an object")),
    };
    let destination = match target.kind {
        // A language model's input is checked here; a training's input is
        // the trainer's to judge. (Queued requests come in through the
        // OpenAI routes, `Service::queue_request`, never here.)
        // A procedure's input is its code's to judge.
        JobKind::Procedure => None,
        JobKind::Prediction | JobKind::Request => {
            if llm {
                let parsed = LlmInput::parse(&input)
                    .map_err(|e| Problem::invalid(&format!("input.{}", e.field), &e.message))?;
                if let Some(adapter) = &parsed.lora {
                    inner.executor().check_adapter(&key, adapter, account).await.map_err(|e| {
                        let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
                        let title = if status == StatusCode::NOT_FOUND { "Not found" } else { "Bad request" };
                        Problem::new(status, title, e.message)
                    })?;
                }
            }
            None
        }
        JobKind::Training => match body.get("destination") {
            Some(Value::String(d))
                if d.split('/').count() == 2 && !d.starts_with('/') && !d.ends_with('/') =>
            {
                Some(d.clone())
            }
            None => {
                return Err(Problem::invalid(
                    "destination",
                    "is required (`owner/name` of the model to create)",
                ))
            }
            Some(_) => return Err(Problem::invalid("destination", "must be a string `owner/name`")),
        },
    };
    let webhook = match body.get("webhook") {
        None | Some(Value::Null) => None,
        Some(Value::String(url)) => {
            // Refused outright (400), not input to correct: where the
            // server may send requests (see `webhook_target`).
            if let Err(e) = webhook_target::check_url(url, &inner.allow) {
                return Err(Problem::bad_field("webhook", &format!("`{url}` is refused: {e}")));
            }
            Some(url.clone())
        }
        Some(_) => return Err(Problem::invalid("webhook", "must be a string (an http(s) URL)")),
    };
    let webhook_events = match body.get("webhook_events_filter") {
        None | Some(Value::Null) => Filter::ALL,
        Some(Value::Array(items)) => {
            let events = items
                .iter()
                .map(|i| i.as_str().and_then(Event::parse))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    Problem::invalid(
                        "webhook_events_filter",
                        "must list events among start, output, logs, completed",
                    )
                })?;
            Filter::of(&events)
        }
        Some(_) => return Err(Problem::invalid("webhook_events_filter", "must be a list")),
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(Problem::invalid("stream", "must be a boolean")),
    };
    let cancel_after = match headers.get("cancel-after") {
        None => None,
        Some(v) => {
            let v = v.to_str().map_err(|_| Problem::bad_request("the Cancel-After header is not text"))?;
            Some(parse_cancel_after(v).map_err(|e| Problem::bad_request(e.to_string()))?)
        }
    };
    let wait = prefer_wait(headers)?;
    let idempotency_key = idempotency::key(headers)?;
    let settings =
        target.deployment.as_ref().and_then(|d| inner.deployments.get(d)).map_or(model_settings, |(_, s)| *s);
    let created_at = now();
    let deadlines =
        Deadlines::new(&settings.limits(target.kind == JobKind::Training), created_at, cancel_after);
    let id = idempotency_key.as_deref().map_or_else(new_id, |k| idempotency::prediction_id(account, k));
    let mut record = Record::starting(id, &key, &version, account.as_str(), input, created_at, deadlines);
    record.kind = target.kind;
    record.destination = destination;
    record.deployment = target.deployment;
    record.webhook = webhook;
    record.webhook_events = webhook_events;
    record.stream = stream;
    let replayed = match &idempotency_key {
        None => {
            inner.create(&mut record).await.map_err(Problem::store)?;
            false
        }
        Some(k) => idempotency::create(inner, &mut record, k).await?,
    };
    let view = view(headers);
    let mut shown = match wait {
        // The prediction is stored: whatever happens to the wait, the
        // answer is 201 with it (a store that fails meanwhile shows it as
        // created), never an error that would make the client create it
        // again.
        Some(secs) => match wait_for_end(inner, &record.id, Duration::from_secs(secs)).await {
            Ok(Some(r)) => r,
            Ok(None) => record,
            Err(e) => {
                tracing::warn!(prediction = %record.id, "Prefer: wait ended early: {e}");
                record
            }
        },
        None => record,
    };
    if !shown.status.is_terminal() {
        // The stable `replicate` client treats any status but `starting`
        // after a wait as final: never show it partial output.
        shown.status = Status::Starting;
        shown.output = None;
        shown.logs.clear();
        shown.started_at = None;
    }
    let mut r = (StatusCode::CREATED, Json(shown.to_json(&inner.base_url, view))).into_response();
    if replayed {
        r.headers_mut().insert(idempotency::REPLAYED, header::HeaderValue::from_static("true"));
    }
    if let Ok(loc) = header::HeaderValue::from_str(&format!("{}/v1/predictions/{}", inner.base_url, shown.id))
    {
        r.headers_mut().insert(header::LOCATION, loc);
    }
    Ok(r)
}

/// Waits until `id` is terminal or `limit` passes; its state then
/// (`None` if it does not exist).
pub(crate) async fn wait_for_end(
    inner: &Arc<Inner>,
    id: &str,
    limit: Duration,
) -> Result<Option<Record>, StoreError> {
    let live = inner.live(id);
    let mut changes = live.changed.subscribe();
    let until = tokio::time::Instant::now() + limit;
    loop {
        let Some(r) = inner.current(id)? else { return Ok(None) };
        if r.status.is_terminal() {
            inner.forget_if_ended(&r);
            return Ok(Some(r));
        }
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep_until(until) => return Ok(Some(r)),
        }
    }
}

/// The record `id` of `kind` (a prediction or training if `None`) if
/// `account` owns it (404 otherwise: other accounts' predictions are not
/// revealed). A queued request of the OpenAI API is not the predictions
/// API's to show.
fn owned(inner: &Inner, id: &str, account: &AccountId, kind: Option<JobKind>) -> Result<Record, Problem> {
    let shown = |r: &Record| kind.map_or(r.kind != JobKind::Request, |k| k == r.kind.shown_as());
    match inner.current(id).map_err(Problem::store)? {
        Some(r) if r.account == account.as_str() && shown(&r) => Ok(r),
        _ => Err(Problem::not_found(format!(
            "{} `{id}` does not exist",
            kind.unwrap_or(JobKind::Prediction).as_str()
        ))),
    }
}

async fn get_job(
    State(inner): State<Arc<Inner>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    kind: JobKind,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let r = owned(&inner, &id, &account, Some(kind))?;
    Ok(Json(r.to_json(&inner.base_url, view(&headers))).into_response())
}

async fn cancel(
    State(inner): State<Arc<Inner>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    kind: JobKind,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let mut r = owned(&inner, &id, &account, Some(kind))?;
    if !r.status.is_terminal() {
        if let Some(live) = inner.live_if_any(&id) {
            // Its worker ends it (and stops the engine call).
            live.cancel.cancel();
            r = wait_for_end(&inner, &id, Duration::from_secs(5))
                .await
                .map_err(Problem::store)?
                .ok_or_else(|| Problem::not_found(format!("{} `{id}` does not exist", kind.as_str())))?;
        }
        if !r.status.is_terminal() {
            r.status = Status::Canceled;
            r.completed_at = Some(now());
            r.error = Some("canceled by the user".into());
            inner.finish(&r, Some(ErrorCode::Canceled)).map_err(Problem::store)?;
            r = owned(&inner, &id, &account, Some(kind))?;
        }
    }
    Ok(Json(r.to_json(&inner.base_url, view(&headers))).into_response())
}

#[derive(serde::Deserialize)]
struct ListQuery {
    cursor: Option<String>,
}

async fn list(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
    kind: JobKind,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let cursor = match q.cursor.as_deref() {
        None | Some("") => Cursor::Start,
        Some(c) => parse_cursor(c).ok_or_else(|| {
            Problem::bad_field(
                "cursor",
                &format!("`{c}` is invalid; use the `next`/`previous` URLs as given"),
            )
        })?,
    };
    let page = inner.store.list(Some(account.as_str()), kind, cursor, PAGE_SIZE).map_err(Problem::store)?;
    let url = |c: String| format!("{}/v1/{}s?cursor={c}", inner.base_url, kind.as_str());
    let next = page.more_after.then(|| page.results.last().map(|r| url(format!("b{}", r.seq)))).flatten();
    let previous =
        page.more_before.then(|| page.results.first().map(|r| url(format!("a{}", r.seq)))).flatten();
    let view = view(&headers);
    let results: Vec<Value> = page.results.iter().map(|r| r.to_json(&inner.base_url, view)).collect();
    Ok(Json(json!({"next": next, "previous": previous, "results": results})).into_response())
}

/// A listing cursor: `b<seq>` (the page after) or `a<seq>` (the page
/// before). Any other text, non-ASCII included, is `None`.
fn parse_cursor(c: &str) -> Option<Cursor> {
    if let Some(seq) = c.strip_prefix('b') {
        return seq.parse().ok().map(Cursor::Before);
    }
    c.strip_prefix('a')?.parse().ok().map(Cursor::After)
}

/// SSE at `urls.stream`: `output` and `logs` events as they happen (from
/// the beginning), then `error` if it did not succeed, then `done`.
async fn stream(State(inner): State<Arc<Inner>>, Path(id): Path<String>, headers: HeaderMap) -> ApiResult {
    let account = account(&inner, &headers)?;
    let r = owned(&inner, &id, &account, None)?;
    let live = (!r.status.is_terminal()).then(|| inner.live(&id));
    let changes = live.as_ref().map(|l| l.changed.subscribe());
    let state = StreamState {
        inner,
        id,
        live,
        changes,
        sent: 0,
        stored: StoredCursor::default(),
        next_id: 0,
        finished: false,
        queue: Vec::new(),
    };
    let events = futures::stream::unfold(state, |mut s| async move {
        let e = s.next_event().await?;
        Some((Ok::<_, std::convert::Infallible>(e), s))
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))).into_response())
}

struct StreamState {
    inner: Arc<Inner>,
    id: String,
    live: Option<Arc<crate::service::Live>>,
    changes: Option<tokio::sync::watch::Receiver<u64>>,
    /// Live events already sent.
    sent: usize,
    /// What was sent of the stored record's output and logs (a prediction
    /// another gateway runs, or one that ended before any live event).
    stored: StoredCursor,
    next_id: u64,
    finished: bool,
    queue: Vec<(String, String)>,
}

impl StreamState {
    fn event(&mut self, name: &str, data: String) -> SseEvent {
        self.next_id += 1;
        SseEvent::default().event(name).id(self.next_id.to_string()).data(data)
    }

    async fn next_event(&mut self) -> Option<SseEvent> {
        loop {
            if !self.queue.is_empty() {
                let (name, data) = self.queue.remove(0);
                return Some(self.event(&name, data));
            }
            if self.finished {
                return None;
            }
            if let Some(live) = &self.live {
                // (A run lost and put back starts its events again: fewer
                // than were sent until it catches up.)
                let fresh: Vec<(Event, Value)> = live
                    .state
                    .lock()
                    .expect("live state")
                    .events
                    .get(self.sent..)
                    .unwrap_or_default()
                    .to_vec();
                self.sent += fresh.len();
                self.queue.extend(fresh.into_iter().map(|(e, v)| (e.as_str().to_owned(), item_text(&v))));
                if !self.queue.is_empty() {
                    continue;
                }
            }
            // Run here: the live events carry it. Elsewhere: the record,
            // which the gateway running it saves every half second.
            let here = self.live.as_ref().is_some_and(|l| l.state.lock().expect("live state").runs_here());
            let r = match self.inner.store.get(&self.id) {
                Ok(Some(r)) => r,
                Err(e) if e.is_unavailable() => {
                    // A blip of the store: keep the stream open (its
                    // keep-alives go on) and read again.
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                _ => {
                    self.finished = true;
                    self.queue.push(("error".into(), "the prediction could not be read".into()));
                    continue;
                }
            };
            if r.status.is_terminal() {
                self.inner.forget_if_ended(&r);
                if self.sent == 0 {
                    // Nothing seen live: the rest of the record.
                    self.queue.extend(self.stored.rest(&r, true));
                }
                if r.status != Status::Succeeded {
                    self.queue
                        .push(("error".into(), r.error.clone().unwrap_or_else(|| r.status.to_string())));
                }
                let reason = match r.status {
                    Status::Succeeded => json!({}),
                    Status::Canceled | Status::Aborted => json!({"reason": "canceled"}),
                    _ => json!({"reason": "error"}),
                };
                self.queue.push(("done".into(), reason.to_string()));
                self.finished = true;
                continue;
            }
            if !here && r.status == Status::Processing {
                self.queue.extend(self.stored.rest(&r, false));
                if !self.queue.is_empty() {
                    continue;
                }
            }
            // A run elsewhere is read again sooner: its progress comes only
            // through the store.
            let poll = if here { Duration::from_secs(1) } else { STORED_POLL };
            match &mut self.changes {
                Some(rx) => {
                    tokio::select! {
                        _ = rx.changed() => {}
                        _ = tokio::time::sleep(poll) => {}
                    }
                }
                None => tokio::time::sleep(poll).await,
            }
        }
    }
}

/// How often an SSE stream reads the record of a prediction another
/// gateway runs.
const STORED_POLL: Duration = Duration::from_millis(250);

/// How much of a stored record's output and logs a stream has sent.
#[derive(Debug, Default)]
struct StoredCursor {
    items: usize,
    log_bytes: usize,
}

impl StoredCursor {
    /// The events for what `r` holds beyond what was sent: each new output
    /// item, each new whole log line (the last, unfinished one too once
    /// `ended`). An ended record's output that is not a list is one item.
    fn rest(&mut self, r: &Record, ended: bool) -> Vec<(String, String)> {
        let single;
        let items: &[Value] = match &r.output {
            Some(Value::Array(items)) => items,
            Some(v) if ended && self.items == 0 => {
                single = [v.clone()];
                &single
            }
            _ => &[],
        };
        let mut events: Vec<(String, String)> =
            items.iter().skip(self.items).map(|v| ("output".to_owned(), item_text(v))).collect();
        self.items = self.items.max(items.len());
        let fresh = r.logs.get(self.log_bytes..).unwrap_or("");
        let upto = if ended { fresh.len() } else { fresh.rfind('\n').map_or(0, |i| i + 1) };
        events.extend(fresh[..upto].lines().map(|line| ("logs".to_owned(), line.to_owned())));
        self.log_bytes += upto;
        events
    }
}

fn item_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn version_json(inner: &Inner, key: &str) -> Value {
    let m = &inner.models[key];
    json!({
        "id": m.version,
        "created_at": rfc3339(inner.started_ms),
        "cog_version": "0.16.0",
        "openapi_schema": match &m.input {
            InputRules::Llm => openapi_schema(),
            InputRules::Own(Some(schema)) => schema.clone(),
            InputRules::Own(None) => json!({"openapi": "3.0.2", "info": {"title": "Cog"}, "paths": {},
                "components": {"schemas": {"Input": {"type": "object", "title": "Input"}}}}),
        },
    })
}

async fn model(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let model = visible_model(&inner, &account, &owner, &name)?;
    Ok(Json(model_json(&inner, model)).into_response())
}

/// A model as both APIs read it: OpenAI's model object (`id`, `object`,
/// `created`, `owned_by`) and Replicate's (`owner`, `name`, `latest_version`
/// …) in one — `client.models.retrieve("owner/name")` sent unencoded
/// reaches the Replicate route. A key without one `/` has no owner: its
/// `owner` is empty and its `name` the whole key.
fn model_json(inner: &Inner, model: &crate::Model) -> Value {
    let key = &model.key;
    let (owner, name) = key.split_once('/').unwrap_or(("", key));
    let visibility = if model.access.is_some() { "private" } else { "public" };
    json!({
        "id": key,
        "object": "model",
        "created": inner.started_ms / 1000,
        "owned_by": "hangar",
        "url": format!("{}/{key}", inner.base_url),
        "owner": owner,
        "name": name,
        "description": format!("{key}, served by hangar"),
        "visibility": visibility,
        "github_url": null, "paper_url": null, "license_url": null, "cover_image_url": null,
        "run_count": 0,
        "default_example": null,
        "latest_version": version_json(inner, key),
    })
}

/// `GET /v1/models`: every model the caller may use, in one answer both
/// clients read — OpenAI's list (`object`, `data`) and Replicate's page
/// (`results`, `next`, `previous`; one page holds them all).
async fn models(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> ApiResult {
    let account = account(&inner, &headers)?;
    let models: Vec<Value> =
        inner.models.values().filter(|m| m.allows(&account)).map(|m| model_json(&inner, m)).collect();
    Ok(Json(json!({"object": "list", "data": models, "results": models, "next": null, "previous": null}))
        .into_response())
}

async fn versions(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let key = visible_model(&inner, &account, &owner, &name)?.key.clone();
    Ok(Json(json!({"next": null, "previous": null, "results": [version_json(&inner, &key)]})).into_response())
}

async fn version(
    State(inner): State<Arc<Inner>>,
    Path((owner, name, id)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let key = visible_model(&inner, &account, &owner, &name)?.key.clone();
    if inner.models[&key].version != id {
        return Err(Problem::not_found(format!("version `{id}` of `{key}` does not exist")));
    }
    Ok(Json(version_json(&inner, &key)).into_response())
}

/// `GET /v1/hardware`: the hardware the caller's models run on, each SKU
/// once (`gpu` for a model any GPU node takes, `gpu-KIND` for one that
/// needs nodes of that `gpu_kind`) — what a deployment's release names.
async fn hardware(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> ApiResult {
    let account = account(&inner, &headers)?;
    let skus: std::collections::BTreeMap<&str, String> = inner
        .models
        .values()
        .filter(|m| m.allows(&account))
        .map(|m| (m.capacity.hardware.as_str(), m.capacity.hardware_name()))
        .collect();
    let list: Vec<Value> = skus.into_iter().map(|(sku, name)| json!({"sku": sku, "name": name})).collect();
    Ok(Json(list).into_response())
}

/// The account's current signing secret (each account has its own).
async fn secret(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> ApiResult {
    let account = account(&inner, &headers)?;
    let mut secrets = inner.signing_secrets(account.as_str()).map_err(Problem::store)?;
    Ok(Json(json!({"key": secrets.swap_remove(0)})).into_response())
}

/// Makes a new signing secret for the account. The one it replaces stays
/// valid for `webhook_secret_grace_s`: until then webhooks carry both
/// signatures.
async fn rotate_secret(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> ApiResult {
    let account = account(&inner, &headers)?;
    let grace = inner.config.webhook_secret_grace_s.saturating_mul(1000);
    let r = inner
        .store
        .rotate_webhook_secret(account.as_str(), now(), grace, &crate::signing::new_secret)
        .map_err(Problem::store)?;
    Ok(Json(json!({"key": r.key, "previous_key_valid_until": r.previous_valid_until.map(rfc3339)}))
        .into_response())
}
