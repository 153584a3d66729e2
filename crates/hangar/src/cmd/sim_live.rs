//! `hangar sim live`: the same trace through a fleet simulation and through
//! a live `hangar serve` with mock engines of the same engine, compared.
//!
//! The live server gets the fleet as a configuration: its nodes (virtual
//! GPUs of the same memory), and per model the same size, bounds, permits,
//! line, objective, router and scaling policy, on a `mock` engine running
//! the model's engine settings, which loads for as long as the simulation's
//! COLD start from disk takes and wakes from sleep for as long as its WARM
//! wake. The simulation is told that the page cache is no faster than the
//! disk, since a mock engine has one load time. Each trace row is sent at
//! its (time-scaled) time as a streaming completion whose prompt is token
//! ids with the row's prefix structure (`hash_ids`), so both sides see the
//! same prefix-cache hits.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args as ClapArgs;
use hangar_bench::replay::{replay, LiveRun, ReplayRequest};
use hangar_engine::Prompt;
use hangar_sim::fleet::{FleetConfig, FleetOptions, FleetReport};
use hangar_sim::stats::Stats;
use hangar_sim::trace::Trace;
use serde::Serialize;
use serde_json::json;

use super::sim::{read_fleet, read_trace, simulate_with_bar};

/// `hangar sim live`.
#[derive(Debug, ClapArgs)]
pub struct LiveArgs {
    /// The trace (rows name their `model`); keep it short: it is replayed
    /// in real time.
    trace: PathBuf,
    /// The fleet file.
    #[arg(long)]
    fleet: PathBuf,
    /// Divide the time between arrivals by this (in both runs).
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Compare the replicas wanted every this many seconds of trace time
    /// (divided by --speedup on the clock).
    #[arg(long, default_value_t = 60.0)]
    sample_s: f64,
    /// Tokens each trace hash id stands for.
    #[arg(long, default_value_t = 512)]
    trace_block_size: u32,
    /// TTFT p50 and p99 may differ by at most this many percent.
    #[arg(long, default_value_t = 10.0)]
    ttft_tolerance_pct: f64,
    /// Replicas wanted may differ by at most this many at each sample.
    #[arg(long, default_value_t = 1)]
    replica_tolerance: u32,
    /// Write both runs and the comparison as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One model compared.
#[derive(Debug, Serialize)]
struct ModelComparison {
    model: String,
    sim_ttft_p50_ms: f64,
    live_ttft_p50_ms: f64,
    sim_ttft_p99_ms: f64,
    live_ttft_p99_ms: f64,
    /// The largest |sim − live| of the replicas wanted over the samples.
    max_replica_gap: u32,
    live_failed: u64,
}

impl ModelComparison {
    fn ttft_gaps_pct(&self) -> [f64; 2] {
        let gap = |sim: f64, live: f64| if sim > 0.0 { (live - sim).abs() / sim * 100.0 } else { 0.0 };
        [gap(self.sim_ttft_p50_ms, self.live_ttft_p50_ms), gap(self.sim_ttft_p99_ms, self.live_ttft_p99_ms)]
    }
}

pub fn run(a: &LiveArgs) -> anyhow::Result<()> {
    if !(a.sample_s.is_finite() && a.sample_s > 0.0) {
        bail!("--sample-s must be above 0, got {}", a.sample_s);
    }
    let mut cfg = read_fleet(&a.fleet)?;
    let trace = read_trace(&a.trace)?;
    let requests = requests(&trace, &cfg, a)?;
    // A mock engine has one load time: the simulation's page cache is made
    // no faster than its disk.
    cfg.cold_start.page_cache_gbps = cfg.cold_start.disk_gbps;
    let sample_ms = ((a.sample_s * 1000.0 / a.speedup).round() as u64).max(1);
    let opts = FleetOptions {
        speedup: a.speedup,
        trace_block_size: a.trace_block_size,
        skip_unknown: false,
        sample_ms,
        ..FleetOptions::default()
    };
    let sim = simulate_with_bar("simulating", &a.trace, &cfg, &opts)?;

    let dir = tempfile::tempdir().context("cannot create a temporary directory")?;
    let config = serve_config(&cfg, dir.path())?;
    let exe = std::env::current_exe().context("cannot find the hangar binary to start the server")?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let live = runtime.block_on(replay(&exe, &config, requests, sample_ms))?;

    let rows = compare(&cfg, &sim, &live);
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{} on {}, speed-up {}: simulation against a live hangar serve",
        trace.source,
        a.fleet.display(),
        a.speedup
    )?;
    writeln!(
        out,
        "{:<22} {:>12} {:>12} {:>7} {:>12} {:>12} {:>7} {:>9} {:>7}",
        "model", "sim p50 ms", "live p50 ms", "Δ %", "sim p99 ms", "live p99 ms", "Δ %", "replicas", "failed"
    )?;
    let mut outside = Vec::new();
    for r in &rows {
        let [d50, d99] = r.ttft_gaps_pct();
        writeln!(
            out,
            "{:<22} {:>12.1} {:>12.1} {:>7.1} {:>12.1} {:>12.1} {:>7.1} {:>9} {:>7}",
            r.model,
            r.sim_ttft_p50_ms,
            r.live_ttft_p50_ms,
            d50,
            r.sim_ttft_p99_ms,
            r.live_ttft_p99_ms,
            d99,
            format!("±{}", r.max_replica_gap),
            r.live_failed
        )?;
        if d50 > a.ttft_tolerance_pct || d99 > a.ttft_tolerance_pct {
            outside.push(format!("{}: TTFT differs by {d50:.1} % (p50) and {d99:.1} % (p99)", r.model));
        }
        if r.max_replica_gap > a.replica_tolerance {
            outside.push(format!("{}: replicas wanted differ by {} at a sample", r.model, r.max_replica_gap));
        }
        if r.live_failed > 0 {
            outside.push(format!("{}: {} live requests failed", r.model, r.live_failed));
        }
    }
    for e in &live.errors {
        writeln!(out, "live error: {e}")?;
    }
    if let Some(path) = &a.json {
        let json = json!({"simulation": sim, "live": live, "models": rows});
        super::write_json(path, &json)?;
    }
    if !outside.is_empty() {
        bail!(
            "outside the tolerance (TTFT ±{} %, replicas ±{}): {}",
            a.ttft_tolerance_pct,
            a.replica_tolerance,
            outside.join("; ")
        );
    }
    writeln!(
        out,
        "within the tolerance: TTFT ±{} %, replicas ±{}",
        a.ttft_tolerance_pct, a.replica_tolerance
    )?;
    Ok(())
}

