//! Calls on the predictions API, for the tests that use it.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
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

/// One webhook as received.
#[derive(Debug, Clone)]
pub struct Hook {
    pub id: String,
    pub timestamp: u64,
    pub signature: String,
    pub body: String,
}

/// A webhook receiver on loopback that answers 500 to the first
/// `failures` requests (and to all while `accept` is false), 200 after.
pub struct Receiver {
    pub url: String,
    hooks: Arc<Mutex<Vec<Hook>>>,
    /// The `webhook-id` of every request, refused ones included.
    pub attempts: Arc<Mutex<Vec<String>>>,
    pub accept: Arc<std::sync::atomic::AtomicBool>,
}

pub fn receiver(failures: usize) -> Receiver {
    start_receiver(failures, None)
}

/// [`receiver`] over https, with a certificate for `127.0.0.1` that `ca`
/// issued.
pub fn tls_receiver(failures: usize, ca: &hangar_redis::tls::TestCa) -> Receiver {
    start_receiver(failures, Some(Arc::new(ca.server_config(&["127.0.0.1"]))))
}

fn start_receiver(failures: usize, tls: Option<Arc<rustls::ServerConfig>>) -> Receiver {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://{}/hook", listener.local_addr().unwrap());
    let hooks: Arc<Mutex<Vec<Hook>>> = Arc::default();
    let attempts: Arc<Mutex<Vec<String>>> = Arc::default();
    let accept = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let seen = Arc::new(AtomicUsize::new(0));
    let (store, tried, accepting) = (hooks.clone(), attempts.clone(), accept.clone());
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let state = (store.clone(), seen.clone(), tried.clone(), accepting.clone());
            let tls = tls.clone();
            std::thread::spawn(move || match tls {
                None => answer(conn, failures, state),
                // The handshake runs on the first read; a failed one is
                // an error there, so nothing is recorded.
                Some(config) => answer(
                    rustls::StreamOwned::new(rustls::ServerConnection::new(config).unwrap(), conn),
                    failures,
                    state,
                ),
            });
        }
    });
    Receiver { url, hooks, attempts, accept }
}

/// The state a receiver's connections share: hooks accepted, requests
/// seen, their ids, whether to accept.
type ReceiverState =
    (Arc<Mutex<Vec<Hook>>>, Arc<AtomicUsize>, Arc<Mutex<Vec<String>>>, Arc<std::sync::atomic::AtomicBool>);

/// Reads one request from `conn` and answers it.
fn answer(conn: impl Read + Write, failures: usize, (store, seen, tried, accepting): ReceiverState) {
    let mut reader = BufReader::new(conn);
    let mut headers = HashMap::new();
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    loop {
        line.clear();
        // A sender killed mid-request (the test kills the
        // server) leaves a request cut short: not a delivery.
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        if line == "\r\n" {
            break;
        }
        if let Some((k, v)) = line.trim_end().split_once(':') {
            headers.insert(k.to_ascii_lowercase(), v.trim().to_owned());
        }
    }
    let len: usize = headers.get("content-length").and_then(|l| l.parse().ok()).unwrap_or(0);
    let mut body = vec![0; len];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let n = seen.fetch_add(1, Ordering::SeqCst);
    tried.lock().unwrap().push(headers["webhook-id"].clone());
    let ok = n >= failures && accepting.load(Ordering::SeqCst);
    let status = if ok { "200 OK" } else { "500 Internal Server Error" };
    if ok {
        store.lock().unwrap().push(Hook {
            id: headers["webhook-id"].clone(),
            timestamp: headers["webhook-timestamp"].parse().unwrap(),
            signature: headers["webhook-signature"].clone(),
            body: String::from_utf8(body).unwrap(),
        });
    }
    let conn = reader.get_mut();
    let _ = write!(conn, "HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
    let _ = conn.flush();
}

/// Creates a prediction of `model` through `gateway` (`max_tokens`
/// tokens) whose terminal webhook goes to `hooks`: the status and answer.
pub fn create_with_webhook(gateway: &str, model: &str, tokens: u32, hooks: &Receiver) -> (u16, Value) {
    post(
        &format!("{gateway}/v1/models/{model}/predictions"),
        &serde_json::json!({"input": {"prompt": "x", "max_tokens": tokens}, "webhook": hooks.url, "webhook_events_filter": ["completed"]}),
        &[],
    )
}

impl Receiver {
    /// Waits (two minutes at most) until every id has its terminal webhook
    /// and checks it came once (resends of one share its `webhook-id`);
    /// each one's terminal status.
    pub fn one_terminal_each(&self, ids: &[String]) -> HashMap<String, String> {
        let t = Instant::now();
        while self.completed().len() < ids.len() {
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "{} of {} completed webhooks",
                self.completed().len(),
                ids.len()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let completed = self.completed();
        ids.iter()
            .map(|id| {
                let received = &completed[id];
                assert!(
                    received.iter().all(|h| h.id == received[0].id),
                    "{id}: two terminal webhooks: {received:?}"
                );
                let v: Value = serde_json::from_str(&received[0].body).unwrap();
                (id.clone(), v["status"].as_str().unwrap().to_owned())
            })
            .collect()
    }

    pub fn hooks(&self) -> Vec<Hook> {
        self.hooks.lock().unwrap().clone()
    }

    /// The `status` of each received body, per prediction id.
    pub fn completed(&self) -> HashMap<String, Vec<Hook>> {
        let mut out: HashMap<String, Vec<Hook>> = HashMap::new();
        for h in self.hooks() {
            let v: Value = serde_json::from_str(&h.body).unwrap();
            if !matches!(v["status"].as_str(), Some("starting" | "processing")) {
                out.entry(v["id"].as_str().unwrap().to_owned()).or_default().push(h);
            }
        }
        out
    }
}
