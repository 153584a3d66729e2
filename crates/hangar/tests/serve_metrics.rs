//! What the server counts and how it names things, seen from outside:
//! answers carry the model asked for, not the engine's name for it;
//! streams cut by their deadline or their replica are counted as such;
//! predictions are counted like requests; every process's `/metrics`
//! passes Debian's `promtool check metrics`; and the Grafana dashboard
//! queries only series a running server has (docs/observability.md).

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::predictions::{client, post as post_json};
use common::{chat, one_gpu, promtool, serve, PREDICTIONS_CONFIG};
use serde_json::{json, Value};

/// The name the test engine gives its model, as llama.cpp's server does
/// for weights handed over by the store.
const ENGINE_NAME: &str = "/proc/self/fd/30";

/// An OpenAI-compatible engine answering one request per connection, as
/// the last word of its prompt says: `json` a whole completion, `sse` a
/// stream (its first event cut in two writes), `stall` a stream that stops
/// after one event for longer than the request's timeout, `break` a stream
/// whose connection drops after one event. Every answer names the model
/// [`ENGINE_NAME`].
fn engine() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || answer(stream));
        }
    });
    url
}

fn answer(stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let Some((line, body)) = common::read_request(&mut reader) else { return };
    let body = String::from_utf8_lossy(&body);
    let mut w = stream;
    let whole = |w: &mut TcpStream, status: u16, text: &str| {
        let head = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            text.len()
        );
        let _ = w.write_all(head.as_bytes()).and_then(|()| w.write_all(text.as_bytes()));
    };
    if line.starts_with("GET /health ") {
        return whole(&mut w, 200, "{}");
    }
    if !line.starts_with("POST /v1/chat/completions ") {
        return whole(&mut w, 404, r#"{"error":"no such endpoint"}"#);
    }
    let event = |i: u32| {
        format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"{ENGINE_NAME}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n"
        )
    };
    let chunk = |w: &mut TcpStream, data: &str| {
        let _ = write!(w, "{:x}\r\n{data}\r\n", data.len());
        let _ = w.flush();
    };
    let stream_head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    if body.contains("say json") {
        let completion = json!({
            "id": "c", "object": "chat.completion", "model": ENGINE_NAME,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        });
        return whole(&mut w, 200, &completion.to_string());
    }
    let _ = w.write_all(stream_head.as_bytes());
    let first = event(0);
    if body.contains("say sse") {
        // The first event in two writes: a frame may end mid-line.
        let (a, b) = first.split_at(30);
        chunk(&mut w, a);
        std::thread::sleep(Duration::from_millis(50));
        chunk(&mut w, b);
        chunk(&mut w, &event(1));
        chunk(&mut w, "data: [DONE]\n\n");
        let _ = w.write_all(b"0\r\n\r\n");
    } else if body.contains("say stall") {
        chunk(&mut w, &first);
        std::thread::sleep(Duration::from_secs(4));
    } else if body.contains("say break") {
        chunk(&mut w, &first);
        // Dropped here: the connection closes mid-stream.
    }
}

fn ask(url: &str, say: &str, stream: bool) -> reqwest::blocking::Response {
    let body = json!({
        "model": "t/x", "stream": stream, "max_tokens": 4,
        "messages": [{"role": "user", "content": format!("say {say}")}],
    });
    client().post(format!("{url}/v1/chat/completions")).json(&body).send().unwrap()
}

/// `GET /metrics` in the text format (what a scraper that does not ask
/// for OpenMetrics gets).
fn metrics(url: &str) -> String {
    reqwest::blocking::get(format!("{url}/metrics")).unwrap().text().unwrap()
}

