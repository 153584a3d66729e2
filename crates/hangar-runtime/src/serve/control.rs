//! The controller's task: the one place `hangar serve` decides replica
//! counts.
//!
//! It owns `hangar-scaler`'s [`Controller`] (every model's scaler and the
//! cluster's placement) in a [`ControlLoop`] — the cadence the fleet
//! simulation drives it with too — and runs it on the wall clock: every
//! second, and before each due decision, it shows it each model's line,
//! replicas and counters, calls its timeout, and carries out its actions.
//! Deployment deltas are folded into each node's desired state, which goes
//! whole to the node's lifecycle driver (on a fleet's leader: to Redis, for
//! the node's agent); decisions and placement trouble are logged once and
//! counted. At one instant what is due on the clock comes before the
//! commands that arrive, as in the simulator. Everything else talks to it
//! through [`ControlHandle`]: the request path sends facts (a request for
//! a model with no replica up), the nodes report a replica ready, failed
//! or cold, and the admin API sends commands and reads its status.
//! Nothing is scaled on the request path — a request that has to wait only
//! tells the task (at most one message per model in flight) — and an admin
//! call whose client leaves still has its command carried out whole.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use hangar_core::{Millis, ModelKey, ReplicaId};
use hangar_placement::{Deployment, DrainError, Level, NodeConfig, NodeId, Restore};
use hangar_scaler::{Action, CommandError, ControlLoop, Controller, Observation, ReplicaCounts, StartTier};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use super::{Inner, ModelRuntime};
use hangar_core::ReplicaPhase;

/// How often every model is observed.
pub(crate) const TICK: Duration = Duration::from_secs(1);

/// What the controller's task is asked.
pub(crate) enum Command {
    /// A request of the model had to wait for a permit: observe the model
    /// now (with at least that request waiting), so its scaler can act at
    /// once rather than at the next tick.
    Waiting(ModelKey),
    /// A replica came up, on an engine that can (`sleeps`) or cannot sleep.
    Ready { model: ModelKey, tier: StartTier, took: Duration, sleeps: bool },
    /// A replica died, stopped answering, or did not start.
    Failed { model: ModelKey, replica: ReplicaId, why: String, start_failed: bool },
    /// A replica placement sent to the warm cache was stopped instead (its
    /// engine cannot sleep): it is gone, not WARM.
    Stopped { model: ModelKey, replica: ReplicaId },
    /// An operator's scaling command.
    Scaling { model: ModelKey, command: ScalingCommand, reply: oneshot::Sender<Result<(), CommandError>> },
    /// An operator's eviction.
    Evict { model: ModelKey, replica: Option<ReplicaId>, reply: oneshot::Sender<Result<usize, CommandError>> },
    /// The scaling and placement view of every model, for `/admin/status`.
    Status { reply: oneshot::Sender<Status> },
    /// A node joined, running these replicas (fleet mode, the leader).
    NodeJoined(NodeConfig, Vec<Restore>),
    /// A node agent's registration lapsed: its replicas are gone.
    NodeLost(NodeId),
    /// The weight artifacts a node holds resident changed (fleet mode, the
    /// leader).
    Resident(NodeId, BTreeSet<String>),
    /// A started replica of the model loaded this weight artifact (fleet
    /// mode, the leader).
    ModelArtifact(ModelKey, String),
    /// Drain a node (`on`), or call its drain off: an operator's command on
    /// a single machine (with its `reply`), the view's on a fleet's leader.
    Drain { node: NodeId, on: bool, reply: Option<oneshot::Sender<Result<(), DrainError>>> },
    /// A node's agent and engines stopped answering (`on`), or it beat
    /// again since (fleet mode, the leader): sent before the replicas found
    /// dead there, so their replacements go elsewhere.
    Suspect { node: NodeId, on: bool },
}

/// An operator's scaling command for one model
/// (`POST /admin/models/{model}/scaling`): the kill switches of its scaler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScalingCommand {
    /// Keep the replica count where it is: the scaler decides nothing.
    Freeze,
    /// Let the scaler decide again.
    Unfreeze,
    /// Hold the model at this many replicas (within its bounds).
    Pin(u32),
    /// Run the model between these bounds from now on (a deployment's
    /// `min_instances` / `max_instances`).
    Bounds(hangar_scaler::Bounds),
}

