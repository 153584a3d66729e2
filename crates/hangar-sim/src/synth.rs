//! Synthetic Mooncake-style traces, generated deterministically from a seed.
//!
//! The generator models a chat service: sessions arrive as a Poisson
//! process; each picks one of `system_prompts` shared system prompts with
//! Zipf-distributed popularity (a few prompts are very common); each session
//! has 1 to `max_turns` turns, and turn *k*'s prompt is the system prompt,
//! the whole conversation so far (earlier user messages and answers) and a
//! new user message. Prompt blocks are named by `hash_ids` of
//! `trace_block_size` tokens exactly as Mooncake traces do, so equal id
//! prefixes are equal prompt prefixes: the shared system prompts and each
//! session's growing history are what a prefix cache can reuse. User message
//! and answer lengths are log-normal.
//!
//! For a whole-fleet simulation, `models` spreads sessions over that many
//! models (`synth/m0`, `synth/m1`, …) with Zipf popularity, and `pattern`
//! shapes the session arrival rate over time: `steady` (Poisson at
//! `rate`), `diurnal` (a sine between 10 % and 190 % of `rate` over
//! `period_s`) or `bursty` (a tenth of each period at 5× `rate`, the rest
//! at half). With neither, the trace is exactly what it always was.
//!
//! `adapters` makes many LoRA fine-tunes over those few models: adapter
//! *k* (`lora-k`) belongs to model *k* mod `models`; each session picks its
//! model as before, then one of that model's adapters with Zipf popularity
//! (`adapter_zipf_s`), and every turn of it names the adapter and its size
//! (`adapter`, `adapter_size`). An adapter's size is its LoRA rank — 8,
//! 16, 32 or 64, drawn once per adapter with chances 30, 40, 20 and 10 %
//! — times `adapter_rank_bytes`. The adapters are drawn from a generator
//! of their own, so the rest of the trace is the one without them.

use std::collections::BTreeMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// Generator settings; `Default` gives a small multi-turn chat workload.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthConfig {
    /// Rows to generate.
    pub requests: u32,
    /// Session arrivals per second (Poisson).
    pub rate: f64,
    /// Distinct shared system prompts.
    pub system_prompts: u32,
    /// Zipf exponent of system prompt popularity (0 = uniform).
    pub zipf_s: f64,
    /// System prompt length in tokens (rounded down to whole trace blocks).
    pub system_prompt_tokens: u32,
    /// Mean new user tokens per turn.
    pub user_tokens_mean: f64,
    /// Mean output tokens per turn.
    pub output_tokens_mean: f64,
    /// Log-normal shape of both lengths (0 = constant).
    pub length_sigma: f64,
    /// Turns per session are uniform in `1..=max_turns`.
    pub max_turns: u32,
    /// Mean think time between a turn's answer and the next turn (exponential).
    pub turn_delay_ms: f64,
    /// Tokens per hash id.
    pub trace_block_size: u32,
    /// Longest prompt generated; longer conversations end early.
    pub max_prompt_tokens: u32,
    /// Seed of every random draw.
    pub seed: u64,
    /// Models the sessions are spread over (0: rows name no model).
    pub models: u32,
    /// Zipf exponent of model popularity.
    pub model_zipf_s: f64,
    /// How the arrival rate changes over time.
    pub pattern: Pattern,
    /// The pattern's period in seconds.
    pub period_s: f64,
    /// LoRA adapters over the models (0: rows name none).
    pub adapters: u32,
    /// Zipf exponent of adapter popularity within a model.
    pub adapter_zipf_s: f64,
    /// Bytes of an adapter per unit of LoRA rank (default 5.24 MB: a
    /// rank-16 adapter of every linear layer of an 8B Llama is 84 MB in
    /// 16-bit weights).
    pub adapter_rank_bytes: u64,
}

/// How a synthetic trace's arrival rate changes over time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pattern {
    /// Constant.
    #[default]
    Steady,
    /// A sine over the period, 10 % to 190 % of the mean.
    Diurnal,
    /// On/off: a tenth of each period at 5×, the rest at half.
    Bursty,
}

