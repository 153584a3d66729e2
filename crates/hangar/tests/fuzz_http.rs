//! Fuzzing every route of `hangar serve` through `oneshot` (no socket):
//! random methods, paths, query strings, headers and bodies, built around
//! the real routes so most requests reach a handler.
//!
//! The property: no request is a server fault. A handler that panics is
//! answered 500 by the guard (and counted), so a 500 anywhere fails the
//! run; 502/503/504 are legitimate (the models' engines are `external` at
//! a closed port), and every malformed body gets a 4xx.
//!
//! `PROPTEST_CASES` sets the number of requests per property (default
//! 1,000 in `cargo test`; the issue's figure is taken with 10,000):
//!
//!     PROPTEST_CASES=10000 cargo test -p hangar --test fuzz_http --release -- --nocapture

use std::sync::OnceLock;

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Method, Request, StatusCode};
use hangar_runtime::serve::{ServeConfig, Server};
use proptest::prelude::*;
use tower::ServiceExt;

/// Two models (one private to `acme`), keys for two accounts and an
/// admin, a 4 KiB body limit, engines at a closed port.
const CONFIG: &str = r#"
max_body_bytes = "4KiB"
timeout_floor_s = 2
timeout_ceiling_s = 2
[[nodes]]
id = "n"
gpus = 2
gpu_memory = "80GB"
virtual_gpus = true

[[models]]
key = "f/open"
engine = { kind = "external", url = "http://127.0.0.1:1" }
size = "10GB"
max_replicas = 2

[[models]]
key = "f/private"
engine = { kind = "external", url = "http://127.0.0.1:1" }
size = "10GB"
access = ["acme"]

[[api_keys]]
key = "k-acme"
account = "acme"
[[api_keys]]
key = "k-other"
account = "other"
[[api_keys]]
key = "k-admin"
account = "ops"
admin = true

[predictions]
lease_s = 5
"#;

struct Harness {
    runtime: tokio::runtime::Runtime,
    app: axum::Router,
    _dir: tempfile::TempDir,
}

/// One server for every case of every property in this binary.
fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let config = ServeConfig::from_toml(CONFIG, "fuzz").unwrap();
        let limit = config.max_body_bytes.bytes() as usize;
        let app = runtime.block_on(async {
            let mut config = config;
            let predictions = std::mem::take(&mut config.predictions);
            let server = Server::start(config, env!("CARGO_BIN_EXE_hangar").into()).await.unwrap();
            let service = server
                .start_predictions(
                    &hangar_predictions::store::Backend::Sqlite(dir.path().into()),
                    predictions,
                    "http://fuzz",
                )
                .await
                .unwrap();
            hangar_gateway::router(&server, &service, limit)
        });
        Harness { runtime, app, _dir: dir }
    })
}

/// Sends `request`; its status.
fn send(request: Request<Body>) -> StatusCode {
    let h = harness();
    let app = h.app.clone();
    h.runtime.block_on(async move { app.oneshot(request).await.unwrap().status() })
}

