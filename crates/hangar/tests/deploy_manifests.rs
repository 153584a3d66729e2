//! The Kubernetes manifests under `deploy/kubernetes`, checked against what
//! reads them, so that a typo fails here rather than in a cluster:
//!
//! - every document parses into the Kubernetes API's own type for its
//!   `kind` (k8s-openapi), and no field is lost on the way — those types
//!   ignore unknown fields, so a misspelt one (`replica:`) would otherwise
//!   pass and be dropped by the API server just as silently;
//! - the ConfigMap's `fleet.toml` loads with `hangar serve`'s own loader;
//! - the gateway's and the agent's arguments and `HANGAR_*` variables are
//!   accepted by the real `hangar` binary;
//! - the names that tie the objects together (namespace, selectors, named
//!   ports, the ConfigMap mounted at `--config`, the Redis Service) agree.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Container, EnvVar, Namespace, PodTemplateSpec, Service};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/kubernetes");

/// One document of a manifest file, as its typed object.
enum Object {
    Namespace(Namespace),
    ConfigMap(ConfigMap),
    Service(Service),
    StatefulSet(StatefulSet),
    Deployment(Deployment),
    DaemonSet(DaemonSet),
}

/// A document and where it came from (`30-gateway.yaml#2`).
struct Doc {
    origin: String,
    object: Object,
}

/// Every `*.yaml` file of the directory, sorted by name.
fn manifest_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(DIR)
        .unwrap_or_else(|e| panic!("cannot read {DIR}: {e}"))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no *.yaml in {DIR}");
    files
}

/// The documents of one YAML text as JSON values (empty ones skipped).
fn documents(text: &str) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        let value = Value::deserialize(doc).map_err(|e| e.to_string())?;
        if !value.is_null() {
            out.push(value);
        }
    }
    Ok(out)
}

/// `doc` as the typed `T`, and the paths of the fields that did not
/// survive the round trip through it (unknown to the API: typos).
fn typed<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<(T, Vec<String>), String> {
    let object: T = serde_json::from_value(doc.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&object).expect("a typed object serializes");
    let mut lost = Vec::new();
    lost_fields(doc, &back, "", &mut lost);
    Ok((object, lost))
}

/// Appends to `out` the path of every key of `original` that `back`
/// lacks, and of every value that came back different.
fn lost_fields(original: &Value, back: &Value, path: &str, out: &mut Vec<String>) {
    match (original, back) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, value) in a {
                let here = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
                match b.get(key) {
                    Some(v) => lost_fields(value, v, &here, out),
                    None => out.push(here),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, value) in a.iter().enumerate() {
                let here = format!("{path}[{i}]");
                match b.get(i) {
                    Some(v) => lost_fields(value, v, &here, out),
                    None => out.push(here),
                }
            }
        }
        (a, b) if a != b => out.push(format!("{path} ({a} came back as {b})")),
        _ => {}
    }
}

/// A document as the typed object of its `kind`; an error names the kind,
/// the parse error or the fields that are not the API's.
fn object(doc: &Value) -> Result<Object, String> {
    fn checked<T: DeserializeOwned + Serialize>(
        doc: &Value,
        wrap: fn(T) -> Object,
    ) -> Result<Object, String> {
        let (object, lost) = typed::<T>(doc)?;
        if lost.is_empty() {
            Ok(wrap(object))
        } else {
            Err(format!("fields the API does not have (misspelt or misplaced?): {}", lost.join(", ")))
        }
    }
    match doc["kind"].as_str() {
        Some("Namespace") => checked(doc, Object::Namespace),
        Some("ConfigMap") => checked(doc, Object::ConfigMap),
        Some("Service") => checked(doc, Object::Service),
        Some("StatefulSet") => checked(doc, Object::StatefulSet),
        Some("Deployment") => checked(doc, Object::Deployment),
        Some("DaemonSet") => checked(doc, Object::DaemonSet),
        Some(other) => Err(format!("kind `{other}` is none this test knows; add it here")),
        None => Err("no `kind`".into()),
    }
}

