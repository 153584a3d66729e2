//! What a fleet simulation measured, per model and in total.

use std::fmt::Write as _;

use hangar_core::{Millis, ModelKey};
use hangar_scaler::{Controller, Decision, StartTier};
use serde::Serialize;

use super::{FleetConfig, Outcome, Timing};
use crate::stats::{LogHistogram, Stats};

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
    /// Of the WARM wakes, those of a hotswap model: *swaps* (its copy
    /// swapped out to the warm cache, swapped back in).
    pub swaps: u64,
    /// Start time of both, ms.
    pub ms: Stats,
}

/// What a model's replicas did with LoRA adapters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct AdapterCounts {
    /// Requests that named an adapter.
    pub requests: u64,
    /// Those that found their adapter loaded on the replica they were
    /// given (they waited for no load).
    pub hits: u64,
    /// Adapter loads carried out.
    pub loads: u64,
    /// Adapter unloads carried out.
    pub unloads: u64,
    /// Time from a request's permit to its adapter being loaded there,
    /// ms (0 for a hit), over the requests that got that far.
    pub wait_ms: Stats,
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
    /// Its adapters.
    pub adapters: AdapterCounts,
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
    /// What the control loop was told and decided, in order (with
    /// `record_control`; not in the JSON).
    #[serde(skip)]
    pub control_record: Vec<hangar_scaler::Input>,
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
    swaps: u64,
    decisions: u64,
    unplaceable: u64,
    /// Requests ended, by how.
    requests: u64,
    rejected: u64,
    timed_out: u64,
    failed: u64,
    /// TTFT and end-to-end latency of each completed request (ms): one
    /// number each per request, so the percentiles stay exact.
    ttft: Vec<f64>,
    e2e: Vec<f64>,
    /// Completed within the objective.
    good: u64,
    adapters: AdapterCounts,
    /// Each adapter request's wait for its adapter, ms.
    adapter_waits: Vec<f64>,
}

/// Collects as the simulation runs. Each request is booked once, as it
/// ends ([`ended`](Self::ended)), so nothing per request outlives it but
/// its latencies.
pub(crate) struct Builder {
    models: Vec<PerModel>,
    /// The TTFT objective of each model, ms.
    slo_ms: Vec<f64>,
    /// Per replica slot: its current bucket, GPUs and since when.
    slots: Vec<(Bucket, f64, f64)>,
    timeline: Vec<Sample>,
    /// The timeline's period (ms); 0: none.
    sample_ms: f64,
    /// Per window of the timeline: arrivals, and the TTFTs of the first
    /// tokens sent in it.
    windows: Vec<(u64, Vec<f64>)>,
}

impl Builder {
    pub fn new(cfg: &FleetConfig, sample_ms: Millis) -> Self {
        Builder {
            models: cfg.models.iter().map(|_| PerModel::default()).collect(),
            slo_ms: cfg.models.iter().map(|m| m.slo_ttft_ms as f64).collect(),
            slots: Vec::new(),
            timeline: Vec::new(),
            sample_ms: sample_ms as f64,
            windows: Vec::new(),
        }
    }

    /// A token of model `m` came `gap` ms after its request's previous one.
    pub fn token_gap(&mut self, m: usize, gap: f64) {
        self.models[m].itl.add(gap);
    }

    /// Request `t` of model `m` ended (its `outcome` and `done` set).
    pub fn ended(&mut self, m: usize, t: &Timing) {
        let p = &mut self.models[m];
        p.requests += 1;
        match t.outcome {
            Outcome::Completed => {
                let ttft = t.first_token.map(|f| f - t.arrived);
                p.ttft.extend(ttft);
                p.e2e.extend(t.done.map(|d| d - t.arrived));
                if ttft.is_some_and(|v| v <= self.slo_ms[m]) {
                    p.good += 1;
                }
            }
            Outcome::Rejected => p.rejected += 1,
            Outcome::TimedOut => p.timed_out += 1,
            Outcome::Failed | Outcome::Pending => p.failed += 1,
        }
        if self.sample_ms > 0.0 {
            self.window(t.arrived).0 += 1;
            if let Some(first) = t.first_token {
                self.window(first).1.push(first - t.arrived);
            }
        }
    }

