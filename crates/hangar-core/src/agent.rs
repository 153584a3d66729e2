//! The node agent protocol: what a `hangar agent` tells the fleet about
//! its machine and its replicas, and what the leader wants it to run.
//! The substrate that carries them (Redis) is `hangar-redis`'s concern;
//! these are only the words.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{ByteSize, ModelKey, ReplicaId};

/// A machine as its agent registers it, renewed with every heartbeat:
/// what placement needs to put replicas there, and where to reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// The node's name, unique among live agents (a second agent asking
    /// for a live name is refused).
    pub name: String,
    /// This agent run (random, new at each start): tells a restarted
    /// agent from another machine claiming the same name.
    pub agent: String,
    /// GPUs on the machine.
    pub gpus: u32,
    /// Memory of each GPU.
    pub gpu_memory: ByteSize,
    /// The GPUs are slots of host memory (machines without accelerators:
    /// the mock engine, CI).
    #[serde(default)]
    pub virtual_gpus: bool,
    /// The hardware label models may require (`a100-80gb`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_kind: Option<String>,
    /// Host memory for the warm cache.
    pub cpu_memory: ByteSize,
    /// Store artifacts (`hg1:` ids) the node holds, so placement can
    /// prefer a node that need not fetch a model's weights.
    #[serde(default)]
    pub artifacts: Vec<String>,
    /// The agent's HTTP address (`http://10.0.0.7:9400`).
    pub url: String,
    /// Leaving (SIGTERM): place nothing new here; its replicas move.
    #[serde(default)]
    pub draining: bool,
}

/// One replica the leader wants on a node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DesiredReplica {
    /// The replica.
    pub replica: ReplicaId,
    /// Its model.
    pub model: ModelKey,
    /// HOT (serving, on `gpus`) or WARM (asleep in the warm cache).
    pub warm: bool,
    /// GPU index on the node → bytes it may use there (empty when warm).
    #[serde(default)]
    pub gpus: BTreeMap<u32, u64>,
    /// The share of each GPU's memory it may use, below 1 when it shares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_fraction: Option<f64>,
    /// Kept by a dedicated window of the schedule.
    #[serde(default)]
    pub dedicated: bool,
}

/// Everything the leader wants on one node, written whole on every
/// change, with the leader's epoch (see the leader lease).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DesiredState {
    /// The tenure of the leader that wrote it.
    pub epoch: u64,
    /// The agent run it was written for (the node's `NodeRecord::agent`
    /// when the leader wrote it). Another run under the same name ignores
    /// it: it starts from what it actually runs, and the leader writes it
    /// a state of its own.
    #[serde(default)]
    pub agent: String,
    /// The replicas, by id.
    pub replicas: Vec<DesiredReplica>,
}

/// Where a replica a node runs is in its life, as its node reports it
/// (the replica lifecycle's observed state, in the fleet's words).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaPhase {
    /// Wanted HOT, no engine yet: waiting for room on its GPUs (another
    /// engine is still leaving them) or for its restart's back-off.
    Pending,
    /// Its engine is starting.
    Starting,
    /// Serving at its URL.
    Ready,
    /// Awake but taken out of service: finishing its requests before it
    /// sleeps or stops.
    Draining,
    /// Asleep in the warm cache.
    Sleeping,
    /// Waking from the warm cache.
    Waking,
    /// Its engine is being stopped.
    Stopping,
    /// It did not start, or its engine died.
    Failed,
    /// Wanted WARM, but no engine is kept for it (it could not sleep, or
    /// none was running): nothing to wake.
    Cold,
}

impl ReplicaPhase {
    /// Every phase, in order.
    pub const ALL: [Self; 9] = [
        Self::Pending,
        Self::Starting,
        Self::Ready,
        Self::Draining,
        Self::Sleeping,
        Self::Waking,
        Self::Stopping,
        Self::Failed,
        Self::Cold,
    ];

    /// Its name in reports, logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Starting => "starting",
            Self::Ready => "ready",
            Self::Draining => "draining",
            Self::Sleeping => "sleeping",
            Self::Waking => "waking",
            Self::Stopping => "stopping",
            Self::Failed => "failed",
            Self::Cold => "cold",
        }
    }

    /// Whether the replica serves or soon will (a scaler counts it as
    /// starting or ready).
    pub fn is_up(self) -> bool {
        matches!(self, Self::Pending | Self::Starting | Self::Waking | Self::Ready)
    }
}

/// One replica as its node's agent reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaReport {
    /// The replica.
    pub replica: ReplicaId,
    /// Its model.
    pub model: ModelKey,
    /// Where it is.
    pub phase: ReplicaPhase,
    /// Its engine's base URL, once started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Placed → ready of its last start, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_ms: Option<u64>,
    /// The GPUs its engine holds now (none while asleep or stopped).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<u32>,
    /// Whether its engine can sleep (keep its weights in CPU memory and
    /// give its GPU memory back), as probed once it started — meaningful
    /// from `Ready` on: placement sends a model that cannot to COLD rather
    /// than to the warm cache. Absent (an agent from before this field):
    /// true, placement's own assumption.
    #[serde(default = "engine_sleeps_unless_told")]
    pub sleeps: bool,
    /// Why it failed, while it is failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

/// What a report without `sleeps` says: what placement assumes until told.
fn engine_sleeps_unless_told() -> bool {
    true
}

/// Every replica one node runs, reported whole by its agent several
/// times a second (a replica missing from it is gone).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    /// The agent run that wrote it.
    pub agent: String,
    /// The replicas.
    pub replicas: Vec<ReplicaReport>,
}

/// What one gateway sees of each model's demand, published for the
/// leader, which scales on the sum over every gateway.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GatewayLoad {
    /// The gateway.
    pub gateway: String,
    /// Per model.
    pub models: BTreeMap<ModelKey, ModelLoad>,
}

/// One model's demand at one gateway: the scaler's inputs that come from
/// the request path (counters since the gateway started).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelLoad {
    /// Requests waiting for a permit.
    pub waiting: u32,
    /// Requests holding a permit.
    pub in_flight: u32,
    /// Requests that arrived.
    pub arrivals: u64,
    /// Requests that finished.
    pub completions: u64,
    /// Requests turned away for want of capacity.
    pub rejected: u64,
    /// Permit-milliseconds held.
    pub busy_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_report_says_whether_its_engine_sleeps_and_an_older_one_means_yes() {
        let older = r#"{"replica":"00000000000000000000000000000007","model":"acme/m","phase":"ready"}"#;
        let report: ReplicaReport = serde_json::from_str(older).unwrap();
        assert!(report.sleeps, "a report from before the field: placement's default");
        let cannot = ReplicaReport { sleeps: false, ..report };
        let text = serde_json::to_string(&cannot).unwrap();
        assert!(text.contains(r#""sleeps":false"#), "{text}");
        assert_eq!(serde_json::from_str::<ReplicaReport>(&text).unwrap(), cannot);
    }
}
