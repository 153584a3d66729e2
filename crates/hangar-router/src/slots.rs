//! [`AdapterSlots`]: which LoRA adapters one replica holds, and the one
//! next step to take so that a request's adapter is there.
//!
//! A replica of a base model holds at most [`AdapterConfig::slots`]
//! adapters and at most [`AdapterConfig::memory`] bytes of them. A request
//! for adapter *A* is [acquired](AdapterSlots::acquire) on the replica it
//! was routed to: if *A* is loaded it may run at once; otherwise it waits,
//! and the machine asks for the steps that bring *A* in — a
//! [`SlotStep::Load`] when there is room, else first a
//! [`SlotStep::Unload`] of the least recently used adapter that no
//! request in flight uses. The driver carries each step out (the live one
//! against vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`,
//! the simulator by a load time from the adapter's size), reports how it
//! went ([`AdapterSlots::step_done`]), and learns from
//! [`poll_event`](AdapterSlots::poll_event) which waiting requests may
//! now run ([`SlotEvent::Ready`]) or will not ([`SlotEvent::Failed`]).
//!
//! It is sans-IO, like every policy: no clock (recency is the order of
//! calls), no I/O. One step is in flight at a time — an engine loads one
//! adapter at a time anyway, and an unload followed by a load then never
//! has the engine hold more than the machine counts. An adapter counts
//! against the slots and the memory from the moment its load is asked for
//! until its unload is confirmed, so what the engine holds is never more
//! than what the machine counts.
//!
//! # Driving it
//! After every call, drain [`poll_event`](AdapterSlots::poll_event) and
//! then [`poll_step`](AdapterSlots::poll_step); carry out the step (if
//! any) and call [`step_done`](AdapterSlots::step_done) when it ends, then
//! drain again. Call [`release`](AdapterSlots::release) when a request
//! ends, whether it ran, waited or failed.
//!
//! # Invariants, after every call
//! - Adapters held (loading, loaded, unloading) ≤ `slots`, their bytes ≤
//!   `memory`.
//! - No adapter a request in flight uses is unloaded: a victim is loaded
//!   and unused.
//! - A request acquired gets exactly one answer: `Ready` from `acquire`
//!   or a later [`SlotEvent::Ready`], or a [`SlotEvent::Failed`] — unless
//!   it is released first.
//! - At most one step is in flight.
//!
//! Which adapter goes in next: the waiting adapters in the order they were
//! first asked for, the first that can fit once unused adapters are
//! unloaded. One that cannot fit until a request in flight ends waits
//! without holding up the others behind it.
//!
//! ```
//! use hangar_core::{AdapterRef, ByteSize, RequestId};
//! use hangar_router::{Acquired, AdapterConfig, AdapterSlots, SlotEvent, SlotStep};
//!
//! let cfg = AdapterConfig { slots: 1, memory: ByteSize::new(100), ..AdapterConfig::default() };
//! let mut slots = AdapterSlots::new(&cfg);
//! let (a, b): (AdapterRef, AdapterRef) = ("m:a".parse().unwrap(), "m:b".parse().unwrap());
//!
//! assert_eq!(slots.acquire(RequestId(1), &a, 60).unwrap(), Acquired::Waiting);
//! assert_eq!(slots.poll_step(), Some(SlotStep::Load { adapter: a.clone(), bytes: 60 }));
//! slots.step_done(true);
//! assert_eq!(slots.poll_event(), Some(SlotEvent::Ready(RequestId(1))));
//!
//! // b needs a's slot, but request 1 still uses a: nothing to do yet.
//! assert_eq!(slots.acquire(RequestId(2), &b, 60).unwrap(), Acquired::Waiting);
//! assert_eq!(slots.poll_step(), None);
//! slots.release(RequestId(1));
//! assert_eq!(slots.poll_step(), Some(SlotStep::Unload { adapter: a.clone() }));
//! slots.step_done(true);
//! assert_eq!(slots.poll_step(), Some(SlotStep::Load { adapter: b.clone(), bytes: 60 }));
//! ```

use std::collections::VecDeque;

use hangar_core::{AdapterRef, ByteSize, RequestId};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

