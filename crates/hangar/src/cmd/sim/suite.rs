//! `hangar sim suite`: every case of `hangar_sim::suite`, each policy and
//! each peer setting a fleet run, spread over threads, reported in one
//! table (docs/scaling.md, "The trace suite").

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args as ClapArgs;
use hangar_core::Millis;
use hangar_sim::bound::{hindsight_bound, BoundOptions, HindsightBound};
use hangar_sim::compare::RunSpec;
use hangar_sim::fleet::{simulate_fleet, FleetOptions, FleetReport};
use hangar_sim::suite::{self, Case, PublicTraces, SuiteReport};
use hangar_sim::trace::Trace;

use super::plot::{self, PlotFile};
use super::pool;
use crate::cmd::{peak_rss_mib, write_json};

/// Run the trace suite: `hangar`, `replicate` and `workers-ai` (and each
/// peer over its main knob) on every case — public traces mapped onto
/// several models, steady, diurnal and bursty synthetic traces, a model
/// that loads for minutes, more models than GPUs — judged against each
/// trace's hindsight bound; one table (Markdown) on stdout.
///
/// The public traces are read from `--traces-dir` (or the per-trace
/// flags); a case whose trace is not found is skipped, and the report says
/// so. The synthetic traces are generated as `hangar trace synth` would.
#[derive(Debug, ClapArgs)]
pub struct SuiteArgs {
    /// A directory holding the public traces under their usual names:
    /// `azure2023_conv.csv`, `azure2023_code.csv`,
    /// `mooncake_conversation_trace.jsonl`.
    #[arg(long, value_name = "DIR")]
    traces_dir: Option<PathBuf>,
    /// Azure's 2023 conversation trace (instead of `--traces-dir`'s).
    #[arg(long, value_name = "FILE")]
    azure_conv: Option<PathBuf>,
    /// Azure's 2023 code trace (instead of `--traces-dir`'s).
    #[arg(long, value_name = "FILE")]
    azure_code: Option<PathBuf>,
    /// Mooncake's conversation trace (instead of `--traces-dir`'s).
    #[arg(long, value_name = "FILE")]
    mooncake: Option<PathBuf>,
    /// Run only this case (repeat for several): azure, mooncake, steady,
    /// diurnal, bursty, long-load, contention.
    #[arg(long = "case", value_name = "NAME")]
    cases: Vec<String>,
    /// The share of each trace to run: synthetic ones get that share of
    /// their requests at the same rates, public ones the first share of
    /// their span. 1: the suite as documented.
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Added to every synthetic trace's seed: the same shapes drawn again,
    /// traffic no one tuned on.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Only the three policies with their defaults, no sweep of the peers.
    #[arg(long)]
    no_sweep: bool,
    /// Draw each case's runs here: `CASE-POLICY.svg` (load, replicas and
    /// TTFT over time, per policy with its defaults) and
    /// `CASE-frontier.svg` (GPU-hours against SLO attainment, every run,
    /// the peers' frontiers and the bound).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Draw the plots as PNG rather than SVG.
    #[arg(long, requires = "out")]
    png: bool,
    /// Write the whole report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Runs at once [default: the machine's cores].
    #[arg(long)]
    jobs: Option<usize>,
}

/// A case ready to run: its trace, its runs and its timeline period.
struct Prepared {
    case: Case,
    trace: Trace,
    runs: Vec<RunSpec>,
    sample_ms: Millis,
}

/// One unit of work for the threads.
#[derive(Clone, Copy)]
enum Job {
    Bound(usize),
    Run(usize, usize),
}

enum Done {
    Bound(Result<HindsightBound, String>),
    Run(Box<Result<FleetReport, String>>),
}

/// Where a public trace is: its own flag, else `--traces-dir`'s file of
/// that name if it exists; a flag naming a missing file is an error.
fn locate(flag: &Option<PathBuf>, dir: &Option<PathBuf>, name: &str) -> anyhow::Result<Option<PathBuf>> {
    if let Some(path) = flag {
        if !path.is_file() {
            bail!("{}: no such trace file", path.display());
        }
        return Ok(Some(path.clone()));
    }
    Ok(dir.as_ref().map(|d| d.join(name)).filter(|p| p.is_file()))
}

fn read_public(path: Option<PathBuf>) -> anyhow::Result<Option<Trace>> {
    path.map(|p| super::read_trace(&p)).transpose()
}

