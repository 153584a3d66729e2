//! Helpers shared by the integration tests: small clusters written as TOML.

#![allow(dead_code)]

use hangar_core::{ModelKey, ReplicaId};
use hangar_placement::{Cluster, ClusterConfig, DeploymentDelta, Level, ReplicaRequest, Restore, Snapshot};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

pub const GB: u64 = 1_000_000_000;
pub const HOUR: u64 = 3_600_000;

pub fn cluster(toml_text: &str) -> Cluster {
    let config: ClusterConfig = toml::from_str(toml_text).expect("test config parses");
    Cluster::new(config).expect("test config is valid")
}

/// TOML for one node of `gpus` × 80 GB GPUs and `cpu_cache` of warm cache.
pub fn node(id: &str, gpus: u32, cpu_cache: &str) -> String {
    format!("[[nodes]]\nid = \"{id}\"\ngpus = {gpus}\ngpu_memory = \"80GB\"\ncpu_cache = \"{cpu_cache}\"\n")
}

pub fn rng() -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(42)
}

pub fn key(s: &str) -> ModelKey {
    s.parse().unwrap()
}

pub fn rid(n: u128) -> ReplicaId {
    ReplicaId::from_u128(n)
}

pub fn req(model: &str, replicas: u32) -> ReplicaRequest {
    ReplicaRequest { model_key: key(model), replicas, dedicated: false }
}

pub fn dedicated(model: &str, replicas: u32) -> ReplicaRequest {
    ReplicaRequest { model_key: key(model), replicas, dedicated: true }
}

/// Registers a hot deployment on the listed GPUs, deployed at time 0.
pub fn hot(c: &mut Cluster, model: &str, id: u128, node: &str, gpus: &[u32]) -> ReplicaId {
    c.restore(Restore {
        model_key: key(model),
        replica_id: rid(id),
        node: node.parse().unwrap(),
        level: Level::Hot,
        gpus: Some(gpus.to_vec()),
        dedicated: false,
        deployed_at_ms: 0,
    })
    .expect("test deployment fits")
}

/// Registers a warm deployment.
pub fn warm(c: &mut Cluster, model: &str, id: u128, node: &str) -> ReplicaId {
    c.restore(Restore {
        model_key: key(model),
        replica_id: rid(id),
        node: node.parse().unwrap(),
        level: Level::Warm,
        gpus: None,
        dedicated: false,
        deployed_at_ms: 0,
    })
    .expect("test deployment fits")
}

/// Asserts the delta between two states applies back to the new one.
pub fn assert_delta_round_trips(old: &Snapshot, new: &Snapshot) -> DeploymentDelta {
    let delta = DeploymentDelta::between(old, new).expect("expressible");
    let mut replay = old.clone();
    delta.apply(&mut replay).expect("applies");
    assert_eq!(&replay, new);
    delta
}
