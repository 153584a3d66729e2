//! The checker's eyes: every half second, every running agent's `GET
//! /status`, every gateway's `GET /admin/status` and the run's processes,
//! read into a [`Sample`] for the [`Judge`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::fleet::{run_processes, SharedRoster};
use super::judge::{EngineSample, Judge, ModelSample, NodeSample, Placed, Sample, Violation};

/// How often the fleet is sampled.
pub const EVERY: Duration = Duration::from_millis(500);

/// What the prober has found so far.
#[derive(Debug, Default)]
pub struct Findings {
    /// Every violation, in the order found.
    pub violations: Vec<Violation>,
    /// The last sample.
    pub last: Option<Sample>,
    /// Each sample's time and whether every model was whole then.
    pub whole: Vec<(u64, bool)>,
    /// Samples taken.
    pub samples: u64,
    /// Samples in which more than one gateway said it leads.
    pub split_leaders: u64,
    /// The calm time each difference from placement took to go, ms.
    pub converged: Vec<u64>,
}

/// Samples the fleet every [`EVERY`] until `stop`, judging each sample.
pub async fn run(
    roster: SharedRoster,
    run_id: String,
    t0: Instant,
    findings: Arc<Mutex<Findings>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    let client = hangar_agent::direct_http().timeout(Duration::from_secs(3)).build().expect("a client");
    let mut judge = Judge::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let began = Instant::now();
        let s = sample(&client, &roster, &run_id, t0).await;
        let found = judge.observe(&s);
        {
            let mut f = findings.lock().expect("findings");
            for v in &found {
                tracing::warn!("chaos checker: {v}");
            }
            f.violations.extend(found);
            f.whole.push((s.at_ms, judge.whole()));
            f.samples += 1;
            if s.leaders > 1 {
                f.split_leaders += 1;
            }
            f.last = Some(s);
            f.converged = judge.converged().to_vec();
        }
        tokio::time::sleep(EVERY.saturating_sub(began.elapsed())).await;
    }
}

async fn get(client: reqwest::Client, url: String) -> Option<Value> {
    client.get(url).send().await.ok()?.json().await.ok()
}

/// One sample of the fleet.
pub async fn sample(client: &reqwest::Client, roster: &SharedRoster, run_id: &str, t0: Instant) -> Sample {
    let r = roster.read().expect("roster").clone();
    let redis_ok_before = !r.redis_fault;
    // Every read at once, each with its own timeout.
    let gateways: Vec<_> = r
        .gateways
        .iter()
        .flatten()
        .map(|g| tokio::spawn(get(client.clone(), format!("{g}/admin/status"))))
        .collect();
    let agents: Vec<_> = r
        .agents
        .iter()
        .map(|a| a.answering().map(|url| tokio::spawn(get(client.clone(), format!("{url}/status")))))
        .collect();
    let mut gateway_answers = Vec::new();
    for g in gateways {
        gateway_answers.push(g.await.ok().flatten());
    }
    let mut agent_answers = Vec::new();
    for a in agents {
        agent_answers.push(match a {
            Some(task) => task.await.ok().flatten(),
            None => None,
        });
    }
    let gateways = gateway_answers;
    let at_ms = t0.elapsed().as_millis() as u64;
    let redis_ok = redis_ok_before && !roster.read().expect("roster").redis_fault;
    let leading: Vec<&Value> = gateways.iter().flatten().filter(|s| s["fleet"]["leading"] == true).collect();
    let (leader, leader_id) = match leading.as_slice() {
        [one] => (Some(models(one)), one["fleet"]["gateway"].as_str().map(str::to_owned)),
        _ => (None, None),
    };
    let mut nodes = Vec::new();
    let mut down: Vec<String> = Vec::new();
    let processes = run_processes(run_id);
    let agent_pids: Vec<u32> = r.agents.iter().filter_map(|a| a.running.as_ref().map(|(_, p)| *p)).collect();
    for (a, answer) in r.agents.iter().zip(&agent_answers) {
        match (answer, &a.running) {
            (Some(status), Some((_, pid))) => {
                let engines_os =
                    processes.iter().filter(|p| p.engine && p.ppid == *pid).map(|p| p.pid).collect();
                nodes.push(node(status, &a.name, *pid, engines_os));
            }
            _ => down.push(a.name.clone()),
        }
    }
    let orphans =
        processes.iter().filter(|p| p.engine && !agent_pids.contains(&p.ppid)).map(|p| p.pid).collect();
    Sample { at_ms, redis_ok, leader, leaders: leading.len(), leader_id, nodes, down, orphans }
}

