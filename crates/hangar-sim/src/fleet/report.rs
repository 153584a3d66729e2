//! What a fleet simulation measured, per model and in total.

use std::fmt::Write as _;

use hangar_core::ModelKey;
use hangar_scaler::{Controller, Decision, StartTier};
use serde::Serialize;

use super::{FleetConfig, Outcome, Timing};
use crate::stats::{LogHistogram, Stats};
use crate::trace::Trace;

/// GPU-seconds by what the replicas holding them were doing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct GpuSeconds {
    /// Loading weights or booting.
    pub loading: f64,
    /// Ready with nothing to do.
    pub idle: f64,
    /// Running requests.
    pub busy: f64,
    /// The three together.
    pub total: f64,
}

/// Replica starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ColdStarts {
    /// COLD starts (weights from disk or page cache).
    pub cold: u64,
    /// WARM wakes.
    pub warm: u64,
    /// Start time of both, ms.
    pub ms: Stats,
}

/// One model's figures (or the fleet's, in `total`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelReport {
    /// The model (`*` for the total).
    pub model: String,
    /// Its policy.
    pub policy: String,
    /// Requests in the trace for it.
    pub requests: u64,
    /// Answered.
    pub completed: u64,
    /// Turned away with 429.
    pub rejected: u64,
    /// Waited past their timeout (504).
    pub timed_out: u64,
    /// Could not run.
    pub failed: u64,
    /// Time to first token, ms.
    pub ttft_ms: Stats,
    /// Inter-token latency, ms.
    pub itl_ms: Stats,
    /// End to end, ms.
    pub e2e_ms: Stats,
    /// The TTFT objective.
    pub slo_ttft_ms: f64,
    /// Share of its requests completed within the objective.
    pub slo_attainment: f64,
    /// Requests completed within the objective per second of the run.
    pub goodput_rps: f64,
    /// GPU-seconds by state.
    pub gpu_seconds: GpuSeconds,
    /// Replica-seconds spent WARM (CPU memory, no GPU).
    pub warm_seconds: f64,
    /// Requests completed within the objective per GPU-hour.
    pub goodput_per_gpu_hour: f64,
    /// Starts.
    pub cold_starts: ColdStarts,
    /// Scale decisions that changed the count.
    pub decisions: u64,
    /// Decisions that went the other way from the one before.
    pub reversals: u64,
    /// Times the model became unplaceable.
    pub unplaceable: u64,
}

/// The fleet at one moment and the load of the window it opens, for
/// plots.
///
/// The window runs from this sample to the next (the last one to the end
/// of the run), so the windows cover the run once: their `arrivals` add
/// up to the requests the fleet served.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    /// Seconds since the first arrival.
    pub t_s: f64,
    /// Replicas wanted, per model in fleet order.
    pub desired: Vec<u32>,
    /// Replicas hot, per model.
    pub hot: Vec<u32>,
    /// Requests that arrived in the window, all models.
    pub arrivals: u64,
    /// TTFT p99 in ms of the first tokens sent in the window, all models
    /// (nearest rank, as every percentile here); `None` when none was.
    pub ttft_p99_ms: Option<f64>,
}

/// A whole fleet simulation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FleetReport {
    /// The trace.
    pub trace: String,
    /// Seconds from the first arrival to the last answer.
    pub duration_s: f64,
    /// Per model, in fleet order.
    pub models: Vec<ModelReport>,
    /// The whole fleet.
    pub total: ModelReport,
    /// Replicas over time (with `sample_ms`).
    pub timeline: Vec<Sample>,
}

/// Where a replica's time is booked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bucket {
    Loading,
    Idle,
    Busy,
    Warm,
    Gone,
}

#[derive(Default)]
struct PerModel {
    gpu: GpuSeconds,
    warm_s: f64,
    itl: LogHistogram,
    starts: Vec<f64>,
    cold: u64,
    warm: u64,
    decisions: u64,
    unplaceable: u64,
}

