//! The engine's adapters against a model of a vLLM engine (which refuses
//! to load a name it has and to unload one it lacks), on noisy streams of
//! holds and releases from several gateways, gateways that die, and steps
//! that fail.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

fn adapter(k: usize) -> AdapterRef {
    format!("base/m:lora-{k}").parse().unwrap()
}

fn artifact(k: u8) -> ArtifactId {
    format!("hg1:{}:{}", format!("{k:02x}").repeat(32), "00".repeat(32)).parse().unwrap()
}

/// `gateway` holds `a` (as artifact 1) on `e`, and its load is done.
fn loaded(e: &mut EngineAdapters, gateway: &str, a: &AdapterRef) {
    e.hold(gateway, 1, a, artifact(1));
    assert!(matches!(e.poll_step(), Some(Step::Load { .. })));
    e.step_done(Ok(()));
}

#[test]
fn two_gateways_share_one_load_and_the_last_release_unloads() {
    let mut e = EngineAdapters::new();
    let a = adapter(0);
    assert_eq!(e.hold("gw-1", 1, &a, artifact(1)), Hold::Waiting);
    assert_eq!(e.hold("gw-2", 1, &a, artifact(1)), Hold::Waiting);
    assert_eq!(e.poll_step(), Some(Step::Load { adapter: a.clone(), artifact: artifact(1) }));
    assert_eq!(e.poll_step(), None, "one step at a time");
    e.step_done(Ok(()));
    assert_eq!(e.poll_step(), None, "loaded once for both");
    assert_eq!(e.state("gw-1", a.name()), State::Ready);
    assert_eq!(e.hold("gw-1", 1, &a, artifact(1)), Hold::Ready, "a hold is idempotent");
    e.release("gw-1", 1, a.name());
    assert_eq!(e.poll_step(), None, "gw-2 still holds it");
    assert_eq!(e.state("gw-1", a.name()), State::NotHeld(None));
    e.release("gw-2", 1, a.name());
    assert_eq!(e.poll_step(), Some(Step::Unload { adapter: a.clone() }));
    e.step_done(Ok(()));
    assert_eq!(e.loaded().count(), 0);
}

#[test]
fn newer_slots_of_a_gateway_end_the_holds_of_its_older_ones() {
    let mut e = EngineAdapters::new();
    let (a, b) = (adapter(0), adapter(1));
    loaded(&mut e, "gw-1", &a);
    // The replica left gw-1's routing and came back: its new slots (2) are
    // empty, the engine still has a.
    assert_eq!(e.hold("gw-1", 2, &b, artifact(1)), Hold::Waiting);
    assert_eq!(e.poll_step(), Some(Step::Unload { adapter: a.clone() }), "slots 1 will never release a");
    e.step_done(Ok(()));
    assert_eq!(e.hold("gw-1", 1, &a, artifact(1)), Hold::Stale, "from the replaced slots");
    e.release("gw-1", 1, b.name());
    assert!(matches!(e.poll_step(), Some(Step::Load { .. })), "a stale release changes nothing");
    e.step_done(Ok(()));
    assert_eq!(e.hold("gw-1", 2, &b, artifact(1)), Hold::Ready);
    // Held again from the newer slots before its unload, an adapter stays.
    assert_eq!(e.hold("gw-1", 3, &b, artifact(1)), Hold::Ready);
    assert_eq!(e.poll_step(), None);
}

#[test]
fn a_dead_gateways_holds_go_and_a_failed_load_tells_its_holders() {
    let mut e = EngineAdapters::new();
    let (a, b) = (adapter(0), adapter(1));
    loaded(&mut e, "gw-1", &a);
    e.hold("gw-2", 1, &b, artifact(2));
    e.keep_gateways(&BTreeSet::from(["gw-2".to_owned()]));
    assert_eq!(e.poll_step(), Some(Step::Unload { adapter: a.clone() }), "unloads go first");
    e.step_done(Ok(()));
    assert_eq!(e.poll_step(), Some(Step::Load { adapter: b.clone(), artifact: artifact(2) }));
    e.step_done(Err("its engine answered 400".into()));
    assert_eq!(e.state("gw-2", b.name()), State::NotHeld(Some("its engine answered 400".into())));
    assert_eq!(e.poll_step(), None, "not tried again until held again");
    assert_eq!(e.hold("gw-2", 1, &b, artifact(2)), Hold::Waiting);
    assert!(matches!(e.poll_step(), Some(Step::Load { .. })));
}

