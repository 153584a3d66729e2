//! [`DeploymentDelta`]: the ordered steps between two cluster states.

use std::collections::BTreeMap;
use std::sync::Arc;

use hangar_core::ReplicaId;
use serde::{Deserialize, Serialize};

use crate::deployment::{Deployment, Level, NodeId};
use crate::error::DeltaError;

/// Every hot and warm deployment of a cluster, node by node.
///
/// Each node's deployments are shared: cloning a snapshot costs nothing,
/// a snapshot of a cluster shares every node that did not change since
/// the last one ([`Cluster::snapshot`](crate::Cluster::snapshot)), and
/// [`DeploymentDelta::between`] looks only at the nodes whose deployments
/// differ — so a controller that snapshots around every attempt to place
/// pays for what the attempt changed, not for the fleet's size.
#[derive(Debug, Clone, Default)]
pub struct Snapshot(Arc<Parts>);

/// One node's deployments in a [`Snapshot`], shared.
pub(crate) type Part = Arc<BTreeMap<ReplicaId, Deployment>>;

/// What a [`Snapshot`] holds.
#[derive(Debug, Default)]
struct Parts {
    /// The nodes, in order (shared between snapshots while no node joins
    /// or leaves).
    nodes: Arc<Vec<NodeId>>,
    /// Each node's deployments, in the same order.
    parts: Vec<Part>,
    /// Every deployment in one map, built when first asked for.
    flat: std::sync::OnceLock<BTreeMap<ReplicaId, Deployment>>,
}

impl PartialEq for Snapshot {
    fn eq(&self, other: &Self) -> bool {
        self.same_as(other) || self.deployments() == other.deployments()
    }
}

impl Serialize for Snapshot {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.deployments().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Snapshot {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let all = BTreeMap::<ReplicaId, Deployment>::deserialize(deserializer)?;
        Ok(Self::from_deployments(all.into_values()))
    }
}

impl Snapshot {
    /// Collects deployments (later ones replace earlier ones with the same id).
    pub fn from_deployments(deps: impl IntoIterator<Item = Deployment>) -> Self {
        let all: BTreeMap<ReplicaId, Deployment> = deps.into_iter().map(|d| (d.replica_id, d)).collect();
        let mut by_node: BTreeMap<NodeId, BTreeMap<ReplicaId, Deployment>> = BTreeMap::new();
        for d in all.values() {
            by_node.entry(d.node.clone()).or_default().insert(d.replica_id, d.clone());
        }
        let (nodes, parts) = by_node.into_iter().map(|(id, part)| (id, Arc::new(part))).unzip();
        Self::from_parts(Arc::new(nodes), parts)
    }

    /// A snapshot of `nodes` whose deployments are `parts`, in the same
    /// order (each node's replicas on that node).
    pub(crate) fn from_parts(nodes: Arc<Vec<NodeId>>, parts: Vec<Part>) -> Self {
        debug_assert_eq!(nodes.len(), parts.len(), "one part per node");
        Snapshot(Arc::new(Parts { nodes, parts, flat: Default::default() }))
    }

    /// The nodes and their deployments, shared, for a snapshot taken later
    /// to reuse the unchanged ones.
    pub(crate) fn parts(&self) -> (&Arc<Vec<NodeId>>, &[Part]) {
        (&self.0.nodes, &self.0.parts)
    }

