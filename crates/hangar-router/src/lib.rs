//! Replica selection.
//!
//! A [`Router`] picks, for each request, the worker (replica) that should
//! serve it. It is a sans-IO state machine: the driver tells it about workers
//! ([`Router::add_worker`]), requests ([`Router::route`]), their progress
//! ([`Router::prefill_done`], [`Router::finished`]) and the workers' KV cache
//! changes ([`Router::apply_kv_events`]); it never reads a clock, and its
//! only randomness — breaking ties — comes from a seeded generator, so a
//! replay routes identically every time.
//!
//! Policies ([`RouterPolicy`]):
//! - `round-robin`: workers in turn.
//! - `least-outstanding`: the worker with the fewest requests in flight.
//! - `kv`: the lowest cost, where for worker *w*
//!   `cost = prefill_load_scale × (max(0, prompt blocks − overlap_credit ×
//!   overlap_w) + queued prefill blocks_w) + active blocks_w +
//!   active_request_weight × requests_w`. `overlap_w` is how many leading
//!   blocks of the prompt *w* has cached, from its KV events; queued
//!   prefill blocks are the uncached prompt blocks of *w*'s requests that have
//!   not produced a first token yet; active blocks are the prompt blocks of
//!   all of *w*'s requests in flight. Shared prefixes count once per request:
//!   the term estimates decode work, and a decode step attends over each
//!   request's whole context whether or not its KV is shared (the timing
//!   model charges decode by summed context tokens for the same reason).
//! - `adapter`: for a request naming a LoRA adapter, the lowest
//!   `requests_w + loads_w × load_ms / request_ms`, where `requests_w` is
//!   what `least-outstanding` counts and `loads_w` how many adapter loads
//!   must begin on *w* before the request could run there — 0 when *w*
//!   holds the adapter or is loading it — so a replica lacking it costs
//!   about its load time in requests in flight, as `kv` weighs a prompt's
//!   uncached blocks against load. A replica that cannot load it until a
//!   request in flight there ends (every slot in use) comes last. Without
//!   an adapter it is `least-outstanding`. This is also Replicate's *prefer
//!   same stream* for hotswap versions: a worker that holds a version's
//!   weights serves that version again rather than swapping.
//!
//! Every policy loads adapters the same way: each worker has its
//! [`AdapterSlots`] (at most `slots` adapters and `memory` bytes, the
//! least recently used unused one unloaded to make room), which the router
//! asks to hold a routed request's adapter; the steps it takes and the
//! requests that may then run come out of [`Router::poll_adapter`]. Only
//! `adapter` reads them to choose; the others are the baselines it is
//! compared with.
//!
//! ```
//! use hangar_core::{BlockHash, KvEvent, RequestId};
//! use hangar_router::{RouteRequest, Router, RouterPolicy, KvRouterConfig, WorkerId};
//!
//! let mut router = Router::new(RouterPolicy::Kv, 64, 7).with_kv(KvRouterConfig::default());
//! router.add_worker(WorkerId(0));
//! router.add_worker(WorkerId(1));
//! let prompt = [BlockHash(11), BlockHash(12)];
//! router.apply_kv_events(WorkerId(1), &[KvEvent::Stored { parent: None, blocks: prompt.to_vec() }]);
//! let w = router.route(&RouteRequest { id: RequestId(1), blocks: &prompt, prompt_tokens: 128, adapter: None }).unwrap();
//! assert_eq!(w, WorkerId(1));
//! ```
#![deny(missing_docs)]

mod chooser;
mod index;
mod slots;

use hangar_core::{BlockHash, KvEvent, RequestId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

pub use chooser::{
    text_blocks, ApproxKvConfig, ReplicaChooser, FAILING_COOL_DOWN_MAX_MS, FAILING_COOL_DOWN_MS,
    FAILING_STREAK, REFUSAL_COOL_DOWN_MS,
};
use hangar_core::AdapterRef;
use index::{KvIndex, WorkerSet};
pub use slots::{Acquired, AdapterConfig, AdapterSlots, Holding, SlotEvent, SlotStep, SlotsError};

/// A worker (replica) as the router knows it: a small dense index the driver
/// assigns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct WorkerId(pub u32);

/// Weights of the KV-aware cost (see the crate docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvRouterConfig {
    /// Weight of the prefill work a worker would have to do.
    pub prefill_load_scale: f64,
    /// How much one cached overlap block discounts the new prefill blocks.
    pub overlap_credit: f64,
    /// Weight of the number of requests in flight.
    pub active_request_weight: f64,
}

