//! The policies: each turns a model's recent observations into a
//! recommended replica count and a reason. The rules every policy keeps
//! (bounds, from zero, overrides) are [`crate::Scaler`]'s.

use std::collections::VecDeque;

use hangar_core::Millis;

use crate::config::{ReplicateSettings, WorkersAiSettings};
use crate::decision::Reason;
pub(crate) use crate::hangar::{Context, Hangar};
use crate::observation::Observation;

/// Observations with their time, oldest first (never empty when a policy
/// is asked).
pub(crate) type History = VecDeque<(Millis, Observation)>;

#[derive(Debug, Clone)]
pub(crate) enum Policy {
    Replicate(Replicate),
    WorkersAi(WorkersAi),
    Hangar(Hangar),
    Fixed,
}

impl Policy {
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Replicate(_) => "replicate",
            Policy::WorkersAi(_) => "workers-ai",
            Policy::Hangar(_) => "hangar",
            Policy::Fixed => "fixed",
        }
    }

    /// Time between decisions.
    pub fn interval(&self) -> Millis {
        match self {
            Policy::Replicate(p) => p.s.interval_ms,
            Policy::WorkersAi(p) => p.s.interval_s * 1000,
            Policy::Hangar(p) => p.s.interval_ms,
            Policy::Fixed => 1_000,
        }
    }

    /// Whether `obs` calls for a decision now rather than at the next tick:
    /// the `hangar` policy scales up at once when the work exceeds what
    /// the wanted replicas can hold.
    pub fn urgent(&self, obs: &Observation, desired: u32) -> bool {
        match self {
            Policy::Hangar(p) => {
                let per_replica = f64::from(obs.permits_per_replica.max(1)) * p.s.target_occupancy;
                obs.work() as f64 > f64::from(desired) * per_replica
            }
            _ => false,
        }
    }

    /// How far back observations are needed.
    pub fn history_ms(&self) -> Millis {
        match self {
            Policy::WorkersAi(p) => p.s.window_s * 1000,
            _ => 0,
        }
    }
}

/// `ceil(x)` of a non-negative amount of replicas, saturating.
pub(crate) fn replicas(x: f64) -> u32 {
    if x.is_nan() || x <= 0.0 {
        0
    } else if x >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        // Amounts a hair above an integer from float noise stay there.
        let rounded = x.round();
        if (x - rounded).abs() < 1e-9 {
            rounded as u32
        } else {
            x.ceil() as u32
        }
    }
}

/// Replicate's backlog-per-instance HPA (`computeNewReplicaCountV2`).
#[derive(Debug, Clone)]
pub(crate) struct Replicate {
    s: ReplicateSettings,
    /// Raw recommendations within the longest stabilization window.
    recommendations: VecDeque<(Millis, u32)>,
    /// The count wanted over the last scale-out period (time it took
    /// effect, count), for the rate limit.
    counts: VecDeque<(Millis, u32)>,
    /// The last moment the model had work or an arrival.
    busy_at: Option<Millis>,
    last_arrivals: u64,
}

impl Replicate {
    pub fn new(s: ReplicateSettings) -> Self {
        Replicate {
            s,
            recommendations: VecDeque::new(),
            counts: VecDeque::new(),
            busy_at: None,
            last_arrivals: 0,
        }
    }

