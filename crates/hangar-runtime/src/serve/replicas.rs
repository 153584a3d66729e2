//! A model's replicas: the controller's deployment deltas applied to
//! engine processes, and each replica watched until it is gone.
//!
//! The controller (`control`) decides; this module only carries out a
//! `DeploymentDelta`, in order — `to_cache` drains a replica and puts its
//! engine to sleep, `delete` stops it, `from_cache` wakes it, `create`
//! starts an engine process — and reports back: a replica ready (with how
//! long it took, COLD or WARM), or one that did not start. New engines
//! start concurrently and each serves as soon as it is ready.
//!
//! A ready replica is health-checked every second: an engine process that
//! exits, or three failed checks in a row, mark it failed. A failed
//! replica leaves the processor at once (its in-flight requests are
//! retried by the gateway), and the controller is told, which takes it out
//! of the cluster and restores the model's count.

use std::sync::{Arc, Weak};
use std::time::Duration;

use hangar_core::ReplicaId;
use hangar_placement::{Action, Deployment, DeploymentDelta};
use hangar_scaler::StartTier;
use serde::Serialize;

use super::control::Command;
use super::{replica_name, Inner, ModelRuntime};
use hangar_agent::capabilities::{self, Capabilities};
use hangar_agent::cog;
use hangar_agent::engine::{launch_on, LaunchContext, RunningEngine};
use hangar_agent::weights::{LoadedWeights, WeightsReport};

/// How often a ready replica is health-checked.
const HEALTH_INTERVAL: Duration = Duration::from_secs(1);
/// How long one health check may take.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);
/// Failed checks in a row that make a replica failed.
const HEALTH_FAILURES: u32 = 3;
/// How long a replica being put to sleep may take to finish its requests.
const DRAIN_LIMIT: Duration = Duration::from_secs(60);

/// Where a replica is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum ReplicaState {
    /// Its engine is starting (loading weights).
    Starting,
    /// Serving.
    Ready,
    /// Evicted to the warm cache: finishing its requests before sleeping.
    Draining,
    /// Asleep in the warm cache; a wake-up brings it back without a load.
    Sleeping,
}

impl ReplicaState {
    pub const ALL: [Self; 4] = [Self::Starting, Self::Ready, Self::Draining, Self::Sleeping];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Ready => "ready",
            Self::Draining => "draining",
            Self::Sleeping => "sleeping",
        }
    }

    /// Whether the replica serves or soon will (it counts as hot).
    fn is_up(self) -> bool {
        matches!(self, Self::Starting | Self::Ready)
    }
}

/// Why a health check failed.
#[derive(Debug, Clone, Copy)]
enum Unhealthy {
    Exited,
    NoAnswer,
}

impl Unhealthy {
    fn as_str(self) -> &'static str {
        match self {
            Self::Exited => "its engine process exited",
            Self::NoAnswer => "its health check failed",
        }
    }
}

/// One replica this node runs.
pub(crate) struct Replica {
    pub state: ReplicaState,
    /// Known once the engine has started.
    pub base_url: Option<String>,
    engine: Option<RunningEngine>,
    /// What the engine can do, probed once it answered.
    pub capabilities: Capabilities,
    /// Its weights, materialized by the store, while the replica lives.
    weights: Option<LoadedWeights>,
    /// How its start went, phase by phase, once it is ready.
    start: Option<StartReport>,
    /// The fleet node running it, for a replica another machine runs.
    pub node: Option<String>,
}

/// How a replica started, phase by phase (seed 001's setup-run report):
/// placed at 0, then its weights materialized (from which source), its
/// engine started and answering, ready. In `/admin/status` and the log.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct StartReport {
    /// The weights phase, for a model with `weights`.
    pub weights: Option<WeightsReport>,
    /// Engine process spawned → answering its readiness check, ms.
    pub engine_ms: u64,
    /// Placed → ready, ms (the phases above and the capability probe).
    pub ready_ms: u64,
}

impl std::fmt::Display for StartReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("placed")?;
        if let Some(w) = &self.weights {
            write!(f, " → weights {} ms ({}, {} bytes)", w.took_ms, w.source, w.bytes)?;
        }
        write!(f, " → engine {} ms → ready at {} ms", self.engine_ms, self.ready_ms)
    }
}

