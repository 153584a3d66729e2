//! The replay loop: a logical clock, an event heap, the workers' engines and
//! the router.
//!
//! The clock only jumps — to the next arrival, the next pass end, the next
//! delayed KV-event delivery or the next session turn becoming ready — so
//! idle time costs nothing. At each instant the loop first applies every
//! event due then (in the order they were scheduled), and only then starts
//! a pass on each idle worker that has work; this order is fixed, and every
//! tie is broken by insertion order or by the seeded router, so a run is
//! reproducible bit for bit.

use std::collections::{BinaryHeap, VecDeque};

use hangar_core::{KvEvent, RequestId};
use hangar_engine::{EngineConfig, EngineCore, EngineRequest, Pass, Prompt};
use hangar_router::{KvRouterConfig, RouteRequest, Router, RouterPolicy, WorkerId};

use crate::collector::Collector;
use crate::report::{Report, RequestRecord};
use crate::trace::{Trace, TraceError};

/// How requests enter the cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ArrivalMode {
    /// At their trace timestamps, shifted so the first is at 0 and divided by
    /// `speedup`; follow-up turns of a session `delay / speedup` after the
    /// previous turn completes.
    Trace {
        /// Compresses (>1) or stretches (<1) time between arrivals.
        speedup: f64,
    },
    /// Ignoring timestamps, keeping `in_flight` requests in the cluster;
    /// follow-up turns become eligible `delay` after the previous turn
    /// completes.
    Concurrency {
        /// Requests kept in flight.
        in_flight: u32,
    },
}

/// Latency objectives for goodput.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Slo {
    /// Time to first token at most this.
    pub ttft_ms: Option<f64>,
    /// Mean inter-token latency at most this.
    pub itl_ms: Option<f64>,
}

/// Everything a replay needs besides the trace.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Workers (engines) in the cluster.
    pub workers: u32,
    /// How requests are spread over them.
    pub router: RouterPolicy,
    /// The `kv` policy's weights.
    pub kv: KvRouterConfig,
    /// Every worker's engine.
    pub engine: EngineConfig,
    /// Arrival mode.
    pub mode: ArrivalMode,
    /// Tokens each trace `hash_id` stands for.
    pub trace_block_size: u32,
    /// Seeds every random choice (router ties).
    pub seed: u64,
    /// KV events reach the router this long after the pass that caused them.
    pub kv_event_delay_ms: f64,
    /// Goodput objectives.
    pub slo: Slo,
    /// Dynamo's router-side pending queue: with `Some(θ)`, a request that
    /// arrives while every worker has at least θ × `max_num_batched_tokens`
    /// prompt tokens routed and not yet prefilled waits in the router, in
    /// arrival order, and is routed — on the KV state of that moment — as
    /// soon as a worker's backlog is below it. `None`: every request is
    /// routed on arrival.
    pub router_queue: Option<f64>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            workers: 1,
            router: RouterPolicy::RoundRobin,
            kv: KvRouterConfig::default(),
            engine: EngineConfig::default(),
            mode: ArrivalMode::Trace { speedup: 1.0 },
            trace_block_size: 512,
            seed: 0,
            kv_event_delay_ms: 0.0,
            slo: Slo::default(),
            router_queue: None,
        }
    }
}

/// Why a replay could not run. Nothing is simulated when one is returned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// A setting cannot work.
    #[error("{0}")]
    Config(String),
    /// The engine configuration is invalid.
    #[error(transparent)]
    Engine(#[from] hangar_engine::ConfigError),
    /// A trace row cannot be replayed.
    #[error(transparent)]
    Trace(#[from] TraceError),
}

/// A finished replay.
#[derive(Debug, Clone)]
pub struct SimOutput {
    /// The summary.
    pub report: Report,
    /// One record per trace request, in trace order.
    pub requests: Vec<RequestRecord>,
}

#[derive(Debug)]
enum Kind {
    /// A request enters the cluster.
    Arrive(u32),
    /// A worker's pass ends.
    PassEnd(u32),
    /// Delayed KV events reach the router: the worker and the payload's
    /// index in `Sim::delayed_kv` (kept out of the heap so events stay small
    /// and cheap to sift).
    Kv(u32, u32),
    /// Re-check the concurrency window (a follow-up turn became ready).
    Wake,
}

type Event = crate::clock::Event<Kind>;

struct Worker {
    engine: EngineCore,
    busy: bool,
}

struct Sim<'t> {
    cfg: &'t SimConfig,
    trace: &'t Trace,
    heap: BinaryHeap<Event>,
    seq: u64,
    /// Trace-mode first arrivals, in time order. Kept apart from the heap
    /// (which then holds only a few events per worker) because they are
    /// known up front and already sorted.
    arrivals: VecDeque<(f64, u32)>,
    workers: Vec<Worker>,
    /// Each worker's current (or last) pass. Apart from `workers` so a pass
    /// can be read while the rest of the simulation is updated.
    passes: Vec<Pass>,
    /// Payloads of pending delayed KV deliveries; freed slots are reused.
    delayed_kv: Vec<Vec<KvEvent>>,
    free_kv: Vec<u32>,
    router: Router,
    kv_router: bool,
    collector: Collector,
    /// The next turn of the same session, per request.
    next_turn: Vec<Option<u32>>,
    /// Concurrency mode: requests eligible to enter, with the time they
    /// became eligible, in order.
    ready: VecDeque<(f64, u32)>,
    in_flight: u32,
    /// When the earliest pending [`Kind::Wake`] fires (infinity: none).
    pending_wake: f64,
    /// Workers that may need a pass started at the current instant.
    touched: Vec<u32>,
    /// The router's pending queue ([`SimConfig::router_queue`]): arrival
    /// time and request, in arrival order.
    pending: VecDeque<(f64, u32)>,
    /// The backlog, in blocks, at which a worker counts as saturated.
    pending_limit: u64,
}

