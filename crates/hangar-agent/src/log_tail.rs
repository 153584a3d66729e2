//! What an engine prints: passed on to this process's stderr line by
//! line, as the engine would have printed it there itself, and its last
//! [`LogTail::BYTES`] kept — so a start that fails says what the engine
//! printed last (the Python traceback, the CUDA error), and a start report
//! carries the tail of a start that went well (seed 001's setup report:
//! status, timestamps, phases, log tail).
//!
//! The engine writes into pipes this process drains at once, so it never
//! blocks on a full pipe; a line longer than the tail keeps its end.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;

/// The last lines an engine printed, at most [`LogTail::BYTES`] of them.
/// Cheap to clone: clones read the same tail.
#[derive(Debug, Clone)]
pub struct LogTail(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    lines: Mutex<Lines>,
    /// Outputs still being read.
    open: watch::Sender<usize>,
}

impl Default for LogTail {
    fn default() -> Self {
        LogTail(Arc::new(Shared { lines: Mutex::default(), open: watch::Sender::new(0) }))
    }
}

#[derive(Debug, Default)]
struct Lines {
    lines: VecDeque<String>,
    bytes: usize,
}

impl LogTail {
    /// The most of an engine's output a tail keeps: enough for a
    /// traceback, small enough to travel in every start report.
    pub const BYTES: usize = 8 * 1024;

    /// Has `cmd`'s stdout and stderr piped, for [`LogTail::follow`] (call
    /// before spawning it).
    pub fn pipe(cmd: &mut Command) {
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    }

    /// Follows the piped stdout and stderr of `child` (each taken from it)
    /// until the engine closes them.
    pub fn follow(child: &mut Child) -> LogTail {
        let tail = LogTail::default();
        if let Some(out) = child.stdout.take() {
            tail.follow_reader(out);
        }
        if let Some(err) = child.stderr.take() {
            tail.follow_reader(err);
        }
        tail
    }

    /// Follows `reader`, one more output of the engine, on a task of its
    /// own that ends when the engine closes it.
    pub fn follow_reader(&self, reader: impl AsyncRead + Unpin + Send + 'static) {
        let tail = self.clone();
        self.0.open.send_modify(|n| *n += 1);
        tokio::spawn(async move {
            // Counted closed however the task ends.
            struct Closed(LogTail);
            impl Drop for Closed {
                fn drop(&mut self) {
                    self.0 .0.open.send_modify(|n| *n -= 1);
                }
            }
            let tail = Closed(tail);
            let mut reader = BufReader::new(reader);
            let mut line = Vec::new();
            let mut stderr = tokio::io::stderr();
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        // Where it went before: this process's stderr.
                        let _ = stderr.write_all(&line).await;
                        tail.0.push(&line);
                    }
                }
            }
        });
    }

    /// Keeps `line` (its end, if longer than the tail), dropping the
    /// oldest lines beyond [`LogTail::BYTES`].
    fn push(&self, line: &[u8]) {
        let line = String::from_utf8_lossy(line);
        let line = line.trim_end_matches(['\n', '\r']);
        let mut from = line.len().saturating_sub(Self::BYTES);
        while !line.is_char_boundary(from) {
            from += 1;
        }
        let line = &line[from..];
        let mut kept = self.0.lines.lock().expect("never poisoned: no panics while held");
        kept.bytes += line.len() + 1;
        kept.lines.push_back(line.to_owned());
        while kept.bytes > Self::BYTES + 1 {
            let Some(old) = kept.lines.pop_front() else { break };
            kept.bytes -= old.len() + 1;
        }
    }

    /// Waits until every output followed has been read to its end — the
    /// engine exited, and what it printed last is in the tail — or
    /// `at_most` has passed (a process it left behind may hold its
    /// outputs open).
    ///
    /// # Cancel safety
    /// Only waits: dropping it changes nothing.
    pub async fn drained(&self, at_most: Duration) {
        let mut open = self.0.open.subscribe();
        let _ = tokio::time::timeout(at_most, open.wait_for(|n| *n == 0)).await;
    }

    /// The tail, one line after the other.
    pub fn text(&self) -> String {
        let kept = self.0.lines.lock().expect("never poisoned: no panics while held");
        let mut text = String::with_capacity(kept.bytes);
        for line in &kept.lines {
            text.push_str(line);
            text.push('\n');
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_tail_keeps_the_last_lines_and_the_end_of_a_long_one() {
        let tail = LogTail::default();
        for i in 0..2_000 {
            tail.push(format!("line {i}\n").as_bytes());
        }
        let text = tail.text();
        assert!(text.len() <= LogTail::BYTES + 1, "{}", text.len());
        assert!(text.ends_with("line 1999\n") && !text.contains("line 0\n"), "{text}");
        assert!(text.starts_with("line "), "whole lines only: {text}");
        let long = format!("start{}end\n", "x".repeat(3 * LogTail::BYTES));
        tail.push(long.as_bytes());
        let text = tail.text();
        assert_eq!(text.len(), LogTail::BYTES + 1, "one line, its end");
        assert!(text.ends_with("xxend\n"));
    }

    #[tokio::test]
    async fn an_engines_output_is_followed_until_it_closes() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo to-stdout; echo to-stderr >&2; printf 'no newline'"]);
        LogTail::pipe(&mut cmd);
        let mut child = cmd.spawn().unwrap();
        let tail = LogTail::follow(&mut child);
        child.wait().await.unwrap();
        tail.drained(Duration::from_secs(60)).await;
        let text = tail.text();
        assert!(
            text.contains("to-stdout\n") && text.contains("to-stderr\n") && text.ends_with("no newline\n"),
            "{text}"
        );
    }
}