/// The fleet as a `hangar serve` configuration; each model's engine file
/// is written to `dir`.
fn serve_config(cfg: &FleetConfig, dir: &Path) -> anyhow::Result<String> {
    let mut nodes = cfg.cluster().nodes;
    for n in &mut nodes {
        n.virtual_gpus = true;
    }
    let mut models = Vec::new();
    for (i, m) in cfg.models.iter().enumerate() {
        let engine_file = dir.join(format!("engine-{i}.toml"));
        std::fs::write(&engine_file, toml::to_string(&m.engine)?)
            .with_context(|| format!("cannot write {}", engine_file.display()))?;
        let bytes = m.size.bytes() as f64;
        let cold_ms = bytes / (cfg.cold_start.disk_gbps * 1e9) * 1000.0 + cfg.cold_start.boot_ms as f64;
        let wake_ms = bytes / (cfg.cold_start.wake_gbps * 1e9) * 1000.0;
        let mut model = json!({
            "key": m.key,
            "size": m.size,
            "engine": {
                "kind": "mock",
                "startup_delay_ms": cold_ms.round() as u64,
                "wake_delay_ms": wake_ms.round() as u64,
                "engine_config": engine_file,
            },
            "min_replicas": m.min_replicas,
            "max_replicas": m.max_replicas(),
            "concurrency": m.concurrency,
            "queue": {"capacity": m.capacity()},
            "slo_ttft_ms": m.slo_ttft_ms,
            "router": m.router,
        });
        if let Some(scaling) = &m.scaling {
            model["scaling"] = serde_json::to_value(scaling)?;
        }
        models.push(model);
    }
    let config = json!({
        "listen": "127.0.0.1:0",
        "seed": cfg.seed,
        "placement": cfg.placement,
        "nodes": nodes,
        "models": models,
    });
    let value: toml::Value = serde_json::from_value(config)?;
    Ok(toml::to_string(&value)?)
}

