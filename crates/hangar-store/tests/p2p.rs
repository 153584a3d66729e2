//! Two daemons on loopback with two data roots, a registry, and a fallback
//! directory: P2P transfer, verification, and falling back when the peer
//! hangs or dies mid-transfer.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{eventually, http_get, import, node, tensor};
use hangar_store::chunks::chunk_range;
use hangar_store::client::{Hold, StoreClient};
use hangar_store::daemon::{DaemonConfig, DaemonHandle};
use hangar_store::protocol::{Selection, Source};
use hangar_store::registry::RegistryHandle;
use hangar_store::view::{ViewPlan, ViewSpec};
use hangar_store::{ArtifactId, BlobStore, StoreKey};

const CONFIRM: Duration = Duration::from_secs(20);

/// Waits until daemon `b` can resolve `key` through the registry (so the
/// registry has heard `a`'s heartbeat).
fn wait_registered(b: &DaemonHandle, key: &StoreKey) -> StoreClient {
    let mut c = StoreClient::connect(b.socket()).unwrap().with_key_cache_ttl(Duration::ZERO);
    eventually("the registry learns the holder", || c.resolve_key(key).is_ok());
    c
}

#[test]
fn artifact_imported_on_one_daemon_is_materialized_on_the_other_via_p2p() {
    let dir = tempfile::tempdir().unwrap();
    let (ra, rb) = (dir.path().join("a"), dir.path().join("b"));
    let f = import(&ra, &dir.path().join("src"), 5 << 20, 21, "org/m:v1");
    let registry = RegistryHandle::start("127.0.0.1:0".parse().unwrap(), 5_000).unwrap();
    let _a = node(&ra, &registry, |_| {});
    let b = node(&rb, &registry, |_| {});
    let key: StoreKey = "org/m:v1".parse().unwrap();
    let mut c = wait_registered(&b, &key);
    assert_eq!(c.resolve_key(&key).unwrap(), f.id);

    let sel = Selection { artifact_id: f.id, view: None, key: Some(key) };
    let m = c.materialize(&sel, Hold::Process).unwrap();
    let done = c.confirm(&m, CONFIRM).unwrap();
    assert_eq!(done.source, Source::Peer);
    let local = BlobStore::open(&ra).unwrap().open_artifact(&f.id).unwrap().map_verified().unwrap();
    assert_eq!(m.data(), &local[..], "peer bytes equal the original");
    let store_b = BlobStore::open(&rb).unwrap();
    eventually("b persists what it fetched", || store_b.contains(&f.id));
    store_b.open_artifact(&f.id).unwrap().map_verified().unwrap();

    let addr = b.http_addr().unwrap();
    let metrics = http_get(addr, "/metrics");
    let peer_bytes = format!("hangar_store_loaded_bytes_total{{source=\"peer\"}} {}", m.index.data_len);
    assert!(metrics.contains(&peer_bytes), "{metrics}");
    assert!(metrics.contains("hangar_store_resident_bytes"), "{metrics}");
    let events: serde_json::Value = serde_json::from_str(&http_get(addr, "/v1/events")).unwrap();
    let events = events.as_array().unwrap();
    assert_eq!(events[0]["kind"], "ingestion_started");
    assert_eq!(events[1]["kind"], "ingestion_completed");
    assert_eq!(events[1]["source"], "peer");
    assert_eq!(events[0]["context_id"], events[1]["context_id"]);
}

fn fallback_case(kill_peer: bool) {
    let dir = tempfile::tempdir().unwrap();
    let (ra, rb) = (dir.path().join("a"), dir.path().join("b"));
    // The fallback directory is laid out by key: <dir>/<name>/<tag>/*.safetensors.
    let fallback = dir.path().join("fallback");
    let f = import(&ra, &fallback.join("org/m/v1"), 6 << 20, 22, "org/m:v1");
    let registry = RegistryHandle::start("127.0.0.1:0".parse().unwrap(), 5_000).unwrap();
    let a = node(&ra, &registry, |c| c.fault_stall_after = Some(2 << 20));
    let b = node(&rb, &registry, |c| {
        c.fallback = Some(fallback.display().to_string());
        // When the peer is killed the fallback must come from the broken
        // connection, not from this timeout.
        c.peer_timeout = if kill_peer { Duration::from_secs(15) } else { Duration::from_millis(300) };
    });
    let key: StoreKey = "org/m:v1".parse().unwrap();
    let mut c = wait_registered(&b, &key);
    let sel = Selection { artifact_id: f.id, view: None, key: Some(key) };
    let m = c.materialize(&sel, Hold::Process).unwrap();
    if kill_peer {
        drop(a);
    }
    let done = c.confirm(&m, CONFIRM).unwrap();
    assert_eq!(done.source, Source::Fallback, "a failed peer falls back without losing the request");
    let original = BlobStore::open(&ra).unwrap().open_artifact(&f.id).unwrap().map_verified().unwrap();
    assert_eq!(m.data(), &original[..]);
}

#[test]
fn stalled_peer_falls_back_to_the_directory_source() {
    fallback_case(false);
}

