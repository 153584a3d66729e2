//! `hangar`: the one binary of the platform.
//!
//! The binary only parses arguments and wires crates together; each
//! subcommand lives in its own module under `cmd/` and calls into the crate
//! that owns the behaviour. Errors are `anyhow` here and typed everywhere
//! else; a failing command prints its error chain and exits with status 1
//! (2 for usage errors, as clap does).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;

/// mimalloc instead of the C library's allocator: the gateway allocates
/// and frees small buffers on every request from two worker threads, and
/// glibc's arenas spent about 8 % of its CPU doing so (`hangar bench
/// gateway`'s closed loop, `perf`); mimalloc's per-thread free lists take
/// a fraction of that (docs/serve.md, "What the gateway costs").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc.h's `mi_option_purge_delay` (the crate names no constant for it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps freed memory in the process instead of handing it back to the
/// OS, for a command that runs to completion (a simulation). mimalloc
/// gives pages back 10 ms after they empty, and the simulator's engines
/// and router free and refill their buffers all the time, so each came
/// back as a fresh page the kernel zeroed first: 15–20 % of a `hangar
/// sim` replay's time (`perf`: `clear_page_erms`, docs/sim.md). A run's
/// footprint matters at its peak, which this raises by about a tenth;
/// the servers keep the default, their idle memory going back.
fn keep_freed_memory() {
    // SAFETY: sets one of mimalloc's options, any time, from any thread.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) }
}

/// Hangar: serve many models on a fleet of GPUs, and simulate that fleet.
#[derive(Debug, Parser)]
#[command(name = "hangar", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve models: an OpenAI-compatible gateway over placed, admitted
    /// replicas (without --config: a built-in demo of two mock models).
    Serve(cmd::serve::Args),
    /// Run this machine's replicas for a fleet's leader (a node agent).
    Agent(cmd::agent::Args),
    /// Run an engine process (the mock LLM engine).
    Engine(cmd::engine::Args),
    /// Replay a request trace through simulated engines and a router.
    // Boxed: its flags (the replay's, the fleet's, compare's) make it
    // several times the size of the other commands.
    Sim(Box<cmd::sim::Args>),
    /// Generate request traces.
    Trace(cmd::trace::Args),
    /// Dry-run replica placement for a scenario file: decisions, evictions
    /// and the deployment delta.
    Plan(cmd::plan::Args),
    /// KV-cache disk evictor: a drop-in for llm-d's PVC evictor.
    Evict(cmd::evict::Args),
    /// Content-addressed model-weight store: import, inspect, serve, share.
    Store(cmd::store::Args),
    /// Usage and billing of a running server (its `GET /v1/usage`), per
    /// model, account, day or hour.
    Usage(cmd::usage::Args),
    /// Benchmarks that print figures against targets: the gateway, durable
    /// predictions, the predictions queue, a fleet's control plane, a fleet
    /// under faults, the weight store, cold starts and LoRA adapters.
    Bench(cmd::bench::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `hangar evict` takes its level and log file from its own settings.
    if !matches!(cli.command, Command::Evict(_)) {
        init_tracing();
    }
    let result = match cli.command {
        Command::Serve(args) => cmd::serve::run(args),
        Command::Agent(args) => cmd::agent::run(args),
        Command::Engine(args) => cmd::engine::run(args),
        Command::Sim(args) => {
            keep_freed_memory();
            cmd::sim::run(*args)
        }
        Command::Trace(args) => cmd::trace::run(args),
        Command::Plan(args) => cmd::plan::run(args),
        Command::Evict(args) => cmd::evict::run(args),
        Command::Store(args) => cmd::store::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Usage(args) => cmd::usage::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => cmd::report(&err),
    }
}

/// Logs go to stderr so that stdout stays for a command's output (tables,
/// JSON); the level comes from `RUST_LOG`, default `info`. Coloured only
/// on a terminal: a pod's log, a file or a pipe gets plain text.
fn init_tracing() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}
