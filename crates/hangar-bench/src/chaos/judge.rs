//! The checker's judgement of the fleet's state, sample by sample.
//!
//! Sans-IO: the run's prober reads every agent's `GET /status`, the
//! leader's `GET /admin/status` and the process table into a [`Sample`];
//! [`Judge::observe`] compares it with the last ones and returns what it
//! finds wrong. No clock is read: a sample carries its time.
//!
//! # What is checked
//! - **No GPU over-commit**, on every sample: on each node, the bytes of
//!   the engines that hold GPU memory (starting, awake, falling asleep,
//!   waking, or stopping or being killed from awake) on each GPU are at most that GPU's
//!   memory. Placement's own books (the leader's deployments per node and
//!   GPU) are held to the same bound.
//! - **Engines == placed replicas** on every node, both ways: every
//!   engine a node runs (a replica with a process in its `/status`) is
//!   placed there by the leader, on the GPUs it runs on, HOT if it is
//!   awake; every replica placed HOT on a node has an engine there; and
//!   every engine process of the run is one a live agent lists. A
//!   difference is allowed to last [`ALLOWANCE_MS`] of *calm* time — time
//!   in which Redis answers, a leader leads, and the node's agent runs
//!   (not stopped, not dead) — because before that the fleet cannot
//!   converge: the leader learns of a change only through Redis, a node
//!   declared dead is placed again only after the 8 s TTL of silence, and
//!   a stopped agent cannot stop its engines. One that outlives it is
//!   counted once, as a ghost (an engine nobody placed) or as stuck.
//! - **Whole**: each model has at least its `min_replicas` replicas placed
//!   HOT and ready, as the leader sees them.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Serialize;

/// How long, in calm time, a node may differ from placement before the
/// difference is a ghost or stuck: within it the leader sees a change
/// (250 ms), decides and writes the node's desired state, the agent reads
/// it (200 ms) and carries out one step per replica — a stop that drains
/// the replica's requests (a mock request lasts well under a second), a
/// start (about a second for a mock engine), a restart after a back-off
/// of 1 s doubling — with room to spare for a machine shared with the
/// run's own processes.
pub const ALLOWANCE_MS: u64 = 15_000;

/// One engine (a replica with a process) of a node, from its `/status`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineSample {
    /// The replica id.
    pub replica: String,
    /// Its model.
    pub model: String,
    /// The engine's state (`starting`, `awake`, `asleep`, …).
    pub state: String,
    /// GPU → bytes it holds now (none asleep).
    pub holds: BTreeMap<u32, u64>,
    /// The engine's process, once started.
    pub pid: Option<u32>,
    /// It has a process (or may, mid-step).
    pub has_process: bool,
    /// What placement wants of it, as the node knows: `hot`, `warm` or
    /// `gone`.
    pub want: String,
}

/// One node as its agent answered.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeSample {
    /// The node's name.
    pub name: String,
    /// The agent's process.
    pub pid: u32,
    /// Each GPU's memory, bytes.
    pub gpus: Vec<u64>,
    /// Its replicas that are not absent or failed.
    pub engines: Vec<EngineSample>,
    /// The engine processes whose parent is this agent.
    pub processes: Vec<u32>,
}

/// One replica the leader has placed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Placed {
    /// The replica id.
    pub replica: String,
    /// The node.
    pub node: String,
    /// HOT (else WARM).
    pub hot: bool,
    /// GPU → bytes (empty unless HOT).
    pub gpus: BTreeMap<u32, u64>,
}

/// One model as the leader sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSample {
    /// The model.
    pub model: String,
    /// Its `min_replicas`.
    pub min_replicas: u32,
    /// Its replicas as placement holds them.
    pub placed: Vec<Placed>,
    /// The ids of its replicas the leader routes to (ready).
    pub ready: Vec<String>,
}

