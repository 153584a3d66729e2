//! A fleet on loopback: a private Redis, two gateways (`hangar serve`
//! with `redis` and no `[[nodes]]`) and three node agents (`hangar
//! agent`) with mock engines. One agent is killed with SIGKILL under load;
//! the leading gateway is killed; nothing accepted is lost.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::fleet::{agent, agent_with, ready, status, wait_ready, Agent};
use common::predictions::{client, create_with_webhook, get, post, receiver, wait_terminal, Receiver};
use common::{serve_in, Serve};
use hangar_redis::{LocalRedis, LocalRedisCluster};
use serde_json::{json, Value};

/// The fleet's models: `t/a` with two replicas and `t/b` with one.
const FLEET_MODELS: &str = r#"
[[models]]
key = "t/a"
engine = { kind = "mock", preset = "fast" }
size = "10GB"
min_replicas = 2

[[models]]
key = "t/b"
engine = { kind = "mock", preset = "fast" }
size = "10GB"
min_replicas = 1
"#;

/// A fleet's file on the Redis at `redis` (a URL) serving `models`
/// (`[[models]]` entries); async predictions with a short lease and
/// webhooks to loopback.
fn fleet_config_of(redis: &str, models: &str) -> String {
    format!(
        r#"
redis = "{}"
{models}
[predictions]
async_slots = 4
lease_s = 2
webhook_allow = ["127.0.0.1/32"]
"#,
        redis
    )
}

/// [`fleet_config_of`] written to `dir/fleet.toml`: its path (for agents)
/// and its text (for gateways).
fn fleet_file(dir: &std::path::Path, redis: &str, models: &str) -> (std::path::PathBuf, String) {
    let config = fleet_config_of(redis, models);
    let path = dir.join("fleet.toml");
    std::fs::write(&path, &config).unwrap();
    (path, config)
}

struct Fleet {
    gateways: Vec<Serve>,
    agents: Vec<Agent>,
    dir: tempfile::TempDir,
}

/// The fleet on the Redis at `redis` (a URL): `gateways` gateways and
/// `agents` agents of 2 GPUs, every model's replicas ready on every
/// gateway.
fn fleet(redis: &str, gateways: usize, agents: usize) -> Fleet {
    let dir = tempfile::tempdir().unwrap();
    let (path, config) = fleet_file(dir.path(), redis, FLEET_MODELS);
    let gateways: Vec<Serve> =
        (0..gateways).map(|_| serve_in(tempfile::tempdir().unwrap(), &config)).collect();
    let agents = (0..agents).map(|i| agent(dir.path(), &path, redis, &format!("n{i}"), 2)).collect();
    for g in &gateways {
        wait_ready(&g.url, &[("t/a", 2), ("t/b", 1)], None);
    }
    Fleet { gateways, agents, dir }
}

/// The fleet on a Redis Cluster of three nodes (`redis+cluster://`):
/// replicas placed on the agents, a chat through each gateway, a
/// prediction created through one and read through the other, and every
/// key Hangar wrote — the events stream, a single key, aside — in the one
/// hash slot of `{hangar}`.
#[test]
fn a_fleet_runs_on_a_redis_cluster() {
    let Some(cluster) = LocalRedisCluster::for_test() else { return };
    let f = fleet(&cluster.url(), 2, 2);
    for g in &f.gateways {
        assert_eq!(chat(&g.url, "t/a"), 200);
    }
    let hooks = receiver(0);
    let id = create(&f.gateways[0].url, "t/b", 4, &hooks);
    let done = wait_terminal(&format!("{}/v1/predictions/{id}", f.gateways[1].url));
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(hooks.one_terminal_each(std::slice::from_ref(&id))[&id], "succeeded");
    let nodes: std::collections::BTreeSet<String> =
        ready(&f.gateways[0].url).into_iter().map(|(_, n)| n).collect();
    assert!(nodes.iter().all(|n| n.starts_with('n')), "{nodes:?}");

    let redis = hangar_redis::Redis::connect(&cluster.url()).unwrap();
    let keys: Vec<String> = redis.run(|c| hangar_redis::redis::cmd("KEYS").arg("*").query(c)).unwrap();
    assert!(keys.contains(&format!("{{hangar}}:p:{id}")), "{keys:?}");
    assert!(keys.contains(&"{hangar}:leader".to_owned()), "{keys:?}");
    let stray: Vec<&String> =
        keys.iter().filter(|k| !k.starts_with("{hangar}:") && *k != "hangar:events").collect();
    assert!(stray.is_empty(), "keys outside the slot: {stray:?}");
}

/// The gateway that leads now, if one does.
fn leader(gateways: &[Serve]) -> Option<usize> {
    gateways.iter().position(|g| status(&g.url)["fleet"]["leading"] == true)
}

/// Waits until one of `gateways` leads (failing after 15 s, naming
/// `when`), and returns it.
fn wait_leader(gateways: &[Serve], when: &str) -> usize {
    let t = Instant::now();
    loop {
        if let Some(lead) = leader(gateways) {
            return lead;
        }
        assert!(t.elapsed() < Duration::from_secs(15), "no gateway leads {when}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn chat(gateway: &str, model: &str) -> u16 {
    chat_outcome(gateway, model).0
}

/// A chat's status and, unless 200, what it said (0 and why when the
/// request got no answer).
fn chat_outcome(gateway: &str, model: &str) -> (u16, String) {
    let sent = client()
        .post(format!("{gateway}/v1/chat/completions"))
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}))
        .send();
    match sent {
        Ok(r) if r.status() == 200 => (200, String::new()),
        Ok(r) => (r.status().as_u16(), r.text().unwrap_or_default()),
        Err(e) => (0, e.to_string()),
    }
}

