//! End-to-end behaviour over generated trees in temporary directories, with
//! a usage source the test controls. Tests named `regression_*` each pin a
//! defect of llm-d's Python evictor.

mod common;

use std::collections::HashSet;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use common::{eventually, read_at, spec, Dial, Fixture, TreeUsage};
use hangar_evict::layout::Layout;
use hangar_evict::synth::{set_times, TreeSpec};
use hangar_evict::{EvictError, Evictor, Statvfs, Stop, Tick, UsageSource};

fn evicted(t: Tick) -> hangar_evict::EvictReport {
    match t {
        Tick::Evicted(r) => r,
        other => panic!("expected an eviction, got {other:?}"),
    }
}

/// Ticks until nothing more is eligible (bounded).
fn drain(ev: &mut Evictor) {
    for _ in 0..10 {
        if let Tick::NothingEligible | Tick::Idle { .. } = ev.tick().unwrap() {
            return;
        }
    }
    panic!("evictor kept finding work");
}

#[test]
fn hysteresis_turns_on_at_cleanup_and_stops_at_target() {
    let fx = Fixture::new();
    let files = fx.tree(spec(200));
    let usage = TreeUsage::filled_to(&fx.root, 84.0);
    let mut ev = Evictor::new(fx.config(&[]), usage.source());

    // Below 85 %: the first tick pre-fills the queue and deletes nothing.
    assert!(matches!(ev.tick().unwrap(), Tick::Prefilled(q) if q.files > 0));
    assert!(matches!(ev.tick().unwrap(), Tick::Idle { .. }), "84% is below 85%");
    assert_eq!(fx.remaining(&files).len(), 200);

    *usage.other_bytes.lock().unwrap() = usage.capacity * 2 / 100; // 86 %
    let need = usage.usage().unwrap().bytes_above(70.0).div_ceil(4096);
    let r = evicted(ev.tick().unwrap());
    assert_eq!(r.stopped, Stop::TargetReached);
    assert!(usage.percent() <= 70.0, "{}", usage.percent());
    // Re-checked between batches of 10: stops within one batch of the need.
    assert!(r.deleted >= need && r.deleted < need + 10, "deleted {} need {need}", r.deleted);
    assert_eq!(fx.remaining(&files).len() as u64, 200 - r.deleted);

    // Between the thresholds it stays OFF.
    *usage.other_bytes.lock().unwrap() += usage.capacity * 10 / 100;
    assert!(usage.percent() > 70.0 && usage.percent() < 85.0);
    for _ in 0..3 {
        // OFF: idle, or refilling the queue the deletion thinned.
        let t = ev.tick().unwrap();
        assert!(matches!(t, Tick::Idle { .. } | Tick::Prefilled(_)), "{t:?}");
    }
    assert_eq!(ev.stats().snapshot().deleted, r.deleted);
}

#[test]
fn deletes_least_recently_used_first() {
    let fx = Fixture::new();
    let files = fx.tree(spec(300));
    let usage = TreeUsage::filled_to(&fx.root, 90.0);
    let mut ev = Evictor::new(fx.config(&[]), usage.source());
    evicted(ev.tick().unwrap());

    let (kept, gone): (Vec<_>, Vec<_>) = files.iter().partition(|f| fx.exists(f));
    assert!(!gone.is_empty() && !kept.is_empty());
    let newest_gone = gone.iter().map(|f| f.last_use).max().unwrap();
    let oldest_kept = kept.iter().map(|f| f.last_use).min().unwrap();
    assert!(newest_gone < oldest_kept, "a newer file went before an older one");
}

#[test]
fn files_used_within_the_threshold_are_never_deleted() {
    let fx = Fixture::new();
    let files = fx.tree(TreeSpec { files: 200, hot_fraction: 0.5, ..TreeSpec::default() });
    let usage = TreeUsage::filled_to(&fx.root, 95.0);
    let config = fx.config(&[("CLEANUP_THRESHOLD", "50"), ("TARGET_THRESHOLD", "0")]);
    let mut ev = Evictor::new(config, usage.source());
    drain(&mut ev);
    assert_eq!(ev.tick().unwrap(), Tick::NothingEligible);
    for f in &files {
        assert_eq!(fx.exists(f), f.hot, "{}", f.path.display());
    }
}

