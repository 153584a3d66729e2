//! Admission control: who runs now, who waits, who is told to back off.
//!
//! Each model has one [`Admission`] state machine. Its ready replicas each
//! grant up to `limit` permits (concurrent requests). A request that finds
//! a free permit is *leased* at once; otherwise it waits in a bounded line —
//! FIFO across all accounts, or fair: round-robin over accounts, FIFO within
//! each — and is *dispatched* when a permit frees; when the line is full it
//! is *rejected* (the gateway answers 429). Waiting requests may carry a
//! deadline, after which they *expire* (504). This is Workers AI's
//! constellation-server design (permits, `ModelRequestQueue`, the three
//! outcomes Leased / Queued / NoSlotsAvailable) as a sans-IO state machine.
//!
//! The machine never reads a clock, sleeps or spawns. Inputs are method
//! calls carrying `now`; decisions taken later than the call that caused
//! them (dispatches, expiries, failures) are pulled with
//! [`Admission::poll_action`]; [`Admission::poll_timeout`] names the next
//! deadline, after which the driver calls [`Admission::handle_timeout`].
//! Which free replica a request gets is the caller's choice, through a
//! [`Chooser`] (e.g. the KV-aware router), so this crate knows nothing
//! about prompts.
//!
//! How many replicas a model should have is not this crate's question:
//! `hangar-scaler` decides it from what it observes of the line.
//!
//! # Waiting for a model that cannot run
//! A request waits with a [`Patience`]. A synchronous client holds a
//! connection open and is better told at once that nothing can serve it
//! than kept until its timeout: it *fails fast*. An async prediction is
//! durable and has deadlines of its own: it is *patient*. When the driver
//! learns that the model cannot run now — its controller found no room
//! for a replica and none is up — it says so with
//! [`Admission::set_unavailable`]: every fail-fast waiter is turned away
//! ([`Action::Unavailable`], HTTP 503 with `Retry-After`), and so is every
//! fail-fast request submitted while it stays so and finds no free permit
//! ([`Submitted::Unavailable`]); patient ones wait on, until a replica
//! comes or their deadline passes. It lasts until the driver clears it or
//! a replica becomes ready. [`Admission::fail_waiting`] (the model's
//! engine does not start at all) still fails everyone waiting.
//!
//! Invariants, after every call: no replica has more permits out than its
//! limit; either nobody waits or no healthy replica has a free permit; no
//! fail-fast request waits while the model is unavailable; every
//! submitted request reaches exactly one end (leased or dispatched and later
//! released, rejected, expired, cancelled, turned away, or failed).
//!
//! ```
//! use hangar_core::{AccountId, ReplicaId, RequestId};
//! use hangar_queue::{Action, Admission, AdmissionConfig, FirstFree, Submitted};
//!
//! let mut a = Admission::new(AdmissionConfig { capacity: 1, ..AdmissionConfig::default() });
//! let r = ReplicaId::from_u128(1);
//! a.replica_ready(0, r, 1, &mut FirstFree);
//! let acct: AccountId = "acme".parse().unwrap();
//! assert!(matches!(a.submit(0, RequestId(1), acct.clone(), None, &mut FirstFree), Ok(Submitted::Leased(_))));
//! assert_eq!(a.submit(0, RequestId(2), acct.clone(), None, &mut FirstFree), Ok(Submitted::Queued));
//! assert!(matches!(a.submit(0, RequestId(3), acct, None, &mut FirstFree), Ok(Submitted::Rejected { .. })));
//! a.release(5, RequestId(1), &mut FirstFree);
//! assert!(matches!(a.poll_action(), Some(Action::Dispatch(p)) if p.request == RequestId(2)));
//! ```
#![deny(missing_docs)]

mod waiting;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use hangar_core::{AccountId, BlockHash, Millis, ReplicaId, RequestId};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use waiting::Waiting;

