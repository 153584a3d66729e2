//! Scenario files for `hangar plan`: a cluster, its current deployments and
//! what to ask of it, run as a dry run.
//!
//! A scenario (TOML or JSON, same fields) holds the [`ClusterConfig`] parts
//! (`placement`, `nodes`, `models`), the current `deployments`, and the
//! operations to plan, which run in this order at `now_ms`:
//!
//! 1. `evictions`: explicit evictions (a whole model, or one replica);
//! 2. `schedule`: if present, the dedicated windows are applied (an empty
//!    list frees every dedicated replica);
//! 3. `requests`: replica requests, deployed together.
//!
//! The rng is ChaCha8 seeded with `seed`, so the same file always plans the
//! same way. Errors name the field (`deployments[2].node`) and the line.

mod locate;
mod report;

use std::collections::{BTreeMap, BTreeSet};

use hangar_core::{Millis, ModelKey, ReplicaId};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

pub use locate::{FieldPath, Segment};
pub use report::{NodeSummary, PlanReport};

use crate::cluster::{Cluster, Restore};
use crate::config::{ClusterConfig, NodeConfig, PlacementConfig};
use crate::delta::DeploymentDelta;
use crate::deployment::{Level, NodeId};
use crate::error::{ConfigError, RestoreError};
use crate::outcome::ReplicaRequest;
use crate::schedule::{Schedule, Window};
use crate::sizing::ModelSpec;

/// The file format of a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// TOML.
    Toml,
    /// JSON.
    Json,
}

impl Format {
    /// The format a file name implies: `.json` is JSON, `.toml` TOML; any
    /// other name is sniffed from the text (JSON starts with `{`).
    pub fn guess(file_name: &str, text: &str) -> Self {
        let lower = file_name.to_ascii_lowercase();
        if lower.ends_with(".json") {
            Format::Json
        } else if lower.ends_with(".toml") || !text.trim_start().starts_with('{') {
            Format::Toml
        } else {
            Format::Json
        }
    }
}

/// A deployment that exists before the plan runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExistingDeployment {
    /// Its model.
    pub model: ModelKey,
    /// Its id (32 hex digits); minted from the seed when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<ReplicaId>,
    /// Its node.
    pub node: NodeId,
    /// `hot` (default) or `warm`.
    #[serde(default = "hot")]
    pub level: Level,
    /// GPUs a hot one holds; picked by the sizing rules when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<Vec<u32>>,
    /// Whether it is dedicated.
    #[serde(default)]
    pub dedicated: bool,
    /// When it became hot (default 0).
    #[serde(default)]
    pub deployed_at_ms: Millis,
}

fn hot() -> Level {
    Level::Hot
}

/// An explicit eviction to plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlannedEviction {
    /// The model.
    pub model: ModelKey,
    /// One replica; every hot replica of the model when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<ReplicaId>,
}

/// A scenario file, parsed. See the [module docs](self).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Seeds the rng (ids, tie-breaks).
    #[serde(default)]
    pub seed: u64,
    /// The instant the plan runs at.
    #[serde(default)]
    pub now_ms: Millis,
    /// Policy knobs.
    #[serde(default)]
    pub placement: PlacementConfig,
    /// The fleet.
    #[serde(default)]
    pub nodes: Vec<NodeConfig>,
    /// The model catalogue.
    #[serde(default)]
    pub models: BTreeMap<ModelKey, ModelSpec>,
    /// What runs now.
    #[serde(default)]
    pub deployments: Vec<ExistingDeployment>,
    /// Explicit evictions, applied first.
    #[serde(default)]
    pub evictions: Vec<PlannedEviction>,
    /// Dedicated windows, applied second when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<Vec<Window>>,
    /// Replica requests, deployed last.
    #[serde(default)]
    pub requests: Vec<ReplicaRequest>,
    /// Where models' weights are resident: the last tie-breaker of
    /// placement ([`Cluster::set_resident`]).
    #[serde(default)]
    pub residency: ScenarioResidency,
}

/// `[residency]`: which weight artifact each model loads, and which
/// artifacts each node holds resident in its weight store.
///
/// ```toml
/// [residency]
/// artifacts = { "meta/llama" = "llama-q4" }
/// nodes = { "gpu-02" = ["llama-q4"] }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioResidency {
    /// Model → the artifact its replicas load (models may share one).
    #[serde(default)]
    pub artifacts: BTreeMap<ModelKey, String>,
    /// Node → the artifacts resident there.
    #[serde(default)]
    pub nodes: BTreeMap<NodeId, BTreeSet<String>>,
}

/// A scenario that cannot be parsed or run: what, where, why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{path}: {message}", location(*.line, *.column))]
pub struct ScenarioError {
    /// The field, e.g. `deployments[2].node` (empty for the whole file).
    pub path: FieldPath,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// 1-based column, when known.
    pub column: Option<usize>,
    /// What is wrong.
    pub message: String,
}

fn location(line: Option<usize>, column: Option<usize>) -> String {
    match (line, column) {
        (Some(l), Some(c)) => format!("line {l}, column {c}: "),
        (Some(l), None) => format!("line {l}: "),
        _ => String::new(),
    }
}

impl ScenarioError {
    fn at(path: FieldPath, message: impl ToString) -> Self {
        Self { path, line: None, column: None, message: message.to_string() }
    }
}