/// Adapters on one model's replicas: what each replica may hold, and how
/// the `adapter` routing policy weighs a load against a replica's load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdapterConfig {
    /// Adapters one replica holds at most (default 8): set it no higher
    /// than the engine keeps loaded at once (vLLM: `--max-loras`, raised
    /// to `--max-cpu-loras` when those are cached in CPU memory).
    pub slots: u32,
    /// Bytes of adapters one replica holds at most (default 4 GB): the
    /// GPU memory its engine sets aside for them.
    pub memory: ByteSize,
    /// The size assumed for an adapter whose size is not known (default
    /// 200 MB: a LoRA of every linear layer of an 8B Llama in 16-bit
    /// weights is 84 MB at rank 16, 168 MB at rank 32).
    pub default_size: ByteSize,
    /// What one request in flight on a replica costs a new request there,
    /// in ms of its time to first token (default 25): the `adapter` policy
    /// counts a load of *L* ms as *L* / `request_ms` requests in flight.
    /// On an engine that batches, a request in flight delays a new one's
    /// first token by at most about one prefill pass of its own — 20–50
    /// ms for a prompt's uncached part on the mock engine's default timing
    /// — and mostly by far less (a decode step grows by well under a
    /// millisecond per request); an engine that runs one request at a time
    /// (concurrency 1) wants about its mean service time instead.
    pub request_ms: f64,
}

impl Default for AdapterConfig {
    fn default() -> Self {
        AdapterConfig {
            slots: 8,
            memory: ByteSize::new(4_000_000_000),
            default_size: ByteSize::new(200_000_000),
            request_ms: 25.0,
        }
    }
}

impl AdapterConfig {
    /// Checks the settings; the error names the field (`slots`, …; place
    /// it with [`FieldError::within`](hangar_core::FieldError::within)).
    pub fn validate(&self) -> Result<(), hangar_core::FieldError> {
        let bad = |field: &str, why: &str| Err(hangar_core::FieldError::new(field, why));
        if self.slots == 0 {
            return bad("slots", "must be at least 1");
        }
        if self.memory.bytes() == 0 {
            return bad("memory", "must be above 0");
        }
        if self.default_size > self.memory {
            return bad("default_size", "is larger than `memory`: no such adapter could be loaded");
        }
        if !(self.request_ms.is_finite() && self.request_ms > 0.0) {
            return bad("request_ms", "must be a number of ms above 0");
        }
        Ok(())
    }

    /// Whether an adapter of `bytes` can ever be held: the error says why
    /// not. Checked before a request for it is routed, so such a request
    /// is refused (4xx) rather than left waiting forever.
    pub fn check_fits(&self, adapter: &AdapterRef, bytes: u64) -> Result<(), SlotsError> {
        if bytes > self.memory.bytes() {
            return Err(SlotsError::TooLarge {
                adapter: adapter.clone(),
                bytes,
                memory: self.memory.bytes(),
            });
        }
        Ok(())
    }
}

/// What [`AdapterSlots::acquire`] answered at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    /// The adapter is loaded: run the request now.
    Ready,
    /// It is not loaded yet: wait for [`SlotEvent::Ready`] (or
    /// [`SlotEvent::Failed`]).
    Waiting,
}

/// A step for the driver to carry out on the replica's engine, then
/// report with [`AdapterSlots::step_done`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotStep {
    /// Load the adapter (vLLM: `POST /v1/load_lora_adapter`).
    Load {
        /// Which.
        adapter: AdapterRef,
        /// Its size, as it is counted.
        bytes: u64,
    },
    /// Unload the adapter (vLLM: `POST /v1/unload_lora_adapter`).
    Unload {
        /// Which.
        adapter: AdapterRef,
    },
}

/// What became of waiting requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotEvent {
    /// The request's adapter is loaded: run it.
    Ready(RequestId),
    /// The request's adapter failed to load; the machine forgot the
    /// request (releasing it does nothing).
    Failed {
        /// The request.
        request: RequestId,
        /// Its adapter.
        adapter: AdapterRef,
    },
}

/// Misuse, or an adapter that can never be held.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SlotsError {
    /// The adapter is larger than all of a replica's adapter memory.
    #[error(
        "adapter `{adapter}` is {bytes} bytes, more than the {memory} bytes a replica holds for adapters"
    )]
    TooLarge {
        /// The adapter.
        adapter: AdapterRef,
        /// Its size.
        bytes: u64,
        /// The replica's adapter memory.
        memory: u64,
    },
    /// The request was acquired already and not released.
    #[error("request {0} already holds an adapter here")]
    Duplicate(RequestId),
}