/// How the waiting line is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum QueueAlgorithm {
    /// Arrival order across all accounts; `capacity` bounds the whole line.
    #[default]
    Fifo,
    /// Round-robin over accounts, arrival order within each; `capacity`
    /// bounds each account's line, so one busy account cannot crowd out
    /// the others.
    Fair,
}

/// A model's admission settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// How the line is served.
    pub algorithm: QueueAlgorithm,
    /// Requests that may wait (in all for FIFO, per account for fair);
    /// 0 rejects whatever cannot run at once.
    pub capacity: usize,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self { algorithm: QueueAlgorithm::Fifo, capacity: 100 }
    }
}

/// The most requests one line may hold (per account when fair): seed
/// 001's bound for Workers AI's queues.
pub const MAX_CAPACITY: usize = 1_000;

impl AdmissionConfig {
    /// The line's length when none is configured, for a model with
    /// `permits` permits at its most replicas: four waiting per permit, 1
    /// to [`MAX_CAPACITY`]. `hangar serve` and the fleet simulation size
    /// their lines with it.
    pub fn default_capacity(permits: usize) -> usize {
        permits.saturating_mul(4).clamp(1, MAX_CAPACITY)
    }
}

/// A right to send one request to one replica, held until released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Permit {
    /// The request holding it.
    pub request: RequestId,
    /// The replica it is for.
    pub replica: ReplicaId,
}

/// How a request waits for a permit (see the crate docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Patience {
    /// Turned away at once while the model is unavailable (a synchronous
    /// request: its client waits on an open connection).
    #[default]
    FailFast,
    /// Waits until a permit frees or its deadline passes, whatever the
    /// model's state (an async prediction, durable, with deadlines of its
    /// own).
    Patient,
}

/// What [`Admission::submit`] decided at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submitted {
    /// A permit was free: send the request now.
    Leased(Permit),
    /// The request waits; an [`Action::Dispatch`] or [`Action::Expired`]
    /// (or [`Action::Failed`]) will follow.
    Queued,
    /// Every permit is taken and the line is full: tell the client to back
    /// off (HTTP 429).
    Rejected {
        /// The line's capacity that was reached.
        capacity: usize,
    },
    /// A fail-fast request found no free permit while the model is
    /// unavailable: tell the client why ([`Admission::unavailable`]) and
    /// to retry later (HTTP 503 with `Retry-After`).
    Unavailable,
}

/// A decision taken after the call that caused it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// A waiting request got a permit: send it now.
    Dispatch(Permit),
    /// A waiting request's deadline passed (HTTP 504).
    Expired(RequestId),
    /// A waiting request will not be served (HTTP 503).
    Failed {
        /// The request.
        request: RequestId,
        /// Why.
        reason: String,
    },
    /// A waiting fail-fast request was turned away because the model
    /// became unavailable (HTTP 503 with `Retry-After`: it may succeed
    /// later).
    Unavailable {
        /// The request.
        request: RequestId,
        /// Why, as [`Admission::set_unavailable`] was told.
        reason: String,
    },
}

/// Misuse of the state machine by its driver.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdmissionError {
    /// The request id is already admitted or waiting.
    #[error("request {0} is already admitted")]
    Duplicate(RequestId),
}

/// A healthy replica with at least one free permit, as a [`Chooser`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreeReplica {
    /// The replica.
    pub id: ReplicaId,
    /// Permits it has out.
    pub in_use: u32,
    /// Permits it has in all.
    pub limit: u32,
}

/// Picks the replica for a request among those with a free permit.
///
/// The driver may tell a chooser more than [`Admission`] does: what a
/// request's prompt is ([`hint`](Self::hint), before submitting it), that
/// a replica refused a request for want of capacity ([`avoid`](Self::avoid)
/// for that request, [`refused`](Self::refused) for the ones after), when a
/// request is over ([`done`](Self::done)) and when a replica is gone
/// ([`replica_gone`](Self::replica_gone)). Choosers that need none of it
/// (the default methods do nothing) stay one-liners. The routing
/// policies (`round-robin`, `least-outstanding`, `kv`) are
/// `hangar-router`'s `ReplicaChooser`, one implementation for the live
/// server and the simulator; [`FirstFree`] is the simplest chooser.
pub trait Chooser {
    /// Returns the id of one element of `free` (never empty; sorted by id)
    /// at `now` (the clock of every `now` the [`Admission`] is given).
    /// Returning anything else falls back to `free[0]`.
    fn choose(&mut self, now: Millis, request: RequestId, free: &[FreeReplica]) -> ReplicaId;

