//! Compatibility with the official `openai` Python client: chat (streamed
//! and not), completions, embeddings in the client's default base64
//! encoding, `models.list` and its error classes, against `hangar serve`
//! running the built-in demo's mock models behind an API key. The checks
//! themselves are in `openai_compat.py`.
//!
//! The Python interpreter is [`common::python`]'s: `$HANGAR_PYTHON`, or a
//! venv the tests make with `python-requirements.txt`. Without python3 the
//! test fails and says what to install: it never skips.

mod common;

use std::process::Command;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_compat.py");
const API_KEY: &str = "sk-compat-test";

#[test]
fn the_official_openai_python_client_works_against_hangar_serve() {
    let python = common::python();
    let config =
        format!("{}\n[[api_keys]]\nkey = \"{API_KEY}\"\naccount = \"compat\"\n", hangar_runtime::serve::DEMO);
    let server = common::serve(&config);
    let o = Command::new(&python)
        .arg(SCRIPT)
        .arg(format!("{}/v1", server.url))
        .arg(API_KEY)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "openai_compat.py failed ({}):\n{stdout}\n{stderr}", o.status);
    eprintln!("{stdout}");
}
