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
//! The free queue is a ring of block ids rather than a linked list: a block
//! taken out of the middle (a cache hit on a free block) is not unlinked,
//! its entry just stops matching the block (which is in use, or was queued
//! again at a later position) and is skipped when it reaches the head.
//! Neither a hit nor an allocation then chases pointers through the pool.
//! An entry's *position* is how many entries were queued before it (modulo
//! 2³⁰), kept by the ring rather than in the entry; a free block remembers
//! the position of its one matching entry. The ring is compacted, and its
//! entries numbered afresh, when skipped entries would make it longer than
//! one and a half times the pool.
//!
//! The index is a [`BlockIndex`]: four bytes per slot, two slots per
//! block, so that the pools of a many-worker replay stay in cache (its
//! lookups and registrations are among the hottest memory accesses of a
//! replay). Evicting a block only clears the block's own hash: its index
//! entry goes stale, and is recognised as such on lookup (the block no
//! longer carries that hash). This spares the eviction a visit to a cold
//! part of the index. Stale entries are purged whenever they would fill the
//! index past three quarters, so memory stays bounded.
//!
//! Memory follows use: blocks never allocated yet (*fresh*) have no record
//! and no queue entry — the queue's order puts them first anyway, in id
//! order, ahead of every block freed since — and the index and the ring
//! start as memory the system hands out page by page. A fleet simulation
//! holds thousands of engines, most of which never touch most of their
//! blocks; each costs what it used, not its full KV cache's bookkeeping. A
//! busy engine pays 12 bytes a block for its record, 8 for the index and
//! at most 6 for the ring (a 16,384-block engine: 416 KiB).
//!
//! Invariants (checked by `check_invariants` in tests): a block is free
//! exactly when it has no references, and then exactly one queue entry
//! matches it unless it is fresh; `free_len` counts the free blocks, fresh
//! ones included; the index finds every block carrying a hash under that
//! hash.

use std::collections::VecDeque;

use hangar_core::{BlockHash, KvEvent};

use crate::pass::KvLog;
use crate::MAX_GPU_BLOCKS;

/// Index of a block in the pool.
pub(crate) type BlockId = u32;

/// One block's bookkeeping: 12 bytes (packed to four-byte alignment, so a
/// pool's records are three quarters of what an aligned hash would make
/// them).
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(4))]
struct Block {
    /// [`HASHED`] while `hash` names the block; [`FREE`] while nobody holds
    /// it; below them ([`LOW`]), the references of a block in use or the
    /// position of its queue entry of a free one — never both at once.
    word: u32,
    hash: u64,
}

/// The bit of [`Block::word`] saying the block carries a hash.
const HASHED: u32 = 1 << 31;
/// The bit of [`Block::word`] saying the block is free.
const FREE: u32 = 1 << 30;
/// The bits of [`Block::word`] below the two flags.
const LOW: u32 = FREE - 1;

impl Block {
    /// A block just taken by one request.
    const TAKEN: Block = Block { word: 1, hash: 0 };

    fn ref_cnt(self) -> u32 {
        if self.word & FREE != 0 {
            0
        } else {
            self.word & LOW
        }
    }

    /// Whether `position`'s queue entry is the free block's current one.
    fn queued_at(self, position: u32) -> bool {
        self.word & (FREE | LOW) == FREE | (position & LOW)
    }

    /// One more reference (the first of a free block).
    fn take(&mut self) {
        let refs = self.ref_cnt() + 1;
        debug_assert!(refs < FREE, "references overflow");
        self.word = (self.word & HASHED) | refs;
    }

    /// One reference fewer; whether that was the last.
    fn drop_ref(&mut self) -> bool {
        debug_assert!(self.ref_cnt() > 0, "released more often than taken");
        self.word -= 1;
        self.word & LOW == 0
    }

    /// Free, its queue entry at `position`.
    fn queue_at(&mut self, position: u32) {
        self.word = (self.word & HASHED) | FREE | (position & LOW);
    }

    fn hash(self) -> Option<BlockHash> {
        (self.word & HASHED != 0).then_some(BlockHash(self.hash))
    }

    fn holds(self, hash: BlockHash) -> bool {
        self.word & HASHED != 0 && self.hash == hash.0
    }