/// Collects as the simulation runs.
pub(crate) struct Builder {
    models: Vec<PerModel>,
    /// Per replica slot: its current bucket, GPUs and since when.
    slots: Vec<(Bucket, f64, f64)>,
    timeline: Vec<Sample>,
    /// When each sample of `timeline` was taken, ms.
    sampled_ms: Vec<f64>,
}

impl Builder {
    pub fn new(cfg: &FleetConfig) -> Self {
        Builder {
            models: cfg.models.iter().map(|_| PerModel::default()).collect(),
            slots: Vec::new(),
            timeline: Vec::new(),
            sampled_ms: Vec::new(),
        }
    }

    /// A token of request `t` of model `m` at `now`.
    pub fn token_gap(&mut self, m: usize, t: &mut Timing, now: f64) {
        if t.tokens > 1 {
            self.models[m].itl.add(now - t.last_token);
        }
        t.last_token = now;
    }

    /// Replica `slot` of model `m` is in `bucket` with `gpus` from `now`.
    pub fn replica_state(&mut self, slot: usize, m: usize, now: f64, bucket: Bucket, gpus: f64) {
        if self.slots.len() <= slot {
            self.slots.resize(slot + 1, (Bucket::Gone, 0.0, now));
        }
        let (old, old_gpus, since) = self.slots[slot];
        let secs = (now - since).max(0.0) / 1000.0;
        let p = &mut self.models[m];
        match old {
            Bucket::Loading => p.gpu.loading += secs * old_gpus,
            Bucket::Idle => p.gpu.idle += secs * old_gpus,
            Bucket::Busy => p.gpu.busy += secs * old_gpus,
            Bucket::Warm => p.warm_s += secs,
            Bucket::Gone => {}
        }
        self.slots[slot] = (bucket, gpus, now);
    }

    pub fn cold_start(&mut self, m: usize, tier: StartTier, took_ms: f64) {
        let p = &mut self.models[m];
        match tier {
            StartTier::Cold => p.cold += 1,
            StartTier::Warm => p.warm += 1,
        }
        p.starts.push(took_ms);
    }

    pub fn decided(&mut self, m: usize, _now: f64, _decision: &Decision) {
        self.models[m].decisions += 1;
    }

    pub fn unplaceable(&mut self, m: usize) {
        self.models[m].unplaceable += 1;
    }

    pub fn sample(&mut self, now: f64, controller: &Controller, keys: &[ModelKey]) {
        let desired = keys.iter().map(|k| controller.scaler(k).map_or(0, |s| s.desired())).collect();
        let hot = keys
            .iter()
            .map(|k| controller.cluster().replicas_of(k, hangar_placement::Level::Hot).len() as u32)
            .collect();
        self.timeline.push(Sample { t_s: now / 1000.0, desired, hot, arrivals: 0, ttft_p99_ms: None });
        self.sampled_ms.push(now);
    }

    /// Books each request's arrival and first token into the window of
    /// the sample it follows. Done from the finished timings rather than
    /// as events come, so a first token at the very instant of a sample
    /// lands in the same window whatever order the two events took.
    fn fill_windows(&mut self, row_model: &[Option<usize>], timings: &[Timing]) {
        if self.timeline.is_empty() {
            return;
        }
        let window = |t: f64| self.sampled_ms.partition_point(|&s| s <= t).saturating_sub(1);
        let mut ttft = vec![Vec::new(); self.timeline.len()];
        for (t, _) in timings.iter().zip(row_model).filter(|(_, m)| m.is_some()) {
            self.timeline[window(t.arrived)].arrivals += 1;
            if let Some(first) = t.first_token {
                ttft[window(first)].push(first - t.arrived);
            }
        }
        for (sample, ttft) in self.timeline.iter_mut().zip(ttft) {
            sample.ttft_p99_ms = (!ttft.is_empty()).then(|| Stats::exact(ttft).p99);
        }
    }

