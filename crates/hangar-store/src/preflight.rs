//! Serving preflight: the checks an artifact that calls itself a serving
//! artifact must pass before the store accepts it.
//!
//! TensorCast's phase-1 carrier of a serving artifact's self-description is
//! a reserved tensor, [`MANIFEST_TENSOR`] (`__tensorcast_meta__.manifest_json`):
//! its bytes are a JSON manifest. An artifact **without** that tensor is an
//! ordinary artifact and is accepted as it always was (generic loading stays
//! fail-open). An artifact **with** it must pass every rule of [`Rule`], in
//! this order, whatever the policy:
//!
//! 1. `manifest_json`: the bytes parse as a JSON object;
//! 2. `schema_version`: `schema_version == 1`;
//! 3. `artifact_kind`: `artifact_kind == "serving"`;
//! 4. `non_empty(FIELD)`: each of [`REQUIRED_FIELDS`] is a non-empty string;
//! 5. `serving_manifest_ref` (strict only): the manifest's
//!    `serving_manifest_ref`, when it gives one, equals the policy's
//!    ([`MANIFEST_REF`] unless the caller names another);
//! 6. `canonical_tensor_count`: equals the number of tensors in the
//!    canonical index, the manifest tensor excluded;
//! 7. `tensor_schema_hash`: equals [`tensor_schema_hash`] of the canonical
//!    index, the manifest tensor excluded.
//!
//! A [`ServingPolicy`] with `strict` (TensorCast's `ServingRuntimePolicy`,
//! opt-in) also refuses an artifact that has no manifest (rule
//! `manifest_required`): serving startup fails closed without making the
//! whole store serving-only.
//!
//! The check is pure: the caller hands it the id, the canonical index and
//! the manifest tensor's bytes. Imports and registrations run it before
//! anything becomes visible ([`crate::Registration::commit_with`]); the
//! daemon runs it on every artifact it loads or streams into a caller's
//! memory, so an artifact that reached it some other way (a fallback
//! directory) is held to the same contract.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::id::ArtifactId;
use crate::index::{CanonicalIndex, TensorSpec};

/// The reserved tensor that carries a serving artifact's manifest.
pub const MANIFEST_TENSOR: &str = "__tensorcast_meta__.manifest_json";

/// The manifest reference of the phase-1 carrier: what a strict policy
/// expects a manifest's `serving_manifest_ref` to say unless told otherwise.
pub const MANIFEST_REF: &str = "tensor:__tensorcast_meta__.manifest_json";

/// The only manifest schema version accepted.
pub const SCHEMA_VERSION: u64 = 1;

/// The `artifact_kind` of a serving artifact.
pub const ARTIFACT_KIND: &str = "serving";

/// Fields every manifest must carry as non-empty strings.
pub const REQUIRED_FIELDS: [&str; 8] = [
    "framework_name",
    "adapter_version",
    "serving_abi_version",
    "representation_contract_hash",
    "serving_build_digest",
    "tensor_schema_hash",
    "builder_mode",
    "build_pipeline_version",
];

/// Largest manifest read: a manifest holds identity fields, not data.
pub const MAX_MANIFEST: u64 = 1 << 20;

/// What the caller requires of an artifact beyond the always-on rules.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServingPolicy {
    /// Refuse artifacts without a manifest, and check `serving_manifest_ref`.
    #[serde(default)]
    pub strict: bool,
    /// The manifest reference a strict caller expects; [`MANIFEST_REF`] when `None`.
    #[serde(default)]
    pub manifest_ref: Option<String>,
}

impl ServingPolicy {
    /// The strict policy with the phase-1 manifest reference.
    pub fn strict() -> Self {
        ServingPolicy { strict: true, manifest_ref: None }
    }
}

