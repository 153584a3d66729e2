//! What the mock engine reads before it serves (`--weights PATH`), as a
//! real engine loads its weights: a file (a GGUF, or the `/proc/self/fd/N`
//! of a store's shared memory) read whole, or a Hugging Face model
//! directory as vLLM's `--model DIR` takes one — `config.json` parsed,
//! every file read whole, every `*.safetensors` file's header checked as
//! the `safetensors` crate checks it (length within the file, JSON, every
//! tensor's offsets inside the data, the data covered exactly). A weights
//! path that fails any of it fails the start, naming the file, as vLLM's
//! loader would. What was read is reported in `/v1/models` ([`WeightsRead`]).

use std::io;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;

/// Bytes read whole from a path before serving (weights) or while loading
/// (a LoRA adapter's files).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct WeightsRead {
    /// The path it was given (a file, a model directory, or a LoRA
    /// adapter's directory).
    pub path: String,
    /// Bytes read.
    pub bytes: u64,
    /// BLAKE3 of those bytes, hex (of a directory's files one after the
    /// other, depth first, each directory's entries in name order).
    pub blake3: String,
    /// A model directory's files, in name order (empty for a file).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<FileRead>,
    /// A model directory's `config.json` `model_type`, if it says one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_type: Option<String>,
}

impl WeightsRead {
    /// What reading a file or an adapter's files gave: `bytes` of BLAKE3
    /// `hash` from `path`.
    pub fn whole(path: impl Into<String>, bytes: u64, hash: blake3::Hash) -> Self {
        WeightsRead {
            path: path.into(),
            bytes,
            blake3: hash.to_hex().to_string(),
            files: Vec::new(),
            model_type: None,
        }
    }
}

/// One file of a model directory, as the engine read it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FileRead {
    /// Its name in the directory.
    pub name: String,
    /// Its bytes.
    pub bytes: u64,
    /// BLAKE3 of its bytes, hex.
    pub blake3: String,
    /// The tensors of a safetensors file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensors: Option<usize>,
}

/// Why the weights could not be read; the engine does not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WeightsError {
    /// A file or directory could not be read.
    #[error("cannot read the weights {}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// A model directory without `config.json`.
    #[error("the model directory {} has no config.json", dir.display())]
    NoConfig {
        /// The directory.
        dir: PathBuf,
    },
    /// `config.json` is not a JSON object.
    #[error("{}: not a JSON object: {reason}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A safetensors file the `safetensors` crate refuses.
    #[error("{}: not a valid safetensors file: {reason}", path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the crate said.
        reason: String,
    },
}

