//! Synthetic safetensors models for tests and `hangar bench store`.
//!
//! Nothing large is committed: fixtures are generated from a seed. Tensors
//! mimic a transformer checkpoint (`layers.N.attn.weight`, odd-sized biases
//! so the canonical layout has padding) and carry pseudo-random bytes.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::View;
use safetensors::Dtype;

use crate::error::{io_err, StoreError};
use crate::index::{tensor_bytes, TensorSpec};

/// A tensor held in memory, for writing safetensors files.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedTensor {
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Row-major bytes.
    pub data: Vec<u8>,
}

impl View for &OwnedTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Fills `buf` with pseudo-random bytes from `seed` (xorshift64*; fast, not cryptographic).
pub fn fill_random(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// A tensor of `shape` and `dtype` with random bytes from `seed`.
pub fn random_tensor(dtype: Dtype, shape: &[usize], seed: u64) -> OwnedTensor {
    let len = tensor_bytes(dtype, &shape.iter().map(|&d| d as u64).collect::<Vec<_>>()).expect("whole bytes");
    let mut data = vec![0; len as usize];
    fill_random(&mut data, seed);
    OwnedTensor { dtype, shape: shape.to_vec(), data }
}

/// A model of about `total_bytes`: `layers` layers each with an F16 square
/// weight sized to fit and an odd-length F32 bias.
pub fn model(total_bytes: u64, layers: usize, seed: u64) -> Vec<(String, OwnedTensor)> {
    let per_layer = total_bytes / layers.max(1) as u64;
    let side = (((per_layer / 2) as f64).sqrt() as usize).max(1);
    let mut out = Vec::with_capacity(layers * 2);
    for l in 0..layers {
        let s = seed.wrapping_add(l as u64 * 2);
        out.push((format!("layers.{l}.mlp.weight"), random_tensor(Dtype::F16, &[side, side], s)));
        out.push((format!("layers.{l}.mlp.bias"), random_tensor(Dtype::F32, &[side + 3], s + 1)));
    }
    out
}

/// The specs (name, dtype, shape) of `tensors`, for streaming registrations.
pub fn specs(tensors: &[(String, OwnedTensor)]) -> Vec<TensorSpec> {
    tensors
        .iter()
        .map(|(n, t)| TensorSpec {
            name: n.clone(),
            dtype: t.dtype,
            shape: t.shape.iter().map(|&d| d as u64).collect(),
        })
        .collect()
}

/// Writes `tensors` into `files` safetensors files under `dir` (tensors
/// dealt round-robin), named `model-0000N.safetensors`.
pub fn write_files(
    dir: &Path,
    tensors: &[(String, OwnedTensor)],
    files: usize,
) -> Result<Vec<PathBuf>, StoreError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let mut paths = Vec::with_capacity(files);
    for f in 0..files {
        let part: HashMap<&str, &OwnedTensor> = tensors
            .iter()
            .enumerate()
            .filter(|(i, _)| i % files == f)
            .map(|(_, (n, t))| (n.as_str(), t))
            .collect();
        let path = dir.join(format!("model-{:05}.safetensors", f + 1));
        safetensors::serialize_to_file(part, None, &path).map_err(|e| StoreError::Source {
            source_name: path.display().to_string(),
            reason: e.to_string(),
        })?;
        paths.push(path);
    }
    Ok(paths)
}

/// The serving manifest tensor (`__tensorcast_meta__.manifest_json`, `U8`)
/// holding `manifest` bytes, to add to a model.
pub fn manifest_tensor(manifest: &[u8]) -> (String, OwnedTensor) {
    let t = OwnedTensor { dtype: Dtype::U8, shape: vec![manifest.len()], data: manifest.to_vec() };
    (crate::preflight::MANIFEST_TENSOR.to_owned(), t)
}

