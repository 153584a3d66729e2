//! The leader: of the gateways sharing a Redis, the one holding the lease
//! runs the fleet's controller.
//!
//! Every gateway asks for the lease every third of its TTL. The one that
//! takes it starts a tenure: it builds the placement cluster from the
//! registered nodes — each node's replicas from its desired state when
//! that was written for the node's present agent run, else from what the
//! node reports it runs (a new run reports nothing; a run that outlived a
//! Redis which lost its data reports its engines, which are kept) — and
//! runs the same control loop a single machine runs (`control::run`).
//! Where a single machine hands a node's desired state to its lifecycle
//! driver, the leader writes it to Redis, stamped with its epoch and the
//! node's agent run; the node's agent carries it out.
//!
//! Writes are level-triggered too: a node whose state changed is marked,
//! the writer sends the latest state of every marked node (one write at a
//! time, so an older state never lands after a newer), keeps the marks of
//! writes that failed for the next round, and rewrites every node's state
//! every few seconds, so a state Redis lost comes back.
//!
//! **A blip is not a new tenure.** A renewal that fails because Redis does
//! not answer ends nothing: the leader keeps its controller, writes
//! nothing that cannot land, and concludes nothing (its view learns
//! nothing either). When Redis answers again it renews — in the same
//! epoch, if nobody took the lease meanwhile — and carries on. The tenure
//! ends only when another gateway holds the lease, or the lease says
//! another epoch.
//!
//! The tenure's members are the nodes it places on; the view keeps them
//! level with the live nodes ([`Tenure::join`], [`Tenure::lose`]).
//!
//! Only the controller knows which models can run nowhere now, so the
//! leader writes the models its processors hold unavailable, with their
//! reasons, for the other gateways ([`Tenure::publish_unavailable`]); a
//! new tenure drops what its gateway took from the last leader and applies
//! again what an operator asked, which Redis keeps ([`OperatorWord`]): the
//! scaling overrides, and the hotswap models closed to swapping in.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hangar_core::{
    DesiredState, GatewayLoad, Millis, ModelKey, NodeRecord, NodeReport, ReplicaId, ReplicaPhase,
};
use hangar_placement::{Cluster, ClusterConfig, Deployment, Level, NodeId, Restore};
use hangar_redis::fleet::{FleetState, ScalingOverride, Unavailable};
use hangar_redis::lease::{LeaderLease, Leadership as Lease};
use hangar_redis::registry::Registry;
use hangar_scaler::{Action, Observation};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::super::control::{self, Command, Fleet, ScalingCommand};
use super::super::desired::{desired, DesiredBook};
use super::super::{control_loop, Inner, ServeConfig};
use super::node_config;

/// How often the writer retries what failed, and how often it rewrites
/// every node's state.
const RETRY_EVERY: Duration = Duration::from_secs(1);
const REWRITE_EVERY: Duration = Duration::from_secs(5);

/// Which tenure, if any, this gateway holds now.
#[derive(Default)]
pub(crate) struct Leadership {
    current: Mutex<Option<Arc<Tenure>>>,
}

impl Leadership {
    /// The tenure this gateway holds, if it leads.
    pub(crate) fn current(&self) -> Option<Arc<Tenure>> {
        self.current.lock().expect("leadership lock").clone()
    }

    fn set(&self, tenure: Option<Arc<Tenure>>) {
        *self.current.lock().expect("leadership lock") = tenure;
    }
}

/// One leader's term: its epoch, its members and what it has told each.
pub(crate) struct Tenure {
    inner: Arc<Inner>,
    /// Node → what it was last told.
    desired: Arc<Mutex<DesiredBook>>,
    /// Node → the agent run it places for: the tenure's members.
    runs: Arc<Mutex<BTreeMap<String, String>>>,
    /// When each replica of `desired` was first placed by this tenure.
    placed_at: Mutex<HashMap<ReplicaId, Instant>>,
    writer: Arc<Writer>,
    /// The other gateways' loads, from the view.
    loads: Mutex<Vec<GatewayLoad>>,
    /// Cancelled when the lease is lost.
    lost: CancellationToken,
    /// The unavailable models last written for the other gateways, and
    /// when.
    published: Mutex<Option<(Unavailable, Instant)>>,
    /// What the controller was last told of the members and the models.
    told: Mutex<Told>,
}

