//! A model's replicas: placement's decisions applied to engine processes,
//! and each replica watched until it is gone.
//!
//! Every change goes the same way ([`Inner::reconcile`]): take a snapshot
//! of the cluster, let the placement policy change it (deploy for demand,
//! evict for the admin API, forget a failed replica), and apply the
//! resulting `DeploymentDelta` in order — `to_cache` drains a replica and
//! puts its engine to sleep, `delete` stops it, `from_cache` wakes it,
//! `create` starts an engine process. New engines start concurrently and
//! each serves as soon as it is ready.
//!
//! A ready replica is health-checked every second: an engine process that
//! exits, or three failed checks in a row, mark it failed. A failed
//! replica leaves the processor (its in-flight requests are retried by the
//! gateway), leaves the cluster, and placement is asked to restore the
//! model's replica count.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::future::BoxFuture;
use hangar_core::{Millis, ReplicaId};
use hangar_placement::{Action, Cluster, Deployment, DeploymentDelta, Level, ReplicaRequest};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use super::{replica_name, Inner, ModelRuntime};
use crate::cog;
use crate::engine::{launch, LaunchContext, RunningEngine};

/// How often a ready replica is health-checked.
const HEALTH_INTERVAL: Duration = Duration::from_secs(1);
/// How long one health check may take.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);
/// Failed checks in a row that make a replica failed.
const HEALTH_FAILURES: u32 = 3;
/// How long a replica being put to sleep may take to finish its requests.
const DRAIN_LIMIT: Duration = Duration::from_secs(60);

/// How often every model's demand is shown to its scale-down policy
/// (arrivals show it too).
const SCALE_DOWN_TICK: Duration = Duration::from_secs(1);

/// Shows every model's demand to its scale-down policy each
/// [`SCALE_DOWN_TICK`], so quiet models give back replicas with no request
/// arriving; ends with the server.
pub(super) async fn watch_excess(inner: Weak<Inner>) {
    let mut tick = tokio::time::interval(SCALE_DOWN_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        for rt in inner.models.values() {
            inner.scale_down_if_quiet(rt, rt.wanted(0), rt.up());
        }
    }
}

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
}

/// A replica as the admin API shows it.
#[derive(Debug, Serialize)]
pub(crate) struct ReplicaStatus {
    pub name: String,
    pub id: String,
    /// `HOT` or `WARM`, from placement.
    pub level: Option<String>,
    pub state: ReplicaState,
    pub node: Option<String>,
    pub gpus: Vec<u32>,
    pub in_flight: u32,
    pub url: Option<String>,
    /// The engine process, when this node started one.
    pub pid: Option<u32>,
}

impl ModelRuntime {
    /// Removes every replica, returning the engines to stop.
    pub fn take_engines(&self) -> Vec<RunningEngine> {
        let mut replicas = self.replicas.lock().expect("replica table lock");
        std::mem::take(&mut *replicas).into_values().filter_map(|r| r.engine).collect()
    }

    /// The base URL of a ready replica.
    pub fn replica_url(&self, replica: ReplicaId) -> Option<String> {
        let replicas = self.replicas.lock().expect("replica table lock");
        replicas.get(&replica).filter(|r| r.state == ReplicaState::Ready).and_then(|r| r.base_url.clone())
    }

    /// How many replicas are in `state`.
    pub fn count(&self, state: ReplicaState) -> usize {
        self.replicas.lock().expect("replica table lock").values().filter(|r| r.state == state).count()
    }

    /// Each ready replica's name and the permits held on it.
    pub fn in_flight(&self) -> Vec<(String, u32)> {
        let ready: Vec<ReplicaId> = {
            let table = self.replicas.lock().expect("replica table lock");
            table.iter().filter(|(_, r)| r.state == ReplicaState::Ready).map(|(id, _)| *id).collect()
        };
        ready
            .into_iter()
            .map(|id| (replica_name(&self.config.key, id), self.processor.in_use_on(id)))
            .collect()
    }

