//! Engine configuration: the knobs of vLLM and SGLang that shape scheduling,
//! with vLLM's defaults, loadable from TOML and validated before use.

use serde::{Deserialize, Serialize};

use crate::timing::{Fixed, Polynomial, SharedTiming, Table, TimingConfig};

/// Which scheduler an engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SchedulerKind {
    /// vLLM v1: paged KV blocks with a hash-chained prefix cache, mixed
    /// prefill/decode passes under a token budget, LIFO preemption with
    /// recompute.
    #[default]
    Vllm,
    /// SGLang: a radix cache of `page_size`-token pages, separate prefill
    /// and decode passes, `fifo` or `lpm` admission reserving memory for
    /// future output, decode retraction under memory pressure. Reads the
    /// `sglang` settings; `max_num_batched_tokens` does not apply (SGLang's
    /// `chunked_prefill_size` bounds a prefill pass). With
    /// `enable_chunked_prefill` off a prompt is never split: a pass still
    /// takes only prompts that fit in `chunked_prefill_size`, except its
    /// first, which runs whole.
    Sglang,
}

/// How an SGLang-style engine orders its waiting queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SglangPolicy {
    /// First come, first served.
    #[default]
    Fifo,
    /// Longest prefix match first: requests with the most cached tokens go
    /// first, arrival order breaking ties.
    Lpm,
}

/// Settings that only the SGLang-style scheduler reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SglangConfig {
    /// Tokens per radix-cache page; prefixes match in whole pages.
    pub page_size: u32,
    /// Waiting-queue order.
    pub schedule_policy: SglangPolicy,
    /// The most prompt tokens one prefill pass computes (SGLang's
    /// `chunked_prefill_size`); longer prompts are chunked.
    pub chunked_prefill_size: u32,
    /// Fraction of each running request's remaining output that admission
    /// reserves memory for (SGLang's initial `new_token_ratio`).
    pub init_new_token_ratio: f64,
    /// The floor the reservation ratio decays to while no retraction happens.
    pub min_new_token_ratio: f64,
    /// How much the ratio decays per decode pass.
    pub new_token_ratio_decay: f64,
}

impl Default for SglangConfig {
    fn default() -> Self {
        Self {
            page_size: 1,
            schedule_policy: SglangPolicy::Fifo,
            chunked_prefill_size: 8192,
            init_new_token_ratio: 0.7,
            min_new_token_ratio: 0.1,
            new_token_ratio_decay: 0.001,
        }
    }
}

/// The most KV blocks an engine models: a block's references and its place
/// in the free queue share 30 bits of its 12-byte record.
pub const MAX_GPU_BLOCKS: u32 = 1 << 28;

/// One mock engine's configuration. Field names follow vLLM's engine
/// arguments; defaults are vLLM's (and Dynamo mocker's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Which scheduler to run.
    pub scheduler: SchedulerKind,
    /// Tokens per KV block (the unit of allocation, caching and KV events).
    pub block_size: u32,
    /// KV blocks on the (modelled) GPU.
    pub num_gpu_blocks: u32,
    /// The most requests running at once.
    pub max_num_seqs: u32,
    /// The most tokens (prefill and decode together) one pass computes.
    pub max_num_batched_tokens: u32,
    /// Reuse cached blocks of equal prefixes.
    pub enable_prefix_caching: bool,
    /// Split long prompts over several passes instead of waiting for a pass
    /// with room for the whole prompt.
    pub enable_chunked_prefill: bool,
    /// Divides every modelled duration: 2.0 runs twice as fast.
    pub speedup_ratio: f64,
    /// How long a pass takes.
    pub timing: TimingConfig,
    /// SGLang-only settings.
    pub sglang: SglangConfig,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            scheduler: SchedulerKind::Vllm,
            block_size: 64,
            num_gpu_blocks: 16384,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            speedup_ratio: 1.0,
            timing: TimingConfig::Polynomial,
            sglang: SglangConfig::default(),
        }
    }
}

/// A configuration value that cannot work, naming the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A field holds a value outside its allowed range.
    #[error("engine config field `{field}`: {why}")]
    Invalid {
        /// The field's name as written in configuration.
        field: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// The timing table could not be read or parsed.
    #[error("engine config field `timing.path`: {0}")]
    Timing(String),
}

