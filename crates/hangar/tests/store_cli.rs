//! `hangar store` from the command line: import, ls, stat, get, rm, adapters and bad input.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{start_store, store, Killed};
use hangar_store::synth::{model, write_files};

fn hangar(root: &Path, args: &[&str]) -> Output {
    store(root, args).output().expect("hangar runs")
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

/// Issue 30: a LoRA adapter's directory imported under `BASE:ADAPTER`,
/// listed, marked in `ls`, written back by `get` and removed by name.
#[test]
fn an_adapter_is_imported_listed_written_back_and_removed_by_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let src = dir.path().join("support-v2");
    let s = src.to_str().unwrap();
    let wrote = ok(hangar(
        &root,
        &["synth-adapter", s, "--base-model", "meta-llama/Meta-Llama-3-8B", "--rank", "4", "--hidden", "64"],
    ));
    assert!(wrote.starts_with(&format!("wrote {s} (2 files, ")), "{wrote}");

    let out = hangar(&root, &["import-adapter", s, "--adapter", "meta/llama-3-8b:acme/support-v2"]);
    assert!(out.stderr.is_empty(), "no warning: {}", String::from_utf8_lossy(&out.stderr));
    let first = ok(out);
    assert!(
        first.starts_with("imported hg1:")
            && first.contains(" as meta/llama-3-8b:acme/support-v2 (2 files, ")
    );
    let id = first.split_whitespace().nth(1).unwrap().to_owned();
    let again = ok(hangar(&root, &["import-adapter", s, "--adapter", "meta/llama-3-8b:acme/support-v2"]));
    assert!(again.starts_with(&format!("existed {id} as ")), "{again}");

    // The same name under another base: another adapter, and a warning
    // that the config's base model does not look like it.
    let other = hangar(&root, &["import-adapter", s, "--adapter", "synth/m0:acme/support-v2", "--json"]);
    let warning = String::from_utf8_lossy(&other.stderr).into_owned();
    assert!(warning.starts_with("warning: ") && warning.contains("`synth/m0`"), "{warning}");
    let other: serde_json::Value = serde_json::from_str(&ok(other)).unwrap();
    assert_ne!(other["id"], id.as_str());
    assert_eq!(other["existed"], false);

    let table = ok(hangar(&root, &["adapters"]));
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("BASE ") && lines[0].contains("ADAPTER") && lines[0].ends_with("ID"),
        "{table}"
    );
    assert_eq!(lines.len(), 3, "{table}");
    assert!(lines[1].starts_with("meta/llama-3-8b acme/support-v2 "), "{table}");
    assert!(lines[2].starts_with("synth/m0        acme/support-v2 "), "columns aligned: {table}");
    assert!(lines[1].ends_with(&format!(" yes  {id}")), "{table}");
    let json = ok(hangar(&root, &["adapters", "--base", "meta/llama-3-8b", "--json"]));
    let rows: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 1, "{json}");
    assert_eq!(rows[0]["adapter"], "meta/llama-3-8b:acme/support-v2");
    assert_eq!(
        (&rows[0]["base"], &rows[0]["name"], &rows[0]["id"]),
        (&"meta/llama-3-8b".into(), &"acme/support-v2".into(), &id.as_str().into())
    );
    assert_eq!(rows[0]["on_disk"], true);
    let files: u64 = ["adapter_config.json", "adapter_model.safetensors"]
        .iter()
        .map(|f| std::fs::metadata(src.join(f)).unwrap().len())
        .sum();
    assert_eq!(
        rows[0]["bytes"], files,
        "the synthetic adapter's files are written as the store exports them"
    );

    let line = ls_line(&root, &id);
    assert!(line.ends_with(" yes adapter    meta/llama-3-8b:acme/support-v2"), "{line}");

    let got = dir.path().join("got");
    ok(hangar(&root, &["get", &id, "--out", got.to_str().unwrap()]));
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        assert_eq!(std::fs::read(got.join(f)).unwrap(), std::fs::read(src.join(f)).unwrap(), "{f}");
    }

    let rm = ok(hangar(&root, &["rm", "--adapter", "meta/llama-3-8b:acme/support-v2"]));
    assert_eq!(rm.trim(), format!("removed adapter meta/llama-3-8b:acme/support-v2 and {id}"));
    let table = ok(hangar(&root, &["adapters"]));
    assert!(!table.contains("meta/llama-3-8b") && table.contains("synth/m0"), "{table}");
    assert!(!ok(hangar(&root, &["ls"])).contains(&id));
}

