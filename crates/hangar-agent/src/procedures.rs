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
//! `procedure_source_url` (where the gateway running it serves the source
//! archive it fetched and checked, for the run's length:
//! [`crate::cog::CogJob::source`]), `procedure_source_sha256`,
//! `replicate_api_token` and `replicate_api_base_url`. The runtime may run
//! on another node than the gateway: it downloads the archive, checks its
//! hash and extracts it (tarfile's `data` filter) into a private cache
//! keyed by that hash, so a replica fetches each source once.
//! The source's contract: `predict.py` defining `predict(**input)` at its
//! root (or a `cog.yaml` whose `predict:` names `FILE.py:FUNCTION`); the
//! return value is the output (an iterator's items stream one by one), what
//! it prints the logs, an exception the error. Each run is a fresh process
//! in the source's directory with `REPLICATE_API_TOKEN`,
//! `REPLICATE_BASE_URL`, `OPENAI_API_KEY` and `OPENAI_BASE_URL` set, so the
//! official clients call the same Hangar as the caller.

/// The runtime's Python source.
pub const RUNTIME: &str = include_str!("procedures_runtime.py");
