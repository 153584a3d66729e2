//! The fleet file of `hangar sim --fleet`: nodes, models and cold starts.

use hangar_core::{ByteSize, FieldError, Millis, ModelKey};
use hangar_engine::EngineConfig;
use hangar_placement::{ClusterConfig, ModelSpec, NodeConfig, PlacementConfig};
use hangar_router::{AdapterConfig, RouterPolicy};
use hangar_scaler::ScalingConfig;
use serde::Deserialize;

/// A whole fleet to simulate.
///
/// ```toml
/// seed = 1
///
/// [[nodes]]
/// id = "gpu"          # nodes gpu-0 … gpu-3
/// count = 4
/// gpus = 8
/// gpu_memory = "80GB"
/// cpu_cache = "512GB"
///
/// [[models]]
/// key = "synth/m0"
/// size = "16GB"
/// max_replicas = 8
/// slo_ttft_ms = 2000
/// scaling = { policy = "hangar" }
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// Seeds placement's and the routers' random choices.
    #[serde(default)]
    pub seed: u64,
    /// Placement knobs (docs/placement.md).
    #[serde(default)]
    pub placement: PlacementConfig,
    /// Node groups.
    pub nodes: Vec<FleetNodes>,
    /// The models served.
    pub models: Vec<FleetModel>,
    /// How long a replica takes to come up.
    #[serde(default)]
    pub cold_start: ColdStart,
    /// How often the controller observes every model (ms). Default 1000, as
    /// `hangar serve`.
    #[serde(default = "default_observe")]
    pub observe_ms: Millis,
    /// Nodes an operator drains during the run (`[[drains]]`), to try a
    /// maintenance before doing it.
    #[serde(default)]
    pub drains: Vec<FleetDrain>,
}

/// `[[drains]]`: node `node` drained from `from_s` to `to_s` (trace
/// seconds after the first row; no `to_s`: to the end), as
/// `POST /admin/nodes/{node}/drain` and its `DELETE` would (docs/sim.md).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetDrain {
    /// The node: a group's `{id}-{i}`.
    pub node: String,
    /// When the drain begins.
    pub from_s: f64,
    /// When it is called off.
    #[serde(default)]
    pub to_s: Option<f64>,
}

/// `count` alike nodes, named `{id}-0` … `{id}-{count-1}`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetNodes {
    /// The group's name.
    pub id: String,
    /// How many nodes (default 1).
    #[serde(default = "one")]
    pub count: u32,
    /// GPUs per node.
    pub gpus: u32,
    /// Memory of each GPU.
    pub gpu_memory: ByteSize,
    /// CPU memory for the warm cache (default 0).
    #[serde(default)]
    pub cpu_cache: ByteSize,
    /// The label of its GPUs (default `gpu`), which models may require.
    #[serde(default)]
    pub gpu_kind: Option<String>,
}