/// Every document of every file; fails the test naming each bad one.
fn load() -> Vec<Doc> {
    let mut docs = Vec::new();
    let mut errors = Vec::new();
    for file in manifest_files() {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&file).unwrap();
        match documents(&text) {
            Err(e) => errors.push(format!("{name}: not YAML: {e}")),
            Ok(values) => {
                for (i, value) in values.iter().enumerate() {
                    let origin = format!("{name}#{}", i + 1);
                    match object(value) {
                        Ok(object) => docs.push(Doc { origin, object }),
                        Err(e) => errors.push(format!("{origin}: {e}")),
                    }
                }
            }
        }
    }
    assert!(errors.is_empty(), "bad manifests:\n{}", errors.join("\n"));
    docs
}

/// A workload's name, its pod template and the selector it claims pods by.
struct Workload<'a> {
    origin: &'a str,
    name: String,
    namespace: Option<String>,
    selector: BTreeMap<String, String>,
    template: &'a PodTemplateSpec,
}

fn workloads(docs: &[Doc]) -> Vec<Workload<'_>> {
    docs.iter()
        .filter_map(|d| {
            let (meta, selector, template) = match &d.object {
                Object::Deployment(o) => {
                    let s = o.spec.as_ref()?;
                    (&o.metadata, &s.selector, &s.template)
                }
                Object::StatefulSet(o) => {
                    let s = o.spec.as_ref()?;
                    (&o.metadata, &s.selector, &s.template)
                }
                Object::DaemonSet(o) => {
                    let s = o.spec.as_ref()?;
                    (&o.metadata, &s.selector, &s.template)
                }
                _ => return None,
            };
            Some(Workload {
                origin: &d.origin,
                name: meta.name.clone().unwrap_or_default(),
                namespace: meta.namespace.clone(),
                selector: selector.match_labels.clone().unwrap_or_default(),
                template,
            })
        })
        .collect()
}

fn config_maps(docs: &[Doc]) -> Vec<&ConfigMap> {
    docs.iter().filter_map(|d| if let Object::ConfigMap(c) = &d.object { Some(c) } else { None }).collect()
}

fn services(docs: &[Doc]) -> Vec<&Service> {
    docs.iter().filter_map(|d| if let Object::Service(s) = &d.object { Some(s) } else { None }).collect()
}

/// The containers that run `hangar`, with the workload they are in.
fn hangar_containers<'a>(ws: &'a [Workload<'a>]) -> Vec<(&'a Workload<'a>, &'a Container)> {
    ws.iter()
        .flat_map(|w| w.template.spec.iter().flat_map(move |s| s.containers.iter().map(move |c| (w, c))))
        .filter(|(_, c)| c.command.as_deref() == Some(&["hangar".to_owned()][..]))
        .collect()
}

/// The fleet file the manifests hold: the ConfigMap key `fleet.toml`.
fn fleet_toml(docs: &[Doc]) -> String {
    let holders: Vec<&String> = config_maps(docs)
        .into_iter()
        .filter_map(|c| c.data.as_ref().and_then(|d| d.get("fleet.toml")))
        .collect();
    assert_eq!(holders.len(), 1, "exactly one ConfigMap holds fleet.toml");
    holders[0].clone()
}

