//! Hangar's policy: as many replicas as the demand needs — measured beyond
//! its noise — up at once, down only after a quiet period.
//!
//! Each rule in a line (docs/scaling.md, "`hangar` (the default)"):
//! - **Rate**: the arrival rate × mean permit time, at the lower bound of
//!   its Poisson noise, is met.
//! - **Burst**: more work than the permits *and* a surge of arrivals beyond
//!   the rate before them is met at once, by what the replicas up or
//!   loading would not clear before one more is ready.
//! - **No runaway while loading**: a queue that grows at the rate it had is
//!   no burst; with nothing finished yet, past a model's first seconds, no
//!   queue is.
//! - **Objective**: TTFT p99 above the objective while requests wait beyond
//!   what is cleared adds one replica (none while another loads); the count
//!   where it was missed is kept until the demand surely fell.
//! - **Give-back**: only when the upper bound of the demand has fitted
//!   fewer replicas for a whole quiet period (sized by the measured
//!   restart), keeping the period's peak, never while requests wait; to
//!   zero after a quiet period without work or arrivals.
//! - **Yield**: what it holds beyond what its demand's upper bound over
//!   the rate window needs goes at once to a model starving for room (the
//!   controller asks, [`Hangar::need`]), and so does a replica whose
//!   traffic is surely less than the starving model's
//!   ([`Hangar::rate_band`]): a GPU serves the model that has more for it.

use hangar_core::Millis;

use crate::config::HangarSettings;
use crate::decision::Reason;
use crate::demand::{Demand, Side};
use crate::observation::Observation;
use crate::policy::{replicas, History};
use crate::scaler::StartTimes;

