//! The whole-fleet simulation: reproducible, every request accounted for,
//! the controller scaling models up and to zero, bad input named.

use hangar_scaler::{ReplicateSettings, ScalingConfig};
use hangar_sim::fleet::{simulate_fleet, simulate_fleet_rows, FleetConfig, FleetOptions};
use hangar_sim::synth::{self, Pattern, SynthConfig};
use hangar_sim::trace::{self, Trace};

const FLEET: &str = r#"
seed = 3

[[nodes]]
id = "gpu"
count = 2
gpus = 2
gpu_memory = "80GB"
cpu_cache = "200GB"

[[models]]
key = "synth/m0"
size = "16GB"
max_replicas = 4
concurrency = 8
scaling = { policy = "hangar", scale_down_after_s = 20 }

[[models]]
key = "synth/m1"
size = "30GB"
max_replicas = 2
concurrency = 8
scaling = { policy = "hangar", scale_down_after_s = 20 }
"#;

fn synth_trace(requests: u32, pattern: Pattern) -> Trace {
    let rows = synth::generate(&SynthConfig {
        requests,
        rate: 4.0,
        models: 2,
        max_turns: 1,
        pattern,
        period_s: 60.0,
        seed: 5,
        ..SynthConfig::default()
    })
    .unwrap();
    let text: String = rows.iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect();
    trace::read(&text, "synth.jsonl").unwrap()
}

fn fleet() -> FleetConfig {
    FleetConfig::parse(FLEET, "fleet.toml").unwrap()
}

#[test]
fn a_fleet_run_is_reproducible_byte_for_byte_and_accounts_for_every_request() {
    let trace = synth_trace(600, Pattern::Bursty);
    let opts = FleetOptions { sample_ms: 5_000, ..FleetOptions::default() };
    let a = simulate_fleet(&trace, &fleet(), &opts, |_, _| {}).unwrap();
    let b = simulate_fleet(&trace, &fleet(), &opts, |_, _| {}).unwrap();
    assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap());
    let t = &a.total;
    assert_eq!(t.requests, 600);
    assert_eq!(t.completed + t.rejected + t.timed_out + t.failed, 600, "{t:?}");
    assert!(t.completed > 500, "{t:?}");
    assert_eq!(a.models.iter().map(|m| m.requests).sum::<u64>(), 600);
    // Every model started from zero, so the first requests paid a cold start.
    assert!(a.models.iter().all(|m| m.cold_starts.cold >= 1), "{:?}", a.models);
    assert!(t.cold_starts.ms.p50 >= 10_000.0, "boot time alone is 10 s: {:?}", t.cold_starts);
    assert!(t.gpu_seconds.busy > 0.0 && t.gpu_seconds.total >= t.gpu_seconds.busy);
    assert!(t.goodput_per_gpu_hour > 0.0);
    assert!(!a.timeline.is_empty() && a.timeline.iter().all(|s| s.desired.len() == 2));
    assert!(a.table().contains("synth/m0"));
}

#[test]
fn the_timeline_windows_hold_every_arrival_and_progress_reaches_the_total() {
    let trace = synth_trace(400, Pattern::Bursty);
    let opts = FleetOptions { sample_ms: 2_000, ..FleetOptions::default() };
    let mut calls = Vec::new();
    let r = simulate_fleet(&trace, &fleet(), &opts, |done, total| calls.push((done, total))).unwrap();
    let timeline = &r.timeline;
    assert_eq!(timeline.iter().map(|s| s.arrivals).sum::<u64>(), 400);
    assert!(timeline.windows(2).all(|w| w[1].t_s - w[0].t_s == 2.0), "one sample every 2 s");
    assert!(timeline.last().unwrap().t_s <= r.duration_s);
    // A window's p99 is one of the run's TTFTs: within the run's range.
    let windows: Vec<f64> = timeline.iter().filter_map(|s| s.ttft_p99_ms).collect();
    assert!(!windows.is_empty());
    assert!(windows.iter().all(|&p| p >= r.total.ttft_ms.min && p <= r.total.ttft_ms.max), "{windows:?}");
    // Progress: once per request, counting up to the total.
    assert_eq!(calls.len(), 400);
    assert!(calls.iter().enumerate().all(|(i, &(done, total))| done == i + 1 && total == 400));
    // Rows the fleet skips are not load.
    let text = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"model\": \"synth/m0\"}\n\
                {\"timestamp\": 5, \"input_length\": 10, \"output_length\": 2, \"model\": \"acme/other\"}\n";
    let trace = trace::read(text, "t.jsonl").unwrap();
    let opts = FleetOptions { skip_unknown: true, ..opts };
    let r = simulate_fleet(&trace, &fleet(), &opts, |_, _| {}).unwrap();
    assert_eq!(r.timeline.iter().map(|s| s.arrivals).sum::<u64>(), 1);
}

