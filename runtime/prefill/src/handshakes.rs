//! The decode's handshakes carried in the Prefill call (`PrefillRequest.handshakes`), checked
//! and dealt out to the dp rank's senders, which then wait for none over their transfer
//! connections. Only where every sender's backend takes them so
//! ([`handoff_transfer::Agent::handshake_in_call`]).

use handoff_core::Room;
use handoff_proto::v1::TransferHandshake;
use handoff_transfer::{AgentAddr, ConnectRequest, RegionId};

use crate::PrefillError;
use crate::rank::Rank;

/// Handshakes one call may carry at most (a dp rank's senders times the decode's ranks).
pub(crate) const MAX_IN_CALL: usize = 4096;
/// Longest receiver address taken (a host name at most).
const MAX_IP_LEN: usize = 253;

/// `given`, one list per sender of `senders` in their order, each for room `room` of `tokens`
/// prompt tokens; an empty list for each when none was given (they come over the transfer
/// connections). Given any, every sender must have at least one.
pub(crate) fn deal(
    given: Vec<TransferHandshake>,
    senders: &[Rank],
    room: Room,
    tokens: usize,
) -> Result<Vec<Vec<ConnectRequest>>, PrefillError> {
    let mut dealt = vec![Vec::new(); senders.len()];
    if given.is_empty() {
        return Ok(dealt);
    }
    if given.len() > MAX_IN_CALL {
        return Err(invalid(format!("{} handshakes, at most {MAX_IN_CALL}", given.len())));
    }
    if let Some(r) = senders.iter().find(|r| !r.agent.handshake_in_call()) {
        return Err(invalid(format!(
            "this instance's {} transfer takes its handshakes over its own connections",
            r.agent.backend_name()
        )));
    }
    for h in given {
        let at = senders.iter().position(|r| r.tp == h.tp_rank && r.pp == h.pp_rank);
        let Some(at) = at else {
            return Err(invalid(format!(
                "a handshake for tp rank {} pp rank {}, which this dp rank does not have",
                h.tp_rank, h.pp_rank
            )));
        };
        dealt[at].push(connect_request(h, room, tokens)?);
    }
    if let Some(at) = dealt.iter().position(Vec::is_empty) {
        return Err(invalid(format!(
            "no handshake for tp rank {} pp rank {}",
            senders[at].tp, senders[at].pp
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
