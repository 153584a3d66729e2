//! Which adapters are registered, and where an engine loads each from.
//!
//! On a single machine the [`AdapterCatalog`] reads the node's weight
//! store: once, then again when a request names an adapter it does not
//! know (at most every [`REFRESH_EVERY`]) or, behind a request it answered
//! from memory, once what it knows is older than [`STALE_AFTER`]; it
//! exports each served adapter as the directory an engine loads, ahead of
//! need, and holds each adapter a replica's slots load on its engine
//! through the machine's [`AdapterHolds`] (which loads it unless the engine
//! has it, and unloads it once released). On a
//! fleet's gateway it knows what the live nodes' agents publish
//! (`hangar:adapters:NODE`, read by the fleet view when a node's report
//! says its list changed): the fleet serves every adapter some node
//! registers; a load is this gateway's hold of the adapter on the replica,
//! asked of the replica's agent, which loads it on its engine (making its
//! directory on its own disk) unless another gateway's hold has it loaded
//! already, and an unload is this gateway's release of its hold.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hangar_core::{AdapterName, AdapterRef, ModelKey, NodeAdapters, ReplicaId};
use hangar_store::adapters::AdapterEntry;
use hangar_store::{ArtifactId, BlobStore};

use super::engines::AdapterHolds;

/// The least time between two reads of the store's adapters on a request
/// for one the catalog does not know: a newly registered adapter is served
/// within about this long, and unknown names cannot make each request read
/// the store.
pub const REFRESH_EVERY: Duration = Duration::from_secs(1);

/// How old what the catalog knows may grow before a request that finds
/// its adapter in memory has the store read again behind it: an adapter
/// removed from the store stops being served within about this long
/// under traffic (a request for an unknown one reads at once).
pub const STALE_AFTER: Duration = Duration::from_secs(10);

/// The holder a single machine's adapter slots hold adapters as.
const LOCAL_HOLDER: &str = "local";

/// How long a gateway waits for an agent's load of an adapter: a fetch
/// from a peer of a few hundred MB and the engine's load.
const AGENT_LOAD_LIMIT: Duration = Duration::from_secs(120);

/// The adapters registered where this server serves them from.
pub struct AdapterCatalog {
    source: Source,
    known: Mutex<Known>,
}

/// Where the registrations come from.
enum Source {
    /// The node's weight store (a single machine).
    Store(LocalStore),
    /// The fleet's nodes, by their agents' word.
    Fleet(Fleet),
}

/// A fleet gateway's side of the agents.
struct Fleet {
    /// This gateway, the holder its agents know it as.
    gateway: String,
    /// Each live node's agent URL.
    agents: Mutex<HashMap<String, String>>,
}

impl Fleet {
    /// Asks the agent of `node`, which runs `replica`, to `op` (`hold`,
    /// `release`) an adapter there for this gateway's slots of generation
    /// `slots`: `body` names the adapter; an answer that is not a success
    /// fails, naming the path, the status and the agent's message.
    async fn ask(
        &self,
        client: &reqwest::Client,
        node: Option<&str>,
        (replica, slots): (ReplicaId, u64),
        op: &str,
        mut body: serde_json::Value,
    ) -> Result<(), String> {
        let node = node.ok_or("the replica's node is not known")?;
        let agent = self.agents.lock().expect("agents lock").get(node).cloned();
        let agent = agent.ok_or_else(|| format!("node {node} is not a live node of the fleet"))?;
        body["gateway"] = self.gateway.clone().into();
        body["slots"] = slots.into();
        let path = format!("/v1/replicas/{replica}/adapters/{op}");
        let answer = client.post(format!("{agent}{path}")).json(&body).timeout(AGENT_LOAD_LIMIT).send().await;
        match answer.as_ref().is_ok_and(|r| r.status().is_success()) {
            true => Ok(()),
            false => Err(format!(
                "its node's agent answered {path} with {}",
                hangar_agent::capabilities::describe(answer).await
            )),
        }
    }
}

