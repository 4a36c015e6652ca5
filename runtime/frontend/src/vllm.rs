//! Attempts on vLLM prefill servers (protocol `vllm`): the frontend is vLLM's decode for the
//! request, in its NIXL connector's pull mode (vLLM's default). As vLLM's disaggregated proxy
//! does, it POSTs the prompt to the server's `/v1/completions` with `kv_transfer_params`
//! asking it to keep the KV; the answer says where the blocks wait. The frontend then asks
//! each of the prefill's TP ranks for its NIXL metadata on the side channel (once per rank
//! and prefill engine), READs the request's blocks with NIXL, which notifies each rank so it
//! frees them, turns them into the engine's KV, and computes the prompt's last token itself
//! for the first token, as vLLM's decode does.
//!
//! Binding: the room goes as `X-Request-Id`, and an answer whose request id is not vLLM's
//! for it (`cmpl-<id>-...`) is refused; the side channel asked is on the host the instance
//! registered. The NIXL address comes from the metadata the prefill sends, and vLLM's wire
//! carries no checksum: the bytes are the prefill's word (`docs/security.md`).
//!
//! The NIXL agent (a reader: no listener, nothing registered but each read's own buffer)
//! starts with the first such attempt: a frontend routed only to other prefills runs none.
//! Once the handshakes are done, every rank is notified whatever happens next (the read's own
//! notification, or a guard's when the read fails or the attempt is dropped), so vLLM frees
//! the blocks at once rather than when its lease runs out.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::{join_all, try_join_all};
use handoff_core::Room;
use handoff_engine::{Engine, Kv};
use handoff_transfer::InboxConfig;
use handoff_transfer::nixl::NixlReader;
use handoff_vllm::{Blocks, KvSource, Peer, VllmError, layout, prefill_request, read_blocks};
use tokio::sync::{OnceCell, Semaphore};
use tokio::time::Instant;

use crate::attempt::{Prefilled, Stages, within};
use crate::engine_http::{self, EngineHttp, post_json};
use crate::sglang::split_host_port;
use crate::{Cause, FrontendError};

mod peers;

use peers::{Notify, Peers};

/// Kept back from the attempt's deadline for the reads' own timeouts, so that a read that
/// times out still notifies the prefill before the attempt is given up.
const NOTIFY_MARGIN: Duration = Duration::from_millis(200);

/// How often the reader's progress thread wakes at least (it waits on UCX's event fd).
const PROGRESS: Duration = Duration::from_millis(10);

/// Where a vLLM attempt goes.
#[derive(Debug, Clone)]
pub struct VllmTarget {
    /// The server's HTTP address (`host:port`).
    pub url: String,
    /// Its NIXL side channel as registered (`host:port`): the handshakes go to this host.
    pub side_channel: String,
}

/// The frontend's side of vLLM's PD protocol (see the module docs).
pub(crate) struct VllmPrefills {
    engine: Arc<dyn Engine>,
    reader: OnceCell<NixlReader>,
    peers: Peers,
    http: EngineHttp,
    /// Most KV bytes one request reads, all ranks together.
    max_request_bytes: u64,
    /// KV bytes all requests read at once, in KiB.
    budget: Arc<Semaphore>,
}

