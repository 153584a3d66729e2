//! One node's resource accounting: its GPUs, its hot deployments, and its
//! warm cache in CPU memory.

use std::collections::{BTreeMap, BTreeSet};

use hangar_core::{ModelKey, ReplicaId};
use serde::Serialize;

use crate::config::MAX_GPUS_PER_NODE;
use crate::deployment::{Deployment, Level, NodeId};

/// One GPU of a node. `free_bytes + Σ reservations on it = total_bytes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// Index on the node, from 0.
    pub index: u32,
    /// Label of the GPU model (`H100`, `virtual`, …).
    pub kind: String,
    /// Memory in bytes.
    pub total_bytes: u64,
    /// Memory not reserved by any hot deployment.
    pub free_bytes: u64,
    /// Hot deployments with a reservation on this GPU.
    pub tenants: u32,
}

/// Replica maps keyed model → replica, as the node agent sees them.
pub type ReplicaMap = BTreeMap<ModelKey, BTreeMap<ReplicaId, Deployment>>;

/// A worker node: GPUs of one size, hot deployments, and the warm cache.
#[derive(Debug, Clone)]
pub struct Node {
    id: NodeId,
    gpus: Vec<Gpu>,
    gpu_memory: u64,
    cache_budget: u64,
    cache_used: u64,
    hot: ReplicaMap,
    warm: ReplicaMap,
    /// Largest `free_bytes` over the GPUs: answers "does a share fit without
    /// eviction" in O(1) during candidate evaluation.
    max_free: u64,
    /// GPUs with no tenant: answers "are k whole GPUs free" in O(1).
    empty_gpus: u32,
    /// Per GPU, its free bytes, and the smallest reservation on it (its total
    /// when empty: any eviction there frees, and costs, at least this much).
    /// Kept inline so a cluster-wide scan of eviction bounds reads one
    /// contiguous record per node instead of chasing pointers.
    gpu_free: [u64; MAX_GPUS],
    min_reservation: [u64; MAX_GPUS],
    /// Weight artifacts resident in this node's weight store (memory or
    /// page cache), as last reported by the caller: a tie-breaker only, so
    /// it lives apart from the accounting above and no invariant covers it.
    resident: BTreeSet<String>,
    /// Draining ([`Cluster::set_draining`](crate::Cluster::set_draining)):
    /// nothing new is placed here, and what is demoted here goes COLD.
    /// Input, like residency: no invariant covers it.
    draining: bool,
    /// Suspect ([`Cluster::set_suspect`](crate::Cluster::set_suspect)):
    /// nothing new is placed here, but nothing moves either. Input, like
    /// draining.
    suspect: bool,
    /// Bumped by every change to `hot` or `warm`: a cluster's snapshot
    /// taken at the same counts of every node is still the cluster's.
    changes: u64,
}

const MAX_GPUS: usize = MAX_GPUS_PER_NODE as usize;

impl Node {
    pub(crate) fn new(id: NodeId, gpus: u32, gpu_memory: u64, kind: String, cache_budget: u64) -> Self {
        let gpus = (0..gpus)
            .map(|index| Gpu {
                index,
                kind: kind.clone(),
                total_bytes: gpu_memory,
                free_bytes: gpu_memory,
                tenants: 0,
            })
            .collect();
        let mut node = Self {
            id,
            gpus,
            gpu_memory,
            cache_budget,
            cache_used: 0,
            hot: ReplicaMap::new(),
            warm: ReplicaMap::new(),
            max_free: 0,
            empty_gpus: 0,
            gpu_free: [0; MAX_GPUS],
            min_reservation: [0; MAX_GPUS],
            resident: BTreeSet::new(),
            draining: false,
            suspect: false,
            changes: 0,
        };
        node.refresh_summary();
        node
    }

    /// The node's id.
    pub fn id(&self) -> &NodeId {
        &self.id
    }

    /// Its GPUs.
    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// The label of its GPUs (`H100`, `virtual`, …; empty without GPUs).
    pub fn gpu_kind(&self) -> &str {
        self.gpus.first().map_or("", |g| g.kind.as_str())
    }

