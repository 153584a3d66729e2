//! Engine processes: start, wait until ready, stop.
//!
//! An [`EngineSpec`] says what runs a replica:
//! - `mock`: `hangar engine mock --host HOST --port 0 --preset NAME --model
//!   MODEL`, a child of this binary; its first output line names the port
//!   it bound.
//! - `openai`: any OpenAI-compatible server from a command template such as
//!   `vllm serve {model} --host {host} --port {port}
//!   --gpu-memory-utilization {gpu_fraction}`, run with
//!   `CUDA_VISIBLE_DEVICES={gpus}`; the port is one free on the host,
//!   chosen here.
//! - `external`: a server already running elsewhere; nothing is started or
//!   stopped.
//! - `cog`: a cog model server, `python -m cog.server.http --host HOST` run
//!   in the model's directory (the one holding `cog.yaml`) with `PORT` set
//!   to a free port; it speaks cog's protocol ([`crate::cog`]), not
//!   OpenAI's, and serves one prediction at a time.
//! - `procedures`: the procedures runtime ([`crate::procedures`]), the
//!   embedded Python server run as `python3 -c RUNTIME --host HOST` with
//!   `PORT` set and no GPU visible; driven as a cog server, one procedure
//!   at a time.
//!
//! HOST, the engine host, is the address an engine binds to and the one
//! its base URL names, so it must be an address whoever sends the engine
//! requests can reach. [`launch`] uses loopback ([`DEFAULT_HOST`]): on one
//! machine the gateway is beside its engines. A fleet's agent uses
//! [`launch_on`] with an address of its machine (a pod's IP), because the
//! gateways that call its engines run elsewhere.
//!
//! [`launch`] returns once the engine answers its readiness path with 200
//! (for `cog`: once `/health-check` says `READY`), or fails when the
//! process exits, the setup fails (`SETUP_FAILED`, with `setup()`'s logs)
//! or the setup timeout passes — killing what it started, so no failure
//! leaves a process behind. A [`RunningEngine`] is stopped with
//! [`RunningEngine::stop`] (SIGTERM, then SIGKILL after a grace period) and
//! is killed if dropped.
//!
//! A cog server is a process tree: the HTTP server runs the model in a
//! worker process of its own (and Python's resource tracker beside it).
//! Killing only the server leaves the worker reading a closed pipe, and it
//! dies printing an `EOFError` traceback. So a cog server is always asked
//! to shut down through cog's own `POST /shutdown` — also when its setup
//! failed or timed out — which terminates the worker and exits cleanly, and
//! does not depend on the server's signal dispositions (it ignores SIGTERM
//! and, started from a shell in the background, inherits SIGINT ignored).
//! It runs in a process group of its own, so that the SIGKILL of last resort
//! takes the whole tree, and a Ctrl-C at the terminal reaches only
//! `hangar`, which stops it.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use rustix::process::Signal;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::cog::{self, CogMode, HealthStatus};
use crate::log_tail::LogTail;
use crate::weights::HandedWeights;