#[test]
fn quiet_models_scale_to_zero_and_wake_from_warm() {
    // Two bursts for one model 100 s apart with silence between: the quiet
    // period (20 s) takes its replicas WARM, the second burst wakes them.
    let mut text = String::new();
    for start in [0, 100_000] {
        for i in 0..60 {
            text.push_str(&format!(
                "{{\"timestamp\": {}, \"input_length\": 500, \"output_length\": 50, \"model\": \"synth/m0\"}}\n",
                start + i * 100
            ));
        }
    }
    let trace = trace::read(&text, "bursts.jsonl").unwrap();
    let report = simulate_fleet(&trace, &fleet(), &FleetOptions::default(), |_, _| {}).unwrap();
    let m0 = &report.models[0];
    assert_eq!(m0.completed, 120, "{m0:?}");
    assert!(m0.warm_seconds > 0.0, "{m0:?}");
    assert!(m0.cold_starts.cold >= 1 && m0.cold_starts.warm >= 1, "{m0:?}");
    // A WARM wake (16 GB at 25 GB/s) is far quicker than a COLD start.
    assert!(m0.cold_starts.ms.min < 1_000.0, "{:?}", m0.cold_starts);
    assert_eq!(report.models[1].requests, 0);
    assert_eq!(report.models[1].gpu_seconds.total, 0.0, "a model nobody asks for holds no GPU");
}

#[test]
fn every_policy_runs_on_the_same_fleet() {
    let trace = synth_trace(300, Pattern::Steady);
    for policy in [
        ScalingConfig::default(),
        ScalingConfig::Replicate(ReplicateSettings::default()),
        ScalingConfig::WorkersAi(Default::default()),
        ScalingConfig::Fixed,
    ] {
        let name = policy.name();
        let opts = FleetOptions { policy: Some(policy), ..FleetOptions::default() };
        let mut fleet = fleet();
        if name == "fixed" {
            // min_replicas = 0 held fixed would never run: refused, naming the field.
            let e = simulate_fleet(&trace, &fleet, &opts, |_, _| {}).unwrap_err().to_string();
            assert!(e.contains("models[0].min_replicas") && e.contains("fixed"), "{e}");
            let text = FLEET
                .replace("max_replicas = 4", "min_replicas = 1\nmax_replicas = 4")
                .replace("max_replicas = 2", "min_replicas = 1\nmax_replicas = 2");
            fleet = FleetConfig::parse(&text, "fleet.toml").unwrap();
        }
        let r = simulate_fleet(&trace, &fleet, &opts, |_, _| {}).unwrap();
        assert_eq!(r.total.policy, name);
        assert_eq!(r.total.requests, 300);
        assert!(r.total.completed > 250, "{name}: {:?}", r.total);
    }
}

#[test]
fn an_unknown_model_is_named_with_its_line_unless_skipped() {
    let text = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"model\": \"synth/m0\"}\n\
                {\"timestamp\": 5, \"input_length\": 10, \"output_length\": 2, \"model\": \"acme/other\"}\n";
    let trace = trace::read(text, "t.jsonl").unwrap();
    let e = simulate_fleet(&trace, &fleet(), &FleetOptions::default(), |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("t.jsonl:2") && e.contains("acme/other") && e.contains("--skip-unknown"), "{e}");
    let opts = FleetOptions { skip_unknown: true, ..FleetOptions::default() };
    let r = simulate_fleet(&trace, &fleet(), &opts, |_, _| {}).unwrap();
    assert_eq!(r.total.requests, 1);
}

