//! Request traces: reading them, and what one request of a trace is.
//!
//! Two formats are read:
//! - **Mooncake-style JSONL**, one request per line: `timestamp` or
//!   `created_time` (ms), `input_length` or `input_tokens`, `output_length` or
//!   `output_tokens`, optional `hash_ids` (64-bit integers, each standing for
//!   `trace_block_size` prompt tokens; equal prefixes of ids mean equal
//!   prompt prefixes), optional `session_id` (string or integer) and `delay`
//!   or `delay_ms` (ms after the previous turn of the session completes),
//!   optional `model` (the model a whole-fleet simulation sends it to),
//!   optional `adapter` (the LoRA adapter it runs with, named under its
//!   `model`: the request is `MODEL:ADAPTER`) and `adapter_size` (its size
//!   in bytes, when the trace knows it). Traces without them read as
//!   before.
//! - **Azure LLM inference trace CSV**: header `TIMESTAMP,ContextTokens,
//!   GeneratedTokens`, timestamps like `2023-11-16 18:15:46.6805900`. Prompts
//!   carry no prefix information, so every request's tokens are its own.
//!
//! Every problem is reported with the file, the 1-based line and the field.

use std::borrow::Cow;
use std::fmt;

use hangar_core::AdapterName;
use rustc_hash::FxHashMap;
use serde::Deserialize;
use serde_json::{Map, Value};

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// Arrival in ms as written in the trace (not yet normalized).
    pub timestamp_ms: f64,
    /// Prompt tokens.
    pub input_len: u32,
    /// Output tokens to generate.
    pub output_len: u32,
    /// Prompt block ids (empty: the prompt shares nothing).
    pub hash_ids: Vec<u64>,
    /// The session this request is a turn of, as a dense index.
    pub session: Option<u32>,
    /// For a follow-up turn: ms between the previous turn's completion and
    /// this turn's arrival.
    pub delay_ms: f64,
    /// The model it names, if any (`model`).
    pub model: Option<String>,
    /// The LoRA adapter it runs with, under its model (`adapter`).
    pub adapter: Option<AdapterName>,
    /// The adapter's size in bytes, if the trace gives it (`adapter_size`).
    pub adapter_size: Option<u64>,
    /// Line in the source file (1-based), for messages.
    pub line: usize,
}

/// A whole trace, in file order.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// Where it came from (for messages and reports).
    pub source: String,
    /// The requests, in file order.
    pub requests: Vec<TraceRequest>,
    /// How many distinct sessions the requests belong to.
    pub sessions: u32,
}

/// A problem in a trace, located.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub struct TraceError {
    /// The file (or other source).
    pub source_name: String,
    /// 1-based line; 0 for the file as a whole.
    pub line: usize,
    /// The field at fault, if one is.
    pub field: Option<String>,
    /// What was wrong.
    pub why: String,
}

impl TraceError {
    /// A trace with no requests: nothing to replay.
    pub fn empty(source_name: &str) -> Self {
        Self {
            source_name: source_name.to_owned(),
            line: 0,
            field: None,
            why: "the trace holds no requests".into(),
        }
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: ", self.source_name, self.line)?;
        if let Some(field) = &self.field {
            write!(f, "field `{field}`: ")?;
        }
        f.write_str(&self.why)
    }
}

/// The formats [`read`] understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceFormat {
    /// Mooncake-style JSON lines.
    MooncakeJsonl,
    /// Azure LLM inference trace CSV.
    AzureCsv,
}

impl TraceFormat {
    /// Guesses the format from the first non-blank line: a CSV header starting
    /// with `TIMESTAMP` means Azure, anything else JSONL.
    pub fn detect(text: &str) -> Self {
        match text.lines().find(|l| !l.trim().is_empty()) {
            Some(l) => Self::of_first_line(l),
            None => Self::MooncakeJsonl,
        }
    }

    fn of_first_line(line: &str) -> Self {
        if line.trim_start().starts_with("TIMESTAMP") {
            Self::AzureCsv
        } else {
            Self::MooncakeJsonl
        }
    }
}

/// Parses a trace held in memory; `source_name` appears in errors.
pub fn read(text: &str, source_name: &str) -> Result<Trace, TraceError> {
    let mut rows = TraceRows::new(text.as_bytes(), source_name);
    let requests = rows.by_ref().collect::<Result<Vec<_>, _>>()?;
    if requests.is_empty() {
        return Err(TraceError::empty(source_name));
    }
    Ok(Trace { source: source_name.to_owned(), requests, sessions: rows.sessions() })
}