/// Path segments that stress decoding, lookup and parsing.
fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec!["f", "open", "private", "nope", "f%2Fopen", "f%2Fprivate"]).prop_map(String::from),
        2 => "[a-z0-9]{26}",
        1 => prop::sample::select(vec![
            "..", ".", "%2F", "%00", "%C3%A9", "%ZZ", "%", "é", "a:b", "0000000000000000000000000000002a",
            "f:0000000000000000000000000000002a", "{id}", "%F0%9F%98%80", "x".repeat(300).leak(),
        ])
        .prop_map(String::from),
        1 => "[^/?#]{0,40}".prop_map(|s| urlencode(&s)),
    ]
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every route (its method and template, `{}` standing for a segment).
const ROUTES: &[(&str, &str)] = &[
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{}"),
    ("GET", "/v1/models/{}/{}"),
    ("POST", "/v1/models/{}/{}/predictions"),
    ("GET", "/v1/models/{}/{}/versions"),
    ("GET", "/v1/models/{}/{}/versions/{}"),
    ("POST", "/v1/models/{}/{}/versions/{}/trainings"),
    ("POST", "/v1/predictions"),
    ("GET", "/v1/predictions"),
    ("GET", "/v1/predictions/{}"),
    ("POST", "/v1/predictions/{}/cancel"),
    ("GET", "/v1/trainings"),
    ("GET", "/v1/trainings/{}"),
    ("POST", "/v1/trainings/{}/cancel"),
    ("GET", "/p/{}"),
    ("GET", "/v1/deployments/{}/{}"),
    ("POST", "/v1/deployments/{}/{}/predictions"),
    ("GET", "/v1/webhooks/default/secret"),
    ("POST", "/v1/webhooks/default/secret/rotate"),
    ("GET", "/health"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/admin/status"),
    ("POST", "/admin/evict"),
    ("POST", "/admin/models/{}/{}/scaling"),
    ("PUT", "/admin/models/{}/{}/queue"),
    ("POST", "/admin/models/{}"),
    ("GET", "/{}"),
    ("POST", "/v1/{}/{}"),
];

/// A route's method (now and then another one) and its path.
fn route() -> impl Strategy<Value = (Method, String)> {
    let other =
        prop::sample::select(vec![Method::GET, Method::POST, Method::PUT, Method::DELETE, Method::PATCH]);
    (prop::sample::select(ROUTES), prop::collection::vec(segment(), 4), prop::option::weighted(0.1, other))
        .prop_map(|((method, template), segs, other)| {
            let mut path = String::new();
            let mut segs = segs.into_iter();
            for (i, part) in template.split("{}").enumerate() {
                if i > 0 {
                    path.push_str(&segs.next().unwrap_or_default());
                }
                path.push_str(part);
            }
            (other.unwrap_or_else(|| method.parse().expect("a method")), path)
        })
}

fn query() -> impl Strategy<Value = String> {
    let key = prop::sample::select(vec!["cursor", "wait", "limit", "x", "cursor[]"]);
    let value = prop_oneof![
        prop::sample::select(vec![
            "",
            "a1",
            "b9",
            "a-1",
            "b99999999999999999999",
            "%C3%A9",
            "%ZZ",
            "é",
            "a%C3%A9"
        ])
        .prop_map(String::from),
        any::<String>().prop_map(|s| urlencode(&s)),
    ];
    prop::collection::vec((key, value), 0..3).prop_map(|pairs| {
        if pairs.is_empty() {
            return String::new();
        }
        let joined: Vec<String> = pairs.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!("?{}", joined.join("&"))
    })
}

/// Raw bytes a header value may hold (visible ASCII, space, tab, obs-text).
fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop_oneof![0x20u8..0x7f, 0x80u8..=0xff, Just(b'\t')], 0..60)
}

/// Mostly a valid key of one of the three accounts, else a bad or no one.
fn auth() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        6 => prop::sample::select(vec!["Bearer k-acme", "Bearer k-other", "Bearer k-admin"])
            .prop_map(|s| Some(s.as_bytes().to_vec())),
        1 => prop::sample::select(vec!["Token k-acme", "Bearer ", "Basic x", "Bearer k-nobody"])
            .prop_map(|s| Some(s.as_bytes().to_vec())),
        1 => header_bytes().prop_map(Some),
        1 => Just(None),
    ]
}

fn headers() -> impl Strategy<Value = Vec<(&'static str, Vec<u8>)>> {
    let named = prop_oneof![
        prop_oneof![
            prop::sample::select(vec!["wait", "wait=1", "wait=0", "wait=61", "wait=x", "respond-async"])
                .prop_map(|s| s.as_bytes().to_vec()),
            header_bytes()
        ]
        .prop_map(|v| ("prefer", v)),
        prop_oneof![
            prop::sample::select(vec!["5s", "1m", "0", "4s", "99999999999h", "-1s", "1h30m"])
                .prop_map(|s| s.as_bytes().to_vec()),
            header_bytes()
        ]
        .prop_map(|v| ("cancel-after", v)),
        header_bytes().prop_map(|v| ("content-type", v)),
        header_bytes().prop_map(|v| ("user-agent", v)),
        header_bytes().prop_map(|v| ("x-request-id", v)),
    ];
    prop::collection::vec(named, 0..4)
}

