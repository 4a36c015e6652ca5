//! One attempt at the request path on one prefill instance (DESIGN.md steps 5 to 10):
//! resolve-topology, resolve-rank, register, connect, prefill, verify, consume. Each stage
//! proves only its own step and records when it completed.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::try_join_all;
use handoff_bootstrap::DirectoryCache;
use handoff_bootstrap::mapping::{self, Parallel, RegionLayout};
use handoff_core::Room;
use handoff_engine::{Engine, Kv};
use handoff_proto::v1::{PrefillRequest, SamplingParams, StageTimings, TransferHandshake};
use handoff_transfer::{Agent, ConnectRequest, Inbox, RegionId, SenderId};
use tokio::time::Instant;

use crate::{Cause, FrontendError};

mod call;
mod peer;

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

async fn before<T, E: std::fmt::Display>(
    deadline: Instant,
    stage: &'static str,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, FrontendError> {
    within(deadline, stage, async { f.await.map_err(|e| FrontendError::at(stage, e)) }).await
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
    let info = ctx.engine.info();
    let shape = info.shape;
    let t = tokens.len();
    let d = ctx.decode_tp;

    // resolve-topology
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
    let prefill = Parallel {
        tp: server.attn_tp_size as usize,
        pp: server.pp_size as usize,
        cp: server.attn_cp_size as usize,
    };
    stages.timings.resolve_topology_us = stages.mark();

    // resolve-rank
    let decode = Parallel { tp: d, pp: 1, cp: 1 };
    let plans = (0..d)
        .map(|r| mapping::plan_ranks(prefill, decode, r, 0, false))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| FrontendError::at("resolve-rank", e))?;
    let mut needed: Vec<(usize, usize)> = plans
        .iter()
        .flat_map(|p| p.tp_ranks.iter().flat_map(|&tp| p.pp_ranks.iter().map(move |&pp| (tp, pp))))
        .collect();
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
    let addrs: BTreeMap<(usize, usize), _> = needed.iter().copied().zip(addrs).collect();
    stages.timings.resolve_rank_us = stages.mark();

    // register
    let layout = RegionLayout {
        layers: shape.layers,
        heads: mapping::heads_per_rank(d, shape.kv_heads),
        tokens: t,
        head_bytes: shape.head_bytes,
    };
    let inbox = ctx.agent.inbox();
    let mut regions = Vec::with_capacity(d);
    for (r, plan) in plans.iter().enumerate() {
        // Each sender may write exactly its shard's bytes, where the plan puts them.
        let expected: Vec<(SenderId, Vec<std::ops::Range<u64>>)> = plan
            .tp_ranks
            .iter()
            .flat_map(|&tp| plan.pp_ranks.iter().map(move |&pp| (tp, pp)))
            .map(|(tp, pp)| {
                let s = mapping::shard(prefill, d, tp, pp, r, shape.kv_heads, shape.layers);
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
    stages.timings.register_us = stages.mark();

    // connect: each decode rank's handshake with each prefill rank it reads from, in the
    // Prefill call when the instance said it takes them there, our backend's handshake is
    // nothing more, and every rank is on this host (no connection of its own then), else
    // over each prefill rank's agent. Across hosts the handshake's quick answer (or its
    // absence, within a second) is also how a lost path fails an attempt fast.
    let pairs: Vec<(usize, RegionId, usize, usize)> = plans
        .iter()
        .enumerate()
        .flat_map(|(r, plan)| {
            let region = regions[r].id;
            plan.tp_ranks
                .iter()
                .flat_map(move |&tp| plan.pp_ranks.iter().map(move |&pp| (r, region, tp, pp)))
        })
        .collect();
    let receiver = ctx.agent.addr();
    let per_sender = (d / prefill.tp).max(1);
    let in_call = ctx.agent.handshake_in_call()
        && pairs.len() <= handoff_proto::handshakes::MAX_IN_CALL
        && per_sender <= handoff_proto::handshakes::MAX_PER_SENDER
        && addrs.values().all(|a| peer::same_host(&a.rank_ip, &receiver.ip))
        && target.prefill.takes_handshakes(&target.instance);
    let mut handshakes = Vec::new();
    let mut connects = Vec::new();
    for &(r, region, tp, pp) in &pairs {
        if in_call {
            handshakes.push(TransferHandshake {
                tp_rank: tp as u32,
                pp_rank: pp as u32,
                receiver_ip: receiver.ip.clone(),
                receiver_port: u32::from(receiver.port),
                region: region.0,
                region_len: layout.len(),
                dst_tp_size: d as u32,
                dst_tp_rank: r as u32,
            });
            continue;
        }
        let a = &addrs[&(tp, pp)];
        let peer = handoff_transfer::AgentAddr { ip: a.rank_ip.clone(), port: a.rank_port };
        let req = ConnectRequest {
            room,
            receiver: receiver.clone(),
            region,
            region_len: layout.len(),
            dst_tp_size: d as u32,
            dst_tp_rank: r as u32,
            tokens: t as u32,
            token: ctx.transfer_token.clone(),
        };
        connects.push(async move { ctx.agent.connect(&peer, req).await });
    }
    if in_call {
        for g in &regions {
            inbox.mark_connected(g.id);
        }
    }
    // Connecting runs alongside the prefill call below, not before it: the prefill waits for
    // the handshakes while it computes (up to its handshake timeout), so asking both at once
    // saves a round trip. A failed handshake fails the attempt, which aborts the call.
    let connecting = try_join_all(connects);
    let connected = async move {
        match tokio::time::timeout_at(deadline, connecting).await {
            Ok(r) => r.map_err(|e| FrontendError::transfer("connect", e))?,
            Err(_) => {
                return Err(FrontendError::because(
                    "connect",
                    Cause::Deadline,
                    "attempt deadline passed",
                ));
            }
        };
        Ok(Instant::now())
    };

    // prefill, and the KV it sends
    let left = deadline.saturating_duration_since(Instant::now());
    let req = PrefillRequest {
        bootstrap_room: room.get(),
        token_ids: tokens.to_vec(),
        dp_rank: target.dp_rank,
        sampling: Some(sampling.clone()),
        deadline_ms: left.as_millis().min(u128::from(u32::MAX)) as u32,
        handshakes,
    };
    let request = handoff_proto::trace::traced(
        handoff_proto::auth::request(req, ctx.transfer_token.as_deref()),
        &ctx.trace,
    );
    // The attempt goes on once the KV is verified (its notices carry the first token), not
    // when the call answers (see `call`). A call that fails first (a refusal, an error) fails
    // the attempt, unless the handshakes fail too: theirs then names the failure (a prefill
    // this frontend cannot reach fails both, and `reach` counts connect failures).
    let mut call = call::PrefillCall::start(ctx.tasks, &target, request, in_call, room, deadline);
    let waits = async {
        let w = regions.iter().map(|g| inbox.wait(g.id, deadline));
        try_join_all(w).await.map_err(|e| FrontendError::transfer("verify", e))
    };
    tokio::pin!(connected, waits);
    let receiving = async {
        let mut connected_at = None;
        let received = loop {
            tokio::select! {
                c = &mut connected, if connected_at.is_none() => connected_at = Some(c?),
                w = &mut waits => break w?,
                a = call.answer(), if call.is_out() => {
                    if let Err(e) = a {
                        if connected_at.is_none() {
                            (&mut connected).await?;
                        }
                        return Err(e);
                    }
                }
            }
        };
        let connected_at = match connected_at {
            Some(at) => at,
            None => (&mut connected).await?,
        };
        // verify: every notice of every region names our room and our prompt, and all agree
        // on the first token and the cached prefix.
        let said = agreed_notices(&received, room, t)?;
        Ok((received, connected_at, said))
    };
    let (mut received, connected_at, (said, kv_bytes)) = match receiving.await {
        Ok(r) => r,
        Err(e) => {
            call.failed(&e);
            return Err(e);
        }
    };
    call.let_run();
    stages.timings.connect_us = stages.mark_at(connected_at);

    let (first_token, cached_tokens) = said;
    stages.timings.verify_us = stages.mark();

    // consume: a single region holding every head is already the engine's layout; several
    // decode ranks' regions are reassembled into it.
    if let [only] = &mut received[..]
        && layout.heads == shape.kv_heads
    {
        let kv = Kv::from_bytes(shape, t, std::mem::take(&mut only.buf))
            .map_err(|e| FrontendError::at("consume", e))?;
        return Ok(Prefilled { kv, first_token, cached_tokens, kv_bytes });
    }
    let mut kv = Kv::zeroed(shape, t);
    let mut filled = vec![false; shape.kv_heads];
    for (r, rec) in received.iter().enumerate() {
        for local in 0..layout.heads {
            let g = mapping::rank_heads(d, shape.kv_heads, r).start + local;
            if g >= shape.kv_heads || filled[g] {
                continue;
            }
            filled[g] = true;
            for l in 0..shape.layers {
                for k in 0..2 {
                    let off = layout.run_offset(l, k, local) as usize;
                    kv.run_mut(l, k, g).copy_from_slice(&rec.buf[off..off + layout.run_len()]);
                }
            }
        }
    }
    if filled.iter().any(|f| !f) {
        return Err(FrontendError::at("consume", "some KV heads were not received"));
    }
    Ok(Prefilled { kv, first_token, cached_tokens, kv_bytes })
}

/// Checks that every notice of `received` names `room` and `tokens` tokens and that all say
/// the same first token and cached prefix: those, and the bytes verified.
fn agreed_notices(
    received: &[handoff_transfer::Received],
    room: Room,
    tokens: usize,
) -> Result<((u32, u32), u64), FrontendError> {
    let mut said = None;
    let mut kv_bytes = 0;
    for rec in received {
        for n in &rec.notices {
            if n.room != room || rec.room != room {
                return Err(FrontendError::at(
                    "verify",
                    format!("bootstrap_room mismatch: expected {room}, got {}", n.room),
                ));
            }
            if n.tokens as usize != tokens {
                return Err(FrontendError::at(
                    "verify",
                    format!("a notice says {} tokens, the prompt has {tokens}", n.tokens),
                ));
            }
            let this = (n.first_token, n.cached_tokens);
            if *said.get_or_insert(this) != this {
                return Err(FrontendError::at(
                    "verify",
                    format!(
                        "notices disagree: first token and cached prefix {said:?}, then {this:?}"
                    ),
                ));
            }
            kv_bytes += n.bytes;
        }
    }
    let said = said.ok_or_else(|| FrontendError::at("verify", "no notice"))?;
    Ok((said, kv_bytes))
}

#[cfg(test)]
mod tests {
    use handoff_transfer::{Notice, Received};

    use super::*;

    fn notice(room: Room, first_token: u32, cached_tokens: u32) -> Notice {
        Notice {
            room,
            sender: SenderId::new(0, 0),
            first_token,
            tokens: 4,
            cached_tokens,
            bytes: 10,
            checksum: 0,
        }
    }

    fn received(room: Room, notices: Vec<Notice>) -> Vec<Received> {
        vec![Received { room, buf: Vec::new(), notices }]
    }

    #[test]
    fn the_notices_must_name_the_room_and_prompt_and_agree() {
        let room = Room::mint();
        let ok = received(room, vec![notice(room, 7, 2), notice(room, 7, 2)]);
        assert_eq!(agreed_notices(&ok, room, 4).unwrap(), ((7, 2), 20));
        let disagree = received(room, vec![notice(room, 7, 2), notice(room, 8, 2)]);
        assert!(agreed_notices(&disagree, room, 4).unwrap_err().to_string().contains("disagree"));
        let cached_differs = received(room, vec![notice(room, 7, 2), notice(room, 7, 3)]);
        assert!(agreed_notices(&cached_differs, room, 4).is_err(), "the cached prefix too");
        let other = Room::mint();
        let foreign = received(room, vec![notice(other, 7, 2)]);
        let err = agreed_notices(&foreign, room, 4).unwrap_err().to_string();
        assert!(err.contains("bootstrap_room mismatch"), "{err}");
        assert!(agreed_notices(&ok, room, 5).is_err(), "another prompt length");
        assert!(agreed_notices(&received(room, vec![]), room, 4).is_err(), "no notice");
    }
}
