//! The KV index: which worker caches which block.
//!
//! Block hashes are chained (see [`hangar_core::BlockHash`]), so the hash of
//! block *k* already names the whole prefix up to it. The radix tree of
//! prefixes therefore collapses to one map from block hash to the set of
//! workers holding that block: walking a prompt's hashes in order walks the
//! tree from the root, and a worker's overlap is how far the walk gets before
//! that worker drops out. One lookup per block answers for all workers.

use std::collections::hash_map::Entry;

use hangar_core::{BlockHash, KvEvent};
use rustc_hash::FxHashMap;

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
///
/// Workers below 64 — every worker of almost any cluster — live in a
/// [`BitTable`], one 16-byte slot per block, so that the index of a large
/// replay stays small and its cache misses can be overlapped
/// ([`BitTable::prefetch`]); workers from 64 up, if any, in a map beside it.
#[derive(Debug, Default)]
pub(crate) struct KvIndex {
    low: BitTable,
    /// Sets without their first word (it is in `low`), for the blocks some
    /// worker from 64 up caches.
    high: FxHashMap<BlockHash, WorkerSet>,
}

impl KvIndex {
    /// Applies one worker's KV events, in order.
    pub fn apply(&mut self, w: WorkerId, events: &[KvEvent]) {
        for e in events {
            match e {
                KvEvent::Stored { blocks, .. } => {
                    self.low.prefetch(blocks);
                    for &h in blocks {
                        match low_bit(w) {
                            Some(bit) => self.low.insert(h, bit),
                            None => self.high.entry(h).or_default().insert(w),
                        }
                    }
                }
                KvEvent::Removed { blocks } => {
                    self.low.prefetch(blocks);
                    for &h in blocks {
                        self.forget(w, h);
                    }
                }
                KvEvent::Cleared => self.forget_worker(w),
            }
        }
    }

    fn forget(&mut self, w: WorkerId, h: BlockHash) {
        match low_bit(w) {
            Some(bit) => self.low.remove(h, bit),
            None => {
                if let Entry::Occupied(mut e) = self.high.entry(h) {
                    e.get_mut().remove(w);
                    if e.get().is_empty() {
                        e.remove();
                    }
                }
            }
        }
    }

    /// Drops every block of a worker (it cleared its cache or left).
    pub fn forget_worker(&mut self, w: WorkerId) {
        match low_bit(w) {
            Some(bit) => self.low.clear_everywhere(bit),
            None => self.high.retain(|_, set| {
                set.remove(w);
                !set.is_empty()
            }),
        }
    }

    /// The workers caching `h`.
    pub fn workers_of(&self, h: BlockHash) -> WorkerSet {
        let mut set = self.high.get(&h).cloned().unwrap_or_default();
        set.low = self.low.get(h);
        set
    }

    /// For each of `workers`, how many leading blocks of `prompt` it caches;
    /// written into `overlap[w]` (which the caller sized and zeroed).
    pub fn overlaps(&self, prompt: &[BlockHash], workers: &WorkerSet, overlap: &mut [u32]) {
        self.low.prefetch(prompt);
        let mut alive = workers.clone();
        for (k, h) in prompt.iter().enumerate() {
            let mut next = alive.clone();
            next.intersect(&self.workers_of(*h));
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
        let low: usize = self.low.slots.iter().map(|s| s.bits.count_ones() as usize).sum();
        low + self.high.values().map(|s| s.iter().count()).sum::<usize>()
    }
}

/// `w`'s bit in a [`BitTable`] word, if it is below 64.
fn low_bit(w: WorkerId) -> Option<u64> {
    (w.0 < 64).then(|| 1 << w.0)
}

/// Block hash → a 64-bit word (never 0: a block no worker caches has no
/// entry), by open addressing with linear probing: four slots share a cache
/// line, a lookup mostly reads one line, and at most half the slots are
/// used. Deletion shifts later entries back, so there are no tombstones.
#[derive(Debug)]
struct BitTable {
    slots: Vec<BitSlot>,
    len: usize,
    /// `64 − log2(slots)`: a re-mixed hash shifted right by this is its home.
    shift: u32,
}

#[derive(Debug, Clone, Copy)]
struct BitSlot {
    key: BlockHash,
    /// 0: the slot is empty.
    bits: u64,
}

const EMPTY_SLOT: BitSlot = BitSlot { key: BlockHash(0), bits: 0 };

/// The slots of an empty table (a power of two).
const INITIAL_SLOTS: usize = 16;

impl Default for BitTable {
    fn default() -> Self {
        Self::with_slots(INITIAL_SLOTS)
    }
}

impl BitTable {
    fn with_slots(n: usize) -> Self {
        Self { slots: vec![EMPTY_SLOT; n], len: 0, shift: 64 - n.trailing_zeros() }
    }

