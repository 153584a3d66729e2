//! `hangar sim` and `hangar trace synth` as a user runs them.

use std::path::Path;
use std::process::{Command, Output};

fn hangar(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hangar")).args(args).output().expect("run hangar")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `hangar sim compare` of the three scaling policies with their
/// defaults, and `extra` flags.
fn compare(fleet: &str, trace: &str, extra: &[&str]) -> Output {
    let args = ["sim", "compare", "--fleet", fleet, trace, "--policy", "hangar", "--policy", "replicate"];
    hangar(&[&args[..], &["--policy", "workers-ai"], extra].concat())
}

fn synth(dir: &Path, extra: &[&str]) -> String {
    let path = dir.join("trace.jsonl").display().to_string();
    let mut args = vec!["trace", "synth", "--requests", "120", "--seed", "3", "--rate", "20", "-o", &path];
    args.extend_from_slice(extra);
    let o = hangar(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    path
}

#[test]
fn synth_then_replay_is_reproducible_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let trace = synth(dir.path(), &[]);
    let run = |name: &str| {
        let json = dir.path().join(name).display().to_string();
        let reqs = dir.path().join(format!("{name}.requests")).display().to_string();
        let o = hangar(&[
            "sim",
            &trace,
            "--workers",
            "3",
            "--router",
            "kv",
            "--num-gpu-blocks",
            "4096",
            "--seed",
            "11",
            "--json",
            &json,
            "--requests-jsonl",
            &reqs,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let table = String::from_utf8(o.stdout).unwrap();
        assert!(table.contains("120 completed of 120"), "{table}");
        assert!(table.contains("TTFT ms"));
        (std::fs::read(json).unwrap(), std::fs::read_to_string(reqs).unwrap())
    };
    let (a, ra) = run("a.json");
    let (b, rb) = run("b.json");
    assert_eq!(a, b);
    assert_eq!(ra, rb);
    assert_eq!(ra.lines().count(), 120);
    let report: serde_json::Value = serde_json::from_slice(&a).unwrap();
    assert_eq!(report["completed"], 120);
    assert!(report["ttft_ms"]["p99"].as_f64().unwrap() >= report["ttft_ms"]["p50"].as_f64().unwrap());
    let synth_again = synth(dir.path(), &[]);
    assert_eq!(std::fs::read(&trace).unwrap(), std::fs::read(synth_again).unwrap());
}

#[test]
fn the_demo_replay_runs_without_arguments() {
    let o = hangar(&["sim", "--workers", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(out.contains("2000 completed of 2000"), "{out}");
    assert!(out.contains("simulated requests per wall second"));
}

#[test]
fn a_broken_trace_line_names_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1}\n{\"timestamp\": 5, \"input_length\": 10, \"output_length\": \"many\"}\n",
    )
    .unwrap();
    let o = hangar(&["sim", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("bad.jsonl:2: field `output_length`: expected a token count"), "{err}");
}

#[test]
fn bad_settings_and_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let trace = synth(dir.path(), &[]);
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "\n").unwrap();
    let cfg = dir.path().join("engine.toml");
    std::fs::write(&cfg, "block_size = 16\nmax_num_seq = 4\n").unwrap();
    let cases: [(&[&str], &str); 5] = [
        (&["sim", &trace, "--workers", "0"], "at least one worker"),
        (&["sim", empty.to_str().unwrap()], "the trace holds no requests"),
        (&["sim", "/nonexistent/trace.jsonl"], "cannot read /nonexistent/trace.jsonl"),
        (&["sim", &trace, "--engine-config", cfg.to_str().unwrap()], "max_num_seq"),
        (&["trace", "synth", "--rate", "0"], "`rate` must be a number above 0"),
    ];
    for (args, want) in cases {
        let o = hangar(args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert!(stderr(&o).contains(want), "{args:?}: {}", stderr(&o));
    }
    let o = hangar(&["sim", &trace, "--router", "random"]);
    assert_eq!(o.status.code(), Some(2), "clap rejects unknown values");
}

#[test]
fn the_router_takes_the_serve_config_spelling_as_an_alias() {
    let dir = tempfile::tempdir().unwrap();
    let trace = synth(dir.path(), &["--max-turns", "1"]);
    let run = |router: &str| {
        let json = dir.path().join(format!("{router}.json"));
        let o = hangar(&["sim", &trace, "--router", router, "--json", json.to_str().unwrap()]);
        assert!(o.status.success(), "{router}: {}", stderr(&o));
        std::fs::read(json).unwrap()
    };
    // One policy, one name in the report, whichever spelling asked for it.
    let kebab = run("round-robin");
    assert_eq!(kebab, run("round_robin"));
    let parsed: serde_json::Value = serde_json::from_slice(&kebab).unwrap();
    assert_eq!(parsed["router"], "round-robin");
    assert_eq!(run("least_outstanding"), run("least-outstanding"));
}

const FLEET: &str = r#"
[[nodes]]
id = "gpu"
count = 2
gpus = 2
gpu_memory = "80GB"
cpu_cache = "100GB"

[[models]]
key = "synth/m0"
size = "16GB"
max_replicas = 3

[[models]]
key = "synth/m1"
size = "16GB"
max_replicas = 2
"#;

#[test]
fn a_fleet_simulates_a_multi_model_trace_and_compares_policies() {
    let dir = tempfile::tempdir().unwrap();
    let trace =
        synth(dir.path(), &["--models", "2", "--pattern", "bursty", "--period-s", "30", "--max-turns", "1"]);
    assert!(std::fs::read_to_string(&trace).unwrap().contains("\"model\":\"synth/m1\""));
    let fleet = dir.path().join("fleet.toml");
    std::fs::write(&fleet, FLEET).unwrap();
    let json = dir.path().join("fleet.json");
    let o = hangar(&["sim", "--fleet", fleet.to_str().unwrap(), &trace, "--json", json.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = String::from_utf8(o.stdout).unwrap();
    assert!(table.contains("synth/m0") && table.contains("good/GPU-h"), "{table}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["total"]["requests"], 120);

    let o = compare(fleet.to_str().unwrap(), &trace, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = String::from_utf8(o.stdout).unwrap();
    for policy in ["hangar", "replicate", "workers-ai"] {
        let row = table.lines().find(|l| l.split_whitespace().nth(1) == Some(policy));
        assert!(row.is_some_and(|r| r.starts_with(policy)), "{policy} missing:\n{table}");
    }
    assert!(
        table.contains("× bound") && table.contains("busy ×") && table.contains("hindsight bound: "),
        "{table}"
    );

    // A row naming a model the fleet does not serve: its line, or skipped.
    let other = dir.path().join("other.jsonl");
    std::fs::write(
        &other,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"model\": \"x/y\"}\n",
    )
    .unwrap();
    let o = hangar(&["sim", "--fleet", fleet.to_str().unwrap(), other.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("other.jsonl:1") && stderr(&o).contains("x/y"), "{}", stderr(&o));
    let o = hangar(&["sim", "--fleet", fleet.to_str().unwrap(), other.to_str().unwrap(), "--skip-unknown"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `hangar trace synth` without `-o` writes to stdout as it draws, and a
/// fleet simulation reads the pipe as it would the file: the same report.
#[test]
fn a_synthetic_trace_piped_into_a_fleet_simulation_is_the_file_replayed() {
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let gen = ["--models", "2", "--max-turns", "3", "--turn-delay-ms", "4000"];
    let trace = synth(dir.path(), &gen);
    let fleet = dir.path().join("fleet.toml");
    std::fs::write(&fleet, FLEET).unwrap();
    let (from_file, from_pipe) = (dir.path().join("file.json"), dir.path().join("pipe.json"));
    let o =
        hangar(&["sim", "--fleet", fleet.to_str().unwrap(), &trace, "--json", from_file.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));

    let bin = env!("CARGO_BIN_EXE_hangar");
    let mut drawn = Command::new(bin)
        .args([&["trace", "synth", "--requests", "120", "--seed", "3", "--rate", "20"][..], &gen].concat())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let o = Command::new(bin)
        .args([
            "sim",
            "--fleet",
            fleet.to_str().unwrap(),
            "/dev/stdin",
            "--json",
            from_pipe.to_str().unwrap(),
        ])
        .stdin(drawn.stdout.take().unwrap())
        .output()
        .unwrap();
    assert!(drawn.wait().unwrap().success());
    assert!(o.status.success(), "{}", stderr(&o));
    let report = |p: &Path| {
        let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
        v.as_object_mut().unwrap().remove("trace");
        v
    };
    let piped = report(&from_pipe);
    assert_eq!(piped["total"]["requests"], 120);
    assert_eq!(piped, report(&from_file));
}

/// With --fleet the fleet file describes the cluster: a flag of the plain
/// replay's own cluster is refused, naming it, instead of being ignored;
/// --skip-unknown means nothing without --fleet.
#[test]
fn sim_fleet_refuses_the_flags_it_would_ignore() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = dir.path().join("fleet.toml");
    std::fs::write(&fleet, FLEET).unwrap();
    let fleet = fleet.to_str().unwrap();
    for flag in [
        &["--workers", "2"][..],
        &["--router", "round-robin"],
        &["--engine", "sglang"],
        &["--max-num-seqs", "4"],
        &["--no-prefix-caching"],
        &["--concurrency", "4"],
        &["--seed", "7"],
        &["--slo-ttft-ms", "500"],
        &["--requests-jsonl", "r.jsonl"],
    ] {
        let o = hangar(&[&["sim", "--fleet", fleet, "trace.jsonl"][..], flag].concat());
        assert_eq!(o.status.code(), Some(2), "{flag:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(flag[0]) && stderr(&o).contains("--fleet"), "{flag:?}: {}", stderr(&o));
    }
    let o = hangar(&["sim", "--skip-unknown"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--fleet"), "{}", stderr(&o));
}

/// What an SVG's `<text>` elements say, trimmed.
fn svg_texts(svg: &str) -> Vec<&str> {
    svg.split("</text>").filter_map(|chunk| chunk.rsplit_once('>')).map(|(_, text)| text.trim()).collect()
}

#[test]
fn plots_draw_the_fleet_over_time_and_the_policies_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let trace =
        synth(dir.path(), &["--models", "2", "--pattern", "bursty", "--period-s", "30", "--max-turns", "1"]);
    let fleet = dir.path().join("fleet.toml");
    std::fs::write(&fleet, FLEET).unwrap();
    let fleet = fleet.to_str().unwrap();
    let path = |name: &str| dir.path().join(name).display().to_string();

    let (svg, json) = (path("fleet.svg"), path("fleet.json"));
    let o = hangar(&["sim", "--fleet", fleet, &trace, "--plot", &svg, "--json", &json]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o), "", "no progress bar when stderr is not a terminal");
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") || text.starts_with("<?xml"), "{}", &text[..100]);
    assert!(text.trim_end().ends_with("</svg>"));
    for model in ["synth/m0", "synth/m1"] {
        assert!(svg_texts(&text).contains(&model), "{model} has no legend entry");
    }
    // The timeline behind the plot is in the report too, every request in
    // one window.
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let windows = report["timeline"].as_array().unwrap();
    assert_eq!(windows.iter().map(|s| s["arrivals"].as_u64().unwrap()).sum::<u64>(), 120);

    let png = path("fleet.png");
    let o = hangar(&["sim", "--fleet", fleet, &trace, "--plot", &png]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG\r\n\x1a\n"));

    let plot = path("compare.svg");
    let o = compare(fleet, &trace, &["--plot", &plot]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&plot).unwrap();
    assert!(text.starts_with("<svg") || text.starts_with("<?xml"), "{}", &text[..100]);
    for policy in ["hangar", "replicate", "workers-ai"] {
        assert!(svg_texts(&text).contains(&policy), "{policy} has no point label");
    }

    // A format it cannot write is refused before anything runs; a file it
    // cannot create is named.
    let pdf = path("fleet.pdf");
    let o = hangar(&["sim", "--fleet", fleet, &trace, "--plot", &pdf]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains(&pdf) && stderr(&o).contains(".svg or .png"), "{}", stderr(&o));
    let nowhere = path("missing/fleet.svg");
    let o = hangar(&["sim", "--fleet", fleet, &trace, "--plot", &nowhere]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains(&format!("cannot write the plot {nowhere}")), "{}", stderr(&o));
    let o = compare(fleet, &trace, &["--plot", &nowhere]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains(&format!("cannot write the plot {nowhere}")), "{}", stderr(&o));
    let o = hangar(&["sim", &trace, "--plot", &svg]);
    assert_eq!(o.status.code(), Some(2), "--plot draws a fleet run");
}

#[test]
fn the_suite_runs_its_synthetic_cases_reproducibly_and_skips_public_traces_it_cannot_find() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("no-traces");
    std::fs::create_dir(&empty).unwrap();
    let run = |name: &str| {
        let out = dir.path().join(name);
        let json = dir.path().join(format!("{name}.json"));
        let o = hangar(&[
            "sim",
            "suite",
            "--scale",
            "0.03",
            "--case",
            "steady",
            "--case",
            "bursty",
            "--case",
            "azure",
            "--traces-dir",
            empty.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
            "--jobs",
            "2",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let err = stderr(&o);
        (String::from_utf8(o.stdout).unwrap(), std::fs::read(json).unwrap(), err, out)
    };
    let (table, a, err, out) = run("a");
    let (_, b, _, _) = run("b");
    assert_eq!(a, b, "the same suite, the same report");
    assert!(err.contains("azure: skipped, azure2023_conv.csv and azure2023_code.csv not found"), "{err}");
    assert!(table.contains("azure: skipped"), "{table}");
    assert!(table.contains("| steady |") && table.contains("| bursty |"), "{table}");
    assert!(table.contains("replicate frontier:") && table.contains("workers-ai frontier:"), "{table}");
    for file in ["steady-hangar.svg", "steady-replicate.svg", "steady-workers-ai.svg", "bursty-frontier.svg"]
    {
        let svg = std::fs::read_to_string(out.join(file)).unwrap();
        assert!(svg.starts_with("<svg"), "{file}");
    }
    let report: serde_json::Value = serde_json::from_slice(&a).unwrap();
    let cases = report["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    for case in cases {
        let bound = case["bound"]["gpu_hours"].as_f64().unwrap();
        let runs = case["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 11, "three defaults and eight other peer settings");
        for r in runs {
            // No run answers 99 % in time on fewer GPU-hours than the bound.
            if r["total"]["slo_attainment"].as_f64().unwrap() >= 0.99 {
                assert!(r["gpu_hours"].as_f64().unwrap() >= bound, "{r}");
            }
        }
    }

    let o = hangar(&["sim", "suite", "--case", "nope"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--case nope: no such case") && stderr(&o).contains("long-load"),
        "{}",
        stderr(&o)
    );
    let o = hangar(&["sim", "suite", "--traces-dir", dir.path().join("nowhere").to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("nowhere: no such directory"), "{}", stderr(&o));
    let o = hangar(&["sim", "suite", "--mooncake", dir.path().join("missing.jsonl").to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("missing.jsonl: no such trace file"), "{}", stderr(&o));
}

/// Two small models that load in about half a second, so a policy can
/// answer nearly every request of a short trace in time, and the knobs of
/// the peers make a difference.
const QUICK_FLEET: &str = r#"
[cold_start]
disk_gbps = 20.0
page_cache_gbps = 40.0
wake_gbps = 50.0
boot_ms = 400

[[nodes]]
id = "gpu"
count = 2
gpus = 2
gpu_memory = "80GB"
cpu_cache = "100GB"

[[models]]
key = "synth/m0"
size = "4GB"
max_replicas = 4
concurrency = 4
slo_ttft_ms = 3000

[[models]]
key = "synth/m1"
size = "2GB"
max_replicas = 4
concurrency = 4
slo_ttft_ms = 3000
"#;

#[test]
fn a_sweep_draws_each_peers_pareto_frontier_and_judges_hangar_against_it() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("bursty.jsonl").display().to_string();
    let o = hangar(&[
        "trace",
        "synth",
        "--requests",
        "400",
        "--seed",
        "3",
        "--rate",
        "3",
        "--models",
        "2",
        "--pattern",
        "bursty",
        "--period-s",
        "30",
        "--max-turns",
        "1",
        "-o",
        &trace,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let fleet = dir.path().join("fleet.toml");
    std::fs::write(&fleet, QUICK_FLEET).unwrap();
    let json = dir.path().join("sweep.json");
    let o = compare(fleet.to_str().unwrap(), &trace, &["--sweep", "--json", json.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = String::from_utf8(o.stdout).unwrap();
    for line in ["replicate@0.125 ", "workers-ai@0.05-0.2 ", "replicate frontier: ", "workers-ai frontier: "]
    {
        assert!(table.contains(line), "{line}:\n{table}");
    }
    assert!(table.contains("best replicate at ≥ ") && table.contains("best workers-ai at ≥ "), "{table}");

    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 11, "three defaults and four more settings of each peer");
    let point = |r: &serde_json::Value| {
        (
            r["label"].as_str().unwrap().to_owned(),
            r["total"]["slo_attainment"].as_f64().unwrap(),
            r["gpu_hours"].as_f64().unwrap(),
        )
    };
    // The knob matters on this trace: the peers' runs differ.
    let spread = |family: &str| {
        let a: Vec<f64> = runs.iter().filter(|r| r["family"] == family).map(|r| point(r).1).collect();
        a.iter().cloned().fold(0.0, f64::max) - a.iter().cloned().fold(1.0, f64::min)
    };
    assert!(spread("replicate") > 0.2 && spread("workers-ai") > 0.2, "{table}");
    let bound = &report["bound"];
    for r in runs {
        let (label, attainment, used) = point(r);
        if attainment >= 0.99 {
            assert!(used >= bound["gpu_hours"].as_f64().unwrap(), "{label} below the bound");
            assert!(r["times_bound"].as_f64().unwrap() >= 1.0, "{label}");
        }
        // The time replicas ran requests is part of the whole, and some.
        let busy = r["busy_times_bound"].as_f64().unwrap();
        assert!(busy > 0.0 && busy <= r["times_bound"].as_f64().unwrap(), "{label}: busy {busy}");
        let g = &r["total"]["gpu_seconds"];
        let want = g["busy"].as_f64().unwrap() / 3600.0 / bound["gpu_hours"].as_f64().unwrap();
        assert!((busy - want).abs() < 1e-9, "{label}: busy × bound {busy}, busy GPU-h over the bound {want}");
    }
    for frontier in report["frontiers"].as_array().unwrap() {
        let family = frontier["family"].as_str().unwrap();
        let points: Vec<(String, f64, f64)> = frontier["points"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["label"].as_str().unwrap().to_owned(),
                    p["attainment"].as_f64().unwrap(),
                    p["gpu_hours"].as_f64().unwrap(),
                )
            })
            .collect();
        assert!(!points.is_empty());
        let own: Vec<(String, f64, f64)> = runs.iter().filter(|r| r["family"] == family).map(point).collect();
        // No run of the peer beats a frontier point on both counts, and
        // every run off the frontier is matched or beaten by a point on it.
        for (label, a, g) in &points {
            for (other, oa, og) in &own {
                assert!(
                    !(oa >= a && og <= g && (oa > a || og < g)),
                    "{other} dominates {label} on the frontier"
                );
            }
        }
        for (label, a, g) in &own {
            assert!(
                points.iter().any(|(_, pa, pg)| pa >= a && pg <= g),
                "{label} is neither on the frontier nor beaten"
            );
        }
        // The frontier climbs: more GPU-hours buy more attainment.
        for w in points.windows(2) {
            assert!(w[1].1 > w[0].1 && w[1].2 >= w[0].2, "{points:?}");
        }
    }
    // hangar is judged against the cheapest frontier point at or above its
    // attainment, for each peer.
    let verdict = &report["verdict"];
    let at = verdict["hangar"]["attainment"].as_f64().unwrap();
    for peer in verdict["peers"].as_array().unwrap() {
        let family = peer["family"].as_str().unwrap();
        let cheapest = runs
            .iter()
            .filter(|r| r["family"] == family)
            .map(point)
            .filter(|p| p.1 >= at)
            .map(|p| p.2)
            .fold(f64::INFINITY, f64::min);
        match peer["at_hangars_slo"].as_object() {
            Some(p) => assert_eq!(p["gpu_hours"].as_f64().unwrap(), cheapest, "{family}"),
            None => assert!(cheapest.is_infinite(), "{family}"),
        }
    }
}

/// Many LoRA adapters over two models, as a user would compare routers on
/// them: `trace synth --adapters`, then `sim compare --router`, whose table
/// has a row per policy and router and whose adapter lines count loads; a
/// plain replay of the trace is refused, pointing to --fleet.
#[test]
fn routers_are_compared_on_a_trace_of_many_adapters() {
    let dir = tempfile::tempdir().unwrap();
    let trace = synth(dir.path(), &["--models", "2", "--adapters", "50", "--max-turns", "1"]);
    let text = std::fs::read_to_string(&trace).unwrap();
    assert!(text.contains("\"adapter\":\"lora-") && text.contains("\"adapter_size\":"), "{text}");
    let fleet = dir.path().join("fleet.toml");
    let with_adapters = FLEET.replace("size = \"16GB\"", "size = \"16GB\"\nadapters = { slots = 4 }");
    std::fs::write(&fleet, &with_adapters).unwrap();
    let json = dir.path().join("compare.json");
    let compare = |extra: &[&str]| {
        let fleet = fleet.to_str().unwrap();
        hangar(&[&["sim", "compare", "--fleet", fleet, trace.as_str()][..], extra].concat())
    };
    let routers = ["--policy", "hangar", "--router", "round-robin", "--router", "adapter"];
    let o = compare(&[&routers[..], &["--json", json.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let table = String::from_utf8(o.stdout).unwrap();
    for label in ["hangar/round-robin", "hangar/adapter"] {
        assert!(table.lines().any(|l| l.starts_with(label)), "{label} missing:\n{table}");
        assert!(table.lines().any(|l| l.trim_start().starts_with(label) && l.contains("loads")), "{table}");
    }
    assert!(table.contains("ad loads"), "{table}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs[1]["router"], "adapter");
    assert_eq!(runs[1]["total"]["adapters"]["requests"], 120);
    assert!(runs[0]["total"]["adapters"]["loads"].as_u64().unwrap() > 0);

    // --sweep would mix routers in one frontier: refused, naming both.
    let o = compare(&["--policy", "replicate", "--router", "adapter", "--sweep"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--router") && stderr(&o).contains("--sweep"), "{}", stderr(&o));
    // An unknown router names the ones there are.
    let o = compare(&["--policy", "hangar", "--router", "sticky"]);
    assert!(stderr(&o).contains("kv or adapter"), "{}", stderr(&o));
    // `sim live` would send the rows without their adapters: refused
    // before anything runs.
    let o = hangar(&["sim", "live", &trace, "--fleet", fleet.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("field `adapter`") && stderr(&o).contains("--fleet"), "{}", stderr(&o));
    // A plain replay has no adapter slots.
    let o = hangar(&["sim", &trace]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("field `adapter`") && stderr(&o).contains("--fleet"), "{}", stderr(&o));
    // A fleet whose model loads no adapters names the row.
    let plain = dir.path().join("plain.toml");
    std::fs::write(&plain, FLEET).unwrap();
    let o = hangar(&["sim", "--fleet", plain.to_str().unwrap(), &trace]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("loads no adapters") && stderr(&o).contains(":1:"), "{}", stderr(&o));
}
