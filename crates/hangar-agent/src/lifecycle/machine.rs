//! [`Lifecycle`]: the sans-IO replica lifecycle machine of one driver's
//! nodes (a `hangar agent`'s one node, or the `[[nodes]]` of a single
//! `hangar serve`).
//!
//! Per replica it holds two states, each owned by one side:
//! - **desired**, placement's word ([`Tier`]): HOT on a [`Slot`] (GPUs and
//!   the bytes on each), WARM (asleep in the warm cache), or gone (absent
//!   from the node's desired state). It is replaced whole, per node, by
//!   [`Lifecycle::set_desired`] — level-triggered, so a lost or repeated
//!   write changes nothing.
//! - **observed**, the engine as the node knows it ([`Engine`]): absent,
//!   starting, awake on a slot, falling asleep, asleep, waking, stopping,
//!   being killed (it died or hung), or failed (waiting out a back-off).
//!
//! After every input the machine picks, per replica, the one next step
//! that moves observed toward desired and hands it to the driver
//! ([`Output::Step`]). A replica has at most one step in flight; the
//! driver reports how it ended ([`Lifecycle::handle_step_done`]) and only
//! then is the next one chosen. A desired state that changes mid-step is
//! never interleaved with it: the step ends, then the machine decides
//! again. A step that is no longer wanted may be cut short
//! ([`Output::Abandon`]) where that is safe — a start not yet finished, a
//! sleep still draining — and the driver says whether it was
//! ([`Outcome::Abandoned`]) or had already changed the engine.
//!
//! # Rules
//! - A replica **serves** (has permits, [`Output::Serve`]) exactly while
//!   it is desired HOT on slot S and its engine is awake on S with no step
//!   in flight. The moment either stops being true its permits are taken
//!   ([`Output::Unserve`]), before any step that changes the engine.
//! - **GPUs are never over-committed by engines.** An engine holds its
//!   slot's bytes from the start of its start or wake until its sleep or
//!   stop has finished — or, once it died or stopped answering, until its
//!   process has been killed: a hung engine still holds its GPU memory. A
//!   start or wake waits until every GPU of its slot has room beside what
//!   other engines hold there, so a replica evicted from a GPU has
//!   finished going before the one placed there starts.
//! - **A wake onto other GPUs is a restart there.** An engine that slept
//!   on slot S' and is wanted HOT on S ≠ S' (different GPUs or share) is
//!   stopped and started afresh on S: an engine's process is bound to the
//!   GPUs it was started on (`CUDA_VISIBLE_DEVICES`). The same holds for an
//!   awake engine wanted on another slot.
//! - **WARM only for an engine that really sleeps.** An awake replica
//!   wanted WARM is drained and put to sleep if its engine can sleep;
//!   otherwise (or if the engine refuses) it is stopped, and the
//!   controller hears it is cold ([`Fact::Cold`]), so placement never
//!   counts a WARM copy that holds nothing — or GPU memory.
//! - **Failures back off.** A start that fails, or an engine that dies or
//!   stops answering (killed at once, [`Step::Kill`]: it would not drain),
//!   leaves the replica failed: the controller hears it ([`Fact::Failed`])
//!   and normally replaces it; if it is still wanted HOT the node itself
//!   starts it again after a back-off of 1 s doubling to 60 s (reset once
//!   it serves), so a node keeps its replicas while no controller runs.
//!
//! # Driving it
//! Inputs carry `now` (milliseconds, never going back). After each input
//! the driver drains [`Lifecycle::poll_output`], then sleeps until
//! [`Lifecycle::poll_timeout`] and calls [`Lifecycle::handle_timeout`].
//! Early or repeated calls do nothing. Outputs of one input are in the
//! order they must be carried out: permits taken before the step that
//! needs them gone.

use std::collections::{BTreeMap, VecDeque};

use hangar_core::{Millis, ModelKey, ReplicaId};
use serde::Serialize;

/// The first wait before a failed replica is started again.
pub const FIRST_BACKOFF_MS: Millis = 1_000;
/// The longest wait between restarts of a failing replica.
pub const MAX_BACKOFF_MS: Millis = 60_000;

