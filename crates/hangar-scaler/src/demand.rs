//! The demand on a model, measured from its counters with the noise of
//! Poisson arrivals: how many permits its traffic needs, and how sure the
//! measure is.
//!
//! Little's law gives the mean number of requests in the model — the
//! permits its traffic holds — as the arrival rate times the mean time a
//! request holds a permit. Both come from cumulative counters, sampled at
//! each decision. Arrivals are counted, so the rate is known only up to
//! the noise of a count: `n` arrivals in a window say the rate lies
//! within `(n ± z·√n) / window` with the confidence `z` standard
//! deviations give; the mean permit time, a mean of the requests that
//! finished, is known up to its own noise, which widens the band. The
//! `hangar` policy goes up on the lower bound and
//! gives back on the upper one, so a reversal needs the measure to swing
//! by twice the noise band — which steady traffic, however bursty its
//! seconds, does not do.

use std::collections::VecDeque;

use hangar_core::Millis;

use crate::observation::Observation;

/// Counters at one decision.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Millis,
    arrivals: u64,
    completions: u64,
    busy_ms: u64,
}

/// A model's counters over the last window, and its mean permit time.
#[derive(Debug, Clone, Default)]
pub(crate) struct Demand {
    samples: VecDeque<Sample>,
    /// The mean permit-milliseconds of a request, last measured (`None`
    /// until a request has finished).
    service_ms: Option<f64>,
    /// How many requests that mean is of.
    service_done: u64,
}

/// Which side of the noise band a bound is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// The least the demand can be (a step up on it is sure).
    Lower,
    /// The most the demand can be (a give-back below it is sure).
    Upper,
}

impl Demand {
    /// Records the counters of `o` at `now`, keeping `keep_ms` of them.
    /// The mean permit time is measured over what is kept, once a request
    /// has finished within it; before, the last measure stands.
    pub fn sample(&mut self, now: Millis, o: &Observation, keep_ms: Millis) {
        self.samples.push_back(Sample {
            at: now,
            arrivals: o.arrivals,
            completions: o.completions,
            busy_ms: o.busy_ms,
        });
        while self.samples.len() > 2 && self.samples[1].at.saturating_add(keep_ms) <= now {
            self.samples.pop_front();
        }
        let (first, last) = (self.samples[0], self.samples[self.samples.len() - 1]);
        let done = last.completions.saturating_sub(first.completions);
        if done > 0 {
            self.service_ms = Some(last.busy_ms.saturating_sub(first.busy_ms) as f64 / done as f64);
            self.service_done = done;
        }
    }

    /// The oldest sample taken at or after `from`. Samples are in time
    /// order and a busy model takes one at every decision (thousands in a
    /// window), so this is a binary search, not a walk.
    fn first_since(&self, from: Millis) -> Option<Sample> {
        self.samples.get(self.samples.partition_point(|s| s.at < from)).copied()
    }

    /// Whether a request arrived between the last two samples.
    pub fn arrived(&self) -> bool {
        let n = self.samples.len();
        n >= 2 && self.samples[n - 1].arrivals != self.samples[n - 2].arrivals
    }

    /// The mean permit time of a request, ms, once one has finished.
    pub fn service_ms(&self) -> Option<f64> {
        self.service_ms
    }

    /// The permits the traffic of the last `window_ms` needs, at `side`
    /// of the band `z` standard deviations of its noise wide — its arrival
    /// count's and its mean permit time's; `None` until a request has
    /// finished or while less than a third of the window has been sampled
    /// (too few arrivals to say anything).
    ///
    /// The permit time is a mean of the requests that finished, as noisy
    /// as their times are spread: taken as exponential (their standard
    /// deviation their mean), `z / √done` of it. Left out, a mean a few
    /// percent low on one measure and high on the next reads as a change
    /// of demand on steady traffic.
    pub fn permits(&self, window_ms: Millis, z: f64, side: Side) -> Option<f64> {
        let service_ms = self.service_ms?;
        let noise = z / (self.service_done as f64).sqrt();
        let service_ms = match side {
            Side::Lower => service_ms * (1.0 - noise).max(0.0),
            Side::Upper => service_ms * (1.0 + noise),
        };
        Some(self.rate(window_ms, z, side)? * service_ms)
    }

