//! A key whose artifact's bytes the disk budget dropped (issue 27): the
//! key still resolves, the next load fetches the bytes again — from the
//! fallback directory (safetensors and whole files) or a peer — verified
//! against the id, and when no source has them the load fails with one
//! line naming the key, the artifact and every source tried.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{eventually, http_get, node};
use hangar_store::client::{ClientError, Hold, StoreClient};
use hangar_store::daemon::{DaemonConfig, DaemonHandle};
use hangar_store::protocol::{Selection, Source};
use hangar_store::registry::RegistryHandle;
use hangar_store::synth::{fill_random, model, write_files};
use hangar_store::{ArtifactId, BlobStore, StoreKey};

const CONFIRM: Duration = Duration::from_secs(20);

/// What a test imports: safetensors parts, or one whole file.
#[derive(Clone, Copy)]
enum Kind {
    Safetensors,
    WholeFile,
}

/// Writes artifact `seed`'s files of `kind` into `dir` (what the fallback
/// directory and the importing node both hold).
fn write(kind: Kind, dir: &Path, seed: u64) -> Vec<PathBuf> {
    match kind {
        Kind::Safetensors => write_files(dir, &model(3 << 20, 2, seed), 2).unwrap(),
        Kind::WholeFile => {
            std::fs::create_dir_all(dir).unwrap();
            let mut bytes = vec![0u8; (3 << 20) + 12_345];
            fill_random(&mut bytes, seed);
            let path = dir.join("model.Q4_1.gguf");
            std::fs::write(&path, bytes).unwrap();
            vec![path]
        }
    }
}

/// A node whose store holds `x` under `key` and a newer artifact, with a
/// disk budget that fits only the newer one: materializing the newer one
/// makes the budget drop `x`'s bytes. Returns the daemon, a client, the
/// held newer artifact and `x`'s id.
struct Dropped {
    daemon: DaemonHandle,
    client: StoreClient,
    _held: hangar_store::client::Materialized,
    x: ArtifactId,
    key: StoreKey,
}

fn node_with_dropped_bytes(
    root: &Path,
    x_files: &[PathBuf],
    key: &str,
    tweak: impl FnOnce(&mut DaemonConfig),
) -> Dropped {
    let key: StoreKey = key.parse().unwrap();
    let store = BlobStore::open(root).unwrap();
    let x = store.import_files(x_files, std::slice::from_ref(&key)).unwrap().id;
    let newer = write(Kind::Safetensors, &root.join("newer-src"), 99);
    let y = store.import_files(&newer, &["other:v1".parse().unwrap()]).unwrap().id;
    let y_bytes = store.usage().unwrap().into_iter().find(|(id, _, _)| *id == y).unwrap().1;
    let mut cfg = DaemonConfig::new(root, root.join("store.sock"));
    cfg.disk_budget = Some(y_bytes);
    tweak(&mut cfg);
    let daemon = DaemonHandle::start(cfg).unwrap();
    let mut client = StoreClient::connect(daemon.socket()).unwrap().with_key_cache_ttl(Duration::ZERO);
    let held =
        client.materialize(&Selection { artifact_id: y, view: None, key: None }, Hold::Process).unwrap();
    client.confirm(&held, CONFIRM).unwrap();
    eventually("the disk budget drops x's bytes", || !store.contains(&x));
    assert!(store.contains(&y), "the held artifact keeps its bytes");
    assert_eq!(store.keys().unwrap().get(&key), Some(&x), "the budget kept the key");
    assert_eq!(client.resolve_key(&key).unwrap(), x, "the key still resolves");
    let listed = store.list().unwrap();
    assert!(listed.iter().any(|a| a.id == x && !a.on_disk && a.keys == vec![key.clone()]), "{listed:?}");
    Dropped { daemon, client, _held: held, x, key }
}

/// Materializes `key` and checks the bytes against the original files'
/// import, that they came from `want`, and that the store has them again.
fn fetched_again(d: &mut Dropped, root: &Path, original: &[PathBuf], want: Source) {
    let sel = Selection { artifact_id: d.x, view: None, key: Some(d.key.clone()) };
    let m = d.client.materialize(&sel, Hold::Process).unwrap();
    let done = d.client.confirm(&m, CONFIRM).unwrap();
    assert_eq!(done.source, want);
    let reference = tempfile::tempdir().unwrap();
    let ref_store = BlobStore::open(reference.path()).unwrap();
    let id = ref_store.import_files(original, &[]).unwrap().id;
    assert_eq!(id, d.x);
    assert_eq!(m.data(), &ref_store.open_artifact(&id).unwrap().map_verified().unwrap()[..]);
    let store = BlobStore::open(root).unwrap();
    eventually("the fetched bytes are stored again", || store.contains(&d.x));
    store.open_artifact(&d.x).unwrap().map_verified().unwrap();
    assert!(store.list().unwrap().iter().any(|a| a.id == d.x && a.on_disk));
}