/// One preflight rule; its `Display` is the name errors and docs use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rule {
    /// Strict only: the artifact must carry a manifest.
    ManifestRequired,
    /// The manifest parses as a JSON object.
    ManifestJson,
    /// `schema_version == 1`.
    SchemaVersion,
    /// `artifact_kind == "serving"`.
    ArtifactKind,
    /// The named field is a non-empty string.
    NonEmpty(&'static str),
    /// Strict only: `serving_manifest_ref` agrees with the policy's.
    ServingManifestRef,
    /// `canonical_tensor_count` equals the index's count, manifest excluded.
    CanonicalTensorCount,
    /// `tensor_schema_hash` equals the index's, manifest excluded.
    TensorSchemaHash,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rule::ManifestRequired => f.write_str("manifest_required"),
            Rule::ManifestJson => f.write_str("manifest_json"),
            Rule::SchemaVersion => f.write_str("schema_version"),
            Rule::ArtifactKind => f.write_str("artifact_kind"),
            Rule::NonEmpty(field) => write!(f, "non_empty({field})"),
            Rule::ServingManifestRef => f.write_str("serving_manifest_ref"),
            Rule::CanonicalTensorCount => f.write_str("canonical_tensor_count"),
            Rule::TensorSchemaHash => f.write_str("tensor_schema_hash"),
        }
    }
}

/// An artifact failed a preflight rule; nothing was accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("serving preflight refused artifact {artifact}: rule `{rule}`: {detail}")]
pub struct PreflightError {
    /// The artifact.
    pub artifact: ArtifactId,
    /// The rule it failed.
    pub rule: Rule,
    /// What was found, against what was expected.
    pub detail: String,
}

/// What an accepted artifact is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Accepted {
    /// No manifest: an ordinary artifact (only under a non-strict policy).
    Ordinary,
    /// A serving artifact whose manifest passed every rule.
    Serving {
        /// The manifest's `serving_build_digest`.
        serving_build_digest: String,
        /// The manifest's `framework_name`.
        framework_name: String,
    },
}

/// The tensors the manifest describes: the canonical index's, the manifest
/// tensor excluded, in canonical order.
fn described(index: &CanonicalIndex) -> impl Iterator<Item = &crate::index::IndexEntry> {
    index.tensors.iter().filter(|t| t.name != MANIFEST_TENSOR)
}

/// The number of tensors a manifest's `canonical_tensor_count` must give.
pub fn canonical_tensor_count(index: &CanonicalIndex) -> u64 {
    described(index).count() as u64
}

/// The hash a manifest's `tensor_schema_hash` must give: `blake3:` and the
/// hex BLAKE3 of the compact JSON list of `{name, dtype, shape}` of every
/// tensor of the canonical index but the manifest, in canonical (bytewise
/// name) order — the tensor *schema*, not its bytes and not its layout
/// (offsets follow from the shapes). `hangar store stat` prints it.
pub fn tensor_schema_hash(index: &CanonicalIndex) -> String {
    let schema: Vec<TensorSpec> = described(index)
        .map(|t| TensorSpec { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() })
        .collect();
    let bytes = serde_json::to_vec(&schema).expect("tensor specs serialize");
    format!("blake3:{}", blake3::hash(&bytes).to_hex())
}