/// Reads the weights at `path`: a file whole, or a model directory (see
/// the module documentation). Blocking: every byte is read.
pub fn read(path: &Path) -> Result<WeightsRead, WeightsError> {
    let io_err = |p: &Path| {
        let p = p.to_owned();
        move |source| WeightsError::Io { path: p, source }
    };
    if !std::fs::metadata(path).map_err(io_err(path))?.is_dir() {
        let mut file = std::fs::File::open(path).map_err(io_err(path))?;
        let mut hasher = blake3::Hasher::new();
        let bytes = io::copy(&mut file, &mut hasher).map_err(io_err(path))?;
        return Ok(WeightsRead::whole(path.display().to_string(), bytes, hasher.finalize()));
    }
    let config_path = path.join("config.json");
    if !config_path.is_file() {
        return Err(WeightsError::NoConfig { dir: path.to_owned() });
    }
    let config = std::fs::read(&config_path).map_err(io_err(&config_path))?;
    let bad_config = |reason: String| WeightsError::Config { path: config_path.clone(), reason };
    let config: serde_json::Value = serde_json::from_slice(&config).map_err(|e| bad_config(e.to_string()))?;
    let Some(config) = config.as_object() else { return Err(bad_config("not an object".into())) };
    let model_type = config.get("model_type").and_then(|t| t.as_str()).map(str::to_owned);

    let mut total = blake3::Hasher::new();
    let (mut bytes, mut files) = (0u64, Vec::new());
    for entry in walkdir::WalkDir::new(path).follow_links(true).sort_by_file_name() {
        let entry = entry.map_err(|e| {
            let file = e.path().unwrap_or(path).to_path_buf();
            WeightsError::Io {
                path: file,
                source: e.into_io_error().unwrap_or_else(|| io::Error::other("a symbolic link loop")),
            }
        })?;
        if !entry.file_type().is_file() {
            continue;
        }
        let file_path = entry.path();
        let file = std::fs::File::open(file_path).map_err(io_err(file_path))?;
        let len = file.metadata().map_err(io_err(file_path))?.len();
        // SAFETY: a read-only map of a file only read here; the weights an
        // engine is handed are not written while it runs.
        let map = match len {
            0 => None,
            _ => Some(unsafe { memmap2::Mmap::map(&file) }.map_err(io_err(file_path))?),
        };
        let data: &[u8] = map.as_deref().unwrap_or_default();
        let name = file_path.strip_prefix(path).unwrap_or(file_path).display().to_string();
        let tensors = match name.ends_with(".safetensors") {
            false => None,
            true => {
                let (_, metadata) = SafeTensors::read_metadata(data).map_err(|e| {
                    WeightsError::Safetensors { path: file_path.to_owned(), reason: e.to_string() }
                })?;
                Some(metadata.tensors().len())
            }
        };
        total.update(data);
        bytes += len;
        files.push(FileRead { name, bytes: len, blake3: blake3::hash(data).to_hex().to_string(), tensors });
    }
    Ok(WeightsRead {
        path: path.display().to_string(),
        bytes,
        blake3: total.finalize().to_hex().to_string(),
        files,
        model_type,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of one `U8` tensor of `n` bytes, `data` after it.
    fn safetensors(n: usize, data: &[u8]) -> Vec<u8> {
        let header = format!(r#"{{"w":{{"dtype":"U8","shape":[{n}],"data_offsets":[0,{n}]}}}}"#);
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    fn model_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), br#"{"model_type": "llama"}"#).unwrap();
        std::fs::write(dir.path().join("model.safetensors"), safetensors(4, &[1, 2, 3, 4])).unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), b"{}").unwrap();
        dir
    }

    #[test]
    fn a_model_directory_is_read_whole_and_reported_file_by_file() {
        let dir = model_dir();
        let read = read(dir.path()).unwrap();
        assert_eq!(read.model_type.as_deref(), Some("llama"));
        let names: Vec<&str> = read.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["config.json", "model.safetensors", "tokenizer.json"]);
        assert_eq!(read.files[1].tensors, Some(1));
        assert_eq!(read.files[0].tensors, None);
        let mut all = Vec::new();
        for f in &names {
            all.extend(std::fs::read(dir.path().join(f)).unwrap());
        }
        assert_eq!(read.bytes, all.len() as u64);
        assert_eq!(read.blake3, blake3::hash(&all).to_hex().to_string());
    }

    #[test]
    fn a_directory_an_engine_could_not_load_fails_naming_the_file() {
        type Break = fn(&Path);
        let cases: Vec<(&str, Break, &str)> = vec![
            ("no config", |d| std::fs::remove_file(d.join("config.json")).unwrap(), "has no config.json"),
            (
                "config not JSON",
                |d| std::fs::write(d.join("config.json"), b"{").unwrap(),
                "config.json: not a JSON object",
            ),
            (
                "config an array",
                |d| std::fs::write(d.join("config.json"), b"[]").unwrap(),
                "config.json: not a JSON object",
            ),
            (
                "truncated",
                |d| {
                    std::fs::write(d.join("model.safetensors"), &safetensors(4, &[1, 2, 3, 4])[..20]).unwrap()
                },
                "model.safetensors: not a valid safetensors file: invalid header length",
            ),
            (
                "header not JSON",
                |d| {
                    let mut b = safetensors(4, &[1, 2, 3, 4]);
                    b[8] = b'[';
                    std::fs::write(d.join("model.safetensors"), b).unwrap()
                },
                "model.safetensors: not a valid safetensors file: invalid JSON in header",
            ),
            (
                "offsets outside the data",
                |d| std::fs::write(d.join("model.safetensors"), safetensors(8, &[1, 2, 3, 4])).unwrap(),
                "model.safetensors: not a valid safetensors file",
            ),
        ];
        for (label, break_it, says) in cases {
            let dir = model_dir();
            break_it(dir.path());
            let e = read(dir.path()).expect_err(label).to_string();
            assert!(e.contains(says), "{label}: {e}");
            assert!(e.contains(dir.path().to_str().unwrap()), "{label} names the path: {e}");
        }
    }
}
