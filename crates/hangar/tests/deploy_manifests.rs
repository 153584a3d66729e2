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
//!   ports, the ConfigMap mounted at `--config`, the Secrets README.md
//!   makes, the Redis Service) agree;
//! - and what a careful operator asks of them: probes on the routes that
//!   mean ready and alive (checked against a running gateway and agent),
//!   pods that meet Pod Security's `restricted` profile, secrets only from
//!   Secrets, Redis with a password, a pinned tag and `noeviction` below
//!   its memory limit, gateways spread and guarded by a disruption budget,
//!   network policies that admit only what the fleet uses, the store on a
//!   volume Pod Security admits, GPU counts from the node, and an image
//!   built by the Dockerfile beside them, run as a non-root user.
//!
//! The Dockerfile is checked here, statically: building it needs a
//! container engine and a registry, which CI does not have.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, EnvVar, Namespace, PodSpec, PodTemplateSpec, Probe, Service, Volume,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
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
    NetworkPolicy(NetworkPolicy),
    PodDisruptionBudget(PodDisruptionBudget),
}

impl Object {
    fn kind(&self) -> &'static str {
        match self {
            Object::Namespace(_) => "Namespace",
            Object::ConfigMap(_) => "ConfigMap",
            Object::Service(_) => "Service",
            Object::StatefulSet(_) => "StatefulSet",
            Object::Deployment(_) => "Deployment",
            Object::DaemonSet(_) => "DaemonSet",
            Object::NetworkPolicy(_) => "NetworkPolicy",
            Object::PodDisruptionBudget(_) => "PodDisruptionBudget",
        }
    }

    /// Its namespace; `None` for a Namespace (which has none).
    fn namespace(&self) -> Option<&Option<String>> {
        Some(match self {
            Object::Namespace(_) => return None,
            Object::ConfigMap(o) => &o.metadata.namespace,
            Object::Service(o) => &o.metadata.namespace,
            Object::StatefulSet(o) => &o.metadata.namespace,
            Object::Deployment(o) => &o.metadata.namespace,
            Object::DaemonSet(o) => &o.metadata.namespace,
            Object::NetworkPolicy(o) => &o.metadata.namespace,
            Object::PodDisruptionBudget(o) => &o.metadata.namespace,
        })
    }
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
        Some("NetworkPolicy") => checked(doc, Object::NetworkPolicy),
        Some("PodDisruptionBudget") => checked(doc, Object::PodDisruptionBudget),
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
    /// Pods it keeps (a DaemonSet: one per node, `None`).
    replicas: Option<i32>,
}

impl Workload<'_> {
    fn pod(&self) -> &PodSpec {
        self.template.spec.as_ref().unwrap_or_else(|| panic!("{}: no pod spec", self.origin))
    }

    fn labels(&self) -> BTreeMap<String, String> {
        self.template.metadata.as_ref().and_then(|m| m.labels.clone()).unwrap_or_default()
    }

    fn volume(&self, name: &str) -> &Volume {
        let volumes = self.pod().volumes.iter().flatten();
        volumes
            .into_iter()
            .find(|v| v.name == name)
            .unwrap_or_else(|| panic!("{}: no volume `{name}`", self.origin))
    }
}

