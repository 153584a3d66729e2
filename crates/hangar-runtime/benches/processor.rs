//! What a request costs the processor: a permit taken at once and given
//! back, on a model of four ready replicas, with and without an instance
//! monitor on each replica (`hangar serve` keeps one on every replica it
//! runs; a fleet's gateway, none). The difference is what the instance
//! monitor adds to the request path: one hash lookup and a few additions
//! at the grant and at the release, under the lock both already take.
//!
//! Run: `cargo bench -p hangar-runtime --bench processor`.

// `criterion_group!` defines an undocumented public function.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, Criterion};
use futures::FutureExt;
use hangar_core::{AccountId, ReplicaId, ReplicaPhase};
use hangar_queue::{AdmissionConfig, FirstFree};
use hangar_runtime::processor::Processor;

fn admit_and_release(c: &mut Criterion) {
    // The processor's deadline timer is a task: it needs a runtime, which
    // the measured loop never waits on (a free permit is granted at once).
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let _inside = runtime.enter();
    let account: AccountId = "bench".parse().unwrap();
    let mut group = c.benchmark_group("processor");
    for monitored in [false, true] {
        let p = Processor::new(AdmissionConfig::default(), Box::new(FirstFree));
        for r in 0..4 {
            let replica = ReplicaId::from_u128(r);
            p.replica_ready(replica, 8);
            if monitored {
                p.replica_phase(replica, ReplicaPhase::Ready);
            }
        }
        let name = if monitored { "admit_release/monitored" } else { "admit_release/unmonitored" };
        group.bench_function(name, |b| {
            b.iter(|| {
                let lease = p.admit(account.clone(), None).now_or_never().expect("a free permit").unwrap();
                drop(lease);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, admit_and_release);
criterion_main!(benches);