/// Where an adapter is on the replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holding {
    /// Not held, and no request waits for it.
    Absent,
    /// Requests wait for it; its load has not been asked for yet.
    Wanted,
    /// Its load is in flight.
    Loading,
    /// Loaded.
    Loaded,
    /// Its unload is in flight.
    Unloading,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Wanted,
    Loading,
    Loaded,
    Unloading,
    /// Loaded, and its unload failed: kept, counted, never a victim again.
    Stuck,
}

#[derive(Debug)]
struct Entry {
    bytes: u64,
    state: State,
    /// Requests acquired with it, ready or waiting.
    users: u32,
    /// Those of them waiting for it to load.
    waiters: Vec<RequestId>,
    /// The machine's tick at its last acquire or load.
    last_use: u64,
}

impl Entry {
    fn held(&self) -> bool {
        self.state != State::Wanted
    }

    /// Could be unloaded to make room: loaded and unused (or leaving).
    fn freeable(&self) -> bool {
        (self.state == State::Loaded && self.users == 0) || self.state == State::Unloading
    }
}

/// One replica's adapters. See the module docs.
#[derive(Debug)]
pub struct AdapterSlots {
    slots: u32,
    memory: u64,
    adapters: FxHashMap<AdapterRef, Entry>,
    /// Adapters in the `Wanted` state, first asked for first.
    wanted: VecDeque<AdapterRef>,
    /// Requests acquired, with their adapter and whether they may run.
    requests: FxHashMap<RequestId, (AdapterRef, bool)>,
    /// The step in flight.
    step: Option<SlotStep>,
    events: VecDeque<SlotEvent>,
    held_count: u32,
    held_bytes: u64,
    tick: u64,
}

impl AdapterSlots {
    /// An empty replica's slots, sized by `config`.
    pub fn new(config: &AdapterConfig) -> Self {
        AdapterSlots {
            slots: config.slots,
            memory: config.memory.bytes(),
            adapters: FxHashMap::default(),
            wanted: VecDeque::new(),
            requests: FxHashMap::default(),
            step: None,
            events: VecDeque::new(),
            held_count: 0,
            held_bytes: 0,
            tick: 0,
        }
    }

    /// Request `request` will run with `adapter` (of `bytes`, used if the
    /// adapter is not held yet) on this replica: it may run now, or must
    /// wait for a load. Either way the adapter is *in use* by the request
    /// — never unloaded — until [`release`](Self::release).
    ///
    /// An adapter larger than the replica's adapter memory is refused
    /// ([`SlotsError::TooLarge`]; check with [`AdapterConfig::check_fits`]
    /// before routing), as is a request acquired twice; neither changes
    /// anything.
    pub fn acquire(
        &mut self,
        request: RequestId,
        adapter: &AdapterRef,
        bytes: u64,
    ) -> Result<Acquired, SlotsError> {
        if self.requests.contains_key(&request) {
            return Err(SlotsError::Duplicate(request));
        }
        let known = self.adapters.get(adapter).map(|e| e.bytes);
        let bytes = known.unwrap_or(bytes);
        if bytes > self.memory {
            return Err(SlotsError::TooLarge { adapter: adapter.clone(), bytes, memory: self.memory });
        }
        self.tick += 1;
        let tick = self.tick;
        let entry = match self.adapters.get_mut(adapter) {
            Some(e) => e,
            None => {
                self.wanted.push_back(adapter.clone());
                self.adapters.entry(adapter.clone()).or_insert(Entry {
                    bytes,
                    state: State::Wanted,
                    users: 0,
                    waiters: Vec::new(),
                    last_use: tick,
                })
            }
        };
        entry.users += 1;
        entry.last_use = tick;
        let ready = matches!(entry.state, State::Loaded | State::Stuck);
        if !ready {
            entry.waiters.push(request);
        }
        self.requests.insert(request, (adapter.clone(), ready));
        Ok(if ready { Acquired::Ready } else { Acquired::Waiting })
    }

    /// Request `request` ended (ran, waited, was cancelled): its adapter is
    /// no longer in use by it. An adapter nobody waits for any more whose
    /// load was not asked for yet is forgotten. `false` if the request was
    /// not acquired here (or failed already).
    pub fn release(&mut self, request: RequestId) -> bool {
        let Some((adapter, ready)) = self.requests.remove(&request) else { return false };
        let entry = self.adapters.get_mut(&adapter).expect("an acquired request's adapter is known");
        entry.users -= 1;
        if !ready {
            entry.waiters.retain(|&r| r != request);
        }
        if entry.state == State::Wanted && entry.users == 0 {
            self.adapters.remove(&adapter);
            self.wanted.retain(|a| *a != adapter);
        }
        true
    }

