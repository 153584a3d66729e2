//! A synchronous request's event, filled in as the request goes: opened
//! when the request has a model, told of its permit, its replica, each
//! frame of the answer, and finished once — by the gateway when it
//! answers an error, or by the relayed body when the answer ends.
//!
//! Nothing here parses on the way: frames are only searched for
//! `"usage"` (a `memmem`), and token estimates — which parse the request
//! and the answer — are made at the end, and only when the engine gave no
//! usage or the model is not trusted.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hangar_core::{AccountId, ReplicaId};
use memchr::memmem;
use serde::Deserialize;
use serde_json::Value;

use super::{estimate_tokens, EventKind, InferenceEvent, Outcome};
use crate::serve::{replica_name, ModelRuntime, Server};

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
    let at = memmem::find(frame, b"\"usage\"")?;
    let rest = &frame[at + 7..];
    let colon = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let rest = rest[colon..].strip_prefix(b":")?;
    serde_json::Deserializer::from_slice(rest).into_iter::<Option<Usage>>().next()?.ok().flatten()
}

/// A request's event in the making.
pub struct RequestRecord {
    server: Server,
    rt: Arc<ModelRuntime>,
    arrival: Instant,
    admitted: Option<Instant>,
    first_byte: Option<Instant>,
    /// The request body, for an input-token estimate.
    request: Bytes,
    usage: Option<Usage>,
    sse: bool,
    /// SSE events with data seen (each about one token).
    sse_events: u64,
    /// A non-streamed answer's frames, for an output-token estimate.
    answer: Option<Bytes>,
    answer_more: Vec<Bytes>,
    /// Taken when the event is sent.
    event: Option<InferenceEvent>,
}

/// Answers larger than this are not kept for an estimate (they are
/// estimated from what was kept).
const KEEP_ANSWER_BYTES: usize = 1 << 20;

impl RequestRecord {
    /// Opens the record of request `id` of `account` to `rt`, arrived at
    /// `arrival`; `None` when events are off.
    pub fn open(
        server: &Server,
        rt: &Arc<ModelRuntime>,
        id: String,
        account: AccountId,
        arrival: Instant,
        request: Bytes,
    ) -> Option<Self> {
        server.events().enabled().then(|| RequestRecord {
            server: server.clone(),
            rt: rt.clone(),
            arrival,
            admitted: None,
            first_byte: None,
            request,
            usage: None,
            sse: false,
            sse_events: 0,
            answer: None,
            answer_more: Vec::new(),
            event: Some(InferenceEvent {
                ts_ms: 0,
                kind: EventKind::Request,
                id,
                account,
                model: rt.config().key.to_string(),
                replica: None,
                node: None,
                outcome: Outcome::Succeeded,
                status: 200,
                error_code: None,
                queue_ms: 0,
                inference_ms: 0,
                total_ms: 0,
                ttft_ms: None,
                input_tokens: 0,
                output_tokens: 0,
                tokens_estimated: false,
                images: 0,
                cost: Default::default(),
            }),
        })
    }

    /// The request got its permit now (the first time counts).
    pub fn admitted(&mut self) {
        self.admitted.get_or_insert_with(Instant::now);
    }

    /// The request went to `replica` on `node`.
    pub fn replica(&mut self, replica: ReplicaId, node: Option<String>) {
        if let Some(e) = &mut self.event {
            e.replica = Some(replica_name(&self.rt.config().key, replica));
            e.node = node;
        }
    }

    /// The answer is an SSE stream.
    pub fn streamed(&mut self, sse: bool) {
        self.sse = sse;
    }

    /// A frame of the answer.
    pub fn frame(&mut self, data: &Bytes) {
        self.first_byte.get_or_insert_with(Instant::now);
        if self.usage.is_none() {
            self.usage = find_usage(data);
        }
        if self.sse {
            let events = memmem::find_iter(data, b"data:").count() as u64;
            let done = memmem::find_iter(data, b"[DONE]").count() as u64;
            self.sse_events += events.saturating_sub(done);
        } else if self.answer.is_none() {
            self.answer = Some(data.clone());
        } else if self.answer_more.iter().map(Bytes::len).sum::<usize>() < KEEP_ANSWER_BYTES {
            self.answer_more.push(data.clone());
        }
    }

    /// Ends the record with `status` (and `error`, when it failed or was
    /// cancelled) and sends the event; later calls do nothing. A record
    /// dropped unfinished ends as `canceled` (`client_gone`, status 499):
    /// its client went away.
    pub fn finish(&mut self, status: u16, error: Option<(Outcome, &'static str)>) {
        let Some(mut e) = self.event.take() else { return };
        let end = Instant::now();
        let ms = |d: std::time::Duration| d.as_millis() as u64;
        let billing = &self.rt.config().billing;
        e.ts_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        e.status = status;
        if let Some((outcome, code)) = error {
            e.outcome = outcome;
            e.error_code = Some(Cow::Borrowed(code));
        }
        let admitted = self.admitted.unwrap_or(end);
        e.queue_ms = ms(admitted - self.arrival);
        e.inference_ms = self.admitted.map_or(0, |a| ms(end - a));
        e.total_ms = ms(end - self.arrival);
        e.ttft_ms = self.first_byte.map(|f| ms(f - self.arrival));
        match self.usage.filter(|_| billing.trust_usage) {
            Some(u) => (e.input_tokens, e.output_tokens) = (u.prompt_tokens, u.completion_tokens),
            None if self.admitted.is_some() => {
                e.tokens_estimated = true;
                e.input_tokens = serde_json::from_slice::<Value>(&self.request)
                    .map_or(0, |v| estimate_tokens(&crate::serve::prompt_words(&v)));
                e.output_tokens = match self.sse {
                    true => self.sse_events,
                    false => estimate_answer(self.answer.as_ref(), &self.answer_more),
                };
            }
            None => {}
        }
        e.price(billing);
        self.server.events().send(e);
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        self.finish(CLIENT_GONE, Some((Outcome::Canceled, "client_gone")));
    }
}

/// The status of a request whose client left before its answer ended
/// (nginx's "client closed request").
pub const CLIENT_GONE: u16 = 499;

/// Words × 4/3 of a non-streamed answer's texts (`choices[].message.content`
/// or `choices[].text`).
fn estimate_answer(first: Option<&Bytes>, more: &[Bytes]) -> u64 {
    let Some(first) = first else { return 0 };
    let parsed: Option<Value> = match more.is_empty() {
        true => serde_json::from_slice(first).ok(),
        false => {
            let whole: Vec<u8> = std::iter::once(first).chain(more).flat_map(|b| b.iter().copied()).collect();
            serde_json::from_slice(&whole).ok()
        }
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
        assert_eq!(estimate_answer(Some(&one), &[]), 4 + 2);
        let (a, b) =
            (Bytes::from_static(br#"{"choices":[{"text":"#), Bytes::from_static(br#""a b c d e f"}]}"#));
        assert_eq!(estimate_answer(Some(&a), &[b]), 8);
        assert_eq!(estimate_answer(None, &[]), 0);
    }
}
