//! LoRA adapters in the whole-fleet simulation: loads paid where an
//! adapter is missing, the `adapter` router keeping adapters where they
//! are, reproducible runs, and rows that cannot run named.

use hangar_router::RouterPolicy;
use hangar_sim::fleet::{simulate_fleet, FleetConfig, FleetOptions, FleetReport};
use hangar_sim::synth::{self, SynthConfig};
use hangar_sim::trace::{self, Trace};

/// Two models of four fixed replicas each, eight adapters a replica.
fn fleet(router: RouterPolicy, adapters: bool) -> FleetConfig {
    FleetConfig::parse(&fleet_text(router, adapters), "fleet.toml").unwrap()
}

fn fleet_text(router: RouterPolicy, adapters: bool) -> String {
    let table = |key: &str| {
        let adapters = if adapters { "adapters = { slots = 8, memory = \"2GB\" }\n" } else { "" };
        format!(
            "[[models]]\nkey = \"{key}\"\nsize = \"1GB\"\nmin_replicas = 4\nmax_replicas = 4\nconcurrency = 16\n\
             scaling = {{ policy = \"fixed\" }}\nrouter = \"{router}\"\n{adapters}"
        )
    };
    format!(
        "seed = 2\n[cold_start]\nboot_ms = 0\n[[nodes]]\nid = \"gpu\"\ncount = 2\ngpus = 4\ngpu_memory = \"80GB\"\n\n{}\n{}",
        table("synth/m0"),
        table("synth/m1")
    )
}

fn synth_trace(cfg: SynthConfig) -> Trace {
    let text: String =
        synth::generate(&cfg).unwrap().iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect();
    trace::read(&text, "synth.jsonl").unwrap()
}

fn adapter_trace(adapters: u32, zipf_s: f64, seed: u64) -> Trace {
    synth_trace(SynthConfig {
        requests: 3_000,
        rate: 6.0,
        models: 2,
        model_zipf_s: 0.0,
        adapters,
        adapter_zipf_s: zipf_s,
        seed,
        ..SynthConfig::default()
    })
}

fn run(trace: &Trace, cfg: &FleetConfig) -> FleetReport {
    simulate_fleet(trace, cfg, &FleetOptions::default(), |_, _| {}).unwrap()
}

#[test]
fn adapter_runs_are_reproducible_and_account_for_every_request_and_load() {
    let trace = adapter_trace(200, 1.0, 4);
    for router in RouterPolicy::ALL {
        let cfg = fleet(router, true);
        let a = run(&trace, &cfg);
        assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&run(&trace, &cfg)).unwrap());
        let (t, ad) = (&a.total, &a.total.adapters);
        assert_eq!(t.completed + t.rejected + t.timed_out + t.failed, 3_000, "{router}: {t:?}");
        assert_eq!(ad.requests, 3_000, "every row names an adapter");
        // Every granted request either found its adapter or waited for it.
        assert_eq!(ad.wait_ms.count, t.completed + t.failed, "{router}: {ad:?}");
        assert!(ad.hits < ad.requests && ad.loads > 0, "{router}: {ad:?}");
        // A replica starts empty: each load that was not the first of its
        // slots pushed another adapter out.
        assert!(ad.unloads <= ad.loads && ad.loads - ad.unloads <= 8 * 8, "{router}: {ad:?}");
        assert_eq!(ad.loads, a.models.iter().map(|m| m.adapters.loads).sum::<u64>());
        assert!(a.table().contains("found theirs loaded"), "{}", a.table());
    }
}