    /// The next step to carry out, if one is due and none is in flight.
    /// Once returned, the step is in flight until
    /// [`step_done`](Self::step_done).
    pub fn poll_step(&mut self) -> Option<SlotStep> {
        if self.step.is_some() {
            return None;
        }
        let (free_count, free_bytes) = self.freeable();
        let mut chosen = None;
        for (i, adapter) in self.wanted.iter().enumerate() {
            let bytes = self.adapters[adapter].bytes;
            if self.held_count < self.slots && self.held_bytes + bytes <= self.memory {
                chosen = Some((i, true));
                break;
            }
            let fits_after = self.held_count - free_count < self.slots
                && self.held_bytes - free_bytes + bytes <= self.memory;
            if fits_after {
                chosen = Some((i, false));
                break;
            }
        }
        let step = match chosen? {
            (i, true) => {
                let adapter = self.wanted.remove(i).expect("found above");
                let entry = self.adapters.get_mut(&adapter).expect("wanted adapters are known");
                entry.state = State::Loading;
                self.held_count += 1;
                self.held_bytes += entry.bytes;
                SlotStep::Load { bytes: entry.bytes, adapter }
            }
            (_, false) => {
                let victim = (self.adapters.iter())
                    .filter(|(_, e)| e.state == State::Loaded && e.users == 0)
                    .min_by_key(|(a, e)| (e.last_use, *a))
                    .map(|(a, _)| a.clone())
                    .expect("room after unloading means an unused adapter is loaded");
                self.adapters.get_mut(&victim).expect("just found").state = State::Unloading;
                SlotStep::Unload { adapter: victim }
            }
        };
        self.step = Some(step.clone());
        Some(step)
    }

    /// The step in flight ended: `ok` if the engine did it. A load that
    /// failed fails the requests waiting for the adapter
    /// ([`SlotEvent::Failed`]); an unload that failed leaves the adapter
    /// loaded and counted, never a victim again (the driver may restart a
    /// replica whose engine will not unload). `false`, changing nothing,
    /// when no step was in flight.
    pub fn step_done(&mut self, ok: bool) -> bool {
        let Some(step) = self.step.take() else { return false };
        match step {
            SlotStep::Load { adapter, .. } => {
                let entry = self.adapters.get_mut(&adapter).expect("a loading adapter is known");
                if ok {
                    self.tick += 1;
                    entry.state = State::Loaded;
                    entry.last_use = self.tick;
                    for r in entry.waiters.drain(..) {
                        self.requests.get_mut(&r).expect("waiters are acquired").1 = true;
                        self.events.push_back(SlotEvent::Ready(r));
                    }
                } else {
                    let entry = self.adapters.remove(&adapter).expect("just found");
                    self.held_count -= 1;
                    self.held_bytes -= entry.bytes;
                    for r in entry.waiters {
                        self.requests.remove(&r);
                        self.events.push_back(SlotEvent::Failed { request: r, adapter: adapter.clone() });
                    }
                }
            }
            SlotStep::Unload { adapter } => {
                let entry = self.adapters.get_mut(&adapter).expect("an unloading adapter is known");
                if ok {
                    self.held_count -= 1;
                    self.held_bytes -= entry.bytes;
                    if entry.users == 0 {
                        self.adapters.remove(&adapter);
                    } else {
                        // Asked for again while it left: it comes back.
                        entry.state = State::Wanted;
                        self.wanted.push_back(adapter);
                    }
                } else {
                    entry.state = State::Stuck;
                    for r in entry.waiters.drain(..) {
                        self.requests.get_mut(&r).expect("waiters are acquired").1 = true;
                        self.events.push_back(SlotEvent::Ready(r));
                    }
                }
            }
        }
        true
    }

    /// The next waiting request that may run or will not.
    pub fn poll_event(&mut self) -> Option<SlotEvent> {
        self.events.pop_front()
    }

    /// The step in flight, if any.
    pub fn step_in_flight(&self) -> Option<&SlotStep> {
        self.step.as_ref()
    }

