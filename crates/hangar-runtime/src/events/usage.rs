//! Usage: the inference events of a time range added up by model,
//! account, day or hour — requests, errors, tokens in and out, images,
//! seconds of inference, Replicate-style cost and Workers AI neurons
//! (`GET /v1/usage`, `hangar usage`; docs/observability.md).
//!
//! [`UsageQuery`] says what to add up and [`UsageReport`] adds it, with
//! no I/O; [`read_files`] reads a machine's JSONL files (the current one
//! and the rotated ones) and [`read_stream`] a fleet's Redis stream,
//! whose entry ids are the milliseconds they were written at, so a time
//! range is one `XRANGE`.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use hangar_core::{AccountId, ErrorCode, Millis};
use serde::{Deserialize, Serialize};

use super::billing::Cost;
use super::sink::EventsConfig;

/// How usage is grouped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupBy {
    /// By model key.
    #[default]
    Model,
    /// By account.
    Account,
    /// By UTC day (`2026-11-27`).
    Day,
    /// By UTC hour (`2026-11-27T14:00Z`).
    Hour,
}

impl GroupBy {
    /// Every grouping, by name.
    pub const ALL: [(&'static str, GroupBy); 4] = [
        ("model", GroupBy::Model),
        ("account", GroupBy::Account),
        ("day", GroupBy::Day),
        ("hour", GroupBy::Hour),
    ];

    /// The grouping called `name`.
    pub fn parse(name: &str) -> Result<GroupBy, QueryError> {
        Self::ALL
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, g)| *g)
            .ok_or_else(|| QueryError::GroupBy { value: name.to_owned() })
    }
}

/// A usage query's value that cannot be used; each names its parameter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QueryError {
    /// `from` or `to` is neither RFC 3339 nor Unix seconds.
    #[error("`{param}`: `{value}` is not a time: give RFC 3339 (2026-11-27T14:00:00Z) or Unix seconds")]
    Time {
        /// `from` or `to`.
        param: &'static str,
        /// What was given.
        value: String,
    },
    /// `from` is after `to`.
    #[error("`from` ({from}) is after `to` ({to})")]
    Range {
        /// `from`, as given.
        from: String,
        /// `to`, as given.
        to: String,
    },
    /// `group_by` names no grouping.
    #[error("`group_by`: `{value}` is not one of model, account, day, hour")]
    GroupBy {
        /// What was given.
        value: String,
    },
}

/// A time as a usage query takes it: RFC 3339 (`2026-11-27T14:00:00Z`,
/// any offset) or Unix seconds (`1795788000`, fractions allowed), as Unix
/// ms; `param` names it in the error.
pub fn parse_time(param: &'static str, value: &str) -> Result<Millis, QueryError> {
    let refused = || QueryError::Time { param, value: value.to_owned() };
    let value = value.trim();
    if let Ok(seconds) = value.parse::<f64>() {
        return match (0.0..1e13).contains(&seconds) {
            true => Ok((seconds * 1000.0).round() as Millis),
            false => Err(refused()),
        };
    }
    let at: jiff::Timestamp = value.parse().map_err(|_| refused())?;
    Millis::try_from(at.as_millisecond()).map_err(|_| refused())
}

/// The RFC 3339 form of Unix ms `ms` (UTC, to the second).
pub fn rfc3339(ms: Millis) -> String {
    let at = jiff::Timestamp::from_millisecond(i64::try_from(ms).unwrap_or(i64::MAX)).unwrap_or_default();
    at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// What to add up: events that ended in `[from_ms, to_ms)`, of `model`
/// and `account` when given, grouped by `group_by`.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageQuery {
    /// From, Unix ms (inclusive).
    pub from_ms: Millis,
    /// To, Unix ms (exclusive).
    pub to_ms: Millis,
    /// Only this model's events.
    pub model: Option<String>,
    /// Only this account's events.
    pub account: Option<AccountId>,
    /// How to group them.
    pub group_by: GroupBy,
}

