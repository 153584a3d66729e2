//! [`Controller`]: every model's scaler and the cluster's placement in one
//! sans-IO state machine — the one place replica counts are decided.
//!
//! It owns the [`Cluster`], a [`Scaler`] per model and each model's
//! placement state. Facts come in (observations, a replica ready, failed,
//! or not starting), commands too (freeze, pin, release, evict), and out
//! come [`Action`]s: deployment deltas for the driver to apply to engines,
//! the decisions taken, and a model becoming unplaceable or placeable
//! again. The live server drives it from one task; the simulator drives
//! it on its logical clock.
//!
//! # Reconciling
//! After each decision, and at each retry, a model's hot replicas are
//! brought to its scaler's count: more are placed through
//! [`Cluster::deploy`]; fewer are evicted, least busy first (to the warm
//! cache when it has room). A model placement cannot fit is *unplaceable*:
//! its scaler is capped at what fits, and the controller retries after a
//! back-off (1 s doubling to 60 s while it stays unplaceable) instead of
//! trying again every tick — or at once when GPUs are freed (another model
//! shrinks, a replica fails, a dedicated window ends, a node joins), so a
//! model waiting for room, and the WARM replicas it holds in the warm
//! cache, come back as soon as there is room rather than at the end of a
//! back-off. A WARM replica idle beyond its scaler's keep time is let go.
//!
//! # Start failures
//! A replica that does not start ([`Controller::handle_failed`] with
//! `start_failed`) blocks its model too, for a back-off of its own: 1 s
//! after the first failure, doubling with each start that fails in a row
//! (1, 2, 4 … 60 s), until a replica of the model becomes ready
//! ([`Controller::handle_ready`]), which starts it over at 1 s. Placing the
//! retry does not reset it, so a broken engine is restarted less and less
//! often rather than every second; freed GPUs and joining nodes do not
//! bring it forward, as room is not what it waits for. Replicas of one
//! model that fail together — started in one round, their failures
//! arriving while the model already waits out a start back-off — count as
//! one failure.
//!
//! # Engines that cannot sleep
//! [`Controller::handle_ready`] also says whether the started engine can
//! sleep; the controller tells placement ([`Cluster::set_sleeps`]), which
//! then evicts that model's replicas straight to COLD (stopped) rather than
//! to the warm cache, where it would have pushed out WARM replicas of
//! other models for nothing.
//!
//! # Nodes that join and leave
//! Node agents come and go while the controller runs. A node that joins
//! ([`Controller::handle_node_joined`]) is room, so every backed-off model
//! is retried at once, as when GPUs are freed. A node that is lost
//! ([`Controller::handle_node_lost`]) takes its replicas with it: the HOT
//! ones are placed again on the remaining nodes in the same call, its
//! WARM ones are gone (COLD).
//!
//! # Draining nodes
//! A node drained on purpose ([`Controller::drain`]: an operator's
//! command, or its agent leaving) is moved off make-before-break: placement
//! takes it out of the candidates and stops counting its HOT replicas
//! (`Cluster::set_draining`), so reconciling places each model's count on
//! the other nodes while the *leaving* replicas keep serving; its WARM
//! replicas are let go at once (the node is on its way out). A leaving
//! replica is stopped once the model's ready replicas would still number
//! its count without it — ready, as the last observation of the model says
//! — so a drain never takes a model below what it serves with; a leaving
//! replica not ready yet goes at once. When no other node has room, the
//! leaving replicas stay and the model shows as unplaceable, until room
//! comes or the drain is called off.
//!
//! # Weight residency
//! Which weight artifact each model loads and which artifacts each node
//! holds resident are facts of the nodes ([`Controller::set_model_artifact`],
//! [`Controller::set_resident`]); the controller hands them to placement,
//! which breaks ties between equally good nodes in favour of one that need
//! not read the model's weights again.
//!
//! # Dedicated windows
//! A [`Schedule`] (seed 000's dedicated deployments) is applied at each
//! window's start and end, on time: placement keeps the window's replicas
//! hot and marked dedicated (no other model may take their GPUs), and the
//! model's scaler keeps at least that many until the window ends; then the
//! replicas are ordinary again and the policy gives them back when the
//! demand allows.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use hangar_core::{Millis, ModelKey, ReplicaId};
use hangar_placement::{
    AddNodeError, Cluster, Deployment, DeploymentDelta, DrainError, Level, NodeConfig, NodeId,
    ReplicaRequest, ResidencyError, Restore, Schedule, Snapshot,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::decision::{Decision, Reason};
use crate::observation::Observation;
use crate::scaler::{Bounds, Scaler, StartTier};
use crate::ScalingConfig;

/// The first retry of an unplaceable model, or after a first start failure.
const FIRST_BACKOFF: Millis = 1_000;
/// The longest wait between retries.
const MAX_BACKOFF: Millis = 60_000;

/// The least time a model's requests wait for room before another model's
/// replicas beyond its demand are given to it (its mean COLD start when
/// longer): shorter, and two models would trade GPUs on every lull.
pub const STARVATION_PATIENCE_MS: Millis = 60_000;

/// The wait after the `last` one (`None`: there was none): the first, then
/// twice the last, at most [`MAX_BACKOFF`].
fn next_backoff(last: Option<Millis>) -> Millis {
    last.map_or(FIRST_BACKOFF, |b| b.saturating_mul(2).min(MAX_BACKOFF))
}

/// One model as the controller is given it.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    /// The model (it must be in the cluster's catalogue).
    pub key: ModelKey,
    /// Its scaling policy.
    pub scaling: ScalingConfig,
    /// `min_replicas` and `max_replicas`.
    pub bounds: Bounds,
    /// Its TTFT objective (`slo_ttft_ms`), which the `hangar` policy
    /// scales to meet.
    pub slo_ttft_ms: Option<Millis>,
}