#[test]
fn bad_adapter_input_gets_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let src = dir.path().join("a");
    let s = src.to_str().unwrap();
    ok(hangar(&root, &["synth-adapter", s, "--rank", "2", "--hidden", "8", "--layers", "1"]));
    let refused = [
        ("meta/llama", "`meta/llama` names no adapter; write BASE:ADAPTER"),
        ("meta/llama:", "`meta/llama:` has no adapter name after `:`"),
        ("m:a:b", "has a second `:` at byte 3"),
        ("m:../x", "adapter name `../x` has the segment `..`"),
    ];
    for (adapter, says) in refused {
        let e = err(hangar(&root, &["import-adapter", s, "--adapter", adapter]));
        assert!(e.contains(says) && e.contains("--adapter"), "{adapter}: {e}");
    }
    std::fs::remove_file(src.join("adapter_config.json")).unwrap();
    let e = err(hangar(&root, &["import-adapter", s, "--adapter", "m:a"]));
    assert!(e.contains(&format!("{s} has no adapter_config.json")), "{e}");
    let e = err(hangar(&root, &["rm", "--adapter", "m:a"]));
    assert!(e.contains("unknown adapter m:a"), "{e}");
    let e = err(hangar(&root, &["rm", "m:v1", "--adapter", "m:a"]));
    assert!(e.contains("cannot be used with"), "{e}");
    let e = err(hangar(&root, &["rm"]));
    assert!(e.contains("--adapter"), "{e}");
}

/// Kills the spawned daemon even when the test fails.

