//! Blob store: identity, idempotent import, streaming registration, corruption
//! detection and bad input.

use std::fs;

use hangar_store::synth::{model, write_files};
use hangar_store::{BlobStore, IdOrKey, StoreError, StoreKey};

fn key(s: &str) -> StoreKey {
    s.parse().unwrap()
}

#[test]
fn same_tensors_from_differently_split_files_get_the_same_id() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = model(3 << 20, 3, 7);
    let one = write_files(&dir.path().join("one"), &tensors, 1).unwrap();
    let mut three = write_files(&dir.path().join("three"), &tensors, 3).unwrap();
    three.reverse();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let a = store.import_files(&one, &[key("m:one")]).unwrap();
    let b = store.import_files(&three, &[key("m:three")]).unwrap();
    assert!(!a.existed);
    assert!(b.existed, "same content must be an idempotent no-op");
    assert_eq!(a.id, b.id);
    let listed = store.list().unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].keys, vec![key("m:one"), key("m:three")]);
    store.open_artifact(&a.id).unwrap().map_verified().unwrap();
}

#[test]
fn one_flipped_byte_changes_the_id_and_stored_corruption_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = model(2 << 20, 2, 1);
    let files = write_files(&dir.path().join("src"), &tensors, 1).unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let a = store.import_files(&files, &[]).unwrap();

    let mut bytes = fs::read(&files[0]).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    fs::write(&files[0], &bytes).unwrap();
    let b = store.import_files(&files, &[]).unwrap();
    assert_ne!(a.id, b.id);
    assert_eq!(a.id.to_string().split(':').nth(1), b.id.to_string().split(':').nth(1), "same index");

    // Flip a byte of the stored data: reads must fail, never serve it.
    let data = store.root().join("artifacts").join(a.id.file_name()).join("data");
    let mut stored = fs::read(&data).unwrap();
    stored[(1 << 20) + 3] ^= 1;
    fs::write(&data, &stored).unwrap();
    let art = store.open_artifact(&a.id).unwrap();
    match art.map_verified().map(drop) {
        Err(StoreError::HashMismatch { id, chunk: 1 }) => assert_eq!(id, a.id),
        other => panic!("expected a mismatch at chunk 1, got {other:?}"),
    }
}

#[test]
fn streaming_registration_matches_file_import_and_aborts_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = model(1 << 20, 2, 3);
    let files = write_files(&dir.path().join("src"), &tensors, 2).unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let specs = || hangar_store::synth::specs(&tensors);

    let mut reg = store.register(specs()).unwrap();
    for (n, t) in tensors.iter().rev() {
        let (a, b) = t.data.split_at(t.data.len() / 3);
        reg.feed(n, a).unwrap();
        reg.feed(n, b).unwrap();
    }
    assert!(matches!(reg.feed("nope", b"x"), Err(StoreError::UnknownTensor(_))));
    assert!(matches!(reg.feed(&tensors[0].0, b"x"), Err(StoreError::Overfeed { .. })));
    let streamed = reg.commit(&[key("s:1")]).unwrap();
    let imported = store.import_files(&files, &[]).unwrap();
    assert_eq!(streamed.id, imported.id);
    assert!(imported.existed);

    let mut partial = store.register(specs()).unwrap();
    partial.feed(&tensors[0].0, &tensors[0].1.data[..10]).unwrap();
    assert!(matches!(partial.commit(&[]), Err(StoreError::Incomplete { .. })));
    let aborted = store.register(specs()).unwrap();
    aborted.abort();
    assert_eq!(fs::read_dir(store.root().join("tmp")).unwrap().count(), 0, "staging left behind");
}

