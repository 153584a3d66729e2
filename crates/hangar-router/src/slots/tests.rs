//! The adapter slots against a model of an engine, on noisy request
//! streams: Poisson arrivals, Zipf-popular adapters of random sizes,
//! random run and step times, loads and unloads that sometimes fail, and
//! requests that give up while they wait.

use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use hangar_core::{AdapterRef, ByteSize, RequestId};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

fn adapter(k: usize) -> AdapterRef {
    format!("base/m:lora-{k}").parse().unwrap()
}

fn config(slots: u32, memory: u64) -> AdapterConfig {
    AdapterConfig { slots, memory: ByteSize::new(memory), ..AdapterConfig::default() }
}

#[test]
fn a_loaded_adapter_serves_at_once_and_recency_picks_the_victim() {
    let mut s = AdapterSlots::new(&config(2, 1_000));
    let (a, b, c) = (adapter(0), adapter(1), adapter(2));
    for (id, x) in [(1, &a), (2, &b)] {
        assert_eq!(s.acquire(RequestId(id), x, 100).unwrap(), Acquired::Waiting);
        assert!(matches!(s.poll_step(), Some(SlotStep::Load { .. })));
        assert_eq!(s.poll_step(), None, "one step at a time");
        assert!(s.step_done(true));
        assert_eq!(s.poll_event(), Some(SlotEvent::Ready(RequestId(id))));
        s.release(RequestId(id));
    }
    // a is used again, so b is the least recently used.
    assert_eq!(s.acquire(RequestId(3), &a, 100).unwrap(), Acquired::Ready);
    s.release(RequestId(3));
    assert_eq!(s.loads_before_ready(&c, 100), Some(1));
    s.acquire(RequestId(4), &c, 100).unwrap();
    assert_eq!(s.poll_step(), Some(SlotStep::Unload { adapter: b.clone() }));
    assert_eq!(s.holding(&b), Holding::Unloading);
    s.step_done(true);
    assert_eq!(s.poll_step(), Some(SlotStep::Load { adapter: c.clone(), bytes: 100 }));
    assert_eq!((s.used_slots(), s.used_bytes()), (2, 200));
    s.check();
}

#[test]
fn an_adapter_in_use_is_never_the_victim_and_a_full_replica_says_so() {
    let mut s = AdapterSlots::new(&config(1, 1_000));
    let (a, b) = (adapter(0), adapter(1));
    s.acquire(RequestId(1), &a, 100).unwrap();
    s.poll_step();
    s.step_done(true);
    assert_eq!(s.loads_before_ready(&b, 100), None, "a's only slot is in use");
    assert_eq!(s.loads_before_ready(&a, 100), Some(0));
    s.acquire(RequestId(2), &b, 100).unwrap();
    assert_eq!(s.poll_step(), None);
    // Another request for a runs at once even though b waits.
    assert_eq!(s.acquire(RequestId(3), &a, 100).unwrap(), Acquired::Ready);
    s.release(RequestId(1));
    assert_eq!(s.poll_step(), None, "request 3 still uses a");
    s.release(RequestId(3));
    assert_eq!(s.poll_step(), Some(SlotStep::Unload { adapter: a.clone() }));
    s.check();
}

