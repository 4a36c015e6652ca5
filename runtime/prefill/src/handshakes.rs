//! The decode's handshakes carried in the Prefill call (`PrefillRequest.handshakes`), checked
//! and dealt out to the dp rank's senders, which then wait for none over their transfer
//! connections. Only where every sender's backend takes them so
//! ([`handoff_transfer::Agent::handshake_in_call`]).

use handoff_bootstrap::mapping::{self, Parallel};
use handoff_core::Room;
use handoff_proto::handshakes::{MAX_IN_CALL, MAX_PER_SENDER};
use handoff_proto::v1::TransferHandshake;
use handoff_transfer::{AgentAddr, ConnectRequest, RegionId};

use crate::PrefillError;
use crate::rank::Rank;

/// Longest receiver address taken (a host name at most).
const MAX_IP_LEN: usize = 253;

/// `given`, one list per sender of `senders` in their order, each for room `room` of `tokens`
/// prompt tokens; an empty list for each when none was given (they come over the transfer
/// connections). Given any, all name one decode tp size compatible with `par`, and every
/// sender has exactly one per decode rank that reads from it (at most
/// [`MAX_PER_SENDER`]), none twice. Handshakes this
/// instance cannot take (a transfer that takes none in the call, a rank it does not have) are
/// a [`PrefillError::Mismatch`]; malformed ones are invalid.
pub(crate) fn deal(
    given: Vec<TransferHandshake>,
    senders: &[Rank],
    par: Parallel,
    room: Room,
    tokens: usize,
) -> Result<Vec<Vec<ConnectRequest>>, PrefillError> {
    let mut dealt = vec![Vec::new(); senders.len()];
    let Some(first) = given.first() else { return Ok(dealt) };
    if given.len() > MAX_IN_CALL {
        return Err(invalid(format!("{} handshakes, at most {MAX_IN_CALL}", given.len())));
    }
    if let Some(r) = senders.iter().find(|r| !r.agent.handshake_in_call()) {
        return Err(mismatch(format!(
            "this instance's {} transfer takes its handshakes over its own connections",
            r.agent.backend_name()
        )));
    }
    let d = first.dst_tp_size as usize;
    if !mapping::tp_compatible(d, par.tp) {
        return Err(invalid(format!("decode tp {d} does not divide with prefill tp {}", par.tp)));
    }
    let peers = mapping::readers_per_sender(d, par.tp);
    if peers > MAX_PER_SENDER {
        return Err(invalid(format!(
            "decode tp {d} needs {peers} handshakes per rank, at most {MAX_PER_SENDER}"
        )));
    }
    for h in given {
        if h.dst_tp_size as usize != d || h.dst_tp_rank as usize >= d {
            return Err(invalid(format!(
                "decode rank {} of tp {}, another said tp {d}",
                h.dst_tp_rank, h.dst_tp_size
            )));
        }
        let at = senders.iter().position(|r| r.tp == h.tp_rank && r.pp == h.pp_rank);
        let Some(at) = at else {
            return Err(mismatch(format!(
                "a handshake for tp rank {} pp rank {}, which this dp rank does not have",
                h.tp_rank, h.pp_rank
            )));
        };
        let decode = Parallel { tp: d, pp: 1, cp: 1 };
        let plan = mapping::plan_ranks(par, decode, h.dst_tp_rank as usize, 0, false)
            .map_err(|e| invalid(e.to_string()))?;
        if !plan.tp_ranks.contains(&(h.tp_rank as usize)) {
            return Err(invalid(format!(
                "decode rank {} does not read from tp rank {}",
                h.dst_tp_rank, h.tp_rank
            )));
        }
        if dealt[at].iter().any(|c: &ConnectRequest| c.dst_tp_rank == h.dst_tp_rank) {
            return Err(invalid(format!(
                "two handshakes of decode rank {} for tp rank {} pp rank {}",
                h.dst_tp_rank, h.tp_rank, h.pp_rank
            )));
        }
        dealt[at].push(connect_request(h, room, tokens)?);
    }
    if let Some(at) = dealt.iter().position(|hs| hs.len() != peers) {
        return Err(invalid(format!(
            "{} handshakes for tp rank {} pp rank {}, decode tp {d} needs {peers}",
            dealt[at].len(),
            senders[at].tp,
            senders[at].pp
        )));
    }
    Ok(dealt)
}

/// The request a handshake over a transfer connection would have carried. The bearer token
/// is the call's, already checked.
fn connect_request(
    h: TransferHandshake,
    room: Room,
    tokens: usize,
) -> Result<ConnectRequest, PrefillError> {
    let port = u16::try_from(h.receiver_port)
        .ok()
        .filter(|&p| p != 0)
        .ok_or_else(|| invalid(format!("receiver port {}", h.receiver_port)))?;
    if h.receiver_ip.is_empty() || h.receiver_ip.len() > MAX_IP_LEN {
        return Err(invalid(format!("a receiver address of {} bytes", h.receiver_ip.len())));
    }
    Ok(ConnectRequest {
        room,
        receiver: AgentAddr { ip: h.receiver_ip, port },
        region: RegionId(h.region),
        region_len: h.region_len,
        dst_tp_size: h.dst_tp_size,
        dst_tp_rank: h.dst_tp_rank,
        tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
        token: None,
    })
}

fn invalid(why: String) -> PrefillError {
    PrefillError::Invalid(format!("handshakes: {why}"))
}

fn mismatch(why: String) -> PrefillError {
    PrefillError::Mismatch(format!("handshakes: {why}"))
}