/// Hangar's policy.
#[derive(Debug, Clone)]
pub(crate) struct Hangar {
    pub(crate) s: HangarSettings,
    demand: Demand,
    /// Since when the demand has fitted fewer replicas, and its peak since.
    excess: Option<(Millis, u32)>,
    /// What the demand needed at the last decision, over the rate window.
    need: Option<u32>,
    /// The arrival rate's noise band (per ms) at the last decision.
    rate_band: Option<(f64, f64)>,
    /// The count at which the objective was last missed while requests
    /// waited, and the demand's lower bound (permits) then.
    missed: Option<(u32, f64)>,
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
        Hangar { s, demand: Demand::default(), excess: None, need: None, rate_band: None, missed: None }
    }

    pub fn recommend(
        &mut self,
        now: Millis,
        history: &History,
        current: u32,
        cx: &Context<'_>,
    ) -> (u32, Reason) {
        let o = history.back().expect("observed").1;
        let quiet = self.quiet_ms(cx.starts);
        let window = (self.s.rate_window_s * 1000).max(quiet.unwrap_or(0));
        self.demand.sample(now, &o, window);
        let per_replica = f64::from(o.permits_per_replica.max(1)) * self.s.target_occupancy;
        let z = self.s.noise_z;
        let expected = self.demand.permits(window, 0.0, Side::Upper);

        // What the demand needs of the count now, for a give-back (none
        // once idle: the quiet period guards that) and for a yield to a
        // model waiting for room (a model between two of its requests
        // still needs the replica the next one will use).
        // Both over the rate window alone: another model's wait is counted
        // in tens of seconds, not in this one's quiet period.
        let fits = self.fits(&o, current, per_replica, window, true);
        let rate_window = self.s.rate_window_s * 1000;
        self.need = Some(self.fits(&o, current, per_replica, rate_window, false));
        let band = |side| self.demand.rate(rate_window, z, side);
        self.rate_band = band(Side::Lower).zip(band(Side::Upper));

        let (mut need, mut reason) = (0, Reason::Steady);
        if let Some(burst) = self.burst(&o, current, per_replica, expected, cx) {
            (need, reason) = (burst, Reason::Demand { work: o.work(), per_replica });
        }
        if let Some(low) = self.demand.permits(window / 3, z, Side::Lower) {
            let by_rate = replicas(low / per_replica);
            if by_rate > need {
                (need, reason) = (by_rate, Reason::Rate { permits: low, per_replica });
            }
        }
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
            if o.waiting > 0
                && o.replicas.starting == 0
                && need <= current
                && self.uncleared(&o, current, per_replica, expected, cx) > 0.0
            {
                need = current.saturating_add(1);
                reason = Reason::SloMiss { ttft_p99_ms, slo_ms };
                let low = self.demand.permits(window, z, Side::Lower);
                self.missed = Some((current, low.unwrap_or(o.work() as f64)));
            }
        }
        // Up at once: replicas still loading count as capacity on the way,
        // so a burst is met once and not again while they load. Nothing is
        // given back while the objective is missed with work present (an
        // idle model's misses are of requests gone).
        if need > current || (missed.is_some() && o.work() > 0) {
            self.excess = None;
            return (need.max(current), if need > current { reason } else { Reason::Steady });
        }
        // Down only when the demand's upper bound has fitted fewer replicas
        // for a whole quiet period, keeping the period's peak.
        let Some(quiet) = quiet else { return (current, Reason::Steady) };
        if fits >= current {
            self.excess = None;
            return (current, Reason::Steady);
        }
        let (since, peak) = self.excess.get_or_insert((now, fits));
        *peak = (*peak).max(fits);
        if now.saturating_sub(*since) < quiet {
            return (current, Reason::Steady);
        }
        let peak = *peak;
        self.excess = None;
        (peak, Reason::Quiet { peak })
    }

    /// What the model needs of its `current` replicas: none when idle
    /// (nothing running, waiting or arrived since the last decision) if
    /// `idle_is_none` (else all, until the demand is measured), all
    /// while requests wait, else those its demand's upper bound and the
    /// requests running need — and no fewer than one more than a count at
    /// which the objective was missed, unless the demand fell beyond its
    /// noise since: its upper bound now below its lower bound then (misses
    /// come with the rate's upward swings, so a swing back is no reason
    /// to return).
    fn fits(
        &self,
        o: &Observation,
        current: u32,
        per_replica: f64,
        window: Millis,
        idle_is_none: bool,
    ) -> u32 {
        let z = self.s.noise_z;
        let high = self.demand.permits(window, z, Side::Upper);
        let fits = match high {
            _ if idle_is_none && o.work() == 0 && !self.demand.arrived() => 0,
            _ if o.waiting > 0 => current,
            Some(high) => replicas(high / per_replica).max(replicas(f64::from(o.in_flight) / per_replica)),
            // Nothing measured yet: the work present is all there is — to
            // scale on; to yield, the count stands (a model between two
            // requests is not known to need less).
            None if idle_is_none => replicas(o.work() as f64 / per_replica),
            None => current,
        };
        let floor = match self.missed {
            Some((count, then)) if high.is_none_or(|now| now >= then) => count + 1,
            _ => 0,
        };
        fits.max(floor.min(current))
    }

    /// The replicas the model's demand needed at the last decision (`None`
    /// before one): what it keeps when it yields the rest to a model
    /// waiting for room.
    pub fn need(&self) -> Option<u32> {
        self.need
    }

    /// The arrival rate's band (lower, upper; requests per ms) over the
    /// rate window at the last decision, `None` before the window is a
    /// third sampled: whose traffic is surely the larger, when two models
    /// want one GPU.
    pub fn rate_band(&self) -> Option<(f64, f64)> {
        self.rate_band
    }

    /// The replicas a queue calls for at once, if it is a burst: more
    /// work than the replicas' permits *and* arrivals beyond the noise of
    /// the rate before them (a queue the same traffic formed by chance is
    /// the objective's business, not a burst's). Once a request's permit
    /// time and a restart have been measured, a queue the `current`
    /// replicas clear before one more would be ready calls for none, and
    /// what they would not clear calls for the replicas that finish it
    /// within a restart (or a request's time, if longer) beside the
    /// traffic itself — so a queue that piled up while a slow load ran is
    /// met by what drains it, not by a replica per queued request. Before,
    /// each request running or waiting holds a permit.
    fn burst(
        &self,
        o: &Observation,
        current: u32,
        per_replica: f64,
        expected: Option<f64>,
        cx: &Context<'_>,
    ) -> Option<u32> {
        let work = o.work() as f64;
        let capacity = f64::from(current) * per_replica;
        let window_ms = self.s.rate_window_s * 1000;
        // Tested at every decision, an hour of steady traffic tries it
        // thousands of times: one standard deviation more than the rate's
        // bounds keeps chance surges to about one in a day.
        let surge = self.demand.surge(window_ms / 12, window_ms, self.s.noise_z + 1.0);
        if work <= capacity || surge == Some(false) {
            return None;
        }
        // Past a model's first seconds, with replicas up or loading but no
        // request finished, a queue is the load's own: nothing says yet
        // what a replica serves.
        if surge.is_some() && self.demand.service_ms().is_none() && o.replicas.up() > 0 {
            return None;
        }
        let Some((service_ms, restart_ms)) = self.timings(o, cx) else {
            return Some(replicas(work / per_replica));
        };
        let load = expected.unwrap_or(f64::from(o.in_flight));
        let horizon_ms = (restart_ms as f64).max(service_ms).max(1.0);
        let rest = self.uncleared(o, current, per_replica, expected, cx);
        (rest > 0.0).then(|| replicas((load + rest * service_ms / horizon_ms) / per_replica))
    }

    /// A request's mean permit time and one more replica's restart, once
    /// both have been measured.
    fn timings(&self, o: &Observation, cx: &Context<'_>) -> Option<(f64, Millis)> {
        Some((self.demand.service_ms()?, restart_ms(cx.starts, o)?))
    }

    /// The queued requests the `current` replicas' spare permits would
    /// not have finished by the time one more replica is ready (all of
    /// them until a permit time and a restart are measured): what another
    /// replica could still help with.
    fn uncleared(
        &self,
        o: &Observation,
        current: u32,
        per_replica: f64,
        expected: Option<f64>,
        cx: &Context<'_>,
    ) -> f64 {
        let capacity = f64::from(current) * per_replica;
        let backlog = f64::from(o.waiting);
        let Some((service_ms, restart_ms)) = self.timings(o, cx) else {
            return backlog;
        };
        let load = expected.unwrap_or(f64::from(o.in_flight));
        let clears = (capacity - load).max(0.0) * restart_ms as f64 / service_ms.max(1.0);
        backlog - clears
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
}

/// How long one more replica would take to be ready, as measured: a WARM
/// wake when a copy sleeps (`None` until one has been: a wake may be far
/// quicker than a load, and assuming a load would hold back replicas a
/// burst needs), else a COLD start (a wake's time when no load has been
/// measured: the least it can take).
fn restart_ms(starts: &StartTimes, o: &Observation) -> Option<Millis> {
    let restart = if o.replicas.sleeping > 0 { starts.warm } else { starts.cold.or(starts.warm) };
    restart.map(|(ms, _)| ms)
}