/// A replica as the admin API shows it (serialized as is).
#[derive(Debug, Serialize)]
pub struct ReplicaStatus {
    name: String,
    id: String,
    /// `HOT` or `WARM`, from placement.
    level: Option<String>,
    /// Kept by a dedicated window of the schedule.
    dedicated: bool,
    state: ReplicaState,
    node: Option<String>,
    gpus: Vec<u32>,
    in_flight: u32,
    url: Option<String>,
    /// The engine process, when this node started one.
    pid: Option<u32>,
    /// What its engine can do (sleep, metrics, slots).
    capabilities: Capabilities,
    /// How its last cold start went.
    start: Option<StartReport>,
}

impl Replica {
    /// A replica another machine runs (fleet mode), as its agent reports
    /// it: this gateway routes to it, it does not own its engine.
    pub fn remote(state: ReplicaState, url: Option<String>, node: String) -> Replica {
        Replica {
            state,
            base_url: url,
            engine: None,
            capabilities: Capabilities::default(),
            weights: None,
            start: None,
            node: Some(node),
        }
    }

    /// Placed → ready of its last start, ms.
    pub fn ready_ms(&self) -> Option<u64> {
        self.start.as_ref().map(|s| s.ready_ms)
    }
}

impl From<ReplicaState> for hangar_core::ReplicaPhase {
    fn from(s: ReplicaState) -> Self {
        match s {
            ReplicaState::Starting => Self::Starting,
            ReplicaState::Ready => Self::Ready,
            ReplicaState::Draining => Self::Draining,
            ReplicaState::Sleeping => Self::Sleeping,
        }
    }
}

impl From<hangar_core::ReplicaPhase> for ReplicaState {
    fn from(p: hangar_core::ReplicaPhase) -> Self {
        match p {
            hangar_core::ReplicaPhase::Starting => Self::Starting,
            hangar_core::ReplicaPhase::Ready => Self::Ready,
            hangar_core::ReplicaPhase::Draining => Self::Draining,
            hangar_core::ReplicaPhase::Sleeping => Self::Sleeping,
        }
    }
}

impl ModelRuntime {
    /// Removes every replica, returning the engines to stop.
    pub(crate) fn take_engines(&self) -> Vec<RunningEngine> {
        let mut replicas = self.replicas.lock().expect("replica table lock");
        std::mem::take(&mut *replicas).into_values().filter_map(|r| r.engine).collect()
    }

    /// The base URL of a ready replica (`None` once it is not ready, or
    /// gone).
    pub fn replica_url(&self, replica: ReplicaId) -> Option<String> {
        let replicas = self.replicas.lock().expect("replica table lock");
        replicas.get(&replica).filter(|r| r.state == ReplicaState::Ready).and_then(|r| r.base_url.clone())
    }

    /// How many replicas are in `state`.
    pub(crate) fn count(&self, state: ReplicaState) -> usize {
        self.replicas.lock().expect("replica table lock").values().filter(|r| r.state == state).count()
    }

    /// Each ready replica's name and the permits held on it.
    pub(crate) fn in_flight(&self) -> Vec<(String, u32)> {
        let ready: Vec<ReplicaId> = {
            let table = self.replicas.lock().expect("replica table lock");
            table.iter().filter(|(_, r)| r.state == ReplicaState::Ready).map(|(id, _)| *id).collect()
        };
        ready
            .into_iter()
            .map(|id| (replica_name(&self.config.key, id), self.processor.in_use_on(id)))
            .collect()
    }

    /// Each replica's state.
    pub(crate) fn states(&self) -> Vec<(ReplicaId, ReplicaState)> {
        self.replicas.lock().expect("replica table lock").iter().map(|(id, r)| (*id, r.state)).collect()
    }

    /// Replicas starting or serving.
    pub(crate) fn up(&self) -> u32 {
        self.replicas.lock().expect("replica table lock").values().filter(|r| r.state.is_up()).count() as u32
    }

    /// A replica's state.
    fn state(&self, replica: ReplicaId) -> Option<ReplicaState> {
        self.replicas.lock().expect("replica table lock").get(&replica).map(|r| r.state)
    }

    /// Moves a replica from `from` to `to`; false if it was not in `from`.
    fn set_state_if(&self, replica: ReplicaId, from: ReplicaState, to: ReplicaState) -> bool {
        let mut replicas = self.replicas.lock().expect("replica table lock");
        match replicas.get_mut(&replica) {
            Some(r) if r.state == from => {
                r.state = to;
                true
            }
            _ => false,
        }
    }