    /// The window of the timeline `t` falls in: samples are taken every
    /// `sample_ms` from 0, so it is told by `t` alone, whatever order
    /// the sample and the event took at the same instant.
    fn window(&mut self, t: f64) -> &mut (u64, Vec<f64>) {
        let k = (t / self.sample_ms).floor().max(0.0) as usize;
        if self.windows.len() <= k {
            self.windows.resize_with(k + 1, Default::default);
        }
        &mut self.windows[k]
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

    /// A replica of model `m` came up from `tier` after `took_ms`; a WARM
    /// wake of a `hotswap` model is a swap.
    pub fn cold_start(&mut self, m: usize, tier: StartTier, hotswap: bool, took_ms: f64) {
        let p = &mut self.models[m];
        match tier {
            StartTier::Cold => p.cold += 1,
            StartTier::Warm => p.warm += 1,
        }
        p.swaps += u64::from(hotswap && tier == StartTier::Warm);
        p.starts.push(took_ms);
    }

    pub fn decided(&mut self, m: usize, _now: f64, _decision: &Decision) {
        self.models[m].decisions += 1;
    }

    pub fn unplaceable(&mut self, m: usize) {
        self.models[m].unplaceable += 1;
    }

    /// A request of model `m` names an adapter.
    pub fn adapter_request(&mut self, m: usize) {
        self.models[m].adapters.requests += 1;
    }

    /// An adapter load began on a replica of model `m`.
    pub fn adapter_load(&mut self, m: usize) {
        self.models[m].adapters.loads += 1;
    }

    /// An adapter was unloaded from a replica of model `m`.
    pub fn adapter_unload(&mut self, m: usize) {
        self.models[m].adapters.unloads += 1;
    }

    /// A request of model `m` may run: its adapter is loaded where it was
    /// granted, `waited` ms after the grant.
    pub fn adapter_ready(&mut self, m: usize, waited: f64) {
        let p = &mut self.models[m];
        if waited <= 0.0 {
            p.adapters.hits += 1;
        }
        p.adapter_waits.push(waited.max(0.0));
    }

    pub fn sample(&mut self, now: f64, controller: &Controller, keys: &[ModelKey]) {
        let desired = keys.iter().map(|k| controller.scaler(k).map_or(0, |s| s.desired())).collect();
        let hot = keys
            .iter()
            .map(|k| controller.cluster().count_of(k, hangar_placement::Level::Hot) as u32)
            .collect();
        self.timeline.push(Sample { t_s: now / 1000.0, desired, hot, arrivals: 0, ttft_p99_ms: None });
    }

    /// Books each window's arrivals and first tokens into its sample; a
    /// window past the last sample belongs to the last.
    fn fill_windows(&mut self) {
        let Some(last) = self.timeline.len().checked_sub(1) else { return };
        let mut ttft = vec![Vec::new(); self.timeline.len()];
        for (k, (arrivals, firsts)) in std::mem::take(&mut self.windows).into_iter().enumerate() {
            self.timeline[k.min(last)].arrivals += arrivals;
            ttft[k.min(last)].extend(firsts);
        }
        for (sample, ttft) in self.timeline.iter_mut().zip(ttft) {
            sample.ttft_p99_ms = (!ttft.is_empty()).then(|| Stats::exact(ttft).p99);
        }
    }

    pub fn finish(
        mut self,
        cfg: &FleetConfig,
        source: &str,
        controller: &Controller,
        end_ms: f64,
    ) -> FleetReport {
        let duration_s = (end_ms / 1000.0).max(1e-9);
        self.fill_windows();
        // The totals first, so each model's samples can then go into its
        // own figures without a copy: an hour of a busy fleet keeps some
        // 70 M of each, and three copies at once were its peak memory.
        let all = totals(&self.models);
        let mut models = Vec::new();
        let mut reversals = 0;
        for (p, spec) in self.models.into_iter().zip(&cfg.models) {
            let scaler = controller.scaler(&spec.key);
            let report = model_report(
                spec.key.as_str(),
                scaler.map_or("", |s| s.policy()),
                p,
                spec.slo_ttft_ms as f64,
                duration_s,
                scaler.map_or(0, |s| s.reversals()),
            );
            reversals += report.reversals;
            models.push(report);
        }
        let policy = models.first().map_or("", |r| r.policy.as_str()).to_owned();
        let total = model_report("*", &policy, all, f64::NAN, duration_s, reversals);
        FleetReport {
            trace: source.to_owned(),
            duration_s,
            models,
            total,
            timeline: self.timeline,
            control_record: Vec::new(),
        }
    }
}

fn model_report(
    model: &str,
    policy: &str,
    p: PerModel,
    slo_ms: f64,
    duration_s: f64,
    reversals: u64,
) -> ModelReport {
    let mut gpu = p.gpu;
    gpu.total = gpu.loading + gpu.idle + gpu.busy;
    let good = p.good as f64;
    ModelReport {
        model: model.to_owned(),
        policy: policy.to_owned(),
        requests: p.requests,
        completed: p.e2e.len() as u64,
        rejected: p.rejected,
        timed_out: p.timed_out,
        failed: p.failed,
        ttft_ms: Stats::exact(p.ttft),
        itl_ms: p.itl.stats(),
        e2e_ms: Stats::exact(p.e2e),
        slo_ttft_ms: slo_ms,
        slo_attainment: if p.requests == 0 { 1.0 } else { good / p.requests as f64 },
        goodput_rps: good / duration_s,
        gpu_seconds: gpu,
        warm_seconds: p.warm_s,
        goodput_per_gpu_hour: if gpu.total > 0.0 { good / (gpu.total / 3600.0) } else { 0.0 },
        cold_starts: ColdStarts { cold: p.cold, warm: p.warm, swaps: p.swaps, ms: Stats::exact(p.starts) },
        decisions: p.decisions,
        reversals,
        unplaceable: p.unplaceable,
        adapters: AdapterCounts { wait_ms: Stats::exact(p.adapter_waits), ..p.adapters },
    }
}

/// Every model's figures added up, each list of samples allocated once at
/// its full length.
fn totals(models: &[PerModel]) -> PerModel {
    let joined = |list: fn(&PerModel) -> &Vec<f64>| {
        let mut all = Vec::with_capacity(models.iter().map(|p| list(p).len()).sum());
        for p in models {
            all.extend_from_slice(list(p));
        }
        all
    };
    let mut all = PerModel {
        ttft: joined(|p| &p.ttft),
        e2e: joined(|p| &p.e2e),
        starts: joined(|p| &p.starts),
        adapter_waits: joined(|p| &p.adapter_waits),
        ..PerModel::default()
    };
    for p in models {
        all.gpu.loading += p.gpu.loading;
        all.gpu.idle += p.gpu.idle;
        all.gpu.busy += p.gpu.busy;
        all.warm_s += p.warm_s;
        all.itl.merge(&p.itl);
        all.cold += p.cold;
        all.warm += p.warm;
        all.swaps += p.swaps;
        all.decisions += p.decisions;
        all.unplaceable += p.unplaceable;
        all.requests += p.requests;
        all.rejected += p.rejected;
        all.timed_out += p.timed_out;
        all.failed += p.failed;
        all.good += p.good;
        all.adapters.requests += p.adapters.requests;
        all.adapters.hits += p.adapters.hits;
        all.adapters.loads += p.adapters.loads;
        all.adapters.unloads += p.adapters.unloads;
    }
    all
}

impl ModelReport {
    /// The header of [`row`](Self::row)s, starting with `first`.
    pub fn header(first: &str) -> String {
        format!(
            "{first:<28} {:<10} {:>8} {:>8} {:>6} {:>6} {:>9} {:>9} {:>7} {:>9} {:>9} {:>10} {:>7} {:>5} {:>5} {:>8}",
            "policy", "requests", "done", "429", "504", "TTFT p50", "TTFT p99", "SLO %", "goodput/s", "GPU-h",
            "good/GPU-h", "starts", "dec", "rev", "ad loads"
        )
    }

    /// One table row: the model (or the policy, in `sim compare`) and its
    /// figures.
    pub fn row(&self, first: &str) -> String {
        format!(
            "{first:<28} {:<10} {:>8} {:>8} {:>6} {:>6} {:>9.0} {:>9.0} {:>7.1} {:>9.2} {:>9.3} {:>10.0} {:>7} {:>5} {:>5} {:>8}",
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
            self.adapters.loads,
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
        let a = &self.total.adapters;
        if a.requests > 0 {
            let _ = writeln!(
                out,
                "adapters: {} requests, {:.1} % found theirs loaded; {} loads, {} unloads; wait for a load p50 {:.0} ms, p99 {:.0} ms",
                a.requests,
                a.hits as f64 * 100.0 / a.requests as f64,
                a.loads,
                a.unloads,
                a.wait_ms.p50,
                a.wait_ms.p99
            );
        }
        out
    }
}