/// One model of the fleet.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetModel {
    /// The key trace rows name in `model`.
    pub key: ModelKey,
    /// Weights (and GPU footprint).
    pub size: ByteSize,
    /// The hardware label its replicas need (a node group's `gpu_kind`).
    #[serde(default)]
    pub gpu_kind: Option<String>,
    /// The least memory each GPU of a node taking its replicas must have.
    #[serde(default)]
    pub min_gpu_memory: Option<ByteSize>,
    /// The engine each replica runs (its scheduler and timing model;
    /// docs/sim.md).
    #[serde(default)]
    pub engine: EngineConfig,
    /// Replicas kept whatever the load.
    #[serde(default)]
    pub min_replicas: u32,
    /// The most replicas (default: `min_replicas`, at least 1).
    #[serde(default)]
    pub max_replicas: Option<u32>,
    /// Requests one replica is given at once (its permits). Default 8.
    #[serde(default = "default_concurrency")]
    pub concurrency: u32,
    /// Requests that may wait (default 4 per permit at `max_replicas`, at
    /// most 1000, as `hangar serve`).
    #[serde(default)]
    pub queue_capacity: Option<usize>,
    /// Seconds a request may wait for a permit before it is timed out
    /// (504). Default 30.
    #[serde(default = "default_timeout")]
    pub timeout_s: u64,
    /// The TTFT objective SLO attainment and goodput count against. Default 2000.
    #[serde(default = "default_slo")]
    pub slo_ttft_ms: Millis,
    /// The scaling policy (default `hangar`).
    #[serde(default)]
    pub scaling: Option<ScalingConfig>,
    /// How a request's replica is chosen among those with a free permit,
    /// as `hangar serve`'s `router` (default `least-outstanding`; `kv`
    /// scores the prompt's `hash_ids` against what each replica was sent).
    #[serde(default)]
    pub router: RouterPolicy,
    /// The LoRA adapters its replicas load for requests that name one
    /// (`[models.adapters]`: `slots`, `memory`, `default_size`,
    /// `request_ms`; docs/adapters.md). Without it, a trace row naming an
    /// adapter of this model is refused.
    #[serde(default)]
    pub adapters: Option<AdapterConfig>,
    /// In the hotswap tier, as `hangar serve`'s `hotswap` (placement swaps
    /// it in by demand behind the models that hold their own replicas).
    #[serde(default)]
    pub hotswap: bool,
}

/// A replica's start: loading its weights from the first tier that holds
/// them — the node's store memory (another replica of the model runs or
/// sleeps there: lease-in-place, at `wake_gbps`), the node's page cache
/// (a load of it finished there), another node's weight store
/// (`peer_gbps`, when set), the disk — then the engine's boot.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ColdStart {
    /// Weights read from disk, GB/s (unless a load of the model has finished on the node).
    pub disk_gbps: f64,
    /// Weights read from the page cache, GB/s (a node where a load of the
    /// model has finished before).
    pub page_cache_gbps: f64,
    /// A WARM replica's weights copied back from CPU memory, GB/s; also a
    /// new replica's, copied from the store's resident copy on its node
    /// while another replica of the model holds it (lease-in-place).
    pub wake_gbps: f64,
    /// Weights fetched from another node's weight store that holds them
    /// (the store's peer transfer), GB/s; unset: no peers, as a store
    /// without a `registry`. A node that fetched them holds them after.
    pub peer_gbps: Option<f64>,
    /// The engine's own start once weights are in (ms); not paid on a wake.
    pub boot_ms: Millis,
    /// An adapter load's work besides reading its bytes (ms, default
    /// 300): the engine building its layers' weights and copying them to
    /// the GPU — LoRAX measured about 20 ms a layer before batching the
    /// copies (predibase/lorax#433), PEFT 25–60 ms an adapter. Its bytes
    /// come from the disk, or the page cache once a load of it has
    /// finished on the node.
    pub adapter_ms: Millis,
}

impl Default for ColdStart {
    fn default() -> Self {
        ColdStart {
            disk_gbps: 2.0,
            page_cache_gbps: 10.0,
            wake_gbps: 25.0,
            peer_gbps: None,
            boot_ms: 10_000,
            adapter_ms: 300,
        }
    }
}

impl ColdStart {
    /// How long loading an adapter of `bytes` takes: from the page cache
    /// (`cached`: a load of it finished on the node before) or the disk.
    pub fn adapter_load_ms(&self, bytes: u64, cached: bool) -> f64 {
        let gbps = if cached { self.page_cache_gbps } else { self.disk_gbps };
        bytes as f64 / (gbps * 1e9) * 1000.0 + self.adapter_ms as f64
    }
}

fn one() -> u32 {
    1
}
fn default_observe() -> Millis {
    1_000
}
fn default_concurrency() -> u32 {
    8
}
fn default_timeout() -> u64 {
    30
}
fn default_slo() -> Millis {
    2_000
}

impl FleetModel {
    /// The most replicas.
    pub fn max_replicas(&self) -> u32 {
        self.max_replicas.unwrap_or(self.min_replicas.max(1))
    }

