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
