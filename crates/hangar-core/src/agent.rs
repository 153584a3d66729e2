//! The node agent protocol: what a `hangar agent` tells the fleet about
//! its machine. The substrate that carries it (Redis today) is
//! `hangar-redis`'s concern; these are only the words.

use serde::{Deserialize, Serialize};

use crate::ByteSize;

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
