//! [`ReplicaChooser`]: the [`Router`]'s policies as an admission queue's
//! [`Chooser`], for `hangar serve` and the fleet simulation alike — one
//! implementation of each policy, with the router's tie-breaking.
//!
//! The `kv` policy runs in the approximate mode. Engines behind an
//! OpenAI-compatible API rarely publish their KV-cache events, and the
//! gateway does not run their tokenizer. Like llm-d's approximate
//! prefix-cache scorer, the gateway then cuts the prompt *text* into
//! fixed-size character blocks ([`text_blocks`]), chains their hashes, and
//! assumes a replica caches the blocks of the prompts it was sent — the
//! latest `cache_blocks` of them per replica, older ones forgotten first,
//! as an engine's LRU would — and feeds that model to the KV router's cost.
//! A driver that knows the prompt's real blocks (the simulator) hints those
//! instead.
//!
//! A replica that refused a request for want of capacity (an engine's own
//! queue full: 429, or 503 from vLLM and SGLang) is put last for
//! [`REFUSAL_COOL_DOWN_MS`] after each refusal ([`Chooser::refused`]):
//! every policy then chooses among the other free replicas, and among the
//! refusing ones only when every free replica refused. Without it the
//! refusing replica, which answers at once and so has the fewest requests
//! in flight, would be `least-outstanding`'s first choice for every
//! request, each paying a failover. The request that was refused is kept
//! off that replica for its next choice by [`Chooser::avoid`] as well.
//!
//! A replica whose engine fails request after request while its health
//! checks pass (a *black hole*: it answers 500 at once, so it has the
//! fewest requests in flight and would draw most of them) is put last the
//! same way: [`FAILING_STREAK`] server errors in a row ([`Chooser::answered`])
//! put it last for [`FAILING_COOL_DOWN_MS`], doubled by each streak after
//! up to [`FAILING_COOL_DOWN_MAX_MS`]; an answer that is not a server error
//! ends the streak and the doubling. Still only an order: when it is the
//! only free replica it is chosen.
//!
//! # Adapters
//! A request that runs with a LoRA adapter is told to the chooser before
//! it is submitted ([`ReplicaChooser::hint_adapter`]). When it is given a
//! replica, that replica's [`AdapterSlots`](crate::AdapterSlots) are asked
//! to hold the adapter, so the chooser knows what each replica holds from
//! the slots themselves — the loads and unloads they asked for and the
//! driver confirmed —, not from where it sent requests. The driver pulls
//! [`ReplicaChooser::poll_adapter`] after every call into the admission
//! (and into the chooser): the loads and unloads to carry out on each
//! replica (reported back with [`ReplicaChooser::adapter_step_done`]) and
//! which granted requests may now be sent or will not run
//! ([`AdapterAction::Answer`]: [`SlotEvent::Ready`](crate::SlotEvent::Ready)
//! or [`SlotEvent::Failed`](crate::SlotEvent::Failed)). A request with an adapter is
//! sent only on its `Ready`; it holds its permit while its adapter loads.

use std::collections::{BTreeMap, HashMap};

use hangar_core::{mix64, BlockHash, KvEvent, Millis, ReplicaId, RequestId, ROOT_BLOCK_HASH};
use hangar_queue::{Chooser, FreeReplica};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use hangar_core::Adapter;

use crate::{
    AdapterAction, AdapterAsk, AdapterConfig, AdapterSlots, KvRouterConfig, RouteRequest, Router,
    RouterPolicy, SlotsError, WorkerId,
};

/// Settings of the `kv` policy's approximate mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApproxKvConfig {
    /// Characters per block (about four per token).
    pub block_chars: u32,
    /// Blocks each replica is assumed to keep.
    pub cache_blocks: usize,
    /// The KV cost's weights.
    pub weights: KvRouterConfig,
}

impl Default for ApproxKvConfig {
    fn default() -> Self {
        Self { block_chars: 64, cache_blocks: 32_768, weights: KvRouterConfig::default() }
    }
}