/// The fleet at one moment.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Sample {
    /// Ms since the run began.
    pub at_ms: u64,
    /// Redis answers (not down, not paused).
    pub redis_ok: bool,
    /// The leader's picture, when one gateway leads and answered.
    pub leader: Option<Vec<ModelSample>>,
    /// How many gateways said they lead.
    pub leaders: usize,
    /// The leading gateway's id, when one leads.
    pub leader_id: Option<String>,
    /// Every agent that runs (not stopped) and answered.
    pub nodes: Vec<NodeSample>,
    /// The names of the agents that are not running now (dead, stopped,
    /// restarting).
    pub down: Vec<String>,
    /// The run's engine processes whose parent is no running agent.
    pub orphans: Vec<u32>,
}

/// How a node differs from placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mismatch {
    /// An engine runs for a replica the leader has not placed on the node.
    Unplaced,
    /// An engine is awake on other GPUs than placement holds for it.
    WrongGpus,
    /// An engine is awake though placement wants it WARM.
    AwakeButWarm,
    /// A replica placed HOT has no engine on its node.
    Missing,
    /// An engine process its agent does not list.
    UnlistedProcess,
    /// An engine process whose agent is gone.
    Orphan,
}

impl Mismatch {
    /// Whether it is an engine nobody placed (a ghost) rather than a
    /// replica stuck short of its placement.
    pub fn is_ghost(self) -> bool {
        matches!(self, Mismatch::Unplaced | Mismatch::UnlistedProcess | Mismatch::Orphan)
    }
}

/// Something the judge found wrong.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Violation {
    /// A GPU's engines hold more than its memory.
    OverCommit {
        /// When, ms into the run.
        at_ms: u64,
        /// The node.
        node: String,
        /// The GPU.
        gpu: u32,
        /// Bytes held there.
        bytes: u64,
        /// The GPU's memory.
        capacity: u64,
        /// The replicas holding them.
        replicas: Vec<String>,
        /// It is placement's books, not the engines.
        placement: bool,
    },
    /// A node differed from placement past the allowance.
    Diverged {
        /// When it was first seen, ms into the run.
        since_ms: u64,
        /// When it passed the allowance.
        at_ms: u64,
        /// The node (`?` for an orphan process).
        node: String,
        /// The replica, or the process id.
        what: String,
        /// How.
        mismatch: Mismatch,
        /// What the node and the leader said.
        detail: String,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::OverCommit { at_ms, node, gpu, bytes, capacity, replicas, placement } => write!(
                f,
                "t={:.1} s: {} over-commit on {node} GPU {gpu}: {:.1} GB held of {:.1} GB by {}",
                *at_ms as f64 / 1e3,
                if *placement { "placement" } else { "engine" },
                *bytes as f64 / 1e9,
                *capacity as f64 / 1e9,
                replicas.join(", ")
            ),
            Violation::Diverged { since_ms, at_ms, node, what, mismatch, detail } => write!(
                f,
                "t={:.1} s: {} on {node}: {what} ({mismatch:?} since t={:.1} s): {detail}",
                *at_ms as f64 / 1e3,
                if mismatch.is_ghost() { "ghost engine" } else { "stuck replica" },
                *since_ms as f64 / 1e3
            ),
        }
    }
}

#[derive(Debug, Clone)]
struct Open {
    since_ms: u64,
    calm_ms: u64,
    reported: bool,
}

/// The judge. See the module doc.
#[derive(Debug, Default)]
pub struct Judge {
    last_at: Option<u64>,
    open: BTreeMap<(String, String, Mismatch), Open>,
    /// Over-commits going on: (node, GPU, placement's books).
    overcommitted: BTreeSet<(String, u32, bool)>,
    /// Samples in which the models were all whole.
    whole: bool,
    /// The calm time of each difference that went within the allowance.
    converged: Vec<u64>,
}

impl Judge {
    /// A judge that has seen nothing.
    pub fn new() -> Judge {
        Judge::default()
    }

    /// The calm time, ms, each difference from placement took to go, of
    /// those that went within the allowance (how long the fleet took to
    /// converge).
    pub fn converged(&self) -> &[u64] {
        &self.converged
    }