#[test]
fn failures_fail_the_waiters_or_keep_the_adapter() {
    let mut s = AdapterSlots::new(&config(1, 1_000));
    let (a, b) = (adapter(0), adapter(1));
    s.acquire(RequestId(1), &a, 100).unwrap();
    s.acquire(RequestId(2), &a, 100).unwrap();
    s.poll_step();
    s.step_done(false);
    assert_eq!(s.poll_event(), Some(SlotEvent::Failed { request: RequestId(1), adapter: a.clone() }));
    assert_eq!(s.poll_event(), Some(SlotEvent::Failed { request: RequestId(2), adapter: a.clone() }));
    assert!(!s.release(RequestId(1)), "a failed request is forgotten");
    assert_eq!((s.used_slots(), s.holding(&a)), (0, Holding::Absent));
    // Loaded, then an unload that fails: a stays, and is never chosen again.
    s.acquire(RequestId(3), &a, 100).unwrap();
    s.poll_step();
    s.step_done(true);
    s.poll_event();
    s.release(RequestId(3));
    s.acquire(RequestId(4), &b, 100).unwrap();
    assert_eq!(s.poll_step(), Some(SlotStep::Unload { adapter: a.clone() }));
    s.acquire(RequestId(5), &a, 100).unwrap();
    s.step_done(false);
    assert_eq!(s.poll_event(), Some(SlotEvent::Ready(RequestId(5))), "a is still there");
    s.release(RequestId(5));
    assert_eq!(s.poll_step(), None, "a stuck adapter is no victim");
    assert!(!s.step_done(true), "nothing in flight");
    s.check();
}

#[test]
fn misuse_and_impossible_adapters_change_nothing() {
    let mut s = AdapterSlots::new(&config(2, 500));
    let err = s.acquire(RequestId(1), &adapter(0), 501).unwrap_err();
    assert_eq!(
        err.to_string(),
        "adapter `base/m:lora-0` is 501 bytes, more than the 500 bytes a replica holds for adapters"
    );
    assert_eq!(config(2, 500).check_fits(&adapter(0), 501), Err(err));
    s.acquire(RequestId(1), &adapter(0), 100).unwrap();
    assert_eq!(s.acquire(RequestId(1), &adapter(1), 100), Err(SlotsError::Duplicate(RequestId(1))));
    assert_eq!(s.requests(), 1);
    s.check();
    let field = |cfg: AdapterConfig| cfg.validate().unwrap_err().within("models[0].adapters").to_string();
    assert!(field(config(0, 1)).contains("models[0].adapters.slots"));
    assert!(field(AdapterConfig { request_ms: 0.0, ..config(1, 1_000_000_000) }).contains("request_ms"));
    assert!(field(config(1, 1)).contains("default_size"));
}

#[test]
fn a_request_that_gives_up_takes_its_adapter_off_the_list() {
    let mut s = AdapterSlots::new(&config(1, 1_000));
    s.acquire(RequestId(1), &adapter(0), 100).unwrap();
    s.poll_step();
    s.step_done(true);
    s.poll_event();
    s.acquire(RequestId(2), &adapter(1), 100).unwrap();
    assert_eq!(s.holding(&adapter(1)), Holding::Wanted);
    s.release(RequestId(2));
    assert_eq!(s.holding(&adapter(1)), Holding::Absent);
    s.release(RequestId(1));
    assert_eq!(s.poll_step(), None, "nobody wants another adapter: a stays");
    s.check();
}

/// A stream's shape, drawn per case.
#[derive(Debug, Clone)]
struct Stream {
    seed: u64,
    slots: u32,
    memory: u64,
    adapters: usize,
    zipf_s: f64,
    /// Mean ms between arrivals, of a run, of a step.
    gap_ms: f64,
    run_ms: f64,
    step_ms: f64,
    /// Chance a step fails, a waiting request gives up.
    fail: f64,
    give_up: f64,
    requests: u64,
}

fn streams() -> impl Strategy<Value = Stream> {
    (any::<u64>(), 1u32..6, 1u64..8, 1usize..40, 0.0f64..1.6, 1.0f64..50.0, 1.0f64..400.0).prop_flat_map(
        |(seed, slots, memory_units, adapters, zipf_s, gap_ms, run_ms)| {
            (0.5f64..100.0, 0.0f64..0.2, 0.0f64..0.1, 50u64..600).prop_map(
                move |(step_ms, fail, give_up, requests)| Stream {
                    seed,
                    slots,
                    memory: memory_units * 100,
                    adapters,
                    zipf_s,
                    gap_ms,
                    run_ms,
                    step_ms,
                    fail,
                    give_up,
                    requests,
                },
            )
        },
    )
}

