//! The policies: each turns a model's recent observations into a
//! recommended replica count and a reason. The rules every policy keeps
//! (bounds, from zero, overrides) are [`crate::Scaler`]'s.

use std::collections::VecDeque;

use hangar_core::Millis;

use crate::config::{HangarSettings, ReplicateSettings, WorkersAiSettings};
use crate::decision::Reason;
use crate::observation::Observation;
use crate::scaler::StartTimes;

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
fn replicas(x: f64) -> u32 {
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

/// Hangar's policy.
#[derive(Debug, Clone)]
pub(crate) struct Hangar {
    s: HangarSettings,
    /// Since when the demand has been below the count, and its peak since.
    excess: Option<(Millis, u32)>,
    /// The last give-back: when, the quiet period it waited, and the
    /// count it gave back from.
    last_down: Option<(Millis, Millis, u32)>,
    /// Flap damping: the quiet period is doubled this many times (at
    /// most `flap_damping`).
    damping: u32,
}

/// What the `hangar` policy knows of its model besides the observations.
pub(crate) struct Context<'a> {
    /// Measured start times.
    pub starts: &'a StartTimes,
    /// The model's TTFT objective.
    pub slo_ttft_ms: Option<Millis>,
}

impl Hangar {
    pub fn new(s: HangarSettings) -> Self {
        Hangar { s, excess: None, last_down: None, damping: 0 }
    }

    pub fn recommend(
        &mut self,
        now: Millis,
        history: &History,
        current: u32,
        cx: &Context<'_>,
    ) -> (u32, Reason) {
        let o = history.back().expect("observed").1;
        let per_replica = f64::from(o.permits_per_replica.max(1)) * self.s.target_occupancy;
        let mut need = replicas(o.work() as f64 / per_replica);
        let mut reason = Reason::Demand { work: o.work(), per_replica };
        let missed = match (cx.slo_ttft_ms, o.ttft_p99_ms) {
            (Some(slo_ms), Some(ttft_p99_ms)) if ttft_p99_ms > slo_ms => Some((ttft_p99_ms, slo_ms)),
            _ => None,
        };
        if let Some((ttft_p99_ms, slo_ms)) = missed {
            // TTFT misses its objective while requests wait for a permit:
            // one replica more than there are, one at a time (none is added
            // while another is still loading, so a slow start cannot run
            // away). With nobody waiting a slow TTFT is the prompts' own
            // prefill, which more replicas would not shorten.
            if o.waiting > 0 && o.replicas.starting == 0 && need <= current {
                need = current.saturating_add(1);
                reason = Reason::SloMiss { ttft_p99_ms, slo_ms };
            }
        }
        // Up at once: replicas still loading count as capacity on the way,
        // so a burst is met once and not again while they load.
        if need >= current || missed.is_some() {
            self.excess = None;
            if need > current {
                self.damp(now, need);
            }
            return (need.max(current), if need > current { reason } else { Reason::Steady });
        }
        // Down only after a whole quiet period, keeping its peak.
        let Some(quiet) = self.quiet_ms(cx.starts) else {
            return (current, Reason::Steady);
        };
        let quiet = quiet.saturating_mul(1 << self.damping).min(self.s.scale_down_after_s * 1000);
        let (since, peak) = self.excess.get_or_insert((now, need));
        *peak = (*peak).max(need);
        if now.saturating_sub(*since) < quiet {
            return (current, Reason::Steady);
        }
        let peak = *peak;
        self.excess = None;
        self.last_down = Some((now, quiet, current));
        (peak, Reason::Quiet { peak })
    }

    /// Flap damping, on a step up to `need` at `now`: taking back, within
    /// the quiet period, replicas just given back (no more than there
    /// were) means the period was too short for this model's traffic — it
    /// doubles (up to `scale_down_after_s`, at most `flap_damping` times) — and a step up
    /// only after twice the period halves it again. Noisy steady traffic
    /// so settles on a period long enough not to give back replicas it
    /// wants a moment later, while a burst that grows past the old count
    /// is growth, not a flap.
    fn damp(&mut self, now: Millis, need: u32) {
        let Some((at, quiet, before)) = self.last_down.take() else { return };
        let since = now.saturating_sub(at);
        if since < quiet && need <= before {
            self.damping = (self.damping + 1).min(self.s.flap_damping);
        } else if since >= quiet.saturating_mul(2) {
            self.damping = self.damping.saturating_sub(1);
        }
    }

    /// How long the demand must stay below the replicas before one is given
    /// back: `quiet_factor` × the mean measured restart, within
    /// `min_quiet_s` and `scale_down_after_s`; `scale_down_after_s` until a
    /// restart has been measured. `None`: never (`scale_down_after_s = 0`).
    fn quiet_ms(&self, starts: &StartTimes) -> Option<Millis> {
        let longest = self.s.scale_down_after_s * 1000;
        if longest == 0 {
            return None;
        }
        let Some(restart) = starts.mean_ms() else { return Some(longest) };
        let quiet = (restart as f64 * self.s.quiet_factor) as Millis;
        Some(quiet.clamp((self.s.min_quiet_s * 1000).min(longest), longest))
    }

    /// How long an idle replica stays WARM: `warm_keep_factor` × its mean
    /// COLD start (the price of letting it go), at least `min_warm_s`.
    pub fn keep_warm_ms(&self, starts: &StartTimes) -> Millis {
        let floor = self.s.min_warm_s * 1000;
        let cold = starts.cold.map_or(0, |(ms, _)| ms) as f64;
        floor.max((cold * self.s.warm_keep_factor) as Millis)
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
