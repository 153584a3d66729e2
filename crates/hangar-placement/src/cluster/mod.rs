//! [`Cluster`]: the fleet's accounting and its placement commands.

mod deploy;
mod evict;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use hangar_core::{Millis, ModelKey, ReplicaId};

use crate::candidate::Shape;
use crate::config::{BadNode, ClusterConfig, NodeConfig, PlacementConfig};
use crate::delta::{Part, Snapshot};
use crate::deployment::{Deployment, Level, NodeId};
use crate::error::{AddNodeError, ConfigError, DrainError, ResidencyError, RestoreError, SleepsError};
use crate::node::Node;
use crate::sizing::Requirement;

/// Where a tracked replica is.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Loc {
    model: ModelKey,
    node: usize,
    level: Level,
}

/// A deployment that already exists, to register with
/// [`Cluster::restore`] (after a controller restart, or from a scenario).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restore {
    /// Its model (must be in the catalogue).
    pub model_key: ModelKey,
    /// Its id (must be unused).
    pub replica_id: ReplicaId,
    /// Its node.
    pub node: NodeId,
    /// `Hot` or `Warm`.
    pub level: Level,
    /// For a hot one, the GPUs it holds; `None` lets the sizing rules pick
    /// free ones. The bytes per GPU always follow the sizing rules.
    pub gpus: Option<Vec<u32>>,
    /// Whether it is dedicated.
    pub dedicated: bool,
    /// When it became hot.
    pub deployed_at_ms: Millis,
}

/// The fleet as placement sees it: every node's accounting plus a cluster-wide replica index.
///
/// Methods are grouped as quinn-proto groups a connection's: getters,
/// set-up ([`Cluster::new`], [`Cluster::restore`]), membership
/// ([`Cluster::add_node`], [`Cluster::remove_node`]: node agents join and
/// leave while it runs), commands
/// ([`Cluster::deploy`], [`Cluster::apply_schedule`], the `evict_*`
/// family), and [`Cluster::snapshot`] for diffing. Commands take `now` on the
/// caller's clock and an rng; nothing here reads a clock or does I/O.
///
/// Invariants after every command (checked by [`Cluster::check_invariants`]
/// and by the property tests): no GPU is over-committed; on every GPU
/// `free + Σ reservations = total`; every warm cache fits its budget; each
/// replica id is unique cluster-wide and is in exactly one of one node's hot
/// or warm maps (so none names a node that was removed).
///
/// Weight residency ([`Cluster::set_model_artifact`],
/// [`Cluster::set_resident`]) and whether a model's engine can sleep
/// ([`Cluster::set_sleeps`]) are input the caller reports, not deployment
/// state: they are carried by `Clone` (so [`Cluster::room_for`] sees
/// them) but not by [`Cluster::snapshot`], and no command changes them (a
/// removed node's residency goes with it).
#[derive(Debug, Clone)]
pub struct Cluster {
    config: PlacementConfig,
    models: BTreeMap<ModelKey, u64>,
    /// Model → the weight artifact its replicas load (models without one
    /// are absent). Several models may share an artifact.
    artifacts: BTreeMap<ModelKey, String>,
    /// Model → the hardware it requires (models that run anywhere are
    /// absent).
    requirements: BTreeMap<ModelKey, Requirement>,
    /// Models whose engine cannot sleep ([`Cluster::set_sleeps`]): demoted
    /// straight to COLD, never WARM.
    sleepless: BTreeSet<ModelKey>,
    /// Models in the hotswap tier ([`ModelSpec::hotswap`](crate::ModelSpec::hotswap)).
    hotswap: BTreeSet<ModelKey>,
    nodes: Vec<Node>,
    node_index: BTreeMap<NodeId, usize>,
    replicas: BTreeMap<ReplicaId, Loc>,
    by_model: BTreeMap<ModelKey, BTreeSet<ReplicaId>>,
    /// Bumped when a node joins or leaves: the nodes a snapshot lists are
    /// still the cluster's while it is unchanged.
    membership: u64,
    /// How many nodes are draining: [`Cluster::any_draining`] in O(1).
    draining: usize,
    /// The last snapshot, with each node's change count then.
    last_snapshot: SnapshotCache,
}