    fn set_state(&self, replica: ReplicaId, state: ReplicaState) -> Option<String> {
        let mut replicas = self.replicas.lock().expect("replica table lock");
        let r = replicas.get_mut(&replica)?;
        r.state = state;
        r.base_url.clone()
    }

    /// The model's replicas as the admin API shows them, with placement's
    /// view of each (`deployments`: the model's hot and warm deployments).
    pub fn status(&self, deployments: &[Deployment]) -> Vec<ReplicaStatus> {
        let replicas = self.replicas.lock().expect("replica table lock");
        replicas
            .iter()
            .map(|(id, r)| {
                let d = deployments.iter().find(|d| d.replica_id == *id);
                ReplicaStatus {
                    name: replica_name(&self.config.key, *id),
                    id: id.to_string(),
                    level: d.map(|d| d.level.to_string()),
                    dedicated: d.is_some_and(|d| d.dedicated),
                    state: r.state,
                    node: d.map(|d| d.node.to_string()),
                    gpus: d.map(|d| d.gpu_bytes_by_gpu.keys().copied().collect()).unwrap_or_default(),
                    in_flight: self.processor.in_use_on(*id),
                    url: r.base_url.clone(),
                    pid: r.engine.as_ref().and_then(RunningEngine::pid),
                    capabilities: r.capabilities,
                    start: r.start.clone(),
                }
            })
            .collect()
    }
}

impl Inner {
    /// Applies a delta's steps in order; engines start concurrently, and
    /// each reports to the controller when it is ready or did not start.
    ///
    /// # Cancel safety
    /// Not cancel-safe: dropped midway, the steps after are not applied.
    /// The controller's task runs it in a task of its own.
    pub(crate) async fn apply(self: &Arc<Self>, delta: &DeploymentDelta) {
        let mut starts = Vec::new();
        for step in delta.steps() {
            match step.action {
                Action::FromCache | Action::Create => {
                    starts.push(self.apply_step(step.action, step.deployment))
                }
                action => self.apply_step(action, step.deployment).await,
            }
        }
        futures::future::join_all(starts).await;
    }

    /// Carries out one step for deployment `d`: the one way a replica is
    /// started, woken, put to sleep or stopped, whether the step came from
    /// this server's controller or, on a fleet's node, from the leader's
    /// desired state.
    ///
    /// # Cancel safety
    /// Not cancel-safe (a start dropped midway leaves its replica in the
    /// table as starting); callers run it to its end in a task.
    pub(crate) async fn apply_step(self: &Arc<Self>, action: Action, d: &Deployment) {
        let Some(rt) = self.models.get(d.model_key.as_str()).cloned() else { return };
        match action {
            Action::ToCache => self.put_to_sleep(&rt, d.replica_id).await,
            Action::Delete => self.stop(&rt, d.replica_id).await,
            Action::FromCache => {
                if !self.wake(&rt, d.replica_id).await {
                    self.start_replica(rt, d.clone()).await;
                }
            }
            Action::Create => self.start_replica(rt, d.clone()).await,
            Action::Update => {}
        }
    }

