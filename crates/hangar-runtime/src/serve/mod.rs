//! `hangar serve`: models placed on the node's GPUs, engines started for
//! their replicas, and the state an OpenAI-compatible gateway admits
//! requests with onto replica permits.
//!
//! The request path: the gateway (`hangar-gateway`, over the handle a
//! [`Server`] gives it) reads `model` from the body, finds the model's
//! [`ModelRuntime`], waits for a permit on its [`Processor`]
//! ([`Processor::admit`]; 429 when the line is full, 504 past the model's
//! timeout) and forwards the request to the chosen replica
//! ([`ModelRuntime::send`]), streaming the answer back; the permit is given
//! back when the answer ends or the client leaves.
//!
//! Replica counts come from one task (`control`) that drives
//! `hangar-scaler`'s controller: each model's scaler decides how many
//! replicas it should have from what it observes, placement decides where,
//! and the resulting `DeploymentDelta` is folded into each node's desired
//! state (`desired`). The node's lifecycle driver (`node`, over
//! `hangar-agent`'s replica lifecycle) converges every replica's engine
//! toward it one step at a time — start, sleep, wake, stop — and a replica
//! serves, in its model's table (`replicas`), exactly while its engine is
//! awake where placement wants it.

pub mod adapters;
mod config;
mod control;
mod data_dir;
mod desired;
pub(crate) mod fleet;
mod metrics;
mod node;
mod predictions;
mod prompt;
mod replicas;
mod upstream;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use hangar_core::{AccountId, AdapterRef, ApiKeys, BlockHash, Millis, ModelKey, Principal, ReplicaId};
use hangar_placement::{Cluster, Schedule};
use hangar_redis::fleet::{FleetState, ScalingOverride};
use hangar_router::{text_blocks, RouterPolicy};
use hangar_scaler::{Bounds, Controller, ModelSpec};
use hyper::body::Incoming;
use prometheus_client::metrics::counter::Counter;

use crate::processor::Processor;
use hangar_agent::engine::DEFAULT_HOST;
use hangar_agent::lifecycle::DriverHandle;
use hangar_agent::weights::WeightStore;
use hangar_core::ReplicaPhase;

use crate::events::{EventSink, Target, UsageError, UsageQuery, UsageReport, UsageSource};
pub use config::{
    check_queue_capacity, ApiKey, ConfigError, DedicatedWindow, ModelConfig, QueueConfig, ServeConfig,
    WebSocketConfig, DEMO, MAX_DURATION_S, MAX_QUEUE_CAPACITY,
};
pub use control::{ControlError, ControlHandle, ScalingCommand};
pub use data_dir::{DataDirError, DataDirLock};
pub use fleet::{wall_ms, Agent};
use metrics::Metrics;
pub use metrics::{ModelMetrics, Tally};
pub(crate) use prompt::{prompt_text, prompt_words};
use replicas::Replica;
pub use replicas::{ReplicaStatus, StartRecord, RECENT_STARTS};
pub use upstream::SendError;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Listening or serving failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The fleet's Redis refused or failed (a node name taken, Redis
    /// unreachable).
    #[error("{0}")]
    Fleet(String),
}

/// A replica's name in logs, metrics and the admin API:
/// `<model>:<replica_id>`.
pub fn replica_name(model: &ModelKey, replica: ReplicaId) -> String {
    format!("{model}:{replica}")
}

/// A node as `/admin/status` shows it: its GPUs, and on a fleet its
/// agent. A single machine's come from its file; a fleet gateway's are the
/// live nodes of its last view of the registry.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NodeStatus {
    /// Its name (what each replica's `node` says).
    pub name: String,
    /// Its GPUs, numbered from 0.
    pub gpus: u32,
    /// Each GPU's memory, bytes.
    pub gpu_memory: u64,
    /// The hardware label models may require.
    pub gpu_kind: Option<String>,
    /// Its agent's address (a fleet's node).
    pub url: Option<String>,
    /// Draining: nothing new is placed on it, and its replicas move to
    /// other nodes (an operator drained it, or its agent is leaving).
    pub draining: bool,
    /// Suspect (a fleet's node): its agent and engines stopped answering
    /// this gateway and it has not beaten since; nothing new is placed on
    /// it until it does, or it is declared dead.
    pub suspect: bool,
    /// The weight artifacts it holds resident, by its agent's last report
    /// (a fleet's node; empty on a single machine, where every node shares
    /// one store).
    pub resident: Vec<String>,
}

impl NodeStatus {
    /// A fleet's node, as its agent registered it and last reported,
    /// whether it drains (its record says so, or an operator's word) and
    /// whether it is suspect.
    pub(crate) fn registered(
        r: &hangar_core::NodeRecord,
        report: Option<&hangar_core::NodeReport>,
        draining: bool,
        suspect: bool,
    ) -> Self {
        NodeStatus {
            name: r.name.clone(),
            gpus: r.gpus,
            gpu_memory: r.gpu_memory.bytes(),
            gpu_kind: r.gpu_kind.clone(),
            url: Some(r.url.clone()),
            draining,
            suspect,
            resident: report.map(|r| r.artifacts.clone()).unwrap_or_default(),
        }
    }
}

