//! `hangar agent`: one machine of a fleet.
//!
//! It registers its node ([`Registry`]; a name another live agent holds
//! is refused), renews the registration every 2 s, and follows the
//! node's desired state: every 200 ms it compares what the leader wants
//! (`hangar:desired:NODE`) with the replicas it runs and carries out the
//! difference with the steps a single machine uses (`Inner::apply_step`:
//! weights from the store, engine launch, sleep, wake, stop). Four times a
//! second it reports every replica it runs, with its phase and engine URL
//! (`hangar:reported:NODE`); a replica missing from the report is gone,
//! which is how the leader hears of a failed start or a dead engine. The
//! replicas' own health checks run here, as on a single machine.
//!
//! On SIGTERM it drains: it leaves the registry at once (the leader places
//! its replicas elsewhere without waiting for the TTL), stops reporting
//! (gateways stop sending it new requests), gives requests in flight
//! `drain` to finish, then stops its engines. If another agent takes its
//! name — this one was silent past the TTL and replaced — it stops.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use axum::routing::get;
use hangar_core::{DesiredState, NodeRecord, NodeReport, ReplicaId, ReplicaReport};
use hangar_placement::{Action, NodeId};
use hangar_redis::fleet::FleetState;
use hangar_redis::registry::{Heartbeat, Registry, HEARTBEAT_EVERY, NODE_TTL};
use hangar_redis::Redis;
use tokio_util::sync::CancellationToken;

use super::super::replicas::ReplicaState;
use super::super::{build, Inner, ServeConfig, ServeError};
use super::{deployment, wall_ms};

/// How often the desired state is read.
const FOLLOW_EVERY: Duration = Duration::from_millis(200);
/// How often the replicas are reported.
const REPORT_EVERY: Duration = Duration::from_millis(250);

/// A running node agent.
pub struct Agent {
    inner: Arc<Inner>,
    record: NodeRecord,
    node: NodeId,
    registry: Registry,
    fleet: FleetState,
    /// Replicas with a step in progress: not stepped again until it ends.
    busy: Mutex<HashSet<ReplicaId>>,
    /// Stops the loops.
    stop: CancellationToken,
    /// Cancelled when another agent took the node's name.
    replaced: CancellationToken,
}

impl Agent {
    /// Registers `record` and starts following the node's desired state.
    /// `config` is the fleet's file: its models (and store) are what this
    /// node can run; its `[[nodes]]`, if any, are ignored (the node is
    /// `record`). Engines bind to `engine_host` and are reported at it, so
    /// it must be an address of this machine the gateways can reach.
    /// Fails if another live agent holds the name, or Redis does not
    /// answer.
    pub async fn start(
        mut config: ServeConfig,
        hangar_exe: std::path::PathBuf,
        engine_host: String,
        redis: Redis,
        record: NodeRecord,
    ) -> Result<Arc<Agent>, ServeError> {
        let node = super::node_config(&record).map_err(ServeError::Config)?;
        hangar_placement::Cluster::new(hangar_placement::ClusterConfig {
            nodes: vec![node.clone()],
            ..config.cluster()
        })
        .map_err(|e| ServeError::Config(e.to_string()))?;
        let id = node.id.clone();
        // Checked as a fleet's file: the models, not whether they fit on
        // this one machine (placement decides where they go).
        config.nodes.clear();
        config.redis = Some(redis.url().to_owned());
        let (inner, mut commands) = build(&config, hangar_exe, engine_host).await?;
        // Replicas report ready and failed to a controller; here the
        // leader learns it from the node's report instead.
        tokio::spawn(async move { while commands.recv().await.is_some() {} });
        let registry = Registry::new(redis.clone(), NODE_TTL);
        let (registry, registered) = tokio::task::spawn_blocking(move || {
            let result = registry.register(&record, wall_ms());
            (registry, result.map(|()| record))
        })
        .await
        .expect("registering does not panic");
        let record = registered.map_err(|e| ServeError::Fleet(e.to_string()))?;
        let agent = Arc::new(Agent {
            inner,
            record,
            node: id,
            registry,
            fleet: FleetState::new(redis),
            busy: Mutex::default(),
            stop: CancellationToken::new(),
            replaced: CancellationToken::new(),
        });
        tracing::info!(node = %agent.node, url = %agent.record.url, "registered with the fleet");
        tokio::spawn(every(Arc::downgrade(&agent), HEARTBEAT_EVERY, Agent::heartbeat));
        tokio::spawn(every(Arc::downgrade(&agent), FOLLOW_EVERY, Agent::follow));
        tokio::spawn(every(Arc::downgrade(&agent), REPORT_EVERY, Agent::report_now));
        Ok(agent)
    }

    /// The node's replicas as its report says them.
    pub fn report(&self) -> NodeReport {
        let mut replicas = Vec::new();
        for rt in self.inner.models.values() {
            for (id, r) in rt.replicas.lock().expect("replica table lock").iter() {
                replicas.push(ReplicaReport {
                    replica: *id,
                    model: rt.config.key.clone(),
                    phase: r.state.into(),
                    url: r.base_url.clone(),
                    ready_ms: r.ready_ms(),
                    sleeps: r.capabilities.sleep.is_some(),
                });
            }
        }
        NodeReport { agent: self.record.agent.clone(), replicas }
    }

    /// `GET /health` and `GET /status` (the node's record and report).
    pub fn router(self: &Arc<Self>) -> axum::Router {
        let me = self.clone();
        axum::Router::new().route("/health", get(|| async { "ok" })).route(
            "/status",
            get(move || {
                let me = me.clone();
                async move { axum::Json(serde_json::json!({"node": me.record, "report": me.report()})) }
            }),
        )
    }

