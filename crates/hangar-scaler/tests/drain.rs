//! The controller draining nodes: replicas moved make-before-break — a
//! leaving replica stops only once the model's ready replicas would still
//! number its count without it — WARM ones let go at once, and nothing new
//! placed on a draining node. And suspect nodes (agent and engines not
//! answering a gateway): nothing new placed there, nothing moved off.

use std::collections::{BTreeMap, BTreeSet};

use hangar_core::{ByteSize, Millis, ModelKey, ReplicaId};
use hangar_placement::{
    Cluster, ClusterConfig, Level, ModelSpec as Size, NodeConfig, NodeId, Schedule, Window,
};
use hangar_scaler::{Action, Bounds, Controller, ModelSpec, Observation, ScalingConfig};
use proptest::prelude::*;

const GB: u64 = 1_000_000_000;

fn key(k: &str) -> ModelKey {
    k.parse().unwrap()
}

fn nid(i: usize) -> NodeId {
    format!("n{i}").parse().unwrap()
}

/// `nodes` nodes of `gpus` 80 GB GPUs (and `cache_gb` of warm cache each)
/// serving models of 30 GB (a whole GPU each), `m0`, `m1`, … each held at
/// its count.
fn controller(nodes: usize, gpus: u32, cache_gb: u64, counts: &[u32], seed: u64) -> Controller {
    let nodes = (0..nodes)
        .map(|i| NodeConfig {
            id: nid(i),
            gpus,
            gpu_memory: Some(ByteSize::new(80 * GB)),
            gpu_kind: None,
            virtual_gpus: false,
            cpu_cache: ByteSize::new(cache_gb * GB),
        })
        .collect();
    let models = (0..counts.len())
        .map(|m| (key(&format!("m{m}")), Size { size: Some(ByteSize::new(30 * GB)), ..Size::default() }))
        .collect();
    let cluster = Cluster::new(ClusterConfig { nodes, models, ..ClusterConfig::default() }).unwrap();
    let specs = counts
        .iter()
        .enumerate()
        .map(|(m, &n)| ModelSpec {
            key: key(&format!("m{m}")),
            scaling: ScalingConfig::Fixed,
            bounds: Bounds { min: n, max: n },
            slo_ttft_ms: None,
        })
        .collect();
    Controller::new(cluster, seed, specs, 0)
}

fn drain_actions(c: &mut Controller) -> Vec<Action> {
    std::iter::from_fn(|| c.poll_action()).collect()
}

/// A model's HOT replicas, by id, with their node.
fn hot(c: &Controller, model: &ModelKey) -> BTreeMap<ReplicaId, NodeId> {
    c.cluster().replicas_of(model, Level::Hot).into_iter().map(|d| (d.replica_id, d.node.clone())).collect()
}

/// Tells the controller, at `now`, which of each model's placed HOT
/// replicas are ready (`ready`), as a driver's observation does.
fn observe(c: &mut Controller, now: Millis, ready: &BTreeSet<ReplicaId>) {
    let models: Vec<ModelKey> = c.cluster().models().keys().cloned().collect();
    for m in &models {
        let serving: Vec<(ReplicaId, u32)> =
            hot(c, m).into_keys().filter(|id| ready.contains(id)).map(|id| (id, 0)).collect();
        c.observe(now, m, Observation::default(), &serving);
    }
}

fn draining(c: &Controller, node: &NodeId) -> bool {
    c.cluster().node(node).is_some_and(|n| n.draining())
}