/// A single machine's weight store and the directories exported from it.
struct LocalStore {
    store: BlobStore,
    /// The machine's engines' adapters.
    holds: Arc<AdapterHolds>,
    /// Where adapters are exported as directories engines load.
    exports: PathBuf,
    /// Which registered adapters some model of this server serves.
    serves: Box<dyn Fn(&AdapterRef) -> bool + Send + Sync>,
    /// Exported directories by artifact (a name moved to new bytes is a
    /// new export), once written.
    exported: Mutex<HashMap<ArtifactId, Arc<tokio::sync::OnceCell<PathBuf>>>>,
    /// The background exporter runs.
    exporting: AtomicBool,
    /// A read behind a request runs.
    reading: AtomicBool,
}

#[derive(Default)]
struct Known {
    by_ref: HashMap<AdapterRef, AdapterEntry>,
    /// The bases each adapter name is registered under.
    bases: HashMap<AdapterName, Vec<ModelKey>>,
    read_at: Option<Instant>,
}

impl Known {
    fn set(&mut self, entries: impl IntoIterator<Item = AdapterEntry>) {
        self.by_ref.clear();
        self.bases.clear();
        for e in entries {
            self.bases.entry(e.adapter.name().clone()).or_default().push(e.adapter.base().clone());
            self.by_ref.insert(e.adapter.clone(), e);
        }
        self.read_at = Some(Instant::now());
    }
}

impl AdapterCatalog {
    /// The catalog of the store at `store`'s root, exporting adapters under
    /// `<root>/adapter-dirs`; `serves` says which registered adapters some
    /// model of this server serves (those are exported ahead of need);
    /// `holds`, the machine's engines' adapters.
    pub(crate) fn new(
        store: BlobStore,
        serves: impl Fn(&AdapterRef) -> bool + Send + Sync + 'static,
        holds: Arc<AdapterHolds>,
    ) -> Self {
        let exports = store.root().join(hangar_store::adapters::EXPORT_DIRS);
        let local = LocalStore {
            store,
            holds,
            exports,
            serves: Box::new(serves),
            exported: Mutex::new(HashMap::new()),
            exporting: AtomicBool::new(false),
            reading: AtomicBool::new(false),
        };
        AdapterCatalog { source: Source::Store(local), known: Mutex::new(Known::default()) }
    }

    /// The catalog of the fleet's gateway `gateway`: empty until the fleet
    /// view hands it what the nodes publish ([`AdapterCatalog::set_fleet`]).
    pub fn fleet(gateway: String) -> Self {
        let fleet = Fleet { gateway, agents: Mutex::default() };
        AdapterCatalog { source: Source::Fleet(fleet), known: Mutex::new(Known::default()) }
    }

    /// Makes the catalog what the live `nodes` publish — each node's agent
    /// URL and its adapters — a fleet's gateway's view, on every change.
    /// An adapter some node registers is served; when nodes register
    /// different artifacts under one name, the one most of them register
    /// is (ties: the lowest id), everywhere, and the others are named in
    /// the log: an adapter's name means the same bytes on every replica.
    pub fn set_fleet<'a>(
        &self,
        nodes: impl IntoIterator<Item = (&'a str, &'a str, Option<&'a NodeAdapters>)>,
    ) {
        let Source::Fleet(fleet) = &self.source else { return };
        let mut urls = HashMap::new();
        // Per adapter, per artifact: the nodes registering it, and its bytes.
        let mut votes: BTreeMap<AdapterRef, BTreeMap<String, (Vec<&str>, u64)>> = BTreeMap::new();
        for (node, url, adapters) in nodes {
            urls.insert(node.to_owned(), url.to_owned());
            for a in adapters.iter().flat_map(|a| &a.adapters) {
                let vote = votes.entry(a.adapter.clone()).or_default().entry(a.artifact.clone()).or_default();
                vote.0.push(node);
                vote.1 = a.bytes;
            }
        }
        let mut entries = Vec::new();
        for (adapter, by_artifact) in votes {
            // Most nodes first; among equals, the lowest id (BTreeMap order).
            let (artifact, (nodes, bytes)) = by_artifact
                .iter()
                .rev()
                .max_by_key(|(_, (nodes, _))| nodes.len())
                .expect("an adapter has an artifact");
            if by_artifact.len() > 1 {
                let others: Vec<String> = by_artifact
                    .iter()
                    .filter(|(a, _)| *a != artifact)
                    .map(|(a, (n, _))| format!("{a} on {}", n.join(", ")))
                    .collect();
                tracing::warn!(%adapter, serving = %artifact, on = %nodes.join(", "), others = %others.join("; "),
                    "nodes register different artifacts under one adapter name: serving the one most register");
            }
            match artifact.parse::<ArtifactId>() {
                Ok(id) => entries.push(AdapterEntry { adapter, id, bytes: *bytes, on_disk: true }),
                Err(e) => {
                    tracing::warn!(%adapter, %artifact, "a node publishes an adapter artifact that is not an id: {e}")
                }
            }
        }
        *fleet.agents.lock().expect("agents lock") = urls;
        self.known.lock().expect("adapter catalog lock").set(entries);
    }

