//! The vLLM v1 scheduler, pass by pass.
//!
//! Every request is a sequence of `num_tokens = prompt + generated` tokens of
//! which the first `num_computed` have KV in the cache. A pass gives each
//! scheduled request some new tokens to compute; a request whose computed
//! tokens reach `num_tokens` samples one more token at the end of the pass.
//! That one rule covers prefill (many new tokens), chunked prefill (a part of
//! them), decode (one new token: the last sampled one) and recompute after
//! preemption (all tokens again, mostly cache hits).
//!
//! A pass ([`VllmScheduler::step`]) schedules, in order:
//! 1. running requests, oldest first, each up to its remaining tokens within
//!    the pass's token budget; when blocks run out, the most recently
//!    admitted running request is preempted (LIFO): its blocks are released
//!    (full ones stay cached) and it returns to the front of the waiting
//!    queue to be recomputed;
//! 2. if nothing was preempted, waiting requests in order while a sequence
//!    slot, budget and blocks remain, each first reusing the cached blocks of
//!    its longest cached prefix (at least one token is always computed, as in
//!    vLLM). The queue head that does not fit blocks the rest (FCFS).

mod block_pool;

use std::collections::VecDeque;

use hangar_core::{mix64, BlockHash, RequestId};

use crate::config::EngineConfig;
use crate::pass::{Admission, KvLog, Pass, TokenEmission};
use crate::requests::RequestTable;
use crate::timing::{DecodeShape, PrefillShape, SharedTiming};
use crate::{AddError, EngineRequest};
use block_pool::{BlockId, BlockPool};

#[derive(Debug)]
struct Seq {
    id: RequestId,
    prompt_len: u32,
    output_len: u32,
    generated: u32,
    num_computed: u32,
    blocks: Vec<BlockId>,
    /// Chained hashes of the full blocks known so far: the prompt's, then
    /// those of blocks filled by generated tokens, appended as they fill.
    hashes: Vec<BlockHash>,
    /// How many leading `blocks` are registered in the cache (or were hits).
    registered: u32,
    /// Identity of this request's generated tokens.
    salt: u64,
    admitted_before: bool,
    /// The end of the pass that emitted its last token.
    last_token_ms: Option<f64>,
}

impl Seq {
    fn num_tokens(&self) -> u32 {
        self.prompt_len + self.generated
    }
}

/// The vLLM-style scheduler state machine. See the module docs.
#[derive(Debug)]
pub struct VllmScheduler {
    block_size: u32,
    max_num_seqs: usize,
    max_num_batched_tokens: u32,
    prefix_caching: bool,
    chunked_prefill: bool,
    speedup_ratio: f64,
    capacity_tokens: u64,
    timing: SharedTiming,
    kv: KvLog,
    pool: BlockPool,
    requests: RequestTable<Seq>,
    waiting: VecDeque<u32>,
    running: Vec<u32>,
    /// Per pass: (slot, new tokens); kept to reuse its allocation.
    scheduled: Vec<(u32, u32)>,
    /// The cached blocks found for the waiting queue's head.
    hits: Vec<BlockId>,
    /// Per pass: slots of requests that completed.
    completed: Vec<u32>,
    /// Per pass: slots of requests that emitted a token, to stamp with the
    /// pass's end once it is timed.
    emitted: Vec<u32>,
}

impl VllmScheduler {
    pub(crate) fn new(config: &EngineConfig, timing: SharedTiming) -> Self {
        Self {
            block_size: config.block_size,
            max_num_seqs: config.max_num_seqs as usize,
            max_num_batched_tokens: config.max_num_batched_tokens,
            prefix_caching: config.enable_prefix_caching,
            chunked_prefill: config.enable_chunked_prefill,
            speedup_ratio: config.speedup_ratio,
            capacity_tokens: config.capacity_tokens(),
            timing,
            kv: KvLog::on(),
            pool: BlockPool::new(config.num_gpu_blocks),
            requests: RequestTable::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            scheduled: Vec::new(),
            hits: Vec::new(),
            completed: Vec::new(),
            emitted: Vec::new(),
        }
    }

