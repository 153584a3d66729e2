//! A gateway's view of the fleet, refreshed four times a second: which
//! nodes are alive (the registry, judged by a `Liveness`), which replicas
//! each runs (the nodes' reports), and this gateway's load, published for
//! the leader.
//!
//! Every gateway routes to the replicas the live nodes report ready: each
//! becomes a remote entry in its model's replica table and gets its
//! permits on the model's processor; one that stops being reported ready,
//! or whose node is gone, loses them. **A read that fails changes
//! nothing**: routing stays as it was, and no node's silence grows while
//! Redis does not answer. A live node whose report is missing for a moment
//! (Redis restarted, the report's TTL passed) keeps the routes of its last
//! report until the node is declared dead, and one whose registration is
//! missing (Redis lost its data) its last record: that is silence, counted
//! towards its death, not death.
//!
//! A follower answers for each model as the leader does: it takes the
//! leader's word on which models are unavailable (503 with the leader's
//! reason) and which hotswap models an operator closed.
//!
//! On the leader the view also keeps the controller's picture level with
//! what it reads: the tenure's members are made the live nodes (a node
//! joined, another run under a known name, a node dead or gone), and each
//! node's report becomes the controller's facts — a replica that serves
//! (COLD, or WARM when it woke), one that failed, one that went cold, one
//! placed long ago that its node never took up, and the weight artifacts
//! each node holds resident and each model loads (placement's
//! tie-breaker). A node drains while its record says so (its agent is
//! leaving) or an operator drained it (`hangar:draining`, read every
//! refresh): every gateway shows it, and the leader tells its controller
//! when a member's drain changes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use hangar_core::{
    GatewayLoad, Millis, ModelKey, ModelLoad, NodeAdapters, NodeRecord, NodeReport, ReplicaId, ReplicaPhase,
};
use hangar_redis::fleet::{FleetState, Unavailable};
use hangar_redis::liveness::{Change, Liveness, Seen as Registered};
use hangar_redis::registry::Registry;
use hangar_scaler::StartTier;

use super::super::adapters::AdapterCatalog;
use super::super::control::Command;
use super::super::replicas::{Replica, Reported};
use super::super::Inner;
use super::leader::{Leadership, Tenure};
use super::wall_ms;

/// How long a replica placed on a live node may go unreported (or
/// pending) before the leader counts it as a failed start.
const NEVER_TAKEN_UP: Duration = Duration::from_secs(30);

/// How often the view is refreshed.
pub(crate) const VIEW_EVERY: Duration = Duration::from_millis(250);

/// How often the agent of a suspect node that beats again is checked
/// while it does not answer this gateway.
const REACH_EVERY: Duration = Duration::from_secs(1);

/// One replica as the last refresh saw it.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    model: ModelKey,
    node: String,
    phase: ReplicaPhase,
    url: Option<String>,
    ready_ms: Option<u64>,
    sleeps: bool,
    failure: Option<String>,
    /// Its last start and what it is doing, as its node says.
    reported: Reported,
}

/// What the view keeps between refreshes.
struct Memory {
    liveness: Liveness,
    /// Each live node's last registration record.
    records: BTreeMap<String, NodeRecord>,
    /// Each live node's last report of its present run.
    reports: BTreeMap<String, NodeReport>,
    /// Every replica as last seen, and whether it ever served.
    seen: HashMap<ReplicaId, (Seen, bool)>,
    /// Registry keys already named as unreadable.
    named: HashSet<String>,
    /// A follower: the unavailable models last taken from the leader
    /// (`None`: none taken yet, or this gateway led since).
    mirrored: Option<Unavailable>,
    /// The leader: replicas checked on another gateway's word, and when.
    checked: HashMap<ReplicaId, Instant>,
    /// The adapters each live node publishes, as last read, and each
    /// node's agent URL as last handed to the adapter catalog.
    adapters: BTreeMap<String, NodeAdapters>,
    agents: BTreeMap<String, String>,
    /// Suspect nodes that beat again: when each was last checked, and
    /// whether it was named as cut off from this gateway.
    reach: HashMap<String, (Instant, bool)>,
}

/// The view and what it saw last.
pub(crate) struct View {
    inner: Weak<Inner>,
    me: String,
    registry: Registry,
    fleet: FleetState,
    leadership: Arc<Leadership>,
    epoch: Instant,
    memory: Mutex<Memory>,
}

