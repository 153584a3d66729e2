//! Compatibility with the stable `replicate` Python client (1.0.x):
//! `replicate.run` (model and version routes, waiting),
//! `predictions.create / get / wait / list / cancel`, `stream()`, an
//! aborted prediction read without a crash, error classes, and the cog
//! model of `examples/cog-echo` (run, stream, cancel) on the `cog` engine,
//! against `hangar serve` through `REPLICATE_BASE_URL` with an API key. The checks
//! are in `replicate_compat.py`; the interpreter is [`common::python`]'s.

mod common;

use std::process::Command;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/replicate_compat.py");
const API_KEY: &str = "r8-compat-test";

#[test]
fn the_stable_replicate_python_client_works_against_hangar_serve() {
    let python = common::python();
    let config = format!(
        "{}{}\n[[api_keys]]\nkey = \"{API_KEY}\"\naccount = \"compat\"\n",
        common::PREDICTIONS_CONFIG,
        common::cog_echo_model(&python)
    );
    let server = common::serve(&config);
    let o = Command::new(&python)
        .arg(SCRIPT)
        .env("REPLICATE_BASE_URL", &server.url)
        .env("REPLICATE_API_TOKEN", API_KEY)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "replicate_compat.py failed ({}):\n{stdout}\n{stderr}", o.status);
    eprintln!("{stdout}");
}
