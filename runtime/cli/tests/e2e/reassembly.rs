//! KV split by head (tp) and layer (pp) on the prefill, received in one region per decode
//! rank, and reassembled byte for byte, for decode tp smaller than, equal to and larger
//! than the prefill's.

use std::sync::Arc;

use handoff::{Cluster, ClusterConfig};
use handoff_bootstrap::{DirectoryCache, DirectoryClient};
use handoff_core::{Room, Tasks};
use handoff_engine::{Engine, MockEngine};
use handoff_frontend::attempt::{self, AttemptCtx, Stages, Target};
use handoff_proto::v1::SamplingParams;
use handoff_proto::v1::prefill_client::PrefillClient;
use handoff_transfer::{InboxConfig, TransferKind};
use tokio::time::{Duration, Instant};

use super::support::*;

async fn reassemble(c: &Cluster, decode_tp: usize, tokens: &[u32]) -> handoff_engine::Kv {
    let engine = engine();
    let tasks = Tasks::new();
    let agent = TransferKind::loopback().start(InboxConfig::default(), &tasks, None).await.unwrap();
    let directory = DirectoryCache::new(DirectoryClient::default());
    let ctx = AttemptCtx {
        engine: &*engine,
        agent: &agent,
        directory: &directory,
        decode_tp,
        transfer_token: None,
    };
    let p = &c.prefills[0];
    let target = Target {
        instance: p.id.to_string(),
        dp_rank: 0,
        bootstrap_addr: p.bootstrap_addr.clone(),
        prefill: PrefillClient::connect(format!("http://{}", p.grpc_addr)).await.unwrap(),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut stages = Stages::start();
    let got = attempt::run(
        &ctx,
        target,
        Room::mint(),
        tokens,
        &SamplingParams::default(),
        deadline,
        &mut stages,
    )
    .await
    .unwrap_or_else(|e| panic!("decode tp {decode_tp}: {e}"));
    let heads = engine.info().shape.kv_heads;
    let replicas = (decode_tp / heads).max(1) as u64;
    let one_copy = (tokens.len() * engine.info().shape.token_bytes()) as u64;
    assert_eq!(got.kv_bytes, one_copy * replicas, "decode tp {decode_tp}: bytes received");
    tasks.shutdown().await;
    got.kv
}

#[tokio::test]
async fn kv_is_reassembled_byte_exact_for_every_decode_tp() {
    let shape = engine().info().shape;
    for (prefill_tp, prefill_pp) in [(2, 1), (4, 2), (1, 1)] {
        let cfg =
            ClusterConfig { prefills: 1, prefill_tp, prefill_pp, ..ClusterConfig::ephemeral() };
        let c = Cluster::start_shared(cfg, engine() as Arc<dyn Engine>).await.unwrap();
        for decode_tp in [1, 2, 4, 8] {
            let tokens = prompt(decode_tp as u32, 37);
            let kv = reassemble(&c, decode_tp, &tokens).await;
            assert!(
                kv == MockEngine::compute_kv(shape, &tokens, 0),
                "prefill tp {prefill_tp} pp {prefill_pp} -> decode tp {decode_tp}"
            );
        }
        c.shutdown().await;
    }
}

#[tokio::test]
async fn decode_tp_other_than_prefill_tp_gives_the_right_tokens() {
    for decode_tp in [1, 4] {
        let cfg = ClusterConfig { decode_tp, ..ClusterConfig::ephemeral() };
        let c = cluster(cfg).await;
        let mut cl = client(&c).await;
        let p = prompt(decode_tp, 64);
        assert_eq!(
            generate(&mut cl, &p, 8).await.unwrap().0,
            aggregated(&*engine(), &p, 8).await,
            "decode tp {decode_tp}"
        );
        c.shutdown().await;
    }
}
