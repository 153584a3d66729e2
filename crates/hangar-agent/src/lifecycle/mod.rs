//! The replica lifecycle: what placement wants of each replica on a node
//! (its desired tier) against what its engine is (its observed state),
//! converged one step at a time.
//!
//! - [`machine`]: [`Lifecycle`], the sans-IO machine that picks each
//!   replica's one next step and says when it serves.
//! - [`driver`]: the task that owns the machine and carries its steps out
//!   on [`Engines`], telling a [`Sink`] (permits, facts for the
//!   controller) what changed.
//! - `engines`: [`NodeEngines`], the real engines: weights from the
//!   node's store, engine processes, their sleep API and health.
//!
//! `hangar serve` drives it for the nodes of its file, `hangar agent` for
//! its machine, from the desired state the fleet's leader writes.

pub mod driver;
mod engines;
pub mod machine;

pub use driver::{
    phase, spawn, wanted, DriverHandle, Engines, Health, NodeReplica, Sink, SleepAnswer, StartError,
    StartReport, Started, Stopped,
};
pub use engines::{ModelEngine, NodeEngines};
pub use machine::{
    Engine, Fact, Lifecycle, LifecycleError, Outcome, Output, ReplicaView, Slot, Step, Tier, Wanted,
};