/// A trace read one row at a time, in file order, from any reader: what
/// [`read`] collects, and what a whole-fleet simulation streams so that a
/// trace of millions of rows never sits in memory at once.
///
/// The format is told by the first non-blank line ([`TraceFormat::detect`]).
/// After an error the iterator ends.
pub struct TraceRows<R> {
    reader: R,
    source: String,
    line: usize,
    buf: String,
    format: Option<Columns>,
    /// Session keys seen so far and their dense index; `None` when the
    /// reader was told sessions do not matter ([`without_sessions`](Self::without_sessions)).
    sessions: Option<FxHashMap<String, u32>>,
    done: bool,
}

/// Where a format's fields are.
enum Columns {
    Jsonl,
    /// Azure CSV: the header's width and the columns of the timestamp,
    /// prompt and output tokens.
    Csv {
        width: usize,
        ts: usize,
        input: usize,
        output: usize,
    },
}

impl<R: std::io::BufRead> TraceRows<R> {
    /// Rows of `reader`; `source_name` appears in errors.
    pub fn new(reader: R, source_name: &str) -> Self {
        TraceRows {
            reader,
            source: source_name.to_owned(),
            line: 0,
            buf: String::new(),
            format: None,
            sessions: Some(FxHashMap::default()),
            done: false,
        }
    }

    /// Rows without their sessions numbered (`session` is `None`): for a
    /// run that ignores them, so a trace of millions of one-turn sessions
    /// does not keep a map of their keys.
    pub fn without_sessions(mut self) -> Self {
        self.sessions = None;
        self
    }

    /// The name errors give the source.
    pub fn source_name(&self) -> &str {
        &self.source
    }

    /// Distinct sessions among the rows read so far.
    pub fn sessions(&self) -> u32 {
        self.sessions.as_ref().map_or(0, |s| s.len() as u32)
    }

    fn ctx(&self) -> LineCtx<'_> {
        LineCtx { source: &self.source, line: self.line }
    }

    /// The next non-blank line into `buf`, without its line break.
    fn next_line(&mut self) -> Option<Result<(), TraceError>> {
        loop {
            self.buf.clear();
            match self.reader.read_line(&mut self.buf) {
                Ok(0) => return None,
                Ok(_) => self.line += 1,
                Err(e) => {
                    self.line += 1;
                    return Some(Err(self.ctx().err(None, format!("cannot be read: {e}"))));
                }
            }
            let trimmed = self.buf.trim_end_matches(['\n', '\r']).len();
            self.buf.truncate(trimmed);
            if !self.buf.trim().is_empty() {
                return Some(Ok(()));
            }
        }
    }

    fn row(&mut self) -> Option<Result<TraceRequest, TraceError>> {
        if let Err(e) = self.next_line()? {
            return Some(Err(e));
        }
        if self.format.is_none() {
            if TraceFormat::of_first_line(&self.buf) == TraceFormat::AzureCsv {
                // The header: the rows follow it.
                return match csv_header(&self.buf, &self.ctx()) {
                    Ok(columns) => {
                        self.format = Some(columns);
                        self.row()
                    }
                    Err(e) => Some(Err(e)),
                };
            }
            self.format = Some(Columns::Jsonl);
        }
        let ctx = LineCtx { source: &self.source, line: self.line };
        Some(match self.format.as_ref().expect("set above") {
            Columns::Jsonl => jsonl_row(&self.buf, &ctx, self.sessions.as_mut()),
            &Columns::Csv { width, ts, input, output } => {
                csv_row(&self.buf, &ctx, width, [ts, input, output])
            }
        })
    }
}

impl<R: std::io::BufRead> Iterator for TraceRows<R> {
    type Item = Result<TraceRequest, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let row = self.row();
        self.done = !matches!(row, Some(Ok(_)));
        row
    }
}

struct LineCtx<'a> {
    source: &'a str,
    line: usize,
}

