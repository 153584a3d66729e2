//! The whole-fleet simulation (`hangar sim --fleet`): every model's
//! admission, the controller (scalers and placement), cold starts by the
//! tier the weights come from, and an engine per replica, on one logical
//! clock.
//!
//! It drives the same code `hangar serve` does — `hangar-queue`'s
//! [`Admission`] per model (permits, the bounded line, 429, deadlines),
//! `hangar-scaler`'s [`Controller`] driven by the same [`ControlLoop`] as
//! the live control task (every model observed each `observe_ms` and
//! before each due decision, a request that has to wait decided on at
//! once), `hangar-placement` inside it,
//! `hangar-engine`'s [`EngineCore`] per replica — and replaces only what
//! the live server does with processes: a replica's start takes its
//! weights' bytes over the bandwidth of the tier they come from (disk,
//! page cache, or a WARM wake from CPU memory) plus the engine's boot.
//!
//! Adapters: a model with `[models.adapters]` gives each replica the
//! router's [`AdapterSlots`](hangar_router::AdapterSlots) (through its
//! chooser, as `hangar serve` does); a row naming an `adapter` is granted
//! a permit as any other, then waits until the slots say its adapter is
//! loaded there. A load takes the adapter's bytes over the disk's
//! bandwidth — the page cache's once a load of that adapter finished on
//! the node — plus `cold_start.adapter_ms`; an unload is immediate. A
//! request's prompt blocks are its adapter's own (an engine's prefix cache
//! keys blocks by adapter), and a WARM replica wakes with no adapters.
//!
//! The trace is read as the clock reaches it ([`simulate_fleet_rows`]) and
//! each request is booked in the report as it ends, so memory follows the
//! fleet and what is in flight, not the trace's length.
//!
//! Order at one instant: due events in the order they were scheduled
//! (pass ends, replicas ready, admission deadlines, controller ticks),
//! then arrivals in trace order, then passes start. Every tie is broken by
//! that order or by a seeded generator, so a run is reproducible byte for
//! byte.

mod config;
mod report;
mod requests;

use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use hangar_core::{
    mix64, AccountId, Adapter, AdapterRef, BlockHash, ByteSize, Millis, ModelKey, ReplicaId, RequestId,
    ROOT_BLOCK_HASH,
};
use hangar_engine::{EngineCore, EngineRequest, Pass, Prompt};
use hangar_placement::{Action as Step, Deployment, NodeId};
use hangar_queue::{Action as Admit, Admission, AdmissionConfig, Chooser, Submitted};
use hangar_router::{AdapterAction, ApproxKvConfig, ReplicaChooser, RouterPolicy, SlotEvent, SlotStep};
use hangar_scaler::{Action, ControlLoop, Observation, ReplicaCounts, ScalingConfig, StartTier, TtftWindow};

pub use config::{ColdStart, FleetConfig, FleetModel, FleetNodes};
pub use report::{AdapterCounts, ColdStarts, FleetReport, GpuSeconds, ModelReport, Sample};

use crate::trace::{Trace, TraceError, TraceRequest};
use crate::SimError;
use requests::{InFlight, Requests};

/// How a fleet simulation runs besides its fleet file.
///
/// `hangar sim --fleet` and `sim compare` set it from their flags.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetOptions {
    /// Divides the time between trace arrivals.
    pub speedup: f64,
    /// Tokens per trace `hash_id`.
    pub trace_block_size: u32,
    /// Drop rows naming a model the fleet does not serve (else an error
    /// with the row's line).
    pub skip_unknown: bool,
    /// Every model runs this policy instead of its own (`sim compare`).
    pub policy: Option<ScalingConfig>,
    /// Record the fleet every this many ms for plots, with the load and
    /// TTFT of each window ([`FleetReport::timeline`]); 0: no timeline.
    pub sample_ms: Millis,
    /// Keep what the control loop was told and decided
    /// ([`FleetReport::control_record`]), to replay it elsewhere.
    pub record_control: bool,
}

impl Default for FleetOptions {
    fn default() -> Self {
        FleetOptions {
            speedup: 1.0,
            trace_block_size: 512,
            skip_unknown: false,
            policy: None,
            sample_ms: 0,
            record_control: false,
        }
    }
}

#[derive(Debug)]
enum Kind {
    /// A replica's pass ends (slot, generation).
    PassEnd(usize, u64),
    /// A replica finished loading (slot, generation).
    Loaded(usize, u64),
    /// A replica's adapter load finished (slot, generation).
    AdapterLoaded(usize, u64),
    /// Something in the control loop (a tick, a decision, a retry) or an
    /// admission is due.
    Due,
    /// Take a timeline sample.
    Sample,
    /// A `[[drains]]` window begins (`true`) or ends.
    Drain(usize, bool),
}

type Event = crate::clock::Event<Kind>;

/// Where a replica is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Loading since, from a tier.
    Loading {
        tier: StartTier,
    },
    Ready,
    /// Finishing its requests before going WARM (`to_warm`) or away.
    Draining {
        to_warm: bool,
    },
    Warm,
    /// Stopped, or never finished loading: nothing left of it. Its slot
    /// stays (the report books by slot), but it counts nowhere.
    Gone,
}

struct Replica {
    id: ReplicaId,
    model: usize,
    /// The node it runs on: the page cache its COLD load fills is that
    /// node's.
    node: NodeId,
    /// GPUs it holds (fractions for a shared GPU).
    gpus: f64,
    /// Its engine while it is on a GPU; a WARM or stopped replica has none
    /// (its KV cache went with the GPU memory).
    engine: Option<EngineCore>,
    state: State,
    /// A pass is running.
    busy: bool,
    /// Bumped when the replica changes life, so stale events are ignored.
    generation: u64,
    /// When its current load began.
    load_started: f64,
    /// Requests granted here that wait for their adapter to load.
    adapter_waiting: u32,
    /// The adapter its load in flight brings in.
    adapter_loading: Option<AdapterRef>,
}

