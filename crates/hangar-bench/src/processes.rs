//! The `hangar` child processes the benches start: a mock engine with zero
//! compute time and `hangar serve` on a configuration written for the
//! bench. Each runs as its own process, with its own tokio runtime, as
//! deployed, so that it shares no worker threads with the load generator.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use hangar_agent::engine::{launch, launch_announcing, EngineSpec, LaunchContext, RunningEngine};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::BenchError;

/// The model name the gateway and predictions benches serve.
pub(crate) const MODEL: &str = "bench/instant";

/// A mock engine with zero compute time (`--preset instant`) serving
/// [`MODEL`], as a child process.
pub(crate) async fn launch_instant_engine(hangar_exe: &Path) -> Result<RunningEngine, BenchError> {
    let ctx = LaunchContext {
        model: MODEL.into(),
        gpus: Vec::new(),
        gpu_fraction: 1.0,
        hangar_exe: hangar_exe.to_owned(),
        mock_setup_timeout: Duration::from_secs(60),
        weights: None,
    };
    let spec = EngineSpec::mock("instant", 0);
    launch(&spec, &ctx).await.map_err(|source| BenchError::Launch { what: "mock engine", source })
}

/// A `hangar serve` child process and the directory of its configuration
/// and data (removed when dropped, after the process is stopped).
pub(crate) struct Server {
    /// The process.
    pub process: RunningEngine,
    _dir: tempfile::TempDir,
}

/// Starts `hangar serve` on one virtual node with the model [`MODEL`] on
/// the engine at `engine_url` (`permits` per replica), plus the TOML
/// `extra`; `what` names it in errors.
pub(crate) async fn start_serve(
    hangar_exe: &Path,
    engine_url: &str,
    permits: usize,
    extra: &str,
    what: &'static str,
) -> Result<Server, BenchError> {
    let config = format!(
        r#"listen = "127.0.0.1:0"

[[nodes]]
id = "bench"
gpus = 1
gpu_memory = "80GB"
virtual_gpus = true

[[models]]
key = "{MODEL}"
engine = {{ kind = "external", url = "{engine_url}" }}
size = "1GB"
min_replicas = 1
concurrency = {permits}
{extra}"#
    );
    start_serve_config(hangar_exe, &config, what).await
}

/// Starts `hangar serve` on `config` (written to a temporary directory,
/// which also holds its data and its log, `serve.log`, kept off the
/// benchmark's own output); `what` names it in errors.
pub(crate) async fn start_serve_config(
    hangar_exe: &Path,
    config: &str,
    what: &'static str,
) -> Result<Server, BenchError> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench-serve.toml");
    std::fs::write(&path, config)?;
    let log = std::fs::File::create(dir.path().join("serve.log"))?;
    let mut cmd = Command::new(hangar_exe);
    cmd.arg("serve").arg("--config").arg(&path).stderr(log);
    let process = launch_announcing(cmd, hangar_exe, Duration::from_secs(60))
        .await
        .map_err(|source| BenchError::Launch { what, source })?;
    Ok(Server { process, _dir: dir })
}

/// The socket address of an `http://HOST:PORT` URL the children announce.
pub(crate) fn address(url: &str) -> Result<SocketAddr, BenchError> {
    let hostport = url.strip_prefix("http://").unwrap_or(url).trim_end_matches('/');
    hostport.parse().map_err(|_| BenchError::Options(format!("`{url}` is not an http://IP:PORT address")))
}

/// A `hangar` child process that announced `… listening on URL` on its
/// first line (`hangar serve`, `hangar agent`). Killed when dropped.
pub(crate) struct Process {
    /// The process.
    pub child: tokio::process::Child,
    /// The URL it announced.
    pub url: String,
}

/// Starts `exe args` with the environment `envs` added, its stderr to
/// `log`, and waits (a minute at most) for its first line. A process that
/// exits or says something else first is an error naming what it said.
pub(crate) async fn spawn_announcing(
    exe: &Path,
    args: &[&str],
    envs: &[(&str, &str)],
    log: std::fs::File,
) -> Result<Process, BenchError> {
    let (child, line) = spawn_first_line(exe, args, envs, log).await?;
    match line.split_once("listening on ") {
        Some((_, url)) => Ok(Process { child, url: url.trim().to_owned() }),
        None => Err(BenchError::Options(format!("`hangar {}` did not start: {line:?}", args.join(" ")))),
    }
}

/// Starts `exe args` as [`spawn_announcing`] does (killed when dropped)
/// and returns it with its first line of output, trimmed: an error if it
/// printed none within a minute.
pub(crate) async fn spawn_first_line(
    exe: &Path,
    args: &[&str],
    envs: &[(&str, &str)],
    log: std::fs::File,
) -> Result<(tokio::process::Child, String), BenchError> {
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .envs(envs.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(log)
        .kill_on_drop(true);
    let mut child = cmd.spawn()?;
    let stdout = child.stdout.take().expect("piped");
    let mut line = String::new();
    let read =
        tokio::time::timeout(Duration::from_secs(60), BufReader::new(stdout).read_line(&mut line)).await;
    match read {
        Ok(Ok(n)) if n > 0 => Ok((child, line.trim().to_owned())),
        _ => Err(BenchError::Options(format!(
            "`hangar {}` printed nothing within a minute (its log says why)",
            args.join(" ")
        ))),
    }
}

/// CPU time a process has used so far, read from `/proc`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ProcessCpu {
    /// All its live threads together.
    pub total: Duration,
    /// Its live threads of the name asked for (e.g. `hangar-events`).
    pub named: Duration,
}

impl std::ops::AddAssign for ProcessCpu {
    fn add_assign(&mut self, more: ProcessCpu) {
        self.total += more.total;
        self.named += more.named;
    }
}

impl std::ops::Sub for ProcessCpu {
    type Output = ProcessCpu;

    fn sub(self, before: ProcessCpu) -> ProcessCpu {
        ProcessCpu {
            total: self.total.saturating_sub(before.total),
            named: self.named.saturating_sub(before.named),
        }
    }
}

/// The CPU time of process `pid`'s threads, and of those named `name`
/// (none asked for: `named` stays zero and no thread's name is read),
/// from each thread's `schedstat` (nanoseconds on the CPU, where `stat`
/// counts 10 ms ticks: too coarse for a phase of a second). Threads that
/// have exited are not counted, so a difference is only meaningful for a
/// process whose threads live on (a tokio runtime's workers, a writer
/// thread). `None` once the process is gone or without `/proc`.
pub(crate) fn process_cpu(pid: u32, name: Option<&str>) -> Option<ProcessCpu> {
    let mut cpu = ProcessCpu::default();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
        let path = task.path();
        // A thread may end between the listing and the read: skip it.
        let Ok(sched) = std::fs::read_to_string(path.join("schedstat")) else { continue };
        let Some(ns) = sched.split(' ').next().and_then(|n| n.parse::<u64>().ok()) else { continue };
        let ran = Duration::from_nanos(ns);
        cpu.total += ran;
        let named =
            |name| std::fs::read_to_string(path.join("comm")).is_ok_and(|comm| comm.trim_end() == name);
        if name.is_some_and(named) {
            cpu.named += ran;
        }
    }
    Some(cpu)
}