/// Per model: its key, its scaling state as JSON, and its hot and warm
/// deployments.
pub type Status = Vec<(String, Value, Vec<Deployment>)>;

/// The way to the controller's task. Cheap to clone; sends never block.
#[derive(Clone)]
pub struct ControlHandle {
    tx: mpsc::UnboundedSender<Command>,
    /// Whether a controller reads the channel: always on a single
    /// machine; in a fleet, only while this gateway leads.
    active: Arc<AtomicBool>,
}

/// Why an operator's command was not carried out.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// The controller refused it.
    #[error(transparent)]
    Command(#[from] CommandError),
    /// This gateway of a fleet does not lead: no controller runs here.
    #[error(
        "this gateway is not the fleet's leader, which runs the controller; send the command to the gateway whose \
         /admin/status shows `fleet.leading: true`"
    )]
    NotLeader,
    /// The controller's task is gone (the server is stopping).
    #[error("the controller is stopping")]
    Stopped,
    /// The fleet's Redis did not take the command's record, so nothing
    /// was changed.
    #[error("cannot record the command in the fleet's Redis, nothing changed: {0}")]
    Unrecorded(String),
    /// A node no live agent registered (on a fleet), or not in the
    /// configuration (on a single machine).
    #[error("there is no node `{0}`: `GET /admin/status` lists the nodes")]
    UnknownNode(String),
}

impl ControlHandle {
    /// A handle, and the receiving end the controller's task reads.
    pub(crate) fn new() -> (Self, mpsc::UnboundedReceiver<Command>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (ControlHandle { tx, active: Arc::default() }, rx)
    }

    /// Marks whether a controller reads the channel now.
    pub(crate) fn set_active(&self, active: bool) {
        self.active.store(active, Ordering::Release);
    }

    /// Whether a controller reads the channel now: always on a single
    /// machine; on a fleet's gateway, while it leads.
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    pub(crate) fn send(&self, command: Command) {
        // Only fails when the server is stopping, when nothing needs it.
        let _ = self.tx.send(command);
    }

    /// The hook a model's processor calls when a request has to wait: one
    /// `Waiting` at a time per model (`pending`, cleared when the task
    /// handles it), so a flood of queued requests is one message.
    pub(crate) fn on_queued(&self, model: ModelKey, pending: Arc<AtomicBool>) -> crate::processor::OnQueued {
        let tx = self.tx.clone();
        Box::new(move || {
            if !pending.swap(true, Ordering::AcqRel) {
                let _ = tx.send(Command::Waiting(model.clone()));
            }
        })
    }

    /// Sends an operator's scaling command and waits for it to be applied.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the command to be carried out whole.
    pub async fn scaling(&self, model: &ModelKey, command: ScalingCommand) -> Result<(), ControlError> {
        if !self.is_active() {
            return Err(ControlError::NotLeader);
        }
        let (reply, rx) = oneshot::channel();
        self.send(Command::Scaling { model: model.clone(), command, reply });
        Ok(rx.await.map_err(|_| ControlError::Stopped)??)
    }

    /// Sends an eviction and waits for placement's answer (not for the
    /// engines: they follow in the background).
    ///
    /// # Cancel safety
    /// Dropping the future leaves the eviction to be carried out whole.
    pub async fn evict(&self, model: &ModelKey, replica: Option<ReplicaId>) -> Result<usize, ControlError> {
        if !self.is_active() {
            return Err(ControlError::NotLeader);
        }
        let (reply, rx) = oneshot::channel();
        self.send(Command::Evict { model: model.clone(), replica, reply });
        Ok(rx.await.map_err(|_| ControlError::Stopped)??)
    }

