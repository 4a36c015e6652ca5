//! The decode's own memory found full is answered at once, on the first attempt: no other
//! prefill instance would find it otherwise.

use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff::{Cluster, ClusterConfig};
use handoff_engine::{MockConfig, MockEngine};

use super::support::*;

/// Receive regions held past the inbox's bytes (a one-token request holds one through its
/// prefill, with no decode slot) refuse the next request at once (429), counted as one
/// failed attempt: before, each of the other instances was booked and tried in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_memory_full_refuses_at_once_without_trying_other_instances() {
    let engine = Arc::new(MockEngine::new(MockConfig {
        prefill_per_token: Duration::from_millis(4),
        ..MockConfig::default()
    }));
    let token_bytes = handoff_engine::Engine::info(&*engine).shape.token_bytes() as u64;
    let mut cfg = ClusterConfig { prefills: 3, ..ClusterConfig::ephemeral() };
    cfg.frontend.inbox.max_total_bytes = 320 * token_bytes;
    let c = Cluster::start_shared(cfg, engine).await.expect("cluster starts");
    let mut cl = client(&c).await;
    let mut holder = cl.clone();
    // 300 tokens at 4 ms: its region is held for over a second.
    let first = tokio::spawn(async move { generate(&mut holder, &prompt(1, 300), 1).await });
    let since = Instant::now();
    while c.frontend.agent().inbox().regions() == 0 {
        assert!(since.elapsed() < Duration::from_secs(5), "the first holds its region");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let e = generate(&mut cl, &prompt(2, 32), 1).await.expect_err("refused");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    let scrape = c.frontend.ops().scrape();
    let failures: f64 = scrape
        .lines()
        .filter(|l| l.starts_with("handoff_frontend_attempt_failures_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(failures, 1.0, "one attempt: {scrape}");
    first.await.unwrap().expect("the first is served");
    c.shutdown().await;
}
