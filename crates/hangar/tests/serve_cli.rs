//! `hangar serve` end to end: real gateway, real engine processes.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{chat, one_gpu, post, serve};
use serde_json::{json, Value};

const CONFIG: &str = r#"
timeout_floor_s = 1
max_body_bytes = "64KiB"

[[nodes]]
id = "local"
gpus = 2
gpu_memory = "80GB"
virtual_gpus = true

[[models]]
key = "t/ready"
engine = { kind = "mock", preset = "fast" }
size = "10GB"
min_replicas = 1
router = "round-robin"

[[models]]
key = "t/cold"
engine = { kind = "mock", preset = "fast", startup_delay_ms = 200 }
size = "10GB"

[[models]]
key = "t/narrow"
engine = { kind = "mock", preset = "default" }
size = "10GB"
min_replicas = 1
concurrency = 1
queue = { algorithm = "fifo", capacity = 1 }
timeout_s = 1

[[models]]
key = "t/slow-start"
engine = { kind = "mock", preset = "fast", startup_delay_ms = 3000 }
size = "10GB"
"#;

#[test]
fn serves_ready_and_cold_models_and_names_bad_requests() {
    let s = serve(CONFIG);
    let (status, r) = post(&s.url, None, &chat("t/ready", 5));
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["completion_tokens"], 5);
    let (status, r) = post(&s.url, None, &chat("t/cold", 3));
    assert_eq!(status, 200, "a cold model starts on its first request: {r}");
    let models: Value = reqwest::blocking::get(format!("{}/v1/models", s.url)).unwrap().json().unwrap();
    assert_eq!(models["data"].as_array().unwrap().len(), 4);
    let (status, r) = post(&s.url, None, &chat("t/unknown", 1));
    assert_eq!((status, r["error"]["param"].as_str()), (404, Some("model")));
    let (status, r) = post(&s.url, None, &json!({"messages": []}));
    assert_eq!(status, 400);
    assert!(r["error"]["message"].as_str().unwrap().contains("`model`"));
    let raw = reqwest::blocking::Client::new()
        .post(format!("{}/v1/chat/completions", s.url))
        .body("{oops")
        .send()
        .unwrap();
    assert_eq!(raw.status(), 400);
    let mut wrong = chat("t/ready", 1);
    wrong["max_tokens"] = json!("many");
    let (status, r) = post(&s.url, None, &wrong);
    assert_eq!(status, 400, "{r}");
    assert!(r["error"]["message"].as_str().unwrap().contains("max_tokens"), "the field is named: {r}");
    // Output tokens are bounded as a prediction's are, by the gateway.
    for field in ["max_tokens", "max_completion_tokens"] {
        let mut many = chat("t/ready", 1);
        many[field] = json!(hangar_core::MAX_OUTPUT_TOKENS + 1);
        let (status, r) = post(&s.url, None, &many);
        assert_eq!((status, r["error"]["param"].as_str()), (400, Some(field)), "{r}");
        let message = r["error"]["message"].as_str().unwrap();
        assert!(message.contains(&hangar_core::MAX_OUTPUT_TOKENS.to_string()), "the bound is named: {r}");
    }
    let mut big = chat("t/ready", 1);
    big["messages"][0]["content"] = json!("x".repeat(100_000));
    let (status, r) = post(&s.url, None, &big);
    assert_eq!(status, 413, "{r}");
}

/// A proxy in the environment is for the outside world: the server
/// reaches its engines directly (before, their readiness checks went to
/// the proxy and the server never answered).
#[test]
fn a_proxy_in_the_environment_does_not_stand_between_the_server_and_its_engines() {
    let s = common::serve_in_env(tempfile::tempdir().unwrap(), CONFIG, &[], &common::DEAD_PROXY);
    let (status, r) = post(&s.url, None, &chat("t/ready", 3));
    assert_eq!(status, 200, "{r}");
    let (status, r) = post(&s.url, None, &chat("t/cold", 2));
    assert_eq!(status, 200, "a cold start through the same clients: {r}");
}