    /// Whether `other` is this very snapshot (a clone of it, or taken of
    /// an unchanged cluster): then the two are equal without a look.
    pub fn same_as(&self, other: &Snapshot) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The deployments, by replica id (gathered from the nodes' on first
    /// ask).
    pub fn deployments(&self) -> &BTreeMap<ReplicaId, Deployment> {
        self.0.flat.get_or_init(|| {
            self.0.parts.iter().flat_map(|p| p.iter()).map(|(id, d)| (*id, d.clone())).collect()
        })
    }

    /// The deployments of the nodes whose deployments `self` and `other`
    /// do not share (each side's), by replica id: all that can differ
    /// between the two. A replica that moved between nodes changed both.
    fn unshared<'a>(&'a self, other: &'a Snapshot) -> Unshared<'a> {
        let (mut mine, mut theirs) = (BTreeMap::new(), BTreeMap::new());
        let (a, b) = (&self.0, &other.0);
        if Arc::ptr_eq(&a.nodes, &b.nodes) || a.nodes == b.nodes {
            for (x, y) in a.parts.iter().zip(&b.parts).filter(|(x, y)| !Arc::ptr_eq(x, y)) {
                mine.extend(x.iter());
                theirs.extend(y.iter());
            }
        } else {
            // Nodes joined or left: match the parts by node.
            let by_node =
                |p: &'a Parts| -> BTreeMap<&'a NodeId, &'a Part> { p.nodes.iter().zip(&p.parts).collect() };
            let (ours, others) = (by_node(a), by_node(b));
            let differs =
                |part: &Arc<_>, there: Option<&&Arc<_>>| there.is_none_or(|t| !Arc::ptr_eq(part, t));
            for (node, part) in &ours {
                if differs(part, others.get(node)) {
                    mine.extend(part.iter());
                }
            }
            for (node, part) in &others {
                if differs(part, ours.get(node)) {
                    theirs.extend(part.iter());
                }
            }
        }
        (mine, theirs)
    }
}

/// What [`Snapshot::unshared`] finds: each side's deployments on the
/// nodes that differ.
type Unshared<'a> = (BTreeMap<&'a ReplicaId, &'a Deployment>, BTreeMap<&'a ReplicaId, &'a Deployment>);

/// What one step asks of the node agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// HOT → WARM on the same node.
    ToCache,
    /// Stop the replica and free what it holds.
    Delete,
    /// WARM → HOT on the same node, onto the GPUs in the record.
    FromCache,
    /// Start a new replica on the GPUs in the record.
    Create,
    /// Metadata only (e.g. the dedicated flag); nothing moves.
    Update,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Action::ToCache => "to_cache",
            Action::Delete => "delete",
            Action::FromCache => "from_cache",
            Action::Create => "create",
            Action::Update => "update",
        }
    }
}

/// One step: an action on a deployment (the new record, or for `delete`
/// the old one).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Step<'a> {
    /// What to do.
    pub action: Action,
    /// To which deployment.
    pub deployment: &'a Deployment,
}

/// The changes between two [`Snapshot`]s, each list ordered by node, then
/// replica id.
///
/// Steps, per replica, between an old and a new [`Snapshot`]:
///
/// | old → new | step |
/// |---|---|
/// | absent → HOT | `create` (start the engine, load weights) |
/// | HOT → WARM, same node | `to_cache` (move weights to CPU memory) |
/// | WARM → HOT, same node | `from_cache` (move weights back onto the GPUs listed) |
/// | HOT or WARM → absent | `delete` (stop, free everything) |
/// | HOT → HOT elsewhere, or other GPUs | `delete` then `create` |
/// | same place and level, other metadata | `update` (bookkeeping only) |
///
/// Releases come first: [`DeploymentDelta::steps`] yields every `to_cache`
/// and `delete` before any `from_cache` or `create`, so on each node the GPU
/// memory a new replica is given has been freed by the time it loads (the
/// reference runs cache moves synchronously for the same reason).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DeploymentDelta {
    /// HOT → WARM (new records).
    pub to_cache: Vec<Deployment>,
    /// Gone (old records).
    pub delete: Vec<Deployment>,
    /// WARM → HOT (new records, with their GPUs).
    pub from_cache: Vec<Deployment>,
    /// New hot replicas (new records).
    pub create: Vec<Deployment>,
    /// Same place and level, changed metadata (new records).
    pub update: Vec<Deployment>,
}

fn place(d: Option<&Deployment>) -> String {
    d.map_or_else(|| "absent".to_owned(), |d| format!("{} on {}", d.level, d.node))
}

