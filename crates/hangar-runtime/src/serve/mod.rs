//! `hangar serve`: models placed on the node's GPUs, engines started for
//! their replicas, and an OpenAI-compatible gateway admitting requests onto
//! replica permits.
//!
//! The request path: the gateway reads `model` from the body, finds the
//! model's [`Processor`], waits for a permit ([`Processor::admit`]; 429
//! when the line is full, 504 past the model's timeout) and forwards the
//! request to the chosen replica, streaming the answer back; the permit is
//! given back when the answer ends or the client leaves.
//!
//! Replica counts come from one task (`control`) that drives
//! `hangar-scaler`'s controller: each model's scaler decides how many
//! replicas it should have from what it observes, placement decides where,
//! and the resulting `DeploymentDelta` is applied (`replicas`) in order —
//! `to_cache` puts an evicted replica's engine to sleep, `delete` stops it,
//! `from_cache` wakes it, `create` starts a new engine process. A replica
//! serves as soon as it is ready, and is watched until it is gone.

mod admin;
mod config;
mod control;
mod data_dir;
mod fleet;
mod gateway;
mod guard;
mod metrics;
mod predictions;
mod prompt;
mod relay;
mod replicas;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hangar_core::{AccountId, ApiKeys, Millis, ModelKey, Principal, ReplicaId};
use hangar_placement::{Cluster, Schedule};
use hangar_scaler::{Bounds, Controller, ModelSpec};

use crate::processor::Processor;
use hangar_agent::engine::DEFAULT_HOST;
use hangar_agent::weights::WeightStore;

pub use config::{
    ApiKey, ConfigError, DedicatedWindow, ModelConfig, QueueConfig, ServeConfig, DEMO, MAX_DURATION_S,
    MAX_QUEUE_CAPACITY,
};
pub use data_dir::{DataDirError, DataDirLock};
pub use fleet::Agent;
pub use guard::install_panic_hook;
use metrics::{Metrics, ModelMetrics};
use replicas::Replica;

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

/// A replica's name in logs, metrics and the admin API.
pub(crate) fn replica_name(model: &ModelKey, replica: ReplicaId) -> String {
    format!("{model}:{replica}")
}

pub(crate) struct ModelRuntime {
    pub config: ModelConfig,
    /// How long one request may take, waiting included.
    pub timeout: Duration,
    pub processor: Processor,
    pub metrics: Arc<ModelMetrics>,
    replicas: Mutex<BTreeMap<ReplicaId, Replica>>,
    /// Replicas its scaler wants, as the controller last said (read on the
    /// request path to tell the controller of a request for a model at
    /// zero, and by `/readyz`).
    pub desired: AtomicU32,
    /// The controller cannot place (or start) the replicas it wants.
    pub unplaceable: AtomicBool,
    /// A `Waiting` message for this model is on its way to the controller.
    pub waiting_signal: Arc<AtomicBool>,
    /// Its connections to its replicas, for forwarding requests.
    pub upstream: relay::Upstream,
}

pub(crate) struct Inner {
    pub models: BTreeMap<String, Arc<ModelRuntime>>,
    /// API key → (account, may use the admin API); empty: the gateway is
    /// open.
    pub api_keys: ApiKeys,
    /// The controller's task.
    pub control: control::ControlHandle,
    hangar_exe: PathBuf,
    /// The address engines bind to and their URLs name: loopback on one
    /// machine, where the gateway is beside them; an agent's own address,
    /// which the fleet's gateways can reach, on a fleet's node.
    engine_host: String,
    /// For the control plane: health checks, sleep and wake-up.
    pub client: reqwest::Client,
    pub metrics: Metrics,
    /// The bearer key `/metrics` asks for, if any.
    pub metrics_key: Option<String>,
    /// The node's weight store, when a model has `weights`.
    pub weights: Option<Arc<WeightStore>>,
    /// This gateway's id in a fleet (none on a single machine).
    pub gateway: std::sync::OnceLock<String>,
    /// Replicas this server saw fail, and when: a fleet's gateway does
    /// not route to one again on its node's word for
    /// [`fleet::QUARANTINE`] (the node's report may still name it while
    /// the node is dying).
    /// (With the node that ran it, for a fleet's replica.)
    pub failed: Mutex<std::collections::HashMap<ReplicaId, (Instant, Option<String>)>>,
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
    pub async fn start(config: ServeConfig, hangar_exe: PathBuf) -> Result<Self, ServeError> {
        let (inner, commands) = build(&config, hangar_exe, DEFAULT_HOST.into()).await?;
        let cluster = Cluster::new(config.cluster()).map_err(|e| ServeError::Config(e.to_string()))?;
        let control = control_loop(&config, config.seed, &inner, cluster);
        inner.control.set_active(true);
        tokio::spawn(control::run_owned(Arc::downgrade(&inner), control, commands));
        inner.min_replicas_up().await;
        Ok(Server { inner })
    }

