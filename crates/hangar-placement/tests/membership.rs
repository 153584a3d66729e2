//! Nodes that join and leave a running cluster: `add_node` and
//! `remove_node`, alone and mixed at random with deploys (each replica's
//! node held to the candidates, spread included) and evictions.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;
use hangar_core::{ByteSize, ModelKey, ReplicaId};
use hangar_placement::{
    AddNodeError, CandidateLevel, Cluster, ClusterConfig, Deployment, DeploymentDelta, Level, ModelSpec,
    NodeConfig, NodeId, ReplicaRequest, Snapshot,
};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn node_id(i: usize) -> NodeId {
    format!("n{i}").parse().unwrap()
}

fn model_key(i: usize) -> ModelKey {
    key(&format!("m{i}"))
}

/// A node of `gpus` GPUs of `gpu_gb` GB each, of `kind`, with `cache_gb` of
/// warm cache.
fn node_config(id: &NodeId, gpus: u32, gpu_gb: u64, kind: &str, cache_gb: u64) -> NodeConfig {
    NodeConfig {
        id: id.clone(),
        gpus,
        gpu_memory: Some(ByteSize::new(gpu_gb * GB)),
        gpu_kind: Some(kind.to_owned()),
        virtual_gpus: false,
        cpu_cache: ByteSize::new(cache_gb * GB),
    }
}