    /// The line's length.
    pub fn capacity(&self) -> usize {
        let permits = self.concurrency as usize * self.max_replicas() as usize;
        self.queue_capacity.unwrap_or(hangar_queue::AdmissionConfig::default_capacity(permits))
    }
}

impl FleetConfig {
    /// Parses a fleet file; errors name the file, the line and the field.
    pub fn parse(text: &str, origin: &str) -> Result<Self, String> {
        let fleet: FleetConfig = toml::from_str(text).map_err(|e| format!("{origin}: {e}"))?;
        fleet.validate().map_err(|e| format!("{origin}:{}: {e}", e.line_in(text)))?;
        Ok(fleet)
    }

    /// Placement's view: every node and model.
    pub fn cluster(&self) -> ClusterConfig {
        let nodes = self
            .nodes
            .iter()
            .flat_map(|g| {
                (0..g.count).map(move |i| NodeConfig {
                    id: format!("{}-{i}", g.id).parse().expect("validated"),
                    gpus: g.gpus,
                    gpu_memory: Some(g.gpu_memory),
                    gpu_kind: g.gpu_kind.clone(),
                    virtual_gpus: false,
                    cpu_cache: g.cpu_cache,
                })
            })
            .collect();
        let models = self
            .models
            .iter()
            .map(|m| {
                let spec = ModelSpec {
                    size: Some(m.size),
                    gpu_kind: m.gpu_kind.clone(),
                    min_gpu_memory: m.min_gpu_memory,
                    adapter_memory: m.adapters.as_ref().map(|a| a.memory),
                    hotswap: m.hotswap,
                    ..ModelSpec::default()
                };
                (m.key.clone(), spec)
            })
            .collect();
        ClusterConfig { placement: self.placement.clone(), nodes, models }
    }