/// Replica ids come from the controller's seeded rng; `hangar serve` mixes
/// a per-process value into the file's `seed`, so a second run of the same
/// file names its replicas apart from the first run's (logs, metrics and
/// Redis keys name replicas by id). `hangar sim` keeps the seed as is.
#[test]
fn two_runs_of_one_file_give_their_replicas_different_ids() {
    let config = one_gpu(
        "[[models]]\nkey = \"t/m\"\nengine = { kind = \"mock\", preset = \"instant\" }\nsize = \"10GB\"\n\
         min_replicas = 2\n",
    );
    let run = || -> std::collections::BTreeSet<String> {
        let s = serve(&config);
        common::ready_replicas(&s.url, 2).iter().map(|r| r["id"].as_str().unwrap().to_owned()).collect()
    };
    let (first, second) = (run(), run());
    assert_eq!((first.len(), second.len()), (2, 2));
    assert!(first.is_disjoint(&second), "a restart reused replica ids: {first:?} then {second:?}");
}

#[test]
fn a_busy_model_answers_429_when_its_line_is_full_and_504_past_its_timeout() {
    let s = serve(CONFIG);
    let url = s.url.clone();
    // One long request holds the only permit (about 6 ms per token) until
    // the model's 1 s timeout ends it.
    let holder = std::thread::spawn(move || post(&url, None, &chat("t/narrow", 2000)));
    std::thread::sleep(Duration::from_millis(300));
    let url = s.url.clone();
    let waiter = std::thread::spawn(move || post(&url, None, &chat("t/narrow", 1)));
    std::thread::sleep(Duration::from_millis(200));
    let r = reqwest::blocking::Client::new()
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&chat("t/narrow", 1))
        .send()
        .unwrap();
    assert_eq!(r.status(), 429, "the line of one is full");
    assert_eq!(r.headers()["retry-after"], "1");
    let (status, r) = holder.join().unwrap();
    assert_eq!(status, 504, "the holder ran past the model's 1 s timeout: {r}");
    assert!(
        r["error"]["message"].as_str().unwrap().contains("did not finish within its timeout (1 s)"),
        "{r}"
    );
    let (status, r) = waiter.join().unwrap();
    assert_eq!(status, 200, "the waiter ran once the holder was cut off: {r}");
    // A replica that takes longer to start than the timeout: 504 waiting.
    let (status, r) = post(&s.url, None, &chat("t/slow-start", 1));
    assert_eq!(status, 504, "{r}");
    assert!(r["error"]["message"].as_str().unwrap().contains("no replica became free"), "{r}");
}

#[test]
fn a_malformed_config_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    let model =
        "[[nodes]]\nid = \"n\"\ngpus = 2\ngpu_memory = \"80GB\"\n[[models]]\nengine = { kind = \"mock\" }\n";
    for (extra, says) in [
        ("key = \"bad key\"", "model key `bad key`"),
        ("key = \"m\"\ntimeout_s = -5", "line 8"),
        // Values the types accept but that could never run: file, line, field.
        (
            "key = \"m\"\nsize = \"500GB\"",
            "bad.toml:8: models[0].size: model `m` fits on no node: the model (500.0GB) needs 7 GPUs; the largest node has 2",
        ),
        ("key = \"m\"\nsize = \"1GB\"\ntimeout_s = 18446744073709551615", "bad.toml:9: models[0].timeout_s"),
        ("key = \"m\"\nsize = \"60GB\"\nmin_replicas = 3", "bad.toml:9: models[0].min_replicas"),
    ] {
        std::fs::write(&path, format!("{model}{extra}\n")).unwrap();
        let err = refused(&path);
        assert!(err.contains("bad.toml") && err.contains(says), "{err}");
    }
}