/// A node's description: GPUs, GB per GPU, kind, warm cache GB.
type Spec = (u32, u64, &'static str, u64);

#[derive(Debug, Clone)]
enum Op {
    /// A node joins under id `n{0}` (refused if that id is in the cluster).
    Join(usize, Spec),
    /// A node joins with a declaration `Cluster::new` would refuse.
    JoinInvalid(usize, bool),
    /// Node `n{0}` is lost (nothing happens if it is not in the cluster).
    Lose(usize),
    /// Node `n{0}` reports a weight artifact resident.
    Resident(usize),
    Deploy(Vec<(usize, u32, bool)>),
    /// One more replica of one model, held to every node's candidates.
    Grow(usize, bool),
    EvictReplica(usize),
    EvictModel(usize),
    Advance(u64),
}

#[derive(Debug, Clone)]
struct World {
    nodes: Vec<Spec>,
    models: Vec<u64>,
    ops: Vec<Op>,
    seed: u64,
}

const NODE_IDS: usize = 6;

fn spec() -> impl Strategy<Value = Spec> {
    (
        0u32..5,
        prop::sample::select(vec![24u64, 40, 80]),
        prop::sample::select(vec!["gpu", "h100"]),
        prop::sample::select(vec![0u64, 30, 100, 400]),
    )
}

/// A fleet of up to four nodes (`n0`…), models up to 100 GB (model 0 needs
/// `h100` GPUs, so where it may run changes as nodes come and go), and
/// operations drawn from a small pool of node ids so that ids are reused:
/// joins that collide, losses of nodes that are gone, nodes that rejoin.
fn world() -> impl Strategy<Value = World> {
    let nodes = prop::collection::vec(spec(), 0..4);
    let models = prop::collection::vec(1u64..100, 1..6);
    (nodes, models, any::<u64>()).prop_flat_map(|(nodes, models, seed)| {
        let m = models.len();
        let op = prop_oneof![
            3 => (0..NODE_IDS, spec()).prop_map(|(i, s)| Op::Join(i, s)),
            1 => (0..NODE_IDS, any::<bool>()).prop_map(|(i, b)| Op::JoinInvalid(i, b)),
            3 => (0..NODE_IDS).prop_map(Op::Lose),
            1 => (0..NODE_IDS).prop_map(Op::Resident),
            4 => prop::collection::vec((0..m, 0u32..4, prop::bool::weighted(0.2)), 1..4).prop_map(Op::Deploy),
            3 => (0..m, prop::bool::weighted(0.2)).prop_map(|(m, d)| Op::Grow(m, d)),
            1 => (0usize..64).prop_map(Op::EvictReplica),
            1 => (0..m).prop_map(Op::EvictModel),
            1 => (0u64..3).prop_map(Op::Advance),
        ];
        (Just(nodes), Just(models), prop::collection::vec(op, 1..30), Just(seed))
            .prop_map(|(nodes, models, ops, seed)| World { nodes, models, ops, seed })
    })
}

fn build(w: &World) -> Cluster {
    let mut models: BTreeMap<ModelKey, ModelSpec> = w
        .models
        .iter()
        .enumerate()
        .map(|(i, &gb)| {
            (model_key(i), ModelSpec { size: Some(ByteSize::new(gb * GB)), ..Default::default() })
        })
        .collect();
    models.get_mut(&model_key(0)).unwrap().gpu_kind = Some("h100".into());
    let nodes = w
        .nodes
        .iter()
        .enumerate()
        .map(|(i, &(gpus, gb, kind, cache))| node_config(&node_id(i), gpus, gb, kind, cache))
        .collect();
    Cluster::new(ClusterConfig { nodes, models, ..Default::default() }).unwrap()
}

fn ids(c: &Cluster) -> Vec<NodeId> {
    c.nodes().iter().map(|n| n.id().clone()).collect()
}

/// Runs `w`'s operations, checking after each that the accounting holds,
/// that no deployment names a node the cluster no longer has, that nodes
/// keep their order, and what each join and loss must do; returns the final
/// state.
fn run(w: &World) -> Result<Snapshot, TestCaseError> {
    let mut c = build(w);
    let mut rng = ChaCha8Rng::seed_from_u64(w.seed);
    let mut now = 0;
    // The node ids in the order the cluster must list them.
    let mut order = ids(&c);
    for op in &w.ops {
        let before = c.snapshot();
        match op {
            Op::Join(i, (gpus, gb, kind, cache)) => {
                let id = node_id(*i);
                let result = c.add_node(node_config(&id, *gpus, *gb, kind, *cache));
                if order.contains(&id) {
                    prop_assert_eq!(result, Err(AddNodeError::Duplicate(id)));
                } else {
                    prop_assert_eq!(result, Ok(()));
                    let n = c.node(&id).unwrap();
                    prop_assert!(n.hot().is_empty() && n.warm().is_empty() && n.resident().is_empty());
                    order.push(id);
                }
            }
            Op::JoinInvalid(i, too_many) => {
                let mut bad = node_config(&node_id(*i), 1, 80, "gpu", 0);
                if *too_many {
                    bad.gpus = hangar_placement::MAX_GPUS_PER_NODE + 1;
                } else {
                    bad.gpu_memory = None;
                }
                prop_assert!(c.add_node(bad).is_err());
            }
            Op::Lose(i) => {
                let id = node_id(*i);
                let had: Vec<Deployment> =
                    before.deployments().values().filter(|d| d.node == id).cloned().collect();
                match c.remove_node(&id) {
                    None => prop_assert!(!order.contains(&id)),
                    Some(mut gone) => {
                        // Exactly what the node held, hot ones first.
                        let hot_first = gone.windows(2).all(|p| p[0].level <= p[1].level);
                        prop_assert!(hot_first, "{:?}", gone);
                        gone.sort_by_key(|d| d.replica_id);
                        prop_assert_eq!(gone, had);
                        prop_assert!(c.node(&id).is_none());
                        prop_assert!(c.set_resident(&id, BTreeSet::new()).is_err(), "its residency stays");
                        order.retain(|n| *n != id);
                    }
                }
            }
            Op::Resident(i) => {
                let id = node_id(*i);
                let result = c.set_resident(&id, BTreeSet::from(["hg1:a".to_owned()]));
                prop_assert_eq!(result.is_ok(), order.contains(&id));
            }
            Op::Deploy(reqs) => {
                let reqs: Vec<ReplicaRequest> = reqs
                    .iter()
                    .map(|&(m, replicas, dedicated)| ReplicaRequest {
                        model_key: model_key(m),
                        replicas,
                        dedicated,
                    })
                    .collect();
                let out = c.deploy(&reqs, now, &mut rng);
                for r in out.models.iter().flat_map(|m| &m.replicas) {
                    if r.level != CandidateLevel::CantAccommodate {
                        prop_assert!(c.node(r.node.as_ref().unwrap()).is_some());
                    }
                }
            }
            Op::Grow(m, dedicated) => {
                // The lowest level, then spread over the nodes as they are
                // now, then the cheapest set.
                grow_one_checked(&mut c, &model_key(*m), *dedicated, now, &mut rng)
                    .map_err(TestCaseError::fail)?;
            }
            Op::EvictReplica(pick) => {
                let all: Vec<(ModelKey, ReplicaId)> =
                    before.deployments().values().map(|d| (d.model_key.clone(), d.replica_id)).collect();
                if !all.is_empty() {
                    let (m, r) = &all[pick % all.len()];
                    c.evict_replica(m, r).unwrap();
                }
            }
            Op::EvictModel(m) => {
                c.evict_model(&model_key(*m));
            }
            Op::Advance(hours) => now += hours * HOUR + 1,
        }
        c.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(ids(&c), order.clone());
        let after = c.snapshot();
        // A snapshot handed out again is the cluster as it is: the same as
        // one built afresh from a clone (which starts without the cache),
        // and shared with the last one exactly when nothing changed.
        prop_assert_eq!(&after, &c.clone().snapshot());
        prop_assert!(c.snapshot().same_as(&after));
        for d in after.deployments().values() {
            let node = c.node(&d.node);
            let node =
                node.ok_or_else(|| TestCaseError::fail(format!("{} names a removed node", d.name())))?;
            let r = c.requirement(&d.model_key);
            prop_assert!(r.is_none_or(|r| r.admits(node.gpu_kind(), node.gpu_memory())));
        }
        // What the node agents are told stays expressible: a loss is a
        // delete of each replica the lost node held.
        let delta =
            DeploymentDelta::between(&before, &after).map_err(|e| TestCaseError::fail(e.to_string()))?;
        // Snapshots share the parts of nodes that did not change, and the
        // delta looks only at the others: it is the delta between copies
        // that share nothing.
        let unshared = |s: &Snapshot| Snapshot::from_deployments(s.deployments().values().cloned());
        let full = DeploymentDelta::between(&unshared(&before), &unshared(&after));
        prop_assert_eq!(&delta, &full.map_err(|e| TestCaseError::fail(e.to_string()))?);
        let mut replay = before.clone();
        delta.apply(&mut replay).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&replay, &after);
    }
    Ok(c.snapshot())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// After any sequence of joins, losses, deploys and evictions the
    /// accounting holds and no deployment names a node that was removed.
    #[test]
    fn invariants_hold_as_nodes_join_and_leave(w in world()) {
        run(&w)?;
    }

    #[test]
    fn the_same_joins_and_losses_give_the_same_cluster(w in world()) {
        prop_assert_eq!(run(&w)?, run(&w)?);
    }
}

