//! The processor with adapters: a lease for a request with an adapter is
//! handed out once its adapter is loaded on the lease's replica, the
//! slots' steps are carried out by the installed driver one at a time per
//! replica, failures and departures end the wait, and nothing is held
//! after a caller leaves. On a paused clock: the fake engine's loads take
//! simulated time.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use hangar_core::{AccountId, Adapter, AdapterRef, ByteSize, ReplicaId};
use hangar_queue::{AdmissionConfig, QueueAlgorithm};
use hangar_router::{AdapterConfig, ApproxKvConfig, ReplicaChooser, RouterPolicy, SlotStep};
use hangar_runtime::processor::{AdapterDriver, AdmitError, Processor, Wait};

fn acct() -> AccountId {
    "a".parse().unwrap()
}

fn adapter(name: &str) -> Adapter {
    Adapter::sized(format!("m:{name}").parse::<AdapterRef>().unwrap(), ByteSize::new(100))
}

/// A fake engine: what it was asked, in order, and what it holds; a load
/// takes `load` of (paused) time; loads of `fails` fail.
#[derive(Default)]
struct Engine {
    steps: Mutex<Vec<(ReplicaId, String)>>,
    held: Mutex<Vec<(ReplicaId, String)>>,
    in_flight: Mutex<u32>,
    fails: Option<String>,
}

fn driver(engine: &Arc<Engine>, load: Duration) -> AdapterDriver {
    let engine = engine.clone();
    Arc::new(move |replica, _slots, step| {
        let engine = engine.clone();
        Box::pin(async move {
            {
                let mut n = engine.in_flight.lock().unwrap();
                *n += 1;
                assert_eq!(*n, 1, "one step at a time");
            }
            let (name, load_it) = match &step {
                SlotStep::Load { adapter, .. } => (adapter.name().to_string(), true),
                SlotStep::Unload { adapter } => (adapter.name().to_string(), false),
            };
            engine
                .steps
                .lock()
                .unwrap()
                .push((replica, format!("{}{name}", if load_it { "+" } else { "-" })));
            if load_it {
                tokio::time::sleep(load).await;
            }
            *engine.in_flight.lock().unwrap() -= 1;
            if load_it && engine.fails.as_deref() == Some(&name) {
                return Err(format!("the engine could not read {name}"));
            }
            let mut held = engine.held.lock().unwrap();
            match load_it {
                true => held.push((replica, name)),
                false => held.retain(|h| h != &(replica, name.clone())),
            }
            Ok(())
        })
    })
}

fn processor(slots: u32, engine: &Arc<Engine>) -> Processor {
    let config = AdapterConfig { slots, ..AdapterConfig::default() };
    let chooser =
        ReplicaChooser::new(RouterPolicy::Adapter, &ApproxKvConfig::default(), 7).with_adapters(config);
    let p =
        Processor::new(AdmissionConfig { algorithm: QueueAlgorithm::Fifo, capacity: 10 }, Box::new(chooser));
    p.set_adapter_driver(driver(engine, Duration::from_millis(300)));
    p.replica_ready(ReplicaId::from_u128(1), 4);
    p
}

fn with(adapter: &Adapter) -> Wait<'_> {
    Wait { adapter: Some((adapter, 300.0)), timeout: Some(Duration::from_secs(10)), ..Wait::default() }
}

#[tokio::test(start_paused = true)]
async fn a_lease_waits_for_its_adapter_once_and_the_next_finds_it_loaded() {
    let engine = Arc::new(Engine::default());
    let p = processor(2, &engine);
    let a = adapter("acme/a");
    let start = tokio::time::Instant::now();
    let first = p.admit_with(acct(), with(&a)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(300), "the lease came when the load ended");
    assert_eq!(engine.held.lock().unwrap().len(), 1);
    let second = p.admit_with(acct(), with(&a)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(300), "no second load");
    assert_eq!(engine.steps.lock().unwrap().len(), 1);
    assert_eq!((first.replica, second.replica), (ReplicaId::from_u128(1), ReplicaId::from_u128(1)));
    // A request without an adapter runs at once, beside them.
    let plain = p.admit_with(acct(), Wait::default()).await.unwrap();
    drop((first, second, plain));
    assert_eq!(p.load().in_use, 0);
}

