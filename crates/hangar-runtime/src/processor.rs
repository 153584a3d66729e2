//! A model's processor: the live driver of its [`Admission`] state.
//!
//! Handlers call [`Processor::admit`] and get a [`Lease`] — a permit on one
//! ready replica — either at once or when one frees; the lease gives the
//! permit back when dropped, so a request that ends in any way (done,
//! failed, client gone) frees its slot. A full line answers
//! [`AdmitError::QueueFull`] (HTTP 429), a wait past its deadline
//! [`AdmitError::Timeout`] (504). A caller that stops waiting (its client
//! disconnected, so the handler future is dropped) leaves the line at once.
//! While the controller says the model cannot run
//! ([`Processor::set_unavailable`]), a fail-fast request (synchronous)
//! that finds no permit is answered [`AdmitError::Unavailable`] (503 with
//! `Retry-After`) at once; a patient one (an async prediction) waits.
//!
//! The admission policy itself is `hangar-queue`'s sans-IO state machine;
//! this module only adds the clock, a timer task for deadlines, and the
//! channels that wake waiting handlers.
//!
//! It also keeps the instance monitor ([`InstanceMonitor`]) of each
//! replica this process runs, since it is where permits are granted and
//! given back: a grant and a release bump the monitor of the permit's
//! replica under the lock they already hold (no lock, no allocation of
//! their own). The node tells it each replica's phase
//! ([`Processor::replica_phase`]); a fleet's agent, which holds no permits,
//! samples its engines' own counts instead ([`Processor::sample_in_flight`]).
//!
//! # Adapters
//! A request that runs with a LoRA adapter ([`Wait::adapter`]) is granted a
//! permit like any other, on the replica the chooser picks — which is also
//! where the chooser's adapter slots ([`hangar_router::AdapterSlots`])
//! acquire its adapter. [`Processor::admit_with`] then waits, holding the
//! permit, until the slots say the adapter is loaded there, and only then
//! hands out the lease. The slots' steps (load, unload) are carried out by
//! the [`AdapterDriver`] the runtime installs ([`Processor::set_adapter_driver`]),
//! one at a time per replica, each in a task of its own that reports back;
//! the processor only relays: the slots decide.

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hangar_core::instance::{InstanceMonitor, InstanceReport};
use hangar_core::{AccountId, BlockHash, Millis, ReplicaId, ReplicaPhase, RequestId};
pub use hangar_queue::Patience;
use hangar_queue::{Action, Admission, AdmissionConfig, Chooser, FirstFree, Submitted};
use hangar_router::{AdapterAction, ReplicaChooser, SlotEvent, SlotStep};
use rustc_hash::FxHashMap;
use tokio::sync::{oneshot, Notify};

/// A chooser a processor drives: any [`Chooser`], and for adapters the
/// router's own ([`ReplicaChooser`]), whose slots decide adapter steps.
pub trait ProcessorChooser: Chooser + Send {
    /// The router's chooser, when this is one: only it holds adapter slots.
    fn adapters(&mut self) -> Option<&mut ReplicaChooser> {
        None
    }
}

impl ProcessorChooser for ReplicaChooser {
    fn adapters(&mut self) -> Option<&mut ReplicaChooser> {
        Some(self)
    }
}

impl ProcessorChooser for FirstFree {}

/// Carries out one adapter step on a replica's engine (vLLM's
/// `/v1/load_lora_adapter` or `/v1/unload_lora_adapter`), answering why it
/// failed if it did. Installed by the runtime, which knows engines' URLs
/// and where adapters' files are. Called with the replica, the
/// *generation* of its slots here (new each time the replica becomes
/// ready: the slots start empty while the engine keeps what it loaded)
/// and the step.
pub type AdapterDriver = Arc<
    dyn Fn(
            ReplicaId,
            u64,
            SlotStep,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>>
        + Send
        + Sync,
>;

/// Where a request granted with an adapter stands with it.
enum AdapterWait {
    /// Its lease waits for the answer.
    Waiting { replica: ReplicaId, tx: oneshot::Sender<Result<(), AdmitError>> },
    /// The answer came before its lease asked (an adapter already loaded).
    Answered(Result<(), AdmitError>),
}

/// A processor's line and permits at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    /// Requests waiting for a permit.
    pub waiting: usize,
    /// Permits out.
    pub in_use: u32,
    /// Permits of ready replicas, in all.
    pub permits: u32,
    /// The line's settings.
    pub config: AdmissionConfig,
    /// What went through it since it started.
    pub counters: Counters,
}