fn workloads(docs: &[Doc]) -> Vec<Workload<'_>> {
    docs.iter()
        .filter_map(|d| {
            let (meta, selector, template, replicas) = match &d.object {
                Object::Deployment(o) => {
                    let s = o.spec.as_ref()?;
                    (&o.metadata, &s.selector, &s.template, Some(s.replicas.unwrap_or(1)))
                }
                Object::StatefulSet(o) => {
                    let s = o.spec.as_ref()?;
                    (&o.metadata, &s.selector, &s.template, Some(s.replicas.unwrap_or(1)))
                }
                Object::DaemonSet(o) => {
                    let s = o.spec.as_ref()?;
                    (&o.metadata, &s.selector, &s.template, None)
                }
                _ => return None,
            };
            Some(Workload {
                origin: &d.origin,
                name: meta.name.clone().unwrap_or_default(),
                namespace: meta.namespace.clone(),
                selector: selector.match_labels.clone().unwrap_or_default(),
                template,
                replicas,
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

/// Every container, with the workload it is in.
fn containers<'a>(ws: &'a [Workload<'a>]) -> Vec<(&'a Workload<'a>, &'a Container)> {
    ws.iter().flat_map(|w| w.pod().containers.iter().map(move |c| (w, c))).collect()
}

/// The workload called `name`.
fn workload<'a>(ws: &'a [Workload<'a>], name: &str) -> &'a Workload<'a> {
    ws.iter().find(|w| w.name == name).unwrap_or_else(|| panic!("no workload `{name}`"))
}

/// The containers that run `hangar SUB`.
fn hangar_runs<'a>(ws: &'a [Workload<'a>], sub: &str) -> Vec<(&'a Workload<'a>, &'a Container)> {
    let runs: Vec<_> = hangar_containers(ws)
        .into_iter()
        .filter(|(_, c)| c.args.as_ref().and_then(|a| a.first()).map(String::as_str) == Some(sub))
        .collect();
    assert!(!runs.is_empty(), "no container runs `hangar {sub}`");
    runs
}

/// The value after `flag` in `args` (`--config PATH`).
fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).map(String::as_str)
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
        *kinds.entry(d.object.kind()).or_default() += 1;
    }
    for kind in [
        "Namespace",
        "ConfigMap",
        "StatefulSet",
        "Deployment",
        "DaemonSet",
        "NetworkPolicy",
        "PodDisruptionBudget",
    ] {
        assert!(kinds.contains_key(kind), "no {kind} in the manifests: {kinds:?}");
    }
    assert!(
        kinds.get("Service").copied().unwrap_or(0) >= 2,
        "a Service for Redis and the gateways: {kinds:?}"
    );
}

// ---- values as a running pod sees them -------------------------------

/// What a Secret's key stands for in these tests.
const SAMPLE_SECRET: &str = "0123456789abcdef0123456789abcdef";

/// A container's variables by name.
fn env_of(c: &Container) -> BTreeMap<&str, &EnvVar> {
    c.env.iter().flatten().map(|e| (e.name.as_str(), e)).collect()
}

/// `text` with each `$(VAR)` replaced as Kubernetes does, from the
/// container's variables (an unknown one fails the test: Kubernetes would
/// leave it as is).
fn expand(text: &str, env: &BTreeMap<&str, &EnvVar>, at: &str) -> String {
    let mut out = text.to_owned();
    while let Some(start) = out.find("$(") {
        let end = start + out[start..].find(')').expect("a closed $(");
        let name = out[start + 2..end].to_owned();
        let e = env.get(name.as_str()).unwrap_or_else(|| panic!("{at}: $({name}) is no variable of it"));
        out.replace_range(start..=end, &sample_value(e, env, at));
    }
    out
}

/// What a variable stands for in a running pod: its value (its own
/// `$(VAR)`s expanded), a sample of the field the downward API gives it,
/// or [`SAMPLE_SECRET`] for a Secret's key.
fn sample_value(e: &EnvVar, env: &BTreeMap<&str, &EnvVar>, at: &str) -> String {
    if let Some(v) = &e.value {
        return expand(v, env, at);
    }
    let from = e.value_from.as_ref().unwrap_or_else(|| panic!("{at}: variable {} has no value", e.name));
    if from.secret_key_ref.is_some() {
        return SAMPLE_SECRET.into();
    }
    match from.field_ref.as_ref().map(|f| f.field_path.as_str()) {
        Some("status.podIP") => "10.1.2.3".into(),
        Some("spec.nodeName") => "gpu-node-1".into(),
        Some("metadata.name") => "hangar-agent-x7k2p".into(),
        other => panic!("{at}: variable {}: give this test a sample of {other:?}", e.name),
    }
}

/// A container's value of `name` as it runs, if it sets the variable.
fn env_sample(c: &Container, name: &str) -> Option<String> {
    let env = env_of(c);
    env.get(name).map(|e| sample_value(e, &env, &c.name))
}

/// A Kubernetes quantity in bytes (`200Gi`, `4Gi`, `512Mi`, `10G`).
fn quantity_bytes(q: &str) -> u64 {
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (n, unit) = q.split_at(split);
    let n: u64 = n.parse().unwrap_or_else(|_| panic!("quantity `{q}`"));
    let k: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => panic!("quantity `{q}`: give this test its unit"),
    };
    n * k
}

/// A Redis memory setting in bytes: `3gb` is 3 GiB, `3g` 3 × 10^9.
fn redis_bytes(v: &str) -> u64 {
    let v = v.to_ascii_lowercase();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (n, unit) = v.split_at(split);
    let n: u64 = n.parse().unwrap_or_else(|_| panic!("redis size `{v}`"));
    n * match unit {
        "" | "b" => 1,
        "k" => 1_000,
        "kb" => 1 << 10,
        "m" => 1_000_000,
        "mb" => 1 << 20,
        "g" => 1_000_000_000,
        "gb" => 1 << 30,
        _ => panic!("redis size `{v}`"),
    }
}

/// A container's memory limit, in bytes.
fn memory_limit(c: &Container) -> Option<u64> {
    let limits = c.resources.as_ref()?.limits.as_ref()?;
    limits.get("memory").map(|q| quantity_bytes(&q.0))
}

/// The README beside the manifests.
fn readme() -> String {
    std::fs::read_to_string(format!("{DIR}/README.md")).expect("deploy/kubernetes/README.md")
}

/// The Secrets README.md tells the operator to make (`kubectl … create
/// secret generic NAME --from-literal=KEY=… --from-file=KEY=…`): each
/// name with its keys. They are made by hand, not kept in these files,
/// so that no secret is ever committed.
fn readme_secrets() -> BTreeMap<String, BTreeSet<String>> {
    let text = readme().replace("\\\n", " ");
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some(i) = words.windows(3).position(|w| w == ["create", "secret", "generic"]) else { continue };
        let name = words[i + 3].to_owned();
        let keys: BTreeSet<String> = words[i + 4..]
            .iter()
            .filter_map(|w| w.strip_prefix("--from-literal=").or_else(|| w.strip_prefix("--from-file=")))
            .map(|spec| {
                let key = spec.split('=').next().unwrap();
                Path::new(key).file_name().unwrap().to_string_lossy().into_owned()
            })
            .collect();
        assert!(!keys.is_empty(), "README: secret `{name}` is made with no key");
        out.insert(name, keys);
    }
    out
}

/// `GET url`: its status.
fn get_status(url: &str) -> u16 {
    reqwest::blocking::get(url).map(|r| r.status().as_u16()).unwrap_or_else(|e| panic!("GET {url}: {e}"))
}