/// What the controller asks of its driver, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Apply these placement steps to engines (`to_cache`, `delete`,
    /// `from_cache`, `create`, in the delta's order).
    Apply(DeploymentDelta),
    /// A scaler changed a model's count.
    Decided {
        /// The model.
        model: ModelKey,
        /// The decision.
        decision: Decision,
    },
    /// The model's count cannot be placed (reported once per change of
    /// reason).
    Unplaceable {
        /// The model.
        model: ModelKey,
        /// Why, as placement or the engine start said.
        reason: String,
        /// Whether placement found no room or an engine did not start.
        cause: BlockCause,
    },
    /// The model is placeable again.
    Placeable {
        /// The model.
        model: ModelKey,
    },
}

/// Why a command could not be carried out; the controller is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CommandError {
    /// No such model.
    #[error("the model `{0}` does not exist")]
    UnknownModel(ModelKey),
    /// The model has no such replica.
    #[error("`{model}` has no replica `{replica}` on GPUs or in the warm cache")]
    UnknownReplica {
        /// The model.
        model: ModelKey,
        /// The replica asked for.
        replica: ReplicaId,
    },
    /// Bounds no model can run within.
    #[error("invalid replica bounds: {0}")]
    InvalidBounds(String),
    /// A pinned count beyond the model's bounds.
    #[error("{replicas} replicas is outside the model's bounds ({min} to {max})")]
    OutOfBounds {
        /// Asked for.
        replicas: u32,
        /// `min_replicas`.
        min: u32,
        /// `max_replicas`.
        max: u32,
    },
}

/// Why a model is not at its count, and when it is tried again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Blocked {
    /// Placement's or the engine's reason.
    pub reason: String,
    /// What the model waits out.
    pub cause: BlockCause,
    /// When placement is tried again.
    pub retry_at: Millis,
    /// The wait this retry came after.
    pub backoff: Millis,
}

/// What a blocked model waits out: it decides what brings the retry
/// forward and how the next wait is reckoned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockCause {
    /// Placement cannot fit the model's count: no node, none with the
    /// hardware the model needs, or no GPU free that may be taken. Retried
    /// at once when GPUs are freed or a node joins; the wait doubles while
    /// it stays blocked. Room comes and goes, so this is a wait, not a
    /// failure: work for the model may wait for room.
    NoRoom,
    /// A replica did not start (a broken command, a model whose setup
    /// fails). Retried only when the wait is over; the wait doubles with
    /// each start that fails in a row until a replica of the model is
    /// ready, however the retries in between were placed. Work for the
    /// model cannot be served by waiting for room.
    StartFailed,
}

#[derive(Debug, Clone)]
struct Control {
    scaler: Scaler,
    blocked: Option<Blocked>,
    /// Requests in flight on each replica, from the last observation.
    in_flight: BTreeMap<ReplicaId, u32>,
    /// When each WARM replica went WARM.
    warm_since: BTreeMap<ReplicaId, Millis>,
    /// The wait the last start failure imposed, while no replica has been
    /// ready since (`None`: the next start failure waits the first
    /// back-off).
    start_backoff: Option<Millis>,
    /// Since when requests have waited while placement found no room for
    /// the model's count.
    starving_since: Option<Millis>,
}

/// Every model's scaler and the cluster they share. See the module doc.
pub struct Controller {
    cluster: Cluster,
    rng: ChaCha8Rng,
    models: BTreeMap<ModelKey, Control>,
    actions: VecDeque<Action>,
    schedule: Schedule,
    /// The next window start or end not applied yet.
    schedule_due: Option<Millis>,
}

impl Controller {
    /// A controller of `models` on `cluster` (placement's random choices
    /// seeded with `seed`); the first decisions are due at once.
    pub fn new(cluster: Cluster, seed: u64, models: Vec<ModelSpec>, now: Millis) -> Self {
        let models = models
            .into_iter()
            .map(|m| {
                let control = Control {
                    scaler: Scaler::new(&m.scaling, m.bounds, now).with_objective(m.slo_ttft_ms),
                    blocked: None,
                    in_flight: BTreeMap::new(),
                    warm_since: BTreeMap::new(),
                    start_backoff: None,
                    starving_since: None,
                };
                (m.key, control)
            })
            .collect();
        let mut c = Controller {
            cluster,
            rng: ChaCha8Rng::seed_from_u64(seed),
            models,
            actions: VecDeque::new(),
            schedule: Schedule::default(),
            schedule_due: None,
        };
        let keys: Vec<ModelKey> = c.models.keys().cloned().collect();
        for key in keys {
            c.reconcile(now, &key);
        }
        c
    }

    // ---- getters -----------------------------------------------------

    /// The cluster as placement sees it.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// A model's scaler.
    pub fn scaler(&self, model: &ModelKey) -> Option<&Scaler> {
        self.models.get(model).map(|c| &c.scaler)
    }

    /// Why a model is short of its count, if it is.
    pub fn blocked(&self, model: &ModelKey) -> Option<&Blocked> {
        self.models.get(model).and_then(|c| c.blocked.as_ref())
    }

    /// The dedicated schedule in force.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The earliest moment something is due: a decision, a retry or a
    /// dedicated window's start or end.
    pub fn poll_timeout(&self) -> Millis {
        self.models
            .values()
            .flat_map(|c| {
                let retry = c.blocked.as_ref().map(|b| b.retry_at);
                [Some(c.scaler.poll_timeout()), retry]
            })
            .chain([self.schedule_due])
            .flatten()
            .min()
            .unwrap_or(Millis::MAX)
    }

