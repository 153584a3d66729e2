//! `hangar sim`: replay a trace through simulated engines and a router.

use std::cell::Cell;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args as ClapArgs, ValueEnum};
use hangar_core::Millis;
use hangar_engine::EngineConfig;
use hangar_router::{KvRouterConfig, RouterPolicy};
use hangar_scaler::ScalingConfig;
use hangar_sim::bound::{hindsight_bound, BoundOptions};
use hangar_sim::compare::{self, Comparison};
use hangar_sim::fleet::{
    simulate_fleet, simulate_fleet_rows, FleetConfig, FleetOptions, FleetReport, ModelReport,
};
use hangar_sim::synth::{self, SynthConfig};
use hangar_sim::{simulate, trace, ArrivalMode, SimConfig, Slo};
use indicatif::{ProgressBar, ProgressStyle};

use super::{peak_rss_mib, read_text, write_json, write_jsonl};

mod plot;
mod pool;
mod suite;

use plot::PlotFile;

/// Replay a request trace on a logical clock through mock engines behind a
/// router, and report latency, throughput and prefix-cache reuse.
///
/// Without TRACE it replays a built-in synthetic multi-turn chat trace
/// (`hangar trace synth --requests 2000 --seed 0`). Engine settings come
/// from `--engine-config FILE` (TOML, the fields of docs/sim.md) and are
/// overridden by the flags below. With --fleet the fleet file describes
/// the cluster: the flags of the replay's own cluster are refused.
#[derive(Debug, ClapArgs)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Mooncake-style JSONL or Azure CSV trace.
    trace: Option<PathBuf>,
    /// Simulate a whole fleet (nodes, models, admission, the controller
    /// with each model's scaling policy, cold starts) described by this
    /// file (docs/sim.md, "Whole-fleet simulation"); trace rows name their
    /// `model`.
    #[arg(long)]
    fleet: Option<PathBuf>,
    /// With --fleet: drop trace rows naming a model the fleet does not
    /// serve, instead of refusing the trace.
    #[arg(long, requires = "fleet")]
    skip_unknown: bool,
    /// With --fleet: draw load, replicas per model and TTFT p99 over
    /// simulated time to this .svg or .png file.
    #[arg(long, value_name = "FILE", requires = "fleet", value_parser = PlotFile::parse)]
    plot: Option<PlotFile>,
    /// Workers (engines) in the simulated cluster.
    #[arg(long, conflicts_with = "fleet", default_value_t = 4)]
    workers: u32,
    /// Routing policy: round-robin, least-outstanding or kv (as `hangar
    /// serve`'s `router`; the snake_case spellings are aliases).
    #[arg(long, conflicts_with = "fleet", default_value_t = RouterPolicy::Kv)]
    router: RouterPolicy,
    /// KV router: weight of the prefill work a worker would do.
    #[arg(long, conflicts_with = "fleet", default_value_t = 1.0)]
    prefill_load_scale: f64,
    /// KV router: discount per cached overlap block.
    #[arg(long, conflicts_with = "fleet", default_value_t = 1.0)]
    overlap_credit: f64,
    /// KV router: weight of the requests in flight.
    #[arg(long, conflicts_with = "fleet", default_value_t = 0.0)]
    active_request_weight: f64,
    /// KV events reach the router this many ms after the pass that caused them.
    #[arg(long, conflicts_with = "fleet", default_value_t = 0.0)]
    kv_event_delay_ms: f64,
    /// Dynamo's router-side pending queue: hold a request in the router
    /// while every worker has at least THRESHOLD × max_num_batched_tokens
    /// prompt tokens routed and not yet prefilled, and route it once one
    /// has less [default: off, every request routed on arrival].
    #[arg(long, conflicts_with = "fleet", value_name = "THRESHOLD")]
    router_queue: Option<f64>,
    /// Engine configuration file (TOML).
    #[arg(long, conflicts_with = "fleet")]
    engine_config: Option<PathBuf>,
    /// Scheduler of every engine.
    #[arg(long, conflicts_with = "fleet", value_enum)]
    engine: Option<Engine>,
    /// Tokens per KV block [engine default: 64].
    #[arg(long, conflicts_with = "fleet")]
    block_size: Option<u32>,
    /// KV blocks per engine [default: 16384].
    #[arg(long, conflicts_with = "fleet")]
    num_gpu_blocks: Option<u32>,
    /// Most requests running per engine [default: 256].
    #[arg(long, conflicts_with = "fleet")]
    max_num_seqs: Option<u32>,
    /// Most tokens per pass [default: 8192].
    #[arg(long, conflicts_with = "fleet")]
    max_num_batched_tokens: Option<u32>,
    /// Turn the prefix cache off.
    #[arg(long, conflicts_with = "fleet")]
    no_prefix_caching: bool,
    /// Turn chunked prefill off.
    #[arg(long, conflicts_with = "fleet")]
    no_chunked_prefill: bool,
    /// Divide modelled pass times by this [default: 1].
    #[arg(long, conflicts_with = "fleet")]
    speedup_ratio: Option<f64>,
    /// Trace mode: divide the time between arrivals (and turn delays) by this.
    #[arg(long, default_value_t = 1.0, conflicts_with = "concurrency")]
    speedup: f64,
    /// Concurrency mode: keep this many requests in flight, ignoring timestamps.
    #[arg(long, conflicts_with = "fleet")]
    concurrency: Option<u32>,
    /// Tokens each trace hash id stands for.
    #[arg(long, default_value_t = 512)]
    trace_block_size: u32,
    /// Seed of every random choice.
    #[arg(long, conflicts_with = "fleet", default_value_t = 0)]
    seed: u64,
    /// Goodput objective: time to first token in ms.
    #[arg(long, conflicts_with = "fleet")]
    slo_ttft_ms: Option<f64>,
    /// Goodput objective: mean inter-token latency in ms.
    #[arg(long, conflicts_with = "fleet")]
    slo_itl_ms: Option<f64>,
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write one JSON record per request to this file.
    #[arg(long, conflicts_with = "fleet")]
    requests_jsonl: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Engine {
    Vllm,
    Sglang,
}