const TWO_NODES: &str = r#"
    [[nodes]]
    id = "a"
    gpus = 2
    gpu_memory = "80GB"
    cpu_cache = "100GB"
    [[nodes]]
    id = "b"
    gpus = 1
    gpu_memory = "80GB"
    [models.m]
    size = "10GB"
    [models.h]
    size = "10GB"
    gpu_kind = "h100"
"#;

fn nid(s: &str) -> NodeId {
    s.parse().unwrap()
}

#[test]
fn a_duplicate_node_is_refused_and_changes_nothing() {
    let mut c = cluster(TWO_NODES);
    c.deploy(&[req("m", 2)], 0, &mut rng());
    let before = c.snapshot();
    let err = c.add_node(node_config(&nid("a"), 8, 80, "h100", 0)).unwrap_err();
    assert_eq!(err, AddNodeError::Duplicate(nid("a")));
    assert_eq!(err.to_string(), "node `a` is already in the cluster; remove it before adding it again");
    assert_eq!(c.snapshot(), before);
    assert_eq!(c.node(&nid("a")).unwrap().gpus().len(), 2, "the node already there is untouched");
    c.check_invariants().unwrap();
}

#[test]
fn a_node_is_held_to_the_rules_of_the_config() {
    let mut c = cluster(TWO_NODES);
    let mut bad = node_config(&nid("c"), 1, 80, "gpu", 0);
    bad.gpu_memory = None;
    let err = c.add_node(bad.clone()).unwrap_err();
    assert!(matches!(&err, AddNodeError::Invalid { field: "gpu_memory", .. }), "{err:?}");
    assert!(err.to_string().starts_with("node `c`: gpu_memory: is required"), "{err}");
    // The same declaration in a config is refused for the same reason.
    let config = ClusterConfig { nodes: vec![bad], ..Default::default() };
    let in_config = Cluster::new(config).unwrap_err().to_string();
    assert_eq!(
        in_config,
        "nodes[0].gpu_memory (node `c`): is required when `gpus` is above 0 (e.g. \"80GB\")"
    );
    let mut many = node_config(&nid("c"), 17, 80, "gpu", 0);
    assert!(matches!(c.add_node(many.clone()), Err(AddNodeError::Invalid { field: "gpus", .. })));
    assert!(c.node(&nid("c")).is_none());
    many.gpus = 16;
    c.add_node(many).unwrap();
    assert_eq!(ids(&c), vec![nid("a"), nid("b"), nid("c")], "a node that joins comes last");
}

