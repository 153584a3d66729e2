//! SGLang's radix cache: a tree of cached token prefixes, one KV page per
//! key, with reference-counted locks and LRU eviction of unlocked leaves.
//!
//! Keys are page content keys ([`crate::Prompt::page_key_runs`]), kept
//! run-length encoded on the edges: a trace prompt of a few shared hash ids
//! is a few runs even with 1-token pages, so matching and inserting cost the
//! number of runs, not of tokens. Edges are path-compressed; a node's
//! children are keyed by the first page key of their edge.
//!
//! Memory: every page on an edge is a page of KV memory. A node is *locked*
//! while a request uses it (its `lock_ref` counts the requests whose locked
//! path runs through it, as SGLang's `inc_lock_ref` walks to the root); an
//! unlocked node's pages are *evictable*. [`RadixCache::evict`] removes
//! unlocked leaves, least recently used first; a parent left without
//! children becomes a leaf in turn.
//!
//! KV events: the tree records, in each node, the chained hashes of the
//! prompt blocks (`block_size` tokens, the router's identity) whose *last*
//! token falls inside that node's token range. Such a block is cached
//! exactly while its node is in the tree, so creating the node stores those
//! blocks and evicting it removes them; splitting a node splits the list.
//!
//! Invariants (checked by `check_invariants` in tests): `evictable_pages` is
//! the sum of edge lengths of unlocked nodes; an unlocked node's children are
//! unlocked; `leaves` holds exactly the unlocked childless non-root nodes,
//! keyed by their last access; each child's start is its parent's end.

use std::collections::BTreeSet;

use hangar_core::{BlockHash, KvEvent};
use rustc_hash::FxHashMap;

use crate::pass::KvLog;
use crate::prompt::TokenRun;

/// Index of a node in the tree's arena.
pub(crate) type NodeId = u32;

/// The root: the empty prefix, never evicted.
pub(crate) const ROOT: NodeId = 0;

#[derive(Debug, Default)]
struct Node {
    parent: NodeId,
    children: FxHashMap<u64, NodeId>,
    /// The edge's page keys, run-length encoded (`count` pages of `token`).
    edge: Vec<TokenRun>,
    /// Page index of the edge's first page (its depth in pages).
    start: u32,
    /// Pages on the edge.
    len: u32,
    lock_ref: u32,
    last_access: u64,
    /// Index of the first block in `blocks` (blocks are consecutive).
    first_block: u32,
    /// Hashes of the prompt blocks whose last token lies in this node.
    blocks: Vec<BlockHash>,
}

/// A request's page keys: its prompt's full pages, then a key of its own
/// repeated without end (its generated tokens, and the prompt's last partial
/// page, are unique to it). Only a prefix of it is ever read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Keys<'a> {
    /// The prompt's full pages.
    pub prompt: &'a [TokenRun],
    /// The key of every later page.
    pub tail: u64,
}

/// A position in a [`Keys`] sequence.
#[derive(Debug, Clone, Copy)]
struct Cursor<'a> {
    keys: Keys<'a>,
    run: usize,
    used: u32,
}

impl<'a> Cursor<'a> {
    fn new(keys: Keys<'a>) -> Self {
        Self { keys, run: 0, used: 0 }
    }

    /// The current key and how many pages it repeats from here.
    fn peek(&self) -> (u64, u32) {
        match self.keys.prompt.get(self.run) {
            Some(r) => (r.token, r.count - self.used),
            None => (self.keys.tail, u32::MAX),
        }
    }

    fn advance(&mut self, mut n: u32) {
        while n > 0 && self.run < self.keys.prompt.len() {
            let left = self.keys.prompt[self.run].count - self.used;
            if n < left {
                self.used += n;
                return;
            }
            n -= left;
            self.run += 1;
            self.used = 0;
        }
    }

