//! One attempt at the request path on one prefill instance (DESIGN.md steps 5 to 10):
//! resolve-topology, resolve-rank, register, connect, prefill, verify, consume. Each stage
//! proves only its own step and records when it completed.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::try_join_all;
use handoff_bootstrap::DirectoryCache;
use handoff_bootstrap::RankAddr;
use handoff_bootstrap::mapping::{self, Parallel, RankPlan, RegionLayout};
use handoff_core::Room;
use handoff_engine::{Engine, Kv, KvShape};
use handoff_proto::v1::{PrefillRequest, SamplingParams, StageTimings};
use handoff_transfer::{Agent, Inbox, Received, RegionId, SenderId};
use tokio::time::Instant;

use crate::{Cause, FrontendError};

mod call;
mod connect;
mod peer;
mod verify;

pub use peer::PrefillPeer;

/// When each stage completed, in microseconds since the attempt started.
#[derive(Debug, Clone, Copy)]
pub struct Stages {
    start: Instant,
    /// The timings so far.
    pub timings: StageTimings,
}

impl Stages {
    /// Starts the clock.
    pub fn start() -> Self {
        Stages { start: Instant::now(), timings: StageTimings::default() }
    }

    pub(crate) fn mark(&self) -> u64 {
        self.mark_at(Instant::now())
    }

    /// The stage that ended at `at`.
    pub(crate) fn mark_at(&self, at: Instant) -> u64 {
        (at.saturating_duration_since(self.start).as_micros() as u64).max(1)
    }
}

/// Where this attempt goes.
#[derive(Debug, Clone)]
pub struct Target {
    /// Instance id.
    pub instance: String,
    /// Its dp rank for this request.
    pub dp_rank: u32,
    /// Its directory.
    pub bootstrap_addr: String,
    /// Its Prefill service.
    pub prefill: PrefillPeer,
}

/// The verified result of a successful attempt.
#[derive(Debug)]
pub struct Prefilled {
    /// The whole prompt's KV, reassembled in the engine's layout.
    pub kv: Kv,
    /// First generated token.
    pub first_token: u32,
    /// Prompt tokens the prefill took from its cache.
    pub cached_tokens: u32,
    /// KV bytes received and verified.
    pub kv_bytes: u64,
}

/// Releases a receive region unless it was taken.
struct RegionGuard {
    inbox: Arc<Inbox>,
    id: RegionId,
}

impl Drop for RegionGuard {
    fn drop(&mut self) {
        self.inbox.release(self.id);
    }
}

/// What an attempt needs from the frontend.
pub struct AttemptCtx<'a> {
    /// The decode engine.
    pub engine: &'a dyn Engine,
    /// The frontend's transfer agent.
    pub agent: &'a Agent,
    /// Topology and rank-address cache.
    pub directory: &'a DirectoryCache,
    /// Decode tp size.
    pub decode_tp: usize,
    /// Bearer token for handshakes.
    pub transfer_token: Option<String>,
    /// The request's trace, sent on to the prefill.
    pub trace: handoff_proto::trace::TraceContext,
    /// Where the Prefill call runs (it may end after the attempt has gone on).
    pub tasks: &'a handoff_core::Tasks,
}

/// How much sooner than the attempt's deadline a prefill is told to answer by.
const ANSWER_MARGIN: std::time::Duration = std::time::Duration::from_millis(500);

async fn before<T, E: std::error::Error + 'static>(
    deadline: Instant,
    stage: &'static str,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, FrontendError> {
    within(deadline, stage, async { f.await.map_err(|e| FrontendError::reaching(stage, &e)) }).await
}

/// `f`'s answer, or the attempt's deadline passing at `stage`.
pub(crate) async fn within<T>(
    deadline: Instant,
    stage: &'static str,
    f: impl std::future::Future<Output = Result<T, FrontendError>>,
) -> Result<T, FrontendError> {
    tokio::time::timeout_at(deadline, f).await.unwrap_or_else(|_| {
        Err(FrontendError::because(stage, Cause::Deadline, "attempt deadline passed"))
    })
}