    /// Memory of each of its GPUs (0 without GPUs).
    pub fn gpu_memory(&self) -> u64 {
        self.gpu_memory
    }

    /// Hot deployments, model → replica.
    pub fn hot(&self) -> &ReplicaMap {
        &self.hot
    }

    /// Warm deployments, model → replica.
    pub fn warm(&self) -> &ReplicaMap {
        &self.warm
    }

    /// CPU memory set aside for the warm cache.
    pub fn cache_budget(&self) -> u64 {
        self.cache_budget
    }

    /// CPU memory the warm cache holds now.
    pub fn cache_used(&self) -> u64 {
        self.cache_used
    }

    /// Weight artifacts resident in the node's weight store, as last set by
    /// [`Cluster::set_resident`](crate::Cluster::set_resident) (empty until
    /// then). Not derived from the deployments here: a warm or evicted
    /// replica's weights may or may not still be in the page cache, and only
    /// the node knows.
    pub fn resident(&self) -> &BTreeSet<String> {
        &self.resident
    }

    pub(crate) fn set_resident(&mut self, artifacts: BTreeSet<String>) {
        self.resident = artifacts;
    }

    /// Whether the node is draining, as last set by
    /// [`Cluster::set_draining`](crate::Cluster::set_draining) (false until
    /// then).
    pub fn draining(&self) -> bool {
        self.draining
    }

    pub(crate) fn set_draining(&mut self, draining: bool) {
        self.draining = draining;
    }

    /// Whether the node is suspect, as last set by
    /// [`Cluster::set_suspect`](crate::Cluster::set_suspect) (false until
    /// then).
    pub fn suspect(&self) -> bool {
        self.suspect
    }

    pub(crate) fn set_suspect(&mut self, suspect: bool) {
        self.suspect = suspect;
    }

    pub(crate) fn max_free(&self) -> u64 {
        self.max_free
    }

    pub(crate) fn empty_gpus(&self) -> u32 {
        self.empty_gpus
    }

    pub(crate) fn hot_deployments(&self) -> impl Iterator<Item = &Deployment> {
        self.hot.values().flat_map(|m| m.values())
    }

    pub(crate) fn warm_deployments(&self) -> impl Iterator<Item = &Deployment> {
        self.warm.values().flat_map(|m| m.values())
    }

    /// Every deployment the node holds, hot ones first, each group by model
    /// then replica id: what a node that leaves takes with it.
    pub(crate) fn into_deployments(self) -> impl Iterator<Item = Deployment> {
        self.hot.into_values().chain(self.warm.into_values()).flat_map(BTreeMap::into_values)
    }

    /// Free bytes per GPU (a copy of the GPUs' `free_bytes`).
    pub(crate) fn gpu_free(&self) -> &[u64] {
        &self.gpu_free[..self.gpus.len()]
    }

    /// Smallest reservation per GPU (its total when it has no tenant).
    pub(crate) fn min_reservation(&self) -> &[u64] {
        &self.min_reservation[..self.gpus.len()]
    }

    fn refresh_summary(&mut self) {
        self.max_free = self.gpus.iter().map(|g| g.free_bytes).max().unwrap_or(0);
        self.empty_gpus = self.gpus.iter().filter(|g| g.tenants == 0).count() as u32;
        for (i, g) in self.gpus.iter().enumerate() {
            self.gpu_free[i] = g.free_bytes;
            self.min_reservation[i] = g.total_bytes;
        }
        for d in self.hot.values().flat_map(|m| m.values()) {
            for (&g, &b) in &d.gpu_bytes_by_gpu {
                let slot = &mut self.min_reservation[g as usize];
                *slot = (*slot).min(b);
            }
        }
    }

    /// Reserves `dep`'s GPU bytes and records it hot. The caller has checked
    /// the room (plans are computed from this same state), so running out
    /// here is a bug in the caller.
    pub(crate) fn insert_hot(&mut self, dep: Deployment) {
        debug_assert_eq!(dep.level, Level::Hot);
        for (&gpu, &bytes) in &dep.gpu_bytes_by_gpu {
            let g = &mut self.gpus[gpu as usize];
            g.free_bytes = g.free_bytes.checked_sub(bytes).expect("placement plan over-commits a GPU");
            g.tenants += 1;
        }
        self.hot.entry(dep.model_key.clone()).or_default().insert(dep.replica_id, dep);
        self.changes += 1;
        self.refresh_summary();
    }

