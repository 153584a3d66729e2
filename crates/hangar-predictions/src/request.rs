//! Workers AI's async mode on the synchronous OpenAI API (seed 001,
//! "Async Queue").
//!
//! A request whose body says `"options": {"queueRequest": true}`, to a
//! model with `use_async_queue`, is not forwarded at once: it is kept as a
//! job of kind [`JobKind::Request`] in its model's prediction queue — the
//! same store (SQLite, or Redis Streams in a fleet), claims and leases,
//! recovery, deadlines, per-account turns and `async_slots` as
//! predictions — and runs through the server's [`Executor`](crate::Executor)
//! as a patient request. The client gets its answer at once if it ends
//! within `queue_request_wait_ms`, else `202` and a `request_id` to poll
//! with (a follow-up whose `inputs.request_id` names it). No webhook, no
//! stream: polling only, as the seed says.
//!
//! The HTTP side — what the gateway reads of a body and answers — is
//! `hangar-gateway`'s; running the job is the server's executor. This
//! module holds what both agree on: the job's input ([`QueuedRequest`]),
//! its output ([`Answer`]), what a client may be told of it
//! ([`RequestState`]), and the [`Service`] calls that queue and find one.

use std::time::Duration;

use hangar_core::AccountId;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::lifecycle::{Deadlines, Status};
use crate::record::{JobKind, Record};
use crate::service::{now, Service};
use crate::store::StoreError;

/// A queued request as its job keeps it (the record's `input`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueuedRequest {
    /// The OpenAI path it came in on (`/v1/chat/completions`,
    /// `/v1/completions`, `/v1/embeddings`), which the engine is sent too.
    pub path: String,
    /// What the engine is sent: the caller's body without `stream`,
    /// `stream_options` and `options` (a queued request is answered whole),
    /// named as the engine serves it.
    pub body: Map<String, Value>,
    /// Its LoRA adapter's name, looked up again when it runs (it may have
    /// been removed meanwhile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
    /// The model as the caller named it (its key, or `BASE:ADAPTER`): the
    /// name its answer carries.
    pub model: String,
}

impl QueuedRequest {
    /// The request a job's `input` holds; why not, for a job whose input
    /// is not one.
    pub fn from_input(input: &Value) -> Result<QueuedRequest, String> {
        serde_json::from_value(input.clone()).map_err(|e| format!("the stored request cannot be read: {e}"))
    }

    /// The job input that holds it.
    pub fn to_input(&self) -> Value {
        serde_json::to_value(self).expect("a JSON object serializes")
    }
}

/// How a queued request ended, as its follow-up answers it (the record's
/// `output`): the engine's status and answer, or — when it ended without
/// one (a deadline, a run lost twice, a model that could not start) — the
/// status a synchronous request ending so gets, and the record's `error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    /// The HTTP status of the answer.
    pub status: u16,
    /// The engine's answer (JSON, or its text as a string), if it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<Value>,
}

impl Answer {
    /// As a record keeps it.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).expect("an answer serializes")
    }

    /// The answer a queued request's record keeps, if it keeps one.
    pub fn kept(r: &Record) -> Option<Answer> {
        let output = r.output.as_ref().filter(|_| r.kind == JobKind::Request)?;
        serde_json::from_value(output.clone()).ok()
    }
}

/// What the client of a queued request is told of it.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestState {
    /// Waiting in the durable queue or in its model's line.
    Queued,
    /// Holding a permit: its engine is working on it.
    Running,
    /// Ended: the answer, and why it failed if it did.
    Ended {
        /// The status and the engine's answer.
        answer: Answer,
        /// The record's `error`, for an answer without the engine's body.
        error: Option<String>,
        /// The model as the request named it, which the answer names.
        model: String,
    },
    /// Ended over `retention_s` ago: its answer was removed.
    Removed,
}

impl RequestState {
    /// The state of a queued request's record.
    pub fn of(r: &Record) -> RequestState {
        match r.status {
            Status::Starting => RequestState::Queued,
            Status::Processing => RequestState::Running,
            _ if r.data_removed => RequestState::Removed,
            status => {
                let answer = Answer::kept(r).unwrap_or(Answer {
                    // Ended by the store itself — failed by recovery after
                    // a crash, pruned after a day in the queue — or kept
                    // without an answer: what ended it says which.
                    status: match status {
                        Status::Aborted | Status::Canceled => 504,
                        Status::Succeeded => 500,
                        _ => 502,
                    },
                    body: None,
                });
                let model = QueuedRequest::from_input(&r.input).map_or_else(|_| r.model.clone(), |q| q.model);
                RequestState::Ended { answer, error: r.error.clone(), model }
            }
        }
    }
}

