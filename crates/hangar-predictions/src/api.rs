//! The Replicate-compatible HTTP API under `/v1`.
//!
//! Errors are RFC 7807 problem documents (`application/problem+json`)
//! with `title`, `detail` and `status`; input validation errors (422) add
//! `invalid_fields` naming each bad field.

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
use hangar_core::AccountId;
use rand::Rng;
use serde_json::{json, Map, Value};

use crate::lifecycle::{parse_cancel_after, Deadlines, Status};
use crate::llm::{openapi_schema, LlmInput};
use crate::record::{rfc3339, JobKind, Record, StatusView};
use crate::service::{now, Inner, InputRules, Service};
use crate::store::{Cursor, PredictionQueue};
use crate::webhook_policy::{Event, Filter};

/// Predictions per page of `GET /v1/predictions`.
pub const PAGE_SIZE: usize = 100;

/// A new random id: 26 characters of `[a-z0-9]`, as Replicate's look.
pub(crate) fn new_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..26).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect()
}

/// An RFC 7807 problem.
struct Problem {
    status: StatusCode,
    title: &'static str,
    detail: String,
    invalid: Option<(String, String)>,
}

impl Problem {
    fn new(status: StatusCode, title: &'static str, detail: impl Into<String>) -> Self {
        Problem { status, title, detail: detail.into(), invalid: None }
    }

    /// A 422 naming `field`.
    fn invalid(field: &str, message: &str) -> Self {
        Problem {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            title: "Input validation failed",
            detail: format!("{field}: {message}"),
            invalid: Some((field.to_owned(), message.to_owned())),
        }
    }

    fn bad_request(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::BAD_REQUEST, "Bad request", detail)
    }

    fn not_found(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::NOT_FOUND, "Not found", detail)
    }

    fn internal(e: impl std::fmt::Display) -> Self {
        tracing::error!("predictions API: {e}");
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Internal error",
            "the prediction store failed; see the server log",
        )
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut body = json!({"type": "about:blank", "title": self.title, "status": self.status.as_u16(), "detail": self.detail});
        if let Some((field, message)) = self.invalid {
            body["invalid_fields"] = json!([{"type": "invalid", "field": field, "description": message}]);
        }
        let mut r = (self.status, body.to_string()).into_response();
        r.headers_mut()
            .insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/problem+json"));
        r
    }
}

type ApiResult = Result<Response, Problem>;

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
            // `urls.web`: there is no web UI; the same object as `urls.get`.
            .route("/p/{id}", get(|s, p, h| get_job(s, p, h, JobKind::Prediction)))
            .route("/v1/models/{owner}/{name}", get(model))
            .route("/v1/models/{owner}/{name}/predictions", post(create_by_model))
            .route("/v1/models/{owner}/{name}/versions", get(versions))
            .route("/v1/models/{owner}/{name}/versions/{id}", get(version))
            .route("/v1/deployments/{owner}/{name}", get(deployment))
            .route("/v1/deployments/{owner}/{name}/predictions", post(create_by_deployment))
            .route("/v1/webhooks/default/secret", get(secret))
            .with_state(self.inner.clone())
    }
}

/// The account of a request, with the sync gateway's rules: `anonymous`
/// when no API keys are configured, else the owner of the bearer key.
fn account(inner: &Inner, headers: &HeaderMap) -> Result<AccountId, Problem> {
    let unauthorized = |d: &str| Problem::new(StatusCode::UNAUTHORIZED, "Unauthenticated", d);
    if inner.api_keys.is_empty() {
        return Ok("anonymous".parse().expect("a valid account id"));
    }
    let value = headers
        .get(header::AUTHORIZATION)
        .ok_or_else(|| unauthorized("missing API key: send `Authorization: Bearer KEY`"))?;
    let key = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("Token ")))
        .ok_or_else(|| unauthorized("malformed Authorization header: expected `Bearer KEY`"))?;
    inner.api_keys.get(key.trim()).cloned().ok_or_else(|| unauthorized("invalid API key"))
}

fn view(headers: &HeaderMap) -> StatusView {
    StatusView::for_user_agent(headers.get(header::USER_AGENT).and_then(|v| v.to_str().ok()))
}

