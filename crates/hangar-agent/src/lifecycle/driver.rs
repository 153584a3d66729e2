//! The lifecycle's driver: one task that owns the [`Lifecycle`] machine,
//! carries out each step it asks for with real (or, in tests, fake)
//! engines, and tells the rest of the node what changed.
//!
//! Every input — a node's desired state, a step's end, a health check
//! that failed, a back-off that passed — reaches the machine through this
//! one task, in the order it arrived, so the machine is never touched by
//! two tasks at once. Steps run in tasks of their own (each replica has at
//! most one) and report back on a channel; the engines they started are
//! kept here, by replica. Each engine that is awake, asleep or on its way
//! between the two is health-checked every second by a watcher of its own, which reports a
//! death as an input like any other (stale reports, about an engine the
//! replica no longer has, are ignored by the machine).
//!
//! The rest of the node sees the replicas through a [`Sink`] — permits
//! given and taken, facts for the controller — and through
//! [`DriverHandle::replicas`], a table updated after every input.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hangar_core::{Millis, ModelKey, ReplicaId, ReplicaPhase};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::machine::{Engine, Fact, Lifecycle, Outcome, Output, ReplicaView, Slot, Step, Tier, Wanted};
use crate::capabilities::Capabilities;
use crate::wall_ms;
pub use hangar_core::StartReport;

/// How often an engine is health-checked.
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(1);
/// Failed checks in a row that make an awake engine lost.
pub const HEALTH_FAILURES: u32 = 3;
/// How long a replica leaving service may take to finish its requests
/// before it is put to sleep or stopped regardless.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(60);
/// How often a drain looks at the requests in flight.
const DRAIN_POLL: Duration = Duration::from_millis(50);
/// How long an engine process gets to exit after SIGTERM.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// An engine that started.
#[derive(Debug)]
pub struct Started<E> {
    /// The engine, kept by the driver until it is stopped.
    pub engine: E,
    /// Its base URL.
    pub url: String,
    /// Its process id, if this node runs it.
    pub pid: Option<u32>,
    /// What it can do (whether it sleeps, among others).
    pub capabilities: Capabilities,
    /// How its start went (the driver stamps when it began and ended).
    pub report: StartReport,
}

/// Why a start did not give an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartError {
    /// It was abandoned (nothing is left running).
    Abandoned,
    /// It failed (nothing is left running), and why.
    Failed(String),
}

/// What an engine said to being put to sleep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SleepAnswer {
    /// It sleeps.
    Slept,
    /// It is busy finishing requests: ask again.
    Busy,
    /// It will not (no sleep API, or an error), and why.
    Refused(String),
}

/// What a health check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Alive and answering.
    Ok,
    /// Its process exited.
    Exited,
    /// It did not answer.
    NoAnswer,
}

/// The engines of a node, as the driver uses them. The real ones are
/// `NodeEngines`; tests use fakes whose calls can be slowed or refused.
pub trait Engines: Send + Sync + 'static {
    /// A running engine, kept by the driver.
    type Engine: Send + Sync + 'static;

    /// Starts an engine for `replica` of `model` on `slot`; gives up,
    /// leaving nothing running, once `abandon` is cancelled (if it can).
    fn start(
        &self,
        replica: ReplicaId,
        model: &ModelKey,
        slot: &Slot,
        abandon: CancellationToken,
    ) -> impl Future<Output = Result<Started<Self::Engine>, StartError>> + Send;

    /// Asks an awake engine to sleep.
    fn sleep(&self, engine: &Self::Engine) -> impl Future<Output = SleepAnswer> + Send;

    /// Wakes a sleeping engine.
    fn wake(&self, engine: &Self::Engine) -> impl Future<Output = Result<(), String>> + Send;

    /// Stops an engine's process for good (and lets its weights go).
    fn stop(&self, replica: ReplicaId, engine: Arc<Self::Engine>) -> impl Future<Output = ()> + Send;

    /// Kills an engine's process at once and reaps it (and lets its
    /// weights go): it died or stopped answering, so a request to stop
    /// would only wait on it.
    fn kill(&self, replica: ReplicaId, engine: Arc<Self::Engine>) -> impl Future<Output = ()> + Send;

    /// Checks an engine: its process, and its health route when `awake`,
    /// else its sleep API's state route (one that hung asleep is found
    /// before a wake needs it).
    fn check(&self, engine: &Self::Engine, awake: bool) -> impl Future<Output = Health> + Send;

    /// Requests the engine itself says it is running or holding (`None`:
    /// it does not say). A drain asks once nobody on this side holds one:
    /// on a fleet's node the gateways, not the agent, hold the permits.
    fn busy(&self, engine: &Self::Engine) -> impl Future<Output = Option<u32>> + Send;
}