/// The last [`Cluster::snapshot`]: handed out again while no node changed
/// since, and each node's part of it reused while that node did not
/// change. A clone of the cluster starts without one.
#[derive(Debug, Default)]
struct SnapshotCache(std::sync::Mutex<Option<Taken>>);

/// A snapshot, the membership it was taken at and, per node in order, its
/// change count then.
#[derive(Debug)]
struct Taken {
    snapshot: Snapshot,
    membership: u64,
    changes: Vec<u64>,
}

impl Clone for SnapshotCache {
    fn clone(&self) -> Self {
        SnapshotCache::default()
    }
}

impl Cluster {
    /// Builds an empty cluster (no deployments) from validated config.
    pub fn new(config: ClusterConfig) -> Result<Self, ConfigError> {
        config.placement.validate()?;
        let mut nodes = Vec::with_capacity(config.nodes.len());
        let mut node_index = BTreeMap::new();
        for (index, n) in config.nodes.iter().enumerate() {
            let node = n.to_node().map_err(|BadNode { field, why }| ConfigError::Node {
                index,
                node: n.id.to_string(),
                field,
                why,
            })?;
            if let Some(&first) = node_index.get(&n.id) {
                return Err(ConfigError::DuplicateNode { id: n.id.clone(), first, second: index });
            }
            node_index.insert(n.id.clone(), index);
            nodes.push(node);
        }
        let models = config
            .models
            .iter()
            .map(|(k, spec)| Ok((k.clone(), spec.footprint(k.as_str())?)))
            .collect::<Result<_, ConfigError>>()?;
        let requirements = config
            .models
            .iter()
            .map(|(k, spec)| (k.clone(), spec.requirement()))
            .filter(|(_, r)| !r.is_none())
            .collect();
        let hotswap = config.models.iter().filter(|(_, spec)| spec.hotswap).map(|(k, _)| k.clone()).collect();
        Ok(Self {
            config: config.placement,
            models,
            artifacts: BTreeMap::new(),
            requirements,
            sleepless: BTreeSet::new(),
            hotswap,
            nodes,
            node_index,
            replicas: BTreeMap::new(),
            by_model: BTreeMap::new(),
            membership: 0,
            draining: 0,
            last_snapshot: SnapshotCache::default(),
        })
    }

    // ---- getters ----

    /// The policy knobs.
    pub fn config(&self) -> &PlacementConfig {
        &self.config
    }

    /// The nodes: the config's in its order, then each one that joined
    /// ([`Cluster::add_node`]) in the order it joined.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// A node by id.
    pub fn node(&self, id: &NodeId) -> Option<&Node> {
        self.node_index.get(id).map(|&i| &self.nodes[i])
    }

    /// The hardware a model requires of a node (`None`: any node).
    pub fn requirement(&self, model: &ModelKey) -> Option<&Requirement> {
        self.requirements.get(model)
    }

    /// The hardware `model` requires when no node with GPUs has it: the
    /// model can never be placed, whatever else changes.
    pub fn missing_hardware(&self, model: &ModelKey) -> Option<&Requirement> {
        self.requirements.get(model).filter(|r| {
            !self.nodes.iter().any(|n| !n.gpus().is_empty() && r.admits(n.gpu_kind(), n.gpu_memory()))
        })
    }

    /// The reservation a model of `size` bytes that `requires` hardware
    /// (its [`Cluster::requirement`], looked up once per placement, not
    /// per node) needs on `node`, or `None` if the node cannot host it: too
    /// few GPUs, or not that hardware.
    /// A draining or suspect node hosts nothing new
    /// ([`Cluster::set_draining`], [`Cluster::set_suspect`]).
    pub(crate) fn shape_on(&self, requires: Option<&Requirement>, size: u64, node: &Node) -> Option<Shape> {
        if node.draining() || node.suspect() {
            return None;
        }
        self.shape_anyway(requires, size, node)
    }

    /// [`Cluster::shape_on`] as if `node` were neither draining nor suspect: what it could
    /// host, for saying why a model cannot be placed.
    pub(crate) fn shape_anyway(
        &self,
        requires: Option<&Requirement>,
        size: u64,
        node: &Node,
    ) -> Option<Shape> {
        if requires.is_some_and(|r| !r.admits(node.gpu_kind(), node.gpu_memory())) {
            return None;
        }
        Shape::for_model(&self.config, size, node.gpu_memory())
    }

