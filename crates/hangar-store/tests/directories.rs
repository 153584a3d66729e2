//! Model directories in the store: a Hugging Face model directory imported
//! as one directory artifact, listed as `model-dir`, written back byte for
//! byte (safetensors shards included), and every directory the import
//! refuses, each naming the path.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use hangar_store::directory::{self, ExportError, ImportError};
use hangar_store::synth::synth_model_dir;
use hangar_store::{ArtifactKind, BlobStore, StoreKey};

fn key(s: &str) -> StoreKey {
    s.parse().unwrap()
}

/// The files of a directory but its hidden entries, name → bytes.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| !e.file_name().to_str().unwrap().starts_with('.'))
        .map(|e| (e.file_name().into_string().unwrap(), fs::read(e.path()).unwrap()))
        .collect()
}

/// A safetensors file as no writer of this repository lays one out: keys
/// out of order, the data in another order than the keys, metadata last,
/// the header padded with spaces to an odd length.
fn odd_safetensors(path: &Path) {
    let header = br#"{"z.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a.weight":{"dtype":"U8","shape":[3],"data_offsets":[8,11]},"__metadata__":{"format":"pt","by":"hand"}}     "#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
    fs::write(path, bytes).unwrap();
}

#[test]
fn a_model_directory_is_one_artifact_written_back_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("tiny-llama");
    synth_model_dir(&src, 64, 3, 2, 1).unwrap();
    odd_safetensors(&src.join("extra.safetensors"));
    fs::create_dir_all(src.join(".cache/huggingface")).unwrap();
    fs::write(src.join(".gitattributes"), b"*.safetensors filter=lfs\n").unwrap();
    std::os::unix::fs::symlink(src.join("tokenizer.json"), src.join("vocab.json")).unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();

    let report = directory::import_model_dir(&store, &src, &[key("tiny/llama:v1")]).unwrap();
    assert!(!report.existed, "{report:?}");
    assert_eq!(report.skipped, [".cache", ".gitattributes"]);
    assert_eq!(
        report.files,
        [
            "config.json",
            "extra.safetensors",
            "generation_config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "vocab.json",
        ]
    );
    let want = files(&src);
    assert_eq!(report.bytes, want.values().map(|b| b.len() as u64).sum::<u64>());
    // Embeddings, head, final norm, 9 per layer, and the odd file's two.
    assert_eq!(report.tensors, 3 + 9 * 3 + 2);

    let again = directory::import_model_dir(&store, &src, &[]).unwrap();
    assert!(again.existed && again.id == report.id, "the same files are the same artifact");
    let summary = store.list().unwrap().into_iter().find(|s| s.id == report.id).unwrap();
    assert_eq!(summary.kind, ArtifactKind::ModelDir);
    assert_eq!(summary.kind.as_str(), "model-dir");
    assert_eq!(summary.keys, [key("tiny/llama:v1")]);

    let under = dir.path().join("exports");
    let out = directory::export(&store, &report.id, &under).unwrap();
    assert_eq!(out, under.join(report.id.file_name()));
    assert_eq!(files(&out), want, "every file byte for byte, the shards and the odd one included");
    assert_eq!(directory::export(&store, &report.id, &under).unwrap(), out, "exported once");

    // `hangar store get` writes the same directory.
    let art = store.open_artifact(&report.id).unwrap();
    let get = dir.path().join("get");
    hangar_store::export::write_artifact(&art.index, &art.map_verified().unwrap(), &get).unwrap();
    assert_eq!(files(&get), want);

    // Pruning keeps what is wanted, removes the rest, read-only or not.
    directory::make_read_only(&out).unwrap();
    assert!(directory::prune_exports(&under, [&report.id]).unwrap().is_empty());
    assert_eq!(directory::prune_exports(&under, []).unwrap(), std::slice::from_ref(&out));
    assert!(!out.exists());
}

#[test]
fn concurrent_exports_of_one_directory_end_with_one_directory() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("m");
    synth_model_dir(&src, 64, 2, 2, 2).unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let id = directory::import_model_dir(&store, &src, &[]).unwrap().id;
    let under = dir.path().join("exports");
    let paths: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> =
            (0..4).map(|_| s.spawn(|| directory::export(&store, &id, &under).unwrap())).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(paths.iter().all(|p| *p == paths[0]), "{paths:?}");
    let entries: Vec<String> =
        fs::read_dir(&under).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(entries, [id.file_name()], "one directory, no temporary one left");
    assert_eq!(files(&paths[0]), files(&src));
}

