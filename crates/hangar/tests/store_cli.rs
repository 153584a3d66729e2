//! `hangar store` from the command line: import, ls, stat, get, rm and bad input.

use std::path::Path;
use std::process::{Command, Output};

use hangar_store::synth::{model, write_files};

fn hangar(root: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hangar"))
        .arg("store")
        .args(args)
        .env("HANGAR_STORE_ROOT", root)
        .env_remove("HANGAR_STORE_SOCKET")
        .output()
        .expect("hangar runs")
}

fn ok(out: Output) -> String {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn err(out: Output) -> String {
    assert!(!out.status.success(), "unexpected success: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8(out.stderr).unwrap()
}

#[test]
fn import_ls_stat_get_rm_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let tensors = model(1 << 18, 2, 5);
    let files = write_files(&dir.path().join("src"), &tensors, 2).unwrap();
    let f: Vec<&str> = files.iter().map(|p| p.to_str().unwrap()).collect();

    let first = ok(hangar(&root, &["import", f[0], f[1], "--key", "demo/m:v1"]));
    assert!(first.starts_with("imported hg1:"), "{first}");
    let id = first.split_whitespace().nth(1).unwrap().to_owned();
    let again = ok(hangar(&root, &["import", f[1], f[0], "--key", "demo/m:v2"]));
    assert!(again.starts_with(&format!("existed {id}")), "{again}");

    let ls = ok(hangar(&root, &["ls"]));
    assert!(ls.contains(&id) && ls.contains("demo/m:v1,demo/m:v2"), "{ls}");
    let stat = ok(hangar(&root, &["stat", "demo/m:v1", "--verify"]));
    assert!(stat.contains("layers.1.mlp.weight") && stat.contains("verified"), "{stat}");

    let out = dir.path().join("out");
    ok(hangar(&root, &["get", &id, "--out", out.to_str().unwrap()]));
    let exported = out.join("model.safetensors");
    let reimported = ok(hangar(&root, &["import", exported.to_str().unwrap()]));
    assert!(reimported.starts_with(&format!("existed {id}")), "export must round-trip: {reimported}");

    ok(hangar(&root, &["rm", "demo/m:v1"]));
    assert!(ok(hangar(&root, &["ls"])).contains(&id));
    ok(hangar(&root, &["rm", "demo/m:v2"]));
    assert!(!ok(hangar(&root, &["ls"])).contains(&id));
}

#[test]
fn bad_input_gets_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let e = err(hangar(&root, &["stat", "nobody/here:v1"]));
    assert!(e.contains("unknown key `nobody/here:v1`"), "{e}");
    let e = err(hangar(&root, &["stat", "../../etc/passwd"]));
    assert!(e.contains("segment"), "{e}");
    let e = err(hangar(&root, &["get", "hg1:../../x:y", "--out", "/tmp/x"]));
    assert!(e.contains("not an artifact id"), "{e}");
    let bogus = dir.path().join("bogus.safetensors");
    std::fs::write(&bogus, b"\xff\xff\x00\x00\x00\x00\x00\x00{}").unwrap();
    let e = err(hangar(&root, &["import", bogus.to_str().unwrap(), "--key", "x:1"]));
    assert!(e.contains("bogus.safetensors") && e.contains("header says"), "{e}");
    let e = err(hangar(&root, &["import", dir.path().join("missing").to_str().unwrap()]));
    assert!(e.contains("missing") && e.contains("No such file"), "{e}");
}

/// Kills the spawned daemon even when the test fails.
struct Serve(std::process::Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn serve_then_get_a_view_and_status_through_the_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let files = write_files(&dir.path().join("src"), &model(1 << 18, 2, 6), 1).unwrap();
    ok(hangar(&root, &["import", files[0].to_str().unwrap(), "--key", "demo/m:v1"]));
    let socket = dir.path().join("d.sock");
    let s = socket.to_str().unwrap();
    let _serve = Serve(
        Command::new(env!("CARGO_BIN_EXE_hangar"))
            .args(["store", "serve", "--socket", s, "--listen", "127.0.0.1:0", "--budget", "64MiB"])
            .env("HANGAR_STORE_ROOT", &root)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let start = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(start.elapsed() < std::time::Duration::from_secs(10), "daemon did not start");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = dir.path().join("rank1");
    let got = ok(hangar(
        &root,
        &["get", "demo/m:v1", "--socket", s, "--view", "1/2:*.weight=0", "--out", out.to_str().unwrap()],
    ));
    assert!(got.contains("hg1v:") && got.contains("from local"), "{got}");
    let local = dir.path().join("rank1-local");
    ok(hangar(&root, &["get", "demo/m:v1", "--view", "1/2:*.weight=0", "--out", local.to_str().unwrap()]));
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        std::fs::read(local.join("model.safetensors")).unwrap(),
        "daemon and local views agree"
    );
    let status = ok(hangar(&root, &["status", "--socket", s]));
    assert!(status.contains("hg1v:") && status.contains("0 refs"), "{status}");
    let e = err(hangar(&root, &["get", "nobody:v1", "--socket", s, "--out", out.to_str().unwrap()]));
    assert!(e.contains("unknown key"), "{e}");
}