    /// The next action for the driver.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    // ---- facts -------------------------------------------------------

    /// `model` as it is at `now`, with the requests in flight on each of
    /// its ready replicas (to pick the least busy when it shrinks).
    pub fn observe(
        &mut self,
        now: Millis,
        model: &ModelKey,
        obs: Observation,
        in_flight: &[(ReplicaId, u32)],
    ) {
        if let Some(c) = self.models.get_mut(model) {
            c.scaler.observe(now, obs);
            c.in_flight = in_flight.iter().copied().collect();
            // Which replicas serve is what a leaving one waits on.
            self.retire_leaving(model);
        }
    }

    /// Takes every decision and retry due at `now`, and reconciles what
    /// they changed. Early calls do nothing.
    pub fn handle_timeout(&mut self, now: Millis) {
        if self.schedule_due.is_some_and(|t| t <= now) {
            self.apply_schedule(now);
        }
        let keys: Vec<ModelKey> = self.models.keys().cloned().collect();
        for key in &keys {
            self.handle_model_timeout(now, key);
        }
        self.relieve_starvation(now, &keys);
    }

    /// Takes what is due at `now` for `model` alone: its decision, its
    /// retry, its WARM replicas' keep time. For a request of the model that
    /// has to wait, which must be decided on at once: the other models are
    /// not due (a driver calls [`handle_timeout`](Self::handle_timeout) when
    /// [`poll_timeout`](Self::poll_timeout) says so), and starvation, which
    /// is reckoned in tens of seconds, is looked at on the next full call —
    /// so a waiting request costs one model's work, however many the fleet
    /// serves.
    pub fn handle_model_timeout(&mut self, now: Millis, model: &ModelKey) {
        let Some(c) = self.models.get_mut(model) else { return };
        let retry = c.blocked.as_ref().is_some_and(|b| b.retry_at <= now);
        if retry {
            // Let the scaler ask for its full count again.
            c.scaler.set_placeable(now, None);
        }
        let decided = c.scaler.handle_timeout(now);
        let due = retry || decided.is_some();
        if let Some(decision) = decided {
            self.actions.push_back(Action::Decided { model: model.clone(), decision });
        }
        if due {
            self.reconcile(now, model);
        }
        self.expire_warm(now, model);
    }

    /// A replica of `model` came up from `tier` after `took_ms`, on an
    /// engine that can (`sleeps`) or cannot sleep — a fact of the engine
    /// the driver probed, which placement needs to know before it evicts
    /// one of the model's replicas: one that cannot sleep goes COLD rather
    /// than taking warm-cache room ([`Cluster::set_sleeps`]). The model's
    /// start back-off starts over: the next start failure waits 1 s.
    pub fn handle_ready(
        &mut self,
        _now: Millis,
        model: &ModelKey,
        tier: StartTier,
        took_ms: Millis,
        sleeps: bool,
    ) {
        if let Some(c) = self.models.get_mut(model) {
            c.scaler.handle_start(tier, took_ms);
            c.start_backoff = None;
            // A model the controller serves is in the catalogue (`new`'s
            // contract), so this cannot fail.
            let _ = self.cluster.set_sleeps(model, sleeps);
        }
    }

    /// A replica of `model` is gone: its engine died, stopped answering,
    /// or never started (`start_failed`, which also backs off further
    /// starts — 1 s, doubling with each start that fails in a row until a
    /// replica is ready — so a broken engine is not restarted in a tight
    /// loop; see the module doc). It leaves the cluster, and the model's
    /// count is restored (after the back-off, for a start failure).
    pub fn handle_failed(
        &mut self,
        now: Millis,
        model: &ModelKey,
        replica: ReplicaId,
        why: &str,
        start_failed: bool,
    ) {
        // A fact about a replica placement no longer holds is stale (a
        // node reports what it runs several times a second): nothing to do.
        if !self.models.contains_key(model) || self.cluster.deployment(&replica).is_none() {
            return;
        }
        let c = &self.models[model];
        // Started in the round that is already backed off: the same failure.
        let same_round =
            c.blocked.as_ref().is_some_and(|b| b.cause == BlockCause::StartFailed && b.retry_at > now);
        self.remove(now, model, replica);
        if !start_failed {
            self.reconcile(now, model);
            return;
        }
        let reason = format!("a replica did not start: {why}");
        if same_round {
            let b = self.models.get_mut(model).expect("checked").blocked.as_mut().expect("same round");
            if b.reason != reason {
                b.reason.clone_from(&reason);
                self.actions.push_back(Action::Unplaceable {
                    model: model.clone(),
                    reason,
                    cause: BlockCause::StartFailed,
                });
            }
            return;
        }
        let c = self.models.get_mut(model).expect("checked");
        let backoff = next_backoff(c.start_backoff);
        c.start_backoff = Some(backoff);
        self.block(now, model, reason, BlockCause::StartFailed, backoff);
    }

    /// A replica of `model` that placement sent to the warm cache was
    /// stopped instead (its engine cannot sleep): it leaves the cluster,
    /// so it is neither counted WARM nor woken; the model's count stands.
    pub fn handle_stopped(&mut self, now: Millis, model: &ModelKey, replica: ReplicaId) {
        self.remove(now, model, replica);
    }