    /// The prompt of a request about to be submitted: its chained block
    /// hashes and its length in tokens.
    fn hint(&mut self, _request: RequestId, _blocks: &[BlockHash], _tokens: u32) {}

    /// `replica` refused the request for want of capacity (it answered 429
    /// or 503): while another replica has a free permit, choose that one.
    /// Only a hint — when the refusing replica is the only one free, it is
    /// chosen, so no request waits while a permit is free.
    fn avoid(&mut self, _request: RequestId, _replica: ReplicaId) {}

    /// `replica` refused a request for want of capacity at `now`: for a
    /// while, choose it only when every other free replica refused too.
    /// Like [`avoid`](Self::avoid), only an order — a free permit is never
    /// left unused while a request waits.
    fn refused(&mut self, _now: Millis, _replica: ReplicaId) {}

    /// `replica` answered a request at `now`: with a server error
    /// (`failed`: an engine's 500, 502 or 504, not a refusal for capacity)
    /// or not. A chooser may put a replica that fails request after request
    /// last for a while, as one that refused; it returns how long (ms) when
    /// this answer made it so, for the driver to say.
    fn answered(&mut self, _now: Millis, _replica: ReplicaId, _failed: bool) -> Option<Millis> {
        None
    }

    /// The request is over, served or not; forget it.
    fn done(&mut self, _request: RequestId) {}

    /// The replica is gone; forget it.
    fn replica_gone(&mut self, _replica: ReplicaId) {}
}

/// The free replica with the lowest id.
#[derive(Debug, Clone, Copy, Default)]
pub struct FirstFree;

impl Chooser for FirstFree {
    fn choose(&mut self, _: Millis, _: RequestId, free: &[FreeReplica]) -> ReplicaId {
        free[0].id
    }
}

#[derive(Debug)]
struct Replica {
    limit: u32,
    in_use: u32,
    healthy: bool,
    /// Permits that were out beyond a lowered limit; they stay valid until
    /// released, and no new permit is granted while any remain.
    excess: u32,
}

#[derive(Debug)]
enum Place {
    Waiting { deadline: Option<Millis> },
    Leased(ReplicaId),
}

#[derive(Debug)]
struct Req {
    account: AccountId,
    patience: Patience,
    place: Place,
    /// Arrival order, so a change of algorithm can rebuild the line as
    /// the requests came.
    arrival: u64,
}

/// One model's admission state. See the crate docs.
#[derive(Debug)]
pub struct Admission {
    config: AdmissionConfig,
    replicas: BTreeMap<ReplicaId, Replica>,
    waiting: Waiting,
    /// Every admitted or waiting request (Fx: ids are trusted, and this
    /// is on every request's path).
    requests: FxHashMap<RequestId, Req>,
    deadlines: BTreeSet<(Millis, RequestId)>,
    actions: VecDeque<Action>,
    free_scratch: Vec<FreeReplica>,
    arrivals: u64,
    /// Why the model cannot run now, while it cannot (see the crate docs).
    unavailable: Option<String>,
}

impl Admission {
    /// An empty state: no replicas, nobody waiting.
    pub fn new(config: AdmissionConfig) -> Self {
        Self {
            waiting: Waiting::new(config.algorithm),
            config,
            replicas: BTreeMap::new(),
            requests: FxHashMap::default(),
            deadlines: BTreeSet::new(),
            actions: VecDeque::new(),
            free_scratch: Vec::new(),
            arrivals: 0,
            unavailable: None,
        }
    }

    // ---- getters -------------------------------------------------------