/// One served model: its configuration, its processor (the line and the
/// permits of its replicas), its replica table, its request figures and
/// its connections to its replicas. [`Server::model`] hands it out.
pub struct ModelRuntime {
    pub(crate) config: ModelConfig,
    /// How long one request may take, waiting included.
    pub(crate) timeout: Duration,
    pub(crate) processor: Processor,
    pub(crate) metrics: Arc<ModelMetrics>,
    replicas: Mutex<BTreeMap<ReplicaId, Replica>>,
    /// Its last start reports, whichever node made them.
    starts: Mutex<replicas::RecentStarts>,
    /// Replicas its scaler wants, as the controller last said (read on the
    /// request path to tell the controller of a request for a model at
    /// zero, and by `/readyz`).
    pub(crate) desired: AtomicU32,
    /// The controller cannot place (or start) the replicas it wants.
    pub(crate) unplaceable: AtomicBool,
    /// A `Waiting` message for this model is on its way to the controller.
    pub(crate) waiting_signal: Arc<AtomicBool>,
    /// Its connections to its replicas, for forwarding requests.
    pub(crate) upstream: upstream::Upstream,
    /// The server's event sink (a clone): a request's trace reaches it
    /// through the model it already holds, no handle of its own.
    pub(crate) events: crate::events::EventSink,
    /// What its engines' adapter loads took, for the estimate of the next.
    pub(crate) adapter_loads: Mutex<adapters::LoadTimes>,
    /// A hotswap model an operator closed to swapping in.
    pub(crate) swap_closed: AtomicBool,
}

pub(crate) struct Inner {
    pub models: BTreeMap<String, Arc<ModelRuntime>>,
    /// API key → (account, may use the admin API); empty: the gateway is
    /// open.
    pub api_keys: ApiKeys,
    /// The controller's task.
    pub control: control::ControlHandle,
    /// The lifecycle driver of the nodes this process runs engines on
    /// (none on a fleet's gateway).
    pub(crate) driver: std::sync::OnceLock<DriverHandle>,
    /// What placement wants on each of this process's nodes (a single
    /// machine; a fleet's leader keeps its own, per tenure).
    pub(crate) desired: Mutex<desired::DesiredBook>,
    hangar_exe: PathBuf,
    /// The address engines bind to and their URLs name: loopback on one
    /// machine, where the gateway is beside them; an agent's own address,
    /// which the fleet's gateways can reach, on a fleet's node.
    engine_host: String,
    /// For the control plane: health checks, sleep and wake-up.
    pub client: reqwest::Client,
    pub metrics: Metrics,
    /// Where inference events go.
    pub events: crate::events::EventSink,
    /// Where they are read back from, for usage.
    pub usage: crate::events::UsageSource,
    /// The bearer key `/metrics` asks for, if any.
    pub metrics_key: Option<String>,
    /// The node's weight store, when a model has `weights`.
    pub weights: Option<Arc<WeightStore>>,
    /// The adapters registered in the node's weight store, when a model
    /// loads adapters.
    pub adapters: Option<Arc<adapters::AdapterCatalog>>,
    /// The adapters of the engines this process runs, as the adapter
    /// slots that use them hold them (a single machine's, or a fleet
    /// node's agent's), when a model loads adapters.
    pub(crate) adapter_holds: Option<Arc<adapters::engines::AdapterHolds>>,
    /// Cancelled when the server stops on purpose.
    pub(crate) stopping: tokio_util::sync::CancellationToken,
    /// A fleet's gateway: cancelled once its leader task has ended (and
    /// resigned, if it led).
    pub(crate) leader_stopped: std::sync::OnceLock<tokio_util::sync::CancellationToken>,
    /// This gateway's id in a fleet (none on a single machine).
    pub gateway: std::sync::OnceLock<String>,
    /// The fleet's shared state, on a fleet's gateway: where an
    /// operator's commands (scaling overrides, hotswap gates) are recorded.
    pub(crate) fleet: std::sync::OnceLock<FleetState>,
    /// Replicas this server saw fail, and when: a fleet's gateway does
    /// not route to one again on its node's word for
    /// [`fleet::QUARANTINE`] (the node's report may still name it while
    /// the node is dying).
    /// (With the node that ran it, for a fleet's replica.)
    pub failed: Mutex<std::collections::HashMap<ReplicaId, (Instant, Option<String>)>>,
    /// Fleet nodes found not answering — their agent nor any engine —
    /// since the view last took them: it makes them suspect before its next
    /// read of the registry (see `hangar_redis::liveness`).
    pub(crate) found_silent: Mutex<Vec<String>>,
    /// The nodes: a single machine's, or the live nodes of a fleet
    /// gateway's last view.
    pub(crate) nodes: Mutex<Vec<NodeStatus>>,
    epoch: Instant,
}

/// A running server's state; drop it (after [`Server::shutdown`]) to stop.
#[derive(Clone)]
pub struct Server {
    inner: Arc<Inner>,
}

