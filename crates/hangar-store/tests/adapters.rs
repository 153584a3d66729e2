//! LoRA adapters in the store: a PEFT directory imported as one artifact
//! bound to `BASE:ADAPTER`, listed, found, exported as the directory an
//! engine loads, and every directory the import refuses.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use hangar_core::AdapterRef;
use hangar_store::adapters::{self, AdapterEntry, ExportError, ImportError, RemoveError};
use hangar_store::directory::ScanError;
use hangar_store::synth::synth_adapter_dir;
use hangar_store::{ArtifactKind, BlobStore, IdOrKey, StoreError};
use safetensors::SafeTensors;

fn name(s: &str) -> AdapterRef {
    s.parse().unwrap()
}

/// A PEFT directory as users have it: the synthetic adapter plus a
/// tokenizer file and a README, kept whole.
fn peft_dir(dir: &Path, seed: u64) -> PathBuf {
    synth_adapter_dir(dir, "meta-llama/Meta-Llama-3-8B", 8, 96, 3, seed).unwrap();
    fs::write(dir.join("tokenizer.json"), format!("{{\"seed\": {seed}}}")).unwrap();
    fs::write(dir.join("README.md"), b"# a fine-tune\n").unwrap();
    dir.to_owned()
}

/// Every tensor of a safetensors file: name → (dtype, shape, bytes).
fn tensors(path: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let bytes = fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype().to_string(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn metadata(path: &Path) -> Option<std::collections::HashMap<String, String>> {
    let bytes = fs::read(path).unwrap();
    SafeTensors::read_metadata(&bytes).unwrap().1.metadata().clone()
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

#[test]
fn an_imported_adapter_is_listed_found_and_exported_as_the_directory_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let src = peft_dir(&dir.path().join("src"), 1);
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let a = name("meta/llama-3-8b:acme/support-v2");

    let report = adapters::import_dir(&store, &src, &a).unwrap();
    assert!(!report.existed && report.moved_from.is_none() && report.warnings.is_empty(), "{report:?}");
    assert_eq!(
        report.files,
        ["README.md", "adapter_config.json", "adapter_model.safetensors", "tokenizer.json"]
    );

    let listed = adapters::list(&store, None).unwrap();
    let entry = AdapterEntry { adapter: a.clone(), id: report.id, bytes: report.bytes, on_disk: true };
    assert_eq!(listed, vec![entry.clone()]);
    assert_eq!(adapters::find(&store, &a).unwrap(), Some(entry.clone()));
    assert_eq!(adapters::find(&store, &name("meta/llama-3-8b:acme/other")).unwrap(), None);
    assert_eq!(entry.sized().size.unwrap().bytes(), report.bytes);

    // The store lists it as an adapter, named.
    let summary = store.list().unwrap().into_iter().find(|s| s.id == report.id).unwrap();
    assert_eq!((summary.kind, summary.adapter.as_ref()), (ArtifactKind::Adapter, Some(&a)));
    assert!(summary.keys.is_empty());

    let under = dir.path().join("exports");
    let out = adapters::export_dir(&store, &entry, &under).unwrap();
    assert_eq!(out, under.join(report.id.file_name()));
    let (got, want) = (files(&out), files(&src));
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "the same file names");
    for f in ["adapter_config.json", "tokenizer.json", "README.md", "adapter_model.safetensors"] {
        assert_eq!(got[f], want[f], "{f} byte for byte");
    }
    let weights = "adapter_model.safetensors";
    assert_eq!(tensors(&out.join(weights)), tensors(&src.join(weights)), "the same tensors");
    assert_eq!(tensors(&src.join(weights)).len(), 3 * 4);
    assert_eq!(metadata(&out.join(weights)), metadata(&src.join(weights)), "the same metadata");
    let exported: u64 = got.values().map(|b| b.len() as u64).sum();
    assert_eq!(exported, report.bytes, "the size is the files' as exported");

    // Exporting again reuses the directory.
    fs::write(out.join("marker"), b"kept").unwrap();
    assert_eq!(adapters::export_dir(&store, &entry, &under).unwrap(), out);
    assert!(out.join("marker").exists());
    // An empty directory in the way is replaced; another one is an error.
    let elsewhere = dir.path().join("elsewhere");
    fs::create_dir_all(elsewhere.join(report.id.file_name())).unwrap();
    let again = adapters::export_dir(&store, &entry, &elsewhere).unwrap();
    assert_eq!(files(&again).len(), 4);
    fs::remove_file(again.join("adapter_config.json")).unwrap();
    let e = adapters::export_dir(&store, &entry, &elsewhere).unwrap_err();
    assert!(matches!(e, ExportError::Write { .. }) && e.to_string().contains(again.to_str().unwrap()), "{e}");

    // `hangar store get` writes the same directory.
    let art = store.open_artifact(&report.id).unwrap();
    let get = dir.path().join("get");
    hangar_store::export::write_artifact(&art.index, &art.map_verified().unwrap(), &get).unwrap();
    fs::remove_file(out.join("marker")).unwrap();
    assert_eq!(files(&get), files(&out));
}

#[test]
fn reimporting_is_idempotent_and_other_bytes_move_the_name() {
    let dir = tempfile::tempdir().unwrap();
    let src = peft_dir(&dir.path().join("src"), 2);
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let a = name("meta/llama-3-8b:acme/x");
    let first = adapters::import_dir(&store, &src, &a).unwrap();
    let again = adapters::import_dir(&store, &src, &a).unwrap();
    assert!(again.existed && again.moved_from.is_none(), "{again:?}");
    assert_eq!((again.id, again.bytes), (first.id, first.bytes));

    fs::write(src.join("tokenizer.json"), b"{\"retrained\": true}").unwrap();
    let moved = adapters::import_dir(&store, &src, &a).unwrap();
    assert!(!moved.existed);
    assert_ne!(moved.id, first.id);
    assert_eq!(moved.moved_from, Some(first.id), "the name moved and says from where");
    assert_eq!(adapters::find(&store, &a).unwrap().unwrap().id, moved.id);
    // The older artifact stays, an adapter without a name.
    let old = store.list().unwrap().into_iter().find(|s| s.id == first.id).unwrap();
    assert_eq!((old.kind, old.adapter), (ArtifactKind::Adapter, None));
}

#[test]
fn the_same_name_under_two_bases_is_two_adapters() {
    let dir = tempfile::tempdir().unwrap();
    let src = peft_dir(&dir.path().join("src"), 3);
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let (on_a, on_b) = (name("base/a:acme/x"), name("base/b:acme/x"));
    let a = adapters::import_dir(&store, &src, &on_a).unwrap();
    let b = adapters::import_dir(&store, &src, &on_b).unwrap();
    assert_ne!(a.id, b.id, "the binding is part of the content");
    assert!(!b.existed && b.moved_from.is_none());
    assert_eq!(adapters::find(&store, &on_a).unwrap().unwrap().id, a.id);
    assert_eq!(adapters::find(&store, &on_b).unwrap().unwrap().id, b.id);
    let all: Vec<AdapterRef> = adapters::list(&store, None).unwrap().into_iter().map(|e| e.adapter).collect();
    assert_eq!(all, [on_a.clone(), on_b.clone()]);
    let of_b = adapters::list(&store, Some(on_b.base())).unwrap();
    assert_eq!(of_b.len(), 1);
    assert_eq!(of_b[0].adapter, on_b);

    // The entry of one cannot export the other's artifact.
    let mut forged = adapters::find(&store, &on_a).unwrap().unwrap();
    forged.id = b.id;
    match adapters::export_dir(&store, &forged, &dir.path().join("x")) {
        Err(ExportError::NotThisAdapter { what, .. }) => assert!(what.contains("base/b:acme/x"), "{what}"),
        other => panic!("expected NotThisAdapter, got {other:?}"),
    }
    assert!(!dir.path().join("x").join(b.id.file_name()).exists());
}

#[test]
fn every_directory_an_engine_could_not_load_is_refused_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let a = name("meta/llama-3-8b:acme/x");
    let outside = dir.path().join("outside.json");
    fs::write(&outside, b"{}").unwrap();

    type Break = fn(&Path, &Path);
    let cases: Vec<(&str, Break, &str)> = vec![
        (
            "no-config",
            |d, _| fs::remove_file(d.join("adapter_config.json")).unwrap(),
            "has no adapter_config.json",
        ),
        (
            "not-json",
            |d, _| fs::write(d.join("adapter_config.json"), b"{r: 8").unwrap(),
            "adapter_config.json: not a JSON object",
        ),
        ("an-array", |d, _| fs::write(d.join("adapter_config.json"), b"[8]").unwrap(), "found an array"),
        (
            "no-weights",
            |d, _| fs::remove_file(d.join("adapter_model.safetensors")).unwrap(),
            "has no weights file",
        ),
        (
            "escaping-link",
            |d, o| std::os::unix::fs::symlink(o, d.join("special_tokens_map.json")).unwrap(),
            "outside",
        ),
        (
            "broken-link",
            |d, _| std::os::unix::fs::symlink(d.join("gone"), d.join("vocab.json")).unwrap(),
            "vocab.json",
        ),
        (
            "socket",
            |d, _| drop(std::os::unix::net::UnixListener::bind(d.join("s")).unwrap()),
            "is a socket, not a regular file",
        ),
        ("nested", |d, _| fs::create_dir(d.join("checkpoint-100")).unwrap(), "checkpoint-100 is a directory"),
        ("link-to-dir", |d, _| std::os::unix::fs::symlink(d, d.join("self")).unwrap(), "self is a directory"),
        ("reserved", |d, _| fs::write(d.join("__hangar_adapter__.json"), b"{}").unwrap(), "is reserved"),
        (
            "bad-weights",
            |d, _| {
                fs::write(d.join("adapter_model.safetensors"), b"\x10\x00\x00\x00\x00\x00\x00\x00{}").unwrap()
            },
            "header says",
        ),
    ];
    for (label, break_it, says) in cases {
        let d = peft_dir(&dir.path().join(label), 4);
        break_it(&d, &outside);
        let e = adapters::import_dir(&store, &d, &a).expect_err(label).to_string();
        assert!(e.contains(says), "{label}: {e}");
        assert!(e.contains(d.to_str().unwrap()), "{label} names the path: {e}");
    }
    let missing = dir.path().join("missing");
    let e = adapters::import_dir(&store, &missing, &a).unwrap_err();
    assert!(matches!(&e, ImportError::Scan(ScanError::Io { path, .. }) if *path == missing), "{e}");
    let e = adapters::import_dir(&store, &outside, &a).unwrap_err();
    assert!(matches!(e, ImportError::Scan(ScanError::NotADirectory { .. })), "{e}");

    assert!(adapters::list(&store, None).unwrap().is_empty(), "nothing registered");
    assert!(store.list().unwrap().is_empty(), "nothing stored");
}