fn from_the_fallback(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    // Laid out by key, beside a file that is not part of it.
    let fb_dir = dir.path().join("fallback/org/m/v1");
    let files = write(kind, &fb_dir, 7);
    std::fs::write(fb_dir.join("README.md"), b"model card").unwrap();
    let fallback = dir.path().join("fallback").display().to_string();
    let mut d = node_with_dropped_bytes(&root, &files, "org/m:v1", |c| c.fallback = Some(fallback));
    fetched_again(&mut d, &root, &files, Source::Fallback);
}

#[test]
fn dropped_safetensors_are_fetched_again_from_the_fallback() {
    from_the_fallback(Kind::Safetensors);
}

#[test]
fn a_dropped_whole_file_is_fetched_again_from_the_fallback() {
    from_the_fallback(Kind::WholeFile);
}

#[test]
fn dropped_bytes_are_fetched_again_from_a_peer() {
    for kind in [Kind::Safetensors, Kind::WholeFile] {
        let dir = tempfile::tempdir().unwrap();
        let (ra, rb) = (dir.path().join("a"), dir.path().join("b"));
        let files = write(kind, &dir.path().join("src"), 8);
        let x = BlobStore::open(&ra).unwrap().import_files(&files, &[]).unwrap().id;
        let registry = RegistryHandle::start("127.0.0.1:0".parse().unwrap(), 5_000).unwrap();
        let _a = node(&ra, &registry, |_| {});
        let registry_url = registry.url();
        let mut d = node_with_dropped_bytes(&rb, &files, "org/m:v1", |c| {
            c.listen = Some("127.0.0.1:0".parse().unwrap());
            c.registry = Some(registry_url);
            c.heartbeat = Duration::from_millis(50);
            c.node = "b".into();
        });
        assert_eq!(d.x, x);
        let holders = format!("/v1/holders/{x}");
        eventually("the registry knows a holds x", || http_get(registry.addr(), &holders).contains("http"));
        fetched_again(&mut d, &rb, &files, Source::Peer);
        drop(d.daemon);
    }
}

/// No peer and no fallback has it: one line with the key, the id and what
/// each source said, from `Materialize` (so a replica start fails at once).
#[test]
fn with_no_source_the_load_fails_with_one_line_naming_key_id_and_sources() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let files = write(Kind::WholeFile, &dir.path().join("src"), 9);
    let registry = RegistryHandle::start("127.0.0.1:0".parse().unwrap(), 5_000).unwrap();
    let empty_fallback = dir.path().join("fallback");
    std::fs::create_dir_all(&empty_fallback).unwrap();
    let (registry_url, fb) = (registry.url(), empty_fallback.display().to_string());
    let mut d = node_with_dropped_bytes(&root, &files, "org/g:v1", |c| {
        c.listen = Some("127.0.0.1:0".parse().unwrap());
        c.registry = Some(registry_url);
        c.fallback = Some(fb);
    });
    let sel = Selection { artifact_id: d.x, view: None, key: Some(d.key.clone()) };
    let msg = match d.client.materialize(&sel, Hold::Process) {
        Err(ClientError::UnknownArtifact(msg)) => msg,
        other => panic!("expected the artifact to be unavailable, got {other:?}"),
    };
    assert!(!msg.contains('\n'), "one line: {msg}");
    for part in [
        "`org/g:v1`".to_owned(),
        d.x.to_string(),
        "this node's disk: the disk budget dropped its bytes".to_owned(),
        format!("registry {}: no live peer holds it", registry.url()),
        format!("fallback {}", empty_fallback.display()),
        "org/g/v1/".to_owned(),
    ] {
        assert!(msg.contains(&part), "`{msg}` lacks `{part}`");
    }
    assert!(d.client.status().unwrap().2.iter().all(|r| r.id != d.x), "nothing stays resident");

    // Without a registry or fallback, the error says so.
    drop(d);
    let mut cfg = DaemonConfig::new(&root, root.join("store.sock"));
    cfg.budget = 64 << 20;
    let daemon = DaemonHandle::start(cfg).unwrap();
    let mut c = StoreClient::connect(daemon.socket()).unwrap();
    let key: StoreKey = "org/g:v1".parse().unwrap();
    let x = c.resolve_key(&key).unwrap();
    let sel = Selection { artifact_id: x, view: None, key: Some(key) };
    let msg = match c.materialize(&sel, Hold::Process) {
        Err(ClientError::UnknownArtifact(msg)) => msg,
        other => panic!("expected the artifact to be unavailable, got {other:?}"),
    };
    assert!(
        msg.contains("peers: no registry configured") && msg.contains("fallback: none configured"),
        "{msg}"
    );
}