/// Where a replica's engine runs: GPU index → bytes it may use there, and
/// the share of each GPU's memory it is given (below 1 when it shares).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Slot {
    /// GPU index on the node → bytes.
    pub gpus: BTreeMap<u32, u64>,
    /// The share of each GPU's memory, if it shares.
    pub fraction: Option<f64>,
}

impl Slot {
    /// Its GPU indexes, in order.
    pub fn gpu_list(&self) -> Vec<u32> {
        self.gpus.keys().copied().collect()
    }
}

/// Where placement wants a replica.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Tier {
    /// Serving, on this slot.
    Hot(Slot),
    /// Asleep in the node's warm cache.
    Warm,
}

/// One replica of a node's desired state.
#[derive(Debug, Clone, PartialEq)]
pub struct Wanted {
    /// The replica.
    pub replica: ReplicaId,
    /// Its model.
    pub model: ModelKey,
    /// Where placement wants it.
    pub tier: Tier,
}

/// A replica's engine as the node knows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Engine {
    /// No engine process.
    Absent,
    /// A start is in flight (weights, process, readiness).
    Starting {
        /// Where it is starting.
        slot: Slot,
    },
    /// Running and awake.
    Awake {
        /// Where it runs.
        slot: Slot,
    },
    /// A sleep is in flight (draining, then the engine's sleep call).
    FallingAsleep {
        /// Where it runs until asleep.
        slot: Slot,
    },
    /// Asleep: its weights in host memory, its GPU memory given back.
    Asleep {
        /// Where it slept (and may wake).
        slot: Slot,
    },
    /// A wake is in flight.
    Waking {
        /// Where it wakes.
        slot: Slot,
    },
    /// A stop is in flight.
    Stopping {
        /// The slot whose memory it holds until stopped (`None`: it was
        /// asleep or never started).
        holds: Option<Slot>,
    },
    /// It died or stopped answering, and its process is being killed: a
    /// hung engine holds its GPU memory until it is gone. Failed once it
    /// is.
    Killing {
        /// The slot whose memory it holds until gone (`None`: it was
        /// asleep).
        holds: Option<Slot>,
        /// What happened.
        why: String,
    },
    /// It did not start, or died; no process.
    Failed {
        /// What happened.
        why: String,
        /// When it may be started again, if still wanted.
        retry_at: Millis,
    },
}

impl Engine {
    /// Whether a step is in flight.
    pub fn in_step(&self) -> bool {
        matches!(
            self,
            Engine::Starting { .. }
                | Engine::FallingAsleep { .. }
                | Engine::Waking { .. }
                | Engine::Stopping { .. }
                | Engine::Killing { .. }
        )
    }

    /// The slot whose GPU memory this engine holds now, if any.
    pub fn holds(&self) -> Option<&Slot> {
        match self {
            Engine::Starting { slot }
            | Engine::Awake { slot }
            | Engine::FallingAsleep { slot }
            | Engine::Waking { slot } => Some(slot),
            Engine::Stopping { holds } | Engine::Killing { holds, .. } => holds.as_ref(),
            Engine::Absent | Engine::Asleep { .. } | Engine::Failed { .. } => None,
        }
    }
}

/// What the driver is asked to do for one replica. Exactly one is in
/// flight per replica; report its end with [`Lifecycle::handle_step_done`].
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Start an engine for `model` on `slot` (weights, process,
    /// readiness, capabilities). May be abandoned.
    Start {
        /// The model.
        model: ModelKey,
        /// Where.
        slot: Slot,
    },
    /// Let the requests in flight finish, then put the engine to sleep.
    /// May be abandoned while it drains.
    Sleep,
    /// Wake the sleeping engine.
    Wake,
    /// Let the requests in flight finish (for a while), then stop the
    /// engine process. Never abandoned.
    Stop,
    /// Kill the engine process at once: it died or stopped answering, so
    /// nothing in it can finish. Never abandoned.
    Kill,
}