/// Waits (a minute at most) until `/metrics` has every line in `want`.
fn wait_metrics(url: &str, want: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = metrics(url);
        let missing: Vec<&&str> = want.iter().filter(|w| !m.lines().any(|l| l == **w)).collect();
        if missing.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "missing {missing:?} in\n{m}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn answers_name_the_model_asked_for_and_cut_streams_count_as_what_they_are() {
    let engine = engine();
    let s = serve(&format!(
        "timeout_floor_s = 1\n{}",
        one_gpu(&format!(
            r#"
[[models]]
key = "t/x"
engine = {{ kind = "external", url = "{engine}" }}
size = "10GB"
min_replicas = 1
timeout_s = 1
"#
        ))
    ));

    let whole = ask(&s.url, "json", false);
    assert_eq!(whole.status(), 200);
    let whole: Value = whole.json().unwrap();
    assert_eq!(whole["model"], "t/x", "{whole}");

    let streamed = ask(&s.url, "sse", true).text().unwrap();
    let events: Vec<Value> = streamed
        .lines()
        .filter_map(|l| l.strip_prefix("data: {").map(|j| serde_json::from_str(&format!("{{{j}")).unwrap()))
        .collect();
    assert_eq!(events.len(), 2, "{streamed}");
    assert!(events.iter().all(|e| e["model"] == "t/x"), "{streamed}");
    assert!(streamed.ends_with("data: [DONE]\n\n"), "{streamed}");

    let stalled = ask(&s.url, "stall", true);
    assert_eq!(stalled.status(), 200, "the head was sent before the stall");
    let stalled = stalled.text().unwrap();
    assert!(stalled.contains("did not finish within the request's timeout"), "{stalled}");

    let broken = ask(&s.url, "break", true).text().unwrap();
    assert!(broken.contains("the replica failed while answering"), "{broken}");

    wait_metrics(
        &s.url,
        &[
            "hangar_requests_total{model=\"t/x\",kind=\"sync\",status=\"200\"} 2",
            "hangar_requests_total{model=\"t/x\",kind=\"sync\",status=\"504\"} 1",
            "hangar_requests_total{model=\"t/x\",kind=\"sync\",status=\"502\"} 1",
            "hangar_errors_total{model=\"t/x\",kind=\"sync\",code=\"timeout\"} 1",
            "hangar_errors_total{model=\"t/x\",kind=\"sync\",code=\"replica_failed\"} 1",
            "hangar_request_duration_seconds_count{model=\"t/x\",kind=\"sync\"} 4",
        ],
    );
}

#[test]
fn predictions_are_counted_like_requests() {
    let s = serve(PREDICTIONS_CONFIG);
    for _ in 0..2 {
        let (status, p) = post_json(
            &format!("{}/v1/models/t/fast/predictions", s.url),
            &json!({"input": {"prompt": "Hello", "max_tokens": 3}}),
            &[("prefer", "wait=60")],
        );
        assert_eq!((status, p["status"].as_str()), (201, Some("succeeded")), "{p}");
    }
    // A long one on the slow model, canceled by its user.
    let (status, p) = post_json(
        &format!("{}/v1/models/t/slow/predictions", s.url),
        &json!({"input": {"prompt": "Hello", "max_tokens": 100000}}),
        &[],
    );
    assert_eq!(status, 201, "{p}");
    let (status, p) = post_json(p["urls"]["cancel"].as_str().unwrap(), &json!({}), &[]);
    assert_eq!((status, p["status"].as_str()), (200, Some("canceled")), "{p}");
    // And a synchronous request beside them.
    assert_eq!(common::post(&s.url, None, &chat("t/fast", 2)).0, 200);

    wait_metrics(
        &s.url,
        &[
            "hangar_requests_total{model=\"t/fast\",kind=\"prediction\",status=\"200\"} 2",
            "hangar_queue_wait_seconds_count{model=\"t/fast\",kind=\"prediction\"} 2",
            "hangar_request_duration_seconds_count{model=\"t/fast\",kind=\"prediction\"} 2",
            "hangar_time_to_first_token_seconds_count{model=\"t/fast\",kind=\"prediction\"} 2",
            "hangar_requests_total{model=\"t/slow\",kind=\"prediction\",status=\"499\"} 1",
            "hangar_errors_total{model=\"t/slow\",kind=\"prediction\",code=\"canceled\"} 1",
            "hangar_requests_total{model=\"t/fast\",kind=\"sync\",status=\"200\"} 1",
            "hangar_queue_wait_seconds_count{model=\"t/fast\",kind=\"sync\"} 1",
        ],
    );
}

/// A child process killed when the test ends, however it ends.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `hangar ARGS` with `env`, and returns it with the first line it
/// prints.
fn spawn(args: &[&str], env: &[(&str, &std::path::Path)]) -> (Kill, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_hangar"));
    command.args(args).stdout(Stdio::piped()).stderr(Stdio::null());
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = Kill(command.spawn().unwrap());
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
    (child, line.trim().to_owned())
}

/// `what`'s `/metrics` at `base`: in the text format by default, passing
/// `promtool check metrics` with no problem; in OpenMetrics, ending with
/// `# EOF`, when asked for it. Returns the text exposition.
fn check_with_promtool(promtool: &std::path::Path, what: &str, base: &str) -> String {
    let text = reqwest::blocking::get(format!("{base}/metrics")).unwrap();
    assert_eq!(text.headers()["content-type"], "text/plain; version=0.0.4; charset=utf-8", "{what}");
    let text = text.text().unwrap();
    common::assert_promtool_passes(promtool, what, &text);
    let open = client()
        .get(format!("{base}/metrics"))
        .header("accept", "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5")
        .send()
        .unwrap();
    assert_eq!(
        open.headers()["content-type"],
        "application/openmetrics-text; version=1.0.0; charset=utf-8",
        "{what}"
    );
    assert!(open.text().unwrap().ends_with("# EOF\n"), "{what}");
    text
}

