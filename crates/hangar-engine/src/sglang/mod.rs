//! The SGLang scheduler, pass by pass, as Dynamo's mocker models it.
//!
//! KV memory is `num_gpu_blocks × block_size` tokens in pages of
//! `page_size` tokens. Cached prefixes live in a [`radix`] tree; a request
//! holds its matched prefix locked plus *private* pages for tokens it
//! computed beyond it. As in the vLLM scheduler, a request is a sequence of
//! `prompt + generated` tokens of which the first `computed` have KV; a pass
//! whose work brings `computed` to the sequence's end samples one token.
//!
//! SGLang never mixes prefill and decode in one pass. Each
//! [`SglangScheduler::step`]:
//! 1. orders the waiting queue (`fifo`, or `lpm`: most cached pages first,
//!    requests whose short-match prefix duplicates one ahead of them last,
//!    falling back to FIFO above 128 waiting requests, as SGLang does);
//! 2. tries to form a prefill batch: first the request whose prefill was
//!    chunked in the last pass, then waiting requests in order, while fewer
//!    than `max_num_seqs` run, within `chunked_prefill_size` new tokens (the
//!    last admitted request is chunked at a page boundary), and while free
//!    plus evictable memory exceeds the new tokens plus its remaining output
//!    (clipped at 4096) plus `new_token_ratio ×` the remaining output of
//!    every running request. Each admitted request reuses its longest
//!    cached prefix (at most `len − 1` tokens, so one is always computed);
//! 3. if a batch formed, runs it: requests that finish their prompt emit
//!    their first token and join the running batch (running requests wait);
//! 4. otherwise runs one decode pass over every running request. If the
//!    free and evictable pages cannot give each one the page its next token
//!    needs, requests are *retracted* — fewest generated tokens first, then
//!    longest prompt, then the most recently admitted — releasing their
//!    memory (their computed pages stay cached, unlocked) and going to the
//!    back of the waiting queue, where they recompute mostly from the cache;
//!    `new_token_ratio` is then re-estimated from the survivors as SGLang's
//!    `retract_decode` does. A decode pass without retraction decays the
//!    ratio by `new_token_ratio_decay`, down to `min_new_token_ratio`.
//!
//! KV events use the router's identity, the chained hashes of full
//! `block_size`-token prompt blocks ([`crate::Prompt::blocks`]); blocks
//! holding generated tokens are cached in the tree but never reported (no
//! other request can ask for them).

mod radix;

use std::collections::VecDeque;

use hangar_core::{mix64, BlockHash, KvEvent, RequestId};
use rustc_hash::FxHashSet;

use crate::config::{EngineConfig, SglangPolicy};
use crate::pass::{Admission, KvLog, Pass, TokenEmission};
use crate::prompt::TokenRun;
use crate::requests::{RequestTable, Slot};
use crate::timing::{DecodeShape, PrefillShape, SharedTiming};
use crate::{AddError, EngineRequest};
use radix::{Keys, NodeId, RadixCache, ROOT};

/// SGLang's `SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION`: admission reserves
/// memory for at most this many output tokens per request.
const CLIP_MAX_NEW_TOKENS: u32 = 4096;
/// Above this many waiting requests, `lpm` scheduling falls back to FIFO.
const LPM_FALLBACK_THRESHOLD: usize = 128;
/// `lpm`: a request whose cached match is at most this many tokens, and
/// whose first this-many tokens equal those of a request ahead of it, is
/// moved behind the others (it will hit the cache once that one ran).
const IN_BATCH_PREFIX_TOKENS: u32 = 32;
/// SGLang's `SGLANG_RETRACT_DECODE_STEPS`: after a retraction the ratio is
/// re-estimated to reserve this many decode steps per surviving request.
const RETRACT_DECODE_STEPS: f64 = 20.0;