    /// Where `adapter` is on this replica.
    pub fn holding(&self, adapter: &AdapterRef) -> Holding {
        match self.adapters.get(adapter).map(|e| e.state) {
            None => Holding::Absent,
            Some(State::Wanted) => Holding::Wanted,
            Some(State::Loading) => Holding::Loading,
            Some(State::Loaded | State::Stuck) => Holding::Loaded,
            Some(State::Unloading) => Holding::Unloading,
        }
    }

    /// How many loads must still end before a request for `adapter` (of
    /// `bytes` if not held) could run here — 0 when it is loaded or
    /// loading, else its place among the adapters waiting to load (behind
    /// the load in flight, if one is) — or
    /// `None` when it cannot fit until a request in flight here ends
    /// (every slot, or too much of the memory, is in use). What the
    /// `adapter` routing policy prices.
    pub fn loads_before_ready(&self, adapter: &AdapterRef, bytes: u64) -> Option<u32> {
        let queued = self.wanted.len() as u32;
        let loading = u32::from(matches!(self.step, Some(SlotStep::Load { .. })));
        match self.adapters.get(adapter) {
            Some(e) => match e.state {
                State::Loaded | State::Stuck | State::Loading => Some(0),
                State::Wanted => {
                    let place = self.wanted.iter().position(|a| a == adapter).map_or(queued, |i| i as u32);
                    Some(loading + place + 1)
                }
                State::Unloading => Some(queued + 1),
            },
            None => {
                let (free_count, free_bytes) = self.freeable();
                let fits = self.held_count - free_count < self.slots
                    && self.held_bytes - free_bytes + bytes <= self.memory;
                fits.then_some(loading + queued + 1)
            }
        }
    }

    /// Every adapter held (loading, loaded or unloading), in no order.
    pub fn held(&self) -> impl Iterator<Item = (&AdapterRef, Holding)> + '_ {
        (self.adapters.iter()).filter(|(_, e)| e.held()).map(|(a, _)| (a, self.holding(a)))
    }

    /// Adapters held (loading, loaded, unloading).
    pub fn used_slots(&self) -> u32 {
        self.held_count
    }

    /// Their bytes.
    pub fn used_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// Requests acquired and not released (ready or waiting).
    pub fn requests(&self) -> usize {
        self.requests.len()
    }

    /// Requests waiting for their adapter to load.
    pub fn waiting(&self) -> usize {
        self.requests.values().filter(|(_, ready)| !ready).count()
    }

    /// Slots and bytes that unloading every unused loaded adapter (and
    /// finishing the unload in flight) would free.
    fn freeable(&self) -> (u32, u64) {
        (self.adapters.values().filter(|e| e.freeable())).fold((0, 0), |(n, b), e| (n + 1, b + e.bytes))
    }

    /// Checks every invariant of the module docs against the state: for
    /// tests, which call it after every step.
    #[cfg(test)]
    pub(crate) fn check(&self) {
        let held: Vec<&Entry> = self.adapters.values().filter(|e| e.held()).collect();
        assert_eq!(held.len() as u32, self.held_count, "held count");
        assert_eq!(held.iter().map(|e| e.bytes).sum::<u64>(), self.held_bytes, "held bytes");
        assert!(self.held_count <= self.slots, "{} adapters in {} slots", self.held_count, self.slots);
        assert!(self.held_bytes <= self.memory, "{} bytes in {}", self.held_bytes, self.memory);
        let in_flight =
            (self.adapters.values()).filter(|e| matches!(e.state, State::Loading | State::Unloading)).count();
        assert_eq!(in_flight, usize::from(self.step.is_some()), "one step in flight, matching the states");
        for (a, e) in &self.adapters {
            let users = self.requests.values().filter(|(x, _)| x == a).count() as u32;
            assert_eq!(e.users, users, "{a}: users");
            let waiting = self.requests.iter().filter(|(_, (x, ready))| x == a && !ready).count();
            assert_eq!(e.waiters.len(), waiting, "{a}: waiters");
            if matches!(e.state, State::Loaded | State::Stuck) {
                assert!(e.waiters.is_empty(), "{a}: nobody waits on a loaded adapter");
            }
            if e.state == State::Unloading {
                assert!(e.waiters.len() as u32 == e.users, "{a}: nobody runs on an adapter leaving");
            }
            assert_eq!(e.state == State::Wanted, self.wanted.contains(a), "{a}: wanted list");
            if e.state == State::Wanted {
                assert!(e.users > 0, "{a}: wanted by nobody");
            }
        }
    }
}

#[cfg(test)]
mod tests;
