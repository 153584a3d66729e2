//! The two on-disk layouts of llm-d's FileMapper, recognised by the shape of
//! every path component rather than by guessing from directory contents.
//!
//! Current layout (one directory per model and rank, `config.json` beside):
//!
//! ```text
//! <root>/<model>_<digest12>/config.json
//! <root>/<model>_<digest12>_r<rank>/<hhh>/<hh>_g<group>/<hash16>.bin
//! ```
//!
//! Older layout (model names may contain `/`, so the model part is one or more
//! directories):
//!
//! ```text
//! <root>/<model…>/block_size_<X>_blocks_per_file_<Y>/tp_<tp>_pp_size_<pp>_pcp_size_<pcp>/
//!        rank_<rank>/<dtype>/<hhh>/<hh>/<hash16>.bin
//! ```
//!
//! A *shard* is the directory that directly holds the first bucket level: the
//! `…_r<rank>` directory or the `<dtype>` directory. Because the older layout
//! is matched component by component, a dtype directory named `bf16` (which
//! is also valid hex) is a shard, never mistaken for a bucket.
//!
//! Only files named `<16 lowercase hex digits>.bin` are ever candidates.

/// Which FileMapper layout a shard follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `<model>_<digest12>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin`; the
    /// first bucket level has `bucket_len` hex digits (`HEX_BUCKET_LEN`).
    Current {
        /// Hex digits of the first bucket level.
        bucket_len: usize,
    },
    /// `…/rank_<rank>/<dtype>/<hhh>/<hh>/<hash>.bin`.
    Legacy,
}

impl Layout {
    /// Hex digits of the first bucket level.
    pub fn bucket_len(self) -> usize {
        match self {
            Layout::Current { bucket_len } => bucket_len,
            Layout::Legacy => 3,
        }
    }

    /// Parses a first-level bucket name (`abc`) into its value.
    pub fn parse_bucket(self, name: &[u8]) -> Option<u16> {
        (name.len() == self.bucket_len()).then(|| parse_hex(name)).flatten().map(|v| v as u16)
    }

    /// Formats a first-level bucket value back into its name.
    pub fn bucket_name(self, bucket: u16) -> String {
        format!("{bucket:0width$x}", width = self.bucket_len())
    }

    /// Parses a second-level (leaf) directory name: `ab_g3` in the current
    /// layout, `ab` in the older one.
    pub fn parse_leaf(self, name: &[u8]) -> Option<Leaf> {
        let hh = name.get(..2).and_then(parse_hex)? as u8;
        match self {
            Layout::Legacy => (name.len() == 2).then_some(Leaf { hh, group: None }),
            Layout::Current { .. } => {
                let digits = name[2..].strip_prefix(b"_g")?;
                let group = parse_decimal(digits)?;
                Some(Leaf { hh, group: Some(group) })
            }
        }
    }

    /// Formats a leaf back into its directory name.
    pub fn leaf_name(self, leaf: Leaf) -> String {
        match leaf.group {
            Some(g) => format!("{:02x}_g{g}", leaf.hh),
            None => format!("{:02x}", leaf.hh),
        }
    }
}

/// A second-level bucket directory, stored in 8 bytes instead of a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Leaf {
    /// The two hex digits.
    pub hh: u8,
    /// The `_g<group>` suffix of the current layout.
    pub group: Option<u32>,
}

/// The block hash of a file named `<16 lowercase hex>.bin`, else `None`.
pub fn parse_block_file(name: &[u8]) -> Option<u64> {
    let stem = name.strip_suffix(b".bin")?;
    (stem.len() == 16).then(|| parse_hex(stem)).flatten()
}

/// The file name of block `hash`.
pub fn block_file_name(hash: u64) -> String {
    format!("{hash:016x}.bin")
}

/// Whether `name` is a writer's leftover temporary file: `<16 hex>…` ending
/// in `.tmp` (e.g. `0123456789abcdef.bin.tmp`).
pub fn is_tmp_file(name: &[u8]) -> bool {
    name.ends_with(b".tmp") && name.len() > 16 && parse_hex(&name[..16]).is_some()
}

/// A current-layout rank directory `<model>_<digest12>_r<rank>`: returns the
/// model base directory name (`<model>_<digest12>`) and the model part.
pub fn parse_current_rank_dir(name: &str) -> Option<(&str, &str)> {
    let (base, rank) = name.rsplit_once("_r")?;
    parse_decimal(rank.as_bytes())?;
    let (model, digest) = base.rsplit_once('_')?;
    let digest_ok = digest.len() == 12 && parse_hex(digest.as_bytes()).is_some();
    (digest_ok && !model.is_empty()).then_some((base, model))
}