impl Replica {
    fn has_work(&self) -> bool {
        self.engine.as_ref().is_some_and(EngineCore::has_work) || self.adapter_waiting > 0
    }
}

/// One model's live state.
struct ModelState {
    key: ModelKey,
    admission: Admission,
    /// Its `router`, as `hangar serve` runs it.
    chooser: ReplicaChooser,
    /// The `kv` router: prompts are hinted to the chooser.
    kv: bool,
    /// Whether its replicas load adapters.
    adapters: bool,
    timeout_ms: Millis,
    permits: u32,
    counters: (u64, u64, u64, u64),
    /// Recent TTFTs, for the controller's observations (as `hangar serve`).
    ttft: TtftWindow,
}

/// Per request: when it arrived, was granted a permit, had its first token
/// and ended, and how.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Timing {
    pub arrived: f64,
    pub first_token: Option<f64>,
    pub done: Option<f64>,
    pub outcome: Outcome,
    pub granted: f64,
}

/// How a request ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Outcome {
    #[default]
    Pending,
    Completed,
    Rejected,
    TimedOut,
    Failed,
}

struct Fleet<'t> {
    cfg: &'t FleetConfig,
    opts: &'t FleetOptions,
    rows: &'t mut dyn Iterator<Item = Result<TraceRequest, TraceError>>,
    source: String,
    /// The next served row, its model and when it arrives.
    next: Option<(f64, usize, TraceRequest)>,
    /// The first served row's timestamp: the clock's zero.
    t0: Option<f64>,
    /// The last row read (timestamp, line), to hold the trace to time order.
    last_row: Option<(f64, usize)>,
    heap: BinaryHeap<Event>,
    seq: u64,
    control: ControlLoop,
    models: Vec<ModelState>,
    by_key: BTreeMap<ModelKey, usize>,
    replicas: Vec<Replica>,
    slots: BTreeMap<ReplicaId, usize>,
    /// Per model, the slots of its replicas that are not gone, ascending:
    /// what an observation counts, without a pass over every replica the
    /// fleet ever started.
    by_model: Vec<Vec<usize>>,
    passes: Vec<Pass>,
    /// Nodes where a load of each model has finished (its weights are in
    /// their page cache). A load still under way, or given up, has put
    /// nothing there yet.
    cached: BTreeSet<(NodeId, usize)>,
    /// Per model, how many nodes hold its weights (`cached`): a start where
    /// the node holds none fetches them from a peer, when the fleet has
    /// peers.
    cached_nodes: Vec<u32>,
    /// The same for adapters.
    adapters_cached: BTreeSet<(NodeId, AdapterRef)>,
    /// Adapter actions are being carried out (a call that would carry them
    /// out again leaves them to that loop).
    carrying_adapters: bool,
    touched: Vec<usize>,
    requests: Requests,
    report: report::Builder,
    /// When each model's admission is next due, as last asked, and the
    /// same ordered by time: the earliest is read in O(1), and only models
    /// due are woken, so an instant costs what changed, not the number of
    /// models.
    admission_due: Vec<Option<Millis>>,
    due_models: BTreeSet<(Millis, usize)>,
    /// Models whose admission was called since `admission_due` was asked.
    admission_touched: Vec<usize>,
    /// The control loop's next due time, as last asked (`None`: it was
    /// called since, ask again).
    control_due: Option<Millis>,
    next_due: f64,
    /// A day after the last arrival: requests still pending then fail.
    horizon: f64,
    /// The last request's end: the run's length.
    last_end: f64,
    account: AccountId,
    /// Told how many requests have ended, as each one does.
    progress: &'t mut dyn FnMut(usize),
    ended: usize,
}

