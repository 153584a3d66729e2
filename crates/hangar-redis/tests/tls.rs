//! `rediss://`: Redis over TLS against Debian's `redis-server` in TLS
//! mode, its certificate issued by a throwaway CA; and the checks a
//! `rediss` URL passes at load.

use hangar_redis::tls::TestCa;
use hangar_redis::{check_url, redis, LocalRedis, LocalRedisCluster, Redis, RedisError};

/// `url` with `?ca_file=` the PEM file at `path`.
fn with_ca(url: &str, path: &std::path::Path) -> String {
    format!("{url}/0?ca_file={}", path.display())
}

#[test]
fn rediss_with_the_servers_ca_runs_commands() {
    let Some(server) = LocalRedis::for_test_tls() else { return };
    let url = with_ca(&server.tls_url().unwrap(), &server.ca_file().unwrap());
    assert_eq!(check_url(&url), Ok(()));
    let redis = Redis::connect(&url).unwrap();
    redis.run(|c| redis::cmd("SET").arg("hangar:tls").arg("over TLS").query::<()>(c)).unwrap();
    let got: String = redis.run(|c| redis::cmd("GET").arg("hangar:tls").query(c)).unwrap();
    assert_eq!(got, "over TLS");
    let n: i64 = redis.run(|c| redis::cmd("INCRBY").arg("hangar:tls:n").arg(41).query(c)).unwrap();
    let (n2, len): (i64, i64) = redis
        .run(|c| redis::pipe().cmd("INCR").arg("hangar:tls:n").cmd("STRLEN").arg("hangar:tls").query(c))
        .unwrap();
    assert_eq!((n, n2, len), (41, 42, 8));
    // The same data over the server's plain Unix socket: one server.
    let plain = Redis::connect(&server.url()).unwrap();
    let got: String = plain.run(|c| redis::cmd("GET").arg("hangar:tls").query(c)).unwrap();
    assert_eq!(got, "over TLS");
}

#[test]
fn a_certificate_from_an_untrusted_ca_is_refused_naming_the_problem() {
    let Some(server) = LocalRedis::for_test_tls() else { return };
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("other-ca.pem");
    TestCa::new("someone else's CA").write(&other).unwrap();
    // Another CA's file, and the default roots (the Mozilla CAs, which
    // never signed a test certificate).
    for url in [with_ca(&server.tls_url().unwrap(), &other), server.tls_url().unwrap()] {
        let e = Redis::connect(&url).unwrap_err();
        assert!(matches!(e, RedisError::Unreachable { .. }), "{url}: {e}");
        let text = e.to_string();
        assert!(text.contains("invalid peer certificate") && text.contains("UnknownIssuer"), "{url}: {text}");
        assert!(text.contains(&url), "the error names the server: {text}");
    }
}

#[test]
fn rediss_urls_are_checked_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    TestCa::new("load-time CA").write(&ca).unwrap();
    let ca = ca.display();
    for ok in [
        "rediss://redis.example.com:6380/0".to_owned(),
        format!("rediss://redis.example.com:6380/0?ca_file={ca}"),
        format!("rediss://:secret@10.0.0.5/2?protocol=resp3&ca_file={ca}"),
        "redis://127.0.0.1:6379/0".to_owned(),
        "unix:///run/redis.sock".to_owned(),
        "rediss+cluster://redis-0.example.com:6380,redis-1.example.com:6380".to_owned(),
        format!("rediss+cluster://:secret@10.0.0.5:6380,10.0.0.6:6380/0?ca_file={ca}"),
    ] {
        assert_eq!(check_url(&ok), Ok(()), "{ok}");
    }
    for (bad, says) in [
        ("rediss://redis.example.com/0#insecure".to_owned(), "#insecure"),
        (format!("redis://127.0.0.1/0?ca_file={ca}"), "only a TLS URL (rediss://"),
        ("rediss://h/0?ca_file=ca.pem".to_owned(), "relative path"),
        (format!("rediss://h/0?ca_file={}/nope.pem", dir.path().display()), "cannot read the CA file"),
        (format!("rediss://h/0?ca_file={ca}&ca_file={ca}"), "more than once"),
        (format!("rediss+cluster://h:6380?ca_file={ca}&ca_file={ca}"), "more than once"),
        ("rediss+cluster://h:6380?ca_file=ca.pem".to_owned(), "relative path"),
        ("http://cache:6379".to_owned(), "is not a Redis URL"),
    ] {
        let e = check_url(&bad).unwrap_err();
        assert!(e.contains(says) && e.contains(&bad), "{bad}: {e}");
        assert!(Redis::connect(&bad).unwrap_err().to_string().contains(says), "{bad}");
    }
}

/// A Redis Cluster served over TLS only is reached with
/// `rediss+cluster://…?ca_file=`, the nodes' certificate verified on every
/// connection the slot map leads to; without the CA it is refused.
#[test]
fn a_cluster_over_tls_is_reached_with_its_ca_and_refused_without() {
    let Some(cluster) = LocalRedisCluster::for_test_tls() else { return };
    let url = cluster.url();
    assert!(url.starts_with("rediss+cluster://") && url.contains("?ca_file="), "{url}");
    let redis = Redis::connect(&url).unwrap();
    assert_eq!(redis.prefix(), "{hangar}");
    for i in 0..20 {
        // Keys of every node's slots, not only Hangar's one.
        let key = format!("k{i}");
        redis.run(|c| redis::cmd("SET").arg(&key).arg(i).query::<()>(c)).unwrap();
        let back: i64 = redis.run(|c| redis::cmd("GET").arg(&key).query(c)).unwrap();
        assert_eq!(back, i);
    }
    let without = url.split('?').next().unwrap();
    let e = Redis::connect(without).unwrap_err().to_string();
    assert!(e.contains("UnknownIssuer") || e.contains("certificate"), "{e}");
}
