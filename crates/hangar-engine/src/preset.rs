//! Named engine configurations: `hangar engine mock --preset NAME` and a
//! served model's `engine = { kind = "mock", preset = "NAME" }`.
//!
//! The one list of presets: the mock engine starts from it, and
//! `hangar serve`'s loader refuses a name that is not in it, so a typo is
//! caught when the file loads rather than when a replica starts.

use crate::timing::TimingConfig;
use crate::{EngineConfig, SchedulerKind};

/// A named mock-engine setup.
#[derive(Debug, Clone)]
pub struct Preset {
    /// The name given on the command line.
    pub name: &'static str,
    /// One line for `--help` and docs.
    pub description: &'static str,
    /// The scheduler configuration.
    pub engine: EngineConfig,
    /// Dimensions of `/v1/embeddings` vectors.
    pub embedding_dims: usize,
}

/// Every preset, in the order `--help` lists them.
pub fn presets() -> Vec<Preset> {
    let base = EngineConfig::default();
    vec![
        Preset {
            name: "default",
            description: "vLLM defaults with Dynamo's polynomial timing (an 8B-class model on one GPU)",
            engine: base.clone(),
            embedding_dims: 384,
        },
        Preset {
            name: "fast",
            description:
                "the default engine twenty times faster: passes of about a millisecond, for demos and tests",
            engine: EngineConfig { speedup_ratio: 20.0, ..base.clone() },
            embedding_dims: 384,
        },
        Preset {
            name: "instant",
            description:
                "zero compute time: every pass takes 0 ms, to measure what is in front of the engine",
            engine: EngineConfig {
                timing: TimingConfig::Fixed { prefill_ms: 0.0, decode_ms: 0.0 },
                ..base.clone()
            },
            embedding_dims: 384,
        },
        Preset {
            name: "sglang",
            description:
                "SGLang's scheduler (radix cache, separate prefill and decode passes) with polynomial timing",
            engine: EngineConfig { scheduler: SchedulerKind::Sglang, ..base },
            embedding_dims: 384,
        },
    ]
}

/// The preset called `name`.
pub fn preset(name: &str) -> Option<Preset> {
    presets().into_iter().find(|p| p.name == name)
}

/// The preset called `name`, or an error that lists the known ones.
pub fn named(name: &str) -> Result<Preset, UnknownPreset> {
    preset(name).ok_or_else(|| UnknownPreset { name: name.to_owned() })
}

/// A preset name that is none of [`presets`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown preset `{name}`; choose one of {}", names().join(", "))]
pub struct UnknownPreset {
    /// The name asked for.
    pub name: String,
}

/// The presets' names, in [`presets`]' order.
pub fn names() -> Vec<&'static str> {
    presets().iter().map(|p| p.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_is_valid_and_named_uniquely() {
        let all = presets();
        for p in &all {
            p.engine.validate().unwrap();
            assert_eq!(preset(p.name).unwrap().name, p.name);
        }
        assert!(preset("gpt-5").is_none());
        assert_eq!(
            named("gpt-5").unwrap_err().to_string(),
            "unknown preset `gpt-5`; choose one of default, fast, instant, sglang"
        );
        assert_eq!(names().len(), all.len());
    }
}
