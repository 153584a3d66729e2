//! Fuzzing the configuration loader: random files built from every field
//! with values across their types' ranges (zeros, huge numbers, bad URLs,
//! duplicates), and random line edits of valid files.
//!
//! The property: loading never panics, and a file that loads is one a
//! server can run — its cluster builds, every deadline fits the clock,
//! every line has room. Cases: `PROPTEST_CASES` (default 1,000 here).

use std::time::{Duration, Instant};

use hangar_placement::Cluster;
use hangar_runtime::serve::{ServeConfig, DEMO, MAX_QUEUE_CAPACITY};
use proptest::prelude::*;

/// A number as TOML writes it, from the edges of `u64` and the ordinary.
fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "0",
            "1",
            "2",
            "3",
            "1000",
            "1001",
            "5000",
            "-1",
            "2592000",
            "2592001",
            "18446744073709551615",
            "18446744073709551616",
            "9223372036854775807",
            "1.5",
            "\"7\"",
        ])
        .prop_map(String::from),
        (0u64..100_000).prop_map(|n| n.to_string()),
    ]
}

fn bytes() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "\"80GB\"",
        "\"16GB\"",
        "\"0\"",
        "\"1\"",
        "\"60GB\"",
        "\"200GB\"",
        "\"4KiB\"",
        "\"99999PB\"",
        "\"-1GB\"",
        "\"lots\"",
        "\"1KiB\"",
        "\"2GiB\"",
        "0",
        "17",
    ])
    .prop_map(String::from)
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "http://127.0.0.1:1",
            "not a url",
            "ftp://h/",
            "http://",
            "http://u:p@h:1",
            "https://h.example:443/x",
            "",
            " ",
            "m",
            "a/b",
            "a/b",
            "é",
            "/health",
            "health",
            "x {port}",
        ])
        .prop_map(String::from),
        "[ -~]{0,12}",
    ]
    .prop_map(|s| format!("{s:?}"))
}

fn engine() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("{ kind = \"mock\" }".to_owned()),
        text().prop_map(|u| format!("{{ kind = \"external\", url = {u} }}")),
        (text(), text(), number()).prop_map(|(c, r, t)| format!(
            "{{ kind = \"openai\", command = {c}, readiness_path = {r}, setup_timeout_s = {t} }}"
        )),
        number().prop_map(|t| format!("{{ kind = \"cog\", dir = \"d\", setup_timeout_s = {t} }}")),
        Just("{ kind = \"warp\" }".to_owned()),
    ]
}

