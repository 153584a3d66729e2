//! Scheduler tests: hand-checked scenarios and property tests over random
//! workloads.

use std::collections::HashMap;

use hangar_core::{BlockHash, KvEvent, RequestId};
use proptest::prelude::*;

use crate::config::{SchedulerKind, SglangConfig, SglangPolicy};
use crate::timing::Fixed;
use crate::{EngineConfig, EngineCore, EngineRequest, Pass, Prompt};

use super::SglangScheduler;

/// A small engine: `tokens` of KV in pages of `page`, blocks of 4 tokens.
fn small(tokens: u32, page: u32, max_seqs: u32, chunk: u32) -> EngineConfig {
    EngineConfig {
        scheduler: SchedulerKind::Sglang,
        block_size: 4,
        num_gpu_blocks: tokens / 4,
        max_num_seqs: max_seqs,
        sglang: SglangConfig { page_size: page, chunked_prefill_size: chunk, ..SglangConfig::default() },
        ..EngineConfig::default()
    }
}

fn sched(config: &EngineConfig) -> SglangScheduler {
    config.validate().unwrap();
    SglangScheduler::new(config, std::sync::Arc::new(Fixed { prefill_ms: 10.0, decode_ms: 1.0 }))
}

fn req(id: u64, tokens: &[u32], out: u32) -> EngineRequest {
    EngineRequest { id: RequestId(id), prompt: Prompt::from_tokens(tokens, 4), max_output_tokens: out }
}

/// Everything the passes of a run reported, pass by pass checked against
/// the engine's invariants.
#[derive(Default)]
struct Log {
    tokens: HashMap<RequestId, Vec<u32>>,
    completed: Vec<RequestId>,
    preempted: Vec<RequestId>,
    admitted: Vec<(RequestId, u32)>,
    events: Vec<KvEvent>,
    prefill_chunks: Vec<u32>,
    first_admissions: Vec<RequestId>,
    /// The end of the pass of each request's latest token.
    last_token: HashMap<RequestId, f64>,
}

impl Log {
    fn record(&mut self, pass: &Pass) {
        for t in &pass.tokens {
            self.tokens.entry(t.request).or_default().push(t.index);
            let previous = self.last_token.insert(t.request, pass.end_ms);
            assert_eq!(
                t.previous_ms, previous,
                "{:?}'s token {}: its previous one's pass end",
                t.request, t.index
            );
        }
        self.completed.extend(&pass.completed);
        self.preempted.extend(&pass.preempted);
        self.admitted.extend(pass.admitted.iter().map(|a| (a.request, a.reused_tokens)));
        self.first_admissions.extend(pass.admitted.iter().filter(|a| a.first).map(|a| a.request));
        self.events.extend(pass.kv_events.iter().cloned());
        if pass.prefill_tokens > 0 {
            self.prefill_chunks.push(pass.prefill_tokens);
        }
    }
}

/// Runs one pass, checking what every pass must satisfy.
fn step(s: &mut SglangScheduler, pass: &mut Pass, now: &mut f64, log: &mut Log) {
    s.step(*now, pass);
    s.check_invariants();
    assert!(
        pass.prefill_tokens == 0 || pass.decode_seqs == 0,
        "SGLang never mixes prefill and decode in one pass"
    );
    if s.chunked_prefill {
        assert!(
            pass.prefill_tokens <= s.chunk_size,
            "{} prefill tokens over the chunk size",
            pass.prefill_tokens
        );
    }
    log.record(pass);
    *now = pass.end_ms;
}

/// Steps until idle.
fn drain(s: &mut SglangScheduler, pass: &mut Pass, now: &mut f64, log: &mut Log) {
    for _ in 0..100_000 {
        if s.num_running() + s.num_waiting() == 0 {
            return;
        }
        step(s, pass, now, log);
        assert!(!pass.is_idle(), "engine has work but the pass did nothing");
    }
    panic!("no progress after 100000 passes");
}

fn stored(events: &[KvEvent]) -> Vec<BlockHash> {
    events
        .iter()
        .flat_map(|e| match e {
            KvEvent::Stored { blocks, .. } => blocks.clone(),
            _ => Vec::new(),
        })
        .collect()
}

fn removed(events: &[KvEvent]) -> Vec<BlockHash> {
    events
        .iter()
        .flat_map(|e| match e {
            KvEvent::Removed { blocks } => blocks.clone(),
            _ => Vec::new(),
        })
        .collect()
}