    /// A node agent joined with the machine `node` describes, running
    /// `running` (what its agent reports: a node back after a silence, or
    /// whose agent outlived a Redis that lost its data). Its GPUs are
    /// placement candidates from now on.
    ///
    /// What it runs is adopted where that loses nothing and costs nothing:
    /// a HOT replica while its model has fewer hot replicas than its scaler
    /// wants (and it fits where it runs), a WARM one while the node's warm
    /// cache has room. Returns the node's deployments — the adopted ones —
    /// which the driver makes the node's whole desired state: it keeps
    /// those, and stops whatever was not adopted. No adopted replica is
    /// started again.
    ///
    /// Every model backed off for want of room has its retry brought
    /// forward to `now` (as when GPUs are freed; one waiting out a start
    /// failure keeps waiting), so one that waits for room — or
    /// for hardware only this node has — is placed by the driver's next
    /// [`handle_timeout`] at this same instant ([`poll_timeout`] says it is
    /// due), after the driver has observed the models, rather than at the
    /// end of a back-off of up to a minute. Refused, with nothing changed,
    /// if a node of that id is already in the cluster or the description is
    /// one the cluster's config would refuse.
    ///
    /// [`handle_timeout`]: Self::handle_timeout
    /// [`poll_timeout`]: Self::poll_timeout
    pub fn handle_node_joined(
        &mut self,
        now: Millis,
        node: NodeConfig,
        running: &[Restore],
    ) -> Result<Vec<Deployment>, AddNodeError> {
        let id = node.id.clone();
        self.cluster.add_node(node)?;
        for r in running {
            let Some(c) = self.models.get(&r.model_key) else { continue };
            let wanted = match r.level {
                Level::Hot => self.hot(&r.model_key) < c.scaler.desired(),
                _ => true,
            };
            let restore = Restore { node: id.clone(), dedicated: false, deployed_at_ms: now, ..r.clone() };
            if wanted && self.cluster.restore(restore).is_ok() && r.level == Level::Warm {
                self.models.get_mut(&r.model_key).expect("listed").warm_since.insert(r.replica_id, now);
            }
        }
        self.capacity_freed(now);
        let node = self.cluster.node(&id).expect("just added");
        Ok(node.hot().values().chain(node.warm().values()).flat_map(|m| m.values()).cloned().collect())
    }

    /// The node agent `node` is gone (its machine died, or it left): so are
    /// its replicas, which this returns (`None`, and nothing changes, if no
    /// such node is in the cluster — a loss reported twice), so the driver
    /// can stop routing to them; no delta deletes them, as no agent is left
    /// to carry that out. Each leaves its model's books as a failed
    /// replica does. Lost HOT replicas are placed again on the nodes that
    /// remain, at once and in one batch: the next [`poll_action`] yields the
    /// delta that creates them, as far as the room left allows (a model
    /// short of its count is backed off as unplaceable, as always). That
    /// includes a model already backed off: its back-off was about the
    /// fleet as it was, and the replicas it just lost are not a retry of a
    /// start that failed. A dedicated window's lost replicas come back
    /// dedicated. Lost WARM replicas are simply forgotten: their weights
    /// were in the lost node's memory, so they are COLD now.
    ///
    /// [`poll_action`]: Self::poll_action
    pub fn handle_node_lost(&mut self, now: Millis, node: &NodeId) -> Option<Vec<Deployment>> {
        let lost = self.cluster.remove_node(node)?;
        let mut short = BTreeSet::new();
        let mut dedicated = false;
        for d in &lost {
            self.forget(&d.model_key, d.replica_id);
            if d.level == Level::Hot && self.models.contains_key(&d.model_key) {
                short.insert(d.model_key.clone());
                dedicated |= d.dedicated;
            }
        }
        let before = self.cluster.snapshot();
        if dedicated {
            // Placement marks a window's replicas dedicated when it deploys
            // the window; re-deploying the windows in force replaces the
            // lost ones as dedicated, so no other model can take their
            // GPUs, instead of as ordinary replicas until the window ends.
            self.cluster.apply_schedule(&self.schedule, now, &mut self.rng);
        }
        let mut wants = Vec::new();
        for model in short {
            let desired = self.models[&model].scaler.desired();
            if desired > self.staying(&model) {
                wants.push((model, desired));
            }
        }
        self.grow(now, &before, &wants);
        Some(lost)
    }

    /// Takes `replica` out of the cluster (hot or warm) and out of its
    /// model's books; the GPUs it held are free for whoever waits. The
    /// delta that deletes it goes out too: its node must stop wanting it,
    /// or a node that restarts failed replicas by itself would bring back
    /// one placement no longer counts.
    fn remove(&mut self, now: Millis, model: &ModelKey, replica: ReplicaId) {
        let before = self.cluster.snapshot();
        while self.cluster.deployment(&replica).is_some() {
            if self.cluster.evict_replica(model, &replica).is_err() {
                break;
            }
        }
        self.push_delta(&before);
        self.forget(model, replica);
        self.capacity_freed(now);
    }

    /// Drops what `model`'s books hold about `replica`, which left the
    /// cluster: a gone replica must not be picked to shrink, nor let go of
    /// again when its warm keep time ends.
    fn forget(&mut self, model: &ModelKey, replica: ReplicaId) {
        if let Some(c) = self.models.get_mut(model) {
            c.in_flight.remove(&replica);
            c.warm_since.remove(&replica);
        }
    }

    /// The weight artifact `model`'s replicas load (as a started replica
    /// reported it), or none: among equally good nodes placement prefers
    /// one holding it resident ([`Cluster::set_model_artifact`]). Refused,
    /// with nothing changed, for a model placement does not know.
    pub fn set_model_artifact(
        &mut self,
        model: &ModelKey,
        artifact: Option<String>,
    ) -> Result<(), ResidencyError> {
        self.cluster.set_model_artifact(model, artifact)
    }