/// How a step ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The engine started and answers; whether it can sleep.
    Started {
        /// It has a sleep API.
        sleeps: bool,
    },
    /// The start failed; nothing runs.
    StartFailed(String),
    /// The engine is asleep.
    Slept,
    /// The engine would not sleep (it is still awake).
    SleepRefused(String),
    /// The engine is awake again.
    Woke,
    /// The wake failed; the engine's state is unknown (it is stopped next).
    WakeFailed(String),
    /// The engine process is gone.
    Stopped,
    /// The step was abandoned before it changed the engine: a start left
    /// nothing running, a sleep left the engine awake.
    Abandoned,
}

/// What the controller hears from a node.
#[derive(Debug, Clone, PartialEq)]
pub enum Fact {
    /// A replica serves: started (`woke: false`, a cold start) or woken
    /// from the warm cache, `took_ms` after its step began.
    Ready {
        /// The replica.
        replica: ReplicaId,
        /// Its model.
        model: ModelKey,
        /// It woke from the warm cache rather than starting cold.
        woke: bool,
        /// Its start or wake, ms.
        took_ms: Millis,
        /// Its engine can sleep.
        sleeps: bool,
    },
    /// A replica failed: it did not start (`start_failed`), or its engine
    /// died or stopped answering.
    Failed {
        /// The replica.
        replica: ReplicaId,
        /// Its model.
        model: ModelKey,
        /// What happened.
        why: String,
        /// It never served.
        start_failed: bool,
    },
    /// A replica placement wants WARM has no engine kept for it (it could
    /// not sleep, there was none, or it died or hung asleep): it is cold.
    Cold {
        /// The replica.
        replica: ReplicaId,
        /// Its model.
        model: ModelKey,
        /// Why, if its engine died or hung in the warm cache; `None`: it
        /// could not sleep, or had no engine.
        failed: Option<String>,
    },
}

/// What the driver must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Carry out `step` for `replica`; its engine is incarnation
    /// `incarnation` (a start begins a new one).
    Step {
        /// The replica.
        replica: ReplicaId,
        /// The engine incarnation the step acts on.
        incarnation: u64,
        /// What to do.
        step: Step,
    },
    /// The step in flight for `replica` is no longer wanted: cut it short
    /// if it has not changed the engine yet.
    Abandon {
        /// The replica.
        replica: ReplicaId,
    },
    /// Give `replica` its permits: it serves.
    Serve {
        /// The replica.
        replica: ReplicaId,
    },
    /// Take `replica`'s permits: no new request goes there.
    Unserve {
        /// The replica.
        replica: ReplicaId,
    },
    /// `replica` left the node's books (not wanted, no engine): forget it.
    Forget {
        /// The replica.
        replica: ReplicaId,
    },
    /// Tell the controller.
    Fact(Fact),
}

/// Why a step or report was refused; the machine is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LifecycleError {
    /// A desired state for a node this machine does not drive.
    #[error("node `{0}` is not one of this driver's nodes")]
    UnknownNode(String),
    /// A desired replica names a GPU the node does not have.
    #[error("replica {replica} is placed on GPU {gpu} of node `{node}`, which has {gpus} GPUs")]
    NoSuchGpu {
        /// The node.
        node: String,
        /// The replica.
        replica: ReplicaId,
        /// The GPU asked for.
        gpu: u32,
        /// How many the node has.
        gpus: usize,
    },
    /// One replica twice in a desired state, or on two nodes.
    #[error("replica {0} is listed twice in the desired state")]
    Duplicate(ReplicaId),
}

/// One replica's books.
#[derive(Debug, Clone)]
struct Replica {
    model: ModelKey,
    node: String,
    /// `None`: not wanted (gone from the desired state).
    want: Option<Tier>,
    engine: Engine,
    /// The engine can sleep (probed at its start).
    sleeps: bool,
    /// It has permits.
    serving: bool,
    /// The engine it has (bumped at each start).
    incarnation: u64,
    /// When the step in flight began.
    step_at: Millis,
    /// The awake engine came from a wake (not a cold start).
    woke: bool,
    /// Whether the engine became awake since it last served (a Ready is
    /// owed when it serves).
    ready_owed: bool,
    /// An abandon was sent for the step in flight.
    abandoned: bool,
    /// The next restart's back-off.
    backoff: Millis,
    /// A `Cold` fact was sent for the present WARM want.
    cold_told: bool,
    /// When the observed state last changed.
    since: Millis,
}

