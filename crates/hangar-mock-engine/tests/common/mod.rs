//! What the mock engine's HTTP tests share: a server on a free port, and
//! JSON requests to it.
#![allow(dead_code)] // Each test binary uses its own part.

use hangar_mock_engine::{preset, serve, MockConfig};
use serde_json::Value;
use tokio::net::TcpListener;

/// A server on a free loopback port, stopped when dropped.
pub struct Server {
    pub base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

pub async fn start_with(f: impl FnOnce(&mut MockConfig)) -> Server {
    let mut config = MockConfig::from_preset(&preset("fast").unwrap(), "mock-llm");
    f(&mut config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        serve(config, listener, |_| Err("no files".into()), async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });
    Server { base, stop: Some(stop) }
}

pub async fn start() -> Server {
    start_with(|_| {}).await
}

pub async fn post(s: &Server, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new().post(format!("{}{path}", s.base)).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

pub async fn post_raw(s: &Server, path: &str, body: Vec<u8>) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}{path}", s.base))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A POST whose answer is read as text (vLLM answers its LoRA API's
/// successes in plain text).
pub async fn post_text(s: &Server, path: &str, body: Value) -> (u16, String) {
    let r = reqwest::Client::new().post(format!("{}{path}", s.base)).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.text().await.unwrap())
}

pub async fn get_json(s: &Server, path: &str) -> Value {
    reqwest::get(format!("{}{path}", s.base)).await.unwrap().json().await.unwrap()
}

pub async fn get_text(s: &Server, path: &str) -> String {
    reqwest::get(format!("{}{path}", s.base)).await.unwrap().text().await.unwrap()
}
