//! Publish-side dedupe: an ingestion that leaves an artifact stored on a
//! node is published once per artifact per window, keyed by the publish
//! context — whichever of the automatic publish (a fetched artifact
//! stored after `ingestion_completed`) and the synchronous one (a
//! producer's `CommitRegister`) comes first publishes; a later one joins
//! its context and only refreshes it.

mod common;

use std::time::Duration;

use common::{eventually, http_get, import, node};
use hangar_store::client::{Hold, StoreClient};
use hangar_store::daemon::{DaemonConfig, DaemonHandle};
use hangar_store::protocol::{Selection, Source};
use hangar_store::registry::RegistryHandle;
use hangar_store::synth::{model, specs, write_files, OwnedTensor};
use hangar_store::{BlobStore, StoreKey};
use serde_json::Value;

fn events(d: &DaemonHandle) -> Vec<Value> {
    let v: Value = serde_json::from_str(&http_get(d.http_addr().unwrap(), "/v1/events")).unwrap();
    v.as_array().unwrap().clone()
}

fn of_kind<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["kind"] == kind).collect()
}

fn metric(d: &DaemonHandle, name: &str) -> u64 {
    let text = http_get(d.http_addr().unwrap(), "/metrics");
    let line = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name}: {text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Registers `tensors` through the daemon.
fn register(c: &mut StoreClient, tensors: &[(String, OwnedTensor)]) -> hangar_store::CommitReport {
    let mut p = c.begin_register(specs(tensors), vec![]).unwrap();
    for (name, t) in tensors {
        p.tensor_mut(name).unwrap().copy_from_slice(&t.data);
    }
    c.commit_register(p).unwrap()
}

fn daemon_with_window(root: &std::path::Path, window: Duration) -> DaemonHandle {
    let mut cfg = DaemonConfig::new(root, root.join("store.sock"));
    cfg.listen = Some("127.0.0.1:0".parse().unwrap());
    cfg.publish_dedupe_window = window;
    DaemonHandle::start(cfg).unwrap()
}

/// Eight ranks registering one replicated artifact publish it once.
#[test]
fn registrations_of_one_artifact_within_the_window_publish_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon_with_window(dir.path(), Duration::from_secs(600));
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let tensors = model(1 << 18, 2, 3);
    let first = register(&mut c, &tensors);
    for _ in 0..7 {
        let again = register(&mut c, &tensors);
        assert_eq!((again.id, again.existed), (first.id, true));
    }
    let other = register(&mut c, &model(1 << 18, 2, 4));

    let ev = events(&d);
    let completed = of_kind(&ev, "ingestion_completed");
    assert_eq!(completed.len(), 9, "every registration is an ingestion of its own");
    assert!(completed.iter().all(|e| e["source"] == "register"));
    let published = of_kind(&ev, "ingestion_published");
    let ids: Vec<&str> = published.iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(ids, [first.id.to_string(), other.id.to_string()], "one publish per artifact");
    assert_eq!(published[0]["context_id"], completed[0]["context_id"], "under the first ingestion's context");
    assert_eq!(metric(&d, "hangar_store_publishes_total"), 2);
    assert_eq!(metric(&d, "hangar_store_publishes_deduplicated_total"), 7);
}

#[test]
fn with_no_window_every_publish_goes_out() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon_with_window(dir.path(), Duration::ZERO);
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let tensors = model(1 << 16, 1, 5);
    for _ in 0..3 {
        register(&mut c, &tensors);
    }
    assert_eq!(of_kind(&events(&d), "ingestion_published").len(), 3);
    assert_eq!(metric(&d, "hangar_store_publishes_deduplicated_total"), 0);
}