/// The facts of the members' reports and records a tenure last sent its
/// controller (weights resident, each model's artifact, drains), so each
/// is sent when it changes rather than at every refresh of the view.
#[derive(Default)]
struct Told {
    /// Member → the artifacts it holds resident.
    resident: BTreeMap<String, Vec<String>>,
    /// Model → the artifact its replicas load.
    artifacts: BTreeMap<ModelKey, String>,
    /// Members told draining.
    draining: BTreeSet<String>,
    /// Members told suspect.
    suspect: BTreeSet<String>,
}

impl Told {
    /// Forgets what member `node` was told: a run that joins under its
    /// name, or none, is told afresh.
    fn forget(&mut self, node: &str) {
        self.resident.remove(node);
        self.draining.remove(node);
        self.suspect.remove(node);
    }
}

impl Tenure {
    /// Whether this leader wants replica `id` on `node`: `Some(warm)` if
    /// it does.
    pub(crate) fn wants(&self, node: &str, id: ReplicaId) -> Option<bool> {
        self.desired.lock().expect("desired lock").wants(node, id)
    }

    pub(crate) fn set_loads(&self, loads: Vec<GatewayLoad>) {
        *self.loads.lock().expect("loads lock") = loads;
    }

    /// The members: node → its agent run.
    pub(crate) fn members(&self) -> Vec<(String, String)> {
        self.runs.lock().expect("runs lock").iter().map(|(n, a)| (n.clone(), a.clone())).collect()
    }

    /// The agent run the tenure places for on `node`, if it is a member.
    pub(crate) fn member(&self, node: &str) -> Option<String> {
        self.runs.lock().expect("runs lock").get(node).cloned()
    }

    /// A live node that is not a member joins: from now on its desired
    /// state is for `record`'s run, starting empty; the controller adds it
    /// and adopts what `report` says it runs (where that fits and is
    /// wanted), which becomes its desired state.
    pub(crate) fn join(&self, record: &NodeRecord, report: Option<&NodeReport>) {
        let node = match node_config(record) {
            Ok(node) => node,
            Err(e) => return tracing::warn!(node = %record.name, "cannot use this node: {e}"),
        };
        self.runs.lock().expect("runs lock").insert(record.name.clone(), record.agent.clone());
        self.desired.lock().expect("desired lock").set(&record.name, DesiredState::default());
        self.told.lock().expect("told lock").forget(&record.name);
        let running = report.map(|r| running(&node.id, r)).unwrap_or_default();
        self.inner.control.send(Command::NodeJoined(node, running));
    }

    /// A member is gone (dead, left, or another run holds its name): the
    /// controller loses it and its replicas; it is told nothing more.
    pub(crate) fn lose(&self, node: &str) {
        self.runs.lock().expect("runs lock").remove(node);
        self.desired.lock().expect("desired lock").remove(node);
        self.told.lock().expect("told lock").forget(node);
        self.writer.forget(node);
        if let Ok(id) = node.parse() {
            self.inner.control.send(Command::NodeLost(id));
        }
    }

    /// Member `node` holds `artifacts` resident, by its last report: the
    /// controller is told when that changed.
    pub(crate) fn resident(&self, node: &str, artifacts: &[String]) {
        let mut told = self.told.lock().expect("told lock");
        if told.resident.get(node).is_some_and(|t| t == artifacts) {
            return;
        }
        let Ok(id) = node.parse() else { return };
        told.resident.insert(node.to_owned(), artifacts.to_vec());
        self.inner.control.send(Command::Resident(id, artifacts.iter().cloned().collect()));
    }

    /// Member `node` should drain (`on`: its agent is leaving, or an
    /// operator drained it) or not: the controller is told when that
    /// changed.
    pub(crate) fn draining(&self, node: &str, on: bool) {
        if let Some(id) = self.flip(node, on, |told| &mut told.draining) {
            self.inner.control.send(Command::Drain { node: id, on, reply: None });
        }
    }