/// `hangar sim compare`, `sim live`, `sim suite`.
#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Run several scaling policies (and, with `--router`, routing
    /// policies) on the same fleet and trace, and print one table:
    /// requests, SLO attainment, goodput, GPU-hours, goodput per GPU-hour,
    /// cold starts, decisions, reversals and adapter loads per run, and
    /// its GPU-hours as a multiple of the trace's hindsight bound (the
    /// fewest any schedule could use answering 99 % of requests in time;
    /// with `--sweep`, each peer's frontier over its main knob too).
    Compare(CompareArgs),
    /// Replay a short trace through a fleet simulation and through a live
    /// `hangar serve` with mock engines of the same engine settings, and
    /// compare TTFT p50 / p99 per model and the replicas wanted at every
    /// sample (docs/sim.md, "Simulation against a live server"). Exits
    /// non-zero outside the tolerances.
    Live(super::sim_live::LiveArgs),
    /// Run the trace suite: every scaling policy, and each peer over its
    /// main knob, on public and synthetic traces of every shape, judged
    /// against each trace's hindsight bound (docs/scaling.md, "The trace
    /// suite").
    Suite(suite::SuiteArgs),
}

#[derive(Debug, ClapArgs)]
struct CompareArgs {
    /// The trace (rows name their `model`).
    trace: PathBuf,
    /// The fleet file.
    #[arg(long)]
    fleet: PathBuf,
    /// A policy every model runs, with its defaults; repeat to compare.
    #[arg(long = "policy", value_enum, required = true)]
    policies: Vec<PolicyName>,
    /// A routing policy every model runs instead of its own `router`:
    /// round-robin, least-outstanding, kv or adapter; repeat to compare
    /// routers — each --policy runs under each, labelled policy/router.
    #[arg(long = "router", conflicts_with = "sweep")]
    routers: Vec<RouterPolicy>,
    /// Also run each peer policy given (replicate, workers-ai) over its
    /// main knob — replicate's target backlog per replica, workers-ai's
    /// utilization deadband — and report its Pareto frontier of GPU-hours
    /// against SLO attainment, and hangar's default against it.
    #[arg(long)]
    sweep: bool,
    /// Divide the time between arrivals by this.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Tokens each trace hash id stands for.
    #[arg(long, default_value_t = 512)]
    trace_block_size: u32,
    /// Drop rows naming a model the fleet does not serve.
    #[arg(long)]
    skip_unknown: bool,
    /// Write the comparison (the bound, every run with its figures per
    /// model, the frontiers, the verdict) as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw GPU-hours against SLO attainment — every run, the peers'
    /// frontiers, the hindsight bound — to this .svg or .png file.
    #[arg(long, value_name = "FILE", value_parser = PlotFile::parse)]
    plot: Option<PlotFile>,
    /// Runs at once [default: the machine's cores].
    #[arg(long)]
    jobs: Option<usize>,
}