/// What usage reads of an event (the rest of its fields are skipped).
#[derive(Debug, Clone, Deserialize)]
pub struct UsageRow {
    /// When it ended, Unix ms.
    pub ts_ms: Millis,
    /// The account it ran for.
    pub account: AccountId,
    /// The model key.
    pub model: String,
    /// Why it did not succeed; none when it did.
    #[serde(default)]
    pub code: Option<ErrorCode>,
    /// Permit to end, ms.
    #[serde(default)]
    pub inference_ms: u64,
    /// Prompt tokens.
    #[serde(default)]
    pub input_tokens: u64,
    /// Generated tokens.
    #[serde(default)]
    pub output_tokens: u64,
    /// Images produced.
    #[serde(default)]
    pub images: u64,
    /// What it cost.
    #[serde(default)]
    pub cost: Cost,
}

/// One group's (or all groups') figures.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Totals {
    /// Requests and predictions.
    pub requests: u64,
    /// Of them, those that did not succeed.
    pub errors: u64,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Images produced.
    pub images: u64,
    /// Seconds of inference (permit to end).
    pub seconds: f64,
    /// Replicate-style cost, USD.
    pub usd: f64,
    /// Workers AI neurons.
    pub neurons: f64,
}

impl Totals {
    fn add(&mut self, row: &UsageRow) {
        self.requests += 1;
        self.errors += u64::from(row.code.is_some());
        self.input_tokens += row.input_tokens;
        self.output_tokens += row.output_tokens;
        self.images += row.images;
        self.seconds += row.inference_ms as f64 / 1000.0;
        self.usd += row.cost.usd;
        self.neurons += row.cost.neurons;
    }
}

/// One group of a report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Group {
    /// The model, account, day or hour.
    pub group: String,
    /// Its figures.
    #[serde(flatten)]
    pub totals: Totals,
}

/// A query's answer, built row by row ([`UsageReport::add`]).
#[derive(Debug, Clone, PartialEq)]
pub struct UsageReport {
    query: UsageQuery,
    groups: BTreeMap<String, Totals>,
    total: Totals,
}

impl UsageReport {
    /// An empty report of `query`.
    pub fn new(query: UsageQuery) -> Self {
        UsageReport { query, groups: BTreeMap::new(), total: Totals::default() }
    }

    /// The query.
    pub fn query(&self) -> &UsageQuery {
        &self.query
    }

    /// Whether `row` is one the query asks for.
    pub fn wants(&self, row: &UsageRow) -> bool {
        let q = &self.query;
        (q.from_ms..q.to_ms).contains(&row.ts_ms)
            && q.model.as_ref().is_none_or(|m| *m == row.model)
            && q.account.as_ref().is_none_or(|a| *a == row.account)
    }

    /// Adds `row` if the query wants it.
    pub fn add(&mut self, row: &UsageRow) {
        if !self.wants(row) {
            return;
        }
        let key = match self.query.group_by {
            GroupBy::Model => row.model.clone(),
            GroupBy::Account => row.account.to_string(),
            GroupBy::Day => rfc3339(row.ts_ms)[..10].to_owned(),
            GroupBy::Hour => format!("{}:00Z", &rfc3339(row.ts_ms)[..13]),
        };
        self.groups.entry(key).or_default().add(row);
        self.total.add(row);
    }

    /// The groups, in key order.
    pub fn groups(&self) -> Vec<Group> {
        self.groups.iter().map(|(group, totals)| Group { group: group.clone(), totals: *totals }).collect()
    }

    /// The figures of every group together.
    pub fn total(&self) -> Totals {
        self.total
    }
}

/// Why usage could not be read. Nothing is changed by a failed read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UsageError {
    /// This server writes no events (`[events] enabled = false`, or no
    /// place to write them).
    #[error(
        "this server records no inference events (`[events] enabled = false`): there is no usage to read"
    )]
    Off,
    /// An events file could not be read.
    #[error("cannot read the events file {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The fleet's stream could not be read.
    #[error("cannot read the events stream `{stream}`: {source}")]
    Stream {
        /// The stream key.
        stream: String,
        /// Why (`is_unavailable` when Redis cannot be reached).
        source: hangar_redis::RedisError,
    },
    /// The server is stopping: the read was not finished.
    #[error("the server is stopping")]
    Stopping,
}

/// Where a server's events are read back from: what it writes them to.
pub enum UsageSource {
    /// It writes none.
    Off,
    /// The JSONL file `path` and its `keep` rotated files.
    Files {
        /// The current file.
        path: PathBuf,
        /// Rotated files kept.
        keep: u32,
    },
    /// A fleet's Redis stream.
    Stream {
        /// The fleet's Redis.
        redis: hangar_redis::Redis,
        /// The stream key.
        stream: String,
    },
}

