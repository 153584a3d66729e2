//! `hangar store …`: the content-addressed model-weight store.
//!
//! `import`, `ls`, `stat` and `rm` work on a local store root directly;
//! `get` reads through the node's daemon when one answers on `--socket`
//! (so it can pull from peers and fallbacks) and from the local root
//! otherwise; `serve` runs the daemon, `registry` the peer registry.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use hangar_store::{BlobStore, IdOrKey, StoreKey};

/// Arguments of `hangar store`.
#[derive(Debug, Parser)]
pub struct Args {
    /// Store root directory (blobs, keys).
    #[arg(long, global = true, env = "HANGAR_STORE_ROOT", default_value_os_t = default_root())]
    root: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Import safetensors files as one artifact (idempotent: same content → same id, `existed`).
    Import {
        /// Safetensors files; together they form one artifact.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Keys (`name:tag`) to point at the artifact; may repeat.
        #[arg(long = "key", short)]
        keys: Vec<StoreKey>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List stored artifacts and their keys.
    Ls {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
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
    /// Write an artifact as `DIR/model.safetensors` (every byte verified).
    Get {
        /// Artifact id (`hg1:…`) or key (`name:tag`).
        what: IdOrKey,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
    },
    /// Remove a key (and its artifact if no other key points at it), or an artifact and all its keys.
    Rm {
        /// Artifact id or key.
        what: IdOrKey,
    },
}

fn default_root() -> PathBuf {
    let data = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .unwrap_or_else(|| PathBuf::from("."));
    data.join("hangar/store")
}

/// Runs `hangar store …`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let open =
        || BlobStore::open(&args.root).with_context(|| format!("opening store {}", args.root.display()));
    match args.command {
        Command::Import { files, keys, json } => {
            let report = open()?.import_files(&files, &keys)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                let what = if report.existed { "existed" } else { "imported" };
                println!("{what} {} ({} tensors, {} bytes)", report.id, report.tensors, report.bytes);
            }
        }
        Command::Ls { json } => {
            let list = open()?.list()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                println!("{:<140} {:>14} {:>8}  KEYS", "ID", "BYTES", "TENSORS");
                for a in list {
                    let keys: Vec<String> = a.keys.iter().map(|k| k.to_string()).collect();
                    println!("{:<140} {:>14} {:>8}  {}", a.id, a.bytes, a.tensors, keys.join(","));
                }
            }
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
        Command::Get { what, out } => {
            let store = open()?;
            let art = store.open_artifact(&store.resolve(&what)?)?;
            let map = art.map_verified()?;
            let path = hangar_store::export::write_safetensors(&art.index, &map, &out)?;
            println!("wrote {} ({})", path.display(), art.id);
        }
        Command::Rm { what } => {
            let removed = open()?.remove(&what)?;
            match removed.as_slice() {
                [] => println!("removed key {what}"),
                ids => ids.iter().for_each(|id| println!("removed {id}")),
            }
        }
    }
    Ok(())
}