#[test]
fn a_misspelt_or_unknown_field_is_caught() {
    let doc = |spec: Value| {
        serde_json::json!({
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
            "spec": spec,
        })
    };
    let good = doc(serde_json::json!({
        "replicas": 2,
        "selector": {"matchLabels": {"a": "b"}},
        "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
    }));
    assert!(object(&good).is_ok());
    let mut typo = good.clone();
    typo["spec"]["replica"] = typo["spec"]["replicas"].take();
    typo["spec"].as_object_mut().unwrap().remove("replicas");
    let e = object(&typo).err().expect("a typo is refused");
    assert!(e.contains("spec.replica"), "{e}");
    let mut deep = good.clone();
    deep["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always".into();
    let e = object(&deep).err().expect("a typo in a list item is refused");
    assert!(e.contains("spec.template.spec.containers[0].imagePullPolicyy"), "{e}");
    let mut kind = good;
    kind["kind"] = "Ingress".into();
    assert!(object(&kind).err().unwrap().contains("kind `Ingress`"));
}

#[test]
fn every_manifest_is_a_known_kind_with_no_unknown_field() {
    let docs = load();
    let mut kinds = BTreeMap::<&str, usize>::new();
    for d in &docs {
        let kind = match d.object {
            Object::Namespace(_) => "Namespace",
            Object::ConfigMap(_) => "ConfigMap",
            Object::Service(_) => "Service",
            Object::StatefulSet(_) => "StatefulSet",
            Object::Deployment(_) => "Deployment",
            Object::DaemonSet(_) => "DaemonSet",
        };
        *kinds.entry(kind).or_default() += 1;
    }
    for kind in ["Namespace", "ConfigMap", "StatefulSet", "Deployment", "DaemonSet"] {
        assert!(kinds.contains_key(kind), "no {kind} in the manifests: {kinds:?}");
    }
    assert!(
        kinds.get("Service").copied().unwrap_or(0) >= 2,
        "a Service for Redis and the gateways: {kinds:?}"
    );
}

#[test]
fn the_fleet_file_loads_with_the_real_loader() {
    let docs = load();
    let text = fleet_toml(&docs);
    let config = hangar_runtime::serve::ServeConfig::from_toml(&text, "fleet.toml")
        .unwrap_or_else(|e| panic!("the ConfigMap's fleet.toml: {e}"));
    assert!(config.nodes.is_empty(), "a fleet's file has no [[nodes]]: the agents are its nodes");
    assert!(!config.models.is_empty(), "a model to serve");
    let redis = config.redis.expect("a fleet's file names its Redis");
    // `redis://HOST:PORT/DB`: HOST must be a Service of the manifests that
    // exposes PORT.
    let authority = redis.strip_prefix("redis://").and_then(|r| r.split('/').next()).expect("a redis:// URL");
    let (host, port) = authority.rsplit_once(':').expect("a port in the Redis URL");
    let port: i32 = port.parse().unwrap();
    let service = services(&docs)
        .into_iter()
        .find(|s| s.metadata.name.as_deref() == Some(host))
        .unwrap_or_else(|| panic!("no Service `{host}` for the Redis URL {redis}"));
    let ports = service.spec.as_ref().and_then(|s| s.ports.as_ref()).cloned().unwrap_or_default();
    assert!(ports.iter().any(|p| p.port == port), "Service `{host}` does not expose {port}");
    // The agents are given the same Redis.
    let ws = workloads(&docs);
    for (w, c) in hangar_containers(&ws) {
        if let Some(v) = env_value(c, "HANGAR_REDIS") {
            assert_eq!(v, redis, "{}: HANGAR_REDIS is not fleet.toml's redis", w.origin);
        }
    }
}

/// A container's literal value of `name`, if it sets one.
fn env_value(c: &Container, name: &str) -> Option<String> {
    c.env.iter().flatten().find(|e| e.name == name).and_then(|e| e.value.clone())
}

/// What a variable stands for in a running pod: its literal value, or a
/// sample of the field the downward API gives it.
fn sample_value(e: &EnvVar) -> String {
    if let Some(v) = &e.value {
        return v.clone();
    }
    let field = e.value_from.as_ref().and_then(|f| f.field_ref.as_ref()).map(|f| f.field_path.as_str());
    match field {
        Some("status.podIP") => "10.1.2.3".into(),
        Some("spec.nodeName") => "gpu-node-1".into(),
        Some("metadata.name") => "hangar-agent-x7k2p".into(),
        other => panic!("variable {}: give this test a sample of {other:?}", e.name),
    }
}

/// What `hangar SUB --help` says: each `--flag` with the variable it reads
/// (`[env: NAME=]`), and the flags its usage line requires.
struct Help {
    flags: BTreeMap<String, Option<String>>,
    required: Vec<String>,
}

fn help(sub: &str) -> Help {
    let out = Command::new(env!("CARGO_BIN_EXE_hangar")).args([sub, "--help"]).output().unwrap();
    assert!(out.status.success(), "`hangar {sub} --help` failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let mut flags = BTreeMap::new();
    let mut current: Option<String> = None;
    let mut required = Vec::new();
    for line in text.lines() {
        if let Some(usage) = line.strip_prefix("Usage: ") {
            required = usage.split_whitespace().filter(|w| w.starts_with("--")).map(str::to_owned).collect();
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        if line.trim_start().starts_with('-') {
            if let Some(flag) = words.iter().find(|w| w.starts_with("--")) {
                let flag = flag.trim_end_matches(',').to_owned();
                flags.insert(flag.clone(), None);
                current = Some(flag);
            }
        }
        if let (Some(flag), Some(at)) = (&current, line.find("[env: ")) {
            let name = line[at + 6..].split('=').next().unwrap().to_owned();
            flags.insert(flag.clone(), Some(name));
        }
    }
    Help { flags, required }
}

/// `HANGAR_*` variables read outside the subcommand's flags (so not in
/// its `--help`): the weight store's root, which the store crate reads.
const READ_ELSEWHERE: &[&str] = &["HANGAR_STORE_ROOT"];

#[test]
fn hangar_containers_run_what_the_binary_accepts() {
    let docs = load();
    let ws = workloads(&docs);
    let containers = hangar_containers(&ws);
    let subcommands: BTreeSet<&str> =
        containers.iter().filter_map(|(_, c)| c.args.as_ref()?.first().map(String::as_str)).collect();
    assert_eq!(subcommands, BTreeSet::from(["agent", "serve"]), "a gateway and an agent run hangar");
    for (w, c) in containers {
        let at = format!("{} container `{}`", w.origin, c.name);
        let args = c.args.clone().unwrap_or_default();
        let sub = args.first().unwrap_or_else(|| panic!("{at}: no subcommand"));
        let help = help(sub);
        let env: BTreeMap<&str, &EnvVar> = c.env.iter().flatten().map(|e| (e.name.as_str(), e)).collect();
        // Each flag is the subcommand's.
        let given: BTreeSet<String> = args
            .iter()
            .filter(|a| a.starts_with("--"))
            .map(|a| a.split('=').next().unwrap().to_owned())
            .collect();
        for flag in &given {
            assert!(help.flags.contains_key(flag), "{at}: `hangar {sub}` has no {flag}");
        }
        // Each HANGAR_ variable is one a flag reads (or the store's).
        let by_env: BTreeMap<&str, &str> =
            help.flags.iter().filter_map(|(f, e)| Some((e.as_deref()?, f.as_str()))).collect();
        for name in env.keys().filter(|n| n.starts_with("HANGAR_")) {
            assert!(
                by_env.contains_key(name) || READ_ELSEWHERE.contains(name),
                "{at}: `hangar {sub}` reads no {name}"
            );
        }
        // Each required flag is given, as an argument or its variable.
        for flag in &help.required {
            let from_env =
                help.flags.get(flag).cloned().flatten().is_some_and(|n| env.contains_key(n.as_str()));
            assert!(given.contains(flag) || from_env, "{at}: `hangar {sub}` needs {flag}");
        }
        // `$(VAR)` is expanded by Kubernetes only from the container's
        // variables; an unknown one would reach hangar as is.
        let expand = |arg: &str| {
            let mut out = arg.to_owned();
            while let Some(start) = out.find("$(") {
                let end = start + out[start..].find(')').expect("a closed $(");
                let name = out[start + 2..end].to_owned();
                let e =
                    env.get(name.as_str()).unwrap_or_else(|| panic!("{at}: $({name}) is no variable of it"));
                out.replace_range(start..=end, &sample_value(e));
            }
            out
        };
        // The arguments, and the variables as the flags they stand for,
        // through the binary's own parser (`--help` stops it from running;
        // it exits 2 on any flag or value it refuses).
        let mut argv: Vec<String> = args.iter().map(|a| expand(a)).collect();
        for (name, e) in &env {
            if let Some(flag) = by_env.get(name).filter(|f| !given.contains(**f)) {
                argv.push((*flag).to_owned());
                argv.push(sample_value(e));
            }
        }
        argv.push("--help".into());
        let out = Command::new(env!("CARGO_BIN_EXE_hangar")).args(&argv).output().unwrap();
        assert!(
            out.status.success(),
            "{at}: `hangar {}` refused: {}",
            argv.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_objects_refer_to_each_other_by_names_that_exist() {
    let docs = load();
    let namespaces: BTreeSet<String> = docs
        .iter()
        .filter_map(|d| if let Object::Namespace(n) = &d.object { n.metadata.name.clone() } else { None })
        .collect();
    let ws = workloads(&docs);
    // Namespaced objects are in the fleet's namespace.
    for d in &docs {
        let ns = match &d.object {
            Object::Namespace(_) => continue,
            Object::ConfigMap(o) => &o.metadata.namespace,
            Object::Service(o) => &o.metadata.namespace,
            Object::StatefulSet(o) => &o.metadata.namespace,
            Object::Deployment(o) => &o.metadata.namespace,
            Object::DaemonSet(o) => &o.metadata.namespace,
        };
        let ns = ns.as_deref().unwrap_or_else(|| panic!("{}: no namespace", d.origin));
        assert!(namespaces.contains(ns), "{}: namespace `{ns}` is not among {namespaces:?}", d.origin);
    }
    // A workload's selector matches its own pods.
    let labels = |t: &PodTemplateSpec| t.metadata.as_ref().and_then(|m| m.labels.clone()).unwrap_or_default();
    for w in &ws {
        let pods = labels(w.template);
        assert!(!w.selector.is_empty(), "{}: an empty selector", w.origin);
        for (k, v) in &w.selector {
            assert_eq!(pods.get(k), Some(v), "{}: the selector's {k} is not on its pods", w.origin);
        }
    }
    // A Service selects some workload's pods, in its namespace, and a named
    // target port is one their containers declare.
    for s in services(&docs) {
        let name = s.metadata.name.clone().unwrap_or_default();
        let spec = s.spec.as_ref().expect("a Service spec");
        let selector = spec.selector.clone().unwrap_or_default();
        let w = ws
            .iter()
            .find(|w| {
                w.namespace == s.metadata.namespace
                    && selector.iter().all(|(k, v)| labels(w.template).get(k) == Some(v))
            })
            .unwrap_or_else(|| panic!("Service `{name}` selects no workload's pods"));
        let declared: BTreeSet<String> = w
            .template
            .spec
            .iter()
            .flat_map(|p| &p.containers)
            .flat_map(|c| c.ports.iter().flatten())
            .filter_map(|p| p.name.clone())
            .collect();
        for p in spec.ports.iter().flatten() {
            if let Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(target)) =
                &p.target_port
            {
                assert!(
                    declared.contains(target),
                    "Service `{name}`: no container port `{target}` in `{}`",
                    w.name
                );
            }
        }
    }
    // `--config PATH` is a file of a ConfigMap mounted at PATH's directory.
    let maps = config_maps(&docs);
    for (w, c) in hangar_containers(&ws) {
        let args = c.args.clone().unwrap_or_default();
        let Some(i) = args.iter().position(|a| a == "--config") else { continue };
        let path = Path::new(&args[i + 1]);
        let (dir, file) = (path.parent().unwrap(), path.file_name().unwrap().to_str().unwrap());
        let mount = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| Path::new(&m.mount_path) == dir)
            .unwrap_or_else(|| panic!("{}: nothing is mounted at {}", w.origin, dir.display()));
        let volume = w
            .template
            .spec
            .iter()
            .flat_map(|p| p.volumes.iter().flatten())
            .find(|v| v.name == mount.name)
            .unwrap_or_else(|| panic!("{}: no volume `{}`", w.origin, mount.name));
        let map_name =
            volume.config_map.as_ref().map(|m| m.name.clone()).expect("the config volume is a ConfigMap");
        let map = maps
            .iter()
            .find(|m| {
                m.metadata.name.as_deref() == Some(map_name.as_str()) && m.metadata.namespace == w.namespace
            })
            .unwrap_or_else(|| panic!("{}: no ConfigMap `{map_name}`", w.origin));
        assert!(
            map.data.as_ref().is_some_and(|d| d.contains_key(file)),
            "ConfigMap `{map_name}` has no `{file}`"
        );
    }
    // An agent declares as many GPUs as it asks Kubernetes for.
    for (w, c) in hangar_containers(&ws) {
        if c.args.as_ref().and_then(|a| a.first()).map(String::as_str) != Some("agent") {
            continue;
        }
        let gpus = env_value(c, "HANGAR_GPUS").expect("the agent's HANGAR_GPUS");
        let limit = c
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("nvidia.com/gpu"))
            .map(|q| q.0.clone())
            .unwrap_or_else(|| panic!("{}: no nvidia.com/gpu limit", w.origin));
        assert_eq!(gpus, limit, "{}: HANGAR_GPUS is not the nvidia.com/gpu limit", w.origin);
    }
}
