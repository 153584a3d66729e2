//! A synchronous request's event, in two halves: what the request path
//! keeps ([`RequestTrace`]) and what the writer thread makes of it
//! ([`RequestEnded::event`]).
//!
//! The request path takes the `Instant`s it reads anyway for `/metrics`
//! and copies a few small things into the trace; at the end, one
//! `try_send` hands the trace to the writer, which parses the engine's
//! `usage`, estimates tokens when it must (parsing the request and the
//! answer), names the replica, reads the wall clock, prices and
//! serializes.
//!
//! # Why copies, not `Bytes` handles
//! A `Bytes` handle is a reference count, but keeping one past the
//! request pins the buffer hyper read it into: hyper can then not reuse
//! that connection's read buffer and allocates a new one for the next
//! read (measured: the gateway's resident memory more than doubled and
//! its throughput fell in `hangar bench gateway`). So the request path
//! keeps only what the writer needs, copied, or a handle only while the
//! request runs:
//! - a whole JSON answer: its `usage` object, copied (a search of the
//!   answer for `"usage"` and at most [`USAGE_BYTES`] copied); with no
//!   usage, or a model that is not trusted, the answer itself, for an
//!   estimate;
//! - a streamed answer: the count of its SSE `data:` events and its last
//!   [`STREAM_TAIL_BYTES`] (where a stream's usage comes);
//! - the request body: a handle while the request runs (its buffer is
//!   held then anyway), and when it ends, only if an estimate may need it.
//!
//! What is kept for an estimate is copied when it is at most
//! [`COPY_UP_TO`] bytes; a larger body or answer is kept by handle.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hangar_core::{AccountId, ErrorCode, ReplicaId, RequestKind};
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

/// Finds and reads the last `usage` object in `text`, if `text` holds a
/// whole one (`"usage": null` reads as none).
pub fn find_usage(text: &[u8]) -> Option<Usage> {
    let (start, _) = usage_value(text)?;
    serde_json::Deserializer::from_slice(&text[start..]).into_iter::<Option<Usage>>().next()?.ok().flatten()
}

/// Where the value of the last `"usage"` key in `text` begins, and — when
/// it is an object that ends within `text` — where it ends.
fn usage_value(text: &[u8]) -> Option<(usize, Option<usize>)> {
    let at = memmem::rfind(text, b"\"usage\"")? + b"\"usage\"".len();
    let space = |b: &u8| b.is_ascii_whitespace();
    let colon = at + text[at..].iter().take_while(|b| space(b)).count();
    if text.get(colon) != Some(&b':') {
        return None;
    }
    let start = colon + 1 + text[colon + 1..].iter().take_while(|b| space(b)).count();
    Some((start, object_end(text, start)))
}

/// The end (one past its `}`) of the JSON object starting at `start`.
fn object_end(text: &[u8], start: usize) -> Option<usize> {
    if text.get(start) != Some(&b'{') {
        return None;
    }
    let (mut depth, mut in_string, mut escaped) = (0u32, false, false);
    for (i, b) in text[start..].iter().enumerate() {
        match (in_string, escaped, b) {
            (true, true, _) => escaped = false,
            (true, false, b'\\') => escaped = true,
            (true, false, b'"') => in_string = false,
            (true, false, _) => {}
            (false, _, b'"') => in_string = true,
            (false, _, b'{') => depth += 1,
            (false, _, b'}') => {
                depth -= 1;
                if depth == 0 {
                    return Some(start + i + 1);
                }
            }
            (false, _, _) => {}
        }
    }
    None
}

/// The longest `usage` object copied from a whole answer (OpenAI's, with
/// its token details, is about 230 bytes); a longer one makes the answer
/// kept whole, where the writer finds it all the same.
pub const USAGE_BYTES: usize = 256;

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

/// A small copy of bytes, inline (no allocation).
#[derive(Clone, Copy)]
struct Inline<const N: usize> {
    len: usize,
    bytes: [u8; N],
}

impl<const N: usize> Inline<N> {
    /// `from`, cut to its first `N` bytes.
    fn new(from: &[u8]) -> Self {
        let mut inline = Inline { len: from.len().min(N), bytes: [0; N] };
        inline.bytes[..inline.len].copy_from_slice(&from[..inline.len]);
        inline
    }

    fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// What the request path keeps of an answer.
///
/// The usage copy is inline on purpose: boxing it would cost the request
/// an allocation, and the writer a free on another thread's arena.
#[allow(clippy::large_enum_variant)]
enum Answer {
    /// None came (refused, timed out, the client left first).
    None,
    /// A whole answer's `usage` object, copied (the answer is not kept).
    Usage(Inline<USAGE_BYTES>),
    /// A whole answer kept for an estimate: it had no usage, or its model
    /// is not trusted.
    Whole(Bytes),
    /// A streamed answer (boxed: its tail is large next to a trace).
    Stream(Box<Tail>),
}

/// What is kept of a streamed answer, as the client got it.
struct Tail {
    /// An SSE stream (about one token per `data:` event).
    sse: bool,
    /// `data:` events seen.
    events: u64,
    /// Its last bytes (up to [`STREAM_TAIL_BYTES`]).
    last: Inline<STREAM_TAIL_BYTES>,
}

impl Tail {
    fn new(sse: bool) -> Self {
        Tail { sse, events: 0, last: Inline { len: 0, bytes: [0; STREAM_TAIL_BYTES] } }
    }

    /// One more frame: its events counted, its bytes appended to the tail.
    fn push(&mut self, frame: &[u8]) {
        if self.sse {
            self.events += memmem::find_iter(frame, b"data:").count() as u64;
        }
        let last = &mut self.last;
        if frame.len() >= STREAM_TAIL_BYTES {
            last.bytes.copy_from_slice(&frame[frame.len() - STREAM_TAIL_BYTES..]);
            last.len = STREAM_TAIL_BYTES;
        } else {
            let keep = (STREAM_TAIL_BYTES - frame.len()).min(last.len);
            last.bytes.copy_within(last.len - keep..last.len, 0);
            last.bytes[keep..keep + frame.len()].copy_from_slice(frame);
            last.len = keep + frame.len();
        }
    }

    /// SSE events with data, `[DONE]` aside (each about one token).
    fn tokens(&self) -> u64 {
        let done = memmem::find(self.last.as_slice(), b"[DONE]").is_some();
        self.events.saturating_sub(u64::from(done))
    }
}

/// A synchronous request's event in the making, on the request path.
///
/// Made when the request has a model ([`RequestTrace::start`]); ended
/// once, with what `/metrics` counts it as, by the request's
/// [`Tally`](crate::serve::Tally), which holds it.
pub struct RequestTrace {
    facts: RequestFacts,
}

/// What a trace holds; sent to the writer when the request ends.
pub(super) struct RequestFacts {
    rt: Arc<ModelRuntime>,
    /// `x-request-id`: the caller's or the gateway's, copied.
    id: Inline<ID_BYTES>,
    account: AccountId,
    arrival: Instant,
    admitted: Option<Instant>,
    first_byte: Option<Instant>,
    replica: Option<(ReplicaId, Option<Arc<str>>)>,
    /// The request body: a handle while the request runs; kept past its
    /// end only for an estimate.
    request: Option<Bytes>,
    answer: Answer,
}

/// A request that ended, on its way to the writer.
pub(super) struct RequestEnded {
    facts: RequestFacts,
    end: Instant,
    status: u16,
    code: Option<ErrorCode>,
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
            facts: RequestFacts {
                rt: rt.clone(),
                id: Inline::new(id),
                account,
                arrival,
                admitted: None,
                first_byte: None,
                replica: None,
                request: Some(request.clone()),
                answer: Answer::None,
            },
        })
    }

    /// The request got a permit `at` on `replica`, run by `node`: the
    /// first permit ends its wait; the last replica is the one named.
    pub fn admitted(&mut self, at: Instant, replica: ReplicaId, node: Option<Arc<str>>) {
        self.facts.admitted.get_or_insert(at);
        self.facts.replica = Some((replica, node));
    }

    /// The answer's first byte went out `at`.
    pub fn first_byte(&mut self, at: Instant) {
        self.facts.first_byte.get_or_insert(at);
    }

    /// The answer, read whole (as the replica sent it: its `usage` is the
    /// same renamed or not): its usage copied, or — with none, or for a
    /// model not trusted — the answer kept for an estimate.
    pub fn whole(&mut self, answer: &Bytes) {
        let usage = match self.facts.rt.config().billing.trust_usage {
            true => usage_value(answer).and_then(|(start, end)| Some(&answer[start..end?])),
            false => None,
        };
        self.facts.answer = match usage.filter(|u| u.len() <= USAGE_BYTES) {
            Some(usage) => Answer::Usage(Inline::new(usage)),
            None => Answer::Whole(keep(answer.clone())),
        };
    }

    /// The answer is streamed (`sse`: as server-sent events).
    pub fn streaming(&mut self, sse: bool) {
        self.facts.answer = Answer::Stream(Box::new(Tail::new(sse)));
    }

    /// A frame of a streamed answer, as the client gets it.
    pub fn frame(&mut self, frame: &[u8]) {
        if let Answer::Stream(tail) = &mut self.facts.answer {
            tail.push(frame);
        }
    }

    /// Ends the trace: the request was counted with `status` and `code`
    /// (none when it succeeded). Never blocks: a full channel drops the
    /// event and counts it.
    pub fn end(mut self, status: u16, code: Option<ErrorCode>) {
        let f = &mut self.facts;
        // The body outlives the request only if an estimate may read it.
        let estimate = f.admitted.is_some() && !matches!(f.answer, Answer::Usage(_));
        f.request = f.request.take().filter(|_| estimate).map(keep);
        // The model's sink, held while the trace moves into the channel.
        let rt = self.facts.rt.clone();
        rt.events.send(Ended::Request(RequestEnded { facts: self.facts, end: Instant::now(), status, code }));
    }
}

