//! The node agent protocol: what a `hangar agent` tells the fleet about
//! its machine and its replicas, and what the leader wants it to run.
//! The substrate that carries them (Redis) is `hangar-redis`'s concern;
//! these are only the words.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::instance::InstanceReport;
use crate::{AdapterRef, ByteSize, ModelKey, ReplicaId};

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
    /// The agent's HTTP address (`http://10.0.0.7:9400`).
    pub url: String,
    /// Leaving (SIGTERM with time to move its replicas): the leader places
    /// nothing new here and moves its replicas to other nodes.
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Whether its engine loads LoRA adapters at run time (its start probe
    /// found `/v1/load_lora_adapter`) — meaningful from `Ready` on: a
    /// gateway refuses a request for an adapter of a model none of whose
    /// engines can. Absent (an agent from before this field): true, and a
    /// load the engine cannot do fails then.
    #[serde(default = "engine_loads_lora_unless_told")]
    pub lora: bool,
    /// Why it failed, while it is failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// How its last start went (absent: it has not finished one, or an
    /// agent from before this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartReport>,
    /// What it is doing, by the agent's instance monitor (absent: an agent
    /// from before this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<InstanceReport>,
}

/// How one start of a replica ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartStatus {
    /// Its engine serves.
    #[default]
    Ready,
    /// It did not start (nothing is left running).
    Failed,
}

/// A step of a replica's start, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartPhase {
    /// Placement put it on its node and GPUs: the start began.
    Placed,
    /// Its weights are materialized (for a model with `weights`).
    Weights,
    /// Its engine process answers its readiness check (healthy).
    Engine,
    /// Its capabilities probed: it serves.
    Ready,
}

/// When, after its start began, a replica reached one [`StartPhase`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseAt {
    /// The phase.
    pub phase: StartPhase,
    /// Milliseconds after the start began.
    pub at_ms: u64,
}

/// How a replica's weights were materialized (its start report's weights
/// phase).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightsReport {
    /// The artifact.
    pub artifact: String,
    /// Where the bytes came from: `resident` (lease-in-place), `local` (the
    /// blob store), `peer` or `fallback`.
    pub source: String,
    /// The artifact's bytes.
    pub bytes: u64,
    /// The whole phase: key resolved (or file imported), materialized,
    /// confirmed, ms.
    pub took_ms: u64,
    /// Of that, the store daemon's own load — reading every byte from its
    /// source and verifying it — ms (the daemon's clock); 0 for resident
    /// weights, which were not read again.
    pub load_ms: u64,
}

/// How one start of a replica went: seed 001's setup-run report, made by
/// the node that ran it once the start ends, ready or failed (a start
/// abandoned because placement changed its mind has none). Placed at 0,
/// its weights materialized (from which source), its engine answering,
/// ready — or the error that stopped it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartReport {
    /// How it ended.
    #[serde(default)]
    pub status: StartStatus,
    /// When it began, ms since the Unix epoch (the node's clock; 0 from
    /// an agent from before this field).
    #[serde(default)]
    pub started_at_ms: u64,
    /// When it ended, ms since the Unix epoch.
    #[serde(default)]
    pub completed_at_ms: u64,
    /// The phases it reached, in order, each with its time since placed.
    #[serde(default)]
    pub phases: Vec<PhaseAt>,
    /// The weights phase, for a model with `weights`.
    #[serde(default)]
    pub weights: Option<WeightsReport>,
    /// Engine process spawned → answering its readiness check, ms.
    #[serde(default)]
    pub engine_ms: u64,
    /// Placed → ready, ms (the phases above and the capability probe).
    #[serde(default)]
    pub ready_ms: u64,
    /// Why it failed — with the tail of what the engine printed where the
    /// node has it (a cog model's `setup()` logs), at most
    /// [`StartReport::ERROR_TAIL`] bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The end of what the engine printed while it started (a failed
    /// start has it in `error`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub logs: String,
}

impl StartReport {
    /// The most of an error's text a report keeps (its end, where a log's
    /// last lines are): seed 001's 20 KiB of setup logs.
    pub const ERROR_TAIL: usize = 20 * 1024;

    /// A start that ended with the engine serving: its weights phase, the
    /// engine's spawn → healthy time, and placed → ready. The times since
    /// the epoch are the driver's to stamp.
    pub fn ready(weights: Option<WeightsReport>, engine_ms: u64, ready_ms: u64) -> Self {
        let weights_ms = weights.as_ref().map_or(0, |w| w.took_ms);
        let mut phases = vec![PhaseAt { phase: StartPhase::Placed, at_ms: 0 }];
        if weights.is_some() {
            phases.push(PhaseAt { phase: StartPhase::Weights, at_ms: weights_ms });
        }
        phases.push(PhaseAt { phase: StartPhase::Engine, at_ms: (weights_ms + engine_ms).min(ready_ms) });
        phases.push(PhaseAt { phase: StartPhase::Ready, at_ms: ready_ms });
        StartReport { status: StartStatus::Ready, phases, weights, engine_ms, ready_ms, ..Self::default() }
    }

    /// A start that failed `took_ms` after it began, for `why` (its last
    /// [`Self::ERROR_TAIL`] bytes kept).
    pub fn failed(took_ms: u64, why: &str) -> Self {
        let mut from = why.len().saturating_sub(Self::ERROR_TAIL);
        while !why.is_char_boundary(from) {
            from += 1;
        }
        StartReport {
            status: StartStatus::Failed,
            phases: vec![PhaseAt { phase: StartPhase::Placed, at_ms: 0 }],
            ready_ms: took_ms,
            error: Some(why[from..].to_owned()),
            ..Self::default()
        }
    }

