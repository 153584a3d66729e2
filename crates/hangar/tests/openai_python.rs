//! Compatibility with the official `openai` Python client: chat (streamed
//! and not), completions, embeddings in the client's default base64
//! encoding, `models.list` and its error classes, against `hangar serve`
//! running the built-in demo's mock models behind an API key. The checks
//! themselves are in `openai_compat.py`.
//!
//! The Python interpreter is `$HANGAR_OPENAI_PYTHON` (CI installs the
//! client into a venv and sets it); without it the test makes its own venv
//! under the target directory with `python3 -m venv` and installs
//! `openai-requirements.txt` there. Without python3 the test fails and says
//! what to install: it never skips.

mod common;

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::Command;

const REQUIREMENTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai-requirements.txt");
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_compat.py");
const API_KEY: &str = "sk-compat-test";

/// A Python interpreter with the pinned `openai` package.
fn python() -> PathBuf {
    match std::env::var_os("HANGAR_OPENAI_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => bootstrap(&Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv")),
    }
}

/// Creates (once) a venv at `venv` with the pinned requirements.
fn bootstrap(venv: &Path) -> PathBuf {
    let python = venv.join("bin").join("python");
    if !python.exists() {
        match Command::new("python3").arg("-m").arg("venv").arg(venv).output() {
            Err(e) if e.kind() == ErrorKind::NotFound => panic!(
                "python3 is not installed: this test runs the official `openai` Python client. \
                 Install python3 and python3-venv (apt-get install python3 python3-venv), or set \
                 HANGAR_OPENAI_PYTHON to a Python that has `openai` installed"
            ),
            Err(e) => panic!("cannot run python3: {e}"),
            Ok(o) if !o.status.success() => panic!(
                "`python3 -m venv {}` failed (on Debian, install python3-venv):\n{}",
                venv.display(),
                String::from_utf8_lossy(&o.stderr)
            ),
            Ok(_) => {}
        }
    }
    // The marker records what was installed, so a changed pin reinstalls.
    let marker = venv.join("hangar-requirements.txt");
    let wanted = std::fs::read_to_string(REQUIREMENTS).unwrap();
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(wanted.as_str()) {
        let o = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r", REQUIREMENTS])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "installing {REQUIREMENTS} into {} failed:\n{}{}",
            venv.display(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        std::fs::write(&marker, wanted).unwrap();
    }
    python
}

#[test]
fn the_official_openai_python_client_works_against_hangar_serve() {
    let python = python();
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
