//! A procedure's source archive (a gzip-compressed tar) checked and
//! extracted into a directory.
//!
//! Only regular files, directories and symbolic links that stay inside the
//! directory are extracted. Refused, each naming the entry: absolute paths
//! and `..` components (path escapes), symbolic links whose target leaves
//! the directory (lexically, and again once every link is in place), hard
//! links, devices and FIFOs, writing through a link, and more than
//! [`Limits::max_extracted_bytes`] of data (counted over the decompressed
//! stream, so a bomb stops at the limit) or [`Limits::max_entries`]
//! entries. Files get mode 0644 (0755 if any execute bit was set): no
//! setuid, no world-writable files.
//!
//! On any error the partly extracted directory is the caller's to remove
//! ([`extract`] writes only under `dest`).

use std::io::{self, Read};
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Size limits of a source archive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// The most bytes the compressed archive may have.
    pub max_archive_bytes: u64,
    /// The most bytes it may decompress to (the tar stream: headers and
    /// file data).
    pub max_extracted_bytes: u64,
    /// The most entries it may hold.
    pub max_entries: u32,
}

/// Why an archive was refused. Each names the entry at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ArchiveError {
    /// The bytes do not start with gzip's magic number.
    #[error("is not a tar.gz archive: it does not start with gzip's magic bytes (1f 8b){0}")]
    NotGzip(String),
    /// The gzip stream or the tar inside it is malformed.
    #[error("is not a valid tar.gz archive: {0}")]
    Malformed(String),
    /// The compressed archive is over its limit.
    #[error("is over the limit of {limit} bytes compressed (max_archive_bytes)")]
    CompressedTooLarge {
        /// The limit.
        limit: u64,
    },
    /// The archive decompresses to more than its limit.
    #[error("decompresses to more than {limit} bytes (max_extracted_bytes), reached at entry `{at}`")]
    ExtractedTooLarge {
        /// The limit.
        limit: u64,
        /// The entry being read when it was reached.
        at: String,
    },
    /// More entries than allowed.
    #[error("holds more than {limit} entries (the limit)")]
    TooManyEntries {
        /// The limit.
        limit: u32,
    },
    /// An entry's path is absolute or climbs out with `..`.
    #[error("entry `{path}` escapes the source directory: {why}")]
    PathEscapes {
        /// The entry's path as written in the archive.
        path: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A symbolic link pointing outside the directory.
    #[error("entry `{path}` is a link to `{target}`, outside the source directory")]
    LinkEscapes {
        /// The link's path.
        path: String,
        /// Its target.
        target: String,
    },
    /// An entry of a type not extracted.
    #[error("entry `{path}` is a {kind}, which a procedure's source may not hold (only files, directories and links inside it)")]
    Unsupported {
        /// The entry's path.
        path: String,
        /// Its type.
        kind: &'static str,
    },
    /// Writing the entry failed.
    #[error("entry `{path}` could not be written: {source}")]
    Io {
        /// The entry's path.
        path: String,
        /// The error.
        source: io::Error,
    },
}

/// Counts what is read through it and fails past `limit`.
struct Capped<R> {
    inner: R,
    read: u64,
    limit: u64,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        if self.read > self.limit {
            return Err(io::Error::other(OverLimit));
        }
        Ok(n)
    }
}

/// The marker error of [`Capped`].
#[derive(Debug)]
struct OverLimit;

impl std::fmt::Display for OverLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("over the extracted-size limit")
    }
}

impl std::error::Error for OverLimit {}

fn is_over_limit(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|i| i.is::<OverLimit>())
}

/// The entry path's components, checked: relative, no `..`, `.` dropped.
fn relative(path: &Path, shown: &str) -> Result<PathBuf, ArchiveError> {
    let escapes = |why| ArchiveError::PathEscapes { path: shown.to_owned(), why };
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(part) => out.push(part),
            Component::CurDir => {}
            Component::ParentDir => return Err(escapes("it has a `..` component")),
            Component::RootDir | Component::Prefix(_) => return Err(escapes("it is an absolute path")),
        }
    }
    Ok(out)
}

/// Whether `target`, a link at `link` (relative to the root), stays inside
/// the root when read lexically.
fn link_stays_inside(link: &Path, target: &Path) -> bool {
    if target.is_absolute() {
        return false;
    }
    let mut depth: i64 = link.parent().map_or(0, |p| p.components().count() as i64);
    for c in target.components() {
        match c {
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
            Component::ParentDir => {
                depth -= 1;
                if depth < 0 {
                    return false;
                }
            }
            Component::RootDir | Component::Prefix(_) => return false,
        }
    }
    true
}

