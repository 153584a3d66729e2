//! Demotion: HOT → WARM (or COLD when the warm cache cannot take it), and
//! the explicit `evict_*` commands.

use hangar_core::{ModelKey, ReplicaId};

use super::Cluster;
use crate::deployment::Level;
use crate::error::EvictError;
use crate::outcome::{Eviction, EvictionCause};

impl Cluster {
    /// Demotes hot replica `replica` on node `ni`: its GPU bytes return to
    /// the GPUs, and it goes warm on the same node if its model's engine can
    /// sleep ([`Cluster::set_sleeps`]) and the cache can hold it (dropping
    /// warm entries — non-hotswap ones first, then hotswap ones, each
    /// smallest first — but only if that covers the whole shortfall), else
    /// cold — a model that cannot sleep, or a replica on a draining node,
    /// without looking at the cache, so no WARM entry is dropped for a
    /// replica that would be stopped anyway.
    /// Appends what happened to `out`.
    pub(super) fn demote(
        &mut self,
        ni: usize,
        model: &ModelKey,
        replica: &ReplicaId,
        cause: EvictionCause,
        out: &mut Vec<Eviction>,
    ) {
        let node = &mut self.nodes[ni];
        let mut dep = node.remove_hot(model, replica).expect("demoting a replica the index says is hot");
        dep.level = Level::Warm;
        dep.gpu_bytes_by_gpu.clear();
        dep.gpu_fraction = None;
        let node_id = node.id().clone();
        let tier = &self.hotswap;
        let room = if self.sleepless.contains(model) || node.draining() {
            None
        } else {
            node.cache_room_for(dep.size_bytes, |m| tier.contains(m))
        };
        let Some(drops) = room else {
            self.untrack(model, replica);
            out.push(Eviction {
                model_key: model.clone(),
                replica_id: *replica,
                node: node_id,
                from: Level::Hot,
                to: Level::Cold,
                cause,
            });
            return;
        };
        out.push(Eviction {
            model_key: model.clone(),
            replica_id: *replica,
            node: node_id.clone(),
            from: Level::Hot,
            to: Level::Warm,
            cause,
        });
        for (m, r) in drops {
            self.nodes[ni].remove_warm(&m, &r).expect("cache_room_for names cached entries");
            self.untrack(&m, &r);
            out.push(Eviction {
                model_key: m,
                replica_id: r,
                node: node_id.clone(),
                from: Level::Warm,
                to: Level::Cold,
                cause: EvictionCause::CacheRoom { replica_id: *replica },
            });
        }
        self.nodes[ni].insert_warm(dep.clone());
        self.track(&dep, ni);
    }

    /// Evicts one replica, dedicated or not: a hot one is demoted (to warm
    /// if its engine can sleep and its node's cache can take it, else
    /// cold), a warm one is dropped
    /// (cold). Returns every demotion it caused, including warm entries
    /// dropped to make cache room. On error nothing changes.
    pub fn evict_replica(
        &mut self,
        model: &ModelKey,
        replica: &ReplicaId,
    ) -> Result<Vec<Eviction>, EvictError> {
        let loc = self
            .replicas
            .get(replica)
            .cloned()
            .ok_or_else(|| EvictError::UnknownReplica { model: model.clone(), replica: *replica })?;
        if loc.model != *model {
            return Err(EvictError::WrongModel {
                model: model.clone(),
                replica: *replica,
                actual: loc.model,
            });
        }
        let mut out = Vec::new();
        match loc.level {
            Level::Hot => self.demote(loc.node, model, replica, EvictionCause::Explicit, &mut out),
            _ => {
                let dep = self.nodes[loc.node].remove_warm(model, replica).expect("index says warm");
                self.untrack(model, replica);
                out.push(Eviction {
                    model_key: dep.model_key,
                    replica_id: dep.replica_id,
                    node: dep.node,
                    from: Level::Warm,
                    to: Level::Cold,
                    cause: EvictionCause::Explicit,
                });
            }
        }
        Ok(out)
    }

    /// Evicts every hot replica of `model` (dedicated or not), in replica-id
    /// order, each to warm or cold as [`Cluster::evict_replica`] does. Warm
    /// copies already cached stay cached. A model with nothing hot yields
    /// no evictions.
    pub fn evict_model(&mut self, model: &ModelKey) -> Vec<Eviction> {
        let hot: Vec<(usize, ReplicaId)> = self
            .replicas_of(model, Level::Hot)
            .into_iter()
            .map(|d| (self.node_index[&d.node], d.replica_id))
            .collect();
        let mut out = Vec::new();
        for (ni, id) in hot {
            self.demote(ni, model, &id, EvictionCause::Explicit, &mut out);
        }
        out
    }
}
