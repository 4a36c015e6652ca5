//! What a prefill's metrics say of the bus: an operator sees a prefill that cannot publish
//! (its heartbeats and KV events lost, the schedulers about to stop hearing it).

use std::time::{Duration, Instant};

use super::operations::http_get;
use super::processes::addr_after;
use super::servers::{Handoff, Server};

/// The value of the sample `name` (with its labels) in `/metrics` at `ops`.
async fn sample(ops: &str, name: &str) -> Option<f64> {
    let (_, body) = http_get(ops, "/metrics").await;
    body.lines().find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
}

/// Waits until `name` at `ops` reads `want`, within 20 s.
async fn reads(ops: &str, name: &str, want: f64) {
    let start = Instant::now();
    loop {
        if sample(ops, name).await == Some(want) {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{name} never {want}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_says_when_nats_does_not_take_its_messages() {
    let (etcd, mut nats) = (Server::etcd(), Server::nats());
    let (_p, line) = Handoff::spawn(&[
        "prefill",
        "--engine",
        "mock",
        "--id",
        "p1",
        "--bootstrap-listen",
        "127.0.0.1:0",
        "--grpc-listen",
        "127.0.0.1:0",
        "--ops-listen",
        "127.0.0.1:0",
        "--etcd",
        &etcd.url,
        "--nats",
        &nats.url,
    ]);
    let ops = addr_after(&line, "ops http://");
    reads(&ops, "handoff_prefill_bus_publishing", 1.0).await;
    nats.stop();
    reads(&ops, "handoff_prefill_bus_publishing", 0.0).await;
    nats.start();
    reads(&ops, "handoff_prefill_bus_publishing", 1.0).await;
    assert!(sample(&ops, "handoff_prefill_bus_lost_total{reason=\"queue_full\"}").await.is_some());
}