#[test]
fn links_inside_the_directory_hidden_entries_and_a_bin_only_adapter_are_imported() {
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let src = peft_dir(&dir.path().join("src"), 5);
    // A .bin adapter: no safetensors, every file whole.
    fs::rename(src.join("adapter_model.safetensors"), src.join("adapter_model.bin")).unwrap();
    std::os::unix::fs::symlink(src.join("tokenizer.json"), src.join("tokenizer_config.json")).unwrap();
    fs::create_dir_all(src.join(".cache/huggingface")).unwrap();
    fs::write(src.join(".gitattributes"), b"*.bin lfs").unwrap();
    let a = name("meta/llama-3-8b:acme/bin");
    let report = adapters::import_dir(&store, &src, &a).unwrap();
    assert_eq!(report.skipped, [".cache", ".gitattributes"]);
    assert!(report.files.contains(&"tokenizer_config.json".to_owned()));
    let out =
        adapters::export_dir(&store, &adapters::find(&store, &a).unwrap().unwrap(), dir.path()).unwrap();
    let want = files(&src);
    assert_eq!(files(&out), want, "every file byte for byte, the link's target under the link's name");
    assert_eq!(want.values().map(|b| b.len() as u64).sum::<u64>(), report.bytes);
}

#[test]
fn a_base_model_unlike_the_base_is_a_warning_not_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let src = dir.path().join("src");
    synth_adapter_dir(&src, "mistralai/Mistral-7B-v0.1", 4, 32, 1, 6).unwrap();
    let report = adapters::import_dir(&store, &src, &name("meta/llama-3-8b:acme/x")).unwrap();
    assert_eq!(report.warnings.len(), 1, "{report:?}");
    assert!(report.warnings[0].contains("mistralai/Mistral-7B-v0.1"), "{}", report.warnings[0]);
    let fine = adapters::import_dir(&store, &src, &name("mistral/mistral-7b-v0.1:acme/x")).unwrap();
    assert!(fine.warnings.is_empty(), "{fine:?}");
}

