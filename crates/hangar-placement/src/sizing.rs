//! A model's footprint in bytes, from config: either given directly or
//! estimated as parameters × bytes per parameter × (1 + padding).
//!
//! The padding covers what a loaded model holds beyond its weights (buffers,
//! CUDA context, activation scratch); 15 % is the default the reference
//! deployment used.

use std::fmt;
use std::str::FromStr;

use hangar_core::ByteSize;
use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// The padding used when a model spec does not give one.
pub const DEFAULT_PADDING: f64 = 0.15;

/// Numeric type the weights are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit float: 4 bytes per parameter.
    #[serde(alias = "f32", alias = "float32")]
    Fp32,
    /// 16-bit float: 2 bytes.
    #[serde(alias = "f16", alias = "float16")]
    Fp16,
    /// bfloat16: 2 bytes.
    #[serde(alias = "bfloat16")]
    Bf16,
    /// 8-bit float or integer: 1 byte.
    #[serde(alias = "int8", alias = "f8")]
    Fp8,
    /// 4-bit quantised (int4, fp4, nf4): half a byte.
    #[serde(alias = "fp4", alias = "nf4")]
    Int4,
}

impl Dtype {
    /// Bytes per parameter.
    pub fn bytes_per_parameter(self) -> f64 {
        match self {
            Dtype::Fp32 => 4.0,
            Dtype::Fp16 | Dtype::Bf16 => 2.0,
            Dtype::Fp8 => 1.0,
            Dtype::Int4 => 0.5,
        }
    }
}

/// A parameter count: an integer, or a string such as `"8B"`, `"70.6B"`,
/// `"350M"` or `"1.2T"` (powers of 1000).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ParamRepr", into = "u64")]
pub struct ParamCount(u64);

impl ParamCount {
    /// Wraps a count.
    pub const fn new(n: u64) -> Self {
        Self(n)
    }
    /// The count.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl From<ParamCount> for u64 {
    fn from(p: ParamCount) -> u64 {
        p.0
    }
}

/// Why a parameter count did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a parameter count (write e.g. 8B, 350M, 1.2T or 8030261248)")]
pub struct ParamCountError(String);

impl FromStr for ParamCount {
    type Err = ParamCountError;
    fn from_str(input: &str) -> Result<Self, ParamCountError> {
        let err = || ParamCountError(input.to_owned());
        let s = input.trim();
        let (num, mult) = match s.char_indices().last() {
            Some((i, 'K' | 'k')) => (&s[..i], 1e3),
            Some((i, 'M' | 'm')) => (&s[..i], 1e6),
            Some((i, 'B' | 'b' | 'G' | 'g')) => (&s[..i], 1e9),
            Some((i, 'T' | 't')) => (&s[..i], 1e12),
            _ => (s, 1.0),
        };
        let n: f64 = num.trim().parse().map_err(|_| err())?;
        let total = n * mult;
        if !total.is_finite() || total < 1.0 || total >= u64::MAX as f64 {
            return Err(err());
        }
        Ok(Self(total.round() as u64))
    }
}

impl fmt::Display for ParamCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ParamRepr {
    Int(u64),
    Str(String),
}

impl TryFrom<ParamRepr> for ParamCount {
    type Error = ParamCountError;
    fn try_from(r: ParamRepr) -> Result<Self, ParamCountError> {
        match r {
            ParamRepr::Int(0) => Err(ParamCountError("0".into())),
            ParamRepr::Int(n) => Ok(Self(n)),
            ParamRepr::Str(s) => s.parse(),
        }
    }
}