#[test]
fn prefill_and_decode_run_in_separate_passes() {
    let mut s = sched(&small(256, 1, 8, 64));
    let (mut pass, mut now, mut log) = (Pass::default(), 0.0, Log::default());
    s.add(req(1, &[1; 10], 3)).unwrap();
    step(&mut s, &mut pass, &mut now, &mut log);
    assert_eq!(
        (pass.prefill_tokens, pass.tokens.len(), pass.end_ms),
        (10, 1, 10.0),
        "first token with the prefill"
    );
    // A request arriving now is prefilled while request 1 waits.
    s.add(req(2, &[2; 6], 2)).unwrap();
    step(&mut s, &mut pass, &mut now, &mut log);
    assert_eq!((pass.prefill_tokens, pass.decode_seqs), (6, 0));
    assert_eq!(pass.tokens.iter().map(|t| t.request).collect::<Vec<_>>(), vec![RequestId(2)]);
    step(&mut s, &mut pass, &mut now, &mut log);
    assert_eq!((pass.decode_seqs, pass.end_ms), (2, 21.0));
    assert_eq!(pass.completed, vec![RequestId(2)]);
    drain(&mut s, &mut pass, &mut now, &mut log);
    assert_eq!(log.tokens[&RequestId(1)], vec![0, 1, 2]);
    assert_eq!(log.tokens[&RequestId(2)], vec![0, 1]);
}

#[test]
fn long_prompts_are_chunked_at_page_boundaries() {
    // Pages of 4 tokens, 10-token chunks: 8 + 8 + 4 for a 20-token prompt.
    let mut s = sched(&small(256, 4, 8, 10));
    let (mut pass, mut now, mut log) = (Pass::default(), 0.0, Log::default());
    s.add(req(1, &[1; 20], 1)).unwrap();
    drain(&mut s, &mut pass, &mut now, &mut log);
    assert_eq!(log.prefill_chunks, vec![8, 8, 4]);
    assert_eq!(log.completed, vec![RequestId(1)]);
    assert_eq!(log.tokens[&RequestId(1)], vec![0], "the token comes only after the last chunk");
}

#[test]
fn a_cached_prefix_is_reused_and_reported_in_router_blocks() {
    let mut s = sched(&small(256, 1, 8, 64));
    let (mut pass, mut now, mut log) = (Pass::default(), 0.0, Log::default());
    let p1 = Prompt::from_tokens(&[7; 12], 4);
    s.add(req(1, &[7; 12], 2)).unwrap();
    drain(&mut s, &mut pass, &mut now, &mut log);
    assert_eq!(stored(&log.events), p1.blocks(), "the prompt's full blocks, in the router's identity");
    s.add(req(2, &[7; 12], 1)).unwrap();
    step(&mut s, &mut pass, &mut now, &mut log);
    assert_eq!(pass.admitted[0].reused_tokens, 11, "all but the last token hit");
    assert_eq!(pass.prefill_tokens, 1);
    let mut longer = vec![7; 8];
    longer.extend([9; 8]);
    s.add(req(3, &longer, 1)).unwrap();
    step(&mut s, &mut pass, &mut now, &mut log);
    assert_eq!(pass.admitted[0].reused_tokens, 8, "only the equal prefix hits");
    let p3 = Prompt::from_tokens(&longer, 4);
    assert_eq!(stored(&pass.kv_events), p3.blocks()[2..], "only the new blocks are stored");
}

#[test]
fn eviction_reports_removed_blocks_lru_first() {
    // 32 tokens of KV in 1-token pages.
    let mut s = sched(&small(32, 1, 8, 64));
    let (mut pass, mut now, mut log) = (Pass::default(), 0.0, Log::default());
    s.add(req(1, &[1; 8], 1)).unwrap();
    drain(&mut s, &mut pass, &mut now, &mut log);
    s.add(req(2, &[2; 8], 1)).unwrap();
    drain(&mut s, &mut pass, &mut now, &mut log);
    assert!(removed(&log.events).is_empty());
    // 16 cached tokens; a 20-token prompt needs 4 of them: the newest 4 of
    // request 1's (the least recently used) go, request 2's stay.
    s.add(req(3, &[3; 20], 1)).unwrap();
    drain(&mut s, &mut pass, &mut now, &mut log);
    assert_eq!(removed(&log.events), Prompt::from_tokens(&[1; 8], 4).blocks()[1..]);
    s.add(req(4, &[2; 8], 1)).unwrap();
    step(&mut s, &mut pass, &mut now, &mut log);
    assert_eq!(pass.admitted[0].reused_tokens, 7);
}