/// Where a create request goes.
struct Target {
    model: String,
    deployment: Option<String>,
    kind: JobKind,
}

impl Target {
    fn model(model: String) -> Self {
        Target { model, deployment: None, kind: JobKind::Prediction }
    }
}

fn parse_body(body: Result<Bytes, BytesRejection>) -> Result<Map<String, Value>, Problem> {
    let body = body.map_err(|r| Problem::new(r.status(), "Bad request", r.body_text()))?;
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
    let body = parse_body(body)?;
    let version = match body.get("version") {
        Some(Value::String(v)) => v.clone(),
        None => return Err(Problem::invalid("version", "is required")),
        Some(_) => return Err(Problem::invalid("version", "must be a string")),
    };
    let model = resolve_version(&inner, &version)?;
    create(&inner, &headers, Target::model(model), body).await
}

/// The model of `owner/name`, `owner/name:<id>` or `<id>`.
fn resolve_version(inner: &Inner, version: &str) -> Result<String, Problem> {
    let unknown = || Problem::not_found(format!("version `{version}` does not exist"));
    match version.split_once(':') {
        Some((model, id)) => {
            let m = inner.models.get(model).ok_or_else(unknown)?;
            (m.version == id).then(|| m.key.clone()).ok_or_else(unknown)
        }
        None if version.contains('/') => inner.models.get(version).map(|m| m.key.clone()).ok_or_else(unknown),
        None => {
            inner.models.values().find(|m| m.version == version).map(|m| m.key.clone()).ok_or_else(unknown)
        }
    }
}

async fn create_by_model(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let key = format!("{owner}/{name}");
    if !inner.models.contains_key(&key) {
        return Err(Problem::not_found(format!("model `{key}` does not exist")));
    }
    let body = parse_body(body)?;
    create(&inner, &headers, Target::model(key), body).await
}

async fn create_by_deployment(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let key = format!("{owner}/{name}");
    let Some((model, _)) = inner.deployments.get(&key) else {
        return Err(Problem::not_found(format!("deployment `{key}` does not exist")));
    };
    let model = model.clone();
    let body = parse_body(body)?;
    create(&inner, &headers, Target { model, deployment: Some(key), kind: JobKind::Prediction }, body).await
}

