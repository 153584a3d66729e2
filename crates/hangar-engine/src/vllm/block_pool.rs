//! vLLM's KV block pool: fixed-size blocks with reference counts, a
//! hash → block index of cached full blocks, and an LRU queue of free blocks.
//!
//! A block is *in use* while its reference count is above zero, and *free*
//! (queued for reuse) otherwise. A free block that holds a cached hash is
//! still a cache hit until it is reused: [`BlockPool::allocate`] takes blocks
//! from the head of the free queue, which holds the least recently freed
//! ones, and only then forgets their hash (the eviction). Freed blocks go to
//! the tail, and callers free a request's blocks last-first, so the tail of a
//! prompt is evicted before its shared head — as vLLM does.
//!
//! The free queue is a ring of (block, stamp) entries rather than a linked
//! list: a block taken out of the middle (a cache hit on a free block) is
//! not unlinked, its entry just stops matching the block (which is in use,
//! or was queued again under a newer stamp) and is skipped when it reaches
//! the head. Neither a hit nor an allocation then chases pointers through
//! the pool; the ring is compacted when skipped entries would make it more
//! than twice the pool's size.
//!
//! The index is a [`BlockIndex`]: four bytes per slot, so that the pools
//! of a many-worker replay stay in cache (its lookups and registrations
//! are among the hottest memory accesses of a replay). Evicting a block only
//! clears the block's own hash: its index entry goes stale, and is
//! recognised as such on lookup (the block no longer carries that hash).
//! This spares the eviction a visit to a cold part of the index. Stale
//! entries are purged whenever they would fill the index past three
//! quarters, so memory stays bounded.
//!
//! Memory follows use: blocks never allocated yet (*fresh*) have no record
//! and no queue entry — the queue's order puts them first anyway, in id
//! order, ahead of every block freed since — and the index starts as
//! zeroed memory the system hands out page by page. A fleet simulation
//! holds thousands of engines, most of which never touch most of their
//! blocks; each costs what it used, not its full KV cache's bookkeeping.
//!
//! Invariants (checked by `check_invariants` in tests): a block is free
//! exactly when its count is 0, and then exactly one queue entry matches
//! it unless it is fresh; `free_len` counts the free blocks, fresh ones
//! included; the index finds every block carrying a hash under that hash.

use std::collections::VecDeque;

use hangar_core::{BlockHash, KvEvent};

use crate::pass::KvLog;

/// Index of a block in the pool.
pub(crate) type BlockId = u32;

/// One block's bookkeeping: 16 bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Block {
    /// References, with [`HASHED`] set while `hash` names the block.
    refs: u32,
    /// The stamp of the block's latest queue entry.
    stamp: u32,
    hash: u64,
}

/// The bit of [`Block::refs`] saying the block carries a hash (a block is
/// held by at most `max_num_seqs` requests, far below it).
const HASHED: u32 = 1 << 31;

impl Block {
    fn ref_cnt(self) -> u32 {
        self.refs & !HASHED
    }

    fn hash(self) -> Option<BlockHash> {
        (self.refs & HASHED != 0).then_some(BlockHash(self.hash))
    }

    fn holds(self, hash: BlockHash) -> bool {
        self.refs & HASHED != 0 && self.hash == hash.0
    }

    fn take_hash(&mut self) -> Option<BlockHash> {
        let h = self.hash();
        self.refs &= !HASHED;
        h
    }

    fn set_hash(&mut self, hash: BlockHash) {
        self.refs |= HASHED;
        self.hash = hash.0;
    }
}

#[derive(Debug)]
pub(crate) struct BlockPool {
    /// Blocks allocated at least once, by id; ids from `blocks.len()` to
    /// `num_blocks` are fresh.
    blocks: Vec<Block>,
    num_blocks: u32,
    /// The free queue, least recently freed first: (block, stamp) entries,
    /// of which only those matching their free block count. Fresh blocks
    /// come before all of them.
    queue: VecDeque<(BlockId, u32)>,
    /// The next queue entry's stamp. Stamps wrap, which is safe: an entry is
    /// skipped or compacted away long before 2³² newer ones are queued.
    next_stamp: u32,
    free_len: u32,
    index: BlockIndex,
}

impl BlockPool {
    pub fn new(num_blocks: u32) -> Self {
        Self {
            blocks: Vec::new(),
            num_blocks,
            queue: VecDeque::new(),
            next_stamp: 0,
            free_len: num_blocks,
            index: BlockIndex::new(num_blocks),
        }
    }

    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Blocks available to [`allocate`](Self::allocate) (free, cached or not).
    pub fn free_len(&self) -> u32 {
        self.free_len
    }

