//! [`Scaler`]: one model's autoscaler, the policy its config names wrapped
//! in the rules every policy keeps.

use std::collections::VecDeque;

use hangar_core::Millis;
use serde::Serialize;

use crate::config::ScalingConfig;
use crate::decision::{Decision, DecisionLog, Reason};
use crate::observation::Observation;
use crate::policy::{Context, Hangar, Policy, Replicate, WorkersAi};

/// A model's replica bounds: `min_replicas` and `max_replicas`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Bounds {
    /// Never fewer.
    pub min: u32,
    /// Never more (at least 1).
    pub max: u32,
}

impl Bounds {
    /// Whether a model can run within them: at least one replica at most,
    /// and no more at least than at most. (What a policy adds — `fixed`
    /// needs `min` ≥ 1 — is [`ScalingConfig::check_bounds`].)
    pub fn check(self) -> Result<(), String> {
        match self {
            Bounds { max: 0, .. } => Err("the most replicas (max) must be at least 1".into()),
            Bounds { min, max } if min > max => {
                Err(format!("the fewest replicas ({min}) must not exceed the most ({max})"))
            }
            _ => Ok(()),
        }
    }
}

/// An operator's kill switch on one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "mode", content = "replicas", rename_all = "snake_case")]
pub enum Override {
    /// Held at the count it had when frozen.
    Frozen(u32),
    /// Held at a count the operator chose (within the bounds).
    Pinned(u32),
}

/// How a replica came up: from nothing, or woken from the warm cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StartTier {
    /// Weights loaded into a new engine (COLD → HOT).
    Cold,
    /// A sleeping engine woken (WARM → HOT).
    Warm,
}

/// Measured start times, as a running mean per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StartTimes {
    /// Mean COLD start, ms, and how many were measured.
    pub cold: Option<(Millis, u32)>,
    /// Mean WARM wake, ms, and how many were measured.
    pub warm: Option<(Millis, u32)>,
}

impl StartTimes {
    fn record(&mut self, tier: StartTier, ms: Millis) {
        let slot = match tier {
            StartTier::Cold => &mut self.cold,
            StartTier::Warm => &mut self.warm,
        };
        let (mean, n) = slot.unwrap_or((0, 0));
        let n = n.saturating_add(1);
        // The running mean, in integers: exact for the first, drifting by at
        // most a millisecond per sample after.
        let mean = (mean as u128 * u128::from(n - 1) + u128::from(ms)) / u128::from(n);
        *slot = Some((mean as Millis, n));
    }

    /// The mean restart over both tiers, weighted by how often each
    /// happened; `None` before the first.
    pub fn mean_ms(&self) -> Option<Millis> {
        let (cold, nc) = self.cold.unwrap_or((0, 0));
        let (warm, nw) = self.warm.unwrap_or((0, 0));
        let n = u128::from(nc) + u128::from(nw);
        (n > 0)
            .then(|| ((u128::from(cold) * u128::from(nc) + u128::from(warm) * u128::from(nw)) / n) as Millis)
    }
}

/// One model's autoscaler: a sans-IO state machine.
///
/// Inputs: [`observe`](Self::observe) the model as it is (any time; at
/// least once per decision), [`handle_timeout`](Self::handle_timeout) once
/// `now` reaches [`poll_timeout`](Self::poll_timeout), measured start
/// times ([`handle_start`](Self::handle_start)), what placement can fit
/// ([`set_placeable`](Self::set_placeable)) and an operator's kill switch
/// ([`freeze`](Self::freeze), [`pin`](Self::pin), [`release`](Self::release)).
/// Output: [`desired`](Self::desired) replicas, and the log of the
/// decisions that changed it ([`decisions`](Self::decisions)).
///
/// Whatever the policy, the result keeps these rules:
/// - it is within [`Bounds`], and within what placement can fit;
/// - while requests run or wait it is at least 1, and a model at zero with
///   a waiting request gets its decision at once, not at the policy's next
///   tick (a model is never stuck at zero while requests wait);
/// - an override holds its count until released.
///
/// `now` must not go backwards between calls.
#[derive(Debug, Clone)]
pub struct Scaler {
    policy: Policy,
    bounds: Bounds,
    /// Replicas a dedicated window keeps, whatever the policy says.
    floor: u32,
    slo_ttft_ms: Option<Millis>,
    desired: u32,
    next_at: Millis,
    /// Observations kept for the policy's windows, oldest first.
    history: VecDeque<(Millis, Observation)>,
    log: DecisionLog,
    override_: Option<Override>,
    placeable: Option<u32>,
    starts: StartTimes,
    /// Direction of the last change (+1 up, -1 down) and how many times it
    /// flipped.
    last_direction: i8,
    reversals: u64,
}