/// What runs a model's replicas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum EngineSpec {
    /// The built-in mock engine.
    Mock {
        /// A `hangar engine mock` preset.
        #[serde(default = "default_preset")]
        preset: String,
        /// Milliseconds the mock reports "loading" (weight loading).
        #[serde(default)]
        startup_delay_ms: u64,
        /// Milliseconds a wake from sleep (WARM → HOT) takes.
        #[serde(default)]
        wake_delay_ms: u64,
        /// An engine configuration file (TOML, the fields of docs/sim.md's
        /// engines) replacing the preset's engine; relative paths are
        /// resolved against the configuration file's directory.
        #[serde(default)]
        engine_config: Option<PathBuf>,
    },
    /// Any OpenAI-compatible server started from a command template.
    Openai {
        /// The command, split on whitespace after substituting `{model}`,
        /// `{host}` (the engine host, for the server's listen-address flag),
        /// `{port}`, `{gpus}`, `{gpu_fraction}` and `{weights}` (a path to
        /// the model's `weights`, materialized by the store).
        command: String,
        /// The path answering 200 once the server is ready.
        #[serde(default = "default_readiness")]
        readiness_path: String,
        /// Seconds to wait for readiness before giving up.
        #[serde(default = "default_setup_timeout")]
        setup_timeout_s: u64,
    },
    /// A server already running elsewhere.
    External {
        /// Its base URL, e.g. `http://10.0.0.7:8000`.
        url: String,
    },
    /// A cog model server (`python -m cog.server.http`).
    Cog {
        /// The model's directory, holding `cog.yaml` and the predictor;
        /// relative paths are resolved against the configuration file's
        /// directory.
        dir: PathBuf,
        /// The Python interpreter that has the `cog` package.
        #[serde(default = "default_python")]
        python: PathBuf,
        /// Seconds `setup()` may take before giving up.
        #[serde(default = "default_setup_timeout")]
        setup_timeout_s: u64,
        /// Its servers run the model's `train` (cog's `--x-mode train`)
        /// instead of `predict`: set only on the *trainer* Hangar derives
        /// from each cog model, whose replicas run that model's trainings
        /// (docs/predictions.md, "Trainings"); never read from a file.
        #[serde(skip)]
        train: bool,
    },
    /// The procedures runtime ([`crate::procedures`]): the embedded Python
    /// server that runs procedures, spoken to as a cog server.
    Procedures {
        /// The Python interpreter (3.8 or later) that runs it and the
        /// procedures; the packages procedures import must be installed
        /// for it.
        #[serde(default = "default_python")]
        python: PathBuf,
        /// Seconds it may take to answer its health check.
        #[serde(default = "default_setup_timeout")]
        setup_timeout_s: u64,
    },
}

impl EngineSpec {
    /// A mock engine of `preset` that loads for `startup_delay_ms` and
    /// wakes at once.
    pub fn mock(preset: &str, startup_delay_ms: u64) -> Self {
        Self::Mock { preset: preset.into(), startup_delay_ms, wake_delay_ms: 0, engine_config: None }
    }

    /// Whether replicas speak cog's protocol rather than OpenAI's.
    pub fn is_cog(&self) -> bool {
        matches!(self, Self::Cog { .. } | Self::Procedures { .. })
    }
}

fn default_preset() -> String {
    "default".into()
}

fn default_readiness() -> String {
    "/health".into()
}

fn default_setup_timeout() -> u64 {
    600
}

fn default_python() -> PathBuf {
    "python3".into()
}

/// The engine host of a single machine: loopback, where only the server
/// beside the engines calls them.
pub const DEFAULT_HOST: &str = "127.0.0.1";

/// Where and how to start one replica. (The engine host is not here but an
/// argument of [`launch_on`]: it is the node's, the same for every
/// replica, and callers that only ever start engines on loopback keep
/// building this as they did.)
#[derive(Debug, Clone)]
pub struct LaunchContext {
    /// The model name the engine serves.
    pub model: String,
    /// GPU indices for `CUDA_VISIBLE_DEVICES` (empty: none).
    pub gpus: Vec<u32>,
    /// The share of each GPU's memory the engine may use.
    pub gpu_fraction: f64,
    /// The `hangar` binary, for `mock` engines.
    pub hangar_exe: PathBuf,
    /// Setup timeout for `mock` engines (others carry their own).
    pub mock_setup_timeout: Duration,
    /// The replica's weights ([`crate::weights`]), given as `{weights}`
    /// (a mock: `--weights`): an open descriptor of a whole file's shared
    /// memory, which the engine inherits at the same number and opens as
    /// `/proc/self/fd/N` (it must stay open until the launch returns), or
    /// a model directory's path.
    pub weights: Option<HandedWeights>,
}

impl LaunchContext {
    /// The path `{weights}` stands for.
    fn weights_path(&self) -> Option<String> {
        self.weights.as_ref().map(HandedWeights::path)
    }

    /// Lets the engine inherit the weights descriptor, if it is one.
    fn pass_weights(&self, cmd: &mut Command) {
        if let Some(HandedWeights::Fd(fd)) = self.weights {
            // SAFETY: the closure runs in the forked child before exec and
            // makes one async-signal-safe system call (fcntl).
            unsafe { cmd.pre_exec(move || crate::weights::inherit_in_child(fd)) };
        }
    }
}