/// Runs one attempt with `room` on `target`.
pub async fn run(
    ctx: &AttemptCtx<'_>,
    target: Target,
    room: Room,
    tokens: &[u32],
    sampling: &SamplingParams,
    deadline: Instant,
    stages: &mut Stages,
) -> Result<Prefilled, FrontendError> {
    let shape = ctx.engine.info().shape;
    let t = tokens.len();
    let d = ctx.decode_tp;

    let prefill = resolve_topology(ctx, &target, deadline).await?;
    stages.timings.resolve_topology_us = stages.mark();

    let ranks = resolve_ranks(ctx, &target, prefill, deadline).await?;
    stages.timings.resolve_rank_us = stages.mark();

    let layout = RegionLayout {
        layers: shape.layers,
        heads: mapping::heads_per_rank(d, shape.kv_heads),
        tokens: t,
        head_bytes: shape.head_bytes,
    };
    let regions = register(ctx, room, prefill, &ranks.plans, &layout)?;
    stages.timings.register_us = stages.mark();

    // connect: each decode rank's handshake with each prefill rank it reads from (see
    // `connect::handshakes`); in the call, the regions need no connection of their own.
    let hs = connect::handshakes(ctx, &target, room, prefill, &ranks, &regions, &layout);
    let (in_call, handshakes, connects) = match hs {
        connect::Handshakes::InCall(given) => {
            for g in &regions {
                ctx.agent.inbox().mark_connected(g.id);
            }
            (true, given, Vec::new())
        }
        connect::Handshakes::OverAgents(connects) => (false, Vec::new(), connects),
    };
    let connected = connect::connected(ctx.agent, connects, deadline);

    // prefill: the request, with the handshakes when they ride in it. Its deadline is a
    // little before the attempt's, so a prefill whose queue held the request past it says so
    // (an overload) before this side's timers take its silence for a hang (its fault).
    let left = deadline.saturating_duration_since(Instant::now());
    let left = left.saturating_sub(ANSWER_MARGIN.min(left / 10));
    let req = PrefillRequest {
        bootstrap_room: room.get(),
        token_ids: tokens.to_vec(),
        dp_rank: target.dp_rank,
        sampling: Some(sampling.clone()),
        // At least 1: 0 says "none given" (30 s).
        deadline_ms: left.as_millis().clamp(1, u128::from(u32::MAX)) as u32,
        handshakes,
        model_fingerprint: ctx.engine.info().fingerprint,
    };
    let request = handoff_proto::trace::traced(
        handoff_proto::auth::request(req, ctx.transfer_token.as_deref()),
        &ctx.trace,
    );
    let mut call = call::PrefillCall::start(ctx.tasks, &target, request, in_call, room, deadline);
    let verified =
        match verify::receive(ctx.agent.inbox(), &regions, &mut call, connected, room, t, deadline)
            .await
        {
            Ok(v) => v,
            Err(e) => {
                call.failed(&e);
                return Err(e);
            }
        };
    call.let_run();
    stages.timings.connect_us = stages.mark_at(verified.connected_at);
    stages.timings.verify_us = stages.mark();

    let verify::Verified { received, first_token, cached_tokens, kv_bytes, .. } = verified;
    let kv = consume(received, shape, &layout, d)?;
    Ok(Prefilled { kv, first_token, cached_tokens, kv_bytes })
}

/// resolve-topology: the instance's parallel sizes, once its pages and dp size fit.
async fn resolve_topology(
    ctx: &AttemptCtx<'_>,
    target: &Target,
    deadline: Instant,
) -> Result<Parallel, FrontendError> {
    let info = ctx.engine.info();
    let server = before(
        deadline,
        "resolve-topology",
        ctx.directory.server_info(&target.instance, &target.bootstrap_addr),
    )
    .await?;
    if server.page_size as usize != info.page_size || server.kv_cache_dtype != "auto" {
        return Err(FrontendError::at(
            "resolve-topology",
            format!(
                "instance pages {} of {:?}, decode needs {} of \"auto\"",
                server.page_size, server.kv_cache_dtype, info.page_size
            ),
        ));
    }
    if i64::from(target.dp_rank) >= server.dp_size {
        return Err(FrontendError::at(
            "resolve-topology",
            format!("dp rank {} outside dp size {}", target.dp_rank, server.dp_size),
        ));
    }
    Ok(Parallel {
        tp: server.attn_tp_size as usize,
        pp: server.pp_size as usize,
        cp: server.attn_cp_size as usize,
    })
}

/// Which prefill ranks each decode rank reads from, and where those ranks are.
struct Ranks {
    /// Per decode tp rank.
    plans: Vec<RankPlan>,
    /// Per prefill (tp, pp) rank read from.
    addrs: BTreeMap<(usize, usize), RankAddr>,
}