impl RequestEnded {
    /// The event, made by the writer thread: `clock` turns the request's
    /// instants into wall time.
    pub(super) fn event(self, clock: &WallClock) -> InferenceEvent {
        let RequestEnded { facts: f, end, status, code } = self;
        let config = f.rt.config();
        let ms = |d: std::time::Duration| d.as_millis() as u64;
        let usage = match &f.answer {
            Answer::None => None,
            Answer::Usage(usage) => serde_json::from_slice(usage.as_slice()).ok(),
            Answer::Whole(answer) => find_usage(answer),
            Answer::Stream(tail) => find_usage(tail.last.as_slice()),
        };
        let (mut input_tokens, mut output_tokens, mut tokens_estimated) = (0, 0, false);
        match usage.filter(|_| config.billing.trust_usage) {
            Some(u) => (input_tokens, output_tokens) = (u.prompt_tokens, u.completion_tokens),
            None if f.admitted.is_some() => {
                tokens_estimated = true;
                input_tokens = f
                    .request
                    .and_then(|r| serde_json::from_slice::<Value>(&r).ok())
                    .map_or(0, |v| estimate_tokens(&prompt_words(&v)));
                output_tokens = match &f.answer {
                    Answer::None | Answer::Usage(_) => 0,
                    Answer::Whole(answer) => estimate_answer(answer),
                    Answer::Stream(tail) if tail.sse => tail.tokens(),
                    // A streamed answer that is neither SSE nor JSON.
                    Answer::Stream(_) => 0,
                };
            }
            None => {}
        }
        let id = String::from_utf8_lossy(f.id.as_slice()).into_owned();
        let mut event = InferenceEvent {
            ts_ms: clock.unix_ms(end),
            kind: RequestKind::Sync,
            id,
            account: f.account,
            model: config.key.to_string(),
            replica: f.replica.as_ref().map(|(r, _)| replica_name(&config.key, *r)),
            node: f.replica.and_then(|(_, node)| node).map(|n| n.to_string()),
            status,
            code,
            queue_ms: ms(f.admitted.unwrap_or(end).saturating_duration_since(f.arrival)),
            inference_ms: f.admitted.map_or(0, |a| ms(end.saturating_duration_since(a))),
            total_ms: ms(end.saturating_duration_since(f.arrival)),
            ttft_ms: f.first_byte.map(|t| ms(t.saturating_duration_since(f.arrival))),
            input_tokens,
            output_tokens,
            tokens_estimated,
            images: 0,
            cost: Default::default(),
        };
        event.price(&config.billing);
        event
    }
}

/// Words × 4/3 of a JSON answer's texts (`choices[].message.content` or
/// `choices[].text`).
fn estimate_answer(answer: &[u8]) -> u64 {
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
    }

    #[test]
    fn a_usage_object_is_bounded_by_its_braces_whatever_its_strings_hold() {
        let json = br#"{"usage" : {"prompt_tokens":1,"x":{"y":"}\"{"},"completion_tokens":2}, "after": {}}"#;
        let (start, end) = usage_value(json).unwrap();
        let object = &json[start..end.unwrap()];
        assert_eq!(object, br#"{"prompt_tokens":1,"x":{"y":"}\"{"},"completion_tokens":2}"#);
        assert_eq!(usage_value(br#"{"usage":{"prompt_tokens":1"#), Some((9, None)));
        assert_eq!(usage_value(br#"{"usage":null}"#).map(|(_, end)| end), Some(None));
        assert!(usage_value(br#"{"usage" 3}"#).is_none());
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
        let usage = find_usage(tail.last.as_slice()).unwrap();
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (4, 2));
    }

    #[test]
    fn the_tail_is_the_last_bytes_whatever_the_frames() {
        let text: Vec<u8> = (0..5000u32).map(|i| b'a' + (i % 26) as u8).collect();
        for cut in [1, 7, 100, 1023, 1024, 1025, 3000] {
            let frames: Vec<&[u8]> = text.chunks(cut).collect();
            let tail = stream(&frames);
            assert_eq!(tail.last.as_slice(), &text[text.len() - STREAM_TAIL_BYTES..], "frames of {cut}");
        }
        let short = stream(&[b"ab", b"cd"]);
        assert_eq!(short.last.as_slice(), b"abcd");
    }
}
