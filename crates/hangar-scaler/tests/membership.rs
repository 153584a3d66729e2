//! The controller as node agents join and leave: a lost node's HOT
//! replicas placed again at once, its WARM ones forgotten, a joining node's
//! room (or hardware) used by the models waiting for it.

use std::collections::BTreeSet;

use hangar_core::{ByteSize, Millis, ModelKey};
use hangar_placement::{
    Action as Step, AddNodeError, Cluster, ClusterConfig, Deployment, Level, ModelSpec as Size, NodeConfig,
    NodeId, Restore, Schedule, Snapshot, Window,
};
use hangar_scaler::{Action, Bounds, Controller, HangarSettings, ModelSpec, Observation, ScalingConfig};
use proptest::prelude::*;

const GB: u64 = 1_000_000_000;

fn key(k: &str) -> ModelKey {
    k.parse().unwrap()
}

fn nid(s: &str) -> NodeId {
    s.parse().unwrap()
}

fn node(id: &str, gpus: u32, kind: &str, cache_gb: u64) -> NodeConfig {
    NodeConfig {
        id: nid(id),
        gpus,
        gpu_memory: Some(ByteSize::new(80 * GB)),
        gpu_kind: Some(kind.to_owned()),
        virtual_gpus: false,
        cpu_cache: ByteSize::new(cache_gb * GB),
    }
}

/// A cluster of `nodes` serving `models` (key, GB, required GPU kind).
fn cluster(nodes: Vec<NodeConfig>, models: &[(&str, u64, Option<&str>)]) -> Cluster {
    let models = models
        .iter()
        .map(|&(k, gb, kind)| {
            let size = Size {
                size: Some(ByteSize::new(gb * GB)),
                gpu_kind: kind.map(str::to_owned),
                ..Size::default()
            };
            (key(k), size)
        })
        .collect();
    Cluster::new(ClusterConfig { nodes, models, ..ClusterConfig::default() }).unwrap()
}

/// A model held at exactly `n` replicas.
fn fixed(k: &str, n: u32) -> ModelSpec {
    ModelSpec {
        key: key(k),
        scaling: ScalingConfig::Fixed,
        bounds: Bounds { min: n, max: n },
        slo_ttft_ms: None,
    }
}

fn drain(c: &mut Controller) -> Vec<Action> {
    std::iter::from_fn(|| c.poll_action()).collect()
}

fn steps(actions: &[Action], kind: Step) -> usize {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Apply(d) => Some(d.steps().filter(|s| s.action == kind).count()),
            _ => None,
        })
        .sum()
}

fn hot(c: &Controller, model: &str) -> Vec<Deployment> {
    c.cluster().replicas_of(&key(model), Level::Hot).into_iter().cloned().collect()
}

/// As a driver does at `now`: every model observed (idle), then whatever
/// is due handled until nothing is.
fn tick(c: &mut Controller, now: Millis) {
    let models: Vec<ModelKey> = c.cluster().models().keys().cloned().collect();
    for m in &models {
        c.observe(now, m, Observation::default(), &[]);
    }
    let mut rounds = 0;
    while c.poll_timeout() <= now {
        c.handle_timeout(now);
        rounds += 1;
        assert!(rounds < 50, "something stays due at {now}");
    }
}