    /// Appends the next `n` pages to `out` as runs and advances past them.
    fn take_into(&mut self, mut n: u32, out: &mut Vec<TokenRun>) {
        while n > 0 {
            let (key, avail) = self.peek();
            let take = avail.min(n);
            match out.last_mut() {
                Some(last) if last.token == key => last.count += take,
                _ => out.push(TokenRun { token: key, count: take }),
            }
            self.advance(take);
            n -= take;
        }
    }
}

/// Pages both sequences share from their starts, at most `limit`.
fn common_pages(edge: &[TokenRun], keys: &Cursor<'_>, limit: u32) -> u32 {
    let mut k = *keys;
    let mut matched = 0;
    for r in edge {
        let mut left = r.count;
        while left > 0 {
            if matched == limit {
                return matched;
            }
            let (key, avail) = k.peek();
            if key != r.token {
                return matched;
            }
            let step = left.min(avail).min(limit - matched);
            matched += step;
            left -= step;
            k.advance(step);
        }
    }
    matched
}

/// The radix tree plus its memory accounting, in pages.
#[derive(Debug)]
pub(crate) struct RadixCache {
    page_size: u32,
    block_size: u32,
    nodes: Vec<Node>,
    free_nodes: Vec<NodeId>,
    /// Pages held by the tree (every node's edge).
    tree_pages: u64,
    /// Pages of unlocked nodes.
    evictable_pages: u64,
    /// Unlocked childless nodes by (last access, id): the eviction order.
    leaves: BTreeSet<(u64, NodeId)>,
    /// Logical clock for LRU order, bumped by every access.
    tick: u64,
}

impl RadixCache {
    /// An empty tree of `page_size`-token pages whose KV events name
    /// `block_size`-token blocks.
    pub fn new(page_size: u32, block_size: u32) -> Self {
        let root = Node { lock_ref: 1, ..Node::default() };
        Self {
            page_size,
            block_size,
            nodes: vec![root],
            free_nodes: Vec::new(),
            tree_pages: 0,
            evictable_pages: 0,
            leaves: BTreeSet::new(),
            tick: 0,
        }
    }

    /// Pages of KV memory the tree holds.
    pub fn tree_pages(&self) -> u64 {
        self.tree_pages
    }

    /// Pages [`evict`](Self::evict) could free.
    pub fn evictable_pages(&self) -> u64 {
        self.evictable_pages
    }

    /// The page index where `node`'s edge ends (its depth plus its length).
    pub fn end(&self, node: NodeId) -> u32 {
        let n = &self.nodes[node as usize];
        n.start + n.len
    }

    /// How many leading pages of `keys` (at most `limit`) the tree holds,
    /// without changing anything.
    pub fn match_len(&self, keys: Keys<'_>, limit: u32) -> u32 {
        let mut cur = Cursor::new(keys);
        let (mut node, mut matched) = (ROOT, 0);
        while matched < limit {
            let Some(&child) = self.nodes[node as usize].children.get(&cur.peek().0) else { break };
            let c = &self.nodes[child as usize];
            let m = common_pages(&c.edge, &cur, limit - matched);
            matched += m;
            if m < c.len {
                break;
            }
            cur.advance(m);
            node = child;
        }
        matched
    }

    /// Finds the longest cached prefix of `keys` (at most `limit` pages),
    /// splitting the last node so that the returned node ends exactly where
    /// the match does, and marks the path as used now. Returns the node and
    /// the matched pages (`ROOT` and 0 on a miss). Nothing is locked.
    pub fn match_prefix(&mut self, keys: Keys<'_>, limit: u32) -> (NodeId, u32) {
        self.tick += 1;
        let mut cur = Cursor::new(keys);
        let (mut node, mut matched) = (ROOT, 0);
        while matched < limit {
            let Some(&child) = self.nodes[node as usize].children.get(&cur.peek().0) else { break };
            let m = common_pages(&self.nodes[child as usize].edge, &cur, limit - matched);
            let child = if m < self.nodes[child as usize].len { self.split(child, m) } else { child };
            self.touch(child);
            matched += m;
            cur.advance(m);
            node = child;
        }
        (node, matched)
    }

