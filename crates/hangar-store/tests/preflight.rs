//! Serving preflight: an artifact carrying `__tensorcast_meta__.manifest_json`
//! passes every rule before the store accepts it — on import, on a
//! producer's registration, and when the daemon loads it from a source that
//! never imported it (a fallback directory). One test per rule; each error
//! names the rule and the artifact, and nothing is left visible.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use hangar_store::client::{ClientError, Hold, StoreClient, TargetMemory};
use hangar_store::index::CanonicalIndex;
use hangar_store::preflight::{self, Rule, ServingPolicy, MANIFEST_TENSOR, REQUIRED_FIELDS};
use hangar_store::protocol::Selection;
use hangar_store::synth::{manifest_tensor, model, serving_manifest, specs, write_files, OwnedTensor};
use hangar_store::{BlobStore, StoreError};
use serde_json::{json, Value};

/// A small model and a manifest that is right for it.
fn model_and_manifest(seed: u64) -> (Vec<(String, OwnedTensor)>, Value) {
    let tensors = model(1 << 16, 2, seed);
    let manifest = serving_manifest(&tensors);
    (tensors, manifest)
}

/// `tensors` plus a manifest tensor holding `manifest` bytes, written as
/// safetensors files under `dir`.
fn files_with(dir: &Path, mut tensors: Vec<(String, OwnedTensor)>, manifest: Option<&[u8]>) -> Vec<PathBuf> {
    tensors.extend(manifest.map(manifest_tensor));
    write_files(dir, &tensors, 2).unwrap()
}

/// Imports with `manifest` edited by `edit` under `policy` and returns the
/// refusal, checking it names `rule` and the artifact and left nothing.
fn refused(edit: impl FnOnce(&mut Value), policy: &ServingPolicy, rule: Rule) -> String {
    let (tensors, mut manifest) = model_and_manifest(7);
    edit(&mut manifest);
    refused_bytes(tensors, Some(&serde_json::to_vec(&manifest).unwrap()), policy, rule)
}

fn refused_bytes(
    tensors: Vec<(String, OwnedTensor)>,
    manifest: Option<&[u8]>,
    policy: &ServingPolicy,
    rule: Rule,
) -> String {
    let dir = tempfile::tempdir().unwrap();
    let files = files_with(&dir.path().join("src"), tensors, manifest);
    let store = BlobStore::open(dir.path().join("root")).unwrap();
    let err = match store.import_files_with(&files, &["m:v1".parse().unwrap()], policy) {
        Err(StoreError::Preflight(e)) => e,
        other => panic!("expected the preflight to refuse (rule {rule}), got {other:?}"),
    };
    assert_eq!(err.rule, rule, "{err}");
    let msg = err.to_string();
    assert!(msg.contains(&format!("rule `{rule}`")), "names the rule: {msg}");
    assert!(msg.contains(&err.artifact.to_string()), "names the artifact: {msg}");
    assert!(store.list().unwrap().is_empty() && store.keys().unwrap().is_empty(), "nothing visible");
    msg
}

/// Imports and expects acceptance.
fn accepted(tensors: Vec<(String, OwnedTensor)>, manifest: Option<&Value>, policy: &ServingPolicy) {
    let dir = tempfile::tempdir().unwrap();
    let bytes = manifest.map(|m| serde_json::to_vec(m).unwrap());
    let files = files_with(&dir.path().join("src"), tensors, bytes.as_deref());
    let store = BlobStore::open(dir.path().join("root")).unwrap();
    let report = store.import_files_with(&files, &[], policy).unwrap();
    assert!(store.contains(&report.id));
}

#[test]
fn a_correct_manifest_passes_even_strict_and_no_manifest_is_an_ordinary_artifact() {
    let (tensors, manifest) = model_and_manifest(1);
    accepted(tensors.clone(), Some(&manifest), &ServingPolicy::strict());
    accepted(tensors.clone(), Some(&manifest), &ServingPolicy::default());
    accepted(tensors, None, &ServingPolicy::default());
}

#[test]
fn rule_manifest_required_strict_refuses_an_artifact_without_a_manifest() {
    let (tensors, _) = model_and_manifest(2);
    let msg = refused_bytes(tensors, None, &ServingPolicy::strict(), Rule::ManifestRequired);
    assert!(msg.contains(MANIFEST_TENSOR), "{msg}");
}

