//! KV split by head (tp) and layer (pp) on the prefill, received in one region per decode
//! rank, and reassembled byte for byte, for decode tp smaller than, equal to and larger
//! than the prefill's.

use std::sync::Arc;

use handoff::{Cluster, ClusterConfig};
use handoff_engine::{Engine, MockEngine};

use super::support::*;

async fn reassemble(c: &Cluster, decode_tp: usize, tokens: &[u32]) -> handoff_engine::Kv {
    let engine = engine();
    let got = direct_attempt(c, &*engine, decode_tp, tokens).await;
    let heads = engine.info().shape.kv_heads;
    let replicas = (decode_tp / heads).max(1) as u64;
    let one_copy = (tokens.len() * engine.info().shape.token_bytes()) as u64;
    assert_eq!(got.kv_bytes, one_copy * replicas, "decode tp {decode_tp}: bytes received");
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
