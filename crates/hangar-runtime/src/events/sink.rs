//! Where events go: a bounded channel, which a request only ever
//! `try_send`s on, and a writer thread that drains it into a rotating
//! JSONL file (one machine) or a Redis stream (a fleet).
//!
//! A full channel drops the event and counts it
//! (`hangar_events_dropped_total{reason="full"}`); a sink that cannot be
//! written (a read-only directory, Redis down) drops what it cannot write
//! (`reason="sink_failed"`), sets `hangar_events_sink_failing` to 1 and
//! says so once in the log, tries again every few seconds, and says so
//! once more when it writes again. The server serves on either way.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hangar_core::ByteSize;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

use super::trace::{ReplicaNames, RequestEnded};
use super::InferenceEvent;

/// After a failed write, how long the writer waits before trying the sink
/// again (events meanwhile are dropped and counted).
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// `[events]`: where inference events are written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EventsConfig {
    /// Write events at all. Default `true`.
    pub enabled: bool,
    /// The JSONL file on one machine. Relative paths are resolved against
    /// `data_dir`; default `events/events.jsonl` there.
    pub path: Option<PathBuf>,
    /// The file is rotated (`events.jsonl` → `events.jsonl.1` → …) before
    /// it would pass this size. Default 64 MiB.
    pub max_file_bytes: ByteSize,
    /// Rotated files kept besides the current one. Default 8.
    pub keep_files: u32,
    /// Events waiting for the writer; one more is dropped. Default 4096.
    pub channel: usize,
    /// In a fleet (`redis` set): the stream every gateway appends to.
    /// Default `hangar:events`.
    pub stream: String,
    /// The stream is trimmed to about this many entries (`XADD … MAXLEN ~`).
    /// Default 1,000,000.
    pub stream_max_len: u64,
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig {
            enabled: true,
            path: None,
            max_file_bytes: ByteSize::new(64 << 20),
            keep_files: 8,
            channel: 4096,
            stream: "hangar:events".into(),
            stream_max_len: 1_000_000,
        }
    }
}

impl EventsConfig {
    /// The JSONL file, resolved against `data_dir`.
    pub fn file(&self, data_dir: &Path) -> PathBuf {
        match &self.path {
            Some(p) if p.is_absolute() => p.clone(),
            Some(p) => data_dir.join(p),
            None => data_dir.join("events").join("events.jsonl"),
        }
    }

    /// The current file and the rotated ones, newest first.
    pub fn files(path: &Path, keep: u32) -> Vec<PathBuf> {
        std::iter::once(path.to_path_buf()).chain((1..=keep).map(|i| rotated(path, i))).collect()
    }
}

fn rotated(path: &Path, i: u32) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{i}"));
    PathBuf::from(name)
}

/// Where the writer puts events.
pub enum Target {
    /// A JSONL file, rotated by size.
    File {
        /// The current file.
        path: PathBuf,
        /// Rotate before passing this many bytes.
        max_bytes: u64,
        /// Rotated files kept.
        keep: u32,
    },
    /// A Redis stream, each entry one event as JSON in its field `e`.
    Redis {
        /// The fleet's Redis.
        redis: hangar_redis::Redis,
        /// The stream key.
        stream: String,
        /// `MAXLEN ~`.
        max_len: u64,
    },
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// The sink's figures in `/metrics`.
#[derive(Clone, Default)]
pub struct SinkStats {
    dropped: Family<ReasonLabel, Counter>,
    written: Counter,
    failing: Gauge,
}

impl SinkStats {
    /// Registers the figures in `registry` (prefixed `hangar_` by it).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "events_dropped",
            "Inference events dropped: the writer's channel was full, or the sink could not be written",
            self.dropped.clone(),
        );
        registry.register("events_written", "Inference events written to the sink", self.written.clone());
        registry.register(
            "events_sink_failing",
            "1 while the event sink cannot be written (the log says why)",
            self.failing.clone(),
        );
    }

    /// The counter of `full` drops, for the request path to bump.
    fn full(&self) -> Counter {
        self.dropped.get_or_create(&ReasonLabel { reason: "full" }).clone()
    }

    fn dropped(&self, reason: &'static str) -> u64 {
        self.dropped.get_or_create(&ReasonLabel { reason }).get()
    }

    /// Events dropped because the channel was full.
    pub fn dropped_full(&self) -> u64 {
        self.dropped("full")
    }

    /// Events dropped because the sink could not be written.
    pub fn dropped_sink_failed(&self) -> u64 {
        self.dropped("sink_failed")
    }

    /// Events written.
    pub fn written(&self) -> u64 {
        self.written.get()
    }

    /// Whether the sink is failing now.
    pub fn failing(&self) -> bool {
        self.failing.get() != 0
    }
}