impl Scaler {
    /// A scaler for `config` (validated) within `bounds`, wanting
    /// `bounds.min` at `now`.
    pub fn new(config: &ScalingConfig, bounds: Bounds, now: Millis) -> Self {
        let policy = match config {
            ScalingConfig::Replicate(s) => Policy::Replicate(Replicate::new(s.clone())),
            ScalingConfig::WorkersAi(s) => Policy::WorkersAi(WorkersAi::new(s.clone())),
            ScalingConfig::Hangar(s) => Policy::Hangar(Hangar::new(s.clone())),
            ScalingConfig::Fixed => Policy::Fixed,
        };
        let bounds = Bounds { min: bounds.min, max: bounds.max.max(1).max(bounds.min) };
        Scaler {
            next_at: now.saturating_add(policy.interval()),
            policy,
            bounds,
            floor: 0,
            slo_ttft_ms: None,
            desired: bounds.min,
            history: VecDeque::new(),
            log: DecisionLog::default(),
            override_: None,
            placeable: None,
            starts: StartTimes::default(),
            last_direction: 0,
            reversals: 0,
        }
    }

    /// The model's TTFT objective, which the `hangar` policy scales to
    /// meet (from `slo_ttft_ms` in the model's config).
    pub fn with_objective(mut self, slo_ttft_ms: Option<Millis>) -> Self {
        self.slo_ttft_ms = slo_ttft_ms;
        self
    }

    // ---- getters -----------------------------------------------------

    /// Replicas wanted now.
    pub fn desired(&self) -> u32 {
        self.desired
    }