impl Server {
    /// Builds the state, starts the controller's task, and returns once
    /// every model with `min_replicas` has a replica ready (or could not
    /// start one, which is logged).
    pub async fn start(mut config: ServeConfig, hangar_exe: PathBuf) -> Result<Self, ServeError> {
        config.add_trainers();
        let (inner, commands) = build(&config, hangar_exe, DEFAULT_HOST.into(), &Role::Machine).await?;
        let cluster = Cluster::new(config.cluster()).map_err(|e| ServeError::Config(e.to_string()))?;
        *inner.nodes.lock().expect("nodes lock") = cluster
            .nodes()
            .iter()
            .map(|n| NodeStatus {
                name: n.id().to_string(),
                gpus: n.gpus().len() as u32,
                gpu_memory: n.gpu_memory(),
                gpu_kind: Some(n.gpu_kind().to_owned()),
                url: None,
                draining: false,
                suspect: false,
                resident: Vec::new(),
            })
            .collect();
        inner.metrics.nodes(cluster.nodes().len(), 0, 0, true);
        let driver =
            node::start_driver(&inner, &config, node::node_gpus(&cluster), node::Audience::Controller);
        if let Some(holds) = &inner.adapter_holds {
            holds.attach(driver);
            tokio::spawn(adapters::engines::keep_level_every_second(Arc::downgrade(holds)));
        }
        // A per-process value mixed into the seed: the replica ids it draws
        // then differ from the last run's (logs, metrics, Redis name them).
        let control = control_loop(&config, config.seed ^ rand::random::<u64>(), &inner, cluster);
        inner.control.set_active(true);
        tokio::spawn(control::run_owned(Arc::downgrade(&inner), control, commands));
        tokio::spawn(metrics::sample(Arc::downgrade(&inner)));
        inner.min_replicas_up().await;
        Ok(Server { inner })
    }

    /// A gateway of a fleet (`redis` set, no `[[nodes]]`): it routes to
    /// the replicas the live node agents report, publishes its load, and
    /// asks for the leader lease, running the fleet's controller while it
    /// holds it (docs/cluster.md). Returns at once: replicas appear as
    /// the agents report them.
    pub async fn start_gateway(
        mut config: ServeConfig,
        redis: hangar_redis::Redis,
    ) -> Result<Self, ServeError> {
        config.add_trainers();
        let me = format!("gw-{:016x}", rand::random::<u64>());
        let role = Role::Gateway(me.clone());
        let (inner, commands) = build(&config, PathBuf::new(), DEFAULT_HOST.into(), &role).await?;
        inner.gateway.set(me.clone()).expect("a new server");
        let registry = hangar_redis::registry::Registry::new(redis.clone(), hangar_redis::registry::NODE_TTL);
        let state = hangar_redis::fleet::FleetState::new(redis.clone());
        inner.fleet.set(state.clone()).expect("a new server");
        let lease = Arc::new(hangar_redis::lease::LeaderLease::new(
            redis,
            me.clone(),
            hangar_redis::lease::LEASE_TTL,
        ));
        let leadership = Arc::new(fleet::Leadership::default());
        let view = fleet::View::new(&inner, me.clone(), registry.clone(), state.clone(), leadership.clone());
        tokio::spawn(view.run());
        tokio::spawn(metrics::sample(Arc::downgrade(&inner)));
        let (stop, stopped) = (inner.stopping.clone(), tokio_util::sync::CancellationToken::new());
        let lead =
            fleet::leader::run(inner.clone(), config, lease, registry, state, leadership, commands, stop);
        let done = stopped.clone();
        tokio::spawn(async move {
            lead.await;
            done.cancel();
        });
        inner.leader_stopped.set(stopped).expect("a new server");
        tracing::info!(gateway = %me, "joined the fleet as a gateway");
        Ok(Server { inner })
    }

    /// Stops every engine this server started; a fleet's gateway gives up
    /// the leader lease first if it holds it (another takes over at once).
    /// Then writes the inference events sent so far (for 5 s at most).
    pub async fn shutdown(&self) {
        self.inner.stopping.cancel();
        if let Some(stopped) = self.inner.leader_stopped.get() {
            let _ = tokio::time::timeout(Duration::from_secs(5), stopped.cancelled()).await;
        }
        if let Some(driver) = self.inner.driver.get() {
            driver.shutdown().await;
        }
        // What requests that ended have sent is written before the process
        // goes (the writer is a thread, which exiting would cut short).
        let events = self.inner.events.clone();
        let _ = tokio::task::spawn_blocking(move || events.flush(Duration::from_secs(5))).await;
    }
}

/// What the HTTP surface (`hangar-gateway`'s routes) reads and asks of a
/// running server. A `Server` is a cheap handle (an `Arc`), fit to be a
/// router's state.
impl Server {
    /// Every model that has replicas, in key order: the models served and
    /// their trainers (an operator's view).
    pub fn models(&self) -> impl Iterator<Item = &Arc<ModelRuntime>> {
        self.inner.models.values()
    }

    /// The model `key`, if it is served (whether a caller may use it is
    /// [`ModelRuntime::allows`]); never a trainer, which clients do not
    /// name.
    pub fn model(&self, key: &str) -> Option<&Arc<ModelRuntime>> {
        self.inner.models.get(key).filter(|rt| rt.config.trains.is_none())
    }

