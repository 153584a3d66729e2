//! Scaling policies compared on one fleet and trace (`hangar sim compare`,
//! and each case of the [trace suite](crate::suite)): each run's GPU-hours
//! as a multiple of the trace's [hindsight bound](crate::bound), each
//! peer's Pareto frontier over its main knob, and `hangar`'s default
//! judged against those frontiers rather than against one default point.
//!
//! Routing policies are compared the same way: given routers, [`runs`]
//! runs each scaling policy under each router (every model routing with
//! it), labelled `policy/router` — how `adapter` routing is held against
//! round robin on a trace of many LoRA adapters (docs/adapters.md).
//!
//! [`runs`] lists the fleet runs — the policies asked for with their
//! defaults, then (with a sweep) each peer over its knob: `replicate`'s
//! `target_backlog_per_replica` ([`REPLICATE_TARGETS`], shares of each
//! model's `concurrency`) and `workers-ai`'s utilization deadband
//! ([`WORKERS_AI_DEADBANDS`]). The driver carries them out, in any order
//! and on any number of threads, and hands the reports back in [`runs`]'
//! order to [`Comparison::new`], so the same inputs give the same
//! comparison, byte for byte.
//!
//! ```
//! use hangar_scaler::ScalingConfig;
//! use hangar_sim::compare::{runs, Comparison};
//! use hangar_sim::fleet::{simulate_fleet, FleetConfig, FleetOptions};
//!
//! let fleet = FleetConfig::parse(
//!     "[[nodes]]\nid = \"gpu\"\ngpus = 1\ngpu_memory = \"80GB\"\ncpu_cache = \"64GB\"\n\
//!      [[models]]\nkey = \"m/a\"\nsize = \"16GB\"\nmax_replicas = 1\n",
//!     "fleet.toml",
//! )
//! .unwrap();
//! let trace = hangar_sim::trace::read(
//!     "{\"timestamp\": 0, \"input_length\": 100, \"output_length\": 8}",
//!     "one.jsonl",
//! )
//! .unwrap();
//! let specs = runs(&fleet, &[ScalingConfig::default()], &[], false);
//! let done: Vec<_> = specs
//!     .into_iter()
//!     .map(|spec| {
//!         let report = simulate_fleet(&trace, &spec.fleet, &FleetOptions::default(), |_, _| {}).unwrap();
//!         (spec, report)
//!     })
//!     .collect();
//! let comparison = Comparison::new(None, &done);
//! assert_eq!(comparison.runs[0].label, "hangar");
//! ```

use std::fmt::Write as _;

use hangar_router::RouterPolicy;
use hangar_scaler::{ReplicateSettings, ScalingConfig, WorkersAiSettings};
use serde::Serialize;

use crate::bound::HindsightBound;
use crate::fleet::{FleetConfig, FleetModel, FleetReport, ModelReport};

/// `replicate`'s `target_backlog_per_replica` in a sweep, as shares of
/// each model's `concurrency` (1: its default). Lower targets add
/// replicas sooner: more GPU-hours, more requests in time.
pub const REPLICATE_TARGETS: [f64; 5] = [0.125, 0.25, 0.5, 1.0, 2.0];

/// `workers-ai`'s deadbands in a sweep, `(min_utilization,
/// max_utilization)` (`(0.3, 0.8)`: its default). Lower bands run the
/// replicas cooler.
pub const WORKERS_AI_DEADBANDS: [(f64, f64); 5] =
    [(0.05, 0.2), (0.1, 0.35), (0.2, 0.5), (0.3, 0.8), (0.5, 0.9)];

/// The policies whose knob a sweep turns, in the order reports list them.
pub const PEERS: [&str; 2] = ["replicate", "workers-ai"];

/// One fleet run of a comparison.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// How reports name it: the policy with its defaults (`hangar`), or
    /// the policy at a knob's value (`replicate@0.5`: a target backlog of
    /// half of each model's `concurrency`; `workers-ai@0.1-0.35`: that
    /// utilization deadband). One word, so a fixed-width table splits.
    pub label: String,
    /// The policy, as the config spells it.
    pub family: &'static str,
    /// The routing policy every model runs, when the comparison sets one.
    pub router: Option<RouterPolicy>,
    /// Whether it runs the policy with its defaults.
    pub default: bool,
    /// The fleet, every model's `scaling` set for the run.
    pub fleet: FleetConfig,
}

