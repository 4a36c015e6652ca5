//! The request path: disaggregated tokens equal aggregated ones, rooms are fresh, every stage
//! is recorded, prefixes are reused, bad input is refused.

use std::collections::HashSet;

use futures::StreamExt;
use handoff::ClusterConfig;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::{GenerateRequest, SamplingParams, TokenIds};
use handoff_transfer::{FakeNetwork, TransferKind};

use super::support::*;

#[tokio::test]
async fn disaggregated_tokens_equal_aggregated_and_rooms_are_fresh() {
    let c = cluster(ClusterConfig::ephemeral()).await;
    let engine = engine();
    let mut cl = client(&c).await;
    for seed in 0..5 {
        let p = prompt(seed, 40 + seed as usize * 13);
        let (tokens, done) = generate(&mut cl, &p, 10).await.unwrap();
        assert_eq!(tokens, aggregated(&*engine, &p, 10).await, "prompt {seed}");
        assert_eq!(done.usage.unwrap().completion_tokens, 10);
    }

    // 1000 requests, 16 at a time: rooms non-zero and distinct, every stage recorded.
    let mut rooms = HashSet::new();
    let results = futures::stream::iter(0..1000u32)
        .map(|i| {
            let mut cl = cl.clone();
            async move { generate(&mut cl, &prompt(i, 20 + (i as usize % 50)), 2).await }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    for r in results {
        let (_, done) = r.expect("request succeeds");
        let ev = done.evidence.unwrap();
        assert_ne!(ev.bootstrap_room, 0);
        assert!(rooms.insert(ev.bootstrap_room), "room {} reused", ev.bootstrap_room);
        let s = ev.stages.unwrap();
        let stages = [
            s.resolve_topology_us,
            s.resolve_rank_us,
            s.register_us,
            s.connect_us,
            s.verify_us,
            s.consume_us,
        ];
        assert!(stages.iter().all(|&t| t > 0), "every stage recorded: {s:?}");
        assert!(ev.instance_id.starts_with("prefill-"));
    }
    assert_eq!(rooms.len(), 1000);
    assert_eq!(c.frontend.agent().inbox().regions(), 0, "no receive region left behind");
    c.shutdown().await;
}

#[tokio::test]
async fn a_shared_prefix_is_served_from_cache_with_the_same_tokens() {
    shared_prefix_from_cache(ClusterConfig::ephemeral()).await.shutdown().await;
}

/// The same, with the frontend asking the scheduler in its own process (with the cluster's
/// token, which its service checks as over gRPC): the KV events reach it, it routes by
/// them, and every booking's report reaches it.
#[tokio::test]
async fn a_frontend_asking_its_scheduler_in_process_routes_by_prefix_as_over_grpc() {
    let cfg = ClusterConfig {
        scheduler_in_frontend: true,
        token: Some("cluster-secret".into()),
        ..ClusterConfig::ephemeral()
    };
    let c = shared_prefix_from_cache(cfg).await;
    assert_eq!(c.frontend.schedulers().addrs(), [handoff::cluster::IN_PROCESS]);
    let since = std::time::Instant::now();
    while c.scheduler.state().open_bookings() > 0 {
        assert!(since.elapsed() < std::time::Duration::from_secs(10), "every report arrives");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    c.shutdown().await;
}

/// A prompt, then one sharing its first six pages: the second is routed to the instance
/// holding them and served from its cache, with the tokens of an aggregated run.
async fn shared_prefix_from_cache(cfg: ClusterConfig) -> handoff::Cluster {
    let c = cluster(cfg).await;
    let engine = engine();
    let mut cl = client(&c).await;
    let first = prompt(1, 100);
    let (_, done) = generate(&mut cl, &first, 4).await.unwrap();
    assert_eq!(done.usage.unwrap().cached_tokens, 0);
    let mut second = first[..96].to_vec();
    second.extend(prompt(2, 30));
    // Let the KV events reach the scheduler.
    let since = std::time::Instant::now();
    while c.scheduler.state().instances().iter().map(|i| i.cached_blocks).sum::<u64>() < 6 {
        assert!(since.elapsed() < std::time::Duration::from_secs(10), "the KV events arrive");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let (tokens, done) = generate(&mut cl, &second, 6).await.unwrap();
    assert_eq!(done.usage.unwrap().cached_tokens, 96, "six cached pages of 16");
    assert_eq!(tokens, aggregated(&*engine, &second, 6).await);
    assert_eq!(done.evidence.unwrap().instance_id, done_instance(&c, &first).await);
    c
}

async fn done_instance(c: &handoff::Cluster, p: &[u32]) -> String {
    let mut cl = client(c).await;
    generate(&mut cl, p, 1).await.unwrap().1.evidence.unwrap().instance_id
}

#[tokio::test]
async fn the_fake_backend_runs_the_same_path() {
    let cfg = ClusterConfig {
        transfer: TransferKind::Fake(FakeNetwork::new()),
        ..ClusterConfig::ephemeral()
    };
    let c = cluster(cfg).await;
    let mut cl = client(&c).await;
    let p = prompt(9, 77);
    assert_eq!(generate(&mut cl, &p, 5).await.unwrap().0, aggregated(&*engine(), &p, 5).await);
    c.shutdown().await;
}

/// Mooncake's wire between handoff's own prefill ranks and frontend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mooncake_backend_runs_the_same_path() {
    let bind_ip = std::net::Ipv4Addr::LOCALHOST.into();
    same_path_over(TransferKind::Mooncake { bind_ip, advertise_ip: None }, "mooncake").await;
}

/// NIXL (the wheel's library, UCX over TCP) between handoff's own prefill ranks and frontend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nixl_backend_runs_the_same_path() {
    let bind_ip = std::net::Ipv4Addr::LOCALHOST.into();
    same_path_over(TransferKind::Nixl { bind_ip, advertise_ip: None }, "nixl").await;
}

/// tp 2 prefills into a tp 1 decode over `transfer`, 50 requests with the cluster token:
/// tokens as aggregated, no failed attempt, no receive region left behind.
async fn same_path_over(transfer: TransferKind, name: &str) {
    let cfg = ClusterConfig {
        transfer,
        token: Some("cluster-secret".into()),
        ..ClusterConfig::ephemeral()
    };
    let c = cluster(cfg).await;
    assert_eq!(c.frontend.agent().backend_name(), name);
    let mut cl = client(&c).await;
    for seed in 0..50 {
        let p = prompt(seed, 30 + seed as usize * 7);
        let (tokens, done) = generate(&mut cl, &p, 4).await.unwrap();
        assert_eq!(tokens, aggregated(&*engine(), &p, 4).await, "prompt {seed}");
        let ev = done.evidence.unwrap();
        assert!(ev.failed_attempts.is_empty(), "prompt {seed}: {:?}", ev.failed_attempts);
        assert!(ev.kv_bytes > 0);
    }
    assert_eq!(c.frontend.agent().inbox().regions(), 0, "no receive region left behind");
    let (over_transfer, in_call) = super::handshakes::handshakes_via(&c);
    assert_eq!((over_transfer, in_call), (50, 0), "{name}'s handshakes never ride in the call");
    c.shutdown().await;
}

#[tokio::test]
async fn bad_requests_get_invalid_argument_and_the_frontend_keeps_serving() {
    let c = cluster(ClusterConfig::ephemeral()).await;
    let mut cl = client(&c).await;
    let ids = |ids: Vec<u32>| Some(Input::TokenIds(TokenIds { ids }));
    let bad = [
        GenerateRequest { input: None, ..Default::default() },
        GenerateRequest { input: ids(vec![]), ..Default::default() },
        GenerateRequest { input: ids(vec![5, 999_999]), ..Default::default() },
        GenerateRequest { input: ids(vec![5; 9000]), ..Default::default() },
        GenerateRequest { input: ids(vec![5]), policy: 77, ..Default::default() },
        GenerateRequest {
            input: ids(vec![5]),
            sampling: Some(SamplingParams { temperature: f32::NAN, ..Default::default() }),
            ..Default::default()
        },
        GenerateRequest {
            input: ids(vec![5]),
            sampling: Some(SamplingParams { max_tokens: 100_000, ..Default::default() }),
            ..Default::default()
        },
    ];
    for req in bad {
        let err = cl.generate(req.clone()).await.expect_err("refused");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{req:?}: {err}");
        assert!(!err.message().is_empty());
    }
    let unknown =
        GenerateRequest { model: "gpt-9".into(), input: ids(vec![5]), ..Default::default() };
    assert_eq!(cl.generate(unknown).await.unwrap_err().code(), tonic::Code::NotFound);
    assert!(generate(&mut cl, &prompt(3, 20), 3).await.is_ok());
    c.shutdown().await;
}

#[tokio::test]
async fn a_scheduler_in_the_frontends_process_is_one_replica() {
    let cfg =
        ClusterConfig { scheduler_in_frontend: true, schedulers: 2, ..ClusterConfig::ephemeral() };
    let refused = handoff::Cluster::start_shared(cfg, engine()).await.err();
    let e = refused.expect("two replicas in one frontend are refused").to_string();
    assert!(e.contains("one replica"), "{e}");
}
