//! Counters shared by crawlers, deleter, status line and `/metrics`.
//!
//! Everything is an atomic so workers never lock to count. Figures that
//! describe *the current sweep* (discovered, queued) are reset when a sweep
//! starts, so the status line reports what is happening now rather than a
//! total that grows with every pass over the tree — the Python evictor's
//! "discovered" kept climbing across sweeps.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Live counters of one evictor.
#[derive(Debug, Default)]
pub struct Stats {
    /// Deletion ON.
    pub deleting: AtomicBool,
    /// Last measured usage in hundredths of a percent.
    pub usage_centi_percent: AtomicU64,
    /// Sweeps started (pre-fills included).
    pub sweeps: AtomicU64,
    /// Pre-fill sweeps that completed: the queue was filled while OFF.
    pub prefills: AtomicU64,
    /// Pre-fill sweeps abandoned because usage crossed meanwhile.
    pub prefills_cancelled: AtomicU64,
    /// Candidates the selection of the sweep in progress holds.
    pub selected: AtomicU64,
    /// Block files seen by the current (or last) sweep.
    pub discovered: AtomicU64,
    /// Files skipped this sweep because they were used within the threshold.
    pub hot_skipped: AtomicU64,
    /// Files in the deletion queue: pre-filled while OFF, not yet
    /// processed by the deleter while ON.
    pub queued: AtomicU64,
    /// Files deleted (or, in a dry run, reported) since start.
    pub deleted: AtomicU64,
    /// Bytes freed (or, in a dry run, that would be freed) since start.
    pub bytes_freed: AtomicU64,
    /// Selected files spared because they were used after selection.
    pub spared_recently_used: AtomicU64,
    /// Selected files that had vanished before their turn.
    pub vanished: AtomicU64,
    /// Empty directories removed.
    pub dirs_removed: AtomicU64,
    /// Leftover `.tmp` files removed.
    pub tmp_removed: AtomicU64,
    /// I/O errors other than vanished files.
    pub errors: AtomicU64,
    /// Crawler threads that panicked and were restarted.
    pub crawler_restarts: AtomicU64,
    /// `BlockRemoved` events dropped because the publisher lagged.
    pub events_dropped: AtomicU64,
}

/// A consistent-enough copy of [`Stats`] for one report.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Snapshot {
    /// Deletion ON.
    pub deleting: bool,
    /// Usage percentage.
    pub usage_percent: f64,
    /// Sweeps started.
    pub sweeps: u64,
    /// Pre-fill sweeps completed.
    pub prefills: u64,
    /// Pre-fill sweeps cancelled by a crossing.
    pub prefills_cancelled: u64,
    /// Candidates held by the sweep in progress.
    pub selected: u64,
    /// Files seen by the current sweep.
    pub discovered: u64,
    /// Files skipped as recently used this sweep.
    pub hot_skipped: u64,
    /// Files in the deletion queue.
    pub queued: u64,
    /// Files deleted since start.
    pub deleted: u64,
    /// Bytes freed since start.
    pub bytes_freed: u64,
    /// Files spared because they were used after selection.
    pub spared_recently_used: u64,
    /// Files vanished before deletion.
    pub vanished: u64,
    /// Directories removed.
    pub dirs_removed: u64,
    /// Temporary files removed.
    pub tmp_removed: u64,
    /// I/O errors.
    pub errors: u64,
    /// Crawler restarts.
    pub crawler_restarts: u64,
    /// Dropped events.
    pub events_dropped: u64,
}

impl Stats {
    /// Adds `n` to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    /// Records the latest usage figure.
    pub fn set_usage(&self, percent: f64) {
        self.usage_centi_percent.store((percent * 100.0).round() as u64, Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            deleting: self.deleting.load(Relaxed),
            usage_percent: self.usage_centi_percent.load(Relaxed) as f64 / 100.0,
            sweeps: self.sweeps.load(Relaxed),
            prefills: self.prefills.load(Relaxed),
            prefills_cancelled: self.prefills_cancelled.load(Relaxed),
            selected: self.selected.load(Relaxed),
            discovered: self.discovered.load(Relaxed),
            hot_skipped: self.hot_skipped.load(Relaxed),
            queued: self.queued.load(Relaxed),
            deleted: self.deleted.load(Relaxed),
            bytes_freed: self.bytes_freed.load(Relaxed),
            spared_recently_used: self.spared_recently_used.load(Relaxed),
            vanished: self.vanished.load(Relaxed),
            dirs_removed: self.dirs_removed.load(Relaxed),
            tmp_removed: self.tmp_removed.load(Relaxed),
            errors: self.errors.load(Relaxed),
            crawler_restarts: self.crawler_restarts.load(Relaxed),
            events_dropped: self.events_dropped.load(Relaxed),
        }
    }
}

impl Snapshot {
    /// The aggregated status line: current figures plus rates since `prev`,
    /// taken `elapsed` earlier.
    pub fn status_line(&self, prev: &Snapshot, elapsed: Duration, dry_run: bool) -> String {
        let secs = elapsed.as_secs_f64().max(1e-3);
        let deleted = self.deleted - prev.deleted;
        let freed = self.bytes_freed - prev.bytes_freed;
        let verb = if dry_run { "would_delete" } else { "deleted" };
        format!(
            "usage={:.2}% deletion={} sweep={} prefills={} discovered={} hot_skipped={} queued={} \
             {verb}={} (+{deleted}, {:.0}/s) freed={} (+{}/s) spared={} vanished={} \
             dirs_removed={} tmp_removed={} errors={} crawler_restarts={}",
            self.usage_percent,
            if self.deleting { "ON" } else { "OFF" },
            self.sweeps,
            self.prefills,
            self.discovered,
            self.hot_skipped,
            self.queued,
            self.deleted,
            deleted as f64 / secs,
            human_bytes(self.bytes_freed),
            human_bytes((freed as f64 / secs) as u64),
            self.spared_recently_used,
            self.vanished,
            self.dirs_removed,
            self.tmp_removed,
            self.errors,
            self.crawler_restarts,
        )
    }
}

/// `1536` → `1.5KiB`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{b}B")
    } else {
        format!("{v:.1}{}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_line_reports_mode_and_rates() {
        let stats = Stats::default();
        let before = stats.snapshot();
        stats.deleting.store(true, Relaxed);
        stats.set_usage(84.5);
        Stats::add(&stats.deleted, 200);
        Stats::add(&stats.bytes_freed, 2 * 1024 * 1024);
        let line = stats.snapshot().status_line(&before, Duration::from_secs(2), false);
        assert!(line.contains("usage=84.50%"), "{line}");
        assert!(line.contains("deletion=ON"), "{line}");
        assert!(line.contains("deleted=200 (+200, 100/s)"), "{line}");
        assert!(line.contains("freed=2.0MiB (+1.0MiB/s)"), "{line}");
    }
}