/// Why an engine did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// The process could not be spawned.
    #[error("cannot start `{program}`: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The command template is empty after substitution.
    #[error("the engine command template is empty")]
    EmptyCommand,
    /// The command template uses `{weights}` but the model has none.
    #[error("the engine command uses {{weights}} but the model has no `weights`")]
    NoWeights,
    /// The process exited before it was ready.
    #[error("the engine exited before it was ready ({status}){}", last_output(.output))]
    Exited {
        /// Its exit status.
        status: std::process::ExitStatus,
        /// The end of what it printed ([`LogTail`]).
        output: String,
    },
    /// Readiness did not come within the setup timeout.
    #[error("the engine was not ready within {timeout:?}{}", last_output(.output))]
    SetupTimeout {
        /// The setup timeout.
        timeout: Duration,
        /// The end of what it printed ([`LogTail`]).
        output: String,
    },
    /// The mock engine did not announce its address.
    #[error("the engine did not print `listening on http://…` as its first line")]
    NoAddress,
    /// A cog model's `setup()` failed.
    #[error("the model's setup failed (SETUP_FAILED); its logs:\n{logs}")]
    SetupFailed {
        /// What `setup()` printed, with its traceback.
        logs: String,
    },
    /// A cog server reported a fatal error before it was ready.
    #[error("the cog server is DEFUNCT")]
    Defunct,
    /// A local I/O error.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// `; its last output:` and `output`, when it printed anything.
fn last_output(output: &str) -> String {
    if output.trim().is_empty() {
        String::new()
    } else {
        format!("; its last output:\n{output}")
    }
}

/// A started (or external) engine.
#[derive(Debug)]
pub struct RunningEngine {
    /// Base URL, e.g. `http://127.0.0.1:41237`: the engine host and port
    /// (an IPv6 host in brackets, `http://[fd00::2]:41237`).
    pub base_url: String,
    child: Option<Child>,
    /// What asks the process to stop.
    stop_by: StopBy,
    /// The end of what it has printed (empty for external engines).
    logs: LogTail,
}

/// How a started engine is asked to stop before it is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StopBy {
    /// SIGTERM to the process.
    Terminate,
    /// cog's `POST /shutdown` (SIGINT if it does not answer); the process
    /// leads a process group of its own, which SIGKILL takes whole.
    CogShutdown,
}

impl RunningEngine {
    /// The end of what the engine has printed so far.
    pub fn logs(&self) -> &LogTail {
        &self.logs
    }

    /// The engine process's pid, if this node started it.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// Whether the process has exited (always false for external engines).
    pub fn has_exited(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))))
    }

    /// Stops the engine: SIGTERM (a cog server: `POST /shutdown`), then
    /// SIGKILL if it has not exited after `grace` (a cog server: its whole
    /// process group). External engines are left alone.
    ///
    /// # Cancel safety
    /// If the future is dropped, the process is killed when `self` is.
    pub async fn stop(mut self, grace: Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        let Some(child) = self.child.as_mut() else { return };
        let pid = child.id().and_then(|p| rustix::process::Pid::from_raw(p as i32));
        match self.stop_by {
            StopBy::Terminate => {
                if let Some(pid) = pid {
                    let _ = rustix::process::kill_process(pid, Signal::TERM);
                }
            }
            StopBy::CogShutdown => {
                let client = crate::direct_http().build().expect("a plain HTTP client");
                if cog::shutdown(&client, &self.base_url, grace).await.is_err() {
                    if let Some(pid) = pid {
                        let _ = rustix::process::kill_process(pid, Signal::INT);
                    }
                }
            }
        }
        if tokio::time::timeout_at(deadline, child.wait()).await.is_ok() {
            self.child = None;
            return;
        }
        self.kill().await;
    }

    /// Kills the engine at once (SIGKILL; a cog server: its whole process
    /// group) and reaps it: for an engine that died or stopped answering,
    /// which a request to stop would only wait on. External engines are
    /// left alone.
    ///
    /// # Cancel safety
    /// If the future is dropped, the process is killed when `self` is.
    pub async fn kill(mut self) {
        self.kill_group();
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    /// SIGKILL to a cog server's process group, taking its worker along.
    /// Only while the server has not been reaped: until then its pid, and
    /// so the group id, cannot have been reused.
    fn kill_group(&self) {
        if self.stop_by != StopBy::CogShutdown {
            return;
        }
        let pid = self.child.as_ref().and_then(Child::id);
        if let Some(pid) = pid.and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
            let _ = rustix::process::kill_process_group(pid, Signal::KILL);
        }
    }
}