/// Chained hashes of the full `block_chars`-byte blocks of `text` (a last,
/// partial block is not cached by engines either), and the text's length
/// in estimated tokens (four bytes each). Blocks are cut at byte offsets,
/// so equal prefixes give equal chains.
pub fn text_blocks(text: &str, block_chars: u32) -> (Vec<BlockHash>, u32) {
    let size = block_chars.max(1) as usize;
    let mut parent = ROOT_BLOCK_HASH;
    let blocks = text
        .as_bytes()
        .chunks_exact(size)
        .map(|block| {
            let content = block.chunks(8).fold(block.len() as u64, |h, word| {
                let mut w = [0u8; 8];
                w[..word.len()].copy_from_slice(word);
                mix64(h, u64::from_le_bytes(w))
            });
            parent = parent.chain(content);
            parent
        })
        .collect();
    let tokens = u32::try_from(text.len().div_ceil(4)).unwrap_or(u32::MAX);
    (blocks, tokens)
}

/// How long a replica that refused a request for want of capacity is
/// chosen last: 2 s. Long enough for the replica's own line to drain a
/// little and for the requests meanwhile to go elsewhere without a
/// failover each; short enough that a replica with room again is back in
/// the rotation before a quiet period could matter.
pub const REFUSAL_COOL_DOWN_MS: Millis = 2_000;

/// Server errors in a row after which a replica is chosen last: more than
/// a few requests that each fail on their own (a prompt an engine cannot
/// take) are likely to be.
pub const FAILING_STREAK: u32 = 5;
/// How long a replica is first chosen last after a streak of server
/// errors: 10 s, then twice as long after each streak while no answer
/// succeeds between.
pub const FAILING_COOL_DOWN_MS: Millis = 10_000;
/// The longest a failing replica is chosen last at a time: 5 minutes (an
/// engine that fails for that long is for an operator to look at).
pub const FAILING_COOL_DOWN_MAX_MS: Millis = 300_000;

/// A replica's streak of server errors.
#[derive(Debug, Clone, Copy)]
struct Failing {
    /// Server errors in a row since the streak (or the last cool-down)
    /// began.
    errors: u32,
    /// The cool-down the next full streak earns.
    cool_down: Millis,
}

/// One replica's assumed cache: blocks by last use, oldest first out.
#[derive(Debug, Default)]
struct Lru {
    last_use: FxHashMap<BlockHash, u64>,
    by_age: BTreeMap<u64, BlockHash>,
}

/// A routing policy as a [`Chooser`]. See the module docs.
#[derive(Debug)]
pub struct ReplicaChooser {
    router: Router,
    /// The `kv` policy: prompts are hinted and caches modelled.
    kv: bool,
    cache_blocks: usize,
    workers: HashMap<ReplicaId, WorkerId>,
    replicas: FxHashMap<WorkerId, ReplicaId>,
    /// Worker ids of gone replicas, for reuse.
    spare: Vec<WorkerId>,
    caches: FxHashMap<WorkerId, Lru>,
    prompts: FxHashMap<RequestId, (Vec<BlockHash>, u32)>,
    /// Requests' adapters (with their size and load time) until routed.
    adapters: FxHashMap<RequestId, (hangar_core::AdapterRef, u64, f64)>,
    /// Requests a replica refused for want of capacity, and that replica.
    avoid: FxHashMap<RequestId, ReplicaId>,
    /// Replicas that refused a request for want of capacity, or failed
    /// [`FAILING_STREAK`] in a row, and until when they are chosen last.
    refusing: FxHashMap<ReplicaId, Millis>,
    /// Replicas whose last answers were server errors.
    failing: FxHashMap<ReplicaId, Failing>,
    tick: u64,
    scratch: Vec<WorkerId>,
}

impl ReplicaChooser {
    /// Chooses `replica` last until `until`, or longer if it already is.
    fn put_last(&mut self, replica: ReplicaId, until: Millis) {
        let last = self.refusing.entry(replica).or_insert(until);
        *last = (*last).max(until);
    }

