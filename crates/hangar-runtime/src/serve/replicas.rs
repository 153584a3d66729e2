//! Each model's replica table: the replicas the gateway routes to, and
//! what the admin API shows of them.
//!
//! An entry is one of two kinds. A replica this process runs — a single
//! `hangar serve`'s nodes, or a fleet agent's machine — is written by the
//! node's lifecycle driver (`node`), which owns its engine; the entry
//! mirrors the driver's view of it. A replica another machine runs is
//! written by a fleet gateway's view (`fleet::view`) from its node's
//! report. Either way the entry's phase says whether it serves; the
//! processor's permits on it are given and taken by the same writer.
//!
//! What a replica is doing (its instance monitor) and how its last start
//! went (its start report) come from whoever runs it: this process's
//! processor and lifecycle driver, or the node's report. Each model also
//! keeps its last [`RECENT_STARTS`] start reports, whichever node made
//! them, for the admin API and the status page.

use std::collections::VecDeque;
use std::sync::Arc;

use hangar_agent::capabilities::Capabilities;
use hangar_agent::lifecycle::{NodeReplica, StartReport};
use hangar_core::instance::InstanceReport;
use hangar_core::{ReplicaId, ReplicaPhase};
use hangar_placement::Deployment;
use serde::Serialize;

use super::control::Command;
use super::{replica_name, Inner, ModelRuntime};

/// One replica of a model, as the gateway knows it.
pub(crate) struct Replica {
    /// Where it is in its life (only `Ready` ones are routed to).
    pub state: ReplicaPhase,
    /// Its engine's base URL, once known.
    pub base_url: Option<String>,
    /// The node running it.
    pub node: Option<String>,
    /// The driver's view of it, when this process runs it.
    pub local: Option<NodeReplica>,
    /// What its node reports of it, when another machine runs it: its
    /// last start and what it is doing.
    pub reported: Option<Reported>,
}

impl Replica {
    /// Its engine's URL while it is routed to (ready).
    fn routed_url(&self) -> Option<String> {
        self.base_url.clone().filter(|_| self.state == ReplicaPhase::Ready)
    }
}

/// What a node's report says of a replica beyond its phase.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Reported {
    pub start: Option<StartReport>,
    pub instance: Option<InstanceReport>,
    /// Its engine loads LoRA adapters at run time, as its agent probed.
    pub lora: bool,
}

/// How many start reports a model keeps.
pub const RECENT_STARTS: usize = 20;

/// One of a model's recent starts, as the admin API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct StartRecord {
    /// `<model>:<replica_id>`.
    pub replica: String,
    /// The node it started on.
    pub node: Option<String>,
    /// How it went.
    #[serde(flatten)]
    pub report: StartReport,
}

/// A model's recent starts, newest last.
#[derive(Default)]
pub(crate) struct RecentStarts(VecDeque<(ReplicaId, StartRecord)>);

/// A replica as the admin API shows it (serialized as is).
#[derive(Debug, Serialize)]
pub struct ReplicaStatus {
    name: String,
    id: String,
    /// `HOT` or `WARM`, from placement.
    level: Option<String>,
    /// Kept by a dedicated window of the schedule.
    dedicated: bool,
    state: ReplicaPhase,
    node: Option<String>,
    /// The GPUs placement holds for it.
    gpus: Vec<u32>,
    /// The GPUs its engine runs on, when this process runs it.
    engine_gpus: Option<Vec<u32>>,
    in_flight: u32,
    url: Option<String>,
    /// The engine process, when this process started one.
    pid: Option<u32>,
    /// What its engine can do (sleep, metrics, slots).
    capabilities: Capabilities,
    /// How its last start went.
    start: Option<StartReport>,
    /// What it is doing: its instance monitor's state and last window.
    instance: Option<InstanceReport>,
    /// Why it failed, while it is failed.
    failure: Option<String>,
}

impl Replica {
    /// A replica another machine runs (fleet mode), as its node reports
    /// it: this gateway routes to it, it does not own its engine.
    pub fn remote(state: ReplicaPhase, url: Option<String>, node: String, reported: Reported) -> Replica {
        Replica { state, base_url: url, node: Some(node), local: None, reported: Some(reported) }
    }

    /// A replica this process runs, as its driver sees it.
    pub fn local(r: &NodeReplica) -> Replica {
        Replica {
            state: r.phase,
            base_url: r.url.clone(),
            node: Some(r.view.node.clone()),
            local: Some(r.clone()),
            reported: None,
        }
    }
}

impl ModelRuntime {
    /// The base URL of a ready replica (`None` once it is not ready, or
    /// gone).
    pub fn replica_url(&self, replica: ReplicaId) -> Option<String> {
        let replicas = self.replicas.lock().expect("replica table lock");
        replicas.get(&replica).filter(|r| r.state == ReplicaPhase::Ready).and_then(|r| r.base_url.clone())
    }

