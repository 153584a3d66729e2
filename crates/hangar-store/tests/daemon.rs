//! The daemon over its Unix socket: lease-in-place across real processes,
//! references, TTL leases, budget and eviction, views, errors.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{daemon, eventually, import, tensor};
use hangar_store::client::{ClientError, Hold, StoreClient};
use hangar_store::protocol::{Selection, Source};
use hangar_store::ArtifactId;

fn sel(id: ArtifactId) -> Selection {
    Selection { artifact_id: id, view: None, key: None }
}

const CONFIRM: Duration = Duration::from_secs(20);

/// Not a test on its own: the child process of
/// `lease_in_place_across_two_processes`. It materializes, confirms, prints
/// what it mapped, then holds the reference until killed.
#[test]
#[ignore = "helper process spawned by lease_in_place_across_two_processes"]
fn child_holder() {
    let socket = std::env::var("HANGAR_STORE_CHILD_SOCKET").expect("run by the parent test");
    let id: ArtifactId = std::env::var("HANGAR_STORE_CHILD_ID").unwrap().parse().unwrap();
    let mut c = StoreClient::connect(socket).unwrap();
    let m = c.materialize(&sel(id), Hold::Process).unwrap();
    c.confirm(&m, CONFIRM).unwrap();
    let (dev, ino) = m.memory_identity().unwrap();
    println!("HELD reused={} dev={dev} ino={ino} hash={}", m.reused, blake3::hash(m.data()).to_hex());
    std::io::stdin().lines().for_each(drop); // hold until killed
}

struct Child {
    proc: std::process::Child,
    line: String,
}

fn spawn_holder(socket: &std::path::Path, id: ArtifactId) -> Child {
    let mut proc = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_holder", "--nocapture", "--test-threads=1"])
        .env("HANGAR_STORE_CHILD_SOCKET", socket)
        .env("HANGAR_STORE_CHILD_ID", id.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(proc.stdout.take().unwrap());
    let mut line = String::new();
    // libtest may print `test child_holder ... ` on the same line first.
    while !line.contains("HELD ") {
        line.clear();
        assert_ne!(out.read_line(&mut line).unwrap(), 0, "child exited before holding");
    }
    let line = line[line.find("HELD ").unwrap()..].to_owned();
    Child { proc, line }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace().find_map(|kv| kv.strip_prefix(&format!("{name}="))).unwrap()
}

#[test]
fn lease_in_place_across_two_processes() {
    let dir = tempfile::tempdir().unwrap();
    let f = import(dir.path(), &dir.path().join("src"), 3 << 20, 1, "m:v1");
    let d = daemon(dir.path(), 1 << 30);
    let mut c = StoreClient::connect(d.socket()).unwrap();

    let mut a = spawn_holder(d.socket(), f.id);
    assert_eq!(field(&a.line, "reused"), "false");
    let (used_after_first, _, _) = c.status().unwrap();
    let b = spawn_holder(d.socket(), f.id);
    assert_eq!(field(&b.line, "reused"), "true", "second call must reuse the resident copy");
    assert_eq!(
        (field(&a.line, "dev"), field(&a.line, "ino")),
        (field(&b.line, "dev"), field(&b.line, "ino"))
    );
    assert_eq!(field(&a.line, "hash"), field(&b.line, "hash"));
    let (used, _, residents) = c.status().unwrap();
    assert_eq!(used, used_after_first, "the second call allocated nothing");
    assert_eq!(residents.len(), 1);
    assert_eq!(residents[0].refs, 2);

    a.proc.kill().unwrap();
    a.proc.wait().unwrap();
    eventually("the dead client's reference is released", || c.status().unwrap().2[0].refs == 1);
    let (_, _, residents) = c.status().unwrap();
    assert_eq!(residents[0].refs, 1, "only the dead process's reference goes");
    drop(b);
    eventually("the second reference is released", || c.status().unwrap().2[0].refs == 0);
}

#[test]
fn budget_evicts_unreferenced_lru_and_never_referenced() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let fx: Vec<_> =
        (0..3).map(|i| import(dir.path(), &src.join(i.to_string()), 1 << 20, 10 + i, "m:x")).collect();
    let size = stored_size(&fx[0].id, dir.path());
    let d = daemon(dir.path(), size * 2 + size / 2);
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let a = c.materialize(&sel(fx[0].id), Hold::Process).unwrap();
    let b = c.materialize(&sel(fx[1].id), Hold::Process).unwrap();
    match c.materialize(&sel(fx[2].id), Hold::Process) {
        Err(ClientError::OutOfBudget(msg)) => assert!(msg.contains("budget"), "{msg}"),
        other => panic!("expected out of budget, got {other:?}"),
    }
    c.confirm(&b, CONFIRM).unwrap();
    assert!(c.unload(&b).unwrap());
    assert!(!c.unload(&b).unwrap(), "unload is idempotent");
    let third = c.materialize(&sel(fx[2].id), Hold::Process).unwrap();
    c.confirm(&third, CONFIRM).unwrap();
    let ids: Vec<ArtifactId> = c.status().unwrap().2.into_iter().map(|r| r.id).collect();
    assert!(ids.contains(&fx[0].id), "referenced artifact evicted");
    assert!(!ids.contains(&fx[1].id), "unreferenced artifact kept over budget");
    c.confirm(&a, CONFIRM).unwrap();
    assert_eq!(a.tensor("layers.0.mlp.weight").unwrap(), &tensor(&fx[0], "layers.0.mlp.weight").data[..]);
}

