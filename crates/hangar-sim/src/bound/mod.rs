//! The hindsight bound: the fewest GPU-hours any schedule of replica
//! counts could use on a fleet, knowing its whole trace in advance, while
//! answering a share of the requests (99 %) within each model's TTFT
//! objective — on the fleet simulation's own engine and cold-start model.
//! A policy's GPU-hours divided by it say how far from the best possible
//! it is; no policy run in the simulator can get below it
//! (`tests/bound.rs` checks that on random fleets and traces).
//!
//! # What it counts
//!
//! A model's GPU time is, for each replica, its GPUs times the time from
//! the start of its load to its end. Write `n(t)` for the replicas of a
//! model that are up (ready or finishing their requests). Every rise of
//! `n` is one replica finishing a load, which held its GPUs for the
//! load's length before — at least `restart`, the shortest load the
//! fleet file allows (a WARM wake, or a start from the page cache), and
//! for the model's first, a read from disk plus the engine's boot. So a
//! model costs at least `g · (∫ n + restart · rises + first-load extra)`,
//! `g` the fewest GPUs one of its replicas can hold, and, splitting `n`
//! into layers (`n ≥ 1`, `n ≥ 2`, …):
//!
//! 1. **The first layer** ([`cover`]): a request answered within the
//!    objective was granted a permit on an up replica at some
//!    `g ∈ [a, d]` — `a` its arrival, `d` the latest grant whose first
//!    token can still come in time — and held it for at least `s`, its
//!    least service; its replica stays up meanwhile. So `n ≥ 1` on an
//!    interval of length `s` starting in `[a, d]`, and each interval on
//!    which `n ≥ 1` begins with a rise. The least cost of that is solved
//!    exactly (an exact search over where the intervals end; brute force
//!    agrees on every small case of the tests).
//! 2. **The layers above** ([`capacity`]): a replica has `concurrency`
//!    permits, so in any window the up-time is at least the permit-time
//!    the window's requests must hold there over `concurrency`; what
//!    exceeds the window's length must come from a second replica or
//!    more. The best split of time into windows is found exactly.
//!
//! `a`, `d` and `s` come from the engine's timing model ([`jobs`]): the
//! least time the prefill and each later token take on an engine with no
//! other work and every shareable prefix cached. Everything the bound
//! leaves out only lowers it: contention between models for GPUs, the
//! time between a rise of `n ≥ 2` and its replica's load, the fleet's
//! `min_replicas`, queueing, requests that miss the objective anyway.
//!
//! # The 1 % let go
//!
//! With 99 % of `N` requests to answer, a schedule may give up on
//! `N − ⌈0.99 N⌉` of them, first the ones that can never be on time (no
//! output token, or a prefill longer than the objective). Giving up on
//! requests saves in the first layer at most the least of three
//! ([`letgo`]): a service and a restart each (the optimum with them is at
//! most the optimum without them plus a component of their own); the
//! time they alone pin up and a share of a restart each (filling their
//! service into an optimum without them, which must stay up wherever a
//! request kept must be served — so among dense traffic one request let
//! go saves little); and the whole segment they are in (requests a
//! restart or more apart from the rest are solved apart). In the layers
//! above each saves at most `s / concurrency`. The bound subtracts the
//! most the allowance could save that way, so it stays a bound —
//! conservative by up to `gpu_hours_all − gpu_hours`, which the report
//! states.
//! [`HindsightBound::at`] takes off the allowance of any other share the
//! same way: a run that answered 90 % in time is held to the bound at
//! 90 %, which it cannot beat either.
//!
//! # Its one assumption about the simulator
//!
//! A replica is up only after its load finished, and a model's first
//! replica loads from disk. Today's simulator lets a replica given back
//! while still loading go WARM, and a later wake skips the rest of that
//! first read (issue 28's fidelity item); a run that does so can come in
//! under the bound by at most that model's `(first load − restart) · g`.

mod capacity;
mod cover;
mod jobs;
mod letgo;

use hangar_placement::Shape;
use serde::Serialize;

use crate::fleet::FleetConfig;
use crate::trace::Trace;

/// How the bound reads a trace: the same settings as the fleet run it is
/// compared with.
#[derive(Debug, Clone, PartialEq)]
pub struct BoundOptions {
    /// The share of requests answered within the objective (0.99).
    pub attainment: f64,
    /// Divides the time between trace arrivals, as the run's.
    pub speedup: f64,
    /// Tokens per trace `hash_id`, as the run's.
    pub trace_block_size: u32,
    /// Drop rows naming a model the fleet does not serve, as the run's.
    pub skip_unknown: bool,
}

impl Default for BoundOptions {
    fn default() -> Self {
        BoundOptions { attainment: 0.99, speedup: 1.0, trace_block_size: 512, skip_unknown: false }
    }
}

/// Why a bound cannot be computed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum BoundError {
    /// The fleet file or an option cannot work.
    #[error("{0}")]
    Config(String),
    /// A row names a model the fleet does not serve.
    #[error("line {line}: model `{model}` is not in the fleet (add it, or skip unknown models)")]
    UnknownModel {
        /// The row's line.
        line: usize,
        /// The model it names (empty: none, on a fleet of several).
        model: String,
    },
}

