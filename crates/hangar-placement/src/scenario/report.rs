//! [`PlanReport`]: what a plan decided, as JSON or as tables for a terminal.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use hangar_core::{ByteSize, Millis};
use serde::Serialize;

use super::Scenario;
use crate::cluster::Cluster;
use crate::delta::DeploymentDelta;
use crate::deployment::NodeId;
use crate::node::Gpu;
use crate::outcome::{DeployOutcome, Eviction};

/// One node after the plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeSummary {
    /// The node.
    pub id: NodeId,
    /// Its GPUs.
    pub gpus: Vec<Gpu>,
    /// Hot replicas on it.
    pub hot: usize,
    /// Warm replicas in its cache.
    pub warm: usize,
    /// Cache bytes in use.
    pub cache_used: u64,
    /// Cache budget.
    pub cache_budget: u64,
}

/// The result of a plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanReport {
    /// The seed used.
    pub seed: u64,
    /// The instant planned at.
    pub now_ms: Millis,
    /// What the explicit evictions did.
    pub evictions: Vec<Eviction>,
    /// What applying the schedule did, when the scenario has one.
    pub schedule: Option<DeployOutcome>,
    /// What the requests did.
    pub deploy: DeployOutcome,
    /// The steps from the state before to the state after, in apply order.
    pub delta: DeploymentDelta,
    /// Every node after the plan.
    pub nodes: Vec<NodeSummary>,
}

impl PlanReport {
    pub(super) fn new(
        scenario: &Scenario,
        cluster: &Cluster,
        evictions: Vec<Eviction>,
        schedule: Option<DeployOutcome>,
        deploy: DeployOutcome,
        delta: DeploymentDelta,
    ) -> Self {
        let nodes = cluster
            .nodes()
            .iter()
            .map(|n| NodeSummary {
                id: n.id().clone(),
                gpus: n.gpus().to_vec(),
                hot: n.hot().values().map(BTreeMap::len).sum(),
                warm: n.warm().values().map(BTreeMap::len).sum(),
                cache_used: n.cache_used(),
                cache_budget: n.cache_budget(),
            })
            .collect();
        Self { seed: scenario.seed, now_ms: scenario.now_ms, evictions, schedule, deploy, delta, nodes }
    }

    /// Every eviction in the order it happened: explicit, schedule, requests.
    pub fn all_evictions(&self) -> impl Iterator<Item = &Eviction> {
        self.evictions
            .iter()
            .chain(self.schedule.iter().flat_map(|s| &s.evictions))
            .chain(&self.deploy.evictions)
    }

    /// The report as aligned text tables: decisions, evictions, delta, nodes.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "plan at now_ms={} seed={}", self.now_ms, self.seed);

        let mut decisions =
            Table::new(&["STEP", "MODEL", "REPLICA", "NODE", "LEVEL", "GPUS", "EVICTED", "NOTE"]);
        let steps = self.schedule.iter().map(|s| ("schedule", s)).chain([("request", &self.deploy)]);
        for (step, outcome) in steps {
            for m in &outcome.models {
                for r in &m.replicas {
                    decisions.row(vec![
                        step.to_owned(),
                        m.model_key.to_string(),
                        r.replica_id.map_or_else(|| "-".into(), |id| id.to_string()),
                        r.node.as_ref().map_or_else(|| "-".into(), ToString::to_string),
                        r.level.to_string(),
                        gpus(&r.gpu_bytes_by_gpu),
                        if r.eviction_cost.count == 0 {
                            "-".into()
                        } else {
                            format!("{} ({})", r.eviction_cost.count, ByteSize::new(r.eviction_cost.bytes))
                        },
                        match (&r.reason, m.dedicated, r.swap) {
                            (Some(reason), _, _) => reason.to_string(),
                            (None, true, true) => "dedicated, swap".into(),
                            (None, true, false) => "dedicated".into(),
                            (None, false, true) => "swap".into(),
                            (None, false, false) => String::new(),
                        },
                    ]);
                }
            }
        }
        section(&mut out, "decisions", decisions);

