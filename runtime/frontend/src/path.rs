//! [`Frontend`]: the request path around attempts: ask the scheduler, mint a fresh room,
//! run the attempt, and on failure before the first token retry on another instance.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use handoff_bootstrap::{DirectoryCache, DirectoryClient};
use handoff_core::{Room, Tasks, block_hashes};
use handoff_discovery::{Registry, Role, Update};
use handoff_engine::{Decoder, Engine};
use handoff_proto::v1::prefill_client::PrefillClient;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use handoff_proto::v1::{Attempt, Evidence, ReportOutcomeRequest, SelectPrefillRequest};
use handoff_transfer::Agent;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};
use tracing::{debug, warn};

use crate::attempt::{self, AttemptCtx, Stages, Target};
use crate::input::Plan;
use crate::{FrontendConfig, FrontendError};

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
    scheduler: SchedulerClient<Channel>,
    prefills: Mutex<HashMap<String, PrefillClient<Channel>>>,
    pub(crate) tasks: Tasks,
    pub(crate) limit: Arc<Semaphore>,
    pub(crate) metrics: Metrics,
}

/// Counters served at `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    pub(crate) requests: std::sync::atomic::AtomicU64,
    pub(crate) failed: std::sync::atomic::AtomicU64,
    pub(crate) tokens: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frontend")
            .field("cfg", &self.cfg)
            .field("agent", &self.agent)
            .finish_non_exhaustive()
    }
}

fn channel(addr: &str) -> Result<Channel, FrontendError> {
    let ep = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| FrontendError::Invalid(format!("address {addr:?}: {e}")))?;
    Ok(ep.tcp_nodelay(true).connect_lazy())
}

const MAX_PREFILL_CLIENTS: usize = 4096;

impl Frontend {
    /// A frontend that asks the scheduler at `scheduler_addr` (host:port); its transfer
    /// agent and reports run on `tasks`.
    pub async fn new(
        cfg: FrontendConfig,
        engine: Arc<dyn Engine>,
        scheduler_addr: &str,
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
        let agent = cfg
            .transfer
            .start(cfg.inbox.clone(), tasks, None)
            .await
            .map_err(|e| FrontendError::Invalid(format!("transfer agent: {e}")))?;
        let scheduler = SchedulerClient::new(channel(scheduler_addr)?);
        Ok(Arc::new(Frontend {
            limit: Arc::new(Semaphore::new(cfg.max_concurrent)),
            cfg,
            engine,
            agent,
            directory: DirectoryCache::new(DirectoryClient::default()),
            scheduler,
            prefills: Mutex::default(),
            tasks: tasks.clone(),
            metrics: Metrics::default(),
        }))
    }

    /// Follows the prefill instances in `registry` on the frontend's tasks: an instance that
    /// leaves or registers again loses its cached topology and rank addresses.
    pub async fn follow(
        self: &Arc<Self>,
        registry: Arc<dyn Registry>,
    ) -> Result<(), FrontendError> {
        let mut updates = registry
            .watch(Role::Prefill)
            .await
            .map_err(|e| FrontendError::Unavailable(e.to_string()))?;
        let (me, t) = (self.clone(), self.tasks.clone());
        self.tasks.spawn(async move {
            loop {
                let u = tokio::select! {
                    _ = t.shutdown_requested() => break,
                    u = updates.next() => match u { Some(u) => u, None => break },
                };
                match u {
                    Update::Reset(_) => me.directory.clear(),
                    Update::Add(i) => me.directory.invalidate(i.id.as_str()),
                    Update::Remove(id) => me.directory.invalidate(id.as_str()),
                }
            }
        });
        Ok(())
    }

    /// The model this frontend serves.
    pub fn model_name(&self) -> &str {
        &self.engine.info().name
    }

