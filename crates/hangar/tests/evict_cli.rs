//! `hangar evict` as a process: settings errors, signals, /metrics.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use hangar_evict::synth::TreeSpec;

/// The child is killed even when an assertion fails.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn hangar() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hangar"));
    for v in hangar_evict::VARIABLES {
        c.env_remove(v.name);
    }
    c.env_remove("RUST_LOG");
    c
}

fn evictor(mount: &Path, extra: &[(&str, &str)]) -> Proc {
    let mut c = hangar();
    c.arg("evict")
        .env("PVC_MOUNT_PATH", mount)
        .env("CACHE_DIRECTORY", "cache")
        .env("STATUS_INTERVAL_SECONDS", "0.2")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in extra {
        c.env(k, v);
    }
    Proc(c.spawn().expect("spawn hangar evict"))
}

fn wait_exit(p: &mut Proc, bound: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + bound;
    while Instant::now() < deadline {
        if let Some(s) = p.0.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

#[test]
fn invalid_settings_are_rejected_naming_the_variable() {
    let out = hangar().args(["evict"]).env("CLEANUP_THRESHOLD", "eighty").output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("CLEANUP_THRESHOLD") && err.contains("eighty"), "{err}");

    let out = hangar().args(["evict", "--target-threshold", "90"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("TARGET_THRESHOLD"), "{err}");
}

#[test]
fn bench_refuses_a_tree_too_small_to_measure_by_its_flag() {
    let out = hangar().args(["evict", "bench", "--files", "100000,10"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--files 10: trees of fewer than 1000 files"), "{err}");
}

#[test]
fn help_lists_every_variable_as_a_flag() {
    let out = hangar().args(["evict", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for v in hangar_evict::VARIABLES {
        assert!(help.contains(&format!("--{}", v.flag())), "--{} missing", v.flag());
        assert!(help.contains(v.name), "{} missing", v.name);
    }
}

#[test]
fn regression_sigterm_during_eviction_exits_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("cache");
    TreeSpec { files: 2000, ..TreeSpec::default() }.write(&root, SystemTime::now(), 2).unwrap();
    // ON from the start and never at target: it keeps sweeping and deleting.
    let log_file = tmp.path().join("evictor.log");
    let mut p = evictor(
        tmp.path(),
        &[
            ("CLEANUP_THRESHOLD", "0.001"),
            ("TARGET_THRESHOLD", "0"),
            ("DELETION_MAX_FILES_PER_SECOND", "500"),
            ("LOG_FILE_PATH", log_file.to_str().unwrap()),
        ],
    );
    let mut stderr = BufReader::new(p.0.stderr.take().unwrap());
    let mut line = String::new();
    while stderr.read_line(&mut line).unwrap() > 0 && !line.contains("deletion=ON") {
        line.clear();
    }
    assert!(line.contains("deletion=ON"), "never reported deleting");
    let pid = rustix::process::Pid::from_child(&p.0);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = wait_exit(&mut p, Duration::from_secs(10)).expect("still running 10 s after SIGTERM");
    assert!(status.success(), "{status}");
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("evictor stopped"), "{rest}");
    let logged = std::fs::read_to_string(&log_file).unwrap();
    assert!(logged.contains("evictor started") && logged.contains("evictor stopped"), "{logged}");
}

#[test]
fn metrics_are_served_in_prometheus_text() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(tmp.path().join("cache")).unwrap();
    let mut p = evictor(tmp.path(), &[("METRICS_PORT", "0"), ("METRICS_ADDRESS", "127.0.0.1")]);
    let mut stderr = BufReader::new(p.0.stderr.take().unwrap());
    let mut line = String::new();
    let addr = loop {
        line.clear();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "no metrics address logged");
        if let Some(rest) = line.split("bound=").nth(1) {
            break rest.split_whitespace().next().unwrap().to_owned();
        }
    };
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    write!(conn, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut body = String::new();
    conn.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(body.contains("hangar_evict_usage_percent"), "{body}");
    assert!(body.contains("hangar_evict_deleted_files_total 0"), "{body}");
    let pid = rustix::process::Pid::from_child(&p.0);
    rustix::process::kill_process(pid, rustix::process::Signal::INT).unwrap();
    assert!(wait_exit(&mut p, Duration::from_secs(10)).is_some_and(|s| s.success()));
}