impl LineCtx<'_> {
    fn err(&self, field: Option<&str>, why: impl Into<String>) -> TraceError {
        TraceError {
            source_name: self.source.to_owned(),
            line: self.line,
            field: field.map(str::to_owned),
            why: why.into(),
        }
    }

    /// The value under the first of `names` present, or an error naming the
    /// first (canonical) name.
    fn field<'v, 'n>(
        &self,
        obj: &'v Map<String, Value>,
        names: &[&'n str],
    ) -> Result<(&'n str, &'v Value), TraceError> {
        for &n in names {
            if let Some(v) = obj.get(n) {
                return Ok((n, v));
            }
        }
        Err(self.err(Some(names[0]), format!("missing (also accepted: {})", names[1..].join(", "))))
    }

    fn count(&self, obj: &Map<String, Value>, names: &[&str]) -> Result<u32, TraceError> {
        let (name, v) = self.field(obj, names)?;
        v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| {
            self.err(Some(name), format!("expected a token count (0 to {}), found {v}", u32::MAX))
        })
    }

    fn millis(&self, name: &str, v: &Value) -> Result<f64, TraceError> {
        v.as_f64()
            .filter(|t| t.is_finite() && *t >= 0.0)
            .ok_or_else(|| self.err(Some(name), format!("expected milliseconds ≥ 0, found {v}")))
    }
}

/// A session's key as a row spells it.
#[cfg_attr(test, derive(Debug, PartialEq))]
enum SessionKey<'a> {
    Str(Cow<'a, str>),
    Num(serde_json::Number),
}

/// One JSONL row's fields, before sessions get their dense index.
#[cfg_attr(test, derive(Debug, PartialEq))]
struct Row<'a> {
    timestamp_ms: f64,
    input_len: u32,
    output_len: u32,
    hash_ids: Vec<u64>,
    session: Option<SessionKey<'a>>,
    delay_ms: f64,
    model: Option<String>,
    adapter: Option<AdapterName>,
    adapter_size: Option<u64>,
}

/// One JSONL row, its session numbered in `sessions` (when kept).
fn jsonl_row(
    raw: &str,
    ctx: &LineCtx<'_>,
    sessions: Option<&mut FxHashMap<String, u32>>,
) -> Result<TraceRequest, TraceError> {
    let row = match FastRow::parse(raw) {
        Some(row) => row,
        None => parse_row(raw, ctx)?,
    };
    let session = sessions.zip(row.session).map(|(sessions, key)| {
        let next = sessions.len() as u32;
        match key {
            SessionKey::Str(s) => match sessions.get(s.as_ref()) {
                Some(&known) => known,
                None => *sessions.entry(s.into_owned()).or_insert(next),
            },
            SessionKey::Num(n) => *sessions.entry(n.to_string()).or_insert(next),
        }
    });
    Ok(TraceRequest {
        timestamp_ms: row.timestamp_ms,
        input_len: row.input_len,
        output_len: row.output_len,
        hash_ids: row.hash_ids,
        session,
        delay_ms: row.delay_ms,
        model: row.model,
        adapter: row.adapter,
        adapter_size: row.adapter_size,
        line: ctx.line,
    })
}

/// A row read straight into its fields, without building a JSON map: the
/// common case of a trace, several times faster. It takes only rows whose
/// reading cannot differ from [`parse_row`]'s — an object, each field at
/// most once, every value of the expected type and range — and leaves
/// everything else (aliases spelled twice, nulls where a value is needed,
/// numeric session ids, any error) to `parse_row`, the one place that
/// decides and words what a row means.
#[derive(Deserialize, Default)]
#[serde(default)]
struct FastRow<'a> {
    timestamp: Field<f64>,
    created_time: Field<f64>,
    input_length: Field<u64>,
    input_tokens: Field<u64>,
    output_length: Field<u64>,
    output_tokens: Field<u64>,
    hash_ids: Option<Vec<u64>>,
    #[serde(borrow)]
    session_id: Option<Cow<'a, str>>,
    delay: Field<f64>,
    delay_ms: Field<f64>,
    #[serde(borrow)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    adapter: Option<Cow<'a, str>>,
    adapter_size: Field<u64>,
}

/// A field as a row has it: absent, `null`, or a value (`Option` would
/// not tell the first two apart).
#[derive(Default)]
enum Field<T> {
    #[default]
    Absent,
    Null,
    Value(T),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Field<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Option::<T>::deserialize(d)?.map_or(Field::Null, Field::Value))
    }
}

impl<T> Field<T> {
    /// This field, or `alias` if this one is absent: the first name
    /// present counts, `null` or not, as in [`parse_row`].
    fn or(self, alias: Self) -> Self {
        match self {
            Field::Absent => alias,
            present => present,
        }
    }

    fn value(self) -> Option<T> {
        match self {
            Field::Value(v) => Some(v),
            Field::Absent | Field::Null => None,
        }
    }
}