/// Cumulative counts of a processor, for the scaler's windows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Requests that asked for a permit.
    pub arrivals: u64,
    /// Permits given back (requests that ran, however they ended).
    pub completions: u64,
    /// Requests turned away because the line was full (429).
    pub rejected: u64,
    /// Milliseconds permits were held, summed over requests.
    pub busy_ms: u64,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdmitError {
    /// Every permit is taken and the line is full (HTTP 429).
    #[error("the model is at capacity: {capacity} requests already wait")]
    QueueFull {
        /// The line's capacity.
        capacity: usize,
    },
    /// The request waited past its deadline (HTTP 504).
    #[error("no replica became free within the request's timeout")]
    Timeout,
    /// The request will not be served (HTTP 503).
    #[error("{0}")]
    Failed(String),
    /// The model cannot run now — no replica is up and the controller
    /// finds no room for one — and the request asked to fail fast (HTTP
    /// 503 with `Retry-After`: it may succeed later). Never for a patient
    /// request.
    #[error("{reason}")]
    Unavailable {
        /// Why, as the controller said.
        reason: String,
    },
    /// The request's adapter could not be loaded on the replica it was
    /// granted (HTTP 502 once no other replica can take it: nothing was
    /// sent, so a caller may ask again, avoiding that one).
    #[error("{why}")]
    AdapterFailed {
        /// The replica the load failed on, if it still held the request.
        replica: Option<ReplicaId>,
        /// What failed.
        why: String,
    },
    /// The replica the request was granted left while the request's
    /// adapter was loading there. Nothing was sent to it, so the caller
    /// asks again (another replica, or this one back); HTTP 502 only if
    /// it cannot.
    #[error("{0}")]
    AdapterReplicaLeft(String),
    /// The request's adapter can never run here (HTTP 400).
    #[error("{0}")]
    AdapterRefused(String),
}

type Waiter = oneshot::Sender<Result<ReplicaId, AdmitError>>;

struct State {
    admission: Admission,
    /// Picks among free replicas, for immediate leases and later
    /// dispatches alike.
    chooser: Box<dyn ProcessorChooser>,
    waiters: FxHashMap<RequestId, Waiter>,
    /// Requests granted with an adapter, until their lease takes the answer.
    adapter_waits: FxHashMap<RequestId, AdapterWait>,
    /// Why the last adapter step on a replica failed, for the requests
    /// its load failed.
    step_errors: FxHashMap<ReplicaId, String>,
    /// The generation of each ready replica's adapter slots, and the last
    /// one given.
    slots: FxHashMap<ReplicaId, u64>,
    slots_given: u64,
    next_id: u64,
    counters: Counters,
    /// The instance monitor of each replica this process runs (none for
    /// the remote replicas of a fleet's gateway: their agents keep them).
    monitors: FxHashMap<ReplicaId, InstanceMonitor>,
}

impl State {
    /// A permit on `replica` was granted (`true`) or given back.
    fn bump(&mut self, now: Millis, replica: ReplicaId, granted: bool) {
        if let Some(m) = self.monitors.get_mut(&replica) {
            match granted {
                true => m.request_started(now),
                false => m.request_ended(now),
            }
        }
    }

    /// `request` ended: its permit goes back and the chooser forgets it
    /// (releasing its adapter), and any adapter answer for it goes too.
    fn end(&mut self, now: Millis, request: RequestId) {
        self.admission.release(now, request, &mut *self.chooser);
        self.chooser.done(request);
        self.adapter_waits.remove(&request);
    }

    /// Tells `request`'s lease how its adapter load went, or keeps the
    /// answer until the lease asks.
    fn answer_adapter(&mut self, request: RequestId, answer: Result<(), AdmitError>) {
        match self.adapter_waits.remove(&request) {
            Some(AdapterWait::Waiting { tx, .. }) => drop(tx.send(answer)),
            _ => drop(self.adapter_waits.insert(request, AdapterWait::Answered(answer))),
        }
    }
}

/// Called (outside the processor's lock) when a request has to wait for a
/// permit.
pub type OnQueued = Box<dyn Fn() + Send + Sync>;

