//! Independent simulations spread over threads (`sim compare`, `sim
//! suite`): each job runs whole on one thread, and the results come back
//! in the jobs' order, so what is printed does not depend on the thread
//! count or on which run finished first.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressStyle};

/// The threads to use: `asked`, or the machine's cores; at least one and
/// no more than there are jobs.
pub fn threads(asked: Option<usize>, jobs: usize) -> usize {
    asked.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).clamp(1, jobs.max(1))
}

/// `f` of every job on `threads` threads, in the jobs' order. A bar
/// counting finished jobs is drawn on stderr when it is a terminal
/// (`what` names them), and cleared at the end.
pub fn map<J: Sync, R: Send>(jobs: &[J], threads: usize, what: &str, f: impl Fn(&J) -> R + Sync) -> Vec<R> {
    let bar = std::io::stderr().is_terminal().then(|| {
        ProgressBar::new(jobs.len() as u64).with_style(
            ProgressStyle::with_template(&format!("[{{bar:40}}] {{pos}}/{{len}} {what}, {{eta}} left"))
                .expect("a valid template")
                .progress_chars("=> "),
        )
    });
    let results: Vec<Mutex<Option<R>>> = jobs.iter().map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let done = f(job);
                *results[i].lock().expect("no thread panics holding it") = Some(done);
                if let Some(bar) = &bar {
                    bar.inc(1);
                }
            });
        }
    });
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    results.into_iter().map(|m| m.into_inner().expect("not poisoned").expect("every job ran")).collect()
}
