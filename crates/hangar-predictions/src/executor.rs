//! The execution boundary: what the server plugs in to run a prediction.
//!
//! This crate knows nothing of engines or replicas. `hangar serve` gives
//! the [`Service`](crate::Service) an [`Executor`] that admits the job
//! through the model's processor and calls the engine; the executor
//! reports progress through a [`Sink`] and watches a cancellation token.

use std::future::Future;
use std::pin::Pin;

use hangar_core::{AccountId, ErrorCode, Millis};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::deployments::InstanceBounds;
use crate::record::{JobKind, Record};

/// One job to run.
#[derive(Debug, Clone)]
pub struct Job {
    /// The prediction id.
    pub id: String,
    /// Prediction or training.
    pub kind: JobKind,
    /// The model key (`owner/name`).
    pub model: String,
    /// The account it runs for (admission fairness, access).
    pub account: AccountId,
    /// The validated input (a queued request's: its
    /// [`QueuedRequest`](crate::request::QueuedRequest)).
    pub input: Value,
    /// When it was created (ms since the Unix epoch): its arrival, which
    /// its waiting and first output are measured from.
    pub created_at: Millis,
    /// A procedure's run ([`JobKind::Procedure`]): where it runs and with
    /// what context; `None` for every other kind.
    pub procedure: Option<ProcedureRun>,
}

/// How a procedure's run is carried out: on a replica of the procedures
/// runtime, `PUT /procedures/{id}` with `context`, the checked archive
/// `source` served to that replica for the run's length.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcedureRun {
    /// The runtime model's key (`[predictions.procedures] runtime`).
    pub runtime: String,
    /// The source archive, checked, in this gateway's cache: the executor
    /// serves it to the replica (which may be on another node) at the
    /// `procedure_source_url` it adds to the context.
    pub source: std::path::PathBuf,
    /// The context sent with it: `procedure_source_sha256` (the archive's
    /// hash, which the runtime checks and caches it under),
    /// `replicate_api_token` (a key of the caller's account),
    /// `replicate_api_base_url` (the server's base URL).
    pub context: Value,
}

/// Progress reported by an executor.
#[derive(Debug, Clone, PartialEq)]
pub enum ExecEvent {
    /// The job got its capacity (a permit) and now runs: `processing`.
    Started,
    /// One more output item (a token for language models).
    Output(Value),
    /// A log line.
    Log(String),
}

/// Where an executor reports progress. Cheap to clone; sends never block
/// and are ignored once the prediction has ended.
#[derive(Debug, Clone)]
pub struct Sink(pub(crate) mpsc::UnboundedSender<ExecEvent>);

impl Sink {
    /// A sink and the receiver of its events (for drivers and tests).
    pub fn channel() -> (Sink, mpsc::UnboundedReceiver<ExecEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Sink(tx), rx)
    }

    /// The job started running (call once, when capacity is granted).
    pub fn started(&self) {
        let _ = self.0.send(ExecEvent::Started);
    }

    /// One output item.
    pub fn output(&self, item: Value) {
        let _ = self.0.send(ExecEvent::Output(item));
    }

    /// A log line.
    pub fn log(&self, line: impl Into<String>) {
        let _ = self.0.send(ExecEvent::Log(line.into()));
    }
}

/// Why a job did not produce output.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// The model failed on this input (the prediction fails with it).
    #[error("{0}")]
    Failed(String),
    /// The job stopped because its cancellation token fired.
    #[error("canceled")]
    Canceled,
    /// What ran it went away mid-run (its engine died, or the machine
    /// running it left the fleet): not the model's fault, so the
    /// prediction is put back in its queue and runs once more, from the
    /// start; lost a second time, it fails with this message.
    #[error("{0}")]
    Lost(String),
    /// The engine answered a queued request ([`JobKind::Request`]) with an
    /// error status: the job fails, and its follow-up gives the client the
    /// engine's `status` and `body` as a synchronous request would have had
    /// them (kept as its [`Answer`](crate::request::Answer)).
    #[error("the engine answered {status}: {body}")]
    Answered {
        /// The engine's HTTP status (4xx or 5xx).
        status: u16,
        /// Its answer: the JSON it sent, or its text as a JSON string.
        body: Value,
    },
}