impl View {
    pub(crate) fn new(
        inner: &Arc<Inner>,
        me: String,
        registry: Registry,
        fleet: FleetState,
        leadership: Arc<Leadership>,
    ) -> Arc<View> {
        let ttl = registry.ttl().as_millis() as Millis;
        let memory = Memory {
            // A gap between two reads counts at most four periods: a gateway
            // that was stopped itself does not blame the nodes for it.
            liveness: Liveness::new(ttl, 4 * VIEW_EVERY.as_millis() as Millis),
            records: BTreeMap::new(),
            reports: BTreeMap::new(),
            seen: HashMap::new(),
            named: HashSet::new(),
            mirrored: None,
            checked: HashMap::new(),
            adapters: BTreeMap::new(),
            agents: BTreeMap::new(),
            reach: HashMap::new(),
        };
        Arc::new(View {
            inner: Arc::downgrade(inner),
            me,
            registry,
            fleet,
            leadership,
            epoch: Instant::now(),
            memory: Mutex::new(memory),
        })
    }

    /// Refreshes the view every [`VIEW_EVERY`] until the server is gone.
    pub(crate) async fn run(self: Arc<Self>) {
        let mut failing = false;
        loop {
            if self.inner.strong_count() == 0 {
                return;
            }
            let me = self.clone();
            match tokio::task::spawn_blocking(move || me.refresh()).await.expect("no panic") {
                Ok(()) if failing => {
                    tracing::info!("fleet view: Redis answers again");
                    failing = false;
                }
                Ok(()) => {}
                Err(e) if !failing => {
                    tracing::warn!(
                        "fleet view: {e}; routing as before and concluding nothing until Redis answers"
                    );
                    failing = true;
                }
                Err(_) => {}
            }
            for (node, agent) in self.to_reach() {
                tokio::spawn(self.clone().reach(node, agent));
            }
            tokio::time::sleep(VIEW_EVERY).await;
        }
    }

    /// The suspect nodes that beat again and are due a check of their
    /// agent, each with its agent's URL if this gateway knows it.
    fn to_reach(&self) -> Vec<(String, Option<String>)> {
        let mut memory = self.memory.lock().expect("view lock");
        let memory = &mut *memory;
        let listed: HashSet<&str> = memory.liveness.to_reach().collect();
        memory.reach.retain(|n, _| listed.contains(n.as_str()));
        let due: Vec<String> = listed
            .into_iter()
            .filter(|n| memory.reach.get(*n).is_none_or(|(at, _)| at.elapsed() >= REACH_EVERY))
            .map(str::to_owned)
            .collect();
        due.into_iter()
            .map(|n| {
                let named = memory.reach.get(&n).is_some_and(|(_, named)| *named);
                memory.reach.insert(n.clone(), (Instant::now(), named));
                let agent = memory.records.get(&n).map(|r| r.url.clone());
                (n, agent)
            })
            .collect()
    }

    /// Checks the agent of suspect node `node`, which beats again: if it
    /// answers (or this gateway knows no agent to ask, so only the beat
    /// can tell), the suspicion is cleared. A node that beats and does not
    /// answer is cut off from this gateway by a network fault: it stays
    /// suspect, and hosts nothing new, until it answers.
    ///
    /// # Cancel safety
    /// The memory is changed only after the check, in one locked step.
    async fn reach(self: Arc<Self>, node: String, agent: Option<String>) {
        let answers = match (&agent, self.inner.upgrade()) {
            (Some(url), Some(inner)) => inner.answers(&format!("{url}/health")).await,
            (None, Some(_)) => true,
            (_, None) => return,
        };
        let mut memory = self.memory.lock().expect("view lock");
        if !answers {
            if let Some((_, named @ false)) = memory.reach.get_mut(&node) {
                *named = true;
                tracing::warn!(
                    node,
                    "a suspect node beats in Redis, but its agent does not answer this gateway: a network \
                     path between them has failed; it stays suspect, and nothing new goes there, until it answers"
                );
            }
        } else if let Some(run) = memory.liveness.reached(&node) {
            tracing::info!(
                node,
                run,
                "a suspect node beat again and its agent answers: it takes new replicas again"
            );
            memory.reach.remove(&node);
        }
    }