    /// Member `node` is suspect (`on`: its agent and engines stopped
    /// answering a gateway's probe, and it has not beaten since) or not:
    /// the controller is told when that changed. (The probe tells it at
    /// once too, before the replicas it found dead; twice is harmless.)
    pub(crate) fn suspect(&self, node: &str, on: bool) {
        if let Some(id) = self.flip(node, on, |told| &mut told.suspect) {
            self.inner.control.send(Command::Suspect { node: id, on });
        }
    }

    /// Records that `node` is (`on`) in the set of members `set` picks;
    /// its id if that changed what the controller was told.
    fn flip(
        &self,
        node: &str,
        on: bool,
        set: impl FnOnce(&mut Told) -> &mut BTreeSet<String>,
    ) -> Option<NodeId> {
        let mut told = self.told.lock().expect("told lock");
        let set = set(&mut told);
        if set.contains(node) == on {
            return None;
        }
        let id = node.parse().ok()?;
        match on {
            true => set.insert(node.to_owned()),
            false => set.remove(node),
        };
        Some(id)
    }

    /// A started replica of `model` loaded `artifact`: the controller is
    /// told when that changed (a first start, or a key moved to new
    /// weights).
    pub(crate) fn model_artifact(&self, model: &ModelKey, artifact: &str) {
        let mut told = self.told.lock().expect("told lock");
        if told.artifacts.get(model).is_some_and(|t| t == artifact) {
            return;
        }
        told.artifacts.insert(model.clone(), artifact.to_owned());
        self.inner.control.send(Command::ModelArtifact(model.clone(), artifact.to_owned()));
    }

    /// Folds a delta into the nodes' desired states and writes the nodes
    /// it touched.
    fn apply(&self, delta: &hangar_placement::DeploymentDelta) {
        let touched = self.desired.lock().expect("desired lock").apply(delta);
        {
            let mut placed = self.placed_at.lock().expect("placed lock");
            for step in delta.steps() {
                let id = step.deployment.replica_id;
                if matches!(step.action, hangar_placement::Action::Delete) {
                    placed.remove(&id);
                } else {
                    placed.entry(id).or_insert_with(Instant::now);
                }
            }
        }
        self.write(touched);
    }

    /// Marks `nodes` for writing and writes them in the background.
    fn write(&self, nodes: Vec<String>) {
        let runs = self.runs.lock().expect("runs lock");
        // Only members are written: a node the tenure lost is told nothing.
        self.writer.mark(nodes.into_iter().filter(|n| runs.contains_key(n)));
        drop(runs);
        let writer = self.writer.clone();
        tokio::task::spawn_blocking(move || writer.flush());
    }

    /// Writes which models this leader's processors hold unavailable (and
    /// why) for the other gateways, when that changed or every
    /// [`REWRITE_EVERY`]. Blocking (Redis); a write that fails is tried at
    /// the next call, one refused (the lease passed) ends the tenure.
    pub(crate) fn publish_unavailable(&self) {
        let now: Unavailable = self
            .inner
            .models
            .iter()
            .filter_map(|(key, rt)| Some((key.clone(), rt.processor.unavailable()?)))
            .collect();
        let mut published = self.published.lock().expect("published lock");
        if published.as_ref().is_some_and(|(last, at)| *last == now && at.elapsed() < REWRITE_EVERY) {
            return;
        }
        let w = &self.writer;
        match w.fleet.write_unavailable(&w.me, w.epoch, &now) {
            Ok(true) => *published = Some((now, Instant::now())),
            Ok(false) => w.lease_passed(),
            Err(e) => tracing::debug!("cannot write the unavailable models now: {e}"),
        }
    }

    /// Stops watching whether replica `id` is taken up; whether it was
    /// still watched (so its failure is reported once).
    pub(crate) fn give_up(&self, id: ReplicaId) -> bool {
        self.placed_at.lock().expect("placed lock").remove(&id).is_some()
    }

    /// The replicas this leader placed on `node` more than `limit` ago
    /// (warm or hot), for the view to tell which its agent never took up.
    pub(crate) fn placed_before(&self, node: &str, limit: Duration) -> Vec<(ModelKey, ReplicaId)> {
        let state = self.desired.lock().expect("desired lock").get(node);
        let placed = self.placed_at.lock().expect("placed lock");
        state
            .replicas
            .iter()
            .filter(|r| placed.get(&r.replica).is_some_and(|at| at.elapsed() > limit))
            .map(|r| (r.model.clone(), r.replica))
            .collect()
    }
}