    /// The controller of this fleet, every model on its own scaling policy
    /// or on `policy` (`sim compare`): what a simulation of it drives.
    pub fn controller(&self, policy: Option<&ScalingConfig>) -> Result<hangar_scaler::Controller, String> {
        let mut cluster = hangar_placement::Cluster::new(self.cluster()).map_err(|e| e.to_string())?;
        // A simulated model's weights are an artifact of its own, named by
        // its key: a node where a load of it finished holds it resident.
        for m in &self.models {
            cluster.set_model_artifact(&m.key, Some(m.key.to_string())).map_err(|e| e.to_string())?;
        }
        let specs = self
            .models
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let scaling = policy.or(m.scaling.as_ref()).cloned().unwrap_or_default();
                let bounds = hangar_scaler::Bounds { min: m.min_replicas, max: m.max_replicas() };
                scaling.check_bounds(bounds).map_err(|e| e.within(&format!("models[{i}]")).to_string())?;
                Ok(hangar_scaler::ModelSpec {
                    key: m.key.clone(),
                    scaling,
                    bounds,
                    slo_ttft_ms: Some(m.slo_ttft_ms),
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(hangar_scaler::Controller::new(cluster, self.seed, specs, 0))
    }

    /// Each model's index in `models`, by key.
    pub(crate) fn by_key(&self) -> std::collections::BTreeMap<ModelKey, usize> {
        self.models.iter().enumerate().map(|(i, m)| (m.key.clone(), i)).collect()
    }

    /// Ranges and cross-field rules; a model the fleet cannot hold (or
    /// not `min_replicas` of it, even alone) is refused before the run.
    pub fn validate(&self) -> Result<(), FieldError> {
        if self.nodes.is_empty() {
            return Err(FieldError::new("nodes", "at least one `[[nodes]]` group is required"));
        }
        for (i, g) in self.nodes.iter().enumerate() {
            let at = format!("nodes[{i}]");
            if format!("{}-0", g.id).parse::<hangar_placement::NodeId>().is_err() {
                return Err(FieldError::new(format!("{at}.id"), format!("`{}` is not a node name", g.id)));
            }
            if g.count == 0 || g.gpus == 0 || g.gpu_memory.bytes() == 0 {
                return Err(FieldError::new(at, "`count`, `gpus` and `gpu_memory` must be above 0"));
            }
        }
        if self.models.is_empty() {
            return Err(FieldError::new("models", "at least one `[[models]]` entry is required"));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, m) in self.models.iter().enumerate() {
            let at = format!("models[{i}]");
            if !seen.insert(m.key.as_str()) {
                return Err(FieldError::new(format!("{at}.key"), format!("`{}` is declared twice", m.key)));
            }
            if m.max_replicas() < m.min_replicas {
                return Err(FieldError::new(format!("{at}.max_replicas"), "is below min_replicas"));
            }
            if m.concurrency == 0 {
                return Err(FieldError::new(format!("{at}.concurrency"), "must be at least 1"));
            }
            if let Some(s) = &m.scaling {
                s.validate().map_err(|e| e.within(&format!("{at}.scaling")))?;
            }
            if let Some(a) = &m.adapters {
                a.validate().map_err(|e| e.within(&format!("{at}.adapters")))?;
            }
            let tier = ModelSpec { hotswap: m.hotswap, ..ModelSpec::default() };
            tier.check_tier(m.min_replicas).map_err(|e| e.within(&at))?;
            hangar_engine::EngineCore::new(&m.engine, super::no_tables)
                .map_err(|e| FieldError::new(format!("{at}.engine"), e.to_string()))?;
        }
        let c = &self.cold_start;
        let peer = c.peer_gbps.map(|v| ("peer_gbps", v));
        let rates =
            [("disk_gbps", c.disk_gbps), ("page_cache_gbps", c.page_cache_gbps), ("wake_gbps", c.wake_gbps)];
        for (field, v) in rates.into_iter().chain(peer) {
            if !(v.is_finite() && v > 0.0) {
                return Err(FieldError::new(format!("cold_start.{field}"), format!("{v} must be above 0")));
            }
        }
        if self.observe_ms == 0 {
            return Err(FieldError::new("observe_ms", "must be at least 1"));
        }
        let cluster = hangar_placement::Cluster::new(self.cluster())
            .map_err(|e| FieldError::new("nodes", e.to_string()))?;
        // A drain names a node the fleet has, by placement's own names.
        for (i, d) in self.drains.iter().enumerate() {
            let at = format!("drains[{i}]");
            if d.node.parse().ok().and_then(|id| cluster.node(&id)).is_none() {
                let first =
                    cluster.nodes().first().map_or(String::new(), |n| format!(" (such as `{}`)", n.id()));
                return Err(FieldError::new(
                    format!("{at}.node"),
                    format!(
                        "no node is named `{}`: nodes are named `{{id}}-{{i}}` of their group{first}",
                        d.node
                    ),
                ));
            }
            if !(d.from_s.is_finite() && d.from_s >= 0.0) {
                return Err(FieldError::new(
                    format!("{at}.from_s"),
                    format!("{} must be 0 or more", d.from_s),
                ));
            }
            if d.to_s.is_some_and(|t| !(t.is_finite() && t > d.from_s)) {
                return Err(FieldError::new(format!("{at}.to_s"), "must come after `from_s`"));
            }
        }
        // Each model alone on the fleet must fit at least one replica, and
        // its `min_replicas`.
        for (i, m) in self.models.iter().enumerate() {
            let wanted = m.min_replicas.max(1);
            let room = cluster.room_for(&m.key, wanted, self.seed);
            if room.placed == 0 {
                let why = room.reason.unwrap_or_else(|| "no room".into());
                let field = cluster.missing_hardware(&m.key).map_or("size", |r| r.field());
                return Err(FieldError::new(
                    format!("models[{i}].{field}"),
                    format!("`{}` ({}) fits on no node: {why}", m.key, m.size),
                ));
            }
            if room.placed < wanted {
                return Err(FieldError::new(
                    format!("models[{i}].min_replicas"),
                    format!(
                        "{wanted} replicas of `{}` are wanted, but the nodes can hold at most {} even with nothing else on them",
                        m.key, room.placed
                    ),
                ));
            }
        }
        Ok(())
    }
}
