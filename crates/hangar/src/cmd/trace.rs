//! `hangar trace`: work with request traces.

use std::path::PathBuf;

use clap::{Args as ClapArgs, Subcommand, ValueEnum};
use hangar_sim::synth::{self, Pattern, SynthConfig};

use super::{jsonl_to, write_jsonl};

/// Generate and inspect request traces.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate a Mooncake-style JSONL trace of a multi-turn chat workload,
    /// deterministically from a seed.
    Synth(SynthArgs),
}

#[derive(Debug, ClapArgs)]
struct SynthArgs {
    /// Rows to generate.
    #[arg(long, default_value_t = 1000)]
    requests: u32,
    /// Session arrivals per second (Poisson).
    #[arg(long, default_value_t = 5.0)]
    rate: f64,
    /// Distinct shared system prompts.
    #[arg(long, default_value_t = 16)]
    system_prompts: u32,
    /// Zipf exponent of system prompt popularity.
    #[arg(long, default_value_t = 1.1)]
    zipf_s: f64,
    /// System prompt tokens.
    #[arg(long, default_value_t = 2048)]
    system_prompt_tokens: u32,
    /// Mean new user tokens per turn (log-normal).
    #[arg(long, default_value_t = 600.0)]
    user_tokens: f64,
    /// Mean output tokens per turn (log-normal).
    #[arg(long, default_value_t = 250.0)]
    output_tokens: f64,
    /// Log-normal shape of the lengths (0 = constant).
    #[arg(long, default_value_t = 0.6)]
    length_sigma: f64,
    /// Turns per session, uniform in 1..=N (1: single-turn, no sessions).
    #[arg(long, default_value_t = 4)]
    max_turns: u32,
    /// Mean think time between turns in ms (exponential).
    #[arg(long, default_value_t = 5000.0)]
    turn_delay_ms: f64,
    /// Tokens per hash id.
    #[arg(long, default_value_t = 512)]
    trace_block_size: u32,
    /// Longest prompt; longer conversations end early.
    #[arg(long, default_value_t = 32768)]
    max_prompt_tokens: u32,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Spread sessions over this many models (`synth/m0`, …) for a
    /// whole-fleet simulation; 0: rows name no model.
    #[arg(long, default_value_t = 0)]
    models: u32,
    /// Zipf exponent of model popularity.
    #[arg(long, default_value_t = 1.0)]
    model_zipf_s: f64,
    /// Arrival pattern over time.
    #[arg(long, value_enum, default_value_t = PatternArg::Steady)]
    pattern: PatternArg,
    /// The pattern's period in seconds.
    #[arg(long, default_value_t = 600.0)]
    period_s: f64,
    /// LoRA adapters over the models (`lora-K` belongs to model K mod
    /// --models); each session names one, by Zipf popularity within its
    /// model, with its size. 0: rows name none.
    #[arg(long, default_value_t = 0)]
    adapters: u32,
    /// Zipf exponent of adapter popularity within a model.
    #[arg(long, default_value_t = 1.0)]
    adapter_zipf_s: f64,
    /// Bytes of an adapter per unit of LoRA rank (ranks 8, 16, 32, 64 are
    /// drawn per adapter); the default makes a rank-16 adapter 84 MB.
    #[arg(long, default_value_t = 5_240_000)]
    adapter_rank_bytes: u64,
    /// Output file (default: standard output).
    #[arg(long, short)]
    out: Option<PathBuf>,
}

/// `--pattern`.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum PatternArg {
    /// Poisson at `--rate`.
    Steady,
    /// A sine over the period, 10 % to 190 % of `--rate`.
    Diurnal,
    /// A tenth of each period at 5x `--rate`, the rest at half.
    Bursty,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let Command::Synth(a) = args.command;
    let rows = synth::rows(&SynthConfig {
        requests: a.requests,
        rate: a.rate,
        system_prompts: a.system_prompts,
        zipf_s: a.zipf_s,
        system_prompt_tokens: a.system_prompt_tokens,
        user_tokens_mean: a.user_tokens,
        output_tokens_mean: a.output_tokens,
        length_sigma: a.length_sigma,
        max_turns: a.max_turns,
        turn_delay_ms: a.turn_delay_ms,
        trace_block_size: a.trace_block_size,
        max_prompt_tokens: a.max_prompt_tokens,
        seed: a.seed,
        models: a.models,
        model_zipf_s: a.model_zipf_s,
        pattern: match a.pattern {
            PatternArg::Steady => Pattern::Steady,
            PatternArg::Diurnal => Pattern::Diurnal,
            PatternArg::Bursty => Pattern::Bursty,
        },
        period_s: a.period_s,
        adapters: a.adapters,
        adapter_zipf_s: a.adapter_zipf_s,
        adapter_rank_bytes: a.adapter_rank_bytes,
    })?;
    // Written as drawn: an hour of 72 million rows never sits in memory.
    match &a.out {
        Some(path) => write_jsonl(path, rows),
        None => jsonl_to(std::io::stdout().lock(), rows),
    }
}
