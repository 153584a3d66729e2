//! Workers AI's async mode on the OpenAI routes (seed 001, "Async Queue";
//! docs/serve.md): what the gateway reads of a body and answers.
//!
//! Both conditions must hold, as in Workers AI: the model has
//! `use_async_queue`, and the body asks, with `"options": {"queueRequest":
//! true}`. Such a request is not forwarded: it becomes a durable job in
//! the model's prediction queue ([`hangar_predictions::request`]), with
//! `stream`, `stream_options` and `options` removed from what the engine
//! will be sent (a queued request is answered whole; the seed deletes the
//! stream flag). The client then waits up to
//! `predictions.queue_request_wait_ms` (1 s): an answer by then is given
//! at once, as a synchronous request's would be (the engine's status and
//! JSON, its `model` the name the client used); otherwise `202` with
//! `{"request_id", "status": "queued" | "running", "model"}` — Workers AI's
//! shape. A follow-up to the same path, `{"model": M, "inputs":
//! {"request_id": ID}}`, answers `202` the same way while it waits or
//! runs, and its answer once it has ended — an engine's error with the
//! engine's status and body, a failure without one with the status a
//! synchronous request failing so gets (504 past a deadline, 502 for a
//! lost replica, …) and why. An id that is not a request of the caller's
//! on that model and path is a 404 naming it, however it exists.
//!
//! A model without `use_async_queue` serves every request synchronously,
//! its body passed on untouched, as before. A queued request is counted
//! once, when its job ends (as a `prediction`: it waits as one); the
//! answers of this module count nothing but their own refusals.

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use hangar_core::{AccountId, Adapter, ErrorCode};
use hangar_predictions::request::{Answer, QueueRequestError, QueuedRequest, RequestState};
use hangar_predictions::store::StoreError;
use hangar_predictions::Service;
use hangar_runtime::serve::{ModelRuntime, Tally};
use serde_json::{json, Value};

use crate::openai::error;

/// What a request to a model with `use_async_queue` asks of its async
/// mode.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Asked {
    /// `options.queueRequest: true`: queue it.
    Queue,
    /// `inputs.request_id`: a follow-up about that request.
    FollowUp(String),
    /// A field of the mode with a value it cannot take: the 400 message
    /// and the field.
    Refused(String, &'static str),
}

impl Asked {
    /// What the body's `options` and `inputs` ask of a model whose
    /// `use_async_queue` is `enabled`; `None`: serve it synchronously.
    /// A follow-up is read first: its body names a request already
    /// queued, whatever else it says.
    pub(crate) fn read(enabled: bool, options: Option<&Value>, inputs: Option<&Value>) -> Option<Asked> {
        if !enabled {
            return None;
        }
        if let Some(id) = inputs.and_then(|i| i.get("request_id")) {
            return Some(match id {
                Value::String(id) if !id.is_empty() => Asked::FollowUp(id.clone()),
                _ => Asked::Refused(
                    "`inputs.request_id` must be the `request_id` string a queued request was answered with"
                        .into(),
                    "inputs.request_id",
                ),
            });
        }
        match options.and_then(|o| o.get("queueRequest")) {
            None | Some(Value::Null | Value::Bool(false)) => None,
            Some(Value::Bool(true)) => Some(Asked::Queue),
            Some(other) => Some(Asked::Refused(
                format!("`options.queueRequest` must be a boolean, not {other}"),
                "options.queueRequest",
            )),
        }
    }

