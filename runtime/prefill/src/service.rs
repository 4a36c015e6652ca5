//! The `handoff.v1.Prefill` gRPC service.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::try_join_all;
use handoff_bootstrap::Directory;
use handoff_bootstrap::mapping::Parallel;
use handoff_core::{InstanceId, Room, block_hashes};
use handoff_discovery::{Heartbeat, Publisher, Snapshots};
use handoff_engine::{Engine, Sampling};
use handoff_proto::auth::Bearer;
use handoff_proto::trace::TraceContext;
use handoff_proto::v1::prefill_server::{Prefill as PrefillRpc, PrefillServer};
use handoff_proto::v1::{
    DrainRequest, DrainResponse, PrefillRequest, PrefillResponse, SamplingParams,
};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};
use tracing::{Instrument, debug, info, warn};

use crate::cost::{SendCost, TokenCost};
use crate::guards::{Queued, RoomClosing, Running, Unanswered, WorkAhead};
use crate::rank::{Destination, Rank, SendMeta};
use crate::{PrefillError, PrefixCache};

mod caches;

/// How long past a request's deadline its KV may still be sent: the frontend's own timers end
/// the attempt up to half a second after the deadline it gives, and cancel the call, which
/// is how a request ends while the decode is reachable. This bound is for a decode that is
/// not (its host gone, or cut off): its requests' KV is let go here then.
const SEND_GRACE: Duration = Duration::from_secs(2);

/// One dp rank's engine slot, queue and prefix cache.
#[derive(Debug)]
pub(crate) struct DpState {
    pub(crate) cache: Mutex<PrefixCache>,
    /// Held from a change of `cache` until its events are numbered: two stores' events go
    /// out in the order of their changes (released between, a store evicting a block
    /// another then stored again could be numbered after it, and the schedulers' index
    /// would lose the block the cache holds). Not the cache's lock: a snapshot numbers
    /// first, then reads the caches.
    publishing: Mutex<()>,
    slot: Semaphore,
    queued: AtomicUsize,
    /// The work waiting for or in compute here, as heartbeats say it.
    ahead: WorkAhead,
    /// cp-0 ranks of this dp group: the ones that send.
    pub(crate) senders: Vec<Rank>,
}

impl DpState {
    pub(crate) fn new(cache: PrefixCache, senders: Vec<Rank>) -> Self {
        DpState {
            cache: Mutex::new(cache),
            publishing: Mutex::new(()),
            slot: Semaphore::new(1),
            queued: AtomicUsize::new(0),
            ahead: WorkAhead::default(),
            senders,
        }
    }
}

/// The Prefill service of one instance.
#[derive(Clone)]
pub struct PrefillService {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) id: InstanceId,
    pub(crate) engine: Arc<dyn Engine>,
    pub(crate) par: Parallel,
    pub(crate) dps: Vec<DpState>,
    pub(crate) directory: Arc<Directory>,
    /// KV events leave through it, never waiting on the bus.
    pub(crate) publisher: Publisher,
    /// Last KV event number given out.
    pub(crate) seq: Mutex<u64>,
    /// This process's numbering of KV events (`KvEvent::incarnation`): random, never 0.
    pub(crate) incarnation: u64,
    /// Measured prefill cost.
    pub(crate) cost: Mutex<TokenCost>,
    /// Measured time the KV takes after the compute, per prompt token.
    pub(crate) send_cost: Mutex<SendCost>,
    /// Recent snapshots, served in pages.
    pub(crate) snapshots: Snapshots,
    pub(crate) max_queue: usize,
    /// The cluster's token, required on every gRPC call when set.
    pub(crate) token: Option<String>,
    pub(crate) handshake_timeout: Duration,
    pub(crate) running: AtomicUsize,
    /// Set by a drain: new requests are refused and heartbeats stop.
    pub(crate) draining: std::sync::atomic::AtomicBool,
    pub(crate) queued_tokens: std::sync::atomic::AtomicU64,
    pub(crate) metrics: crate::metrics::PrefillMetrics,
    /// Where the instance is registered (a drain deregisters it).
    pub(crate) registry: Arc<dyn handoff_discovery::Registry>,
    /// The instance's tasks (prompts are cached on them, off the requests' path).
    pub(crate) tasks: handoff_core::Tasks,
    /// Prompts being cached at once (at most [`MAX_STORES`]: each holds its whole KV).
    pub(crate) storing: Arc<Semaphore>,
}

/// Prompts cached at once; past that a prompt goes uncached rather than queue its KV.
pub(crate) const MAX_STORES: usize = 4;