impl VllmPrefills {
    /// Reads `engine`'s KV within `inbox`'s bounds: `max_region_bytes` per request,
    /// `max_total_bytes` in all.
    pub(crate) fn new(engine: Arc<dyn Engine>, inbox: &InboxConfig) -> Self {
        let kib = (inbox.max_total_bytes >> 10).min(Semaphore::MAX_PERMITS as u64) as usize;
        VllmPrefills {
            engine,
            reader: OnceCell::new(),
            peers: Peers::default(),
            http: engine_http::client(),
            max_request_bytes: inbox.max_region_bytes,
            budget: Arc::new(Semaphore::new(kib)),
        }
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
        let reader = self
            .reader
            .get_or_try_init(|| async { NixlReader::start(PROGRESS) })
            .await
            .map_err(|e| FrontendError::because("register", Cause::Decode, e))?;
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
        let post = post_json(&self.http, &target.url, "/v1/completions", &headers, &body);
        let answer = within(deadline, "prefill", post).await?;
        let source = KvSource::from_answer(&answer, &request).map_err(|e| failure("prefill", e))?;
        // The prompt's last token is computed here, for its logits, as vLLM's decode does.
        let loaded = (source.tokens as usize).min(tokens.len().saturating_sub(1));
        // Bounded by the reads' own timeouts, which end before the deadline.
        let by = deadline.checked_sub(NOTIFY_MARGIN).unwrap_or(deadline).max(Instant::now());
        let (kv, kv_bytes) = self.read(reader, host, &source, loaded, by).await?;
        stages.timings.verify_us = stages.mark();
        let prefix = (loaded > 0).then_some(kv);
        let compute = async {
            self.engine
                .prefill(tokens, prefix, sampling)
                .await
                .map_err(|e| FrontendError::because("consume", Cause::Decode, e))
        };
        let done = within(deadline, "consume", compute).await?;
        let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        Ok(Prefilled {
            kv: done.kv,
            first_token: done.first_token,
            cached_tokens: cached.unwrap_or(0).min(tokens.len() as u64) as u32,
            kv_bytes,
        })
    }

    /// Reads the KV of the first `loaded` tokens of `source` from the prefill's side channel
    /// host `host`, every TP rank at once, by `by`. Once a rank's handshake is done it is
    /// notified whatever happens (see the module docs); a failure forgets the ranks.
    async fn read(
        &self,
        reader: &NixlReader,
        host: &str,
        source: &KvSource,
        loaded: usize,
        by: Instant,
    ) -> Result<(Kv, u64), FrontendError> {
        let timeout = by.saturating_duration_since(Instant::now());
        let shook =
            join_all((0..source.tp_size).map(|r| self.peers.get(reader, host, source, r, timeout)))
                .await;
        let (ranks, failed): (Vec<_>, Vec<_>) = shook.into_iter().partition(Result::is_ok);
        let ranks: Vec<Arc<Peer>> = ranks.into_iter().flatten().collect();
        let notify = Notify::new(reader, &ranks, &source.request_id);
        let read = match failed.into_iter().find_map(Result::err) {
            Some(e) => Err(failure("connect", e)),
            None => {
                let reading = self.read_ranks(reader, &ranks, source, loaded, by);
                let mut every = tokio::time::interval(HEARTBEAT_EVERY);
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let ticks = tokio_stream::wrappers::IntervalStream::new(every);
                leased(reading, ticks, || notify.heartbeat()).await
            }
        };
        let timed_out = read.as_ref().is_err_and(|e| out_of_time_given_enough(timeout, e));
        let again = self.peers.timed_out_again(host, source.port, timed_out);
        match read {
            Ok(kv) => {
                notify.done();
                Ok(kv)
            }
            Err(e) => {
                // Told before forgotten: NIXL cannot notify an agent it no longer knows.
                drop(notify);
                if peer_suspect(&e) || again {
                    self.peers.forget(reader, host, source.port);
                }
                Err(e)
            }
        }
    }