/// The boxed future an executor returns.
pub type ExecFuture = Pin<Box<dyn Future<Output = Result<Value, ExecError>> + Send>>;

/// Why a prediction's LoRA adapter is refused when it is created: the HTTP
/// status and a message naming adapter and model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct AdapterRefused {
    /// 400, or 404 for an adapter that does not exist for the account.
    pub status: u16,
    /// What is wrong.
    pub message: String,
}

/// The boxed future of [`Executor::check_adapter`].
pub type AdapterCheck = Pin<Box<dyn Future<Output = Result<(), AdapterRefused>> + Send>>;

/// The boxed future of [`Executor::apply_bounds`]: why the bounds were
/// not applied here, if they were not.
pub type BoundsFuture = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// Runs jobs. Implementations must report [`ExecEvent::Started`] before
/// any output, and should stop promptly (returning
/// [`ExecError::Canceled`]) once `cancel` fires; the caller stops polling
/// the future at that point anyway, so dropping it must release every
/// resource it holds (permits, connections).
///
/// A queued request ([`JobKind::Request`]) sends its stored body to the
/// engine path it names and returns the engine's answer as an
/// [`Answer`](crate::request::Answer) ([`Answer::to_value`](crate::request::Answer::to_value));
/// an engine's error status is [`ExecError::Answered`].
pub trait Executor: Send + Sync + 'static {
    /// Runs `job`, reporting through `sink`; the final output on success.
    fn execute(&self, job: Job, sink: Sink, cancel: CancellationToken) -> ExecFuture;

    /// `record` has just ended, through this process — it ran here, its
    /// user canceled it here, or its deadline passed while it waited —
    /// with `code` saying why unless it succeeded: what `hangar serve`
    /// counts in `/metrics`. Called once per prediction across every
    /// gateway sharing a store (the one whose store write ended it), after
    /// the end is stored; it must not block. Predictions a restarted
    /// server fails in its recovery, and those pruned after a day in the
    /// queue, are not told.
    fn ended(&self, record: &Record, code: Option<ErrorCode>) {
        let _ = (record, code);
    }

    /// Whether `account` may run `model` with the LoRA adapter `adapter`
    /// (its input's `lora`, or the adapter a `BASE:ADAPTER` version
    /// names): asked when the prediction is created, so a refused adapter
    /// never queues. By default no model serves adapters.
    fn check_adapter(&self, model: &str, adapter: &str, account: &AccountId) -> AdapterCheck {
        let message =
            format!("the model `{model}` serves no LoRA adapters, so it cannot run adapter `{adapter}`");
        let _ = account;
        Box::pin(async move { Err(AdapterRefused { status: 400, message }) })
    }

    /// Why `model` cannot run between `bounds` (a deployment's
    /// `min_instances` / `max_instances`) by its own rules, if it cannot:
    /// asked when a deployment is created or updated, after the bounds
    /// passed [`InstanceBounds::check`], so refused bounds are never
    /// stored. By default a model has no rules of its own.
    fn check_bounds(&self, model: &str, bounds: InstanceBounds) -> Result<(), String> {
        let _ = (model, bounds);
        Ok(())
    }

    /// Runs `model` between `bounds` from now on (`None`: its own, from
    /// the config). The service calls it with what the stored deployments
    /// say when one changes and again every few seconds (level-triggered:
    /// a restarted or newly leading controller catches up), so it must be
    /// cheap when nothing changes. An error — no controller runs here, on
    /// a fleet's gateway that does not lead — is only logged. By default
    /// nothing scales, so there is nothing to apply.
    fn apply_bounds(&self, model: &str, bounds: Option<InstanceBounds>) -> BoundsFuture {
        let _ = (model, bounds);
        Box::pin(async { Ok(()) })
    }
}