    /// One refresh: read, route, keep the leader level, publish the load.
    fn refresh(&self) -> Result<(), String> {
        let Some(inner) = self.inner.upgrade() else { return Ok(()) };
        let mut memory = self.memory.lock().expect("view lock");
        // Before the read: the heartbeats it sees are the first after the
        // evidence.
        for node in std::mem::take(&mut *inner.found_silent.lock().expect("found silent")) {
            memory.liveness.suspect(&node);
        }
        let read = self.read(&mut memory);
        let (nodes, silent) = match read {
            Ok(read) => read,
            Err(e) => {
                memory.liveness.unreachable();
                return Err(e);
            }
        };
        // Every replica of every live node, from its report (or its last
        // one, while it has none).
        let mut seen: HashMap<ReplicaId, Seen> = HashMap::new();
        for (name, report) in memory.reports.iter().filter(|(n, _)| nodes.contains_key(*n)) {
            for r in &report.replicas {
                let s = Seen {
                    model: r.model.clone(),
                    node: name.clone(),
                    phase: r.phase,
                    url: r.url.clone(),
                    ready_ms: r.ready_ms,
                    sleeps: r.sleeps,
                    failure: r.failure.clone(),
                    reported: Reported { start: r.start.clone(), instance: r.instance, lora: r.lora },
                };
                seen.insert(r.replica, s);
            }
        }
        inner.failed.lock().expect("failed table").retain(|_, (at, _)| at.elapsed() < super::QUARANTINE);
        let suspect: HashSet<&str> =
            nodes.keys().filter(|n| memory.liveness.is_suspect(n)).map(String::as_str).collect();
        route(&inner, &seen, &suspect);
        if let Some(catalog) = &inner.adapters {
            self.keep_adapters(&mut memory, &nodes, catalog)?;
        }
        // An agent leaving drains its node, as does an operator's word.
        let drained = self.fleet.drained_nodes().map_err(|e| e.to_string())?;
        let draining: HashSet<&str> = nodes
            .values()
            .filter(|r| r.draining || drained.contains(&r.name))
            .map(|r| r.name.as_str())
            .collect();
        let tenure = self.leadership.current();
        inner.metrics.nodes(nodes.len(), suspect.len(), draining.len(), tenure.is_some());
        if let Some(tenure) = tenure {
            self.keep_level(&inner, &tenure, &nodes, &memory.reports, &seen, &silent, &memory.seen);
            // After the joins: a node is drained, or suspect, as a member.
            for name in nodes.keys().filter(|n| tenure.member(n).is_some()) {
                tenure.draining(name, draining.contains(name.as_str()));
                tenure.suspect(name, suspect.contains(name.as_str()));
            }
            // Once the controller knows them suspect: what it placed on a
            // suspect node and its agent has not taken up is placed
            // elsewhere at once, not after NEVER_TAKEN_UP or the node's
            // death. A node dies over some milliseconds, so a probe may find
            // some of its engines dead while the rest and its agent still
            // answer — it is not suspect yet, and the replacements go back
            // to it (its weights are resident there) — and then the rest of
            // it is found dead. Nothing is lost by moving a replica that
            // never started; should the node beat again, it does not get it.
            for name in &suspect {
                for (model, replica) in give_up_untaken(&tenure, name, Duration::ZERO, &seen) {
                    let why = format!("node {name} went silent before it took it up");
                    inner.control.send(Command::Failed { model, replica, why, start_failed: false });
                }
            }
            tenure.publish_unavailable();
            memory.mirrored = None;
        } else {
            let (unavailable, closed) = self.fleet.gates().map_err(|e| e.to_string())?;
            follow_gates(&inner, memory.mirrored.as_ref(), &unavailable, &closed);
            memory.mirrored = Some(unavailable);
        }
        // After the leader's controller was told what they hold: what
        // `/admin/status` shows of a node, the controller knows.
        *inner.nodes.lock().expect("nodes lock") = nodes
            .values()
            .map(|r| {
                let report = memory.reports.get(&r.name);
                let name = r.name.as_str();
                super::super::NodeStatus::registered(
                    r,
                    report,
                    draining.contains(name),
                    suspect.contains(name),
                )
            })
            .collect();
        let ever: HashMap<ReplicaId, bool> = memory.seen.iter().map(|(id, (_, ever))| (*id, *ever)).collect();
        memory.seen = seen
            .into_iter()
            .map(|(id, s)| {
                let ever = ever.get(&id).copied().unwrap_or(false) || s.phase == ReplicaPhase::Ready;
                (id, (s, ever))
            })
            .collect();
        drop(memory);
        self.fleet.publish_load(&load(&inner, &self.me), wall_ms()).map_err(|e| e.to_string())?;
        if let Some(tenure) = self.leadership.current() {
            let others: Vec<GatewayLoad> = self
                .fleet
                .loads()
                .map_err(|e| e.to_string())?
                .into_iter()
                .filter(|l| l.gateway != self.me)
                .collect();
            // Only the leader's controller places replacements, and it hears
            // only this gateway's evidence: a replica another one found dead
            // is checked here too, apart from the refresh (which runs on a
            // blocking thread of the runtime, so it may spawn).
            for replica in self.new_word(others.iter().flat_map(|l| l.failed.iter().copied())) {
                let inner = inner.clone();
                tokio::spawn(async move { inner.probe_on_word(replica).await });
            }
            tenure.set_loads(others);
        }
        Ok(())
    }