/// `block_size_<X>_blocks_per_file_<Y>`.
pub fn is_block_size_dir(name: &str) -> bool {
    name.strip_prefix("block_size_")
        .and_then(|r| r.split_once("_blocks_per_file_"))
        .is_some_and(|(x, y)| is_decimal(x) && is_decimal(y))
}

/// `tp_<tp>_pp_size_<pp>_pcp_size_<pcp>`.
pub fn is_parallel_dir(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("tp_") else {
        return false;
    };
    let Some((tp, rest)) = rest.split_once("_pp_size_") else {
        return false;
    };
    let Some((pp, pcp)) = rest.split_once("_pcp_size_") else {
        return false;
    };
    is_decimal(tp) && is_decimal(pp) && is_decimal(pcp)
}

/// `rank_<rank>`.
pub fn is_legacy_rank_dir(name: &str) -> bool {
    name.strip_prefix("rank_").is_some_and(is_decimal)
}

/// A dtype directory name (`bfloat16`, `bf16`, `torch.float16`, `fp8_e4m3`).
pub fn is_dtype_dir(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
}

fn is_decimal(s: &str) -> bool {
    parse_decimal(s.as_bytes()).is_some()
}

fn parse_decimal(s: &[u8]) -> Option<u32> {
    if s.is_empty() || s.len() > 9 || !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    s.iter().try_fold(0u32, |acc, d| Some(acc * 10 + u32::from(d - b'0')))
}

/// Lowercase hex only, as FileMapper writes it; at most 16 digits.
fn parse_hex(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 16 {
        return None;
    }
    s.iter().try_fold(0u64, |acc, &c| {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None,
        };
        Some(acc << 4 | u64::from(d))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn block_files_match_only_the_hex_pattern() {
        assert_eq!(parse_block_file(b"00000000000000ff.bin"), Some(255));
        for bad in [
            &b"00000000000000ff.bin.tmp"[..],
            b"00000000000000FF.bin",
            b"0000000000000ff.bin",
            b"000000000000000ff.bin",
            b"00000000000000fg.bin",
            b"config.json",
            b".bin",
        ] {
            assert_eq!(parse_block_file(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn current_rank_dirs_need_digest_and_rank() {
        assert_eq!(
            parse_current_rank_dir("meta-llama--Llama-3_0123456789ab_r0"),
            Some(("meta-llama--Llama-3_0123456789ab", "meta-llama--Llama-3"))
        );
        assert_eq!(parse_current_rank_dir("model_0123456789ab"), None);
        assert_eq!(parse_current_rank_dir("model_0123456789_r0"), None);
        assert_eq!(parse_current_rank_dir("model_0123456789ab_rx"), None);
        assert_eq!(parse_current_rank_dir("_0123456789ab_r1"), None);
    }

    #[test]
    fn legacy_components() {
        assert!(is_block_size_dir("block_size_16_blocks_per_file_4"));
        assert!(!is_block_size_dir("block_size_x_blocks_per_file_4"));
        assert!(is_parallel_dir("tp_2_pp_size_1_pcp_size_1"));
        assert!(!is_parallel_dir("tp_2_pp_1_pcp_1"));
        assert!(is_legacy_rank_dir("rank_3"));
        assert!(!is_legacy_rank_dir("rank_"));
        assert!(is_dtype_dir("bf16") && is_dtype_dir("torch.bfloat16"));
        assert!(!is_dtype_dir("..") && !is_dtype_dir("a/b"));
    }

    #[test]
    fn leaves_per_layout() {
        let cur = Layout::Current { bucket_len: 3 };
        assert_eq!(cur.parse_leaf(b"ab_g12"), Some(Leaf { hh: 0xab, group: Some(12) }));
        assert_eq!(cur.parse_leaf(b"ab"), None);
        assert_eq!(Layout::Legacy.parse_leaf(b"ab"), Some(Leaf { hh: 0xab, group: None }));
        assert_eq!(Layout::Legacy.parse_leaf(b"ab_g1"), None);
        assert_eq!(cur.parse_bucket(b"0f3"), Some(0x0f3));
        assert_eq!(cur.parse_bucket(b"0f"), None);
        assert!(is_tmp_file(b"0123456789abcdef.bin.tmp"));
        assert!(!is_tmp_file(b"notes.tmp"));
    }

    proptest! {
        #[test]
        fn names_round_trip(hash: u64, bucket in 0u16..0x1000, hh: u8, group in proptest::option::of(0u32..100_000)) {
            prop_assert_eq!(parse_block_file(block_file_name(hash).as_bytes()), Some(hash));
            let layout = if group.is_some() { Layout::Current { bucket_len: 3 } } else { Layout::Legacy };
            prop_assert_eq!(layout.parse_bucket(layout.bucket_name(bucket).as_bytes()), Some(bucket));
            let leaf = Leaf { hh, group };
            prop_assert_eq!(layout.parse_leaf(layout.leaf_name(leaf).as_bytes()), Some(leaf));
        }
    }
}
