//! [`TtftWindow`]: a model's recent times to first token, for the
//! `ttft_p99_ms` a driver puts in each [`Observation`](crate::Observation).
//!
//! The live server and the simulator keep one per model and feed it the
//! same way, so the `hangar` policy sees the same signal in both.

use std::collections::VecDeque;

use hangar_core::Millis;

/// The times to first token of a model's requests over the last
/// `window_ms`, at most `capacity` of them (the oldest go first).
#[derive(Debug, Clone)]
pub struct TtftWindow {
    window_ms: Millis,
    capacity: usize,
    /// (when the first token came, TTFT ms), oldest first.
    samples: VecDeque<(Millis, Millis)>,
    scratch: Vec<Millis>,
}

impl TtftWindow {
    /// Samples older than this are forgotten: a minute, long enough for a
    /// p99 over a few hundred requests at modest rates, short enough that a
    /// burst's queueing stops counting once the burst has been met.
    pub const WINDOW_MS: Millis = 60_000;
    /// The most samples kept: the p99 of 4096 is read from its top 41,
    /// and the sort at each observation stays cheap.
    pub const CAPACITY: usize = 4096;

    /// An empty window of [`Self::WINDOW_MS`] and [`Self::CAPACITY`].
    pub fn new() -> Self {
        TtftWindow {
            window_ms: Self::WINDOW_MS,
            capacity: Self::CAPACITY,
            samples: VecDeque::new(),
            scratch: Vec::new(),
        }
    }

    /// A request's first token came at `now`, `ttft_ms` after it arrived.
    pub fn record(&mut self, now: Millis, ttft_ms: Millis) {
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back((now, ttft_ms));
    }

    /// The p99 of the samples within the window ending at `now`; `None`
    /// when there are none.
    pub fn p99(&mut self, now: Millis) -> Option<Millis> {
        self.forget(now);
        self.p99_where(|_| true)
    }

    /// The p99 of the samples whose first token came after `from` and at
    /// or before `to` (within the window ending at `to`); `None` when
    /// there are none. A status page's TTFT over each of its intervals.
    pub fn p99_between(&mut self, from: Millis, to: Millis) -> Option<Millis> {
        self.forget(to);
        self.p99_where(|t| from < t && t <= to)
    }

    /// Forgets the samples older than the window ending at `now`.
    fn forget(&mut self, now: Millis) {
        let from = now.saturating_sub(self.window_ms);
        while self.samples.front().is_some_and(|(t, _)| *t < from) {
            self.samples.pop_front();
        }
    }

    /// The nearest-rank p99 of the samples whose time `keep` accepts.
    fn p99_where(&mut self, keep: impl Fn(Millis) -> bool) -> Option<Millis> {
        self.scratch.clear();
        self.scratch.extend(self.samples.iter().filter(|(t, _)| keep(*t)).map(|(_, ms)| *ms));
        if self.scratch.is_empty() {
            return None;
        }
        // The nearest-rank p99: the ceil(0.99 n)-th smallest.
        let rank = (self.scratch.len() * 99).div_ceil(100).max(1) - 1;
        Some(*self.scratch.select_nth_unstable(rank).1)
    }
}

impl Default for TtftWindow {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p99_is_the_nearest_rank_of_recent_samples_only() {
        let mut w = TtftWindow::new();
        assert_eq!(w.p99(0), None);
        for i in 1..=100 {
            w.record(1_000, i * 10);
        }
        assert_eq!(w.p99(1_000), Some(990));
        w.record(2_000, 5_000);
        assert_eq!(w.p99(2_000), Some(1_000), "101 samples: the 100th smallest");
        // A minute later the first hundred have gone.
        assert_eq!(w.p99(61_500), Some(5_000));
        assert_eq!(w.p99(62_001), None);
    }

    #[test]
    fn an_intervals_p99_counts_only_its_own_samples() {
        let mut w = TtftWindow::new();
        for i in 1..=100 {
            w.record(1_000 + i, i);
        }
        w.record(6_000, 7_000);
        assert_eq!(w.p99_between(1_000, 5_000), Some(99));
        assert_eq!(w.p99_between(5_000, 10_000), Some(7_000));
        assert_eq!(w.p99_between(6_000, 10_000), None, "a sample at `from` is the last interval's");
        assert_eq!(w.p99_between(10_000, 15_000), None);
        assert_eq!(w.p99(10_000), Some(100), "the minute's p99 counts every interval's samples");
    }

    #[test]
    fn the_oldest_go_first_beyond_the_capacity() {
        let mut w = TtftWindow::new();
        w.record(0, 1_000_000);
        for _ in 0..TtftWindow::CAPACITY {
            w.record(1, 1);
        }
        assert_eq!(w.p99(1), Some(1));
    }
}