/// 30 GB takes a whole 80 GB GPU: four replicas on two 4-GPU nodes, and
/// whichever node is lost, the other has exactly the room its replicas
/// need.
#[test]
fn a_lost_nodes_hot_replicas_are_placed_again_by_the_very_next_poll_action() {
    let nodes = vec![node("a", 4, "gpu", 0), node("b", 4, "gpu", 0)];
    let mut c = Controller::new(cluster(nodes, &[("m", 30, None)]), 1, vec![fixed("m", 4)], 0);
    drain(&mut c);
    let lost_node = hot(&c, "m")[0].node.clone();
    let on_it: BTreeSet<_> =
        hot(&c, "m").iter().filter(|d| d.node == lost_node).map(|d| d.replica_id).collect();

    let lost = c.handle_node_lost(5_000, &lost_node).expect("a known node");
    let ids: BTreeSet<_> = lost.iter().map(|d| d.replica_id).collect();
    assert_eq!(ids, on_it, "every replica the node held is reported lost");
    assert!(lost.iter().all(|d| d.level == Level::Hot));

    // No timer in between: the very next action places them.
    let Some(Action::Apply(delta)) = c.poll_action() else { panic!("the next action is not a placement") };
    assert_eq!(delta.create.len(), on_it.len(), "{delta:?}");
    assert!(delta.create.iter().all(|d| d.node != lost_node && !on_it.contains(&d.replica_id)));
    assert!(delta.delete.is_empty(), "the lost replicas are not deleted: they are already gone");
    assert_eq!(hot(&c, "m").len(), 4);
    assert!(c.blocked(&key("m")).is_none());
    assert!(c.cluster().node(&lost_node).is_none());
    c.cluster().check_invariants().unwrap();
    assert!(drain(&mut c).iter().all(|a| !matches!(a, Action::Apply(_) | Action::Unplaceable { .. })));
}

/// Two whole-GPU replicas wanted, room for one after the loss: one is
/// placed at once, and the model is reported unplaceable for the other.
#[test]
fn a_loss_beyond_the_room_left_places_what_fits_and_backs_off() {
    let nodes = vec![node("a", 2, "gpu", 0), node("b", 1, "gpu", 0)];
    let mut c = Controller::new(cluster(nodes, &[("m", 30, None)]), 1, vec![fixed("m", 2)], 0);
    drain(&mut c);
    let on_a = hot(&c, "m").iter().filter(|d| d.node == nid("a")).count();
    c.handle_node_lost(5_000, &nid("a")).unwrap();
    let actions = drain(&mut c);
    let room = 1 - (2 - on_a); // b's one GPU, less what m already has there
    assert_eq!(steps(&actions, Step::Create), room.min(on_a), "{actions:?}");
    assert_eq!(hot(&c, "m").len(), 1);
    assert!(actions.iter().any(|a| matches!(a, Action::Unplaceable { .. })), "{actions:?}");
    assert!(c.blocked(&key("m")).is_some());
}

/// A WARM replica on the lost node is not woken anywhere: its weights
/// were in that node's memory. The model's next replica starts COLD.
#[test]
fn a_lost_nodes_warm_replicas_are_forgotten() {
    let nodes = vec![node("a", 1, "gpu", 200), node("b", 1, "gpu", 0)];
    let spec = ModelSpec { bounds: Bounds { min: 0, max: 2 }, ..fixed("m", 0) };
    let mut c = Controller::new(cluster(nodes, &[("m", 30, None)]), 1, vec![spec], 0);
    c.observe(0, &key("m"), Observation::default(), &[]);
    c.pin(0, &key("m"), 2).unwrap();
    drain(&mut c);
    let on_a = hot(&c, "m").into_iter().find(|d| d.node == nid("a")).unwrap();
    c.evict(1_000, &key("m"), Some(on_a.replica_id)).unwrap();
    drain(&mut c);
    assert_eq!(c.cluster().deployment(&on_a.replica_id).unwrap().level, Level::Warm);

    let lost = c.handle_node_lost(1_500, &nid("a")).unwrap();
    let lost: Vec<_> = lost.iter().map(|d| (d.replica_id, d.level)).collect();
    assert_eq!(lost, vec![(on_a.replica_id, Level::Warm)]);
    assert!(drain(&mut c).iter().all(|a| !matches!(a, Action::Apply(_))), "nothing HOT was lost");
    assert!(c.cluster().replicas_of(&key("m"), Level::Warm).is_empty());

    // A node joins and the operator asks for two again: a COLD start there.
    c.handle_node_joined(2_000, node("c", 1, "gpu", 0), &[]).unwrap();
    c.pin(2_000, &key("m"), 2).unwrap();
    let actions = drain(&mut c);
    assert_eq!((steps(&actions, Step::Create), steps(&actions, Step::FromCache)), (1, 0), "{actions:?}");
    assert_eq!(hot(&c, "m").len(), 2);
}