/// The seed's case: the automatic publish of a fetched artifact and a
/// producer's synchronous registration of the same bytes — the first
/// publishes under its context, the later is a no-op.
#[test]
fn a_fetched_artifact_and_a_registration_of_the_same_bytes_publish_once() {
    let dir = tempfile::tempdir().unwrap();
    let (ra, rb) = (dir.path().join("a"), dir.path().join("b"));
    let f = import(&ra, &dir.path().join("src"), 3 << 20, 31, "org/p:v1");
    let registry = RegistryHandle::start("127.0.0.1:0".parse().unwrap(), 5_000).unwrap();
    let _a = node(&ra, &registry, |_| {});
    let b = node(&rb, &registry, |c| c.publish_dedupe_window = Duration::from_secs(600));
    let key: StoreKey = "org/p:v1".parse().unwrap();
    let mut c = StoreClient::connect(b.socket()).unwrap().with_key_cache_ttl(Duration::ZERO);
    eventually("the registry learns a's holdings", || c.resolve_key(&key).is_ok());

    let m =
        c.materialize(&Selection { artifact_id: f.id, view: None, key: Some(key) }, Hold::Process).unwrap();
    assert_eq!(c.confirm(&m, Duration::from_secs(20)).unwrap().source, Source::Peer);
    eventually("b stores and publishes what it fetched", || {
        !of_kind(&events(&b), "ingestion_published").is_empty()
    });
    assert!(BlobStore::open(&rb).unwrap().contains(&f.id));
    let again = register(&mut c, &f.tensors);
    assert_eq!((again.id, again.existed), (f.id, true));

    let ev = events(&b);
    let load = of_kind(&ev, "ingestion_completed")[0];
    assert_eq!(load["source"], "peer");
    let published = of_kind(&ev, "ingestion_published");
    assert_eq!(published.len(), 1, "{ev:?}");
    assert_eq!(published[0]["context_id"], load["context_id"], "the load's context published");
    assert_eq!(published[0]["source"], "peer");
    assert_eq!(of_kind(&ev, "ingestion_completed").len(), 2, "the registration is still an ingestion");
    assert_eq!(metric(&b, "hangar_store_publishes_deduplicated_total"), 1);
}

/// An artifact whose bytes the disk budget dropped is no longer stored
/// here: fetched and stored again, it is published again, window or not.
#[test]
fn an_artifact_dropped_by_the_disk_budget_is_published_again_when_stored_again() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("node");
    let (x, y) = (model(3 << 20, 2, 51), model(3 << 20, 2, 52));
    write_files(&dir.path().join("fallback/org/x/v1"), &x, 1).unwrap();
    let y_bytes = {
        let scratch = BlobStore::open(dir.path().join("scratch")).unwrap();
        scratch.import_files(&write_files(&dir.path().join("y"), &y, 1).unwrap(), &[]).unwrap();
        scratch.usage().unwrap()[0].1
    };
    let mut cfg = DaemonConfig::new(&root, root.join("store.sock"));
    cfg.listen = Some("127.0.0.1:0".parse().unwrap());
    cfg.publish_dedupe_window = Duration::from_secs(600);
    cfg.disk_budget = Some(y_bytes);
    cfg.fallback = Some(dir.path().join("fallback").display().to_string());
    let d = DaemonHandle::start(cfg).unwrap();
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let x_id = register(&mut c, &x).id;
    let y_id = register(&mut c, &y).id;
    let held = c.materialize(&Selection { artifact_id: y_id, view: None, key: None }, Hold::Process).unwrap();
    c.confirm(&held, Duration::from_secs(20)).unwrap();
    let store = BlobStore::open(&root).unwrap();
    eventually("the disk budget drops x's bytes", || !store.contains(&x_id));

    let sel = Selection { artifact_id: x_id, view: None, key: Some("org/x:v1".parse().unwrap()) };
    let m = c.materialize(&sel, Hold::Process).unwrap();
    assert_eq!(c.confirm(&m, Duration::from_secs(20)).unwrap().source, Source::Fallback);
    let published_x = || {
        let ev = events(&d);
        of_kind(&ev, "ingestion_published").iter().filter(|e| e["id"] == x_id.to_string()).count()
    };
    eventually("x is published again once stored again", || published_x() == 2);
    assert_eq!(metric(&d, "hangar_store_publishes_deduplicated_total"), 0);
}