    /// Drains `node` (`on`) or calls its drain off, and waits for the
    /// controller to take it (not for the replicas to move: they follow in
    /// the background).
    ///
    /// # Cancel safety
    /// Dropping the future leaves the command to be carried out whole.
    pub async fn drain(&self, node: &NodeId, on: bool) -> Result<(), ControlError> {
        if !self.is_active() {
            return Err(ControlError::NotLeader);
        }
        let (reply, rx) = oneshot::channel();
        self.send(Command::Drain { node: node.clone(), on, reply: Some(reply) });
        rx.await.map_err(|_| ControlError::Stopped)?.map_err(|_| ControlError::UnknownNode(node.to_string()))
    }

    /// Every model's scaling state and deployments (none where no
    /// controller runs: a fleet's gateway that does not lead).
    pub async fn status(&self) -> Status {
        if !self.is_active() {
            return Status::default();
        }
        let (reply, rx) = oneshot::channel();
        self.send(Command::Status { reply });
        rx.await.unwrap_or_default()
    }
}

/// What the control task drives: `hangar serve`'s models and engines
/// ([`Inner`]), or a test's stand-in.
pub(crate) trait Fleet: Send + Sync + 'static {
    /// Milliseconds on the controller's clock.
    fn now(&self) -> Millis;
    /// When `at` on that clock is, to sleep until it.
    fn instant(&self, at: Millis) -> tokio::time::Instant;
    /// The models, in a fixed order.
    fn models(&self) -> Vec<ModelKey>;
    /// `model` as it is now, with at least `waiting` requests waiting.
    fn observe(&self, model: &ModelKey, waiting: u32) -> Option<(Observation, Vec<(ReplicaId, u32)>)>;
    /// A `Waiting` of `model` is being handled: the next queued request
    /// may announce itself again.
    fn waiting_handled(&self, model: &ModelKey);
    /// Carries out one of the controller's actions.
    fn carry_out(self: &Arc<Self>, action: Action);
    /// A node joined, placement holding `deployments` there (what it runs
    /// that was adopted): that is its whole desired state now.
    fn node_joined(&self, _node: &NodeId, _deployments: Vec<Deployment>) {}
}

/// Runs the control loop until the fleet is dropped (its handle closes).
/// [`run`] owning its channel: the single-machine server's controller,
/// which lives as long as the server.
pub(crate) async fn run_owned<F: Fleet>(
    fleet: Weak<F>,
    control: ControlLoop,
    mut rx: mpsc::UnboundedReceiver<Command>,
) {
    run(fleet, control, &mut rx).await
}

pub(crate) async fn run<F: Fleet>(
    fleet: Weak<F>,
    mut control: ControlLoop,
    rx: &mut mpsc::UnboundedReceiver<Command>,
) {
    loop {
        let Some(wake) = fleet.upgrade().map(|f| f.instant(control.poll_timeout())) else { return };
        // Biased: at one instant, what is due on the clock first, then the
        // commands that arrived (as the simulator orders them).
        tokio::select! {
            biased;
            () = tokio::time::sleep_until(wake) => {}
            command = rx.recv() => {
                let Some(command) = command else { return };
                let Some(fleet) = fleet.upgrade() else { return };
                handle(&fleet, &mut control, command);
            }
        }
        let Some(fleet) = fleet.upgrade() else { return };
        let now = fleet.now();
        // Decisions are taken on what the models are now, not on the last
        // tick's view.
        if control.wants_observations(now) {
            for model in fleet.models() {
                if let Some((obs, in_flight)) = fleet.observe(&model, 0) {
                    control.observe(now, &model, obs, &in_flight);
                }
            }
        }
        control.handle_timeout(now);
        while let Some(action) = control.poll_action() {
            fleet.carry_out(action);
        }
    }
}

impl Fleet for Inner {
    fn now(&self) -> Millis {
        Inner::now(self)
    }

    fn instant(&self, at: Millis) -> tokio::time::Instant {
        self.epoch.checked_add(Duration::from_millis(at)).map_or_else(
            || tokio::time::Instant::now() + Duration::from_secs(86_400),
            tokio::time::Instant::from_std,
        )
    }

    fn models(&self) -> Vec<ModelKey> {
        self.models.values().map(|rt| rt.config.key.clone()).collect()
    }