    /// A chooser running `policy`; `config` sets the `kv` policy's blocks
    /// (the router's costs count in blocks of `block_chars / 4` estimated
    /// tokens) and weights; `seed` fixes tie-breaking.
    pub fn new(policy: RouterPolicy, config: &ApproxKvConfig, seed: u64) -> Self {
        let block_tokens = config.block_chars.div_ceil(4).max(1);
        Self {
            router: Router::new(policy, block_tokens, seed).with_kv(config.weights.clone()),
            kv: policy == RouterPolicy::Kv,
            cache_blocks: config.cache_blocks.max(1),
            workers: HashMap::new(),
            replicas: FxHashMap::default(),
            spare: Vec::new(),
            caches: FxHashMap::default(),
            prompts: FxHashMap::default(),
            adapters: FxHashMap::default(),
            avoid: FxHashMap::default(),
            refusing: FxHashMap::default(),
            failing: FxHashMap::default(),
            tick: 0,
            scratch: Vec::new(),
        }
    }

    /// Sets each replica's adapter slots and the `adapter` policy's price
    /// of a load (default [`AdapterConfig::default`]).
    pub fn with_adapters(self, adapters: AdapterConfig) -> Self {
        Self { router: self.router.with_adapters(adapters), ..self }
    }

    /// Request `request`, about to be submitted, runs with `adapter` (an
    /// unknown size taken as the configured `default_size`), which takes
    /// about `load_ms` to load where it is not held. It lasts until the
    /// request is [done](Chooser::done). Refused, and not kept, when the
    /// adapter is larger than a replica's adapter memory — refuse the
    /// request (it could never run) rather than submit it.
    pub fn hint_adapter(
        &mut self,
        request: RequestId,
        adapter: &Adapter,
        load_ms: f64,
    ) -> Result<(), SlotsError> {
        let config = self.router.adapter_config();
        let bytes = adapter.size_or(config.default_size).bytes();
        config.check_fits(&adapter.id, bytes)?;
        self.adapters.insert(request, (adapter.id.clone(), bytes, load_ms.max(0.0)));
        Ok(())
    }

    /// The next adapter step to carry out on a replica, or granted request
    /// that may now be sent (or will not run). See the module docs.
    pub fn poll_adapter(&mut self) -> Option<AdapterAction<ReplicaId>> {
        let action = self.router.poll_adapter()?;
        Some(match action {
            AdapterAction::Step { on, step } => AdapterAction::Step { on: self.replicas[&on], step },
            AdapterAction::Answer(event) => AdapterAction::Answer(event),
        })
    }

    /// The adapter step in flight on `replica` ended, `ok` if its engine
    /// did it. Nothing happens for a replica that is gone.
    pub fn adapter_step_done(&mut self, replica: ReplicaId, ok: bool) {
        if let Some(&w) = self.workers.get(&replica) {
            self.router.adapter_step_done(w, ok);
        }
    }

    /// The adapter slots of `replica`, once it was a candidate.
    pub fn adapter_slots(&self, replica: ReplicaId) -> Option<&AdapterSlots> {
        self.workers.get(&replica).and_then(|&w| self.router.adapter_slots(w))
    }

    /// Blocks replica `replica` is assumed to hold.
    pub fn cached_blocks(&self, replica: ReplicaId) -> usize {
        self.workers.get(&replica).and_then(|w| self.caches.get(w)).map_or(0, |c| c.last_use.len())
    }

    fn worker(&mut self, replica: ReplicaId) -> WorkerId {
        if let Some(&w) = self.workers.get(&replica) {
            return w;
        }
        let w = self.spare.pop().unwrap_or(WorkerId(self.workers.len() as u32));
        self.workers.insert(replica, w);
        self.replicas.insert(w, replica);
        self.router.add_worker(w);
        w
    }

    /// Records that `w` now holds `blocks`, evicting its oldest beyond the
    /// budget, and tells the router both.
    fn cache(&mut self, w: WorkerId, blocks: &[BlockHash]) {
        let lru = self.caches.entry(w).or_default();
        let mut stored = Vec::new();
        for &b in blocks {
            self.tick += 1;
            match lru.last_use.insert(b, self.tick) {
                Some(old) => {
                    lru.by_age.remove(&old);
                }
                None => stored.push(b),
            }
            lru.by_age.insert(self.tick, b);
        }
        let mut removed = Vec::new();
        while lru.last_use.len() > self.cache_blocks {
            let (_, b) = lru.by_age.pop_first().expect("sizes agree");
            lru.last_use.remove(&b);
            removed.push(b);
        }
        let mut events = Vec::with_capacity(2);
        if !stored.is_empty() {
            events.push(KvEvent::Stored { parent: None, blocks: stored });
        }
        if !removed.is_empty() {
            events.push(KvEvent::Removed { blocks: removed });
        }
        self.router.apply_kv_events(w, &events);
    }
}

