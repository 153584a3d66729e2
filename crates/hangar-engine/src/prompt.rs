//! Prompts as the schedulers see them: a token count plus enough identity to
//! tell which prefixes two prompts share.
//!
//! Tokens are kept run-length encoded ([`TokenRun`]): a live request is one
//! run per token id, while a replayed trace row — which names its prompt by
//! `hash_ids`, one per `trace_block_size` tokens — is one run per hash id,
//! each standing for that many copies of the id (the convention of Dynamo's
//! replay, so cache hits line up with its reports). Tokens a trace does not
//! describe (an Azure row has no `hash_ids`) are unique to their request.
//!
//! From the runs a prompt derives the chained [`BlockHash`]es of its full
//! blocks once, at construction: the vLLM scheduler and the KV-aware router
//! both need them, and they must agree.

use hangar_core::{mix64, BlockHash, ROOT_BLOCK_HASH};

/// `count` consecutive tokens that all have the id `token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenRun {
    /// The token id (or a trace hash id standing for a block of tokens).
    pub token: u64,
    /// How many tokens the run covers; never 0.
    pub count: u32,
}

/// A request's prompt: its length, its tokens as runs, and the chained hashes
/// of its full `block_size`-token blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    len: u32,
    runs: Vec<TokenRun>,
    block_size: u32,
    blocks: Vec<BlockHash>,
}

/// Why a trace row cannot become a prompt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{len} input tokens need {needed} hash ids of {trace_block_size} tokens, found {found}")]
pub struct PromptError {
    len: u32,
    needed: usize,
    found: usize,
    trace_block_size: u32,
}

impl Prompt {
    /// A prompt of explicit token ids (the live engine's case).
    pub fn from_tokens(tokens: &[u32], block_size: u32) -> Self {
        let runs = tokens.iter().map(|&t| TokenRun { token: u64::from(t), count: 1 }).collect();
        Self::from_runs(tokens.len() as u32, runs, block_size)
    }

    /// A prompt described by a trace row: `hash_ids[i]` stands for tokens
    /// `[i·trace_block_size, (i+1)·trace_block_size)`. With no hash ids at
    /// all, every token is unique to `salt` (a per-request value). A row
    /// whose hash ids cover fewer than `len` tokens is an error.
    pub fn from_trace(
        len: u32,
        hash_ids: &[u64],
        trace_block_size: u32,
        block_size: u32,
        salt: u64,
    ) -> Result<Self, PromptError> {
        if hash_ids.is_empty() {
            return Ok(Self::unique(len, block_size, salt));
        }
        let needed = (len as usize).div_ceil(trace_block_size.max(1) as usize);
        if hash_ids.len() < needed {
            return Err(PromptError { len, needed, found: hash_ids.len(), trace_block_size });
        }
        let mut remaining = len;
        let runs = hash_ids
            .iter()
            .take(needed)
            .map(|&h| {
                let count = remaining.min(trace_block_size);
                remaining -= count;
                // Keep trace ids apart from the ids of unique tokens.
                TokenRun { token: mix64(h, 0x7472_6163_6569_6473), count }
            })
            .collect();
        Ok(Self::from_runs(len, runs, block_size))
    }

    /// A prompt of `len` tokens shared with no other request: `len` copies
    /// of a token id of its own. Prefix sharing only depends on which
    /// tokens are equal at equal positions, so one run says it all, and
    /// keeps a long trace prompt as small as its caches' keys.
    pub fn unique(len: u32, block_size: u32, salt: u64) -> Self {
        let runs = if len == 0 {
            Vec::new()
        } else {
            vec![TokenRun { token: mix64(salt, 0x756e_6971), count: len }]
        };
        Self::from_runs(len, runs, block_size)
    }

    /// Builds from runs in canonical form (adjacent equal tokens merged), so
    /// that equal token sequences always yield equal block hashes.
    fn from_runs(len: u32, mut runs: Vec<TokenRun>, block_size: u32) -> Self {
        // Merged in place: a replay builds one prompt per request.
        runs.dedup_by(|next, kept| {
            let same = next.token == kept.token;
            if same {
                kept.count += next.count;
            }
            same
        });
        let mut blocks = Vec::with_capacity((len / block_size) as usize);
        let mut parent = ROOT_BLOCK_HASH;
        for content in chunk_contents(&runs, block_size) {
            parent = parent.chain(content);
            blocks.push(parent);
        }
        Self { len, runs, block_size, blocks }
    }

    /// Prompt length in tokens.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether the prompt has no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The block size the block hashes were computed for.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Chained hashes of the prompt's full blocks, in order.
    pub fn blocks(&self) -> &[BlockHash] {
        &self.blocks
    }

    /// Takes the block hashes, dropping the rest.
    pub fn into_blocks(self) -> Vec<BlockHash> {
        self.blocks
    }

    /// The prompt's tokens as runs.
    pub fn runs(&self) -> &[TokenRun] {
        &self.runs
    }

