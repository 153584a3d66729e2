//! Named engine configurations for `hangar engine mock --preset NAME`.

use hangar_engine::timing::TimingConfig;
use hangar_engine::{EngineConfig, SchedulerKind};

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
    }
}