#[test]
fn a_drained_nodes_replica_stops_only_once_its_replacement_is_ready() {
    let m = key("m0");
    let mut c = controller(3, 1, 100, &[2], 7);
    drain_actions(&mut c);
    let mut ready: BTreeSet<ReplicaId> = hot(&c, &m).into_keys().collect();
    observe(&mut c, 1_000, &ready);
    let (old, node) = hot(&c, &m).into_iter().next().unwrap();

    c.drain(2_000, &node, true).unwrap();
    let actions = drain_actions(&mut c);
    let creates: Vec<_> = actions
        .iter()
        .flat_map(|a| match a {
            Action::Apply(d) => d.create.clone(),
            _ => Vec::new(),
        })
        .collect();
    assert_eq!(creates.len(), 1, "{actions:?}");
    assert_ne!(creates[0].node, node, "the replacement is placed elsewhere");
    assert!(hot(&c, &m).contains_key(&old), "the leaving replica serves until its replacement does");

    // Observed again before the replacement is ready: nothing stops.
    observe(&mut c, 3_000, &ready);
    assert!(drain_actions(&mut c).is_empty());
    assert_eq!(hot(&c, &m).len(), 3);

    ready.insert(creates[0].replica_id);
    observe(&mut c, 4_000, &ready);
    let actions = drain_actions(&mut c);
    let deleted: Vec<ReplicaId> = actions
        .iter()
        .flat_map(|a| match a {
            Action::Apply(d) => d.delete.iter().map(|d| d.replica_id).collect(),
            _ => Vec::new(),
        })
        .collect();
    assert_eq!(deleted, [old], "{actions:?}");
    assert!(c.cluster().node(&node).unwrap().hot().is_empty(), "the node is drained");
    assert_eq!(c.cluster().count_of(&m, Level::Warm), 0, "a drained replica does not go WARM");
    assert!(c.drain(5_000, &"ghost".parse().unwrap(), true).is_err());
    c.cluster().check_invariants().unwrap();
}

/// No other node has room: the leaving replica stays (the model shows
/// unplaceable), and calling the drain off leaves it where it is.
#[test]
fn without_room_elsewhere_the_leaving_replica_stays() {
    let m = key("m0");
    let mut c = controller(2, 1, 0, &[2], 1);
    drain_actions(&mut c);
    let ready: BTreeSet<ReplicaId> = hot(&c, &m).into_keys().collect();
    observe(&mut c, 1_000, &ready);
    let (old, node) = hot(&c, &m).into_iter().next().unwrap();
    c.drain(2_000, &node, true).unwrap();
    let actions = drain_actions(&mut c);
    assert!(actions.iter().all(|a| !matches!(a, Action::Apply(_))), "{actions:?}");
    assert!(actions.iter().any(|a| matches!(a, Action::Unplaceable { .. })), "{actions:?}");
    observe(&mut c, 3_000, &ready);
    assert!(hot(&c, &m).contains_key(&old));
    c.drain(4_000, &node, false).unwrap();
    assert!(!draining(&c, &node));
    let actions = drain_actions(&mut c);
    assert!(actions.iter().all(|a| !matches!(a, Action::Apply(_))), "{actions:?}");
    assert_eq!(hot(&c, &m).len(), 2);
}

/// Creates in `actions`, as (replica, node).
fn creates(actions: &[Action]) -> Vec<(ReplicaId, NodeId)> {
    actions
        .iter()
        .flat_map(|a| match a {
            Action::Apply(d) => d.create.iter().map(|d| (d.replica_id, d.node.clone())).collect(),
            _ => Vec::new(),
        })
        .collect()
}

proptest! {
    /// Two models on two nodes of two GPUs: a replica found dead on a
    /// suspect node is placed again on the other one whatever the draw
    /// (the suspect node's freed GPU would fit it as well), and what else
    /// the suspect node holds stays where it is.
    #[test]
    fn a_replica_found_dead_on_a_suspect_node_is_placed_elsewhere(seed in any::<u64>()) {
        let (m0, m1) = (key("m0"), key("m1"));
        let mut c = controller(2, 2, 100, &[1, 2], seed);
        drain_actions(&mut c);
        let ready: BTreeSet<ReplicaId> = c
            .cluster()
            .models()
            .keys()
            .flat_map(|m| hot(&c, m).into_keys().collect::<Vec<_>>())
            .collect();
        observe(&mut c, 1_000, &ready);
        let (dead, node) = hot(&c, &m0).into_iter().next().unwrap();
        let others: BTreeMap<ReplicaId, NodeId> = hot(&c, &m1);
        c.suspect(2_000, &node, true).unwrap();
        prop_assert!(drain_actions(&mut c).is_empty(), "a suspicion moves nothing");
        c.handle_failed(2_000, &m0, dead, "its health check failed", false);
        let placed = creates(&drain_actions(&mut c));
        prop_assert_eq!(placed.len(), 1);
        prop_assert_ne!(&placed[0].1, &node, "placed again on the suspect node");
        prop_assert_eq!(hot(&c, &m1), others, "the suspect node's other replicas stay");
        c.cluster().check_invariants().unwrap();
    }
}