    /// An operator's scaling command for `rt` (`POST
    /// /admin/models/{key}/scaling`): freeze, unfreeze or pin. On a fleet
    /// the override is recorded in Redis first, so each later leader
    /// applies it again; one the controller refuses (a pin out of bounds)
    /// puts the record back as it was.
    ///
    /// # Cancel safety
    /// Carried out whole in a task of its own: a caller that leaves
    /// changes nothing of what happens.
    pub async fn scale(&self, rt: &Arc<ModelRuntime>, command: ScalingCommand) -> Result<(), ControlError> {
        let (server, key) = (self.clone(), rt.config.key.clone());
        let apply = tokio::spawn(async move {
            let record = match command {
                ScalingCommand::Freeze => Some(ScalingOverride::Freeze),
                ScalingCommand::Pin(n) => Some(ScalingOverride::Pin(n)),
                ScalingCommand::Unfreeze => None,
                // A deployment's bounds: its own record, repeated.
                ScalingCommand::Bounds(_) => return server.control().scaling(&key, command).await,
            };
            let model = key.to_string();
            // `Some(what was recorded)` on a fleet.
            let before = server.record_in_fleet(move |fleet| {
                let before = fleet.override_of(&model)?;
                fleet.set_override(&model, record)?;
                Ok(Some(before))
            });
            let before = before.await?;
            let applied = server.control().scaling(&key, command).await;
            if let (Err(_), Some(before)) = (&applied, before) {
                let model = key.to_string();
                if let Err(e) = server.record_in_fleet(move |fleet| fleet.set_override(&model, before)).await
                {
                    tracing::warn!(%key, "a refused scaling command stays recorded: {e}");
                }
            }
            applied
        });
        apply.await.expect("a scaling command does not panic")
    }

    /// Opens (`true`) or closes the hotswap model `rt` to swapping in:
    /// closed, its scaler is pinned at 0 replicas and fail-fast requests
    /// are answered 503 at once (predictions wait); opened, its scaler
    /// decides again. Errors as the scaling command's (not the leader, the
    /// controller stopped); the model must be in the tier.
    ///
    /// On a fleet the gate is recorded in Redis first (nothing changes if
    /// it cannot be): every gateway then answers as this one, and a later
    /// leader closes the model again. Opening it releases any override of
    /// its scaler, so the override's record goes too.
    ///
    /// # Cancel safety
    /// Carried out whole in a task of its own: a caller that leaves
    /// changes nothing of what happens.
    pub async fn set_swappable(&self, rt: &Arc<ModelRuntime>, swappable: bool) -> Result<(), ControlError> {
        debug_assert!(rt.config.hotswap, "only a hotswap model is opened or closed");
        let (server, rt) = (self.clone(), rt.clone());
        let apply = tokio::spawn(async move {
            let key = rt.config.key.to_string();
            server
                .record_in_fleet(move |fleet| {
                    fleet.close_hotswap(&key, !swappable)?;
                    if swappable {
                        fleet.set_override(&key, None)?;
                    }
                    Ok(())
                })
                .await?;
            let command = if swappable { ScalingCommand::Unfreeze } else { ScalingCommand::Pin(0) };
            server.control().scaling(&rt.config.key, command).await?;
            rt.close_to_swapping(!swappable);
            tracing::info!(model = %rt.config.key, swappable, "hotswap gate set");
            Ok(())
        });
        apply.await.expect("setting the hotswap gate does not panic")
    }

    /// Drains node `node` (`on`: nothing new is placed there and its
    /// replicas move to other nodes, each stopping there once its
    /// replacement serves), or calls the drain off (`POST` / `DELETE
    /// /admin/nodes/{node}/drain`). The node must be one `/admin/status`
    /// lists. On a fleet the drain is recorded in Redis (leader only,
    /// nothing changed if it cannot be), and the leader's view carries it
    /// out within a refresh — as it does for an agent that leaves — and
    /// every later leader too; on a single machine the controller takes it
    /// at once. The replicas move in the background.
    ///
    /// # Cancel safety
    /// Carried out whole in a task of its own: a caller that leaves
    /// changes nothing of what happens.
    pub async fn drain_node(&self, node: &str, on: bool) -> Result<(), ControlError> {
        let known = self.nodes().iter().any(|n| n.name == node);
        let id: hangar_placement::NodeId =
            node.parse().ok().filter(|_| known).ok_or_else(|| ControlError::UnknownNode(node.to_owned()))?;
        let server = self.clone();
        let apply = tokio::spawn(async move {
            if server.inner.fleet.get().is_some() {
                let name = id.to_string();
                return server.record_in_fleet(move |fleet| fleet.drain_node(&name, on)).await;
            }
            server.control().drain(&id, on).await?;
            for n in
                server.inner.nodes.lock().expect("nodes lock").iter_mut().filter(|n| n.name == id.as_str())
            {
                n.draining = on;
            }
            Ok(())
        });
        apply.await.expect("a drain does not panic")
    }