    /// The registered adapter `adapter`, reading the store again if it is
    /// not known and the last read is older than [`REFRESH_EVERY`]; else
    /// the bases its name is registered under (maybe none). A fleet's
    /// catalog answers from what the nodes last published.
    ///
    /// # Cancel safety
    /// A read of the store runs to its end on a blocking thread; dropping
    /// the future only loses its answer.
    pub async fn find(
        self: &Arc<Self>,
        adapter: &AdapterRef,
    ) -> Result<Result<AdapterEntry, Vec<ModelKey>>, String> {
        let Source::Store(local) = &self.source else {
            return Ok(self.lookup(adapter, true).0.expect("answered from memory"));
        };
        if let (Some(found), stale) = self.lookup(adapter, false) {
            if stale && !local.reading.swap(true, Ordering::AcqRel) {
                // Answered from memory at once; the store is read behind it,
                // so an adapter removed there is forgotten soon.
                let me = self.clone();
                tokio::spawn(async move {
                    if let Err(e) = me.read().await {
                        tracing::warn!("reading the weight store's adapters: {e}");
                    }
                    if let Source::Store(local) = &me.source {
                        local.reading.store(false, Ordering::Release);
                    }
                });
            }
            return Ok(found);
        }
        self.read().await?;
        Ok(self.lookup(adapter, true).0.expect("answered after a read"))
    }

    /// Reads the store's adapters into memory (removing the exported copies
    /// of those no longer registered), then exports those a model serves
    /// that are not exported yet, in the background (one at a time), so a
    /// request for one pays only its engine's load. A fleet's catalog has
    /// no store to read: nothing to do.
    ///
    /// # Cancel safety
    /// As [`find`](Self::find); the exports go on whatever the caller does.
    pub async fn read(self: &Arc<Self>) -> Result<(), String> {
        let Source::Store(local) = &self.source else { return Ok(()) };
        let (store, exports) = (local.store.clone(), local.exports.clone());
        let read = tokio::task::spawn_blocking(move || {
            let entries = hangar_store::adapters::list(&store, None).map_err(|e| e.to_string())?;
            // Copies of adapters no longer registered go (an engine that
            // loaded one keeps it); pruning is housekeeping, never fatal.
            match hangar_store::adapters::prune_exports(&exports, entries.iter().map(|e| &e.id)) {
                Ok(removed) if !removed.is_empty() => {
                    tracing::info!(
                        removed = removed.len(),
                        "removed exports of adapters no longer registered"
                    )
                }
                Ok(_) => {}
                Err(e) => tracing::warn!("pruning adapter exports: {e}"),
            }
            Ok::<_, String>(entries)
        });
        let entries = read.await.expect("listing adapters does not panic")?;
        self.known.lock().expect("adapter catalog lock").set(entries);
        self.export_served();
        Ok(())
    }