    /// Requests waiting for a permit.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Permits out, over all replicas.
    pub fn in_use(&self) -> u32 {
        self.replicas.values().map(|r| r.in_use).sum()
    }

    /// Permits out on one replica.
    pub fn in_use_on(&self, replica: ReplicaId) -> u32 {
        self.replicas.get(&replica).map_or(0, |r| r.in_use)
    }

    /// The replica whose permit `request` holds, if it holds one.
    pub fn holder(&self, request: RequestId) -> Option<ReplicaId> {
        match self.requests.get(&request)?.place {
            Place::Leased(replica) => Some(replica),
            Place::Waiting { .. } => None,
        }
    }

    /// Where waiting `request` stands in the line (1: served next; see
    /// the line's order in the crate docs); `None` once it is not waiting.
    /// What a queued prediction shows as its position.
    pub fn position(&self, request: RequestId) -> Option<usize> {
        let req = self.requests.get(&request)?;
        match req.place {
            Place::Waiting { .. } => self.waiting.position(&req.account, request),
            Place::Leased(_) => None,
        }
    }

    /// The settings in force.
    pub fn config(&self) -> &AdmissionConfig {
        &self.config
    }

    /// Permits of healthy replicas, in all.
    pub fn total_permits(&self) -> u32 {
        self.replicas.values().filter(|r| r.healthy).map(|r| r.limit).sum()
    }

    /// Why the model cannot run now, while [`Admission::set_unavailable`]
    /// says so.
    pub fn unavailable(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    // ---- handle_* (facts) ---------------------------------------------

    /// A replica became ready with `limit` permits (or changed its limit).
    /// Waiting requests are dispatched to it at once. Lowering the limit
    /// below the permits out keeps those permits valid until released.
    /// The model can run: it is no longer unavailable.
    pub fn replica_ready(&mut self, now: Millis, replica: ReplicaId, limit: u32, chooser: &mut dyn Chooser) {
        self.unavailable = None;
        let r =
            self.replicas.entry(replica).or_insert(Replica { limit, in_use: 0, healthy: true, excess: 0 });
        r.limit = limit;
        r.excess = r.in_use.saturating_sub(limit);
        r.healthy = true;
        self.fill(now, chooser);
    }

    /// A replica is unhealthy: it gets no new requests until it is ready
    /// again, but its permits stay out until released.
    pub fn replica_unhealthy(&mut self, _now: Millis, replica: ReplicaId) {
        if let Some(r) = self.replicas.get_mut(&replica) {
            r.healthy = false;
        }
    }

    /// A replica is gone (stopped, evicted, crashed). Returns the requests
    /// that held permits on it, in id order, which are no longer admitted:
    /// the driver retries them (submit again) or fails them.
    pub fn replica_gone(&mut self, _now: Millis, replica: ReplicaId) -> Vec<RequestId> {
        self.replicas.remove(&replica);
        let mut lost: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| matches!(r.place, Place::Leased(x) if x == replica))
            .map(|(id, _)| *id)
            .collect();
        lost.sort_unstable();
        for id in &lost {
            self.requests.remove(id);
        }
        lost
    }

    /// Fails every waiting request with `reason` (e.g. no replica could be
    /// started); they come out as [`Action::Failed`].
    pub fn fail_waiting(&mut self, _now: Millis, reason: &str) {
        for request in self.waiting.drain() {
            self.forget_waiting(request);
            self.actions.push_back(Action::Failed { request, reason: reason.to_owned() });
        }
    }

    /// The model cannot run now, for `reason` (`Some`: no replica is up
    /// and none can be placed), or can again (`None`). While it cannot,
    /// every fail-fast request waiting is turned away, in arrival order
    /// ([`Action::Unavailable`]), and so is each fail-fast request
    /// submitted that finds no free permit ([`Submitted::Unavailable`]);
    /// patient requests wait on. A replica becoming ready ends it too.
    pub fn set_unavailable(&mut self, _now: Millis, reason: Option<String>) {
        self.unavailable = reason.clone();
        let Some(reason) = reason else { return };
        let mut turned_away: Vec<(u64, RequestId)> = self
            .requests
            .iter()
            .filter(|(_, r)| r.patience == Patience::FailFast && matches!(r.place, Place::Waiting { .. }))
            .map(|(id, r)| (r.arrival, *id))
            .collect();
        turned_away.sort_unstable();
        for (_, request) in turned_away {
            let account = self.requests[&request].account.clone();
            self.waiting.remove(&account, request);
            self.forget_waiting(request);
            self.actions.push_back(Action::Unavailable { request, reason: reason.clone() });
        }
    }