/// A streamed file gives the report the trace held in memory gives; a
/// row out of time order, or a bad one, ends the run naming its line.
#[test]
fn a_streamed_trace_runs_as_one_in_memory_and_must_be_in_time_order() {
    let trace = synth_trace(300, Pattern::Bursty);
    let text: String = trace
        .requests
        .iter()
        .map(|r| {
            format!(
                "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": {}, \"hash_ids\": {:?}, \"model\": {:?}}}\n",
                r.timestamp_ms,
                r.input_len,
                r.output_len,
                r.hash_ids,
                r.model.as_deref().unwrap()
            )
        })
        .collect();
    let opts = FleetOptions { sample_ms: 5_000, ..FleetOptions::default() };
    let streamed = |text: &str| {
        let rows = trace::TraceRows::new(text.as_bytes(), "s.jsonl").without_sessions();
        simulate_fleet_rows(rows, "s.jsonl", &fleet(), &opts, |_| {})
    };
    let held = simulate_fleet(&trace, &fleet(), &opts, |_, _| {}).unwrap();
    let mut from_file = streamed(&text).unwrap();
    from_file.trace = held.trace.clone();
    assert_eq!(serde_json::to_string(&held).unwrap(), serde_json::to_string(&from_file).unwrap());

    let backwards = "{\"timestamp\": 50, \"input_length\": 10, \"output_length\": 2, \"model\": \"synth/m0\"}\n\
                     {\"timestamp\": 20, \"input_length\": 10, \"output_length\": 2, \"model\": \"synth/m0\"}\n";
    let e = streamed(backwards).unwrap_err().to_string();
    assert!(
        e.contains("s.jsonl:2")
            && e.contains("timestamp")
            && e.contains("line 1")
            && e.contains("time order"),
        "{e}"
    );
    // Held in memory, the same rows are simply sorted.
    let sorted = simulate_fleet(&trace::read(backwards, "b.jsonl").unwrap(), &fleet(), &opts, |_, _| {});
    assert_eq!(sorted.unwrap().total.requests, 2);
    let broken = format!("{}{{\"timestamp\": 99999999, \"input_length\": 1}}\n", text);
    let e = streamed(&broken).unwrap_err().to_string();
    assert!(e.contains("s.jsonl:301") && e.contains("output_length"), "{e}");
}

#[test]
fn a_model_that_requires_hardware_runs_only_where_it_is_and_no_such_hardware_is_refused() {
    // Two groups of nodes; m1 needs the `h100` one, which has room for it.
    let mixed = FLEET.replace(
        "cpu_cache = \"200GB\"\n",
        "cpu_cache = \"200GB\"\ngpu_kind = \"a100\"\n\n[[nodes]]\nid = \"fast\"\ncount = 1\ngpus = 1\n\
         gpu_memory = \"80GB\"\ngpu_kind = \"h100\"\n",
    );
    let needs = mixed.replace("size = \"30GB\"", "size = \"30GB\"\ngpu_kind = \"h100\"");
    let cfg = FleetConfig::parse(&needs, "f.toml").unwrap();
    let c = hangar_placement::Cluster::new(cfg.cluster()).unwrap();
    let m1: hangar_core::ModelKey = "synth/m1".parse().unwrap();
    let admitted: Vec<String> = c
        .nodes()
        .iter()
        .filter(|n| c.requirement(&m1).is_some_and(|r| r.admits(n.gpu_kind(), n.gpu_memory())))
        .map(|n| n.id().to_string())
        .collect();
    assert_eq!(admitted, ["fast-0"]);
    let report =
        simulate_fleet(&synth_trace(300, Pattern::Steady), &cfg, &FleetOptions::default(), |_, _| {});
    let report = report.unwrap();
    assert_eq!(report.total.requests, 300);
    assert!(report.models[1].cold_starts.cold > 0, "m1 never started");
    let nowhere = mixed.replace("size = \"30GB\"", "size = \"30GB\"\ngpu_kind = \"tpu-v5\"");
    let e = FleetConfig::parse(&nowhere, "f.toml").unwrap_err();
    assert!(e.contains("models[1].gpu_kind") && e.contains("no node has GPUs of kind `tpu-v5`"), "{e}");
}

