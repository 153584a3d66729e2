//! How a node could take a replica: the [`CandidateLevel`] ladder and the
//! [`Shape`] of the reservation the sizing rules give.

use std::collections::BTreeMap;
use std::fmt;

use hangar_core::{ModelKey, ReplicaId};
use serde::{Deserialize, Serialize};

use crate::config::PlacementConfig;
use crate::deployment::NodeId;
use crate::eviction::EvictionCost;

/// One node's answer to "could you host one more replica of this model?",
/// from [`Cluster::candidates`](crate::Cluster::candidates).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    /// The node.
    pub node: NodeId,
    /// How good it is; `CantAccommodate` when it cannot host the replica.
    pub level: CandidateLevel,
    /// The warm replica that would be promoted (`Cached*` levels).
    pub warm_replica: Option<ReplicaId>,
    /// GPU index → bytes the replica would reserve.
    pub gpu_bytes_by_gpu: BTreeMap<u32, u64>,
    /// The cheapest set to evict first (`*Full` levels).
    pub evictions: Vec<(ModelKey, ReplicaId)>,
    /// What that set costs.
    pub eviction_cost: EvictionCost,
    /// HOT replicas of the model already on the node. Among candidates of
    /// the same level, `deploy` prefers the fewest (spread: one node's loss
    /// takes out as few of the model's replicas as it can) before comparing
    /// eviction costs. WARM copies do not count: a node holding one is
    /// already a better level (`Cached*`).
    pub hot_replicas: u32,
    /// Whether the node holds the model's weight artifact resident (false
    /// when the model has no artifact set). Among candidates of the same
    /// level, HOT replica count and eviction cost, `deploy` prefers
    /// resident ones.
    pub resident: bool,
}

/// How good a node is for a replica; lower is better, and the derived order
/// is the preference order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum CandidateLevel {
    /// The replica is already hot there; nothing to do.
    Deployed,
    /// A warm copy of the replica is there and room is free: promote it.
    CachedAndFree,
    /// Room is free: create the replica there.
    Free,
    /// A warm copy is there but promoting it needs evictions.
    CachedAndFull,
    /// Creating the replica there needs evictions.
    Full,
    /// No node can take the replica, even by evicting.
    CantAccommodate,
}

impl fmt::Display for CandidateLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CandidateLevel::Deployed => "DEPLOYED",
            CandidateLevel::CachedAndFree => "CACHED_AND_FREE",
            CandidateLevel::Free => "FREE",
            CandidateLevel::CachedAndFull => "CACHED_AND_FULL",
            CandidateLevel::Full => "FULL",
            CandidateLevel::CantAccommodate => "CANT_ACCOMMODATE",
        })
    }
}

/// The reservation a model of a given size needs on a node whose GPUs all
/// have `gpu_memory` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// A fractional share of one GPU: `bytes` reserved, on a GPU that has at
    /// least `need_free` bytes free (the share, or the availability floor
    /// `min_available_gpu_fraction × GPU memory` if that is larger).
    Share {
        /// Bytes reserved.
        bytes: u64,
        /// Free bytes the GPU must have to take the share.
        need_free: u64,
    },
    /// `gpus` whole GPUs, each with no other tenant.
    Whole {
        /// How many.
        gpus: u32,
    },
}

impl Shape {
    /// The sizing rules:
    ///
    /// * a model no larger than one GPU gets `gpu_fraction_factor × size` of
    ///   one GPU when that is below `fraction_largest_possible × GPU memory`,
    ///   otherwise the whole GPU;
    /// * a larger model gets `ceil(size / GPU memory)` whole GPUs (an exact
    ///   multiple needs no extra GPU).
    ///
    /// `None` when the node has no GPUs.
    pub fn for_model(config: &PlacementConfig, size: u64, gpu_memory: u64) -> Option<Self> {
        if gpu_memory == 0 {
            return None;
        }
        if size > gpu_memory {
            let gpus = u32::try_from(size.div_ceil(gpu_memory)).unwrap_or(u32::MAX);
            return Some(Shape::Whole { gpus });
        }
        let share = (config.gpu_fraction_factor * size as f64).ceil();
        if share < config.fraction_largest_possible * gpu_memory as f64 {
            let floor = (config.min_available_gpu_fraction * gpu_memory as f64).ceil() as u64;
            let bytes = share as u64;
            Some(Shape::Share { bytes, need_free: bytes.max(floor) })
        } else {
            Some(Shape::Whole { gpus: 1 })
        }
    }

    /// GPUs the shape occupies.
    pub fn gpu_count(self) -> u32 {
        match self {
            Shape::Share { .. } => 1,
            Shape::Whole { gpus } => gpus,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    #[test]
    fn small_models_get_a_share_with_the_availability_floor() {
        let c = PlacementConfig::default();
        // 20 GB × 3 = 60 GB < 64 GB (0.8 × 80): a share.
        assert_eq!(
            Shape::for_model(&c, 20 * GB, 80 * GB),
            Some(Shape::Share { bytes: 60 * GB, need_free: 60 * GB })
        );
        // 2 GB × 3 = 6 GB, but a GPU must have 24 GB (0.3 × 80) free to take it.
        assert_eq!(
            Shape::for_model(&c, 2 * GB, 80 * GB),
            Some(Shape::Share { bytes: 6 * GB, need_free: 24 * GB })
        );
    }

    #[test]
    fn mid_models_take_a_whole_gpu_and_large_ones_several() {
        let c = PlacementConfig::default();
        // 22 GB × 3 = 66 GB ≥ 64 GB: the whole GPU.
        assert_eq!(Shape::for_model(&c, 22 * GB, 80 * GB), Some(Shape::Whole { gpus: 1 }));
        assert_eq!(Shape::for_model(&c, 80 * GB, 80 * GB), Some(Shape::Whole { gpus: 1 }));
        // Exact multiple: no extra GPU.
        assert_eq!(Shape::for_model(&c, 160 * GB, 80 * GB), Some(Shape::Whole { gpus: 2 }));
        assert_eq!(Shape::for_model(&c, 160 * GB + 1, 80 * GB), Some(Shape::Whole { gpus: 3 }));
        assert_eq!(Shape::for_model(&c, GB, 0), None);
    }

    #[test]
    fn levels_order_as_the_ladder() {
        use CandidateLevel::*;
        let mut v = vec![CantAccommodate, Full, CachedAndFull, Free, CachedAndFree, Deployed];
        v.sort();
        assert_eq!(v, vec![Deployed, CachedAndFree, Free, CachedAndFull, Full, CantAccommodate]);
    }
}
