//! [`ControlLoop`]: the [`Controller`] with the cadence every driver gives
//! it — the live server's control task and the fleet simulation alike.
//!
//! Drivers differ in how they learn facts (HTTP handlers and engine tasks,
//! or events on a logical clock) but must feed the controller the same way
//! for the simulator to predict the server: every model observed each
//! `observe_every` and again whenever a decision or retry is due (so a
//! decision is taken on the models as they are then, not as at the last
//! tick), a request that has to wait observed and decided on at once, and
//! at one instant what is due on the clock before the facts that arrive.
//! That cadence lives here, once. A loop can also keep a record of what it
//! was told and what it decided ([`ControlLoop::recording`]), which is how
//! a test checks that two drivers drive alike.

use std::collections::BTreeSet;

use hangar_core::{Millis, ModelKey, ReplicaId};
use hangar_placement::NodeId;

use crate::controller::{Action, Controller};
use crate::observation::Observation;
use crate::scaler::StartTier;

/// The controller and its cadence.
pub struct ControlLoop {
    controller: Controller,
    every: Millis,
    next_tick: Millis,
    record: Option<Vec<Input>>,
}

/// One thing a driver told its [`ControlLoop`], or a decision the loop
/// took, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// A model as observed on a tick or before a due decision.
    Observed {
        /// When.
        at: Millis,
        /// The model.
        model: ModelKey,
        /// What was seen.
        obs: Observation,
        /// Requests in flight per ready replica.
        in_flight: Vec<(ReplicaId, u32)>,
    },
    /// A request of the model had to wait.
    Waiting {
        /// When.
        at: Millis,
        /// The model.
        model: ModelKey,
        /// What was seen (at least one waiting).
        obs: Observation,
        /// Requests in flight per ready replica.
        in_flight: Vec<(ReplicaId, u32)>,
    },
    /// A replica came up.
    Ready {
        /// When.
        at: Millis,
        /// The model.
        model: ModelKey,
        /// From where.
        tier: StartTier,
        /// How long it took.
        took_ms: Millis,
        /// Whether its engine can sleep.
        sleeps: bool,
    },
    /// A node holds these weight artifacts resident now.
    Resident {
        /// When.
        at: Millis,
        /// The node.
        node: NodeId,
        /// The artifacts.
        artifacts: BTreeSet<String>,
    },
    /// A node drains (`on`), or its drain was called off.
    Drain {
        /// When.
        at: Millis,
        /// The node.
        node: NodeId,
        /// Draining or not.
        on: bool,
    },
    /// A scaler changed a model's count.
    Decided {
        /// When.
        at: Millis,
        /// The model.
        model: ModelKey,
        /// The count before.
        previous: u32,
        /// The count after.
        desired: u32,
    },
}

impl ControlLoop {
    /// Drives `controller`, observing every model each `observe_every_ms`
    /// (at least 1) from `now` on.
    pub fn new(controller: Controller, observe_every_ms: Millis, now: Millis) -> Self {
        ControlLoop { controller, every: observe_every_ms.max(1), next_tick: now, record: None }
    }

    /// Keeps a record of every [`Input`] from now on.
    pub fn recording(mut self) -> Self {
        self.record = Some(Vec::new());
        self
    }

    /// The record so far (empty unless [`recording`](Self::recording)).
    pub fn take_record(&mut self) -> Vec<Input> {
        self.record.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn note(&mut self, input: impl FnOnce() -> Input) {
        if let Some(record) = self.record.as_mut() {
            record.push(input());
        }
    }

    /// The controller, for its state and status.
    pub fn controller(&self) -> &Controller {
        &self.controller
    }

    /// The controller, for operators' commands (freeze, pin, evict, a
    /// schedule), which act at once.
    pub fn controller_mut(&mut self) -> &mut Controller {
        &mut self.controller
    }

    /// When [`handle_timeout`](Self::handle_timeout) is next due: the next
    /// tick, or the controller's next decision or retry if sooner.
    pub fn poll_timeout(&self) -> Millis {
        self.next_tick.min(self.controller.poll_timeout())
    }

    /// Whether every model must be [observed](Self::observe) before
    /// [`handle_timeout`](Self::handle_timeout) at `now`: a tick is due, or
    /// a decision or retry.
    pub fn wants_observations(&self, now: Millis) -> bool {
        self.poll_timeout() <= now
    }

    /// Shows the controller `model` as it is at `now`.
    pub fn observe(
        &mut self,
        now: Millis,
        model: &ModelKey,
        obs: Observation,
        in_flight: &[(ReplicaId, u32)],
    ) {
        self.note(|| Input::Observed { at: now, model: model.clone(), obs, in_flight: in_flight.to_vec() });
        self.controller.observe(now, model, obs, in_flight);
    }

    /// A request of `model` had to wait: the model as it is now (`obs`
    /// counting that request among the waiting) is observed and decided
    /// on at once, rather than at the next tick.
    pub fn waiting(
        &mut self,
        now: Millis,
        model: &ModelKey,
        obs: Observation,
        in_flight: &[(ReplicaId, u32)],
    ) {
        self.note(|| Input::Waiting { at: now, model: model.clone(), obs, in_flight: in_flight.to_vec() });
        self.controller.observe(now, model, obs, in_flight);
        self.controller.handle_model_timeout(now, model);
    }

    /// A replica of `model` came up from `tier` after `took_ms`, on an
    /// engine that can (`sleeps`) or cannot sleep
    /// ([`Controller::handle_ready`]).
    pub fn handle_ready(
        &mut self,
        now: Millis,
        model: &ModelKey,
        tier: StartTier,
        took_ms: Millis,
        sleeps: bool,
    ) {
        self.note(|| Input::Ready { at: now, model: model.clone(), tier, took_ms, sleeps });
        self.controller.handle_ready(now, model, tier, took_ms, sleeps);
    }

    /// `node` holds `artifacts` resident now
    /// ([`Controller::set_resident`]); a node no longer in the cluster is
    /// passed over.
    pub fn set_resident(&mut self, now: Millis, node: &NodeId, artifacts: BTreeSet<String>) {
        self.note(|| Input::Resident { at: now, node: node.clone(), artifacts: artifacts.clone() });
        let _ = self.controller.set_resident(node, artifacts);
    }

    /// Drains `node` (`on`) or calls its drain off ([`Controller::drain`];
    /// observe every model first, as for any command); a node no longer in
    /// the cluster is passed over.
    pub fn drain(&mut self, now: Millis, node: &NodeId, on: bool) {
        self.note(|| Input::Drain { at: now, node: node.clone(), on });
        let _ = self.controller.drain(now, node, on);
    }

    /// Takes what is due at `now` (call after observing every model when
    /// [`wants_observations`](Self::wants_observations) said so). Early
    /// calls do nothing.
    pub fn handle_timeout(&mut self, now: Millis) {
        if self.next_tick <= now {
            // The next tick after `now`: a late driver skips the ticks it
            // missed rather than running them back to back.
            self.next_tick = now - (now - self.next_tick) % self.every + self.every;
        }
        self.controller.handle_timeout(now);
    }

    /// The controller's next action for the driver.
    pub fn poll_action(&mut self) -> Option<Action> {
        let action = self.controller.poll_action()?;
        if let Action::Decided { model, decision } = &action {
            let (at, previous, desired) = (decision.at, decision.previous, decision.desired);
            self.note(|| Input::Decided { at, model: model.clone(), previous, desired });
        }
        Some(action)
    }
}
