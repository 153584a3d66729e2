//! Errors in the shape OpenAI clients expect:
//! `{"error": {"message", "type", "param", "code"}}` with a matching status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// An API error: status, OpenAI error type, message, and the parameter at
/// fault when there is one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI's error `type`.
    pub kind: &'static str,
    /// What went wrong, for people.
    pub message: String,
    /// The request field at fault.
    pub param: Option<String>,
    /// A machine-readable code.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: the request is malformed or a field is wrong.
    pub fn bad_request(message: impl Into<String>, param: Option<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param,
            code: None,
        }
    }

    /// 404: no such model here.
    pub fn unknown_model(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!("The model `{model}` does not exist."),
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 500: the engine failed the request.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "internal_server_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// 503: the engine cannot take requests right now (loading, asleep).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "service_unavailable",
            message: message.into(),
            param: None,
            code: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }});
        (self.status, Json(body)).into_response()
    }
}
