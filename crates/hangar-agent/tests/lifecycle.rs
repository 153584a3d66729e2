//! The replica lifecycle, machine and driver together, against a model of
//! the world: random sequences of what placement wants (HOT on random
//! GPUs, WARM, gone), requests, engine crashes and hangs, refused sleeps,
//! failed starts and wakes, and slow engine calls, on a paused clock with fake
//! engines. After every step the invariants that faults used to tear are
//! checked:
//!
//! - a replica with permits has a live engine that is awake, on exactly
//!   the GPUs placement wants it on (a crashed one keeps them only until
//!   its health check finds it);
//! - engines never over-commit a GPU: the bytes of live engines that hold
//!   GPU memory (awake, or starting or waking on it — hung ones too) fit
//!   every GPU;
//! - no request is cut except by a crash or a hang (a replica leaving
//!   service drains first).
//!
//! And once everything settles: every engine is a replica placement
//! wants (no ghosts), HOT ones awake on their GPUs and serving, WARM ones
//! asleep or stopped, and no hung engine runs, awake or asleep.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use hangar_agent::capabilities::{Capabilities, SleepApi};
use hangar_agent::lifecycle::{
    spawn, DriverHandle, Engines, Fact, Health, Sink, SleepAnswer, Slot, StartError, StartReport, Started,
    Tier, Wanted,
};
use hangar_core::{ModelKey, ReplicaId};
use proptest::prelude::*;
use tokio_util::sync::CancellationToken;

const NODE: &str = "n0";
const GPUS: usize = 4;
const GPU_BYTES: u64 = 80;
const REPLICAS: usize = 5;
/// The longest a hung engine may run on: the slowest start it may hang in
/// (5 s), three failed health checks 1 s apart, the slowest kill (2 s),
/// and a second's slack for the checks' phase.
const HUNG_KILLED_WITHIN: Duration = Duration::from_secs(11);

/// One fake engine process.
#[derive(Debug, Clone)]
struct Proc {
    replica: ReplicaId,
    gpus: BTreeMap<u32, u64>,
    alive: bool,
    awake: bool,
    /// Alive but answering nothing (wedged on its GPU): it keeps its GPU
    /// memory until killed.
    hung: bool,
    /// When it hung.
    hung_at: Option<Instant>,
    /// Requests running on it.
    in_flight: u32,
}

/// What is really running, and the faults armed for the next calls.
#[derive(Debug, Default)]
struct World {
    procs: Vec<Proc>,
    /// Per replica: the next start fails / the next sleep is refused / the
    /// next wake fails.
    fail_start: BTreeSet<ReplicaId>,
    refuse_sleep: BTreeSet<ReplicaId>,
    fail_wake: BTreeSet<ReplicaId>,
    /// Replicas whose engines cannot sleep at all (llama.cpp-like).
    sleepless: BTreeSet<ReplicaId>,
    /// How long each kind of call takes now, ms.
    delay: Delays,
    /// Requests cut by a stop (not by a crash).
    cut: u32,
    /// Permits per replica, as the sink was told.
    serving: BTreeSet<ReplicaId>,
    facts: Vec<Fact>,
    violations: Vec<String>,
}

#[derive(Debug, Clone, Copy)]
struct Delays {
    start: u64,
    sleep: u64,
    wake: u64,
    stop: u64,
}

impl Default for Delays {
    fn default() -> Self {
        Delays { start: 300, sleep: 50, wake: 100, stop: 50 }
    }
}

type Shared = Arc<Mutex<World>>;

struct FakeEngines(Shared);

/// A fake engine handle: an index into the world's processes.
struct FakeEngine(usize);

impl Engines for FakeEngines {
    type Engine = FakeEngine;