fn create(gateway: &str, model: &str, tokens: u32, hooks: &Receiver) -> String {
    let (status, p) = create_with_webhook(gateway, model, tokens, hooks);
    assert_eq!(status, 201, "{p}");
    p["id"].as_str().unwrap().to_owned()
}

/// 1,000 requests, half sync chats and half async predictions, over both
/// gateways from 8 clients; the agent running every replica (the only one
/// there when they were placed; two more join before the load) is killed
/// with SIGKILL a third of the way in — the worst case: a request cut
/// there is retried while its siblings on the same node are still being
/// found dead. No prediction is lost or ends
/// twice, no sync request fails (none streams, so each one cut by the
/// kill is retried), the dead node's replicas run again on the others
/// while it is only suspect (not yet declared dead), and a prediction created through one gateway is read and cancelled
/// through the other.
#[test]
fn a_fleet_loses_nothing_when_a_node_dies_under_load() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let mut f = fleet(&redis.url(), 2, 1);
    let lead = leader(&f.gateways).expect("a gateway leads");
    let placed = wait_ready(&f.gateways[lead].url, &[("t/a", 2), ("t/b", 1)], None);
    let path = f.dir.path().join("fleet.toml");
    for name in ["n1", "n2"] {
        f.agents.push(agent(f.dir.path(), &path, &redis.url(), name, 2));
    }
    let mut per_node: HashMap<String, usize> = HashMap::new();
    for (_, node) in &placed {
        *per_node.entry(node.clone()).or_default() += 1;
    }
    let victim = per_node.iter().max_by_key(|(_, n)| **n).map(|(node, _)| node.clone()).unwrap();
    let hooks = Arc::new(receiver(0));
    let urls: Vec<String> = f.gateways.iter().map(|g| g.url.clone()).collect();
    let next = Arc::new(AtomicUsize::new(0));
    let sync_status: Arc<Mutex<Vec<(u16, String)>>> = Arc::default();
    let ids: Arc<Mutex<Vec<String>>> = Arc::default();
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let (urls, next, sync_status, ids, hooks) =
                (urls.clone(), next.clone(), sync_status.clone(), ids.clone(), hooks.clone());
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= 1000 {
                    return;
                }
                let gateway = &urls[(i / 2) % 2];
                let model = if i % 3 == 0 { "t/b" } else { "t/a" };
                if i % 2 == 0 {
                    let (s, said) = chat_outcome(gateway, model);
                    sync_status.lock().unwrap().push((s, format!("{model} through {gateway}: {said}")));
                } else {
                    let id = create(gateway, model, 16, &hooks);
                    ids.lock().unwrap().push(id);
                }
            })
        })
        .collect();
    while next.load(Ordering::SeqCst) < 330 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let killed_at = Instant::now();
    f.agents.iter_mut().find(|a| a.name == victim).unwrap().kill9();
    // Watched from the kill on, under the load: how long the rest of the
    // test takes says nothing of when the models were whole again.
    let recovery = {
        let (lead, victim) = (f.gateways[lead].url.clone(), victim.clone());
        std::thread::spawn(move || whole_while_suspect(&lead, &victim, killed_at))
    };
    for c in clients {
        c.join().unwrap();
    }
    let sync_status = sync_status.lock().unwrap().clone();
    let failed: Vec<&(u16, String)> = sync_status.iter().filter(|(s, _)| *s != 200).collect();
    assert!(failed.is_empty(), "{} of {} sync requests failed: {failed:?}", failed.len(), sync_status.len());
    let ids = ids.lock().unwrap().clone();
    assert_eq!(ids.len(), 500);
    // Every prediction ends once, succeeded, with one terminal webhook.
    for (id, status) in hooks.one_terminal_each(&ids) {
        assert_eq!(status, "succeeded", "{id}");
    }
    // The dead node's replicas run again on the others — before its
    // registration lapses (8 s): the gateways found it not answering, so
    // none of its replicas was placed on it again.
    let recovered =
        recovery.join().expect("the models were whole again while the victim was suspect (above)");
    // Created through one gateway, read and cancelled through the other.
    let id = create(&f.gateways[0].url, "t/b", 100_000, &hooks);
    let t = Instant::now();
    while get(&format!("{}/v1/predictions/{id}", f.gateways[1].url))["status"] != "processing" {
        assert!(t.elapsed() < Duration::from_secs(30), "never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let canceled = client()
        .post(format!("{}/v1/predictions/{id}/cancel", f.gateways[1].url))
        .send()
        .unwrap()
        .json::<Value>()
        .unwrap();
    assert_eq!(canceled["status"], "canceled");
    assert_eq!(get(&format!("{}/v1/predictions/{id}", f.gateways[0].url))["status"], "canceled");
    eprintln!(
        "node loss: 500 sync (all 200) and 500 async (all succeeded once) over 2 gateways; {victim} killed \
         with {} replicas; every model whole again {recovered:?} after the kill",
        per_node[&victim]
    );
}

/// Waits until the leader at `lead` has every model whole off `victim`,
/// killed at `killed_at`, and checks that it still lists `victim` as
/// suspect — not yet declared dead, its registration not lapsed (8 s).
/// Returns how long after the kill the models were whole.
fn whole_while_suspect(lead: &str, victim: &str, killed_at: Instant) -> Duration {
    wait_ready(lead, &[("t/a", 2), ("t/b", 1)], Some(victim));
    let recovered = killed_at.elapsed();
    let nodes = status(lead)["nodes"].clone();
    let dead = nodes.as_array().unwrap().iter().find(|n| n["name"] == victim);
    assert!(
        dead.is_some_and(|n| n["suspect"] == true),
        "the leader did not find {victim} suspect, or declared it dead, before its replicas ran elsewhere \
         ({recovered:?} after the kill): {nodes}"
    );
    // What an operator's alert reads: the leader leads, and holds one of
    // its live nodes suspect.
    let metrics = client().get(format!("{lead}/metrics")).send().unwrap().text().unwrap();
    let live = nodes.as_array().unwrap().len();
    for line in ["hangar_leader 1".to_owned(), format!("hangar_nodes{{state=\"live\"}} {live}")] {
        assert!(metrics.lines().any(|l| l == line), "no `{line}` in the leader's /metrics:\n{metrics}");
    }
    assert!(
        metrics.lines().any(|l| l == "hangar_nodes{state=\"suspect\"} 1"),
        "the leader's /metrics does not count {victim} suspect:\n{metrics}"
    );
    recovered
}

/// A node dies while only the follower serves: its requests find the
/// replicas dead, and the leader — whose controller alone places — takes
/// the follower's word as a reason to check them itself, so the models are
/// whole again while the node is only suspect, not after its registration
/// lapses; every request through the follower answers 200.
#[test]
fn the_leader_replaces_what_a_follower_found_dead() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let mut f = fleet(&redis.url(), 2, 1);
    let lead = leader(&f.gateways).expect("a gateway leads");
    let follower = f.gateways[1 - lead].url.clone();
    let path = f.dir.path().join("fleet.toml");
    for name in ["n1", "n2"] {
        f.agents.push(agent(f.dir.path(), &path, &redis.url(), name, 2));
    }
    let victim = "n0";
    assert!(ready(&f.gateways[lead].url).iter().all(|(_, node)| node == victim));
    let killed_at = Instant::now();
    f.agents.iter_mut().find(|a| a.name == victim).unwrap().kill9();
    let statuses: Vec<u16> = ["t/a", "t/b", "t/a", "t/b"].iter().map(|m| chat(&follower, m)).collect();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let recovered = whole_while_suspect(&f.gateways[lead].url, victim, killed_at);
    eprintln!(
        "a follower's word: every model whole {recovered:?} after the kill, {victim} suspect on the leader"
    );
}