    /// The weight artifacts `node` holds resident, as its agent last
    /// reported them ([`Cluster::set_resident`]). Refused, with nothing
    /// changed, for a node not in the cluster (a report from one lost).
    pub fn set_resident(&mut self, node: &NodeId, artifacts: BTreeSet<String>) -> Result<(), ResidencyError> {
        self.cluster.set_resident(node, artifacts)
    }

    // ---- commands ----------------------------------------------------

    /// Drains `node` (`on`), or calls its drain off: see the module doc,
    /// "Draining nodes". Draining lets its WARM replicas go and places the
    /// count of every model it runs on the other nodes (as far as room
    /// allows); its leaving replicas stop as the observations show their
    /// replacements ready. Calling it off makes the node a candidate again
    /// and its replicas count again: a model then above its count gives
    /// back its least busy replicas. Refused, with nothing changed, for a
    /// node not in the cluster; the same word twice changes nothing. A
    /// driver observes the models first, as for any command: a replica is
    /// ready when the last observation says so.
    pub fn drain(&mut self, now: Millis, node: &NodeId, on: bool) -> Result<(), DrainError> {
        if self.cluster.node(node).is_some_and(|n| n.draining() == on) {
            return Ok(());
        }
        self.cluster.set_draining(node, on)?;
        let held = self.cluster.node(node).expect("just set");
        let models: BTreeSet<ModelKey> = held.hot().keys().cloned().collect();
        if on {
            let warm: Vec<(ModelKey, ReplicaId)> = held
                .warm()
                .values()
                .flat_map(|m| m.values())
                .map(|d| (d.model_key.clone(), d.replica_id))
                .collect();
            let dedicated = held.hot().values().flat_map(|m| m.values()).any(|d| d.dedicated);
            let before = self.cluster.snapshot();
            for (model, id) in warm {
                let _ = self.cluster.evict_replica(&model, &id);
                self.forget(&model, id);
            }
            if dedicated {
                // A dedicated window's replicas are replaced dedicated (as
                // a lost node's are): re-deploying the windows in force
                // counts only the staying ones and marks those first.
                self.cluster.apply_schedule(&self.schedule, now, &mut self.rng);
            }
            let evicted = self.push_delta(&before).map(evicted).unwrap_or_default();
            self.lower_preempted(now, evicted);
        } else {
            // Its GPUs are candidates again.
            self.capacity_freed(now);
        }
        for model in models {
            self.reconcile(now, &model);
        }
        Ok(())
    }

    /// Marks `node` suspect (`on`) or calls the suspicion off: its agent
    /// and engines stopped answering a gateway, which cannot tell yet
    /// whether the node is gone ([`Cluster::set_suspect`]). While suspect it
    /// hosts nothing new — a replica found dead there ([`handle_failed`])
    /// is placed again on another node, not on the one that just lost it —
    /// and what it holds stays put (if the node is gone,
    /// [`handle_node_lost`] says so). Calling it off makes the node a
    /// candidate again, as freed GPUs do. Refused, with nothing changed,
    /// for a node not in the cluster.
    ///
    /// [`handle_failed`]: Controller::handle_failed
    /// [`handle_node_lost`]: Controller::handle_node_lost
    pub fn suspect(&mut self, now: Millis, node: &NodeId, on: bool) -> Result<(), DrainError> {
        let was = self.cluster.node(node).is_some_and(hangar_placement::Node::suspect);
        self.cluster.set_suspect(node, on)?;
        if was && !on {
            self.capacity_freed(now);
        }
        Ok(())
    }

    /// Holds `model` at its current count.
    pub fn freeze(&mut self, now: Millis, model: &ModelKey) -> Result<(), CommandError> {
        let decided = self.control(model)?.scaler.freeze(now);
        self.after_command(now, model, decided);
        Ok(())
    }

    /// Holds `model` at `replicas`.
    pub fn pin(&mut self, now: Millis, model: &ModelKey, replicas: u32) -> Result<(), CommandError> {
        let c = self.control(model)?;
        let Bounds { min, max } = c.scaler.bounds();
        if !(min..=max).contains(&replicas) {
            return Err(CommandError::OutOfBounds { replicas, min, max });
        }
        let decided = c.scaler.pin(now, replicas);
        self.after_command(now, model, decided);
        Ok(())
    }

    /// Runs `model` between `bounds` from now on (a deployment's
    /// `min_instances` / `max_instances`); the same bounds again change
    /// nothing.
    pub fn set_bounds(&mut self, now: Millis, model: &ModelKey, bounds: Bounds) -> Result<(), CommandError> {
        bounds.check().map_err(CommandError::InvalidBounds)?;
        let decided = self.control(model)?.scaler.set_bounds(now, bounds);
        self.after_command(now, model, decided);
        Ok(())
    }

    /// Gives `model` back to its policy.
    pub fn release(&mut self, now: Millis, model: &ModelKey) -> Result<(), CommandError> {
        let decided = self.control(model)?.scaler.release(now);
        self.after_command(now, model, decided);
        Ok(())
    }

    /// Evicts one replica of `model`, or all its hot ones, to the warm
    /// cache (or out, without room there), and lowers the model's count to
    /// what stays hot so they do not come straight back; a later decision
    /// may raise it again. Returns how many replicas changed level.
    pub fn evict(
        &mut self,
        now: Millis,
        model: &ModelKey,
        replica: Option<ReplicaId>,
    ) -> Result<usize, CommandError> {
        self.control(model)?;
        let before = self.cluster.snapshot();
        let evicted = match replica {
            Some(id) => self
                .cluster
                .evict_replica(model, &id)
                .map_err(|_| CommandError::UnknownReplica { model: model.clone(), replica: id })?,
            None => self.cluster.evict_model(model),
        };
        self.push_delta(&before);
        let hot = self.hot(model);
        let c = self.models.get_mut(model).expect("checked");
        for e in &evicted {
            if self.cluster.deployment(&e.replica_id).is_some_and(|d| d.level == Level::Warm) {
                c.warm_since.insert(e.replica_id, now);
            }
        }
        if let Some(decision) = c.scaler.lower_to(now, hot) {
            self.actions.push_back(Action::Decided { model: model.clone(), decision });
        }
        Ok(evicted.len())
    }