/// What a node's report says it runs, as placement would take it back:
/// HOT where its engine is awake (or about to be) on its GPUs, WARM where
/// it sleeps.
fn running(node: &NodeId, report: &NodeReport) -> Vec<Restore> {
    report
        .replicas
        .iter()
        .filter_map(|r| {
            let level = match r.phase {
                ReplicaPhase::Ready | ReplicaPhase::Starting | ReplicaPhase::Waking if !r.gpus.is_empty() => {
                    Level::Hot
                }
                ReplicaPhase::Sleeping => Level::Warm,
                _ => return None,
            };
            Some(Restore {
                model_key: r.model.clone(),
                replica_id: r.replica,
                node: node.clone(),
                level,
                gpus: (level == Level::Hot).then(|| r.gpus.clone()),
                dedicated: false,
                deployed_at_ms: 0,
            })
        })
        .collect()
}

/// Writes nodes' desired states: the latest state of each marked node,
/// one write at a time; marks of writes that failed stay for the next
/// round. A write refused (the lease passed) ends the tenure.
struct Writer {
    fleet: FleetState,
    me: String,
    epoch: u64,
    desired: Arc<Mutex<DesiredBook>>,
    runs: Arc<Mutex<BTreeMap<String, String>>>,
    lost: CancellationToken,
    dirty: Mutex<BTreeSet<String>>,
    one_at_a_time: Mutex<()>,
}

impl Writer {
    fn mark(&self, nodes: impl IntoIterator<Item = String>) {
        self.dirty.lock().expect("dirty lock").extend(nodes);
    }

    fn forget(&self, node: &str) {
        self.dirty.lock().expect("dirty lock").remove(node);
    }

    /// Writes every marked node. Blocking (Redis).
    fn flush(&self) {
        let _turn = self.one_at_a_time.lock().expect("writer lock");
        let nodes = std::mem::take(&mut *self.dirty.lock().expect("dirty lock"));
        let mut failed = BTreeSet::new();
        for node in nodes {
            let Some(agent) = self.runs.lock().expect("runs lock").get(&node).cloned() else { continue };
            if !failed.is_empty() {
                failed.insert(node); // Redis failed this round: try later.
                continue;
            }
            let mut state = self.desired.lock().expect("desired lock").get(&node);
            state.epoch = self.epoch;
            state.agent = agent;
            match self.fleet.write_desired(&self.me, &node, &state) {
                Ok(true) => {}
                Ok(false) => return self.lease_passed(),
                Err(e) => {
                    tracing::debug!(%node, "cannot write the desired state now: {e}");
                    failed.insert(node);
                }
            }
        }
        self.mark(failed);
    }

    /// A write was refused: another gateway holds the lease, so this
    /// tenure ends.
    fn lease_passed(&self) {
        tracing::warn!(epoch = self.epoch, "the lease has passed to another gateway: no longer leading");
        self.lost.cancel();
    }

    /// Retries failed writes every [`RETRY_EVERY`] and rewrites every
    /// member's state every [`REWRITE_EVERY`], until the tenure ends.
    async fn run(self: Arc<Self>) {
        let mut rewrite = Instant::now();
        loop {
            tokio::select! {
                () = tokio::time::sleep(RETRY_EVERY) => {}
                () = self.lost.cancelled() => return,
            }
            if rewrite.elapsed() >= REWRITE_EVERY {
                rewrite = Instant::now();
                let all: Vec<String> = self.runs.lock().expect("runs lock").keys().cloned().collect();
                self.mark(all);
            }
            let me = self.clone();
            let _ = tokio::task::spawn_blocking(move || me.flush()).await;
        }
    }
}

impl Fleet for Tenure {
    fn now(&self) -> Millis {
        self.inner.now()
    }

    fn instant(&self, at: Millis) -> tokio::time::Instant {
        Fleet::instant(&*self.inner, at)
    }

