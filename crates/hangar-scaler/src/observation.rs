//! What a driver tells a scaler about one model.

use hangar_core::Millis;
use serde::Serialize;

/// One model as its driver sees it at a moment: the line, the replicas,
/// and cumulative counters (the scaler takes their differences over
/// whatever window its policy needs, so a missed observation loses
/// nothing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Observation {
    /// Requests waiting for a permit (the queue length).
    pub waiting: u32,
    /// Requests holding a permit (running on a replica).
    pub in_flight: u32,
    /// Requests one replica serves at once (its permits).
    pub permits_per_replica: u32,
    /// Replicas by state.
    pub replicas: ReplicaCounts,
    /// Requests that arrived, since the start.
    pub arrivals: u64,
    /// Requests that finished (with an answer), since the start.
    pub completions: u64,
    /// Requests turned away for want of capacity (429, out of capacity),
    /// since the start.
    pub rejected: u64,
    /// Permit-milliseconds held by requests, since the start: the sum of
    /// every request's run time (Workers AI's inference time).
    pub busy_ms: u64,
    /// The p99 time to first token of recent requests, if any finished.
    pub ttft_p99_ms: Option<Millis>,
}

/// A model's replicas by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReplicaCounts {
    /// Placed and loading (weights, engine start).
    pub starting: u32,
    /// Serving.
    pub ready: u32,
    /// WARM: asleep with their weights in CPU memory.
    pub sleeping: u32,
    /// Failed since the start (cumulative).
    pub failed: u32,
}

impl ReplicaCounts {
    /// Replicas serving or about to: what a scaler counts as the current
    /// capacity.
    pub fn up(&self) -> u32 {
        self.starting.saturating_add(self.ready)
    }
}

impl Observation {
    /// Requests running or waiting.
    pub fn work(&self) -> u64 {
        u64::from(self.waiting) + u64::from(self.in_flight)
    }
}
