//! `hangar store …`: the content-addressed model-weight store.
//!
//! `import`, `import-adapter`, `ls`, `adapters`, `stat` and `rm` work on a
//! local store root directly;
//! `get` reads through the node's daemon when `--socket` (or
//! `HANGAR_STORE_SOCKET`) is given — so it can pull from peers and
//! fallbacks; with `--no-resident` into this command's own memory, the
//! daemon keeping no copy — and from the local root otherwise; `serve` runs the daemon,
//! `registry` the peer registry, `status` asks a daemon what is resident,
//! `bench` measures the store against plain reads and copies, and
//! `synth-adapter` and `synth-model-dir` write a synthetic LoRA adapter
//! directory and a synthetic model directory to import.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use hangar_core::{AdapterRef, ByteSize, ModelKey};
use hangar_store::client::{Hold, StoreClient, TargetMemory};
use hangar_store::daemon::{DaemonConfig, DaemonHandle};
use hangar_store::preflight::{self, ServingPolicy};
use hangar_store::protocol::Selection;
use hangar_store::registry::RegistryHandle;
use hangar_store::view::{ViewPlan, ViewSpec};
use hangar_store::{adapters, directory};
use hangar_store::{BlobStore, IdOrKey, StoreKey};

/// Arguments of `hangar store`.
#[derive(Debug, Parser)]
pub struct Args {
    /// Store root directory (blobs, keys).
    #[arg(long, global = true, env = "HANGAR_STORE_ROOT", default_value_os_t = hangar_store::default_root())]
    root: PathBuf,
    /// The daemon's Unix socket (`serve` listens on it, default `<root>/store.sock`;
    /// `get` goes through the daemon only when this is given).
    #[arg(long, global = true, env = "HANGAR_STORE_SOCKET")]
    socket: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Import files as one artifact (idempotent: same content → same id,
    /// `existed`): `*.safetensors` tensor by tensor, any other file (a GGUF)
    /// whole, as the file an engine opens. One directory is a model
    /// directory (`config.json`, tokenizer files, `*.safetensors` shards,
    /// as `huggingface-cli download --local-dir` writes it), kept as one
    /// directory artifact and handed to an engine as the directory it was.
    Import {
        /// Safetensors files, or whole files; together they form one
        /// artifact. Or one model directory.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Keys (`name:tag`) to point at the artifact; may repeat.
        #[arg(long = "key", short)]
        keys: Vec<StoreKey>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Strict serving policy: refuse an artifact without the manifest
        /// tensor `__tensorcast_meta__.manifest_json` (a present manifest
        /// must pass the serving preflight either way).
        #[arg(long)]
        strict: bool,
        /// With `--strict`: the `serving_manifest_ref` the manifest must
        /// name (default `tensor:__tensorcast_meta__.manifest_json`).
        #[arg(long, requires = "strict")]
        manifest_ref: Option<String>,
    },
    /// Import a LoRA adapter's directory (PEFT's: `adapter_config.json`,
    /// `adapter_model.safetensors` or `.bin`, tokenizer files) as one
    /// artifact registered as adapter ADAPTER of base model BASE
    /// (idempotent: the same files under the same name → `existed`;
    /// other files under a registered name move the name).
    ImportAdapter {
        /// The adapter's directory (flat; hidden entries are skipped).
        dir: PathBuf,
        /// The name to register it under: `BASE:ADAPTER`, the base model's
        /// key and the adapter's name under it.
        #[arg(long, value_name = "BASE:ADAPTER")]
        adapter: AdapterRef,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List known artifacts, their kind (`model`, `model-dir` or `adapter`), their
    /// names (keys, an adapter's `BASE:ADAPTER`) and whether their bytes
    /// are on disk (`no`: the disk budget dropped them; the next load
    /// through the daemon fetches them again from a peer or the fallback).
    Ls {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// List registered adapters: base, name, size of their files, whether
    /// their bytes are on disk, artifact.
    Adapters {
        /// Only the adapters of this base model.
        #[arg(long)]
        base: Option<ModelKey>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Write a synthetic LoRA adapter directory as PEFT saves one (bf16
    /// `lora_A`/`lora_B` of `q_proj` and `v_proj` in every layer, and its
    /// `adapter_config.json`), for benchmarks and tests.
    SynthAdapter {
        /// The directory to write (created).
        dir: PathBuf,
        /// The adapter's `base_model_name_or_path`.
        #[arg(long, default_value = "synth/base")]
        base_model: String,
        /// LoRA rank `r`.
        #[arg(long, default_value_t = 16)]
        rank: usize,
        /// Hidden size of the base model.
        #[arg(long, default_value_t = 4096)]
        hidden: usize,
        /// Layers of the base model.
        #[arg(long, default_value_t = 32)]
        layers: usize,
        /// Seed of the weights' bytes.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Write a synthetic Hugging Face model directory (a small Llama-style
    /// model: `config.json`, tokenizer files, `bf16` weights in safetensors
    /// shards and their index), for benchmarks and tests.
    SynthModelDir {
        /// The directory to write (created).
        dir: PathBuf,
        /// Hidden size.
        #[arg(long, default_value_t = 256)]
        hidden: usize,
        /// Layers.
        #[arg(long, default_value_t = 4)]
        layers: usize,
        /// Safetensors shards the weights are split into.
        #[arg(long, default_value_t = 2)]
        shards: usize,
        /// Seed of the weights' bytes.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Show an artifact's tensors.
    Stat {
        /// Artifact id (`hg1:…`) or key (`name:tag`).
        what: IdOrKey,
        /// Also read and verify every byte against its hash.
        #[arg(long)]
        verify: bool,
        /// Print the canonical index as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write an artifact (or a view of it) as `DIR/model.safetensors` (a
    /// whole-file artifact as `DIR/<its file name>`, an adapter or a model
    /// directory as the files of its directory); every byte verified.
    Get {
        /// Artifact id (`hg1:…`) or key (`name:tag`).
        what: IdOrKey,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Tensor-parallel view `RANK/WORLD:GLOB=DIM,…`, e.g. `0/2:*.weight=0`.
        #[arg(long)]
        view: Option<ViewSpec>,
        /// Through the daemon (needs `--socket`): have it stream the bytes
        /// straight into this command's own memory (`MaterializeIntoTarget`)
        /// and keep no copy, so exporting leaves the daemon's resident set
        /// (what running replicas use) as it was.
        #[arg(long, requires = "socket")]
        no_resident: bool,
    },
    /// Run the per-node daemon (until killed).
    Serve(ServeArgs),
    /// Run the peer registry daemons heartbeat to (until killed).
    Registry {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:7700")]
        listen: SocketAddr,
        /// Forget a daemon not heard from for this many ms.
        #[arg(long, default_value_t = 10_000)]
        ttl_ms: u64,
    },
    /// Show what a daemon holds resident.
    Status,
    /// Remove a key (and its artifact if no other name points at it), an
    /// artifact and all its names, or with `--adapter` an adapter's name
    /// (and its artifact unless a key points at it).
    #[command(group(clap::ArgGroup::new("removed").required(true).args(["what", "adapter"])))]
    Rm {
        /// Artifact id or key.
        what: Option<IdOrKey>,
        /// An adapter's name, `BASE:ADAPTER`.
        #[arg(long, value_name = "BASE:ADAPTER")]
        adapter: Option<AdapterRef>,
    },
}

/// Arguments of `hangar store serve`.
#[derive(Debug, Parser)]
struct ServeArgs {
    /// TCP address for peers and `/metrics` (e.g. `0.0.0.0:7701`); omit to serve local clients only.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// URL peers should use to reach this daemon (default `http://<listen>`).
    #[arg(long)]
    advertise: Option<String>,
    /// Node name reported to the registry (default: host name). One
    /// daemon's: the registry refuses a name another live daemon holds, so
    /// a second daemon on one host needs its own.
    #[arg(long)]
    node: Option<String>,
    /// Resident memory budget, e.g. `64GiB`.
    #[arg(long, default_value = "4GiB")]
    budget: ByteSize,
    /// Disk budget of the blob store, e.g. `500GB`: the bytes of artifacts
    /// beyond it are dropped least recently used first, never one a lease
    /// or a running replica uses; their keys stay, and the next load fetches
    /// them again from a peer or the fallback (default: no limit).
    #[arg(long)]
    disk_budget: Option<ByteSize>,
    /// Registry base URL, e.g. `http://10.0.0.2:7700`.
    #[arg(long)]
    registry: Option<String>,
    /// Heartbeat period to the registry, ms.
    #[arg(long, default_value_t = 2_000)]
    heartbeat_ms: u64,
    /// Fallback source: a directory or object-store URL (`file:///srv/weights`).
    #[arg(long)]
    fallback: Option<String>,
    /// Abandon a peer that sends nothing for this many ms.
    #[arg(long, default_value_t = 5_000)]
    peer_timeout_ms: u64,
    /// Publishes of one artifact within this many ms of the first join its
    /// publish context and are not repeated (0: publish every time).
    #[arg(long, default_value_t = hangar_store::publish::DEFAULT_WINDOW_MS)]
    publish_dedupe_ms: u64,
    /// Testing aid: stop sending artifact data to peers after this many bytes.
    #[arg(long, hide = true)]
    fault_stall_peer_after: Option<u64>,
}

/// Runs `hangar store …`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let open =
        || BlobStore::open(&args.root).with_context(|| format!("opening store {}", args.root.display()));
    match args.command {
        Command::Import { files, keys, json, strict, manifest_ref } if matches!(files.as_slice(), [one] if one.is_dir()) =>
        {
            anyhow::ensure!(
                !strict && manifest_ref.is_none(),
                "--strict applies to files, not to a model directory"
            );
            let report = directory::import_model_dir(&open()?, &files[0], &keys)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                let what = if report.existed { "existed" } else { "imported" };
                println!(
                    "{what} {} (model directory: {} files, {} tensors, {} bytes)",
                    report.id,
                    report.files.len(),
                    report.tensors,
                    report.bytes
                );
                if !report.skipped.is_empty() {
                    println!("skipped hidden entries: {}", report.skipped.join(", "));
                }
            }
        }
        Command::Import { files, keys, json, strict, manifest_ref } => {
            let policy = ServingPolicy { strict, manifest_ref };
            let report = open()?.import_files_with(&files, &keys, &policy)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                let what = if report.existed { "existed" } else { "imported" };
                println!("{what} {} ({} tensors, {} bytes)", report.id, report.tensors, report.bytes);
            }
        }
        Command::ImportAdapter { dir, adapter, json } => {
            let report = adapters::import_dir(&open()?, &dir, &adapter)?;
            for w in &report.warnings {
                eprintln!("warning: {w}");
            }
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                let what = if report.existed { "existed" } else { "imported" };
                println!(
                    "{what} {} as {} ({} files, {} bytes)",
                    report.id,
                    report.adapter,
                    report.files.len(),
                    report.bytes
                );
                if let Some(old) = report.moved_from {
                    println!(
                        "moved {} from {old}, which is still stored (`hangar store rm {old}` removes it)",
                        report.adapter
                    );
                }
                if !report.skipped.is_empty() {
                    println!("skipped hidden entries: {}", report.skipped.join(", "));
                }
            }
        }
        Command::Ls { json } => {
            let list = open()?.list()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                println!(
                    "{:<140} {:>14} {:>8} {:>7} {:<9}  NAMES",
                    "ID", "BYTES", "TENSORS", "ON_DISK", "KIND"
                );
                for a in list {
                    let names: Vec<String> = a
                        .keys
                        .iter()
                        .map(|k| k.to_string())
                        .chain(a.adapter.map(|r| r.to_string()))
                        .collect();
                    println!(
                        "{:<140} {:>14} {:>8} {:>7} {:<9}  {}",
                        a.id,
                        a.bytes,
                        a.tensors,
                        yes_no(a.on_disk),
                        a.kind.as_str(),
                        names.join(",")
                    );
                }
            }
        }
        Command::Adapters { base, json } => {
            let list = adapters::list(&open()?, base.as_ref())?;
            if json {
                let rows: Vec<serde_json::Value> = list
                    .iter()
                    .map(|e| {
                        serde_json::json!({
                            "adapter": e.adapter,
                            "base": e.adapter.base(),
                            "name": e.adapter.name(),
                            "id": e.id,
                            "bytes": e.bytes,
                            "on_disk": e.on_disk,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                let width = |f: &dyn Fn(&adapters::AdapterEntry) -> usize, title: &str| {
                    list.iter().map(f).chain([title.len()]).max().unwrap_or(0)
                };
                let wb = width(&|e| e.adapter.base().as_str().len(), "BASE");
                let wn = width(&|e| e.adapter.name().as_str().len(), "ADAPTER");
                println!("{:<wb$} {:<wn$} {:>14} {:>7}  ID", "BASE", "ADAPTER", "BYTES", "ON_DISK");
                for e in &list {
                    println!(
                        "{:<wb$} {:<wn$} {:>14} {:>7}  {}",
                        e.adapter.base().as_str(),
                        e.adapter.name().as_str(),
                        e.bytes,
                        yes_no(e.on_disk),
                        e.id
                    );
                }
            }
        }
        Command::SynthAdapter { dir, base_model, rank, hidden, layers, seed } => {
            let files =
                hangar_store::synth::synth_adapter_dir(&dir, &base_model, rank, hidden, layers, seed)?;
            let mut bytes = 0;
            for f in &files {
                bytes += std::fs::metadata(f).with_context(|| format!("reading {}", f.display()))?.len();
            }
            println!("wrote {} ({} files, {bytes} bytes)", dir.display(), files.len());
        }
        Command::SynthModelDir { dir, hidden, layers, shards, seed } => {
            let files = hangar_store::synth::synth_model_dir(&dir, hidden, layers, shards, seed)?;
            let mut bytes = 0;
            for f in &files {
                bytes += std::fs::metadata(f).with_context(|| format!("reading {}", f.display()))?.len();
            }
            println!("wrote {} ({} files, {bytes} bytes)", dir.display(), files.len());
        }
        Command::Stat { what, verify, json } => {
            let store = open()?;
            let id = store.resolve(&what)?;
            let art = store.open_artifact(&id)?;
            if verify {
                art.map_verified()?;
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&art.index)?);
            } else {
                println!("id       {id}");
                println!("bytes    {}", art.index.data_len);
                println!("tensors  {}", art.index.tensors.len());
                if verify {
                    println!("verified {} chunks", art.chunk_hashes.len());
                }
                // What a serving manifest for these tensors must say.
                println!(
                    "schema   {} ({} tensors, `{}` excluded)",
                    preflight::tensor_schema_hash(&art.index),
                    preflight::canonical_tensor_count(&art.index),
                    preflight::MANIFEST_TENSOR
                );
                let serving = match art.index.tensor(preflight::MANIFEST_TENSOR) {
                    None => "none (an ordinary artifact)".to_owned(),
                    Some(_) => {
                        let data = art.map_verified()?;
                        match preflight::check_data(&id, &art.index, &data, &ServingPolicy::default()) {
                            Ok(preflight::Accepted::Serving { framework_name, serving_build_digest }) => {
                                format!("manifest ok ({framework_name}, build {serving_build_digest})")
                            }
                            Ok(preflight::Accepted::Ordinary) => unreachable!("it has a manifest"),
                            Err(e) => format!("manifest refused: {e}"),
                        }
                    }
                };
                println!("serving  {serving}");
                for t in &art.index.tensors {
                    println!(
                        "  {:<48} {:<8} {:<20} @{}",
                        t.name,
                        t.dtype.to_string(),
                        format!("{:?}", t.shape),
                        t.offset
                    );
                }
            }
        }
        Command::Get { what, out, view, no_resident } => match &args.socket {
            Some(socket) if no_resident => get_into_own_memory(socket, what, view, &out)?,
            Some(socket) => get_via_daemon(socket, what, view, &out)?,
            None => {
                let store = open()?;
                let art = store.open_artifact(&store.resolve(&what)?)?;
                let path = match view {
                    None => hangar_store::export::write_artifact(&art.index, &art.map_verified()?, &out)?,
                    Some(spec) => {
                        let plan = ViewPlan::new(&art.index, &spec)?;
                        let mut data = vec![0u8; plan.index.data_len as usize];
                        plan.execute(art.index.data_len, &mut data, |i, buf| art.read_chunk(i, buf))?;
                        hangar_store::export::write_safetensors(&plan.index, &data, &out)?
                    }
                };
                println!("wrote {} ({})", path.display(), art.id);
            }
        },
        Command::Serve(s) => {
            let mut cfg = DaemonConfig::new(
                &args.root,
                args.socket.clone().unwrap_or_else(|| args.root.join("store.sock")),
            );
            cfg.listen = s.listen;
            cfg.advertise = s.advertise;
            if let Some(node) = s.node {
                cfg.node = node;
            }
            cfg.budget = s.budget.bytes();
            cfg.disk_budget = s.disk_budget.map(|b| b.bytes());
            cfg.registry = s.registry.map(|r| r.trim_end_matches('/').to_owned());
            cfg.heartbeat = Duration::from_millis(s.heartbeat_ms);
            cfg.fallback = s.fallback;
            cfg.peer_timeout = Duration::from_millis(s.peer_timeout_ms);
            cfg.fault_stall_after = s.fault_stall_peer_after;
            cfg.publish_dedupe_window = Duration::from_millis(s.publish_dedupe_ms);
            let handle = DaemonHandle::start(cfg).context("starting the store daemon")?;
            match handle.http_addr() {
                Some(addr) => println!("serving {} and http://{addr}", handle.socket().display()),
                None => println!("serving {}", handle.socket().display()),
            }
            handle.wait();
        }
        Command::Registry { listen, ttl_ms } => {
            let handle =
                RegistryHandle::start(listen, ttl_ms).with_context(|| format!("binding {listen}"))?;
            println!("registry at {}", handle.url());
            handle.wait();
        }
        Command::Status => {
            let socket = args.socket.clone().unwrap_or_else(|| args.root.join("store.sock"));
            let (used, budget, residents) = StoreClient::connect(&socket)?.status()?;
            println!("resident {used} of {budget} bytes");
            for r in residents {
                println!(
                    "  {} {:>14} bytes {:>3} refs{}",
                    r.id,
                    r.bytes,
                    r.refs,
                    if r.ready { "" } else { " (loading)" }
                );
            }
        }
        Command::Rm { what: Some(what), .. } => {
            let removed = open()?.remove(&what)?;
            match removed.as_slice() {
                [] => println!("removed key {what}"),
                ids => ids.iter().for_each(|id| println!("removed {id}")),
            }
        }
        Command::Rm { what: None, adapter } => {
            let adapter = adapter.expect("clap requires WHAT or --adapter");
            let removed = adapters::remove(&open()?, &adapter)?;
            match removed.artifact_removed {
                true => println!("removed adapter {adapter} and {}", removed.id),
                false => println!("removed adapter {adapter}; {} stays (a key points at it)", removed.id),
            }
        }
    }
    Ok(())
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// A client of the daemon at `socket` and the selection `what` (an id,
/// or a key resolved by the daemon) with `view` names.
fn select(
    socket: &std::path::Path,
    what: IdOrKey,
    view: Option<ViewSpec>,
) -> anyhow::Result<(StoreClient, Selection)> {
    let mut client = StoreClient::connect(socket)?;
    let (artifact_id, key) = match what {
        IdOrKey::Id(id) => (id, None),
        IdOrKey::Key(k) => (client.resolve_key(&k)?, Some(k)),
    };
    Ok((client, Selection { artifact_id, view, key }))
}

/// `get` through the daemon: resolve, materialize (any source), confirm, write, unload.
fn get_via_daemon(
    socket: &std::path::Path,
    what: IdOrKey,
    view: Option<ViewSpec>,
    out: &std::path::Path,
) -> anyhow::Result<()> {
    let (mut client, selection) = select(socket, what, view)?;
    let m = client.materialize(&selection, Hold::Process)?;
    let confirmed = client.confirm(&m, Duration::from_secs(30))?;
    let path = hangar_store::export::write_artifact(&m.index, m.data(), out)?;
    client.unload(&m)?;
    println!("wrote {} ({}, from {})", path.display(), m.id, confirmed.source.as_str());
    Ok(())
}

/// `get --no-resident`: resolve, `Describe` for the size, allocate this
/// process's own memory (a memfd sealed against resizing), have the daemon
/// stream the artifact or view into it (`MaterializeIntoTarget`: verified,
/// no reference taken, nothing kept resident), write it out.
///
/// Why a memfd the CLI creates rather than mapping the output file: the
/// daemon accepts only a memfd sealed against shrinking, because it writes
/// through a mapping and a file shrunk under it would fault the daemon; a
/// regular output file cannot carry that seal. The export format (a
/// safetensors header before the data) differs from the canonical layout
/// anyway, so the bytes are written out once, as `get` always does.
fn get_into_own_memory(
    socket: &std::path::Path,
    what: IdOrKey,
    view: Option<ViewSpec>,
    out: &std::path::Path,
) -> anyhow::Result<()> {
    let (mut client, sel) = select(socket, what, view)?;
    let (_, layout) = client.describe(&sel)?;
    let target = TargetMemory::allocate(layout.data_len).context("allocating memory for the artifact")?;
    let done = client.materialize_into(&sel, &target, 0)?;
    let path =
        hangar_store::export::write_artifact(&done.index, &target.bytes()[..done.bytes as usize], out)?;
    println!("wrote {} ({}, from {}, nothing kept resident)", path.display(), done.id, done.source.as_str());
    Ok(())
}
