//! Scenario files: the example plans as documented, JSON plans like TOML,
//! and malformed files get errors naming the field and the line.

use hangar_placement::scenario::{plan, Format, Scenario, ScenarioError};
use hangar_placement::{CandidateLevel, DeployOutcome, DeploymentDelta, Level};

const EXAMPLE: &str = include_str!("../../../examples/plan.toml");

#[test]
fn the_example_scenario_plans_every_kind_of_decision() {
    let report = plan(EXAMPLE, Format::Toml).unwrap();
    let levels: Vec<CandidateLevel> = report
        .schedule
        .iter()
        .chain([&report.deploy])
        .flat_map(|o| &o.models)
        .flat_map(|m| &m.replicas)
        .map(|r| r.level)
        .collect();
    for level in
        [CandidateLevel::Deployed, CandidateLevel::CachedAndFree, CandidateLevel::Free, CandidateLevel::Full]
    {
        assert!(levels.contains(&level), "{level} missing from {levels:?}");
    }
    let evictions: Vec<(String, Level)> =
        report.all_evictions().map(|e| (e.model_key.to_string(), e.to)).collect();
    assert!(evictions.contains(&("acme/whisper-large".into(), Level::Warm)));
    assert!(evictions.contains(&("mistral/mixtral-8x22b".into(), Level::Warm)));
    assert!(!report.delta.is_empty());
    let table = report.render_table();
    for section in ["decisions:", "evictions:", "delta (apply in order):", "nodes after:"] {
        assert!(table.contains(section), "{section} missing:\n{table}");
    }
    // The same file plans the same way every time.
    assert_eq!(plan(EXAMPLE, Format::Toml).unwrap(), report);
    // What a driver sends on (outcomes, deltas) survives JSON unchanged.
    let json = serde_json::to_string(&report.deploy).unwrap();
    assert_eq!(serde_json::from_str::<DeployOutcome>(&json).unwrap(), report.deploy);
    let json = serde_json::to_string(&report.delta).unwrap();
    assert_eq!(serde_json::from_str::<DeploymentDelta>(&json).unwrap(), report.delta);
}

#[test]
fn a_json_scenario_plans_like_the_same_toml_one() {
    let scenario = Scenario::parse(EXAMPLE, Format::Toml).unwrap();
    let json = serde_json::to_string_pretty(&scenario).unwrap();
    assert_eq!(Format::guess("x.scenario", &json), Format::Json);
    assert_eq!(plan(&json, Format::Json).unwrap(), plan(EXAMPLE, Format::Toml).unwrap());
}

fn toml_err(text: &str) -> ScenarioError {
    plan(text, Format::Toml).unwrap_err()
}

fn json_err(text: &str) -> ScenarioError {
    plan(text, Format::Json).unwrap_err()
}

const NODE: &str = "[[nodes]]\nid = \"a\"\ngpus = 1\ngpu_memory = \"80GB\"\n";

#[test]
fn toml_syntax_errors_give_the_line() {
    let e = toml_err("seed = 1\nnow_ms = \n");
    assert_eq!(e.line, Some(2), "{e}");
    assert!(e.to_string().starts_with("line 2"), "{e}");
}

#[test]
fn wrong_types_and_unknown_fields_name_the_field_and_line() {
    let e = toml_err("[[nodes]]\nid = \"a\"\ngpus = \"eight\"\n");
    assert_eq!((e.path.to_string(), e.line), ("nodes[0].gpus".into(), Some(3)), "{e}");

    let e = toml_err(&format!("{NODE}gpu_mem = \"80GB\"\n"));
    assert_eq!(e.path.to_string(), "nodes[0].gpu_mem", "{e}");
    assert!(e.message.contains("gpu_mem"), "{e}");
    assert_eq!(e.line, Some(5), "{e}");

    let e = toml_err(&format!("{NODE}cpu_cache = \"80 parsecs\"\n"));
    assert_eq!((e.path.to_string(), e.line), ("nodes[0].cpu_cache".into(), Some(5)), "{e}");
    assert!(e.message.contains("unknown unit"), "{e}");

    let e = toml_err(&format!("{NODE}[models.\"bad key\"]\nsize = \"1GB\"\n"));
    assert!(e.message.contains("bad key"), "{e}");
    assert!(e.line.is_some(), "{e}");

    let e = toml_err(&format!(
        "{NODE}[models.m]\nsize = \"1GB\"\n[[deployments]]\nmodel = \"m\"\nnode = \"a\"\nreplica = \"xyz\"\n"
    ));
    assert_eq!((e.path.to_string(), e.line), ("deployments[0].replica".into(), Some(10)), "{e}");
}

