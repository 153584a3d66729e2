//! What the gateway's tests share: a mock engine in process, a server with
//! its predictions behind the router, and one call through the router.

#![allow(dead_code)] // each test binary uses its own share of it

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use hangar_mock_engine::{preset, MockConfig};
use hangar_predictions::store::Backend;
use hangar_predictions::{PredictionsConfig, Service};
use hangar_runtime::serve::{ServeConfig, Server};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

/// A mock engine with zero compute time serving `model` (`edit` changes
/// its configuration first), on port 0 of loopback, in this process: its
/// base URL.
pub async fn mock_engine(model: &str, edit: impl FnOnce(&mut MockConfig)) -> String {
    let mut config = MockConfig::from_preset(&preset("instant").unwrap(), model);
    edit(&mut config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let never = std::future::pending::<()>();
    tokio::spawn(hangar_mock_engine::serve(config, listener, |_| Err("no tables".into()), never));
    url
}

/// A server on `config` with its predictions (`predictions`, on `backend`)
/// and the gateway's router in front of both.
pub struct Served {
    pub server: Server,
    pub service: Service,
    pub router: Router,
}

/// Starts [`Served`] on `config`.
pub async fn serve(config: ServeConfig, backend: &Backend, predictions: PredictionsConfig) -> Served {
    let server = Server::start(config, Default::default()).await.unwrap();
    let service = server.start_predictions(backend, predictions, "http://test").await.unwrap();
    let router = hangar_gateway::router(&server, &service, 1 << 20);
    Served { server, service, router }
}

impl Served {
    /// Stops the predictions, then the server.
    pub async fn stop(self) {
        self.service.stop();
        self.server.shutdown().await;
    }
}

/// `method path` through `router` as the API key `key` (if any), with the
/// extra `headers` and the JSON `body` (if any): the status and the
/// answer's JSON (`Null` when it is none).
pub async fn call(
    router: &Router,
    method: &str,
    path: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> (StatusCode, Value) {
    let mut request = Request::builder().method(method).uri(path).header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("authorization", format!("Bearer {key}"));
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(body.map_or_else(Body::empty, |b| Body::from(b.to_string()))).unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}
