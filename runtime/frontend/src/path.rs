//! [`Frontend`]: the request path around attempts: ask a scheduler replica (booking the
//! instance), mint a fresh room, run the attempt, report the booking's outcome, and on
//! failure before the first token retry on another instance. A request dropped midway (its
//! client left) reports its booking cancelled through [`Lease`]'s drop.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use handoff_bootstrap::{DirectoryCache, DirectoryClient};
use handoff_core::{Tasks, block_hashes};
use handoff_discovery::{Registry, Role, Update};
use handoff_engine::{Decoder, Engine};
use handoff_proto::grpc::cluster_channel;
use handoff_proto::v1::prefill_client::PrefillClient;
use handoff_proto::v1::{Attempt, Evidence, Outcome};
use handoff_transfer::Agent;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::{Instrument, debug, warn};

use crate::attempt::{AttemptCtx, PrefillPeer, Stages};
use crate::input::Plan;
use crate::lease::outcome_of;
use crate::metrics::Metrics;
use crate::reach::{Reach, unreachable};
use crate::schedulers::Selected;
use crate::traces::Recent;
use crate::{Cause, FrontendConfig, FrontendError, Schedulers};

/// A request whose KV is verified and loaded: ready to stream.
pub struct Ready {
    /// The decoder holding the request's KV.
    pub decoder: Box<dyn Decoder>,
    /// The first token (from prefill).
    pub first_token: u32,
    /// Prompt tokens served from the prefill's cache.
    pub cached_tokens: u32,
    /// The evidence chain so far.
    pub evidence: Evidence,
}

/// The decode frontend's request path (see the module docs).
pub struct Frontend {
    pub(crate) cfg: FrontendConfig,
    pub(crate) engine: Arc<dyn Engine>,
    agent: Agent,
    directory: DirectoryCache,
    schedulers: Arc<Schedulers>,
    prefills: Mutex<HashMap<String, PrefillPeer>>,
    /// The decode side of SGLang's PD protocol, for SGLang prefill servers.
    sglang: crate::sglang::SglangPrefills,
    /// The decode side of vLLM's PD protocol (NIXL pull), for vLLM prefill servers.
    vllm: crate::vllm::VllmPrefills,
    pub(crate) tasks: Tasks,
    pub(crate) limit: Arc<Semaphore>,
    /// The decode's slots, if it has a bound ([`crate::decoding`]).
    pub(crate) decoding: Option<Arc<crate::decoding::DecodeSlots>>,
    /// Long inputs tokenized at once, on blocking threads (see `input::checked`).
    pub(crate) tokenizing: Arc<Semaphore>,
    /// Bytes of long inputs waiting for a turn or tokenized, at most
    /// [`crate::input::TOKENIZE_HELD_BYTES`].
    pub(crate) tokenizing_bytes: Arc<Semaphore>,
    pub(crate) metrics: Arc<Metrics>,
    /// Prefill instances registered in discovery (while followed).
    prefills_known: std::sync::atomic::AtomicUsize,
    ops: std::sync::OnceLock<Arc<handoff_core::ops::Ops>>,
    pub(crate) recent: Recent,
    /// The prefills this frontend cannot reach, in its own view.
    reach: Reach,
    /// Set when the frontend drains: readiness fails, requests in flight finish.
    draining: tokio::sync::watch::Sender<bool>,
    /// Set once its public API serves (gRPC or HTTP): not ready before.
    serving: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frontend")
            .field("cfg", &self.cfg)
            .field("agent", &self.agent)
            .finish_non_exhaustive()
    }
}

const MAX_PREFILL_CLIENTS: usize = 4096;

mod first_token;
mod follow;
mod select;
mod target;

use target::{all_failed, handoff_prefill_sampling, room_for, summary};