/// A scaling policy by name.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum PolicyName {
    Hangar,
    Replicate,
    WorkersAi,
    Fixed,
}

impl PolicyName {
    fn config(self) -> ScalingConfig {
        match self {
            PolicyName::Hangar => ScalingConfig::Hangar(Default::default()),
            PolicyName::Replicate => ScalingConfig::Replicate(Default::default()),
            PolicyName::WorkersAi => ScalingConfig::WorkersAi(Default::default()),
            PolicyName::Fixed => ScalingConfig::Fixed,
        }
    }
}

pub(super) fn read_fleet(path: &std::path::Path) -> anyhow::Result<FleetConfig> {
    FleetConfig::parse(&read_text(path)?, &path.display().to_string()).map_err(anyhow::Error::msg)
}

pub(super) fn read_trace(path: &std::path::Path) -> anyhow::Result<trace::Trace> {
    Ok(trace::read(&read_text(path)?, &path.display().to_string())?)
}

/// The rows of the trace file at `path`, read as they are asked for (a
/// fleet run never holds its trace), and a count of the bytes read so far
/// for a progress bar.
fn stream_rows(path: &std::path::Path) -> anyhow::Result<(FileRows, Rc<Cell<u64>>)> {
    let file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let read = Rc::new(Cell::new(0));
    let reader = std::io::BufReader::with_capacity(1 << 16, Counted { file, read: read.clone() });
    Ok((trace::TraceRows::new(reader, &path.display().to_string()).without_sessions(), read))
}

/// A trace file's rows as [`stream_rows`] reads them.
type FileRows = trace::TraceRows<std::io::BufReader<Counted>>;

/// A file that counts the bytes read from it.
struct Counted {
    file: std::fs::File,
    read: Rc<Cell<u64>>,
}

impl std::io::Read for Counted {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read(buf)?;
        self.read.set(self.read.get() + n as u64);
        Ok(n)
    }
}

/// One timeline sample a second, or fewer on a long trace: about 600 over
/// the trace's span (arrivals `first` to `last`, ms, divided by
/// `speedup`), as many as a plot's width shows.
fn sample_period(first: f64, last: f64, speedup: f64) -> Millis {
    let span_ms = ((last - first) / speedup).max(0.0);
    ((span_ms / 600.0) as Millis).max(1000)
}

/// [`sample_period`] of the trace file at `path`, read once more for its
/// span.
fn sample_ms(path: &std::path::Path, speedup: f64) -> anyhow::Result<Millis> {
    let (mut first, mut last) = (f64::INFINITY, f64::NEG_INFINITY);
    for row in stream_rows(path)?.0 {
        let t = row?.timestamp_ms;
        (first, last) = (first.min(t), last.max(t));
    }
    Ok(sample_period(first, last, speedup))
}

/// [`sample_period`] of rows in memory.
pub(super) fn span_sample_ms(rows: &[trace::TraceRequest], speedup: f64) -> Millis {
    let (first, last) = (rows.iter()).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), r| {
        (lo.min(r.timestamp_ms), hi.max(r.timestamp_ms))
    });
    sample_period(first, last, speedup)
}