    /// Reads `source`'s blocks of the first `loaded` tokens from each of `ranks`, by `by`,
    /// within the byte bounds, and turns them into the engine's KV; the bytes read with it.
    async fn read_ranks(
        &self,
        reader: &NixlReader,
        ranks: &[Arc<Peer>],
        source: &KvSource,
        loaded: usize,
        by: Instant,
    ) -> Result<(Kv, u64), FrontendError> {
        let shape = self.engine.info().shape;
        for p in ranks {
            layout::check(&p.handshake.metadata, shape, ranks.len())
                .map_err(|e| failure("resolve-topology", e))?;
        }
        let Some(first) = ranks.first() else {
            return Err(FrontendError::at("resolve-topology", "no prefill rank to read from"));
        };
        let block_size = first.handshake.metadata.block_size as usize;
        let blocks = loaded.div_ceil(block_size);
        let ids = source.block_ids.get(..blocks).ok_or_else(|| {
            failure(
                "verify",
                VllmError::Malformed(format!(
                    "{} blocks offered for {loaded} tokens of {block_size} per block",
                    source.block_ids.len()
                )),
            )
        })?;
        // Every rank's blocks are a 1/N share of the heads: the whole request is this much.
        let total =
            (blocks * shape.layers * 2 * shape.kv_heads * block_size * shape.head_bytes) as u64;
        if total > self.max_request_bytes {
            let e = format!("{total} bytes of KV (at most {})", self.max_request_bytes);
            return Err(failure("register", VllmError::TooLarge(e)));
        }
        let kib = u32::try_from(total.div_ceil(1024)).unwrap_or(u32::MAX);
        let _budget =
            self.budget.clone().try_acquire_many_owned(kib).map_err(|_| budget_in_use())?;
        let timeout = by.saturating_duration_since(Instant::now());
        let per_rank = (total as usize).div_ceil(ranks.len());
        let reads: Vec<Blocks> = try_join_all(
            ranks
                .iter()
                .map(|p| read_blocks(reader, p, &source.request_id, ids, 1, per_rank, timeout)),
        )
        .await
        .map_err(|e| failure("verify", e))?;
        let kv_bytes = reads.iter().map(|r| r.bytes.len() as u64).sum();
        let ranks = ranks.to_vec();
        // A copy per head and token: off the async workers.
        let kv = tokio::task::spawn_blocking(move || {
            let pairs: Vec<_> = ranks.iter().map(|p| &p.handshake.metadata).zip(&reads).collect();
            layout::kv_from_ranks(shape, loaded, &pairs)
        })
        .await
        .map_err(|e| FrontendError::because("verify", Cause::Decode, e))?
        .map_err(|e| failure("verify", e))?;
        Ok((kv, kv_bytes))
    }
}

/// How often a read still running tells the ranks its blocks are still wanted: vLLM's own
/// decode's pace (its `kv_lease_duration`, 30 s by default, over 6).
const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);

/// `read`'s outcome, calling `beat` at each of `ticks` while it runs.
async fn leased<T>(
    read: impl Future<Output = T>,
    ticks: impl futures::Stream,
    beat: impl Fn(),
) -> T {
    let (mut read, mut ticks) = (std::pin::pin!(read), std::pin::pin!(ticks));
    loop {
        tokio::select! {
            biased;
            out = &mut read => return out,
            Some(_) = ticks.next() => beat(),
        }
    }
}

/// Whether a failed read puts the prefill's ranks in doubt (it may have restarted or changed
/// its cache), so they are forgotten and asked again. A failure of this request alone (the
/// decode's KV budget in use, a request too large, time run out) does not: forgetting
/// disconnects the agent every other request reading from that prefill is using, failing
/// their reads too (but see [`Peers::timed_out_again`]).
fn peer_suspect(e: &FrontendError) -> bool {
    e.cause() == Some(Cause::Instance)
}

/// A read given this long that did not finish says something of the prefill, not only of
/// the request: no working link takes that long for a prompt's KV.
const READ_GIVEN_ENOUGH: Duration = Duration::from_secs(10);

/// Whether a read `given` that long failed by running out of time, and was given enough
/// ([`READ_GIVEN_ENOUGH`]) for that to count towards forgetting the prefill: a request with
/// a short deadline of its own is no evidence.
fn out_of_time_given_enough(given: Duration, e: &FrontendError) -> bool {
    given >= READ_GIVEN_ENOUGH && e.cause() == Some(Cause::Deadline)
}

/// The decode's KV budget for reads has no room for a request's KV now.
fn budget_in_use() -> FrontendError {
    FrontendError::because(
        "register",
        Cause::Overloaded,
        "the decode's KV budget for vLLM reads is in use (inbox max_total_bytes)",
    )
}

/// A vLLM failure as the attempt's, at `stage` unless the error says where it belongs.
fn failure(stage: &'static str, e: VllmError) -> FrontendError {
    match e {
        VllmError::Transfer(t) => FrontendError::transfer(stage, t),
        VllmError::SideChannel { .. } => FrontendError::at("connect", e),
        VllmError::Unsupported(_) => FrontendError::at("resolve-topology", e),
        // The request's KV is more than this decode takes: the request's, not the prefill's.
        VllmError::TooLarge(_) => FrontendError::because(stage, Cause::Invalid, e),
        VllmError::Malformed(_) | VllmError::Invalid(_) => FrontendError::at(stage, e),
    }
}

#[cfg(test)]
mod tests;