/// The only node is suspect: a replica found dead there waits (the model
/// says why), and is placed there again at once when the suspicion is
/// called off.
#[test]
fn a_model_waits_for_its_only_node_to_answer_again() {
    let m = key("m0");
    let mut c = controller(1, 1, 0, &[1], 3);
    drain_actions(&mut c);
    let (dead, node) = hot(&c, &m).into_iter().next().unwrap();
    observe(&mut c, 1_000, &BTreeSet::from([dead]));
    c.suspect(2_000, &node, true).unwrap();
    c.handle_failed(2_000, &m, dead, "its health check failed", false);
    let actions = drain_actions(&mut c);
    let why: Vec<String> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Unplaceable { reason, .. } => Some(reason.clone()),
            _ => None,
        })
        .collect();
    assert!(creates(&actions).is_empty(), "{actions:?}");
    assert!(why.iter().any(|r| r.contains("not answering")), "{actions:?}");
    c.suspect(3_000, &node, false).unwrap();
    assert_eq!(c.poll_timeout(), 3_000, "the model is retried at once");
    c.handle_timeout(3_000);
    let placed = creates(&drain_actions(&mut c));
    assert_eq!(placed.len(), 1);
    assert_eq!(placed[0].1, node);
    assert!(c.suspect(3_000, &"ghost".parse().unwrap(), true).is_err());
}

/// A dedicated window's replica on a drained node is replaced dedicated,
/// and the window keeps its count of dedicated replicas throughout.
#[test]
fn a_dedicated_replica_is_replaced_dedicated() {
    let m = key("m0");
    let mut c = controller(3, 1, 0, &[0], 5);
    let window = Window { model_key: m.clone(), replicas: 2, start_ms: 0, end_ms: 3_600_000 };
    c.set_schedule(0, Schedule::new(vec![window]).unwrap());
    drain_actions(&mut c);
    let dedicated =
        |c: &Controller| c.cluster().replicas_of(&m, Level::Hot).iter().filter(|d| d.dedicated).count();
    assert_eq!(dedicated(&c), 2);
    let mut ready: BTreeSet<ReplicaId> = hot(&c, &m).into_keys().collect();
    observe(&mut c, 1_000, &ready);
    let (old, node) = hot(&c, &m).into_iter().next().unwrap();
    c.drain(2_000, &node, true).unwrap();
    drain_actions(&mut c);
    let new: Vec<ReplicaId> = hot(&c, &m).into_keys().filter(|id| !ready.contains(id)).collect();
    assert_eq!(new.len(), 1, "{:?}", hot(&c, &m));
    assert!(c.cluster().deployment(&new[0]).unwrap().dedicated, "the replacement is dedicated");
    assert_eq!(dedicated(&c), 2, "the leaving one gave its mark to its replacement");
    ready.insert(new[0]);
    observe(&mut c, 3_000, &ready);
    drain_actions(&mut c);
    assert!(!hot(&c, &m).contains_key(&old));
    assert_eq!(dedicated(&c), 2);
    c.cluster().check_invariants().unwrap();
}

/// WARM replicas on a node that starts draining are let go at once.
#[test]
fn a_draining_nodes_warm_replicas_go() {
    let m = key("m0");
    let mut c = controller(1, 1, 100, &[1], 3);
    drain_actions(&mut c);
    let (id, node) = hot(&c, &m).into_iter().next().unwrap();
    c.evict(1_000, &m, Some(id)).unwrap();
    drain_actions(&mut c);
    assert_eq!(c.cluster().count_of(&m, Level::Warm), 1);
    c.drain(2_000, &node, true).unwrap();
    let actions = drain_actions(&mut c);
    let deleted =
        actions.iter().any(|a| matches!(a, Action::Apply(d) if d.delete.iter().any(|d| d.replica_id == id)));
    assert!(deleted, "{actions:?}");
    assert_eq!(c.cluster().count_of(&m, Level::Warm), 0);
}