    pub fn recommend(&mut self, now: Millis, history: &History, current: u32) -> (u32, Reason) {
        let o = history.back().expect("observed").1;
        if o.work() > 0 || o.arrivals != self.last_arrivals {
            self.busy_at = Some(now);
        }
        self.last_arrivals = o.arrivals;
        let target = self.s.target_backlog_per_replica.unwrap_or(f64::from(o.permits_per_replica.max(1)));
        let backlog = (o.work() + u64::from(self.s.queue_headroom)) as f64;
        let per_replica = backlog / f64::from(current.max(1));
        let ratio = per_replica / target;
        let mut recommended = if current > 0 && (ratio - 1.0).abs() <= self.s.hysteresis {
            current
        } else {
            replicas(backlog / target)
        };
        // Scale to zero only after the idle delay.
        let idle = self.busy_at.is_none_or(|t| now.saturating_sub(t) >= self.s.scale_to_zero_delay_s * 1000);
        if recommended == 0 && current > 0 && !idle {
            recommended = 1;
        }
        let reason = Reason::Backlog { per_replica, target, recommended };

        // Stabilization: the lowest recommendation of the scale-out window
        // for going up, the highest of the scale-in window for going down
        // (Kubernetes' HPA behaviour, which Replicate's algorithm follows).
        self.recommendations.push_back((now, recommended));
        let longest = self.s.scale_out_window_s.max(self.s.scale_in_window_s) * 1000;
        while self.recommendations.front().is_some_and(|(t, _)| t.saturating_add(longest) < now) {
            self.recommendations.pop_front();
        }
        let within = |window_s: u64| {
            let from = now.saturating_sub(window_s * 1000);
            self.recommendations.iter().filter(move |(t, _)| *t >= from).map(|(_, r)| *r)
        };
        let up = within(self.s.scale_out_window_s).min().unwrap_or(recommended);
        let down = within(self.s.scale_in_window_s).max().unwrap_or(recommended);
        let mut desired = if up > current {
            up
        } else if down < current {
            down
        } else {
            current
        };

        // Scale-out policy: +step or +percent per period, whichever is larger,
        // from the count in effect at the period's start.
        let period = self.s.scale_out_period_s * 1000;
        while self.counts.len() > 1 && self.counts[1].0.saturating_add(period) <= now {
            self.counts.pop_front();
        }
        let base = self.counts.front().map_or(current, |(_, c)| *c).min(current);
        if desired > current {
            let by_step = base.saturating_add(self.s.scale_out_step);
            let by_percent = u64::from(base) + u64::from(base) * u64::from(self.s.scale_out_percent) / 100;
            let limit = by_step.max(by_percent.min(u64::from(u32::MAX)) as u32);
            desired = desired.min(limit.max(current));
        }
        // Slow start: few replicas until one has shown it can start.
        if o.replicas.ready == 0 {
            desired = desired.min(self.s.slow_start_cap.max(current.min(self.s.slow_start_cap)));
        }
        if let Some(cap) = self.s.cap_max_replicas {
            desired = desired.min(cap);
        }
        if desired != current {
            self.counts.push_back((now, desired));
        }
        (desired, reason)
    }
}

/// Workers AI's EZ utilization loop.
#[derive(Debug, Clone)]
pub(crate) struct WorkersAi {
    s: WorkersAiSettings,
}

impl WorkersAi {
    pub fn new(s: WorkersAiSettings) -> Self {
        WorkersAi { s }
    }

    pub fn recommend(&mut self, now: Millis, history: &History, current: u32) -> (u32, Reason) {
        let (_, o) = *history.back().expect("observed");
        let (min, max) = (self.s.min_utilization, self.s.max_utilization);
        if self.s.disabled {
            return (current, Reason::Disabled);
        }
        // The window: from the oldest observation within it.
        let from = now.saturating_sub(self.s.window_s * 1000);
        let (t0, first) = history.iter().find(|(t, _)| *t >= from).copied().unwrap_or((now, o));
        let span_ms = now.saturating_sub(t0).max(1) as f64;
        let permits = f64::from(o.permits_per_replica.max(1));
        // Replica-equivalents of work: inference time per unit of time,
        // per replica's permits (Workers AI's `required_to_fit`).
        let mut needed = o.busy_ms.saturating_sub(first.busy_ms) as f64 / span_ms / permits;
        // What runs now counts even when nothing finished in the window yet.
        needed = needed.max(f64::from(o.in_flight) / permits);
        needed *= self.s.utilization_scale;
        if self.s.use_out_of_cap {
            let minutes = span_ms / 60_000.0;
            let ok = (o.completions.saturating_sub(first.completions) as f64 / minutes).max(0.1);
            let turned_away = o.rejected.saturating_sub(first.rejected) as f64 / minutes;
            needed *= ((ok + turned_away) / ok).min(self.s.out_of_cap_max_inflation);
        }
        // Requests waiting with nothing to serve them are demand too.
        if o.replicas.ready == 0 && o.waiting > 0 {
            needed = needed.max(f64::from(o.waiting) / permits);
        }
        // Upscale from healthy replicas, downscale from requested ones.
        let healthy = o.replicas.ready;
        let utilization_up = if healthy == 0 { f64::INFINITY } else { needed / f64::from(healthy) };
        let utilization_down = if current == 0 { 0.0 } else { needed / f64::from(current) };
        let sized = replicas(needed / self.s.aim());
        let (desired, utilization) = if needed > 0.0 && utilization_up > max {
            (sized.max(current), utilization_up)
        } else if utilization_down < min {
            (sized.max(current.saturating_sub(self.s.max_downscale_per_cycle)).min(current), utilization_down)
        } else {
            (current, utilization_down)
        };
        let utilization = if utilization.is_finite() { utilization } else { f64::MAX };
        (desired, Reason::Utilization { utilization, min, max })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_counts_round_up_but_not_float_noise() {
        assert_eq!(replicas(0.0), 0);
        assert_eq!(replicas(0.01), 1);
        assert_eq!(replicas(2.0), 2);
        assert_eq!(replicas(2.000_000_000_1), 2);
        assert_eq!(replicas(2.1), 3);
        assert_eq!(replicas(f64::INFINITY), u32::MAX);
        assert_eq!(replicas(f64::NAN), 0);
    }
}
