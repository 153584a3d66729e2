//! A gateway's view of the fleet, refreshed four times a second: which
//! nodes are alive (the registry), which replicas each runs (the nodes'
//! reports), and this gateway's load, published for the leader.
//!
//! Every gateway routes to the replicas the live nodes report ready: each
//! becomes a remote entry in its model's replica table and gets its
//! permits on the model's processor; one that stops being reported ready,
//! or whose node is gone, loses them. On the leader the view also turns
//! what changed into the controller's facts: a node joined or lost, a
//! replica ready (COLD, or WARM when it woke), and a replica the leader
//! still wants that its node stopped reporting (failed, or stopped when
//! it was to sleep).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use hangar_core::{GatewayLoad, ModelKey, ModelLoad, NodeRecord, ReplicaId, ReplicaPhase};
use hangar_redis::fleet::FleetState;
use hangar_redis::registry::Registry;
use hangar_scaler::StartTier;

use super::super::control::Command;
use super::super::replicas::{Replica, ReplicaState};
use super::super::Inner;
use super::leader::Leadership;
use super::{node_config, wall_ms};

/// How long a replica placed on a live node may go unreported before the
/// leader counts it as a failed start.
const NEVER_TAKEN_UP: Duration = Duration::from_secs(30);

/// How often the view is refreshed.
pub(crate) const VIEW_EVERY: Duration = Duration::from_millis(250);

/// One replica as the last refresh saw it.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    model: ModelKey,
    node: String,
    phase: ReplicaPhase,
    url: Option<String>,
    ready_ms: Option<u64>,
    sleeps: bool,
}

/// The view and what it saw last.
pub(crate) struct View {
    inner: Weak<Inner>,
    me: String,
    registry: Registry,
    fleet: FleetState,
    leadership: Arc<Leadership>,
    last: Mutex<(BTreeMap<String, NodeRecord>, HashMap<ReplicaId, Seen>)>,
}

impl View {
    pub(crate) fn new(
        inner: &Arc<Inner>,
        me: String,
        registry: Registry,
        fleet: FleetState,
        leadership: Arc<Leadership>,
    ) -> Arc<View> {
        Arc::new(View {
            inner: Arc::downgrade(inner),
            me,
            registry,
            fleet,
            leadership,
            last: Mutex::default(),
        })
    }

    /// Refreshes the view every [`VIEW_EVERY`] until the server is gone.
    pub(crate) async fn run(self: Arc<Self>) {
        loop {
            if self.inner.strong_count() == 0 {
                return;
            }
            let me = self.clone();
            if let Err(e) = tokio::task::spawn_blocking(move || me.refresh()).await.expect("no panic") {
                tracing::warn!("fleet view: {e}");
            }
            tokio::time::sleep(VIEW_EVERY).await;
        }
    }