/// One replica as a report or the admin API shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplicaView {
    /// The replica.
    pub replica: ReplicaId,
    /// Its model.
    pub model: ModelKey,
    /// Its node.
    pub node: String,
    /// What placement wants (`None`: gone, being stopped).
    pub want: Option<Tier>,
    /// Its engine.
    pub engine: Engine,
    /// It has permits.
    pub serving: bool,
    /// Its engine can sleep.
    pub sleeps: bool,
    /// Its engine incarnation.
    pub incarnation: u64,
    /// When its observed state last changed.
    pub since: Millis,
}

/// The lifecycle machine of one driver's nodes. See the module doc.
#[derive(Debug, Clone)]
pub struct Lifecycle {
    /// Node → each GPU's memory, bytes.
    nodes: BTreeMap<String, Vec<u64>>,
    replicas: BTreeMap<ReplicaId, Replica>,
    outputs: VecDeque<Output>,
    incarnations: u64,
    now: Millis,
}

impl Lifecycle {
    /// A machine for `nodes` (name → each GPU's memory in bytes), with no
    /// replicas.
    pub fn new(nodes: impl IntoIterator<Item = (String, Vec<u64>)>) -> Self {
        Lifecycle {
            nodes: nodes.into_iter().collect(),
            replicas: BTreeMap::new(),
            outputs: VecDeque::new(),
            incarnations: 0,
            now: 0,
        }
    }

    // ---- getters -----------------------------------------------------