/// The leading gateway is killed: the other takes the lease within its
/// TTL and runs the controller — a node lost afterwards has its replicas
/// placed again by the new leader — while both keep serving.
#[test]
fn another_gateway_leads_within_the_lease_ttl_when_the_leader_dies() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let mut f = fleet(&redis.url(), 2, 2);
    let old = leader(&f.gateways).expect("a gateway leads");
    let other = 1 - old;
    let dead = f.gateways.remove(old);
    let killed_at = Instant::now();
    drop(dead.kill9());
    let mut f_other = vec![f.gateways.remove(0)];
    let t = Instant::now();
    while leader(&f_other) != Some(0) {
        assert!(t.elapsed() < Duration::from_secs(10), "no new leader");
        std::thread::sleep(Duration::from_millis(50));
    }
    let took_over = killed_at.elapsed();
    assert!(took_over < Duration::from_secs(7), "took {took_over:?} (lease TTL 5 s, asked every 1.7 s)");
    assert_eq!(chat(&f_other[0].url, "t/a"), 200);
    // The new leader carries on: a node lost now is replaced by it.
    let placed = wait_ready(&f_other[0].url, &[("t/a", 2), ("t/b", 1)], None);
    let victim = placed[0].1.clone();
    f.agents.iter_mut().find(|a| a.name == victim).unwrap().kill9();
    wait_ready(&f_other[0].url, &[("t/a", 2), ("t/b", 1)], Some(&victim));
    assert_eq!(chat(&f_other[0].url, "t/a"), 200);
    eprintln!("leader kill: gateway {other} took over {took_over:?} after the kill");
    f.gateways.append(&mut f_other);
}

/// Redis restarts (SIGTERM), then crashes (SIGKILL) and comes back, while
/// sync requests and predictions flow through both gateways: no sync
/// request fails (they never touch Redis), every prediction accepted
/// succeeds once (a create refused while Redis is down is retried by the
/// client), and afterwards a gateway leads and every model is whole.
#[test]
fn the_fleet_rides_out_a_redis_restart() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let f = fleet(&redis.url(), 2, 2);
    let hooks = receiver(0);
    let restarts = std::thread::spawn(move || {
        let mut redis = redis;
        std::thread::sleep(Duration::from_millis(300));
        redis.restart().unwrap();
        std::thread::sleep(Duration::from_millis(1_500));
        redis.crash_and_restart().unwrap();
        redis
    });
    let mut rounds = 0;
    let (ids, refused) = load_through(&f, &hooks, Duration::from_millis(5), || {
        rounds += 1;
        rounds <= 300
    });
    let _redis = restarts.join().unwrap();
    all_served_after(&f, &hooks, &ids, "after the restarts");
    eprintln!("redis restart under load: 300 sync all 200; {} predictions accepted, all succeeded once; {refused} creates refused while Redis was down", ids.len());
}