impl UsageSource {
    /// The report of `query`, read from here. Blocks on file or network
    /// I/O: call it off the async runtime.
    pub fn read(&self, query: UsageQuery) -> Result<UsageReport, UsageError> {
        let mut report = UsageReport::new(query);
        match self {
            UsageSource::Off => return Err(UsageError::Off),
            UsageSource::Files { path, keep } => read_files(path, *keep, &mut report)?,
            UsageSource::Stream { redis, stream } => read_stream(redis, stream, &mut report)?,
        }
        Ok(report)
    }
}

/// Adds up the events in the JSONL file `path` and its `keep` rotated
/// files into `report`. A file rotated while it is read is read once
/// (files are opened newest first and told apart by inode); a line that
/// is not an event — the one being written — is skipped. Files last
/// written before the query's start are not read.
pub fn read_files(path: &Path, keep: u32, report: &mut UsageReport) -> Result<(), UsageError> {
    let mut seen = HashSet::new();
    let mut files = Vec::new();
    for p in EventsConfig::files(path, keep) {
        let file = match File::open(&p) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return Err(UsageError::File { path: p, source }),
        };
        let meta = file.metadata().map_err(|source| UsageError::File { path: p.clone(), source })?;
        let written_ms = meta.mtime().saturating_mul(1000) + meta.mtime_nsec() / 1_000_000 + 1;
        if seen.insert((meta.dev(), meta.ino()))
            && Millis::try_from(written_ms).unwrap_or(0) >= report.query.from_ms
        {
            files.push((p, file));
        }
    }
    for (p, file) in files {
        for line in BufReader::new(file).split(b'\n') {
            let line = line.map_err(|source| UsageError::File { path: p.clone(), source })?;
            if let Ok(row) = serde_json::from_slice::<UsageRow>(&line) {
                report.add(&row);
            }
        }
    }
    Ok(())
}

/// How long after an event ends it may be written at the latest (the
/// writer's tick, a batch, a slow Redis): a stream read goes this far
/// past the query's end, its entries' ids being their write times.
const WRITE_LAG_MS: Millis = 60_000;

/// Entries read at a time.
const XRANGE_COUNT: usize = 10_000;