    pub fn finish(
        mut self,
        cfg: &FleetConfig,
        trace: &Trace,
        row_model: &[Option<usize>],
        timings: &[Timing],
        controller: &Controller,
        end_ms: f64,
    ) -> FleetReport {
        let duration_s = (end_ms / 1000.0).max(1e-9);
        self.fill_windows(row_model, timings);
        let mut models = Vec::new();
        let mut all = Vec::new();
        for (m, (p, spec)) in self.models.into_iter().zip(&cfg.models).enumerate() {
            let rows: Vec<&Timing> =
                timings.iter().zip(row_model).filter(|(_, rm)| **rm == Some(m)).map(|(t, _)| t).collect();
            let scaler = controller.scaler(&spec.key);
            let report = model_report(
                spec.key.as_str(),
                scaler.map_or("", |s| s.policy()),
                &rows,
                spec.slo_ttft_ms as f64,
                duration_s,
                &p,
                scaler.map_or(0, |s| s.reversals()),
            );
            all.extend(rows.iter().map(|t| (*t, spec.slo_ttft_ms as f64)));
            models.push((report, p));
        }
        let total = total_report(&models, &all, duration_s);
        FleetReport {
            trace: trace.source.clone(),
            duration_s,
            models: models.into_iter().map(|(r, _)| r).collect(),
            total,
            timeline: self.timeline,
        }
    }
}

fn model_report(
    model: &str,
    policy: &str,
    rows: &[&Timing],
    slo_ms: f64,
    duration_s: f64,
    p: &PerModel,
    reversals: u64,
) -> ModelReport {
    let count = |o: Outcome| rows.iter().filter(|t| t.outcome == o).count() as u64;
    let completed: Vec<&&Timing> = rows.iter().filter(|t| t.outcome == Outcome::Completed).collect();
    let ttft: Vec<f64> = completed.iter().filter_map(|t| t.first_token.map(|f| f - t.arrived)).collect();
    let e2e: Vec<f64> = completed.iter().filter_map(|t| t.done.map(|d| d - t.arrived)).collect();
    let good =
        completed.iter().filter(|t| t.first_token.is_some_and(|f| f - t.arrived <= slo_ms)).count() as f64;
    let mut gpu = p.gpu;
    gpu.total = gpu.loading + gpu.idle + gpu.busy;
    ModelReport {
        model: model.to_owned(),
        policy: policy.to_owned(),
        requests: rows.len() as u64,
        completed: completed.len() as u64,
        rejected: count(Outcome::Rejected),
        timed_out: count(Outcome::TimedOut),
        failed: count(Outcome::Failed),
        ttft_ms: Stats::exact(ttft),
        itl_ms: p.itl.stats(),
        e2e_ms: Stats::exact(e2e),
        slo_ttft_ms: slo_ms,
        slo_attainment: if rows.is_empty() { 1.0 } else { good / rows.len() as f64 },
        goodput_rps: good / duration_s,
        gpu_seconds: gpu,
        warm_seconds: p.warm_s,
        goodput_per_gpu_hour: if gpu.total > 0.0 { good / (gpu.total / 3600.0) } else { 0.0 },
        cold_starts: ColdStarts { cold: p.cold, warm: p.warm, ms: Stats::exact(p.starts.clone()) },
        decisions: p.decisions,
        reversals,
        unplaceable: p.unplaceable,
    }
}