#[derive(Debug, Clone)]
enum Op {
    /// Node (modulo the nodes) starts draining.
    Drain(usize),
    /// The `k`-th placed replica not ready yet (modulo them) becomes ready.
    Ready(usize),
    /// The driver observes every model and handles what is due.
    Tick,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![1 => (0usize..8).prop_map(Op::Drain), 4 => (0usize..16).prop_map(Op::Ready), 3 => Just(Op::Tick)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Nodes drained at random while replicas become ready at random:
    /// after every step the cluster's books hold, nothing new is on a
    /// draining node, and no model has fewer ready replicas than before
    /// the step unless it had more than its count (a drain never takes a
    /// model below what it served with); once every replica is ready and
    /// the fleet has room for every count off the draining nodes, no
    /// replica is left on one.
    #[test]
    fn drains_never_take_a_model_below_what_it_serves_with(
        nodes in 2usize..5,
        gpus in 1u32..4,
        counts in prop::collection::vec(1u32..4, 1..4),
        ops in prop::collection::vec(op(), 1..40),
        seed: u64,
    ) {
        let mut c = controller(nodes, gpus, 100, &counts, seed);
        let mut now = 0;
        let mut ready: BTreeSet<ReplicaId> = BTreeSet::new();
        let models: Vec<ModelKey> = c.cluster().models().keys().cloned().collect();
        let serving = |c: &Controller, ready: &BTreeSet<ReplicaId>, m: &ModelKey| {
            hot(c, m).into_keys().filter(|id| ready.contains(id)).count()
        };
        for op in &ops {
            now += 1_000;
            let before: Vec<usize> = models.iter().map(|m| serving(&c, &ready, m)).collect();
            let placed_before: BTreeMap<ReplicaId, NodeId> = models.iter().flat_map(|m| hot(&c, m)).collect();
            match op {
                // Observed first, as a driver does before a command.
                Op::Drain(n) => {
                    observe(&mut c, now, &ready);
                    c.drain(now, &nid(n % nodes), true).unwrap();
                }
                Op::Ready(k) => {
                    let waiting: Vec<ReplicaId> =
                        placed_before.keys().filter(|id| !ready.contains(id)).copied().collect();
                    if !waiting.is_empty() {
                        ready.insert(waiting[k % waiting.len()]);
                    }
                }
                Op::Tick => {
                    observe(&mut c, now, &ready);
                    while c.poll_timeout() <= now {
                        c.handle_timeout(now);
                    }
                }
            }
            drain_actions(&mut c);
            c.cluster().check_invariants().map_err(TestCaseError::fail)?;
            for (i, m) in models.iter().enumerate() {
                for (id, node) in hot(&c, m) {
                    if draining(&c, &node) {
                        prop_assert_eq!(placed_before.get(&id), Some(&node), "{} placed on draining {}", id, node);
                    }
                }
                let after = serving(&c, &ready, m);
                prop_assert!(
                    after >= before[i].min(counts[i] as usize),
                    "{m}: {} ready replicas before, {after} after, count {}",
                    before[i],
                    counts[i]
                );
            }
        }
        // Every replica ready, then observed: the leaving ones go, where
        // the count stands off the draining nodes.
        let all: BTreeSet<ReplicaId> = models.iter().flat_map(|m| hot(&c, m).into_keys()).collect();
        observe(&mut c, now + 1_000, &all);
        drain_actions(&mut c);
        for (i, m) in models.iter().enumerate() {
            if c.cluster().count_staying(m) as u32 >= counts[i] {
                prop_assert!(
                    hot(&c, m).values().all(|n| !draining(&c, n)),
                    "{m} still on a draining node with its count elsewhere"
                );
            }
        }
    }
}