impl Chooser for ReplicaChooser {
    fn choose(&mut self, now: Millis, request: RequestId, free: &[FreeReplica]) -> ReplicaId {
        let mut candidates = std::mem::take(&mut self.scratch);
        candidates.clear();
        let avoid = self.avoid.remove(&request).filter(|_| free.len() > 1);
        if !self.refusing.is_empty() {
            self.refusing.retain(|_, until| *until > now);
        }
        let eligible = |r: &&FreeReplica| Some(r.id) != avoid;
        // Refusing replicas are candidates only when every eligible one is.
        let any_willing = free.iter().filter(eligible).any(|r| !self.refusing.contains_key(&r.id));
        for r in free.iter().filter(eligible) {
            if !any_willing || !self.refusing.contains_key(&r.id) {
                let w = self.worker(r.id);
                candidates.push(w);
            }
        }
        let (blocks, tokens) = self.prompts.remove(&request).unwrap_or_default();
        let adapter = self.adapters.remove(&request);
        let adapter = adapter.as_ref().map(|(adapter, bytes, load_ms)| AdapterAsk {
            adapter,
            bytes: *bytes,
            load_ms: *load_ms,
        });
        let req = RouteRequest { id: request, blocks: &blocks, prompt_tokens: tokens, adapter };
        let chosen = self.router.route_among(&req, &candidates);
        self.scratch = candidates;
        match chosen {
            Ok(w) => {
                if self.kv {
                    self.cache(w, &blocks);
                }
                self.replicas[&w]
            }
            Err(_) => free[0].id,
        }
    }

    fn hint(&mut self, request: RequestId, blocks: &[BlockHash], tokens: u32) {
        if self.kv {
            self.prompts.insert(request, (blocks.to_vec(), tokens));
        }
    }

    fn avoid(&mut self, request: RequestId, replica: ReplicaId) {
        self.avoid.insert(request, replica);
    }

    fn refused(&mut self, now: Millis, replica: ReplicaId) {
        self.put_last(replica, now.saturating_add(REFUSAL_COOL_DOWN_MS));
    }

    fn answered(&mut self, now: Millis, replica: ReplicaId, failed: bool) -> Option<Millis> {
        if !failed {
            if !self.failing.is_empty() {
                self.failing.remove(&replica);
            }
            return None;
        }
        let f = self.failing.entry(replica).or_insert(Failing { errors: 0, cool_down: FAILING_COOL_DOWN_MS });
        f.errors += 1;
        if f.errors < FAILING_STREAK {
            return None;
        }
        let cool_down = f.cool_down;
        *f = Failing { errors: 0, cool_down: (cool_down * 2).min(FAILING_COOL_DOWN_MAX_MS) };
        self.put_last(replica, now.saturating_add(cool_down));
        Some(cool_down)
    }

    fn done(&mut self, request: RequestId) {
        self.prompts.remove(&request);
        self.adapters.remove(&request);
        self.avoid.remove(&request);
        self.router.finished(request);
    }

