//! Helpers shared by the integration tests: small clusters written as TOML.

#![allow(dead_code)]

use hangar_core::{ModelKey, ReplicaId};
use hangar_placement::{
    Candidate, CandidateLevel, Cluster, ClusterConfig, DeploymentDelta, Level, ReplicaOutcome,
    ReplicaRequest, Restore, Snapshot,
};
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

/// Deploys one more replica of `model`, alone, and holds where it went to
/// every node's [`Cluster::candidates`] taken just before (no shortcuts):
/// the lowest level; at that level the fewest HOT replicas of the model
/// (spread); among those the cheapest eviction set, on a node that offers
/// it. Returns the candidates and what the deploy did with the replica;
/// `Err` says which rule was broken.
pub fn grow_one_checked(
    c: &mut Cluster,
    model: &ModelKey,
    dedicated: bool,
    now: u64,
    rng: &mut ChaCha8Rng,
) -> Result<(Vec<Candidate>, ReplicaOutcome), String> {
    let candidates = c.candidates(model, dedicated, now);
    if candidates.len() != c.nodes().len() {
        return Err(format!("{} candidates for {} nodes", candidates.len(), c.nodes().len()));
    }
    // One more than it has off draining nodes: what `deploy` counts.
    let hot = c.count_staying(model) as u32;
    for level in [Level::Hot, Level::Warm] {
        let (counted, listed) = (c.count_of(model, level), c.replicas_of(model, level).len());
        if counted != listed {
            return Err(format!("count_of says {counted} {level} replicas, replicas_of lists {listed}"));
        }
    }
    let request = ReplicaRequest { model_key: model.clone(), replicas: hot + 1, dedicated };
    let out = c.deploy(&[request], now, rng);
    let placed = out.models[0].replicas.last().expect("one replica asked").clone();
    let best = candidates.iter().map(|c| c.level).min().unwrap_or(CandidateLevel::CantAccommodate);
    if placed.level != best {
        return Err(format!("placed at {} while the best level was {best}", placed.level));
    }
    if best == CandidateLevel::CantAccommodate {
        return Ok((candidates, placed));
    }
    let at_best = candidates.iter().filter(|c| c.level == best);
    let fewest = at_best.clone().map(|c| c.hot_replicas).min().expect("some candidate is at the best level");
    let spread: Vec<&Candidate> = at_best.filter(|c| c.hot_replicas == fewest).collect();
    let cost = spread.iter().map(|c| c.eviction_cost).min().expect("not empty");
    if placed.eviction_cost != cost {
        return Err(format!("evicted {:?} where {cost:?} would do", placed.eviction_cost));
    }
    let chosen = spread.iter().any(|c| c.eviction_cost == cost && Some(&c.node) == placed.node.as_ref());
    if !chosen {
        let on = placed.node.as_ref().and_then(|n| candidates.iter().find(|c| &c.node == n));
        return Err(format!(
            "placed on {:?} (holding {:?} HOT replicas) while nodes at {best} held {fewest}",
            placed.node,
            on.map(|c| c.hot_replicas)
        ));
    }
    Ok((candidates, placed))
}

/// Runs `test` on `cases` values drawn from `strategy`, as `proptest!`
/// does (a failing case is shrunk, then reported by a panic naming the
/// smallest input), and returns the sum of what the cases returned: how
/// many checks meant something, for a test to assert that its
/// precondition was not vacuous.
pub fn run_counting<S: proptest::strategy::Strategy>(
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<usize, proptest::test_runner::TestCaseError>,
) -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let counted = AtomicUsize::new(0);
    let config = proptest::test_runner::Config { cases, ..Default::default() };
    let result = proptest::test_runner::TestRunner::new(config).run(&strategy, |value| {
        counted.fetch_add(test(value)?, Ordering::Relaxed);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    counted.into_inner()
}