/// A serving manifest that passes the preflight for `tensors` (the
/// manifest tensor itself not among them): every required field filled
/// with a placeholder, and the tensor count and schema hash of their
/// canonical index.
pub fn serving_manifest(tensors: &[(String, OwnedTensor)]) -> serde_json::Value {
    let index = crate::index::CanonicalIndex::build(specs(tensors)).expect("a model's tensors lay out");
    serde_json::json!({
        "schema_version": crate::preflight::SCHEMA_VERSION,
        "artifact_kind": crate::preflight::ARTIFACT_KIND,
        "framework_name": "torch",
        "adapter_version": "adapter-v1",
        "serving_abi_version": "abi-v1",
        "representation_contract_hash": "repr-hash",
        "serving_build_digest": "build-digest",
        "tensor_schema_hash": crate::preflight::tensor_schema_hash(&index),
        "canonical_tensor_count": crate::preflight::canonical_tensor_count(&index),
        "serving_manifest_ref": crate::preflight::MANIFEST_REF,
        "builder_mode": "pure_transform",
        "build_pipeline_version": "pipeline-v1",
    })
}

/// The tensor name of one LoRA factor as PEFT saves it for a Llama-style
/// model: `base_model.model.model.layers.{layer}.self_attn.{module}.lora_{A|B}.weight`.
pub fn lora_tensor_name(layer: usize, module: &str, factor: char) -> String {
    format!("base_model.model.model.layers.{layer}.self_attn.{module}.lora_{factor}.weight")
}

/// The modules [`synth_adapter_dir`] adapts.
pub const LORA_TARGET_MODULES: [&str; 2] = ["q_proj", "v_proj"];

/// A `bf16` tensor of `shape` with finite values of magnitude 2^-10 to
/// 2^-3, as trained LoRA factors hold, from `seed`.
pub fn random_bf16(shape: &[usize], seed: u64) -> OwnedTensor {
    let mut t = random_tensor(Dtype::BF16, shape, seed);
    for v in t.data.chunks_exact_mut(2) {
        let bits = u16::from_le_bytes([v[0], v[1]]);
        // Sign and 7 mantissa bits kept; exponent 117..=124 (2^-10..2^-3).
        let exponent = 117 + ((bits >> 7) & 7);
        v.copy_from_slice(&((bits & 0x807f) | (exponent << 7)).to_le_bytes());
    }
    t
}

/// Writes a LoRA adapter directory as PEFT's `save_pretrained` does, for
/// tests and benchmarks: `adapter_model.safetensors` with a `lora_A`
/// (`rank × hidden`) and a `lora_B` (`hidden × rank`) `bf16` factor for
/// `q_proj` and `v_proj` of each of `layers` layers (metadata
/// `{"format": "pt"}`), and `adapter_config.json` (`r` = `rank`,
/// `lora_alpha` = 2 × `rank`, those `target_modules`,
/// `base_model_name_or_path` = `base`). The weights take
/// `layers × 8 × rank × hidden` bytes: 16.8 MB at rank 16, hidden 4096,
/// 32 layers. Deterministic in `seed`. Returns the files written.
pub fn synth_adapter_dir(
    dir: &Path,
    base: &str,
    rank: usize,
    hidden: usize,
    layers: usize,
    seed: u64,
) -> Result<Vec<PathBuf>, StoreError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let mut tensors = Vec::with_capacity(layers * 4);
    for layer in 0..layers {
        for (m, module) in LORA_TARGET_MODULES.iter().enumerate() {
            let s = seed.wrapping_mul(1_000_003).wrapping_add((layer * 4 + m * 2) as u64);
            tensors.push((lora_tensor_name(layer, module, 'A'), random_bf16(&[rank, hidden], s)));
            tensors.push((lora_tensor_name(layer, module, 'B'), random_bf16(&[hidden, rank], s + 1)));
        }
    }
    let weights = dir.join("adapter_model.safetensors");
    let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    let views = tensors.iter().map(|(n, t)| (n.as_str(), t));
    safetensors::serialize_to_file(views, Some(metadata), &weights).map_err(|e| StoreError::Source {
        source_name: weights.display().to_string(),
        reason: e.to_string(),
    })?;
    let config = serde_json::json!({
        "base_model_name_or_path": base,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "layers_to_transform": null,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": rank,
        "revision": null,
        "target_modules": LORA_TARGET_MODULES,
        "task_type": "CAUSAL_LM",
        "use_rslora": false,
    });
    let config_path = dir.join("adapter_config.json");
    let text = serde_json::to_string_pretty(&config).expect("a config serializes") + "\n";
    std::fs::write(&config_path, text).map_err(io_err(&config_path))?;
    Ok(vec![config_path, weights])
}
