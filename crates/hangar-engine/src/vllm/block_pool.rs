//! vLLM's KV block pool: fixed-size blocks with reference counts, a
//! hash → block map of cached full blocks, and an LRU queue of free blocks.
//!
//! A block is *in use* while its reference count is above zero, and *free*
//! (queued for reuse) otherwise. A free block that holds a cached hash is
//! still a cache hit until it is reused: [`BlockPool::allocate`] takes blocks
//! from the head of the free queue, which holds the least recently freed
//! ones, and only then forgets their hash (the eviction). Freed blocks go to
//! the tail, and callers free a request's blocks last-first, so the tail of a
//! prompt is evicted before its shared head — as vLLM does.
//!
//! Evicting a block only clears the block's own hash; the stale `cached`
//! entry pointing at it is left behind and recognised as stale on lookup
//! (the block no longer carries that hash). This halves the hash-map work of
//! a block's life, the hottest path of a replay. Stale entries are purged
//! whenever they would make the map more than twice the pool's size, so
//! memory stays bounded.
//!
//! Invariants (checked by `check_invariants` in tests): a block is in the
//! free queue exactly when its count is 0; `free_len` is the queue's length;
//! every block carrying hash `h` is what `cached[h]` points at.

use std::collections::hash_map::Entry;

use hangar_core::{BlockHash, KvEvent};
use rustc_hash::FxHashMap;

use crate::pass::KvLog;

/// Index of a block in the pool.
pub(crate) type BlockId = u32;

const NIL: u32 = u32::MAX;

/// One block's bookkeeping, kept together so that an allocation touches one
/// cache line per block.
#[derive(Debug, Clone, Copy)]
struct Block {
    prev: u32,
    next: u32,
    ref_cnt: u32,
    hash: Option<BlockHash>,
}

#[derive(Debug)]
pub(crate) struct BlockPool {
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    free_len: u32,
    cached: FxHashMap<BlockHash, BlockId>,
}

impl BlockPool {
    pub fn new(num_blocks: u32) -> Self {
        let mut pool = Self {
            blocks: vec![Block { prev: NIL, next: NIL, ref_cnt: 0, hash: None }; num_blocks as usize],
            head: NIL,
            tail: NIL,
            free_len: 0,
            cached: FxHashMap::with_capacity_and_hasher(2 * num_blocks as usize, Default::default()),
        };
        for b in 0..num_blocks {
            pool.push_tail(b);
        }
        pool
    }

    pub fn num_blocks(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks available to [`allocate`](Self::allocate) (free, cached or not).
    pub fn free_len(&self) -> u32 {
        self.free_len
    }

    /// The block caching `hash`, if any.
    pub fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        let b = *self.cached.get(&hash)?;
        (self.blocks[b as usize].hash == Some(hash)).then_some(b)
    }

    pub fn is_free(&self, b: BlockId) -> bool {
        self.blocks[b as usize].ref_cnt == 0
    }

    /// Takes a reference on a cached block found by [`lookup`](Self::lookup),
    /// pulling it out of the free queue if nobody held it.
    pub fn touch(&mut self, b: BlockId) {
        if self.blocks[b as usize].ref_cnt == 0 {
            self.unlink(b);
        }
        self.blocks[b as usize].ref_cnt += 1;
    }