/// The trace's rows as live requests: their time, model, and token ids
/// with the row's prefix structure.
fn requests(trace: &Trace, cfg: &FleetConfig, a: &LiveArgs) -> anyhow::Result<Vec<ReplayRequest>> {
    let t0 = trace.requests.iter().map(|r| r.timestamp_ms).fold(f64::INFINITY, f64::min);
    trace
        .requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let Some(model) = &r.model else { bail!("{}:{}: the row names no model", trace.source, r.line) };
            if let Some(adapter) = &r.adapter {
                // The live request would not carry it, and the two sides
                // would be compared on different work.
                bail!(
                    "{}:{}: field `adapter`: `sim live` sends rows without their adapter (`{model}:{adapter}`), \
                     so it would compare different work; simulate adapters with `hangar sim --fleet`",
                    trace.source,
                    r.line
                );
            }
            let Some(m) = cfg.models.iter().find(|m| m.key.as_str() == model) else {
                bail!("{}:{}: model `{model}` is not in the fleet", trace.source, r.line)
            };
            let prompt = Prompt::from_trace(
                r.input_len,
                &r.hash_ids,
                a.trace_block_size,
                m.engine.block_size,
                i as u64,
            )
            .map_err(|e| anyhow::anyhow!("{}:{}: {e}", trace.source, r.line))?;
            // Equal runs stay equal as 32-bit ids; that is all prefix
            // sharing depends on.
            let tokens = prompt
                .runs()
                .iter()
                .flat_map(|run| std::iter::repeat_n(run.token as u32, run.count as usize))
                .collect();
            Ok(ReplayRequest {
                at_ms: (r.timestamp_ms - t0) / a.speedup,
                model: model.clone(),
                prompt: tokens,
                max_tokens: r.output_len.max(1),
            })
        })
        .collect()
}

/// Per model: TTFT percentiles of both runs and the largest gap in
/// replicas wanted at the samples both took.
fn compare(cfg: &FleetConfig, sim: &FleetReport, live: &LiveRun) -> Vec<ModelComparison> {
    cfg.models
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let key = m.key.as_str();
            let report = &sim.models[i];
            let outcome = live.models.get(key).cloned().unwrap_or_default();
            let live_ttft = Stats::exact(outcome.ttft_ms);
            let sim_wanted: BTreeMap<u64, u32> =
                sim.timeline.iter().map(|s| ((s.t_s * 1000.0).round() as u64, s.desired[i])).collect();
            let max_replica_gap = live
                .samples
                .iter()
                .filter_map(|s| {
                    let at = (s.t_s * 1000.0).round() as u64;
                    Some(sim_wanted.get(&at)?.abs_diff(*s.desired.get(key)?))
                })
                .max()
                .unwrap_or(0);
            ModelComparison {
                model: key.to_owned(),
                sim_ttft_p50_ms: report.ttft_ms.p50,
                live_ttft_p50_ms: live_ttft.p50,
                sim_ttft_p99_ms: report.ttft_ms.p99,
                live_ttft_p99_ms: live_ttft.p99,
                max_replica_gap,
                live_failed: outcome.failed,
            }
        })
        .collect()
}
