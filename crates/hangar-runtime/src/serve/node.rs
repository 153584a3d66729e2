//! The nodes this process runs engines on: a single `hangar serve`'s
//! `[[nodes]]`, or a fleet agent's one machine.
//!
//! Their replicas follow `hangar-agent`'s replica lifecycle: the node's
//! desired state (what placement wants of each replica) goes to the
//! lifecycle driver, which converges each replica's engine toward it one
//! step at a time. This module builds that driver over the node's real
//! engines and is its [`Sink`]: a replica that serves gets its permits on
//! its model's processor and is routed to; one that stops serving loses
//! them at once; every change is mirrored in the model's replica table;
//! and on a single machine the controller hears each fact (ready, failed,
//! cold). A fleet's agent tells no controller: the leader reads the node's
//! report instead.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use hangar_agent::lifecycle::{self, DriverHandle, Fact, ModelEngine, NodeEngines, NodeReplica, Sink};
use hangar_core::{ModelKey, ReplicaId, ReplicaPhase};
use hangar_placement::Cluster;
use hangar_scaler::StartTier;

use super::control::Command;
use super::replicas::Replica;
use super::{replica_name, Inner, ModelRuntime, ServeConfig};

/// Each node's GPUs' memory, as placement knows them.
pub(crate) fn node_gpus(cluster: &Cluster) -> BTreeMap<String, Vec<u64>> {
    cluster.nodes().iter().map(|n| (n.id().to_string(), vec![n.gpu_memory(); n.gpus().len()])).collect()
}

/// Starts the lifecycle driver of `nodes` for `inner`'s models, its
/// engines bound to `engine_host`; `tell_controller`: whether facts go to
/// this process's controller (a single machine) or nowhere (an agent).
pub(crate) fn start_driver(
    inner: &Arc<Inner>,
    config: &ServeConfig,
    nodes: BTreeMap<String, Vec<u64>>,
    tell_controller: bool,
) -> DriverHandle {
    let models = config
        .models
        .iter()
        .map(|m| (m.key.clone(), ModelEngine { spec: m.engine.clone(), weights: m.weights.clone() }))
        .collect();
    let engines = NodeEngines::new(
        models,
        inner.hangar_exe.clone(),
        inner.engine_host.clone(),
        inner.client.clone(),
        inner.weights.clone(),
    );
    let sink = NodeSink { inner: Arc::downgrade(inner), tell_controller };
    let driver = lifecycle::spawn(nodes, Arc::new(engines), Arc::new(sink));
    inner.driver.set(driver.clone()).unwrap_or_else(|_| panic!("one driver per server"));
    driver
}

/// How the driver's news reaches the rest of the process.
struct NodeSink {
    inner: Weak<Inner>,
    tell_controller: bool,
}

impl NodeSink {
    fn model(&self, model: &ModelKey) -> Option<(Arc<Inner>, Arc<ModelRuntime>)> {
        let inner = self.inner.upgrade()?;
        let rt = inner.models.get(model.as_str())?.clone();
        Some((inner, rt))
    }
}

impl Sink for NodeSink {
    fn serve(&self, replica: ReplicaId, model: &ModelKey, url: &str) {
        let Some((_, rt)) = self.model(model) else { return };
        {
            let mut table = rt.replicas.lock().expect("replica table lock");
            let entry = table.entry(replica).or_insert_with(|| Replica {
                state: ReplicaPhase::Starting,
                base_url: None,
                node: None,
                local: None,
            });
            entry.state = ReplicaPhase::Ready;
            entry.base_url = Some(url.to_owned());
        }
        rt.processor.replica_ready(replica, rt.config.permits());
    }

    fn unserve(&self, replica: ReplicaId, model: &ModelKey) {
        let Some((_, rt)) = self.model(model) else { return };
        if let Some(r) = rt.replicas.lock().expect("replica table lock").get_mut(&replica) {
            r.state = ReplicaPhase::Draining;
        }
        drop(rt.processor.replica_gone(replica));
    }

    fn fact(&self, fact: Fact) {
        let model = match &fact {
            Fact::Ready { model, .. } | Fact::Failed { model, .. } | Fact::Cold { model, .. } => {
                model.clone()
            }
        };
        let Some((inner, rt)) = self.model(&model) else { return };
        let command = match fact {
            Fact::Ready { replica, woke, took_ms, sleeps, .. } => {
                let name = replica_name(&model, replica);
                let report = rt
                    .replicas
                    .lock()
                    .expect("replica table lock")
                    .get(&replica)
                    .and_then(|r| r.local.as_ref()?.start.clone());
                match (woke, report) {
                    (true, _) => tracing::info!(replica = %name, took_ms, "replica woke from the warm cache"),
                    (false, Some(report)) => {
                        tracing::info!(replica = %name, took_ms, "replica ready: {report}")
                    }
                    (false, None) => tracing::info!(replica = %name, took_ms, "replica ready"),
                }
                let tier = if woke { StartTier::Warm } else { StartTier::Cold };
                Command::Ready { model, tier, took: Duration::from_millis(took_ms), sleeps }
            }
            Fact::Failed { replica, why, start_failed, .. } => {
                let name = replica_name(&model, replica);
                if start_failed {
                    tracing::error!(replica = %name, "did not start: {why}");
                } else {
                    tracing::warn!(replica = %name, "replica failed: {why}");
                    rt.metrics.replica_failed();
                }
                Command::Failed { model, replica, why, start_failed }
            }
            Fact::Cold { replica, .. } => {
                tracing::info!(replica = %replica_name(&model, replica), "no engine kept in the warm cache (it cannot sleep): the replica is cold");
                Command::Stopped { model, replica }
            }
        };
        if self.tell_controller {
            inner.control.send(command);
        }
    }

    fn in_flight(&self, replica: ReplicaId, model: &ModelKey) -> u32 {
        self.model(model).map_or(0, |(_, rt)| rt.processor.in_use_on(replica))
    }

    fn changed(&self, replica: ReplicaId, now: Option<&NodeReplica>) {
        let Some(inner) = self.inner.upgrade() else { return };
        match now {
            Some(r) => {
                let Some(rt) = inner.models.get(r.view.model.as_str()) else { return };
                rt.replicas.lock().expect("replica table lock").insert(replica, Replica::local(r));
            }
            None => {
                for rt in inner.models.values() {
                    rt.replicas.lock().expect("replica table lock").remove(&replica);
                }
            }
        }
    }
}
