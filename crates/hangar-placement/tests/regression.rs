//! One test per defect of the reference implementation (NDIF) that this
//! crate must not repeat, named after the defect.

mod common;

use common::*;
use hangar_placement::{CandidateLevel, EvictionCost, Level, Unplaceable};

/// Reference: when no GPU had room for the fractional share, the multi-GPU
/// path counted GPUs that were merely "available" (≥ 30 % free), reported
/// FREE, and the reservation then raised an uncaught error.
#[test]
fn failed_fractional_search_is_not_reported_free() {
    let text = &(node("a", 2, "0B")
        + r#"
        [models.tenant]
        size = "13333333334"   # share 40 GB: each GPU keeps 40 GB (50 %) free
        [models.mid]
        size = "20GB"          # share 60 GB: fits no GPU as is
    "#);
    let mut c = cluster(text);
    hot(&mut c, "tenant", 1, "a", &[0]);
    hot(&mut c, "tenant", 2, "a", &[1]);
    // Tenants too young to evict: CANT_ACCOMMODATE with a reason, no panic.
    let out = c.deploy(&[req("mid", 1)], HOUR / 2, &mut rng());
    let r = &out.models[0].replicas[0];
    assert_eq!((r.level, r.reason.clone()), (CandidateLevel::CantAccommodate, Some(Unplaceable::NoRoom)));
    assert!(!out.changed);
    c.check_invariants().unwrap();
    // Old enough: FULL, evicting exactly one tenant, and the reservation holds.
    let out = c.deploy(&[req("mid", 1)], 2 * HOUR, &mut rng());
    let r = &out.models[0].replicas[0];
    assert_eq!(r.level, CandidateLevel::Full);
    assert_eq!(r.eviction_cost.count, 1);
    assert_eq!(r.gpu_bytes_by_gpu.values().copied().collect::<Vec<_>>(), vec![60 * GB]);
    c.check_invariants().unwrap();
}

/// Reference: a whole-GPU claim ignored a fractional tenant already on the
/// GPU, so after both were released the GPU showed more free memory than it
/// has.
#[test]
fn whole_gpu_claim_never_shares_a_gpu_with_a_fractional_tenant() {
    let text = &(node("a", 2, "0B")
        + r#"
        [models.small]
        size = "10GB"          # share 30 GB
        [models.whole]
        size = "25GB"          # 75 GB ≥ 64 GB: the whole GPU
    "#);
    // An empty GPU is taken rather than the one with a tenant.
    let mut c = cluster(text);
    hot(&mut c, "small", 1, "a", &[0]);
    let out = c.deploy(&[req("whole", 1)], 0, &mut rng());
    let r = &out.models[0].replicas[0];
    assert_eq!(r.level, CandidateLevel::Free);
    assert_eq!(r.gpu_bytes_by_gpu.keys().copied().collect::<Vec<_>>(), vec![1]);

    // With no empty GPU, the tenant is evicted, not shared with.
    let mut c = cluster(text);
    hot(&mut c, "small", 1, "a", &[0]);
    hot(&mut c, "small", 2, "a", &[1]);
    let out = c.deploy(&[req("whole", 1)], 2 * HOUR, &mut rng());
    let r = &out.models[0].replicas[0];
    assert_eq!(r.level, CandidateLevel::Full);
    assert_eq!(out.evictions.len(), 1);
    let gpu = *r.gpu_bytes_by_gpu.keys().next().unwrap();
    assert_eq!(r.gpu_bytes_by_gpu[&gpu], 80 * GB);
    let a = c.node(&"a".parse().unwrap()).unwrap();
    assert_eq!((a.gpus()[gpu as usize].free_bytes, a.gpus()[gpu as usize].tenants), (0, 1));
    // Release everything: every GPU is back to exactly its total.
    for m in ["whole", "small"] {
        c.evict_model(&key(m));
    }
    let a = c.node(&"a".parse().unwrap()).unwrap();
    assert!(a.gpus().iter().all(|g| g.free_bytes == g.total_bytes && g.tenants == 0));
    c.check_invariants().unwrap();
}

/// Reference: evictions were chosen greedily smallest-first, evicting two
/// deployments where one larger one frees enough for fewer bytes.
#[test]
fn one_larger_eviction_beats_two_smaller_greedy_ones() {
    let text = &(node("a", 1, "0B")
        + r#"
        [models.s15]
        size = "5GB"           # share 15 GB
        [models.s18]
        size = "6GB"           # share 18 GB
        [models.s30]
        size = "10GB"          # share 30 GB
        [models.new]
        size = "15GB"          # share 45 GB; 17 GB free, so 28 GB more needed
    "#);
    let mut c = cluster(text);
    hot(&mut c, "s15", 1, "a", &[0]);
    hot(&mut c, "s18", 2, "a", &[0]);
    hot(&mut c, "s30", 3, "a", &[0]);
    let out = c.deploy(&[req("new", 1)], 2 * HOUR, &mut rng());
    // Greedy would evict s15 + s18 (33 GB, two replicas).
    assert_eq!(out.evictions.len(), 1);
    assert_eq!(out.evictions[0].replica_id, rid(3));
    assert_eq!(
        out.models[0].replicas[0].eviction_cost,
        EvictionCost { non_hotswap: true, bytes: 30 * GB, count: 1 }
    );
    c.check_invariants().unwrap();
}

/// Reference: a warm replica's id was placed as a new replica on another
/// node while its warm copy still existed, giving two actors one name.
#[test]
fn warm_replica_id_is_never_created_on_another_node() {
    let text = &(node("a", 1, "100GB")
        + r#"
        [[nodes]]
        id = "b"
        gpus = 1
        gpu_memory = "80GB"
        [models.blocker]
        size = "25GB"
        [models.m]
        size = "20GB"
    "#);
    let mut c = cluster(text);
    // a is held by a young blocker, so the warm copy there cannot be promoted.
    c.deploy(&[req("blocker", 1)], 0, &mut rng());
    let blocker = c.replicas_of(&key("blocker"), Level::Hot)[0].node.clone();
    assert_eq!(blocker.as_str(), "a", "b has no cache, so seed the blocker on a");
    warm(&mut c, "m", 77, "a");
    let before = c.snapshot();
    let out = c.deploy(&[req("m", 1)], 1, &mut rng());
    let r = &out.models[0].replicas[0];
    assert_eq!((r.level, r.node.as_ref().unwrap().as_str()), (CandidateLevel::Free, "b"));
    assert_ne!(r.replica_id, Some(rid(77)), "a fresh id, not the warm one");
    let warm_copy = c.deployment(&rid(77)).unwrap();
    assert_eq!((warm_copy.level, warm_copy.node.as_str()), (Level::Warm, "a"));
    let delta = assert_delta_round_trips(&before, &c.snapshot());
    assert!(delta.create.iter().all(|d| d.replica_id != rid(77)));
    c.check_invariants().unwrap();
}

/// Reference: an empty cluster, or one whose nodes have no GPUs, crashed
/// the evaluation instead of answering CANT_ACCOMMODATE.
#[test]
fn clusters_without_nodes_or_gpus_cant_accommodate_with_a_reason() {
    let models = "[models.m]\nsize = \"1GB\"\n";
    let mut empty = cluster(models);
    let out = empty.deploy(&[req("m", 2)], 0, &mut rng());
    assert_eq!(out.models[0].replicas.len(), 2);
    assert!(out.models[0].replicas.iter().all(|r| r.reason == Some(Unplaceable::NoNodes)));

    let mut cpu_only = cluster(&format!("[[nodes]]\nid = \"cpu\"\ncpu_cache = \"64GB\"\n{models}"));
    let out = cpu_only.deploy(&[req("m", 1)], 0, &mut rng());
    assert_eq!(out.models[0].replicas[0].reason, Some(Unplaceable::NoGpus));
    assert!(!out.changed);
    assert!(cpu_only.evict_model(&key("m")).is_empty());
    cpu_only.check_invariants().unwrap();
}
