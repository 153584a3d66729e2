//! Helpers shared by the agent's integration tests.

use std::collections::BTreeMap;
use std::path::Path;

/// The files of a directory, name → bytes.
pub fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().into_string().unwrap(), std::fs::read(e.path()).unwrap()))
        .collect()
}