/// Redis comes back empty (run without persistence, or `FLUSHALL`) under
/// sync load through both gateways: the registrations, reports, desired
/// states and the lease are gone at once. A registration gone while Redis
/// answers is silence, not death: every gateway keeps its routes, the
/// leader (whichever takes the lease again) keeps or adopts every node and
/// what it runs, and the agents register again at their next beat. No
/// sync request fails, and the same replicas — the same engine processes —
/// serve afterwards.
#[test]
fn the_fleet_rides_out_redis_losing_its_data() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let f = fleet(&redis.url(), 2, 2);
    let engines = |gateway: &str| -> Vec<(String, Value)> {
        let s = status(gateway);
        let mut e: Vec<(String, Value)> = s["models"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|m| m["replicas"].as_array().unwrap().iter())
            .filter(|r| r["state"] == "ready")
            .map(|r| (r["id"].as_str().unwrap().to_owned(), r["pid"].clone()))
            .collect();
        e.sort_by(|a, b| a.0.cmp(&b.0));
        e
    };
    let before = engines(&f.gateways[0].url);
    assert_eq!(before.len(), 3, "{before:?}");
    let url = redis.url();
    let flush = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let redis = hangar_redis::Redis::connect(&url).unwrap();
        redis.run(|c| hangar_redis::redis::cmd("FLUSHALL").query::<()>(c)).unwrap();
    });
    let mut failed = Vec::new();
    let t = Instant::now();
    let mut i = 0;
    // The agents beat every 2 s: load until well past their next beat.
    while t.elapsed() < Duration::from_secs(5) {
        let (status, body) = chat_outcome(&f.gateways[i % 2].url, "t/a");
        if status != 200 {
            failed.push(format!("{:?} after the start: {status} {body}", t.elapsed()));
        }
        i += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    flush.join().unwrap();
    assert!(failed.is_empty(), "{} of {i} sync requests failed: {failed:?}", failed.len());
    wait_leader(&f.gateways, "after Redis lost its data");
    for g in &f.gateways {
        wait_ready(&g.url, &[("t/a", 2), ("t/b", 1)], None);
        assert_eq!(engines(&g.url), before, "the same replicas and engine processes serve afterwards");
    }
    eprintln!("redis lost its data under load: {i} sync requests all 200, the same 3 engines serving");
}

/// Chats to `t/a` and predictions of `t/b`, alternately through each of
/// `f`'s gateways, `pause` apart, while `more()` says so: every chat must
/// answer 200, a create 201 or — Redis unavailable — 503, never a 500.
/// Returns the ids accepted and how many creates were refused.
fn load_through(
    f: &Fleet,
    hooks: &Receiver,
    pause: Duration,
    mut more: impl FnMut() -> bool,
) -> (Vec<String>, u32) {
    let (mut sync_failed, mut ids, mut refused) = (Vec::new(), Vec::new(), 0);
    let mut i = 0;
    while more() {
        let gateway = &f.gateways[i % f.gateways.len()].url;
        i += 1;
        let s = chat(gateway, "t/a");
        if s != 200 {
            sync_failed.push(s);
        }
        let (status, p) = create_with_webhook(gateway, "t/b", 8, hooks);
        match status {
            201 => ids.push(p["id"].as_str().unwrap().to_owned()),
            503 => refused += 1,
            s => panic!("{s}: {p}"),
        }
        std::thread::sleep(pause);
    }
    assert!(sync_failed.is_empty(), "sync requests failed: {sync_failed:?}");
    (ids, refused)
}

/// After a fault: each of `ids` succeeded once, a gateway leads (failing
/// naming `when`), and every model has its replicas ready again.
fn all_served_after(f: &Fleet, hooks: &Receiver, ids: &[String], when: &str) {
    for (id, status) in hooks.one_terminal_each(ids) {
        assert_eq!(status, "succeeded", "{id}");
    }
    wait_leader(&f.gateways, when);
    for g in &f.gateways {
        wait_ready(&g.url, &[("t/a", 2), ("t/b", 1)], None);
    }
}

/// The ready replicas' ids through `gateway`, in order.
fn replica_ids(gateway: &str) -> Vec<String> {
    let s = status(gateway);
    let mut ids: Vec<String> = s["models"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|m| m["replicas"].as_array().unwrap().iter())
        .filter(|r| r["state"] == "ready")
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect();
    ids.sort();
    ids
}

/// A fleet on a Redis Cluster with replicas, under load, while the
/// primary holding Hangar's slot is killed and its replica takes over:
/// every sync request answered, every accepted prediction succeeds once
/// (creates refused with 503 while no primary holds the slot), and no
/// replica restarted — the same engines serve before and after.
#[test]
fn the_fleet_rides_out_a_redis_cluster_failover() {
    let Some(mut cluster) = LocalRedisCluster::for_test_with_replicas() else { return };
    let f = fleet(&cluster.url(), 2, 2);
    let before = replica_ids(&f.gateways[0].url);
    let redis = hangar_redis::Redis::connect(&cluster.url()).unwrap();
    let primary = cluster.primary_for(&redis.key("seq")).unwrap();
    let failover = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        cluster.nodes()[primary].crash();
        cluster
    });
    let hooks = receiver(0);
    let t = Instant::now();
    // Through the failover (2 s to notice, then the election) and past it.
    let (ids, refused) =
        load_through(&f, &hooks, Duration::from_millis(20), || t.elapsed() < Duration::from_secs(12));
    let _cluster = failover.join().unwrap();
    all_served_after(&f, &hooks, &ids, "after the failover");
    assert_eq!(replica_ids(&f.gateways[0].url), before, "a replica was restarted");
    eprintln!(
        "redis cluster failover under load: sync all 200; {} predictions accepted, all succeeded once; {refused} \
         creates refused during the failover",
        ids.len()
    );
}

