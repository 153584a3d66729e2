//! `MaterializeIntoTarget`: the daemon streams an artifact or a view into
//! memory the caller owns — from a resident copy, its disk, a peer or the
//! fallback — verifies every byte, and keeps nothing: no holder, no
//! resident, no blob. Target regions that cannot take the bytes are
//! refused before anything is written.

mod common;

use std::os::fd::AsFd;
use std::time::Duration;

use common::{daemon, http_get, import, node};
use hangar_store::client::{ClientError, Hold, StoreClient, TargetMemory};
use hangar_store::protocol::{Selection, Source};
use hangar_store::registry::RegistryHandle;
use hangar_store::view::{ViewPlan, ViewSpec};
use hangar_store::{ArtifactId, BlobStore, StoreKey};
use rustix::fs::{MemfdFlags, SealFlags};

fn sel(id: ArtifactId, view: Option<&str>) -> Selection {
    Selection { artifact_id: id, view: view.map(|v| v.parse().unwrap()), key: None }
}

/// The canonical bytes of `id` (or of a view of it) as the local store
/// computes them, every chunk verified.
fn expected(root: &std::path::Path, id: &ArtifactId, view: Option<&str>) -> Vec<u8> {
    let art = BlobStore::open(root).unwrap().open_artifact(id).unwrap();
    match view {
        None => art.map_verified().unwrap().to_vec(),
        Some(v) => {
            let plan = ViewPlan::new(&art.index, &v.parse::<ViewSpec>().unwrap()).unwrap();
            let mut out = vec![0u8; plan.index.data_len as usize];
            plan.execute(art.index.data_len, &mut out, |i, buf| art.read_chunk(i, buf)).unwrap();
            out
        }
    }
}

/// Target memory of `len` bytes holding garbage, so zero padding must be written.
fn dirty_target(len: u64) -> TargetMemory {
    let mut t = TargetMemory::allocate(len).unwrap();
    t.bytes_mut().fill(0xA5);
    t
}

/// Nothing resident, nothing held: the daemon kept no copy.
fn kept_nothing(c: &mut StoreClient) {
    let (used, _, residents) = c.status().unwrap();
    assert_eq!((used, residents.len()), (0, 0), "resident after MaterializeIntoTarget: {residents:?}");
}

#[test]
fn a_whole_artifact_and_a_view_from_disk_land_in_the_callers_memory_and_nothing_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let f = import(dir.path(), &dir.path().join("src"), 3 << 20, 41, "m:v1");
    let d = daemon(dir.path(), 1 << 30);
    let mut c = StoreClient::connect(d.socket()).unwrap();

    let (id, layout) = c.describe(&sel(f.id, None)).unwrap();
    assert_eq!(id, f.id);
    let target = dirty_target(layout.data_len);
    let got = c.materialize_into(&sel(f.id, None), &target, 0).unwrap();
    assert_eq!((got.id, got.source, got.bytes), (f.id, Source::Local, layout.data_len));
    assert_eq!(target.bytes(), &expected(dir.path(), &f.id, None)[..], "bytes equal the stored artifact");
    let bias = got.tensor(target.bytes(), "layers.1.mlp.bias").unwrap();
    assert_eq!(bias, &common::tensor(&f, "layers.1.mlp.bias").data[..]);
    kept_nothing(&mut c);

    // A view, into a region at an odd offset of a larger memfd.
    let view = "1/3:*.weight=1,*.bias=0";
    let (vid, vlayout) = c.describe(&sel(f.id, Some(view))).unwrap();
    assert!(matches!(vid, ArtifactId::View(_)));
    let offset = 4096 + 13;
    let target = dirty_target(offset + vlayout.data_len + 100);
    let got = c.materialize_into(&sel(f.id, Some(view)), &target, offset).unwrap();
    assert_eq!((got.id, got.source), (vid, Source::Local));
    let at = offset as usize;
    assert_eq!(
        &target.bytes()[at..at + vlayout.data_len as usize],
        &expected(dir.path(), &f.id, Some(view))[..]
    );
    assert!(target.bytes()[..at].iter().all(|&b| b == 0xA5), "bytes before the region untouched");
    assert!(target.bytes()[at + vlayout.data_len as usize..].iter().all(|&b| b == 0xA5), "nor after");
    kept_nothing(&mut c);
}

fn http_events(d: &hangar_store::daemon::DaemonHandle) -> Option<serde_json::Value> {
    d.http_addr().map(|a| serde_json::from_str(&http_get(a, "/v1/events")).unwrap())
}

