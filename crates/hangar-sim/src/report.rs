//! The replay report: what a run measured, as JSON and as a table.

use std::fmt::{self, Write as _};

use serde::Serialize;

use crate::stats::Stats;

/// One request's life in the simulation (`--requests-jsonl` writes one per
/// line). Times are ms on the simulation clock, which starts at 0 with the
/// first arrival.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Index of the request in the trace (0-based, file order).
    pub index: u32,
    /// Line of the request in the trace file.
    pub line: usize,
    /// When it entered the cluster (was routed).
    pub arrival_ms: f64,
    /// When a worker first scheduled it.
    pub admitted_ms: Option<f64>,
    /// When its first token was emitted.
    pub first_token_ms: Option<f64>,
    /// When its last token was emitted.
    pub last_token_ms: Option<f64>,
    /// When it completed.
    pub completed_ms: Option<f64>,
    /// Time to first token.
    pub ttft_ms: Option<f64>,
    /// Mean gap between its tokens (needs two tokens).
    pub mean_itl_ms: Option<f64>,
    /// Arrival to completion.
    pub e2e_ms: Option<f64>,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Output tokens requested.
    pub output_tokens: u32,
    /// Output tokens emitted.
    pub emitted_tokens: u32,
    /// Prompt tokens served from the prefix cache at first admission.
    pub reused_tokens: u32,
    /// The worker it was routed to.
    pub worker: u32,
    /// Times it was preempted (or retracted) and recomputed.
    pub preemptions: u32,
    /// Why the engine refused it, if it did.
    pub rejected: Option<String>,
}

/// Requests that met the latency objectives.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Goodput {
    /// TTFT objective, if one was set.
    pub slo_ttft_ms: Option<f64>,
    /// Mean inter-token latency objective, if one was set.
    pub slo_itl_ms: Option<f64>,
    /// Completed requests within every set objective.
    pub requests: u64,
    /// Their share of completed requests.
    pub fraction: f64,
    /// Their rate over the run.
    pub requests_per_s: f64,
}

/// One worker's share of the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerReport {
    /// Worker index.
    pub worker: u32,
    /// Requests routed to it.
    pub requests: u64,
    /// Passes it ran.
    pub passes: u64,
    /// Time spent inside passes.
    pub busy_ms: f64,
    /// `busy_ms` over the run's duration.
    pub utilization: f64,
    /// Preemptions (or retractions) it performed.
    pub preemptions: u64,
}

/// Everything a replay measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// The trace replayed.
    pub trace: String,
    /// Arrival mode, e.g. `trace (speedup 1)` or `concurrency 32`.
    pub mode: String,
    /// Router policy.
    pub router: String,
    /// Engine scheduler.
    pub engine: String,
    /// Workers simulated.
    pub workers: u32,
    /// Seed of every random choice.
    pub seed: u64,
    /// Requests in the trace.
    pub requests: u64,
    /// Requests completed.
    pub completed: u64,
    /// Requests the engines refused (too long for their KV cache).
    pub rejected: u64,
    /// Requests that waited in the router's pending queue
    /// (`--router-queue`) before they were routed.
    pub router_queued: u64,
    /// First arrival to last completion.
    pub duration_ms: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Prompt tokens of completed requests per second.
    pub input_tokens_per_s: f64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// Time to first token, per request.
    pub ttft_ms: Stats,
    /// Time per output token: each request's mean inter-token gap.
    pub tpot_ms: Stats,
    /// Inter-token latency: every gap between consecutive tokens.
    pub itl_ms: Stats,
    /// Arrival to completion, per request.
    pub e2e_ms: Stats,
    /// Each request's decode speed: output tokens per second after its first.
    pub output_tokens_per_s_per_user: Stats,
    /// Prompt tokens served from prefix caches over all prompt tokens.
    pub prefix_cache_reuse_ratio: f64,
    /// Requests meeting the latency objectives.
    pub goodput: Goodput,
    /// Per-worker figures.
    pub per_worker: Vec<WorkerReport>,
}

impl fmt::Display for Report {
    /// A table for people; the JSON form carries the same figures.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "trace      {}", self.trace)?;
        writeln!(
            f,
            "setup      {} workers · {} engine · {} router · {} · seed {}",
            self.workers, self.engine, self.router, self.mode, self.seed
        )?;
        writeln!(
            f,
            "requests   {} completed of {} ({} rejected) in {:.1} s simulated",
            self.completed,
            self.requests,
            self.rejected,
            self.duration_ms / 1000.0
        )?;
        if self.router_queued > 0 {
            writeln!(f, "router     {} requests waited in the router's pending queue", self.router_queued)?;
        }
        writeln!(
            f,
            "throughput {:.2} req/s · {:.0} input tok/s · {:.0} output tok/s",
            self.requests_per_s, self.input_tokens_per_s, self.output_tokens_per_s
        )?;
        writeln!(f, "prefix cache reuse {:.1} %", 100.0 * self.prefix_cache_reuse_ratio)?;
        let mut table = String::new();
        writeln!(
            table,
            "{:<22}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
            "", "mean", "min", "p50", "p75", "p90", "p95", "p99", "max", "std"
        )?;
        for (name, s) in [
            ("TTFT ms", &self.ttft_ms),
            ("TPOT ms", &self.tpot_ms),
            ("ITL ms", &self.itl_ms),
            ("end-to-end ms", &self.e2e_ms),
            ("tok/s per user", &self.output_tokens_per_s_per_user),
        ] {
            writeln!(
                table,
                "{name:<22}{:>10.2}{:>10.2}{:>10.2}{:>10.2}{:>10.2}{:>10.2}{:>10.2}{:>10.2}{:>10.2}",
                s.mean, s.min, s.p50, s.p75, s.p90, s.p95, s.p99, s.max, s.std
            )?;
        }
        f.write_str(&table)?;
        let g = &self.goodput;
        if g.slo_ttft_ms.is_some() || g.slo_itl_ms.is_some() {
            writeln!(
                f,
                "goodput    {} requests ({:.1} %) within TTFT ≤ {} ms, ITL ≤ {} ms: {:.2} req/s",
                g.requests,
                100.0 * g.fraction,
                g.slo_ttft_ms.map_or("-".into(), |v| v.to_string()),
                g.slo_itl_ms.map_or("-".into(), |v| v.to_string()),
                g.requests_per_s
            )?;
        }
        write!(f, "workers   ")?;
        for w in &self.per_worker {
            write!(f, " #{}: {:.0} % busy, {} req", w.worker, 100.0 * w.utilization, w.requests)?;
            if w.preemptions > 0 {
                write!(f, ", {} preempted", w.preemptions)?;
            }
            write!(f, ";")?;
        }
        writeln!(f)
    }
}