impl<'a> FastRow<'a> {
    fn parse(raw: &'a str) -> Option<Row<'a>> {
        // A struct would also read a JSON array, positionally.
        if !raw.trim_start().starts_with('{') {
            return None;
        }
        let r: FastRow<'a> = serde_json::from_str(raw).ok()?;
        let millis = |v: f64| (v.is_finite() && v >= 0.0).then_some(v);
        let count = |v: Field<u64>, alias| u32::try_from(v.or(alias).value()?).ok();
        Some(Row {
            timestamp_ms: millis(r.timestamp.or(r.created_time).value()?)?,
            input_len: count(r.input_length, r.input_tokens)?,
            output_len: count(r.output_length, r.output_tokens)?,
            hash_ids: r.hash_ids.unwrap_or_default(),
            session: r.session_id.map(SessionKey::Str),
            delay_ms: match r.delay.or(r.delay_ms) {
                Field::Absent | Field::Null => 0.0,
                Field::Value(v) => millis(v)?,
            },
            model: match r.model {
                None => None,
                Some(m) if !m.is_empty() => Some(m.into_owned()),
                Some(_) => return None,
            },
            adapter_size: match (&r.adapter, r.adapter_size) {
                (_, Field::Absent | Field::Null) => None,
                (Some(_), Field::Value(b)) => Some(b),
                (None, Field::Value(_)) => return None,
            },
            adapter: match r.adapter {
                None => None,
                Some(a) => Some(a.parse().ok()?),
            },
        })
    }
}

/// Reads a row through a JSON map, naming the field at fault in any error.
fn parse_row(raw: &str, ctx: &LineCtx<'_>) -> Result<Row<'static>, TraceError> {
    let obj: Map<String, Value> =
        serde_json::from_str(raw).map_err(|e| ctx.err(None, format!("not a JSON object: {e}")))?;
    let (ts_name, ts) = ctx.field(&obj, &["timestamp", "created_time"])?;
    let timestamp_ms = ctx.millis(ts_name, ts)?;
    let input_len = ctx.count(&obj, &["input_length", "input_tokens"])?;
    let output_len = ctx.count(&obj, &["output_length", "output_tokens"])?;
    let hash_ids = match obj.get("hash_ids") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(ids)) => ids
            .iter()
            .enumerate()
            .map(|(k, v)| {
                v.as_u64().ok_or_else(|| {
                    ctx.err(Some("hash_ids"), format!("element {k} is {v}, not a 64-bit unsigned integer"))
                })
            })
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(ctx.err(Some("hash_ids"), format!("expected an array of integers, found {v}"))),
    };
    let session = match obj.get("session_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(SessionKey::Str(Cow::Owned(s.clone()))),
        Some(Value::Number(n)) => Some(SessionKey::Num(n.clone())),
        Some(v) => {
            return Err(ctx.err(Some("session_id"), format!("expected a string or integer, found {v}")))
        }
    };
    let delay_ms = match ["delay", "delay_ms"].iter().find_map(|n| obj.get(*n).map(|v| (*n, v))) {
        None | Some((_, Value::Null)) => 0.0,
        Some((name, v)) => ctx.millis(name, v)?,
    };
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) if !m.is_empty() => Some(m.clone()),
        Some(v) => return Err(ctx.err(Some("model"), format!("expected a model key, found {v}"))),
    };
    let adapter = match obj.get("adapter") {
        None | Some(Value::Null) => None,
        Some(Value::String(a)) => {
            Some(a.parse::<AdapterName>().map_err(|e| ctx.err(Some("adapter"), e.to_string()))?)
        }
        Some(v) => {
            return Err(ctx.err(
                Some("adapter"),
                format!("expected an adapter name (e.g. \"acme/support-v2\"), found {v}"),
            ))
        }
    };
    let adapter_size = match obj.get("adapter_size") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let bytes = v.as_u64().ok_or_else(|| {
                ctx.err(Some("adapter_size"), format!("expected the adapter's size in bytes, found {v}"))
            })?;
            if adapter.is_none() {
                return Err(ctx.err(Some("adapter_size"), "given without an `adapter`"));
            }
            Some(bytes)
        }
    };
    Ok(Row { timestamp_ms, input_len, output_len, hash_ids, session, delay_ms, model, adapter, adapter_size })
}

/// The columns an Azure CSV header names.
fn csv_header(header: &str, ctx: &LineCtx<'_>) -> Result<Columns, TraceError> {
    let cols: Vec<&str> = header.split(',').map(str::trim).collect();
    let find = |name: &str| {
        cols.iter()
            .position(|c| *c == name)
            .ok_or_else(|| ctx.err(Some(name), format!("missing column; the header is `{header}`")))
    };
    Ok(Columns::Csv {
        width: cols.len(),
        ts: find("TIMESTAMP")?,
        input: find("ContextTokens")?,
        output: find("GeneratedTokens")?,
    })
}

