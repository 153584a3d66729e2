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
    /// The same samples' TTFTs counted by value, for the p99.
    counts: Counts,
    scratch: Vec<Millis>,
    /// The p99 of `samples` as they were when last computed, until one is
    /// recorded or forgotten. A simulated fleet asks at every observation,
    /// often many times between two first tokens.
    p99: Option<Option<Millis>>,
}

/// A window's TTFTs counted by value, so that the sample of a given rank
/// from the top is found in a few hundred reads of counts — the p99 sits
/// near the top — and recording or forgetting one is two increments. A
/// selection over the samples themselves (thousands) cost a simulated fleet
/// a third of its time, mostly in the caches it flushed; keeping them in an
/// ordered map cost the live gateway about a microsecond on each request.
///
/// The counts per millisecond are kept per block of [`BLOCK_MS`], each
/// allocated when a sample first lands in it: a model's TTFTs fill a few
/// blocks, and a gateway serving hundreds of models holds a few KiB for
/// each rather than the 128 KiB of every millisecond up to [`FINE_MS`].
#[derive(Debug, Clone, Default)]
struct Counts {
    /// Samples per millisecond below [`FINE_MS`], by block (the table
    /// allocated at the first sample, a block at its first).
    fine: Vec<Option<Box<[u16; BLOCK_MS]>>>,
    /// Samples per [`BLOCK_MS`] below [`FINE_MS`].
    blocks: Vec<u16>,
    /// The samples of [`FINE_MS`] or more, unordered: requests waiting that
    /// long are few, or the model has bigger problems than this selection.
    longer: Vec<Millis>,
}

/// TTFTs below this many milliseconds are counted one by one.
const FINE_MS: usize = 1 << 16;
/// Milliseconds per block count.
const BLOCK_MS: usize = 256;

impl Counts {
    fn add(&mut self, ms: Millis) {
        if ms >= FINE_MS as Millis {
            return self.longer.push(ms);
        }
        if self.fine.is_empty() {
            self.fine = vec![None; FINE_MS / BLOCK_MS];
            self.blocks = vec![0; FINE_MS / BLOCK_MS];
        }
        let (block, at) = (ms as usize / BLOCK_MS, ms as usize % BLOCK_MS);
        self.fine[block].get_or_insert_with(|| Box::new([0; BLOCK_MS]))[at] += 1;
        self.blocks[block] += 1;
    }

    /// Forgets one sample of `ms`, which was added.
    fn remove(&mut self, ms: Millis) {
        if ms >= FINE_MS as Millis {
            let at = self.longer.iter().position(|&x| x == ms).expect("a sample added");
            self.longer.swap_remove(at);
            return;
        }
        let (block, at) = (ms as usize / BLOCK_MS, ms as usize % BLOCK_MS);
        self.fine[block].as_mut().expect("a sample added to its block")[at] -= 1;
        self.blocks[block] -= 1;
    }

    /// The sample with `above` others above it in order (0: the largest),
    /// of more than `above` counted.
    fn nth_largest(&mut self, mut above: usize) -> Millis {
        if above < self.longer.len() {
            let at = self.longer.len() - 1 - above;
            return *self.longer.select_nth_unstable(at).1;
        }
        above -= self.longer.len();
        for (b, &count) in self.blocks.iter().enumerate().rev() {
            let count = usize::from(count);
            if count <= above {
                above -= count;
                continue;
            }
            let fine = self.fine[b].as_ref().expect("a block with samples has its counts");
            for (at, &count) in fine.iter().enumerate().rev() {
                let count = usize::from(count);
                if count > above {
                    return (b * BLOCK_MS + at) as Millis;
                }
                above -= count;
            }
        }
        unreachable!("more samples counted than `above`")
    }
}

impl TtftWindow {
    /// Samples older than this are forgotten: a minute, long enough for a
    /// p99 over a few hundred requests at modest rates, short enough that a
    /// burst's queueing stops counting once the burst has been met.
    pub const WINDOW_MS: Millis = 60_000;
    /// The most samples kept: the p99 of 4096 is read from its top 41,
    /// and the window stays small.
    pub const CAPACITY: usize = 4096;

    /// An empty window of [`Self::WINDOW_MS`] and [`Self::CAPACITY`].
    pub fn new() -> Self {
        TtftWindow {
            window_ms: Self::WINDOW_MS,
            capacity: Self::CAPACITY,
            samples: VecDeque::new(),
            counts: Counts::default(),
            scratch: Vec::new(),
            p99: None,
        }
    }

    /// A request's first token came at `now`, `ttft_ms` after it arrived.
    pub fn record(&mut self, now: Millis, ttft_ms: Millis) {
        if self.samples.len() == self.capacity {
            self.pop_oldest();
        }
        self.samples.push_back((now, ttft_ms));
        self.counts.add(ttft_ms);
        self.p99 = None;
    }

    fn pop_oldest(&mut self) {
        if let Some((_, ms)) = self.samples.pop_front() {
            self.counts.remove(ms);
        }
        self.p99 = None;
    }

    /// The p99 of the samples within the window ending at `now`; `None`
    /// when there are none.
    pub fn p99(&mut self, now: Millis) -> Option<Millis> {
        self.forget(now);
        if let Some(p99) = self.p99 {
            return p99;
        }
        let n = self.samples.len();
        let p99 = nearest_rank(n).map(|rank| self.counts.nth_largest(n - 1 - rank));
        self.p99 = Some(p99);
        p99
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
            self.pop_oldest();
        }
    }

    /// The nearest-rank p99 of the samples whose time `keep` accepts.
    fn p99_where(&mut self, keep: impl Fn(Millis) -> bool) -> Option<Millis> {
        self.scratch.clear();
        self.scratch.extend(self.samples.iter().filter(|(t, _)| keep(*t)).map(|(_, ms)| *ms));
        let rank = nearest_rank(self.scratch.len())?;
        Some(*self.scratch.select_nth_unstable(rank).1)
    }
}

/// The index (from 0, smallest first) of the nearest-rank p99 of `n`
/// samples — the ceil(0.99 n)-th smallest; `None` for none.
fn nearest_rank(n: usize) -> Option<usize> {
    (n > 0).then(|| (n * 99).div_ceil(100).max(1) - 1)
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
    fn the_counted_p99_is_the_one_selected_afresh() {
        // Values on both sides of the per-millisecond counts' end, and
        // enough of them for the capacity to push the oldest out.
        let mut w = TtftWindow::new();
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut now = 0;
        for step in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            now += x % 10;
            let ttft = match x % 7 {
                0 => FINE_MS as Millis - 2 + x % 4,
                1 if step % 2 == 0 => FINE_MS as Millis + x % 200_000,
                _ => x % 5_000,
            };
            if x % 3 != 0 {
                w.record(now, ttft);
            }
            w.forget(now);
            let fresh = w.p99_where(|_| true);
            assert_eq!(w.p99(now), fresh, "at {now}");
            assert_eq!(w.p99(now), fresh, "asked again at {now}");
        }
        assert_eq!(w.samples.len(), TtftWindow::CAPACITY, "the capacity was reached");
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
    fn only_the_blocks_a_models_ttfts_fall_in_hold_counts() {
        let mut w = TtftWindow::new();
        for i in 0..TtftWindow::CAPACITY as Millis {
            w.record(i, 40 + i % 1_000);
        }
        let held = w.counts.fine.iter().filter(|b| b.is_some()).count();
        assert_eq!(held, 5, "40..1,040 ms: blocks 0 to 4 of {} ms each", BLOCK_MS);
        assert_eq!(w.p99(4_096), Some(1_029));
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
