//! `hangar engine`: run an engine process.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args as ClapArgs, Subcommand};
use hangar_core::ByteSize;
use hangar_engine::EngineConfig;
use hangar_mock_engine::MockConfig;

use super::read_text;

/// Run an engine process.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the mock LLM engine: an OpenAI-compatible HTTP server driving
    /// the simulator's engine core in real time (no GPU needed).
    ///
    /// Prints `listening on http://HOST:PORT` on standard output once bound,
    /// so `--port 0` can be used and the port read back. SIGTERM or Ctrl-C
    /// stops it after the requests in flight.
    Mock(MockArgs),
}

#[derive(Debug, ClapArgs)]
struct MockArgs {
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Engine preset: default, fast, instant or sglang.
    #[arg(long, default_value = "default")]
    preset: String,
    /// Model name served (what clients put in `model`).
    #[arg(long, default_value = "mock-llm")]
    model: String,
    /// Engine configuration file (TOML), replacing the preset's engine.
    #[arg(long)]
    engine_config: Option<PathBuf>,
    /// Milliseconds the server reports "loading" after start.
    #[arg(long, default_value_t = 0)]
    startup_delay_ms: u64,
    /// Milliseconds `/wake_up` takes.
    #[arg(long, default_value_t = 0)]
    wake_delay_ms: u64,
    /// Output tokens when a request sets no `max_tokens`.
    #[arg(long, default_value_t = 16)]
    default_max_tokens: u32,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 16 << 20)]
    max_body_bytes: usize,
    /// Serve no sleep API (`/sleep`, `/wake_up`, `/is_sleeping` answer
    /// 404), as llama.cpp's server: the engine can only be stopped.
    #[arg(long)]
    no_sleep: bool,
    /// Weights to read whole before serving, as a real engine loads its
    /// weights (`hangar serve` passes `{weights}` here): a file, or a model
    /// directory (`config.json` and every safetensors header checked, a
    /// malformed one failing the start by name); `/v1/models` reports
    /// their size and BLAKE3, a directory's file by file.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Serve no runtime LoRA API (`/v1/load_lora_adapter`,
    /// `/v1/unload_lora_adapter` answer 404), as vLLM without
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: the engine loads no adapters.
    #[arg(long)]
    no_lora_api: bool,
    /// Most LoRA adapters loaded at once; a load beyond is refused (vLLM's
    /// `--max-loras`).
    #[arg(long, default_value_t = hangar_mock_engine::DEFAULT_MAX_LORAS)]
    max_loras: usize,
    /// How fast an adapter load reads its bytes, per second (`2GB`, an
    /// NVMe drive's read): a load takes its size over this plus
    /// `--lora-load-ms`.
    #[arg(long, default_value_t = ByteSize::new(hangar_mock_engine::DEFAULT_LORA_LOAD_BYTES_PER_S.get()))]
    lora_load_bytes_per_s: ByteSize,
    /// Milliseconds every adapter load takes besides reading its bytes
    /// (building its layers, copying them to the GPU).
    #[arg(long, default_value_t = hangar_mock_engine::DEFAULT_LORA_LOAD_MS)]
    lora_load_ms: u64,
    /// While this file exists, answer every inference request 500 at once
    /// (`/health` still 200): an engine that fails every request without
    /// looking dead, to try what the gateway does with one.
    #[arg(long, value_name = "FILE")]
    fail_while: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let Command::Mock(a) = args.command;
    let p = hangar_engine::preset::named(&a.preset)?;
    let mut config = MockConfig::from_preset(&p, a.model);
    if let Some(path) = &a.engine_config {
        config.engine = toml::from_str::<EngineConfig>(&read_text(path)?)
            .with_context(|| format!("invalid engine config {}", path.display()))?;
    }
    config.startup_delay = Duration::from_millis(a.startup_delay_ms);
    config.wake_delay = Duration::from_millis(a.wake_delay_ms);
    config.default_max_tokens = a.default_max_tokens;
    config.max_body_bytes = a.max_body_bytes;
    config.sleep_api = !a.no_sleep;
    config.lora_api = !a.no_lora_api;
    config.max_loras = a.max_loras;
    config.lora_load_bytes_per_s = std::num::NonZeroU64::new(a.lora_load_bytes_per_s.bytes())
        .context("--lora-load-bytes-per-s must be more than 0")?;
    config.lora_load_ms = a.lora_load_ms;
    config.fail_while = a.fail_while;
    if let Some(path) = &a.weights {
        config.weights = Some(hangar_mock_engine::weights::read(path)?);
    }
    let base = a.engine_config.as_ref().and_then(|p| p.parent().map(PathBuf::from));
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", a.host, a.port))?;
        let addr = listener.local_addr()?;
        // Errors ignored: a supervisor may read the line and close the pipe.
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "listening on http://{addr}").and_then(|()| out.flush());
        drop(out);
        tracing::info!(%addr, preset = p.name, "mock engine serving");
        hangar_mock_engine::serve(
            config,
            listener,
            |path| {
                let p = base.as_ref().map_or_else(|| PathBuf::from(path), |b| b.join(path));
                std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))
            },
            shutdown_signal(),
        )
        .await?;
        Ok(())
    })
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
