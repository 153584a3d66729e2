//! A synchronous request's event, in two halves: what the request path
//! keeps ([`RequestTrace`]) and what the writer thread makes of it
//! ([`RequestEnded::event`]).
//!
//! The request path only takes `Instant`s it reads anyway (for
//! `/metrics`), copies a few ids and keeps refcounted handles — the
//! request body, the answer's frames up to [`KEEP_ANSWER_BYTES`] — with
//! no parse, no search, no formatting and no allocation in the usual
//! case (a whole JSON answer). At its end the trace goes to the writer in
//! one `try_send`; the writer finds the engine's `usage` in the kept
//! frames, estimates tokens when it must (parsing the request and the
//! answer), names the replica, reads the wall clock, prices and
//! serializes.

use std::sync::Arc;
use std::time::Instant;

use axum::http::HeaderValue;
use bytes::Bytes;
use hangar_core::{AccountId, ErrorCode, ReplicaId, RequestKind};
use memchr::memmem;
use serde::Deserialize;
use serde_json::Value;

use super::sink::{Ended, EventSink, WallClock};
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

/// Finds and reads the `usage` object in `frame`, if the frame holds a
/// whole one (`"usage": null` reads as none).
pub fn find_usage(frame: &[u8]) -> Option<Usage> {
    let at = memmem::rfind(frame, b"\"usage\"")?;
    let rest = &frame[at + 7..];
    let colon = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let rest = rest[colon..].strip_prefix(b":")?;
    serde_json::Deserializer::from_slice(rest).into_iter::<Option<Usage>>().next()?.ok().flatten()
}

/// Bytes of a streamed answer kept for the writer; past them only the
/// last two frames are (where a stream's `usage` comes), and the rest
/// are counted.
pub const KEEP_ANSWER_BYTES: usize = 1 << 20;

/// What the request path keeps of an answer.
enum Answer {
    /// None came (refused, timed out, the client left first).
    None,
    /// A JSON answer read whole, as the replica sent it.
    Whole(Bytes),
    /// A streamed answer's frames (boxed: a stream is rare next to the
    /// frames it carries, and the trace stays small in the channel).
    Stream(Box<Frames>),
}

/// A streamed answer's frames, as the client got them.
struct Frames {
    /// An SSE stream (one token about per `data:` event).
    sse: bool,
    /// The first frames, up to [`KEEP_ANSWER_BYTES`].
    kept: Vec<Bytes>,
    bytes: usize,
    /// Frames past the cap: counted, not kept.
    past: u64,
    /// The last two frames past the cap (older first).
    tail: [Option<Bytes>; 2],
}

/// A synchronous request's event in the making, on the request path.
///
/// Made when the request has a model ([`EventSink::trace`]); ended once,
/// with what `/metrics` counts it as, by the request's
/// [`Tally`](crate::serve::Tally), which holds it.
pub struct RequestTrace {
    sink: EventSink,
    facts: RequestFacts,
}