    /// Replicas the demand calls for, within the model's bounds.
    fn wanted(&self, arriving: usize) -> u32 {
        let target = self.target.load(Ordering::SeqCst);
        self.processor
            .replicas_wanted(self.config.permits(), arriving)
            .max(target)
            .min(self.config.max_replicas())
    }

    /// Replicas starting or serving.
    fn up(&self) -> u32 {
        self.replicas.lock().expect("replica table lock").values().filter(|r| r.state.is_up()).count() as u32
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
                    state: r.state,
                    node: d.map(|d| d.node.to_string()),
                    gpus: d.map(|d| d.gpu_bytes_by_gpu.keys().copied().collect()).unwrap_or_default(),
                    in_flight: self.processor.in_use_on(*id),
                    url: r.base_url.clone(),
                    pid: r.engine.as_ref().and_then(RunningEngine::pid),
                }
            })
            .collect()
    }
}

impl Inner {
    /// Starts replicas when what runs, waits and `arriving` more requests
    /// need more than the model has (within `max_replicas`), until demand
    /// is met; one such task per model at a time. Otherwise the demand
    /// goes to the model's scale-down policy, which may give replicas back.
    pub fn scale_for_demand(self: &Arc<Self>, rt: &Arc<ModelRuntime>, arriving: usize) {
        let mut wanted = rt.wanted(arriving);
        let up = rt.up();
        self.scale_down_if_quiet(rt, wanted, up);
        if wanted <= up || rt.scaling.swap(true, Ordering::SeqCst) {
            return;
        }
        let inner = self.clone();
        let rt = rt.clone();
        tokio::spawn(async move {
            while wanted > rt.up() {
                if let Err(e) = inner.ensure(&rt, wanted).await {
                    tracing::error!(model = %rt.config.key, "could not start a replica: {e}");
                    if rt.up() == 0 {
                        let reason = format!("no replica of `{}` could start: {e}", rt.config.key);
                        rt.processor.fail_waiting(&reason);
                    }
                    break;
                }
                // Demand that arrived while the replicas started.
                wanted = rt.wanted(0);
            }
            rt.scaling.store(false, Ordering::SeqCst);
        });
    }

    /// Tells the scale-down policy the demand (`wanted` replicas with `up`
    /// up; demand at or above `up` restarts the quiet period). When the
    /// model has had more replicas than it needed for a whole quiet period,
    /// evicts the excess (least busy first), unless a placement change is
    /// under way.
    fn scale_down_if_quiet(self: &Arc<Self>, rt: &Arc<ModelRuntime>, wanted: u32, up: u32) {
        let keep = rt.scale_down.lock().expect("scale-down lock").observe(self.now(), wanted, up);
        let Some(keep) = keep else { return };
        if rt.scaling.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::info!(model = %rt.config.key, up, keep, "quiet: giving back replicas beyond the demand");
        let inner = self.clone();
        let rt = rt.clone();
        tokio::spawn(async move {
            match inner.evict_down_to(&rt, keep).await {
                Ok(evicted) => rt.metrics.scaled_down(evicted),
                Err(e) => tracing::error!(model = %rt.config.key, "could not scale down: {e}"),
            }
            rt.scaling.store(false, Ordering::SeqCst);
            // Requests that arrived meanwhile found the scaling slot taken.
            inner.scale_for_demand(&rt, 0);
        });
    }

