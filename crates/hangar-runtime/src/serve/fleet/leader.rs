//! The leader: of the gateways sharing a Redis, the one holding the lease
//! runs the fleet's controller.
//!
//! Every gateway asks for the lease every third of its TTL. The one that
//! takes it starts a tenure: it builds the placement cluster from the
//! live nodes, restores each node's replicas from its desired state (the
//! previous leader's decisions stay in force), and runs the same control
//! loop a single machine runs (`control::run`). Where a single machine
//! applies a deployment delta to its own engines, the leader writes the
//! desired state of each node the delta touches, in its epoch; the nodes'
//! agents carry it out. Facts come from the gateway's view (nodes joining
//! and lost, replicas ready or gone) and from every gateway's published
//! load. A tenure ends when a renewal fails or finds another holder; the
//! controller is dropped with it, and the next leader rebuilds from Redis.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use hangar_core::{DesiredState, GatewayLoad, Millis, ModelKey, ReplicaId};
use hangar_placement::{Cluster, ClusterConfig, Level, Restore};
use hangar_redis::fleet::FleetState;
use hangar_redis::lease::{LeaderLease, Leadership as Lease};
use hangar_redis::registry::Registry;
use hangar_scaler::{Action, Observation};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::super::control::{self, Command, Fleet};
use super::super::desired::{desired, DesiredBook};
use super::super::{control_loop, Inner, ServeConfig};
use super::node_config;

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

/// One leader's term: its epoch and what it has told each node.
pub(crate) struct Tenure {
    inner: Arc<Inner>,
    /// Node → what it was last told.
    desired: Arc<Mutex<DesiredBook>>,
    /// Node → the agent run its desired state is for.
    runs: Arc<Mutex<BTreeMap<String, String>>>,
    /// When each replica of `desired` was first placed by this tenure.
    placed_at: Mutex<HashMap<ReplicaId, Instant>>,
    writer: Arc<Writer>,
    /// The other gateways' loads, from the view.
    loads: Mutex<Vec<GatewayLoad>>,
    /// Cancelled when the lease is lost.
    lost: CancellationToken,
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

    /// Folds a delta into the nodes' desired states and writes the nodes
    /// it touched. A write refused (the lease passed) ends the tenure.
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
        let writer = self.writer.clone();
        tokio::task::spawn_blocking(move || writer.write(&touched));
    }

    /// Stops watching whether replica `id` is taken up; whether it was
    /// still watched (so its failure is reported once).
    pub(crate) fn give_up(&self, id: ReplicaId) -> bool {
        self.placed_at.lock().expect("placed lock").remove(&id).is_some()
    }

    /// The replicas this leader placed on `node` more than `limit` ago
    /// (warm or hot), for the view to tell which its agent never took up.
    pub(crate) fn placed_before(&self, node: &str, limit: std::time::Duration) -> Vec<(ModelKey, ReplicaId)> {
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

/// Writes nodes' desired states, one write at a time and each with the
/// tenure's latest state of the node: writes spawned in order may run out
/// of order, and an older state must never land after a newer one.
struct Writer {
    fleet: FleetState,
    me: String,
    epoch: u64,
    desired: Arc<Mutex<DesiredBook>>,
    runs: Arc<Mutex<BTreeMap<String, String>>>,
    lost: CancellationToken,
    one_at_a_time: Mutex<()>,
}

impl Writer {
    fn write(&self, nodes: &[String]) {
        let _turn = self.one_at_a_time.lock().expect("writer lock");
        for node in nodes {
            let mut state = self.desired.lock().expect("desired lock").get(node);
            state.epoch = self.epoch;
            state.agent = self.runs.lock().expect("runs lock").get(node).cloned().unwrap_or_default();
            match self.fleet.write_desired(&self.me, node, &state) {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(
                        epoch = self.epoch,
                        "the lease has passed to another gateway: no longer leading"
                    );
                    self.lost.cancel();
                    return;
                }
                Err(e) => tracing::warn!(%node, "cannot write the desired state: {e}"),
            }
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
    while !stop.is_cancelled() {
        let asked = {
            let lease = lease.clone();
            tokio::task::spawn_blocking(move || lease.tick()).await.expect("no panic")
        };
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
                leadership.set(Some(tenure.0.clone()));
                inner.control.set_active(true);
                tracing::info!(epoch, "leading the fleet");
                tokio::spawn(renew(lease.clone(), epoch, tenure.0.lost.clone()));
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
            Err(e) => tracing::warn!("leader lease: {e}"),
        }
        tokio::select! {
            () = tokio::time::sleep(lease.period()) => {}
            () = stop.cancelled() => {}
        }
    }
}

/// Renews the lease every period; cancels `lost` when a renewal fails or
/// another gateway holds it (a leader that cannot renew must assume it
/// lost it).
async fn renew(lease: Arc<LeaderLease>, epoch: u64, lost: CancellationToken) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(lease.period()) => {}
            () = lost.cancelled() => return,
        }
        let l = lease.clone();
        match tokio::task::spawn_blocking(move || l.tick()).await.expect("no panic") {
            Ok(Lease::Leader { epoch: e, .. }) if e == epoch => {}
            other => {
                tracing::warn!(?other, "leader lease not renewed");
                lost.cancel();
                return;
            }
        }
    }
}

