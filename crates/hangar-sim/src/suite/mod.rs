//! The trace suite (`hangar sim suite`): the same scaling policies on
//! traffic of every shape — public traces mapped onto several models,
//! steady, diurnal and bursty synthetic traces, a model that loads for
//! minutes, more models than GPUs — each judged against its
//! [hindsight bound](crate::bound) and against the best setting of its
//! peers rather than their defaults.
//!
//! A case ([`Case`]) names its fleet file and its trace. For each, the
//! suite runs `hangar`, `replicate` and `workers-ai` with their defaults
//! and, with a sweep, each peer over its main knob ([`POLICIES`],
//! [`crate::compare::runs`]); [`case_report`] puts the runs together with
//! the bound into a [`Comparison`], and [`SuiteReport::table`] prints
//! every case. The driver (the binary) carries the runs out — in any
//! order, on any number of threads — and hands them back in the order
//! `runs` gave them, so the report is the same bytes every time.

mod cases;

use std::fmt::Write as _;

use hangar_scaler::ScalingConfig;
use serde::Serialize;

pub use cases::{
    by_prefix_hash, cases, merge_by_row_hash, Case, FleetFile, PublicTraces, Source, AZURE_CODE, AZURE_CONV,
    MOONCAKE,
};

use crate::bound::HindsightBound;
use crate::compare::{self, pct, times, Comparison, RunSpec, PEERS};
use crate::fleet::{FleetConfig, FleetReport};

/// Why a suite case cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SuiteError {
    /// Its synthetic trace cannot be generated.
    #[error("case {case}: {why}")]
    Trace {
        /// The case.
        case: &'static str,
        /// What the generator refused.
        why: String,
    },
}

/// The policies every case runs with their defaults, in the table's
/// order.
pub fn policies() -> [ScalingConfig; 3] {
    [
        ScalingConfig::Hangar(Default::default()),
        ScalingConfig::Replicate(Default::default()),
        ScalingConfig::WorkersAi(Default::default()),
    ]
}

/// The policies of [`policies`], by name.
pub const POLICIES: [&str; 3] = ["hangar", "replicate", "workers-ai"];

/// The runs of a case: [`policies`] with their defaults, then (with
/// `sweep`) each peer over its knob.
pub fn runs(fleet: &FleetConfig, sweep: bool) -> Vec<RunSpec> {
    compare::runs(fleet, &policies(), &[], sweep)
}

/// One case's outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CaseReport {
    /// The case.
    pub name: String,
    /// What it is.
    pub title: String,
    /// Its fleet file.
    pub fleet_file: String,
    /// Where its trace came from.
    pub trace: String,
    /// Kept out of tuning.
    pub held_out: bool,
    /// The runs, the bound, the frontiers and the verdict.
    #[serde(flatten)]
    pub comparison: Comparison,
}

/// Puts a case's runs (in [`runs`]' order) together with its bound.
pub fn case_report(case: &Case, bound: HindsightBound, runs: &[(RunSpec, FleetReport)]) -> CaseReport {
    CaseReport {
        name: case.name.to_owned(),
        title: case.title.to_owned(),
        fleet_file: case.fleet_file.path.to_owned(),
        trace: case.describe(),
        held_out: case.held_out,
        comparison: Comparison::new(Some(bound), runs),
    }
}

/// The whole suite's outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SuiteReport {
    /// The cases that ran, in suite order.
    pub cases: Vec<CaseReport>,
    /// Cases skipped: the case and why (the trace files it lacks).
    pub skipped: Vec<(String, String)>,
}

impl SuiteReport {
    /// The report as Markdown: one summary table — per case the bound,
    /// each policy with its defaults (SLO attainment, GPU-hours, × the
    /// bound) and each peer's cheapest setting at `hangar`'s attainment —
    /// then the cases skipped, then each case in full with every run, its
    /// frontiers and its verdict.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = write!(out, "| case | bound GPU-h |");
        for p in POLICIES {
            let _ = write!(out, " {p}: SLO, GPU-h, × bound |");
        }
        for p in PEERS {
            let _ = write!(out, " cheapest {p} at ≥ hangar's SLO |");
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "|---|---|{}", "---|".repeat(POLICIES.len() + PEERS.len()));
        for c in &self.cases {
            let cmp = &c.comparison;
            let _ = write!(
                out,
                "| {}{} | {} |",
                c.name,
                if c.held_out { " (held out)" } else { "" },
                cmp.bound.as_ref().and_then(|b| b.gpu_hours).map_or("–".into(), |b| format!("{b:.3}")),
            );
            for p in POLICIES {
                let cell = cmp.runs.iter().find(|r| r.family == p && r.default).map_or("–".into(), |r| {
                    format!("{}, {:.3}, {}", pct(r.total.slo_attainment), r.gpu_hours, times(r.times_bound))
                });
                let _ = write!(out, " {cell} |");
            }
            for p in PEERS {
                let cell = (cmp.verdict.iter().flat_map(|v| &v.peers)).find(|b| b.family == p).map_or(
                    "–".into(),
                    |b| match &b.at_hangars_slo {
                        Some(pt) => format!(
                            "{}: {}, {:.3} (hangar {})",
                            pt.label,
                            pct(pt.attainment),
                            pt.gpu_hours,
                            times(b.hangar_over_it)
                        ),
                        None => format!("none (highest {})", pct(b.highest.attainment)),
                    },
                );
                let _ = write!(out, " {cell} |");
            }
            let _ = writeln!(out);
        }
        for (name, why) in &self.skipped {
            let _ = writeln!(out, "\n{name}: skipped, {why}");
        }
        for c in &self.cases {
            let cmp = &c.comparison;
            let _ = writeln!(out, "\n### {} — {}\n", c.name, c.title);
            let _ = writeln!(
                out,
                "{} on `{}`{}\n",
                c.trace,
                c.fleet_file,
                if c.held_out { ", held out of tuning" } else { "" }
            );
            let _ = writeln!(
                out,
                "| run | SLO | TTFT p99 ms | GPU-h | goodput / GPU-h | starts | decisions | reversals | × bound | busy × bound | × bound at its SLO |"
            );
            let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|");
            for r in &cmp.runs {
                let t = &r.total;
                let _ = writeln!(
                    out,
                    "| {} | {} | {:.0} | {:.3} | {:.0} | {} | {} | {} | {} | {} | {} |",
                    r.label,
                    pct(t.slo_attainment),
                    t.ttft_ms.p99,
                    r.gpu_hours,
                    t.goodput_per_gpu_hour,
                    t.cold_starts.cold + t.cold_starts.warm,
                    t.decisions,
                    t.reversals,
                    times(r.times_bound),
                    times(r.busy_times_bound),
                    times(r.times_bound_at_its_slo),
                );
            }
            let _ = writeln!(out);
            for line in cmp.summary().lines() {
                // Markdown: a hard break after each line.
                let _ = writeln!(out, "{line}  ");
            }
        }
        out
    }
}
