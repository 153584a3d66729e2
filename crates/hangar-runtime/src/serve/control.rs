//! The controller's task: the one place `hangar serve` decides replica
//! counts.
//!
//! It owns `hangar-scaler`'s [`Controller`] (every model's scaler and the
//! cluster's placement) and drives it on the wall clock: every second it
//! shows it each model's line, replicas and counters, calls its timeout
//! when due, and carries out its actions — deployment deltas are applied
//! to engines in tasks of their own ([`Inner::apply`]), decisions and
//! placement trouble are logged once and counted. Everything else talks to
//! it through [`ControlHandle`]: the request path sends facts (a request
//! for a model with no replica up), the replica tasks report a replica
//! ready or failed, and the admin API sends commands and reads its status.
//! Nothing is scaled on the request path — a request that has to wait only
//! tells the task (at most one message per model in flight) — and an admin
//! call whose client leaves still has its command carried out whole.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use hangar_core::{Millis, ModelKey, ReplicaId};
use hangar_placement::{Deployment, Level};
use hangar_scaler::{Action, CommandError, Controller, Observation, ReplicaCounts, StartTier};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use super::replicas::ReplicaState;
use super::{Inner, ModelRuntime};

/// How often every model is observed.
const TICK: Duration = Duration::from_secs(1);

/// What the controller's task is asked.
pub(crate) enum Command {
    /// A request of the model had to wait for a permit: observe the model
    /// now (with at least that request waiting), so its scaler can act at
    /// once rather than at the next tick.
    Waiting(ModelKey),
    /// A replica came up.
    Ready { model: ModelKey, tier: StartTier, took: Duration },
    /// A replica died, stopped answering, or did not start.
    Failed { model: ModelKey, replica: ReplicaId, why: String, start_failed: bool },
    /// An operator's scaling command.
    Scaling { model: ModelKey, command: ScalingCommand, reply: oneshot::Sender<Result<(), CommandError>> },
    /// An operator's eviction.
    Evict { model: ModelKey, replica: Option<ReplicaId>, reply: oneshot::Sender<Result<usize, CommandError>> },
    /// The scaling and placement view of every model, for `/admin/status`.
    Status { reply: oneshot::Sender<Status> },
}

/// `POST /admin/models/{model}/scaling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScalingCommand {
    Freeze,
    Unfreeze,
    Pin(u32),
}

/// Per model: its scaling state as JSON, and its hot and warm deployments.
pub(crate) type Status = Vec<(String, Value, Vec<Deployment>)>;

/// The way to the controller's task. Cheap to clone; sends never block.
#[derive(Clone)]
pub(crate) struct ControlHandle {
    tx: mpsc::UnboundedSender<Command>,
}

/// The task is gone (the server is stopping).
fn stopped() -> CommandError {
    CommandError::UnknownModel("hangar/stopping".parse().expect("a valid key"))
}

impl ControlHandle {
    pub fn new() -> (Self, mpsc::UnboundedReceiver<Command>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (ControlHandle { tx }, rx)
    }

    pub fn send(&self, command: Command) {
        // Only fails when the server is stopping, when nothing needs it.
        let _ = self.tx.send(command);
    }

    /// The hook a model's processor calls when a request has to wait: one
    /// `Waiting` at a time per model (`pending`, cleared when the task
    /// handles it), so a flood of queued requests is one message.
    pub fn on_queued(&self, model: ModelKey, pending: Arc<AtomicBool>) -> crate::processor::OnQueued {
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
    pub async fn scaling(&self, model: &ModelKey, command: ScalingCommand) -> Result<(), CommandError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Scaling { model: model.clone(), command, reply });
        rx.await.unwrap_or_else(|_| Err(stopped()))
    }

    /// Sends an eviction and waits for placement's answer (not for the
    /// engines: they follow in the background).
    ///
    /// # Cancel safety
    /// Dropping the future leaves the eviction to be carried out whole.
    pub async fn evict(&self, model: &ModelKey, replica: Option<ReplicaId>) -> Result<usize, CommandError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Evict { model: model.clone(), replica, reply });
        rx.await.unwrap_or_else(|_| Err(stopped()))
    }

    /// Every model's scaling state and deployments.
    pub async fn status(&self) -> Status {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Status { reply });
        rx.await.unwrap_or_default()
    }
}

