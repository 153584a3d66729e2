//! Property tests: random clusters, random operation sequences, and the
//! invariants checked after every operation.

mod common;

use std::collections::BTreeSet;

use common::*;
use hangar_core::ReplicaId;
use hangar_placement::{
    CandidateLevel, Cluster, ClusterConfig, DeployOutcome, DeploymentDelta, Eviction, EvictionCause, Level,
    ModelSpec, NodeConfig, PlacementConfig, ReplicaRequest, Schedule, Shape, Snapshot, Window,
};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone)]
enum Op {
    Deploy(Vec<(usize, u32, bool)>),
    EvictReplica(usize),
    EvictModel(usize),
    Schedule(Vec<(usize, u32, u64, u64)>),
    Advance(u64),
    /// A node (by index, modulo the nodes) draining or not any more.
    Drain(usize, bool),
}

#[derive(Debug, Clone)]
struct World {
    nodes: Vec<(u32, u64, u64)>,
    models: Vec<u64>,
    ops: Vec<Op>,
    seed: u64,
}

/// Any cluster, including none at all and nodes without GPUs.
fn world() -> impl Strategy<Value = World> {
    world_of(0..5, 0..5, vec![16, 24, 40, 80], 1..200, true)
}

/// Clusters where most models fit somewhere, so placements often evict.
fn busy_world() -> impl Strategy<Value = World> {
    world_of(1..5, 1..5, vec![40, 80], 1..100, true)
}

/// [`busy_world`] without draining nodes, for a property that compares
/// demotions to the warm cache (a draining node sends every one COLD).
fn busy_world_never_draining() -> impl Strategy<Value = World> {
    world_of(1..5, 1..5, vec![40, 80], 1..100, false)
}

fn world_of(
    node_count: std::ops::Range<usize>,
    gpus: std::ops::Range<u32>,
    gpu_gb: Vec<u64>,
    model_gb: std::ops::Range<u64>,
    drains: bool,
) -> impl Strategy<Value = World> {
    let nodes = prop::collection::vec(
        (gpus, prop::sample::select(gpu_gb), prop::sample::select(vec![0u64, 30, 100, 400])),
        node_count,
    );
    let models = prop::collection::vec(model_gb, 1..7);
    (nodes, models, any::<u64>()).prop_flat_map(move |(nodes, models, seed)| {
        let m = models.len();
        let op = prop_oneof![
            4 => prop::collection::vec((0..m, 0u32..4, prop::bool::weighted(0.2)), 1..4).prop_map(Op::Deploy),
            1 => (0usize..64).prop_map(Op::EvictReplica),
            1 => (0..m).prop_map(Op::EvictModel),
            1 => prop::collection::vec((0..m, 1u32..3, 0u64..4, 1u64..4), 0..3).prop_map(Op::Schedule),
            2 => (0u64..3).prop_map(Op::Advance),
        ];
        let op = match drains {
            true => {
                prop_oneof![10 => op, 1 => (0usize..8, any::<bool>()).prop_map(|(n, on)| Op::Drain(n, on))]
                    .boxed()
            }
            false => op.boxed(),
        };
        (Just(nodes), Just(models), prop::collection::vec(op, 1..25), Just(seed))
            .prop_map(|(nodes, models, ops, seed)| World { nodes, models, ops, seed })
    })
}

fn model_key(i: usize) -> hangar_core::ModelKey {
    key(&format!("m{i}"))
}

fn build(w: &World) -> Cluster {
    Cluster::new(config_of(w)).unwrap()
}

fn config_of(w: &World) -> ClusterConfig {
    ClusterConfig {
        nodes: w
            .nodes
            .iter()
            .enumerate()
            .map(|(i, &(gpus, mem, cache))| NodeConfig {
                id: format!("n{i}").parse().unwrap(),
                gpus,
                gpu_memory: Some(hangar_core::ByteSize::new(mem * GB)),
                gpu_kind: None,
                virtual_gpus: i % 2 == 1,
                cpu_cache: hangar_core::ByteSize::new(cache * GB),
            })
            .collect(),
        models: w
            .models
            .iter()
            .enumerate()
            .map(|(i, &gb)| {
                let spec = ModelSpec {
                    size: Some(hangar_core::ByteSize::new(gb * GB)),
                    adapter_memory: adapter_gb(w, i).map(|a| hangar_core::ByteSize::new(a * GB)),
                    hotswap: hotswap(w, i),
                    ..Default::default()
                };
                (model_key(i), spec)
            })
            .collect(),
        placement: PlacementConfig { hotswap_min_age_ms: hotswap_min_age_ms(w), ..Default::default() },
    }
}

