//! Typed errors, one enum per operation, each naming what was wrong and where.

use hangar_core::{ModelKey, ReplicaId};

use crate::deployment::{Level, NodeId};

/// A [`ClusterConfig`](crate::ClusterConfig) that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A policy knob is out of range.
    #[error("placement.{field}: {why}")]
    Placement {
        /// The knob.
        field: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// A node's declaration is unusable.
    #[error("nodes[{index}].{field} (node `{node}`): {why}")]
    Node {
        /// Position in the node list.
        index: usize,
        /// The node's id.
        node: String,
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// Two nodes share an id.
    #[error("nodes[{second}].id: node `{id}` is already declared at nodes[{first}]")]
    DuplicateNode {
        /// The repeated id.
        id: NodeId,
        /// Where it first appears.
        first: usize,
        /// Where it appears again.
        second: usize,
    },
    /// A model's size cannot be worked out.
    #[error("models.\"{model}\": {why}")]
    Model {
        /// The model key.
        model: String,
        /// What is wrong with its spec.
        why: String,
    },
}

/// A node could not join a running cluster
/// ([`Cluster::add_node`](crate::Cluster::add_node)). The cluster is
/// unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddNodeError {
    /// A node with this id is already in the cluster. Two nodes under one
    /// name would make every deployment's `node` ambiguous, so a node that
    /// comes back (an agent restarting) must be removed first.
    #[error("node `{0}` is already in the cluster; remove it before adding it again")]
    Duplicate(NodeId),
    /// The node's declaration is unusable, by the same rules as a node in
    /// the cluster's config.
    #[error("node `{node}`: {field}: {why}")]
    Invalid {
        /// The node's id.
        node: NodeId,
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        why: String,
    },
}

/// Registering an existing deployment (at start-up, or from a scenario) failed.
/// The cluster is unchanged.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RestoreError {
    /// The model is not in the catalogue.
    #[error("unknown model `{0}`")]
    UnknownModel(ModelKey),
    /// The node is not in the cluster.
    #[error("unknown node `{0}`")]
    UnknownNode(NodeId),
    /// The replica id is already tracked.
    #[error("replica id {0} is already in use")]
    DuplicateReplica(ReplicaId),
    /// Only hot and warm deployments are tracked.
    #[error("level {0} cannot be registered; a cold replica is simply absent")]
    Cold(Level),
    /// Warm deployments hold no GPUs.
    #[error("a warm deployment holds no GPUs; drop `gpus`")]
    WarmWithGpus,
    /// A GPU index past the node's GPUs.
    #[error("node `{node}` has {count} GPUs; there is no GPU {gpu}")]
    NoSuchGpu {
        /// The node.
        node: NodeId,
        /// The index asked for.
        gpu: u32,
        /// How many GPUs the node has.
        count: usize,
    },
    /// The model needs a different number of GPUs than listed.
    #[error("the model needs {needs} GPU(s) on node `{node}`, {given} listed")]
    GpuCount {
        /// The node.
        node: NodeId,
        /// GPUs the sizing rules give.
        needs: u32,
        /// GPUs listed.
        given: usize,
    },
    /// The GPUs listed cannot hold the reservation.
    #[error("GPU {gpu} of node `{node}` has {free} bytes free, {need} needed{whole}", whole = if *.whole { " (a whole-GPU claim needs it empty)" } else { "" })]
    GpuFull {
        /// The node.
        node: NodeId,
        /// The GPU.
        gpu: u32,
        /// Bytes needed on it.
        need: u64,
        /// Bytes free on it.
        free: u64,
        /// Whether the claim was for the whole GPU.
        whole: bool,
    },
    /// No GPUs were listed and none are free enough on the node.
    #[error("node `{0}` has no free room for the model; list `gpus` or free some")]
    NoRoom(NodeId),
    /// The warm cache cannot hold the model.
    #[error("node `{node}` warm cache has {free} bytes free, {need} needed")]
    CacheFull {
        /// The node.
        node: NodeId,
        /// Bytes the model needs.
        need: u64,
        /// Bytes free in the cache.
        free: u64,
    },
}

/// Residency information named something the cluster does not know
/// ([`Cluster::set_model_artifact`](crate::Cluster::set_model_artifact),
/// [`Cluster::set_resident`](crate::Cluster::set_resident)). The cluster is
/// unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResidencyError {
    /// The model is not in the catalogue.
    #[error("unknown model `{0}`")]
    UnknownModel(ModelKey),
    /// The node is not in the cluster.
    #[error("unknown node `{0}`")]
    UnknownNode(NodeId),
}

/// Whether a model's engine can sleep was said of a model the cluster does
/// not know ([`Cluster::set_sleeps`](crate::Cluster::set_sleeps)). The
/// cluster is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SleepsError {
    /// The model is not in the catalogue.
    #[error("unknown model `{0}`")]
    UnknownModel(ModelKey),
}

/// An explicit eviction could not be carried out. The cluster is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EvictError {
    /// No such replica is hot or warm.
    #[error("replica {replica} of `{model}` is not deployed")]
    UnknownReplica {
        /// The model named.
        model: ModelKey,
        /// The replica named.
        replica: ReplicaId,
    },
    /// The replica exists but serves another model.
    #[error("replica {replica} serves `{actual}`, not `{model}`")]
    WrongModel {
        /// The model named.
        model: ModelKey,
        /// The replica named.
        replica: ReplicaId,
        /// The model it actually serves.
        actual: ModelKey,
    },
}

/// A [`DeploymentDelta`](crate::DeploymentDelta) cannot express, or be
/// applied to, the states given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeltaError {
    /// A change no placement operation makes (e.g. a replica appearing warm,
    /// or moving between nodes while warm).
    #[error("replica {replica} goes from {from} to {to}, which no delta step expresses")]
    Inexpressible {
        /// The replica.
        replica: ReplicaId,
        /// Its old place, e.g. `HOT on node-a`, or `absent`.
        from: String,
        /// Its new place.
        to: String,
    },
    /// Applying a step found the state not as the step expects.
    #[error("cannot apply {step} of replica {replica}: {why}")]
    Mismatch {
        /// The step kind.
        step: &'static str,
        /// The replica.
        replica: ReplicaId,
        /// What the state held instead.
        why: String,
    },
}

/// A dedicated schedule window that makes no sense.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("schedule[{index}] (`{model}`): {why}")]
pub struct ScheduleError {
    /// Position of the window.
    pub index: usize,
    /// Its model.
    pub model: ModelKey,
    /// What is wrong.
    pub why: String,
}

/// A node named for draining is not in the cluster
/// ([`Cluster::set_draining`](crate::Cluster::set_draining)). The cluster is
/// unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DrainError {
    /// The node is not in the cluster.
    #[error("unknown node `{0}`")]
    UnknownNode(NodeId),
}