    /// The same report stamped with when the start began and ended (ms
    /// since the Unix epoch).
    pub fn at(mut self, started_at_ms: u64, completed_at_ms: u64) -> Self {
        self.started_at_ms = started_at_ms;
        self.completed_at_ms = completed_at_ms.max(started_at_ms);
        self
    }
}

impl std::fmt::Display for StartReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("placed")?;
        if let Some(w) = &self.weights {
            write!(f, " → weights {} ms ({}, {} bytes)", w.took_ms, w.source, w.bytes)?;
        }
        match (&self.status, &self.error) {
            (StartStatus::Failed, Some(why)) => write!(f, " → failed at {} ms: {why}", self.ready_ms),
            (StartStatus::Failed, None) => write!(f, " → failed at {} ms", self.ready_ms),
            (StartStatus::Ready, _) => {
                write!(f, " → engine {} ms → ready at {} ms", self.engine_ms, self.ready_ms)
            }
        }
    }
}

/// What a report without `sleeps` says: what placement assumes until told.
fn engine_sleeps_unless_told() -> bool {
    true
}

fn engine_loads_lora_unless_told() -> bool {
    true
}

/// Every replica one node runs, reported whole by its agent several
/// times a second (a replica missing from it is gone).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    /// The agent run that wrote it.
    pub agent: String,
    /// The replicas.
    pub replicas: Vec<ReplicaReport>,
    /// The weight-store artifacts (`hg1:` ids) the node holds resident —
    /// in its store daemon's memory, or materialized as a model directory
    /// — sorted: a replica of a model loading one of them starts there
    /// without reading its weights from disk or a peer, so placement
    /// prefers the node among equal candidates. Absent (an agent from
    /// before this field, or one without a weight store): none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<String>,
    /// The digest of the LoRA adapters registered in the node's weight
    /// store, as its agent last published them ([`NodeAdapters`]): a
    /// gateway reads the list again only when this changes. Absent: the
    /// node registers none (or its agent runs no model with adapters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapters: Option<String>,
}

/// The LoRA adapters registered in one node's weight store (`hangar store
/// import-adapter`), as its agent publishes them for the gateways: a
/// fleet serves every adapter some live node registers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAdapters {
    /// Names this list; the node's report carries it.
    pub digest: String,
    /// The adapters, sorted by name.
    pub adapters: Vec<RegisteredAdapter>,
}

/// One adapter a node registers: its name and the artifact the name
/// points at there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisteredAdapter {
    /// `BASE:ADAPTER`.
    pub adapter: AdapterRef,
    /// The artifact's id (`hg1:…`).
    pub artifact: String,
    /// The bytes of its files as an engine loads them.
    pub bytes: u64,
}

/// What one gateway sees of each model's demand, published for the
/// leader, which scales on the sum over every gateway — and the replicas
/// it found dead lately, which the leader, whose controller alone places
/// their replacements, checks itself.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GatewayLoad {
    /// The gateway.
    pub gateway: String,
    /// Per model.
    pub models: BTreeMap<ModelKey, ModelLoad>,
    /// Replicas of other machines this gateway found dead within its
    /// quarantine (10 s). Absent (a gateway from before this field): none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<ReplicaId>,
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
        assert!(report.lora, "nor does it refuse adapters before trying");
        assert!(report.start.is_none() && report.instance.is_none(), "nor a start report nor a monitor");
        let cannot = ReplicaReport { sleeps: false, ..report };
        let text = serde_json::to_string(&cannot).unwrap();
        assert!(text.contains(r#""sleeps":false"#), "{text}");
        assert_eq!(serde_json::from_str::<ReplicaReport>(&text).unwrap(), cannot);
    }

    #[test]
    fn a_start_report_lists_its_phases_and_travels_whole() {
        let weights = WeightsReport {
            artifact: "hg1:ab".into(),
            source: "peer".into(),
            bytes: 10,
            took_ms: 400,
            load_ms: 300,
        };
        let ready = StartReport::ready(Some(weights), 1_000, 1_450).at(5_000, 6_450);
        let phases: Vec<(StartPhase, u64)> = ready.phases.iter().map(|p| (p.phase, p.at_ms)).collect();
        assert_eq!(
            phases,
            [
                (StartPhase::Placed, 0),
                (StartPhase::Weights, 400),
                (StartPhase::Engine, 1_400),
                (StartPhase::Ready, 1_450)
            ]
        );
        assert_eq!(
            ready.to_string(),
            "placed → weights 400 ms (peer, 10 bytes) → engine 1000 ms → ready at 1450 ms"
        );
        let text = serde_json::to_string(&ready).unwrap();
        assert!(text.contains(r#""status":"ready""#) && text.contains(r#""phase":"engine""#), "{text}");
        assert_eq!(serde_json::from_str::<StartReport>(&text).unwrap(), ready);
    }

    #[test]
    fn a_failed_start_keeps_the_tail_of_its_error() {
        let log = format!("{}Traceback: é\nValueError: no weights", "x".repeat(30_000));
        let failed = StartReport::failed(2_000, &log).at(10, 2_010);
        let error = failed.error.as_deref().unwrap();
        assert!(error.len() <= StartReport::ERROR_TAIL && error.ends_with("ValueError: no weights"));
        assert_eq!(
            (failed.status, failed.ready_ms, failed.completed_at_ms),
            (StartStatus::Failed, 2_000, 2_010)
        );
        assert!(failed.to_string().starts_with("placed → failed at 2000 ms: x"), "{failed}");
        // A cut inside a character moves to its end.
        let wide = format!("{}a", "é".repeat(StartReport::ERROR_TAIL));
        let kept = StartReport::failed(1, &wide).error.unwrap();
        assert_eq!(kept.len(), StartReport::ERROR_TAIL - 1);
        assert!(kept.ends_with("éa"));
    }
}