/// The leader's models, from its `/admin/status`.
fn models(status: &Value) -> Vec<ModelSample> {
    let mut out = Vec::new();
    for m in status["models"].as_array().into_iter().flatten() {
        let placed = m["placement"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| Placed {
                replica: p["replica"].as_str().unwrap_or("").to_owned(),
                node: p["node"].as_str().unwrap_or("").to_owned(),
                hot: p["level"] == "HOT",
                gpus: gpu_map(&p["gpus"]),
            })
            .collect();
        let ready = m["replicas"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["state"] == "ready")
            .filter_map(|r| r["id"].as_str().map(str::to_owned))
            .collect();
        out.push(ModelSample {
            model: m["model"].as_str().unwrap_or("").to_owned(),
            min_replicas: m["min_replicas"].as_u64().unwrap_or(0) as u32,
            placed,
            ready,
        });
    }
    out
}

/// `{"0": bytes, …}` → GPU → bytes.
fn gpu_map(v: &Value) -> BTreeMap<u32, u64> {
    v.as_object().into_iter().flatten().filter_map(|(k, b)| Some((k.parse().ok()?, b.as_u64()?))).collect()
}

/// A node from its agent's `/status`.
fn node(status: &Value, name: &str, pid: u32, processes: Vec<u32>) -> NodeSample {
    let gpus = status["gpus"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
    let mut engines = Vec::new();
    for r in status["replicas"].as_array().into_iter().flatten() {
        let view = &r["view"];
        let engine = &view["engine"];
        let state = engine["state"].as_str().unwrap_or("").to_owned();
        // The slot whose memory it holds (`Engine::holds`): a stopping
        // engine or one being killed names it in `holds`, the others in
        // `slot` — asleep ones hold none.
        let holds = match state.as_str() {
            "starting" | "awake" | "falling_asleep" | "waking" => gpu_map(&engine["slot"]["gpus"]),
            "stopping" | "killing" => gpu_map(&engine["holds"]["gpus"]),
            _ => BTreeMap::new(),
        };
        let want = match &view["want"] {
            Value::Null => "gone",
            Value::String(s) if s == "Warm" => "warm",
            _ => "hot",
        };
        engines.push(EngineSample {
            replica: view["replica"].as_str().unwrap_or("").to_owned(),
            model: view["model"].as_str().unwrap_or("").to_owned(),
            has_process: !matches!(state.as_str(), "absent" | "failed"),
            state,
            holds,
            pid: r["pid"].as_u64().map(|p| p as u32),
            want: want.to_owned(),
        });
    }
    NodeSample { name: name.to_owned(), pid, gpus, engines, processes }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use hangar_agent::lifecycle::{Engine, Slot};

    /// The GPUs an engine holds, read from the agent's own serialization
    /// of each state (so a state renamed there cannot pass unread here).
    #[test]
    fn the_gpus_each_engine_state_holds_are_read_from_the_status() {
        let slot = Slot { gpus: BTreeMap::from([(1, 40)]), fraction: Some(0.5) };
        let cases = [
            (Engine::Awake { slot: slot.clone() }, true),
            (Engine::Stopping { holds: Some(slot.clone()) }, true),
            (Engine::Killing { holds: Some(slot.clone()), why: "hung".into() }, true),
            (Engine::Killing { holds: None, why: "died asleep".into() }, false),
            (Engine::Asleep { slot: slot.clone() }, false),
            (Engine::Failed { why: "gone".into(), retry_at: 0 }, false),
        ];
        for (engine, holds) in cases {
            let status = serde_json::json!({
                "gpus": [80, 80],
                "replicas": [{"view": {"replica": "r", "model": "m", "engine": engine, "want": null}}],
            });
            let sample = super::node(&status, "n", 1, vec![]);
            let want = if holds { BTreeMap::from([(1, 40)]) } else { BTreeMap::new() };
            assert_eq!(sample.engines[0].holds, want, "{engine:?}");
        }
    }
}
