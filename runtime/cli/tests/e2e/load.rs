//! Concurrency through the same assembly `handoff up` runs.

use futures::future::join_all;
use handoff::ClusterConfig;

use super::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_requests_all_complete() {
    let c = cluster(ClusterConfig::ephemeral()).await;
    let cl = client(&c).await;
    let engine = engine();
    let calls = (0..200u32).map(|i| {
        let mut cl = cl.clone();
        async move {
            let p = prompt(i % 50, 30 + (i as usize % 7) * 16);
            (generate(&mut cl, &p, 8).await, p)
        }
    });
    for (res, p) in join_all(calls).await {
        let (tokens, _) = res.expect("no error under load");
        assert_eq!(tokens, aggregated(&*engine, &p, 8).await);
    }
    c.shutdown().await;
}
