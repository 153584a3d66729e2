//! Trace rows as the bound sees them: per model, each request's arrival,
//! the latest moment it can be granted a permit and still meet the TTFT
//! objective, and the least time it holds that permit — each rounded so
//! the bound only gets looser (earlier arrivals, later deadlines, shorter
//! services).
//!
//! The floors come from the model's engine timing and hold for every
//! schedule the engine could run:
//!
//! - a request's first token ends the pass that computes the last of its
//!   uncached prompt tokens; those tokens take at least `⌈U / B⌉` passes
//!   (`B` the most prompt tokens a pass computes), and a pass with `T`
//!   prompt tokens lasts at least `prefill_ms(T)` whatever else it runs.
//!   With `f` convex and non-decreasing on whole tokens (true of the
//!   `polynomial` and `fixed` models, the two a fleet's engines may use),
//!   `f(c) ≥ f(1) + (c − 1)(f(2) − f(1))`, so the passes last at least
//!   `K(2f(1) − f(2)) + U(f(2) − f(1))` for the pass count `K`, least at
//!   `K = ⌈U / B⌉` or `K = U`;
//! - `U`, the uncached tokens, is at least one (an engine always computes
//!   the last prompt token) and at least the tokens outside the longest
//!   prefix of the prompt's blocks that another request of the same model
//!   also has: nothing else can have put them in a cache;
//! - every later token takes one more pass, at least `decode_ms` at the
//!   request's own context (the models grow with context) or a prefill
//!   pass's `prefill_ms(1)`, whichever is less.
//!
//! Divided by the engine's `speedup_ratio`, as its passes are.

use std::collections::BTreeMap;

use hangar_core::{mix64, ModelKey};
use hangar_engine::timing::{DecodeShape, PrefillShape, SharedTiming};
use hangar_engine::SchedulerKind;

use super::BoundError;
use crate::fleet::{model_of, no_tables, FleetConfig, FleetModel};
use crate::trace::TraceRequest;

/// One request, in integer microseconds on the fleet's clock (0 at the
/// first served arrival).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Job {
    /// Arrival, rounded down.
    pub a: i64,
    /// The latest grant that can still meet the objective, rounded up.
    pub d: i64,
    /// The least time the request holds its permit once granted (and its
    /// replica stays up), rounded down.
    pub s: i64,
}

impl Job {
    /// The earliest it can end: arrival plus service.
    pub fn e(&self) -> i64 {
        self.a + self.s
    }
}

/// One model's requests, in arrival order, and those that can never meet
/// the objective.
#[derive(Debug, Default)]
pub(crate) struct ModelJobs {
    pub jobs: Vec<Job>,
    /// Requests with no output token (their TTFT is never measured), with
    /// an empty prompt (an engine refuses it), or whose prefill alone
    /// outlasts the objective.
    pub unservable: u64,
}

/// What a model's engine takes at least, from its timing model.
struct Floors {
    timing: SharedTiming,
    /// `prefill_ms(1)` and `prefill_ms(2)`.
    f1: f64,
    f2: f64,
    /// The most prompt tokens one pass computes.
    per_pass: u32,
    capacity_tokens: u64,
    speedup: f64,
    prefix_caching: bool,
}

impl Floors {
    fn new(model: &FleetModel) -> Result<Self, BoundError> {
        let engine = &model.engine;
        let timing = engine.build_timing(no_tables).map_err(|e| BoundError::Config(e.to_string()))?;
        let f = |t| timing.prefill_ms(PrefillShape { batch: 1, new_tokens: t });
        let (f1, f2) = (f(1), f(2));
        Ok(Floors {
            f1,
            f2,
            timing,
            per_pass: match engine.scheduler {
                SchedulerKind::Vllm if engine.enable_chunked_prefill => engine.max_num_batched_tokens,
                // Without chunks a prompt is computed in one pass.
                SchedulerKind::Vllm => u32::MAX,
                SchedulerKind::Sglang => engine.sglang.chunked_prefill_size,
            }
            .max(1),
            capacity_tokens: engine.capacity_tokens(),
            speedup: engine.speedup_ratio,
            prefix_caching: engine.enable_prefix_caching,
        })
    }

    /// The least time, ms, from a request's first pass to its first
    /// token with `uncached` prompt tokens to compute.
    fn first_token_ms(&self, uncached: u32) -> f64 {
        let u = f64::from(uncached.max(1));
        let fewest = f64::from(uncached.max(1).div_ceil(self.per_pass));
        let at = |passes: f64| passes * (2.0 * self.f1 - self.f2) + u * (self.f2 - self.f1);
        at(fewest).min(at(u)).max(0.0) / self.speedup
    }

    /// The least time, ms, of each pass after the first token of a
    /// request with `input` prompt tokens.
    fn token_ms(&self, input: u32) -> f64 {
        let decode = self.timing.decode_ms(DecodeShape {
            batch: 1,
            context_tokens: u64::from(input) + 1,
            capacity_tokens: self.capacity_tokens,
        });
        decode.min(self.f1).max(0.0) / self.speedup
    }
}

