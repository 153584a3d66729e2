//! Engine launching with real processes: an OpenAI-style command template
//! (a Python HTTP server stands in for vLLM), failures, and stopping.

use std::path::PathBuf;
use std::time::Duration;

use hangar_agent::engine::{launch, launch_on, EngineSpec, LaunchContext, LaunchError};

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

/// A fleet's agent starts engines on an address of its machine that
/// gateways elsewhere reach; 127.0.0.2 stands in for it (Linux routes all
/// of 127/8 to loopback). The template is given that host as `{host}`, the
/// port is free there, and the URL names it.
#[tokio::test]
async fn a_templated_server_binds_the_engine_host_and_is_reached_there() {
    let spec = openai("python3 -m http.server {port} --bind {host}", "/", 60);
    let engine = launch_on(&spec, &ctx(), "127.0.0.2").await.unwrap();
    let port = engine.base_url.strip_prefix("http://127.0.0.2:").expect("the URL names the host");
    assert_eq!(reqwest::get(&engine.base_url).await.unwrap().status(), 200);
    // Bound to that address alone: `{host}` was the engine host, not
    // loopback's usual 127.0.0.1.
    let elsewhere = reqwest::get(format!("http://127.0.0.1:{port}/")).await;
    assert!(elsewhere.is_err(), "the server answers on 127.0.0.1 too: {elsewhere:?}");
    engine.stop(Duration::from_secs(5)).await;
}

/// An IPv6 engine host is bracketed in the URL and bare in the template.
#[tokio::test]
async fn an_ipv6_engine_host_is_bracketed_in_the_url() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("no IPv6 loopback here; skipped");
        return;
    }
    let spec = openai("python3 -m http.server {port} --bind {host}", "/", 60);
    let engine = launch_on(&spec, &ctx(), "::1").await.unwrap();
    assert!(engine.base_url.starts_with("http://[::1]:"), "{}", engine.base_url);
    assert_eq!(reqwest::get(&engine.base_url).await.unwrap().status(), 200);
    engine.stop(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn failures_are_clear_and_leave_no_process() {
    let e = launch(&openai("/nonexistent/vllm serve {model}", "/health", 5), &ctx()).await.unwrap_err();
    assert!(matches!(e, LaunchError::Spawn { .. }), "{e}");
    assert!(e.to_string().starts_with("cannot start `/nonexistent/vllm`"), "{e}");
    let e = launch(&openai("false", "/health", 5), &ctx()).await.unwrap_err();
    assert!(matches!(e, LaunchError::Exited { .. }), "{e}");
    assert!(!e.to_string().contains("last output"), "it printed nothing: {e}");
    // What an engine printed before it died is in its error.
    let dies =
        openai("python3 -c print('loading');__import__('sys').exit('CUDA_out_of_memory')", "/health", 5);
    let e = launch(&dies, &ctx()).await.unwrap_err();
    let text = e.to_string();
    assert!(text.contains("its last output:\n"), "{e}");
    assert!(text.contains("\nloading\n") && text.contains("\nCUDA_out_of_memory\n"), "{e}");
    let e = launch(&openai("sleep 30", "/health", 1), &ctx()).await.unwrap_err();
    assert!(matches!(e, LaunchError::SetupTimeout { .. }), "{e}");
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