    /// A gateway of a fleet (`redis` set, no `[[nodes]]`): it routes to
    /// the replicas the live node agents report, publishes its load, and
    /// asks for the leader lease, running the fleet's controller while it
    /// holds it (docs/cluster.md). Returns at once: replicas appear as
    /// the agents report them.
    pub async fn start_gateway(config: ServeConfig, redis: hangar_redis::Redis) -> Result<Self, ServeError> {
        let (inner, commands) = build(&config, PathBuf::new(), DEFAULT_HOST.into()).await?;
        let me = format!("gw-{:016x}", rand::random::<u64>());
        inner.gateway.set(me.clone()).expect("a new server");
        let registry = hangar_redis::registry::Registry::new(redis.clone(), hangar_redis::registry::NODE_TTL);
        let state = hangar_redis::fleet::FleetState::new(redis.clone());
        let lease = hangar_redis::lease::LeaderLease::new(redis, me.clone(), hangar_redis::lease::LEASE_TTL);
        let leadership = Arc::new(fleet::Leadership::default());
        let view = fleet::View::new(&inner, me.clone(), registry.clone(), state.clone(), leadership.clone());
        tokio::spawn(view.run());
        tokio::spawn(fleet::leader::run(inner.clone(), config, lease, registry, state, leadership, commands));
        tracing::info!(gateway = %me, "joined the fleet as a gateway");
        Ok(Server { inner })
    }

    /// Every route of `hangar serve`: the OpenAI API, the admin API,
    /// health, metrics and the `predictions` API, under one body limit
    /// (413 beyond `max_body_bytes`) and the [`guard`] (request ids; a
    /// panicking handler answers 500).
    pub fn router(&self, predictions: &hangar_predictions::Service, max_body_bytes: usize) -> axum::Router {
        gateway::router(self.inner.clone())
            .merge(admin::router(self.inner.clone()))
            .merge(predictions.router())
            .layer(axum::extract::DefaultBodyLimit::max(max_body_bytes))
            .layer(axum::middleware::from_fn_with_state(self.inner.metrics.panics(), guard::guard))
    }

    /// Stops every engine this server started.
    pub async fn shutdown(&self) {
        for rt in self.inner.models.values() {
            for engine in rt.take_engines() {
                engine.stop(Duration::from_secs(5)).await;
            }
        }
    }
}

/// The state every kind of server shares — models, their processors and
/// replica tables, keys, metrics, the node's weight store — and the
/// receiving end of the controller's channel. Engines it starts bind to
/// `engine_host`.
pub(crate) async fn build(
    config: &ServeConfig,
    hangar_exe: PathBuf,
    engine_host: String,
) -> Result<(Arc<Inner>, tokio::sync::mpsc::UnboundedReceiver<control::Command>), ServeError> {
    config.validate().map_err(|e| ServeError::Config(e.to_string()))?;
    let api_keys = ApiKeys::new(
        config
            .api_keys
            .iter()
            .map(|k| (k.key.clone(), Principal { account: k.account.clone(), admin: k.admin })),
    );
    let weights = open_weight_store(config).await?;
    let metrics = Metrics::new();
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
                desired: AtomicU32::new(m.min_replicas),
                unplaceable: AtomicBool::new(false),
                waiting_signal,
                upstream: relay::upstream(&m.connections),
            };
            (m.key.to_string(), Arc::new(rt))
        })
        .collect();
    let inner = Arc::new(Inner {
        models,
        api_keys,
        control,
        hangar_exe,
        engine_host,
        client: reqwest::Client::new(),
        metrics,
        metrics_key: config.metrics_key.clone(),
        weights,
        gateway: std::sync::OnceLock::new(),
        failed: Mutex::default(),
        epoch: Instant::now(),
    });
    Ok((inner, commands))
}

/// The controller over `cluster` for `config`'s models, with its schedule,
/// in the cadence every driver feeds it.
///
/// `seed` seeds its random choices, replica ids among them: `config.seed`
/// on a single machine; a fleet's leader mixes in its epoch, so a new
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

/// Opens the node's weight store (starting its daemon if none runs) when a
/// model has `weights`, and checks what can be checked before any replica
/// starts: files readable, keys known.
async fn open_weight_store(config: &ServeConfig) -> Result<Option<Arc<WeightStore>>, ServeError> {
    if config.models.iter().all(|m| m.weights.is_none()) {
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
    /// Whether an engine's answer says its replica is out of capacity
    /// (429, or 503 as vLLM and SGLang answer when their own queue is full)
    /// and another replica could take the request instead: then it goes
    /// there, once, before the client sees a refusal (Workers AI's
    /// failover) — a sync request or an async prediction alike.
    pub fn fails_over(&self, status: axum::http::StatusCode) -> bool {
        use axum::http::StatusCode;
        matches!(status, StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE)
            && self.count(replicas::ReplicaState::Ready) > 1
    }

    /// Whether `account` may use this model.
    pub fn allows(&self, account: &AccountId) -> bool {
        self.config.access.as_ref().is_none_or(|accounts| accounts.contains(account))
    }
}

impl Inner {
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
            while rt.count(replicas::ReplicaState::Ready) == 0
                && !rt.unplaceable.load(Ordering::Relaxed)
                && Instant::now() < limit
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if rt.count(replicas::ReplicaState::Ready) == 0 {
                tracing::error!(model = %rt.config.key, "no replica is ready yet; the controller keeps trying");
            }
        }
    }
}