impl Default for KvRouterConfig {
    fn default() -> Self {
        Self { prefill_load_scale: 1.0, overlap_credit: 1.0, active_request_weight: 0.0 }
    }
}

/// How a replica is chosen: the one routing-policy type of Hangar, for
/// `hangar serve`'s `router`, `hangar sim --router`, the fleet file's
/// `router` and every chooser.
///
/// Spelled in kebab-case (`round-robin`, `least-outstanding`, `kv`,
/// `adapter`); the snake_case spellings are accepted as aliases. The KV policy's weights
/// are a [`KvRouterConfig`] of their own ([`Router::with_kv`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouterPolicy {
    /// Workers in turn.
    #[serde(alias = "round_robin")]
    RoundRobin,
    /// Fewest requests in flight.
    #[default]
    #[serde(alias = "least_outstanding")]
    LeastOutstanding,
    /// Lowest KV-aware cost.
    Kv,
    /// Fewest requests in flight, a replica lacking the request's adapter
    /// counting its load time as requests (see the crate docs).
    Adapter,
}

impl RouterPolicy {
    /// Every policy, in the order help texts list them.
    pub const ALL: [RouterPolicy; 4] = [Self::RoundRobin, Self::LeastOutstanding, Self::Kv, Self::Adapter];

    /// Parses a policy name (`round-robin`, `least-outstanding`, `kv`,
    /// `adapter`, or the snake_case aliases).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "round_robin" | "round-robin" | "rr" => Some(Self::RoundRobin),
            "least_outstanding" | "least-outstanding" => Some(Self::LeastOutstanding),
            "kv" => Some(Self::Kv),
            "adapter" => Some(Self::Adapter),
            _ => None,
        }
    }

    /// The policy's canonical name.
    pub fn name(&self) -> &'static str {
        match self {
            Self::RoundRobin => "round-robin",
            Self::LeastOutstanding => "least-outstanding",
            Self::Kv => "kv",
            Self::Adapter => "adapter",
        }
    }
}

impl std::fmt::Display for RouterPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for RouterPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::from_name(s).ok_or_else(|| {
            format!("unknown routing policy `{s}`: expected round-robin, least-outstanding, kv or adapter")
        })
    }
}

/// What the router needs to know about a request.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// The request; must not be in flight already.
    pub id: RequestId,
    /// Chained hashes of the prompt's full blocks.
    pub blocks: &'a [BlockHash],
    /// Prompt length in tokens (the last, partial block counts as a block).
    pub prompt_tokens: u32,
    /// The LoRA adapter it runs with, if any.
    pub adapter: Option<AdapterAsk<'a>>,
}

/// A request's adapter, as the router weighs and loads it.
#[derive(Debug, Clone, Copy)]
pub struct AdapterAsk<'a> {
    /// Which adapter.
    pub adapter: &'a AdapterRef,
    /// Its size (the driver's default for one of unknown size).
    pub bytes: u64,
    /// About how long loading it takes, ms: what the `adapter` policy
    /// charges a replica that would have to.
    pub load_ms: f64,
}

/// What the driver does for adapters, pulled from
/// [`Router::poll_adapter`] (`W`: a [`WorkerId`]) or
/// [`ReplicaChooser::poll_adapter`] (a [`ReplicaId`](hangar_core::ReplicaId)).
///
/// Every request routed with an adapter gets exactly one answer —
/// [`SlotEvent::Ready`] or [`SlotEvent::Failed`] — unless it finishes
/// first; send it to its worker only on `Ready`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdapterAction<W> {
    /// Carry out `step` on worker `on`'s engine, then report how it went
    /// ([`Router::adapter_step_done`]). A worker has one step in flight
    /// at a time.
    Step {
        /// The worker.
        on: W,
        /// What to do.
        step: SlotStep,
    },
    /// What became of a routed request: its adapter is loaded on its
    /// worker (`Ready`: send it), or failed to load there (`Failed`: it
    /// will not run there; end it, or route it again after
    /// [`Router::finished`]).
    Answer(SlotEvent),
}

/// Why a request could not be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouteError {
    /// No worker has been added (or all were removed).
    #[error("no worker to route to")]
    NoWorkers,
    /// The request is already in flight.
    #[error("request {0} is already routed")]
    Duplicate(RequestId),
    /// The request's adapter can never be held (larger than a worker's
    /// adapter memory).
    #[error(transparent)]
    Adapter(#[from] SlotsError),
}

#[derive(Debug)]
struct WorkerLoad {
    requests: u32,
    queued_prefill_blocks: u64,
    /// Prompt blocks (the last partial one included) of requests in flight.
    active_blocks: u64,
    /// The adapters it holds.
    slots: AdapterSlots,
}