    /// The base URL of a ready replica and the node running it, read
    /// under one lock (`None` once it is not ready, or gone).
    pub(crate) fn replica_route(&self, replica: ReplicaId) -> Option<(String, Option<String>)> {
        let replicas = self.replicas.lock().expect("replica table lock");
        let r = replicas.get(&replica).filter(|r| r.state == ReplicaPhase::Ready)?;
        Some((r.base_url.clone()?, r.node.clone()))
    }

    /// The node running `replica`, while the table has it (in any state).
    pub(crate) fn replica_node(&self, replica: ReplicaId) -> Option<String> {
        self.replicas.lock().expect("replica table lock").get(&replica).and_then(|r| r.node.clone())
    }

    /// Keeps `report`, the start of `replica` on `node`, among the model's
    /// recent starts — once: the same start (same replica, same start
    /// time) seen again is not kept twice.
    pub(crate) fn note_start(&self, replica: ReplicaId, node: Option<&str>, report: &StartReport) {
        let mut recent = self.starts.lock().expect("recent starts lock");
        let seen = recent.0.iter().rev().any(|(id, r)| {
            *id == replica
                && r.report.started_at_ms == report.started_at_ms
                && r.report.status == report.status
        });
        if seen {
            return;
        }
        if recent.0.len() == RECENT_STARTS {
            recent.0.pop_front();
        }
        let record = StartRecord {
            replica: replica_name(&self.config.key, replica),
            node: node.map(str::to_owned),
            report: report.clone(),
        };
        recent.0.push_back((replica, record));
    }

    /// The model's recent starts, newest first.
    pub fn recent_starts(&self) -> Vec<StartRecord> {
        self.starts.lock().expect("recent starts lock").0.iter().rev().map(|(_, r)| r.clone()).collect()
    }

    /// What each replica of this process is doing, by name: the instance
    /// monitor's state and last window (remote replicas: their node's
    /// report).
    pub(crate) fn instances(&self) -> Vec<(String, InstanceReport)> {
        let table: Vec<(ReplicaId, Option<InstanceReport>)> = {
            let replicas = self.replicas.lock().expect("replica table lock");
            replicas.iter().map(|(id, r)| (*id, r.reported.as_ref().and_then(|p| p.instance))).collect()
        };
        table
            .into_iter()
            .filter_map(|(id, reported)| {
                let instance = self.processor.instance(id).or(reported)?;
                Some((replica_name(&self.config.key, id), instance))
            })
            .collect()
    }

    /// Whether the model's engines cannot load LoRA adapters: its ready
    /// replicas were probed at start — by this process, or on a fleet by
    /// their agents, which report it — and none can. `false` while none is
    /// ready (nothing is known yet).
    pub(crate) fn lora_refused(&self) -> bool {
        let table = self.replicas.lock().expect("replica table lock");
        let lora = |r: &Replica| match (&r.local, &r.reported) {
            (Some(local), _) => Some(local.capabilities.lora),
            (None, Some(reported)) => Some(reported.lora),
            (None, None) => None,
        };
        let mut probed = table.values().filter(|r| r.state == ReplicaPhase::Ready).filter_map(lora);
        probed.next().is_some_and(|first| !first && probed.all(|can| !can))
    }

    /// How many replicas are in `state`.
    pub(crate) fn count(&self, state: ReplicaPhase) -> usize {
        self.replicas.lock().expect("replica table lock").values().filter(|r| r.state == state).count()
    }

    /// Each ready replica's name and the permits held on it.
    pub(crate) fn in_flight(&self) -> Vec<(String, u32)> {
        let ready: Vec<ReplicaId> = {
            let table = self.replicas.lock().expect("replica table lock");
            table.iter().filter(|(_, r)| r.state == ReplicaPhase::Ready).map(|(id, _)| *id).collect()
        };
        ready
            .into_iter()
            .map(|id| (replica_name(&self.config.key, id), self.processor.in_use_on(id)))
            .collect()
    }

    /// Each replica's state.
    pub(crate) fn states(&self) -> Vec<(ReplicaId, ReplicaPhase)> {
        self.replicas.lock().expect("replica table lock").iter().map(|(id, r)| (*id, r.state)).collect()
    }

    /// Replicas starting or serving.
    pub(crate) fn up(&self) -> u32 {
        self.replicas.lock().expect("replica table lock").values().filter(|r| r.state.is_up()).count() as u32
    }

