//! Records each request's timeline as the replay runs and turns the records
//! into a [`Report`] at the end.

use hangar_engine::Pass;

use crate::driver::{ArrivalMode, SimConfig, SimOutput};
use crate::report::{Goodput, Report, RequestRecord, WorkerReport};
use crate::stats::{LogHistogram, Stats};
use crate::trace::Trace;

#[derive(Debug, Default, Clone)]
struct WorkerTally {
    requests: u64,
    passes: u64,
    busy_ms: f64,
    preemptions: u64,
}

/// The part of a request's record that each of its tokens updates, kept
/// apart in a small dense array: the requests in flight are mostly close in
/// trace order, so theirs share cache lines, where their full records would
/// not.
#[derive(Debug, Default, Clone, Copy)]
struct TokenTally {
    /// When its first token came (meaningful once `emitted > 0`).
    first_ms: f64,
    /// When its latest token came (likewise).
    last_ms: f64,
    emitted: u32,
}

/// The running tallies of a replay.
#[derive(Debug)]
pub(crate) struct Collector {
    records: Vec<RequestRecord>,
    tokens: Vec<TokenTally>,
    itl: LogHistogram,
    workers: Vec<WorkerTally>,
    /// Requests that waited in the router's pending queue.
    router_queued: u64,
}

impl Collector {
    pub fn new(trace: &Trace, workers: u32) -> Self {
        let records: Vec<RequestRecord> = trace
            .requests
            .iter()
            .enumerate()
            .map(|(i, r)| RequestRecord {
                index: i as u32,
                line: r.line,
                arrival_ms: 0.0,
                admitted_ms: None,
                first_token_ms: None,
                last_token_ms: None,
                completed_ms: None,
                ttft_ms: None,
                mean_itl_ms: None,
                e2e_ms: None,
                input_tokens: r.input_len,
                output_tokens: r.output_len,
                emitted_tokens: 0,
                reused_tokens: 0,
                worker: 0,
                preemptions: 0,
                rejected: None,
            })
            .collect();
        Self {
            tokens: vec![TokenTally::default(); records.len()],
            records,
            itl: LogHistogram::default(),
            workers: vec![WorkerTally::default(); workers as usize],
            router_queued: 0,
        }
    }

    /// A request waits in the router's pending queue before it is routed.
    pub fn router_queued(&mut self) {
        self.router_queued += 1;
    }

    pub fn arrived(&mut self, i: u32, now: f64, worker: u32) {
        let r = &mut self.records[i as usize];
        r.arrival_ms = now;
        r.worker = worker;
        self.workers[worker as usize].requests += 1;
    }

    pub fn rejected(&mut self, i: u32, why: String) {
        self.records[i as usize].rejected = Some(why);
    }

    /// Everything a finished pass did: admissions at its start, tokens and
    /// completions at its end.
    pub fn pass(&mut self, worker: u32, pass: &Pass) {
        let tally = &mut self.workers[worker as usize];
        tally.passes += 1;
        tally.busy_ms += pass.end_ms - pass.start_ms;
        tally.preemptions += pass.preempted.len() as u64;
        for a in &pass.admitted {
            let r = &mut self.records[a.request.0 as usize];
            if a.first {
                r.admitted_ms = Some(pass.start_ms);
                r.reused_tokens = a.reused_tokens;
            }
        }
        for p in &pass.preempted {
            self.records[p.0 as usize].preemptions += 1;
        }
        let end = pass.end_ms;
        // Equal consecutive gaps (the decode tokens of one pass mostly
        // share theirs) go into the histogram as one run.
        let (mut gap, mut run) = (0.0f64, 0);
        for t in &pass.tokens {
            let k = &mut self.tokens[t.request.0 as usize];
            if k.emitted == 0 {
                k.first_ms = end;
            } else {
                let g = end - k.last_ms;
                if g.to_bits() != gap.to_bits() {
                    self.itl.add_many(gap, run);
                    (gap, run) = (g, 0);
                }
                run += 1;
            }
            k.last_ms = end;
            k.emitted += 1;
        }
        self.itl.add_many(gap, run);
        for c in &pass.completed {
            self.records[c.0 as usize].completed_ms = Some(end);
        }
    }

