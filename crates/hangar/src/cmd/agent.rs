//! `hangar agent`: one machine of a fleet (docs/cluster.md).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args as ClapArgs;
use hangar_core::{ByteSize, NodeRecord};
use hangar_redis::Redis;
use hangar_runtime::serve::{Agent, ServeConfig};

use super::engine::shutdown_signal;
use super::read_text;
use super::serve::{config_dir, resolve_engine_paths};

/// Run this machine's replicas for a fleet's leader.
///
/// Registers the node in the fleet's Redis (renewed every 2 s; a name
/// another live agent holds is refused), runs the replicas the leader
/// wants here — engines started, put to sleep, woken and stopped as a
/// single `hangar serve` does — and reports them. The first output line is
/// `agent NAME listening on http://ADDR` (GET /health, GET /status).
/// SIGTERM leaves the fleet, drains, and stops every engine.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The fleet's configuration file: the models this node can run, and
    /// its weight store (its `[[nodes]]`, if any, are ignored).
    #[arg(long)]
    config: PathBuf,
    /// The fleet's Redis (`redis://HOST:PORT/DB`, `unix:///path`).
    #[arg(long, env = "HANGAR_REDIS")]
    redis: String,
    /// This node's name, unique in the fleet (default: the host name).
    #[arg(long, env = "HANGAR_NODE_NAME")]
    name: Option<String>,
    /// GPUs on this machine.
    #[arg(long, env = "HANGAR_GPUS")]
    gpus: u32,
    /// Memory of each GPU (`80GB`).
    #[arg(long, env = "HANGAR_GPU_MEMORY")]
    gpu_memory: ByteSize,
    /// The hardware label models may require (`a100-80gb`).
    #[arg(long, env = "HANGAR_GPU_KIND")]
    gpu_kind: Option<String>,
    /// The GPUs are slots of host memory (no accelerators: mock engines,
    /// CI).
    #[arg(long)]
    virtual_gpus: bool,
    /// Host memory for the warm cache.
    #[arg(long, default_value = "0B")]
    cpu_cache: ByteSize,
    /// Where the agent's own HTTP answers (`/health`, `/status`).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// How long requests in flight get to finish after SIGTERM, seconds.
    #[arg(long, default_value_t = 5)]
    drain_s: u64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut config = ServeConfig::from_toml(&read_text(&args.config)?, &args.config.display().to_string())?;
    config.redis = Some(args.redis.clone());
    resolve_engine_paths(&mut config, config_dir(&args.config))?;
    let name = match args.name {
        Some(n) => n,
        None => hostname().context("no --name given and the host name cannot be read")?,
    };
    hangar_runtime::serve::install_panic_hook();
    let exe = std::env::current_exe().context("cannot find the hangar binary to start engines")?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        let addr = listener.local_addr()?;
        let redis = Redis::connect(&args.redis)?;
        let record = NodeRecord {
            name: name.clone(),
            agent: format!("{:016x}", rand::random::<u64>()),
            gpus: args.gpus,
            gpu_memory: args.gpu_memory,
            virtual_gpus: args.virtual_gpus,
            gpu_kind: args.gpu_kind,
            cpu_memory: args.cpu_cache,
            artifacts: Vec::new(),
            url: format!("http://{addr}"),
            draining: false,
        };
        let agent = Agent::start(config, exe, redis, record).await?;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "agent {name} listening on http://{addr}").and_then(|()| out.flush());
        drop(out);
        let server = axum::serve(listener, agent.router());
        let replaced = tokio::select! {
            served = server.with_graceful_shutdown(shutdown_signal()) => { served?; false }
            () = agent.replaced() => true,
        };
        agent.shutdown(Duration::from_secs(args.drain_s)).await;
        if replaced {
            anyhow::bail!("another agent took the node name `{name}`; this one stopped");
        }
        Ok(())
    })
}

/// The machine's host name.
fn hostname() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    Some(name.trim().to_owned()).filter(|n| !n.is_empty())
}