    /// Whether every model was whole in the last sample.
    pub fn whole(&self) -> bool {
        self.whole
    }

    /// Judges `s`, taken after every sample given before. Returns what is
    /// newly wrong: an over-commit when it begins (one per episode), a
    /// difference from placement when it passes the allowance.
    pub fn observe(&mut self, s: &Sample) -> Vec<Violation> {
        let mut found = Vec::new();
        let elapsed = self.last_at.map_or(0, |t| s.at_ms.saturating_sub(t));
        self.last_at = Some(s.at_ms);
        self.whole = s.leader.as_ref().is_some_and(|models| whole(models));
        // Over-commit: engines, then placement's books.
        let mut over = BTreeSet::new();
        for n in &s.nodes {
            let mut per_gpu: BTreeMap<u32, (u64, Vec<String>)> = BTreeMap::new();
            for e in &n.engines {
                for (g, b) in &e.holds {
                    let slot = per_gpu.entry(*g).or_default();
                    slot.0 += b;
                    slot.1.push(format!("{}:{}", e.model, e.replica));
                }
            }
            self.over_commit(s.at_ms, &n.name, &n.gpus, per_gpu, false, &mut over, &mut found);
        }
        if let Some(models) = &s.leader {
            for n in &s.nodes {
                let mut per_gpu: BTreeMap<u32, (u64, Vec<String>)> = BTreeMap::new();
                for m in models {
                    for p in m.placed.iter().filter(|p| p.node == n.name) {
                        for (g, b) in &p.gpus {
                            let slot = per_gpu.entry(*g).or_default();
                            slot.0 += b;
                            slot.1.push(format!("{}:{}", m.model, p.replica));
                        }
                    }
                }
                self.over_commit(s.at_ms, &n.name, &n.gpus, per_gpu, true, &mut over, &mut found);
            }
        }
        // An episode on a node not sampled now goes on until it is seen
        // gone.
        let sampled: BTreeSet<&str> = s.nodes.iter().map(|n| n.name.as_str()).collect();
        self.overcommitted.retain(|k| over.contains(k) || !sampled.contains(k.0.as_str()));
        self.overcommitted.extend(over);
        // Differences from placement.
        let now = mismatches(s);
        let redis_and_leader = s.redis_ok && s.leader.is_some() && s.leaders == 1;
        // Nodes whose differences are judged now: sampled ones (a node
        // that is down keeps its open differences, frozen, until seen).
        let mut judged: BTreeSet<String> = sampled.iter().map(|n| n.to_string()).collect();
        judged.insert("?".into());
        let converged = &mut self.converged;
        self.open.retain(|k, open| {
            let keep = now.contains_key(k) || !judged.contains(&k.0);
            if !keep && !open.reported {
                converged.push(open.calm_ms);
            }
            keep
        });
        for (key, detail) in now {
            let open = self.open.entry(key.clone()).or_insert(Open {
                since_ms: s.at_ms,
                calm_ms: 0,
                reported: false,
            });
            let calm = redis_and_leader && (key.0 == "?" || !s.down.contains(&key.0));
            if calm {
                open.calm_ms += elapsed;
            }
            if open.calm_ms > ALLOWANCE_MS && !open.reported {
                open.reported = true;
                found.push(Violation::Diverged {
                    since_ms: open.since_ms,
                    at_ms: s.at_ms,
                    node: key.0.clone(),
                    what: key.1.clone(),
                    mismatch: key.2,
                    detail,
                });
            }
        }
        found
    }

    #[allow(clippy::too_many_arguments)]
    fn over_commit(
        &self,
        at_ms: u64,
        node: &str,
        capacity: &[u64],
        per_gpu: BTreeMap<u32, (u64, Vec<String>)>,
        placement: bool,
        over: &mut BTreeSet<(String, u32, bool)>,
        found: &mut Vec<Violation>,
    ) {
        for (gpu, (bytes, replicas)) in per_gpu {
            let cap = capacity.get(gpu as usize).copied().unwrap_or(0);
            if bytes > cap {
                let key = (node.to_owned(), gpu, placement);
                if !self.overcommitted.contains(&key) {
                    found.push(Violation::OverCommit {
                        at_ms,
                        node: node.to_owned(),
                        gpu,
                        bytes,
                        capacity: cap,
                        replicas,
                        placement,
                    });
                }
                over.insert(key);
            }
        }
    }
}