#[test]
fn decode_retraction_recomputes_from_the_cache_and_emits_each_token_once() {
    // 40 tokens of KV. Two 10-token prompts with 14 outputs each need 46:
    // admission lets the second in (reserving only 0.1 of the first one's
    // remaining output), then decoding runs out of pages and the request
    // with fewer outputs is retracted.
    let mut config = small(40, 1, 8, 64);
    config.sglang.init_new_token_ratio = 0.1;
    config.sglang.min_new_token_ratio = 0.1;
    let mut s = sched(&config);
    let (mut pass, mut now, mut log) = (Pass::default(), 0.0, Log::default());
    s.add(req(1, &[1; 10], 14)).unwrap();
    step(&mut s, &mut pass, &mut now, &mut log);
    s.add(req(2, &[2; 10], 14)).unwrap();
    drain(&mut s, &mut pass, &mut now, &mut log);
    assert_eq!(log.preempted.first(), Some(&RequestId(2)), "fewest generated tokens goes first");
    for id in [1, 2] {
        assert_eq!(log.tokens[&RequestId(id)], (0..14).collect::<Vec<_>>(), "request {id}");
    }
    let readmission = log.admitted.iter().filter(|a| a.0 == RequestId(2)).nth(1).expect("re-admitted");
    assert!(readmission.1 >= 10, "the retracted request recomputes from its cached prefix");
}

#[test]
fn lpm_admits_the_longest_cached_prefix_first_and_fifo_does_not() {
    let order = |policy| {
        let mut config = small(256, 1, 1, 64);
        config.sglang.schedule_policy = policy;
        let mut s = sched(&config);
        let (mut pass, mut now, mut log) = (Pass::default(), 0.0, Log::default());
        s.add(req(1, &[5; 16], 1)).unwrap();
        drain(&mut s, &mut pass, &mut now, &mut log);
        log.admitted.clear();
        // One slot: requests are admitted one per pass, in policy order.
        s.add(req(2, &[6; 16], 1)).unwrap();
        s.add(req(3, &[[5; 8].as_slice(), &[6; 8]].concat(), 1)).unwrap();
        s.add(req(4, &[5; 17], 1)).unwrap();
        drain(&mut s, &mut pass, &mut now, &mut log);
        log.admitted.iter().map(|a| a.0 .0).collect::<Vec<_>>()
    };
    assert_eq!(order(SglangPolicy::Fifo), vec![2, 3, 4]);
    assert_eq!(order(SglangPolicy::Lpm), vec![4, 3, 2]);
}

#[test]
fn admission_reserves_memory_for_running_outputs() {
    // 64 tokens. Request 1 (8 + 55 output) runs; request 2 (8 + 12) needs
    // 20 < 64 − 8 free tokens, but 0.7 × 54 remaining outputs are reserved.
    let mut s = sched(&small(64, 1, 8, 64));
    let (mut pass, mut now, mut log) = (Pass::default(), 0.0, Log::default());
    s.add(req(1, &[1; 8], 55)).unwrap();
    step(&mut s, &mut pass, &mut now, &mut log);
    s.add(req(2, &[2; 8], 12)).unwrap();
    step(&mut s, &mut pass, &mut now, &mut log);
    assert!(pass.admitted.is_empty() && pass.decode_seqs == 1, "request 2 waits; request 1 decodes");
    drain(&mut s, &mut pass, &mut now, &mut log);
    assert_eq!(log.tokens[&RequestId(2)].len(), 12);
}

#[test]
fn refusals_abort_and_clear_cache() {
    let mut s = sched(&small(32, 1, 8, 64));
    assert!(s.add(req(1, &[1; 20], 12)).is_err(), "32 tokens leave no spare page");
    s.add(req(1, &[1; 20], 11)).unwrap();
    assert!(s.add(req(1, &[1; 4], 1)).is_err(), "duplicate id");
    let (mut pass, mut now, mut log) = (Pass::default(), 0.0, Log::default());
    step(&mut s, &mut pass, &mut now, &mut log);
    assert!(s.kv_usage() > 0.0);
    assert!(s.abort(RequestId(1)));
    assert!(!s.abort(RequestId(1)));
    s.check_invariants();
    assert_eq!(s.kv_usage(), 0.0, "an aborted request's memory is released");
    let mut events = Vec::new();
    s.clear_cache(&mut events);
    assert_eq!(events, vec![KvEvent::Cleared]);
    assert_eq!(s.tree.tree_pages(), 0);
    s.add(req(2, &[1; 20], 1)).unwrap();
    step(&mut s, &mut pass, &mut now, &mut log);
    assert_eq!(pass.admitted[0].reused_tokens, 0, "nothing cached survives a clear");
}