#[tokio::test(start_paused = true)]
async fn a_full_replica_unloads_its_least_recently_used_adapter_once_unused() {
    let engine = Arc::new(Engine::default());
    let p = processor(1, &engine);
    let (a, b) = (adapter("acme/a"), adapter("acme/b"));
    let holding_a = p.admit_with(acct(), with(&a)).await.unwrap();
    let p2 = p.clone();
    let b2 = b.clone();
    let waiting_b = tokio::spawn(async move { p2.admit_with(acct(), with(&b2)).await.map(|l| l.replica) });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!waiting_b.is_finished(), "b waits while a request still uses a's only slot");
    assert_eq!(engine.steps.lock().unwrap().len(), 1);
    drop(holding_a);
    assert_eq!(waiting_b.await.unwrap(), Ok(ReplicaId::from_u128(1)));
    let steps: Vec<String> = engine.steps.lock().unwrap().iter().map(|(_, s)| s.clone()).collect();
    assert_eq!(steps, ["+acme/a", "-acme/a", "+acme/b"]);
    assert_eq!(*engine.held.lock().unwrap(), [(ReplicaId::from_u128(1), "acme/b".to_owned())]);
}

#[tokio::test(start_paused = true)]
async fn a_failed_load_fails_its_requests_with_the_engines_reason_and_frees_their_permits() {
    let engine = Arc::new(Engine { fails: Some("acme/bad".into()), ..Engine::default() });
    let p = processor(2, &engine);
    let bad = adapter("acme/bad");
    let e = p.admit_with(acct(), with(&bad)).await.unwrap_err();
    let AdmitError::AdapterFailed { why, .. } = &e else { panic!("{e:?}") };
    assert!(why.contains("m:acme/bad") && why.contains("the engine could not read acme/bad"), "{why}");
    assert_eq!(p.load().in_use, 0, "the permit went back");
    // The replica still serves other adapters.
    let good = adapter("acme/good");
    p.admit_with(acct(), with(&good)).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_leaves_during_the_load_gives_its_permit_back_and_the_load_still_lands() {
    let engine = Arc::new(Engine::default());
    let p = processor(2, &engine);
    let a = adapter("acme/a");
    let left = tokio::time::timeout(Duration::from_millis(100), p.admit_with(acct(), with(&a))).await;
    assert!(left.is_err(), "the caller gave up mid-load");
    assert_eq!(p.load().in_use, 0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(engine.held.lock().unwrap().len(), 1, "the load went on");
    let start = tokio::time::Instant::now();
    p.admit_with(acct(), with(&a)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO, "the next request finds it loaded");
}

#[tokio::test(start_paused = true)]
async fn a_replica_that_leaves_during_the_load_tells_the_wait_to_ask_again_and_a_deadline_ends_it() {
    let engine = Arc::new(Engine::default());
    let p = processor(2, &engine);
    let a = adapter("acme/a");
    let p2 = p.clone();
    let a2 = a.clone();
    let waiting = tokio::spawn(async move { p2.admit_with(acct(), with(&a2)).await.map(drop) });
    tokio::time::sleep(Duration::from_millis(50)).await;
    p.replica_gone(ReplicaId::from_u128(1));
    let e = waiting.await.unwrap().unwrap_err();
    assert!(matches!(&e, AdmitError::AdapterReplicaLeft(why) if why.contains("left")), "{e:?}");

    // A load slower than the request's timeout ends in a timeout.
    let slow = Arc::new(Engine::default());
    let p = processor(2, &slow);
    let b = adapter("acme/b");
    let short = Wait { timeout: Some(Duration::from_millis(100)), ..with(&b) };
    assert_eq!(p.admit_with(acct(), short).await.unwrap_err(), AdmitError::Timeout);
    assert_eq!(p.load().in_use, 0);
}

#[tokio::test]
async fn an_adapter_without_a_driver_or_too_large_is_refused_before_it_queues() {
    let chooser = ReplicaChooser::new(RouterPolicy::Adapter, &ApproxKvConfig::default(), 7).with_adapters(
        AdapterConfig {
            memory: ByteSize::new(1000),
            default_size: ByteSize::new(10),
            ..AdapterConfig::default()
        },
    );
    let p =
        Processor::new(AdmissionConfig { algorithm: QueueAlgorithm::Fifo, capacity: 10 }, Box::new(chooser));
    p.replica_ready(ReplicaId::from_u128(1), 4);
    let a = adapter("acme/a");
    let e = p.admit_with(acct(), with(&a)).await.unwrap_err();
    assert!(matches!(&e, AdmitError::AdapterRefused(why) if why.contains("load no adapters")), "{e:?}");
    let engine = Arc::new(Engine::default());
    p.set_adapter_driver(driver(&engine, Duration::ZERO));
    let huge = Adapter::sized("m:acme/huge".parse().unwrap(), ByteSize::new(5000));
    let e = p.admit_with(acct(), with(&huge)).await.unwrap_err();
    assert!(matches!(&e, AdmitError::AdapterRefused(why) if why.contains("5000 bytes")), "{e:?}");
    assert_eq!(p.load().counters.arrivals, 2);
    assert_eq!(p.load().waiting, 0);
}
