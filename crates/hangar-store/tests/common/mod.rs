//! Helpers shared by the daemon tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hangar_store::daemon::{DaemonConfig, DaemonHandle};
use hangar_store::synth::{model, write_files, OwnedTensor};
use hangar_store::{ArtifactId, BlobStore, StoreKey};

/// A model written as safetensors files and imported into a store root.
pub struct Fixture {
    pub tensors: Vec<(String, OwnedTensor)>,
    pub files: Vec<PathBuf>,
    pub id: ArtifactId,
}

pub fn import(root: &Path, src: &Path, bytes: u64, seed: u64, key: &str) -> Fixture {
    let tensors = model(bytes, 3, seed);
    let files = write_files(src, &tensors, 2).unwrap();
    let key: StoreKey = key.parse().unwrap();
    let id = BlobStore::open(root).unwrap().import_files(&files, &[key]).unwrap().id;
    Fixture { tensors, files, id }
}

/// A daemon on `root` serving peers on loopback and heartbeating to
/// `registry` every 50 ms under its root's path as node name.
pub fn node(
    root: &Path,
    registry: &hangar_store::registry::RegistryHandle,
    tweak: impl FnOnce(&mut DaemonConfig),
) -> DaemonHandle {
    let mut cfg = DaemonConfig::new(root, root.join("store.sock"));
    cfg.listen = Some("127.0.0.1:0".parse().unwrap());
    cfg.registry = Some(registry.url());
    cfg.heartbeat = Duration::from_millis(50);
    cfg.node = root.display().to_string();
    tweak(&mut cfg);
    DaemonHandle::start(cfg).unwrap()
}

pub fn daemon(root: &Path, budget: u64) -> DaemonHandle {
    let mut cfg = DaemonConfig::new(root, root.join("store.sock"));
    cfg.budget = budget;
    DaemonHandle::start(cfg).unwrap()
}

/// Polls `f` until it returns true; panics after 10 s (a hang, not a speed check).
pub fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The canonical bytes of a fixture's tensor `name`.
pub fn tensor<'a>(f: &'a Fixture, name: &str) -> &'a OwnedTensor {
    &f.tensors.iter().find(|(n, _)| n == name).unwrap().1
}

/// A plain HTTP/1.1 GET on loopback; returns the body.
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "GET {path}: {out}");
    out.split_once("\r\n\r\n").unwrap().1.to_owned()
}
