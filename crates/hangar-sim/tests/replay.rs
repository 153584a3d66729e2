//! End-to-end replays on small generated traces: determinism, arrival-mode
//! semantics, sessions, and the errors users can hit.

use hangar_engine::EngineConfig;
use hangar_router::RouterPolicy;
use hangar_sim::synth::{generate, SynthConfig};
use hangar_sim::trace::{read, Trace};
use hangar_sim::{simulate, ArrivalMode, SimConfig, SimError, SimOutput};

fn synth_trace(requests: u32, max_turns: u32, seed: u64) -> Trace {
    let rows =
        generate(&SynthConfig { requests, max_turns, rate: 20.0, seed, ..SynthConfig::default() }).unwrap();
    let text: String = rows.iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect();
    read(&text, "synth.jsonl").unwrap()
}

fn run(trace: &Trace, cfg: &SimConfig) -> SimOutput {
    simulate(trace, cfg, |p| Err(format!("no file {p}"))).unwrap()
}

fn small_engine() -> EngineConfig {
    EngineConfig { num_gpu_blocks: 2048, max_num_seqs: 32, ..EngineConfig::default() }
}

#[test]
fn same_inputs_and_seed_give_byte_identical_reports_with_every_router() {
    let trace = synth_trace(300, 3, 1);
    for router in [RouterPolicy::RoundRobin, RouterPolicy::LeastOutstanding, RouterPolicy::Kv] {
        let cfg = SimConfig { workers: 3, router, engine: small_engine(), seed: 9, ..SimConfig::default() };
        let a = run(&trace, &cfg);
        let b = run(&trace, &cfg);
        assert_eq!(serde_json::to_string(&a.report).unwrap(), serde_json::to_string(&b.report).unwrap());
        assert_eq!(a.requests, b.requests);
        assert_eq!(a.report.completed, 300);
    }
}

#[test]
fn kv_routing_reuses_more_prefix_than_round_robin() {
    let trace = synth_trace(400, 4, 2);
    let base = SimConfig { workers: 4, engine: small_engine(), ..SimConfig::default() };
    let rr = run(&trace, &SimConfig { router: RouterPolicy::RoundRobin, ..base.clone() });
    let kv = run(&trace, &SimConfig { router: RouterPolicy::Kv, ..base });
    assert!(
        kv.report.prefix_cache_reuse_ratio > rr.report.prefix_cache_reuse_ratio,
        "kv {} vs rr {}",
        kv.report.prefix_cache_reuse_ratio,
        rr.report.prefix_cache_reuse_ratio
    );
}

#[test]
fn every_request_completes_with_its_output_length() {
    let trace = synth_trace(200, 3, 3);
    let out = run(
        &trace,
        &SimConfig { workers: 2, router: RouterPolicy::Kv, engine: small_engine(), ..SimConfig::default() },
    );
    for (r, t) in out.requests.iter().zip(&trace.requests) {
        assert_eq!(r.emitted_tokens, t.output_len, "line {}", t.line);
        assert!(r.completed_ms.unwrap() >= r.last_token_ms.unwrap_or(0.0));
        assert!(r.first_token_ms.unwrap() > r.arrival_ms);
        assert!(r.admitted_ms.unwrap() >= r.arrival_ms);
    }
}

#[test]
fn trace_mode_honours_timestamps_and_speedup() {
    let text = "{\"timestamp\": 1000, \"input_length\": 100, \"output_length\": 2}\n\
                {\"timestamp\": 5000, \"input_length\": 100, \"output_length\": 2}\n";
    let trace = read(text, "t.jsonl").unwrap();
    let out = run(&trace, &SimConfig::default());
    assert_eq!((out.requests[0].arrival_ms, out.requests[1].arrival_ms), (0.0, 4000.0), "normalized to 0");
    let fast = run(&trace, &SimConfig { mode: ArrivalMode::Trace { speedup: 4.0 }, ..SimConfig::default() });
    assert_eq!(fast.requests[1].arrival_ms, 1000.0);
}