#[test]
fn regression_file_read_after_it_was_queued_is_spared() {
    let fx = Fixture::new();
    fx.tree(spec(100));
    let usage = TreeUsage::filled_to(&fx.root, 90.0);
    let mut ev = Evictor::new(fx.config(&[]), usage.source());
    let (u, _) = ev.check().unwrap();
    let sweep = ev.sweep(u).unwrap();
    let selected = sweep.paths();
    assert!(selected.len() > 2);

    // One selected block is read right now; another was read two days ago,
    // after the sweep saw it — no longer among the least recently used.
    let now = SystemTime::now();
    let read_now = fx.root.join(&selected[0]);
    let read_since = fx.root.join(&selected[1]);
    read_at(&read_now, now);
    read_at(&read_since, now - Duration::from_secs(2 * 86_400));

    ev.evict(sweep).unwrap();
    assert!(read_now.exists(), "a block read after queueing was deleted");
    assert!(read_since.exists(), "a block used after queueing was deleted");
    assert_eq!(ev.stats().snapshot().spared_recently_used, 2);
}

#[test]
fn regression_dry_run_deletes_nothing_and_reports_each_file_once() {
    let fx = Fixture::new();
    let files = fx.tree(spec(100));
    let usage = TreeUsage::filled_to(&fx.root, 90.0);

    // With the default thresholds the simulated usage reaches the target and
    // the evictor goes idle instead of re-reporting.
    let mut ev = Evictor::new(fx.config(&[("DRY_RUN", "true")]), usage.source());
    let first = evicted(ev.tick().unwrap());
    assert!(first.deleted > 0 && first.deleted < 100);
    for _ in 0..5 {
        let t = ev.tick().unwrap();
        assert!(matches!(t, Tick::Idle { .. } | Tick::Prefilled(_)), "simulated usage is at target: {t:?}");
    }
    assert_eq!(ev.stats().snapshot().deleted, first.deleted);

    // Kept ON for good, it reports every file exactly once, then nothing.
    let reported = Arc::new(Mutex::new(Vec::new()));
    let sink = reported.clone();
    let config = fx.config(&[("DRY_RUN", "true"), ("CLEANUP_THRESHOLD", "1"), ("TARGET_THRESHOLD", "0")]);
    let mut ev =
        Evictor::new(config, usage.source()).with_removed_sink(move |r| sink.lock().unwrap().push(r.hash));
    for _ in 0..10 {
        ev.tick().unwrap();
    }
    assert_eq!(ev.tick().unwrap(), Tick::NothingEligible);
    assert_eq!(fx.remaining(&files).len(), 100, "dry run deleted a file");
    let reported = reported.lock().unwrap();
    let distinct: HashSet<_> = reported.iter().collect();
    assert_eq!(distinct.len(), reported.len(), "a file was reported twice");
    assert_eq!(reported.len(), 100);
    assert_eq!(ev.stats().snapshot().deleted, 100);
}