#[derive(Debug)]
struct Seq {
    id: RequestId,
    prompt_len: u32,
    output_len: u32,
    generated: u32,
    /// Tokens whose KV this request holds.
    computed: u32,
    /// Pages it holds: its locked tree prefix plus private pages.
    pages: u32,
    /// The deepest tree node it holds locked (`ROOT`: none).
    node: NodeId,
    /// Page keys of the prompt's full pages.
    page_runs: Vec<TokenRun>,
    /// Key of every later page (unique to this request).
    tail_key: u64,
    /// Chained hashes of the prompt's full blocks (for KV events).
    blocks: Vec<BlockHash>,
    admitted_before: bool,
    /// The end of the pass that emitted its last token.
    last_token_ms: Option<f64>,
}

impl Seq {
    fn num_tokens(&self) -> u32 {
        self.prompt_len + self.generated
    }

    fn remaining_output(&self) -> u32 {
        self.output_len - self.generated
    }

    fn keys(&self) -> Keys<'_> {
        Keys { prompt: &self.page_runs, tail: self.tail_key }
    }
}

/// The SGLang-style scheduler state machine. See the module docs.
#[derive(Debug)]
pub struct SglangScheduler {
    page_size: u32,
    block_size: u32,
    max_num_seqs: usize,
    chunk_size: u32,
    chunked_prefill: bool,
    prefix_caching: bool,
    policy: SglangPolicy,
    min_ratio: f64,
    ratio_decay: f64,
    new_token_ratio: f64,
    speedup_ratio: f64,
    capacity_tokens: u64,
    total_pages: u64,
    timing: SharedTiming,
    kv: KvLog,
    tree: RadixCache,
    /// Pages held by requests outside the tree.
    private_pages: u64,
    requests: RequestTable<Seq>,
    waiting: VecDeque<u32>,
    running: Vec<u32>,
    /// The request whose prefill was chunked: it holds memory and continues
    /// first in the next prefill batch.
    chunked: Option<u32>,
    /// Per pass: (slot, new tokens); kept to reuse its allocation.
    batch: Vec<(u32, u32)>,
    /// `lpm` scratch: (deprioritized, cached pages, slot).
    scored: Vec<(bool, u32, u32)>,
    /// Per pass: slots of running requests that emitted a token, to stamp
    /// with the pass's end once it is timed.
    emitted: Vec<u32>,
}

/// What a prefill batch still has room for while it is being formed.
struct Budget {
    /// New tokens the batch may still compute.
    chunk: u32,
    /// Tokens promised to the outputs of running and admitted requests.
    reserved: f64,
    /// Requests the batch may still take.
    seqs: usize,
}

impl SglangScheduler {
    pub(crate) fn new(config: &EngineConfig, timing: SharedTiming) -> Self {
        let s = &config.sglang;
        let capacity_tokens = config.capacity_tokens();
        Self {
            page_size: s.page_size,
            block_size: config.block_size,
            max_num_seqs: config.max_num_seqs as usize,
            chunk_size: s.chunked_prefill_size,
            chunked_prefill: config.enable_chunked_prefill,
            prefix_caching: config.enable_prefix_caching,
            policy: s.schedule_policy,
            min_ratio: s.min_new_token_ratio,
            ratio_decay: s.new_token_ratio_decay,
            new_token_ratio: s.init_new_token_ratio,
            speedup_ratio: config.speedup_ratio,
            capacity_tokens,
            total_pages: capacity_tokens / u64::from(s.page_size),
            timing,
            kv: KvLog::on(),
            tree: RadixCache::new(s.page_size, config.block_size),
            private_pages: 0,
            requests: RequestTable::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            chunked: None,
            batch: Vec::new(),
            scored: Vec::new(),
            emitted: Vec::new(),
        }
    }

    pub(crate) fn set_kv_events(&mut self, on: bool) {
        self.kv.enabled = on;
    }