    /// On a fleet's gateway, writes an operator's command to Redis with
    /// `write` — refused unless this gateway leads, and nothing written
    /// then; elsewhere `T::default()` and nothing to write.
    async fn record_in_fleet<T: Default + Send + 'static>(
        &self,
        write: impl FnOnce(&FleetState) -> Result<T, hangar_redis::RedisError> + Send + 'static,
    ) -> Result<T, ControlError> {
        let Some(fleet) = self.inner.fleet.get().cloned() else { return Ok(T::default()) };
        if !self.control().is_active() {
            return Err(ControlError::NotLeader);
        }
        tokio::task::spawn_blocking(move || write(&fleet))
            .await
            .expect("no panic")
            .map_err(|e| ControlError::Unrecorded(e.to_string()))
    }

    /// The adapters registered in the node's weight store, when a model
    /// loads adapters ([`ModelRuntime::adapter`] looks one up).
    pub fn adapter_catalog(&self) -> Option<&Arc<adapters::AdapterCatalog>> {
        self.inner.adapters.as_ref()
    }

    /// The API keys: who a request acts for, and whether it may use the
    /// admin API; open when none are configured.
    pub fn api_keys(&self) -> &ApiKeys {
        &self.inner.api_keys
    }

    /// The bearer key `GET /metrics` asks for, if any.
    pub fn metrics_key(&self) -> Option<&str> {
        self.inner.metrics_key.as_deref()
    }

    /// The OpenMetrics text exposition of the server's figures, with the
    /// state gauges (lines, permits, replicas) read now
    /// (docs/observability.md).
    pub fn render_metrics(&self) -> String {
        self.inner.metrics.render(self.inner.models.values().map(|rt| &**rt))
    }

    /// Where inference events go.
    pub fn events(&self) -> &EventSink {
        &self.inner.events
    }

    /// The usage `query` asks for, read from this server's events (its
    /// files, or its fleet's stream) once the events this server has sent
    /// so far are written: a caller sees its own last requests. (Another
    /// gateway of a fleet writes its own within a tick.)
    ///
    /// # Cancel safety
    /// The read runs on the blocking pool and changes nothing: dropping
    /// the future lets it finish unseen.
    pub async fn usage(&self, query: UsageQuery) -> Result<UsageReport, UsageError> {
        let inner = self.inner.clone();
        let read = move || {
            inner.events.flush(Duration::from_secs(5));
            inner.usage.read(query)
        };
        match tokio::task::spawn_blocking(read).await {
            Ok(read) => read,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(UsageError::Stopping),
        }
    }

    /// The counter of request handlers that panicked
    /// (`hangar_http_panics_total`), for the layer that catches them.
    pub fn panic_counter(&self) -> Counter {
        self.inner.metrics.panics()
    }

    /// The way to the controller's task: operator commands and its status.
    pub fn control(&self) -> &ControlHandle {
        &self.inner.control
    }

    /// The nodes and their GPUs: a single machine's, or on a fleet's
    /// gateway the live nodes as it last read them.
    pub fn nodes(&self) -> Vec<NodeStatus> {
        self.inner.nodes.lock().expect("nodes lock").clone()
    }

    /// This server's id as a gateway of a fleet; `None` on a single machine.
    pub fn fleet_gateway(&self) -> Option<&str> {
        self.inner.gateway.get().map(String::as_str)
    }

    /// Checks `replica` of `rt` now, after a request to it failed: a dead
    /// one is taken out of routing (and, in a fleet, its node's other
    /// replicas are checked). Returns whether it is alive.
    pub async fn probe(&self, rt: &Arc<ModelRuntime>, replica: ReplicaId) -> bool {
        self.inner.probe(rt, replica).await
    }
}

/// The event sink `config.events` names, and where its events are read
/// back: the Redis stream of a fleet (`redis` set), else the JSONL file at
/// `events.path` (which `hangar serve` resolves against `data_dir`); none
/// when disabled or, for a server built without a data directory (tests),
/// when no path is given.
fn start_events(config: &ServeConfig) -> Result<(EventSink, UsageSource), ServeError> {
    let ev = &config.events;
    let (target, source) = match (&config.redis, &ev.path) {
        _ if !ev.enabled => return Ok((EventSink::disabled(), UsageSource::Off)),
        (Some(url), _) => {
            let redis = hangar_redis::Redis::connect(url).map_err(|e| ServeError::Fleet(e.to_string()))?;
            let source = UsageSource::Stream { redis: redis.clone(), stream: ev.stream.clone() };
            (Target::Redis { redis, stream: ev.stream.clone(), max_len: ev.stream_max_len }, source)
        }
        (None, Some(path)) => (
            Target::File { path: path.clone(), max_bytes: ev.max_file_bytes.bytes(), keep: ev.keep_files },
            UsageSource::Files { path: path.clone(), keep: ev.keep_files },
        ),
        (None, None) => return Ok((EventSink::disabled(), UsageSource::Off)),
    };
    // The writer thread ends when the last sink (the server's) is dropped.
    let (sink, _writer) = EventSink::start(target, ev.channel);
    Ok((sink, source))
}

/// What a process [`build`] builds is in a deployment: what it opens and
/// runs besides its models' lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Role {
    /// A single machine: it runs its engines and routes to them; its
    /// adapters are its weight store's.
    Machine,
    /// A fleet's gateway, by its id (`gw-…`): it routes to the engines the
    /// nodes' agents run; its adapters are those the nodes register.
    Gateway(String),
    /// A fleet node's agent, by its node's name: it runs engines and
    /// routes nothing; it makes the directories of the adapters its engines
    /// load, so it opens the weight store when a model has adapters. It
    /// emits no events (the gateways do).
    Agent(String),
}