    /// The frontend's transfer agent.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    fn prefill_client(&self, addr: &str) -> Result<PrefillClient<Channel>, FrontendError> {
        let mut map = self.prefills.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        if map.len() >= MAX_PREFILL_CLIENTS {
            map.clear();
        }
        let c = PrefillClient::new(channel(addr)?).max_decoding_message_size(64 << 20);
        map.insert(addr.to_owned(), c.clone());
        Ok(c)
    }

    fn report(
        &self,
        instance: String,
        dp_rank: u32,
        work: (u32, u32),
        error: Option<&FrontendError>,
    ) {
        let mut client = self.scheduler.clone();
        // Registering receive memory and loading the KV are the decode's own steps: their
        // failures must not open the prefill's circuit breaker.
        let decode_fault =
            matches!(error, Some(FrontendError::Attempt { stage: "register" | "consume", .. }));
        let req = ReportOutcomeRequest {
            instance_id: instance,
            dp_rank,
            success: error.is_none(),
            prompt_tokens: work.0,
            cached_blocks: work.1,
            error: error.map(ToString::to_string).unwrap_or_default(),
            decode_fault,
        };
        self.tasks.spawn(async move {
            if let Err(e) = client.report_outcome(req).await {
                debug!(error = %e, "outcome not reported");
            }
        });
    }

    fn backoff(&self, failures: usize) -> std::time::Duration {
        let base = self.cfg.backoff.as_secs_f64() * 1.5f64.powi(failures.saturating_sub(1) as i32);
        let jittered = base.min(self.cfg.max_backoff.as_secs_f64()) * rand::random_range(0.8..1.2);
        std::time::Duration::from_secs_f64(jittered)
    }

    /// Runs attempts until one yields verified KV loaded into a decoder, or the attempts,
    /// the instances or the deadline run out.
    pub async fn prefill(&self, plan: &Plan) -> Result<Ready, FrontendError> {
        let info = self.engine.info();
        let hashes: Vec<u64> =
            block_hashes(&plan.tokens, info.page_size).into_iter().map(|h| h.0).collect();
        let prompt_tokens = plan.tokens.len() as u32;
        let ctx = AttemptCtx {
            engine: &*self.engine,
            agent: &self.agent,
            directory: &self.directory,
            decode_tp: self.cfg.decode_tp as usize,
            transfer_token: self.cfg.transfer_token.clone(),
        };
        let mut failed: Vec<Attempt> = Vec::new();
        let mut exclude: Vec<String> = Vec::new();
        for _ in 0..self.cfg.max_attempts {
            if !failed.is_empty() {
                let wake = (Instant::now() + self.backoff(failed.len())).min(plan.deadline);
                tokio::time::sleep_until(wake).await;
            }
            if Instant::now() >= plan.deadline {
                return Err(FrontendError::Deadline(summary(&failed)));
            }
            let select = SelectPrefillRequest {
                block_hashes: hashes.clone(),
                prompt_tokens,
                policy: plan.policy as i32,
                exclude_instances: exclude.clone(),
            };
            let sel = match tokio::time::timeout_at(
                plan.deadline,
                self.scheduler.clone().select_prefill(select),
            )
            .await
            {
                Err(_) => return Err(FrontendError::Deadline(summary(&failed))),
                Ok(Ok(r)) => r.into_inner(),
                Ok(Err(s)) if s.code() == tonic::Code::InvalidArgument => {
                    return Err(FrontendError::Invalid(s.message().to_owned()));
                }
                Ok(Err(s)) if failed.is_empty() => {
                    return Err(FrontendError::Unavailable(format!("scheduler: {}", s.message())));
                }
                Ok(Err(s)) => {
                    debug!(error = %s.message(), "no other instance to retry on");
                    break;
                }
            };
            // What the selection queued on the instance, for the report that takes it off.
            let work = (prompt_tokens, sel.cached_blocks);
            let room = Room::mint();
            let mut stages = Stages::start();
            let deadline = plan.deadline.min(Instant::now() + self.cfg.attempt_timeout);
            let result = match self.prefill_client(&sel.prefill_addr) {
                Ok(prefill) => {
                    let target = Target {
                        instance: sel.instance_id.clone(),
                        dp_rank: sel.dp_rank,
                        bootstrap_addr: sel.bootstrap_addr.clone(),
                        prefill,
                    };
                    attempt::run(
                        &ctx,
                        target,
                        room,
                        &plan.tokens,
                        &plan.sampling,
                        deadline,
                        &mut stages,
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            let outcome = result.and_then(|p| {
                let sampling = handoff_prefill_sampling(&plan.sampling);
                let decoder = self
                    .engine
                    .decoder(p.kv, p.first_token, &sampling)
                    .map_err(|e| FrontendError::at("consume", e))?;
                Ok((decoder, p.first_token, p.cached_tokens, p.kv_bytes))
            });
            match outcome {
                Ok((decoder, first_token, cached_tokens, kv_bytes)) => {
                    stages.timings.consume_us = stages.mark();
                    self.report(sel.instance_id.clone(), sel.dp_rank, work, None);
                    let evidence = Evidence {
                        bootstrap_room: room.get(),
                        instance_id: sel.instance_id,
                        dp_rank: sel.dp_rank,
                        stages: Some(stages.timings),
                        failed_attempts: failed,
                        kv_bytes,
                    };
                    return Ok(Ready { decoder, first_token, cached_tokens, evidence });
                }
                Err(e) => {
                    warn!(%room, instance = %sel.instance_id, error = %e, "attempt failed; retrying elsewhere");
                    self.report(sel.instance_id.clone(), sel.dp_rank, work, Some(&e));
                    self.directory.invalidate(&sel.instance_id);
                    exclude.push(sel.instance_id.clone());
                    failed.push(Attempt {
                        bootstrap_room: room.get(),
                        instance_id: sel.instance_id,
                        dp_rank: sel.dp_rank,
                        stages: Some(stages.timings),
                        error: e.to_string(),
                    });
                }
            }
        }
        Err(FrontendError::Unavailable(summary(&failed)))
    }
}

fn handoff_prefill_sampling(s: &handoff_proto::v1::SamplingParams) -> handoff_engine::Sampling {
    handoff_engine::Sampling {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        seed: s.seed,
    }
}

fn summary(failed: &[Attempt]) -> String {
    if failed.is_empty() {
        return "no attempt made".into();
    }
    failed
        .iter()
        .map(|a| format!("[{} room {}: {}]", a.instance_id, a.bootstrap_room, a.error))
        .collect::<Vec<_>>()
        .join(" ")
}
