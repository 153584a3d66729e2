//! The `/v1` API of a [`Service`] with an in-process executor: routes
//! called through the router (`oneshot`), webhooks delivered to receivers
//! on loopback.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use hangar_core::{ApiKeys, Principal};
use hangar_predictions::store::Backend;
use hangar_predictions::webhook_target::{self, AllowList, Lookup, Outbound};
use hangar_predictions::{
    signing, ExecFuture, Executor, InputRules, InstanceBounds, Job, Model, ModelSettings, PredictionsConfig,
    Service, ServiceError, Sink,
};
use hangar_redis::tls::{CaFile, TestCa};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// Answers every job at once: `max_tokens` (default 2) tokens.
struct Echo;

impl Executor for Echo {
    fn execute(&self, job: Job, sink: Sink, _cancel: CancellationToken) -> ExecFuture {
        Box::pin(async move {
            sink.started();
            let n = job.input.get("max_tokens").and_then(Value::as_u64).unwrap_or(2);
            let out: Vec<Value> = (0..n).map(|i| json!(format!("t{i}"))).collect();
            for t in &out {
                sink.output(t.clone());
            }
            Ok(Value::Array(out))
        })
    }
}

const ACME: &str = "sk-acme";
const OTHER: &str = "sk-other";

fn model(key: &str, access: Option<&[&str]>) -> Model {
    Model {
        key: key.into(),
        version: hangar_predictions::version_id(key),
        settings: ModelSettings::default(),
        access: access.map(|a| a.iter().map(|s| s.parse().unwrap()).collect()),
        input: InputRules::Llm,
        capacity: hangar_predictions::Capacity::new(key.strip_prefix("t/private").map(|_| "a100-80gb"), 0, 2),
    }
}

fn keys() -> ApiKeys {
    ApiKeys::new(
        [(ACME, "acme"), (OTHER, "other")]
            .into_iter()
            .map(|(k, a)| (k.to_owned(), Principal { account: a.parse().unwrap(), admin: false })),
    )
}

/// A running service and its data directory.
struct Running {
    service: Service,
    _dir: tempfile::TempDir,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.service.stop();
    }
}

fn start(config: serde_json::Value, models: Vec<Model>, keys: ApiKeys) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let service = start_in(dir.path(), config, models, keys, Arc::new(Echo));
    Running { service, _dir: dir }
}

/// A service on the store in `dir`, running jobs with `executor`.
fn start_in(
    dir: &std::path::Path,
    config: serde_json::Value,
    models: Vec<Model>,
    keys: ApiKeys,
    executor: Arc<dyn Executor>,
) -> Service {
    let config: PredictionsConfig = serde_json::from_value(config).unwrap();
    Service::start(&Backend::Sqlite(dir.into()), config, models, keys, executor, "http://127.0.0.1:9")
        .unwrap()
}

/// A service with `t/open`, `t/private` (only `acme` may use it) and a
/// deployment of each; API keys for `acme` and `other`.
fn with_private_model() -> Running {
    let config = json!({"deployments": [
        {"name": "acme/open-prod", "model": "t/open"},
        {"name": "acme/private-prod", "model": "t/private"},
    ]});
    start(config, vec![model("t/open", None), model("t/private", Some(&["acme"]))], keys())
}

/// The same service where `t/private` (and its deployment) does not
/// exist.
fn without_private_model() -> Running {
    let config = json!({"deployments": [{"name": "acme/open-prod", "model": "t/open"}]});
    start(config, vec![model("t/open", None)], keys())
}

/// Status, content type and JSON body of one request.
async fn call(
    router: &axum::Router,
    method: &str,
    uri: &str,
    key: Option<&str>,
    body: Option<&str>,
) -> Answer {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    let req = req.body(body.map_or_else(Body::empty, |b| Body::from(b.to_owned()))).unwrap();
    let r = router.clone().oneshot(req).await.unwrap();
    let status = r.status();
    let header = |name: &str| r.headers().get(name).map(|v| v.to_str().unwrap().to_owned());
    let (content_type, retry_after) = (header("content-type"), header("retry-after"));
    let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
    Answer { status, content_type, retry_after, body: serde_json::from_slice(&bytes).unwrap_or(Value::Null) }
}

#[derive(Debug, PartialEq)]
struct Answer {
    status: StatusCode,
    content_type: Option<String>,
    retry_after: Option<String>,
    body: Value,
}

