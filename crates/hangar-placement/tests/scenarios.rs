//! Scenario tests: every candidate level, both GPU paths, eviction to WARM
//! and to COLD, explicit evictions, schedules and the delta.

mod common;

use common::*;
use hangar_placement::{
    Action, CandidateLevel, DeploymentDelta, EvictError, EvictionCause, Level, Schedule, Unplaceable, Window,
};

const TWO_NODES: &str = r#"
[[nodes]]
id = "a"
gpus = 2
gpu_memory = "80GB"
cpu_cache = "100GB"

[[nodes]]
id = "b"
gpus = 2
gpu_memory = "80GB"
cpu_cache = "100GB"

[models.small]
size = "5GB"        # share 15 GB; a GPU needs 24 GB free to take it
[models.mid]
size = "20GB"       # share 60 GB
[models.whole]
size = "25GB"       # 75 GB ≥ 64 GB: the whole GPU
[models.big]
size = "160GB"      # exactly two GPUs
[models.huge]
size = "161GB"      # three GPUs: no node has them
"#;

#[test]
fn deployed_when_already_hot_and_nothing_changes() {
    let mut c = cluster(TWO_NODES);
    hot(&mut c, "mid", 1, "a", &[0]);
    let before = c.snapshot();
    let out = c.deploy(&[req("mid", 1)], 0, &mut rng());
    assert_eq!(out.models[0].replicas.len(), 1);
    assert_eq!(out.models[0].replicas[0].level, CandidateLevel::Deployed);
    assert_eq!(out.models[0].replicas[0].replica_id, Some(rid(1)));
    assert!(!out.changed);
    assert!(DeploymentDelta::between(&before, &c.snapshot()).unwrap().is_empty());
}

#[test]
fn free_share_goes_to_the_best_fitting_available_gpu() {
    let mut c = cluster(TWO_NODES);
    // a: g0 has 80 GB free, g1 20 GB (below the 24 GB floor); b: g0 50 GB, g1 80 GB.
    hot(&mut c, "mid", 1, "a", &[1]);
    hot(&mut c, "small", 2, "b", &[0]);
    hot(&mut c, "small", 3, "b", &[0]);
    let out = c.deploy(&[req("small", 3)], 0, &mut rng());
    let r = &out.models[0].replicas[2];
    assert_eq!(r.level, CandidateLevel::Free);
    // The node is drawn among free ones; within it, the GPU with the least
    // room that suffices wins.
    let gpu = *r.gpu_bytes_by_gpu.keys().next().unwrap();
    assert_eq!(r.gpu_bytes_by_gpu[&gpu], 15 * GB);
    assert_eq!(gpu, 0, "on a, g1 is under the floor; on b, g0 (50 GB free) fits tighter than g1 (80 GB)");
    let dep = c.deployment(r.replica_id.as_ref().unwrap()).unwrap();
    assert_eq!(dep.gpu_fraction, Some(15.0 / 80.0));
    c.check_invariants().unwrap();
}

#[test]
fn cached_and_free_promotes_the_warm_replica_on_its_node() {
    let mut c = cluster(TWO_NODES);
    warm(&mut c, "mid", 7, "b");
    let before = c.snapshot();
    let out = c.deploy(&[req("mid", 1)], 5, &mut rng());
    let r = &out.models[0].replicas[0];
    assert_eq!(
        (r.level, r.replica_id, r.node.as_ref().unwrap().as_str()),
        (CandidateLevel::CachedAndFree, Some(rid(7)), "b")
    );
    assert_eq!(c.node(&"b".parse().unwrap()).unwrap().cache_used(), 0);
    let delta = assert_delta_round_trips(&before, &c.snapshot());
    assert_eq!(delta.from_cache.len(), 1);
    assert!(delta.create.is_empty());
    assert_eq!(delta.from_cache[0].deployed_at_ms, 5);
}