impl EngineConfig {
    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field, why: &str| Err(ConfigError::Invalid { field, why: why.to_owned() });
        if self.block_size == 0 {
            return invalid("block_size", "must be at least 1");
        }
        if self.num_gpu_blocks == 0 {
            return invalid("num_gpu_blocks", "must be at least 1");
        }
        if self.num_gpu_blocks > MAX_GPU_BLOCKS {
            return invalid("num_gpu_blocks", "must be at most 268435456 (2^28)");
        }
        if self.max_num_seqs == 0 {
            return invalid("max_num_seqs", "must be at least 1");
        }
        if self.max_num_batched_tokens == 0 {
            return invalid("max_num_batched_tokens", "must be at least 1");
        }
        if !(self.speedup_ratio.is_finite() && self.speedup_ratio > 0.0) {
            return invalid("speedup_ratio", "must be a finite number above 0");
        }
        if let TimingConfig::Fixed { prefill_ms, decode_ms } = self.timing {
            if !(prefill_ms.is_finite() && prefill_ms >= 0.0) {
                return invalid("timing.prefill_ms", "must be a finite number ≥ 0");
            }
            if !(decode_ms.is_finite() && decode_ms >= 0.0) {
                return invalid("timing.decode_ms", "must be a finite number ≥ 0");
            }
        }
        let s = &self.sglang;
        if s.page_size == 0 {
            return invalid("sglang.page_size", "must be at least 1");
        }
        if self.scheduler == SchedulerKind::Sglang && self.block_size % s.page_size != 0 {
            // A KV event block must be whole pages, or one block could be
            // cached under two request-specific pages.
            return invalid("sglang.page_size", "must divide block_size");
        }
        if s.chunked_prefill_size == 0 {
            return invalid("sglang.chunked_prefill_size", "must be at least 1");
        }
        for (field, v) in [
            ("sglang.init_new_token_ratio", s.init_new_token_ratio),
            ("sglang.min_new_token_ratio", s.min_new_token_ratio),
            ("sglang.new_token_ratio_decay", s.new_token_ratio_decay),
        ] {
            if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
                return invalid(field, "must be between 0 and 1");
            }
        }
        Ok(())
    }

    /// The KV capacity in tokens.
    pub fn capacity_tokens(&self) -> u64 {
        u64::from(self.num_gpu_blocks) * u64::from(self.block_size)
    }

    /// Builds the configured timing model. `load` reads a table file's text
    /// (the engine itself does no I/O); it is only called for `table`.
    pub fn build_timing(
        &self,
        load: impl FnOnce(&str) -> Result<String, String>,
    ) -> Result<SharedTiming, ConfigError> {
        Ok(match &self.timing {
            TimingConfig::Polynomial => std::sync::Arc::new(Polynomial),
            &TimingConfig::Fixed { prefill_ms, decode_ms } => {
                std::sync::Arc::new(Fixed { prefill_ms, decode_ms })
            }
            TimingConfig::Table { path } => {
                let text =
                    load(path).map_err(|e| ConfigError::Timing(format!("cannot read `{path}`: {e}")))?;
                std::sync::Arc::new(
                    Table::from_csv(&text, path).map_err(|e| ConfigError::Timing(e.to_string()))?,
                )
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_vllms() {
        let c = EngineConfig::default();
        assert_eq!(
            (c.block_size, c.num_gpu_blocks, c.max_num_seqs, c.max_num_batched_tokens),
            (64, 16384, 256, 8192)
        );
        assert!(c.enable_prefix_caching && c.enable_chunked_prefill);
        c.validate().unwrap();
    }

    #[test]
    fn toml_with_unknown_or_bad_fields_is_rejected() {
        let c: EngineConfig =
            toml::from_str("block_size = 16\n[timing]\nmodel = \"fixed\"\nprefill_ms = 5\ndecode_ms = 1\n")
                .unwrap();
        assert_eq!(c.block_size, 16);
        assert!(toml::from_str::<EngineConfig>("blok_size = 16")
            .unwrap_err()
            .to_string()
            .contains("blok_size"));
        let c = EngineConfig { speedup_ratio: 0.0, ..Default::default() };
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "engine config field `speedup_ratio`: must be a finite number above 0"
        );
        let c = EngineConfig { num_gpu_blocks: MAX_GPU_BLOCKS + 1, ..Default::default() };
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "engine config field `num_gpu_blocks`: must be at most 268435456 (2^28)"
        );
        EngineConfig { num_gpu_blocks: MAX_GPU_BLOCKS, ..Default::default() }.validate().unwrap();
    }
}