struct Shared {
    state: Mutex<State>,
    on_queued: Option<OnQueued>,
    /// Itself, for the tasks that carry out adapter steps to report back.
    me: std::sync::Weak<Shared>,
    /// Carries out adapter steps; none until the runtime installs it.
    adapter_driver: std::sync::OnceLock<AdapterDriver>,
    epoch: Instant,
    /// Wakes the timer task when the earliest deadline may have changed, or
    /// when the processor is dropped so the task can end.
    timer: Arc<Notify>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.timer.notify_one();
    }
}

/// One model's admission, driven live. Cheap to clone.
#[derive(Clone)]
pub struct Processor {
    shared: Arc<Shared>,
}

/// A permit on a replica, given back when dropped.
pub struct Lease {
    shared: Arc<Shared>,
    /// The request id the permit was granted to.
    pub request: RequestId,
    /// The replica to send the request to.
    pub replica: ReplicaId,
    /// When the permit was granted, on the processor's clock.
    granted_at: Millis,
    /// The request's position in the line when it joined it; `None` when
    /// a permit was free on arrival.
    pub queued_at: Option<NonZeroU32>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease").field("request", &self.request).field("replica", &self.replica).finish()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let granted_at = self.granted_at;
        self.shared.with(|s, now| {
            s.bump(now, self.replica, false);
            s.end(now, self.request);
            s.counters.completions += 1;
            s.counters.busy_ms += now.saturating_sub(granted_at);
        });
    }
}

impl Shared {
    fn now(&self) -> Millis {
        self.epoch.elapsed().as_millis() as Millis
    }

    /// Runs `f` on the state, then delivers every decision it caused.
    fn with<T>(&self, f: impl FnOnce(&mut State, Millis) -> T) -> T {
        let mut guard = self.state.lock().expect("processor state lock");
        let state = &mut *guard;
        let now = self.now();
        let out = f(state, now);
        while let Some(action) = state.admission.poll_action() {
            let (request, result) = match action {
                Action::Dispatch(p) => (p.request, Ok(p.replica)),
                Action::Expired(r) => (r, Err(AdmitError::Timeout)),
                Action::Failed { request, reason } => (request, Err(AdmitError::Failed(reason))),
                Action::Unavailable { request, reason } => (request, Err(AdmitError::Unavailable { reason })),
            };
            let delivered = state.waiters.remove(&request).is_some_and(|w| w.send(result.clone()).is_ok());
            match (delivered, &result) {
                (true, Ok(replica)) => state.bump(now, *replica, true),
                // The waiter left between dispatch and delivery: give the
                // permit straight back.
                (false, Ok(_)) => drop(state.admission.release(now, request, &mut *state.chooser)),
                (_, Err(_)) => {}
            }
            if !delivered || result.is_err() {
                state.chooser.done(request);
            }
        }
        self.drain_adapters(state);
        out
    }

    /// Carries out the adapter slots' steps and answers their requests.
    fn drain_adapters(&self, state: &mut State) {
        loop {
            let Some(action) = state.chooser.adapters().and_then(ReplicaChooser::poll_adapter) else {
                return;
            };
            match action {
                AdapterAction::Step { on, step } => {
                    let slots = state.slots.get(&on).copied().unwrap_or_default();
                    self.run_step(on, slots, step)
                }
                AdapterAction::Answer(SlotEvent::Ready(request)) => state.answer_adapter(request, Ok(())),
                AdapterAction::Answer(SlotEvent::Failed { request, adapter }) => {
                    let replica = state.admission.holder(request);
                    let why = replica.and_then(|r| state.step_errors.get(&r)).map_or("", String::as_str);
                    let on = replica.map(|r| format!(" on replica {r}")).unwrap_or_default();
                    let why = format!("adapter `{adapter}` could not be loaded{on}: {why}");
                    state.answer_adapter(request, Err(AdmitError::AdapterFailed { replica, why }));
                }
            }
        }
    }

