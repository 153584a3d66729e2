//! Draining a node through the admin API of a single machine, with
//! `oneshot`, in front of a mock engine (in process, port 0): the model's
//! replica moves to the other node and the drained node shows `draining`
//! until the drain is called off; an unknown node is 404, a key that is
//! not an admin's 403.

mod common;

use std::time::Duration;

use axum::http::StatusCode;
use axum::Router;
use hangar_predictions::store::Backend;
use hangar_runtime::serve::{ServeConfig, Server};
use serde_json::{json, Value};

async fn call(router: &Router, method: &str, path: &str, key: &str) -> (StatusCode, Value) {
    common::call(router, method, path, Some(key), &[], None).await
}

/// The node each of `t/a`'s replicas is on, as `/admin/status` shows them.
async fn nodes_of(router: &Router) -> Vec<String> {
    let (_, status) = call(router, "GET", "/admin/status", "k-ops").await;
    let model = status["models"].as_array().unwrap().iter().find(|m| m["model"] == "t/a").unwrap().clone();
    model["placement"].as_array().unwrap().iter().map(|r| r["node"].as_str().unwrap().to_owned()).collect()
}

async fn draining(router: &Router, node: &str) -> bool {
    let (_, status) = call(router, "GET", "/admin/status", "k-ops").await;
    status["nodes"].as_array().unwrap().iter().find(|n| n["name"] == node).unwrap()["draining"] == true
}

#[tokio::test]
async fn a_drained_nodes_replica_moves_to_the_other_node() {
    let engine = common::mock_engine("t/a", |_| {}).await;
    let text = format!(
        r#"
[[nodes]]
id = "n1"
gpus = 1
gpu_memory = "80GB"
virtual_gpus = true

[[nodes]]
id = "n2"
gpus = 1
gpu_memory = "80GB"
virtual_gpus = true

[[models]]
key = "t/a"
engine = {{ kind = "external", url = "{engine}" }}
size = "10GB"
min_replicas = 1
max_replicas = 1

[[api_keys]]
key = "k-ops"
account = "ops"
admin = true

[[api_keys]]
key = "k-user"
account = "user"
"#
    );
    let mut config = ServeConfig::from_toml(&text, "test").unwrap();
    config.events.enabled = false;
    let dir = tempfile::tempdir().unwrap();
    let served = common::serve(config, &Backend::Sqlite(dir.path().to_path_buf()), Default::default()).await;
    let (server, router): (&Server, &Router) = (&served.server, &served.router);
    let first = nodes_of(router).await.remove(0);
    let other = if first == "n1" { "n2" } else { "n1" };

    let (status, answer) = call(router, "POST", &format!("/admin/nodes/{first}/drain"), "k-ops").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    assert_eq!(answer, json!({"node": first, "draining": true}));
    assert!(draining(router, &first).await);
    let mut moved = false;
    for _ in 0..250 {
        if nodes_of(router).await == [other] {
            moved = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(moved, "the replica did not move to {other}: {:?}", nodes_of(router).await);
    assert_eq!(server.model("t/a").unwrap().ready_replicas(), 1);

    let (status, _) = call(router, "DELETE", &format!("/admin/nodes/{first}/drain"), "k-ops").await;
    assert_eq!(status, StatusCode::ACCEPTED);
    assert!(!draining(router, &first).await);
    assert_eq!(nodes_of(router).await, [other], "calling the drain off moves nothing back");

    let (status, answer) = call(router, "POST", "/admin/nodes/n9/drain", "k-ops").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{answer}");
    let message = answer.pointer("/error/message").and_then(Value::as_str).unwrap_or("");
    assert!(message.contains("no node `n9`"), "{answer}");
    let (status, _) = call(router, "POST", &format!("/admin/nodes/{other}/drain"), "k-user").await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(!draining(router, other).await, "a refused command changes nothing");
    served.stop().await;
}