#[test]
fn a_name_loaded_as_another_artifact_is_refused_until_released() {
    let mut e = EngineAdapters::new();
    let a = adapter(0);
    loaded(&mut e, "gw-1", &a);
    assert_eq!(e.hold("gw-2", 1, &a, artifact(2)), Hold::Conflict { loaded: artifact(1) });
    e.release("gw-1", 1, a.name());
    assert_eq!(e.poll_step(), Some(Step::Unload { adapter: a.clone() }));
    assert_eq!(
        e.hold("gw-2", 1, &a, artifact(2)),
        Hold::Conflict { loaded: artifact(1) },
        "while it unloads"
    );
    e.step_done(Ok(()));
    assert_eq!(e.hold("gw-2", 1, &a, artifact(2)), Hold::Waiting);
    assert_eq!(e.poll_step(), Some(Step::Load { adapter: a.clone(), artifact: artifact(2) }));
}

#[test]
fn an_unload_that_fails_is_not_tried_again_until_held_and_released_anew() {
    let mut e = EngineAdapters::new();
    let a = adapter(0);
    loaded(&mut e, "gw-1", &a);
    e.release("gw-1", 1, a.name());
    e.poll_step();
    e.step_done(Err("engine busy".into()));
    assert_eq!(e.poll_step(), None);
    assert_eq!(e.loaded().count(), 1, "still loaded");
    assert_eq!(e.hold("gw-1", 1, &a, artifact(1)), Hold::Ready);
    e.release("gw-1", 1, a.name());
    assert_eq!(e.poll_step(), Some(Step::Unload { adapter: a }));
}

#[test]
fn a_gateway_loses_its_holds_only_after_answered_reads_miss_it() {
    let mut h = Holders::default();
    h.heard("gw-new");
    let only = |g: &str| BTreeSet::from([g.to_owned()]);
    let both = BTreeSet::from(["gw-a".to_owned(), "gw-new".to_owned()]);
    // A new gateway holds before it is in the index; the index has gw-a.
    for _ in 0..Holders::MISSED_READS - 1 {
        assert_eq!(h.read(&only("gw-a")), both);
    }
    // Seen once, it starts over; gw-a is missed from now on.
    assert_eq!(h.read(&only("gw-new")), both);
    // (Reads that do not answer are not reads: the caller does not call.)
    for _ in 0..Holders::MISSED_READS - 2 {
        assert_eq!(h.read(&only("gw-new")), both);
    }
    assert_eq!(h.read(&only("gw-new")), only("gw-new"), "gw-a missed by ten answered reads");
}

