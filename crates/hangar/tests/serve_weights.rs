//! The weight store on the serving path: a model's `weights` materialized
//! by the store before each replica's engine starts, handed to the engine
//! as a path it opens, each start reported phase by phase; and the errors a
//! bad `weights` gets.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{chat, one_gpu, post, serve_in};
use serde_json::Value;

/// Writes a stand-in weights file (not safetensors, so the store keeps it
/// whole, as it keeps a GGUF) and returns its BLAKE3.
fn weights_file(path: &Path, len: usize) -> String {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let bytes: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
    std::fs::write(path, &bytes).unwrap();
    blake3::hash(&bytes).to_hex().to_string()
}

fn hangar(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_hangar")).args(args).output().unwrap()
}

/// A configuration with the weight store under the test's directory and
/// one GPU for `models`.
fn with_store(models: &str) -> String {
    format!("[store]\nroot = \"store\"\n{}", one_gpu(models))
}

/// A test directory whose store (`store` in it) holds a stand-in weights
/// file of `len` bytes as `tiny:v1`: the directory, the store's root and
/// the bytes' BLAKE3.
fn store_with_tiny(len: usize) -> (tempfile::TempDir, PathBuf, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("src/tiny.Q4.gguf");
    let hash = weights_file(&file, len);
    let store = dir.path().join("store");
    let o = hangar(&[
        "store",
        "--root",
        store.to_str().unwrap(),
        "import",
        file.to_str().unwrap(),
        "--key",
        "tiny:v1",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (dir, store, hash)
}

/// `hangar serve` in `dir` with `min` replicas of `t/w` on `store:tiny:v1`.
fn serve_tiny(dir: tempfile::TempDir, min: u32) -> common::Serve {
    let model = format!(
        r#"
[[models]]
key = "t/w"
engine = {{ kind = "mock", preset = "instant" }}
size = "10GB"
min_replicas = {min}
weights = "store:tiny:v1"
"#
    );
    serve_in(dir, &with_store(&model))
}

/// What the replica's engine says it read at start.
fn engine_weights(replica: &Value) -> Value {
    let url = replica["url"].as_str().unwrap();
    let models: Value = reqwest::blocking::get(format!("{url}/v1/models")).unwrap().json().unwrap();
    models["data"][0]["weights"].clone()
}

#[test]
fn replicas_load_their_weights_from_the_store_and_the_second_leases_the_first_ones_memory() {
    let (dir, _, hash) = store_with_tiny((3 << 20) + 5);
    let s = serve_tiny(dir, 2);
    let replicas = common::ready_replicas(&s.url, 2);
    let mut sources: Vec<&str> = Vec::new();
    for r in &replicas {
        let read = engine_weights(r);
        assert_eq!(read["blake3"], hash.as_str(), "the engine read other bytes: {read}");
        assert_eq!(read["bytes"], (3 << 20) + 5);
        assert!(read["path"].as_str().unwrap().starts_with("/proc/self/fd/"), "{read}");
        let start = &r["start"];
        assert_eq!(start["weights"]["bytes"], (3 << 20) + 5, "{start}");
        assert!(start["weights"]["artifact"].as_str().unwrap().starts_with("hg1:"), "{start}");
        assert!(start["ready_ms"].as_u64().unwrap() >= start["engine_ms"].as_u64().unwrap(), "{start}");
        sources.push(start["weights"]["source"].as_str().unwrap());
    }
    sources.sort();
    // The first start loads the blob; the second finds it resident.
    assert_eq!(sources, ["local", "resident"], "{replicas:?}");
    let (status, body) = post(&s.url, None, &chat("t/w", 2));
    assert_eq!(status, 200, "{body}");
    assert!(s.log().contains("replica ready: placed → weights"), "{}", s.log());
}

#[test]
fn a_weights_file_is_imported_into_the_store_on_first_use() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("weights/model.gguf");
    let hash = weights_file(&file, 100_000);
    let s = serve_in(
        dir,
        &with_store(
            r#"
[[models]]
key = "t/file"
engine = { kind = "mock", preset = "instant" }
size = "10GB"
min_replicas = 1
weights = "weights/model.gguf"
"#,
        ),
    );
    let replicas = common::ready_replicas(&s.url, 1);
    assert_eq!(engine_weights(&replicas[0])["blake3"], hash.as_str());
    assert_eq!(replicas[0]["start"]["weights"]["source"], "local", "{replicas:?}");
    assert!(s.log().contains("weights file imported into the store"), "{}", s.log());
}

#[test]
fn bad_weights_name_the_model_and_the_key_or_path_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("serve.toml");
    let with_store = |store: &str, weights: &str, engine: &str| {
        format!(
            "[store]\n{store}\n[[nodes]]\nid = \"n\"\ngpus = 1\ngpu_memory = \"80GB\"\n\
             [[models]]\nkey = \"t/bad\"\nsize = \"1GB\"\nweights = \"{weights}\"\nengine = {engine}\n"
        )
    };
    let model = |weights: &str, engine: &str| with_store("root = \"store\"", weights, engine);
    let mock = "{ kind = \"mock\" }";
    for (config, says) in [
        (model("store:nope:v1", mock), vec!["model t/bad", "store:nope:v1", "no such key"]),
        (model("missing/model.gguf", mock), vec!["model t/bad", "missing/model.gguf"]),
        (
            with_store("socket = \"/proc/self/no/store.sock\"", "store:x:v1", mock),
            vec!["model t/bad", "/proc/self/no/store.sock", "not reachable"],
        ),
        (
            model("store:x:v1", "{ kind = \"openai\", command = \"llama-server --port {port}\" }"),
            vec!["serve.toml:", "models[0].weights", "{weights}"],
        ),
    ] {
        std::fs::write(&path, config).unwrap();
        let o = hangar(&["serve", "--listen", "127.0.0.1:0", "--config", path.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1));
        let err = String::from_utf8_lossy(&o.stderr);
        for s in says {
            assert!(err.contains(s), "want `{s}` in: {err}");
        }
    }
}