    /// Spawns the task that carries out `step` on `replica` and reports
    /// how it went. Without a driver (never, once adapters are in use) the
    /// step fails at once.
    fn run_step(&self, replica: ReplicaId, slots: u64, step: SlotStep) {
        let me = self.me.clone();
        let run = self.adapter_driver.get().map(|driver| driver(replica, slots, step));
        tokio::spawn(async move {
            let done = match run {
                Some(run) => run.await,
                None => Err("this server carries out no adapter steps".to_owned()),
            };
            let Some(shared) = me.upgrade() else { return };
            shared.with(|s, _| {
                if let Err(why) = &done {
                    s.step_errors.insert(replica, why.clone());
                }
                if let Some(chooser) = s.chooser.adapters() {
                    chooser.adapter_step_done(replica, done.is_ok());
                }
            });
        });
    }
}

/// Removes a waiting request from the line if its caller stops waiting.
struct WaitGuard {
    shared: Arc<Shared>,
    request: RequestId,
    armed: bool,
}

impl Drop for WaitGuard {
    fn drop(&mut self) {
        if self.armed {
            self.shared.with(|s, now| {
                s.waiters.remove(&self.request);
                // Dispatched and delivered, but its caller left before
                // taking the lease: the permit it held goes back.
                if let Some(replica) = s.admission.holder(self.request) {
                    s.bump(now, replica, false);
                }
                s.end(now, self.request);
            });
        }
    }
}

impl Processor {
    /// A processor with no replicas yet that picks replicas with
    /// `chooser`; spawns its deadline timer on the current tokio runtime
    /// (it ends when the last clone is dropped).
    pub fn new(config: AdmissionConfig, chooser: Box<dyn ProcessorChooser>) -> Self {
        Self::with_hook(config, chooser, None)
    }

    /// [`new`](Self::new), calling `on_queued` whenever a request has to
    /// wait for a permit (how `hangar serve` tells its controller that a
    /// model's line is growing).
    pub fn with_hook(
        config: AdmissionConfig,
        chooser: Box<dyn ProcessorChooser>,
        on_queued: Option<OnQueued>,
    ) -> Self {
        let state = State {
            admission: Admission::new(config),
            chooser,
            waiters: FxHashMap::default(),
            adapter_waits: FxHashMap::default(),
            step_errors: FxHashMap::default(),
            slots: FxHashMap::default(),
            slots_given: 0,
            next_id: 0,
            counters: Counters::default(),
            monitors: FxHashMap::default(),
        };
        let shared = Arc::new_cyclic(|me| Shared {
            state: Mutex::new(state),
            on_queued,
            me: me.clone(),
            adapter_driver: std::sync::OnceLock::new(),
            epoch: Instant::now(),
            timer: Arc::new(Notify::new()),
        });
        tokio::spawn(timer(Arc::downgrade(&shared), shared.timer.clone()));
        Self { shared }
    }

    /// A replica is ready with `limit` permits; waiting requests start on it.
    pub fn replica_ready(&self, replica: ReplicaId, limit: u32) {
        self.shared.with(|s, now| {
            s.slots_given += 1;
            s.slots.insert(replica, s.slots_given);
            s.admission.replica_ready(now, replica, limit, &mut *s.chooser)
        });
    }

    /// Installs what carries out adapter steps on replicas' engines; until
    /// then (and for a chooser without slots) a request with an adapter is
    /// refused. The first driver stays.
    pub fn set_adapter_driver(&self, driver: AdapterDriver) {
        let _ = self.shared.adapter_driver.set(driver);
    }

    /// A replica is gone; returns the requests that held permits on it.
    /// Those waiting for their adapter to load there are told so
    /// ([`AdmitError::AdapterReplicaLeft`]): they ask again.
    pub fn replica_gone(&self, replica: ReplicaId) -> Vec<RequestId> {
        self.shared.with(|s, now| {
            let lost = s.admission.replica_gone(now, replica);
            s.chooser.replica_gone(replica);
            s.step_errors.remove(&replica);
            s.slots.remove(&replica);
            let stranded: Vec<RequestId> = s
                .adapter_waits
                .iter()
                .filter(|(_, w)| matches!(w, AdapterWait::Waiting { replica: r, .. } if *r == replica))
                .map(|(&request, _)| request)
                .collect();
            for request in stranded {
                let why = format!("replica {replica} left while the request's adapter was loading there");
                s.answer_adapter(request, Err(AdmitError::AdapterReplicaLeft(why)));
            }
            lost
        })
    }