/// How big a model is, as config states it. Exactly one of `size` or
/// `parameters` must be given; `dtype` (default `bf16`) and `padding`
/// (default 0.15) only apply to `parameters`.
///
/// ```toml
/// [models."meta/llama-3-8b"]
/// parameters = "8B"
/// dtype = "bf16"          # 8e9 × 2 × 1.15 = 18.4 GB
///
/// [models."acme/whisper"]
/// size = "3GB"
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The footprint, stated directly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<ByteSize>,
    /// The parameter count, to estimate the footprint from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<ParamCount>,
    /// Weight dtype (default bf16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Dtype>,
    /// Overhead on top of the weights, as a fraction (default 0.15).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padding: Option<f64>,
    /// The only nodes it may run on: those whose `gpu_kind` is this
    /// hardware label (e.g. `a100-80gb`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_kind: Option<String>,
    /// The least memory each GPU of its node must have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_gpu_memory: Option<ByteSize>,
    /// GPU memory each replica's engine sets aside for LoRA adapters (a
    /// model's `[models.adapters] memory`), on top of its weights: part of
    /// the footprint, so adapters never over-commit a GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter_memory: Option<ByteSize>,
    /// The model is in the *hotswap tier* (default false): it holds no
    /// GPUs of its own but shares the room the other models leave, swapped
    /// in and out by demand behind them. Any other model's replica may
    /// evict one of its replicas whatever its age; its own replicas evict
    /// only other hotswap replicas, and only those at least
    /// [`PlacementConfig::hotswap_min_age_ms`] old; evicted, its replicas
    /// are the last a warm cache drops, so swapping one back in is a wake
    /// from CPU memory, not a load (docs/placement.md, "The hotswap tier").
    ///
    /// [`PlacementConfig::hotswap_min_age_ms`]: crate::PlacementConfig::hotswap_min_age_ms
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hotswap: bool,
}

/// The hardware a model requires of a node ([`ModelSpec::gpu_kind`],
/// [`ModelSpec::min_gpu_memory`]); the default admits every node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requirement {
    /// The node's GPU kind must be this label.
    pub gpu_kind: Option<String>,
    /// Each GPU of the node must have at least this many bytes.
    pub min_gpu_memory: Option<u64>,
}

impl Requirement {
    /// Whether a node whose GPUs are of `kind` with `gpu_memory` bytes each
    /// meets it.
    pub fn admits(&self, kind: &str, gpu_memory: u64) -> bool {
        self.gpu_kind.as_deref().is_none_or(|k| k == kind)
            && self.min_gpu_memory.is_none_or(|m| gpu_memory >= m)
    }

    /// The model field that asks for it, to name in an error: `gpu_kind`
    /// when a kind is required, else `min_gpu_memory`.
    pub fn field(&self) -> &'static str {
        if self.gpu_kind.is_some() {
            "gpu_kind"
        } else {
            "min_gpu_memory"
        }
    }

    /// Whether it admits every node.
    pub fn is_none(&self) -> bool {
        self.gpu_kind.is_none() && self.min_gpu_memory.is_none()
    }
}

impl std::fmt::Display for Requirement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.gpu_kind, self.min_gpu_memory) {
            (Some(k), Some(m)) => write!(f, "GPUs of kind `{k}` with at least {} each", ByteSize::new(m)),
            (Some(k), None) => write!(f, "GPUs of kind `{k}`"),
            (None, Some(m)) => write!(f, "GPUs with at least {} each", ByteSize::new(m)),
            (None, None) => f.write_str("any GPUs"),
        }
    }
}

impl ModelSpec {
    /// A hotswap model holds no replicas of its own: refuses a
    /// `min_replicas` above 0 for one (the error names `min_replicas`), the
    /// one rule `hangar serve` and the fleet file share.
    pub fn check_tier(&self, min_replicas: u32) -> Result<(), hangar_core::FieldError> {
        if self.hotswap && min_replicas > 0 {
            return Err(hangar_core::FieldError::new(
                "min_replicas",
                format!(
                    "is {min_replicas}, and a `hotswap` model holds no replicas of its own: it is swapped in \
                     by demand (set min_replicas = 0, or drop `hotswap` to keep replicas up)"
                ),
            ));
        }
        Ok(())
    }

    /// The hardware it requires of a node.
    pub fn requirement(&self) -> Requirement {
        Requirement {
            gpu_kind: self.gpu_kind.clone(),
            min_gpu_memory: self.min_gpu_memory.map(|m| m.bytes()),
        }
    }

    /// The footprint in bytes — the weights, padded, and the adapter
    /// memory — or why the spec is unusable. `model` only names the model
    /// in the error.
    pub fn footprint(&self, model: &str) -> Result<u64, ConfigError> {
        let weights = self.weights_footprint(model)?;
        let adapters = self.adapter_memory.map_or(0, ByteSize::bytes);
        weights.checked_add(adapters).ok_or_else(|| ConfigError::Model {
            model: model.to_owned(),
            why: "the footprint with `adapter_memory` overflows 64 bits".into(),
        })
    }