impl Scenario {
    /// Parses a scenario; syntax and type errors carry the field and line.
    pub fn parse(text: &str, format: Format) -> Result<Self, ScenarioError> {
        match format {
            Format::Toml => {
                let de =
                    toml::Deserializer::parse(text).map_err(|e| toml_error(text, FieldPath::root(), &e))?;
                serde_path_to_error::deserialize(de)
                    .map_err(|e| toml_error(text, FieldPath::from_serde(e.path()), e.inner()))
            }
            Format::Json => {
                let mut de = serde_json::Deserializer::from_str(text);
                let scenario: Scenario = serde_path_to_error::deserialize(&mut de)
                    .map_err(|e| json_error(FieldPath::from_serde(e.path()), e.inner()))?;
                de.end().map_err(|e| json_error(FieldPath::root(), &e))?;
                Ok(scenario)
            }
        }
    }

    /// Runs the plan: builds the cluster, registers the deployments, applies
    /// evictions, schedule and requests. Errors carry the field but no line;
    /// [`plan`] adds the line from the source text.
    pub fn run(&self) -> Result<PlanReport, ScenarioError> {
        let config = ClusterConfig {
            placement: self.placement.clone(),
            nodes: self.nodes.clone(),
            models: self.models.clone(),
        };
        let mut cluster = Cluster::new(config).map_err(config_error)?;
        let at = |map: &str, key: &str| FieldPath::root().key("residency").key(map).key(key);
        for (model, artifact) in &self.residency.artifacts {
            cluster
                .set_model_artifact(model, Some(artifact.clone()))
                .map_err(|e| ScenarioError::at(at("artifacts", model.as_str()), e))?;
        }
        for (node, artifacts) in &self.residency.nodes {
            cluster
                .set_resident(node, artifacts.clone())
                .map_err(|e| ScenarioError::at(at("nodes", node.as_str()), e))?;
        }
        let schedule =
            match &self.schedule {
                None => None,
                Some(windows) => Some(Schedule::new(windows.clone()).map_err(|e| {
                    ScenarioError::at(FieldPath::root().key("schedule").index(e.index), e.why)
                })?),
            };
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        for (i, d) in self.deployments.iter().enumerate() {
            let replica_id = d.replica.unwrap_or_else(|| ReplicaId::from_u128(rand::Rng::random(&mut rng)));
            let restore = Restore {
                model_key: d.model.clone(),
                replica_id,
                node: d.node.clone(),
                level: d.level,
                gpus: d.gpus.clone(),
                dedicated: d.dedicated,
                deployed_at_ms: d.deployed_at_ms,
            };
            cluster.restore(restore).map_err(|e| restore_error(i, e))?;
        }
        let before = cluster.snapshot();

        let mut evictions = Vec::new();
        for (i, e) in self.evictions.iter().enumerate() {
            match e.replica {
                None => evictions.extend(cluster.evict_model(&e.model)),
                Some(r) => evictions.extend(cluster.evict_replica(&e.model, &r).map_err(|err| {
                    ScenarioError::at(FieldPath::root().key("evictions").index(i).key("replica"), err)
                })?),
            }
        }
        let scheduled = schedule.map(|s| cluster.apply_schedule(&s, self.now_ms, &mut rng));
        let deployed = cluster.deploy(&self.requests, self.now_ms, &mut rng);
        let after = cluster.snapshot();
        let delta = DeploymentDelta::between(&before, &after)
            .expect("placement commands only make expressible changes");
        Ok(PlanReport::new(self, &cluster, evictions, scheduled, deployed, delta))
    }
}

/// Parses and runs a scenario, with line numbers on every error the source
/// can locate. `format` is usually [`Format::guess`]ed from the file name.
pub fn plan(text: &str, format: Format) -> Result<PlanReport, ScenarioError> {
    let scenario = Scenario::parse(text, format)?;
    scenario.run().map_err(|e| match format {
        Format::Toml => locate::with_toml_line(e, text),
        Format::Json => locate::with_json_line(e, text),
    })
}

fn toml_error(text: &str, path: FieldPath, e: &toml::de::Error) -> ScenarioError {
    let (line, column) = e.span().map_or((None, None), |s| {
        let (l, c) = locate::line_col(text, s.start);
        (Some(l), Some(c))
    });
    ScenarioError { path, line, column, message: e.message().trim().to_owned() }
}

fn json_error(path: FieldPath, e: &serde_json::Error) -> ScenarioError {
    let message = e.to_string();
    // serde_json appends " at line L column C"; the location is shown apart.
    let message = message.split(" at line ").next().unwrap_or(&message).to_owned();
    let known = e.line() > 0;
    ScenarioError { path, line: known.then_some(e.line()), column: known.then_some(e.column()), message }
}

fn config_error(e: ConfigError) -> ScenarioError {
    let root = FieldPath::root();
    let path = match &e {
        ConfigError::Placement { field, .. } => root.key("placement").key(field),
        ConfigError::Node { index, field, .. } => root.key("nodes").index(*index).key(field),
        ConfigError::DuplicateNode { second, .. } => root.key("nodes").index(*second).key("id"),
        ConfigError::Model { model, .. } => root.key("models").key(model),
    };
    let message = match e {
        ConfigError::Placement { why, .. }
        | ConfigError::Node { why, .. }
        | ConfigError::Model { why, .. } => why,
        other => other.to_string(),
    };
    ScenarioError::at(path, message)
}

fn restore_error(index: usize, e: RestoreError) -> ScenarioError {
    let field = match e {
        RestoreError::UnknownModel(_) => Some("model"),
        RestoreError::UnknownNode(_) => Some("node"),
        RestoreError::DuplicateReplica(_) => Some("replica"),
        RestoreError::Cold(_) => Some("level"),
        RestoreError::WarmWithGpus
        | RestoreError::NoSuchGpu { .. }
        | RestoreError::GpuCount { .. }
        | RestoreError::GpuFull { .. } => Some("gpus"),
        _ => None,
    };
    let path = FieldPath::root().key("deployments").index(index);
    let path = match field {
        Some(f) => path.key(f),
        None => path,
    };
    ScenarioError::at(path, e)
}