#[test]
fn a_key_removed_while_serving_fails_the_replica_start_by_name_and_the_request_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("src/gone.gguf");
    weights_file(&file, 4096);
    let store = dir.path().join("store");
    let root = store.to_str().unwrap();
    let o = hangar(&["store", "--root", root, "import", file.to_str().unwrap(), "--key", "gone:v1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = serve_in(
        dir,
        &format!(
            "timeout_floor_s = 3\n[store]\nroot = \"store\"\n{}",
            one_gpu(
                r#"
[[models]]
key = "t/gone"
engine = { kind = "mock", preset = "instant" }
size = "10GB"
weights = "store:gone:v1"
"#
            )
        ),
    );
    let o = hangar(&["store", "--root", root, "rm", "gone:v1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let started = Instant::now();
    let (status, body) = post(&s.url, None, &chat("t/gone", 2));
    assert!(status >= 500, "{status}: {body}");
    assert!(started.elapsed() < Duration::from_secs(10), "the request hung");
    let log = s.log();
    assert!(log.contains("did not start: model t/gone: weights `store:gone:v1`"), "{log}");
}

/// The files of a directory, name → BLAKE3 hex, as the mock engine
/// reports what it read.
fn hashes(dir: &Path) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| {
            let hash = blake3::hash(&std::fs::read(e.path()).unwrap()).to_hex().to_string();
            (e.file_name().into_string().unwrap(), hash)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn a_model_directory_from_the_store_is_one_read_only_directory_every_replica_loads() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src/tiny-llama");
    let store = dir.path().join("store");
    let root = store.to_str().unwrap();
    let o = hangar(&["store", "synth-model-dir", src.to_str().unwrap(), "--hidden", "64", "--layers", "2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = hangar(&["store", "--root", root, "import", src.to_str().unwrap(), "--key", "tiny/llama:v1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(said.contains("model directory: 7 files"), "{said}");
    let o = hangar(&["store", "--root", root, "ls"]);
    let ls = String::from_utf8_lossy(&o.stdout);
    assert!(ls.lines().any(|l| l.contains("model-dir") && l.contains("tiny/llama:v1")), "{ls}");

    let s = serve_in(
        dir,
        &with_store(
            r#"
[[models]]
key = "t/llama"
engine = { kind = "mock", preset = "instant" }
size = "10GB"
min_replicas = 2
weights = "store:tiny/llama:v1"
"#,
        ),
    );
    let replicas = common::ready_replicas(&s.url, 2);
    let want = hashes(&src);
    let mut paths = Vec::new();
    let mut sources = Vec::new();
    for r in &replicas {
        let read = engine_weights(r);
        let got: Vec<(String, String)> = read["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| (f["name"].as_str().unwrap().to_owned(), f["blake3"].as_str().unwrap().to_owned()))
            .collect();
        assert_eq!(got, want, "the engine read every file as it was imported: {read}");
        assert_eq!(read["model_type"], "llama", "{read}");
        let shard = read["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["name"] == "model-00001-of-00002.safetensors");
        assert!(shard.unwrap()["tensors"].as_u64().unwrap() > 0, "{read}");
        paths.push(read["path"].as_str().unwrap().to_owned());
        sources.push(r["start"]["weights"]["source"].as_str().unwrap().to_owned());
    }
    assert_eq!(paths[0], paths[1], "one directory for both replicas");
    let path = Path::new(&paths[0]);
    assert!(path.starts_with(store.join("model-dirs")), "{}", path.display());
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(path).unwrap().permissions().mode() & 0o777, 0o555, "read-only");
    sources.sort();
    assert_eq!(sources, ["local", "resident"], "{replicas:?}");
    let (status, body) = post(&s.url, None, &chat("t/llama", 2));
    assert_eq!(status, 200, "{body}");
    assert!(s.log().contains("model directory materialized"), "{}", s.log());
}

#[test]
fn a_mock_engine_handed_a_malformed_shard_fails_its_start_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("m");
    let o = hangar(&["store", "synth-model-dir", src.to_str().unwrap(), "--hidden", "64", "--layers", "1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let shard = src.join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 10]).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["engine", "mock", "--port", "0", "--weights", src.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A guard against a start that does not fail, not a speed target.
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(1), "the start fails");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(shard.to_str().unwrap()) && err.contains("not a valid safetensors file"), "{err}");
    assert!(o.stdout.is_empty(), "it never listened: {}", String::from_utf8_lossy(&o.stdout));
}

/// The store daemon run apart (`hangar store serve`) dies while serving:
/// the next replica start finds its socket dead and runs the store in the
/// server's own process, rather than failing every start until an
/// operator restarts the daemon.
#[test]
fn a_replica_starts_after_the_store_daemon_run_apart_died() {
    let (dir, store, hash) = store_with_tiny(100_000);
    let (mut daemon, line) = common::start_store(&store, &["serve"]);
    assert!(line.starts_with("serving "), "{line}");
    let s = serve_tiny(dir, 1);
    let first = common::ready_replicas(&s.url, 1);
    assert!(
        !s.log().contains("weight store daemon started"),
        "the daemon run apart was not used: {}",
        s.log()
    );

    daemon.0.kill().unwrap();
    daemon.0.wait().unwrap();
    let pid = first[0]["pid"].as_i64().unwrap_or_else(|| panic!("{first:?}"));
    let engine = rustix::process::Pid::from_raw(pid as i32).unwrap();
    rustix::process::kill_process(engine, rustix::process::Signal::KILL).unwrap();
    let start = Instant::now();
    let again = loop {
        let status: Value =
            reqwest::blocking::get(format!("{}/admin/status", s.url)).unwrap().json().unwrap();
        let now = &status["models"][0]["replicas"][0];
        if now["state"] == "ready" && now["pid"] != first[0]["pid"] {
            break now.clone();
        }
        assert!(start.elapsed() < Duration::from_secs(20), "no replica started again: {status}\n{}", s.log());
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(engine_weights(&again)["blake3"], hash.as_str());
    assert!(s.log().contains("the weight store daemon does not answer"), "{}", s.log());
    let (status, body) = post(&s.url, None, &chat("t/w", 2));
    assert_eq!(status, 200, "{body}");
}