#[test]
fn the_fleet_file_loads_with_the_real_loader() {
    let docs = load();
    let text = fleet_toml(&docs);
    let ws = workloads(&docs);
    // Every hangar container names the same Redis, the Service's.
    let urls: BTreeSet<String> = hangar_containers(&ws)
        .into_iter()
        .map(|(w, c)| {
            env_sample(c, "HANGAR_REDIS").unwrap_or_else(|| panic!("{}: no HANGAR_REDIS", w.origin))
        })
        .collect();
    assert_eq!(urls.len(), 1, "gateways and agents name one Redis: {urls:?}");
    let redis = urls.into_iter().next().unwrap();
    let config =
        hangar_runtime::serve::ServeConfig::from_toml_with_redis(&text, "fleet.toml", Some(redis.clone()))
            .unwrap_or_else(|e| panic!("the ConfigMap's fleet.toml: {e}"));
    assert!(config.nodes.is_empty(), "a fleet's file has no [[nodes]]: the agents are its nodes");
    assert!(!config.models.is_empty(), "a model to serve");
    // `redis://:PASSWORD@HOST:PORT/DB`, a form `--redis` accepts and
    // hides the password of; HOST a Service of the manifests exposing PORT.
    hangar_redis::check_url(&redis).unwrap_or_else(|e| panic!("HANGAR_REDIS: {e}"));
    assert!(!hangar_redis::redacted(&redis).contains(SAMPLE_SECRET));
    let authority = redis.strip_prefix("redis://").and_then(|r| r.split('/').next()).expect("a redis:// URL");
    let (userinfo, host_port) = authority.rsplit_once('@').expect("the password in the Redis URL");
    assert_eq!(userinfo, format!(":{SAMPLE_SECRET}"), "the Secret's password, as the URL's");
    let (host, port) = host_port.rsplit_once(':').expect("a port in the Redis URL");
    let port: i32 = port.parse().unwrap();
    let service = services(&docs)
        .into_iter()
        .find(|s| s.metadata.name.as_deref() == Some(host))
        .unwrap_or_else(|| panic!("no Service `{host}` for the Redis URL {redis}"));
    let ports = service.spec.as_ref().and_then(|s| s.ports.as_ref()).cloned().unwrap_or_default();
    assert!(ports.iter().any(|p| p.port == port), "Service `{host}` does not expose {port}");
}

/// What `hangar SUB --help` says: each `--flag` with the variable it reads
/// (`[env: NAME=]`, or `[env: NAME]` when its value is hidden), the flags
/// its usage line requires, and the whole text.
struct Help {
    flags: BTreeMap<String, Option<String>>,
    required: Vec<String>,
    text: String,
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
            let name = line[at + 6..].split(['=', ']']).next().unwrap().to_owned();
            flags.insert(flag.clone(), Some(name));
        }
    }
    Help { flags, required, text }
}

/// Variables read outside the subcommand's flags (so not in its
/// `--help`): the weight store's root, which the store crate reads; the
/// password the Redis URL is built from; `HOME`, where engines keep their
/// caches.
const READ_ELSEWHERE: &[&str] = &["HANGAR_STORE_ROOT", "REDIS_PASSWORD", "HOME", "RUST_LOG", "POD_IP"];

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
        let env = env_of(c);
        // Each flag is the subcommand's.
        let given: BTreeSet<String> = args
            .iter()
            .filter(|a| a.starts_with("--"))
            .map(|a| a.split('=').next().unwrap().to_owned())
            .collect();
        for flag in &given {
            assert!(help.flags.contains_key(flag), "{at}: `hangar {sub}` has no {flag}");
        }
        // Each HANGAR_ variable is one a flag reads (or another's).
        let by_env: BTreeMap<&str, &str> =
            help.flags.iter().filter_map(|(f, e)| Some((e.as_deref()?, f.as_str()))).collect();
        for name in env.keys() {
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
        // The arguments, and the variables as the flags they stand for,
        // through the binary's own parser (`--help` stops it from running;
        // it exits 2 on any flag or value it refuses). `$(VAR)` is expanded
        // by Kubernetes only from the container's variables.
        let mut argv: Vec<String> = args.iter().map(|a| expand(a, &env, &at)).collect();
        for (name, e) in &env {
            if let Some(flag) = by_env.get(name).filter(|f| !given.contains(**f)) {
                argv.push((*flag).to_owned());
                argv.push(sample_value(e, &env, &at));
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
        // The Redis password never shows in `--help`, which prints a
        // variable's value unless told not to.
        let shown = Command::new(env!("CARGO_BIN_EXE_hangar"))
            .args([sub.as_str(), "--help"])
            .env("HANGAR_REDIS", format!("redis://:{SAMPLE_SECRET}@h:6379/0"))
            .output()
            .unwrap();
        assert!(
            !String::from_utf8_lossy(&shown.stdout).contains(SAMPLE_SECRET),
            "{at}: --help shows the password"
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
        let Some(ns) = d.object.namespace() else { continue };
        let ns = ns.as_deref().unwrap_or_else(|| panic!("{}: no namespace", d.origin));
        assert!(namespaces.contains(ns), "{}: namespace `{ns}` is not among {namespaces:?}", d.origin);
    }
    // A workload's selector matches its own pods.
    for w in &ws {
        let pods = w.labels();
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
                    && selector.iter().all(|(k, v)| w.labels().get(k) == Some(v))
            })
            .unwrap_or_else(|| panic!("Service `{name}` selects no workload's pods"));
        for p in spec.ports.iter().flatten() {
            if let Some(IntOrString::String(target)) = &p.target_port {
                assert!(
                    declared_ports(w).contains(target),
                    "Service `{name}`: no container port `{target}` in `{}`",
                    w.name
                );
            }
        }
    }
    // `--config PATH` is a file of a ConfigMap mounted at PATH's directory,
    // `--keys-file PATH` one of a Secret.
    let maps = config_maps(&docs);
    let secrets = readme_secrets();
    for (w, c) in hangar_containers(&ws) {
        let args = c.args.clone().unwrap_or_default();
        if let Some(path) = flag_value(&args, "--config") {
            let (volume, file) = mounted_file(w, c, path);
            let map_name =
                volume.config_map.as_ref().map(|m| m.name.clone()).expect("the config volume is a ConfigMap");
            let map = maps
                .iter()
                .find(|m| {
                    m.metadata.name.as_deref() == Some(map_name.as_str())
                        && m.metadata.namespace == w.namespace
                })
                .unwrap_or_else(|| panic!("{}: no ConfigMap `{map_name}`", w.origin));
            assert!(
                map.data.as_ref().is_some_and(|d| d.contains_key(&file)),
                "ConfigMap `{map_name}` has no `{file}`"
            );
        }
        if let Some(path) = flag_value(&args, "--keys-file") {
            let (volume, file) = mounted_file(w, c, path);
            let secret = volume.secret.as_ref().and_then(|s| s.secret_name.clone());
            let secret = secret.unwrap_or_else(|| panic!("{}: --keys-file is not on a Secret", w.origin));
            assert!(
                secrets.get(&secret).is_some_and(|keys| keys.contains(&file)),
                "{}: README.md makes no Secret `{secret}` with `{file}` ({secrets:?})",
                w.origin
            );
        }
    }
    // Every Secret a variable names is one README.md makes, with that key.
    for (w, c) in containers(&ws) {
        for e in c.env.iter().flatten() {
            let Some(r) = e.value_from.as_ref().and_then(|f| f.secret_key_ref.as_ref()) else { continue };
            assert!(
                secrets.get(&r.name).is_some_and(|keys| keys.contains(&r.key)),
                "{}: variable {} names Secret `{}` key `{}`, which README.md does not make ({secrets:?})",
                w.origin,
                e.name,
                r.name,
                r.key
            );
        }
    }
}