/// A training of a model version: its own queue, one at a time per
/// model, the model's `train_timeout_s`, a `destination`.
async fn create_training(
    State(inner): State<Arc<Inner>>,
    Path((owner, name, version)): Path<(String, String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let key = format!("{owner}/{name}");
    if inner.models.get(&key).is_none_or(|m| m.version != version) {
        return Err(Problem::not_found(format!("version `{version}` of `{key}` does not exist")));
    }
    let body = parse_body(body)?;
    create(&inner, &headers, Target { model: key, deployment: None, kind: JobKind::Training }, body).await
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

async fn create(
    inner: &Arc<Inner>,
    headers: &HeaderMap,
    target: Target,
    body: Map<String, Value>,
) -> ApiResult {
    let account = account(inner, headers)?;
    let model = &inner.models[&target.model];
    if !model.allows(&account) {
        return Err(Problem::new(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!("account `{account}` may not use the model `{}`", model.key),
        ));
    }
    let input = match body.get("input") {
        Some(v @ Value::Object(_)) => v.clone(),
        None => return Err(Problem::invalid("input", "is required")),
        Some(_) => return Err(Problem::invalid("input", "must be an object")),
    };
    let destination = match target.kind {
        // A language model's input is checked here; a training's input is
        // the trainer's to judge.
        JobKind::Prediction => {
            if model.input == InputRules::Llm {
                LlmInput::parse(&input)
                    .map_err(|e| Problem::invalid(&format!("input.{}", e.field), &e.message))?;
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
            let ok = reqwest::Url::parse(url)
                .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.has_host());
            if !ok {
                return Err(Problem::bad_request(format!("webhook `{url}` is not an http(s) URL")));
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
    let settings =
        target.deployment.as_ref().and_then(|d| inner.deployments.get(d)).map_or(model.settings, |(_, s)| *s);
    let created_at = now();
    let deadlines =
        Deadlines::new(&settings.limits(target.kind == JobKind::Training), created_at, cancel_after);
    let mut record = Record::starting(
        new_id(),
        &model.key,
        &model.version,
        account.as_str(),
        input,
        created_at,
        deadlines,
    );
    record.kind = target.kind;
    record.destination = destination;
    record.deployment = target.deployment;
    record.webhook = webhook;
    record.webhook_events = webhook_events;
    record.stream = stream;
    inner.create(&mut record).await.map_err(Problem::internal)?;
    let view = view(headers);
    let mut shown = match wait {
        Some(secs) => wait_for_end(inner, &record.id, Duration::from_secs(secs)).await?,
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
    if let Ok(loc) = header::HeaderValue::from_str(&format!("{}/v1/predictions/{}", inner.base_url, shown.id))
    {
        r.headers_mut().insert(header::LOCATION, loc);
    }
    Ok(r)
}

/// Waits until `id` is terminal or `limit` passes; its state then.
async fn wait_for_end(inner: &Arc<Inner>, id: &str, limit: Duration) -> Result<Record, Problem> {
    let live = inner.live(id);
    let mut changes = live.changed.subscribe();
    let until = tokio::time::Instant::now() + limit;
    loop {
        let r = inner.current(id).map_err(Problem::internal)?.ok_or_else(|| Problem::not_found("gone"))?;
        if r.status.is_terminal() {
            inner.forget_if_ended(&r);
            return Ok(r);
        }
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep_until(until) => return Ok(r),
        }
    }
}

/// The record `id` of `kind` (any kind if `None`) if `account` owns it
/// (404 otherwise: other accounts' predictions are not revealed).
fn owned(inner: &Inner, id: &str, account: &AccountId, kind: Option<JobKind>) -> Result<Record, Problem> {
    match inner.current(id).map_err(Problem::internal)? {
        Some(r) if r.account == account.as_str() && kind.is_none_or(|k| k == r.kind) => Ok(r),
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
            r = wait_for_end(&inner, &id, Duration::from_secs(5)).await?;
        }
        if !r.status.is_terminal() {
            r.status = Status::Canceled;
            r.completed_at = Some(now());
            r.error = Some("canceled by the user".into());
            inner.finish(&r).map_err(Problem::internal)?;
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
        Some(c) => {
            let bad = || {
                Problem::bad_request(format!(
                    "cursor `{c}` is invalid; use the `next`/`previous` URLs as given"
                ))
            };
            let n = |s: &str| s.parse::<i64>().map_err(|_| bad());
            match c.split_at(1) {
                ("b", s) => Cursor::Before(n(s)?),
                ("a", s) => Cursor::After(n(s)?),
                _ => return Err(bad()),
            }
        }
    };
    let page =
        inner.store.list(Some(account.as_str()), kind, cursor, PAGE_SIZE).map_err(Problem::internal)?;
    let url = |c: String| format!("{}/v1/{}s?cursor={c}", inner.base_url, kind.as_str());
    let next = page.more_after.then(|| page.results.last().map(|r| url(format!("b{}", r.seq)))).flatten();
    let previous =
        page.more_before.then(|| page.results.first().map(|r| url(format!("a{}", r.seq)))).flatten();
    let view = view(&headers);
    let results: Vec<Value> = page.results.iter().map(|r| r.to_json(&inner.base_url, view)).collect();
    Ok(Json(json!({"next": next, "previous": previous, "results": results})).into_response())
}

/// SSE at `urls.stream`: `output` and `logs` events as they happen (from
/// the beginning), then `error` if it did not succeed, then `done`.
async fn stream(State(inner): State<Arc<Inner>>, Path(id): Path<String>, headers: HeaderMap) -> ApiResult {
    let account = account(&inner, &headers)?;
    let r = owned(&inner, &id, &account, None)?;
    let live = (!r.status.is_terminal()).then(|| inner.live(&id));
    let changes = live.as_ref().map(|l| l.changed.subscribe());
    let state =
        StreamState { inner, id, live, changes, sent: 0, next_id: 0, finished: false, queue: Vec::new() };
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
                let fresh: Vec<(Event, Value)> =
                    live.state.lock().expect("live state").events[self.sent..].to_vec();
                self.sent += fresh.len();
                self.queue.extend(fresh.into_iter().map(|(e, v)| (e.as_str().to_owned(), item_text(&v))));
                if !self.queue.is_empty() {
                    continue;
                }
            }
            let r = match self.inner.store.get(&self.id) {
                Ok(Some(r)) => r,
                _ => {
                    self.finished = true;
                    self.queue.push(("error".into(), "the prediction could not be read".into()));
                    continue;
                }
            };
            if r.status.is_terminal() {
                self.inner.forget_if_ended(&r);
                if self.live.is_none() || self.sent == 0 {
                    // Not followed live (or nothing seen live): replay the record.
                    let items = match &r.output {
                        Some(Value::Array(items)) => items.clone(),
                        Some(v) => vec![v.clone()],
                        None => Vec::new(),
                    };
                    self.queue.extend(items.iter().map(|v| ("output".to_owned(), item_text(v))));
                    if !r.logs.is_empty() && self.live.is_none() {
                        self.queue.push(("logs".into(), r.logs.trim_end().to_owned()));
                    }
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
            match &mut self.changes {
                Some(rx) => {
                    tokio::select! {
                        _ = rx.changed() => {}
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
                None => tokio::time::sleep(Duration::from_secs(1)).await,
            }
        }
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
        "created_at": rfc3339(0),
        "cog_version": "0.16.0",
        "openapi_schema": match &m.input {
            InputRules::Llm => openapi_schema(),
            InputRules::Own(Some(schema)) => schema.clone(),
            InputRules::Own(None) => json!({"openapi": "3.0.2", "info": {"title": "Cog"}, "paths": {},
                "components": {"schemas": {"Input": {"type": "object", "title": "Input"}}}}),
        },
    })
}

fn visible_model(inner: &Inner, headers: &HeaderMap, owner: &str, name: &str) -> Result<String, Problem> {
    let account = account(inner, headers)?;
    let key = format!("{owner}/{name}");
    match inner.models.get(&key) {
        Some(m) if m.allows(&account) => Ok(key),
        _ => Err(Problem::not_found(format!("model `{key}` does not exist"))),
    }
}

async fn model(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    let key = visible_model(&inner, &headers, &owner, &name)?;
    Ok(Json(json!({
        "url": format!("{}/{key}", inner.base_url),
        "owner": owner,
        "name": name,
        "description": format!("{key}, served by hangar"),
        "visibility": "public",
        "github_url": null, "paper_url": null, "license_url": null, "cover_image_url": null,
        "run_count": 0,
        "default_example": null,
        "latest_version": version_json(&inner, &key),
    }))
    .into_response())
}

async fn versions(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    let key = visible_model(&inner, &headers, &owner, &name)?;
    Ok(Json(json!({"next": null, "previous": null, "results": [version_json(&inner, &key)]})).into_response())
}

async fn version(
    State(inner): State<Arc<Inner>>,
    Path((owner, name, id)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    let key = visible_model(&inner, &headers, &owner, &name)?;
    if inner.models[&key].version != id {
        return Err(Problem::not_found(format!("version `{id}` of `{key}` does not exist")));
    }
    Ok(Json(version_json(&inner, &key)).into_response())
}

async fn deployment(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    account(&inner, &headers)?;
    let key = format!("{owner}/{name}");
    let Some((model, settings)) = inner.deployments.get(&key) else {
        return Err(Problem::not_found(format!("deployment `{key}` does not exist")));
    };
    Ok(Json(json!({
        "owner": owner,
        "name": name,
        "current_release": {
            "number": 1,
            "model": model,
            "version": inner.models[model].version,
            "created_at": rfc3339(0),
            "configuration": {
                "max_run_lifetime_s": settings.max_run_lifetime_s,
                "predict_timeout_s": settings.predict_timeout_s,
                "idempotent": settings.idempotent,
            },
        },
    }))
    .into_response())
}

async fn secret(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> ApiResult {
    account(&inner, &headers)?;
    Ok(Json(json!({"key": inner.secret})).into_response())
}
