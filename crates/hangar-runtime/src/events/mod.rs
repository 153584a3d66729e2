//! Inference events (seed 001: Workers AI's per-request events, with
//! Replicate's billing metrics): one [`InferenceEvent`] per synchronous
//! request and per prediction run, priced by the model's
//! [`BillingConfig`], handed to an [`EventSink`] that never blocks the
//! request path and writes to a rotating JSONL file or a Redis stream.
//!
//! The gateway builds the event from what its handler already holds and
//! sends it with one `try_send`; serializing and writing are the writer
//! thread's (docs/observability.md, "Inference events").

mod billing;
mod event;
mod record;
mod run;
mod sink;

pub use billing::{BillingConfig, Cost, Neurons};
pub use event::{estimate_tokens, EventKind, InferenceEvent, Outcome};
pub use record::{find_usage, RequestRecord, Usage};
pub use run::{images, input_tokens, output_tokens, run_event, RunEnd, RunFacts};
pub use sink::{EventSink, EventsConfig, SinkStats, Target, WriterHandle};
