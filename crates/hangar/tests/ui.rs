//! The live status page, `/ui`, seen as an operator sees it: Debian's
//! headless Chromium loads it from a `hangar serve` under traffic (and
//! from a fleet's gateway), runs its script, and the test reads what it
//! rendered — nodes, models, replicas and their states, a request rate —
//! and keeps a screenshot. Also: the page and `/admin/status` need an
//! admin key, which a browser gives once in `?key=` and then in an
//! HttpOnly cookie that the admin commands do not accept.
//!
//! `HANGAR_UI_SCREENSHOT=docs/ui.png cargo test -p hangar --test ui`
//! writes the README's screenshot (a relative path is taken from the
//! workspace's root).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{chat, serve};
use serde_json::Value;

const ADMIN_KEY: &str = "sk-ops-ui";
const USER_KEY: &str = "sk-acme-ui";

/// Three models on one machine of two GPUs, behind API keys: two always
/// up, sharing a GPU, and one started by its first request (a scale
/// decision and a cold start for the page to show).
fn config() -> String {
    format!(
        r#"
[[api_keys]]
key = "{USER_KEY}"
account = "acme"

[[api_keys]]
key = "{ADMIN_KEY}"
account = "ops"
admin = true

[[nodes]]
id = "gpu-box"
gpus = 2
gpu_memory = "80GB"
gpu_kind = "a100-80gb"
virtual_gpus = true
cpu_cache = "64GB"

[[models]]
key = "demo/chat-small"
engine = {{ kind = "mock", preset = "fast" }}
size = "16GB"
min_replicas = 1
max_replicas = 1
concurrency = 8

[[models]]
key = "demo/embed"
engine = {{ kind = "mock", preset = "instant" }}
size = "8GB"
min_replicas = 1
max_replicas = 1
concurrency = 16

[[models]]
key = "demo/chat-large"
engine = {{ kind = "mock", preset = "default", startup_delay_ms = 300 }}
size = "60GB"
min_replicas = 0
max_replicas = 1
concurrency = 4
"#
    )
}

/// Debian's `chromium`, if installed (see [`common::installed`]).
fn chromium() -> Option<PathBuf> {
    common::installed("chromium", "chromium")
}

/// A browser run: its process group is killed when it is dropped, however
/// the test ends (Chromium starts helper processes of its own).
struct Browser(Child);