/// Whether every model has its `min_replicas` placed HOT and ready.
pub fn whole(models: &[ModelSample]) -> bool {
    models.iter().all(|m| {
        let ready = m.placed.iter().filter(|p| p.hot && m.ready.contains(&p.replica)).count();
        ready >= m.min_replicas as usize
    })
}

/// Every difference between the nodes and placement in `s`, keyed by
/// (node, replica or process, kind), with what each side said.
fn mismatches(s: &Sample) -> BTreeMap<(String, String, Mismatch), String> {
    let mut out = BTreeMap::new();
    for pid in &s.orphans {
        out.insert(
            ("?".into(), pid.to_string(), Mismatch::Orphan),
            format!("engine process {pid} outlived its agent"),
        );
    }
    for n in &s.nodes {
        let listed: BTreeSet<u32> = n.engines.iter().filter_map(|e| e.pid).collect();
        for pid in n.processes.iter().filter(|p| !listed.contains(p)) {
            out.insert(
                (n.name.clone(), pid.to_string(), Mismatch::UnlistedProcess),
                format!("engine process {pid} is the agent's child but in no replica of its /status"),
            );
        }
    }
    let Some(models) = &s.leader else { return out };
    let placed: BTreeMap<&str, (&str, &Placed)> = models
        .iter()
        .flat_map(|m| m.placed.iter().map(move |p| (p.replica.as_str(), (m.model.as_str(), p))))
        .collect();
    for n in &s.nodes {
        for e in n.engines.iter().filter(|e| e.has_process) {
            let key = |m| (n.name.clone(), format!("{}:{}", e.model, e.replica), m);
            let here = placed.get(e.replica.as_str()).filter(|(_, p)| p.node == n.name);
            match here {
                None => {
                    let elsewhere = placed.get(e.replica.as_str()).map(|(_, p)| p.node.as_str());
                    out.insert(
                        key(Mismatch::Unplaced),
                        format!(
                            "engine {} (pid {:?}, node wants {}); the leader places it {}",
                            e.state,
                            e.pid,
                            e.want,
                            elsewhere.map_or("nowhere".to_owned(), |o| format!("on {o}"))
                        ),
                    );
                }
                Some((_, p)) if e.state == "awake" && !p.hot => {
                    out.insert(key(Mismatch::AwakeButWarm), "engine awake; placed WARM".to_owned());
                }
                Some((_, p)) if e.state == "awake" && p.gpus.keys().ne(e.holds.keys()) => {
                    out.insert(
                        key(Mismatch::WrongGpus),
                        format!(
                            "engine awake on GPUs {:?}; placed on {:?}",
                            e.holds.keys().collect::<Vec<_>>(),
                            p.gpus.keys().collect::<Vec<_>>()
                        ),
                    );
                }
                Some(_) => {}
            }
        }
        for m in models {
            for p in m.placed.iter().filter(|p| p.hot && p.node == n.name) {
                if !n.engines.iter().any(|e| e.replica == p.replica && e.has_process) {
                    out.insert(
                        (n.name.clone(), format!("{}:{}", m.model, p.replica), Mismatch::Missing),
                        format!(
                            "placed HOT on GPUs {:?}; the node runs no engine for it",
                            p.gpus.keys().collect::<Vec<_>>()
                        ),
                    );
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    fn engine(replica: &str, state: &str, gpus: &[(u32, u64)], pid: u32) -> EngineSample {
        EngineSample {
            replica: replica.into(),
            model: "m/a".into(),
            state: state.into(),
            holds: gpus.iter().copied().collect(),
            pid: Some(pid),
            has_process: true,
            want: "hot".into(),
        }
    }

    fn node(name: &str, engines: Vec<EngineSample>) -> NodeSample {
        let processes = engines.iter().filter_map(|e| e.pid).collect();
        NodeSample { name: name.into(), pid: 1, gpus: vec![80 * GB, 80 * GB], engines, processes }
    }

    fn placed(replica: &str, node: &str, gpus: &[(u32, u64)]) -> Placed {
        Placed { replica: replica.into(), node: node.into(), hot: true, gpus: gpus.iter().copied().collect() }
    }

    fn sample(at_ms: u64, nodes: Vec<NodeSample>, placed: Vec<Placed>) -> Sample {
        let ready = placed.iter().map(|p| p.replica.clone()).collect();
        Sample {
            at_ms,
            redis_ok: true,
            leader: Some(vec![ModelSample { model: "m/a".into(), min_replicas: 1, placed, ready }]),
            leaders: 1,
            leader_id: Some("gw".into()),
            nodes,
            down: Vec::new(),
            orphans: Vec::new(),
        }
    }

    #[test]
    fn a_fleet_matching_placement_is_clean_and_whole() {
        let mut j = Judge::new();
        for t in 0..100 {
            let s = sample(
                t * 500,
                vec![node("n1", vec![engine("r1", "awake", &[(0, 60 * GB)], 10)])],
                vec![placed("r1", "n1", &[(0, 60 * GB)])],
            );
            assert_eq!(j.observe(&s), vec![]);
            assert!(j.whole());
        }
    }

    #[test]
    fn over_commit_is_counted_once_per_episode() {
        let mut j = Judge::new();
        let two = || {
            node(
                "n1",
                vec![
                    engine("r1", "awake", &[(0, 60 * GB)], 10),
                    engine("r2", "starting", &[(0, 60 * GB)], 11),
                ],
            )
        };
        let ps = || vec![placed("r1", "n1", &[(0, 60 * GB)]), placed("r2", "n1", &[(1, 60 * GB)])];
        let v = j.observe(&sample(0, vec![two()], ps()));
        assert!(matches!(&v[..], [Violation::OverCommit { gpu: 0, placement: false, .. }]), "{v:?}");
        assert!(j.observe(&sample(500, vec![two()], ps())).is_empty());
        let one = node("n1", vec![engine("r1", "awake", &[(0, 60 * GB)], 10)]);
        assert!(j.observe(&sample(1000, vec![one], ps())).is_empty());
        assert_eq!(j.observe(&sample(1500, vec![two()], ps())).len(), 1);
    }

    #[test]
    fn placement_books_are_held_to_the_same_bound() {
        let mut j = Judge::new();
        let s = sample(
            0,
            vec![node("n1", vec![])],
            vec![placed("r1", "n1", &[(1, 60 * GB)]), placed("r2", "n1", &[(1, 30 * GB)])],
        );
        let v = j.observe(&s);
        assert!(
            v.iter().any(|v| matches!(v, Violation::OverCommit { gpu: 1, placement: true, .. })),
            "{v:?}"
        );
    }

    #[test]
    fn an_unplaced_engine_is_a_ghost_only_after_the_calm_allowance() {
        let mut j = Judge::new();
        let ghosted = |t| {
            sample(
                t,
                vec![node(
                    "n1",
                    vec![
                        engine("r1", "awake", &[(0, 10 * GB)], 10),
                        engine("old", "awake", &[(1, 10 * GB)], 11),
                    ],
                )],
                vec![placed("r1", "n1", &[(0, 10 * GB)])],
            )
        };
        let mut t = 0;
        while t <= ALLOWANCE_MS {
            assert!(j.observe(&ghosted(t)).is_empty(), "at {t}");
            t += 500;
        }
        let v = j.observe(&ghosted(t));
        assert!(matches!(&v[..], [Violation::Diverged { mismatch: Mismatch::Unplaced, .. }]), "{v:?}");
        // Reported once.
        assert!(j.observe(&ghosted(t + 500)).is_empty());
    }

    #[test]
    fn time_without_redis_a_leader_or_the_agent_is_not_calm() {
        let mut j = Judge::new();
        let mut t = 0;
        let ghosted = |t, redis_ok, down: bool| {
            let mut s =
                sample(t, vec![node("n1", vec![engine("old", "awake", &[(1, 10 * GB)], 11)])], vec![]);
            s.redis_ok = redis_ok;
            if down {
                s.down = vec!["n1".into()];
            }
            s
        };
        // A minute with Redis down, then a minute with the agent stopped:
        // no calm time passes.
        while t < 60_000 {
            assert!(j.observe(&ghosted(t, false, false)).is_empty());
            t += 500;
        }
        while t < 120_000 {
            assert!(j.observe(&ghosted(t, true, true)).is_empty());
            t += 500;
        }
        let mut found = Vec::new();
        while found.is_empty() {
            found = j.observe(&ghosted(t, true, false));
            t += 500;
        }
        assert!(t > 120_000 + ALLOWANCE_MS, "{t}");
    }

    #[test]
    fn a_difference_that_clears_starts_again_from_zero() {
        let mut j = Judge::new();
        let missing = |t| sample(t, vec![node("n1", vec![])], vec![placed("r1", "n1", &[(0, 10 * GB)])]);
        let fine = |t| {
            sample(
                t,
                vec![node("n1", vec![engine("r1", "awake", &[(0, 10 * GB)], 10)])],
                vec![placed("r1", "n1", &[(0, 10 * GB)])],
            )
        };
        let mut t = 0;
        for _ in 0..10 {
            for _ in 0..20 {
                assert!(j.observe(&missing(t)).is_empty());
                t += 500;
            }
            assert!(j.observe(&fine(t)).is_empty());
            t += 500;
        }
        assert!(j.whole());
    }

    #[test]
    fn unlisted_and_orphaned_processes_are_ghosts() {
        let mut j = Judge::new();
        let s = |t| {
            let mut n = node("n1", vec![engine("r1", "awake", &[(0, 10 * GB)], 10)]);
            n.processes.push(99);
            let mut s = sample(t, vec![n], vec![placed("r1", "n1", &[(0, 10 * GB)])]);
            s.orphans = vec![77];
            s
        };
        let mut t = 0;
        let mut found = Vec::new();
        while t <= ALLOWANCE_MS + 1_000 {
            found.extend(j.observe(&s(t)));
            t += 500;
        }
        let kinds: BTreeSet<Mismatch> = found
            .iter()
            .filter_map(|v| match v {
                Violation::Diverged { mismatch, .. } => Some(*mismatch),
                _ => None,
            })
            .collect();
        assert_eq!(kinds, BTreeSet::from([Mismatch::UnlistedProcess, Mismatch::Orphan]));
    }

    #[test]
    fn wrong_gpus_and_awake_when_warm_are_differences() {
        let mut j = Judge::new();
        let mut warm = placed("r2", "n1", &[]);
        warm.hot = false;
        let s = |t| {
            sample(
                t,
                vec![node(
                    "n1",
                    vec![
                        engine("r1", "awake", &[(1, 10 * GB)], 10),
                        engine("r2", "awake", &[(0, 10 * GB)], 11),
                    ],
                )],
                vec![placed("r1", "n1", &[(0, 10 * GB)]), warm.clone()],
            )
        };
        let mut found = Vec::new();
        let mut t = 0;
        while t <= ALLOWANCE_MS + 1_000 {
            found.extend(j.observe(&s(t)));
            t += 500;
        }
        let kinds: BTreeSet<Mismatch> = found
            .iter()
            .filter_map(|v| match v {
                Violation::Diverged { mismatch, .. } => Some(*mismatch),
                _ => None,
            })
            .collect();
        assert_eq!(kinds, BTreeSet::from([Mismatch::WrongGpus, Mismatch::AwakeButWarm]));
    }
}
