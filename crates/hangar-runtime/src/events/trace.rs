//! A synchronous request's event, in two halves: what the request path
//! keeps ([`RequestTrace`]) and what the writer thread makes of it
//! ([`RequestEnded::event`]).
//!
//! The request path takes the `Instant`s it reads anyway for `/metrics`
//! and keeps a few small things in the trace; at the end, one `try_send`
//! hands a compact [`RequestEnded`] to the writer, which estimates tokens
//! when it must (parsing the request and the answer), names the replica
//! and its node, reads the wall clock, prices and serializes.
//!
//! # What the request path keeps, and why
//! Measured with `hangar bench gateway`, three things cost the gateway:
//! - A `Bytes` handle kept past the request pins the buffer hyper read it
//!   into: hyper then cannot reuse that connection's read buffer and
//!   allocates a new one for the next read (the gateway's resident memory
//!   more than doubled). So a handle on the request body is kept only
//!   while the request runs (its buffer is held then anyway), and past
//!   its end only what an estimate needs is kept, copied up to
//!   [`COPY_UP_TO`] bytes (by handle beyond).
//! - Every byte of what is sent crosses to the writer's core, and the
//!   trace is moved with the request's tally several times: the message
//!   is kept small (times as microseconds from arrival, the request id
//!   inline when short, what an estimate needs boxed).
//! - An allocation freed by the writer is freed on another thread's
//!   arena: the usual request allocates nothing for its event.
//!
//! So a whole JSON answer's `usage` is read on the request path (one
//! search for `"usage"` and a parse of that small object), and a streamed
//! answer's SSE `data:` events are counted as they pass and its last
//! [`STREAM_TAIL_BYTES`] kept, where its usage chunk comes.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use bytes::Bytes;
use hangar_core::{AccountId, ErrorCode, Progress, ReplicaId, RequestKind, StepAt};
use memchr::memmem;
use serde::Deserialize;
use serde_json::Value;

use super::sink::{Ended, WallClock};
use super::{estimate_tokens, InferenceEvent};
use crate::serve::{prompt_words, replica_name, ModelRuntime};

/// The engine's `usage` object (OpenAI's shape).
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Generated tokens (absent for embeddings).
    #[serde(default)]
    pub completion_tokens: u64,
}

const USAGE_KEY: &[u8] = b"\"usage\"";

/// Finds and reads the last `usage` object in `text`, if `text` holds a
/// whole one (`"usage": null` reads as none).
///
/// It runs on the request path for every whole answer, so it reads the
/// object in one pass rather than through serde (which cost about a
/// microsecond a request, measured): the integers of its top-level
/// `prompt_tokens` and `completion_tokens` (absent: 0), nested objects
/// and strings stepped over.
pub fn find_usage(text: &[u8]) -> Option<Usage> {
    // The searcher is built once: building it is most of a search's cost
    // on an answer of a few hundred bytes.
    static USAGE: LazyLock<memmem::FinderRev<'static>> = LazyLock::new(|| memmem::FinderRev::new(USAGE_KEY));
    let at = USAGE.rfind(text)? + USAGE_KEY.len();
    let colon = at + spaces(&text[at..]);
    if text.get(colon) != Some(&b':') {
        return None;
    }
    let start = colon + 1 + spaces(&text[colon + 1..]);
    read_usage(&text[start..])
}