/// The state every kind of server shares — models, their processors and
/// replica tables, keys, metrics, the node's weight store — and the
/// receiving end of the controller's channel. Engines it starts bind to
/// `engine_host`; what else it opens and runs is its `role`'s.
pub(crate) async fn build(
    config: &ServeConfig,
    hangar_exe: PathBuf,
    engine_host: String,
    role: &Role,
) -> Result<(Arc<Inner>, tokio::sync::mpsc::UnboundedReceiver<control::Command>), ServeError> {
    config.validate().map_err(|e| ServeError::Config(e.to_string()))?;
    let api_keys = ApiKeys::new(
        config
            .api_keys
            .iter()
            .map(|k| (k.key.clone(), Principal { account: k.account.clone(), admin: k.admin })),
    );
    let weights = open_weight_store(config, role).await?;
    let mut metrics = Metrics::new();
    let (events, usage) = match role {
        Role::Machine | Role::Gateway(_) => start_events(config)?,
        Role::Agent(_) => (EventSink::disabled(), UsageSource::Off),
    };
    events.stats().register(metrics.registry_mut());
    let (control, commands) = control::ControlHandle::new();
    let models = config
        .models
        .iter()
        .map(|m| {
            let waiting_signal = Arc::new(AtomicBool::new(false));
            let hook = control.on_queued(m.key.clone(), waiting_signal.clone());
            let rt = ModelRuntime {
                config: m.clone(),
                timeout: config.timeout(m),
                processor: Processor::with_hook(m.admission(), m.chooser(config.seed), Some(hook)),
                metrics: metrics.model(&m.key),
                replicas: Mutex::new(BTreeMap::new()),
                starts: Mutex::default(),
                desired: AtomicU32::new(m.min_replicas),
                unplaceable: AtomicBool::new(false),
                waiting_signal,
                upstream: upstream::upstream(&m.connections),
                events: events.clone(),
                adapter_loads: Mutex::default(),
                swap_closed: AtomicBool::new(false),
            };
            (m.key.to_string(), Arc::new(rt))
        })
        .collect::<BTreeMap<_, _>>();
    let client = hangar_agent::direct_http().build().expect("a plain HTTP client");
    // A single machine's adapters are its weight store's: its catalog
    // reads them there and its engines' directories are exported from it.
    let machine_store = match role {
        Role::Machine if config.models.iter().any(|m| m.adapters.is_some()) => Some(adapter_store(config)?),
        _ => None,
    };
    let adapter_holds = adapter_holds(config, role, machine_store.as_ref(), weights.as_ref(), &client);
    let adapters = adapter_catalog(config, role, machine_store, adapter_holds.clone());
    if let Some(catalog) = &adapters {
        for rt in models.values().filter(|rt| rt.config.adapters.is_some()) {
            let driver = adapters::driver(Arc::downgrade(rt), catalog.clone(), client.clone());
            rt.processor.set_adapter_driver(driver);
            rt.metrics.show_adapter_steps();
        }
    }
    let inner = Arc::new(Inner {
        models,
        api_keys,
        control,
        driver: std::sync::OnceLock::new(),
        desired: Mutex::default(),
        hangar_exe,
        engine_host,
        client,
        metrics,
        events,
        usage,
        metrics_key: config.metrics_key.clone(),
        weights,
        adapters,
        adapter_holds,
        gateway: std::sync::OnceLock::new(),
        fleet: std::sync::OnceLock::new(),
        stopping: tokio_util::sync::CancellationToken::new(),
        leader_stopped: std::sync::OnceLock::new(),
        failed: Mutex::default(),
        found_silent: Mutex::default(),
        nodes: Mutex::default(),
        epoch: Instant::now(),
    });
    Ok((inner, commands))
}

/// The controller over `cluster` for `config`'s models, with its schedule,
/// in the cadence every driver feeds it.
///
/// `seed` seeds its random choices, replica ids among them: `config.seed`
/// and a per-process random value on a single machine (simulations use
/// `config.seed` alone); a fleet's leader mixes in its epoch, so a new
/// tenure, which takes over the replicas of the last, never draws an id
/// one of them already has.
pub(crate) fn control_loop(
    config: &ServeConfig,
    seed: u64,
    inner: &Inner,
    cluster: Cluster,
) -> hangar_scaler::ControlLoop {
    let specs = config
        .models
        .iter()
        .map(|m| ModelSpec {
            key: m.key.clone(),
            scaling: m.scaling(),
            bounds: Bounds { min: m.min_replicas, max: m.max_replicas() },
            slo_ttft_ms: m.slo_ttft_ms,
        })
        .collect();
    let mut controller = Controller::new(cluster, seed, specs, inner.now());
    let (wall, now) = (std::time::SystemTime::now(), inner.now());
    let windows = config.schedule.iter().filter_map(|w| w.on_clock(wall, now)).collect();
    let schedule =
        Schedule::new(windows).expect("validated windows, each ending after it starts on the clock");
    controller.set_schedule(now, schedule);
    hangar_scaler::ControlLoop::new(controller, control::TICK.as_millis() as Millis, now)
}

