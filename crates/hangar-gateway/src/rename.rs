//! The model a client asked for, in place of the engine's own name for it.
//!
//! An engine names its model what it was started with: llama.cpp's server
//! the path of its weights (`/proc/self/fd/30` when they come from the
//! store), vLLM its `--model` unless told a `--served-model-name`. A client
//! that asked for `demo/chat` must read `"model": "demo/chat"` in the
//! answer, as OpenAI's API and its clients expect — so every `"model"`
//! field of a JSON answer or of an SSE stream's events is given the
//! model's key.
//!
//! An engine that already answers with the key (the mock engine, vLLM
//! with `--served-model-name {model}`) costs a search of each answer for
//! `"model"` and nothing else: no copy, no allocation. Only an answer
//! whose name differs is copied once, with the key put in.
//!
//! A `"model"` key can only appear as an object key: inside a JSON string
//! its quotes would be escaped. Model keys need no escaping in JSON
//! (ASCII letters, digits and `._-/`), so the key is written as is.

use std::sync::LazyLock;

use axum::body::Bytes;
use memchr::memmem::Finder;

static MODEL_FIELD: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"model\""));

/// `json` with the value of every `"model"` field that is a string other
/// than `key` replaced by `key`; `None` when there is none to replace.
/// A field whose string does not end within `json` is left as it is.
pub(crate) fn whole(json: &[u8], key: &str) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    let mut copied = 0;
    for at in MODEL_FIELD.find_iter(json) {
        if at < copied {
            continue;
        }
        let Some((start, end)) = string_value(json, at + MODEL_FIELD.needle().len()) else { continue };
        if &json[start..end] == key.as_bytes() {
            continue;
        }
        let out = out.get_or_insert_with(|| Vec::with_capacity(json.len() + key.len()));
        out.extend_from_slice(&json[copied..start]);
        out.extend_from_slice(key.as_bytes());
        copied = end;
    }
    out.map(|mut out| {
        out.extend_from_slice(&json[copied..]);
        out
    })
}

/// Where the string value after an object key ending at `from` lies
/// (`start..end`, between its quotes): `: "…"` with JSON whitespace
/// around the colon. `None` when what follows is not a string or does
/// not end within `json`.
fn string_value(json: &[u8], from: usize) -> Option<(usize, usize)> {
    let is_space = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let mut i = from + json.get(from..)?.iter().take_while(|b| is_space(b)).count();
    if json.get(i) != Some(&b':') {
        return None;
    }
    i += 1;
    i += json.get(i..)?.iter().take_while(|b| is_space(b)).count();
    if json.get(i) != Some(&b'"') {
        return None;
    }
    let start = i + 1;
    let mut j = start;
    while j < json.len() {
        match json[j] {
            b'\\' => j += 2,
            b'"' => return Some((start, j)),
            _ => j += 1,
        }
    }
    None
}

/// [`whole`] over an SSE stream that arrives in frames cut anywhere: each
/// complete line is renamed as it comes; a line cut by a frame's end waits
/// for the rest (an event's JSON is one `data:` line).
#[derive(Default)]
pub(crate) struct StreamRename {
    /// The start of a line whose end has not come yet.
    partial: Vec<u8>,
}

impl StreamRename {
    /// The bytes of `frame` to pass on now, renamed; `None` when all of it
    /// waits for the end of its line.
    pub fn frame(&mut self, frame: Bytes, key: &str) -> Option<Bytes> {
        if self.partial.is_empty() {
            // Engines send whole events: this is the usual way, zero-copy
            // when nothing is renamed.
            let lines = frame.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
            self.partial.extend_from_slice(&frame[lines..]);
            let head = frame.slice(..lines);
            return (!head.is_empty()).then(|| renamed(head, key));
        }
        self.partial.extend_from_slice(&frame);
        let lines = self.partial.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        let rest = self.partial.split_off(lines);
        let head = std::mem::replace(&mut self.partial, rest);
        (!head.is_empty()).then(|| renamed(Bytes::from(head), key))
    }

    /// What is left when the stream ends (a last line without its end),
    /// renamed.
    pub fn finish(&mut self, key: &str) -> Option<Bytes> {
        let rest = std::mem::take(&mut self.partial);
        (!rest.is_empty()).then(|| renamed(Bytes::from(rest), key))
    }

    /// Whether no bytes wait for the end of their line.
    pub fn is_empty(&self) -> bool {
        self.partial.is_empty()
    }
}

fn renamed(bytes: Bytes, key: &str) -> Bytes {
    whole(&bytes, key).map_or(bytes, Bytes::from)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn an_engines_name_becomes_the_key() {
        let body = br#"{"id":"c","model":"/proc/self/fd/30","choices":[]}"#;
        let out = whole(body, "demo/chat").unwrap();
        assert_eq!(out, br#"{"id":"c","model":"demo/chat","choices":[]}"#);
    }

    #[test]
    fn the_key_already_there_is_left_without_a_copy() {
        assert_eq!(whole(br#"{"model":"demo/chat","x":1}"#, "demo/chat"), None);
        assert_eq!(whole(br#"{"choices":[]}"#, "demo/chat"), None);
    }

    #[test]
    fn spaces_escapes_and_lookalikes() {
        let key = "k";
        assert_eq!(whole(br#"{"model" : "a\"b", "y": 2}"#, key).unwrap(), br#"{"model" : "k", "y": 2}"#);
        // Not a field: a value, a string's content, a number.
        assert_eq!(whole(br#"{"owned_by":"model","x":"say \"model\": \"q\""}"#, key), None);
        assert_eq!(whole(br#"{"model":7}"#, key), None);
        // A string that does not end here is left alone.
        assert_eq!(whole(br#"{"model":"/pro"#, key), None);
        // Every field, in nested objects too.
        assert_eq!(
            whole(br#"[{"model":"a"},{"model":"b"}]"#, key).unwrap(),
            br#"[{"model":"k"},{"model":"k"}]"#
        );
    }

    fn sse(names: &[String]) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, name) in names.iter().enumerate() {
            out.extend_from_slice(
                format!("data: {{\"id\":\"c\",\"model\":\"{name}\",\"choices\":[{{\"index\":{i}}}]}}\n\n")
                    .as_bytes(),
            );
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        out
    }

    proptest! {
        /// However a stream is cut into frames, what comes out is the
        /// whole stream renamed.
        #[test]
        fn frames_cut_anywhere_come_out_as_the_whole_stream_renamed(
            names in prop::collection::vec("[a-z/.]{0,20}", 0..6),
            cuts in prop::collection::vec(0usize..400, 0..12),
        ) {
            let key = "demo/chat";
            let stream = sse(&names);
            let expected = whole(&stream, key).unwrap_or_else(|| stream.clone());
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(stream.len())).collect();
            cuts.push(0);
            cuts.push(stream.len());
            cuts.sort_unstable();
            let mut rename = StreamRename::default();
            let mut out = Vec::new();
            for pair in cuts.windows(2) {
                if let Some(b) = rename.frame(Bytes::copy_from_slice(&stream[pair[0]..pair[1]]), key) {
                    out.extend_from_slice(&b);
                }
            }
            if let Some(b) = rename.finish(key) {
                out.extend_from_slice(&b);
            }
            prop_assert!(rename.is_empty());
            prop_assert_eq!(String::from_utf8_lossy(&out), String::from_utf8_lossy(&expected));
            let text = String::from_utf8_lossy(&out);
            prop_assert_eq!(text.matches("\"model\":\"demo/chat\"").count(), names.len());
        }
    }
}
