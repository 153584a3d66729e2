//! The KV index: which worker caches which block.
//!
//! Block hashes are chained (see [`hangar_core::BlockHash`]), so the hash of
//! block *k* already names the whole prefix up to it. The radix tree of
//! prefixes therefore collapses to one map from block hash to the set of
//! workers holding that block: walking a prompt's hashes in order walks the
//! tree from the root, and a worker's overlap is how far the walk gets before
//! that worker drops out. One lookup per block answers for all workers.

use hangar_core::{BlockHash, KvEvent};
use rustc_hash::FxHashMap;
use std::collections::hash_map::Entry;

use crate::WorkerId;

/// A set of workers as a bitset: the first 64 inline, the rest (rare: a
/// cluster of more than 64 replicas of one model) on the heap. Kept small
/// because the index holds one per cached block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct WorkerSet {
    low: u64,
    high: Option<Box<[u64]>>,
}

impl WorkerSet {
    fn word(&self, i: usize) -> u64 {
        match i {
            0 => self.low,
            _ => self.high.as_ref().and_then(|h| h.get(i - 1).copied()).unwrap_or(0),
        }
    }

    fn word_mut(&mut self, i: usize) -> &mut u64 {
        if i == 0 {
            return &mut self.low;
        }
        let have = self.high.as_ref().map_or(0, |h| h.len());
        if have < i {
            let mut grown = vec![0; i];
            grown[..have].copy_from_slice(self.high.as_deref().unwrap_or(&[]));
            self.high = Some(grown.into_boxed_slice());
        }
        &mut self.high.as_mut().expect("just sized")[i - 1]
    }

    fn words(&self) -> usize {
        1 + self.high.as_ref().map_or(0, |h| h.len())
    }

    pub fn insert(&mut self, w: WorkerId) {
        *self.word_mut(w.0 as usize / 64) |= 1 << (w.0 % 64);
    }

    pub fn remove(&mut self, w: WorkerId) {
        let i = w.0 as usize / 64;
        if i < self.words() {
            *self.word_mut(i) &= !(1 << (w.0 % 64));
        }
    }

    pub fn contains(&self, w: WorkerId) -> bool {
        self.word(w.0 as usize / 64) & (1 << (w.0 % 64)) != 0
    }

    pub fn is_empty(&self) -> bool {
        self.low == 0 && self.high.as_ref().is_none_or(|h| h.iter().all(|&x| x == 0))
    }

    /// Keeps only the workers also in `other`.
    pub fn intersect(&mut self, other: &WorkerSet) {
        self.low &= other.low;
        if let Some(h) = &mut self.high {
            for (i, x) in h.iter_mut().enumerate() {
                *x &= other.word(i + 1);
            }
        }
    }

    /// The workers in `self` but not in `other`.
    pub fn minus<'a>(&'a self, other: &'a WorkerSet) -> impl Iterator<Item = WorkerId> + 'a {
        (0..self.words()).flat_map(move |i| {
            let mut rest = self.word(i) & !other.word(i);
            std::iter::from_fn(move || {
                if rest == 0 {
                    return None;
                }
                let bit = rest.trailing_zeros();
                rest &= rest - 1;
                Some(WorkerId(i as u32 * 64 + bit))
            })
        })
    }

    pub fn iter(&self) -> impl Iterator<Item = WorkerId> + '_ {
        static EMPTY: WorkerSet = WorkerSet { low: 0, high: None };
        self.minus(&EMPTY)
    }
}

/// Block hash → workers that cache it.
#[derive(Debug, Default)]
pub(crate) struct KvIndex {
    pub(crate) blocks: FxHashMap<BlockHash, WorkerSet>,
}

impl KvIndex {
    /// Applies one worker's KV events, in order.
    pub fn apply(&mut self, w: WorkerId, events: &[KvEvent]) {
        for e in events {
            match e {
                KvEvent::Stored { blocks, .. } => {
                    for h in blocks {
                        self.blocks.entry(*h).or_default().insert(w);
                    }
                }
                KvEvent::Removed { blocks } => {
                    for h in blocks {
                        self.forget(w, *h);
                    }
                }
                KvEvent::Cleared => self.forget_worker(w),
            }
        }
    }

    fn forget(&mut self, w: WorkerId, h: BlockHash) {
        if let Entry::Occupied(mut e) = self.blocks.entry(h) {
            e.get_mut().remove(w);
            if e.get().is_empty() {
                e.remove();
            }
        }
    }

    /// Drops every block of a worker (it cleared its cache or left).
    pub fn forget_worker(&mut self, w: WorkerId) {
        self.blocks.retain(|_, set| {
            set.remove(w);
            !set.is_empty()
        });
    }

    /// For each of `workers`, how many leading blocks of `prompt` it caches;
    /// written into `overlap[w]` (which the caller sized and zeroed).
    pub fn overlaps(&self, prompt: &[BlockHash], workers: &WorkerSet, overlap: &mut [u32]) {
        let mut alive = workers.clone();
        for (k, h) in prompt.iter().enumerate() {
            let mut next = alive.clone();
            match self.blocks.get(h) {
                Some(set) => next.intersect(set),
                None => next = WorkerSet::default(),
            }
            for w in alive.minus(&next) {
                overlap[w.0 as usize] = k as u32;
            }
            alive = next;
            if alive.is_empty() {
                return;
            }
        }
        for w in alive.iter() {
            overlap[w.0 as usize] = prompt.len() as u32;
        }
    }

    /// Number of (block, worker) pairs indexed.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.blocks.values().map(|s| s.iter().count()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hangar_core::ROOT_BLOCK_HASH;

    fn chain(contents: &[u64]) -> Vec<BlockHash> {
        let mut p = ROOT_BLOCK_HASH;
        contents
            .iter()
            .map(|&c| {
                p = p.chain(c);
                p
            })
            .collect()
    }

    #[test]
    fn overlap_is_the_leading_cached_run_per_worker() {
        let mut idx = KvIndex::default();
        let a = chain(&[1, 2, 3, 4]);
        idx.apply(WorkerId(0), &[KvEvent::Stored { parent: None, blocks: a[..3].to_vec() }]);
        idx.apply(WorkerId(1), &[KvEvent::Stored { parent: None, blocks: a.clone() }]);
        idx.apply(WorkerId(70), &[KvEvent::Stored { parent: None, blocks: a[..1].to_vec() }]);
        idx.apply(WorkerId(1), &[KvEvent::Removed { blocks: vec![a[1]] }]);
        let mut all = WorkerSet::default();
        for w in [0, 1, 2, 70] {
            all.insert(WorkerId(w));
        }
        let mut ov = vec![0; 71];
        idx.overlaps(&a, &all, &mut ov);
        assert_eq!((ov[0], ov[1], ov[2], ov[70]), (3, 1, 0, 1), "a gap ends the run");
        idx.apply(WorkerId(0), &[KvEvent::Cleared]);
        assert_eq!(idx.len(), 4 + 1 - 1);
    }
}