/// What the request path and the predictions hand the writer.
///
/// A request's variant is the big one on purpose: boxing it would cost
/// an allocation per request, and a slot of the channel is allocated once.
#[allow(clippy::large_enum_variant)]
pub(super) enum Ended {
    /// A synchronous request: its trace, made into an event by the writer.
    Request(RequestEnded),
    /// A prediction's event, made when it ended (off the request path).
    Prediction(Box<InferenceEvent>),
    /// Everything sent before this is written (or dropped): say so.
    Flush(Arc<Flushed>),
}

/// A [`EventSink::flush`] waiting for the writer.
pub(super) struct Flushed {
    done: Mutex<bool>,
    cv: Condvar,
}

/// The wall clock at one instant, to turn the request path's `Instant`s
/// into Unix time (the request path reads no wall clock).
pub(super) struct WallClock {
    unix_ms: u64,
    at: Instant,
}

impl WallClock {
    fn now() -> Self {
        let unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        WallClock { unix_ms, at: Instant::now() }
    }

    /// `t` (before now) in Unix ms, never later than it was: the gap to
    /// now is rounded up (a usage query up to now counts what ended
    /// before it).
    pub fn unix_ms(&self, t: Instant) -> u64 {
        let gap_ms = self.at.saturating_duration_since(t).as_micros().div_ceil(1000);
        self.unix_ms.saturating_sub(u64::try_from(gap_ms).unwrap_or(u64::MAX))
    }
}

/// The request path's end of the events channel: cheap to clone, never
/// blocks, never wakes the writer.
///
/// The channel is a bounded array (`std::sync::mpsc::sync_channel`); a
/// send is a few atomic operations and a move. The writer is not woken
/// per event (which would cost a system call on the request path): it
/// drains the channel every [`TICK`] — sooner after a busy drain — so
/// events reach the sink within about a tick.
#[derive(Clone)]
pub struct EventSink {
    tx: Option<SyncSender<Ended>>,
    /// The writer thread, woken only to flush.
    writer: Option<Thread>,
    /// Counted on the request path: the `full` drops.
    full: Counter,
    stats: SinkStats,
}

/// How often the writer drains the channel when it is quiet.
pub const TICK: Duration = Duration::from_millis(100);

/// After a drain of more than a quarter of the channel, the writer comes
/// back this soon.
const BUSY_TICK: Duration = Duration::from_millis(10);

/// The writer thread; [`WriterHandle::join`] waits for it to write what
/// it was sent, once every [`EventSink`] clone is dropped.
pub struct WriterHandle(Option<JoinHandle<()>>);