#[test]
fn rule_manifest_json_the_manifest_must_parse_as_a_json_object() {
    let (tensors, _) = model_and_manifest(3);
    for bad in [&b"{\"schema_version\": 1,"[..], b"[1, 2]", b"\xff\xfe"] {
        refused_bytes(tensors.clone(), Some(bad), &ServingPolicy::default(), Rule::ManifestJson);
    }
}

#[test]
fn rule_schema_version_must_be_1() {
    let msg = refused(|m| m["schema_version"] = json!(2), &ServingPolicy::default(), Rule::SchemaVersion);
    assert!(msg.contains("schema_version is 2, must be 1"), "{msg}");
    refused(
        |m| drop(m.as_object_mut().unwrap().remove("schema_version")),
        &ServingPolicy::default(),
        Rule::SchemaVersion,
    );
    refused(|m| m["schema_version"] = json!("1"), &ServingPolicy::default(), Rule::SchemaVersion);
}

#[test]
fn rule_artifact_kind_must_be_serving() {
    let msg =
        refused(|m| m["artifact_kind"] = json!("source"), &ServingPolicy::default(), Rule::ArtifactKind);
    assert!(msg.contains("\"source\"") && msg.contains("\"serving\""), "{msg}");
}

#[test]
fn rule_non_empty_each_required_field_must_be_a_non_empty_string() {
    for field in REQUIRED_FIELDS {
        let msg = refused(|m| m[field] = json!(""), &ServingPolicy::default(), Rule::NonEmpty(field));
        assert!(msg.contains(&format!("{field} is empty")), "{msg}");
        refused(
            |m| drop(m.as_object_mut().unwrap().remove(field)),
            &ServingPolicy::default(),
            Rule::NonEmpty(field),
        );
        refused(|m| m[field] = json!(7), &ServingPolicy::default(), Rule::NonEmpty(field));
    }
}

#[test]
fn rule_serving_manifest_ref_must_agree_with_a_strict_policy() {
    let other = |m: &mut Value| m["serving_manifest_ref"] = json!("tensor:somewhere_else");
    let msg = refused(other, &ServingPolicy::strict(), Rule::ServingManifestRef);
    assert!(msg.contains("somewhere_else") && msg.contains(preflight::MANIFEST_REF), "{msg}");
    // Only strict serving runtime checks it.
    let (tensors, mut manifest) = model_and_manifest(7);
    other(&mut manifest);
    accepted(tensors.clone(), Some(&manifest), &ServingPolicy::default());
    // A strict caller may name the ref it expects.
    let policy = ServingPolicy { strict: true, manifest_ref: Some("tensor:somewhere_else".into()) };
    accepted(tensors, Some(&manifest), &policy);
}

#[test]
fn rule_canonical_tensor_count_must_equal_the_index_without_the_manifest() {
    let msg = refused(
        |m| m["canonical_tensor_count"] = json!(5),
        &ServingPolicy::default(),
        Rule::CanonicalTensorCount,
    );
    assert!(msg.contains("the manifest says 5, the canonical index has 4 tensors"), "{msg}");
    refused(
        |m| drop(m.as_object_mut().unwrap().remove("canonical_tensor_count")),
        &ServingPolicy::default(),
        Rule::CanonicalTensorCount,
    );
}

#[test]
fn rule_tensor_schema_hash_must_equal_the_index_without_the_manifest() {
    let msg = refused(
        |m| m["tensor_schema_hash"] = json!("blake3:00"),
        &ServingPolicy::default(),
        Rule::TensorSchemaHash,
    );
    assert!(msg.contains("the manifest says blake3:00") && msg.contains("hashes to blake3:"), "{msg}");
    // The schema is names, dtypes and shapes: a manifest written for a
    // model of another shape fails, even with the same tensor names.
    let (tensors, _) = model_and_manifest(7);
    let (_, for_other_shape) = {
        let other = model(1 << 18, 2, 7);
        let index = CanonicalIndex::build(specs(&other)).unwrap();
        let (_, mut m) = model_and_manifest(7);
        m["tensor_schema_hash"] = json!(preflight::tensor_schema_hash(&index));
        (other, m)
    };
    let bytes = serde_json::to_vec(&for_other_shape).unwrap();
    refused_bytes(tensors, Some(&bytes), &ServingPolicy::default(), Rule::TensorSchemaHash);
}