/// The catalog of the adapters a model may load, when one loads adapters:
/// a single machine's `store`'s, the nodes' on a fleet's gateway (an agent
/// routes nothing).
fn adapter_catalog(
    config: &ServeConfig,
    role: &Role,
    store: Option<hangar_store::BlobStore>,
    holds: Option<Arc<adapters::engines::AdapterHolds>>,
) -> Option<Arc<adapters::AdapterCatalog>> {
    if config.models.iter().all(|m| m.adapters.is_none()) {
        return None;
    }
    let (store, holds) = match (role, store, holds) {
        (Role::Machine, Some(store), Some(holds)) => (store, holds),
        (Role::Gateway(me), ..) => return Some(Arc::new(adapters::AdapterCatalog::fleet(me.clone()))),
        _ => return None,
    };
    let models: BTreeMap<ModelKey, ModelConfig> =
        config.models.iter().filter(|m| m.adapters.is_some()).map(|m| (m.key.clone(), m.clone())).collect();
    // What some rule of its base model lets someone use: exported ahead of
    // need.
    let serves =
        move |a: &AdapterRef| models.get(a.base()).is_some_and(|m| m.serves_adapter(a.name().as_str()));
    let catalog = Arc::new(adapters::AdapterCatalog::new(store, serves, holds));
    let first = catalog.clone();
    tokio::spawn(async move {
        if let Err(e) = first.read().await {
            tracing::warn!("reading the weight store's adapters: {e}");
        }
    });
    Some(catalog)
}

/// The node's weight store, read for its adapters.
pub(crate) fn adapter_store(config: &ServeConfig) -> Result<hangar_store::BlobStore, ServeError> {
    let root = config.store.root();
    hangar_store::BlobStore::open(&root).map_err(|e| {
        ServeError::Config(format!("models load adapters from the weight store at {}: {e}", root.display()))
    })
}

/// The adapters of the engines this process runs, when a model loads
/// adapters: a single machine's, whose directories are exported from its
/// `store`, or a fleet node's agent's, made through its store daemon
/// (`weights`; a fleet's gateway runs no engine).
fn adapter_holds(
    config: &ServeConfig,
    role: &Role,
    store: Option<&hangar_store::BlobStore>,
    weights: Option<&Arc<WeightStore>>,
    client: &reqwest::Client,
) -> Option<Arc<adapters::engines::AdapterHolds>> {
    if config.models.iter().all(|m| m.adapters.is_none()) {
        return None;
    }
    let (place, dirs): (String, adapters::engines::AdapterDirs) = match (role, store, weights) {
        (Role::Machine, Some(store), _) => {
            let store = store.clone();
            let exports = store.root().join(hangar_store::adapters::EXPORT_DIRS);
            let dirs = move |adapter: &AdapterRef, id| {
                let entry = hangar_store::adapters::AdapterEntry {
                    adapter: adapter.clone(),
                    id,
                    bytes: 0,
                    on_disk: true,
                };
                hangar_store::adapters::export_dir(&store, &entry, &exports).map_err(|e| e.to_string())
            };
            ("this machine".to_owned(), Box::new(dirs))
        }
        (Role::Agent(node), _, Some(weights)) => {
            let weights = weights.clone();
            let dirs =
                move |adapter: &AdapterRef, id| weights.adapter_dir(adapter, id).map_err(|e| e.to_string());
            (format!("node {node}"), Box::new(dirs))
        }
        _ => return None,
    };
    Some(Arc::new(adapters::engines::AdapterHolds::new(place, dirs, client.clone())))
}

/// Opens the node's weight store (starting its daemon if none runs) when a
/// model has `weights`, or, on a fleet's agent, adapters, and checks what
/// can be checked before any replica starts: files readable, keys known.
async fn open_weight_store(
    config: &ServeConfig,
    role: &Role,
) -> Result<Option<Arc<WeightStore>>, ServeError> {
    let adapter_dirs = matches!(role, Role::Agent(_)) && config.models.iter().any(|m| m.adapters.is_some());
    if config.models.iter().all(|m| m.weights.is_none()) && !adapter_dirs {
        return Ok(None);
    }
    let (settings, models) = (config.store.clone(), config.models.clone());
    let opened = tokio::task::spawn_blocking(move || {
        WeightStore::open(settings, models.iter().filter_map(|m| Some((&m.key, m.weights.as_ref()?))))
    })
    .await
    .expect("opening the weight store does not panic");
    opened.map(|s| Some(Arc::new(s))).map_err(|e| ServeError::Config(e.to_string()))
}

impl ModelRuntime {
    /// The model's configuration, as loaded.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// How long one request may take, waiting included: the model's
    /// `timeout_s` within the server's floor and ceiling.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The model's processor: its line and its replicas' permits.
    pub fn processor(&self) -> &Processor {
        &self.processor
    }

    /// The model's request figures, for the request path to record.
    pub fn metrics(&self) -> &Arc<ModelMetrics> {
        &self.metrics
    }