    /// Replaces the dedicated schedule and applies it at once (windows of
    /// models the controller does not serve are ignored by placement's
    /// catalogue check in the deploy).
    pub fn set_schedule(&mut self, now: Millis, schedule: Schedule) {
        self.schedule = schedule;
        self.apply_schedule(now);
    }

    // ---- internals ---------------------------------------------------

    fn control(&mut self, model: &ModelKey) -> Result<&mut Control, CommandError> {
        self.models.get_mut(model).ok_or_else(|| CommandError::UnknownModel(model.clone()))
    }

    fn after_command(&mut self, now: Millis, model: &ModelKey, decided: Option<Decision>) {
        if let Some(decision) = decided {
            self.actions.push_back(Action::Decided { model: model.clone(), decision });
        }
        self.reconcile(now, model);
    }

    fn hot(&self, model: &ModelKey) -> u32 {
        self.cluster.count_of(model, Level::Hot) as u32
    }

    /// `model`'s HOT replicas off draining nodes: what its count is made of.
    fn staying(&self, model: &ModelKey) -> u32 {
        self.cluster.count_staying(model) as u32
    }

    /// Stops `model`'s leaving replicas (HOT on a draining node) that its
    /// count no longer needs: one not ready at once, a ready one while the
    /// model's ready replicas would still number its count without it —
    /// the least busy first. Nothing to do, at the cost of one check, while
    /// no node drains.
    fn retire_leaving(&mut self, model: &ModelKey) {
        if !self.cluster.any_draining() {
            return;
        }
        let Some(c) = self.models.get(model) else { return };
        let mut ready = 0;
        let mut leaving = Vec::new();
        for d in self.cluster.replicas_of(model, Level::Hot) {
            let serves = c.in_flight.get(&d.replica_id).copied();
            ready += u32::from(serves.is_some());
            if self.cluster.leaving(d) {
                leaving.push((serves.is_some(), serves.unwrap_or(0), d.replica_id));
            }
        }
        if leaving.is_empty() {
            return;
        }
        // Not ready first, then the least busy.
        leaving.sort_unstable();
        let desired = c.scaler.desired();
        let before = self.cluster.snapshot();
        for (serves, _, id) in leaving {
            if serves && ready <= desired {
                break;
            }
            ready -= u32::from(serves);
            let _ = self.cluster.evict_replica(model, &id);
            self.forget(model, id);
        }
        self.push_delta(&before);
    }

    /// Pushes the steps from `before` to the cluster as it is now, if any,
    /// and returns them.
    fn push_delta(&mut self, before: &Snapshot) -> Option<&DeploymentDelta> {
        let delta = DeploymentDelta::between(before, &self.cluster.snapshot())
            .expect("snapshots of one cluster are consistent");
        if delta.is_empty() {
            return None;
        }
        self.actions.push_back(Action::Apply(delta));
        match self.actions.back() {
            Some(Action::Apply(delta)) => Some(delta),
            _ => unreachable!("just pushed"),
        }
    }

    /// Brings `model`'s hot replicas to its scaler's count.
    fn reconcile(&mut self, now: Millis, model: &ModelKey) {
        let Some(c) = self.models.get(model) else { return };
        let desired = c.scaler.desired();
        let hot = self.staying(model);
        if c.blocked.as_ref().is_some_and(|b| b.retry_at > now) {
            // Shrinking is always possible; growing waits for the retry.
            if desired >= hot {
                self.retire_leaving(model);
                return;
            }
        }
        let before = self.cluster.snapshot();
        if desired > hot {
            self.grow(now, &before, &[(model.clone(), desired)]);
        } else if desired < hot {
            let c = &self.models[model];
            // A dedicated window's replicas stay (the scaler's floor keeps
            // the count at least theirs); leaving ones are not counted.
            let mut hot_replicas: Vec<(u32, ReplicaId)> = self
                .cluster
                .replicas_of(model, Level::Hot)
                .iter()
                .filter(|d| !d.dedicated && !self.cluster.leaving(d))
                .map(|d| (c.in_flight.get(&d.replica_id).copied().unwrap_or(0), d.replica_id))
                .collect();
            hot_replicas.sort_unstable();
            for (_, id) in hot_replicas.into_iter().take((hot - desired) as usize) {
                let _ = self.cluster.evict_replica(model, &id);
                if self.cluster.deployment(&id).is_some_and(|d| d.level == Level::Warm) {
                    self.models.get_mut(model).expect("listed").warm_since.insert(id, now);
                }
            }
            self.push_delta(&before);
            self.unblock(now, model);
            self.capacity_freed(now);
        } else if self.models[model].blocked.is_some() {
            self.unblock(now, model);
        }
        self.retire_leaving(model);
    }

