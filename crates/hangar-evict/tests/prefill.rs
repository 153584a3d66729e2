//! Pre-fill: the deletion queue filled while deletion is OFF serves the
//! crossing without a sweep, stays safe when stale, keeps memory within
//! `MAX_CANDIDATES`, and lands usage within two points of the target.
//! Assertions are on the evictor's steps and counters, never on time.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use common::{eventually, read_at, spec, Fixture, TreeUsage};
use hangar_evict::synth::TreeSpec;
use hangar_evict::{Evictor, Stop, Tick};
use proptest::prelude::*;

/// Raises the usage `usage` reports to `percent` with bytes outside the tree.
fn set_usage(usage: &TreeUsage, percent: f64) {
    let tree = usage.usage().unwrap().used_bytes - *usage.other_bytes.lock().unwrap();
    let want = (usage.capacity as f64 * percent / 100.0) as u64;
    *usage.other_bytes.lock().unwrap() = want.saturating_sub(tree);
}

/// Counts the bucket directories crawlers start on: a sweep lists some,
/// deleting from the queue lists none.
fn counting_hook() -> (Arc<AtomicUsize>, hangar_evict::DirHook) {
    let listed = Arc::new(AtomicUsize::new(0));
    let count = listed.clone();
    (
        listed,
        Arc::new(move |_| {
            count.fetch_add(1, Ordering::SeqCst);
        }),
    )
}

#[test]
fn the_prefilled_queue_serves_the_crossing_without_a_sweep() {
    let fx = Fixture::new();
    let files = fx.tree(spec(400));
    let usage = TreeUsage::filled_to(&fx.root, 80.0);
    let (listed, hook) = counting_hook();
    let mut ev = Evictor::new(fx.config(&[]), usage.source()).with_dir_hook(hook);

    // OFF: the first tick sweeps the whole tree into the queue.
    let Tick::Prefilled(queued) = ev.tick().unwrap() else { panic!("no pre-fill at start") };
    assert!(queued.files > 0 && queued.files < 400, "{queued:?}");
    assert_eq!(ev.queue(), queued);
    let after_prefill = ev.stats().snapshot();
    assert_eq!((after_prefill.sweeps, after_prefill.prefills, after_prefill.deleted), (1, 1, 0));
    assert_eq!(after_prefill.queued, queued.files as u64);
    let buckets_listed = listed.load(Ordering::SeqCst);
    assert!(buckets_listed > 0);
    assert!(matches!(ev.tick().unwrap(), Tick::Idle { .. }), "no second sweep while idle");

    // The crossing: the next tick deletes from the queue, listing nothing.
    set_usage(&usage, 90.0);
    let oldest_queued = ev.queued_paths()[0].clone();
    let r = match ev.tick().unwrap() {
        Tick::Evicted(r) => r,
        other => panic!("expected a deletion, got {other:?}"),
    };
    assert!(!r.swept, "a sweep ran between the crossing and the first deletion");
    assert_eq!(r.stopped, Stop::TargetReached);
    assert_eq!(ev.stats().snapshot().sweeps, 1, "no sweep since the pre-fill");
    assert_eq!(listed.load(Ordering::SeqCst), buckets_listed, "a directory was listed to delete");
    assert!(!fx.root.join(oldest_queued).exists());
    let landed = usage.percent();
    assert!((68.0..=70.0).contains(&landed), "landed at {landed:.2} %");

    // Least recently used first, as if swept at the crossing.
    let (kept, gone): (Vec<_>, Vec<_>) = files.iter().partition(|f| fx.exists(f));
    assert_eq!(gone.len() as u64, r.deleted);
    assert!(gone.iter().map(|f| f.last_use).max() < kept.iter().map(|f| f.last_use).min());
    // What was not taken stays queued, still the oldest of what is left.
    let left = ev.queued_paths();
    assert_eq!(left.len() as u64, ev.stats().snapshot().queued);
    let oldest_kept = kept.iter().min_by_key(|f| f.last_use).unwrap();
    assert_eq!(left.first(), Some(&oldest_kept.path));
}