impl Drop for Browser {
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.0.id() as i32) {
            let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs headless Chromium on `url` with `args` (`--dump-dom`, or
/// `--screenshot=…`), giving the page's script 5 s of virtual time, in a
/// profile of its own under `profile`; returns what it printed.
fn browse(chromium: &Path, profile: &Path, url: &str, args: &[&str]) -> String {
    use std::os::unix::process::CommandExt;
    static RUNS: AtomicU64 = AtomicU64::new(0);
    let out = profile.join(format!("out-{}.txt", RUNS.fetch_add(1, Ordering::Relaxed)));
    let child = Command::new(chromium)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"])
        .args(["--hide-scrollbars", "--virtual-time-budget=5000"])
        .arg(format!("--user-data-dir={}", profile.join("profile").display()))
        .args(args)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(profile.join("chromium.log")).unwrap())
        .process_group(0)
        .spawn()
        .unwrap();
    let mut browser = Browser(child);
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = browser.0.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "chromium did not finish within two minutes on {url}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let log = std::fs::read_to_string(profile.join("chromium.log")).unwrap_or_default();
    assert!(status.success(), "chromium failed ({status}) on {url}:\n{log}");
    std::fs::read_to_string(out).unwrap()
}

/// Requests to every model from a few clients until dropped.
struct Traffic {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Traffic {
    fn start(url: &str, key: Option<&str>, models: &[&str]) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for (i, model) in models.iter().cycle().take(models.len() * 2).enumerate() {
            let (stop, url, model, key) =
                (stop.clone(), url.to_owned(), model.to_string(), key.map(str::to_owned));
            threads.push(std::thread::spawn(move || {
                let client = reqwest::blocking::Client::new();
                while !stop.load(Ordering::Relaxed) {
                    let mut r = client.post(format!("{url}/v1/chat/completions")).json(&chat(&model, 24));
                    if let Some(k) = &key {
                        r = r.bearer_auth(k);
                    }
                    let _ = r.send().and_then(|r| r.bytes());
                    std::thread::sleep(Duration::from_millis(20 + 15 * i as u64));
                }
            }));
        }
        Traffic { stop, threads }
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn admin_status(url: &str, key: Option<&str>) -> Value {
    let mut r = reqwest::blocking::Client::new().get(format!("{url}/admin/status"));
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    r.send().unwrap().json().unwrap()
}

/// Waits (a minute and a half at most) until `ok` holds of `/admin/status`.
fn wait_status(url: &str, key: Option<&str>, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let s = admin_status(url, key);
        if ok(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "{what} not seen in time: {s}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn replicas(s: &Value) -> Vec<&Value> {
    s["models"].as_array().unwrap().iter().flat_map(|m| m["replicas"].as_array().unwrap()).collect()
}

/// The values of the attribute `name` in `dom`.
fn attributes<'a>(dom: &'a str, name: &str) -> Vec<&'a str> {
    let needle = format!(" {name}=\"");
    dom.match_indices(&needle)
        .map(|(at, _)| {
            let rest = &dom[at + needle.len()..];
            &rest[..rest.find('"').unwrap()]
        })
        .collect()
}

#[test]
fn the_status_page_renders_a_busy_server() {
    let Some(chromium) = chromium() else { return };
    let s = serve(&config());
    let models = ["demo/chat-small", "demo/embed", "demo/chat-large"];
    let _traffic = Traffic::start(&s.url, Some(USER_KEY), &models);
    // A point of history with requests in it, and a closed instance window.
    wait_status(&s.url, Some(ADMIN_KEY), "a request rate and a closed window", |s| {
        let busy = s["models"].as_array().unwrap().iter().all(|m| {
            m["history"].as_array().unwrap().iter().any(|p| p["requests_per_s"].as_f64().unwrap() > 0.0)
        });
        busy && replicas(s).iter().all(|r| r["instance"]["utilization"].is_number())
    });

    let dir = tempfile::tempdir().unwrap();
    // The key once in the address: the page sets its cookie and reads
    // /admin/status with it.
    let dom = browse(&chromium, dir.path(), &format!("{}/ui?key={ADMIN_KEY}", s.url), &["--dump-dom"]);
    assert!(dom.contains("data-rendered=\""), "the script never rendered a status:\n{dom}");
    assert_eq!(attributes(&dom, "data-node"), ["gpu-box"], "{dom}");
    assert!(dom.contains("a100-80gb · 2 × 80 GB"), "the node's GPUs:\n{dom}");
    let rows = attributes(&dom, "data-model");
    for m in models {
        assert!(rows.contains(&m), "no row or replica of {m}:\n{dom}");
    }
    let states = attributes(&dom, "data-state");
    assert_eq!(states.iter().filter(|s| **s == "ready").count(), 3, "three ready replicas:\n{dom}");
    let instances = attributes(&dom, "data-instance");
    assert_eq!(instances.len(), 3, "each replica's instance state:\n{dom}");
    assert!(instances.iter().all(|i| ["idle", "active"].contains(i)), "{instances:?}");
    let rates: Vec<f64> = attributes(&dom, "data-rps").iter().filter_map(|r| r.parse().ok()).collect();
    assert!(rates.len() == 3 && rates.iter().all(|r| *r > 0.0), "a request rate per model: {rates:?}\n{dom}");
    let ttfts: Vec<f64> = attributes(&dom, "data-ttft-ms").iter().filter_map(|r| r.parse().ok()).collect();
    assert!(!ttfts.is_empty() && ttfts.iter().all(|t| *t > 0.0), "a TTFT p99 per model: {ttfts:?}");
    assert!(
        attributes(&dom, "data-status").iter().filter(|s| **s == "ready").count() >= 3,
        "the starts:\n{dom}"
    );
    assert!(!dom.contains("class=\"error\""), "the page showed an error:\n{dom}");

    // A screenshot, as the README shows it.
    let shot = dir.path().join("ui.png");
    let arg = format!("--screenshot={}", shot.display());
    browse(
        &chromium,
        dir.path(),
        &format!("{}/ui?key={ADMIN_KEY}", s.url),
        &[&arg, "--window-size=1280,900"],
    );
    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(png.len() < 300_000, "the screenshot is {} bytes", png.len());
    if let Some(to) = std::env::var_os("HANGAR_UI_SCREENSHOT") {
        let to = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")).join(to);
        std::fs::write(&to, &png).unwrap();
        eprintln!("screenshot written to {}", to.display());
    }
}

#[test]
fn the_status_page_shows_every_node_of_a_fleet() {
    let Some(chromium) = chromium() else { return };
    let Some(redis) = hangar_redis::LocalRedis::for_test() else { return };
    let dir = tempfile::tempdir().unwrap();
    let model = "[[models]]\nkey = \"t/a\"\nengine = { kind = \"mock\", preset = \"fast\" }\n\
                 size = \"40GB\"\nmin_replicas = 2\nmax_replicas = 2\n";
    let (path, gateway) = common::fleet::gateway(dir.path(), &redis.url(), model);
    let _a = common::fleet::agent(dir.path(), &path, &redis.url(), "node-a", 1);
    let _b = common::fleet::agent(dir.path(), &path, &redis.url(), "node-b", 1);
    common::fleet::wait_ready(&gateway.url, &[("t/a", 2)], None);
    let _traffic = Traffic::start(&gateway.url, None, &["t/a"]);
    // The agents report each replica's start and what it is doing.
    let status = wait_status(&gateway.url, None, "the agents' reports", |s| {
        let r = replicas(s);
        r.len() == 2
            && r.iter().all(|r| r["start"]["status"] == "ready" && r["instance"]["state"].is_string())
    });
    let nodes: Vec<&str> =
        status["nodes"].as_array().unwrap().iter().map(|n| n["name"].as_str().unwrap()).collect();
    assert_eq!(nodes, ["node-a", "node-b"], "{status}");
    let started = status["models"][0]["starts"].as_array().unwrap();
    assert_eq!(started.len(), 2, "each node's start, once: {status}");

    let dom = browse(&chromium, dir.path(), &format!("{}/ui", gateway.url), &["--dump-dom"]);
    assert!(dom.contains("data-rendered=\""), "the script never rendered a status:\n{dom}");
    assert_eq!(attributes(&dom, "data-node"), ["node-a", "node-b"], "{dom}");
    assert_eq!(attributes(&dom, "data-state"), ["ready", "ready"], "one replica on each node:\n{dom}");
    assert!(dom.contains("gateway gw-"), "the gateway's id:\n{dom}");
}

#[test]
fn the_page_and_its_data_need_an_admin_key_given_once() {
    let s = serve(&config());
    let client =
        reqwest::blocking::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let get = |path: &str, cookie: Option<&str>| {
        let mut r = client.get(format!("{}{path}", s.url));
        if let Some(c) = cookie {
            r = r.header("cookie", c);
        }
        r.send().unwrap()
    };

    let page = get("/ui", None);
    assert_eq!(page.status(), 401);
    assert!(page.text().unwrap().contains("/ui?key="), "the page says how to give the key");
    let wrong = get("/ui?key=sk-nope", None);
    assert_eq!(wrong.status(), 401);
    assert!(wrong.headers().get("set-cookie").is_none());
    let user = get(&format!("/ui?key={USER_KEY}"), None);
    assert_eq!(user.status(), 403, "an account's key is not an admin's");
    assert!(user.text().unwrap().contains("account `acme`"));

    let signed = get(&format!("/ui?key={ADMIN_KEY}"), None);
    assert_eq!(signed.status(), 303);
    assert_eq!(signed.headers()["location"], "/ui", "the key leaves the address");
    let cookie = signed.headers()["set-cookie"].to_str().unwrap().to_owned();
    for flag in ["HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(cookie.contains(flag), "{cookie}");
    }
    assert!(!cookie.contains(ADMIN_KEY), "the cookie does not show the key as typed: {cookie}");
    let pair = cookie.split(';').next().unwrap();

    let page = get("/ui", Some(pair));
    assert_eq!(page.status(), 200);
    assert!(page.text().unwrap().contains("<script src=\"/ui/app.js\">"));
    for asset in ["/ui/app.js", "/ui/style.css"] {
        assert_eq!(get(asset, None).status(), 200, "{asset} holds no data and needs no key");
    }
    let status = get("/admin/status", Some(pair));
    assert_eq!(status.status(), 200);
    let status: Value = status.json().unwrap();
    assert_eq!(status["nodes"][0]["name"], "gpu-box", "{status}");
    assert_eq!(get("/admin/status", Some("hangar_admin=00")).status(), 401, "a cookie of no key");

    // The commands never take the cookie: a page elsewhere cannot make a
    // signed-in browser evict a model.
    let evict = client
        .post(format!("{}/admin/evict", s.url))
        .header("cookie", pair)
        .json(&serde_json::json!({"model": "demo/chat-small"}))
        .send()
        .unwrap();
    assert_eq!(evict.status(), 401);
    let still = admin_status(&s.url, Some(ADMIN_KEY));
    assert!(replicas(&still).iter().all(|r| r["state"] != "draining" && r["state"] != "sleeping"));
}
