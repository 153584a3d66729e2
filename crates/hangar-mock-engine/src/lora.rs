//! vLLM's runtime LoRA API (served with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`):
//! `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` and
//! `POST /v1/unload_lora_adapter` `{"lora_name"}`, answered as vLLM answers
//! them. The handlers only do the I/O — read every byte of the adapter,
//! sleep its load time — and ask the sans-IO [`AdapterTable`] at each step
//! what is allowed.
//!
//! A load reads the files under `lora_path` (a PEFT adapter directory, or
//! one file) whole, hashing them with BLAKE3, and ends
//! `bytes / lora_load_bytes_per_s + lora_load_ms` after it began (or when
//! the reading is done, if that took longer); loads run one at a time, in
//! the order they were asked for. Only then do requests naming the
//! adapter run.

use std::io;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::Notify;

use crate::adapters::{load_time, Adapter, AdapterTable, LoadRefused, UnloadRefused};
use crate::api::{parse_ready, Shared};
use crate::error::ApiError;
use crate::WeightsRead;

/// The engine's adapters and how long loading one takes.
pub(crate) struct Lora {
    table: Mutex<AdapterTable>,
    /// Woken whenever a load finishes or is abandoned: the next may start.
    turn: Notify,
    bytes_per_s: NonZeroU64,
    fixed: Duration,
}

impl Lora {
    pub fn new(base: &str, max_loras: usize, bytes_per_s: NonZeroU64, fixed: Duration) -> Self {
        Self {
            table: Mutex::new(AdapterTable::new(base, max_loras)),
            turn: Notify::new(),
            bytes_per_s,
            fixed,
        }
    }

    fn table(&self) -> MutexGuard<'_, AdapterTable> {
        // The table's methods do not panic midway; a poisoned lock still
        // holds a consistent table.
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The salt of the loaded adapter named `model`, if there is one.
    pub fn resolve(&self, model: &str) -> Option<u64> {
        self.table().resolve(model).map(|a| a.salt)
    }

    /// `/v1/models` entries of the loaded adapters, as vLLM lists them
    /// (`root` the path it was loaded from, `parent` the base model), with
    /// what was read and how long the load took.
    pub fn cards(&self, base: &str) -> Vec<Value> {
        self.table().loaded().iter().map(|a| card(a, base)).collect()
    }

    /// Waits until the load of `name` may run (see
    /// [`AdapterTable::try_start`]).
    ///
    /// # Cancel safety
    /// Cancel-safe: dropped, it has taken nothing (a turn is taken only by
    /// the check that returns).
    async fn my_turn(&self, name: &str) {
        loop {
            let mut turn = std::pin::pin!(self.turn.notified());
            // Registered before the check, so a load finishing between the
            // check and the wait still wakes this one.
            turn.as_mut().enable();
            if self.table().try_start(name) {
                return;
            }
            turn.await;
        }
    }
}

fn card(a: &Adapter, base: &str) -> Value {
    json!({
        "id": a.name, "object": "model", "created": 0, "owned_by": "hangar",
        "root": a.read.path, "parent": base,
        "weights": a.read, "load_ms": a.load_time.as_secs_f64() * 1000.0,
    })
}

/// A load's reservation in the table, given back if the load does not
/// finish (the files could not be read, or the client left and the
/// handler was dropped), so its name and slot are free and the next load
/// may start.
struct Reservation<'a> {
    lora: &'a Lora,
    name: &'a str,
    finished: bool,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.lora.table().abort(self.name);
            self.lora.turn.notify_waiters();
        }
    }
}

/// `POST /v1/load_lora_adapter`'s body; vLLM's field names.
#[derive(Deserialize)]
struct LoadRequest {
    #[serde(default)]
    lora_name: String,
    #[serde(default)]
    lora_path: String,
}

/// `POST /v1/unload_lora_adapter`'s body. vLLM also takes `lora_int_id`,
/// an id it gave the adapter; the mock names adapters only by name.
#[derive(Deserialize)]
struct UnloadRequest {
    #[serde(default)]
    lora_name: String,
}