#[test]
fn a_file_used_after_the_prefill_is_spared() {
    let fx = Fixture::new();
    fx.tree(spec(200));
    let usage = TreeUsage::filled_to(&fx.root, 80.0);
    let mut ev = Evictor::new(fx.config(&[]), usage.source());
    assert!(matches!(ev.tick().unwrap(), Tick::Prefilled(_)));
    let queued = ev.queued_paths();
    assert!(queued.len() > 10);

    // After the pre-fill, the two oldest queued blocks are read: one now,
    // one two days ago — later than when the sweep saw it, so no longer
    // among the least recently used.
    let (read_now, read_since) = (fx.root.join(&queued[0]), fx.root.join(&queued[1]));
    read_at(&read_now, SystemTime::now());
    read_at(&read_since, SystemTime::now() - Duration::from_secs(2 * 86_400));

    set_usage(&usage, 88.0);
    let Tick::Evicted(r) = ev.tick().unwrap() else { panic!("expected a deletion") };
    assert!(!r.swept);
    assert!(read_now.exists(), "a block read after the pre-fill was deleted");
    assert!(read_since.exists(), "a block used after the pre-fill was deleted");
    let s = ev.stats().snapshot();
    assert_eq!(s.spared_recently_used, 2);
    assert!(!fx.root.join(&queued[2]).exists(), "the next oldest went instead");
    assert!(!ev.queued_paths().contains(&queued[0]), "a spared file stays queued under its old age");
}

#[test]
fn a_shard_moved_since_the_prefill_is_left_alone() {
    let fx = Fixture::new();
    let files = fx.tree(TreeSpec { files: 120, ranks: 2, ..TreeSpec::default() });
    let usage = TreeUsage::filled_to(&fx.root, 80.0);
    let config = fx.config(&[("TARGET_THRESHOLD", "0")]);
    let mut ev = Evictor::new(config, usage.source());
    assert!(matches!(ev.tick().unwrap(), Tick::Prefilled(q) if q.files == 120));

    // Rank 1's directory leaves the tree after the pre-fill (same volume):
    // its queued files must not be deleted through the handle the queue holds.
    let rank1 = TreeSpec::default().shard_dir(1);
    let outside = fx.tmp.path().join("moved-out");
    std::fs::rename(fx.root.join(&rank1), &outside).unwrap();
    set_usage(&usage, 99.0);
    let Tick::Evicted(_) = ev.tick().unwrap() else { panic!("expected a deletion") };
    let moved: Vec<_> = files.iter().filter(|f| f.path.starts_with(&rank1)).collect();
    assert!(!moved.is_empty());
    for f in &moved {
        let rest = f.path.strip_prefix(&rank1).unwrap();
        assert!(outside.join(rest).exists(), "{} was deleted outside the tree", rest.display());
    }
    let s = ev.stats().snapshot();
    assert_eq!(s.vanished, moved.len() as u64);
    assert_eq!(s.deleted as usize, files.len() - moved.len());
}

#[test]
fn the_queue_and_a_sweep_in_progress_never_hold_more_than_max_candidates() {
    const MAX: u64 = 64;
    let fx = Fixture::new();
    fx.tree(spec(600));
    let usage = TreeUsage::filled_to(&fx.root, 80.0);
    let config = fx.config(&[("MAX_CANDIDATES", "64"), ("FILE_QUEUE_MAXSIZE", "8")]);
    // Sampled as every bucket is entered, i.e. while a sweep runs.
    let peak = Arc::new(AtomicU64::new(0));
    let stats_slot: Arc<Mutex<Option<Arc<hangar_evict::Stats>>>> = Arc::default();
    let (p, slot) = (peak.clone(), stats_slot.clone());
    let ev = Evictor::new(config, usage.source()).with_dir_hook(Arc::new(move |_| {
        if let Some(stats) = slot.lock().unwrap().as_ref() {
            let s = stats.snapshot();
            p.fetch_max(s.queued + s.selected, Ordering::SeqCst);
        }
    }));
    *stats_slot.lock().unwrap() = Some(ev.stats());
    let mut ev = ev;

    let Tick::Prefilled(q) = ev.tick().unwrap() else { panic!("no pre-fill") };
    assert_eq!(q.files as u64, MAX, "600 files at 80 %, a budget for 232 of them: capped");
    // A re-sweep builds the next queue beside the full one.
    let q = ev.prefill().unwrap();
    assert_eq!(q.files as u64, MAX);
    assert!(
        peak.load(Ordering::SeqCst) <= MAX,
        "queue + selection peaked at {}",
        peak.load(Ordering::SeqCst)
    );
    assert!(peak.load(Ordering::SeqCst) >= MAX / 2, "the sampling saw the sweep");
    assert_eq!(ev.stats().snapshot().prefills, 2);

    // Deleting from it, then sweeping for the rest when it runs out.
    set_usage(&usage, 95.0);
    for _ in 0..20 {
        if let Tick::Evicted(r) = ev.tick().unwrap() {
            if r.stopped == Stop::TargetReached {
                break;
            }
        }
        assert!(ev.queue().files as u64 <= MAX);
    }
    assert!(usage.percent() <= 70.0);
    assert!(
        peak.load(Ordering::SeqCst) <= MAX,
        "queue + selection peaked at {}",
        peak.load(Ordering::SeqCst)
    );
}