impl Pattern {
    /// The rate at `t_ms` as a multiple of the mean, and the largest
    /// multiple (for thinning).
    fn factor(self, t_ms: f64, period_ms: f64) -> (f64, f64) {
        let phase = (t_ms / period_ms).fract();
        match self {
            Pattern::Steady => (1.0, 1.0),
            Pattern::Diurnal => (1.0 + 0.9 * (std::f64::consts::TAU * phase).sin(), 1.9),
            Pattern::Bursty => (if phase < 0.1 { 5.0 } else { 0.5 }, 5.0),
        }
    }
}

impl Default for SynthConfig {
    fn default() -> Self {
        Self {
            requests: 1000,
            rate: 5.0,
            system_prompts: 16,
            zipf_s: 1.1,
            system_prompt_tokens: 2048,
            user_tokens_mean: 600.0,
            output_tokens_mean: 250.0,
            length_sigma: 0.6,
            max_turns: 4,
            turn_delay_ms: 5000.0,
            trace_block_size: 512,
            max_prompt_tokens: 32_768,
            seed: 0,
            models: 0,
            model_zipf_s: 1.0,
            pattern: Pattern::Steady,
            period_s: 600.0,
            adapters: 0,
            adapter_zipf_s: 1.0,
            adapter_rank_bytes: 5_240_000,
        }
    }
}

/// One generated row, serialized as a Mooncake JSONL line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SynthRow {
    /// Arrival in ms (follow-up turns: an estimate; replay uses `delay`).
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Output tokens.
    pub output_length: u32,
    /// One id per `trace_block_size` prompt tokens.
    pub hash_ids: Vec<u64>,
    /// The session, when sessions have more than one turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// Think time before this turn, after the previous one completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delay: Option<u64>,
    /// The model, when the trace spreads over several.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The LoRA adapter, when the trace has adapters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
    /// The adapter's size in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapter_size: Option<u64>,
}

/// Why a generator setting cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("trace synth: `{field}` {why}")]
pub struct SynthError {
    field: &'static str,
    why: &'static str,
}

impl SynthConfig {
    fn validate(&self) -> Result<(), SynthError> {
        let bad = |field, why| Err(SynthError { field, why });
        if self.requests == 0 {
            return bad("requests", "must be at least 1");
        }
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return bad("rate", "must be a number above 0");
        }
        if self.system_prompts == 0 {
            return bad("system-prompts", "must be at least 1");
        }
        if !(self.zipf_s.is_finite() && self.zipf_s >= 0.0) {
            return bad("zipf-s", "must be ≥ 0");
        }
        if !(self.user_tokens_mean >= 1.0 && self.output_tokens_mean >= 1.0) {
            return bad("user-tokens / output-tokens", "means must be at least 1");
        }
        if !(self.length_sigma.is_finite() && (0.0..=3.0).contains(&self.length_sigma)) {
            return bad("length-sigma", "must be between 0 and 3");
        }
        if self.max_turns == 0 {
            return bad("max-turns", "must be at least 1");
        }
        if !(self.turn_delay_ms.is_finite() && self.turn_delay_ms >= 0.0) {
            return bad("turn-delay-ms", "must be ≥ 0");
        }
        if self.trace_block_size == 0 {
            return bad("trace-block-size", "must be at least 1");
        }
        if self.max_prompt_tokens < self.system_prompt_tokens + 1 {
            return bad("max-prompt-tokens", "must exceed the system prompt length");
        }
        if !(self.model_zipf_s.is_finite() && self.model_zipf_s >= 0.0) {
            return bad("model-zipf-s", "must be ≥ 0");
        }
        if !(self.period_s.is_finite() && self.period_s >= 1.0) {
            return bad("period-s", "must be at least 1");
        }
        if self.adapters > 1_000_000 {
            return bad("adapters", "must be at most 1000000");
        }
        if !(self.adapter_zipf_s.is_finite() && self.adapter_zipf_s >= 0.0) {
            return bad("adapter-zipf-s", "must be ≥ 0");
        }
        if self.adapters > 0 && self.adapter_rank_bytes == 0 {
            return bad("adapter-rank-bytes", "must be at least 1");
        }
        Ok(())
    }
}