#[test]
fn a_producers_registration_through_the_daemon_is_checked_strict_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let d = common::daemon(dir.path(), 1 << 30);
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let (tensors, manifest) = model_and_manifest(11);
    let fill = |p: &mut hangar_store::client::Producing, tensors: &[(String, OwnedTensor)]| {
        for (name, t) in tensors {
            p.tensor_mut(name).unwrap().copy_from_slice(&t.data);
        }
    };
    let p = {
        let mut p = c.begin_register(specs(&tensors), vec!["m:plain".parse().unwrap()]).unwrap();
        fill(&mut p, &tensors);
        p
    };
    match c.commit_register_with(p, &ServingPolicy::strict()) {
        Err(ClientError::Preflight(msg)) => {
            assert!(msg.contains("rule `manifest_required`") && msg.contains("hg1:"), "{msg}")
        }
        other => panic!("{other:?}"),
    }
    assert!(c.resolve_key(&"m:plain".parse().unwrap()).is_err(), "a refused registration points no key");

    let bytes = serde_json::to_vec(&manifest).unwrap();
    let mut with = tensors.clone();
    with.push(manifest_tensor(&bytes));
    let mut p = c.begin_register(specs(&with), vec!["m:serving".parse().unwrap()]).unwrap();
    fill(&mut p, &with);
    let report = c.commit_register_with(p, &ServingPolicy::strict()).unwrap();
    assert_eq!(c.resolve_key(&"m:serving".parse().unwrap()).unwrap(), report.id);

    // Without strict, a present but wrong manifest is still refused.
    let mut bad = manifest.clone();
    bad["canonical_tensor_count"] = json!(99);
    let bad = serde_json::to_vec(&bad).unwrap();
    let mut with_bad = tensors;
    with_bad.push(manifest_tensor(&bad));
    let mut p = c.begin_register(specs(&with_bad), vec![]).unwrap();
    fill(&mut p, &with_bad);
    match c.commit_register(p) {
        Err(ClientError::Preflight(msg)) => assert!(msg.contains("rule `canonical_tensor_count`"), "{msg}"),
        other => panic!("{other:?}"),
    }
}

/// An artifact with a wrong manifest that never went through an import —
/// it sits in a fallback directory — is refused when the daemon loads it,
/// into its own memory or into the caller's.
#[test]
fn the_daemon_refuses_a_bad_manifest_it_loads_from_the_fallback() {
    let dir = tempfile::tempdir().unwrap();
    let (tensors, mut manifest) = model_and_manifest(13);
    manifest["artifact_kind"] = json!("source");
    let bytes = serde_json::to_vec(&manifest).unwrap();
    let fallback = dir.path().join("fallback");
    let files = files_with(&fallback.join("org/bad/v1"), tensors, Some(&bytes));
    // Its id, as an import without the preflight would give it: the rules
    // are checked after hashing, so a refused import still names the id.
    let id = match BlobStore::open(dir.path().join("scratch")).unwrap().import_files(&files, &[]) {
        Err(StoreError::Preflight(e)) => e.artifact,
        other => panic!("{other:?}"),
    };
    let root = dir.path().join("node");
    let mut cfg = hangar_store::daemon::DaemonConfig::new(&root, root.join("store.sock"));
    cfg.fallback = Some(fallback.display().to_string());
    let d = hangar_store::daemon::DaemonHandle::start(cfg).unwrap();
    let mut c = StoreClient::connect(d.socket()).unwrap();
    let sel = Selection { artifact_id: id, view: None, key: Some("org/bad:v1".parse().unwrap()) };
    let m = c.materialize(&sel, Hold::Process).unwrap();
    match c.confirm(&m, Duration::from_secs(20)) {
        Err(ClientError::Preflight(msg)) => {
            assert!(msg.contains("rule `artifact_kind`") && msg.contains(&id.to_string()), "{msg}")
        }
        other => panic!("{other:?}"),
    }
    let target = TargetMemory::allocate(m.index.data_len).unwrap();
    match c.materialize_into(&sel, &target, 0) {
        Err(ClientError::Preflight(msg)) => assert!(msg.contains("rule `artifact_kind`"), "{msg}"),
        other => panic!("{other:?}"),
    }
    let (_, _, residents) = c.status().unwrap();
    assert!(residents.is_empty(), "a refused artifact is not resident: {residents:?}");
    std::thread::sleep(Duration::from_millis(200)); // a persist would have started by now
    assert!(!BlobStore::open(&root).unwrap().knows(&id), "nor stored");
}
