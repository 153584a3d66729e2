//! Helpers shared by the integration tests that start `hangar serve`.

use std::io::{BufRead, BufReader};
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

#[allow(dead_code)]
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

/// Starts `hangar serve` with `config` on a free loopback port and waits
/// for its `listening on` line.
pub fn serve(config: &str) -> Serve {
    serve_in(tempfile::tempdir().unwrap(), config)
}

/// [`serve`] with its configuration (and so its default data directory)
/// in `dir`: a second server in the same directory finds the first one's
/// state.
pub fn serve_in(dir: tempfile::TempDir, config: &str) -> Serve {
    let path = dir.path().join("serve.toml");
    std::fs::write(&path, config).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config", path.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    Serve { child, url, _dir: dir }
}
