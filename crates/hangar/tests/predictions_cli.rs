//! Async predictions end to end: `hangar serve` over real HTTP, real
//! engine processes, a real webhook receiver, and a crash.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::predictions::{client, get, get_as, post, receiver, sse_events, wait_terminal, Hook};
use common::{serve, serve_in};
use serde_json::{json, Value};

use common::PREDICTIONS_CONFIG as CONFIG;

#[test]
fn create_poll_wait_list_and_the_model_routes() {
    let s = serve(CONFIG);
    let (status, p) = post(
        &format!("{}/v1/models/t/fast/predictions", s.url),
        &json!({"input": {"prompt": "Hello", "max_tokens": 5}}),
        &[],
    );
    assert_eq!(status, 201, "{p}");
    assert_eq!(p["status"], "starting");
    assert_eq!(p["model"], "t/fast");
    let done = wait_terminal(p["urls"]["get"].as_str().unwrap());
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(done["output"].as_array().unwrap().len(), 5, "{done}");
    assert!(done["metrics"]["predict_time"].as_f64().unwrap() >= 0.0);
    assert!(done["completed_at"].as_str().unwrap().ends_with('Z'));
    // `urls.web` is no page (yet): it answers the same JSON as `urls.get`,
    // labelled JSON even to a browser asking for HTML.
    let web =
        client().get(done["urls"]["web"].as_str().unwrap()).header("accept", "text/html").send().unwrap();
    assert_eq!(web.status(), 200);
    assert_eq!(web.headers()["content-type"], "application/json");
    assert_eq!(web.json::<Value>().unwrap(), get(done["urls"]["get"].as_str().unwrap()));

    // Prefer: wait answers with the finished prediction.
    let (status, p) = post(
        &format!("{}/v1/predictions", s.url),
        &json!({"version": "t/fast", "input": {"prompt": "Hi", "max_new_tokens": 3}}),
        &[("prefer", "wait=30")],
    );
    assert_eq!((status, p["status"].as_str()), (201, Some("succeeded")), "{p}");
    assert_eq!(p["output"].as_array().unwrap().len(), 3);

    // Versions: by id, by owner/name:id; the schema is served.
    let model = get(&format!("{}/v1/models/t/fast", s.url));
    let version = model["latest_version"]["id"].as_str().unwrap().to_owned();
    assert_eq!(version.len(), 64);
    let v = get(&format!("{}/v1/models/t/fast/versions/{version}", s.url));
    assert_eq!(v["openapi_schema"]["components"]["schemas"]["Input"]["required"], json!(["prompt"]));
    for version in [version.clone(), format!("t/fast:{version}")] {
        let (status, p) = post(
            &format!("{}/v1/predictions", s.url),
            &json!({"version": version, "input": {"prompt": "x", "max_tokens": 1}}),
            &[("prefer", "wait")],
        );
        assert_eq!((status, p["status"].as_str()), (201, Some("succeeded")), "{p}");
    }
    // Deployments.
    let d = get(&format!("{}/v1/deployments/acme/fast-prod", s.url));
    assert_eq!(d["current_release"]["model"], "t/fast");
    let (status, p) = post(
        &format!("{}/v1/deployments/acme/fast-prod/predictions", s.url),
        &json!({"input": {"prompt": "x", "max_tokens": 2}}),
        &[("prefer", "wait")],
    );
    assert_eq!(
        (status, p["status"].as_str(), p["deployment"].as_str()),
        (201, Some("succeeded"), Some("acme/fast-prod"))
    );
    let secret = get(&format!("{}/v1/webhooks/default/secret", s.url));
    assert!(secret["key"].as_str().unwrap().starts_with("whsec_"));

    // Pagination: 100 a page, newest first, full-URL cursors.
    for _ in 0..100 {
        let (status, _) = post(
            &format!("{}/v1/models/t/fast/predictions", s.url),
            &json!({"input": {"prompt": "p", "max_tokens": 1}}),
            &[],
        );
        assert_eq!(status, 201);
    }
    let page1 = get(&format!("{}/v1/predictions", s.url));
    let results = page1["results"].as_array().unwrap();
    assert_eq!(results.len(), 100);
    assert!(page1["previous"].is_null());
    let next = page1["next"].as_str().unwrap();
    assert!(next.starts_with(&s.url), "{next}");
    let page2 = get(next);
    assert_eq!(page2["results"].as_array().unwrap().len(), 105 - 100);
    assert!(page2["next"].is_null());
    let back = get(page2["previous"].as_str().unwrap());
    assert_eq!(back["results"][0]["id"], results[0]["id"]);
}