#[test]
fn fleet_file_errors_name_the_field() {
    let too_big = FLEET.replace("size = \"30GB\"", "size = \"500GB\"");
    let e = FleetConfig::parse(&too_big, "f.toml").unwrap_err();
    assert!(
        e.starts_with("f.toml:20: models[1].size")
            && e.contains("fits on no node")
            && e.contains("needs 7 GPUs"),
        "{e}"
    );
    let e = FleetConfig::parse(&FLEET.replace("count = 2", "count = 0"), "f.toml").unwrap_err();
    assert!(e.contains("nodes[0]"), "{e}");
    let e = FleetConfig::parse(
        &FLEET.replace("scale_down_after_s = 20 }", "scale_down_after_s = -1 }"),
        "f.toml",
    )
    .unwrap_err();
    assert!(e.contains("f.toml") && e.contains("scale_down_after_s"), "{e}");
    let e = FleetConfig::parse(
        &FLEET.replace("max_replicas = 2", "max_replicas = 2\nmin_replicas = 3"),
        "f.toml",
    )
    .unwrap_err();
    assert!(e.contains("models[1].max_replicas"), "{e}");
}

/// A replica still finishing its requests when the controller takes it
/// back from WARM keeps them: every request completes.
#[test]
fn a_draining_replica_wanted_again_keeps_its_requests() {
    // (An objective no request misses: the hold on give-backs while it is
    // missed would keep every replica through the slow first load.)
    let fleet = FleetConfig::parse(
        &FLEET
            .replace("scale_down_after_s = 20 }", "scale_down_after_s = 1 }")
            .replace("size = \"16GB\"", "size = \"16GB\"\nslo_ttft_ms = 600000"),
        "fleet.toml",
    )
    .unwrap();
    let row = |t: u64, out: u32| {
        format!("{{\"timestamp\": {t}, \"input_length\": 100, \"output_length\": {out}, \"model\": \"synth/m0\"}}\n")
    };
    let mut text = String::new();
    for i in 0..24 {
        text.push_str(&row(i, if i % 3 == 0 { 3000 } else { 10 }));
    }
    for i in 0..40 {
        text.push_str(&row(25_000 + i * 50, 10));
    }
    let trace = trace::read(&text, "drain.jsonl").unwrap();
    let r = simulate_fleet(&trace, &fleet, &FleetOptions::default(), |_, _| {}).unwrap();
    let m0 = &r.models[0];
    assert_eq!((m0.requests, m0.completed, m0.failed), (64, 64, 0), "{m0:?}");
    assert!(m0.decisions >= 3, "it scaled up, down and up again: {m0:?}");
    // And on a long, bursty multi-turn trace with a one-second quiet
    // period: many scale-downs while replicas are busy, none loses work.
    let rows = synth::generate(&SynthConfig {
        requests: 3000,
        rate: 3.0,
        models: 2,
        pattern: Pattern::Bursty,
        period_s: 30.0,
        seed: 9,
        ..SynthConfig::default()
    })
    .unwrap();
    let text: String = rows.iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect();
    let trace = trace::read(&text, "bursty.jsonl").unwrap();
    let r = simulate_fleet(&trace, &fleet, &FleetOptions::default(), |_, _| {}).unwrap();
    let t = &r.total;
    assert_eq!(t.completed + t.rejected + t.timed_out, 3000, "{t:?}");
    assert_eq!(t.failed, 0, "{t:?}");
}