#[test]
fn cached_and_full_evicts_to_promote_and_the_evicted_goes_warm() {
    let mut c = cluster(TWO_NODES);
    for (id, node, gpu) in [(1, "a", 0), (2, "a", 1), (3, "b", 0), (4, "b", 1)] {
        hot(&mut c, "whole", id, node, &[gpu]);
    }
    warm(&mut c, "mid", 9, "a");
    let before = c.snapshot();
    let out = c.deploy(&[req("mid", 1)], 2 * HOUR, &mut rng());
    let r = &out.models[0].replicas[0];
    assert_eq!(r.level, CandidateLevel::CachedAndFull);
    assert_eq!(r.replica_id, Some(rid(9)));
    assert_eq!(r.eviction_cost.count, 1);
    assert_eq!(out.evictions.len(), 1);
    let e = &out.evictions[0];
    assert_eq!((e.from, e.to, e.node.as_str()), (Level::Hot, Level::Warm, "a"));
    assert_eq!(e.cause, EvictionCause::Pressure { model_key: key("mid"), replica_id: rid(9) });
    let delta = assert_delta_round_trips(&before, &c.snapshot());
    assert_eq!((delta.to_cache.len(), delta.from_cache.len()), (1, 1));
    // The release comes before the claim.
    let actions: Vec<Action> =
        delta.by_node()[&"a".parse::<hangar_placement::NodeId>().unwrap()].iter().map(|s| s.action).collect();
    assert_eq!(actions, vec![Action::ToCache, Action::FromCache]);
    c.check_invariants().unwrap();
}

#[test]
fn full_evicts_and_the_evicted_goes_cold_when_the_cache_is_too_small() {
    let mut c = cluster(
        &(node("a", 1, "10GB")
            + r#"
        [models.old]
        size = "25GB"
        [models.new]
        size = "30GB"
        "#),
    );
    hot(&mut c, "old", 1, "a", &[0]);
    let before = c.snapshot();
    let out = c.deploy(&[req("new", 1)], 2 * HOUR, &mut rng());
    assert_eq!(out.models[0].replicas[0].level, CandidateLevel::Full);
    assert_eq!((out.evictions[0].from, out.evictions[0].to), (Level::Hot, Level::Cold));
    assert!(c.deployment(&rid(1)).is_none());
    let delta = assert_delta_round_trips(&before, &c.snapshot());
    assert_eq!((delta.delete.len(), delta.create.len()), (1, 1));
    let order: Vec<Action> = delta.steps().map(|s| s.action).collect();
    assert_eq!(order, vec![Action::Delete, Action::Create]);
}

#[test]
fn warm_cache_drops_smallest_first_only_when_that_covers_the_shortfall() {
    let text = &(node("a", 1, "100GB")
        + r#"
        [models.w10]
        size = "10GB"
        [models.w20]
        size = "20GB"
        [models.w30]
        size = "30GB"
        [models.h70]
        size = "70GB"
        [models.h90]
        size = "79GB"
    "#);
    let mut c = cluster(text);
    warm(&mut c, "w10", 1, "a");
    warm(&mut c, "w20", 2, "a");
    warm(&mut c, "w30", 3, "a");
    hot(&mut c, "h70", 4, "a", &[0]);
    // 60 GB cached + 70 GB = 130 GB: 30 GB short; dropping 10 then 20 covers it.
    let ev = c.evict_replica(&key("h70"), &rid(4)).unwrap();
    let got: Vec<(u128, Level, Level)> = ev.iter().map(|e| (e.replica_id.as_u128(), e.from, e.to)).collect();
    assert_eq!(
        got,
        vec![(4, Level::Hot, Level::Warm), (1, Level::Warm, Level::Cold), (2, Level::Warm, Level::Cold)]
    );
    assert_eq!(ev[1].cause, EvictionCause::CacheRoom { replica_id: rid(4) });
    let a = c.node(&"a".parse().unwrap()).unwrap();
    assert_eq!(a.cache_used(), 100 * GB);
    c.check_invariants().unwrap();

    // A model larger than the whole budget goes cold and drops nothing.
    let mut c = cluster(&text.replace("100GB", "60GB"));
    warm(&mut c, "w10", 1, "a");
    hot(&mut c, "h70", 4, "a", &[0]);
    let ev = c.evict_replica(&key("h70"), &rid(4)).unwrap();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].to, Level::Cold);
    assert!(c.deployment(&rid(1)).is_some());
}

