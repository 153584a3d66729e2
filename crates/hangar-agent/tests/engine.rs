//! Engine launching with real processes: an OpenAI-style command template
//! (a Python HTTP server stands in for vLLM), failures, and stopping.

use std::path::PathBuf;
use std::time::Duration;

use hangar_agent::engine::{launch, EngineSpec, LaunchContext, LaunchError};

fn ctx() -> LaunchContext {
    LaunchContext {
        model: "m".into(),
        gpus: vec![0, 1],
        gpu_fraction: 0.5,
        hangar_exe: PathBuf::from("/nonexistent/hangar"),
        mock_setup_timeout: Duration::from_secs(30),
        weights: None,
    }
}

fn openai(command: &str, readiness_path: &str, setup_timeout_s: u64) -> EngineSpec {
    EngineSpec::Openai { command: command.into(), readiness_path: readiness_path.into(), setup_timeout_s }
}

#[tokio::test]
async fn a_templated_server_starts_on_a_free_port_and_stops() {
    let spec = openai("python3 -m http.server {port} --bind 127.0.0.1", "/", 60);
    let mut engine = launch(&spec, &ctx()).await.unwrap();
    assert!(engine.base_url.starts_with("http://127.0.0.1:"));
    let pid = engine.pid().unwrap();
    let body = reqwest::get(&engine.base_url).await.unwrap();
    assert_eq!(body.status(), 200);
    assert!(!engine.has_exited());
    engine.stop(Duration::from_secs(5)).await;
    let alive =
        rustix::process::test_kill_process(rustix::process::Pid::from_raw(pid as i32).unwrap()).is_ok();
    assert!(!alive, "the engine process {pid} is gone");
}

#[tokio::test]
async fn failures_are_clear_and_leave_no_process() {
    let e = launch(&openai("/nonexistent/vllm serve {model}", "/health", 5), &ctx()).await.unwrap_err();
    assert!(matches!(e, LaunchError::Spawn { .. }), "{e}");
    assert!(e.to_string().starts_with("cannot start `/nonexistent/vllm`"), "{e}");
    let e = launch(&openai("false", "/health", 5), &ctx()).await.unwrap_err();
    assert!(matches!(e, LaunchError::Exited { .. }), "{e}");
    let e = launch(&openai("sleep 30", "/health", 1), &ctx()).await.unwrap_err();
    assert!(matches!(e, LaunchError::SetupTimeout(_)), "{e}");
    let e = launch(&openai("   ", "/health", 1), &ctx()).await.unwrap_err();
    assert!(matches!(e, LaunchError::EmptyCommand));
    let e = launch(&EngineSpec::mock("fast", 0), &ctx()).await.unwrap_err();
    assert!(matches!(e, LaunchError::Spawn { .. }), "{e}");
}

#[tokio::test]
async fn external_engines_are_only_addressed() {
    let spec = EngineSpec::External { url: "http://10.1.2.3:8000/".into() };
    let engine = launch(&spec, &ctx()).await.unwrap();
    assert_eq!(engine.base_url, "http://10.1.2.3:8000");
    assert_eq!(engine.pid(), None);
    engine.stop(Duration::from_millis(10)).await;
}