    /// The model's replicas as the admin API shows them, with placement's
    /// view of each (`deployments`: the model's hot and warm deployments).
    pub fn status(&self, deployments: &[Deployment]) -> Vec<ReplicaStatus> {
        let replicas = self.replicas.lock().expect("replica table lock");
        replicas
            .iter()
            .map(|(id, r)| {
                let d = deployments.iter().find(|d| d.replica_id == *id);
                let local = r.local.as_ref();
                ReplicaStatus {
                    name: replica_name(&self.config.key, *id),
                    id: id.to_string(),
                    level: d.map(|d| d.level.to_string()),
                    dedicated: d.is_some_and(|d| d.dedicated),
                    state: r.state,
                    node: d.map(|d| d.node.to_string()).or_else(|| r.node.clone()),
                    gpus: d.map(|d| d.gpu_bytes_by_gpu.keys().copied().collect()).unwrap_or_default(),
                    engine_gpus: local.map(NodeReplica::gpus),
                    in_flight: self.processor.in_use_on(*id),
                    url: r.base_url.clone(),
                    pid: local.and_then(|l| l.pid),
                    // A remote replica's: what its agent reports of it.
                    capabilities: local.map(|l| l.capabilities).unwrap_or_else(|| Capabilities {
                        lora: r.reported.as_ref().is_some_and(|p| p.lora),
                        ..Capabilities::default()
                    }),
                    start: local
                        .and_then(|l| l.start.clone())
                        .or_else(|| r.reported.as_ref().and_then(|p| p.start.clone())),
                    instance: self
                        .processor
                        .instance(*id)
                        .or_else(|| r.reported.as_ref().and_then(|p| p.instance)),
                    failure: local.and_then(|l| l.failure().map(str::to_owned)),
                }
            })
            .collect()
    }
}

/// How long a health check of a replica (or an agent) another machine
/// runs may take: it answered at once while it served.
const HEALTH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

impl Inner {
    /// A replica another machine runs stopped answering: at once, its
    /// requests lose their replica (the gateway retries them) and no new
    /// ones go there; it is kept out of routing for a while though its
    /// node may still report it. Returns whether this call failed it
    /// (false: another probe did, or it is not in the table): the caller
    /// then tells the controller ([`Inner::tell_failed`]), once its
    /// node's fate is known — exactly one caller per failure.
    fn unroute(&self, rt: &ModelRuntime, replica: ReplicaId, why: &str) -> bool {
        let Some(node) =
            rt.replicas.lock().expect("replica table lock").get(&replica).map(|r| r.node.clone())
        else {
            return false;
        };
        // Whoever quarantines it first failed it. Quarantined before it
        // leaves the table: the view, which checks the quarantine under the
        // table's lock, cannot put it back between the two — and may take
        // it out itself, which must not make it nobody's failure (the
        // controller would never hear of it).
        {
            let mut recent = self.failed.lock().expect("failed table");
            recent.retain(|_, (at, _)| at.elapsed() < super::fleet::QUARANTINE);
            match recent.entry(replica) {
                std::collections::hash_map::Entry::Occupied(_) => return false,
                std::collections::hash_map::Entry::Vacant(v) => v.insert((std::time::Instant::now(), node)),
            };
        }
        // Its permits go with it, unless the view took it out first (and
        // took them).
        if rt.replicas.lock().expect("replica table lock").remove(&replica).is_some() {
            rt.processor.replica_gone(replica);
        }
        tracing::warn!(replica = %replica_name(&rt.config.key, replica), "replica failed: {why}");
        rt.metrics.replica_failed();
        true
    }

    /// On the leader, the controller hears that `replica` failed.
    fn tell_failed(&self, rt: &ModelRuntime, replica: ReplicaId, why: &str) {
        let model = rt.config.key.clone();
        self.control.send(Command::Failed { model, replica, why: why.to_owned(), start_failed: false });
    }

    /// Checks a replica now, after a request to it failed; a dead one is
    /// handled as failed. Returns whether it is alive.
    ///
    /// A replica this process runs is checked by its node's driver. A dead
    /// replica another machine runs (fleet mode) makes its node suspect:
    /// every other replica there is checked at once, so that a retry does
    /// not go to a sibling that died with it (see [`Inner::probe_node`]).
    pub async fn probe(self: &Arc<Self>, rt: &Arc<ModelRuntime>, replica: ReplicaId) -> bool {
        // One read of the table: what is checked is the replica as it was
        // found here. Read twice, an entry another probe took out between
        // the reads once looked alive, and the request lost its retry.
        let here = rt
            .replicas
            .lock()
            .expect("replica table lock")
            .get(&replica)
            .map(|r| (r.node.clone(), r.local.is_some(), r.routed_url()));
        if let (Some((_, true, _)), Some(driver)) = (&here, self.driver.get()) {
            return driver.probe(replica).await;
        }
        let (node, found) = match here {
            Some((node, _, Some(url))) => match self.check_remote(rt, &url).await {
                Ok(()) => return true,
                Err(why) if self.unroute(rt, replica, why) => (node, Some((rt, replica, why))),
                Err(_) => (node, None),
            },
            // Taken out of service since the request was sent: its node
            // says so, and is not in doubt.
            Some((_, _, None)) => (None, None),
            // Already failed by another request's probe, which may still
            // be checking its siblings: check them too before answering.
            None => {
                (self.failed.lock().expect("failed table").get(&replica).and_then(|(_, n)| n.clone()), None)
            }
        };
        match node {
            Some(node) => self.probe_node(&node, found).await,
            None => {
                if let Some((rt, replica, why)) = found {
                    self.tell_failed(rt, replica, why);
                }
            }
        }
        false
    }