/// The names of a workload's container ports.
fn declared_ports(w: &Workload<'_>) -> BTreeSet<String> {
    w.pod().containers.iter().flat_map(|c| c.ports.iter().flatten()).filter_map(|p| p.name.clone()).collect()
}

/// The volume mounted at `path`'s directory in `c`, and the file's name.
fn mounted_file<'a>(w: &'a Workload<'a>, c: &Container, path: &str) -> (&'a Volume, String) {
    let path = Path::new(path);
    let (dir, file) = (path.parent().unwrap(), path.file_name().unwrap().to_string_lossy().into_owned());
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| Path::new(&m.mount_path) == dir)
        .unwrap_or_else(|| panic!("{}: nothing is mounted at {}", w.origin, dir.display()));
    (w.volume(&mount.name), file)
}

/// A probe's HTTP path and port name, if it is an HTTP probe.
fn http_probe(p: &Probe) -> Option<(&str, String)> {
    let get = p.http_get.as_ref()?;
    let port = match &get.port {
        IntOrString::String(s) => s.clone(),
        IntOrString::Int(i) => i.to_string(),
    };
    Some((get.path.as_deref().unwrap_or("/"), port))
}

/// Every container is probed three ways: started (so a slow start is not
/// killed), ready (so nothing is sent to it before) and alive. Gateways
/// are ready on `/readyz` and alive on `/healthz`; agents, which no
/// Service routes to, on `/health`, which answers once they registered.
/// Each path answers on a real gateway and agent.
#[test]
fn probes_check_the_routes_that_mean_ready_and_alive() {
    let docs = load();
    let ws = workloads(&docs);
    for (w, c) in containers(&ws) {
        let at = format!("{} container `{}`", w.origin, c.name);
        for (what, probe) in [
            ("startup", &c.startup_probe),
            ("readiness", &c.readiness_probe),
            ("liveness", &c.liveness_probe),
        ] {
            let probe = probe.as_ref().unwrap_or_else(|| panic!("{at}: no {what} probe"));
            if let Some((_, port)) = http_probe(probe) {
                assert!(
                    declared_ports(w).contains(&port),
                    "{at}: the {what} probe's port `{port}` is not declared"
                );
            }
        }
    }
    let paths = |sub: &str| -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (w, c) in hangar_runs(&ws, sub) {
            for (what, p) in [
                ("startup", &c.startup_probe),
                ("readiness", &c.readiness_probe),
                ("liveness", &c.liveness_probe),
            ] {
                let (path, _) = http_probe(p.as_ref().unwrap())
                    .unwrap_or_else(|| panic!("{}: an HTTP {what} probe", w.origin));
                out.push((what.to_owned(), path.to_owned()));
            }
        }
        out
    };
    let gateway = paths("serve");
    assert!(
        gateway.contains(&("readiness".into(), "/readyz".into())),
        "gateways are ready on /readyz: {gateway:?}"
    );
    assert!(
        gateway.contains(&("liveness".into(), "/healthz".into())),
        "gateways are alive on /healthz: {gateway:?}"
    );
    let agent = paths("agent");
    // Against the real routes: a gateway of a fleet and an agent, on a
    // private Redis (skipped without redis-server, as the fleet tests are).
    let Some(redis) = hangar_redis::LocalRedis::for_test() else { return };
    let dir = tempfile::tempdir().unwrap();
    let fleet = format!(
        "redis = \"{}\"\n[[models]]\nkey = \"t/a\"\nengine = {{ kind = \"mock\", preset = \"instant\" }}\nsize = \"10GB\"\n",
        redis.url()
    );
    let path = dir.path().join("fleet.toml");
    std::fs::write(&path, &fleet).unwrap();
    let gw = common::serve_in(tempfile::tempdir().unwrap(), &fleet);
    for (what, p) in &gateway {
        // Ready: no model keeps replicas, so every check passes.
        assert_eq!(get_status(&format!("{}{p}", gw.url)), 200, "the gateway's {what} probe {p}");
    }
    let node = common::fleet::agent(dir.path(), &path, &redis.url(), "n0", 1);
    for (what, p) in &agent {
        assert_eq!(get_status(&format!("{}{p}", node.url)), 200, "the agent's {what} probe {p}");
    }
}

