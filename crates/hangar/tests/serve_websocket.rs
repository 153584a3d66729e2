//! The WebSocket relay end to end: `hangar serve` in front of mock engines
//! whose token stream speaks WebSocket (`GET /v1/ws`), a client on
//! `tungstenite`.

mod common;

use std::net::TcpStream;
use std::time::Duration;

use common::{post, serve};
use serde_json::{json, Value};
use tungstenite::protocol::frame::coding::CloseCode;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

type Client = WebSocket<MaybeTlsStream<TcpStream>>;

/// Three mock models, one GPU each: `t/ws` takes WebSocket connections (one permit,
/// 1 KiB messages), `t/short` too for a second at most, `t/plain` none.
fn config() -> &'static str {
    "[[nodes]]\nid = \"local\"\ngpus = 3\ngpu_memory = \"80GB\"\nvirtual_gpus = true\n\
         [[models]]\nkey = \"t/ws\"\nengine = { kind = \"mock\", preset = \"instant\" }\nsize = \"10GB\"\n\
         min_replicas = 1\nconcurrency = 1\nwebsocket = { max_message_bytes = \"1KiB\" }\n\
         [[models]]\nkey = \"t/short\"\nengine = { kind = \"mock\", preset = \"instant\" }\nsize = \"10GB\"\n\
         min_replicas = 1\nwebsocket = { max_duration_s = 1 }\n\
         [[models]]\nkey = \"t/plain\"\nengine = { kind = \"mock\", preset = \"instant\" }\nsize = \"10GB\"\n\
         min_replicas = 1\n"
}

fn open(url: &str, query: &str) -> Result<Client, tungstenite::Error> {
    let ws = url.replacen("http", "ws", 1);
    tungstenite::connect(format!("{ws}/v1/ws{query}")).map(|(socket, _)| socket)
}

/// The HTTP status a refused upgrade was answered with.
fn refused(url: &str, query: &str) -> u16 {
    match open(url, query) {
        Err(tungstenite::Error::Http(response)) => response.status().as_u16(),
        other => panic!("not refused: {:?}", other.map(|_| ())),
    }
}

fn read_json(socket: &mut Client) -> Value {
    loop {
        match socket.read().unwrap() {
            Message::Text(text) => return serde_json::from_str(text.as_str()).unwrap(),
            Message::Ping(_) | Message::Pong(_) => {}
            other => panic!("not a text message: {other:?}"),
        }
    }
}

/// Reads until the close frame; its code.
fn close_code(socket: &mut Client) -> CloseCode {
    loop {
        match socket.read() {
            Ok(Message::Close(Some(frame))) => return frame.code,
            Ok(_) => {}
            Err(e) => panic!("no close frame: {e}"),
        }
    }
}

fn model_status(url: &str, key: &str) -> Value {
    let status: Value = reqwest::blocking::get(format!("{url}/admin/status")).unwrap().json().unwrap();
    status["models"].as_array().unwrap().iter().find(|m| m["model"] == key).unwrap().clone()
}

fn permits_used(url: &str) -> u64 {
    model_status(url, "t/ws")["permits"]["used"].as_u64().unwrap()
}

#[test]
fn a_websocket_is_relayed_holding_its_permit_and_closed_at_its_limits() {
    let s = serve(config());
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    for key in ["t/ws", "t/short"] {
        while model_status(&s.url, key)["ready"] != 1 {
            assert!(std::time::Instant::now() < deadline, "{key} not ready: {}", s.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    // Refused before the upgrade, each with its status.
    assert_eq!(refused(&s.url, ""), 400, "no model named");
    assert_eq!(refused(&s.url, "?model=t/nope"), 404);
    assert_eq!(refused(&s.url, "?model=t/plain"), 400, "a model whose engine speaks none");

    // Relayed both ways: two completions on one connection.
    let mut socket = open(&s.url, "?model=t/ws").unwrap();
    for _ in 0..2 {
        socket.send(Message::text(json!({"prompt": "Hello there", "max_tokens": 3}).to_string())).unwrap();
        let tokens: Vec<Value> = (0..3).map(|_| read_json(&mut socket)).collect();
        assert!(tokens.iter().all(|t| t["type"] == "token" && t["text"].is_string()), "{tokens:?}");
        let done = read_json(&mut socket);
        assert_eq!(
            (done["type"].as_str(), done["usage"]["completion_tokens"].as_u64()),
            (Some("done"), Some(3))
        );
    }
    // The engine's own refusal comes through as a message.
    socket.send(Message::text("not json")).unwrap();
    assert_eq!(read_json(&mut socket)["type"], "error");
    socket.send(Message::text(json!({"prompt": "Hello", "max_tokens": 0}).to_string())).unwrap();
    let refused_ask = read_json(&mut socket);
    assert_eq!(refused_ask["type"], "error");
    assert!(refused_ask["message"].as_str().unwrap().contains("max_tokens"), "{refused_ask}");

    // The connection holds the model's one permit while it is open: a
    // second connection waits for it until the first is closed.
    assert_eq!(permits_used(&s.url), 1);
    let url = s.url.clone();
    let second = std::thread::spawn(move || open(&url, "?model=t/ws"));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!second.is_finished(), "a second connection got in while the permit was held");
    socket.close(None).unwrap();
    while socket.read().is_ok() {}
    let mut socket = second.join().unwrap().unwrap();

    // A message over the limit closes the connection with 1009.
    socket.send(Message::text("x".repeat(4096))).unwrap();
    assert_eq!(close_code(&mut socket), CloseCode::Size);
    drop(socket);
    while permits_used(&s.url) != 0 {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(post(&s.url, None, &common::chat("t/ws", 1)).0, 200, "the permit is back");

    // Its maximum duration closes it with 1008.
    let mut socket = open(&s.url, "?model=t/short").unwrap();
    assert_eq!(close_code(&mut socket), CloseCode::Policy);

    // Each connection is counted once, as what happened to it.
    let metrics = reqwest::blocking::get(format!("{}/metrics", s.url)).unwrap().text().unwrap();
    let count = |model: &str, status: &str| {
        let line = format!("hangar_requests_total{{model=\"{model}\",kind=\"sync\",status=\"{status}\"}}");
        metrics.lines().find_map(|l| l.strip_prefix(&line)).map_or(0.0, |v| v.trim().parse().unwrap())
    };
    // t/ws: the closed connection and the chat (200), the one too big (400).
    assert_eq!((count("t/ws", "200"), count("t/ws", "400")), (2.0, 1.0), "{metrics}");
    assert_eq!(count("t/short", "504"), 1.0, "{metrics}");
}
