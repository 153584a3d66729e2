//! The live driver: workers that claim queued predictions and run them,
//! the cordon, sweep and prune loops, and webhook delivery.
//!
//! Time comes from the system clock here and nowhere else in the crate;
//! every rule it applies is one of the sans-IO policies, fed `now`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hangar_core::{AccountId, ApiKeys, ErrorCode, Millis};
use serde_json::Value;
use tokio::sync::{watch, Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::config::{ModelSettings, PredictionsConfig};
use crate::executor::{ExecError, ExecEvent, Executor, Job, Sink};
use crate::lifecycle::{DeadlineSource, Deadlines, Ending, Status};
use crate::record::{JobKind, Record, StatusView};
use crate::signing;
use crate::store::{Backend, Delivery, PredictionQueue, StoreError, Watched};
use crate::webhook_policy::{retry_delay, Decision, Event, Throttle};
use crate::webhook_target::{self, AllowList};

/// The wall clock, in ms since the Unix epoch.
pub(crate) fn now() -> Millis {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as Millis)
}

/// A model the API serves.
#[derive(Debug, Clone)]
pub struct Model {
    /// `owner/name`.
    pub key: String,
    /// Its one version's id.
    pub version: String,
    /// Its predictions settings.
    pub settings: ModelSettings,
    /// Accounts allowed (`None`: all).
    pub access: Option<Vec<AccountId>>,
    /// How its input is checked.
    pub input: InputRules,
    /// What a deployment of it shows as its release's configuration.
    pub capacity: Capacity,
}

/// A model's hardware and replica bounds, as Replicate's deployment
/// release shows them (`configuration.hardware`, `min_instances`,
/// `max_instances`) and `GET /v1/hardware` lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capacity {
    /// The hardware SKU: `gpu-KIND` for a model that needs nodes of one
    /// `gpu_kind`, `gpu` for one any GPU node takes.
    pub hardware: String,
    /// `min_replicas`.
    pub min_instances: u32,
    /// The most replicas it may have.
    pub max_instances: u32,
}

impl Capacity {
    /// The capacity of a model needing nodes of `gpu_kind` (any, if
    /// `None`), between `min` and `max` replicas.
    pub fn new(gpu_kind: Option<&str>, min: u32, max: u32) -> Self {
        let hardware = gpu_kind.map_or_else(|| "gpu".to_owned(), |k| format!("gpu-{k}"));
        Capacity { hardware, min_instances: min, max_instances: max }
    }

    /// The hardware's display name.
    pub fn hardware_name(&self) -> String {
        match self.hardware.strip_prefix("gpu-") {
            Some(kind) => format!("GPU ({kind})"),
            None => "GPU (any node)".to_owned(),
        }
    }
}

/// How a model's prediction input is checked, and the schema its version
/// shows.
#[derive(Debug, Clone, PartialEq)]
pub enum InputRules {
    /// A language model's fields (`prompt`, `max_tokens`, …), checked when
    /// the prediction is created (422 naming the field).
    Llm,
    /// The model checks its own input when it runs (a cog model: a
    /// rejected input fails the prediction, naming the field); its OpenAPI
    /// schema when known.
    Own(Option<serde_json::Value>),
}

impl Model {
    /// Whether `account` may use it.
    pub fn allows(&self, account: &AccountId) -> bool {
        self.access.as_ref().is_none_or(|a| a.contains(account))
    }
}

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceError {
    /// The store could not be opened or recovered.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The configuration is inconsistent.
    #[error("invalid predictions configuration: {0}")]
    Config(String),
}

/// In-memory state of a prediction being run by this process: what SSE
/// readers, `Prefer: wait` and polling see before the store has it.
pub(crate) struct Live {
    pub state: Mutex<LiveState>,
    /// Bumped on every change; closed (sender dropped) when it ends.
    pub changed: watch::Sender<u64>,
    pub cancel: CancellationToken,
}

#[derive(Default)]
pub(crate) struct LiveState {
    pub status: Option<Status>,
    pub started_at: Option<Millis>,
    /// Every output item and log line so far, in order (SSE replays it).
    pub events: Vec<(Event, Value)>,
    pub output: Vec<Value>,
    pub logs: String,
}

impl LiveState {
    /// Whether this process runs the prediction: its run sets `status`
    /// when it starts, while a live entry made by a reader (`Prefer:
    /// wait`, an SSE stream) of a prediction another gateway runs keeps
    /// none — its progress is then the store's.
    pub fn runs_here(&self) -> bool {
        self.status.is_some()
    }
}

impl Inner {
    /// What runs predictions (and checks their adapters).
    pub(crate) fn executor(&self) -> &dyn Executor {
        &*self.executor
    }
}

/// How often a running prediction's output and logs so far are saved to
/// a shared store, where the other gateways of a fleet read them (a
/// client's `GET` or SSE stream may reach any of them).
const PROGRESS_EVERY: Millis = 500;

/// When a running prediction's progress is saved next: at most every
/// [`PROGRESS_EVERY`] while it has new output or logs, one save at a time
/// (so an older snapshot never lands after a newer one). Only with a
/// shared store: on one machine every reader is in this process.
struct Progress {
    shared: bool,
    due: Option<Millis>,
    saving: Option<tokio::task::JoinHandle<()>>,
}

impl Progress {
    fn new(shared: bool) -> Self {
        Progress { shared, due: None, saving: None }
    }

    /// Takes note of an executor event: output or logs make a save due.
    fn noted(&mut self, e: &ExecEvent) {
        if self.shared && self.due.is_none() && matches!(e, ExecEvent::Output(_) | ExecEvent::Log(_)) {
            self.due = Some(now() + PROGRESS_EVERY);
        }
    }