#[test]
fn a_removed_node_takes_its_hot_and_warm_replicas_and_its_residency() {
    let mut c = cluster(TWO_NODES);
    let hot_a = hot(&mut c, "m", 1, "a", &[0]);
    let warm_a = warm(&mut c, "h", 2, "a");
    let on_b = hot(&mut c, "m", 3, "b", &[0]);
    c.set_resident(&nid("a"), BTreeSet::from(["hg1:x".to_owned()])).unwrap();

    let gone = c.remove_node(&nid("a")).unwrap();
    let gone: Vec<(ReplicaId, Level)> = gone.iter().map(|d| (d.replica_id, d.level)).collect();
    assert_eq!(gone, vec![(hot_a, Level::Hot), (warm_a, Level::Warm)]);
    c.check_invariants().unwrap();
    assert!(c.deployment(&hot_a).is_none() && c.deployment(&warm_a).is_none());
    assert_eq!(c.deployment(&on_b).unwrap().node, nid("b"), "the other node's replica stays");
    assert!(c.replicas_of(&key("h"), Level::Warm).is_empty());
    assert!(c.remove_node(&nid("a")).is_none(), "a second loss finds nothing");
    assert!(c.set_resident(&nid("a"), BTreeSet::new()).is_err());

    // Back again: empty, with no residency until it reports some.
    c.add_node(node_config(&nid("a"), 2, 80, "gpu", 100)).unwrap();
    let a = c.node(&nid("a")).unwrap();
    assert!(a.hot().is_empty() && a.warm().is_empty() && a.resident().is_empty());
    assert_eq!(ids(&c), vec![nid("b"), nid("a")]);
    c.check_invariants().unwrap();
    // The index still finds the replica on `b`, now the first node.
    c.evict_replica(&key("m"), &on_b).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn a_model_needing_hardware_only_a_joining_node_has_is_placed_there() {
    let mut c = cluster(TWO_NODES);
    let out = c.deploy(&[req("h", 1)], 0, &mut rng());
    assert_eq!(out.models[0].replicas[0].level, CandidateLevel::CantAccommodate);
    assert!(c.missing_hardware(&key("h")).is_some());
    c.add_node(node_config(&nid("h1"), 1, 80, "h100", 0)).unwrap();
    assert!(c.missing_hardware(&key("h")).is_none());
    let out = c.deploy(&[req("h", 1)], 0, &mut rng());
    assert_eq!(out.models[0].replicas[0].node, Some(nid("h1")));
    c.check_invariants().unwrap();
}

/// A draining node takes nothing new, and its replicas stop counting:
/// `deploy` places the model's count on the other nodes while the leaving
/// replica stays HOT until the caller stops it, which sends it COLD (not
/// into the draining node's warm cache). With every node that could run a
/// model draining, it is unplaceable for that reason.
#[test]
fn a_draining_node_takes_nothing_new_and_its_replicas_are_replaced_elsewhere() {
    let nodes =
        vec![node_config(&node_id(0), 1, 80, "gpu", 100), node_config(&node_id(1), 1, 80, "gpu", 100)];
    let models = BTreeMap::from([(
        model_key(0),
        ModelSpec { size: Some(ByteSize::new(30 * GB)), ..Default::default() },
    )]);
    let mut c = Cluster::new(ClusterConfig { nodes, models, ..ClusterConfig::default() }).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let one = |c: &mut Cluster, rng: &mut ChaCha8Rng| {
        let request = ReplicaRequest { model_key: model_key(0), replicas: 1, dedicated: false };
        c.deploy(&[request], 0, rng)
    };
    one(&mut c, &mut rng);
    let first = c.replicas_of(&model_key(0), Level::Hot)[0].clone();
    let other = if first.node == node_id(0) { node_id(1) } else { node_id(0) };
    c.set_draining(&first.node, true).unwrap();
    assert!(c.any_draining());
    assert_eq!(c.count_staying(&model_key(0)), 0);

    let out = one(&mut c, &mut rng);
    let placed = &out.models[0].replicas;
    assert_eq!(placed.len(), 1, "{placed:?}");
    assert_eq!(placed[0].node.as_ref(), Some(&other), "the replacement goes to the other node");
    assert_eq!(c.count_of(&model_key(0), Level::Hot), 2, "the leaving replica stays until stopped");
    assert_eq!(c.count_staying(&model_key(0)), 1);
    assert!(c
        .candidates(&model_key(0), false, 0)
        .iter()
        .all(|cand| cand.node != first.node || cand.level == CandidateLevel::CantAccommodate));

    let evicted = c.evict_replica(&model_key(0), &first.replica_id).unwrap();
    assert_eq!(evicted[0].to, Level::Cold, "a draining node's cache takes nothing: {evicted:?}");
    assert!(c.node(&first.node).unwrap().warm().is_empty());

    c.set_draining(&other, true).unwrap();
    let request = ReplicaRequest { model_key: model_key(0), replicas: 2, dedicated: false };
    let out = c.deploy(&[request], 0, &mut rng);
    let reason = out.models[0].replicas[1].reason.clone().unwrap();
    assert_eq!(reason.to_string(), "every node that could run it is draining or not answering (suspect)");
    c.set_draining(&first.node, false).unwrap();
    assert!(c.set_draining(&node_id(7), true).is_err(), "an unknown node is refused");
    c.check_invariants().unwrap();
}