#[test]
fn symlinks_foreign_names_and_outside_files_are_never_touched() {
    let fx = Fixture::new();
    let files = fx.tree(spec(60));
    let old = SystemTime::now() - Duration::from_secs(5 * 86_400);
    let outside = fx.tmp.path().join("outside");
    let out_leaf = outside.join("abc/de_g0");
    std::fs::create_dir_all(&out_leaf).unwrap();
    let out_file = outside.join("00000000000000aa.bin");
    let out_nested = out_leaf.join("abcde00000000001.bin");
    for f in [&out_file, &out_nested] {
        std::fs::write(f, b"x").unwrap();
        set_times(f, old, old).unwrap();
    }

    let shard = fx.root.join(TreeSpec::default().shard_dir(0));
    let real_leaf = fx.root.join(files[0].path.parent().unwrap());
    let real_bucket = real_leaf.parent().unwrap().to_owned();
    symlink(outside.join("abc"), shard.join("fff")).unwrap(); // bucket level
    symlink(&out_leaf, real_bucket.join("ee_g0")).unwrap(); // leaf level
    symlink(&out_file, real_leaf.join("1111111111111111.bin")).unwrap(); // file level
    symlink(&outside, fx.root.join("evil_0123456789ab_r9")).unwrap(); // shard level
    let foreign: Vec<_> = ["notes.bin", "ABCDEF0123456789.bin", "0123456789abcdef.bin.bak", "config.json"]
        .iter()
        .map(|n| real_leaf.join(n))
        .chain([fx.root.join("0123456789abcdef.bin"), shard.join("0123456789abcdef.bin")])
        .collect();
    for f in &foreign {
        std::fs::write(f, b"x").unwrap();
        set_times(f, old, old).unwrap();
    }

    let usage = TreeUsage::filled_to(&fx.root, 99.0);
    let config = fx.config(&[("CLEANUP_THRESHOLD", "1"), ("TARGET_THRESHOLD", "0")]);
    let mut ev = Evictor::new(config, usage.source());
    drain(&mut ev);

    assert!(fx.remaining(&files).is_empty(), "generated blocks remain");
    assert!(out_file.exists() && out_nested.exists(), "a file outside the root was deleted");
    for f in &foreign {
        assert!(f.exists(), "{} was deleted", f.display());
    }
    for link in [shard.join("fff"), real_bucket.join("ee_g0"), fx.root.join("evil_0123456789ab_r9")] {
        assert!(link.symlink_metadata().is_ok(), "{} was removed", link.display());
    }
}

/// Writes 20 cold blocks under `real`, runs an evictor that wants to delete
/// everything with `config`, and returns the error it stopped with, after
/// checking that every block behind the symlink survived.
fn refused_with_every_file_kept(fx: &Fixture, real: &Path, extra: &[(&str, &str)]) -> EvictError {
    let files = spec(20).write(real, SystemTime::now(), 2).unwrap();
    let usage = TreeUsage::filled_to(real, 99.0);
    let mut env = vec![("CLEANUP_THRESHOLD", "1"), ("TARGET_THRESHOLD", "0")];
    env.extend_from_slice(extra);
    let mut ev = Evictor::new(fx.config(&env), usage.source());
    let err = ev.tick().expect_err("the evictor went through a symlink");
    let (u, _) = ev.check().unwrap();
    assert!(ev.sweep(u).is_err(), "a sweep went through a symlink");
    let kept = files.iter().filter(|f| real.join(&f.path).exists()).count();
    assert_eq!(kept, 20, "files behind the symlink were deleted: {err}");
    assert_eq!(ev.stats().snapshot().deleted, 0);
    err
}

fn assert_symlink_named(err: &EvictError, root: &Path, link: &Path) {
    match err {
        EvictError::Symlink { root: r, component } => {
            assert_eq!((r.as_path(), component.as_path()), (root, link), "{err}");
        }
        other => panic!("expected a symlink refusal, got {other}"),
    }
    let text = err.to_string();
    assert!(text.contains(&root.display().to_string()), "{text}");
    assert!(text.contains(&format!("{} is a symbolic link", link.display())), "{text}");
}

#[test]
fn regression_a_symlinked_cache_directory_is_refused_and_what_it_points_to_survives() {
    let fx = Fixture::new();
    let real = fx.tmp.path().join("other-volume/cache");
    std::fs::remove_dir(&fx.root).unwrap();
    std::fs::create_dir_all(&real).unwrap();
    symlink(&real, &fx.root).unwrap(); // <mnt>/cache -> elsewhere
    let err = refused_with_every_file_kept(&fx, &real, &[]);
    assert_symlink_named(&err, &fx.root, &fx.root);
}