/// The fewest bytes of KV a streamed part carries, but for the last two and one cut short
/// by the compute failing: layers are gathered until they hold this much (whole layers,
/// before each decode rank takes its shard of them), and the last layer goes alone while
/// the sender keeps up (see `handoff_engine::layer_channel`). SmolLM2's 256-token prompt
/// (30 layers of 393 KB) then goes in 11 parts rather than 30, one of 1024 tokens still
/// layer by layer.
const PART_BYTES: usize = 1 << 20;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sampling settings from the wire.
pub fn sampling_from_wire(s: Option<&SamplingParams>) -> Sampling {
    s.map(|s| Sampling {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        seed: s.seed.unwrap_or_default(),
    })
    .unwrap_or_default()
}

impl PrefillService {
    pub(crate) fn new(inner: Inner) -> Self {
        PrefillService { inner: Arc::new(inner) }
    }

    /// As a tonic service (with the cluster's token, every call must carry it).
    pub fn into_server(self) -> InterceptedService<PrefillServer<Self>, Bearer> {
        let bearer = Bearer::new(self.inner.token.as_deref());
        InterceptedService::new(
            PrefillServer::new(self).max_decoding_message_size(64 << 20),
            bearer,
        )
    }

    /// The current load, for heartbeats.
    pub fn heartbeat(&self) -> Heartbeat {
        let me = &self.inner;
        Heartbeat {
            instance: me.id.clone(),
            queued_tokens: me.queued_tokens.load(Ordering::Relaxed),
            running: me.running.load(Ordering::Relaxed) as u32,
            kv_bytes: me.dps.iter().map(|d| lock(&d.cache).used_bytes() as u64).sum(),
            prefill_ns_per_token: (lock(&me.cost).per_token_us(me.engine.compute_shared_by()) * 1e3)
                as u64,
            dp_queued_tokens: me.dps.iter().map(|d| d.ahead.tokens()).collect(),
            send_ns_per_token: (lock(&me.send_cost).per_token_us_at(std::time::Instant::now())
                * 1e3) as u64,
        }
    }

    /// A drain has begun: new requests are refused with `UNAVAILABLE` and no heartbeat is
    /// sent, so a scheduler that cannot see the deregistration (etcd away) still lets the
    /// instance go once its heartbeats stop.
    pub fn draining(&self) -> bool {
        self.inner.draining.load(Ordering::Relaxed)
    }

    /// Requests being served.
    pub fn running(&self) -> usize {
        self.inner.running.load(Ordering::Relaxed)
    }

    /// Nothing running and nothing being stored in the prefix caches (see
    /// [`PrefillInstance::idle`](crate::PrefillInstance::idle)).
    pub fn idle(&self) -> bool {
        // Acquire, then the permits: a request's store takes its permit before the request
        // stops counting as running (`Running`'s release).
        let running = self.inner.running.load(Ordering::Acquire);
        let free = self.inner.storing.available_permits();
        debug_assert!(free <= MAX_STORES, "more store permits than MAX_STORES");
        running == 0 && free >= MAX_STORES
    }

    /// Records a prefill's measured cost.
    pub(crate) fn measured(&self, tokens: usize, took: Duration) {
        lock(&self.inner.cost).add(tokens, took);
    }

    /// Records the warm-up's cost, measured with the engine to itself.
    pub(crate) fn measured_solo(&self, tokens: usize, took: Duration) {
        lock(&self.inner.cost).add_solo(tokens, took);
    }

    async fn run(&self, req: PrefillRequest) -> Result<PrefillResponse, PrefillError> {
        if self.draining() {
            self.inner.metrics.ended(Err(&PrefillError::Draining));
            return Err(PrefillError::Draining);
        }
        let _running = Running::new(&self.inner, req.token_ids.len() as u64);
        let mut unanswered = Unanswered(Some(&self.inner.metrics));
        let served = self.serve(req).await;
        unanswered.0 = None;
        self.inner.metrics.ended(served.as_ref().map(|_| ()));
        if let Err(e) = &served {
            e.log();
        }
        served
    }

    /// A graceful drain: out of routing first (new requests refused, heartbeats stopped,
    /// deregistered, not ready), then waits until the requests in flight have finished (at
    /// most `grace`). Returns how many are left. Discovery out of reach does not cut the
    /// drain short: the registration's lease, no longer kept alive, takes it out of routing
    /// within its TTL, a scheduler that cannot see etcd either drops it once its heartbeats
    /// stop, a request routed to it meanwhile is refused (the frontend tries another), and
    /// the requests in flight still finish.
    pub async fn drain(&self, grace: Duration) -> Result<usize, PrefillError> {
        self.inner.draining.store(true, Ordering::Relaxed);
        self.inner.metrics.set_registered(false);
        if let Err(e) = self.inner.registry.deregister(&self.inner.id).await {
            warn!(instance = %self.inner.id, error = %e, "could not deregister (its lease will lapse); draining all the same");
        }
        let deadline = Instant::now().checked_add(grace);
        while self.running() > 0 && deadline.is_none_or(|d| Instant::now() < d) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let left = self.running();
        info!(instance = %self.inner.id, left, "drained");
        Ok(left)
    }