    /// The content keys of the prompt's full `page_size`-token pages (for
    /// radix caches), run-length encoded: each returned run is `count`
    /// consecutive pages with the key `token`. Equal keys at equal positions
    /// mean equal tokens. Pages that lie inside one token run share a key, so
    /// a trace prompt of a few hash ids stays a few runs even with 1-token
    /// pages; the work is linear in the runs, not the tokens.
    pub fn page_key_runs(&self, page_size: u32) -> Vec<TokenRun> {
        let mut out: Vec<TokenRun> = Vec::new();
        let mut push = |key: u64, count: u32| match out.last_mut() {
            Some(last) if last.token == key => last.count += count,
            _ => out.push(TokenRun { token: key, count }),
        };
        // A page in progress: tokens still missing and the key folded so far.
        let (mut need, mut acc) = (0u32, 0u64);
        for run in &self.runs {
            let mut left = run.count;
            if need > 0 {
                let take = left.min(need);
                acc = mix64(acc ^ run.token, u64::from(take));
                need -= take;
                left -= take;
                if need == 0 {
                    push(acc, 1);
                }
            }
            if left >= page_size {
                // Whole pages inside this run, folded as `chunk_contents` does.
                push(mix64(u64::from(page_size) ^ run.token, u64::from(page_size)), left / page_size);
                left %= page_size;
            }
            if left > 0 {
                acc = mix64(u64::from(page_size) ^ run.token, u64::from(left));
                need = page_size - left;
            }
        }
        out
    }
}

/// Folds the tokens of each full `chunk`-token chunk into one 64-bit key,
/// walking the runs once. Equal tokens give equal keys because runs are cut
/// at the same chunk boundaries.
fn chunk_contents(runs: &[TokenRun], chunk: u32) -> impl Iterator<Item = u64> + '_ {
    let mut iter = runs.iter().copied();
    let mut current: Option<TokenRun> = None;
    std::iter::from_fn(move || {
        let mut need = chunk;
        let mut acc = u64::from(chunk);
        while need > 0 {
            let run = match current.take() {
                Some(r) => r,
                None => iter.next()?,
            };
            let take = run.count.min(need);
            acc = mix64(acc ^ run.token, u64::from(take));
            need -= take;
            if take < run.count {
                current = Some(TokenRun { token: run.token, count: run.count - take });
            }
        }
        Some(acc)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_share_exactly_their_full_blocks() {
        let a = Prompt::from_trace(1100, &[1, 2, 3], 512, 64, 7).unwrap();
        let b = Prompt::from_trace(1100, &[1, 2, 9], 512, 64, 8).unwrap();
        assert_eq!(a.blocks().len(), 1100 / 64);
        let shared = a.blocks().iter().zip(b.blocks()).take_while(|(x, y)| x == y).count();
        assert_eq!(shared, 1024 / 64);
    }

    #[test]
    fn block_identity_depends_on_tokens_not_on_how_runs_are_cut() {
        let whole = Prompt::from_tokens(&[7; 100], 16);
        let split = Prompt::from_runs(
            100,
            vec![TokenRun { token: 7, count: 60 }, TokenRun { token: 7, count: 40 }],
            16,
        );
        assert_eq!(whole.blocks(), split.blocks());
        assert_eq!(whole.runs().len(), 1);
        let other = Prompt::from_tokens(&[[7; 50].as_slice(), &[8; 50]].concat(), 16);
        assert_eq!(other.blocks()[..3], whole.blocks()[..3]);
        assert_ne!(other.blocks()[3], whole.blocks()[3]);
    }

    #[test]
    fn unique_prompts_share_nothing_and_short_rows_are_errors() {
        let a = Prompt::unique(256, 64, 1);
        let b = Prompt::unique(256, 64, 2);
        assert!(a.blocks().iter().all(|x| !b.blocks().contains(x)));
        assert_eq!(a.blocks().len(), 4);
        assert!(a.blocks().iter().skip(1).all(|x| *x != a.blocks()[0]), "positions still differ");
        assert_eq!(a.page_key_runs(1).len(), 1);
        let e = Prompt::from_trace(1025, &[1, 2], 512, 64, 0).unwrap_err();
        assert_eq!(e.to_string(), "1025 input tokens need 3 hash ids of 512 tokens, found 2");
        assert_eq!(Prompt::from_trace(10, &[], 512, 64, 0).unwrap().blocks().len(), 0);
    }

    fn expand(runs: &[TokenRun]) -> Vec<u64> {
        runs.iter().flat_map(|r| std::iter::repeat_n(r.token, r.count as usize)).collect()
    }

    #[test]
    fn page_key_runs_have_page_granularity() {
        let p = Prompt::from_tokens(&[1, 2, 3, 4, 5], 2);
        assert_eq!(expand(&p.page_key_runs(1)).len(), 5);
        assert_eq!(expand(&p.page_key_runs(2)).len(), 2);
        assert_eq!(Prompt::from_tokens(&[1, 2, 3], 2).page_key_runs(2)[0], p.page_key_runs(2)[0]);
        let trace = Prompt::from_trace(12_000, &(0..24).collect::<Vec<_>>(), 512, 64, 0).unwrap();
        assert_eq!(trace.page_key_runs(1).len(), 24, "one run per hash id, not per token");
    }

    proptest::proptest! {
        /// The run-length keys expand to exactly the per-page keys folded
        /// page by page, whatever the page size and however runs are cut.
        #[test]
        fn page_key_runs_expand_to_per_page_keys(
            runs in proptest::collection::vec((0u64..4, 1u32..20), 0..12),
            page in 1u32..9,
        ) {
            let raw: Vec<TokenRun> = runs.iter().map(|&(token, count)| TokenRun { token, count }).collect();
            let len = raw.iter().map(|r| r.count).sum();
            let p = Prompt::from_runs(len, raw, 4);
            let per_page: Vec<u64> = chunk_contents(p.runs(), page).collect();
            proptest::prop_assert_eq!(expand(&p.page_key_runs(page)), per_page);
        }
    }
}