/// What the rest of the node hears from the driver. Called from the
/// driver's task: implementations must not block.
pub trait Sink: Send + Sync + 'static {
    /// `replica` serves at `url`: give it its permits.
    fn serve(&self, replica: ReplicaId, model: &ModelKey, url: &str);
    /// `replica` no longer serves: take its permits.
    fn unserve(&self, replica: ReplicaId, model: &ModelKey);
    /// For the controller.
    fn fact(&self, fact: Fact);
    /// Requests in flight on `replica` (a drain waits for none).
    fn in_flight(&self, replica: ReplicaId, model: &ModelKey) -> u32;
    /// `replica`'s state changed (`None`: the node forgot it).
    fn changed(&self, replica: ReplicaId, now: Option<&NodeReplica>);
}

/// One replica of the node as its reports and the admin API show it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeReplica {
    /// The machine's view: desired and observed.
    pub view: ReplicaView,
    /// Where it is in its life, in the fleet's words.
    pub phase: ReplicaPhase,
    /// Its engine's base URL, while it has one.
    pub url: Option<String>,
    /// Its engine's process, while it has one.
    pub pid: Option<u32>,
    /// What its engine can do.
    pub capabilities: Capabilities,
    /// How its last start went.
    pub start: Option<StartReport>,
}

impl NodeReplica {
    /// The GPUs its engine runs on or is starting on (none asleep).
    pub fn gpus(&self) -> Vec<u32> {
        self.view.engine.holds().map(Slot::gpu_list).unwrap_or_default()
    }

    /// Why it failed, while it is failed.
    pub fn failure(&self) -> Option<&str> {
        match &self.view.engine {
            Engine::Failed { why, .. } | Engine::Killing { why, .. } => Some(why),
            _ => None,
        }
    }
}

/// A replica's phase from the machine's view of it.
pub fn phase(v: &ReplicaView) -> ReplicaPhase {
    match (&v.engine, v.serving, &v.want) {
        (Engine::Awake { .. }, true, _) => ReplicaPhase::Ready,
        (Engine::Awake { .. } | Engine::FallingAsleep { .. }, _, _) => ReplicaPhase::Draining,
        (Engine::Absent | Engine::Failed { .. }, _, Some(Tier::Warm)) => ReplicaPhase::Cold,
        (Engine::Absent, _, _) => ReplicaPhase::Pending,
        (Engine::Failed { .. }, _, _) => ReplicaPhase::Failed,
        (Engine::Starting { .. }, _, _) => ReplicaPhase::Starting,
        (Engine::Asleep { .. }, _, _) => ReplicaPhase::Sleeping,
        (Engine::Waking { .. }, _, _) => ReplicaPhase::Waking,
        (Engine::Stopping { .. }, _, _) => ReplicaPhase::Stopping,
        // Failed: the fleet's leader hears it at once, not once it is gone.
        (Engine::Killing { .. }, _, _) => ReplicaPhase::Failed,
    }
}

/// Inputs from outside the driver's task.
enum Msg {
    Desired { node: String, wanted: Vec<Wanted> },
    Probe { replica: ReplicaId, reply: oneshot::Sender<bool> },
    Busy { reply: oneshot::Sender<Vec<(ReplicaId, ModelKey, u32)>> },
    Shutdown { reply: oneshot::Sender<()> },
}