    /// The answer to a request that asked this of `to`'s model: queued
    /// (and perhaps answered at once), a follow-up answered, or refused.
    /// `body` is what the engine would have been sent, `adapter` the
    /// request's LoRA adapter and the model's name as the client wrote it.
    ///
    /// # Cancel safety
    /// Dropping the future may leave the request queued, and run; it is
    /// then counted both as a client that left and when its job ends.
    pub(crate) async fn answer(
        self,
        to: To<'_>,
        body: &Bytes,
        adapter: Option<&((Adapter, f64), Arc<str>)>,
        tally: Tally,
    ) -> Response {
        match self {
            Asked::Refused(message, field) => {
                let refused = error(StatusCode::BAD_REQUEST, "invalid_request_error", &message, Some(field));
                counted(tally, ErrorCode::BadRequest, refused)
            }
            Asked::FollowUp(id) => {
                tally.handed_over();
                let key = to.rt.config().key.as_str();
                match to.service.queued_request(&id, to.account, key, to.path) {
                    Ok(Some(state)) => answered(&id, state, to.model),
                    Ok(None) => {
                        let message = format!("there is no queued request `{id}` of `{key}` at {}", to.path);
                        error(
                            StatusCode::NOT_FOUND,
                            "invalid_request_error",
                            &message,
                            Some("inputs.request_id"),
                        )
                    }
                    Err(e) => store_failed(&e).1,
                }
            }
            Asked::Queue => {
                let request = match queued(to, body, adapter) {
                    Ok(request) => request,
                    Err(refused) => return counted(tally, ErrorCode::BadRequest, refused),
                };
                let key = to.rt.config().key.as_str();
                let id = match to.service.queue_request(key, to.account, &request).await {
                    Ok(id) => id,
                    Err(QueueRequestError::Store(e)) => {
                        let (code, response) = store_failed(&e);
                        return counted(tally, code, response);
                    }
                    Err(e) => {
                        tracing::error!(model = %key, "cannot queue a request: {e}");
                        let message = "the request could not be queued; see the server log";
                        let response =
                            error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message, None);
                        return counted(tally, ErrorCode::Internal, response);
                    }
                };
                // A job now, counted when it ends.
                tally.handed_over();
                answered(&id, to.service.wait_for_request(&id).await, &request.model)
            }
        }
    }
}

/// Where a request of the async mode was sent.
#[derive(Clone, Copy)]
pub(crate) struct To<'a> {
    /// The predictions service, whose queue keeps it.
    pub service: &'a Service,
    /// Its model.
    pub rt: &'a Arc<ModelRuntime>,
    /// The route (`/v1/chat/completions`, …).
    pub path: &'a str,
    /// Whom it acts for.
    pub account: &'a AccountId,
    /// The model as the client wrote it.
    pub model: &'a str,
}

/// The job of a request `to` asked to queue: `body` as the engine is to be
/// sent it, answered whole; a 400 if it is not a JSON object.
#[allow(clippy::result_large_err)]
fn queued(
    to: To<'_>,
    body: &Bytes,
    adapter: Option<&((Adapter, f64), Arc<str>)>,
) -> Result<QueuedRequest, Response> {
    let Ok(Value::Object(mut fields)) = serde_json::from_slice::<Value>(body) else {
        let message = "a queued request's body must be a JSON object";
        return Err(error(StatusCode::BAD_REQUEST, "invalid_request_error", message, None));
    };
    for field in ["stream", "stream_options", "options"] {
        fields.remove(field);
    }
    Ok(QueuedRequest {
        path: to.path.to_owned(),
        body: fields,
        adapter: adapter.map(|((a, _), _)| a.id.name().to_string()),
        model: adapter.map_or(to.model, |(_, written)| written).to_owned(),
    })
}

/// The answer to a client about its queued request `id` in `state`;
/// `model` is the name its answer carries.
fn answered(id: &str, state: RequestState, model: &str) -> Response {
    let waiting = |status: &str| {
        let body = json!({"request_id": id, "status": status, "model": model});
        (StatusCode::ACCEPTED, axum::Json(body)).into_response()
    };
    match state {
        RequestState::Queued => waiting("queued"),
        RequestState::Running => waiting("running"),
        RequestState::Ended { answer: Answer { status, body: Some(body) }, model, .. } => {
            engine_answer(status, &body, &model)
        }
        RequestState::Ended { answer: Answer { status, body: None }, error: why, .. } => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
            let message = why.unwrap_or_else(|| "the request failed".to_owned());
            error(status, kind_of(status), &message, None)
        }
        RequestState::Removed => {
            let message = format!(
                "the answer of request `{id}` was removed, as every answer is `predictions.retention_s` \
                 after the request ended"
            );
            error(StatusCode::GONE, "invalid_request_error", &message, Some("inputs.request_id"))
        }
    }
}