#[test]
fn without_prefill_nothing_is_swept_or_held_while_off() {
    let fx = Fixture::new();
    fx.tree(spec(200));
    let usage = TreeUsage::filled_to(&fx.root, 80.0);
    let mut ev = Evictor::new(fx.config(&[("PREFILL_INTERVAL_SECONDS", "0")]), usage.source());
    for _ in 0..3 {
        assert!(matches!(ev.tick().unwrap(), Tick::Idle { .. }));
    }
    assert_eq!(ev.stats().snapshot().sweeps, 0);
    set_usage(&usage, 90.0);
    let Tick::Evicted(r) = ev.tick().unwrap() else { panic!("expected a deletion") };
    assert!(r.swept, "without pre-fill the crossing is swept first");
    assert_eq!(r.stopped, Stop::TargetReached);
    assert!(matches!(ev.tick().unwrap(), Tick::Idle { .. }));
    assert_eq!(ev.queue().files, 0, "the queue's rest is not held while OFF");
}

/// The daemon loop pre-fills in the background and goes on checking usage:
/// a crossing during a re-sweep abandons it and deletes from the queue at
/// once, with no sweep between the crossing and the first deletion.
#[test]
fn a_crossing_during_a_background_prefill_deletes_from_the_queue() {
    let fx = Fixture::new();
    fx.tree(spec(300));
    let usage = TreeUsage::filled_to(&fx.root, 80.0);
    let config = fx.config(&[("PREFILL_INTERVAL_SECONDS", "0.05"), ("NUM_CRAWLER_PROCESSES", "1")]);
    // After the first pre-fill the volume turns slow: 20 ms a bucket, so a
    // re-sweep takes seconds and the crossing lands inside it.
    let slow = Arc::new(AtomicBool::new(false));
    let slow_buckets = Arc::new(AtomicUsize::new(0));
    let (s, n) = (slow.clone(), slow_buckets.clone());
    let ev = Evictor::new(config, usage.source()).with_dir_hook(Arc::new(move |_| {
        if s.load(Ordering::SeqCst) {
            n.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(20));
        }
    }));
    let stats = ev.stats();
    // Sweeps started when the first block went.
    let sweeps_at_first_deletion = Arc::new(AtomicU64::new(u64::MAX));
    let (seen, st) = (sweeps_at_first_deletion.clone(), stats.clone());
    let ev = ev.with_removed_sink(move |_| {
        let _ = seen.compare_exchange(u64::MAX, st.snapshot().sweeps, Ordering::SeqCst, Ordering::SeqCst);
    });
    let stop = ev.shutdown_handle();
    let run = std::thread::spawn(move || ev.run());
    let finish = |run: std::thread::JoinHandle<_>| {
        stop.trigger();
        assert!(eventually(|| run.is_finished()), "run() did not return after the stop request");
        run.join().unwrap()
    };

    assert!(eventually(|| stats.snapshot().prefills >= 1), "no pre-fill at start");
    slow.store(true, Ordering::SeqCst);
    assert!(eventually(|| slow_buckets.load(Ordering::SeqCst) > 2), "no re-sweep after the interval");
    let sweeps_before_crossing = stats.snapshot().sweeps;
    set_usage(&usage, 90.0);
    assert!(eventually(|| usage.percent() <= 70.0), "usage never came down");
    let result = finish(run);
    result.unwrap();

    let s = stats.snapshot();
    assert_eq!(s.prefills_cancelled, 1, "the re-sweep was not abandoned");
    assert_eq!(
        sweeps_at_first_deletion.load(Ordering::SeqCst),
        sweeps_before_crossing,
        "a sweep ran between the crossing and the first deletion"
    );
    assert!(slow_buckets.load(Ordering::SeqCst) < 250, "the abandoned re-sweep ran to its end");
}

/// On a small volume the default batch of 100 files is a large share of
/// it: batches are bounded in bytes too, and none is taken once what was
/// above the target is covered, so usage lands within 2 points of the
/// target (it went from 91 % to 32 % with a 70 % target) — whether the
/// queue was pre-filled before the crossing or swept after it.
#[test]
fn a_small_volume_lands_within_two_points_of_the_target() {
    for prefilled in [false, true] {
        for (files, start) in [(400, 91.0), (150, 95.0), (2_000, 86.0)] {
            let landed = landing(spec(files), start, prefilled);
            assert!(
                (68.0..=70.0).contains(&landed),
                "{files} files from {start} % (pre-filled: {prefilled}): landed at {landed:.2} %"
            );
        }
    }
}