#[test]
fn serve_then_get_a_view_and_status_through_the_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let files = write_files(&dir.path().join("src"), &model(1 << 18, 2, 6), 1).unwrap();
    ok(hangar(&root, &["import", files[0].to_str().unwrap(), "--key", "demo/m:v1"]));
    let socket = dir.path().join("d.sock");
    let s = socket.to_str().unwrap();
    let _serve = Killed(
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

/// Runs `hangar store ARGS` that should exit on its own, waiting at most
/// 10 s (a hang, not a speed check); killed if it does not.
fn exits(root: &Path, args: &[&str]) -> Output {
    let child = store(root, args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut guard = Killed(child);
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = guard.0.try_wait().unwrap() {
            break status;
        }
        assert!(start.elapsed() < std::time::Duration::from_secs(10), "hangar store {args:?} did not exit");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let read = |pipe: Option<&mut dyn std::io::Read>| {
        let mut buf = Vec::new();
        pipe.unwrap().read_to_end(&mut buf).unwrap();
        buf
    };
    let stdout = read(guard.0.stdout.as_mut().map(|p| p as &mut dyn std::io::Read));
    let stderr = read(guard.0.stderr.as_mut().map(|p| p as &mut dyn std::io::Read));
    Output { status, stdout, stderr }
}

/// The `ls` line of `id`.
fn ls_line(root: &Path, id: &str) -> String {
    let ls = ok(hangar(root, &["ls"]));
    assert!(ls.lines().next().unwrap().contains("ON_DISK"), "{ls}");
    ls.lines().find(|l| l.starts_with(id)).unwrap_or_else(|| panic!("{id} not listed: {ls}")).to_owned()
}

/// Issue 27: a key whose bytes the daemon's disk budget dropped is still
/// listed (not on disk), `stat` says why it cannot read it, and `get`
/// through the daemon fetches it again from the fallback.
#[test]
fn a_key_whose_bytes_the_disk_budget_dropped_is_listed_and_fetched_again() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let fallback = dir.path().join("fallback");
    let x = write_files(&fallback.join("demo/x/v1"), &model(1 << 18, 2, 7), 1).unwrap();
    let y = write_files(&dir.path().join("y"), &model(1 << 18, 2, 8), 1).unwrap();
    let imported = ok(hangar(&root, &["import", x[0].to_str().unwrap(), "--key", "demo/x:v1"]));
    let x_id = imported.split_whitespace().nth(1).unwrap().to_owned();
    let imported = ok(hangar(&root, &["import", y[0].to_str().unwrap(), "--key", "demo/y:v1"]));
    let y_id = imported.split_whitespace().nth(1).unwrap().to_owned();
    assert!(ls_line(&root, &x_id).contains(" yes model      demo/x:v1"), "{}", ls_line(&root, &x_id));
    // Room for one of the two.
    let one = hangar_store::BlobStore::open(&root).unwrap().usage().unwrap()[0].1 * 3 / 2;
    let socket = dir.path().join("d.sock");
    let s = socket.to_str().unwrap();
    let budget = format!("{one}B");
    let _serve = start_store(
        &root,
        &["serve", "--socket", s, "--disk-budget", &budget, "--fallback", fallback.to_str().unwrap()],
    );
    let out = dir.path().join("out");
    let o = out.to_str().unwrap();
    ok(hangar(&root, &["get", "demo/y:v1", "--socket", s, "--out", o]));
    let wait_for = |what: &str, f: &dyn Fn() -> bool| {
        let start = std::time::Instant::now();
        while !f() {
            assert!(start.elapsed() < std::time::Duration::from_secs(10), "timed out waiting for {what}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    wait_for("x's bytes dropped", &|| ls_line(&root, &x_id).contains(" no model      demo/x:v1"));
    assert!(ls_line(&root, &y_id).contains(" yes model      demo/y:v1"));

    let e = err(hangar(&root, &["stat", "demo/x:v1"]));
    assert!(e.contains("not on disk") && e.contains(&x_id) && e.contains("--socket"), "{e}");
    let got = ok(hangar(&root, &["get", "demo/x:v1", "--socket", s, "--out", o]));
    assert!(got.contains("from fallback") && got.contains(&x_id), "{got}");
    let reimport = ok(hangar(&root, &["import", out.join("model.safetensors").to_str().unwrap()]));
    assert!(reimport.contains(&x_id), "the bytes fetched again are x's: {reimport}");
    wait_for("x on disk again", &|| ls_line(&root, &x_id).contains(" yes model      demo/x:v1"));
}

/// Issue 27: two daemons on one host without `--node` both take the host
/// name; the registry holds it for the first, and the second stops with an
/// error naming the holder and `--node`. With its own name it starts.
#[test]
fn a_second_daemon_under_the_same_node_name_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (ra, rb) = (dir.path().join("a"), dir.path().join("b"));
    let (_registry, line) = start_store(&ra, &["registry", "--listen", "127.0.0.1:0"]);
    let registry = line.strip_prefix("registry at ").unwrap().to_owned();
    let daemon = |root: &Path| {
        let sock = root.join("d.sock").display().to_string();
        vec!["serve".to_owned(), "--socket".into(), sock, "--listen".into(), "127.0.0.1:0".into()]
            .into_iter()
            .chain(["--registry".into(), registry.clone()])
            .collect::<Vec<String>>()
    };
    let args_a = daemon(&ra);
    let (_a, line) = start_store(&ra, &args_a.iter().map(String::as_str).collect::<Vec<_>>());
    let holder = line.rsplit(' ').next().unwrap().to_owned();
    assert!(holder.starts_with("http://127.0.0.1:"), "{line}");

    let args_b = daemon(&rb);
    let refused = exits(&rb, &args_b.iter().map(String::as_str).collect::<Vec<_>>());
    let e = err(refused);
    assert!(e.contains("is held by another live daemon") && e.contains(&holder), "{e}");
    assert!(e.contains("--node"), "tells the user what to do: {e}");
    assert!(!rb.join("d.sock").exists(), "a refused daemon leaves no socket");

    let mut named = args_b.clone();
    named.extend(["--node".into(), "second".into()]);
    let (_b, line) = start_store(&rb, &named.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(line.starts_with("serving"), "{line}");
}

/// Issue 31: `get --no-resident` has the daemon stream the artifact (or a
/// view) into the command's own memory and keep nothing resident; the
/// file written is the same as a local `get`.
#[test]
fn get_no_resident_writes_the_same_bytes_and_leaves_nothing_resident() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let files = write_files(&dir.path().join("src"), &model(1 << 18, 2, 9), 1).unwrap();
    ok(hangar(&root, &["import", files[0].to_str().unwrap(), "--key", "demo/m:v1"]));
    let socket = dir.path().join("d.sock");
    let s = socket.to_str().unwrap();
    let _serve = start_store(&root, &["serve", "--socket", s]);
    for view in [None, Some("1/2:*.weight=0")] {
        let (daemon, local) = (dir.path().join("daemon"), dir.path().join("local"));
        let mut args =
            vec!["get", "demo/m:v1", "--socket", s, "--no-resident", "--out", daemon.to_str().unwrap()];
        let mut local_args = vec!["get", "demo/m:v1", "--out", local.to_str().unwrap()];
        if let Some(v) = view {
            args.extend(["--view", v]);
            local_args.extend(["--view", v]);
        }
        let got = ok(hangar(&root, &args));
        assert!(got.contains("from local") && got.contains("nothing kept resident"), "{got}");
        ok(hangar(&root, &local_args));
        assert_eq!(
            std::fs::read(daemon.join("model.safetensors")).unwrap(),
            std::fs::read(local.join("model.safetensors")).unwrap(),
            "view {view:?}"
        );
    }
    let status = ok(hangar(&root, &["status", "--socket", s]));
    assert!(status.starts_with("resident 0 of") && status.lines().count() == 1, "{status}");
    let e = err(hangar(&root, &["get", "demo/m:v1", "--no-resident", "--out", "/tmp/x"]));
    assert!(e.contains("--socket"), "{e}");
}

/// Issue 31: `import --strict` refuses an artifact without a serving
/// manifest, naming the rule and the artifact; a present manifest is
/// checked without `--strict` too; `stat` prints what a manifest must say.
#[test]
fn import_strict_and_the_serving_preflight_from_the_command_line() {
    use hangar_store::synth::{manifest_tensor, serving_manifest};
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let tensors = model(1 << 16, 2, 10);
    let plain = write_files(&dir.path().join("plain"), &tensors, 1).unwrap();
    let p = plain[0].to_str().unwrap();
    let e = err(hangar(&root, &["import", p, "--key", "demo/p:v1", "--strict"]));
    assert!(e.contains("rule `manifest_required`") && e.contains("hg1:"), "{e}");
    assert!(ok(hangar(&root, &["ls"])).lines().count() == 1, "nothing imported");
    let imported = ok(hangar(&root, &["import", p, "--key", "demo/p:v1"]));
    let stat = ok(hangar(&root, &["stat", "demo/p:v1"]));
    let manifest = serving_manifest(&tensors);
    let want = format!("schema   {} (4 tensors", manifest["tensor_schema_hash"].as_str().unwrap());
    assert!(stat.contains(&want) && stat.contains("serving  none"), "{stat}");
    assert!(imported.starts_with("imported"), "{imported}");

    let mut good = tensors.clone();
    good.push(manifest_tensor(&serde_json::to_vec(&manifest).unwrap()));
    let good = write_files(&dir.path().join("good"), &good, 1).unwrap();
    ok(hangar(&root, &["import", good[0].to_str().unwrap(), "--key", "demo/s:v1", "--strict"]));
    let stat = ok(hangar(&root, &["stat", "demo/s:v1"]));
    assert!(
        stat.contains("serving  manifest ok (torch, build build-digest)") && stat.contains(&want),
        "{stat}"
    );
    let e = err(hangar(
        &root,
        &["import", good[0].to_str().unwrap(), "--strict", "--manifest-ref", "tensor:elsewhere"],
    ));
    assert!(e.contains("rule `serving_manifest_ref`") && e.contains("tensor:elsewhere"), "{e}");

    let mut bad_manifest = manifest.clone();
    bad_manifest["schema_version"] = serde_json::json!(2);
    let mut bad = tensors;
    bad.push(manifest_tensor(&serde_json::to_vec(&bad_manifest).unwrap()));
    let bad = write_files(&dir.path().join("bad"), &bad, 1).unwrap();
    let e = err(hangar(&root, &["import", bad[0].to_str().unwrap(), "--key", "demo/b:v1"]));
    assert!(e.contains("rule `schema_version`") && e.contains("schema_version is 2, must be 1"), "{e}");
    let e = err(hangar(&root, &["import", p, "--manifest-ref", "x"]));
    assert!(e.contains("--strict"), "{e}");
}

#[test]
fn a_model_directory_is_imported_listed_written_back_and_a_bad_one_refused_by_path() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let src = dir.path().join("tiny-llama");
    ok(hangar(&root, &["synth-model-dir", src.to_str().unwrap(), "--hidden", "64", "--layers", "2"]));
    let imported = ok(hangar(&root, &["import", src.to_str().unwrap(), "--key", "tiny/llama:v1"]));
    assert!(
        imported.starts_with("imported hg1:") && imported.contains("model directory: 7 files"),
        "{imported}"
    );
    let id = imported.split_whitespace().nth(1).unwrap().to_owned();
    let again = ok(hangar(&root, &["import", src.to_str().unwrap()]));
    assert!(again.starts_with(&format!("existed {id}")), "{again}");
    assert!(ls_line(&root, &id).ends_with(" yes model-dir  tiny/llama:v1"), "{}", ls_line(&root, &id));

    let out = dir.path().join("out");
    ok(hangar(&root, &["get", "tiny/llama:v1", "--out", out.to_str().unwrap()]));
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        let back = std::fs::read(out.join(entry.file_name())).unwrap();
        assert!(back == std::fs::read(entry.path()).unwrap(), "{:?} byte for byte", entry.file_name());
    }

    let shard = src.join("model-00001-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 1]).unwrap();
    let e = err(hangar(&root, &["import", src.to_str().unwrap(), "--key", "tiny/llama:v2"]));
    assert!(e.contains(shard.to_str().unwrap()) && e.contains("truncated?"), "{e}");
    let e = err(hangar(&root, &["import", src.to_str().unwrap(), "--strict"]));
    assert!(e.contains("--strict applies to files"), "{e}");
    std::fs::remove_file(src.join("config.json")).unwrap();
    let e = err(hangar(&root, &["import", src.to_str().unwrap()]));
    assert!(e.contains(&format!("{} has no config.json", src.display())), "{e}");
}