    /// Starts an engine for a hot deployment: its weights materialized
    /// first (if it has any), then the engine; it serves once ready. Either
    /// way the controller hears of it.
    async fn start_replica(self: &Arc<Self>, rt: Arc<ModelRuntime>, d: Deployment) {
        let id = d.replica_id;
        let name = replica_name(&rt.config.key, id);
        let replica = Replica {
            state: ReplicaState::Starting,
            base_url: None,
            engine: None,
            capabilities: Capabilities::default(),
            weights: None,
            start: None,
            node: None,
        };
        rt.replicas.lock().expect("replica table lock").insert(id, replica);
        let placed = std::time::Instant::now();
        let weights = match self.load_weights(&rt, id).await {
            Ok(weights) => weights,
            Err(why) => return self.start_failed(&rt, id, why).await,
        };
        let ctx = LaunchContext {
            model: d.model_key.to_string(),
            gpus: d.gpu_bytes_by_gpu.keys().copied().collect(),
            gpu_fraction: d.gpu_fraction.unwrap_or(1.0),
            hangar_exe: self.hangar_exe.clone(),
            mock_setup_timeout: Duration::from_secs(600),
            weights: weights.as_ref().map(LoadedWeights::fd),
        };
        let spawned = std::time::Instant::now();
        let engine = match launch_on(&rt.config.engine, &ctx, &self.engine_host).await {
            Ok(engine) => engine,
            Err(e) => return self.start_failed(&rt, id, e.to_string()).await,
        };
        let engine_ms = spawned.elapsed().as_millis() as u64;
        let url = engine.base_url.clone();
        let capabilities = capabilities::probe(&self.client, &url, &rt.config.engine).await;
        let sleeps = capabilities.sleep.is_some();
        let took = placed.elapsed();
        let report = StartReport {
            weights: weights.as_ref().map(|w| w.report.clone()),
            engine_ms,
            ready_ms: took.as_millis() as u64,
        };
        let unwanted = {
            let mut table = rt.replicas.lock().expect("replica table lock");
            match table.get_mut(&id) {
                Some(r) if r.state == ReplicaState::Starting => {
                    r.state = ReplicaState::Ready;
                    r.base_url = Some(url.clone());
                    r.engine = Some(engine);
                    r.capabilities = capabilities;
                    r.weights = weights;
                    r.start = Some(report.clone());
                    None
                }
                // Evicted or stopped while starting: nothing wants it now.
                _ => Some(engine),
            }
        };
        if let Some(engine) = unwanted {
            engine.stop(Duration::from_secs(5)).await;
            self.release_weights(id).await;
            return;
        }
        tracing::info!(replica = %name, %url, took_ms = took.as_millis() as u64, "replica ready: {report}");
        rt.processor.replica_ready(id, rt.config.permits());
        self.control.send(Command::Ready {
            model: rt.config.key.clone(),
            tier: StartTier::Cold,
            took,
            sleeps,
        });
        self.watch(&rt, id);
    }

    /// Materializes the model's weights for a replica, if it has any.
    async fn load_weights(
        &self,
        rt: &ModelRuntime,
        replica: ReplicaId,
    ) -> Result<Option<LoadedWeights>, String> {
        let Some(source) = &rt.config.weights else { return Ok(None) };
        let store = self.weights.as_ref().expect("a store is opened when a model has weights");
        store.load(&rt.config.key, source, replica).await.map(Some).map_err(|e| e.to_string())
    }

    /// A replica that did not start: out of the table, its weights let go,
    /// the controller told.
    async fn start_failed(&self, rt: &ModelRuntime, replica: ReplicaId, why: String) {
        rt.replicas.lock().expect("replica table lock").remove(&replica);
        self.release_weights(replica).await;
        tracing::error!(replica = %replica_name(&rt.config.key, replica), "did not start: {why}");
        let model = rt.config.key.clone();
        self.control.send(Command::Failed { model, replica, why, start_failed: true });
    }

    /// Drops a replica's reference to its weights in the store.
    async fn release_weights(&self, replica: ReplicaId) {
        if let Some(store) = &self.weights {
            store.release(replica).await;
        }
    }

    /// Wakes a sleeping replica; false if there is none to wake (its
    /// engine is gone), so a fresh one must start.
    async fn wake(&self, rt: &ModelRuntime, replica: ReplicaId) -> bool {
        let found = {
            let table = rt.replicas.lock().expect("replica table lock");
            table.get(&replica).and_then(|r| Some((r.base_url.clone()?, r.capabilities.sleep?)))
        };
        let Some((url, api)) = found else { return false };
        let started = std::time::Instant::now();
        let answer = self.engine_call(&url, api.wake_path()).await;
        let woke = matches!(&answer, Ok(r) if r.status().is_success());
        if !woke {
            let why = capabilities::describe(answer).await;
            tracing::warn!(replica = %replica_name(&rt.config.key, replica), "did not wake ({why}); starting a fresh engine");
            let gone = rt.replicas.lock().expect("replica table lock").remove(&replica);
            if let Some(e) = gone.and_then(|r| r.engine) {
                e.stop(Duration::from_secs(1)).await;
            }
            return false;
        }
        rt.set_state(replica, ReplicaState::Ready);
        let took = started.elapsed();
        tracing::info!(replica = %replica_name(&rt.config.key, replica), took_ms = took.as_millis() as u64, "replica woke from the warm cache");
        rt.processor.replica_ready(replica, rt.config.permits());
        // It woke through its sleep API, so it can sleep.
        let sleeps = true;
        self.control.send(Command::Ready {
            model: rt.config.key.clone(),
            tier: StartTier::Warm,
            took,
            sleeps,
        });
        true
    }