/// A node that comes back (its agent was stopped, or outlived a Redis that
/// lost its data) keeps what it runs where its model still wants it, and
/// only that: replicas placed elsewhere meanwhile are not doubled, and
/// nothing adopted is started again.
#[test]
fn a_rejoining_node_keeps_what_is_still_wanted_and_nothing_more() {
    let nodes = vec![node("a", 2, "gpu", 0), node("b", 2, "gpu", 0)];
    // Three replicas of a GPU each, on two nodes of two GPUs: after `a` is
    // lost, `b` holds two and one is short.
    let mut c = Controller::new(
        cluster(nodes, &[("m", 60, None), ("w", 60, None)]),
        1,
        vec![fixed("m", 2), fixed("w", 1)],
        0,
    );
    drain(&mut c);
    let on_a: Vec<Deployment> =
        c.cluster().nodes()[0].hot().values().flat_map(|m| m.values()).cloned().collect();
    assert!(!on_a.is_empty(), "placement put something on a");
    c.handle_node_lost(1_000, &nid("a")).unwrap();
    drain(&mut c);
    let elsewhere: Vec<_> = ["m", "w"].iter().map(|m| hot(&c, m).len()).collect();
    // `a` comes back running what it ran before it was declared dead.
    let running: Vec<Restore> = on_a
        .iter()
        .map(|d| Restore {
            model_key: d.model_key.clone(),
            replica_id: d.replica_id,
            node: nid("a"),
            level: Level::Hot,
            gpus: Some(d.gpu_bytes_by_gpu.keys().copied().collect()),
            dedicated: false,
            deployed_at_ms: 0,
        })
        .collect();
    let kept = c.handle_node_joined(2_000, node("a", 2, "gpu", 0), &running).unwrap();
    for m in ["m", "w"] {
        let wanted = if m == "m" { 2 } else { 1 };
        assert_eq!(hot(&c, m).len(), wanted, "{m}: no more than its count");
    }
    let kept_ids: BTreeSet<_> = kept.iter().map(|d| d.replica_id).collect();
    let short: usize = elsewhere.iter().zip([2usize, 1]).map(|(have, want)| want - have).sum();
    assert_eq!((short, kept_ids.len()), (1, 1), "what was short was adopted: {kept:?}");
    assert!(kept_ids.iter().all(|id| on_a.iter().any(|d| d.replica_id == *id)));
    assert!(
        drain(&mut c).iter().all(
            |a| !matches!(a, Action::Apply(d) if d.create.iter().any(|d| kept_ids.contains(&d.replica_id)))
        ),
        "nothing adopted is started again"
    );
}

#[test]
fn a_model_needing_hardware_only_a_joining_node_has_is_placed_after_the_join() {
    let nodes = vec![node("a", 2, "gpu", 0)];
    let mut c = Controller::new(cluster(nodes, &[("h", 10, Some("h100"))]), 1, vec![fixed("h", 1)], 0);
    let first = drain(&mut c);
    assert!(first.iter().any(|a| matches!(a, Action::Unplaceable { reason, .. } if reason.contains("h100"))));
    tick(&mut c, 500);
    let waiting = c.blocked(&key("h")).expect("no node has the hardware").clone();
    assert!(waiting.retry_at > 700, "{waiting:?}");

    c.handle_node_joined(700, node("h1", 1, "h100", 0), &[]).unwrap();
    assert_eq!(c.poll_timeout(), 700, "the retry is due at once, not at the end of the back-off");
    tick(&mut c, 700);
    let actions = drain(&mut c);
    let created: Vec<&Deployment> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Apply(d) => Some(&d.create),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(created.len(), 1, "{actions:?}");
    assert_eq!(created[0].node, nid("h1"));
    assert!(actions.iter().any(|a| matches!(a, Action::Placeable { .. })));
    assert!(c.blocked(&key("h")).is_none());
}

