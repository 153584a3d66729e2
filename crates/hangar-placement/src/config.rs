//! Configuration: the policy knobs ([`PlacementConfig`]), the fleet
//! ([`NodeConfig`]) and the model catalogue, validated at load.

use std::collections::BTreeMap;

use hangar_core::{ByteSize, Millis, ModelKey};
use serde::{Deserialize, Serialize};

use crate::deployment::NodeId;
use crate::error::ConfigError;
use crate::node::Node;
use crate::sizing::ModelSpec;

/// Most GPUs one node may declare. Eight is a DGX, sixteen an HGX-2; the limit keeps the
/// whole-GPU eviction search (a choice of k GPUs out of n) small.
pub const MAX_GPUS_PER_NODE: u32 = 16;

/// Most memory one GPU may declare (1 PB): keeps every byte sum over a
/// node's GPUs far from overflow.
pub const MAX_GPU_MEMORY: u64 = 1_000_000_000_000_000;

/// Policy knobs, every one with the reference deployment's default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlacementConfig {
    /// A model that fits in one GPU reserves `gpu_fraction_factor × size`
    /// of it (room for activations and KV cache). Default 3.0.
    pub gpu_fraction_factor: f64,
    /// …unless that share reaches `fraction_largest_possible × GPU memory`,
    /// in which case it takes the whole GPU. Default 0.8.
    pub fraction_largest_possible: f64,
    /// A GPU takes a fractional tenant only while at least this fraction of
    /// it is free. Default 0.3.
    pub min_available_gpu_fraction: f64,
    /// A non-dedicated request may not evict a deployment younger than this
    /// (milliseconds). Default one hour. Dedicated requests may. It guards
    /// the models that hold their own replicas from one another; a hotswap
    /// model's replica ([`ModelSpec::hotswap`]) has no such guard against
    /// them: it yields at once.
    pub min_deployment_age_ms: Millis,
    /// A non-dedicated request for a hotswap model's replica may not evict
    /// another hotswap model's replica younger than this (milliseconds).
    /// Default one minute. Short, because a swap is cheap (the evicted
    /// replica goes WARM and wakes in seconds): an hour-long guard would
    /// starve a second hotswap model with waiting requests the way
    /// `min_deployment_age_ms` does. Not zero, because two hotswap models
    /// wanting the one GPU would then take it from each other on every
    /// placement, each paying a wake per request; a minute lets a swapped-in
    /// model serve its queue first.
    pub hotswap_min_age_ms: Millis,
}

impl Default for PlacementConfig {
    fn default() -> Self {
        Self {
            gpu_fraction_factor: 3.0,
            fraction_largest_possible: 0.8,
            min_available_gpu_fraction: 0.3,
            min_deployment_age_ms: 3_600_000,
            hotswap_min_age_ms: 60_000,
        }
    }
}

impl PlacementConfig {
    /// Checks every knob is in range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &'static str, why: String| Err(ConfigError::Placement { field, why });
        if !(self.gpu_fraction_factor.is_finite() && self.gpu_fraction_factor >= 1.0) {
            return bad("gpu_fraction_factor", format!("{} must be at least 1", self.gpu_fraction_factor));
        }
        for (field, v) in [
            ("fraction_largest_possible", self.fraction_largest_possible),
            ("min_available_gpu_fraction", self.min_available_gpu_fraction),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= 1.0) {
                return bad(field, format!("{v} must be above 0 and at most 1"));
            }
        }
        Ok(())
    }
}

/// One worker node.
///
/// ```toml
/// [[nodes]]
/// id = "gpu-01"
/// gpus = 8
/// gpu_memory = "80GB"
/// gpu_kind = "H100"
/// cpu_cache = "512GB"   # warm-cache budget in CPU memory
///
/// [[nodes]]             # a laptop: no GPU, two virtual ones carved from RAM
/// id = "laptop"
/// gpus = 2
/// gpu_memory = "16GB"
/// virtual_gpus = true
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// The node's name.
    pub id: NodeId,
    /// How many GPUs (all alike). Zero is allowed: the node hosts nothing.
    #[serde(default)]
    pub gpus: u32,
    /// Memory of each GPU; required when `gpus` is above zero.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<ByteSize>,
    /// A label for the GPU model (default `gpu`, or `virtual`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_kind: Option<String>,
    /// The GPUs are virtual: slots of host memory accounted like GPUs, for
    /// machines without accelerators (the mock engine, laptops, CI).
    #[serde(default)]
    pub virtual_gpus: bool,
    /// CPU memory set aside for the warm cache (default 0: no warm cache).
    #[serde(default)]
    pub cpu_cache: ByteSize,
}

impl NodeConfig {
    /// The per-GPU memory in bytes, after validation. The error says what
    /// is wrong but not where the node was declared: a node from a config
    /// file is named by its position, one that joins later by its id, so
    /// each caller wraps it ([`BadNode`]).
    pub(crate) fn validated_gpu_memory(&self) -> Result<u64, BadNode> {
        let bad = |field: &'static str, why: String| Err(BadNode { field, why });
        if self.gpus > MAX_GPUS_PER_NODE {
            return bad(
                "gpus",
                format!("{} is more than the {MAX_GPUS_PER_NODE} a node may have", self.gpus),
            );
        }
        match (self.gpus, self.gpu_memory) {
            (0, _) => Ok(0),
            (_, None) => bad("gpu_memory", "is required when `gpus` is above 0 (e.g. \"80GB\")".into()),
            (_, Some(m)) if m.bytes() == 0 => bad("gpu_memory", "must be above 0".into()),
            (_, Some(m)) if m.bytes() > MAX_GPU_MEMORY => bad("gpu_memory", format!("{m} is more than 1 PB")),
            (_, Some(m)) => Ok(m.bytes()),
        }
    }

    /// The empty node this declares, or what is wrong with it: the one
    /// path by which a node enters a cluster, whether from its config or
    /// joining later, so both are held to the same rules.
    pub(crate) fn to_node(&self) -> Result<Node, BadNode> {
        let gpu_memory = self.validated_gpu_memory()?;
        Ok(Node::new(self.id.clone(), self.gpus, gpu_memory, self.kind(), self.cpu_cache.bytes()))
    }

    /// The GPU kind label.
    fn kind(&self) -> String {
        match (&self.gpu_kind, self.virtual_gpus) {
            (Some(k), _) => k.clone(),
            (None, true) => "virtual".to_owned(),
            (None, false) => "gpu".to_owned(),
        }
    }
}

/// One field of a node's declaration that [`Cluster::new`] and
/// [`Cluster::add_node`] both refuse, before it is known whether the node
/// came from a config file (named by position) or joined later (named by
/// id): the one set of node rules, worded by each caller.
///
/// [`Cluster::new`]: crate::Cluster::new
/// [`Cluster::add_node`]: crate::Cluster::add_node
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadNode {
    /// The offending field.
    pub(crate) field: &'static str,
    /// What is wrong with it.
    pub(crate) why: String,
}

/// Everything a [`Cluster`](crate::Cluster) is built from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Policy knobs.
    #[serde(default)]
    pub placement: PlacementConfig,
    /// The fleet.
    #[serde(default)]
    pub nodes: Vec<NodeConfig>,
    /// The model catalogue: key → size.
    #[serde(default)]
    pub models: BTreeMap<ModelKey, ModelSpec>,
}