impl WriterHandle {
    /// Waits for the writer to end (it ends within a tick of the last
    /// sink being dropped, having written what it was sent).
    pub fn join(mut self) {
        if let Some(thread) = self.0.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

impl EventSink {
    /// A sink that writes nothing (`[events] enabled = false`).
    pub fn disabled() -> Self {
        let stats = SinkStats::default();
        let full = stats.full();
        EventSink { tx: None, writer: None, full, stats }
    }

    /// Starts the writer thread on `target`, with a channel of `capacity`.
    pub fn start(target: Target, capacity: usize) -> (Self, WriterHandle) {
        let capacity = capacity.max(1);
        let (tx, rx) = mpsc::sync_channel(capacity);
        let stats = SinkStats::default();
        let writer =
            Writer { stats: stats.clone(), failing_since: None, retry_at: None, batch: Batch::default() };
        let thread = std::thread::Builder::new()
            .name("hangar-events".into())
            .spawn(move || writer.run(rx, target, capacity))
            .expect("the OS can start a thread");
        let full = stats.full();
        let sink = EventSink { tx: Some(tx), writer: Some(thread.thread().clone()), full, stats };
        (sink, WriterHandle(Some(thread)))
    }

    /// Hands a prediction's `event` to the writer, as [`EventSink::send`].
    pub fn prediction(&self, event: InferenceEvent) {
        if self.tx.is_some() {
            self.send(Ended::Prediction(Box::new(event)));
        }
    }

    /// Hands `ended` to the writer, or drops it (counted) when the channel
    /// is full. Never blocks, never fails the caller.
    pub(super) fn send(&self, ended: Ended) {
        if let Some(tx) = &self.tx {
            if tx.try_send(ended).is_err() {
                self.full.inc();
            }
        }
    }

    /// Waits (at most `within`) until everything sent before the call is
    /// written or dropped: for a server that stops, and for tests. It
    /// blocks the calling thread; from async code, call it in
    /// `spawn_blocking`. `false` if it gave up waiting.
    pub fn flush(&self, within: Duration) -> bool {
        let (Some(tx), Some(writer)) = (&self.tx, &self.writer) else { return true };
        let flushed = Arc::new(Flushed { done: Mutex::new(false), cv: Condvar::new() });
        let deadline = Instant::now() + within;
        // The channel may be full: the writer makes room at its next tick.
        let mut marker = Ended::Flush(flushed.clone());
        loop {
            writer.unpark();
            match tx.try_send(marker) {
                Ok(()) => break,
                Err(TrySendError::Full(back)) if Instant::now() < deadline => {
                    marker = back;
                    std::thread::sleep(BUSY_TICK);
                }
                Err(_) => return false,
            }
        }
        let done = flushed.done.lock().expect("never poisoned: no panics while held");
        let left = deadline.saturating_duration_since(Instant::now());
        let (done, _) = flushed.cv.wait_timeout_while(done, left, |done| !*done).expect("never poisoned");
        *done
    }

    /// Whether events are written at all.
    pub fn enabled(&self) -> bool {
        self.tx.is_some()
    }

    /// The sink's figures.
    pub fn stats(&self) -> &SinkStats {
        &self.stats
    }
}

/// Events as JSON lines, one after the other, each with its newline and
/// ending at its offset in `ends`: a file takes a batch in one write (a
/// line at a time through a buffer cost a copy more and a write per 8 KiB,
/// and left most page-cache pages half written, to be zeroed first).
#[derive(Default)]
struct Batch {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl Batch {
    fn push(&mut self, event: &InferenceEvent) {
        serde_json::to_writer(&mut self.bytes, event).expect("an event serializes");
        self.bytes.push(b'\n');
        self.ends.push(self.bytes.len());
    }

    /// Each event's line, its newline included.
    fn lines(&self) -> impl Iterator<Item = &[u8]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts.zip(self.ends.iter().copied()).map(|(a, b)| &self.bytes[a..b])
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    fn clear(&mut self) {
        self.bytes.clear();
        self.ends.clear();
    }
}

/// The writer thread's state.
struct Writer {
    stats: SinkStats,
    /// Set while writes fail (logged once per episode).
    failing_since: Option<Instant>,
    retry_at: Option<Instant>,
    batch: Batch,
}

/// One sink's way of writing a batch.
trait Out {
    /// Writes every line of `batch`.
    fn write(&mut self, batch: &Batch) -> Result<(), String>;
}

/// Events written at most at once.
const MAX_BATCH: usize = 4096;

impl Writer {
    /// Drains `rx` every tick into `target`, until every sender is gone
    /// and what they sent is written.
    fn run(mut self, rx: Receiver<Ended>, target: Target, capacity: usize) {
        let mut out: Box<dyn Out> = match target {
            Target::File { path, max_bytes, keep } => {
                Box::new(Jsonl { path, max_bytes, keep, file: None, size: 0 })
            }
            Target::Redis { redis, stream, max_len } => Box::new(Stream { redis, stream, max_len }),
        };
        let (mut flushes, mut replicas) = (Vec::new(), ReplicaNames::default());
        loop {
            let clock = WallClock::now();
            let (mut drained, mut gone) = (0, false);
            loop {
                let ended = match rx.try_recv() {
                    Ok(ended) => ended,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        gone = true;
                        break;
                    }
                };
                drained += 1;
                match ended {
                    Ended::Request(ended) => self.batch.push(&ended.event(&clock, &mut replicas)),
                    Ended::Prediction(event) => self.batch.push(&event),
                    Ended::Flush(flushed) => flushes.push(flushed),
                }
                if self.batch.len() >= MAX_BATCH {
                    self.write(&mut *out);
                }
            }
            if self.batch.len() > 0 {
                self.write(&mut *out);
            }
            for flushed in flushes.drain(..) {
                *flushed.done.lock().expect("never poisoned: no panics while held") = true;
                flushed.cv.notify_all();
            }
            if gone {
                return;
            }
            std::thread::park_timeout(if drained > capacity / 4 { BUSY_TICK } else { TICK });
        }
    }

    /// Writes the batch (or drops it, counted, while the sink fails) and
    /// clears it.
    fn write(&mut self, out: &mut dyn Out) {
        let n = self.batch.len() as u64;
        let dropped = || self.stats.dropped.get_or_create(&ReasonLabel { reason: "sink_failed" }).inc_by(n);
        if self.retry_at.is_some_and(|at| Instant::now() < at) {
            dropped();
        } else {
            match out.write(&self.batch) {
                Ok(()) => {
                    self.stats.written.inc_by(n);
                    if let Some(since) = self.failing_since.take() {
                        tracing::info!(
                            "the event sink is written again, after {} s; events meanwhile were dropped",
                            since.elapsed().as_secs()
                        );
                        self.stats.failing.set(0);
                    }
                    self.retry_at = None;
                }
                Err(why) => {
                    dropped();
                    if self.failing_since.is_none() {
                        tracing::error!(
                            "cannot write inference events ({why}); the server serves on, dropping them \
                             (hangar_events_dropped_total{{reason=\"sink_failed\"}}) and trying again every {} s",
                            RETRY_AFTER.as_secs()
                        );
                        self.failing_since = Some(Instant::now());
                        self.stats.failing.set(1);
                    }
                    self.retry_at = Some(Instant::now() + RETRY_AFTER);
                }
            }
        }
        self.batch.clear();
    }
}

/// A JSONL file rotated by size.
struct Jsonl {
    path: PathBuf,
    max_bytes: u64,
    keep: u32,
    file: Option<File>,
    size: u64,
}

impl Jsonl {
    fn open(&mut self) -> std::io::Result<&mut File> {
        if self.file.is_none() {
            if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            let file = OpenOptions::new().create(true).append(true).open(&self.path)?;
            self.size = file.metadata()?.len();
            self.file = Some(file);
        }
        Ok(self.file.as_mut().expect("opened above"))
    }

    /// `events.jsonl.{keep-1}` → `.{keep}`, …, `events.jsonl` → `.1`
    /// (the oldest falls off); with `keep` 0 the file is removed.
    fn rotate(&mut self) -> std::io::Result<()> {
        self.file = None;
        let gone_is_fine = |r: std::io::Result<()>| match r {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
        if self.keep == 0 {
            gone_is_fine(std::fs::remove_file(&self.path))?;
        } else {
            for i in (1..self.keep).rev() {
                gone_is_fine(std::fs::rename(rotated(&self.path, i), rotated(&self.path, i + 1)))?;
            }
            gone_is_fine(std::fs::rename(&self.path, rotated(&self.path, 1)))?;
        }
        self.size = 0;
        Ok(())
    }

    /// Writes the batch's lines, as many at once as fit before the file
    /// must rotate (a line never straddles two files).
    fn write_lines(&mut self, batch: &Batch) -> std::io::Result<()> {
        // The next line, and where it starts.
        let (mut line, mut from) = (0, 0);
        while line < batch.len() {
            self.open()?;
            // The lines that fit in this file: at least one, into an empty
            // file, however long.
            let room = self.max_bytes.saturating_sub(self.size);
            let fit = batch.ends[line..].partition_point(|&end| (end - from) as u64 <= room);
            let n = match (fit, self.size) {
                (0, 0) => 1,
                (0, _) => {
                    self.rotate()?;
                    continue;
                }
                (n, _) => n,
            };
            let end = batch.ends[line + n - 1];
            self.open()?.write_all(&batch.bytes[from..end])?;
            self.size += (end - from) as u64;
            (line, from) = (line + n, end);
        }
        Ok(())
    }
}

impl Out for Jsonl {
    fn write(&mut self, batch: &Batch) -> Result<(), String> {
        self.write_lines(batch).map_err(|e| {
            // Reopened on the next try (the directory may come back).
            self.file = None;
            format!("{}: {e}", self.path.display())
        })
    }
}

/// A Redis stream, trimmed to about `max_len` entries.
struct Stream {
    redis: hangar_redis::Redis,
    stream: String,
    max_len: u64,
}

impl Out for Stream {
    fn write(&mut self, batch: &Batch) -> Result<(), String> {
        use hangar_redis::redis;
        // A repeat after a dropped connection may add a batch twice; the
        // events carry their ids, so readers can tell.
        let mut pipe = redis::pipe();
        for line in batch.lines() {
            let line = line.strip_suffix(b"\n").unwrap_or(line);
            pipe.cmd("XADD")
                .arg(&self.stream)
                .arg("MAXLEN")
                .arg("~")
                .arg(self.max_len)
                .arg("*")
                .arg("e")
                .arg(line)
                .ignore();
        }
        self.redis.run(|conn| pipe.query::<()>(conn)).map_err(|e| format!("stream `{}`: {e}", self.stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hangar_core::RequestKind;

    pub(crate) fn event(id: &str) -> InferenceEvent {
        InferenceEvent {
            ts_ms: 1,
            kind: RequestKind::Sync,
            id: id.into(),
            account: "acme".parse().unwrap(),
            model: "demo/chat".into(),
            replica: None,
            node: None,
            status: 200,
            code: None,
            queue_ms: 0,
            inference_ms: 10,
            total_ms: 10,
            ttft_ms: Some(5),
            input_tokens: 3,
            output_tokens: 7,
            tokens_estimated: false,
            images: 0,
            cost: Default::default(),
            queue_position: None,
            steps: Vec::new(),
        }
    }

    fn lines(path: &Path) -> Vec<String> {
        std::fs::read_to_string(path).map(|t| t.lines().map(str::to_owned).collect()).unwrap_or_default()
    }

    #[test]
    fn the_file_rotates_by_size_and_keeps_n_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ev").join("events.jsonl");
        let one = serde_json::to_vec(&event("r0000")).unwrap().len() as u64 + 1;
        // Three events per file, two rotated files kept.
        let target = Target::File { path: path.clone(), max_bytes: 3 * one, keep: 2 };
        let (sink, writer) = EventSink::start(target, 64);
        for i in 0..10 {
            sink.prediction(event(&format!("r{i:04}")));
        }
        let stats = sink.stats().clone();
        drop(sink);
        writer.join();
        assert_eq!(stats.written(), 10);
        let files = EventsConfig::files(&path, 2);
        let ids: Vec<Vec<String>> = files
            .iter()
            .map(|f| lines(f).iter().map(|l| serde_json::from_str::<InferenceEvent>(l).unwrap().id).collect())
            .collect();
        // Newest first: r0009 alone, then r0006..8, r0003..5; r0000..2 fell off.
        assert_eq!(ids, [vec!["r0009"], vec!["r0006", "r0007", "r0008"], vec!["r0003", "r0004", "r0005"]]);
        assert!(!rotated(&path, 3).exists());
    }

    #[test]
    fn a_line_longer_than_a_file_goes_alone_into_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let (sink, writer) =
            EventSink::start(Target::File { path: path.clone(), max_bytes: 10, keep: 5 }, 64);
        for i in 0..3 {
            sink.prediction(event(&format!("r{i}")));
        }
        drop(sink);
        writer.join();
        let files = EventsConfig::files(&path, 5);
        let per_file: Vec<usize> = files.iter().map(|f| lines(f).len()).collect();
        assert_eq!(per_file, [1, 1, 1, 0, 0, 0]);
        let last: InferenceEvent = serde_json::from_str(&lines(&path)[0]).unwrap();
        assert_eq!(last.id, "r2");
    }

    #[test]
    fn an_unwritable_sink_drops_counts_and_never_blocks() {
        let dir = tempfile::tempdir().unwrap();
        // A file where the directory should be: nothing can be created under it.
        let blocker = dir.path().join("blocker");
        std::fs::write(&blocker, b"").unwrap();
        let target = Target::File { path: blocker.join("events.jsonl"), max_bytes: 1 << 20, keep: 1 };
        let (sink, writer) = EventSink::start(target, 4);
        for i in 0..100 {
            sink.prediction(event(&format!("r{i}")));
        }
        let stats = sink.stats().clone();
        drop(sink);
        writer.join();
        assert_eq!(stats.written(), 0);
        assert!(stats.failing());
        assert_eq!(stats.dropped_full() + stats.dropped_sink_failed(), 100);
        assert!(stats.dropped_sink_failed() >= 1);
        let mut registry = Registry::with_prefix("hangar");
        stats.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("hangar_events_sink_failing 1"), "{text}");
        assert!(text.contains("hangar_events_dropped_total{reason=\"sink_failed\"}"), "{text}");
    }

    #[test]
    fn a_full_channel_drops_and_counts() {
        let (tx, _rx) = mpsc::sync_channel(2);
        let stats = SinkStats::default();
        let full = stats.full();
        let sink = EventSink { tx: Some(tx), writer: None, full, stats };
        for i in 0..5 {
            sink.prediction(event(&format!("r{i}")));
        }
        assert_eq!(sink.stats().dropped_full(), 3);
    }
}