/// A server with a model, an async prediction, a bad request and a
/// synchronous one behind it: every family has samples.
/// The predictions configuration with a model that loads LoRA adapters
/// (from a store in `store`): a server whose every family has series.
fn busy_server_in(store: &std::path::Path) -> common::Serve {
    let config = format!(
        "{PREDICTIONS_CONFIG}\n[store]\nroot = \"{}\"\n\n[[models]]\nkey = \"t/lora\"\n\
         engine = {{ kind = \"mock\", preset = \"instant\" }}\nsize = \"1GB\"\nadapters = {{}}\n",
        store.display()
    );
    busy(serve(&config))
}

fn busy_server() -> common::Serve {
    busy(serve(PREDICTIONS_CONFIG))
}

/// `s` after a chat request, a refused one and a prediction.
fn busy(s: common::Serve) -> common::Serve {
    assert_eq!(common::post(&s.url, None, &chat("t/fast", 2)).0, 200);
    assert_eq!(common::post(&s.url, None, &chat("t/fast", 0)).0, 400);
    let (status, p) = post_json(
        &format!("{}/v1/models/t/fast/predictions", s.url),
        &json!({"input": {"prompt": "Hello", "max_tokens": 3}}),
        &[("prefer", "wait=60")],
    );
    assert_eq!((status, p["status"].as_str()), (201, Some("succeeded")), "{p}");
    s
}

#[test]
fn the_server_the_mock_engine_and_the_store_daemon_pass_promtool() {
    let Some(promtool) = promtool() else { return };
    let s = busy_server();
    let m = check_with_promtool(&promtool, "hangar serve", &s.url);
    assert!(m.contains("# TYPE hangar_permits gauge\n"), "{m}");
    assert!(m.contains("# TYPE hangar_requests_total counter\n"), "{m}");

    let (_engine, line) = spawn(&["engine", "mock", "--port", "0", "--preset", "instant"], &[]);
    let engine =
        line.strip_prefix("listening on ").unwrap_or_else(|| panic!("first line {line:?}")).to_owned();
    let asked =
        client().post(format!("{engine}/v1/chat/completions")).json(&chat("mock-llm", 2)).send().unwrap();
    assert_eq!(asked.status(), 200);
    let m = check_with_promtool(&promtool, "hangar engine mock", &engine);
    assert!(m.contains("# TYPE hangar_mock_requests_total counter\nhangar_mock_requests_total 1\n"), "{m}");

    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("store.sock");
    let (_store, line) = spawn(
        &[
            "store",
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--budget",
            "64MiB",
        ],
        &[("HANGAR_STORE_ROOT", &dir.path().join("root"))],
    );
    let store = line.rsplit(" and ").next().filter(|u| u.starts_with("http://"));
    let store = store.unwrap_or_else(|| panic!("first line {line:?}"));
    let m = check_with_promtool(&promtool, "hangar store serve", store);
    assert!(m.contains("# TYPE hangar_store_resident_bytes gauge\n"), "{m}");
}