#[test]
fn invalid_values_name_the_field_and_line() {
    let e = toml_err("[[nodes]]\nid = \"a\"\ngpus = 4\n");
    assert_eq!(e.path.to_string(), "nodes[0].gpu_memory", "{e}");
    assert!(e.message.contains("required"), "{e}");

    let e = toml_err("[[nodes]]\nid = \"a\"\ngpus = 1\ngpu_memory = \"2000TB\"\n");
    assert_eq!((e.path.to_string(), e.line), ("nodes[0].gpu_memory".into(), Some(4)), "{e}");

    let e = toml_err("[[nodes]]\nid = \"a\"\ngpus = 17\ngpu_memory = \"80GB\"\n");
    assert_eq!((e.path.to_string(), e.line), ("nodes[0].gpus".into(), Some(3)), "{e}");

    let e = toml_err(&format!("{NODE}[[nodes]]\nid = \"a\"\n"));
    assert_eq!((e.path.to_string(), e.line), ("nodes[1].id".into(), Some(6)), "{e}");

    let e = toml_err("[placement]\ngpu_fraction_factor = 0.5\n");
    assert_eq!((e.path.to_string(), e.line), ("placement.gpu_fraction_factor".into(), Some(2)), "{e}");

    let e = toml_err(&format!("{NODE}[models.\"acme/m\"]\nsize = \"1GB\"\nparameters = \"1B\"\n"));
    assert_eq!(e.path.to_string(), "models.\"acme/m\"", "{e}");
    assert_eq!(e.line, Some(5), "{e}");
}

#[test]
fn deployments_that_do_not_fit_the_cluster_are_located() {
    let base = format!("{NODE}[models.m]\nsize = \"20GB\"\n");
    let deployment = |extra: &str| format!("{base}[[deployments]]\nmodel = \"m\"\nnode = \"a\"\n{extra}");

    let e = toml_err(&format!("{base}[[deployments]]\nmodel = \"m\"\nnode = \"zzz\"\n"));
    assert_eq!((e.path.to_string(), e.line), ("deployments[0].node".into(), Some(9)), "{e}");
    assert!(e.message.contains("unknown node `zzz`"), "{e}");

    let e = toml_err(&format!("{base}[[deployments]]\nmodel = \"other\"\nnode = \"a\"\n"));
    assert_eq!((e.path.to_string(), e.line), ("deployments[0].model".into(), Some(8)), "{e}");

    let e = toml_err(&deployment("gpus = [3]\n"));
    assert_eq!((e.path.to_string(), e.line), ("deployments[0].gpus".into(), Some(10)), "{e}");
    assert!(e.message.contains("no GPU 3"), "{e}");

    // Two 60 GB shares do not fit one 80 GB GPU.
    let twice =
        format!("{}[[deployments]]\nmodel = \"m\"\nnode = \"a\"\ngpus = [0]\n", deployment("gpus = [0]\n"));
    let e = toml_err(&twice);
    assert_eq!((e.path.to_string(), e.line), ("deployments[1].gpus".into(), Some(14)), "{e}");

    let e = toml_err(&deployment("level = \"cold\"\n"));
    assert_eq!(e.path.to_string(), "deployments[0].level", "{e}");

    let e = toml_err(&deployment("level = \"lukewarm\"\n"));
    assert_eq!((e.path.to_string(), e.line), ("deployments[0].level".into(), Some(10)), "{e}");
}

#[test]
fn bad_schedules_and_evictions_are_located() {
    let base = format!("{NODE}[models.m]\nsize = \"20GB\"\n");
    let e = toml_err(&format!("{base}[[schedule]]\nmodel = \"m\"\nstart_ms = 10\nend_ms = 5\n"));
    assert_eq!((e.path.to_string(), e.line), ("schedule[0]".into(), Some(7)), "{e}");
    let e = toml_err(&format!("{base}[[evictions]]\nmodel = \"m\"\nreplica = \"{:032x}\"\n", 5));
    assert_eq!((e.path.to_string(), e.line), ("evictions[0].replica".into(), Some(9)), "{e}");
    assert!(e.message.contains("not deployed"), "{e}");
}

#[test]
fn json_errors_name_the_field_and_line() {
    let e = json_err("{\"seed\": 1,\n \"nodes\": [\n");
    assert_eq!(e.line, Some(3), "{e}");

    let e = json_err("{\n  \"nodes\": [\n    {\"id\": \"a\", \"gpus\": -1}\n  ]\n}");
    assert_eq!((e.path.to_string(), e.line), ("nodes[0].gpus".into(), Some(3)), "{e}");

    let e = json_err("{\"seed\": 1} trailing");
    assert!(e.line.is_some(), "{e}");

    // Errors found while planning are located in JSON too, past strings
    // with escapes, nested values and scalars.
    let text = r#"{
  "seed": 3, "now_ms": 1500,
  "nodes": [{"id": "a", "gpus": 1, "gpu_memory": "80GB", "cpu_cache": 0},
            {"id": "b", "gpus": 2, "virtual_gpus": true}],
  "models": {"m": {"size": "20GB"}}
}"#;
    let e = json_err(text);
    assert_eq!((e.path.to_string(), e.line), ("nodes[1].gpu_memory".into(), Some(4)), "{e}");

    let text = r#"{
  "nodes": [{"id": "a", "gpus": 1, "gpu_memory": "80GB", "gpu_kind": "H\"100\\", "virtual_gpus": false}],
  "models": {"m": {"size": "20GB"}, "acme/x": {"parameters": 7, "size": "1GB"}}
}"#;
    let e = json_err(text);
    assert_eq!((e.path.to_string(), e.line), ("models.\"acme/x\"".into(), Some(3)), "{e}");

    let text = r#"{
  "nodes": [{"id": "a", "gpus": 1, "gpu_memory": "80GB", "gpu_kind": "[{\"}"}],
  "models": {"m": {"size": "20GB"}},
  "deployments": [
    {"model": "m", "node": "a", "gpus": [0], "dedicated": false},
    {"model": "m",
     "node": "zzz"}
  ]
}"#;
    let e = json_err(text);
    assert_eq!((e.path.to_string(), e.line), ("deployments[1].node".into(), Some(7)), "{e}");
}

