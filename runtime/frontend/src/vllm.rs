//! Attempts on vLLM prefill servers (protocol `vllm`): the frontend is vLLM's decode for the
//! request, in its NIXL connector's pull mode (vLLM's default). As vLLM's disaggregated proxy
//! does, it POSTs the prompt to the server's `/v1/completions` with `kv_transfer_params`
//! asking it to keep the KV; the answer says where the blocks wait. The frontend then asks
//! each of the prefill's TP ranks for its NIXL metadata on the side channel (once per rank
//! and prefill engine), READs the request's blocks with NIXL, which notifies each rank so it
//! frees them, turns them into the engine's KV, and computes the prompt's last token itself
//! for the first token, as vLLM's decode does.
//!
//! Binding: the room goes as `X-Request-Id`, and an answer whose request id does not derive
//! from it is refused; blocks are read only from the host the instance registered as its side
//! channel. vLLM's wire carries no checksum: the bytes are the prefill's word
//! (`docs/security.md`).
//!
//! The NIXL agent starts with the first such attempt: a frontend routed only to other
//! prefills runs none.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::try_join_all;
use handoff_core::{Room, Tasks};
use handoff_engine::Engine;
use handoff_transfer::nixl::{NixlConfig, NixlTransfer};
use handoff_transfer::{Inbox, InboxConfig, TransferError, TransferKind};
use handoff_vllm::{KvSource, Peer, VllmError, layout, prefill_request, read_blocks};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::attempt::{Prefilled, Stages, within};
use crate::engine_http::{self, EngineHttp, post_json};
use crate::sglang::split_host_port;
use crate::{Cause, FrontendError};

/// Side-channel handshakes remembered (a prefill rank each); past this, all are forgotten.
const MAX_PEERS: usize = 1024;

/// Where a vLLM attempt goes.
#[derive(Debug, Clone)]
pub struct VllmTarget {
    /// The server's HTTP address (`host:port`).
    pub url: String,
    /// Its NIXL side channel as registered (`host:port`): blocks are read from this host only.
    pub side_channel: String,
}

/// A prefill rank's side channel: host, port, TP rank.
type PeerKey = (String, u16, u32);

/// The frontend's side of vLLM's PD protocol (see the module docs).
pub(crate) struct VllmPrefills {
    engine: Arc<dyn Engine>,
    bind_ip: IpAddr,
    inbox: InboxConfig,
    tasks: Tasks,
    nixl: OnceCell<NixlTransfer>,
    peers: Mutex<HashMap<PeerKey, Peer>>,
    http: EngineHttp,
}

impl VllmPrefills {
    /// Reads `engine`'s KV with a NIXL agent on `transfer`'s address (once started), at most
    /// `inbox.max_region_bytes` per request, its tasks on `tasks`.
    pub(crate) fn new(
        engine: Arc<dyn Engine>,
        transfer: &TransferKind,
        inbox: InboxConfig,
        tasks: &Tasks,
    ) -> Self {
        VllmPrefills {
            engine,
            bind_ip: transfer.bind_ip(),
            inbox,
            tasks: tasks.clone(),
            nixl: OnceCell::new(),
            peers: Mutex::default(),
            http: engine_http::client(),
        }
    }

    async fn nixl(&self) -> Result<&NixlTransfer, TransferError> {
        self.nixl
            .get_or_try_init(|| async {
                let control = tokio::net::TcpListener::bind((self.bind_ip, 0))
                    .await
                    .map_err(|e| TransferError::Failed(format!("nixl control listener: {e}")))?;
                // This agent only reads: nothing is ever written into its inbox.
                let inbox = Arc::new(Inbox::new(self.inbox.clone()));
                let n =
                    NixlTransfer::serve(control, None, inbox, NixlConfig::default(), &self.tasks)?;
                tracing::info!(agent = n.agent_name(), "vLLM decode side started");
                Ok(n)
            })
            .await
    }

    /// Runs one attempt with `room` on the vLLM prefill server `target`.
    pub(crate) async fn attempt(
        &self,
        target: &VllmTarget,
        room: Room,
        tokens: &[u32],
        sampling: &handoff_engine::Sampling,
        deadline: Instant,
        stages: &mut Stages,
    ) -> Result<Prefilled, FrontendError> {
        // The agent is ours: its failing to start is the decode's, not the server's.
        let nixl =
            self.nixl().await.map_err(|e| FrontendError::because("register", Cause::Decode, e))?;
        stages.timings.register_us = stages.mark();
        let (host, _) = split_host_port(&target.side_channel).ok_or_else(|| {
            FrontendError::at(
                "resolve-topology",
                format!("side channel {:?} is not HOST:PORT", target.side_channel),
            )
        })?;
        let request = format!("handoff-room-{room}");
        let headers = [("x-request-id", request.as_str())];
        let body = prefill_request(tokens);
        let answer = within(
            deadline,
            "prefill",
            post_json(&self.http, &target.url, "/v1/completions", &headers, &body),
        )
        .await?;
        let source = KvSource::from_answer(&answer, &request).map_err(|e| failure("prefill", e))?;
        // The prompt's last token is computed here, for its logits, as vLLM's decode does.
        let loaded = (source.tokens as usize).min(tokens.len().saturating_sub(1));
        let (kv, kv_bytes) = within(deadline, "verify", async {
            self.read(nixl, host, &source, loaded, deadline).await.map_err(|e| failure("verify", e))
        })
        .await?;
        stages.timings.verify_us = stages.mark();
        let prefix = (loaded > 0).then_some(kv);
        let done = self
            .engine
            .prefill(tokens, prefix, sampling)
            .await
            .map_err(|e| FrontendError::because("consume", Cause::Decode, e))?;
        let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        Ok(Prefilled {
            kv: done.kv,
            first_token: done.first_token,
            cached_tokens: cached.unwrap_or(0).min(tokens.len() as u64) as u32,
            kv_bytes,
        })
    }

