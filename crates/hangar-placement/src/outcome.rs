//! What a placement command asks for and what it returns: plain data a
//! controller acts on and an operator reads.

use std::collections::BTreeMap;
use std::fmt;

use hangar_core::{ModelKey, ReplicaId};
use serde::{Deserialize, Serialize};

use crate::candidate::CandidateLevel;
use crate::deployment::{Level, NodeId};
use crate::eviction::EvictionCost;

/// "Keep `replicas` replicas of `model_key` hot."
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaRequest {
    /// The model.
    #[serde(rename = "model")]
    pub model_key: ModelKey,
    /// Hot replicas wanted (default 1). Deploy never scales down: extra hot
    /// replicas stay until evicted explicitly.
    #[serde(default = "one")]
    pub replicas: u32,
    /// Dedicated replicas are not evicted by pressure and may evict young
    /// non-dedicated ones.
    #[serde(default)]
    pub dedicated: bool,
}

fn one() -> u32 {
    1
}

/// Why a replica could not be placed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "reason")]
#[non_exhaustive]
pub enum Unplaceable {
    /// The model is not in the catalogue, so its size is unknown.
    UnknownModel,
    /// The cluster has no nodes.
    NoNodes,
    /// No node has a GPU (real or virtual).
    NoGpus,
    /// Every node has fewer GPUs than the model needs.
    TooLarge {
        /// The model's footprint.
        size_bytes: u64,
        /// GPUs it needs on the best-suited node.
        gpus_needed: u32,
        /// The most GPUs any node has.
        most_gpus_on_a_node: u32,
    },
    /// No node has the hardware the model requires.
    NoMatchingNode {
        /// What it requires, in words.
        requires: String,
    },
    /// Nodes are big enough, but the room is held by deployments that may not
    /// be evicted: dedicated ones, ones younger than `min_deployment_age_ms`
    /// (for non-dedicated requests), replicas of the same model, or replicas
    /// the same call placed or counted as deployed.
    NoRoom,
    /// [`Unplaceable::NoRoom`] for a hotswap model: nodes are big enough,
    /// but the room is held by what the tier may not evict — replicas of
    /// models outside it (the tier stands behind them), hotswap replicas
    /// younger than `hotswap_min_age_ms` (for non-dedicated requests), and
    /// the rest `NoRoom` lists.
    NoSwapRoom,
    /// Every node that could run it, with room or not, is draining
    /// ([`Cluster::set_draining`](crate::Cluster::set_draining)) or
    /// suspect ([`Cluster::set_suspect`](crate::Cluster::set_suspect)).
    Draining,
}

impl fmt::Display for Unplaceable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unplaceable::UnknownModel => f.write_str("the model is not in the catalogue"),
            Unplaceable::NoNodes => f.write_str("the cluster has no nodes"),
            Unplaceable::NoGpus => f.write_str("no node has a GPU"),
            Unplaceable::TooLarge { size_bytes, gpus_needed, most_gpus_on_a_node } => write!(
                f,
                "the model ({}) needs {gpus_needed} GPUs; the largest node has {most_gpus_on_a_node}",
                hangar_core::ByteSize::new(*size_bytes)
            ),
            Unplaceable::NoMatchingNode { requires } => write!(f, "no node has {requires}"),
            Unplaceable::NoRoom => {
                f.write_str("no room, and what holds it may not be evicted (dedicated or too young)")
            }
            Unplaceable::NoSwapRoom => f.write_str(
                "no room the hotswap tier may take: the rest is held by models outside the tier, \
                 dedicated replicas or hotswap replicas too young to swap out",
            ),
            Unplaceable::Draining => {
                f.write_str("every node that could run it is draining or not answering (suspect)")
            }
        }
    }
}

/// The fate of one replica in a deploy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaOutcome {
    /// The replica (absent when it could not be placed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_id: Option<ReplicaId>,
    /// Where it is hot now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeId>,
    /// The level of the candidate chosen, or `CantAccommodate`.
    pub level: CandidateLevel,
    /// GPU index → bytes reserved.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gpu_bytes_by_gpu: BTreeMap<u32, u64>,
    /// What placing it evicted (zero for all but `CachedAndFull` / `Full`).
    #[serde(default)]
    pub eviction_cost: EvictionCost,
    /// Why it could not be placed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<Unplaceable>,
    /// The start is a *swap*: a hotswap model's replica
    /// ([`ModelSpec::hotswap`](crate::ModelSpec::hotswap)) woken from the
    /// node's warm cache (`CachedAndFree` / `CachedAndFull`: a `from_cache`
    /// step, seconds), not loaded cold. A driver counts them apart from
    /// cold starts ([`DeployOutcome::swaps`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub swap: bool,
}

/// The result for one requested model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelOutcome {
    /// The model.
    pub model_key: ModelKey,
    /// Replicas requested.
    pub requested: u32,
    /// Whether the request was dedicated.
    pub dedicated: bool,
    /// Already-hot replicas (`Deployed`) first, then one entry per replica
    /// that was missing.
    pub replicas: Vec<ReplicaOutcome>,
}

impl ModelOutcome {
    /// Replicas hot after the deploy.
    pub fn hot(&self) -> usize {
        self.replicas.iter().filter(|r| r.level != CandidateLevel::CantAccommodate).count()
    }
}

/// Why a replica was evicted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
#[non_exhaustive]
pub enum EvictionCause {
    /// To make room for this replica.
    Pressure {
        /// The model placed.
        model_key: ModelKey,
        /// The replica placed.
        replica_id: ReplicaId,
    },
    /// An operator or controller asked.
    Explicit,
    /// Dropped from the warm cache to make room for this replica's weights.
    CacheRoom {
        /// The replica moving into the cache.
        replica_id: ReplicaId,
    },
}

impl fmt::Display for EvictionCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EvictionCause::Pressure { model_key, replica_id } => {
                write!(f, "room for {model_key}:{replica_id}")
            }
            EvictionCause::Explicit => f.write_str("explicit"),
            EvictionCause::CacheRoom { replica_id } => write!(f, "cache room for {replica_id}"),
        }
    }
}

/// One replica demoted: HOT → WARM, HOT → COLD or WARM → COLD.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Eviction {
    /// Its model.
    pub model_key: ModelKey,
    /// The replica.
    pub replica_id: ReplicaId,
    /// The node that held it.
    pub node: NodeId,
    /// Level before.
    pub from: Level,
    /// Level after.
    pub to: Level,
    /// Why.
    pub cause: EvictionCause,
}

/// What [`Cluster::room_for`](crate::Cluster::room_for) found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fit {
    /// Replicas that could be placed.
    pub placed: u32,
    /// Why one could not, if one could not.
    pub reason: Option<String>,
}

/// What [`Cluster::deploy`](crate::Cluster::deploy) did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DeployOutcome {
    /// One entry per requested model, largest model first.
    pub models: Vec<ModelOutcome>,
    /// Every replica demoted on the way, in order.
    pub evictions: Vec<Eviction>,
    /// Whether the cluster state changed (a placement, an eviction or a
    /// dedicated flag); if not, there is no delta to apply.
    pub changed: bool,
}

impl DeployOutcome {
    /// How many of the replicas placed are swaps
    /// ([`ReplicaOutcome::swap`]): hotswap replicas woken from a warm
    /// cache rather than loaded.
    pub fn swaps(&self) -> usize {
        self.models.iter().flat_map(|m| &m.replicas).filter(|r| r.swap).count()
    }
}