/// Adds up the events of the Redis stream `stream` into `report`, reading
/// the entries written from the query's start to its end (plus
/// [`WRITE_LAG_MS`]) by pages of `XRANGE`.
pub fn read_stream(
    redis: &hangar_redis::Redis,
    stream: &str,
    report: &mut UsageReport,
) -> Result<(), UsageError> {
    use hangar_redis::redis;
    type Entries = Vec<(String, Vec<(String, Vec<u8>)>)>;
    let end = report.query.to_ms.saturating_add(WRITE_LAG_MS);
    let mut start = format!("{}-0", report.query.from_ms);
    loop {
        let page: Entries = redis
            .run(|conn| {
                redis::cmd("XRANGE")
                    .arg(stream)
                    .arg(&start)
                    .arg(end)
                    .arg("COUNT")
                    .arg(XRANGE_COUNT)
                    .query(conn)
            })
            .map_err(|source| UsageError::Stream { stream: stream.to_owned(), source })?;
        for (_, fields) in &page {
            let event = fields.iter().find(|(k, _)| k == "e").map(|(_, v)| v.as_slice());
            if let Some(row) = event.and_then(|e| serde_json::from_slice::<UsageRow>(e).ok()) {
                report.add(&row);
            }
        }
        match page.last() {
            Some((id, _)) if page.len() == XRANGE_COUNT => start = format!("({id}"),
            _ => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_or_unix_seconds_and_refusals_name_their_parameter() {
        assert_eq!(parse_time("from", "1795788000"), Ok(1_795_788_000_000));
        assert_eq!(parse_time("from", "1795788000.25"), Ok(1_795_788_000_250));
        assert_eq!(parse_time("to", "2026-11-27T14:00:00Z"), Ok(1_795_788_000_000));
        assert_eq!(parse_time("to", "2026-11-27T15:00:00+01:00"), Ok(1_795_788_000_000));
        for bad in ["yesterday", "-5", "2026-13-01T00:00:00Z", "NaN", "", "1e20"] {
            let e = parse_time("from", bad).unwrap_err();
            assert!(e.to_string().starts_with("`from`:"), "{e}");
        }
        assert_eq!(rfc3339(1_795_788_000_999), "2026-11-27T14:00:00Z");
        assert_eq!(GroupBy::parse("hour"), Ok(GroupBy::Hour));
        assert!(GroupBy::parse("week").unwrap_err().to_string().contains("`group_by`: `week`"));
    }

    use crate::events::{EventSink, InferenceEvent, Target};
    use hangar_core::RequestKind;
    use proptest::prelude::*;

    fn event(i: u64, ts_ms: Millis, account: &str, model: &str) -> InferenceEvent {
        InferenceEvent {
            ts_ms,
            kind: RequestKind::Prediction,
            id: format!("p{i}"),
            account: account.parse().unwrap(),
            model: model.into(),
            replica: None,
            node: None,
            status: 200,
            code: (i % 5 == 0).then_some(ErrorCode::Timeout),
            queue_ms: 0,
            inference_ms: 1500,
            total_ms: 1500,
            ttft_ms: None,
            input_tokens: 10,
            output_tokens: i,
            tokens_estimated: true,
            images: i % 2,
            cost: Cost { usd: 0.25, neurons: 2.0 },
            queue_position: None,
            steps: Vec::new(),
        }
    }

    fn row(e: &InferenceEvent) -> UsageRow {
        serde_json::from_slice(&serde_json::to_vec(e).unwrap()).unwrap()
    }

    fn query(from_ms: Millis, to_ms: Millis, group_by: GroupBy) -> UsageQuery {
        UsageQuery { from_ms, to_ms, model: None, account: None, group_by }
    }

    proptest! {
        /// Against a model: each group holds exactly the rows in range of
        /// its key, and the total is the sum of the groups.
        #[test]
        fn a_report_adds_each_wanted_row_once_to_its_group(
            rows in proptest::collection::vec((0u64..3 * 86_400_000, 0usize..3, 0usize..2, 0u64..1000), 0..200),
            from in 0u64..86_400_000,
            len in 0u64..2 * 86_400_000,
            by in 0usize..4,
            only_model in proptest::option::of(0usize..3),
        ) {
            let (models, accounts) = (["a/x", "a/y", "b/z"], ["acme", "ops"]);
            let group_by = GroupBy::ALL[by].1;
            let mut q = query(from, from + len, group_by);
            q.model = only_model.map(|m| models[m].to_owned());
            let mut report = UsageReport::new(q.clone());
            let events: Vec<InferenceEvent> = rows
                .iter()
                .enumerate()
                .map(|(i, (ts, m, a, out))| {
                    let mut e = event(i as u64, *ts, accounts[*a], models[*m]);
                    e.output_tokens = *out;
                    e
                })
                .collect();
            for e in &events {
                report.add(&row(e));
            }
            let wanted: Vec<&InferenceEvent> = events
                .iter()
                .filter(|e| (q.from_ms..q.to_ms).contains(&e.ts_ms))
                .filter(|e| q.model.as_ref().is_none_or(|m| *m == e.model))
                .collect();
            let key = |e: &InferenceEvent| match group_by {
                GroupBy::Model => e.model.clone(),
                GroupBy::Account => e.account.to_string(),
                GroupBy::Day => rfc3339(e.ts_ms)[..10].to_owned(),
                GroupBy::Hour => rfc3339(e.ts_ms)[..13].to_owned() + ":00Z",
            };
            let groups = report.groups();
            let keys: std::collections::BTreeSet<String> = wanted.iter().map(|e| key(e)).collect();
            prop_assert_eq!(groups.iter().map(|g| g.group.clone()).collect::<Vec<_>>(), keys.into_iter().collect::<Vec<_>>());
            for g in &groups {
                let mine: Vec<&&InferenceEvent> = wanted.iter().filter(|e| key(e) == g.group).collect();
                prop_assert_eq!(g.totals.requests, mine.len() as u64);
                prop_assert_eq!(g.totals.errors, mine.iter().filter(|e| e.code.is_some()).count() as u64);
                prop_assert_eq!(g.totals.output_tokens, mine.iter().map(|e| e.output_tokens).sum::<u64>());
            }
            let total = report.total();
            prop_assert_eq!(total.requests, wanted.len() as u64);
            prop_assert_eq!(total.output_tokens, groups.iter().map(|g| g.totals.output_tokens).sum::<u64>());
            prop_assert!((total.usd - 0.25 * wanted.len() as f64).abs() < 1e-9);
            prop_assert!((total.seconds - 1.5 * wanted.len() as f64).abs() < 1e-9);
        }
    }

    #[test]
    fn the_current_and_rotated_files_are_read_and_a_torn_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let one = serde_json::to_vec(&event(10, 0, "acme", "a/x")).unwrap().len() as u64 + 1;
        // About four events a file; 30 events fill eight files, all kept.
        let target = Target::File { path: path.clone(), max_bytes: 4 * one, keep: 10 };
        let (sink, writer) = EventSink::start(target, 64);
        let day = 86_400_000;
        for i in 0..30 {
            let account = if i % 3 == 0 { "ops" } else { "acme" };
            sink.prediction(event(i, day + i * 60_000, account, "a/x"));
        }
        drop(sink);
        writer.join();
        assert!(EventsConfig::files(&path, 10).iter().filter(|f| f.exists()).count() >= 7);
        // The writer's torn last line, mid-write.
        use std::io::Write;
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"{\"ts_ms\":").unwrap();

        let mut report = UsageReport::new(query(0, u64::MAX, GroupBy::Account));
        read_files(&path, 10, &mut report).unwrap();
        let groups = report.groups();
        assert_eq!(
            groups.iter().map(|g| (g.group.as_str(), g.totals.requests)).collect::<Vec<_>>(),
            [("acme", 20), ("ops", 10)]
        );
        // A range: minutes 5 to 14 of the day.
        let mut report = UsageReport::new(query(day + 5 * 60_000, day + 15 * 60_000, GroupBy::Model));
        read_files(&path, 10, &mut report).unwrap();
        assert_eq!(report.total().requests, 10);
        // Without rotated files kept, only the current one's.
        let mut report = UsageReport::new(query(0, u64::MAX, GroupBy::Model));
        read_files(&path, 0, &mut report).unwrap();
        assert!(report.total().requests < 30);
        // No file yet: no usage, no error.
        let mut report = UsageReport::new(query(0, u64::MAX, GroupBy::Model));
        read_files(&dir.path().join("none.jsonl"), 3, &mut report).unwrap();
        assert_eq!(report.total(), Totals::default());
    }

    #[test]
    fn a_fleets_stream_is_read_by_time_range() {
        let Some(server) = hangar_redis::LocalRedis::for_test() else { return };
        let redis = hangar_redis::Redis::connect(&server.url()).unwrap();
        let target = Target::Redis { redis: redis.clone(), stream: "hangar:events".into(), max_len: 1000 };
        let (sink, writer) = EventSink::start(target, 64);
        let now = crate::serve::wall_ms();
        for i in 0..25 {
            // Twenty that ended ten minutes ago and before, one a minute;
            // five two hours ago.
            let (ts, model) = match i < 20 {
                true => (now - (i + 10) * 60_000, "a/x"),
                false => (now - 7_200_000 - i * 60_000, "b/z"),
            };
            sink.prediction(event(i, ts, "acme", model));
        }
        drop(sink);
        writer.join();
        let mut report = UsageReport::new(query(0, u64::MAX, GroupBy::Model));
        read_stream(&redis, "hangar:events", &mut report).unwrap();
        assert_eq!(report.groups().iter().map(|g| g.totals.requests).collect::<Vec<_>>(), [20, 5]);
        // The entries were written now: a range that ended an hour ago
        // reads none of them (the ids are write times, and only that range
        // is read), though the five oldest ended in it.
        let mut report = UsageReport::new(query(0, now - 3_600_000, GroupBy::Model));
        read_stream(&redis, "hangar:events", &mut report).unwrap();
        assert_eq!(report.total().requests, 0);
        // A range over their write time, filtered by their end times.
        let mut report = UsageReport::new(query(now - 15 * 60_000, now + 1, GroupBy::Model));
        read_stream(&redis, "hangar:events", &mut report).unwrap();
        assert_eq!(report.total().requests, 6);
    }
}