#[test]
fn the_example_fleet_parses() {
    let text = include_str!("../../../examples/fleet.toml");
    let fleet = FleetConfig::parse(text, "examples/fleet.toml").unwrap();
    assert_eq!(fleet.models.len(), 4);
}

#[test]
fn every_router_serves_the_fleet_reproducibly() {
    let trace = synth_trace(300, Pattern::Steady);
    for router in hangar_router::RouterPolicy::ALL {
        let text = FLEET.replace("concurrency = 8\n", &format!("concurrency = 8\nrouter = \"{router}\"\n"));
        let cfg = FleetConfig::parse(&text, "fleet.toml").unwrap();
        assert!(cfg.models.iter().all(|m| m.router == router));
        let a = simulate_fleet(&trace, &cfg, &FleetOptions::default(), |_, _| {}).unwrap();
        let b = simulate_fleet(&trace, &cfg, &FleetOptions::default(), |_, _| {}).unwrap();
        assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap(), "{router}");
        assert_eq!(a.total.completed, 300, "{router}");
    }
    let e = FleetConfig::parse(
        &FLEET.replace("concurrency = 8\n", "concurrency = 8\nrouter = \"random\"\n"),
        "f.toml",
    )
    .unwrap_err();
    assert!(e.contains("f.toml") && e.contains("random"), "{e}");
}

/// One node of two GPUs, a 16 GB model: a load from disk takes 8 s + the
/// 10 s boot, one from the page cache 1.6 s + 10 s.
const ONE_NODE: &str = r#"
seed = 1

[cold_start]
disk_gbps = 2.0
page_cache_gbps = 10.0
boot_ms = 10000

[[nodes]]
id = "gpu"
gpus = 2
gpu_memory = "80GB"
cpu_cache = "0GB"

[[models]]
key = "synth/m0"
size = "16GB"
"#;

fn rows(times_ms: &[u64], output: u32) -> Trace {
    let text: String = times_ms
        .iter()
        .map(|t| format!("{{\"timestamp\": {t}, \"input_length\": 100, \"output_length\": {output}}}\n"))
        .collect();
    trace::read(&text, "rows.jsonl").unwrap()
}

/// The page cache holds a model's weights only once a load of it has
/// finished on that node: two replicas that start together both read the
/// disk, a later start on the node reads the page cache.
#[test]
fn the_page_cache_serves_only_loads_that_start_after_one_finished() {
    let text = format!("{ONE_NODE}min_replicas = 2\nmax_replicas = 2\nscaling = {{ policy = \"fixed\" }}\n");
    let cfg = FleetConfig::parse(&text, "fleet.toml").unwrap();
    let r = simulate_fleet(&rows(&[0], 10), &cfg, &FleetOptions::default(), |_, _| {}).unwrap();
    let starts = &r.models[0].cold_starts;
    assert_eq!((starts.cold, starts.warm), (2, 0), "{starts:?}");
    assert_eq!((starts.ms.min, starts.ms.max), (18_000.0, 18_000.0), "both from disk: {starts:?}");

    // With no warm cache, a replica given back goes COLD; the next start
    // on the node, after the first load finished, reads the page cache.
    let text =
        format!("{ONE_NODE}max_replicas = 1\nscaling = {{ policy = \"hangar\", scale_down_after_s = 5 }}\n");
    let cfg = FleetConfig::parse(&text, "fleet.toml").unwrap();
    let r = simulate_fleet(&rows(&[0, 300_000], 10), &cfg, &FleetOptions::default(), |_, _| {}).unwrap();
    let m0 = &r.models[0];
    assert_eq!(m0.completed, 2, "{m0:?}");
    assert_eq!((m0.cold_starts.cold, m0.cold_starts.warm), (2, 0), "{m0:?}");
    assert_eq!((m0.cold_starts.ms.min, m0.cold_starts.ms.max), (11_600.0, 18_000.0), "{m0:?}");
}