/// A leading gateway stopped on purpose (SIGTERM) gives the lease up on
/// its way out: when it has exited, the lease is no longer its own, and
/// the other gateway leads at its next ask instead of after the TTL.
#[test]
fn a_leader_stopping_on_purpose_hands_the_lease_over() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let mut f = fleet(&redis.url(), 2, 1);
    let old = leader(&f.gateways).expect("a gateway leads");
    let old_id = status(&f.gateways[old].url)["fleet"]["gateway"].as_str().unwrap().to_owned();
    drop(f.gateways.remove(old)); // SIGTERM, and waits for it to exit.
    let holder: Option<String> = hangar_redis::Redis::connect(&redis.url())
        .unwrap()
        .run(|c| hangar_redis::redis::cmd("GET").arg("hangar:leader").query(c))
        .unwrap();
    assert_ne!(holder.as_deref(), Some(old_id.as_str()), "the stopped leader still holds the lease");
    let t = Instant::now();
    while leader(&f.gateways) != Some(0) {
        assert!(t.elapsed() < Duration::from_secs(10), "no new leader");
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("graceful handover: new leader {:?} after the old one exited", t.elapsed());
}

/// Every node runs exactly the replicas the leader places there: the
/// engines (replicas whose engine has a process, per the agent's
/// lifecycle) on each agent equal the leader's placement on its node, HOT
/// and WARM. Waits up to 20 s for the fleet to converge.
fn engines_match_placement(gateway: &str, agents: &[Agent]) {
    let t = Instant::now();
    loop {
        let s = status(gateway);
        let mut placed: Vec<(String, String)> = Vec::new();
        for m in s["models"].as_array().unwrap() {
            for r in m["replicas"].as_array().unwrap().iter().filter(|r| !r["level"].is_null()) {
                placed.push((
                    r["node"].as_str().unwrap_or("").to_owned(),
                    r["id"].as_str().unwrap().to_owned(),
                ));
            }
        }
        let mut running: Vec<(String, String)> = Vec::new();
        for a in agents {
            for r in a.status()["replicas"].as_array().unwrap() {
                let state = r["view"]["engine"]["state"].as_str().unwrap();
                if !["absent", "failed"].contains(&state) {
                    running.push((a.name.clone(), r["view"]["replica"].as_str().unwrap().to_owned()));
                }
            }
        }
        placed.sort();
        running.sort();
        if placed == running && !placed.is_empty() {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "engines never matched placement: placed {placed:?}, running {running:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Issue 27's ghosts: an agent killed with SIGKILL and started again under
/// its name. At once it is refused (its name is still held); once its
/// silence has passed the TTL it joins as a new run, which starts from
/// what it runs — nothing — so no replica of the old run's desired state
/// comes back as an engine placement does not count.
#[test]
fn an_agent_killed_and_started_again_under_its_name_runs_only_what_placement_counts() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let mut f = fleet(&redis.url(), 1, 2);
    let gw = f.gateways[0].url.clone();
    let placed = wait_ready(&gw, &[("t/a", 2), ("t/b", 1)], None);
    engines_match_placement(&gw, &f.agents);
    let victim = placed[0].1.clone();
    let i = f.agents.iter().position(|a| a.name == victim).unwrap();
    f.agents[i].kill9();
    let config = f.dir.path().join("fleet.toml");
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_hangar"))
        .args(["agent", "--config", config.to_str().unwrap(), "--redis", &redis.url(), "--name", &victim])
        .args(["--gpus", "2", "--gpu-memory", "80GB", "--virtual-gpus"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("is held by another live agent"), "{stderr}");
    std::thread::sleep(Duration::from_secs(9));
    f.agents[i] = common::fleet::agent(f.dir.path(), &config, &redis.url(), &victim, 2);
    wait_ready(&gw, &[("t/a", 2), ("t/b", 1)], None);
    engines_match_placement(&gw, &f.agents);
    // And it stays so.
    std::thread::sleep(Duration::from_secs(2));
    engines_match_placement(&gw, &f.agents);
}

/// An agent stopped (SIGSTOP) past its TTL is declared dead and its
/// replicas run elsewhere; when it goes on (SIGCONT) it rejoins as the same
/// run with its engines still running. Those placement no longer wants are
/// stopped — none is counted twice, none runs unplaced.
#[test]
fn an_agent_stopped_past_its_ttl_rejoins_without_ghosts() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let f = fleet(&redis.url(), 1, 3);
    let gw = f.gateways[0].url.clone();
    let placed = wait_ready(&gw, &[("t/a", 2), ("t/b", 1)], None);
    let victim = placed[0].1.clone();
    let agent = f.agents.iter().find(|a| a.name == victim).unwrap();
    agent.signal(rustix::process::Signal::STOP);
    wait_ready(&gw, &[("t/a", 2), ("t/b", 1)], Some(&victim));
    agent.signal(rustix::process::Signal::CONT);
    std::thread::sleep(Duration::from_secs(3));
    wait_ready(&gw, &[("t/a", 2), ("t/b", 1)], None);
    engines_match_placement(&gw, &f.agents);
    assert_eq!(chat(&gw, "t/a"), 200);
}

/// A sync chat through `gateway`: its status, `Retry-After` and the error
/// message, if any.
fn chat_answer(gateway: &str, model: &str) -> (u16, Option<String>, String) {
    let r = client()
        .post(format!("{gateway}/v1/chat/completions"))
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
        .send()
        .unwrap();
    let status = r.status().as_u16();
    let retry_after = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
    let body: Value = r.json().unwrap_or(Value::Null);
    (status, retry_after, body["error"]["message"].as_str().unwrap_or_default().to_owned())
}

/// A fleet whose only node is too small for its only model (60 GB on
/// 16 GB GPUs: placement refuses). A sync request is answered 503 at
/// once with `Retry-After` and the reason — not after its 600 s timeout
/// — while the model stays so; async predictions are not failed for
/// want of room: one with `Cancel-After` waits until that deadline
/// (aborted, never run), one without waits until a node with room joins
/// and then succeeds, and sync requests are served again.
#[test]
fn a_model_with_no_room_turns_sync_requests_away_and_keeps_its_predictions() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let dir = tempfile::tempdir().unwrap();
    let model = r#"
[[models]]
key = "t/big"
engine = { kind = "mock", preset = "fast" }
size = "60GB"
min_replicas = 0
timeout_s = 600
"#;
    let (path, config) = fleet_file(dir.path(), &redis.url(), model);
    let gateway = serve_in(tempfile::tempdir().unwrap(), &config);
    let _small = agent_with(dir.path(), &path, &redis.url(), "small", 1, "16GB", &[]);
    wait_leader(std::slice::from_ref(&gateway), "at the start");
    let hooks = receiver(0);
    let body = |hooks: &Receiver| json!({"input": {"prompt": "x", "max_tokens": 4}, "webhook": hooks.url, "webhook_events_filter": ["completed"]});
    let predict = format!("{}/v1/models/t/big/predictions", gateway.url);
    let (status, bounded) = post(&predict, &body(&hooks), &[("Cancel-After", "5s")]);
    assert_eq!(status, 201, "{bounded}");
    let (status, open) = post(&predict, &body(&hooks), &[]);
    assert_eq!(status, 201, "{open}");

    // The predictions wait in the line, so the controller wants a replica
    // and finds no room: the first request may wait for that word, those
    // after it are told at once. None waits out its 600 s timeout (the
    // client gives up after 90 s).
    for _ in 0..3 {
        let (status, retry_after, message) = chat_answer(&gateway.url, "t/big");
        assert_eq!(status, 503, "{message}");
        assert_eq!(retry_after.as_deref(), Some("5"), "{message}");
        assert!(message.starts_with("no replica of `t/big` can run now: "), "{message}");
        assert!(message.ends_with("; retry"), "{message}");
    }
    let url = |p: &Value| format!("{}/v1/predictions/{}", gateway.url, p["id"].as_str().unwrap());
    let aborted = wait_terminal(&url(&bounded));
    assert_eq!(aborted["status"], "aborted", "waited until its own deadline: {aborted}");
    assert_eq!(get(&url(&open))["status"], "starting", "still waiting for room");

    let _big = agent(dir.path(), &path, &redis.url(), "big", 1);
    let done = wait_terminal(&url(&open));
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(chat_answer(&gateway.url, "t/big").0, 200);
    let ids = [bounded["id"].as_str().unwrap().to_owned(), open["id"].as_str().unwrap().to_owned()];
    let ends = hooks.one_terminal_each(&ids);
    assert_eq!((ends[&ids[0]].as_str(), ends[&ids[1]].as_str()), ("aborted", "succeeded"));
}

/// `PUT /admin/models/{model}/hotswap` on `gateway`: its status.
fn set_swappable(gateway: &str, model: &str, swappable: bool) -> u16 {
    client()
        .put(format!("{gateway}/admin/models/{model}/hotswap"))
        .json(&json!({"swappable": swappable}))
        .send()
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

/// Polls `gateway` with a sync chat for `model` until `check` accepts its
/// answer (failing after 20 s), and returns that answer.
fn chat_until(gateway: &str, model: &str, check: impl Fn(&(u16, Option<String>, String)) -> bool) -> String {
    let t = Instant::now();
    loop {
        let answer = chat_answer(gateway, model);
        if check(&answer) {
            return answer.2;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "{gateway} still answers {answer:?} for {model}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `POST /admin/models/{model}/scaling` on `gateway`: its status.
fn scale(gateway: &str, model: &str, body: Value) -> u16 {
    let url = format!("{gateway}/admin/models/{model}/scaling");
    client().post(url).json(&body).send().map(|r| r.status().as_u16()).unwrap_or(0)
}

/// Every gateway answers for a model as the leader does, and what an
/// operator asked outlives the leader. Two gateways and one node of two
/// 16 GB GPUs: `t/big` (60 GB) has no room, `t/swap` is a hotswap model,
/// `t/small` an ordinary one. A sync request for `t/big` through the
/// gateway that does not lead is answered 503 with the leader's reason
/// (not after its 600 s timeout). The operator's hotswap gate, closed
/// through the leader (the other refuses the command), closes `t/swap` on
/// both; `t/small` is pinned at 1 (a pin out of its bounds is refused and
/// changes nothing). The leader is killed with SIGKILL: the other gateway
/// leads, keeps `t/swap` closed and `t/small` pinned, and opens `t/swap`
/// when told to.
#[test]
fn every_gateway_answers_as_the_leader_and_the_operators_word_outlives_it() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let dir = tempfile::tempdir().unwrap();
    let models = r#"
[[models]]
key = "t/big"
engine = { kind = "mock", preset = "fast" }
size = "60GB"
min_replicas = 0
timeout_s = 600

[[models]]
key = "t/swap"
engine = { kind = "mock", preset = "fast" }
size = "10GB"
min_replicas = 0
hotswap = true

[[models]]
key = "t/small"
engine = { kind = "mock", preset = "fast" }
size = "4GB"
min_replicas = 0
max_replicas = 2
"#;
    let (path, config) = fleet_file(dir.path(), &redis.url(), models);
    let mut gateways: Vec<Serve> = (0..2).map(|_| serve_in(tempfile::tempdir().unwrap(), &config)).collect();
    let _node = agent_with(dir.path(), &path, &redis.url(), "small", 2, "16GB", &[]);
    let lead = wait_leader(&gateways, "at the start");
    let follower = gateways[1 - lead].url.clone();
    assert_eq!(chat_answer(&follower, "t/swap").0, 200, "served while open");

    let (code, retry_after, message) = chat_answer(&follower, "t/big");
    assert_eq!((code, retry_after.as_deref()), (503, Some("5")), "{message}");
    assert!(message.starts_with("no replica of `t/big` can run now: "), "{message}");

    assert_eq!(set_swappable(&follower, "t/swap", false), 409, "the command goes to the leader");
    assert_eq!(set_swappable(&gateways[lead].url, "t/swap", false), 200);
    let gate = "the hotswap model `t/swap` is closed to swapping in by an operator";
    let closed = |a: &(u16, Option<String>, String)| a.0 == 503 && a.2.starts_with(gate);
    chat_until(&follower, "t/swap", closed);
    let swap = |gateway: &str| {
        let models = status(gateway)["models"].as_array().unwrap().clone();
        models.into_iter().find(|m| m["model"] == "t/swap").unwrap()["hotswap"].clone()
    };
    assert_eq!(swap(&follower), json!({"swappable": false}));
    let leader_url = gateways[lead].url.clone();
    assert_eq!(scale(&leader_url, "t/small", json!({"action": "pin", "replicas": 1})), 200);
    assert_eq!(scale(&leader_url, "t/small", json!({"action": "pin", "replicas": 5})), 400, "above its max");
    assert_eq!(
        scale(&follower, "t/small", json!({"action": "freeze"})),
        409,
        "the command goes to the leader"
    );
    wait_ready(&follower, &[("t/small", 1)], None);

    drop(gateways.remove(lead).kill9());
    wait_leader(&gateways, "after the leader's kill");
    // The new leader closed it again from Redis: still refused, and no
    // replica is started for the requests.
    assert!(closed(&chat_answer(&follower, "t/swap")));
    assert_eq!(swap(&follower), json!({"swappable": false}));
    let scaling = |model: &str| {
        let models = status(&follower)["models"].as_array().unwrap().clone();
        models.into_iter().find(|m| m["model"] == model).unwrap()["scaling"]["override"].clone()
    };
    let t = Instant::now();
    while scaling("t/swap") != json!({"mode": "pinned", "replicas": 0}) {
        assert!(t.elapsed() < Duration::from_secs(10), "t/swap never pinned again: {}", scaling("t/swap"));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(scaling("t/small"), json!({"mode": "pinned", "replicas": 1}), "pinned again, as recorded");
    assert_eq!(wait_ready(&follower, &[("t/small", 1)], None).len(), 1);
    assert_eq!(set_swappable(&follower, "t/swap", true), 200);
    chat_until(&follower, "t/swap", |a| a.0 == 200);
    assert_eq!(swap(&follower), json!({"swappable": true}));
    assert_eq!(scaling("t/swap"), Value::Null, "opening released the scaler");
    assert_eq!(scale(&follower, "t/small", json!({"action": "unfreeze"})), 200);
    assert_eq!(scaling("t/small"), Value::Null);
}

/// The weight artifacts `gateway` shows node `node` holding resident.
fn resident(gateway: &str, node: &str) -> Vec<String> {
    let nodes = status(gateway)["nodes"].as_array().unwrap().clone();
    let node = nodes.into_iter().find(|n| n["name"] == node).unwrap();
    serde_json::from_value(node["resident"].clone()).unwrap()
}

/// Placement prefers the node whose weight store holds a model's weights
/// resident. Two nodes, each agent with a weight store of its own (its
/// own root), and a model whose weights are a file: pinned at 1, its
/// replica loads the weights on one node, whose agent reports them
/// resident (shown in `/admin/status`). Pinned at 0 and at 1 again five
/// times, the replica comes back on that node every time: the two nodes
/// are otherwise equal (both free, neither runs the model, no warm
/// cache), so without residency each round is the rng's draw (with the
/// leader's controller not told, round 1 lands on the other node). The
/// other node never reads the weights.
#[test]
fn a_model_comes_back_on_the_node_that_holds_its_weights() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let dir = tempfile::tempdir().unwrap();
    let weights = dir.path().join("model.gguf");
    std::fs::write(&weights, (0..1_000_000u32).map(|i| (i % 251) as u8).collect::<Vec<u8>>()).unwrap();
    let models = format!(
        r#"
[store]
root = "store"

[[models]]
key = "t/w"
engine = {{ kind = "mock", preset = "instant" }}
size = "10GB"
min_replicas = 0
max_replicas = 1
weights = "{}"
"#,
        weights.display()
    );
    let config = fleet_config_of(&redis.url(), &models);
    let gateway = serve_in(tempfile::tempdir().unwrap(), &config);
    // Each agent's file in a directory of its own: `root = "store"` is
    // then a store of its own.
    let _agents: Vec<Agent> = ["n0", "n1"]
        .iter()
        .map(|name| {
            let own = dir.path().join(name);
            std::fs::create_dir(&own).unwrap();
            std::fs::write(own.join("fleet.toml"), &config).unwrap();
            agent(&own, &own.join("fleet.toml"), &redis.url(), name, 1)
        })
        .collect();
    wait_leader(std::slice::from_ref(&gateway), "at the start");
    let g = gateway.url.as_str();
    let pin = |n: u32| assert_eq!(scale(g, "t/w", json!({"action": "pin", "replicas": n})), 200);
    pin(1);
    let first = wait_ready(g, &[("t/w", 1)], None)[0].1.clone();
    let models = status(g)["models"].as_array().unwrap().clone();
    let replica = models.iter().find(|m| m["model"] == "t/w").unwrap()["replicas"][0].clone();
    let artifact = replica["start"]["weights"]["artifact"].as_str().unwrap().to_owned();
    let t = Instant::now();
    while !resident(g, &first).contains(&artifact) {
        assert!(t.elapsed() < Duration::from_secs(10), "{first} never reported {artifact} resident");
        std::thread::sleep(Duration::from_millis(50));
    }
    let other = if first == "n0" { "n1" } else { "n0" };
    for round in 0..5 {
        pin(0);
        wait_ready(g, &[("t/w", 0)], None);
        pin(1);
        let (_, node) = wait_ready(g, &[("t/w", 1)], None).remove(0);
        assert_eq!(node, first, "round {round}: placed on {node}, where the weights are not resident");
    }
    assert_eq!(resident(g, &first), [artifact]);
    assert!(resident(g, other).is_empty(), "{other} read weights it never ran");
}

/// `POST` (or `DELETE`) `/admin/nodes/{node}/drain` on `gateway`: its
/// status.
fn drain(gateway: &str, node: &str, on: bool) -> u16 {
    let url = format!("{gateway}/admin/nodes/{node}/drain");
    let request = if on { client().post(url) } else { client().delete(url) };
    request.send().map(|r| r.status().as_u16()).unwrap_or(0)
}

/// Whether `gateway` shows node `node` draining.
fn shown_draining(gateway: &str, node: &str) -> bool {
    let nodes = status(gateway)["nodes"].as_array().unwrap().clone();
    nodes.into_iter().find(|n| n["name"] == node).unwrap()["draining"] == true
}

/// Samples, every 50 ms until `done`, how many replicas of `model`
/// `gateway` routes to; returns the fewest seen.
fn fewest_ready_while(gateway: &str, model: &str, done: impl Fn() -> bool) -> usize {
    let mut fewest = usize::MAX;
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(60), "not done in a minute: {}", status(gateway));
        fewest = fewest.min(ready(gateway).iter().filter(|(m, _)| m == model).count());
        std::thread::sleep(Duration::from_millis(50));
    }
    fewest
}

/// Draining moves a node's replicas make-before-break. One model of one
/// replica whose engine takes 1.5 s to start, two nodes. An operator
/// drains the replica's node: the replica is started on the other node
/// and the first stops only once it serves — the gateway routes to a
/// replica at every moment (a replica stopped first would leave none for
/// 1.5 s), every request is answered 200, and the node shows `draining`
/// until the drain is called off. Then the other node's agent gets
/// SIGTERM with `--move-s`: it drains itself the same way, and exits once
/// its replica runs on the first node again. An unknown node is 404.
#[test]
fn a_drained_node_hands_its_replicas_over_before_they_stop() {
    let Some(redis) = LocalRedis::for_test() else { return };
    let dir = tempfile::tempdir().unwrap();
    let models = r#"
[[models]]
key = "t/a"
engine = { kind = "mock", preset = "fast", startup_delay_ms = 1500 }
size = "10GB"
min_replicas = 1
max_replicas = 1
"#;
    let (path, config) = fleet_file(dir.path(), &redis.url(), models);
    let gateway = serve_in(tempfile::tempdir().unwrap(), &config);
    let mut agents: Vec<Agent> = ["n0", "n1"]
        .iter()
        .map(|name| agent_with(dir.path(), &path, &redis.url(), name, 1, "80GB", &["--move-s", "30"]))
        .collect();
    wait_leader(std::slice::from_ref(&gateway), "at the start");
    let g = gateway.url.clone();
    let first = wait_ready(&g, &[("t/a", 1)], None)[0].1.clone();
    let other = if first == "n0" { "n1" } else { "n0" }.to_owned();
    assert_eq!(drain(&g, "nope", true), 404);

    // Requests all along, from another thread.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answers = Arc::new(Mutex::new(HashMap::<u16, usize>::new()));
    let load = {
        let (g, stop, answers) = (g.clone(), stop.clone(), answers.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                *answers.lock().unwrap().entry(chat(&g, "t/a")).or_default() += 1;
            }
        })
    };

    assert_eq!(drain(&g, &first, true), 202);
    let moved = || ready(&g).iter().any(|(m, n)| m == "t/a" && *n == other) && ready(&g).len() == 1;
    assert_eq!(fewest_ready_while(&g, "t/a", moved), 1, "no replica served at some moment of the move");
    assert!(shown_draining(&g, &first));
    assert_eq!(drain(&g, &first, false), 202);
    let t = Instant::now();
    while shown_draining(&g, &first) {
        assert!(t.elapsed() < Duration::from_secs(5), "{first} still shown draining");
        std::thread::sleep(Duration::from_millis(50));
    }

    let leaving = agents.iter().position(|a| a.name == other).unwrap();
    agents[leaving].signal(rustix::process::Signal::TERM);
    let back = || ready(&g).iter().any(|(m, n)| m == "t/a" && *n == first) && ready(&g).len() == 1;
    assert_eq!(
        fewest_ready_while(&g, "t/a", back),
        1,
        "no replica served at some moment of the agent's leaving"
    );
    let t = Instant::now();
    let exited = loop {
        if let Some(status) = agents[leaving].exited() {
            break status;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "the leaving agent did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(exited.success(), "{exited}");
    assert!(agents[leaving].log().contains("drained: every replica moved"), "{}", agents[leaving].log());

    stop.store(true, Ordering::Relaxed);
    load.join().unwrap();
    let answers = answers.lock().unwrap().clone();
    assert_eq!(answers.keys().copied().collect::<Vec<u16>>(), [200], "{answers:?}");
}