/// Where usage lands after crossing to `start` %, with default settings.
/// `prefilled`: the queue is filled at 80 % before the crossing; else the
/// evictor starts at `start` % and sweeps first.
///
/// The evictor measures usage after every batch, and small volumes take
/// many batches; walking the tree each time would make this slow (and so
/// would writing the trees on a shared disk: they go to tmpfs), so the
/// evictor is given [`Counted`] usage, and where it landed is then measured
/// on the tree itself.
fn landing(tree: TreeSpec, start: f64, prefilled: bool) -> f64 {
    let fx = Fixture::in_memory();
    fx.tree(tree);
    let defaults =
        [("NUM_CRAWLER_PROCESSES", "8"), ("FILE_QUEUE_MIN_SIZE", "1000"), ("DELETION_BATCH_SIZE", "100")];
    let usage = TreeUsage::filled_to(&fx.root, if prefilled { 80.0 } else { start });
    let counted = Counted::of(&usage);
    let mut ev = Evictor::new(fx.config(&defaults), counted.source()).with_removed_sink(counted.sink());
    if prefilled {
        assert!(matches!(ev.tick().unwrap(), Tick::Prefilled(_)));
        set_usage(&usage, start);
        counted.reset(&usage);
    }
    let r = match ev.tick().unwrap() {
        Tick::Evicted(r) => r,
        other => panic!("expected a deletion, got {other:?}"),
    };
    assert_eq!(r.swept, !prefilled);
    assert_eq!(r.stopped, Stop::TargetReached, "{r:?}");
    let landed = usage.percent();
    assert!((landed - counted.percent()).abs() < 1e-9, "the removals reported are not what left the tree");
    landed
}

/// Usage as the deleter's own reports leave it: the tree's allocated
/// bytes when measured, less each removed block's.
#[derive(Clone)]
struct Counted {
    capacity: u64,
    used: Arc<AtomicU64>,
    allocated: Arc<HashMap<u64, u64>>,
}

impl Counted {
    fn of(usage: &TreeUsage) -> Counted {
        let allocated = block_sizes(&usage.root);
        let used = Arc::new(AtomicU64::new(usage.usage().unwrap().used_bytes));
        Counted { capacity: usage.capacity, used, allocated: Arc::new(allocated) }
    }

    fn reset(&self, usage: &TreeUsage) {
        self.used.store(usage.usage().unwrap().used_bytes, Ordering::SeqCst);
    }

    fn percent(&self) -> f64 {
        self.used.load(Ordering::SeqCst) as f64 * 100.0 / self.capacity as f64
    }

    fn source(&self) -> impl Fn() -> std::io::Result<hangar_evict::Usage> + Send + Sync + 'static {
        let this = self.clone();
        move || {
            let used = this.used.load(Ordering::SeqCst);
            Ok(hangar_evict::Usage { used_bytes: used, avail_bytes: this.capacity.saturating_sub(used) })
        }
    }

    fn sink(&self) -> impl FnMut(hangar_evict::Removed) + Send + 'static {
        let this = self.clone();
        move |r| {
            this.used.fetch_sub(this.allocated[&r.hash], Ordering::SeqCst);
        }
    }
}

/// Allocated bytes of every block file below `dir`, by hash.
fn block_sizes(dir: &std::path::Path) -> HashMap<u64, u64> {
    use std::os::unix::fs::MetadataExt;
    let mut out = HashMap::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let meta = e.path().symlink_metadata().unwrap();
        if meta.is_dir() {
            out.extend(block_sizes(&e.path()));
        } else if let Some(hash) = hangar_evict::layout::parse_block_file(e.file_name().as_encoded_bytes()) {
            out.insert(hash, meta.blocks() * 512);
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Whatever the tree's size, its files' sizes (up to 4x apart, none
    /// above about 1 % of the volume) and how far usage jumps past the
    /// threshold, with or without pre-fill: usage lands at or below the
    /// target and within 2 points of it.
    #[test]
    fn usage_lands_within_two_points_of_the_target(
        files in 500usize..1_500,
        smallest in 1usize..8,
        spread in 1usize..=4,
        start in 85.5f64..99.0,
        prefilled in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let tree = TreeSpec {
            files,
            file_bytes: smallest * 1024,
            max_file_bytes: smallest * 1024 * spread,
            seed,
            ..TreeSpec::default()
        };
        let landed = landing(tree, start, prefilled);
        prop_assert!((68.0..=70.0).contains(&landed), "landed at {:.2} %", landed);
    }
}