/// Why a request could not be queued.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QueueRequestError {
    /// The service has no such model (the caller resolves models first,
    /// so this is a mismatch between the server's models and the
    /// service's).
    #[error("the model `{0}` is not served by the predictions service")]
    UnknownModel(String),
    /// The store did not take it: nothing was queued (see
    /// [`StoreError::Unavailable`] for the one exception).
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl Service {
    /// Queues `request` of `account` on `model` — a model the caller has
    /// checked `account` may use — returning its id once it is durable.
    /// It runs with the model's predictions limits (its lifetime, its
    /// predict timeout), as a prediction of the model would.
    ///
    /// # Cancel safety
    /// Dropping the future may still leave the request queued, and run.
    pub async fn queue_request(
        &self,
        model: &str,
        account: &AccountId,
        request: &QueuedRequest,
    ) -> Result<String, QueueRequestError> {
        let inner = &self.inner;
        let m = inner.models.get(model).ok_or_else(|| QueueRequestError::UnknownModel(model.to_owned()))?;
        let created_at = now();
        let deadlines = Deadlines::new(&m.settings.limits(false), created_at, None);
        let id = crate::api::new_id();
        let input = request.to_input();
        let mut record =
            Record::starting(id.clone(), &m.key, &m.version, account.as_str(), input, created_at, deadlines);
        record.kind = JobKind::Request;
        inner.create(&mut record).await?;
        Ok(id)
    }

    /// The state of the request `id` this process just queued, once it
    /// has ended or `queue_request_wait_ms` has passed, whichever comes
    /// first. A store that fails meanwhile shows it queued: it is stored,
    /// so the client is given its id rather than an error that would make
    /// it send the request again.
    ///
    /// # Cancel safety
    /// Dropping the future only ends the wait.
    pub async fn wait_for_request(&self, id: &str) -> RequestState {
        let wait = Duration::from_millis(self.inner.config.queue_request_wait_ms);
        match crate::api::wait_for_end(&self.inner, id, wait).await {
            Ok(Some(r)) => RequestState::of(&r),
            Ok(None) => RequestState::Queued,
            Err(e) => {
                tracing::warn!(request = %id, "the wait for a queued request ended early: {e}");
                RequestState::Queued
            }
        }
    }

    /// What `account` may know of its queued request `id` on `model`,
    /// sent to `path`: `None` when it has none such — another account's
    /// request, another model's or path's, a prediction's id and an id
    /// never given are alike unknown, so none is told apart.
    pub fn queued_request(
        &self,
        id: &str,
        account: &AccountId,
        model: &str,
        path: &str,
    ) -> Result<Option<RequestState>, StoreError> {
        let Some(r) = self.inner.current(id)? else { return Ok(None) };
        let same_path = || {
            // Its input is gone with its answer once removed.
            r.data_removed || r.input.get("path").and_then(Value::as_str) == Some(path)
        };
        if r.kind != JobKind::Request || r.account != account.as_str() || r.model != model || !same_path() {
            return Ok(None);
        }
        self.inner.forget_if_ended(&r);
        Ok(Some(RequestState::of(&r)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ended(status: Status, output: Option<Value>) -> Record {
        let deadlines = Deadlines { per_prediction: None, lifetime: None };
        let mut r = Record::starting("r".into(), "a/x", "v", "acme", json!({}), 0, deadlines);
        r.kind = JobKind::Request;
        r.status = status;
        r.output = output;
        r.error = (status != Status::Succeeded).then(|| "why".to_owned());
        r
    }

    #[test]
    fn a_request_round_trips_through_its_job_input() {
        let body = json!({"model": "a/x", "messages": [{"role": "user", "content": "hi"}]});
        let request = QueuedRequest {
            path: "/v1/chat/completions".into(),
            body: body.as_object().unwrap().clone(),
            adapter: None,
            model: "a/x".into(),
        };
        let input = request.to_input();
        assert!(input.get("adapter").is_none(), "no adapter, no field: {input}");
        assert_eq!(QueuedRequest::from_input(&input).unwrap(), request);
        let e = QueuedRequest::from_input(&json!({"prompt": "x"})).unwrap_err();
        assert!(e.contains("cannot be read"), "{e}");
    }

    #[test]
    fn each_status_tells_the_client_where_it_is_and_an_ended_one_its_answer() {
        assert_eq!(RequestState::of(&ended(Status::Starting, None)), RequestState::Queued);
        assert_eq!(RequestState::of(&ended(Status::Processing, None)), RequestState::Running);
        let answer = Answer { status: 200, body: Some(json!({"choices": []})) };
        assert_eq!(
            RequestState::of(&ended(Status::Succeeded, Some(answer.to_value()))),
            RequestState::Ended { answer, error: None, model: "a/x".into() }
        );
        let refused = Answer { status: 400, body: Some(json!({"error": {"message": "bad"}})) };
        let RequestState::Ended { answer, error, .. } =
            RequestState::of(&ended(Status::Failed, Some(refused.to_value())))
        else {
            panic!("ended")
        };
        assert_eq!((answer, error.as_deref()), (refused, Some("why")));
        // Ended by the store, without an answer: the status says how.
        for (status, code) in [(Status::Failed, 502), (Status::Aborted, 504), (Status::Canceled, 504)] {
            let RequestState::Ended { answer, .. } = RequestState::of(&ended(status, None)) else {
                panic!("ended")
            };
            assert_eq!(answer, Answer { status: code, body: None }, "{status}");
        }
        let mut removed = ended(Status::Succeeded, None);
        removed.data_removed = true;
        assert_eq!(RequestState::of(&removed), RequestState::Removed);
    }
}