    /// Starts the background exporter unless it runs: it exports every
    /// served adapter not exported yet, looking again after each, and ends
    /// when none is left (an export that fails is tried again on demand).
    fn export_served(self: &Arc<Self>) {
        let Source::Store(local) = &self.source else { return };
        if local.exporting.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            let Source::Store(local) = &me.source else { return };
            let mut failed = std::collections::HashSet::new();
            loop {
                let next = {
                    let exported = local.exported.lock().expect("adapter exports lock");
                    let known = me.known.lock().expect("adapter catalog lock");
                    let done = |e: &AdapterEntry| exported.get(&e.id).is_some_and(|c| c.initialized());
                    known
                        .by_ref
                        .values()
                        .filter(|e| e.on_disk && !done(e) && !failed.contains(&e.id))
                        .find(|e| (local.serves)(&e.adapter))
                        .cloned()
                };
                let Some(entry) = next else { break };
                if let Err(why) = me.export(local, &entry).await {
                    tracing::warn!(adapter = %entry.adapter, "exporting the adapter ahead of need failed: {why}");
                    failed.insert(entry.id);
                }
            }
            local.exporting.store(false, Ordering::Release);
        });
    }

    /// The answer from memory (`None` when the store should be read
    /// first), and whether what is known was read longer than
    /// [`STALE_AFTER`] ago: one look under the lock, on the path of every
    /// adapter request.
    fn lookup(
        &self,
        adapter: &AdapterRef,
        read_now: bool,
    ) -> (Option<Result<AdapterEntry, Vec<ModelKey>>>, bool) {
        let known = self.known.lock().expect("adapter catalog lock");
        let age = known.read_at.map(|at| at.elapsed());
        let stale = age.is_none_or(|age| age > STALE_AFTER);
        if let Some(e) = known.by_ref.get(adapter) {
            return (Some(Ok(e.clone())), stale);
        }
        let fresh = age.is_some_and(|age| age < REFRESH_EVERY);
        let found =
            (read_now || fresh).then(|| Err(known.bases.get(adapter.name()).cloned().unwrap_or_default()));
        (found, stale)
    }

    /// Loads `entry` on `replica`'s engine (on `node`) for the replica's
    /// slots of generation `slots`: held by this server on it — on a
    /// single machine through its [`AdapterHolds`], on a fleet through the
    /// node's agent — answered once the engine has it (at once when it had
    /// it: an engine that slept keeps its adapters).
    ///
    /// # Cancel safety
    /// A hold stays until released (holds are idempotent); dropping the
    /// future only loses its answer.
    pub async fn load(
        self: &Arc<Self>,
        entry: &AdapterEntry,
        (replica, slots): (ReplicaId, u64),
        node: Option<&str>,
        client: &reqwest::Client,
    ) -> Result<(), String> {
        match &self.source {
            Source::Store(local) => {
                let held = local.holds.hold(replica, LOCAL_HOLDER, slots, &entry.adapter, entry.id).await;
                held.map_err(|e| e.to_string())
            }
            Source::Fleet(fleet) => {
                let body = serde_json::json!({"adapter": entry.adapter, "artifact": entry.id.to_string()});
                fleet.ask(client, node, (replica, slots), "hold", body).await
            }
        }
    }

    /// Unloads `adapter` from `replica`'s engine (on `node`) for the
    /// replica's slots of generation `slots`: this server's hold released,
    /// the engine unloading it once nobody holds it.
    ///
    /// # Cancel safety
    /// One request, or none; dropping the future only loses its answer.
    pub async fn unload(
        &self,
        adapter: &AdapterRef,
        (replica, slots): (ReplicaId, u64),
        node: Option<&str>,
        client: &reqwest::Client,
    ) -> Result<(), String> {
        match &self.source {
            Source::Store(local) => {
                local.holds.release(replica, LOCAL_HOLDER, slots, adapter.name());
                Ok(())
            }
            Source::Fleet(fleet) => {
                let body = serde_json::json!({"adapter": adapter});
                fleet.ask(client, node, (replica, slots), "release", body).await
            }
        }
    }

    /// The directory `entry` is exported to on this machine, written once.
    async fn export(&self, local: &LocalStore, entry: &AdapterEntry) -> Result<PathBuf, String> {
        // One cell per artifact: an export waits for another only when it
        // is the same one, never behind unrelated exports.
        let cell = local.exported.lock().expect("adapter exports lock").entry(entry.id).or_default().clone();
        let dir = cell
            .get_or_try_init(|| async {
                let (store, exports, e) = (local.store.clone(), local.exports.clone(), entry.clone());
                tokio::task::spawn_blocking(move || {
                    hangar_store::adapters::export_dir(&store, &e, &exports).map_err(|e| e.to_string())
                })
                .await
                .expect("exporting an adapter does not panic")
            })
            .await?;
        Ok(dir.clone())
    }
}