    pub(crate) fn set_kv_events(&mut self, on: bool) {
        self.kv.enabled = on;
    }

    pub(crate) fn add(&mut self, req: EngineRequest) -> Result<(), AddError> {
        let capacity = u64::from(self.pool.num_blocks()) * u64::from(self.block_size);
        self.requests.check(&req, self.block_size, capacity)?;
        let total = u64::from(req.prompt.len()) + u64::from(req.max_output_tokens);
        // Without chunked prefill a request must fit one pass whole, also
        // when it is recomputed after preemption with its output so far.
        if !self.chunked_prefill && total > u64::from(self.max_num_batched_tokens) {
            return Err(AddError::TooLong { tokens: total, capacity: self.max_num_batched_tokens.into() });
        }
        let seq = Seq {
            id: req.id,
            prompt_len: req.prompt.len(),
            output_len: req.max_output_tokens,
            generated: 0,
            num_computed: 0,
            blocks: Vec::new(),
            hashes: req.prompt.into_blocks(),
            registered: 0,
            salt: mix64(req.id.0, 0x6f75_7470_7574),
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
        } else if let Some(pos) = self.waiting.iter().position(|&s| s == slot) {
            self.waiting.remove(pos);
        }
        self.release_slot(slot);
        true
    }

    pub(crate) fn num_running(&self) -> usize {
        self.running.len()
    }

    pub(crate) fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub(crate) fn kv_usage(&self) -> f64 {
        1.0 - f64::from(self.pool.free_len()) / f64::from(self.pool.num_blocks())
    }

    pub(crate) fn clear_cache(&mut self, events: &mut Vec<hangar_core::KvEvent>) {
        self.pool.clear_cache();
        self.kv.cleared(events);
    }

    fn seq(&self, slot: u32) -> &Seq {
        self.requests.get(slot)
    }

    pub(crate) fn step(&mut self, now: f64, out: &mut Pass) {
        self.kv.recycle(&mut out.kv_events);
        out.reset(now);
        let mut scheduled = std::mem::take(&mut self.scheduled);
        scheduled.clear();
        let mut budget = self.max_num_batched_tokens;
        let preempted_any = self.schedule_running(&mut budget, &mut scheduled, out);
        if !preempted_any {
            self.schedule_waiting(&mut budget, &mut scheduled, out);
        }
        self.execute(&scheduled, out);
        self.scheduled = scheduled;
    }