/// Generates a trace as [`crate::trace::read`] would read the JSONL file
/// `hangar trace synth` writes from `cfg`, named `source_name`: the same
/// requests, sessions and lines, without the file.
pub fn trace(cfg: &SynthConfig, source_name: &str) -> Result<crate::trace::Trace, SynthError> {
    let mut text = String::new();
    for row in generate(cfg)? {
        text.push_str(&serde_json::to_string(&row).expect("a row serializes"));
        text.push('\n');
    }
    Ok(crate::trace::read(&text, source_name).expect("generated rows parse"))
}

/// Generates the rows, ordered by timestamp (stable for equal ones).
pub fn generate(cfg: &SynthConfig) -> Result<Vec<SynthRow>, SynthError> {
    Ok(rows(cfg)?.collect())
}

/// The rows of [`generate`], one at a time in the same order: a trace of
/// any length in the memory of the turns still to come of the sessions
/// under way (an hour at 20,000 requests/s took 15 GB as one `Vec`).
pub fn rows(cfg: &SynthConfig) -> Result<Rows, SynthError> {
    cfg.validate()?;
    let bs = cfg.trace_block_size;
    let sys_blocks = cfg.system_prompt_tokens / bs;
    Ok(Rows {
        cfg: cfg.clone(),
        rng: ChaCha8Rng::seed_from_u64(cfg.seed),
        sys_blocks,
        // Ids 0.. name system prompt blocks; fresh ids for everything else.
        next_id: u64::from(cfg.system_prompts) * u64::from(sys_blocks),
        zipf: zipf_cdf(cfg.system_prompts, cfg.zipf_s),
        model_zipf: zipf_cdf(cfg.models.max(1), cfg.model_zipf_s),
        adapters: Adapters::new(cfg),
        clock_ms: 0.0,
        session: 0,
        made: 0,
        pending: BTreeMap::new(),
    })
}

/// The generator behind [`rows`]: sessions are drawn in order of their
/// start, each with all its turns; a turn waits in `pending` until no
/// session yet to be drawn can come before it.
pub struct Rows {
    cfg: SynthConfig,
    rng: ChaCha8Rng,
    sys_blocks: u32,
    next_id: u64,
    zipf: Vec<f64>,
    model_zipf: Vec<f64>,
    adapters: Adapters,
    /// The start of the last session drawn: every later one starts at or
    /// after it.
    clock_ms: f64,
    session: u32,
    /// Rows drawn so far.
    made: u64,
    /// Rows drawn but not yet given out, by (timestamp, order drawn): the
    /// order a stable sort by timestamp gives.
    pending: BTreeMap<(u64, u64), SynthRow>,
}

impl Iterator for Rows {
    type Item = SynthRow;

    fn next(&mut self) -> Option<SynthRow> {
        loop {
            let all_drawn = self.made == u64::from(self.cfg.requests);
            // A session drawn later starts at or after `clock_ms`, so its
            // rows' timestamps are at least this one; equal ones come after
            // the rows drawn before them.
            let settled = self.clock_ms.round() as u64;
            if let Some(entry) = self.pending.first_entry() {
                if all_drawn || entry.key().0 <= settled {
                    return Some(entry.remove());
                }
            }
            if all_drawn {
                return None;
            }
            self.draw_session();
        }
    }
}

