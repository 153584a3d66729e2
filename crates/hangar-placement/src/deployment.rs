//! What a replica is and where it lives: [`NodeId`], [`Level`] and the
//! per-replica record [`Deployment`].

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use hangar_core::{Millis, ModelKey, ReplicaId};
use serde::{Deserialize, Serialize};

/// A worker node's name, e.g. `gpu-node-07`: ASCII letters, digits and
/// `._-`, at most 128 bytes, so it can go into logs and metric labels as is.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NodeId(String);

/// Why a string is not a valid [`NodeId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("node id `{0}` must be 1 to 128 ASCII letters, digits, `.`, `_` or `-`")]
pub struct NodeIdError(String);

impl NodeId {
    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for NodeId {
    type Err = NodeIdError;
    fn from_str(s: &str) -> Result<Self, NodeIdError> {
        let ok = !s.is_empty()
            && s.len() <= 128
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if ok {
            Ok(Self(s.to_owned()))
        } else {
            Err(NodeIdError(s.to_owned()))
        }
    }
}

impl TryFrom<String> for NodeId {
    type Error = NodeIdError;
    fn try_from(s: String) -> Result<Self, NodeIdError> {
        s.parse()
    }
}

impl From<NodeId> for String {
    fn from(id: NodeId) -> String {
        id.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How ready a replica is to serve.
///
/// * `Hot`: weights on GPUs, serving.
/// * `Warm`: weights in the node's CPU memory (the warm cache); promoting it
///   back to `Hot` on the same node skips the load from storage.
/// * `Cold`: nowhere; the cluster no longer tracks it. Only eviction records
///   carry this level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// On GPUs, serving.
    Hot,
    /// In the node's CPU warm cache.
    Warm,
    /// Not held anywhere.
    Cold,
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Level::Hot => "HOT",
            Level::Warm => "WARM",
            Level::Cold => "COLD",
        })
    }
}

/// One replica of one model on one node.
///
/// Invariants the [`Cluster`](crate::Cluster) keeps: a `Hot` deployment has
/// `gpu_bytes_by_gpu` non-empty and `gpu_fraction` set; a `Warm` one has
/// neither (its weights are in CPU memory and count `size_bytes` against the
/// node's cache budget).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Deployment {
    /// The model this replica serves.
    pub model_key: ModelKey,
    /// Cluster-wide unique, opaque replica id.
    pub replica_id: ReplicaId,
    /// The node holding it.
    pub node: NodeId,
    /// `Hot` or `Warm` while tracked.
    pub level: Level,
    /// GPU index on the node → bytes reserved there (empty unless hot).
    pub gpu_bytes_by_gpu: BTreeMap<u32, u64>,
    /// The share of each claimed GPU's memory the replica may use (for
    /// `torch.cuda.set_per_process_memory_fraction` and friends): below 1 for
    /// a fractional share, 1 for whole GPUs, `None` unless hot.
    pub gpu_fraction: Option<f64>,
    /// The model's footprint: what the warm cache holds for it.
    pub size_bytes: u64,
    /// Dedicated (scheduled) deployments are never evicted by pressure.
    pub dedicated: bool,
    /// When it last became hot (or was registered), on the caller's clock.
    pub deployed_at_ms: Millis,
}

impl Deployment {
    /// The replica's name as logs, metrics and actors spell it:
    /// `<model_key>:<replica_id>`.
    pub fn name(&self) -> String {
        format!("{}:{}", self.model_key, self.replica_id)
    }

    /// GPU bytes the deployment reserves across all its GPUs.
    pub fn gpu_bytes(&self) -> u64 {
        self.gpu_bytes_by_gpu.values().sum()
    }
}