/// Pod Security's `restricted` profile, as the namespace enforces it:
/// non-root, the runtime's seccomp profile, no privilege escalation,
/// every capability dropped, a read-only root filesystem, only volumes of
/// the kinds it admits (no hostPath), nothing of the host's.
#[test]
fn every_pod_meets_pod_security_restricted() {
    let docs = load();
    let ns = docs
        .iter()
        .find_map(|d| if let Object::Namespace(n) = &d.object { Some(n) } else { None })
        .expect("a Namespace");
    let labels = ns.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels.get("pod-security.kubernetes.io/enforce").map(String::as_str),
        Some("restricted"),
        "the namespace enforces the restricted profile"
    );
    for w in workloads(&docs) {
        let pod = w.pod();
        let at = w.origin;
        let sc = pod.security_context.as_ref().unwrap_or_else(|| panic!("{at}: no pod securityContext"));
        assert_eq!(sc.run_as_non_root, Some(true), "{at}: runAsNonRoot");
        assert!(sc.run_as_user.is_some_and(|u| u > 0), "{at}: runAsUser, not root");
        let seccomp = sc.seccomp_profile.as_ref().map(|s| s.type_.as_str());
        assert_eq!(seccomp, Some("RuntimeDefault"), "{at}: seccompProfile RuntimeDefault");
        assert_ne!(pod.host_network, Some(true), "{at}: hostNetwork");
        assert_ne!(pod.host_pid, Some(true), "{at}: hostPID");
        assert_ne!(pod.host_ipc, Some(true), "{at}: hostIPC");
        assert_eq!(pod.automount_service_account_token, Some(false), "{at}: no API token it never uses");
        for v in pod.volumes.iter().flatten() {
            let admitted = v.config_map.is_some()
                || v.secret.is_some()
                || v.empty_dir.is_some()
                || v.ephemeral.is_some()
                || v.persistent_volume_claim.is_some()
                || v.projected.is_some()
                || v.downward_api.is_some()
                || v.csi.is_some();
            assert!(admitted, "{at}: volume `{}` is of a kind the restricted profile refuses", v.name);
        }
        for c in pod.containers.iter().chain(pod.init_containers.iter().flatten()) {
            let at = format!("{at} container `{}`", c.name);
            let sc = c.security_context.as_ref().unwrap_or_else(|| panic!("{at}: no securityContext"));
            assert_eq!(sc.allow_privilege_escalation, Some(false), "{at}: allowPrivilegeEscalation");
            assert_ne!(sc.privileged, Some(true), "{at}: privileged");
            assert_eq!(sc.read_only_root_filesystem, Some(true), "{at}: readOnlyRootFilesystem");
            let caps = sc.capabilities.as_ref();
            let dropped = caps.and_then(|c| c.drop.clone()).unwrap_or_default();
            assert_eq!(dropped, ["ALL"], "{at}: capabilities drop ALL");
            assert!(caps.and_then(|c| c.add.as_ref()).is_none_or(Vec::is_empty), "{at}: no capability added");
            assert!(c.ports.iter().flatten().all(|p| p.host_port.is_none()), "{at}: a hostPort");
        }
    }
}

/// No secret in a ConfigMap or a literal: the Redis password and the API
/// and metrics keys come from Secrets, which README.md makes.
#[test]
fn secrets_come_from_secrets_and_never_from_the_config() {
    let docs = load();
    let text = fleet_toml(&docs);
    let file: toml::Table = toml::from_str(&text).unwrap();
    for secret in ["api_keys", "metrics_key", "redis"] {
        assert!(!file.contains_key(secret), "fleet.toml (a ConfigMap) sets `{secret}`: keep it in a Secret");
    }
    let ws = workloads(&docs);
    let from_secret = |c: &Container, name: &str| -> bool {
        env_of(c).get(name).and_then(|e| e.value_from.as_ref()).is_some_and(|f| f.secret_key_ref.is_some())
    };
    for (w, c) in hangar_containers(&ws) {
        let env = env_of(c);
        let url = env.get("HANGAR_REDIS").and_then(|e| e.value.clone()).unwrap_or_default();
        let vars: Vec<&str> = url.split("$(").skip(1).filter_map(|s| s.split(')').next()).collect();
        assert!(
            vars.len() == 1 && from_secret(c, vars[0]),
            "{}: HANGAR_REDIS's password is a variable from a Secret: {url}",
            w.origin
        );
    }
    for (w, c) in hangar_runs(&ws, "serve") {
        let args = c.args.clone().unwrap_or_default();
        assert!(
            flag_value(&args, "--keys-file").is_some(),
            "{}: the gateway's keys come from --keys-file",
            w.origin
        );
    }
    // Redis itself: --requirepass from the same Secret's key.
    let redis = redis_container(&ws);
    let args = redis.args.clone().unwrap_or_default();
    let pass = flag_value(&args, "--requirepass").expect("Redis runs with --requirepass");
    let var = pass.strip_prefix("$(").and_then(|p| p.strip_suffix(')')).expect("--requirepass $(VAR)");
    assert!(from_secret(redis, var), "--requirepass's {var} comes from a Secret");
    let key_of = |c: &Container, var: &str| {
        let e = env_of(c)[var].value_from.clone().unwrap().secret_key_ref.unwrap();
        (e.name, e.key)
    };
    let (gateway, gw) = hangar_runs(&ws, "serve")[0];
    let gw_var = gw
        .env
        .iter()
        .flatten()
        .find(|e| e.value_from.as_ref().is_some_and(|f| f.secret_key_ref.is_some()))
        .unwrap();
    assert_eq!(
        key_of(redis, var),
        key_of(gw, &gw_var.name),
        "{}: the gateways' password is Redis's",
        gateway.origin
    );
}