    fn models(&self) -> Vec<ModelKey> {
        Fleet::models(&*self.inner)
    }

    /// This gateway's view of the model, with every other gateway's
    /// requests waiting and running, and their counters, added.
    fn observe(&self, model: &ModelKey, waiting: u32) -> Option<(Observation, Vec<(ReplicaId, u32)>)> {
        let (mut obs, in_flight) = Fleet::observe(&*self.inner, model, waiting)?;
        for l in self.loads.lock().expect("loads lock").iter().filter_map(|g| g.models.get(model)) {
            obs.waiting = obs.waiting.saturating_add(l.waiting);
            obs.in_flight = obs.in_flight.saturating_add(l.in_flight);
            obs.arrivals += l.arrivals;
            obs.completions += l.completions;
            obs.rejected += l.rejected;
            obs.busy_ms += l.busy_ms;
        }
        Some((obs, in_flight))
    }

    fn waiting_handled(&self, model: &ModelKey) {
        Fleet::waiting_handled(&*self.inner, model)
    }

    fn carry_out(self: &Arc<Self>, action: Action) {
        match action {
            Action::Apply(delta) => self.apply(&delta),
            other => control::note(&self.inner, other),
        }
    }

    fn node_joined(&self, node: &NodeId, deployments: Vec<Deployment>) {
        let name = node.to_string();
        let now = Instant::now();
        let mut placed = self.placed_at.lock().expect("placed lock");
        for d in &deployments {
            placed.entry(d.replica_id).or_insert(now);
        }
        drop(placed);
        let state =
            DesiredState { replicas: deployments.iter().map(desired).collect(), ..DesiredState::default() };
        self.desired.lock().expect("desired lock").set(&name, state);
        self.write(vec![name]);
    }
}

/// Asks for the lease for as long as the server lives, and leads while
/// it holds it.
///
/// # Cancel safety
/// Meant to run in a task of its own for the server's life; dropped, the
/// tenure in progress ends without resigning (the lease lapses).
///
/// When `stop` is cancelled (the server stopping on purpose) it stops
/// asking and, if it leads, resigns, so another gateway takes over at its
/// next ask rather than after the lease's TTL.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    inner: Arc<Inner>,
    config: ServeConfig,
    lease: Arc<LeaderLease>,
    registry: Registry,
    fleet: FleetState,
    leadership: Arc<Leadership>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    stop: CancellationToken,
) {
    let mut unreachable = false;
    while !stop.is_cancelled() {
        let asked = {
            let lease = lease.clone();
            tokio::task::spawn_blocking(move || lease.tick()).await.expect("no panic")
        };
        if asked.is_ok() {
            unreachable = false;
        }
        match asked {
            Ok(Lease::Leader { epoch, .. }) => {
                let tenure = match begin(&inner, &config, &registry, &fleet, &lease, epoch).await {
                    Ok(t) => t,
                    Err(e) => {
                        tracing::error!("cannot begin leading: {e}");
                        tokio::time::sleep(lease.period()).await;
                        continue;
                    }
                };
                // Facts sent while following are about a fleet the new
                // controller reads afresh.
                while commands.try_recv().is_ok() {}
                tenure.2.restore(&inner);
                leadership.set(Some(tenure.0.clone()));
                inner.control.set_active(true);
                tracing::info!(epoch, "leading the fleet");
                tokio::spawn(renew(lease.clone(), epoch, tenure.0.lost.clone()));
                tokio::spawn(tenure.0.writer.clone().run());
                tokio::select! {
                    () = control::run(Arc::downgrade(&tenure.0), tenure.1, &mut commands) => {}
                    () = tenure.0.lost.cancelled() => {}
                    () = stop.cancelled() => {}
                }
                inner.control.set_active(false);
                leadership.set(None);
                tenure.0.lost.cancel();
                if stop.is_cancelled() {
                    let l = lease.clone();
                    match tokio::task::spawn_blocking(move || l.resign()).await.expect("no panic") {
                        Ok(_) => tracing::info!(epoch, "stopping: the leader lease is given up"),
                        Err(e) => tracing::warn!(epoch, "stopping: the lease lapses by itself ({e})"),
                    }
                    return;
                }
                tracing::warn!(epoch, "no longer leading the fleet");
            }
            Ok(Lease::Follower { .. }) => {}
            Err(e) if !unreachable => {
                tracing::warn!("leader lease: {e}");
                unreachable = true;
            }
            Err(_) => {}
        }
        tokio::select! {
            () = tokio::time::sleep(lease.period()) => {}
            () = stop.cancelled() => {}
        }
    }
}