    fn replica_gone(&mut self, replica: ReplicaId) {
        self.refusing.remove(&replica);
        self.failing.remove(&replica);
        if let Some(w) = self.workers.remove(&replica) {
            self.replicas.remove(&w);
            self.caches.remove(&w);
            self.router.remove_worker(w);
            self.spare.push(w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SlotEvent, SlotStep};
    use proptest::prelude::*;

    fn free(ids: &[u128]) -> Vec<FreeReplica> {
        ids.iter().map(|&i| FreeReplica { id: ReplicaId::from_u128(i), in_use: 0, limit: 4 }).collect()
    }

    fn ask(c: &mut ReplicaChooser, id: u64, text: &str, ids: &[u128]) -> ReplicaId {
        let (blocks, tokens) = text_blocks(text, 8);
        c.hint(RequestId(id), &blocks, tokens);
        c.choose(0, RequestId(id), &free(ids))
    }

    #[test]
    fn equal_prefixes_give_equal_chains_and_partial_blocks_do_not_count() {
        let (a, ta) = text_blocks("system: be brief. hello there", 8);
        let (b, _) = text_blocks("system: be brief. goodbye now!", 8);
        assert_eq!(a.len(), 3);
        assert_eq!(ta, 8);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
    }

    #[test]
    fn a_repeated_prompt_returns_to_its_replica_while_others_spread() {
        let mut c = ReplicaChooser::new(
            RouterPolicy::Kv,
            &ApproxKvConfig { block_chars: 8, ..Default::default() },
            1,
        );
        let long = "the same long system prompt shared by a whole conversation, turn after turn";
        let first = ask(&mut c, 1, long, &[1, 2]);
        c.done(RequestId(1));
        for id in 2..6 {
            assert_eq!(ask(&mut c, id, long, &[1, 2]), first, "cache overlap wins");
            c.done(RequestId(id));
        }
        // Only free replicas are candidates.
        let other = if first == ReplicaId::from_u128(1) { 2 } else { 1 };
        assert_eq!(ask(&mut c, 9, long, &[other]), ReplicaId::from_u128(other));
        c.replica_gone(first);
        assert_eq!(c.cached_blocks(first), 0);
    }

    #[test]
    fn round_robin_and_least_outstanding_choose_as_the_router_does() {
        let cfg = ApproxKvConfig::default();
        let mut rr = ReplicaChooser::new(RouterPolicy::RoundRobin, &cfg, 0);
        let picks: Vec<_> = (0..4).map(|i| rr.choose(0, RequestId(i), &free(&[1, 2, 3]))).collect();
        let ids: Vec<_> = [1, 2, 3, 1].map(ReplicaId::from_u128).to_vec();
        assert_eq!(picks, ids);
        // Only free replicas are candidates: 2 is full, so 3 then 1.
        assert_eq!(rr.choose(0, RequestId(9), &free(&[1, 3])), ReplicaId::from_u128(3));

        let mut lo = ReplicaChooser::new(RouterPolicy::LeastOutstanding, &cfg, 0);
        let first = lo.choose(0, RequestId(1), &free(&[1, 2]));
        let second = lo.choose(0, RequestId(2), &free(&[1, 2]));
        assert_ne!(first, second, "the busier replica is avoided");
        lo.done(RequestId(1));
        assert_eq!(lo.choose(0, RequestId(3), &free(&[1, 2])), first, "the one whose request finished");
    }

    #[test]
    fn a_refusing_replica_is_chosen_last_until_its_cool_down_ends() {
        let cfg = ApproxKvConfig::default();
        let (one, two) = (ReplicaId::from_u128(1), ReplicaId::from_u128(2));
        let mut lo = ReplicaChooser::new(RouterPolicy::LeastOutstanding, &cfg, 0);
        // 1 refuses at t = 100; it answers at once, so without the cool-down
        // least-outstanding would choose it for each request after.
        lo.refused(100, one);
        for (i, t) in [100, 500, 2_099].into_iter().enumerate() {
            assert_eq!(lo.choose(t, RequestId(i as u64), &free(&[1, 2])), two, "at {t}");
            lo.done(RequestId(i as u64));
        }
        // Full elsewhere: the refusing one rather than no one.
        assert_eq!(lo.choose(600, RequestId(7), &free(&[1])), one);
        lo.done(RequestId(7));
        // The cool-down over, it is a choice like any other again.
        assert_eq!(lo.choose(2_100, RequestId(8), &free(&[1, 2])), one);
        lo.done(RequestId(8));
        // Each refusal starts it again; a gone replica is forgotten.
        lo.refused(3_000, two);
        lo.refused(4_000, two);
        assert_eq!(lo.choose(5_500, RequestId(9), &free(&[1, 2])), one);
        lo.replica_gone(two);
        assert!(lo.refusing.is_empty());
    }

    /// A replica that fails request after request (a black hole, fastest
    /// of all) is chosen last once it failed a streak, for a cool-down that
    /// doubles with each streak; an answer that is no server error ends the
    /// streak and the doubling; a capacity refusal does not shorten it.
    #[test]
    fn a_failing_replica_is_chosen_last_after_a_streak_for_a_doubling_while() {
        let cfg = ApproxKvConfig::default();
        let (one, two) = (ReplicaId::from_u128(1), ReplicaId::from_u128(2));
        let mut lo = ReplicaChooser::new(RouterPolicy::LeastOutstanding, &cfg, 0);
        let mut request = 0;
        let mut choose = |lo: &mut ReplicaChooser, t: Millis, ids: &[u128]| {
            request += 1;
            let chosen = lo.choose(t, RequestId(request), &free(ids));
            lo.done(RequestId(request));
            chosen
        };
        // Errors broken by a success make no streak.
        for _ in 0..FAILING_STREAK - 1 {
            assert_eq!(lo.answered(100, one, true), None);
        }
        assert_eq!(lo.answered(100, one, false), None);
        assert!(lo.refusing.is_empty(), "no streak: not put last");
        // A streak: last for 10 s.
        for _ in 0..FAILING_STREAK - 1 {
            assert_eq!(lo.answered(1_000, one, true), None);
        }
        assert_eq!(lo.answered(1_000, one, true), Some(FAILING_COOL_DOWN_MS));
        for t in 1_001..1_021 {
            assert_eq!(choose(&mut lo, t, &[1, 2]), two, "at {t}");
        }
        assert_eq!(choose(&mut lo, 1_100, &[1]), one, "the only free one is still chosen");
        // A capacity refusal meanwhile does not cut it short.
        lo.refused(2_000, one);
        assert_eq!(choose(&mut lo, 10_999, &[1, 2]), two);
        assert!((11_000..11_020).any(|t| choose(&mut lo, t, &[1, 2]) == one), "the cool-down is over");
        // The next streak: twice as long; up to the most.
        for _ in 0..FAILING_STREAK - 1 {
            lo.answered(12_000, one, true);
        }
        assert_eq!(lo.answered(12_000, one, true), Some(2 * FAILING_COOL_DOWN_MS));
        assert_eq!(choose(&mut lo, 31_999, &[1, 2]), two);
        let mut last = 0;
        for _ in 0..10 {
            for _ in 0..FAILING_STREAK {
                last = lo.answered(40_000, one, true).unwrap_or(last);
            }
        }
        assert_eq!(last, FAILING_COOL_DOWN_MAX_MS);
        // A success ends the doubling: the next streak starts at 10 s again.
        lo.answered(400_000, one, false);
        for _ in 0..FAILING_STREAK - 1 {
            lo.answered(400_000, one, true);
        }
        assert_eq!(lo.answered(400_000, one, true), Some(FAILING_COOL_DOWN_MS));
        lo.replica_gone(one);
        assert!(lo.failing.is_empty() && lo.refusing.is_empty());
    }

    #[test]
    fn policies_are_spelled_in_kebab_case_with_snake_case_aliases() {
        #[derive(serde::Deserialize)]
        struct Config {
            router: RouterPolicy,
        }
        let parse = |s: &str| toml::from_str::<Config>(&format!("router = \"{s}\"")).map(|c| c.router);
        for policy in RouterPolicy::ALL {
            assert_eq!(parse(policy.name()).unwrap(), policy);
            assert_eq!(policy.name().parse::<RouterPolicy>().unwrap(), policy);
        }
        assert_eq!(parse("round_robin").unwrap(), RouterPolicy::RoundRobin);
        assert_eq!(parse("least_outstanding").unwrap(), RouterPolicy::LeastOutstanding);
        assert!(parse("random").unwrap_err().to_string().contains("least-outstanding"));
        assert!("random".parse::<RouterPolicy>().unwrap_err().contains("`random`"));
    }

    #[test]
    fn the_chooser_learns_what_replicas_hold_from_their_slots() {
        use hangar_core::{Adapter, ByteSize};
        let cfg = AdapterConfig { slots: 2, memory: ByteSize::new(1_000), ..AdapterConfig::default() };
        let mut c =
            ReplicaChooser::new(RouterPolicy::Adapter, &ApproxKvConfig::default(), 5).with_adapters(cfg);
        let a = Adapter::sized("base:lora-a".parse().unwrap(), ByteSize::new(100));
        let ask = |c: &mut ReplicaChooser, id: u64, ids: &[u128]| {
            c.hint_adapter(RequestId(id), &a, 500.0).unwrap();
            c.choose(0, RequestId(id), &free(ids))
        };
        // The first request for `a` goes anywhere, and asks for a load there.
        let r1 = ask(&mut c, 1, &[1, 2]);
        let Some(AdapterAction::Step { on, step: SlotStep::Load { .. } }) = c.poll_adapter() else {
            panic!()
        };
        assert_eq!(on, r1);
        // The load fails: r1 does not hold `a`, and the request is told.
        c.adapter_step_done(r1, false);
        assert_eq!(
            c.poll_adapter(),
            Some(AdapterAction::Answer(SlotEvent::Failed { request: RequestId(1), adapter: a.id.clone() }))
        );
        c.done(RequestId(1));
        assert_eq!(c.adapter_slots(r1).unwrap().holding(&a.id), crate::Holding::Absent);
        // Again, and this time the load succeeds.
        let r2 = ask(&mut c, 2, &[1, 2]);
        let Some(AdapterAction::Step { on, .. }) = c.poll_adapter() else { panic!() };
        c.adapter_step_done(on, true);
        assert_eq!(c.poll_adapter(), Some(AdapterAction::Answer(SlotEvent::Ready(RequestId(2)))));
        c.done(RequestId(2));
        // Now every request for `a` goes to the replica that holds it, and
        // runs at once.
        for id in 3..8 {
            assert_eq!(ask(&mut c, id, &[1, 2]), r2, "request {id}");
            assert_eq!(c.poll_adapter(), Some(AdapterAction::Answer(SlotEvent::Ready(RequestId(id)))));
            c.done(RequestId(id));
        }
        // Only free replicas are candidates, adapters or not.
        let other = if r2 == ReplicaId::from_u128(1) { 2 } else { 1 };
        assert_eq!(ask(&mut c, 9, &[other]), ReplicaId::from_u128(other));
        // A gone replica's slots go with it.
        c.replica_gone(r2);
        assert!(c.adapter_slots(r2).is_none());
        // An adapter larger than a replica's memory is refused at the hint.
        let huge = Adapter::sized("base:huge".parse().unwrap(), ByteSize::new(2_000));
        assert!(c.hint_adapter(RequestId(10), &huge, 1.0).is_err());
    }

    proptest! {
        /// A replica that refused a request for want of capacity is not
        /// chosen for it again while another is free, whatever the policy;
        /// when it is the only free one it is (nobody waits on a free
        /// permit); and the hint lasts for that one choice.
        #[test]
        fn an_avoided_replica_is_chosen_only_when_no_other_is_free(
            policy in prop_oneof![Just(RouterPolicy::RoundRobin), Just(RouterPolicy::LeastOutstanding), Just(RouterPolicy::Kv), Just(RouterPolicy::Adapter)],
            asks in proptest::collection::vec((proptest::collection::vec(0u128..5, 1..5), 0u128..5), 1..100),
        ) {
            let mut c = ReplicaChooser::new(policy, &ApproxKvConfig::default(), 3);
            for (i, (mut ids, avoided)) in asks.into_iter().enumerate() {
                ids.sort_unstable();
                ids.dedup();
                let avoided = ReplicaId::from_u128(ids[avoided as usize % ids.len()]);
                c.avoid(RequestId(i as u64), avoided);
                let got = c.choose(0, RequestId(i as u64), &free(&ids));
                prop_assert!(ids.iter().any(|&r| ReplicaId::from_u128(r) == got));
                prop_assert_eq!(got == avoided, ids.len() == 1, "chose {} among {:?}", got, ids);
                c.done(RequestId(i as u64));
            }
            prop_assert!(c.avoid.is_empty());
        }

        /// On noisy time and traffic, whatever the policy: a replica that
        /// refused within the cool-down is chosen only when every other
        /// free replica (the ready ones not full) refused too; the request
        /// a replica refused does not go back to it while another is free;
        /// the choice is always a free replica.
        #[test]
        fn a_refusing_replica_is_chosen_only_when_every_other_free_one_refuses(
            policy in prop_oneof![Just(RouterPolicy::RoundRobin), Just(RouterPolicy::LeastOutstanding), Just(RouterPolicy::Kv), Just(RouterPolicy::Adapter)],
            seed in any::<u64>(),
            steps in proptest::collection::vec(
                (0u64..1_500, 0u8..10, proptest::collection::vec(0u128..6, 1..6), 0u128..6),
                1..300,
            ),
        ) {
            let mut c = ReplicaChooser::new(policy, &ApproxKvConfig { block_chars: 4, ..Default::default() }, seed);
            // The model: until when each replica is refusing.
            let mut until: BTreeMap<ReplicaId, Millis> = BTreeMap::new();
            let mut now: Millis = 0;
            let mut open: Vec<RequestId> = Vec::new();
            for (i, (gap, op, mut ids, pick)) in steps.into_iter().enumerate() {
                now += gap;
                ids.sort_unstable();
                ids.dedup();
                let request = RequestId(i as u64);
                let refusing = |r: ReplicaId, until: &BTreeMap<ReplicaId, Millis>| until.get(&r).is_some_and(|&u| u > now);
                match op {
                    // A refusal seen on its own (the last attempt's, relayed).
                    0 | 1 => {
                        let r = ReplicaId::from_u128(pick);
                        c.refused(now, r);
                        until.insert(r, now + REFUSAL_COOL_DOWN_MS);
                    }
                    2 => {
                        let r = ReplicaId::from_u128(pick);
                        c.replica_gone(r);
                        until.remove(&r);
                    }
                    3 => {
                        if let Some(done) = open.pop() {
                            c.done(done);
                        }
                    }
                    _ => {
                        // A failover: the refusal, then the request again
                        // with the refusing replica to avoid.
                        let avoided = (op >= 8).then(|| ReplicaId::from_u128(ids[pick as usize % ids.len()]));
                        if let Some(r) = avoided {
                            c.refused(now, r);
                            until.insert(r, now + REFUSAL_COOL_DOWN_MS);
                            c.avoid(request, r);
                        }
                        let (blocks, tokens) = text_blocks(["aaaabbbb", "aaaacccc", "zzzz"][op as usize % 3], 4);
                        c.hint(request, &blocks, tokens);
                        let got = c.choose(now, request, &free(&ids));
                        open.push(request);
                        prop_assert!(ids.iter().any(|&r| ReplicaId::from_u128(r) == got));
                        if ids.len() > 1 {
                            prop_assert!(Some(got) != avoided, "went back to {} among {:?}", got, ids);
                        }
                        if refusing(got, &until) {
                            for &other in &ids {
                                let other = ReplicaId::from_u128(other);
                                prop_assert!(
                                    other == got || refusing(other, &until),
                                    "chose {} (refusing until {:?}) at {} over {} (until {:?})",
                                    got, until.get(&got), now, other, until.get(&other)
                                );
                            }
                        }
                    }
                }
            }
        }

        /// Whatever the traffic and churn: the choice is always one of the
        /// free replicas, and no replica is assumed to hold more than the
        /// budget.
        #[test]
        fn choices_are_free_replicas_and_caches_stay_bounded(
            ops in proptest::collection::vec((0u8..4, 0u8..6, proptest::collection::vec(0u128..4, 1..4)), 1..200),
        ) {
            let mut c = ReplicaChooser::new(RouterPolicy::Kv, &ApproxKvConfig { block_chars: 4, cache_blocks: 5, ..Default::default() }, 7);
            let texts = ["aaaabbbbccccdddd", "aaaabbbbeeee", "zzzzyyyy", "aaaa"];
            for (i, (op, t, mut ids)) in ops.into_iter().enumerate() {
                ids.sort_unstable();
                ids.dedup();
                match op {
                    0 => c.replica_gone(ReplicaId::from_u128(ids[0])),
                    1 => c.done(RequestId((i as u64).saturating_sub(1))),
                    _ => {
                        let got = ask(&mut c, i as u64, texts[t as usize % texts.len()], &ids);
                        prop_assert!(ids.iter().any(|&r| ReplicaId::from_u128(r) == got));
                    }
                }
                for r in 0..4 {
                    prop_assert!(c.cached_blocks(ReplicaId::from_u128(r)) <= 5);
                }
            }
        }
    }
}
