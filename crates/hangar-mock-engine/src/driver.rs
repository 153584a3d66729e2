//! The real-time driver: one task owns the [`EngineCore`] and steps it on
//! the wall clock, the way the simulator steps it on a logical one.
//!
//! HTTP handlers talk to it through a [`Command`] channel and receive each
//! request's progress on a channel of their own. The loop: take every queued
//! command; if the engine has work, step it at `now`, sleep until the pass
//! ends, then deliver the pass's tokens and completions; otherwise wait for
//! the next command. Requests that arrive during a pass join the next one,
//! exactly as in the simulator, so concurrent requests are batched and
//! tokens come out on the core's pass timing.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use hangar_core::RequestId;
use hangar_engine::{EngineCore, EngineRequest, Pass, Prompt};
use tokio::sync::{mpsc, oneshot, watch};

use crate::metrics::Metrics;

/// How far behind the wall the driver may be and still start a pass where
/// the last one ended (ms): a timer's lateness, not an overloaded machine.
const SLACK_MS: f64 = 5.0;

/// What a request's owner hears about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Output token `index` was produced.
    Token(u32),
    /// The request finished; no more messages follow.
    Done {
        /// Prompt tokens served from the prefix cache.
        cached_tokens: u32,
    },
    /// The engine refused the request; no more messages follow.
    Refused(String),
}

/// A message to the engine task.
#[derive(Debug)]
pub enum Command {
    /// Run a request, reporting to `progress`.
    Submit {
        /// Unique among live requests.
        id: RequestId,
        /// The tokenized prompt.
        prompt: Prompt,
        /// Tokens to generate.
        max_tokens: u32,
        /// Where progress goes; dropping the receiver aborts the request.
        progress: mpsc::UnboundedSender<Progress>,
    },
    /// Stop stepping and drop the prefix cache (vLLM's sleep mode).
    Sleep {
        /// `Err` with the number of requests in flight if not idle.
        reply: oneshot::Sender<Result<(), usize>>,
    },
    /// Resume after [`Command::Sleep`].
    Wake {
        /// Answered once awake.
        reply: oneshot::Sender<()>,
    },
}

struct Live {
    progress: mpsc::UnboundedSender<Progress>,
    cached_tokens: u32,
}

/// Runs the engine until every command sender is dropped. `asleep` mirrors
/// the sleep state for the HTTP layer; `wake_delay` models reloading weights.
pub async fn run(
    mut engine: EngineCore,
    mut commands: mpsc::UnboundedReceiver<Command>,
    asleep: watch::Sender<bool>,
    wake_delay: Duration,
    metrics: Metrics,
) {
    let epoch = Instant::now();
    let mut live: HashMap<RequestId, Live> = HashMap::new();
    let mut pass = Pass::default();
    let mut sleeping = false;
    // When the last pass ended on the engine's clock, if the engine has
    // been busy since.
    let mut last_end: Option<f64> = None;
    loop {
        if sleeping || !engine.has_work() {
            last_end = None;
            let Some(cmd) = commands.recv().await else { return };
            apply(cmd, &mut engine, &mut live, &mut sleeping, &asleep, wake_delay, &metrics).await;
        }
        while let Ok(cmd) = commands.try_recv() {
            apply(cmd, &mut engine, &mut live, &mut sleeping, &asleep, wake_delay, &metrics).await;
        }
        if sleeping || !engine.has_work() {
            continue;
        }
        // A pass that follows another at once starts when that one ended
        // on the engine's clock, not when the timer woke us (up to a
        // millisecond late, every pass): as in the simulator, so a busy
        // engine does not fall behind its timing model by a millisecond a
        // pass. Only a driver more than `SLACK_MS` behind the wall (an
        // overloaded machine) steps at the wall.
        let wall = epoch.elapsed().as_secs_f64() * 1000.0;
        let now = match last_end {
            Some(end) if wall - end <= SLACK_MS => end.max(0.0),
            _ => wall,
        };
        engine.step(now, &mut pass);
        if pass.is_idle() {
            last_end = None;
            continue;
        }
        last_end = Some(pass.end_ms);
        let end = epoch + Duration::from_secs_f64(pass.end_ms / 1000.0);
        if end > Instant::now() {
            tokio::time::sleep_until(end.into()).await;
        } else {
            // A zero-time pass (the `instant` preset): tokio's timer would
            // round "now" up to its next millisecond tick, so only let the
            // other tasks run.
            tokio::task::yield_now().await;
        }
        metrics.pass(&pass, engine.num_running(), engine.num_waiting(), engine.kv_usage());
        for a in &pass.admitted {
            if let Some(l) = live.get_mut(&a.request) {
                if a.first {
                    l.cached_tokens = a.reused_tokens;
                }
            }
        }
        for t in &pass.tokens {
            let gone =
                live.get(&t.request).is_some_and(|l| l.progress.send(Progress::Token(t.index)).is_err());
            if gone {
                // The client went away: free its memory now.
                engine.abort(t.request);
                live.remove(&t.request);
                metrics.aborted();
            }
        }
        for id in &pass.completed {
            if let Some(l) = live.remove(id) {
                let _ = l.progress.send(Progress::Done { cached_tokens: l.cached_tokens });
            }
        }
    }
}

async fn apply(
    cmd: Command,
    engine: &mut EngineCore,
    live: &mut HashMap<RequestId, Live>,
    sleeping: &mut bool,
    asleep: &watch::Sender<bool>,
    wake_delay: Duration,
    metrics: &Metrics,
) {
    match cmd {
        Command::Submit { id, prompt, max_tokens, progress } => {
            match engine.add_request(EngineRequest { id, prompt, max_output_tokens: max_tokens }) {
                Ok(()) => {
                    metrics.admitted();
                    live.insert(id, Live { progress, cached_tokens: 0 });
                }
                Err(e) => {
                    let _ = progress.send(Progress::Refused(e.to_string()));
                }
            }
        }
        Command::Sleep { reply } => {
            // Requests whose clients left are still counted until aborted.
            live.retain(|id, l| {
                let open = !l.progress.is_closed();
                if !open {
                    engine.abort(*id);
                }
                open
            });
            if !live.is_empty() {
                let _ = reply.send(Err(live.len()));
                return;
            }
            engine.clear_cache(&mut Vec::new());
            *sleeping = true;
            asleep.send_replace(true);
            let _ = reply.send(Ok(()));
        }
        Command::Wake { reply } => {
            if *sleeping {
                tokio::time::sleep(wake_delay).await;
                *sleeping = false;
                asleep.send_replace(false);
            }
            let _ = reply.send(());
        }
    }
}