    /// Resolves when another agent has taken this node's name: this one
    /// must stop.
    pub async fn replaced(&self) {
        self.replaced.cancelled().await
    }

    /// Leaves the fleet: out of the registry and the reports at once,
    /// then `drain` for requests in flight, then every engine stopped.
    pub async fn shutdown(&self, drain: Duration) {
        self.stop.cancel();
        let (registry, fleet, record) = (self.registry.clone(), self.fleet.clone(), self.record.clone());
        let left = tokio::task::spawn_blocking(move || {
            registry.deregister(&record).map_err(|e| e.to_string())?;
            fleet.forget(&record.name).map_err(|e| e.to_string())
        })
        .await
        .expect("leaving does not panic");
        match left {
            Ok(()) => tracing::info!(node = %self.node, "left the fleet; draining for {drain:?}"),
            Err(e) => {
                tracing::warn!(node = %self.node, "could not leave the registry ({e}); it lapses in {NODE_TTL:?}")
            }
        }
        if !self.replaced.is_cancelled() {
            tokio::time::sleep(drain).await;
        }
        for rt in self.inner.models.values() {
            for engine in rt.take_engines() {
                engine.stop(Duration::from_secs(5)).await;
            }
        }
    }

    fn heartbeat(self: Arc<Self>) {
        match self.registry.heartbeat(&self.record, wall_ms()) {
            Ok(Heartbeat::Renewed) => {}
            Ok(Heartbeat::Reregistered) => {
                tracing::warn!(node = %self.node, "registered again (Redis had lost the registration)")
            }
            Ok(Heartbeat::Taken { holder }) => {
                tracing::error!(node = %self.node, %holder, "another agent holds this node's name now: stopping");
                self.replaced.cancel();
                self.stop.cancel();
            }
            Err(e) => tracing::warn!(node = %self.node, "heartbeat failed: {e}"),
        }
    }

    fn report_now(self: Arc<Self>) {
        if let Err(e) = self.fleet.report(&self.record.name, &self.report()) {
            tracing::warn!(node = %self.node, "report failed: {e}");
        }
    }

    /// Reads the desired state and starts the steps that bring the node
    /// to it, each in a task of its own (a replica with a step in
    /// progress waits for the next read).
    fn follow(self: Arc<Self>) {
        let desired = match self.fleet.desired(&self.record.name) {
            Ok(d) => d.unwrap_or_default(),
            Err(e) => return tracing::warn!(node = %self.node, "cannot read the desired state: {e}"),
        };
        for (action, d) in self.steps(&desired) {
            self.busy.lock().expect("busy set").insert(d.replica_id);
            let me = self.clone();
            tokio::spawn(async move {
                tracing::debug!(replica = %super::super::replica_name(&d.model_key, d.replica_id), ?action, "step");
                me.inner.apply_step(action, &d).await;
                me.busy.lock().expect("busy set").remove(&d.replica_id);
            });
        }
    }

    /// What to do to go from the replicas here to `desired`.
    fn steps(&self, desired: &DesiredState) -> Vec<(Action, hangar_placement::Deployment)> {
        let busy = self.busy.lock().expect("busy set").clone();
        let mut here: HashMap<ReplicaId, (hangar_core::ModelKey, ReplicaState)> = HashMap::new();
        for rt in self.inner.models.values() {
            for (id, state) in rt.states() {
                here.insert(id, (rt.config.key.clone(), state));
            }
        }
        let size = |model: &hangar_core::ModelKey| {
            self.inner.models.get(model.as_str()).and_then(|rt| rt.config.size).map_or(0, |s| s.bytes())
        };
        let mut steps = Vec::new();
        for d in desired.replicas.iter().filter(|d| !busy.contains(&d.replica)) {
            if !self.inner.models.contains_key(d.model.as_str()) {
                tracing::warn!(model = %d.model, "the leader wants a model this agent's configuration lacks");
                continue;
            }
            let action = match (d.warm, here.get(&d.replica).map(|(_, s)| *s)) {
                (false, None) => Action::Create,
                (false, Some(ReplicaState::Sleeping)) => Action::FromCache,
                (true, Some(ReplicaState::Ready)) => Action::ToCache,
                _ => continue,
            };
            steps.push((action, deployment(d, &self.node, size(&d.model))));
        }
        let wanted: HashSet<ReplicaId> = desired.replicas.iter().map(|d| d.replica).collect();
        for (id, (model, _)) in here {
            if !wanted.contains(&id) && !busy.contains(&id) {
                let gone = hangar_core::DesiredReplica {
                    replica: id,
                    model: model.clone(),
                    warm: false,
                    gpus: Default::default(),
                    gpu_fraction: None,
                    dedicated: false,
                };
                steps.push((Action::Delete, deployment(&gone, &self.node, size(&model))));
            }
        }
        steps
    }
}

/// Runs `f` (a blocking Redis exchange) every `period` on a blocking
/// thread until the agent stops or is dropped.
async fn every(agent: Weak<Agent>, period: Duration, f: fn(Arc<Agent>)) {
    loop {
        let Some(me) = agent.upgrade() else { return };
        let stop = me.stop.clone();
        if stop.is_cancelled() {
            return;
        }
        let _ = tokio::task::spawn_blocking(move || f(me)).await;
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.cancelled() => return,
        }
    }
}