    /// How many replicas its scaler wants, as the controller last said.
    pub fn desired_replicas(&self) -> u32 {
        self.desired.load(Ordering::Relaxed)
    }

    /// How many of its replicas serve now.
    pub fn ready_replicas(&self) -> usize {
        self.count(ReplicaPhase::Ready)
    }

    /// The prompt of the OpenAI request `body` in block hashes, with its
    /// estimated tokens, when the model's router reads prompts (`kv`);
    /// `None` otherwise, without parsing the body.
    pub fn prompt_blocks(&self, body: &[u8]) -> Option<(Vec<BlockHash>, u32)> {
        match self.config.router {
            RouterPolicy::Kv => serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .map(|v| text_blocks(&prompt_text(&v), self.config.kv.block_chars)),
            _ => None,
        }
    }

    /// POSTs the JSON `body` to `url` (a replica's base URL and the
    /// request's path) on the model's pool of connections, and once more
    /// on a fresh connection if the pooled one was lost before any answer
    /// came back (counted in `hangar_connection_retries_total`). The
    /// answer's body is the caller's to stream; dropping it closes the
    /// connection, which cancels the engine's work.
    ///
    /// # Cancel safety
    /// Dropping the future drops the request and its connection.
    pub async fn send(&self, url: &str, body: Bytes) -> Result<hyper::Response<Incoming>, SendError> {
        self.upstream.send(url, body, || self.metrics.connection_retried()).await
    }

    /// Whether an engine's answer says its replica is out of capacity
    /// (429, or 503 as vLLM and SGLang answer when their own queue is full)
    /// and another replica could take the request instead: then it goes
    /// there, once, before the client sees a refusal (Workers AI's
    /// failover) — a sync request or an async prediction alike.
    pub fn fails_over(&self, status: axum::http::StatusCode) -> bool {
        out_of_capacity(status) && self.count(ReplicaPhase::Ready) > 1
    }

    /// Notes the status `replica` answered a request with: out of
    /// capacity, the model's chooser puts it last for a while
    /// ([`hangar_router::REFUSAL_COOL_DOWN_MS`]) — whether or not the
    /// request then fails over; a server error, it counts toward a streak
    /// that puts it last too ([`hangar_router::FAILING_STREAK`]).
    pub fn answered(&self, replica: ReplicaId, status: axum::http::StatusCode) {
        if out_of_capacity(status) {
            self.processor.refused(replica);
            return;
        }
        if let Some(cool_down) = self.processor.answered(replica, status.is_server_error()) {
            self.metrics.failing_streak();
            let streak = hangar_router::FAILING_STREAK;
            tracing::warn!(
                replica = %replica_name(&self.config.key, replica),
                "{streak} requests in a row answered with server errors (the last {status}): chosen last for {} s",
                cool_down.as_secs()
            );
        }
    }

    /// Whether it may be swapped in now: `None` for a model outside the
    /// hotswap tier.
    pub fn swappable(&self) -> Option<bool> {
        self.config.hotswap.then(|| !self.swap_closed.load(Ordering::Relaxed))
    }

    /// Closes (`true`) or opens this hotswap model to swapping in, as far
    /// as its requests go: closed, fail-fast ones are answered 503 naming
    /// the gate. (Its scaler is pinned by the controller.)
    pub(crate) fn close_to_swapping(&self, closed: bool) {
        self.swap_closed.store(closed, Ordering::Relaxed);
        let key = &self.config.key;
        let reason = format!(
            "the hotswap model `{key}` is closed to swapping in by an operator (PUT /admin/models/{key}/hotswap)"
        );
        self.processor.set_unavailable(closed.then_some(reason));
    }

    /// Whether `account` may use this model.
    pub fn allows(&self, account: &AccountId) -> bool {
        self.config.access.as_ref().is_none_or(|accounts| accounts.contains(account))
    }
}

/// 429, or 503 as vLLM and SGLang answer when their own queue is full.
fn out_of_capacity(status: axum::http::StatusCode) -> bool {
    use axum::http::StatusCode;
    matches!(status, StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE)
}

impl Inner {
    /// The trainer of `model`, which runs its trainings, if it has one
    /// (config/trainers.rs).
    pub(crate) fn trainer_of(&self, model: &ModelRuntime) -> Option<&Arc<ModelRuntime>> {
        self.models.get(config::trainer_key(&model.config)?.as_str())
    }

    /// Milliseconds since the server started: the controller's clock.
    pub(crate) fn now(&self) -> Millis {
        self.epoch.elapsed().as_millis() as Millis
    }

    /// Waits until every model with `min_replicas` has a replica ready, or
    /// the controller says it cannot place or start one (it keeps trying,
    /// with back-off), or the setup time has passed.
    async fn min_replicas_up(&self) {
        let limit = Instant::now() + Duration::from_secs(600);
        for rt in self.models.values().filter(|rt| rt.config.min_replicas > 0) {
            while rt.count(ReplicaPhase::Ready) == 0
                && !rt.unplaceable.load(Ordering::Relaxed)
                && Instant::now() < limit
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if rt.count(ReplicaPhase::Ready) == 0 {
                tracing::error!(model = %rt.config.key, "no replica is ready yet; the controller keeps trying");
            }
        }
    }
}