/// Replays `trace` under `cfg`. `load` reads the engine's timing table file
/// when it names one.
pub fn simulate(
    trace: &Trace,
    cfg: &SimConfig,
    load: impl Fn(&str) -> Result<String, String>,
) -> Result<SimOutput, SimError> {
    validate(trace, cfg)?;
    let kv_router = cfg.router == RouterPolicy::Kv;
    let mut router = Router::new(cfg.router, cfg.engine.block_size, cfg.seed).with_kv(cfg.kv.clone());
    let mut workers = Vec::with_capacity(cfg.workers as usize);
    for w in 0..cfg.workers {
        let mut engine = EngineCore::new(&cfg.engine, &load)?;
        engine.set_kv_events(kv_router);
        workers.push(Worker { engine, busy: false });
        router.add_worker(WorkerId(w));
    }
    let mut sim = Sim {
        cfg,
        trace,
        heap: BinaryHeap::new(),
        seq: 0,
        arrivals: VecDeque::new(),
        passes: (0..cfg.workers).map(|_| Pass::default()).collect(),
        delayed_kv: Vec::new(),
        free_kv: Vec::new(),
        workers,
        router,
        kv_router,
        collector: Collector::new(trace, cfg.workers),
        next_turn: link_sessions(trace),
        ready: VecDeque::new(),
        in_flight: 0,
        pending_wake: f64::INFINITY,
        touched: Vec::new(),
        pending: VecDeque::new(),
        pending_limit: cfg.router_queue.map_or(0, |theta| {
            let tokens = theta * f64::from(cfg.engine.max_num_batched_tokens);
            (tokens / f64::from(cfg.engine.block_size.max(1))).ceil().max(1.0) as u64
        }),
    };
    sim.seed_arrivals();
    sim.run();
    Ok(sim.finish())
}

fn validate(trace: &Trace, cfg: &SimConfig) -> Result<(), SimError> {
    if cfg.workers == 0 {
        return Err(SimError::Config("the cluster needs at least one worker (--workers ≥ 1)".into()));
    }
    if cfg.trace_block_size == 0 {
        return Err(SimError::Config("--trace-block-size must be at least 1".into()));
    }
    match cfg.mode {
        ArrivalMode::Trace { speedup } if !(speedup.is_finite() && speedup > 0.0) => {
            return Err(SimError::Config(format!("--speedup must be a number above 0, got {speedup}")));
        }
        ArrivalMode::Concurrency { in_flight: 0 } => {
            return Err(SimError::Config("--concurrency must be at least 1".into()));
        }
        _ => {}
    }
    if !(cfg.kv_event_delay_ms.is_finite() && cfg.kv_event_delay_ms >= 0.0) {
        return Err(SimError::Config("--kv-event-delay-ms must be ≥ 0".into()));
    }
    if let Some(theta) = cfg.router_queue.filter(|t| !(t.is_finite() && *t > 0.0)) {
        return Err(SimError::Config(format!("--router-queue must be a number above 0, got {theta}")));
    }
    cfg.engine.validate()?;
    if trace.requests.is_empty() {
        return Err(TraceError::empty(&trace.source).into());
    }
    for r in &trace.requests {
        if r.adapter.is_some() {
            // A plain replay's workers serve one model and have no adapter
            // slots; the fleet simulation models adapters.
            return Err(TraceError {
                source_name: trace.source.clone(),
                line: r.line,
                field: Some("adapter".into()),
                why: "adapters are simulated on a fleet: run `hangar sim --fleet FLEET TRACE` with \
                      `[models.adapters]` (docs/adapters.md)"
                    .into(),
            }
            .into());
        }
        let needed = (r.input_len as usize).div_ceil(cfg.trace_block_size as usize);
        if !r.hash_ids.is_empty() && r.hash_ids.len() < needed {
            return Err(TraceError {
                source_name: trace.source.clone(),
                line: r.line,
                field: Some("hash_ids".into()),
                why: format!(
                    "{} ids of {} tokens cover fewer than the {} input tokens",
                    r.hash_ids.len(),
                    cfg.trace_block_size,
                    r.input_len
                ),
            }
            .into());
        }
    }
    Ok(())
}