    fn observe(&self, model: &ModelKey, waiting: u32) -> Option<(Observation, Vec<(ReplicaId, u32)>)> {
        self.models.get(model.as_str()).map(|rt| observe(rt, waiting))
    }

    fn waiting_handled(&self, model: &ModelKey) {
        if let Some(rt) = self.models.get(model.as_str()) {
            rt.waiting_signal.store(false, Ordering::Release);
        }
    }

    fn carry_out(self: &Arc<Self>, action: Action) {
        carry_out(self, action);
    }
}

/// A model's observation, with at least `waiting` requests waiting (a
/// request that announced itself may or may not be in the line yet).
fn observe(rt: &ModelRuntime, waiting: u32) -> (Observation, Vec<(ReplicaId, u32)>) {
    let load = rt.processor.load();
    let (mut starting, mut ready, mut sleeping) = (0, 0, 0);
    let mut ready_ids = Vec::new();
    for (id, state) in rt.states() {
        match state {
            ReplicaPhase::Pending | ReplicaPhase::Starting | ReplicaPhase::Waking => starting += 1,
            ReplicaPhase::Ready => {
                ready += 1;
                ready_ids.push(id);
            }
            ReplicaPhase::Draining | ReplicaPhase::Sleeping => sleeping += 1,
            ReplicaPhase::Stopping | ReplicaPhase::Failed | ReplicaPhase::Cold => {}
        }
    }
    let in_flight = ready_ids.into_iter().map(|id| (id, rt.processor.in_use_on(id))).collect();
    let obs = Observation {
        waiting: u32::try_from(load.waiting).unwrap_or(u32::MAX).max(waiting),
        in_flight: load.in_use,
        permits_per_replica: rt.config.permits(),
        replicas: ReplicaCounts { starting, ready, sleeping, failed: rt.metrics.failures() },
        arrivals: load.counters.arrivals,
        completions: load.counters.completions,
        rejected: load.counters.rejected,
        busy_ms: load.counters.busy_ms,
        ttft_p99_ms: rt.metrics.recent_ttft_p99(),
    };
    (obs, in_flight)
}

fn handle<F: Fleet>(fleet: &Arc<F>, control: &mut ControlLoop, command: Command) {
    let now = fleet.now();
    match command {
        Command::Waiting(model) => {
            fleet.waiting_handled(&model);
            if let Some((obs, in_flight)) = fleet.observe(&model, 1) {
                control.waiting(now, &model, obs, &in_flight);
            }
        }
        Command::Ready { model, tier, took, sleeps } => {
            control.handle_ready(now, &model, tier, took.as_millis() as Millis, sleeps);
        }
        Command::Failed { model, replica, why, start_failed } => {
            control.controller_mut().handle_failed(now, &model, replica, &why, start_failed);
        }
        Command::Stopped { model, replica } => {
            control.controller_mut().handle_stopped(now, &model, replica);
        }
        Command::Scaling { model, command: ScalingCommand::Bounds(b), reply }
            if control.controller().scaler(&model).is_some_and(|s| s.bounds() == b) =>
        {
            // The bounds it runs within already: deployments repeat theirs
            // every few seconds (level-triggered), and an unneeded
            // observation would only crowd the policy's history.
            let _ = reply.send(Ok(()));
        }
        Command::Scaling { model, command, reply } => {
            observe_now(fleet.as_ref(), control, now, &model);
            let controller = control.controller_mut();
            let result = match command {
                ScalingCommand::Freeze => controller.freeze(now, &model),
                ScalingCommand::Unfreeze => controller.release(now, &model),
                ScalingCommand::Pin(n) => controller.pin(now, &model, n),
                ScalingCommand::Bounds(b) => controller.set_bounds(now, &model, b),
            };
            let _ = reply.send(result);
        }
        Command::Evict { model, replica, reply } => {
            observe_now(fleet.as_ref(), control, now, &model);
            let _ = reply.send(control.controller_mut().evict(now, &model, replica));
        }
        Command::Status { reply } => {
            let _ = reply.send(status(control.controller(), now));
        }
        Command::NodeJoined(node, running) => {
            let id = node.id.clone();
            match control.controller_mut().handle_node_joined(now, node, &running) {
                Ok(deployments) => {
                    tracing::info!(node = %id, running = running.len(), adopted = deployments.len(), "node joined the fleet");
                    fleet.node_joined(&id, deployments);
                }
                Err(e) => tracing::warn!(node = %id, "node not added: {e}"),
            }
        }
        Command::NodeLost(node) => {
            if let Some(lost) = control.controller_mut().handle_node_lost(now, &node) {
                tracing::warn!(node = %node, replicas = lost.len(), "node lost: its replicas are placed elsewhere");
            }
        }
        Command::Resident(node, artifacts) => {
            // A node lost since its report was read: nothing to prefer.
            let _ = control.controller_mut().set_resident(&node, artifacts);
        }
        Command::Drain { node, on, reply } => {
            // Which replicas are ready decides which leaving ones may stop.
            for model in fleet.models() {
                observe_now(fleet.as_ref(), control, now, &model);
            }
            let result = control.controller_mut().drain(now, &node, on);
            match &result {
                Ok(()) => tracing::info!(node = %node, draining = on, "node drain set"),
                Err(e) => tracing::warn!(node = %node, "cannot drain: {e}"),
            }
            if let Some(reply) = reply {
                let _ = reply.send(result);
            }
        }
        Command::Suspect { node, on } => {
            // A node not (or no longer) a member: what it ran is handled
            // as it joins or is lost.
            if let Err(e) = control.controller_mut().suspect(now, &node, on) {
                tracing::debug!(node = %node, "suspicion not recorded: {e}");
            }
        }
        Command::ModelArtifact(model, artifact) => {
            if let Err(e) = control.controller_mut().set_model_artifact(&model, Some(artifact)) {
                tracing::debug!(%model, "weight artifact not recorded: {e}");
            }
        }
    }
}