/// JSON whitespace at the start of `text`.
fn spaces(text: &[u8]) -> usize {
    text.iter().take_while(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r')).count()
}

/// The usage object at the start of `text`; `None` unless it is an object
/// that ends within `text` and whose token counts are integers.
fn read_usage(text: &[u8]) -> Option<Usage> {
    if text.first() != Some(&b'{') {
        return None;
    }
    let mut usage = Usage { prompt_tokens: 0, completion_tokens: 0 };
    let (mut i, mut depth) = (0, 0usize);
    while let Some(&b) = text.get(i) {
        i += 1;
        match b {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return Some(usage);
                }
            }
            b'"' => {
                let start = i;
                while *text.get(i)? != b'"' {
                    i += if text[i] == b'\\' { 2 } else { 1 };
                }
                let name = &text[start..i];
                i += 1;
                // A key of the usage object itself, followed by its value.
                let colon = i + spaces(text.get(i..)?);
                if depth != 1 || text.get(colon) != Some(&b':') {
                    continue;
                }
                let count = match name {
                    b"prompt_tokens" => &mut usage.prompt_tokens,
                    b"completion_tokens" => &mut usage.completion_tokens,
                    _ => continue,
                };
                let value = colon + 1 + spaces(text.get(colon + 1..)?);
                let digits = text.get(value..)?.iter().take_while(|b| b.is_ascii_digit()).count();
                *count = std::str::from_utf8(&text[value..value + digits]).ok()?.parse().ok()?;
                i = value + digits;
            }
            _ => {}
        }
    }
    None
}

/// The end of a streamed answer kept for the writer: where its `usage`
/// chunk and `[DONE]` come.
pub const STREAM_TAIL_BYTES: usize = 1024;

/// A body or answer kept for an estimate is copied up to this size, kept
/// by handle beyond it.
pub const COPY_UP_TO: usize = 64 << 10;

/// The longest request id kept (the gateway's guard takes none longer).
const ID_BYTES: usize = 128;

/// `bytes`, kept past the request: copied when small (see the module's
/// doc), else by handle.
fn keep(bytes: Bytes) -> Bytes {
    match bytes.len() <= COPY_UP_TO {
        true => Bytes::copy_from_slice(&bytes),
        false => bytes,
    }
}

/// A request id: inline when short (the gateway's own are 16 hex
/// digits), else on the heap.
#[derive(Debug, Clone, PartialEq)]
enum RequestId {
    Short { len: u8, bytes: [u8; SHORT_ID] },
    Long(Box<[u8]>),
}

/// The longest request id kept inline.
const SHORT_ID: usize = 22;

impl RequestId {
    fn new(id: &[u8]) -> Self {
        let id = &id[..id.len().min(ID_BYTES)];
        match id.len() <= SHORT_ID {
            true => {
                let mut bytes = [0; SHORT_ID];
                bytes[..id.len()].copy_from_slice(id);
                RequestId::Short { len: id.len() as u8, bytes }
            }
            false => RequestId::Long(id.into()),
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            RequestId::Short { len, bytes } => &bytes[..usize::from(*len)],
            RequestId::Long(bytes) => bytes,
        }
    }
}

/// What the request path keeps of an answer while the request runs.
enum Answer {
    /// None came (refused, timed out, the client left first).
    None,
    /// A whole answer's `usage`, read (the answer is not kept).
    Usage(Usage),
    /// A whole answer kept for an estimate: it had no usage, or its model
    /// is not trusted.
    Whole(Bytes),
    /// A streamed answer (boxed: its tail is large next to a trace).
    Stream(Box<Tail>),
}

/// What an estimate reads, kept past the request (boxed: rare).
struct Kept {
    request: Option<Bytes>,
    answer: Option<Bytes>,
    tail: Option<Box<Tail>>,
}

/// What is kept of a streamed answer, as the client got it.
struct Tail {
    /// An SSE stream (about one token per `data:` event).
    sse: bool,
    /// `data:` events seen.
    events: u64,
    /// Its last bytes: `last[..len]`, up to [`STREAM_TAIL_BYTES`].
    len: usize,
    last: [u8; STREAM_TAIL_BYTES],
}

impl Tail {
    fn new(sse: bool) -> Self {
        Tail { sse, events: 0, len: 0, last: [0; STREAM_TAIL_BYTES] }
    }

    fn bytes(&self) -> &[u8] {
        &self.last[..self.len]
    }

    /// One more frame: its events counted, its bytes appended to the tail.
    fn push(&mut self, frame: &[u8]) {
        if self.sse {
            self.events += memmem::find_iter(frame, b"data:").count() as u64;
        }
        if frame.len() >= STREAM_TAIL_BYTES {
            self.last.copy_from_slice(&frame[frame.len() - STREAM_TAIL_BYTES..]);
            self.len = STREAM_TAIL_BYTES;
        } else {
            let keep = (STREAM_TAIL_BYTES - frame.len()).min(self.len);
            self.last.copy_within(self.len - keep..self.len, 0);
            self.last[keep..keep + frame.len()].copy_from_slice(frame);
            self.len = keep + frame.len();
        }
    }

