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

/// The size of a synthetic adapter ([`synth_adapter_dir`]): its LoRA
/// rank, the base model's hidden size, and the layers adapted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterShape {
    /// LoRA rank.
    pub rank: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Layers.
    pub layers: usize,
}

impl AdapterShape {
    /// A few kilobytes: rank 2, hidden 64, 2 layers.
    pub const TINY: AdapterShape = AdapterShape { rank: 2, hidden: 64, layers: 2 };
}

/// Registers in `store` a synthetic adapter `adapter` of `shape`, for
/// tests and benchmarks: [`synth_adapter_dir`] (its base model's name the
/// adapter's base, deterministic in `seed`, so the same seed makes the same
/// artifact in any store) written to a temporary directory, then
/// [`crate::adapters::import_dir`]. Its import report.
pub fn register_adapter(
    store: &crate::BlobStore,
    adapter: &hangar_core::AdapterRef,
    shape: AdapterShape,
    seed: u64,
) -> Result<crate::adapters::ImportReport, crate::adapters::ImportError> {
    let synth = || -> Result<tempfile::TempDir, StoreError> {
        let dir = tempfile::tempdir().map_err(io_err(&std::env::temp_dir()))?;
        synth_adapter_dir(dir.path(), adapter.base().as_str(), shape.rank, shape.hidden, shape.layers, seed)?;
        Ok(dir)
    };
    let dir = synth().map_err(|e| crate::adapters::ImportError::Store {
        adapter: adapter.clone(),
        dir: std::env::temp_dir(),
        source: Box::new(e),
    })?;
    crate::adapters::import_dir(store, dir.path(), adapter)
}

/// Writes a Hugging Face model directory of a small Llama-style model, as
/// `huggingface-cli download --local-dir` leaves one, for tests and
/// benchmarks: `config.json` (`hidden_size` = `hidden`,
/// `num_hidden_layers` = `layers`), `generation_config.json`,
/// `tokenizer.json`, `tokenizer_config.json`, and the `bf16` weights —
/// embeddings, each layer's attention and MLP projections and norms, the
/// final norm and the LM head over a 256-token vocabulary — in `shards`
/// files `model-0000N-of-0000M.safetensors` (layers dealt in order, the
/// embeddings in the first, the head in the last; `{"format": "pt"}`
/// metadata, as transformers writes it) with their
/// `model.safetensors.index.json`. Deterministic in `seed`. Returns the
/// files written, by name.
pub fn synth_model_dir(
    dir: &Path,
    hidden: usize,
    layers: usize,
    shards: usize,
    seed: u64,
) -> Result<Vec<PathBuf>, StoreError> {
    const VOCAB: usize = 256;
    let shards = shards.max(1);
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let mut parts: Vec<Vec<(String, OwnedTensor)>> = vec![Vec::new(); shards];
    let mut n = 0u64;
    let mut tensor = |shape: &[usize]| {
        n += 1;
        random_bf16(shape, seed.wrapping_mul(1_000_003).wrapping_add(n))
    };
    parts[0].push(("model.embed_tokens.weight".into(), tensor(&[VOCAB, hidden])));
    for layer in 0..layers {
        let part = &mut parts[layer * shards / layers.max(1)];
        let p = |name: &str| format!("model.layers.{layer}.{name}");
        for m in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            part.push((p(&format!("self_attn.{m}.weight")), tensor(&[hidden, hidden])));
        }
        for (m, shape) in [("gate_proj", [2 * hidden, hidden]), ("up_proj", [2 * hidden, hidden])] {
            part.push((p(&format!("mlp.{m}.weight")), tensor(&shape)));
        }
        part.push((p("mlp.down_proj.weight"), tensor(&[hidden, 2 * hidden])));
        part.push((p("input_layernorm.weight"), tensor(&[hidden])));
        part.push((p("post_attention_layernorm.weight"), tensor(&[hidden])));
    }
    parts[shards - 1].push(("model.norm.weight".into(), tensor(&[hidden])));
    parts[shards - 1].push(("lm_head.weight".into(), tensor(&[VOCAB, hidden])));

    let write = |name: &str, text: String| -> Result<PathBuf, StoreError> {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(io_err(&path))?;
        Ok(path)
    };
    let json = |v: serde_json::Value| serde_json::to_string_pretty(&v).expect("JSON serializes") + "\n";
    let mut written = Vec::new();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    for (i, part) in parts.iter().enumerate() {
        let name = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
        let path = dir.join(&name);
        let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
        let views = part.iter().map(|(n, t)| (n.as_str(), t));
        safetensors::serialize_to_file(views, Some(metadata), &path).map_err(|e| StoreError::Source {
            source_name: path.display().to_string(),
            reason: e.to_string(),
        })?;
        for (tensor, t) in part {
            weight_map.insert(tensor.clone(), name.clone().into());
            total += t.data.len();
        }
        written.push(path);
    }
    written.push(write(
        "model.safetensors.index.json",
        json(serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map })),
    )?);
    written.push(write(
        "config.json",
        json(serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": (hidden / 64).max(1),
            "num_key_value_heads": (hidden / 64).max(1),
            "vocab_size": VOCAB,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": false,
        })),
    )?);
    written.push(write(
        "generation_config.json",
        json(serde_json::json!({ "bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 256 })),
    )?);
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..VOCAB).map(|i| (format!("<{i:02x}>"), i.into())).collect();
    written.push(write(
        "tokenizer.json",
        json(
            serde_json::json!({ "version": "1.0", "model": { "type": "BPE", "vocab": vocab, "merges": [] } }),
        ),
    )?);
    written.push(write(
        "tokenizer_config.json",
        json(serde_json::json!({ "bos_token": "<01>", "eos_token": "<02>", "model_max_length": 2048 })),
    )?);
    written.sort();
    Ok(written)
}