#[test]
fn concurrency_mode_keeps_n_in_flight_and_ignores_timestamps() {
    let text: String = (0..6)
        .map(|i| {
            format!("{{\"timestamp\": {}, \"input_length\": 64, \"output_length\": 3}}\n", i * 1_000_000)
        })
        .collect();
    let trace = read(&text, "t.jsonl").unwrap();
    let out =
        run(&trace, &SimConfig { mode: ArrivalMode::Concurrency { in_flight: 2 }, ..SimConfig::default() });
    let r = &out.requests;
    assert_eq!((r[0].arrival_ms, r[1].arrival_ms), (0.0, 0.0));
    // Each later request enters exactly when an earlier one completes.
    for k in 2..6 {
        let completions: Vec<f64> = r[..k].iter().map(|x| x.completed_ms.unwrap()).collect();
        assert!(completions.contains(&r[k].arrival_ms), "request {k} arrived at {}", r[k].arrival_ms);
    }
    let in_flight_at = |t: f64| r.iter().filter(|x| x.arrival_ms <= t && x.completed_ms.unwrap() > t).count();
    assert!(r.iter().all(|x| in_flight_at(x.arrival_ms) <= 2));
}

#[test]
fn session_turns_wait_for_the_previous_turn_plus_delay() {
    let text = "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 20, \"session_id\": \"a\", \"hash_ids\": [1, 2]}\n\
                {\"timestamp\": 0, \"input_length\": 1300, \"output_length\": 5, \"session_id\": \"a\", \"delay\": 250, \"hash_ids\": [1, 3, 4]}\n\
                {\"timestamp\": 0, \"input_length\": 64, \"output_length\": 5}\n";
    let trace = read(text, "t.jsonl").unwrap();
    for mode in [ArrivalMode::Trace { speedup: 1.0 }, ArrivalMode::Concurrency { in_flight: 8 }] {
        let out = run(&trace, &SimConfig { mode, ..SimConfig::default() });
        let (first, second) = (&out.requests[0], &out.requests[1]);
        assert_eq!(second.arrival_ms, first.completed_ms.unwrap() + 250.0, "{mode:?}");
        assert_eq!(out.requests[2].arrival_ms, 0.0, "standalone rows do not wait");
    }
    let fast = run(&trace, &SimConfig { mode: ArrivalMode::Trace { speedup: 2.0 }, ..SimConfig::default() });
    assert_eq!(fast.requests[1].arrival_ms, fast.requests[0].completed_ms.unwrap() + 125.0);
}

#[test]
fn azure_traces_replay_without_prefix_sharing() {
    let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,374,44\n2023-11-16 18:15:47.5,396,10\n";
    let trace = read(text, "azure.csv").unwrap();
    let out = run(&trace, &SimConfig { workers: 1, router: RouterPolicy::Kv, ..SimConfig::default() });
    assert_eq!(out.report.completed, 2);
    assert_eq!(out.requests[1].arrival_ms, 1500.0);
    assert_eq!(out.report.prefix_cache_reuse_ratio, 0.0);
}

#[test]
fn oversized_requests_are_rejected_and_counted_not_fatal() {
    let text = "{\"timestamp\": 0, \"input_length\": 100000, \"output_length\": 2}\n\
                {\"timestamp\": 1, \"input_length\": 100, \"output_length\": 2}\n";
    let trace = read(text, "t.jsonl").unwrap();
    let cfg = SimConfig {
        engine: EngineConfig { num_gpu_blocks: 64, ..EngineConfig::default() },
        ..SimConfig::default()
    };
    let out = run(&trace, &cfg);
    assert_eq!((out.report.completed, out.report.rejected), (1, 1));
    assert!(out.requests[0].rejected.as_deref().unwrap().contains("at most 4096"));
}

#[test]
fn bad_configurations_are_clear_errors() {
    let trace = synth_trace(10, 1, 0);
    let err = |cfg: SimConfig| simulate(&trace, &cfg, |_| Err("none".into())).unwrap_err().to_string();
    assert_eq!(
        err(SimConfig { workers: 0, ..SimConfig::default() }),
        "the cluster needs at least one worker (--workers ≥ 1)"
    );
    assert!(err(SimConfig { mode: ArrivalMode::Concurrency { in_flight: 0 }, ..SimConfig::default() })
        .contains("--concurrency"));
    assert!(err(SimConfig { mode: ArrivalMode::Trace { speedup: -1.0 }, ..SimConfig::default() })
        .contains("--speedup"));
    let bad_engine = SimConfig {
        engine: EngineConfig { block_size: 0, ..EngineConfig::default() },
        ..SimConfig::default()
    };
    assert_eq!(err(bad_engine), "engine config field `block_size`: must be at least 1");
    let short = read(
        "{\"timestamp\": 0, \"input_length\": 2000, \"output_length\": 1, \"hash_ids\": [1]}\n",
        "s.jsonl",
    )
    .unwrap();
    let e = simulate(&short, &SimConfig::default(), |_| Err("none".into())).unwrap_err();
    assert!(matches!(e, SimError::Trace(_)));
    assert_eq!(
        e.to_string(),
        "s.jsonl:1: field `hash_ids`: 1 ids of 512 tokens cover fewer than the 2000 input tokens"
    );
}