/// Under a disk budget the daemon drops the bytes of stored artifacts
/// least recently used first, never one a holder references however old,
/// and keeps every key.
#[test]
fn the_disk_budget_drops_the_least_recently_used_unreferenced_blobs_and_keeps_keys() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let fx: Vec<_> = (0..4)
        .map(|i| {
            std::thread::sleep(Duration::from_millis(20)); // distinct import times
            import(dir.path(), &src.join(i.to_string()), 1 << 20, 20 + i, &format!("m:v{i}"))
        })
        .collect();
    let on_disk = || -> Vec<(ArtifactId, u64)> {
        let usage = hangar_store::BlobStore::open(dir.path()).unwrap().usage().unwrap();
        usage.into_iter().map(|(id, bytes, _)| (id, bytes)).collect()
    };
    let each = on_disk()[0].1;
    let mut cfg = hangar_store::daemon::DaemonConfig::new(dir.path(), dir.path().join("store.sock"));
    cfg.disk_budget = Some(each * 3 + each / 2);
    let d = hangar_store::daemon::DaemonHandle::start(cfg).unwrap();
    let mut c = StoreClient::connect(d.socket()).unwrap();
    // The oldest is held; the newest is used now.
    let oldest = c.materialize(&sel(fx[0].id), Hold::Process).unwrap();
    c.confirm(&oldest, CONFIRM).unwrap();
    let newest = c.materialize(&sel(fx[3].id), Hold::Process).unwrap();
    c.confirm(&newest, CONFIRM).unwrap();
    eventually("the store is under its disk budget", || on_disk().len() == 3);
    let kept: Vec<ArtifactId> = on_disk().into_iter().map(|(id, _)| id).collect();
    assert!(!kept.contains(&fx[1].id), "the least recently used unreferenced one goes: {kept:?}");
    assert!(kept.contains(&fx[0].id), "the oldest is held: it stays");
    assert!(kept.contains(&fx[2].id) && kept.contains(&fx[3].id));
    let keys = hangar_store::BlobStore::open(dir.path()).unwrap().keys().unwrap();
    assert_eq!(keys.len(), 4, "the budget drops bytes, never keys: {keys:?}");
    assert_eq!(keys[&"m:v1".parse().unwrap()], fx[1].id);
    drop((oldest, newest, d));
}

/// Data bytes of a stored artifact.
fn stored_size(id: &ArtifactId, root: &std::path::Path) -> u64 {
    hangar_store::BlobStore::open(root).unwrap().open_artifact(id).unwrap().index.data_len
}

#[test]
fn ttl_leases_expire_and_keep_alive_extends() {
    let dir = tempfile::tempdir().unwrap();
    let f = import(dir.path(), &dir.path().join("src"), 1 << 20, 2, "m:v1");
    let d = daemon(dir.path(), 1 << 30);
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let m = c.materialize(&sel(f.id), Hold::Lease(Duration::from_millis(300))).unwrap();
    c.confirm(&m, CONFIRM).unwrap();
    assert!(c.keep_alive(&m, Duration::from_secs(3)).unwrap() > Duration::from_secs(2));
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(c.status().unwrap().2[0].refs, 1, "keep-alive must have extended the lease");
    c.keep_alive(&m, Duration::from_millis(100)).unwrap();
    eventually("the lease expires", || c.status().unwrap().2[0].refs == 0);
    assert!(matches!(c.keep_alive(&m, Duration::from_secs(1)), Err(ClientError::BadRequest(_))));
}