    /// Removes a hot deployment and returns its GPU bytes to the GPUs.
    pub(crate) fn remove_hot(&mut self, model: &ModelKey, replica: &ReplicaId) -> Option<Deployment> {
        let dep = remove_nested(&mut self.hot, model, replica)?;
        self.changes += 1;
        for (&gpu, &bytes) in &dep.gpu_bytes_by_gpu {
            let g = &mut self.gpus[gpu as usize];
            g.free_bytes += bytes;
            g.tenants -= 1;
        }
        self.refresh_summary();
        Some(dep)
    }

    /// Flips the dedicated flag of a hot or warm deployment; true if it changed.
    pub(crate) fn set_dedicated(&mut self, model: &ModelKey, replica: &ReplicaId, dedicated: bool) -> bool {
        let dep = self
            .hot
            .get_mut(model)
            .and_then(|m| m.get_mut(replica))
            .or_else(|| self.warm.get_mut(model).and_then(|m| m.get_mut(replica)));
        match dep {
            Some(d) if d.dedicated != dedicated => {
                d.dedicated = dedicated;
                self.changes += 1;
                true
            }
            _ => false,
        }
    }

    /// Takes a warm deployment out of the cache, releasing its CPU bytes.
    pub(crate) fn remove_warm(&mut self, model: &ModelKey, replica: &ReplicaId) -> Option<Deployment> {
        let dep = remove_nested(&mut self.warm, model, replica)?;
        self.changes += 1;
        self.cache_used -= dep.size_bytes;
        Some(dep)
    }

    /// Warm entries that would be dropped so that `size` more bytes fit in
    /// the cache: those of models outside the hotswap tier (`hotswap` says
    /// which are in it) first, then the hotswap ones, each smallest first;
    /// `None` if even dropping every droppable entry would not make room
    /// (then nothing is dropped and the newcomer goes cold). Dedicated
    /// entries are never dropped.
    ///
    /// Hotswap copies go last because the tier lives on them: a hotswap
    /// model holds no GPUs of its own, so each time demand swaps it back in
    /// it is either woken from this cache in seconds or loaded cold in
    /// minutes, while a model that holds its own replicas is evicted rarely
    /// and comes back rarely.
    pub(crate) fn cache_room_for(
        &self,
        size: u64,
        hotswap: impl Fn(&ModelKey) -> bool,
    ) -> Option<Vec<(ModelKey, ReplicaId)>> {
        if size > self.cache_budget {
            return None;
        }
        let free = self.cache_budget - self.cache_used;
        if size <= free {
            return Some(Vec::new());
        }
        let mut shortfall = size - free;
        let mut entries: Vec<&Deployment> = self.warm_deployments().filter(|d| !d.dedicated).collect();
        entries.sort_by_key(|d| (hotswap(&d.model_key), d.size_bytes, d.replica_id));
        let mut drop = Vec::new();
        for d in entries {
            drop.push((d.model_key.clone(), d.replica_id));
            shortfall = shortfall.saturating_sub(d.size_bytes);
            if shortfall == 0 {
                return Some(drop);
            }
        }
        None
    }

    /// Records a warm deployment; the caller has made room.
    pub(crate) fn insert_warm(&mut self, dep: Deployment) {
        debug_assert_eq!(dep.level, Level::Warm);
        self.cache_used += dep.size_bytes;
        debug_assert!(self.cache_used <= self.cache_budget);
        self.warm.entry(dep.model_key.clone()).or_default().insert(dep.replica_id, dep);
        self.changes += 1;
    }

    /// How many times its deployments changed.
    pub(crate) fn changes(&self) -> u64 {
        self.changes
    }
}

fn remove_nested(map: &mut ReplicaMap, model: &ModelKey, replica: &ReplicaId) -> Option<Deployment> {
    let inner = map.get_mut(model)?;
    let dep = inner.remove(replica)?;
    if inner.is_empty() {
        map.remove(model);
    }
    Some(dep)
}
