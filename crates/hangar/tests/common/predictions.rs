//! Calls on the predictions API, for the tests that use it.

use std::time::{Duration, Instant};

use serde_json::Value;

/// A blocking client with a generous timeout.
pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(90)).build().unwrap()
}

/// Posts JSON with extra headers; the status and the JSON answer (null
/// if it is not JSON).
pub fn post(url: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
    let mut r = client().post(url).json(body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

/// Gets JSON.
pub fn get(url: &str) -> Value {
    client().get(url).send().unwrap().json().unwrap()
}

/// Gets `url`, with a bearer `key` if given: the status and the JSON
/// answer (null if it is not JSON).
pub fn get_as(url: &str, key: Option<&str>) -> (u16, Value) {
    let mut r = client().get(url);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

/// Polls a prediction until it is terminal.
pub fn wait_terminal(url: &str) -> Value {
    let t = Instant::now();
    loop {
        let p = get(url);
        if !matches!(p["status"].as_str(), Some("starting" | "processing")) {
            return p;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "never ended: {p}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Reads a prediction's whole SSE stream at `url`: its `(event, data)`
/// pairs, checking that every event has an `id:`.
pub fn sse_events(url: &str) -> Vec<(String, String)> {
    let body = client().get(url).header("accept", "text/event-stream").send().unwrap().text().unwrap();
    body.split("\n\n")
        .filter(|e| e.contains("event:"))
        .map(|e| {
            let field =
                |name: &str| e.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim_start().to_owned());
            assert!(field("id:").is_some(), "every event has an id: {e:?}");
            (field("event:").unwrap(), field("data:").unwrap_or_default())
        })
        .collect()
}