    /// Brings each of `wants` (a model, and the hot replicas it should
    /// have) up to its count in one placement batch, and pushes the steps
    /// from `before` as one delta. One batch, so a model placed earlier in
    /// it is never evicted to place a later one. A model still short
    /// afterwards is backed off as unplaceable, the others are placeable.
    fn grow(&mut self, now: Millis, before: &Snapshot, wants: &[(ModelKey, u32)]) {
        let requests: Vec<ReplicaRequest> = wants
            .iter()
            .map(|(model, desired)| ReplicaRequest {
                model_key: model.clone(),
                replicas: *desired,
                dedicated: false,
            })
            .collect();
        let outcome = self.cluster.deploy(&requests, now, &mut self.rng);
        let evicted = self.push_delta(before).map(evicted).unwrap_or_default();
        self.lower_preempted(now, evicted);
        for m in &outcome.models {
            if (m.hot() as u32) < m.requested {
                let reason = m.replicas.iter().find_map(|r| r.reason.as_ref()).map(ToString::to_string);
                let reason = reason.unwrap_or_else(|| "no room".into());
                let last = self.models[&m.model_key].blocked.as_ref().map(|b| b.backoff);
                self.block(now, &m.model_key, reason, BlockCause::NoRoom, next_backoff(last));
            } else {
                self.unblock(now, &m.model_key);
            }
        }
    }

    /// Replicas of other models the last deploy pushed off the GPUs
    /// (`evicted`, with where each went): their models want only what they
    /// still have, until their own demand asks again (so two models do not
    /// take turns evicting each other).
    fn lower_preempted(&mut self, now: Millis, evicted: Vec<((ModelKey, ReplicaId), Level)>) {
        let mut preempted = Vec::new();
        for ((victim, replica), level) in evicted {
            if let Some(c) = self.models.get_mut(&victim) {
                if level == Level::Warm {
                    c.warm_since.insert(replica, now);
                }
                preempted.push(victim);
            }
        }
        preempted.dedup();
        for victim in preempted {
            let hot = self.hot(&victim);
            let c = self.models.get_mut(&victim).expect("listed");
            if let Some(decision) = c.scaler.preempted(now, hot) {
                self.actions.push_back(Action::Decided { model: victim, decision });
            }
        }
    }

    /// Applies the dedicated windows in force at `now`: placement keeps
    /// their replicas hot and dedicated, each model's scaler keeps at least
    /// its window's count (none once it ended), and the next start or end
    /// is due.
    fn apply_schedule(&mut self, now: Millis) {
        let before = self.cluster.snapshot();
        self.cluster.apply_schedule(&self.schedule, now, &mut self.rng);
        let evicted = self.push_delta(&before).map(evicted).unwrap_or_default();
        self.lower_preempted(now, evicted);
        // A window that ended left its replicas to the policy: room may
        // come from them soon, and a waiting model should see it.
        self.capacity_freed(now);
        let floors: BTreeMap<ModelKey, u32> =
            self.schedule.requests_at(now).into_iter().map(|r| (r.model_key, r.replicas)).collect();
        let keys: Vec<ModelKey> = self.models.keys().cloned().collect();
        for key in keys {
            let floor = floors.get(&key).copied().unwrap_or(0);
            let c = self.models.get_mut(&key).expect("listed");
            if c.scaler.floor() == floor {
                continue;
            }
            if let Some(decision) = c.scaler.set_floor(now, floor) {
                self.actions.push_back(Action::Decided { model: key.clone(), decision });
            }
            self.reconcile(now, &key);
        }
        self.schedule_due =
            self.schedule.windows().iter().flat_map(|w| [w.start_ms, w.end_ms]).filter(|t| *t > now).min();
    }

    /// Caps `model` at what it has and retries it `backoff` from `now`.
    fn block(&mut self, now: Millis, model: &ModelKey, reason: String, cause: BlockCause, backoff: Millis) {
        let hot = self.hot(model);
        let c = self.models.get_mut(model).expect("listed");
        let changed = c.blocked.as_ref().is_none_or(|b| b.reason != reason || b.cause != cause);
        let retry_at = now.saturating_add(backoff);
        c.blocked = Some(Blocked { reason: reason.clone(), cause, retry_at, backoff });
        c.scaler.set_placeable(now, Some(hot));
        if let Some(decision) = c.scaler.handle_timeout(now) {
            self.actions.push_back(Action::Decided { model: model.clone(), decision });
        }
        if changed {
            self.actions.push_back(Action::Unplaceable { model: model.clone(), reason, cause });
        }
    }

    /// GPUs were (or may soon be) freed: every model waiting for room
    /// retries now rather than at the end of its back-off. The back-off
    /// itself is kept, so a model that still does not fit waits longer next
    /// time. A model waiting out a start failure keeps waiting: room is not
    /// what it lacks.
    fn capacity_freed(&mut self, now: Millis) {
        for c in self.models.values_mut() {
            if let Some(b) = c.blocked.as_mut().filter(|b| b.cause == BlockCause::NoRoom) {
                b.retry_at = b.retry_at.min(now);
            }
        }
    }

    fn unblock(&mut self, now: Millis, model: &ModelKey) {
        let c = self.models.get_mut(model).expect("listed");
        if c.blocked.take().is_some() {
            c.scaler.set_placeable(now, None);
            self.actions.push_back(Action::Placeable { model: model.clone() });
        }
    }

