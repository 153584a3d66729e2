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

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

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

/// Who hears of this process's replicas.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Audience {
    /// A single machine: its own controller hears every fact, and its own
    /// processors hold every permit.
    Controller,
    /// A fleet's agent: no controller here (the leader reads the node's
    /// report), and the permits are the gateways', which keep sending a
    /// replica requests for up to `routing_grace` after it stops serving
    /// (until their view of its node's report changes).
    Gateways {
        /// How long gateways may still route to a replica taken out.
        routing_grace: Duration,
    },
}

/// Starts the lifecycle driver of `nodes` for `inner`'s models, telling
/// `audience`.
pub(crate) fn start_driver(
    inner: &Arc<Inner>,
    config: &ServeConfig,
    nodes: BTreeMap<String, Vec<u64>>,
    audience: Audience,
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
    let sink = NodeSink { inner: Arc::downgrade(inner), audience, unserved: Mutex::default() };
    let driver = lifecycle::spawn(nodes, Arc::new(engines), Arc::new(sink));
    inner.driver.set(driver.clone()).unwrap_or_else(|_| panic!("one driver per server"));
    driver
}

/// How the driver's news reaches the rest of the process.
struct NodeSink {
    inner: Weak<Inner>,
    audience: Audience,
    /// When each replica stopped serving (for the gateways' grace).
    unserved: Mutex<HashMap<ReplicaId, Instant>>,
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
                reported: None,
            });
            entry.state = ReplicaPhase::Ready;
            entry.base_url = Some(url.to_owned());
        }
        rt.processor.replica_ready(replica, rt.config.permits());
    }

    fn unserve(&self, replica: ReplicaId, model: &ModelKey) {
        if let Audience::Gateways { routing_grace } = self.audience {
            let mut unserved = self.unserved.lock().expect("unserved lock");
            unserved.retain(|_, at| at.elapsed() < routing_grace);
            unserved.insert(replica, Instant::now());
        }
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
                rt.metrics.replica_started(tier, rt.config.hotswap, Duration::from_millis(took_ms));
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
            Fact::Cold { replica, failed, .. } => {
                let name = replica_name(&model, replica);
                match failed {
                    Some(why) => {
                        tracing::warn!(replica = %name, "replica failed in the warm cache, now cold: {why}");
                        rt.metrics.replica_failed();
                    }
                    None => {
                        tracing::info!(replica = %name, "no engine kept in the warm cache (it cannot sleep): the replica is cold")
                    }
                }
                Command::Stopped { model, replica }
            }
        };
        if matches!(self.audience, Audience::Controller) {
            inner.control.send(command);
        }
    }

    /// The permits held on `replica` here; on a fleet's agent, 1 while
    /// gateways may still be routing to it.
    fn in_flight(&self, replica: ReplicaId, model: &ModelKey) -> u32 {
        if let Audience::Gateways { routing_grace } = self.audience {
            let at = self.unserved.lock().expect("unserved lock").get(&replica).copied();
            return u32::from(at.is_some_and(|at| at.elapsed() < routing_grace));
        }
        self.model(model).map_or(0, |(_, rt)| rt.processor.in_use_on(replica))
    }

    fn changed(&self, replica: ReplicaId, now: Option<&NodeReplica>) {
        let Some(inner) = self.inner.upgrade() else { return };
        match now {
            Some(r) => {
                let Some(rt) = inner.models.get(r.view.model.as_str()) else { return };
                rt.replicas.lock().expect("replica table lock").insert(replica, Replica::local(r));
                rt.processor.replica_phase(replica, r.phase);
                if let Some(start) = &r.start {
                    rt.note_start(replica, Some(&r.view.node), start);
                }
            }
            None => {
                for rt in inner.models.values() {
                    rt.replicas.lock().expect("replica table lock").remove(&replica);
                    rt.processor.forget(replica);
                }
            }
        }
    }
}