/// What happens next in the model of one replica.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Arrive,
    StepDone,
    /// A request finished running, or gave up waiting.
    End(RequestId),
}

fn exp(rng: &mut ChaCha8Rng, mean: f64) -> u64 {
    (-mean * (1.0 - rng.random::<f64>()).ln()).round() as u64
}

/// Runs `stream` through one replica's slots and a model engine, checking
/// after every call the slots' invariants and the engine against them;
/// returns the loads carried out.
fn run(st: &Stream) -> u64 {
    let mut rng = ChaCha8Rng::seed_from_u64(st.seed);
    let weights: Vec<f64> = (1..=st.adapters).map(|k| 1.0 / (k as f64).powf(st.zipf_s)).collect();
    let total: f64 = weights.iter().sum();
    // Sizes of 1 to 3 hundred bytes, never more than the memory.
    let sizes: Vec<u64> =
        (0..st.adapters).map(|_| rng.random_range(1..=3u64).min(st.memory / 100) * 100).collect();
    let mut s = AdapterSlots::new(&config(st.slots, st.memory));
    let mut heap: BinaryHeap<std::cmp::Reverse<(u64, u64, Ev)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |heap: &mut BinaryHeap<_>, at: u64, ev: Ev| {
        seq += 1;
        heap.push(std::cmp::Reverse((at, seq, ev)));
    };
    // The engine: what it has loaded, and each adapter's last use as the
    // machine should count it.
    let mut engine: BTreeMap<AdapterRef, u64> = BTreeMap::new();
    let mut last_use: BTreeMap<AdapterRef, u64> = BTreeMap::new();
    let mut tick = 0u64;
    // Adapters whose unload failed: never a victim again.
    let mut stuck: BTreeSet<AdapterRef> = BTreeSet::new();
    // Requests and their adapter, and which of them run.
    let mut open: BTreeMap<RequestId, AdapterRef> = BTreeMap::new();
    let mut running: BTreeSet<RequestId> = BTreeSet::new();
    let mut answered: BTreeSet<RequestId> = BTreeSet::new();
    let mut in_flight: Option<SlotStep> = None;
    let (mut next_id, mut loads) = (0u64, 0u64);
    push(&mut heap, 0, Ev::Arrive);
    while let Some(std::cmp::Reverse((now, _, ev))) = heap.pop() {
        match ev {
            Ev::Arrive => {
                let u = rng.random::<f64>() * total;
                let mut acc = 0.0;
                let k = weights.iter().position(|w| {
                    acc += w;
                    acc >= u
                });
                let a = adapter(k.unwrap_or(st.adapters - 1));
                let id = RequestId(next_id);
                next_id += 1;
                let bytes = sizes[k.unwrap_or(st.adapters - 1)];
                tick += 1;
                last_use.insert(a.clone(), tick);
                match s.acquire(id, &a, bytes).unwrap() {
                    Acquired::Ready => {
                        assert!(engine.contains_key(&a), "ready on an adapter the engine lacks");
                        answered.insert(id);
                        running.insert(id);
                        push(&mut heap, now + exp(&mut rng, st.run_ms), Ev::End(id));
                    }
                    Acquired::Waiting => {
                        if rng.random::<f64>() < st.give_up {
                            push(&mut heap, now + exp(&mut rng, st.step_ms), Ev::End(id));
                        }
                    }
                }
                open.insert(id, a);
                if next_id < st.requests {
                    push(&mut heap, now + exp(&mut rng, st.gap_ms), Ev::Arrive);
                }
            }
            Ev::StepDone => {
                let step = in_flight.take().expect("a step was in flight");
                let p = if matches!(step, SlotStep::Load { .. }) { st.fail } else { st.fail / 4.0 };
                let ok = rng.random::<f64>() >= p;
                match step {
                    SlotStep::Load { adapter, bytes } if ok => {
                        engine.insert(adapter.clone(), bytes);
                        tick += 1;
                        last_use.insert(adapter, tick);
                        loads += 1;
                    }
                    SlotStep::Unload { adapter } if ok => {
                        engine.remove(&adapter);
                    }
                    SlotStep::Unload { adapter } => {
                        stuck.insert(adapter);
                    }
                    SlotStep::Load { .. } => {}
                }
                assert!(s.step_done(ok));
            }
            Ev::End(id) => {
                // A waiting request that gave up, or a run that ended;
                // a request may have failed or finished before.
                if open.remove(&id).is_some() {
                    running.remove(&id);
                    s.release(id);
                }
            }
        }
        // Drain: answers first, then the next step.
        while let Some(e) = s.poll_event() {
            match e {
                SlotEvent::Ready(id) => {
                    let a = &open[&id];
                    assert!(engine.contains_key(a), "{id} ready before {a} loaded");
                    assert!(answered.insert(id), "{id} answered twice");
                    running.insert(id);
                    push(&mut heap, now + exp(&mut rng, st.run_ms), Ev::End(id));
                }
                SlotEvent::Failed { request, adapter } => {
                    assert_eq!(open.remove(&request), Some(adapter));
                    assert!(answered.insert(request), "{request} answered twice");
                }
            }
        }
        if let Some(step) = s.poll_step() {
            if let SlotStep::Unload { adapter } = &step {
                let used = running.iter().any(|r| open.get(r) == Some(adapter));
                assert!(!used, "unloading {adapter}, which a running request uses");
                // The least recently used of the unused loaded adapters.
                let oldest = (engine.keys())
                    .filter(|a| !open.values().any(|x| x == *a) && *a != adapter && !stuck.contains(*a))
                    .map(|a| last_use[a])
                    .min();
                if let Some(oldest) = oldest {
                    assert!(last_use[adapter] <= oldest, "{adapter} is not the least recently used");
                }
            }
            in_flight = Some(step);
            push(&mut heap, now + exp(&mut rng, st.step_ms), Ev::StepDone);
        }
        s.check();
        assert!(engine.len() as u32 <= st.slots, "the engine holds {} adapters", engine.len());
        assert!(engine.values().sum::<u64>() <= st.memory);
        assert!(engine.len() as u32 <= s.used_slots() && engine.values().sum::<u64>() <= s.used_bytes());
    }
    // Every request was answered (or gave up while waiting), and all
    // ended — but those whose adapter cannot fit beside adapters whose
    // unload failed (kept for good): they wait for a restart.
    let stuck_bytes: u64 = stuck.iter().map(|a| engine[a]).sum();
    for (id, a) in &open {
        let bytes = sizes[a.name().as_str()["lora-".len()..].parse::<usize>().unwrap()];
        let blocked = stuck.len() as u32 >= st.slots || stuck_bytes + bytes > st.memory;
        assert!(blocked && !running.contains(id), "{id} for {a} never ended ({} stuck)", stuck.len());
    }
    assert_eq!(s.requests(), open.len());
    loads
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// On noisy streams, after every call: the slots and the memory are
    /// never exceeded — by what the machine counts nor by what the engine
    /// holds —, no adapter a running request uses is unloaded, the victim
    /// is the least recently used, every request gets exactly one answer,
    /// and every request ends.
    #[test]
    fn slots_and_memory_hold_and_every_request_is_answered(st in streams()) {
        run(&st);
    }
}

#[test]
fn a_hot_working_set_that_fits_is_loaded_once_each() {
    // Four adapters in eight slots: each is loaded once, whatever the load.
    let st = Stream {
        seed: 9,
        slots: 8,
        memory: 1_200,
        adapters: 4,
        zipf_s: 1.0,
        gap_ms: 5.0,
        run_ms: 100.0,
        step_ms: 20.0,
        fail: 0.0,
        give_up: 0.0,
        requests: 2_000,
    };
    assert_eq!(run(&st), 4);
}