/// Runs `trace` on the fleet `cfg`, its rows taken in time order (a
/// stable sort, so rows of one instant keep their file order). Rows must
/// name a model (`model`) the fleet serves, unless `opts.skip_unknown`.
///
/// `progress(done, total)` is called each time one of the `total` served
/// requests ends (completed, rejected, timed out or failed), so a caller
/// can show how far a long run is; `done` only grows and the last call has
/// `done == total`. It is called inline: keep it cheap. The simulation
/// itself does no I/O.
pub fn simulate_fleet(
    trace: &Trace,
    cfg: &FleetConfig,
    opts: &FleetOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<FleetReport, SimError> {
    let by_key = cfg.by_key();
    let served = (trace.requests.iter()).filter(|r| model_of(r, cfg, &by_key).is_some()).count();
    let mut order: Vec<usize> = (0..trace.requests.len()).collect();
    order.sort_by(|&a, &b| trace.requests[a].timestamp_ms.total_cmp(&trace.requests[b].timestamp_ms));
    let rows = order.into_iter().map(|i| Ok(trace.requests[i].clone()));
    simulate_fleet_rows(rows, &trace.source, cfg, opts, |done| progress(done, served))
}

/// Runs the rows of a trace on the fleet `cfg` as the clock reaches them,
/// without holding the trace: how `hangar sim --fleet` runs a file of any
/// length. Rows must come in time order (a row earlier than the one
/// before it is an error naming both lines) and name a model the fleet
/// serves, unless `opts.skip_unknown`; a bad row ends the run with its
/// error. `progress(done)` is told how many requests have ended, as each
/// one does.
pub fn simulate_fleet_rows(
    rows: impl Iterator<Item = Result<TraceRequest, TraceError>>,
    source_name: &str,
    cfg: &FleetConfig,
    opts: &FleetOptions,
    mut progress: impl FnMut(usize),
) -> Result<FleetReport, SimError> {
    if !(opts.speedup.is_finite() && opts.speedup > 0.0) {
        return Err(SimError::Config(format!("--speedup must be a number above 0, got {}", opts.speedup)));
    }
    cfg.validate().map_err(|e| SimError::Config(e.to_string()))?;
    let by_key = cfg.by_key();
    let controller = cfg.controller(opts.policy.as_ref()).map_err(SimError::Config)?;
    let control = ControlLoop::new(controller, cfg.observe_ms, 0);
    let control = if opts.record_control { control.recording() } else { control };
    let models = cfg
        .models
        .iter()
        .map(|m| {
            let chooser = ReplicaChooser::new(m.router, &kv_config(opts.trace_block_size), cfg.seed);
            (
                m,
                m.router,
                match &m.adapters {
                    Some(a) => chooser.with_adapters(a.clone()),
                    None => chooser,
                },
            )
        })
        .map(|(m, router, chooser)| ModelState {
            key: m.key.clone(),
            admission: Admission::new(AdmissionConfig {
                capacity: m.capacity(),
                ..AdmissionConfig::default()
            }),
            chooser,
            kv: router == RouterPolicy::Kv,
            adapters: m.adapters.is_some(),
            timeout_ms: m.timeout_s * 1000,
            permits: m.concurrency,
            counters: (0, 0, 0, 0),
            ttft: TtftWindow::new(),
        })
        .collect();
    let mut rows = rows;
    let mut fleet = Fleet {
        cfg,
        opts,
        rows: &mut rows,
        source: source_name.to_owned(),
        next: None,
        t0: None,
        last_row: None,
        heap: BinaryHeap::new(),
        seq: 0,
        control,
        models,
        by_key,
        replicas: Vec::new(),
        slots: BTreeMap::new(),
        by_model: vec![Vec::new(); cfg.models.len()],
        passes: Vec::new(),
        cached: BTreeSet::new(),
        cached_nodes: vec![0; cfg.models.len()],
        adapters_cached: BTreeSet::new(),
        carrying_adapters: false,
        touched: Vec::new(),
        requests: Requests::default(),
        report: report::Builder::new(cfg, opts.sample_ms),
        admission_due: vec![None; cfg.models.len()],
        due_models: BTreeSet::new(),
        admission_touched: Vec::new(),
        control_due: None,
        next_due: f64::INFINITY,
        horizon: f64::INFINITY,
        last_end: 0.0,
        account: "sim".parse().expect("a valid account"),
        progress: &mut progress,
        ended: 0,
    };
    fleet.run()?;
    Ok(fleet.finish())
}

/// The fleet model a row is for: the one it names, or the only one.
pub(crate) fn model_of(
    row: &TraceRequest,
    cfg: &FleetConfig,
    by_key: &BTreeMap<ModelKey, usize>,
) -> Option<usize> {
    match &row.model {
        Some(m) => m.parse::<ModelKey>().ok().and_then(|k| by_key.get(&k).copied()),
        None if cfg.models.len() == 1 => Some(0),
        None => None,
    }
}

/// A fleet's engines take their timing inline: a `table` timing model is
/// refused when the fleet file is checked.
pub(crate) fn no_tables(path: &str) -> Result<String, String> {
    Err(format!("`{path}`: a fleet's engines take `polynomial` or `fixed` timing, not a table file"))
}

/// What an adapter's prompt blocks are mixed with, so that they are its
/// own.
fn adapter_salt(a: &AdapterRef) -> u64 {
    a.to_string().bytes().fold(0x6164_6170_7465_7273, |h, b| mix64(h, u64::from(b)))
}

/// The `kv` router's settings in a simulation: blocks are the trace's
/// (`hash_ids` chained), so a block counts `trace_block_size` tokens.
fn kv_config(trace_block_size: u32) -> ApproxKvConfig {
    ApproxKvConfig { block_chars: trace_block_size.saturating_mul(4), ..ApproxKvConfig::default() }
}

fn ms(t: f64) -> Millis {
    t.max(0.0).floor() as Millis
}

impl Fleet<'_> {
    fn push(&mut self, at: f64, kind: Kind) {
        self.seq += 1;
        // What is due on the control loop's clock comes first at its
        // instant, before replicas loaded or passes ended then — the order
        // the live control task takes them in.
        let rank = u8::from(!matches!(kind, Kind::Due));
        self.heap.push(Event { at, rank, seq: self.seq, kind });
    }

    /// Reads rows up to the next one the fleet serves: checked, and
    /// timed on the clock.
    fn read_next(&mut self) -> Result<(), SimError> {
        self.next = None;
        for row in &mut *self.rows {
            let r = row?;
            let err = |field: &str, why: String| TraceError {
                source_name: self.source.clone(),
                line: r.line,
                field: Some(field.into()),
                why,
            };
            if let Some((ts, line)) = self.last_row.filter(|(ts, _)| r.timestamp_ms < *ts) {
                let why = format!(
                    "{} is earlier than line {line}'s {ts}; a fleet run reads its trace in time order (sort it by timestamp)",
                    r.timestamp_ms
                );
                return Err(err("timestamp", why).into());
            }
            self.last_row = Some((r.timestamp_ms, r.line));
            let Some(m) = model_of(&r, self.cfg, &self.by_key) else {
                if self.opts.skip_unknown {
                    continue;
                }
                let why = match &r.model {
                    Some(m) => format!("model `{m}` is not in the fleet (add it, or pass --skip-unknown)"),
                    None => "the row names no model and the fleet serves several".into(),
                };
                return Err(err("model", why).into());
            };
            if let Some(a) = &r.adapter {
                let model = &self.cfg.models[m];
                let Some(slots) = &model.adapters else {
                    let why = format!(
                        "model `{}` loads no adapters: give it `[models.adapters]` to serve `{}:{a}`",
                        model.key, model.key
                    );
                    return Err(err("adapter", why).into());
                };
                let bytes = r.adapter_size.unwrap_or(slots.default_size.bytes());
                if bytes > slots.memory.bytes() {
                    let why = format!(
                        "`{}:{a}` is {bytes} bytes, more than the {} of adapter memory of a replica (`memory`)",
                        model.key, slots.memory
                    );
                    return Err(err("adapter_size", why).into());
                }
            }
            let needed = (r.input_len as usize).div_ceil(self.opts.trace_block_size.max(1) as usize);
            if !r.hash_ids.is_empty() && r.hash_ids.len() < needed {
                let why =
                    format!("{} ids cover fewer than the {} input tokens", r.hash_ids.len(), r.input_len);
                return Err(err("hash_ids", why).into());
            }
            let t0 = *self.t0.get_or_insert(r.timestamp_ms);
            self.next = Some(((r.timestamp_ms - t0) / self.opts.speedup, m, r));
            return Ok(());
        }
        Ok(())
    }

    fn next_time(&self) -> Option<f64> {
        crate::clock::next_time(&self.heap, self.next.as_ref().map(|n| n.0))
    }

    /// Rows still to come or requests in flight.
    fn more(&self) -> bool {
        self.next.is_some() || self.requests.open() > 0
    }

    fn run(&mut self) -> Result<(), SimError> {
        self.read_next()?;
        self.carry_out(0.0);
        self.settle(0.0);
        if self.opts.sample_ms > 0 {
            self.push(0.0, Kind::Sample);
        }
        for (i, d) in self.cfg.drains.iter().enumerate() {
            let at = |s: f64| s * 1000.0 / self.opts.speedup;
            let (from, to) = (at(d.from_s), d.to_s.map(at));
            self.push(from, Kind::Drain(i, true));
            if let Some(to) = to {
                self.push(to, Kind::Drain(i, false));
            }
        }
        while self.more() {
            let Some(now) = self.next_time() else { break };
            while self.heap.peek().is_some_and(|e| e.at == now) {
                let ev = self.heap.pop().expect("peeked");
                self.handle(now, ev.kind);
            }
            while self.next.as_ref().is_some_and(|n| n.0 == now) {
                let (_, m, row) = self.next.take().expect("peeked");
                self.read_next()?;
                if self.next.is_none() {
                    self.horizon = now + 86_400_000.0;
                }
                self.arrive(now, m, row);
            }
            self.settle(now);
        }
        Ok(())
    }

    /// After the events of an instant: the controller's actions, admission
    /// decisions, passes, and when anything is due next.
    fn settle(&mut self, now: f64) {
        self.carry_out(now);
        self.start_passes(now);
        self.refresh_admission_due();
        let control = *self.control_due.get_or_insert_with(|| self.control.poll_timeout());
        let due = (self.due_models.first().map(|&(t, _)| t).into_iter())
            .chain([control])
            .min()
            .map_or(f64::INFINITY, |t| t as f64);
        if due < self.next_due || self.next_due <= now {
            self.next_due = due.max(now);
            if due.is_finite() {
                self.push(due.max(now), Kind::Due);
            }
        }
    }

    /// Asks the admissions called since of their next due time.
    fn refresh_admission_due(&mut self) {
        let mut touched = std::mem::take(&mut self.admission_touched);
        for &m in &touched {
            let due = self.models[m].admission.poll_timeout();
            if due != self.admission_due[m] {
                if let Some(old) = self.admission_due[m] {
                    self.due_models.remove(&(old, m));
                }
                if let Some(new) = due {
                    self.due_models.insert((new, m));
                }
                self.admission_due[m] = due;
            }
        }
        touched.clear();
        self.admission_touched = touched;
    }

    fn handle(&mut self, now: f64, kind: Kind) {
        match kind {
            Kind::PassEnd(slot, generation) => {
                if self.replicas[slot].generation == generation {
                    self.pass_end(now, slot);
                }
            }
            Kind::Loaded(slot, generation) => {
                if self.replicas[slot].generation == generation {
                    self.loaded(now, slot);
                }
            }
            Kind::AdapterLoaded(slot, generation) => {
                if self.replicas[slot].generation == generation {
                    self.adapter_loaded(now, slot);
                }
            }
            Kind::Due => {
                if now >= self.next_due {
                    self.next_due = f64::INFINITY;
                }
                if self.control.wants_observations(ms(now)) {
                    for m in 0..self.models.len() {
                        let (key, obs, in_flight) = self.observation(now, m, 0);
                        self.control.observe(ms(now), &key, obs, &in_flight);
                    }
                }
                self.control.handle_timeout(ms(now));
                self.control_due = None;
                if self.next.is_none() && now > self.horizon {
                    // A bound on the run, so a request the fleet can never
                    // serve cannot keep the clock going forever.
                    for id in self.requests.open_ids() {
                        self.end(now, id, Outcome::Failed);
                    }
                }
                // Only admissions with a deadline due have anything to do
                // (every other call drained its actions): in model order,
                // as a pass over all of them would.
                self.refresh_admission_due();
                let mut due: Vec<usize> =
                    self.due_models.range(..=(ms(now), usize::MAX)).map(|&(_, m)| m).collect();
                due.sort_unstable();
                for m in due {
                    self.models[m].admission.handle_timeout(ms(now));
                    self.admissions(now, m);
                }
            }
            Kind::Drain(i, on) => {
                // As the live control task takes a command: every model
                // observed first (which replicas are ready decides which
                // leaving ones may stop).
                for m in 0..self.models.len() {
                    let (key, obs, in_flight) = self.observation(now, m, 0);
                    self.control.observe(ms(now), &key, obs, &in_flight);
                }
                let node = self.cfg.drains[i].node.parse().expect("validated");
                self.control.drain(ms(now), &node, on);
                self.control_due = None;
            }
            Kind::Sample => {
                self.report.sample(
                    now,
                    self.control.controller(),
                    &self.models.iter().map(|m| m.key.clone()).collect::<Vec<_>>(),
                );
                if self.more() {
                    self.push(now + self.opts.sample_ms as f64, Kind::Sample);
                }
            }
        }
    }

    /// What the controller sees of model `m`, as `hangar serve` shows it;
    /// `waiting` at least.
    fn observation(
        &mut self,
        now: f64,
        m: usize,
        waiting: u32,
    ) -> (ModelKey, Observation, Vec<(ReplicaId, u32)>) {
        let mut counts = ReplicaCounts::default();
        let mut in_flight = Vec::new();
        for r in self.by_model[m].iter().map(|&slot| &self.replicas[slot]) {
            match r.state {
                State::Loading { .. } => counts.starting += 1,
                State::Ready => {
                    counts.ready += 1;
                    in_flight.push((r.id, self.models[m].admission.in_use_on(r.id)));
                }
                State::Draining { .. } | State::Warm => counts.sleeping += 1,
                State::Gone => {}
            }
        }
        let model = &mut self.models[m];
        let ttft_p99_ms = model.ttft.p99(ms(now));
        let (arrivals, completions, rejected, busy_ms) = model.counters;
        let obs = Observation {
            waiting: (model.admission.waiting() as u32).max(waiting),
            in_flight: model.admission.in_use(),
            permits_per_replica: model.permits,
            replicas: counts,
            arrivals,
            completions,
            rejected,
            busy_ms,
            ttft_p99_ms,
        };
        (model.key.clone(), obs, in_flight)
    }

    fn arrive(&mut self, now: f64, m: usize, row: TraceRequest) {
        self.models[m].counters.0 += 1;
        let adapter = row.adapter.map(|name| {
            let default = self.cfg.models[m].adapters.as_ref().map_or(ByteSize::new(0), |a| a.default_size);
            let size = ByteSize::new(row.adapter_size.unwrap_or(default.bytes()));
            Adapter::sized(AdapterRef::new(self.models[m].key.clone(), name), size)
        });
        let mut hash_ids = row.hash_ids;
        if let Some(a) = &adapter {
            // An engine keys its prefix cache by adapter too: the same
            // prompt under two adapters shares no block.
            let salt = adapter_salt(&a.id);
            hash_ids.iter_mut().for_each(|h| *h = mix64(*h, salt));
        }
        let id = self.requests.insert(InFlight {
            model: m,
            input_len: row.input_len,
            output_len: row.output_len,
            hash_ids,
            adapter: adapter.is_some(),
            waiting_on: None,
            timing: Timing { arrived: now, ..Timing::default() },
        });
        if let Some(a) = &adapter {
            // The chooser's estimate of a load is the slow tier's, as a
            // live gateway's would be: it does not know the page cache.
            let bytes = a.size.map_or(0, ByteSize::bytes);
            let load_ms = self.cfg.cold_start.adapter_load_ms(bytes, false);
            self.report.adapter_request(m);
            self.models[m].chooser.hint_adapter(id, a, load_ms).expect("sizes checked as the row was read");
        }
        let model = &mut self.models[m];
        if model.kv {
            let r = self.requests.get(id).expect("just inserted");
            let mut parent = ROOT_BLOCK_HASH;
            let blocks: Vec<BlockHash> = r
                .hash_ids
                .iter()
                .map(|&h| {
                    parent = parent.chain(h);
                    parent
                })
                .collect();
            model.chooser.hint(id, &blocks, r.input_len);
        }
        let deadline = Some(ms(now) + model.timeout_ms);
        let submitted = model
            .admission
            .submit(ms(now), id, self.account.clone(), deadline, &mut model.chooser)
            .expect("ids are unique");
        match submitted {
            Submitted::Leased(p) => self.grant(now, m, p.request, p.replica),
            Submitted::Queued => {
                // As `hangar serve`: a request that has to wait tells the
                // controller at once.
                self.admission_touched.push(m);
                let (key, obs, in_flight) = self.observation(now, m, 1);
                self.control.waiting(ms(now), &key, obs, &in_flight);
                self.control_due = None;
            }
            Submitted::Rejected { .. } => {
                self.models[m].counters.2 += 1;
                self.models[m].chooser.done(id);
                self.end(now, id, Outcome::Rejected);
            }
            // The simulation never marks a model unavailable (its requests
            // wait for room until their timeout); were it to, such a
            // request would end unserved.
            Submitted::Unavailable => {
                self.models[m].chooser.done(id);
                self.end(now, id, Outcome::Failed);
            }
        }
        self.carry_out_adapters(now, m);
    }

    /// Decisions an admission took since it was last asked.
    fn admissions(&mut self, now: f64, m: usize) {
        self.admission_touched.push(m);
        while let Some(action) = self.models[m].admission.poll_action() {
            match action {
                Admit::Dispatch(p) => self.grant(now, m, p.request, p.replica),
                Admit::Expired(r) => {
                    self.models[m].chooser.done(r);
                    self.end(now, r, Outcome::TimedOut);
                }
                Admit::Failed { request, .. } | Admit::Unavailable { request, .. } => {
                    self.models[m].chooser.done(request);
                    self.end(now, request, Outcome::Failed);
                }
            }
        }
        self.carry_out_adapters(now, m);
    }

    /// Request `request` got a permit on `replica`: it starts there now,
    /// or once its adapter is loaded there.
    fn grant(&mut self, now: f64, m: usize, request: RequestId, replica: ReplicaId) {
        let Some(r) = self.requests.get_mut(request) else { return };
        r.timing.granted = now;
        if r.adapter {
            r.waiting_on = Some(replica);
            let slot = self.slots[&replica];
            self.replicas[slot].adapter_waiting += 1;
            return;
        }
        self.start_request(now, m, request, replica);
    }

    /// The adapter steps and answers the model's chooser has for the
    /// driver, carried out until there are none.
    fn carry_out_adapters(&mut self, now: f64, m: usize) {
        if !self.models[m].adapters || self.carrying_adapters {
            return;
        }
        self.carrying_adapters = true;
        while let Some(action) = self.models[m].chooser.poll_adapter() {
            match action {
                AdapterAction::Step { on, step: SlotStep::Load { adapter, bytes } } => {
                    let slot = self.slots[&on];
                    let r = &mut self.replicas[slot];
                    let cached = self.adapters_cached.contains(&(r.node.clone(), adapter.clone()));
                    let took = self.cfg.cold_start.adapter_load_ms(bytes, cached);
                    r.adapter_loading = Some(adapter);
                    let generation = r.generation;
                    self.report.adapter_load(m);
                    self.push(now + took, Kind::AdapterLoaded(slot, generation));
                }
                AdapterAction::Step { on, step: SlotStep::Unload { .. } } => {
                    self.report.adapter_unload(m);
                    self.models[m].chooser.adapter_step_done(on, true);
                }
                AdapterAction::Answer(SlotEvent::Ready(request)) => {
                    let Some(r) = self.requests.get_mut(request) else { continue };
                    let Some(replica) = r.waiting_on.take() else { continue };
                    let waited = now - r.timing.granted;
                    self.replicas[self.slots[&replica]].adapter_waiting -= 1;
                    self.report.adapter_ready(m, waited);
                    self.start_request(now, m, request, replica);
                }
                AdapterAction::Answer(SlotEvent::Failed { request, .. }) => {
                    // Loads do not fail in a simulation; were one to, its
                    // requests would end unserved.
                    if let Some(replica) = self.requests.get_mut(request).and_then(|r| r.waiting_on.take()) {
                        self.replicas[self.slots[&replica]].adapter_waiting -= 1;
                    }
                    self.release(now, m, request);
                    self.end(now, request, Outcome::Failed);
                }
            }
        }
        self.carrying_adapters = false;
    }

    /// Replica `slot`'s adapter load finished.
    fn adapter_loaded(&mut self, now: f64, slot: usize) {
        let r = &mut self.replicas[slot];
        let Some(adapter) = r.adapter_loading.take() else { return };
        let (m, id) = (r.model, r.id);
        self.adapters_cached.insert((r.node.clone(), adapter));
        self.models[m].chooser.adapter_step_done(id, true);
        self.carry_out_adapters(now, m);
        self.maybe_drained(now, slot);
    }

    fn start_request(&mut self, now: f64, m: usize, request: RequestId, replica: ReplicaId) {
        let slot = self.slots[&replica];
        let block_size = self.cfg.models[m].engine.block_size;
        let Some(r) = self.requests.get_mut(request) else { return };
        let prompt =
            Prompt::from_trace(r.input_len, &r.hash_ids, self.opts.trace_block_size, block_size, request.0)
                .expect("hash_ids coverage checked");
        let engine = self.replicas[slot].engine.as_mut().expect("a ready replica has its engine");
        let added =
            engine.add_request(EngineRequest { id: request, prompt, max_output_tokens: r.output_len });
        match added {
            Ok(()) => {
                self.touched.push(slot);
                self.account_replica(now, slot);
            }
            Err(_) => {
                self.release(now, m, request);
                self.end(now, request, Outcome::Failed);
            }
        }
    }

    fn release(&mut self, now: f64, m: usize, request: RequestId) {
        let granted = self.requests.get(request).map_or(now, |r| r.timing.granted);
        let model = &mut self.models[m];
        model.admission.release(ms(now), request, &mut model.chooser);
        model.chooser.done(request);
        model.counters.1 += 1;
        model.counters.3 += ms(now).saturating_sub(ms(granted));
        self.admissions(now, m);
    }

    /// Request `id` ends: booked in the report and forgotten. A request
    /// ends once; later calls for it do nothing.
    fn end(&mut self, now: f64, id: RequestId, outcome: Outcome) {
        let Some(mut r) = self.requests.remove(id) else { return };
        r.timing.outcome = outcome;
        r.timing.done = Some(now);
        self.report.ended(r.model, &r.timing);
        self.last_end = self.last_end.max(now);
        self.ended += 1;
        (self.progress)(self.ended);
    }

    fn pass_end(&mut self, now: f64, slot: usize) {
        self.replicas[slot].busy = false;
        let pass = std::mem::take(&mut self.passes[slot]);
        let m = self.replicas[slot].model;
        for t in &pass.tokens {
            // A later token's gap comes with it: the request's record (a
            // cache miss on a large fleet) is read once, for its first.
            if let Some(previous) = t.previous_ms {
                self.report.token_gap(m, now - previous);
                continue;
            }
            let Some(r) = self.requests.get_mut(t.request) else { continue };
            r.timing.first_token = Some(now);
            self.models[m].ttft.record(ms(now), ms(now - r.timing.arrived));
        }
        for id in &pass.completed {
            self.release(now, m, *id);
            self.end(now, *id, Outcome::Completed);
        }
        self.passes[slot] = pass;
        self.touched.push(slot);
        self.account_replica(now, slot);
        self.maybe_drained(now, slot);
    }

    fn start_passes(&mut self, now: f64) {
        let mut touched = std::mem::take(&mut self.touched);
        touched.sort_unstable();
        touched.dedup();
        for &slot in &touched {
            let r = &mut self.replicas[slot];
            if r.busy || !r.has_work() || matches!(r.state, State::Loading { .. } | State::Warm | State::Gone)
            {
                continue;
            }
            let pass = &mut self.passes[slot];
            r.engine.as_mut().expect("it has work").step(now, pass);
            if pass.is_idle() {
                continue;
            }
            r.busy = true;
            let (end, generation) = (pass.end_ms, r.generation);
            self.push(end, Kind::PassEnd(slot, generation));
        }
        touched.clear();
        self.touched = touched;
    }

    /// The controller's actions: engines to start, wake, drain or stop.
    fn carry_out(&mut self, now: f64) {
        while let Some(action) = self.control.poll_action() {
            match action {
                Action::Apply(delta) => {
                    for step in delta.steps() {
                        let d = step.deployment;
                        match step.action {
                            Step::Create => self.create(now, d),
                            Step::FromCache => self.wake(now, d),
                            Step::ToCache => self.drain(now, d.replica_id, true),
                            Step::Delete => self.drain(now, d.replica_id, false),
                            Step::Update => {}
                        }
                    }
                }
                Action::Decided { model, decision } => {
                    if let Some(&m) = self.by_key.get(&model) {
                        self.report.decided(m, now, &decision);
                    }
                }
                Action::Unplaceable { model, .. } => {
                    if let Some(&m) = self.by_key.get(&model) {
                        self.report.unplaceable(m);
                    }
                }
                Action::Placeable { .. } => {}
            }
        }
    }

    /// GPUs a hot deployment holds: its reserved bytes in GPUs of its node.
    fn gpus_of(&self, d: &Deployment) -> f64 {
        let memory =
            self.control.controller().cluster().node(&d.node).map_or(1, |n| n.gpu_memory()).max(1) as f64;
        d.gpu_bytes_by_gpu.values().map(|b| *b as f64 / memory).sum()
    }

    fn create(&mut self, now: f64, d: &Deployment) {
        let Some(&m) = self.by_key.get(&d.model_key) else { return };
        let gbps = self.weights_gbps(&d.node, m);
        // The weights are what loads: the footprint's adapter memory is
        // only set aside.
        let load_ms = self.cfg.models[m].size.bytes() as f64 / (gbps * 1e9) * 1000.0
            + self.cfg.cold_start.boot_ms as f64;
        let engine = EngineCore::new(&self.cfg.models[m].engine, no_tables).expect("validate() built one");
        let gpus = self.gpus_of(d);
        let replica = Replica {
            id: d.replica_id,
            model: m,
            node: d.node.clone(),
            gpus,
            engine: Some(engine),
            state: State::Loading { tier: StartTier::Cold },
            busy: false,
            generation: 0,
            load_started: now,
            adapter_waiting: 0,
            adapter_loading: None,
        };
        let slot = match self.slots.get(&d.replica_id) {
            Some(&slot) => {
                self.replicas[slot] = replica;
                slot
            }
            None => {
                self.replicas.push(replica);
                self.passes.push(Pass::default());
                let slot = self.replicas.len() - 1;
                self.slots.insert(d.replica_id, slot);
                self.by_model[m].push(slot);
                slot
            }
        };
        self.replicas[slot].generation = self.seq;
        self.report.replica_state(slot, m, now, report::Bucket::Loading, gpus);
        let generation = self.replicas[slot].generation;
        self.push(now + load_ms, Kind::Loaded(slot, generation));
    }

    /// How fast a new replica of model `m` on `node` reads its weights: from
    /// the first source the node's weight store would use (docs/store.md,
    /// "Sources, in order") — its resident copy while another replica of
    /// the model holds it on the node (running, draining or asleep:
    /// lease-in-place, at memory speed), the node's page cache once a load
    /// of the model finished there, a peer that holds them, the disk.
    fn weights_gbps(&self, node: &NodeId, m: usize) -> f64 {
        let cs = &self.cfg.cold_start;
        let resident = self.by_model[m].iter().any(|&slot| {
            let r = &self.replicas[slot];
            r.node == *node && matches!(r.state, State::Ready | State::Draining { .. } | State::Warm)
        });
        let here = self.cached.contains(&(node.clone(), m));
        match cs.peer_gbps {
            _ if resident => cs.wake_gbps,
            _ if here => cs.page_cache_gbps,
            Some(peer) if self.cached_nodes[m] > 0 => peer,
            _ => cs.disk_gbps,
        }
    }

    fn wake(&mut self, now: f64, d: &Deployment) {
        let Some(&slot) = self.slots.get(&d.replica_id) else { return self.create(now, d) };
        match self.replicas[slot].state {
            State::Warm => {}
            // Still finishing its requests on the GPU: it simply stays.
            State::Draining { .. } => return self.resume(now, slot),
            State::Loading { .. } | State::Ready => return,
            // Gone replicas leave `slots`; were one found, it starts anew.
            State::Gone => return self.create(now, d),
        }
        let m = self.replicas[slot].model;
        let wake_ms = self.cfg.models[m].size.bytes() as f64 / (self.cfg.cold_start.wake_gbps * 1e9) * 1000.0;
        let gpus = self.gpus_of(d);
        let r = &mut self.replicas[slot];
        r.engine =
            Some(EngineCore::new(&self.cfg.models[m].engine, no_tables).expect("validate() built one"));
        r.state = State::Loading { tier: StartTier::Warm };
        r.gpus = gpus;
        r.load_started = now;
        self.report.replica_state(slot, m, now, report::Bucket::Loading, gpus);
        let generation = r.generation;
        self.push(now + wake_ms, Kind::Loaded(slot, generation));
    }

    /// A draining replica wanted again before it went: back in service, no
    /// load (its weights never left the GPU).
    fn resume(&mut self, now: f64, slot: usize) {
        let r = &mut self.replicas[slot];
        r.state = State::Ready;
        let (m, id) = (r.model, r.id);
        let model = &mut self.models[m];
        let permits = model.permits;
        model.admission.replica_ready(ms(now), id, permits, &mut model.chooser);
        self.account_replica(now, slot);
        self.admissions(now, m);
    }

    fn loaded(&mut self, now: f64, slot: usize) {
        let State::Loading { tier } = self.replicas[slot].state else { return };
        let r = &mut self.replicas[slot];
        r.state = State::Ready;
        let (m, id, took) = (r.model, r.id, now - r.load_started);
        if tier == StartTier::Cold && !self.cached.contains(&(r.node.clone(), m)) {
            // The weights read for this load are now in the node's page
            // cache; a start beside it before this moment read the disk.
            // Placement is told, as a live agent tells it what its store
            // holds: among equal nodes it prefers this one for the model.
            let node = r.node.clone();
            self.cached.insert((node.clone(), m));
            self.cached_nodes[m] += 1;
            let held = self.cached.range((node.clone(), 0)..=(node.clone(), usize::MAX));
            let artifacts = held.map(|(_, m)| self.models[*m].key.to_string()).collect();
            self.control.set_resident(ms(now), &node, artifacts);
        }
        self.report.cold_start(m, tier, self.cfg.models[m].hotswap, took);
        self.account_replica(now, slot);
        let key = self.models[m].key.clone();
        // Simulated engines sleep (they model vLLM's sleep mode).
        self.control.handle_ready(ms(now), &key, tier, took as Millis, true);
        self.control_due = None;
        let model = &mut self.models[m];
        let permits = model.permits;
        model.admission.replica_ready(ms(now), id, permits, &mut model.chooser);
        self.admissions(now, m);
    }

    /// A replica leaves service: it takes no new request, finishes what it
    /// has, then goes WARM (`to_warm`) or away.
    fn drain(&mut self, now: f64, replica: ReplicaId, to_warm: bool) {
        let Some(&slot) = self.slots.get(&replica) else { return };
        let m = self.replicas[slot].model;
        match self.replicas[slot].state {
            State::Loading { .. } => {
                // Never served: it stops loading, and leaves nothing behind
                // — its weights never all reached the GPU, so there is no
                // WARM copy to sleep, whatever placement was told. Should
                // placement wake it later, that is a COLD start (`wake`
                // finds no replica and creates one).
                self.replicas[slot].generation = self.seq;
                self.gone(now, slot);
                return;
            }
            State::Warm if !to_warm => return self.gone(now, slot),
            State::Warm | State::Gone => return,
            State::Ready | State::Draining { .. } => {}
        }
        self.replicas[slot].state = State::Draining { to_warm };
        self.models[m].admission.replica_unhealthy(ms(now), replica);
        self.maybe_drained(now, slot);
    }

    fn maybe_drained(&mut self, now: f64, slot: usize) {
        let r = &self.replicas[slot];
        let State::Draining { to_warm } = r.state else { return };
        if r.busy || r.has_work() {
            return;
        }
        let (m, id) = (r.model, r.id);
        let model = &mut self.models[m];
        model.admission.replica_gone(ms(now), id);
        model.chooser.replica_gone(id);
        self.admissions(now, m);
        let r = &mut self.replicas[slot];
        r.generation = self.seq;
        r.engine = None;
        if to_warm {
            r.state = State::Warm;
            self.report.replica_state(slot, m, now, report::Bucket::Warm, 0.0);
        } else {
            self.gone(now, slot);
        }
    }

    /// Replica `slot` is no more: nothing of it is left, and nothing looks
    /// it up again.
    fn gone(&mut self, now: f64, slot: usize) {
        let r = &mut self.replicas[slot];
        let (m, id) = (r.model, r.id);
        r.engine = None;
        r.state = State::Gone;
        self.report.replica_state(slot, m, now, report::Bucket::Gone, 0.0);
        self.slots.remove(&id);
        self.by_model[m].retain(|&s| s != slot);
    }

    /// Books a ready or draining replica as busy or idle, as it is now.
    fn account_replica(&mut self, now: f64, slot: usize) {
        let r = &self.replicas[slot];
        if !matches!(r.state, State::Ready | State::Draining { .. }) {
            return;
        }
        let bucket = if r.busy || r.has_work() { report::Bucket::Busy } else { report::Bucket::Idle };
        let (gpus, m) = (r.gpus, r.model);
        self.report.replica_state(slot, m, now, bucket, gpus);
    }

    fn finish(mut self) -> FleetReport {
        let end = self.last_end;
        for slot in 0..self.replicas.len() {
            let m = self.replicas[slot].model;
            self.report.replica_state(slot, m, end, report::Bucket::Gone, 0.0);
        }
        // The engines are done with: their memory goes before the report's
        // is taken.
        self.replicas.clear();
        self.passes.clear();
        let record = self.control.take_record();
        let mut report = self.report.finish(self.cfg, &self.source, self.control.controller(), end);
        report.control_record = record;
        report
    }
}