    /// The block caching `hash`, if any.
    pub fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.index.find(hash, |b| self.blocks[b as usize].holds(hash)).ok()
    }

    /// Brings the index entries of `hashes` into cache together, ahead of
    /// their lookups or registrations; see [`BlockIndex::prefetch`].
    pub fn prefetch(&self, hashes: &[BlockHash]) {
        self.index.prefetch(hashes);
    }

    pub fn is_free(&self, b: BlockId) -> bool {
        self.blocks[b as usize].ref_cnt() == 0
    }

    /// Takes a reference on a cached block found by [`lookup`](Self::lookup),
    /// taking it out of the free queue if nobody held it.
    pub fn touch(&mut self, b: BlockId) {
        let block = &mut self.blocks[b as usize];
        if block.ref_cnt() == 0 {
            // Its queue entry no longer matches; see the module docs.
            self.free_len -= 1;
        }
        block.refs += 1;
    }

    /// Takes `n` blocks from the head of the free queue into `out`, evicting
    /// their cached hashes. The caller checked `n <= free_len()`.
    pub fn allocate(&mut self, n: u32, out: &mut Vec<BlockId>, log: &mut KvLog, events: &mut Vec<KvEvent>) {
        debug_assert!(n <= self.free_len);
        out.reserve(n as usize);
        // Fresh blocks first: they head the queue.
        let fresh = (n as usize).min(self.num_blocks as usize - self.blocks.len());
        for _ in 0..fresh {
            out.push(self.blocks.len() as BlockId);
            self.blocks.push(Block { refs: 1, stamp: 0, hash: 0 });
        }
        let mut taken = fresh as u32;
        while taken < n {
            let (b, stamp) = self.queue.pop_front().expect("free_len counts queued blocks");
            let block = &mut self.blocks[b as usize];
            if block.ref_cnt() != 0 || block.stamp != stamp {
                continue;
            }
            block.refs += 1;
            if let Some(h) = block.take_hash() {
                // The index entry goes stale; see the module docs.
                log.removed(events, h);
            }
            out.push(b);
            taken += 1;
        }
        self.free_len -= n;
    }

    /// Drops one reference; a block nobody holds joins the free queue's tail
    /// and stays a cache hit until reused.
    pub fn release(&mut self, b: BlockId) {
        let block = &mut self.blocks[b as usize];
        debug_assert!(block.ref_cnt() > 0, "block {b} released more often than taken");
        block.refs -= 1;
        if block.ref_cnt() == 0 {
            self.enqueue(b);
        }
    }

    /// Names a full block by its hash so later prompts can reuse it. Returns
    /// false (and caches nothing) when another block already caches that
    /// hash — two requests computed the same prefix at once — or when the
    /// block already has a hash.
    pub fn register(&mut self, b: BlockId, hash: BlockHash) -> bool {
        if self.blocks[b as usize].hash().is_some() {
            return false;
        }
        let Err(vacancy) = self.index.find(hash, |c| self.blocks[c as usize].holds(hash)) else {
            return false;
        };
        self.blocks[b as usize].set_hash(hash);
        if self.index.insert_at(vacancy, hash, b) {
            self.purge_stale();
        }
        true
    }

    /// Forgets every cached hash of free blocks (e.g. on sleep). In-use blocks
    /// keep theirs.
    pub fn clear_cache(&mut self) {
        for block in &mut self.blocks {
            if block.ref_cnt() == 0 {
                block.take_hash();
            }
        }
        self.purge_stale();
    }

    /// Drops index entries whose block no longer carries their hash.
    fn purge_stale(&mut self) {
        let blocks = &self.blocks;
        self.index.retain(|b| blocks[b as usize].hash());
    }

    /// Queues a block that just became free at the tail.
    fn enqueue(&mut self, b: BlockId) {
        if self.queue.len() >= 2 * self.num_blocks as usize {
            let blocks = &self.blocks;
            self.queue
                .retain(|&(c, stamp)| blocks[c as usize].ref_cnt() == 0 && blocks[c as usize].stamp == stamp);
        }
        let stamp = self.next_stamp;
        self.next_stamp = stamp.wrapping_add(1);
        self.blocks[b as usize].stamp = stamp;
        self.queue.push_back((b, stamp));
        self.free_len += 1;
    }

    /// Panics if an invariant of the module docs does not hold.
    #[cfg(test)]
    pub fn check_invariants(&self) {
        let mut matched = vec![0u32; self.blocks.len()];
        for &(b, stamp) in &self.queue {
            let block = &self.blocks[b as usize];
            if block.ref_cnt() == 0 && block.stamp == stamp {
                matched[b as usize] += 1;
            }
        }
        for (i, &m) in matched.iter().enumerate() {
            let free = self.blocks[i].ref_cnt() == 0;
            assert_eq!(m, u32::from(free), "block {i}: one matching entry exactly when free");
        }
        let fresh = self.num_blocks as usize - self.blocks.len();
        let free = self.blocks.iter().filter(|b| b.ref_cnt() == 0).count() + fresh;
        assert_eq!(free, self.free_len as usize, "free_len counts the free blocks");
        assert!(self.queue.len() <= 2 * self.num_blocks as usize, "skipped entries are compacted");
        for (i, block) in self.blocks.iter().enumerate() {
            if let Some(h) = block.hash() {
                assert_eq!(self.lookup(h), Some(i as u32), "block {i}'s hash maps back to it");
            }
        }
        assert!(self.index.used <= self.index.limit(), "stale entries are purged");
    }
}