/// One Azure CSV row; `[ts, input, output]` are its columns.
fn csv_row(
    raw: &str,
    ctx: &LineCtx<'_>,
    width: usize,
    [ts, input, output]: [usize; 3],
) -> Result<TraceRequest, TraceError> {
    let fields: Vec<&str> = raw.split(',').map(str::trim).collect();
    if fields.len() != width {
        return Err(ctx.err(None, format!("expected {width} fields, found {}", fields.len())));
    }
    let timestamp_ms = parse_datetime_ms(fields[ts]).ok_or_else(|| {
        ctx.err(Some("TIMESTAMP"), format!("`{}` is not `YYYY-MM-DD HH:MM:SS[.f]`", fields[ts]))
    })?;
    let num = |col: usize, name: &str| {
        fields[col]
            .parse::<u32>()
            .map_err(|_| ctx.err(Some(name), format!("`{}` is not a token count", fields[col])))
    };
    Ok(TraceRequest {
        timestamp_ms,
        input_len: num(input, "ContextTokens")?,
        output_len: num(output, "GeneratedTokens")?,
        hash_ids: Vec::new(),
        session: None,
        delay_ms: 0.0,
        model: None,
        adapter: None,
        adapter_size: None,
        line: ctx.line,
    })
}

/// Milliseconds since 1970-01-01 of a `YYYY-MM-DD HH:MM:SS[.fraction]` UTC
/// time stamp.
fn parse_datetime_ms(s: &str) -> Option<f64> {
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (hh, mm, ss) = (t.next()??, t.next()??, t.next()??);
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    let frac_s = if frac.is_empty() {
        0.0
    } else {
        if !frac.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        format!("0.{frac}").parse::<f64>().ok()?
    };
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hh * 3600 + mm * 60 + ss;
    Some(secs as f64 * 1000.0 + frac_s * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mooncake_rows_with_aliases_and_sessions() {
        let text = r#"{"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": [1, 2]}

{"created_time": 7.5, "input_tokens": 3, "output_tokens": 1, "session_id": "a", "delay_ms": 100}
{"timestamp": 9, "input_length": 3, "output_length": 1, "session_id": 4, "delay": 3}
{"timestamp": 9, "input_length": 3, "output_length": 1, "session_id": "a"}
"#;
        let t = read(text, "t.jsonl").unwrap();
        assert_eq!(t.requests.len(), 4);
        assert_eq!(t.requests[0].hash_ids, vec![1, 2]);
        assert_eq!(t.requests[1].timestamp_ms, 7.5);
        assert_eq!(t.requests[1].delay_ms, 100.0);
        assert_eq!(t.requests[1].line, 3);
        assert_eq!(
            (t.requests[1].session, t.requests[2].session, t.requests[3].session),
            (Some(0), Some(1), Some(0))
        );
        assert_eq!(t.sessions, 2);
    }

    #[test]
    fn the_direct_read_of_a_row_agrees_with_the_map_or_leaves_it_to_the_map() {
        let taken = [
            r#"{"timestamp":172,"input_length":2720,"output_length":55,"hash_ids":[0,1,2,3,64,65],"session_id":"s0"}"#,
            r#" {"created_time": 7.5, "input_tokens": 3, "output_tokens": 1, "delay_ms": 100, "x": [1, {"y": null}]}"#,
            r#"{"timestamp": 1e3, "input_length": 1, "output_length": 0, "hash_ids": null, "session_id": "a\"b\u00e9"}"#,
            r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "delay": null, "delay_ms": 5, "model": "m"}"#,
            r#"{"timestamp": 0, "created_time": -1, "input_length": 1, "output_length": 1}"#,
            r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "model": "m", "adapter": "acme/x", "adapter_size": 5}"#,
            r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "adapter": "a", "adapter_size": null}"#,
        ];
        let left = [
            r#"{"timestamp": null, "created_time": 5, "input_length": 1, "output_length": 1}"#,
            r#"{"timestamp": 5, "input_length": 3.0, "output_length": 1}"#,
            r#"{"timestamp": 5, "input_length": 4294967296, "output_length": 1}"#,
            r#"{"timestamp": -0.5, "input_length": 1, "output_length": 1}"#,
            r#"{"timestamp": 5, "input_length": 1, "output_length": 1, "session_id": 4}"#,
            r#"{"timestamp": 5, "input_length": 1, "output_length": 1, "model": ""}"#,
            r#"{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [1, -2]}"#,
            r#"{"timestamp": 5, "timestamp": 6, "input_length": 1, "output_length": 1}"#,
            r#"[5, 1, 1]"#,
            r#"{"timestamp": 5, "output_length": 1}"#,
            r#"{"timestamp": 0, "input_length": 1, "input_tokens": "x", "output_length": 1}"#,
            r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "adapter": "a b"}"#,
            r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "adapter_size": 5}"#,
            r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "adapter": "a", "adapter_size": -5}"#,
        ];
        let ctx = LineCtx { source: "t.jsonl", line: 1 };
        for raw in taken {
            let fast = FastRow::parse(raw).unwrap_or_else(|| panic!("not read directly: {raw}"));
            assert_eq!(Ok(fast), parse_row(raw, &ctx), "{raw}");
        }
        for raw in left {
            assert!(FastRow::parse(raw).is_none(), "read directly: {raw}");
        }
        let dup = read(left[7], "t.jsonl").unwrap();
        assert_eq!(dup.requests[0].timestamp_ms, 6.0, "the map keeps a repeated field's last value");
        assert_eq!(read(left[4], "t.jsonl").unwrap().sessions, 1);
        assert_eq!(
            read(left[10], "t.jsonl").unwrap().requests[0].input_len,
            1,
            "an alias behind its name is not read"
        );
    }

    #[test]
    fn bad_lines_name_file_line_and_field() {
        let e = |text: &str| read(text, "t.jsonl").unwrap_err().to_string();
        assert_eq!(
            e("{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1}\n{\"timestamp\": 1, \"output_length\": 1}"),
            "t.jsonl:2: field `input_length`: missing (also accepted: input_tokens)"
        );
        assert_eq!(
            e(r#"{"timestamp": -1, "input_length": 1, "output_length": 1}"#),
            "t.jsonl:1: field `timestamp`: expected milliseconds ≥ 0, found -1"
        );
        assert_eq!(
            e(r#"{"timestamp": 0, "input_length": "12", "output_length": 1}"#),
            "t.jsonl:1: field `input_length`: expected a token count (0 to 4294967295), found \"12\""
        );
        assert_eq!(
            e(r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, -2]}"#),
            "t.jsonl:1: field `hash_ids`: element 1 is -2, not a 64-bit unsigned integer"
        );
        assert!(e("{not json").starts_with("t.jsonl:1: not a JSON object"));
        assert_eq!(
            e(r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "adapter": "a:b"}"#),
            "t.jsonl:1: field `adapter`: adapter name `a:b` has the character ':' at byte 1; allowed are ASCII \
             letters, digits and ._-/"
        );
        assert_eq!(
            e(r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "adapter": 7}"#),
            "t.jsonl:1: field `adapter`: expected an adapter name (e.g. \"acme/support-v2\"), found 7"
        );
        assert_eq!(
            e(r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "adapter_size": 5}"#),
            "t.jsonl:1: field `adapter_size`: given without an `adapter`"
        );
        assert_eq!(
            e(
                r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "adapter": "a", "adapter_size": "5MB"}"#
            ),
            "t.jsonl:1: field `adapter_size`: expected the adapter's size in bytes, found \"5MB\""
        );
        assert_eq!(e("\n\n"), "t.jsonl:0: the trace holds no requests");
    }

    #[test]
    fn reads_azure_csv() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n";
        let t = read(text, "a.csv").unwrap();
        assert_eq!(t.requests.len(), 2);
        let gap = t.requests[1].timestamp_ms - t.requests[0].timestamp_ms;
        assert!((gap - 4314.579).abs() < 1e-3, "{gap}");
        assert_eq!(parse_datetime_ms("1970-01-02 00:00:00"), Some(86_400_000.0));
        let e =
            read("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-01 00:00:00,1,1\n", "a.csv").unwrap_err();
        assert_eq!(
            e.to_string(),
            "a.csv:2: field `TIMESTAMP`: `2023-13-01 00:00:00` is not `YYYY-MM-DD HH:MM:SS[.f]`"
        );
        let e =
            read("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-01 00:00:00,x,1\n", "a.csv").unwrap_err();
        assert_eq!(e.to_string(), "a.csv:2: field `ContextTokens`: `x` is not a token count");
    }
}