        let mut evictions = Table::new(&["MODEL", "REPLICA", "NODE", "FROM", "TO", "CAUSE"]);
        for e in self.all_evictions() {
            evictions.row(vec![
                e.model_key.to_string(),
                e.replica_id.to_string(),
                e.node.to_string(),
                e.from.to_string(),
                e.to.to_string(),
                e.cause.to_string(),
            ]);
        }
        section(&mut out, "evictions", evictions);

        let mut delta = Table::new(&["#", "NODE", "ACTION", "REPLICA", "GPUS"]);
        for (i, step) in self.delta.steps().enumerate() {
            let d = step.deployment;
            delta.row(vec![
                (i + 1).to_string(),
                d.node.to_string(),
                serde_json::to_value(step.action)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default(),
                d.name(),
                gpus(&d.gpu_bytes_by_gpu),
            ]);
        }
        section(&mut out, "delta (apply in order)", delta);

        let mut nodes =
            Table::new(&["NODE", "GPU", "KIND", "FREE", "TOTAL", "TENANTS", "HOT", "WARM", "CACHE"]);
        for n in &self.nodes {
            if n.gpus.is_empty() {
                nodes.row(vec![n.id.to_string(), "-".into(), "-".into(), "-".into(), "-".into(), "-".into()]);
            }
            for (i, g) in n.gpus.iter().enumerate() {
                let first = i == 0;
                nodes.row(vec![
                    if first { n.id.to_string() } else { String::new() },
                    g.index.to_string(),
                    g.kind.clone(),
                    ByteSize::new(g.free_bytes).to_string(),
                    ByteSize::new(g.total_bytes).to_string(),
                    g.tenants.to_string(),
                    if first { n.hot.to_string() } else { String::new() },
                    if first { n.warm.to_string() } else { String::new() },
                    if first {
                        format!("{} / {}", ByteSize::new(n.cache_used), ByteSize::new(n.cache_budget))
                    } else {
                        String::new()
                    },
                ]);
            }
        }
        section(&mut out, "nodes after", nodes);
        out
    }
}

/// `g0 60.0GB`, or `g0,g1 @80.0GB each` for several GPUs.
fn gpus(map: &BTreeMap<u32, u64>) -> String {
    let ids = map.keys().map(|g| format!("g{g}")).collect::<Vec<_>>().join(",");
    match map.values().next() {
        None => "-".into(),
        Some(&b) if map.len() == 1 => format!("{ids} {}", ByteSize::new(b)),
        Some(&b) if map.values().all(|&v| v == b) => format!("{ids} @{} each", ByteSize::new(b)),
        Some(_) => {
            map.iter().map(|(g, b)| format!("g{g} {}", ByteSize::new(*b))).collect::<Vec<_>>().join(", ")
        }
    }
}

fn section(out: &mut String, title: &str, table: Table) {
    let _ = writeln!(out, "\n{title}:");
    if table.rows.is_empty() {
        out.push_str("  (none)\n");
    } else {
        out.push_str(&table.render());
    }
}

/// Left-aligned columns separated by two spaces.
struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(header: &[&str]) -> Self {
        Self { header: header.iter().map(|h| (*h).to_owned()).collect(), rows: Vec::new() }
    }

    fn row(&mut self, mut cells: Vec<String>) {
        cells.resize(self.header.len(), String::new());
        self.rows.push(cells);
    }

    fn render(&self) -> String {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, c) in widths.iter_mut().zip(row) {
                *w = (*w).max(c.chars().count());
            }
        }
        let mut out = String::new();
        for row in std::iter::once(&self.header).chain(&self.rows) {
            let mut line = String::from("  ");
            for (c, w) in row.iter().zip(&widths) {
                let _ = write!(line, "{c:<w$}  ");
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}