    /// Every replica the node has books for, in id order.
    pub fn views(&self) -> impl Iterator<Item = ReplicaView> + '_ {
        self.replicas.iter().map(|(id, r)| view(*id, r))
    }

    /// One replica.
    pub fn view(&self, replica: ReplicaId) -> Option<ReplicaView> {
        self.replicas.get(&replica).map(|r| view(replica, r))
    }

    /// The nodes and their GPUs' memory.
    pub fn nodes(&self) -> &BTreeMap<String, Vec<u64>> {
        &self.nodes
    }

    /// Bytes engines hold on each GPU of `node` now.
    pub fn held(&self, node: &str) -> Vec<u64> {
        let mut held = vec![0; self.nodes.get(node).map_or(0, Vec::len)];
        for r in self.replicas.values().filter(|r| r.node == node) {
            if let Some(slot) = r.engine.holds() {
                for (gpu, bytes) in &slot.gpus {
                    if let Some(h) = held.get_mut(*gpu as usize) {
                        *h += bytes;
                    }
                }
            }
        }
        held
    }

    /// When [`Lifecycle::handle_timeout`] is next due: the earliest retry
    /// of a failed replica still wanted HOT that has not come yet. (One
    /// whose retry has come but waits for room on its GPUs is decided
    /// again when room is freed: at the end of another replica's step.)
    pub fn poll_timeout(&self) -> Option<Millis> {
        self.replicas
            .values()
            .filter(|r| matches!(r.want, Some(Tier::Hot(_))))
            .filter_map(|r| match r.engine {
                Engine::Failed { retry_at, .. } => Some(retry_at),
                _ => None,
            })
            .filter(|at| *at > self.now)
            .min()
    }

    /// The next thing for the driver to do.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    // ---- inputs ------------------------------------------------------

    /// Replaces what placement wants on `node`: every replica listed, at
    /// its tier; every other replica of the node is gone. Refused whole
    /// (nothing changes) if it names a GPU the node lacks or a replica
    /// twice or already on another node.
    pub fn set_desired(&mut self, now: Millis, node: &str, wanted: &[Wanted]) -> Result<(), LifecycleError> {
        self.tick(now);
        let gpus = self.nodes.get(node).ok_or_else(|| LifecycleError::UnknownNode(node.to_owned()))?.len();
        let mut seen = std::collections::BTreeSet::new();
        for w in wanted {
            if !seen.insert(w.replica) || self.replicas.get(&w.replica).is_some_and(|r| r.node != node) {
                return Err(LifecycleError::Duplicate(w.replica));
            }
            if let Tier::Hot(slot) = &w.tier {
                if let Some(&gpu) = slot.gpus.keys().find(|g| **g as usize >= gpus) {
                    return Err(LifecycleError::NoSuchGpu {
                        node: node.to_owned(),
                        replica: w.replica,
                        gpu,
                        gpus,
                    });
                }
            }
        }
        for r in self.replicas.values_mut().filter(|r| r.node == node) {
            r.want = None;
        }
        for w in wanted {
            let r = self.replicas.entry(w.replica).or_insert_with(|| Replica {
                model: w.model.clone(),
                node: node.to_owned(),
                want: None,
                engine: Engine::Absent,
                sleeps: false,
                serving: false,
                incarnation: 0,
                step_at: now,
                woke: false,
                ready_owed: false,
                abandoned: false,
                backoff: FIRST_BACKOFF_MS,
                cold_told: false,
                since: now,
            });
            if r.want.as_ref() != Some(&w.tier) {
                r.cold_told = false;
            }
            r.want = Some(w.tier.clone());
        }
        self.decide_all();
        Ok(())
    }

    /// The step in flight for `replica` ended with `outcome`. A report for
    /// a replica with no step in flight is ignored.
    pub fn handle_step_done(&mut self, now: Millis, replica: ReplicaId, outcome: Outcome) {
        self.tick(now);
        let Some(r) = self.replicas.get_mut(&replica) else { return };
        // Not in a step; or the late outcome of a sleep or wake a kill
        // overtook (only the kill's own end frees the engine's GPUs).
        let overtaken = matches!(r.engine, Engine::Killing { .. }) && !matches!(outcome, Outcome::Stopped);
        if !r.engine.in_step() || overtaken {
            return;
        }
        r.abandoned = false;
        r.since = now;
        let engine = std::mem::replace(&mut r.engine, Engine::Absent);
        r.engine = match (engine, outcome) {
            (Engine::Starting { slot }, Outcome::Started { sleeps }) => {
                r.sleeps = sleeps;
                r.woke = false;
                r.ready_owed = true;
                Engine::Awake { slot }
            }
            (Engine::Starting { .. }, Outcome::StartFailed(why)) => {
                let fact =
                    Fact::Failed { replica, model: r.model.clone(), why: why.clone(), start_failed: true };
                self.outputs.push_back(Output::Fact(fact));
                failed(r, now, why)
            }
            (Engine::Starting { .. }, _) => Engine::Absent,
            (Engine::FallingAsleep { slot }, Outcome::Slept) => Engine::Asleep { slot },
            (Engine::FallingAsleep { slot }, Outcome::Abandoned) => Engine::Awake { slot },
            (Engine::FallingAsleep { slot }, _) => {
                // It would not sleep: it is stopped rather than kept WARM.
                r.sleeps = false;
                Engine::Awake { slot }
            }
            (Engine::Waking { slot }, Outcome::Woke) => {
                r.woke = true;
                r.ready_owed = true;
                Engine::Awake { slot }
            }
            // A failed wake leaves the engine in an unknown state: it is
            // stopped, and started afresh if still wanted.
            (Engine::Waking { slot }, _) => Engine::Stopping { holds: Some(slot) },
            (Engine::Stopping { .. }, _) => Engine::Absent,
            (Engine::Killing { why, .. }, _) => failed(r, now, why),
            (other, _) => other,
        };
        if matches!(r.engine, Engine::Stopping { .. }) {
            // The wake failed: stop it now.
            r.step_at = now;
            let incarnation = r.incarnation;
            self.outputs.push_back(Output::Step { replica, incarnation, step: Step::Stop });
        }
        self.decide_all();
    }

    /// `replica`'s engine of `incarnation` died or stopped answering (a
    /// health check): it is killed ([`Step::Kill`]), holding its GPUs until
    /// it is gone, and then failed. A sleep or wake in flight is overtaken:
    /// a hung engine never answers it, and its late outcome is ignored
    /// (see [`Lifecycle::handle_step_done`]). Ignored if that engine is no
    /// longer the replica's, or is starting or stopping (those steps end
    /// by themselves).
    pub fn handle_lost(&mut self, now: Millis, replica: ReplicaId, incarnation: u64, why: &str) {
        self.tick(now);
        let Some(r) = self.replicas.get_mut(&replica) else { return };
        let holds = match &r.engine {
            _ if r.incarnation != incarnation => return,
            Engine::Awake { slot } | Engine::FallingAsleep { slot } | Engine::Waking { slot } => {
                Some(slot.clone())
            }
            Engine::Asleep { .. } => None,
            _ => return,
        };
        if r.serving {
            r.serving = false;
            self.outputs.push_back(Output::Unserve { replica });
        }
        let asleep = matches!(r.engine, Engine::Asleep { .. } | Engine::FallingAsleep { .. });
        if asleep && matches!(r.want, Some(Tier::Warm)) {
            // Asleep in the warm cache, or on its way there: the controller
            // hears at once that no engine is kept for it, and why.
            r.cold_told = true;
            let fact = Fact::Cold { replica, model: r.model.clone(), failed: Some(why.to_owned()) };
            self.outputs.push_back(Output::Fact(fact));
        } else if holds.is_some() {
            // One that serves or was to serve failed.
            let fact =
                Fact::Failed { replica, model: r.model.clone(), why: why.to_owned(), start_failed: false };
            self.outputs.push_back(Output::Fact(fact));
        }
        // Killed, not stopped: a hung engine would not drain, and its GPUs
        // are not free for another until its process is gone.
        r.engine = Engine::Killing { holds, why: why.to_owned() };
        r.since = now;
        r.step_at = now;
        self.outputs.push_back(Output::Step { replica, incarnation, step: Step::Kill });
        self.decide_all();
    }

    /// Retries failed replicas whose back-off has passed.
    pub fn handle_timeout(&mut self, now: Millis) {
        self.tick(now);
        self.decide_all();
    }

    // ---- internals ---------------------------------------------------

    fn tick(&mut self, now: Millis) {
        self.now = self.now.max(now);
    }

    /// Decides every replica once; starts and wakes go last, so room that
    /// the same pass frees (nothing does synchronously) or that others
    /// hold is counted as it stands.
    fn decide_all(&mut self) {
        let ids: Vec<ReplicaId> = self.replicas.keys().copied().collect();
        for id in &ids {
            self.decide(*id);
        }
    }

    /// The one next step for `id`, if any, and the permits it implies.
    fn decide(&mut self, id: ReplicaId) {
        let now = self.now;
        let room = {
            let r = &self.replicas[&id];
            match (&r.want, &r.engine) {
                (Some(Tier::Hot(slot)), Engine::Absent | Engine::Failed { .. } | Engine::Asleep { .. }) => {
                    self.has_room(&r.node, id, slot)
                }
                _ => false,
            }
        };
        let r = self.replicas.get_mut(&id).expect("a listed replica");
        let out = &mut self.outputs;
        // Permits first: a replica serves only awake on its wanted slot.
        let should_serve = matches!((&r.want, &r.engine),
            (Some(Tier::Hot(want)), Engine::Awake { slot }) if want == slot);
        if r.serving && !should_serve {
            r.serving = false;
            out.push_back(Output::Unserve { replica: id });
        }
        if r.engine.in_step() {
            let abandon = match (&r.want, &r.engine) {
                (Some(Tier::Hot(want)), Engine::Starting { slot }) => want != slot,
                (_, Engine::Starting { .. }) => true,
                (Some(Tier::Hot(want)), Engine::FallingAsleep { slot }) => want == slot,
                _ => false,
            };
            if abandon && !r.abandoned {
                r.abandoned = true;
                out.push_back(Output::Abandon { replica: id });
            }
            return;
        }
        let step = match (r.want.clone(), r.engine.clone()) {
            (None, Engine::Absent | Engine::Failed { .. }) => {
                self.replicas.remove(&id);
                self.outputs.push_back(Output::Forget { replica: id });
                return;
            }
            (None, Engine::Awake { slot }) => Some((Step::Stop, Engine::Stopping { holds: Some(slot) })),
            (None, Engine::Asleep { .. }) => Some((Step::Stop, Engine::Stopping { holds: None })),
            (Some(Tier::Hot(want)), Engine::Awake { slot }) if want == slot => {
                if !r.serving {
                    r.serving = true;
                    r.backoff = FIRST_BACKOFF_MS;
                    out.push_back(Output::Serve { replica: id });
                    if r.ready_owed {
                        r.ready_owed = false;
                        out.push_back(Output::Fact(Fact::Ready {
                            replica: id,
                            model: r.model.clone(),
                            woke: r.woke,
                            took_ms: now.saturating_sub(r.step_at),
                            sleeps: r.sleeps,
                        }));
                    }
                }
                None
            }
            // Awake, or asleep, on other GPUs than wanted: a restart there.
            (Some(Tier::Hot(_)), Engine::Awake { slot }) => {
                Some((Step::Stop, Engine::Stopping { holds: Some(slot) }))
            }
            (Some(Tier::Hot(want)), Engine::Asleep { slot }) if want == slot => {
                room.then_some((Step::Wake, Engine::Waking { slot }))
            }
            (Some(Tier::Hot(_)), Engine::Asleep { .. }) => {
                Some((Step::Stop, Engine::Stopping { holds: None }))
            }
            (Some(Tier::Hot(want)), Engine::Absent) => room.then(|| {
                (Step::Start { model: r.model.clone(), slot: want.clone() }, Engine::Starting { slot: want })
            }),
            (Some(Tier::Hot(want)), Engine::Failed { retry_at, .. }) => {
                (room && now >= retry_at).then(|| {
                    (
                        Step::Start { model: r.model.clone(), slot: want.clone() },
                        Engine::Starting { slot: want },
                    )
                })
            }
            (Some(Tier::Warm), Engine::Awake { slot }) if r.sleeps => {
                Some((Step::Sleep, Engine::FallingAsleep { slot }))
            }
            (Some(Tier::Warm), Engine::Awake { slot }) => {
                Some((Step::Stop, Engine::Stopping { holds: Some(slot) }))
            }
            (Some(Tier::Warm), Engine::Absent | Engine::Failed { .. }) => {
                if !r.cold_told {
                    r.cold_told = true;
                    out.push_back(Output::Fact(Fact::Cold {
                        replica: id,
                        model: r.model.clone(),
                        failed: None,
                    }));
                }
                None
            }
            (Some(Tier::Warm), Engine::Asleep { .. }) => None,
            (
                _,
                Engine::Starting { .. }
                | Engine::FallingAsleep { .. }
                | Engine::Waking { .. }
                | Engine::Stopping { .. }
                | Engine::Killing { .. },
            ) => {
                unreachable!("a step in flight returned above")
            }
        };
        if let Some((step, engine)) = step {
            if matches!(step, Step::Start { .. }) {
                self.incarnations += 1;
                r.incarnation = self.incarnations;
            }
            r.engine = engine;
            r.step_at = now;
            r.since = now;
            r.abandoned = false;
            out.push_back(Output::Step { replica: id, incarnation: r.incarnation, step });
        }
    }

    /// Whether every GPU of `slot` on `node` has room for it beside what
    /// the other engines there hold now.
    fn has_room(&self, node: &str, id: ReplicaId, slot: &Slot) -> bool {
        let Some(capacity) = self.nodes.get(node) else { return false };
        slot.gpus.iter().all(|(gpu, bytes)| {
            let held: u64 = self
                .replicas
                .iter()
                .filter(|(other, r)| **other != id && r.node == node)
                .filter_map(|(_, r)| r.engine.holds()?.gpus.get(gpu))
                .sum();
            capacity.get(*gpu as usize).is_some_and(|cap| held + bytes <= *cap)
        })
    }
}

/// The failed state after `why`, with the replica's back-off doubled.
fn failed(r: &mut Replica, now: Millis, why: String) -> Engine {
    let retry_at = now.saturating_add(r.backoff);
    r.backoff = (r.backoff * 2).min(MAX_BACKOFF_MS);
    r.ready_owed = false;
    Engine::Failed { why, retry_at }
}

fn view(id: ReplicaId, r: &Replica) -> ReplicaView {
    ReplicaView {
        replica: id,
        model: r.model.clone(),
        node: r.node.clone(),
        want: r.want.clone(),
        engine: r.engine.clone(),
        serving: r.serving,
        sleeps: r.sleeps,
        incarnation: r.incarnation,
        since: r.since,
    }
}