    pub fn finish(mut self, cfg: &SimConfig, trace: &Trace) -> SimOutput {
        for (r, k) in self.records.iter_mut().zip(&self.tokens) {
            if k.emitted > 0 {
                r.first_token_ms = Some(k.first_ms);
                r.last_token_ms = Some(k.last_ms);
                r.emitted_tokens = k.emitted;
            }
        }
        let (mut ttft, mut tpot, mut e2e, mut per_user) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut input, mut output, mut reused, mut completed, mut rejected) = (0u64, 0u64, 0u64, 0u64, 0u64);
        let mut duration: f64 = 0.0;
        let mut good = 0u64;
        for r in &mut self.records {
            if r.rejected.is_some() {
                rejected += 1;
                continue;
            }
            let Some(done) = r.completed_ms else { continue };
            completed += 1;
            duration = duration.max(done);
            input += u64::from(r.input_tokens);
            output += u64::from(r.emitted_tokens);
            reused += u64::from(r.reused_tokens);
            r.e2e_ms = Some(done - r.arrival_ms);
            e2e.push(done - r.arrival_ms);
            r.ttft_ms = r.first_token_ms.map(|f| f - r.arrival_ms);
            if let Some(t) = r.ttft_ms {
                ttft.push(t);
            }
            if let (Some(first), Some(last)) = (r.first_token_ms, r.last_token_ms) {
                if r.emitted_tokens >= 2 {
                    let span = last - first;
                    let mean = span / f64::from(r.emitted_tokens - 1);
                    r.mean_itl_ms = Some(mean);
                    tpot.push(mean);
                    if span > 0.0 {
                        per_user.push(f64::from(r.emitted_tokens - 1) * 1000.0 / span);
                    }
                }
            }
            let ok_ttft = cfg.slo.ttft_ms.is_none_or(|slo| r.ttft_ms.is_some_and(|t| t <= slo));
            let ok_itl = cfg.slo.itl_ms.is_none_or(|slo| r.mean_itl_ms.is_none_or(|t| t <= slo));
            good += u64::from(ok_ttft && ok_itl);
        }
        let secs = duration / 1000.0;
        let rate = |n: u64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        let per_worker = self
            .workers
            .iter()
            .enumerate()
            .map(|(w, t)| WorkerReport {
                worker: w as u32,
                requests: t.requests,
                passes: t.passes,
                busy_ms: t.busy_ms,
                utilization: if duration > 0.0 { t.busy_ms / duration } else { 0.0 },
                preemptions: t.preemptions,
            })
            .collect();
        let report = Report {
            trace: trace.source.clone(),
            mode: match cfg.mode {
                ArrivalMode::Trace { speedup } => format!("trace (speedup {speedup})"),
                ArrivalMode::Concurrency { in_flight } => format!("concurrency {in_flight}"),
            },
            router: match cfg.router_queue {
                Some(theta) => {
                    format!("{} with a pending queue at {theta} × max_num_batched_tokens", cfg.router.name())
                }
                None => cfg.router.name().to_owned(),
            },
            router_queued: self.router_queued,
            engine: format!("{:?}", cfg.engine.scheduler).to_lowercase(),
            workers: cfg.workers,
            seed: cfg.seed,
            requests: self.records.len() as u64,
            completed,
            rejected,
            duration_ms: duration,
            requests_per_s: rate(completed),
            input_tokens_per_s: rate(input),
            output_tokens_per_s: rate(output),
            ttft_ms: Stats::exact(ttft),
            tpot_ms: Stats::exact(tpot),
            itl_ms: self.itl.stats(),
            e2e_ms: Stats::exact(e2e),
            output_tokens_per_s_per_user: Stats::exact(per_user),
            prefix_cache_reuse_ratio: if input > 0 { reused as f64 / input as f64 } else { 0.0 },
            goodput: Goodput {
                slo_ttft_ms: cfg.slo.ttft_ms,
                slo_itl_ms: cfg.slo.itl_ms,
                requests: good,
                fraction: if completed > 0 { good as f64 / completed as f64 } else { 0.0 },
                requests_per_s: rate(good),
            },
            per_worker,
        };
        SimOutput { report, requests: self.records }
    }
}
