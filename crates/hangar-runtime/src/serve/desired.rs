//! What placement wants on each node, in the agent protocol's words: the
//! controller's deployment deltas folded into one [`DesiredState`] per
//! node. A single machine's control task hands a node's state to its
//! lifecycle driver; a fleet's leader writes it to Redis for the node's
//! agent. Either way a node is told the whole of what it should run,
//! never a step — so a lost or repeated message changes nothing.

use std::collections::BTreeMap;

use hangar_core::{DesiredReplica, DesiredState, ReplicaId};
use hangar_placement::{Action, Deployment, DeploymentDelta, Level};

/// Every node's desired state.
#[derive(Debug, Clone, Default)]
pub(crate) struct DesiredBook {
    states: BTreeMap<String, DesiredState>,
}

impl DesiredBook {
    /// Folds `delta` in; returns the nodes whose state changed, in order.
    pub fn apply(&mut self, delta: &DeploymentDelta) -> Vec<String> {
        let mut touched = Vec::new();
        for step in delta.steps() {
            let d = step.deployment;
            let node = d.node.to_string();
            let state = self.states.entry(node.clone()).or_default();
            state.replicas.retain(|r| r.replica != d.replica_id);
            if !matches!(step.action, Action::Delete) {
                state.replicas.push(desired(d));
            }
            if !touched.contains(&node) {
                touched.push(node);
            }
        }
        touched
    }

    /// `node`'s desired state (empty if it has none).
    pub fn get(&self, node: &str) -> DesiredState {
        self.states.get(node).cloned().unwrap_or_default()
    }

    /// Replaces `node`'s desired state.
    pub fn set(&mut self, node: &str, state: DesiredState) {
        self.states.insert(node.to_owned(), state);
    }

    /// Forgets `node` (it is lost).
    pub fn remove(&mut self, node: &str) {
        self.states.remove(node);
    }

    /// Whether `replica` is wanted on `node`: `Some(warm)` if it is.
    pub fn wants(&self, node: &str, replica: ReplicaId) -> Option<bool> {
        self.states.get(node)?.replicas.iter().find(|r| r.replica == replica).map(|r| r.warm)
    }

    /// Every node's state.
    pub fn states(&self) -> &BTreeMap<String, DesiredState> {
        &self.states
    }
}

/// A deployment as a node's desired replica.
pub(crate) fn desired(d: &Deployment) -> DesiredReplica {
    DesiredReplica {
        replica: d.replica_id,
        model: d.model_key.clone(),
        warm: d.level != Level::Hot,
        gpus: d.gpu_bytes_by_gpu.clone(),
        gpu_fraction: d.gpu_fraction,
        dedicated: d.dedicated,
    }
}
