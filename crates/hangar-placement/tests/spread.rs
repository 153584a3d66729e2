//! Spread: a model's replicas go to the nodes holding the fewest of them,
//! at every candidate level, so that one node's loss takes out as few of
//! them as it can (issue 27, item 8: after a node loss both replicas of a
//! model landed on one node).

mod common;

use std::collections::BTreeSet;

use common::*;
use hangar_core::{ByteSize, ModelKey};
use hangar_placement::{
    CandidateLevel, Cluster, ClusterConfig, EvictionCost, Level, ModelSpec, NodeConfig, NodeId,
    ReplicaRequest,
};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn nid(s: &str) -> NodeId {
    s.parse().unwrap()
}

/// The nodes `model`'s HOT replicas are on, one entry per replica.
fn nodes_of(c: &Cluster, model: &str) -> Vec<NodeId> {
    c.replicas_of(&key(model), Level::Hot).iter().map(|d| d.node.clone()).collect()
}

fn distinct(nodes: &[NodeId]) -> bool {
    nodes.iter().collect::<BTreeSet<_>>().len() == nodes.len()
}

/// Issue 27 item 8: three nodes of two GPUs, a model with two replicas on
/// two of them. The node of one is lost; the replica placed again goes to
/// the third node, never beside the survivor — for every seed, where a
/// uniform draw between the two free nodes stacked them half the time.
#[test]
fn issue_27_8_a_lost_replica_is_placed_again_on_a_node_without_one() {
    let text =
        node("a", 2, "0B") + &node("b", 2, "0B") + &node("c", 2, "0B") + "[models.m]\nsize = \"20GB\"\n";
    for seed in 0..64 {
        let mut c = cluster(&text);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        c.deploy(&[req("m", 2)], 0, &mut rng);
        let placed = nodes_of(&c, "m");
        assert!(distinct(&placed), "seed {seed}: {placed:?}");
        let lost = placed[0].clone();
        let gone = c.remove_node(&lost).unwrap();
        assert_eq!(gone.len(), 1, "one node's loss takes one replica");
        let out = c.deploy(&[req("m", 2)], 0, &mut rng);
        assert_eq!(out.models[0].replicas[1].level, CandidateLevel::Free);
        let now = nodes_of(&c, "m");
        assert!(distinct(&now), "seed {seed}: after losing {lost}, {now:?}");
        c.check_invariants().unwrap();
    }
}

/// When every node must evict, the node without a replica of the model is
/// chosen even though evicting there costs more: spread comes before the
/// eviction cost (never before the level).
#[test]
fn spread_comes_before_the_eviction_cost() {
    let text = node("a", 2, "0B")
        + &node("b", 2, "0B")
        + r#"
        [models.m]
        size = "20GB"   # a 60 GB share
        [models.t]
        size = "10GB"   # a 30 GB share
        [models.w]
        size = "25GB"   # a whole GPU
    "#;
    let mut c = cluster(&text);
    hot(&mut c, "m", 1, "a", &[0]);
    hot(&mut c, "t", 2, "a", &[1]);
    hot(&mut c, "w", 3, "b", &[0]);
    hot(&mut c, "w", 4, "b", &[1]);
    let candidates = c.candidates(&key("m"), false, 2 * HOUR);
    let seen: Vec<(CandidateLevel, u32, u64)> =
        candidates.iter().map(|c| (c.level, c.hot_replicas, c.eviction_cost.bytes / GB)).collect();
    assert_eq!(seen, [(CandidateLevel::Full, 1, 30), (CandidateLevel::Full, 0, 80)]);
    for seed in 0..16 {
        let mut c = c.clone();
        let out = c.deploy(&[req("m", 2)], 2 * HOUR, &mut ChaCha8Rng::seed_from_u64(seed));
        let r = &out.models[0].replicas[1];
        assert_eq!((r.node.clone(), r.level), (Some(nid("b")), CandidateLevel::Full), "seed {seed}");
        assert_eq!(r.eviction_cost, EvictionCost { non_hotswap: true, bytes: 80 * GB, count: 1 });
        c.check_invariants().unwrap();
    }
}