/// Inputs from the driver's own tasks (steps and watchers).
enum Internal<E> {
    /// A step ended (a start, ready or failed, with its report).
    Done {
        replica: ReplicaId,
        outcome: Outcome,
        started: Option<Box<Started<E>>>,
        report: Option<Box<StartReport>>,
    },
    /// An engine's health check failed (for good).
    Lost { replica: ReplicaId, incarnation: u64, why: String },
    /// A probe's check ended; the answer goes out once a death it found
    /// has been handled (the replica's permits taken), so the caller's
    /// retry cannot pick it again.
    Probed { replica: ReplicaId, incarnation: u64, health: Health, reply: oneshot::Sender<bool> },
}

/// The way to a running driver. Cheap to clone; the driver stops its
/// engines and ends when the last handle is dropped.
#[derive(Clone)]
pub struct DriverHandle {
    tx: mpsc::UnboundedSender<Msg>,
    table: Arc<Mutex<BTreeMap<ReplicaId, NodeReplica>>>,
    nodes: Arc<BTreeMap<String, Vec<u64>>>,
}

/// The driver has stopped (the process is shutting down).
#[derive(Debug, thiserror::Error)]
#[error("the node's replica driver has stopped")]
pub struct Stopped;

impl DriverHandle {
    /// Replaces what placement wants on `node`. The driver takes desired
    /// states in the order they are given; one it refuses (a GPU the node
    /// lacks, a replica listed twice) changes nothing and is logged, naming
    /// what is wrong.
    pub fn set_desired(&self, node: &str, wanted: Vec<Wanted>) -> Result<(), Stopped> {
        self.tx.send(Msg::Desired { node: node.to_owned(), wanted }).map_err(|_| Stopped)
    }

    /// Every replica the node has books for, as of the last input.
    pub fn replicas(&self) -> Vec<NodeReplica> {
        self.table.lock().expect("replica table lock").values().cloned().collect()
    }

    /// One replica, as of the last input.
    pub fn replica(&self, replica: ReplicaId) -> Option<NodeReplica> {
        self.table.lock().expect("replica table lock").get(&replica).cloned()
    }

    /// The nodes this driver runs and their GPUs' memory.
    pub fn nodes(&self) -> &BTreeMap<String, Vec<u64>> {
        &self.nodes
    }

    /// Checks `replica`'s engine now (a request to it failed): a dead one
    /// is lost at once. Returns whether it is alive.
    ///
    /// # Cancel safety
    /// Dropping the future drops only the answer.
    pub async fn probe(&self, replica: ReplicaId) -> bool {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Msg::Probe { replica, reply }).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// The requests each awake engine says it runs or holds (its own
    /// gauges, [`Engines::busy`]), by replica with its model; engines that
    /// do not say are left out. A fleet's agent, whose gateways hold the
    /// permits, samples it for its instance monitors.
    ///
    /// # Cancel safety
    /// Dropping the future drops only the answer.
    pub async fn busy(&self) -> Vec<(ReplicaId, ModelKey, u32)> {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Msg::Busy { reply }).is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Stops every engine at once (after SIGTERM, once requests have had
    /// their drain) and ends the driver.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the engines to be stopped in the
    /// background.
    pub async fn shutdown(&self) {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Msg::Shutdown { reply }).is_ok() {
            let _ = rx.await;
        }
    }
}

/// One engine the driver keeps.
struct Kept<E> {
    engine: Arc<E>,
    url: String,
    pid: Option<u32>,
    capabilities: Capabilities,
    /// Stops its health watcher.
    watch: CancellationToken,
}

/// The driver's task state.
struct Driver<E: Engines, S: Sink> {
    machine: Lifecycle,
    engines: Arc<E>,
    sink: Arc<S>,
    epoch: Instant,
    kept: BTreeMap<ReplicaId, Kept<E::Engine>>,
    /// Each replica's last start, ready or failed, until it is forgotten.
    reports: BTreeMap<ReplicaId, StartReport>,
    /// The abandon token of each step in flight.
    steps: BTreeMap<ReplicaId, CancellationToken>,
    internal: mpsc::UnboundedSender<Internal<E::Engine>>,
    table: Arc<Mutex<BTreeMap<ReplicaId, NodeReplica>>>,
    /// Probe answers to send once the current input's outputs are out.
    replies: Vec<(oneshot::Sender<bool>, bool)>,
}