#[test]
fn a_resident_copy_is_copied_out_and_stays_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let f = import(dir.path(), &dir.path().join("src"), 2 << 20, 42, "m:v1");
    let d = daemon(dir.path(), 1 << 30);
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let m = c.materialize(&sel(f.id, None), Hold::Process).unwrap();
    c.confirm(&m, Duration::from_secs(20)).unwrap();
    let target = dirty_target(m.index.data_len);
    let got = c.materialize_into(&sel(f.id, None), &target, 0).unwrap();
    assert_eq!(got.source, Source::Resident);
    assert_eq!(target.bytes(), m.data());
    let (_, _, residents) = c.status().unwrap();
    assert_eq!(residents.len(), 1);
    assert_eq!(residents[0].refs, 1, "only the Materialize holds it: {residents:?}");

    // A view of the resident parent is cut from it too (the blob is gone).
    std::fs::remove_file(dir.path().join("artifacts").join(f.id.file_name()).join("data")).unwrap();
    let view = "0/2:*.weight=0";
    let (_, vlayout) = c.describe(&sel(f.id, Some(view))).unwrap();
    let target = dirty_target(vlayout.data_len);
    let got = c.materialize_into(&sel(f.id, Some(view)), &target, 0).unwrap();
    assert_eq!(got.source, Source::Resident);
    let plan = ViewPlan::new(&m.index, &view.parse().unwrap()).unwrap();
    let mut want = vec![0u8; plan.index.data_len as usize];
    plan.execute(m.index.data_len, &mut want, |i, buf| {
        let (a, b) = hangar_store::chunks::chunk_range(i, m.index.data_len);
        buf.copy_from_slice(&m.data()[a as usize..b as usize]);
        Ok(())
    })
    .unwrap();
    assert_eq!(target.bytes(), &want[..]);
    let (_, _, residents) = c.status().unwrap();
    assert_eq!(residents.len(), 1, "the view was not made resident: {residents:?}");
}

#[test]
fn from_a_peer_an_artifact_and_a_view_are_streamed_in_and_not_persisted() {
    let dir = tempfile::tempdir().unwrap();
    let (ra, rb) = (dir.path().join("a"), dir.path().join("b"));
    let f = import(&ra, &dir.path().join("src"), 6 << 20, 43, "org/t:v1");
    let registry = RegistryHandle::start("127.0.0.1:0".parse().unwrap(), 5_000).unwrap();
    let _a = node(&ra, &registry, |_| {});
    let b = node(&rb, &registry, |_| {});
    let key: StoreKey = "org/t:v1".parse().unwrap();
    let mut c = StoreClient::connect(b.socket()).unwrap().with_key_cache_ttl(Duration::ZERO);
    common::eventually("the registry learns a's holdings", || c.resolve_key(&key).is_ok());

    let whole = Selection { artifact_id: f.id, view: None, key: Some(key.clone()) };
    let (_, layout) = c.describe(&whole).unwrap();
    let target = dirty_target(layout.data_len);
    let got = c.materialize_into(&whole, &target, 0).unwrap();
    assert_eq!(got.source, Source::Peer);
    assert_eq!(target.bytes(), &expected(&ra, &f.id, None)[..], "peer bytes equal the original");

    let view = "2/4:*.weight=0";
    let part = Selection { artifact_id: f.id, view: Some(view.parse().unwrap()), key: Some(key) };
    let (_, vlayout) = c.describe(&part).unwrap();
    let target = dirty_target(vlayout.data_len);
    let got = c.materialize_into(&part, &target, 0).unwrap();
    assert_eq!(got.source, Source::Peer);
    assert_eq!(target.bytes(), &expected(&ra, &f.id, Some(view))[..]);

    kept_nothing(&mut c);
    std::thread::sleep(Duration::from_millis(200)); // a persist would have started by now
    assert!(!BlobStore::open(&rb).unwrap().knows(&f.id), "b stored nothing");
    let events = http_events(&b).unwrap();
    let kinds: Vec<(&str, bool)> = events
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["kind"].as_str().unwrap(), e["into_target"].as_bool().unwrap()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("ingestion_started", true),
            ("ingestion_completed", true),
            ("ingestion_started", true),
            ("ingestion_completed", true)
        ],
        "two ingestions into the caller's memory, nothing published"
    );
}

#[test]
fn a_view_of_a_parent_only_the_fallback_holds_is_streamed_without_making_it_resident() {
    let dir = tempfile::tempdir().unwrap();
    let fallback = dir.path().join("fallback");
    let origin = dir.path().join("origin");
    let f = import(&origin, &fallback.join("org/fb/v1"), 5 << 20, 44, "org/fb:v1");
    let node_root = dir.path().join("node");
    let mut cfg = hangar_store::daemon::DaemonConfig::new(&node_root, node_root.join("store.sock"));
    cfg.fallback = Some(fallback.display().to_string());
    let d = hangar_store::daemon::DaemonHandle::start(cfg).unwrap();
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let key: StoreKey = "org/fb:v1".parse().unwrap();
    for view in [Some("1/2:*.weight=1"), None] {
        let s =
            Selection { artifact_id: f.id, view: view.map(|v| v.parse().unwrap()), key: Some(key.clone()) };
        let (_, layout) = c.describe(&s).unwrap();
        let target = dirty_target(layout.data_len);
        let got = c.materialize_into(&s, &target, 0).unwrap();
        assert_eq!(got.source, Source::Fallback);
        assert_eq!(target.bytes(), &expected(&origin, &f.id, view)[..], "view {view:?}");
        kept_nothing(&mut c);
    }
    assert!(!BlobStore::open(&node_root).unwrap().knows(&f.id));
}