    /// Phase 1. Returns whether any request was preempted.
    fn schedule_running(
        &mut self,
        budget: &mut u32,
        scheduled: &mut Vec<(u32, u32)>,
        out: &mut Pass,
    ) -> bool {
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let slot = self.running[i];
            let s = self.seq(slot);
            let new = (s.num_tokens() - s.num_computed).min(*budget);
            let need = blocks_short(s.num_computed + new, s.blocks.len(), self.block_size);
            // Preempt from the back until the blocks fit or this request
            // itself was the one preempted.
            let mut fits = true;
            while need > self.pool.free_len() {
                let victim = self.running.pop().expect("running is not empty");
                self.preempt(victim, out);
                preempted = true;
                if victim == slot {
                    fits = false;
                    break;
                }
            }
            if !fits {
                break;
            }
            self.grow(slot, need, out);
            scheduled.push((slot, new));
            *budget -= new;
            i += 1;
        }
        preempted
    }

    /// Phase 2: admit waiting requests in order.
    fn schedule_waiting(&mut self, budget: &mut u32, scheduled: &mut Vec<(u32, u32)>, out: &mut Pass) {
        while let Some(&slot) = self.waiting.front() {
            if self.running.len() >= self.max_num_seqs || *budget == 0 {
                break;
            }
            let hits_free = self.cached_prefix(slot);
            let hits = self.hits.len() as u32;
            let s = self.seq(slot);
            let computed = hits * self.block_size;
            let remaining = s.num_tokens() - computed;
            let new = if self.chunked_prefill {
                remaining.min(*budget)
            } else if remaining <= *budget {
                remaining
            } else {
                break;
            };
            let need = blocks_for(computed + new, self.block_size) - hits;
            if need > self.pool.free_len() - hits_free {
                break;
            }
            let (first, id) = (!s.admitted_before, s.id);
            self.waiting.pop_front();
            let s = self.requests.get_mut(slot);
            // Room for every block the request can ever hold, so neither
            // admission nor decoding grows the list block by block.
            let lifetime =
                (u64::from(s.prompt_len) + u64::from(s.output_len)).div_ceil(self.block_size.into());
            s.blocks.reserve(lifetime as usize);
            for &b in &self.hits {
                self.pool.touch(b);
                s.blocks.push(b);
            }
            s.num_computed = computed;
            s.registered = hits;
            s.admitted_before = true;
            self.grow(slot, need, out);
            self.running.push(slot);
            scheduled.push((slot, new));
            *budget -= new;
            out.admitted.push(Admission { request: id, reused_tokens: computed, first });
        }
    }

    /// Finds the cached leading blocks of the waiting request at `slot` into
    /// `self.hits` and returns how many of them sit in the free queue (a hit
    /// on them takes them out of it). At least one token is left to compute.
    fn cached_prefix(&mut self, slot: u32) -> u32 {
        self.hits.clear();
        if !self.prefix_caching {
            return 0;
        }
        let s = self.requests.get(slot);
        let max_hits = ((s.num_tokens() - 1) / self.block_size) as usize;
        // All of the prompt: the blocks past the hits are registered as
        // soon as they are computed, mostly within this pass.
        self.pool.prefetch(&s.hashes);
        let mut free = 0;
        for &h in s.hashes.iter().take(max_hits) {
            match self.pool.lookup(h) {
                Some(b) => {
                    self.hits.push(b);
                    free += u32::from(self.pool.is_free(b));
                }
                None => break,
            }
        }
        free
    }

    fn grow(&mut self, slot: u32, n: u32, out: &mut Pass) {
        if n == 0 {
            return;
        }
        let s = self.requests.get_mut(slot);
        self.pool.allocate(n, &mut s.blocks, &mut self.kv, &mut out.kv_events);
    }

    fn preempt(&mut self, slot: u32, out: &mut Pass) {
        let s = self.requests.get_mut(slot);
        for &b in s.blocks.iter().rev() {
            self.pool.release(b);
        }
        s.blocks.clear();
        s.num_computed = 0;
        s.registered = 0;
        out.preempted.push(s.id);
        self.waiting.push_front(slot);
    }

    /// Runs the scheduled work: advances computed tokens, caches newly full
    /// blocks, samples tokens, completes requests and times the pass.
    fn execute(&mut self, scheduled: &[(u32, u32)], out: &mut Pass) {
        let (mut prefill, mut decode) = (PrefillShape::default(), DecodeShape::default());
        let mut completed_slots = std::mem::take(&mut self.completed);
        completed_slots.clear();
        let mut emitted = std::mem::take(&mut self.emitted);
        emitted.clear();
        for &(slot, new) in scheduled {
            let s = self.requests.get_mut(slot);
            let steady_decode = new == 1 && s.generated > 0 && s.num_computed + 1 == s.num_tokens();
            if steady_decode {
                decode.batch += 1;
                decode.context_tokens += u64::from(s.num_tokens());
            } else if new > 0 {
                prefill.batch += 1;
                prefill.new_tokens += new;
            }
            s.num_computed += new;
            if self.prefix_caching {
                register_full_blocks(s, self.block_size, &mut self.pool, &mut self.kv, &mut out.kv_events);
            }
            if s.num_computed == s.num_tokens() {
                if s.generated < s.output_len {
                    out.tokens.push(TokenEmission {
                        request: s.id,
                        index: s.generated,
                        previous_ms: s.last_token_ms,
                    });
                    s.generated += 1;
                    emitted.push(slot);
                }
                if s.generated == s.output_len {
                    completed_slots.push(slot);
                }
            }
        }
        out.scheduled_seqs = scheduled.len() as u32;
        out.prefill_tokens = prefill.new_tokens;
        out.decode_seqs = decode.batch;
        let mut ms = 0.0;
        if prefill.new_tokens > 0 {
            ms += self.timing.prefill_ms(prefill);
        }
        if decode.batch > 0 {
            decode.capacity_tokens = self.capacity_tokens;
            ms += self.timing.decode_ms(decode);
        }
        out.end_ms = out.start_ms + ms / self.speedup_ratio;
        for &slot in &emitted {
            self.requests.get_mut(slot).last_token_ms = Some(out.end_ms);
        }
        self.emitted = emitted;
        if !completed_slots.is_empty() {
            self.running.retain(|s| !completed_slots.contains(s));
            for &slot in &completed_slots {
                let id = self.seq(slot).id;
                self.requests.forget(id);
                self.release_slot(slot);
                out.completed.push(id);
            }
        }
        self.completed = completed_slots;
    }

    fn release_slot(&mut self, slot: u32) {
        let s = self.requests.free(slot);
        for &b in s.blocks.iter().rev() {
            self.pool.release(b);
        }
    }

    #[cfg(test)]
    fn check_invariants(&self) {
        self.pool.check_invariants();
        assert!(self.running.len() <= self.max_num_seqs);
        let held: usize = self.requests.iter().map(|s| s.blocks.len()).sum();
        assert!(held as u32 >= self.pool.num_blocks() - self.pool.free_len());
        for &slot in &self.running {
            let s = self.seq(slot);
            assert!(s.blocks.len() as u32 >= blocks_for(s.num_computed, self.block_size));
            assert!(s.generated <= s.output_len);
        }
        for &slot in &self.waiting {
            assert!(self.seq(slot).blocks.is_empty(), "a waiting request holds no blocks");
        }
    }
}