/// Starts a driver for `nodes` (name → each GPU's memory, bytes) over
/// `engines`, telling `sink`; it runs until [`DriverHandle::shutdown`] or
/// until every handle is dropped, and stops its engines then.
pub fn spawn<E: Engines, S: Sink>(
    nodes: BTreeMap<String, Vec<u64>>,
    engines: Arc<E>,
    sink: Arc<S>,
) -> DriverHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let (internal, internal_rx) = mpsc::unbounded_channel();
    let table = Arc::new(Mutex::new(BTreeMap::new()));
    let driver = Driver {
        machine: Lifecycle::new(nodes.clone()),
        engines,
        sink,
        epoch: Instant::now(),
        kept: BTreeMap::new(),
        reports: BTreeMap::new(),
        steps: BTreeMap::new(),
        internal,
        table: table.clone(),
        replies: Vec::new(),
    };
    tokio::spawn(driver.run(rx, internal_rx));
    DriverHandle { tx, table, nodes: Arc::new(nodes) }
}

impl<E: Engines, S: Sink> Driver<E, S> {
    fn now(&self) -> Millis {
        self.epoch.elapsed().as_millis() as Millis
    }

    /// The task: one input at a time, then its outputs carried out.
    ///
    /// # Cancel safety
    /// Runs for the driver's life in a task of its own.
    async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Msg>,
        mut internal: mpsc::UnboundedReceiver<Internal<E::Engine>>,
    ) {
        loop {
            let wake = self.machine.poll_timeout().map(|at| self.epoch + Duration::from_millis(at));
            let timer = async {
                match wake {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                // Step ends first: a desired state that arrives at the same
                // instant is decided on the engines as they are.
                biased;
                Some(input) = internal.recv() => self.handle_internal(input),
                msg = rx.recv() => match msg {
                    Some(Msg::Desired { node, wanted }) => {
                        let now = self.now();
                        if let Err(e) = self.machine.set_desired(now, &node, &wanted) {
                            tracing::error!(%node, "desired state refused, nothing changed: {e}");
                        }
                    }
                    Some(Msg::Probe { replica, reply }) => self.probe(replica, reply),
                    Some(Msg::Busy { reply }) => self.busy(reply),
                    Some(Msg::Shutdown { reply }) => {
                        self.stop_all().await;
                        let _ = reply.send(());
                        return;
                    }
                    None => return self.stop_all().await,
                },
                () = timer => {
                    let now = self.now();
                    self.machine.handle_timeout(now);
                }
            }
            self.carry_out();
            for (reply, alive) in self.replies.drain(..) {
                let _ = reply.send(alive);
            }
        }
    }

    fn handle_internal(&mut self, input: Internal<E::Engine>) {
        let now = self.now();
        match input {
            Internal::Done { replica, outcome, started, report } => {
                self.steps.remove(&replica);
                if let Some(report) = report {
                    self.reports.insert(replica, *report);
                }
                if let Some(s) = started.map(|s| *s) {
                    self.keep(replica, s);
                }
                if matches!(outcome, Outcome::Stopped) {
                    if let Some(k) = self.kept.remove(&replica) {
                        k.watch.cancel();
                    }
                }
                self.machine.handle_step_done(now, replica, outcome);
            }
            Internal::Lost { replica, incarnation, why } => self.lost(now, replica, incarnation, &why),
            Internal::Probed { replica, incarnation, health, reply } => {
                if health != Health::Ok {
                    self.lost(now, replica, incarnation, &describe(health, 1));
                }
                self.replies.push((reply, health == Health::Ok));
            }
        }
    }

    /// An engine died or stopped answering: the machine hears it, and
    /// asks for its process to be killed ([`Step::Kill`]; it may be hung
    /// rather than gone, holding its GPUs).
    fn lost(&mut self, now: Millis, replica: ReplicaId, incarnation: u64, why: &str) {
        self.machine.handle_lost(now, replica, incarnation, why);
    }

    /// Keeps a started engine and starts watching its health.
    fn keep(&mut self, replica: ReplicaId, s: Started<E::Engine>) {
        let engine = Arc::new(s.engine);
        let watch = CancellationToken::new();
        let incarnation = self.machine.view(replica).map_or(0, |v| v.incarnation);
        tokio::spawn(watch_health(
            self.engines.clone(),
            engine.clone(),
            self.table.clone(),
            replica,
            incarnation,
            watch.clone(),
            self.internal.clone(),
        ));
        let kept = Kept { engine, url: s.url, pid: s.pid, capabilities: s.capabilities, watch };
        if let Some(old) = self.kept.insert(replica, kept) {
            // Not expected (a start begins with no engine); never leak one.
            old.watch.cancel();
            let engines = self.engines.clone();
            tokio::spawn(async move { engines.stop(replica, old.engine).await });
        }
    }

    /// Stops a replica's engine in the background and forgets it.
    fn dispose(&mut self, replica: ReplicaId) {
        if let Some(k) = self.kept.remove(&replica) {
            k.watch.cancel();
            let engines = self.engines.clone();
            tokio::spawn(async move { engines.stop(replica, k.engine).await });
        }
    }

    fn probe(&mut self, replica: ReplicaId, reply: oneshot::Sender<bool>) {
        let Some(k) = self.kept.get(&replica) else {
            let _ = reply.send(false);
            return;
        };
        let Some(view) = self.machine.view(replica) else {
            let _ = reply.send(false);
            return;
        };
        let (engines, engine, internal) = (self.engines.clone(), k.engine.clone(), self.internal.clone());
        let awake = matches!(view.engine, Engine::Awake { .. });
        tokio::spawn(async move {
            let health = engines.check(&engine, awake).await;
            let _ = internal.send(Internal::Probed { replica, incarnation: view.incarnation, health, reply });
        });
    }

    /// Asks every awake engine how busy it is, in a task of its own (the
    /// driver does not wait on engines); the answer goes to `reply`.
    fn busy(&self, reply: oneshot::Sender<Vec<(ReplicaId, ModelKey, u32)>>) {
        let awake: Vec<(ReplicaId, ModelKey, Arc<E::Engine>)> = self
            .machine
            .views()
            .filter(|v| matches!(v.engine, Engine::Awake { .. }))
            .filter_map(|v| Some((v.replica, v.model, self.kept.get(&v.replica)?.engine.clone())))
            .collect();
        let engines = self.engines.clone();
        tokio::spawn(async move {
            let asks = awake.into_iter().map(|(replica, model, engine)| {
                let engines = engines.clone();
                async move { engines.busy(&engine).await.map(|n| (replica, model, n)) }
            });
            let _ = reply.send(futures::future::join_all(asks).await.into_iter().flatten().collect());
        });
    }

    /// Carries out the machine's outputs, publishes the table, then tells
    /// the facts (so whoever hears one reads the table as it stands).
    fn carry_out(&mut self) {
        let mut facts = Vec::new();
        while let Some(output) = self.machine.poll_output() {
            match output {
                Output::Step { replica, step, .. } => {
                    self.run_step(replica, step);
                }
                Output::Abandon { replica } => {
                    if let Some(token) = self.steps.get(&replica) {
                        token.cancel();
                    }
                }
                Output::Serve { replica } => {
                    let model = self.machine.view(replica).map(|v| v.model);
                    if let (Some(model), Some(k)) = (model, self.kept.get(&replica)) {
                        self.sink.serve(replica, &model, &k.url);
                    }
                }
                Output::Unserve { replica } => {
                    if let Some(v) = self.machine.view(replica) {
                        self.sink.unserve(replica, &v.model);
                    }
                }
                Output::Forget { replica } => {
                    self.dispose(replica);
                }
                Output::Fact(fact) => facts.push(fact),
            }
        }
        // Every replica whose view changed since the last publication.
        let views: Vec<ReplicaView> = self.machine.views().collect();
        let mut table = self.table.lock().expect("replica table lock");
        let gone: Vec<ReplicaId> =
            table.keys().filter(|id| self.machine.view(**id).is_none()).copied().collect();
        for id in gone {
            table.remove(&id);
            self.reports.remove(&id);
            self.sink.changed(id, None);
        }
        for v in views {
            let kept = self.kept.get(&v.replica);
            let now = NodeReplica {
                phase: phase(&v),
                url: kept.map(|k| k.url.clone()),
                pid: kept.and_then(|k| k.pid),
                capabilities: kept.map(|k| k.capabilities).unwrap_or_default(),
                start: self.reports.get(&v.replica).cloned(),
                view: v,
            };
            if table.get(&now.view.replica) != Some(&now) {
                self.sink.changed(now.view.replica, Some(&now));
                table.insert(now.view.replica, now);
            }
        }
        drop(table);
        for fact in facts {
            self.sink.fact(fact);
        }
    }

    /// Runs one step in a task of its own; its end comes back as an input.
    fn run_step(&mut self, replica: ReplicaId, step: Step) {
        let abandon = CancellationToken::new();
        self.steps.insert(replica, abandon.clone());
        let (engines, sink, internal) = (self.engines.clone(), self.sink.clone(), self.internal.clone());
        let model = self.machine.view(replica).map(|v| v.model).expect("a step is for a known replica");
        let engine = self.kept.get(&replica).map(|k| k.engine.clone());
        tokio::spawn(async move {
            let mut report = None;
            let (outcome, started) = match (step, engine) {
                (Step::Start { model, slot }, _) => {
                    let (began, placed) = (wall_ms(), Instant::now());
                    match engines.start(replica, &model, &slot, abandon).await {
                        Ok(mut s) => {
                            // The report goes to the driver's books; the
                            // engine is kept without it.
                            report = Some(Box::new(std::mem::take(&mut s.report).at(began, wall_ms())));
                            (Outcome::Started { sleeps: s.capabilities.sleep.is_some() }, Some(s))
                        }
                        Err(StartError::Abandoned) => (Outcome::Abandoned, None),
                        Err(StartError::Failed(why)) => {
                            let took = placed.elapsed().as_millis() as u64;
                            report = Some(Box::new(StartReport::failed(took, &why).at(began, wall_ms())));
                            (Outcome::StartFailed(why), None)
                        }
                    }
                }
                (Step::Sleep, Some(engine)) => {
                    (put_to_sleep(&*engines, &*sink, replica, &model, &engine, abandon).await, None)
                }
                (Step::Wake, Some(engine)) => match engines.wake(&engine).await {
                    Ok(()) => (Outcome::Woke, None),
                    Err(why) => (Outcome::WakeFailed(why), None),
                },
                (Step::Stop, Some(engine)) => {
                    drain(&*engines, &*sink, replica, &model, &engine, None).await;
                    engines.stop(replica, engine).await;
                    (Outcome::Stopped, None)
                }
                (Step::Kill, Some(engine)) => {
                    engines.kill(replica, engine).await;
                    (Outcome::Stopped, None)
                }
                // No engine kept (it died and was disposed of): nothing to
                // sleep, wake or stop.
                (Step::Sleep, None) => (Outcome::SleepRefused("its engine is gone".into()), None),
                (Step::Wake, None) => (Outcome::WakeFailed("its engine is gone".into()), None),
                (Step::Stop | Step::Kill, None) => (Outcome::Stopped, None),
            };
            let _ =
                internal.send(Internal::Done { replica, outcome, started: started.map(Box::new), report });
        });
    }

    /// Stops every engine (the driver is ending).
    async fn stop_all(&mut self) {
        for token in self.steps.values() {
            token.cancel();
        }
        let stops: Vec<_> = std::mem::take(&mut self.kept)
            .into_iter()
            .map(|(replica, k)| {
                k.watch.cancel();
                let engines = self.engines.clone();
                async move { engines.stop(replica, k.engine).await }
            })
            .collect();
        futures::future::join_all(stops).await;
    }
}