    /// The policy's name.
    pub fn policy(&self) -> &'static str {
        self.policy.name()
    }

    /// The bounds.
    pub fn bounds(&self) -> Bounds {
        self.bounds
    }

    /// When the next decision is due.
    pub fn poll_timeout(&self) -> Millis {
        self.next_at
    }

    /// The decisions that changed the count, oldest first (the last 120).
    pub fn decisions(&self) -> &DecisionLog {
        &self.log
    }

    /// The operator's override, if any.
    pub fn override_(&self) -> Option<Override> {
        self.override_
    }

    /// Times the count went up after going down, or down after going up.
    pub fn reversals(&self) -> u64 {
        self.reversals
    }

    /// The start times measured so far.
    pub fn start_times(&self) -> StartTimes {
        self.starts
    }

    /// How long an idle replica of this model stays WARM before it is let
    /// go (`hangar`'s `warm_keep_s`); `None`: until placement needs its
    /// room.
    pub fn keep_warm_ms(&self) -> Option<Millis> {
        match &self.policy {
            Policy::Hangar(h) => h.s.warm_keep_s.map(|s| s.saturating_mul(1000)),
            _ => None,
        }
    }

    /// The replicas the model's demand needs now, by its policy's own
    /// measure (`hangar`'s; `None` for the other policies and before the
    /// first decision): what more than that it holds, it could yield to a
    /// model waiting for room.
    pub fn need(&self) -> Option<u32> {
        match &self.policy {
            Policy::Hangar(h) => h.need().map(|n| n.max(self.bounds.min).max(self.floor)),
            _ => None,
        }
    }

    /// The arrival rate's noise band (lower, upper; requests per ms) over
    /// the policy's rate window (`hangar`'s; `None` for the other policies
    /// and before the window is a third sampled).
    pub fn rate_band(&self) -> Option<(f64, f64)> {
        match &self.policy {
            Policy::Hangar(h) => h.rate_band(),
            _ => None,
        }
    }

    /// The last observation, if any.
    pub fn latest(&self) -> Option<&Observation> {
        self.history.back().map(|(_, o)| o)
    }

    // ---- facts -------------------------------------------------------

    /// The model as it is at `now`. A model at zero replicas wanted with a
    /// request running or waiting has its next decision due at once, and so
    /// does one whose policy scales up at once (`hangar`) when the work
    /// exceeds its replicas.
    pub fn observe(&mut self, now: Millis, obs: Observation) {
        self.history.push_back((now, obs));
        let keep = self.policy.history_ms();
        while self.history.len() > 2 && self.history[1].0.saturating_add(keep) <= now {
            self.history.pop_front();
        }
        let from_zero = self.desired == 0 && obs.work() > 0;
        if self.override_.is_none() && (from_zero || self.policy.urgent(&obs, self.desired)) {
            self.next_at = self.next_at.min(now);
        }
    }

    /// A replica of this model came up from `tier` in `ms`.
    pub fn handle_start(&mut self, tier: StartTier, ms: Millis) {
        self.starts.record(tier, ms);
    }

    /// Placement can fit at most `replicas` of this model now (`None`: no
    /// limit known). The next decision takes it into account.
    pub fn set_placeable(&mut self, now: Millis, replicas: Option<u32>) {
        if self.placeable != replicas {
            self.placeable = replicas;
            self.next_at = self.next_at.min(now);
        }
    }

    /// Takes a decision if one is due at `now`; returns it if it changed
    /// the count. Early calls do nothing.
    pub fn handle_timeout(&mut self, now: Millis) -> Option<Decision> {
        if now < self.next_at {
            return None;
        }
        self.next_at = now.saturating_add(self.policy.interval());
        let &(_, latest) = self.history.back()?;
        let (mut wanted, mut reason) = match self.override_ {
            Some(Override::Frozen(n)) => (n, Reason::Frozen),
            Some(Override::Pinned(n)) => (n, Reason::Pinned),
            None => self.recommend(now, &latest),
        };
        if wanted < self.floor {
            (wanted, reason) = (self.floor, Reason::Dedicated { replicas: self.floor });
        }
        self.change(now, wanted, reason, latest)
    }

    // ---- commands ----------------------------------------------------

    /// Holds the model at its current count until [`release`](Self::release).
    pub fn freeze(&mut self, now: Millis) -> Option<Decision> {
        self.override_ = Some(Override::Frozen(self.desired));
        self.next_at = now;
        self.handle_timeout(now)
    }

    /// Holds the model at `replicas` (clamped to the bounds) until
    /// [`release`](Self::release).
    pub fn pin(&mut self, now: Millis, replicas: u32) -> Option<Decision> {
        let replicas = replicas.clamp(self.bounds.min, self.bounds.max);
        self.override_ = Some(Override::Pinned(replicas));
        self.next_at = now;
        self.handle_timeout(now)
    }

    /// Runs the model between new `bounds` from `now` (a deployment's
    /// `min_instances` / `max_instances`, changed while it serves): an
    /// override's count is clamped into them and a decision is due at
    /// once. The same bounds again change nothing, so a driver may repeat
    /// what it wants (level-triggered). `bounds` must be valid
    /// ([`Bounds::check`]).
    pub fn set_bounds(&mut self, now: Millis, bounds: Bounds) -> Option<Decision> {
        debug_assert!(bounds.check().is_ok(), "{bounds:?} was checked");
        if bounds == self.bounds {
            return None;
        }
        self.bounds = bounds;
        self.override_ = self.override_.map(|o| match o {
            Override::Frozen(n) => Override::Frozen(n.clamp(bounds.min, bounds.max)),
            Override::Pinned(n) => Override::Pinned(n.clamp(bounds.min, bounds.max)),
        });
        self.floor = self.floor.min(bounds.max);
        self.next_at = now;
        if self.history.is_empty() {
            // Nothing observed yet: decide on an idle model.
            self.history.push_back((now, Observation::default()));
        }
        self.handle_timeout(now)
    }

    /// A dedicated window keeps at least `replicas` (0: none is in force),
    /// within the bounds; the next decision is due at once.
    pub fn set_floor(&mut self, now: Millis, replicas: u32) -> Option<Decision> {
        self.floor = replicas.min(self.bounds.max);
        self.next_at = now;
        if self.history.is_empty() {
            // Nothing observed yet: decide on an idle model.
            self.history.push_back((now, Observation::default()));
        }
        self.handle_timeout(now)
    }

    /// The replicas a dedicated window keeps now (0: none).
    pub fn floor(&self) -> u32 {
        self.floor
    }

    /// Gives the model back to its policy; the next decision is due at once.
    pub fn release(&mut self, now: Millis) -> Option<Decision> {
        self.override_ = None;
        self.next_at = now;
        self.handle_timeout(now)
    }

    // ---- internals ---------------------------------------------------

    /// The policy's recommendation, kept within the rules every policy keeps.
    fn recommend(&mut self, now: Millis, latest: &Observation) -> (u32, Reason) {
        let (mut wanted, mut reason) = match &mut self.policy {
            Policy::Fixed => (self.bounds.min, Reason::Fixed),
            Policy::Replicate(p) => p.recommend(now, &self.history, self.desired),
            Policy::WorkersAi(p) => p.recommend(now, &self.history, self.desired),
            Policy::Hangar(p) => {
                let cx = Context { starts: &self.starts, slo_ttft_ms: self.slo_ttft_ms };
                p.recommend(now, &self.history, self.desired, &cx)
            }
        };
        if wanted == 0 && latest.work() > 0 && !matches!(self.policy, Policy::Fixed) {
            (wanted, reason) = (1, Reason::FromZero);
        }
        if wanted > self.bounds.max {
            reason = Reason::Capped { wanted };
            wanted = self.bounds.max;
        }
        wanted = wanted.max(self.bounds.min);
        if let Some(room) = self.placeable.filter(|room| wanted > *room) {
            reason = Reason::Unplaceable { wanted };
            wanted = room.max(self.desired.min(wanted));
        }
        (wanted, reason)
    }

    /// Gives up what the model holds beyond its [`need`](Self::need) to a
    /// model waiting for room, at once rather than after its quiet period
    /// (`Reason::Yielded`). An operator's override stands.
    pub(crate) fn yield_surplus(&mut self, now: Millis) -> Option<Decision> {
        let need = self.need()?;
        if self.override_.is_some() || need >= self.desired {
            return None;
        }
        self.set_desired(now, need, Reason::Yielded)
    }

    /// Gives up one replica to a model waiting for room whose traffic is
    /// surely more than this one's (`Reason::Yielded`); not below the
    /// model's floor or bounds. An operator's override stands.
    pub(crate) fn yield_one(&mut self, now: Millis) -> Option<Decision> {
        let least = self.bounds.min.max(self.floor);
        if self.override_.is_some() || self.desired <= least {
            return None;
        }
        self.set_desired(now, self.desired - 1, Reason::Yielded)
    }

    /// Lowers an override's count to at most `replicas`.
    pub(crate) fn lower_override(&mut self, replicas: u32) {
        self.override_ = match self.override_ {
            Some(Override::Frozen(n)) => Some(Override::Frozen(n.min(replicas))),
            Some(Override::Pinned(n)) => Some(Override::Pinned(n.min(replicas))),
            None => None,
        };
    }

    /// Sets the count outside a policy decision (an eviction), logged with
    /// `reason`.
    pub(crate) fn set_desired(&mut self, now: Millis, desired: u32, reason: Reason) -> Option<Decision> {
        let inputs = self.latest().copied().unwrap_or_default();
        self.change(now, desired, reason, inputs)
    }

    fn change(&mut self, now: Millis, desired: u32, reason: Reason, inputs: Observation) -> Option<Decision> {
        let previous = self.desired;
        if desired == previous {
            return None;
        }
        let direction = if desired > previous { 1 } else { -1 };
        if self.last_direction != 0 && direction != self.last_direction {
            self.reversals += 1;
        }
        self.last_direction = direction;
        self.desired = desired;
        let decision = Decision { at: now, previous, desired, reason, inputs };
        self.log.push(decision.clone());
        Some(decision)
    }
}