#[test]
fn an_agent_and_a_fleet_gateway_pass_promtool() {
    let Some(promtool) = promtool() else { return };
    let Some(redis) = hangar_redis::LocalRedis::for_test() else { return };
    let dir = tempfile::tempdir().unwrap();
    let model = "[[models]]\nkey = \"t/a\"\nengine = { kind = \"mock\", preset = \"fast\" }\nsize = \"10GB\"\nmin_replicas = 1\n";
    let (path, gateway) = common::fleet::gateway(dir.path(), &redis.url(), model);
    let agent = common::fleet::agent(dir.path(), &path, &redis.url(), "n0", 1);
    common::fleet::wait_ready(&gateway.url, &[("t/a", 1)], None);
    assert_eq!(common::post(&gateway.url, None, &chat("t/a", 2)).0, 200);

    let m = check_with_promtool(&promtool, "hangar agent", &agent.url);
    assert!(m.contains("hangar_replicas{model=\"t/a\",state=\"ready\"} 1\n"), "{m}");
    assert!(m.contains("hangar_replica_start_seconds_count{model=\"t/a\",tier=\"cold\"} 1\n"), "{m}");
    assert!(!m.contains("hangar_requests_total"), "request figures are the gateways':\n{m}");
    // The agent's instance monitor knows its one replica, in one state.
    let instances: f64 = m
        .lines()
        .filter(|l| l.starts_with("hangar_instances{model=\"t/a\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(instances, 1.0, "{m}");
    let m = check_with_promtool(&promtool, "a fleet's hangar serve", &gateway.url);
    assert!(m.contains("hangar_requests_total{model=\"t/a\",kind=\"sync\",status=\"200\"} 1\n"), "{m}");
}

/// A label matcher of a selector: label, operator, value.
type Matcher = (String, String, String);

/// Every `hangar_…` selector in a PromQL expression: its name and its
/// matchers.
fn selectors(expr: &str) -> Vec<(String, Vec<Matcher>)> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("hangar_") {
        let tail = &rest[at..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        let name = tail[..end].to_owned();
        let mut matchers = Vec::new();
        rest = &tail[end..];
        if let Some(inner) = rest.strip_prefix('{') {
            let close = inner.find('}').expect("a closed selector");
            for m in inner[..close].split(',').map(str::trim).filter(|m| !m.is_empty()) {
                let op_at = m.find(['=', '!']).expect("a matcher has an operator");
                let label = m[..op_at].trim().to_owned();
                let op_len = if m[op_at + 1..].starts_with(['=', '~']) { 2 } else { 1 };
                let op = m[op_at..op_at + op_len].to_owned();
                let value = m[op_at + op_len..].trim().trim_matches('"').to_owned();
                matchers.push((label, op, value));
            }
            rest = &inner[close + 1..];
        }
        out.push((name, matchers));
    }
    out
}

/// The labels of every `by (…)` in `expr`.
fn grouped_by(expr: &str) -> Vec<String> {
    expr.split("by (")
        .skip(1)
        .flat_map(|s| s[..s.find(')').unwrap()].split(',').map(|l| l.trim().to_owned()).collect::<Vec<_>>())
        .collect()
}

/// A sample line's name and labels.
fn sample(line: &str) -> (&str, Vec<(&str, &str)>) {
    let end = line.find(['{', ' ']).unwrap_or(line.len());
    let labels = match line[end..].strip_prefix('{') {
        Some(inner) => inner[..inner.find('}').unwrap()]
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k, v.trim_matches('"')))
            .collect(),
        None => Vec::new(),
    };
    (&line[..end], labels)
}

#[test]
fn the_grafana_dashboard_queries_only_series_the_server_has() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/grafana/hangar.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut exprs: Vec<String> = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            exprs.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = variable["query"]["query"].as_str() {
            exprs.push(q.to_owned());
        }
    }
    assert!(exprs.len() >= 15, "the dashboard has its panels: {exprs:?}");

    let store = tempfile::tempdir().unwrap();
    let s = busy_server_in(store.path());
    // The instance monitor's per-replica figures come once a replica's
    // first 15 s window has closed.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !metrics(&s.url).contains("hangar_replica_utilization{") {
        assert!(Instant::now() < deadline, "no instance window closed in a minute:\n{}", metrics(&s.url));
        std::thread::sleep(Duration::from_millis(200));
    }
    let exposition = metrics(&s.url);
    let samples: Vec<(&str, Vec<(&str, &str)>)> =
        exposition.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).map(sample).collect();
    let mut queried = BTreeSet::new();
    for expr in &exprs {
        let found = selectors(expr);
        assert!(!found.is_empty(), "`{expr}` queries no hangar series");
        let mut labels_here = BTreeSet::new();
        for (name, matchers) in &found {
            queried.insert(name.clone());
            let series: Vec<_> = samples.iter().filter(|(n, _)| n == name).collect();
            assert!(!series.is_empty(), "`{expr}`: no `{name}` on /metrics:\n{exposition}");
            for (label, op, value) in matchers {
                let has = |(_, ls): &&&(&str, Vec<(&str, &str)>)| ls.iter().any(|(l, _)| l == label);
                assert!(series.iter().any(|s| has(&s)), "`{expr}`: `{name}` has no label `{label}`");
                if op == "=" && !value.contains('$') {
                    let matches =
                        series.iter().any(|(_, ls)| ls.iter().any(|(l, v)| l == label && v == value));
                    assert!(matches, "`{expr}`: no `{name}` with {label}=\"{value}\" on /metrics");
                }
            }
            for (_, ls) in &series {
                labels_here.extend(ls.iter().map(|(l, _)| l.to_string()));
            }
        }
        for label in grouped_by(expr) {
            assert!(labels_here.contains(&label), "`{expr}` groups by `{label}`, which its series lack");
        }
    }
    // Every family of the server's own figures is on the dashboard.
    for family in exposition.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let (name, kind) = family.split_once(' ').unwrap();
        let shown = match kind {
            "histogram" => queried.contains(&format!("{name}_bucket")),
            _ => queried.contains(name),
        };
        assert!(shown, "`{name}` is on /metrics but on no panel");
    }
}