#[test]
fn adapter_routing_loads_less_than_round_robin_on_a_trace_no_one_tuned_on() {
    // Many adapters, a long tail: round robin scatters each adapter over
    // every replica; `adapter` keeps it where it is.
    let trace = adapter_trace(400, 0.9, 17);
    let rr = run(&trace, &fleet(RouterPolicy::RoundRobin, true)).total;
    let ad = run(&trace, &fleet(RouterPolicy::Adapter, true)).total;
    assert!(
        ad.adapters.loads * 3 < rr.adapters.loads * 2,
        "adapter {} loads, round robin {}",
        ad.adapters.loads,
        rr.adapters.loads
    );
    assert!(ad.adapters.hits > rr.adapters.hits, "{:?} vs {:?}", ad.adapters, rr.adapters);
    assert!(ad.ttft_ms.p99 <= rr.ttft_ms.p99 * 1.05, "TTFT p99 {} vs {}", ad.ttft_ms.p99, rr.ttft_ms.p99);
}

#[test]
fn a_load_is_paid_once_and_then_the_adapter_is_there() {
    // One replica; a request without an adapter starts the clock (and
    // waits for the replica's start), then two for one adapter a second
    // apart: the first waits for the load (100 MB at 2 GB/s from disk and
    // the engine's own 300 ms), the second finds it loaded.
    let text = "[cold_start]\nboot_ms = 0\n[[nodes]]\nid = \"gpu\"\ngpus = 1\ngpu_memory = \"80GB\"\n\
                [[models]]\nkey = \"m/a\"\nsize = \"1GB\"\nmin_replicas = 1\nscaling = { policy = \"fixed\" }\n\
                engine = { timing = { model = \"fixed\", prefill_ms = 10, decode_ms = 1 } }\n\
                adapters = { slots = 2 }\n";
    let cfg = FleetConfig::parse(text, "fleet.toml").unwrap();
    let row = |t: u64, adapter: &str| {
        format!("{{\"timestamp\": {t}, \"input_length\": 100, \"output_length\": 1{adapter}}}\n")
    };
    let with = ", \"adapter\": \"acme/x\", \"adapter_size\": 100000000";
    let trace = trace::read(&(row(0, "") + &row(1_000, with) + &row(2_000, with)), "three.jsonl").unwrap();
    let r = run(&trace, &cfg).total;
    assert_eq!(r.completed, 3);
    assert_eq!((r.adapters.requests, r.adapters.loads, r.adapters.hits), (2, 1, 1));
    assert_eq!(r.adapters.wait_ms.max, 350.0, "50 ms of bytes, 300 ms of the engine's work");
    // The replica's start (1 GB from disk, 500 ms) then a 10 ms prefill;
    // the load then a prefill; a prefill alone.
    assert_eq!((r.ttft_ms.max, r.ttft_ms.p50, r.ttft_ms.min), (510.0, 360.0, 10.0));
}

#[test]
fn a_trace_without_adapters_runs_as_before_whatever_the_fleet_says_of_them() {
    let trace = synth_trace(SynthConfig { requests: 800, rate: 5.0, models: 2, ..SynthConfig::default() });
    for router in [RouterPolicy::LeastOutstanding, RouterPolicy::Adapter] {
        let with = run(&trace, &fleet(router, true));
        let without = run(&trace, &fleet(router, false));
        // The same requests served alike; only the GPU memory set aside
        // for adapters (2 GB a replica beside 1 GB of weights) is held.
        for (w, wo) in with.models.iter().zip(&without.models) {
            assert_eq!((w.completed, &w.ttft_ms, &w.e2e_ms), (wo.completed, &wo.ttft_ms, &wo.e2e_ms));
            assert_eq!(w.cold_starts, wo.cold_starts, "the weights alone load");
            let ratio = w.gpu_seconds.total / wo.gpu_seconds.total;
            assert!((ratio - 3.0).abs() < 0.01, "3 GB held against 1 GB: {ratio}");
        }
        assert_eq!(with.total.adapters.requests, 0);
    }
    // And `adapter` routing without adapters is least-outstanding.
    let lo = run(&trace, &fleet(RouterPolicy::LeastOutstanding, false));
    let ad = run(&trace, &fleet(RouterPolicy::Adapter, false));
    assert_eq!(lo.total.ttft_ms, ad.total.ttft_ms);
}

