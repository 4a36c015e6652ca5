//! The connect stage: the decode's handshakes with the prefill ranks it reads from.

use futures::future::try_join_all;
use handoff_bootstrap::mapping::{self, Parallel, RegionLayout};
use handoff_core::Room;
use handoff_proto::v1::TransferHandshake;
use handoff_transfer::{Agent, AgentAddr, ConnectRequest, RegionId};
use tokio::time::Instant;

use super::{AttemptCtx, Ranks, RegionGuard, Target, peer, senders};
use crate::{Cause, FrontendError};

/// When every one of `connects` was acknowledged, or the first failure, or the deadline.
/// Connecting runs alongside the Prefill call, not before it: the prefill waits for the
/// handshakes while it computes (up to its handshake timeout), so asking both at once saves a
/// round trip. A failed handshake fails the attempt, which aborts the call.
pub(super) async fn connected(
    agent: &Agent,
    connects: Vec<(AgentAddr, ConnectRequest)>,
    deadline: Instant,
) -> Result<Instant, FrontendError> {
    let acks =
        connects.into_iter().map(|(peer, req)| async move { agent.connect(&peer, req).await });
    match tokio::time::timeout_at(deadline, try_join_all(acks)).await {
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
}

/// How an attempt's handshakes go (see [`handshakes`]).
pub(super) enum Handshakes {
    /// All in the Prefill call.
    InCall(Vec<TransferHandshake>),
    /// One connect per (decode rank, prefill rank) pair over that prefill rank's agent.
    OverAgents(Vec<(AgentAddr, ConnectRequest)>),
}

/// The attempt's handshakes: all in the Prefill call when the instance said it takes them
/// there, our backend's handshake is nothing more, and every rank is on this host (no
/// connection of its own then); else over each prefill rank's agent. Across hosts the
/// handshake's quick answer (or its absence, within a second) is also how a lost path fails
/// an attempt fast.
pub(super) fn handshakes(
    ctx: &AttemptCtx<'_>,
    target: &Target,
    room: Room,
    prefill: Parallel,
    ranks: &Ranks,
    regions: &[RegionGuard],
    layout: &RegionLayout,
) -> Handshakes {
    let d = ctx.decode_tp;
    let pairs: Vec<(usize, RegionId, usize, usize)> = ranks
        .plans
        .iter()
        .zip(regions)
        .enumerate()
        .flat_map(|(r, (plan, g))| senders(plan).map(move |(tp, pp)| (r, g.id, tp, pp)))
        .collect();
    let receiver = ctx.agent.addr();
    let in_call = ctx.agent.handshake_in_call()
        && pairs.len() <= handoff_proto::handshakes::MAX_IN_CALL
        && mapping::readers_per_sender(d, prefill.tp) <= handoff_proto::handshakes::MAX_PER_SENDER
        && ranks.addrs.values().all(|a| peer::same_host(&a.rank_ip, &receiver.ip))
        && target.prefill.takes_handshakes(&target.instance);
    if in_call {
        let given = pairs
            .iter()
            .map(|&(r, region, tp, pp)| TransferHandshake {
                tp_rank: tp as u32,
                pp_rank: pp as u32,
                receiver_ip: receiver.ip.clone(),
                receiver_port: u32::from(receiver.port),
                region: region.0,
                region_len: layout.len(),
                dst_tp_size: d as u32,
                dst_tp_rank: r as u32,
            })
            .collect();
        return Handshakes::InCall(given);
    }
    let connects = pairs
        .iter()
        .map(|&(r, region, tp, pp)| {
            let a = &ranks.addrs[&(tp, pp)];
            let peer = AgentAddr { ip: a.rank_ip.clone(), port: a.rank_port };
            let req = ConnectRequest {
                room,
                receiver: receiver.clone(),
                region,
                region_len: layout.len(),
                dst_tp_size: d as u32,
                dst_tp_rank: r as u32,
                tokens: layout.tokens as u32,
                token: ctx.transfer_token.clone(),
            };
            (peer, req)
        })
        .collect();
    Handshakes::OverAgents(connects)
}