/// Two identical free nodes; the model's weights resident on `b`.
const RESIDENT: &str = r#"
seed = SEED

[[nodes]]
id = "a"
gpus = 1
gpu_memory = "80GB"

[[nodes]]
id = "b"
gpus = 1
gpu_memory = "80GB"

[models."meta/llama"]
size = "16GB"

[[requests]]
model = "meta/llama"

[residency]
artifacts = { "meta/llama" = "llama-q4" }
nodes = { "b" = ["llama-q4"] }
"#;

#[test]
fn a_scenario_says_where_weights_are_resident_and_the_plan_goes_there() {
    let node_of = |text: &str| {
        let report = plan(text, Format::Toml).unwrap();
        report.deploy.models[0].replicas[0].node.as_ref().map(ToString::to_string).unwrap()
    };
    let mut without = std::collections::BTreeSet::new();
    for seed in 0..16 {
        let text = RESIDENT.replace("SEED", &seed.to_string());
        assert_eq!(node_of(&text), "b", "seed {seed}");
        let (head, _) = text.split_once("[residency]").unwrap();
        without.insert(node_of(head));
    }
    assert_eq!(without.len(), 2, "without residency the seeds spread over both nodes");
    let e = toml_err(&RESIDENT.replace("SEED", "0").replace("\"b\" = [", "\"c\" = ["));
    assert_eq!(e.path.to_string(), "residency.nodes.c", "{e}");
    assert!(e.to_string().contains("line"), "{e}");
}

/// The hotswap tier from a scenario file, as `hangar plan` reads one: a
/// model outside the tier takes a GPU from a hotswap replica deployed a
/// second ago (without the tier it would wait out the hour), and a hotswap
/// model swaps in from the warm cache in place of another hotswap replica
/// past `hotswap_min_age_ms`, which the report notes as a swap.
#[test]
fn a_scenario_plans_the_hotswap_tier() {
    const HOTSWAP: &str = r#"
        seed = 1
        now_ms = 10_000_000

        [placement]
        hotswap_min_age_ms = 60_000

        [[nodes]]
        id = "a"
        gpus = 2
        gpu_memory = "80GB"
        cpu_cache = "100GB"

        [models."acme/chat"]
        size = "30GB"               # a whole GPU
        [models."lora/a"]
        size = "10GB"               # a 30 GB share
        hotswap = true
        [models."lora/b"]
        size = "30GB"
        hotswap = true
        [models."lora/c"]
        size = "30GB"
        hotswap = true

        [[deployments]]             # a second old: evicted all the same
        model = "lora/a"
        node = "a"
        gpus = [0]
        deployed_at_ms = 9_999_000
        [[deployments]]             # two minutes old: a hotswap model may take it
        model = "lora/c"
        node = "a"
        gpus = [1]
        deployed_at_ms = 9_880_000
        [[deployments]]
        model = "lora/b"
        node = "a"
        level = "warm"

        [[requests]]
        model = "acme/chat"
        [[requests]]
        model = "lora/b"
    "#;
    let report = plan(HOTSWAP, Format::Toml).unwrap();
    let placed: Vec<(String, CandidateLevel, bool)> = report
        .deploy
        .models
        .iter()
        .flat_map(|m| m.replicas.iter().map(move |r| (m.model_key.to_string(), r.level, r.swap)))
        .collect();
    assert_eq!(
        placed,
        [
            ("acme/chat".into(), CandidateLevel::Full, false),
            ("lora/b".into(), CandidateLevel::CachedAndFull, true)
        ]
    );
    assert_eq!(report.deploy.swaps(), 1);
    let evicted: Vec<(String, Level)> =
        report.all_evictions().map(|e| (e.model_key.to_string(), e.to)).collect();
    assert_eq!(evicted, [("lora/a".into(), Level::Warm), ("lora/c".into(), Level::Warm)]);
    let table = report.render_table();
    assert!(table.lines().any(|l| l.contains("lora/b") && l.contains("swap")), "{table}");
    // A scenario written back out keeps the tier.
    let scenario = Scenario::parse(HOTSWAP, Format::Toml).unwrap();
    let json = serde_json::to_string(&scenario).unwrap();
    assert!(json.contains(r#""hotswap":true"#) && json.contains(r#""hotswap_min_age_ms":60000"#), "{json}");
}