    /// Keeps the adapter catalog what the live nodes publish. A node's
    /// list is read only when its report's digest differs from the list
    /// held; a list not (or no longer) in Redis under that digest — the
    /// agent has not written it yet, or Redis lost it and the agent will
    /// write it again — leaves what was held, as any read that finds
    /// nothing new.
    fn keep_adapters(
        &self,
        memory: &mut Memory,
        nodes: &BTreeMap<String, NodeRecord>,
        catalog: &AdapterCatalog,
    ) -> Result<(), String> {
        let held = memory.adapters.len();
        memory.adapters.retain(|name, _| nodes.contains_key(name));
        let mut changed = memory.adapters.len() != held;
        for name in nodes.keys() {
            let said = memory.reports.get(name).and_then(|r| r.adapters.as_ref());
            if said == memory.adapters.get(name).map(|a| &a.digest) {
                continue;
            }
            let Some(digest) = said else {
                changed |= memory.adapters.remove(name).is_some();
                continue;
            };
            if let Some(list) = self.fleet.adapters(name).map_err(|e| e.to_string())? {
                if list.digest == *digest {
                    memory.adapters.insert(name.clone(), list);
                    changed = true;
                }
            }
        }
        let agents: BTreeMap<String, String> =
            nodes.iter().map(|(n, r)| (n.clone(), r.url.clone())).collect();
        if changed || agents != memory.agents {
            let published = |name: &str| memory.adapters.get(name);
            catalog.set_fleet(agents.iter().map(|(n, url)| (n.as_str(), url.as_str(), published(n))));
            memory.agents = agents;
        }
        Ok(())
    }

    /// Of the replicas other gateways found dead, those not yet checked
    /// here on their word (each once per [`super::QUARANTINE`]).
    fn new_word(&self, failed: impl Iterator<Item = ReplicaId>) -> Vec<ReplicaId> {
        let mut memory = self.memory.lock().expect("view lock");
        memory.checked.retain(|_, at| at.elapsed() < super::QUARANTINE);
        failed.filter(|id| memory.checked.insert(*id, Instant::now()).is_none()).collect()
    }

    /// Reads the registry and the live nodes' reports. Returns the live
    /// nodes, and those among them whose report of their present run is
    /// missing now (their last report stands in for it).
    #[allow(clippy::type_complexity)]
    fn read(&self, memory: &mut Memory) -> Result<(BTreeMap<String, NodeRecord>, HashSet<String>), String> {
        let registrations = self.registry.registered().map_err(|e| e.to_string())?;
        for (key, why) in &registrations.bad {
            if memory.named.insert(key.clone()) {
                tracing::warn!(%key, "not a node registration, skipped (delete the key): {why}");
            }
        }
        let now = self.epoch.elapsed().as_millis() as Millis;
        let regs: Vec<Registered> = registrations
            .nodes
            .iter()
            .map(|r| Registered {
                name: r.record.name.clone(),
                agent: r.record.agent.clone(),
                beat: r.beat,
                left: r.left,
            })
            .collect();
        for change in memory.liveness.observe(now, &regs) {
            match change {
                Change::Died { name, agent } => {
                    tracing::warn!(node = %name, run = %agent, "node silent past its TTL while Redis answers: dead")
                }
                Change::Left { name, .. } => tracing::info!(node = %name, "node left the fleet"),
                Change::Replaced { name, old, new } => {
                    tracing::warn!(node = %name, %old, %new, "another agent run holds the node's name now")
                }
                Change::Joined { name, agent } => tracing::info!(node = %name, run = %agent, "node joined"),
            }
        }
        let mut nodes: BTreeMap<String, NodeRecord> = registrations
            .nodes
            .into_iter()
            .filter(|r| memory.liveness.is_alive(&r.record.name) && !r.left)
            .map(|r| (r.record.name.clone(), r.record))
            .collect();
        // A registration gone while Redis answers (Redis lost its data; the
        // agent registers again at its next beat) is silence, not death: a
        // node still alive keeps its last record — its routes, its place
        // among the leader's members — until it is declared dead.
        for (name, agent) in memory.liveness.alive() {
            if let Some(record) =
                memory.records.get(name).filter(|r| r.agent == agent && !nodes.contains_key(name))
            {
                nodes.insert(name.to_owned(), record.clone());
            }
        }
        memory.records.clone_from(&nodes);
        let names: Vec<String> = nodes.keys().cloned().collect();
        let reports = self.fleet.reports(&names).map_err(|e| e.to_string())?;
        let mut silent = HashSet::new();
        for (name, report) in names.iter().zip(reports) {
            match report.filter(|r| r.agent == nodes[name].agent) {
                Some(report) => {
                    memory.reports.insert(name.clone(), report);
                }
                // No report of this run now: its last one, if it is this
                // run's, stands in (nothing is known of a new run's).
                None => {
                    silent.insert(name.clone());
                    if memory.reports.get(name).is_some_and(|r| r.agent != nodes[name].agent) {
                        memory.reports.remove(name);
                    }
                }
            }
        }
        memory.reports.retain(|name, _| nodes.contains_key(name));
        Ok((nodes, silent))
    }

