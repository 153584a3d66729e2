//! How a request ended, in the words every surface uses for it: its
//! [`RequestKind`] — a synchronous OpenAI request, an async prediction or
//! a training — and, when it did not succeed, its [`ErrorCode`].
//!
//! `/metrics` labels its request figures with these
//! (`hangar_requests_total{kind, status}`, `hangar_errors_total{kind, code}`),
//! so one dashboard reads the OpenAI gateway and the predictions API alike;
//! each code also says the HTTP status it is counted under, which for a
//! prediction (that has no HTTP answer of its own) is the one a synchronous
//! request ending the same way gets.

use serde::{Deserialize, Serialize};

/// What kind of request: how it came in and how it waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestKind {
    /// An OpenAI-compatible request (`/v1/chat/completions`, …), answered
    /// on its own connection; it fails fast when its model cannot run.
    Sync,
    /// An async prediction (`POST /v1/predictions`), kept in the durable
    /// queue until it runs.
    Prediction,
    /// An async training (`POST …/trainings`).
    Training,
}

impl RequestKind {
    /// Every kind, in the order above.
    pub const ALL: [RequestKind; 3] = [RequestKind::Sync, RequestKind::Prediction, RequestKind::Training];

    /// The label value (`sync`, `prediction`, `training`).
    pub fn as_str(self) -> &'static str {
        match self {
            RequestKind::Sync => "sync",
            RequestKind::Prediction => "prediction",
            RequestKind::Training => "training",
        }
    }

    /// Its position in [`RequestKind::ALL`] (for tables indexed by kind).
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Why a request or a prediction did not succeed.
///
/// The set is closed on purpose: a metric label takes few values, and
/// each of these calls for a different remedy (more replicas, a longer
/// timeout, a look at the engine, nothing at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Refused before admission: a body or field the gateway does not
    /// accept for this model (400).
    BadRequest,
    /// The model's line was full (429).
    QueueFull,
    /// The model cannot run now: no replica could be placed or started
    /// (503).
    Unavailable,
    /// A deadline passed: the request's timeout while it waited or while
    /// its answer streamed, a prediction's `Cancel-After`, lifetime or
    /// predict timeout (504).
    Timeout,
    /// The replica serving it failed before or while answering (after the
    /// one retry a request gets), or a prediction's run was lost twice
    /// (502).
    ReplicaFailed,
    /// The engine answered with an error, which the client got as is (its
    /// own status is counted), or a prediction the model failed (500).
    EngineError,
    /// The client went away before its answer ended (499, as nginx counts
    /// it).
    ClientClosed,
    /// A prediction canceled by its user (499).
    Canceled,
    /// A fault inside Hangar — a bug (500).
    Internal,
}

impl ErrorCode {
    /// Every code, in the order above.
    pub const ALL: [ErrorCode; 9] = [
        ErrorCode::BadRequest,
        ErrorCode::QueueFull,
        ErrorCode::Unavailable,
        ErrorCode::Timeout,
        ErrorCode::ReplicaFailed,
        ErrorCode::EngineError,
        ErrorCode::ClientClosed,
        ErrorCode::Canceled,
        ErrorCode::Internal,
    ];

    /// The label value (`queue_full`, `timeout`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::QueueFull => "queue_full",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Timeout => "timeout",
            ErrorCode::ReplicaFailed => "replica_failed",
            ErrorCode::EngineError => "engine_error",
            ErrorCode::ClientClosed => "client_closed",
            ErrorCode::Canceled => "canceled",
            ErrorCode::Internal => "internal",
        }
    }

    /// The HTTP status a request ending this way is counted under (an
    /// engine's error passed on keeps the engine's own status instead).
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 400,
            ErrorCode::QueueFull => 429,
            ErrorCode::Unavailable => 503,
            ErrorCode::Timeout => 504,
            ErrorCode::ReplicaFailed => 502,
            ErrorCode::EngineError | ErrorCode::Internal => 500,
            ErrorCode::ClientClosed | ErrorCode::Canceled => 499,
        }
    }

    /// Its position in [`ErrorCode::ALL`] (for tables indexed by code).
    pub fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_and_names_follow_the_lists() {
        for (i, code) in ErrorCode::ALL.into_iter().enumerate() {
            assert_eq!(code.index(), i);
            assert_eq!(serde_json::to_value(code).unwrap(), code.as_str());
        }
        for (i, kind) in RequestKind::ALL.into_iter().enumerate() {
            assert_eq!(kind.index(), i);
            assert_eq!(serde_json::to_value(kind).unwrap(), kind.as_str());
        }
        let names: std::collections::BTreeSet<_> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(names.len(), ErrorCode::ALL.len(), "one name per code");
    }

    #[test]
    fn every_code_is_counted_under_an_error_status() {
        for code in ErrorCode::ALL {
            assert!((400..600).contains(&code.http_status()), "{code:?}");
        }
    }
}
