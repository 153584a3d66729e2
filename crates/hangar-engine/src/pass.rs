//! What one scheduler pass reports back to its driver.

use hangar_core::{BlockHash, KvEvent, RequestId};

/// One output token, stamped at the pass's end.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenEmission {
    /// The request the token belongs to.
    pub request: RequestId,
    /// The token's 0-based position in the request's output.
    pub index: u32,
    /// When the request's previous token came (the end of the pass that
    /// emitted it); `None` for its first. The gap to this pass's end is the
    /// inter-token latency, which a driver can then count without looking
    /// the request up (on a large simulated fleet, a cache miss per token).
    pub previous_ms: Option<f64>,
}

/// A request scheduled for the first time (or again after preemption).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// The admitted request.
    pub request: RequestId,
    /// Prompt tokens served from the prefix cache instead of computed.
    pub reused_tokens: u32,
    /// Whether this is the request's first admission (not a re-admission
    /// after preemption or retraction).
    pub first: bool,
}

/// The result of [`crate::EngineCore::step`]. The driver owns one and passes
/// it to every step so its buffers are reused; `step` clears it first.
#[derive(Debug, Clone, Default)]
pub struct Pass {
    /// When the pass started (the `now` it was stepped at).
    pub start_ms: f64,
    /// When the pass ends: tokens and completions below happen then, and the
    /// engine can be stepped again from then on.
    pub end_ms: f64,
    /// Requests admitted by this pass, in order.
    pub admitted: Vec<Admission>,
    /// One token for each request that produced one in this pass.
    pub tokens: Vec<TokenEmission>,
    /// Requests that finished in this pass, in order.
    pub completed: Vec<RequestId>,
    /// Requests pushed back to the waiting queue to free memory.
    pub preempted: Vec<RequestId>,
    /// KV cache changes, in the order they happened (only when KV event
    /// capture is on).
    pub kv_events: Vec<KvEvent>,
    /// Prompt tokens computed in this pass.
    pub prefill_tokens: u32,
    /// Requests that decoded a token in this pass.
    pub decode_seqs: u32,
    /// Requests that did any work in this pass.
    pub scheduled_seqs: u32,
}

impl Pass {
    /// Resets every field for a new pass starting at `now`.
    pub(crate) fn reset(&mut self, now: f64) {
        self.start_ms = now;
        self.end_ms = now;
        self.admitted.clear();
        self.tokens.clear();
        self.completed.clear();
        self.preempted.clear();
        self.kv_events.clear();
        self.prefill_tokens = 0;
        self.decode_seqs = 0;
        self.scheduled_seqs = 0;
    }

    /// Whether the pass did nothing at all (the engine had no runnable work).
    pub fn is_idle(&self) -> bool {
        self.scheduled_seqs == 0 && self.completed.is_empty() && self.preempted.is_empty()
    }
}

/// Appends KV events, merging consecutive removals and consecutive stores of
/// one chain so that a pass emits few events.
///
/// The block lists of a pass's events are handed back with
/// [`recycle`](Self::recycle) before the next pass and reused, so a steady
/// run allocates none: a replay emits an event list in most passes.
#[derive(Debug, Default)]
pub(crate) struct KvLog {
    pub enabled: bool,
    spare: Vec<Vec<BlockHash>>,
}

impl KvLog {
    /// A log that records.
    pub fn on() -> Self {
        Self { enabled: true, spare: Vec::new() }
    }

    /// Empties `events`, keeping their block lists for reuse.
    pub fn recycle(&mut self, events: &mut Vec<KvEvent>) {
        for e in events.drain(..) {
            if let KvEvent::Stored { mut blocks, .. } | KvEvent::Removed { mut blocks } = e {
                blocks.clear();
                self.spare.push(blocks);
            }
        }
    }

    fn list(&mut self, first: BlockHash) -> Vec<BlockHash> {
        let mut blocks = self.spare.pop().unwrap_or_default();
        blocks.push(first);
        blocks
    }

    pub fn removed(&mut self, events: &mut Vec<KvEvent>, hash: BlockHash) {
        if !self.enabled {
            return;
        }
        match events.last_mut() {
            Some(KvEvent::Removed { blocks }) => blocks.push(hash),
            _ => {
                let blocks = self.list(hash);
                events.push(KvEvent::Removed { blocks });
            }
        }
    }

    pub fn stored(&mut self, events: &mut Vec<KvEvent>, parent: Option<BlockHash>, hash: BlockHash) {
        if !self.enabled {
            return;
        }
        if let Some(KvEvent::Stored { blocks, .. }) = events.last_mut() {
            if blocks.last().copied() == parent && parent.is_some() {
                blocks.push(hash);
                return;
            }
        }
        let blocks = self.list(hash);
        events.push(KvEvent::Stored { parent, blocks });
    }

    pub fn cleared(&self, events: &mut Vec<KvEvent>) {
        if self.enabled {
            events.push(KvEvent::Cleared);
        }
    }
}
