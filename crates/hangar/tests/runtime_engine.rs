//! The node agent's launcher starting real `hangar engine mock` processes.

use std::path::PathBuf;
use std::time::Duration;

use hangar_agent::engine::{launch, launch_on, EngineSpec, LaunchContext, LaunchError};

fn ctx(timeout: Duration) -> LaunchContext {
    LaunchContext {
        model: "demo".into(),
        gpus: vec![],
        gpu_fraction: 1.0,
        hangar_exe: PathBuf::from(env!("CARGO_BIN_EXE_hangar")),
        mock_setup_timeout: timeout,
        weights: None,
    }
}

#[tokio::test]
async fn a_mock_engine_is_launched_ready_and_stopped() {
    let spec = EngineSpec::mock("fast", 200);
    let engine = launch(&spec, &ctx(Duration::from_secs(60))).await.unwrap();
    let models: serde_json::Value =
        reqwest::get(format!("{}/v1/models", engine.base_url)).await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "demo");
    let health = reqwest::get(format!("{}/health", engine.base_url)).await.unwrap();
    assert_eq!(health.status(), 200, "launch returns only once the engine is ready");
    engine.stop(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn a_mock_engine_that_loads_too_long_is_killed() {
    let spec = EngineSpec::mock("fast", 3_600_000);
    let e = launch(&spec, &ctx(Duration::from_millis(500))).await.unwrap_err();
    assert!(matches!(e, LaunchError::SetupTimeout { .. }), "{e}");
}

/// As a fleet's agent launches it: bound to the engine host (127.0.0.2
/// standing in for the machine's address), and reached there.
#[tokio::test]
async fn a_mock_engine_on_the_engine_host_answers_there() {
    let spec = EngineSpec::mock("fast", 0);
    let engine = launch_on(&spec, &ctx(Duration::from_secs(60)), "127.0.0.2").await.unwrap();
    let port = engine.base_url.strip_prefix("http://127.0.0.2:").expect("the URL names the engine host");
    let models: serde_json::Value =
        reqwest::get(format!("{}/v1/models", engine.base_url)).await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "demo");
    assert!(
        reqwest::get(format!("http://127.0.0.1:{port}/health")).await.is_err(),
        "bound to the host alone"
    );
    engine.stop(Duration::from_secs(5)).await;
}
