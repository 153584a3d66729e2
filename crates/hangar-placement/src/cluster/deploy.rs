//! [`Cluster::deploy`]: turning "N replicas of model M" into placements.
//!
//! For each missing replica every node is judged, and the best
//! [`CandidateLevel`] wins, ties broken by the caller's rng. The search runs
//! level by level and stops at the first level that has a candidate, so the
//! common case (some node has room) costs O(1) per node: each node keeps its
//! largest free GPU and its count of empty GPUs up to date. Only when no node
//! has room does it run the exact eviction search (see [`crate::eviction`]),
//! best-first: nodes are visited in order of a cheap lower bound on the bytes
//! they must evict (for a share, the least over GPUs of the larger of the
//! shortfall and the smallest reservation there; for k whole GPUs, the bytes
//! used on the k least-used GPUs), each search is
//! bounded by the best set found so far, and the scan stops once the bound
//! exceeds it. Among nodes that need evictions, the one evicting the fewest
//! bytes (then the fewest deployments) wins, and ties go to the rng.
//!
//! Spread comes first within every level: among the candidates of the
//! level chosen, only the nodes holding the fewest HOT replicas of the
//! model are considered (for the evicting levels, the best-first scan runs
//! over the nodes without one, then — only if none of them can make room —
//! over those with one, and so on), so a model's replicas land on distinct
//! nodes for as long as nodes without one can take one at the level
//! chosen, and losing a node takes out as few of them as it can. It never changes the level:
//! a WARM copy on a node that already runs the model is still woken before
//! a fresh replica is created elsewhere (a wake takes a second, a load
//! minutes). It does come before the eviction cost: evicting a few more
//! bytes elsewhere is the price of not stacking a model's replicas on one
//! node. A model with no HOT replica, or the same number on every
//! candidate, draws exactly as it did before spread existed.
//!
//! The hotswap tier ([`crate::ModelSpec::hotswap`]) enters through what
//! an ask may evict ([`Ask::may_evict`]) and through the eviction cost: on
//! each node the hotswap replicas the ask may evict are searched alone
//! first, and a set of them beats any set that takes a non-hotswap replica
//! (`evicting_room`). The cost's order puts that before bytes, while the
//! best-first scan's bound is on bytes, so once the bound passes a best set
//! that takes a non-hotswap replica, the scan still visits the nodes left
//! that hold a hotswap replica ([`Cluster::scan_evicting`]). Without
//! hotswap models every step is what it was before the tier existed.
//!
//! Weight residency is the last tie-breaker before the rng: within a level's
//! tie set (warm copies, free nodes, or equal-cost eviction plans, on the
//! nodes with the fewest HOT replicas of the model), if some
//! but not all nodes hold the model's weight artifact resident, the draw is
//! among those only. It is applied after the level and the eviction cost are
//! settled, so it can never trade either for a warm page cache: residency
//! only saves reading weights from storage, while a worse level or a
//! costlier eviction set takes room from other replicas.
//! When it selects nothing or everything the draw is over the original tie
//! set, so without residency information the rng draws, and every outcome,
//! are exactly what they were before residency existed.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use hangar_core::{Millis, ModelKey, ReplicaId};
use rand::{Rng, SeedableRng};

use super::{fraction, Cluster};
use crate::candidate::{Candidate, CandidateLevel, Shape};
use crate::config::MAX_GPUS_PER_NODE;
use crate::deployment::{Deployment, Level};
use crate::eviction::{min_clear, min_cover, Clearable, EvictionCost, Item};
use crate::node::Node;
use crate::outcome::{
    DeployOutcome, Eviction, EvictionCause, Fit, ModelOutcome, ReplicaOutcome, ReplicaRequest, Unplaceable,
};
use crate::schedule::Schedule;
use crate::sizing::Requirement;

/// One way to host one more replica.
#[derive(Debug, Clone)]
struct Plan {
    node: usize,
    level: CandidateLevel,
    /// The warm replica to promote, if any.
    warm: Option<ReplicaId>,
    alloc: BTreeMap<u32, u64>,
    fraction: f64,
    evict: Vec<(ModelKey, ReplicaId)>,
    cost: EvictionCost,
}

/// The replica being placed, and what it may evict.
struct Ask<'a> {
    model: &'a ModelKey,
    size: u64,
    /// The hardware the model requires, if any.
    requires: Option<&'a Requirement>,
    dedicated: bool,
    now: Millis,
    /// Replicas this call placed or counted as deployed: never evicted by it
    /// (else a later model of the batch could undo an earlier one).
    kept: &'a BTreeSet<ReplicaId>,
    /// `min_deployment_age_ms`: how old a non-hotswap replica must be for a
    /// non-dedicated non-hotswap ask to evict it.
    min_age: Millis,
    /// The models in the hotswap tier.
    tier: &'a BTreeSet<ModelKey>,
    /// Whether the model placed is in it.
    hotswap: bool,
    /// `hotswap_min_age_ms`: how old a hotswap replica must be for a
    /// non-dedicated hotswap ask to evict it.
    swap_min_age: Millis,
}

impl<'a> Ask<'a> {
    /// The ask for one more replica of `model`, of `size` bytes, at `now`,
    /// sparing `kept`.
    fn new(
        cluster: &'a Cluster,
        model: &'a ModelKey,
        size: u64,
        dedicated: bool,
        now: Millis,
        kept: &'a BTreeSet<ReplicaId>,
    ) -> Self {
        Ask {
            model,
            size,
            requires: cluster.requirement(model),
            dedicated,
            now,
            kept,
            min_age: cluster.config.min_deployment_age_ms,
            tier: &cluster.hotswap,
            hotswap: cluster.hotswap.contains(model),
            swap_min_age: cluster.config.hotswap_min_age_ms,
        }
    }

    /// Only non-dedicated deployments of other models, not kept by this
    /// call, are evictable, and then by tier, one rule a line:
    ///
    /// * an ask outside the hotswap tier evicts a hotswap replica whatever
    ///   its age (the tier stands behind the models that hold their own
    ///   replicas, and yields at once);
    /// * a hotswap ask never evicts a replica outside the tier;
    /// * a hotswap ask evicts another hotswap replica once it is
    ///   `hotswap_min_age_ms` old (any age if the ask is dedicated);
    /// * an ask outside the tier evicts a replica outside it once it is
    ///   `min_deployment_age_ms` old (any age if the ask is dedicated).
    fn may_evict(&self, d: &Deployment) -> bool {
        if d.dedicated || d.model_key == *self.model || self.kept.contains(&d.replica_id) {
            return false;
        }
        let age = self.now.saturating_sub(d.deployed_at_ms);
        match (self.hotswap, self.in_tier(d)) {
            (false, true) => true,
            (true, false) => false,
            (true, true) => self.dedicated || age >= self.swap_min_age,
            (false, false) => self.dedicated || age >= self.min_age,
        }
    }

    /// Whether `d` is a hotswap model's replica.
    fn in_tier(&self, d: &Deployment) -> bool {
        self.tier.contains(&d.model_key)
    }
}

/// Room a node can make by evicting: the reservation, who goes, the cost.
type Room = (BTreeMap<u32, u64>, Vec<(ModelKey, ReplicaId)>, EvictionCost);

impl Cluster {
    /// How many of `wanted` replicas of `model` this cluster could hold
    /// as it is, and why not more: asked of an empty cluster, what a
    /// configuration is checked against before anything runs (`hangar
    /// serve`, `hangar sim --fleet`), so both refuse a model alike. The
    /// cluster itself is not changed.
    pub fn room_for(&self, model: &ModelKey, wanted: u32, seed: u64) -> Fit {
        let mut trial = self.clone();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let request = ReplicaRequest { model_key: model.clone(), replicas: wanted, dedicated: false };
        let outcome = trial.deploy(&[request], 0, &mut rng);
        let replicas = outcome.models.first().map_or(&[][..], |m| &m.replicas[..]);
        Fit {
            placed: replicas.iter().filter(|r| r.level != CandidateLevel::CantAccommodate).count() as u32,
            reason: replicas.iter().find_map(|r| r.reason.as_ref()).map(ToString::to_string),
        }
    }