/// `POST /v1/load_lora_adapter`: 200 with vLLM's text once the adapter is
/// loaded; 400 naming what is wrong (a missing field, a name in use, no
/// slot left, a file that cannot be read), 404 when nothing is at the path.
///
/// # Cancel safety
/// Dropped (the client left), the load is abandoned: its reservation is
/// given back and the next load starts.
pub(crate) async fn load(
    State(s): State<Shared>,
    b: Result<Bytes, BytesRejection>,
) -> Result<String, ApiError> {
    let req: LoadRequest = parse_ready(&s, b)?;
    let (name, path) = (req.lora_name.as_str(), req.lora_path.as_str());
    s.lora.table().request_load(name, path).map_err(|e| {
        let param =
            if !name.is_empty() && e == LoadRefused::MissingField { "lora_path" } else { "lora_name" };
        let kind = if matches!(e, LoadRefused::Full { .. }) { "BadRequestError" } else { "InvalidUserInput" };
        refusal(StatusCode::BAD_REQUEST, kind, e.to_string(), param)
    })?;
    let mut reservation = Reservation { lora: &s.lora, name, finished: false };
    s.lora.my_turn(name).await;
    // Reading the bytes is part of the load: the load ends its modelled
    // time after it began, however long the reading itself took.
    let began = tokio::time::Instant::now();
    let owned = PathBuf::from(path);
    let read = tokio::task::spawn_blocking(move || read_adapter(&owned))
        .await
        .map_err(|_| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "InternalServerError",
            message: format!("Loading lora {name} failed: reading it stopped"),
            param: None,
            code: None,
        })?
        .map_err(|e| match e {
            ReadError::NotFound => refusal(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                format!("Loading lora {name} failed: No adapter found for {path}"),
                "lora_path",
            ),
            ReadError::Io { file, source } => refusal(
                StatusCode::BAD_REQUEST,
                "BadRequestError",
                format!("Loading lora {name} failed: cannot read {}: {source}", file.display()),
                "lora_path",
            ),
        })?;
    let took = load_time(read.bytes, s.lora.bytes_per_s, s.lora.fixed);
    tokio::time::sleep_until(began + took).await;
    let weights = WeightsRead::whole(path, read.bytes, read.hash);
    let salt = u64::from_le_bytes(read.hash.as_bytes()[..8].try_into().expect("a BLAKE3 hash has 32 bytes"));
    {
        let mut table = s.lora.table();
        table.finish(name, weights, took, salt).expect("the reservation holds the load in progress");
        s.metrics.adapter_loaded(table.loaded().len());
    }
    reservation.finished = true;
    drop(reservation);
    s.lora.turn.notify_waiters();
    tracing::info!(name, path, bytes = read.bytes, load_ms = took.as_millis() as u64, "LoRA adapter loaded");
    Ok(format!("Success: LoRA adapter '{name}' added successfully."))
}

/// `POST /v1/unload_lora_adapter`: 200 with vLLM's text, 400 without a
/// name, 404 for a name not loaded (vLLM's statuses).
pub(crate) async fn unload(
    State(s): State<Shared>,
    b: Result<Bytes, BytesRejection>,
) -> Result<String, ApiError> {
    let req: UnloadRequest = parse_ready(&s, b)?;
    let name = req.lora_name.as_str();
    let mut table = s.lora.table();
    table.unload(name).map_err(|e| match e {
        UnloadRefused::NotFound(_) => {
            refusal(StatusCode::NOT_FOUND, "NotFoundError", e.to_string(), "lora_name")
        }
        _ => refusal(StatusCode::BAD_REQUEST, "InvalidUserInput", e.to_string(), "lora_name"),
    })?;
    s.metrics.adapter_unloaded(table.loaded().len());
    drop(table);
    tracing::info!(name, "LoRA adapter unloaded");
    Ok(format!("Success: LoRA adapter '{name}' removed successfully."))
}

/// An error answer with vLLM's error `type`.
fn refusal(status: StatusCode, kind: &'static str, message: String, param: &str) -> ApiError {
    ApiError { status, kind, message, param: Some(param.into()), code: None }
}

/// What reading an adapter gave.
struct Read {
    bytes: u64,
    hash: blake3::Hash,
}

/// Why an adapter could not be read.
#[derive(Debug)]
enum ReadError {
    /// Nothing at the path, or a directory holding no file (vLLM: "No
    /// adapter found").
    NotFound,
    /// A file or directory under the path could not be read.
    Io { file: PathBuf, source: io::Error },
}

/// Reads every file under `path` (itself, if a file), depth first with
/// each directory's entries in name order, following symbolic links, and
/// hashes their bytes in that order with BLAKE3.
fn read_adapter(path: &Path) -> Result<Read, ReadError> {
    let mut hasher = blake3::Hasher::new();
    let (mut bytes, mut files) = (0u64, 0usize);
    for entry in walkdir::WalkDir::new(path).follow_links(true).sort_by_file_name() {
        let entry = entry.map_err(|e| {
            let file = e.path().unwrap_or(path).to_path_buf();
            match e.into_io_error() {
                Some(source) if source.kind() == io::ErrorKind::NotFound && file == path => {
                    ReadError::NotFound
                }
                Some(source) => ReadError::Io { file, source },
                None => ReadError::Io { file, source: io::Error::other("a symbolic link loop") },
            }
        })?;
        if !entry.file_type().is_file() {
            continue;
        }
        let io = |source| ReadError::Io { file: entry.path().to_path_buf(), source };
        let mut file = std::fs::File::open(entry.path()).map_err(io)?;
        bytes += io::copy(&mut file, &mut hasher).map_err(io)?;
        files += 1;
    }
    if files == 0 {
        return Err(ReadError::NotFound);
    }
    Ok(Read { bytes, hash: hasher.finalize() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_adapter_is_read_whole_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("b.safetensors"), b"bbbb").unwrap();
        std::fs::write(dir.path().join("a.json"), b"aa").unwrap();
        std::fs::create_dir(dir.path().join("c")).unwrap();
        std::fs::write(dir.path().join("c/z"), b"z").unwrap();
        let r = read_adapter(dir.path()).unwrap();
        assert_eq!(r.bytes, 7);
        assert_eq!(r.hash, blake3::hash(b"aabbbbz"));
        let one = read_adapter(&dir.path().join("a.json")).unwrap();
        assert_eq!((one.bytes, one.hash), (2, blake3::hash(b"aa")));
        assert!(matches!(read_adapter(&dir.path().join("missing")), Err(ReadError::NotFound)));
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        assert!(matches!(read_adapter(&empty), Err(ReadError::NotFound)));
    }
}
