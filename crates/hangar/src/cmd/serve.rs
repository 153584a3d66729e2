//! `hangar serve`: the serving platform on this machine.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use axum::serve::ListenerExt;
use clap::Args as ClapArgs;
use hangar_agent::engine::EngineSpec;
use hangar_agent::weights::WeightsSource;
use hangar_predictions::store::Backend;
use hangar_redis::Redis;
use hangar_runtime::serve::{DataDirLock, ServeConfig, Server};

use super::engine::shutdown_signal;
use super::read_text;

/// Serve models behind an OpenAI-compatible gateway.
///
/// Without --config it serves a built-in demo: one node with two virtual
/// 80 GB GPUs and two mock chat models on 127.0.0.1:8080. The first output
/// line is `listening on http://ADDR`. SIGTERM or Ctrl-C stops the gateway
/// and every engine it started.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// Configuration file (TOML; see docs/config.md).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Listen address, overriding the file's `listen`.
    #[arg(long)]
    listen: Option<String>,
    /// The Redis this gateway shares with others (`redis://HOST:PORT/DB`,
    /// `redis://:PASSWORD@HOST:PORT/DB`, `unix:///path`), overriding the
    /// file's `redis`: predictions then live on Redis Streams
    /// (docs/cluster.md). Messages show it with the password hidden.
    #[arg(long, env = "HANGAR_REDIS", hide_env_values = true)]
    redis: Option<String>,
    /// A TOML file of the secrets, `api_keys` and `metrics_key`, kept
    /// apart from the configuration (a Kubernetes Secret beside its
    /// ConfigMap); the configuration must then set neither.
    #[arg(long, env = "HANGAR_KEYS_FILE")]
    keys_file: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(url) = &args.redis {
        hangar_redis::check_url(url).map_err(|e| anyhow::anyhow!("--redis: {e}"))?;
    }
    let mut config: ServeConfig = match &args.config {
        Some(path) => {
            ServeConfig::from_toml_with_redis(&read_text(path)?, &path.display().to_string(), args.redis)?
        }
        None => {
            let mut demo = ServeConfig::demo();
            demo.redis = args.redis.or(demo.redis);
            demo
        }
    };
    if let Some(path) = &args.keys_file {
        let origin = args.config.as_ref().map_or("the built-in demo".into(), |p| p.display().to_string());
        config = config.with_keys_file(&origin, &read_text(path)?, &path.display().to_string())?;
    }
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    let base = args.config.as_deref().map(config_dir);
    if let Some(base) = base {
        resolve_engine_paths(&mut config, base)?;
    }
    // Procedures keep their registry and source cache in the data
    // directory, whatever the predictions store.
    if config.predictions.procedures.runtime.is_some() {
        config.predictions.procedures.dir = Some(data_dir(&config, base)?.join("procedures"));
    }
    // Before anything starts: the predictions store. In SQLite, a second
    // server on the directory would take the first one's running
    // predictions for abandoned, so the directory is locked; on Redis,
    // any number of gateways share it.
    let (backend, _lock) = match &config.redis {
        Some(url) => (Backend::Redis(Redis::connect(url)?), None),
        None => {
            let data_dir = data_dir(&config, base)?;
            let lock = DataDirLock::acquire(&data_dir)?;
            // Inference events go to a JSONL file under it (a fleet's to
            // its Redis stream).
            config.events.path = Some(config.events.file(&data_dir));
            (Backend::Sqlite(data_dir), Some(lock))
        }
    };
    hangar_gateway::install_panic_hook();
    let exe = std::env::current_exe().context("cannot find the hangar binary to start engines")?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let addr = listener.local_addr()?;
        let try_line = try_line(&config, addr);
        let body_limit = config.max_body_bytes.bytes() as usize;
        let predictions = std::mem::take(&mut config.predictions);
        // With a Redis and no nodes of its own, this is one gateway of a
        // fleet: the nodes are the agents that register there.
        let server = match &backend {
            Backend::Redis(redis) if config.nodes.is_empty() => {
                Server::start_gateway(config, redis.clone()).await?
            }
            _ => Server::start(config, exe).await?,
        };
        let service = server
            .start_predictions(&backend, predictions, &format!("http://{addr}"))
            .await
            .with_context(|| format!("cannot start predictions in {}", backend_name(&backend)))?;
        // One write, and errors ignored: whoever started us may read only
        // the first line and close the pipe, which must not stop a server.
        let announce = format!("listening on http://{addr}\ntry: {try_line}\n");
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(announce.as_bytes()).and_then(|()| out.flush());
        drop(out);
        let router = hangar_gateway::router(&server, &service, body_limit);
        // Streamed answers (tokens, SSE) are small writes: send each at
        // once (no Nagle).
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, router).with_graceful_shutdown(shutdown_signal()).await?;
        service.stop();
        server.shutdown().await;
        Ok(())
    })
}