    /// A model's footprint in bytes, if it is in the catalogue.
    pub fn model_size(&self, model: &ModelKey) -> Option<u64> {
        self.models.get(model).copied()
    }

    /// The model catalogue: key → footprint in bytes.
    pub fn models(&self) -> &BTreeMap<ModelKey, u64> {
        &self.models
    }

    /// The weight artifact `model` loads, if one was set with
    /// [`Cluster::set_model_artifact`].
    pub fn model_artifact(&self, model: &ModelKey) -> Option<&str> {
        self.artifacts.get(model).map(String::as_str)
    }

    /// Whether `model`'s engine can sleep, as last set with
    /// [`Cluster::set_sleeps`] (true until then, and for a model not in the
    /// catalogue).
    pub fn sleeps(&self, model: &ModelKey) -> bool {
        !self.sleepless.contains(model)
    }

    /// Whether `model` is in the hotswap tier ([`ModelSpec::hotswap`]):
    /// what a driver asks of a `from_cache` step or an eviction to count
    /// swaps (false for a model not in the catalogue).
    ///
    /// [`ModelSpec::hotswap`]: crate::ModelSpec::hotswap
    pub fn hotswap(&self, model: &ModelKey) -> bool {
        self.hotswap.contains(model)
    }

    /// A hot or warm replica's record.
    pub fn deployment(&self, replica: &ReplicaId) -> Option<&Deployment> {
        let loc = self.replicas.get(replica)?;
        let node = &self.nodes[loc.node];
        let map = if loc.level == Level::Hot { node.hot() } else { node.warm() };
        map.get(&loc.model)?.get(replica)
    }

    /// How many replicas of `model` are at `level` — what
    /// [`replicas_of`](Self::replicas_of) would list, without reading their
    /// records: a controller asks it of every model on every tick.
    pub fn count_of(&self, model: &ModelKey, level: Level) -> usize {
        self.by_model
            .get(model)
            .map_or(0, |ids| ids.iter().filter(|id| self.replicas[*id].level == level).count())
    }

    /// A model's replicas at `level` (`Hot` or `Warm`), by replica id.
    pub fn replicas_of(&self, model: &ModelKey, level: Level) -> Vec<&Deployment> {
        self.by_model
            .get(model)
            .into_iter()
            .flatten()
            .filter(|id| self.replicas[*id].level == level)
            .filter_map(|id| self.deployment(id))
            .collect()
    }

    /// Every hot and warm deployment, keyed by replica id: the state a
    /// [`DeploymentDelta`](crate::DeploymentDelta) is computed between.
    /// Weight residency is not part of it: a node agent has nothing to do
    /// about it, and the caller re-reports it rather than restoring it.
    ///
    /// Taken again of a cluster no node of which changed, it is the same
    /// snapshot, shared ([`Snapshot::same_as`]): O(nodes) to check, instead
    /// of a copy of every deployment; otherwise only the nodes that changed
    /// are copied, the others shared with the last snapshot.
    pub fn snapshot(&self) -> Snapshot {
        let mut cache = self.last_snapshot.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let changes: Vec<u64> = self.nodes.iter().map(Node::changes).collect();
        let last = cache.as_ref().filter(|t| t.membership == self.membership);
        if let Some(t) = last.filter(|t| t.changes == changes) {
            return t.snapshot.clone();
        }
        let (nodes, parts) = match last {
            Some(t) => {
                let (nodes, before) = t.snapshot.parts();
                let parts = self
                    .nodes
                    .iter()
                    .zip(before.iter().zip(&t.changes))
                    .map(|(n, (part, &then))| match n.changes() == then {
                        true => part.clone(),
                        false => Self::part(n),
                    })
                    .collect();
                (nodes.clone(), parts)
            }
            None => (
                Arc::new(self.nodes.iter().map(|n| n.id().clone()).collect()),
                self.nodes.iter().map(Self::part).collect(),
            ),
        };
        let snapshot = Snapshot::from_parts(nodes, parts);
        *cache = Some(Taken { snapshot: snapshot.clone(), membership: self.membership, changes });
        snapshot
    }