/// What an operator asked of the fleet, kept in Redis for every leader:
/// the hotswap models closed to swapping in, and the scaling overrides.
pub(crate) struct OperatorWord {
    closed: BTreeSet<String>,
    overrides: BTreeMap<String, ScalingOverride>,
}

impl OperatorWord {
    /// Read from Redis. Blocking.
    fn read(fleet: &FleetState) -> Result<OperatorWord, String> {
        let closed = fleet.closed_hotswap().map_err(|e| e.to_string())?;
        let overrides = fleet.overrides().map_err(|e| e.to_string())?;
        Ok(OperatorWord { closed, overrides })
    }

    /// A tenure's start, before its controller runs: what this gateway
    /// answered as a follower (the last leader's word on which models
    /// cannot run) is dropped, for the new controller decides afresh; each
    /// scaling override is applied again, then the hotswap models an
    /// operator closed are closed again — answered 503 and pinned at zero.
    fn restore(&self, inner: &Arc<Inner>) {
        for (key, rt) in &inner.models {
            let command = match self.overrides.get(key) {
                Some(ScalingOverride::Freeze) => Some(ScalingCommand::Freeze),
                Some(&ScalingOverride::Pin(n)) => Some(ScalingCommand::Pin(n)),
                None => None,
            };
            let close = rt.config.hotswap && self.closed.contains(key);
            if rt.config.hotswap {
                rt.close_to_swapping(close);
            } else {
                rt.processor.set_unavailable(None);
            }
            for command in command.into_iter().chain(close.then_some(ScalingCommand::Pin(0))) {
                let (reply, answer) = tokio::sync::oneshot::channel();
                let model = rt.config.key.clone();
                inner.control.send(Command::Scaling { model: model.clone(), command, reply });
                tokio::spawn(async move {
                    if let Ok(Err(e)) = answer.await {
                        tracing::warn!(%model, ?command, "cannot apply the operator's recorded command again: {e}");
                    }
                });
            }
        }
    }
}

/// Renews the lease every period. A renewal that finds another holder or
/// another epoch cancels `lost`; one that fails for want of Redis ends
/// nothing — the leader may well still hold the lease, or get it back in
/// the same epoch — and the next is tried a period later.
async fn renew(lease: Arc<LeaderLease>, epoch: u64, lost: CancellationToken) {
    let mut unreachable_since: Option<Instant> = None;
    loop {
        tokio::select! {
            () = tokio::time::sleep(lease.period()) => {}
            () = lost.cancelled() => return,
        }
        let l = lease.clone();
        match tokio::task::spawn_blocking(move || l.tick()).await.expect("no panic") {
            Ok(Lease::Leader { epoch: e, .. }) if e == epoch => {
                if let Some(since) = unreachable_since.take() {
                    tracing::info!(
                        epoch,
                        after_ms = since.elapsed().as_millis() as u64,
                        "Redis answers again: still leading, in the same epoch"
                    );
                }
            }
            Err(e) => {
                if unreachable_since.is_none() {
                    tracing::warn!(epoch, "cannot renew the leader lease ({e}): holding on, concluding nothing until Redis answers");
                    unreachable_since = Some(Instant::now());
                }
            }
            other => {
                tracing::warn!(?other, "leader lease not renewed");
                lost.cancel();
                return;
            }
        }
    }
}