#[test]
fn a_duplicate_node_is_refused_with_a_clear_error() {
    let nodes = vec![node("a", 2, "gpu", 0)];
    let mut c = Controller::new(cluster(nodes, &[("m", 10, None)]), 1, vec![fixed("m", 1)], 0);
    drain(&mut c);
    let before = c.cluster().snapshot();
    let err = c.handle_node_joined(1_000, node("a", 8, "h100", 0), &[]).unwrap_err();
    assert_eq!(err, AddNodeError::Duplicate(nid("a")));
    assert_eq!(err.to_string(), "node `a` is already in the cluster; remove it before adding it again");
    assert_eq!(c.cluster().snapshot(), before);
    assert_eq!(c.cluster().nodes().len(), 1);
    assert!(drain(&mut c).is_empty());
    // Lost, it may come back.
    c.handle_node_lost(2_000, &nid("a")).unwrap();
    assert!(c.handle_node_lost(2_000, &nid("a")).is_none(), "a loss reported twice finds nothing");
    c.handle_node_joined(3_000, node("a", 1, "gpu", 0), &[]).unwrap();
    tick(&mut c, 3_000);
    assert_eq!(hot(&c, "m").len(), 1);
}

/// A dedicated window's replica lost with its node comes back dedicated,
/// so no other model's placement can take its GPU while the window lasts.
#[test]
fn a_dedicated_replica_comes_back_dedicated() {
    let nodes = vec![node("a", 2, "gpu", 0), node("b", 2, "gpu", 0)];
    let hangar = ScalingConfig::Hangar(HangarSettings { scale_down_after_s: 5, ..HangarSettings::default() });
    let spec =
        ModelSpec { key: key("m"), scaling: hangar, bounds: Bounds { min: 0, max: 4 }, slo_ttft_ms: None };
    let mut c = Controller::new(cluster(nodes, &[("m", 30, None)]), 1, vec![spec], 0);
    let window = Window { model_key: key("m"), replicas: 2, start_ms: 0, end_ms: 100_000 };
    c.set_schedule(0, Schedule::new(vec![window]).unwrap());
    drain(&mut c);
    assert!(hot(&c, "m").len() == 2 && hot(&c, "m").iter().all(|d| d.dedicated));
    let lost_node = hot(&c, "m")[0].node.clone();

    c.handle_node_lost(10_000, &lost_node).unwrap();
    let Some(Action::Apply(delta)) = c.poll_action() else { panic!("the next action is not a placement") };
    assert!(!delta.create.is_empty() && delta.create.iter().all(|d| d.dedicated), "{delta:?}");
    let now_hot = hot(&c, "m");
    assert!(now_hot.len() == 2 && now_hot.iter().all(|d| d.dedicated && d.node != lost_node));
    c.cluster().check_invariants().unwrap();
}

// ---- properties ------------------------------------------------------