/// Whether model `i` is in the hotswap tier: one model in three, drawn
/// from the world's seed (bits the adapter memory does not use).
fn hotswap(w: &World, i: usize) -> bool {
    (w.seed >> (32 + 2 * i)) % 3 == 0
}

/// The world's `hotswap_min_age_ms`, drawn from its seed: none, the
/// default, or exactly the age of a replica one single-hour `Advance` old
/// (an advance moves the clock by whole hours and 1 ms), or two.
fn hotswap_min_age_ms(w: &World) -> u64 {
    [0, 60_000, HOUR + 1, 2 * HOUR + 2][(w.seed >> 60) as usize % 4]
}

fn model_index(m: &hangar_core::ModelKey) -> usize {
    m.as_str()[1..].parse().expect("models are m0, m1, …")
}

/// The GPU memory model `i`'s replicas set aside for LoRA adapters, in
/// GB, if it loads any: none, 1 or 4 GB, drawn from the world's seed.
fn adapter_gb(w: &World, i: usize) -> Option<u64> {
    match (w.seed >> (2 * i)) % 3 {
        0 => None,
        1 => Some(1),
        _ => Some(4),
    }
}

/// [`build`] with model 0 requiring virtual GPUs (the odd nodes) and
/// model 1 GPUs of 80 GB.
fn build_with_requirements(w: &World) -> Cluster {
    let mut config = config_of(w);
    if let Some(spec) = config.models.get_mut(&model_key(0)) {
        spec.gpu_kind = Some("virtual".into());
    }
    if let Some(spec) = config.models.get_mut(&model_key(1)) {
        spec.min_gpu_memory = Some(hangar_core::ByteSize::new(80 * GB));
    }
    Cluster::new(config).unwrap()
}

/// What an operation did, for the checks.
struct Step {
    evictions: Vec<Eviction>,
    deploys: Vec<DeployOutcome>,
    /// Models whose dedicated replicas may lose protection in this step
    /// (they left the schedule).
    released: BTreeSet<hangar_core::ModelKey>,
    /// How many nodes [`check_tier`]'s (b) examined that held a hotswap
    /// replica the failed deploy could have taken (so the check weighed
    /// something).
    tier_examined: usize,
}

fn apply(c: &mut Cluster, op: &Op, now: &mut u64, rng: &mut ChaCha8Rng) -> Step {
    let mut step = Step { evictions: vec![], deploys: vec![], released: BTreeSet::new(), tier_examined: 0 };
    match op {
        Op::Deploy(reqs) => {
            let reqs: Vec<ReplicaRequest> = reqs
                .iter()
                .map(|&(m, replicas, dedicated)| ReplicaRequest {
                    model_key: model_key(m),
                    replicas,
                    dedicated,
                })
                .collect();
            step.deploys.push(c.deploy(&reqs, *now, rng));
        }
        Op::EvictReplica(pick) => {
            let all: Vec<(hangar_core::ModelKey, ReplicaId)> =
                c.snapshot().deployments().values().map(|d| (d.model_key.clone(), d.replica_id)).collect();
            if !all.is_empty() {
                let (m, r) = &all[pick % all.len()];
                step.evictions = c.evict_replica(m, r).unwrap();
            }
        }
        Op::EvictModel(m) => step.evictions = c.evict_model(&model_key(*m)),
        Op::Schedule(windows) => {
            let windows: Vec<Window> = windows
                .iter()
                .map(|&(m, replicas, start, len)| Window {
                    model_key: model_key(m),
                    replicas,
                    start_ms: start * HOUR,
                    end_ms: (start + len) * HOUR,
                })
                .collect();
            let schedule = Schedule::new(windows).unwrap();
            let active: BTreeSet<_> = schedule.requests_at(*now).into_iter().map(|r| r.model_key).collect();
            step.released = c.snapshot().deployments().values().map(|d| d.model_key.clone()).collect();
            step.released.retain(|m| !active.contains(m));
            step.deploys.push(c.apply_schedule(&schedule, *now, rng));
        }
        Op::Advance(hours) => *now += hours * HOUR + 1,
        Op::Drain(n, on) => {
            let ids: Vec<_> = c.nodes().iter().map(|node| node.id().clone()).collect();
            if !ids.is_empty() {
                c.set_draining(&ids[n % ids.len()], *on).unwrap();
            }
        }
    }
    step
}

