//! The OpenAI-compatible gateway in front of the processors.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use hangar_core::AccountId;
use serde_json::{json, Value};

use super::Inner;
use crate::processor::AdmitError;

pub(crate) fn router(inner: Arc<Inner>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(forward))
        .route("/v1/completions", post(forward))
        .route("/v1/embeddings", post(forward))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .fallback(|| async {
            error(StatusCode::NOT_FOUND, "invalid_request_error", "no such endpoint", None)
        })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(inner)
}

/// An OpenAI-shaped error response.
fn error(status: StatusCode, kind: &str, message: &str, param: Option<&str>) -> Response {
    (status, Json(json!({"error": {"message": message, "type": kind, "param": param, "code": null}})))
        .into_response()
}

/// The account a request acts for: `anonymous` on an open gateway,
/// otherwise the owner of its bearer key; the error is the 401 message.
fn account(inner: &Inner, headers: &HeaderMap) -> Result<AccountId, &'static str> {
    if inner.api_keys.is_empty() {
        return Ok("anonymous".parse().expect("a valid account id"));
    }
    let value =
        headers.get(header::AUTHORIZATION).ok_or("missing API key: send `Authorization: Bearer KEY`")?;
    let key = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or("malformed Authorization header: expected `Bearer KEY`")?;
    inner.api_keys.get(key.trim()).cloned().ok_or("invalid API key")
}

fn unauthorized(message: &str) -> Response {
    error(StatusCode::UNAUTHORIZED, "authentication_error", message, None)
}

async fn models(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    let account = match account(&inner, &headers) {
        Ok(a) => a,
        Err(message) => return unauthorized(message),
    };
    let data: Vec<Value> = inner
        .models
        .iter()
        .filter(|(_, rt)| rt.allows(&account))
        .map(|(k, _)| json!({"id": k, "object": "model", "created": 0, "owned_by": "hangar"}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// Admits the request onto a replica of its model and streams the
/// replica's answer back; the permit is released when the answer ends or
/// the client goes away.
async fn forward(
    State(inner): State<Arc<Inner>>,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let account = match account(&inner, &headers) {
        Ok(a) => a,
        Err(message) => return unauthorized(message),
    };
    let body = match body {
        Ok(b) => b,
        Err(r) => return error(r.status(), "invalid_request_error", &r.body_text(), None),
    };
    let parsed: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                &format!("the body is not valid JSON: {e}"),
                None,
            )
        }
    };
    let Some(model) = parsed.get("model").and_then(Value::as_str) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "field `model` is missing or not a string",
            Some("model"),
        );
    };
    let Some(rt) = inner.models.get(model).cloned() else {
        return error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            &format!("The model `{model}` does not exist."),
            Some("model"),
        );
    };
    if !rt.allows(&account) {
        let message = format!("account `{account}` may not use the model `{model}`");
        return error(StatusCode::FORBIDDEN, "permission_error", &message, Some("model"));
    }
    inner.wake_model(&rt);
    let lease = match rt.processor.admit(account, Some(rt.config.timeout())).await {
        Ok(lease) => lease,
        Err(e @ AdmitError::QueueFull { .. }) => {
            return error(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", &e.to_string(), None)
        }
        Err(e @ AdmitError::Timeout) => {
            return error(StatusCode::GATEWAY_TIMEOUT, "timeout", &e.to_string(), None)
        }
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", &e.to_string(), None),
    };
    let Some(base) = inner.replica_url(&rt, lease.replica) else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", "the replica went away", None);
    };
    let upstream = inner
        .client
        .post(format!("{base}{}", uri.path()))
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await;
    let upstream = match upstream {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(replica = %lease.replica, "forwarding failed: {e}");
            return error(StatusCode::BAD_GATEWAY, "service_unavailable", "the replica did not answer", None);
        }
    };
    let status = StatusCode::from_u16(upstream.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = upstream.headers().get(header::CONTENT_TYPE).cloned();
    // The lease rides along with the body stream and is dropped with it.
    let stream = upstream.bytes_stream().map(move |chunk| {
        let _hold = &lease;
        chunk.map_err(std::io::Error::other)
    });
    let mut response = Response::new(Body::from_stream(stream));
    *response.status_mut() = status;
    if let Some(ct) = content_type {
        response.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    response
}
