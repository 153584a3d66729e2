//! Forwarding over keep-alive connections to an engine that closes them,
//! as llama.cpp's server closes idle ones: a request whose pooled
//! connection is lost before an answer goes again on a fresh connection,
//! and the client never sees it.

mod common;

use std::io::{BufReader, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{chat, one_gpu, post, serve};

/// An OpenAI-compatible engine that reads a second POST on a connection
/// and closes it without answering — the request was sent on a connection
/// the engine was closing. Returns its URL and how many it dropped.
fn closing_engine() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let dropped = Arc::new(AtomicUsize::new(0));
    let count = dropped.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let count = count.clone();
            std::thread::spawn(move || {
                let mut writer = stream.try_clone().unwrap();
                let mut reader = BufReader::new(stream);
                let mut posts = 0;
                loop {
                    let Some((line, _)) = common::read_request(&mut reader) else { return };
                    let answer = if line.starts_with("POST") {
                        posts += 1;
                        if posts == 2 {
                            count.fetch_add(1, Ordering::SeqCst);
                            return; // closes the connection, unanswered
                        }
                        (
                            200,
                            r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}"#,
                        )
                    } else if line.starts_with("GET /health ") {
                        (200, "{}")
                    } else {
                        (404, r#"{"error":"no such endpoint"}"#)
                    };
                    let head = format!(
                        "HTTP/1.1 {} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        answer.0,
                        answer.1.len()
                    );
                    if writer
                        .write_all(head.as_bytes())
                        .and_then(|()| writer.write_all(answer.1.as_bytes()))
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (url, dropped)
}

#[test]
fn a_request_on_a_connection_the_engine_closed_goes_again_on_a_fresh_one() {
    let (engine, dropped) = closing_engine();
    let s = serve(&one_gpu(&format!(
        r#"
[[models]]
key = "t/x"
engine = {{ kind = "external", url = "{engine}" }}
size = "10GB"
min_replicas = 1
concurrency = 8
"#
    )));
    // Rounds of eight at once: the first fills the pool, each later one
    // sends on pooled connections the engine then closes.
    for round in 0..4 {
        let runs: Vec<_> = (0..8)
            .map(|_| {
                let url = s.url.clone();
                std::thread::spawn(move || post(&url, None, &chat("t/x", 2)))
            })
            .collect();
        for r in runs {
            let (status, body) = r.join().unwrap();
            assert_eq!(status, 200, "round {round}: {body}");
        }
    }
    let lost = dropped.load(Ordering::SeqCst);
    assert!(lost >= 8, "the engine closed only {lost} pooled connections: the test did not test");
    let metrics = reqwest::blocking::get(format!("{}/metrics", s.url)).unwrap().text().unwrap();
    let retries = format!("hangar_connection_retries_total{{model=\"t/x\"}} {lost}");
    assert!(metrics.contains(&retries), "want `{retries}` in\n{metrics}");
}