    /// SSE events with data, `[DONE]` aside (each about one token).
    fn tokens(&self) -> u64 {
        let done = memmem::find(self.bytes(), b"[DONE]").is_some();
        self.events.saturating_sub(u64::from(done))
    }
}

/// A synchronous request's event in the making, on the request path.
///
/// Made when the request has a model ([`RequestTrace::start`]); ended
/// once, with what `/metrics` counts it as, by the request's
/// [`Tally`](crate::serve::Tally), which holds it.
pub struct RequestTrace {
    facts: Facts,
    /// The request body, while the request runs.
    request: Option<Bytes>,
    answer: Answer,
    /// Its position in the line when it joined it (none: a permit was
    /// free on arrival). Beside the facts, not among them: there it would
    /// grow the message past [`MESSAGE_BYTES`].
    queued_at: Option<NonZeroU32>,
}

/// What a request's event knows of it from its start: on its trace while
/// it runs, then on the message to the writer.
pub(super) struct Facts {
    rt: Arc<ModelRuntime>,
    /// `x-request-id`: the caller's or the gateway's.
    id: RequestId,
    account: AccountId,
    arrival: Instant,
    /// Arrival to the first permit, µs.
    admitted_us: Option<u32>,
    /// Arrival to the answer's first byte, µs.
    first_byte_us: Option<u32>,
    /// The last replica it went to (the writer names it and its node).
    replica: Option<ReplicaId>,
}

/// A request that ended, on its way to the writer: what its event needs,
/// small (a `size_of` test holds it to [`MESSAGE_BYTES`]).
pub(super) struct RequestEnded {
    facts: Facts,
    total_us: u32,
    status: u16,
    code: Option<ErrorCode>,
    queued_at: Option<NonZeroU32>,
    usage: Option<Usage>,
    /// What an estimate reads: none when the engine's usage is taken (or
    /// the request never got a permit).
    kept: Option<Box<Kept>>,
}

/// The most a [`RequestEnded`] may weigh.
pub const MESSAGE_BYTES: usize = 160;

/// Microseconds from `from` to `to`, saturated.
fn micros(from: Instant, to: Instant) -> u32 {
    u32::try_from(to.saturating_duration_since(from).as_micros()).unwrap_or(u32::MAX)
}

impl RequestTrace {
    /// The trace of request `id` of `account` to `rt`, arrived at
    /// `arrival` with `request`; `None` when events are off.
    pub fn start(
        rt: &Arc<ModelRuntime>,
        id: &[u8],
        account: AccountId,
        arrival: Instant,
        request: &Bytes,
    ) -> Option<Self> {
        rt.events.enabled().then(|| RequestTrace {
            facts: Facts {
                rt: rt.clone(),
                id: RequestId::new(id),
                account,
                arrival,
                admitted_us: None,
                first_byte_us: None,
                replica: None,
            },
            queued_at: None,
            request: Some(request.clone()),
            answer: Answer::None,
        })
    }

    /// The request got a permit `at` on `replica`, having waited in the
    /// line from `queued_at` (its position then) or not: the first permit
    /// ends its wait and says whether it queued; the last replica is the
    /// one named.
    pub fn admitted(&mut self, at: Instant, replica: ReplicaId, queued_at: Option<NonZeroU32>) {
        let f = &mut self.facts;
        if f.admitted_us.is_none() {
            f.admitted_us = Some(micros(f.arrival, at));
            self.queued_at = queued_at;
        }
        f.replica = Some(replica);
    }

    /// The answer's first byte went out `at`.
    pub fn first_byte(&mut self, at: Instant) {
        let f = &mut self.facts;
        f.first_byte_us.get_or_insert(micros(f.arrival, at));
    }