/// Runs one fleet simulation of the trace file at `path`, streamed, with
/// a progress bar over the file on stderr, drawn only when stderr is a
/// terminal so pipes, logs and tests see nothing; the bar is cleared once
/// the run ends.
pub(super) fn simulate_with_bar(
    label: &str,
    path: &std::path::Path,
    cfg: &FleetConfig,
    opts: &FleetOptions,
) -> anyhow::Result<FleetReport> {
    let (rows, read) = stream_rows(path)?;
    let source = rows.source_name().to_owned();
    if !std::io::stderr().is_terminal() {
        return Ok(simulate_fleet_rows(rows, &source, cfg, opts, |_| {})?);
    }
    let size = std::fs::metadata(path).map_or(0, |m| m.len());
    let bar = ProgressBar::new(size).with_prefix(label.to_owned()).with_style(
        ProgressStyle::with_template(
            "{prefix} [{bar:40}] {binary_bytes}/{binary_total_bytes} of the trace, {eta} left",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    let report = simulate_fleet_rows(rows, &source, cfg, opts, |done| {
        // The bar redraws at most 20 times a second anyway; this spares
        // its lock on every one of millions of requests.
        if done % 256 == 1 {
            bar.set_position(read.get());
        }
    });
    bar.finish_and_clear();
    Ok(report?)
}

/// `hangar sim --fleet`.
fn run_fleet(args: &Args, fleet: &std::path::Path) -> anyhow::Result<()> {
    let started = Instant::now();
    let Some(path) = &args.trace else { bail!("--fleet needs a TRACE whose rows name their `model`") };
    let cfg = read_fleet(fleet)?;
    let opts = FleetOptions {
        speedup: args.speedup,
        trace_block_size: args.trace_block_size,
        skip_unknown: args.skip_unknown,
        policy: None,
        sample_ms: if args.plot.is_some() { sample_ms(path, args.speedup)? } else { 0 },
        ..FleetOptions::default()
    };
    let report = simulate_with_bar("simulating", path, &cfg, &opts)?;
    if let Some(file) = &args.plot {
        plot::timeline(&report, file)?;
    }
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    let mut stdout = std::io::stdout().lock();
    write!(stdout, "{}", report.table())?;
    writeln!(
        stdout,
        "wall {:.3} s · {} requests · peak RSS {}",
        started.elapsed().as_secs_f64(),
        report.total.requests,
        peak_rss_mib().map_or("unknown".into(), |m| format!("{m:.1} MiB")),
    )?;
    Ok(())
}

/// `hangar sim compare`: the trace is read whole (the bound needs all of
/// it) and shared by the runs, which go on `--jobs` threads.
fn run_compare(a: &CompareArgs) -> anyhow::Result<()> {
    let cfg = read_fleet(&a.fleet)?;
    let trace = read_trace(&a.trace)?;
    let bound_opts = BoundOptions {
        speedup: a.speedup,
        trace_block_size: a.trace_block_size,
        skip_unknown: a.skip_unknown,
        ..BoundOptions::default()
    };
    let bound = hindsight_bound(&trace, &cfg, &bound_opts).context("the hindsight bound")?;
    let policies: Vec<ScalingConfig> = a.policies.iter().map(|p| p.config()).collect();
    let specs = compare::runs(&cfg, &policies, &a.routers, a.sweep);
    let opts = FleetOptions {
        speedup: a.speedup,
        trace_block_size: a.trace_block_size,
        skip_unknown: a.skip_unknown,
        ..FleetOptions::default()
    };
    let threads = pool::threads(a.jobs, specs.len());
    let reports =
        pool::map(&specs, threads, "runs", |spec| simulate_fleet(&trace, &spec.fleet, &opts, |_, _| {}));
    let mut done = Vec::new();
    for (spec, report) in specs.into_iter().zip(reports) {
        let report = report.with_context(|| format!("run {}", spec.label))?;
        done.push((spec, report));
    }
    let comparison = Comparison::new(Some(bound), &done);
    let title = format!("{} on {}", a.trace.display(), a.fleet.display());
    if let Some(file) = &a.plot {
        plot::comparison(&comparison, &title, file)?;
    }
    if let Some(path) = &a.json {
        write_json(path, &comparison)?;
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "{title}")?;
    writeln!(out, "{} {:>8} {:>8} {:>10}", ModelReport::header("run"), "× bound", "busy ×", "× at SLO")?;
    for r in &comparison.runs {
        let times = |x: Option<f64>| x.map_or("–".into(), |x| format!("{x:.2}"));
        writeln!(
            out,
            "{} {:>8} {:>8} {:>10}",
            r.total.row(&r.label),
            times(r.times_bound),
            times(r.busy_times_bound),
            times(r.times_bound_at_its_slo)
        )?;
    }
    write!(out, "\n{}", comparison.summary())?;
    if comparison.runs.iter().any(|r| r.total.adapters.requests > 0) {
        writeln!(out, "\nadapters (every model):")?;
        for r in &comparison.runs {
            let a = &r.total.adapters;
            writeln!(
                out,
                "  {:<28} {} requests, {:.1} % found theirs loaded; {} loads, {} unloads; wait for a load p99 {:.0} ms",
                r.label,
                a.requests,
                a.hits as f64 * 100.0 / a.requests.max(1) as f64,
                a.loads,
                a.unloads,
                a.wait_ms.p99,
            )?;
        }
    }
    Ok(())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match &args.command {
        Some(Command::Compare(a)) => return run_compare(a),
        Some(Command::Live(a)) => return super::sim_live::run(a),
        Some(Command::Suite(a)) => return suite::run(a),
        None => {}
    }
    if let Some(fleet) = &args.fleet {
        return run_fleet(&args, fleet);
    }
    let started = Instant::now();
    let trace = match &args.trace {
        Some(path) => {
            let name = path.display().to_string();
            trace::read(&read_text(path)?, &name)?
        }
        None => demo_trace()?,
    };
    let cfg = sim_config(&args)?;
    let base = args.engine_config.as_ref().and_then(|p| p.parent().map(PathBuf::from));
    let out = simulate(&trace, &cfg, |path| {
        let p = base.as_ref().map_or_else(|| PathBuf::from(path), |b| b.join(path));
        std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))
    })?;
    let wall = started.elapsed().as_secs_f64();
    if let Some(path) = &args.json {
        write_json(path, &out.report)?;
    }
    if let Some(path) = &args.requests_jsonl {
        write_jsonl(path, &out.requests)?;
    }
    let mut stdout = std::io::stdout().lock();
    write!(stdout, "{}", out.report)?;
    writeln!(
        stdout,
        "wall       {:.3} s · {:.0} simulated requests per wall second · peak RSS {}",
        wall,
        out.report.requests as f64 / wall,
        peak_rss_mib().map_or("unknown".into(), |m| format!("{m:.1} MiB")),
    )?;
    Ok(())
}

