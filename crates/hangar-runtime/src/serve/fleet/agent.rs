//! `hangar agent`: one machine of a fleet.
//!
//! It registers its node ([`Registry`]; a name another live agent holds
//! is refused), renews the registration every 2 s, and follows the node's
//! desired state: every 200 ms it reads what the leader wants
//! (`hangar:desired:NODE`) and hands it whole to the node's lifecycle
//! driver (`node`), which converges each replica's engine toward it one
//! step at a time — the same machine and driver a single `hangar serve`
//! runs. A desired state written for another run of this node's name is
//! not this run's: it is ignored until the leader writes one for this run.
//! A desired state it cannot read (Redis down) changes nothing: the
//! engines keep running as they are. Four times a second it reports every
//! replica it has, with its phase, engine URL and GPUs, its last start
//! report and what its instance monitor says (`hangar:reported:NODE`),
//! which is how the leader hears of a replica that serves, failed or went
//! cold, and every gateway what each replica is doing. The report also
//! lists the weight artifacts the node's store holds resident (asked of
//! its daemon every second), so the leader's placement prefers this node
//! for a model whose weights it would not have to read again. When a model
//! loads LoRA adapters, it publishes the adapters the node's store
//! registers (`hangar:adapters:NODE`, read every second, written when they
//! change, the report carrying their digest) — a fleet serves every
//! adapter some node registers — and loads and unloads adapters on its
//! engines as the gateways hold and release them (`agent_adapters`). The
//! gateways hold
//! the permits, so the agent's instance monitors are fed by sampling each
//! awake engine's own count of the requests it runs or holds (its
//! gauges) as often. The replicas' health checks run here.
//!
//! On SIGTERM it leaves. Given time to move its replicas (`--move-s`), it
//! first drains: its record says `draining`, the leader places its
//! replicas on other nodes, and each stops here (its requests finished)
//! once its replacement serves — until nothing runs here, or the time is
//! up. Then it leaves the registry at once (the leader places what still
//! runs here elsewhere without waiting for the TTL), stops reporting
//! (gateways stop sending it new requests), gives requests in flight
//! `drain` to finish, then stops its engines. If another agent takes its
//! name — this one was silent past the TTL and replaced — it stops.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use axum::routing::get;
use hangar_agent::lifecycle::{self, DriverHandle};
use hangar_core::exposition::Format;
use hangar_core::{NodeAdapters, NodeRecord, NodeReport, RegisteredAdapter, ReplicaReport};
use hangar_placement::NodeId;
use hangar_redis::fleet::FleetState;
use hangar_redis::registry::{Heartbeat, Registry, HEARTBEAT_EVERY, NODE_TTL};
use hangar_redis::Redis;
use tokio_util::sync::CancellationToken;

use super::super::{adapter_store, build, node, Role, ServeConfig, ServeError};

/// How often the desired state is read.
const FOLLOW_EVERY: Duration = Duration::from_millis(200);
/// How often the replicas are reported.
const REPORT_EVERY: Duration = Duration::from_millis(250);
/// How often the store daemon is asked what it holds resident: a load
/// takes seconds, and residency only breaks placement's ties.
const RESIDENCY_EVERY: Duration = Duration::from_secs(1);
/// How often the store's adapters are read (and their publication kept
/// alive): a newly registered adapter is served within about this long
/// and a gateway's refresh.
const ADAPTERS_EVERY: Duration = Duration::from_secs(1);
/// How often adapter directories nobody asked for lately are looked for.
const PRUNE_ADAPTER_DIRS_EVERY: Duration = Duration::from_secs(60);