fn total_report(models: &[(ModelReport, PerModel)], all: &[(&Timing, f64)], duration_s: f64) -> ModelReport {
    let sum = |f: fn(&ModelReport) -> u64| models.iter().map(|(r, _)| f(r)).sum::<u64>();
    let completed: Vec<&(&Timing, f64)> =
        all.iter().filter(|(t, _)| t.outcome == Outcome::Completed).collect();
    let ttft: Vec<f64> = completed.iter().filter_map(|(t, _)| t.first_token.map(|f| f - t.arrived)).collect();
    let e2e: Vec<f64> = completed.iter().filter_map(|(t, _)| t.done.map(|d| d - t.arrived)).collect();
    let good =
        completed.iter().filter(|(t, slo)| t.first_token.is_some_and(|f| f - t.arrived <= *slo)).count()
            as f64;
    let mut gpu = GpuSeconds::default();
    let mut itl = LogHistogram::default();
    let mut starts = Vec::new();
    let mut warm_s = 0.0;
    for (r, p) in models {
        gpu.loading += r.gpu_seconds.loading;
        gpu.idle += r.gpu_seconds.idle;
        gpu.busy += r.gpu_seconds.busy;
        warm_s += p.warm_s;
        itl.merge(&p.itl);
        starts.extend_from_slice(&p.starts);
    }
    gpu.total = gpu.loading + gpu.idle + gpu.busy;
    ModelReport {
        model: "*".into(),
        policy: models.first().map(|(r, _)| r.policy.clone()).unwrap_or_default(),
        requests: all.len() as u64,
        completed: completed.len() as u64,
        rejected: sum(|r| r.rejected),
        timed_out: sum(|r| r.timed_out),
        failed: sum(|r| r.failed),
        ttft_ms: Stats::exact(ttft),
        itl_ms: itl.stats(),
        e2e_ms: Stats::exact(e2e),
        slo_ttft_ms: f64::NAN,
        slo_attainment: if all.is_empty() { 1.0 } else { good / all.len() as f64 },
        goodput_rps: good / duration_s,
        gpu_seconds: gpu,
        warm_seconds: warm_s,
        goodput_per_gpu_hour: if gpu.total > 0.0 { good / (gpu.total / 3600.0) } else { 0.0 },
        cold_starts: ColdStarts {
            cold: sum(|r| r.cold_starts.cold),
            warm: sum(|r| r.cold_starts.warm),
            ms: Stats::exact(starts),
        },
        decisions: sum(|r| r.decisions),
        reversals: sum(|r| r.reversals),
        unplaceable: sum(|r| r.unplaceable),
    }
}

impl ModelReport {
    /// The header of [`row`](Self::row)s, starting with `first`.
    pub fn header(first: &str) -> String {
        format!(
            "{first:<22} {:<10} {:>8} {:>8} {:>6} {:>6} {:>9} {:>9} {:>7} {:>9} {:>9} {:>10} {:>7} {:>5} {:>5}",
            "policy", "requests", "done", "429", "504", "TTFT p50", "TTFT p99", "SLO %", "goodput/s", "GPU-h",
            "good/GPU-h", "starts", "dec", "rev"
        )
    }

    /// One table row: the model (or the policy, in `sim compare`) and its
    /// figures.
    pub fn row(&self, first: &str) -> String {
        format!(
            "{first:<22} {:<10} {:>8} {:>8} {:>6} {:>6} {:>9.0} {:>9.0} {:>7.1} {:>9.2} {:>9.3} {:>10.0} {:>7} {:>5} {:>5}",
            self.policy,
            self.requests,
            self.completed,
            self.rejected,
            self.timed_out,
            self.ttft_ms.p50,
            self.ttft_ms.p99,
            self.slo_attainment * 100.0,
            self.goodput_rps,
            self.gpu_seconds.total / 3600.0,
            self.goodput_per_gpu_hour,
            self.cold_starts.cold + self.cold_starts.warm,
            self.decisions,
            self.reversals,
        )
    }
}

impl FleetReport {
    /// The report as a table, one row per model and the total.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "fleet simulation of {} over {:.1} s", self.trace, self.duration_s);
        let _ = writeln!(out, "{}", ModelReport::header("model"));
        for r in self.models.iter().chain([&self.total]) {
            let _ = writeln!(out, "{}", r.row(&r.model));
        }
        let g = &self.total.gpu_seconds;
        let _ = writeln!(
            out,
            "GPU-seconds: loading {:.0}, idle {:.0}, busy {:.0}; WARM replica-seconds {:.0}; cold starts p50 {:.0} ms, p99 {:.0} ms",
            g.loading, g.idle, g.busy, self.total.warm_seconds, self.total.cold_starts.ms.p50, self.total.cold_starts.ms.p99
        );
        out
    }
}