impl Rows {
    /// Draws the next session: its start and every turn of it, each into
    /// `pending`.
    fn draw_session(&mut self) {
        let cfg = &self.cfg;
        let rng = &mut self.rng;
        let bs = cfg.trace_block_size;
        let sys_blocks = self.sys_blocks;
        let sys_len = sys_blocks * bs;
        let multi_turn = cfg.max_turns > 1;
        self.clock_ms = next_arrival(rng, cfg, self.clock_ms);
        let u: f64 = rng.random();
        let sys = self.zipf.partition_point(|&c| c < u).min(self.zipf.len() - 1) as u64;
        let mut model_index = 0;
        let model = (cfg.models > 0).then(|| {
            let u: f64 = rng.random();
            model_index = self.model_zipf.partition_point(|&c| c < u).min(self.model_zipf.len() - 1);
            format!("synth/m{model_index}")
        });
        let adapter = self.adapters.pick(model_index);
        let turns = rng.random_range(1..=cfg.max_turns);
        let mut history = sys_len;
        let mut content_ids: Vec<u64> = Vec::new();
        let mut prev_len = sys_len;
        let mut at = self.clock_ms;
        for turn in 0..turns {
            if self.made == u64::from(cfg.requests) {
                break;
            }
            let user = lognormal(rng, cfg.user_tokens_mean, cfg.length_sigma);
            let output = lognormal(rng, cfg.output_tokens_mean, cfg.length_sigma);
            let len = history + user;
            if len > cfg.max_prompt_tokens {
                break;
            }
            // Full content blocks of the previous prompt are shared; the
            // rest gets fresh ids.
            content_ids.truncate(((prev_len - sys_len) / bs) as usize);
            let needed = (len.div_ceil(bs) - sys_blocks) as usize;
            while content_ids.len() < needed {
                content_ids.push(self.next_id);
                self.next_id += 1;
            }
            let mut hash_ids: Vec<u64> =
                (0..u64::from(sys_blocks)).map(|b| sys * u64::from(sys_blocks) + b).collect();
            hash_ids.extend_from_slice(&content_ids);
            let delay = if turn == 0 {
                None
            } else {
                let d = exponential(rng, cfg.turn_delay_ms).round();
                at += d;
                Some(d as u64)
            };
            let row = SynthRow {
                timestamp: at.round() as u64,
                input_length: len,
                output_length: output,
                hash_ids,
                session_id: multi_turn.then(|| format!("s{}", self.session)),
                delay,
                model: model.clone(),
                adapter: adapter.map(|k| format!("lora-{k}")),
                adapter_size: adapter.map(|k| self.adapters.sizes[k]),
            };
            self.pending.insert((row.timestamp, self.made), row);
            self.made += 1;
            prev_len = len;
            history = len + output;
        }
        self.session += 1;
    }
}

/// The adapters of a trace: each one's size, and each model's by
/// popularity; drawn from a generator of their own.
struct Adapters {
    rng: ChaCha8Rng,
    /// Bytes of adapter `k`.
    sizes: Vec<u64>,
    /// Per model, the cumulative Zipf weights of its adapters, in rank
    /// order (adapter `m + j × models` is model `m`'s rank `j`).
    cdf: Vec<Vec<f64>>,
    models: usize,
}

impl Adapters {
    fn new(cfg: &SynthConfig) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x6164_6170_7465_7273);
        let sizes = (0..cfg.adapters)
            .map(|_| {
                let u: f64 = rng.random();
                let rank = match u {
                    u if u < 0.3 => 8,
                    u if u < 0.7 => 16,
                    u if u < 0.9 => 32,
                    _ => 64,
                };
                rank * cfg.adapter_rank_bytes
            })
            .collect();
        let models = cfg.models.max(1) as usize;
        let cdf = (0..models)
            .map(|m| {
                let own = (cfg.adapters as usize).saturating_sub(m).div_ceil(models) as u32;
                if own == 0 {
                    Vec::new()
                } else {
                    zipf_cdf(own, cfg.adapter_zipf_s)
                }
            })
            .collect();
        Adapters { rng, sizes, cdf, models }
    }

    /// An adapter of model `m` by popularity; `None` without adapters (or
    /// when the model has none).
    fn pick(&mut self, m: usize) -> Option<usize> {
        let cdf = self.cdf.get(m).filter(|c| !c.is_empty())?;
        let u: f64 = self.rng.random();
        let rank = cdf.partition_point(|&c| c < u).min(cdf.len() - 1);
        Some(m + rank * self.models)
    }
}

/// The next session arrival after `clock_ms`: Poisson at `rate`, shaped by
/// the pattern through thinning (a steady trace draws exactly as before).
fn next_arrival(rng: &mut ChaCha8Rng, cfg: &SynthConfig, mut clock_ms: f64) -> f64 {
    let (_, peak) = cfg.pattern.factor(0.0, 1.0);
    loop {
        clock_ms += exponential(rng, 1000.0 / (cfg.rate * peak));
        if cfg.pattern == Pattern::Steady {
            return clock_ms;
        }
        let (factor, peak) = cfg.pattern.factor(clock_ms, cfg.period_s * 1000.0);
        if rng.random::<f64>() * peak < factor {
            return clock_ms;
        }
    }
}