    /// Refuses requests that could never be admitted: SGLang admits only
    /// while a request's tokens stay strictly below the memory it could
    /// get, so prompt plus output must leave one page of the pool spare.
    pub(crate) fn add(&mut self, req: EngineRequest) -> Result<(), AddError> {
        let capacity = (self.total_pages * u64::from(self.page_size)).saturating_sub(self.page_size.into());
        self.requests.check(&req, self.block_size, capacity)?;
        let seq = Seq {
            id: req.id,
            prompt_len: req.prompt.len(),
            output_len: req.max_output_tokens,
            generated: 0,
            computed: 0,
            pages: 0,
            node: ROOT,
            page_runs: req.prompt.page_key_runs(self.page_size),
            tail_key: mix64(req.id.0, 0x7367_6c61_6e67_6f75),
            blocks: req.prompt.into_blocks(),
            admitted_before: false,
            last_token_ms: None,
        };
        let slot = self.requests.insert(req.id, seq);
        self.waiting.push_back(slot);
        Ok(())
    }

    pub(crate) fn abort(&mut self, id: RequestId) -> bool {
        let Some(slot) = self.requests.forget(id) else { return false };
        if let Some(pos) = self.running.iter().position(|&s| s == slot) {
            self.running.remove(pos);
        } else if self.chunked == Some(slot) {
            self.chunked = None;
        } else if let Some(pos) = self.waiting.iter().position(|&s| s == slot) {
            self.waiting.remove(pos);
        }
        self.release(slot);
        self.requests.free(slot);
        true
    }

    pub(crate) fn num_running(&self) -> usize {
        self.running.len() + usize::from(self.chunked.is_some())
    }

    pub(crate) fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub(crate) fn kv_usage(&self) -> f64 {
        let held = self.tree.tree_pages() - self.tree.evictable_pages() + self.private_pages;
        held as f64 / self.total_pages as f64
    }

    pub(crate) fn clear_cache(&mut self, events: &mut Vec<KvEvent>) {
        self.tree.evict(u64::MAX, &mut KvLog::default(), &mut Vec::new());
        self.kv.cleared(events);
    }

    fn seq(&self, slot: Slot) -> &Seq {
        self.requests.get(slot)
    }

    fn seq_mut(&mut self, slot: Slot) -> &mut Seq {
        self.requests.get_mut(slot)
    }

    fn free_pages(&self) -> u64 {
        self.total_pages - self.tree.tree_pages() - self.private_pages
    }