/// resolve-rank: every decode rank's plan, and the addresses of the prefill ranks they name.
async fn resolve_ranks(
    ctx: &AttemptCtx<'_>,
    target: &Target,
    prefill: Parallel,
    deadline: Instant,
) -> Result<Ranks, FrontendError> {
    let decode = Parallel { tp: ctx.decode_tp, pp: 1, cp: 1 };
    let plans = (0..ctx.decode_tp)
        .map(|r| mapping::plan_ranks(prefill, decode, r, 0, false))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| FrontendError::at("resolve-rank", e))?;
    let mut needed: Vec<(usize, usize)> = plans.iter().flat_map(senders).collect();
    needed.sort_unstable();
    needed.dedup();
    let lookups = needed.iter().map(|&(tp, pp)| {
        ctx.directory.rank(
            &target.instance,
            &target.bootstrap_addr,
            (target.dp_rank, 0, tp as u32, pp as u32),
        )
    });
    let addrs = before(deadline, "resolve-rank", try_join_all(lookups)).await?;
    Ok(Ranks { plans, addrs: needed.into_iter().zip(addrs).collect() })
}

/// The prefill (tp, pp) ranks `plan` reads from.
fn senders(plan: &RankPlan) -> impl Iterator<Item = (usize, usize)> + '_ {
    plan.tp_ranks.iter().flat_map(|&tp| plan.pp_ranks.iter().map(move |&pp| (tp, pp)))
}

/// register: one receive region per decode rank, each sender allowed exactly its shard's
/// bytes, where the plan puts them.
fn register(
    ctx: &AttemptCtx<'_>,
    room: Room,
    prefill: Parallel,
    plans: &[RankPlan],
    layout: &RegionLayout,
) -> Result<Vec<RegionGuard>, FrontendError> {
    let shape = ctx.engine.info().shape;
    let inbox = ctx.agent.inbox();
    let mut regions = Vec::with_capacity(plans.len());
    for (r, plan) in plans.iter().enumerate() {
        let expected: Vec<(SenderId, Vec<std::ops::Range<u64>>)> = senders(plan)
            .map(|(tp, pp)| {
                let s =
                    mapping::shard(prefill, plans.len(), tp, pp, r, shape.kv_heads, shape.layers);
                (SenderId::new(tp as u16, pp as u16), layout.shard_ranges(&s))
            })
            .collect();
        let id = inbox.register_region(room, layout.len(), expected).map_err(|e| match e {
            // The decode's receive memory is spoken for: overload, not a fault.
            handoff_transfer::TransferError::Full(_) => {
                FrontendError::because("register", Cause::Overloaded, e)
            }
            e => FrontendError::at("register", e),
        })?;
        regions.push(RegionGuard { inbox: inbox.clone(), id });
    }
    Ok(regions)
}

/// consume: the engine's KV from the regions. A single region holding every head is already
/// the engine's layout; several decode ranks' regions are reassembled into it.
fn consume(
    mut received: Vec<Received>,
    shape: KvShape,
    layout: &RegionLayout,
    d: usize,
) -> Result<Kv, FrontendError> {
    if let [only] = &mut received[..]
        && layout.heads == shape.kv_heads
    {
        return Kv::from_bytes(shape, layout.tokens, std::mem::take(&mut only.buf))
            .map_err(|e| FrontendError::at("consume", e));
    }
    // Which region (and which of its heads) each head comes from: the first rank holding it.
    let mut from: Vec<Option<(&Received, usize)>> = vec![None; shape.kv_heads];
    for (r, rec) in received.iter().enumerate() {
        for local in 0..layout.heads {
            let g = mapping::rank_heads(d, shape.kv_heads, r).start + local;
            if let Some(slot @ None) = from.get_mut(g) {
                *slot = Some((rec, local));
            }
        }
    }
    let from: Vec<(&Received, usize)> = from
        .into_iter()
        .collect::<Option<_>>()
        .ok_or_else(|| FrontendError::at("consume", "some KV heads were not received"))?;
    // Appended run by run in the engine's layout, so the buffer is never zeroed first.
    let mut data = Vec::with_capacity(shape.token_bytes() * layout.tokens);
    for l in 0..shape.layers {
        for k in 0..2 {
            for &(rec, local) in &from {
                let off = layout.run_offset(l, k, local) as usize;
                data.extend_from_slice(&rec.buf[off..off + layout.run_len()]);
            }
        }
    }
    Kv::from_bytes(shape, layout.tokens, data).map_err(|e| FrontendError::at("consume", e))
}