/// The engine's answer as a synchronous request would have had it: its
/// status, and its JSON with every `model` field naming `model`; an
/// answer that was not JSON is reported as an error of that status.
fn engine_answer(status: u16, body: &Value, model: &str) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    match body {
        Value::String(text) if !status.is_success() => {
            let message = format!("the engine answered {status}: {text}");
            error(status, kind_of(status), &message, None)
        }
        body => {
            let json = serde_json::to_vec(body).expect("JSON serializes");
            let json = crate::rename::whole(&json, model).unwrap_or(json);
            let content_type = [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))];
            (status, content_type, json).into_response()
        }
    }
}

/// OpenAI's error `type` for an answer of `status`.
fn kind_of(status: StatusCode) -> &'static str {
    match status.as_u16() {
        504 => "timeout",
        429 => "rate_limit_error",
        500 => "server_error",
        s if s >= 500 => "service_unavailable",
        _ => "invalid_request_error",
    }
}

/// Seconds a client is told to wait (`Retry-After`) before repeating a
/// call the store could not serve: the predictions API's figure.
const STORE_RETRY_AFTER_S: u32 = 2;

/// The answer to a store failure, and its code: an unreachable store is
/// 503 with `Retry-After`, naming the store and nothing more (nothing was
/// queued: the request may be sent again); anything else is 500, its
/// cause logged, never told.
fn store_failed(e: &StoreError) -> (ErrorCode, Response) {
    match e {
        StoreError::Unavailable { store, .. } => {
            let message = format!("the request queue ({store}) is unreachable; retry");
            let mut r = error(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", &message, None);
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(STORE_RETRY_AFTER_S));
            (ErrorCode::Unavailable, r)
        }
        e => {
            tracing::error!("request queue: {e}");
            let message = "the request queue failed; see the server log";
            (ErrorCode::Internal, error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message, None))
        }
    }
}

/// `response`, a refusal of the gateway's own, counted with `code`.
fn counted(tally: Tally, code: ErrorCode, response: Response) -> Response {
    tally.ended(response.status().as_u16(), Some(code));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_conditions_must_hold_and_a_malformed_field_is_named() {
        let yes = json!({"queueRequest": true});
        assert_eq!(Asked::read(false, Some(&yes), None), None, "a model without use_async_queue");
        assert_eq!(Asked::read(true, Some(&yes), None), Some(Asked::Queue));
        for no in [json!({}), json!({"queueRequest": false}), json!({"queueRequest": null}), json!(3)] {
            assert_eq!(Asked::read(true, Some(&no), None), None, "{no}");
        }
        assert_eq!(Asked::read(true, None, None), None);
        let Some(Asked::Refused(message, field)) =
            Asked::read(true, Some(&json!({"queueRequest": "yes"})), None)
        else {
            panic!("refused")
        };
        assert_eq!(field, "options.queueRequest");
        assert!(message.contains("boolean") && message.contains("\"yes\""), "{message}");
        let follow = json!({"request_id": "abc"});
        assert_eq!(Asked::read(true, Some(&yes), Some(&follow)), Some(Asked::FollowUp("abc".into())));
        assert_eq!(Asked::read(false, None, Some(&follow)), None, "passed on as before");
        for bad in [json!({"request_id": 7}), json!({"request_id": ""}), json!({"request_id": null})] {
            let Some(Asked::Refused(_, field)) = Asked::read(true, None, Some(&bad)) else { panic!("{bad}") };
            assert_eq!(field, "inputs.request_id");
        }
        // `inputs` without a request id is the engine's to judge.
        assert_eq!(Asked::read(true, None, Some(&json!({"text": "x"}))), None);
    }

    #[test]
    fn an_answer_names_the_model_the_client_used_and_keeps_the_engines_status() {
        let body = json!({"model": "/proc/self/fd/30", "choices": [{"text": "hi"}]});
        let r = engine_answer(200, &body, "t/a");
        assert_eq!(r.status(), StatusCode::OK);
        let r = engine_answer(400, &json!({"error": {"message": "no"}}), "t/a");
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        let r = engine_answer(500, &json!("boom"), "t/a");
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
