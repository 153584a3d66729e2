//! KV-cache block identity and the events engines publish about it.
//!
//! A prompt is cut into blocks of `block_size` tokens. Each full block is
//! named by a [`BlockHash`] chained over its parent's hash and the block's own
//! tokens, so two requests share block *k* exactly when they share the first
//! *k + 1* blocks of tokens. Engines announce which blocks they hold with
//! [`KvEvent`]s; a KV-aware router indexes those to estimate, per worker, how
//! much of a new prompt is already cached.

use serde::{Deserialize, Serialize};

/// A full KV block's identity: a 64-bit hash chained over the parent block's
/// hash and the block's tokens. Equal hashes mean equal prefixes (up to
/// 64-bit collisions, which are ignored as every production engine does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

/// The root of every chain: the "parent" of a prompt's first block.
pub const ROOT_BLOCK_HASH: BlockHash = BlockHash(0x9e37_79b9_7f4a_7c15);

/// Mixes two 64-bit words into one, with full avalanche: every input bit
/// flips about half of the output bits. A multiply-fold of the 128-bit
/// product (the `wyhash` / `folded multiply` construction), deterministic on
/// every platform, so hashes are stable across runs and machines.
#[inline]
pub fn mix64(a: u64, b: u64) -> u64 {
    let x = (a ^ 0xa076_1d64_78bd_642f) as u128 * (b ^ 0xe703_7ed1_a0b4_28db) as u128;
    let folded = (x as u64) ^ ((x >> 64) as u64);
    // A final splitmix64 round so that mix64(a, b) and mix64(b, a) differ
    // and small inputs still spread.
    let mut z = folded.wrapping_add(a.rotate_left(17));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl BlockHash {
    /// The hash of the block whose parent is `self` and whose tokens hash to
    /// `content` (see [`mix64`] for how callers fold tokens into `content`).
    #[inline]
    pub fn chain(self, content: u64) -> BlockHash {
        BlockHash(mix64(self.0, content))
    }
}

/// What an engine tells the outside world about its KV cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvEvent {
    /// Consecutive blocks of one sequence became cached: `blocks[0]`'s parent
    /// is `parent` (`None` for the first block of a prompt), `blocks[i]`'s
    /// parent is `blocks[i - 1]`.
    Stored {
        /// The parent of the first stored block, if any.
        parent: Option<BlockHash>,
        /// The stored blocks, in chain order.
        blocks: Vec<BlockHash>,
    },
    /// Blocks were evicted and can no longer be reused.
    Removed {
        /// The evicted blocks.
        blocks: Vec<BlockHash>,
    },
    /// The engine dropped its whole cache (e.g. it was put to sleep).
    Cleared,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_parent_and_content() {
        let a = ROOT_BLOCK_HASH.chain(1);
        assert_ne!(a, ROOT_BLOCK_HASH.chain(2));
        assert_ne!(a.chain(1), ROOT_BLOCK_HASH.chain(1));
        assert_eq!(a, ROOT_BLOCK_HASH.chain(1));
        assert_ne!(mix64(1, 2), mix64(2, 1));
    }
}