/// JSON bodies near what the routes expect, with random values.
fn json_body() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(serde_json::Value::from),
        ".{0,20}".prop_map(serde_json::Value::from),
        prop::sample::select(vec![
            "f/open",
            "f/private",
            "nope",
            "f/open:x",
            "http://127.0.0.1:9/h",
            "http://169.254.169.254/",
            "fair",
            "fifo"
        ])
        .prop_map(serde_json::Value::from),
    ];
    let value = leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            prop::collection::btree_map(
                prop::sample::select(vec!["prompt", "max_tokens", "content", "role", "x", "stream"])
                    .prop_map(String::from),
                inner,
                0..4
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    });
    let field = prop::sample::select(vec![
        "model",
        "messages",
        "prompt",
        "input",
        "max_tokens",
        "stream",
        "webhook",
        "webhook_events_filter",
        "version",
        "destination",
        "replicas",
        "algorithm",
        "capacity",
        "replica",
        "temperature",
    ]);
    prop::collection::btree_map(field.prop_map(String::from), value, 0..6)
        .prop_map(|m| serde_json::Value::Object(m.into_iter().collect()))
}

fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => json_body().prop_map(|v| serde_json::to_vec(&v).unwrap()),
        1 => prop::collection::vec(any::<u8>(), 0..200),
        1 => Just(Vec::new()),
        1 => Just(vec![b'['; 5000]),
    ]
}

/// `PROPTEST_CASES`, else 1,000.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000)
}

fn request(
    method: Method,
    uri: &str,
    headers: &[(&'static str, Vec<u8>)],
    body: Vec<u8>,
) -> Option<Request<Body>> {
    let mut b = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        b = b.header(HeaderName::from_static(name), HeaderValue::from_bytes(value).ok()?);
    }
    b.body(Body::from(body)).ok()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    /// Any request on any route: an answer, never a server fault.
    #[test]
    fn no_request_is_answered_as_a_server_fault(
        (method, path) in route(), query in query(), auth in auth(), mut headers in headers(), body in body(),
    ) {
        let uri = format!("{path}{query}");
        headers.extend(auth.map(|a| ("authorization", a)));
        if let Some(request) = request(method.clone(), &uri, &headers, body) {
            let status = send(request);
            prop_assert!(
                status != StatusCode::INTERNAL_SERVER_ERROR && status != StatusCode::NOT_IMPLEMENTED,
                "{method} {uri} with {headers:?} answered {status}"
            );
        }
    }

    /// A body that is not a JSON object, on every route that takes one: 4xx.
    #[test]
    fn every_malformed_body_gets_a_4xx(
        route in prop::sample::select(vec![
            "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/predictions",
            "/v1/models/f/open/predictions", "/v1/deployments/f/open/predictions", "/admin/evict",
            "/admin/models/f/open/scaling",
        ]),
        key in prop::sample::select(vec!["k-acme", "k-admin"]),
        body in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..100).prop_filter("not JSON", |b| serde_json::from_slice::<serde_json::Value>(b).is_err()),
            Just(b"[1, 2]".to_vec()), Just(b"\"text\"".to_vec()), Just(b"null".to_vec()), Just(b"17".to_vec()),
            Just(vec![b' '; 5000]),
        ],
    ) {
        let request = Request::post(route)
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(Body::from(body.clone()))
            .unwrap();
        let status = send(request);
        prop_assert!(status.is_client_error(), "POST {route} {:?} answered {status}", String::from_utf8_lossy(&body));
    }
}

/// `/metrics` counts handler panics (none here), and every answer carries
/// its request id.
#[test]
fn the_panic_counter_is_exposed_and_zero() {
    let request =
        Request::get("/metrics").header("authorization", "Bearer k-admin").body(Body::empty()).unwrap();
    let h = harness();
    let app = h.app.clone();
    let text = h.runtime.block_on(async move {
        let r = app.oneshot(request).await.unwrap();
        assert!(r.headers().contains_key("x-request-id"));
        let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        String::from_utf8(bytes.to_vec()).unwrap()
    });
    let line = text.lines().find(|l| l.starts_with("hangar_http_panics_total")).expect("the panic counter");
    assert!(line.ends_with(" 0"), "{line}");
}