    /// The answer, read whole (as the replica sent it: its `usage` is the
    /// same renamed or not): its usage read, or — with none, or for a
    /// model not trusted — the answer kept for an estimate.
    pub fn whole(&mut self, answer: &Bytes) {
        let usage = self.facts.rt.config().billing.trust_usage.then(|| find_usage(answer)).flatten();
        self.answer = match usage {
            Some(usage) => Answer::Usage(usage),
            None => Answer::Whole(keep(answer.clone())),
        };
    }

    /// The answer is streamed (`sse`: as server-sent events).
    pub fn streaming(&mut self, sse: bool) {
        self.answer = Answer::Stream(Box::new(Tail::new(sse)));
    }

    /// A frame of a streamed answer, as the client gets it.
    pub fn frame(&mut self, frame: &[u8]) {
        if let Answer::Stream(tail) = &mut self.answer {
            tail.push(frame);
        }
    }

    /// Ends the trace: the request was counted with `status` and `code`
    /// (none when it succeeded). Never blocks: a full channel drops the
    /// event and counts it.
    pub fn end(self, status: u16, code: Option<ErrorCode>) {
        let total_us = micros(self.facts.arrival, Instant::now());
        let (usage, answer, tail) = match self.answer {
            Answer::None => (None, None, None),
            Answer::Usage(usage) => (Some(usage), None, None),
            Answer::Whole(answer) => (None, Some(answer), None),
            Answer::Stream(tail) => (None, None, Some(tail)),
        };
        // The body outlives the request only if an estimate may read it.
        let kept = (self.facts.admitted_us.is_some() && usage.is_none())
            .then(|| Box::new(Kept { request: self.request.map(keep), answer, tail }));
        let queued_at = self.queued_at;
        let ended = RequestEnded { facts: self.facts, total_us, status, code, queued_at, usage, kept };
        // The model's sink, held while the trace moves into the channel.
        let rt = ended.facts.rt.clone();
        rt.events.send(Ended::Request(ended));
    }
}

impl RequestEnded {
    /// The event, made by the writer thread: `clock` turns the request's
    /// instants into wall time, `replicas` names replicas and their nodes.
    pub(super) fn event(self, clock: &WallClock, replicas: &mut ReplicaNames) -> InferenceEvent {
        let RequestEnded { facts: f, total_us, status, code, queued_at, usage, kept } = self;
        let config = f.rt.config();
        let ms = |us: u32| u64::from(us) / 1000;
        let (mut input_tokens, mut output_tokens, mut tokens_estimated) = (0, 0, false);
        let usage = usage.or_else(|| {
            let kept = kept.as_deref()?;
            match (&kept.answer, &kept.tail) {
                (Some(answer), _) => find_usage(answer),
                (_, Some(tail)) => find_usage(tail.bytes()),
                _ => None,
            }
        });
        match (usage.filter(|_| config.billing.trust_usage), &kept) {
            (Some(u), _) => (input_tokens, output_tokens) = (u.prompt_tokens, u.completion_tokens),
            (None, Some(kept)) => {
                tokens_estimated = true;
                input_tokens = kept
                    .request
                    .as_ref()
                    .and_then(|r| serde_json::from_slice::<Value>(r).ok())
                    .map_or(0, |v| estimate_tokens(&prompt_words(&v)));
                output_tokens = match (&kept.answer, &kept.tail) {
                    (Some(answer), _) => estimate_answer(answer),
                    (_, Some(tail)) if tail.sse => tail.tokens(),
                    // No answer, or a stream that is neither SSE nor JSON.
                    _ => 0,
                };
            }
            (None, None) => {}
        }
        let end = f.arrival + std::time::Duration::from_micros(u64::from(total_us));
        let (replica, node) = match f.replica {
            Some(r) => replicas.name(&f.rt, r),
            None => (None, None),
        };
        let ts_ms = clock.unix_ms(end);
        let steps = steps(&f, queued_at, total_us, code, replica.as_deref(), |us| {
            clock.unix_ms(f.arrival + std::time::Duration::from_micros(u64::from(us)))
        });
        let mut event = InferenceEvent {
            ts_ms,
            kind: RequestKind::Sync,
            id: String::from_utf8_lossy(f.id.as_bytes()).into_owned(),
            account: f.account,
            model: config.key.to_string(),
            replica,
            node,
            status,
            code,
            queue_ms: ms(f.admitted_us.unwrap_or(total_us)),
            inference_ms: f.admitted_us.map_or(0, |a| ms(total_us.saturating_sub(a))),
            total_ms: ms(total_us),
            ttft_ms: f.first_byte_us.map(ms),
            input_tokens,
            output_tokens,
            tokens_estimated,
            images: 0,
            cost: Default::default(),
            queue_position: queued_at.map(NonZeroU32::get),
            steps,
        };
        event.price(&config.billing);
        event
    }
}

