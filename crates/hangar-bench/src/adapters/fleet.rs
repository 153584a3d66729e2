//! The benchmark on a fleet: a private Redis, a store registry, two nodes
//! (`n0`, `n1`) each with its own weight store daemon and agent, and one
//! gateway, all child processes of the run. The model has one replica;
//! the loaded adapter is registered on both nodes, the fresh ones in turn
//! on `n0` and `n1`, so that whichever node runs the replica, half of them
//! are in its own store and half only in its peer's.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hangar_redis::fleet::FleetState;
use hangar_redis::{LocalRedis, Redis};
use hangar_store::BlobStore;

use super::{
    exported_ahead, fresh_figure, loaded_figure, model_extra, register, until_ok, Fresh, Options, Report,
    Source,
};
use crate::processes::{address, spawn_announcing, spawn_first_line, Process, MODEL};
use crate::BenchError;

/// The nodes' names.
const NODES: [&str; 2] = ["n0", "n1"];

/// The fleet's processes (killed when dropped) and what the figures need
/// of them.
struct Fleet {
    gateway: Process,
    /// Seconds from the agents' start until each node had made the
    /// directories of its own store's adapters ahead of need.
    made_ahead_s: f64,
    /// The one replica's node (an index into [`NODES`]) and engine URL.
    replica: (usize, String),
    /// Each node's store, opened by the bench beside its daemon.
    stores: Vec<BlobStore>,
    _processes: Vec<tokio::process::Child>,
    _agents: Vec<Process>,
    _redis: LocalRedis,
    _dir: tempfile::TempDir,
}

/// Runs both figures on a fleet, `names[0]` the loaded adapter and the
/// rest the fresh ones.
///
/// # Cancel safety
/// Dropping the future kills every child process (and Redis).
pub(super) async fn run(options: &Options, names: &[String]) -> Result<Report, BenchError> {
    let (fleet, adapter_bytes) = Fleet::start(options, names).await?;
    let gateway = address(&fleet.gateway.url)?;
    let (mut client, base, loaded) = loaded_figure(gateway, &names[0], options.requests).await?;
    let (node, engine_url) = &fleet.replica;
    let fresh: Vec<Fresh> = names[1..]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let home = i % NODES.len();
            let source = if home == *node { Source::ThisNode } else { Source::Peer };
            Fresh { name, store: &fleet.stores[home], source: Some(source) }
        })
        .collect();
    let fresh = fresh_figure(&mut client, gateway, engine_url, &fresh, base.p50_ms).await?;
    Ok(Report::new(true, adapter_bytes, fleet.made_ahead_s, (base, loaded), fresh))
}