    /// Reads the KV of the first `loaded` tokens of `source` from the prefill's side channel
    /// host `host`, every TP rank at once (each notified so it frees the blocks). If the read
    /// fails after the handshakes, each rank is still notified, so vLLM frees the blocks now
    /// rather than when its lease runs out.
    async fn read(
        &self,
        nixl: &NixlTransfer,
        host: &str,
        source: &KvSource,
        loaded: usize,
        deadline: Instant,
    ) -> Result<(handoff_engine::Kv, u64), VllmError> {
        let timeout = deadline.saturating_duration_since(Instant::now());
        let ranks =
            try_join_all((0..source.tp_size).map(|r| self.peer(nixl, host, source, r, timeout)))
                .await?;
        let read = self.read_ranks(nixl, &ranks, source, loaded, timeout).await;
        if let Err(e) = &read {
            let done = format!("{}:1", source.request_id);
            for p in &ranks {
                if let Err(n) = nixl.notify_peer(&p.agent, done.as_bytes()) {
                    tracing::debug!(agent = %p.agent, error = %n, "vLLM rank not notified");
                }
            }
            if matches!(e, VllmError::Transfer(_)) {
                // The prefill may have restarted: its ranks are asked again next time.
                self.forget(nixl, host, source.port);
            }
        }
        read
    }

    /// Reads `source`'s blocks of the first `loaded` tokens from each of `ranks` and turns
    /// them into the engine's KV; the bytes read with it.
    async fn read_ranks(
        &self,
        nixl: &NixlTransfer,
        ranks: &[Peer],
        source: &KvSource,
        loaded: usize,
        timeout: Duration,
    ) -> Result<(handoff_engine::Kv, u64), VllmError> {
        let shape = self.engine.info().shape;
        for p in ranks {
            layout::check(&p.handshake.metadata, shape, ranks.len())?;
        }
        let Some(first) = ranks.first() else {
            return Err(VllmError::Invalid("no prefill rank to read from".into()));
        };
        let block_size = first.handshake.metadata.block_size as usize;
        let blocks = loaded.div_ceil(block_size);
        let ids = source.block_ids.get(..blocks).ok_or_else(|| {
            VllmError::Malformed(format!(
                "{} blocks offered for {loaded} tokens of {block_size} per block",
                source.block_ids.len()
            ))
        })?;
        let max = self.inbox.max_region_bytes as usize;
        let reads = try_join_all(
            ranks.iter().map(|p| read_blocks(nixl, p, &source.request_id, ids, 1, max, timeout)),
        )
        .await?;
        let pairs: Vec<_> = ranks.iter().map(|p| &p.handshake.metadata).zip(&reads).collect();
        let kv = layout::kv_from_ranks(shape, loaded, &pairs)?;
        Ok((kv, reads.iter().map(|r| r.bytes.len() as u64).sum()))
    }

    /// TP rank `rank` of `source`'s prefill, handshaken once per prefill engine.
    async fn peer(
        &self,
        nixl: &NixlTransfer,
        host: &str,
        source: &KvSource,
        rank: u32,
        timeout: Duration,
    ) -> Result<Peer, VllmError> {
        let key = (host.to_owned(), source.port, rank);
        if let Some(p) = self.peers().get(&key)
            && p.handshake.metadata.engine_id == source.engine_id
        {
            return Ok(p.clone());
        }
        let p = handoff_vllm::connect(nixl, host, source.port, 0, rank, timeout).await?;
        if p.handshake.metadata.engine_id != source.engine_id {
            return Err(VllmError::Malformed(format!(
                "side channel {host}:{} rank {rank} is engine {:?}, the answer named {:?}",
                source.port, p.handshake.metadata.engine_id, source.engine_id
            )));
        }
        let mut peers = self.peers();
        if peers.len() >= MAX_PEERS {
            peers.clear();
        }
        peers.insert(key, p.clone());
        Ok(p)
    }

    fn peers(&self) -> std::sync::MutexGuard<'_, HashMap<PeerKey, Peer>> {
        self.peers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets the ranks behind side channel `host:port` (NIXL's copy of their metadata too).
    fn forget(&self, nixl: &NixlTransfer, host: &str, port: u16) {
        let mut peers = self.peers();
        peers.retain(|(h, p, _), peer| {
            let keep = h != host || *p != port;
            if !keep {
                nixl.forget_peer(&peer.agent);
            }
            keep
        });
    }
}

/// A vLLM failure as the attempt's, at `stage` unless the error says where it belongs.
fn failure(stage: &'static str, e: VllmError) -> FrontendError {
    match e {
        VllmError::Transfer(t) => FrontendError::transfer(stage, t),
        VllmError::SideChannel { .. } => FrontendError::at("connect", e),
        VllmError::Unsupported(_) => FrontendError::at("resolve-topology", e),
        VllmError::Malformed(_) | VllmError::Invalid(_) => FrontendError::at(stage, e),
    }
}