#[test]
fn regression_a_symlinked_component_of_the_cache_directory_is_refused() {
    let fx = Fixture::new();
    let elsewhere = fx.tmp.path().join("other-volume");
    std::fs::create_dir_all(elsewhere.join("cache")).unwrap();
    let link = fx.mount().join("kv");
    symlink(&elsewhere, &link).unwrap(); // <mnt>/kv -> elsewhere, CACHE_DIRECTORY=kv/cache
    let err = refused_with_every_file_kept(&fx, &elsewhere.join("cache"), &[("CACHE_DIRECTORY", "kv/cache")]);
    assert_symlink_named(&err, &link.join("cache"), &link);
}

#[test]
fn regression_a_symlinked_mount_path_is_refused() {
    let fx = Fixture::new();
    let link = fx.tmp.path().join("mnt-link");
    symlink(fx.mount(), &link).unwrap(); // PVC_MOUNT_PATH=<tmp>/mnt-link -> <tmp>/mnt
    let err = refused_with_every_file_kept(&fx, &fx.root, &[("PVC_MOUNT_PATH", link.to_str().unwrap())]);
    assert_symlink_named(&err, &link.join("cache"), &link);
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
fn regression_a_cache_directory_on_another_filesystem_than_the_mount_is_refused() {
    // PVC_MOUNT_PATH=/ with the cache on another filesystem below it: no
    // symlink anywhere, but deleting there never lowers `/`'s usage.
    let Some(other) = tempdir_off_the_root_filesystem() else {
        eprintln!("skipped: no writable directory on another filesystem than / on this machine");
        return;
    };
    let fx = Fixture::new();
    let real = other.path().join("cache");
    let files = spec(20).write(&real, SystemTime::now(), 2).unwrap();
    let usage = TreeUsage::filled_to(&real, 99.0);
    let relative = real.strip_prefix("/").unwrap().to_str().unwrap();
    let config = fx.config(&[
        ("PVC_MOUNT_PATH", "/"),
        ("CACHE_DIRECTORY", relative),
        ("CLEANUP_THRESHOLD", "1"),
        ("TARGET_THRESHOLD", "0"),
    ]);
    let mut ev = Evictor::new(config, usage.source());
    let err = ev.tick().expect_err("the evictor deleted on another filesystem");
    match &err {
        EvictError::OtherFilesystem { root, mount, .. } => {
            assert_eq!((root.as_path(), mount.as_path()), (real.as_path(), Path::new("/")));
        }
        other => panic!("expected a filesystem refusal, got {other}"),
    }
    assert!(err.to_string().contains("another filesystem"), "{err}");
    let kept = files.iter().filter(|f| real.join(&f.path).exists()).count();
    assert_eq!(kept, 20, "files on the other filesystem were deleted");
}

/// Unmounts (lazily) when dropped, also when the test fails.
struct TmpfsMount(PathBuf);

impl TmpfsMount {
    /// Mounts a small tmpfs at `at`, or `None` when not permitted here.
    fn new(at: &Path) -> Option<TmpfsMount> {
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
            .arg(at)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| TmpfsMount(at.to_owned()))
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_shard_mounted_from_another_filesystem_is_skipped() {
    let fx = Fixture::new();
    let files = fx.tree(TreeSpec { files: 40, ranks: 2, ..TreeSpec::default() });
    // Rank 1's shard directory becomes the mount point of another volume
    // holding its own copy of the blocks.
    let shard1 = fx.root.join(TreeSpec::default().shard_dir(1));
    let Some(_mount) = TmpfsMount::new(&shard1) else {
        eprintln!("skipped: cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)");
        return;
    };
    let (rank0, rank1): (Vec<_>, Vec<_>) =
        files.iter().cloned().partition(|f| f.path.starts_with(TreeSpec::default().shard_dir(0)));
    for f in &rank1 {
        let p = fx.root.join(&f.path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, b"block").unwrap();
        set_times(&p, f.last_use, f.last_use).unwrap();
    }
    let usage = TreeUsage::filled_to(&fx.root, 99.0);
    let config = fx.config(&[("CLEANUP_THRESHOLD", "1"), ("TARGET_THRESHOLD", "0")]);
    let mut ev = Evictor::new(config, usage.source());
    drain(&mut ev);
    assert!(!rank0.is_empty() && fx.remaining(&rank0).is_empty(), "the shard on the volume was not evicted");
    assert_eq!(fx.remaining(&rank1).len(), rank1.len(), "a block on another filesystem was deleted");
}

#[test]
fn files_vanishing_before_their_turn_are_skipped() {
    let fx = Fixture::new();
    fx.tree(spec(100));
    let usage = TreeUsage::filled_to(&fx.root, 99.0);
    let config = fx.config(&[("CLEANUP_THRESHOLD", "1"), ("TARGET_THRESHOLD", "0")]);
    let mut ev = Evictor::new(config, usage.source());
    let (u, _) = ev.check().unwrap();
    let sweep = ev.sweep(u).unwrap();
    let selected = sweep.paths();
    for p in selected.iter().take(5) {
        std::fs::remove_file(fx.root.join(p)).unwrap();
    }
    // Deletion aims at what is above the target when it starts, counting
    // the vanished files' bytes as taken: it may stop short and go on from
    // the queue at the next tick.
    ev.evict(sweep).unwrap();
    drain(&mut ev);
    let s = ev.stats().snapshot();
    assert_eq!((s.vanished, s.errors), (5, 0));
    assert_eq!(s.deleted as usize, selected.len() - 5);
    assert!(selected.iter().all(|p| !fx.root.join(p).exists()));
}

#[test]
fn regression_both_layouts_including_a_bf16_dtype_directory() {
    let fx = Fixture::new();
    let current =
        fx.tree(TreeSpec { files: 80, ranks: 2, model: "org/current".into(), ..TreeSpec::default() });
    let legacy = fx.tree(TreeSpec {
        files: 80,
        ranks: 2,
        layout: Layout::Legacy,
        model: "org/legacy".into(),
        dtype: "bf16".into(),
        seed: 99,
        ..TreeSpec::default()
    });
    let usage = TreeUsage::filled_to(&fx.root, 99.0);
    let config = fx.config(&[("CLEANUP_THRESHOLD", "1"), ("TARGET_THRESHOLD", "0")]);
    let mut ev = Evictor::new(config, usage.source());
    let (u, _) = ev.check().unwrap();
    let sweep = ev.sweep(u).unwrap();

    let mut shards: Vec<_> = sweep
        .shards()
        .iter()
        .map(|s| (s.path.display().to_string(), s.model.to_string(), s.layout))
        .collect();
    shards.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(shards.len(), 4, "{shards:?}");
    assert!(shards
        .iter()
        .any(|s| s.0.ends_with("rank_0/bf16") && s.1 == "org/legacy" && s.2 == Layout::Legacy));
    assert!(shards.iter().any(|s| s.0.ends_with("_r1") && s.1 == "org/current"));
    assert_eq!(sweep.len(), 160);

    ev.evict(sweep).unwrap();
    assert!(fx.remaining(&current).is_empty() && fx.remaining(&legacy).is_empty());
}

#[test]
fn regression_a_full_queue_slows_discovery_instead_of_dropping_files() {
    let fx = Fixture::new();
    fx.tree(spec(300));
    let usage = TreeUsage::filled_to(&fx.root, 99.0);
    let config = fx.config(&[
        ("CLEANUP_THRESHOLD", "1"),
        ("TARGET_THRESHOLD", "0"),
        ("FILE_QUEUE_MAXSIZE", "1"),
        ("NUM_CRAWLER_PROCESSES", "4"),
    ]);
    let mut ev = Evictor::new(config, usage.source());
    let (u, _) = ev.check().unwrap();
    let sweep = ev.sweep(u).unwrap();
    assert_eq!(ev.stats().snapshot().discovered, 300);
    assert_eq!(sweep.len(), 300, "discovered files were dropped");
}

#[test]
fn regression_discovered_counts_the_current_sweep_only() {
    let fx = Fixture::new();
    fx.tree(spec(120));
    let dial = Dial::default();
    dial.set(90.0);
    let mut ev = Evictor::new(fx.config(&[]), dial.source());
    for _ in 0..3 {
        let (u, _) = ev.check().unwrap();
        ev.sweep(u).unwrap();
        assert_eq!(ev.stats().snapshot().discovered, 120);
    }
    assert_eq!(ev.stats().snapshot().sweeps, 3);
}

#[test]
fn regression_status_reports_on_while_deleting() {
    let fx = Fixture::new();
    fx.tree(spec(50));
    let usage = TreeUsage::filled_to(&fx.root, 90.0);
    let seen_on = Arc::new(AtomicBool::new(false));
    let mut ev = Evictor::new(fx.config(&[]), usage.source());
    let stats = ev.stats();
    let flag = seen_on.clone();
    let ev_sink = move |_r: hangar_evict::Removed| {
        if stats.snapshot().deleting {
            flag.store(true, Ordering::Relaxed);
        }
    };
    let (u, mode) = ev.check().unwrap();
    assert_eq!(mode, hangar_evict::Mode::On);
    let line = ev.stats().snapshot().status_line(&Default::default(), Duration::from_secs(1), false);
    assert!(line.contains("deletion=ON"), "{line}");
    ev = ev.with_removed_sink(ev_sink);
    let sweep = ev.sweep(u).unwrap();
    ev.evict(sweep).unwrap();
    assert!(seen_on.load(Ordering::Relaxed), "status said OFF while deleting");
    assert!(!ev.stats().snapshot().deleting, "OFF after reaching the target");
}

#[test]
fn regression_a_panicking_crawler_is_restarted_and_counted() {
    let fx = Fixture::new();
    let files = fx.tree(spec(100));
    let usage = TreeUsage::filled_to(&fx.root, 99.0);
    let config = fx.config(&[("CLEANUP_THRESHOLD", "1"), ("TARGET_THRESHOLD", "0")]);
    let armed = Arc::new(AtomicBool::new(true));
    let trap = armed.clone();
    let mut ev = Evictor::new(config, usage.source()).with_dir_hook(Arc::new(move |_| {
        if trap.swap(false, Ordering::SeqCst) {
            panic!("injected crawler fault");
        }
    }));
    let (u, _) = ev.check().unwrap();
    let sweep = ev.sweep(u).unwrap();
    assert_eq!(ev.stats().snapshot().crawler_restarts, 1);
    assert!(sweep.len() >= 99, "the restarted crawlers finished the sweep: {}", sweep.len());
    ev.evict(sweep).unwrap();
    drain(&mut ev);
    assert!(fx.remaining(&files).is_empty());
}

#[test]
fn regression_stop_request_ends_a_sweep_promptly() {
    let fx = Fixture::new();
    fx.tree(spec(300));
    let usage = TreeUsage::filled_to(&fx.root, 99.0);
    let config =
        fx.config(&[("CLEANUP_THRESHOLD", "1"), ("TARGET_THRESHOLD", "0"), ("NUM_CRAWLER_PROCESSES", "1")]);
    let visited = Arc::new(AtomicUsize::new(0));
    let count = visited.clone();
    let ev = Evictor::new(config, usage.source()).with_dir_hook(Arc::new(move |_| {
        count.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20)); // a slow volume
    }));
    let stop = ev.shutdown_handle();
    let run = std::thread::spawn(move || ev.run());
    assert!(eventually(|| visited.load(Ordering::SeqCst) > 0));
    stop.trigger();
    assert!(eventually(|| run.is_finished()), "run() did not return after the stop request");
    run.join().unwrap().unwrap();
    assert!(visited.load(Ordering::SeqCst) < 250, "the sweep ran to completion instead of stopping");
}