#[test]
fn the_engine_core_runs_sglang_from_toml() {
    let config: EngineConfig = toml::from_str(
        "scheduler = \"sglang\"\nblock_size = 16\n[sglang]\npage_size = 4\nschedule_policy = \"lpm\"\n",
    )
    .unwrap();
    assert_eq!(config.scheduler, SchedulerKind::Sglang);
    let mut engine = EngineCore::new(&config, |_| unreachable!()).unwrap();
    engine.set_kv_events(false);
    for id in 0..3 {
        let prompt = Prompt::from_tokens(&[3; 100], 16);
        engine.add_request(EngineRequest { id: RequestId(id), prompt, max_output_tokens: 5 }).unwrap();
    }
    let (mut pass, mut now, mut tokens, mut reused) = (Pass::default(), 0.0, 0, 0);
    while engine.has_work() {
        engine.step(now, &mut pass);
        tokens += pass.tokens.len();
        reused += pass.admitted.iter().map(|a| a.reused_tokens).sum::<u32>();
        assert!(pass.kv_events.is_empty(), "KV event capture is off");
        now = pass.end_ms;
    }
    assert_eq!(engine.kv_usage(), 0.0, "finished requests hold nothing (their cache is evictable)");
    assert_eq!(tokens, 15);
    assert_eq!(reused, 0, "all three were admitted in one pass, before anything was cached");
    let bad = EngineConfig { sglang: SglangConfig { page_size: 3, ..Default::default() }, ..config };
    assert!(EngineCore::new(&bad, |_| unreachable!())
        .unwrap_err()
        .to_string()
        .contains("must divide block_size"));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random workloads on a small engine: every pass stays within the chunk
    /// size and `max_num_seqs`, memory adds up after every pass, every
    /// request completes with exactly its output length with indices in
    /// order, and each block the router was told about is stored before it
    /// is removed.
    #[test]
    fn every_request_completes_with_exactly_its_output(
        kv_tokens in 48u32..128,
        page in prop_oneof![Just(1u32), Just(2), Just(4)],
        ratio in 0.0f64..1.0,
        max_seqs in 1u32..6,
        chunk in 4u32..40,
        lpm in any::<bool>(),
        caching in any::<bool>(),
        chunked in any::<bool>(),
        reqs in proptest::collection::vec((0u32..3, 1u32..24, 0u32..30, 0u8..3, 0u8..8), 1..20),
    ) {
        let mut config = small(kv_tokens / 4 * 4, page, max_seqs, chunk);
        config.sglang.init_new_token_ratio = ratio;
        config.sglang.min_new_token_ratio = ratio * 0.14;
        config.enable_prefix_caching = caching;
        config.enable_chunked_prefill = chunked;
        config.sglang.schedule_policy = if lpm { SglangPolicy::Lpm } else { SglangPolicy::Fifo };
        let mut s = sched(&config);
        let mut expected = HashMap::new();
        let (mut pass, mut now, mut log) = (Pass::default(), 0.0, Log::default());
        for (i, &(family, len, out, gap, abort)) in reqs.iter().enumerate() {
            let tokens: Vec<u32> = (0..len).map(|t| if t < 8 { family } else { 100 + i as u32 }).collect();
            if s.add(req(i as u64, &tokens, out)).is_ok() {
                expected.insert(RequestId(i as u64), out);
            }
            for _ in 0..gap {
                if s.num_running() + s.num_waiting() == 0 { break; }
                step(&mut s, &mut pass, &mut now, &mut log);
            }
            // Now and then abort an earlier request, wherever it is.
            if abort == 0 && i > 0 {
                let id = RequestId(i as u64 - 1);
                if s.abort(id) {
                    expected.remove(&id);
                    log.tokens.remove(&id);
                    log.admitted.retain(|a| a.0 != id);
                    log.preempted.retain(|p| *p != id);
                    log.first_admissions.retain(|a| *a != id);
                }
                s.check_invariants();
            }
        }
        drain(&mut s, &mut pass, &mut now, &mut log);
        for (id, out) in &expected {
            let got = log.tokens.remove(id).unwrap_or_default();
            prop_assert_eq!(got, (0..*out).collect::<Vec<_>>(), "request {}", id);
        }
        prop_assert_eq!(log.completed.len(), expected.len());
        prop_assert!(log.tokens.is_empty());
        // Each retraction is recomputed: one more admission, not a first one.
        for id in expected.keys() {
            let admissions = log.admitted.iter().filter(|a| a.0 == *id).count();
            let retractions = log.preempted.iter().filter(|p| *p == id).count();
            prop_assert_eq!(admissions, 1 + retractions, "request {}", id);
        }
        prop_assert_eq!(log.first_admissions.len(), expected.len());
        // Replaying the events as a router would: stores and removals
        // alternate per block, starting with a store.
        let mut cached = std::collections::HashSet::new();
        for e in &log.events {
            match e {
                KvEvent::Stored { blocks, .. } => for b in blocks { prop_assert!(cached.insert(*b), "{:?} stored twice", b); },
                KvEvent::Removed { blocks } => for b in blocks { prop_assert!(cached.remove(b), "{:?} removed uncached", b); },
                KvEvent::Cleared => cached.clear(),
            }
        }
        if !caching {
            prop_assert!(log.events.is_empty());
        }
    }
}
