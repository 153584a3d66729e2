//! `hangar bench`: benchmarks that print figures against targets. The
//! harnesses are `hangar-bench`'s (the store's is `hangar_store::bench`);
//! this module is their flags and the runtime each runs on.

use anyhow::Context;
use clap::{Args as ClapArgs, Subcommand, ValueEnum};
use hangar_bench::gateway::{self, BodyKind};
use hangar_bench::{adapters, chaos, cluster, coldstart, predictions, queue};

/// Benchmarks that print figures against targets: the gateway, durable
/// predictions, the predictions queue, a fleet's control plane, a fleet
/// under faults, the weight store, cold starts and LoRA adapters.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// What the gateway adds in front of an engine.
    ///
    /// Starts a mock engine with zero compute time (`hangar engine mock
    /// --preset instant`) and a gateway in front of it (`hangar serve`, its
    /// model's engine `external` at that mock), both as child processes;
    /// then sends the same requests straight to the engine and through the
    /// gateway: a closed loop of --concurrency keep-alive clients (maximum
    /// throughput), then an open loop at --rate requests per second
    /// (latency). Prints requests per second, p50/p90/p99 latency of each
    /// path and what the gateway adds. See docs/serve.md.
    Gateway(GatewayArgs),
    /// What the durable predictions path sustains.
    ///
    /// Starts `hangar serve` (its store in a temporary directory) with one
    /// model on a zero-compute mock engine, both child processes; then
    /// measures durable creates per second answered 201 (closed loop of
    /// --concurrency clients), completions per second draining that
    /// backlog, create-and-wait (`Prefer: wait`) round trips, and create
    /// latency at --rate creates per second (open loop). See
    /// docs/predictions.md.
    Predictions(PredictionsArgs),
    /// The durable predictions queue on its own.
    ///
    /// In-process against the embedded SQLite store (in a temporary
    /// directory): predictions created and claimed per second with
    /// --slots claiming workers, and fairness — how many claims a second
    /// account's prediction waits behind another account's backlog of
    /// --backlog, in claims and in replica-slot waits (p50, p99, max) —,
    /// and the latency of creates sent one at a time; the same on Redis
    /// Streams side by side, and with --durable on a Redis Cluster with
    /// replicas, without and with `durable_replicas = 1`. See
    /// docs/predictions.md.
    Queue(QueueArgs),
    /// A fleet's control plane under load and when a node dies.
    ///
    /// Part 1: --agents simulated node agents heartbeating (every 2 s) and
    /// reporting (every 250 ms) against a private redis-server, while one
    /// thread does the leading gateway's view every 250 ms: its CPU share
    /// of a core. Part 2: a private fleet (Redis, one gateway, three
    /// agents with a mock model, child processes); the agent holding a
    /// replica is killed with SIGKILL: how long after its last heartbeat
    /// it is declared dead, and how long after that its replica is ready
    /// elsewhere, less the engine's start. See docs/cluster.md.
    Cluster(ClusterArgs),
    /// A fleet under a seeded random schedule of faults, and what must
    /// survive them.
    ///
    /// Starts a loopback fleet of real processes — a private redis-server
    /// with AOF, 2 gateways, 3 agents with virtual GPUs, four mock models —
    /// and a webhook receiver; sends bounded mixed load (sync chat requests
    /// and predictions with webhooks, through random gateways) while it
    /// injects the seed's faults one at a time: kill -9 of an agent
    /// (restarted under its name at once or after the TTL), of a gateway,
    /// of the leader and of an engine; SIGSTOP/SIGCONT of an agent; Redis
    /// killed and restarted, and paused; an agent leaving and rejoining. A
    /// checker samples the fleet twice a second. Prints the schedule first
    /// (stderr), then the figures beside the targets: every
    /// accepted request answered, one terminal webhook per prediction,
    /// re-runs only where docs/cluster.md allows, no ghost engine, no GPU
    /// over-commit, nothing restarted by a Redis fault, every model whole
    /// within 15 s of the last fault. Exits 1 when a check fails (the
    /// processes' logs are then kept). See docs/cluster.md.
    Chaos(ChaosArgs),
    /// The weight store against the physical reference.
    ///
    /// Generates a safetensors model of --size (once, under --dir), then
    /// measures import against a sequential read of the same files, local
    /// Materialize against a read of the blob into new memory (blob in the
    /// page cache and, as root, on disk), lease-in-place latency, and P2P
    /// between two daemons on loopback against a plain TCP copy. See
    /// docs/store.md.
    Store(StoreArgs),
    /// A replica's cold start, placement → first token, by where its
    /// weights come from.
    ///
    /// Starts the engine of --command (an `openai` template using
    /// {weights} and {port}) on --weights, --runs times each: opening the
    /// file itself (dropped from the page cache, or in it), from the weight
    /// store (a fresh daemon loading the blob from disk or page cache, or
    /// the artifact resident: lease-in-place), and a WARM wake where the
    /// engine can sleep. Prints each start's phases and, beside them, the
    /// store's weight read against a raw sequential read of the same
    /// bytes. See docs/engines.md.
    Coldstart(ColdstartArgs),
    /// What a LoRA adapter costs a request through the gateway.
    ///
    /// Registers synthetic PEFT adapters of --rank in a weight store (a
    /// temporary directory), starts a mock engine with zero compute time
    /// and the runtime LoRA API and `hangar serve` in front of it (child
    /// processes, `router = "adapter"`, 4 adapter slots). Then: requests for
    /// the base model and for an adapter already loaded, --requests each,
    /// one of each in turn (what the adapter adds at p50 and p99); and
    /// --fresh adapters never asked for, each first loaded straight on the
    /// mock (the engine's own load time), then asked for through the
    /// gateway (what the request pays beyond that load). With --fleet, the
    /// same through a fleet: a private Redis, a store registry, two nodes
    /// each with its store daemon and agent, one gateway. See
    /// docs/adapters.md.
    Adapters(AdaptersArgs),
}