/// The hindsight bound of one trace on one fleet.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HindsightBound {
    /// The share of requests it answers within the objective.
    pub attainment: f64,
    /// Requests the fleet serves.
    pub requests: u64,
    /// Requests no schedule answers within the objective.
    pub unservable: u64,
    /// The fewest GPU-hours at `attainment`; `None` when the unservable
    /// requests alone are more than `1 − attainment` of them.
    pub gpu_hours: Option<f64>,
    /// The fewest GPU-hours answering every servable request in time
    /// (before the allowance is taken off).
    pub gpu_hours_all: f64,
    /// Whether every first-layer search finished; if not, a weaker (still
    /// valid) bound stands in for the unfinished ones.
    pub exact: bool,
    /// Per model, in fleet order.
    pub models: Vec<ModelBound>,
    /// What giving requests up may save, for [`HindsightBound::at`].
    #[serde(skip)]
    allowance: Allowance,
}

/// What a schedule may save by giving up requests (see the module docs,
/// "The 1 % let go"), in GPU-µs, each list largest first.
#[derive(Debug, Clone, Default, PartialEq)]
struct Allowance {
    /// Per request, in the first layer (capped per segment).
    first_layer: Vec<f64>,
    /// Per request, in the layers above.
    beyond: Vec<f64>,
    /// Per model: its requests, and its first load's extra.
    first_loads: Vec<(u64, f64)>,
}

impl HindsightBound {
    /// The fewest GPU-hours any schedule needs to answer a share
    /// `attainment` of the requests within the objective (0–1), as
    /// [`gpu_hours`](Self::gpu_hours) is at the bound's own: `None` when
    /// the unservable requests alone are more than `1 − attainment` of
    /// them. A run of the same trace and fleet whose SLO attainment is
    /// `attainment` uses at least this many GPU-hours, whatever its
    /// policy: the bound a run is judged against at what it achieved.
    pub fn at(&self, attainment: f64) -> Option<f64> {
        let needed = fewest_on_time(self.requests, attainment.clamp(0.0, 1.0));
        let allowance = (self.requests - needed).checked_sub(self.unservable)? as usize;
        let a = &self.allowance;
        let top = |v: &[f64]| v.iter().take(allowance).sum::<f64>();
        // A model with no more requests than the allowance may be given
        // up whole, its first load with it.
        let whole: f64 = a.first_loads.iter().filter(|(n, _)| *n as usize <= allowance).map(|(_, x)| x).sum();
        let saved = top(&a.first_layer) + top(&a.beyond) + whole;
        Some((self.gpu_hours_all * 3.6e9 - saved).max(0.0) / 3.6e9)
    }
}

/// One model's share of the bound, every servable request answered.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelBound {
    /// The model.
    pub model: String,
    /// Its requests.
    pub requests: u64,
    /// Those no schedule answers within the objective.
    pub unservable: u64,
    /// The fewest GPUs a replica holds.
    pub gpus_per_replica: f64,
    /// Its first load, s: from disk, plus the engine's boot.
    pub first_load_s: f64,
    /// The shortest load, s: a WARM wake, a start from the page cache or
    /// from disk, whichever the fleet makes shortest.
    pub restart_s: f64,
    /// Replica-seconds with one replica up, loads included.
    pub first_layer_s: f64,
    /// Replica-seconds of replicas beyond the first.
    pub beyond_one_s: f64,
    /// The two, and the first load's extra, in GPU-hours.
    pub gpu_hours: f64,
}

/// States a first-layer search may visit per model before a weaker bound
/// stands in: far above what hour-long traces of thousands of requests a
/// minute need, and a few seconds of work.
const SEARCH_BUDGET: usize = 4_000_000;