/// The runs comparing `policies` on `fleet`: each with its defaults, in
/// the order given, then — with `sweep` — each peer among them (see
/// [`PEERS`]) at the other values of its knob. With `routers`, each
/// policy's default runs once per router instead (labelled
/// `policy/router`), every model routing with it; a sweep then is not
/// run (its frontiers would mix routers).
pub fn runs(
    fleet: &FleetConfig,
    policies: &[ScalingConfig],
    routers: &[RouterPolicy],
    sweep: bool,
) -> Vec<RunSpec> {
    let with = |scaling: &dyn Fn(&FleetModel) -> ScalingConfig| {
        let mut f = fleet.clone();
        for m in &mut f.models {
            m.scaling = Some(scaling(m));
        }
        f
    };
    if !routers.is_empty() {
        return (policies.iter())
            .flat_map(|p| routers.iter().map(move |r| (p, *r)))
            .map(|(p, router)| {
                let mut fleet = with(&|_| p.clone());
                fleet.models.iter_mut().for_each(|m| m.router = router);
                RunSpec {
                    label: format!("{}/{router}", p.name()),
                    family: p.name(),
                    router: Some(router),
                    default: true,
                    fleet,
                }
            })
            .collect();
    }
    let mut out: Vec<RunSpec> = policies
        .iter()
        .map(|p| RunSpec {
            label: p.name().to_owned(),
            family: p.name(),
            router: None,
            default: true,
            fleet: with(&|_| p.clone()),
        })
        .collect();
    if !sweep {
        return out;
    }
    let asked = |family: &str| policies.iter().any(|p| p.name() == family);
    if asked("replicate") {
        out.extend(REPLICATE_TARGETS.into_iter().filter(|&s| s != 1.0).map(|share| RunSpec {
            label: format!("replicate@{share}"),
            family: "replicate",
            router: None,
            default: false,
            fleet: with(&|m| {
                ScalingConfig::Replicate(ReplicateSettings {
                    target_backlog_per_replica: Some(share * f64::from(m.concurrency)),
                    ..ReplicateSettings::default()
                })
            }),
        }));
    }
    if asked("workers-ai") {
        let default = WorkersAiSettings::default();
        let band = (default.min_utilization, default.max_utilization);
        out.extend(WORKERS_AI_DEADBANDS.into_iter().filter(|&b| b != band).map(|(min, max)| RunSpec {
            label: format!("workers-ai@{min}-{max}"),
            family: "workers-ai",
            router: None,
            default: false,
            fleet: with(&|_| {
                ScalingConfig::WorkersAi(WorkersAiSettings {
                    min_utilization: min,
                    max_utilization: max,
                    ..WorkersAiSettings::default()
                })
            }),
        }));
    }
    out
}

/// One run's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunResult {
    /// The run's label ([`RunSpec::label`]).
    pub label: String,
    /// The policy.
    pub family: String,
    /// The routing policy every model ran, when the comparison set one.
    pub router: Option<RouterPolicy>,
    /// Whether it ran the policy's defaults.
    pub default: bool,
    /// The whole fleet's figures.
    pub total: ModelReport,
    /// Each model's, in fleet order.
    pub models: Vec<ModelReport>,
    /// GPU-hours.
    pub gpu_hours: f64,
    /// GPU-hours over the bound at its attainment (99 %); `None` without a
    /// bound or when no schedule reaches it. Below 1 only for a run that
    /// answered fewer requests in time.
    pub times_bound: Option<f64>,
    /// GPU-hours over the bound at the run's own SLO attainment
    /// ([`HindsightBound::at`]): never below 1.
    pub times_bound_at_its_slo: Option<f64>,
    /// The GPU-hours its replicas spent running requests, over the bound
    /// at 99 %: the part of `times_bound` no change of *when* replicas are
    /// up could save while requests are served as they come (the bound
    /// may start them as late as their deadlines, on an engine with no
    /// other work); what is above it is loading and idling.
    pub busy_times_bound: Option<f64>,
}

/// A run as a point of GPU-hours against SLO attainment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    /// The run.
    pub label: String,
    /// SLO attainment (0–1).
    pub attainment: f64,
    /// GPU-hours.
    pub gpu_hours: f64,
}

/// A policy's Pareto frontier: the runs of it that no other run of it
/// beats on both counts, by GPU-hours (and so by attainment).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Frontier {
    /// The policy.
    pub family: String,
    /// Its points, cheapest first.
    pub points: Vec<Point>,
}

/// A peer's frontier at `hangar`'s attainment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PeerBest {
    /// The peer.
    pub family: String,
    /// Its cheapest run answering at least `hangar`'s share in time (a
    /// point of its frontier); `None` when none does.
    pub at_hangars_slo: Option<Point>,
    /// `hangar`'s GPU-hours over that run's: above 1, the peer reaches
    /// `hangar`'s attainment for less.
    pub hangar_over_it: Option<f64>,
    /// Its run with the highest attainment (the cheapest among equals).
    pub highest: Point,
}