#[test]
fn rm_by_key_keeps_shared_artifacts_and_rm_by_id_removes_all_keys() {
    let dir = tempfile::tempdir().unwrap();
    let files = write_files(&dir.path().join("src"), &model(1 << 16, 1, 9), 1).unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let id = store.import_files(&files, &[key("a:1"), key("b:1")]).unwrap().id;
    assert_eq!(store.remove(&IdOrKey::Key(key("a:1"))).unwrap(), vec![]);
    assert_eq!(store.resolve(&IdOrKey::Key(key("b:1"))).unwrap(), id);
    assert!(matches!(store.resolve(&IdOrKey::Key(key("a:1"))), Err(StoreError::UnknownKey(_))));
    store.set_key(&key("c:1"), &id).unwrap();
    assert_eq!(store.remove(&IdOrKey::Id(id)).unwrap(), vec![id]);
    assert!(store.keys().unwrap().is_empty());
    assert!(matches!(store.resolve(&IdOrKey::Id(id)), Err(StoreError::UnknownArtifact(_))));
    assert!(matches!(store.remove(&IdOrKey::Id(id)), Err(StoreError::UnknownArtifact(_))));
}

#[test]
fn bad_safetensors_get_clear_errors_and_leave_nothing_visible() {
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let good = write_files(&dir.path().join("src"), &model(1 << 16, 1, 2), 1).unwrap().remove(0);
    let bytes = fs::read(&good).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let write = |name: &str, b: &[u8]| {
        let p = dir.path().join(name);
        fs::write(&p, b).unwrap();
        p
    };
    let with_header = |h: &str| {
        let mut v = (h.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(h.as_bytes());
        v.extend_from_slice(&[0; 16]);
        v
    };
    let cases: Vec<(std::path::PathBuf, &str)> = vec![
        (write("short.safetensors", &bytes[..5]), "truncated"),
        (write("cut.safetensors", &bytes[..bytes.len() - 100]), "truncated?"),
        (write("halfheader.safetensors", &bytes[..8 + header_len / 2]), "header says"),
        (write("bigheader.safetensors", &[&(1u64 << 40).to_le_bytes()[..], b"{}"].concat()), "exceeds"),
        (write("json.safetensors", &with_header("{\"a\": [")), "malformed header"),
        (
            write(
                "dtype.safetensors",
                &with_header(r#"{"a":{"dtype":"Q7","shape":[4],"data_offsets":[0,4]}}"#),
            ),
            "unknown dtype `Q7`",
        ),
    ];
    for (path, want) in cases {
        let err = store.import_files(std::slice::from_ref(&path), &[key("x:1")]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(want), "{}: `{msg}` lacks `{want}`", path.display());
        assert!(msg.contains(path.file_name().unwrap().to_str().unwrap()), "{msg} names no file");
    }
    let dup = store.import_files(&[good.clone(), good], &[]).unwrap_err();
    assert!(dup.to_string().contains("more than once"), "{dup}");
    assert!(store.list().unwrap().is_empty());
    assert!(store.keys().unwrap().is_empty());
    assert_eq!(fs::read_dir(store.root().join("tmp")).unwrap().count(), 0);
}

#[test]
fn a_file_that_is_not_safetensors_is_stored_whole_and_exported_as_itself() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.Q4_1.gguf");
    // Not a multiple of the 64-byte alignment nor of a chunk: the bytes come
    // back exactly, with no padding.
    let bytes: Vec<u8> = (0..(1u32 << 20) + 77).map(|i| (i * 31 % 251) as u8).collect();
    fs::write(&gguf, &bytes).unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let a = store.import_files(std::slice::from_ref(&gguf), &[key("smol:q4")]).unwrap();
    let art = store.open_artifact(&a.id).unwrap();
    assert_eq!(art.index.whole_file(), Some("tiny.Q4_1.gguf"));
    assert_eq!(art.index.data_len, bytes.len() as u64);
    assert_eq!(&art.map_verified().unwrap()[..], &bytes[..]);
    let out = hangar_store::export::write_artifact(
        &art.index,
        &art.map_verified().unwrap(),
        &dir.path().join("out"),
    )
    .unwrap();
    assert_eq!(out.file_name().unwrap(), "tiny.Q4_1.gguf");
    assert_eq!(fs::read(&out).unwrap(), bytes);
    // The same bytes under another name are another artifact: the name is
    // part of what an engine is handed.
    let renamed = dir.path().join("other.gguf");
    fs::copy(&gguf, &renamed).unwrap();
    assert_ne!(store.import_files(&[renamed], &[]).unwrap().id, a.id);
}

#[test]
fn a_safetensors_tensor_may_not_pose_as_a_whole_file() {
    let dir = tempfile::tempdir().unwrap();
    let header = br#"{"file:x.gguf":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[1, 2, 3, 4]);
    let path = dir.path().join("w.safetensors");
    fs::write(&path, bytes).unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let e = store.import_files(&[path], &[]).unwrap_err().to_string();
    assert!(e.contains("w.safetensors") && e.contains("reserved for whole files"), "{e}");
}

/// The disk budget drops bytes and keeps everything a key needs: the keys
/// still resolve (to "not on disk"), `list` shows the artifact as known but
/// not on disk, and importing the same content puts the bytes back.
#[test]
fn the_disk_budget_drops_bytes_keeps_keys_and_a_reimport_restores_them() {
    let dir = tempfile::tempdir().unwrap();
    let xs = write_files(&dir.path().join("x"), &model(1 << 16, 1, 40), 1).unwrap();
    let ys = write_files(&dir.path().join("y"), &model(1 << 16, 1, 41), 1).unwrap();
    let store = BlobStore::open(dir.path().join("store")).unwrap();
    let x = store.import_files(&xs, &[key("a:1"), key("b:1")]).unwrap().id;
    let y = store.import_files(&ys, &[key("c:1")]).unwrap().id;
    let keys = store.keys().unwrap();

    let mut dropped = store.enforce_disk_budget(0, &Default::default()).unwrap();
    dropped.sort();
    let mut both = vec![x, y];
    both.sort();
    assert_eq!(dropped, both);
    assert_eq!(store.keys().unwrap(), keys, "the budget never touches keys");
    assert!(!store.contains(&x) && store.knows(&x));
    assert!(store.usage().unwrap().is_empty(), "nothing left for the budget");
    assert!(store.enforce_disk_budget(0, &Default::default()).unwrap().is_empty());
    let listed = store.list().unwrap();
    assert_eq!(listed.len(), 2);
    assert!(listed.iter().all(|a| !a.on_disk && a.bytes > 0), "{listed:?}");
    match store.resolve(&IdOrKey::Key(key("a:1"))) {
        Err(e @ StoreError::NotOnDisk { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("`a:1`") && msg.contains(&x.to_string()) && msg.contains("disk budget"),
                "{msg}"
            );
        }
        other => panic!("expected not on disk, got {other:?}"),
    }

    let back = store.import_files(&xs, &[]).unwrap();
    assert_eq!(back.id, x);
    assert!(!back.existed, "the bytes were not there: they were written");
    store.open_artifact(&x).unwrap().map_verified().unwrap();
    assert_eq!(store.resolve(&IdOrKey::Key(key("b:1"))).unwrap(), x);
    assert_eq!(store.usage().unwrap().len(), 1);

    assert_eq!(
        store.remove(&IdOrKey::Key(key("c:1"))).unwrap(),
        vec![y],
        "a known artifact goes with its last key"
    );
    assert!(!store.knows(&y));
    assert_eq!(store.list().unwrap().len(), 1);
}

mod budget_model {
    use std::collections::{BTreeMap, BTreeSet, HashSet};

    use hangar_store::{ArtifactId, BlobStore, IdOrKey, StoreError, StoreKey};
    use proptest::prelude::*;

    const ARTIFACTS: usize = 4;

    #[derive(Debug, Clone)]
    enum Op {
        /// Import artifact `i`, under its key or none.
        Import(usize, bool),
        /// Apply a disk budget with these artifacts referenced.
        Budget(u64, [bool; ARTIFACTS]),
        /// Remove artifact `i`'s key.
        RmKey(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..ARTIFACTS, any::<bool>()).prop_map(|(i, k)| Op::Import(i, k)),
            (0u64..60_000, any::<[bool; ARTIFACTS]>()).prop_map(|(b, r)| Op::Budget(b, r)),
            (0..ARTIFACTS).prop_map(Op::RmKey),
        ]
    }

    fn key(i: usize) -> StoreKey {
        format!("m{i}:v1").parse().unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// Against a model of keys and known artifacts: a budget only ever
        /// drops bytes of unreferenced artifacts, never a key or what a key
        /// needs to resolve, and leaves the store under budget or holding
        /// only referenced bytes; an import puts dropped bytes back.
        #[test]
        fn the_budget_never_touches_keys(ops in prop::collection::vec(op(), 1..24)) {
            let dir = tempfile::tempdir().unwrap();
            let sources: Vec<_> = (0..ARTIFACTS)
                .map(|i| {
                    let t = hangar_store::synth::model(4096 * (i as u64 + 1), 1, 60 + i as u64);
                    hangar_store::synth::write_files(&dir.path().join(format!("src{i}")), &t, 1).unwrap()
                })
                .collect();
            let store = BlobStore::open(dir.path().join("store")).unwrap();
            let mut ids: [Option<ArtifactId>; ARTIFACTS] = [None; ARTIFACTS];
            let mut keys: BTreeMap<StoreKey, ArtifactId> = BTreeMap::new();
            let mut known: BTreeSet<ArtifactId> = BTreeSet::new();
            for op in ops {
                match op {
                    Op::Import(i, with_key) => {
                        let was_on_disk = ids[i].is_some_and(|id| store.contains(&id));
                        let k: Vec<StoreKey> = if with_key { vec![key(i)] } else { vec![] };
                        let r = store.import_files(&sources[i], &k).unwrap();
                        prop_assert_eq!(r.existed, was_on_disk, "dropped bytes are written again");
                        ids[i] = Some(r.id);
                        known.insert(r.id);
                        if with_key {
                            keys.insert(key(i), r.id);
                        }
                    }
                    Op::Budget(budget, refs) => {
                        let referenced: HashSet<ArtifactId> =
                            (0..ARTIFACTS).filter(|&i| refs[i]).filter_map(|i| ids[i]).collect();
                        let before: BTreeSet<ArtifactId> =
                            store.usage().unwrap().into_iter().map(|(id, _, _)| id).collect();
                        let dropped = store.enforce_disk_budget(budget, &referenced).unwrap();
                        for id in &dropped {
                            prop_assert!(before.contains(id) && !referenced.contains(id));
                            prop_assert!(!store.contains(id) && store.knows(id));
                        }
                        let left = store.usage().unwrap();
                        let total: u64 = left.iter().map(|(_, b, _)| b).sum();
                        prop_assert!(total <= budget || left.iter().all(|(id, _, _)| referenced.contains(id)));
                        for id in before.iter().filter(|id| referenced.contains(id)) {
                            prop_assert!(store.contains(id), "a referenced artifact lost its bytes");
                        }
                    }
                    Op::RmKey(i) => {
                        let got = store.remove(&IdOrKey::Key(key(i)));
                        match keys.remove(&key(i)) {
                            Some(id) => {
                                let last = !keys.values().any(|v| *v == id);
                                prop_assert_eq!(got.unwrap(), if last { vec![id] } else { vec![] });
                                if last {
                                    known.remove(&id);
                                }
                            }
                            None => prop_assert!(matches!(got, Err(StoreError::UnknownKey(_)))),
                        }
                    }
                }
                prop_assert_eq!(&store.keys().unwrap(), &keys);
                let listed: BTreeSet<ArtifactId> = store.list().unwrap().into_iter().map(|a| a.id).collect();
                prop_assert_eq!(&listed, &known);
                for (k, id) in &keys {
                    match store.resolve(&IdOrKey::Key(k.clone())) {
                        Ok(got) => prop_assert_eq!(got, *id),
                        Err(StoreError::NotOnDisk { id: got, .. }) => prop_assert_eq!(got, *id),
                        Err(e) => prop_assert!(false, "key {} no longer resolves: {}", k, e),
                    }
                }
            }
        }
    }
}