/// The hindsight bound of `trace` on the fleet `cfg` (see the module
/// docs). Deterministic: the same inputs give the same figures.
pub fn hindsight_bound(
    trace: &Trace,
    cfg: &FleetConfig,
    opts: &BoundOptions,
) -> Result<HindsightBound, BoundError> {
    if !(opts.attainment > 0.0 && opts.attainment <= 1.0) {
        return Err(BoundError::Config(format!(
            "attainment {} must be above 0 and at most 1",
            opts.attainment
        )));
    }
    if !(opts.speedup.is_finite() && opts.speedup > 0.0) {
        return Err(BoundError::Config(format!("speedup {} must be a number above 0", opts.speedup)));
    }
    cfg.validate().map_err(|e| BoundError::Config(e.to_string()))?;
    let per_model =
        jobs::by_model(&trace.requests, cfg, opts.speedup, opts.trace_block_size, opts.skip_unknown)?;

    let mut models = Vec::new();
    // What giving up on one request may save, in GPU-µs: in the first
    // layer (per segment, largest first, capped at the segment's cost)
    // and in the layers above.
    let mut first_layer_savings: Vec<f64> = Vec::new();
    let mut beyond_savings: Vec<f64> = Vec::new();
    let mut exact = true;
    let mut all_gpu_us = 0.0;
    let mut first_loads = Vec::new();
    for (spec, mj) in cfg.models.iter().zip(&per_model) {
        let g = gpus_per_replica(cfg, spec);
        let size_gb = spec.size.bytes() as f64 / 1e9;
        let cs = &cfg.cold_start;
        let first_ms = size_gb / cs.disk_gbps * 1000.0 + cs.boot_ms as f64;
        let page_ms = size_gb / cs.page_cache_gbps * 1000.0 + cs.boot_ms as f64;
        let restart_ms = (size_gb / cs.wake_gbps * 1000.0).min(page_ms).min(first_ms);
        let restart = (restart_ms * 1000.0).floor() as i64;
        let first_extra = ((first_ms * 1000.0).floor() as i64 - restart).max(0);

        let mut first_layer = 0i64;
        for seg in cover::segments(&mj.jobs, restart) {
            let solved = cover::min_cover(&seg, restart, SEARCH_BUDGET);
            exact &= solved.exact;
            first_layer += solved.cost;
            first_layer_savings
                .extend(letgo::marginals(&seg, restart, solved.cost).into_iter().map(|x| x * g));
        }
        let beyond = capacity::beyond_one(&mj.jobs, spec.concurrency);
        let permits = f64::from(spec.concurrency.max(1));
        beyond_savings.extend(mj.jobs.iter().map(|j| j.s as f64 / permits * g));
        let extra = if mj.jobs.is_empty() { 0 } else { first_extra };
        let gpu_us = (first_layer + extra + beyond) as f64 * g;
        all_gpu_us += gpu_us;
        first_loads.push((mj.jobs.len() as u64, extra as f64 * g));
        models.push(ModelBound {
            model: spec.key.to_string(),
            requests: mj.jobs.len() as u64 + mj.unservable,
            unservable: mj.unservable,
            gpus_per_replica: g,
            first_load_s: first_ms / 1000.0,
            restart_s: restart_ms / 1000.0,
            first_layer_s: first_layer as f64 / 1e6,
            beyond_one_s: beyond as f64 / 1e6,
            gpu_hours: gpu_us / 3.6e9,
        });
    }

    let requests: u64 = models.iter().map(|m| m.requests).sum();
    let unservable: u64 = models.iter().map(|m| m.unservable).sum();
    let largest_first = |mut v: Vec<f64>| {
        v.sort_unstable_by(|a, b| b.total_cmp(a));
        v
    };
    let mut bound = HindsightBound {
        attainment: opts.attainment,
        requests,
        unservable,
        gpu_hours: None,
        gpu_hours_all: all_gpu_us / 3.6e9,
        exact,
        models,
        allowance: Allowance {
            first_layer: largest_first(first_layer_savings),
            beyond: largest_first(beyond_savings),
            first_loads,
        },
    };
    bound.gpu_hours = bound.at(opts.attainment);
    Ok(bound)
}

/// The fewest requests of `n` answered in time for `good / n ≥ share`, as
/// the report computes attainment.
fn fewest_on_time(n: u64, share: f64) -> u64 {
    if n == 0 {
        return 0;
    }
    let mut k = ((share * n as f64).ceil() as u64).min(n);
    while k > 0 && (k - 1) as f64 / n as f64 >= share {
        k -= 1;
    }
    while k < n && (k as f64 / n as f64) < share {
        k += 1;
    }
    k
}

/// The fewest GPUs one replica of `model` holds on any node group that may
/// take it, as placement sizes it.
fn gpus_per_replica(cfg: &FleetConfig, model: &crate::fleet::FleetModel) -> f64 {
    let fits = |g: &crate::fleet::FleetNodes| {
        let kind = g.gpu_kind.as_deref().unwrap_or("gpu");
        model.gpu_kind.as_deref().is_none_or(|k| k == kind)
            && model.min_gpu_memory.is_none_or(|m| m.bytes() <= g.gpu_memory.bytes())
    };
    let share = |g: &crate::fleet::FleetNodes| {
        let memory = g.gpu_memory.bytes();
        match Shape::for_model(&cfg.placement, model.size.bytes(), memory) {
            Some(Shape::Share { bytes, .. }) => bytes as f64 / memory as f64,
            Some(Shape::Whole { gpus }) => f64::from(gpus),
            None => f64::INFINITY,
        }
    };
    let candidates = cfg.nodes.iter().filter(|g| fits(g)).map(share).fold(f64::INFINITY, f64::min);
    if candidates.is_finite() {
        candidates
    } else {
        cfg.nodes.iter().map(share).fold(f64::INFINITY, f64::min)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fewest_on_time_matches_the_reports_attainment() {
        for n in 1..2000u64 {
            let k = fewest_on_time(n, 0.99);
            assert!(k as f64 / n as f64 >= 0.99, "{n}: {k}");
            assert!(k == 0 || ((k - 1) as f64 / n as f64) < 0.99, "{n}: {k}");
        }
        assert_eq!(fewest_on_time(100, 0.99), 99);
        assert_eq!(fewest_on_time(0, 0.99), 0);
        assert_eq!(fewest_on_time(7, 1.0), 7);
    }
}