/// What the `adapter` policy adds for a worker that cannot load the
/// request's adapter until a request in flight there ends: more than any
/// other cost, so such a worker is chosen only when every candidate is
/// one (and then the least busy).
const BLOCKED_COST: f64 = 1e12;

#[derive(Debug)]
struct InFlight {
    worker: WorkerId,
    prompt_blocks: u64,
    prefill_blocks: u64,
    prefilling: bool,
    /// It holds its worker's adapter slots.
    adapter: bool,
}

/// The router state machine. See the crate docs.
#[derive(Debug)]
pub struct Router {
    policy: RouterPolicy,
    kv: KvRouterConfig,
    adapters: AdapterConfig,
    adapter_actions: std::collections::VecDeque<AdapterAction<WorkerId>>,
    block_size: u32,
    rng: ChaCha8Rng,
    workers: Vec<Option<WorkerLoad>>,
    live: WorkerSet,
    next_rr: usize,
    index: KvIndex,
    in_flight: FxHashMap<RequestId, InFlight>,
    scratch_overlap: Vec<u32>,
    scratch_ties: Vec<WorkerId>,
    scratch_set: WorkerSet,
}

impl Router {
    /// A router with no workers yet. `block_size` must be the engines'
    /// (prompt block hashes are cut at it); `seed` fixes tie-breaking.
    pub fn new(policy: RouterPolicy, block_size: u32, seed: u64) -> Self {
        Self {
            policy,
            kv: KvRouterConfig::default(),
            adapters: AdapterConfig::default(),
            adapter_actions: std::collections::VecDeque::new(),
            block_size: block_size.max(1),
            rng: ChaCha8Rng::seed_from_u64(seed),
            workers: Vec::new(),
            live: WorkerSet::default(),
            next_rr: 0,
            index: KvIndex::default(),
            in_flight: FxHashMap::default(),
            scratch_overlap: Vec::new(),
            scratch_ties: Vec::new(),
            scratch_set: WorkerSet::default(),
        }
    }

    /// Sets the KV policy's weights (default [`KvRouterConfig::default`]).
    pub fn with_kv(mut self, kv: KvRouterConfig) -> Self {
        self.kv = kv;
        self
    }

    /// Sets each worker's adapter slots and the `adapter` policy's price of
    /// a load (default [`AdapterConfig::default`]); for workers added
    /// after.
    pub fn with_adapters(mut self, adapters: AdapterConfig) -> Self {
        self.adapters = adapters;
        self
    }

    /// The adapter settings in use.
    pub fn adapter_config(&self) -> &AdapterConfig {
        &self.adapters
    }

    /// The policy in use.
    pub fn policy(&self) -> RouterPolicy {
        self.policy
    }

    /// Makes a worker routable. Adding a live worker again does nothing.
    pub fn add_worker(&mut self, w: WorkerId) {
        let i = w.0 as usize;
        if self.workers.len() <= i {
            self.workers.resize_with(i + 1, || None);
        }
        if self.workers[i].is_none() {
            self.workers[i] = Some(WorkerLoad {
                requests: 0,
                queued_prefill_blocks: 0,
                active_blocks: 0,
                slots: AdapterSlots::new(&self.adapters),
            });
            self.live.insert(w);
        }
    }

    /// Stops routing to a worker and forgets its cache, its adapters and
    /// its requests (the driver re-routes or fails them); adapter actions
    /// for it or its requests not yet pulled are dropped.
    pub fn remove_worker(&mut self, w: WorkerId) {
        if let Some(slot) = self.workers.get_mut(w.0 as usize) {
            *slot = None;
        }
        self.live.remove(w);
        self.index.forget_worker(w);
        let in_flight = &self.in_flight;
        self.adapter_actions.retain(|a| match a {
            AdapterAction::Step { on, .. } => *on != w,
            AdapterAction::Answer(SlotEvent::Ready(r) | SlotEvent::Failed { request: r, .. }) => {
                in_flight.get(r).is_none_or(|f| f.worker != w)
            }
        });
        self.in_flight.retain(|_, f| f.worker != w);
    }

    /// The adapter slots of worker `w`, if it is live.
    pub fn adapter_slots(&self, w: WorkerId) -> Option<&AdapterSlots> {
        self.load(w).map(|l| &l.slots)
    }

    /// The next adapter step to carry out or request that may now run (or
    /// will not). Drain it after every call that routes, finishes or
    /// reports a step.
    pub fn poll_adapter(&mut self) -> Option<AdapterAction<WorkerId>> {
        self.adapter_actions.pop_front()
    }

