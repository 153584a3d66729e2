//! `hangar evict` as a process: settings errors, signals, /metrics.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
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
    assert!(body.contains("content-type: text/plain; version=0.0.4"), "{body}");
    assert!(body.contains("hangar_evict_usage_percent"), "{body}");
    assert!(
        body.contains("# TYPE hangar_evict_deleted_files_total counter\nhangar_evict_deleted_files_total 0"),
        "{body}"
    );
    if let Some(promtool) = common::promtool() {
        let exposition = body.split_once("\r\n\r\n").unwrap().1;
        common::assert_promtool_passes(&promtool, "hangar evict", exposition);
    }
    let pid = rustix::process::Pid::from_child(&p.0);
    rustix::process::kill_process(pid, rustix::process::Signal::INT).unwrap();
    assert!(wait_exit(&mut p, Duration::from_secs(10)).is_some_and(|s| s.success()));
}

/// Starts `hangar evict` over `mount` with `args`, ON from the start and
/// never at target, so it would delete every cold block it can reach, and
/// returns its exit status and stderr once it has exited (it must refuse).
fn refused(mount: &Path, args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut c = hangar();
    c.arg("evict")
        .args(args)
        .env("PVC_MOUNT_PATH", mount)
        .env("CACHE_DIRECTORY", "cache")
        .env("CLEANUP_THRESHOLD", "0.001")
        .env("TARGET_THRESHOLD", "0")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut p = Proc(c.spawn().expect("spawn hangar evict"));
    let status = wait_exit(&mut p, Duration::from_secs(30)).expect("still running: the root was not refused");
    let mut err = String::new();
    p.0.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (status, err)
}

/// Writes 20 cold blocks under `root` and returns their paths.
fn cold_tree(root: &Path) -> Vec<PathBuf> {
    let files = TreeSpec { files: 20, ..TreeSpec::default() }.write(root, SystemTime::now(), 2).unwrap();
    files.into_iter().map(|f| root.join(f.path)).collect()
}

#[test]
fn regression_symlinks_in_the_cache_path_are_refused_at_start_and_nothing_behind_them_is_deleted() {
    let tmp = tempfile::tempdir().unwrap();
    let mount = tmp.path().join("mnt");
    let elsewhere = tmp.path().join("other-volume");
    std::fs::create_dir_all(&mount).unwrap();
    let blocks = cold_tree(&elsewhere.join("cache"));
    let link = |name: &str, to: &Path| {
        let at = tmp.path().join(name);
        let _ = std::fs::remove_file(&at);
        symlink(to, &at).unwrap();
        at
    };
    // (flags, root as configured, the symlinked component)
    let cases: Vec<(Vec<String>, PathBuf, PathBuf)> = vec![
        // CACHE_DIRECTORY=cache, <mnt>/cache -> elsewhere/cache
        {
            let l = link("mnt/cache", &elsewhere.join("cache"));
            (vec![], l.clone(), l)
        },
        // --cache-directory kv/cache, <mnt>/kv -> elsewhere
        {
            let l = link("mnt/kv", &elsewhere);
            (vec!["--cache-directory".into(), "kv/cache".into()], l.join("cache"), l)
        },
        // --pvc-mount-path <tmp>/mnt-link, <tmp>/mnt-link -> elsewhere
        {
            let l = link("mnt-link", &elsewhere);
            (vec!["--pvc-mount-path".into(), l.to_str().unwrap().to_owned()], l.join("cache"), l)
        },
    ];
    for (args, root, component) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (status, err) = refused(&mount, &args);
        assert_eq!(status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(&format!("refusing cache root {}", root.display())), "{args:?}: {err}");
        assert!(err.contains(&format!("{} is a symbolic link", component.display())), "{args:?}: {err}");
        let kept = blocks.iter().filter(|b| b.exists()).count();
        assert_eq!(kept, 20, "{args:?}: files behind the symlink were deleted");
    }
}

/// A writable temporary directory reachable from `/` without symlinks on
/// another filesystem than `/`, if this machine has one.
fn tempdir_off_the_root_filesystem() -> Option<tempfile::TempDir> {
    use std::os::unix::fs::MetadataExt;
    let root_dev = std::fs::metadata("/").ok()?.dev();
    let candidates = [
        PathBuf::from("/dev/shm"),
        PathBuf::from("/run"),
        std::env::temp_dir(),
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")),
    ];
    candidates.into_iter().find_map(|dir| {
        let real = std::fs::canonicalize(&dir).ok().filter(|r| *r == dir)?;
        (std::fs::metadata(&real).ok()?.dev() != root_dev).then(|| tempfile::tempdir_in(&real).ok())?
    })
}

#[test]
fn regression_a_cache_directory_on_another_filesystem_than_the_mount_is_refused_at_start() {
    let Some(other) = tempdir_off_the_root_filesystem() else {
        eprintln!("skipped: no writable directory on another filesystem than / on this machine");
        return;
    };
    let root = other.path().join("cache");
    let blocks = cold_tree(&root);
    let relative = root.strip_prefix("/").unwrap().to_str().unwrap().to_owned();
    let (status, err) = refused(Path::new("/"), &["--cache-directory", &relative]);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("refusing cache root {}", root.display())), "{err}");
    assert!(err.contains("another filesystem") && err.contains("PVC_MOUNT_PATH /"), "{err}");
    assert_eq!(
        blocks.iter().filter(|b| b.exists()).count(),
        20,
        "files on the other filesystem were deleted"
    );
}
