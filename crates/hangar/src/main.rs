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

/// Hangar: serve many models on a fleet of GPUs, and simulate that fleet.
#[derive(Debug, Parser)]
#[command(name = "hangar", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Content-addressed model-weight store: import, inspect, serve, share.
    Store(cmd::store::Args),
}

fn main() -> ExitCode {
    init_tracing();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Store(args) => cmd::store::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => cmd::report(&err),
    }
}

/// Logs go to stderr so that stdout stays for a command's output (tables,
/// JSON); the level comes from `RUST_LOG`, default `info`.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}