    /// One refresh: read, route, tell the leader, publish the load.
    fn refresh(&self) -> Result<(), String> {
        let Some(inner) = self.inner.upgrade() else { return Ok(()) };
        let nodes: BTreeMap<String, NodeRecord> = self
            .registry
            .live()
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|n| (n.name.clone(), n))
            .collect();
        let names: Vec<String> = nodes.keys().cloned().collect();
        let reports = self.fleet.reports(&names).map_err(|e| e.to_string())?;
        let mut seen = HashMap::new();
        // Live nodes without a report of their agent's run: nothing is
        // known of their replicas (a report lapses 3 s after its agent
        // dies, the registration 8 s after), so none is declared gone.
        let mut silent = std::collections::HashSet::new();
        for (name, report) in names.iter().zip(reports) {
            // A report from an earlier run of the node's agent is not this
            // run's (it may list replicas the new run never started).
            let Some(report) = report.filter(|r| r.agent == nodes[name].agent) else {
                silent.insert(name.clone());
                continue;
            };
            for r in report.replicas {
                let s = Seen {
                    model: r.model,
                    node: name.clone(),
                    phase: r.phase,
                    url: r.url,
                    ready_ms: r.ready_ms,
                    sleeps: r.sleeps,
                };
                seen.insert(r.replica, s);
            }
        }
        {
            let mut failed = inner.failed.lock().expect("failed table");
            failed.retain(|_, (at, _)| at.elapsed() < super::QUARANTINE);
            seen.retain(|id, s| s.phase != ReplicaPhase::Ready || !failed.contains_key(id));
        }
        route(&inner, &seen);
        let mut last = self.last.lock().expect("view lock");
        if let Some(tenure) = self.leadership.current() {
            for (name, record) in &nodes {
                if !last.0.contains_key(name) {
                    match node_config(record) {
                        Ok(node) => inner.control.send(Command::NodeJoined(node)),
                        Err(e) => tracing::warn!(node = %name, "cannot use this node: {e}"),
                    }
                }
            }
            for name in last.0.keys().filter(|n| !nodes.contains_key(*n)) {
                if let Ok(id) = name.parse() {
                    inner.control.send(Command::NodeLost(id));
                }
                if let Err(e) = self.fleet.forget(name) {
                    tracing::warn!(node = %name, "cannot forget a lost node's state: {e}");
                }
            }
            for (id, now) in &seen {
                tenure.give_up(*id); // Taken up.
                let before = last.1.get(id).map(|s| s.phase);
                if now.phase == ReplicaPhase::Ready && before != Some(ReplicaPhase::Ready) {
                    let tier = match before {
                        Some(ReplicaPhase::Sleeping | ReplicaPhase::Draining) => StartTier::Warm,
                        _ => StartTier::Cold,
                    };
                    let took = Duration::from_millis(now.ready_ms.unwrap_or(0));
                    let sleeps = now.sleeps;
                    inner.control.send(Command::Ready { model: now.model.clone(), tier, took, sleeps });
                }
            }
            for (id, before) in last.1.iter().filter(|(id, _)| !seen.contains_key(id)) {
                if !nodes.contains_key(&before.node) || silent.contains(&before.node) {
                    continue; // Its node's loss covers it, or nothing is known.
                }
                let (model, replica) = (before.model.clone(), *id);
                match tenure.wants(&before.node, *id) {
                    Some(false) => inner.control.send(Command::Failed {
                        model,
                        replica,
                        why: format!("node {} no longer reports it", before.node),
                        start_failed: before.phase == ReplicaPhase::Starting,
                    }),
                    Some(true) => inner.control.send(Command::Stopped { model, replica }),
                    None => {}
                }
            }
            // Placed long ago and never reported: its agent did not take it
            // up (a write lost with Redis, say); placement must not count
            // on it forever.
            for name in nodes.keys().filter(|n| !silent.contains(*n)) {
                for (model, replica) in tenure.placed_before(name, NEVER_TAKEN_UP) {
                    let reported = seen.contains_key(&replica) || last.1.contains_key(&replica);
                    if !reported && tenure.give_up(replica) {
                        let why = format!("node {name} never took it up in {NEVER_TAKEN_UP:?}");
                        inner.control.send(Command::Failed { model, replica, why, start_failed: true });
                    }
                }
            }
        }
        *last = (nodes, seen);
        drop(last);
        self.fleet.publish_load(&load(&inner, &self.me), wall_ms()).map_err(|e| e.to_string())?;
        if let Some(tenure) = self.leadership.current() {
            let others = self.fleet.loads().map_err(|e| e.to_string())?;
            tenure.set_loads(others.into_iter().filter(|l| l.gateway != self.me).collect());
        }
        Ok(())
    }
}

/// Makes each model's replica table what the nodes report, giving permits
/// to replicas that became ready and taking them from those that stopped.
fn route(inner: &Inner, seen: &HashMap<ReplicaId, Seen>) {
    for rt in inner.models.values() {
        let mut table = rt.replicas.lock().expect("replica table lock");
        let gone: Vec<ReplicaId> = table.keys().filter(|id| !seen.contains_key(id)).copied().collect();
        for id in gone {
            if table.remove(&id).is_some_and(|r| r.state == ReplicaState::Ready) {
                rt.processor.replica_gone(id);
            }
        }
        for (id, s) in seen.iter().filter(|(_, s)| s.model == rt.config.key) {
            let state = ReplicaState::from(s.phase);
            let was = table.get(id).map(|r| r.state);
            match table.get_mut(id) {
                Some(r) => {
                    r.state = state;
                    r.base_url.clone_from(&s.url);
                }
                None => {
                    table.insert(*id, Replica::remote(state, s.url.clone(), s.node.clone()));
                }
            }
            match (was == Some(ReplicaState::Ready), state == ReplicaState::Ready) {
                (false, true) => rt.processor.replica_ready(*id, rt.config.permits()),
                (true, false) => drop(rt.processor.replica_gone(*id)),
                _ => {}
            }
        }
    }
}

/// This gateway's load, per model.
fn load(inner: &Inner, me: &str) -> GatewayLoad {
    let models = inner
        .models
        .values()
        .map(|rt| {
            let l = rt.processor.load();
            let load = ModelLoad {
                waiting: u32::try_from(l.waiting).unwrap_or(u32::MAX),
                in_flight: l.in_use,
                arrivals: l.counters.arrivals,
                completions: l.counters.completions,
                rejected: l.counters.rejected,
                busy_ms: l.counters.busy_ms,
            };
            (rt.config.key.clone(), load)
        })
        .collect();
    GatewayLoad { gateway: me.to_owned(), models }
}