    /// Worker `w`'s adapter step in flight ended, `ok` if its engine did it
    /// (see [`AdapterSlots::step_done`]). Nothing happens for a worker
    /// that is gone or had no step in flight.
    pub fn adapter_step_done(&mut self, w: WorkerId, ok: bool) {
        let Some(load) = self.workers.get_mut(w.0 as usize).and_then(Option::as_mut) else { return };
        if load.slots.step_done(ok) {
            self.drain_slots(w);
        }
    }

    /// Moves worker `w`'s slots' events and next step to the actions.
    fn drain_slots(&mut self, w: WorkerId) {
        let slots = &mut self.workers[w.0 as usize].as_mut().expect("live worker").slots;
        while let Some(event) = slots.poll_event() {
            self.adapter_actions.push_back(AdapterAction::Answer(event));
        }
        if let Some(step) = slots.poll_step() {
            self.adapter_actions.push_back(AdapterAction::Step { on: w, step });
        }
    }

    /// Applies a worker's KV events (in the order the worker emitted them).
    /// Events of unknown workers are ignored.
    pub fn apply_kv_events(&mut self, w: WorkerId, events: &[KvEvent]) {
        if self.live.contains(w) {
            self.index.apply(w, events);
        }
    }

    /// Whether every worker has at least `limit` prompt blocks routed to it
    /// and not yet prefilled: Dynamo's test for holding a request in the
    /// router's own queue rather than sending it to an engine whose prefill
    /// backlog is already long (`hangar sim --router-queue`). A router with
    /// no workers is saturated.
    pub fn saturated(&self, limit: u64) -> bool {
        self.workers.iter().flatten().all(|l| l.queued_prefill_blocks >= limit)
    }

    /// Requests in flight on `w`.
    pub fn outstanding(&self, w: WorkerId) -> u32 {
        self.load(w).map_or(0, |l| l.requests)
    }

    fn load(&self, w: WorkerId) -> Option<&WorkerLoad> {
        self.workers.get(w.0 as usize).and_then(Option::as_ref)
    }

    fn load_mut(&mut self, w: WorkerId) -> &mut WorkerLoad {
        self.workers[w.0 as usize].as_mut().expect("live worker")
    }

    /// Chooses a worker for `req` and counts the request as in flight there
    /// until [`finished`](Self::finished).
    pub fn route(&mut self, req: &RouteRequest<'_>) -> Result<WorkerId, RouteError> {
        let live = std::mem::take(&mut self.scratch_set);
        let live = self.scratch_set_of(live, None);
        self.route_in(req, live)
    }

    /// Like [`route`](Self::route), but only among `candidates` (live
    /// workers; others are ignored): for a driver that routes among the
    /// replicas with a free slot, such as an admission queue.
    pub fn route_among(
        &mut self,
        req: &RouteRequest<'_>,
        candidates: &[WorkerId],
    ) -> Result<WorkerId, RouteError> {
        let set = std::mem::take(&mut self.scratch_set);
        let set = self.scratch_set_of(set, Some(candidates));
        self.route_in(req, set)
    }

    /// `set` refilled with the live workers, or those of `only` that live.
    fn scratch_set_of(&self, mut set: WorkerSet, only: Option<&[WorkerId]>) -> WorkerSet {
        set.clone_from(&self.live);
        if let Some(only) = only {
            let mut wanted = WorkerSet::default();
            for &w in only {
                wanted.insert(w);
            }
            set.intersect(&wanted);
        }
        set
    }

    fn route_in(&mut self, req: &RouteRequest<'_>, set: WorkerSet) -> Result<WorkerId, RouteError> {
        let chosen = self.choose_in(req, &set);
        self.scratch_set = set;
        chosen
    }