    /// Takes `n` blocks from the head of the free queue into `out`, evicting
    /// their cached hashes. The caller checked `n <= free_len()`.
    pub fn allocate(&mut self, n: u32, out: &mut Vec<BlockId>, log: &mut KvLog, events: &mut Vec<KvEvent>) {
        debug_assert!(n <= self.free_len);
        out.reserve(n as usize);
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            let block = &mut self.blocks[b as usize];
            block.ref_cnt = 1;
            if let Some(h) = block.hash.take() {
                // The map entry goes stale; see the module docs.
                log.removed(events, h);
            }
            out.push(b);
        }
    }

    /// Drops one reference; a block nobody holds joins the free queue's tail
    /// and stays a cache hit until reused.
    pub fn release(&mut self, b: BlockId) {
        let rc = &mut self.blocks[b as usize].ref_cnt;
        debug_assert!(*rc > 0, "block {b} released more often than taken");
        *rc -= 1;
        if *rc == 0 {
            self.push_tail(b);
        }
    }

    /// Names a full block by its hash so later prompts can reuse it. Returns
    /// false (and caches nothing) when another block already caches that
    /// hash — two requests computed the same prefix at once — or when the
    /// block already has a hash.
    pub fn register(&mut self, b: BlockId, hash: BlockHash) -> bool {
        if self.blocks[b as usize].hash.is_some() {
            return false;
        }
        if self.cached.len() >= 2 * self.blocks.len() {
            self.purge_stale();
        }
        match self.cached.entry(hash) {
            Entry::Occupied(mut e) => {
                let holder = *e.get();
                if self.blocks[holder as usize].hash == Some(hash) {
                    return false;
                }
                e.insert(b);
            }
            Entry::Vacant(v) => {
                v.insert(b);
            }
        }
        self.blocks[b as usize].hash = Some(hash);
        true
    }

    /// Forgets every cached hash of free blocks (e.g. on sleep). In-use blocks
    /// keep theirs.
    pub fn clear_cache(&mut self) {
        let mut b = self.head;
        while b != NIL {
            self.blocks[b as usize].hash = None;
            b = self.blocks[b as usize].next;
        }
        self.purge_stale();
    }

    /// Drops map entries whose block no longer carries their hash.
    fn purge_stale(&mut self) {
        let blocks = &self.blocks;
        self.cached.retain(|h, b| blocks[*b as usize].hash == Some(*h));
    }

    fn push_tail(&mut self, b: BlockId) {
        let tail = self.tail;
        let block = &mut self.blocks[b as usize];
        block.prev = tail;
        block.next = NIL;
        if tail == NIL {
            self.head = b;
        } else {
            self.blocks[tail as usize].next = b;
        }
        self.tail = b;
        self.free_len += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let Block { prev: p, next: n, .. } = self.blocks[b as usize];
        if p == NIL {
            self.head = n;
        } else {
            self.blocks[p as usize].next = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.blocks[n as usize].prev = p;
        }
        let block = &mut self.blocks[b as usize];
        block.prev = NIL;
        block.next = NIL;
        self.free_len -= 1;
    }

    /// Panics if an invariant of the module docs does not hold.
    #[cfg(test)]
    pub fn check_invariants(&self) {
        let mut in_queue = vec![false; self.blocks.len()];
        let mut b = self.head;
        let mut len = 0;
        while b != NIL {
            assert!(!in_queue[b as usize], "block {b} queued twice");
            in_queue[b as usize] = true;
            len += 1;
            b = self.blocks[b as usize].next;
        }
        assert_eq!(len, self.free_len, "free_len disagrees with the queue");
        for (i, &q) in in_queue.iter().enumerate() {
            assert_eq!(q, self.blocks[i].ref_cnt == 0, "block {i}: free exactly when unreferenced");
        }
        for (i, block) in self.blocks.iter().enumerate() {
            if let Some(h) = block.hash {
                assert_eq!(self.cached.get(&h), Some(&(i as u32)), "block {i}'s hash maps back to it");
            }
        }
        assert!(self.cached.len() <= 2 * self.blocks.len() + 1, "stale entries are purged");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u8),
        Release(u8),
        Register(u8, u8),
        Hit(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u8..6).prop_map(Op::Alloc),
            any::<u8>().prop_map(Op::Release),
            (any::<u8>(), 0u8..12).prop_map(|(b, h)| Op::Register(b, h)),
            (0u8..12).prop_map(Op::Hit),
        ]
    }

    proptest! {
        /// Random allocate / release / register / hit sequences against a
        /// model of who holds what: no block is both free and in use,
        /// reference counts never go negative, and a hit always returns the
        /// block registered under exactly that hash.
        #[test]
        fn pool_keeps_its_invariants(ops in proptest::collection::vec(op(), 1..200)) {
            let mut pool = BlockPool::new(16);
            let mut log = KvLog::on();
            let mut events = Vec::new();
            let mut held: Vec<BlockId> = Vec::new();
            let mut names: std::collections::HashMap<BlockHash, BlockId> = Default::default();
            for op in ops {
                match op {
                    Op::Alloc(n) => {
                        let n = u32::from(n).min(pool.free_len());
                        let mut out = Vec::new();
                        pool.allocate(n, &mut out, &mut log, &mut events);
                        for b in &out {
                            names.retain(|_, v| v != b);
                        }
                        held.extend(out);
                    }
                    Op::Release(i) if !held.is_empty() => {
                        let b = held.swap_remove(i as usize % held.len());
                        pool.release(b);
                    }
                    Op::Register(i, h) if !held.is_empty() => {
                        let b = held[i as usize % held.len()];
                        let h = BlockHash(u64::from(h));
                        if pool.register(b, h) {
                            names.insert(h, b);
                        }
                    }
                    Op::Hit(h) => {
                        let h = BlockHash(u64::from(h));
                        prop_assert_eq!(pool.lookup(h), names.get(&h).copied());
                        if let Some(b) = pool.lookup(h) {
                            pool.touch(b);
                            held.push(b);
                        }
                    }
                    _ => {}
                }
                pool.check_invariants();
                let in_use = pool.num_blocks() - pool.free_len();
                prop_assert_eq!(in_use as usize, held.iter().collect::<std::collections::HashSet<_>>().len());
            }
        }
    }

    #[test]
    fn eviction_takes_the_least_recently_freed_block_and_reports_it() {
        let mut pool = BlockPool::new(2);
        let mut log = KvLog::on();
        let (mut ev, mut out) = (Vec::new(), Vec::new());
        pool.allocate(2, &mut out, &mut log, &mut ev);
        assert!(pool.register(out[0], BlockHash(1)));
        assert!(pool.register(out[1], BlockHash(2)));
        assert!(!pool.register(out[1], BlockHash(3)), "a block is named once");
        pool.release(out[1]);
        pool.release(out[0]);
        out.clear();
        pool.allocate(1, &mut out, &mut log, &mut ev);
        assert_eq!(ev, vec![KvEvent::Removed { blocks: vec![BlockHash(2)] }]);
        assert_eq!(pool.lookup(BlockHash(1)), Some(0));
    }
}