/// The container running `redis-server`.
fn redis_container<'a>(ws: &'a [Workload<'a>]) -> &'a Container {
    containers(ws)
        .into_iter()
        .map(|(_, c)| c)
        .find(|c| c.command.as_deref() == Some(&["redis-server".to_owned()][..]))
        .expect("a container runs redis-server")
}

/// Redis is a pinned release with a password and its append-only file,
/// and when full refuses writes (`noeviction`) before the kernel would
/// kill it: `maxmemory` below the container's memory limit.
#[test]
fn redis_has_a_password_a_pinned_tag_and_refuses_writes_before_it_is_killed() {
    let docs = load();
    let ws = workloads(&docs);
    let redis = redis_container(&ws);
    let image = redis.image.as_deref().unwrap();
    let tag = image.rsplit_once(':').map(|(_, t)| t).unwrap_or_else(|| panic!("`{image}` has no tag"));
    assert!(
        tag != "latest"
            && tag.split(['.', '-']).filter(|p| p.chars().all(|c| c.is_ascii_digit())).count() >= 3,
        "`{image}`: pin a release (major.minor.patch)"
    );
    let args = redis.args.clone().unwrap_or_default();
    assert_eq!(
        flag_value(&args, "--maxmemory-policy"),
        Some("noeviction"),
        "queued predictions are never evicted"
    );
    assert_eq!(flag_value(&args, "--appendonly"), Some("yes"));
    let max = redis_bytes(flag_value(&args, "--maxmemory").expect("a --maxmemory"));
    let limit = memory_limit(redis).expect("a memory limit on Redis");
    assert!(
        max < limit,
        "maxmemory {max} B must be below the memory limit {limit} B (room for the AOF rewrite's fork)"
    );
    assert!(
        max * 5 <= limit * 4,
        "maxmemory {max} B leaves under a fifth of {limit} B for the fork and buffers"
    );
    assert!(flag_value(&args, "--requirepass").is_some(), "Redis asks for a password");
    // The probes authenticate: redis-cli reads REDISCLI_AUTH.
    assert!(env_of(redis).contains_key("REDISCLI_AUTH"), "the probes' redis-cli needs the password");
}

/// Gateways: at least two, spread over machines, and a disruption budget
/// that keeps one serving through drains without blocking them when none
/// is ready.
#[test]
fn gateways_survive_a_drain_and_a_machine_loss() {
    let docs = load();
    let ws = workloads(&docs);
    for (w, _) in hangar_runs(&ws, "serve") {
        let replicas = w.replicas.expect("gateways are a Deployment");
        assert!(replicas >= 2, "{}: {replicas} gateway(s)", w.origin);
        let anti = w.pod().affinity.as_ref().and_then(|a| a.pod_anti_affinity.as_ref());
        let terms: Vec<_> = anti
            .into_iter()
            .flat_map(|a| {
                let required =
                    a.required_during_scheduling_ignored_during_execution.iter().flatten().cloned();
                let preferred = a
                    .preferred_during_scheduling_ignored_during_execution
                    .iter()
                    .flatten()
                    .map(|p| p.pod_affinity_term.clone());
                required.chain(preferred).collect::<Vec<_>>()
            })
            .collect();
        let spread = terms.iter().any(|t| {
            t.topology_key == "kubernetes.io/hostname"
                && t.label_selector
                    .as_ref()
                    .and_then(|s| s.match_labels.as_ref())
                    .is_some_and(|m| m.iter().all(|(k, v)| w.labels().get(k) == Some(v)))
        });
        assert!(spread, "{}: no pod anti-affinity keeping gateways on different machines", w.origin);
        let pdb = docs
            .iter()
            .find_map(|d| match &d.object {
                Object::PodDisruptionBudget(p)
                    if p.metadata.namespace == w.namespace
                        && p.spec
                            .as_ref()
                            .and_then(|s| s.selector.as_ref())
                            .and_then(|s| s.match_labels.as_ref())
                            .is_some_and(|m| {
                                !m.is_empty() && m.iter().all(|(k, v)| w.labels().get(k) == Some(v))
                            }) =>
                {
                    p.spec.as_ref()
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("{}: no PodDisruptionBudget selects the gateways", w.origin));
        let min = match &pdb.min_available {
            Some(IntOrString::Int(n)) => *n,
            other => panic!("{}: give the budget minAvailable as a count, not {other:?}", w.origin),
        };
        assert!(
            (1..replicas).contains(&min),
            "{}: minAvailable {min} of {replicas} must keep one and allow a drain",
            w.origin
        );
        assert_eq!(
            pdb.unhealthy_pod_eviction_policy.as_deref(),
            Some("AlwaysAllow"),
            "{}: gateways not ready may be evicted",
            w.origin
        );
    }
}

/// Ingress is denied unless a policy admits it, and the policies admit
/// what the fleet uses: anyone to the gateways' API port, agents to the
/// gateways' per-run ports, gateways to the agents' engines, gateways and
/// agents to Redis's port — nobody else to Redis.
#[test]
fn network_policies_admit_only_what_the_fleet_uses() {
    let docs = load();
    let ws = workloads(&docs);
    let policies: Vec<&NetworkPolicy> = docs
        .iter()
        .filter_map(|d| if let Object::NetworkPolicy(p) = &d.object { Some(p) } else { None })
        .collect();
    let selects = |p: &NetworkPolicy, w: &Workload<'_>| {
        let s = p.spec.as_ref().unwrap().pod_selector.as_ref();
        let labels = s.and_then(|s| s.match_labels.clone()).unwrap_or_default();
        p.metadata.namespace == w.namespace && labels.iter().all(|(k, v)| w.labels().get(k) == Some(v))
    };
    let deny_all = policies.iter().any(|p| {
        let spec = p.spec.as_ref().unwrap();
        spec.pod_selector.as_ref().is_none_or(|s| {
            s.match_labels.as_ref().is_none_or(BTreeMap::is_empty) && s.match_expressions.is_none()
        }) && spec.policy_types.as_ref().is_some_and(|t| t.iter().any(|t| t == "Ingress"))
            && spec.ingress.as_ref().is_none_or(Vec::is_empty)
    });
    assert!(deny_all, "no default-deny ingress policy for the namespace");
    // Whether some policy selecting `to` admits pods of `from` (None:
    // anyone) on the named port (None: whatever port).
    let admits = |to: &Workload<'_>, from: Option<&Workload<'_>>, port: Option<&str>| {
        policies
            .iter()
            .filter(|p| selects(p, to))
            .flat_map(|p| p.spec.as_ref().unwrap().ingress.iter().flatten())
            .any(|rule| {
                let source = match (&rule.from, from) {
                    (None, _) => true,
                    (Some(peers), Some(f)) => peers.iter().any(|peer| {
                        peer.namespace_selector.is_none()
                            && peer.ip_block.is_none()
                            && peer
                                .pod_selector
                                .as_ref()
                                .and_then(|s| s.match_labels.as_ref())
                                .is_some_and(|m| m.iter().all(|(k, v)| f.labels().get(k) == Some(v)))
                    }),
                    (Some(peers), None) => peers.is_empty(),
                };
                let on_port = match (&rule.ports, port) {
                    (None, _) => true,
                    (Some(ports), Some(name)) => {
                        ports.iter().any(|p| matches!(&p.port, Some(IntOrString::String(s)) if s == name))
                    }
                    (Some(ports), None) => ports.is_empty(),
                };
                source && on_port
            })
    };
    let (gateway, agent, redis) =
        (workload(&ws, "hangar-gateway"), workload(&ws, "hangar-agent"), workload(&ws, "hangar-redis"));
    for w in &ws {
        assert!(
            policies.iter().any(|p| selects(p, w) && p.spec.as_ref().unwrap().ingress.is_some()),
            "{}: no policy admits anything to it",
            w.origin
        );
    }
    assert!(admits(gateway, None, Some("http")), "clients reach the gateways' API");
    assert!(admits(agent, Some(gateway), None), "gateways reach the agents' engines, on any port");
    assert!(admits(gateway, Some(agent), None), "agents' cog servers reach a run's port on the gateways");
    assert!(!admits(gateway, None, None), "anyone reaches the gateways on any port");
    assert!(
        admits(redis, Some(gateway), Some("redis")) && admits(redis, Some(agent), Some("redis")),
        "gateways and agents reach Redis"
    );
    assert!(!admits(redis, None, Some("redis")), "anyone reaches Redis");
    assert!(!admits(redis, Some(gateway), None), "Redis is open on ports other than its own");
    // Every port a policy names is one its pods declare.
    for p in &policies {
        for w in ws.iter().filter(|w| selects(p, w)) {
            for port in
                p.spec.as_ref().unwrap().ingress.iter().flatten().flat_map(|r| r.ports.iter().flatten())
            {
                if let Some(IntOrString::String(name)) = &port.port {
                    assert!(
                        declared_ports(w).contains(name),
                        "policy {:?}: `{}` declares no port `{name}`",
                        p.metadata.name,
                        w.name
                    );
                }
            }
        }
    }
}

/// The agent's weight store lives on a volume Pod Security admits (not a
/// hostPath), and the store's disk budget keeps it below the volume's
/// size limit, so the kubelet never evicts the pod for it.
#[test]
fn the_store_is_on_an_admitted_volume_and_stays_below_its_limit() {
    let docs = load();
    let ws = workloads(&docs);
    let config: toml::Table = toml::from_str(&fleet_toml(&docs)).unwrap();
    let budget = config
        .get("store")
        .and_then(|s| s.get("disk_budget"))
        .and_then(toml::Value::as_str)
        .map(|b| b.parse::<hangar_core::ByteSize>().unwrap().bytes())
        .expect("fleet.toml's [store] disk_budget");
    for (w, c) in hangar_runs(&ws, "agent") {
        let root =
            env_sample(c, "HANGAR_STORE_ROOT").unwrap_or_else(|| panic!("{}: HANGAR_STORE_ROOT", w.origin));
        let mount = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| Path::new(&root).starts_with(&m.mount_path))
            .unwrap_or_else(|| panic!("{}: nothing mounted at the store's root {root}", w.origin));
        let volume = w.volume(&mount.name);
        assert!(volume.host_path.is_none(), "{}: the store on a hostPath", w.origin);
        let limit = volume
            .empty_dir
            .as_ref()
            .and_then(|e| e.size_limit.as_ref())
            .map(|q| quantity_bytes(&q.0))
            .unwrap_or_else(|| panic!("{}: the store's volume is an emptyDir with a sizeLimit", w.origin));
        assert!(
            budget < limit,
            "{}: disk_budget {budget} B is not below the store volume's {limit} B",
            w.origin
        );
        // Every path the agent writes is a volume (the root is read-only).
        for dir in ["/tmp", &env_sample(c, "HOME").expect("HOME for engines' caches")] {
            assert!(
                c.volume_mounts.iter().flatten().any(|m| m.mount_path == dir && m.read_only != Some(true)),
                "{}: {dir} is not a writable volume",
                w.origin
            );
        }
    }
}

/// An agent's GPU count is the node's, not a number in the manifest: it
/// counts the GPUs the device plugin hands its pod (no --gpus, no
/// HANGAR_GPUS), and the pod asks for as many as the nodes it lands on
/// have.
#[test]
fn an_agent_takes_its_gpu_count_from_the_node() {
    let docs = load();
    let ws = workloads(&docs);
    let agent_help = help("agent");
    let gpus_help = agent_help.text.split("--gpus").nth(1).unwrap_or("");
    assert!(
        gpus_help.contains("/dev/nvidia0"),
        "`hangar agent --help` says --gpus defaults to the device count"
    );
    assert!(!agent_help.required.contains(&"--gpus".to_owned()), "--gpus is required");
    for (w, c) in hangar_runs(&ws, "agent") {
        let args = c.args.clone().unwrap_or_default();
        assert!(
            flag_value(&args, "--gpus").is_none() && env_sample(c, "HANGAR_GPUS").is_none(),
            "{}: a fixed GPU count",
            w.origin
        );
        let limit = c
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("nvidia.com/gpu"))
            .map(|q| q.0.clone())
            .unwrap_or_else(|| panic!("{}: no nvidia.com/gpu limit", w.origin));
        let count = w.pod().node_selector.as_ref().and_then(|s| s.get("nvidia.com/gpu.count")).cloned();
        assert_eq!(count, Some(limit), "{}: the nodes it selects have as many GPUs as it asks for", w.origin);
    }
}