#[test]
fn corrupt_blob_fails_confirm_and_is_never_reused() {
    let dir = tempfile::tempdir().unwrap();
    let f = import(dir.path(), &dir.path().join("src"), 2 << 20, 3, "m:v1");
    let data = dir.path().join("artifacts").join(f.id.file_name()).join("data");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&data, bytes).unwrap();
    let d = daemon(dir.path(), 1 << 30);
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let m = c.materialize(&sel(f.id), Hold::Process).unwrap();
    match c.confirm(&m, CONFIRM) {
        Err(ClientError::HashMismatch(msg)) => assert!(msg.contains("chunk 0"), "{msg}"),
        other => panic!("expected a hash mismatch, got {other:?}"),
    }
    assert!(c.status().unwrap().2.is_empty(), "failed load must not stay resident");
    let again = c.materialize(&sel(f.id), Hold::Process).unwrap();
    assert!(!again.reused);
    assert!(c.confirm(&again, CONFIRM).is_err());
}

#[test]
fn typed_errors_for_unknown_keys_artifacts_and_missing_daemon() {
    let dir = tempfile::tempdir().unwrap();
    match StoreClient::connect(dir.path().join("nobody.sock")) {
        Err(e @ ClientError::DaemonUnavailable { .. }) => {
            assert!(e.to_string().contains("hangar store serve"))
        }
        other => panic!("expected daemon unavailable, got {other:?}"),
    }
    let d = daemon(dir.path(), 1 << 30);
    let mut c = StoreClient::connect(d.socket()).unwrap();
    match c.resolve_key(&"no/such:key".parse().unwrap()) {
        Err(ClientError::UnknownKey(msg)) => assert!(msg.contains("no/such:key"), "{msg}"),
        other => panic!("expected unknown key, got {other:?}"),
    }
    let ghost = ArtifactId::Full { index: [1; 32], data: [2; 32] };
    assert!(matches!(c.materialize(&sel(ghost), Hold::Process), Err(ClientError::UnknownArtifact(_))));
    assert!(!c.unload_replica(hangar_core::ReplicaId::from_u128(5)).unwrap(), "unload of nothing is a no-op");
}

#[test]
fn keys_resolve_and_are_cached_client_side() {
    let dir = tempfile::tempdir().unwrap();
    let f = import(dir.path(), &dir.path().join("src"), 1 << 16, 4, "org/m:v1");
    let d = daemon(dir.path(), 1 << 30);
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let key = "org/m:v1".parse().unwrap();
    assert_eq!(c.resolve_key(&key).unwrap(), f.id);
    hangar_store::BlobStore::open(dir.path())
        .unwrap()
        .remove(&hangar_store::IdOrKey::Key(key.clone()))
        .unwrap();
    assert_eq!(c.resolve_key(&key).unwrap(), f.id, "served from the 30 s cache");
    let mut fresh = StoreClient::connect(d.socket()).unwrap().with_key_cache_ttl(Duration::ZERO);
    assert!(matches!(fresh.resolve_key(&key), Err(ClientError::UnknownKey(_))));
}

#[test]
fn views_are_exact_shards_with_zero_padding_and_shared_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let f = import(dir.path(), &dir.path().join("src"), 3 << 20, 5, "m:v1");
    let d = daemon(dir.path(), 1 << 30);
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let world = 3u32;
    for rank in 0..world {
        let view = format!("{rank}/{world}:*.weight=1,*.bias=0").parse().unwrap();
        let s = Selection { artifact_id: f.id, view: Some(view), key: None };
        let m = c.materialize(&s, Hold::Process).unwrap();
        assert!(!m.reused);
        assert_eq!(c.confirm(&m, CONFIRM).unwrap().source, Source::Local);
        assert!(matches!(m.id, ArtifactId::View(_)));
        for (name, full) in &f.tensors {
            let (rows, cols, elem) = match full.shape.as_slice() {
                [r, c] => (*r, *c, 2usize),
                [n] => (1, *n, 4usize),
                _ => unreachable!(),
            };
            // Weights split on dim 1 (columns), biases on dim 0: both split `cols`.
            let per = cols.div_ceil(world as usize);
            let lo = (rank as usize * per).min(cols);
            let hi = ((rank as usize + 1) * per).min(cols);
            let got = m.tensor(name).unwrap();
            assert_eq!(got.len(), rows * per * elem, "{name} shard size");
            for r in 0..rows {
                let want = &full.data[(r * cols + lo) * elem..(r * cols + hi) * elem];
                let row = &got[r * per * elem..(r + 1) * per * elem];
                assert_eq!(&row[..want.len()], want, "{name} rank {rank} row {r}");
                assert!(row[want.len()..].iter().all(|&b| b == 0), "{name} rank {rank}: padding not zero");
            }
        }
        let again = c.materialize(&s, Hold::Process).unwrap();
        assert!(again.reused, "a view is shared lease-in-place like any artifact");
        assert_eq!(again.id, m.id);
    }
    let bad = Selection { artifact_id: f.id, view: Some("0/2:*.bias=1".parse().unwrap()), key: None };
    match c.materialize(&bad, Hold::Process) {
        Err(ClientError::BadRequest(msg)) => assert!(msg.contains("cannot split dim 1"), "{msg}"),
        other => panic!("expected a bad view error, got {other:?}"),
    }
}