impl Frontend {
    /// A frontend that asks the scheduler replicas at `scheduler_addrs` (host:port; more
    /// can come from [`Frontend::follow_schedulers`]); its transfer agent and reports run on
    /// `tasks`.
    pub async fn new(
        cfg: FrontendConfig,
        engine: Arc<dyn Engine>,
        scheduler_addrs: &[String],
        tasks: &Tasks,
    ) -> Result<Arc<Self>, FrontendError> {
        if cfg.decode_tp == 0 || cfg.max_attempts == 0 {
            return Err(FrontendError::Invalid(
                "decode_tp and max_attempts must be positive".into(),
            ));
        }
        let heads = engine.info().shape.kv_heads as u32;
        if !handoff_bootstrap::mapping::tp_compatible(heads as usize, cfg.decode_tp as usize) {
            return Err(FrontendError::Invalid(format!(
                "decode tp {} does not fit {heads} KV heads",
                cfg.decode_tp
            )));
        }
        // The handshake token is the cluster's: it also authenticates transfer connections.
        let inbox = handoff_transfer::InboxConfig {
            token: cfg.transfer_token.clone().or_else(|| cfg.inbox.token.clone()),
            ..cfg.inbox.clone()
        };
        let agent = cfg
            .transfer
            .start(inbox, tasks, None)
            .await
            .map_err(|e| FrontendError::Invalid(format!("transfer agent: {e}")))?;
        let schedulers = Arc::new(
            Schedulers::new(cfg.select_timeout, tasks)
                .with_token(cfg.transfer_token.clone())
                .with_tls(cfg.tls.clone()),
        );
        schedulers.reset(scheduler_addrs)?;
        let directory = DirectoryCache::new(DirectoryClient::with_tls(None, cfg.tls.as_ref()));
        let sglang = crate::sglang::SglangPrefills::new(
            engine.clone(),
            &cfg.transfer,
            // SGLang's Mooncake wire carries no token: its peers are the ranks it registered with.
            handoff_transfer::InboxConfig { token: None, ..cfg.inbox.clone() },
            tasks,
        );
        let vllm = crate::vllm::VllmPrefills::new(engine.clone(), &cfg.inbox);
        Ok(Arc::new(Frontend {
            limit: Arc::new(Semaphore::new(cfg.max_concurrent)),
            decoding: cfg.max_decoding.or_else(|| engine.decode_batch()).map(|n| {
                crate::decoding::DecodeSlots::with_kv_budget(n, cfg.inbox.max_total_bytes)
            }),
            tokenizing: Arc::new(Semaphore::new(
                std::thread::available_parallelism().map_or(2, |n| n.get()),
            )),
            tokenizing_bytes: Arc::new(Semaphore::new(crate::input::TOKENIZE_HELD_BYTES)),
            cfg,
            engine,
            agent,
            directory,
            schedulers,
            prefills: Mutex::default(),
            sglang,
            vllm,
            tasks: tasks.clone(),
            metrics: Arc::new(Metrics::new()),
            prefills_known: Default::default(),
            ops: Default::default(),
            recent: Recent::default(),
            reach: Reach::default(),
            draining: tokio::sync::watch::Sender::new(false),
            serving: Default::default(),
        }))
    }

    /// The decode's slots, if it has a bound ([`crate::decoding`]).
    pub fn decode_slots(&self) -> Option<&crate::decoding::DecodeSlots> {
        self.decoding.as_deref()
    }

    /// Follows the scheduler replicas in `registry` on the frontend's tasks: selections go
    /// to the replicas registered there (besides none given at start).
    pub async fn follow_schedulers(
        self: &Arc<Self>,
        registry: Arc<dyn Registry>,
    ) -> Result<(), FrontendError> {
        let mut updates = registry
            .watch(Role::Scheduler)
            .await
            .map_err(|e| FrontendError::Unavailable(e.to_string()))?;
        let (s, t) = (self.schedulers.clone(), self.tasks.clone());
        let mut addrs: HashMap<String, String> = HashMap::new();
        self.tasks.spawn(async move {
            loop {
                let u = tokio::select! {
                    _ = t.shutdown_requested() => break,
                    u = updates.next() => match u { Some(u) => u, None => break },
                };
                match u {
                    Update::Reset(all) => {
                        addrs = all.into_iter().map(|i| (i.id.to_string(), i.grpc_addr)).collect();
                    }
                    Update::Add(i) => {
                        addrs.insert(i.id.to_string(), i.grpc_addr);
                    }
                    Update::Remove(id) => {
                        addrs.remove(id.as_str());
                    }
                }
                // The addresses registered, however many ids name each: a replica restarted
                // at its address registers a new id before its old one's lease lapses.
                if let Err(e) = s.reset(&addrs.values().cloned().collect::<Vec<_>>()) {
                    warn!(error = %e, "scheduler registration ignored");
                }
            }
        });
        Ok(())
    }

    /// The scheduler replicas this frontend asks.
    pub fn schedulers(&self) -> &Schedulers {
        &self.schedulers
    }

    /// The model this frontend serves.
    pub fn model_name(&self) -> &str {
        &self.engine.info().name
    }

    /// The frontend's transfer agent.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// Its operations surface: metrics (gauges refreshed at each scrape) and readiness (a
    /// scheduler replica not suspect, and a prefill instance registered).
    pub fn ops(self: &Arc<Self>) -> Arc<handoff_core::ops::Ops> {
        self.ops.get_or_init(|| Arc::new(crate::metrics::ops(self))).clone()
    }

    /// Starts a drain: `/readyz` fails from now on (requests still served).
    pub fn start_draining(&self) {
        self.draining.send_replace(true);
    }