/// Where predictions are stored, for an error message.
fn backend_name(backend: &Backend) -> String {
    match backend {
        Backend::Sqlite(dir) => dir.display().to_string(),
        Backend::Redis(redis) => format!("redis at {}", redis.url()),
    }
}

/// A ready-to-paste curl line for the first model: a chat completion, or a
/// prediction when every model runs on cog (which serves no chat).
fn try_line(config: &ServeConfig, addr: std::net::SocketAddr) -> String {
    let key = match config.models.iter().find(|m| !m.engine.is_cog()) {
        Some(chat) => {
            return format!(
                "curl -s http://{addr}/v1/chat/completions -H 'content-type: application/json' \
                 -d '{{\"model\": \"{}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"max_tokens\": 16}}'",
                chat.key
            )
        }
        None => config.models.first().map(|m| m.key.to_string()).unwrap_or_default(),
    };
    format!(
        "curl -s http://{addr}/v1/models/{key}/predictions -H 'content-type: application/json' \
         -H 'Prefer: wait' -d '{{\"input\": {{\"prompt\": \"Hello\"}}}}'  (its inputs: GET /v1/models/{key}/versions)"
    )
}

/// The directory of the configuration file `file`, against which its
/// relative paths are resolved.
pub(crate) fn config_dir(file: &Path) -> &Path {
    match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Makes the store's root and socket, weights files, the model directory and interpreter of `cog`
/// engines and the engine file of `mock` engines absolute, resolving relative ones against
/// the configuration file's directory `base` (the server runs them from
/// elsewhere). A bare interpreter name (`python3`) is left to `PATH`; a
/// mock engine file that cannot be read is an error naming the model.
pub(crate) fn resolve_engine_paths(config: &mut ServeConfig, base: &Path) -> anyhow::Result<()> {
    let resolve = |path: &mut PathBuf| -> anyhow::Result<()> {
        *path = std::path::absolute(base.join(&*path))
            .with_context(|| format!("cannot resolve {}", path.display()))?;
        Ok(())
    };
    for path in [&mut config.store.root, &mut config.store.socket].into_iter().flatten() {
        resolve(path)?;
    }
    for model in &mut config.models {
        if let Some(WeightsSource::File(path)) = &mut model.weights {
            resolve(path)?;
        }
        match &mut model.engine {
            EngineSpec::Cog { dir, python, .. } => {
                resolve(dir)?;
                if python.components().count() > 1 {
                    resolve(python)?;
                }
            }
            EngineSpec::Procedures { python, .. } if python.components().count() > 1 => resolve(python)?,
            EngineSpec::Mock { engine_config: Some(path), .. } => {
                resolve(path)?;
                std::fs::metadata(&*path).with_context(|| {
                    format!("model {}: cannot read its engine_config {}", model.key, path.display())
                })?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// The data directory: `data_dir` from the file (relative to the file's
/// directory `beside`), else `hangar-data` beside the file; for the
/// built-in demo `$HANGAR_DATA_DIR`, `$XDG_DATA_HOME/hangar` or
/// `~/.local/share/hangar`.
fn data_dir(config: &ServeConfig, beside: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(dir) = &config.data_dir {
        return Ok(match beside {
            Some(base) if dir.is_relative() => base.join(dir),
            _ => dir.clone(),
        });
    }
    if let Some(base) = beside {
        return Ok(base.join("hangar-data"));
    }
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("HANGAR_DATA_DIR")
        .or_else(|| env("XDG_DATA_HOME").map(|d| d.join("hangar")))
        .or_else(|| env("HOME").map(|h| h.join(".local/share/hangar")))
        .context("no data directory: set data_dir in a configuration file, or HANGAR_DATA_DIR")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_try_line_is_a_chat_unless_every_model_runs_on_cog() {
        let addr: std::net::SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let line = try_line(&ServeConfig::demo(), addr);
        assert!(line.contains("/v1/chat/completions") && line.contains("demo/chat-small"), "{line}");
        let cog_only: ServeConfig = toml::from_str(
            "nodes = []\n[[models]]\nkey = \"acme/echo\"\nengine = { kind = \"cog\", dir = \"m\" }\n",
        )
        .unwrap();
        let line = try_line(&cog_only, addr);
        assert!(line.contains("/v1/models/acme/echo/predictions") && !line.contains("chat"), "{line}");
    }
}