/// What `hangar serve` prints refusing the config at `path` (exit 1).
fn refused(path: &std::path::Path) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["serve", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A TOML syntax error — several lines, the offending one quoted — is
/// printed once, not again as its own cause.
#[test]
fn a_toml_syntax_error_is_printed_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "[[models]]\nkey = \"t/x\"\nsize = \n").unwrap();
    let err = refused(&path);
    assert!(err.starts_with("error: invalid configuration ") && err.contains("bad.toml"), "{err}");
    assert_eq!(err.matches("TOML parse error at line 3").count(), 1, "{err}");
    assert_eq!(err.matches("size = ").count(), 1, "{err}");
}

/// Logs that go to a file, a pipe or a pod's log are plain text: no ANSI
/// colour codes unless stderr is a terminal.
#[test]
fn logs_carry_no_colour_codes_off_a_terminal() {
    let s = serve(&one_gpu(
        "[[models]]\nkey = \"t/m\"\nengine = { kind = \"mock\", preset = \"instant\" }\nsize = \"10GB\"\n\
         min_replicas = 1\n",
    ));
    assert_eq!(post(&s.url, None, &chat("t/m", 1)).0, 200);
    let log = s.log();
    assert!(log.contains("INFO") && log.contains("replica ready"), "{log}");
    assert!(!log.contains('\u{1b}'), "ANSI escapes in a log written to a file:\n{log:?}");
}

/// A malformed `redis` URL is refused at load (file, line, field), by
/// `--redis` too; a Redis that does not answer stops serve at once,
/// naming the URL, before it listens.
#[test]
fn a_bad_or_unreachable_redis_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.toml");
    let rest = "[[models]]\nkey = \"m\"\nengine = { kind = \"mock\", preset = \"fast\" }\nsize = \"1GB\"\n";
    let gone = format!("unix://{}/no-redis.sock", dir.path().display());
    for (redis, flag, says) in [
        ("http://cache:6379", None, "fleet.toml:1: redis: `http://cache:6379` is not a Redis URL".to_owned()),
        ("redis://127.0.0.1:1/0", Some("ftp://x"), "--redis: `ftp://x` is not a Redis URL".to_owned()),
        (gone.as_str(), None, format!("cannot reach redis at {gone}")),
    ] {
        std::fs::write(&path, format!("redis = \"{redis}\"\n{}", one_gpu(rest))).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hangar"));
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--config", path.to_str().unwrap()]);
        if let Some(flag) = flag {
            cmd.args(["--redis", flag]);
        }
        let o = cmd.output().unwrap();
        assert_eq!(o.status.code(), Some(1));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(&says), "{err}");
        assert!(o.stdout.is_empty(), "it never listened: {}", String::from_utf8_lossy(&o.stdout));
    }
}

#[test]
fn a_mock_engine_file_that_cannot_be_read_names_the_model_and_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("serve.toml");
    std::fs::write(
        &path,
        "[[nodes]]\nid = \"n\"\ngpus = 1\ngpu_memory = \"80GB\"\n[[models]]\nkey = \"m\"\nsize = \"1GB\"\n\
         engine = { kind = \"mock\", engine_config = \"engines/missing.toml\" }\n",
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("model m") && err.contains("engines/missing.toml"), "{err}");
}