/// `hangar`'s default against the peers' frontiers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    /// `hangar` with its defaults.
    pub hangar: Point,
    /// Its GPU-hours over the bound at 99 %.
    pub times_bound: Option<f64>,
    /// Per peer that ran, in [`PEERS`] order.
    pub peers: Vec<PeerBest>,
}

/// Policies compared on one fleet and trace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    /// The trace's hindsight bound on the fleet, when computed.
    pub bound: Option<HindsightBound>,
    /// Every run, in [`runs`]' order.
    pub runs: Vec<RunResult>,
    /// Each peer's frontier, in [`PEERS`] order (peers that ran).
    pub frontiers: Vec<Frontier>,
    /// `hangar`'s default judged against the frontiers, when both ran.
    pub verdict: Option<Verdict>,
}

impl Comparison {
    /// Puts the runs (in [`runs`]' order, each with its report) together
    /// with the bound.
    pub fn new(bound: Option<HindsightBound>, runs: &[(RunSpec, FleetReport)]) -> Self {
        let runs: Vec<RunResult> = runs
            .iter()
            .map(|(spec, report)| {
                let gpu_hours = report.total.gpu_seconds.total / 3600.0;
                let busy_hours = report.total.gpu_seconds.busy / 3600.0;
                let ratio = |hours: f64, b: Option<f64>| b.filter(|b| *b > 0.0).map(|b| hours / b);
                let over = |b| ratio(gpu_hours, b);
                RunResult {
                    label: spec.label.clone(),
                    family: spec.family.to_owned(),
                    router: spec.router,
                    default: spec.default,
                    total: report.total.clone(),
                    models: report.models.clone(),
                    gpu_hours,
                    times_bound: over(bound.as_ref().and_then(|b| b.gpu_hours)),
                    times_bound_at_its_slo: over(
                        bound.as_ref().and_then(|b| b.at(report.total.slo_attainment)),
                    ),
                    busy_times_bound: ratio(busy_hours, bound.as_ref().and_then(|b| b.gpu_hours)),
                }
            })
            .collect();
        let frontiers: Vec<Frontier> = PEERS
            .into_iter()
            .map(|name| Frontier {
                family: name.to_owned(),
                points: pareto(runs.iter().filter(|r| r.family == name).map(RunResult::point).collect()),
            })
            .filter(|f| !f.points.is_empty())
            .collect();
        let verdict = runs.iter().find(|r| r.family == "hangar" && r.default).map(|hangar| {
            let at = hangar.total.slo_attainment;
            let peers = frontiers
                .iter()
                .map(|f| {
                    let best = f.points.iter().find(|p| p.attainment >= at).cloned();
                    PeerBest {
                        family: f.family.clone(),
                        hangar_over_it: best
                            .as_ref()
                            .filter(|b| b.gpu_hours > 0.0)
                            .map(|b| hangar.gpu_hours / b.gpu_hours),
                        at_hangars_slo: best,
                        highest: f.points.last().expect("a frontier has a point").clone(),
                    }
                })
                .collect();
            Verdict { hangar: hangar.point(), times_bound: hangar.times_bound, peers }
        });
        Comparison { bound, runs, frontiers, verdict }
    }

    /// The bound, the frontiers and the verdict, a line each, as the
    /// reports print them under their table of runs.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        match &self.bound {
            Some(b) => {
                let _ = writeln!(
                    out,
                    "hindsight bound: {} GPU-h at {} of requests in time ({:.3} answering every one{})",
                    b.gpu_hours.map_or("– (no schedule reaches it)".into(), |g| format!("{g:.3}")),
                    pct(b.attainment),
                    b.gpu_hours_all,
                    if b.exact { "" } else { "; a search ran over its budget, its part is weaker" },
                );
            }
            None => {
                let _ = writeln!(out, "hindsight bound: not computed");
            }
        }
        for f in &self.frontiers {
            let points: Vec<String> = f.points.iter().map(Point::brief).collect();
            let _ = writeln!(out, "{} frontier: {}", f.family, points.join(" · "));
        }
        if let Some(v) = &self.verdict {
            let _ = writeln!(out, "hangar: {}, {} the bound", v.hangar.brief(), times(v.times_bound));
            for p in &v.peers {
                let _ = writeln!(out, "  best {} at ≥ {}: {}", p.family, pct(v.hangar.attainment), p.cell());
            }
        }
        out
    }
}