/// A WARM copy is woken where it is, even on a node that already runs the
/// model: waking is a better level than a fresh start elsewhere, and spread
/// only orders the candidates of one level. Among WARM copies, the one on
/// a node without a HOT replica is woken.
#[test]
fn a_warm_copy_still_wins_and_among_warm_copies_spread_decides() {
    let text = node("a", 2, "100GB") + &node("b", 2, "100GB") + "[models.m]\nsize = \"20GB\"\n";
    for seed in 0..16 {
        let mut c = cluster(&text);
        hot(&mut c, "m", 1, "a", &[0]);
        warm(&mut c, "m", 2, "a");
        let out = c.deploy(&[req("m", 2)], 0, &mut ChaCha8Rng::seed_from_u64(seed));
        let r = &out.models[0].replicas[1];
        assert_eq!((r.node.clone(), r.level), (Some(nid("a")), CandidateLevel::CachedAndFree));

        let mut c = cluster(&text);
        hot(&mut c, "m", 1, "a", &[0]);
        warm(&mut c, "m", 2, "a");
        warm(&mut c, "m", 3, "b");
        let out = c.deploy(&[req("m", 2)], 0, &mut ChaCha8Rng::seed_from_u64(seed));
        let r = &out.models[0].replicas[1];
        assert_eq!((r.replica_id, r.level), (Some(rid(3)), CandidateLevel::CachedAndFree), "seed {seed}");
        c.check_invariants().unwrap();
    }
}

/// What happens to the fleet after the model is first placed.
#[derive(Debug, Clone)]
enum Event {
    /// The node at this position (modulo the node count) is lost.
    Lose(usize),
    /// A node of this many GPUs of this many GB joins.
    Join(u32, u64),
}

#[derive(Debug, Clone)]
struct World {
    /// GPUs and GB per GPU of each node.
    nodes: Vec<(u32, u64)>,
    /// Sizes of the other models, GB.
    others: Vec<u64>,
    /// Batches of (other model, replicas) deployed first, as noise.
    fill: Vec<Vec<(usize, u32)>>,
    /// The model under test: GB, and whether it needs 80 GB GPUs.
    size: u64,
    needs_80: bool,
    /// Its replica count.
    replicas: u32,
    events: Vec<Event>,
    seed: u64,
}

fn world() -> impl Strategy<Value = World> {
    let gb = || prop::sample::select(vec![24u64, 40, 80]);
    let nodes = prop::collection::vec((0u32..5, gb()), 1..8);
    let others = prop::collection::vec(1u64..100, 1..5);
    (nodes, others, any::<u64>()).prop_flat_map(move |(nodes, others, seed)| {
        let m = others.len();
        let fill = prop::collection::vec(prop::collection::vec((0..m, 0u32..4), 1..4), 0..6);
        let event = prop_oneof![
            3 => (0usize..16).prop_map(Event::Lose),
            1 => (1u32..5, gb()).prop_map(|(g, s)| Event::Join(g, s)),
        ];
        let events = prop::collection::vec(event, 1..6);
        (Just(nodes), Just(others), fill, 1u64..60, any::<bool>(), 1u32..6, events, Just(seed)).prop_map(
            |(nodes, others, fill, size, needs_80, replicas, events, seed)| World {
                nodes,
                others,
                fill,
                size,
                needs_80,
                replicas,
                events,
                seed,
            },
        )
    })
}

fn node_config(id: String, gpus: u32, gb: u64) -> NodeConfig {
    NodeConfig {
        id: id.parse().unwrap(),
        gpus,
        gpu_memory: Some(ByteSize::new(gb * GB)),
        gpu_kind: None,
        virtual_gpus: false,
        cpu_cache: ByteSize::new(100 * GB),
    }
}

fn other(i: usize) -> ModelKey {
    key(&format!("o{i}"))
}