impl Fleet {
    /// Registers the adapters, starts every process and waits until the
    /// gateway answers for the base model and knows every adapter; the
    /// fleet, and each adapter's bytes.
    async fn start(options: &Options, names: &[String]) -> Result<(Fleet, u64), BenchError> {
        let exe = options.hangar_exe.as_path();
        let dir = tempfile::tempdir()?;
        let roots: Vec<PathBuf> = NODES.iter().map(|n| dir.path().join(n).join("store")).collect();
        let (mut stores, mut own_counts, mut adapter_bytes) = (Vec::new(), Vec::new(), 0);
        for (node, root) in roots.iter().enumerate() {
            let own: Vec<(u64, &str)> = names
                .iter()
                .enumerate()
                .filter(|&(i, _)| i == 0 || (i - 1) % NODES.len() == node)
                .map(|(i, n)| (i as u64, n.as_str()))
                .collect();
            let (store, bytes) = register(root, &own, options.rank).await?;
            stores.push(store);
            own_counts.push(own.len());
            adapter_bytes = bytes;
        }

        let redis = tokio::task::spawn_blocking(LocalRedis::start)
            .await
            .expect("starting Redis does not panic")
            .map_err(|e| BenchError::Failed(format!("starting a private Redis: {e}")))?;
        let log = |name: &str| std::fs::File::create(dir.path().join(format!("{name}.log")));
        let mut processes = Vec::new();
        let registry_root = dir.path().join("registry");
        std::fs::create_dir_all(&registry_root)?;
        let (registry, line) = store_process(
            exe,
            &registry_root,
            &["store", "registry", "--listen", "127.0.0.1:0"],
            log("registry")?,
        )
        .await?;
        processes.push(registry);
        let registry = line.strip_prefix("registry at ").unwrap_or(&line).to_owned();
        for (node, root) in NODES.iter().zip(&roots) {
            let socket = root.join("store.sock").display().to_string();
            let args = [
                "store",
                "serve",
                "--socket",
                &socket,
                "--listen",
                "127.0.0.1:0",
                "--registry",
                &registry,
                "--node",
                node,
            ];
            let (daemon, line) = store_process(exe, root, &args, log(&format!("store-{node}"))?).await?;
            if !line.starts_with("serving") {
                return Err(BenchError::Failed(format!("node {node}'s store daemon did not start: {line}")));
            }
            processes.push(daemon);
        }

        let config = format!(
            "redis = \"{}\"\n\n[[models]]\nkey = \"{MODEL}\"\nengine = {{ kind = \"mock\", preset = \"instant\" }}\n\
             size = \"1GB\"\nmin_replicas = 1\nmax_replicas = 1\nconcurrency = 8\n{}",
            redis.url(),
            model_extra()
        );
        let gateway_config = dir.path().join("gateway.toml");
        std::fs::write(&gateway_config, &config)?;
        let gateway = spawn_announcing(
            exe,
            &["serve", "--config", path(&gateway_config), "--listen", "127.0.0.1:0"],
            &[],
            log("gateway")?,
        )
        .await?;
        let mut agents = Vec::new();
        let agents_started = Instant::now();
        for (node, root) in NODES.iter().zip(&roots) {
            let own = dir.path().join(node).join("fleet.toml");
            std::fs::write(&own, format!("{config}\n[store]\nroot = \"{}\"\n", root.display()))?;
            let args = [
                "agent",
                "--config",
                path(&own),
                "--redis",
                &redis.url(),
                "--name",
                node,
                "--gpus",
                "1",
                "--gpu-memory",
                "80GB",
                "--virtual-gpus",
                "--listen",
                "127.0.0.1:0",
            ];
            agents.push(spawn_announcing(exe, &args, &[], log(&format!("agent-{node}"))?).await?);
        }

        let replica = replica(&agents).await?;
        until_ok(&super::chat(address(&gateway.url)?, MODEL), "the base model through the gateway").await?;
        published(&redis.url(), names.len()).await?;
        // The steady state, as on one machine: every node has made its own
        // store's adapters' directories (a peer's are made on demand).
        let mut made_ahead_s: f64 = 0.0;
        for (root, &count) in roots.iter().zip(&own_counts) {
            made_ahead_s = made_ahead_s.max(exported_ahead(root, count, agents_started).await?);
        }
        let fleet = Fleet {
            gateway,
            made_ahead_s,
            replica,
            stores,
            _processes: processes,
            _agents: agents,
            _redis: redis,
            _dir: dir,
        };
        Ok((fleet, adapter_bytes))
    }
}

/// `hangar ARGS` on the store at `root`: the process and its first line.
async fn store_process(
    exe: &Path,
    root: &Path,
    args: &[&str],
    log: std::fs::File,
) -> Result<(tokio::process::Child, String), BenchError> {
    let root = root.to_str().expect("a UTF-8 temporary path");
    spawn_first_line(exe, args, &[("HANGAR_STORE_ROOT", root)], log).await
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 temporary path")
}

/// Waits (a minute at most) until one of the agents runs the model's
/// replica: its node's index and its engine's URL, from the agent's
/// `/status`.
async fn replica(agents: &[Process]) -> Result<(usize, String), BenchError> {
    let http = hangar_agent::direct_http().build().expect("a plain HTTP client");
    let started = Instant::now();
    loop {
        for (node, agent) in agents.iter().enumerate() {
            let Ok(answer) = http.get(format!("{}/status", agent.url)).send().await else { continue };
            let Ok(status) = answer.json::<serde_json::Value>().await else { continue };
            let replicas = status["replicas"].as_array().cloned().unwrap_or_default();
            let ready = replicas.iter().find(|r| r["phase"] == "ready" && r["url"].is_string());
            if let Some(url) = ready.and_then(|r| r["url"].as_str()) {
                return Ok((node, url.to_owned()));
            }
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Err(BenchError::Failed("no agent ran the model's replica within a minute".into()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (a minute at most) until both nodes have published all their
/// adapters in Redis (`count` names across both, the loaded one on each),
/// then for a second more: the gateway reads what a node publishes at its
/// next report (every 250 ms), so the second figure finds every adapter
/// known.
async fn published(redis_url: &str, count: usize) -> Result<(), BenchError> {
    let url = redis_url.to_owned();
    let started = Instant::now();
    loop {
        let url = url.clone();
        let names = tokio::task::spawn_blocking(move || {
            let fleet = FleetState::new(Redis::connect(&url).ok()?);
            let mut names = std::collections::BTreeSet::new();
            for node in NODES {
                let published = fleet.adapters(node).ok()??;
                names.extend(published.adapters.into_iter().map(|a| a.adapter.to_string()));
            }
            Some(names.len())
        })
        .await
        .expect("reading Redis does not panic");
        if names == Some(count) {
            tokio::time::sleep(Duration::from_secs(1)).await;
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Err(BenchError::Failed(format!(
                "the nodes published {} of {count} adapters within a minute",
                names.unwrap_or(0)
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