/// A memfd of `len` bytes with `seals` added.
fn memfd(len: u64, seals: SealFlags) -> std::os::fd::OwnedFd {
    let fd =
        rustix::fs::memfd_create("test-target", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    if !seals.is_empty() {
        rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
    }
    fd
}

#[test]
fn regions_that_cannot_take_the_bytes_are_refused_naming_what_and_where() {
    let dir = tempfile::tempdir().unwrap();
    let f = import(dir.path(), &dir.path().join("src"), 1 << 20, 45, "m:v1");
    let d = daemon(dir.path(), 1 << 30);
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let whole = sel(f.id, None);
    let (_, layout) = c.describe(&whole).unwrap();
    let need = layout.data_len;
    let refused = |c: &mut StoreClient, fd: std::os::fd::BorrowedFd<'_>, offset: u64, len: u64| -> String {
        match c.materialize_into_fd(&whole, fd, offset, len) {
            Err(ClientError::BadRequest(msg)) => msg,
            other => panic!("expected a refusal, got {other:?}"),
        }
    };

    // Smaller than the artifact: both sizes and the artifact named.
    let small = TargetMemory::allocate(need - 1).unwrap();
    let e = match c.materialize_into(&whole, &small, 0) {
        Err(ClientError::BadRequest(msg)) => msg,
        other => panic!("{other:?}"),
    };
    assert!(e.contains(&format!("is {} bytes", need - 1)) && e.contains(&format!("the {need} bytes")), "{e}");
    assert!(e.contains(&f.id.to_string()), "{e}");
    assert!(small.bytes().iter().all(|&b| b == 0), "nothing written into a refused region");
    // Smaller than a view (the view's id named).
    let view = sel(f.id, Some("0/2:*.weight=0"));
    let (vid, vlayout) = c.describe(&view).unwrap();
    let small = TargetMemory::allocate(vlayout.data_len - 64).unwrap();
    match c.materialize_into(&view, &small, 0) {
        Err(ClientError::BadRequest(msg)) => {
            assert!(msg.contains(&vid.to_string()) && msg.contains(&vlayout.data_len.to_string()), "{msg}")
        }
        other => panic!("{other:?}"),
    }

    let shrink = SealFlags::SHRINK;
    let e = refused(&mut c, memfd(need, shrink | SealFlags::WRITE).as_fd(), 0, need);
    assert!(e.contains("sealed against writes") && e.contains("F_SEAL_WRITE"), "{e}");
    let e = refused(&mut c, memfd(need, shrink | SealFlags::FUTURE_WRITE).as_fd(), 0, need);
    assert!(e.contains("sealed against writes") && e.contains("F_SEAL_FUTURE_WRITE"), "{e}");
    let e = refused(&mut c, memfd(need, SealFlags::empty()).as_fd(), 0, need);
    assert!(e.contains("not sealed against shrinking"), "{e}");
    let e = refused(&mut c, memfd(need, shrink).as_fd(), 100, need);
    assert!(
        e.contains(&format!("100..{}", need + 100)) && e.contains(&format!("which is {need} bytes")),
        "{e}"
    );
    let e = refused(&mut c, memfd(need, shrink).as_fd(), 0, 0);
    assert!(e.contains("empty"), "{e}");
    let file = std::fs::File::create(dir.path().join("plain")).unwrap();
    file.set_len(need).unwrap();
    let e = refused(&mut c, file.as_fd(), 0, need);
    assert!(e.contains("not a memfd"), "{e}");
    let rw = memfd(need, shrink);
    let ro = std::fs::File::open(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&rw))).unwrap();
    let e = refused(&mut c, ro.as_fd(), 0, need);
    assert!(e.contains("read-only"), "{e}");

    // No fd at all: a raw request.
    {
        use hangar_store::memory::{recv_frame, send_frame};
        use hangar_store::protocol::{ErrorKind, Request, Response};
        let s = std::os::unix::net::UnixStream::connect(d.socket()).unwrap();
        let req = Request::MaterializeIntoTarget { selection: whole.clone(), offset: 0, len: need };
        send_frame(&s, &serde_json::to_vec(&req).unwrap(), None).unwrap();
        let (payload, _) = recv_frame(&s).unwrap().unwrap();
        match serde_json::from_slice::<Response>(&payload).unwrap() {
            Response::Error { kind: ErrorKind::BadRequest, message } => {
                assert!(message.contains("SCM_RIGHTS"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }
    kept_nothing(&mut c);

    // The daemon is still fine: a good region works.
    let ok = TargetMemory::allocate(need).unwrap();
    assert_eq!(c.materialize_into(&whole, &ok, 0).unwrap().bytes, need);
}
