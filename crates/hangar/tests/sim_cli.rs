//! `hangar sim` and `hangar trace synth` as a user runs them.

use std::path::Path;
use std::process::{Command, Output};

fn hangar(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hangar")).args(args).output().expect("run hangar")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
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

    let o = hangar(&[
        "sim",
        "compare",
        "--fleet",
        fleet.to_str().unwrap(),
        &trace,
        "--policy",
        "hangar",
        "--policy",
        "replicate",
        "--policy",
        "workers-ai",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = String::from_utf8(o.stdout).unwrap();
    for policy in ["hangar", "replicate", "workers-ai"] {
        let row = table.lines().find(|l| l.split_whitespace().nth(1) == Some(policy));
        assert!(row.is_some_and(|r| r.starts_with("all")), "{policy} missing:\n{table}");
    }

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

    let compare = path("compare.svg");
    let policies = ["--policy", "hangar", "--policy", "replicate", "--policy", "workers-ai"];
    let o =
        hangar(&[&["sim", "compare", "--fleet", fleet, &trace, "--plot", &compare], &policies[..]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&compare).unwrap();
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
    let o =
        hangar(&[&["sim", "compare", "--fleet", fleet, &trace, "--plot", &nowhere], &policies[..]].concat());
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains(&format!("cannot write the plot {nowhere}")), "{}", stderr(&o));
    let o = hangar(&["sim", &trace, "--plot", &svg]);
    assert_eq!(o.status.code(), Some(2), "--plot draws a fleet run");
}