#[cfg(test)]
mod tests {
    use hangar_core::RegisteredAdapter;

    use super::*;

    fn id(n: u8) -> String {
        format!("hg1:{}:{}", format!("{n:02x}").repeat(32), "00".repeat(32))
    }

    fn published(adapters: &[(&str, u8)]) -> NodeAdapters {
        let adapters = adapters
            .iter()
            .map(|(a, n)| RegisteredAdapter {
                adapter: a.parse().unwrap(),
                artifact: id(*n),
                bytes: u64::from(*n),
            })
            .collect();
        NodeAdapters { digest: "d".into(), adapters }
    }

    /// A fleet's catalog serves what any live node registers; a name that
    /// nodes register with different artifacts is served with the one most
    /// register, the lowest id among equals; what no node registers is
    /// unknown (with the bases its name has), and a node that is gone
    /// takes its registrations with it.
    #[tokio::test]
    async fn a_fleet_serves_what_some_node_registers_one_artifact_a_name() {
        let catalog = Arc::new(AdapterCatalog::fleet("gw-1".into()));
        let find = |a: &'static str| {
            let catalog = catalog.clone();
            async move { catalog.find(&a.parse().unwrap()).await.unwrap() }
        };
        assert_eq!(find("t/m:a").await, Err(vec![]), "nothing before the view's first word");
        let (n0, n1, n2) = (
            published(&[("t/m:a", 2), ("t/m:b", 5)]),
            published(&[("t/m:a", 2), ("t/m:b", 4), ("t/other:c", 7)]),
            published(&[("t/m:a", 1)]),
        );
        catalog.set_fleet([
            ("n0", "http://a0", Some(&n0)),
            ("n1", "http://a1", Some(&n1)),
            ("n2", "http://a2", Some(&n2)),
        ]);
        let a = find("t/m:a").await.unwrap();
        assert_eq!((a.id.to_string(), a.bytes), (id(2), 2), "two nodes of three register artifact 2");
        assert_eq!(find("t/m:b").await.unwrap().id.to_string(), id(4), "one each: the lowest id");
        assert_eq!(find("t/m:c").await, Err(vec!["t/other".parse().unwrap()]));
        catalog.set_fleet([("n0", "http://a0", Some(&n0)), ("n2", "http://a2", Some(&n2))]);
        assert_eq!(find("t/other:c").await, Err(vec![]), "n1 is gone and with it `t/other:c`");
        assert_eq!(find("t/m:b").await.unwrap().id.to_string(), id(5));
        let tied = find("t/m:a").await.unwrap();
        assert_eq!(tied.id.to_string(), id(1), "one node each now: the lowest id");

        let (client, replica) = (reqwest::Client::new(), ReplicaId::from_u128(7));
        let e = catalog.load(&tied, (replica, 1), Some("n1"), &client).await.unwrap_err();
        assert_eq!(e, "node n1 is not a live node of the fleet");
        let e = catalog.unload(&tied.adapter, (replica, 1), None, &client).await.unwrap_err();
        assert_eq!(e, "the replica's node is not known");
    }
}
