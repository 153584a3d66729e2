//! Autoscaling for Hangar: how many replicas each model should have.
//!
//! One [`Scaler`] per model runs the policy its `[models.scaling]` table
//! names ([`ScalingConfig`]):
//!
//! - `replicate`: Replicate's backlog-per-instance HPA — desired = current ×
//!   backlog per replica / target, with scale-out rate limits (+5 or
//!   +100 % a minute), stabilization windows (30 s out, 2 min in),
//!   hysteresis (0.02), slow start (at most 5 until one is ready),
//!   scale to zero after an idle delay and an emergency cap;
//! - `workers-ai`: Workers AI's EZ utilization loop — utilization from
//!   inference time over a 15-minute window every 5 minutes, a 0.3–0.8
//!   deadband, out-of-capacity inflation capped at 2×, upscale from healthy
//!   and downscale from requested replicas, at most 10 down a cycle, a
//!   `disabled` kill switch;
//! - `hangar` (the default): the replicas the demand needs, counting those
//!   still loading as capacity on the way; up at once, down only after a
//!   quiet period keeping its peak, so under steady load no decision
//!   reverses another; one more while requests wait and TTFT misses its
//!   objective; idle replicas kept WARM for a multiple of their measured
//!   COLD start;
//! - `fixed`: exactly `min_replicas`.
//!
//! Every number is a knob with its source's default (docs/scaling.md).
//!
//! Like every policy crate here, a scaler is a sans-IO state machine (the
//! shape of `hangar-queue`): it never reads a clock. The driver
//! [`observe`](Scaler::observe)s the model (queue, replicas, cumulative
//! counters), calls [`handle_timeout`](Scaler::handle_timeout) once `now`
//! reaches [`poll_timeout`](Scaler::poll_timeout), and reads
//! [`desired`](Scaler::desired). The live server and the simulator drive
//! the same code.
//!
//! ```
//! use hangar_scaler::{Bounds, Observation, ReplicaCounts, Scaler, ScalingConfig};
//!
//! let mut s = Scaler::new(&ScalingConfig::default(), Bounds { min: 0, max: 4 }, 0);
//! // A request waits and nothing is up: the decision comes at once.
//! let waiting = Observation { waiting: 1, permits_per_replica: 8, ..Observation::default() };
//! s.observe(10, waiting);
//! assert_eq!(s.poll_timeout(), 10);
//! assert_eq!(s.handle_timeout(10).map(|d| d.desired), Some(1));
//! // 20 requests at 8 per replica: 3 replicas.
//! let busy = Observation {
//!     in_flight: 8, waiting: 12, permits_per_replica: 8,
//!     replicas: ReplicaCounts { ready: 1, ..ReplicaCounts::default() }, ..Observation::default()
//! };
//! s.observe(1_010, busy);
//! s.handle_timeout(1_010);
//! assert_eq!(s.desired(), 3);
//! ```
#![deny(missing_docs)]

mod config;
mod control_loop;
mod controller;
mod decision;
mod demand;
mod hangar;
mod observation;
mod policy;
mod scaler;
mod ttft;

pub use config::{HangarSettings, ReplicateSettings, ScalingConfig, WorkersAiAlgorithm, WorkersAiSettings};
pub use control_loop::{ControlLoop, Input};
pub use controller::{
    Action, BlockCause, Blocked, CommandError, Controller, ModelSpec, STARVATION_PATIENCE_MS,
};
pub use decision::{Decision, DecisionLog, Reason, DECISIONS_KEPT};
pub use observation::{Observation, ReplicaCounts};
pub use scaler::{Bounds, Override, Scaler, StartTier, StartTimes};
pub use ttft::TtftWindow;