/// Waits until `replica` has no request in flight — none held on this
/// side (`sink`), none the engine says it runs — or `DRAIN_LIMIT` passes,
/// or `abandon` (if given) is cancelled; false when abandoned.
async fn drain<E: Engines, S: Sink>(
    engines: &E,
    sink: &S,
    replica: ReplicaId,
    model: &ModelKey,
    engine: &E::Engine,
    abandon: Option<&CancellationToken>,
) -> bool {
    let limit = Instant::now() + DRAIN_LIMIT;
    while Instant::now() < limit {
        if abandon.is_some_and(CancellationToken::is_cancelled) {
            return false;
        }
        if sink.in_flight(replica, model) == 0 && engines.busy(engine).await.unwrap_or(0) == 0 {
            break;
        }
        tokio::time::sleep(DRAIN_POLL).await;
    }
    !abandon.is_some_and(CancellationToken::is_cancelled)
}

/// A sleep step: the replica's requests drain (it has no permits any
/// more), then the engine is asked to sleep until it does, refuses, or the
/// drain limit passes. Abandoned only before the engine slept.
async fn put_to_sleep<E: Engines, S: Sink>(
    engines: &E,
    sink: &S,
    replica: ReplicaId,
    model: &ModelKey,
    engine: &E::Engine,
    abandon: CancellationToken,
) -> Outcome {
    if !drain(engines, sink, replica, model, engine, Some(&abandon)).await {
        return Outcome::Abandoned;
    }
    let limit = Instant::now() + DRAIN_LIMIT;
    loop {
        match engines.sleep(engine).await {
            SleepAnswer::Slept => return Outcome::Slept,
            SleepAnswer::Refused(why) => return Outcome::SleepRefused(why),
            SleepAnswer::Busy if Instant::now() >= limit => {
                return Outcome::SleepRefused(format!("still busy after {}s", DRAIN_LIMIT.as_secs()))
            }
            SleepAnswer::Busy => {
                if abandon.is_cancelled() {
                    return Outcome::Abandoned;
                }
                tokio::time::sleep(DRAIN_POLL * 2).await;
            }
        }
    }
}