    /// The arrival rate of the last `window_ms`, per ms, at `side` of the
    /// band `z` standard deviations of its count wide; `None` while less
    /// than a third of the window has been sampled.
    pub fn rate(&self, window_ms: Millis, z: f64, side: Side) -> Option<f64> {
        let last = *self.samples.back()?;
        let from = last.at.saturating_sub(window_ms);
        let first = self.first_since(from)?;
        let span_ms = last.at.saturating_sub(first.at);
        if span_ms == 0 || span_ms < window_ms / 3 {
            return None;
        }
        let n = last.arrivals.saturating_sub(first.arrivals) as f64;
        // √(n + 1): a window without arrivals still has a rate it cannot
        // rule out.
        let spread = z * (n + 1.0).sqrt();
        let count = match side {
            Side::Lower => (n - spread).max(0.0),
            Side::Upper => n + spread,
        };
        Some(count / span_ms as f64)
    }

    /// Whether the arrivals of the last `recent_ms` are more than the
    /// rate of the rest of the last `window_ms` explains, beyond `z` standard
    /// deviations of its noise and twice over at least: a change of
    /// demand, not a queue that the same traffic formed by chance. `None` while less than a third of
    /// the window has been sampled.
    pub fn surge(&self, recent_ms: Millis, window_ms: Millis, z: f64) -> Option<bool> {
        let last = *self.samples.back()?;
        let since = |ms: Millis| {
            let from = last.at.saturating_sub(ms);
            self.first_since(from)
        };
        let (long, recent) = (since(window_ms)?, since(recent_ms)?);
        // The rate before the recent arrivals, which must not raise the
        // bar they are measured against.
        let (before_ms, recent_span) = (recent.at.saturating_sub(long.at), last.at.saturating_sub(recent.at));
        if before_ms < recent_ms || recent_span == 0 {
            return None;
        }
        let rate = recent.arrivals.saturating_sub(long.arrivals) as f64 / before_ms as f64;
        let expected = rate * recent_span as f64;
        let seen = last.arrivals.saturating_sub(recent.arrivals) as f64;
        Some(seen > (expected + z * (expected + 1.0).sqrt()).max(2.0 * expected))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(arrivals: u64, completions: u64, busy_ms: u64) -> Observation {
        Observation { arrivals, completions, busy_ms, ..Observation::default() }
    }

    #[test]
    fn the_demand_is_the_rate_times_the_permit_time_within_its_noise() {
        let mut d = Demand::default();
        assert_eq!(d.permits(60_000, 3.0, Side::Lower), None, "nothing sampled");
        // 10 arrivals a second, each holding a permit 2 s: 20 permits.
        for t in 0..=60u64 {
            d.sample(t * 1_000, &at(t * 10, t * 10, t * 10 * 2_000), 120_000);
        }
        assert_eq!(d.service_ms(), Some(2_000.0));
        let exact = d.permits(60_000, 0.0, Side::Upper).unwrap();
        assert!((exact - 20.0).abs() < 1e-9, "{exact}");
        let (low, high) =
            (d.permits(60_000, 3.0, Side::Lower).unwrap(), d.permits(60_000, 3.0, Side::Upper).unwrap());
        // 600 arrivals: ± 3 × √601 ≈ 73.5 of them, ± 2.45 permits; and
        // a permit time of 600 requests, ± 3 / √600 ≈ 12.2 % of it.
        assert!((low - 15.40).abs() < 0.01 && (high - 25.20).abs() < 0.01, "{low} {high}");
        // A shorter window is noisier.
        let short = d.permits(6_000, 3.0, Side::Upper).unwrap();
        assert!(short > high, "{short} {high}");
    }

    #[test]
    fn nothing_is_said_before_a_request_finished_or_on_a_window_barely_begun() {
        let mut d = Demand::default();
        for t in 0..=30u64 {
            d.sample(t * 1_000, &at(t * 10, 0, 0), 60_000);
        }
        assert_eq!(d.permits(30_000, 3.0, Side::Upper), None, "no permit time measured");
        let mut d = Demand::default();
        for t in 0..=10u64 {
            d.sample(t * 1_000, &at(t, t, t * 1_000), 60_000);
        }
        assert_eq!(d.permits(60_000, 3.0, Side::Upper), None, "10 s of a 60 s window");
        assert!(d.permits(30_000, 3.0, Side::Upper).is_some());
    }
}