/// For each request, the next request of its session in file order.
fn link_sessions(trace: &Trace) -> Vec<Option<u32>> {
    let mut next = vec![None; trace.requests.len()];
    let mut last: Vec<Option<u32>> = vec![None; trace.sessions as usize];
    for (i, r) in trace.requests.iter().enumerate() {
        if let Some(s) = r.session {
            if let Some(prev) = last[s as usize] {
                next[prev as usize] = Some(i as u32);
            }
            last[s as usize] = Some(i as u32);
        }
    }
    next
}

impl Sim<'_> {
    fn push(&mut self, at: f64, kind: Kind) {
        self.seq += 1;
        self.heap.push(Event { at, rank: 0, seq: self.seq, kind });
    }

    /// First turns (and standalone requests) are the entry points; later
    /// turns wait for their predecessor.
    fn seed_arrivals(&mut self) {
        let mut is_follow_up = vec![false; self.trace.requests.len()];
        for n in self.next_turn.iter().flatten() {
            is_follow_up[*n as usize] = true;
        }
        let entries = (0..self.trace.requests.len() as u32).filter(|&i| !is_follow_up[i as usize]);
        match self.cfg.mode {
            ArrivalMode::Trace { speedup } => {
                let reqs = &self.trace.requests;
                let t0 = entries.clone().map(|i| reqs[i as usize].timestamp_ms).fold(f64::INFINITY, f64::min);
                let mut arrivals: Vec<(f64, u32)> =
                    entries.map(|i| ((reqs[i as usize].timestamp_ms - t0) / speedup, i)).collect();
                // Stable: equal times keep file order.
                arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
                self.arrivals = arrivals.into();
            }
            ArrivalMode::Concurrency { .. } => {
                self.ready.extend(entries.map(|i| (0.0, i)));
                self.pending_wake = 0.0;
                self.push(0.0, Kind::Wake);
            }
        }
    }

    /// Concurrency mode: admits eligible requests while the window has room;
    /// if the next eligible one is in the future, wakes up then.
    fn fill_window(&mut self, now: f64) {
        let ArrivalMode::Concurrency { in_flight } = self.cfg.mode else { return };
        while self.in_flight < in_flight {
            match self.ready.front() {
                Some(&(at, i)) if at <= now => {
                    self.ready.pop_front();
                    self.arrive(now, i);
                }
                Some(&(at, _)) => {
                    if at < self.pending_wake {
                        self.pending_wake = at;
                        self.push(at, Kind::Wake);
                    }
                    break;
                }
                None => break,
            }
        }
    }

    /// The time of the next event of either source.
    fn next_time(&self) -> Option<f64> {
        crate::clock::next_time(&self.heap, self.arrivals.front().map(|a| a.0))
    }

    /// At each instant: heap events due now (pass ends, deliveries, wakes,
    /// follow-up turns) in scheduling order, then first arrivals due now in
    /// trace order, then passes start.
    fn run(&mut self) {
        while let Some(now) = self.next_time() {
            while self.heap.peek().is_some_and(|e| e.at == now) {
                let ev = self.heap.pop().expect("peeked");
                self.handle(now, ev.kind);
            }
            while self.arrivals.front().is_some_and(|a| a.0 == now) {
                let (_, i) = self.arrivals.pop_front().expect("peeked");
                self.arrive(now, i);
            }
            self.start_passes(now);
        }
    }

    fn handle(&mut self, now: f64, kind: Kind) {
        match kind {
            Kind::Arrive(i) => self.arrive(now, i),
            Kind::PassEnd(w) => self.pass_end(now, w),
            Kind::Kv(w, slot) => {
                let events = std::mem::take(&mut self.delayed_kv[slot as usize]);
                self.router.apply_kv_events(WorkerId(w), &events);
                self.free_kv.push(slot);
            }
            Kind::Wake => {
                if now >= self.pending_wake {
                    self.pending_wake = f64::INFINITY;
                }
                self.fill_window(now);
            }
        }
    }

    fn arrive(&mut self, now: f64, i: u32) {
        self.in_flight += 1;
        let waits = self.cfg.router_queue.is_some()
            && (!self.pending.is_empty() || self.router.saturated(self.pending_limit));
        if waits {
            self.collector.router_queued();
            self.pending.push_back((now, i));
        } else {
            self.dispatch(now, now, i);
        }
    }

    /// Routes the requests the router holds while a worker has room for
    /// them, oldest first.
    fn drain_pending(&mut self, now: f64) {
        while !self.pending.is_empty() && !self.router.saturated(self.pending_limit) {
            let (arrival, i) = self.pending.pop_front().expect("not empty");
            self.dispatch(now, arrival, i);
        }
    }

    /// Routes request `i`, which arrived at `arrival`, at `now`, and hands
    /// it to its worker's engine.
    fn dispatch(&mut self, now: f64, arrival: f64, i: u32) {
        let r = &self.trace.requests[i as usize];
        let block_size = self.cfg.engine.block_size;
        let prompt =
            Prompt::from_trace(r.input_len, &r.hash_ids, self.cfg.trace_block_size, block_size, u64::from(i))
                .expect("validate() checked hash_ids coverage");
        let id = RequestId(u64::from(i));
        let w = self
            .router
            .route(&RouteRequest { id, blocks: prompt.blocks(), prompt_tokens: r.input_len, adapter: None })
            .expect("workers exist and request ids are unique");
        self.collector.arrived(i, arrival, w.0);
        let worker = &mut self.workers[w.0 as usize];
        match worker.engine.add_request(EngineRequest { id, prompt, max_output_tokens: r.output_len }) {
            Ok(()) => self.touched.push(w.0),
            Err(e) => {
                self.collector.rejected(i, e.to_string());
                self.request_done(now, i);
            }
        }
    }

    fn pass_end(&mut self, now: f64, w: u32) {
        self.workers[w as usize].busy = false;
        let passes = std::mem::take(&mut self.passes);
        let pass = &passes[w as usize];
        self.collector.pass(w, pass);
        for t in &pass.tokens {
            if t.index == 0 {
                self.router.prefill_done(t.request);
            }
        }
        if self.kv_router && !pass.kv_events.is_empty() {
            if self.cfg.kv_event_delay_ms > 0.0 {
                let slot = match self.free_kv.pop() {
                    Some(slot) => {
                        self.delayed_kv[slot as usize].clone_from(&pass.kv_events);
                        slot
                    }
                    None => {
                        self.delayed_kv.push(pass.kv_events.clone());
                        (self.delayed_kv.len() - 1) as u32
                    }
                };
                self.push(now + self.cfg.kv_event_delay_ms, Kind::Kv(w, slot));
            } else {
                self.router.apply_kv_events(WorkerId(w), &pass.kv_events);
            }
        }
        for &id in &pass.completed {
            self.request_done(now, id.0 as u32);
        }
        self.passes = passes;
        self.touched.push(w);
        self.drain_pending(now);
    }

    /// A request left the cluster: free its router slot, release its
    /// session's next turn, refill the concurrency window.
    fn request_done(&mut self, now: f64, i: u32) {
        self.router.finished(RequestId(u64::from(i)));
        self.in_flight -= 1;
        if let Some(n) = self.next_turn[i as usize] {
            let delay = self.trace.requests[n as usize].delay_ms;
            match self.cfg.mode {
                ArrivalMode::Trace { speedup } => self.push(now + delay / speedup, Kind::Arrive(n)),
                ArrivalMode::Concurrency { .. } => {
                    let at = now + delay;
                    // Keep `ready` ordered by eligibility time, then order of
                    // release.
                    let pos = self.ready.partition_point(|&(t, _)| t <= at);
                    self.ready.insert(pos, (at, n));
                }
            }
        }
        self.fill_window(now);
    }

    fn start_passes(&mut self, now: f64) {
        let mut touched = std::mem::take(&mut self.touched);
        touched.sort_unstable();
        touched.dedup();
        for &w in &touched {
            let worker = &mut self.workers[w as usize];
            if worker.busy || !worker.engine.has_work() {
                continue;
            }
            let pass = &mut self.passes[w as usize];
            worker.engine.step(now, pass);
            if pass.is_idle() {
                continue;
            }
            worker.busy = true;
            let end = pass.end_ms;
            self.push(end, Kind::PassEnd(w));
        }
        touched.clear();
        self.touched = touched;
    }

    fn finish(self) -> SimOutput {
        self.collector.finish(self.cfg, self.trace)
    }
}