/// A tenure's start: the cluster of the live nodes with the replicas
/// their desired states hold, the controller over it, and every node's
/// desired state written again in this epoch (a replica the cluster could
/// not take back is thereby dropped).
async fn begin(
    inner: &Arc<Inner>,
    config: &ServeConfig,
    registry: &Registry,
    fleet: &FleetState,
    lease: &LeaderLease,
    epoch: u64,
) -> Result<(Arc<Tenure>, hangar_scaler::ControlLoop), String> {
    let (registry, reader) = (registry.clone(), fleet.clone());
    let (nodes, states) = tokio::task::spawn_blocking(move || {
        let nodes = registry.live().map_err(|e| e.to_string())?;
        let states = nodes
            .iter()
            .map(|n| {
                Ok((n.name.clone(), reader.desired(&n.name).map_err(|e| e.to_string())?.unwrap_or_default()))
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok::<_, String>((nodes, states))
    })
    .await
    .expect("no panic")?;
    let mut node_configs = Vec::new();
    for n in &nodes {
        match node_config(n) {
            Ok(c) => node_configs.push(c),
            Err(e) => tracing::warn!(node = %n.name, "cannot use this node: {e}"),
        }
    }
    let mut cluster =
        Cluster::new(ClusterConfig { nodes: node_configs, ..config.cluster() }).map_err(|e| e.to_string())?;
    for (node, state) in &states {
        let Ok(node_id) = node.parse::<hangar_placement::NodeId>() else { continue };
        for r in &state.replicas {
            let restore = Restore {
                model_key: r.model.clone(),
                replica_id: r.replica,
                node: node_id.clone(),
                level: if r.warm { Level::Warm } else { Level::Hot },
                gpus: (!r.warm).then(|| r.gpus.keys().copied().collect()),
                dedicated: r.dedicated,
                deployed_at_ms: 0,
            };
            if let Err(e) = cluster.restore(restore) {
                tracing::warn!(%node, replica = %r.replica, "dropping a replica the cluster cannot take back: {e}");
            }
        }
    }
    let mut desired_states: BTreeMap<String, DesiredState> =
        nodes.iter().map(|n| (n.name.clone(), DesiredState { epoch, ..DesiredState::default() })).collect();
    for d in cluster.snapshot().deployments().values() {
        desired_states.entry(d.node.to_string()).or_default().replicas.push(desired(d));
    }
    let runs = Arc::new(Mutex::new(nodes.iter().map(|n| (n.name.clone(), n.agent.clone())).collect()));
    let seed = config.seed ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let control = control_loop(config, seed, inner, cluster);
    let all: Vec<String> = desired_states.keys().cloned().collect();
    let now = Instant::now();
    let placed_at =
        desired_states.values().flat_map(|s| s.replicas.iter().map(|r| (r.replica, now))).collect();
    let desired_states = Arc::new(Mutex::new(DesiredBook::new(desired_states)));
    let lost = CancellationToken::new();
    let writer = Arc::new(Writer {
        fleet: fleet.clone(),
        me: lease.holder().to_owned(),
        epoch,
        desired: desired_states.clone(),
        runs: runs.clone(),
        lost: lost.clone(),
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
    });
    tokio::task::spawn_blocking(move || writer.write(&all)).await.expect("no panic");
    Ok((tenure, control))
}