/// Runs the preflight on artifact `artifact` with canonical index `index`;
/// `manifest` is the bytes of its [`MANIFEST_TENSOR`], `None` when it has
/// none. Pure: no I/O.
pub fn check(
    artifact: &ArtifactId,
    index: &CanonicalIndex,
    manifest: Option<&[u8]>,
    policy: &ServingPolicy,
) -> Result<Accepted, PreflightError> {
    let fail = |rule: Rule, detail: String| PreflightError { artifact: *artifact, rule, detail };
    let Some(bytes) = manifest else {
        return match policy.strict {
            true => Err(fail(
                Rule::ManifestRequired,
                format!("strict serving policy: the artifact has no tensor `{MANIFEST_TENSOR}`"),
            )),
            false => Ok(Accepted::Ordinary),
        };
    };
    let m: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(bytes).map_err(|e| {
        fail(Rule::ManifestJson, format!("tensor `{MANIFEST_TENSOR}` is not a JSON object: {e}"))
    })?;
    match m.get("schema_version") {
        Some(v) if v.as_u64() == Some(SCHEMA_VERSION) => {}
        Some(v) => {
            return Err(fail(Rule::SchemaVersion, format!("schema_version is {v}, must be {SCHEMA_VERSION}")))
        }
        None => {
            return Err(fail(
                Rule::SchemaVersion,
                format!("schema_version is missing, must be {SCHEMA_VERSION}"),
            ))
        }
    }
    match m.get("artifact_kind") {
        Some(serde_json::Value::String(k)) if k == ARTIFACT_KIND => {}
        Some(v) => {
            return Err(fail(
                Rule::ArtifactKind,
                format!("artifact_kind is {v}, must be \"{ARTIFACT_KIND}\""),
            ))
        }
        None => {
            return Err(fail(
                Rule::ArtifactKind,
                format!("artifact_kind is missing, must be \"{ARTIFACT_KIND}\""),
            ))
        }
    }
    let text = |field: &str| match m.get(field) {
        Some(serde_json::Value::String(s)) => Some(s.as_str()),
        _ => None,
    };
    for field in REQUIRED_FIELDS {
        match m.get(field) {
            Some(serde_json::Value::String(s)) if !s.trim().is_empty() => {}
            Some(serde_json::Value::String(_)) => {
                return Err(fail(Rule::NonEmpty(field), format!("{field} is empty")));
            }
            Some(v) => return Err(fail(Rule::NonEmpty(field), format!("{field} is {v}, not a string"))),
            None => return Err(fail(Rule::NonEmpty(field), format!("{field} is missing"))),
        }
    }
    if policy.strict {
        let want = policy.manifest_ref.as_deref().unwrap_or(MANIFEST_REF);
        match m.get("serving_manifest_ref") {
            None => {}
            Some(serde_json::Value::String(r)) if r == want => {}
            Some(v) => {
                return Err(fail(
                    Rule::ServingManifestRef,
                    format!("the manifest's serving_manifest_ref is {v}, the policy requires \"{want}\""),
                ));
            }
        }
    }
    let count = canonical_tensor_count(index);
    match m.get("canonical_tensor_count") {
        Some(v) if v.as_u64() == Some(count) => {}
        Some(v) => {
            return Err(fail(
                Rule::CanonicalTensorCount,
                format!(
                    "the manifest says {v}, the canonical index has {count} tensors (`{MANIFEST_TENSOR}` excluded)"
                ),
            ));
        }
        None => {
            return Err(fail(
                Rule::CanonicalTensorCount,
                format!("canonical_tensor_count is missing; the canonical index has {count} tensors"),
            ));
        }
    }
    let hash = tensor_schema_hash(index);
    let said = text("tensor_schema_hash").expect("checked non-empty above");
    if said != hash {
        return Err(fail(
            Rule::TensorSchemaHash,
            format!("the manifest says {said}, the canonical index (`{MANIFEST_TENSOR}` excluded) hashes to {hash}"),
        ));
    }
    Ok(Accepted::Serving {
        serving_build_digest: text("serving_build_digest").unwrap_or_default().to_owned(),
        framework_name: text("framework_name").unwrap_or_default().to_owned(),
    })
}

/// [`check`] on canonical data in memory: the manifest's bytes are read
/// from `data` (the artifact's canonical data) at the manifest tensor's
/// place. A manifest larger than [`MAX_MANIFEST`] fails `manifest_json`.
pub fn check_data(
    artifact: &ArtifactId,
    index: &CanonicalIndex,
    data: &[u8],
    policy: &ServingPolicy,
) -> Result<Accepted, PreflightError> {
    let manifest = manifest_range(artifact, index)?;
    check(artifact, index, manifest.map(|(a, b)| &data[a as usize..b as usize]), policy)
}

/// Where the manifest tensor's bytes lie in the canonical data, if it has
/// one; refused (`manifest_json`) when it is too large to be a manifest.
pub fn manifest_range(
    artifact: &ArtifactId,
    index: &CanonicalIndex,
) -> Result<Option<(u64, u64)>, PreflightError> {
    let Some(t) = index.tensor(MANIFEST_TENSOR) else { return Ok(None) };
    if t.len > MAX_MANIFEST {
        return Err(PreflightError {
            artifact: *artifact,
            rule: Rule::ManifestJson,
            detail: format!(
                "tensor `{MANIFEST_TENSOR}` is {} bytes, more than a manifest's {MAX_MANIFEST}",
                t.len
            ),
        });
    }
    Ok(Some((t.offset, t.offset + t.len)))
}