    /// One node's part of a snapshot: its hot and warm deployments.
    fn part(node: &Node) -> Part {
        Arc::new(
            node.hot_deployments()
                .chain(node.warm_deployments())
                .map(|d| (d.replica_id, d.clone()))
                .collect(),
        )
    }

    // ---- set-up ----

    /// Registers an existing deployment. Hot ones must fit the free room as
    /// the sizing rules shape them (whole-GPU claims need tenant-free GPUs);
    /// warm ones must fit the free cache. On error nothing changes.
    pub fn restore(&mut self, r: Restore) -> Result<ReplicaId, RestoreError> {
        let size =
            self.model_size(&r.model_key).ok_or_else(|| RestoreError::UnknownModel(r.model_key.clone()))?;
        let &ni = self.node_index.get(&r.node).ok_or_else(|| RestoreError::UnknownNode(r.node.clone()))?;
        if self.replicas.contains_key(&r.replica_id) {
            return Err(RestoreError::DuplicateReplica(r.replica_id));
        }
        let mut dep = Deployment {
            model_key: r.model_key,
            replica_id: r.replica_id,
            node: r.node,
            level: r.level,
            gpu_bytes_by_gpu: BTreeMap::new(),
            gpu_fraction: None,
            size_bytes: size,
            dedicated: r.dedicated,
            deployed_at_ms: r.deployed_at_ms,
        };
        let node = &self.nodes[ni];
        match r.level {
            Level::Cold => return Err(RestoreError::Cold(Level::Cold)),
            Level::Warm => {
                if r.gpus.is_some() {
                    return Err(RestoreError::WarmWithGpus);
                }
                let free = node.cache_budget() - node.cache_used();
                if size > free {
                    return Err(RestoreError::CacheFull { node: dep.node, need: size, free });
                }
                self.nodes[ni].insert_warm(dep.clone());
            }
            Level::Hot => {
                let shape = Shape::for_model(&self.config, size, node.gpu_memory())
                    .ok_or_else(|| RestoreError::NoRoom(dep.node.clone()))?;
                let alloc = match r.gpus {
                    None => {
                        self.fit_free(node, shape).ok_or_else(|| RestoreError::NoRoom(dep.node.clone()))?
                    }
                    Some(gpus) => check_listed_gpus(node, shape, &gpus)?,
                };
                dep.gpu_fraction = Some(fraction(shape, node.gpu_memory()));
                dep.gpu_bytes_by_gpu = alloc;
                self.nodes[ni].insert_hot(dep.clone());
            }
        }
        self.track(&dep, ni);
        Ok(dep.replica_id)
    }

    // ---- membership ----

    /// Adds a node that joined while the cluster runs (a node agent that
    /// came up), with no deployments: it is a candidate for the next
    /// [`Cluster::deploy`]. It is held to the rules [`Cluster::new`] holds
    /// a configured node to, and refused if a node with its id is already
    /// here: a node that comes back must be removed first
    /// ([`Cluster::remove_node`]), since what it ran before is gone. On
    /// error nothing changes.
    pub fn add_node(&mut self, node: NodeConfig) -> Result<(), AddNodeError> {
        if self.node_index.contains_key(&node.id) {
            return Err(AddNodeError::Duplicate(node.id));
        }
        let built = node.to_node().map_err(|BadNode { field, why }| AddNodeError::Invalid {
            node: node.id.clone(),
            field,
            why,
        })?;
        self.node_index.insert(node.id, self.nodes.len());
        self.nodes.push(built);
        self.membership += 1;
        Ok(())
    }

    /// Removes a node that left or was lost, with everything it held: its
    /// hot and warm deployments (returned, hot ones first, each group by
    /// model then replica id, so the caller can tell the models what they
    /// lost and place the hot ones again) and the weight residency it
    /// reported. Nothing is demoted or moved: the node's engines and warm
    /// cache went with it, so its replicas are simply no longer anywhere.
    /// `None` if no such node is here (already removed, or never added).
    pub fn remove_node(&mut self, id: &NodeId) -> Option<Vec<Deployment>> {
        let ni = self.node_index.remove(id)?;
        // `remove`, not `swap_remove`: the other nodes keep their order, so
        // the rng's tie-breaks among them draw as they did before.
        let node = self.nodes.remove(ni);
        self.membership += 1;
        self.draining -= usize::from(node.draining());
        let gone: Vec<Deployment> = node.into_deployments().collect();
        for d in &gone {
            self.untrack(&d.model_key, &d.replica_id);
        }
        // Every node after it moved down one place.
        for i in self.node_index.values_mut().chain(self.replicas.values_mut().map(|loc| &mut loc.node)) {
            if *i > ni {
                *i -= 1;
            }
        }
        Some(gone)
    }