/// Health-checks an engine every [`HEALTH_INTERVAL`] while `watch` lives:
/// an exit at once, or [`HEALTH_FAILURES`] failed checks in a row of an
/// engine awake, asleep, or on its way between the two, is reported lost.
async fn watch_health<E: Engines>(
    engines: Arc<E>,
    engine: Arc<E::Engine>,
    table: Arc<Mutex<BTreeMap<ReplicaId, NodeReplica>>>,
    replica: ReplicaId,
    incarnation: u64,
    watch: CancellationToken,
    internal: mpsc::UnboundedSender<Internal<E::Engine>>,
) {
    let mut failures = 0;
    loop {
        tokio::select! {
            () = watch.cancelled() => return,
            () = tokio::time::sleep(HEALTH_INTERVAL) => {}
        }
        // An engine asleep is checked by its sleep API's state route; one
        // awake, falling asleep or waking by its health route, which an
        // engine's API server answers while a sleep or wake call runs
        // (vLLM's and SGLang's answer it apart from their engine core): a
        // hung one would otherwise hold its GPUs through the call's 120 s.
        // Starting and stopping have their own limits.
        let awake = match table.lock().expect("replica table lock").get(&replica).map(|r| &r.view.engine) {
            Some(Engine::Awake { .. } | Engine::FallingAsleep { .. } | Engine::Waking { .. }) => true,
            Some(Engine::Asleep { .. }) => false,
            _ => continue,
        };
        let health = engines.check(&engine, awake).await;
        failures = if health == Health::Ok { 0 } else { failures + 1 };
        if health == Health::Exited || failures >= HEALTH_FAILURES {
            let why = describe(health, failures);
            let _ = internal.send(Internal::Lost { replica, incarnation, why });
            return;
        }
    }
}

fn describe(health: Health, failures: u32) -> String {
    match health {
        Health::Exited => "its engine process exited".into(),
        _ if failures > 1 => format!("its health check failed {failures} times in a row"),
        _ => "its health check failed".into(),
    }
}

/// Converts one node's desired replicas from the agent protocol's words.
pub fn wanted(replicas: &[hangar_core::DesiredReplica]) -> Vec<Wanted> {
    replicas
        .iter()
        .map(|d| Wanted {
            replica: d.replica,
            model: d.model.clone(),
            tier: if d.warm {
                Tier::Warm
            } else {
                Tier::Hot(Slot { gpus: d.gpus.clone(), fraction: d.gpu_fraction })
            },
        })
        .collect()
}