/// A running node agent.
pub struct Agent {
    /// The node's models and engines (kept alive with the agent), and
    /// their figures.
    inner: Arc<super::super::Inner>,
    record: NodeRecord,
    node: NodeId,
    registry: Registry,
    fleet: FleetState,
    /// The node's lifecycle driver.
    driver: DriverHandle,
    /// The desired state of another run last seen (logged once).
    foreign: std::sync::Mutex<Option<String>>,
    /// The weight-store artifacts the node holds resident, as its store
    /// daemon last said (reported with the replicas).
    resident: std::sync::Mutex<Vec<String>>,
    /// The node's store, read for the adapters it registers, when a model
    /// loads adapters.
    adapter_store: Option<hangar_store::BlobStore>,
    /// The models that load adapters: the node makes the directories of
    /// its own store's adapters of these ahead of need.
    adapter_bases: std::collections::BTreeSet<hangar_core::ModelKey>,
    /// Those adapters, with their artifacts, as the store listed them at
    /// the last publication (one read a second serves both chores).
    own_adapters: std::sync::Mutex<Vec<(hangar_core::AdapterRef, hangar_store::ArtifactId)>>,
    /// The digest of the adapters published last (reported with the
    /// replicas; `None`: none published).
    adapters: std::sync::Mutex<Option<String>>,
    /// Leaving: the record says `draining`, so the leader moves the
    /// node's replicas elsewhere.
    draining: std::sync::atomic::AtomicBool,
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
        config.add_trainers();
        let (inner, mut commands) =
            build(&config, hangar_exe, engine_host, &Role::Agent(record.name.clone())).await?;
        // No controller runs here (the leader reads the node's report);
        // nothing is sent on its channel, which is drained all the same.
        tokio::spawn(async move { while commands.recv().await.is_some() {} });
        let gpus =
            BTreeMap::from([(record.name.clone(), vec![record.gpu_memory.bytes(); record.gpus as usize])]);
        // Gateways see a replica stop serving within one report and one view
        // refresh; they may route to it until then.
        let grace = node::Audience::Gateways { routing_grace: REPORT_EVERY + super::view::VIEW_EVERY * 2 };
        let driver = node::start_driver(&inner, &config, gpus, grace);
        let adapter_store = match config.models.iter().any(|m| m.adapters.is_some()) {
            true => Some(adapter_store(&config)?),
            false => None,
        };
        if let Some(holds) = &inner.adapter_holds {
            holds.attach(driver.clone());
        }
        let registry = Registry::new(redis.clone(), NODE_TTL);
        let (registry, registered) = tokio::task::spawn_blocking(move || {
            let result = registry.register(&record);
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
            driver,
            foreign: std::sync::Mutex::default(),
            resident: std::sync::Mutex::default(),
            adapters: std::sync::Mutex::default(),
            adapter_store,
            adapter_bases: config
                .models
                .iter()
                .filter(|m| m.adapters.is_some())
                .map(|m| m.key.clone())
                .collect(),
            own_adapters: std::sync::Mutex::default(),
            draining: std::sync::atomic::AtomicBool::new(false),
            stop: CancellationToken::new(),
            replaced: CancellationToken::new(),
        });
        tracing::info!(node = %agent.node, url = %agent.record.url, "registered with the fleet");
        tokio::spawn(every(Arc::downgrade(&agent), HEARTBEAT_EVERY, Agent::heartbeat));
        tokio::spawn(every(Arc::downgrade(&agent), FOLLOW_EVERY, Agent::follow));
        tokio::spawn(every(Arc::downgrade(&agent), REPORT_EVERY, Agent::report_now));
        if agent.inner.weights.is_some() {
            tokio::spawn(every(Arc::downgrade(&agent), RESIDENCY_EVERY, Agent::check_residency));
        }
        if agent.adapter_store.is_some() {
            tokio::spawn(every(Arc::downgrade(&agent), ADAPTERS_EVERY, Agent::publish_adapters));
        }
        if agent.inner.adapter_holds.is_some() {
            tokio::spawn(every(Arc::downgrade(&agent), ADAPTERS_EVERY, Agent::keep_adapter_holds));
            tokio::spawn(every(Arc::downgrade(&agent), ADAPTERS_EVERY, Agent::make_adapter_dirs_ahead));
            tokio::spawn(every(Arc::downgrade(&agent), PRUNE_ADAPTER_DIRS_EVERY, Agent::prune_adapter_dirs));
        }
        tokio::spawn(sample_engines(Arc::downgrade(&agent)));
        Ok(agent)
    }

    /// The node's replicas as its report says them.
    pub fn report(&self) -> NodeReport {
        let replicas = self
            .driver
            .replicas()
            .into_iter()
            .map(|r| ReplicaReport {
                replica: r.view.replica,
                model: r.view.model.clone(),
                phase: r.phase,
                url: r.url.clone(),
                ready_ms: r.start.as_ref().map(|s| s.ready_ms),
                gpus: r.gpus(),
                sleeps: r.view.sleeps,
                lora: r.capabilities.lora,
                failure: r.failure().map(str::to_owned),
                start: r.start.clone(),
                instance: self
                    .inner
                    .models
                    .get(r.view.model.as_str())
                    .and_then(|rt| rt.processor.instance(r.view.replica)),
            })
            .collect();
        let artifacts = self.resident.lock().expect("resident lock").clone();
        let adapters = self.adapters.lock().expect("adapters lock").clone();
        NodeReport { agent: self.record.agent.clone(), replicas, artifacts, adapters }
    }

    /// `GET /health`; `GET /status`: the node's record, its report, every
    /// replica as its lifecycle driver holds it (desired tier and GPUs with
    /// their bytes, engine state, process id, capabilities) and each
    /// engine's adapters with the gateways holding them — what
    /// an operator, or the fault-injection suite's checker, compares with
    /// placement; and `GET /metrics`: the node's replicas by state, their
    /// starts and failures (docs/observability.md); and the gateways'
    /// holds and releases of adapters on its replicas
    /// (`POST /v1/replicas/{replica}/adapters/{hold,release}`,
    /// `agent_adapters`). Like `/status`, they need no key: an agent's port
    /// is the fleet's own network's.
    pub fn router(self: &Arc<Self>) -> axum::Router {
        let (me, metrics) = (self.clone(), self.clone());
        let (holds, node) = (self.inner.adapter_holds.clone(), self.node.to_string());
        axum::Router::new()
            .route(
                "/v1/replicas/{replica}/adapters/{op}",
                axum::routing::post(
                    move |axum::extract::Path((replica, op)): axum::extract::Path<(String, String)>,
                          body: axum::body::Bytes| {
                        let (holds, node) = (holds.clone(), node.clone());
                        async move {
                            super::agent_adapters::answer(holds.as_ref(), &node, &replica, &op, &body).await
                        }
                    },
                ),
            )
            .route("/health", get(|| async { "ok" }))
            .route(
                "/status",
                get(move || {
                    let me = me.clone();
                    async move {
                        axum::Json(serde_json::json!({
                            "node": me.record(),
                            "report": me.report(),
                            "replicas": me.driver.replicas(),
                            "gpus": me.driver.nodes().get(&me.record.name),
                            "adapters": me.inner.adapter_holds.as_ref().map(|h| h.view()),
                        }))
                    }
                }),
            )
            .route(
                "/metrics",
                get(move |headers: axum::http::HeaderMap| {
                    let inner = metrics.inner.clone();
                    async move {
                        let accept = headers.get(axum::http::header::ACCEPT).and_then(|v| v.to_str().ok());
                        let format = Format::negotiate(accept);
                        let body = inner.metrics.render_node(inner.models.values().map(|rt| &**rt));
                        ([(axum::http::header::CONTENT_TYPE, format.content_type())], format.render(body))
                    }
                }),
            )
    }

    /// Resolves when another agent has taken this node's name: this one
    /// must stop.
    pub async fn replaced(&self) {
        self.replaced.cancelled().await
    }

    /// The node's record as it registers now: `draining` once it leaves.
    fn record(&self) -> NodeRecord {
        let draining = self.draining.load(std::sync::atomic::Ordering::Relaxed);
        NodeRecord { draining, ..self.record.clone() }
    }

    /// Leaves the fleet. With `move_for` (not zero), the node drains first:
    /// its record says `draining`, and it keeps following the leader —
    /// which places its replicas on other nodes and stops each here once
    /// its replacement serves — until it runs nothing, for `move_for` at
    /// most. Then it leaves: out of the registry and the reports at once,
    /// `drain` for requests in flight on whatever still runs here (the
    /// leader places those again as a lost node's), then every engine
    /// stopped.
    pub async fn shutdown(&self, drain: Duration, move_for: Duration) {
        if !move_for.is_zero() && !self.replaced.is_cancelled() {
            self.move_replicas(move_for).await;
        }
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
        if !self.replaced.is_cancelled() && !self.driver.replicas().is_empty() {
            tokio::time::sleep(drain).await;
        }
        self.driver.shutdown().await;
    }

    /// Drains the node: says so in its record at once, then waits, for
    /// `limit` at most, until the leader has moved every replica away.
    async fn move_replicas(&self, limit: Duration) {
        self.draining.store(true, std::sync::atomic::Ordering::Relaxed);
        let (registry, record) = (self.registry.clone(), self.record());
        let said = tokio::task::spawn_blocking(move || registry.heartbeat(&record)).await.expect("no panic");
        if let Err(e) = said {
            tracing::warn!(node = %self.node, "cannot say the node drains ({e}); the heartbeats go on trying");
        }
        let running = self.driver.replicas().len();
        tracing::info!(node = %self.node, running, "draining: waiting up to {limit:?} for the leader to move the replicas");
        let deadline = tokio::time::Instant::now() + limit;
        while !self.driver.replicas().is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(FOLLOW_EVERY).await;
        }
        match self.driver.replicas().len() {
            0 => tracing::info!(node = %self.node, "drained: every replica moved"),
            left => {
                tracing::warn!(node = %self.node, left, "not every replica moved in {limit:?}: leaving anyway")
            }
        }
    }

    fn heartbeat(self: Arc<Self>) {
        match self.registry.heartbeat(&self.record()) {
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

    /// Asks the node's weight store what it holds resident, for the
    /// reports. A daemon that does not answer changes nothing: what it
    /// held is still the best guess.
    fn check_residency(self: Arc<Self>) {
        let Some(weights) = &self.inner.weights else { return };
        match weights.resident() {
            Ok(now) => *self.resident.lock().expect("resident lock") = now,
            Err(e) => tracing::debug!(node = %self.node, "cannot ask the weight store what it holds: {e}"),
        }
    }

    /// Publishes the adapters the node's store registers when they changed
    /// since the last publication (and again when Redis lost them), and
    /// keeps the publication alive otherwise; keeps those of the models
    /// that load adapters for [`Agent::make_adapter_dirs_ahead`]. A store
    /// or Redis that cannot be read changes nothing: what was published
    /// stands.
    fn publish_adapters(self: Arc<Self>) {
        let Some(store) = &self.adapter_store else { return };
        let list = match hangar_store::adapters::list(store, None) {
            Ok(list) => list,
            Err(e) => return tracing::warn!(node = %self.node, "cannot read the store's adapters: {e}"),
        };
        *self.own_adapters.lock().expect("own adapters lock") = list
            .iter()
            .filter(|e| self.adapter_bases.contains(e.adapter.base()))
            .map(|e| (e.adapter.clone(), e.id))
            .collect();
        let now = node_adapters(list);
        let published = self.adapters.lock().expect("adapters lock").clone();
        let digest = (!now.adapters.is_empty()).then(|| now.digest.clone());
        let name = &self.record.name;
        let done = match (published == digest, &digest) {
            (true, None) => Ok(()),
            // Kept alive; published again if Redis lost it.
            (true, Some(_)) => self.fleet.keep_adapters(name).and_then(|kept| {
                if kept {
                    Ok(())
                } else {
                    self.fleet.publish_adapters(name, &now)
                }
            }),
            (false, _) => self.fleet.publish_adapters(name, &now),
        };
        match done {
            Ok(()) => *self.adapters.lock().expect("adapters lock") = digest,
            Err(e) => tracing::warn!(node = %self.node, "cannot publish the node's adapters: {e}"),
        }
    }

    /// Lets the holds of gateways no longer alive go, and forgets the
    /// engines of replicas that stopped (`AdapterHolds::keep_level`); a
    /// Redis that cannot be read takes no hold away.
    fn keep_adapter_holds(self: Arc<Self>) {
        let Some(holds) = &self.inner.adapter_holds else { return };
        let alive = match self.fleet.loads() {
            Ok(loads) => Some(loads.into_iter().map(|l| l.gateway).collect()),
            Err(e) => {
                tracing::debug!(node = %self.node, "cannot read which gateways are alive: {e}");
                None
            }
        };
        holds.keep_level(alive);
    }

    /// Makes the directories of the adapters the node's own store
    /// registers for a model that loads adapters (as the last publication
    /// read them) ahead of need, so that a first request for one pays the
    /// engine's load only (a peer's are made on demand).
    fn make_adapter_dirs_ahead(self: Arc<Self>) {
        let Some(weights) = &self.inner.weights else { return };
        let own = self.own_adapters.lock().expect("own adapters lock").clone();
        for e in weights.make_adapter_dirs_ahead(&own) {
            tracing::warn!(node = %self.node, "making an adapter's directory ahead of need: {e}; it is made when a request needs it");
        }
    }

    /// Removes the adapter directories nobody asked for lately.
    fn prune_adapter_dirs(self: Arc<Self>) {
        let Some(weights) = &self.inner.weights else { return };
        match weights.prune_adapter_dirs(hangar_agent::weights::ADAPTER_DIR_IDLE) {
            Ok(0) => {}
            Ok(removed) => {
                tracing::info!(node = %self.node, removed, "removed adapter directories nobody asked for lately")
            }
            Err(e) => tracing::warn!(node = %self.node, "pruning adapter directories: {e}"),
        }
    }

    fn report_now(self: Arc<Self>) {
        if let Err(e) = self.fleet.report(&self.record.name, &self.report()) {
            tracing::warn!(node = %self.node, "report failed: {e}");
        }
    }

    /// Reads the node's desired state and hands it to the driver, if it
    /// was written for this run. Nothing read, nothing changes.
    fn follow(self: Arc<Self>) {
        let desired = match self.fleet.desired(&self.record.name) {
            Ok(Some(d)) => d,
            Ok(None) => return,
            Err(e) => return tracing::warn!(node = %self.node, "cannot read the desired state: {e}"),
        };
        if desired.agent != self.record.agent {
            let mut foreign = self.foreign.lock().expect("foreign lock");
            if foreign.as_deref() != Some(desired.agent.as_str()) {
                tracing::info!(node = %self.node, run = %desired.agent, "the desired state is another run's: waiting for the leader to write this run's");
                *foreign = Some(desired.agent.clone());
            }
            return;
        }
        let _ = self.driver.set_desired(&self.record.name, lifecycle::wanted(&desired.replicas));
    }
}

/// The adapters `list` as the node publishes them, named by a digest of
/// the list.
fn node_adapters(mut list: Vec<hangar_store::adapters::AdapterEntry>) -> NodeAdapters {
    list.sort_by_key(|e| e.adapter.to_string());
    let adapters: Vec<RegisteredAdapter> = list
        .into_iter()
        .map(|e| RegisteredAdapter { adapter: e.adapter, artifact: e.id.to_string(), bytes: e.bytes })
        .collect();
    let json = serde_json::to_vec(&adapters).expect("adapters serialize");
    let digest = blake3::hash(&json).to_hex()[..16].to_owned();
    NodeAdapters { digest, adapters }
}

/// Feeds each replica's instance monitor what its engine says it runs or
/// holds, every [`REPORT_EVERY`], until the agent stops or is dropped. A
/// request shorter than that may go unseen: the figures of a fleet's
/// replicas are samples, where a single machine's count every permit.
///
/// # Cancel safety
/// Holds nothing across its awaits but the driver's handle.
async fn sample_engines(agent: Weak<Agent>) {
    let mut every = tokio::time::interval(REPORT_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(me) = agent.upgrade() else { return };
        if me.stop.is_cancelled() {
            return;
        }
        let driver = me.driver.clone();
        drop(me);
        let busy = driver.busy().await;
        let Some(me) = agent.upgrade() else { return };
        for (replica, model, in_flight) in busy {
            if let Some(rt) = me.inner.models.get(model.as_str()) {
                rt.processor.sample_in_flight(replica, in_flight);
            }
        }
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