/// A second replica of a model on a node where one already runs reads the
/// weights the node's store holds resident (lease-in-place: 16 GB at the
/// 25 GB/s of `wake_gbps`, 0.64 s + the boot), not the page cache.
#[test]
fn a_replica_beside_a_running_one_leases_its_weights_in_place() {
    let text = format!(
        "{ONE_NODE}min_replicas = 1\nmax_replicas = 2\nconcurrency = 1\nscaling = {{ policy = \"hangar\" }}\n"
    );
    let cfg = FleetConfig::parse(&text, "fleet.toml").unwrap();
    // The first replica is up by 18 s; from 30 s four requests a second,
    // each holding the one permit for about a second, need a second one.
    let times: Vec<u64> = [0].into_iter().chain((0..240).map(|k| 30_000 + k * 250)).collect();
    let r = simulate_fleet(&rows(&times, 300), &cfg, &FleetOptions::default(), |_, _| {}).unwrap();
    let starts = &r.models[0].cold_starts;
    assert_eq!((starts.cold, starts.warm), (2, 0), "{starts:?}");
    assert_eq!((starts.ms.min, starts.ms.max), (10_640.0, 18_000.0), "{starts:?}");
}

/// Two one-GPU nodes and one 16 GB model held at one replica.
const TWO_NODES: &str = r#"
seed = 1

[[nodes]]
id = "gpu"
count = 2
gpus = 1
gpu_memory = "80GB"

[[models]]
key = "synth/m0"
size = "16GB"
min_replicas = 1
max_replicas = 1
concurrency = 8
scaling = { policy = "fixed" }
"#;

/// With peers (`peer_gbps`), a replica moved to a node that never loaded
/// the model fetches the weights from the node that did; without, it reads
/// its disk.
#[test]
fn a_node_without_the_weights_fetches_them_from_a_peer_when_the_fleet_has_peers() {
    let base = TWO_NODES.to_owned()
        + r#"
[cold_start]
disk_gbps = 2.0
boot_ms = 10000

# The replica starts on gpu-0 (gpu-1 drained), and moves to gpu-1,
# which never loaded the model, when gpu-0 is drained.
[[drains]]
node = "gpu-1"
from_s = 0
to_s = 30

[[drains]]
node = "gpu-0"
from_s = 60
"#;
    let starts = |text: &str| {
        let cfg = FleetConfig::parse(text, "fleet.toml").unwrap();
        let r = simulate_fleet(&rows(&[0, 120_000], 10), &cfg, &FleetOptions::default(), |_, _| {}).unwrap();
        let s = &r.models[0].cold_starts;
        assert_eq!(s.cold, 2, "{s:?}");
        (s.ms.min, s.ms.max)
    };
    assert_eq!(starts(&base), (18_000.0, 18_000.0), "both from disk");
    let with_peers = base.replace("boot_ms = 10000", "boot_ms = 10000\npeer_gbps = 4.0");
    assert_eq!(starts(&with_peers), (14_000.0, 18_000.0), "16 GB from the peer at 4 GB/s");
    let e = FleetConfig::parse(&base.replace("boot_ms = 10000", "boot_ms = 10000\npeer_gbps = 0"), "f.toml")
        .unwrap_err();
    assert!(e.contains("cold_start.peer_gbps"), "{e}");
}

/// A replica given back before its load finished leaves nothing WARM: no
/// WARM time is booked and the next start is a COLD load from disk (the
/// given-up load put nothing in the page cache either).
#[test]
fn a_replica_given_back_mid_load_leaves_nothing_warm() {
    // 70 GB from disk: 35 s + the 10 s boot. The only request times out
    // after a second, so the model wants nothing long before the load ends.
    let text = ONE_NODE.replace("cpu_cache = \"0GB\"", "cpu_cache = \"200GB\"").replace("16GB", "70GB")
        + "max_replicas = 1\ntimeout_s = 1\nscaling = { policy = \"hangar\", scale_down_after_s = 5 }\n";
    let cfg = FleetConfig::parse(&text, "fleet.toml").unwrap();
    // Then a request a second for 80 s: those after the new load is done
    // are served.
    let times: Vec<u64> = [0].into_iter().chain((0..80).map(|k| 300_000 + k * 1000)).collect();
    let r = simulate_fleet(&rows(&times, 10), &cfg, &FleetOptions::default(), |_, _| {}).unwrap();
    let m0 = &r.models[0];
    assert!(m0.timed_out >= 1 && m0.completed >= 1, "{m0:?}");
    assert!(m0.gpu_seconds.loading < 45.0 + 45.0, "the first load was given up: {m0:?}");
    assert_eq!(m0.warm_seconds, 0.0, "{m0:?}");
    assert_eq!((m0.cold_starts.cold, m0.cold_starts.warm), (1, 0), "the given-up load is no start: {m0:?}");
    assert_eq!(m0.cold_starts.ms.min, 45_000.0, "from disk: {m0:?}");
}