/// With Redis stopped, or paused past the command timeout, every call of
/// the API that needs the store answers 503 with `Retry-After`, naming
/// the store and nothing more; a create refused so stored nothing — not
/// even once a paused Redis resumes — and once Redis is back the same
/// calls succeed.
#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_store_is_a_503_with_retry_after_and_stores_nothing() {
    let Some(mut redis) = hangar_redis::LocalRedis::for_test() else { return };
    let backend = Backend::Redis(hangar_redis::Redis::connect(&redis.url()).unwrap());
    let config: PredictionsConfig = serde_json::from_value(json!({})).unwrap();
    let service = Service::start(
        &backend,
        config,
        vec![model("t/open", None)],
        keys(),
        Arc::new(Echo),
        "http://127.0.0.1:9",
    )
    .unwrap();
    let router = service.router();
    let create = r#"{"input": {"prompt": "x"}}"#;
    let created = call(&router, "POST", "/v1/models/t/open/predictions", Some(ACME), Some(create)).await;
    assert_eq!(created.status, StatusCode::CREATED, "{created:?}");
    let id = created.body["id"].as_str().unwrap().to_owned();
    let listed = |router: axum::Router| async move {
        let a = call(&router, "GET", "/v1/predictions", Some(ACME), None).await;
        assert_eq!(a.status, StatusCode::OK, "{a:?}");
        a.body["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["id"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let unreachable = format!("the prediction store (redis at {}) is unreachable; retry", redis.url());
    let refused = |a: &Answer, what: &str| {
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{what}: {a:?}");
        assert_eq!(a.retry_after.as_deref(), Some("2"), "{what}: {a:?}");
        assert_eq!(a.content_type.as_deref(), Some("application/problem+json"));
        assert_eq!(a.body["detail"], unreachable.as_str(), "{what}: only the store is named");
    };

    redis.stop();
    let get = format!("/v1/predictions/{id}");
    for (method, uri, body) in [
        ("POST", "/v1/models/t/open/predictions", Some(create)),
        ("GET", get.as_str(), None),
        ("GET", "/v1/predictions", None),
    ] {
        refused(&call(&router, method, uri, Some(ACME), body).await, uri);
    }
    redis.start_again().unwrap();
    assert_eq!(listed(router.clone()).await, std::slice::from_ref(&id), "the refused create stored nothing");

    // Paused past the 5 s command timeout: the create waits, is refused,
    // and does not run when Redis resumes.
    let pause = Duration::from_secs(6);
    let paused_at = Instant::now();
    redis.pause(pause).unwrap();
    refused(
        &call(&router, "POST", "/v1/models/t/open/predictions", Some(ACME), Some(create)).await,
        "paused",
    );
    tokio::time::sleep(pause.saturating_sub(paused_at.elapsed()) + Duration::from_millis(200)).await;
    assert_eq!(listed(router.clone()).await, [id], "the create refused during the pause never ran");
    let again = call(&router, "POST", "/v1/models/t/open/predictions", Some(ACME), Some(create)).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    service.stop();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_non_ascii_cursor_is_a_400_naming_the_cursor() {
    let s = start(json!({}), vec![model("t/open", None)], ApiKeys::default());
    let router = s.service.router();
    for list in ["/v1/predictions", "/v1/trainings"] {
        for cursor in ["%C3%A9", "%C3%A9%C3%A9", "b%C3%A9", "%F0%9F%98%80", "x1", "b", "a-", "%C3%A91"] {
            let a = call(&router, "GET", &format!("{list}?cursor={cursor}"), None, None).await;
            assert_eq!(a.status, StatusCode::BAD_REQUEST, "{list} {cursor}: {a:?}");
            assert_eq!(a.content_type.as_deref(), Some("application/problem+json"));
            assert_eq!(a.body["invalid_fields"][0]["field"], "cursor", "{a:?}");
            assert!(a.body["detail"].as_str().unwrap().starts_with("cursor: "), "{a:?}");
        }
        for ok in ["b5", "a5", ""] {
            let a = call(&router, "GET", &format!("{list}?cursor={ok}"), None, None).await;
            assert_eq!(a.status, StatusCode::OK, "{list} {ok}: {a:?}");
        }
    }
}

/// A prediction's output tokens are bounded as the OpenAI API's
/// `max_tokens` is: past the bound, 422 naming the field and the bound,
/// before anything is queued.
#[tokio::test(flavor = "multi_thread")]
async fn max_tokens_beyond_the_chat_bound_is_a_422_naming_field_and_limit() {
    let s = start(json!({}), vec![model("t/open", None)], ApiKeys::default());
    let router = s.service.router();
    let max = hangar_core::MAX_OUTPUT_TOKENS;
    for field in ["max_tokens", "max_new_tokens"] {
        for n in [max + 1, u64::MAX] {
            let body = json!({"input": {"prompt": "x", field: n}}).to_string();
            let a = call(&router, "POST", "/v1/models/t/open/predictions", None, Some(&body)).await;
            assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY, "{field} {n}: {a:?}");
            assert_eq!(a.body["invalid_fields"][0]["field"], format!("input.{field}"), "{a:?}");
            let why = a.body["invalid_fields"][0]["description"].as_str().unwrap();
            assert!(why.contains(&max.to_string()), "{why}");
        }
        let body = json!({"input": {"prompt": "x", field: 3}}).to_string();
        let a = call(&router, "POST", "/v1/models/t/open/predictions", None, Some(&body)).await;
        assert_eq!(a.status, StatusCode::CREATED, "{field} within the bound: {a:?}");
    }
    let listed = call(&router, "GET", "/v1/predictions", None, None).await;
    assert_eq!(listed.body["results"].as_array().map(Vec::len), Some(2), "only the two within the bound");
}

/// Every route that names a model, version or deployment, on `t/private`
/// (its version `vid`), with a body where it takes one.
fn private_routes(vid: &str) -> Vec<(&'static str, String, Option<String>)> {
    let create = r#"{"input": {"prompt": "x"}}"#.to_owned();
    vec![
        ("GET", "/v1/models/t/private".into(), None),
        ("GET", "/v1/models/t/private/versions".into(), None),
        ("GET", format!("/v1/models/t/private/versions/{vid}"), None),
        ("POST", "/v1/models/t/private/predictions".into(), Some(create.clone())),
        ("POST", "/v1/models/t/private/predictions".into(), Some("{oops".into())),
        (
            "POST",
            format!("/v1/models/t/private/versions/{vid}/trainings"),
            Some(r#"{"destination": "acme/tuned", "input": {}}"#.into()),
        ),
        (
            "POST",
            "/v1/predictions".into(),
            Some(r#"{"version": "t/private", "input": {"prompt": "x"}}"#.into()),
        ),
        (
            "POST",
            "/v1/predictions".into(),
            Some(format!(r#"{{"version": "t/private:{vid}", "input": {{"prompt": "x"}}}}"#)),
        ),
        (
            "POST",
            "/v1/predictions".into(),
            Some(format!(r#"{{"version": "{vid}", "input": {{"prompt": "x"}}}}"#)),
        ),
        ("GET", "/v1/deployments/acme/private-prod".into(), None),
        ("POST", "/v1/deployments/acme/private-prod/predictions".into(), Some(create)),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn a_private_model_answers_other_accounts_exactly_as_a_missing_one() {
    let (with, without) = (with_private_model(), without_private_model());
    let (with, without) = (with.service.router(), without.service.router());
    let vid = hangar_predictions::version_id("t/private");
    for (method, uri, body) in private_routes(&vid) {
        let seen = call(&with, method, &uri, Some(OTHER), body.as_deref()).await;
        let missing = call(&without, method, &uri, Some(OTHER), body.as_deref()).await;
        assert_eq!(seen.status, StatusCode::NOT_FOUND, "{method} {uri}: {seen:?}");
        assert_eq!(seen, missing, "{method} {uri}: other account vs. no such model");
        // The account on the access list does see it (so the route is real).
        if body.as_deref() != Some("{oops") {
            let owner = call(&with, method, &uri, Some(ACME), body.as_deref()).await;
            assert!(owner.status.is_success(), "{method} {uri} for acme: {owner:?}");
        }
    }
}

/// What Replicate's client lists — models, deployments, hardware — holds
/// only what the account may use, with each deployment's hardware and
/// bounds; `GET /v1/models` is OpenAI's list too.
#[tokio::test(flavor = "multi_thread")]
async fn the_lists_show_only_what_the_account_may_use() {
    let s = with_private_model();
    let router = s.service.router();
    let keys = |v: &Value, field: &str, name: &str| -> Vec<String> {
        v[field].as_array().unwrap().iter().map(|m| m[name].as_str().unwrap().to_owned()).collect()
    };
    let acme = call(&router, "GET", "/v1/models", Some(ACME), None).await;
    assert_eq!(acme.status, StatusCode::OK, "{acme:?}");
    assert_eq!(keys(&acme.body, "data", "id"), ["t/open", "t/private"]);
    assert_eq!(keys(&acme.body, "results", "name"), ["open", "private"]);
    assert_eq!(acme.body["object"], "list");
    assert_eq!(acme.body["next"], Value::Null);
    let other = call(&router, "GET", "/v1/models", Some(OTHER), None).await;
    assert_eq!(keys(&other.body, "data", "id"), ["t/open"]);

    let acme = call(&router, "GET", "/v1/deployments", Some(ACME), None).await;
    assert_eq!(keys(&acme.body, "results", "name"), ["open-prod", "private-prod"]);
    let private = &acme.body["results"][1]["current_release"];
    assert_eq!(private["configuration"]["hardware"], "gpu-a100-80gb");
    assert_eq!(private["configuration"]["max_instances"], 2);
    assert_ne!(private["created_at"], "1970-01-01T00:00:00.000Z", "the release is the loaded config");
    let other = call(&router, "GET", "/v1/deployments", Some(OTHER), None).await;
    assert_eq!(keys(&other.body, "results", "name"), ["open-prod"]);

    let acme = call(&router, "GET", "/v1/hardware", Some(ACME), None).await;
    let skus: Vec<&str> = acme.body.as_array().unwrap().iter().map(|h| h["sku"].as_str().unwrap()).collect();
    assert_eq!(skus, ["gpu", "gpu-a100-80gb"]);
    let other = call(&router, "GET", "/v1/hardware", Some(OTHER), None).await;
    assert_eq!(other.body, json!([{"sku": "gpu", "name": "GPU (any node)"}]));
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_key_every_route_is_401_for_existing_and_unknown_models_alike() {
    let (with, without) = (with_private_model(), without_private_model());
    let (with, without) = (with.service.router(), without.service.router());
    let vid = hangar_predictions::version_id("t/private");
    let mut routes = private_routes(&vid);
    let open_vid = hangar_predictions::version_id("t/open");
    routes.push((
        "POST",
        "/v1/models/t/open/predictions".into(),
        Some(r#"{"input": {"prompt": "x"}}"#.into()),
    ));
    routes.push((
        "POST",
        "/v1/models/t/nope/predictions".into(),
        Some(r#"{"input": {"prompt": "x"}}"#.into()),
    ));
    routes.push(("POST", format!("/v1/models/t/open/versions/{open_vid}/trainings"), Some("{}".into())));
    routes.push(("GET", "/v1/deployments/acme/open-prod".into(), None));
    routes.push(("GET", "/v1/deployments/acme/nope".into(), None));
    for list in ["/v1/models", "/v1/deployments", "/v1/hardware"] {
        routes.push(("GET", list.into(), None));
    }
    routes.push(("GET", "/v1/webhooks/default/secret".into(), None));
    routes.push(("POST", "/v1/webhooks/default/secret/rotate".into(), None));
    let first = call(&with, "GET", "/v1/models/t/open", None, None).await;
    assert_eq!(first.status, StatusCode::UNAUTHORIZED, "{first:?}");
    for (method, uri, body) in routes {
        for router in [&with, &without] {
            let a = call(router, method, &uri, None, body.as_deref()).await;
            assert_eq!(a, first, "{method} {uri} without a key");
        }
        let a = call(&with, method, &uri, Some("sk-wrong"), body.as_deref()).await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{method} {uri} with a wrong key: {a:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_oversized_body_is_payload_too_large() {
    let s = start(json!({}), vec![model("t/open", None)], ApiKeys::default());
    let router = s.service.router().layer(DefaultBodyLimit::max(64));
    let big = format!(r#"{{"input": {{"prompt": "{}"}}}}"#, "x".repeat(1000));
    for uri in ["/v1/models/t/open/predictions", "/v1/predictions"] {
        let a = call(&router, "POST", uri, None, Some(&big)).await;
        assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE, "{uri}: {a:?}");
        assert_eq!(a.body["title"], "Payload too large", "{a:?}");
        assert_eq!(a.body["status"], 413);
        assert_eq!(a.content_type.as_deref(), Some("application/problem+json"));
    }
    let a = call(&router, "POST", "/v1/models/t/open/predictions", None, Some("{oops")).await;
    assert_eq!((a.status, a.body["title"].as_str()), (StatusCode::BAD_REQUEST, Some("Bad request")), "{a:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_webhooks_are_refused_at_create_and_the_allow_list_opens_what_it_names() {
    let s = start(json!({}), vec![model("t/open", None)], ApiKeys::default());
    let router = s.service.router();
    let create = |url: &str| json!({"input": {"prompt": "x"}, "webhook": url}).to_string();
    for url in hangar_predictions::webhook_target::REFUSED_BY_DEFAULT {
        let a = call(&router, "POST", "/v1/models/t/open/predictions", None, Some(&create(url))).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{url}: {a:?}");
        assert_eq!(a.body["invalid_fields"][0]["field"], "webhook", "{url}: {a:?}");
    }
    let a = call(
        &router,
        "POST",
        "/v1/models/t/open/predictions",
        None,
        Some(&create("https://hooks.example.com/x")),
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED, "a public destination: {a:?}");
    let open =
        start(json!({"webhook_allow": ["127.0.0.1/32"]}), vec![model("t/open", None)], ApiKeys::default());
    let router = open.service.router();
    for (url, status) in [
        ("http://127.0.0.1:9/hook", StatusCode::CREATED),
        ("http://127.1:9/hook", StatusCode::CREATED),
        ("http://127.0.0.2/", StatusCode::BAD_REQUEST),
        ("http://[::1]/", StatusCode::BAD_REQUEST),
        ("http://169.254.169.254/", StatusCode::BAD_REQUEST),
        ("http://user:pass@127.0.0.1/", StatusCode::BAD_REQUEST),
    ] {
        let a = call(&router, "POST", "/v1/models/t/open/predictions", None, Some(&create(url))).await;
        assert_eq!(a.status, status, "{url}: {a:?}");
    }
}

/// One webhook request as a receiver saw it.
#[derive(Debug, Clone)]
struct Hook {
    id: String,
    timestamp: u64,
    signature: String,
    body: String,
}

impl Hook {
    fn verifies_with(&self, secret: &str) -> bool {
        signing::verify(secret, &self.id, self.timestamp, &self.body, &self.signature)
    }
}

type Seen = Arc<Mutex<Vec<Hook>>>;

/// A receiver on loopback that records each request, whatever its
/// method, and answers 200, or redirects (`302`, `307`) to a URL.
async fn receiver(redirect: Option<(StatusCode, String)>) -> (String, Seen) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    (url, serve_receiver(listener, redirect))
}

/// The TLS listener of an `https` receiver: TCP on loopback, then a
/// rustls handshake with its certificate; a failed handshake is recorded
/// (what the sender's refusal looks like from this side) and the next
/// connection awaited.
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    refused: Arc<Mutex<Vec<String>>>,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else { continue };
            match self.acceptor.accept(tcp).await {
                Ok(tls) => return (tls, addr),
                Err(e) => self.refused.lock().unwrap().push(e.to_string()),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// An `https` receiver on loopback (else as [`receiver`]) whose
/// certificate `ca` issued for `names`; the URL names `host` (with the
/// listener's port), and the failed TLS handshakes are listed.
async fn tls_receiver(ca: &TestCa, names: &[&str], host: &str) -> (String, Seen, Arc<Mutex<Vec<String>>>) {
    let config = ca.server_config(names);
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{host}:{}/hook", tcp.local_addr().unwrap().port());
    let refused: Arc<Mutex<Vec<String>>> = Arc::default();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let seen = serve_receiver(TlsListener { tcp, acceptor, refused: refused.clone() }, None);
    (url, seen, refused)
}

/// Serves the recording receiver on `listener`.
fn serve_receiver(
    listener: impl axum::serve::Listener<Addr = std::net::SocketAddr>,
    redirect: Option<(StatusCode, String)>,
) -> Seen {
    let seen: Seen = Arc::default();
    async fn handle(
        State((seen, redirect)): State<(Seen, Option<(StatusCode, String)>)>,
        headers: HeaderMap,
        body: String,
    ) -> Response {
        let h = |k: &str| headers.get(k).map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
        seen.lock().unwrap().push(Hook {
            id: h("webhook-id"),
            timestamp: h("webhook-timestamp").parse().unwrap_or(0),
            signature: h("webhook-signature"),
            body,
        });
        match redirect {
            Some((status, to)) => (status, [("location", to)]).into_response(),
            None => StatusCode::OK.into_response(),
        }
    }
    let app =
        axum::Router::new().route("/hook", axum::routing::any(handle)).with_state((seen.clone(), redirect));
    tokio::spawn(async move { axum::serve(listener, app).await });
    seen
}

/// Waits until `seen` holds `n` requests (failing after 20 s, so a
/// broken build does not hang).
async fn wait_for(seen: &Seen, n: usize) -> Vec<Hook> {
    let t = Instant::now();
    loop {
        let hooks = seen.lock().unwrap().clone();
        if hooks.len() >= n {
            return hooks;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "{} of {n} webhooks arrived: {hooks:?}", hooks.len());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn create_with_webhook(router: &axum::Router, key: &str, webhook: &str) {
    let body = json!({"input": {"prompt": "x"}, "webhook": webhook, "webhook_events_filter": ["completed"]});
    let a = call(router, "POST", "/v1/models/t/open/predictions", Some(key), Some(&body.to_string())).await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
}

async fn secret_of(router: &axum::Router, key: &str) -> String {
    let a = call(router, "GET", "/v1/webhooks/default/secret", Some(key), None).await;
    a.body["key"].as_str().unwrap_or_else(|| panic!("{a:?}")).to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn each_account_signs_with_its_own_secret_and_rotation_keeps_the_old_one_for_the_grace_period() {
    let s = start(json!({"webhook_allow": ["127.0.0.1/32"]}), vec![model("t/open", None)], keys());
    let router = s.service.router();
    let (acme, other) = (secret_of(&router, ACME).await, secret_of(&router, OTHER).await);
    assert!(acme.starts_with("whsec_") && other.starts_with("whsec_"));
    assert_ne!(acme, other, "two accounts, two secrets");
    assert_eq!(secret_of(&router, ACME).await, acme, "kept");
    assert_eq!(s.service.webhook_secret(&"acme".parse().unwrap()).unwrap(), acme);

    let (url, seen) = receiver(None).await;
    create_with_webhook(&router, ACME, &url).await;
    let hook = wait_for(&seen, 1).await.remove(0);
    assert!(hook.verifies_with(&acme), "{hook:?}");
    assert!(!hook.verifies_with(&other), "another account's secret does not verify: {hook:?}");
    // And the other way round.
    create_with_webhook(&router, OTHER, &url).await;
    let hook = wait_for(&seen, 2).await.remove(1);
    assert!(hook.verifies_with(&other) && !hook.verifies_with(&acme), "{hook:?}");

    // Rotation: a new key; the old one valid for the default day.
    let r = call(&router, "POST", "/v1/webhooks/default/secret/rotate", Some(ACME), None).await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    let new = r.body["key"].as_str().unwrap().to_owned();
    assert!(new.starts_with("whsec_") && new != acme, "{r:?}");
    assert!(r.body["previous_key_valid_until"].as_str().unwrap().ends_with('Z'), "{r:?}");
    assert_eq!(secret_of(&router, ACME).await, new);
    assert_eq!(secret_of(&router, OTHER).await, other, "the other account's secret is untouched");
    create_with_webhook(&router, ACME, &url).await;
    let hook = wait_for(&seen, 3).await.remove(2);
    assert_eq!(hook.signature.split(' ').count(), 2, "{hook:?}");
    assert!(hook.verifies_with(&new) && hook.verifies_with(&acme), "both during the grace period: {hook:?}");
    assert!(!hook.verifies_with(&other));
}

#[tokio::test(flavor = "multi_thread")]
async fn after_the_grace_period_only_the_new_secret_signs() {
    // A zero grace period: the rotated-out secret ends at once.
    let config = json!({"webhook_allow": ["127.0.0.1/32"], "webhook_secret_grace_s": 0});
    let s = start(config, vec![model("t/open", None)], keys());
    let router = s.service.router();
    let old = secret_of(&router, ACME).await;
    let r = call(&router, "POST", "/v1/webhooks/default/secret/rotate", Some(ACME), None).await;
    let new = r.body["key"].as_str().unwrap().to_owned();
    let (url, seen) = receiver(None).await;
    create_with_webhook(&router, ACME, &url).await;
    let hook = wait_for(&seen, 1).await.remove(0);
    assert!(hook.verifies_with(&new), "{hook:?}");
    assert!(!hook.verifies_with(&old), "the old secret no longer signs: {hook:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_redirect_is_a_failed_attempt_retried_and_its_target_gets_nothing() {
    let config = json!({
        "webhook_allow": ["127.0.0.1/32"],
        "webhook_retry_base_ms": 100, "webhook_retry_cap_ms": 100, "webhook_max_attempts": 3,
    });
    let s = start(config, vec![model("t/open", None)], ApiKeys::default());
    let router = s.service.router();
    // The target records any request, so a followed redirect (a 302 turns
    // the POST into a GET; a 307 keeps it) would show there.
    let (target, target_seen) = receiver(None).await;
    for status in [StatusCode::FOUND, StatusCode::TEMPORARY_REDIRECT] {
        let (redirecting, redirecting_seen) = receiver(Some((status, target.clone()))).await;
        let body =
            json!({"input": {"prompt": "x"}, "webhook": redirecting, "webhook_events_filter": ["completed"]});
        let a = call(&router, "POST", "/v1/models/t/open/predictions", None, Some(&body.to_string())).await;
        assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
        // All three attempts reach the redirecting receiver: each redirect
        // failed its attempt; none reaches the target.
        let t = Instant::now();
        while redirecting_seen.lock().unwrap().len() < 3 {
            assert!(target_seen.lock().unwrap().is_empty(), "{status}: the redirect was followed");
            assert!(t.elapsed() < Duration::from_secs(20), "{status}: not retried");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let attempts = redirecting_seen.lock().unwrap().clone();
        assert!(
            attempts.iter().all(|h| h.id == attempts[0].id),
            "{status}: one webhook retried: {attempts:?}"
        );
        assert!(target_seen.lock().unwrap().is_empty(), "{status}: the redirect was followed");
    }
    // The target is reachable and allowed: a webhook addressed to it arrives.
    let body = json!({"input": {"prompt": "x"}, "webhook": target, "webhook_events_filter": ["completed"]});
    let a = call(&router, "POST", "/v1/models/t/open/predictions", None, Some(&body.to_string())).await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    assert_eq!(wait_for(&target_seen, 1).await.len(), 1);
}

/// What the service logs at WARN and above, from the first call on: one
/// subscriber for the whole test binary, so each test looks for its own
/// receiver's URL.
fn logs() -> String {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    struct Append(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Append {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let logs = LOGS.get_or_init(|| {
        let logs: Arc<Mutex<Vec<u8>>> = Arc::default();
        let to = logs.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
            .with_writer(move || Append(to.clone()))
            .init();
        logs
    });
    String::from_utf8_lossy(&logs.lock().unwrap()).into_owned()
}

/// Waits until `done` holds (failing after 20 s, so a broken build does
/// not hang).
async fn wait_until(what: &str, done: impl Fn() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(20), "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A test CA and its certificate written to a PEM file in `dir`.
fn ca_file_in(dir: &std::path::Path, name: &str) -> (TestCa, std::path::PathBuf) {
    let ca = TestCa::new(name);
    let path = dir.join(format!("{name}.pem").replace(' ', "-"));
    ca.write(&path).unwrap();
    (ca, path)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_https_webhook_reaches_a_receiver_the_ca_file_vouches_for_signed_as_over_http() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, ca_file) = ca_file_in(dir.path(), "hooks CA");
    let config = json!({"webhook_allow": ["127.0.0.1/32"], "webhook_ca_file": ca_file});
    let s = start(config, vec![model("t/open", None)], keys());
    let router = s.service.router();
    let (url, seen, refused) = tls_receiver(&ca, &["127.0.0.1"], "127.0.0.1").await;
    assert!(url.starts_with("https://"));
    create_with_webhook(&router, ACME, &url).await;
    let hook = wait_for(&seen, 1).await.remove(0);
    assert!(hook.verifies_with(&secret_of(&router, ACME).await), "{hook:?}");
    let body: Value = serde_json::from_str(&hook.body).unwrap();
    assert_eq!(body["status"], "succeeded", "{body}");
    assert_eq!(refused.lock().unwrap().len(), 0, "no handshake failed");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_receiver_whose_certificate_no_trusted_ca_signed_gets_nothing_and_the_log_names_the_certificate() {
    logs();
    let dir = tempfile::tempdir().unwrap();
    let (_, ca_file) = ca_file_in(dir.path(), "hooks CA");
    let config = json!({
        "webhook_allow": ["127.0.0.1/32"], "webhook_ca_file": ca_file,
        "webhook_retry_base_ms": 100, "webhook_retry_cap_ms": 100, "webhook_max_attempts": 2,
    });
    let s = start(config, vec![model("t/open", None)], keys());
    let router = s.service.router();
    let stranger = TestCa::new("a CA nobody trusts");
    let (url, seen, refused) = tls_receiver(&stranger, &["127.0.0.1"], "127.0.0.1").await;
    create_with_webhook(&router, ACME, &url).await;
    // Both attempts were refused at the handshake (the retry came), and
    // the one after the last gave up.
    let failures = || logs().lines().filter(|l| l.contains("webhook failed") && l.contains(&url)).count();
    wait_until("two failed attempts logged", || failures() >= 2).await;
    let logged = logs();
    let lines: Vec<&str> = logged.lines().filter(|l| l.contains(&url)).collect();
    assert!(lines[0].contains("will retry") && lines[1].contains("giving up"), "{lines:#?}");
    for line in &lines {
        assert!(line.contains("invalid peer certificate: UnknownIssuer"), "{line}");
    }
    // The receiver records a refused handshake when the sender's alert
    // reaches it, which may be after the sender has logged its failure.
    wait_until("two handshakes refused at the receiver", || refused.lock().unwrap().len() >= 2).await;
    let refused = refused.lock().unwrap().len();
    assert_eq!(refused, 2, "two handshakes, both refused by the sender");
    assert!(seen.lock().unwrap().is_empty(), "nothing was sent to the untrusted receiver");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_webhook_client_connects_to_the_vetted_address_and_checks_the_certificate_against_the_urls_name()
{
    let dir = tempfile::tempdir().unwrap();
    let (ca, ca_file) = ca_file_in(dir.path(), "hooks CA");
    let ca_file = CaFile::load(&ca_file).unwrap();
    // The name resolves to loopback, which the allow list opens.
    let lookup: Lookup = Arc::new(|_| Box::pin(async { Ok(vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]) }));
    let allow = Arc::new(AllowList::parse(&["127.0.0.1/32".to_owned()]).unwrap());
    let client = Outbound::with_lookup(allow.clone(), lookup.clone(), Some(&ca_file), None).unwrap();
    let client = client.http();
    let (url, seen, _) = tls_receiver(&ca, &["hooks.example.com"], "hooks.example.com").await;
    let answer = client.post(&url).body("{}").send().await.unwrap();
    assert!(answer.status().is_success(), "{answer:?}");
    assert_eq!(seen.lock().unwrap().len(), 1);
    let refusal = |e: reqwest::Error| webhook_target::error_chain(&e);
    // The same address with a certificate for another name: refused.
    let (elsewhere, elsewhere_seen, _) = tls_receiver(&ca, &["other.example.com"], "hooks.example.com").await;
    let e = refusal(client.post(&elsewhere).send().await.unwrap_err());
    assert!(
        e.contains(r#"invalid peer certificate: certificate not valid for name "hooks.example.com""#),
        "{e}"
    );
    assert!(elsewhere_seen.lock().unwrap().is_empty());
    // Without the CA file, the default roots do not know the test CA.
    let default = Outbound::with_lookup(allow, lookup.clone(), None, None).unwrap();
    let default = default.http();
    let e = refusal(default.post(&url).send().await.unwrap_err());
    assert!(e.contains("invalid peer certificate: UnknownIssuer"), "{e}");
    // And a name resolving inside without an allow entry is refused
    // before any connection, https or not.
    let strict = Outbound::with_lookup(Arc::new(AllowList::default()), lookup, Some(&ca_file), None).unwrap();
    let strict = strict.http();
    let e = refusal(strict.post(&url).send().await.unwrap_err());
    assert!(e.contains("resolves to 127.0.0.1"), "{e}");
    assert_eq!(seen.lock().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn start_refuses_an_invalid_configuration() {
    let dir = tempfile::tempdir().unwrap();
    for (config, says) in [
        (json!({"webhook_retry_base_ms": 0, "webhook_max_attempts": 1000000}), "webhook_retry_base_ms"),
        (json!({"webhook_allow": ["10.0.0.0/99"]}), "webhook_allow[0]"),
        (json!({"webhook_ca_file": "/nonexistent/hooks-ca.pem"}), "webhook_ca_file: cannot read the CA file"),
        (json!({"deployments": [{"name": "x", "model": "t/open"}]}), "deployments[0].name"),
        (json!({"durable_replicas": 17}), "durable_replicas"),
        // Replicas to hold a create, of a store on the server's own disk.
        (json!({"durable_replicas": 1}), "durable_replicas = 1 asks Redis replicas"),
    ] {
        let config: PredictionsConfig = serde_json::from_value(config).unwrap();
        let e = Service::start(
            &Backend::Sqlite(dir.path().into()),
            config,
            vec![model("t/open", None)],
            ApiKeys::default(),
            Arc::new(Echo),
            "http://x",
        )
        .err()
        .unwrap();
        assert!(matches!(&e, ServiceError::Config(m) if m.contains(says)), "{e}");
    }
    let mut m = model("t/open", None);
    m.settings.max_run_lifetime_s = u64::MAX;
    let e = Service::start(
        &Backend::Sqlite(dir.path().into()),
        PredictionsConfig::default(),
        vec![m],
        ApiKeys::default(),
        Arc::new(Echo),
        "http://x",
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("max_run_lifetime_s"), "{e}");
}

/// Answers as [`Echo`] and keeps every model's bounds as the service
/// applies them; a model whose policy keeps exactly its minimum (`fixed`,
/// named `t/fixed`) refuses a minimum of 0.
#[derive(Default)]
struct Bounded {
    applied: Mutex<std::collections::BTreeMap<String, Option<InstanceBounds>>>,
}

impl Executor for Bounded {
    fn execute(&self, job: Job, sink: Sink, cancel: CancellationToken) -> ExecFuture {
        Echo.execute(job, sink, cancel)
    }

    fn check_bounds(&self, model: &str, bounds: InstanceBounds) -> Result<(), String> {
        match model == "t/fixed" && bounds.min_instances == 0 {
            true => Err("min_replicas: is 0, and the `fixed` policy keeps exactly min_replicas".into()),
            false => Ok(()),
        }
    }

    fn apply_bounds(&self, model: &str, bounds: Option<InstanceBounds>) -> hangar_predictions::BoundsFuture {
        self.applied.lock().unwrap().insert(model.to_owned(), bounds);
        Box::pin(async { Ok(()) })
    }
}

/// Deployments through the API, as Replicate's client makes them: created
/// under the caller's account (201), its model's bounds applied at once;
/// seen, run and changed by that account alone; each update a new release
/// from the one read; deleted (204) giving the model its own bounds back;
/// kept by the store across a restart, whose service applies them again
/// without being told. Every refusal names its field or the conflict.
#[tokio::test(flavor = "multi_thread")]
async fn deployments_are_made_changed_and_removed_by_their_owner() {
    let dir = tempfile::tempdir().unwrap();
    let models = || vec![model("t/open", None), model("t/fixed", None), model("t/private", Some(&["acme"]))];
    let config = json!({"deployments": [{"name": "acme/open-prod", "model": "t/open"}]});
    let exec = Arc::new(Bounded::default());
    let service = start_in(dir.path(), config.clone(), models(), keys(), exec.clone());
    let router = service.router();
    let version = hangar_predictions::version_id("t/open");
    let body = |name: &str, model: &str, min: i64, max: i64| {
        let version = hangar_predictions::version_id(model);
        json!({"name": name, "model": model, "version": version, "hardware": "gpu",
               "min_instances": min, "max_instances": max})
        .to_string()
    };
    let bounds = |min, max| Some(InstanceBounds { min_instances: min, max_instances: max });

    let made =
        call(&router, "POST", "/v1/deployments", Some(ACME), Some(&body("prod", "t/open", 1, 3))).await;
    assert_eq!(made.status, StatusCode::CREATED, "{made:?}");
    assert_eq!((made.body["owner"].as_str(), made.body["name"].as_str()), (Some("acme"), Some("prod")));
    let release = &made.body["current_release"];
    assert_eq!((release["number"].as_u64(), release["version"].as_str()), (Some(1), Some(version.as_str())));
    assert_eq!(release["configuration"]["min_instances"], 1);
    assert_eq!(release["created_by"]["username"], "acme");
    assert_eq!(exec.applied.lock().unwrap()["t/open"], bounds(1, 3), "applied at once");

    // Its owner sees it in the list, after the declared one (whose release
    // shows the model's bounds as they now stand); another account never.
    let list = call(&router, "GET", "/v1/deployments", Some(ACME), None).await;
    let names: Vec<&str> =
        list.body["results"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["open-prod", "prod"]);
    assert_eq!(list.body["results"][0]["current_release"]["configuration"]["min_instances"], 1);
    let list = call(&router, "GET", "/v1/deployments", Some(OTHER), None).await;
    assert_eq!(list.body["results"].as_array().unwrap().len(), 1, "{list:?}");
    for (method, uri, body) in [
        ("GET", "/v1/deployments/acme/prod", None),
        ("PATCH", "/v1/deployments/acme/prod", Some(r#"{"min_instances": 0}"#)),
        ("DELETE", "/v1/deployments/acme/prod", None),
        ("POST", "/v1/deployments/acme/prod/predictions", Some(r#"{"input": {"prompt": "x"}}"#)),
    ] {
        let a = call(&router, method, uri, Some(OTHER), body).await;
        assert_eq!(a.status, StatusCode::NOT_FOUND, "{method} {uri} by another account: {a:?}");
    }
    let run = call(
        &router,
        "POST",
        "/v1/deployments/acme/prod/predictions",
        Some(ACME),
        Some(r#"{"input": {"prompt": "x"}}"#),
    )
    .await;
    assert_eq!(run.status, StatusCode::CREATED, "{run:?}");
    assert_eq!(run.body["model"], "t/open");

    // Refusals, each naming what is wrong.
    let refused = [
        (r#"{"name": "a/b", "model": "t/open"}"#.to_owned(), StatusCode::UNPROCESSABLE_ENTITY, "name"),
        (r#"{"name": "x"}"#.to_owned(), StatusCode::UNPROCESSABLE_ENTITY, "model"),
        (body("x", "t/open", 2, 1), StatusCode::UNPROCESSABLE_ENTITY, "min_instances"),
        (body("x", "t/open", 0, 0), StatusCode::UNPROCESSABLE_ENTITY, "max_instances"),
        (body("x", "t/open", -1, 1), StatusCode::UNPROCESSABLE_ENTITY, "min_instances"),
        (body("x", "t/fixed", 0, 1), StatusCode::UNPROCESSABLE_ENTITY, "min_instances"),
        (
            body("x", "t/open", 0, 1).replace("\"gpu\"", "\"gpu-h100\""),
            StatusCode::UNPROCESSABLE_ENTITY,
            "hardware",
        ),
        (body("x", "t/open", 0, 1).replace(&version, "v0"), StatusCode::UNPROCESSABLE_ENTITY, "version"),
        (
            body("x", "t/open", 0, 1).replace("\"hardware\"", "\"hardwear\""),
            StatusCode::UNPROCESSABLE_ENTITY,
            "hardwear",
        ),
        (body("x", "t/nope", 0, 1), StatusCode::NOT_FOUND, "t/nope"),
        (body("x", "t/private", 0, 1), StatusCode::NOT_FOUND, "t/private"),
        (body("prod", "t/fixed", 1, 1), StatusCode::CONFLICT, "acme/prod"),
        (body("other", "t/open", 0, 1), StatusCode::CONFLICT, "acme/prod"),
        (body("open-prod", "t/fixed", 1, 1), StatusCode::CONFLICT, "config"),
        ("{oops".to_owned(), StatusCode::BAD_REQUEST, "JSON"),
    ];
    for (body, status, named) in refused {
        let key = if named == "t/private" { OTHER } else { ACME };
        let a = call(&router, "POST", "/v1/deployments", Some(key), Some(&body)).await;
        assert_eq!(a.status, status, "{body}: {a:?}");
        assert!(a.body["detail"].as_str().unwrap().contains(named), "{body}: {a:?}");
    }
    let declared =
        call(&router, "PATCH", "/v1/deployments/acme/open-prod", Some(ACME), Some(r#"{"min_instances": 2}"#))
            .await;
    assert_eq!(declared.status, StatusCode::CONFLICT, "{declared:?}");
    assert!(declared.body["detail"].as_str().unwrap().contains("[[predictions.deployments]]"));

    // An update is a new release; a field left out keeps its value.
    let updated =
        call(&router, "PATCH", "/v1/deployments/acme/prod", Some(ACME), Some(r#"{"max_instances": 2}"#))
            .await;
    assert_eq!(updated.status, StatusCode::OK, "{updated:?}");
    let configuration = &updated.body["current_release"]["configuration"];
    assert_eq!(
        (configuration["min_instances"].as_u64(), configuration["max_instances"].as_u64()),
        (Some(1), Some(2))
    );
    assert_eq!(updated.body["current_release"]["number"], 2);
    assert_eq!(exec.applied.lock().unwrap()["t/open"], bounds(1, 2));
    let bad =
        call(&router, "PATCH", "/v1/deployments/acme/prod", Some(ACME), Some(r#"{"min_instances": 3}"#))
            .await;
    assert_eq!(bad.status, StatusCode::UNPROCESSABLE_ENTITY, "{bad:?}");
    drop(router);
    service.stop();

    // A restart on the same store: the deployment is there and its bounds
    // are applied again by the service itself.
    let exec = Arc::new(Bounded::default());
    let service = start_in(dir.path(), config, models(), keys(), exec.clone());
    let router = service.router();
    let got = call(&router, "GET", "/v1/deployments/acme/prod", Some(ACME), None).await;
    assert_eq!(got.body["current_release"]["number"], 2, "{got:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while exec.applied.lock().unwrap().get("t/open") != Some(&bounds(1, 2)) {
        assert!(Instant::now() < deadline, "the restarted service applies the stored bounds");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let gone = call(&router, "DELETE", "/v1/deployments/acme/prod", Some(ACME), None).await;
    assert_eq!(gone.status, StatusCode::NO_CONTENT, "{gone:?}");
    assert_eq!(exec.applied.lock().unwrap()["t/open"], None, "its own bounds again");
    let again = call(&router, "GET", "/v1/deployments/acme/prod", Some(ACME), None).await;
    assert_eq!(again.status, StatusCode::NOT_FOUND);
    service.stop();
}

/// Streams `a` and `b`, waits for the gate to open, then streams `c`;
/// notes which gateway ran it.
struct Gated {
    name: &'static str,
    ran: Arc<Mutex<Option<&'static str>>>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Executor for Gated {
    fn execute(&self, _job: Job, sink: Sink, _cancel: CancellationToken) -> ExecFuture {
        let (name, ran, gate) = (self.name, self.ran.clone(), self.gate.clone());
        Box::pin(async move {
            *ran.lock().unwrap() = Some(name);
            sink.started();
            sink.output(json!("a"));
            sink.log("first line");
            sink.output(json!("b"));
            let _open = gate.acquire().await.unwrap();
            sink.output(json!("c"));
            Ok(json!(["a", "b", "c"]))
        })
    }
}

/// Two gateways on one Redis: a prediction runs on whichever claims it,
/// and a client of the other — polling `GET` or following the SSE stream —
/// sees its output while it runs, not only at its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prediction_running_on_one_gateway_streams_through_the_other() {
    let Some(redis) = hangar_redis::LocalRedis::for_test() else { return };
    let ran = Arc::new(Mutex::new(None));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let start_one = |name: &'static str| {
        let backend = Backend::Redis(hangar_redis::Redis::connect(&redis.url()).unwrap());
        let executor = Arc::new(Gated { name, ran: ran.clone(), gate: gate.clone() });
        let config: PredictionsConfig = serde_json::from_value(json!({"lease_s": 5})).unwrap();
        Service::start(&backend, config, vec![model("t/open", None)], keys(), executor, "http://127.0.0.1:9")
            .unwrap()
    };
    let gateways = [("one", start_one("one")), ("two", start_one("two"))];
    let routers: Vec<axum::Router> = gateways.iter().map(|(_, s)| s.router()).collect();
    let created = call(
        &routers[0],
        "POST",
        "/v1/models/t/open/predictions",
        Some(ACME),
        Some(r#"{"input": {"prompt": "hi"}}"#),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{:?}", created.body);
    let id = created.body["id"].as_str().unwrap().to_owned();
    let t = Instant::now();
    let runner = loop {
        if let Some(name) = *ran.lock().unwrap() {
            break name;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "never claimed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let elsewhere = &routers[gateways.iter().position(|(n, _)| *n != runner).unwrap()];

    // Polled through the other gateway: the output so far, still running.
    let t = Instant::now();
    loop {
        let got = call(elsewhere, "GET", &format!("/v1/predictions/{id}"), Some(ACME), None).await;
        if got.body["output"] == json!(["a", "b"]) {
            assert_eq!(got.body["status"], "processing", "{:?}", got.body);
            assert_eq!(got.body["logs"], "first line\n");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no output through the other gateway: {:?}", got.body);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Followed through the other gateway: `a`, `b` and the log line come
    // while it runs (the record keeps output and logs apart: the items
    // first, then the lines); `c` and `done` once the gate opens.
    let req = Request::get(format!("/v1/predictions/{id}/stream"))
        .header("authorization", format!("Bearer {ACME}"))
        .body(Body::empty())
        .unwrap();
    let mut body = elsewhere.clone().oneshot(req).await.unwrap().into_body().into_data_stream();
    let mut text = String::new();
    let mut next = async || {
        use futures::StreamExt;
        let chunk = tokio::time::timeout(Duration::from_secs(10), body.next()).await;
        String::from_utf8(chunk.expect("an event in time").expect("the stream goes on").unwrap().to_vec())
            .unwrap()
    };
    while !(text.contains("data: b") && text.contains("data: first line")) {
        text.push_str(&next().await);
    }
    assert!(!text.contains("data: c") && !text.contains("event: done"), "it is still running: {text}");
    gate.add_permits(1);
    while !text.contains("event: done") {
        text.push_str(&next().await);
    }
    let outputs: Vec<&str> =
        text.split("\n\n").filter(|e| e.contains("event: output")).filter_map(|e| e.lines().last()).collect();
    assert_eq!(outputs, ["data: a", "data: b", "data: c"], "each item once, in order: {text}");
    for (_, s) in &gateways {
        s.stop();
    }
}

/// A forward HTTP proxy on 127.0.0.2 (plain `http` targets, absolute-form
/// requests, one per connection): forwards each to its target and counts
/// them.
async fn forward_proxy() -> (String, Arc<Mutex<Vec<String>>>) {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let noted = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else { continue };
            let noted = noted.clone();
            tokio::spawn(async move {
                let mut client = BufReader::new(client);
                let mut line = String::new();
                client.read_line(&mut line).await.unwrap();
                // `POST http://127.0.0.1:PORT/hook HTTP/1.1`
                let mut words = line.split_whitespace();
                let (method, target) = (words.next().unwrap().to_owned(), words.next().unwrap().to_owned());
                noted.lock().unwrap().push(target.clone());
                let target = url::Url::parse(&target).unwrap();
                let mut head = format!("{method} {} HTTP/1.1\r\n", target.path());
                let mut length = 0;
                loop {
                    let mut header = String::new();
                    client.read_line(&mut header).await.unwrap();
                    if header == "\r\n" {
                        break;
                    }
                    if let Some(v) = header.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                    if !header.to_ascii_lowercase().starts_with("connection:") {
                        head.push_str(&header);
                    }
                }
                head.push_str("connection: close\r\n\r\n");
                let mut body = vec![0; length];
                client.read_exact(&mut body).await.unwrap();
                let addr = format!("{}:{}", target.host_str().unwrap(), target.port().unwrap());
                let mut upstream = tokio::net::TcpStream::connect(addr).await.unwrap();
                upstream.write_all(head.as_bytes()).await.unwrap();
                upstream.write_all(&body).await.unwrap();
                let mut answer = Vec::new();
                upstream.read_to_end(&mut answer).await.unwrap();
                client.get_mut().write_all(&answer).await.unwrap();
            });
        }
    });
    (url, seen)
}

/// With `webhook_proxy` set, webhooks go out through the operator's
/// proxy (which needs no allow-list entry of its own), signed as ever;
/// a destination the guard refuses is refused at creation all the same,
/// and the proxy never sees it.
#[tokio::test(flavor = "multi_thread")]
async fn webhooks_go_through_the_configured_proxy_and_the_guard_still_holds() {
    let (proxy, through) = forward_proxy().await;
    let (hook, seen) = receiver(None).await;
    let config = json!({"webhook_allow": ["127.0.0.1/32"], "webhook_proxy": proxy});
    let s = start(config, vec![model("t/open", None)], keys());
    let router = s.service.router();
    create_with_webhook(&router, ACME, &hook).await;
    let hooks = wait_for(&seen, 1).await;
    assert!(hooks[0].verifies_with(&secret_of(&router, ACME).await), "signed as without a proxy");
    assert_eq!(*through.lock().unwrap(), [hook], "the webhook went through the proxy");
    let refused = json!({"input": {"prompt": "x"}, "webhook": "http://10.0.0.1/hook"}).to_string();
    let a = call(&router, "POST", "/v1/models/t/open/predictions", Some(ACME), Some(&refused)).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{a:?}");
    assert_eq!(through.lock().unwrap().len(), 1);
    // A proxy that is not an http(s) URL is refused at load, named.
    let bad: PredictionsConfig = serde_json::from_value(json!({"webhook_proxy": "socks5://p:1080"})).unwrap();
    let e = bad.validate().unwrap_err();
    assert!(e.to_string().contains("webhook_proxy") && e.to_string().contains("socks5://p:1080"), "{e}");
}

/// A create with an `Idempotency-Key`: its status, whether it was
/// answered as a replay, and its body.
async fn create_keyed(
    router: &axum::Router,
    api_key: &str,
    idempotency_key: &str,
    body: &Value,
) -> (StatusCode, bool, Value) {
    let req = Request::builder()
        .method("POST")
        .uri("/v1/models/t/open/predictions")
        .header("authorization", format!("Bearer {api_key}"))
        .header("content-type", "application/json")
        .header("idempotency-key", idempotency_key)
        .header("prefer", "wait=5")
        .body(Body::from(body.to_string()))
        .unwrap();
    let r = router.clone().oneshot(req).await.unwrap();
    let (status, replayed) = (r.status(), r.headers().get("idempotent-replayed").is_some());
    let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
    (status, replayed, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// Creates repeated with one `Idempotency-Key` make one prediction, run
/// once: the repeats answer it (201, `Idempotent-Replayed: true`), as it
/// stands now, and eight sent at once make one too; another request under the key is refused (422) naming the
/// key and the prediction; another account's same key is its own; a
/// malformed key is a 400 that stores nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_idempotency_key_makes_one_prediction_however_often_it_is_sent() {
    let s = without_private_model();
    let router = s.service.router();
    let body = json!({"input": {"prompt": "x"}});
    let (status, replayed, first) = create_keyed(&router, ACME, "order-42", &body).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false), "{first}");
    assert_eq!(first["status"], "succeeded", "{first}");
    let id = first["id"].as_str().unwrap().to_owned();
    for _ in 0..3 {
        let (status, replayed, again) = create_keyed(&router, ACME, "order-42", &body).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, true), "{again}");
        assert_eq!(again["id"], id.as_str());
        assert_eq!(again["output"], first["output"]);
    }
    let list = call(&router, "GET", "/v1/predictions", Some(ACME), None).await;
    assert_eq!(list.body["results"].as_array().unwrap().len(), 1, "{:?}", list.body);

    // Eight at once under a new key: one prediction, all eight answer it.
    let burst: Vec<_> = (0..8)
        .map(|_| {
            let (router, body) = (router.clone(), body.clone());
            tokio::spawn(async move { create_keyed(&router, ACME, "order-43", &body).await })
        })
        .collect();
    let mut ids = std::collections::BTreeSet::new();
    for b in burst {
        let (status, _, p) = b.await.unwrap();
        assert_eq!(status, StatusCode::CREATED, "{p}");
        ids.insert(p["id"].as_str().unwrap().to_owned());
    }
    assert_eq!(ids.len(), 1, "{ids:?}");
    let list = call(&router, "GET", "/v1/predictions", Some(ACME), None).await;
    assert_eq!(list.body["results"].as_array().unwrap().len(), 2, "{:?}", list.body);

    let other_input = json!({"input": {"prompt": "y"}});
    let (status, _, refused) = create_keyed(&router, ACME, "order-42", &other_input).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{refused}");
    let detail = refused["detail"].as_str().unwrap();
    assert!(detail.contains("order-42") && detail.contains(&id), "{detail}");

    let (status, replayed, theirs) = create_keyed(&router, OTHER, "order-42", &body).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false), "{theirs}");
    assert_ne!(theirs["id"], id.as_str());

    let (status, _, bad) = create_keyed(&router, ACME, "two words", &body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
    assert!(bad["detail"].as_str().unwrap().contains("Idempotency-Key"), "{bad}");
    let list = call(&router, "GET", "/v1/predictions", Some(ACME), None).await;
    assert_eq!(list.body["results"].as_array().unwrap().len(), 2, "{:?}", list.body);
}
