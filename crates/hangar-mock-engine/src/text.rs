//! The mock's tokenizer and its deterministic output text.
//!
//! Real engines tokenize with the model's vocabulary; the mock only needs
//! token *counts* that behave like a real tokenizer's (longer text, more
//! tokens; equal text, equal tokens, so prefix caching works on repeated
//! prompts) and output that is the same every time. Text is split into
//! words, punctuation marks and runs of whitespace, each one token whose id
//! is a hash of the piece. Output token *i* of a request is a word drawn by
//! hashing the prompt's hash with *i*.

use hangar_core::mix64;

/// Words the mock "generates".
const VOCABULARY: &[&str] = &[
    "the",
    "hangar",
    "serves",
    "models",
    "on",
    "a",
    "fleet",
    "of",
    "accelerators",
    "and",
    "every",
    "request",
    "finds",
    "its",
    "replica",
    "quickly",
    "while",
    "tokens",
    "stream",
    "back",
    "to",
    "users",
    "who",
    "wait",
    "for",
    "answers",
    "from",
    "warm",
    "caches",
    "with",
    "prefixes",
    "shared",
    "across",
    "turns",
    "in",
    "time",
];

/// Token ids of `text`.
pub fn tokenize(text: &str) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(text.len() / 4 + 1);
    let mut start = None;
    let flush = |tokens: &mut Vec<u32>, piece: &str| tokens.push(piece_id(piece));
    for (i, c) in text.char_indices() {
        if c.is_alphanumeric() {
            start.get_or_insert(i);
            continue;
        }
        if let Some(s) = start.take() {
            flush(&mut tokens, &text[s..i]);
        }
        if !c.is_whitespace() {
            flush(&mut tokens, &text[i..i + c.len_utf8()]);
        }
    }
    if let Some(s) = start {
        flush(&mut tokens, &text[s..]);
    }
    tokens
}

fn piece_id(piece: &str) -> u32 {
    let h =
        piece.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    (h % 128_000) as u32
}

/// A stable 64-bit identity of a token sequence.
pub fn fingerprint(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0x243f_6a88_85a3_08d3, |h, &t| mix64(h, u64::from(t)))
}

/// The text of output token `index` of a request whose prompt has
/// `fingerprint`; tokens after the first start with a space.
pub fn output_piece(fingerprint: u64, index: u32) -> String {
    let word = VOCABULARY[(mix64(fingerprint, u64::from(index)) % VOCABULARY.len() as u64) as usize];
    if index == 0 {
        word.to_owned()
    } else {
        format!(" {word}")
    }
}

/// A deterministic unit-length embedding of `tokens` with `dims` dimensions.
pub fn embedding(tokens: &[u32], dims: usize) -> Vec<f32> {
    let seed = fingerprint(tokens);
    let mut v: Vec<f32> =
        (0..dims).map(|i| ((mix64(seed, i as u64) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(f32::MIN_POSITIVE);
    v.iter_mut().for_each(|x| *x /= norm);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_counts_words_and_punctuation() {
        assert_eq!(tokenize("Hello, world!").len(), 4);
        assert_eq!(tokenize("  "), Vec::<u32>::new());
        assert_eq!(tokenize("same words"), tokenize("same   words"));
        assert_ne!(tokenize("a b"), tokenize("b a"));
    }

    #[test]
    fn output_and_embeddings_are_deterministic() {
        let f = fingerprint(&tokenize("hi"));
        assert_eq!(output_piece(f, 3), output_piece(f, 3));
        assert!(output_piece(f, 1).starts_with(' '));
        let e = embedding(&[1, 2, 3], 16);
        assert_eq!(e, embedding(&[1, 2, 3], 16));
        assert!((e.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-4);
    }
}