    async fn start(
        &self,
        replica: ReplicaId,
        _model: &ModelKey,
        slot: &Slot,
        abandon: CancellationToken,
    ) -> Result<Started<FakeEngine>, StartError> {
        let (delay, fail) = {
            let mut w = self.0.lock().unwrap();
            (w.delay.start, w.fail_start.remove(&replica))
        };
        // The process exists (and holds its GPUs) from the start on.
        let index = {
            let mut w = self.0.lock().unwrap();
            let gpus = slot.gpus.clone();
            w.procs.push(Proc {
                replica,
                gpus,
                alive: true,
                awake: true,
                hung: false,
                hung_at: None,
                in_flight: 0,
            });
            w.procs.len() - 1
        };
        tokio::select! {
            () = abandon.cancelled() => {
                self.0.lock().unwrap().procs[index].alive = false;
                return Err(StartError::Abandoned);
            }
            () = tokio::time::sleep(Duration::from_millis(delay)) => {}
        }
        if fail {
            self.0.lock().unwrap().procs[index].alive = false;
            return Err(StartError::Failed("the fake engine was told to fail".into()));
        }
        let sleeps = !self.0.lock().unwrap().sleepless.contains(&replica);
        let capabilities =
            Capabilities { sleep: sleeps.then_some(SleepApi::Vllm), ..Capabilities::default() };
        Ok(Started {
            engine: FakeEngine(index),
            url: format!("http://fake/{index}"),
            pid: Some(index as u32),
            capabilities,
            report: StartReport::default(),
        })
    }

    async fn sleep(&self, engine: &FakeEngine) -> SleepAnswer {
        let delay = self.0.lock().unwrap().delay.sleep;
        tokio::time::sleep(Duration::from_millis(delay)).await;
        if let Some(why) = self.unanswered(engine).await {
            return SleepAnswer::Refused(why);
        }
        let mut w = self.0.lock().unwrap();
        let replica = w.procs[engine.0].replica;
        let (alive, hung) = (w.procs[engine.0].alive, w.procs[engine.0].hung);
        if w.refuse_sleep.remove(&replica) || w.sleepless.contains(&replica) || !alive || hung {
            return SleepAnswer::Refused("the fake engine refused".into());
        }
        if w.procs[engine.0].in_flight > 0 {
            return SleepAnswer::Busy;
        }
        w.procs[engine.0].awake = false;
        SleepAnswer::Slept
    }

    async fn wake(&self, engine: &FakeEngine) -> Result<(), String> {
        let delay = self.0.lock().unwrap().delay.wake;
        tokio::time::sleep(Duration::from_millis(delay)).await;
        if let Some(why) = self.unanswered(engine).await {
            return Err(why);
        }
        let mut w = self.0.lock().unwrap();
        let replica = w.procs[engine.0].replica;
        if w.fail_wake.remove(&replica) || !w.procs[engine.0].alive || w.procs[engine.0].hung {
            return Err("the fake engine did not wake".into());
        }
        w.procs[engine.0].awake = true;
        Ok(())
    }

    async fn stop(&self, _replica: ReplicaId, engine: Arc<FakeEngine>) {
        self.end(engine).await;
    }

    async fn kill(&self, _replica: ReplicaId, engine: Arc<FakeEngine>) {
        self.end(engine).await;
    }

    async fn busy(&self, engine: &FakeEngine) -> Option<u32> {
        let w = self.0.lock().unwrap();
        let p = &w.procs[engine.0];
        (p.alive && !p.hung).then_some(p.in_flight)
    }

    /// As the real one: an awake engine's health route, an asleep one's
    /// state route — a hung engine answers neither.
    async fn check(&self, engine: &FakeEngine, _awake: bool) -> Health {
        let p = &self.0.lock().unwrap().procs[engine.0];
        match (p.alive, p.hung) {
            (false, _) => Health::Exited,
            (true, true) => Health::NoAnswer,
            (true, false) => Health::Ok,
        }
    }
}