/// One thing that happens to the engine's adapters.
#[derive(Debug, Clone)]
enum Op {
    Hold {
        gateway: usize,
        adapter: usize,
    },
    Release {
        gateway: usize,
        adapter: usize,
    },
    /// The gateway dies: only the others are alive from now on.
    Dies {
        gateway: usize,
    },
    /// The replica left the gateway's routing and came back: its slots
    /// start anew (a newer generation), the engine keeps what it has.
    Reset {
        gateway: usize,
    },
    /// The driver carries out the step in flight, if any.
    Step {
        ok: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    // Holds and steps dominate, so adapters come and go under load.
    prop_oneof![
        4 => (0..4usize, 0..6usize).prop_map(|(gateway, adapter)| Op::Hold { gateway, adapter }),
        3 => (0..4usize, 0..6usize).prop_map(|(gateway, adapter)| Op::Release { gateway, adapter }),
        1 => (0..4usize).prop_map(|gateway| Op::Dies { gateway }),
        1 => (0..4usize).prop_map(|gateway| Op::Reset { gateway }),
        5 => proptest::bool::weighted(0.85).prop_map(|ok| Op::Step { ok }),
    ]
}

proptest! {
    /// After every operation: the engine (a model refusing a load of a name
    /// it has and an unload of one it lacks) is never asked either; at most
    /// one step is in flight; no adapter a live gateway holds is unloaded;
    /// every live gateway's hold reads Ready exactly when the engine has
    /// the adapter. Once the operations stop and every step succeeds, the
    /// engine has exactly what live gateways hold.
    #[test]
    fn the_engine_converges_to_what_live_gateways_hold(ops in proptest::collection::vec(op(), 1..300)) {
        let mut e = EngineAdapters::new();
        let mut engine: BTreeSet<AdapterName> = BTreeSet::new();
        let mut holds: BTreeMap<AdapterName, BTreeSet<String>> = BTreeMap::new();
        let mut alive: BTreeSet<String> = (0..4).map(|g| format!("gw-{g}")).collect();
        // Each gateway's slots now, and the newest the engine has heard of.
        let mut slots: BTreeMap<String, u64> = alive.iter().map(|g| (g.clone(), 1)).collect();
        let mut heard: BTreeMap<String, u64> = BTreeMap::new();
        let mut in_flight: Option<Step> = None;
        for op in ops {
            match op {
                Op::Hold { gateway, adapter: k } => {
                    let gw = format!("gw-{gateway}");
                    if alive.contains(&gw) {
                        let now = slots[&gw];
                        if heard.get(&gw).is_none_or(|&h| h < now) {
                            // The first hold of newer slots ends the older ones'.
                            for h in holds.values_mut() {
                                h.remove(&gw);
                            }
                            heard.insert(gw.clone(), now);
                        }
                        e.hold(&gw, now, &adapter(k), artifact(1));
                        holds.entry(adapter(k).name().clone()).or_default().insert(gw);
                    }
                }
                Op::Release { gateway, adapter: k } => {
                    let gw = format!("gw-{gateway}");
                    let now = slots[&gw];
                    e.release(&gw, now, adapter(k).name());
                    if heard.get(&gw) == Some(&now) {
                        holds.entry(adapter(k).name().clone()).or_default().remove(&gw);
                    }
                }
                Op::Dies { gateway } => {
                    let gw = format!("gw-{gateway}");
                    alive.remove(&gw);
                    heard.remove(&gw);
                    e.keep_gateways(&alive);
                    for h in holds.values_mut() {
                        h.retain(|g| alive.contains(g));
                    }
                }
                Op::Reset { gateway } => {
                    *slots.get_mut(&format!("gw-{gateway}")).expect("a gateway") += 1;
                }
                Op::Step { ok } => {
                    if let Some(step) = in_flight.take() {
                        let outcome = if ok { Ok(()) } else { Err("refused".to_owned()) };
                        match (&step, ok) {
                            (Step::Load { adapter, .. }, true) => { engine.insert(adapter.name().clone()); }
                            (Step::Load { adapter, .. }, false) => { holds.remove(adapter.name()); }
                            (Step::Unload { adapter }, true) => { engine.remove(adapter.name()); }
                            (Step::Unload { .. }, false) => {}
                        }
                        e.step_done(outcome);
                    }
                }
            }
            if in_flight.is_none() {
                in_flight = e.poll_step();
                match &in_flight {
                    Some(Step::Load { adapter, .. }) => prop_assert!(!engine.contains(adapter.name()), "loads what it has: {adapter}"),
                    Some(Step::Unload { adapter }) => {
                        prop_assert!(engine.contains(adapter.name()), "unloads what it lacks: {adapter}");
                        let held = holds.get(adapter.name()).is_some_and(|h| !h.is_empty());
                        prop_assert!(!held, "unloads {adapter}, which a live gateway holds");
                    }
                    None => {}
                }
            }
            prop_assert!(e.poll_step().is_none() || in_flight.is_none(), "two steps in flight");
            for (name, holders) in &holds {
                for gw in holders {
                    let ready = e.state(gw, name) == State::Ready;
                    prop_assert_eq!(ready, engine.contains(name) && !matches!(&in_flight, Some(Step::Unload { adapter }) if adapter.name() == name), "{} for {}", name, gw);
                }
            }
            let loaded: BTreeSet<AdapterName> = e.loaded().map(|a| a.name().clone()).collect();
            prop_assert_eq!(&loaded, &engine, "the machine's word on what the engine has");
        }
        // Quiet: every step succeeds until none is due.
        for _ in 0..100 {
            if let Some(step) = in_flight.take() {
                match &step {
                    Step::Load { adapter, .. } => { engine.insert(adapter.name().clone()); }
                    Step::Unload { adapter } => { engine.remove(adapter.name()); }
                }
                e.step_done(Ok(()));
            }
            in_flight = e.poll_step();
            if in_flight.is_none() { break; }
        }
        prop_assert!(in_flight.is_none(), "still stepping after 100 steps");
        let wanted: BTreeSet<AdapterName> =
            holds.iter().filter(|(_, h)| !h.is_empty()).map(|(n, _)| n.clone()).collect();
        // An unload that failed leaves its adapter loaded (stuck) until held
        // and released anew: the engine has at least what is held.
        prop_assert!(wanted.is_subset(&engine), "held {:?}, engine has {:?}", wanted, engine);
    }
}
