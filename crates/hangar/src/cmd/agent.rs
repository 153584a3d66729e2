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
/// `agent NAME listening on http://ADDR` (GET /health, GET /status, GET
/// /metrics).
/// SIGTERM leaves the fleet (with `--move-s`, once its replicas moved to
/// other nodes), drains, and stops every engine.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The fleet's configuration file: the models this node can run, and
    /// its weight store (its `[[nodes]]`, if any, are ignored).
    #[arg(long)]
    config: PathBuf,
    /// The fleet's Redis (`redis://HOST:PORT/DB`,
    /// `redis://:PASSWORD@HOST:PORT/DB`, `unix:///path`). Messages show it
    /// with the password hidden.
    #[arg(long, env = "HANGAR_REDIS", hide_env_values = true)]
    redis: String,
    /// This node's name, unique in the fleet (default: the host name).
    #[arg(long, env = "HANGAR_NODE_NAME")]
    name: Option<String>,
    /// GPUs on this machine. Default: the NVIDIA GPUs this process can
    /// open (`/dev/nvidia0`, `/dev/nvidia1`, …) — in a Kubernetes pod,
    /// those the device plugin allocated to it.
    #[arg(long, env = "HANGAR_GPUS")]
    gpus: Option<u32>,
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
    /// Where the agent's own HTTP answers (`/health`, `/status`, `/metrics`).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// The address this machine's engines bind to and are reported at:
    /// gateways send requests straight to it, so on a fleet of several
    /// machines it must be one they reach (on Kubernetes, the pod's IP).
    /// Loopback serves only gateways on this machine; `0.0.0.0` is refused,
    /// as it names no machine to connect to.
    #[arg(long, env = "HANGAR_ENGINE_HOST", default_value = hangar_agent::engine::DEFAULT_HOST, value_parser = engine_host)]
    engine_host: String,
    /// How long requests in flight get to finish after SIGTERM, seconds.
    #[arg(long, default_value_t = 5)]
    drain_s: u64,
    /// How long SIGTERM waits, seconds, for the leader to move this node's
    /// replicas to other nodes before leaving (each stops here once its
    /// replacement serves); 0 leaves at once, and the leader places them
    /// again as a lost node's.
    #[arg(long, default_value_t = 0)]
    move_s: u64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    hangar_redis::check_url(&args.redis).map_err(|e| anyhow::anyhow!("--redis: {e}"))?;
    let origin = args.config.display().to_string();
    let mut config =
        ServeConfig::from_toml_with_redis(&read_text(&args.config)?, &origin, Some(args.redis.clone()))?;
    resolve_engine_paths(&mut config, config_dir(&args.config))?;
    let gpus = match args.gpus {
        Some(n) => n,
        None if args.virtual_gpus => anyhow::bail!("--virtual-gpus needs --gpus: how many GPUs to account"),
        None => {
            let dev = std::path::Path::new(hangar_agent::devices::DEV);
            match hangar_agent::devices::nvidia_gpus(dev)
                .with_context(|| format!("cannot list {}", dev.display()))?
            {
                0 => anyhow::bail!(
                    "no --gpus given and no NVIDIA GPU in {} (nvidia0, …): give --gpus N ($HANGAR_GPUS), or \
                     --virtual-gpus --gpus N on a machine without accelerators",
                    dev.display()
                ),
                n => {
                    tracing::info!(gpus = n, "GPUs counted from {}", dev.display());
                    n
                }
            }
        }
    };
    let name = match args.name {
        Some(n) => n,
        None => hostname().context("no --name given and the host name cannot be read")?,
    };
    hangar_gateway::install_panic_hook();
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
            gpus,
            gpu_memory: args.gpu_memory,
            virtual_gpus: args.virtual_gpus,
            gpu_kind: args.gpu_kind,
            cpu_memory: args.cpu_cache,
            url: advertised(addr, &args.engine_host),
            draining: false,
        };
        let agent = Agent::start(config, exe, args.engine_host, redis, record).await?;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "agent {name} listening on http://{addr}").and_then(|()| out.flush());
        drop(out);
        let server = axum::serve(listener, agent.router());
        let replaced = tokio::select! {
            served = server.with_graceful_shutdown(shutdown_signal()) => { served?; false }
            () = agent.replaced() => true,
        };
        agent.shutdown(Duration::from_secs(args.drain_s), Duration::from_secs(args.move_s)).await;
        if replaced {
            anyhow::bail!("another agent took the node name `{name}`; this one stopped");
        }
        Ok(())
    })
}

/// `--engine-host`: an address engines can be reached at, so not empty
/// and not the unspecified address (`0.0.0.0`, `::`), which binds every
/// interface but names none to connect to.
fn engine_host(s: &str) -> Result<String, String> {
    let bare = hangar_agent::engine::bare_host(s);
    if bare.is_empty() {
        return Err("an address is needed, such as the machine's IP".into());
    }
    if bare.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified()) {
        return Err(format!("`{s}` is no address to connect to; give one of this machine's (the pod IP)"));
    }
    Ok(s.to_owned())
}

/// The agent's URL in the registry: its listen address, or — when that
/// is every interface (`--listen 0.0.0.0:9400`) — the engine host with its
/// port, the address others reach this machine at.
fn advertised(addr: std::net::SocketAddr, engine_host: &str) -> String {
    if !addr.ip().is_unspecified() {
        return format!("http://{addr}");
    }
    hangar_agent::engine::base_url(engine_host, addr.port())
}

/// The machine's host name.
fn hostname() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    Some(name.trim().to_owned()).filter(|n| !n.is_empty())
}