    fn choose_in(&mut self, req: &RouteRequest<'_>, set: &WorkerSet) -> Result<WorkerId, RouteError> {
        if set.is_empty() {
            return Err(RouteError::NoWorkers);
        }
        if self.in_flight.contains_key(&req.id) {
            return Err(RouteError::Duplicate(req.id));
        }
        if let Some(ask) = &req.adapter {
            self.adapters.check_fits(ask.adapter, ask.bytes)?;
        }
        let prompt_blocks = u64::from(req.prompt_tokens.div_ceil(self.block_size));
        let (w, overlap) = match self.policy {
            RouterPolicy::RoundRobin => (self.pick_round_robin(set), 0),
            RouterPolicy::LeastOutstanding => {
                let w = self.pick_min(set, |l, _| f64::from(l.requests));
                (w, 0)
            }
            RouterPolicy::Kv => {
                let cfg = self.kv.clone();
                let mut overlap = std::mem::take(&mut self.scratch_overlap);
                overlap.clear();
                overlap.resize(self.workers.len(), 0);
                self.index.overlaps(req.blocks, set, &mut overlap);
                let w = self.pick_min(set, |l, w| {
                    let ov = f64::from(overlap[w.0 as usize]);
                    let new_prefill = (prompt_blocks as f64 - cfg.overlap_credit * ov).max(0.0);
                    cfg.prefill_load_scale * (new_prefill + l.queued_prefill_blocks as f64)
                        + l.active_blocks as f64
                        + cfg.active_request_weight * f64::from(l.requests)
                });
                let ov = overlap[w.0 as usize];
                self.scratch_overlap = overlap;
                (w, ov)
            }
            RouterPolicy::Adapter => {
                let (ask, request_ms) = (req.adapter, self.adapters.request_ms);
                let w = self.pick_min(set, |l, _| {
                    let load = f64::from(l.requests);
                    let Some(ask) = ask else { return load };
                    match l.slots.loads_before_ready(ask.adapter, ask.bytes) {
                        Some(loads) => load + f64::from(loads) * ask.load_ms / request_ms,
                        None => BLOCKED_COST + load,
                    }
                });
                (w, 0)
            }
        };
        let prefill_blocks = prompt_blocks.saturating_sub(u64::from(overlap));
        let load = self.load_mut(w);
        load.requests += 1;
        load.queued_prefill_blocks += prefill_blocks;
        load.active_blocks += prompt_blocks;
        if let Some(ask) = &req.adapter {
            let acquired =
                load.slots.acquire(req.id, ask.adapter, ask.bytes).expect("checked to fit; not in flight");
            if acquired == Acquired::Ready {
                self.adapter_actions.push_back(AdapterAction::Answer(SlotEvent::Ready(req.id)));
            }
            self.drain_slots(w);
        }
        let adapter = req.adapter.is_some();
        self.in_flight
            .insert(req.id, InFlight { worker: w, prompt_blocks, prefill_blocks, prefilling: true, adapter });
        Ok(w)
    }

    /// The request produced its first token: its prefill no longer queues
    /// on its worker.
    pub fn prefill_done(&mut self, id: RequestId) {
        let Some(f) = self.in_flight.get_mut(&id) else { return };
        if !f.prefilling {
            return;
        }
        f.prefilling = false;
        let (w, n) = (f.worker, f.prefill_blocks);
        let load = self.load_mut(w);
        load.queued_prefill_blocks -= n;
    }

    /// The request left its worker (completed, failed or aborted): it no
    /// longer counts there, and its adapter is no longer in use by it —
    /// which may let a waiting adapter in (drain
    /// [`poll_adapter`](Self::poll_adapter)).
    pub fn finished(&mut self, id: RequestId) {
        let Some(f) = self.in_flight.remove(&id) else { return };
        let load = self.workers[f.worker.0 as usize].as_mut().expect("live worker");
        load.requests -= 1;
        if f.prefilling {
            load.queued_prefill_blocks -= f.prefill_blocks;
        }
        load.active_blocks -= f.prompt_blocks;
        if f.adapter {
            load.slots.release(id);
            // An answer not yet pulled is no longer wanted.
            self.adapter_actions.retain(|a| !matches!(a, AdapterAction::Answer(SlotEvent::Ready(r) | SlotEvent::Failed { request: r, .. }) if *r == id));
            self.drain_slots(f.worker);
        }
    }

    /// The first worker of `set` at or after the one after the last pick.
    fn pick_round_robin(&mut self, set: &WorkerSet) -> WorkerId {
        let n = self.workers.len();
        for k in 0..n {
            let i = (self.next_rr + k) % n;
            if set.contains(WorkerId(i as u32)) {
                self.next_rr = i + 1;
                return WorkerId(i as u32);
            }
        }
        unreachable!("callers checked that the set has a live worker")
    }

    /// The live worker with the lowest cost; ties broken uniformly at random
    /// with the seeded generator.
    fn pick_min(&mut self, set: &WorkerSet, cost: impl Fn(&WorkerLoad, WorkerId) -> f64) -> WorkerId {
        let mut best = f64::INFINITY;
        let ties = &mut self.scratch_ties;
        ties.clear();
        for w in set.iter() {
            let c = cost(self.workers[w.0 as usize].as_ref().expect("live worker"), w);
            if c < best {
                best = c;
                ties.clear();
                ties.push(w);
            } else if c == best {
                ties.push(w);
            }
        }
        if ties.len() == 1 {
            ties[0]
        } else {
            ties[self.rng.random_range(0..ties.len())]
        }
    }
}

#[cfg(test)]
mod tests;
