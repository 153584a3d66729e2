//! The `hangar bench` figures: harnesses that start real processes and
//! print figures against targets.
//!
//! Each bench sets up what a user runs — mock or real engines, `hangar
//! serve`, `hangar agent`, a private `redis-server`, the weight store —
//! as child processes wherever the thing measured must run as its own
//! process (its own runtime, its own threads, as deployed), drives it with
//! load, and returns a report that is a table for people (`Display`) and
//! JSON for scripts (`Serialize`), each figure printed beside its target.
//! Nothing here is on the serving path: `hangar-runtime` is the live
//! control plane, and this crate measures it from the outside.
//!
//! One module per bench, named for what it measures (each `run` is the
//! bench, its `Options` the command's flags, its report what it prints):
//!
//! - [`gateway`] (`hangar bench gateway`): what the gateway adds in front of
//!   an engine — throughput and added latency, straight to a zero-compute
//!   mock engine against through `hangar serve`.
//! - [`predictions`] (`hangar bench predictions`): what the durable
//!   predictions path sustains — creates, queue drain, `Prefer: wait`,
//!   create latency at a fixed rate.
//! - [`queue`] (`hangar bench queue`): the predictions queue on its own,
//!   SQLite and Redis Streams side by side — throughput and fairness.
//! - [`cluster`] (`hangar bench cluster`): a fleet's control plane — the
//!   leader's view under many heartbeating agents, and a node's loss
//!   detected and its replica placed again.
//! - [`chaos`] (`hangar bench chaos`): a loopback fleet under load and a
//!   seeded random schedule of faults, with a checker of what must survive
//!   them — accepted requests, one terminal webhook each, no ghost engines,
//!   no GPU over-commit, Redis blips that restart nothing.
//! - [`coldstart`] (`hangar bench coldstart`): a replica's start, placement
//!   → first token, by where its weights come from.
//! - [`replay`]: a trace replayed in real time against `hangar serve`, the
//!   live half of `hangar sim live` (TTFTs and replicas wanted).
//!
//! `hangar bench store` is `hangar-store`'s (`hangar_store::bench`), since
//! it measures the store against the physical reference with no `hangar`
//! process. Shared by the benches: the load generator (`load`: keep-alive
//! clients in closed and open loops, and [`PathStats`], one run's figures)
//! and the child processes (`processes`: the instant mock engine, `hangar
//! serve` on a written configuration).
//!
//! Requests that fail are counted in the reports; a [`BenchError`] (a
//! [`coldstart::ColdstartError`] for the cold start) means a bench could
//! not run. Timings are never asserted in tests: they are what
//! the benches print.
#![deny(missing_docs)]

mod error;
pub use error::BenchError;

mod load;
pub use load::PathStats;

mod processes;

pub mod adapters;
pub mod chaos;
pub mod cluster;
pub mod coldstart;
pub mod gateway;
pub mod predictions;
pub mod queue;
pub mod replay;