fn build(w: &World) -> Cluster {
    let sized = |gb: u64| ModelSpec { size: Some(ByteSize::new(gb * GB)), ..Default::default() };
    let mut models: std::collections::BTreeMap<ModelKey, ModelSpec> =
        w.others.iter().enumerate().map(|(i, &gb)| (other(i), sized(gb))).collect();
    let mut spread = sized(w.size);
    if w.needs_80 {
        spread.min_gpu_memory = Some(ByteSize::new(80 * GB));
    }
    models.insert(key("spread"), spread);
    let nodes = w.nodes.iter().enumerate().map(|(i, &(g, gb))| node_config(format!("n{i}"), g, gb)).collect();
    Cluster::new(ClusterConfig { nodes, models, ..Default::default() }).unwrap()
}

/// Brings `spread` to `w.replicas` and checks it: when at least as many
/// nodes without a replica of it have room for one (no eviction) as
/// replicas are missing, the new replicas are on distinct nodes that held
/// none before. Returns whether that precondition held, i.e. whether the
/// check meant something.
fn deploy_and_check(
    c: &mut Cluster,
    w: &World,
    now: u64,
    rng: &mut ChaCha8Rng,
) -> Result<bool, TestCaseError> {
    let before = nodes_of(c, "spread");
    let missing = (w.replicas as usize).saturating_sub(before.len());
    let room = c
        .candidates(&key("spread"), false, now)
        .iter()
        .filter(|c| c.level == CandidateLevel::Free && c.hot_replicas == 0)
        .count();
    let request = ReplicaRequest { model_key: key("spread"), replicas: w.replicas, dedicated: false };
    c.deploy(&[request], now, rng);
    c.check_invariants().map_err(TestCaseError::fail)?;
    let after = nodes_of(c, "spread");
    if missing == 0 || room < missing {
        return Ok(false);
    }
    prop_assert_eq!(after.len(), before.len() + missing, "room for every missing replica");
    let added: Vec<NodeId> = after.iter().filter(|n| !before.contains(n)).cloned().collect();
    prop_assert!(
        added.len() == missing && distinct(&added),
        "{} missing, room on {} fresh nodes: {:?} added to {:?}",
        missing,
        room,
        after,
        before
    );
    Ok(true)
}

/// The property of issue 27 item 8, on random fleets filled with random
/// other models: whenever enough eligible nodes have room, the model's N
/// replicas are on N distinct nodes, so a node's loss takes out at most
/// one; and after each loss (or join) and a re-deploy, the same holds.
#[test]
fn replicas_land_on_distinct_nodes_when_room_allows_and_after_each_loss() {
    let checked = run_counting(512, world(), |w| {
        let mut c = build(&w);
        let mut rng = ChaCha8Rng::seed_from_u64(w.seed);
        for batch in &w.fill {
            let reqs: Vec<ReplicaRequest> = batch
                .iter()
                .map(|&(m, replicas)| ReplicaRequest { model_key: other(m), replicas, dedicated: false })
                .collect();
            c.deploy(&reqs, 0, &mut rng);
        }
        let now = 2 * HOUR;
        let mut meant = deploy_and_check(&mut c, &w, now, &mut rng)?;
        let mut joined = 0;
        for event in &w.events {
            match *event {
                Event::Lose(pick) if !c.nodes().is_empty() => {
                    let id = c.nodes()[pick % c.nodes().len()].id().clone();
                    let was_distinct = distinct(&nodes_of(&c, "spread"));
                    let gone = c.remove_node(&id).unwrap();
                    let lost = gone.iter().filter(|d| d.model_key == key("spread")).count();
                    prop_assert!(!was_distinct || lost <= 1, "{} replicas lost with {}", lost, id);
                }
                Event::Lose(_) => {}
                Event::Join(gpus, gb) => {
                    joined += 1;
                    c.add_node(node_config(format!("j{joined}"), gpus, gb)).unwrap();
                }
            }
            meant |= deploy_and_check(&mut c, &w, now, &mut rng)?;
        }
        Ok(usize::from(meant))
    });
    assert!(checked >= 128, "only {checked} of 512 fleets had room to check spread in");
}