#[derive(Debug, ClapArgs)]
struct AdaptersArgs {
    /// Requests for the base model and for the loaded adapter, each.
    #[arg(long, default_value_t = 2_000)]
    requests: usize,
    /// Adapters loaded on demand.
    #[arg(long, default_value_t = 16)]
    fresh: usize,
    /// The adapters' LoRA rank (32 layers of q_proj and v_proj at hidden
    /// 4096: 67 MB at rank 64).
    #[arg(long, default_value_t = 64)]
    rank: usize,
    /// On a fleet of two nodes behind one gateway (needs `redis-server`):
    /// a fresh adapter's load includes its directory's making on the
    /// replica's node, from that node's store or fetched from its peer.
    #[arg(long)]
    fleet: bool,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, ClapArgs)]
struct ColdstartArgs {
    /// The engine's command template, e.g. `llama-server -m {weights}
    /// --port {port}`.
    #[arg(long)]
    command: String,
    /// The weights file (a GGUF for llama.cpp).
    #[arg(long)]
    weights: std::path::PathBuf,
    /// Starts of each kind (the median is printed).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Seconds an engine may take to become ready.
    #[arg(long, default_value_t = 120)]
    setup_timeout_s: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, ClapArgs)]
struct StoreArgs {
    /// Working directory (generated model, store roots); reused between runs.
    #[arg(long, default_value = "target/store-bench")]
    dir: std::path::PathBuf,
    /// Size of the generated artifact.
    #[arg(long, default_value = "2GiB")]
    size: hangar_core::ByteSize,
    /// Lease-in-place calls to time. Host noise on a shared VM comes in
    /// bursts of a dozen slow calls; enough calls keep one burst from
    /// deciding the p99.
    #[arg(long, default_value_t = 10_000)]
    lip_calls: usize,
    /// Skip the cold-cache rows, which drop the whole machine's page cache
    /// before every run (they are skipped anyway when not root).
    #[arg(long)]
    warm_only: bool,
}