/// Rows in time order (a stable sort, as the fleet simulation takes
/// them) split by model, with arrivals on the simulation's clock.
pub(crate) fn by_model(
    rows: &[TraceRequest],
    cfg: &FleetConfig,
    speedup: f64,
    trace_block_size: u32,
    skip_unknown: bool,
) -> Result<Vec<ModelJobs>, BoundError> {
    let by_key: BTreeMap<ModelKey, usize> =
        cfg.models.iter().enumerate().map(|(i, m)| (m.key.clone(), i)).collect();
    let mut order: Vec<(usize, usize)> = Vec::with_capacity(rows.len());
    for (i, row) in rows.iter().enumerate() {
        match model_of(row, cfg, &by_key) {
            Some(m) => order.push((i, m)),
            None if skip_unknown => {}
            None => {
                return Err(BoundError::UnknownModel {
                    line: row.line,
                    model: row.model.clone().unwrap_or_default(),
                })
            }
        }
    }
    order.sort_by(|x, y| rows[x.0].timestamp_ms.total_cmp(&rows[y.0].timestamp_ms));
    let t0 = order.first().map_or(0.0, |&(i, _)| rows[i].timestamp_ms);
    // How many requests of each model share each prompt prefix (chained
    // block ids): a prefix only one request has is computed by it.
    let mut prefixes: Vec<BTreeMap<u64, u32>> = vec![BTreeMap::new(); cfg.models.len()];
    for &(i, m) in &order {
        let mut h = 0;
        for &id in &rows[i].hash_ids {
            h = mix64(h, id);
            *prefixes[m].entry(h).or_default() += 1;
        }
    }
    let floors = cfg.models.iter().map(Floors::new).collect::<Result<Vec<_>, _>>()?;
    let mut out: Vec<ModelJobs> = cfg.models.iter().map(|_| ModelJobs::default()).collect();
    for &(i, m) in &order {
        let row = &rows[i];
        let floor = &floors[m];
        let shared_blocks = if floor.prefix_caching {
            let mut h = 0;
            (row.hash_ids.iter())
                .take_while(|&&id| {
                    h = mix64(h, id);
                    prefixes[m].get(&h).is_some_and(|&n| n >= 2)
                })
                .count()
        } else {
            0
        };
        let shared =
            (shared_blocks as u64 * u64::from(trace_block_size)).min(u64::from(row.input_len)) as u32;
        let first = floor.first_token_ms(row.input_len - shared);
        let arrival_ms = (row.timestamp_ms - t0) / speedup;
        let slack_ms = cfg.models[m].slo_ttft_ms as f64 - first;
        if row.output_len == 0 || row.input_len == 0 || slack_ms < 0.0 {
            out[m].unservable += 1;
            continue;
        }
        let service_ms = first + f64::from(row.output_len - 1) * floor.token_ms(row.input_len);
        out[m].jobs.push(Job {
            a: (arrival_ms * 1000.0).floor() as i64,
            d: ((arrival_ms + slack_ms) * 1000.0).ceil() as i64,
            s: (service_ms * 1000.0).floor() as i64,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hangar_engine::EngineCore;
    use hangar_engine::{EngineConfig, EngineRequest, Pass, Prompt};

    fn floors(engine: EngineConfig) -> Floors {
        let model = FleetModel {
            key: "m/a".parse().unwrap(),
            size: "1GB".parse().unwrap(),
            gpu_kind: None,
            min_gpu_memory: None,
            engine,
            min_replicas: 0,
            max_replicas: None,
            concurrency: 8,
            queue_capacity: None,
            timeout_s: 30,
            slo_ttft_ms: 2000,
            scaling: None,
            router: Default::default(),
            adapters: None,
            hotswap: false,
        };
        Floors::new(&model).unwrap()
    }

    /// The floors are never above what an engine alone with the request
    /// takes, the fastest it can go.
    #[test]
    fn the_floors_are_below_an_engine_serving_the_request_alone() {
        for engine in [
            EngineConfig::default(),
            EngineConfig { max_num_batched_tokens: 512, ..EngineConfig::default() },
            EngineConfig { speedup_ratio: 4.0, ..EngineConfig::default() },
            EngineConfig {
                timing: hangar_engine::timing::TimingConfig::Fixed { prefill_ms: 30.0, decode_ms: 8.0 },
                ..EngineConfig::default()
            },
            EngineConfig {
                enable_chunked_prefill: false,
                max_num_batched_tokens: 32_768,
                ..EngineConfig::default()
            },
            EngineConfig { scheduler: SchedulerKind::Sglang, ..EngineConfig::default() },
        ] {
            let f = floors(engine.clone());
            for (input, output) in [(1, 1), (100, 5), (3000, 40), (20_000, 3)] {
                let mut core = EngineCore::new(&engine, no_tables).unwrap();
                let tokens: Vec<u32> = (0..input).collect();
                let prompt = Prompt::from_tokens(&tokens, engine.block_size);
                let id = hangar_core::RequestId(1);
                core.add_request(EngineRequest { id, prompt, max_output_tokens: output }).unwrap();
                let (mut now, mut pass, mut first) = (0.0, Pass::default(), None);
                while core.has_work() {
                    core.step(now, &mut pass);
                    now = pass.end_ms;
                    if first.is_none() && !pass.tokens.is_empty() {
                        first = Some(now);
                    }
                }
                let first = first.unwrap();
                let floor_first = f.first_token_ms(input);
                let floor_all = floor_first + f64::from(output - 1) * f.token_ms(input);
                assert!(floor_first <= first + 1e-9, "{engine:?} {input}: {floor_first} > {first}");
                assert!(floor_all <= now + 1e-9, "{engine:?} {input}/{output}: {floor_all} > {now}");
                // And not far below: alone, the engine runs at its floor
                // but for the quadratic prefill term.
                assert!(floor_all >= 0.5 * now, "{engine:?} {input}/{output}: {floor_all} ≪ {now}");
            }
        }
    }

    #[test]
    fn the_first_token_floor_splits_long_prompts_over_passes() {
        let f = floors(EngineConfig { max_num_batched_tokens: 1000, ..EngineConfig::default() });
        // Polynomial: about 16.5 ms a pass plus 0.0152 ms a token.
        let one = f.first_token_ms(1000);
        let three = f.first_token_ms(3000);
        assert!((three - one) > 2.0 * 16.0 + 2000.0 * 0.015, "{one} {three}");
    }
}
