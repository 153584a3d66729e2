//! Where a request is, in the steps its user is shown: NDIF's user-facing
//! steps — received, queued (with its position), dispatched (to a
//! replica), running, completed or error — for a synchronous request in
//! its inference event and for a prediction in its logs (so in its SSE
//! stream and webhooks too).
//!
//! One name per step, wherever it is shown: [`Progress`] serializes as
//! `{"step": "queued", "position": 3}` and prints as the log line
//! `queued at position 3`.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ErrorCode;

/// One step of a request, in the order they happen. Every request is
/// received and ends (completed or error); it is queued only when no permit
/// was free on arrival, and dispatched and running only when it got one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub enum Progress {
    /// The gateway has it.
    Received,
    /// It waits in its model's line; `position` 1 is served next. A waiting
    /// prediction is shown its position again whenever it moves.
    Queued {
        /// Its place in the order the line serves (1: next).
        position: u32,
    },
    /// It holds a permit on `replica` (`<model>:<id>`) and was sent there.
    Dispatched {
        /// The replica it was sent to.
        replica: String,
    },
    /// The replica's first output arrived.
    Running,
    /// It ended well.
    Completed,
    /// It ended without an answer, or with an error.
    Error {
        /// Why, in the words `/metrics` counts it under, when known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<ErrorCode>,
    },
}

impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Progress::Received => f.write_str("received"),
            Progress::Queued { position } => write!(f, "queued at position {position}"),
            Progress::Dispatched { replica } => write!(f, "dispatched to replica {replica}"),
            Progress::Running => f.write_str("running"),
            Progress::Completed => f.write_str("completed"),
            Progress::Error { code: Some(code) } => write!(f, "error ({})", code.as_str()),
            Progress::Error { code: None } => f.write_str("error"),
        }
    }
}

/// A step and when it happened (ms since the Unix epoch): an inference
/// event's `steps`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepAt {
    /// When.
    pub at_ms: u64,
    /// Which step.
    #[serde(flatten)]
    pub step: Progress,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_reads_the_same_in_json_and_in_a_log_line() {
        let queued = StepAt { at_ms: 7, step: Progress::Queued { position: 3 } };
        let json = serde_json::to_value(&queued).unwrap();
        assert_eq!(json, serde_json::json!({"at_ms": 7, "step": "queued", "position": 3}));
        assert_eq!(serde_json::from_value::<StepAt>(json).unwrap(), queued);
        assert_eq!(queued.step.to_string(), "queued at position 3");
        let failed = Progress::Error { code: Some(ErrorCode::Timeout) };
        assert_eq!(
            serde_json::to_value(&failed).unwrap(),
            serde_json::json!({"step": "error", "code": "timeout"})
        );
        assert_eq!(failed.to_string(), "error (timeout)");
        assert_eq!(serde_json::to_value(Progress::Running).unwrap(), serde_json::json!({"step": "running"}));
    }
}