    /// Another gateway found `replica` dead: if this one routes to it, it
    /// is checked here too and, if dead, handled as one a request of this
    /// gateway found dead — on the leader, its controller hears of it (and
    /// of its node, if suspect), which it would not from the other gateway.
    pub(crate) async fn probe_on_word(self: &Arc<Self>, replica: ReplicaId) {
        let routed = self.models.values().find(|rt| {
            let table = rt.replicas.lock().expect("replica table lock");
            table.get(&replica).is_some_and(|r| r.local.is_none() && r.state == ReplicaPhase::Ready)
        });
        if let Some(rt) = routed {
            self.probe(rt, replica).await;
        }
    }

    /// Checks every ready replica of `node` and its agent at once, after
    /// `found` (a replica there this probe took out of routing, if any)
    /// did not answer: the dead are taken out of routing as each check
    /// fails. If nothing there answers — no replica, not the agent — the
    /// node is suspect, and the controller hears that before it hears of
    /// the replicas, so it places them again on another node rather than
    /// on the one that just lost them. A node whose agent answers only
    /// lost engines.
    async fn probe_node(
        self: &Arc<Self>,
        node: &str,
        found: Option<(&Arc<ModelRuntime>, ReplicaId, &'static str)>,
    ) {
        let mut checks = Vec::new();
        for rt in self.models.values() {
            let ready: Vec<(ReplicaId, String)> = rt
                .replicas
                .lock()
                .expect("replica table lock")
                .iter()
                .filter(|(_, r)| r.node.as_deref() == Some(node) && r.local.is_none())
                .filter_map(|(id, r)| Some((*id, r.routed_url()?)))
                .collect();
            for (id, url) in ready {
                checks.push(async move {
                    match self.check_remote(rt, &url).await {
                        Ok(()) => Ok(()),
                        Err(why) => Err(self.unroute(rt, id, why).then_some((rt, id, why))),
                    }
                });
            }
        }
        let agent = self
            .nodes
            .lock()
            .expect("nodes lock")
            .iter()
            .find(|n| n.name == node)
            .and_then(|n| n.url.clone());
        let agent_answers = async {
            match agent {
                Some(url) => self.answers(&format!("{url}/health")).await,
                // Not a node this gateway knows the agent of: no evidence.
                None => true,
            }
        };
        let (checked, agent_answers) =
            futures::future::join(futures::future::join_all(checks), agent_answers).await;
        let answered = agent_answers || checked.iter().any(Result::is_ok);
        let dead: Vec<_> =
            found.into_iter().chain(checked.into_iter().filter_map(|c| c.err().flatten())).collect();
        if !answered && !dead.is_empty() {
            tracing::warn!(
                node,
                "neither the node's agent nor any of its engines answers: suspect, nothing new goes there \
                 until it beats again (or its registration lapses)"
            );
            self.found_silent.lock().expect("found silent").push(node.to_owned());
            if let Ok(id) = node.parse() {
                self.control.send(Command::Suspect { node: id, on: true });
            }
        }
        for (rt, id, why) in dead {
            self.tell_failed(rt, id, why);
        }
    }

    /// Whether `url` answers a GET with a success within the health
    /// checks' timeout.
    pub(crate) async fn answers(&self, url: &str) -> bool {
        let answer = self.client.get(url).timeout(HEALTH_TIMEOUT).send().await;
        answer.is_ok_and(|r| r.status().is_success())
    }

    /// One health check of a replica another machine runs, at `url`: its
    /// `/health` (cog: its state) answers.
    async fn check_remote(&self, rt: &ModelRuntime, url: &str) -> Result<(), &'static str> {
        let healthy = if rt.config.engine.is_cog() {
            // Cog answers 200 whatever its state: read the state.
            hangar_agent::cog::health(&self.client, url, HEALTH_TIMEOUT).await.is_ok_and(|h| h.serves())
        } else {
            self.answers(&format!("{url}/health")).await
        };
        healthy.then_some(()).ok_or("its health check failed")
    }
}