#[test]
fn empty_directories_are_removed_only_after_the_ttl() {
    for (ttl, removed) in [("0", true), ("3600", false)] {
        let fx = Fixture::new();
        fx.tree(spec(30));
        let usage = TreeUsage::filled_to(&fx.root, 99.0);
        let config = fx.config(&[
            ("CLEANUP_THRESHOLD", "1"),
            ("TARGET_THRESHOLD", "0"),
            ("DIR_CLEANUP_TTL_SECONDS", ttl),
        ]);
        let mut ev = Evictor::new(config, usage.source());
        for _ in 0..3 {
            ev.tick().unwrap();
        }
        let shard = fx.root.join(TreeSpec::default().shard_dir(0));
        let left = std::fs::read_dir(&shard).unwrap().count();
        assert_eq!(left == 0, removed, "ttl {ttl}: {left} buckets left");
        assert!(shard.exists(), "the shard directory itself stays");
    }
}

#[test]
fn stale_temporary_files_are_removed() {
    let fx = Fixture::new();
    let files = fx.tree(spec(10));
    let leaf = fx.root.join(files[0].path.parent().unwrap());
    let (stale, fresh) = (leaf.join("0123456789abcdef.bin.tmp"), leaf.join("fedcba9876543210.bin.tmp"));
    for f in [&stale, &fresh] {
        std::fs::write(f, b"partial").unwrap();
    }
    let two_hours_ago = SystemTime::now() - Duration::from_secs(7200);
    set_times(&stale, two_hours_ago, two_hours_ago).unwrap();
    let dial = Dial::default();
    dial.set(90.0);
    let mut ev = Evictor::new(fx.config(&[]), dial.source());
    let (u, _) = ev.check().unwrap();
    ev.sweep(u).unwrap();
    assert!(!stale.exists() && fresh.exists());
    assert_eq!(ev.stats().snapshot().tmp_removed, 1);
}

