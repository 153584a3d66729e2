//! `BlockRemoved` events reach a ZMQ subscriber in vLLM's KV-event format.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{spec, Fixture, TreeUsage};
use hangar_evict::{Evictor, Services, Tick};
use zeromq::{Socket, SocketRecv};

#[test]
fn removed_blocks_are_published_to_storage_events_endpoint() {
    let fx = Fixture::new();
    let files = fx.tree(spec(150));
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let config = fx.config(&[
        ("CLEANUP_THRESHOLD", "1"),
        ("TARGET_THRESHOLD", "0"),
        ("STORAGE_EVENTS_ENDPOINT", &endpoint),
        ("DELETION_BATCH_SIZE", "40"),
    ]);
    let usage = TreeUsage::filled_to(&fx.root, 99.0);
    let mut ev = Evictor::new(config.clone(), usage.source());
    let services = Services::start(&config, ev.stats()).unwrap();
    ev = ev.with_removed_sink(services.removed_sink().expect("events enabled"));

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut sub = zeromq::SubSocket::new();
    rt.block_on(async {
        sub.connect(&endpoint).await.unwrap();
        sub.subscribe("kv@").await.unwrap();
        // Let the publisher register the subscription (ZMQ slow joiner).
        tokio::time::sleep(Duration::from_millis(500)).await;
    });

    assert!(matches!(ev.tick().unwrap(), Tick::Evicted(_)));
    assert!(fx.remaining(&files).is_empty());
    services.stop();

    let mut hashes = BTreeSet::new();
    let mut seqs = Vec::new();
    rt.block_on(async {
        while hashes.len() < files.len() {
            let msg = tokio::time::timeout(Duration::from_secs(10), sub.recv())
                .await
                .expect("events stopped arriving")
                .unwrap();
            let frames = msg.into_vec();
            assert_eq!(&frames[0][..], b"kv@SHARED_STORAGE@meta-llama/Llama-3.1-8B");
            seqs.push(u64::from_be_bytes(frames[1][..].try_into().unwrap()));
            let (_ts, events): (f64, Vec<(String, Vec<u64>, String)>) =
                rmp_serde::from_slice(&frames[2]).unwrap();
            for (kind, block_hashes, medium) in events {
                assert_eq!((kind.as_str(), medium.as_str()), ("BlockRemoved", "SHARED_STORAGE"));
                assert!(block_hashes.len() <= 40);
                hashes.extend(block_hashes);
            }
        }
    });
    let expected: BTreeSet<u64> = files.iter().map(|f| f.hash).collect();
    assert_eq!(hashes, expected);
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
}