pub fn run(a: &SuiteArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    if !(a.scale > 0.0 && a.scale <= 1.0) {
        bail!("--scale must be above 0 and at most 1, got {}", a.scale);
    }
    if let Some(dir) = a.traces_dir.as_ref().filter(|d| !d.is_dir()) {
        bail!("--traces-dir {}: no such directory", dir.display());
    }
    let all = suite::cases(a.seed, a.scale);
    for name in &a.cases {
        if !all.iter().any(|c| c.name == name) {
            let names: Vec<&str> = all.iter().map(|c| c.name).collect();
            bail!("--case {name}: no such case (the suite has {})", names.join(", "));
        }
    }
    let chosen: Vec<Case> =
        all.into_iter().filter(|c| a.cases.is_empty() || a.cases.iter().any(|n| n == c.name)).collect();
    let wants = |source: fn(&suite::Source) -> bool| chosen.iter().any(|c| source(&c.source));
    let azure = wants(|s| matches!(s, suite::Source::AzureMerged { .. }));
    let mooncake = wants(|s| matches!(s, suite::Source::Mooncake { .. }));
    let find = |wanted: bool, flag: &Option<PathBuf>, name: &str| -> anyhow::Result<Option<Trace>> {
        if wanted {
            read_public(locate(flag, &a.traces_dir, name)?)
        } else {
            Ok(None)
        }
    };
    let public = PublicTraces {
        azure_conv: find(azure, &a.azure_conv, suite::AZURE_CONV)?,
        azure_code: find(azure, &a.azure_code, suite::AZURE_CODE)?,
        mooncake: find(mooncake, &a.mooncake, suite::MOONCAKE)?,
    };
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }

    let mut prepared = Vec::new();
    let mut skipped = Vec::new();
    for case in chosen {
        let Some(trace) = case.trace(&public, a.scale)? else {
            let missing = case.missing(&public).join(" and ");
            let why = match &a.traces_dir {
                Some(dir) => format!("{missing} not found in {}", dir.display()),
                None => format!("{missing} not given (--traces-dir)"),
            };
            eprintln!("suite: {}: skipped, {why}", case.name);
            skipped.push((case.name.to_owned(), why));
            continue;
        };
        let runs = suite::runs(&case.fleet(), !a.no_sweep);
        let sample_ms = if a.out.is_some() { super::span_sample_ms(&trace.requests, 1.0) } else { 0 };
        prepared.push(Prepared { case, trace, runs, sample_ms });
    }

    let jobs: Vec<Job> = prepared
        .iter()
        .enumerate()
        .flat_map(|(c, p)| {
            std::iter::once(Job::Bound(c)).chain((0..p.runs.len()).map(move |r| Job::Run(c, r)))
        })
        .collect();
    let threads = pool::threads(a.jobs, jobs.len());
    let done = pool::map(&jobs, threads, "runs and bounds", |&job| match job {
        Job::Bound(c) => {
            let p = &prepared[c];
            Done::Bound(
                hindsight_bound(&p.trace, &p.case.fleet(), &BoundOptions::default())
                    .map_err(|e| e.to_string()),
            )
        }
        Job::Run(c, r) => {
            let p = &prepared[c];
            let spec = &p.runs[r];
            // Timelines only for the runs drawn: the policies' defaults.
            let sample_ms = if spec.default { p.sample_ms } else { 0 };
            let opts = FleetOptions { sample_ms, ..FleetOptions::default() };
            Done::Run(Box::new(
                simulate_fleet(&p.trace, &spec.fleet, &opts, |_, _| {}).map_err(|e| e.to_string()),
            ))
        }
    });

    let ext = if a.png { "png" } else { "svg" };
    let mut done = done.into_iter();
    let mut cases = Vec::new();
    for p in &prepared {
        let Some(Done::Bound(bound)) = done.next() else { unreachable!("a case's bound comes first") };
        let bound =
            bound.map_err(anyhow::Error::msg).with_context(|| format!("case {}: the bound", p.case.name))?;
        let mut runs = Vec::new();
        for spec in &p.runs {
            let Some(Done::Run(report)) = done.next() else { unreachable!("then its runs") };
            let report = report
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("case {}: {}", p.case.name, spec.label))?;
            runs.push((spec.clone(), report));
        }
        if let Some(dir) = &a.out {
            for (spec, report) in runs.iter().filter(|(s, _)| s.default) {
                plot::timeline(report, &plot_file(dir, &format!("{}-{}.{ext}", p.case.name, spec.label))?)?;
            }
        }
        let report = suite::case_report(&p.case, bound, &runs);
        if let Some(dir) = &a.out {
            let title = format!("{}: {}", report.name, report.title);
            plot::comparison(
                &report.comparison,
                &title,
                &plot_file(dir, &format!("{}-frontier.{ext}", p.case.name))?,
            )?;
        }
        cases.push(report);
    }
    let report = SuiteReport { cases, skipped };
    if let Some(path) = &a.json {
        write_json(path, &report)?;
    }
    let mut out = std::io::stdout().lock();
    write!(out, "{}", report.table())?;
    writeln!(
        out,
        "\nwall {:.1} s · {} runs and {} bounds on {threads} threads · peak RSS {}",
        started.elapsed().as_secs_f64(),
        jobs.len() - prepared.len(),
        prepared.len(),
        peak_rss_mib().map_or("unknown".into(), |m| format!("{m:.0} MiB")),
    )?;
    Ok(())
}

fn plot_file(dir: &Path, name: &str) -> anyhow::Result<PlotFile> {
    PlotFile::parse(&dir.join(name).display().to_string()).map_err(anyhow::Error::msg)
}
