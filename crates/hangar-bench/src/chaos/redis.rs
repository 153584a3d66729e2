//! The Redis the fleet runs on, and what the Redis faults do to it: one
//! server with AOF, or a Redis Cluster of three primaries with a replica
//! each (`--redis cluster`), where killing "Redis" kills the primary that
//! holds Hangar's hash slot *now* — so its replica takes over, and the
//! killed node, started again, rejoins as the new primary's replica, the
//! next kill failing back to it.

use std::time::Duration;

use hangar_redis::{LocalRedis, LocalRedisCluster, Rejoined, ServerError};

/// The slot every key of Hangar's is in on a cluster (`{hangar}:…`).
const HANGAR_SLOT_KEY: &str = "{hangar}";

/// How long a killed cluster node, started again, may take to rejoin.
const REJOIN_LIMIT: Duration = Duration::from_secs(60);

/// Which Redis the fleet runs on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Topology {
    /// One `redis-server` with AOF: a kill is an outage until it is back.
    #[default]
    Single,
    /// A Redis Cluster, three primaries and a replica of each: a kill of
    /// the slot's primary is a failover (two seconds to notice, then the
    /// replica's election), a pause holds the slot's primary.
    Cluster,
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Topology::Single => "one redis-server with AOF",
            Topology::Cluster => "a Redis Cluster, 3 primaries with a replica each",
        })
    }
}

impl std::str::FromStr for Topology {
    type Err = String;

    fn from_str(s: &str) -> Result<Topology, String> {
        match s {
            "single" => Ok(Topology::Single),
            "cluster" => Ok(Topology::Cluster),
            other => Err(format!("`{other}` is no Redis topology; use `single` or `cluster`")),
        }
    }
}

/// The running Redis of a [`Topology`].
#[derive(Debug)]
pub enum RedisUnderTest {
    /// One server.
    Single(LocalRedis),
    /// A cluster, and the node a fault killed, until it is started again.
    Cluster { cluster: LocalRedisCluster, down: Option<usize> },
}

impl RedisUnderTest {
    /// Starts it (blocking: run it on a blocking thread).
    pub fn start(topology: Topology) -> Result<RedisUnderTest, ServerError> {
        Ok(match topology {
            Topology::Single => RedisUnderTest::Single(LocalRedis::start()?),
            Topology::Cluster => {
                RedisUnderTest::Cluster { cluster: LocalRedisCluster::start_with_replicas()?, down: None }
            }
        })
    }

    /// The URL the fleet's processes are given.
    pub fn url(&self) -> String {
        match self {
            RedisUnderTest::Single(r) => r.url(),
            RedisUnderTest::Cluster { cluster, .. } => cluster.url(),
        }
    }

    /// Kills the server, or the cluster's primary of Hangar's slot, with
    /// SIGKILL; it stays down. Returns what was killed, in words.
    pub fn crash(&mut self) -> Result<String, ServerError> {
        match self {
            RedisUnderTest::Single(r) => {
                r.crash();
                Ok(String::new())
            }
            RedisUnderTest::Cluster { cluster, down } => {
                let primary = cluster.primary_for(HANGAR_SLOT_KEY)?;
                cluster.nodes()[primary].crash();
                *down = Some(primary);
                Ok(format!("killed cluster node {primary}, the primary of Hangar's slot"))
            }
        }
    }

    /// Starts what [`RedisUnderTest::crash`] killed again on its data and
    /// waits until it answers — a cluster node until it has its place
    /// back in the cluster. Returns what it became, in words.
    pub fn start_again(&mut self) -> Result<String, ServerError> {
        match self {
            RedisUnderTest::Single(r) => r.start_again().map(|()| String::new()),
            RedisUnderTest::Cluster { cluster, down } => {
                let Some(node) = down.take() else { return Ok(String::new()) };
                cluster.nodes()[node].start_again()?;
                let now = cluster.primary_for(HANGAR_SLOT_KEY)?;
                Ok(match cluster.wait_rejoined(node, REJOIN_LIMIT)? {
                    Rejoined::Replica => {
                        format!("failed over to node {now}; node {node} rejoined as its replica")
                    }
                    Rejoined::Primary => format!("node {node} is back as the primary (no failover yet)"),
                })
            }
        }
    }

    /// Pauses every client of the server, or of the cluster's primary of
    /// Hangar's slot, for `duration` (`CLIENT PAUSE … ALL`): the cluster's
    /// bus is no client, so a paused primary is not failed over.
    pub fn pause(&mut self, duration: Duration) -> Result<(), ServerError> {
        match self {
            RedisUnderTest::Single(r) => r.pause(duration),
            RedisUnderTest::Cluster { cluster, .. } => {
                let primary = cluster.primary_for(HANGAR_SLOT_KEY)?;
                cluster.nodes()[primary].pause(duration)
            }
        }
    }

    /// Kills every server of it.
    pub fn shut_down(&mut self) {
        match self {
            RedisUnderTest::Single(r) => r.crash(),
            RedisUnderTest::Cluster { cluster, .. } => cluster.nodes().iter_mut().for_each(LocalRedis::crash),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--redis` takes the two topologies by name, and refuses anything
    /// else naming the value and the choices.
    #[test]
    fn a_topology_is_read_by_name_and_anything_else_is_refused_naming_the_choices() {
        assert_eq!("single".parse::<Topology>(), Ok(Topology::Single));
        assert_eq!("cluster".parse::<Topology>(), Ok(Topology::Cluster));
        let e = "sentinel".parse::<Topology>().unwrap_err();
        assert_eq!(e, "`sentinel` is no Redis topology; use `single` or `cluster`");
        assert!("Cluster".parse::<Topology>().is_err(), "names are lowercase, as `--help` lists them");
    }
}