    /// Expires waiting requests whose deadline is at or before `now`.
    /// Calling it early or twice does nothing.
    pub fn handle_timeout(&mut self, now: Millis) {
        while let Some(&(at, request)) = self.deadlines.first() {
            if at > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(req) = self.requests.remove(&request) {
                self.waiting.remove(&req.account, request);
                self.actions.push_back(Action::Expired(request));
            }
        }
    }

    // ---- commands -----------------------------------------------------

    /// Admits a fail-fast request of `account` (see
    /// [`Admission::submit_as`]).
    pub fn submit(
        &mut self,
        now: Millis,
        request: RequestId,
        account: AccountId,
        deadline: Option<Millis>,
        chooser: &mut dyn Chooser,
    ) -> Result<Submitted, AdmissionError> {
        self.submit_as(now, request, account, deadline, Patience::FailFast, chooser)
    }

    /// Admits a request of `account` that waits with `patience`.
    /// `deadline` bounds how long it may wait (absolute, same clock as
    /// `now`).
    pub fn submit_as(
        &mut self,
        now: Millis,
        request: RequestId,
        account: AccountId,
        deadline: Option<Millis>,
        patience: Patience,
        chooser: &mut dyn Chooser,
    ) -> Result<Submitted, AdmissionError> {
        if self.requests.contains_key(&request) {
            return Err(AdmissionError::Duplicate(request));
        }
        let arrival = self.arrivals;
        self.arrivals += 1;
        if self.waiting.len() == 0 {
            if let Some(replica) = self.pick(now, request, chooser) {
                let req = Req { account, patience, place: Place::Leased(replica), arrival };
                self.requests.insert(request, req);
                return Ok(Submitted::Leased(Permit { request, replica }));
            }
        }
        if self.unavailable.is_some() && patience == Patience::FailFast {
            return Ok(Submitted::Unavailable);
        }
        if !self.waiting.has_room(&account, self.config.capacity) {
            return Ok(Submitted::Rejected { capacity: self.config.capacity });
        }
        self.waiting.push(account.clone(), request);
        self.requests.insert(request, Req { account, patience, place: Place::Waiting { deadline }, arrival });
        if let Some(d) = deadline {
            self.deadlines.insert((d, request));
        }
        Ok(Submitted::Queued)
    }

    /// Switches to new settings without losing anyone: the waiting line
    /// is rebuilt under the new algorithm in arrival order (so FIFO → fair
    /// keeps each account's order, fair → FIFO restores the global one),
    /// deadlines stay, and a lowered capacity only rejects newcomers until
    /// the line is short enough.
    pub fn reconfigure(&mut self, _now: Millis, config: AdmissionConfig) {
        let mut line: Vec<(u64, AccountId, RequestId)> = self
            .requests
            .iter()
            .filter(|(_, r)| matches!(r.place, Place::Waiting { .. }))
            .map(|(id, r)| (r.arrival, r.account.clone(), *id))
            .collect();
        line.sort_unstable_by_key(|(arrival, _, _)| *arrival);
        self.waiting = Waiting::new(config.algorithm);
        for (_, account, request) in line {
            self.waiting.push(account, request);
        }
        self.config = config;
    }