#[test]
fn malformed_requests_get_an_error_and_the_connection_survives() {
    use hangar_store::memory::{recv_frame, send_frame};
    use hangar_store::protocol::{ErrorKind, Request, Response};
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(dir.path(), 1 << 30);
    let s = std::os::unix::net::UnixStream::connect(d.socket()).unwrap();
    for bad in [&b"{not json"[..], br#"{"op":"Materialize"}"#, br#"{"op":"Explode"}"#] {
        send_frame(&s, bad, None).unwrap();
        let (payload, fds) = recv_frame(&s).unwrap().unwrap();
        assert!(fds.is_empty());
        match serde_json::from_slice::<Response>(&payload).unwrap() {
            Response::Error { kind: ErrorKind::BadRequest, message } => {
                assert!(message.contains("malformed"), "{message}")
            }
            other => panic!("expected bad request, got {other:?}"),
        }
    }
    send_frame(&s, &serde_json::to_vec(&Request::Status).unwrap(), None).unwrap();
    let (payload, _) = recv_frame(&s).unwrap().unwrap();
    assert!(matches!(serde_json::from_slice::<Response>(&payload).unwrap(), Response::Status { .. }));
}

#[test]
fn a_restarted_daemon_is_reached_again_by_one_retry_on_a_fresh_connection() {
    let dir = tempfile::tempdir().unwrap();
    let f = import(dir.path(), &dir.path().join("src"), 1 << 16, 8, "m:v1");
    let d = daemon(dir.path(), 1 << 30);
    let mut c = StoreClient::connect(d.socket()).unwrap().with_key_cache_ttl(Duration::ZERO);
    assert_eq!(c.resolve_key(&"m:v1".parse().unwrap()).unwrap(), f.id);
    drop(d);
    let _d = daemon(dir.path(), 1 << 30);
    assert_eq!(c.resolve_key(&"m:v1".parse().unwrap()).unwrap(), f.id, "the stale connection was replaced");
}

#[test]
fn producers_register_bytes_in_place_through_the_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let f = import(dir.path(), &dir.path().join("src"), 1 << 20, 9, "m:files");
    let d = daemon(dir.path(), 1 << 30);
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let specs = || hangar_store::synth::specs(&f.tensors);
    let mut p = c.begin_register(specs(), vec!["m:streamed".parse().unwrap()]).unwrap();
    for (name, t) in &f.tensors {
        p.tensor_mut(name).unwrap().copy_from_slice(&t.data);
    }
    let report = c.commit_register(p).unwrap();
    assert_eq!(report.id, f.id, "same tensors, same id, whatever the producer");
    assert!(report.existed);
    assert_eq!(c.resolve_key(&"m:streamed".parse().unwrap()).unwrap(), f.id);

    let mut changed = c.begin_register(specs(), vec![]).unwrap();
    let (name, _) = &f.tensors[0];
    changed.tensor_mut(name).unwrap()[0] ^= 1; // everything else zero: a different artifact
    let other = c.commit_register(changed).unwrap();
    assert!(!other.existed && other.id != f.id);
    hangar_store::BlobStore::open(dir.path())
        .unwrap()
        .open_artifact(&other.id)
        .unwrap()
        .map_verified()
        .unwrap();

    let aborted = c.begin_register(specs(), vec![]).unwrap();
    let handle = aborted.handle;
    c.abort_register(aborted).unwrap();
    {
        use hangar_store::memory::{recv_frame, send_frame};
        use hangar_store::protocol::{ErrorKind, Request, Response};
        let s = std::os::unix::net::UnixStream::connect(d.socket()).unwrap();
        send_frame(
            &s,
            &serde_json::to_vec(&Request::CommitRegister { handle, serving: Default::default() }).unwrap(),
            None,
        )
        .unwrap();
        let (payload, _) = recv_frame(&s).unwrap().unwrap();
        match serde_json::from_slice::<Response>(&payload).unwrap() {
            Response::Error { kind: ErrorKind::BadRequest, message } => {
                assert!(message.contains("unknown handle"), "{message}")
            }
            other => panic!("an aborted registration must not commit: {other:?}"),
        }
    }
    let dup = vec![specs()[0].clone(), specs()[0].clone()];
    assert!(matches!(c.begin_register(dup, vec![]), Err(ClientError::BadRequest(_))));
}