#[test]
fn concurrent_exports_of_one_adapter_end_with_one_directory() {
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let src = peft_dir(&dir.path().join("src"), 7);
    let a = name("meta/llama-3-8b:acme/x");
    adapters::import_dir(&store, &src, &a).unwrap();
    let entry = adapters::find(&store, &a).unwrap().unwrap();
    let under = dir.path().join("exports");
    let barrier = std::sync::Barrier::new(8);
    let paths: Vec<PathBuf> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    adapters::export_dir(&store, &entry, &under).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(paths.iter().all(|p| *p == paths[0]), "{paths:?}");
    let entries: Vec<String> =
        fs::read_dir(&under).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(entries, [entry.id.file_name()], "one directory, no temporary one left");
    assert_eq!(
        tensors(&paths[0].join("adapter_model.safetensors")),
        tensors(&src.join("adapter_model.safetensors"))
    );
}

#[test]
fn an_export_never_writes_bytes_that_fail_their_hash_nor_bytes_the_disk_budget_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let src = peft_dir(&dir.path().join("src"), 8);
    let a = name("meta/llama-3-8b:acme/x");
    let report = adapters::import_dir(&store, &src, &a).unwrap();
    let entry = adapters::find(&store, &a).unwrap().unwrap();
    let data = store.root().join("artifacts").join(report.id.file_name()).join("data");
    let good = fs::read(&data).unwrap();
    let mut bad = good.clone();
    bad[100] ^= 1;
    fs::write(&data, &bad).unwrap();
    let under = dir.path().join("exports");
    match adapters::export_dir(&store, &entry, &under) {
        Err(ExportError::Read { source, .. })
            if matches!(*source, StoreError::HashMismatch { chunk: 0, .. }) => {}
        other => panic!("expected a hash mismatch, got {other:?}"),
    }
    assert!(!under.exists() || fs::read_dir(&under).unwrap().next().is_none(), "nothing written");

    fs::write(&data, &good).unwrap();
    assert!(store.drop_data(&report.id).unwrap());
    let entry = adapters::find(&store, &a).unwrap().unwrap();
    assert!(!entry.on_disk, "the name stays, the bytes are gone");
    let e = adapters::export_dir(&store, &entry, &under).unwrap_err();
    assert!(matches!(e, ExportError::NotOnDisk { .. }), "{e}");
    assert!(e.to_string().contains("import-adapter"), "{e}");
    // Importing the directory again puts the bytes back.
    adapters::import_dir(&store, &src, &a).unwrap();
    assert!(adapters::find(&store, &a).unwrap().unwrap().on_disk);
    adapters::export_dir(&store, &entry, &under).unwrap();
}

