//! Durable, Replicate-compatible async predictions for `hangar serve`.
//!
//! A prediction is persisted ([`store`]) before the client hears `201`,
//! waits in its model's ordered queue, is claimed under a lease by a
//! worker, runs through an [`Executor`] the server provides (which goes
//! through the same admission as synchronous requests), and reaches the
//! client by polling, `Prefer: wait`, server-sent events or signed
//! webhooks. The rules — statuses, deadlines, webhook throttling and
//! retry, when claims may be swept after the store was unreachable — are
//! sans-IO policies that take `now` ([`lifecycle`], [`webhook_policy`],
//! [`webhook_target`], [`reachability`]); [`Service`] drives them with
//! real time and serves the HTTP API ([`Service::router`]).
//!
//! The same queue holds the synchronous API's requests that Workers AI's
//! async mode queues ([`request`]: `options.queueRequest`, answered by
//! polling with `inputs.request_id`).
//!
//! [`procedures`] run user-provided Python pipelines as predictions on the
//! shared procedures runtime, their sources fetched through the webhook
//! destination guard and cached.
#![deny(missing_docs)]

mod api;
mod config;
pub mod deployments;
mod executor;
mod idempotency;
pub mod lifecycle;
pub mod llm;
pub mod procedures;
pub mod reachability;
pub mod record;
pub mod request;
mod service;
pub mod signing;
pub mod store;
pub mod webhook_policy;
pub mod webhook_target;

pub use config::{Deployment, ModelSettings, PredictionsConfig};
pub use deployments::InstanceBounds;
pub use executor::{
    AdapterCheck, AdapterRefused, BoundsFuture, ExecError, ExecEvent, ExecFuture, Executor, Job,
    ProcedureRun, Sink,
};
pub use service::{Capacity, InputRules, Model, Service, ServiceError};

/// The version id of a model described by `description` (e.g. its
/// configuration as JSON): 64 hex digits of its SHA-256, stable while the
/// description is.
pub fn version_id(description: &str) -> String {
    sha256_hex(description.as_bytes())
}

/// 64 hex digits of the SHA-256 of `bytes`.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}