    // ---- residency ----

    /// Says which weight artifact (an opaque id such as `hg1:…`; models may
    /// share one) `model`'s replicas load, or that it has none (`None`).
    /// With an artifact set, [`Cluster::deploy`] prefers, among equally good
    /// candidates, nodes that hold it resident ([`Cluster::set_resident`]).
    /// An unknown model is an error rather than ignored, so a typo does not
    /// silently disable the preference; on error nothing changes.
    pub fn set_model_artifact(
        &mut self,
        model: &ModelKey,
        artifact: Option<String>,
    ) -> Result<(), ResidencyError> {
        if !self.models.contains_key(model) {
            return Err(ResidencyError::UnknownModel(model.clone()));
        }
        match artifact {
            Some(a) => self.artifacts.insert(model.clone(), a),
            None => self.artifacts.remove(model),
        };
        Ok(())
    }

    /// Replaces the set of weight artifacts `node` holds resident (in memory
    /// or the page cache of its weight store), as the node last reported it;
    /// an empty set clears it. The cluster never infers residency from its
    /// own placements: whether evicted weights are still cached is the
    /// node's to know. An unknown node is an error (a report from a node
    /// that left the cluster); on error nothing changes.
    pub fn set_resident(&mut self, node: &NodeId, artifacts: BTreeSet<String>) -> Result<(), ResidencyError> {
        let &ni = self.node_index.get(node).ok_or_else(|| ResidencyError::UnknownNode(node.clone()))?;
        self.nodes[ni].set_resident(artifacts);
        Ok(())
    }

    // ---- draining ----

    /// Marks `node` draining, or not any more. A draining node is no
    /// candidate for anything new — no replica is created, woken from its
    /// warm cache or made room for by evicting there — and a replica
    /// demoted there goes COLD rather than into its warm cache (the node is
    /// on its way out). What it holds stays until the caller moves it: its
    /// HOT replicas no longer count towards a model's replicas in
    /// [`Cluster::deploy`], which places the model's count on the other
    /// nodes, so the caller can stop the draining node's replicas once
    /// their replacements serve ([`Cluster::count_staying`]). Like
    /// residency it is input, not deployment state. An unknown node is an
    /// error; on error nothing changes.
    pub fn set_draining(&mut self, node: &NodeId, draining: bool) -> Result<(), DrainError> {
        let &ni = self.node_index.get(node).ok_or_else(|| DrainError::UnknownNode(node.clone()))?;
        if self.nodes[ni].draining() != draining {
            self.nodes[ni].set_draining(draining);
            self.draining = if draining { self.draining + 1 } else { self.draining - 1 };
        }
        Ok(())
    }

    /// Marks `node` suspect (`on`) or not: its agent and engines stopped
    /// answering the caller, which does not know yet whether the node is
    /// gone. A suspect node hosts nothing new — a replica found dead there
    /// is replaced elsewhere, not on the node that just lost it — while
    /// what it holds stays where it is (unlike [`Cluster::set_draining`],
    /// nothing is moved and no WARM copy dropped): if the node is gone, the
    /// caller removes it ([`Cluster::remove_node`]); if it answers again,
    /// the caller calls the suspicion off. Input, like draining. An unknown
    /// node is an error; on error nothing changes.
    pub fn set_suspect(&mut self, node: &NodeId, suspect: bool) -> Result<(), DrainError> {
        let &ni = self.node_index.get(node).ok_or_else(|| DrainError::UnknownNode(node.clone()))?;
        self.nodes[ni].set_suspect(suspect);
        Ok(())
    }

    /// Whether any node is draining: a driver's shortcut past the work of
    /// moving replicas off draining nodes (O(1)).
    pub fn any_draining(&self) -> bool {
        self.draining > 0
    }

    /// Whether `d` is *leaving*: HOT on a draining node, where it serves
    /// until the caller stops it but no longer counts towards its model.
    pub fn leaving(&self, d: &Deployment) -> bool {
        d.level == Level::Hot && self.node(&d.node).is_some_and(Node::draining)
    }