    /// `replica` refused a request for want of capacity (its engine
    /// answered 429 or 503): the chooser puts it last for a while
    /// ([`hangar_queue::Chooser::refused`]), so the requests after do not
    /// each try it first.
    pub fn refused(&self, replica: ReplicaId) {
        self.shared.with(|s, now| s.chooser.refused(now, replica));
    }

    /// `replica` answered a request, with a server error (`failed`) or
    /// not: the chooser may put a replica that fails request after request
    /// last for a while ([`hangar_queue::Chooser::answered`]); how long,
    /// when this answer made it so.
    pub fn answered(&self, replica: ReplicaId, failed: bool) -> Option<Duration> {
        self.shared.with(|s, now| s.chooser.answered(now, replica, failed)).map(Duration::from_millis)
    }

    /// Fails every waiting request, patient ones included (e.g. no
    /// replica could be started).
    pub fn fail_waiting(&self, reason: &str) {
        self.shared.with(|s, now| s.admission.fail_waiting(now, reason));
    }

    /// The model cannot run now, for `reason` (`Some`), or can again
    /// (`None`): the controller's word. While it cannot, fail-fast
    /// requests waiting are answered [`AdmitError::Unavailable`], and so
    /// are new ones that find no permit; patient ones wait. A replica
    /// becoming ready ends it too.
    pub fn set_unavailable(&self, reason: Option<String>) {
        self.shared.with(|s, now| s.admission.set_unavailable(now, reason));
    }

    /// Why the model cannot run now, if the controller said so (and no
    /// replica became ready since).
    pub fn unavailable(&self) -> Option<String> {
        self.shared.with(|s, _| s.admission.unavailable().map(str::to_owned))
    }

    /// The line and the permits as they stand.
    pub fn load(&self) -> Load {
        self.shared.with(|s, _| Load {
            waiting: s.admission.waiting(),
            in_use: s.admission.in_use(),
            permits: s.admission.total_permits(),
            config: s.admission.config().clone(),
            counters: s.counters,
        })
    }

    /// `replica`, which this process runs, is in `phase`: its instance
    /// monitor (made at its first phase) hears it.
    pub fn replica_phase(&self, replica: ReplicaId, phase: ReplicaPhase) {
        self.shared.with(|s, now| {
            s.monitors.entry(replica).or_insert_with(|| InstanceMonitor::new(now)).handle_phase(now, phase)
        });
    }

    /// `replica`'s engine says it runs or holds `in_flight` requests (a
    /// fleet's agent, whose gateways hold the permits, samples it).
    pub fn sample_in_flight(&self, replica: ReplicaId, in_flight: u32) {
        self.shared.with(|s, now| {
            if let Some(m) = s.monitors.get_mut(&replica) {
                m.set_in_flight(now, in_flight);
            }
        });
    }

    /// `replica` is gone from this process: its monitor goes too.
    pub fn forget(&self, replica: ReplicaId) {
        self.shared.with(|s, _| s.monitors.remove(&replica));
    }

    /// What `replica` is doing now and its last closed window, if this
    /// process runs it.
    pub fn instance(&self, replica: ReplicaId) -> Option<InstanceReport> {
        self.shared.with(|s, now| {
            let m = s.monitors.get_mut(&replica)?;
            m.handle_timeout(now);
            Some(m.report())
        })
    }

    /// Permits out on one replica.
    pub fn in_use_on(&self, replica: ReplicaId) -> u32 {
        self.shared.with(|s, _| s.admission.in_use_on(replica))
    }

    /// Switches the line's algorithm or capacity; nobody waiting is lost.
    pub fn reconfigure(&self, config: AdmissionConfig) {
        self.shared.with(|s, now| s.admission.reconfigure(now, config));
    }

    /// Waits for a permit for a fail-fast request of `account`, at most
    /// `timeout`.
    ///
    /// # Cancel safety
    /// Dropping the future removes the request from the line (or gives its
    /// permit back if one was granted meanwhile).
    pub async fn admit(&self, account: AccountId, timeout: Option<Duration>) -> Result<Lease, AdmitError> {
        self.admit_with(account, Wait { timeout, ..Wait::default() }).await
    }