    /// The leader: the tenure's members made the live nodes, and the
    /// reports turned into the controller's facts.
    #[allow(clippy::too_many_arguments)]
    fn keep_level(
        &self,
        inner: &Inner,
        tenure: &Tenure,
        nodes: &BTreeMap<String, NodeRecord>,
        reports: &BTreeMap<String, NodeReport>,
        seen: &HashMap<ReplicaId, Seen>,
        silent: &HashSet<String>,
        before: &HashMap<ReplicaId, (Seen, bool)>,
    ) {
        for (name, agent) in tenure.members() {
            if nodes.get(&name).is_none_or(|r| r.agent != agent) {
                tenure.lose(&name);
                match self.registry.declare_dead(&name, &agent) {
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(node = %name, "cannot remove a dead node from the registry: {e}")
                    }
                }
            }
        }
        for (name, record) in nodes {
            if tenure.member(name).is_none() {
                let report = reports.get(name).filter(|r| r.agent == record.agent);
                tenure.join(record, report);
            }
        }
        for (id, now) in seen.iter().filter(|(_, s)| !silent.contains(&s.node)) {
            let Some(warm) = tenure.wants(&now.node, *id) else { continue };
            let (was, ever) = before.get(id).map_or((None, false), |(s, ever)| (Some(s.phase), *ever));
            let model = now.model.clone();
            match now.phase {
                ReplicaPhase::Ready if was != Some(ReplicaPhase::Ready) => {
                    let tier = match was {
                        Some(ReplicaPhase::Sleeping | ReplicaPhase::Waking | ReplicaPhase::Draining) => {
                            StartTier::Warm
                        }
                        _ => StartTier::Cold,
                    };
                    let took = Duration::from_millis(now.ready_ms.unwrap_or(0));
                    inner.control.send(Command::Ready { model, tier, took, sleeps: now.sleeps });
                }
                ReplicaPhase::Failed if !warm => {
                    let why =
                        now.failure.clone().unwrap_or_else(|| format!("node {} says it failed", now.node));
                    inner.control.send(Command::Failed { model, replica: *id, why, start_failed: !ever });
                }
                ReplicaPhase::Cold if warm => inner.control.send(Command::Stopped { model, replica: *id }),
                _ => {}
            }
        }
        // What the nodes hold of the models' weights, for placement's ties:
        // each model's artifact from its latest start (a key moved to new
        // weights reads as the new artifact once a replica loaded it).
        for (name, report) in reports.iter().filter(|(n, _)| nodes.contains_key(*n)) {
            tenure.resident(name, &report.artifacts);
        }
        let mut latest: HashMap<&ModelKey, (u64, &str)> = HashMap::new();
        for s in seen.values() {
            let Some(start) = &s.reported.start else { continue };
            let Some(weights) = &start.weights else { continue };
            let this = (start.completed_at_ms, weights.artifact.as_str());
            let last = latest.entry(&s.model).or_insert(this);
            *last = this.max(*last);
        }
        for (model, (_, artifact)) in latest {
            tenure.model_artifact(model, artifact);
        }
        // Placed long ago and not taken up: its agent never got it (a write
        // lost with Redis, no room left on its GPUs); placement must not
        // count on it forever.
        for name in nodes.keys().filter(|n| !silent.contains(*n)) {
            for (model, replica) in give_up_untaken(tenure, name, NEVER_TAKEN_UP, seen) {
                let why = format!("node {name} did not take it up in {NEVER_TAKEN_UP:?}");
                inner.control.send(Command::Failed { model, replica, why, start_failed: true });
            }
        }
        for id in seen.keys().filter(|id| seen[id].phase != ReplicaPhase::Pending) {
            tenure.give_up(*id); // Taken up.
        }
    }
}