    fn take_hash(&mut self) -> Option<BlockHash> {
        let h = self.hash();
        self.word &= !HASHED;
        h
    }

    fn set_hash(&mut self, hash: BlockHash) {
        self.word |= HASHED;
        self.hash = hash.0;
    }
}

#[derive(Debug)]
pub(crate) struct BlockPool {
    /// Blocks allocated at least once, by id; ids from `blocks.len()` to
    /// `num_blocks` are fresh.
    blocks: Vec<Block>,
    num_blocks: u32,
    /// The free queue, least recently freed first, of which only entries
    /// matching their free block count. Fresh blocks come before all of
    /// them. Its capacity is set once to [`queue_limit`](Self::queue_limit),
    /// which it never exceeds.
    queue: VecDeque<BlockId>,
    /// The position of the queue's head entry; the entry `i` places behind
    /// it is at `head + i`. Positions wrap at 2³⁰, which is safe: the
    /// entries in the queue at any moment, far fewer, have distinct ones.
    head: u32,
    free_len: u32,
    index: BlockIndex,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks, at most [`MAX_GPU_BLOCKS`] (which
    /// `EngineConfig::validate` refuses): references and queue positions
    /// then fit in 30 bits with room to spare.
    pub fn new(num_blocks: u32) -> Self {
        assert!(num_blocks <= MAX_GPU_BLOCKS, "{num_blocks} blocks: a pool holds at most {MAX_GPU_BLOCKS}");
        Self {
            blocks: Vec::new(),
            num_blocks,
            queue: VecDeque::with_capacity(Self::queue_limit(num_blocks)),
            head: 0,
            free_len: num_blocks,
            index: BlockIndex::new(num_blocks),
        }
    }

    /// The queue's longest: at a block's release at most `num_blocks − 1`
    /// entries match (the block released is not free yet), so compacting
    /// at this length frees at least a third of it.
    fn queue_limit(num_blocks: u32) -> usize {
        num_blocks as usize + num_blocks as usize / 2 + 1
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
        block.take();
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
            self.blocks.push(Block::TAKEN);
        }
        let mut taken = fresh as u32;
        while taken < n {
            let b = self.queue.pop_front().expect("free_len counts queued blocks");
            let position = self.head;
            self.head = position.wrapping_add(1);
            let block = &mut self.blocks[b as usize];
            if !block.queued_at(position) {
                continue;
            }
            block.take();
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
        if self.blocks[b as usize].drop_ref() {
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

    /// Queues a block that just became free (its last reference dropped) at
    /// the tail, compacting the queue first if it is at its longest.
    fn enqueue(&mut self, b: BlockId) {
        if self.queue.len() + 1 >= Self::queue_limit(self.num_blocks) {
            self.compact();
        }
        let position = self.head.wrapping_add(self.queue.len() as u32);
        self.blocks[b as usize].queue_at(position);
        self.queue.push_back(b);
        self.free_len += 1;
    }

    /// Drops the entries that no longer match and numbers the rest afresh
    /// from the head's position, in order.
    fn compact(&mut self) {
        let blocks = &mut self.blocks;
        let (mut old, mut new) = (self.head, self.head);
        self.queue.retain(|&c| {
            let block = &mut blocks[c as usize];
            let keep = block.queued_at(old);
            old = old.wrapping_add(1);
            if keep {
                block.queue_at(new);
                new = new.wrapping_add(1);
            }
            keep
        });
    }

    /// Panics if an invariant of the module docs does not hold.
    #[cfg(test)]
    pub fn check_invariants(&self) {
        let mut matched = vec![0u32; self.blocks.len()];
        for (i, &b) in self.queue.iter().enumerate() {
            if self.blocks[b as usize].queued_at(self.head.wrapping_add(i as u32)) {
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
        assert!(self.queue.len() < Self::queue_limit(self.num_blocks), "skipped entries are compacted");
        assert!(self.queue.capacity() <= Self::queue_limit(self.num_blocks) + 8, "the queue never grows");
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
///
/// The home of a hash is the high half of its re-mixed hash scaled to the
/// table (a multiply, not a power-of-two mask, so the table is exactly two
/// slots a block, not up to four); its tag comes from the low half, so
/// entries sharing a home still tell each other apart.
#[derive(Debug)]
struct BlockIndex {
    slots: Vec<u32>,
    /// Bits of an entry holding the block id; the tag has the rest.
    id_bits: u32,
    /// Slots holding an entry, live or stale.
    used: usize,
}

const EMPTY: u32 = 0;

/// Index slots per block: the live entries then fill at most half of the
/// index, and stale ones up to a quarter more before a purge, so a purge (a
/// sweep of the whole index) comes once per half a pool-full of
/// registrations at worst.
const SLOTS_PER_BLOCK: usize = 2;

impl BlockIndex {
    fn new(num_blocks: u32) -> Self {
        // At least four slots, so that below the purge limit (three
        // quarters) one is always empty and ends a probe.
        let slots = (SLOTS_PER_BLOCK * num_blocks as usize).max(4);
        Self {
            slots: vec![EMPTY; slots],
            // Ids below `num_blocks` fit with room to spare, so an entry
            // (tag and id) is never all ones and one more never wraps.
            id_bits: 32 - num_blocks.leading_zeros(),
            used: 0,
        }
    }

    fn mixed(hash: BlockHash) -> u64 {
        hash.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    /// The slot value of block `b` under `hash`: the hash's tag above the
    /// id, plus one.
    fn entry(&self, hash: BlockHash, b: BlockId) -> u32 {
        // `id_bits` is at most 29 (MAX_GPU_BLOCKS), so the tag has three bits
        // or more.
        let tag = (Self::mixed(hash) as u32) >> self.id_bits;
        ((tag << self.id_bits) | b) + 1
    }

    fn block(&self, e: u32) -> BlockId {
        (e - 1) & ((1 << self.id_bits) - 1)
    }

    /// Where probing for `hash` starts: the high half of its re-mixed hash
    /// times the table's length, over 2³².
    fn home(&self, hash: BlockHash) -> usize {
        (((Self::mixed(hash) >> 32) * self.slots.len() as u64) >> 32) as usize
    }

    /// The slot after `i`, wrapping at the end.
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    /// Entries past this many trigger a purge: three quarters of the slots.
    fn limit(&self) -> usize {
        self.slots.len() * 3 / 4
    }

    /// The block under `hash`, the first whose tag matches and that `holds`
    /// confirms; or else the empty slot that ended the search, where such an
    /// entry would go.
    fn find(&self, hash: BlockHash, holds: impl Fn(BlockId) -> bool) -> Result<BlockId, usize> {
        // The tag of `hash` with any id: entries match it where they agree
        // above the id bits.
        let want = self.entry(hash, 0) - 1;
        let above = u32::MAX << self.id_bits;
        let mut i = self.home(hash);
        loop {
            let e = self.slots[i];
            if e == EMPTY {
                return Err(i);
            }
            if (e - 1) & above == want && holds(self.block(e)) {
                return Ok(self.block(e));
            }
            i = self.next(i);
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
        // Not kept between purges: a buffer per engine as large as its live
        // entries was a sixth of a 1,000-node fleet simulation's memory.
        let mut kept: Vec<(u32, u32)> = Vec::with_capacity(self.used);
        for i in 0..self.slots.len() {
            let e = self.slots[i];
            if e != EMPTY {
                let b = self.block(e);
                if let Some(h) = hash_of(b).filter(|&h| self.entry(h, b) == e) {
                    kept.push((self.home(h) as u32, e));
                }
            }
            self.slots[i] = EMPTY;
        }
        self.used = 0;
        'kept: for &(home, e) in &kept {
            let mut i = home as usize;
            while self.slots[i] != EMPTY {
                if self.slots[i] == e {
                    // A block whose old and new hashes share a tag has two
                    // equal entries, with one home: one will do.
                    continue 'kept;
                }
                i = self.next(i);
            }
            self.slots[i] = e;
            self.used += 1;
        }
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
        fn pool_keeps_its_invariants(
            blocks in 1u32..17,
            head in any::<u32>(),
            ops in proptest::collection::vec(op(), 1..300),
        ) {
            let mut pool = BlockPool::new(blocks);
            // Queue positions wrap: start anywhere, near the wrap too.
            pool.head = head;
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
    fn a_block_record_is_twelve_bytes() {
        assert_eq!(std::mem::size_of::<Block>(), 12);
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