#[test]
fn peer_killed_mid_transfer_falls_back_to_the_directory_source() {
    fallback_case(true);
}

/// Flips the byte at `at(len)` of the blob `root` holds for `id` (a peer's
/// copy gone bad on disk); returns the original bytes.
fn corrupt_blob(root: &Path, id: &ArtifactId, at: impl FnOnce(usize) -> usize) -> Vec<u8> {
    let blob = root.join("artifacts").join(id.file_name()).join("data");
    let original = std::fs::read(&blob).unwrap();
    let mut corrupt = original.clone();
    corrupt[at(original.len())] ^= 0x10;
    std::fs::write(&blob, &corrupt).unwrap();
    original
}

/// The last number on the metrics line that starts with `name`.
fn metric(addr: std::net::SocketAddr, name: &str) -> u64 {
    let text = http_get(addr, "/metrics");
    let line = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no {name} in {text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn a_view_of_an_artifact_held_only_by_a_peer_fetches_only_the_chunks_it_reads() {
    let dir = tempfile::tempdir().unwrap();
    let (ra, rb) = (dir.path().join("a"), dir.path().join("b"));
    let f = import(&ra, &dir.path().join("src"), 12 << 20, 23, "org/v:v1");
    let registry = RegistryHandle::start("127.0.0.1:0".parse().unwrap(), 5_000).unwrap();
    let a = node(&ra, &registry, |_| {});
    let b = node(&rb, &registry, |_| {});
    let key: StoreKey = "org/v:v1".parse().unwrap();
    let mut c = wait_registered(&b, &key);
    let spec: ViewSpec = "3/4:*.weight=0".parse().unwrap();
    let sel = Selection { artifact_id: f.id, view: Some(spec.clone()), key: Some(key) };
    let m = c.materialize(&sel, Hold::Process).unwrap();
    assert_eq!(c.confirm(&m, CONFIRM).unwrap().source, Source::Peer);
    for l in 0..3 {
        let name = format!("layers.{l}.mlp.weight");
        let weight = &tensor(&f, &name).data;
        let quarter = weight.len() / 4; // 1448 rows: four equal shards, no padding
        assert_eq!(m.tensor(&name).unwrap(), &weight[3 * quarter..], "{name}");
        let bias = format!("layers.{l}.mlp.bias");
        assert_eq!(m.tensor(&bias).unwrap(), &tensor(&f, &bias).data[..], "{bias}");
    }

    // Only the parent chunks the view reads crossed the wire; the parent
    // itself was never made resident on b, nor stored there.
    let parent = BlobStore::open(&ra).unwrap().open_artifact(&f.id).unwrap();
    let needed = ViewPlan::new(&parent.index, &spec).unwrap().needed_chunks();
    let needed_bytes: u64 =
        needed.iter().map(|&i| chunk_range(i, parent.index.data_len)).map(|(s, e)| e - s).sum();
    assert!(needed_bytes < parent.index.data_len * 3 / 4, "the view reads {needed_bytes} bytes");
    assert_eq!(metric(a.http_addr().unwrap(), "hangar_store_peer_sent_bytes_total"), needed_bytes);
    let (_, _, residents) = c.status().unwrap();
    assert!(residents.iter().all(|r| r.id != f.id), "parent resident on b: {residents:?}");
    assert!(!BlobStore::open(&rb).unwrap().contains(&f.id));
}

#[test]
fn a_view_whose_peer_serves_a_corrupt_chunk_is_built_from_the_whole_parent_from_the_fallback() {
    let dir = tempfile::tempdir().unwrap();
    let (ra, rb) = (dir.path().join("a"), dir.path().join("b"));
    let fallback = dir.path().join("fallback");
    let f = import(&ra, &fallback.join("org/v/v1"), 12 << 20, 26, "org/v:v1");
    // In the last chunk, which the view reads (rank 1 of the last weight).
    let original = corrupt_blob(&ra, &f.id, |len| len - 10);
    let registry = RegistryHandle::start("127.0.0.1:0".parse().unwrap(), 5_000).unwrap();
    let _a = node(&ra, &registry, |_| {});
    let b = node(&rb, &registry, |c| c.fallback = Some(fallback.display().to_string()));
    let key: StoreKey = "org/v:v1".parse().unwrap();
    let mut c = wait_registered(&b, &key);
    let sel = Selection { artifact_id: f.id, view: Some("1/2:*.weight=0".parse().unwrap()), key: Some(key) };
    let m = c.materialize(&sel, Hold::Process).unwrap();
    assert_eq!(
        c.confirm(&m, CONFIRM).unwrap().source,
        Source::Resident,
        "built from the materialized parent"
    );
    let weight = &tensor(&f, "layers.2.mlp.weight").data;
    assert_eq!(m.tensor("layers.2.mlp.weight").unwrap(), &weight[weight.len() / 2..]);
    let metrics = http_get(b.http_addr().unwrap(), "/metrics");
    let from_fallback = format!("hangar_store_loaded_bytes_total{{source=\"fallback\"}} {}", original.len());
    assert!(metrics.contains(&from_fallback), "{metrics}");
}

#[test]
fn a_peer_never_sends_a_corrupt_chunk_and_the_load_falls_back() {
    let dir = tempfile::tempdir().unwrap();
    let (ra, rb) = (dir.path().join("a"), dir.path().join("b"));
    let fallback = dir.path().join("fallback");
    let f = import(&ra, &fallback.join("org/m/v1"), 6 << 20, 24, "org/m:v1");
    let original = corrupt_blob(&ra, &f.id, |_| (2 << 20) + 5); // chunk 2 of the peer's copy
    let registry = RegistryHandle::start("127.0.0.1:0".parse().unwrap(), 5_000).unwrap();
    let a = node(&ra, &registry, |_| {});
    let b = node(&rb, &registry, |c| c.fallback = Some(fallback.display().to_string()));
    let key: StoreKey = "org/m:v1".parse().unwrap();
    let mut c = wait_registered(&b, &key);
    let sel = Selection { artifact_id: f.id, view: None, key: Some(key) };
    let m = c.materialize(&sel, Hold::Process).unwrap();
    let done = c.confirm(&m, CONFIRM).unwrap();
    assert_eq!(done.source, Source::Fallback, "the peer cut its stream before the bad chunk");
    assert_eq!(m.data(), &original[..]);

    // The plain (not upgraded) HTTP stream is cut the same way: two good chunks, then the end.
    let url = format!("http://{}/v1/artifacts/{}/data?from_chunk=0", a.http_addr().unwrap(), f.id);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let got = rt.block_on(async {
        let mut resp = reqwest::get(&url).await.unwrap();
        let mut got = Vec::new();
        while let Ok(Some(piece)) = resp.chunk().await {
            got.extend_from_slice(&piece);
        }
        got
    });
    assert_eq!(got, original[..2 << 20], "only verified chunks are sent");
}

#[test]
fn plain_http_clients_get_the_data_stream_or_a_run_of_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let ra = dir.path().join("a");
    let f = import(&ra, &dir.path().join("src"), 3 << 20, 25, "org/m:v1");
    let original = BlobStore::open(&ra).unwrap().open_artifact(&f.id).unwrap().map_verified().unwrap();
    let registry = RegistryHandle::start("127.0.0.1:0".parse().unwrap(), 5_000).unwrap();
    let a = node(&ra, &registry, |_| {});
    let url = format!("http://{}/v1/artifacts/{}/data?from_chunk=1", a.http_addr().unwrap(), f.id);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let got = rt.block_on(async { reqwest::get(&url).await.unwrap().bytes().await.unwrap() });
    assert_eq!(&got[..], &original[1 << 20..]);

    // A run of chunks, and ranges that do not fit, named in the answer.
    let base = format!("http://{}/v1/artifacts/{}/data", a.http_addr().unwrap(), f.id);
    let got = rt.block_on(async {
        reqwest::get(format!("{base}?from_chunk=1&to_chunk=2")).await.unwrap().bytes().await.unwrap()
    });
    assert_eq!(&got[..], &original[1 << 20..2 << 20]);
    let n = original.len().div_ceil(1 << 20);
    for query in ["from_chunk=2&to_chunk=1", &format!("to_chunk={}", n + 1)] {
        let (status, body) = rt.block_on(async {
            let r = reqwest::get(format!("{base}?{query}")).await.unwrap();
            (r.status(), r.text().await.unwrap())
        });
        assert_eq!(status, reqwest::StatusCode::RANGE_NOT_SATISFIABLE, "{query}");
        assert!(body.contains(&format!("0..{n}")), "{query}: {body}");
    }
}

/// Two daemons under one node name (two `hangar store serve` on one host,
/// both named after it): the second is refused at start, naming the
/// holder, and leaves no socket behind; under its own name it starts.
#[test]
fn a_node_name_held_by_a_live_daemon_is_refused_to_another() {
    let dir = tempfile::tempdir().unwrap();
    let (ra, rb) = (dir.path().join("a"), dir.path().join("b"));
    let registry = RegistryHandle::start("127.0.0.1:0".parse().unwrap(), 5_000).unwrap();
    let a = node(&ra, &registry, |c| c.node = "host".into());
    let holder = format!("http://{}", a.http_addr().unwrap());
    let err = DaemonHandle::start({
        let mut cfg = DaemonConfig::new(&rb, rb.join("store.sock"));
        cfg.listen = Some("127.0.0.1:0".parse().unwrap());
        cfg.registry = Some(registry.url());
        cfg.node = "host".into();
        cfg
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("`host`") && msg.contains(&holder) && msg.contains("--node"), "{msg}");
    assert!(!rb.join("store.sock").exists(), "a refused daemon leaves no socket");
    let nodes = http_get(registry.addr(), "/v1/nodes");
    assert!(nodes.contains(&holder), "the holder keeps its name: {nodes}");
    let _b = node(&rb, &registry, |c| c.node = "host-2".into());
}