impl RunResult {
    fn point(&self) -> Point {
        Point { label: self.label.clone(), attainment: self.total.slo_attainment, gpu_hours: self.gpu_hours }
    }
}

impl Point {
    /// `label (97.25 %, 1.234 GPU-h)`: two decimals, so that points of a
    /// frontier, whose attainments differ, read differently.
    pub fn brief(&self) -> String {
        format!("{} ({:.2} %, {:.3} GPU-h)", self.label, self.attainment * 100.0, self.gpu_hours)
    }
}

impl PeerBest {
    /// The peer's cheapest run at `hangar`'s attainment and `hangar`'s
    /// GPU-hours over it, or that none reaches it and its highest.
    pub fn cell(&self) -> String {
        match &self.at_hangars_slo {
            Some(p) => format!("{}; hangar uses {} its GPU-h", p.brief(), times(self.hangar_over_it)),
            None => format!("none (its highest: {})", self.highest.brief()),
        }
    }
}

/// The points no other point beats on both counts (at most the GPU-hours
/// and at least the attainment, one of them strictly), by GPU-hours; of
/// points equal on both, the first.
pub fn pareto(mut points: Vec<Point>) -> Vec<Point> {
    points.sort_by(|a, b| a.gpu_hours.total_cmp(&b.gpu_hours).then(b.attainment.total_cmp(&a.attainment)));
    let mut out: Vec<Point> = Vec::new();
    for p in points {
        if out.last().is_none_or(|best| p.attainment > best.attainment) {
            out.push(p);
        }
    }
    out
}

/// A share as a percentage, one decimal.
pub(crate) fn pct(x: f64) -> String {
    format!("{:.1} %", x * 100.0)
}

/// A multiple, two decimals (`1.25×`), `–` for none.
pub(crate) fn times(x: Option<f64>) -> String {
    x.map_or("–".into(), |x| format!("{x:.2}×"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(label: &str, attainment: f64, gpu_hours: f64) -> Point {
        Point { label: label.into(), attainment, gpu_hours }
    }

    #[test]
    fn the_frontier_keeps_what_nothing_beats_on_both_counts() {
        let points = vec![
            p("a", 0.90, 1.0),
            p("b", 0.95, 2.0),
            p("c", 0.93, 2.5), // beaten by b
            p("d", 0.99, 3.0),
            p("e", 0.90, 1.5), // beaten by a
            p("f", 0.99, 3.0), // a tie with d: one is kept
            p("g", 0.80, 1.0), // beaten by a at the same cost
        ];
        let labels: Vec<String> = pareto(points).into_iter().map(|p| p.label).collect();
        assert_eq!(labels, ["a", "b", "d"]);
    }

    #[test]
    fn each_peer_is_swept_over_its_knob_with_its_default_among_the_points() {
        let fleet = crate::suite::cases(0, 0.01).into_iter().find(|c| c.name == "steady").unwrap().fleet();
        let three = [
            ScalingConfig::default(),
            ScalingConfig::Replicate(Default::default()),
            ScalingConfig::WorkersAi(Default::default()),
        ];
        let all = runs(&fleet, &three, &[], true);
        assert_eq!(all.len(), 1 + REPLICATE_TARGETS.len() + WORKERS_AI_DEADBANDS.len());
        assert_eq!(all.iter().filter(|r| r.default).count(), 3);
        let half = all.iter().find(|r| r.label == "replicate@0.5").unwrap();
        let Some(ScalingConfig::Replicate(s)) = &half.fleet.models[0].scaling else { panic!() };
        assert_eq!(s.target_backlog_per_replica, Some(8.0), "half of 16 permits");
        assert!(all.iter().any(|r| r.label == "workers-ai@0.1-0.35"));
        assert!(all.iter().all(|r| !r.label.contains(' ')), "one word each");
        assert_eq!(runs(&fleet, &three, &[], false).len(), 3);
        // Only the peers asked for are swept.
        assert_eq!(runs(&fleet, &three[..2], &[], true).len(), 1 + REPLICATE_TARGETS.len());
        // Routers: each policy under each, labelled so, with no sweep.
        let routed = runs(&fleet, &three[..2], &[RouterPolicy::RoundRobin, RouterPolicy::Adapter], true);
        let labels: Vec<&str> = routed.iter().map(|r| r.label.as_str()).collect();
        assert_eq!(
            labels,
            ["hangar/round-robin", "hangar/adapter", "replicate/round-robin", "replicate/adapter"]
        );
        assert!(routed[1].fleet.models.iter().all(|m| m.router == RouterPolicy::Adapter));
    }
}