fn problem(url: &str, body: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let mut r = client().post(url).header("content-type", "application/json").body(body.to_owned());
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().unwrap();
    let status = r.status().as_u16();
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    (status, r.json().unwrap())
}

#[test]
fn bad_input_gets_clear_problems() {
    let s = serve(CONFIG);
    let create = format!("{}/v1/models/t/fast/predictions", s.url);
    let (status, p) = problem(&format!("{}/v1/models/t/nope/predictions", s.url), r#"{"input": {}}"#, &[]);
    assert_eq!(status, 404, "{p}");
    let (status, p) =
        problem(&format!("{}/v1/predictions", s.url), r#"{"version": "zzz", "input": {}}"#, &[]);
    assert_eq!(status, 404, "{p}");
    let (status, p) = problem(&create, "{oops", &[]);
    assert_eq!(status, 400, "{p}");
    assert!(p["detail"].as_str().unwrap().contains("not valid JSON"));
    for (body, field) in [
        (r#"{"input": "hi"}"#, "input"),
        (r#"{"input": {"prompt": 5}}"#, "input.prompt"),
        (r#"{"input": {"prompt": "x", "max_tokens": "many"}}"#, "input.max_tokens"),
        (r#"{"input": {}}"#, "input.prompt"),
        (r#"{"input": {"prompt": "x"}, "stream": "yes"}"#, "stream"),
        (r#"{"input": {"prompt": "x"}, "webhook_events_filter": ["sometimes"]}"#, "webhook_events_filter"),
    ] {
        let (status, p) = problem(&create, body, &[]);
        assert_eq!(status, 422, "{body}: {p}");
        assert_eq!(p["invalid_fields"][0]["field"], field, "{body}: {p}");
    }
    let ok = r#"{"input": {"prompt": "x"}}"#;
    for bad in ["soon", "2s", "-5"] {
        let (status, p) = problem(&create, ok, &[("cancel-after", bad)]);
        assert_eq!(status, 400, "{bad}: {p}");
        assert!(p["detail"].as_str().unwrap().contains("Cancel-After"), "{p}");
    }
    let (status, p) =
        problem(&create, r#"{"input": {"prompt": "x"}, "webhook": "ftp://example.com/hook"}"#, &[]);
    assert_eq!(status, 400, "{p}");
    assert!(p["detail"].as_str().unwrap().contains("webhook"));
    let (status, _) = problem(&create, ok, &[("prefer", "wait=99")]);
    assert_eq!(status, 400);
    let r = client().get(format!("{}/v1/predictions/doesnotexist", s.url)).send().unwrap();
    assert_eq!(r.status(), 404);
}

#[test]
fn cancel_queued_and_running_and_deadlines_abort_or_cancel() {
    let s = serve(CONFIG);
    let create = format!("{}/v1/models/t/slow/predictions", s.url);
    let long = json!({"input": {"prompt": "x", "max_tokens": 100000}});
    // The slow model takes one prediction at a time (async_slots = 1).
    let (_, running) = post(&create, &long, &[]);
    let (_, queued) = post(&create, &long, &[]);
    let (_, doomed) = post(&create, &long, &[("cancel-after", "5s")]);
    let running_url = running["urls"]["get"].as_str().unwrap().to_owned();
    let t = Instant::now();
    while get(&running_url)["status"] != "processing" {
        assert!(t.elapsed() < Duration::from_secs(20));
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let partial = get(&running_url);
    assert!(!partial["output"].as_array().unwrap().is_empty(), "output streams in while it runs: {partial}");
    // Cancel the queued one: it never runs.
    let (status, c) = post(queued["urls"]["cancel"].as_str().unwrap(), &json!({}), &[]);
    assert_eq!((status, c["status"].as_str()), (200, Some("canceled")), "{c}");
    assert!(c["started_at"].is_null());
    // The third waits behind the running one past its Cancel-After: aborted.
    let aborted = wait_terminal(doomed["urls"]["get"].as_str().unwrap());
    assert_eq!(aborted["status"], "aborted", "{aborted}");
    assert!(aborted["deadline"].is_string());
    // The stable replicate client does not know `aborted`: it sees canceled.
    let compat: Value = client()
        .get(doomed["urls"]["get"].as_str().unwrap())
        .header("user-agent", "replicate-python/1.0.7")
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(compat["status"], "canceled");
    // Cancel the running one.
    let (status, c) = post(running["urls"]["cancel"].as_str().unwrap(), &json!({}), &[]);
    assert_eq!((status, c["status"].as_str()), (200, Some("canceled")), "{c}");
    // A running prediction past its Cancel-After: canceled.
    let (_, timed) = post(&create, &long, &[("cancel-after", "5")]);
    let timed = wait_terminal(timed["urls"]["get"].as_str().unwrap());
    assert_eq!(timed["status"], "canceled", "{timed}");
    assert!(!timed["started_at"].is_null(), "it ran before its deadline: {timed}");
    assert!(timed["error"].as_str().unwrap().contains("Cancel-After"));
}

#[test]
fn webhooks_are_signed_filtered_throttled_and_retried() {
    let s = serve(CONFIG);
    let hooks = receiver(2);
    let secret = get(&format!("{}/v1/webhooks/default/secret", s.url))["key"].as_str().unwrap().to_owned();
    let create = format!("{}/v1/models/t/slow/predictions", s.url);
    // About 6 ms a token: ~1.2 s of output.
    let (_, all) =
        post(&create, &json!({"input": {"prompt": "x", "max_tokens": 200}, "webhook": hooks.url}), &[]);
    let all_id = all["id"].as_str().unwrap().to_owned();
    wait_terminal(all["urls"]["get"].as_str().unwrap());
    let (_, only) = post(
        &create,
        &json!({"input": {"prompt": "x", "max_tokens": 50}, "webhook": hooks.url, "webhook_events_filter": ["completed"]}),
        &[],
    );
    let only_id = only["id"].as_str().unwrap().to_owned();
    wait_terminal(only["urls"]["get"].as_str().unwrap());
    let t = Instant::now();
    while hooks.completed().len() < 2 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "completed webhooks not delivered: {:?}",
            hooks.hooks()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let received = hooks.hooks();
    for h in &received {
        assert!(
            hangar_predictions::signing::verify(&secret, &h.id, h.timestamp, &h.body, &h.signature),
            "bad signature on {h:?}"
        );
    }
    let of = |id: &str| -> Vec<Value> {
        received
            .iter()
            .map(|h| serde_json::from_str::<Value>(&h.body).unwrap())
            .filter(|v| v["id"] == id)
            .collect()
    };
    let all_events = of(&all_id);
    let last = all_events.last().unwrap();
    assert_eq!(last["status"], "succeeded");
    assert_eq!(last["output"].as_array().unwrap().len(), 200);
    let intermediate = all_events.iter().filter(|v| v["status"] == "processing").count();
    // ~1.2 s of output at one webhook per 500 ms at most (plus `start`).
    assert!((2..=6).contains(&intermediate), "{intermediate} intermediate webhooks");
    let only_events = of(&only_id);
    assert_eq!(only_events.len(), 1, "filtered to `completed`: {only_events:?}");
    assert_eq!(only_events[0]["status"], "succeeded");
}

#[test]
fn sse_streams_output_then_done() {
    let s = serve(CONFIG);
    let (_, p) = post(
        &format!("{}/v1/models/t/slow/predictions", s.url),
        &json!({"input": {"prompt": "x", "max_tokens": 30}, "stream": true}),
        &[],
    );
    let events = sse_events(p["urls"]["stream"].as_str().unwrap());
    assert_eq!(events.iter().filter(|(e, _)| e == "output").count(), 30, "{events:?}");
    assert_eq!(events.last().unwrap(), &("done".to_owned(), "{}".to_owned()));
    // A finished prediction replays the same stream.
    let again = client().get(p["urls"]["stream"].as_str().unwrap()).send().unwrap().text().unwrap();
    assert_eq!(again.matches("event: output").count(), 30);
}

#[test]
fn a_killed_server_loses_nothing() {
    // Two at a time, 40 tokens each: the server is still working through
    // the backlog when the kill comes. The restarted one runs eight at once.
    let config = CONFIG.replace("async_slots = 1", "async_slots = 2");
    let restart_config = CONFIG.replace("async_slots = 1", "async_slots = 8");
    let dir = tempfile::tempdir().unwrap();
    let s = serve_in(dir, &config);
    let hooks = receiver(0);
    let create = format!("{}/v1/models/t/fast/predictions", s.url);
    let body = json!({"input": {"prompt": "x", "max_tokens": 40}, "webhook": hooks.url, "webhook_events_filter": ["completed"]});
    let mut ids = Vec::new();
    for _ in 0..1000 {
        let (status, p) = post(&create, &body, &[]);
        assert_eq!(status, 201, "{p}");
        ids.push(p["id"].as_str().unwrap().to_owned());
    }
    // Part-way through: some done, some not.
    let t = Instant::now();
    while hooks.completed().len() < 100 {
        assert!(t.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(10));
    }
    let dir = s.kill9();
    let before = hooks.completed().len();
    assert!(before < 1000, "the kill came too late to test anything");
    let s = serve_in(dir, &restart_config);
    let t = Instant::now();
    let mut statuses = HashMap::new();
    while statuses.len() < 1000 || statuses.values().any(|s: &String| s == "starting" || s == "processing") {
        assert!(t.elapsed() < Duration::from_secs(120), "not all ended");
        std::thread::sleep(Duration::from_millis(200));
        statuses.clear();
        let mut page = get(&format!("{}/v1/predictions", s.url));
        loop {
            for p in page["results"].as_array().unwrap() {
                statuses
                    .insert(p["id"].as_str().unwrap().to_owned(), p["status"].as_str().unwrap().to_owned());
            }
            match page["next"].as_str() {
                Some(next) => page = get(next),
                None => break,
            }
        }
    }
    for id in &ids {
        assert!(matches!(statuses[id].as_str(), "succeeded" | "failed"), "{id}: {}", statuses[id]);
    }
    let t = Instant::now();
    while hooks.completed().len() < 1000 {
        assert!(t.elapsed() < Duration::from_secs(60), "{} completed webhooks", hooks.completed().len());
        std::thread::sleep(Duration::from_millis(100));
    }
    for (id, received) in hooks.completed() {
        let first = &received[0];
        assert!(received.iter().all(|h| h.id == first.id), "{id}: webhook ids differ: {received:?}");
        let v: Value = serde_json::from_str(&first.body).unwrap();
        assert_eq!(v["status"].as_str(), Some(statuses[&id].as_str()), "{id}: one terminal state");
    }
    let failed = statuses.values().filter(|s| *s == "failed").count();
    let completed = hooks.completed();
    let deliveries: usize = completed.values().map(Vec::len).sum();
    let repeated = completed.values().filter(|r| r.len() > 1).count();
    eprintln!(
        "crash test: 1000 created, {before} completed webhooks before the kill; after the restart {} ended \
         ({} succeeded, {failed} failed by recovery), 0 lost; {deliveries} completed deliveries for {} \
         predictions ({repeated} delivered more than once, same webhook-id)",
        statuses.len(),
        statuses.len() - failed,
        completed.len()
    );
}

#[test]
fn sync_and_async_share_a_replica_without_starving() {
    // One permit; a continuous synchronous load keeps it busy.
    let s = serve(CONFIG);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sync_ok = Arc::new(AtomicUsize::new(0));
    let loaders: Vec<_> = (0..3)
        .map(|_| {
            let (url, stop, ok) = (s.url.clone(), stop.clone(), sync_ok.clone());
            std::thread::spawn(move || {
                let body = json!({"model": "t/slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20});
                let mut statuses = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let (status, _) = post(&format!("{url}/v1/chat/completions"), &body, &[]);
                    statuses.push(status);
                    if status == 200 {
                        ok.fetch_add(1, Ordering::SeqCst);
                    }
                }
                statuses
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let before = sync_ok.load(Ordering::SeqCst);
    let urls: Vec<String> = (0..4)
        .map(|_| {
            let (status, p) = post(
                &format!("{}/v1/models/t/slow/predictions", s.url),
                &json!({"input": {"prompt": "x", "max_tokens": 20}}),
                &[],
            );
            assert_eq!(status, 201);
            p["urls"]["get"].as_str().unwrap().to_owned()
        })
        .collect();
    // Async is not starved: every prediction ends while the load goes on.
    for url in &urls {
        let p = wait_terminal(url);
        assert_eq!(p["status"], "succeeded", "{p}");
    }
    // Sync is not starved either: it kept being served meanwhile.
    let during = sync_ok.load(Ordering::SeqCst) - before;
    stop.store(true, Ordering::SeqCst);
    for l in loaders {
        let statuses = l.join().unwrap();
        assert!(statuses.iter().all(|s| *s == 200), "sync requests were refused: {statuses:?}");
    }
    assert!(during >= 4, "only {during} synchronous requests were served while predictions ran");
}

#[test]
fn a_failing_receiver_gets_retries_that_survive_a_restart() {
    let hooks = receiver(0);
    hooks.accept.store(false, Ordering::SeqCst);
    let s = serve_in(tempfile::tempdir().unwrap(), CONFIG);
    let (status, p) = post(
        &format!("{}/v1/models/t/fast/predictions", s.url),
        &json!({"input": {"prompt": "x", "max_tokens": 2}, "webhook": hooks.url, "webhook_events_filter": ["completed"]}),
        &[("prefer", "wait")],
    );
    assert_eq!((status, p["status"].as_str()), (201, Some("succeeded")), "{p}");
    let t = Instant::now();
    while hooks.attempts.lock().unwrap().len() < 3 {
        assert!(t.elapsed() < Duration::from_secs(20), "not retried: {:?}", hooks.attempts.lock().unwrap());
        std::thread::sleep(Duration::from_millis(20));
    }
    let dir = s.kill9();
    let refused = hooks.attempts.lock().unwrap().clone();
    assert!(refused.iter().all(|id| *id == refused[0]), "one webhook-id across retries: {refused:?}");
    hooks.accept.store(true, Ordering::SeqCst);
    let _s = serve_in(dir, CONFIG);
    let t = Instant::now();
    while hooks.hooks().is_empty() {
        assert!(t.elapsed() < Duration::from_secs(20), "delivery did not resume after the restart");
        std::thread::sleep(Duration::from_millis(20));
    }
    let delivered = &hooks.hooks()[0];
    assert_eq!(delivered.id, refused[0], "the restart kept the webhook-id");
    let body: Value = serde_json::from_str(&delivered.body).unwrap();
    assert_eq!((body["id"].as_str(), body["status"].as_str()), (p["id"].as_str(), Some("succeeded")));
}

#[test]
fn trainings_have_their_own_routes_queue_and_destination() {
    let s = serve(CONFIG);
    let version =
        get(&format!("{}/v1/models/t/fast", s.url))["latest_version"]["id"].as_str().unwrap().to_owned();
    let create = format!("{}/v1/models/t/fast/versions/{version}/trainings", s.url);
    let (status, t) = post(&create, &json!({"destination": "acme/tuned", "input": {"train_data": "x"}}), &[]);
    assert_eq!(status, 201, "{t}");
    assert_eq!(t["destination"], "acme/tuned");
    let url = t["urls"]["get"].as_str().unwrap().to_owned();
    assert!(url.contains("/v1/trainings/"), "{url}");
    // The mock engine serves completions and cannot train: a clear failure.
    let done = wait_terminal(&url);
    assert_eq!(done["status"], "failed", "{done}");
    assert!(done["error"].as_str().unwrap().contains("cannot train"), "{done}");
    let trainings = get(&format!("{}/v1/trainings", s.url));
    assert_eq!(trainings["results"][0]["id"], t["id"]);
    let predictions = get(&format!("{}/v1/predictions", s.url));
    assert!(predictions["results"].as_array().unwrap().iter().all(|p| p["id"] != t["id"]));
    let r = client().get(format!("{}/v1/predictions/{}", s.url, t["id"].as_str().unwrap())).send().unwrap();
    assert_eq!(r.status(), 404, "a training is not a prediction");
    let (status, p) = problem(&create, r#"{"input": {}}"#, &[]);
    assert_eq!((status, p["invalid_fields"][0]["field"].as_str()), (422, Some("destination")), "{p}");
    let (status, _) = problem(
        &format!("{}/v1/models/t/fast/versions/nope/trainings", s.url),
        r#"{"destination": "a/b", "input": {}}"#,
        &[],
    );
    assert_eq!(status, 404);
}

#[test]
fn data_is_removed_after_the_retention_period() {
    let s = serve(&CONFIG.replace("[predictions]\n", "[predictions]\nretention_s = 1\n"));
    let (status, p) = post(
        &format!("{}/v1/models/t/fast/predictions", s.url),
        &json!({"input": {"prompt": "secret", "max_tokens": 2}}),
        &[("prefer", "wait")],
    );
    assert_eq!((status, p["status"].as_str()), (201, Some("succeeded")), "{p}");
    let url = p["urls"]["get"].as_str().unwrap();
    let t = Instant::now();
    loop {
        let p = get(url);
        if p["data_removed"] == true {
            assert!(p["input"].is_null() && p["output"].is_null() && p["logs"].is_null(), "{p}");
            assert_eq!(p["status"], "succeeded");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "data kept past the retention period: {p}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn hostile_webhooks_and_an_unlisted_loopback_receiver_are_refused() {
    let allow = "webhook_allow = [\"127.0.0.1/32\"]\n";
    assert!(CONFIG.contains(allow));
    let s = serve(&CONFIG.replace(allow, ""));
    let create = format!("{}/v1/models/t/fast/predictions", s.url);
    let hooks = receiver(0);
    for url in
        hangar_predictions::webhook_target::REFUSED_BY_DEFAULT.iter().copied().chain([hooks.url.as_str()])
    {
        let body = json!({"input": {"prompt": "x", "max_tokens": 1}, "webhook": url});
        let (status, p) = problem(&create, &body.to_string(), &[]);
        assert_eq!(status, 400, "{url}: {p}");
        assert_eq!(p["invalid_fields"][0]["field"], "webhook", "{url}: {p}");
        assert!(p["detail"].as_str().unwrap().starts_with("webhook: "), "{url}: {p}");
    }
    // A public destination is accepted.
    let (status, p) =
        post(&create, &json!({"input": {"prompt": "x"}, "webhook": "https://hooks.example.com/x"}), &[]);
    assert_eq!(status, 201, "{p}");
    assert!(hooks.attempts.lock().unwrap().is_empty());
}

/// CONFIG with API keys for the accounts `acme` and `other`, a model
/// `t/private` only `acme` may use, and a deployment of it.
fn keyed_config() -> String {
    format!(
        "{CONFIG}
[[api_keys]]
key = \"sk-acme\"
account = \"acme\"

[[api_keys]]
key = \"sk-other\"
account = \"other\"

[[models]]
key = \"t/private\"
engine = {{ kind = \"mock\", preset = \"fast\" }}
size = \"10GB\"
access = [\"acme\"]

[[predictions.deployments]]
name = \"acme/private-prod\"
model = \"t/private\"
"
    )
}

const ACME: (&str, &str) = ("authorization", "Bearer sk-acme");
const OTHER: (&str, &str) = ("authorization", "Bearer sk-other");

#[test]
fn a_private_model_looks_missing_to_other_accounts_and_to_no_key() {
    let s = serve(&keyed_config());
    let version = get_as(&format!("{}/v1/models/t/private", s.url), Some("sk-acme"));
    assert_eq!(version.0, 200, "{}", version.1);
    let version = version.1["latest_version"]["id"].as_str().unwrap().to_owned();
    // Each route on the private model, and the same on names that do not exist.
    let routes = [
        ("GET", "/v1/models/t/private".to_owned(), "/v1/models/t/nope".to_owned(), None),
        ("GET", "/v1/models/t/private/versions".into(), "/v1/models/t/nope/versions".into(), None),
        (
            "POST",
            "/v1/models/t/private/predictions".into(),
            "/v1/models/t/nope/predictions".into(),
            Some(json!({"input": {"prompt": "x"}})),
        ),
        (
            "POST",
            format!("/v1/models/t/private/versions/{version}/trainings"),
            format!("/v1/models/t/nope/versions/{version}/trainings"),
            Some(json!({"destination": "a/b", "input": {}})),
        ),
        ("GET", "/v1/deployments/acme/private-prod".into(), "/v1/deployments/acme/nope".into(), None),
        (
            "POST",
            "/v1/deployments/acme/private-prod/predictions".into(),
            "/v1/deployments/acme/nope/predictions".into(),
            Some(json!({"input": {"prompt": "x"}})),
        ),
    ];
    let send = |method: &str, path: &str, body: &Option<Value>, key: Option<(&str, &str)>| -> (u16, String) {
        let mut r = client().request(method.parse().unwrap(), format!("{}{path}", s.url));
        if let Some((k, v)) = key {
            r = r.header(k, v);
        }
        if let Some(b) = body {
            r = r.json(b);
        }
        let r = r.send().unwrap();
        (r.status().as_u16(), r.text().unwrap())
    };
    for (method, private, missing, body) in &routes {
        let (seen_status, seen) = send(method, private, body, Some(OTHER));
        let (missing_status, missing_body) = send(method, missing, body, Some(OTHER));
        assert_eq!(seen_status, 404, "{method} {private}: {seen}");
        assert_eq!(missing_status, 404, "{method} {missing}: {missing_body}");
        let anonymised = seen.replace("t/private", "t/nope").replace("private-prod", "nope");
        assert_eq!(anonymised, missing_body, "{method} {private}: the same answer as for {missing}");
        // Without a key: 401 first, for both.
        let (a, a_body) = send(method, private, body, None);
        let (b, b_body) = send(method, missing, body, None);
        assert_eq!((a, &a_body), (401, &b_body), "{method} {private} without a key");
        assert_eq!(b, 401);
        // The account on the access list sees it.
        let (owner, owner_body) = send(method, private, body, Some(ACME));
        assert!((200..300).contains(&owner), "{method} {private} for acme: {owner} {owner_body}");
    }
    let (status, p) = post(
        &format!("{}/v1/predictions", s.url),
        &json!({"version": format!("t/private:{version}"), "input": {"prompt": "x"}}),
        &[OTHER],
    );
    assert_eq!(status, 404, "{p}");
}

#[test]
fn webhook_secrets_are_per_account_and_rotate_with_a_grace_period() {
    let s = serve(&keyed_config());
    let secret_of = |key: &str| {
        let (status, v) = get_as(&format!("{}/v1/webhooks/default/secret", s.url), Some(key));
        assert_eq!(status, 200, "{v}");
        v["key"].as_str().unwrap().to_owned()
    };
    let (acme, other) = (secret_of("sk-acme"), secret_of("sk-other"));
    assert_ne!(acme, other, "each account has its own secret");
    let hooks = receiver(0);
    let create = format!("{}/v1/models/t/fast/predictions", s.url);
    let body = json!({
        "input": {"prompt": "x", "max_tokens": 2}, "webhook": hooks.url, "webhook_events_filter": ["completed"]
    });
    let wait_hooks = |n: usize| {
        let t = Instant::now();
        while hooks.hooks().len() < n {
            assert!(t.elapsed() < Duration::from_secs(20), "webhook not delivered: {:?}", hooks.hooks());
            std::thread::sleep(Duration::from_millis(20));
        }
        hooks.hooks()[n - 1].clone()
    };
    let verifies = |h: &Hook, secret: &str| {
        hangar_predictions::signing::verify(secret, &h.id, h.timestamp, &h.body, &h.signature)
    };
    let (status, p) = post(&create, &body, &[ACME]);
    assert_eq!(status, 201, "{p}");
    let h = wait_hooks(1);
    assert!(verifies(&h, &acme), "{h:?}");
    assert!(!verifies(&h, &other), "another account's secret must not verify: {h:?}");

    let (status, rotated) =
        post(&format!("{}/v1/webhooks/default/secret/rotate", s.url), &json!({}), &[ACME]);
    assert_eq!(status, 200, "{rotated}");
    let new = rotated["key"].as_str().unwrap().to_owned();
    assert_ne!(new, acme);
    assert!(rotated["previous_key_valid_until"].is_string(), "{rotated}");
    assert_eq!(secret_of("sk-acme"), new);
    assert_eq!(secret_of("sk-other"), other);
    let (status, p) = post(&create, &body, &[ACME]);
    assert_eq!(status, 201, "{p}");
    let h = wait_hooks(2);
    assert!(verifies(&h, &new) && verifies(&h, &acme), "both during the grace period: {h:?}");
    assert!(!verifies(&h, &other));
}
