//! A model's recent minutes, point by point: what the status page (`/ui`)
//! plots — requests per second and TTFT p99 — with the line and the
//! permits at each point.
//!
//! It is sans-IO: the server's sampling task ([`super::sample`]) hands in
//! each model's cumulative counters, the p99 of the TTFTs since the last
//! point and the line as they stand every [`HISTORY_EVERY`], with both
//! clocks' readings; the history turns counters into rates over the time
//! that really passed between two points (a late tick makes a longer
//! interval, not a wrong rate).

use std::collections::VecDeque;
use std::time::Duration;

use hangar_core::Millis;
use serde::Serialize;

use crate::processor::Counters;

/// How often a point is taken.
pub(crate) const HISTORY_EVERY: Duration = Duration::from_secs(5);

/// Points kept: ten minutes of [`HISTORY_EVERY`].
pub(crate) const HISTORY_POINTS: usize = 120;

/// One point of a model's history: the interval that ended at `at_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct HistoryPoint {
    /// When the interval ended, ms since the Unix epoch.
    pub at_ms: u64,
    /// Its length, ms.
    pub interval_ms: Millis,
    /// Requests (synchronous and async) that asked for a permit in it,
    /// per second.
    pub requests_per_s: f64,
    /// Requests that gave their permit back in it, per second.
    pub completed_per_s: f64,
    /// Requests the full line turned away in it (429), per second.
    pub rejected_per_s: f64,
    /// p99 of the synchronous requests' TTFTs whose first token came in
    /// it, ms (none without one).
    pub ttft_p99_ms: Option<Millis>,
    /// Requests waiting for a permit at its end.
    pub waiting: usize,
    /// Permits held at its end.
    pub in_flight: u32,
}

/// What the sampling task reads of a model at one point.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct Reading {
    /// ms since the Unix epoch.
    pub at_ms: u64,
    /// The monotonic clock's reading, ms.
    pub now: Millis,
    /// The processor's cumulative counters.
    pub counters: Counters,
    /// p99 of the TTFTs since the last reading.
    pub ttft_p99_ms: Option<Millis>,
    pub waiting: usize,
    pub in_flight: u32,
}

/// The last [`HISTORY_POINTS`] points of one model, oldest first.
///
/// Invariant after every call: at most [`HISTORY_POINTS`] points, their
/// `at_ms` in the order they were read.
#[derive(Debug, Default)]
pub(crate) struct History {
    points: VecDeque<HistoryPoint>,
    last: Option<Reading>,
}

impl History {
    /// Adds the interval since the last reading (the first reading only
    /// starts the first interval), dropping the oldest point beyond
    /// [`HISTORY_POINTS`].
    pub fn record(&mut self, reading: Reading) {
        let Some(last) = self.last.replace(reading) else { return };
        let interval_ms = reading.now.saturating_sub(last.now);
        if interval_ms == 0 {
            self.last = Some(last);
            return;
        }
        let per_s = |now: u64, then: u64| now.saturating_sub(then) as f64 * 1000.0 / interval_ms as f64;
        let (c, l) = (reading.counters, last.counters);
        if self.points.len() == HISTORY_POINTS {
            self.points.pop_front();
        }
        self.points.push_back(HistoryPoint {
            at_ms: reading.at_ms,
            interval_ms,
            requests_per_s: per_s(c.arrivals, l.arrivals),
            completed_per_s: per_s(c.completions, l.completions),
            rejected_per_s: per_s(c.rejected, l.rejected),
            ttft_p99_ms: reading.ttft_p99_ms,
            waiting: reading.waiting,
            in_flight: reading.in_flight,
        });
    }

    /// The monotonic clock's reading at the last reading.
    pub fn last_now(&self) -> Option<Millis> {
        self.last.map(|r| r.now)
    }

    /// The points, oldest first.
    pub fn points(&self) -> Vec<HistoryPoint> {
        self.points.iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(now: Millis, arrivals: u64, completions: u64) -> Reading {
        Reading {
            at_ms: 1_700_000_000_000 + now,
            now,
            counters: Counters { arrivals, completions, ..Counters::default() },
            ..Reading::default()
        }
    }

    #[test]
    fn rates_are_over_the_time_that_really_passed() {
        let mut h = History::default();
        h.record(reading(0, 10, 10));
        assert!(h.points().is_empty(), "one reading is no interval yet");
        h.record(reading(5_000, 60, 40));
        // A late tick: 10 s, not 5.
        h.record(reading(15_000, 160, 140));
        let p = h.points();
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].requests_per_s, p[0].completed_per_s, p[0].interval_ms), (10.0, 6.0, 5_000));
        assert_eq!((p[1].requests_per_s, p[1].completed_per_s, p[1].interval_ms), (10.0, 10.0, 10_000));
        assert_eq!(p[1].at_ms, 1_700_000_015_000);
        // The same instant twice makes no point (and no division by 0).
        h.record(reading(15_000, 170, 140));
        assert_eq!(h.points().len(), 2);
    }

    #[test]
    fn only_the_last_points_are_kept() {
        let mut h = History::default();
        for i in 0..=(HISTORY_POINTS as u64 + 10) {
            h.record(reading(i * 5_000, i, i));
        }
        let p = h.points();
        assert_eq!(p.len(), HISTORY_POINTS);
        assert!(p.windows(2).all(|w| w[0].at_ms < w[1].at_ms));
        assert_eq!(p.last().unwrap().at_ms, 1_700_000_000_000 + (HISTORY_POINTS as u64 + 10) * 5_000);
    }
}