    /// How long decoding `max_tokens` (the first is the prefill's) is expected to take: its
    /// tokens at the larger of a step's time lately and a token's share of a decode slot's
    /// hold lately (see [`crate::decoding`]). The selection reserves it, the decode's
    /// admission and its slot's give-up weigh it.
    pub(crate) fn expected_decode(&self, max_tokens: u32) -> std::time::Duration {
        let tokens = max_tokens.saturating_sub(1);
        let held = self.decoding.as_ref().map(|s| s.decode_time(tokens)).unwrap_or_default();
        self.metrics.decode_time(tokens).max(held)
    }

    /// Marks the public API served: from now on the frontend may be ready (an operations
    /// listener is up before, while it waits for a scheduler and its registration).
    pub(crate) fn mark_serving(&self) {
        self.serving.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the public API serves ([`Frontend::mark_serving`]).
    pub(crate) fn is_serving(&self) -> bool {
        self.serving.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the frontend drains ([`Frontend::start_draining`]).
    pub fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Completes once the frontend drains.
    pub async fn drained(&self) {
        // The sender lives as long as the frontend.
        let _ = self.draining.subscribe().wait_for(|d| *d).await;
    }

    /// Requests being served (arrived and not yet streamed to their end).
    pub fn in_flight(&self) -> u64 {
        self.metrics.in_flight().max(0) as u64
    }

    /// Prefill instances registered in discovery, as followed.
    pub fn prefills_known(&self) -> usize {
        self.prefills_known.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn prefill_client(&self, addr: &str) -> Result<PrefillPeer, FrontendError> {
        let mut map = self.prefills.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        if map.len() >= MAX_PREFILL_CLIENTS {
            map.clear();
        }
        let channel =
            cluster_channel(addr, self.cfg.tls.as_ref(), std::time::Duration::from_secs(2))
                .map_err(|e| FrontendError::Invalid(e.to_string()))?;
        let c = PrefillPeer::new(PrefillClient::new(channel).max_decoding_message_size(64 << 20));
        map.insert(addr.to_owned(), c.clone());
        Ok(c)
    }

    /// Forgets what the prefill service at `addr` said it takes, if it was called.
    pub(crate) fn forget_prefill_features(&self, addr: &str) {
        let map = self.prefills.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(peer) = map.get(addr) {
            peer.forget();
        }
    }

    /// [`Frontend::prefill`]'s attempts; failed ones are pushed on `failed`.
    pub(crate) async fn attempts(
        &self,
        plan: &Plan,
        failed: &mut Vec<Attempt>,
    ) -> Result<Ready, FrontendError> {
        let info = self.engine.info();
        let hashes: Vec<u64> =
            block_hashes(&plan.tokens, info.page_size).into_iter().map(|h| h.0).collect();
        let ctx = AttemptCtx {
            tasks: &self.tasks,
            engine: &*self.engine,
            agent: &self.agent,
            directory: &self.directory,
            decode_tp: self.cfg.decode_tp as usize,
            transfer_token: self.cfg.transfer_token.clone(),
            trace: plan.trace,
        };
        let mut exclude: Vec<String> = Vec::new();
        let mut last: Option<FrontendError> = None;
        for _ in 0..self.cfg.max_attempts {
            if !failed.is_empty() {
                let wake = (Instant::now() + self.backoff(failed.len())).min(plan.deadline);
                tokio::time::sleep_until(wake).await;
            }
            // Stopping, another attempt would be cut the same way (booked, and its call
            // reset): the client is told so now.
            if self.tasks.is_shutting_down() {
                return Err(FrontendError::Unavailable("the frontend is stopping".into()));
            }
            if Instant::now() >= plan.deadline {
                return Err(FrontendError::Deadline(summary(failed)));
            }
            let asked = Instant::now();
            let (lease, Selected { selection: sel, .. }) =
                match self.select_reachable(plan, &hashes, &exclude, failed).await {
                    Ok(s) => s,
                    // Nothing else to retry on: the earlier attempt's failure is the answer.
                    Err(FrontendError::Unavailable(why)) if !failed.is_empty() => {
                        debug!(%why, "no other instance to retry on");
                        break;
                    }
                    Err(e) => return Err(e),
                };
            self.metrics.selected(asked.elapsed());
            let room = room_for(&sel);
            let mut stages = Stages::start();
            let wait = std::time::Duration::from_millis(u64::from(sel.expected_wait_ms))
                + std::time::Duration::from_millis(u64::from(sel.expected_prefill_ms));
            let deadline = plan.deadline.min(Instant::now() + wait + self.cfg.attempt_timeout);
            let span = tracing::info_span!(
                "attempt",
                %room,
                instance = %sel.instance_id,
                dp_rank = sel.dp_rank,
                protocol = %sel.protocol,
            );
            let result = self
                .attempt_on(&ctx, &sel, room, plan, deadline, &mut stages)
                .instrument(span)
                .await;
            let outcome = result.and_then(|p| {
                // The engine loads the KV after the first token (LoadOnFirstStep): what can be
                // checked before is checked here, where a failure is still retried.
                if p.kv.tokens() != plan.tokens.len() {
                    let why = format!(
                        "KV of {} tokens for a {}-token prompt",
                        p.kv.tokens(),
                        plan.tokens.len()
                    );
                    return Err(FrontendError::at("consume", why));
                }
                // A prefill of another model (or a broken one): its token would fail every
                // sequence decoded in the same batch. The instance's fault.
                if p.first_token >= info.vocab {
                    let why = format!(
                        "first token {} outside the vocabulary of {}",
                        p.first_token, info.vocab
                    );
                    return Err(FrontendError::because("consume", Cause::Instance, why));
                }
                let sampling = handoff_prefill_sampling(&plan.sampling);
                let decoder: Box<dyn Decoder> = Box::new(first_token::LoadOnFirstStep::new(
                    self.engine.clone(),
                    p.kv,
                    p.first_token,
                    sampling,
                ));
                Ok((decoder, p.first_token, p.cached_tokens, p.kv_bytes))
            });
            match outcome {
                Ok((decoder, first_token, cached_tokens, kv_bytes)) => {
                    self.reach.reached(&sel.instance_id);
                    stages.timings.consume_us = stages.mark();
                    self.metrics.attempt_stages(&stages.timings);
                    self.metrics.kv_received(kv_bytes);
                    lease.end(Outcome::Success, String::new());
                    let evidence = Evidence {
                        bootstrap_room: room.get(),
                        instance_id: sel.instance_id,
                        dp_rank: sel.dp_rank,
                        stages: Some(stages.timings),
                        failed_attempts: std::mem::take(failed),
                        kv_bytes,
                    };
                    return Ok(Ready { decoder, first_token, cached_tokens, evidence });
                }
                Err(e) => {
                    // Its own time passed before the request's, on an instance whose times
                    // are measured (a handoff prefill's, once its heartbeat said its cost:
                    // the estimate is then at least 1 ms, but for a prompt cached whole,
                    // which is not blamed): it went silent.
                    let own_time_passed = deadline < plan.deadline && Instant::now() >= deadline;
                    let measured = sel.protocol == "handoff" && sel.expected_prefill_ms > 0;
                    let e = match own_time_passed && measured {
                        true => e.overran(),
                        false => e,
                    };
                    // A fault is worth a line each; a refusal, a deadline or bad input is
                    // counted (`handoff_frontend_attempt_failures_total`), not logged above
                    // debug: under a partial outage or a client's short deadlines, a line per
                    // attempt filled disks.
                    match e.cause() {
                        Some(Cause::Instance | Cause::Decode | Cause::Mismatch) | None => {
                            warn!(%room, instance = %sel.instance_id, error = %e, "attempt failed")
                        }
                        Some(Cause::Overloaded | Cause::Deadline | Cause::Invalid) => {
                            debug!(%room, instance = %sel.instance_id, error = %e, "attempt failed")
                        }
                    }
                    if unreachable(&e) && self.reach.failed_at(&sel.instance_id, Instant::now()) {
                        warn!(
                            instance = %sel.instance_id,
                            "this frontend cannot reach the instance: passed over for {:?}",
                            crate::reach::AVOID_FOR
                        );
                    }
                    self.metrics.attempt_failed(&e);
                    lease.end(outcome_of(&e), e.to_string());
                    failed.push(Attempt {
                        bootstrap_room: room.get(),
                        instance_id: sel.instance_id.clone(),
                        dp_rank: sel.dp_rank,
                        stages: Some(stages.timings),
                        error: e.to_string(),
                    });
                    if e.decode_memory_full() {
                        let retry_after = std::time::Duration::from_secs(1);
                        return Err(FrontendError::Overloaded {
                            retry_after,
                            limit: crate::Limit::DecodeMemory,
                            reason: e.to_string(),
                        });
                    }
                    match e.cause() {
                        Some(Cause::Invalid) => return Err(FrontendError::Invalid(e.to_string())),
                        Some(Cause::Deadline) if Instant::now() >= plan.deadline => {
                            return Err(FrontendError::Deadline(summary(failed)));
                        }
                        // A mismatch may be a directory read before the instance restarted
                        // with another topology: read again next time.
                        Some(Cause::Instance | Cause::Mismatch) => {
                            self.directory.invalidate(&sel.instance_id)
                        }
                        _ => {}
                    }
                    exclude.push(sel.instance_id);
                    last = Some(e);
                }
            }
        }
        Err(all_failed(last.and_then(|e| e.cause()), failed))
    }
}