/// Applies `op` to `c` and holds the result to every property ([`check`]).
fn step_checked(
    w: &World,
    c: &mut Cluster,
    op: &Op,
    now: &mut u64,
    rng: &mut ChaCha8Rng,
) -> Result<Step, TestCaseError> {
    let (before, rng_before, at) = (c.clone(), rng.clone(), *now);
    let mut step = apply(c, op, now, rng);
    check(w, &before.snapshot(), c, &step)?;
    step.tier_examined = check_tier(w, &before, &rng_before, at, op, c, &step)?;
    Ok(step)
}

fn check(w: &World, before: &Snapshot, c: &Cluster, step: &Step) -> Result<(), TestCaseError> {
    // Accounting: no GPU over-committed, free + reserved = total, caches in
    // budget, ids unique, each replica in at most one of hot / warm.
    c.check_invariants().map_err(TestCaseError::fail)?;
    let after = c.snapshot();
    // Adapters count: every hot replica holds its weights and its model's
    // adapter memory on its GPUs (which, by the invariants above, no GPU
    // exceeds).
    for d in after.deployments().values().filter(|d| d.level == hangar_placement::Level::Hot) {
        let i: usize = d.model_key.as_str()[1..].parse().expect("models are m0, m1, …");
        let wanted = (w.models[i] + adapter_gb(w, i).unwrap_or(0)) * GB;
        let held: u64 = d.gpu_bytes_by_gpu.values().sum();
        prop_assert!(
            held >= wanted,
            "{} holds {held} bytes on its GPUs, less than its weights and adapters ({wanted})",
            d.name()
        );
    }

    // delta(old, new) applied to old = new.
    let delta = DeploymentDelta::between(before, &after).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut replay = before.clone();
    delta.apply(&mut replay).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(&replay, &after);

    // Releases precede claims.
    let actions: Vec<_> = delta.steps().map(|s| s.action).collect();
    let first_claim = actions
        .iter()
        .position(|a| matches!(a, hangar_placement::Action::Create | hangar_placement::Action::FromCache));
    if let Some(i) = first_claim {
        prop_assert!(actions[i..]
            .iter()
            .all(|a| !matches!(a, hangar_placement::Action::Delete | hangar_placement::Action::ToCache)));
    }

    // Dedicated deployments are never evicted by pressure (or dropped from
    // a cache for room), unless the schedule just released their model.
    let pressure = step
        .deploys
        .iter()
        .flat_map(|d| &d.evictions)
        .chain(&step.evictions)
        .filter(|e| !matches!(e.cause, EvictionCause::Explicit));
    for e in pressure {
        if let Some(old) = before.deployments().get(&e.replica_id) {
            prop_assert!(
                !old.dedicated || step.released.contains(&old.model_key),
                "dedicated {} evicted by {:?}",
                old.name(),
                e.cause
            );
        }
    }

    // Draining nodes take nothing new: whatever is on one was there, at
    // the same level, before the step (or is gone).
    for d in after.deployments().values() {
        let node = c.node(&d.node).expect("deployments are on nodes");
        if node.draining() {
            let was = before.deployments().get(&d.replica_id);
            prop_assert!(
                was.is_some_and(|b| b.level == d.level && b.node == d.node),
                "{} is {:?} on draining {}, where it was {:?}",
                d.name(),
                d.level,
                d.node,
                was.map(|b| (b.level, &b.node))
            );
        }
    }
    // A model placed in full has its count off the draining nodes.
    for m in step.deploys.iter().flat_map(|d| &d.models) {
        if m.replicas.iter().all(|r| r.level != CandidateLevel::CantAccommodate) {
            prop_assert!(
                c.count_staying(&m.model_key) >= m.requested as usize,
                "{} placed in full, yet {} of {} off draining nodes",
                m.model_key,
                c.count_staying(&m.model_key),
                m.requested
            );
        }
    }

    // Every placed replica is hot where the outcome says.
    for out in &step.deploys {
        for m in &out.models {
            for r in &m.replicas {
                match r.level {
                    CandidateLevel::CantAccommodate => prop_assert!(r.reason.is_some()),
                    level => {
                        let d = after.deployments().get(&r.replica_id.unwrap());
                        let d = d.ok_or_else(|| TestCaseError::fail("placed replica missing"))?;
                        prop_assert_eq!(d.level, Level::Hot);
                        prop_assert_eq!(Some(&d.node), r.node.as_ref());
                        if level <= CandidateLevel::Free {
                            prop_assert_eq!(r.eviction_cost.count, 0);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// The hotswap tier's rules, after `op` took `before` (with `rng_before`,
/// at `now`) to `after`:
///
/// * (a) no hotswap ask evicted a replica outside the tier; every pressure
///   eviction follows the tier's table: a hotswap ask evicts a hotswap
///   replica at least `hotswap_min_age_ms` old unless the ask is
///   dedicated, an ask outside the tier evicts a replica outside it at
///   least `min_deployment_age_ms` old unless dedicated, and evicts a
///   hotswap one at any age;
/// * (b) a non-dedicated deploy of a model outside the tier never leaves a
///   replica unplaced when evicting every hotswap replica it may evict
///   (every one not dedicated and not kept by the same call) on some node
///   that admits the model and is not draining would have made room. The state the replica
///   failed in is rebuilt by deploying, from `before` and `rng_before`,
///   the batch's models up to that one in `deploy`'s order (largest first,
///   then key): the same draws, so the same outcome, which is checked too.
///
/// Dedicated replicas are never evicted by pressure ([`check`]). Returns
/// how many nodes (b) examined that held a hotswap replica it could take.
fn check_tier(
    w: &World,
    before: &Cluster,
    rng_before: &ChaCha8Rng,
    now: u64,
    op: &Op,
    after: &Cluster,
    step: &Step,
) -> Result<usize, TestCaseError> {
    let old = before.snapshot();
    let config = after.config();
    let in_tier = |m: &hangar_core::ModelKey| hotswap(w, model_index(m));
    for out in &step.deploys {
        for e in &out.evictions {
            let EvictionCause::Pressure { model_key: asker, .. } = &e.cause else { continue };
            let victim = old.deployments().get(&e.replica_id);
            let victim = victim
                .ok_or_else(|| TestCaseError::fail(format!("{} evicted but was not there", e.replica_id)))?;
            let dedicated = out.models.iter().any(|m| &m.model_key == asker && m.dedicated);
            let age = now.saturating_sub(victim.deployed_at_ms);
            let allowed = match (in_tier(asker), in_tier(&victim.model_key)) {
                (true, false) => false,
                (false, true) => true,
                (true, true) => dedicated || age >= config.hotswap_min_age_ms,
                (false, false) => dedicated || age >= config.min_deployment_age_ms,
            };
            prop_assert!(
                allowed,
                "{asker} (hotswap {}, dedicated {dedicated}) evicted {} (hotswap {}, {age} ms old)",
                in_tier(asker),
                victim.name(),
                in_tier(&victim.model_key)
            );
        }
    }

    let Op::Deploy(reqs) = op else { return Ok(0) };
    let mut examined = 0;
    let requests: Vec<ReplicaRequest> = reqs
        .iter()
        .map(|&(m, replicas, dedicated)| ReplicaRequest { model_key: model_key(m), replicas, dedicated })
        .collect();
    let order = |m: &hangar_core::ModelKey| (std::cmp::Reverse(before.model_size(m)), m.clone());
    for failed in step.deploys.iter().flat_map(|d| &d.models) {
        let unplaced = failed.replicas.iter().any(|r| r.level == CandidateLevel::CantAccommodate);
        if !unplaced || failed.dedicated || in_tier(&failed.model_key) {
            continue;
        }
        let prefix: Vec<ReplicaRequest> =
            requests.iter().filter(|r| order(&r.model_key) <= order(&failed.model_key)).cloned().collect();
        let mut then = before.clone();
        let replay = then.deploy(&prefix, now, &mut rng_before.clone());
        let again = replay.models.iter().find(|m| m.model_key == failed.model_key);
        prop_assert_eq!(
            again,
            Some(failed),
            "replaying the batch up to {} did not fail alike",
            failed.model_key
        );
        let kept: BTreeSet<&hangar_core::ModelKey> = prefix.iter().map(|r| &r.model_key).collect();
        let size = then.model_size(&failed.model_key).expect("in the catalogue");
        let requires = then.requirement(&failed.model_key);
        for node in then.nodes() {
            if node.draining() || requires.is_some_and(|r| !r.admits(node.gpu_kind(), node.gpu_memory())) {
                continue;
            }
            let Some(shape) = Shape::for_model(then.config(), size, node.gpu_memory()) else { continue };
            // The node's GPUs with every hotswap replica it may evict gone.
            let mut free: Vec<u64> = node.gpus().iter().map(|g| g.free_bytes).collect();
            let mut tenants: Vec<u32> = node.gpus().iter().map(|g| g.tenants).collect();
            let swappable: Vec<_> = node
                .hot()
                .iter()
                .filter(|(m, _)| in_tier(m) && !kept.contains(m))
                .flat_map(|(_, replicas)| replicas.values())
                .filter(|d| !d.dedicated)
                .collect();
            examined += usize::from(!swappable.is_empty());
            for d in swappable {
                for (&g, &bytes) in &d.gpu_bytes_by_gpu {
                    free[g as usize] += bytes;
                    tenants[g as usize] -= 1;
                }
            }
            let room = match shape {
                Shape::Share { need_free, .. } => free.iter().any(|&f| f >= need_free),
                Shape::Whole { gpus } => tenants.iter().filter(|&&t| t == 0).count() >= gpus as usize,
            };
            prop_assert!(
                !room,
                "{} left a replica unplaced ({:?}) where evicting the hotswap replicas on {} alone made room",
                failed.model_key,
                failed.replicas.iter().find_map(|r| r.reason.as_ref()),
                node.id()
            );
        }
    }
    Ok(examined)
}

fn run(w: &World) -> Result<Snapshot, TestCaseError> {
    run_with(w, |_| {}).map(|(snapshot, _)| snapshot)
}

/// Like [`run`], with `setup` applied to the fresh cluster first; also
/// returns every deploy outcome, for comparing runs draw for draw.
fn run_with(
    w: &World,
    setup: impl Fn(&mut Cluster),
) -> Result<(Snapshot, Vec<DeployOutcome>), TestCaseError> {
    let mut c = build(w);
    setup(&mut c);
    let mut rng = ChaCha8Rng::seed_from_u64(w.seed);
    let mut now = 0;
    let mut outcomes = Vec::new();
    for op in &w.ops {
        let step = step_checked(w, &mut c, op, &mut now, &mut rng)?;
        outcomes.extend(step.deploys);
    }
    Ok((c.snapshot(), outcomes))
}

/// Random weight residency: per model, an artifact out of three (or none),
/// so models may share one; per node, the artifacts it holds resident.
#[derive(Debug, Clone)]
struct Residency {
    artifacts: Vec<Option<usize>>,
    resident: Vec<BTreeSet<usize>>,
}

fn residency() -> impl Strategy<Value = Residency> {
    (
        prop::collection::vec(prop::option::weighted(0.8, 0usize..3), 6),
        prop::collection::vec(prop::collection::btree_set(0usize..3, 0..3), 5),
    )
        .prop_map(|(artifacts, resident)| Residency { artifacts, resident })
}

fn artifact(i: usize) -> String {
    format!("hg1:a{i}")
}

/// Tells `c` about `r` (entries past the cluster's models or nodes are dropped).
fn set_residency(c: &mut Cluster, r: &Residency) {
    let models: Vec<_> = c.models().keys().cloned().collect();
    for m in models {
        let i: usize = m.as_str()[1..].parse().unwrap();
        c.set_model_artifact(&m, r.artifacts[i].map(artifact)).unwrap();
    }
    let nodes: Vec<_> = c.nodes().iter().map(|n| n.id().clone()).collect();
    for (id, set) in nodes.iter().zip(&r.resident) {
        c.set_resident(id, set.iter().map(|&a| artifact(a)).collect()).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_after_every_operation(w in world()) {
        run(&w)?;
    }

    /// A model that requires hardware is only ever hot or warm on nodes
    /// that have it, and a replica it could not place says so when no node
    /// has it.
    #[test]
    fn models_run_only_on_the_hardware_they_require(w in world()) {
        let mut c = build_with_requirements(&w);
        let mut rng = ChaCha8Rng::seed_from_u64(w.seed);
        let mut now = 0;
        let admits = |c: &Cluster, m: usize, node: &hangar_placement::Node| {
            c.requirement(&model_key(m)).is_none_or(|r| r.admits(node.gpu_kind(), node.gpu_memory()))
        };
        for op in &w.ops {
            let step = step_checked(&w, &mut c, op, &mut now, &mut rng)?;
            for node in c.nodes() {
                for (model, _) in node.hot().iter().chain(node.warm().iter()) {
                    let m: usize = model.as_str()[1..].parse().unwrap();
                    prop_assert!(admits(&c, m, node), "{model} on {} ({}, {} B)", node.id(), node.gpu_kind(), node.gpu_memory());
                }
            }
            let none_has = |m: usize| !c.nodes().iter().any(|n| !n.gpus().is_empty() && admits(&c, m, n));
            for outcome in step.deploys.iter().flat_map(|d| &d.models) {
                let m: usize = outcome.model_key.as_str()[1..].parse().unwrap();
                for r in outcome.replicas.iter().filter(|r| r.level == CandidateLevel::CantAccommodate) {
                    if m < 2 && none_has(m) && !c.nodes().is_empty() {
                        let reason = r.reason.as_ref().map(ToString::to_string).unwrap_or_default();
                        prop_assert!(reason.starts_with("no node has GPUs"), "{reason}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_same_seed_and_operations_give_the_same_cluster(w in world()) {
        prop_assert_eq!(run(&w)?, run(&w)?);
    }

    /// `deploy` stops early and bounds its search; what it picks must still
    /// be the best of every node's exhaustive answer: the lowest level, then
    /// the fewest HOT replicas of the model there, then the cheapest set.
    #[test]
    fn deploy_picks_the_best_candidate(w in busy_world(), pick in 0usize..16, dedicated: bool) {
        let mut c = build(&w);
        let mut rng = ChaCha8Rng::seed_from_u64(w.seed);
        let mut now = 0;
        for op in &w.ops {
            apply(&mut c, op, &mut now, &mut rng);
        }
        let model = model_key(pick % w.models.len());
        grow_one_checked(&mut c, &model, dedicated, now, &mut rng).map_err(TestCaseError::fail)?;
        c.check_invariants().map_err(TestCaseError::fail)?;
    }

    /// The residency tie-breaker never overrides a better candidate level
    /// or a cheaper eviction set: from the same state and seed, one more
    /// replica lands at the same level, for the same cost, as it does with
    /// no residency information at all.
    #[test]
    fn residency_never_changes_the_level_or_the_eviction_cost(
        w in busy_world(),
        r in residency(),
        pick in 0usize..16,
        dedicated: bool,
    ) {
        let mut plain = build(&w);
        let mut rng = ChaCha8Rng::seed_from_u64(w.seed);
        let mut now = 0;
        for op in &w.ops {
            apply(&mut plain, op, &mut now, &mut rng);
        }
        let mut informed = plain.clone();
        set_residency(&mut informed, &r);
        let model = model_key(pick % w.models.len());
        // The staying replicas, which `deploy` counts: one more than those
        // is one replica placed (a leaving one on a draining node is not
        // counted, and asking past it would place two, the second from
        // states the first's tie-break already made differ).
        let hot = plain.count_staying(&model) as u32;
        let request = ReplicaRequest { model_key: model, replicas: hot + 1, dedicated };
        let a = plain.deploy(std::slice::from_ref(&request), now, &mut ChaCha8Rng::seed_from_u64(pick as u64));
        let b = informed.deploy(&[request], now, &mut ChaCha8Rng::seed_from_u64(pick as u64));
        let (a, b) = (a.models[0].replicas.last().unwrap(), b.models[0].replicas.last().unwrap());
        prop_assert_eq!(a.level, b.level);
        prop_assert_eq!(a.eviction_cost, b.eviction_cost);
        informed.check_invariants().map_err(TestCaseError::fail)?;
    }

    /// With residency in play from the start (so every operation goes
    /// through the tie-breaker, and the invariants are checked after each):
    /// when some node of the chosen level's tie set (same level, fewest HOT
    /// replicas of the model, same eviction cost) holds the model's
    /// artifact, the chosen node holds it.
    #[test]
    fn a_resident_node_in_the_tie_set_is_always_chosen(
        w in busy_world(),
        r in residency(),
        pick in 0usize..16,
        dedicated: bool,
    ) {
        let mut c = build(&w);
        set_residency(&mut c, &r);
        let mut rng = ChaCha8Rng::seed_from_u64(w.seed);
        let mut now = 0;
        for op in &w.ops {
            step_checked(&w, &mut c, op, &mut now, &mut rng)?;
        }
        let model = model_key(pick % w.models.len());
        let candidates = c.candidates(&model, dedicated, now);
        let hot = c.count_staying(&model) as u32;
        let request = ReplicaRequest { model_key: model, replicas: hot + 1, dedicated };
        let out = c.deploy(&[request], now, &mut rng);
        let placed = out.models[0].replicas.last().unwrap();
        let Some(node) = placed.node.as_ref() else { return Ok(()) };
        if placed.level == CandidateLevel::Deployed {
            return Ok(());
        }
        let fewest = candidates.iter().filter(|c| c.level == placed.level).map(|c| c.hot_replicas).min();
        let ties: Vec<_> = candidates
            .iter()
            .filter(|c| c.level == placed.level && Some(c.hot_replicas) == fewest)
            .filter(|c| c.eviction_cost == placed.eviction_cost)
            .collect();
        let chosen = ties.iter().find(|c| &c.node == node);
        let chosen = chosen.ok_or_else(|| TestCaseError::fail("the chosen node is not in the tie set"))?;
        if ties.iter().any(|c| c.resident) {
            prop_assert!(chosen.resident, "{} chosen over a resident tie", node);
        }
    }

    /// Residency that selects no tie or every tie (no artifacts set, no node
    /// holding them, or every node holding all of them) changes nothing:
    /// same outcomes, same rng draws, same final cluster, operation for
    /// operation.
    #[test]
    fn residency_that_cannot_break_a_tie_changes_nothing(w in world(), r in residency(), mode in 0u8..3) {
        let plain = run_with(&w, |_| {})?;
        let informed = run_with(&w, |c| {
            let mut r = r.clone();
            match mode {
                0 => r.artifacts.iter_mut().for_each(|a| *a = None),
                1 => r.resident.iter_mut().for_each(BTreeSet::clear),
                _ => r.resident.iter_mut().for_each(|s| *s = (0..3).collect()),
            }
            set_residency(c, &r);
        })?;
        prop_assert_eq!(plain, informed);
    }
}

/// A model whose engine cannot sleep takes no warm-cache room. The cluster
/// is told which models cannot sleep at a random point of a random run (as
/// a driver learns it from the first engine that starts); from then on
/// every demotion of such a model's HOT replica goes COLD, never WARM, no
/// WARM entry is dropped to make room for one, and evicting such a model
/// (or one of its HOT replicas) leaves every warm cache exactly as it was.
/// Each step is also replayed on a copy told that every model sleeps: the
/// test only counts as having checked something if, there, such a
/// replica went WARM or a WARM entry was dropped for it.
#[test]
fn a_model_that_cannot_sleep_takes_no_warm_cache_room() {
    let strategy = (busy_world_never_draining(), prop::collection::vec(any::<bool>(), 6), 0usize..25);
    let meaningful = run_counting(512, strategy, |(w, sleeps, told)| {
        let mut meaningful = 0;
        let mut c = build(&w);
        let mut rng = ChaCha8Rng::seed_from_u64(w.seed);
        let mut now = 0;
        let models: Vec<_> = c.models().keys().cloned().collect();
        let sleeps_of = |m: &hangar_core::ModelKey| sleeps[m.as_str()[1..].parse::<usize>().unwrap()];
        let warm_ids = |c: &Cluster| -> BTreeSet<ReplicaId> {
            c.snapshot()
                .deployments()
                .values()
                .filter(|d| d.level == Level::Warm)
                .map(|d| d.replica_id)
                .collect()
        };
        for (i, op) in w.ops.iter().enumerate() {
            if i == told {
                for m in &models {
                    c.set_sleeps(m, sleeps_of(m)).unwrap();
                }
            }
            let known = i >= told;
            let before = c.snapshot();
            let warm_before = warm_ids(&c);
            let mut all_sleep = c.clone();
            let mut other_rng = rng.clone();
            let mut other_now = now;
            let step = step_checked(&w, &mut c, op, &mut now, &mut rng)?;
            if !known {
                continue;
            }
            for m in &models {
                prop_assert_eq!(c.sleeps(m), sleeps_of(m));
            }
            let sleepless = |replica: &ReplicaId| {
                before.deployments().get(replica).is_some_and(|d| !sleeps_of(&d.model_key))
            };
            let evictions = step.deploys.iter().flat_map(|d| &d.evictions).chain(&step.evictions);
            for e in evictions {
                if e.from == Level::Hot && !sleeps_of(&e.model_key) {
                    prop_assert_eq!(e.to, Level::Cold, "{} cannot sleep but went {}", e.model_key, e.to);
                }
                if let EvictionCause::CacheRoom { replica_id } = &e.cause {
                    prop_assert!(
                        !sleepless(replica_id),
                        "{} dropped for a model that cannot sleep",
                        e.replica_id
                    );
                }
            }
            for d in c.snapshot().deployments().values().filter(|d| d.level == Level::Warm) {
                prop_assert!(
                    sleeps_of(&d.model_key) || warm_before.contains(&d.replica_id),
                    "{} went WARM though its engine cannot sleep",
                    d.name()
                );
            }
            let evicts_sleepless_hot = match op {
                Op::EvictModel(m) => !sleeps_of(&model_key(*m)),
                Op::EvictReplica(pick) => {
                    let all: Vec<_> = before.deployments().values().collect();
                    !all.is_empty() && {
                        let d = all[pick % all.len()];
                        d.level == Level::Hot && !sleeps_of(&d.model_key)
                    }
                }
                _ => false,
            };
            if evicts_sleepless_hot {
                prop_assert_eq!(warm_ids(&c), warm_before.clone(), "the warm caches changed");
            }
            // The same step where every model sleeps: did the rule matter?
            for m in &models {
                all_sleep.set_sleeps(m, true).unwrap();
            }
            let other = apply(&mut all_sleep, op, &mut other_now, &mut other_rng);
            let mattered = other.deploys.iter().flat_map(|d| &d.evictions).chain(&other.evictions).any(|e| {
                (e.to == Level::Warm && !sleeps_of(&e.model_key))
                    || matches!(&e.cause, EvictionCause::CacheRoom { replica_id } if sleepless(replica_id))
            });
            meaningful += usize::from(mattered);
        }
        Ok(meaningful)
    });
    assert!(meaningful >= 100, "only {meaningful} steps where the rule changed anything");
}

/// The tier's rules are checked after every operation of every test above
/// ([`check_tier`]); this counts, on busy fleets, the steps where they
/// decided something, so those checks are known to weigh real cases: a
/// hotswap replica younger than `min_deployment_age_ms` evicted for a model
/// outside the tier (the tier yielding at once), a hotswap replica evicted
/// for another hotswap model, a swap (a hotswap replica woken from a warm
/// cache), and a failed deploy weighed against a node holding hotswap
/// replicas it could have taken.
#[test]
fn the_hotswap_tier_decides_something_on_busy_fleets() {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    let (swap_for_swap, swaps, examined) = (AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0));
    let yielded = run_counting(512, busy_world(), |w| {
        let mut yielded = 0;
        let mut c = build(&w);
        let mut rng = ChaCha8Rng::seed_from_u64(w.seed);
        let mut now = 0;
        for op in &w.ops {
            let before = c.snapshot();
            let step = step_checked(&w, &mut c, op, &mut now, &mut rng)?;
            examined.fetch_add(step.tier_examined, Relaxed);
            for out in &step.deploys {
                swaps.fetch_add(out.swaps(), Relaxed);
                for e in &out.evictions {
                    let EvictionCause::Pressure { model_key: asker, .. } = &e.cause else { continue };
                    let victim = &before.deployments()[&e.replica_id];
                    match (hotswap(&w, model_index(asker)), hotswap(&w, model_index(&e.model_key))) {
                        (false, true) => yielded += usize::from(now - victim.deployed_at_ms < HOUR),
                        (true, true) => _ = swap_for_swap.fetch_add(1, Relaxed),
                        _ => {}
                    }
                }
                for r in out.models.iter().flat_map(|m| &m.replicas) {
                    let swap = r.swap;
                    // WARM before the step, or sent to the warm cache by an
                    // earlier ask of the same batch and woken by a later one.
                    let warm = |id: &ReplicaId| {
                        before.deployments().get(id).is_some_and(|d| d.level == Level::Warm)
                            || out.evictions.iter().any(|e| e.replica_id == *id)
                    };
                    let expected = r.replica_id.is_some_and(|id| {
                        matches!(r.level, CandidateLevel::CachedAndFree | CandidateLevel::CachedAndFull)
                            && warm(&id)
                            && before
                                .deployments()
                                .get(&id)
                                .is_some_and(|d| hotswap(&w, model_index(&d.model_key)))
                    });
                    prop_assert_eq!(swap, expected, "swap flag of {:?} at {}", r.replica_id, r.level);
                }
            }
        }
        Ok(yielded)
    });
    let (swap_for_swap, swaps, examined) =
        (swap_for_swap.into_inner(), swaps.into_inner(), examined.into_inner());
    eprintln!("young hotswap replicas yielded: {yielded}, swaps for swaps: {swap_for_swap}, swaps: {swaps}, failed deploys weighed: {examined}");
    // Over 512 worlds each count runs in the tens to about a hundred
    // (26 to 130 over several runs); the floors are a quarter of the least.
    assert!(yielded >= 20, "only {yielded} young hotswap replicas yielded to a model outside the tier");
    assert!(swap_for_swap >= 12, "only {swap_for_swap} hotswap replicas evicted for another");
    assert!(swaps >= 20, "only {swaps} swaps");
    assert!(examined >= 6, "only {examined} nodes with hotswap replicas weighed for a failed deploy");
}