/// `[[drains]]`: an operator's drain tried in the simulator. One model of
/// one replica on two one-GPU nodes, each node drained in turn: the
/// replica moves make-before-break — a second COLD start, every request
/// answered as without the drains, no request waiting through the move —
/// and the run records each drain as the controller's input. A drain naming no node is refused with its line.
#[test]
fn a_drained_nodes_replica_moves_in_the_simulation_and_nothing_is_lost() {
    let base = TWO_NODES;
    let drains = "\n[[drains]]\nnode = \"gpu-0\"\nfrom_s = 100\nto_s = 200\n\n[[drains]]\nnode = \"gpu-1\"\nfrom_s = 300\n";
    let rows = synth::generate(&SynthConfig {
        requests: 1_000,
        rate: 1.5,
        models: 1,
        max_turns: 1,
        pattern: Pattern::Steady,
        seed: 2,
        ..SynthConfig::default()
    })
    .unwrap();
    let text: String = rows.iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect();
    let trace = trace::read(&text, "steady.jsonl").unwrap();
    let opts = FleetOptions { record_control: true, ..FleetOptions::default() };
    let plain =
        simulate_fleet(&trace, &FleetConfig::parse(base, "f.toml").unwrap(), &opts, |_, _| {}).unwrap();
    let cfg = FleetConfig::parse(&format!("{base}{drains}"), "f.toml").unwrap();
    let drained = simulate_fleet(&trace, &cfg, &opts, |_, _| {}).unwrap();
    let (p, d) = (&plain.total, &drained.total);
    assert_eq!(p.cold_starts.cold, 1, "{p:?}");
    assert_eq!(d.cold_starts.cold, 2, "one move (the replica is on one of the nodes at each drain): {d:?}");
    assert_eq!((d.completed, d.timed_out, d.failed), (p.completed, p.timed_out, p.failed), "{d:?}");
    assert_eq!(d.completed, 1_000, "{d:?}");
    // No request waited through a move: the p95 TTFT stays what it is
    // without drains (239 against 218 ms; a replica stopped before its
    // replacement served takes it to 5.5 s).
    assert!(
        d.ttft_ms.p95 < 2.0 * p.ttft_ms.p95,
        "p95 TTFT {} ms against {} ms",
        d.ttft_ms.p95,
        p.ttft_ms.p95
    );
    let recorded: Vec<(String, bool)> = drained
        .control_record
        .iter()
        .filter_map(|i| match i {
            hangar_scaler::Input::Drain { node, on, .. } => Some((node.to_string(), *on)),
            _ => None,
        })
        .collect();
    let want = [("gpu-0", true), ("gpu-0", false), ("gpu-1", true)].map(|(n, on)| (n.to_owned(), on));
    assert_eq!(recorded, want);

    let e = FleetConfig::parse(&format!("{base}{}", drains.replace("gpu-1", "gpu-7")), "f.toml").unwrap_err();
    assert!(e.starts_with("f.toml:") && e.contains("drains[1].node") && e.contains("`gpu-7`"), "{e}");
    let e = FleetConfig::parse(&format!("{base}{}", drains.replace("to_s = 200", "to_s = 50")), "f.toml")
        .unwrap_err();
    assert!(e.contains("drains[0].to_s"), "{e}");
}