    /// No starvation: a model whose requests have waited for room longer
    /// than it takes to start one of its replicas (its mean COLD start, at
    /// least [`STARVATION_PATIENCE_MS`]) gets the replicas another model
    /// holds beyond what that model's demand needs — the one holding the
    /// most such first, one per call — or, when none holds more than it
    /// needs, a replica of the model whose traffic per replica is surely
    /// less than the starving model's (its rate's upper bound below the
    /// other's lower bound; the least such first): a GPU goes where it
    /// serves more requests, and the two bounds apart keep two models of
    /// like traffic from trading it back and forth. Placement's minimum deployment age
    /// guards against churn between models that both need their GPUs; it
    /// does not let a model keep GPUs its demand does not need while
    /// another's requests wait.
    fn relieve_starvation(&mut self, now: Millis, keys: &[ModelKey]) {
        let mut starving = None;
        for key in keys {
            let c = &self.models[key];
            let waits = c.scaler.latest().is_some_and(|o| o.waiting > 0);
            let no_room = c.blocked.as_ref().is_some_and(|b| b.cause == BlockCause::NoRoom);
            // Counting hot replicas costs a look at each: only for a model
            // that waits for room.
            let short = waits && no_room && c.scaler.desired() > self.staying(key);
            let c = self.models.get_mut(key).expect("listed");
            if !short {
                c.starving_since = None;
                continue;
            }
            let since = *c.starving_since.get_or_insert(now);
            let cold = c.scaler.start_times().cold.map_or(0, |(ms, _)| ms);
            if now.saturating_sub(since) >= cold.max(STARVATION_PATIENCE_MS) && starving.is_none() {
                starving = Some(key.clone());
            }
        }
        let Some(starving) = starving else { return };
        let surplus = keys
            .iter()
            .filter(|k| **k != starving)
            .filter_map(|k| {
                let need = self.models[k].scaler.need()?;
                let surplus = self.staying(k).saturating_sub(need);
                (surplus > 0).then_some((surplus, k.clone()))
            })
            .max_by_key(|(surplus, k)| (*surplus, std::cmp::Reverse(k.clone())));
        let (donor, surplus) = match surplus {
            Some((_, donor)) => (donor, true),
            None => match self.less_served(&starving, keys) {
                Some(donor) => (donor, false),
                None => return,
            },
        };
        let c = self.models.get_mut(&donor).expect("listed");
        let decided = if surplus { c.scaler.yield_surplus(now) } else { c.scaler.yield_one(now) };
        if let Some(decision) = decided {
            self.actions.push_back(Action::Decided { model: donor.clone(), decision });
            self.reconcile(now, &donor);
            self.models.get_mut(&starving).expect("listed").starving_since = Some(now);
        }
    }

    /// Of `keys`, the model holding a replica whose traffic per replica
    /// held is surely less than `starving`'s (its rate's upper bound over
    /// its hot replicas below `starving`'s lower bound), the least first.
    fn less_served(&self, starving: &ModelKey, keys: &[ModelKey]) -> Option<ModelKey> {
        let (wants, _) = self.models[starving].scaler.rate_band()?;
        keys.iter()
            .filter(|k| *k != starving)
            .filter_map(|k| {
                let hot = self.hot(k);
                let (_, high) = self.models[k].scaler.rate_band()?;
                let per_replica = high / f64::from(hot.max(1));
                (hot > 0 && per_replica < wants).then_some((per_replica, k))
            })
            .min_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(b.1)))
            .map(|(_, k)| k.clone())
    }

    /// Lets go of WARM replicas idle beyond the scaler's keep time.
    fn expire_warm(&mut self, now: Millis, model: &ModelKey) {
        let c = self.models.get_mut(model).expect("listed");
        let Some(keep) = c.scaler.keep_warm_ms() else { return };
        let expired: Vec<ReplicaId> = c
            .warm_since
            .iter()
            .filter(|(_, since)| now.saturating_sub(**since) >= keep)
            .map(|(id, _)| *id)
            .collect();
        if expired.is_empty() {
            return;
        }
        let before = self.cluster.snapshot();
        for id in expired {
            self.models.get_mut(model).expect("listed").warm_since.remove(&id);
            if self.cluster.deployment(&id).is_some_and(|d| d.level == Level::Warm) {
                let _ = self.cluster.evict_replica(model, &id);
            }
        }
        self.push_delta(&before);
    }
}

/// The replicas `delta` takes off the GPUs, with where each goes: to the
/// warm cache (WARM), or out (COLD). A HOT replica that moves to another
/// node — deleted and created again under its id — stays HOT. Read from
/// the delta, which holds only what changed, rather than from a walk of
/// every deployment.
fn evicted(delta: &DeploymentDelta) -> Vec<((ModelKey, ReplicaId), Level)> {
    let to_cache = delta.to_cache.iter().map(|d| ((d.model_key.clone(), d.replica_id), Level::Warm));
    let deleted = delta
        .delete
        .iter()
        .filter(|d| d.level == Level::Hot && !delta.create.iter().any(|c| c.replica_id == d.replica_id))
        .map(|d| ((d.model_key.clone(), d.replica_id), Level::Cold));
    let mut evicted: Vec<_> = to_cache.chain(deleted).collect();
    // In replica order, as placement lists deployments: the decisions that
    // follow come out in the same order in the live server and the
    // simulator, run after run.
    evicted.sort_unstable_by_key(|((_, id), _)| *id);
    evicted
}

impl Scaler {
    /// Placement took replicas away for another model, leaving `hot`:
    /// want no more than that until a decision says otherwise
    /// (`Reason::Preempted`). An operator's override stands.
    pub(crate) fn preempted(&mut self, now: Millis, hot: u32) -> Option<Decision> {
        let target = hot.max(self.bounds().min);
        if self.override_().is_some() || target >= self.desired() {
            return None;
        }
        self.set_desired(now, target, Reason::Preempted)
    }

    /// An eviction left `hot` replicas: want no more until a decision says
    /// otherwise (`Reason::Evicted`); an override holding more is lowered
    /// with it, since the operator who evicted meant it.
    pub(crate) fn lower_to(&mut self, now: Millis, hot: u32) -> Option<Decision> {
        let target = hot.max(self.bounds().min);
        self.lower_override(target);
        if target >= self.desired() {
            return None;
        }
        self.set_desired(now, target, Reason::Evicted)
    }
}
