//! Helpers shared by the integration tests that start `hangar serve`.
//! (Each test binary uses some of them.)
#![allow(dead_code)]

pub mod fleet;
pub mod predictions;

use std::io::{BufRead, BufReader, ErrorKind};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `hangar serve`. Dropping it stops the server (SIGTERM, so it
/// stops its engines) even when a test fails; engines also die with it if
/// it has to be killed.
pub struct Serve {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Serve {
    /// Kills the server outright (SIGKILL), as a crash would, and returns
    /// its directory for a restart.
    pub fn kill9(mut self) -> tempfile::TempDir {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let dir = tempfile::tempdir().unwrap();
        std::mem::replace(&mut self._dir, dir)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self._dir.path().join("serve.log")).unwrap_or_default();
            eprintln!("--- hangar serve's log ---\n{log}");
        }
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Serve {
    /// What the server has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("serve.log")).unwrap_or_default()
    }
}

/// A child process killed (SIGKILL) and reaped when dropped, even when a
/// test fails: for processes with nothing to stop gracefully.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns `command` with its stdout piped (stderr as the command says) and
/// returns it, owned at once, with its first line trimmed; fails naming
/// the command if it exits before printing one.
pub fn first_line(command: &mut Command) -> (Killed, String) {
    let mut child = command.stdout(Stdio::piped()).spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let killed = Killed(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    assert!(!line.is_empty(), "{command:?} exited before its first line");
    (killed, line.trim().to_owned())
}

/// `hangar store ARGS` on the store at `root` (its socket the root's
/// default, whatever the environment says).
pub fn store(root: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hangar"));
    c.arg("store").args(args).env("HANGAR_STORE_ROOT", root).env_remove("HANGAR_STORE_SOCKET");
    c
}

/// Starts `hangar store ARGS` that serves (the daemon, the registry) on the
/// store at `root`, killed when dropped; returns it and its first line of
/// output (printed once it serves).
pub fn start_store(root: &Path, args: &[&str]) -> (Killed, String) {
    first_line(store(root, args).stderr(Stdio::null()))
}

/// Registers a small synthetic LoRA adapter `adapter` (`BASE:NAME`) in the
/// weight store at `root`: its artifact.
pub fn register_adapter(root: &Path, adapter: &str, seed: u64) -> hangar_store::ArtifactId {
    let store = hangar_store::BlobStore::open(root).unwrap();
    let shape = hangar_store::synth::AdapterShape::TINY;
    hangar_store::synth::register_adapter(&store, &adapter.parse().unwrap(), shape, seed).unwrap().id
}

/// Starts `hangar serve` with `config` on a free loopback port and waits
/// for its `listening on` line.
pub fn serve(config: &str) -> Serve {
    serve_in(tempfile::tempdir().unwrap(), config)
}

/// [`serve`] with its configuration (and so its default data directory)
/// in `dir`: a second server in the same directory finds the first one's
/// state.
pub fn serve_in(dir: tempfile::TempDir, config: &str) -> Serve {
    serve_in_with(dir, config, &[])
}

/// [`serve_in`] with more arguments for `hangar serve`.
pub fn serve_in_with(dir: tempfile::TempDir, config: &str, args: &[&str]) -> Serve {
    serve_in_env(dir, config, args, &[])
}

/// A proxy that answers nothing, named by every variable HTTP clients
/// read: what a machine behind a corporate proxy has in its environment.
pub const DEAD_PROXY: [(&str, &str); 4] = [
    ("HTTP_PROXY", "http://127.0.0.1:9"),
    ("http_proxy", "http://127.0.0.1:9"),
    ("HTTPS_PROXY", "http://127.0.0.1:9"),
    ("ALL_PROXY", "http://127.0.0.1:9"),
];

/// [`serve_in_with`] with `envs` set in the server's environment.
pub fn serve_in_env(dir: tempfile::TempDir, config: &str, args: &[&str], envs: &[(&str, &str)]) -> Serve {
    let path = dir.path().join("serve.toml");
    std::fs::write(&path, config).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config", path.to_str().unwrap()])
        .args(args)
        .envs(envs.iter().copied())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("serve.log")).unwrap())
        .spawn()
        .unwrap();
    // Owned by a `Serve` at once, so a failure below still stops it.
    let mut serve = Serve { child, url: String::new(), _dir: dir };
    let mut line = String::new();
    BufReader::new(serve.child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    serve.url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    serve
}

/// A configuration of one node with one virtual 80 GB GPU, then `rest`.
pub fn one_gpu(rest: &str) -> String {
    format!("[[nodes]]\nid = \"local\"\ngpus = 1\ngpu_memory = \"80GB\"\nvirtual_gpus = true\n{rest}")
}

/// The first model's replicas in `/admin/status` once there are exactly
/// `n`, all ready; fails the test after two minutes, showing the status.
pub fn ready_replicas(url: &str, n: usize) -> Vec<serde_json::Value> {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let status: serde_json::Value =
            reqwest::blocking::get(format!("{url}/admin/status")).unwrap().json().unwrap();
        let replicas = status["models"][0]["replicas"].as_array().cloned().unwrap_or_default();
        if replicas.len() == n && replicas.iter().all(|r| r["state"] == "ready") {
            return replicas;
        }
        assert!(std::time::Instant::now() < deadline, "not {n} ready replicas in time: {status}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A short chat request.
pub fn chat(model: &str, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({
        "model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": max_tokens
    })
}

/// Posts a chat request, with a bearer `key` if given; the status and the
/// JSON answer (null if it is not JSON).
pub fn post(url: &str, key: Option<&str>, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let mut r = reqwest::blocking::Client::new().post(format!("{url}/v1/chat/completions")).json(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(serde_json::Value::Null))
}

/// Two mock models for the predictions tests: `t/fast`, and `t/slow` with
/// one permit and one async slot (so a second prediction waits in the
/// durable queue); fast webhook retries; a deployment `acme/fast-prod`.
pub const PREDICTIONS_CONFIG: &str = r#"
[[nodes]]
id = "local"
gpus = 2
gpu_memory = "80GB"
virtual_gpus = true

[[models]]
key = "t/fast"
engine = { kind = "mock", preset = "fast" }
size = "10GB"
min_replicas = 1

[[models]]
key = "t/slow"
engine = { kind = "mock", preset = "default" }
size = "10GB"
min_replicas = 1
concurrency = 1

[predictions]
async_slots = 1
webhook_retry_base_ms = 100
webhook_retry_cap_ms = 400
# The tests' webhook receivers listen on loopback, which webhooks may not
# reach unless opened.
webhook_allow = ["127.0.0.1/32"]

[[predictions.deployments]]
name = "acme/fast-prod"
model = "t/fast"
"#;

/// The `[[models]]` entry of `examples/cog-echo` on the `cog` engine, run
/// by `python` (one with the pinned `cog`).
pub fn cog_echo_model(python: &Path) -> String {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/cog-echo");
    format!(
        "\n[[models]]\nkey = \"examples/cog-echo\"\n\
         engine = {{ kind = \"cog\", dir = \"{dir}\", python = \"{}\", setup_timeout_s = 120 }}\n\
         size = \"1GB\"\nmin_replicas = 1\n",
        python.display()
    )
}

const REQUIREMENTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python-requirements.txt");

/// A Python interpreter with the pinned clients of `python-requirements.txt`
/// (`openai`, `replicate`): `$HANGAR_PYTHON` (CI installs them into a venv
/// and sets it), or a venv made once under the target directory.
pub fn python() -> PathBuf {
    match std::env::var_os("HANGAR_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => bootstrap(&Path::new(env!("CARGO_TARGET_TMPDIR")).join("python-venv")),
    }
}

/// Creates (once) a venv at `venv` with the pinned requirements.
fn bootstrap(venv: &Path) -> PathBuf {
    let python = venv.join("bin").join("python");
    if !python.exists() {
        match Command::new("python3").arg("-m").arg("venv").arg(venv).output() {
            Err(e) if e.kind() == ErrorKind::NotFound => panic!(
                "python3 is not installed: this test runs the official Python clients. \
                 Install python3 and python3-venv (apt-get install python3 python3-venv), or set \
                 HANGAR_PYTHON to a Python that has the packages of python-requirements.txt"
            ),
            Err(e) => panic!("cannot run python3: {e}"),
            Ok(o) if !o.status.success() => panic!(
                "`python3 -m venv {}` failed (on Debian, install python3-venv):\n{}",
                venv.display(),
                String::from_utf8_lossy(&o.stderr)
            ),
            Ok(_) => {}
        }
    }
    // The marker records what was installed, so a changed pin reinstalls.
    let marker = venv.join("hangar-requirements.txt");
    let wanted = std::fs::read_to_string(REQUIREMENTS).unwrap();
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(wanted.as_str()) {
        let o = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r", REQUIREMENTS])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "installing {REQUIREMENTS} into {} failed:\n{}{}",
            venv.display(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        std::fs::write(&marker, wanted).unwrap();
    }
    python
}

/// Debian's `promtool` (package `prometheus`), if installed (see
/// [`installed`]).
pub fn promtool() -> Option<PathBuf> {
    installed("promtool", "prometheus")
}

/// `program` on the `PATH`, from Debian's `package`. Without it the test
/// is skipped, saying what to install — except under CI, where `.ci/run`
/// installs it, so its absence fails the test.
pub fn installed(program: &str, package: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join(program))
        .find(|p| p.is_file());
    if found.is_none() {
        let why = format!(
            "{program} is not installed (Debian: apt-get install -y --no-install-recommends {package})"
        );
        assert!(std::env::var_os("CI").is_none(), "{why}");
        eprintln!("skipped: {why}");
    }
    found
}

/// Fails unless `promtool check metrics` finds no problem in `exposition`,
/// `what`'s `/metrics` (which must not be empty: that would test nothing).
pub fn assert_promtool_passes(promtool: &Path, what: &str, exposition: &str) {
    use std::io::Write;
    assert!(exposition.contains("# TYPE "), "{what}: an empty exposition tests nothing:\n{exposition}");
    let mut check = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    check.stdin.take().unwrap().write_all(exposition.as_bytes()).unwrap();
    let out = check.wait_with_output().unwrap();
    let problems =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && problems.trim().is_empty(),
        "promtool check metrics on {what}'s /metrics ({}):\n{problems}\n--- exposition ---\n{exposition}",
        out.status
    );
}

/// Reads one HTTP/1.1 request from `reader`, as a test's hand-written
/// engine gets it: its request line and its body (by `content-length`);
/// `None` when the connection ends first.
pub fn read_request(reader: &mut impl BufRead) -> Option<(String, Vec<u8>)> {
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return None;
    }
    let (mut length, mut header) = (0, String::new());
    while reader.read_line(&mut header).unwrap_or(0) > 2 {
        if let Some(v) = header.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap();
        }
        header.clear();
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some((line, body))
}