    /// [`admit`](Self::admit) of a request that waits as `wait` says; one
    /// with an adapter gets its lease once the adapter is loaded on the
    /// lease's replica (within the same timeout).
    ///
    /// # Cancel safety
    /// As [`admit`](Self::admit): dropping the future while the adapter
    /// loads gives the permit back (the load itself goes on, for the next
    /// request that wants the adapter).
    pub async fn admit_with(&self, account: AccountId, wait: Wait<'_>) -> Result<Lease, AdmitError> {
        let deadline = wait.timeout.map(|t| tokio::time::Instant::now() + t);
        let adapter = wait.adapter.is_some();
        let lease = self.permit(account, wait).await?;
        if adapter {
            self.adapter_loaded(&lease, deadline).await?;
        }
        Ok(lease)
    }

    /// Waits until `lease`'s adapter is loaded on its replica, or failed,
    /// or `deadline` passed. The caller drops the lease on an error.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the answer to the lease, whose drop
    /// forgets it.
    async fn adapter_loaded(
        &self,
        lease: &Lease,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<(), AdmitError> {
        let rx = self.shared.with(|s, _| match s.adapter_waits.remove(&lease.request) {
            Some(AdapterWait::Answered(answer)) => Err(answer),
            _ => {
                let (tx, rx) = oneshot::channel();
                s.adapter_waits.insert(lease.request, AdapterWait::Waiting { replica: lease.replica, tx });
                Ok(rx)
            }
        });
        let rx = match rx {
            Ok(rx) => rx,
            Err(answer) => return answer,
        };
        let answer = match deadline {
            Some(at) => tokio::time::timeout_at(at, rx).await.map_err(|_| AdmitError::Timeout)?,
            None => rx.await,
        };
        answer.unwrap_or(Err(AdmitError::Failed("the processor stopped".into())))
    }

    /// A permit for a request that waits as `wait` says.
    ///
    /// # Cancel safety
    /// As [`admit`](Self::admit).
    async fn permit(&self, account: AccountId, wait: Wait<'_>) -> Result<Lease, AdmitError> {
        let Wait { patience, timeout, prompt, avoid, on_position, adapter } = wait;
        let (request, position, rx) = {
            let shared = &self.shared;
            let submitted = shared.with(|s, now| {
                let request = RequestId(s.next_id);
                s.next_id += 1;
                s.counters.arrivals += 1;
                if let Some((adapter, load_ms)) = adapter {
                    let driven = shared.adapter_driver.get().is_some();
                    let Some(chooser) = s.chooser.adapters().filter(|_| driven) else {
                        let why = format!("adapter `{}`: this model's replicas load no adapters", adapter.id);
                        return Err(AdmitError::AdapterRefused(why));
                    };
                    if let Err(e) = chooser.hint_adapter(request, adapter, load_ms) {
                        return Err(AdmitError::AdapterRefused(e.to_string()));
                    }
                }
                if let Some((blocks, tokens)) = prompt {
                    s.chooser.hint(request, blocks, tokens);
                }
                if let Some(replica) = avoid {
                    s.chooser.avoid(request, replica);
                }
                let deadline = timeout.map(|t| now + t.as_millis() as Millis);
                let submitted = s
                    .admission
                    .submit_as(now, request, account, deadline, patience, &mut *s.chooser)
                    .expect("ids are unique");
                let (rx, position) = match submitted {
                    Submitted::Leased(p) => {
                        s.bump(now, p.replica, true);
                        (None, None)
                    }
                    Submitted::Queued => {
                        let (tx, rx) = oneshot::channel();
                        s.waiters.insert(request, tx);
                        (Some(rx), s.admission.position(request).and_then(position_of))
                    }
                    _ => (None, None),
                };
                Ok((request, submitted, rx, position))
            })?;
            match submitted {
                (request, Submitted::Leased(p), _, _) => {
                    let granted_at = self.shared.now();
                    return Ok(Lease {
                        shared: self.shared.clone(),
                        request,
                        replica: p.replica,
                        granted_at,
                        queued_at: None,
                    });
                }
                (request, Submitted::Rejected { capacity }, _, _) => {
                    self.shared.with(|s, _| {
                        s.chooser.done(request);
                        s.counters.rejected += 1;
                    });
                    return Err(AdmitError::QueueFull { capacity });
                }
                (request, Submitted::Unavailable, _, _) => {
                    let reason = self.shared.with(|s, _| {
                        s.chooser.done(request);
                        s.admission.unavailable().unwrap_or("the model cannot run now").to_owned()
                    });
                    return Err(AdmitError::Unavailable { reason });
                }
                (request, Submitted::Queued, rx, position) => {
                    self.shared.timer.notify_one();
                    if let Some(hook) = &self.shared.on_queued {
                        hook();
                    }
                    (request, position, rx.expect("queued requests wait"))
                }
            }
        };
        let mut guard = WaitGuard { shared: self.shared.clone(), request, armed: true };
        let granted = match (on_position, position) {
            (Some(tell), Some(position)) => self.watch_position(request, position, tell, rx).await,
            _ => rx.await,
        };
        let result = granted.unwrap_or(Err(AdmitError::Failed("the processor stopped".into())));
        guard.armed = false;
        let granted_at = self.shared.now();
        result.map(|replica| Lease {
            shared: self.shared.clone(),
            request,
            replica,
            granted_at,
            queued_at: position,
        })
    }

    /// Waits on `rx` for waiting `request`'s permit, telling `tell` its
    /// position — `position` at once, then again whenever it has moved,
    /// looked at every [`POSITION_EVERY`].
    ///
    /// # Cancel safety
    /// Dropping the future drops `rx`; the caller's guard takes the request
    /// out of the line.
    async fn watch_position(
        &self,
        request: RequestId,
        mut position: NonZeroU32,
        tell: &(dyn Fn(NonZeroU32) + Send + Sync),
        mut rx: oneshot::Receiver<Result<ReplicaId, AdmitError>>,
    ) -> Result<Result<ReplicaId, AdmitError>, oneshot::error::RecvError> {
        tell(position);
        let mut every = tokio::time::interval(POSITION_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await;
        loop {
            tokio::select! {
                granted = &mut rx => return granted,
                _ = every.tick() => {
                    let now = self.shared.with(|s, _| s.admission.position(request).and_then(position_of));
                    if let Some(now) = now.filter(|p| *p != position) {
                        position = now;
                        tell(position);
                    }
                }
            }
        }
    }
}

/// How often a waiting request whose caller follows its position
/// ([`Wait::on_position`]) looks at it again: often enough that a
/// prediction's logs follow its line, rarely enough to cost nothing.
pub const POSITION_EVERY: Duration = Duration::from_secs(1);

/// A line's position (1: next) as the lease keeps it.
fn position_of(position: usize) -> Option<NonZeroU32> {
    NonZeroU32::new(u32::try_from(position).unwrap_or(u32::MAX))
}

/// How a request waits for its permit: everything
/// [`Processor::admit_with`] needs besides its account.
#[derive(Default, Clone, Copy)]
pub struct Wait<'a> {
    /// Fail fast (a synchronous request) or wait (a prediction).
    pub patience: Patience,
    /// The longest wait, if any.
    pub timeout: Option<Duration>,
    /// The request's prompt (block hashes and token count), so the chooser
    /// can route by cache overlap.
    pub prompt: Option<(&'a [BlockHash], u32)>,
    /// A replica that just refused the request for want of capacity:
    /// avoided while another has a free permit.
    pub avoid: Option<ReplicaId>,
    /// Told the request's position in the line when it joins it and again
    /// whenever it moves (looked at every [`POSITION_EVERY`]); a request
    /// leased at once is never told.
    pub on_position: Option<&'a (dyn Fn(NonZeroU32) + Send + Sync)>,
    /// The LoRA adapter the request runs with, and about how long loading
    /// it takes, ms (what the `adapter` router charges a replica without
    /// it): the lease is handed out once the adapter is loaded on its
    /// replica.
    pub adapter: Option<(&'a hangar_core::Adapter, f64)>,
}

/// Sleeps until the earliest deadline, then expires what is due. Holds the
/// processor only weakly, so it ends once the processor is dropped.
async fn timer(shared: std::sync::Weak<Shared>, wake: Arc<Notify>) {
    loop {
        let next = {
            let Some(s) = shared.upgrade() else { return };
            s.with(|st, _| st.admission.poll_timeout()).map(|ms| s.epoch + Duration::from_millis(ms))
        };
        match next {
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(at.into()) => {}
                    _ = wake.notified() => {}
                }
            }
            None => wake.notified().await,
        }
        let Some(s) = shared.upgrade() else { return };
        s.with(|st, now| st.admission.handle_timeout(now));
    }
}