fn demo_trace() -> anyhow::Result<trace::Trace> {
    Ok(synth::trace(
        &SynthConfig { requests: 2000, ..SynthConfig::default() },
        "built-in demo (hangar trace synth --requests 2000 --seed 0)",
    )?)
}

fn sim_config(args: &Args) -> anyhow::Result<SimConfig> {
    let mut engine = match &args.engine_config {
        Some(path) => {
            let text = read_text(path)?;
            toml::from_str::<EngineConfig>(&text)
                .with_context(|| format!("invalid engine config {}", path.display()))?
        }
        None => EngineConfig::default(),
    };
    if let Some(e) = args.engine {
        engine.scheduler = match e {
            Engine::Vllm => hangar_engine::SchedulerKind::Vllm,
            Engine::Sglang => hangar_engine::SchedulerKind::Sglang,
        };
    }
    let set = |field: &mut u32, v: Option<u32>| {
        if let Some(v) = v {
            *field = v;
        }
    };
    set(&mut engine.block_size, args.block_size);
    set(&mut engine.num_gpu_blocks, args.num_gpu_blocks);
    set(&mut engine.max_num_seqs, args.max_num_seqs);
    set(&mut engine.max_num_batched_tokens, args.max_num_batched_tokens);
    engine.enable_prefix_caching &= !args.no_prefix_caching;
    engine.enable_chunked_prefill &= !args.no_chunked_prefill;
    if let Some(r) = args.speedup_ratio {
        engine.speedup_ratio = r;
    }
    let kv = KvRouterConfig {
        prefill_load_scale: args.prefill_load_scale,
        overlap_credit: args.overlap_credit,
        active_request_weight: args.active_request_weight,
    };
    for (name, v) in [
        ("--prefill-load-scale", args.prefill_load_scale),
        ("--overlap-credit", args.overlap_credit),
        ("--active-request-weight", args.active_request_weight),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            bail!("{name} must be a number ≥ 0, got {v}");
        }
    }
    let mode = match args.concurrency {
        Some(n) => ArrivalMode::Concurrency { in_flight: n },
        None => ArrivalMode::Trace { speedup: args.speedup },
    };
    Ok(SimConfig {
        workers: args.workers,
        router: args.router,
        kv,
        engine,
        mode,
        trace_block_size: args.trace_block_size,
        seed: args.seed,
        kv_event_delay_ms: args.kv_event_delay_ms,
        slo: Slo { ttft_ms: args.slo_ttft_ms, itl_ms: args.slo_itl_ms },
        router_queue: args.router_queue,
    })
}