/// Cumulative Zipf weights `1/k^s` of ranks 1..=n, normalized to end at 1.
fn zipf_cdf(n: u32, s: f64) -> Vec<f64> {
    let weights: Vec<f64> = (1..=n).map(|k| 1.0 / f64::from(k).powf(s)).collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    weights
        .iter()
        .map(|w| {
            acc += w / total;
            acc
        })
        .collect()
}

fn exponential(rng: &mut ChaCha8Rng, mean: f64) -> f64 {
    if mean == 0.0 {
        return 0.0;
    }
    -mean * (1.0 - rng.random::<f64>()).ln()
}

/// A log-normal draw with the given mean, at least 1.
fn lognormal(rng: &mut ChaCha8Rng, mean: f64, sigma: f64) -> u32 {
    let mu = mean.ln() - sigma * sigma / 2.0;
    // Box–Muller.
    let (u1, u2): (f64, f64) = (1.0 - rng.random::<f64>(), rng.random::<f64>());
    let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
    (mu + sigma * z).exp().round().clamp(1.0, f64::from(u32::MAX / 4)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_trace_other_seed_other_trace() {
        let cfg = SynthConfig { requests: 200, ..SynthConfig::default() };
        assert_eq!(generate(&cfg).unwrap(), generate(&cfg).unwrap());
        assert_ne!(generate(&cfg).unwrap(), generate(&SynthConfig { seed: 1, ..cfg }).unwrap());
    }

    #[test]
    fn rows_come_out_in_time_order_as_they_are_drawn() {
        // Long think times: a session's later turns come after many later
        // sessions' first ones, so rows must wait their turn.
        for seed in 0..4 {
            let cfg = SynthConfig {
                requests: 20_000,
                rate: 20.0,
                max_turns: 6,
                turn_delay_ms: 30_000.0,
                seed,
                ..SynthConfig::default()
            };
            let mut drawn = rows(&cfg).unwrap();
            let mut out = Vec::new();
            let mut most_waiting = 0;
            while let Some(row) = drawn.next() {
                most_waiting = most_waiting.max(drawn.pending.len());
                out.push(row);
            }
            assert_eq!(out.len(), 20_000);
            assert!(out.windows(2).all(|w| w[0].timestamp <= w[1].timestamp), "seed {seed}: out of order");
            // Each session's turns in their order, none lost.
            let mut turns: std::collections::HashMap<&str, Vec<u32>> = Default::default();
            for r in &out {
                turns.entry(r.session_id.as_deref().unwrap()).or_default().push(r.input_length);
            }
            assert!(turns.values().all(|t| t.windows(2).all(|w| w[0] < w[1])), "seed {seed}");
            // What waits is the turns under way (about rate × think time ×
            // turns to come: some 1,700 here), not the trace.
            assert!(
                most_waiting > 100 && most_waiting < 4_000,
                "seed {seed}: {most_waiting} rows waited at once"
            );
        }
        let single = SynthConfig { requests: 5_000, max_turns: 1, ..SynthConfig::default() };
        let mut drawn = rows(&single).unwrap();
        while drawn.next().is_some() {
            assert!(drawn.pending.len() <= 1, "a single-turn trace waits for nothing");
        }
    }

    #[test]
    fn turns_extend_their_history_and_share_system_prompts() {
        let cfg = SynthConfig { requests: 300, max_turns: 5, ..SynthConfig::default() };
        let rows = generate(&cfg).unwrap();
        assert_eq!(rows.len(), 300);
        let mut by_session: std::collections::BTreeMap<&str, Vec<&SynthRow>> = Default::default();
        for r in &rows {
            assert_eq!(r.hash_ids.len() as u32, r.input_length.div_ceil(512), "ids cover the prompt");
            by_session.entry(r.session_id.as_deref().unwrap()).or_default().push(r);
        }
        let mut follow_ups = 0;
        for turns in by_session.values() {
            for pair in turns.windows(2) {
                follow_ups += 1;
                let (a, b) = (pair[0], pair[1]);
                assert!(b.input_length > a.input_length + a.output_length);
                let full = (a.input_length / 512) as usize;
                assert_eq!(a.hash_ids[..full], b.hash_ids[..full], "history is a shared prefix");
                assert!(b.delay.is_some());
            }
        }
        assert!(follow_ups > 50);
        let first_block = |r: &SynthRow| r.hash_ids[0];
        let popular = rows.iter().filter(|r| first_block(r) == 0).count();
        assert!(popular > rows.len() / 8, "Zipf makes prompt 0 common: {popular}");
    }

    #[test]
    fn models_follow_zipf_and_bursts_cluster_arrivals() {
        let cfg = SynthConfig {
            requests: 2000,
            max_turns: 1,
            models: 4,
            model_zipf_s: 1.2,
            pattern: Pattern::Bursty,
            period_s: 60.0,
            rate: 10.0,
            ..SynthConfig::default()
        };
        let rows = generate(&cfg).unwrap();
        let count = |m: &str| rows.iter().filter(|r| r.model.as_deref() == Some(m)).count();
        assert!(count("synth/m0") > count("synth/m1") && count("synth/m1") > count("synth/m3"));
        assert_eq!(rows.iter().filter(|r| r.model.is_none()).count(), 0);
        // A tenth of each minute at 5x and the rest at 0.5x: over half the
        // arrivals fall in the burst windows.
        let in_burst = rows.iter().filter(|r| (r.timestamp % 60_000) < 6_000).count();
        assert!(in_burst * 2 > rows.len(), "{in_burst} of {}", rows.len());
        // Without models or a pattern, the trace is the one it always was.
        let plain = SynthConfig { requests: 100, ..SynthConfig::default() };
        assert!(generate(&plain).unwrap().iter().all(|r| r.model.is_none()));
    }

    #[test]
    fn adapters_belong_to_their_model_follow_zipf_and_leave_the_rest_alone() {
        let base = SynthConfig { requests: 3000, max_turns: 3, models: 2, ..SynthConfig::default() };
        let cfg = SynthConfig { adapters: 100, adapter_zipf_s: 1.1, ..base.clone() };
        let rows = generate(&cfg).unwrap();
        assert_eq!(rows, generate(&cfg).unwrap(), "deterministic");
        let plain = generate(&base).unwrap();
        for (a, b) in rows.iter().zip(&plain) {
            assert_eq!((a.timestamp, &a.hash_ids, &a.model), (b.timestamp, &b.hash_ids, &b.model));
            assert!(b.adapter.is_none() && b.adapter_size.is_none());
        }
        let mut count = std::collections::BTreeMap::<usize, usize>::new();
        let mut size = std::collections::BTreeMap::<usize, u64>::new();
        for r in &rows {
            let k: usize = r.adapter.as_deref().unwrap()["lora-".len()..].parse().unwrap();
            assert_eq!(r.model.as_deref(), Some(format!("synth/m{}", k % 2).as_str()), "lora-{k}");
            *count.entry(k).or_default() += 1;
            let bytes = r.adapter_size.unwrap();
            assert_eq!(*size.entry(k).or_insert(bytes), bytes, "one size per adapter");
            assert!([8, 16, 32, 64].map(|r| r * 5_240_000).contains(&bytes));
        }
        // Zipf within each model: its first adapters are the most asked for.
        assert!(count[&0] > count.get(&20).copied().unwrap_or(0) * 3, "{count:?}");
        assert!(count[&1] > count.get(&21).copied().unwrap_or(0) * 3, "{count:?}");
        assert!(count.len() > 40, "the tail is long: {}", count.len());
        // A session keeps its adapter.
        let mut by_session = std::collections::BTreeMap::<&str, &str>::new();
        for r in &rows {
            let (s, a) = (r.session_id.as_deref().unwrap(), r.adapter.as_deref().unwrap());
            assert_eq!(*by_session.entry(s).or_insert(a), a);
        }
        let e = generate(&SynthConfig { adapters: 5, adapter_zipf_s: -1.0, ..base }).unwrap_err();
        assert_eq!(e.to_string(), "trace synth: `adapter-zipf-s` must be ≥ 0");
    }

    #[test]
    fn bad_settings_name_the_field() {
        let e = generate(&SynthConfig { rate: 0.0, ..SynthConfig::default() }).unwrap_err();
        assert_eq!(e.to_string(), "trace synth: `rate` must be a number above 0");
    }
}
