//! A model directory as a replica's weights: written once per node from
//! the store (every file as it was imported), read-only, shared by every
//! replica that uses it, removed with the last of them unless another
//! process holds it too; and weights that are neither a file nor a model
//! directory refused by name.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::files;
use hangar_agent::weights::{HandedWeights, StoreSettings, WeightStore, WeightsSource, MODEL_DIRS};
use hangar_core::ModelKey;
use hangar_store::client::fresh_replica;
use hangar_store::{directory, synth, BlobStore};

fn dir_of(handed: HandedWeights) -> PathBuf {
    match handed {
        HandedWeights::Directory(dir) => dir,
        other => panic!("a model directory is handed as a directory, not {other:?}"),
    }
}

/// A store under `dir` holding a synthetic model directory under
/// `tiny/llama:v1` and a safetensors artifact under `tensors:v1`, and the
/// node's weight store over it (its daemon in this process).
fn node(dir: &Path) -> (Arc<WeightStore>, ModelKey, WeightsSource, PathBuf) {
    let src = dir.join("src");
    synth::synth_model_dir(&src, 64, 2, 2, 9).unwrap();
    let root = dir.join("store");
    let blobs = BlobStore::open(&root).unwrap();
    directory::import_model_dir(&blobs, &src, &["tiny/llama:v1".parse().unwrap()]).unwrap();
    let shards: Vec<PathBuf> =
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"].map(|f| src.join(f)).into();
    blobs.import_files(&shards, &["tensors:v1".parse().unwrap()]).unwrap();
    let settings =
        StoreSettings { root: Some(root), socket: Some(dir.join("store.sock")), ..StoreSettings::default() };
    let model: ModelKey = "t/dir".parse().unwrap();
    let source: WeightsSource = "store:tiny/llama:v1".parse().unwrap();
    let store = WeightStore::open(settings, [(&model, &source)]).unwrap();
    (Arc::new(store), model, source, src)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_model_directory_is_written_once_per_node_and_removed_with_its_last_replica() {
    let dir = tempfile::tempdir().unwrap();
    let (store, model, source, src) = node(dir.path());
    let (r1, r2) = (fresh_replica(), fresh_replica());

    let first = store.load(&model, &source, r1).await.unwrap();
    let path = dir_of(first.handed());
    assert!(path.starts_with(dir.path().join("store").join(MODEL_DIRS)), "{}", path.display());
    assert_eq!(files(&path), files(&src), "every file as it was imported");
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o555, "read-only");
    let config = std::fs::metadata(path.join("config.json")).unwrap();
    assert_eq!(config.permissions().mode() & 0o777, 0o444);
    assert_eq!(first.report.source, "local", "{:?}", first.report);

    let second = store.load(&model, &source, r2).await.unwrap();
    assert_eq!(dir_of(second.handed()), path, "one directory per node");
    assert_eq!(second.report.source, "resident", "{:?}", second.report);
    assert_eq!(second.report.bytes, first.report.bytes);

    store.release(r1).await;
    assert!(path.join("config.json").is_file(), "the second replica still uses it");
    store.release(r2).await;
    assert!(!path.exists(), "removed with its last replica");

    // Another process holding it (its shared lock): the last replica of
    // this one leaves it be.
    let lock_path = PathBuf::from(format!("{}.lock", path.display()));
    let r3 = fresh_replica();
    let third = store.load(&model, &source, r3).await.unwrap();
    assert_eq!(dir_of(third.handed()), path, "written again where it was");
    let other = std::fs::File::open(&lock_path).unwrap();
    rustix::fs::flock(&other, rustix::fs::FlockOperation::LockShared).unwrap();
    store.release(r3).await;
    assert!(path.join("config.json").is_file(), "another process holds it");
    drop(other);

    // What a process that died left is swept when a weight store opens.
    drop(store);
    let (again, ..) = node(dir.path());
    assert!(!path.exists(), "swept: no process held it");
    drop(again);
}

#[tokio::test(flavor = "multi_thread")]
async fn weights_neither_a_file_nor_a_model_directory_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let (store, model, _, _) = node(dir.path());
    let tensors: WeightsSource = "store:tensors:v1".parse().unwrap();
    let e = store.load(&model, &tensors, fresh_replica()).await.unwrap_err().to_string();
    assert!(e.contains("model t/dir") && e.contains("store:tensors:v1"), "{e}");
    assert!(e.contains("are not a model directory") && e.contains("hangar store import DIR"), "{e}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_model_directory_given_by_its_path_is_imported_on_first_use() {
    let dir = tempfile::tempdir().unwrap();
    let (store, model, by_key, src) = node(dir.path());
    let by_path = WeightsSource::File(src.clone());
    let (r1, r2) = (fresh_replica(), fresh_replica());
    let a = store.load(&model, &by_path, r1).await.unwrap();
    let b = store.load(&model, &by_key, r2).await.unwrap();
    assert_eq!(a.report.artifact, b.report.artifact, "the same files are the same artifact");
    assert_eq!(dir_of(a.handed()), dir_of(b.handed()));
    store.release(r1).await;
    store.release(r2).await;

    // Another version of a file is imported again.
    std::fs::write(src.join("tokenizer_config.json"), b"{\"model_max_length\": 4096}").unwrap();
    let r3 = fresh_replica();
    let c = store.load(&model, &by_path, r3).await.unwrap();
    assert_ne!(c.report.artifact, a.report.artifact, "a changed file is a new version");
    let path = dir_of(c.handed());
    assert_eq!(std::fs::read(path.join("tokenizer_config.json")).unwrap(), b"{\"model_max_length\": 4096}");
    store.release(r3).await;
}
