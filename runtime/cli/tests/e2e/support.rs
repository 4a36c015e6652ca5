//! Helpers: a client call that collects a stream, and the aggregated reference.

use std::sync::Arc;

use handoff::{Cluster, ClusterConfig};
use handoff_engine::{Engine, MockConfig, MockEngine, Sampling};
use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::generate_response::Event;
use handoff_proto::v1::{Complete, GenerateRequest, SamplingParams, TokenIds};
use tonic::transport::Channel;

pub(crate) fn engine() -> Arc<MockEngine> {
    Arc::new(MockEngine::new(MockConfig::default()))
}

pub(crate) async fn cluster(cfg: ClusterConfig) -> Cluster {
    Cluster::start_shared(cfg, engine()).await.expect("cluster starts")
}

pub(crate) async fn client(c: &Cluster) -> GenerateClient<Channel> {
    GenerateClient::connect(format!("http://{}", c.frontend_addr))
        .await
        .expect("frontend reachable")
}

/// A prompt of `n` token ids, distinct per `seed`.
pub(crate) fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 2 + (seed * 7919 + i * 104_729) % 31_000).collect()
}

/// Generates through the frontend: the streamed tokens and the final message.
pub(crate) async fn generate(
    client: &mut GenerateClient<Channel>,
    tokens: &[u32],
    max_tokens: u32,
) -> Result<(Vec<u32>, Complete), tonic::Status> {
    let req = GenerateRequest {
        input: Some(Input::TokenIds(TokenIds { ids: tokens.to_vec() })),
        sampling: Some(SamplingParams { max_tokens, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    };
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await? {
        match m.event {
            Some(Event::Chunk(c)) => out.extend(c.token_ids),
            Some(Event::Complete(c)) => return Ok((out, c)),
            None => {}
        }
    }
    Err(tonic::Status::internal("stream ended without Complete"))
}

/// What the same engine generates aggregated: prefill and decode in one place, no transfer.
pub(crate) async fn aggregated(engine: &dyn Engine, tokens: &[u32], n: usize) -> Vec<u32> {
    let p = engine.prefill(tokens, None, &Sampling::default()).await.unwrap();
    let mut out = vec![p.first_token];
    let mut d = engine.decoder(p.kv, p.first_token, &Sampling::default()).unwrap();
    while out.len() < n {
        out.push(d.step().await.unwrap());
    }
    out
}

/// One attempt of the request path run directly against the cluster's first prefill
/// instance, as a decode of tp `decode_tp` with its own agent: the verified, reassembled KV.
pub(crate) async fn direct_attempt(
    c: &Cluster,
    engine: &dyn Engine,
    decode_tp: usize,
    tokens: &[u32],
) -> handoff_frontend::attempt::Prefilled {
    try_direct_attempt(c, engine, decode_tp, tokens)
        .await
        .unwrap_or_else(|e| panic!("decode tp {decode_tp}: {e}"))
}

/// [`direct_attempt`], failing as the attempt does.
pub(crate) async fn try_direct_attempt(
    c: &Cluster,
    engine: &dyn Engine,
    decode_tp: usize,
    tokens: &[u32],
) -> Result<handoff_frontend::attempt::Prefilled, handoff_frontend::FrontendError> {
    let loopback = handoff_transfer::TransferKind::loopback();
    try_direct_attempt_over(c, engine, decode_tp, tokens, loopback).await
}

/// [`try_direct_attempt`] with the decode's agent of `kind`.
pub(crate) async fn try_direct_attempt_over(
    c: &Cluster,
    engine: &dyn Engine,
    decode_tp: usize,
    tokens: &[u32],
    kind: handoff_transfer::TransferKind,
) -> Result<handoff_frontend::attempt::Prefilled, handoff_frontend::FrontendError> {
    let p = &c.prefills[0];
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    try_direct_attempt_via(c, engine, decode_tp, tokens, kind, &p.grpc_addr, deadline).await
}

/// [`try_direct_attempt_over`] calling the prefill at `grpc_addr` (a proxy of it), within
/// `deadline`.
pub(crate) async fn try_direct_attempt_via(
    c: &Cluster,
    engine: &dyn Engine,
    decode_tp: usize,
    tokens: &[u32],
    kind: handoff_transfer::TransferKind,
    grpc_addr: &str,
    deadline: tokio::time::Instant,
) -> Result<handoff_frontend::attempt::Prefilled, handoff_frontend::FrontendError> {
    use handoff_bootstrap::{DirectoryCache, DirectoryClient};
    use handoff_frontend::attempt::{self, AttemptCtx, PrefillPeer, Stages, Target};
    use handoff_proto::v1::prefill_client::PrefillClient;
    use handoff_transfer::InboxConfig;

    let tasks = handoff_core::Tasks::new();
    let agent = kind.start(InboxConfig::default(), &tasks, None).await.unwrap();
    let directory = DirectoryCache::new(DirectoryClient::default());
    let ctx = AttemptCtx {
        engine,
        agent: &agent,
        directory: &directory,
        decode_tp,
        transfer_token: None,
        trace: Default::default(),
        tasks: &tasks,
    };
    let p = &c.prefills[0];
    let target = Target {
        instance: p.id.to_string(),
        dp_rank: 0,
        bootstrap_addr: p.bootstrap_addr.clone(),
        prefill: PrefillPeer::new(
            PrefillClient::connect(format!("http://{grpc_addr}")).await.unwrap(),
        ),
    };
    let room = handoff_core::Room::mint();
    let got = attempt::run(
        &ctx,
        target,
        room,
        tokens,
        &SamplingParams::default(),
        deadline,
        &mut Stages::start(),
    )
    .await;
    tasks.shutdown().await;
    got
}