/// A tenure's start: the cluster of the registered nodes with the replicas
/// each runs — from its desired state when that is its present run's, else
/// from its report — the controller over it, and every node's desired
/// state written again in this epoch.
async fn begin(
    inner: &Arc<Inner>,
    config: &ServeConfig,
    registry: &Registry,
    fleet: &FleetState,
    lease: &LeaderLease,
    epoch: u64,
) -> Result<(Arc<Tenure>, hangar_scaler::ControlLoop, OperatorWord), String> {
    let (registry, reader) = (registry.clone(), fleet.clone());
    let (nodes, states, reports, word) = tokio::task::spawn_blocking(move || {
        let nodes: Vec<NodeRecord> = registry
            .registered()
            .map_err(|e| e.to_string())?
            .nodes
            .into_iter()
            .filter(|r| !r.left)
            .map(|r| r.record)
            .collect();
        let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
        let states = names
            .iter()
            .map(|n| Ok(reader.desired(n).map_err(|e| e.to_string())?.unwrap_or_default()))
            .collect::<Result<Vec<_>, String>>()?;
        let reports = reader.reports(&names).map_err(|e| e.to_string())?;
        let word = OperatorWord::read(&reader)?;
        Ok::<_, String>((nodes, states, reports, word))
    })
    .await
    .expect("no panic")?;
    let mut usable = Vec::new();
    let mut node_configs = Vec::new();
    for ((n, state), report) in nodes.iter().zip(states).zip(reports) {
        match node_config(n) {
            Ok(c) => {
                node_configs.push(c);
                usable.push((n, state, report));
            }
            Err(e) => tracing::warn!(node = %n.name, "cannot use this node: {e}"),
        }
    }
    let mut cluster =
        Cluster::new(ClusterConfig { nodes: node_configs, ..config.cluster() }).map_err(|e| e.to_string())?;
    for (n, state, report) in &usable {
        let Ok(node_id) = n.name.parse::<NodeId>() else { continue };
        let restores: Vec<Restore> = if state.agent == n.agent {
            state
                .replicas
                .iter()
                .map(|r| Restore {
                    model_key: r.model.clone(),
                    replica_id: r.replica,
                    node: node_id.clone(),
                    level: if r.warm { Level::Warm } else { Level::Hot },
                    gpus: (!r.warm).then(|| r.gpus.keys().copied().collect()),
                    dedicated: r.dedicated,
                    deployed_at_ms: 0,
                })
                .collect()
        } else {
            // Not this run's: what the run reports it runs, if anything.
            report.as_ref().filter(|r| r.agent == n.agent).map(|r| running(&node_id, r)).unwrap_or_default()
        };
        for restore in restores {
            let replica = restore.replica_id;
            if let Err(e) = cluster.restore(restore) {
                tracing::warn!(node = %n.name, %replica, "dropping a replica the cluster cannot take back: {e}");
            }
        }
    }
    let mut book = DesiredBook::default();
    for n in &usable {
        book.set(&n.0.name, DesiredState::default());
    }
    for d in cluster.snapshot().deployments().values() {
        let mut state = book.get(&d.node.to_string());
        state.replicas.push(desired(d));
        book.set(&d.node.to_string(), state);
    }
    let runs: BTreeMap<String, String> =
        usable.iter().map(|(n, _, _)| (n.name.clone(), n.agent.clone())).collect();
    let seed = config.seed ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let control = control_loop(config, seed, inner, cluster);
    let now = Instant::now();
    let placed_at =
        book.states().values().flat_map(|s| s.replicas.iter().map(|r| (r.replica, now))).collect();
    let all: Vec<String> = runs.keys().cloned().collect();
    let desired_states = Arc::new(Mutex::new(book));
    let runs = Arc::new(Mutex::new(runs));
    let lost = CancellationToken::new();
    let writer = Arc::new(Writer {
        fleet: fleet.clone(),
        me: lease.holder().to_owned(),
        epoch,
        desired: desired_states.clone(),
        runs: runs.clone(),
        lost: lost.clone(),
        dirty: Mutex::new(all.into_iter().collect()),
        one_at_a_time: Mutex::new(()),
    });
    let tenure = Arc::new(Tenure {
        inner: inner.clone(),
        desired: desired_states,
        runs,
        placed_at: Mutex::new(placed_at),
        writer: writer.clone(),
        loads: Mutex::default(),
        lost,
        published: Mutex::default(),
        told: Mutex::default(),
    });
    tokio::task::spawn_blocking(move || writer.flush()).await.expect("no panic");
    Ok((tenure, control, word))
}