    fn home(&self, key: BlockHash) -> usize {
        (key.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The slot holding `key`, or the empty slot where it would go.
    fn probe(&self, key: BlockHash) -> (usize, bool) {
        let mut i = self.home(key);
        loop {
            let s = self.slots[i];
            if s.bits == 0 {
                return (i, false);
            }
            if s.key == key {
                return (i, true);
            }
            i = (i + 1) & self.mask();
        }
    }

    fn get(&self, key: BlockHash) -> u64 {
        match self.probe(key) {
            (i, true) => self.slots[i].bits,
            (_, false) => 0,
        }
    }

    /// Reads the home slots of `keys` in one sweep, whose cache misses the
    /// processor overlaps, so that the lookups that follow — one after
    /// another, each waiting for its own miss otherwise — find them cached.
    fn prefetch(&self, keys: &[BlockHash]) {
        let mut any = 0;
        for &k in keys {
            any |= self.slots[self.home(k)].bits;
        }
        std::hint::black_box(any);
    }

    /// Sets `bit` in `key`'s word.
    fn insert(&mut self, key: BlockHash, bit: u64) {
        match self.probe(key) {
            (i, true) => self.slots[i].bits |= bit,
            (i, false) => {
                self.slots[i] = BitSlot { key, bits: bit };
                self.len += 1;
                if 2 * self.len > self.slots.len() {
                    self.rebuild(2 * self.slots.len());
                }
            }
        }
    }

    /// Clears `bit` in `key`'s word, dropping the entry when it empties.
    fn remove(&mut self, key: BlockHash, bit: u64) {
        let (mut hole, true) = self.probe(key) else { return };
        self.slots[hole].bits &= !bit;
        if self.slots[hole].bits != 0 {
            return;
        }
        // Shift later entries of the run back over the hole when it lies on
        // their probe path (between their home and their slot).
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s.bits == 0 {
                break;
            }
            if j.wrapping_sub(self.home(s.key)) & mask >= j.wrapping_sub(hole) & mask {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = EMPTY_SLOT;
        self.len -= 1;
    }

    /// Clears `bit` in every word, dropping the entries that empty.
    fn clear_everywhere(&mut self, bit: u64) {
        for s in &mut self.slots {
            s.bits &= !bit;
        }
        self.rebuild(self.slots.len());
    }

    /// Re-inserts every entry into `n` slots.
    fn rebuild(&mut self, n: usize) {
        let old = std::mem::replace(self, Self::with_slots(n));
        for s in old.slots.into_iter().filter(|s| s.bits != 0) {
            let (i, _) = self.probe(s.key);
            self.slots[i] = s;
            self.len += 1;
        }
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

    proptest::proptest! {
        /// Random sets, clears and whole-bit clears against a map: every
        /// key reads its word, and emptied entries are gone (the table's
        /// length is the map's), through growth and backward-shift
        /// deletions.
        #[test]
        fn bit_table_reads_like_a_map(
            ops in proptest::collection::vec((0u8..3, 0u64..40, 0u32..4), 1..400),
        ) {
            let mut t = BitTable::default();
            let mut model: std::collections::HashMap<u64, u64> = Default::default();
            for (op, key, bit) in ops {
                let (k, b) = (BlockHash(key), 1u64 << bit);
                match op {
                    0 => {
                        t.insert(k, b);
                        *model.entry(key).or_default() |= b;
                    }
                    1 => {
                        t.remove(k, b);
                        if let Some(w) = model.get_mut(&key) {
                            *w &= !b;
                        }
                    }
                    _ if key % 8 == 0 => {
                        t.clear_everywhere(b);
                        model.values_mut().for_each(|w| *w &= !b);
                    }
                    _ => {}
                }
                model.retain(|_, w| *w != 0);
                for key in 0..40 {
                    proptest::prop_assert_eq!(t.get(BlockHash(key)), model.get(&key).copied().unwrap_or(0));
                }
                proptest::prop_assert_eq!(t.len, model.len());
                proptest::prop_assert!(2 * t.len <= t.slots.len());
            }
        }
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