#[test]
fn rows_whose_adapter_cannot_run_name_their_line() {
    let err = |cfg: &FleetConfig, rows: &str| {
        let trace = trace::read(rows, "t.jsonl").unwrap();
        simulate_fleet(&trace, cfg, &FleetOptions::default(), |_, _| {}).unwrap_err().to_string()
    };
    let ok = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"model\": \"synth/m0\"}\n";
    let named = "{\"timestamp\": 1, \"input_length\": 10, \"output_length\": 1, \"model\": \"synth/m0\", \"adapter\": \"x\"}\n";
    assert_eq!(
        err(&fleet(RouterPolicy::Adapter, false), &format!("{ok}{named}")),
        "t.jsonl:2: field `adapter`: model `synth/m0` loads no adapters: give it `[models.adapters]` to serve `synth/m0:x`"
    );
    let huge = "{\"timestamp\": 1, \"input_length\": 10, \"output_length\": 1, \"model\": \"synth/m1\", \"adapter\": \"x\", \"adapter_size\": 3000000000}\n";
    assert_eq!(
        err(&fleet(RouterPolicy::Adapter, true), huge),
        "t.jsonl:1: field `adapter_size`: `synth/m1:x` is 3000000000 bytes, more than the 2.0GB of adapter memory of a replica (`memory`)"
    );
    // The fleet file's adapter settings are checked, naming the field.
    let text = fleet_text(RouterPolicy::Adapter, true).replace("slots = 8", "slots = 0");
    let e = FleetConfig::parse(&text, "fleet.toml").unwrap_err();
    assert!(e.contains("models[0].adapters.slots") && e.contains("at least 1"), "{e}");
}

#[test]
fn hotswap_models_sharing_one_gpu_swap_in_and_out_through_the_warm_cache() {
    // One 80 GB GPU, two 60 GB hotswap models asked for in turns two
    // minutes apart (past `hotswap_min_age_ms`): each takes the GPU from
    // the other, whose copy goes to the warm cache; the second time `m/a`
    // is asked for it is swapped back in, a WARM wake.
    let text = "[cold_start]\nboot_ms = 0\ndisk_gbps = 10.0\n[[nodes]]\nid = \"gpu\"\ngpus = 1\ngpu_memory = \"80GB\"\ncpu_cache = \"200GB\"\n\
                [[models]]\nkey = \"m/a\"\nsize = \"60GB\"\nhotswap = true\n\
                [[models]]\nkey = \"m/b\"\nsize = \"60GB\"\nhotswap = true\n";
    let cfg = FleetConfig::parse(text, "fleet.toml").unwrap();
    let row = |t: u64, model: &str| {
        format!(
            "{{\"timestamp\": {t}, \"input_length\": 100, \"output_length\": 4, \"model\": \"{model}\"}}\n"
        )
    };
    let rows = row(0, "m/a") + &row(120_000, "m/b") + &row(240_000, "m/a");
    let trace = trace::read(&rows, "turns.jsonl").unwrap();
    let r = run(&trace, &cfg);
    assert_eq!(r.total.completed, 3);
    let a = r.models.iter().find(|m| m.model == "m/a").unwrap();
    assert_eq!(
        (a.cold_starts.cold, a.cold_starts.warm, a.cold_starts.swaps),
        (1, 1, 1),
        "{:?}",
        a.cold_starts
    );
    assert_eq!(r.total.cold_starts.swaps, 1);

    // The same models outside the tier: their wakes are not swaps.
    let plain = FleetConfig::parse(&text.replace("hotswap = true\n", ""), "fleet.toml").unwrap();
    let r = run(&trace, &plain);
    assert!(r.total.cold_starts.warm > 0, "{:?}", r.total.cold_starts);
    assert_eq!(r.total.cold_starts.swaps, 0);
}