    /// Inserts the first `upto` pages of `keys`, below `from` — a node the
    /// caller holds locked that is already a prefix of `keys` — where
    /// `blocks` are the chained hashes of the request's full prompt blocks
    /// (block `k` covers tokens `[k·block_size, (k+1)·block_size)`). Returns
    /// the node ending at `upto`. Pages new to the tree become the tree's
    /// memory (the caller gives up its private pages for the whole range:
    /// those the tree already had were computed twice). New nodes are
    /// unlocked; prompt blocks ending in them are logged as stored.
    pub fn insert(
        &mut self,
        keys: Keys<'_>,
        from: NodeId,
        upto: u32,
        blocks: &[BlockHash],
        log: &mut KvLog,
        events: &mut Vec<KvEvent>,
    ) -> NodeId {
        self.tick += 1;
        let mut node = from;
        let mut at = self.end(from);
        let mut cur = Cursor::new(keys);
        cur.advance(at);
        while at < upto {
            let key = cur.peek().0;
            let Some(&child) = self.nodes[node as usize].children.get(&key) else {
                return self.new_leaf(node, &mut cur, at, upto - at, blocks, log, events);
            };
            let m = common_pages(&self.nodes[child as usize].edge, &cur, upto - at);
            let child = if m < self.nodes[child as usize].len { self.split(child, m) } else { child };
            self.touch(child);
            at += m;
            cur.advance(m);
            node = child;
        }
        node
    }

    /// Adds one reference to every node from `node` up to the root.
    pub fn lock(&mut self, mut node: NodeId) {
        while node != ROOT {
            let n = &mut self.nodes[node as usize];
            n.lock_ref += 1;
            if n.lock_ref == 1 {
                self.evictable_pages -= u64::from(n.len);
                if n.children.is_empty() {
                    self.leaves.remove(&(n.last_access, node));
                }
            }
            node = n.parent;
        }
    }

    /// Drops one reference from every node from `node` up to the root.
    pub fn unlock(&mut self, mut node: NodeId) {
        while node != ROOT {
            let n = &mut self.nodes[node as usize];
            debug_assert!(n.lock_ref > 0, "node {node} unlocked more often than locked");
            n.lock_ref -= 1;
            if n.lock_ref == 0 {
                self.evictable_pages += u64::from(n.len);
                if n.children.is_empty() {
                    self.leaves.insert((n.last_access, node));
                }
            }
            node = n.parent;
        }
    }

    /// Evicts pages of unlocked leaves, least recently used leaf first,
    /// until `pages` pages were freed or nothing is evictable; returns the
    /// pages freed. A leaf longer than what is still needed loses only its
    /// newest pages (as Dynamo's mocker does), so a shared head outlives a
    /// long private tail. Prompt blocks whose last token goes are logged as
    /// removed.
    pub fn evict(&mut self, pages: u64, log: &mut KvLog, events: &mut Vec<KvEvent>) -> u64 {
        let mut freed = 0;
        while freed < pages {
            let Some(&(_, id)) = self.leaves.first() else { break };
            let want = pages - freed;
            if want < u64::from(self.nodes[id as usize].len) {
                self.trim(id, want as u32, log, events);
                return pages;
            }
            self.leaves.pop_first();
            let n = std::mem::take(&mut self.nodes[id as usize]);
            for &h in &n.blocks {
                log.removed(events, h);
            }
            freed += u64::from(n.len);
            self.tree_pages -= u64::from(n.len);
            self.evictable_pages -= u64::from(n.len);
            let parent = &mut self.nodes[n.parent as usize];
            parent.children.remove(&n.edge[0].token);
            if parent.children.is_empty() && parent.lock_ref == 0 {
                self.leaves.insert((parent.last_access, n.parent));
            }
            self.free_nodes.push(id);
        }
        freed
    }