#[test]
fn kv_event_delay_changes_routing_but_stays_reproducible() {
    let trace = synth_trace(300, 4, 5);
    let cfg = SimConfig {
        workers: 4,
        router: RouterPolicy::Kv,
        engine: small_engine(),
        kv_event_delay_ms: 500.0,
        ..SimConfig::default()
    };
    let a = run(&trace, &cfg);
    assert_eq!(
        serde_json::to_string(&a.report).unwrap(),
        serde_json::to_string(&run(&trace, &cfg).report).unwrap()
    );
    let prompt = run(&trace, &SimConfig { kv_event_delay_ms: 0.0, ..cfg });
    assert_ne!(
        a.requests.iter().map(|r| r.worker).collect::<Vec<_>>(),
        prompt.requests.iter().map(|r| r.worker).collect::<Vec<_>>()
    );
}

#[test]
fn the_sglang_engine_replays_deterministically_too() {
    let trace = synth_trace(300, 3, 4);
    let engine = EngineConfig { scheduler: hangar_engine::SchedulerKind::Sglang, ..small_engine() };
    let cfg = SimConfig { workers: 3, router: RouterPolicy::Kv, engine, ..SimConfig::default() };
    let (a, b) = (run(&trace, &cfg), run(&trace, &cfg));
    assert_eq!(serde_json::to_string(&a.report).unwrap(), serde_json::to_string(&b.report).unwrap());
    assert_eq!(a.report.engine, "sglang");
    assert_eq!(a.report.completed, 300);
    assert!(a.report.prefix_cache_reuse_ratio > 0.3, "{}", a.report.prefix_cache_reuse_ratio);
    for (r, t) in a.requests.iter().zip(&trace.requests) {
        assert_eq!(r.emitted_tokens, t.output_len);
    }
}

/// Dynamo's router-side pending queue: under a burst every worker's
/// prefill backlog passes the threshold, so requests wait in the router;
/// each still completes whole, is timed from its arrival in the trace,
/// and the replay stays reproducible. Without the option nothing waits.
#[test]
fn the_router_pending_queue_holds_requests_while_every_worker_is_saturated() {
    let trace = synth_trace(300, 1, 11);
    let cfg = SimConfig {
        workers: 2,
        router: RouterPolicy::Kv,
        engine: small_engine(),
        mode: ArrivalMode::Trace { speedup: 20.0 },
        router_queue: Some(0.5),
        ..SimConfig::default()
    };
    let queued = run(&trace, &cfg);
    assert!(queued.report.router_queued > 0, "a 20× burst saturates two workers");
    assert_eq!(queued.report.completed, 300);
    let direct = run(&trace, &SimConfig { router_queue: None, ..cfg.clone() });
    assert_eq!(direct.report.router_queued, 0);
    for ((q, d), t) in queued.requests.iter().zip(&direct.requests).zip(&trace.requests) {
        assert_eq!(q.emitted_tokens, t.output_len, "line {}", t.line);
        assert_eq!(q.arrival_ms, d.arrival_ms, "timed from its arrival, not from when it was routed");
        assert!(q.admitted_ms.unwrap() >= q.arrival_ms);
    }
    assert_eq!(
        serde_json::to_string(&queued.report).unwrap(),
        serde_json::to_string(&run(&trace, &cfg).report).unwrap()
    );
    let e =
        simulate(&trace, &SimConfig { router_queue: Some(0.0), ..cfg }, |_| Err("none".into())).unwrap_err();
    assert_eq!(e.to_string(), "--router-queue must be a number above 0, got 0");
}