impl DeploymentDelta {
    /// The delta from `old` to `new`, or which replica changed in a way no
    /// step expresses (appearing warm, or moving nodes while warm).
    pub fn between(old: &Snapshot, new: &Snapshot) -> Result<Self, DeltaError> {
        let mut delta = Self::default();
        if old.same_as(new) {
            return Ok(delta);
        }
        let (olds, news) = old.unshared(new);
        let ids: std::collections::BTreeSet<&ReplicaId> = olds.keys().chain(news.keys()).copied().collect();
        for id in ids {
            let (o, n) = (olds.get(id).copied(), news.get(id).copied());
            match (o, n) {
                (None, None) => {}
                (Some(o), None) => delta.delete.push(o.clone()),
                (None, Some(n)) if n.level == Level::Hot => delta.create.push(n.clone()),
                (Some(o), Some(n)) if o == n => {}
                (Some(o), Some(n)) => match (o.level, n.level, o.node == n.node) {
                    (Level::Hot, Level::Warm, true) => delta.to_cache.push(n.clone()),
                    (Level::Warm, Level::Hot, true) => delta.from_cache.push(n.clone()),
                    (a, b, true) if a == b && same_place(o, n) => delta.update.push(n.clone()),
                    (Level::Hot, Level::Hot, _) => {
                        delta.delete.push(o.clone());
                        delta.create.push(n.clone());
                    }
                    _ => return Err(inexpressible(*id, Some(o), Some(n))),
                },
                (None, Some(n)) => return Err(inexpressible(*id, None, Some(n))),
            }
        }
        for list in [
            &mut delta.to_cache,
            &mut delta.delete,
            &mut delta.from_cache,
            &mut delta.create,
            &mut delta.update,
        ] {
            list.sort_by(|a, b| (&a.node, a.replica_id).cmp(&(&b.node, b.replica_id)));
        }
        Ok(delta)
    }

    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.steps().next().is_none()
    }

    /// The steps in the order to apply them: every release (`to_cache`,
    /// `delete`) before any claim (`from_cache`, `create`), then `update`s.
    pub fn steps(&self) -> impl Iterator<Item = Step<'_>> {
        fn tag(action: Action, list: &[Deployment]) -> impl Iterator<Item = Step<'_>> {
            list.iter().map(move |d| Step { action, deployment: d })
        }
        tag(Action::ToCache, &self.to_cache)
            .chain(tag(Action::Delete, &self.delete))
            .chain(tag(Action::FromCache, &self.from_cache))
            .chain(tag(Action::Create, &self.create))
            .chain(tag(Action::Update, &self.update))
    }

    /// The steps grouped per node, each group in apply order: what each
    /// node agent receives.
    pub fn by_node(&self) -> BTreeMap<&NodeId, Vec<Step<'_>>> {
        let mut out: BTreeMap<&NodeId, Vec<Step<'_>>> = BTreeMap::new();
        for step in self.steps() {
            out.entry(&step.deployment.node).or_default().push(step);
        }
        out
    }

    /// Applies the steps in order to `state`, checking each finds what it
    /// expects. `between(a, b)?.apply(&mut a)` leaves `a == b`. On error
    /// `state` holds the steps applied so far.
    pub fn apply(&self, state: &mut Snapshot) -> Result<(), DeltaError> {
        let mut all = state.deployments().clone();
        let applied = self.apply_to(&mut all);
        *state = Snapshot::from_deployments(all.into_values());
        applied
    }

    /// [`apply`](Self::apply) on the deployments by replica id.
    fn apply_to(&self, state: &mut BTreeMap<ReplicaId, Deployment>) -> Result<(), DeltaError> {
        for step in self.steps() {
            let d = step.deployment;
            let mismatch =
                |why: String| DeltaError::Mismatch { step: step.action.name(), replica: d.replica_id, why };
            let current = state.get(&d.replica_id);
            match step.action {
                Action::Create => {
                    if current.is_some() {
                        return Err(mismatch(format!("it is already {}", place(current))));
                    }
                }
                Action::Delete => {
                    if current != Some(d) {
                        return Err(mismatch(format!(
                            "expected {}, found {}",
                            place(Some(d)),
                            place(current)
                        )));
                    }
                    state.remove(&d.replica_id);
                    continue;
                }
                Action::ToCache | Action::FromCache | Action::Update => {
                    let expect = match step.action {
                        Action::ToCache => Level::Hot,
                        Action::FromCache => Level::Warm,
                        _ => d.level,
                    };
                    if !current.is_some_and(|c| c.level == expect && c.node == d.node) {
                        return Err(mismatch(format!(
                            "expected {expect} on {}, found {}",
                            d.node,
                            place(current)
                        )));
                    }
                }
            }
            state.insert(d.replica_id, d.clone());
        }
        Ok(())
    }
}

/// Same node, level and GPUs: only metadata may differ.
fn same_place(o: &Deployment, n: &Deployment) -> bool {
    o.node == n.node && o.level == n.level && o.gpu_bytes_by_gpu == n.gpu_bytes_by_gpu
}

fn inexpressible(replica: ReplicaId, o: Option<&Deployment>, n: Option<&Deployment>) -> DeltaError {
    DeltaError::Inexpressible { replica, from: place(o), to: place(n) }
}