    /// The weights' footprint, padded.
    fn weights_footprint(&self, model: &str) -> Result<u64, ConfigError> {
        let bad = |why: String| ConfigError::Model { model: model.to_owned(), why };
        match (self.size, self.parameters) {
            (Some(_), Some(_)) => Err(bad("give either `size` or `parameters`, not both".into())),
            (None, None) => Err(bad("give its `size` (e.g. \"16GB\") or `parameters` (e.g. \"8B\")".into())),
            (Some(size), None) => {
                if self.dtype.is_some() || self.padding.is_some() {
                    return Err(bad("`dtype` and `padding` only apply with `parameters`".into()));
                }
                if size.bytes() == 0 {
                    return Err(bad("`size` must be above 0".into()));
                }
                Ok(size.bytes())
            }
            (None, Some(params)) => {
                let padding = self.padding.unwrap_or(DEFAULT_PADDING);
                if !(padding.is_finite() && (0.0..=10.0).contains(&padding)) {
                    return Err(bad(format!("`padding` {padding} must be between 0 and 10")));
                }
                let dtype = self.dtype.unwrap_or(Dtype::Bf16);
                let bytes = params.get() as f64 * dtype.bytes_per_parameter() * (1.0 + padding);
                if bytes >= u64::MAX as f64 {
                    return Err(bad("the footprint overflows 64 bits".into()));
                }
                Ok((bytes.ceil() as u64).max(1))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn footprint_from_parameters_pads_by_default() {
        let spec = ModelSpec { parameters: Some("8B".parse().unwrap()), ..Default::default() };
        assert_eq!(spec.footprint("m").unwrap(), 18_400_000_000);
        let spec = ModelSpec {
            parameters: Some(ParamCount::new(1_000)),
            dtype: Some(Dtype::Int4),
            padding: Some(0.0),
            ..Default::default()
        };
        assert_eq!(spec.footprint("m").unwrap(), 500);
    }

    #[test]
    fn adapter_memory_adds_to_the_footprint() {
        let spec = ModelSpec {
            size: Some(ByteSize::new(16_000_000_000)),
            adapter_memory: Some(ByteSize::new(4_000_000_000)),
            ..Default::default()
        };
        assert_eq!(spec.footprint("m").unwrap(), 20_000_000_000);
        let huge = ModelSpec { adapter_memory: Some(ByteSize::new(u64::MAX)), ..spec };
        assert!(huge.footprint("m").unwrap_err().to_string().contains("adapter_memory"));
    }

    #[test]
    fn footprint_from_size_is_taken_as_is() {
        let spec = ModelSpec { size: Some("16GB".parse().unwrap()), ..Default::default() };
        assert_eq!(spec.footprint("m").unwrap(), 16_000_000_000);
    }

    #[test]
    fn inconsistent_specs_are_rejected_with_the_model_named() {
        let both = ModelSpec {
            size: Some(ByteSize::new(1)),
            parameters: Some(ParamCount::new(1)),
            ..Default::default()
        };
        let e = both.footprint("acme/x").unwrap_err().to_string();
        assert!(e.contains("acme/x") && e.contains("not both"), "{e}");
        assert!(ModelSpec::default().footprint("m").is_err());
        let zero = ModelSpec { size: Some(ByteSize::new(0)), ..Default::default() };
        assert!(zero.footprint("m").is_err());
        let pad =
            ModelSpec { parameters: Some(ParamCount::new(5)), padding: Some(-1.0), ..Default::default() };
        assert!(pad.footprint("m").is_err());
    }

    #[test]
    fn parameter_counts_parse_with_suffixes() {
        assert_eq!("70.6B".parse::<ParamCount>().unwrap().get(), 70_600_000_000);
        assert_eq!("350M".parse::<ParamCount>().unwrap().get(), 350_000_000);
        assert_eq!("1.2T".parse::<ParamCount>().unwrap().get(), 1_200_000_000_000);
        assert!("lots".parse::<ParamCount>().is_err());
        assert!("0".parse::<ParamCount>().is_err());
        let p: ParamCount = serde_json::from_str("\"8B\"").unwrap();
        assert_eq!(p.get(), 8_000_000_000);
        let d: Dtype = serde_json::from_str("\"bfloat16\"").unwrap();
        assert_eq!(d, Dtype::Bf16);
    }
}