fn blocks_for(tokens: u32, block_size: u32) -> u32 {
    tokens.div_ceil(block_size)
}

/// `blocks_for(tokens) - held` for `held` blocks that cover at most
/// `tokens`, without a division when they cover all of them: the common
/// case of a decode step inside its last block, taken once per running
/// request per pass.
fn blocks_short(tokens: u32, held: usize, block_size: u32) -> u32 {
    let covered = held as u64 * u64::from(block_size);
    match u64::from(tokens).checked_sub(covered) {
        None | Some(0) => 0,
        Some(missing) => missing.div_ceil(u64::from(block_size)) as u32,
    }
}

/// Names every newly full block of `s` in the cache and logs it. Blocks past
/// the prompt get hashes from the request's own salt: generated tokens are
/// never shared with another request.
fn register_full_blocks(
    s: &mut Seq,
    block_size: u32,
    pool: &mut BlockPool,
    kv: &mut KvLog,
    events: &mut Vec<hangar_core::KvEvent>,
) {
    // Checks by multiplying: this runs for every scheduled request of every
    // pass, and a block fills only once per `block_size` tokens.
    let block_size = u64::from(block_size);
    if u64::from(s.registered + 1) * block_size > u64::from(s.num_computed) {
        return;
    }
    let full = (u64::from(s.num_computed) / block_size) as usize;
    let known = full.min(s.hashes.len());
    if known > s.registered as usize + 1 {
        // A prefill chunk: take the index's cache misses together.
        pool.prefetch(&s.hashes[s.registered as usize..known]);
    }
    while (s.registered as usize) < full {
        let k = s.registered as usize;
        if k == s.hashes.len() {
            if k == s.hashes.capacity() {
                // The first generated block: make room for all of them.
                let lifetime = (u64::from(s.prompt_len) + u64::from(s.output_len)) / block_size;
                s.hashes.reserve_exact((lifetime as usize).saturating_sub(k));
            }
            let parent = if k == 0 { hangar_core::ROOT_BLOCK_HASH } else { s.hashes[k - 1] };
            s.hashes.push(parent.chain(mix64(s.salt, k as u64)));
        }
        let h = s.hashes[k];
        if pool.register(s.blocks[k], h) {
            kv.stored(events, k.checked_sub(1).map(|p| s.hashes[p]), h);
        }
        s.registered += 1;
    }
}

#[cfg(test)]
mod tests;