#[derive(Debug, ClapArgs)]
struct QueueArgs {
    /// Predictions created and claimed.
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// Claiming workers (replica slots).
    #[arg(long, default_value_t = 8)]
    slots: usize,
    /// The first account's backlog.
    #[arg(long, default_value_t = 10_000)]
    backlog: usize,
    /// Other accounts' predictions, one at a time (each account its own).
    #[arg(long, default_value_t = 200)]
    probes: usize,
    /// A scratch Redis for the Redis Streams figures (it must hold no
    /// Hangar keys); default: a private redis-server started for the
    /// bench, when one is installed.
    #[arg(long)]
    redis: Option<String>,
    /// Also on a private Redis Cluster with a replica per primary
    /// (`redis-server` needed), without and with `durable_replicas = 1`:
    /// what waiting for a replica adds to a create.
    #[arg(long)]
    durable: bool,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, ClapArgs)]
struct ChaosArgs {
    /// The seed of the fault schedule and of the load: the same seed gives
    /// the same schedule.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How long the schedule runs, minutes (fractions allowed).
    #[arg(long, default_value_t = 5.0)]
    minutes: f64,
    /// Run the faults written in this TOML file instead of a seed's
    /// (`[[step]]` tables of `gap_ms` and `fault`; docs/cluster.md), for
    /// as long as they last; `--seed` still seeds the load. Faults no seed
    /// draws, such as `engine-hang` and `node-drain`, are only run so.
    #[arg(long, value_name = "FILE", conflicts_with = "minutes")]
    schedule: Option<std::path::PathBuf>,
    /// Concurrent clients of the load.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Requests per second of the load, all clients together.
    #[arg(long, default_value_t = 6.0)]
    rate: f64,
    /// The Redis the fleet runs on: `single` (one server with AOF: a kill
    /// is an outage) or `cluster` (three primaries with a replica each: a
    /// kill of the primary of Hangar's slot is a failover).
    #[arg(long, default_value = "single")]
    redis: chaos::Topology,
    /// Print the seed's schedule and exit, without running anything.
    #[arg(long)]
    dry_run: bool,
    /// Keep the processes' logs even when the run passes (a failed run
    /// always keeps them; the report names the directory).
    #[arg(long)]
    keep_logs: bool,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, ClapArgs)]