/// Shows `model` as it is now, before a command decides on it.
fn observe_now<F: Fleet>(fleet: &F, control: &mut ControlLoop, now: Millis, model: &ModelKey) {
    if let Some((obs, in_flight)) = fleet.observe(model, 0) {
        control.observe(now, model, obs, &in_flight);
    }
}

/// Every model's scaling state, with the controller's clock `now` (the
/// decisions' `at_ms` are on it).
fn status(controller: &Controller, now: Millis) -> Status {
    let cluster = controller.cluster();
    cluster
        .models()
        .keys()
        .filter_map(|model| {
            let scaler = controller.scaler(model)?;
            let decisions: Vec<Value> = scaler
                .decisions()
                .iter()
                .map(|d| {
                    json!({"at_ms": d.at, "previous": d.previous, "desired": d.desired,
                           "reason": d.reason.to_string(), "why": d.reason, "inputs": d.inputs})
                })
                .collect();
            let value = json!({
                "now_ms": now,
                "policy": scaler.policy(),
                "desired": scaler.desired(),
                "bounds": scaler.bounds(),
                "override": scaler.override_(),
                "unplaceable": controller.blocked(model),
                "start_times": scaler.start_times(),
                "keep_warm_ms": scaler.keep_warm_ms(),
                "reversals": scaler.reversals(),
                "decisions": decisions,
            });
            let deployments = [Level::Hot, Level::Warm]
                .into_iter()
                .flat_map(|l| cluster.replicas_of(model, l).into_iter().cloned())
                .collect();
            Some((model.to_string(), value, deployments))
        })
        .collect()
}

/// Carries out one of the controller's actions: a delta is folded into
/// the nodes' desired states, and each node it touched is handed its
/// state whole.
fn carry_out(inner: &Arc<Inner>, action: Action) {
    match action {
        Action::Apply(delta) => {
            let Some(driver) = inner.driver.get() else { return };
            let mut book = inner.desired.lock().expect("desired book lock");
            for node in book.apply(&delta) {
                let state = book.get(&node);
                // Only refused while the server stops.
                let _ = driver.set_desired(&node, hangar_agent::lifecycle::wanted(&state.replicas));
            }
        }
        other => note(inner, other),
    }
}

