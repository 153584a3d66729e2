//! The policies: each turns a model's recent observations into a
//! recommended replica count and a reason. The rules every policy keeps
//! (bounds, from zero, overrides) are [`crate::Scaler`]'s.

use std::collections::VecDeque;

use hangar_core::Millis;

use crate::config::{ReplicateSettings, WorkersAiAlgorithm, WorkersAiSettings};
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

/// Workers AI's autoscaler: one of its three algorithms (seed 001), on
/// the work of a window of observations.
#[derive(Debug, Clone)]
pub(crate) struct WorkersAi {
    s: WorkersAiSettings,
    /// Cumulative busy milliseconds at each decision, kept for the
    /// forecast: as far back as its offset and a window.
    past: VecDeque<(Millis, u64)>,
}

impl WorkersAi {
    pub fn new(s: WorkersAiSettings) -> Self {
        WorkersAi { s, past: VecDeque::new() }
    }

    pub fn recommend(&mut self, now: Millis, history: &History, current: u32) -> (u32, Reason) {
        let (_, o) = *history.back().expect("observed");
        if self.s.disabled {
            return (current, Reason::Disabled);
        }
        let window_ms = self.s.window_s * 1000;
        // The window: from the oldest observation within it.
        let from = now.saturating_sub(window_ms);
        let (t0, first) = history.iter().find(|(t, _)| *t >= from).copied().unwrap_or((now, o));
        let span_ms = now.saturating_sub(t0).max(1) as f64;
        let permits = f64::from(o.permits_per_replica.max(1));
        if self.s.algorithm == WorkersAiAlgorithm::RequestCount {
            // Over the whole window, as the seed's 15-minute averages: a
            // window barely begun does not turn one request into a rate.
            let minutes = (window_ms as f64 / 60_000.0).max(span_ms / 60_000.0);
            let per_minute = o.arrivals.saturating_sub(first.arrivals) as f64 / minutes;
            let factor = self.s.scaling_factor;
            return (replicas(per_minute * factor), Reason::RequestCount { per_minute, factor });
        }
        // Replica-equivalents of work: inference time per unit of time,
        // per replica's permits (Workers AI's `required_to_fit`), or as
        // much the same window a forecast offset ago, if more.
        let mut needed = o.busy_ms.saturating_sub(first.busy_ms) as f64 / span_ms / permits;
        if self.s.use_forecast {
            self.remember(now, o.busy_ms, window_ms);
            if let Some(past) = self.forecast(now, window_ms) {
                needed = needed.max(past / permits);
            }
        }
        // What runs now counts even when nothing finished in the window yet.
        needed = needed.max(f64::from(o.in_flight) / permits);
        let (min, max, aim) = match self.s.algorithm {
            WorkersAiAlgorithm::Utilization => {
                let f = self.s.utilization_factor();
                (1.0 / (f + 0.15), 1.0 / f, 1.0 / f)
            }
            _ => {
                needed *= self.s.utilization_scale;
                if self.s.use_out_of_cap {
                    let minutes = span_ms / 60_000.0;
                    let ok = (o.completions.saturating_sub(first.completions) as f64 / minutes).max(0.1);
                    let turned_away = o.rejected.saturating_sub(first.rejected) as f64 / minutes;
                    needed *= ((ok + turned_away) / ok).min(self.s.out_of_cap_max_inflation);
                }
                (self.s.min_utilization, self.s.max_utilization, self.s.aim())
            }
        };
        // Requests waiting with nothing to serve them are demand too.
        if o.replicas.ready == 0 && o.waiting > 0 {
            needed = needed.max(f64::from(o.waiting) / permits);
        }
        // Upscale from healthy replicas, downscale from requested ones.
        let over = |n: u32| if n == 0 { f64::INFINITY } else { needed / f64::from(n) };
        let (utilization_up, utilization_down) =
            (over(o.replicas.ready), if current == 0 { 0.0 } else { over(current) });
        let sized = replicas(needed / aim);
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

    /// Keeps the busy-time counter at `now`, and what the forecast may
    /// still ask for (only a policy that forecasts keeps any).
    fn remember(&mut self, now: Millis, busy_ms: u64, window_ms: Millis) {
        self.past.push_back((now, busy_ms));
        let keep = self.s.forecast_offset_s.saturating_mul(1000).saturating_add(window_ms);
        while self.past.len() > 2 && self.past[1].0.saturating_add(keep) <= now {
            self.past.pop_front();
        }
    }

    /// Busy milliseconds per millisecond over the window that ended
    /// `forecast_offset_s` before `now` (Workers AI's same-time-last-week
    /// usage); `None` without records that far back.
    fn forecast(&self, now: Millis, window_ms: Millis) -> Option<f64> {
        let end = now.checked_sub(self.s.forecast_offset_s.saturating_mul(1000))?;
        let start = end.checked_sub(window_ms)?;
        // The last record at or before each edge.
        let at =
            |t: Millis| self.past.partition_point(|(at, _)| *at <= t).checked_sub(1).map(|i| self.past[i]);
        let ((t0, b0), (t1, b1)) = (at(start)?, at(end)?);
        (t1 > t0).then(|| b1.saturating_sub(b0) as f64 / (t1 - t0) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observation::ReplicaCounts;

    /// A model with `ready` replicas of 4 permits whose counters read
    /// `arrivals` and `busy_ms` at `at`.
    fn seen(at: Millis, arrivals: u64, busy_ms: u64, ready: u32) -> (Millis, Observation) {
        let replicas = ReplicaCounts { ready, ..ReplicaCounts::default() };
        (
            at,
            Observation {
                arrivals,
                completions: arrivals,
                busy_ms,
                permits_per_replica: 4,
                replicas,
                ..Observation::default()
            },
        )
    }

    fn workers_ai(algorithm: WorkersAiAlgorithm) -> WorkersAi {
        WorkersAi::new(WorkersAiSettings { algorithm, window_s: 60, ..WorkersAiSettings::default() })
    }

    #[test]
    fn the_request_count_algorithm_wants_a_minutes_requests_times_the_factor() {
        let mut p = workers_ai(WorkersAiAlgorithm::RequestCount);
        // 30 requests a minute over the window: 30 × 0.8 = 24 replicas.
        let history: History = [seen(0, 0, 0, 2), seen(60_000, 30, 0, 2)].into();
        let (desired, reason) = p.recommend(60_000, &history, 2);
        assert_eq!(desired, 24);
        assert_eq!(reason.to_string(), "30.0 requests a minute × 0.80");
        // A window barely begun: one request is one of the window's, not a rate.
        let history: History = [seen(0, 0, 0, 0), seen(10, 1, 0, 0)].into();
        assert_eq!(p.recommend(10, &history, 0).0, 1);
    }

    #[test]
    fn the_older_utilization_algorithm_keeps_its_deadband_around_a_factor_of_at_least_1_2() {
        let mut p = workers_ai(WorkersAiAlgorithm::Utilization);
        // 4 replicas of 4 permits; work of `load` permits for the minute.
        let mut at = |load: f64, current: u32| {
            let history: History =
                [seen(0, 0, 0, current), seen(60_000, 100, (load * 60_000.0) as u64, current)].into();
            p.recommend(60_000, &history, current)
        };
        // Utilization 0.8 is within 1/1.35 = 0.741 .. 1/1.2 = 0.833: stay.
        let (desired, reason) = at(12.8, 4);
        assert_eq!(desired, 4);
        assert_eq!(reason.to_string(), "utilization 0.80 against 0.74–0.83");
        // 0.9: up, to the work × 1.2 (3.6 × 1.2 = 4.32: 5 replicas).
        assert_eq!(at(14.4, 4).0, 5);
        // 0.5: down, to 2 × 1.2 = 2.4: 3 replicas.
        assert_eq!(at(8.0, 4).0, 3);
    }

    #[test]
    fn a_forecast_of_last_weeks_work_holds_the_count_up() {
        let week = 7 * 24 * 3_600_000;
        let mut p = workers_ai(WorkersAiAlgorithm::EzUtilization);
        // A week ago: 8 permits of work for a minute; now nothing.
        for (t, busy) in [(0, 0), (60_000, 8 * 60_000), (week, 8 * 60_000)] {
            let history: History = [seen(t, 0, busy, 4)].into();
            p.recommend(t, &history, 4);
        }
        let now = week + 60_000;
        let history: History = [seen(week, 0, 8 * 60_000, 4), seen(now, 0, 8 * 60_000, 4)].into();
        // Last week's 2 replicas of work at 0.55 utilization: 4 stay.
        assert_eq!(p.recommend(now, &history, 4).0, 4);
        let mut blind = WorkersAi::new(WorkersAiSettings {
            use_forecast: false,
            window_s: 60,
            ..WorkersAiSettings::default()
        });
        assert_eq!(blind.recommend(now, &history, 4).0, 0, "without the forecast, idle: down to nothing");
    }

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