impl Drop for RunningEngine {
    /// `kill_on_drop` kills the engine process; a cog server's worker goes
    /// with its process group.
    fn drop(&mut self) {
        self.kill_group();
    }
}

/// Starts an engine on loopback ([`DEFAULT_HOST`]) and waits until it is
/// ready. On any failure the process is killed before returning.
pub async fn launch(spec: &EngineSpec, ctx: &LaunchContext) -> Result<RunningEngine, LaunchError> {
    launch_on(spec, ctx, DEFAULT_HOST).await
}

/// Starts an engine bound to `host` — an IP address or a name, an IPv6
/// address with or without brackets — and waits until it is ready at
/// `http://HOST:PORT`. On any failure the process is killed before
/// returning.
pub async fn launch_on(
    spec: &EngineSpec,
    ctx: &LaunchContext,
    host: &str,
) -> Result<RunningEngine, LaunchError> {
    let host = bare_host(host);
    match spec {
        EngineSpec::External { url } => Ok(RunningEngine {
            base_url: url.trim_end_matches('/').to_owned(),
            child: None,
            stop_by: StopBy::Terminate,
            logs: LogTail::default(),
        }),
        EngineSpec::Cog { dir, python, setup_timeout_s, train } => {
            let mode = if *train { CogMode::Train } else { CogMode::Predict };
            let mut cmd = Command::new(python);
            // The server waits for an explicit shutdown (SIGINT) rather than
            // exiting when setup fails, so the failure and its logs can be read.
            cmd.args(["-m", "cog.server.http", "--host", host, "--await-explicit-shutdown", "true"])
                .args(["--x-mode", mode.arg()])
                .current_dir(dir);
            launch_cog(cmd, python, *setup_timeout_s, &ctx.gpus, host).await
        }
        EngineSpec::Procedures { python, setup_timeout_s } => {
            let mut cmd = Command::new(python);
            cmd.args(["-c", crate::procedures::RUNTIME, "--host", host]);
            // Procedures run on the CPU: the runtime is shown no GPU
            // whatever share placement gave its replica.
            launch_cog(cmd, python, *setup_timeout_s, &[], host).await
        }
        EngineSpec::Mock { preset, startup_delay_ms, wake_delay_ms, engine_config } => {
            let mut cmd = Command::new(&ctx.hangar_exe);
            cmd.args(["engine", "mock", "--host", host, "--port", "0"])
                .args(["--preset", preset, "--model", &ctx.model])
                .args(["--startup-delay-ms", &startup_delay_ms.to_string()])
                .args(["--wake-delay-ms", &wake_delay_ms.to_string()]);
            if let Some(path) = engine_config {
                cmd.arg("--engine-config").arg(path);
            }
            if let Some(path) = ctx.weights_path() {
                cmd.args(["--weights", &path]);
            }
            ctx.pass_weights(&mut cmd);
            // Its stderr too goes through the tail (a failed start shows it).
            cmd.stderr(Stdio::piped());
            launch_announcing(cmd, &ctx.hangar_exe, ctx.mock_setup_timeout).await
        }
        EngineSpec::Openai { command, readiness_path, setup_timeout_s } => {
            let port = free_port(host)?;
            let gpus = ctx.gpus.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
            let line = command
                .replace("{model}", &ctx.model)
                .replace("{host}", host)
                .replace("{port}", &port.to_string())
                .replace("{gpus}", &gpus)
                .replace("{gpu_fraction}", &format!("{:.3}", ctx.gpu_fraction));
            let line = match ctx.weights_path() {
                Some(path) => line.replace("{weights}", &path),
                None if line.contains("{weights}") => return Err(LaunchError::NoWeights),
                None => line,
            };
            let mut words = line.split_whitespace();
            let program = words.next().ok_or(LaunchError::EmptyCommand)?.to_owned();
            let mut cmd = Command::new(&program);
            cmd.args(words).env("CUDA_VISIBLE_DEVICES", &gpus).stdin(Stdio::null()).kill_on_drop(true);
            LogTail::pipe(&mut cmd);
            die_with_parent(&mut cmd);
            ctx.pass_weights(&mut cmd);
            let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn { program, source })?;
            let logs = LogTail::follow(&mut child);
            let timeout = Duration::from_secs(*setup_timeout_s);
            ready(child, logs, base_url(host, port), readiness_path, timeout).await
        }
    }
}