/// The replicas this leader placed on `node` more than `limit` ago that
/// its agent has not taken up (not reported, or pending), each given up
/// here — so once — for the caller to tell the controller.
fn give_up_untaken(
    tenure: &Tenure,
    node: &str,
    limit: Duration,
    seen: &HashMap<ReplicaId, Seen>,
) -> Vec<(ModelKey, ReplicaId)> {
    let untaken = tenure.placed_before(node, limit).into_iter().filter(|(_, replica)| {
        seen.get(replica).is_none_or(|s| s.phase == ReplicaPhase::Pending) && tenure.give_up(*replica)
    });
    untaken.collect()
}

/// A follower answers for each model as the leader does: a model the
/// leader holds unavailable turns fail-fast requests away here too, with
/// the leader's reason, and a hotswap model shows the operator's gate.
/// Only what changed since the last word taken (`mirrored`) is applied:
/// a replica that became ready here since ends the model's unavailability
/// at once, as on the leader, and is not overruled by a stale word.
fn follow_gates(
    inner: &Inner,
    mirrored: Option<&Unavailable>,
    unavailable: &Unavailable,
    closed: &std::collections::BTreeSet<String>,
) {
    for (key, rt) in &inner.models {
        let reason = unavailable.get(key);
        if mirrored.map(|m| m.get(key)) != Some(reason) {
            rt.processor.set_unavailable(reason.cloned());
        }
        if rt.config.hotswap {
            rt.swap_closed.store(closed.contains(key), std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// Makes each model's replica table what the nodes report, giving permits
/// to replicas that became ready and taking them from those that stopped.
/// A replica this gateway found dead is kept out while quarantined, though
/// its node may still report it ready, and so is every replica of a node
/// this gateway holds suspect: a node cut off from this gateway alone (the
/// leader reaches it, so its replicas stay placed) would otherwise cost a
/// request its retry each time a quarantine lapsed.
fn route(inner: &Inner, seen: &HashMap<ReplicaId, Seen>, suspect: &HashSet<&str>) {
    for rt in inner.models.values() {
        let mut table = rt.replicas.lock().expect("replica table lock");
        // Read under the table's lock: a replica a probe quarantines
        // meanwhile is not put back (see `Inner::unroute`).
        let failed = inner.failed.lock().expect("failed table");
        let routed = |id: &ReplicaId| {
            seen.get(id).filter(|s| {
                s.phase != ReplicaPhase::Ready
                    || !(failed.contains_key(id) || suspect.contains(s.node.as_str()))
            })
        };
        let gone: Vec<ReplicaId> = table.keys().filter(|id| routed(id).is_none()).copied().collect();
        for id in gone {
            if table.remove(&id).is_some_and(|r| r.state == ReplicaPhase::Ready) {
                rt.processor.replica_gone(id);
            }
        }
        for (id, s) in seen.iter().filter(|(id, s)| s.model == rt.config.key && routed(id).is_some()) {
            let state = s.phase;
            let was = table.get(id).map(|r| r.state);
            match table.get_mut(id) {
                Some(r) => {
                    r.state = state;
                    r.base_url.clone_from(&s.url);
                    r.reported = Some(s.reported.clone());
                }
                None => {
                    table.insert(
                        *id,
                        Replica::remote(state, s.url.clone(), s.node.clone(), s.reported.clone()),
                    );
                }
            }
            if let Some(start) = &s.reported.start {
                rt.note_start(*id, Some(&s.node), start);
            }
            match (was == Some(ReplicaPhase::Ready), state == ReplicaPhase::Ready) {
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
    // The view pruned the quarantine earlier in this refresh.
    let failed = {
        let failed = inner.failed.lock().expect("failed table");
        failed.iter().filter(|(_, (_, node))| node.is_some()).map(|(id, _)| *id).collect()
    };
    GatewayLoad { gateway: me.to_owned(), models, failed }
}
