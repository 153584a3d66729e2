//! The *procedures runtime*: the shared Python server that runs procedures
//! (seed 001, "Procedures": Replicate's `pipelines-runtime`), kept in the
//! repository as `procedures_runtime.py` and embedded in the binary.
//!
//! An engine of kind `procedures` ([`EngineSpec::Procedures`](crate::engine::EngineSpec))
//! runs it as `python3 -c RUNTIME --host HOST` with `PORT` set. It speaks
//! the part of cog's protocol [`crate::cog`] drives — `GET /health-check`,
//! `PUT /procedures/{id}` with `Prefer: respond-async` and a webhook,
//! `POST /procedures/{id}/cancel`, `POST /shutdown` — so its replicas are
//! placed, health-checked, scaled and stopped as any cog model's.
//!
//! A run's `context` ([`crate::cog::CogJob::context`]) carries
//! `procedure_source_url` (`file://` of the source Hangar fetched, checked
//! and extracted), `replicate_api_token` and `replicate_api_base_url`.
//! The source's contract: `predict.py` defining `predict(**input)` at its
//! root (or a `cog.yaml` whose `predict:` names `FILE.py:FUNCTION`); the
//! return value is the output (an iterator's items stream one by one), what
//! it prints the logs, an exception the error. Each run is a fresh process
//! in the source's directory with `REPLICATE_API_TOKEN`,
//! `REPLICATE_BASE_URL`, `OPENAI_API_KEY` and `OPENAI_BASE_URL` set, so the
//! official clients call the same Hangar as the caller.

/// The runtime's Python source.
pub const RUNTIME: &str = include_str!("procedures_runtime.py");