/// Starts a cog model server (or the procedures runtime, which speaks its
/// protocol): `cmd` is the server's command line, run by `python`; it is
/// shown `gpus` and bound to `host` (as in [`launch_on`]). Waits until its
/// setup is done.
async fn launch_cog(
    mut cmd: Command,
    python: &Path,
    setup_timeout_s: u64,
    gpus: &[u32],
    host: &str,
) -> Result<RunningEngine, LaunchError> {
    let port = free_port(host)?;
    let gpus = gpus.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    // Cog posts its webhooks with `requests`, which honors the
    // environment's proxy: not for the gateway beside it on loopback.
    for name in ["NO_PROXY", "no_proxy"] {
        let set = std::env::var(name).unwrap_or_default();
        let joined: Vec<&str> =
            [set.as_str(), "127.0.0.1,localhost,::1"].into_iter().filter(|s| !s.is_empty()).collect();
        cmd.env(name, joined.join(","));
    }
    cmd.env("PORT", port.to_string())
        .env("CUDA_VISIBLE_DEVICES", &gpus)
        .stdin(Stdio::null())
        // Its own process group: the SIGKILL of last resort takes its
        // worker too, and a Ctrl-C at the terminal does not reach it.
        .process_group(0)
        .kill_on_drop(true);
    // Cog starts its worker with the `python` it finds on PATH: make that
    // the interpreter that has cog (a virtual environment's).
    if let Some(bin) = python.parent().filter(|d| !d.as_os_str().is_empty()) {
        let path = std::env::var_os("PATH").unwrap_or_default();
        let joined =
            std::env::join_paths(std::iter::once(bin.to_path_buf()).chain(std::env::split_paths(&path)));
        if let Ok(joined) = joined {
            cmd.env("PATH", joined);
        }
    }
    LogTail::pipe(&mut cmd);
    die_with_parent(&mut cmd);
    let mut child =
        cmd.spawn().map_err(|source| LaunchError::Spawn { program: python.display().to_string(), source })?;
    let logs = LogTail::follow(&mut child);
    let mut engine = RunningEngine {
        base_url: base_url(host, port),
        child: Some(child),
        stop_by: StopBy::CogShutdown,
        logs,
    };
    let client = crate::direct_http().build().expect("a plain HTTP client");
    let timeout = Duration::from_secs(setup_timeout_s);
    let deadline = tokio::time::Instant::now() + timeout;
    let failure = loop {
        let child = engine.child.as_mut().expect("the cog server is ours until it is stopped");
        if let Some(status) = child.try_wait()? {
            engine.child = None;
            engine.logs.drained(OUTPUT_DRAIN).await;
            return Err(LaunchError::Exited { status, output: engine.logs.text() });
        }
        match cog::health(&client, &engine.base_url, Duration::from_secs(2)).await.map(|h| (h.status, h)) {
            Ok((HealthStatus::Ready | HealthStatus::Busy, _)) => return Ok(engine),
            Ok((HealthStatus::SetupFailed, h)) => {
                break LaunchError::SetupFailed { logs: h.setup_logs().to_owned() }
            }
            Ok((HealthStatus::Defunct, _)) => break LaunchError::Defunct,
            _ if tokio::time::Instant::now() >= deadline => {
                break LaunchError::SetupTimeout { timeout, output: engine.logs.text() }
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    // Still up (awaiting an explicit shutdown, or stuck in setup): shut it
    // down as any cog server, not by killing it under its worker.
    engine.stop(FAILED_COG_GRACE).await;
    Err(failure)
}

/// How long an engine that exited has for what it printed last to be
/// read: its pipes close with it, unless it left a process holding them.
const OUTPUT_DRAIN: Duration = Duration::from_secs(1);

/// How long a cog server whose setup failed has to shut down.
const FAILED_COG_GRACE: Duration = Duration::from_secs(5);

/// Makes the engine die with the process that started it, even if that
/// process is killed outright and never runs its cleanup: no orphaned
/// engines hold GPUs or ports.
fn die_with_parent(cmd: &mut Command) {
    // SAFETY: the closure runs in the forked child before exec and only
    // makes one async-signal-safe system call (prctl).
    unsafe {
        cmd.pre_exec(|| {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
                .map_err(std::io::Error::from)
        });
    }
}

/// Starts a `hangar` subcommand that prints `listening on URL` as its
/// first line (`hangar engine mock`, `hangar serve`) and waits until its
/// `/health` answers 200; killed on any failure. What it prints on stdout
/// after that line is followed by the engine's [`LogTail`], and so is its
/// stderr if the caller piped it (the node does; a caller may send it to a
/// file of its own instead, which is left as it is).
pub async fn launch_announcing(
    cmd: Command,
    hangar_exe: &std::path::Path,
    timeout: Duration,
) -> Result<RunningEngine, LaunchError> {
    let (child, logs, base_url) = spawn_announcing(cmd, &hangar_exe.display().to_string()).await?;
    ready(child, logs, base_url, "/health", timeout).await
}

/// Spawns a process whose first stdout line is `listening on URL`; what
/// it prints next (and its stderr, if piped) is followed by a [`LogTail`].
async fn spawn_announcing(mut cmd: Command, program: &str) -> Result<(Child, LogTail, String), LaunchError> {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).kill_on_drop(true);
    die_with_parent(&mut cmd);
    let mut child =
        cmd.spawn().map_err(|source| LaunchError::Spawn { program: program.to_owned(), source })?;
    let logs = LogTail::default();
    if let Some(stderr) = child.stderr.take() {
        logs.follow_reader(stderr);
    }
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut lines = BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await;
    let url = match first {
        Ok(Ok(Some(line))) => line.strip_prefix("listening on ").map(str::to_owned),
        _ => None,
    };
    match url {
        Some(url) => {
            logs.follow_reader(lines.into_inner());
            Ok((child, logs, url))
        }
        None => {
            let _ = child.kill().await;
            Err(LaunchError::NoAddress)
        }
    }
}

/// Polls `base_url + path` until it answers 200; fails if the process
/// exits or `timeout` passes, killing it.
async fn ready(
    mut child: Child,
    logs: LogTail,
    base_url: String,
    path: &str,
    timeout: Duration,
) -> Result<RunningEngine, LaunchError> {
    let client = crate::direct_http().timeout(Duration::from_secs(2)).build().expect("a plain HTTP client");
    let url = format!("{base_url}{path}");
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            logs.drained(OUTPUT_DRAIN).await;
            return Err(LaunchError::Exited { status, output: logs.text() });
        }
        if client.get(&url).send().await.is_ok_and(|r| r.status().is_success()) {
            return Ok(RunningEngine { base_url, child: Some(child), stop_by: StopBy::Terminate, logs });
        }
        if tokio::time::Instant::now() >= deadline {
            let _ = child.kill().await;
            return Err(LaunchError::SetupTimeout { timeout, output: logs.text() });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A port nobody listens on right now at `host` — probed there, not on
/// loopback, because a port free on one address may be taken on another.
fn free_port(host: &str) -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind((host, 0))?.local_addr()?.port())
}

/// `host` without the brackets an IPv6 address has in a URL: the form
/// servers' listen flags and `bind` take.
pub fn bare_host(host: &str) -> &str {
    host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host)
}

/// `http://HOST:PORT`, an IPv6 host in brackets (without them its colons
/// would read as the port's).
pub fn base_url(host: &str, port: u16) -> String {
    let host = bare_host(host);
    if host.contains(':') {
        format!("http://[{host}]:{port}")
    } else {
        format!("http://{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_bracket_ipv6_hosts() {
        assert_eq!(base_url("127.0.0.2", 8000), "http://127.0.0.2:8000");
        assert_eq!(base_url("node-3.local", 8000), "http://node-3.local:8000");
        assert_eq!(base_url("fd00::2", 8000), "http://[fd00::2]:8000");
        assert_eq!(base_url("[::1]", 8000), "http://[::1]:8000");
        assert_eq!(bare_host("[::1]"), "::1");
        assert_eq!(bare_host("10.0.0.7"), "10.0.0.7");
    }
}