    /// Asks placement for `replicas` hot replicas of the model and applies
    /// the result; an error says why none could be placed or started.
    pub async fn ensure(self: &Arc<Self>, rt: &Arc<ModelRuntime>, replicas: u32) -> Result<(), String> {
        let model = rt.config.key.clone();
        tracing::info!(%model, replicas, "asking placement for hot replicas");
        let placed = self
            .reconcile(|cluster, now, rng| {
                let request = ReplicaRequest { model_key: model.clone(), replicas, dedicated: false };
                let outcome = cluster.deploy(&[request], now, rng);
                let model = outcome.models.first();
                match model.is_some_and(|m| m.hot() > 0) {
                    true => Ok(()),
                    false => Err(model
                        .and_then(|m| m.replicas.iter().find_map(|r| r.reason.as_ref()))
                        .map_or("no room".to_owned(), ToString::to_string)),
                }
            })
            .await?;
        placed.map_err(|reason| format!("placement found no room for `{model}`: {reason}"))
    }

    /// Evicts one replica of the model, or all its hot ones: each goes to
    /// the warm cache (its engine sleeps) if the node's cache has room,
    /// else it is stopped. Returns how many replicas changed level.
    pub async fn evict(
        self: &Arc<Self>,
        rt: &Arc<ModelRuntime>,
        replica: Option<ReplicaId>,
    ) -> Result<usize, String> {
        let model = rt.config.key.clone();
        self.reconcile(|cluster, _, _| match replica {
            Some(id) => cluster.evict_replica(&model, &id).map(|e| e.len()).map_err(|e| e.to_string()),
            None => Ok(cluster.evict_model(&model).len()),
        })
        .await?
    }

    /// Sets the replicas the model keeps whatever the demand: more are
    /// placed now; extra ones (least busy first) are evicted.
    pub async fn set_target(self: &Arc<Self>, rt: &Arc<ModelRuntime>, replicas: u32) -> Result<(), String> {
        rt.target.store(replicas, Ordering::SeqCst);
        if replicas > 0 {
            self.ensure(rt, replicas).await?;
        }
        self.evict_down_to(rt, replicas).await.map(drop)
    }

    /// Evicts the replicas up beyond `keep`, least busy first; returns how
    /// many it evicted.
    async fn evict_down_to(self: &Arc<Self>, rt: &Arc<ModelRuntime>, keep: u32) -> Result<u32, String> {
        let mut up: Vec<(u32, ReplicaId)> = {
            let table = rt.replicas.lock().expect("replica table lock");
            table.iter().filter(|(_, r)| r.state.is_up()).map(|(id, _)| (0, *id)).collect()
        };
        for (busy, id) in &mut up {
            *busy = rt.processor.in_use_on(*id);
        }
        up.sort_unstable();
        let mut evicted = 0;
        for (_, id) in up.iter().take(up.len().saturating_sub(keep as usize)) {
            evicted += self.evict(rt, Some(*id)).await? as u32;
        }
        Ok(evicted)
    }

    /// Lets placement change the cluster with `change`, then applies the
    /// difference to the engines. Returns what `change` returned; the
    /// error is a failure to apply (e.g. an engine that did not start).
    async fn reconcile<T>(
        self: &Arc<Self>,
        change: impl FnOnce(&mut Cluster, Millis, &mut ChaCha8Rng) -> T,
    ) -> Result<T, String> {
        let (out, delta) = {
            let mut guard = self.placement.lock().await;
            let (cluster, rng) = &mut *guard;
            let before = cluster.snapshot();
            let out = change(cluster, self.now(), rng);
            let delta = DeploymentDelta::between(&before, &cluster.snapshot()).map_err(|e| e.to_string())?;
            (out, delta)
        };
        self.apply(&delta).await?;
        Ok(out)
    }

