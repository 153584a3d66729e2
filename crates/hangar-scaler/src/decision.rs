//! A scaler's decisions and their log (seed 001's scale snapshots).

use std::collections::VecDeque;
use std::fmt;

use hangar_core::Millis;
use serde::Serialize;

use crate::observation::Observation;

/// How many decisions a scaler keeps (seed 001: the autoscaler retains
/// 120 snapshots per deployable).
pub const DECISIONS_KEPT: usize = 120;

/// One decision: when, what, from what, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    /// When it was taken.
    pub at: Millis,
    /// Replicas wanted before it.
    pub previous: u32,
    /// Replicas wanted now.
    pub desired: u32,
    /// Why.
    pub reason: Reason,
    /// What the scaler saw.
    pub inputs: Observation,
}

/// Why a scaler wants the replicas it wants.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Reason {
    /// `fixed`: `min_replicas`.
    Fixed,
    /// Requests wait and no replica is up: one starts at once, whatever the
    /// policy's next tick.
    FromZero,
    /// An operator froze the model at this count.
    Frozen,
    /// An operator pinned this count.
    Pinned,
    /// Replicate: backlog per replica against its target.
    Backlog {
        /// (waiting + running + headroom) per replica up.
        per_replica: f64,
        /// The target.
        target: f64,
        /// The recommendation before stabilization and rate limits.
        recommended: u32,
    },
    /// Workers AI: utilization against the deadband.
    Utilization {
        /// Measured (and out-of-capacity inflated) utilization.
        utilization: f64,
        /// The deadband.
        min: f64,
        /// The deadband.
        max: f64,
    },
    /// Workers AI: the kill switch is on.
    Disabled,
    /// Workers AI's request-count algorithm: requests a minute × factor.
    RequestCount {
        /// Requests a minute over the window.
        per_minute: f64,
        /// The autoscaling factor.
        factor: f64,
    },
    /// Hangar: replicas the demand needs.
    Demand {
        /// Requests running or waiting.
        work: u64,
        /// Permits the sizing fills per replica.
        per_replica: f64,
    },
    /// Hangar: the measured demand — arrival rate × mean permit time —
    /// beyond its noise.
    Rate {
        /// The demand's bound in permits (lower going up, upper going
        /// down).
        permits: f64,
        /// Permits the sizing fills per replica.
        per_replica: f64,
    },
    /// Hangar: the demand has been below the replicas for the quiet period;
    /// its peak is kept.
    Quiet {
        /// The peak demand, in replicas, during the period.
        peak: u32,
    },
    /// Hangar: requests wait and TTFT p99 is above the model's objective.
    SloMiss {
        /// The recent TTFT p99.
        ttft_p99_ms: Millis,
        /// The objective.
        slo_ms: Millis,
    },
    /// Nothing changed.
    Steady,
    /// An operator evicted replicas: the count is lowered to what stayed
    /// hot, so they do not come straight back.
    Evicted,
    /// Placement gave the model's replicas to another model: the count is
    /// lowered to what stayed hot until demand asks again.
    Preempted,
    /// Hangar: what the model held beyond its demand went to a model
    /// waiting for room.
    Yielded,
    /// A dedicated window of the schedule keeps at least this many.
    Dedicated {
        /// The window's replicas.
        replicas: u32,
    },
    /// The policy wanted more than `max_replicas` (or an emergency cap).
    Capped {
        /// What the policy wanted.
        wanted: u32,
    },
    /// Placement cannot fit more than this many now.
    Unplaceable {
        /// What the policy wanted.
        wanted: u32,
    },
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Fixed => f.write_str("fixed at min_replicas"),
            Reason::FromZero => f.write_str("requests wait and no replica is up"),
            Reason::Frozen => f.write_str("frozen by an operator"),
            Reason::Pinned => f.write_str("pinned by an operator"),
            Reason::Backlog { per_replica, target, recommended } => {
                write!(
                    f,
                    "backlog {per_replica:.2} per replica against {target:.2}: {recommended} recommended"
                )
            }
            // From zero (no healthy replica) there is no finite utilization.
            Reason::Utilization { utilization, min, max } if *utilization >= f64::MAX => {
                write!(f, "utilization unbounded (no replica ready) against {min:.2}–{max:.2}")
            }
            Reason::Utilization { utilization, min, max } => {
                write!(f, "utilization {utilization:.2} against {min:.2}–{max:.2}")
            }
            Reason::Disabled => f.write_str("scaling disabled"),
            Reason::RequestCount { per_minute, factor } => {
                write!(f, "{per_minute:.1} requests a minute × {factor:.2}")
            }
            Reason::Demand { work, per_replica } => {
                write!(f, "{work} requests running or waiting at {per_replica:.1} per replica")
            }
            Reason::Rate { permits, per_replica } => write!(
                f,
                "arrivals × service time need {permits:.1} permits beyond noise at {per_replica:.1} per replica"
            ),
            Reason::Quiet { peak } => write!(f, "quiet period over: keeping its peak of {peak}"),
            Reason::SloMiss { ttft_p99_ms, slo_ms } => {
                write!(f, "TTFT p99 {ttft_p99_ms} ms above the {slo_ms} ms objective")
            }
            Reason::Steady => f.write_str("steady"),
            Reason::Evicted => f.write_str("evicted by an operator"),
            Reason::Preempted => f.write_str("its replicas were given to another model"),
            Reason::Yielded => f.write_str("gave what its demand does not need to a model waiting for room"),
            Reason::Dedicated { replicas } => write!(f, "a dedicated window keeps {replicas}"),
            Reason::Capped { wanted } => write!(f, "{wanted} wanted, capped"),
            Reason::Unplaceable { wanted } => write!(f, "{wanted} wanted, placement cannot fit more"),
        }
    }
}

/// The last [`DECISIONS_KEPT`] decisions, oldest first.
#[derive(Debug, Clone, Default)]
pub struct DecisionLog {
    decisions: VecDeque<Decision>,
}

impl DecisionLog {
    pub(crate) fn push(&mut self, d: Decision) {
        if self.decisions.len() == DECISIONS_KEPT {
            self.decisions.pop_front();
        }
        self.decisions.push_back(d);
    }

    /// The decisions kept, oldest first.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &Decision> + ExactSizeIterator {
        self.decisions.iter()
    }

    /// The latest decision.
    pub fn last(&self) -> Option<&Decision> {
        self.decisions.back()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_from_zero_reads_without_a_309_digit_number() {
        let r = Reason::Utilization { utilization: f64::MAX, min: 0.3, max: 0.8 };
        assert_eq!(r.to_string(), "utilization unbounded (no replica ready) against 0.30–0.80");
    }
}