/// Cached block hash → block, for [`BlockPool`]: open addressing with
/// linear probing, one `u32` per slot holding the block id and, in the bits
/// the id does not need, a tag from the (multiplicatively re-mixed) hash,
/// so sixteen slots share a cache line and a probe rarely leaves its
/// first. A slot stores its entry plus one, so an empty slot is zero and
/// the table starts as zeroed memory. Entries are never removed one by
/// one, only purged together ([`retain`](Self::retain)); a tag match is
/// confirmed by the caller against the block's own hash, which also tells
/// a stale entry from a live one (a short tag only costs such checks).
#[derive(Debug)]
struct BlockIndex {
    slots: Vec<u32>,
    /// `64 − log2(slots)`: a re-mixed hash shifted right by this is its home.
    shift: u32,
    /// Bits of an entry holding the block id; the tag has the rest.
    id_bits: u32,
    /// Slots holding an entry, live or stale.
    used: usize,
    /// Kept entries during a purge, with their homes; kept to reuse its
    /// allocation.
    scratch: Vec<(usize, u32)>,
}

const EMPTY: u32 = 0;

/// Index slots per block: the live entries then fill at most a quarter of
/// the index, and stale ones another half before a purge, so purges come
/// once per two pool-fulls of registrations.
const SLOTS_PER_BLOCK: u64 = 4;

impl BlockIndex {
    fn new(num_blocks: u32) -> Self {
        let slots = (SLOTS_PER_BLOCK * u64::from(num_blocks)).next_power_of_two();
        Self {
            slots: vec![EMPTY; slots as usize],
            shift: 64 - slots.trailing_zeros(),
            // Ids below `num_blocks` fit with room to spare, so an entry
            // (tag and id) is never all ones and one more never wraps.
            id_bits: 32 - num_blocks.leading_zeros(),
            used: 0,
            scratch: Vec::new(),
        }
    }

    fn mixed(hash: BlockHash) -> u64 {
        hash.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    /// The slot value of block `b` under `hash`: the hash's tag above the
    /// id, plus one.
    fn entry(&self, hash: BlockHash, b: BlockId) -> u32 {
        let tag = if self.id_bits >= 32 { 0 } else { Self::mixed(hash) >> (32 + self.id_bits) };
        (((tag as u32) << (self.id_bits % 32)) | b) + 1
    }

    fn block(&self, e: u32) -> BlockId {
        let id = e - 1;
        if self.id_bits >= 32 {
            id
        } else {
            id & ((1 << self.id_bits) - 1)
        }
    }

    /// Where probing for `hash` starts: the top bits of its re-mixed hash.
    fn home(&self, hash: BlockHash) -> usize {
        (Self::mixed(hash) >> self.shift) as usize
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// Entries past this many trigger a purge: three quarters of the slots.
    fn limit(&self) -> usize {
        self.slots.len() / 4 * 3
    }

    /// The block under `hash`, the first whose tag matches and that `holds`
    /// confirms; or else the empty slot that ended the search, where such an
    /// entry would go.
    fn find(&self, hash: BlockHash, holds: impl Fn(BlockId) -> bool) -> Result<BlockId, usize> {
        // The tag of `hash` with any id: entries match it where they agree
        // above the id bits.
        let want = self.entry(hash, 0) - 1;
        let above = if self.id_bits >= 32 { 0 } else { u32::MAX << self.id_bits };
        let mut i = self.home(hash);
        loop {
            let e = self.slots[i];
            if e == EMPTY {
                return Err(i);
            }
            if (e - 1) & above == want && holds(self.block(e)) {
                return Ok(self.block(e));
            }
            i = (i + 1) & self.mask();
        }
    }

    /// Reads the home slots of `hashes` in one sweep, whose cache misses the
    /// processor overlaps, so that the probes that follow — one after
    /// another, each waiting for its own miss otherwise — find them cached.
    fn prefetch(&self, hashes: &[BlockHash]) {
        let mut any = 0;
        for &h in hashes {
            any |= self.slots[self.home(h)];
        }
        std::hint::black_box(any);
    }

    /// Fills `vacancy`, the empty slot that [`find`](Self::find) returned
    /// for `hash`, with `b`. Returns whether the index is now due a purge.
    fn insert_at(&mut self, vacancy: usize, hash: BlockHash, b: BlockId) -> bool {
        debug_assert_eq!(self.slots[vacancy], EMPTY);
        self.slots[vacancy] = self.entry(hash, b);
        self.used += 1;
        self.used > self.limit()
    }

    /// Keeps the entries whose block still carries a hash of their tag
    /// (`hash_of` tells a block's hash), each once, and re-inserts them
    /// into an otherwise empty index.
    fn retain(&mut self, hash_of: impl Fn(BlockId) -> Option<BlockHash>) {
        let mut kept = std::mem::take(&mut self.scratch);
        kept.clear();
        for i in 0..self.slots.len() {
            let e = self.slots[i];
            if e != EMPTY {
                let b = self.block(e);
                if let Some(h) = hash_of(b).filter(|&h| self.entry(h, b) == e) {
                    kept.push((self.home(h), e));
                }
            }
            self.slots[i] = EMPTY;
        }
        self.used = 0;
        'kept: for &(home, e) in &kept {
            let mut i = home;
            while self.slots[i] != EMPTY {
                if self.slots[i] == e {
                    // A block whose old and new hashes share a tag has two
                    // equal entries, with one home: one will do.
                    continue 'kept;
                }
                i = (i + 1) & self.mask();
            }
            self.slots[i] = e;
            self.used += 1;
        }
        self.scratch = kept;
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
            (any::<u8>(), 0u8..24).prop_map(|(b, h)| Op::Register(b, h)),
            (0u8..24).prop_map(Op::Hit),
        ]
    }