/// Refuses a write to `rel` under `root` that would go through a link.
fn no_link_on_the_way(root: &Path, rel: &Path, shown: &str) -> Result<(), ArchiveError> {
    let mut at = root.to_path_buf();
    let parts: Vec<_> = rel.components().collect();
    for part in &parts[..parts.len().saturating_sub(1)] {
        at.push(part);
        if std::fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(ArchiveError::PathEscapes {
                path: shown.to_owned(),
                why: "it is written through a link earlier in the archive",
            });
        }
    }
    Ok(())
}

/// Checks `bytes` (a whole tar.gz) against `limits` and extracts it into
/// `dest`, an empty directory that exists. See the module doc for what is
/// refused.
pub fn extract(bytes: &[u8], dest: &Path, limits: &Limits) -> Result<(), ArchiveError> {
    use std::os::unix::fs::PermissionsExt;

    if bytes.len() as u64 > limits.max_archive_bytes {
        return Err(ArchiveError::CompressedTooLarge { limit: limits.max_archive_bytes });
    }
    if !bytes.starts_with(&[0x1f, 0x8b]) {
        let head: String = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ");
        let shown =
            if bytes.is_empty() { ": it is empty".to_owned() } else { format!("; it starts with {head}") };
        return Err(ArchiveError::NotGzip(shown));
    }
    let capped =
        Capped { inner: flate2::read::GzDecoder::new(bytes), read: 0, limit: limits.max_extracted_bytes };
    let mut archive = tar::Archive::new(capped);
    let mut links = Vec::new();
    let mut current = String::from("(the first)");
    let read_error = |e: io::Error, at: &str| {
        if is_over_limit(&e) {
            ArchiveError::ExtractedTooLarge { limit: limits.max_extracted_bytes, at: at.to_owned() }
        } else {
            ArchiveError::Malformed(e.to_string())
        }
    };
    let entries = archive.entries().map_err(|e| read_error(e, &current))?;
    let mut count = 0u32;
    for entry in entries {
        let mut entry = entry.map_err(|e| read_error(e, &current))?;
        count += 1;
        if count > limits.max_entries {
            return Err(ArchiveError::TooManyEntries { limit: limits.max_entries });
        }
        let raw = entry.path().map_err(|e| ArchiveError::Malformed(e.to_string()))?.into_owned();
        let shown = raw.display().to_string();
        current = shown.clone();
        let rel = relative(&raw, &shown)?;
        let io = |source| ArchiveError::Io { path: shown.clone(), source };
        let kind = entry.header().entry_type();
        if rel.as_os_str().is_empty() {
            if kind.is_dir() {
                continue;
            }
            return Err(ArchiveError::PathEscapes { path: shown, why: "it names the directory itself" });
        }
        no_link_on_the_way(dest, &rel, &shown)?;
        let at = dest.join(&rel);
        if let Some(parent) = at.parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        match kind {
            k if k.is_dir() => {
                std::fs::create_dir_all(&at).map_err(io)?;
                std::fs::set_permissions(&at, std::fs::Permissions::from_mode(0o755)).map_err(io)?;
            }
            k if k.is_file() || k == tar::EntryType::Continuous => {
                let executable = entry.header().mode().is_ok_and(|m| m & 0o111 != 0);
                let mut file = std::fs::File::create(&at).map_err(io)?;
                match io::copy(&mut entry, &mut file) {
                    Ok(_) => {}
                    Err(e) if is_over_limit(&e) => {
                        return Err(ArchiveError::ExtractedTooLarge {
                            limit: limits.max_extracted_bytes,
                            at: shown,
                        })
                    }
                    Err(e) => return Err(ArchiveError::Malformed(format!("entry `{shown}`: {e}"))),
                }
                let mode = if executable { 0o755 } else { 0o644 };
                std::fs::set_permissions(&at, std::fs::Permissions::from_mode(mode)).map_err(io)?;
            }
            k if k.is_symlink() => {
                let target = entry
                    .link_name()
                    .map_err(|e| ArchiveError::Malformed(e.to_string()))?
                    .ok_or_else(|| ArchiveError::Malformed(format!("link `{shown}` has no target")))?
                    .into_owned();
                if !link_stays_inside(&rel, &target) {
                    return Err(ArchiveError::LinkEscapes {
                        path: shown,
                        target: target.display().to_string(),
                    });
                }
                std::os::unix::fs::symlink(&target, &at).map_err(io)?;
                links.push((at, shown, target));
            }
            k if k.is_hard_link() => {
                return Err(ArchiveError::Unsupported { path: shown, kind: "hard link" })
            }
            k if k.is_character_special() => {
                return Err(ArchiveError::Unsupported { path: shown, kind: "character device" })
            }
            k if k.is_block_special() => {
                return Err(ArchiveError::Unsupported { path: shown, kind: "block device" })
            }
            k if k.is_fifo() => return Err(ArchiveError::Unsupported { path: shown, kind: "FIFO" }),
            // pax and GNU headers the tar reader has not folded in: nothing
            // to write.
            k if k.is_pax_global_extensions() || k.is_pax_local_extensions() || k.is_gnu_longname() => {}
            _ => return Err(ArchiveError::Unsupported { path: shown, kind: "special entry" }),
        }
    }
    // Links that stay inside one by one may leave it together (a link to a
    // link's parent): resolve each now that all are in place.
    let root = dest.canonicalize().map_err(|source| ArchiveError::Io { path: ".".into(), source })?;
    for (at, shown, target) in links {
        if let Ok(real) = at.canonicalize() {
            if !real.starts_with(&root) {
                return Err(ArchiveError::LinkEscapes { path: shown, target: target.display().to_string() });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) const LIMITS: Limits =
        Limits { max_archive_bytes: 1 << 20, max_extracted_bytes: 4 << 20, max_entries: 100 };

    /// One entry of a test archive.
    pub(crate) enum Entry<'a> {
        File(&'a str, &'a [u8]),
        Dir(&'a str),
        Symlink(&'a str, &'a str),
        HardLink(&'a str, &'a str),
        Fifo(&'a str),
        CharDevice(&'a str),
    }

    /// A tar.gz of `entries`, paths written raw (so `../x` and `/x` can be
    /// made).
    pub(crate) fn tar_gz(entries: &[Entry<'_>]) -> Vec<u8> {
        let mut b = tar::Builder::new(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
        for e in entries {
            let mut h = tar::Header::new_gnu();
            let (path, kind, data, link): (&str, tar::EntryType, &[u8], Option<&str>) = match e {
                Entry::File(p, d) => (p, tar::EntryType::Regular, d, None),
                Entry::Dir(p) => (p, tar::EntryType::Directory, b"", None),
                Entry::Symlink(p, t) => (p, tar::EntryType::Symlink, b"", Some(t)),
                Entry::HardLink(p, t) => (p, tar::EntryType::Link, b"", Some(t)),
                Entry::Fifo(p) => (p, tar::EntryType::Fifo, b"", None),
                Entry::CharDevice(p) => (p, tar::EntryType::Char, b"", None),
            };
            // Raw name bytes: `set_path` refuses `..`, which is the point.
            let name = &mut h.as_old_mut().name;
            name[..path.len()].copy_from_slice(path.as_bytes());
            if let Some(t) = link {
                let l = &mut h.as_old_mut().linkname;
                l[..t.len()].copy_from_slice(t.as_bytes());
            }
            h.set_entry_type(kind);
            h.set_size(data.len() as u64);
            h.set_mode(0o4755);
            h.set_cksum();
            b.append(&h, data).unwrap();
        }
        b.into_inner().unwrap().finish().unwrap()
    }

    fn refused(entries: &[Entry<'_>]) -> ArchiveError {
        let dir = tempfile::tempdir().unwrap();
        extract(&tar_gz(entries), dir.path(), &LIMITS).unwrap_err()
    }

    #[test]
    fn a_plain_source_is_extracted_with_safe_modes() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = tar_gz(&[
            Entry::Dir("pkg/"),
            Entry::File("./predict.py", b"def predict(): return 1\n"),
            Entry::File("pkg/util.py", b"X = 2\n"),
            Entry::Symlink("main.py", "predict.py"),
            Entry::Symlink("pkg/up.py", "../predict.py"),
        ]);
        extract(&bytes, dir.path(), &LIMITS).unwrap();
        assert_eq!(std::fs::read(dir.path().join("pkg/util.py")).unwrap(), b"X = 2\n");
        assert_eq!(std::fs::read(dir.path().join("main.py")).unwrap(), b"def predict(): return 1\n");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("predict.py")).unwrap().permissions().mode();
        assert_eq!(mode & 0o7777, 0o755, "setuid dropped, execute kept");
    }

    #[test]
    fn path_escapes_are_refused() {
        let e = refused(&[Entry::File("../evil.py", b"x")]);
        assert!(matches!(&e, ArchiveError::PathEscapes { path, .. } if path == "../evil.py"), "{e}");
        let e = refused(&[Entry::File("a/../../evil.py", b"x")]);
        assert!(e.to_string().contains("`a/../../evil.py` escapes") && e.to_string().contains(".."), "{e}");
        let e = refused(&[Entry::File("/etc/evil", b"x")]);
        assert!(e.to_string().contains("absolute path"), "{e}");
    }

    #[test]
    fn links_out_of_the_directory_are_refused() {
        let e = refused(&[Entry::Symlink("out", "/etc/passwd")]);
        assert!(
            matches!(&e, ArchiveError::LinkEscapes { path, target } if path == "out" && target == "/etc/passwd")
        );
        let e = refused(&[Entry::Symlink("a/out", "../../x")]);
        assert!(e.to_string().contains("outside the source directory"), "{e}");
        // Each link alone stays inside; together they climb out.
        let e = refused(&[
            Entry::Dir("d/e/"),
            Entry::Symlink("d/e/up", "../.."),
            Entry::Symlink("esc", "d/e/up/.."),
        ]);
        assert!(matches!(&e, ArchiveError::LinkEscapes { path, .. } if path == "esc"), "{e}");
        // Writing through a link (even one pointing inside) is refused.
        let e = refused(&[Entry::Dir("d/"), Entry::Symlink("l", "d"), Entry::File("l/x.py", b"x")]);
        assert!(e.to_string().contains("through a link"), "{e}");
        let e = refused(&[Entry::File("a", b"x"), Entry::HardLink("b", "/etc/shadow")]);
        assert!(matches!(e, ArchiveError::Unsupported { kind: "hard link", .. }), "{e}");
    }

    #[test]
    fn devices_and_fifos_are_refused() {
        let e = refused(&[Entry::CharDevice("dev/null")]);
        assert!(e.to_string().contains("`dev/null` is a character device"), "{e}");
        let e = refused(&[Entry::Fifo("pipe")]);
        assert!(matches!(e, ArchiveError::Unsupported { kind: "FIFO", .. }), "{e}");
    }

    #[test]
    fn what_is_not_a_tar_gz_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let e = extract(b"PK\x03\x04 a zip", dir.path(), &LIMITS).unwrap_err();
        assert!(e.to_string().contains("not a tar.gz") && e.to_string().contains("50 4b 03 04"), "{e}");
        let e = extract(b"", dir.path(), &LIMITS).unwrap_err();
        assert!(e.to_string().contains("empty"), "{e}");
        // gzip of something that is not a tar.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &[7u8; 1024]).unwrap();
        let e = extract(&gz.finish().unwrap(), dir.path(), &LIMITS).unwrap_err();
        assert!(matches!(e, ArchiveError::Malformed(_)), "{e}");
        // A truncated gzip stream.
        let whole = tar_gz(&[Entry::File("predict.py", &[b'x'; 4096])]);
        let e = extract(&whole[..whole.len() / 2], dir.path(), &LIMITS).unwrap_err();
        assert!(matches!(e, ArchiveError::Malformed(_)), "{e}");
    }

    #[test]
    fn size_limits_hold_compressed_and_extracted() {
        let dir = tempfile::tempdir().unwrap();
        // 8 MiB of zeros compresses to a few KiB: a bomb for a 4 MiB limit.
        let zeros = vec![0u8; 8 << 20];
        let bomb = tar_gz(&[Entry::File("big.bin", &zeros)]);
        assert!(bomb.len() < 64 << 10);
        let e = extract(&bomb, dir.path(), &LIMITS).unwrap_err();
        assert!(
            matches!(&e, ArchiveError::ExtractedTooLarge { limit, at } if *limit == 4 << 20 && at == "big.bin"),
            "{e}"
        );
        let small = Limits { max_archive_bytes: 20, ..LIMITS };
        let e = extract(&tar_gz(&[Entry::File("a", &[1; 10])]), dir.path(), &small).unwrap_err();
        assert!(matches!(e, ArchiveError::CompressedTooLarge { limit: 20 }), "{e}");
        let few = Limits { max_entries: 2, ..LIMITS };
        let e = extract(
            &tar_gz(&[Entry::File("a", b""), Entry::File("b", b""), Entry::File("c", b"")]),
            dir.path(),
            &few,
        )
        .unwrap_err();
        assert!(matches!(e, ArchiveError::TooManyEntries { limit: 2 }), "{e}");
    }
}