    /// Makes each requested model have at least `replicas` hot replicas.
    ///
    /// Models are handled largest first (ties by key), so big models claim
    /// whole GPUs before small ones fragment them; a model listed twice is
    /// merged (most replicas, dedicated if either is). For each missing
    /// replica: a warm replica of the model is promoted on the node that
    /// holds it when that node is the best candidate (`CachedAndFree`,
    /// `CachedAndFull`); otherwise a fresh id is minted from `rng` and the
    /// warm copy stays cached — a warm id is never created on a second node.
    /// Among the candidates of the best level, the nodes holding the fewest
    /// HOT replicas of the model are preferred (spread), then the cheapest
    /// eviction set; among equally good candidates (same level, HOT
    /// replica count and eviction cost), nodes holding the model's weight
    /// artifact resident are preferred ([`Cluster::set_resident`]); the
    /// rest of the tie goes to `rng`.
    /// Placing may evict non-dedicated hot replicas of other models that
    /// this call neither placed nor counted as deployed, by tier (the rules
    /// are listed on the `may_evict` of this module's `Ask`): a model
    /// outside the hotswap tier evicts hotswap replicas whatever their age
    /// and other replicas at least `min_deployment_age_ms` old; a hotswap
    /// model evicts hotswap replicas at least `hotswap_min_age_ms` old and
    /// nothing else (a dedicated request skips either age). Among the
    /// sets that make room on a node, one of hotswap replicas alone is
    /// preferred to any that takes another ([`EvictionCost`]). Evicted
    /// replicas go warm on their node if their engine can sleep and its
    /// cache can take them (dropping non-hotswap warm copies before
    /// hotswap ones), else cold. A hotswap model's replica woken from a
    /// warm copy is reported as a swap ([`ReplicaOutcome::swap`]).
    ///
    /// A dedicated request also sets the dedicated flag on exactly
    /// `replicas` of the model's hot replicas (the oldest) and clears it on
    /// the rest. Unknown models and unplaceable replicas are reported per
    /// replica with a reason; the rest of the batch still proceeds.
    ///
    /// Never scales down: extra hot replicas are reported `Deployed` and
    /// stay until an `evict_*` command removes them.
    pub fn deploy<R: Rng + ?Sized>(
        &mut self,
        requests: &[ReplicaRequest],
        now: Millis,
        rng: &mut R,
    ) -> DeployOutcome {
        let mut merged: BTreeMap<&ModelKey, (u32, bool)> = BTreeMap::new();
        for r in requests {
            let e = merged.entry(&r.model_key).or_insert((0, false));
            e.0 = e.0.max(r.replicas);
            e.1 |= r.dedicated;
        }
        let mut order: Vec<(&ModelKey, u32, bool)> =
            merged.into_iter().map(|(k, (n, d))| (k, n, d)).collect();
        order.sort_by_key(|&(k, _, _)| (std::cmp::Reverse(self.model_size(k)), k));

        let mut out = DeployOutcome::default();
        let mut kept = BTreeSet::new();
        for (model, replicas, dedicated) in order {
            let outcome = self.deploy_model(model, replicas, dedicated, now, rng, &mut kept, &mut out);
            out.models.push(outcome);
        }
        out.changed |= !out.evictions.is_empty();
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn deploy_model<R: Rng + ?Sized>(
        &mut self,
        model: &ModelKey,
        replicas: u32,
        dedicated: bool,
        now: Millis,
        rng: &mut R,
        kept: &mut BTreeSet<ReplicaId>,
        out: &mut DeployOutcome,
    ) -> ModelOutcome {
        let mut outcome =
            ModelOutcome { model_key: model.clone(), requested: replicas, dedicated, replicas: vec![] };
        let Some(size) = self.model_size(model) else {
            outcome.replicas = (0..replicas).map(|_| unplaced(Unplaceable::UnknownModel)).collect();
            return outcome;
        };
        let hot = self.replicas_of(model, Level::Hot);
        // A draining node's replicas are leaving: kept from eviction, but
        // the count is made up on the other nodes.
        kept.extend(hot.iter().map(|d| d.replica_id));
        outcome.replicas = hot
            .into_iter()
            .filter(|d| !self.leaving(d))
            .map(|d| ReplicaOutcome {
                replica_id: Some(d.replica_id),
                node: Some(d.node.clone()),
                level: CandidateLevel::Deployed,
                gpu_bytes_by_gpu: d.gpu_bytes_by_gpu.clone(),
                eviction_cost: EvictionCost::default(),
                reason: None,
                swap: false,
            })
            .collect();
        let missing = (replicas as usize).saturating_sub(outcome.replicas.len());
        let swap = self.hotswap.contains(model);
        for i in 0..missing {
            let ask = Ask::new(self, model, size, dedicated, now, kept);
            let Some(plan) = self.best_plan(&ask, rng) else {
                // Nothing changed since this attempt, so the rest fail alike.
                let reason = self.why_not(model, size);
                outcome.replicas.extend((i..missing).map(|_| unplaced(reason.clone())));
                break;
            };
            let level = plan.level;
            let cost = plan.cost;
            let dep = self.commit(plan, model, dedicated, now, rng, &mut out.evictions);
            kept.insert(dep.replica_id);
            out.changed = true;
            outcome.replicas.push(ReplicaOutcome {
                replica_id: Some(dep.replica_id),
                node: Some(dep.node.clone()),
                level,
                gpu_bytes_by_gpu: dep.gpu_bytes_by_gpu.clone(),
                eviction_cost: cost,
                reason: None,
                swap: swap && matches!(level, CandidateLevel::CachedAndFree | CandidateLevel::CachedAndFull),
            });
        }
        if dedicated {
            out.changed |= self.mark_dedicated(model, replicas as usize);
        }
        outcome
    }

    /// The best candidate for one more replica, or `None` (CANT_ACCOMMODATE).
    fn best_plan<R: Rng + ?Sized>(&self, ask: &Ask<'_>, rng: &mut R) -> Option<Plan> {
        let (warm, hot_on) = self.placed(ask.model);
        let shape = |n: &Node| self.shape_on(ask.requires, ask.size, n);
        let artifact = self.model_artifact(ask.model);

        // No eviction: a warm copy first, then any node; within each level
        // the nodes holding the fewest HOT replicas of the model.
        let cached: Vec<&(usize, ReplicaId)> = warm
            .iter()
            .filter(|(ni, _)| shape(&self.nodes[*ni]).is_some_and(|s| fits(&self.nodes[*ni], s)))
            .collect();
        let cached = fewest_hot(cached, |&&(ni, _)| ni, &hot_on);
        if let Some(i) = self.pick_resident(&cached, |&&(ni, _)| ni, artifact, rng) {
            let (ni, id) = *cached[i];
            return Some(self.free_plan(ni, CandidateLevel::CachedAndFree, Some(id), ask));
        }
        let free: Vec<usize> = (0..self.nodes.len())
            .filter(|&ni| shape(&self.nodes[ni]).is_some_and(|s| fits(&self.nodes[ni], s)))
            .collect();
        let free = fewest_hot_nodes(free, &hot_on);
        if let Some(i) = self.pick_resident(&free, |&ni| ni, artifact, rng) {
            return Some(self.free_plan(free[i], CandidateLevel::Free, None, ask));
        }

        // Evictions needed: again a warm copy first, then any node, each
        // time over the nodes with the fewest HOT replicas of the model
        // that can make room, and only then the cheapest set among them.
        let mut ties: Vec<Plan> = Vec::new();
        let swap_nodes = self.swap_nodes(ask);
        for group in by_hot_count(&warm, |&(ni, _)| ni, &hot_on) {
            for (ni, id) in group {
                self.consider_evicting(ni, CandidateLevel::CachedAndFull, Some(id), ask, &mut ties);
            }
            if !ties.is_empty() {
                break;
            }
        }
        if ties.is_empty() {
            // Nodes without a HOT replica of the model (all but a few)
            // first, then those with one, two, …
            self.scan_evicting(0..self.nodes.len(), Some(&hot_on), ask, &swap_nodes, &mut ties);
            let mut with: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
            for (&ni, &count) in &hot_on {
                with.entry(count).or_default().push(ni);
            }
            for nodes in with.into_values() {
                if !ties.is_empty() {
                    break;
                }
                self.scan_evicting(nodes.into_iter(), None, ask, &swap_nodes, &mut ties);
            }
        }
        // `ties` holds only the cheapest sets, so preferring resident nodes
        // among them never buys a costlier eviction.
        let i = self.pick_resident(&ties, |p| p.node, artifact, rng)?;
        Some(ties.swap_remove(i))
    }

    /// Where `model` is, from the replica index alone (one pass, no
    /// deployment records read): its WARM copies as (node index, replica),
    /// by replica id, and the number of its HOT replicas on each node that
    /// holds any, by node index — the spread tie-breaker's input.
    fn placed(&self, model: &ModelKey) -> (Vec<(usize, ReplicaId)>, BTreeMap<usize, u32>) {
        let mut warm = Vec::new();
        let mut hot_on = BTreeMap::new();
        for id in self.by_model.get(model).into_iter().flatten() {
            let loc = &self.replicas[id];
            match loc.level {
                Level::Hot => *hot_on.entry(loc.node).or_insert(0) += 1,
                _ => warm.push((loc.node, *id)),
            }
        }
        (warm, hot_on)
    }

    /// The nodes where `ask` could take hotswap replicas alone: those
    /// holding a HOT replica of a hotswap model, for an ask outside the
    /// tier (a hotswap ask evicts nothing else, so for it the set is empty
    /// and never consulted). Read from the replica index, O(hotswap
    /// replicas): empty, at no cost, in a fleet without hotswap models.
    fn swap_nodes(&self, ask: &Ask<'_>) -> BTreeSet<usize> {
        if ask.hotswap {
            return BTreeSet::new();
        }
        self.hotswap
            .iter()
            .flat_map(|m| self.by_model.get(m).into_iter().flatten())
            .map(|id| &self.replicas[id])
            .filter(|loc| loc.level == Level::Hot)
            .map(|loc| loc.node)
            .collect()
    }

    /// Adds to `ties` the cheapest evicting plans of `nodes` (with
    /// [`Cluster::consider_evicting`]), best-first: nodes by a lower bound
    /// on the bytes they must evict, so the scan stops once no remaining
    /// node can match the best set. A heap, not a sort: building it is
    /// O(n), and only the nodes visited are popped. Nodes among `skip`'s
    /// keys are passed over as they come up (a check per node visited, not
    /// per node).
    ///
    /// The bound is on bytes, and bytes come second in an
    /// [`EvictionCost`]: a best set that takes a non-hotswap replica can
    /// still lose to a costlier set of hotswap replicas alone. So when the
    /// scan stops with such a best, the nodes left that hold a hotswap
    /// replica (`swap_nodes`, from [`Cluster::swap_nodes`]) are visited
    /// too; with no hotswap replica anywhere it stops as it always did.
    fn scan_evicting(
        &self,
        nodes: impl Iterator<Item = usize>,
        skip: Option<&BTreeMap<usize, u32>>,
        ask: &Ask<'_>,
        swap_nodes: &BTreeSet<usize>,
        ties: &mut Vec<Plan>,
    ) {
        let skipped = |ni: usize| skip.is_some_and(|s| s.contains_key(&ni));
        let mut order: BinaryHeap<Reverse<(u64, usize)>> = nodes
            .filter_map(|ni| {
                let node = &self.nodes[ni];
                let shape = self.shape_on(ask.requires, ask.size, node)?;
                Some(Reverse((eviction_lower_bound(node, shape)?, ni)))
            })
            .collect();
        while let Some(Reverse((bound, ni))) = order.pop() {
            if let Some(best) = ties.first().map(|p| p.cost) {
                if bound > best.bytes {
                    if best.non_hotswap && !swap_nodes.is_empty() {
                        let mut left: Vec<(u64, usize)> = std::iter::once((bound, ni))
                            .chain(order.into_iter().map(|Reverse(b)| b))
                            .filter(|&(_, ni)| swap_nodes.contains(&ni) && !skipped(ni))
                            .collect();
                        left.sort_unstable();
                        for (_, ni) in left {
                            self.consider_evicting(ni, CandidateLevel::Full, None, ask, ties);
                        }
                    }
                    return;
                }
            }
            if skipped(ni) {
                continue;
            }
            self.consider_evicting(ni, CandidateLevel::Full, None, ask, ties);
        }
    }

    /// Draws the index of one of `ties` (`node_of` gives each one's node),
    /// among those whose node holds `artifact` resident when some but not
    /// all do. With no artifact, or none or all of them resident, this is
    /// [`pick_index`] over the whole tie set: the same draws as without
    /// residency, which keeps seeded runs (the simulator's golden outputs)
    /// byte-identical when residency is not in play.
    fn pick_resident<T, R: Rng + ?Sized>(
        &self,
        ties: &[T],
        node_of: impl Fn(&T) -> usize,
        artifact: Option<&str>,
        rng: &mut R,
    ) -> Option<usize> {
        let Some(artifact) = artifact else { return pick_index(ties.len(), rng) };
        let resident: Vec<usize> = (0..ties.len())
            .filter(|&i| self.nodes[node_of(&ties[i])].resident().contains(artifact))
            .collect();
        if resident.is_empty() || resident.len() == ties.len() {
            return pick_index(ties.len(), rng);
        }
        pick_index(resident.len(), rng).map(|i| resident[i])
    }

    /// Every node's best way to host one more replica of `model`, without
    /// the shortcuts [`Cluster::deploy`] takes (it stops at the first level
    /// with a candidate and bounds the eviction search): for diagnostics and
    /// for checking those shortcuts. A node holding a warm replica of the
    /// model answers with a `Cached*` level. `deploy` picks the lowest level
    /// here, then the fewest `hot_replicas` (spread), then the cheapest
    /// eviction set, then prefers `resident` nodes if some of the remaining
    /// ties are, then draws among ties. Empty for a model not in the
    /// catalogue.
    pub fn candidates(&self, model: &ModelKey, dedicated: bool, now: Millis) -> Vec<Candidate> {
        let Some(size) = self.model_size(model) else { return Vec::new() };
        let requires = self.requirement(model);
        let kept = BTreeSet::new();
        let ask = Ask::new(self, model, size, dedicated, now, &kept);
        let (warm, hot_on) = self.placed(model);
        // Per node, its first WARM copy by replica id.
        let warm: BTreeMap<usize, ReplicaId> = warm.into_iter().rev().collect();
        let artifact = self.model_artifact(model);
        let resident = |node: &Node| artifact.is_some_and(|a| node.resident().contains(a));
        let hot_replicas = |ni: usize| hot_on.get(&ni).copied().unwrap_or(0);
        let cant = |ni: usize, node: &Node| Candidate {
            node: node.id().clone(),
            level: CandidateLevel::CantAccommodate,
            warm_replica: None,
            gpu_bytes_by_gpu: BTreeMap::new(),
            evictions: Vec::new(),
            eviction_cost: EvictionCost::default(),
            hot_replicas: hot_replicas(ni),
            resident: resident(node),
        };
        self.nodes
            .iter()
            .enumerate()
            .map(|(ni, node)| {
                let Some(shape) = self.shape_on(requires, size, node) else {
                    return cant(ni, node);
                };
                let cached = warm.get(&ni).copied();
                let plan = if fits(node, shape) {
                    let level =
                        if cached.is_some() { CandidateLevel::CachedAndFree } else { CandidateLevel::Free };
                    self.free_plan(ni, level, cached, &ask)
                } else {
                    let level =
                        if cached.is_some() { CandidateLevel::CachedAndFull } else { CandidateLevel::Full };
                    let mut found = Vec::new();
                    self.consider_evicting(ni, level, cached, &ask, &mut found);
                    match found.pop() {
                        Some(plan) => plan,
                        None => return cant(ni, node),
                    }
                };
                Candidate {
                    node: node.id().clone(),
                    level: plan.level,
                    warm_replica: plan.warm,
                    gpu_bytes_by_gpu: plan.alloc,
                    evictions: plan.evict,
                    eviction_cost: plan.cost,
                    hot_replicas: hot_replicas(ni),
                    resident: resident(node),
                }
            })
            .collect()
    }

    fn free_plan(&self, ni: usize, level: CandidateLevel, warm: Option<ReplicaId>, ask: &Ask<'_>) -> Plan {
        let node = &self.nodes[ni];
        let shape = self.shape_on(ask.requires, ask.size, node).expect("checked by fits");
        let alloc = self.fit_free(node, shape).expect("checked by fits");
        Plan {
            node: ni,
            level,
            warm,
            alloc,
            fraction: fraction(shape, node.gpu_memory()),
            evict: Vec::new(),
            cost: EvictionCost::default(),
        }
    }

    /// Adds node `ni`'s cheapest evicting plan to `ties` if it is no worse
    /// than those already there (and clears them if it is better).
    fn consider_evicting(
        &self,
        ni: usize,
        level: CandidateLevel,
        warm: Option<ReplicaId>,
        ask: &Ask<'_>,
        ties: &mut Vec<Plan>,
    ) {
        let node = &self.nodes[ni];
        let Some(shape) = self.shape_on(ask.requires, ask.size, node) else { return };
        let limit = ties.first().map(|p| p.cost);
        let Some((alloc, evict, cost)) = evicting_room(node, shape, ask, limit) else { return };
        if limit.is_some_and(|l| cost < l) {
            ties.clear();
        }
        ties.push(Plan {
            node: ni,
            level,
            warm,
            alloc,
            fraction: fraction(shape, node.gpu_memory()),
            evict,
            cost,
        });
    }

    /// Carries out a plan: promote or mint, evict, reserve. Returns the new
    /// hot record.
    fn commit<R: Rng + ?Sized>(
        &mut self,
        plan: Plan,
        model: &ModelKey,
        dedicated: bool,
        now: Millis,
        rng: &mut R,
        evictions: &mut Vec<Eviction>,
    ) -> Deployment {
        let ni = plan.node;
        let mut dep = match plan.warm {
            Some(id) => self.nodes[ni].remove_warm(model, &id).expect("planned from a warm replica"),
            None => Deployment {
                model_key: model.clone(),
                replica_id: self.mint_replica_id(rng),
                node: self.nodes[ni].id().clone(),
                level: Level::Hot,
                gpu_bytes_by_gpu: BTreeMap::new(),
                gpu_fraction: None,
                size_bytes: self.models[model],
                dedicated,
                deployed_at_ms: now,
            },
        };
        let cause = EvictionCause::Pressure { model_key: model.clone(), replica_id: dep.replica_id };
        for (m, r) in &plan.evict {
            self.demote(ni, m, r, cause.clone(), evictions);
        }
        dep.level = Level::Hot;
        dep.gpu_bytes_by_gpu = plan.alloc;
        dep.gpu_fraction = Some(plan.fraction);
        dep.dedicated = dedicated;
        dep.deployed_at_ms = now;
        self.nodes[ni].insert_hot(dep.clone());
        self.track(&dep, ni);
        dep
    }

    /// Dedicates the `n` oldest hot replicas of `model` off draining nodes
    /// (those on a draining node last: they are leaving) and frees the
    /// rest; true if any flag changed.
    fn mark_dedicated(&mut self, model: &ModelKey, n: usize) -> bool {
        let mut hot: Vec<(bool, Millis, ReplicaId, usize)> = self
            .replicas_of(model, Level::Hot)
            .into_iter()
            .map(|d| {
                let ni = self.node_index[&d.node];
                (self.nodes[ni].draining(), d.deployed_at_ms, d.replica_id, ni)
            })
            .collect();
        hot.sort();
        let mut changed = false;
        for (i, (_, _, id, ni)) in hot.into_iter().enumerate() {
            changed |= self.nodes[ni].set_dedicated(model, &id, i < n);
        }
        changed
    }

    /// Why nothing could take a replica of `size` bytes.
    fn why_not(&self, model: &ModelKey, size: u64) -> Unplaceable {
        if self.nodes.is_empty() {
            return Unplaceable::NoNodes;
        }
        if let Some(r) = self.missing_hardware(model) {
            return Unplaceable::NoMatchingNode { requires: r.to_string() };
        }
        let requires = self.requirement(model);
        let with_gpus: Vec<(u32, u32, bool)> = self
            .nodes
            .iter()
            .filter_map(|n| {
                let shape = self.shape_anyway(requires, size, n)?;
                Some((shape.gpu_count(), n.gpus().len() as u32, n.draining() || n.suspect()))
            })
            .collect();
        if with_gpus.is_empty() {
            return Unplaceable::NoGpus;
        }
        if with_gpus.iter().all(|&(need, have, _)| need > have) {
            return Unplaceable::TooLarge {
                size_bytes: size,
                gpus_needed: with_gpus.iter().map(|w| w.0).min().unwrap_or(0),
                most_gpus_on_a_node: with_gpus.iter().map(|w| w.1).max().unwrap_or(0),
            };
        }
        if with_gpus.iter().all(|&(need, have, leaving)| need > have || leaving) {
            return Unplaceable::Draining;
        }
        if self.hotswap.contains(model) {
            Unplaceable::NoSwapRoom
        } else {
            Unplaceable::NoRoom
        }
    }

    /// Applies a dedicated schedule at `now`: replicas of models with no
    /// active window lose their dedicated flag (an empty schedule frees
    /// every one), then the active windows are deployed as dedicated
    /// requests. The outcome's `changed` covers both steps.
    pub fn apply_schedule<R: Rng + ?Sized>(
        &mut self,
        schedule: &Schedule,
        now: Millis,
        rng: &mut R,
    ) -> DeployOutcome {
        let requests = schedule.requests_at(now);
        let active: BTreeSet<&ModelKey> = requests.iter().map(|r| &r.model_key).collect();
        let to_free: Vec<(usize, ModelKey, ReplicaId)> = self
            .nodes
            .iter()
            .enumerate()
            .flat_map(|(ni, n)| n.hot_deployments().chain(n.warm_deployments()).map(move |d| (ni, d)))
            .filter(|(_, d)| d.dedicated && !active.contains(&d.model_key))
            .map(|(ni, d)| (ni, d.model_key.clone(), d.replica_id))
            .collect();
        let mut freed = false;
        for (ni, model, id) in to_free {
            freed |= self.nodes[ni].set_dedicated(&model, &id, false);
        }
        let mut out = self.deploy(&requests, now, rng);
        out.changed |= freed;
        out
    }
}

fn unplaced(reason: Unplaceable) -> ReplicaOutcome {
    ReplicaOutcome {
        replica_id: None,
        node: None,
        level: CandidateLevel::CantAccommodate,
        gpu_bytes_by_gpu: BTreeMap::new(),
        eviction_cost: EvictionCost::default(),
        reason: Some(reason),
        swap: false,
    }
}

/// Whether `node` has room for `shape` without evicting: O(1).
fn fits(node: &Node, shape: Shape) -> bool {
    match shape {
        Shape::Share { need_free, .. } => node.max_free() >= need_free,
        Shape::Whole { gpus } => node.empty_gpus() >= gpus,
    }
}

/// The entries of `items` (`node_of` gives each one's node) on the nodes
/// holding the fewest HOT replicas of the model being placed (`hot_on`,
/// from [`Cluster::placed`]), in their order: the spread tie-breaker. With
/// no HOT replica anywhere, or the same number on every entry's node, that
/// is all of `items`, so the draws that follow are exactly those made
/// without it.
fn fewest_hot<T>(mut items: Vec<T>, node_of: impl Fn(&T) -> usize, hot_on: &BTreeMap<usize, u32>) -> Vec<T> {
    if hot_on.is_empty() {
        return items;
    }
    let count = |t: &T| hot_on.get(&node_of(t)).copied().unwrap_or(0);
    if let Some(least) = items.iter().map(count).min() {
        items.retain(|t| count(t) == least);
    }
    items
}

/// [`fewest_hot`] for `nodes`, node indices in ascending order (the free
/// nodes, possibly thousands): the few nodes holding a HOT replica are
/// found by binary search and cut out by moving the runs between them, so
/// spread costs no lookup per node, and nothing at all for a model with no
/// replica on a free node.
fn fewest_hot_nodes(mut nodes: Vec<usize>, hot_on: &BTreeMap<usize, u32>) -> Vec<usize> {
    let holding: Vec<usize> = hot_on.keys().filter_map(|ni| nodes.binary_search(ni).ok()).collect();
    if holding.is_empty() {
        return nodes;
    }
    if holding.len() == nodes.len() {
        return fewest_hot(nodes, |&ni| ni, hot_on);
    }
    // Some free node holds none: drop those that hold one.
    let mut kept = holding[0];
    for (j, &at) in holding.iter().enumerate() {
        let next = holding.get(j + 1).copied().unwrap_or(nodes.len());
        nodes.copy_within(at + 1..next, kept);
        kept += next - at - 1;
    }
    nodes.truncate(kept);
    nodes
}

/// `items` grouped by the number of HOT replicas of the model being placed
/// on each one's node, fewest first, each group in the items' order.
fn by_hot_count<T: Copy>(
    items: &[T],
    node_of: impl Fn(&T) -> usize,
    hot_on: &BTreeMap<usize, u32>,
) -> impl Iterator<Item = Vec<T>> {
    let mut groups: BTreeMap<u32, Vec<T>> = BTreeMap::new();
    for t in items {
        groups.entry(hot_on.get(&node_of(t)).copied().unwrap_or(0)).or_default().push(*t);
    }
    groups.into_values()
}

fn pick_index<R: Rng + ?Sized>(len: usize, rng: &mut R) -> Option<usize> {
    match len {
        0 => None,
        1 => Some(0),
        n => Some(rng.random_range(0..n)),
    }
}

/// A lower bound on the bytes `node` must evict to host `shape`, or `None`
/// if it never can (too few GPUs). Every evicted tenant costs at least the
/// bytes it frees, so a share costs, on its best GPU, at least the shortfall
/// there and at least the smallest reservation there; k whole GPUs cost at
/// least the bytes used on the k least-used GPUs.
fn eviction_lower_bound(node: &Node, shape: Shape) -> Option<u64> {
    match shape {
        Shape::Share { need_free, .. } => node
            .gpu_free()
            .iter()
            .zip(node.min_reservation())
            .map(|(&free, &smallest)| match need_free.checked_sub(free) {
                None | Some(0) => 0,
                Some(short) => short.max(smallest),
            })
            .min(),
        Shape::Whole { gpus } => {
            let k = gpus as usize;
            let free = node.gpu_free();
            if k > free.len() {
                return None;
            }
            let mut used = [0u64; MAX_GPUS_PER_NODE as usize];
            let used = &mut used[..free.len()];
            for (u, f) in used.iter_mut().zip(free) {
                *u = node.gpu_memory() - f;
            }
            used.select_nth_unstable(k - 1);
            Some(used[..k].iter().sum())
        }
    }
}

/// The cheapest room `node` can make for `shape` by evicting what `ask`
/// may evict, costing at most `limit` ([`EvictionCost`]'s order).
///
/// Two searches, the hotswap tier first: if the hotswap replicas `ask` may
/// evict can make the room alone, the cheapest such set is the answer,
/// whatever the bytes a set taking a non-hotswap replica would save (the
/// tier stands behind the models that hold their own replicas); only if
/// they cannot is every evictable replica searched, and the set found then
/// takes a non-hotswap one. Each search is bounded by `limit` where its
/// sets can tie with it: the first by a limit of its own tier, the second
/// not at all after a limit of hotswap replicas alone. Without hotswap
/// replicas on the node the first search is skipped, so the answer is
/// exactly what one search over every evictable replica gave before the
/// tier existed.
fn evicting_room(node: &Node, shape: Shape, ask: &Ask<'_>, limit: Option<EvictionCost>) -> Option<Room> {
    let tenants: Vec<&Deployment> = node.hot_deployments().collect();
    let evictable: Vec<bool> = tenants.iter().map(|d| ask.may_evict(d)).collect();
    let swappable: Vec<bool> = tenants.iter().zip(&evictable).map(|(d, &e)| e && ask.in_tier(d)).collect();
    let tier_limit = |held: bool| {
        limit.filter(|l| l.non_hotswap == held).map(|l| EvictionCost { non_hotswap: false, ..l })
    };
    if swappable.contains(&true) {
        if let Some(room) = cheapest_among(node, shape, &tenants, &swappable, tier_limit(false)) {
            return Some(room);
        }
    }
    if limit.is_some_and(|l| !l.non_hotswap) || evictable == swappable {
        return None; // a set taking a non-hotswap replica cannot beat the limit, or is the set above
    }
    let (alloc, evict, cost) = cheapest_among(node, shape, &tenants, &evictable, tier_limit(true))?;
    Some((alloc, evict, EvictionCost { non_hotswap: true, ..cost }))
}

/// The cheapest room `node` can make for `shape` by evicting the
/// `tenants` marked in `evictable`, by bytes then count (the cost's
/// `non_hotswap` is left false: the caller knows which tier it searched),
/// costing at most `limit`.
fn cheapest_among(
    node: &Node,
    shape: Shape,
    tenants: &[&Deployment],
    evictable: &[bool],
    limit: Option<EvictionCost>,
) -> Option<Room> {
    let mut on_gpu: Vec<Vec<usize>> = vec![Vec::new(); node.gpus().len()];
    for (t, d) in tenants.iter().enumerate() {
        for &g in d.gpu_bytes_by_gpu.keys() {
            on_gpu[g as usize].push(t);
        }
    }
    let names = |set: &[usize]| -> Vec<(ModelKey, ReplicaId)> {
        set.iter().map(|&t| (tenants[t].model_key.clone(), tenants[t].replica_id)).collect()
    };
    match shape {
        Shape::Share { bytes, need_free } => {
            let mut best: Option<(u32, Vec<usize>, EvictionCost)> = None;
            let mut limit = limit;
            for g in node.gpus() {
                let need = need_free.saturating_sub(g.free_bytes);
                if limit.is_some_and(|l| need > l.bytes) {
                    continue; // evicting costs at least the bytes freed
                }
                let idx: Vec<usize> =
                    on_gpu[g.index as usize].iter().copied().filter(|&t| evictable[t]).collect();
                let items: Vec<Item> = idx
                    .iter()
                    .map(|&t| Item {
                        benefit: tenants[t].gpu_bytes_by_gpu[&g.index],
                        cost: tenants[t].gpu_bytes(),
                    })
                    .collect();
                let Some((set, cost)) = min_cover(&items, need, limit) else { continue };
                if best.as_ref().is_none_or(|b| cost < b.2) {
                    best = Some((g.index, set.into_iter().map(|i| idx[i]).collect(), cost));
                    limit = Some(cost);
                }
            }
            let (gpu, set, cost) = best?;
            Some((BTreeMap::from([(gpu, bytes)]), names(&set), cost))
        }
        Shape::Whole { gpus } => {
            let clearable: Vec<Clearable> = node
                .gpus()
                .iter()
                .filter(|g| on_gpu[g.index as usize].iter().all(|&t| evictable[t]))
                .map(|g| Clearable { gpu: g.index, tenants: on_gpu[g.index as usize].clone() })
                .collect();
            let costs: Vec<u64> = tenants.iter().map(|d| d.gpu_bytes()).collect();
            let (chosen, evicted, cost) = min_clear(&clearable, &costs, gpus as usize, limit)?;
            let alloc = chosen.into_iter().map(|g| (g, node.gpus()[g as usize].total_bytes)).collect();
            Some((alloc, names(&evicted), cost))
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::cluster::Restore;
    use crate::config::{ClusterConfig, NodeConfig, PlacementConfig};
    use crate::deployment::NodeId;
    use crate::sizing::ModelSpec;

    const GB: u64 = 1_000_000_000;

    fn filled(nodes: &[u32], sizes: &[u64], fill: &[(usize, usize)]) -> Cluster {
        filled_tiered(nodes, sizes, 0, fill)
    }

    /// [`filled`] with model `mi` in the hotswap tier when bit `i` of
    /// `tier` is set.
    fn filled_tiered(nodes: &[u32], sizes: &[u64], tier: u8, fill: &[(usize, usize)]) -> Cluster {
        let config = ClusterConfig {
            nodes: nodes
                .iter()
                .enumerate()
                .map(|(i, &gpus)| NodeConfig {
                    id: format!("n{i}").parse().unwrap(),
                    gpus,
                    gpu_memory: Some(hangar_core::ByteSize::new(80 * GB)),
                    gpu_kind: None,
                    virtual_gpus: false,
                    cpu_cache: hangar_core::ByteSize::new(0),
                })
                .collect(),
            models: sizes
                .iter()
                .enumerate()
                .map(|(i, &gb)| {
                    let spec = ModelSpec {
                        size: Some(hangar_core::ByteSize::new(gb * GB)),
                        hotswap: tier >> i & 1 == 1,
                        ..Default::default()
                    };
                    (format!("m{i}").parse().unwrap(), spec)
                })
                .collect(),
            ..Default::default()
        };
        let mut c = Cluster::new(config).unwrap();
        for (n, &(model, node)) in fill.iter().enumerate() {
            let _ = c.restore(Restore {
                model_key: format!("m{}", model % sizes.len()).parse().unwrap(),
                replica_id: ReplicaId::from_u128(n as u128 + 1),
                node: format!("n{}", node % nodes.len()).parse().unwrap(),
                level: Level::Hot,
                gpus: None,
                dedicated: n % 7 == 0,
                deployed_at_ms: (n as u64 % 3) * 1_000_000,
            });
        }
        c
    }

    const HOUR: Millis = 3_600_000;

    fn key(s: &str) -> ModelKey {
        s.parse().unwrap()
    }

    /// Registers an old, non-dedicated hot replica of `model` on `node`.
    fn hot(c: &mut Cluster, model: &str, id: u128, node: &str) {
        c.restore(Restore {
            model_key: key(model),
            replica_id: ReplicaId::from_u128(id),
            node: node.parse().unwrap(),
            level: Level::Hot,
            gpus: None,
            dedicated: false,
            deployed_at_ms: 0,
        })
        .unwrap();
    }

    /// Says `m0` loads artifact `hg1:m0` and `node` holds it resident.
    fn resident_on(c: &mut Cluster, node: &str) {
        c.set_model_artifact(&key("m0"), Some("hg1:m0".into())).unwrap();
        c.set_resident(&node.parse().unwrap(), BTreeSet::from(["hg1:m0".to_string()])).unwrap();
    }

    /// Where one replica of `m0` lands, deployed at 2 h with `seed`.
    fn placed(c: &Cluster, seed: u64) -> ReplicaOutcome {
        let mut c = c.clone();
        let request = ReplicaRequest { model_key: key("m0"), replicas: 1, dedicated: false };
        let out = c.deploy(&[request], 2 * HOUR, &mut ChaCha8Rng::seed_from_u64(seed));
        out.models[0].replicas[0].clone()
    }

    fn node_of(r: &ReplicaOutcome) -> &str {
        r.node.as_ref().unwrap().as_str()
    }

    #[test]
    fn a_free_node_holding_the_artifact_wins_every_draw() {
        // Two empty one-GPU nodes: without residency the rng spreads the
        // replica over both; with n1 resident it always lands on n1.
        let mut c = filled(&[1, 1], &[20], &[]);
        let plain: BTreeSet<String> = (0..64).map(|seed| node_of(&placed(&c, seed)).to_owned()).collect();
        assert_eq!(plain.len(), 2, "both nodes should win some draws without residency");
        resident_on(&mut c, "n1");
        for seed in 0..64 {
            let r = placed(&c, seed);
            assert_eq!((node_of(&r), r.level), ("n1", CandidateLevel::Free), "seed {seed}");
        }
        let candidates = c.candidates(&key("m0"), false, 2 * HOUR);
        assert_eq!(candidates.iter().map(|c| c.resident).collect::<Vec<_>>(), [false, true]);
    }

    #[test]
    fn residency_never_beats_a_better_level() {
        // n0 is free; n1 holds the artifact but must evict first.
        let mut c = filled(&[1, 1], &[20, 30], &[]);
        hot(&mut c, "m1", 1, "n1");
        resident_on(&mut c, "n1");
        for seed in 0..16 {
            let r = placed(&c, seed);
            assert_eq!((node_of(&r), r.level), ("n0", CandidateLevel::Free), "seed {seed}");
        }
    }

    #[test]
    fn residency_never_buys_a_costlier_eviction() {
        // Both nodes must evict: 30 GB of m1 on n0, a whole 80 GB GPU of m2
        // on the resident n1. The cheaper set wins.
        let mut c = filled(&[1, 1], &[20, 10, 30], &[]);
        hot(&mut c, "m1", 1, "n0");
        hot(&mut c, "m2", 2, "n1");
        resident_on(&mut c, "n1");
        for seed in 0..16 {
            let r = placed(&c, seed);
            assert_eq!((node_of(&r), r.level), ("n0", CandidateLevel::Full), "seed {seed}");
            assert_eq!(r.eviction_cost, EvictionCost { non_hotswap: true, bytes: 30 * GB, count: 1 });
        }
    }

    #[test]
    fn residency_names_only_known_models_and_nodes() {
        let mut c = filled(&[1], &[20], &[]);
        assert_eq!(
            c.set_model_artifact(&key("nope"), Some("hg1:x".into())),
            Err(crate::ResidencyError::UnknownModel(key("nope")))
        );
        let ghost: crate::NodeId = "ghost".parse().unwrap();
        assert_eq!(
            c.set_resident(&ghost, BTreeSet::from(["hg1:x".to_string()])),
            Err(crate::ResidencyError::UnknownNode(ghost))
        );
        c.set_model_artifact(&key("m0"), Some("hg1:x".into())).unwrap();
        assert_eq!(c.model_artifact(&key("m0")), Some("hg1:x"));
        c.set_model_artifact(&key("m0"), None).unwrap();
        assert_eq!(c.model_artifact(&key("m0")), None);
    }

    /// One node of `gpus` × 80 GB GPUs and `cache_gb` of warm cache, and
    /// the models `(key, size in GB, hotswap)`, with default knobs.
    fn tiered(gpus: u32, cache_gb: u64, models: &[(&str, u64, bool)]) -> Cluster {
        let mut text = format!(
            "[[nodes]]\nid = \"n0\"\ngpus = {gpus}\ngpu_memory = \"80GB\"\ncpu_cache = \"{cache_gb}GB\"\n"
        );
        for (model, gb, hotswap) in models {
            text += &format!("[models.\"{model}\"]\nsize = \"{gb}GB\"\nhotswap = {hotswap}\n");
        }
        Cluster::new(toml::from_str(&text).unwrap()).unwrap()
    }

    /// Registers a hot replica of `model` on `node`, deployed at `at`.
    fn hot_at(c: &mut Cluster, model: &str, id: u128, node: &str, gpus: &[u32], at: Millis, dedicated: bool) {
        c.restore(Restore {
            model_key: key(model),
            replica_id: ReplicaId::from_u128(id),
            node: node.parse().unwrap(),
            level: Level::Hot,
            gpus: Some(gpus.to_vec()),
            dedicated,
            deployed_at_ms: at,
        })
        .unwrap();
    }

    /// Deploys one replica of `model` (on a copy of `c`) at `now`.
    fn one_of(c: &Cluster, model: &str, dedicated: bool, now: Millis) -> (Cluster, DeployOutcome) {
        let mut c = c.clone();
        let request = ReplicaRequest { model_key: key(model), replicas: 1, dedicated };
        let out = c.deploy(&[request], now, &mut ChaCha8Rng::seed_from_u64(3));
        (c, out)
    }

    fn evicted(out: &DeployOutcome) -> Vec<ReplicaId> {
        out.evictions.iter().filter(|e| e.from == Level::Hot).map(|e| e.replica_id).collect()
    }

    // Every model below is 30 GB, so each replica takes a whole 80 GB GPU
    // (3 × 30 GB is past 0.8 × 80 GB): one GPU, one replica.
    const SWAPS: [(&str, u64, bool); 4] =
        [("held", 30, false), ("held2", 30, false), ("swap", 30, true), ("swap2", 30, true)];

    #[test]
    fn a_model_outside_the_tier_evicts_a_hotswap_replica_whatever_its_age() {
        let mut c = tiered(1, 0, &SWAPS);
        hot_at(&mut c, "swap", 1, "n0", &[0], HOUR, false);
        // Deployed this very millisecond, and still evicted.
        let (_, out) = one_of(&c, "held", false, HOUR);
        assert_eq!(out.models[0].replicas[0].level, CandidateLevel::Full);
        assert_eq!(evicted(&out), [ReplicaId::from_u128(1)]);
        assert!(!out.models[0].replicas[0].eviction_cost.non_hotswap);
        // The same young replica outside the tier is spared, as before.
        let mut c = tiered(1, 0, &SWAPS);
        hot_at(&mut c, "held2", 1, "n0", &[0], HOUR, false);
        let (_, out) = one_of(&c, "held", false, HOUR + 1);
        assert_eq!(out.models[0].replicas[0].reason, Some(Unplaceable::NoRoom));
    }

    #[test]
    fn a_hotswap_model_never_evicts_a_replica_outside_the_tier() {
        for dedicated_victim in [false, true] {
            let mut c = tiered(1, 0, &SWAPS);
            hot_at(&mut c, "held", 1, "n0", &[0], 0, dedicated_victim);
            // Old enough for anything, and a dedicated ask: still not.
            for dedicated in [false, true] {
                let (after, out) = one_of(&c, "swap", dedicated, 10 * HOUR);
                let r = &out.models[0].replicas[0];
                assert_eq!(r.reason, Some(Unplaceable::NoSwapRoom), "dedicated ask {dedicated}");
                assert!(out.evictions.is_empty());
                assert!(after.deployment(&ReplicaId::from_u128(1)).is_some_and(|d| d.level == Level::Hot));
            }
        }
        // The reason says why in words.
        assert!(Unplaceable::NoSwapRoom.to_string().contains("outside the tier"));
    }

    #[test]
    fn a_hotswap_model_evicts_another_once_it_is_hotswap_min_age_old() {
        let mut c = tiered(1, 0, &SWAPS);
        let min_age = c.config().hotswap_min_age_ms;
        assert_eq!(min_age, 60_000);
        hot_at(&mut c, "swap2", 1, "n0", &[0], HOUR, false);
        let (_, out) = one_of(&c, "swap", false, HOUR + min_age - 1);
        assert_eq!(out.models[0].replicas[0].reason, Some(Unplaceable::NoSwapRoom), "one ms too young");
        let (_, out) = one_of(&c, "swap", false, HOUR + min_age);
        assert_eq!(out.models[0].replicas[0].level, CandidateLevel::Full, "old enough to the millisecond");
        assert_eq!(evicted(&out), [ReplicaId::from_u128(1)]);
        // A dedicated ask takes it at any age; a non-hotswap replica of the
        // same age would be spared for an hour.
        let (_, out) = one_of(&c, "swap", true, HOUR);
        assert_eq!(evicted(&out), [ReplicaId::from_u128(1)]);
        // Dedicated hotswap replicas are never evicted by pressure.
        let mut c = tiered(1, 0, &SWAPS);
        hot_at(&mut c, "swap2", 1, "n0", &[0], 0, true);
        for (model, dedicated) in [("swap", false), ("swap", true), ("held", false), ("held", true)] {
            let (_, out) = one_of(&c, model, dedicated, 10 * HOUR);
            assert!(out.evictions.is_empty(), "{model} dedicated={dedicated}");
        }
    }

    #[test]
    fn the_knob_sets_the_hotswap_boundary() {
        let mut config: ClusterConfig = toml::from_str(
            "[placement]\nhotswap_min_age_ms = 5000\n[[nodes]]\nid = \"n0\"\ngpus = 1\ngpu_memory = \"80GB\"\n\
             [models.swap]\nsize = \"30GB\"\nhotswap = true\n[models.swap2]\nsize = \"30GB\"\nhotswap = true\n",
        )
        .unwrap();
        assert_eq!(config.placement.hotswap_min_age_ms, 5_000);
        assert!(config.models.values().all(|m| m.hotswap));
        let mut c = Cluster::new(config.clone()).unwrap();
        hot_at(&mut c, "swap2", 1, "n0", &[0], 0, false);
        assert!(one_of(&c, "swap", false, 4_999).1.evictions.is_empty());
        assert_eq!(evicted(&one_of(&c, "swap", false, 5_000).1), [ReplicaId::from_u128(1)]);
        // `hotswap = false` is the default and is not written out.
        config.models.get_mut(&key("swap")).unwrap().hotswap = false;
        let written = toml::to_string(&config.models[&key("swap")]).unwrap();
        assert!(!written.contains("hotswap"), "{written}");
        assert_eq!(PlacementConfig::default().hotswap_min_age_ms, 60_000);
    }

    #[test]
    fn a_set_of_hotswap_replicas_alone_beats_a_cheaper_one_outside_the_tier() {
        // On one node: GPU 0 holds 30 GB of an old model outside the tier
        // (a 10 GB share), GPU 1 60 GB of a hotswap one (a 20 GB share).
        // Clearing a GPU for `held` costs 30 GB on GPU 0 and 60 GB on GPU 1;
        // the tier goes.
        let models = [("held", 30, false), ("small", 10, false), ("swap", 20, true)];
        let mut c = tiered(2, 0, &models);
        hot_at(&mut c, "small", 1, "n0", &[0], 0, false);
        hot_at(&mut c, "swap", 2, "n0", &[1], 0, false);
        let (_, out) = one_of(&c, "held", false, 2 * HOUR);
        assert_eq!(evicted(&out), [ReplicaId::from_u128(2)]);
        let cost = out.models[0].replicas[0].eviction_cost;
        assert_eq!(cost, EvictionCost { non_hotswap: false, bytes: 60 * GB, count: 1 });
        // The same across nodes, where the best-first scan meets the cheap
        // set first (its bound, 30 GB, is lower) and must look past it.
        let config = format!(
            "{}{}{}",
            "[[nodes]]\nid = \"n0\"\ngpus = 1\ngpu_memory = \"80GB\"\n",
            "[[nodes]]\nid = \"n1\"\ngpus = 1\ngpu_memory = \"80GB\"\n",
            "[models.held]\nsize = \"30GB\"\n[models.small]\nsize = \"10GB\"\n\
             [models.swap]\nsize = \"20GB\"\nhotswap = true\n",
        );
        let mut c = Cluster::new(toml::from_str(&config).unwrap()).unwrap();
        hot_at(&mut c, "small", 1, "n0", &[0], 0, false);
        hot_at(&mut c, "swap", 2, "n1", &[0], 0, false);
        for seed in 0..8 {
            let mut c = c.clone();
            let request = ReplicaRequest { model_key: key("held"), replicas: 1, dedicated: false };
            let out = c.deploy(&[request], 2 * HOUR, &mut ChaCha8Rng::seed_from_u64(seed));
            assert_eq!(evicted(&out), [ReplicaId::from_u128(2)], "seed {seed}");
            assert_eq!(out.models[0].replicas[0].node.as_ref().map(NodeId::as_str), Some("n1"));
        }
        let candidates = c.candidates(&key("held"), false, 2 * HOUR);
        let costs: Vec<_> =
            candidates.iter().map(|c| (c.eviction_cost.non_hotswap, c.eviction_cost.bytes / GB)).collect();
        assert_eq!(costs, [(true, 30), (false, 60)]);
    }

    #[test]
    fn a_swapped_out_replica_goes_warm_and_its_swap_back_in_is_a_wake() {
        let mut c = tiered(1, 100, &SWAPS);
        hot_at(&mut c, "swap", 1, "n0", &[0], 0, false);
        let before = c.snapshot();
        let (mut c, out) = one_of(&c, "held", false, HOUR);
        let e = &out.evictions[0];
        assert_eq!((e.replica_id, e.from, e.to), (ReplicaId::from_u128(1), Level::Hot, Level::Warm));
        assert_eq!(out.swaps(), 0, "a cold load of a model outside the tier is no swap");
        let delta = crate::DeploymentDelta::between(&before, &c.snapshot()).unwrap();
        let to_cache: Vec<_> = delta.steps().filter(|s| s.action == crate::Action::ToCache).collect();
        assert_eq!(to_cache.len(), 1);
        // `held` leaves (explicitly: the tier never takes its GPU), and the
        // hotswap model comes back from the cache.
        c.evict_model(&key("held"));
        let before = c.snapshot();
        let (after, out) = one_of(&c, "swap", false, HOUR + 1);
        let r = &out.models[0].replicas[0];
        assert_eq!(
            (r.level, r.replica_id, r.swap),
            (CandidateLevel::CachedAndFree, Some(ReplicaId::from_u128(1)), true)
        );
        assert_eq!(out.swaps(), 1);
        let delta = crate::DeploymentDelta::between(&before, &after.snapshot()).unwrap();
        let actions: Vec<_> = delta.steps().map(|s| (s.action, s.deployment.replica_id)).collect();
        assert_eq!(actions, [(crate::Action::FromCache, ReplicaId::from_u128(1))]);
        assert!(after.hotswap(&key("swap")) && !after.hotswap(&key("held")));
    }

    #[test]
    fn the_warm_cache_drops_copies_outside_the_tier_before_hotswap_ones() {
        // 80 GB of cache holding a 20 GB hotswap copy and a 30 GB copy of a
        // model outside the tier; a 40 GB replica demoted needs 10 GB more.
        // Smallest first alone would drop the hotswap copy.
        let models = [("big", 40, false), ("held", 30, false), ("swap", 20, true)];
        let mut c = tiered(1, 80, &models);
        for (model, id) in [("swap", 1), ("held", 2)] {
            c.restore(Restore {
                model_key: key(model),
                replica_id: ReplicaId::from_u128(id),
                node: "n0".parse().unwrap(),
                level: Level::Warm,
                gpus: None,
                dedicated: false,
                deployed_at_ms: 0,
            })
            .unwrap();
        }
        hot_at(&mut c, "big", 3, "n0", &[0], 0, false);
        let out = c.evict_replica(&key("big"), &ReplicaId::from_u128(3)).unwrap();
        let moves: Vec<_> = out.iter().map(|e| (e.replica_id, e.to)).collect();
        assert_eq!(moves, [(ReplicaId::from_u128(3), Level::Warm), (ReplicaId::from_u128(2), Level::Cold)]);
        assert!(c.deployment(&ReplicaId::from_u128(1)).is_some_and(|d| d.level == Level::Warm));
        c.check_invariants().unwrap();
    }

    proptest! {
        /// Cutting the holders out of a sorted node list by position gives
        /// what filtering it node by node gives.
        #[test]
        fn fewest_hot_nodes_is_fewest_hot_on_a_sorted_list(
            nodes in prop::collection::btree_set(0usize..40, 0..40),
            hot_on in prop::collection::btree_map(0usize..40, 1u32..4, 0..12),
        ) {
            let nodes: Vec<usize> = nodes.into_iter().collect();
            let expected = fewest_hot(nodes.clone(), |&ni| ni, &hot_on);
            prop_assert_eq!(fewest_hot_nodes(nodes, &hot_on), expected);
        }
    }

    proptest! {
        // A best set outside the tier met before a node whose hotswap
        // replicas alone make room is a few cases in a thousand: enough
        // cases that the scan's look past its byte bound is always tried.
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// The best-first scan with bounds finds what scanning every node
        /// without bounds finds: among the free nodes if there are any, else
        /// among the nodes that can make room, one with the fewest HOT
        /// replicas of the model, and there the cheapest set — with some
        /// models in the hotswap tier, so that a set of hotswap replicas
        /// alone beats sets of fewer bytes, past the scan's byte bound.
        #[test]
        fn best_first_scan_matches_exhaustive_scan(
            nodes in prop::collection::vec(1u32..5, 1..6),
            sizes in prop::collection::vec(1u64..250, 2..6),
            tier: u8,
            fill in prop::collection::vec((0usize..8, 0usize..8), 0..60),
            ask_model in 0usize..6,
            dedicated: bool,
        ) {
            let c = filled_tiered(&nodes, &sizes, tier, &fill);
            let model: ModelKey = format!("m{}", ask_model % sizes.len()).parse().unwrap();
            let size = c.model_size(&model).unwrap();
            let kept = BTreeSet::new();
            let ask = Ask::new(&c, &model, size, dedicated, 7_200_000, &kept);
            let hot_on = c.placed(&model).1;
            let exhaustive = c
                .nodes
                .iter()
                .enumerate()
                .filter_map(|(ni, n)| {
                    let shape = Shape::for_model(&c.config, size, n.gpu_memory())?;
                    let hot = hot_on.get(&ni).copied().unwrap_or(0);
                    if fits(n, shape) {
                        return Some((false, hot, EvictionCost::default()));
                    }
                    evicting_room(n, shape, &ask, None).map(|r| (true, hot, r.2))
                })
                .min();
            let got = c.best_plan(&ask, &mut ChaCha8Rng::seed_from_u64(1));
            let got = got.map(|p| (p.level == CandidateLevel::Full, hot_on.get(&p.node).copied().unwrap_or(0), p.cost));
            prop_assert_eq!(got, exhaustive);
        }
    }
}