/// The one test on a real filesystem: `statvfs`, `unlinkat` and atimes of
/// the disk holding the build directory.
#[test]
fn real_filesystem_end_to_end() {
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let fx = Fixture::in_dir(tmp);
    let files = fx.tree(TreeSpec { files: 200, hot_fraction: 0.3, ..TreeSpec::default() });
    let disk = Statvfs::new(fx.mount());
    let now = disk.usage().unwrap().percent();
    // ON from the start, never reaching the target: delete all that is cold.
    let cleanup = format!("{}", (now / 2.0).max(0.001));
    let config = fx.config(&[("CLEANUP_THRESHOLD", &cleanup), ("TARGET_THRESHOLD", "0")]);
    let mut ev = Evictor::new(config, disk);
    drain(&mut ev);
    for f in &files {
        assert_eq!(fx.exists(f), f.hot, "{}", f.path.display());
    }
    assert_eq!(ev.stats().snapshot().errors, 0);
}

#[test]
fn regression_each_bucket_is_listed_once_per_sweep() {
    let fx = Fixture::new();
    fx.tree(TreeSpec { files: 400, ranks: 2, ..TreeSpec::default() });
    let listed = Arc::new(Mutex::new(Vec::new()));
    let log = listed.clone();
    let config = fx.config(&[("NUM_CRAWLER_PROCESSES", "8")]);
    let dial = Dial::default();
    dial.set(90.0);
    let mut ev = Evictor::new(config, dial.source())
        .with_dir_hook(Arc::new(move |p| log.lock().unwrap().push(p.to_owned())));
    let (u, _) = ev.check().unwrap();
    ev.sweep(u).unwrap();

    let listed = listed.lock().unwrap();
    let distinct: HashSet<_> = listed.iter().collect();
    assert_eq!(distinct.len(), listed.len(), "a bucket was listed twice in one sweep");
    let on_disk: usize = (0..2)
        .map(|r| std::fs::read_dir(fx.root.join(TreeSpec::default().shard_dir(r))).unwrap().count())
        .sum();
    assert_eq!(listed.len(), on_disk, "every bucket is listed");
    assert_eq!(ev.stats().snapshot().discovered, 400);
}