    /// Drops the last `pages` pages of leaf `id` (fewer than it has).
    fn trim(&mut self, id: NodeId, pages: u32, log: &mut KvLog, events: &mut Vec<KvEvent>) {
        let n = &mut self.nodes[id as usize];
        let mut left = pages;
        while left > 0 {
            let last = n.edge.last_mut().expect("the leaf keeps a page");
            if last.count > left {
                last.count -= left;
                break;
            }
            left -= last.count;
            n.edge.pop();
        }
        n.len -= pages;
        let end_token = u64::from(n.start + n.len) * u64::from(self.page_size);
        let keep = (blocks_ending_before(end_token, self.block_size) as i64 - i64::from(n.first_block))
            .clamp(0, n.blocks.len() as i64) as usize;
        for h in n.blocks.drain(keep..) {
            log.removed(events, h);
        }
        self.tree_pages -= u64::from(pages);
        self.evictable_pages -= u64::from(pages);
    }

    fn touch(&mut self, id: NodeId) {
        let n = &mut self.nodes[id as usize];
        if n.lock_ref == 0 && n.children.is_empty() {
            self.leaves.remove(&(n.last_access, id));
            self.leaves.insert((self.tick, id));
        }
        n.last_access = self.tick;
    }

    /// Cuts `id`'s edge after `at` pages (0 < at < len): a new node takes
    /// the first part and `id`'s place under its parent; `id` keeps the rest
    /// as the new node's only child. Returns the new (upper) node.
    fn split(&mut self, id: NodeId, at: u32) -> NodeId {
        let up_id = self.alloc_id();
        let cut_token = u64::from(self.nodes[id as usize].start + at) * u64::from(self.page_size);
        let n = &mut self.nodes[id as usize];
        debug_assert!(at > 0 && at < n.len);
        let mut upper_edge = Vec::new();
        let mut left = at;
        let mut whole = 0;
        for r in &mut n.edge {
            if left >= r.count {
                left -= r.count;
                upper_edge.push(*r);
                whole += 1;
            } else {
                if left > 0 {
                    upper_edge.push(TokenRun { token: r.token, count: left });
                    r.count -= left;
                }
                break;
            }
        }
        n.edge.drain(..whole);
        // Blocks whose last token lies before the cut move up.
        let up_blocks = (blocks_ending_before(cut_token, self.block_size) as i64 - i64::from(n.first_block))
            .clamp(0, n.blocks.len() as i64) as usize;
        let lower_blocks = n.blocks.split_off(up_blocks);
        let upper = Node {
            parent: n.parent,
            children: FxHashMap::from_iter([(n.edge[0].token, id)]),
            edge: upper_edge,
            start: n.start,
            len: at,
            lock_ref: n.lock_ref,
            last_access: n.last_access,
            first_block: n.first_block,
            blocks: std::mem::replace(&mut n.blocks, lower_blocks),
        };
        n.first_block += up_blocks as u32;
        n.start += at;
        n.len -= at;
        n.parent = up_id;
        let (parent, key) = (upper.parent, upper.edge[0].token);
        self.nodes[up_id as usize] = upper;
        self.nodes[parent as usize].children.insert(key, up_id);
        up_id
    }

