//! Inference events (seed 001: Workers AI's per-request events, with
//! Replicate's billing metrics): one [`InferenceEvent`] per synchronous
//! request and per prediction, priced by the model's [`BillingConfig`],
//! handed to an [`EventSink`] that never blocks and written by a thread of
//! its own to a rotating JSONL file or a Redis stream; and the usage they
//! add up to ([`UsageReport`], read back by a [`UsageSource`]).
//!
//! A synchronous request's event costs the request path next to nothing:
//! its [`RequestTrace`] keeps instants and small things (never a handle
//! that would pin hyper's buffers past the request), rides on the
//! request's `Tally` and goes to the writer, compact, in one `try_send`
//! when the request is counted; the writer thread does the rest (docs/observability.md,
//! "Inference events"). A prediction's event is made when it ends, from its
//! stored record ([`prediction_event`]).

mod billing;
mod event;
mod prediction;
mod sink;
mod trace;
mod usage;

pub use billing::{BillingConfig, Cost, Neurons};
pub use event::{estimate_tokens, InferenceEvent};
pub(crate) use prediction::request_kind;
pub use prediction::{images, input_tokens, output_tokens, prediction_event, RunFacts, Runs};
pub use sink::{EventSink, EventsConfig, SinkStats, Target, WriterHandle, TICK};
pub use trace::estimate_answer;
pub use trace::{find_usage, RequestTrace, Usage, COPY_UP_TO, MESSAGE_BYTES, STREAM_TAIL_BYTES};
pub use usage::{
    parse_time, read_files, read_stream, rfc3339, Group, GroupBy, QueryError, Totals, UsageError, UsageQuery,
    UsageReport, UsageRow, UsageSource,
};