/// A synchronous request's [`Progress`] from its facts: received on
/// arrival; queued then too, at its position, if no permit was free;
/// dispatched to `replica` with its first permit; running from its first
/// byte; completed — or error with `code` — at its end, `total_us` after
/// arrival. `unix_ms` turns µs after arrival into wall time.
fn steps(
    f: &Facts,
    queued_at: Option<NonZeroU32>,
    total_us: u32,
    code: Option<ErrorCode>,
    replica: Option<&str>,
    unix_ms: impl Fn(u32) -> u64,
) -> Vec<StepAt> {
    let at = |us: u32, step: Progress| StepAt { at_ms: unix_ms(us), step };
    let mut steps = vec![at(0, Progress::Received)];
    if let Some(position) = queued_at {
        steps.push(at(0, Progress::Queued { position: position.get() }));
    }
    if let (Some(us), Some(replica)) = (f.admitted_us, replica) {
        steps.push(at(us, Progress::Dispatched { replica: replica.to_owned() }));
    }
    if let Some(us) = f.first_byte_us {
        steps.push(at(us, Progress::Running));
    }
    steps.push(at(total_us, code.map_or(Progress::Completed, |code| Progress::Error { code: Some(code) })));
    steps
}

/// The writer's names of replicas (`<model>:<id>`) and of their nodes,
/// remembered: made once per replica, not per event, and a replica that
/// failed is gone from its model's table by the time its last requests'
/// events are made.
#[derive(Default)]
pub(super) struct ReplicaNames(HashMap<ReplicaId, (String, Option<String>)>);

impl ReplicaNames {
    /// Replicas remembered at most (then the memory starts over).
    const MAX: usize = 4096;

    /// `replica` of `rt`'s model: its name, and its node when known.
    fn name(&mut self, rt: &ModelRuntime, replica: ReplicaId) -> (Option<String>, Option<String>) {
        match self.0.get(&replica) {
            // A node unknown when first named may be known now.
            Some((name, None)) => {
                let node = rt.replica_node(replica);
                let known = (Some(name.clone()), node.clone());
                if node.is_some() {
                    self.0.insert(replica, (name.clone(), node));
                }
                known
            }
            Some((name, node)) => (Some(name.clone()), node.clone()),
            None => {
                if self.0.len() >= Self::MAX {
                    self.0.clear();
                }
                let (name, node) = (replica_name(&rt.config().key, replica), rt.replica_node(replica));
                self.0.insert(replica, (name.clone(), node.clone()));
                (Some(name), node)
            }
        }
    }
}