    /// Adds an unlocked leaf under `parent` for the next `len` pages of
    /// `cur`, starting at page `start`, and logs the prompt blocks ending in
    /// it as stored.
    #[allow(clippy::too_many_arguments)]
    fn new_leaf(
        &mut self,
        parent: NodeId,
        cur: &mut Cursor<'_>,
        start: u32,
        len: u32,
        blocks: &[BlockHash],
        log: &mut KvLog,
        events: &mut Vec<KvEvent>,
    ) -> NodeId {
        let id = self.alloc_id();
        let mut edge = Vec::new();
        cur.take_into(len, &mut edge);
        let page = u64::from(self.page_size);
        let lo = blocks_ending_before(u64::from(start) * page, self.block_size).min(blocks.len());
        let hi = blocks_ending_before(u64::from(start + len) * page, self.block_size).min(blocks.len());
        for k in lo..hi {
            log.stored(events, k.checked_sub(1).map(|p| blocks[p]), blocks[k]);
        }
        let key = edge[0].token;
        self.nodes[id as usize] = Node {
            parent,
            children: FxHashMap::default(),
            edge,
            start,
            len,
            lock_ref: 0,
            last_access: self.tick,
            first_block: lo as u32,
            blocks: blocks[lo..hi].to_vec(),
        };
        let p = &mut self.nodes[parent as usize];
        if p.children.is_empty() && p.lock_ref == 0 {
            self.leaves.remove(&(p.last_access, parent));
        }
        p.children.insert(key, id);
        self.leaves.insert((self.tick, id));
        self.tree_pages += u64::from(len);
        self.evictable_pages += u64::from(len);
        id
    }

    fn alloc_id(&mut self) -> NodeId {
        self.free_nodes.pop().unwrap_or_else(|| {
            self.nodes.push(Node::default());
            (self.nodes.len() - 1) as NodeId
        })
    }

    /// Panics if an invariant of the module docs does not hold.
    #[cfg(test)]
    pub fn check_invariants(&self) {
        let free: std::collections::HashSet<_> = self.free_nodes.iter().copied().collect();
        let (mut tree, mut evictable, mut leaves) = (0u64, 0u64, BTreeSet::new());
        for (i, n) in self.nodes.iter().enumerate() {
            let id = i as NodeId;
            if id == ROOT || free.contains(&id) {
                continue;
            }
            tree += u64::from(n.len);
            assert_eq!(n.edge.iter().map(|r| r.count).sum::<u32>(), n.len, "node {id}: edge length");
            assert!(n.len > 0, "node {id} is empty");
            let p = &self.nodes[n.parent as usize];
            assert_eq!(p.children.get(&n.edge[0].token), Some(&id), "node {id}: parent link");
            assert_eq!(p.start + p.len, n.start, "node {id} starts where its parent ends");
            if n.parent != ROOT {
                assert!(p.lock_ref >= n.lock_ref, "node {id}: locked more than its parent");
            }
            if n.lock_ref == 0 {
                evictable += u64::from(n.len);
                if n.children.is_empty() {
                    leaves.insert((n.last_access, id));
                }
            }
        }
        assert_eq!(tree, self.tree_pages, "tree pages");
        assert_eq!(evictable, self.evictable_pages, "evictable pages");
        assert_eq!(leaves, self.leaves, "evictable leaves");
    }
}

