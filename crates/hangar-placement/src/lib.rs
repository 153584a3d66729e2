//! Replica placement for Hangar: where each replica of each model runs.
//!
//! A [`Cluster`] holds [`Node`]s, each with GPUs of one size, hot
//! deployments (weights on GPUs) and a warm cache (weights in CPU memory).
//! It is a sans-IO state machine: commands take `now` on the caller's clock
//! and a seeded rng, mutate the state and return plain data; nothing here
//! reads a clock, sleeps or does I/O. The live controller (a tokio task) and
//! the simulator (a logical clock) drive the same code.
//!
//! * [`Cluster::deploy`] takes [`ReplicaRequest`]s and returns a
//!   [`DeployOutcome`]: per replica the [`CandidateLevel`] chosen (or why
//!   not), plus the [`Eviction`]s it caused. Within a level it spreads a
//!   model's replicas: the nodes holding the fewest of them come first.
//! * [`Cluster::candidates`] shows every node's [`Candidate`] for one more
//!   replica, without `deploy`'s shortcuts (diagnostics, and the oracle the
//!   property tests hold `deploy` to).
//! * [`Cluster::evict_replica`] / [`Cluster::evict_model`] demote on demand.
//! * [`Cluster::set_model_artifact`] / [`Cluster::set_resident`] say which
//!   weight artifact a model loads and which nodes hold which artifacts
//!   resident; among otherwise equal candidates `deploy` prefers a node
//!   that holds the model's artifact (it never beats a better level or a
//!   cheaper eviction set).
//! * [`Cluster::set_draining`] takes a node out of the candidates: nothing
//!   new lands there, what is demoted there goes COLD, and its HOT replicas
//!   stop counting towards their models' replicas, so `deploy` places
//!   replacements elsewhere before the caller stops them.
//! * [`Cluster::set_sleeps`] says whether a model's engine can sleep; one
//!   that cannot is demoted straight to COLD, taking no warm-cache room.
//! * The *hotswap tier* ([`ModelSpec::hotswap`]): its replicas share the
//!   GPUs the other models leave. Any other model's replica evicts one at
//!   any age; a hotswap replica evicts only other hotswap replicas, at
//!   least [`PlacementConfig::hotswap_min_age_ms`] old; a set of hotswap
//!   victims alone is preferred ([`EvictionCost::non_hotswap`]); their warm
//!   copies are the last a cache drops, and a hotswap replica woken from one
//!   is reported as a swap ([`ReplicaOutcome::swap`]).
//! * [`Cluster::add_node`] / [`Cluster::remove_node`] change the fleet while
//!   it runs: a node agent joins, or is lost with every replica it held.
//! * [`Cluster::apply_schedule`] turns a [`Schedule`] of dedicated windows
//!   into dedicated requests and frees what left it.
//! * [`DeploymentDelta::between`] two [`Snapshot`]s lists the `to_cache`,
//!   `delete`, `from_cache` and `create` steps a node agent applies in order.
//!
//! Sizing ([`Shape::for_model`]): a model that fits in one GPU gets
//! `gpu_fraction_factor × size` of one (or the whole GPU once that share
//! reaches `fraction_largest_possible` of it); a larger one gets
//! `ceil(size / GPU memory)` whole GPUs. Eviction picks the set that frees
//! enough with the least evicted bytes, then the fewest evictions
//! ([`eviction`] documents the exact search).
//!
//! ```
//! use hangar_placement::{CandidateLevel, Cluster, ClusterConfig, DeploymentDelta, ReplicaRequest};
//! use rand::SeedableRng;
//!
//! let config: ClusterConfig = toml::from_str(r#"
//!     [[nodes]]
//!     id = "gpu-01"
//!     gpus = 8
//!     gpu_memory = "80GB"
//!     cpu_cache = "256GB"
//!
//!     [models."meta/llama-3-8b"]
//!     parameters = "8B"
//! "#).unwrap();
//! let mut cluster = Cluster::new(config).unwrap();
//! let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
//!
//! let before = cluster.snapshot();
//! let request = ReplicaRequest { model_key: "meta/llama-3-8b".parse().unwrap(), replicas: 2, dedicated: false };
//! let outcome = cluster.deploy(&[request], 0, &mut rng);
//! assert!(outcome.models[0].replicas.iter().all(|r| r.level == CandidateLevel::Free));
//!
//! let delta = DeploymentDelta::between(&before, &cluster.snapshot()).unwrap();
//! assert_eq!(delta.create.len(), 2);
//! ```
#![deny(missing_docs)]

mod candidate;
mod cluster;
mod config;
mod delta;
mod deployment;
mod error;
pub mod eviction;
mod node;
mod outcome;
pub mod scenario;
mod schedule;
mod sizing;

pub use candidate::{Candidate, CandidateLevel, Shape};
pub use cluster::{Cluster, Restore};
pub use config::{ClusterConfig, NodeConfig, PlacementConfig, MAX_GPUS_PER_NODE, MAX_GPU_MEMORY};
pub use delta::{Action, DeploymentDelta, Snapshot, Step};
pub use deployment::{Deployment, Level, NodeId, NodeIdError};
pub use error::{
    AddNodeError, ConfigError, DeltaError, DrainError, EvictError, ResidencyError, RestoreError,
    ScheduleError, SleepsError,
};
pub use eviction::EvictionCost;
pub use node::{Gpu, Node, ReplicaMap};
pub use outcome::{
    DeployOutcome, Eviction, EvictionCause, Fit, ModelOutcome, ReplicaOutcome, ReplicaRequest, Unplaceable,
};
pub use schedule::{Schedule, Window};
pub use sizing::{Dtype, ModelSpec, ParamCount, ParamCountError, Requirement, DEFAULT_PADDING};