struct ClusterArgs {
    /// Simulated node agents in part 1.
    #[arg(long, default_value_t = 1000)]
    agents: usize,
    /// How long part 1 runs, seconds.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, ClapArgs)]
struct PredictionsArgs {
    /// Predictions in each phase.
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// Keep-alive clients in the closed loops.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Creates per second in the open loop.
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, ClapArgs)]
struct GatewayArgs {
    /// Requests per path in each phase.
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// Keep-alive clients per path in the closed loop (also the most
    /// requests in flight in the open loop).
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Requests per second in the open loop.
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Request kind.
    #[arg(long, value_enum, default_value_t = Body::Chat)]
    body: Body,
    /// Also run the gateway without inference events (`[events] enabled =
    /// false`), taking turns with the one with them: their cost in
    /// throughput and CPU per request, measured side by side.
    #[arg(long)]
    compare_events: bool,
    /// Also run the gateway of this other `hangar` binary (an earlier
    /// build), taking turns with this one's: a change's cost side by side
    /// in one run, steadier than two runs compared.
    #[arg(long, value_name = "HANGAR")]
    baseline: Option<std::path::PathBuf>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Body {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completion,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let hangar_exe = std::env::current_exe().context("cannot find the hangar binary to start processes")?;
    let a = match args.command {
        Command::Gateway(a) => a,
        Command::Predictions(a) => {
            let options = predictions::Options {
                requests: a.requests,
                concurrency: a.concurrency,
                rate: a.rate,
                hangar_exe,
            };
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let report = runtime.block_on(predictions::run(&options))?;
            return print(&report, a.json);
        }
        Command::Cluster(a) => {
            let options = cluster::Options { agents: a.agents, seconds: a.seconds, hangar_exe };
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let report = runtime.block_on(cluster::run(&options))?;
            return print(&report, a.json);
        }
        Command::Chaos(a) => {
            if !(a.minutes.is_finite() && a.minutes > 0.0) {
                anyhow::bail!("--minutes must be a positive number, not {}", a.minutes);
            }
            let schedule = match &a.schedule {
                None => None,
                Some(path) => {
                    let text = std::fs::read_to_string(path)
                        .map_err(|e| anyhow::anyhow!("schedule {}: {e}", path.display()))?;
                    let schedule = chaos::Schedule::from_toml(&text, chaos::AGENTS, chaos::GATEWAYS)
                        .map_err(|e| anyhow::anyhow!("schedule {}: {e}", path.display()))?;
                    Some(schedule)
                }
            };
            if a.dry_run {
                let ms = (a.minutes * 60_000.0) as u64;
                let random = || chaos::Schedule::random(a.seed, ms, chaos::AGENTS, chaos::GATEWAYS);
                print!("{}", schedule.unwrap_or_else(random));
                return Ok(());
            }
            let options = chaos::Options {
                seed: a.seed,
                duration: match schedule {
                    Some(_) => std::time::Duration::ZERO,
                    None => std::time::Duration::from_secs_f64(a.minutes * 60.0),
                },
                schedule,
                clients: a.clients,
                rate: a.rate,
                redis: a.redis,
                hangar_exe,
                keep_logs: a.keep_logs,
            };
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            // Interrupted (Ctrl-C, SIGTERM), the run is dropped, which kills
            // every process it started.
            let report = runtime.block_on(async {
                tokio::select! {
                    report = chaos::run(&options) => Ok(report?),
                    () = super::engine::shutdown_signal() => Err(anyhow::anyhow!("interrupted: every process of the run was killed")),
                }
            })?;
            print(&report, a.json)?;
            if !report.passed() {
                match &a.schedule {
                    Some(path) => anyhow::bail!(
                        "the fault-injection run failed its checks (schedule {}, seed {})",
                        path.display(),
                        a.seed
                    ),
                    None => anyhow::bail!("the fault-injection run failed its checks (seed {})", a.seed),
                }
            }
            return Ok(());
        }
        Command::Queue(a) => {
            let options = queue::Options {
                requests: a.requests,
                slots: a.slots,
                backlog: a.backlog,
                probes: a.probes,
                redis: a.redis,
                durable: a.durable,
            };
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let report = runtime.block_on(queue::run(&options))?;
            return print(&report, a.json);
        }
        Command::Adapters(a) => {
            let options = adapters::Options {
                requests: a.requests,
                fresh: a.fresh,
                rank: a.rank,
                fleet: a.fleet,
                hangar_exe,
            };
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let report = runtime.block_on(adapters::run(&options))?;
            return print(&report, a.json);
        }
        Command::Coldstart(a) => {
            let options = coldstart::Options {
                command: a.command,
                weights: a.weights,
                runs: a.runs,
                setup_timeout: std::time::Duration::from_secs(a.setup_timeout_s),
                hangar_exe,
            };
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let report = runtime.block_on(coldstart::run(&options))?;
            return print(&report, a.json);
        }
        Command::Store(a) => {
            let lip_calls =
                std::num::NonZeroUsize::new(a.lip_calls).context("--lip-calls must be at least 1")?;
            let cfg = hangar_store::bench::BenchConfig {
                dir: a.dir,
                size: a.size.bytes(),
                lip_calls,
                cold: !a.warm_only,
            };
            print!("{}", hangar_store::bench::run(&cfg)?);
            return Ok(());
        }
    };
    let options = gateway::Options {
        requests: a.requests,
        concurrency: a.concurrency,
        rate: a.rate,
        body: match a.body {
            Body::Chat => BodyKind::Chat,
            Body::Completion => BodyKind::Completion,
        },
        hangar_exe,
        compare_events: a.compare_events,
        baseline: a.baseline,
    };
    // One thread: the load generator should take as little of the machine
    // as it can from the processes it measures, and the same from both paths.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let report = runtime.block_on(gateway::run(&options))?;
    print(&report, a.json)
}

fn print(report: &(impl serde::Serialize + std::fmt::Display), json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}