#[test]
fn removing_a_name_removes_its_artifact_unless_a_key_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let src = peft_dir(&dir.path().join("src"), 9);
    let (x, y) = (name("m:acme/x"), name("m:acme/y"));
    let rx = adapters::import_dir(&store, &src, &x).unwrap();
    let ry = adapters::import_dir(&store, &src, &y).unwrap();

    let removed = adapters::remove(&store, &x).unwrap();
    assert_eq!((removed.id, removed.artifact_removed), (rx.id, true));
    assert!(!store.knows(&rx.id));
    let e = adapters::remove(&store, &x).unwrap_err();
    assert!(matches!(e, RemoveError::Unknown { .. }) && e.to_string().contains("m:acme/x"), "{e}");

    // A key on the artifact keeps it when the name goes, and a name keeps
    // it when the key goes.
    store.set_key(&"pinned/y:v1".parse().unwrap(), &ry.id).unwrap();
    assert_eq!(store.remove(&IdOrKey::Key("pinned/y:v1".parse().unwrap())).unwrap(), []);
    assert!(store.knows(&ry.id) && adapters::find(&store, &y).unwrap().is_some());
    store.set_key(&"pinned/y:v1".parse().unwrap(), &ry.id).unwrap();
    assert!(!adapters::remove(&store, &y).unwrap().artifact_removed);
    assert!(store.knows(&ry.id));

    // Removing the artifact by id removes every name of it.
    adapters::import_dir(&store, &src, &y).unwrap();
    assert_eq!(store.remove(&IdOrKey::Id(ry.id)).unwrap(), [ry.id]);
    assert!(adapters::list(&store, None).unwrap().is_empty() && store.keys().unwrap().is_empty());
}