#[test]
fn an_export_never_writes_bytes_that_fail_their_hash_and_refuses_what_is_not_a_model_directory() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("m");
    synth_model_dir(&src, 64, 2, 1, 3).unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let id = directory::import_model_dir(&store, &src, &[]).unwrap().id;
    let data = dir.path().join("store/artifacts").join(id.file_name()).join("data");
    let mut bytes = fs::read(&data).unwrap();
    bytes[100] ^= 0xff;
    fs::write(&data, bytes).unwrap();
    let under = dir.path().join("exports");
    let e = directory::export(&store, &id, &under).unwrap_err();
    assert!(matches!(e, ExportError::Read { .. }), "{e}");
    assert!(!under.exists() || fs::read_dir(&under).unwrap().next().is_none(), "nothing written");

    // A file imported whole is no model directory; an adapter is none either.
    let gguf = dir.path().join("w.gguf");
    fs::write(&gguf, b"GGUF and more").unwrap();
    let file = store.import_files(&[gguf], &[]).unwrap().id;
    let e = directory::export(&store, &file, &under).unwrap_err();
    assert!(e.to_string().contains("is not a model directory"), "{e}");
    let peft = dir.path().join("peft");
    hangar_store::synth::synth_adapter_dir(&peft, "b", 4, 32, 1, 1).unwrap();
    let adapter = hangar_store::adapters::import_dir(&store, &peft, &"b:x".parse().unwrap()).unwrap().id;
    let e = directory::export(&store, &adapter, &under).unwrap_err();
    assert!(e.to_string().contains("is a LoRA adapter"), "{e}");
}

#[test]
fn every_directory_an_engine_could_not_load_is_refused_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let outside = dir.path().join("outside.json");
    fs::write(&outside, b"{}").unwrap();

    type Break = fn(&Path, &Path);
    let cases: Vec<(&str, Break, &str)> = vec![
        ("no-config", |d, _| fs::remove_file(d.join("config.json")).unwrap(), "has no config.json"),
        (
            "config-not-json",
            |d, _| fs::write(d.join("config.json"), b"{\"a\": ").unwrap(),
            "config.json: not a JSON object",
        ),
        ("config-an-array", |d, _| fs::write(d.join("config.json"), b"[1]").unwrap(), "found an array"),
        (
            "truncated",
            |d, _| {
                let bytes = fs::read(d.join("model-00001-of-00001.safetensors")).unwrap();
                fs::write(d.join("model-00001-of-00001.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
            },
            "truncated?",
        ),
        (
            "header-past-the-end",
            |d, _| {
                let mut bytes = fs::read(d.join("model-00001-of-00001.safetensors")).unwrap();
                let len = bytes.len() as u64;
                bytes[..8].copy_from_slice(&len.to_le_bytes());
                fs::write(d.join("model-00001-of-00001.safetensors"), bytes).unwrap();
            },
            "header says it is",
        ),
        (
            "shorter-than-a-length",
            |d, _| fs::write(d.join("model-00001-of-00001.safetensors"), b"\x01\x02").unwrap(),
            "shorter than the 8-byte header length",
        ),
        (
            "header-not-json",
            |d, _| {
                let mut bytes = fs::read(d.join("model-00001-of-00001.safetensors")).unwrap();
                bytes[8] = b'[';
                fs::write(d.join("model-00001-of-00001.safetensors"), bytes).unwrap();
            },
            "malformed header",
        ),
        (
            "offsets-outside-the-data",
            |d, _| {
                let s: &[u8] = br#"{"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#;
                let mut bytes = (s.len() as u64).to_le_bytes().to_vec();
                bytes.extend_from_slice(s);
                bytes.extend_from_slice(&[0; 4]);
                fs::write(d.join("model-00001-of-00001.safetensors"), bytes).unwrap();
            },
            "data ends at byte",
        ),
        (
            "a-hole-in-the-data",
            |d, _| {
                let s: &[u8] = br#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#;
                let mut bytes = (s.len() as u64).to_le_bytes().to_vec();
                bytes.extend_from_slice(s);
                bytes.extend_from_slice(&[0; 8]);
                fs::write(d.join("model-00001-of-00001.safetensors"), bytes).unwrap();
            },
            "belong to no tensor",
        ),
        (
            "escaping-link",
            |d, o| std::os::unix::fs::symlink(o, d.join("special_tokens_map.json")).unwrap(),
            "outside",
        ),
        (
            "broken-link",
            |d, _| std::os::unix::fs::symlink(d.join("gone"), d.join("merges.txt")).unwrap(),
            "merges.txt",
        ),
        (
            "socket",
            |d, _| drop(std::os::unix::net::UnixListener::bind(d.join("s")).unwrap()),
            "is a socket, not a regular file",
        ),
        ("nested", |d, _| fs::create_dir(d.join("original")).unwrap(), "original is a directory"),
        ("reserved", |d, _| fs::write(d.join("__hangar_directory__.json"), b"{}").unwrap(), "is reserved"),
    ];
    for (label, break_it, says) in cases {
        let d = dir.path().join(label);
        synth_model_dir(&d, 64, 1, 1, 4).unwrap();
        break_it(&d, &outside);
        let e = directory::import_model_dir(&store, &d, &[key("m:v1")]).expect_err(label).to_string();
        assert!(e.contains(says), "{label}: {e}");
        assert!(e.contains(d.to_str().unwrap()), "{label} names the path: {e}");
    }
    let e = directory::import_model_dir(&store, &outside, &[]).unwrap_err();
    assert!(matches!(e, ImportError::Scan(directory::ScanError::NotADirectory { .. })), "{e}");
    assert!(store.list().unwrap().is_empty(), "nothing stored");
    assert!(store.keys().unwrap().is_empty(), "no key set");
}
