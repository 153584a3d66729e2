//! The trace suite on small traces: every case runs, its runs never use
//! fewer GPU-hours than its hindsight bound allows, and its report is
//! the same bytes every time.

use hangar_sim::bound::{hindsight_bound, BoundOptions};
use hangar_sim::fleet::{simulate_fleet, FleetOptions};
use hangar_sim::suite::{self, PublicTraces, SuiteReport};
use hangar_sim::synth::{self, SynthConfig};
use hangar_sim::trace::Trace;

/// A stand-in for a public trace: rows naming no model, as Azure's and
/// Mooncake's, the suite maps them onto its models.
fn stand_in(requests: u32, seed: u64) -> Trace {
    let config = SynthConfig { requests, rate: 2.0, max_turns: 3, seed, ..SynthConfig::default() };
    synth::trace(&config, "stand-in.jsonl").unwrap()
}

/// Every case (or only the one named) at a hundredth of its requests (the
/// public ones on small stand-ins), `hangar`, `replicate` and `workers-ai`
/// with their defaults.
fn small_suite(seed: u64, only: Option<&str>) -> SuiteReport {
    let public = PublicTraces {
        azure_conv: Some(stand_in(60, 1)),
        azure_code: Some(stand_in(30, 2)),
        mooncake: Some(stand_in(80, 3)),
    };
    let mut cases = Vec::new();
    for case in suite::cases(seed, 0.01).into_iter().filter(|c| only.is_none_or(|o| o == c.name)) {
        let trace = case.trace(&public, 1.0).unwrap().expect("every trace is given");
        let fleet = case.fleet();
        let bound = hindsight_bound(&trace, &fleet, &BoundOptions::default()).unwrap();
        let runs: Vec<_> = suite::runs(&fleet, false)
            .into_iter()
            .map(|spec| {
                let report =
                    simulate_fleet(&trace, &spec.fleet, &FleetOptions::default(), |_, _| {}).unwrap();
                (spec, report)
            })
            .collect();
        cases.push(suite::case_report(&case, bound, &runs));
    }
    SuiteReport { cases, skipped: Vec::new() }
}

#[test]
fn no_policy_uses_fewer_gpu_hours_than_the_bound_on_any_case() {
    let report = small_suite(0, None);
    assert_eq!(report.cases.len(), suite::cases(0, 1.0).len());
    for case in &report.cases {
        let cmp = &case.comparison;
        let bound = cmp.bound.as_ref().unwrap();
        assert!(bound.requests > 0, "{}", case.name);
        assert_eq!(cmp.runs.len(), suite::POLICIES.len());
        // Today's simulator lets a replica load from the page cache while
        // the node's first read of the model is still under way, and keeps
        // a replica given back mid-load as a WARM copy (issue 28's
        // fidelity item), so a run may come under the bound by up to each
        // model's first load beyond a restart (the bound's module docs,
        // "Its one assumption"). That slack goes once the simulator reads
        // a model from disk before anything else on that node.
        let slack: f64 = (bound.models.iter())
            .filter(|m| m.requests > 0)
            .map(|m| (m.first_load_s - m.restart_s) * m.gpus_per_replica / 3600.0)
            .sum();
        for run in &cmp.runs {
            let attainment = run.total.slo_attainment;
            // At the attainment it reached, and at 99 % if it got there.
            let floor = bound.at(attainment).unwrap_or(0.0) - slack;
            assert!(
                run.gpu_hours >= floor * (1.0 - 1e-9),
                "{}: {} used {} GPU-h at {attainment}, below the bound {floor} there",
                case.name,
                run.label,
                run.gpu_hours
            );
            if attainment >= 0.99 {
                let floor = bound.gpu_hours.unwrap() - slack;
                assert!(run.gpu_hours >= floor * (1.0 - 1e-9), "{}: {}", case.name, run.label);
            }
        }
        // Each case reports hangar's verdict against both peers.
        let verdict = cmp.verdict.as_ref().unwrap();
        assert_eq!(verdict.peers.len(), 2, "{}", case.name);
    }
}

#[test]
fn the_suite_report_is_the_same_bytes_every_time_and_tables_every_case() {
    let a = small_suite(0, None);
    let b = small_suite(0, None);
    assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap());
    let table = a.table();
    for case in suite::cases(0, 1.0) {
        assert!(table.contains(&format!("| {}", case.name)), "{}: {table}", case.name);
        assert!(table.contains(&format!("### {} — ", case.name)), "{}", case.name);
    }
    // A fresh draw of the synthetic traces is other traffic.
    let other = small_suite(1, Some("steady"));
    let steady =
        |r: &SuiteReport| r.cases.iter().find(|c| c.name == "steady").unwrap().comparison.runs[0].clone();
    assert_ne!(steady(&a).total.ttft_ms, steady(&other).total.ttft_ms);
}