#[test]
fn exports_of_adapters_no_longer_registered_are_pruned_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let under = dir.path().join("exports");
    let (a, b) = (name("m:acme/a"), name("m:acme/b"));
    adapters::import_dir(&store, &peft_dir(&dir.path().join("a"), 1), &a).unwrap();
    adapters::import_dir(&store, &peft_dir(&dir.path().join("b"), 2), &b).unwrap();
    let entry = |x: &AdapterRef| adapters::find(&store, x).unwrap().unwrap();
    let (dir_a, dir_b) = (
        adapters::export_dir(&store, &entry(&a), &under).unwrap(),
        adapters::export_dir(&store, &entry(&b), &under).unwrap(),
    );
    // An export in progress and a stray file stay whatever happens.
    fs::create_dir_all(under.join(".staging-1")).unwrap();
    fs::write(under.join("notes.txt"), b"x").unwrap();

    let registered = |store: &BlobStore| {
        adapters::list(store, None).unwrap().into_iter().map(|e| e.id).collect::<Vec<_>>()
    };
    assert!(adapters::prune_exports(&under, &registered(&store)).unwrap().is_empty(), "both registered");
    adapters::remove(&store, &b).unwrap();
    assert_eq!(adapters::prune_exports(&under, &registered(&store)).unwrap(), std::slice::from_ref(&dir_b));
    assert!(dir_a.join("adapter_config.json").is_file() && !dir_b.exists());
    assert!(under.join(".staging-1").is_dir() && under.join("notes.txt").is_file());
    // A directory that does not exist has nothing to prune.
    assert!(adapters::prune_exports(&dir.path().join("none"), &[]).unwrap().is_empty());
}

/// `synth::register_adapter`, which tests and benchmarks use to fill a
/// store: the same adapter and seed make the same artifact in any store
/// (a fleet's nodes must agree on it), another seed another one.
#[test]
fn a_synthetic_adapter_registered_with_one_seed_is_one_artifact_everywhere() {
    use hangar_store::synth::{register_adapter, AdapterShape};
    let dir = tempfile::tempdir().unwrap();
    let a = name("t/base:acme/a");
    let stores: Vec<BlobStore> =
        ["one", "two"].iter().map(|n| BlobStore::open(dir.path().join(n)).unwrap()).collect();
    let ids: Vec<_> =
        stores.iter().map(|s| register_adapter(s, &a, AdapterShape::TINY, 3).unwrap().id).collect();
    assert_eq!(ids[0], ids[1]);
    assert_eq!(adapters::find(&stores[1], &a).unwrap().unwrap().id, ids[1], "registered under its name");
    let other = register_adapter(&stores[0], &name("t/base:acme/b"), AdapterShape::TINY, 4).unwrap().id;
    assert_ne!(other, ids[0]);
}