#[test]
fn api_keys_authenticate_and_access_lists_authorize() {
    let s = serve(&one_gpu(
        r#"
[[api_keys]]
key = "sk-acme"
account = "acme"

[[api_keys]]
key = "sk-other"
account = "other"

[[models]]
key = "t/private"
engine = { kind = "mock", preset = "fast" }
size = "10GB"
min_replicas = 1
access = ["acme"]
"#,
    ));
    let client = reqwest::blocking::Client::new();
    let send = |key: Option<&str>| {
        let mut r = client.post(format!("{}/v1/chat/completions", s.url)).json(&chat("t/private", 2));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        let r = r.send().unwrap();
        let status = r.status().as_u16();
        (status, r.json::<Value>().unwrap_or(Value::Null))
    };
    assert_eq!(send(Some("sk-acme")).0, 200);
    let (status, r) = send(None);
    assert_eq!(status, 401, "{r}");
    assert!(r["error"]["message"].as_str().unwrap().contains("missing API key"));
    assert_eq!(send(Some("sk-wrong")).0, 401);
    // To another account the private model does not exist: the same 404,
    // body for body, as a model that is not there.
    let (status, r) = send(Some("sk-other"));
    assert_eq!(status, 404, "{r}");
    let unknown = client
        .post(format!("{}/v1/chat/completions", s.url))
        .bearer_auth("sk-other")
        .json(&chat("t/nowhere", 2))
        .send()
        .unwrap()
        .json::<Value>()
        .unwrap();
    assert_eq!(r.to_string().replace("t/private", "t/nowhere"), unknown.to_string());
    // The OpenAI SDK's models.retrieve: the key as one encoded segment.
    let retrieve =
        |key: &str| client.get(format!("{}/v1/models/t%2Fprivate", s.url)).bearer_auth(key).send().unwrap();
    let mine = retrieve("sk-acme");
    assert_eq!(mine.status(), 200);
    assert_eq!(
        mine.json::<Value>().unwrap(),
        json!({"id": "t/private", "object": "model", "created": 0, "owned_by": "hangar"})
    );
    assert_eq!(retrieve("sk-other").status(), 404);
    let listed: Value =
        client.get(format!("{}/v1/models", s.url)).bearer_auth("sk-other").send().unwrap().json().unwrap();
    assert_eq!(listed["data"].as_array().unwrap().len(), 0, "models an account may not use are not listed");
}

/// `--keys-file`: the API and metrics keys from a file of their own (a
/// Kubernetes Secret), not the configuration.
#[test]
fn keys_from_a_keys_file_authenticate() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    std::fs::write(&keys, "metrics_key = \"scrape\"\n[[api_keys]]\nkey = \"sk-acme\"\naccount = \"acme\"\n")
        .unwrap();
    let config = one_gpu(
        "[[models]]\nkey = \"t/m\"\nengine = { kind = \"mock\", preset = \"instant\" }\nsize = \"10GB\"\n\
         min_replicas = 1\n",
    );
    let s = common::serve_in_with(dir, &config, &["--keys-file", keys.to_str().unwrap()]);
    let (status, _) = post(&s.url, None, &chat("t/m", 1));
    assert_eq!(status, 401, "no key");
    let (status, r) = post(&s.url, Some("sk-acme"), &chat("t/m", 1));
    assert_eq!(status, 200, "{r}");
    let metrics = |key: Option<&str>| {
        let mut r = reqwest::blocking::Client::new().get(format!("{}/metrics", s.url));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send().unwrap().status().as_u16()
    };
    assert_eq!((metrics(None), metrics(Some("scrape"))), (401, 200));
    // Keys in the configuration as well: refused at start, naming both.
    let other = tempfile::tempdir().unwrap();
    let both = other.path().join("serve.toml");
    std::fs::write(&both, format!("metrics_key = \"x\"\n{config}")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["serve", "--keys-file", keys.to_str().unwrap(), "--config", both.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("sets metrics_key") && err.contains("keys.toml"), "{err}");
}

#[test]
fn a_second_server_on_the_same_data_dir_exits_at_once_naming_it_and_the_holder() {
    let data = tempfile::tempdir().unwrap();
    let config = format!(
        "data_dir = \"{}\"\n{}",
        data.path().display(),
        one_gpu("[[models]]\nkey = \"m\"\nengine = { kind = \"mock\", preset = \"fast\" }\nsize = \"1GB\"\n")
    );
    let first = serve(&config);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("second.toml");
    std::fs::write(&path, &config).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    let pid = std::fs::read_to_string(data.path().join("lock")).unwrap();
    assert!(
        err.contains(&data.path().display().to_string()) && err.contains(&format!("PID {}", pid.trim())),
        "{err}"
    );
    // The first one is untouched and still answers.
    assert_eq!(post(&first.url, None, &chat("m", 1)).0, 200);
    // Once it is gone (killed outright: the kernel drops its lock), the
    // directory is free again.
    drop(first.kill9());
    let again = serve(&config);
    assert_eq!(post(&again.url, None, &chat("m", 1)).0, 200);
}