    /// How many HOT replicas of `model` are on nodes that are not draining:
    /// the count [`Cluster::deploy`] brings up to what it is asked.
    pub fn count_staying(&self, model: &ModelKey) -> usize {
        self.by_model.get(model).map_or(0, |ids| {
            ids.iter()
                .map(|id| &self.replicas[id])
                .filter(|loc| loc.level == Level::Hot && !self.nodes[loc.node].draining())
                .count()
        })
    }

    // ---- engines ----

    /// Says whether `model`'s engine can sleep — keep its weights in CPU
    /// memory and give its GPU memory back, to wake in seconds — as the
    /// driver learns it from a started engine (vLLM's and SGLang's can;
    /// llama.cpp, cog and external engines cannot). Until told otherwise a
    /// model is taken to sleep. A hot replica of a model that cannot sleep
    /// is demoted straight to COLD (its engine is stopped), never to WARM:
    /// it takes no room in a warm cache and drops no other model's WARM
    /// replica to make some. It does not touch replicas already WARM (a
    /// driver that finds one unable to sleep stops it and says so). An
    /// unknown model is an error; on error nothing changes.
    pub fn set_sleeps(&mut self, model: &ModelKey, sleeps: bool) -> Result<(), SleepsError> {
        if !self.models.contains_key(model) {
            return Err(SleepsError::UnknownModel(model.clone()));
        }
        if sleeps {
            self.sleepless.remove(model);
        } else {
            self.sleepless.insert(model.clone());
        }
        Ok(())
    }

    // ---- index upkeep ----

    fn track(&mut self, dep: &Deployment, node: usize) {
        self.replicas.insert(dep.replica_id, Loc { model: dep.model_key.clone(), node, level: dep.level });
        self.by_model.entry(dep.model_key.clone()).or_default().insert(dep.replica_id);
    }

    fn untrack(&mut self, model: &ModelKey, replica: &ReplicaId) {
        self.replicas.remove(replica);
        if let Some(set) = self.by_model.get_mut(model) {
            set.remove(replica);
            if set.is_empty() {
                self.by_model.remove(model);
            }
        }
    }

    fn mint_replica_id<R: rand::Rng + ?Sized>(&self, rng: &mut R) -> ReplicaId {
        loop {
            let id = ReplicaId::from_u128(rng.random());
            if !self.replicas.contains_key(&id) {
                return id;
            }
        }
    }

    /// A reservation for `shape` on `node` without evicting anything: the
    /// best-fitting GPU (least free room that suffices, lowest index on ties)
    /// for a share, the lowest-indexed tenant-free GPUs for whole claims.
    fn fit_free(&self, node: &Node, shape: Shape) -> Option<BTreeMap<u32, u64>> {
        match shape {
            Shape::Share { bytes, need_free } => {
                if node.max_free() < need_free {
                    return None;
                }
                let gpu =
                    node.gpus().iter().filter(|g| g.free_bytes >= need_free).min_by_key(|g| g.free_bytes)?;
                Some(BTreeMap::from([(gpu.index, bytes)]))
            }
            Shape::Whole { gpus } => {
                if node.empty_gpus() < gpus {
                    return None;
                }
                let alloc = node
                    .gpus()
                    .iter()
                    .filter(|g| g.tenants == 0)
                    .take(gpus as usize)
                    .map(|g| (g.index, g.total_bytes))
                    .collect();
                Some(alloc)
            }
        }
    }