    fn pages_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.page_size)
    }

    pub(crate) fn step(&mut self, now: f64, out: &mut Pass) {
        self.kv.recycle(&mut out.kv_events);
        out.reset(now);
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear();
        self.form_prefill_batch(&mut batch, out);
        if !batch.is_empty() {
            self.run_prefill(&batch, out);
        } else if !self.running.is_empty() {
            self.run_decode(out);
        }
        self.batch = batch;
    }

    /// Step 2 of the module docs: fills `batch` with (slot, new tokens).
    fn form_prefill_batch(&mut self, batch: &mut Vec<(u32, u32)>, out: &mut Pass) {
        if self.policy == SglangPolicy::Lpm
            && self.prefix_caching
            && self.waiting.len() <= LPM_FALLBACK_THRESHOLD
        {
            self.sort_longest_prefix_first();
        }
        let reserved: u64 = self
            .running
            .iter()
            .map(|&s| u64::from(self.seq(s).remaining_output().min(CLIP_MAX_NEW_TOKENS)))
            .sum();
        let mut budget = Budget {
            chunk: self.chunk_size,
            reserved: reserved as f64 * self.new_token_ratio,
            seqs: self.max_num_seqs - self.running.len(),
        };
        if let Some(slot) = self.chunked {
            if !self.try_schedule(slot, false, &mut budget, batch, out) {
                return;
            }
            self.chunked = None;
        }
        while budget.seqs > 0 && budget.chunk > 0 {
            let Some(&slot) = self.waiting.front() else { break };
            if !self.try_schedule(slot, true, &mut budget, batch, out) {
                break;
            }
            self.waiting.pop_front();
        }
    }

    /// Schedules the next chunk of the request at `slot` — a waiting one
    /// (`fresh`: it first matches the cache) or the chunked one — if the
    /// budget and memory allow; returns whether it did.
    fn try_schedule(
        &mut self,
        slot: Slot,
        fresh: bool,
        budget: &mut Budget,
        batch: &mut Vec<(u32, u32)>,
        out: &mut Pass,
    ) -> bool {
        let page = self.page_size;
        let s = self.requests.get(slot);
        let (node, held, start) = if !fresh {
            (s.node, s.pages, s.computed)
        } else if self.prefix_caching {
            let (node, matched) = self.tree.match_prefix(s.keys(), s.num_tokens().saturating_sub(1) / page);
            (node, matched, matched * page)
        } else {
            (ROOT, 0, 0)
        };
        let s = self.seq(slot);
        let extend = s.num_tokens() - start;
        let chunk =
            if extend.div_ceil(page) * page <= budget.chunk || (!self.chunked_prefill && batch.is_empty()) {
                extend
            } else if self.chunked_prefill && budget.chunk >= page {
                (budget.chunk / page * page).min(extend)
            } else {
                return false;
            };
        let charged = chunk.div_ceil(page) * page;
        let reserve = if chunk < extend { 0 } else { s.remaining_output().min(CLIP_MAX_NEW_TOKENS) };
        if fresh {
            // Locking the prefix takes it out of the evictable memory the
            // check below counts on.
            self.tree.lock(node);
        }
        let available = (self.free_pages() + self.tree.evictable_pages()) * u64::from(page);
        if (u64::from(charged) + u64::from(reserve)) as f64 >= available as f64 - budget.reserved {
            if fresh {
                self.tree.unlock(node);
            }
            return false;
        }
        let need = u64::from(self.pages_for(start + chunk) - held);
        let free = self.free_pages();
        if need > free {
            self.tree.evict(need - free, &mut self.kv, &mut out.kv_events);
        }
        self.private_pages += need;
        let s = self.seq_mut(slot);
        s.pages = held + need as u32;
        if fresh {
            s.node = node;
            s.computed = start;
            out.admitted.push(Admission { request: s.id, reused_tokens: start, first: !s.admitted_before });
            s.admitted_before = true;
        }
        budget.reserved += f64::from(reserve);
        budget.chunk -= charged.min(budget.chunk);
        budget.seqs -= 1;
        batch.push((slot, chunk));
        true
    }

    /// `lpm` order: most cached pages first; among requests with almost no
    /// cached prefix, those whose first tokens repeat an earlier waiting
    /// request's go last. The sort is stable, so arrival order breaks ties.
    fn sort_longest_prefix_first(&mut self) {
        let mut scored = std::mem::take(&mut self.scored);
        scored.clear();
        let dup_pages = IN_BATCH_PREFIX_TOKENS.div_ceil(self.page_size);
        let mut seen = FxHashSet::default();
        for &slot in &self.waiting {
            let s = self.seq(slot);
            let cached = self.tree.match_len(s.keys(), s.num_tokens().saturating_sub(1) / self.page_size);
            let deprioritized = cached * self.page_size <= IN_BATCH_PREFIX_TOKENS
                && s.num_tokens() >= dup_pages * self.page_size
                && !seen.insert(prefix_fingerprint(s.keys(), dup_pages));
            scored.push((deprioritized, cached, slot));
        }
        scored.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        self.waiting.clear();
        self.waiting.extend(scored.iter().map(|&(_, _, slot)| slot));
        self.scored = scored;
    }

    /// Step 3: runs a prefill batch.
    fn run_prefill(&mut self, batch: &[(u32, u32)], out: &mut Pass) {
        let mut shape = PrefillShape::default();
        self.emitted.clear();
        for &(slot, chunk) in batch {
            shape.batch += 1;
            shape.new_tokens += chunk;
            self.seq_mut(slot).computed += chunk;
            self.cache_computed(slot, out);
            let s = self.seq_mut(slot);
            if s.computed < s.num_tokens() {
                self.chunked = Some(slot);
                continue;
            }
            if s.generated < s.output_len {
                out.tokens.push(TokenEmission {
                    request: s.id,
                    index: s.generated,
                    previous_ms: s.last_token_ms,
                });
                s.generated += 1;
            }
            if s.generated == s.output_len {
                self.finish(slot, out);
            } else {
                self.running.push(slot);
                self.emitted.push(slot);
            }
        }
        out.scheduled_seqs = batch.len() as u32;
        out.prefill_tokens = shape.new_tokens;
        if shape.new_tokens > 0 {
            out.end_ms = out.start_ms + self.timing.prefill_ms(shape) / self.speedup_ratio;
        }
        self.stamp_emitted(out.end_ms);
    }

    /// The requests still running that emitted a token this pass had it at
    /// `end_ms`, the pass's end.
    fn stamp_emitted(&mut self, end_ms: f64) {
        for i in 0..self.emitted.len() {
            let slot = self.emitted[i];
            self.seq_mut(slot).last_token_ms = Some(end_ms);
        }
    }

    /// Step 4: one decode pass over the running requests, retracting first
    /// if their next tokens do not fit.
    fn run_decode(&mut self, out: &mut Pass) {
        let page = self.page_size;
        // The page for the token each request computes now (its last sampled).
        let need_of = |s: &Seq| u64::from(s.computed + 1 > s.pages * page);
        let mut need: u64 = self.running.iter().map(|&slot| need_of(self.seq(slot))).sum();
        let mut retracted = false;
        while need > self.free_pages() + self.tree.evictable_pages() {
            retracted = true;
            if self.running.len() > 1 {
                let victim = self.retraction_victim();
                let slot = self.running.remove(victim);
                need -= need_of(self.seq(slot));
                self.retract(slot, out);
                self.waiting.push_back(slot);
            } else {
                // A lone request always fits once the chunked prefill, the
                // only other holder of memory, lets go (see `add`).
                let slot =
                    self.chunked.take().expect("a lone running request fits unless a prefill is chunked");
                self.retract(slot, out);
                self.waiting.push_front(slot);
            }
        }
        if retracted {
            let (done, total, n) = self.running.iter().fold((0u64, 0u64, 0u64), |(d, t, n), &slot| {
                let s = self.seq(slot);
                (d + u64::from(s.generated), t + u64::from(s.output_len), n + 1)
            });
            self.new_token_ratio =
                ((done as f64 + RETRACT_DECODE_STEPS * n as f64) / (total as f64 + 1.0)).min(1.0);
        } else {
            self.new_token_ratio = (self.new_token_ratio - self.ratio_decay).max(self.min_ratio);
        }
        let free = self.free_pages();
        if need > free {
            self.tree.evict(need - free, &mut self.kv, &mut out.kv_events);
        }
        self.private_pages += need;
        let mut shape = DecodeShape { capacity_tokens: self.capacity_tokens, ..DecodeShape::default() };
        self.emitted.clear();
        let mut i = 0;
        while i < self.running.len() {
            let slot = self.running[i];
            let s = self.seq_mut(slot);
            s.pages += need_of(s) as u32;
            shape.batch += 1;
            shape.context_tokens += u64::from(s.num_tokens());
            s.computed += 1;
            out.tokens.push(TokenEmission {
                request: s.id,
                index: s.generated,
                previous_ms: s.last_token_ms,
            });
            s.generated += 1;
            if s.generated == s.output_len {
                self.running.remove(i);
                self.finish(slot, out);
            } else {
                self.emitted.push(slot);
                i += 1;
            }
        }
        out.scheduled_seqs = shape.batch;
        out.decode_seqs = shape.batch;
        out.end_ms = out.start_ms + self.timing.decode_ms(shape) / self.speedup_ratio;
        self.stamp_emitted(out.end_ms);
    }

    /// The running request SGLang retracts first: fewest generated tokens,
    /// then longest prompt, then the most recently admitted.
    fn retraction_victim(&self) -> usize {
        let key = |i: usize| {
            let s = self.seq(self.running[i]);
            (s.generated, std::cmp::Reverse(s.prompt_len))
        };
        (0..self.running.len()).rev().min_by_key(|&i| key(i)).expect("running is not empty")
    }

    /// Inserts the request's computed full pages into the tree and moves its
    /// lock to the new deepest node; pages the tree already had are freed.
    fn cache_computed(&mut self, slot: Slot, out: &mut Pass) {
        if !self.prefix_caching {
            return;
        }
        let s = self.requests.get_mut(slot);
        let upto = s.computed / self.page_size;
        let locked = self.tree.end(s.node);
        if upto <= locked {
            return;
        }
        let keys = Keys { prompt: &s.page_runs, tail: s.tail_key };
        let node = self.tree.insert(keys, s.node, upto, &s.blocks, &mut self.kv, &mut out.kv_events);
        self.tree.lock(node);
        self.tree.unlock(s.node);
        // The request still holds as many pages, but `upto − locked` of
        // them are now the tree's: new nodes took them over, and those the
        // tree already had (computed twice) were freed.
        s.node = node;
        self.private_pages -= u64::from(upto - locked);
    }

    /// Gives back everything the request holds: its private pages are
    /// freed, its tree path unlocked.
    fn release(&mut self, slot: Slot) {
        let s = self.requests.get_mut(slot);
        self.private_pages -= u64::from(s.pages - self.tree.end(s.node));
        self.tree.unlock(s.node);
        s.node = ROOT;
        s.pages = 0;
    }

    /// Retracts a request: its computed pages are cached, its memory
    /// released, and it will recompute from the start. The caller queues it.
    fn retract(&mut self, slot: Slot, out: &mut Pass) {
        self.cache_computed(slot, out);
        self.release(slot);
        let s = self.seq_mut(slot);
        s.computed = 0;
        out.preempted.push(s.id);
    }

    fn finish(&mut self, slot: Slot, out: &mut Pass) {
        self.cache_computed(slot, out);
        self.release(slot);
        let id = self.requests.free(slot).id;
        self.requests.forget(id);
        out.completed.push(id);
    }

    #[cfg(test)]
    fn check_invariants(&self) {
        self.tree.check_invariants();
        assert!(self.num_running() <= self.max_num_seqs, "max_num_seqs exceeded");
        let mut private = 0u64;
        for &slot in self.running.iter().chain(self.chunked.iter()) {
            let s = self.seq(slot);
            let locked = self.tree.end(s.node);
            assert!(s.pages >= locked, "a request holds its locked prefix");
            assert_eq!(s.pages, self.pages_for(s.computed), "pages cover exactly the computed tokens");
            assert!(s.generated <= s.output_len);
            private += u64::from(s.pages - locked);
        }
        assert_eq!(private, self.private_pages, "private pages add up");
        assert!(self.tree.tree_pages() + self.private_pages <= self.total_pages, "memory overcommitted");
        for &slot in &self.waiting {
            let s = self.seq(slot);
            assert!(s.pages == 0 && s.node == ROOT && s.computed == 0, "a waiting request holds nothing");
        }
        assert!((0.0..=1.0).contains(&self.new_token_ratio));
    }
}

/// A hash of the first `pages` page keys of `keys`.
fn prefix_fingerprint(keys: Keys<'_>, pages: u32) -> u64 {
    let mut acc = u64::from(pages);
    let mut left = pages;
    for r in keys.prompt {
        if left == 0 {
            return acc;
        }
        let take = r.count.min(left);
        acc = mix64(acc ^ r.token, u64::from(take));
        left -= take;
    }
    if left > 0 {
        acc = mix64(acc ^ keys.tail, u64::from(left));
    }
    acc
}

#[cfg(test)]
mod tests;
