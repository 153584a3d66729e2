//! Placement speed: place 100 new replicas in a cluster about half full,
//! at 100, 1,000 and 10,000 nodes of 8 × 80 GB GPUs, with 2,000 models of
//! 1–300 GB. Criterion reports time per batch of 100 and, through the
//! throughput setting, replicas per second; time per replica is the batch
//! time / 100. Target: ≤ 1 ms per replica at 1,000 nodes, linear or better
//! in nodes.
//!
//! A second group measures the worst case: a cluster filled until nothing
//! fits, where every placement runs the exact eviction search on every node.
//!
//! Run: `cargo bench -p hangar-placement --bench placement`.

// `criterion_group!` defines an undocumented public function.
#![allow(missing_docs)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use hangar_core::{ByteSize, ModelKey, ReplicaId};
use hangar_placement::{Cluster, ClusterConfig, Level, ModelSpec, NodeConfig, ReplicaRequest, Restore};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const GB: u64 = 1_000_000_000;
const MODELS: usize = 2_000;
const BATCH: usize = 100;
const HOUR: u64 = 3_600_000;

fn model(i: usize) -> ModelKey {
    format!("bench/model-{i:04}").parse().unwrap()
}

/// `nodes` × 8 × 80 GB, 2,000 models log-uniform in 1–300 GB, filled with
/// replicas of random models on random nodes until `fill` of all GPU memory
/// is reserved (or placements stop fitting).
fn cluster(nodes: usize, fill: f64, seed: u64) -> Cluster {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let config = ClusterConfig {
        nodes: (0..nodes)
            .map(|i| NodeConfig {
                id: format!("node-{i:05}").parse().unwrap(),
                gpus: 8,
                gpu_memory: Some(ByteSize::new(80 * GB)),
                gpu_kind: Some("H100".into()),
                virtual_gpus: false,
                cpu_cache: ByteSize::new(1_000 * GB),
            })
            .collect(),
        models: (0..MODELS)
            .map(|i| {
                let gb = 300f64.powf(rng.random::<f64>());
                (
                    model(i),
                    ModelSpec { size: Some(ByteSize::new((gb * GB as f64) as u64)), ..Default::default() },
                )
            })
            .collect(),
        ..Default::default()
    };
    let mut c = Cluster::new(config).unwrap();
    let total = nodes as u64 * 8 * 80 * GB;
    let target = (total as f64 * fill) as u64;
    let mut reserved = 0;
    let mut misses = 0;
    while reserved < target && misses < 20 * nodes {
        let m = model(rng.random_range(0..MODELS));
        let node = c.nodes()[rng.random_range(0..nodes)].id().clone();
        let restore = Restore {
            model_key: m,
            replica_id: ReplicaId::from_u128(rng.random()),
            node,
            level: Level::Hot,
            gpus: None,
            dedicated: false,
            deployed_at_ms: 0,
        };
        match c.restore(restore) {
            Ok(id) => {
                reserved += c.deployment(&id).unwrap().gpu_bytes();
                misses = 0;
            }
            Err(_) => misses += 1,
        }
    }
    c
}

/// 100 distinct random models, each asking for one more replica than it has.
fn requests(c: &Cluster, seed: u64) -> Vec<ReplicaRequest> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut picked = std::collections::BTreeSet::new();
    while picked.len() < BATCH {
        picked.insert(rng.random_range(0..MODELS));
    }
    picked
        .into_iter()
        .map(|i| {
            let key = model(i);
            let hot = c.replicas_of(&key, Level::Hot).len() as u32;
            ReplicaRequest { model_key: key, replicas: hot + 1, dedicated: false }
        })
        .collect()
}

fn bench_group(crit: &mut Criterion, name: &str, fill: f64, sizes: &[usize]) {
    let mut group = crit.benchmark_group(name);
    group.throughput(Throughput::Elements(BATCH as u64));
    for &nodes in sizes {
        let base = cluster(nodes, fill, 1);
        let reqs = requests(&base, 2);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let out = base.clone().deploy(&reqs, 2 * HOUR, &mut rng);
        let placed: usize = out.models.iter().map(|m| m.hot()).sum::<usize>();
        let hot_before: usize = reqs.iter().map(|r| r.replicas as usize - 1).sum();
        eprintln!(
            "{name}/{nodes}: {} replicas placed of {BATCH}, {} evictions",
            placed - hot_before,
            out.evictions.len()
        );
        if nodes >= 10_000 {
            group.sample_size(10).measurement_time(Duration::from_secs(20));
        } else {
            group.sample_size(20).measurement_time(Duration::from_secs(8));
        }
        group.bench_with_input(BenchmarkId::from_parameter(nodes), &nodes, |b, _| {
            b.iter_batched(
                || (base.clone(), ChaCha8Rng::seed_from_u64(3)),
                // Returning the cluster lets criterion drop it untimed.
                |(mut c, mut rng)| {
                    let out = c.deploy(&reqs, 2 * HOUR, &mut rng);
                    (c, out)
                },
                BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

fn place_half_full(crit: &mut Criterion) {
    bench_group(crit, "place_100_half_full", 0.5, &[100, 1_000, 10_000]);
}

fn place_full(crit: &mut Criterion) {
    bench_group(crit, "place_100_full_evicting", 1.0, &[100, 1_000, 10_000]);
}

criterion_group!(benches, place_half_full, place_full);
criterion_main!(benches);