    /// Saves the output and logs so far, in a task of its own (best
    /// effort: the end writes them whole); with a save still running, it
    /// tries again a period later.
    ///
    /// # Cancel safety
    /// The save runs to its end whatever becomes of the run; the store
    /// takes it only while the prediction is `processing`, so one landing
    /// after the end changes nothing.
    fn save(&mut self, store: &Arc<dyn PredictionQueue>, id: &str, live: &Live) {
        if self.saving.as_ref().is_some_and(|s| !s.is_finished()) {
            self.due = Some(now() + PROGRESS_EVERY);
            return;
        }
        self.due = None;
        let (output, logs) = {
            let s = live.state.lock().expect("live state");
            (Value::Array(s.output.clone()), s.logs.clone())
        };
        let (store, id) = (store.clone(), id.to_owned());
        self.saving = Some(tokio::spawn(async move {
            if let Err(e) = store.save_progress(&id, &output, &logs) {
                tracing::debug!(prediction = %id, "progress not saved: {e}");
            }
        }));
    }
}

/// How often a gateway drops the cached archives no procedure wants any
/// more (deleted or expired, through any gateway of the fleet).
const PRUNE_SOURCES_EVERY: Duration = Duration::from_secs(60);

impl ProcedureState {
    /// Moves a `procedures.json` of an earlier version into the store,
    /// then every [`PRUNE_SOURCES_EVERY`] drops the cached archives that no
    /// procedure of the registry wants at that time.
    async fn sources_loop(self: Arc<Self>, stop: CancellationToken) {
        tokio::select! {
            _ = crate::procedures::adopt_legacy(&self.dir, &self.registry, &self.sources) => {}
            _ = stop.cancelled() => return,
        }
        loop {
            self.prune_sources();
            tokio::select! {
                _ = tokio::time::sleep(PRUNE_SOURCES_EVERY) => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    /// Drops the cached archives no live procedure wants (none if the
    /// registry cannot be read: a store that does not answer is no sign
    /// the procedures are gone).
    pub(crate) fn prune_sources(&self) {
        match self.registry.live_sources(now()) {
            Ok(live) => {
                for sha256 in self.sources.cached().into_iter().filter(|s| !live.contains(s)) {
                    self.sources.forget(&sha256);
                }
            }
            Err(e) => tracing::warn!("procedure sources not pruned: {e}"),
        }
    }
}

/// What runs procedures: the registry, the source cache, the runtime
/// model's key and the data directory they live in.
pub(crate) struct ProcedureState {
    pub registry: crate::procedures::Registry,
    pub sources: crate::procedures::Sources,
    pub runtime: String,
    pub dir: std::path::PathBuf,
}

pub(crate) struct Inner {
    /// The store, watched: every call's outcome tells `watched` whether
    /// it answers.
    pub store: Arc<dyn PredictionQueue>,
    /// The same store, for what its answers say: when this process may
    /// sweep, when it must renew its claims.
    watched: Arc<Watched>,
    pub models: BTreeMap<String, Model>,
    /// When this service started (Unix ms): the release every model and
    /// deployment shows is the config loaded then.
    pub started_ms: u64,
    /// Deployments declared in the config: name → model and settings.
    pub deployments: BTreeMap<String, (String, ModelSettings)>,
    /// Deployments made through the API, as last read from the store.
    pub book: crate::deployments::Book,
    pub api_keys: ApiKeys,
    pub config: PredictionsConfig,
    pub base_url: String,
    /// What webhooks may reach beyond public addresses.
    pub allow: Arc<AllowList>,
    executor: Arc<dyn Executor>,
    /// Procedures, when a runtime is configured.
    pub procedures: Option<Arc<ProcedureState>>,
    owner: String,
    live: Mutex<HashMap<String, Arc<Live>>>,
    /// Predictions this gateway put back once after losing their run.
    lost_once: Mutex<HashSet<String>>,
    wake: HashMap<String, Arc<Notify>>,
    deliveries: Notify,
    /// Webhooks and procedure sources go out through it.
    outbound: webhook_target::Outbound,
    stop: CancellationToken,
}

/// The predictions service: store, workers and HTTP API. Cheap to clone.
#[derive(Clone)]
pub struct Service {
    pub(crate) inner: Arc<Inner>,
}

impl Service {
    /// Opens the store (`backend`), recovers what a previous run left
    /// (see [`PredictionQueue::recover`]) and starts the workers and loops on
    /// the current tokio runtime. `base_url` is where clients reach the
    /// API (used unless `config.public_url` is set).
    pub fn start(
        backend: &Backend,
        config: PredictionsConfig,
        models: Vec<Model>,
        api_keys: ApiKeys,
        executor: Arc<dyn Executor>,
        base_url: &str,
    ) -> Result<Self, ServiceError> {
        // The server's loader validates too (naming file and line); this
        // keeps an unvalidated configuration from ever running.
        config.validate().map_err(|e| ServiceError::Config(e.to_string()))?;
        for m in &models {
            m.settings
                .validate()
                .map_err(|e| ServiceError::Config(format!("model `{}`: predictions.{e}", m.key)))?;
        }
        let allow = Arc::new(
            AllowList::parse(&config.webhook_allow)
                .map_err(|e| ServiceError::Config(e.within("webhook_allow").to_string()))?,
        );
        let ca = config.webhook_ca().map_err(|e| ServiceError::Config(e.to_string()))?;
        let proxy = config.webhook_proxy().map_err(|e| ServiceError::Config(e.to_string()))?;
        let outbound =
            webhook_target::Outbound::new(allow.clone(), ca.as_ref(), proxy.as_ref()).map_err(|e| {
                ServiceError::Config(format!("webhook client: {}", webhook_target::error_chain(&e)))
            })?;
        if config.durable_replicas > 0 && matches!(backend, Backend::Sqlite(_)) {
            return Err(ServiceError::Config(format!(
                "predictions.durable_replicas = {} asks Redis replicas to hold each create, but this server \
                 keeps its predictions in SQLite on its own disk (set `redis` to keep them in Redis)",
                config.durable_replicas
            )));
        }
        let grace_ms = config.webhook_secret_grace_s.saturating_mul(1000);
        let lease_ms = config.lease_s.max(1) * 1000;
        let watched = Arc::new(Watched::new(
            backend.open(lease_ms, grace_ms, now(), config.durable_replicas)?,
            lease_ms,
        ));
        let store: Arc<dyn PredictionQueue> = watched.clone();
        let models: BTreeMap<String, Model> = models.into_iter().map(|m| (m.key.clone(), m)).collect();
        let mut deployments = BTreeMap::new();
        for d in &config.deployments {
            let model = models.get(&d.model).ok_or_else(|| {
                ServiceError::Config(format!("deployment `{}` names unknown model `{}`", d.name, d.model))
            })?;
            deployments.insert(d.name.clone(), (d.model.clone(), d.settings.unwrap_or(model.settings)));
        }
        let base_url = config.public_url.clone().unwrap_or_else(|| base_url.to_owned());
        let base_url = base_url.trim_end_matches('/').to_owned();
        let procedures = match &config.procedures.runtime {
            None => None,
            Some(runtime) => {
                if !models.contains_key(runtime) {
                    return Err(ServiceError::Config(format!(
                        "procedures.runtime names `{runtime}`, which is not a model of this server"
                    )));
                }
                let dir = config.procedures.dir.clone().ok_or_else(|| {
                    ServiceError::Config("procedures need a data directory for their sources".into())
                })?;
                let io = |e: &dyn std::fmt::Display| ServiceError::Config(format!("procedures: {e}"));
                std::fs::create_dir_all(&dir).map_err(|e| io(&e))?;
                let registry =
                    crate::procedures::Registry::new(store.clone(), config.procedures.ephemeral_ttl_s);
                let sources =
                    crate::procedures::Sources::open(&dir, config.procedures.limits(), outbound.clone())
                        .map_err(|e| io(&e))?;
                Some(Arc::new(ProcedureState { registry, sources, runtime: runtime.clone(), dir }))
            }
        };
        let wake = models
            .keys()
            .flat_map(|m| [JobKind::Prediction.queue(m), JobKind::Training.queue(m)])
            .chain(procedures.as_ref().map(|_| JobKind::Procedure.queue("")))
            .map(|q| (q, Arc::new(Notify::new())))
            .collect();
        let inner = Arc::new(Inner {
            store,
            watched,
            models,
            started_ms: now(),
            deployments,
            book: Default::default(),
            api_keys,
            config,
            base_url,
            outbound,
            allow,
            executor,
            procedures,
            owner: format!("node-{}", crate::api::new_id()),
            live: Mutex::new(HashMap::new()),
            lost_once: Mutex::default(),
            wake,
            deliveries: Notify::new(),
            stop: CancellationToken::new(),
        });
        let recovered = {
            let i = inner.clone();
            inner.store.recover(now(), &|m| i.models.get(m).is_some_and(|m| m.settings.idempotent), &|r| {
                i.completed_delivery(r)
            })?
        };
        if !recovered.failed.is_empty() || !recovered.requeued.is_empty() {
            tracing::warn!(
                failed = recovered.failed.len(),
                requeued = recovered.requeued.len(),
                "recovered predictions interrupted by the last stop"
            );
        }
        let service = Service { inner };
        service.spawn_loops();
        Ok(service)
    }

    /// Stops the workers and loops (running predictions are left to
    /// recovery on the next start).
    pub fn stop(&self) {
        self.inner.stop.cancel();
    }

    /// The current webhook signing secret of `account` (created on first
    /// use).
    pub fn webhook_secret(&self, account: &AccountId) -> Result<String, StoreError> {
        Ok(self.inner.signing_secrets(account.as_str())?.swap_remove(0))
    }

    fn spawn_loops(&self) {
        for (queue, notify) in &self.inner.wake {
            let training = queue.starts_with("input:training:");
            let slots = if training { 1 } else { self.inner.config.async_slots.max(1) as usize };
            tokio::spawn(self.inner.clone().worker(queue.clone(), notify.clone(), slots));
        }
        tokio::spawn(self.inner.clone().cordon_loop());
        tokio::spawn(self.inner.clone().sweep_loop());
        tokio::spawn(self.inner.clone().prune_loop());
        tokio::spawn(self.inner.clone().delivery_loop());
        tokio::spawn(self.inner.clone().deployments_loop());
        if let Some(procedures) = &self.inner.procedures {
            tokio::spawn(procedures.clone().sources_loop(self.inner.stop.clone()));
        }
        if self.inner.store.shared() {
            tokio::spawn(self.inner.clone().watch_loop());
        }
    }
}

impl Inner {
    /// The settings that apply to `r`.
    pub fn settings(&self, r: &Record) -> ModelSettings {
        if let (JobKind::Procedure, Some(p)) = (r.kind, &self.procedures) {
            return self.models.get(&p.runtime).map(|m| m.settings).unwrap_or_default();
        }
        if let Some((_, s)) = r.deployment.as_ref().and_then(|d| self.deployments.get(d)) {
            return *s;
        }
        self.models.get(&r.model).map(|m| m.settings).unwrap_or_default()
    }

    /// The secrets that sign `account`'s webhooks now, the current one
    /// first (never empty).
    pub fn signing_secrets(&self, account: &str) -> Result<Vec<String>, StoreError> {
        if account.is_empty() {
            // A delivery whose prediction is gone has no account to sign for.
            return Err(StoreError::Corrupt { id: String::new(), what: "no account to sign for".into() });
        }
        let secrets = self.store.webhook_secrets(account, now(), &signing::new_secret)?;
        if secrets.is_empty() {
            return Err(StoreError::Corrupt {
                id: account.to_owned(),
                what: "no current webhook secret".into(),
            });
        }
        Ok(secrets)
    }

    /// Persists a new prediction (returning once it is durable) and wakes
    /// its model's worker.
    ///
    /// # Cancel safety
    /// Dropping the future may still leave the prediction stored (and
    /// run).
    pub async fn create(&self, record: &mut Record) -> Result<(), StoreError> {
        record.seq = self.store.enqueue_async(record).await?;
        if let Some(n) = self.wake.get(&record.kind.queue(&record.model)) {
            n.notify_one();
        }
        Ok(())
    }

    /// The live entry of `id`, created if missing.
    pub fn live(&self, id: &str) -> Arc<Live> {
        self.live
            .lock()
            .expect("live table")
            .entry(id.to_owned())
            .or_insert_with(|| {
                Arc::new(Live {
                    state: Mutex::new(LiveState::default()),
                    changed: watch::channel(0).0,
                    cancel: CancellationToken::new(),
                })
            })
            .clone()
    }

    /// Forgets the live entry of `id` once it has ended (a waiter may have
    /// created it after the prediction's end removed the last one).
    pub fn forget_if_ended(&self, r: &Record) {
        if r.status.is_terminal() {
            self.live.lock().expect("live table").remove(&r.id);
        }
    }

    /// The live entry of `id` if this process is running it.
    pub fn live_if_any(&self, id: &str) -> Option<Arc<Live>> {
        self.live.lock().expect("live table").get(id).cloned()
    }

    /// The record with in-flight output and logs folded in: this
    /// process's own, or on a fleet what the gateway running it saved.
    pub fn current(&self, id: &str) -> Result<Option<Record>, StoreError> {
        let Some(mut r) = self.store.get(id)? else { return Ok(None) };
        if r.status == Status::Processing {
            if let Some(live) = self.live_if_any(id) {
                let s = live.state.lock().expect("live state");
                if s.runs_here() {
                    r.output = Some(Value::Array(s.output.clone()));
                    r.logs = s.logs.clone();
                }
            }
        }
        Ok(Some(r))
    }

    /// Ends `r` (already carrying its terminal fields; `code` says why,
    /// unless it succeeded) unless it ended already; queues its
    /// `completed` webhook in the same transaction, wakes anyone watching
    /// and tells the executor ([`Executor::ended`]). `false` if another
    /// path ended it first.
    pub fn finish(&self, r: &Record, code: Option<ErrorCode>) -> Result<bool, StoreError> {
        let deliveries: Vec<Delivery> = self.completed_delivery(r).into_iter().collect();
        let done = self.store.finish(r, &deliveries)?;
        if done && !deliveries.is_empty() {
            self.deliveries.notify_one();
        }
        if done {
            self.executor.ended(r, code);
        }
        if let Some(live) = self.live.lock().expect("live table").remove(&r.id) {
            live.cancel.cancel();
            live.changed.send_modify(|v| *v += 1);
        }
        Ok(done)
    }

    /// The durable `completed` webhook of a terminal record.
    fn completed_delivery(&self, r: &Record) -> Option<Delivery> {
        self.delivery(r, Event::Completed)
    }

    fn delivery(&self, r: &Record, event: Event) -> Option<Delivery> {
        let url = r.webhook.clone()?;
        Some(Delivery {
            id: format!("msg_{}", crate::api::new_id()),
            prediction: r.id.clone(),
            event,
            url,
            body: r.to_json(&self.base_url, StatusView::Exact).to_string(),
            attempts: 0,
            next_at: now(),
            account: r.account.clone(),
        })
    }

    /// Claims and runs the queue's predictions, at most `slots` at once.
    async fn worker(self: Arc<Self>, queue: String, wake: Arc<Notify>, slots: usize) {
        let slots = Arc::new(Semaphore::new(slots));
        let lease = self.config.lease_s.max(1) * 1000;
        loop {
            let permit = tokio::select! {
                p = slots.clone().acquire_owned() => p.expect("never closed"),
                _ = self.stop.cancelled() => return,
            };
            match self.store.claim(&queue, &self.owner, now(), lease) {
                Ok(Some(record)) => {
                    let me = self.clone();
                    tokio::spawn(async move {
                        let id = record.id.clone();
                        if let Err(e) = me.clone().run(record).await {
                            // Its claim is no longer renewed: once the
                            // lease passes, a sweep (here or in another
                            // gateway) re-queues or fails it.
                            tracing::error!(prediction = %id, "prediction store failed, leaving the prediction to the sweep: {e}");
                            me.store.abandon(&me.owner, &id);
                        }
                        drop(permit);
                    });
                }
                Ok(None) => {
                    drop(permit);
                    tokio::select! {
                        _ = wake.notified() => {}
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = self.stop.cancelled() => return,
                    }
                }
                Err(e) => {
                    drop(permit);
                    log_store_error(&format!("claim from {queue}"), &e);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    /// Runs one claimed prediction to its end.
    async fn run(self: Arc<Self>, mut r: Record) -> Result<(), StoreError> {
        if r.status != Status::Starting {
            // Ended between enqueue and claim (canceled): nothing to run.
            return Ok(());
        }
        let settings = self.settings(&r);
        let limits = settings.limits(r.kind == JobKind::Training);
        let deadlines = Deadlines { per_prediction: r.deadline, lifetime: r.lifetime_deadline };
        if let Some(ending) = deadlines.at_dequeue(now()) {
            return self.end_durably(&mut r, ending).await;
        }
        let live = self.live(&r.id);
        let Ok(account) = r.account.parse::<AccountId>() else {
            let ending = Ending::new(
                Status::Failed,
                ErrorCode::Internal,
                format!("stored account `{}` is invalid", r.account),
            );
            return self.end_durably(&mut r, ending).await;
        };
        let (sink, mut events) = Sink::channel();
        let job = Job {
            id: r.id.clone(),
            kind: r.kind,
            model: r.model.clone(),
            account,
            input: r.input.clone(),
            created_at: r.created_at,
            procedure: None,
        };
        let exec_cancel = live.cancel.child_token();
        let mut exec = match r.kind {
            JobKind::Procedure => self.clone().execute_procedure(job, sink, exec_cancel.clone()),
            _ => self.executor.execute(job, sink, exec_cancel.clone()),
        };
        let mut throttle = Throttle::new(r.webhook_events);
        let mut deadline = deadlines.before_start();
        let mut started = false;
        let mut progress = Progress::new(self.store.shared());
        loop {
            let wait_deadline = deadline.map(|(at, _)| at.saturating_sub(now()));
            let wait_webhook = throttle.poll_timeout().map(|at| at.saturating_sub(now()));
            let wait_progress = progress.due.map(|at| at.saturating_sub(now()));
            let sleep = |ms: Option<Millis>| async move {
                match ms {
                    Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                _ = live.cancel.cancelled() => {
                    exec_cancel.cancel();
                    let ending = Ending::new(Status::Canceled, ErrorCode::Canceled, "canceled by the user");
                    return self.end_durably(&mut r, ending).await;
                }
                _ = sleep(wait_deadline) => {
                    exec_cancel.cancel();
                    let source = deadline.map_or(DeadlineSource::PredictTimeout, |(_, s)| s);
                    let ending = if started { Ending::expired_while_running(source) } else { Ending::expired_before_start(source) };
                    return self.end_durably(&mut r, ending).await;
                }
                _ = sleep(wait_webhook) => {
                    if let Some(event) = throttle.handle_timeout(now()) {
                        self.send_intermediate(&r, &live, event);
                    }
                }
                _ = sleep(wait_progress) => progress.save(&self.store, &r.id, &live),
                result = &mut exec => {
                    // Drain what the executor reported before it returned.
                    while let Ok(e) = events.try_recv() {
                        self.apply(&mut r, &live, &mut throttle, e, &mut started, &limits, &deadlines, &mut deadline).await?;
                    }
                    let ending = match result {
                        Ok(output) if started => {
                            r.output = Some(output);
                            r.logs = live.state.lock().expect("live state").logs.clone();
                            Ending::succeeded()
                        }
                        Ok(_) => Ending::new(Status::Failed, ErrorCode::Internal, "the executor returned without starting"),
                        Err(ExecError::Canceled) => Ending::new(Status::Canceled, ErrorCode::Canceled, "canceled"),
                        Err(ExecError::Failed(e)) => Ending::new(Status::Failed, ErrorCode::EngineError, e),
                        Err(e @ ExecError::Answered { .. }) => {
                            let message = e.to_string();
                            if let ExecError::Answered { status, body } = e {
                                r.output = Some(crate::request::Answer { status, body: Some(body) }.to_value());
                            }
                            Ending::new(Status::Failed, ErrorCode::EngineError, message)
                        }
                        Err(ExecError::Lost(e)) => {
                            if self.run_again(&r, &e).await? {
                                return Ok(());
                            }
                            Ending::new(Status::Failed, ErrorCode::ReplicaFailed, format!("{e} (twice)"))
                        }
                    };
                    return self.end_durably(&mut r, ending).await;
                }
                Some(e) = events.recv() => {
                    progress.noted(&e);
                    if !self.apply(&mut r, &live, &mut throttle, e, &mut started, &limits, &deadlines, &mut deadline).await? {
                        // It ended elsewhere (canceled while waiting for capacity).
                        exec_cancel.cancel();
                        self.live.lock().expect("live table").remove(&r.id);
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Runs a procedure's job: its source made ready (fetched, held to the
    /// hash recorded at its creation and checked, or found in the cache),
    /// then the executor runs it on the procedures runtime, serving it the
    /// archive, with the context naming its hash and the caller's
    /// credentials. A procedure deleted or expired since the run
    /// was created, or a source refused, fails the run with that error.
    ///
    /// # Cancel safety
    /// Dropping the future drops the executor's run (see [`Executor`]) and
    /// leaves the source cache whole.
    fn execute_procedure(
        self: Arc<Self>,
        mut job: Job,
        sink: Sink,
        cancel: CancellationToken,
    ) -> crate::executor::ExecFuture {
        Box::pin(async move {
            let state = self
                .procedures
                .clone()
                .ok_or_else(|| ExecError::Failed("procedures are not enabled on this server".into()))?;
            let p =
                state.registry.runnable(&job.model, now()).map_err(|e| ExecError::Failed(e.to_string()))?;
            sink.log(format!("procedure {}: source {}", p.key(), p.version()));
            let archive = state
                .sources
                .prepare(&p.source_url, Some(&p.source_sha256))
                .await
                .map_err(|e| ExecError::Failed(e.to_string()))?;
            // The caller's credentials: a key of its account (on an open
            // server any token is accepted; the account's name stands in).
            let token = match self.api_keys.key_for(&job.account) {
                Some(k) => k.to_owned(),
                None if self.api_keys.is_open() => job.account.as_str().to_owned(),
                None => {
                    return Err(ExecError::Failed(format!(
                        "no API key acts for the account `{}` any more, so the procedure cannot call the API as it",
                        job.account
                    )))
                }
            };
            job.procedure = Some(crate::executor::ProcedureRun {
                runtime: state.runtime.clone(),
                source: archive.path,
                context: serde_json::json!({
                    "procedure_source_sha256": archive.sha256,
                    "replicate_api_token": token,
                    "replicate_api_base_url": self.base_url,
                }),
            });
            self.executor.execute(job, sink, cancel).await
        })
    }

    /// A run lost with what ran it: the prediction goes back to its queue
    /// (output and logs so far dropped) to run once more, unless this
    /// gateway already did so for it. Whether it went back.
    ///
    /// # Cancel safety
    /// Dropping the future may leave it re-queued or not (it is then
    /// swept once its claim lapses).
    async fn run_again(&self, r: &Record, why: &str) -> Result<bool, StoreError> {
        if !self.lost_once.lock().expect("lost set").insert(r.id.clone()) {
            return Ok(false);
        }
        if let Some(live) = self.live.lock().expect("live table").remove(&r.id) {
            let mut s = live.state.lock().expect("live state");
            *s = LiveState::default();
        }
        let again = self.durably(&r.id, "its return to the queue", || self.store.requeue(&r.id)).await?;
        if again {
            tracing::warn!(prediction = %r.id, "{why}: running it once more");
            if let Some(n) = self.wake.get(&r.kind.queue(&r.model)) {
                n.notify_one();
            }
        }
        Ok(again)
    }

    /// Applies one executor event. `false` when the prediction turned out
    /// to have ended elsewhere.
    ///
    /// # Cancel safety
    /// Dropping the future while it stores the start may leave the start
    /// stored or not; the run is over either way (its claim lapses).
    #[allow(clippy::too_many_arguments)]
    async fn apply(
        &self,
        r: &mut Record,
        live: &Live,
        throttle: &mut Throttle,
        event: ExecEvent,
        started: &mut bool,
        limits: &crate::lifecycle::Limits,
        deadlines: &Deadlines,
        deadline: &mut Option<(Millis, DeadlineSource)>,
    ) -> Result<bool, StoreError> {
        let t = now();
        let kind = match event {
            ExecEvent::Started => {
                if *started {
                    return Ok(true);
                }
                let mut running = r.clone();
                running.status = Status::Processing;
                running.started_at = Some(t);
                let webhook = match throttle.handle(t, Event::Start) {
                    Decision::Send => self.delivery(&running, Event::Start),
                    _ => None,
                };
                let webhook: Vec<Delivery> = webhook.into_iter().collect();
                let stored = self.durably(&r.id, "its start", || self.store.start(&r.id, t, &webhook));
                if !stored.await? {
                    return Ok(false);
                }
                *r = running;
                *started = true;
                *deadline = Some(deadlines.while_running(limits, t));
                {
                    let mut s = live.state.lock().expect("live state");
                    s.status = Some(Status::Processing);
                    s.started_at = Some(t);
                }
                if !webhook.is_empty() {
                    self.deliveries.notify_one();
                }
                live.changed.send_modify(|v| *v += 1);
                return Ok(true);
            }
            ExecEvent::Output(item) => {
                let mut s = live.state.lock().expect("live state");
                s.output.push(item.clone());
                s.events.push((Event::Output, item));
                Event::Output
            }
            ExecEvent::Log(line) => {
                let mut s = live.state.lock().expect("live state");
                s.logs.push_str(&line);
                s.logs.push('\n');
                s.events.push((Event::Logs, Value::String(line)));
                Event::Logs
            }
        };
        live.changed.send_modify(|v| *v += 1);
        if throttle.handle(t, kind) == Decision::Send {
            self.send_intermediate(r, live, kind);
        }
        Ok(true)
    }

    /// Sends an `output`/`logs` webhook once, best effort (the next one or
    /// `completed` supersedes it).
    fn send_intermediate(&self, r: &Record, live: &Live, event: Event) {
        let Some(url) = r.webhook.clone() else { return };
        let mut snapshot = r.clone();
        {
            let s = live.state.lock().expect("live state");
            snapshot.output = Some(Value::Array(s.output.clone()));
            snapshot.logs = s.logs.clone();
        }
        let body = snapshot.to_json(&self.base_url, StatusView::Exact).to_string();
        let id = format!("msg_{}", crate::api::new_id());
        let secrets = match self.signing_secrets(&r.account) {
            Ok(s) => s,
            Err(e) => return tracing::error!(prediction = %r.id, "webhook secret: {e}"),
        };
        let outbound = self.outbound.clone();
        tokio::spawn(async move {
            if let Err(e) = post_webhook(&outbound, &secrets, &id, &url, body).await {
                tracing::debug!(%url, ?event, "intermediate webhook not delivered: {e}");
            }
        });
    }

    /// [`Inner::end`] for a prediction this process ran, through
    /// [`Inner::durably`]: a finished run is not lost to a store that is
    /// unreachable for a while. Another failure of the store, lasting a
    /// lease, goes to the caller, who abandons the claim.
    ///
    /// # Cancel safety
    /// Dropping the future may leave the end stored or not.
    async fn end_durably(&self, r: &mut Record, ending: Ending) -> Result<(), StoreError> {
        let id = r.id.clone();
        self.durably(&id, "its end", || self.end(r, ending.clone())).await.map(drop)
    }

    /// Runs `op`, a store write for a prediction this process runs (its
    /// start, its end, its return to the queue), until the store takes
    /// it, backing off from 50 ms to 2 s between attempts.
    ///
    /// While the store is unreachable ([`StoreError::Unavailable`]) it
    /// waits for as long as that lasts: this process's claims cannot be
    /// swept meanwhile (nobody sweeps until the store has answered for a
    /// lease, and this process renews its claims as soon as it answers,
    /// see [`Inner::sweep_loop`]), and giving up would drop a run that
    /// happened, to be run again. Any other failure is retried for up to
    /// a lease and then returned. Stopping the service ends the wait with
    /// the last error.
    ///
    /// # Cancel safety
    /// Dropping the future stops the retries; the last attempt may or may
    /// not have been stored (every store call is safe to repeat).
    async fn durably<T>(
        &self,
        id: &str,
        what: &str,
        mut op: impl FnMut() -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let give_up = tokio::time::Instant::now() + Duration::from_secs(self.config.lease_s.max(1));
        let mut wait = Duration::from_millis(50);
        loop {
            let e = match op() {
                Ok(v) => return Ok(v),
                Err(e) if self.stop.is_cancelled() => return Err(e),
                Err(e) if e.is_unavailable() => {
                    tracing::debug!(prediction = %id, "cannot store {what} yet, retrying in {wait:?}: {e}");
                    e
                }
                Err(e) if tokio::time::Instant::now() + wait > give_up => return Err(e),
                Err(e) => {
                    tracing::warn!(prediction = %id, "cannot store {what} yet, retrying in {wait:?}: {e}");
                    e
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = self.stop.cancelled() => return Err(e),
            }
            wait = (wait * 2).min(Duration::from_secs(2));
        }
    }

    /// Ends `r` with `ending` at now. A queued request that ends without
    /// an answer of its engine (a deadline, a lost run, a model that could
    /// not start) keeps the status its follow-up answers with: that of
    /// its error code, as a synchronous request ending so is answered.
    fn end(&self, r: &mut Record, ending: Ending) -> Result<bool, StoreError> {
        r.status = ending.status;
        r.completed_at = Some(now());
        if ending.status != Status::Succeeded {
            r.error = Some(ending.error);
            if let Some(live) = self.live_if_any(&r.id) {
                let s = live.state.lock().expect("live state");
                if !s.output.is_empty() {
                    r.output = Some(Value::Array(s.output.clone()));
                }
                r.logs = s.logs.clone();
            }
            if let (JobKind::Request, None, Some(code)) = (r.kind, &r.output, ending.code) {
                r.output = Some(crate::request::Answer { status: code.http_status(), body: None }.to_value());
            }
        }
        self.finish(r, ending.code)
    }

    /// Ends waiting predictions whose deadline passed, even when no worker
    /// is free to dequeue them (Replicate's cordon loop), every second.
    async fn cordon_loop(self: Arc<Self>) {
        loop {
            let t = now();
            match self.store.expired_waiting(t, 256) {
                Ok(expired) => {
                    for mut r in expired {
                        let d = Deadlines { per_prediction: r.deadline, lifetime: r.lifetime_deadline };
                        if let Some(ending) = d.at_dequeue(t) {
                            if let Err(e) = self.end(&mut r, ending) {
                                log_store_error(&format!("cordon of {}", r.id), &e);
                            }
                        }
                    }
                }
                Err(e) => log_store_error("cordon", &e),
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = self.stop.cancelled() => return,
            }
        }
    }

    /// With a store other gateways share, a prediction may end through
    /// another gateway (a cancel there, or run by its worker) while this
    /// one runs it or has clients waiting on it: every 250 ms, each live
    /// entry whose record has ended is cancelled here (its run stops) and
    /// its waiters are woken (they read the end from the store).
    async fn watch_loop(self: Arc<Self>) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                _ = self.stop.cancelled() => return,
            }
            let watched: Vec<(String, Arc<Live>)> =
                self.live.lock().expect("live table").iter().map(|(id, l)| (id.clone(), l.clone())).collect();
            for (id, live) in watched {
                match self.store.get(&id) {
                    Ok(Some(r)) if !r.status.is_terminal() => {}
                    Ok(_) => {
                        live.cancel.cancel();
                        live.changed.send_modify(|v| *v += 1);
                    }
                    Err(e) => log_store_error(&format!("watch of {id}"), &e),
                }
            }
        }
    }

    /// Renews this process's claims every `lease_s / 3` — and at once
    /// when the store answers again after being unreachable — and handles
    /// other owners' claims that went a lease without renewal, but only
    /// once the store has answered every call for a lease: after an
    /// outage every claim has gone that long, its owner alive or not, and
    /// live owners renew with their first answer, before that
    /// (`crate::reachability`; a shared Redis also holds sweeps back by
    /// itself after a stall, see `store::redis`).
    async fn sweep_loop(self: Arc<Self>) {
        let lease = self.config.lease_s.max(1) * 1000;
        loop {
            let t = now();
            if let Err(e) = self.store.heartbeat(&self.owner, t, lease) {
                log_store_error("lease heartbeat", &e);
            }
            if self.watched.may_sweep() {
                match self.store.sweep_expired_claims(t) {
                    Ok(stale) => {
                        for mut r in stale {
                            let result = if self.settings(&r).idempotent {
                                self.store.requeue(&r.id).map(drop)
                            } else {
                                let ending = Ending::new(
                                    Status::Failed,
                                    ErrorCode::ReplicaFailed,
                                    "the worker running this prediction stopped renewing its lease",
                                );
                                self.end(&mut r, ending).map(drop)
                            };
                            if let Err(e) = result {
                                log_store_error(&format!("sweep of {}", r.id), &e);
                            }
                        }
                    }
                    Err(e) => log_store_error("sweep", &e),
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(lease / 3)) => {}
                // The store answers again: renew now, before anyone may sweep.
                _ = self.watched.returned() => {}
                _ = self.stop.cancelled() => return,
            }
        }
    }

    /// Reads the API's deployments from the store and applies their
    /// bounds now, in a task of its own: a caller that stops waiting
    /// leaves it to finish.
    pub(crate) async fn reconcile_deployments(self: &Arc<Self>) -> Result<(), StoreError> {
        let inner = self.clone();
        let pass = tokio::spawn(async move {
            crate::deployments::reconcile(&*inner.store, &inner.book, &*inner.executor).await
        });
        pass.await.expect("a reconcile pass does not panic")
    }

    /// Applies the API's deployments' bounds at start and every
    /// [`RECONCILE_EVERY`](crate::deployments::RECONCILE_EVERY)
    /// (level-triggered: see [`crate::deployments`]).
    async fn deployments_loop(self: Arc<Self>) {
        loop {
            if let Err(e) = self.reconcile_deployments().await {
                log_store_error("deployments", &e);
            }
            tokio::select! {
                _ = tokio::time::sleep(crate::deployments::RECONCILE_EVERY) => {}
                _ = self.stop.cancelled() => return,
            }
        }
    }

    /// Prunes stuck queue entries (over 24 h) and removes data past the
    /// retention period, at start and hourly.
    async fn prune_loop(self: Arc<Self>) {
        loop {
            let t = now();
            match self.store.prune_queue(t.saturating_sub(24 * 3600 * 1000), t) {
                Ok(ids) if !ids.is_empty() => tracing::warn!(count = ids.len(), "pruned stuck queue entries"),
                Ok(_) => {}
                Err(e) => log_store_error("prune", &e),
            }
            if let Err(e) = self.store.remove_data(t.saturating_sub(self.config.retention_s * 1000)) {
                log_store_error("retention", &e);
            }
            let period = Duration::from_secs(self.config.retention_s.clamp(1, 3600));
            tokio::select! {
                _ = tokio::time::sleep(period) => {}
                _ = self.stop.cancelled() => return,
            }
        }
    }

    /// Delivers durable webhooks, retrying with back-off; resumes after a
    /// restart from what the store holds.
    async fn delivery_loop(self: Arc<Self>) {
        let in_flight: Arc<Mutex<HashSet<String>>> = Arc::default();
        let limit = Arc::new(Semaphore::new(32));
        loop {
            let t = now();
            let due = self.store.due_deliveries(t, 64).unwrap_or_else(|e| {
                log_store_error("webhook deliveries", &e);
                Vec::new()
            });
            for d in due {
                if !in_flight.lock().expect("in flight").insert(d.id.clone()) {
                    continue;
                }
                let Ok(permit) = limit.clone().acquire_owned().await else { return };
                let (me, in_flight) = (self.clone(), in_flight.clone());
                tokio::spawn(async move {
                    let ok = match me.signing_secrets(&d.account) {
                        Ok(secrets) => {
                            post_webhook(&me.outbound, &secrets, &d.id, &d.url, d.body.clone()).await
                        }
                        Err(e) => Err(format!("no signing secret: {e}")),
                    };
                    let next = match &ok {
                        Ok(()) => None,
                        Err(e) => {
                            let next =
                                retry_delay(&me.config.retry(), d.attempts + 1).map(|delay| now() + delay);
                            tracing::warn!(webhook = %d.id, url = %d.url, attempt = d.attempts + 1, "webhook failed: {e}; {}",
                                if next.is_some() { "will retry" } else { "giving up" });
                            next
                        }
                    };
                    if let Err(e) = me.store.delivery_attempted(&d.id, ok.is_ok(), next) {
                        log_store_error("webhook delivery", &e);
                    }
                    in_flight.lock().expect("in flight").remove(&d.id);
                    me.deliveries.notify_one();
                    drop(permit);
                });
            }
            let next = self.store.next_delivery_at().ok().flatten();
            let wait = next.map_or(Duration::from_secs(1), |at| {
                Duration::from_millis(at.saturating_sub(now()).clamp(5, 1000))
            });
            tokio::select! {
                _ = self.deliveries.notified() => {}
                _ = tokio::time::sleep(wait) => {}
                _ = self.stop.cancelled() => return,
            }
        }
    }
}

/// Logs a store failure of a background loop: an unreachable store at
/// debug level (the watched store logs the outage once, and its end),
/// anything else as an error.
fn log_store_error(what: &str, e: &StoreError) {
    match e.is_unavailable() {
        true => tracing::debug!("{what}: {e}"),
        false => tracing::error!("{what}: {e}"),
    }
}

/// POSTs one webhook signed with each of `secrets`; `Ok` on a 2xx
/// answer. Anything else fails the attempt: a 3xx too, since redirects
/// are not followed (they could point anywhere). The destination is
/// checked again first ([`webhook_target::Outbound::check`]): reqwest
/// resolves names through the vetting resolver, but connects to IP
/// literals without asking it, and through a proxy asks it nothing.
async fn post_webhook(
    outbound: &webhook_target::Outbound,
    secrets: &[String],
    id: &str,
    url: &str,
    body: String,
) -> Result<(), String> {
    outbound.check(url).await.map_err(|e| format!("refused destination: {e}"))?;
    let http = outbound.http();
    let ts = now() / 1000;
    let signature = signing::sign_all(secrets, id, ts, &body);
    let response = http
        .post(url)
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .header("webhook-timestamp", ts.to_string())
        .header("webhook-signature", signature)
        .body(body)
        .send()
        .await
        .map_err(|e| webhook_target::error_chain(&e))?;
    if response.status().is_success() {
        Ok(())
    } else {
        Err(format!("answered {}", response.status()))
    }
}
