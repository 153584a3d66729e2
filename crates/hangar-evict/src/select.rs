//! Oldest-first selection with bounded memory. Sans-IO.
//!
//! A sweep offers every deletable file once. [`Selection`] keeps a max-heap
//! of the least recently used ones and drops the newest as soon as the rest
//! still cover the byte budget (what must be freed to reach the target), so
//! it ends holding the *smallest set of oldest files* that frees enough —
//! never more than `max_count` entries of 40 bytes, whatever the tree size.
//! The current newest key ([`Selection::cutoff`]) is published to crawlers so
//! they skip files that could not get in without sending them.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::layout::Leaf;

/// One deletable file, located by shard index and bucket codes instead of a
/// path (40 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Last use in nanoseconds since the epoch: `max(atime, mtime)`.
    pub last_use_ns: i64,
    /// Block hash (the file name).
    pub hash: u64,
    /// Allocated size in 512-byte blocks (`st_blocks`), what `df` counts.
    pub blocks: u32,
    /// Inode number (low 32 bits), for deleting in on-disk order.
    pub ino: u32,
    /// Index of the shard in the sweep's shard table.
    pub shard: u32,
    /// First-level bucket value.
    pub bucket: u16,
    /// Second-level bucket.
    pub leaf: Leaf,
}

impl Candidate {
    /// Allocated bytes.
    pub fn bytes(&self) -> u64 {
        u64::from(self.blocks) * 512
    }

    fn order_key(&self) -> (i64, u64, u32) {
        (self.last_use_ns, self.hash, self.shard)
    }
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        self.order_key().cmp(&other.order_key())
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// The oldest candidates covering a byte budget.
#[derive(Debug)]
pub struct Selection {
    budget_bytes: u64,
    min_count: usize,
    max_count: usize,
    heap: BinaryHeap<Candidate>,
    bytes: u64,
    offered: u64,
}

impl Selection {
    /// Keeps the oldest candidates whose sizes add up to `budget_bytes`, but
    /// at least `min_count` (when offered) and at most `max_count`.
    ///
    /// Room for `max_count + 1` entries (the most ever held, between a push
    /// and the pop it causes) is reserved at once: address space only, its
    /// pages are touched as entries arrive. Left to grow by doubling, a
    /// full selection of 262,144 entries sat in room for 524,288, copied
    /// on the way: the 500k benchmark's evictor peaked at 33 MiB resident
    /// that way, 23 MiB now.
    pub fn new(budget_bytes: u64, min_count: usize, max_count: usize) -> Selection {
        let max_count = max_count.max(1);
        Selection {
            budget_bytes,
            min_count: min_count.min(max_count),
            max_count,
            heap: BinaryHeap::with_capacity(max_count + 1),
            bytes: 0,
            offered: 0,
        }
    }

    /// Offers one candidate. Amortised O(log n).
    pub fn offer(&mut self, c: Candidate) {
        self.offered += 1;
        if let Some(cut) = self.cutoff() {
            if c.last_use_ns > cut {
                return;
            }
        }
        self.bytes += c.bytes();
        self.heap.push(c);
        while let Some(newest) = self.heap.peek() {
            let len = self.heap.len();
            let covered_without = self.bytes - newest.bytes() >= self.budget_bytes;
            if len > self.max_count || (len > self.min_count && covered_without) {
                self.bytes -= newest.bytes();
                self.heap.pop();
            } else {
                break;
            }
        }
    }

    /// Last-use time at or below which a candidate can still enter, once the
    /// selection is full; `None` while anything offered would be kept.
    pub fn cutoff(&self) -> Option<i64> {
        let full = self.heap.len() >= self.max_count
            || (self.heap.len() >= self.min_count && self.bytes >= self.budget_bytes);
        full.then(|| self.heap.peek().map(|c| c.last_use_ns)).flatten()
    }

    /// Candidates kept so far.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Bytes the kept candidates occupy.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Candidates offered, kept or not.
    pub fn offered(&self) -> u64 {
        self.offered
    }

    /// The kept candidates, least recently used first.
    pub fn into_oldest_first(self) -> Vec<Candidate> {
        self.heap.into_sorted_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cand(last_use_ns: i64, hash: u64, blocks: u32) -> Candidate {
        Candidate {
            last_use_ns,
            hash,
            blocks,
            ino: 0,
            shard: 0,
            bucket: 0,
            leaf: Leaf { hh: 0, group: None },
        }
    }

    #[test]
    fn keeps_the_oldest_that_cover_the_budget() {
        let mut s = Selection::new(3 * 512, 1, 100);
        for (t, h) in [(50, 1), (10, 2), (40, 3), (20, 4), (30, 5)] {
            s.offer(cand(t, h, 1));
        }
        let kept: Vec<_> = s.into_oldest_first().iter().map(|c| c.last_use_ns).collect();
        assert_eq!(kept, vec![10, 20, 30]);
    }

    proptest! {
        /// Whatever the offer order, the selection is the shortest prefix of
        /// the sorted input covering the budget, clamped to [min, max].
        #[test]
        fn equals_the_covering_prefix_of_the_sorted_input(
            items in proptest::collection::vec((0i64..1000, 1u32..20), 0..300),
            budget in 0u64..40_000,
            min in 0usize..20,
            max in 1usize..200,
        ) {
            let cands: Vec<Candidate> = items.iter().enumerate()
                .map(|(i, &(t, b))| cand(t, i as u64, b)).collect();
            let mut s = Selection::new(budget, min, max);
            for c in &cands { s.offer(*c); }
            prop_assert_eq!(s.offered(), cands.len() as u64);

            let mut sorted = cands.clone();
            sorted.sort();
            let min = min.min(max);
            let mut expected = Vec::new();
            let mut bytes = 0;
            for c in sorted {
                if expected.len() >= max || (expected.len() >= min && bytes >= budget) { break; }
                bytes += c.bytes();
                expected.push(c);
            }
            prop_assert!(s.heap.capacity() <= max + 1, "allocated {} for at most {}", s.heap.capacity(), max);
            prop_assert_eq!(s.into_oldest_first(), expected);
        }
    }
}