    /// Recomputes every account from the deployments and compares it with
    /// what is stored; `Err` names the first discrepancy. The property tests
    /// call it after every command; it is public so drivers can too.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = BTreeSet::new();
        if self.node_index.len() != self.nodes.len()
            || self.nodes.iter().enumerate().any(|(ni, n)| self.node_index.get(n.id()) != Some(&ni))
        {
            return Err("the node index disagrees with the node list".into());
        }
        if self.draining != self.nodes.iter().filter(|n| n.draining()).count() {
            return Err(format!("{} nodes counted draining, not what the nodes say", self.draining));
        }
        for (ni, node) in self.nodes.iter().enumerate() {
            let mut reserved = vec![0u64; node.gpus().len()];
            let mut tenants = vec![0u32; node.gpus().len()];
            for d in node.hot_deployments() {
                if d.level != Level::Hot || d.gpu_bytes_by_gpu.is_empty() || d.gpu_fraction.is_none() {
                    return Err(format!(
                        "{} on {} is in the hot map but not a hot record",
                        d.name(),
                        node.id()
                    ));
                }
                for (&g, &b) in &d.gpu_bytes_by_gpu {
                    let slot =
                        reserved.get_mut(g as usize).ok_or(format!("{} names missing GPU {g}", d.name()))?;
                    *slot += b;
                    tenants[g as usize] += 1;
                }
            }
            for g in node.gpus() {
                let r = reserved[g.index as usize];
                if g.free_bytes + r != g.total_bytes || r > g.total_bytes {
                    return Err(format!(
                        "{} GPU {}: free {} + reserved {r} != total {}",
                        node.id(),
                        g.index,
                        g.free_bytes,
                        g.total_bytes
                    ));
                }
                if g.tenants != tenants[g.index as usize] {
                    return Err(format!("{} GPU {}: tenant count drifted", node.id(), g.index));
                }
            }
            let cached: u64 = node.warm_deployments().map(|d| d.size_bytes).sum();
            if cached != node.cache_used() || cached > node.cache_budget() {
                return Err(format!(
                    "{}: cache holds {cached}, accounts {}, budget {}",
                    node.id(),
                    node.cache_used(),
                    node.cache_budget()
                ));
            }
            for (level, d) in node
                .hot_deployments()
                .map(|d| (Level::Hot, d))
                .chain(node.warm_deployments().map(|d| (Level::Warm, d)))
            {
                if d.level != level || &d.node != node.id() {
                    return Err(format!(
                        "{} is filed under {level} on {} but says otherwise",
                        d.name(),
                        node.id()
                    ));
                }
                if level == Level::Warm && (!d.gpu_bytes_by_gpu.is_empty() || d.gpu_fraction.is_some()) {
                    return Err(format!("warm {} still holds GPUs", d.name()));
                }
                if !seen.insert(d.replica_id) {
                    return Err(format!("replica id {} appears twice", d.replica_id));
                }
                let expect = Loc { model: d.model_key.clone(), node: ni, level };
                if self.replicas.get(&d.replica_id) != Some(&expect) {
                    return Err(format!("index disagrees about {}", d.name()));
                }
                if !self.by_model.get(&d.model_key).is_some_and(|s| s.contains(&d.replica_id)) {
                    return Err(format!("model index misses {}", d.name()));
                }
            }
        }
        if seen.len() != self.replicas.len()
            || self.by_model.values().map(BTreeSet::len).sum::<usize>() != seen.len()
        {
            return Err("the replica index tracks replicas no node holds".into());
        }
        Ok(())
    }
}

/// The per-GPU memory fraction a replica of `shape` may use.
fn fraction(shape: Shape, gpu_memory: u64) -> f64 {
    match shape {
        Shape::Share { bytes, .. } => bytes as f64 / gpu_memory as f64,
        Shape::Whole { .. } => 1.0,
    }
}

fn check_listed_gpus(node: &Node, shape: Shape, gpus: &[u32]) -> Result<BTreeMap<u32, u64>, RestoreError> {
    let mut distinct = gpus.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() != shape.gpu_count() as usize {
        return Err(RestoreError::GpuCount {
            node: node.id().clone(),
            needs: shape.gpu_count(),
            given: gpus.len(),
        });
    }
    let mut alloc = BTreeMap::new();
    for gpu in distinct {
        let g = node.gpus().get(gpu as usize).ok_or_else(|| RestoreError::NoSuchGpu {
            node: node.id().clone(),
            gpu,
            count: node.gpus().len(),
        })?;
        let (need, whole) = match shape {
            Shape::Share { bytes, .. } => (bytes, false),
            Shape::Whole { .. } => (g.total_bytes, true),
        };
        if g.free_bytes < need || (whole && g.tenants > 0) {
            return Err(RestoreError::GpuFull {
                node: node.id().clone(),
                gpu,
                need,
                free: g.free_bytes,
                whole,
            });
        }
        alloc.insert(gpu, need);
    }
    Ok(alloc)
}