impl FakeEngines {
    /// A call to a hung engine, as a real one goes: no answer until its
    /// process is killed (the connection then breaks) or the call's 120 s
    /// pass. `None` for an engine that answers.
    async fn unanswered(&self, engine: &FakeEngine) -> Option<String> {
        let began = Instant::now();
        loop {
            let (alive, hung) = {
                let p = &self.0.lock().unwrap().procs[engine.0];
                (p.alive, p.hung)
            };
            if !hung {
                return None;
            }
            if !alive {
                return Some("the connection broke".into());
            }
            if began.elapsed() >= Duration::from_secs(120) {
                return Some("it did not answer in time".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A stop or a kill, after the stop delay: the process is gone. Requests
    /// still on an engine that answered are counted cut; a hung engine's
    /// were lost to the hang.
    async fn end(&self, engine: Arc<FakeEngine>) {
        let delay = self.0.lock().unwrap().delay.stop;
        tokio::time::sleep(Duration::from_millis(delay)).await;
        let mut w = self.0.lock().unwrap();
        let p = &mut w.procs[engine.0];
        let cut = if p.alive && !p.hung { p.in_flight } else { 0 };
        p.alive = false;
        p.in_flight = 0;
        w.cut += cut;
    }
}

struct FakeSink(Shared);

impl Sink for FakeSink {
    fn serve(&self, replica: ReplicaId, _model: &ModelKey, url: &str) {
        let mut w = self.0.lock().unwrap();
        let index: usize = url.rsplit('/').next().unwrap().parse().unwrap();
        let p = &w.procs[index];
        if !p.awake || p.replica != replica {
            let why = format!("{replica} served by engine {index} that is not awake ({p:?})");
            w.violations.push(why);
        }
        w.serving.insert(replica);
    }

    fn unserve(&self, replica: ReplicaId, _model: &ModelKey) {
        self.0.lock().unwrap().serving.remove(&replica);
    }

    fn fact(&self, fact: Fact) {
        self.0.lock().unwrap().facts.push(fact);
    }

    fn in_flight(&self, replica: ReplicaId, _model: &ModelKey) -> u32 {
        let w = self.0.lock().unwrap();
        w.procs.iter().filter(|p| p.replica == replica && p.alive).map(|p| p.in_flight).sum()
    }

    fn changed(&self, _replica: ReplicaId, _now: Option<&hangar_agent::lifecycle::NodeReplica>) {}
}

/// One step of a sequence.
#[derive(Debug, Clone)]
enum Op {
    /// Placement wants replica `r` HOT on the GPUs of `mask` (each GPU
    /// `bytes`, a share when below the GPU's memory); skipped if that
    /// over-commits what placement already wants there.
    Hot {
        r: usize,
        mask: u8,
        bytes: u64,
    },
    /// Placement wants `r` WARM (evicted to the warm cache).
    Warm {
        r: usize,
    },
    /// Placement no longer wants `r`.
    Gone {
        r: usize,
    },
    /// A request of `ms` on `r`, if it serves.
    Request {
        r: usize,
        ms: u64,
    },
    /// `r`'s engine process dies.
    Crash {
        r: usize,
    },
    /// `r`'s engine process hangs: alive, holding its GPUs, answering
    /// nothing.
    Hang {
        r: usize,
    },
    /// `r`'s next sleep is refused; next start fails; next wake fails.
    RefuseSleep {
        r: usize,
    },
    FailStart {
        r: usize,
    },
    FailWake {
        r: usize,
    },
    /// Engine calls get slower or faster.
    Delays {
        start: u64,
        sleep: u64,
        wake: u64,
        stop: u64,
    },
    /// Time passes.
    Wait {
        ms: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let r = 0..REPLICAS;
    prop_oneof![
        4 => (r.clone(), 1u8..16, prop_oneof![Just(GPU_BYTES), Just(40u64), Just(30u64)])
            .prop_map(|(r, mask, bytes)| Op::Hot { r, mask, bytes }),
        3 => r.clone().prop_map(|r| Op::Warm { r }),
        2 => r.clone().prop_map(|r| Op::Gone { r }),
        4 => (r.clone(), 10u64..3_000).prop_map(|(r, ms)| Op::Request { r, ms }),
        1 => r.clone().prop_map(|r| Op::Crash { r }),
        1 => r.clone().prop_map(|r| Op::Hang { r }),
        1 => r.clone().prop_map(|r| Op::RefuseSleep { r }),
        1 => r.clone().prop_map(|r| Op::FailStart { r }),
        1 => r.clone().prop_map(|r| Op::FailWake { r }),
        1 => (0u64..5_000, 0u64..2_000, 0u64..3_000, 0u64..2_000)
            .prop_map(|(start, sleep, wake, stop)| Op::Delays { start, sleep, wake, stop }),
        4 => prop_oneof![0u64..50, 50u64..1_000, 1_000u64..20_000].prop_map(|ms| Op::Wait { ms }),
    ]
}

fn id(r: usize) -> ReplicaId {
    ReplicaId::from_u128(0x100 + r as u128)
}

fn model() -> ModelKey {
    "t/m".parse().unwrap()
}

/// What placement wants now, replica by replica.
type Desired = BTreeMap<usize, Tier>;

fn bytes_wanted(desired: &Desired, skip: usize) -> [u64; GPUS] {
    let mut used = [0; GPUS];
    for (r, t) in desired {
        if let (Tier::Hot(slot), true) = (t, *r != skip) {
            for (g, b) in &slot.gpus {
                used[*g as usize] += b;
            }
        }
    }
    used
}

fn wanted(desired: &Desired) -> Vec<Wanted> {
    desired.iter().map(|(r, t)| Wanted { replica: id(*r), model: model(), tier: t.clone() }).collect()
}

/// The invariants that must hold at every moment.
fn check_always(world: &World, desired: &Desired) -> Result<(), String> {
    if let Some(v) = world.violations.first() {
        return Err(v.clone());
    }
    for r in &world.serving {
        let index = (0..REPLICAS).find(|i| id(*i) == *r).unwrap();
        let Some(Tier::Hot(slot)) = desired.get(&index) else {
            return Err(format!("replica {index} has permits but placement wants {:?}", desired.get(&index)));
        };
        let live: Vec<&Proc> = world.procs.iter().filter(|p| p.replica == *r && p.alive).collect();
        // A crashed engine keeps its permits until its health check; a
        // live one must be the one, awake, on the wanted GPUs.
        match live.as_slice() {
            [] => {}
            [p] if p.awake && p.gpus == slot.gpus => {}
            _ => {
                return Err(format!(
                    "replica {index} has permits but its engines are {live:?}, wanted {slot:?}"
                ))
            }
        }
    }
    let mut held = [0u64; GPUS];
    for p in world.procs.iter().filter(|p| p.alive && p.awake) {
        for (g, b) in &p.gpus {
            held[*g as usize] += b;
        }
    }
    if let Some(g) = (0..GPUS).find(|g| held[*g] > GPU_BYTES) {
        return Err(format!("GPU {g} over-committed: {} of {GPU_BYTES} bytes by {:?}", held[g], world.procs));
    }
    if world.cut > 0 {
        return Err(format!("{} requests cut by a stop", world.cut));
    }
    let late =
        world.procs.iter().find(|p| p.alive && p.hung_at.is_some_and(|t| t.elapsed() > HUNG_KILLED_WITHIN));
    if let Some(p) = late {
        return Err(format!("a hung engine still runs {HUNG_KILLED_WITHIN:?} after it hung: {p:?}"));
    }
    Ok(())
}

/// The invariants once everything has settled.
fn check_settled(world: &World, desired: &Desired, driver: &DriverHandle) -> Result<(), String> {
    check_always(world, desired)?;
    for (r, tier) in desired {
        let live: Vec<&Proc> = world.procs.iter().filter(|p| p.replica == id(*r) && p.alive).collect();
        let sleepless = world.sleepless.contains(&id(*r));
        match tier {
            Tier::Hot(slot) => match live.as_slice() {
                [p] if p.awake && p.gpus == slot.gpus && world.serving.contains(&id(*r)) => {}
                // A replica whose start keeps failing waits out its back-off.
                [] if driver.replica(id(*r)).is_some_and(|n| n.failure().is_some()) => {}
                _ => {
                    return Err(format!("HOT replica {r} settled as {live:?}: {:?}", driver.replica(id(*r))))
                }
            },
            Tier::Warm => match live.as_slice() {
                [] => {}
                [p] if !p.awake && !sleepless => {}
                _ => return Err(format!("WARM replica {r} settled as {live:?}")),
            },
        }
    }
    if let Some(p) = world.procs.iter().find(|p| p.alive && p.hung) {
        return Err(format!("a hung engine was left running: {p:?}"));
    }
    let ghosts: Vec<&Proc> =
        world.procs.iter().filter(|p| p.alive && !desired.keys().any(|r| id(*r) == p.replica)).collect();
    if !ghosts.is_empty() {
        return Err(format!("ghost engines: {ghosts:?}"));
    }
    Ok(())
}

/// Runs one sequence; the first broken invariant, if any.
async fn run(ops: Vec<Op>, sleepless: BTreeSet<usize>) -> Result<(), String> {
    let world: Shared = Arc::default();
    world.lock().unwrap().sleepless = sleepless.into_iter().map(id).collect();
    let nodes = BTreeMap::from([(NODE.to_owned(), vec![GPU_BYTES; GPUS])]);
    let driver = spawn(nodes, Arc::new(FakeEngines(world.clone())), Arc::new(FakeSink(world.clone())));
    let mut desired = Desired::new();
    let settle = |ms| tokio::time::sleep(Duration::from_millis(ms));
    for op in ops {
        match op {
            Op::Hot { r, mask, bytes } => {
                let used = bytes_wanted(&desired, r);
                let gpus: BTreeMap<u32, u64> =
                    (0..GPUS as u32).filter(|g| mask & (1 << g) != 0).map(|g| (g, bytes)).collect();
                if gpus.iter().all(|(g, b)| used[*g as usize] + b <= GPU_BYTES) {
                    let fraction = (bytes < GPU_BYTES).then(|| bytes as f64 / GPU_BYTES as f64);
                    desired.insert(r, Tier::Hot(Slot { gpus, fraction }));
                }
            }
            Op::Warm { r } => {
                desired.insert(r, Tier::Warm);
            }
            Op::Gone { r } => {
                desired.remove(&r);
            }
            Op::Request { r, ms } => {
                let mut w = world.lock().unwrap();
                if w.serving.contains(&id(r)) {
                    let index = w.procs.iter().rposition(|p| p.replica == id(r) && p.alive);
                    if let Some(index) = index {
                        if !w.procs[index].awake {
                            return Err(format!("a request for replica {r} found its engine asleep"));
                        }
                        w.procs[index].in_flight += 1;
                        let world = world.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_millis(ms)).await;
                            let p = &mut world.lock().unwrap().procs[index];
                            p.in_flight = p.in_flight.saturating_sub(1);
                        });
                    }
                }
            }
            Op::Crash { r } => {
                let mut w = world.lock().unwrap();
                for p in w.procs.iter_mut().filter(|p| p.replica == id(r)) {
                    p.alive = false;
                    p.in_flight = 0;
                }
            }
            Op::Hang { r } => {
                let mut w = world.lock().unwrap();
                for p in w.procs.iter_mut().filter(|p| p.replica == id(r) && p.alive && !p.hung) {
                    p.hung = true;
                    p.hung_at = Some(Instant::now());
                }
            }
            Op::RefuseSleep { r } => drop(world.lock().unwrap().refuse_sleep.insert(id(r))),
            Op::FailStart { r } => drop(world.lock().unwrap().fail_start.insert(id(r))),
            Op::FailWake { r } => drop(world.lock().unwrap().fail_wake.insert(id(r))),
            Op::Delays { start, sleep, wake, stop } => {
                world.lock().unwrap().delay = Delays { start, sleep, wake, stop }
            }
            Op::Wait { ms } => settle(ms).await,
        }
        if matches!(op, Op::Hot { .. } | Op::Warm { .. } | Op::Gone { .. }) {
            driver.set_desired(NODE, wanted(&desired)).map_err(|e| e.to_string())?;
        }
        settle(1).await;
        check_always(&world.lock().unwrap(), &desired)?;
    }
    // Settle: no more faults; long enough for any drain (requests last at
    // most 3 s), back-off (60 s at most) and slow call to finish.
    {
        let mut w = world.lock().unwrap();
        w.fail_start.clear();
        w.fail_wake.clear();
        w.refuse_sleep.clear();
    }
    for _ in 0..20 {
        settle(10_000).await;
        check_always(&world.lock().unwrap(), &desired)?;
    }
    check_settled(&world.lock().unwrap(), &desired, &driver)?;
    driver.shutdown().await;
    let w = world.lock().unwrap();
    if let Some(p) = w.procs.iter().find(|p| p.alive) {
        return Err(format!("an engine survived the driver's shutdown: {p:?}"));
    }
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn faults_never_tear_the_lifecycle(
        ops in proptest::collection::vec(op(), 1..60),
        sleepless in proptest::collection::btree_set(0..REPLICAS, 0..2),
    ) {
        let result = runtime().block_on(run(ops, sleepless));
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }
}

/// The races the issue found, each as a fixed sequence.
#[test]
fn an_evict_racing_a_wake_never_serves_from_a_sleeping_engine() {
    let hot = |r| Op::Hot { r, mask: 0b1, bytes: GPU_BYTES };
    let seqs = [
        // Evicted while it wakes.
        vec![
            hot(0),
            Op::Wait { ms: 1_000 },
            Op::Warm { r: 0 },
            Op::Wait { ms: 500 },
            hot(0),
            Op::Warm { r: 0 },
        ],
        // Woken while it falls asleep, a request in flight.
        vec![
            hot(0),
            Op::Wait { ms: 1_000 },
            Op::Request { r: 0, ms: 2_000 },
            Op::Warm { r: 0 },
            Op::Wait { ms: 100 },
            hot(0),
            Op::Request { r: 0, ms: 100 },
        ],
        // Woken onto another GPU, where another model now runs.
        vec![
            hot(0),
            Op::Wait { ms: 1_000 },
            Op::Warm { r: 0 },
            Op::Wait { ms: 1_000 },
            Op::Hot { r: 1, mask: 0b1, bytes: GPU_BYTES },
            Op::Hot { r: 0, mask: 0b10, bytes: GPU_BYTES },
        ],
    ];
    for ops in seqs {
        runtime().block_on(run(ops.clone(), BTreeSet::new())).unwrap_or_else(|e| panic!("{ops:?}: {e}"));
    }
}

/// A hung engine (alive, answering nothing) keeps its GPU memory until it
/// is killed: neither its own restart nor another replica placed on its
/// GPU starts before it is gone, however slow the kill. One that hangs
/// asleep is found and killed too, before a wake waits on it.
#[test]
fn a_hung_engine_holds_its_gpus_until_killed() {
    let slow_stop = Op::Delays { start: 0, sleep: 0, wake: 0, stop: 1_500 };
    let seqs = [
        // Restarted in place once killed.
        vec![
            slow_stop.clone(),
            Op::Hot { r: 0, mask: 0b1, bytes: 40 },
            Op::Hot { r: 2, mask: 0b1, bytes: 40 },
            Op::Hang { r: 2 },
            Op::Wait { ms: 2_500 },
            Op::Wait { ms: 1_500 },
        ],
        // Its GPU given to another replica while it is being killed.
        vec![
            slow_stop,
            Op::Hot { r: 0, mask: 0b1, bytes: GPU_BYTES },
            Op::Wait { ms: 500 },
            Op::Request { r: 0, ms: 2_000 },
            Op::Hang { r: 0 },
            Op::Wait { ms: 3_500 },
            Op::Gone { r: 0 },
            Op::Hot { r: 1, mask: 0b1, bytes: GPU_BYTES },
            Op::Wait { ms: 100 },
            Op::Wait { ms: 1_000 },
        ],
        // Hung asleep in the warm cache, then wanted back.
        vec![
            Op::Hot { r: 0, mask: 0b1, bytes: GPU_BYTES },
            Op::Wait { ms: 1_000 },
            Op::Warm { r: 0 },
            Op::Wait { ms: 1_000 },
            Op::Hang { r: 0 },
            Op::Wait { ms: 5_000 },
            Op::Hot { r: 0, mask: 0b1, bytes: GPU_BYTES },
        ],
        // Hung as it was being put to sleep (`hangar bench chaos` found it:
        // the sleep call, never answered, held the engine for its 120 s),
        // then wanted back while the call still waits.
        vec![
            Op::Hot { r: 0, mask: 0b1, bytes: GPU_BYTES },
            Op::Wait { ms: 500 },
            Op::Warm { r: 0 },
            Op::Hang { r: 0 },
            Op::Wait { ms: 500 },
            Op::Hot { r: 0, mask: 0b1, bytes: GPU_BYTES },
            Op::Wait { ms: 12_000 },
        ],
        // Hung as it was being woken.
        vec![
            Op::Hot { r: 0, mask: 0b1, bytes: GPU_BYTES },
            Op::Wait { ms: 1_000 },
            Op::Warm { r: 0 },
            Op::Wait { ms: 1_000 },
            Op::Delays { start: 300, sleep: 50, wake: 2_000, stop: 50 },
            Op::Hot { r: 0, mask: 0b1, bytes: GPU_BYTES },
            Op::Hang { r: 0 },
            Op::Wait { ms: 12_000 },
        ],
    ];
    for ops in seqs {
        runtime().block_on(run(ops.clone(), BTreeSet::new())).unwrap_or_else(|e| panic!("{ops:?}: {e}"));
    }
}

/// Each start, failed or ready, leaves its report on the replica (seed
/// 001's setup-run report), stamped when it began and ended; a restart's
/// report replaces the last.
#[test]
fn each_start_leaves_its_report_failed_or_ready() {
    use hangar_core::StartStatus;

    runtime().block_on(async {
        let world: Shared = Arc::default();
        world.lock().unwrap().fail_start.insert(id(0));
        let nodes = BTreeMap::from([(NODE.to_owned(), vec![GPU_BYTES; GPUS])]);
        let driver = spawn(nodes, Arc::new(FakeEngines(world.clone())), Arc::new(FakeSink(world.clone())));
        let slot = Slot { gpus: BTreeMap::from([(0, GPU_BYTES)]), fraction: None };
        driver
            .set_desired(NODE, vec![Wanted { replica: id(0), model: model(), tier: Tier::Hot(slot) }])
            .unwrap();
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(driver.replica(id(0)).unwrap().start, None, "no report while the start runs");
        // The fake start fails after 300 ms.
        tokio::time::sleep(Duration::from_millis(250)).await;
        let failed = driver.replica(id(0)).unwrap().start.expect("a failed start's report");
        assert_eq!(failed.status, StartStatus::Failed);
        assert_eq!(failed.error.as_deref(), Some("the fake engine was told to fail"));
        assert_eq!(failed.ready_ms, 300, "placed → failed, on the driver's clock");
        assert!(failed.started_at_ms > 0 && failed.completed_at_ms >= failed.started_at_ms);
        // Restarted after its back-off (1 s), ready 300 ms later.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let ready = driver.replica(id(0)).unwrap().start.expect("the restart's report");
        assert_eq!((ready.status, ready.error), (StartStatus::Ready, None));
        assert!(ready.started_at_ms >= failed.started_at_ms);
        assert!(world.lock().unwrap().serving.contains(&id(0)));
        // Its engine says how busy it is (what a fleet's agent samples).
        assert_eq!(driver.busy().await, vec![(id(0), model(), 0)]);
        driver.shutdown().await;
    });
}