    /// Applies a delta's steps in order; engines start concurrently. (Boxed:
    /// a failed start reconciles again, so the future is recursive.)
    fn apply<'a>(self: &'a Arc<Self>, delta: &'a DeploymentDelta) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let mut starts = Vec::new();
            for step in delta.steps() {
                let d = step.deployment;
                let Some(rt) = self.models.get(d.model_key.as_str()).cloned() else { continue };
                match step.action {
                    // A cog server has no sleep mode: it stops, and a
                    // wake-up from the cache starts a fresh one.
                    Action::ToCache if rt.config.engine.is_cog() => self.stop(&rt, d.replica_id).await,
                    Action::ToCache => self.put_to_sleep(&rt, d.replica_id).await,
                    Action::Delete => self.stop(&rt, d.replica_id).await,
                    Action::FromCache => {
                        if !self.wake(&rt, d.replica_id).await {
                            starts.push(self.start_replica(rt, d.clone()));
                        }
                    }
                    Action::Create => starts.push(self.start_replica(rt, d.clone())),
                    Action::Update => {}
                }
            }
            let failures: Vec<String> =
                futures::future::join_all(starts).await.into_iter().filter_map(Result::err).collect();
            match failures.is_empty() {
                true => Ok(()),
                false => Err(failures.join("; ")),
            }
        })
    }

    /// Starts an engine for a hot deployment; it serves once ready. On
    /// failure the replica leaves the cluster.
    async fn start_replica(self: &Arc<Self>, rt: Arc<ModelRuntime>, d: Deployment) -> Result<(), String> {
        let id = d.replica_id;
        let name = replica_name(&rt.config.key, id);
        let replica = Replica { state: ReplicaState::Starting, base_url: None, engine: None };
        rt.replicas.lock().expect("replica table lock").insert(id, replica);
        let ctx = LaunchContext {
            model: d.model_key.to_string(),
            gpus: d.gpu_bytes_by_gpu.keys().copied().collect(),
            gpu_fraction: d.gpu_fraction.unwrap_or(1.0),
            hangar_exe: self.hangar_exe.clone(),
            mock_setup_timeout: Duration::from_secs(600),
        };
        let engine = match launch(&rt.config.engine, &ctx).await {
            Ok(engine) => engine,
            Err(e) => {
                rt.replicas.lock().expect("replica table lock").remove(&id);
                let _ = self.forget(&rt, id).await;
                return Err(format!("replica {name} did not start: {e}"));
            }
        };
        let url = engine.base_url.clone();
        let unwanted = {
            let mut table = rt.replicas.lock().expect("replica table lock");
            match table.get_mut(&id) {
                Some(r) if r.state == ReplicaState::Starting => {
                    r.state = ReplicaState::Ready;
                    r.base_url = Some(url.clone());
                    r.engine = Some(engine);
                    None
                }
                // Evicted or stopped while starting: nothing wants it now.
                _ => Some(engine),
            }
        };
        if let Some(engine) = unwanted {
            engine.stop(Duration::from_secs(5)).await;
            return Ok(());
        }
        tracing::info!(replica = %name, %url, "replica ready");
        rt.processor.replica_ready(id, rt.config.permits());
        self.watch(&rt, id);
        Ok(())
    }

    /// Wakes a sleeping replica; false if there is none to wake (its
    /// engine is gone), so a fresh one must start.
    async fn wake(&self, rt: &ModelRuntime, replica: ReplicaId) -> bool {
        let url = {
            let table = rt.replicas.lock().expect("replica table lock");
            table.get(&replica).and_then(|r| r.base_url.clone())
        };
        let Some(url) = url else { return false };
        let woke =
            self.client.post(format!("{url}/wake_up")).send().await.is_ok_and(|r| r.status().is_success());
        if !woke {
            let gone = rt.replicas.lock().expect("replica table lock").remove(&replica);
            if let Some(e) = gone.and_then(|r| r.engine) {
                e.stop(Duration::from_secs(1)).await;
            }
            return false;
        }
        rt.set_state(replica, ReplicaState::Ready);
        tracing::info!(replica = %replica_name(&rt.config.key, replica), "replica woke from the warm cache");
        rt.processor.replica_ready(replica, rt.config.permits());
        true
    }

    /// Takes a replica out of service and puts its engine to sleep once its
    /// requests have finished (the engine refuses to sleep while busy).
    async fn put_to_sleep(&self, rt: &ModelRuntime, replica: ReplicaId) {
        rt.processor.replica_gone(replica);
        let Some(url) = rt.set_state(replica, ReplicaState::Draining) else { return };
        let name = replica_name(&rt.config.key, replica);
        let started = tokio::time::Instant::now();
        loop {
            match self.client.post(format!("{url}/sleep")).send().await {
                Ok(r) if r.status() == reqwest::StatusCode::CONFLICT && started.elapsed() < DRAIN_LIMIT => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Ok(r) if r.status().is_success() => break,
                other => {
                    tracing::warn!(replica = %name, "the engine did not go to sleep: {other:?}");
                    break;
                }
            }
        }
        rt.set_state(replica, ReplicaState::Sleeping);
        tracing::info!(replica = %name, "replica evicted to the warm cache");
    }

    /// Takes a replica out of service and stops its engine.
    async fn stop(&self, rt: &ModelRuntime, replica: ReplicaId) {
        rt.processor.replica_gone(replica);
        let removed = rt.replicas.lock().expect("replica table lock").remove(&replica);
        if let Some(e) = removed.and_then(|r| r.engine) {
            e.stop(Duration::from_secs(5)).await;
        }
        tracing::info!(replica = %replica_name(&rt.config.key, replica), "replica stopped");
    }

    /// Removes a replica from the cluster altogether (hot → warm → cold).
    async fn forget(self: &Arc<Self>, rt: &ModelRuntime, replica: ReplicaId) -> Result<(), String> {
        let model = rt.config.key.clone();
        self.reconcile(|cluster, _, _| {
            while cluster.deployment(&replica).is_some() {
                if cluster.evict_replica(&model, &replica).is_err() {
                    break;
                }
            }
        })
        .await
    }

    /// A replica's engine died or stopped answering: at once, its
    /// requests lose their replica (the gateway retries them) and no new
    /// ones go there; then, in the background, it leaves the cluster and
    /// the model gets its replica count back through placement.
    pub fn replica_failed(self: &Arc<Self>, rt: &Arc<ModelRuntime>, replica: ReplicaId, why: &str) {
        let Some(failed) = rt.replicas.lock().expect("replica table lock").remove(&replica) else {
            return; // Already handled.
        };
        tracing::warn!(replica = %replica_name(&rt.config.key, replica), "replica failed: {why}");
        rt.metrics.replica_failed();
        rt.processor.replica_gone(replica);
        let (inner, rt) = (self.clone(), rt.clone());
        tokio::spawn(async move {
            if let Some(e) = failed.engine {
                e.stop(Duration::from_millis(500)).await;
            }
            if let Err(e) = inner.forget(&rt, replica).await {
                tracing::warn!(model = %rt.config.key, "cleaning up after a failed replica: {e}");
            }
            let restore = rt.up() + u32::from(failed.state.is_up());
            if restore > rt.up() {
                if let Err(e) = inner.ensure(&rt, restore).await {
                    tracing::error!(model = %rt.config.key, "could not replace a failed replica: {e}");
                    if rt.up() == 0 {
                        rt.processor.fail_waiting(&format!("`{}` lost its replica: {e}", rt.config.key));
                    }
                }
            }
        });
    }

    /// Checks a replica now; a dead one is handled as failed. Returns
    /// whether it is alive.
    pub async fn probe(self: &Arc<Self>, rt: &Arc<ModelRuntime>, replica: ReplicaId) -> bool {
        match self.check(rt, replica).await {
            Ok(()) => true,
            Err(why) => {
                self.replica_failed(rt, replica, why.as_str());
                false
            }
        }
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

    /// Placement's deployments of a model (hot and warm).
    pub async fn deployments(&self, rt: &ModelRuntime) -> Vec<Deployment> {
        let guard = self.placement.lock().await;
        let cluster = &guard.0;
        [Level::Hot, Level::Warm]
            .into_iter()
            .flat_map(|l| cluster.replicas_of(&rt.config.key, l).into_iter().cloned())
            .collect()
    }
}