/// A node's description: GPUs (80 GB each), kind, warm cache GB.
type Spec = (u32, &'static str, u64);

#[derive(Debug, Clone)]
enum Op {
    /// A node joins as `n{0}`; the driver then handles what is due.
    Join(usize, Spec),
    /// Node `n{0}` is lost.
    Lose(usize),
    /// `secs` pass, the models observed and what is due handled.
    Tick(u64),
    /// An operator evicts one hot replica of a model (to WARM, room
    /// allowing), so losses take WARM replicas too.
    Evict(usize, usize),
}

#[derive(Debug, Clone)]
struct World {
    nodes: Vec<Spec>,
    /// Per model: GB and the replicas it is held at.
    models: Vec<(u64, u32)>,
    ops: Vec<Op>,
    seed: u64,
}

const NODE_IDS: usize = 6;

fn spec() -> impl Strategy<Value = Spec> {
    (0u32..7, prop::sample::select(vec!["gpu", "h100"]), prop::sample::select(vec![0u64, 100]))
}

/// Up to four nodes, models of 1 to 60 GB held at 0 to 3 replicas each
/// (model 0 needs `h100` GPUs), and at most 30 operations of at most
/// 10 s: the whole run stays under placement's one-hour minimum age, so
/// nothing is evicted for room and "room" means free GPU memory.
fn world() -> impl Strategy<Value = World> {
    (prop::collection::vec(spec(), 1..4), prop::collection::vec((1u64..60, 0u32..4), 1..5), any::<u64>())
        .prop_flat_map(|(nodes, models, seed)| {
            let m = models.len();
            let op = prop_oneof![
                2 => (0..NODE_IDS, spec()).prop_map(|(i, s)| Op::Join(i, s)),
                3 => (0..NODE_IDS).prop_map(Op::Lose),
                2 => (1u64..10).prop_map(Op::Tick),
                1 => (0..m, 0usize..8).prop_map(|(m, r)| Op::Evict(m, r)),
            ];
            (Just(nodes), Just(models), prop::collection::vec(op, 1..30), Just(seed))
                .prop_map(|(nodes, models, ops, seed)| World { nodes, models, ops, seed })
        })
}

fn model_key(i: usize) -> ModelKey {
    key(&format!("m{i}"))
}

fn node_of(i: usize, &(gpus, kind, cache): &Spec) -> NodeConfig {
    node(&format!("n{i}"), gpus, kind, cache)
}

/// Applies every action's delta to `state`, what the node agents run.
fn apply(state: &mut Snapshot, actions: &[Action]) -> Result<(), TestCaseError> {
    for a in actions {
        if let Action::Apply(delta) = a {
            delta.apply(state).map_err(|e| TestCaseError::fail(format!("{e}: {delta:?}")))?;
        }
    }
    Ok(())
}

/// Whether placement, as the cluster is now, has room for one more
/// replica of `model` beyond its `hot` ones without evicting anything.
fn room_for_one_more(c: &Controller, model: &ModelKey, hot: u32) -> bool {
    c.cluster().room_for(model, hot + 1, 0).placed > hot
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// After any sequence of joins, losses, ticks and evictions: the
    /// cluster's accounting holds, no deployment names a removed node, and
    /// the deltas the driver was given take its engines (less what each
    /// lost node took with it) exactly to the cluster's state. Right after
    /// a loss — before any timer — each model that lost HOT replicas is
    /// back at its count, or short only because no room is left for one
    /// more (and then backed off); right after a join (and the driver's
    /// handling of what that made due, at the same instant), so is every
    /// model that was backed off before it.
    #[test]
    fn after_a_loss_each_models_hot_count_is_restored_when_room_allows(w in world()) {
        let names: Vec<String> = (0..w.models.len()).map(|i| format!("m{i}")).collect();
        let sized: Vec<(&str, u64, Option<&str>)> = w
            .models
            .iter()
            .enumerate()
            .map(|(i, &(gb, _))| (names[i].as_str(), gb, (i == 0).then_some("h100")))
            .collect();
        let nodes = w.nodes.iter().enumerate().map(|(i, s)| node_of(i, s)).collect();
        let specs = w.models.iter().enumerate().map(|(i, &(_, n))| fixed(&names[i], n)).collect();
        let mut c = Controller::new(cluster(nodes, &sized), w.seed, specs, 0);
        let mut engines = Snapshot::default();
        apply(&mut engines, &drain(&mut c))?;
        let mut now: Millis = 0;
        for op in &w.ops {
            let mut check_models: Vec<ModelKey> = Vec::new();
            match op {
                Op::Join(i, s) => {
                    let known = c.cluster().node(&nid(&format!("n{i}"))).is_some();
                    let waiting: Vec<ModelKey> =
                        c.cluster().models().keys().filter(|m| c.blocked(m).is_some()).cloned().collect();
                    let result = c.handle_node_joined(now, node_of(*i, s), &[]);
                    prop_assert_eq!(result.is_err(), known);
                    if !known {
                        prop_assert!(c.poll_timeout() <= now || waiting.is_empty(), "the waiting retry at once");
                        check_models = waiting;
                    }
                    tick(&mut c, now);
                }
                Op::Lose(i) => {
                    let id = nid(&format!("n{i}"));
                    let held: Vec<Deployment> =
                        engines.deployments().values().filter(|d| d.node == id).cloned().collect();
                    let Some(mut lost) = c.handle_node_lost(now, &id) else {
                        prop_assert!(held.is_empty() && c.cluster().node(&id).is_none());
                        continue;
                    };
                    lost.sort_by_key(|d| d.replica_id);
                    prop_assert_eq!(&lost, &held, "the replicas reported lost are the node's");
                    // The driver drops what the node took with it.
                    engines = Snapshot::from_deployments(
                        engines.deployments().values().filter(|d| d.node != id).cloned(),
                    );
                    let short: BTreeSet<ModelKey> =
                        lost.iter().filter(|d| d.level == Level::Hot).map(|d| d.model_key.clone()).collect();
                    // Nothing is due in between: the next actions are the placement.
                    let actions: Vec<Action> = std::iter::from_fn(|| c.poll_action()).collect();
                    let applies = actions.iter().filter(|a| matches!(a, Action::Apply(_))).count();
                    prop_assert!(applies <= 1, "one batch, one delta: {:?}", actions);
                    if applies == 1 {
                        prop_assert!(matches!(actions[0], Action::Apply(_)), "{:?}", actions);
                    }
                    apply(&mut engines, &actions)?;
                    check_models = short.into_iter().collect();
                }
                Op::Tick(secs) => {
                    now += secs * 1_000;
                    tick(&mut c, now);
                }
                Op::Evict(m, pick) => {
                    let model = model_key(*m);
                    let hot: Vec<_> =
                        c.cluster().replicas_of(&model, Level::Hot).iter().map(|d| d.replica_id).collect();
                    if !hot.is_empty() {
                        c.evict(now, &model, Some(hot[pick % hot.len()])).unwrap();
                    }
                }
            }
            apply(&mut engines, &drain(&mut c))?;
            c.cluster().check_invariants().map_err(TestCaseError::fail)?;
            let state = c.cluster().snapshot();
            for d in state.deployments().values() {
                prop_assert!(c.cluster().node(&d.node).is_some(), "{} names a removed node", d.name());
            }
            prop_assert_eq!(&engines, &state, "the engines drifted from placement after {:?}", op);
            for model in &check_models {
                let hot = c.cluster().replicas_of(model, Level::Hot).len() as u32;
                let desired = c.scaler(model).unwrap().desired();
                if hot < desired {
                    prop_assert!(c.blocked(model).is_some(), "{} short ({}/{}) but not backed off", model, hot, desired);
                    prop_assert!(!room_for_one_more(&c, model, hot), "{} short ({}/{}) with room left after {:?}", model, hot, desired, op);
                } else {
                    prop_assert_eq!(hot, desired, "{}", model);
                }
            }
        }
    }
}

/// A lost node's replica is placed again on the node holding its model's
/// weights resident, whatever the seed: told by the controller's driver
/// (a fleet's leader, from the agents' reports), placement breaks the tie
/// between the two free nodes left. Residency named for a node or model
/// the controller does not know is refused and changes nothing.
#[test]
fn a_lost_replica_comes_back_where_its_weights_are_resident() {
    for seed in 0..40 {
        let nodes = vec![node("a", 1, "gpu", 0), node("b", 1, "gpu", 0), node("c", 1, "gpu", 0)];
        let mut c = Controller::new(cluster(nodes, &[("m", 30, None)]), seed, vec![fixed("m", 1)], 0);
        drain(&mut c);
        let lost = hot(&c, "m")[0].node.clone();
        let holder = ["a", "b", "c"].into_iter().map(nid).find(|n| *n != lost).unwrap();
        c.set_model_artifact(&key("m"), Some("hg1:w".into())).unwrap();
        c.set_resident(&holder, BTreeSet::from(["hg1:w".to_owned()])).unwrap();
        assert!(c.set_resident(&nid("ghost"), BTreeSet::new()).is_err());
        assert!(c.set_model_artifact(&key("nope"), Some("hg1:x".into())).is_err());
        c.handle_node_lost(1_000, &lost).unwrap();
        drain(&mut c);
        assert_eq!(hot(&c, "m")[0].node, holder, "seed {seed}: not placed where the weights are");
    }
}