/// Carries out what is not a deployment delta: decisions logged and kept
/// for the admin API, placement trouble flagged (and a model that can run
/// nowhere turns synchronous requests away while predictions wait).
pub(crate) fn note(inner: &Inner, action: Action) {
    match action {
        Action::Apply(_) => unreachable!("deltas are the caller's"),
        Action::Decided { model, decision } => {
            let Some(rt) = inner.models.get(model.as_str()) else { return };
            tracing::info!(%model, from = decision.previous, to = decision.desired, "scaling: {}", decision.reason);
            rt.desired.store(decision.desired, Ordering::Relaxed);
            rt.metrics.decided(decision.desired > decision.previous);
        }
        Action::Unplaceable { model, reason, cause } => {
            let Some(rt) = inner.models.get(model.as_str()) else { return };
            tracing::warn!(%model, "unplaceable: {reason}; retrying with back-off");
            rt.unplaceable.store(true, Ordering::Relaxed);
            rt.metrics.unplaceable(true);
            if rt.up() == 0 {
                // The model cannot run now: synchronous requests are told
                // so at once (503, retry), waiting or arriving; async
                // predictions wait for room until their own deadlines —
                // unless its engine does not start, which fails them too.
                let reason = format!("no replica of `{model}` can run now: {reason}");
                if cause == hangar_scaler::BlockCause::StartFailed {
                    rt.processor.fail_waiting(&reason);
                }
                rt.processor.set_unavailable(Some(reason));
            }
        }
        Action::Placeable { model } => {
            let Some(rt) = inner.models.get(model.as_str()) else { return };
            tracing::info!(%model, "placeable again");
            rt.unplaceable.store(false, Ordering::Relaxed);
            rt.metrics.unplaceable(false);
            // A hotswap model an operator closed stays closed.
            if rt.swappable() != Some(false) {
                rt.processor.set_unavailable(None);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The live control task against the fleet simulation: the same trace
    //! through both, on a paused clock, takes the same scale decisions.

    use std::collections::{BTreeMap, VecDeque};
    use std::sync::Mutex;

    use hangar_scaler::Input;
    use hangar_sim::fleet::{simulate_fleet, FleetConfig, FleetOptions};
    use hangar_sim::synth::{self, Pattern, SynthConfig};

    use super::*;

    const FLEET: &str = r#"
seed = 7

[cold_start]
boot_ms = 1000

[[nodes]]
id = "gpu"
count = 2
gpus = 2
gpu_memory = "80GB"
cpu_cache = "200GB"

[[models]]
key = "synth/m0"
size = "16GB"
max_replicas = 4
concurrency = 4

[[models]]
key = "synth/m1"
size = "60GB"
max_replicas = 3
concurrency = 4
scaling = { policy = "replicate" }
"#;

    type Seen = (Observation, Vec<(ReplicaId, u32)>);

    /// The simulated fleet as the live task sees it: each model observed
    /// as the simulator observed it at that very millisecond. A look at a
    /// moment the simulator did not look is a divergence, kept to fail on.
    struct Replay {
        start: tokio::time::Instant,
        keys: Vec<ModelKey>,
        observed: Mutex<BTreeMap<(Millis, ModelKey), VecDeque<Seen>>>,
        waiting: Mutex<BTreeMap<(Millis, ModelKey), VecDeque<Seen>>>,
        decided: Mutex<Vec<Input>>,
        diverged: Mutex<Vec<String>>,
    }

    impl Fleet for Replay {
        fn now(&self) -> Millis {
            self.start.elapsed().as_millis() as Millis
        }

        fn instant(&self, at: Millis) -> tokio::time::Instant {
            self.start + Duration::from_millis(at.min(86_400_000_000))
        }

        fn models(&self) -> Vec<ModelKey> {
            self.keys.clone()
        }

        fn observe(&self, model: &ModelKey, waiting: u32) -> Option<Seen> {
            let now = self.now();
            let book = if waiting > 0 { &self.waiting } else { &self.observed };
            let seen = book.lock().unwrap().get_mut(&(now, model.clone())).and_then(VecDeque::pop_front);
            if seen.is_none() {
                self.diverged.lock().unwrap().push(format!("the live task looked at {model} at {now} ms"));
            }
            seen
        }

        fn waiting_handled(&self, _model: &ModelKey) {}

        fn carry_out(self: &Arc<Self>, action: Action) {
            if let Action::Decided { model, decision } = action {
                let (at, previous, desired) = (decision.at, decision.previous, decision.desired);
                self.decided.lock().unwrap().push(Input::Decided { at, model, previous, desired });
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_live_task_takes_the_simulators_decisions_on_the_same_trace() {
        let rows = synth::generate(&SynthConfig {
            requests: 3000,
            rate: 4.0,
            models: 2,
            max_turns: 1,
            pattern: Pattern::Bursty,
            period_s: 120.0,
            seed: 11,
            ..SynthConfig::default()
        })
        .unwrap();
        let text: String = rows.iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect();
        let trace = hangar_sim::trace::read(&text, "synth.jsonl").unwrap();
        let cfg = FleetConfig::parse(FLEET, "fleet.toml").unwrap();
        let opts = FleetOptions { record_control: true, ..FleetOptions::default() };
        let record = simulate_fleet(&trace, &cfg, &opts, |_, _| {}).unwrap().control_record;

        let mut observed: BTreeMap<(Millis, ModelKey), VecDeque<Seen>> = BTreeMap::new();
        let mut waiting: BTreeMap<(Millis, ModelKey), VecDeque<Seen>> = BTreeMap::new();
        let mut facts = Vec::new();
        let mut expected = Vec::new();
        for input in &record {
            match input {
                Input::Observed { at, model, obs, in_flight } => {
                    observed.entry((*at, model.clone())).or_default().push_back((*obs, in_flight.clone()));
                }
                Input::Waiting { at, model, obs, in_flight } => {
                    waiting.entry((*at, model.clone())).or_default().push_back((*obs, in_flight.clone()));
                    facts.push((*at, Command::Waiting(model.clone())));
                }
                Input::Ready { at, model, tier, took_ms, sleeps } => {
                    let took = Duration::from_millis(*took_ms);
                    let sleeps = *sleeps;
                    facts.push((*at, Command::Ready { model: model.clone(), tier: *tier, took, sleeps }));
                }
                Input::Resident { at, node, artifacts } => {
                    facts.push((*at, Command::Resident(node.clone(), artifacts.clone())));
                }
                Input::Drain { at, node, on } => {
                    facts.push((*at, Command::Drain { node: node.clone(), on: *on, reply: None }));
                }
                Input::Decided { .. } => expected.push(input.clone()),
            }
        }
        assert!(expected.len() >= 10, "a run that scales: {} decisions", expected.len());
        let end = record.iter().map(input_at).max().unwrap();

        let replay = Arc::new(Replay {
            start: tokio::time::Instant::now(),
            keys: cfg.models.iter().map(|m| m.key.clone()).collect(),
            observed: Mutex::new(observed),
            waiting: Mutex::new(waiting),
            decided: Mutex::new(Vec::new()),
            diverged: Mutex::new(Vec::new()),
        });
        let control = ControlLoop::new(cfg.controller(None).unwrap(), cfg.observe_ms, 0);
        let weak = Arc::downgrade(&replay);
        let (handle, mut rx) = ControlHandle::new();
        let task = tokio::spawn(async move { run(weak, control, &mut rx).await });
        for (at, command) in facts {
            tokio::time::sleep_until(replay.instant(at)).await;
            handle.send(command);
        }
        tokio::time::sleep_until(replay.instant(end + 1)).await;
        task.abort();

        let diverged = replay.diverged.lock().unwrap();
        assert!(diverged.is_empty(), "{} divergences, first {:?}", diverged.len(), diverged.first());
        assert_eq!(*replay.decided.lock().unwrap(), expected);
    }

    fn input_at(input: &Input) -> Millis {
        match input {
            Input::Observed { at, .. } | Input::Waiting { at, .. } | Input::Ready { at, .. } => *at,
            Input::Resident { at, .. } | Input::Drain { at, .. } | Input::Decided { at, .. } => *at,
        }
    }
}