    /// The request finished (or failed, or its client left) and gives back
    /// its permit, which goes to the next waiting request. Releasing a
    /// request that waits cancels it; releasing an unknown one does
    /// nothing. Returns whether anything changed.
    pub fn release(&mut self, now: Millis, request: RequestId, chooser: &mut dyn Chooser) -> bool {
        let Some(req) = self.requests.get(&request) else { return false };
        match req.place {
            Place::Leased(replica) => {
                self.requests.remove(&request);
                if let Some(r) = self.replicas.get_mut(&replica) {
                    r.in_use -= 1;
                    r.excess = r.excess.saturating_sub(1);
                }
                self.fill(now, chooser);
            }
            Place::Waiting { .. } => {
                let account = req.account.clone();
                self.waiting.remove(&account, request);
                self.forget_waiting(request);
            }
        }
        true
    }

    // ---- poll_* (outputs) ---------------------------------------------

    /// The next decision, in the order taken.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The earliest deadline of a waiting request.
    pub fn poll_timeout(&self) -> Option<Millis> {
        self.deadlines.first().map(|&(d, _)| d)
    }

    // ---- internals ----------------------------------------------------

    fn forget_waiting(&mut self, request: RequestId) {
        if let Some(Req { place: Place::Waiting { deadline: Some(d) }, .. }) = self.requests.remove(&request)
        {
            self.deadlines.remove(&(d, request));
        }
    }

    /// Takes a free permit for `request`, if any healthy replica has one.
    fn pick(&mut self, now: Millis, request: RequestId, chooser: &mut dyn Chooser) -> Option<ReplicaId> {
        self.free_scratch.clear();
        self.free_scratch.extend(
            self.replicas
                .iter()
                .filter(|(_, r)| r.healthy && r.in_use < r.limit)
                .map(|(id, r)| FreeReplica { id: *id, in_use: r.in_use, limit: r.limit }),
        );
        if self.free_scratch.is_empty() {
            return None;
        }
        let chosen = chooser.choose(now, request, &self.free_scratch);
        let replica =
            if self.free_scratch.iter().any(|r| r.id == chosen) { chosen } else { self.free_scratch[0].id };
        self.replicas.get_mut(&replica).expect("free replicas exist").in_use += 1;
        Some(replica)
    }

    /// Dispatches waiting requests while permits are free.
    fn fill(&mut self, now: Millis, chooser: &mut dyn Chooser) {
        while self.waiting.len() > 0 {
            let Some(next) = self.peek_next() else { break };
            let Some(replica) = self.pick(now, next, chooser) else { break };
            let popped = self.waiting.pop().expect("peeked");
            debug_assert_eq!(popped, next);
            let req = self.requests.get_mut(&next).expect("waiting requests are known");
            if let Place::Waiting { deadline: Some(d) } = req.place {
                self.deadlines.remove(&(d, next));
            }
            req.place = Place::Leased(replica);
            self.actions.push_back(Action::Dispatch(Permit { request: next, replica }));
        }
    }

    fn peek_next(&self) -> Option<RequestId> {
        self.waiting.peek()
    }

    /// Panics if an invariant of the crate docs does not hold.
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let mut held: HashMap<ReplicaId, u32> = HashMap::new();
        for r in self.requests.values() {
            if let Place::Leased(x) = r.place {
                *held.entry(x).or_default() += 1;
            }
        }
        for (id, r) in &self.replicas {
            assert!(r.in_use <= r.limit + r.excess, "replica {id} over its limit");
            assert_eq!(r.in_use, held.get(id).copied().unwrap_or(0), "replica {id} permit count");
        }
        let waiting = self.requests.values().filter(|r| matches!(r.place, Place::Waiting { .. })).count();
        assert_eq!(waiting, self.waiting.len(), "waiting line and request table agree");
        if self.unavailable.is_some() {
            assert!(
                self.requests
                    .values()
                    .all(|r| r.patience == Patience::Patient || !matches!(r.place, Place::Waiting { .. })),
                "a fail-fast request waits while the model is unavailable"
            );
        }
        if self.waiting.len() > 0 {
            assert!(
                self.replicas.values().all(|r| !r.healthy || r.in_use >= r.limit),
                "someone waits while a permit is free"
            );
        }
    }
}