/// `key = value` lines, each present or not.
fn fields(options: Vec<(&'static str, BoxedStrategy<String>)>) -> impl Strategy<Value = String> {
    let each: Vec<_> = options
        .into_iter()
        .map(|(k, v)| prop::option::weighted(0.4, v).prop_map(move |v| v.map(|v| format!("{k} = {v}\n"))))
        .collect();
    each.prop_map(|lines| lines.into_iter().flatten().collect::<String>())
}

fn node() -> impl Strategy<Value = String> {
    (
        prop::sample::select(vec!["n", "n", "m"]),
        fields(vec![
            ("gpus", number().boxed()),
            ("gpu_memory", bytes().boxed()),
            ("virtual_gpus", any::<bool>().prop_map(|b| b.to_string()).boxed()),
            ("cpu_cache", bytes().boxed()),
        ]),
    )
        .prop_map(|(id, rest)| format!("[[nodes]]\nid = \"{id}\"\n{rest}"))
}

fn model() -> impl Strategy<Value = String> {
    (
        prop::sample::select(vec!["a", "a", "b/c", "bad key", ""]),
        engine(),
        fields(vec![
            ("size", bytes().boxed()),
            (
                "parameters",
                prop::sample::select(vec!["\"8B\"", "\"0\"", "\"70B\"", "\"x\""])
                    .prop_map(String::from)
                    .boxed(),
            ),
            ("min_replicas", number().boxed()),
            ("max_replicas", number().boxed()),
            ("concurrency", number().boxed()),
            ("timeout_s", number().boxed()),
            (
                "scaling",
                (prop::sample::select(vec!["hangar", "replicate", "workers-ai", "fixed", "magic"]), number())
                    .prop_map(|(p, n)| format!("{{ policy = \"{p}\", interval_ms = {n} }}"))
                    .boxed(),
            ),
            ("queue", number().prop_map(|c| format!("{{ capacity = {c} }}")).boxed()),
            (
                "router",
                prop::sample::select(vec!["\"kv\"", "\"round-robin\"", "\"round_robin\"", "\"random\""])
                    .prop_map(String::from)
                    .boxed(),
            ),
            (
                "kv",
                (number(), number())
                    .prop_map(|(b, c)| format!("{{ block_chars = {b}, cache_blocks = {c} }}"))
                    .boxed(),
            ),
            (
                "predictions",
                (number(), number())
                    .prop_map(|(l, p)| format!("{{ max_run_lifetime_s = {l}, predict_timeout_s = {p} }}"))
                    .boxed(),
            ),
        ]),
    )
        .prop_map(|(key, engine, rest)| format!("[[models]]\nkey = \"{key}\"\nengine = {engine}\n{rest}"))
}

fn config() -> impl Strategy<Value = String> {
    (
        fields(vec![
            ("max_body_bytes", bytes().boxed()),
            ("timeout_floor_s", number().boxed()),
            ("timeout_ceiling_s", number().boxed()),
            ("metrics_key", text().boxed()),
            ("seed", number().boxed()),
        ]),
        prop::collection::vec(node(), 0..3),
        prop::collection::vec(model(), 0..4),
        fields(vec![
            ("webhook_retry_base_ms", number().boxed()),
            ("webhook_retry_cap_ms", number().boxed()),
            ("webhook_max_attempts", number().boxed()),
            ("retention_s", number().boxed()),
            ("lease_s", number().boxed()),
            ("async_slots", number().boxed()),
            ("public_url", text().boxed()),
        ]),
    )
        .prop_map(|(top, nodes, models, predictions)| {
            format!("{top}{}{}[predictions]\n{predictions}", nodes.concat(), models.concat())
        })
}

/// A valid file with one line dropped, doubled or overwritten.
fn edited_demo() -> impl Strategy<Value = String> {
    let lines: Vec<&'static str> = DEMO.lines().collect();
    let n = lines.len();
    (0..n, 0..3u8, number()).prop_map(move |(at, edit, value)| {
        let mut out: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
        match edit {
            0 => {
                out.remove(at);
            }
            1 => out.insert(at, out[at].clone()),
            _ => {
                if let Some((key, _)) = out[at].split_once(" = ") {
                    out[at] = format!("{key} = {value}");
                }
            }
        }
        out.join("\n")
    })
}

/// What a server does with a loaded configuration, none of which may fail.
fn runs(config: &ServeConfig) {
    Cluster::new(config.cluster()).expect("a loaded configuration makes a cluster");
    for m in &config.models {
        let timeout = config.timeout(m);
        assert!(Instant::now().checked_add(timeout).is_some(), "{}: timeout {timeout:?}", m.key);
        assert!(timeout >= Duration::from_secs(1));
        let capacity = m.admission().capacity;
        assert!((1..=MAX_QUEUE_CAPACITY).contains(&capacity), "{}: capacity {capacity}", m.key);
        assert!(m.max_replicas() >= 1 && m.max_replicas() >= m.min_replicas);
        m.scaling().validate().expect("a loaded model's scaling knobs are in range");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn a_random_configuration_loads_or_is_refused_by_field_and_line(text in config()) {
        match ServeConfig::from_toml(&text, "fuzz.toml") {
            Ok(config) => runs(&config),
            Err(e) => prop_assert!(e.to_string().starts_with("invalid configuration fuzz.toml"), "{e}"),
        }
    }

    #[test]
    fn an_edited_demo_loads_or_is_refused_by_field_and_line(text in edited_demo()) {
        match ServeConfig::from_toml(&text, "demo.toml") {
            Ok(config) => runs(&config),
            Err(e) => prop_assert!(e.to_string().starts_with("invalid configuration demo.toml"), "{e}"),
        }
    }
}