    /// Its counters and histograms.
    pub fn metrics(&self) -> &crate::metrics::PrefillMetrics {
        &self.inner.metrics
    }

    /// Handshakes that came over the ranks' transfer connections and no request has taken
    /// yet, counted by room and rank.
    pub fn pending_handshakes(&self) -> usize {
        let ranks = self.inner.dps.iter().flat_map(|d| &d.senders);
        ranks.map(|r| r.agent.inbox().pending_rooms()).sum()
    }

    /// Requests waiting for each dp rank's engine.
    pub fn queued(&self) -> Vec<usize> {
        self.inner.dps.iter().map(|d| d.queued.load(Ordering::Relaxed)).collect()
    }

    async fn serve(&self, req: PrefillRequest) -> Result<PrefillResponse, PrefillError> {
        let me = &self.inner;
        let room =
            Room::try_from(req.bootstrap_room).map_err(|e| PrefillError::Invalid(e.to_string()))?;
        let dp = me.dps.get(req.dp_rank as usize).ok_or_else(|| {
            PrefillError::Mismatch(format!(
                "dp_rank {} outside dp size {}",
                req.dp_rank,
                me.dps.len()
            ))
        })?;
        let _closing = RoomClosing { ranks: &dp.senders, room };
        let info = me.engine.info();
        // First: another model's limits below would answer as the client's error.
        if req.model_fingerprint != 0
            && info.fingerprint != 0
            && req.model_fingerprint != info.fingerprint
        {
            return Err(PrefillError::Mismatch(format!(
                "model weights {:016x} asked, this instance serves {:016x}",
                req.model_fingerprint, info.fingerprint
            )));
        }
        let tokens = req.token_ids;
        if tokens.is_empty() {
            return Err(PrefillError::Invalid("token_ids is empty".into()));
        }
        // Past this instance's context: the request is too long here (a 400 for the client),
        // not a fault of the instance.
        if tokens.len() >= info.max_context {
            return Err(PrefillError::Invalid(format!(
                "{} tokens exceed the context of {}",
                tokens.len(),
                info.max_context
            )));
        }
        if let Some(t) = tokens.iter().find(|&&t| t >= info.vocab) {
            return Err(PrefillError::Mismatch(format!(
                "token id {t} outside the vocabulary of {}",
                info.vocab
            )));
        }
        let in_call = !req.handshakes.is_empty();
        let handshakes =
            crate::handshakes::deal(req.handshakes, &dp.senders, me.par, room, tokens.len())?;
        me.metrics.handshakes(in_call);
        let budget = match req.deadline_ms {
            0 => Duration::from_secs(30),
            ms => Duration::from_millis(u64::from(ms)),
        };
        let deadline = Instant::now() + budget;
        me.directory.register_dp_rank(room.get(), req.dp_rank);

        let queued = Queued(&dp.queued);
        if dp.queued.fetch_add(1, Ordering::AcqRel) >= me.max_queue {
            return Err(PrefillError::Overloaded(format!(
                "dp rank {} has {} queued",
                req.dp_rank, me.max_queue
            )));
        }
        let hashes = block_hashes(&tokens, info.page_size);
        // What it leaves to compute is work ahead of the next ones.
        let ahead = {
            let cache = lock(&dp.cache);
            dp.ahead.enter(&hashes, tokens.len(), info.page_size, |h| cache.holds(h))
        };
        // Dropped while waiting here (the decode went away): the place is given up and
        // nothing is computed.
        let waited = Instant::now();
        let permit = tokio::time::timeout_at(deadline, dp.slot.acquire()).await;
        drop(queued);
        me.metrics.stage("queue", waited.elapsed());
        let permit = permit
            // Alive, but too busy to start it in time: an overload, not a silent instance
            // (the frontend refuses with 429 once every instance says so).
            .map_err(|_| PrefillError::QueuedPastDeadline(waited.elapsed()))?
            .map_err(|_| PrefillError::Startup("engine slot closed".into()))?;
        let prefix = lock(&dp.cache).lookup(&tokens, &hashes);
        let cached = prefix.as_ref().map_or(0, |p| p.tokens());
        let sampling = sampling_from_wire(req.sampling.as_ref());
        let (sink, mut parts) = handoff_engine::layer_channel(info.shape.layers, PART_BYTES);
        let compute = async {
            let started = Instant::now();
            let out = me.engine.prefill_streamed(&tokens, prefix, &sampling, sink).await;
            drop((permit, ahead));
            let out = out?;
            self.measured(tokens.len() - cached, started.elapsed());
            me.metrics.stage("compute", started.elapsed());
            me.metrics.tokens(tokens.len() - cached, cached);
            Ok::<_, PrefillError>((out, Instant::now()))
        };
        // The decode's handshakes came in this call, or it sends them alongside it: they are
        // taken while the engine computes, and the layers travel to every decode rank a part
        // at a time as they are done.
        let hs_deadline = deadline.min(Instant::now() + me.handshake_timeout);
        let stream = async {
            let opens = dp.senders.iter().zip(handshakes).map(|(r, given)| {
                r.destinations(me.par, room, info.shape, tokens.len(), given, hs_deadline)
            });
            let opened = try_join_all(opens).await?;
            let ranks = opened.iter().filter(|d| !d.is_empty()).count();
            let mut dests: Vec<Destination> = opened.into_iter().flatten().collect();
            // A part is due at PART_BYTES, at the last layer but one and at the last (see
            // `layer_channel`), and takes every layer ready by the time it can go (more when
            // the engine computes faster than the KV travels).
            let posting = async {
                while let Some(part) = parts.next_part().await {
                    try_join_all(dests.iter_mut().map(|d| d.post_layers(&part))).await?;
                }
                Ok::<_, PrefillError>(())
            };
            tokio::time::timeout_at(deadline + SEND_GRACE, posting)
                .await
                .map_err(|_| PrefillError::SentPastDeadline)??;
            Ok::<_, PrefillError>((ranks, dests))
        };
        // A compute that fails ends the request at once. A stream that fails still waits for
        // the engine: its slot stays taken while it computes.
        tokio::pin!(compute, stream);
        let ((out, computed), (ranks, dests)) = tokio::select! {
            c = &mut compute => { let c = c?; (c, stream.await?) }
            s = &mut stream => match s {
                Ok(s) => (compute.await?, s),
                Err(e) => { let _ = compute.await; return Err(e) }
            },
        };
        // The notices: every byte already sent, each decode rank verifies its whole region.
        let meta = SendMeta { first_token: out.first_token, cached_tokens: cached as u32 };
        let finishing = try_join_all(dests.into_iter().map(|d| d.finish(room, meta)));
        tokio::time::timeout_at(deadline + SEND_GRACE, finishing)
            .await
            .map_err(|_| PrefillError::SentPastDeadline)??;
        // The link's share: what the KV still took once the compute was done, per token.
        me.metrics.stage("send", computed.elapsed());
        lock(&me.send_cost).add_at(tokens.len(), computed.elapsed(), std::time::Instant::now());
        me.metrics.sent(out.kv.byte_len() as u64);
        // The cache keeps each page's tokens to compare on a hit (a hash only names a page).
        self.cache_later(req.dp_rank, tokens.clone(), hashes, out.kv);
        debug!(%room, dp_rank = req.dp_rank, cached, tokens = tokens.len(), "prefill sent");
        Ok(PrefillResponse {
            first_token: out.first_token,
            cached_tokens: cached as u32,
            computed_tokens: (tokens.len() - cached) as u32,
            ranks_sent: ranks as u32,
            takes_handshakes: me
                .dps
                .iter()
                .flat_map(|d| &d.senders)
                .all(|r| r.agent.handshake_in_call()),
        })
    }
}

#[tonic::async_trait]
impl PrefillRpc for PrefillService {
    async fn prefill(
        &self,
        req: Request<PrefillRequest>,
    ) -> Result<Response<PrefillResponse>, Status> {
        let trace = TraceContext::from_metadata(req.metadata());
        let r = req.into_inner();
        let span = tracing::info_span!(
            "prefill",
            trace_id = tracing::field::Empty,
            room = r.bootstrap_room,
            dp_rank = r.dp_rank
        );
        trace.bind(&span);
        Ok(Response::new(self.run(r).instrument(span).await?))
    }

    async fn drain(&self, req: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        let grace = Duration::from_millis(u64::from(req.into_inner().grace_ms.min(3_600_000)));
        let left = PrefillService::drain(self, grace).await?;
        Ok(Response::new(DrainResponse { left: left.min(u32::MAX as usize) as u32 }))
    }
}