/// How many blocks end before token position `pos` (block `k` ends at token
/// `(k + 1)·block_size − 1`).
fn blocks_ending_before(pos: u64, block_size: u32) -> usize {
    (pos / u64::from(block_size)) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Run-length keys of a page sequence.
    fn runs(pages: &[u64]) -> Vec<TokenRun> {
        let mut out: Vec<TokenRun> = Vec::new();
        for &k in pages {
            match out.last_mut() {
                Some(r) if r.token == k => r.count += 1,
                _ => out.push(TokenRun { token: k, count: 1 }),
            }
        }
        out
    }

    fn keys(r: &[TokenRun]) -> Keys<'_> {
        Keys { prompt: r, tail: u64::MAX }
    }

    fn insert(t: &mut RadixCache, pages: &[u64], ev: &mut Vec<KvEvent>) -> NodeId {
        let r = runs(pages);
        t.insert(keys(&r), ROOT, pages.len() as u32, &[], &mut KvLog::on(), ev)
    }

    #[test]
    fn insert_match_and_split() {
        let mut t = RadixCache::new(1, 4);
        let mut ev = Vec::new();
        let a = insert(&mut t, &[1, 1, 1, 2, 3], &mut ev);
        assert_eq!((t.tree_pages(), t.end(a)), (5, 5));
        let q = runs(&[1, 1, 1, 2, 9]);
        assert_eq!(t.match_len(keys(&q), 10), 4);
        assert_eq!(t.match_len(keys(&q), 2), 2, "the limit caps the match");
        // Inserting a sibling splits [1 1 1 2 3] after 4 pages.
        let b = insert(&mut t, &[1, 1, 1, 2, 9, 9], &mut ev);
        assert_eq!((t.tree_pages(), t.end(b)), (7, 6));
        t.check_invariants();
        // Matching inside an edge splits it so the node ends at the match.
        let (n, m) = t.match_prefix(keys(&runs(&[1, 1, 7])), 10);
        assert_eq!((m, t.end(n)), (2, 2));
        t.check_invariants();
        assert_eq!(t.tree_pages(), 7, "splits move pages, never add them");
        let (n, m) = t.match_prefix(keys(&runs(&[5])), 10);
        assert_eq!((n, m), (ROOT, 0));
    }

    #[test]
    fn eviction_is_lru_over_leaves_and_spares_locked_nodes() {
        let mut t = RadixCache::new(1, 4);
        let mut ev = Vec::new();
        let a = insert(&mut t, &[1, 2, 3], &mut ev);
        let b = insert(&mut t, &[1, 2, 4], &mut ev);
        let c = insert(&mut t, &[7, 7], &mut ev);
        t.lock(c);
        t.match_prefix(keys(&runs(&[1, 2, 3])), 3); // `a` is now more recent than `b`
        assert_eq!(t.evictable_pages(), 4);
        assert_eq!(t.evict(1, &mut KvLog::on(), &mut ev), 1);
        assert_eq!(t.match_len(keys(&runs(&[1, 2, 4])), 3), 2, "the least recently used leaf went first");
        assert_eq!(t.match_len(keys(&runs(&[1, 2, 3])), 3), 3);
        // Evicting everything evictable keeps the locked `c`.
        assert_eq!(
            t.evict(u64::MAX, &mut KvLog::on(), &mut ev),
            3,
            "`a`, then its parent once it became a leaf"
        );
        // A long leaf loses only its newest pages.
        let d = insert(&mut t, &[8, 8, 8, 9, 9], &mut ev);
        assert_eq!(t.evict(2, &mut KvLog::on(), &mut ev), 2);
        assert_eq!(t.match_len(keys(&runs(&[8, 8, 8, 9, 9])), 5), 3);
        assert_eq!(t.end(d), 3);
        t.evict(u64::MAX, &mut KvLog::on(), &mut ev);
        assert_eq!((t.tree_pages(), t.evictable_pages()), (2, 0));
        assert_eq!(t.match_len(keys(&runs(&[7, 7])), 2), 2);
        t.check_invariants();
        t.unlock(c);
        assert_eq!(t.evictable_pages(), 2);
        t.check_invariants();
        let _ = (a, b);
    }

    #[test]
    fn blocks_are_stored_once_split_with_their_node_and_removed_on_eviction() {
        // Pages of 2 tokens, blocks of 4: block k ends in page 2k + 1.
        let mut t = RadixCache::new(2, 4);
        let mut ev = Vec::new();
        let hashes: Vec<BlockHash> = (10..13).map(BlockHash).collect();
        let r = runs(&[1, 2, 3, 4, 5, 6]);
        t.insert(keys(&r), ROOT, 6, &hashes, &mut KvLog::on(), &mut ev);
        assert_eq!(ev, vec![KvEvent::Stored { parent: None, blocks: hashes.clone() }]);
        ev.clear();
        // A prompt sharing 3 pages (block 0 and half of block 1) splits the
        // node after page 3: block 0 moves up, blocks 1 and 2 stay below.
        let other: Vec<BlockHash> = vec![BlockHash(10), BlockHash(99)];
        let r2 = runs(&[1, 2, 3, 8]);
        let n = t.insert(keys(&r2), ROOT, 4, &other, &mut KvLog::on(), &mut ev);
        assert_eq!(ev, vec![KvEvent::Stored { parent: Some(BlockHash(10)), blocks: vec![BlockHash(99)] }]);
        t.check_invariants();
        ev.clear();
        t.lock(n);
        // The unlocked leaf holds pages 3..6. Trimming page 5 drops block 2,
        // which ends in it; trimming page 4 drops none (block 1 ends in page
        // 3); evicting page 3 drops block 1.
        t.evict(1, &mut KvLog::on(), &mut ev);
        assert_eq!(ev, vec![KvEvent::Removed { blocks: vec![BlockHash(12)] }]);
        t.evict(1, &mut KvLog::on(), &mut ev);
        assert_eq!(ev.len(), 1);
        t.evict(u64::MAX, &mut KvLog::on(), &mut ev);
        assert_eq!(ev, vec![KvEvent::Removed { blocks: vec![BlockHash(12), BlockHash(11)] }]);
        assert_eq!(t.tree_pages(), 4);
        t.check_invariants();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(Vec<u64>),
        Lock(usize),
        Unlock(usize),
        Evict(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            proptest::collection::vec(0u64..3, 1..10).prop_map(Op::Insert),
            any::<usize>().prop_map(Op::Lock),
            any::<usize>().prop_map(Op::Unlock),
            (0u8..6).prop_map(Op::Evict),
        ]
    }

    proptest! {
        /// Random inserts, locks and evictions against a model: memory adds
        /// up (pages held = pages inserted − pages evicted), locked prefixes
        /// are never evicted, and a match never exceeds what some cached
        /// sequence shares with the query.
        #[test]
        fn tree_keeps_its_invariants(ops in proptest::collection::vec(op(), 1..60)) {
            let mut t = RadixCache::new(1, 2);
            let mut ev = Vec::new();
            let mut seqs: Vec<Vec<u64>> = Vec::new();
            let mut locks: Vec<(NodeId, Vec<u64>)> = Vec::new();
            let mut pages = 0u64;
            for op in ops {
                match op {
                    Op::Insert(p) => {
                        let before = t.tree_pages();
                        let cached = t.match_len(keys(&runs(&p)), p.len() as u32);
                        insert(&mut t, &p, &mut ev);
                        prop_assert_eq!(t.tree_pages() - before, (p.len() as u32 - cached) as u64);
                        pages += u64::from(p.len() as u32 - cached);
                        seqs.push(p);
                    }
                    Op::Lock(i) if !seqs.is_empty() => {
                        let p = seqs[i % seqs.len()].clone();
                        let (n, m) = t.match_prefix(keys(&runs(&p)), p.len() as u32);
                        t.lock(n);
                        locks.push((n, p[..m as usize].to_vec()));
                    }
                    Op::Unlock(i) if !locks.is_empty() => {
                        let (n, _) = locks.swap_remove(i % locks.len());
                        t.unlock(n);
                    }
                    Op::Evict(n) => {
                        let evictable = t.evictable_pages();
                        let freed = t.evict(u64::from(n), &mut KvLog::on(), &mut ev);
                        prop_assert_eq!(freed, u64::from(n).min(evictable), "exactly what was asked, if it can");
                        pages -= freed;
                    }
                    _ => {}
                }
                t.check_invariants();
                prop_assert_eq!(t.tree_pages(), pages);
                for (n, p) in &locks {
                    prop_assert_eq!(t.end(*n) as usize, p.len());
                    prop_assert_eq!(t.match_len(keys(&runs(p)), p.len() as u32) as usize, p.len());
                }
                let q = [0u64, 1, 2, 0, 1];
                let best = seqs.iter().map(|s| s.iter().zip(&q).take_while(|(a, b)| a == b).count()).max();
                prop_assert!(t.match_len(keys(&runs(&q)), 5) as usize <= best.unwrap_or(0));
            }
        }
    }
}