/// One `FROM` stage of a Dockerfile: its image, its name, and its
/// instructions (continuation lines joined).
struct Stage {
    from: String,
    name: Option<String>,
    instructions: Vec<(String, String)>,
}

fn dockerfile() -> Vec<Stage> {
    let text = std::fs::read_to_string(format!("{DIR}/Dockerfile")).expect("deploy/kubernetes/Dockerfile");
    let mut stages: Vec<Stage> = Vec::new();
    let joined = text.replace("\\\n", " ");
    for line in joined.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let (op, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let op = op.to_ascii_uppercase();
        if op == "FROM" {
            let words: Vec<&str> = rest.split_whitespace().filter(|w| !w.starts_with("--")).collect();
            let name =
                words.iter().position(|w| w.eq_ignore_ascii_case("as")).map(|i| words[i + 1].to_owned());
            stages.push(Stage { from: words[0].to_owned(), name, instructions: Vec::new() });
        } else if let Some(stage) = stages.last_mut() {
            stage.instructions.push((op, rest.trim().to_owned()));
        }
    }
    stages
}

/// The image every hangar container runs is the Dockerfile's: its tag is
/// the workspace's version; the build stage compiles `hangar` with the
/// lock file; the final stage copies only the binary onto the `PATH`,
/// runs as the non-root user the pods run as, and its entrypoint is the
/// `hangar` the manifests call. (Building it needs a container engine and
/// a registry; CI checks it here, statically.)
#[test]
fn the_image_is_the_dockerfiles_final_stage_run_as_non_root() {
    let stages = dockerfile();
    assert!(stages.len() >= 2, "a multi-stage build: the toolchain stays out of the image");
    for s in &stages {
        let tag = s.from.rsplit_once(':').map(|(_, t)| t);
        assert!(tag.is_some_and(|t| t != "latest"), "`FROM {}`: pin a tag", s.from);
    }
    let (build, run) = (&stages[..stages.len() - 1], stages.last().unwrap());
    let builds = build.iter().any(|s| {
        s.instructions
            .iter()
            .any(|(op, rest)| op == "RUN" && rest.contains("cargo build --release --locked -p hangar"))
    });
    assert!(builds, "a stage builds `hangar` in release mode with the lock file");
    let of = |op: &str| -> Vec<&str> {
        run.instructions.iter().filter(|(o, _)| o == op).map(|(_, r)| r.as_str()).collect()
    };
    // The final user: numeric (so runAsNonRoot can check it), not 0, and
    // the one the pods run as.
    let user = *of("USER").last().expect("the final stage sets USER");
    let uid: i64 =
        user.split(':').next().unwrap().parse().unwrap_or_else(|_| panic!("USER {user}: give it by number"));
    assert!(uid > 0, "USER {user} is root");
    // The entrypoint, exec form, is the hangar binary copied from a build
    // stage onto the PATH.
    let entry: Vec<String> = serde_json::from_str(of("ENTRYPOINT").last().expect("an ENTRYPOINT"))
        .expect("ENTRYPOINT in exec form");
    let binary = Path::new(&entry[0]);
    assert_eq!(binary.file_name().unwrap(), "hangar", "the entrypoint is hangar");
    let copied = of("COPY").iter().any(|c| {
        let words: Vec<&str> = c.split_whitespace().collect();
        words.iter().any(|w| {
            w.strip_prefix("--from=")
                .is_some_and(|from| build.iter().any(|s| s.name.as_deref() == Some(from)))
        }) && words.last().is_some_and(|dest| Path::new(dest) == binary)
    });
    assert!(copied, "the final stage copies {} from a build stage", binary.display());
    let on_path = ["/usr/local/bin", "/usr/bin", "/bin"];
    assert!(
        on_path.iter().any(|d| binary.parent() == Some(Path::new(d))),
        "{} is on the default PATH",
        binary.display()
    );
    // The manifests run that image and binary, as that user.
    let version = env!("CARGO_PKG_VERSION");
    let docs = load();
    let ws = workloads(&docs);
    for (w, c) in hangar_containers(&ws) {
        let image = c.image.as_deref().unwrap();
        assert!(
            image.ends_with(&format!(":{version}")),
            "{}: `{image}` is not the workspace's version {version}",
            w.origin
        );
        assert_eq!(
            c.command.as_deref(),
            Some(&[binary.file_name().unwrap().to_string_lossy().into_owned()][..])
        );
        let sc = w.pod().security_context.as_ref().unwrap();
        assert_eq!(sc.run_as_user, Some(uid), "{}: the pods run as the image's user", w.origin);
    }
    // The build command the README and the Dockerfile give tags that image.
    let tagged = format!("-t ghcr.io/hangar-serve/hangar:{version}");
    assert!(
        readme().contains(&tagged),
        "README.md's build command tags the version the manifests run ({tagged})"
    );
}