/// Words × 4/3 of a JSON answer's texts (`choices[].message.content` or
/// `choices[].text`).
pub fn estimate_answer(answer: &[u8]) -> u64 {
    let parsed: Option<Value> = serde_json::from_slice(answer).ok();
    let Some(choices) = parsed.as_ref().and_then(|v| v.get("choices")).and_then(Value::as_array) else {
        return 0;
    };
    choices
        .iter()
        .filter_map(|c| c.pointer("/message/content").or_else(|| c.get("text")).and_then(Value::as_str))
        .map(estimate_tokens)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_found_in_a_json_answer_and_an_sse_chunk() {
        let json = br#"{"id":"x","choices":[{"text":"hi"}],"usage": {"prompt_tokens":12,"completion_tokens":5,"total_tokens":17}}"#;
        let u = find_usage(json).unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (12, 5));
        let sse = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":9}}\n\ndata: [DONE]\n\n";
        assert_eq!(find_usage(sse).unwrap().completion_tokens, 9);
        assert!(find_usage(br#"{"usage":null}"#).is_none());
        assert!(find_usage(br#"{"choices":[]}"#).is_none());
        // Cut in the middle: no usage rather than a wrong one.
        assert!(find_usage(br#"{"usage":{"prompt_tokens":3,"compl"#).is_none());
        assert!(find_usage(br#"{"usage":{"prompt_tokens":"3"}}"#).is_none());
    }

    /// The one-pass reader against serde on usage objects as engines
    /// write them, and on noisy ones: nested details, strings holding
    /// braces and quotes, the same names deeper down, any spacing.
    #[test]
    fn the_usage_reader_agrees_with_serde() {
        #[derive(Deserialize)]
        struct Whole {
            usage: Option<Usage>,
        }
        for json in [
            r#"{"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10,"prompt_tokens_details":{"cached_tokens":0}}}"#,
            r#"{"usage": {"prompt_tokens": 9, "total_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": null}}"#,
            r#"{"usage":{"prompt_tokens":19,"completion_tokens":10,"total_tokens":29,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}"#,
            r#"{"usage":{"x":{"prompt_tokens":99,"y":"}\"{"},"note":"\"completion_tokens\": 5","completion_tokens":7,"z":[{"completion_tokens":8}]}}"#,
            "{\"usage\"\n:\t{ \"completion_tokens\" :\r\n 12 }}",
            r#"{"usage":{"prompt_tokens":18446744073709551615}}"#,
            r#"{"usage":{}}"#,
        ] {
            let expected = serde_json::from_str::<Whole>(json).unwrap().usage.unwrap();
            let read = find_usage(json.as_bytes()).unwrap_or_else(|| panic!("none in {json}"));
            assert_eq!(
                (read.prompt_tokens, read.completion_tokens),
                (expected.prompt_tokens, expected.completion_tokens),
                "{json}"
            );
        }
    }

    #[test]
    fn what_crosses_to_the_writer_is_small() {
        let size = std::mem::size_of::<RequestEnded>();
        assert!(size <= MESSAGE_BYTES, "a RequestEnded weighs {size} bytes");
        assert_eq!(RequestId::new(b"00000000000000ab").as_bytes(), b"00000000000000ab");
        let long = [b'x'; 200];
        assert_eq!(RequestId::new(&long).as_bytes(), &long[..ID_BYTES]);
    }

    #[test]
    fn an_answer_without_usage_is_estimated_from_its_texts() {
        let one = br#"{"choices":[{"message":{"content":"one two three"}},{"text":"four"}]}"#;
        assert_eq!(estimate_answer(one), 4 + 2);
        assert_eq!(estimate_answer(b"not json"), 0);
    }

    fn stream(frames: &[&[u8]]) -> Tail {
        let mut tail = Tail::new(true);
        frames.iter().for_each(|frame| tail.push(frame));
        tail
    }

    #[test]
    fn a_stream_counts_its_data_events_and_keeps_its_end_for_the_usage() {
        let tail = stream(&[
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[]}\n\n",
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2}}\n\n",
            b"data: [DONE]\n\n",
        ]);
        assert_eq!(tail.tokens(), 3);
        let usage = find_usage(tail.bytes()).unwrap();
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (4, 2));
    }

    #[test]
    fn the_tail_is_the_last_bytes_whatever_the_frames() {
        let text: Vec<u8> = (0..5000u32).map(|i| b'a' + (i % 26) as u8).collect();
        for cut in [1, 7, 100, 1023, 1024, 1025, 3000] {
            let frames: Vec<&[u8]> = text.chunks(cut).collect();
            let tail = stream(&frames);
            assert_eq!(tail.bytes(), &text[text.len() - STREAM_TAIL_BYTES..], "frames of {cut}");
        }
        let short = stream(&[b"ab", b"cd"]);
        assert_eq!(short.bytes(), b"abcd");
    }
}