/// Runs the controller until the server is dropped (its handle closes).
pub(crate) async fn run(
    inner: Weak<Inner>,
    mut controller: Controller,
    mut rx: mpsc::UnboundedReceiver<Command>,
) {
    let mut next_tick = tokio::time::Instant::now();
    loop {
        let epoch = match inner.upgrade() {
            Some(i) => i.epoch,
            None => return,
        };
        let due = epoch
            .checked_add(Duration::from_millis(controller.poll_timeout()))
            .map_or(next_tick, tokio::time::Instant::from_std);
        let wake = next_tick.min(due);
        tokio::select! {
            command = rx.recv() => {
                let Some(command) = command else { return };
                let Some(inner) = inner.upgrade() else { return };
                handle(&inner, &mut controller, command);
            }
            () = tokio::time::sleep_until(wake) => {}
        }
        let Some(inner) = inner.upgrade() else { return };
        let now = inner.now();
        let tick = tokio::time::Instant::now() >= next_tick;
        // Decisions are taken on what the models are now, not on the last
        // tick's view.
        if tick || controller.poll_timeout() <= now {
            for rt in inner.models.values() {
                let (obs, in_flight) = observe(rt, 0);
                controller.observe(now, &rt.config.key, obs, &in_flight);
            }
        }
        if tick {
            next_tick += TICK;
        }
        controller.handle_timeout(now);
        carry_out(&inner, &mut controller);
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
            ReplicaState::Starting => starting += 1,
            ReplicaState::Ready => {
                ready += 1;
                ready_ids.push(id);
            }
            ReplicaState::Draining | ReplicaState::Sleeping => sleeping += 1,
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

fn handle(inner: &Arc<Inner>, controller: &mut Controller, command: Command) {
    let now = inner.now();
    match command {
        Command::Waiting(model) => {
            if let Some(rt) = inner.models.get(model.as_str()) {
                rt.waiting_signal.store(false, Ordering::Release);
                let (obs, in_flight) = observe(rt, 1);
                controller.observe(now, &model, obs, &in_flight);
            }
        }
        Command::Ready { model, tier, took } => {
            controller.handle_ready(now, &model, tier, took.as_millis() as Millis);
        }
        Command::Failed { model, replica, why, start_failed } => {
            controller.handle_failed(now, &model, replica, &why, start_failed);
        }
        Command::Scaling { model, command, reply } => {
            observe_now(inner, controller, now, &model);
            let result = match command {
                ScalingCommand::Freeze => controller.freeze(now, &model),
                ScalingCommand::Unfreeze => controller.release(now, &model),
                ScalingCommand::Pin(n) => controller.pin(now, &model, n),
            };
            let _ = reply.send(result);
        }
        Command::Evict { model, replica, reply } => {
            observe_now(inner, controller, now, &model);
            let _ = reply.send(controller.evict(now, &model, replica));
        }
        Command::Status { reply } => {
            let _ = reply.send(status(controller));
        }
    }
}

/// Shows `model` as it is now, before a command decides on it.
fn observe_now(inner: &Inner, controller: &mut Controller, now: Millis, model: &ModelKey) {
    if let Some(rt) = inner.models.get(model.as_str()) {
        let (obs, in_flight) = observe(rt, 0);
        controller.observe(now, model, obs, &in_flight);
    }
}

fn status(controller: &Controller) -> Status {
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

/// Carries out the controller's actions.
fn carry_out(inner: &Arc<Inner>, controller: &mut Controller) {
    while let Some(action) = controller.poll_action() {
        match action {
            Action::Apply(delta) => {
                let inner = inner.clone();
                tokio::spawn(async move { inner.apply(&delta).await });
            }
            Action::Decided { model, decision } => {
                let Some(rt) = inner.models.get(model.as_str()) else { continue };
                tracing::info!(%model, from = decision.previous, to = decision.desired, "scaling: {}", decision.reason);
                rt.desired.store(decision.desired, Ordering::Relaxed);
                rt.metrics.decided(decision.desired > decision.previous);
            }
            Action::Unplaceable { model, reason } => {
                let Some(rt) = inner.models.get(model.as_str()) else { continue };
                tracing::warn!(%model, "unplaceable: {reason}; retrying with back-off");
                rt.unplaceable.store(true, Ordering::Relaxed);
                rt.metrics.unplaceable(true);
                if rt.up() == 0 {
                    rt.processor.fail_waiting(&format!("no replica of `{model}` can run now: {reason}"));
                }
            }
            Action::Placeable { model } => {
                let Some(rt) = inner.models.get(model.as_str()) else { continue };
                tracing::info!(%model, "placeable again");
                rt.unplaceable.store(false, Ordering::Relaxed);
                rt.metrics.unplaceable(false);
            }
        }
    }
}