/// A replica whose engine cannot sleep is stopped when evicted: placement
/// sends it COLD at once and keeps the warm cache as it was, rather than
/// dropping another model's WARM replica to make room for one that would
/// never use it.
#[test]
fn a_model_that_cannot_sleep_goes_cold_and_drops_no_warm_entry() {
    let text = &(node("a", 1, "100GB")
        + r#"
        [models.w]
        size = "60GB"
        [models.s]
        size = "50GB"
    "#);
    let mut c = cluster(text);
    assert!(c.sleeps(&key("s")), "a model sleeps until told otherwise");
    warm(&mut c, "w", 1, "a");
    hot(&mut c, "s", 2, "a", &[0]);
    // Able to sleep, `s` would take the cache and push `w` out.
    let ev = c.clone().evict_replica(&key("s"), &rid(2)).unwrap();
    assert_eq!(
        ev.iter().map(|e| (e.replica_id, e.to)).collect::<Vec<_>>(),
        [(rid(2), Level::Warm), (rid(1), Level::Cold)]
    );

    c.set_sleeps(&key("s"), false).unwrap();
    assert!(!c.sleeps(&key("s")));
    let ev = c.evict_replica(&key("s"), &rid(2)).unwrap();
    assert_eq!(
        ev.iter().map(|e| (e.replica_id, e.from, e.to)).collect::<Vec<_>>(),
        [(rid(2), Level::Hot, Level::Cold)]
    );
    assert_eq!(c.deployment(&rid(1)).map(|d| d.level), Some(Level::Warm), "w stays WARM");
    assert!(c.deployment(&rid(2)).is_none());
    c.check_invariants().unwrap();

    // Pressure alike: `w` woken evicts nothing here, but a fresh `s` then
    // pushed off by a dedicated `w` goes COLD.
    let s = c.deploy(&[req("s", 1)], 0, &mut rng()).models[0].replicas[0].replica_id.unwrap();
    let out = c.deploy(&[dedicated("w", 1)], 0, &mut rng());
    assert_eq!(out.models[0].replicas[0].level, CandidateLevel::CachedAndFull);
    let evicted: Vec<_> = out.evictions.iter().map(|e| (e.replica_id, e.to)).collect();
    assert_eq!(evicted, [(s, Level::Cold)]);
    c.check_invariants().unwrap();

    assert_eq!(
        c.set_sleeps(&key("nope"), false),
        Err(hangar_placement::SleepsError::UnknownModel(key("nope")))
    );
}

#[test]
fn multi_gpu_takes_exactly_the_gpus_it_needs() {
    let mut c = cluster(TWO_NODES);
    let out = c.deploy(&[req("big", 1), req("huge", 1)], 0, &mut rng());
    let huge = out.models.iter().find(|m| m.model_key == key("huge")).unwrap();
    assert_eq!(
        huge.replicas[0].reason,
        Some(Unplaceable::TooLarge { size_bytes: 161 * GB, gpus_needed: 3, most_gpus_on_a_node: 2 })
    );
    let big = out.models.iter().find(|m| m.model_key == key("big")).unwrap();
    assert_eq!(big.replicas[0].level, CandidateLevel::Free);
    assert_eq!(big.replicas[0].gpu_bytes_by_gpu.len(), 2, "160 GB on 80 GB GPUs needs exactly two");
    assert!(big.replicas[0].gpu_bytes_by_gpu.values().all(|&b| b == 80 * GB));
    let dep = c.deployment(big.replicas[0].replica_id.as_ref().unwrap()).unwrap();
    assert_eq!(dep.gpu_fraction, Some(1.0));
}

#[test]
fn largest_models_are_placed_first() {
    let mut c = cluster(
        &(node("a", 2, "0B")
            + r#"
        [models.big]
        size = "160GB"
        [models.mid]
        size = "20GB"
        "#),
    );
    // Listed small first; the big one still gets both GPUs.
    let out = c.deploy(&[req("mid", 1), req("big", 1)], 0, &mut rng());
    assert_eq!(out.models[0].model_key, key("big"));
    assert_eq!(out.models[0].replicas[0].level, CandidateLevel::Free);
    assert_eq!(out.models[1].replicas[0].level, CandidateLevel::CantAccommodate);
    // What the big one just took is not evicted by the same call.
    assert_eq!(out.models[1].replicas[0].reason, Some(Unplaceable::NoRoom));
}

#[test]
fn young_deployments_are_spared_unless_the_request_is_dedicated() {
    let mut c = cluster(TWO_NODES);
    for (id, node, gpu) in [(1, "a", 0), (2, "a", 1), (3, "b", 0), (4, "b", 1)] {
        hot(&mut c, "whole", id, node, &[gpu]);
    }
    let young = HOUR - 1;
    let out = c.deploy(&[req("mid", 1)], young, &mut rng());
    assert_eq!(out.models[0].replicas[0].reason, Some(Unplaceable::NoRoom));
    assert!(!out.changed);
    let out = c.deploy(&[dedicated("mid", 1)], young, &mut rng());
    assert_eq!(out.models[0].replicas[0].level, CandidateLevel::Full);
    let placed = c.deployment(out.models[0].replicas[0].replica_id.as_ref().unwrap()).unwrap();
    assert!(placed.dedicated);
}

#[test]
fn dedicated_replicas_are_never_evicted_by_pressure() {
    let mut c = cluster(TWO_NODES);
    for (id, node, gpu) in [(1, "a", 0), (2, "a", 1), (3, "b", 0), (4, "b", 1)] {
        hot(&mut c, "whole", id, node, &[gpu]);
    }
    c.deploy(&[dedicated("whole", 4)], 0, &mut rng());
    let out = c.deploy(&[dedicated("mid", 1)], 10 * HOUR, &mut rng());
    assert_eq!(out.models[0].replicas[0].reason, Some(Unplaceable::NoRoom));
    assert!(out.evictions.is_empty());
}

#[test]
fn schedules_dedicate_while_active_and_release_after() {
    let mut c = cluster(
        &(node("a", 2, "0B")
            + r#"
        [models.whole]
        size = "25GB"
        [models.big]
        size = "160GB"
        [models.mid]
        size = "20GB"
        "#),
    );
    let schedule =
        Schedule::new(vec![Window { model_key: key("whole"), replicas: 2, start_ms: 0, end_ms: 10 * HOUR }])
            .unwrap();
    let out = c.apply_schedule(&schedule, 0, &mut rng());
    assert_eq!(out.models[0].hot(), 2);
    assert!(c.replicas_of(&key("whole"), Level::Hot).iter().all(|d| d.dedicated));

    // Scheduled: even old enough, they are not evicted.
    let out = c.deploy(&[req("big", 1)], 5 * HOUR, &mut rng());
    assert_eq!(out.models[0].replicas[0].reason, Some(Unplaceable::NoRoom));
    let out = c.apply_schedule(&schedule, 5 * HOUR, &mut rng());
    assert!(!out.changed, "re-applying an unchanged schedule changes nothing");

    // The window is over: the flag goes, and pressure may evict them.
    let before = c.snapshot();
    let out = c.apply_schedule(&schedule, 10 * HOUR, &mut rng());
    assert!(out.changed && out.models.is_empty());
    assert!(c.replicas_of(&key("whole"), Level::Hot).iter().all(|d| !d.dedicated));
    let delta = assert_delta_round_trips(&before, &c.snapshot());
    assert_eq!(delta.update.len(), 2);
    let out = c.deploy(&[req("big", 1)], 10 * HOUR, &mut rng());
    assert_eq!(out.models[0].replicas[0].level, CandidateLevel::Full);
    assert_eq!(out.evictions.len(), 2);
    assert!(out.evictions.iter().all(|e| e.model_key == key("whole")));

    // An empty schedule frees every dedicated replica too.
    c.evict_model(&key("big"));
    c.deploy(&[dedicated("mid", 1)], 20 * HOUR, &mut rng());
    assert!(c.snapshot().deployments().values().any(|d| d.dedicated));
    c.apply_schedule(&Schedule::default(), 20 * HOUR, &mut rng());
    assert!(c.snapshot().deployments().values().all(|d| !d.dedicated));
}

#[test]
fn explicit_evictions_demote_one_replica_or_a_whole_model() {
    let mut c = cluster(TWO_NODES);
    let out = c.deploy(&[req("mid", 3)], 0, &mut rng());
    let ids: Vec<_> = out.models[0].replicas.iter().map(|r| r.replica_id.unwrap()).collect();
    let ev = c.evict_replica(&key("mid"), &ids[0]).unwrap();
    assert_eq!((ev[0].from, ev[0].to, &ev[0].cause), (Level::Hot, Level::Warm, &EvictionCause::Explicit));
    let ev = c.evict_replica(&key("mid"), &ids[0]).unwrap();
    assert_eq!((ev[0].from, ev[0].to), (Level::Warm, Level::Cold));
    assert_eq!(
        c.evict_replica(&key("mid"), &ids[0]),
        Err(EvictError::UnknownReplica { model: key("mid"), replica: ids[0] })
    );
    assert!(matches!(c.evict_replica(&key("small"), &ids[1]), Err(EvictError::WrongModel { .. })));
    let ev = c.evict_model(&key("mid"));
    assert_eq!(ev.len(), 2);
    assert!(c.replicas_of(&key("mid"), Level::Hot).is_empty());
    assert_eq!(c.replicas_of(&key("mid"), Level::Warm).len(), 2);
    assert!(c.evict_model(&key("mid")).is_empty());
    c.check_invariants().unwrap();
}

#[test]
fn unknown_models_are_reported_and_the_rest_of_the_batch_proceeds() {
    let mut c = cluster(TWO_NODES);
    let out = c.deploy(&[req("nope", 2), req("mid", 1)], 0, &mut rng());
    let nope = out.models.iter().find(|m| m.model_key == key("nope")).unwrap();
    assert_eq!(nope.replicas.len(), 2);
    assert!(nope.replicas.iter().all(|r| r.reason == Some(Unplaceable::UnknownModel)));
    assert_eq!(out.models.iter().find(|m| m.model_key == key("mid")).unwrap().hot(), 1);
}

#[test]
fn virtual_gpus_are_accounted_like_real_ones() {
    let mut c = cluster(
        r#"
        [[nodes]]
        id = "laptop"
        gpus = 2
        gpu_memory = "16GB"
        virtual_gpus = true
        [models.tiny]
        size = "1GB"
        [models.mid]
        size = "20GB"
        "#,
    );
    let laptop = c.node(&"laptop".parse().unwrap()).unwrap();
    assert!(laptop.gpus().iter().all(|g| g.kind == "virtual"));
    let out = c.deploy(&[req("tiny", 3), req("mid", 1)], 0, &mut rng());
    assert_eq!(out.models[0].replicas[0].gpu_bytes_by_gpu.len(), 2, "20 GB spans both 16 GB virtual GPUs");
    assert_eq!(out.models[1].hot(), 0);
    c.check_invariants().unwrap();
}

#[test]
fn the_same_seed_gives_the_same_placement() {
    let run = || {
        let mut c = cluster(TWO_NODES);
        c.deploy(&[req("small", 5), req("mid", 2)], 0, &mut rng());
        c.snapshot()
    };
    assert_eq!(run(), run());
}

#[test]
fn a_later_model_in_the_batch_never_evicts_what_an_earlier_one_counted() {
    let mut c = cluster(
        &(node("a", 1, "0B")
            + r#"
        [models.keep]
        size = "30GB"
        [models.small]
        size = "20GB"
        "#),
    );
    hot(&mut c, "keep", 1, "a", &[0]);
    // `keep` (larger) is handled first and counts its hot replica; `small`
    // must not then evict it, old as it is.
    let out = c.deploy(&[req("keep", 1), req("small", 1)], 10 * HOUR, &mut rng());
    assert_eq!(out.models[0].replicas[0].level, CandidateLevel::Deployed);
    assert_eq!(out.models[1].replicas[0].reason, Some(Unplaceable::NoRoom));
    assert!(out.evictions.is_empty());
    // Asked alone, `small` may evict it.
    let out = c.deploy(&[req("small", 1)], 10 * HOUR, &mut rng());
    assert_eq!(out.models[0].replicas[0].level, CandidateLevel::Full);
}