/// What a trace holds; sent to the writer when the request ends.
pub(super) struct RequestFacts {
    rt: Arc<ModelRuntime>,
    /// `x-request-id`: the caller's or the gateway's.
    id: Option<HeaderValue>,
    account: AccountId,
    arrival: Instant,
    admitted: Option<Instant>,
    first_byte: Option<Instant>,
    replica: Option<(ReplicaId, Option<Arc<str>>)>,
    /// The request body, for an input-token estimate.
    request: Bytes,
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
    pub(super) fn new(
        sink: EventSink,
        rt: Arc<ModelRuntime>,
        id: Option<HeaderValue>,
        account: AccountId,
        arrival: Instant,
        request: Bytes,
    ) -> Self {
        let facts = RequestFacts {
            rt,
            id,
            account,
            arrival,
            admitted: None,
            first_byte: None,
            replica: None,
            request,
            answer: Answer::None,
        };
        RequestTrace { sink, facts }
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
    /// same renamed or not).
    pub fn whole(&mut self, answer: &Bytes) {
        self.facts.answer = Answer::Whole(answer.clone());
    }

    /// The answer is streamed (`sse`: as server-sent events).
    pub fn streaming(&mut self, sse: bool) {
        self.facts.answer = Answer::Stream(Box::new(Frames::new(sse)));
    }

    /// A frame of a streamed answer, as the client gets it.
    pub fn frame(&mut self, frame: &Bytes) {
        if let Answer::Stream(frames) = &mut self.facts.answer {
            frames.push(frame.clone());
        }
    }

    /// Ends the trace: the request was counted with `status` and `code`
    /// (none when it succeeded). Never blocks: a full channel drops the
    /// event and counts it.
    pub fn end(self, status: u16, code: Option<ErrorCode>) {
        let ended = RequestEnded { facts: self.facts, end: Instant::now(), status, code };
        self.sink.send(Ended::Request(ended));
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
            Answer::Whole(answer) => find_usage(answer),
            Answer::Stream(frames) => frames.usage(),
        };
        let (mut input_tokens, mut output_tokens, mut tokens_estimated) = (0, 0, false);
        match usage.filter(|_| config.billing.trust_usage) {
            Some(u) => (input_tokens, output_tokens) = (u.prompt_tokens, u.completion_tokens),
            None if f.admitted.is_some() => {
                tokens_estimated = true;
                input_tokens = serde_json::from_slice::<Value>(&f.request)
                    .map_or(0, |v| estimate_tokens(&prompt_words(&v)));
                output_tokens = match &f.answer {
                    Answer::None => 0,
                    Answer::Whole(answer) => estimate_answer(std::slice::from_ref(answer)),
                    Answer::Stream(frames) if frames.sse => frames.events(),
                    Answer::Stream(frames) => estimate_answer(&frames.kept),
                };
            }
            None => {}
        }
        let mut event = InferenceEvent {
            ts_ms: clock.unix_ms(end),
            kind: RequestKind::Sync,
            id: f.id.as_ref().and_then(|id| id.to_str().ok()).unwrap_or_default().to_owned(),
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

impl Frames {
    fn new(sse: bool) -> Self {
        Frames { sse, kept: Vec::new(), bytes: 0, past: 0, tail: [None, None] }
    }

    /// One more frame: kept below the cap, else counted (the last two
    /// kept).
    fn push(&mut self, frame: Bytes) {
        if self.bytes < KEEP_ANSWER_BYTES {
            self.bytes += frame.len();
            self.kept.push(frame);
        } else {
            self.past += 1;
            self.tail[0] = self.tail[1].replace(frame);
        }
    }

    /// The engine's `usage`, from the last two frames (newest first):
    /// where a stream carries it.
    fn usage(&self) -> Option<Usage> {
        let last = match self.past {
            0 => self.kept.iter().rev().take(2).collect::<Vec<_>>(),
            _ => self.tail.iter().rev().flatten().collect(),
        };
        last.into_iter().find_map(|frame| find_usage(frame))
    }

    /// SSE events with data (each about one token), `[DONE]` aside; past
    /// the cap each frame counts as one (engines send an event a frame).
    fn events(&self) -> u64 {
        let count = |frame: &Bytes| {
            let data = memmem::find_iter(frame, b"data:").count() as u64;
            data.saturating_sub(memmem::find_iter(frame, b"[DONE]").count() as u64)
        };
        let past_done = self.tail[1].as_ref().map_or(0, |f| memmem::find_iter(f, b"[DONE]").count() as u64);
        self.kept.iter().map(count).sum::<u64>() + self.past.saturating_sub(past_done)
    }
}

/// Words × 4/3 of a JSON answer's texts (`choices[].message.content` or
/// `choices[].text`), its frames joined.
fn estimate_answer(frames: &[Bytes]) -> u64 {
    let parsed: Option<Value> = match frames {
        [] => None,
        [one] => serde_json::from_slice(one).ok(),
        many => serde_json::from_slice(&many.concat()).ok(),
    };
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
    fn an_answer_without_usage_is_estimated_from_its_texts() {
        let one =
            Bytes::from_static(br#"{"choices":[{"message":{"content":"one two three"}},{"text":"four"}]}"#);
        assert_eq!(estimate_answer(&[one]), 4 + 2);
        let (a, b) =
            (Bytes::from_static(br#"{"choices":[{"text":"#), Bytes::from_static(br#""a b c d e f"}]}"#));
        assert_eq!(estimate_answer(&[a, b]), 8);
        assert_eq!(estimate_answer(&[]), 0);
    }

    fn stream(frames: &[&'static [u8]]) -> Frames {
        let mut f = Frames::new(true);
        frames.iter().for_each(|frame| f.push(Bytes::from_static(frame)));
        f
    }

    #[test]
    fn a_stream_counts_its_data_events_and_finds_its_usage_at_the_end() {
        let f = stream(&[
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[]}\n\n",
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2}}\n\n",
            b"data: [DONE]\n\n",
        ]);
        assert_eq!(f.events(), 3);
        let usage = f.usage().unwrap();
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (4, 2));
    }

    #[test]
    fn past_the_cap_frames_are_counted_and_the_last_two_kept() {
        static BIG: [u8; KEEP_ANSWER_BYTES] = [b' '; KEEP_ANSWER_BYTES];
        let mut frames: Vec<&'static [u8]> = vec![&BIG];
        frames.extend([&b"data: {}\n\n"[..]; 10]);
        frames.push(b"data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":11}}\n\n");
        frames.push(b"data: [DONE]\n\n");
        let f = stream(&frames);
        assert_eq!((f.kept.len(), f.past), (1, 12));
        // Ten events and the usage one; `[DONE]` is not a token.
        assert_eq!(f.events(), 11);
        let usage = f.usage().unwrap();
        assert_eq!(usage.completion_tokens, 11);
    }
}
