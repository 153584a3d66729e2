//! A fleet node's adapter directories (`WeightStore::adapter_dir`): the
//! files of an adapter artifact as it was imported, written once per node,
//! refused for an artifact that is another adapter or that no source
//! holds, and removed once nobody asked for them within the idle time.

mod common;

use std::time::Duration;

use common::files;
use hangar_agent::weights::{AdapterDirError, StoreSettings, WeightStore};
use hangar_core::AdapterRef;
use hangar_store::{adapters, synth, ArtifactId, BlobStore};

#[test]
fn an_adapter_directory_is_written_once_checked_and_pruned_when_idle() {
    let dir = tempfile::tempdir().unwrap();
    let (src, root) = (dir.path().join("src"), dir.path().join("store"));
    let a1: AdapterRef = "t/base:acme/a1".parse().unwrap();
    synth::synth_adapter_dir(&src, "t/base", 2, 64, 2, 1).unwrap();
    let id = adapters::import_dir(&BlobStore::open(&root).unwrap(), &src, &a1).unwrap().id;
    let settings = StoreSettings {
        root: Some(root.clone()),
        socket: Some(dir.path().join("store.sock")),
        ..StoreSettings::default()
    };
    let store = WeightStore::open(settings, []).unwrap();

    let path = store.adapter_dir(&a1, id).unwrap();
    assert_eq!(path, root.join(adapters::EXPORT_DIRS).join(id.file_name()));
    assert_eq!(files(&path), files(&src), "every file as it was imported");
    let written = std::fs::metadata(path.join(adapters::CONFIG_FILE)).unwrap().modified().unwrap();
    assert_eq!(store.adapter_dir(&a1, id).unwrap(), path);
    let again = std::fs::metadata(path.join(adapters::CONFIG_FILE)).unwrap().modified().unwrap();
    assert_eq!(written, again, "written once");

    let other: AdapterRef = "t/base:acme/other".parse().unwrap();
    let e = store.adapter_dir(&other, id).unwrap_err();
    assert!(matches!(*e, AdapterDirError::NotThisAdapter { .. }), "{e}");
    assert_eq!(e.status(), 409);
    assert!(e.to_string().contains("bound to adapter t/base:acme/a1"), "{e}");
    let unknown: ArtifactId = format!("hg1:{}:{}", "07".repeat(32), "09".repeat(32)).parse().unwrap();
    let e = store.adapter_dir(&a1, unknown).unwrap_err();
    assert!(matches!(*e, AdapterDirError::Load { .. }), "{e}");
    assert!(e.to_string().contains(&unknown.to_string()), "{e}");
    let left: Vec<_> = std::fs::read_dir(root.join(adapters::EXPORT_DIRS)).unwrap().collect();
    assert_eq!(left.len(), 1, "a refused directory leaves nothing: {left:?}");

    assert_eq!(store.prune_adapter_dirs(Duration::from_secs(3600)).unwrap(), 0, "asked for just now");
    assert!(path.is_dir());
    assert_eq!(store.prune_adapter_dirs(Duration::ZERO).unwrap(), 1);
    assert!(!path.exists());
    assert_eq!(store.adapter_dir(&a1, id).unwrap(), path, "written again when asked again");
    assert_eq!(files(&path), files(&src));
}

/// The adapters of the node's own store are made ahead of need, once, and
/// kept from the idle prune while they stay registered; one that cannot
/// be made is answered once and left to be made on demand.
#[test]
fn the_nodes_own_adapters_are_made_ahead_and_kept_while_registered() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let blobs = BlobStore::open(&root).unwrap();
    let own: Vec<(AdapterRef, ArtifactId)> = (1..=2)
        .map(|i| {
            let (src, adapter) = (dir.path().join(format!("src{i}")), format!("t/base:acme/a{i}"));
            let adapter: AdapterRef = adapter.parse().unwrap();
            synth::synth_adapter_dir(&src, "t/base", 2, 64, 2, i).unwrap();
            let id = adapters::import_dir(&blobs, &src, &adapter).unwrap().id;
            (adapter, id)
        })
        .collect();
    let settings = StoreSettings {
        root: Some(root.clone()),
        socket: Some(dir.path().join("store.sock")),
        ..StoreSettings::default()
    };
    let store = WeightStore::open(settings, []).unwrap();
    let path = |id: &ArtifactId| root.join(adapters::EXPORT_DIRS).join(id.file_name());

    assert!(store.make_adapter_dirs_ahead(&own).is_empty());
    for (i, (_, id)) in own.iter().enumerate() {
        assert_eq!(files(&path(id)), files(&dir.path().join(format!("src{}", i + 1))));
    }
    let written = std::fs::metadata(path(&own[0].1).join(adapters::CONFIG_FILE)).unwrap().modified().unwrap();
    let unknown: ArtifactId = format!("hg1:{}:{}", "07".repeat(32), "09".repeat(32)).parse().unwrap();
    let broken = [own.clone(), vec![(own[0].0.clone(), unknown)]].concat();
    let errors = store.make_adapter_dirs_ahead(&broken);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].to_string().contains(&unknown.to_string()), "{}", errors[0]);
    assert!(store.make_adapter_dirs_ahead(&broken).is_empty(), "a failure is answered once");
    let again = std::fs::metadata(path(&own[0].1).join(adapters::CONFIG_FILE)).unwrap().modified().unwrap();
    assert_eq!(written, again, "made once");

    assert_eq!(store.prune_adapter_dirs(Duration::ZERO).unwrap(), 0, "kept while registered");
    assert!(store.make_adapter_dirs_ahead(&own[..1]).is_empty());
    assert_eq!(store.prune_adapter_dirs(Duration::ZERO).unwrap(), 1, "a2 no longer registered");
    assert!(path(&own[0].1).is_dir() && !path(&own[1].1).exists());
}