    /// Takes a replica out of service and puts its engine to sleep once its
    /// requests have finished (the engine refuses to sleep while busy). An
    /// engine that cannot sleep (no sleep API, or the call failed) is
    /// stopped instead, and the controller told it is gone rather than
    /// WARM: a replica counted WARM never holds its GPU memory.
    async fn put_to_sleep(&self, rt: &ModelRuntime, replica: ReplicaId) {
        let name = replica_name(&rt.config.key, replica);
        let api =
            rt.replicas.lock().expect("replica table lock").get(&replica).and_then(|r| r.capabilities.sleep);
        let Some(api) = api else {
            tracing::info!(replica = %name, "its engine cannot sleep: stopping it instead of keeping it WARM");
            return self.stop_cold(rt, replica).await;
        };
        rt.processor.replica_gone(replica);
        let Some(url) = rt.set_state(replica, ReplicaState::Draining) else { return };
        let started = tokio::time::Instant::now();
        // The controller may want it back while it drains (a wake sets it
        // ready again): then it stays awake.
        let draining = || rt.state(replica) == Some(ReplicaState::Draining);
        while draining() {
            match self.engine_call(&url, api.sleep_path()).await {
                Ok(r) if r.status() == reqwest::StatusCode::CONFLICT && started.elapsed() < DRAIN_LIMIT => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Ok(r) if r.status().is_success() => break,
                other => {
                    let why = capabilities::describe(other).await;
                    tracing::warn!(replica = %name, "the engine did not go to sleep ({why}): stopping it instead");
                    if draining() {
                        return self.stop_cold(rt, replica).await;
                    }
                    break;
                }
            }
        }
        if !rt.set_state_if(replica, ReplicaState::Draining, ReplicaState::Sleeping) {
            // Woken while it went to sleep: make sure the engine is awake.
            let _ = self.engine_call(&url, api.wake_path()).await;
            return;
        }
        tracing::info!(replica = %name, "replica evicted to the warm cache");
    }

    /// `POST {url}{path}` with an empty JSON object: a sleep or wake call
    /// (SGLang's take a body, vLLM's ignore it).
    async fn engine_call(&self, url: &str, path: &str) -> reqwest::Result<reqwest::Response> {
        self.client.post(format!("{url}{path}")).json(&serde_json::json!({})).send().await
    }

    /// Stops a replica placement meant to keep WARM, and tells the
    /// controller it is gone (COLD): its next start loads afresh.
    async fn stop_cold(&self, rt: &ModelRuntime, replica: ReplicaId) {
        self.stop(rt, replica).await;
        self.control.send(Command::Stopped { model: rt.config.key.clone(), replica });
    }

    /// Takes a replica out of service and stops its engine.
    async fn stop(&self, rt: &ModelRuntime, replica: ReplicaId) {
        rt.processor.replica_gone(replica);
        let removed = rt.replicas.lock().expect("replica table lock").remove(&replica);
        if let Some(e) = removed.and_then(|r| r.engine) {
            e.stop(Duration::from_secs(5)).await;
        }
        self.release_weights(replica).await;
        tracing::info!(replica = %replica_name(&rt.config.key, replica), "replica stopped");
    }

    /// A replica's engine died or stopped answering: at once, its
    /// requests lose their replica (the gateway retries them) and no new
    /// ones go there; the controller takes it out of the cluster and
    /// restores the model's count; its engine is stopped in the background.
    pub fn replica_failed(self: &Arc<Self>, rt: &Arc<ModelRuntime>, replica: ReplicaId, why: &str) {
        let Some(failed) = rt.replicas.lock().expect("replica table lock").remove(&replica) else {
            return; // Already handled.
        };
        {
            let mut recent = self.failed.lock().expect("failed table");
            recent.retain(|_, (at, _)| at.elapsed() < super::fleet::QUARANTINE);
            recent.insert(replica, (std::time::Instant::now(), failed.node.clone()));
        }
        tracing::warn!(replica = %replica_name(&rt.config.key, replica), "replica failed: {why}");
        rt.metrics.replica_failed();
        rt.processor.replica_gone(replica);
        let model = rt.config.key.clone();
        self.control.send(Command::Failed { model, replica, why: why.to_owned(), start_failed: false });
        let inner = self.clone();
        tokio::spawn(async move {
            if let Some(e) = failed.engine {
                e.stop(Duration::from_millis(500)).await;
            }
            inner.release_weights(replica).await;
        });
    }