    proptest! {
        /// Random allocate / release / register / hit sequences against a
        /// model of who holds what and of the free queue's order: no block
        /// is both free and in use, allocation takes the least recently
        /// freed blocks, a block is named at most once and a name at most
        /// once, and a hit always returns the block registered under
        /// exactly that hash. Small pools purge their index often.
        #[test]
        fn pool_keeps_its_invariants(blocks in 1u32..17, ops in proptest::collection::vec(op(), 1..300)) {
            let mut pool = BlockPool::new(blocks);
            let mut log = KvLog::on();
            let mut events = Vec::new();
            let mut held: Vec<BlockId> = Vec::new();
            let mut free: VecDeque<BlockId> = (0..blocks).collect();
            let mut names: std::collections::HashMap<BlockHash, BlockId> = Default::default();
            for op in ops {
                match op {
                    Op::Alloc(n) => {
                        let n = u32::from(n).min(pool.free_len());
                        let mut out = Vec::new();
                        pool.allocate(n, &mut out, &mut log, &mut events);
                        let expected: Vec<BlockId> = free.drain(..n as usize).collect();
                        prop_assert_eq!(&out, &expected, "least recently freed first");
                        for b in &out {
                            names.retain(|_, v| v != b);
                        }
                        held.extend(out);
                    }
                    Op::Release(i) if !held.is_empty() => {
                        let b = held.swap_remove(i as usize % held.len());
                        pool.release(b);
                        if !held.contains(&b) {
                            free.push_back(b);
                        }
                    }
                    Op::Register(i, h) if !held.is_empty() => {
                        let b = held[i as usize % held.len()];
                        let h = BlockHash(u64::from(h));
                        let new = !names.contains_key(&h) && !names.values().any(|&v| v == b);
                        prop_assert_eq!(pool.register(b, h), new);
                        if new {
                            names.insert(h, b);
                        }
                    }
                    Op::Hit(h) => {
                        let h = BlockHash(u64::from(h));
                        prop_assert_eq!(pool.lookup(h), names.get(&h).copied());
                        if let Some(b) = pool.lookup(h) {
                            pool.touch(b);
                            if !held.contains(&b) {
                                free.retain(|&f| f != b);
                            }
                            held.push(b);
                        }
                    }
                    _ => {}
                }
                pool.check_invariants();
                prop_assert_eq!(pool.free_len() as usize, free.len());
            }
        }
    }

    #[test]
    fn stale_index_entries_are_purged_and_never_found() {
        let mut pool = BlockPool::new(2);
        let mut log = KvLog::on();
        let (mut ev, mut out) = (Vec::new(), Vec::new());
        for i in 0..100 {
            out.clear();
            pool.allocate(1, &mut out, &mut log, &mut ev);
            assert!(pool.register(out[0], BlockHash(i)));
            pool.release(out[0]);
            pool.check_invariants();
            assert_eq!(pool.lookup(BlockHash(i)), Some(out[0]));
            if i >= 2 {
                assert_eq!(pool.lookup(BlockHash(i - 2)), None, "evicted two allocations ago");
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