    /// Checks a replica now; a dead one is handled as failed. Returns
    /// whether it is alive.
    ///
    /// A dead replica another machine runs (fleet mode) makes its node
    /// suspect: every other replica there is checked at once, so that a
    /// retry does not go to a sibling that died with it.
    pub async fn probe(self: &Arc<Self>, rt: &Arc<ModelRuntime>, replica: ReplicaId) -> bool {
        let here = rt.replicas.lock().expect("replica table lock").get(&replica).map(|r| r.node.clone());
        let node = match &here {
            Some(node) => node.clone(),
            // Already failed by another request's probe, which may still
            // be checking its siblings: check them too before answering.
            None => self.failed.lock().expect("failed table").get(&replica).and_then(|(_, n)| n.clone()),
        };
        if here.is_some() {
            match self.check(rt, replica).await {
                Ok(()) => return true,
                Err(why) => self.replica_failed(rt, replica, why.as_str()),
            }
        }
        if let Some(node) = node {
            self.probe_node(&node).await;
        }
        false
    }

    /// Checks every ready replica of `node` at once; the dead are failed.
    async fn probe_node(self: &Arc<Self>, node: &str) {
        let mut checks = Vec::new();
        for rt in self.models.values() {
            let ids: Vec<ReplicaId> = rt
                .replicas
                .lock()
                .expect("replica table lock")
                .iter()
                .filter(|(_, r)| r.node.as_deref() == Some(node) && r.state == ReplicaState::Ready)
                .map(|(id, _)| *id)
                .collect();
            for id in ids {
                checks.push(async move {
                    if let Err(why) = self.check(rt, id).await {
                        self.replica_failed(rt, id, why.as_str());
                    }
                });
            }
        }
        futures::future::join_all(checks).await;
    }

    /// One health check: the process is alive and `/health` answers 200.
    async fn check(&self, rt: &ModelRuntime, replica: ReplicaId) -> Result<(), Unhealthy> {
        let url = {
            let mut table = rt.replicas.lock().expect("replica table lock");
            let Some(r) = table.get_mut(&replica) else { return Ok(()) };
            if r.engine.as_mut().is_some_and(RunningEngine::has_exited) {
                return Err(Unhealthy::Exited);
            }
            match (r.state, &r.base_url) {
                (ReplicaState::Ready, Some(url)) => url.clone(),
                _ => return Ok(()),
            }
        };
        if rt.config.engine.is_cog() {
            // Cog answers 200 whatever its state: read the state.
            return match cog::health(&self.client, &url, HEALTH_TIMEOUT).await {
                Ok(h) if h.serves() => Ok(()),
                _ => Err(Unhealthy::NoAnswer),
            };
        }
        let answer = self.client.get(format!("{url}/health")).timeout(HEALTH_TIMEOUT).send().await;
        match answer {
            Ok(r) if r.status().is_success() => Ok(()),
            _ => Err(Unhealthy::NoAnswer),
        }
    }

    /// Health-checks a replica until it leaves the table.
    fn watch(self: &Arc<Self>, rt: &Arc<ModelRuntime>, replica: ReplicaId) {
        let inner: Weak<Inner> = Arc::downgrade(self);
        let rt = rt.clone();
        tokio::spawn(async move {
            let mut failures = 0;
            loop {
                tokio::time::sleep(HEALTH_INTERVAL).await;
                let Some(inner) = inner.upgrade() else { return };
                if !rt.replicas.lock().expect("replica table lock").contains_key(&replica) {
                    return;
                }
                match inner.check(&rt, replica).await {
                    Ok(()) => failures = 0,
                    Err(Unhealthy::Exited) => {
                        return inner.replica_failed(&rt, replica, Unhealthy::Exited.as_str())
                    }
                    Err(Unhealthy::NoAnswer) => {
                        failures += 1;
                        if failures >= HEALTH_FAILURES {
                            let why =
                                format!("{} {HEALTH_FAILURES} times in a row", Unhealthy::NoAnswer.as_str());
                            return inner.replica_failed(&rt, replica, &why);
                        }
                    }
                }
            }
        });
    }
}
